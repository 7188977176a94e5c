//! StarTrail / WallFacer concentric rings (Liu et al.), with team size `C` (`C²` divides `P`).
//!
//! Rank arithmetic ([`StarTrailPlan`]): teams of `C` consecutive ranks; team groups of
//! `G = P / C²` teams; the ranks of one member index in one team group form a sub-ring of `G`
//! ranks (WallFacer Algorithm 3). Each rank's shard is the [`ShardPlan`] ring shard of its rank
//! (any layout; zigzag by default, so that a team's rows are balanced for causal masks).
//!
//! Forward (StarTrail Algorithm 1):
//! 1. all-gather q, k, v in the team: `C·n` rows, the members' positions in member order;
//! 2. the initial P2P (WallFacer Algorithm 2): the team's kv goes to
//!    [`StarTrailPlan::init_send`], so that the members of a team hold different kv, the teams of
//!    a sub-ring hold different kv, and each team group holds all of it;
//! 3. `G` sub-ring steps: the team's q against the held kv, merged through the lse, the kv passed
//!    on while the block computes;
//! 4. reduce-scatter combine in the team: each member holds partial `(out, lse)` of all the
//!    team's rows over `1/C` of the keys; an all-to-all hands member `a` the `C` partials of its
//!    own rows, which it merges (a reduce-scatter whose reduction is the lse merge).
//!
//! Backward: the kv stays where the initial P2P put it, with its f32 dk/dv accumulators; the
//! team's (q, out, dout, lse) circulates on the sub-ring (out, dout and lse first all-gathered
//! in the team) with its f32 dq accumulator, which after the last step makes one more hop home.
//! dk/dv go back to the kv's owner (the inverse initial P2P), then dq, dk, dv are
//! reduce-scattered (summed) in the team.
//!
//! `C = 1`: no team collectives and no initial P2P, one sub-ring of all `P` ranks in rank order:
//! the forward is exactly ring attention ([`super::ring`]: same blocks, same merge order, same
//! bytes); the backward circulates q instead of kv.
//!
//! Traffic per rank: see [`StarTrailPlan::forward_bytes`] and
//! [`StarTrailPlan::backward_bytes`] (asserted exactly by the tests).

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::block::{block_bwd, block_fwd, Partial, QRows};
use super::layout::ShardPlan;
use super::mask::{AttnMask, MaskBlock};
use super::multi_ring_plan::StarTrailPlan;
use super::op::record_attention;
use super::ring::RingComm;
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::comm::{Comm, Pending, ReduceOp};
use crate::error::{Error, Result};

/// One rank's communicators and P2P partners of StarTrail over a sequence-parallel communicator.
#[derive(Debug, Clone)]
pub struct StarTrailComm {
    plan: StarTrailPlan,
    /// Sends to `next`, receives from `prev` on the sub-ring.
    sub: RingComm,
    /// Initial placement: sends to `init_send`, receives from `init_recv`.
    init: RingComm,
    /// Its inverse (dk, dv home): sends to `init_recv`, receives from `init_send`.
    back: RingComm,
    /// The team's communicator (member order); `None` when `C = 1`.
    team: Option<TeamComm>,
}

#[derive(Clone, Debug)]
struct TeamComm(Comm);

impl StarTrailComm {
    /// Builds the teams of `c` ranks over `comm` (`P = comm.size()`). Fails before any
    /// communication unless `c² | P`; otherwise, when `c > 1`, splits `comm` into teams
    /// (collective: every rank of `comm` calls it).
    pub fn new(comm: Comm, c: usize) -> Result<Self> {
        let plan = StarTrailPlan::new(comm.size(), c)?;
        let r = comm.rank();
        let team = if c > 1 {
            let t = comm.split(plan.team(r), plan.member(r))?;
            if t.size() != c || t.rank() != plan.member(r) {
                return Err(Error::Layout(format!(
                    "startrail: the team split gave rank {} of {}, expected {} of {c}",
                    t.rank(),
                    t.size(),
                    plan.member(r)
                )));
            }
            Some(TeamComm(t))
        } else {
            None
        };
        Ok(Self {
            sub: RingComm::with_neighbours(comm.clone(), plan.next(r), plan.prev(r))?,
            init: RingComm::with_neighbours(comm.clone(), plan.init_send(r), plan.init_recv(r))?,
            back: RingComm::with_neighbours(comm, plan.init_recv(r), plan.init_send(r))?,
            plan,
            team,
        })
    }

