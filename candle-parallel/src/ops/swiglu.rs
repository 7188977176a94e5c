//! SwiGLU (`silu(gate) * up`): a custom op with a backward on the CPU, a composite of
//! differentiable candle ops elsewhere.

use super::{all_cpu, check_float, chunk_exp, dispatch_float, round_through, strided, Elem};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 4096;

/// `silu(gate) * up` elementwise, as the Hugging Face LLaMA MLP computes it
/// (`act_fn(gate_proj(x)) * up_proj(x)`): `silu` is evaluated in f32 and rounded to the
/// dtype, then the product is rounded to the dtype.
///
/// - `gate`, `up`: the same shape (any, any strides) and the same dtype (f32, bf16 or f16);
///   error otherwise.
/// - Returns a tensor of that shape and dtype, differentiable with respect to both inputs
///   (gradients are computed in f32 and rounded once to the dtype).
///
/// On the CPU a fused kernel; on other devices the same function from differentiable candle ops
/// ([`swiglu_composite`]).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(gate, up)?;
    if all_cpu(&[gate, up]) {
        gate.apply_op2(up, SwiGlu)
    } else {
        composite(gate, up)
    }
}

/// [`swiglu`] built from differentiable candle ops, on any device (what [`swiglu`] runs off the
/// CPU; public so that tests can run it on the CPU). Same validation and errors.
///
/// candle's `silu` of gate in f32 (`x / (1 + exp(-x))`, as the kernel), rounded to the dtype
/// (forward only: the gradient passes through the rounding, as in the kernel's backward), times
/// `up` in f32 (exact for two bf16/f16 values, so rounding it equals the product in the dtype),
/// cast once to the dtype. Gradients are computed in f32 and rounded once to the dtype.
#[doc(hidden)]
pub fn swiglu_composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(gate, up)?;
    composite(gate, up)
}

fn composite(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let silu = round_through(&gate.to_dtype(DType::F32)?.silu()?, gate.dtype())?;
    (silu * up.to_dtype(DType::F32)?)?.to_dtype(gate.dtype())
}

/// The checks of [`swiglu`], shared by both paths.
fn check(gate: &Tensor, up: &Tensor) -> Result<()> {
    const OP: &str = "swiglu";
    check_float(OP, "gate", gate.dtype())?;
    if up.dtype() != gate.dtype() {
        bail!(
            "{OP}: up dtype {:?} must equal gate dtype {:?}",
            up.dtype(),
            gate.dtype()
        );
    }
    if up.shape() != gate.shape() {
        bail!(
            "{OP}: gate {:?} and up {:?} must have the same shape",
            gate.shape(),
            up.shape()
        );
    }
    Ok(())
}

/// `x * sigmoid(x)` as torch's CPU kernel writes it, `x / (1 + e)`, with `e = exp(-x)` from
/// [`chunk_exp`] (a vector exponential: libm's `expf` one element at a time, three times per
/// element over forward and backward, was about 5% of a bf16 MoE training step).
#[inline(always)]
fn silu(x: f32, e: f32) -> f32 {
    x / (1.0 + e)
}

/// The exponent of `e = exp(-x)`.
#[inline(always)]
fn minus(x: f32) -> f32 {
    -x
}

struct SwiGlu;

fn swiglu_fwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let g = strided(T::cpu_storage_as_slice(s1)?, l1);
    let u = strided(T::cpu_storage_as_slice(s2)?, l2);
    let mut out = vec![T::from_f32(0.0); g.len()];
    out.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| {
            let (gs, e) = chunk_exp(g, minus);
            for (((o, &g), &e), &u) in o.iter_mut().zip(gs.iter()).zip(&e).zip(u) {
                *o = T::from_f32(T::round(silu(g, e)) * u.to_f32());
            }
        });
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "cpl-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s1, swiglu_fwd(s1, l1, s2, l2))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // One pass computes both gradients, packed as [d gate; d up].
        let packed = gate.apply_op3_no_bwd(up, grad, &SwiGluBwd)?;
        let n = gate.elem_count();
        let dg = packed.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(up.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// Backward of [`SwiGlu`]: inputs (gate, up, grad of the output), output `[d gate; d up]`
/// as a flat tensor in the inputs' dtype.
struct SwiGluBwd;

fn swiglu_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
    s3: &CpuStorage,
    l3: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let g = strided(T::cpu_storage_as_slice(s1)?, l1);
    let u = strided(T::cpu_storage_as_slice(s2)?, l2);
    let d = strided(T::cpu_storage_as_slice(s3)?, l3);
    let n = g.len();
    if d.len() != n {
        bail!(
            "cpl-swiglu-bwd: gradient has {} elements, gate has {n}",
            d.len()
        );
    }
    let mut out = vec![T::from_f32(0.0); 2 * n];
    let (dg, du) = out.split_at_mut(n);
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(d.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), d))| {
            let (gs, e) = chunk_exp(g, minus);
            for i in 0..g.len() {
                let (gv, ev, uv, dv) = (gs[i], e[i], u[i].to_f32(), d[i].to_f32());
                let s = 1.0 / (1.0 + ev);
                // d silu / dg = s * (1 + g * (1 - s)); d out / d up = silu(g) as stored.
                dg[i] = T::from_f32(dv * uv * (s * (1.0 + gv * (1.0 - s))));
                du[i] = T::from_f32(dv * T::round(silu(gv, ev)));
            }
        });
    Ok((T::to_cpu_storage_owned(out), Shape::from(2 * n)))
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "cpl-swiglu-bwd"
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
        dispatch_float!(self.name(), s1, swiglu_bwd(s1, l1, s2, l2, s3, l3))
    }
}
