//! LoongTrain 2D-Attention with Double-Ring-Attention (Gu et al., Algorithm 2).
//!
//! The sequence-parallel group is a `ulysses × ring` grid (LoongTrain's `d_hp × d_cp`; the
//! mesh's placement decides which of the two is intra-node). Ulysses' all-to-all over the
//! head-parallel group (with kv replication when the degree exceeds the kv heads, see
//! [`super::ulysses`]) gives every rank of ring rank `c` the tokens of
//! [`ShardPlan::ring_positions`]`(c)` for `hq / d_hp` heads; then Double-Ring attention runs in
//! the context-parallel group, and the inverse all-to-all returns the output.
//!
//! Double ring ([`DoubleRingPlan`]): the `d_cp` ranks form `d_cp / w` inner rings of `w`
//! consecutive ranks, `W(i, j)` with `i = c / w`, `j = c % w`; the inner rings form the outer
//! ring. Each outer step runs a whole inner ring (`w` micro-steps, kv passed to `W(i, j+1)`),
//! while the kv block the next outer step starts from is prefetched from `W(i-1, j)`. At outer
//! step `o`, micro-step `s`, `W(i, j)` holds the kv of `W(i-o, j-s)`.
//!
//! Backward: kv moves as in the forward; `dq` accumulates locally in f32; the f32 `dk`/`dv`
//! accumulator of a block follows it on the inner ring, is handed to the next outer rank after
//! the last micro-step (that rank holds the same block at its last micro-step of the next outer
//! step), and after the last outer step one direct message brings it home. It makes `d_cp` hops,
//! as in plain ring attention. `w = d_cp` and `w = 1` are plain ring attention (same blocks,
//! same order).
//!
//! Traffic per rank in the context-parallel group, with `KV` the bytes of the local k and v
//! blocks after the all-to-all and `DKV` the same in f32: forward `(d_cp - 1)·KV`, backward
//! `(d_cp - 1)·KV + d_cp·DKV` (all `exchange`; every P2P of the forward is `Size(kv)`, LoongTrain
//! 4.5.3). Plus, when `d_hp > 1`, the all-to-alls of [`super::ulysses`].
//!
//! **Sliding windows**: when the window leaves some ring steps unneeded ([`ring_steps`] of the
//! context-parallel group: no rank's queries see, within the window, the block it would hold
//! there), the context-parallel group runs the ring loop over the steps that run instead
//! ([`super::ring`]: the kv block jumps straight to the next step that runs, each accumulator
//! goes home from the last one). The double ring's gain is overlapping a whole inner ring with
//! the outer prefetch when every step runs; under a window only a few steps do (contiguous
//! `{0, 1}`, zigzag `{0, 1, P-1}` while the window is shorter than a chunk), and not sending the
//! others saves far more: the traffic of ring attention under the same window
//! (`planner::traffic::windowed_attention_traffic`). The blocks a rank computes are the same.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::block::{block_bwd, block_fwd, Partial, QRows};
use super::layout::ShardPlan;
use super::mask::{AttnMask, MaskBlock};
use super::multi_ring_plan::DoubleRingPlan;
use super::op::record_attention;
use super::ring::{ring_attention, ring_backward, ring_steps, RingBlocks, RingComm};
use super::ulysses::HeadParallel;
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::comm::{Comm, Pending};
use crate::error::{Error, Result};

/// The three P2P patterns of one rank of a double ring over a context-parallel communicator.
#[derive(Debug, Clone)]
pub struct DoubleRingComm {
    plan: DoubleRingPlan,
    inner: RingComm,
    outer: RingComm,
    /// Finished dk/dv to the block's owner `W(i+1, j+1)`, from `W(i-1, j-1)`.
    home: RingComm,
}

impl DoubleRingComm {
    /// The double ring with inner rings of `w` ranks over `comm` (its size is `d_cp`). Local.
    pub fn new(comm: Comm, w: usize) -> Result<Self> {
        let plan = DoubleRingPlan::new(comm.size(), w)?;
        let r = comm.rank();
        Ok(Self {
            inner: RingComm::with_neighbours(comm.clone(), plan.next_inner(r), plan.prev_inner(r))?,
            outer: RingComm::with_neighbours(comm.clone(), plan.next_outer(r), plan.prev_outer(r))?,
            home: RingComm::with_neighbours(comm, plan.grad_home_dst(r), plan.grad_home_src(r))?,
            plan,
        })
    }

    pub fn plan(&self) -> &DoubleRingPlan {
        &self.plan
    }

    /// This rank's index in the context-parallel communicator.
    pub fn rank(&self) -> usize {
        self.inner.rank()
    }
}

/// The global positions of this rank's q rows and of every context-parallel rank's kv block.
#[derive(Debug, Clone)]
pub struct DoubleRingBlocks {
    pub q: MaskBlock,
    /// `kv[c]`: the block of context-parallel rank `c`.
    pub kv: Vec<MaskBlock>,
}

