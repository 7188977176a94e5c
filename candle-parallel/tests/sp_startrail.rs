//! StarTrail / WallFacer concentric rings (`Strategy::StarTrail`): numerics against
//! single-device flash-ring (out, lse, dq, dk, dv within 1e-5 relative, f32) and the exact
//! bytes every rank sends, for team sizes C in {1, 2} on P in {4, 8} ranks, full / causal /
//! document masks, MHA and GQA, with sliding windows and logit soft-caps; C = 1 against ring
//! attention.

mod multi_ring_common;

use candle_parallel::attention::multi_ring_plan::{ShardElems, StarTrailPlan};
use candle_parallel::attention::{SeqLayout, SpConfig, Strategy};
use candle_parallel::comm::OpKind;
use multi_ring_common::{
    assert_build_rejected, assert_call_rejected, assert_sent, inputs, planned_traffic, rel_err,
    run, run_checked, Case, MaskSel, RankOut,
};
use testkit::assert_identical;

fn config(p: usize, c: usize) -> SpConfig {
    SpConfig::new(Strategy::StarTrail, 1, p).with_team(c)
}

/// WallFacer Algorithm 2 (`get_init_send`), written here from the paper: rank `r` is member
/// `r_a = r % C` of team `r_t = r / C` (teams of consecutive ranks, `d_t = P/C` teams,
/// `d_a = C`); it sends its team's gathered kv to team `r_a · (d_t/d_a) + r_t / d_a`, member
/// `r_t % d_a`.
fn paper_init_send(p: usize, c: usize, r: usize) -> usize {
    let (r_t, r_a, d_t, d_a) = (r / c, r % c, p / c, c);
    let team_group_size = d_t / d_a;
    let target_team = r_a * team_group_size + r_t / d_a;
    target_team * d_a + r_t % d_a
}

