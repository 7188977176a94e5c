//! RMSNorm with the semantics of Hugging Face `LlamaRMSNorm`: a custom op with a backward on the
//! CPU, a composite of differentiable candle ops elsewhere.

use super::{all_cpu, check_float, dispatch_float, round_through, strided, Elem};
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use rayon::prelude::*;

/// RMSNorm over the last dimension, as Hugging Face `LlamaRMSNorm`:
/// `weight * to_dtype(x32 * rsqrt(mean(x32^2, -1) + eps))` where `x32` is `x` in f32 and the
/// final product by `weight` is rounded to x's dtype.
///
/// - `x`: `(..., hidden)`, f32, bf16 or f16, any strides.
/// - `weight`: `(hidden)`, the same dtype as `x` (error otherwise).
/// - Returns a tensor of x's shape and dtype, differentiable with respect to both `x` and
///   `weight` (gradients are computed in f32 and rounded once to the dtype).
///
/// On the CPU a fused kernel; on other devices the same function from differentiable candle ops
/// ([`rms_norm_composite`]).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check(x, weight, eps)?;
    if all_cpu(&[x, weight]) {
        x.apply_op2(weight, RmsNorm { eps })
    } else {
        composite(x, weight, eps)
    }
}

/// [`rms_norm`] built from differentiable candle ops, on any device (what [`rms_norm`] runs
/// off the CPU; public so that tests can run it on the CPU). Same validation and errors.
///
/// `r = 1 / sqrt(mean(x32²) + eps)` and `x32 · r` in f32, rounded to x's dtype (forward only:
/// the gradient passes through the rounding, as in the kernel's backward), times the weight in
/// f32 (exact for a product of two bf16/f16 values, so rounding it to the dtype equals the
/// product in the dtype) and cast once to the dtype. Gradients are computed in f32 (the
/// weight's summed over rows in f32) and rounded once to the dtype, as the kernel's.
#[doc(hidden)]
pub fn rms_norm_composite(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check(x, weight, eps)?;
    composite(x, weight, eps)
}

fn composite(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let r = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let n = round_through(&x32.broadcast_mul(&r)?, x.dtype())?;
    n.broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .to_dtype(x.dtype())
}

/// The checks of [`rms_norm`], shared by both paths.
fn check(x: &Tensor, weight: &Tensor, eps: f64) -> Result<()> {
    const OP: &str = "rms_norm";
    check_float(OP, "x", x.dtype())?;
    if weight.dtype() != x.dtype() {
        bail!(
            "{OP}: weight dtype {:?} must equal x dtype {:?} (the normalised x is cast back to x's \
             dtype and then multiplied by the weight in that dtype)",
            weight.dtype(),
            x.dtype()
        );
    }
    let hidden = match x.dims().last() {
        Some(&h) => h,
        None => bail!("{OP}: x must have at least one dimension, got a scalar"),
    };
    if weight.dims() != [hidden] {
        bail!(
            "{OP}: weight must have shape ({hidden}) to match x {:?}, got {:?}",
            x.shape(),
            weight.shape()
        );
    }
    if eps.is_nan() || eps < 0.0 {
        bail!("{OP}: eps must be non-negative, got {eps}");
    }
    Ok(())
}

/// Rows per block of the backward, so that the weight gradient is summed in an order that
/// depends only on the shape (deterministic whatever the number of threads).
fn block_rows(rows: usize, hidden: usize) -> usize {
    rows.div_ceil(128).max(16384 / hidden.max(1)).max(1)
}

/// `1 / sqrt(mean(x^2) + eps)` in f32, as `torch.rsqrt(x.pow(2).mean(-1) + eps)`.
#[inline]
fn inv_rms<T: Elem>(x: &[T], eps: f32) -> f32 {
    // Eight independent accumulators: vectorisable and close to torch's pairwise-ish sum.
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            let v = v.to_f32();
            *a += v * v;
        }
    }
    let mut sum = 0f32;
    for &v in chunks.remainder() {
        let v = v.to_f32();
        sum += v * v;
    }
    let sum =
        sum + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    1.0 / (sum / x.len() as f32 + eps).sqrt()
}