    pub fn plan(&self) -> &StarTrailPlan {
        &self.plan
    }

    /// This rank's index in the sequence-parallel communicator.
    pub fn rank(&self) -> usize {
        self.sub.rank()
    }

    fn team_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        match &self.team {
            Some(t) => t.0.all_gather(x, dim),
            None => Ok(x.clone()),
        }
    }

    fn team_reduce_scatter(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        match &self.team {
            Some(t) => t.0.reduce_scatter(x, dim, ReduceOp::Sum),
            None => Ok(x.clone()),
        }
    }

    /// Sends `blocks` along `ring` unless this rank is its own partner (then keeps them).
    fn swap(&self, ring: &RingComm, blocks: &[&Tensor]) -> Result<Vec<Tensor>> {
        if ring.next() == ring.rank() {
            return Ok(blocks.iter().map(|t| (*t).clone()).collect());
        }
        ring.shift(blocks)?.wait()
    }
}

/// The global positions of every team's `C·n` rows (member order), by team.
#[derive(Debug, Clone)]
pub struct StarTrailBlocks {
    pub teams: Vec<MaskBlock>,
}

impl StarTrailBlocks {
    /// Rank `r` holds `plan.ring_positions(r)`; a team the concatenation of its members'.
    pub fn natural(plan: &ShardPlan, st: &StarTrailPlan, mask: &AttnMask) -> Self {
        let teams = (0..st.teams())
            .map(|t| {
                let pos: Vec<u32> = (0..st.team_size())
                    .flat_map(|a| plan.ring_positions(st.rank_of(t, a)))
                    .collect();
                mask.block(&pos)
            })
            .collect();
        Self { teams }
    }

    fn check(&self, st: &StarTrailComm) -> Result<()> {
        if self.teams.len() != st.plan.teams() {
            return Err(Error::invalid(
                "startrail",
                format!(
                    "{} team blocks given for {} teams",
                    self.teams.len(),
                    st.plan.teams()
                ),
            ));
        }
        Ok(())
    }
}

fn unpack<const N: usize>(v: Vec<Tensor>, what: &str) -> Result<[Tensor; N]> {
    v.try_into().map_err(|v: Vec<Tensor>| {
        Error::invalid(
            "startrail",
            format!("internal: expected {N} {what} tensors, got {}", v.len()),
        )
    })
}

fn wait_n<const N: usize>(p: Option<Pending>, what: &str) -> Result<Option<[Tensor; N]>> {
    p.map(|p| unpack(p.wait()?, what)).transpose()
}

/// What the forward keeps for the backward: the team's q and the placed kv block.
#[derive(Debug, Clone)]
pub struct StarTrailSaved {
    pub q_team: Tensor,
    pub k_held: Tensor,
    pub v_held: Tensor,
}

impl StarTrailSaved {
    /// Steps 1 and 2 of the forward: the team all-gather of q, k, v and the initial placement
    /// of the team's kv block. Collective over the sequence-parallel communicator.
    pub fn place(st: &StarTrailComm, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let q_team = st.team_gather(q, 1)?;
        let k_team = st.team_gather(k, 1)?;
        let v_team = st.team_gather(v, 1)?;
        let [k_held, v_held] = unpack(st.swap(&st.init, &[&k_team, &v_team])?, "kv")?;
        Ok(Self {
            q_team,
            k_held,
            v_held,
        })
    }
}

