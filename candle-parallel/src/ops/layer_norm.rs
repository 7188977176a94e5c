//! LayerNorm over the last dimension, plain (PyTorch's `layer_norm` with an optional weight and
//! bias) or with DiT's adaLN modulation (`norm(x) · (1 + scale) + shift`, a scale and a shift per
//! sample): one custom op with a one-pass backward on the CPU, a composite of differentiable
//! candle ops elsewhere.
//!
//! Why a kernel: candle has no differentiable LayerNorm (its fused `layer_norm` drops
//! gradients), and the composite is a chain of about ten tensor ops (`mean`, `sub`, `sqr`,
//! `mean`, `add`, `sqrt`, `div`, then the modulation's `add`, `mul`, `add`), each a full pass
//! over the activations with a freshly allocated (page-zeroed) result, and about twice as many in
//! its autograd backward. The kernel reads a row while it sits in L1 and writes one result per
//! pass: the forward writes the output, the backward the gradients of x, the scale and the shift
//! together.
//!
//! # Rounding
//! - The statistics are computed in f64 from the f32 values of x: the mean as an f64 sum, the
//!   variance two-pass (`mean((x - mean)²)`, f64), `r = 1 / sqrt(var + eps)` in f64. The
//!   normalised value `(x - mean) · r` is evaluated in f64 and rounded once to f32, so its error
//!   is half an f32 ulp of itself whatever the conditioning. The composite (and PyTorch) round
//!   the mean to f32 before subtracting it: every centred value then carries an error of about
//!   `|mean| · u` (u = 2^-24), relative to the row's spread `κ · u` with `κ = |mean| / std`, the
//!   condition number of the centring, besides the f32 sums' `hidden · u` growth.
//! - The affine part is then applied in f32 as the composite does: `n · scale + shift`
//!   (`n · (1 + scale) + shift` for the modulation, `1 + scale` in f32), each product and sum
//!   rounded to f32, and the result rounded once to x's dtype (f32, bf16, f16).
//! - Backward: the same f64 statistics; `dx = r · (dn - mean(dn) - n · mean(dn · n))` with
//!   `dn = g · scale` (f32 product), the two means and the formula in f64, rounded once to the
//!   dtype. The scale's and shift's gradients (`Σ g · n`, `Σ g` over each group's rows) are
//!   summed in f64 over blocks of rows whose bounds depend only on the shape (deterministic
//!   whatever the thread count) and rounded once to the dtype.

use super::{all_cpu, check_float, dispatch_float, strided, Elem};
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use rayon::prelude::*;

/// LayerNorm over the last dimension, as PyTorch's `layer_norm`:
/// `(x - mean) / sqrt(var + eps) · weight + bias` (biased variance), computed in f32 from x's
/// values with the statistics in f64 (see the module docs of `ops::layer_norm`) and rounded once to x's
/// dtype.
///
/// - `x`: `(..., hidden)`, f32, bf16 or f16, any strides.
/// - `weight`, `bias`: `(hidden)` in x's dtype, each optional (PyTorch's
///   `elementwise_affine=False` has neither).
/// - Returns x's shape and dtype, differentiable with respect to x, weight and bias.
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let op = check_plain(x, weight, bias, eps)?;
    apply(op, x, weight, bias)
}

/// [`layer_norm`] from differentiable candle ops, on any device (what it runs off the CPU;
/// public so that tests can run it on the CPU). Same validation and errors.
#[doc(hidden)]
pub fn layer_norm_composite(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let op = check_plain(x, weight, bias, eps)?;
    composite(op, x, weight, bias)
}

/// adaLN modulation of a parameter-free LayerNorm (DiT):
/// `layer_norm(x) · (1 + scale) + shift`, one scale and shift per sample, computed in f32 with
/// the statistics in f64 (see the module docs of `ops::layer_norm`) and rounded once to x's dtype.
///
/// - `x`: `(batch, ..., hidden)`, f32, bf16 or f16, any strides.
/// - `shift`, `scale`: `(batch, hidden)` in x's dtype (any strides: DiT's are chunks of one
///   projection), applied to every row of their sample.
/// - Returns x's shape and dtype, differentiable with respect to x, shift and scale.
pub fn layer_norm_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    let op = check_modulate(x, shift, scale, eps)?;
    apply(op, x, Some(scale), Some(shift))
}

