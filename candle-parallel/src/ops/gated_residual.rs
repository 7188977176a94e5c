//! The gated residual of adaLN-Zero blocks (DiT): `x + gate · y` with one gate per sample, as a
//! custom op with a one-pass backward on the CPU, a composite of differentiable candle ops
//! elsewhere.
//!
//! Why a kernel: the composite (`unsqueeze`, `broadcast_mul`, `add`) makes two passes and two
//! allocations forward, and its backward materialises the broadcast gate, multiplies twice and
//! sums the product over the tokens in further passes. The kernel writes the output in one pass
//! and, backward, the gradients of y and of the gate in one pass (the gradient of x is the
//! incoming gradient itself).
//!
//! Rounding: forward `x + (gate · y)` in f32, the product and the sum each rounded to f32 (the
//! composite's order in f32), the result rounded once to the dtype. Backward `dy = g · gate` in
//! f32; `dgate = Σ g · y` over each sample's rows in f64 (blocks of rows whose bounds depend
//! only on the shape), each rounded once to the dtype.

use super::{all_cpu, check_float, dispatch_float, strided, widened, Elem};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// `x + gate · y`: `x`, `y` `(batch, ..., hidden)` of one shape, `gate` `(batch, hidden)` (any
/// strides), all of one dtype (f32, bf16, f16); computed in f32 and rounded once to the dtype,
/// differentiable with respect to all three.
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    check(x, y, gate)?;
    if all_cpu(&[x, y, gate]) {
        x.apply_op3(y, gate, GatedResidual)
    } else {
        composite(x, y, gate)
    }
}

/// [`gated_residual`] from differentiable candle ops, on any device (public so that tests can
/// run it on the CPU). Same validation and errors.
#[doc(hidden)]
pub fn gated_residual_composite(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    check(x, y, gate)?;
    composite(x, y, gate)
}

fn composite(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let mut dims = vec![1; x.rank()];
    dims[0] = x.dim(0)?;
    dims[x.rank() - 1] = x.dim(D::Minus1)?;
    let gate = gate.to_dtype(DType::F32)?.reshape(dims)?;
    let gy = y.to_dtype(DType::F32)?.broadcast_mul(&gate)?;
    (x.to_dtype(DType::F32)? + gy)?.to_dtype(x.dtype())
}

fn check(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<()> {
    const OP: &str = "gated_residual";
    check_float(OP, "x", x.dtype())?;
    if y.dtype() != x.dtype() || gate.dtype() != x.dtype() {
        bail!(
            "{OP}: x, y and gate must have one dtype, got {:?}, {:?}, {:?}",
            x.dtype(),
            y.dtype(),
            gate.dtype()
        );
    }
    if x.rank() < 2 {
        bail!("{OP}: x must be (batch, ..., hidden), got {:?}", x.shape());
    }
    if y.dims() != x.dims() {
        bail!(
            "{OP}: y {:?} must have the shape of x {:?}",
            y.shape(),
            x.shape()
        );
    }
    let want = [x.dim(0)?, x.dim(D::Minus1)?];
    if gate.dims() != want {
        bail!(
            "{OP}: gate must have shape {want:?} to match x {:?}, got {:?}",
            x.shape(),
            gate.shape()
        );
    }
    Ok(())
}

struct GatedResidual;

/// `(hidden, rows per sample)` of x's layout and the gate's element count.
fn geometry(l: &Layout, gate_len: usize) -> Result<(usize, usize)> {
    let n = l.shape().elem_count();
    let hidden = l.dims().last().copied().unwrap_or(1);
    let batch = l.dims().first().copied().unwrap_or(1);
    if hidden == 0 || batch == 0 || n == 0 {
        return Ok((hidden, 0));
    }
    if gate_len != batch * hidden {
        bail!("cpl-gated-residual: gate has {gate_len} elements for {batch} samples of {hidden}");
    }
    Ok((hidden, n / hidden / batch))
}

fn fwd<T: Elem>(
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(s1)?, l1);
    let y = strided(T::cpu_storage_as_slice(s2)?, l2);
    let gate = widened::<T>(s3, l3)?;
    let (hidden, rps) = geometry(l1, gate.len())?;
    let mut out = vec![T::from_f32(0.0); x.len()];
    if rps > 0 {
        out.par_chunks_mut(hidden)
            .zip(x.par_chunks(hidden).zip(y.par_chunks(hidden)))
            .enumerate()
            .with_min_len((4096 / hidden).max(1))
            .for_each(|(row, (o, (xr, yr)))| {
                let g = &gate[row / rps * hidden..][..hidden];
                for j in 0..hidden {
                    o[j] = T::from_f32(xr[j].to_f32() + g[j] * yr[j].to_f32());
                }
            });
    }
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

impl CustomOp3 for GatedResidual {
    fn name(&self) -> &'static str {
        "cpl-gated-residual"
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
        dispatch_float!(self.name(), s1, fwd((s1, l1), (s2, l2), (s3, l3)))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        y: &Tensor,
        gate: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = y.apply_op3_no_bwd(gate, grad, &GatedResidualBwd)?;
        let n = y.elem_count();
        let dy = packed.narrow(0, 0, n)?.reshape(y.shape())?;
        let dgate = packed
            .narrow(0, n, gate.elem_count())?
            .reshape(gate.shape())?;
        Ok((Some(grad.clone()), Some(dy), Some(dgate)))
    }
}

