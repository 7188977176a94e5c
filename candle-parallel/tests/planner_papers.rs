//! The planner's cost model against the directions the papers published, from their stated
//! hardware and model shapes (`docs/planner.md` has the numbers side by side).
//!
//! Each test builds the paper's cluster from a hardware preset (`a100-hdr-cluster`,
//! `a800-roce-cluster`, `l20-pcie-node`, `h100-cluster`: datasheet figures derated, NICs per node
//! as the paper states them), predicts the layouts the paper compares, and asserts the paper's
//! direction (which layout wins). [`the_pick_is_within_ten_percent_of_the_measured_best`] goes
//! through every published number: per column of each table, the planner ranks the measured
//! layouts and its pick's measured time is compared with the column's best.

use candle_parallel::attention::{SeqLayout, SpConfig, Strategy};
use candle_parallel::mesh::{MeshConfig, Placement};
use candle_parallel::nn::TpActivations;
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::{Layout, MemoryPlan};
use candle_parallel::planner::cost::Workload;
use candle_parallel::planner::{
    attention_time, predict, Candidate, Hardware, ModelShape, Prediction,
};
use candle_parallel::recompute::Checkpointing;

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
        moe: None,
        window: None,
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
    let hw = loongtrain_hw();
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

/// LoongTrain Table 5 (64 GPUs, 7B MHA, cp 64, 128K): the double ring beats the plain ring
/// (140.6 ms per attention with inner rings of 4, 295.9 ms without), and inner rings of 4, the
/// NICs per node, beat inner rings of 8 (214.9 ms): the outer ring of inner rings of 8 sends 8
/// hops out of a node over 4 NICs, of inner rings of 4 one hop per NIC.
#[test]
fn loongtrain_double_ring_beats_ring_at_cp64() {
    let hw = loongtrain_hw();
    let w = work(llama7b(32), 128 * 1024);
    let ring = sp_time(&hw, &w, SpConfig::new(Strategy::Ring, 1, 64));
    let dr = |inner: usize| {
        let sp = SpConfig::new(Strategy::DoubleRing, 1, 64).with_inner_ring(inner);
        sp_time(&hw, &w, sp)
    };
    let dr4 = dr(4);
    eprintln!(
        "LoongTrain cp64 MHA 128K: ring {ring:.2} s, double ring w2 {:.2} w4 {dr4:.2} w8 {:.2} s",
        dr(2),
        dr(8)
    );
    assert!(dr4 < ring, "double ring {dr4} ring {ring}");
    let attention = |inner: usize| {
        let mesh = MeshConfig::default()
            .with_ring(64)
            .with_placement(Placement::ContextFirst);
        let sp = SpConfig::new(Strategy::DoubleRing, 1, 64)
            .with_inner_ring(inner)
            .with_placement(Placement::ContextFirst);
        let cand = Candidate {
            layout: Layout::new(mesh, sp, TpActivations::Replicated),
            memory: MemoryPlan {
                zero: ZeroStage::OptimizerStates,
                zero_group: None,
                checkpointing: Checkpointing::Full,
            },
        };
        let t = attention_time(&cand, &w, &hw).unwrap();
        t.forward + t.backward
    };
    let (a4, a8) = (attention(4), attention(8));
    eprintln!("LoongTrain cp64 MHA 128K attention: w4 {a4:.4} s, w8 {a8:.4} s");
    assert!(a4 < a8, "w4 {a4} w8 {a8}");
}

