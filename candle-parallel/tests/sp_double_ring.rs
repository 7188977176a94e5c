//! LoongTrain 2D-Attention with Double-Ring (`Strategy::DoubleRing`): numerics against
//! single-device flash-ring (out, lse, dq, dk, dv within 1e-5 relative, f32) and the exact
//! bytes every rank sends, for inner ring sizes w in {1, 2, 4}, head-first and context-first
//! placement, full / causal / document masks, MHA, GQA and kv replication.

mod multi_ring_common;

use candle_parallel::attention::multi_ring_plan::DoubleRingPlan;
use candle_parallel::attention::{SeqLayout, SpConfig, Strategy};
use candle_parallel::comm::OpKind;
use candle_parallel::mesh::Placement;
use multi_ring_common::{
    assert_build_rejected, assert_call_rejected, assert_sent, inputs, planned_traffic, run,
    run_checked, Case, MaskSel, RankOut,
};
use testkit::assert_identical;

fn config(hp: usize, cp: usize, w: usize, placement: Placement) -> SpConfig {
    SpConfig::new(Strategy::DoubleRing, hp, cp)
        .with_inner_ring(w)
        .with_placement(placement)
}

/// Exact bytes and messages per rank, written here from the global shapes and LoongTrain's
/// 2D-Attention as the code implements it (Algorithm 2, sec. 4.5.3-4.5.4). Derivation, with
/// `S` tokens, `B` batch, `d` head dim, `e` bytes per input element, `hp × cp` ranks,
/// `n_o = cp / w` outer steps of `w` micro-steps:
/// - Ulysses: each all-to-all over the `hp` ranks sends `(hp-1)/hp` of the rank's tensor.
///   Local (sequence-side) tensors: q and out `B (S/(hp cp)) hq d e`; k and v after kv
///   replication to `max(hkv, hp)` heads (sec. 4.5.3) `B (S/(hp cp)) max(hkv, hp) d e`; the
///   lse (returned with the output here) `B hq (S/(hp cp)) 4`. Forward: q, k, v, out, lse;
///   backward: dout, dq, dk, dv (sec. 4.5.4: q, k, v, out each way).
/// - Ring block after the all-to-all: `S/cp` tokens of `max(hkv, hp)/hp` kv heads, so
///   `Size(kv) = 2 B (S/cp) (max(hkv, hp)/hp) d e` for k and v together.
/// - Forward P2P: per outer step `w - 1` inner sends of the held kv, and one outer prefetch of
///   the step's initial kv except at the last outer step (sec. 4.5.3):
///   `n_o (w - 1) + (n_o - 1) = cp - 1` messages of exactly `Size(kv)`.
/// - Backward P2P: kv moves exactly as in the forward (`cp - 1` messages of `Size(kv)`), and
///   the dk/dv accumulator of every block, in f32 (`Size_f32(kv)`), is summed at the `cp`
///   ranks that compute with the block: `cp - 1` hand-overs (inner after each non-last
///   micro-step, outer after the last micro-step of a non-last outer step) plus one message
///   home after the last step, i.e. one send per micro-step, `n_o w = cp` messages; nothing
///   when `cp = 1` (the only block is the rank's own).
///
/// The planning API (`DoubleRingPlan::*_p2p_bytes`) must agree with these formulas.
fn check_traffic(case: &Case, ranks: &[RankOut]) {
    let (hp, cp, w) = (case.cfg.ulysses, case.cfg.ring, case.cfg.inner_ring);
    let (b, s, d, e) = (
        case.b as u64,
        case.s as u64,
        case.d as u64,
        case.elem_bytes(),
    );
    let (hq, hkv_rep) = (case.hq as u64, case.hkv.max(hp) as u64);
    let (hp, cp, w) = (hp as u64, cp as u64, w as u64);
    let n_o = cp / w;
    let f32b = 4u64;
    // Sequence-side local tensors (S/(hp cp) tokens, every head).
    let local = s / (hp * cp);
    let q = b * local * hq * d * e;
    let k = b * local * hkv_rep * d * e;
    let lse = b * hq * local * f32b;
    let a2a = |bytes: u64| bytes * (hp - 1) / hp;
    // Head-side ring block: S/cp tokens, max(hkv, hp)/hp heads, k and v.
    let kv_elems = 2 * b * (s / cp) * (hkv_rep / hp) * d;
    let (kv, dkv) = (kv_elems * e, kv_elems * f32b);
    let fwd_msgs = n_o * (w - 1) + (n_o - 1);
    assert_eq!(fwd_msgs, cp - 1);
    let dkv_msgs = if cp == 1 { 0 } else { n_o * w };
    let fwd_p2p = fwd_msgs * kv;
    let bwd_p2p = fwd_msgs * kv + dkv_msgs * dkv;
    for r in ranks {
        let what = format!("rank {:?} {case:?}", r.coords);
        assert_sent(
            &r.fwd,
            &[
                (OpKind::AllToAll, a2a(2 * q + 2 * k + lse)),
                (OpKind::Exchange, fwd_p2p),
            ],
            &format!("forward {what}"),
        );
        assert_sent(
            &r.bwd,
            &[
                (OpKind::AllToAll, a2a(2 * q + 2 * k)),
                (OpKind::Exchange, bwd_p2p),
            ],
            &format!("backward {what}"),
        );
        // Message counts: one exchange per P2P message.
        assert_eq!(r.fwd.get(OpKind::Exchange).calls, fwd_msgs, "{what}");
        assert_eq!(
            r.bwd.get(OpKind::Exchange).calls,
            fwd_msgs + dkv_msgs,
            "{what}"
        );
    }
    // The planning API agrees with the formulas.
    let plan = DoubleRingPlan::new(cp as usize, w as usize).unwrap();
    assert_eq!(
        plan.forward_p2p_bytes(kv),
        fwd_p2p,
        "DoubleRingPlan forward"
    );
    assert_eq!(
        plan.backward_p2p_bytes(kv, dkv),
        bwd_p2p,
        "DoubleRingPlan backward"
    );
    // So does the planner's cost model, for every rank.
    let planned = planned_traffic(case);
    for r in ranks {
        assert_eq!(
            (planned.forward.total(), planned.backward.total()),
            (r.fwd.bytes_sent(), r.bwd.bytes_sent()),
            "planner::traffic, rank {:?} {case:?}",
            r.coords
        );
    }
}

