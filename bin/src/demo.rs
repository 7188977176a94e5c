//! `cpl demo`: collectives across local ranks, checked against a single-rank computation.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::{LocalWorld, OpKind, ReduceOp};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Number of local ranks (threads).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Elements per rank.
    #[arg(long, default_value_t = 1 << 20)]
    pub elems: usize,
}

impl Default for DemoArgs {
    fn default() -> Self {
        Self {
            ranks: 4,
            elems: 1 << 20,
        }
    }
}

/// Rank `r`'s input: a deterministic ramp, different on every rank.
fn input(rank: usize, elems: usize) -> candle_core::Result<Tensor> {
    Tensor::arange(0u32, elems as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(1e-3, rank as f64 + 1.0)
}

pub fn run(args: &DemoArgs) -> Result<()> {
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    if !args.elems.is_multiple_of(args.ranks) {
        bail!(
            "--elems ({}) must be divisible by --ranks ({}) for the all-to-all",
            args.elems,
            args.ranks
        );
    }
    let (p, n) = (args.ranks, args.elems);
    println!("cpl demo: {p} local ranks, {n} f32 elements per rank");
    let reports = LocalWorld::run(p, |comm| -> candle_core::Result<_> {
        let x = input(comm.rank(), n)?;
        let sum = comm.all_reduce(&x, ReduceOp::Sum)?;
        let gathered = comm.all_gather(&x.unsqueeze(0)?, 0)?;
        let a2a = comm.all_to_all(&x.reshape((p, n / p))?, 0, 1)?;
        Ok((sum, gathered, a2a, comm.traffic().snapshot()))
    })?;

    // The same computations on one rank.
    let inputs = (0..p)
        .map(|r| input(r, n))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let stacked = Tensor::stack(&inputs, 0)?;
    let want_sum = stacked.sum(0)?;
    for (rank, (sum, gathered, a2a, _)) in reports.iter().enumerate() {
        // Element by element, a NaN failing (`max_all` would skip it, and `NaN > tol` is false).
        let diff = (sum - &want_sum)?.abs()?.flatten_all()?.to_vec1::<f32>()?;
        let scale = want_sum.abs()?.max_all()?.to_scalar::<f32>()?;
        if let Some(err) = diff.iter().find(|&&e| e.is_nan() || e > 1e-6 * scale) {
            bail!("rank {rank}: all_reduce differs from the single-rank sum by {err}");
        }
        if gathered.to_vec2::<f32>()? != stacked.to_vec2::<f32>()? {
            bail!("rank {rank}: all_gather differs from the single-rank concatenation");
        }
        let want_a2a = stacked
            .reshape((p, p, n / p))?
            .narrow(1, rank, 1)?
            .reshape((1, p * (n / p)))?;
        if a2a.to_vec2::<f32>()? != want_a2a.to_vec2::<f32>()? {
            bail!("rank {rank}: all_to_all differs from the single-rank exchange");
        }
    }
    println!("all ranks agree with the single-rank computation");
    println!(
        "{:<6} {:<12} {:>14} {:>14}",
        "rank", "op", "bytes sent", "bytes recv"
    );
    for (rank, (_, _, _, traffic)) in reports.iter().enumerate() {
        for kind in [OpKind::AllReduce, OpKind::AllGather, OpKind::AllToAll] {
            let s = traffic.get(kind);
            println!(
                "{rank:<6} {:<12} {:>14} {:>14}",
                kind.name(),
                s.bytes_sent,
                s.bytes_recv
            );
        }
    }
    Ok(())
}
