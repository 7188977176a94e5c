//! The pure rank arithmetic of the two multi-ring strategies: LoongTrain's Double-Ring and
//! StarTrail/WallFacer concentric rings, with their exact traffic formulas. No communication,
//! no tensors: everything here can be checked by unit tests and used for planning and
//! benchmarks. See `docs/design/concentric-and-double-ring.md` for the derivations.
//!
//! Ranks are indices in the communicator the strategy runs on (the context-parallel group for
//! the double ring, the sequence-parallel group for StarTrail).

use crate::error::{Error, Result};

const F32: u64 = 4;

fn layout_err(msg: String) -> Error {
    Error::Layout(msg)
}

// ------------------------------------------------------------------------------------------
// Double ring (LoongTrain, Algorithm 2)
// ------------------------------------------------------------------------------------------

/// LoongTrain's Double-Ring-Attention inside one context-parallel group of `cp` ranks: `cp / w`
/// inner rings of `w` consecutive ranks; the inner rings form the outer ring.
///
/// Rank `c` is `W(i, j)` with `i = c / w` (its inner ring, its position on the outer ring) and
/// `j = c % w` (its position on the inner ring). At outer step `o` and inner step `s` it holds
/// the kv block of rank `W(i - o, j - s)` (indices modulo `cp / w` and `w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoubleRingPlan {
    cp: usize,
    w: usize,
}

impl DoubleRingPlan {
    /// Fails unless `1 <= w` and `w` divides `cp`.
    pub fn new(cp: usize, w: usize) -> Result<Self> {
        if cp == 0 {
            return Err(layout_err(
                "double ring: the context-parallel group is empty".into(),
            ));
        }
        if w == 0 || !cp.is_multiple_of(w) {
            return Err(layout_err(format!(
                "double ring: inner ring size w = {w} must be at least 1 and divide the \
                 context-parallel degree {cp}"
            )));
        }
        Ok(Self { cp, w })
    }

    /// Ranks in the context-parallel group.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// Inner ring size `w`.
    pub fn inner_size(&self) -> usize {
        self.w
    }

    /// Number of inner rings (= outer ring size = outer steps), `cp / w`.
    pub fn outer_size(&self) -> usize {
        self.cp / self.w
    }

    /// `(i, j)`: inner ring index and position in it.
    pub fn coords(&self, rank: usize) -> (usize, usize) {
        (rank / self.w, rank % self.w)
    }

    /// The rank `W(i, j)`, indices taken modulo the ring sizes (negative offsets via `isize`).
    pub fn rank_of(&self, i: isize, j: isize) -> usize {
        let no = self.outer_size() as isize;
        let w = self.w as isize;
        (i.rem_euclid(no) * w + j.rem_euclid(w)) as usize
    }

    fn shifted(&self, rank: usize, di: isize, dj: isize) -> usize {
        let (i, j) = self.coords(rank);
        self.rank_of(i as isize + di, j as isize + dj)
    }

    /// Next rank on the inner ring (receives this rank's kv at each micro-step).
    pub fn next_inner(&self, rank: usize) -> usize {
        self.shifted(rank, 0, 1)
    }

    pub fn prev_inner(&self, rank: usize) -> usize {
        self.shifted(rank, 0, -1)
    }

    /// Next rank on the outer ring (`W(i+1, j)`), which prefetches this rank's initial kv.
    pub fn next_outer(&self, rank: usize) -> usize {
        self.shifted(rank, 1, 0)
    }

    pub fn prev_outer(&self, rank: usize) -> usize {
        self.shifted(rank, -1, 0)
    }

    /// Owner of the kv block that `rank` holds at outer step `o`, inner step `s`.
    pub fn block_at(&self, rank: usize, o: usize, s: usize) -> usize {
        self.shifted(rank, -(o as isize), -(s as isize))
    }

    /// Where the finished dk/dv of the block `rank` completes last goes: the block's owner
    /// `W(i + 1, j + 1)` (backward, after the last outer step).
    pub fn grad_home_dst(&self, rank: usize) -> usize {
        self.shifted(rank, 1, 1)
    }