/// Exact bytes and messages per rank and kind, written here from the global shapes and
/// StarTrail Algorithm 1 / WallFacer Algorithms 2-3 as the code implements them. With `P`
/// ranks, teams of `C`, `G = P/C²` ranks per sub-ring, `n = S/P` local tokens, `e` bytes per
/// input element: `Q = B n hq d e`, `K = B n hkv d e` (one of k, v), and in f32 `Q4`, `K4`,
/// `L4 = B hq n 4` (lse). A team tensor has `C n` rows, so `C` times the local bytes. Counting
/// rules (`comm::traffic`): all-gather of `N` bytes sends `(C-1) N`; all-to-all and
/// reduce-scatter of `N` bytes send `(C-1)/C · N`. A rank whose initial target is itself
/// (`get_init_send(r) = r`) sends nothing for the placement, nor for its inverse.
///
/// Forward:
/// 1. all-gather q, k, v in the team: `(C-1)(Q + 2K)`, 3 calls (C > 1);
/// 2. initial placement of the team's k and v: `2 C K`, one message, unless kept;
/// 3. `G` sub-ring steps, the team kv passed on after all but the last: `(G-1) 2 C K`;
/// 4. combine (a reduce-scatter whose reduction is the lse merge, run as an all-to-all) of the
///    team's partial out and lse, accumulated in f32: `(C-1)/C · C (Q4 + L4)`, 2 calls.
///
/// Backward (the recorded op: kv and dk/dv stay, q circulates):
/// 1. all-gather out, dout and lse in the team: `(C-1)(2Q + L4)`, 3 calls (q was kept);
/// 2. `G` sub-ring steps: the q package (q, out, dout in the input dtype, lse in f32) moves
///    after all but the last, `(G-1) C (3Q + L4)`; its f32 dq accumulator is summed at the `G`
///    ranks of the sub-ring and then returned home, `G` messages of `C Q4` (none if `G = 1`);
/// 3. the f32 dk, dv of the held kv back to its owner (inverse placement): `2 C K4`, unless kept;
/// 4. reduce-scatter (sum) of the team's dq, dk, dv in f32: `(C-1)/C · C (Q4 + 2 K4)`, 3 calls.
///
/// The planning API (`StarTrailPlan::{forward,backward}_bytes`) must agree with these.
fn check_traffic(case: &Case, ranks: &[RankOut]) {
    let (p, c) = (case.cfg.ring, case.cfg.team);
    assert_eq!(case.cfg.ulysses, 1);
    let g = (p / (c * c)) as u64;
    let (p64, c64) = (p as u64, c as u64);
    let n = (case.s / p) as u64;
    let (b, d, e) = (case.b as u64, case.d as u64, case.elem_bytes());
    let (hq, hkv) = (case.hq as u64, case.hkv as u64);
    let (q, k) = (b * n * hq * d * e, b * n * hkv * d * e);
    let (q4, k4, l4) = (b * n * hq * d * 4, b * n * hkv * d * 4, b * hq * n * 4);
    let team_calls = |calls: u64| if c > 1 { calls } else { 0 };
    let ring_msg = 2 * k;
    let plan = StarTrailPlan::new(p, c).unwrap();
    let elems = ShardElems {
        q_elems: b * n * hq * d,
        kv_elems: b * n * hkv * d,
        lse_elems: b * hq * n,
        elem_bytes: e,
    };
    let kept_count = (0..p).filter(|&r| paper_init_send(p, c, r) == r).count();
    // C = 1 is a plain ring (every rank keeps its kv); C > 1 moves some.
    assert!(c == 1 || kept_count < p);
    for r in ranks {
        let rank = r.coords.0;
        let what = format!("rank {rank} {case:?}");
        let moved = paper_init_send(p, c, rank) != rank;
        let placed = u64::from(moved);
        // Forward.
        let f_gather = (c64 - 1) * (q + 2 * k);
        let f_a2a = (c64 - 1) * (q4 + l4);
        let f_p2p = placed * 2 * c64 * k + (g - 1) * 2 * c64 * k;
        let f_msgs = placed + (g - 1);
        // Backward.
        let b_gather = (c64 - 1) * (2 * q + l4);
        let dq_msgs = if g > 1 { g } else { 0 };
        let b_p2p = (g - 1) * c64 * (3 * q + l4) + dq_msgs * c64 * q4 + placed * 2 * c64 * k4;
        let b_msgs = (g - 1) + dq_msgs + placed;
        let b_rs = (c64 - 1) * (q4 + 2 * k4);
        assert_sent(
            &r.fwd,
            &[
                (OpKind::AllGather, f_gather),
                (OpKind::AllToAll, f_a2a),
                (OpKind::Exchange, f_p2p),
            ],
            &format!("forward {what}"),
        );
        assert_sent(
            &r.bwd,
            &[
                (OpKind::AllGather, b_gather),
                (OpKind::ReduceScatter, b_rs),
                (OpKind::Exchange, b_p2p),
            ],
            &format!("backward {what}"),
        );
        for (snap, kind, calls, when) in [
            (&r.fwd, OpKind::AllGather, team_calls(3), "forward"),
            (&r.fwd, OpKind::AllToAll, team_calls(2), "forward"),
            (&r.fwd, OpKind::Exchange, f_msgs, "forward"),
            (&r.bwd, OpKind::AllGather, team_calls(3), "backward"),
            (&r.bwd, OpKind::ReduceScatter, team_calls(3), "backward"),
            (&r.bwd, OpKind::Exchange, b_msgs, "backward"),
        ] {
            assert_eq!(
                snap.get(kind).calls,
                calls,
                "{when} {what}: {} calls",
                kind.name()
            );
        }
        // The library's planning API agrees (and its rank arithmetic with the paper's).
        assert_eq!(plan.init_send(rank) != rank, moved, "{what}: init_send");
        let (fp, bp) = (
            plan.forward_bytes(rank, &elems),
            plan.backward_bytes(rank, &elems),
        );
        assert_eq!(
            (fp.all_gather, fp.all_to_all, fp.reduce_scatter, fp.exchange),
            (f_gather, f_a2a, 0, f_p2p),
            "StarTrailPlan::forward_bytes, {what}"
        );
        assert_eq!(
            (bp.all_gather, bp.all_to_all, bp.reduce_scatter, bp.exchange),
            (b_gather, 0, b_rs, b_p2p),
            "StarTrailPlan::backward_bytes, {what}"
        );
        // Against ring attention: the forward P2P is `G · 2 C K = P/C` ring messages
        // (`2K`), i.e. 1/C of ring's P, on every rank whose initial placement is not local.
        if moved {
            assert_eq!(f_p2p * c64, p64 * ring_msg, "{what}: 1/C of ring");
        } else {
            assert_eq!(f_p2p * c64, (p64 - c64 * c64) * ring_msg, "{what}");
        }
        // Collectives: q, k, v all-gathered, the f32 partial out and lse combined
        // (StarTrail eq. 2, plus the lse and with the partial out in f32).
        assert_eq!(
            r.fwd.collective_bytes_sent(),
            (c64 - 1) * (q + 2 * k + q4 + l4)
        );
    }
    // The planner's cost model takes the busiest rank.
    let planned = planned_traffic(case);
    let busiest = |f: &dyn Fn(&RankOut) -> u64| ranks.iter().map(f).max().unwrap_or(0);
    assert_eq!(
        (planned.forward.total(), planned.backward.total()),
        (
            busiest(&|r| r.fwd.bytes_sent()),
            busiest(&|r| r.bwd.bytes_sent())
        ),
        "planner::traffic {case:?}"
    );
}