/// [`layer_norm_modulate`] from differentiable candle ops, on any device (public so that tests
/// can run it on the CPU). Same validation and errors.
#[doc(hidden)]
pub fn layer_norm_modulate_composite(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let op = check_modulate(x, shift, scale, eps)?;
    composite(op, x, Some(scale), Some(shift))
}

fn apply(
    op: LayerNorm,
    x: &Tensor,
    scale: Option<&Tensor>,
    shift: Option<&Tensor>,
) -> Result<Tensor> {
    let mut all = vec![x];
    all.extend(scale);
    all.extend(shift);
    if !all_cpu(&all) {
        return composite(op, x, scale, shift);
    }
    match (scale, shift) {
        (None, None) => x.apply_op1(op),
        (Some(p), None) | (None, Some(p)) => x.apply_op2(p, op),
        (Some(s), Some(b)) => x.apply_op3(s, b, op),
    }
}

/// `(groups, hidden)` parameters reshaped to broadcast over x `(groups, ..., hidden)` in f32.
fn per_group(p: &Tensor, x: &Tensor, groups: usize) -> Result<Tensor> {
    let hidden = x.dim(D::Minus1)?;
    let mut dims = vec![1; x.rank()];
    dims[x.rank() - 1] = hidden;
    if x.rank() > 1 {
        dims[0] = groups;
    }
    p.to_dtype(DType::F32)?.reshape(dims)
}

fn composite(
    op: LayerNorm,
    x: &Tensor,
    scale: Option<&Tensor>,
    shift: Option<&Tensor>,
) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let centred = x32.broadcast_sub(&x32.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let mut y = centred.broadcast_div(&(var + op.eps)?.sqrt()?)?;
    if let Some(s) = scale {
        let mut s = per_group(s, x, op.groups)?;
        if op.unit_offset {
            s = (s + 1.0)?;
        }
        y = y.broadcast_mul(&s)?;
    }
    if let Some(b) = shift {
        y = y.broadcast_add(&per_group(b, x, op.groups)?)?;
    }
    y.to_dtype(x.dtype())
}

/// The last dimension of `x`, or the error for a scalar.
fn hidden_of(op: &str, x: &Tensor) -> Result<usize> {
    match x.dims().last() {
        Some(&h) => Ok(h),
        None => bail!("{op}: x must have at least one dimension, got a scalar"),
    }
}

fn check_eps(op: &str, eps: f64) -> Result<()> {
    if eps.is_nan() || eps < 0.0 {
        bail!("{op}: eps must be non-negative, got {eps}");
    }
    Ok(())
}

/// Errors unless `p` has x's dtype and the shape `want`.
fn check_param(op: &str, what: &str, p: &Tensor, x: &Tensor, want: &[usize]) -> Result<()> {
    if p.dtype() != x.dtype() {
        bail!(
            "{op}: {what} dtype {:?} must equal x dtype {:?}",
            p.dtype(),
            x.dtype()
        );
    }
    if p.dims() != want {
        bail!(
            "{op}: {what} must have shape {want:?} to match x {:?}, got {:?}",
            x.shape(),
            p.shape()
        );
    }
    Ok(())
}

