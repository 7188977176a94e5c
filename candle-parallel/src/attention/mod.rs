//! Sequence-parallel attention: one configuration, one call, every strategy.
//!
//! Each rank holds a shard of the sequence: `q` `(batch, seq_local, q_heads, head_dim)` and `k`,
//! `v` `(batch, seq_local, kv_heads, head_dim)`, its tokens in the order of the strategy's
//! [`ShardPlan`] (use [`SpAttention::shard`] / [`ShardPlan::shard`] to cut a global batch, and
//! [`SpAttention::local_positions`] for the RoPE positions of the local tokens). Every rank of
//! the sequence-parallel group calls [`SequenceParallelAttention::attention`] with its shard and
//! gets its shard of the output, in the same token order, as a differentiable candle op:
//! `loss.backward()` on every rank yields each rank's `dq`, `dk`, `dv`.
//!
//! | [`Strategy`]   | file              | communication (per layer)                                |
//! |----------------|-------------------|----------------------------------------------------------|
//! | `Ring`         | [`ring`]          | P2P kv ring (forward), kv + dkv ring (backward)          |
//! | `Ulysses`      | [`ulysses`]       | all-to-all of q, k, v and out (and their gradients)      |
//! | `Usp`          | [`usp`]           | Ulysses all-to-all in rows, ring attention in columns    |
//! | `AllGather`    | [`allgather_cp`]  | all-gather k, v (forward), reduce-scatter dk, dv         |
//! | `DoubleRing`   | [`double_ring`]   | LoongTrain 2D attention with inner and outer rings       |
//! | `StarTrail`    | [`startrail`]     | concentric rings in teams of `C`                         |
//!
//! The grid: the sequence-parallel group is `ulysses × ring` ranks, from the mesh's
//! [`crate::mesh::Dim::Ulysses`] and [`crate::mesh::Dim::Ring`]
//! communicators. The global sequence is first split over the ring ranks by the
//! [`SeqLayout`] (contiguous, zigzag, striped, or zigzag per document of the call's document
//! mask), then each ring rank's part is split in contiguous pieces over its ulysses group
//! (USP's Algorithm 2). See [`layout`] and [`doc_layout`]. The plan of a call is
//! [`SpGroup::plan_for`] its mask: cut global tensors with the `_for` methods of
//! [`SpAttention`] and pass the same mask to every call.
//!
//! Masks ([`AttnMask`]): full, causal, and document masks from per-token document ids of the
//! global sequence (packed sequences), causal or bidirectional within documents; GQA with any
//! `q_heads % kv_heads == 0` (Ulysses replicates kv heads when its degree exceeds them).
//!
//! Arithmetic is flash-ring's (f32 accumulation whatever the input dtype); partial results are
//! merged through their log-sum-exp, so every strategy computes the same function as
//! single-device flash-ring. Invalid combinations (indivisible sequence or heads, wrong degrees)
//! return [`crate::Error::InvalidArgument`] or
//! [`crate::Error::Layout`] on every rank before any communication.
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor, Var};
//! use candle_parallel::attention::{AttnCall, AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy};
//! use candle_parallel::comm::LocalWorld;
//! use candle_parallel::mesh::{DeviceMesh, MeshConfig};
//!
//! let (b, s, h, d) = (1, 16, 2, 8);
//! let q = Tensor::randn(0f32, 1., (b, s, h, d), &Device::Cpu)?;
//! let cfg = SpConfig::new(Strategy::Ring, 1, 2).with_layout(SeqLayout::Zigzag);
//! let outs = LocalWorld::run(2, |world| -> candle_parallel::Result<Tensor> {
//!     let mesh = DeviceMesh::new(&cfg.mesh_config(), world)?;
//!     let sp = SpAttention::new(&cfg, &mesh)?;
//!     let ql = Var::from_tensor(&sp.shard(&q, 1)?)?; // this rank's tokens, zigzag order
//!     let out = sp.attention(&ql, &ql, &ql, &AttnCall::new(AttnMask::Causal, 0.35))?;
//!     out.sum_all()?.backward()?;
//!     sp.gather(&out, 1) // back to global order, on every rank
//! })?;
//! assert_eq!(outs[0].dims(), &[b, s, h, d]);
//! # Ok::<(), candle_parallel::Error>(())
//! ```

