//! `cpl bench comm`: bandwidth of the local communicator backend (ranks as threads), next to
//! this machine's memcpy bandwidth.
//!
//! Conventions (those of NCCL-tests, so numbers compare with GPU reports):
//! - `S` (--mib) is the tensor size: the input and output of each rank for all-reduce,
//!   all-to-all and broadcast, the *output* of each rank for all-gather (every rank contributes
//!   `S/P`), the input for reduce-scatter.
//! - `t` is the time of one call: per iteration, the slowest rank's time from leaving a barrier
//!   to holding its output; the best of --iters iterations after a warm-up (and the median).
//! - `algbw = S / t`; `busbw = algbw · 2(P-1)/P` for all-reduce, `algbw · (P-1)/P` for
//!   all-gather, reduce-scatter and all-to-all (and all-to-all-v), `algbw` for broadcast: the bytes each rank moves
//!   to or from other ranks per second.
//! - memcpy bandwidth: bytes copied per second by one thread (`copy_from_slice` of an `S`-byte
//!   buffer into an already touched one); a second row copies into a fresh allocation, as every
//!   collective must for its output. The compared ratio is `busbw / memcpy`.
//!
//! Broadcast on local ranks hands every rank the root's tensor itself (no copy): its time is
//! the synchronisation alone.
//!
//! `cpl` allocates with mimalloc, which keeps freed memory for reuse, so the collectives do not
//! pay first-touch page faults for every output (see docs/benchmarks.md).

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::{Comm, LocalWorld, ReduceOp};
use serde_json::{json, Value};

use super::{at_least_one, min_and_median, print_report, Machine};

pub(super) const MIB: usize = 1 << 20;

#[derive(clap::Args, Debug, Clone)]
pub struct CommArgs {
    /// Local ranks (threads of this process).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Tensor size S in MiB of f32.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed iterations of each operation (after a warm-up).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Operations to time.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [
        CommOp::AllReduce, CommOp::AllGather, CommOp::ReduceScatter, CommOp::AllToAll,
        CommOp::AllToAllV, CommOp::Broadcast,
    ])]
    pub ops: Vec<CommOp>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// A collective of `cpl bench comm`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommOp {
    /// Sum over ranks; every rank gets the whole result.
    AllReduce,
    /// Concatenation of the ranks' S/P inputs.
    AllGather,
    /// Sum over ranks; every rank keeps S/P of it.
    ReduceScatter,
    /// Every rank sends S/P to each rank.
    AllToAll,
    /// The same through `all_to_all_v`, the exchange of expert parallelism (the counts, here
    /// S/P each, are all-gathered first, then one grouped exchange).
    AllToAllV,
    /// Rank 0's tensor to every rank.
    Broadcast,
}

impl CommOp {
    fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all-reduce",
            Self::AllGather => "all-gather",
            Self::ReduceScatter => "reduce-scatter",
            Self::AllToAll => "all-to-all",
            Self::AllToAllV => "all-to-all-v",
            Self::Broadcast => "broadcast",
        }
    }

    /// Elements of each rank's input and output for a tensor of `n` elements over `p` ranks.
    fn sizes(self, n: usize, p: usize) -> (usize, usize) {
        match self {
            Self::AllGather => (n / p, n),
            Self::ReduceScatter => (n, n / p),
            _ => (n, n),
        }
    }

    /// `busbw / algbw` on `p` ranks.
    fn bus_factor(self, p: usize) -> f64 {
        let p = p as f64;
        match self {
            Self::AllReduce => 2.0 * (p - 1.0) / p,
            Self::Broadcast => 1.0,
            _ => (p - 1.0) / p,
        }
    }

    /// What a reader of the numbers must know about this operation on local ranks.
    fn note(self) -> Option<&'static str> {
        (self == Self::Broadcast).then_some(
            "local ranks receive the root's tensor itself (shared, not copied): the time is the \
             synchronisation alone, not a copy rate",
        )
    }

    fn call(self, c: &Comm, x: &Tensor) -> candle_parallel::Result<Tensor> {
        match self {
            Self::AllReduce => c.all_reduce(x, ReduceOp::Sum),
            Self::AllGather => c.all_gather(x, 0),
            Self::ReduceScatter => c.reduce_scatter(x, 0, ReduceOp::Sum),
            Self::AllToAll => c.all_to_all(x, 0, 0),
            Self::AllToAllV => {
                let counts = vec![x.dim(0)? / c.size(); c.size()];
                Ok(c.all_to_all_v(x, &counts)?.0)
            }
            Self::Broadcast => c.broadcast(x, 0),
        }
    }
}

/// Single-thread memcpy of `bytes` bytes: (best, median) seconds into a touched buffer, and
/// into a fresh allocation.
pub(super) fn memcpy(bytes: usize, iters: usize) -> ((f64, f64), (f64, f64)) {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![1u8; bytes];
    let mut warm = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        warm.push(t0.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    let mut fresh = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        let copy = std::hint::black_box(&src).clone();
        fresh.push(t0.elapsed().as_secs_f64());
        drop(std::hint::black_box(copy));
    }
    (min_and_median(warm), min_and_median(fresh))
}

