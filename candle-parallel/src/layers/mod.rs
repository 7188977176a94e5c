//! Tensor-parallel building blocks (Megatron-LM) and the parallel context a model is built with.
//!
//! - [`linear`]: column- and row-parallel linear layers (with TP-sp sequence parallelism);
//! - [`embedding`]: the vocab-parallel embedding;
//! - [`cross_entropy`]: the vocab-parallel, chunked cross-entropy fused with the LM head;
//! - [`ParallelCtx`]: everything a model file needs to know about the layout of its rank, so
//!   that the model never branches on a rank or names a communicator.

pub mod cross_entropy;
pub mod embedding;
pub mod linear;

use std::sync::Arc;

use candle_core::Tensor;

use crate::attention::{SequenceParallelAttention, SpAttention, SpConfig};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};

pub use cross_entropy::{vocab_parallel_cross_entropy, CrossEntropyOptions, IGNORE_INDEX};
pub use embedding::VocabParallelEmbedding;
pub use linear::{linear, ColumnParallelLinear, RowParallelLinear};

/// The token dim of a `(.., tokens, features)` activation.
pub(crate) fn token_dim(x: &Tensor) -> Result<usize> {
    match x.rank() {
        r if r >= 2 => Ok(r - 2),
        _ => Err(Error::invalid(
            "tensor-parallel layer",
            format!(
                "activations must be (.., tokens, features), got {:?}",
                x.dims()
            ),
        )),
    }
}

/// The tensor-parallel group of one rank and whether Megatron sequence parallelism (TP-sp) is on:
/// activations outside the tensor-parallel regions (norms, residuals) are then split along the
/// token dim over the group instead of replicated.
#[derive(Clone)]
pub struct TpGroup {
    comm: Comm,
    sequence_parallel: bool,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("sequence_parallel", &self.sequence_parallel)
            .finish()
    }
}

impl TpGroup {
    pub fn new(comm: Comm, sequence_parallel: bool) -> Self {
        let sequence_parallel = sequence_parallel && comm.size() > 1;
        Self {
            comm,
            sequence_parallel,
        }
    }

    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// TP-sp is on (and the group has more than one rank).
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Enters a tensor-parallel region with `(.., tokens, features)` activations: under TP-sp
    /// all-gathers this rank's tokens (backward reduce-scatter), otherwise the identity whose
    /// backward all-reduces (Megatron's `f`). Collective.
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.size() == 1 {
            Ok(x.clone())
        } else if self.sequence_parallel {
            Ok(crate::collectives::all_gather(
                x,
                &self.comm,
                token_dim(x)?,
            )?)
        } else {
            Ok(crate::collectives::copy_to_parallel_region(x, &self.comm)?)
        }
    }

    /// Under TP-sp: this rank's contiguous part of the tokens of a `(.., tokens, features)`
    /// tensor replicated over the group (backward all-gather). Otherwise the identity.
    pub fn split_tokens(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            Ok(crate::collectives::scatter(x, &self.comm, token_dim(x)?)?)
        } else {
            Ok(x.clone())
        }
    }

    /// Under TP-sp: all of the group's tokens, replicated, from this rank's part (backward
    /// keeps this rank's part of the gradient: the consumer must compute the same thing on
    /// every rank, like the vocab-parallel loss). Otherwise the identity.
    pub fn gather_tokens(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            Ok(crate::collectives::gather(x, &self.comm, token_dim(x)?)?)
        } else {
            Ok(x.clone())
        }
    }

    /// `(start, len)` of this rank's `1/P` share of `n` items; `n % P` must be 0.
    pub fn share(&self, what: &str, n: usize) -> Result<(usize, usize)> {
        let p = self.size();
        if !n.is_multiple_of(p) {
            return Err(Error::Layout(format!(
                "{what} ({n}) is not divisible by the tensor-parallel degree {p}"
            )));
        }
        Ok((self.rank() * (n / p), n / p))
    }
}