/// Backward of [`GatedResidual`]: inputs y, gate and the output's gradient; output the packed
/// `[dy; dgate]` in the dtype.
struct GatedResidualBwd;

/// Rows per block of the gate-gradient sums.
fn block_rows(rows: usize, hidden: usize) -> usize {
    rows.div_ceil(64).max(16384 / hidden.max(1)).max(1)
}

fn bwd<T: Elem>(
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    let y = strided(T::cpu_storage_as_slice(s1)?, l1);
    let gate = widened::<T>(s2, l2)?;
    let g = strided(T::cpu_storage_as_slice(s3)?, l3);
    let n = y.len();
    if g.len() != n {
        bail!(
            "cpl-gated-residual-bwd: gradient has {} elements, y has {n}",
            g.len()
        );
    }
    let (hidden, rps) = geometry(l1, gate.len())?;
    let p = gate.len();
    let mut out = vec![T::from_f32(0.0); n + p];
    if rps > 0 {
        let br = block_rows(rps, hidden);
        let (dy, dgate) = out.split_at_mut(n);
        let partials: Vec<(usize, Vec<f64>)> = dy
            .par_chunks_mut(rps * hidden)
            .enumerate()
            .flat_map(|(b, dys)| {
                dys.par_chunks_mut(br * hidden)
                    .enumerate()
                    .map(move |(bi, dyb)| (b, bi, dyb))
            })
            .map(|(b, bi, dyb)| {
                let gt = &gate[b * hidden..][..hidden];
                let mut acc = vec![0f64; hidden];
                for (ri, dyr) in dyb.chunks_mut(hidden).enumerate() {
                    let row = b * rps + bi * br + ri;
                    let yr = &y[row * hidden..][..hidden];
                    let gr = &g[row * hidden..][..hidden];
                    for j in 0..hidden {
                        let gv = gr[j].to_f32();
                        dyr[j] = T::from_f32(gv * gt[j]);
                        acc[j] += gv as f64 * yr[j].to_f32() as f64;
                    }
                }
                (b, acc)
            })
            .collect();
        let mut sum = vec![0f64; p];
        for (b, acc) in &partials {
            for (a, &v) in sum[b * hidden..].iter_mut().zip(acc) {
                *a += v;
            }
        }
        for (o, &v) in dgate.iter_mut().zip(&sum) {
            *o = T::from_f32(v as f32);
        }
    }
    Ok((T::to_cpu_storage_owned(out), Shape::from(n + p)))
}

impl CustomOp3 for GatedResidualBwd {
    fn name(&self) -> &'static str {
        "cpl-gated-residual-bwd"
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
        dispatch_float!(self.name(), s1, bwd((s1, l1), (s2, l2), (s3, l3)))
    }
}
