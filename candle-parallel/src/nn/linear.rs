//! Megatron's split of a transformer's GEMMs over the tensor-parallel group.
//!
//! A column-parallel linear holds rows `[r·out/P, (r+1)·out/P)` of the `(out, in)` weight (the
//! PyTorch / Hugging Face layout) and produces this rank's slice of the output features; a
//! row-parallel linear holds columns `[r·in/P, (r+1)·in/P)` and sums the partial products over
//! the group. A column-parallel layer followed by a row-parallel one (attention's q/k/v then o,
//! the MLP's gate/up then down) communicates once in forward and once in backward.
//!
//! Inputs are `(.., tokens, features)`. With Megatron sequence parallelism (TP-sp, see
//! [`TpGroup::sequence_parallel`]) the activations outside the parallel region are split along
//! the token dim (the second to last) over the group: the column-parallel layer all-gathers the
//! tokens first, the row-parallel layer reduce-scatters them after.

use candle_core::{DType, Tensor, D};

use super::lora::LoraWeights;
use super::{token_dim, ParallelCtx, ParamBuilder, Shard, TpGroup};
use crate::collectives::{gather, reduce_from_parallel_region, reduce_scatter, scatter};
use crate::error::{Error, Result};
use crate::ops::bias_add;

/// The shape of a linear layer as the checkpoint stores it: `weight` `(out_features,
/// in_features)` and, with `bias`, `bias` `(out_features)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearConfig {
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
}

impl LinearConfig {
    /// A layer without bias.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self {
            in_features,
            out_features,
            bias: false,
        }
    }

    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
}

/// What a column-parallel layer returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColumnOutput {
    /// This rank's slice of the output features (the input of a row-parallel layer).
    #[default]
    Sharded,
    /// All output features, gathered over the group.
    Gathered,
}

/// What a row-parallel layer is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowInput {
    /// This rank's slice of the input features (the output of a column-parallel layer).
    #[default]
    Sharded,
    /// All input features, which the layer splits.
    Whole,
}

/// `a @ b` for 2-D `a` `(m, k)` and `b` `(k, n)`, differentiable.
///
/// On the CPU in f32, bf16 or f16 this is [`flash_ring::matmul`]: each output sums its `k`
/// products in short register chains (64 products) and then adds the chain sums, where
/// `Tensor::matmul` (the `gemm` crate) keeps one running sum over blocks of 512 or more. The
/// large activations of a trained transformer are sums of many same-sign products, whose
/// error grows with the chain length: the short chains keep it at PyTorch's level or below
/// (see `docs/accuracy.md`). In the backward the input's gradient is this product again, the
/// weight's candle's matmul ([`flash_ring::matmul`]). Other devices and dtypes use
/// `Tensor::matmul`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if on_flash_ring(a, b) {
        flash_ring::matmul(a, b).map_err(crate::attention::block::kernel_err)
    } else {
        Ok(a.matmul(b)?)
    }
}

/// Whether flash-ring multiplies `a` and `b`: both on the CPU, in one dtype it has kernels
/// for (f32, bf16, f16).
fn on_flash_ring(a: &Tensor, b: &Tensor) -> bool {
    let kernel_dtype = matches!(a.dtype(), DType::F32 | DType::BF16 | DType::F16);
    a.device().is_cpu() && kernel_dtype && a.dtype() == b.dtype()
}

/// `x @ w^T` for 2-D `x` `(m, k)` and `w` `(n, k)`, differentiable: [`matmul`] of `x` and
/// `w.t()`, where flash-ring runs it through [`flash_ring::matmul_nt`], which hands `w` its
/// gradient in `w`'s own layout (a transposed one is copied element by element when stored).
fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if on_flash_ring(x, w) {
        flash_ring::matmul_nt(x, w).map_err(crate::attention::block::kernel_err)
    } else {
        Ok(x.matmul(&w.t()?)?)
    }
}

/// `x @ w^T (+ b)` for `x` `(.., in)` and `w` `(out, in)`, as one 2-D `matmul_nt`; the bias by
/// [`bias_add`] (its gradient summed in f32 with any candle-core).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (out_f, in_f) = w.dims2()?;
    let last = *dims
        .last()
        .ok_or_else(|| Error::invalid("linear", "input is a scalar"))?;
    if last != in_f {
        return Err(Error::invalid(
            "linear",
            format!(
                "input has {last} features, the weight {:?} expects {in_f}",
                w.dims()
            ),
        ));
    }
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let y = matmul_nt(&x.reshape((rows, in_f))?, w)?;
    let y = match b {
        Some(b) => bias_add(&y, b)?,
        None => y,
    };
    let mut out_dims = dims;
    *out_dims.last_mut().expect("non-empty dims") = out_f;
    Ok(y.reshape(out_dims)?)
}

