//! Rotary position embeddings as in Hugging Face LLaMA (non-interleaved, `rotate_half`), as a
//! custom op with a backward on the CPU (a composite of differentiable candle ops elsewhere),
//! for arbitrary (e.g. zigzag-permuted) global positions.

use super::{all_cpu, check_float, dispatch_float, strided, Elem};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::cmp::Ordering;
use std::sync::Arc;

/// How the rotary frequencies are scaled, as `rope_scaling` / `rope_parameters` of a
/// transformers LLaMA config.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "default"`: `inv_freq[i] = 1 / theta^(2i / head_dim)`.
    Default,
    /// `rope_type: "linear"`: the default frequencies divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type: "llama3"`: low frequencies (wavelength above
    /// `original_max_position_embeddings / low_freq_factor`) divided by `factor`, high
    /// frequencies (wavelength below `original_max_position_embeddings / high_freq_factor`)
    /// kept, and a smooth interpolation between the two.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// The inverse frequencies, `ceil(head_dim / 2)` values (`head_dim / 2` for the even head
/// dimensions [`RotaryEmbedding`] accepts), as transformers computes them
/// (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
/// `_compute_llama3_parameters`).
///
/// Rounding: transformers evaluates every step in float32 tensors, with Python scalars cast to
/// float32. This function replays the same sequence of f32 operations (so each of
/// `i / dim`, `1 / p`, `/ factor`, `2π / inv_freq`, the llama3 comparisons and smoothing is
/// rounded exactly as torch rounds it), except `theta ** e`, which is evaluated in f64 and
/// rounded once to f32 (torch uses a float32 `pow` accurate to about 1 ulp, so the two may
/// differ in the last bit). Parameters are not validated here (see [`RotaryEmbedding::new`]).
pub fn inv_freq(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let dim = head_dim as f32;
    // torch: `base ** t` with a float32 tensor `t` casts the Python base to float32.
    let base = theta as f32 as f64;
    let default = (0..head_dim).step_by(2).map(|i| {
        let e = i as f32 / dim;
        let p = base.powf(e as f64) as f32;
        1.0f32 / p
    });
    match scaling {
        RopeScaling::Default => default.collect(),
        RopeScaling::Linear { factor } => {
            let factor = *factor as f32;
            default.map(|v| v / factor).collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old_len = *original_max_position_embeddings as f64;
            // Python floats, compared with / combined into float32 tensors as float32.
            let low_wavelen = (old_len / low_freq_factor) as f32;
            let high_wavelen = (old_len / high_freq_factor) as f32;
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            let factor32 = *factor as f32;
            let low32 = *low_freq_factor as f32;
            let span = (high_freq_factor - low_freq_factor) as f32;
            let old_len32 = old_len as f32;
            default
                .map(|inv| {
                    let wavelen = two_pi / inv;
                    let inv_llama = if wavelen > low_wavelen {
                        inv / factor32
                    } else {
                        inv
                    };
                    let smooth = (old_len32 / wavelen - low32) / span;
                    let smoothed = (1.0 - smooth) * inv_llama / factor32 + smooth * inv_llama;
                    // `~(wavelen < high) * ~(wavelen > low)`, NaN included.
                    let is_medium = wavelen.partial_cmp(&high_wavelen) != Some(Ordering::Less)
                        && wavelen.partial_cmp(&low_wavelen) != Some(Ordering::Greater);
                    if is_medium {
                        smoothed
                    } else {
                        inv_llama
                    }
                })
                .collect()
        }
    }
}

/// Rotary position embeddings for one head dimension and frequency set (HF LLaMA layout).
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Arc<[f32]>,
    head_dim: usize,
}