    /// Who sends this rank its finished dk/dv: `W(i - 1, j - 1)`.
    pub fn grad_home_src(&self, rank: usize) -> usize {
        self.shifted(rank, -1, -1)
    }

    /// Exact bytes each rank sends (all by `exchange`) in the forward, for local k and v
    /// chunks of `kv_bytes` bytes together: `(cp - 1) * kv_bytes`.
    pub fn forward_p2p_bytes(&self, kv_bytes: u64) -> u64 {
        (self.cp as u64 - 1) * kv_bytes
    }

    /// Exact bytes each rank sends in the backward: the kv blocks travel as in the forward
    /// (`(cp - 1) * kv_bytes`) and the f32 dk/dv accumulators (`dkv_bytes`, their size in f32)
    /// make `cp` hops in all (`n_o (w - 1)` inner, `n_o - 1` outer, one home); nothing when
    /// `cp = 1`.
    pub fn backward_p2p_bytes(&self, kv_bytes: u64, dkv_bytes: u64) -> u64 {
        if self.cp == 1 {
            return 0;
        }
        (self.cp as u64 - 1) * kv_bytes + self.cp as u64 * dkv_bytes
    }
}

// ------------------------------------------------------------------------------------------
// StarTrail / WallFacer concentric rings
// ------------------------------------------------------------------------------------------

/// StarTrail's concentric rings over `p` ranks with team size `c` (`c^2` divides `p`).
///
/// - Teams: `c` consecutive ranks, team `t = r / c`, member (intra-team rank) `a = r % c`.
/// - Team groups: `g = t / G` with `G = p / c^2` teams per group (`c` groups).
/// - Sub-rings: the ranks of one member index `a` in one team group, `G` ranks, in team order.
/// - Initial placement (WallFacer Algorithm 2 `get_init_send`): rank `(t, a)` sends its team's
///   gathered kv to team `a * G + t / c`, member `t % c`. Hence rank `(g * G + q, a)` holds the
///   kv of team `c * q + a`: the members of a team hold different kv, the teams of a sub-ring
///   hold different kv, and each team group holds the kv of every team.
/// - Sub-ring neighbours (Algorithm 3 `get_P2P_config`): the same member of the next/previous
///   team of the team group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StarTrailPlan {
    p: usize,
    c: usize,
}

/// Element counts of one rank's local shards (before the team all-gather), for the traffic
/// formulas. `q_elems = batch * tokens * q_heads * head_dim`, `kv_elems` the same for ONE of k
/// or v (kv heads), `lse_elems = batch * q_heads * tokens`; `elem_bytes` is the input dtype's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardElems {
    pub q_elems: u64,
    pub kv_elems: u64,
    pub lse_elems: u64,
    pub elem_bytes: u64,
}

/// Bytes one rank sends, by kind of operation (see [`crate::comm::traffic`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StrategyBytes {
    pub all_gather: u64,
    pub all_to_all: u64,
    pub reduce_scatter: u64,
    pub exchange: u64,
}

impl StrategyBytes {
    pub fn total(&self) -> u64 {
        self.all_gather + self.all_to_all + self.reduce_scatter + self.exchange
    }
}

impl StarTrailPlan {
    /// Fails unless `c >= 1` and `c^2` divides `p`.
    pub fn new(p: usize, c: usize) -> Result<Self> {
        if p == 0 {
            return Err(layout_err(
                "startrail: the sequence-parallel group is empty".into(),
            ));
        }
        if c == 0 || c.checked_mul(c).is_none_or(|c2| !p.is_multiple_of(c2)) {
            return Err(layout_err(format!(
                "startrail: team size C = {c} must be at least 1 with C^2 dividing the \
                 sequence-parallel degree P = {p}"
            )));
        }
        Ok(Self { p, c })
    }

    pub fn world(&self) -> usize {
        self.p
    }

