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
use super::mask::AttnMask;
use super::{SequenceParallelAttention, SpGroup};
use crate::collectives;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

/// All-gather context parallelism over the ring group (ulysses degree 1).
pub struct AllGatherAttention {
    group: SpGroup,
}

impl AllGatherAttention {
    /// Fails if the group's ulysses degree is not 1.
    pub fn new(group: SpGroup) -> Result<Self> {
        if group.ulysses.size() != 1 {
            return Err(Error::Layout(format!(
                "all-gather context parallelism runs on the ring group only; the ulysses degree \
                 is {}",
                group.ulysses.size()
            )));
        }
        Ok(Self { group })
    }
}

impl SequenceParallelAttention for AllGatherAttention {
    fn name(&self) -> &'static str {
        "all-gather"
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
        let (_, plan) = self.group.check("all-gather cp", q, k, v, mask)?;
        let cp = &self.group.ring;
        let (k_all, v_all) = if cp.size() > 1 {
            (
                collectives::all_gather(k, cp, 1)?,
                collectives::all_gather(v, cp, 1)?,
            )
        } else {
            (k.clone(), v.clone())
        };
        // Gathered keys are in rank order: the concatenation of every rank's positions.
        let q_pos = positions(&plan.ring_positions(cp.rank()));
        let k_pos = positions(&plan.concat_order());
        let spec = mask.spec(scale, q_pos, k_pos);
        let (out, lse) =
            flash_ring::flash_attention_with_lse(q, &k_all, &v_all, &spec).map_err(kernel_err)?;
        Ok((out, want_lse.then_some(lse)))
    }

    /// All-gathers K and V again (the forward did not keep them), runs the kernel's backward
    /// and reduce-scatters dK, dV to their owners.
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
        let (_, plan) =
            self.group
                .check_backward("all-gather cp", q, k, v, out, lse, dout, mask)?;
        let cp = &self.group.ring;
        let (k_all, v_all) = (
            cp.all_gather(&k.detach(), 1)?,
            cp.all_gather(&v.detach(), 1)?,
        );
        let q_pos = positions(&plan.ring_positions(cp.rank()));
        let k_pos = positions(&plan.concat_order());
        let spec = mask.spec(scale, q_pos, k_pos);
        let (dq, dk_all, dv_all) = flash_ring::flash_bwd_f32(
            &q.detach(),
            &k_all,
            &v_all,
            &out.detach(),
            &lse.detach(),
            &dout.detach(),
            &spec,
        )
        .map_err(kernel_err)?;
        let scatter = |x: &Tensor| cp.reduce_scatter(x, 1, ReduceOp::Sum);
        Ok((
            dq.to_dtype(q.dtype())?,
            scatter(&dk_all)?.to_dtype(k.dtype())?,
            scatter(&dv_all)?.to_dtype(v.dtype())?,
        ))
    }
}