/// Linear layer whose output features are split over the tensor-parallel group.
///
/// Weight `(out/P, in)` (this rank's rows), optional bias `(out/P)`. `forward` takes the full
/// input on every rank (or, under TP-sp, this rank's tokens) and returns this rank's output
/// features `(.., tokens, out/P)` for every token of the group, or all `out` features
/// ([`ColumnOutput::Gathered`]). Every rank of the group calls it (collective).
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TpGroup,
    output: ColumnOutput,
    /// LoRA: `A` `(r, in)` replicated, `B` this rank's rows `(out/P, r)`.
    lora: Option<LoraWeights>,
}

/// An input of column-parallel layers before and after it entered the tensor-parallel region
/// ([`TpGroup::enter`]), so that several layers reading it (q, k, v; gate, up) share one
/// gather, and LoRA adapters can take their low-rank product before the gather.
#[derive(Debug, Clone)]
pub struct Entered {
    /// `(.., tokens', in)`: this rank's activations (under TP-sp its part of the tokens).
    pub input: Tensor,
    /// `(.., tokens, in)`: what the layers multiply (all tokens of the group).
    pub entered: Tensor,
}

impl Entered {
    /// `x` entered into `tp`'s region. Collective over tp.
    pub fn new(x: &Tensor, tp: &TpGroup) -> Result<Self> {
        Ok(Self {
            input: x.clone(),
            entered: tp.enter(x)?,
        })
    }
}

impl ColumnParallelLinear {
    /// Loads this rank's rows of `vb`'s `weight` (and `bias`); the output stays sharded.
    /// Errors when the tensor-parallel degree does not divide `out_features`.
    pub fn new(cfg: &LinearConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let lora_at = vb.clone();
        Self::new_part(cfg, vb, &lora_at, ctx)
    }

    /// [`ColumnParallelLinear::new`] for one part of a checkpoint's fused projection (q of
    /// Phi-3's `qkv_proj`, gate of its `gate_up_proj`), loaded under the part's own name `vb`
    /// (the checkpoint's view splits the fused tensor by rows, so each rank gets its heads of
    /// this part): a LoRA adapter is the fused module's, as PEFT puts it there. LoRA targets
    /// match the fused module `fused` (`qkv_proj`), whose `lora_A` `(r, in)` every part shares
    /// (one parameter: its gradient sums over the parts), and each part holds its rows of the
    /// fused `lora_B` under its own name (`q_proj.lora_B`), split over tp like its weight: the
    /// sum over the parts of `s · B_part A x` is the fused module's LoRA, exactly.
    pub fn new_part(
        cfg: &LinearConfig,
        vb: ParamBuilder,
        fused: &ParamBuilder,
        ctx: &ParallelCtx,
    ) -> Result<Self> {
        let tp = ctx.tp();
        let (_, rows) = tp.share(&format!("{}.weight rows", vb.prefix()), cfg.out_features)?;
        let shard = Shard::new(0, tp.rank(), tp.size());
        let w = vb.get_with_hints((rows, cfg.in_features), "weight", shard)?;
        let b = if cfg.bias {
            Some(vb.get_with_hints(rows, "bias", shard)?)
        } else {
            None
        };
        let lora = match fused.adapters_here() {
            Some(ad) => {
                let r = ad.cfg.rank;
                let a = fused.pp("lora_A").get_adapter(
                    (r, cfg.in_features),
                    "weight",
                    Shard::replicated(),
                )?;
                let bm = vb.pp("lora_B").get_adapter((rows, r), "weight", shard)?;
                Some(LoraWeights::new(a, bm, ad.clone()))
            }
            None => None,
        };
        Ok(Self::from_weights(w, b, tp.clone(), ColumnOutput::Sharded).with_lora(lora))
    }

    /// This layer with a LoRA adapter (`A` `(r, in)`, `B` this rank's rows `(out/P, r)`).
    pub fn with_lora(mut self, lora: Option<LoraWeights>) -> Self {
        self.lora = lora;
        self
    }

    /// The LoRA adapter, if any.
    pub fn lora(&self) -> Option<&LoraWeights> {
        self.lora.as_ref()
    }

