//! `cpl bench train`: training throughput of a causal LM of any family (the registry's) under
//! any layout and memory plan.
//!
//! Each step trains --grad-accum sequences of --seq-len random tokens per data-parallel rank (forward,
//! backward, clipping to norm 1, AdamW at lr 1e-4, as `scripts/bench_train.py` does in
//! PyTorch) through the library's `Trainer`, the same step `cpl train` takes. The first step is
//! a warm-up; tokens/s are the best and the median of the others (the slowest rank's time of
//! each step). Also: the peak resident memory and the model FLOPs utilisation (the family's
//! `Description::flops_per_token` x tokens/s over the peak `cpl train` uses: `--peak-tflops`,
//! or the device's matmul rate in the model's dtype, bf16 on tensor cores on a GPU). With
//! `--device cuda`, each step's time ends with the GPU synchronised.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::ReduceOp;
use candle_parallel::nn::ParamMode;
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use serde_json::json;
use train::data::{PackedDataset, Packing, TokenStream};
use train::trainer::{TrainConfig, Trainer};

use super::{at_least_one, random_tokens, LmBenchArgs, Throughput, Work};
use crate::launch::launch;
use train::driver::progress::peak_rss_mib;

#[derive(clap::Args, Debug, Clone)]
pub struct TrainBenchArgs {
    /// Optimizer steps; the first is a warm-up and is not counted.
    #[arg(long, default_value_t = 4)]
    pub steps: u64,
    /// Micro-batches (one sequence each per data-parallel rank) per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// ZeRO stage (as `cpl train --zero`).
    #[arg(long, value_enum, default_value_t = ZeroStage::Off, help_heading = "Memory")]
    pub zero: ZeroStage,
    /// Activation checkpointing (as `cpl train --checkpointing`).
    #[arg(long, value_enum, default_value_t = Checkpointing::None, help_heading = "Memory")]
    pub checkpointing: Checkpointing,
    /// Tokens per chunk of the vocab-parallel loss (as `cpl train --loss-chunk`).
    #[arg(long, default_value_t = 1024, help_heading = "Memory")]
    pub loss_chunk: usize,
    #[command(flatten)]
    pub lm: LmBenchArgs,
}

/// What rank 0 reports of the run.
struct Measured {
    /// The dtype of the loaded parameters.
    dtype: DType,
    /// Per step: the slowest rank's seconds.
    seconds: Vec<f64>,
    /// Labelled tokens of a step's global batch.
    tokens: u64,
    loss_first: f64,
    loss_last: f64,
    /// The largest peak RSS of the ranks' processes.
    peak_rss_mib: f64,
}

pub fn run(args: &TrainBenchArgs) -> Result<()> {
    let a = &args.lm;
    if args.steps < 2 {
        bail!(
            "--steps {} must be at least 2 (the first step is a warm-up)",
            args.steps
        );
    }
    at_least_one("--loss-chunk", args.loss_chunk)?;
    at_least_one("--grad-accum", args.grad_accum)?;
    a.check()?;
    let model = a.resolve()?;
    let dtype = model.dtype(a.dtype);
    let cfg = TrainConfig {
        grad_accum: args.grad_accum,
        seed: a.seed,
        ..TrainConfig::constant_lr(
            a.seq_len,
            args.steps,
            1e-4,
            args.loss_chunk,
            MemoryPlan {
                zero: args.zero,
                zero_group: None,
                checkpointing: args.checkpointing,
            },
        )
    };
    // One window of random tokens per rank and micro-batch (every data-parallel rank gets its
    // own).
    let vocab = model.desc.vocab;
    let ids = random_tokens(
        a.layout.ranks * args.grad_accum * a.seq_len + 1,
        vocab,
        a.seed,
    );
    let data = PackedDataset::new(
        TokenStream::from_sequences(&[ids], vocab)?,
        a.seq_len,
        Packing::Continuous,
    )?;
    let measured = launch(&a.layout, |rank| {
        let loaded = model.load(rank, dtype, ParamMode::Trainable, &a.layout)?;
        let dtype = train::evaluation::activation_dtype(&loaded.params);
        let mut trainer = Trainer::new(loaded.model, &rank.mesh, &rank.ctx, cfg.clone())?;
        let world = rank.world();
        let (mut seconds, mut losses, mut tokens) = (Vec::new(), Vec::new(), 0);
        while trainer.step < cfg.steps {
            let t0 = Instant::now();
            let stats = trainer.step(&data)?;
            rank.ctx.device().synchronize()?;
            seconds.push(t0.elapsed().as_secs_f64());
            losses.push(stats.loss);
            tokens = stats.tokens;
        }
        let cpu = &Device::Cpu;
        let seconds = world
            .all_reduce(&Tensor::new(seconds.as_slice(), cpu)?, ReduceOp::Max)?
            .to_vec1::<f64>()?;
        let rss = peak_rss_mib().unwrap_or(f64::NAN);
        let peak_rss_mib = world
            .all_reduce(&Tensor::new(&[rss], cpu)?, ReduceOp::Max)?
            .to_vec1::<f64>()?[0];
        Ok(Measured {
            dtype,
            seconds,
            tokens,
            loss_first: losses.first().copied().unwrap_or(f64::NAN),
            loss_last: losses.last().copied().unwrap_or(f64::NAN),
            peak_rss_mib,
        })
    })?;
    let Some(m) = measured else {
        return Ok(());
    };
    // Measured after the run, with the ranks (and a GPU) idle.
    let peak = a.peak(m.dtype)?;
    let flops = model.desc.flops_per_token(a.seq_len, Work::Training);
    let rate = Throughput::new(&m.seconds[1..], m.tokens as f64, flops, peak);
    if a.json {
        return a.print_json(
            "train",
            &model,
            m.dtype,
            &rate,
            json!({
                "steps": args.steps, "grad_accum": args.grad_accum, "zero": args.zero.to_string(),
                "checkpointing": args.checkpointing.to_string(), "loss_chunk": args.loss_chunk,
                "tokens_per_step": m.tokens, "step_seconds": m.seconds,
                "peak_rss_mib": m.peak_rss_mib,
                "loss_first": m.loss_first, "loss_last": m.loss_last,
            }),
        );
    }
    let title = format!(
        "cpl bench train: {} x {} tokens per step, {} steps (the first a warm-up), {}, ZeRO {}, \
         checkpointing {}",
        m.tokens / a.seq_len as u64,
        a.seq_len,
        args.steps,
        m.dtype.as_str(),
        args.zero,
        args.checkpointing
    );
    a.print_table(&model, &title, &rate);
    let steps: Vec<String> = m.seconds.iter().map(|s| format!("{s:.2}")).collect();
    println!("step seconds: {}", steps.join(" "));
    println!("peak memory: {:.0} MiB (RSS)", m.peak_rss_mib);
    Ok(())
}
