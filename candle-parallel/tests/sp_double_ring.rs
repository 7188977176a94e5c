//! LoongTrain 2D-Attention with Double-Ring (`Strategy::DoubleRing`): numerics against
//! single-device flash-ring (out, lse, dq, dk, dv within 1e-5 relative, f32) and the exact
//! bytes every rank sends, for inner ring sizes w in {1, 2, 4}, head-first and context-first
//! placement, full / causal / document masks, MHA, GQA and kv replication.

mod multi_ring_common;

use candle_core::Tensor;
use candle_parallel::attention::multi_ring_plan::DoubleRingPlan;
use candle_parallel::attention::ulysses::kv_replication;
use candle_parallel::attention::{
    AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy,
};
use candle_parallel::comm::{LocalWorld, OpKind};
use candle_parallel::mesh::{DeviceMesh, Placement};
use multi_ring_common::{assert_sent, check_numerics, inputs, run, Case, MaskSel, RankOut};

fn config(hp: usize, cp: usize, w: usize, placement: Placement) -> SpConfig {
    SpConfig::new(Strategy::DoubleRing, hp, cp)
        .with_inner_ring(w)
        .with_placement(placement)
}

/// Exact bytes per rank: Ulysses all-to-alls over the head-parallel group (q, k, v, out and
/// lse forward; dout, dq, dk, dv backward; each `(hp-1)/hp` of the tensor) and the double
/// ring's P2P over the context-parallel group (`DoubleRingPlan`).
fn check_traffic(case: &Case, ranks: &[RankOut]) {
    let (hp, cp, w) = (case.cfg.ulysses, case.cfg.ring, case.cfg.inner_ring);
    let plan = DoubleRingPlan::new(cp, w).unwrap();
    let rep = kv_replication(case.hq, case.hkv, hp).unwrap();
    let (e, f32b) = (case.elem_bytes(), 4u64);
    let n = (case.b * case.n()) as u64;
    let q = n * (case.hq * case.d) as u64;
    let k = n * (case.hkv * rep * case.d) as u64;
    let lse = n * case.hq as u64 * f32b;
    let a2a = |bytes: u64| bytes * (hp as u64 - 1) / hp as u64;
    // The kv block of the ring: S/cp tokens, hkv*rep/hp heads = the elements of k and v here;
    // the dk/dv accumulators travel in f32.
    let (kv, dkv) = (2 * k * e, 2 * k * f32b);
    for r in ranks {
        let what = format!("rank {:?} {case:?}", r.coords);
        assert_sent(
            &r.fwd,
            &[
                (OpKind::AllToAll, a2a((2 * q + 2 * k) * e + lse)),
                (OpKind::Exchange, plan.forward_p2p_bytes(kv)),
            ],
            &format!("forward {what}"),
        );
        assert_sent(
            &r.bwd,
            &[
                (OpKind::AllToAll, a2a((2 * q + 2 * k) * e)),
                (OpKind::Exchange, plan.backward_p2p_bytes(kv, dkv)),
            ],
            &format!("backward {what}"),
        );
        // LoongTrain 4.5.3: each forward P2P is Size(kv) = 2 (S/cp) (hkv rep / hp) d bytes.
        let p2p = r.fwd.get(OpKind::Exchange);
        assert_eq!(p2p.calls, cp as u64 - 1);
        if cp > 1 {
            assert_eq!(p2p.bytes_sent / p2p.calls, kv);
        }
    }
}

fn run_case(case: &Case, seed: u64) -> Vec<RankOut> {
    let x = inputs(case, seed);
    let ranks = run(case, &x);
    check_numerics(case, &x, &ranks);
    check_traffic(case, &ranks);
    ranks
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
                assert_eq!(bits(ta), bits(tb), "w = {w}: {name} differs from usp");
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

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Invalid combinations fail on every rank with a clear message before any communication.
#[test]
fn double_ring_rejects_invalid_combinations() {
    // w does not divide the context-parallel degree.
    let cfg = config(1, 4, 3, Placement::HeadFirst);
    let errs = LocalWorld::new(4).launch_each(|world| -> candle_parallel::Result<()> {
        let mesh = DeviceMesh::new(&cfg.mesh_config(), world.clone())?;
        world.traffic().reset();
        let res = SpAttention::new(&cfg, &mesh).map(|_| ());
        assert_eq!(world.traffic().snapshot().bytes_sent(), 0);
        res
    });
    for e in errs {
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains("inner ring size w = 3"), "{msg}");
    }
    // The sequence does not split: 60 tokens over 4 zigzag ranks (8 chunks); heads that do not
    // split over the head-parallel group.
    for (cfg, s, hq, hkv, needle) in [
        (
            config(1, 4, 2, Placement::HeadFirst),
            60,
            4,
            4,
            "not a positive multiple",
        ),
        (
            config(2, 2, 2, Placement::ContextFirst),
            64,
            3,
            3,
            "do not divide",
        ),
    ] {
        let errs = LocalWorld::new(4).launch_each(|world| -> candle_parallel::Result<()> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), world.clone())?;
            let sp = SpAttention::new(&cfg, &mesh)?;
            let n = s / 4;
            let q = Tensor::zeros(
                (1, n, hq, 8),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )?;
            let kv = Tensor::zeros(
                (1, n, hkv, 8),
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )?;
            world.traffic().reset();
            let res = sp
                .attention(&q, &kv, &kv, &AttnMask::Causal, 1.0)
                .map(|_| ());
            assert_eq!(world.traffic().snapshot().bytes_sent(), 0);
            res
        });
        for e in errs {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains(needle), "{msg}");
        }
    }
}