    /// Team size `C`.
    pub fn team_size(&self) -> usize {
        self.c
    }

    /// Number of teams, `P / C`.
    pub fn teams(&self) -> usize {
        self.p / self.c
    }

    /// Teams per team group = ranks per sub-ring = sub-ring steps, `P / C^2`.
    pub fn sub_ring_size(&self) -> usize {
        self.p / (self.c * self.c)
    }

    /// Team of `rank`.
    pub fn team(&self, rank: usize) -> usize {
        rank / self.c
    }

    /// Intra-team rank (member index) of `rank`.
    pub fn member(&self, rank: usize) -> usize {
        rank % self.c
    }

    pub fn rank_of(&self, team: usize, member: usize) -> usize {
        team * self.c + member
    }

    /// Team group of `rank`.
    pub fn team_group(&self, rank: usize) -> usize {
        self.team(rank) / self.sub_ring_size()
    }

    /// Position of `rank` on its sub-ring (its team's index in the team group).
    pub fn sub_ring_pos(&self, rank: usize) -> usize {
        self.team(rank) % self.sub_ring_size()
    }

    /// The ranks of `rank`'s sub-ring, in ring order.
    pub fn sub_ring(&self, rank: usize) -> Vec<usize> {
        let g = self.sub_ring_size();
        let base = self.team_group(rank) * g;
        (0..g)
            .map(|q| self.rank_of(base + q, self.member(rank)))
            .collect()
    }

    /// The ranks of `rank`'s team, in member order.
    pub fn team_ranks(&self, rank: usize) -> Vec<usize> {
        let t = self.team(rank);
        (0..self.c).map(|a| self.rank_of(t, a)).collect()
    }

    /// WallFacer Algorithm 2: where `rank` sends its team's gathered kv before the sub-rings.
    pub fn init_send(&self, rank: usize) -> usize {
        let (t, a) = (self.team(rank), self.member(rank));
        let target_team = a * self.sub_ring_size() + t / self.c;
        self.rank_of(target_team, t % self.c)
    }

    /// The inverse of [`StarTrailPlan::init_send`]: who sends `rank` its initial kv.
    pub fn init_recv(&self, rank: usize) -> usize {
        let (g, q, a) = (
            self.team_group(rank),
            self.sub_ring_pos(rank),
            self.member(rank),
        );
        self.rank_of(self.c * q + a, g)
    }

    /// The team whose kv `rank` holds after the initial placement: `C * q + a`.
    pub fn initial_kv_team(&self, rank: usize) -> usize {
        self.team(self.init_recv(rank))
    }

    /// WallFacer Algorithm 3: the next rank on the sub-ring (same member, next team of the
    /// team group).
    pub fn next(&self, rank: usize) -> usize {
        self.shift(rank, 1)
    }

    /// The previous rank on the sub-ring.
    pub fn prev(&self, rank: usize) -> usize {
        self.shift(rank, self.sub_ring_size() - 1)
    }

    fn shift(&self, rank: usize, by: usize) -> usize {
        let g = self.sub_ring_size();
        let team = self.team_group(rank) * g + (self.sub_ring_pos(rank) + by) % g;
        self.rank_of(team, self.member(rank))
    }

    /// The rank `by` steps back on `rank`'s sub-ring.
    pub fn back(&self, rank: usize, by: usize) -> usize {
        let g = self.sub_ring_size();
        self.shift(rank, g - by % g)
    }

    /// Forward: the team whose kv `rank` holds at sub-ring step `s` (`0 <= s < P/C^2`).
    pub fn kv_team_at(&self, rank: usize, s: usize) -> usize {
        self.initial_kv_team(self.back(rank, s))
    }

    /// Backward: the team whose q package (q, out, dout, lse, dq of the whole team) `rank`
    /// holds at sub-ring step `s`; the kv stays put.
    pub fn q_team_at(&self, rank: usize, s: usize) -> usize {
        self.team(self.back(rank, s))
    }

