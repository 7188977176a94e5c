//! Rotary position embeddings as in Hugging Face transformers (non-interleaved, `rotate_half`), as a
//! custom op with a backward on the CPU (a composite of differentiable candle ops elsewhere),
//! for arbitrary (e.g. zigzag-permuted) global positions.
//!
//! Every RoPE type of transformers' `ROPE_INIT_FUNCTIONS` a causal LM uses is here
//! ([`RopeScaling`]): `default`, `linear`, `dynamic` (NTK-aware), `yarn`, `longrope` and
//! `llama3`, with partial rotation (`partial_rotary_factor`: only the first dims of each head
//! rotate, the rest pass through, as Phi-3's `apply_rotary_pos_emb`) and the attention factor
//! of yarn and longrope (cos and sin multiplied by it, as transformers' rotary modules do).
//!
//! Two types depend on the length of the sequence, which transformers takes as
//! `max(position_ids) + 1` of each forward (`dynamic_rope_update`):
//! - `dynamic`: beyond `max_position_embeddings` the base grows with the length; at or below it
//!   the original frequencies are used;
//! - `longrope`: the `short_factor`s up to `original_max_position_embeddings`, the
//!   `long_factor`s beyond.
//!
//! [`RotaryEmbedding::apply`] takes that length from the positions it is given;
//! [`RotaryEmbedding::apply_seq`] takes it explicitly, for a rank that holds only a shard of the
//! positions (sequence parallelism) and must rotate with the frequencies of the whole sequence.

use super::{all_cpu, check_float, dispatch_float, strided, Elem};
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::cmp::Ordering;
use std::sync::Arc;

/// The RoPE types of transformers (`rope_type` of `rope_scaling` / `rope_parameters`), with
/// every parameter resolved (defaults applied, see `models::rope` for the config parsing).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "default"`: `inv_freq[i] = 1 / theta^(2i / dim)`.
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
    /// `rope_type: "dynamic"` (NTK-aware): for a sequence of `seq_len >
    /// max_position_embeddings` tokens the default frequencies of the base
    /// `theta · (factor · seq_len / max_position_embeddings − (factor − 1))^(dim / (dim − 2))`;
    /// the default frequencies otherwise.
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    /// `rope_type: "yarn"`: the default frequencies (extrapolation) above the `beta_fast`
    /// rotations-per-context boundary, the frequencies divided by `factor` (interpolation) below
    /// `beta_slow`, a linear ramp between (its bounds floored/ceiled when `truncate`); cos and
    /// sin multiplied by `attention_factor` (see [`yarn_attention_factor`]).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        attention_factor: f64,
    },
    /// `rope_type: "longrope"`: `inv_freq[i] = 1 / (ext[i] · theta^(2i / dim))` with `ext` the
    /// `short_factor`s for sequences up to `original_max_position_embeddings` tokens and the
    /// `long_factor`s beyond (one per frequency); cos and sin multiplied by
    /// `attention_factor` (see [`longrope_attention_factor`]).
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The `rope_type` name of transformers.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn { .. } => "yarn",
            RopeScaling::LongRope { .. } => "longrope",
        }
    }

    /// The factor cos and sin are multiplied by (1 except for yarn and longrope).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// Whether the frequencies depend on the sequence length (dynamic, longrope).
    pub fn depends_on_length(&self) -> bool {
        matches!(
            self,
            RopeScaling::Dynamic { .. } | RopeScaling::LongRope { .. }
        )
    }
}

/// transformers' `get_mscale(scale, mscale)`: `0.1 · mscale · ln(scale) + 1`, 1 for `scale <= 1`.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The default yarn attention factor of transformers (`_compute_yarn_parameters`):
/// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both are given and
/// non-zero (Python truthiness), else `get_mscale(factor, 1)`.
pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, mscale_all_dim: Option<f64>) -> f64 {
    match (mscale, mscale_all_dim) {
        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get_mscale(factor, m) / get_mscale(factor, a),
        _ => get_mscale(factor, 1.0),
    }
}