/// The checks of [`layer_norm`], shared by both paths.
fn check_plain(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<LayerNorm> {
    const OP: &str = "layer_norm";
    check_float(OP, "x", x.dtype())?;
    let hidden = hidden_of(OP, x)?;
    for (what, p) in [("weight", weight), ("bias", bias)] {
        if let Some(p) = p {
            check_param(OP, what, p, x, &[hidden])?;
        }
    }
    check_eps(OP, eps)?;
    Ok(LayerNorm {
        eps,
        groups: 1,
        unit_offset: false,
        scale: weight.is_some(),
        shift: bias.is_some(),
    })
}

/// The checks of [`layer_norm_modulate`], shared by both paths.
fn check_modulate(x: &Tensor, shift: &Tensor, scale: &Tensor, eps: f64) -> Result<LayerNorm> {
    const OP: &str = "layer_norm_modulate";
    check_float(OP, "x", x.dtype())?;
    let hidden = hidden_of(OP, x)?;
    if x.rank() < 2 {
        bail!("{OP}: x must be (batch, ..., hidden), got {:?}", x.shape());
    }
    let batch = x.dim(0)?;
    check_param(OP, "shift", shift, x, &[batch, hidden])?;
    check_param(OP, "scale", scale, x, &[batch, hidden])?;
    check_eps(OP, eps)?;
    Ok(LayerNorm {
        eps,
        groups: batch,
        unit_offset: true,
        scale: true,
        shift: true,
    })
}

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------

/// The op: LayerNorm of x `(groups, ..., hidden)`, then (with `scale`) times a `(groups,
/// hidden)` scale (plus one with `unit_offset`) and (with `shift`) plus a `(groups, hidden)`
/// shift, group `i` applying to the i-th `rows / groups` rows.
#[derive(Debug, Clone, Copy)]
struct LayerNorm {
    eps: f64,
    groups: usize,
    unit_offset: bool,
    scale: bool,
    shift: bool,
}

/// `Σ f(i)` for `i < n` in f64, in eight interleaved partial sums (vectorisable).
#[inline(always)]
fn sum_f64(n: usize, f: impl Fn(usize) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        for (k, a) in acc.iter_mut().enumerate() {
            *a += f(i + k);
        }
    }
    let mut tail = 0f64;
    for i in full..n {
        tail += f(i);
    }
    tail + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// A row's mean and `1 / sqrt(var + eps)`, in f64 (two-pass variance).
#[inline]
fn row_stats<T: Elem>(x: &[T], eps: f64) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = sum_f64(x.len(), |i| x[i].to_f32() as f64) / n;
    let var = sum_f64(x.len(), |i| {
        let c = x[i].to_f32() as f64 - mean;
        c * c
    }) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The per-group scale in f32 (`1 + scale` with `unit_offset`; ones without a scale) and shift
/// (zeros without one): `(groups · hidden)` each. Multiplying by one and adding zero are exact.
fn affine_f32<T: Elem>(
    op: &LayerNorm,
    scale: Option<&[T]>,
    shift: Option<&[T]>,
    len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let s = match scale {
        Some(s) if op.unit_offset => s.iter().map(|v| 1.0 + v.to_f32()).collect(),
        Some(s) => s.iter().map(|v| v.to_f32()).collect(),
        None => vec![1.0; len],
    };
    let b = match shift {
        Some(b) => b.iter().map(|v| v.to_f32()).collect(),
        None => vec![0.0; len],
    };
    (s, b)
}

/// Errors unless x's `n` elements form whole groups of rows of `hidden`.
fn rows_per_group(name: &str, n: usize, hidden: usize, groups: usize) -> Result<usize> {
    if hidden == 0 || groups == 0 {
        return Ok(0);
    }
    let rows = n / hidden;
    if !n.is_multiple_of(hidden) || !rows.is_multiple_of(groups) {
        bail!("{name}: {n} elements are not {groups} groups of rows of {hidden}");
    }
    Ok(rows / groups)
}

fn ln_fwd<T: Elem>(
    op: &LayerNorm,
    x: &[T],
    scale: Option<&[T]>,
    shift: Option<&[T]>,
    hidden: usize,
) -> Result<Vec<T>> {
    let n = x.len();
    let mut out = vec![T::from_f32(0.0); n];
    let rpg = rows_per_group("cpl-layer-norm", n, hidden, op.groups)?;
    if rpg == 0 {
        return Ok(out);
    }
    let (s, b) = affine_f32(op, scale, shift, op.groups * hidden);
    let eps = op.eps;
    out.par_chunks_mut(hidden)
        .zip(x.par_chunks(hidden))
        .enumerate()
        .with_min_len((4096 / hidden).max(1))
        .for_each(|(row, (o, xr))| {
            let (mean, r) = row_stats(xr, eps);
            let g = row / rpg * hidden;
            let (s, b) = (&s[g..g + hidden], &b[g..g + hidden]);
            for j in 0..hidden {
                let nv = ((xr[j].to_f32() as f64 - mean) * r) as f32;
                o[j] = T::from_f32(nv * s[j] + b[j]);
            }
        });
    Ok(out)
}

/// The hidden size of a `(.., hidden)` layout (1 for a scalar, which the checks refuse).
fn hidden_of_layout(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

fn fwd_storage<T: Elem>(
    op: &LayerNorm,
    xs: (&CpuStorage, &Layout),
    scale: Option<(&CpuStorage, &Layout)>,
    shift: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(xs.0)?, xs.1);
    let scale = match scale {
        Some((s, l)) => Some(strided(T::cpu_storage_as_slice(s)?, l)),
        None => None,
    };
    let shift = match shift {
        Some((s, l)) => Some(strided(T::cpu_storage_as_slice(s)?, l)),
        None => None,
    };
    let out = ln_fwd(
        op,
        &x,
        scale.as_deref(),
        shift.as_deref(),
        hidden_of_layout(xs.1),
    )?;
    Ok((T::to_cpu_storage_owned(out), xs.1.shape().clone()))
}

const NAME: &str = "cpl-layer-norm";
const BWD_NAME: &str = "cpl-layer-norm-bwd";

impl CustomOp1 for LayerNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(NAME, s1, fwd_storage(self, (s1, l1), None, None))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let packed = x.apply_op2_no_bwd(grad, &LayerNormBwd(*self))?;
        Ok(Some(packed.reshape(x.shape())?))
    }
}

