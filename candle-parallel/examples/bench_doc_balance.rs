//! Attention work balance of packed documents: the window's zigzag against the per-document
//! zigzag (`SeqLayout::DocZigzag`), for ring 4, USP 2x2 and double ring (w = 2 on 4). Not a
//! test.
//!
//! ```text
//! cargo run --release -p candle-parallel --example bench_doc_balance -- \
//!     --tokens TOKENS.json [--seq 16384] [--windows 0,3] [--heads 4] [--kv-heads 2] [--head-dim 32]
//! ```
//!
//! `TOKENS.json` is a corpus as `cpl data prepare` writes it (one token array per document, in
//! stream order; only the lengths are read); the windows are
//! those `cpl train --doc-mask` packs: consecutive `--seq` tokens of the concatenated
//! documents, window `i` starting at token `i · seq`. Prints, for every window, the exact
//! causal work balance (busiest ring rank's query-key pairs over the mean) of both layouts;
//! then for the `--windows` chosen (default: the one where zigzag is worst), runs attention
//! forward + backward under each strategy and layout on local ranks with the block kernels
//! serialised (each rank's kernel time is then its own compute, uncontended) and prints per
//! rank the scores flash-ring's kernels computed (`flash_ring::work`, what `metrics.jsonl`'s
//! `attention_scores` counts) and the kernel seconds, with their max/mean.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::block::{
    set_kernel_scheduling, take_block_compute_time, KernelScheduling,
};
use candle_parallel::attention::doc_layout::{max_over_mean, ring_work};
use candle_parallel::attention::{
    take_attention_scores, AttnCall, AttnMask, SeqLayout, SequenceParallelAttention, ShardPlan,
    SpAttention, SpConfig, Strategy,
};
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::DeviceMesh;

struct Args {
    seq: usize,
    lens: Vec<usize>,
    windows: Option<Vec<usize>>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seq: 16384,
        lens: Vec::new(),
        windows: None,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
    };
    let mut it = std::env::args().skip(1);
    let num = |s: &str| s.trim().parse::<usize>().map_err(|e| format!("{s:?}: {e}"));
    while let Some(flag) = it.next() {
        let val = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--seq" => a.seq = num(&val)?,
            "--heads" => a.heads = num(&val)?,
            "--kv-heads" => a.kv_heads = num(&val)?,
            "--head-dim" => a.head_dim = num(&val)?,
            "--windows" => {
                a.windows = Some(val.split(',').map(num).collect::<Result<_, _>>()?);
            }
            "--tokens" => {
                let text = std::fs::read_to_string(&val).map_err(|e| format!("{val}: {e}"))?;
                let docs: Vec<Vec<u32>> =
                    serde_json::from_str(&text).map_err(|e| format!("{val}: {e}"))?;
                a.lens = docs.iter().map(Vec::len).collect();
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.lens.is_empty() {
        return Err("--tokens FILE (a corpus of `cpl data prepare`) is required".into());
    }
    Ok(a)
}

/// The document ids of window `w` of the packed stream.
fn window_ids(lens: &[usize], seq: usize, w: usize) -> Vec<u32> {
    let ids = lens
        .iter()
        .enumerate()
        .flat_map(|(d, &l)| std::iter::repeat_n(d as u32, l));
    ids.skip(w * seq).take(seq).collect()
}

/// The configurations of the table: (name, config) for `layout`.
fn configs(layout: SeqLayout) -> Vec<(&'static str, SpConfig)> {
    vec![
        ("ring 4", SpConfig::new(Strategy::Ring, 1, 4)),
        ("usp 2x2", SpConfig::new(Strategy::Usp, 2, 2)),
        (
            "double ring w2 on 4",
            SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(2),
        ),
    ]
    .into_iter()
    .map(|(n, c)| (n, c.with_layout(layout)))
    .collect()
}

/// Per rank: (scores counted by the kernels, kernel seconds).
fn run(a: &Args, cfg: &SpConfig, mask: &AttnMask, x: &[Tensor; 4]) -> Vec<(u64, f64)> {
    let [q, k, v, g] = x;
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    LocalWorld::run(
        cfg.degree(),
        |comm| -> candle_parallel::Result<(u64, f64)> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), comm.clone())?;
            let sp = SpAttention::new(cfg, &mesh)?;
            let shard = |t: &Tensor| sp.shard_for(t, 1, mask);
            let (ql, kl, vl) = (
                Var::from_tensor(&shard(q)?)?,
                Var::from_tensor(&shard(k)?)?,
                Var::from_tensor(&shard(v)?)?,
            );
            let gl = shard(g)?;
            comm.barrier()?;
            take_attention_scores();
            take_block_compute_time();
            let out = sp.attention(&ql, &kl, &vl, &AttnCall::new(mask.clone(), scale))?;
            (&out * &gl)?.sum_all()?.backward()?;
            Ok((
                take_attention_scores(),
                take_block_compute_time().as_secs_f64(),
            ))
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", cfg.strategy))
}

