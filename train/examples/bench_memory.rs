//! Peak memory of one training step under each parallel layout and memory plan, and the
//! longest sequence each fits in a memory budget.
//!
//! Model: the benchmark LLaMA of `docs/benchmarks.md` (4 layers, hidden 512, 8 heads,
//! intermediate 1536, vocab 32000; random weights written once to
//! `target/bench/llama-4l-512-rs/`), f32. One training step (forward, backward, AdamW) of one
//! sequence of `S` tokens on local ranks (threads of this process).
//!
//! Memory is counted by this program's global allocator (mimalloc, as in `cpl`, wrapped in a
//! counter): the bytes allocated and not freed.
//! "state" is what the ranks hold before the step (weights, optimizer state, data), "step peak"
//! the largest total during the step; both summed over the ranks of the process. The longest
//! sequence that fits `--budget-gib` is extrapolated from the two largest measured lengths
//! (peak memory is linear in `S` once attention never forms `S x S` scores), and the fit is
//! checked against the smallest measured length.
//!
//! ```text
//! cargo run --release -p cpl-train --example bench_memory -- [--seqs 2048,4096,8192]
//!     [--layouts single,ring4,...] [--plans none,selective,full,zero3-full] [--budget-gib 16]
//!     [--loss-chunk 1024]
//! ```
//!
//! `--loss-chunk` is `cpl train --loss-chunk`: the tokens per chunk of the vocab-parallel loss,
//! whose logit-sized temporaries are a fixed cost per rank (with 4 ranks at the default 1024,
//! about 1.5 GiB of the process, more than the activations of a 8K-token sequence).

use std::time::Instant;

use candle_core::DType;
use candle_parallel::attention::{SpConfig, Strategy};
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::{DeviceMesh, MeshConfig};
use candle_parallel::nn::{ParallelCtx, ParamMode, TpActivations};
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use models::llama;
use train::data::{PackedDataset, Packing, TokenStream};
use train::memory::CountingAlloc;
use train::trainer::{TrainConfig, Trainer};

/// Counts the bytes of mimalloc (the allocator of `cpl`).
#[global_allocator]
static ALLOC: CountingAlloc<mimalloc::MiMalloc> = CountingAlloc::new(mimalloc::MiMalloc);

const VOCAB: usize = 32000;

#[derive(Clone)]
struct Layout {
    name: &'static str,
    ranks: usize,
    mesh: MeshConfig,
    sp: SpConfig,
}

fn layout(name: &'static str, tp: usize, u: usize, r: usize, s: Strategy) -> Layout {
    Layout {
        name,
        ranks: tp * u * r,
        mesh: MeshConfig::default()
            .with_tp(tp)
            .with_ulysses(u)
            .with_ring(r),
        sp: SpConfig::new(s, u, r),
    }
}

fn layouts() -> Vec<Layout> {
    let mut dr = layout("double-ring w2 (ring4)", 1, 1, 4, Strategy::DoubleRing);
    dr.sp = dr.sp.with_inner_ring(2);
    let mut st = layout("startrail C2 (ring4)", 1, 1, 4, Strategy::StarTrail);
    st.sp = st.sp.with_team(2);
    vec![
        layout("single", 1, 1, 1, Strategy::Ring),
        layout("ring4 zigzag", 1, 1, 4, Strategy::Ring),
        layout("ulysses4", 1, 4, 1, Strategy::Ulysses),
        layout("usp 2x2", 1, 2, 2, Strategy::Usp),
        dr,
        st,
        layout("all-gather cp4", 1, 1, 4, Strategy::AllGather),
        layout("tp4", 4, 1, 1, Strategy::Ring),
        layout("tp2 x ring2", 2, 1, 2, Strategy::Ring),
    ]
}

#[derive(Clone, Copy)]
struct Plan {
    name: &'static str,
    zero: ZeroStage,
    ckpt: Checkpointing,
}

fn plans() -> Vec<Plan> {
    vec![
        Plan {
            name: "none",
            zero: ZeroStage::Off,
            ckpt: Checkpointing::None,
        },
        Plan {
            name: "selective",
            zero: ZeroStage::Off,
            ckpt: Checkpointing::Selective,
        },
        Plan {
            name: "full",
            zero: ZeroStage::Off,
            ckpt: Checkpointing::Full,
        },
        Plan {
            name: "zero3-full",
            zero: ZeroStage::Parameters,
            ckpt: Checkpointing::Full,
        },
    ]
}

fn model_dir() -> Result<std::path::PathBuf, String> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/bench/llama-4l-512-rs");
    if !dir.join("model.safetensors").is_file() {
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": VOCAB,
            "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "torch_dtype": "float32"
        });
        llama::write_random_checkpoint(&dir, &config, 1)
            .map_err(|e| format!("writing the benchmark model to {}: {e}", dir.display()))?;
    }
    Ok(dir)
}

struct Measured {
    state: isize,
    peak: isize,
    seconds: f64,
}