impl RotaryEmbedding {
    /// Frequencies from [`inv_freq`]. Errors if `head_dim` is zero or odd, `theta` is not
    /// positive, or a scaling factor is not positive (llama3 also needs
    /// `high_freq_factor > low_freq_factor` and a non-zero original length).
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            bail!("rope: head_dim must be even and positive, got {head_dim}");
        }
        // Also rejects NaN.
        let positive = |v: f64| v > 0.0;
        if !(positive(theta) && theta.is_finite()) {
            bail!("rope: theta must be positive and finite, got {theta}");
        }
        match scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                if !positive(*factor) {
                    bail!("rope: linear scaling factor must be positive, got {factor}");
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if !(positive(*factor)
                    && positive(*low_freq_factor)
                    && positive(high_freq_factor - low_freq_factor))
                    || *original_max_position_embeddings == 0
                {
                    bail!(
                        "rope: llama3 scaling needs factor > 0, 0 < low_freq_factor < \
                         high_freq_factor and original_max_position_embeddings > 0, got {scaling:?}"
                    );
                }
            }
        }
        Ok(Self {
            inv_freq: inv_freq(head_dim, theta, scaling).into(),
            head_dim,
        })
    }

    /// The head dimension the embedding rotates.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The `head_dim / 2` inverse frequencies.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)` of `pos as f32 * inv_freq[i]` (f32 product, as HF's float32 matmul of
    /// inv_freq by the positions), each `positions.len() * head_dim / 2`, row-major by position.
    /// (HF's `emb = cat(freqs, freqs)` repeats them for the second half of the head.)
    fn cos_sin(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        cos.par_chunks_mut(half)
            .zip(sin.par_chunks_mut(half))
            .zip(positions.par_iter())
            .with_min_len((1024 / half).max(1))
            .for_each(|((c, s), &p)| {
                let p = p as f32;
                for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(self.inv_freq.iter()) {
                    let a = p * f;
                    *c = a.cos();
                    *s = a.sin();
                }
            });
        (cos, sin)
    }

    /// Rotates `x` by the angles of `positions`: `x * cos + rotate_half(x) * sin`.
    ///
    /// - `x`: `(batch, seq, heads, head_dim)`, f32, bf16 or f16, any strides.
    /// - `positions`: the global position of each of the `seq` rows (any values, e.g. a zigzag
    ///   permutation for context parallelism), `positions.len() == seq`.
    /// - Returns the rotated tensor, same shape and dtype, differentiable with respect to `x`
    ///   (the backward rotates the gradient by the opposite angle).
    ///
    /// As in HF, cos/sin are computed in f32 and cast to x's dtype before the multiply-add, and
    /// for bf16/f16 each product and the sum are rounded to the dtype. On the CPU a fused
    /// kernel; on other devices the same function from differentiable candle ops
    /// ([`apply_composite`](Self::apply_composite)).
    pub fn apply(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor> {
        self.check(x, positions)?;
        let (cos, sin) = self.cos_sin(positions);
        if all_cpu(&[x]) {
            x.apply_op1(RopeOp {
                cos: cos.into(),
                sin: sin.into(),
                inverse: false,
            })
        } else {
            self.composite(x, positions.len(), cos, sin)
        }
    }

    /// [`apply`](Self::apply) built from differentiable candle ops, on any device (what `apply`
    /// runs off the CPU; public so that tests can run it on the CPU). Same validation and
    /// errors.
    ///
    /// HF's `x * cos + rotate_half(x) * sin` in x's dtype, with the same f32 cos/sin tables
    /// cast to the dtype: each product and the sum rounded to the dtype exactly as the
    /// kernel rounds them. candle's autograd then computes `g * cos + rotate_half^T(g * sin)`,
    /// rounded at the same points as the kernel's backward (the rotation by the opposite angle).
    #[doc(hidden)]
    pub fn apply_composite(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor> {
        self.check(x, positions)?;
        let (cos, sin) = self.cos_sin(positions);
        self.composite(x, positions.len(), cos, sin)
    }

    fn composite(&self, x: &Tensor, seq: usize, cos: Vec<f32>, sin: Vec<f32>) -> Result<Tensor> {
        let half = self.head_dim / 2;
        // (seq, half) f32 tables, cast to x's dtype and repeated for the second half of the head
        // (HF's `cat(freqs, freqs)`), broadcast over batch and heads.
        let table = |v: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_vec(v, (seq, half), x.device())?.to_dtype(x.dtype())?;
            Tensor::cat(&[&t, &t], 1)?.reshape((1, seq, 1, 2 * half))
        };
        let (cos, sin) = (table(cos)?, table(sin)?);
        let x1 = x.narrow(3, 0, half)?;
        let x2 = x.narrow(3, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
        x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
    }

    /// The checks of [`apply`](Self::apply), shared by both paths.
    fn check(&self, x: &Tensor, positions: &[u32]) -> Result<()> {
        const OP: &str = "rope";
        check_float(OP, "x", x.dtype())?;
        let (_b, seq, _h, d) = match x.dims() {
            &[b, s, h, d] => (b, s, h, d),
            _ => bail!(
                "{OP}: x must be (batch, seq, heads, head_dim), got shape {:?}",
                x.shape()
            ),
        };
        if d != self.head_dim {
            bail!(
                "{OP}: x has head_dim {d}, the embedding was built for {}",
                self.head_dim
            );
        }
        if positions.len() != seq {
            bail!(
                "{OP}: {} positions given for a sequence of {seq} rows",
                positions.len()
            );
        }
        Ok(())
    }
}

/// Rotation of a `(batch, seq, heads, 2 * half)` tensor by per-row angles given as `(seq, half)`
/// cos/sin tables; `inverse` rotates by the opposite angles.
#[derive(Clone)]
struct RopeOp {
    cos: Arc<[f32]>,
    sin: Arc<[f32]>,
    inverse: bool,
}

fn rope_fwd<T: Elem>(op: &RopeOp, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let (seq, heads, d) = match l.dims() {
        &[_, s, h, d] => (s, h, d),
        _ => bail!("cpl-rope: expected a rank-4 tensor, got {:?}", l.shape()),
    };
    let half = d / 2;
    if op.cos.len() != seq * half || op.sin.len() != seq * half {
        bail!(
            "cpl-rope: cos/sin tables do not match shape {:?}",
            l.shape()
        );
    }
    let x = strided(T::cpu_storage_as_slice(s)?, l);
    let mut out = vec![T::from_f32(0.0); x.len()];
    let row = heads * d;
    if row > 0 {
        // cos/sin cast to x's dtype, as HF does before the multiply-add.
        let ct: Vec<f32> = op.cos.iter().map(|&c| T::round(c)).collect();
        let st: Vec<f32> = op
            .sin
            .iter()
            .map(|&v| {
                if op.inverse {
                    -T::round(v)
                } else {
                    T::round(v)
                }
            })
            .collect();
        out.par_chunks_mut(row)
            .zip(x.par_chunks(row))
            .enumerate()
            .with_min_len((4096 / row).max(1))
            .for_each(|(r, (o, xr))| {
                let p = r % seq;
                let c = &ct[p * half..(p + 1) * half];
                let sn = &st[p * half..(p + 1) * half];
                for (oh, xh) in o.chunks_exact_mut(d).zip(xr.chunks_exact(d)) {
                    let (o1, o2) = oh.split_at_mut(half);
                    let (x1, x2) = xh.split_at(half);
                    for j in 0..half {
                        let a = x1[j].to_f32();
                        let b = x2[j].to_f32();
                        // HF: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype.
                        o1[j] = T::from_f32(T::round(a * c[j]) - T::round(b * sn[j]));
                        o2[j] = T::from_f32(T::round(b * c[j]) + T::round(a * sn[j]));
                    }
                }
            });
    }
    Ok((T::to_cpu_storage_owned(out), l.shape().clone()))
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "cpl-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s, rope_fwd(self, s, l))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The rotation is orthogonal: its transpose is the rotation by the opposite angle.
        let inv = RopeOp {
            inverse: !self.inverse,
            ..self.clone()
        };
        Ok(Some(grad.apply_op1_no_bwd(&inv)?))
    }
}
