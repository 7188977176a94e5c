//! Differentiable fused ops that candle lacks (its own fused versions drop gradients silently):
//! RMSNorm, LayerNorm (plain and with DiT's adaLN modulation), DiT's gated residual, rotary
//! embeddings, SwiGLU and GELU-tanh; and two ops whose gradients sum in f32 where candle sums in
//! bf16: an embedding lookup (repeated tokens) and a bias addition (crates.io's candle-core).
//!
//! # Devices
//! Each op dispatches on the device of its inputs:
//! - all on the CPU: a fused kernel, a custom op with a one-pass backward;
//! - otherwise (CUDA, Metal): a *composite*, the same function built from plain differentiable
//!   candle tensor ops (`to_dtype`, `sqr`, `mean_keepdim`, `narrow`, `cat`, ...), so candle's
//!   autograd differentiates it on any device. Nothing is copied to the CPU.
//!
//! Both paths validate their inputs with the same code (identical errors) and round where the
//! op's documentation says: the composites compute in f32 where the kernels do, round the
//! intermediate values the kernels round (forward only: the kernels' backward passes gradients
//! through those roundings, and so do the composites), and cast once to the dtype. Their results
//! agree with the kernels' to f32 rounding in f32 and to about one ulp of the dtype in bf16/f16
//! (RoPE, computed in the dtype on both paths as Hugging Face does, is bit-identical on the CPU),
//! except LayerNorm on ill-conditioned rows (mean far above the spread), where the kernel's f64
//! statistics are more exact than the composite's f32 ones (`layer_norm`'s docs).
//!
//! Each composite is also public and `#[doc(hidden)]` ([`rms_norm_composite`],
//! [`layer_norm_composite`], [`layer_norm_modulate_composite`], [`gated_residual_composite`],
//! [`swiglu_composite`], [`gelu_tanh_composite`], [`RotaryEmbedding::apply_composite`],
//! [`embedding_lookup_composite`]; `bias_add`'s is candle's broadcast addition): tests
//! call it on CPU tensors to compare it with the kernel. It runs on any device.

mod bias;
mod embedding;
mod gated_residual;
mod gelu;
mod layer_norm;
mod rms_norm;
mod rope;
pub(crate) mod softmax_rows;
mod swiglu;

pub use bias::bias_add;
pub use embedding::embedding_lookup;
#[doc(hidden)]
pub use embedding::embedding_lookup_composite;
pub use gated_residual::gated_residual;
#[doc(hidden)]
pub use gated_residual::gated_residual_composite;
pub use gelu::gelu_tanh;
#[doc(hidden)]
pub use gelu::gelu_tanh_composite;
pub use layer_norm::{layer_norm, layer_norm_modulate};
#[doc(hidden)]
pub use layer_norm::{layer_norm_composite, layer_norm_modulate_composite};
pub use rms_norm::rms_norm;
#[doc(hidden)]
pub use rms_norm::rms_norm_composite;
pub use rope::{
    inv_freq, inv_freq_at, longrope_attention_factor, yarn_attention_factor, RopeScaling,
    RotaryEmbedding,
};
pub use swiglu::swiglu;
#[doc(hidden)]
pub use swiglu::swiglu_composite;

use candle_core::{bail, DType, Layout, Result, Tensor, WithDType};
use std::borrow::Cow;

/// `x` of one chunk in f32, and `e^{exponent(x)}` of each, by flash-ring's vector exponential
/// ([`flash_ring::cpu::exp_in_place`]: within 2.5e-7 relative, 2 ulps, at every argument;
/// libm's `expf`, one ulp but one element at a time, was several times slower). It clamps at
/// `e^88` (2^127), so `e` stays finite (`x / (1 + e)` goes to 0, not NaN), and NaN gives 0 (NaN
/// still propagates through `x`). The GELU's `e^{-2u}` and the SiLU's `e^{-x}`. An f32 chunk
/// is borrowed, not copied.
pub(crate) fn chunk_exp<T: Elem>(
    x: &[T],
    exponent: impl Fn(f32) -> f32,
) -> (Cow<'_, [f32]>, Vec<f32>) {
    let xs: Cow<[f32]> = match T::as_f32s(x) {
        Some(x) => Cow::Borrowed(x),
        None => Cow::Owned(x.iter().map(|v| v.to_f32()).collect()),
    };
    let mut e: Vec<f32> = xs.iter().map(|&x| exponent(x)).collect();
    flash_ring::cpu::exp_in_place(&mut e);
    (xs, e)
}

/// Element types the fused CPU kernels accept; arithmetic is always done in f32. (Also the
/// optimizer's parallel CPU paths, `optim::cpu_floats`.)
pub(crate) trait Elem: WithDType {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// The slice itself when the type is f32 (no widening needed).
    #[inline(always)]
    fn as_f32s(_x: &[Self]) -> Option<&[f32]> {
        None
    }
    /// Rounds an f32 to this type's precision (round to nearest even), returned as f32.
    /// The identity for f32.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn as_f32s(x: &[Self]) -> Option<&[f32]> {
        Some(x)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn round(v: f32) -> f32 {
        v
    }
}