/// LoongTrain Tables 3 and 4 (64 GPUs, 128K, hp 8 x cp 8): with GQA head-first placement wins
/// (52.1 vs 56.8 ms per attention: the all-to-all stays on NVLink, the small GQA kv blocks hide
/// behind the ring's compute); with MHA context-first wins (62.2 vs 72.2 ms: the kv blocks are 4x
/// larger and the ring's transfers no longer hide when they cross nodes). Not reproduced
/// (`docs/planner.md`): MHA hp 16 x cp 4 (head-first 3% ahead in the paper, context-first in
/// the model) and MHA hp 2 and 4 (context-first 1.6-1.7x ahead in the paper, head-first a few
/// percent ahead here: the model spreads a node's leaving ring hops over its NICs).
#[test]
fn loongtrain_placement_follows_the_kv_size() {
    let hw = loongtrain_hw();
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
    let hw = Hardware::preset("a800-roce-cluster").unwrap();
    let llama3_8b = ModelShape {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128256,
        tied_embeddings: false,
        moe: None,
        window: None,
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

// ---------------------------------------------------------------------------------------------
// Every published measurement, column by column.
// ---------------------------------------------------------------------------------------------

/// What a paper's column reports.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Quantity {
    /// Milliseconds of one attention forward and backward (lower is better).
    AttentionMs,
    /// Attention forward only, iterations per second (higher is better).
    AttentionFwdPerSec,
    /// End-to-end throughput per GPU: tokens/GPU/s, MFU or TFLOPS/GPU of the same model and
    /// sequence (higher is better).
    Throughput,
}

/// One measured layout of a column: degrees, inner ring (1: none), sequences per step, the
/// paper's number.
#[derive(Debug, Clone, Copy)]
struct Row {
    tp: usize,
    hp: usize,
    cp: usize,
    inner: usize,
    sequences: usize,
    placement: Placement,
    /// The ring's sharding: zigzag (load-balanced) unless a paper's row says otherwise.
    layout: SeqLayout,
    value: f64,
}

const fn row(tp: usize, hp: usize, cp: usize, value: f64) -> Row {
    Row {
        tp,
        hp,
        cp,
        inner: 1,
        sequences: 1,
        placement: Placement::HeadFirst,
        layout: SeqLayout::Zigzag,
        value,
    }
}

/// A row of LoongTrain's `placement` column.
const fn placed(hp: usize, cp: usize, placement: Placement, value: f64) -> Row {
    Row {
        placement,
        ..row(1, hp, cp, value)
    }
}

/// One column of a paper's table: what it ran and what it measured for each layout.
struct Column {
    /// "LoongTrain Table 4, MHA head-first, 128K" and so on.
    name: String,
    hw: Hardware,
    /// GPUs the paper ran the column on.
    world: usize,
    model: ModelShape,
    seq: usize,
    checkpointing: Checkpointing,
    tp_activations: TpActivations,
    quantity: Quantity,
    rows: Vec<Row>,
}

impl Column {
    fn candidate(&self, r: &Row) -> Candidate {
        let strategy = match (r.hp, r.cp, r.inner) {
            (_, _, w) if w > 1 => Strategy::DoubleRing,
            (1, _, _) => Strategy::Ring,
            (_, 1, _) => Strategy::Ulysses,
            _ => Strategy::Usp,
        };
        let mut sp = SpConfig::new(strategy, r.hp, r.cp)
            .with_placement(r.placement)
            .with_layout(r.layout);
        if r.inner > 1 {
            sp = sp.with_inner_ring(r.inner);
        }
        let dp = self.world() / (r.tp * r.hp * r.cp);
        let mesh = MeshConfig::default()
            .with_tp(r.tp)
            .with_ulysses(r.hp)
            .with_ring(r.cp)
            .with_dp(dp)
            .with_placement(r.placement);
        Candidate {
            layout: Layout::new(mesh, sp, self.tp_activations),
            memory: MemoryPlan {
                zero: ZeroStage::OptimizerStates,
                zero_group: None,
                checkpointing: self.checkpointing,
            },
        }
    }

    fn world(&self) -> usize {
        self.world
    }

    /// The planner's time for the column's quantity (seconds of attention, or of a step per
    /// sequence).
    fn predicted(&self, r: &Row) -> f64 {
        let w = Workload {
            sequences: r.sequences,
            ..work(self.model, self.seq)
        };
        let cand = self.candidate(r);
        match self.quantity {
            Quantity::AttentionMs => {
                let t = attention_time(&cand, &w, &self.hw).unwrap();
                t.forward + t.backward
            }
            Quantity::AttentionFwdPerSec => attention_time(&cand, &w, &self.hw).unwrap().forward,
            Quantity::Throughput => {
                predict(&cand, &w, &self.hw).unwrap().time.total / r.sequences as f64
            }
        }
    }

    /// The measured time of a row, in the column's unit (only ratios within a column matter).
    fn measured(&self, r: &Row) -> f64 {
        match self.quantity {
            Quantity::AttentionMs => r.value,
            Quantity::AttentionFwdPerSec | Quantity::Throughput => 1.0 / r.value,
        }
    }

    fn label(r: &Row) -> String {
        let mut s = String::new();
        if r.tp > 1 {
            s += &format!("tp{} ", r.tp);
        }
        s += &format!("hp{} cp{}", r.hp, r.cp);
        if r.inner > 1 {
            s += &format!(" w{}", r.inner);
        }
        if r.sequences > 1 {
            s += &format!(" bs{}", r.sequences);
        }
        if r.placement == Placement::ContextFirst && r.hp > 1 {
            s += " CF";
        }
        s
    }

    /// The planner's pick among the measured rows, its measured time over the best's, and
    /// the best row.
    fn evaluate(&self) -> (usize, f64, usize) {
        let arg = |f: &dyn Fn(&Row) -> f64| {
            (0..self.rows.len())
                .min_by(|&a, &b| f(&self.rows[a]).total_cmp(&f(&self.rows[b])))
                .unwrap()
        };
        let pick = arg(&|r| self.predicted(r));
        let best = arg(&|r| self.measured(r));
        let ratio = self.measured(&self.rows[pick]) / self.measured(&self.rows[best]);
        (pick, ratio, best)
    }
}

const K: usize = 1024;

/// LoongTrain (sec. 6.1): 8 nodes x 8 A100 80 GB (NVLink), 4 HDR 200 Gb/s NICs per node.
fn loongtrain_hw() -> Hardware {
    Hardware::preset("a100-hdr-cluster").unwrap()
}

/// LoongTrain Table 4: ms of one 2D-attention forward and backward on 64 GPUs (d_sp = 64),
/// rows (d_cp, d_hp); columns MHA head-first 128K, 256K, 512K, 1M, MHA context-first (same
/// lengths), GQA head-first, GQA context-first ("Overall" rows).
const LT_T4: [(usize, usize, [f64; 16]); 6] = [
    (
        64,
        1,
        [
            296.4, 597.8, 1210.0, 2897.0, 296.4, 597.8, 1210.0, 2897.0, 86.0, 225.1, 713.5, 2681.0,
            86.0, 225.1, 713.5, 2681.0,
        ],
    ),
    (
        32,
        2,
        [
            273.6, 546.8, 1106.0, 2745.0, 162.4, 328.7, 782.5, 2663.0, 75.4, 198.5, 679.5, 2607.0,
            64.9, 187.1, 683.5, 2589.0,
        ],
    ),
    (
        16,
        4,
        [
            137.0, 275.8, 708.1, 2595.0, 87.4, 213.8, 691.5, 2617.0, 55.4, 172.1, 659.4, 2559.0,
            59.9, 179.1, 668.3, 2543.0,
        ],
    ),
    (
        8,
        8,
        [
            72.2, 187.9, 658.3, 2557.0, 62.2, 185.6, 675.3, 2539.0, 52.1, 166.2, 644.1, 2494.0,
            56.8, 175.2, 656.1, 2495.0,
        ],
    ),
    (
        4,
        16,
        [
            58.4, 179.8, 671.9, 2575.0, 60.1, 182.6, 680.6, 2549.0, 55.8, 173.6, 659.6, 2530.0,
            57.3, 177.2, 661.7, 2510.0,
        ],
    ),
    (
        2,
        32,
        [
            60.8, 186.0, 684.9, 2573.0, 59.4, 183.0, 677.1, 2553.0, 60.8, 185.8, 683.9, 2579.0,
            59.3, 183.1, 677.5, 2555.0,
        ],
    ),
];

/// LoongTrain Table 5: ms of one 2D-attention forward and backward with the double ring and
/// context-first placement on 64 GPUs, rows the inner ring size w (1: the plain ring); columns
/// MHA (cp 64, hp 1) 128K..1M, MHA (cp 16, hp 4), GQA (cp 64, hp 1), GQA (cp 16, hp 4).
const LT_T5: [(usize, [f64; 16]); 4] = [
    (
        1,
        [
            295.9, 597.7, 1214.0, 2913.0, 86.3, 213.8, 697.9, 2621.0, 94.2, 226.7, 713.5, 2668.0,
            60.7, 180.6, 673.3, 2567.0,
        ],
    ),
    (
        2,
        [
            184.5, 401.3, 917.1, 2823.0, 72.6, 205.7, 710.7, 2611.0, 83.2, 218.9, 730.5, 2650.0,
            60.8, 182.6, 671.2, 2530.0,
        ],
    ),
    (
        4,
        [
            140.6, 316.3, 842.7, 2754.0, 69.1, 199.4, 704.4, 2610.0, 78.4, 210.3, 719.7, 2669.0,
            60.3, 182.0, 675.2, 2535.0,
        ],
    ),
    (
        8,
        [
            214.9, 415.1, 869.9, 2815.0, 77.4, 198.7, 705.3, 2621.0, 83.4, 211.6, 723.1, 2674.0,
            61.0, 183.1, 677.4, 2537.0,
        ],
    ),
];

/// LoongTrain Table 3: end-to-end MFU on 64 GPUs (d_sp = 64), rows (d_cp, d_hp); per model the
/// columns 128K with SC++ head-first, with SC++ context-first, without SC++ head-first, without
/// SC++ context-first, then 256K, 512K, 1M alike. (Table 6 gives tokens/GPU/s of the same runs;
/// within a column the ratios are the same.)
const LT_T3_MHA: [(usize, usize, [f64; 16]); 6] = [
    (
        64,
        1,
        [
            0.092, 0.092, 0.070, 0.070, 0.159, 0.159, 0.122, 0.122, 0.290, 0.290, 0.221, 0.221,
            0.452, 0.452, 0.357, 0.357,
        ],
    ),
    (
        32,
        2,
        [
            0.099, 0.158, 0.077, 0.126, 0.173, 0.278, 0.133, 0.219, 0.316, 0.434, 0.243, 0.353,
            0.475, 0.486, 0.394, 0.406,
        ],
    ),
    (
        16,
        4,
        [
            0.176, 0.245, 0.141, 0.205, 0.314, 0.378, 0.248, 0.317, 0.470, 0.472, 0.384, 0.388,
            0.520, 0.509, 0.418, 0.413,
        ],
    ),
    (
        8,
        8,
        [
            0.283, 0.321, 0.236, 0.282, 0.434, 0.420, 0.361, 0.357, 0.502, 0.478, 0.409, 0.394,
            0.527, 0.521, 0.424, 0.420,
        ],
    ),
    (
        4,
        16,
        [
            0.328, 0.327, 0.289, 0.283, 0.436, 0.423, 0.369, 0.359, 0.487, 0.476, 0.399, 0.394,
            0.519, 0.520, 0.418, 0.412,
        ],
    ),
    (
        2,
        32,
        [
            0.320, 0.329, 0.284, 0.293, 0.421, 0.421, 0.353, 0.357, 0.474, 0.478, 0.388, 0.394,
            0.517, 0.517, 0.415, 0.406,
        ],
    ),
];
const LT_T3_GQA: [(usize, usize, [f64; 16]); 6] = [
    (
        64,
        1,
        [
            0.255, 0.255, 0.196, 0.196, 0.379, 0.379, 0.308, 0.308, 0.470, 0.470, 0.378, 0.378,
            0.508, 0.508, 0.406, 0.406,
        ],
    ),
    (
        32,
        2,
        [
            0.283, 0.317, 0.233, 0.269, 0.419, 0.429, 0.345, 0.354, 0.492, 0.485, 0.398, 0.392,
            0.521, 0.516, 0.418, 0.416,
        ],
    ),
    (
        16,
        4,
        [
            0.354, 0.338, 0.309, 0.294, 0.466, 0.437, 0.385, 0.373, 0.505, 0.494, 0.410, 0.404,
            0.531, 0.526, 0.425, 0.426,
        ],
    ),
    (
        8,
        8,
        [
            0.377, 0.354, 0.327, 0.310, 0.480, 0.452, 0.392, 0.380, 0.516, 0.502, 0.419, 0.412,
            0.543, 0.536, 0.435, 0.432,
        ],
    ),
    (
        4,
        16,
        [
            0.354, 0.341, 0.310, 0.308, 0.457, 0.437, 0.377, 0.373, 0.500, 0.493, 0.409, 0.405,
            0.532, 0.529, 0.428, 0.419,
        ],
    ),
    (
        2,
        32,
        [
            0.323, 0.333, 0.285, 0.295, 0.424, 0.422, 0.349, 0.360, 0.476, 0.481, 0.389, 0.394,
            0.518, 0.518, 0.415, 0.406,
        ],
    ),
];

/// LoongTrain Table 2: tokens/GPU/s on 32 GPUs (4 nodes), head-first, ZeRO-1, without SC++,
/// rows HP n / CP m (LoongTrain's own rows; DS-Ulysses and Megatron-CP are other systems);
/// columns MHA 128K..1M, GQA 128K..1M.
const LT_T2: [(usize, usize, [f64; 8]); 6] = [
    (
        32,
        1,
        [285.0, 287.4, 250.4, 121.2, 668.5, 480.0, 282.5, 153.0],
    ),
    (
        16,
        2,
        [311.1, 314.9, 267.3, 151.6, 740.8, 501.3, 290.1, 155.9],
    ),
    (
        8,
        4,
        [548.9, 469.2, 283.6, 154.1, 814.4, 517.4, 295.1, 159.5],
    ),
    (
        4,
        8,
        [752.4, 498.1, 286.1, 154.1, 838.1, 528.1, 299.5, 160.1],
    ),
    (
        2,
        16,
        [714.3, 472.4, 278.9, 150.9, 771.4, 498.6, 288.0, 155.1],
    ),
    (
        1,
        32,
        [700.1, 459.3, 268.8, 146.0, 717.1, 468.4, 262.4, 147.5],
    ),
];

const LENGTHS: [(usize, &str); 4] = [
    (128 * K, "128K"),
    (256 * K, "256K"),
    (512 * K, "512K"),
    (1024 * K, "1M"),
];

fn llama3_8b() -> ModelShape {
    ModelShape {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128256,
        tied_embeddings: false,
        moe: None,
        window: None,
    }
}

fn loongtrain_columns() -> Vec<Column> {
    let mut out = Vec::new();
    let models = [("MHA", llama7b(32)), ("GQA", llama7b(8))];
    let placements = [
        ("head-first", Placement::HeadFirst),
        ("context-first", Placement::ContextFirst),
    ];
    let column = |name: String, world, model, seq, ckpt, quantity, rows| Column {
        name,
        hw: loongtrain_hw(),
        world,
        model,
        seq,
        checkpointing: ckpt,
        tp_activations: TpActivations::Replicated,
        quantity,
        rows,
    };
    // Table 2.
    for (mi, (mname, model)) in models.iter().enumerate() {
        for (li, (seq, lname)) in LENGTHS.iter().enumerate() {
            let rows = LT_T2
                .iter()
                .map(|&(cp, hp, v)| row(1, hp, cp, v[mi * 4 + li]))
                .collect();
            out.push(column(
                format!("LoongTrain T2 {mname} {lname}"),
                32,
                *model,
                *seq,
                Checkpointing::Full,
                Quantity::Throughput,
                rows,
            ));
        }
    }
    // Table 3.
    for (mname, model, table) in [
        ("MHA", llama7b(32), &LT_T3_MHA),
        ("GQA", llama7b(8), &LT_T3_GQA),
    ] {
        for (li, (seq, lname)) in LENGTHS.iter().enumerate() {
            for (si, (sname, ckpt)) in [
                ("SC++", Checkpointing::Selective),
                ("no SC++", Checkpointing::Full),
            ]
            .into_iter()
            .enumerate()
            {
                let mut both = Vec::new();
                for (pi, (pname, placement)) in placements.iter().enumerate() {
                    let rows: Vec<Row> = table
                        .iter()
                        .map(|&(cp, hp, v)| placed(hp, cp, *placement, v[li * 4 + si * 2 + pi]))
                        .collect();
                    both.extend(rows.iter().filter(|r| pi == 0 || r.hp > 1).copied());
                    out.push(column(
                        format!("LoongTrain T3 {mname} {lname} {sname} {pname}"),
                        64,
                        model,
                        *seq,
                        ckpt,
                        Quantity::Throughput,
                        rows,
                    ));
                }
                out.push(column(
                    format!("LoongTrain T3 {mname} {lname} {sname} both placements"),
                    64,
                    model,
                    *seq,
                    ckpt,
                    Quantity::Throughput,
                    both,
                ));
            }
        }
    }
    // Table 4.
    for (mi, (mname, model)) in models.iter().enumerate() {
        for (pi, (pname, placement)) in placements.iter().enumerate() {
            for (li, (seq, lname)) in LENGTHS.iter().enumerate() {
                let rows = LT_T4
                    .iter()
                    .map(|&(cp, hp, v)| placed(hp, cp, *placement, v[mi * 8 + pi * 4 + li]))
                    .collect();
                out.push(column(
                    format!("LoongTrain T4 {mname} {pname} {lname}"),
                    64,
                    *model,
                    *seq,
                    Checkpointing::Full,
                    Quantity::AttentionMs,
                    rows,
                ));
            }
        }
    }
    // Table 5.
    for (mi, (mname, model)) in models.iter().enumerate() {
        for (gi, (cp, hp)) in [(64, 1), (16, 4)].into_iter().enumerate() {
            for (li, (seq, lname)) in LENGTHS.iter().enumerate() {
                let rows = LT_T5
                    .iter()
                    .map(|&(w, v)| Row {
                        inner: w,
                        ..placed(hp, cp, Placement::ContextFirst, v[mi * 8 + gi * 4 + li])
                    })
                    .collect();
                out.push(column(
                    format!("LoongTrain T5 {mname} cp{cp} hp{hp} {lname}"),
                    64,
                    *model,
                    *seq,
                    Checkpointing::Full,
                    Quantity::AttentionMs,
                    rows,
                ));
            }
        }
    }
    // Tables 4 and 5 together: every attention layout of d_sp = 64 the paper measured (both
    // placements, the double rings; Table 5's w = 1 rows repeat Table 4's).
    for (mi, (mname, model)) in models.iter().enumerate() {
        for (li, (seq, lname)) in LENGTHS.iter().enumerate() {
            let mut rows = Vec::new();
            for (pi, (_, placement)) in placements.iter().enumerate() {
                for &(cp, hp, v) in LT_T4.iter() {
                    if pi == 0 || hp > 1 {
                        rows.push(placed(hp, cp, *placement, v[mi * 8 + pi * 4 + li]));
                    }
                }
            }
            for (gi, (cp, hp)) in [(64, 1), (16, 4)].into_iter().enumerate() {
                for &(w, v) in LT_T5.iter().filter(|(w, _)| *w > 1) {
                    rows.push(Row {
                        inner: w,
                        ..placed(hp, cp, Placement::ContextFirst, v[mi * 8 + gi * 4 + li])
                    });
                }
            }
            out.push(column(
                format!("LoongTrain T4+T5 {mname} {lname} every layout"),
                64,
                *model,
                *seq,
                Checkpointing::Full,
                Quantity::AttentionMs,
                rows,
            ));
        }
    }
    out
}

/// USP (sec. 5): Tables 3 and 4 (attention forward, iterations/s, the load-balanced ring and
/// the basic ring: contiguous, whose causal imbalance the planner models), Tables 5 to 7
/// (end-to-end TFLOPS per GPU, Megatron-LM with TP-sp and ZeRO-1).
fn usp_columns() -> Vec<Column> {
    let mut out = Vec::new();
    let column = |name: &str, hw: &str, world, model, seq, tpa, quantity, rows| Column {
        name: format!("USP {name}"),
        hw: Hardware::preset(hw).unwrap(),
        world,
        model,
        seq,
        checkpointing: Checkpointing::None,
        tp_activations: tpa,
        quantity,
        rows,
    };
    let ring8 = |v: [f64; 4]| {
        [8, 4, 2, 1]
            .iter()
            .zip(v)
            .map(|(&u, x)| row(1, u, 8 / u, x))
            .collect::<Vec<_>>()
    };
    let basic8 = |v: [f64; 4]| {
        ring8(v)
            .into_iter()
            .map(|r| Row {
                layout: SeqLayout::Contiguous,
                ..r
            })
            .collect::<Vec<_>>()
    };
    let rep = TpActivations::Replicated;
    let fwd = Quantity::AttentionFwdPerSec;
    // Table 3: 8 x A100-SXM4 (NVLink), LLaMA3-8B's attention (32 heads, 8 kv heads of 128),
    // rows ulysses 8, 4, 2, 1 (ring 8 / ulysses), lb-ring column.
    out.push(column(
        "T3 A100 32K lb-ring",
        "a100-hdr-cluster",
        8,
        llama3_8b(),
        32 * K,
        rep,
        fwd,
        ring8([136.375, 132.979, 132.979, 113.79]),
    ));
    out.push(column(
        "T3 A100 128K lb-ring",
        "a100-hdr-cluster",
        8,
        llama3_8b(),
        128 * K,
        rep,
        fwd,
        ring8([2.785, 2.771, 2.89, 2.91]),
    ));
    // The basic-ring columns (contiguous; ulysses 8 has no ring).
    out.push(column(
        "T3 A100 32K basic-ring",
        "a100-hdr-cluster",
        8,
        llama3_8b(),
        32 * K,
        rep,
        fwd,
        basic8([135.569, 103.525, 91.365, 81.985]),
    ));
    out.push(column(
        "T3 A100 128K basic-ring",
        "a100-hdr-cluster",
        8,
        llama3_8b(),
        128 * K,
        rep,
        fwd,
        basic8([2.782, 2.024, 1.73, 1.628]),
    ));
    // Table 4: 8 x L20 (PCIe).
    out.push(column(
        "T4 L20 8K lb-ring",
        "l20-pcie-node",
        8,
        llama3_8b(),
        8 * K,
        rep,
        fwd,
        ring8([57.098, 152.189, 454.93, 361.969]),
    ));
    out.push(column(
        "T4 L20 32K lb-ring",
        "l20-pcie-node",
        8,
        llama3_8b(),
        32 * K,
        rep,
        fwd,
        ring8([14.262, 32.818, 62.754, 58.377]),
    ));
    out.push(column(
        "T4 L20 128K lb-ring",
        "l20-pcie-node",
        8,
        llama3_8b(),
        128 * K,
        rep,
        fwd,
        ring8([2.586, 4.235, 5.476, 5.186]),
    ));
    for (seq, v) in [
        (8, [57.346, 153.134, 415.5, 358.595]),
        (32, [15.229, 28.584, 44.348, 40.478]),
        (128, [2.563, 3.217, 3.399, 3.131]),
    ] {
        out.push(column(
            &format!("T4 L20 {seq}K basic-ring"),
            "l20-pcie-node",
            8,
            llama3_8b(),
            seq * K,
            rep,
            fwd,
            basic8(v),
        ));
    }
    let sh = TpActivations::SequenceSharded;
    let thr = Quantity::Throughput;
    let bs = |r: Row, n: usize| Row { sequences: n, ..r };
    // Table 5: one node of 8 A800, LLaMA2-7B, rows (tp, ulysses, ring).
    out.push(column(
        "T5 A800 LLaMA2-7B 64K",
        "a800-roce-cluster",
        8,
        llama7b(32),
        64 * K,
        sh,
        thr,
        vec![
            row(4, 2, 1, 260.2),
            row(4, 1, 2, 255.0),
            row(8, 1, 1, 238.9),
        ],
    ));
    out.push(column(
        "T5 A800 LLaMA2-7B 30K bs16",
        "a800-roce-cluster",
        8,
        llama7b(32),
        30 * K,
        sh,
        thr,
        vec![
            bs(row(2, 4, 1, 239.2), 16),
            bs(row(2, 1, 4, 226.6), 16),
            bs(row(4, 1, 1, 230.1), 16),
            bs(row(1, 8, 1, 250.6), 16),
            bs(row(1, 1, 8, 218.0), 16),
            bs(row(8, 1, 1, 198.0), 16),
        ],
    ));
    // Table 6: two nodes of 8 A800, LLaMA3-8B.
    let t6 = |v: [f64; 11]| {
        let shape = [
            (1, 8, 2),
            (1, 4, 4),
            (1, 2, 8),
            (1, 1, 16),
            (8, 1, 2),
            (4, 2, 2),
            (2, 4, 2),
            (2, 2, 4),
            (4, 1, 4),
            (2, 1, 8),
        ];
        let mut rows: Vec<Row> = shape
            .iter()
            .zip(v)
            .map(|(&(t, u, r), x)| row(t, u, r, x))
            .collect();
        rows.push(bs(row(8, 1, 1, v[10]), 2));
        rows
    };
    out.push(column(
        "T6 A800 LLaMA3-8B 64K",
        "a800-roce-cluster",
        16,
        llama3_8b(),
        64 * K,
        sh,
        thr,
        t6([
            220.3, 222.2, 209.2, 196.9, 209.7, 197.9, 141.7, 144.4, 198.1, 163.8, 228.2,
        ]),
    ));
    out.push(column(
        "T6 A800 LLaMA3-8B 80K",
        "a800-roce-cluster",
        16,
        llama3_8b(),
        80 * K,
        sh,
        thr,
        t6([
            245.4, 247.8, 233.2, 221.1, 226.6, 228.8, 184.8, 184.4, 216.8, 201.6, 240.3,
        ]),
    ));
    out.push(column(
        "T6 A800 LLaMA3-8B 120K",
        "a800-roce-cluster",
        16,
        llama3_8b(),
        120 * K,
        sh,
        thr,
        vec![
            row(4, 2, 2, 266.0),
            row(2, 4, 2, 238.3),
            row(8, 1, 2, 254.5),
            row(4, 1, 4, 263.3),
        ],
    ));
    // Table 7: the 160K rows.
    out.push(column(
        "T7 A800 LLaMA3-8B 160K",
        "a800-roce-cluster",
        16,
        llama3_8b(),
        160 * K,
        sh,
        thr,
        vec![
            row(4, 2, 2, 284.5),
            row(8, 1, 2, 280.9),
            row(4, 1, 4, 285.8),
        ],
    ));
    out
}

/// Columns whose pick is more than 10% slower than the column's best, with the ratio the
/// paper's numbers give for it (none of the first 107 since the NIC, merge and last-hop terms;
/// before them 12 of 107 missed, `docs/planner.md`). USP Table 4's basic-ring columns (8 L20 on
/// PCIe), added with the contiguous ring's imbalance: the planner picks Ulysses 8, which no
/// ring imbalance slows, where the paper measures it 7.2x, 2.9x and 1.3x slower than ulysses 2
/// x basic ring 4 at 8K, 32K and 128K. Its all-to-all over PCIe is far too fast: the
/// load-balanced columns' Ulysses 8 rows are 8.0x, 4.4x and 2.1x slower than their best, which
/// the planner ranks right only because the balanced ring wins there by a margin; the preset
/// gives every GPU PCIe 4.0's 25.6 GB/s to any peer, while the paper's all-to-all crosses the
/// host bridges (the node's PCIe topology is not modelled).
const MISSES: &[(&str, f64)] = &[
    ("USP T4 L20 8K basic-ring", 7.245),
    ("USP T4 L20 32K basic-ring", 2.912),
    ("USP T4 L20 128K basic-ring", 1.326),
];

/// Every column of LoongTrain's Tables 2 to 5 (each placement, and Tables 3, 4 and 5 with the
/// placements and double rings together) and of USP's Tables 3 to 7: the planner ranks the
/// layouts the paper measured, and its pick's measured time must be within 10% of the
/// column's best (or be a listed miss at its recorded ratio), in at least 80% of the columns.
/// StarTrail and WallFacer give their times only in figures (not in the text): no column.
#[test]
fn the_pick_is_within_ten_percent_of_the_measured_best() {
    let mut cols = loongtrain_columns();
    cols.extend(usp_columns());
    assert_eq!(cols.len(), 112);
    let (mut within, mut open) = (0, 0);
    let mut failures = Vec::new();
    for c in &cols {
        let (pick, ratio, best) = c.evaluate();
        // A column where some measured row is more than 10% off the best: a pick can miss.
        let discriminating = c
            .rows
            .iter()
            .any(|r| c.measured(r) > 1.10 * c.measured(&c.rows[best]));
        open += discriminating as usize;
        within += (ratio <= 1.10) as usize;
        eprintln!(
            "| {} | {} | {} | {} | {} | {:.3} |",
            c.name,
            Column::label(&c.rows[pick]),
            c.rows[pick].value,
            Column::label(&c.rows[best]),
            c.rows[best].value,
            ratio
        );
        let ok = match MISSES.iter().find(|(name, _)| *name == c.name) {
            Some(&(_, recorded)) => (ratio - recorded).abs() < 5e-4,
            None => ratio <= 1.10,
        };
        if !ok {
            failures.push(format!(
                "{}: pick {} at {ratio:.3}x the best {}",
                c.name,
                Column::label(&c.rows[pick]),
                Column::label(&c.rows[best])
            ));
        }
    }
    let share = within as f64 / cols.len() as f64;
    eprintln!(
        "within 10% of the best: {within} of {} columns ({:.0}%); {open} columns have a row more than 10% off",
        cols.len(),
        share * 100.0
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(share >= 0.8, "{share}");
}

/// LoongTrain Table 4's SeqAlltoAll rows (ms, forward and backward) with context-first
/// placement and hp 2, 4, 8, where every peer of the all-to-all is on another node: the model's
/// all-to-all over the node's NICs (4 HDR 200 per 8 GPUs: a GPU's share 10 GB/s) against the
/// measurement, MHA and GQA, 128K to 1M. Columns 128K, 256K, 512K, 1M.
#[test]
fn cross_node_all_to_all_matches_loongtrain_table_4() {
    use candle_parallel::planner::traffic::{attention_traffic, AttnShape};
    const SEQ_ALL_TO_ALL_CF: [(usize, usize, [f64; 4]); 6] = [
        (32, 2, [7.19, 13.27, 25.10, 49.26]),
        (32, 4, [10.31, 19.25, 37.37, 73.74]),
        (32, 8, [12.05, 22.26, 42.82, 83.30]),
        (8, 2, [4.92, 8.65, 16.29, 31.59]),
        (8, 4, [6.90, 12.55, 23.82, 46.87]),
        (8, 8, [8.13, 14.60, 27.51, 53.35]),
    ];
    let hw = loongtrain_hw();
    let mut worst: f64 = 1.0;
    for (kv, hp, ms) in SEQ_ALL_TO_ALL_CF {
        let cp = 64 / hp;
        let mesh = MeshConfig::default()
            .with_ulysses(hp)
            .with_ring(cp)
            .with_placement(Placement::ContextFirst);
        let layout = candle_parallel::mesh::MeshLayout::new(&mesh, 64).unwrap();
        let stride = layout.stride(candle_parallel::mesh::Dim::Ulysses);
        for ((seq, name), measured) in LENGTHS.iter().zip(ms) {
            let shape = AttnShape {
                batch: 1,
                seq: *seq,
                heads: 32,
                kv_heads: kv,
                head_dim: 128,
                elem_bytes: 2,
                with_lse: false,
            };
            let t = attention_traffic(&SpConfig::new(Strategy::Usp, hp, cp), &shape).unwrap();
            let messages = 4.0 * (hp as f64 - 1.0);
            let model = 1e3
                * (hw.all_to_all_time(stride, hp, t.forward.all_to_all as f64, messages)
                    + hw.all_to_all_time(stride, hp, t.backward.all_to_all as f64, messages));
            let ratio = model / measured;
            eprintln!(
                "kv {kv} hp {hp} {name}: model {model:.2} ms, measured {measured} ms ({ratio:.2})"
            );
            worst = testkit::max_or_nan(testkit::max_or_nan(worst, ratio), 1.0 / ratio);
        }
    }
    assert!(worst < 1.2, "worst ratio {worst}");
}
