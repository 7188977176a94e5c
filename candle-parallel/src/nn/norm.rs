//! Normalisation layers. They act on each token alone, so they need no communication: under
//! TP-sp each tensor-parallel rank normalises its own part of the tokens, and the gradient of
//! the (replicated) weights is summed over the tensor-parallel group with the others (the
//! context's [`ParallelCtx::grad_group`](super::ParallelCtx::grad_group)).

use candle_core::{DType, Tensor, D};

use super::{ParallelCtx, ParamBuilder};
use crate::error::Result;
use crate::ops::rms_norm;

/// The shape of a normalisation layer over the last dim: `hidden_size` features, `eps` added
/// to the variance, and for [`LayerNorm`] whether it has a `bias` and whether it has learned
/// parameters at all (`affine`; PyTorch's `elementwise_affine`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormConfig {
    pub hidden_size: usize,
    pub eps: f64,
    pub bias: bool,
    pub affine: bool,
}

impl NormConfig {
    /// Without bias (RMSNorm; LayerNorm as in some vision towers and DiT blocks, set `bias`).
    pub fn new(hidden_size: usize, eps: f64) -> Self {
        Self {
            hidden_size,
            eps,
            bias: false,
            affine: true,
        }
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
/// fused op with backward of [`crate::ops::rms_norm`]. `weight` `(hidden)`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(cfg: &NormConfig, vb: ParamBuilder, _ctx: &ParallelCtx) -> Result<Self> {
        Ok(Self {
            weight: vb.get(cfg.hidden_size, "weight")?,
            eps: cfg.eps,
        })
    }

    /// `x` `(.., hidden)` → the same shape and dtype. Local.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, &self.weight, self.eps)?)
    }
}

/// LayerNorm (`(x - mean) / sqrt(var + eps) * weight (+ bias)`, statistics in f32) written
/// with differentiable primitives: candle's fused `layer_norm` drops gradients. `weight` and
/// `bias` `(hidden)`.
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
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let y = match &self.weight {
            Some(w) => normed.broadcast_mul(&w.to_dtype(DType::F32)?)?,
            None => normed,
        };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?)?,
            None => y,
        };
        Ok(y.to_dtype(dtype)?)
    }
}
