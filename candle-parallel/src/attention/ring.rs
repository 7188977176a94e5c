//! Ring attention (Liu et al.), with contiguous, zigzag or striped sharding.
//!
//! `P` ranks each hold a block of q and of kv. Forward: `P` steps; at step `s` a rank posts the
//! kv block it holds to `next` (receiving the next one from `prev`), computes its q against the
//! held block while the transfer is in flight, and merges `(out, lse)`. Backward: `P` steps; the
//! kv blocks travel again, `dq` accumulates locally (f32), and each block's `dk`/`dv`
//! accumulator (f32) travels with it, one hop behind; after the last step one more hop brings
//! every accumulator home. Block pairs that the mask hides entirely (causal blocks from later
//! ranks in the contiguous layout) are not computed, but without a window their blocks are
//! still forwarded, so the traffic does not depend on the mask.
//!
//! **Sliding windows** ([`AttnCall::window`]): only the steps some rank needs run
//! ([`ring_steps`]: step `s` runs when some rank's q may see, within the window, the block it
//! holds at `s`; every rank derives the same list from the plan). Between two steps that run,
//! `s < s'`, the kv block (and in backward its accumulator) jumps `s' - s` ranks ahead in one
//! exchange; after the last step `L` each accumulator goes home directly, `L` ranks back. With
//! a window shorter than a chunk: contiguous runs steps `{0, 1}`, zigzag `{0, 1, P-1}` (a
//! rank's late chunk needs the late chunk of the next rank), striped `0..min(w, P)`.
//!
//! Traffic per rank, with `K` = bytes of the local k block (v the same), `K32` the same in
//! f32, `m` the number of steps that run after step 0 and `h = 1` if the last of them is not
//! step 0 (else 0): forward sends `m·2K` (`m` exchanges); backward `m·2K + (m + h)·2·K32`
//! (`2m + h` exchanges). Without a window `m = P-1`, `h = 1`: forward `(P-1)·2K`, backward
//! `(P-1)·2K + P·2·K32`.
//!
//! [`ring_forward`] / [`ring_backward`] are the reusable loop (any ring: the caller gives the
//! kv positions held at each step and the steps that run); [`ring_attention`] wraps them as a
//! differentiable op; [`RingAttention`] is the strategy on the ring group of the mesh.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use flash_ring::MaskKind;

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
    /// Built by [`RingComm::new`]: rank `r`'s neighbours are `r ± 1`, so a jump of any number
    /// of hops has known peers ([`RingComm::peers`]).
    natural: bool,
}

