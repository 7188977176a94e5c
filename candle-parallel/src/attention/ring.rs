//! Ring attention (Liu et al.), with contiguous, zigzag or striped sharding.
//!
//! `P` ranks each hold a block of q and of kv. Forward: `P` steps; at step `s` a rank posts the
//! kv block it holds to `next` (receiving the next one from `prev`), computes its q against the
//! held block while the transfer is in flight, and merges `(out, lse)`. Backward: `P` steps; the
//! kv blocks travel again, `dq` accumulates locally (f32), and each block's `dk`/`dv`
//! accumulator (f32) travels with it, one hop behind; after the last step one more hop brings
//! every accumulator home. Block pairs that the mask hides entirely (causal blocks from later
//! ranks in the contiguous layout) are not computed, but their blocks are still forwarded, so
//! the traffic does not depend on the mask.
//!
//! Traffic per rank, with `K` = bytes of the local k block (v the same) and `K32` the same in
//! f32: forward sends `(P-1)·2K` (P-1 exchanges); backward sends `(P-1)·2K + P·2·K32`.
//!
//! [`ring_forward`] / [`ring_backward`] are the reusable loop (any ring: the caller gives the
//! kv positions held at each step); [`ring_attention`] wraps them as a differentiable op;
//! [`RingAttention`] is the strategy on the ring group of the mesh.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::block::{block_bwd, block_fwd, Partial, QRows};
use super::layout::ShardPlan;
use super::mask::{AttnMask, MaskBlock};
use super::op::record_attention;
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::comm::{Comm, Pending, RecvSpec};
use crate::error::{Error, Result};

/// One ring over a communicator: this rank sends to `next` and receives from `prev`.
#[derive(Clone, Debug)]
pub struct RingComm {
    comm: Comm,
    next: usize,
    prev: usize,
}

impl RingComm {
    /// The natural ring of `comm`: rank `r` sends to `r+1` and receives from `r-1` (mod P).
    pub fn new(comm: Comm) -> Self {
        let (r, p) = (comm.rank(), comm.size());
        Self {
            next: (r + 1) % p,
            prev: (r + p - 1) % p,
            comm,
        }
    }

    /// A ring with explicit neighbours in `comm` (e.g. an inner ring of a double ring). Every
    /// member of the ring must build it consistently.
    pub fn with_neighbours(comm: Comm, next: usize, prev: usize) -> Result<Self> {
        if next >= comm.size() || prev >= comm.size() {
            return Err(Error::invalid(
                "ring",
                format!(
                    "neighbours next {next} / prev {prev} outside a communicator of {} ranks",
                    comm.size()
                ),
            ));
        }
        Ok(Self { comm, next, prev })
    }

    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The rank this rank sends to.
    pub fn next(&self) -> usize {
        self.next
    }