pub mod allgather_cp;
pub mod block;
pub mod config;
pub mod doc_layout;
pub mod double_ring;
pub mod layout;
pub mod mask;
pub mod multi_ring_plan;
pub mod op;
pub mod ring;
pub mod selftest;
pub mod startrail;
pub mod ulysses;
pub mod usp;

use candle_core::Tensor;

pub use allgather_cp::AllGatherAttention;
pub use block::{block_bwd, block_fwd, Partial, QRows};
pub use config::{SeqLayout, SpConfig, Strategy};
pub use double_ring::DoubleRingAttention;
pub use layout::ShardPlan;
pub use mask::{AttnMask, MaskBlock};
pub use ring::{
    ring_attention, ring_steps, ring_traffic, RingAttention, RingBlocks, RingComm, RingTraffic,
};
pub use startrail::StarTrailAttention;
pub use ulysses::UlyssesAttention;
pub use usp::UspAttention;

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};

/// The query-key scores flash-ring's kernels computed for this thread's (this rank's)
/// attention calls since the last call, forward and backward (see [`flash_ring::work`]).
pub fn take_attention_scores() -> u64 {
    flash_ring::work::take_scores()
}

/// One attention call: the mask over the GLOBAL sequence, the softmax scale, an optional
/// sliding window (a query at `pq` sees keys at `pq - pk < window` on top of the mask: the
/// convention of transformers' `sliding_window`) and an optional logit soft-cap (the softmax
/// takes `c · tanh(scale · q·k / c)`: Gemma 2's `attn_logit_softcapping`). Every rank of the
/// group passes the same call.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnCall {
    pub mask: AttnMask,
    pub scale: f32,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl AttnCall {
    pub fn new(mask: AttnMask, scale: f32) -> Self {
        Self {
            mask,
            scale,
            window: None,
            softcap: None,
        }
    }

    /// The same call with its logits soft-capped at `softcap` (`None`: no cap).
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    /// The same call with a sliding window of `window` tokens (`None`: no window).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// The flash-ring spec of this call for rows at `q_pos` against keys at `k_pos`.
    pub fn spec(
        &self,
        q_pos: flash_ring::Positions,
        k_pos: flash_ring::Positions,
    ) -> flash_ring::AttnSpec {
        let spec = self.mask.spec(self.scale, q_pos, k_pos);
        let spec = match self.window {
            Some(w) => spec.with_window(w),
            None => spec,
        };
        match self.softcap {
            Some(c) => spec.with_softcap(c),
            None => spec,
        }
    }

    /// False only when no query of `q` may attend any key of `k` under the mask and the window
    /// (a conservative test on the blocks' ranges); a strategy then skips the pair's compute.
    pub fn may_attend(&self, q: &MaskBlock, k: &MaskBlock) -> bool {
        self.mask.may_attend(q, k)
            && self
                .window
                .is_none_or(|w| self.mask.window_reaches(q, k, w))
    }
}

/// This rank's q, k, v of one attention call: `q` `(batch, n, q_heads, head_dim)`, `k`, `v`
/// `(batch, n, kv_heads, head_dim)`, rows in [`ShardPlan`] order.
#[derive(Debug, Clone)]
pub struct Qkv {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

impl Qkv {
    pub fn new(q: &Tensor, k: &Tensor, v: &Tensor) -> Self {
        Self {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
        }
    }

    /// The same tensors, detached.
    pub fn detached(&self) -> Self {
        Self::new(&self.q.detach(), &self.k.detach(), &self.v.detach())
    }
}

/// What a forward returns: `out` and, when asked for, `lse`.
pub type AttnOut = (Tensor, Option<Tensor>);

/// `(dq, dk, dv)`.
pub type Grads = (Tensor, Tensor, Tensor);

/// The two accessors every strategy implements alike: its name and its group (field `group`).
macro_rules! strategy_accessors {
    ($name:literal) => {
        fn name(&self) -> &'static str {
            $name
        }

        fn group(&self) -> &SpGroup {
            &self.group
        }
    };
}
pub(crate) use strategy_accessors;

