//! `cpl bench calibrate` (or `cpl bench --calibrate`): measures this machine and writes the
//! hardware description `cpl plan --auto --hardware FILE` reads.
//!
//! This machine is one node whose `--ranks` local ranks share its cores and memory
//! (`shared_node = true`): the rates are the node's, measured with all its threads, and the
//! planner divides them among the ranks it places there. Measured:
//! - `matmul_flops`: candle's f32 product of `--matmul-size` square matrices;
//! - `attention_flops`: flash-ring causal forward+backward (1, 8 heads, `--attention-seq`, 64),
//!   as `3 x 4 S^2 h d / 2` model FLOPs over the time (the planner's convention);
//! - `memory_bandwidth`: a single-thread memcpy of 64 MiB (element-wise work of local ranks
//!   runs on the ranks' own threads);
//! - `optimizer_params_per_sec`: clipping and AdamW over 4 M parameters on one rank;
//! - the links: all-reduce of 64 MiB on `--ranks` local ranks (bus bandwidth), and the time a
//!   4 KiB all-reduce adds between products the ranks compute (the latency: with more local
//!   ranks than cores, every synchronisation waits for the slowest rank); local ranks have one
//!   kind of link;
//! - `memory_bytes`: the memory available now (`MemAvailable`).
//!
//! Ring transfers of local ranks are copies by the ranks' own cores, so nothing overlaps:
//! `overlap = false`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::comm::{LocalWorld, ReduceOp};
use candle_parallel::optim::{clip_grad_norm, AdamW, AdamWConfig, OptimParam};
use candle_parallel::planner::hardware::{DeviceSpec, LinkSpec};
use candle_parallel::planner::Hardware;
use flash_ring::{flash_bwd, flash_fwd, AttnSpec, MaskKind};

use super::comm::{memcpy, time_op, CommOp, MIB};
use super::{at_least_one, best_of, Machine, MatmulRate};

#[derive(clap::Args, Debug, Clone)]
pub struct CalibrateArgs {
    /// Where to write the hardware description (TOML).
    #[arg(long, default_value = "hardware.toml")]
    pub out: PathBuf,
    /// Local ranks the description offers (`devices_per_node`), and of the collectives timed.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Tokens of the timed attention.
    #[arg(long, default_value_t = 2048)]
    pub attention_seq: usize,
    #[command(flatten)]
    pub matmul: MatmulRate,
}

/// Bytes the kernel says are available now.
fn memory_available() -> Result<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kib: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("/proc/meminfo has no MemAvailable line")?;
    Ok(kib * 1024.0)
}

/// Model FLOP/s of flash-ring's causal forward+backward at (1, 8, s, 64).
fn attention_rate(s: usize) -> Result<f64> {
    let (heads, d) = (8, 64);
    let randn = || Tensor::randn(0f32, 1.0, (1, s, heads, d), &Device::Cpu);
    let (q, k, v, dout) = (randn()?, randn()?, randn()?, randn()?);
    let spec = AttnSpec::dense(1.0 / (d as f32).sqrt(), MaskKind::Causal, s, s);
    let t = best_of(3, || {
        let (o, l) = flash_fwd(&q, &k, &v, &spec)?;
        flash_bwd(&q, &k, &v, &o, &l, &dout, &spec)?;
        Ok(())
    })?;
    Ok(3.0 * 4.0 * (s as f64).powi(2) * (heads * d) as f64 * 0.5 / t)
}

/// Seconds a small all-reduce adds to ranks that compute between synchronisations: each of
/// `ranks` local ranks alternates a product of 256 x 256 matrices with a 4 KiB all-reduce, and
/// the same products without; the difference per all-reduce. Local ranks outnumbering the cores
/// wait for the slowest one at every synchronisation, which costs far more than the idle
/// all-reduce's own time.
fn sync_cost(ranks: usize) -> Result<f64> {
    const ITERS: usize = 40;
    let run = |sync: bool| -> Result<f64> {
        let per_rank = LocalWorld::run(ranks, |comm| -> candle_parallel::Result<f64> {
            let a = Tensor::randn(0f32, 1.0, (256, 256), &Device::Cpu)?;
            let small = Tensor::ones(1024, DType::F32, &Device::Cpu)?;
            comm.barrier()?;
            let t0 = Instant::now();
            let mut x = a.clone();
            for _ in 0..ITERS {
                x = (x.matmul(&a)? * 1e-2)?;
                if sync {
                    comm.all_reduce(&small, ReduceOp::Sum)?;
                }
            }
            comm.barrier()?;
            Ok(t0.elapsed().as_secs_f64())
        })?;
        Ok(per_rank.into_iter().fold(0.0, f64::max))
    };
    let best = |sync: bool| -> Result<f64> {
        let mut t = f64::INFINITY;
        for _ in 0..3 {
            t = t.min(run(sync)?);
        }
        Ok(t)
    };
    let (with, without) = (best(true)?, best(false)?);
    Ok(((with - without) / ITERS as f64).max(0.0))
}

