//! The feed-forward block: a column-parallel up projection (and gate), the activation, a
//! row-parallel down projection (Megatron's MLP: one all-reduce, or under TP-sp one all-gather
//! and one reduce-scatter, in forward and in backward).

use candle_core::Tensor;

use super::{
    ColumnParallelLinear, Entered, LinearConfig, ParallelCtx, ParamBuilder, RowParallelLinear,
    TpGroup,
};
use crate::error::Result;
use crate::ops::{gelu_tanh, swiglu};

/// The nonlinearity of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate(x)) * up(x)` (LLaMA): needs a gate projection.
    SwiGlu,
    /// `gelu_tanh(gate(x)) * up(x)` (Gemma's GeGLU, `gelu_pytorch_tanh`): needs a gate
    /// projection.
    GeGluTanh,
    /// GELU with the exact erf (PyTorch's `gelu`, CLIP's `gelu`).
    Gelu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`: SigLIP, DiT).
    GeluTanh,
    /// `x · σ(1.702 x)` (OpenAI CLIP's `quick_gelu`).
    QuickGelu,
}

/// `x · σ(1.702 x)`, differentiable.
pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    let s = ((x * -1.702)?.exp()? + 1.0)?.recip()?;
    Ok((x * s)?)
}

/// The shape and checkpoint names of an [`Mlp`]: `up` `(intermediate, hidden)`, `down`
/// `(hidden, intermediate)`, and for the gated activations `gate` like `up`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub activation: Activation,
    pub bias: bool,
    /// Sub-module names of the up, gate and down projections (`vb.pp(..)` keys; may contain
    /// dots, e.g. diffusers' `net.0.proj`).
    pub up: String,
    pub gate: String,
    pub down: String,
    /// The checkpoint's fused projection gate and up are parts of (Phi-3's `gate_up_proj`,
    /// gate rows first), see [`ColumnParallelLinear::new_part`]; `None`: two projections.
    pub fused_gate_up: Option<String>,
}

impl MlpConfig {
    /// LLaMA's SwiGLU MLP: `gate_proj`, `up_proj`, `down_proj`, no bias.
    pub fn swiglu(hidden_size: usize, intermediate_size: usize) -> Self {
        Self {
            hidden_size,
            intermediate_size,
            activation: Activation::SwiGlu,
            bias: false,
            up: "up_proj".into(),
            gate: "gate_proj".into(),
            down: "down_proj".into(),
            fused_gate_up: None,
        }
    }

    /// A GELU MLP `fc1`, `fc2` with biases (CLIP, ViT); `activation` [`Activation::Gelu`] or
    /// [`Activation::GeluTanh`].
    pub fn gelu(hidden_size: usize, intermediate_size: usize, activation: Activation) -> Self {
        Self {
            hidden_size,
            intermediate_size,
            activation,
            bias: true,
            up: "fc1".into(),
            gate: String::new(),
            down: "fc2".into(),
            fused_gate_up: None,
        }
    }

    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// The same projections with another gated activation ([`Activation::SwiGlu`] or
    /// [`Activation::GeGluTanh`]).
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Gate and up as parts of the fused projection `fused` (Phi-3's `gate_up_proj`).
    pub fn with_fused_gate_up(mut self, fused: Option<&str>) -> Self {
        self.fused_gate_up = fused.map(String::from);
        self
    }

    /// Other checkpoint names for the up and down projections (and the gate, for SwiGLU).
    pub fn with_names(mut self, up: &str, down: &str, gate: &str) -> Self {
        (self.up, self.down, self.gate) = (up.into(), down.into(), gate.into());
        self
    }
}

/// The feed-forward block; see the [module docs](self). Hidden units are split over the
/// tensor-parallel group.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate: Option<ColumnParallelLinear>,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    activation: Activation,
    tp: TpGroup,
}

impl Mlp {
    pub fn new(cfg: &MlpConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let up_cfg = LinearConfig::new(h, i).with_bias(cfg.bias);
        let proj = |name: &str| -> Result<ColumnParallelLinear> {
            let part = vb.pp(name);
            let fused = cfg
                .fused_gate_up
                .as_ref()
                .map_or_else(|| part.clone(), |f| vb.pp(f));
            ColumnParallelLinear::new_part(&up_cfg, part, &fused, ctx)
        };
        let gate = match cfg.activation {
            Activation::SwiGlu | Activation::GeGluTanh => Some(proj(&cfg.gate)?),
            Activation::Gelu | Activation::GeluTanh | Activation::QuickGelu => None,
        };
        Ok(Self {
            gate,
            up: proj(&cfg.up)?,
            down: RowParallelLinear::new(
                &LinearConfig::new(i, h).with_bias(cfg.bias),
                vb.pp(&cfg.down),
                ctx,
            )?,
            activation: cfg.activation,
            tp: ctx.tp().clone(),
        })
    }

    /// `x` `(batch, tokens', hidden)` → the same shape. Collective over tp.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = Entered::new(x, &self.tp)?;
        let up = self.up.forward_entered(&x)?;
        let h = match (&self.gate, self.activation) {
            (Some(gate), Activation::GeGluTanh) => (gelu_tanh(&gate.forward_entered(&x)?)? * up)?,
            (Some(gate), _) => swiglu(&gate.forward_entered(&x)?, &up)?,
            (None, Activation::GeluTanh) => gelu_tanh(&up)?,
            (None, Activation::QuickGelu) => quick_gelu(&up)?,
            (None, _) => up.gelu_erf()?,
        };
        self.down.forward(&h)
    }
}