fn ratio(xs: &[f64]) -> f64 {
    let max = xs.iter().copied().fold(0.0, f64::max);
    let sum: f64 = xs.iter().sum();
    if sum > 0.0 {
        max * xs.len() as f64 / sum
    } else {
        1.0
    }
}

fn main() {
    let a = parse_args().unwrap_or_else(|e| {
        eprintln!("bench_doc_balance: {e}");
        std::process::exit(2);
    });
    let total: usize = a.lens.iter().sum();
    let n = total / a.seq;
    println!(
        "{} documents, {total} tokens: {n} windows of {} tokens\n",
        a.lens.len(),
        a.seq
    );
    println!("| window | documents | ring | zigzag max/mean | doc-zigzag max/mean |");
    println!("|---|---|---|---|---|");
    let mut worst = (0, 0.0);
    for w in 0..n {
        let ids = window_ids(&a.lens, a.seq, w);
        let docs = 1 + ids.windows(2).filter(|p| p[0] != p[1]).count();
        let mask = AttnMask::documents(ids.clone());
        for ring in [2, 4] {
            let b = |l| {
                let plan = ShardPlan::for_mask(a.seq, l, ring, 1, &mask).expect("plan");
                max_over_mean(&ring_work(&plan, Some(&ids)).expect("work"))
            };
            let (z, d) = (b(SeqLayout::Zigzag), b(SeqLayout::DocZigzag));
            if ring == 4 && z > worst.1 {
                worst = (w, z);
            }
            println!("| {w} | {docs} | {ring} | {z:.3} | {d:.3} |");
        }
    }
    let windows = a.windows.clone().unwrap_or(vec![worst.0]);
    let dev = Device::Cpu;
    let rand = |h: usize| {
        Tensor::randn(0f32, 1.0, (1, a.seq, h, a.head_dim), &dev)
            .and_then(|t| t.to_dtype(DType::F32))
            .expect("random input")
    };
    let x = [
        rand(a.heads),
        rand(a.kv_heads),
        rand(a.kv_heads),
        rand(a.heads),
    ];
    set_kernel_scheduling(KernelScheduling::Serialized);
    println!(
        "\n| window | strategy | layout | scores per rank (M) | scores max/mean | kernel s per \
         rank | time max/mean | slowest rank s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for w in windows {
        let mask = AttnMask::documents(window_ids(&a.lens, a.seq, w));
        for layout in [SeqLayout::Zigzag, SeqLayout::DocZigzag] {
            for (name, cfg) in configs(layout) {
                let t0 = Instant::now();
                let per_rank = run(&a, &cfg, &mask, &x);
                let scores: Vec<f64> = per_rank.iter().map(|r| r.0 as f64).collect();
                let secs: Vec<f64> = per_rank.iter().map(|r| r.1).collect();
                let list = |xs: &[f64], f: &dyn Fn(f64) -> String| {
                    xs.iter().map(|&v| f(v)).collect::<Vec<_>>().join(" / ")
                };
                println!(
                    "| {w} | {name} | {layout} | {} | {:.3} | {} | {:.3} | {:.2} |",
                    list(&scores, &|v| format!("{:.0}", v / 1e6)),
                    ratio(&scores),
                    list(&secs, &|v| format!("{v:.2}")),
                    ratio(&secs),
                    secs.iter().copied().fold(0.0, f64::max),
                );
                eprintln!("window {w} {name} {layout}: {:?}", t0.elapsed());
            }
        }
    }
}