fn run_case(case: &Case, seed: u64) -> Vec<RankOut> {
    run_checked(case, seed, check_traffic)
}

/// The grid of the issue: C in {1, 2}, P in {4, 8} (P = 4, C = 2 has one-team sub-rings),
/// every mask, MHA and GQA.
#[test]
fn startrail_matches_single_device() {
    let mut seed = 0;
    for (p, c) in [(4, 1), (4, 2), (8, 1), (8, 2)] {
        for mask in MaskSel::ALL {
            for (hq, hkv) in [(4, 4), (8, 2)] {
                seed += 1;
                run_case(&Case::new(config(p, c), mask, hq, hkv), seed);
            }
        }
    }
}

/// Sliding windows (of 1 key, shorter than a rank's tokens, spanning teams) and Gemma 2's logit
/// soft-cap, alone and together, every mask, GQA, teams of 1 and 2: out, lse and the gradients
/// equal one device (1e-5) and the bytes are the formula's (a window skips compute, not
/// StarTrail's transfers).
#[test]
fn startrail_with_windows_and_softcaps_matches_single_device() {
    let mut seed = 400;
    for (p, c) in [(4, 2), (8, 2), (8, 1)] {
        for mask in MaskSel::ALL {
            for (w, cap) in [
                (Some(1), None),
                (Some(6), None),
                (Some(20), Some(0.7)),
                (None, Some(0.7)),
            ] {
                seed += 1;
                let case = Case::new(config(p, c), mask, 8, 2).with_window_and_softcap(w, cap);
                run_case(&case, seed);
            }
        }
    }
}

/// Any ring layout works (the blocks carry their global positions).
#[test]
fn startrail_layouts() {
    for (i, layout) in [SeqLayout::Contiguous, SeqLayout::Striped]
        .into_iter()
        .enumerate()
    {
        for mask in [MaskSel::Causal, MaskSel::Docs] {
            let case = Case::new(config(8, 2), mask, 4, 1).with_layout(layout);
            run_case(&case, 100 + i as u64);
        }
    }
}

/// C = 1 is ring attention: bit-identical forward and the same forward bytes; the backward
/// (q circulating instead of kv) sums in another order, so it agrees within rounding.
#[test]
fn startrail_c1_is_ring_attention() {
    for p in [4, 8] {
        for mask in [MaskSel::Causal, MaskSel::Docs] {
            let case = Case::new(config(p, 1), mask, 8, 2);
            let x = inputs(&case, 200 + p as u64);
            let st = run_case(&case, 200 + p as u64);
            let mut ring_case = case.clone();
            ring_case.cfg = SpConfig::new(Strategy::Ring, 1, p);
            let ring = run(&ring_case, &x);
            for (a, b) in st.iter().zip(&ring) {
                assert_eq!(a.coords, b.coords);
                assert_identical(&a.out, &b.out, "out vs ring");
                assert_identical(&a.lse, &b.lse, "lse vs ring");
                assert_eq!(a.fwd, b.fwd, "forward traffic differs from ring");
                for (name, ta, tb) in [
                    ("dq", &a.dq, &b.dq),
                    ("dk", &a.dk, &b.dk),
                    ("dv", &a.dv, &b.dv),
                ] {
                    let e = rel_err(ta, tb);
                    assert!(e <= 1e-6, "{name}: {e:e} from ring");
                }
            }
        }
    }
}

/// Batch 2 and bf16 (the traffic formulas with 2-byte elements).
#[test]
fn startrail_batch_and_bf16() {
    run_case(
        &Case::new(config(8, 2), MaskSel::Docs, 8, 2).with_batch(2),
        300,
    );
    let bf16 = Case::new(config(8, 2), MaskSel::Causal, 4, 4).with_dtype(candle_core::DType::BF16);
    run_case(&bf16, 301);
}

/// Invalid combinations fail on every rank with a clear message before any communication.
#[test]
fn startrail_rejects_invalid_combinations() {
    // C^2 does not divide P; StarTrail on a ulysses x ring grid.
    for (cfg, needle) in [
        (config(8, 4), "C^2 = 16"),
        (config(8, 3), "C^2 = 9"),
        (
            SpConfig::new(Strategy::StarTrail, 2, 4).with_team(2),
            "ring group only",
        ),
    ] {
        assert_build_rejected(&cfg, 8, needle);
    }
    // The sequence does not split over 8 zigzag ranks (16 chunks), and q/kv heads that are not
    // a GQA pair.
    let cfg = config(8, 2);
    assert_call_rejected(&cfg, 8, (40, 4, 4), "not a positive multiple");
    assert_call_rejected(&cfg, 8, (64, 4, 3), "multiple of kv_heads");
}