fn measure(l: &Layout, plan: Plan, seq: usize, loss_chunk: usize) -> Result<Measured, String> {
    let files = models::hub::from_dir("bench", &model_dir()?).map_err(|e| e.to_string())?;
    let ids: Vec<u32> = (0..seq + 1)
        .map(|i| ((i as u64 * 2_654_435_761) % VOCAB as u64) as u32)
        .collect();
    let data = PackedDataset::new(
        TokenStream::from_sequences(&[ids], VOCAB).map_err(|e| e.to_string())?,
        seq,
        Packing::Continuous,
    )
    .map_err(|e| e.to_string())?;
    let cfg = TrainConfig::constant_lr(
        seq,
        1,
        1e-4,
        loss_chunk,
        MemoryPlan {
            zero: plan.zero,
            zero_group: None,
            checkpointing: plan.ckpt,
        },
    );
    let out = LocalWorld::run(l.ranks, |world| -> Result<Measured, String> {
        let e = |x: &dyn std::fmt::Display| x.to_string();
        let mesh = DeviceMesh::new(&l.mesh, world.clone()).map_err(|x| e(&x))?;
        let ctx = ParallelCtx::new(&mesh, &l.sp, TpActivations::Replicated).map_err(|x| e(&x))?;
        let model = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Trainable)
            .map_err(|x| e(&x))?
            .model;
        let mut t = Trainer::new(model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        world.barrier().map_err(|x| e(&x))?;
        let state = ALLOC.current();
        if world.rank() == 0 {
            ALLOC.reset_peak(state);
        }
        world.barrier().map_err(|x| e(&x))?;
        let t0 = Instant::now();
        t.step(&data).map_err(|x| e(&x))?;
        world.barrier().map_err(|x| e(&x))?;
        Ok(Measured {
            state,
            peak: ALLOC.peak(),
            seconds: t0.elapsed().as_secs_f64(),
        })
    })
    .map_err(|e| e.to_string())?;
    out.into_iter()
        .next()
        .ok_or_else(|| "no rank ran".to_string())
}

fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(|s| s.as_str())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_memory: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seqs = arg(&args, "--seqs")
        .unwrap_or("2048,4096,8192")
        .split(',')
        .map(|s| match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("--seqs: {s:?} is not a positive whole number")),
        })
        .collect::<Result<Vec<usize>, String>>()?;
    let budget_gib: f64 = arg(&args, "--budget-gib")
        .unwrap_or("16")
        .parse()
        .map_err(|_| "--budget-gib: not a number".to_string())?;
    let loss_chunk = match arg(&args, "--loss-chunk")
        .unwrap_or("1024")
        .parse::<usize>()
    {
        Ok(n) if n > 0 => n,
        _ => return Err("--loss-chunk: not a positive whole number".into()),
    };
    let only_layouts: Option<Vec<&str>> = arg(&args, "--layouts").map(|s| s.split(',').collect());
    let only_plans: Option<Vec<&str>> = arg(&args, "--plans").map(|s| s.split(',').collect());
    model_dir()?;
    let mib = |b: isize| b as f64 / (1 << 20) as f64;
    println!(
        "| layout | plan | state MiB | {} | fit check | longest S in {budget_gib} GiB |",
        seqs.iter()
            .map(|s| format!("S={s}: step peak MiB (s)"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|{}", "---|".repeat(5 + seqs.len()));
    for l in layouts() {
        if only_layouts
            .as_ref()
            .is_some_and(|o| !o.iter().any(|n| l.name.starts_with(n)))
        {
            continue;
        }
        for plan in plans() {
            if only_plans.as_ref().is_some_and(|o| !o.contains(&plan.name)) {
                continue;
            }
            let mut points = Vec::new();
            let mut cells = Vec::new();
            let mut state = 0;
            for &s in &seqs {
                match measure(&l, plan, s, loss_chunk) {
                    Ok(m) => {
                        state = m.state;
                        cells.push(format!("{:.0} ({:.1})", mib(m.peak), m.seconds));
                        points.push((s as f64, m.peak as f64));
                    }
                    Err(e) => cells.push(format!("error: {e}")),
                }
            }
            let (fit, longest) = if points.len() >= 2 {
                let n = points.len();
                let ((s1, p1), (s2, p2)) = (points[n - 2], points[n - 1]);
                let b = (p2 - p1) / (s2 - s1);
                let a = p2 - b * s2;
                let check = if n >= 3 {
                    let (s0, p0) = points[0];
                    format!("{:+.1}% at S={s0}", 100.0 * ((a + b * s0) - p0) / p0)
                } else {
                    "-".into()
                };
                let budget = budget_gib * (1u64 << 30) as f64;
                let longest = ((budget - a) / b / 1024.0).floor() * 1024.0;
                (check, format!("{:.0}K", longest / 1024.0))
            } else {
                ("-".into(), "-".into())
            };
            println!(
                "| {} | {} | {:.0} | {} | {fit} | {longest} |",
                l.name,
                plan.name,
                mib(state),
                cells.join(" | ")
            );
        }
    }
    Ok(())
}
