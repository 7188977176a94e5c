//! The planner's cost model against the directions the papers published, from their stated
//! hardware and model shapes (`docs/planner.md` has the numbers side by side).
//!
//! Each test builds the paper's cluster as a [`Hardware`], predicts the step time of the layouts
//! the paper compares, and asserts the paper's direction (which layout wins). Hardware rates are
//! datasheet figures derated as in the presets (matmul 70% of bf16 peak, flash attention 55%),
//! bandwidths per GPU and direction.

use candle_parallel::attention::{SpConfig, Strategy};
use candle_parallel::mesh::{MeshConfig, Placement};
use candle_parallel::nn::TpActivations;
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::{Layout, MemoryPlan};
use candle_parallel::planner::cost::Workload;
use candle_parallel::planner::hardware::{DeviceSpec, LinkSpec};
use candle_parallel::planner::{predict, Candidate, Hardware, ModelShape, Prediction};
use candle_parallel::recompute::Checkpointing;

/// A100 80 GB nodes of 8 (bf16 peak 312 TFLOP/s, NVLink 3 at 300 GB/s per direction) with
/// `inter_gbps` gigabytes/s per GPU between nodes.
fn a100(nodes: usize, inter_gbs: f64) -> Hardware {
    Hardware {
        name: format!("{nodes} x 8 A100 80GB"),
        nodes,
        devices_per_node: 8,
        shared_node: false,
        device: DeviceSpec {
            matmul_flops: 0.7 * 312e12,
            attention_flops: 0.55 * 312e12,
            memory_bandwidth: 1.8e12,
            memory_bytes: 76e9,
            optimizer_params_per_sec: None,
        },
        intra_node: LinkSpec {
            bandwidth: 2.4e11,
            latency: 1e-5,
        },
        inter_node: LinkSpec {
            bandwidth: inter_gbs * 1e9,
            latency: 2e-5,
        },
        overlap: true,
    }
}

/// LLaMA2-7B's shape (LoongTrain, USP): 32 layers, hidden 4096, 32 heads, FFN 11008.
fn llama7b(kv_heads: usize) -> ModelShape {
    ModelShape {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads,
        head_dim: 128,
        intermediate: 11008,
        vocab: 32000,
        tied_embeddings: false,
    }
}

fn work(model: ModelShape, seq: usize) -> Workload {
    Workload {
        model,
        seq_len: seq,
        sequences: 1,
        elem_bytes: 2,
        loss_chunk: 1024,
        attention_density: 0.5,
    }
}

fn run(
    hw: &Hardware,
    w: &Workload,
    tp: usize,
    sp: SpConfig,
    ckpt: Checkpointing,
    zero: ZeroStage,
) -> Prediction {
    let mesh = MeshConfig::default()
        .with_tp(tp)
        .with_ulysses(sp.ulysses)
        .with_ring(sp.ring)
        .with_placement(sp.placement);
    let cand = Candidate {
        layout: Layout::new(mesh, sp, TpActivations::Replicated),
        memory: MemoryPlan {
            zero,
            zero_group: None,
            checkpointing: ckpt,
        },
    };
    predict(&cand, w, hw).unwrap()
}

fn sp_time(hw: &Hardware, w: &Workload, sp: SpConfig) -> f64 {
    run(
        hw,
        w,
        1,
        sp,
        Checkpointing::Full,
        ZeroStage::OptimizerStates,
    )
    .time
    .total
}

/// LoongTrain Table 2 (32 GPUs, 4 nodes x 8 A100, 4 x 200 Gb/s HDR per node = 12.5 GB/s per
/// GPU; 7B MHA, 128K): head parallelism 8 x context 4 (752 tokens/GPU/s) beats pure ring
/// (cp 32: 285) and pure Ulysses is in between (hp 32 with 1: 700).
#[test]
fn loongtrain_2d_attention_beats_ring_on_32_gpus() {
    let hw = a100(4, 12.5);
    let w = work(llama7b(32), 128 * 1024);
    let ring = sp_time(&hw, &w, SpConfig::new(Strategy::Ring, 1, 32));
    let hp8 = sp_time(&hw, &w, SpConfig::new(Strategy::Usp, 8, 4));
    let hp32 = sp_time(&hw, &w, SpConfig::new(Strategy::Ulysses, 32, 1));
    eprintln!(
        "LoongTrain 32 GPUs MHA 128K: ring {ring:.2} s, hp8 x cp4 {hp8:.2} s, hp32 {hp32:.2} s"
    );
    assert!(
        hp8 < ring && hp32 < ring,
        "ring {ring} hp8 {hp8} hp32 {hp32}"
    );
    assert!(hp8 < hp32, "hp8 {hp8} hp32 {hp32}");
}

/// LoongTrain Table 5 (64 GPUs, 7B MHA, cp 64, 128K): the double ring with inner rings of 4
/// (140.6 ms per attention) beats the plain ring (295.9 ms). Not reproduced: that w = 4 (the
/// NICs per node) beats w = 8 (the model has no NIC count: w = 8 keeps the inner ring in the
/// node and wins).
#[test]
fn loongtrain_double_ring_beats_ring_at_cp64() {
    let hw = a100(8, 12.5);
    let w = work(llama7b(32), 128 * 1024);
    let ring = sp_time(&hw, &w, SpConfig::new(Strategy::Ring, 1, 64));
    let dr4 = sp_time(
        &hw,
        &w,
        SpConfig::new(Strategy::DoubleRing, 1, 64).with_inner_ring(4),
    );
    let dr = |inner: usize| {
        let sp = SpConfig::new(Strategy::DoubleRing, 1, 64).with_inner_ring(inner);
        sp_time(&hw, &w, sp)
    };
    eprintln!(
        "LoongTrain cp64 MHA 128K: ring {ring:.2} s, double ring w2 {:.2} w4 {dr4:.2} w8 {:.2} s",
        dr(2),
        dr(8)
    );
    assert!(dr4 < ring, "double ring {dr4} ring {ring}");
}

