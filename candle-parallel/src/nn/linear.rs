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

use super::{token_dim, ParallelCtx, ParamBuilder, Shard, TpGroup};
use crate::collectives::{gather, reduce_from_parallel_region, reduce_scatter, scatter};
use crate::error::{Error, Result};

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
/// (see `docs/accuracy.md`). The backward is candle's matmul. Other devices and dtypes use
/// `Tensor::matmul`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let kernel_dtype = matches!(a.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if a.device().is_cpu() && kernel_dtype && a.dtype() == b.dtype() {
        flash_ring::matmul(a, b).map_err(crate::attention::block::kernel_err)
    } else {
        Ok(a.matmul(b)?)
    }
}

/// `x @ w^T (+ b)` for `x` `(.., in)` and `w` `(out, in)`, as one 2-D [`matmul`].
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
    let y = matmul(&x.reshape((rows, in_f))?, &w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
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
}

impl ColumnParallelLinear {
    /// Loads this rank's rows of `vb`'s `weight` (and `bias`); the output stays sharded.
    /// Errors when the tensor-parallel degree does not divide `out_features`.
    pub fn new(cfg: &LinearConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let tp = ctx.tp();
        let (_, rows) = tp.share(&format!("{}.weight rows", vb.prefix()), cfg.out_features)?;
        let shard = Shard::new(0, tp.rank(), tp.size());
        let w = vb.get_with_hints((rows, cfg.in_features), "weight", shard)?;
        let b = if cfg.bias {
            Some(vb.get_with_hints(rows, "bias", shard)?)
        } else {
            None
        };
        Ok(Self::from_weights(w, b, tp.clone(), ColumnOutput::Sharded))
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
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_entered(&self.tp.enter(x)?)
    }

    /// As [`ColumnParallelLinear::forward`] on an input that already went through
    /// [`TpGroup::enter`], so that several layers reading one input (q, k, v; gate, up) share
    /// one gather.
    pub fn forward_entered(&self, x: &Tensor) -> Result<Tensor> {
        let y = linear(x, &self.weight, self.bias.as_ref())?;
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
        Ok(Self::from_weights(w, b, tp.clone(), RowInput::Sharded))
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
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.tp.size();
        if p == 1 {
            return linear(x, &self.weight, self.bias.as_ref());
        }
        let x = match self.input {
            RowInput::Sharded => x.clone(),
            RowInput::Whole => scatter(x, self.tp.comm(), D::Minus1)?,
        };
        let partial = linear(&x, &self.weight, None)?;
        let y = if self.tp.sequence_parallel() {
            reduce_scatter(&partial, self.tp.comm(), token_dim(&partial)?)?
        } else {
            reduce_from_parallel_region(&partial, self.tp.comm())?
        };
        match &self.bias {
            Some(b) => Ok(y.broadcast_add(b)?),
            None => Ok(y),
        }
    }
}