impl CustomOp2 for LayerNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (scale, shift) = if self.scale {
            (Some((s2, l2)), None)
        } else {
            (None, Some((s2, l2)))
        };
        dispatch_float!(NAME, s1, fwd_storage(self, (s1, l1), scale, shift))
    }

    fn bwd(
        &self,
        x: &Tensor,
        p: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let packed = if self.scale {
            x.apply_op3_no_bwd(p, grad, &LayerNormBwd(*self))?
        } else {
            x.apply_op2_no_bwd(grad, &LayerNormBwd(*self))?
        };
        let n = x.elem_count();
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dp = packed.narrow(0, n, p.elem_count())?.reshape(p.shape())?;
        Ok((Some(dx), Some(dp)))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(
            NAME,
            s1,
            fwd_storage(self, (s1, l1), Some((s2, l2)), Some((s3, l3)))
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        scale: &Tensor,
        shift: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(scale, grad, &LayerNormBwd(*self))?;
        let (n, p) = (x.elem_count(), scale.elem_count());
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let ds = packed.narrow(0, n, p)?.reshape(scale.shape())?;
        let db = packed.narrow(0, n + p, p)?.reshape(shift.shape())?;
        Ok((Some(dx), Some(ds), Some(db)))
    }
}

/// Backward of [`LayerNorm`]: inputs x, the scale (when the op has one) and the gradient of the
/// output; output the flat packed gradients `[dx; dscale (if scale); dshift (if shift)]` in x's
/// dtype.
struct LayerNormBwd(LayerNorm);

/// Rows per block of the backward's parameter-gradient sums (bounds that depend only on the
/// shape).
fn block_rows(rows: usize, hidden: usize) -> usize {
    rows.div_ceil(64).max(16384 / hidden.max(1)).max(1)
}