impl DoubleRingBlocks {
    /// Blocks after Ulysses' all-to-all: ring rank `c` holds `plan.ring_positions(c)`.
    pub fn natural(plan: &ShardPlan, rank: usize, mask: &AttnMask) -> Self {
        let kv: Vec<MaskBlock> = (0..plan.ring())
            .map(|c| mask.block(&plan.ring_positions(c)))
            .collect();
        Self {
            q: kv[rank].clone(),
            kv,
        }
    }

    fn check(&self, dr: &DoubleRingComm) -> Result<()> {
        if self.kv.len() != dr.plan.cp() {
            return Err(Error::invalid(
                "double ring",
                format!(
                    "{} kv blocks given for a context-parallel group of {} ranks",
                    self.kv.len(),
                    dr.plan.cp()
                ),
            ));
        }
        Ok(())
    }

    /// The block `rank` holds at outer step `o`, micro-step `s`.
    fn at(&self, dr: &DoubleRingComm, o: usize, s: usize) -> &MaskBlock {
        &self.kv[dr.plan.block_at(dr.rank(), o, s)]
    }
}

fn pair(v: Vec<Tensor>, what: &str) -> Result<(Tensor, Tensor)> {
    let mut it = v.into_iter();
    match (it.next(), it.next(), it.next()) {
        (Some(a), Some(b), None) => Ok((a, b)),
        _ => Err(Error::invalid(
            "double ring",
            format!("internal: expected two received {what} tensors"),
        )),
    }
}

fn wait_pair(p: Option<Pending>, what: &str) -> Result<Option<(Tensor, Tensor)>> {
    p.map(|p| pair(p.wait()?, what)).transpose()
}

fn add_pair(
    acc: Option<(Tensor, Tensor)>,
    x: Option<(Tensor, Tensor)>,
) -> Result<Option<(Tensor, Tensor)>> {
    Ok(match (acc, x) {
        (Some((a, b)), Some((c, d))) => Some(((a + c)?, (b + d)?)),
        (a, None) => a,
        (None, x) => x,
    })
}

/// The forward loop (Algorithm 2): `d_cp / w` outer steps of `w` micro-steps, the next outer
/// block prefetched during the inner ring. Returns this rank's q merged over every kv block.
/// Collective over the context-parallel communicator; sends `d_cp - 1` exchanges of `(k, v)`.
pub fn double_ring_forward(
    dr: &DoubleRingComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: &DoubleRingBlocks,
    call: &AttnCall,
) -> Result<Partial> {
    blocks.check(dr)?;
    let (n_o, w) = (dr.plan.outer_size(), dr.plan.inner_size());
    let mut partial = Partial::new();
    let (mut k0, mut v0) = (k.clone(), v.clone());
    for o in 0..n_o {
        let outer = (o + 1 < n_o)
            .then(|| dr.outer.shift(&[&k0, &v0]))
            .transpose()?;
        let (mut kc, mut vc) = (k0.clone(), v0.clone());
        for s in 0..w {
            let inner = (s + 1 < w)
                .then(|| dr.inner.shift(&[&kc, &vc]))
                .transpose()?;
            let kb = blocks.at(dr, o, s);
            partial.add_opt(block_fwd(q, &kc, &vc, call, &blocks.q, kb)?)?;
            if let Some(next) = wait_pair(inner, "kv")? {
                (kc, vc) = next;
            }
        }
        if let Some(next) = wait_pair(outer, "kv")? {
            (k0, v0) = next;
        }
    }
    Ok(partial)
}