/// The default longrope attention factor of transformers (`_compute_longrope_parameters`):
/// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`, 1 for `factor <= 1`.
pub fn longrope_attention_factor(factor: f64, original_max_position_embeddings: usize) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original_max_position_embeddings as f64).ln()).sqrt()
    }
}

/// `1 / base^(i / dim)` for `i = 0, 2, ..` below `dim` (`ceil(dim / 2)` values), the default
/// frequencies as transformers computes them: `i / dim` in f32, the f32 `base` raised to it
/// (evaluated in f64, rounded once), the reciprocal in f32.
fn default_inv_freq(dim: usize, base: f32) -> impl Iterator<Item = f32> {
    let d = dim as f32;
    let base = base as f64;
    (0..dim).step_by(2).map(move |i| {
        let e = i as f32 / d;
        1.0f32 / base.powf(e as f64) as f32
    })
}

/// The inverse frequencies of a head whose first `dim` dims rotate (`int(head_dim ·
/// partial_rotary_factor)` in transformers), `ceil(dim / 2)` values, as transformers computes
/// them at initialisation (`_compute_default_rope_parameters` and the `ROPE_INIT_FUNCTIONS`
/// with no sequence length: the short factors of longrope, the unscaled base of dynamic).
/// [`inv_freq_at`] gives those of a sequence length.
///
/// Rounding: transformers evaluates every step in float32 tensors, with Python scalars cast to
/// float32 where they meet a tensor, and pure Python (f64) arithmetic where only scalars are
/// involved (the llama3 wavelength bounds, the yarn correction range, the dynamic base at
/// initialisation). This function replays the same sequence of f32 and f64 operations (so each
/// of `i / dim`, `1 / p`, `/ factor`, `2π / inv_freq`, the llama3 comparisons and smoothing, the
/// yarn ramp and blend, the longrope products is rounded exactly as torch rounds it), except
/// `base ** e` (and the dynamic `** (dim / (dim − 2))`), which is evaluated in f64 and rounded
/// once to f32 (torch uses a float32 `pow` accurate to about 1 ulp, so the two may differ in the
/// last bit). Parameters are not validated here (see [`RotaryEmbedding::new`]).
pub fn inv_freq(dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    inv_freq_impl(dim, theta, scaling, None)
}

/// [`inv_freq`] for a forward over a sequence of `seq_len` tokens (transformers'
/// `max(position_ids) + 1`): what `dynamic_rope_update` makes the rotary module use. Only
/// dynamic and longrope depend on it.
pub fn inv_freq_at(dim: usize, theta: f64, scaling: &RopeScaling, seq_len: usize) -> Vec<f32> {
    inv_freq_impl(dim, theta, scaling, Some(seq_len))
}