/// The forward: returns this rank's final `out` (q's dtype) and `lse` `(b, hq, n)` f32, and
/// what the backward needs. Collective over the sequence-parallel communicator.
pub fn startrail_forward(
    st: &StarTrailComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    blocks: &StarTrailBlocks,
    call: &AttnCall,
) -> Result<(Tensor, Tensor, StarTrailSaved)> {
    blocks.check(st)?;
    let (plan, me) = (&st.plan, st.rank());
    let g = plan.sub_ring_size();
    // 1. Team all-gather, 2. initial placement.
    let saved = StarTrailSaved::place(st, q, k, v)?;
    let (q_team, k_held, v_held) = (&saved.q_team, &saved.k_held, &saved.v_held);
    // 3. Sub-ring.
    let qb = &blocks.teams[plan.team(me)];
    let mut partial = Partial::new();
    let (mut kc, mut vc) = (k_held.clone(), v_held.clone());
    for s in 0..g {
        let pending = (s + 1 < g).then(|| st.sub.shift(&[&kc, &vc])).transpose()?;
        let kb = &blocks.teams[plan.kv_team_at(me, s)];
        partial.add_opt(block_fwd(q_team, &kc, &vc, call, qb, kb)?)?;
        if let Some([kn, vn]) = wait_n(pending, "kv")? {
            (kc, vc) = (kn, vn);
        }
    }
    // 4. Reduce-scatter combine in the team.
    let (out, lse) = match &st.team {
        None => partial.finish(q)?,
        Some(team) => {
            let (b, n, hq, d) = q.dims4()?;
            let c = plan.team_size();
            let (o, l) = match partial.into_parts() {
                Some(parts) => parts,
                None => (
                    Tensor::zeros((b, c * n, hq, d), DType::F32, q.device())?,
                    Tensor::full(f32::NEG_INFINITY, (b, hq, c * n), q.device())?,
                ),
            };
            // Chunk `a` of the rows goes to member `a`; member `a'`'s chunk lands at batch
            // rows `a'·b .. (a'+1)·b`.
            let o_all = team.0.all_to_all(&o, 1, 0)?;
            let l_all = team.0.all_to_all(&l, 2, 0)?;
            let mut mine = Partial::new();
            for a in 0..c {
                mine.add(&o_all.narrow(0, a * b, b)?, &l_all.narrow(0, a * b, b)?)?;
            }
            mine.finish(q)?
        }
    };
    Ok((out, lse, saved))
}

/// The backward, given this rank's `rows` (its FINAL `out`, `lse` and `dout`; q is taken from
/// `saved`) and what the forward saved. Returns `(dq, dk, dv)` in f32 for this rank's own q, k,
/// v. Collective.
pub fn startrail_backward(
    st: &StarTrailComm,
    saved: &StarTrailSaved,
    rows: &QRows,
    blocks: &StarTrailBlocks,
    call: &AttnCall,
) -> Result<(Tensor, Tensor, Tensor)> {
    blocks.check(st)?;
    let (plan, me) = (&st.plan, st.rank());
    let g = plan.sub_ring_size();
    // 1. The team's rows of out, dout and lse.
    let out_team = st.team_gather(&rows.out, 1)?;
    let dout_team = st.team_gather(&rows.dout, 1)?;
    let lse_team = st.team_gather(&rows.lse, 2)?;
    // 2. Sub-ring: kv fixed, the q package and its dq accumulator circulate.
    let kb = &blocks.teams[plan.initial_kv_team(me)];
    let (kh, vh) = (&saved.k_held, &saved.v_held);
    let mut pkg = [saved.q_team.clone(), out_team, dout_team, lse_team];
    let mut dkv: Option<(Tensor, Tensor)> = None;
    let mut dq_in_flight: Option<Pending> = None;
    let mut dq_home = None;
    for s in 0..g {
        let pkg_pending = (s + 1 < g)
            .then(|| st.sub.shift(&[&pkg[0], &pkg[1], &pkg[2], &pkg[3]]))
            .transpose()?;
        let qb = &blocks.teams[plan.q_team_at(me, s)];
        let [q, out, dout, lse] = pkg.clone();
        let team_rows = QRows { q, out, lse, dout };
        let mut dq_acc = None;
        if let Some((dq_b, dk_b, dv_b)) = block_bwd(&team_rows, kh, vh, call, qb, kb)? {
            dq_acc = Some(dq_b);
            dkv = Some(match dkv {
                Some((a, b)) => ((a + dk_b)?, (b + dv_b)?),
                None => (dk_b, dv_b),
            });
        }
        // The package's accumulator arrives one hop behind it.
        if let Some([d]) = wait_n(dq_in_flight.take(), "dq")? {
            dq_acc = Some(match dq_acc {
                Some(a) => (a + d)?,
                None => d,
            });
        }
        let dq_acc = match dq_acc {
            Some(t) => t,
            None => team_rows.q.zeros_like()?.to_dtype(DType::F32)?,
        };
        // After the last step this hop brings the accumulator home.
        if g > 1 {
            dq_in_flight = Some(st.sub.shift(&[&dq_acc])?);
        } else {
            dq_home = Some(dq_acc);
        }
        if let Some(next) = wait_n(pkg_pending, "q package")? {
            pkg = next;
        }
    }
    let dq_team = match (wait_n(dq_in_flight, "dq")?, dq_home) {
        (Some([d]), _) | (None, Some(d)) => d,
        (None, None) => return Err(Error::invalid("startrail", "internal: no dq")),
    };
    // 3. dk, dv of the held block back to its owner.
    let (dk_acc, dv_acc) = match dkv {
        Some(x) => x,
        None => {
            let z = kh.zeros_like()?.to_dtype(DType::F32)?;
            (z.clone(), z)
        }
    };
    let [dk_team, dv_team] = unpack(st.swap(&st.back, &[&dk_acc, &dv_acc])?, "dk/dv")?;
    // 4. Reduce-scatter (sum) in the team.
    Ok((
        st.team_reduce_scatter(&dq_team, 1)?,
        st.team_reduce_scatter(&dk_team, 1)?,
        st.team_reduce_scatter(&dv_team, 1)?,
    ))
}