/// The backward loop of this rank's `rows` (q with its FINAL `out`, `lse` and `dout`). Returns
/// `(dq, dk, dv)` in f32 for this rank's own q, k, v. Collective over the context-parallel
/// communicator; sends `d_cp - 1` exchanges of `(k, v)` and `d_cp` of the f32 `(dk, dv)`
/// accumulators (none when `d_cp = 1`).
pub fn double_ring_backward(
    dr: &DoubleRingComm,
    rows: &QRows,
    k: &Tensor,
    v: &Tensor,
    blocks: &DoubleRingBlocks,
    call: &AttnCall,
) -> Result<(Tensor, Tensor, Tensor)> {
    blocks.check(dr)?;
    let (n_o, w) = (dr.plan.outer_size(), dr.plan.inner_size());
    let mut dq: Option<Tensor> = None;
    let (mut k0, mut v0) = (k.clone(), v.clone());
    // The accumulator handed over the outer ring, added at the last micro-step.
    let mut outer_acc: Option<Pending> = None;
    let mut home: Option<Pending> = None;
    let mut local_home = None;
    for o in 0..n_o {
        let outer_kv = (o + 1 < n_o)
            .then(|| dr.outer.shift(&[&k0, &v0]))
            .transpose()?;
        let (mut kc, mut vc) = (k0.clone(), v0.clone());
        let mut inner_acc: Option<Pending> = None;
        for s in 0..w {
            let last = s + 1 == w;
            let inner_kv = (!last).then(|| dr.inner.shift(&[&kc, &vc])).transpose()?;
            let kb = blocks.at(dr, o, s);
            let mut acc = None;
            if let Some((dq_b, dk_b, dv_b)) = block_bwd(rows, &kc, &vc, call, &blocks.q, kb)? {
                dq = Some(match dq {
                    Some(a) => (a + dq_b)?,
                    None => dq_b,
                });
                acc = Some((dk_b, dv_b));
            }
            // Wait in the order the peers posted: inner accumulator, then (last micro-step)
            // the outer one.
            acc = add_pair(acc, wait_pair(inner_acc.take(), "dk/dv")?)?;
            if last {
                acc = add_pair(acc, wait_pair(outer_acc.take(), "dk/dv")?)?;
            }
            let (dk_acc, dv_acc) = match acc {
                Some(a) => a,
                None => {
                    let z = kc.zeros_like()?.to_dtype(DType::F32)?;
                    (z.clone(), z)
                }
            };
            if !last {
                inner_acc = Some(dr.inner.shift(&[&dk_acc, &dv_acc])?);
            } else if o + 1 < n_o {
                outer_acc = Some(dr.outer.shift(&[&dk_acc, &dv_acc])?);
            } else if dr.plan.cp() > 1 {
                home = Some(dr.home.shift(&[&dk_acc, &dv_acc])?);
            } else {
                local_home = Some((dk_acc, dv_acc));
            }
            if let Some(next) = wait_pair(inner_kv, "kv")? {
                (kc, vc) = next;
            }
        }
        if let Some(next) = wait_pair(outer_kv, "kv")? {
            (k0, v0) = next;
        }
    }
    let (dk, dv) = match (wait_pair(home, "dk/dv")?, local_home) {
        (Some(h), _) | (None, Some(h)) => h,
        (None, None) => return Err(Error::invalid("double ring", "internal: no dk/dv")),
    };
    let dq = match dq {
        Some(t) => t,
        None => rows.q.zeros_like()?.to_dtype(DType::F32)?,
    };
    Ok((dq, dk, dv))
}

/// Differentiable Double-Ring attention of this rank's `q` against the kv blocks of the whole
/// context-parallel group: `out` (q's shape and dtype, recorded on `q`, `k`, `v`) and `lse`
/// `(b, hq, nq)` f32. The backward runs [`double_ring_backward`] (collective).
pub fn double_ring_attention(
    dr: &DoubleRingComm,
    qkv: &Qkv,
    blocks: Arc<DoubleRingBlocks>,
    call: &AttnCall,
) -> Result<(Tensor, Tensor)> {
    let x = qkv.detached();
    let (out, lse) = double_ring_forward(dr, &x.q, &x.k, &x.v, &blocks, call)?.finish(&x.q)?;
    let (dr, call) = (dr.clone(), call.clone());
    let out = record_attention(
        "cpl-double-ring-attention",
        qkv,
        out,
        &lse,
        move |s, dout| double_ring_backward(&dr, &s.rows(dout), &s.k, &s.v, &blocks, &call),
    )?;
    Ok((out, lse))
}

/// LoongTrain 2D-Attention: Ulysses over the ulysses (head-parallel) group × Double-Ring with
/// inner rings of `w` ranks over the ring (context-parallel) group.
pub struct DoubleRingAttention {
    group: SpGroup,
    dr: DoubleRingComm,
    /// The natural ring over the context-parallel group: under a window that leaves steps out.
    ring: RingComm,
}

impl DoubleRingAttention {
    /// Fails (before any communication) unless `w >= 1` divides the ring degree.
    pub fn new(group: SpGroup, w: usize) -> Result<Self> {
        let dr = DoubleRingComm::new(group.ring.clone(), w)?;
        let ring = RingComm::new(group.ring.clone());
        Ok(Self { group, dr, ring })
    }

    pub fn double_ring(&self) -> &DoubleRingComm {
        &self.dr
    }

    /// Whether `call` on `plan` runs as the ring loop over the steps that run (a window
    /// leaving some out): see the module docs. Pure: every rank decides the same.
    pub fn skips_steps(&self, plan: &ShardPlan, call: &AttnCall) -> bool {
        call.window.is_some() && ring_steps(plan, call).len() < self.ring.size()
    }
}

impl SequenceParallelAttention for DoubleRingAttention {
    strategy_accessors!("double-ring");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        HeadParallel::of(self).forward(qkv, call, want_lse, |h, plan| {
            if self.skips_steps(plan, call) {
                let blocks = Arc::new(RingBlocks::natural(plan, &self.ring, call));
                return ring_attention(&self.ring, h, blocks, call);
            }
            let blocks = DoubleRingBlocks::natural(plan, self.dr.rank(), &call.mask);
            double_ring_attention(&self.dr, h, Arc::new(blocks), call)
        })
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        HeadParallel::of(self).backward(saved, dout, call, |h, dout, plan| {
            if self.skips_steps(plan, call) {
                let blocks = RingBlocks::natural(plan, &self.ring, call);
                return ring_backward(&self.ring, &h.rows(dout), &h.k, &h.v, &blocks, call);
            }
            let blocks = DoubleRingBlocks::natural(plan, self.dr.rank(), &call.mask);
            double_ring_backward(&self.dr, &h.rows(dout), &h.k, &h.v, &blocks, call)
        })
    }
}