// The bf16 conversions are written out (bit for bit those of `half`) so that they inline into
// the kernels even at low optimisation levels.
impl Elem for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        let x = v.to_bits();
        // Round to nearest, ties to even: adding 0x7FFF and the lowest kept bit carries into
        // the kept bits exactly when the dropped half is above a tie, or a tie after an odd
        // kept part. Both candidates are computed and one selected (no branch), so that the
        // loops calling this compile to vector code.
        let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
        // NaN: keep it quiet.
        let quiet_nan = (x >> 16) | 0x0040;
        let bits = if x & 0x7FFF_FFFF > 0x7F80_0000 {
            quiet_nan
        } else {
            rounded
        };
        half::bf16::from_bits(bits as u16)
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// The elements of a tensor with layout `l` stored in `data`, in row-major order: borrowed when
/// the layout is contiguous, gathered otherwise (any strides, offsets and broadcasts).
fn strided<'a, T: Copy>(data: &'a [T], l: &Layout) -> Cow<'a, [T]> {
    if let Some((start, end)) = l.contiguous_offsets() {
        return Cow::Borrowed(&data[start..end]);
    }
    let dims = l.dims();
    let stride = l.stride();
    let n = l.shape().elem_count();
    let mut out = Vec::with_capacity(n);
    // A non-contiguous layout has rank >= 1 (scalars are contiguous).
    if n == 0 || dims.is_empty() {
        return Cow::Owned(out);
    }
    let rank = dims.len();
    let (inner, inner_stride) = (dims[rank - 1], stride[rank - 1]);
    let mut idx = vec![0usize; rank - 1];
    let mut base = l.start_offset();
    for _ in 0..n / inner {
        out.extend((0..inner).map(|k| data[base + k * inner_stride]));
        for d in (0..rank - 1).rev() {
            idx[d] += 1;
            base += stride[d];
            if idx[d] < dims[d] {
                break;
            }
            base -= idx[d] * stride[d];
            idx[d] = 0;
        }
    }
    Cow::Owned(out)
}

/// The elements of a (small) tensor with layout `l`, widened to f32 in row-major order (a gate,
/// a bias).
fn widened<T: Elem>(s: &candle_core::CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    Ok(strided(T::cpu_storage_as_slice(s)?, l)
        .iter()
        .map(|v| v.to_f32())
        .collect())
}

/// Errors unless `dtype` is one the fused kernels support.
fn check_float(op: &str, what: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => bail!("{op}: {what} has dtype {other:?}, expected f32, bf16 or f16"),
    }
}

/// Whether every tensor lives on the CPU, the device with fused kernels. Otherwise the ops run
/// their composite (which reports mixed devices as candle does).
fn all_cpu(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cpu())
}

/// `x32` (f32) rounded to `dtype`'s precision in forward and the identity in backward: the
/// composites' copy of the kernels' intermediate roundings ([`Elem::round`]), which their
/// backward passes gradients through unrounded. `x32` itself for f32.
///
/// Built as `(x32 - detach(x32)) + rounded`: exactly `rounded` for finite values (an infinity
/// gives NaN there, where a kernel keeps it), with gradient one with respect to `x32`.
fn round_through(x32: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype == DType::F32 {
        return Ok(x32.clone());
    }
    let rounded = x32.detach().to_dtype(dtype)?.to_dtype(DType::F32)?;
    (x32 - x32.detach())? + rounded
}

/// Calls `$f::<T>($args)` with `T` the Rust type of the dtype of the CPU storage `$storage`
/// (f32, bf16 or f16).
macro_rules! dispatch_float {
    ($op:expr, $storage:expr, $f:ident ( $($args:expr),* $(,)? )) => {
        match candle_core::backend::BackendStorage::dtype($storage) {
            candle_core::DType::F32 => $f::<f32>($($args),*),
            candle_core::DType::BF16 => $f::<half::bf16>($($args),*),
            candle_core::DType::F16 => $f::<half::f16>($($args),*),
            other => candle_core::bail!("{}: unsupported dtype {other:?}", $op),
        }
    };
}
pub(crate) use dispatch_float;

#[cfg(test)]
mod tests {
    use super::Elem;

    #[test]
    fn bf16_conversions_match_half() {
        let special = [
            0u32,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0x7F7F_FFFF,
        ];
        // Every tie, and the patterns just below and above it, for every kept part.
        let ties =
            (0..1 << 16).flat_map(|i: u32| [0x7FFF, 0x8000, 0x8001].map(|low| (i << 16) | low));
        let sweep = (0..u32::MAX / 1021).map(|i| i * 1021);
        for bits in special.into_iter().chain(ties).chain(sweep) {
            let v = f32::from_bits(bits);
            let ours = <half::bf16 as Elem>::from_f32(v);
            assert_eq!(
                ours.to_bits(),
                half::bf16::from_f32(v).to_bits(),
                "{bits:#x}"
            );
            assert_eq!(
                <half::bf16 as Elem>::to_f32(ours).to_bits(),
                ours.to_f32().to_bits()
            );
        }
    }
}