fn ln_bwd<T: Elem>(
    op: &LayerNorm,
    x: &[T],
    scale: Option<&[T]>,
    g: &[T],
    hidden: usize,
) -> Result<Vec<T>> {
    let n = x.len();
    if g.len() != n {
        bail!("{NAME}-bwd: gradient has {} elements, x has {n}", g.len());
    }
    let p = op.groups * hidden;
    let np = n + p * (op.scale as usize + op.shift as usize);
    let mut out = vec![T::from_f32(0.0); np];
    let rpg = rows_per_group(NAME, n, hidden, op.groups)?;
    if rpg == 0 {
        return Ok(out);
    }
    let (s, _) = affine_f32(op, scale, None, p);
    let br = block_rows(rpg, hidden);
    let eps = op.eps;
    let (dx, dp) = out.split_at_mut(n);
    // Per block: (group, Σ g·n, Σ g) over its rows, in f64.
    let partials: Vec<(usize, Vec<f64>, Vec<f64>)> = dx
        .par_chunks_mut(rpg * hidden)
        .enumerate()
        .flat_map(|(gi, dxg)| {
            dxg.par_chunks_mut(br * hidden)
                .enumerate()
                .map(move |(bi, dxb)| (gi, bi, dxb))
        })
        .map(|(gi, bi, dxb)| {
            let sg = &s[gi * hidden..(gi + 1) * hidden];
            let mut ds = vec![0f64; if op.scale { hidden } else { 0 }];
            let mut db = vec![0f64; if op.shift { hidden } else { 0 }];
            let (mut nv, mut dn) = (vec![0f64; hidden], vec![0f64; hidden]);
            for (ri, dxr) in dxb.chunks_mut(hidden).enumerate() {
                let row = gi * rpg + bi * br + ri;
                let xr = &x[row * hidden..(row + 1) * hidden];
                let gr = &g[row * hidden..(row + 1) * hidden];
                let (mean, r) = row_stats(xr, eps);
                for j in 0..hidden {
                    nv[j] = (xr[j].to_f32() as f64 - mean) * r;
                    dn[j] = (gr[j].to_f32() * sg[j]) as f64;
                }
                if op.scale {
                    for j in 0..hidden {
                        ds[j] += gr[j].to_f32() as f64 * nv[j];
                    }
                }
                if op.shift {
                    for j in 0..hidden {
                        db[j] += gr[j].to_f32() as f64;
                    }
                }
                let h = hidden as f64;
                let a = sum_f64(hidden, |j| dn[j]) / h;
                let b = sum_f64(hidden, |j| dn[j] * nv[j]) / h;
                for j in 0..hidden {
                    dxr[j] = T::from_f32((((dn[j] - a) - nv[j] * b) * r) as f32);
                }
            }
            (gi, ds, db)
        })
        .collect();
    let (ds_out, db_out) = dp.split_at_mut(if op.scale { p } else { 0 });
    for (out, which) in [(ds_out, 1), (db_out, 2)] {
        let mut sum = vec![0f64; out.len()];
        for (gi, ds, db) in &partials {
            let part = if which == 1 { ds } else { db };
            for (a, &v) in sum[gi * hidden..].iter_mut().zip(part) {
                *a += v;
            }
        }
        for (o, &v) in out.iter_mut().zip(&sum) {
            *o = T::from_f32(v as f32);
        }
    }
    Ok(out)
}

fn bwd_storage<T: Elem>(
    op: &LayerNorm,
    xs: (&CpuStorage, &Layout),
    scale: Option<(&CpuStorage, &Layout)>,
    gs: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(xs.0)?, xs.1);
    let g = strided(T::cpu_storage_as_slice(gs.0)?, gs.1);
    let scale = match scale {
        Some((s, l)) => Some(strided(T::cpu_storage_as_slice(s)?, l)),
        None => None,
    };
    let out = ln_bwd(op, &x, scale.as_deref(), &g, hidden_of_layout(xs.1))?;
    let len = out.len();
    Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
}

impl CustomOp2 for LayerNormBwd {
    fn name(&self) -> &'static str {
        BWD_NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(BWD_NAME, s1, bwd_storage(&self.0, (s1, l1), None, (s2, l2)))
    }
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        BWD_NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(
            BWD_NAME,
            s1,
            bwd_storage(&self.0, (s1, l1), Some((s2, l2)), (s3, l3))
        )
    }
}