/// What the backward of one attention call needs: this rank's inputs and its FINAL results
/// (`out` in q's shape, `lse` `(batch, q_heads, n)` f32), as [`SequenceParallelAttention::forward`]
/// returned them with `want_lse`.
#[derive(Debug, Clone)]
pub struct Saved {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub out: Tensor,
    pub lse: Tensor,
}

impl Saved {
    pub fn new(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, lse: &Tensor) -> Self {
        Self {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            out: out.clone(),
            lse: lse.clone(),
        }
    }

    /// The same tensors, detached (a backward records nothing).
    pub fn detached(&self) -> Self {
        Self {
            q: self.q.detach(),
            k: self.k.detach(),
            v: self.v.detach(),
            out: self.out.detach(),
            lse: self.lse.detach(),
        }
    }

    /// The query side of a blockwise backward, with the output gradient `dout`.
    pub fn rows(&self, dout: &Tensor) -> QRows {
        QRows {
            q: self.q.clone(),
            out: self.out.clone(),
            lse: self.lse.clone(),
            dout: dout.clone(),
        }
    }

    /// `(dq, dk, dv)` cast to the dtypes of q, k and v (strategies accumulate in f32).
    pub fn cast_grads(
        &self,
        (dq, dk, dv): (Tensor, Tensor, Tensor),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok((
            dq.to_dtype(self.q.dtype())?,
            dk.to_dtype(self.k.dtype())?,
            dv.to_dtype(self.v.dtype())?,
        ))
    }
}

/// A sequence-parallel attention strategy, run by every rank of its group on its local shard.
///
/// Contract of every implementation:
/// - `q` `(batch, n, q_heads, head_dim)`, `k`, `v` `(batch, n, kv_heads, head_dim)`, all the same
///   dtype and device, `n` this rank's number of tokens, rows in [`ShardPlan`] order;
/// - returns `out` `(batch, n, q_heads, head_dim)` in q's dtype, rows in the same order, and,
///   when `want_lse`, the softmax log-sum-exp `(batch, q_heads, n)` f32 (detached; rows with no
///   visible key have `lse = -inf` and `out = 0`);
/// - collective: every rank of the group calls it with the same shapes and [`AttnCall`], and then
///   backpropagates through `out` (the backward communicates too);
/// - shape, mask and degree errors are detected before any communication, alike on every rank,
///   and name the strategy ([`SequenceParallelAttention::name`]).
pub trait SequenceParallelAttention: Send + Sync {
    /// A short name (`"ring"`, `"ulysses"`, ...), for errors, logs and benchmarks.
    fn name(&self) -> &'static str;

    /// The sequence-parallel group the strategy runs on.
    fn group(&self) -> &SpGroup;

    /// The sharding this strategy expects for a global sequence of `seq_len` tokens without a
    /// document mask.
    fn plan(&self, seq_len: usize) -> Result<ShardPlan> {
        self.group().plan(seq_len)
    }

    /// The sharding this strategy expects for a global sequence of `seq_len` tokens under
    /// `mask` (what its calls with that mask use).
    fn plan_for(&self, seq_len: usize, mask: &AttnMask) -> Result<ShardPlan> {
        self.group().plan_for(seq_len, mask)
    }

    /// This rank's `(ring_rank, ulysses_rank)` in [`SequenceParallelAttention::plan`].
    fn shard_coords(&self) -> (usize, usize) {
        self.group().coords()
    }

    /// Runs the strategy; see the trait docs. `want_lse = false` saves the communication of lse.
    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut>;

    /// The backward of [`SequenceParallelAttention::forward`] from its inputs and FINAL results
    /// (`saved`) and the output gradient `dout`: `(dq, dk, dv)` shaped and typed like `q`, `k`,
    /// `v` (this rank's shard). Collective like `forward`. Records nothing. Selective activation
    /// recomputation uses it to replay a layer's attention without running it again: it keeps
    /// `out` and `lse` and recomputes `q`, `k`, `v` (see [`crate::recompute`]).
    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads>;