    /// From this rank's rows `(out/P, in)` of the weight (and of the bias).
    pub fn from_weights(
        weight: Tensor,
        bias: Option<Tensor>,
        tp: TpGroup,
        output: ColumnOutput,
    ) -> Self {
        Self {
            weight,
            bias,
            tp,
            output,
            lora: None,
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_entered(&Entered::new(x, &self.tp)?)
    }

    /// As [`ColumnParallelLinear::forward`] on an input that already entered the region
    /// ([`Entered`]), so that several layers reading one input share one gather.
    pub fn forward_entered(&self, x: &Entered) -> Result<Tensor> {
        let y = linear(&x.entered, &self.weight, self.bias.as_ref())?;
        let y = match &self.lora {
            Some(l) if l.enabled() => {
                let h = self.tp.enter(&l.down(&x.input)?)?;
                (y + l.up(&h)?)?
            }
            _ => y,
        };
        if self.output == ColumnOutput::Gathered && self.tp.size() > 1 {
            Ok(gather(&y, self.tp.comm(), D::Minus1)?)
        } else {
            Ok(y)
        }
    }
}

/// Linear layer whose input features are split over the tensor-parallel group.
///
/// Weight `(out, in/P)` (this rank's columns), optional bias `(out)` (replicated, added once
/// after the reduction). `forward` takes this rank's input features `(.., tokens, in/P)`
/// ([`RowInput::Sharded`], the output of a column-parallel layer) or the full input, which it then
/// splits; it returns the full output `(.., tokens, out)`, or under TP-sp this rank's tokens of
/// it. Every rank of the group calls it (collective).
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TpGroup,
    input: RowInput,
    /// LoRA: `A` this rank's columns `(r, in/P)`, `B` `(out, r)` replicated.
    lora: Option<LoraWeights>,
}

impl RowParallelLinear {
    /// Loads this rank's columns of `vb`'s `weight` (and the whole `bias`); the input is
    /// expected sharded. Errors when the tensor-parallel degree does not divide `in_features`.
    pub fn new(cfg: &LinearConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let tp = ctx.tp();
        let (_, cols) = tp.share(&format!("{}.weight columns", vb.prefix()), cfg.in_features)?;
        let shard = Shard::new(1, tp.rank(), tp.size());
        let w = vb.get_with_hints((cfg.out_features, cols), "weight", shard)?;
        let b = if cfg.bias {
            Some(vb.get(cfg.out_features, "bias")?)
        } else {
            None
        };
        let lora = match vb.adapters_here() {
            Some(ad) => {
                let r = ad.cfg.rank;
                let a = vb.pp("lora_A").get_adapter((r, cols), "weight", shard)?;
                let bm = vb.pp("lora_B").get_adapter(
                    (cfg.out_features, r),
                    "weight",
                    Shard::replicated(),
                )?;
                Some(LoraWeights::new(a, bm, ad.clone()))
            }
            None => None,
        };
        Ok(Self::from_weights(w, b, tp.clone(), RowInput::Sharded).with_lora(lora))
    }

    /// This layer with a LoRA adapter (`A` this rank's columns `(r, in/P)`, `B` `(out, r)`).
    pub fn with_lora(mut self, lora: Option<LoraWeights>) -> Self {
        self.lora = lora;
        self
    }

    /// The LoRA adapter, if any.
    pub fn lora(&self) -> Option<&LoraWeights> {
        self.lora.as_ref()
    }

    /// From this rank's columns `(out, in/P)` of the weight and the whole bias.
    pub fn from_weights(
        weight: Tensor,
        bias: Option<Tensor>,
        tp: TpGroup,
        input: RowInput,
    ) -> Self {
        Self {
            weight,
            bias,
            tp,
            input,
            lora: None,
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let lora = self.lora.as_ref().filter(|l| l.enabled());
        let p = self.tp.size();
        if p == 1 {
            let y = linear(x, &self.weight, self.bias.as_ref())?;
            return match lora {
                Some(l) => Ok((y + l.up(&l.down(x)?)?)?),
                None => Ok(y),
            };
        }
        let x = match self.input {
            RowInput::Sharded => x.clone(),
            RowInput::Whole => scatter(x, self.tp.comm(), D::Minus1)?,
        };
        let reduce = |partial: &Tensor| -> Result<Tensor> {
            if self.tp.sequence_parallel() {
                Ok(reduce_scatter(
                    partial,
                    self.tp.comm(),
                    token_dim(partial)?,
                )?)
            } else {
                Ok(reduce_from_parallel_region(partial, self.tp.comm())?)
            }
        };
        let mut y = reduce(&linear(&x, &self.weight, None)?)?;
        if let Some(l) = lora {
            y = (y + l.up(&reduce(&l.down(&x)?)?)?)?;
        }
        match &self.bias {
            Some(b) => Ok(bias_add(&y, b)?),
            None => Ok(y),
        }
    }
}