    /// The rank this rank receives from.
    pub fn prev(&self) -> usize {
        self.prev
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// On the natural ring ([`RingComm::new`]): the rank whose block this rank holds after
    /// `step` shifts, `(rank - step) mod P`.
    pub fn owner(&self, step: usize) -> usize {
        let p = self.size();
        (self.rank() + p - step % p) % p
    }

    /// Posts one grouped exchange: `blocks` to `next`, blocks of the same shapes and dtypes from
    /// `prev`. [`Pending::wait`] returns the received blocks in order. Overlap compute between
    /// the two calls.
    pub fn shift(&self, blocks: &[&Tensor]) -> Result<Pending> {
        let sends = blocks.iter().map(|t| (self.next, (*t).clone())).collect();
        let recvs = blocks
            .iter()
            .map(|t| RecvSpec::like(self.prev, t))
            .collect();
        self.comm.exchange(sends, recvs)
    }
}

/// The global positions of this rank's q rows and of the kv block it holds at each step.
#[derive(Debug, Clone)]
pub struct RingBlocks {
    pub q: MaskBlock,
    /// `kv[s]`: the block held at step `s` (`kv[0]` is this rank's own), one per ring rank.
    pub kv: Vec<MaskBlock>,
}

impl RingBlocks {
    /// The blocks of the natural ring over the ring ranks of `plan`: q rows and the own kv block
    /// at `plan.ring_positions(ring.rank())`, the block of step `s` at those of
    /// `ring.owner(s)`. This is the view after Ulysses' all-to-all (or with ulysses degree 1).
    pub fn natural(plan: &ShardPlan, ring: &RingComm, mask: &AttnMask) -> Self {
        let by_rank: Vec<MaskBlock> = (0..plan.ring())
            .map(|r| mask.block(&plan.ring_positions(r)))
            .collect();
        Self {
            q: by_rank[ring.rank()].clone(),
            kv: (0..ring.size())
                .map(|s| by_rank[ring.owner(s)].clone())
                .collect(),
        }
    }
}

fn take2(mut v: Vec<Tensor>, what: &str) -> Result<(Tensor, Tensor)> {
    match (v.pop(), v.pop()) {
        (Some(b), Some(a)) if v.is_empty() => Ok((a, b)),
        _ => Err(Error::invalid(
            "ring",
            format!("internal: expected two received {what} tensors"),
        )),
    }
}

fn check_steps(ring: &RingComm, blocks: &RingBlocks) -> Result<()> {
    if blocks.kv.len() != ring.size() {
        return Err(Error::invalid(
            "ring",
            format!(
                "{} kv blocks given for a ring of {} ranks",
                blocks.kv.len(),
                ring.size()
            ),
        ));
    }
    Ok(())
}

/// The forward loop: `P = ring.size()` steps of compute on the held kv block while the next one
/// is in flight. Returns the merged partial (this rank's q against every kv block).
///
/// Shapes: `q` `(b, nq, hq, d)`, `k`, `v` `(b, nk, hkv, d)` (the same on every rank of the
/// ring). Called by every rank of the ring. Sends `P-1` exchanges of `(k, v)` to `next`.
pub fn ring_forward(
    ring: &RingComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: &RingBlocks,
    call: &AttnCall,
) -> Result<Partial> {
    check_steps(ring, blocks)?;
    let p = ring.size();
    let mut partial = Partial::new();
    let (mut kc, mut vc) = (k.clone(), v.clone());
    for (s, kb) in blocks.kv.iter().enumerate() {
        let _span = tracing::info_span!("ring_step", step = s, pass = %"forward").entered();
        let pending = if s + 1 < p {
            Some(ring.shift(&[&kc, &vc])?)
        } else {
            None
        };
        partial.add_opt(block_fwd(q, &kc, &vc, call, &blocks.q, kb)?)?;
        if let Some(pd) = pending {
            (kc, vc) = take2(pd.wait()?, "kv")?;
        }
    }
    Ok(partial)
}

/// The backward loop of this rank's `rows` (q with its FINAL `out`, `lse` and the output
/// gradient). Returns `(dq, dk, dv)` in f32 for this rank's own q, k, v.
///
/// Called by every rank of the ring. Sends `P-1` exchanges of `(k, v)` and `P` exchanges of
/// the f32 `(dk, dv)` accumulators (the last one brings them home).
pub fn ring_backward(
    ring: &RingComm,
    rows: &QRows,
    k: &Tensor,
    v: &Tensor,
    blocks: &RingBlocks,
    call: &AttnCall,
) -> Result<(Tensor, Tensor, Tensor)> {
    check_steps(ring, blocks)?;
    let p = ring.size();
    let mut dq: Option<Tensor> = None;
    let (mut kc, mut vc) = (k.clone(), v.clone());
    let mut dkv_in_flight: Option<Pending> = None;
    let mut dkv_home = None;
    for (s, kb) in blocks.kv.iter().enumerate() {
        let _span = tracing::info_span!("ring_step", step = s, pass = %"backward").entered();
        let kv_pending = if s + 1 < p {
            Some(ring.shift(&[&kc, &vc])?)
        } else {
            None
        };
        let g = block_bwd(rows, &kc, &vc, call, &blocks.q, kb)?;
        // The accumulator of the held block arrives one hop behind it.
        let acc = match dkv_in_flight.take() {
            Some(pd) => Some(take2(pd.wait()?, "dk/dv")?),
            None => None,
        };
        let (dk_acc, dv_acc) = match (acc, g) {
            (Some((a, b)), Some((dq_b, dk_b, dv_b))) => {
                dq = Some(add_opt(dq, dq_b)?);
                ((a + dk_b)?, (b + dv_b)?)
            }
            (None, Some((dq_b, dk_b, dv_b))) => {
                dq = Some(add_opt(dq, dq_b)?);
                (dk_b, dv_b)
            }
            (Some(acc), None) => acc,
            (None, None) => {
                let z = Tensor::zeros(kc.shape(), DType::F32, kc.device())?;
                (z.clone(), z)
            }
        };
        if p > 1 {
            dkv_in_flight = Some(ring.shift(&[&dk_acc, &dv_acc])?);
        } else {
            dkv_home = Some((dk_acc, dv_acc));
        }
        if let Some(pd) = kv_pending {
            (kc, vc) = take2(pd.wait()?, "kv")?;
        }
    }
    let (dk, dv) = match (dkv_in_flight, dkv_home) {
        (Some(pd), _) => take2(pd.wait()?, "dk/dv")?,
        (None, Some(h)) => h,
        (None, None) => return Err(Error::invalid("ring", "internal: empty ring")),
    };
    let dq = match dq {
        Some(t) => t,
        None => Tensor::zeros(rows.q.shape(), DType::F32, rows.q.device())?,
    };
    Ok((dq, dk, dv))
}

fn add_opt(acc: Option<Tensor>, x: Tensor) -> Result<Tensor> {
    Ok(match acc {
        Some(a) => (a + x)?,
        None => x,
    })
}

/// Differentiable ring attention of this rank's `q` against the kv blocks of the whole ring:
/// returns `out` (q's shape and dtype; recorded on `q`, `k`, `v`) and `lse` `(b, hq, nq)` f32.
/// The backward runs [`ring_backward`] (collective over the ring).
pub fn ring_attention(
    ring: &RingComm,
    qkv: &Qkv,
    blocks: Arc<RingBlocks>,
    call: &AttnCall,
) -> Result<(Tensor, Tensor)> {
    let x = qkv.detached();
    let (out, lse) = ring_forward(ring, &x.q, &x.k, &x.v, &blocks, call)?.finish(&x.q)?;
    let (ring, call) = (ring.clone(), call.clone());
    let out = record_attention("cpl-ring-attention", qkv, out, &lse, move |s, dout| {
        ring_backward(&ring, &s.rows(dout), &s.k, &s.v, &blocks, &call)
    })?;
    Ok((out, lse))
}

/// Ring attention over the ring group (ulysses degree 1), in the group's [`super::SeqLayout`].
pub struct RingAttention {
    group: SpGroup,
    ring: RingComm,
}

impl RingAttention {
    /// Fails if the group's ulysses degree is not 1 (use [`super::UspAttention`]).
    pub fn new(group: SpGroup) -> Result<Self> {
        group.require_no_ulysses("ring", "use usp")?;
        let ring = RingComm::new(group.ring.clone());
        Ok(Self { group, ring })
    }
}

impl SequenceParallelAttention for RingAttention {
    strategy_accessors!("ring");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (_, plan) = self.group.check(self.name(), qkv, &call.mask)?;
        let blocks = Arc::new(RingBlocks::natural(&plan, &self.ring, &call.mask));
        let (out, lse) = ring_attention(&self.ring, qkv, blocks, call)?;
        Ok((out, want_lse.then_some(lse)))
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        let (_, plan) = self
            .group
            .check_backward(self.name(), saved, dout, &call.mask)?;
        let blocks = RingBlocks::natural(&plan, &self.ring, &call.mask);
        let s = saved.detached();
        let grads = ring_backward(
            &self.ring,
            &s.rows(&dout.detach()),
            &s.k,
            &s.v,
            &blocks,
            call,
        )?;
        saved.cast_grads(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::AttnMask;
    use crate::comm::LocalWorld;
    use candle_core::Device;

    /// The natural ring's neighbours and owners on 3 ranks, explicit neighbours, and their
    /// validation (either neighbour out of range is an error).
    #[test]
    fn ring_neighbours_and_owners() {
        let got = LocalWorld::run(3, |comm| -> Result<_> {
            let r = comm.rank();
            let ring = RingComm::new(comm.clone());
            let owners: Vec<usize> = (0..7).map(|s| ring.owner(s)).collect();
            let explicit = RingComm::with_neighbours(comm.clone(), 2, 1)?;
            let bad_next = RingComm::with_neighbours(comm.clone(), 3, 0).is_err();
            let bad_prev = RingComm::with_neighbours(comm.clone(), 0, 3).is_err();
            Ok((
                r,
                ring.next(),
                ring.prev(),
                owners,
                explicit.next(),
                explicit.prev(),
                bad_next,
                bad_prev,
            ))
        })
        .unwrap();
        for (r, next, prev, owners, en, ep, bad_next, bad_prev) in got {
            assert_eq!((next, prev), ((r + 1) % 3, (r + 2) % 3), "rank {r}");
            let want: Vec<usize> = (0..7).map(|s| (r + 3 - s % 3) % 3).collect();
            assert_eq!(owners, want, "rank {r}");
            assert_eq!((en, ep), (2, 1));
            assert!(bad_next && bad_prev, "rank {r}");
        }
    }

    /// `take2` accepts exactly two received tensors; `check_steps` one kv block per ring rank.
    #[test]
    fn received_blocks_and_steps_are_counted() {
        let t = || Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(take2(vec![t(), t()], "kv").is_ok());
        assert!(take2(vec![t(), t(), t()], "kv").is_err());
        assert!(take2(vec![t()], "kv").is_err());
        let out = LocalWorld::run(2, |comm| -> Result<_> {
            let ring = RingComm::new(comm);
            let mask = AttnMask::Causal;
            let block = mask.block(&[0, 1]);
            let two = RingBlocks {
                q: block.clone(),
                kv: vec![block.clone(), block.clone()],
            };
            let one = RingBlocks {
                q: block.clone(),
                kv: vec![block],
            };
            Ok((
                check_steps(&ring, &two).is_ok(),
                check_steps(&ring, &one).is_err(),
            ))
        })
        .unwrap();
        assert!(out.iter().all(|&(ok, err)| ok && err), "{out:?}");
    }
}
