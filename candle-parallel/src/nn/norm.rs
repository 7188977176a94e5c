//! Normalisation layers. They act on each token alone, so they need no communication: under
//! TP-sp each tensor-parallel rank normalises its own part of the tokens, and the gradient of
//! the (replicated) weights is summed over the tensor-parallel group with the others (the
//! context's [`ParallelCtx::grad_group`](super::ParallelCtx::grad_group)).

use candle_core::{DType, Tensor, D};

use super::{ParallelCtx, ParamBuilder};
use crate::collectives::copy_to_parallel_region;
use crate::comm::Comm;
use crate::error::Result;
use crate::ops::{layer_norm, layer_norm_modulate, rms_norm};

/// The shape of a normalisation layer over the last dim: `hidden_size` features, `eps` added
/// to the variance, and for [`LayerNorm`] whether it has a `bias` and whether it has learned
/// parameters at all (`affine`; PyTorch's `elementwise_affine`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormConfig {
    pub hidden_size: usize,
    pub eps: f64,
    pub bias: bool,
    pub affine: bool,
    /// [`RmsNorm`] scales by `1 + weight` (Gemma's stored weights are offsets from one).
    pub unit_offset: bool,
}

impl NormConfig {
    /// Without bias (RMSNorm; LayerNorm as in some vision towers and DiT blocks, set `bias`).
    pub fn new(hidden_size: usize, eps: f64) -> Self {
        Self {
            hidden_size,
            eps,
            bias: false,
            affine: true,
            unit_offset: false,
        }
    }

    /// An [`RmsNorm`] that scales by `1 + weight` (Gemma).
    pub fn with_unit_offset(mut self, unit_offset: bool) -> Self {
        self.unit_offset = unit_offset;
        self
    }

    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// A [`LayerNorm`] without weight or bias (`elementwise_affine=False`: DiT's adaLN norms).
    pub fn without_affine(mut self) -> Self {
        self.affine = false;
        self.bias = false;
        self
    }
}

/// RMSNorm with Hugging Face's `LlamaRMSNorm` semantics (`weight * x / rms(x)`, in f32), by the
/// fused op with backward of [`crate::ops::rms_norm`]. `weight` `(hidden)`. With
/// [`NormConfig::unit_offset`] it is `GemmaRMSNorm`: `(1 + weight) * x / rms(x)`, the scale and
/// the product in f32 and only the result rounded to `x`'s dtype.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    unit_offset: bool,
    /// All-reduce the weight's gradient over this group in backward (see
    /// [`RmsNorm::new_per_head`]).
    grad_reduce: Option<Comm>,
}

impl RmsNorm {
    pub fn new(cfg: &NormConfig, vb: ParamBuilder, _ctx: &ParallelCtx) -> Result<Self> {
        Ok(Self {
            weight: vb.get(cfg.hidden_size, "weight")?,
            eps: cfg.eps,
            unit_offset: cfg.unit_offset,
            grad_reduce: None,
        })
    }

    /// A norm over each attention head's features (Qwen3's and Gemma 3's `q_norm`, `k_norm`):
    /// applied to this tensor-parallel rank's heads only, so its weight's gradient is partial
    /// over tp. Under TP-sp the context's gradient group sums it over tp like every replicated
    /// weight's; otherwise the backward all-reduces it over tp here, so that every rank holds
    /// the whole gradient as for the other replicated weights.
    pub fn new_per_head(cfg: &NormConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let mut norm = Self::new(cfg, vb, ctx)?;
        let tp = ctx.tp();
        if tp.size() > 1 && !tp.sequence_parallel() {
            norm.grad_reduce = Some(tp.comm().clone());
        }
        Ok(norm)
    }

    /// `x` `(.., hidden)` → the same shape and dtype. Local (a per-head norm's backward is
    /// collective over tp).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = match &self.grad_reduce {
            Some(comm) => copy_to_parallel_region(&self.weight, comm)?,
            None => self.weight.clone(),
        };
        if !self.unit_offset {
            return Ok(rms_norm(x, &weight, self.eps)?);
        }
        let scale = (weight.to_dtype(DType::F32)? + 1.0)?;
        let y = rms_norm(&x.to_dtype(DType::F32)?, &scale, self.eps)?;
        Ok(y.to_dtype(x.dtype())?)
    }
}

/// LayerNorm (`(x - mean) / sqrt(var + eps) * weight (+ bias)`) by the fused op with backward
/// of [`crate::ops::layer_norm`] (statistics in f64, the rest in f32, rounded once to x's
/// dtype). `weight` and `bias` `(hidden)`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    eps: f64,
}

impl LayerNorm {
    /// Loads `weight` (and `bias`) unless the config has no affine parameters.
    pub fn new(cfg: &NormConfig, vb: ParamBuilder, _ctx: &ParallelCtx) -> Result<Self> {
        Ok(Self {
            weight: if cfg.affine {
                Some(vb.get(cfg.hidden_size, "weight")?)
            } else {
                None
            },
            bias: if cfg.affine && cfg.bias {
                Some(vb.get(cfg.hidden_size, "bias")?)
            } else {
                None
            },
            eps: cfg.eps,
        })
    }

    /// `x` `(.., hidden)` → the same shape and dtype. Local.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params = [&self.weight, &self.bias];
        if params
            .iter()
            .flat_map(|p| p.iter())
            .all(|p| p.dtype() == x.dtype())
        {
            return Ok(layer_norm(
                x,
                self.weight.as_ref(),
                self.bias.as_ref(),
                self.eps,
            )?);
        }
        // Parameters in another dtype than x: all in f32, rounded once to x's dtype.
        let f32 = |p: &Option<Tensor>| p.as_ref().map(|p| p.to_dtype(DType::F32)).transpose();
        let (w, b) = (f32(&self.weight)?, f32(&self.bias)?);
        let y = layer_norm(&x.to_dtype(DType::F32)?, w.as_ref(), b.as_ref(), self.eps)?;
        Ok(y.to_dtype(x.dtype())?)
    }

    /// adaLN modulation of the norm (DiT): `norm(x) · (1 + scale) + shift`, `x` `(batch, ..,
    /// hidden)`, `shift` and `scale` `(batch, hidden)` (one per sample), all of x's dtype. One
    /// fused op ([`crate::ops::layer_norm_modulate`]) for a norm without affine parameters (DiT's
    /// adaLN norms); otherwise the norm and then the modulation in x's dtype. Local.
    pub fn forward_modulated(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        if self.weight.is_none() && self.bias.is_none() {
            return Ok(layer_norm_modulate(x, shift, scale, self.eps)?);
        }
        let y = self.forward(x)?;
        let mut dims = vec![1; y.rank()];
        dims[0] = y.dim(0)?;
        dims[y.rank() - 1] = y.dim(D::Minus1)?;
        let scale = (scale.reshape(dims.as_slice())? + 1.0)?;
        Ok(y.broadcast_mul(&scale)?
            .broadcast_add(&shift.reshape(dims)?)?)
    }
}
