//! StarTrail / WallFacer concentric rings (`Strategy::StarTrail`): numerics against
//! single-device flash-ring (out, lse, dq, dk, dv within 1e-5 relative, f32) and the exact
//! bytes every rank sends, for team sizes C in {1, 2} on P in {4, 8} ranks, full / causal /
//! document masks, MHA and GQA; C = 1 against ring attention.

mod multi_ring_common;

use candle_core::Tensor;
use candle_parallel::attention::multi_ring_plan::{ShardElems, StarTrailPlan};
use candle_parallel::attention::{
    AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy,
};
use candle_parallel::comm::{LocalWorld, OpKind};
use candle_parallel::mesh::DeviceMesh;
use multi_ring_common::{
    assert_sent, check_numerics, inputs, rel_err, run, Case, MaskSel, RankOut,
};

fn config(p: usize, c: usize) -> SpConfig {
    SpConfig::new(Strategy::StarTrail, 1, p).with_team(c)
}

fn elems(case: &Case) -> ShardElems {
    let n = (case.b * case.n()) as u64;
    ShardElems {
        q_elems: n * (case.hq * case.d) as u64,
        kv_elems: n * (case.hkv * case.d) as u64,
        lse_elems: n * case.hq as u64,
        elem_bytes: case.elem_bytes(),
    }
}

/// Exact bytes per rank and kind ([`StarTrailPlan::forward_bytes`] / `backward_bytes`), and
/// the relation to ring attention: the forward P2P is `P/C` ring messages (`Size(k) + Size(v)`)
/// against ring's `P - 1`, i.e. `1/C` of ring's `P`, on every rank whose initial placement is
/// not local.
fn check_traffic(case: &Case, ranks: &[RankOut]) {
    let (p, c) = (case.cfg.ring, case.cfg.team);
    let plan = StarTrailPlan::new(p, c).unwrap();
    let e = elems(case);
    let ring_msg = 2 * e.kv_elems * e.elem_bytes;
    for r in ranks {
        let rank = r.coords.0;
        let what = format!("rank {rank} {case:?}");
        let f = plan.forward_bytes(rank, &e);
        let b = plan.backward_bytes(rank, &e);
        assert_sent(
            &r.fwd,
            &[
                (OpKind::AllGather, f.all_gather),
                (OpKind::AllToAll, f.all_to_all),
                (OpKind::Exchange, f.exchange),
            ],
            &format!("forward {what}"),
        );
        assert_sent(
            &r.bwd,
            &[
                (OpKind::AllGather, b.all_gather),
                (OpKind::ReduceScatter, b.reduce_scatter),
                (OpKind::Exchange, b.exchange),
            ],
            &format!("backward {what}"),
        );
        let p2p = r.fwd.get(OpKind::Exchange).bytes_sent;
        if plan.init_send(rank) != rank {
            assert_eq!(p2p * c as u64, p as u64 * ring_msg, "{what}: 1/C of ring");
        } else {
            assert_eq!(p2p * c as u64, (p - c * c) as u64 * ring_msg, "{what}");
        }
        // Collectives: q, k, v all-gathered, the f32 partial out and lse reduce-scattered
        // (StarTrail eq. 2, plus the lse).
        let (q, k) = (e.q_elems * e.elem_bytes, e.kv_elems * e.elem_bytes);
        let (q32, lse) = (e.q_elems * 4, e.lse_elems * 4);
        assert_eq!(
            r.fwd.collective_bytes_sent(),
            (c as u64 - 1) * (q + 2 * k + q32 + lse)
        );
    }
}

fn run_case(case: &Case, seed: u64) -> Vec<RankOut> {
    let x = inputs(case, seed);
    let ranks = run(case, &x);
    check_numerics(case, &x, &ranks);
    check_traffic(case, &ranks);
    ranks
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
                assert_eq!(bits(&a.out), bits(&b.out), "out differs from ring");
                assert_eq!(bits(&a.lse), bits(&b.lse), "lse differs from ring");
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
        let errs = LocalWorld::new(8).launch_each(|world| -> candle_parallel::Result<()> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), world.clone())?;
            world.traffic().reset();
            let res = SpAttention::new(&cfg, &mesh).map(|_| ());
            assert_eq!(world.traffic().snapshot().bytes_sent(), 0);
            res
        });
        for e in errs {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains(needle), "{msg}");
        }
    }
    // The sequence does not split over 8 zigzag ranks (16 chunks), and q/kv heads that are not
    // a GQA pair.
    let cfg = config(8, 2);
    for (s, hq, hkv, needle) in [
        (40, 4, 4, "not a positive multiple"),
        (64, 4, 3, "multiple of kv_heads"),
    ] {
        let errs = LocalWorld::new(8).launch_each(|world| -> candle_parallel::Result<()> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), world.clone())?;
            let sp = SpAttention::new(&cfg, &mesh)?;
            let n = s / 8;
            let dev = candle_core::Device::Cpu;
            let q = Tensor::zeros((1, n, hq, 8), candle_core::DType::F32, &dev)?;
            let kv = Tensor::zeros((1, n, hkv, 8), candle_core::DType::F32, &dev)?;
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
