//! USP (Fang & Zhao): Ulysses inside each row of a `ulysses × ring` grid, load-balanced ring
//! attention inside each column (USP Algorithm 1).
//!
//! Rank `(r, u)` holds the `u`-th contiguous piece of ring rank `r`'s tokens (USP Algorithm 2,
//! see [`super::layout`]). The all-to-all over the ulysses group gathers the pieces of a row:
//! every rank of row `r` then holds all of ring rank `r`'s tokens for `hq/U` query heads, which
//! is exactly the q and kv block of ring attention over the ring group. The inverse all-to-all
//! returns the output to the input's layout.
//!
//! Traffic per rank: the Ulysses all-to-alls of [`super::ulysses`] over the ulysses group
//! (degree `U`), plus the ring traffic of [`super::ring`] over the ring group (degree `R`) with
//! kv blocks of `(b, S/R, hkv·rep/U, d)`.

use std::sync::Arc;

use candle_core::Tensor;

use super::layout::ShardPlan;
use super::mask::AttnMask;
use super::ring::{ring_attention, ring_backward, RingBlocks, RingComm};
use super::ulysses::{
    head_parallel_backward, heads_to_seq, kv_replication, lse_heads_to_seq, repeat_kv,
    seq_to_heads, HeadView,
};
use super::{SequenceParallelAttention, SpGroup};
use crate::error::Result;

/// Unified sequence parallelism: Ulysses over the ulysses group × ring over the ring group.
pub struct UspAttention {
    group: SpGroup,
    ring: RingComm,
}

impl UspAttention {
    pub fn new(group: SpGroup) -> Result<Self> {
        let ring = RingComm::new(group.ring.clone());
        Ok(Self { group, ring })
    }
}

impl SequenceParallelAttention for UspAttention {
    fn name(&self) -> &'static str {
        "usp"
    }

    fn plan(&self, seq_len: usize) -> Result<ShardPlan> {
        self.group.plan(seq_len)
    }

    fn shard_coords(&self) -> (usize, usize) {
        self.group.coords()
    }

    fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        scale: f32,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (dims, plan) = self.group.check("usp", q, k, v, mask)?;
        let ulysses = &self.group.ulysses;
        let rep = kv_replication(dims.q_heads, dims.kv_heads, ulysses.size())?;
        let q2 = seq_to_heads(q, ulysses)?;
        let k2 = seq_to_heads(&repeat_kv(k, rep)?, ulysses)?;
        let v2 = seq_to_heads(&repeat_kv(v, rep)?, ulysses)?;
        let blocks = Arc::new(RingBlocks::natural(&plan, &self.ring, mask));
        let (out, lse) = ring_attention(&self.ring, &q2, &k2, &v2, blocks, mask, scale)?;
        let out = heads_to_seq(&out, ulysses)?;
        let lse = if want_lse {
            Some(lse_heads_to_seq(&lse, ulysses)?)
        } else {
            None
        };
        Ok((out, lse))
    }

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        mask: &AttnMask,
        scale: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let inner = |h: &HeadView, plan: &ShardPlan| {
            let blocks = RingBlocks::natural(plan, &self.ring, mask);
            ring_backward(
                &self.ring, &h.q, &h.k, &h.v, &h.out, &h.lse, &h.dout, &blocks, mask, scale,
            )
        };
        head_parallel_backward(&self.group, "usp", q, k, v, out, lse, dout, mask, inner)
    }
}