/// LoongTrain Tables 3 and 4 (64 GPUs, 128K, hp 8 x cp 8): with GQA head-first placement wins
/// (52.1 vs 56.8 ms per attention: the all-to-all stays on NVLink, the small GQA kv blocks hide
/// behind the ring's compute); with MHA context-first wins (62.2 vs 72.2 ms: the kv blocks are 4x
/// larger and the ring's transfers no longer hide when they cross nodes). Not reproduced
/// (`docs/planner.md`): MHA hp 16 x cp 4 (head-first 3% ahead in the paper, context-first 1%
/// in the model) and MHA hp 2 x cp 32 (context-first 1.7x ahead in the paper, a near tie here).
#[test]
fn loongtrain_placement_follows_the_kv_size() {
    let hw = a100(8, 12.5);
    let t = |kv: usize, p: Placement| {
        let w = work(llama7b(kv), 128 * 1024);
        sp_time(
            &hw,
            &w,
            SpConfig::new(Strategy::Usp, 8, 8).with_placement(p),
        )
    };
    for (kv, head_first_wins) in [(8, true), (32, false)] {
        let (hf, cf) = (t(kv, Placement::HeadFirst), t(kv, Placement::ContextFirst));
        eprintln!("LoongTrain kv {kv} hp8 x cp8: head-first {hf:.2} s, context-first {cf:.2} s");
        assert_eq!(
            hf < cf,
            head_first_wins,
            "kv {kv}: head-first {hf} context-first {cf}"
        );
    }
}

/// USP Table 6 (2 nodes x 8 A800, 400 GB/s NVLink, 1.6 Tb/s between nodes = 12.5 GB/s per
/// GPU; LLaMA3-8B 64K): ulysses 4 x ring 4 and ulysses 8 x ring 2 beat ring 16 (by 12-13%),
/// and more ring degree is slower.
#[test]
fn usp_hybrid_beats_ring_across_two_nodes() {
    let hw = a100(2, 12.5);
    let llama3_8b = ModelShape {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128256,
        tied_embeddings: false,
    };
    let w = work(llama3_8b, 64 * 1024);
    let t = |u: usize, r: usize| {
        let s = match (u, r) {
            (_, 1) => Strategy::Ulysses,
            (1, _) => Strategy::Ring,
            _ => Strategy::Usp,
        };
        sp_time(&hw, &w, SpConfig::new(s, u, r))
    };
    let (u8r2, u4r4, u2r8, u1r16) = (t(8, 2), t(4, 4), t(2, 8), t(1, 16));
    eprintln!("USP 16 GPUs 64K: u8r2 {u8r2:.3} u4r4 {u4r4:.3} u2r8 {u2r8:.3} r16 {u1r16:.3} s");
    assert!(u4r4 < u1r16 && u8r2 < u1r16);
    assert!(u4r4 <= u2r8 && u2r8 <= u1r16);
}

/// StarTrail / WallFacer (8 nodes x 8 H100, 8 x 400 Gb/s IB per node = 50 GB/s per GPU; 7B,
/// 128K on 64 GPUs): concentric rings with teams of C = 2 beat ring attention.
#[test]
fn startrail_teams_beat_ring_on_64_h100() {
    let hw = Hardware::preset("h100-cluster").unwrap();
    let w = work(llama7b(32), 128 * 1024);
    let ring = sp_time(&hw, &w, SpConfig::new(Strategy::Ring, 1, 64));
    let c2 = sp_time(
        &hw,
        &w,
        SpConfig::new(Strategy::StarTrail, 1, 64).with_team(2),
    );
    let c4 = sp_time(
        &hw,
        &w,
        SpConfig::new(Strategy::StarTrail, 1, 64).with_team(4),
    );
    eprintln!("StarTrail 64 H100 7B 128K: ring {ring:.2} s, C=2 {c2:.2} s, C=4 {c4:.2} s");
    assert!(c2 < ring, "C=2 {c2} ring {ring}");
}

/// Llama 3 (sec. 3.3.2): tensor parallelism innermost, inside a node. Its all-reduces are
/// the most frequent and largest: tp 8 on NVLink beats tp 8 spread over nodes (here: the same
/// 16 ranks with tp outermost, dp inside).
#[test]
fn llama3_tensor_parallelism_belongs_inside_the_node() {
    use candle_parallel::mesh::Dim;
    let hw = Hardware::preset("h100-cluster").unwrap();
    let w = Workload {
        sequences: 2,
        ..work(llama7b(32), 8192)
    };
    let time = |order: &[Dim]| {
        let mesh = MeshConfig::default()
            .with_tp(8)
            .with_dp(2)
            .with_order(order);
        let cand = Candidate {
            layout: Layout::new(
                mesh,
                SpConfig::new(Strategy::Ring, 1, 1),
                TpActivations::SequenceSharded,
            ),
            memory: MemoryPlan {
                zero: ZeroStage::OptimizerStates,
                zero_group: None,
                checkpointing: Checkpointing::None,
            },
        };
        predict(&cand, &w, &hw).unwrap().time.total
    };
    let inner = time(&MeshConfig::llama3_order());
    let outer = time(&[Dim::Dp, Dim::Ulysses, Dim::Ring, Dim::Pp, Dim::Tp]);
    eprintln!("Llama 3 order: tp inside a node {inner:.3} s, tp across nodes {outer:.3} s");
    assert!(inner < outer, "inner {inner} outer {outer}");
}