/// The parallel layout of one rank as the model layers see it: the tensor-parallel group, the
/// configured sequence-parallel attention (ulysses × ring), and the groups over which gradients
/// of replicated parameters are summed. Built collectively from a [`DeviceMesh`].
///
/// Token layout: a global sequence of `S` tokens is cut by the attention's
/// [`ShardPlan`](crate::attention::ShardPlan) into `S / (ulysses·ring)` local tokens per
/// sequence-parallel rank ([`ParallelCtx::shard_tokens`]); under TP-sp those are further split
/// contiguously over the tensor-parallel group outside the tensor-parallel regions.
#[derive(Clone)]
pub struct ParallelCtx {
    tp: TpGroup,
    attention: Arc<SpAttention>,
    /// Ranks holding different tokens of the same model replica's data: ulysses × ring × dp,
    /// and tp too under TP-sp. Replicated parameters' gradients are summed over it.
    replicated_grad_group: Comm,
    /// ulysses × ring × dp: tensor-parallel shards' gradients are summed over it.
    sharded_grad_group: Comm,
    /// ulysses × ring: ranks that hold different tokens of one sequence.
    sequence_group: Comm,
}

impl std::fmt::Debug for ParallelCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelCtx")
            .field("tp", &self.tp)
            .field("attention", &self.attention)
            .finish_non_exhaustive()
    }
}

impl ParallelCtx {
    /// Collective over the mesh's world: every rank calls it with the same arguments.
    /// `attention`'s ulysses and ring degrees and placement must be the mesh's.
    pub fn new(
        mesh: &DeviceMesh,
        attention: &SpConfig,
        tp_sequence_parallel: bool,
    ) -> Result<Self> {
        let tp = TpGroup::new(mesh.comm(Dim::Tp), tp_sequence_parallel);
        let attention = Arc::new(SpAttention::new(attention, mesh)?);
        let sequence_group = mesh.group(&[Dim::Ulysses, Dim::Ring])?;
        let sharded_grad_group = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let replicated_grad_group = if tp.sequence_parallel() {
            mesh.group(&[Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp])?
        } else {
            sharded_grad_group.clone()
        };
        Ok(Self {
            tp,
            attention,
            replicated_grad_group,
            sharded_grad_group,
            sequence_group,
        })
    }

    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// The configured sequence-parallel attention (a plain flash attention on one rank).
    pub fn attention(&self) -> &SpAttention {
        &self.attention
    }

    /// The configured attention as a shared handle (for blocks that outlive this call, such as
    /// recomputed ones, see [`crate::recompute`]).
    pub fn attention_handle(&self) -> Arc<dyn SequenceParallelAttention> {
        self.attention.clone()
    }

    /// Ranks that hold different tokens of one sequence (ulysses × ring).
    pub fn sequence_group(&self) -> &Comm {
        &self.sequence_group
    }

    /// The group over which the gradient of a parameter is summed after backward: tensor-parallel
    /// shards (`tp_sharded`) over ulysses × ring × dp; replicated parameters also over tp under
    /// TP-sp, where each tensor-parallel rank sees only its tokens.
    pub fn grad_group(&self, tp_sharded: bool) -> &Comm {
        if tp_sharded {
            &self.sharded_grad_group
        } else {
            &self.replicated_grad_group
        }
    }

    /// This rank's sequence-parallel shard of a global `(batch, seq, ..)` tensor whose dim 1 is
    /// the sequence (token ids, positions, labels, document ids), in the attention's token
    /// order. Local. (Under TP-sp the model splits these tokens further inside; callers always
    /// deal in sequence-parallel shards.)
    pub fn shard_tokens(&self, global: &Tensor) -> Result<Tensor> {
        self.attention.shard(global, 1)
    }

    /// The global tensor from every sequence-parallel rank's shard (dim 1 the sequence), on
    /// every rank. Collective over the sequence group; differentiable (replicated semantics).
    pub fn gather_tokens(&self, local: &Tensor) -> Result<Tensor> {
        self.attention.gather(local, 1)
    }

    /// The global positions (RoPE) of this rank's sequence-parallel tokens, i.e. of the tokens
    /// attention sees (under TP-sp: the whole tensor-parallel group's tokens, gathered).
    pub fn attention_positions(&self, seq_len: usize) -> Result<Vec<u32>> {
        self.attention.local_positions(seq_len)
    }

    /// Number of tokens of a global sequence of `seq_len` that this rank's sequence shard holds.
    pub fn local_tokens(&self, seq_len: usize) -> Result<usize> {
        Ok(self.attention.plan(seq_len)?.local_len())
    }
}