    /// Differentiable attention of this rank's shard: `out` `(batch, n, q_heads, head_dim)`.
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, call: &AttnCall) -> Result<Tensor> {
        Ok(self.forward(&Qkv::new(q, k, v), call, false)?.0)
    }

    /// As [`SequenceParallelAttention::attention`], also returning lse `(batch, q_heads, n)` f32.
    fn attention_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        call: &AttnCall,
    ) -> Result<(Tensor, Tensor)> {
        let (out, lse) = self.forward(&Qkv::new(q, k, v), call, true)?;
        let lse = lse
            .ok_or_else(|| Error::invalid(self.name(), "internal: the strategy returned no lse"))?;
        Ok((out, lse))
    }
}

/// The sequence-parallel group of one rank: its Ulysses (head-parallel) and ring
/// (context-parallel) communicators and the sequence layout of the ring.
#[derive(Clone, Debug)]
pub struct SpGroup {
    /// Head-parallel group (all-to-all); size 1 when unused.
    pub ulysses: Comm,
    /// Context-parallel group (ring P2P, all-gather CP); size 1 when unused.
    pub ring: Comm,
    /// How the sequence is split over the ring ranks.
    pub layout: SeqLayout,
}

impl SpGroup {
    pub fn new(ulysses: Comm, ring: Comm, layout: SeqLayout) -> Self {
        Self {
            ulysses,
            ring,
            layout,
        }
    }

    /// Fails (naming `strategy` and what to use instead) unless the ulysses degree is 1: the
    /// strategies that run on the ring group only.
    pub fn require_no_ulysses(&self, strategy: &str, instead: &str) -> Result<()> {
        if self.ulysses.size() != 1 {
            return Err(Error::Layout(format!(
                "{strategy} runs on the ring group only; the ulysses degree is {} ({instead})",
                self.ulysses.size()
            )));
        }
        Ok(())
    }

    /// Ranks in the sequence-parallel group, `ulysses × ring`.
    pub fn degree(&self) -> usize {
        self.ulysses.size() * self.ring.size()
    }

    /// `(ring_rank, ulysses_rank)` of this rank.
    pub fn coords(&self) -> (usize, usize) {
        (self.ring.rank(), self.ulysses.rank())
    }

    /// The sharding of a global sequence of `seq_len` tokens over this group without a
    /// document mask (pure).
    pub fn plan(&self, seq_len: usize) -> Result<ShardPlan> {
        ShardPlan::new(seq_len, self.layout, self.ring.size(), self.ulysses.size())
    }

    /// The sharding of a global sequence of `seq_len` tokens under `mask` over this group
    /// (pure; see [`ShardPlan::for_mask`]).
    pub fn plan_for(&self, seq_len: usize, mask: &AttnMask) -> Result<ShardPlan> {
        ShardPlan::for_mask(
            seq_len,
            self.layout,
            self.ring.size(),
            self.ulysses.size(),
            mask,
        )
    }

    /// Checks q, k, v and the mask before any communication; returns the dims and the plan of
    /// the global sequence (`seq_len = n · degree`).
    pub fn check(
        &self,
        op: &'static str,
        x: &Qkv,
        mask: &AttnMask,
    ) -> Result<(QkvDims, ShardPlan)> {
        let dims = QkvDims::check(op, &x.q, &x.k, &x.v)?;
        let seq_len = dims.n * self.degree();
        mask.check(op, seq_len)?;
        let plan = self.plan_for(seq_len, mask)?;
        Ok((dims, plan))
    }
}

