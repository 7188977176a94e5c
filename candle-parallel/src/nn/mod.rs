//! The building blocks of parallel models: each a module with `fn new(cfg, vb, ctx)` (the
//! [`ParamBuilder`] path mirroring checkpoint keys) and a forward with no rank in its signature.
//! A model file written with them names no rank, no communicator and no collective: the
//! [`ParallelCtx`] a module is built with decides how it is split, and the [`Pass`] its forward
//! gets carries the positions, mask and sequence-parallel attention of the batch.
//!
//! | module        | file            | what is split over the tensor-parallel group                    |
//! |---------------|-----------------|------------------------------------------------------------------|
//! | [`ColumnParallelLinear`], [`RowParallelLinear`] | [`linear`](mod@linear) | output rows / input columns of the weight (Megatron) |
//! | [`VocabParallelEmbedding`] | [`embedding`] | vocabulary rows                                        |
//! | [`LmHead`] and [`vocab_parallel_cross_entropy`] | [`loss`] | vocabulary rows; chunked, fused loss   |
//! | [`ParallelAttention`] | [`attention`] | heads (q/k/v column-, o row-parallel); tokens over the sequence-parallel group by any [`Strategy`](crate::attention::Strategy) |
//! | [`Mlp`]       | [`mlp`]         | hidden units (SwiGLU or GELU)                                     |
//! | [`RmsNorm`], [`LayerNorm`] | [`norm`] | nothing: local to each token (under TP-sp each rank normalises its own tokens) |
//! | LoRA adapters of the linear layers | [`lora`] | with their layer: `B` rows (column-parallel), `A` columns (row-parallel) |
//!
//! [`param`] loads parameters (only this rank's slice), [`unit`](mod@unit) groups a module's parameters
//! into a unit that a [`crate::plan::MemoryPlan`] shards (ZeRO-3) or recomputes (activation
//! checkpointing) from outside the model.
//!
//! Activations are `(batch, tokens, features)` over this rank's sequence shard; under TP-sp
//! (Megatron sequence parallelism, [`TpActivations::SequenceSharded`]) each tensor-parallel rank
//! holds a contiguous part of those tokens outside the tensor-parallel regions, and the modules
//! gather and scatter them where they enter and leave those regions.

pub mod anomaly;
pub mod attention;
mod backward_span;
pub mod batch;
pub mod embedding;
pub mod linear;
pub mod lora;
pub mod loss;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod param;
mod topk;
pub mod unit;

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::attention::{AttnMask, SequenceParallelAttention, SpAttention, SpConfig};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
use crate::recompute::GradSink;

pub use attention::{AttentionConfig, LayerKv, ParallelAttention};
pub use batch::Batch;
pub use embedding::{EmbeddingConfig, VocabParallelEmbedding};
pub use linear::{
    linear, matmul, ColumnOutput, ColumnParallelLinear, Entered, LinearConfig, RowInput,
    RowParallelLinear,
};
pub use lora::{Adapters, LoraConfig, LoraTargets, LoraWeights};
pub use loss::{soft_cap, vocab_parallel_cross_entropy, CrossEntropyOptions, LmHead, IGNORE_INDEX};
pub use mlp::{Activation, Mlp, MlpConfig};
pub use moe::{MoeConfig, RouterAux, RouterStats, SparseMoe};
pub use norm::{LayerNorm, NormConfig, RmsNorm};
pub use param::{Param, ParamBuilder, ParamList, ParamMode, Shard, TensorMap, TensorSource};
pub use unit::{Block, ShardedParam, Track, Unit, UnitOps};

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

/// Where activations outside the tensor-parallel regions (norms, residuals) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TpActivations {
    /// Replicated on every rank of the tensor-parallel group (Megatron tensor parallelism).
    #[default]
    Replicated,
    /// Split along the tokens over the group (Megatron sequence parallelism, TP-sp).
    SequenceSharded,
}

/// The tensor-parallel group of one rank and where its activations live ([`TpActivations`]).
#[derive(Clone, Debug)]
pub struct TpGroup {
    comm: Comm,
    sequence_parallel: bool,
}