/// (best, median) seconds of `op` on `ranks` local ranks with `input_elems` f32 per rank; per
/// iteration, the slowest rank's time.
pub(super) fn time_op(
    op: CommOp,
    ranks: usize,
    iters: usize,
    input_elems: usize,
) -> Result<(f64, f64)> {
    let per_rank = LocalWorld::run(ranks, |comm| -> candle_parallel::Result<Vec<f64>> {
        let x = Tensor::full(comm.rank() as f32 + 1.0, input_elems, &Device::Cpu)?;
        // Warm-up, so the allocator has seen these sizes once.
        drop(op.call(&comm, &x)?);
        let mut ts = Vec::with_capacity(iters);
        for _ in 0..iters {
            comm.barrier()?;
            let t0 = Instant::now();
            let y = op.call(&comm, &x)?;
            ts.push(t0.elapsed().as_secs_f64());
            drop(y);
        }
        Ok(ts)
    })?;
    let slowest = (0..iters)
        .map(|i| per_rank.iter().map(|ts| ts[i]).fold(0.0, f64::max))
        .collect();
    Ok(min_and_median(slowest))
}

/// One timed operation.
struct Row {
    op: CommOp,
    input_mib: f64,
    output_mib: f64,
    best: f64,
    median: f64,
    algbw: f64,
    busbw: f64,
}

pub fn run(args: &CommArgs) -> Result<()> {
    at_least_one("--ranks", args.ranks)?;
    at_least_one("--mib", args.mib)?;
    at_least_one("--iters", args.iters)?;
    if args.ops.is_empty() {
        bail!("--ops: name at least one operation");
    }
    let (p, mib, iters) = (args.ranks, args.mib, args.iters);
    if mib > 1 << 20 {
        bail!("--mib {mib}: at most 1048576 (1 TiB per rank)");
    }
    let s = mib * MIB;
    let el = DType::F32.size_in_bytes();
    let n = s / el;
    if !n.is_multiple_of(p) {
        bail!("--mib {mib} ({n} f32 values) does not split evenly over --ranks {p}");
    }
    let gbs = |t: f64| s as f64 / t / 1e9;
    let ((copy, copy_med), (fresh, fresh_med)) = memcpy(s, iters);
    let (copy_bw, fresh_bw) = (gbs(copy), gbs(fresh));
    let mut rows = Vec::new();
    for &op in &args.ops {
        let (input, output) = op.sizes(n, p);
        let (best, median) = time_op(op, p, iters, input)?;
        rows.push(Row {
            op,
            input_mib: (input * el) as f64 / MIB as f64,
            output_mib: (output * el) as f64 / MIB as f64,
            best,
            median,
            algbw: gbs(best),
            busbw: gbs(best) * op.bus_factor(p),
        });
    }
    if args.json {
        let results: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "op": r.op.name(), "input_mib": r.input_mib, "output_mib": r.output_mib,
                    "best_ms": r.best * 1e3, "median_ms": r.median * 1e3,
                    "algbw_gbs": r.algbw, "busbw_gbs": r.busbw,
                    "busbw_over_memcpy": r.busbw / copy_bw, "algbw_over_memcpy": r.algbw / copy_bw,
                    "note": r.op.note(),
                })
            })
            .collect();
        return print_report(
            "comm",
            json!({
                "ranks": p, "mib": mib, "iters": iters, "dtype": "f32",
                "memcpy": {
                    "touched_best_ms": copy * 1e3, "touched_median_ms": copy_med * 1e3,
                    "touched_gbs": copy_bw,
                    "fresh_best_ms": fresh * 1e3, "fresh_median_ms": fresh_med * 1e3,
                    "fresh_gbs": fresh_bw,
                },
                "results": results,
            }),
        );
    }
    println!("{}", Machine::detect().line());
    println!("ranks {p}, S = {mib} MiB of f32, best of {iters} (median), 1 GB/s = 1e9 B/s");
    println!();
    println!(
        "| operation | per-rank input → output | time ms | algbw GB/s | busbw GB/s | busbw / memcpy \
         | algbw / memcpy |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| memcpy, 1 thread, touched dst | {mib} MiB → {mib} MiB | {:.2} ({:.2}) | {copy_bw:.2} | – \
         | 100% | 100% |",
        copy * 1e3,
        copy_med * 1e3,
    );
    let fresh_pct = 100.0 * fresh_bw / copy_bw;
    println!(
        "| memcpy, 1 thread, fresh dst (Vec clone) | {mib} MiB → {mib} MiB | {:.2} ({:.2}) \
         | {fresh_bw:.2} | – | {fresh_pct:.0}% | {fresh_pct:.0}% |",
        fresh * 1e3,
        fresh_med * 1e3,
    );
    for r in &rows {
        println!(
            "| {} | {} MiB → {} MiB | {:.2} ({:.2}) | {:.2} | {:.2} | {:.0}% | {:.0}% |",
            r.op.name(),
            r.input_mib,
            r.output_mib,
            r.best * 1e3,
            r.median * 1e3,
            r.algbw,
            r.busbw,
            100.0 * r.busbw / copy_bw,
            100.0 * r.algbw / copy_bw,
        );
    }
    for r in &rows {
        if let Some(note) = r.op.note() {
            println!("{}: {note}", r.op.name());
        }
    }
    Ok(())
}
