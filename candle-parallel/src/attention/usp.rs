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

use super::ring::{ring_attention, ring_backward, RingBlocks, RingComm};
use super::ulysses::HeadParallel;
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
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
    strategy_accessors!("usp");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        HeadParallel::of(self).forward(qkv, call, want_lse, |h, plan| {
            let blocks = Arc::new(RingBlocks::natural(plan, &self.ring, call));
            ring_attention(&self.ring, h, blocks, call)
        })
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        HeadParallel::of(self).backward(saved, dout, call, |h, dout, plan| {
            let blocks = RingBlocks::natural(plan, &self.ring, call);
            ring_backward(&self.ring, &h.rows(dout), &h.k, &h.v, &blocks, call)
        })
    }
}