struct RmsNorm {
    eps: f64,
}

fn rms_fwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    eps: f32,
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(s1)?, l1);
    let w = strided(T::cpu_storage_as_slice(s2)?, l2);
    let h = w.len();
    let mut out = vec![T::from_f32(0.0); x.len()];
    if let Some(min_rows) = 4096usize.checked_div(h) {
        let min_rows = min_rows.max(1);
        out.par_chunks_mut(h)
            .zip(x.par_chunks(h))
            .with_min_len(min_rows)
            .for_each(|(o, xr)| {
                let r = inv_rms(xr, eps);
                for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w.iter()) {
                    // HF: `weight * (x32 * r).to(dtype)`, the product rounded to the dtype.
                    let n = T::round(xv.to_f32() * r);
                    *o = T::from_f32(wv.to_f32() * n);
                }
            });
    }
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "cpl-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let eps = self.eps as f32;
        dispatch_float!(self.name(), s1, rms_fwd(s1, l1, s2, l2, eps))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // One pass computes both gradients, packed as [dx (x.elem_count()); dw (hidden)].
        let packed = x.apply_op3_no_bwd(w, grad, &RmsNormBwd { eps: self.eps })?;
        let n = x.elem_count();
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, w.elem_count())?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of [`RmsNorm`]: inputs (x, weight, grad of the output), output the packed
/// gradients `[dx; dw]` as a flat tensor in x's dtype.
struct RmsNormBwd {
    eps: f64,
}

#[allow(clippy::too_many_arguments)]
fn rms_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
    eps: f32,
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(s1)?, l1);
    let w = strided(T::cpu_storage_as_slice(s2)?, l2);
    let g = strided(T::cpu_storage_as_slice(s3)?, l3);
    let h = w.len();
    let n = x.len();
    if g.len() != n {
        bail!(
            "cpl-rms-norm-bwd: gradient has {} elements, x has {n}",
            g.len()
        );
    }
    if h == 0 {
        return Ok((T::to_cpu_storage_owned(Vec::new()), Shape::from(0)));
    }
    let rows = n / h;
    let br = block_rows(rows, h);
    let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let mut out = vec![T::from_f32(0.0); n + h];
    let (dx, dw_out) = out.split_at_mut(n);
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(br * h)
        .enumerate()
        .map(|(bi, dxb)| {
            let mut dw = vec![0f32; h];
            let mut gn = vec![0f32; h];
            for (ri, dxr) in dxb.chunks_mut(h).enumerate() {
                let row = bi * br + ri;
                let xr = &x[row * h..(row + 1) * h];
                let gr = &g[row * h..(row + 1) * h];
                let r = inv_rms(xr, eps);
                // y = w * round(x * r): dw += g * round(x * r); d(x*r)/dx with upstream g * w.
                let mut dot = 0f32;
                for j in 0..h {
                    let xv = xr[j].to_f32();
                    let gv = gr[j].to_f32();
                    dw[j] += gv * T::round(xv * r);
                    let t = gv * w32[j];
                    gn[j] = t;
                    dot += t * xv;
                }
                let c = r * r * r * dot / h as f32;
                for j in 0..h {
                    dxr[j] = T::from_f32(r * gn[j] - xr[j].to_f32() * c);
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![0f32; h];
    for p in &partials {
        for (a, &b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    for (o, &v) in dw_out.iter_mut().zip(&dw) {
        *o = T::from_f32(v);
    }
    Ok((T::to_cpu_storage_owned(out), Shape::from(n + h)))
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "cpl-rms-norm-bwd"
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
        let eps = self.eps as f32;
        dispatch_float!(self.name(), s1, rms_bwd(s1, l1, s2, l2, s3, l3, eps))
    }
}