/// Differentiable StarTrail attention of this rank's shard: `out` (q's shape and dtype,
/// recorded on `q`, `k`, `v`) and `lse` `(b, hq, n)` f32. Collective.
pub fn startrail_attention(
    st: &StarTrailComm,
    qkv: &Qkv,
    blocks: Arc<StarTrailBlocks>,
    call: &AttnCall,
) -> Result<(Tensor, Tensor)> {
    let x = qkv.detached();
    let (out, lse, placed) = startrail_forward(st, &x.q, &x.k, &x.v, &blocks, call)?;
    let (st, call) = (st.clone(), call.clone());
    let out = record_attention("cpl-startrail-attention", qkv, out, &lse, move |s, dout| {
        startrail_backward(&st, &placed, &s.rows(dout), &blocks, &call)
    })?;
    Ok((out, lse))
}

/// StarTrail over the ring group of the mesh (ulysses degree 1), teams of `C` ranks.
pub struct StarTrailAttention {
    group: SpGroup,
    st: StarTrailComm,
}

impl StarTrailAttention {
    /// Fails before any communication unless the ulysses degree is 1 and `C²` divides the ring
    /// degree; then (for `C > 1`) splits the ring communicator into teams (collective).
    pub fn new(group: SpGroup, c: usize) -> Result<Self> {
        group.require_no_ulysses("startrail", "put the ranks in the ring dim")?;
        let st = StarTrailComm::new(group.ring.clone(), c)?;
        Ok(Self { group, st })
    }

    pub fn startrail(&self) -> &StarTrailComm {
        &self.st
    }
}

impl SequenceParallelAttention for StarTrailAttention {
    strategy_accessors!("startrail");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (_, plan) = self.group.check(self.name(), qkv, &call.mask)?;
        let blocks = Arc::new(StarTrailBlocks::natural(&plan, &self.st.plan, &call.mask));
        let (out, lse) = startrail_attention(&self.st, qkv, blocks, call)?;
        Ok((out, want_lse.then_some(lse)))
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        let (_, plan) = self
            .group
            .check_backward(self.name(), saved, dout, &call.mask)?;
        let blocks = StarTrailBlocks::natural(&plan, &self.st.plan, &call.mask);
        let s = saved.detached();
        let placed = StarTrailSaved::place(&self.st, &s.q, &s.k, &s.v)?;
        let grads = startrail_backward(&self.st, &placed, &s.rows(&dout.detach()), &blocks, call)?;
        saved.cast_grads(grads)
    }
}
