//! Llama 3 all-gather context parallelism.
//!
//! The sequence is cut into `2·cp` chunks and rank `i` holds chunks `i` and `2cp-1-i` (the
//! zigzag layout; contiguous and striped work too). Every rank all-gathers K and V over the ring
//! (context-parallel) group, then computes its local q rows against the gathered keys with the
//! mask on global positions, so each local q chunk attends exactly to the keys it may see (the
//! kernel skips the masked tiles; with documents, only its documents). Backward: the
//! all-gather's adjoint reduce-scatters (sums) dK and dV back to their owners.
//!
//! Traffic per rank, with `K` the bytes of the local k block (v the same): forward sends
//! `2·(cp-1)·K` (all-gather of k and v, exposed, not overlapped), backward `2·(cp-1)·K`
//! (reduce-scatter of dk and dv).

use candle_core::Tensor;

use super::block::kernel_err;
use super::layout::{positions, ShardPlan};
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::collectives;
use crate::comm::ReduceOp;
use crate::error::Result;

/// All-gather context parallelism over the ring group (ulysses degree 1).
pub struct AllGatherAttention {
    group: SpGroup,
}

impl AllGatherAttention {
    /// Fails if the group's ulysses degree is not 1.
    pub fn new(group: SpGroup) -> Result<Self> {
        group.require_no_ulysses("all-gather", "put the ranks in the ring dim")?;
        Ok(Self { group })
    }

    /// The spec of this rank's q rows against the gathered keys (in rank order: the
    /// concatenation of every rank's positions).
    fn spec(&self, plan: &ShardPlan, call: &AttnCall) -> flash_ring::AttnSpec {
        let q_pos = positions(&plan.ring_positions(self.group.ring.rank()));
        call.spec(q_pos, positions(&plan.concat_order()))
    }
}

impl SequenceParallelAttention for AllGatherAttention {
    strategy_accessors!("all-gather");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (_, plan) = self.group.check(self.name(), qkv, &call.mask)?;
        let cp = &self.group.ring;
        let (k_all, v_all) = if cp.size() > 1 {
            (
                collectives::all_gather(&qkv.k, cp, 1)?,
                collectives::all_gather(&qkv.v, cp, 1)?,
            )
        } else {
            (qkv.k.clone(), qkv.v.clone())
        };
        let spec = self.spec(&plan, call);
        let (out, lse) = flash_ring::flash_attention_with_lse(&qkv.q, &k_all, &v_all, &spec)
            .map_err(kernel_err)?;
        Ok((out, want_lse.then_some(lse)))
    }

    /// All-gathers K and V again (the forward did not keep them), runs the kernel's backward
    /// and reduce-scatters dK, dV to their owners.
    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        let (_, plan) = self
            .group
            .check_backward(self.name(), saved, dout, &call.mask)?;
        let cp = &self.group.ring;
        let s = saved.detached();
        let (k_all, v_all) = (cp.all_gather(&s.k, 1)?, cp.all_gather(&s.v, 1)?);
        let spec = self.spec(&plan, call);
        let (dq, dk_all, dv_all) =
            flash_ring::flash_bwd_f32(&s.q, &k_all, &v_all, &s.out, &s.lse, &dout.detach(), &spec)
                .map_err(kernel_err)?;
        let scatter = |x: &Tensor| cp.reduce_scatter(x, 1, ReduceOp::Sum);
        saved.cast_grads((dq, scatter(&dk_all)?, scatter(&dv_all)?))
    }
}