impl SpGroup {
    /// [`SpGroup::check`] for a backward: also checks that `out` and `dout` have q's shape and
    /// `lse` is `(batch, q_heads, n)`.
    pub fn check_backward(
        &self,
        op: &'static str,
        saved: &Saved,
        dout: &Tensor,
        mask: &AttnMask,
    ) -> Result<(QkvDims, ShardPlan)> {
        let qkv = Qkv::new(&saved.q, &saved.k, &saved.v);
        let (dims, plan) = self.check(op, &qkv, mask)?;
        for (name, t) in [("out", &saved.out), ("dout", dout)] {
            if t.dims() != saved.q.dims() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{name} has shape {:?}, q has {:?}",
                        t.dims(),
                        saved.q.dims()
                    ),
                ));
            }
        }
        if saved.lse.dims() != [dims.batch, dims.q_heads, dims.n] {
            return Err(Error::invalid(
                op,
                format!(
                    "lse has shape {:?}, expected (batch, q_heads, n) = {:?}",
                    saved.lse.dims(),
                    [dims.batch, dims.q_heads, dims.n]
                ),
            ));
        }
        Ok((dims, plan))
    }
}

/// The dims of a (q, k, v) triple of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvDims {
    pub batch: usize,
    /// Local tokens.
    pub n: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl QkvDims {
    /// Validates `q` `(b, n, hq, d)`, `k`, `v` `(b, n, hkv, d)` with `hq % hkv == 0`, one dtype.
    pub fn check(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let dims4 = |name: &str, t: &Tensor| -> Result<(usize, usize, usize, usize)> {
            t.dims4().map_err(|_| {
                Error::invalid(
                    op,
                    format!(
                        "{name} must be (batch, seq, heads, head_dim), got shape {:?}",
                        t.dims()
                    ),
                )
            })
        };
        let (b, n, hq, d) = dims4("q", q)?;
        let kd = dims4("k", k)?;
        if v.dims() != k.dims() {
            return Err(Error::invalid(
                op,
                format!("v has shape {:?}, k has {:?}", v.dims(), k.dims()),
            ));
        }
        let (kb, kn, hkv, kdim) = kd;
        if kb != b || kn != n || kdim != d {
            return Err(Error::invalid(
                op,
                format!(
                    "q {:?} and k {:?} must agree in batch, seq and head_dim",
                    q.dims(),
                    k.dims()
                ),
            ));
        }
        if hkv == 0 || hq % hkv != 0 {
            return Err(Error::invalid(
                op,
                format!("q_heads {hq} is not a positive multiple of kv_heads {hkv}"),
            ));
        }
        if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
            return Err(Error::invalid(
                op,
                format!(
                    "q, k, v must share one dtype, got {:?}, {:?}, {:?}",
                    q.dtype(),
                    k.dtype(),
                    v.dtype()
                ),
            ));
        }
        if n == 0 {
            return Err(Error::invalid(op, "empty local sequence"));
        }
        Ok(Self {
            batch: b,
            n,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
        })
    }
}

/// The configured strategy of this rank, built by one constructor from the mesh.
///
/// Holds the strategy's communicators; [`SpAttention::shard`] and [`SpAttention::gather`]
/// convert between global batches and this rank's shards in the strategy's token order.
pub struct SpAttention {
    cfg: SpConfig,
    group: SpGroup,
    imp: Box<dyn SequenceParallelAttention>,
}

