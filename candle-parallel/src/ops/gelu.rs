//! GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`, candle's `gelu`), as
//! a custom op with a one-pass backward: candle differentiates its GELU as a chain of
//! elementwise tensor ops (`powf`, `tanh`, products: six passes and allocations), which made
//! it the largest elementwise cost of a DiT training step. Off the CPU, where this crate has no
//! kernel, the op is such a chain of differentiable candle ops (a composite).
//!
//! The CPU kernel evaluates `0.5 x (1 + tanh(u))` as `x σ(2u) = x / (1 + e^{-2u})`, the same
//! function, with flash-ring's vector exponential ([`flash_ring::cpu::exp_shifted`]) instead of
//! libm's scalar `tanhf` (which computes `expm1f` per element: 15% of a DiT step's time in
//! `perf`). Hand-written because the form is also more exact: `1 + tanh(u)` cancels for
//! negative `x` (at `x = -5` it is 9e-8, below the error of `tanh` near -1, so PyTorch's and
//! libm's f32 results there are mostly rounding), while `1 + e^{-2u}` never cancels: the
//! relative error stays within about `|2u|` times a few f32 ulps (the conditioning of `σ(2u)`
//! in `u`), in the value and in the derivative `σ (1 + 2 x u' e^{-2u} σ)`.

use super::{all_cpu, check_float, chunk_exp, dispatch_float, strided, Elem};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Elements per parallel task.
const CHUNK: usize = 4096;

/// √(2/π).
const K: f32 = 0.797_884_6;
const C: f32 = 0.044_715;

/// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` elementwise, evaluated in f32 and rounded once
/// to the dtype (f32, bf16 or f16; any shape and strides), differentiable (the gradient too is
/// computed in f32 and rounded once). On the CPU a fused kernel; on other devices the same
/// function from differentiable candle ops ([`gelu_tanh_composite`]).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    if all_cpu(&[x]) {
        x.apply_op1(GeluTanh)
    } else {
        composite(x)
    }
}

/// [`gelu_tanh`] built from differentiable candle ops, on any device (what [`gelu_tanh`] runs
/// off the CPU; public so that tests can run it on the CPU). Same validation and errors.
///
/// The kernel's formula in f32, `x / (1 + e^{-2u})` with `u = √(2/π) · x · (1 + 0.044715 x²)`
/// (the exponent capped at 80, where the value is already 0 to f32 and `e^{-2u}` and its
/// autograd stay finite), cast once to the dtype; candle's autograd differentiates it in f32
/// and the gradient is rounded once to the dtype.
#[doc(hidden)]
pub fn gelu_tanh_composite(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    composite(x)
}

fn composite(x: &Tensor) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let minus_two_u = (x32.sqr()?.affine(C as f64, 1.0)? * &x32)?
        .affine(-2.0 * K as f64, 0.0)?
        .minimum(80.0)?;
    (&x32 / (minus_two_u.exp()? + 1.0)?)?.to_dtype(x.dtype())
}

/// The checks of [`gelu_tanh`], shared by both paths.
fn check(x: &Tensor) -> Result<()> {
    check_float("gelu_tanh", "x", x.dtype())
}

/// `-2u = -2 √(2/π) (x + 0.044715 x³)`, the exponent of `e^{-2u}`.
#[inline(always)]
fn minus_two_u(x: f32) -> f32 {
    -2.0 * K * (x + C * x * x * x)
}

/// `gelu(x) = x σ(2u) = x / (1 + e)`, `e = e^{-2u}`.
#[inline(always)]
fn gelu(x: f32, e: f32) -> f32 {
    x / (1.0 + e)
}

/// `d gelu / dx = σ + 2 x u' σ (1 − σ) = σ (1 + 2 x u' e σ)`, `σ = 1 / (1 + e)`,
/// `u' = √(2/π) (1 + 3 · 0.044715 x²)` (`1 − σ = e σ`: no cancellation).
#[inline(always)]
fn gelu_grad(x: f32, e: f32) -> f32 {
    let s = 1.0 / (1.0 + e);
    let du = K * (1.0 + 3.0 * C * x * x);
    s * (1.0 + 2.0 * x * du * (e * s))
}

struct GeluTanh;

fn gelu_fwd<T: Elem>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(s)?, l);
    let mut out = vec![T::from_f32(0.0); x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, x)| {
            let (xs, e) = chunk_exp(x, minus_two_u);
            for ((o, &x), &e) in o.iter_mut().zip(xs.iter()).zip(&e) {
                *o = T::from_f32(gelu(x, e));
            }
        });
    Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "cpl-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s, gelu_fwd(s, l))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(grad, &GeluTanhBwd)?))
    }
}

/// Backward of [`GeluTanh`]: inputs (x, grad of the output), output the grad of x.
struct GeluTanhBwd;

fn gelu_bwd<T: Elem>(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let x = strided(T::cpu_storage_as_slice(s1)?, l1);
    let d = strided(T::cpu_storage_as_slice(s2)?, l2);
    if d.len() != x.len() {
        bail!(
            "cpl-gelu-tanh-bwd: gradient has {} elements, x has {}",
            d.len(),
            x.len()
        );
    }
    let mut out = vec![T::from_f32(0.0); x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(d.par_chunks(CHUNK)))
        .for_each(|(o, (x, d))| {
            let (xs, e) = chunk_exp(x, minus_two_u);
            for (((o, &x), &e), &d) in o.iter_mut().zip(xs.iter()).zip(&e).zip(d) {
                *o = T::from_f32(d.to_f32() * gelu_grad(x, e));
            }
        });
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

impl CustomOp2 for GeluTanhBwd {
    fn name(&self) -> &'static str {
        "cpl-gelu-tanh-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s1, gelu_bwd(s1, l1, s2, l2))
    }
}