fn inv_freq_impl(
    dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    seq_len: Option<usize>,
) -> Vec<f32> {
    // torch: `base ** t` with a float32 tensor `t` casts the Python base to float32.
    let base = theta as f32;
    match scaling {
        RopeScaling::Default => default_inv_freq(dim, base).collect(),
        RopeScaling::Linear { factor } => {
            let factor = *factor as f32;
            default_inv_freq(dim, base).map(|v| v / factor).collect()
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
            default_inv_freq(dim, base)
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
        RopeScaling::Dynamic {
            factor,
            max_position_embeddings,
        } => {
            let mpe = *max_position_embeddings;
            let exponent = dim as f64 / (dim as f64 - 2.0);
            match seq_len {
                // `dynamic_frequency_update` recomputes only beyond the original length, with
                // `seq_len` a 0-dim int64 tensor: every step a float32 tensor op.
                Some(s) if s > mpe => {
                    let t = *factor as f32 * s as f32;
                    let t = t / mpe as f32;
                    let t = t - (factor - 1.0) as f32;
                    // `tensor ** python_float`: torch raises to the f64 exponent.
                    let t = (t as f64).powf(exponent) as f32;
                    default_inv_freq(dim, base * t).collect()
                }
                // At initialisation (`seq_len = None` → `max_position_embeddings`): Python
                // floats, the base rounded to f32 when it meets the exponent tensor.
                _ => {
                    let m = mpe as f64;
                    let scaled = theta * (factor * m / m - (factor - 1.0)).powf(exponent);
                    default_inv_freq(dim, scaled as f32).collect()
                }
            }
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            // The correction range in Python floats, with the unrounded base.
            let omp = *original_max_position_embeddings as f64;
            let d = dim as f64;
            let correction_dim = |rotations: f64| {
                (d * (omp / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
            if *truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let low = low.max(0.0);
            let mut high = high.min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            let (low32, span32) = (low as f32, (high - low) as f32);
            let (factor32, d) = (*factor as f32, dim as f32);
            (0..dim)
                .step_by(2)
                .enumerate()
                .map(|(j, i)| {
                    let pos_freq = (base as f64).powf((i as f32 / d) as f64) as f32;
                    let extrapolation = 1.0f32 / pos_freq;
                    let interpolation = 1.0f32 / (factor32 * pos_freq);
                    let ramp = ((j as f32 - low32) / span32).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0f32 - ramp;
                    interpolation * (1.0f32 - extrapolation_factor)
                        + extrapolation * extrapolation_factor
                })
                .collect()
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            ..
        } => {
            let ext = match seq_len {
                Some(s) if s > *original_max_position_embeddings => long_factor,
                _ => short_factor,
            };
            let d = dim as f32;
            (0..dim)
                .step_by(2)
                .zip(ext)
                .map(|(i, &f)| {
                    let p = (base as f64).powf((i as f32 / d) as f64) as f32;
                    1.0f32 / (f as f32 * p)
                })
                .collect()
        }
    }
}

/// Rotary position embeddings for one head dimension and RoPE type (transformers' layout:
/// `rotate_half` over the first `rotated_dims()` dims of each head, the rest passed through).
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// The frequencies at initialisation (and of every length for the types that do not depend
    /// on it).
    inv_freq: Arc<[f32]>,
    /// Longrope: the frequencies beyond `original_max_position_embeddings`.
    long_inv_freq: Option<Arc<[f32]>>,
    head_dim: usize,
    dim: usize,
    theta: f64,
    scaling: RopeScaling,
}

impl RotaryEmbedding {
    /// Rotation of whole heads: [`with_rotary_dim`](Self::with_rotary_dim) with
    /// `dim = head_dim`.
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Self> {
        Self::with_rotary_dim(head_dim, head_dim, theta, scaling)
    }

    /// Frequencies from [`inv_freq`] for `dim` (transformers' `int(head_dim ·
    /// partial_rotary_factor)`): the first `2 · ceil(dim / 2)` dims of each head rotate, the
    /// others pass through unchanged.
    ///
    /// Errors if `head_dim` is zero, if `dim` is zero or rotates more dims than the head has,
    /// if `theta` is not positive and finite, or if a scaling parameter is out of range: every
    /// factor positive and finite (llama3 also needs `low_freq_factor < high_freq_factor`),
    /// lengths positive, dynamic needs `dim > 2` (its exponent `dim / (dim − 2)`), yarn an even
    /// `dim` (transformers' ramp has `dim / 2` entries), longrope one short and one long factor
    /// per frequency, attention factors positive and finite.
    pub fn with_rotary_dim(
        head_dim: usize,
        dim: usize,
        theta: f64,
        scaling: &RopeScaling,
    ) -> Result<Self> {
        if head_dim == 0 {
            bail!("rope: head_dim must be positive");
        }
        let freqs = dim.div_ceil(2);
        if dim == 0 || 2 * freqs > head_dim {
            bail!(
                "rope: cannot rotate {} of the {head_dim} dims of a head (rotary dim {dim}; a \
                 whole head must have an even head_dim)",
                2 * freqs
            );
        }
        // Also rejects NaN.
        let positive = |v: f64| v > 0.0 && v.is_finite();
        if !positive(theta) {
            bail!("rope: theta must be positive and finite, got {theta}");
        }
        let name = scaling.name();
        let bad = |what: &str| -> Result<Self> {
            bail!("rope: {name} scaling needs {what}, got {scaling:?}")
        };
        match scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                if !positive(*factor) {
                    return bad("factor > 0");
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
                    && positive(*high_freq_factor)
                    && positive(high_freq_factor - low_freq_factor))
                    || *original_max_position_embeddings == 0
                {
                    return bad("factor > 0, 0 < low_freq_factor < high_freq_factor and \
                         original_max_position_embeddings > 0");
                }
            }
            RopeScaling::Dynamic {
                factor,
                max_position_embeddings,
            } => {
                if !positive(*factor) || *max_position_embeddings == 0 {
                    return bad("factor > 0 and max_position_embeddings > 0");
                }
                if dim <= 2 {
                    return bad("a rotary dim above 2");
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if !(positive(*factor) && positive(*attention_factor))
                    || *original_max_position_embeddings == 0
                    || !(beta_fast.is_finite() && beta_slow.is_finite())
                    || *beta_fast == 0.0
                    || *beta_slow == 0.0
                {
                    return bad(
                        "factor > 0, attention_factor > 0, original_max_position_embeddings > 0 \
                         and finite non-zero beta_fast, beta_slow",
                    );
                }
                if !dim.is_multiple_of(2) {
                    return bad("an even rotary dim");
                }
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            } => {
                if short_factor.len() != freqs || long_factor.len() != freqs {
                    return bad(&format!(
                        "{freqs} short_factor and long_factor values (one per frequency)"
                    ));
                }
                if !(short_factor.iter().chain(long_factor).all(|&f| positive(f))
                    && positive(*attention_factor))
                    || *original_max_position_embeddings == 0
                {
                    return bad(
                        "positive short_factor, long_factor and attention_factor and \
                         original_max_position_embeddings > 0",
                    );
                }
            }
        }
        let long_inv_freq = match scaling {
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => {
                Some(inv_freq_at(dim, theta, scaling, original_max_position_embeddings + 1).into())
            }
            _ => None,
        };
        Ok(Self {
            inv_freq: inv_freq(dim, theta, scaling).into(),
            long_inv_freq,
            head_dim,
            dim,
            theta,
            scaling: scaling.clone(),
        })
    }

    /// The head dimension the embedding rotates.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// How many leading dims of each head rotate (`2 · inv_freq().len()`); the others pass
    /// through.
    pub fn rotated_dims(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// The RoPE type and its parameters.
    pub fn scaling(&self) -> &RopeScaling {
        &self.scaling
    }

    /// The base `theta`.
    pub fn theta(&self) -> f64 {
        self.theta
    }

    /// The factor cos and sin are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        self.scaling.attention_factor()
    }

    /// The inverse frequencies at initialisation (`ceil(dim / 2)` values): those of every
    /// sequence for the types that do not depend on its length, of sequences up to the original
    /// length for dynamic and longrope (see [`inv_freq_at`](Self::inv_freq_at)).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The inverse frequencies a forward over a sequence of `seq_len` tokens rotates with (see
    /// [`inv_freq_at`](fn@inv_freq_at)).
    pub fn inv_freq_at(&self, seq_len: usize) -> Cow<'_, [f32]> {
        match &self.scaling {
            RopeScaling::Dynamic {
                max_position_embeddings,
                ..
            } if seq_len > *max_position_embeddings => {
                Cow::Owned(inv_freq_at(self.dim, self.theta, &self.scaling, seq_len))
            }
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } if seq_len > *original_max_position_embeddings => {
                Cow::Borrowed(self.long_inv_freq.as_deref().unwrap_or(&self.inv_freq))
            }
            _ => Cow::Borrowed(&self.inv_freq),
        }
    }

    /// `(cos, sin)` of `pos as f32 * inv_freq[i]` (f32 product, as transformers' float32
    /// `position_ids * inv_freq`) times the attention factor (an f32 product, as transformers'
    /// `emb.cos() * attention_scaling`), each `positions.len() * rotated_dims() / 2`, row-major by
    /// position, for a sequence of `seq_len` tokens. (transformers' `emb = cat(freqs, freqs)`
    /// repeats them for the second half of the rotated dims.)
    fn cos_sin(&self, positions: &[u32], seq_len: usize) -> (Vec<f32>, Vec<f32>) {
        let inv_freq = self.inv_freq_at(seq_len);
        let half = inv_freq.len();
        let scale = self.attention_factor() as f32;
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        cos.par_chunks_mut(half)
            .zip(sin.par_chunks_mut(half))
            .zip(positions.par_iter())
            .with_min_len((1024 / half).max(1))
            .for_each(|((c, s), &p)| {
                let p = p as f32;
                for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(inv_freq.iter()) {
                    let a = p * f;
                    *c = a.cos() * scale;
                    *s = a.sin() * scale;
                }
            });
        (cos, sin)
    }

    /// The rows of the cos and sin tables transformers' rotary module returns for `positions`
    /// in a sequence of `seq_len` tokens, each `rotated_dims()` wide (`cat(freqs, freqs)`), f32.
    /// For tests and inspection.
    pub fn cos_sin_rows(
        &self,
        positions: &[u32],
        seq_len: usize,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let (cos, sin) = self.cos_sin(positions, seq_len);
        let half = self.inv_freq.len();
        let rows = |t: Vec<f32>| -> Vec<Vec<f32>> {
            t.chunks(half.max(1))
                .map(|r| r.iter().chain(r.iter()).copied().collect())
                .collect()
        };
        (rows(cos), rows(sin))
    }

    /// Rotates `x` by the angles of `positions`: `x * cos + rotate_half(x) * sin` over the
    /// rotated dims, the others unchanged, with the frequencies of a sequence of
    /// `max(positions) + 1` tokens (transformers' `dynamic_rope_update`: right for a whole
    /// sequence and for a generation step; a shard of a sequence needs
    /// [`apply_seq`](Self::apply_seq)).
    ///
    /// - `x`: `(batch, seq, heads, head_dim)`, f32, bf16 or f16, any strides.
    /// - `positions`: the global position of each of the `seq` rows (any values, e.g. a zigzag
    ///   permutation for context parallelism), `positions.len() == seq`.
    /// - Returns the rotated tensor, same shape and dtype, differentiable with respect to `x`
    ///   (the backward rotates the gradient by the opposite angle).
    ///
    /// As in transformers, cos/sin are computed in f32 and cast to x's dtype before the
    /// multiply-add, and for bf16/f16 each product and the sum are rounded to the dtype. On the
    /// CPU a fused kernel; on other devices the same function from differentiable candle ops
    /// ([`apply_composite`](Self::apply_composite)).
    pub fn apply(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor> {
        self.apply_seq(x, positions, Self::length_of(positions))
    }

    /// [`apply`](Self::apply) with the frequencies of a sequence of `seq_len` tokens, of which
    /// `positions` may be any subset (a sequence-parallel shard): every shard of a sequence is
    /// then rotated exactly as the whole sequence on one rank. Errors if a position is not below
    /// `seq_len`.
    pub fn apply_seq(&self, x: &Tensor, positions: &[u32], seq_len: usize) -> Result<Tensor> {
        self.check(x, positions, seq_len)?;
        let (cos, sin) = self.cos_sin(positions, seq_len);
        if all_cpu(&[x]) {
            x.apply_op1(RopeOp {
                cos: cos.into(),
                sin: sin.into(),
                half: self.inv_freq.len(),
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
    /// transformers' `x * cos + rotate_half(x) * sin` in x's dtype, with the same f32 cos/sin
    /// tables cast to the dtype: each product and the sum rounded to the dtype exactly as the
    /// kernel rounds them. candle's autograd then computes `g * cos + rotate_half^T(g * sin)`,
    /// rounded at the same points as the kernel's backward (the rotation by the opposite angle).
    #[doc(hidden)]
    pub fn apply_composite(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor> {
        let seq_len = Self::length_of(positions);
        self.check(x, positions, seq_len)?;
        let (cos, sin) = self.cos_sin(positions, seq_len);
        self.composite(x, positions.len(), cos, sin)
    }

    /// transformers' `max(position_ids) + 1`.
    fn length_of(positions: &[u32]) -> usize {
        positions.iter().max().map_or(0, |&p| p as usize + 1)
    }

    fn composite(&self, x: &Tensor, seq: usize, cos: Vec<f32>, sin: Vec<f32>) -> Result<Tensor> {
        let half = self.inv_freq.len();
        // (seq, half) f32 tables, cast to x's dtype and repeated for the second half of the
        // rotated dims (transformers' `cat(freqs, freqs)`), broadcast over batch and heads.
        let table = |v: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_vec(v, (seq, half), x.device())?.to_dtype(x.dtype())?;
            Tensor::cat(&[&t, &t], 1)?.reshape((1, seq, 1, 2 * half))
        };
        let (cos, sin) = (table(cos)?, table(sin)?);
        let xr = x.narrow(3, 0, 2 * half)?;
        let x1 = xr.narrow(3, 0, half)?;
        let x2 = xr.narrow(3, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
        let out = (xr.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?;
        if 2 * half == self.head_dim {
            Ok(out)
        } else {
            let pass = x.narrow(3, 2 * half, self.head_dim - 2 * half)?;
            Tensor::cat(&[&out, &pass], 3)
        }
    }

    /// The checks of [`apply_seq`](Self::apply_seq), shared by both paths.
    fn check(&self, x: &Tensor, positions: &[u32], seq_len: usize) -> Result<()> {
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
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= seq_len) {
            bail!("{OP}: position {p} outside a sequence of {seq_len} tokens");
        }
        Ok(())
    }
}

/// Rotation of the first `2 * half` dims of a `(batch, seq, heads, head_dim)` tensor by per-row
/// angles given as `(seq, half)` cos/sin tables (the other dims copied); `inverse` rotates by
/// the opposite angles.
#[derive(Clone)]
struct RopeOp {
    cos: Arc<[f32]>,
    sin: Arc<[f32]>,
    half: usize,
    inverse: bool,
}

fn rope_fwd<T: Elem>(op: &RopeOp, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let (seq, heads, d) = match l.dims() {
        &[_, s, h, d] => (s, h, d),
        _ => bail!("cpl-rope: expected a rank-4 tensor, got {:?}", l.shape()),
    };
    let half = op.half;
    if op.cos.len() != seq * half || op.sin.len() != seq * half || 2 * half > d {
        bail!(
            "cpl-rope: cos/sin tables do not match shape {:?}",
            l.shape()
        );
    }
    let x = strided(T::cpu_storage_as_slice(s)?, l);
    let mut out = vec![T::from_f32(0.0); x.len()];
    let row = heads * d;
    if row > 0 {
        // cos/sin cast to x's dtype, as transformers does before the multiply-add.
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
                    let (o12, o_pass) = oh.split_at_mut(2 * half);
                    let (x12, x_pass) = xh.split_at(2 * half);
                    o_pass.copy_from_slice(x_pass);
                    let (o1, o2) = o12.split_at_mut(half);
                    let (x1, x2) = x12.split_at(half);
                    for j in 0..half {
                        let a = x1[j].to_f32();
                        let b = x2[j].to_f32();
                        // x * cos + cat(-x2, x1) * sin, each product rounded to the dtype.
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