impl RingComm {
    /// The natural ring of `comm`: rank `r` sends to `r+1` and receives from `r-1` (mod P).
    pub fn new(comm: Comm) -> Self {
        let (r, p) = (comm.rank(), comm.size());
        Self {
            next: (r + 1) % p,
            prev: (r + p - 1) % p,
            comm,
            natural: true,
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
        Ok(Self {
            comm,
            next,
            prev,
            natural: false,
        })
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

    /// The peers of a jump of `k` hops along the ring: `(dst, src)`, the rank `k` hops ahead
    /// (this rank sends to it) and the rank `k` hops behind (this rank receives from it). Any
    /// `k` on the natural ring ([`RingComm::new`]); on a ring with explicit neighbours only
    /// `k ≡ ±1 (mod P)` (the neighbours), else an error. Local.
    pub fn peers(&self, k: usize) -> Result<(usize, usize)> {
        let (r, p) = (self.rank(), self.size());
        let k = k % p;
        if self.natural {
            Ok(((r + k) % p, (r + p - k) % p))
        } else if k == 1 {
            Ok((self.next, self.prev))
        } else if k + 1 == p {
            Ok((self.prev, self.next))
        } else {
            Err(Error::invalid(
                "ring",
                format!("a jump of {k} hops on a ring of {p} ranks with explicit neighbours"),
            ))
        }
    }

    /// Posts one grouped exchange: `blocks` to `next`, blocks of the same shapes and dtypes from
    /// `prev`. [`Pending::wait`] returns the received blocks in order. Overlap compute between
    /// the two calls.
    pub fn shift(&self, blocks: &[&Tensor]) -> Result<Pending> {
        self.exchange_with((self.next, self.prev), blocks)
    }

    /// [`RingComm::shift`] with explicit peers `(dst, src)` (e.g. from [`RingComm::peers`]).
    pub fn exchange_with(&self, (dst, src): (usize, usize), blocks: &[&Tensor]) -> Result<Pending> {
        let sends = blocks.iter().map(|t| (dst, (*t).clone())).collect();
        let recvs = blocks.iter().map(|t| RecvSpec::like(src, t)).collect();
        self.comm.exchange(sends, recvs)
    }
}

/// The global positions of this rank's q rows and of the kv block it holds at each step, and
/// the steps that run.
#[derive(Debug, Clone)]
pub struct RingBlocks {
    pub q: MaskBlock,
    /// `kv[s]`: the block held at step `s` (`kv[0]` is this rank's own), one per ring rank.
    pub kv: Vec<MaskBlock>,
    /// The steps that run, ascending from 0, the same on every rank ([`ring_steps`]); the kv
    /// blocks are not sent to the steps left out.
    pub steps: Vec<usize>,
}

impl RingBlocks {
    /// Blocks whose every step runs (`0..kv.len()`).
    pub fn every_step(q: MaskBlock, kv: Vec<MaskBlock>) -> Self {
        let steps = (0..kv.len()).collect();
        Self { q, kv, steps }
    }

    /// The blocks of the natural ring over the ring ranks of `plan`: q rows and the own kv block
    /// at `plan.ring_positions(ring.rank())`, the block of step `s` at those of
    /// `ring.owner(s)`, and the steps of [`ring_steps`] for `call`. This is the view after
    /// Ulysses' all-to-all (or with ulysses degree 1).
    pub fn natural(plan: &ShardPlan, ring: &RingComm, call: &AttnCall) -> Self {
        let by_rank = rank_blocks(plan, &call.mask);
        Self {
            q: by_rank[ring.rank()].clone(),
            kv: (0..ring.size())
                .map(|s| by_rank[ring.owner(s)].clone())
                .collect(),
            steps: steps_of(plan, &by_rank, call),
        }
    }
}

fn rank_blocks(plan: &ShardPlan, mask: &AttnMask) -> Vec<MaskBlock> {
    (0..plan.ring())
        .map(|r| mask.block(&plan.ring_positions(r)))
        .collect()
}

/// The steps of the natural ring over the ring ranks of `plan` that `call` needs, ascending
/// from 0 (always run: a rank's own block). Without a window every step `0..P`. With one,
/// step `s` runs when some ring rank `j` needs the block of rank `(j - s) mod P` (the one it
/// holds at step `s`): [`AttnCall::may_attend`] on the blocks' ranges, and some query and some
/// key of the two blocks within the window on their exact positions (documents are judged
/// on ranges only, so a step may run whose pairs the documents all hide). Pure: every rank
/// derives the same list.
pub fn ring_steps(plan: &ShardPlan, call: &AttnCall) -> Vec<usize> {
    steps_of(plan, &rank_blocks(plan, &call.mask), call)
}

fn steps_of(plan: &ShardPlan, blocks: &[MaskBlock], call: &AttnCall) -> Vec<usize> {
    let p = blocks.len();
    let Some(w) = call.window else {
        return (0..p).collect();
    };
    let kind = call.mask.kind();
    // Layouts of a few runs per rank are checked on the runs (the planner asks at millions of
    // tokens); others on their listed positions.
    let sorted: Option<Vec<Vec<u64>>> = (0..p).any(|r| plan.ring_runs(r).is_none()).then(|| {
        (0..p)
            .map(|r| {
                let mut v: Vec<u64> = plan.ring_positions(r).into_iter().map(u64::from).collect();
                v.sort_unstable();
                v
            })
            .collect()
    });
    let reach = |j: usize, o: usize| match &sorted {
        Some(sorted) => within_window(kind, w, &sorted[j], &sorted[o]),
        None => super::allgather_cp::visible_row_count(plan, kind, w, j, o) > 0,
    };
    let needed = |s: usize| {
        (0..p).any(|j| {
            let o = (j + p - s) % p;
            call.may_attend(&blocks[j], &blocks[o]) && reach(j, o)
        })
    };
    std::iter::once(0)
        .chain((1..p).filter(|&s| needed(s)))
        .collect()
}

/// Bytes and exchanges one rank of a ring sends in one call (every rank sends the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingTraffic {
    pub forward: u64,
    pub backward: u64,
    pub forward_exchanges: u64,
    pub backward_exchanges: u64,
}

/// What a rank sends when `steps` run (the module doc's formula) with k and v blocks of
/// `kv_bytes` each, in elements of `elem_bytes` (the accumulators travel in f32). Pure.
pub fn ring_traffic(steps: &[usize], kv_bytes: u64, elem_bytes: u64) -> RingTraffic {
    let m = steps.len().saturating_sub(1) as u64;
    let home = u64::from(steps.last().is_some_and(|&l| l > 0));
    let k32 = kv_bytes / elem_bytes.max(1) * 4;
    RingTraffic {
        forward: m * 2 * kv_bytes,
        backward: m * 2 * kv_bytes + (m + home) * 2 * k32,
        forward_exchanges: m,
        backward_exchanges: 2 * m + home,
    }
}

/// Whether some query at `q` and key at `k` (ascending global positions) lie within a window of
/// `w` tokens: `0 <= pq - pk < w` (causal) or `|pq - pk| < w` (bidirectional).
fn within_window(kind: MaskKind, w: usize, q: &[u64], k: &[u64]) -> bool {
    let w = w as u64;
    let mut i = 0;
    for &pk in k {
        // The queries that may see the key lie in [lo, pk + w).
        let lo = match kind {
            MaskKind::Causal => pk,
            MaskKind::Full => (pk + 1).saturating_sub(w),
        };
        while i < q.len() && q[i] < lo {
            i += 1;
        }
        match q.get(i) {
            None => return false,
            Some(&pq) if pq < pk + w => return true,
            Some(_) => {}
        }
    }
    false
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

/// Who this rank exchanges with around the steps that run: `hops[i]`, the `(dst, src)` of the
/// jump from the `i`-th step that runs to the next one; `home`, that of the backward's last
/// exchange, which brings the accumulators home from the last step `L` (`L` hops back; `None`
/// when only step 0 runs).
#[derive(Debug)]
struct Schedule {
    hops: Vec<(usize, usize)>,
    home: Option<(usize, usize)>,
}

/// Validates `blocks` against the ring (one kv block per rank, steps ascending from 0 below
/// `P`, jumps the ring can make) before any communication.
fn schedule(ring: &RingComm, blocks: &RingBlocks) -> Result<Schedule> {
    let p = ring.size();
    if blocks.kv.len() != p {
        return Err(Error::invalid(
            "ring",
            format!(
                "{} kv blocks given for a ring of {} ranks",
                blocks.kv.len(),
                p
            ),
        ));
    }
    let steps = &blocks.steps;
    let ascending = steps.windows(2).all(|w| w[0] < w[1]);
    let last = match (steps.first(), steps.last()) {
        (Some(0), Some(&last)) if ascending && last < p => last,
        _ => {
            return Err(Error::invalid(
                "ring",
                format!("the steps that run must ascend from 0 below {p}, got {steps:?}"),
            ))
        }
    };
    let hops = steps
        .windows(2)
        .map(|w| ring.peers(w[1] - w[0]))
        .collect::<Result<_>>()?;
    let home = (last > 0).then(|| ring.peers(p - last)).transpose()?;
    Ok(Schedule { hops, home })
}

/// The forward loop over the steps that run (`blocks.steps`; every step `0..P` without a
/// window): compute on the held kv block while the block of the next step that runs is in
/// flight. Returns the merged partial (this rank's q against every kv block it needs).
///
/// Shapes: `q` `(b, nq, hq, d)`, `k`, `v` `(b, nk, hkv, d)` (the same on every rank of the
/// ring). Called by every rank of the ring with the same steps. Sends one exchange of `(k, v)`
/// per step that runs after step 0 (`P-1` when every step runs).
pub fn ring_forward(
    ring: &RingComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: &RingBlocks,
    call: &AttnCall,
) -> Result<Partial> {
    let sched = schedule(ring, blocks)?;
    let mut partial = Partial::new();
    let (mut kc, mut vc) = (k.clone(), v.clone());
    for (i, &s) in blocks.steps.iter().enumerate() {
        let _span = tracing::info_span!("ring_step", step = s, pass = %"forward").entered();
        let pending = sched
            .hops
            .get(i)
            .map(|&peers| ring.exchange_with(peers, &[&kc, &vc]))
            .transpose()?;
        partial.add_opt(block_fwd(q, &kc, &vc, call, &blocks.q, &blocks.kv[s])?)?;
        if let Some(pd) = pending {
            (kc, vc) = take2(pd.wait()?, "kv")?;
        }
    }
    Ok(partial)
}

/// The backward loop of this rank's `rows` (q with its FINAL `out`, `lse` and the output
/// gradient) over the steps that run. Returns `(dq, dk, dv)` in f32 for this rank's own q, k, v.
///
/// Called by every rank of the ring with the same steps. Sends, per step that runs after step
/// 0, one exchange of `(k, v)` and one of the f32 `(dk, dv)` accumulators, and one more
/// exchange of accumulators from the last step home (when it is not step 0): `P-1` and `P`
/// when every step runs.
pub fn ring_backward(
    ring: &RingComm,
    rows: &QRows,
    k: &Tensor,
    v: &Tensor,
    blocks: &RingBlocks,
    call: &AttnCall,
) -> Result<(Tensor, Tensor, Tensor)> {
    let sched = schedule(ring, blocks)?;
    let mut dq: Option<Tensor> = None;
    let (mut kc, mut vc) = (k.clone(), v.clone());
    let mut dkv_in_flight: Option<Pending> = None;
    let mut dkv_home = None;
    for (i, &s) in blocks.steps.iter().enumerate() {
        let _span = tracing::info_span!("ring_step", step = s, pass = %"backward").entered();
        let hop = sched.hops.get(i).copied();
        let kv_pending = hop
            .map(|peers| ring.exchange_with(peers, &[&kc, &vc]))
            .transpose()?;
        let g = block_bwd(rows, &kc, &vc, call, &blocks.q, &blocks.kv[s])?;
        // The accumulator of the held block arrives one exchange behind it.
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
        // On to the rank that holds the block at the next step that runs; after the last one,
        // straight home.
        match hop.or(sched.home) {
            Some(peers) => dkv_in_flight = Some(ring.exchange_with(peers, &[&dk_acc, &dv_acc])?),
            None => dkv_home = Some((dk_acc, dv_acc)),
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
        let blocks = Arc::new(RingBlocks::natural(&plan, &self.ring, call));
        let (out, lse) = ring_attention(&self.ring, qkv, blocks, call)?;
        Ok((out, want_lse.then_some(lse)))
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        let (_, plan) = self
            .group
            .check_backward(self.name(), saved, dout, &call.mask)?;
        let blocks = RingBlocks::natural(&plan, &self.ring, call);
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
    use crate::attention::{AttnMask, SeqLayout};
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

    /// `take2` accepts exactly two received tensors; `schedule` one kv block per ring rank and
    /// steps ascending from 0 below `P`, with jumps only where the ring knows the peers.
    #[test]
    fn received_blocks_and_steps_are_counted() {
        let t = || Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(take2(vec![t(), t()], "kv").is_ok());
        assert!(take2(vec![t(), t(), t()], "kv").is_err());
        assert!(take2(vec![t()], "kv").is_err());
        let out = LocalWorld::run(4, |comm| -> Result<_> {
            let ring = RingComm::new(comm.clone());
            let explicit = RingComm::with_neighbours(comm.clone(), ring.next(), ring.prev())?;
            let block = AttnMask::Causal.block(&[0, 1]);
            let with = |steps: Vec<usize>, n: usize| RingBlocks {
                q: block.clone(),
                kv: vec![block.clone(); n],
                steps,
            };
            let r = ring.rank();
            let all = schedule(&ring, &with(vec![0, 1, 2, 3], 4))?;
            let jumps = schedule(&ring, &with(vec![0, 1, 3], 4))?;
            let first = schedule(&ring, &with(vec![0], 4))?;
            let bad = [
                with(vec![0, 1], 3),
                with(vec![1, 2], 4),
                with(vec![0, 2, 2], 4),
                with(vec![0, 4], 4),
                with(vec![], 4),
            ]
            .iter()
            .all(|b| schedule(&ring, b).is_err());
            let explicit_ok = schedule(&explicit, &with(vec![0, 1, 2, 3], 4)).is_ok()
                && schedule(&explicit, &with(vec![0, 3], 4)).is_ok();
            let explicit_jump = schedule(&explicit, &with(vec![0, 2], 4)).is_err();
            let ok = bad && explicit_ok && explicit_jump;
            Ok((
                r,
                all.hops,
                all.home,
                jumps.hops,
                jumps.home,
                (first.hops.len(), first.home),
                ok,
            ))
        })
        .unwrap();
        for (r, all, all_home, jumps, jumps_home, (first_hops, first_home), ok) in out {
            let (n, p) = ((r + 1) % 4, (r + 3) % 4);
            assert_eq!(all, vec![(n, p); 3], "rank {r}");
            // The last step 3 holds the block of r + 1: home is the next rank.
            assert_eq!(all_home, Some((n, p)), "rank {r}");
            assert_eq!(jumps, vec![(n, p), ((r + 2) % 4, (r + 2) % 4)], "rank {r}");
            assert_eq!(jumps_home, Some((n, p)), "rank {r}");
            assert_eq!((first_hops, first_home), (0, None), "rank {r}");
            assert!(ok, "rank {r}");
        }
    }

    fn steps(
        s: usize,
        p: usize,
        layout: SeqLayout,
        mask: AttnMask,
        w: Option<usize>,
    ) -> Vec<usize> {
        let plan = ShardPlan::new(s, layout, p, 1).unwrap();
        ring_steps(&plan, &AttnCall::new(mask, 1.0).with_window(w))
    }

    /// The steps that run at 64 tokens on 4 ranks: every one without a window; with a window
    /// shorter than a chunk, contiguous needs the previous rank only, zigzag the previous and
    /// (for the late chunks) the next, striped the `w - 1` previous ranks.
    #[test]
    fn windows_leave_out_the_steps_nobody_needs() {
        use SeqLayout::*;
        let c = || AttnMask::Causal;
        for layout in SeqLayout::ALL {
            assert_eq!(
                steps(64, 4, layout, c(), None),
                vec![0, 1, 2, 3],
                "{layout}"
            );
        }
        assert_eq!(steps(64, 4, Contiguous, c(), Some(1)), vec![0]);
        assert_eq!(steps(64, 4, Contiguous, c(), Some(2)), vec![0, 1]);
        assert_eq!(steps(64, 4, Contiguous, c(), Some(16)), vec![0, 1]);
        assert_eq!(steps(64, 4, Contiguous, c(), Some(17)), vec![0, 1]);
        assert_eq!(steps(64, 4, Contiguous, c(), Some(18)), vec![0, 1, 2]);
        assert_eq!(steps(64, 4, Contiguous, c(), Some(34)), vec![0, 1, 2, 3]);
        assert_eq!(steps(64, 4, Zigzag, c(), Some(1)), vec![0]);
        assert_eq!(steps(64, 4, Zigzag, c(), Some(4)), vec![0, 1, 3]);
        assert_eq!(steps(64, 4, Zigzag, c(), Some(9)), vec![0, 1, 3]);
        assert_eq!(steps(64, 4, Zigzag, c(), Some(10)), vec![0, 1, 2, 3]);
        assert_eq!(steps(64, 4, Striped, c(), Some(1)), vec![0]);
        assert_eq!(steps(64, 4, Striped, c(), Some(3)), vec![0, 1, 2]);
        assert_eq!(steps(64, 4, Striped, c(), Some(4)), vec![0, 1, 2, 3]);
        // Bidirectional: the next rank's block too (a jump back over the ring).
        assert_eq!(
            steps(64, 4, Contiguous, AttnMask::Full, Some(4)),
            vec![0, 1, 3]
        );
        assert_eq!(
            steps(64, 8, Contiguous, AttnMask::Full, Some(4)),
            vec![0, 1, 7]
        );
        // Documents that end at the chunk borders hide the previous block as well.
        let docs = AttnMask::documents((0..64u32).map(|i| i / 16).collect::<Vec<_>>());
        assert_eq!(steps(64, 4, Contiguous, docs.clone(), Some(8)), vec![0]);
        assert_eq!(steps(64, 4, Contiguous, docs, None), vec![0, 1, 2, 3]);
    }

    /// docs/benchmarks.md: 65,536 tokens, window 4,096, cp 8: contiguous runs steps 0 and 1
    /// (one exchange of 7), zigzag 0, 1 and 7 (two of 7), striped all. Bytes per rank with 8
    /// kv heads of 128 in bf16 (a block of 8,192 tokens: k 16 MiB): 960 MiB per layer without a
    /// window (224 forward, 736 backward), 192 MiB contiguous (32 + 160), 320 MiB zigzag
    /// (64 + 256).
    #[test]
    fn a_4k_window_at_64k_on_8_ranks() {
        let c = AttnMask::Causal;
        let w = Some(4096);
        let all: Vec<usize> = (0..8).collect();
        let contiguous = steps(65536, 8, SeqLayout::Contiguous, c.clone(), w);
        let zigzag = steps(65536, 8, SeqLayout::Zigzag, c.clone(), w);
        assert_eq!(contiguous, vec![0, 1]);
        assert_eq!(zigzag, vec![0, 1, 7]);
        assert_eq!(steps(65536, 8, SeqLayout::Striped, c.clone(), w), all);
        assert_eq!(steps(65536, 8, SeqLayout::Zigzag, c, Some(16384)), all);
        let mib = 1 << 20;
        let k = 8192 * 8 * 128 * 2;
        let t = |s: &[usize]| {
            let t = ring_traffic(s, k, 2);
            (t.forward / mib, t.backward / mib)
        };
        assert_eq!(t(&all), (224, 736));
        assert_eq!(t(&contiguous), (32, 160));
        assert_eq!(t(&zigzag), (64, 256));
        assert_eq!(t(&[0]), (0, 0));
        let exchanges = |s: &[usize]| {
            let t = ring_traffic(s, k, 2);
            (t.forward_exchanges, t.backward_exchanges)
        };
        assert_eq!(exchanges(&all), (7, 15));
        assert_eq!(exchanges(&contiguous), (1, 3));
        assert_eq!(exchanges(&zigzag), (2, 5));
        assert_eq!(exchanges(&[0]), (0, 0));
    }
}