fn run_case(case: &Case, seed: u64) -> Vec<RankOut> {
    run_checked(case, seed, check_traffic)
}

/// The grid of the issue: 8 ranks = 2 (head-parallel) x 4 (context-parallel), w in {1, 2, 4},
/// both placements, every mask, MHA and GQA (and kv replication: 1 kv head over 2 ranks).
#[test]
fn double_ring_matches_single_device_2x4() {
    let mut seed = 0;
    for placement in [Placement::HeadFirst, Placement::ContextFirst] {
        for w in [1, 2, 4] {
            for mask in MaskSel::ALL {
                for (hq, hkv) in [(4, 4), (8, 2), (4, 1)] {
                    seed += 1;
                    run_case(&Case::new(config(2, 4, w, placement), mask, hq, hkv), seed);
                }
            }
        }
    }
}

/// Context parallelism only (4 ranks), the three layouts.
#[test]
fn double_ring_matches_single_device_1x4_layouts() {
    let mut seed = 100;
    for layout in SeqLayout::ALL {
        for w in [1, 2, 4] {
            for mask in [MaskSel::Causal, MaskSel::Docs] {
                for (hq, hkv) in [(4, 4), (4, 2)] {
                    seed += 1;
                    let case = Case::new(config(1, 4, w, Placement::HeadFirst), mask, hq, hkv)
                        .with_layout(layout);
                    run_case(&case, seed);
                }
            }
        }
    }
}

/// Eight context-parallel ranks: two inner rings of four and four of two.
#[test]
fn double_ring_matches_single_device_1x8() {
    for (i, w) in [2, 4].into_iter().enumerate() {
        let case = Case::new(
            config(1, 8, w, Placement::ContextFirst),
            MaskSel::Docs,
            4,
            2,
        );
        run_case(&case, 200 + i as u64);
    }
}

/// `w = d_cp` (one inner ring) and `w = 1` (outer ring only) visit the blocks in ring order
/// and accumulate in the same order: bit for bit USP (Ulysses x ring attention), same bytes.
/// MHA: with GQA the flash-ring backward sums the q heads of a kv group in task order, which
/// is not deterministic from run to run.
#[test]
fn double_ring_degenerates_to_usp() {
    for w in [1, 4] {
        let case = Case::new(config(2, 4, w, Placement::HeadFirst), MaskSel::Causal, 4, 4);
        let x = inputs(&case, 300 + w as u64);
        let dr = run_case(&case, 300 + w as u64);
        let mut usp_case = case.clone();
        usp_case.cfg = SpConfig::new(Strategy::Usp, 2, 4);
        let usp = run(&usp_case, &x);
        for (a, b) in dr.iter().zip(&usp) {
            assert_eq!(a.coords, b.coords);
            for (name, ta, tb) in [
                ("out", &a.out, &b.out),
                ("lse", &a.lse, &b.lse),
                ("dq", &a.dq, &b.dq),
                ("dk", &a.dk, &b.dk),
                ("dv", &a.dv, &b.dv),
            ] {
                assert_identical(ta, tb, &format!("w = {w}: {name} vs usp"));
            }
            assert_eq!(
                a.fwd.bytes_sent(),
                b.fwd.bytes_sent(),
                "w = {w}: forward bytes"
            );
            assert_eq!(
                a.bwd.bytes_sent(),
                b.bwd.bytes_sent(),
                "w = {w}: backward bytes"
            );
        }
    }
}

/// Batch 2 and bf16 (the traffic halves where the payload is in the input dtype).
#[test]
fn double_ring_batch_and_bf16() {
    let cfg = config(2, 4, 2, Placement::ContextFirst);
    run_case(
        &Case::new(cfg.clone(), MaskSel::Docs, 8, 2).with_batch(2),
        400,
    );
    let bf16 = Case::new(cfg, MaskSel::Causal, 4, 1).with_dtype(candle_core::DType::BF16);
    run_case(&bf16, 401);
}

/// Invalid combinations fail on every rank with a clear message before any communication.
#[test]
fn double_ring_rejects_invalid_combinations() {
    // w does not divide the context-parallel degree.
    let cfg = config(1, 4, 3, Placement::HeadFirst);
    assert_build_rejected(&cfg, 4, "inner ring size w = 3");
    // The sequence does not split: 60 tokens over 4 zigzag ranks (8 chunks); heads that do not
    // split over the head-parallel group.
    let cfg = config(1, 4, 2, Placement::HeadFirst);
    assert_call_rejected(&cfg, 4, (60, 4, 4), "not a positive multiple");
    let cfg = config(2, 2, 2, Placement::ContextFirst);
    assert_call_rejected(&cfg, 4, (64, 3, 3), "do not divide");
}