/// Parameters per second of one optimizer step on one rank: clipping to norm 1 and AdamW (f32
/// masters and moments) over 4 M f32 parameters in 16 tensors, best of 3 after a warm-up.
fn optimizer_rate() -> Result<f64> {
    const TENSORS: usize = 16;
    const ELEMS: usize = 1 << 18;
    let mut params = Vec::new();
    let mut grads = Vec::new();
    for i in 0..TENSORS {
        let name = format!("layers.{i}.weight");
        let w = Tensor::randn(0f32, 1.0, (512, ELEMS / 512), &Device::Cpu)?;
        params.push(OptimParam::new(name.clone(), Var::from_tensor(&w)?));
        grads.push((
            name,
            Tensor::randn(0f32, 1.0, (512, ELEMS / 512), &Device::Cpu)?,
        ));
    }
    let mut opt = AdamW::new(params, AdamWConfig::default())?;
    let no_shards = |_: &str| None;
    let mut step = || -> Result<()> {
        let mut g = grads.clone();
        clip_grad_norm(&mut g, 1.0, &no_shards)?;
        opt.step(&g, 1e-4)?;
        Ok(())
    };
    step()?;
    let t = best_of(3, &mut step)?;
    Ok((TENSORS * ELEMS) as f64 / t)
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    at_least_one("--ranks", args.ranks)?;
    if args.attention_seq < 64 {
        bail!("--attention-seq {} must be at least 64", args.attention_seq);
    }
    let machine = Machine::detect();
    eprintln!("calibrating {}", machine.line());
    let matmul_flops = args.matmul.gflops(5)? * 1e9;
    eprintln!("  f32 matmul: {:.1} GFLOP/s", matmul_flops / 1e9);
    let attention_flops = attention_rate(args.attention_seq)?;
    eprintln!(
        "  flash attention fwd+bwd: {:.1} GFLOP/s",
        attention_flops / 1e9
    );
    let optimizer_params_per_sec = optimizer_rate()?;
    eprintln!(
        "  optimizer step (clipping, AdamW): {:.0} M parameters/s",
        optimizer_params_per_sec / 1e6
    );
    let ((copy_best, _), _) = memcpy(64 * MIB, 10);
    let memory_bandwidth = (64 * MIB) as f64 / copy_best;
    eprintln!("  memcpy: {:.2} GB/s", memory_bandwidth / 1e9);
    let (bandwidth, latency) = if args.ranks > 1 {
        let p = args.ranks as f64;
        let elems = 16 * MIB; // 64 MiB of f32
        let (big, _) = time_op(CommOp::AllReduce, args.ranks, 5, elems)?;
        let busbw = (elems * 4) as f64 / big * 2.0 * (p - 1.0) / p;
        // An all-reduce is 2 (p - 1) messages in the planner's model.
        (busbw, sync_cost(args.ranks)? / (2.0 * (p - 1.0)))
    } else {
        (memory_bandwidth, 0.0)
    };
    eprintln!(
        "  all-reduce on {} ranks: bus bandwidth {:.2} GB/s, latency {:.1} us per message",
        args.ranks,
        bandwidth / 1e9,
        latency * 1e6
    );
    let link = LinkSpec { bandwidth, latency };
    let hw = Hardware {
        name: format!(
            "{} ({} threads), {} local ranks, measured by cpl bench calibrate",
            machine.cpu, machine.threads, args.ranks
        ),
        nodes: 1,
        devices_per_node: args.ranks,
        shared_node: true,
        device: DeviceSpec {
            matmul_flops,
            attention_flops,
            memory_bandwidth,
            memory_bytes: memory_available()?,
            optimizer_params_per_sec: Some(optimizer_params_per_sec),
        },
        intra_node: link,
        inter_node: link,
        overlap: false,
        nics_per_node: None,
    };
    hw.validate()?;
    let text = format!(
        "# Written by `cpl bench calibrate --ranks {}` on {}.\n# f32 rates; the node's cores \
         and memory are shared by its local ranks.\n{}",
        args.ranks,
        machine.line(),
        hw.to_toml()?
    );
    models::checkpoint::write_atomic(&args.out, text.as_bytes())
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}