impl std::fmt::Debug for SpAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpAttention")
            .field("cfg", &self.cfg)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl SpAttention {
    /// Builds the strategy of `cfg` on `mesh`'s Ulysses and ring communicators. Checks that the
    /// mesh's degrees and placement are those of `cfg`. Local (no communication) for the
    /// strategies of this module; strategies that need sub-communicators may split (collective).
    pub fn new(cfg: &SpConfig, mesh: &DeviceMesh) -> Result<Self> {
        let (u, r) = (mesh.size(Dim::Ulysses), mesh.size(Dim::Ring));
        if (u, r) != (cfg.ulysses, cfg.ring) {
            return Err(Error::Layout(format!(
                "the sequence-parallel config asks for ulysses {} x ring {}, the mesh has \
                 ulysses {u} x ring {r}",
                cfg.ulysses, cfg.ring
            )));
        }
        if mesh.layout().placement() != cfg.placement {
            return Err(Error::Layout(format!(
                "the sequence-parallel config asks for {} placement, the mesh is {}",
                cfg.placement,
                mesh.layout().placement()
            )));
        }
        Self::from_comms(cfg, mesh.comm(Dim::Ulysses), mesh.comm(Dim::Ring))
    }

    /// Builds the strategy of `cfg` on explicit communicators (sizes must be `cfg.ulysses` and
    /// `cfg.ring`). For library users without a [`DeviceMesh`], and tests.
    pub fn from_comms(cfg: &SpConfig, ulysses: Comm, ring: Comm) -> Result<Self> {
        cfg.validate()?;
        if ulysses.size() != cfg.ulysses || ring.size() != cfg.ring {
            return Err(Error::Layout(format!(
                "the sequence-parallel config asks for ulysses {} x ring {}, the communicators \
                 have sizes {} and {}",
                cfg.ulysses,
                cfg.ring,
                ulysses.size(),
                ring.size()
            )));
        }
        let group = SpGroup::new(ulysses, ring, cfg.layout);
        let imp: Box<dyn SequenceParallelAttention> = match cfg.strategy {
            Strategy::Ring => Box::new(RingAttention::new(group.clone())?),
            Strategy::Ulysses => Box::new(UlyssesAttention::new(group.clone())?),
            Strategy::Usp => Box::new(UspAttention::new(group.clone())?),
            Strategy::AllGather => Box::new(AllGatherAttention::new(group.clone())?),
            Strategy::DoubleRing => {
                Box::new(DoubleRingAttention::new(group.clone(), cfg.inner_ring)?)
            }
            Strategy::StarTrail => Box::new(StarTrailAttention::new(group.clone(), cfg.team)?),
        };
        Ok(Self {
            cfg: cfg.clone(),
            group,
            imp,
        })
    }

    pub fn config(&self) -> &SpConfig {
        &self.cfg
    }

    pub fn group(&self) -> &SpGroup {
        &self.group
    }

    /// The global positions (for RoPE) of this rank's tokens, in local order, without a
    /// document mask ([`SpAttention::local_positions_for`] with [`AttnMask::Causal`]).
    pub fn local_positions(&self, seq_len: usize) -> Result<Vec<u32>> {
        self.local_positions_for(seq_len, &AttnMask::Causal)
    }

    /// The global positions (for RoPE) of this rank's tokens under `mask`, in local order.
    pub fn local_positions_for(&self, seq_len: usize, mask: &AttnMask) -> Result<Vec<u32>> {
        let (r, u) = self.shard_coords();
        Ok(self.plan_for(seq_len, mask)?.local_positions(r, u))
    }

    /// This rank's shard of a global tensor (tokens, position ids, document ids, labels, q/k/v)
    /// whose `dim` is the sequence, without a document mask. Local; differentiable
    /// (index_select).
    pub fn shard(&self, global: &Tensor, dim: usize) -> Result<Tensor> {
        self.shard_for(global, dim, &AttnMask::Causal)
    }

    /// [`SpAttention::shard`] for the calls with `mask` (its documents choose the
    /// [`SeqLayout::DocZigzag`] plan).
    pub fn shard_for(&self, global: &Tensor, dim: usize, mask: &AttnMask) -> Result<Tensor> {
        let (r, u) = self.shard_coords();
        self.plan_for(global.dim(dim)?, mask)?
            .shard(global, dim, r, u)
    }

    /// The global tensor from every rank's shard (`dim` the sequence), on every rank, in global
    /// order, without a document mask. Collective over the group; differentiable with
    /// replicated-loss semantics ([`crate::collectives::gather`]).
    pub fn gather(&self, local: &Tensor, dim: usize) -> Result<Tensor> {
        self.gather_for(local, dim, &AttnMask::Causal)
    }

    /// [`SpAttention::gather`] of shards cut for the calls with `mask`.
    pub fn gather_for(&self, local: &Tensor, dim: usize, mask: &AttnMask) -> Result<Tensor> {
        let seq_len = local.dim(dim)? * self.group.degree();
        self.plan_for(seq_len, mask)?
            .gather(local, dim, &self.group.ulysses, &self.group.ring)
    }
}

impl SequenceParallelAttention for SpAttention {
    fn name(&self) -> &'static str {
        self.imp.name()
    }

    fn group(&self) -> &SpGroup {
        &self.group
    }

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        self.imp.forward(qkv, call, want_lse)
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        self.imp.backward(saved, dout, call)
    }
}