    /// Exact bytes `rank` sends in the forward (see the design note):
    /// - all-gather of q, k, v in the team: `(C-1)(Q + 2K)`;
    /// - initial placement: `2 C K` unless `init_send(rank) == rank`;
    /// - sub-ring: `(P/C^2 - 1) 2 C K`;
    /// - combine (all-to-all of the f32 partial out and lse): `(C-1)(Q_f32 + L_f32)`.
    pub fn forward_bytes(&self, rank: usize, e: &ShardElems) -> StrategyBytes {
        let c = self.c as u64;
        let g = self.sub_ring_size() as u64;
        let q = e.q_elems * e.elem_bytes;
        let k = e.kv_elems * e.elem_bytes;
        let init = if self.init_send(rank) == rank {
            0
        } else {
            2 * c * k
        };
        StrategyBytes {
            all_gather: (c - 1) * (q + 2 * k),
            all_to_all: (c - 1) * (e.q_elems + e.lse_elems) * F32,
            reduce_scatter: 0,
            exchange: init + (g - 1) * 2 * c * k,
        }
    }

    /// Exact bytes `rank` sends in the backward:
    /// - all-gather of out, dout (input dtype) and lse (f32) in the team: `(C-1)(2Q + L_f32)`;
    /// - sub-ring: q, out, dout, lse make `P/C^2 - 1` hops, the f32 dq accumulator `P/C^2`
    ///   hops (the last one home); nothing when `P/C^2 = 1`;
    /// - the f32 dk, dv back to the kv's owner: `2 C K_f32` unless `init_recv(rank) == rank`;
    /// - reduce-scatter (sum, f32) of dq, dk, dv in the team: `(C-1)(Q_f32 + 2 K_f32)`.
    pub fn backward_bytes(&self, rank: usize, e: &ShardElems) -> StrategyBytes {
        let c = self.c as u64;
        let g = self.sub_ring_size() as u64;
        let q = e.q_elems * e.elem_bytes;
        let lse = e.lse_elems * F32;
        let ret = if self.init_recv(rank) == rank {
            0
        } else {
            2 * c * e.kv_elems * F32
        };
        let ring = if g == 1 {
            0
        } else {
            (g - 1) * c * (3 * q + lse) + g * c * e.q_elems * F32
        };
        StrategyBytes {
            all_gather: (c - 1) * (2 * q + lse),
            all_to_all: 0,
            reduce_scatter: (c - 1) * (e.q_elems + 2 * e.kv_elems) * F32,
            exchange: ring + ret,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn double_ring_rejects_bad_w() {
        assert!(DoubleRingPlan::new(4, 3).is_err());
        assert!(DoubleRingPlan::new(4, 0).is_err());
        assert!(DoubleRingPlan::new(0, 1).is_err());
        let msg = DoubleRingPlan::new(6, 4).unwrap_err().to_string();
        assert!(msg.contains("w = 4"), "{msg}");
    }

    #[test]
    fn double_ring_neighbours_and_blocks() {
        for (cp, w) in [
            (1, 1),
            (4, 1),
            (4, 2),
            (4, 4),
            (8, 2),
            (8, 4),
            (6, 3),
            (6, 2),
        ] {
            let plan = DoubleRingPlan::new(cp, w).unwrap();
            let no = plan.outer_size();
            for r in 0..cp {
                assert_eq!(plan.prev_inner(plan.next_inner(r)), r);
                assert_eq!(plan.prev_outer(plan.next_outer(r)), r);
                assert_eq!(plan.grad_home_src(plan.grad_home_dst(r)), r);
                assert_eq!(plan.coords(plan.next_inner(r)).0, plan.coords(r).0);
                assert_eq!(plan.coords(plan.next_outer(r)).1, plan.coords(r).1);
                // Every block exactly once over the outer x inner steps.
                let seen: BTreeSet<usize> = (0..no)
                    .flat_map(|o| (0..w).map(move |s| (o, s)))
                    .map(|(o, s)| plan.block_at(r, o, s))
                    .collect();
                assert_eq!(seen.len(), cp);
                assert_eq!(plan.block_at(r, 0, 0), r);
                for o in 0..no {
                    for s in 0..w {
                        // Inner step: the block came from the previous inner rank.
                        if s > 0 {
                            assert_eq!(
                                plan.block_at(r, o, s),
                                plan.block_at(plan.prev_inner(r), o, s - 1)
                            );
                        }
                        // Outer step: the initial block came from the previous outer rank.
                        if o > 0 && s == 0 {
                            assert_eq!(
                                plan.block_at(r, o, 0),
                                plan.block_at(plan.prev_outer(r), o - 1, 0)
                            );
                        }
                    }
                }
                // The last block this rank completes (outer n_o-1, inner w-1) belongs to the
                // grad home destination.
                assert_eq!(plan.block_at(r, no - 1, w - 1), plan.grad_home_dst(r));
                // The dk/dv chain of the block ending an outer step continues on the next
                // outer rank at its last inner step.
                if no > 1 {
                    for o in 0..no - 1 {
                        assert_eq!(
                            plan.block_at(r, o, w - 1),
                            plan.block_at(plan.next_outer(r), o + 1, w - 1)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn double_ring_traffic_matches_ring() {
        // w = cp and w = 1 are plain rings: cp-1 kv sends forward, cp-1 kv + cp dkv backward.
        for (cp, w) in [(4, 1), (4, 2), (4, 4), (8, 2)] {
            let plan = DoubleRingPlan::new(cp, w).unwrap();
            assert_eq!(plan.forward_p2p_bytes(10), (cp as u64 - 1) * 10);
            assert_eq!(
                plan.backward_p2p_bytes(10, 20),
                (cp as u64 - 1) * 10 + cp as u64 * 20
            );
        }
        assert_eq!(
            DoubleRingPlan::new(1, 1)
                .unwrap()
                .backward_p2p_bytes(10, 20),
            0
        );
    }

    #[test]
    fn startrail_rejects_bad_team_size() {
        assert!(StarTrailPlan::new(8, 2).is_ok());
        assert!(StarTrailPlan::new(6, 2).is_err());
        assert!(StarTrailPlan::new(4, 0).is_err());
        assert!(StarTrailPlan::new(12, 3).is_err());
        assert!(StarTrailPlan::new(18, 3).is_ok());
        let msg = StarTrailPlan::new(8, 4).unwrap_err().to_string();
        assert!(msg.contains("C^2"), "{msg}");
    }

    #[test]
    fn startrail_c1_is_a_plain_ring() {
        let plan = StarTrailPlan::new(8, 1).unwrap();
        for r in 0..8 {
            assert_eq!(plan.init_send(r), r);
            assert_eq!(plan.init_recv(r), r);
            assert_eq!(plan.next(r), (r + 1) % 8);
            assert_eq!(plan.prev(r), (r + 7) % 8);
            for s in 0..8 {
                assert_eq!(plan.kv_team_at(r, s), (r + 8 - s) % 8);
            }
        }
    }

    #[test]
    fn startrail_algorithms_2_and_3_by_hand() {
        // Algorithm 2 by hand for P = 16, C = 2: G = 4 teams per team group, and rank
        // (t, a) sends to team a * 4 + t / 2, member t % 2.
        let plan = StarTrailPlan::new(16, 2).unwrap();
        assert_eq!(plan.sub_ring_size(), 4);
        // rank 5 = (team 2, member 1) -> team 1*4 + 1 = 5, member 0 -> rank 10.
        assert_eq!(plan.init_send(5), 10);
        assert_eq!(plan.init_recv(10), 5);
        // rank 10 = (team 5, member 0): group 1, pos 1, holds kv of team 2*1 + 0 = 2.
        assert_eq!(plan.initial_kv_team(10), 2);
        assert_eq!(plan.next(10), 12);
        assert_eq!(plan.prev(10), 8);
        assert_eq!(plan.sub_ring(10), vec![8, 10, 12, 14]);
    }

    #[test]
    fn startrail_invariants() {
        for (p, c) in [
            (1, 1),
            (4, 1),
            (4, 2),
            (8, 1),
            (16, 2),
            (16, 4),
            (18, 3),
            (32, 2),
        ] {
            let plan = StarTrailPlan::new(p, c).unwrap();
            let g = plan.sub_ring_size();
            // init_send is a permutation, init_recv its inverse.
            let targets: BTreeSet<usize> = (0..p).map(|r| plan.init_send(r)).collect();
            assert_eq!(targets.len(), p);
            for r in 0..p {
                assert_eq!(plan.init_recv(plan.init_send(r)), r);
                assert_eq!(plan.next(plan.prev(r)), r);
                assert_eq!(plan.member(plan.next(r)), plan.member(r));
                assert_eq!(plan.team_group(plan.next(r)), plan.team_group(r));
                assert_eq!(plan.sub_ring(r).len(), g);
                assert!(plan.sub_ring(r).contains(&r));
            }
            // Members of a team hold different kv.
            for t in 0..plan.teams() {
                let held: BTreeSet<usize> = (0..c)
                    .map(|a| plan.initial_kv_team(plan.rank_of(t, a)))
                    .collect();
                assert_eq!(held.len(), c);
            }
            for r in 0..p {
                // A sub-ring holds distinct kv; over the steps a rank sees the kv teams of
                // its member class exactly once.
                let seen: BTreeSet<usize> = (0..g).map(|s| plan.kv_team_at(r, s)).collect();
                assert_eq!(seen.len(), g);
                assert!(seen.iter().all(|t| t % c == plan.member(r)));
                // Forward step s: the kv came from the previous sub-ring rank.
                for s in 1..g {
                    assert_eq!(plan.kv_team_at(r, s), plan.kv_team_at(plan.prev(r), s - 1));
                }
                // The team's members together see every kv team exactly once.
                let all: Vec<usize> = plan
                    .team_ranks(r)
                    .into_iter()
                    .flat_map(|m| (0..g).map(move |s| (m, s)))
                    .map(|(m, s)| plan.kv_team_at(m, s))
                    .collect();
                let set: BTreeSet<usize> = all.iter().copied().collect();
                assert_eq!(all.len(), plan.teams());
                assert_eq!(set.len(), plan.teams());
                // Backward: the q packages of every team of the group visit the rank once.
                let qs: BTreeSet<usize> = (0..g).map(|s| plan.q_team_at(r, s)).collect();
                assert_eq!(qs.len(), g);
                assert!(qs.iter().all(|t| t / g == plan.team_group(r)));
            }
            // Each team group holds every team's kv.
            for grp in 0..c {
                let held: BTreeSet<usize> = (0..p)
                    .filter(|&r| plan.team_group(r) == grp)
                    .map(|r| plan.initial_kv_team(r))
                    .collect();
                assert_eq!(held.len(), plan.teams());
            }
        }
    }

    #[test]
    fn startrail_traffic_is_a_cth_of_ring() {
        let e = ShardElems {
            q_elems: 64,
            kv_elems: 32,
            lse_elems: 8,
            elem_bytes: 4,
        };
        let ring = StarTrailPlan::new(16, 1).unwrap();
        let star = StarTrailPlan::new(16, 2).unwrap();
        // Ring P2P: (P-1) sends of k+v.
        assert_eq!(ring.forward_bytes(3, &e).exchange, 15 * 2 * 32 * 4);
        assert_eq!(ring.forward_bytes(3, &e).all_gather, 0);
        // StarTrail on a rank whose initial placement is not local: P/C sends of k+v, i.e.
        // 1/C of ring's P sends.
        let r = (0..16).find(|&r| star.init_send(r) != r).unwrap();
        assert_eq!(star.forward_bytes(r, &e).exchange, 16 / 2 * 2 * 32 * 4);
    }
}