impl TpGroup {
    pub fn new(comm: Comm, activations: TpActivations) -> Self {
        let sequence_parallel = activations == TpActivations::SequenceSharded && comm.size() > 1;
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

    /// Under TP-sp: `x` in forward, its gradient divided by the group size in backward. For
    /// the output of a module every rank of the group computes whole from replicated
    /// parameters (a vision tower under TP-sp), whose gradient then arrives whole on every rank
    /// and is summed over the group with the replicated parameters'. Otherwise the identity.
    pub fn share_gradient(&self, x: &Tensor) -> Result<Tensor> {
        if !self.sequence_parallel {
            return Ok(x.clone());
        }
        let p = self.size() as f64;
        Ok(crate::collectives::scale_gradient(x, 1.0 / p)?)
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
/// configured sequence-parallel attention (ulysses × ring), the groups over which gradients of
/// replicated parameters are summed, and the sink of the gradients of recomputed units. Built
/// collectively from a [`DeviceMesh`]; cheap to clone (shared).
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
    /// Attention over tokens this rank holds whole (no sequence parallelism): vision towers.
    local_attention: Arc<SpAttention>,
    sink: GradSink,
    /// Where this rank's parameters and activations live (the CPU unless set).
    device: Device,
    /// Expert parallelism ([`ParallelCtx::with_expert_parallel`]).
    experts: Option<ExpertGroups>,
}

/// The groups of expert parallelism ([`ParallelCtx::with_expert_parallel`]).
#[derive(Clone, Debug)]
pub struct ExpertGroups {
    /// Divides the experts of every mixture-of-experts block: rank `r` holds the `r`-th of
    /// `ep.size()` equal slices.
    pub ep: Comm,
    /// The ranks holding the same experts (and other tokens): the experts' gradients are summed
    /// over it, and ZeRO shards the experts over it
    /// ([`crate::optim::ZeroGroups::with_experts`]).
    pub replicas: Comm,
    /// `ep` with the tensor-parallel group: the ranks whose pieces make up every expert once
    /// (for the gradient norm).
    pub ep_tp: Comm,
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
    pub fn new(mesh: &DeviceMesh, attention: &SpConfig, tp: TpActivations) -> Result<Self> {
        let tp = TpGroup::new(mesh.comm(Dim::Tp), tp);
        let attention = Arc::new(SpAttention::new(attention, mesh)?);
        let sequence_group = mesh.group(&[Dim::Ulysses, Dim::Ring])?;
        let sharded_grad_group = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let replicated_grad_group = if tp.sequence_parallel() {
            mesh.group(&[Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp])?
        } else {
            sharded_grad_group.clone()
        };
        let single = SpConfig::new(crate::attention::Strategy::Ring, 1, 1);
        let local_attention = Arc::new(SpAttention::from_comms(
            &single,
            crate::comm::solo(),
            crate::comm::solo(),
        )?);
        Ok(Self {
            tp,
            attention,
            replicated_grad_group,
            sharded_grad_group,
            sequence_group,
            local_attention,
            sink: GradSink::new(),
            device: Device::Cpu,
            experts: None,
        })
    }

    /// This context with expert parallelism of degree `ep`, carved from the ranks that hold
    /// different tokens of one model replica (ulysses × ring × dp, in rank order: each run of
    /// `ep` consecutive ranks of that group is one expert-parallel group, innermost first, as
    /// torchtitan carves it from its data and context ranks). Mixture-of-experts blocks built
    /// with it hold `1 / ep` of the experts; the experts' gradients are summed over the `dp · sp
    /// / ep` ranks holding the same ones. Collective over the world (every rank calls it with the
    /// same `ep`). Under tensor parallelism the experts are also split over tp and the groups
    /// hold ranks of one tensor-parallel coordinate. Errors when `ep` does not divide that group.
    pub fn with_expert_parallel(mut self, mesh: &DeviceMesh, ep: usize) -> Result<Self> {
        if ep <= 1 {
            self.experts = None;
            return Ok(self);
        }
        let tokens = &self.sharded_grad_group;
        if !tokens.size().is_multiple_of(ep) {
            return Err(Error::Layout(format!(
                "expert parallelism of {ep} does not divide the {} ranks that hold different \
                 tokens (ulysses x ring x dp)",
                tokens.size()
            )));
        }
        let g = tokens.rank();
        let ep_comm = tokens.split(g / ep, g % ep)?;
        let replicas = tokens.split(g % ep, g / ep)?;
        let all_tp = mesh.group(&[Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let ep_tp = all_tp.split(g / ep, all_tp.rank())?;
        self.experts = Some(ExpertGroups {
            ep: ep_comm,
            replicas,
            ep_tp,
        });
        Ok(self)
    }

    /// The expert-parallel group, when the experts are divided over ranks.
    pub fn expert_parallel(&self) -> Option<&Comm> {
        self.experts.as_ref().map(|e| &e.ep)
    }

    /// The groups of expert parallelism, when the experts are divided over ranks.
    pub fn expert_groups(&self) -> Option<&ExpertGroups> {
        self.experts.as_ref()
    }

    /// This context with parameters and activations on `device` (models built with it load
    /// their weights there, batches put their tokens there). Attention and the fused ops run on
    /// any device candle supports; see `docs/gpu.md` for what has been checked on which.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Where this rank's parameters and activations live.
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// This context without tensor parallelism (a tensor-parallel group of this rank alone):
    /// for a module every rank runs whole, such as a vision tower under TP-sp, whose patches
    /// are not split over the group. Its parameters are then replicated; the gradient groups
    /// stay this context's (under TP-sp replicated parameters' gradients are summed over tp),
    /// so the module's output must pass on each rank's share of its gradient
    /// ([`TpGroup::share_gradient`]).
    pub fn without_tp(&self) -> Self {
        let mut c = self.clone();
        c.tp = TpGroup::new(crate::comm::solo(), TpActivations::Replicated);
        c
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

    /// Where recomputed units put their parameters' gradients (see [`ParallelCtx::backward`]).
    pub fn grad_sink(&self) -> &GradSink {
        &self.sink
    }

    /// `loss.backward()` with the gradients of recomputed (checkpointed) units merged in: use
    /// it in place of `loss.backward()` for models built with this context.
    pub fn backward(&self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        self.sink.backward(loss)
    }

    /// Ranks that hold different tokens of one sequence (ulysses × ring).
    pub fn sequence_group(&self) -> &Comm {
        &self.sequence_group
    }

    /// The groups whose ranks together hold one micro-batch's tokens: the sequence group, and
    /// under TP-sp the tensor-parallel group too (each of its ranks holds part of them).
    pub fn token_groups(&self) -> Vec<Comm> {
        let mut groups = vec![self.sequence_group.clone()];
        if self.tp.sequence_parallel() {
            groups.push(self.tp.comm().clone());
        }
        groups
    }

    /// The group over which the gradient of a parameter is summed after backward: tensor-parallel
    /// shards (`tp_sharded`) over ulysses × ring × dp; replicated parameters also over tp under
    /// TP-sp, where each tensor-parallel rank sees only its tokens.
    ///
    /// A parameter held by this expert-parallel rank alone (`expert_parallel`: an expert under
    /// [`ParallelCtx::with_expert_parallel`]) sums over the ranks holding the same experts.
    pub fn grad_group(&self, shard: &Shard, expert_parallel: bool) -> &Comm {
        if let (true, Some(e)) = (expert_parallel, &self.experts) {
            return &e.replicas;
        }
        if shard.is_split() {
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

    /// [`ParallelCtx::shard_tokens`] for a batch whose attention mask is `mask` (under
    /// [`SeqLayout::DocZigzag`](crate::attention::SeqLayout::DocZigzag) its documents choose
    /// the plan; every tensor of the batch must be cut with the same mask).
    pub fn shard_tokens_for(&self, global: &Tensor, mask: &AttnMask) -> Result<Tensor> {
        self.attention.shard_for(global, 1, mask)
    }

    /// The tokens of a global `(batch, seq, ..)` tensor that this rank's layers work on: its
    /// sequence-parallel shard ([`ParallelCtx::shard_tokens`]) and under TP-sp its
    /// tensor-parallel part of that (backward all-gathers over tp). For inputs a model embeds
    /// with replicated weights (patches, positions), whose gradients then add up over the
    /// group. Local.
    pub fn layer_tokens(&self, global: &Tensor) -> Result<Tensor> {
        self.tp.split_tokens(&self.shard_tokens(global)?)
    }

    /// The inverse of the tensor-parallel part of [`ParallelCtx::layer_tokens`]: this rank's
    /// whole sequence shard from its layers' tokens `(batch, n', ..)`, replicated over tp under
    /// TP-sp (backward keeps this rank's part: what consumes it must compute the same on every
    /// tensor-parallel rank). The identity otherwise. Collective over tp.
    pub fn gather_layer_tokens(&self, x: &Tensor) -> Result<Tensor> {
        self.tp.gather_tokens(x)
    }

    /// How many tokens the layers of this rank see of a sequence shard of `local` tokens (under
    /// TP-sp its tensor-parallel part).
    pub fn layer_token_count(&self, local: usize) -> usize {
        if self.tp.sequence_parallel() {
            local / self.tp.size()
        } else {
            local
        }
    }

    /// The global tensor from every sequence-parallel rank's shard (dim 1 the sequence), on
    /// every rank. Collective over the sequence group; differentiable (replicated semantics).
    pub fn gather_tokens(&self, local: &Tensor) -> Result<Tensor> {
        self.attention.gather(local, 1)
    }

    /// [`ParallelCtx::gather_tokens`] of shards cut by [`ParallelCtx::shard_tokens_for`] `mask`.
    pub fn gather_tokens_for(&self, local: &Tensor, mask: &AttnMask) -> Result<Tensor> {
        self.attention.gather_for(local, 1, mask)
    }

    /// The global positions (RoPE) of this rank's sequence-parallel tokens, i.e. of the tokens
    /// attention sees (under TP-sp: the whole tensor-parallel group's tokens, gathered).
    pub fn attention_positions(&self, seq_len: usize) -> Result<Vec<u32>> {
        self.attention.local_positions(seq_len)
    }

    /// [`ParallelCtx::attention_positions`] of a batch whose attention mask is `mask`.
    pub fn attention_positions_for(&self, seq_len: usize, mask: &AttnMask) -> Result<Vec<u32>> {
        self.attention.local_positions_for(seq_len, mask)
    }

    /// Number of tokens of a global sequence of `seq_len` that this rank's sequence shard holds.
    pub fn local_tokens(&self, seq_len: usize) -> Result<usize> {
        Ok(self.attention.plan(seq_len)?.local_len())
    }

    /// Fails naming `what` (a config field) unless the tensor-parallel degree divides `n`.
    pub fn check_tp_divides(&self, what: &str, n: usize) -> Result<()> {
        self.tp.share(what, n).map(|_| ())
    }
}

/// What the layers of one forward pass share besides their input: the context, the global
/// positions (RoPE) of the tokens attention sees on this rank and the length of the global
/// sequence (identical on every rank), the attention mask of the global
/// sequence, the sequence-parallel attention to run (the context's, or the recording or
/// replaying one of a checkpointed unit), and an optional per-sample conditioning. Model code
/// passes it through unchanged.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    pub ctx: &'a ParallelCtx,
    pub positions: &'a [u32],
    /// The length of the global sequence, transformers' `max(position_ids) + 1` over all of its
    /// tokens: what the sequence-length-dependent RoPE types (dynamic, longrope) scale by, the
    /// same on every rank of the sequence-parallel group whatever shard of positions it holds.
    pub seq_len: usize,
    pub mask: &'a AttnMask,
    pub attention: &'a dyn SequenceParallelAttention,
    /// Per-sample inputs every block reads besides its activations, `(batch, ..)` (a diffusion
    /// model's timesteps and class labels). Not differentiated: checkpointed units keep a
    /// detached copy, so it must not carry a gradient path.
    pub cond: Option<&'a Tensor>,
    /// Which of this rank's tokens count in a mixture of experts' routing statistics,
    /// `batch · positions.len()` flags, sequence-major (transformers' `attention_mask`: padding
    /// is routed but left out of the load-balancing loss). `None`: every token.
    pub routed: Option<&'a [bool]>,
}

impl<'a> Pass<'a> {
    /// A pass over tokens every rank holds whole (a vision tower's patches): attention on this
    /// rank alone, whatever the sequence-parallel layout (tensor parallelism still applies).
    /// Blocks run with it must not be recomputed by a unit (their recomputation would take the
    /// context's sequence-parallel attention): call them through [`Unit::get`].
    /// The sequence length is `max(positions) + 1`.
    pub fn local(ctx: &'a ParallelCtx, positions: &'a [u32], mask: &'a AttnMask) -> Self {
        Self {
            ctx,
            positions,
            seq_len: max_plus_one(positions),
            mask,
            attention: ctx.local_attention.as_ref(),
            cond: None,
            routed: None,
        }
    }

    /// A pass of `ctx`'s configured attention. The global sequence length ([`Pass::seq_len`]) is
    /// `max(positions) + 1` without sequence parallelism, and under it the length the
    /// sequence-parallel attention runs over, `positions.len() · degree` (the shards of one
    /// sequence `0..S`, as [`Batch`] cuts them); [`Pass::with_seq_len`] sets another.
    pub fn new(ctx: &'a ParallelCtx, positions: &'a [u32], mask: &'a AttnMask) -> Self {
        let degree = ctx.attention().group().degree();
        let seq_len = if degree > 1 {
            (positions.len() * degree).max(max_plus_one(positions))
        } else {
            max_plus_one(positions)
        };
        Self {
            ctx,
            positions,
            seq_len,
            mask,
            attention: ctx.attention(),
            cond: None,
            routed: None,
        }
    }

    /// The same pass with the per-sample conditioning `cond` (see [`Pass::cond`]).
    pub fn with_cond(&self, cond: &'a Tensor) -> Self {
        Self {
            cond: Some(cond),
            ..*self
        }
    }

    /// The same pass with the routing flags `routed` (see [`Pass::routed`]).
    pub fn with_routed(&self, routed: Option<&'a [bool]>) -> Self {
        Self { routed, ..*self }
    }

    /// The same pass over a global sequence of `seq_len` tokens (see [`Pass::seq_len`]).
    pub fn with_seq_len(&self, seq_len: usize) -> Self {
        Self { seq_len, ..*self }
    }

    /// The same pass with another attention (inside a checkpointed unit).
    pub fn with_attention(&self, attention: &'a dyn SequenceParallelAttention) -> Self {
        Self { attention, ..*self }
    }
}

/// transformers' `max(position_ids) + 1` (0 for no positions).
fn max_plus_one(positions: &[u32]) -> usize {
    positions.iter().max().map_or(0, |&p| p as usize + 1)
}
