//! Bandwidth of the local communicator backend, next to this machine's memcpy bandwidth.
//!
//! ```text
//! cargo run --release -p candle-parallel --example bench_comm -- [--ranks 4] [--mib 64] [--iters 10]
//! ```
//!
//! Conventions (those of NCCL-tests, so numbers compare with GPU reports):
//! - `S` is the tensor size: the input and output of each rank for all_reduce and all_to_all,
//!   the *output* of each rank for all_gather (every rank contributes `S/P`).
//! - `t` is the time of one call: per iteration, the slowest rank's time from leaving a barrier
//!   to holding its output; the best of `iters` iterations is reported (median in brackets).
//! - algorithm bandwidth `algbw = S / t`;
//!   bus bandwidth `busbw = algbw · 2(P-1)/P` for all_reduce and `algbw · (P-1)/P` for
//!   all_gather and all_to_all: the bytes each rank moves to or from other ranks per second.
//! - memcpy bandwidth: bytes copied per second by one thread (`copy_from_slice` of an `S`-byte
//!   buffer into an already touched one; best of `iters`). A second line copies into a freshly
//!   allocated buffer, as every collective must do for its output.
//! - The target ratio is `busbw / memcpy` (≥ 50%); `algbw / memcpy` is printed too.
//!
//! Every call returns new tensors, so with glibc's default policy (allocations above 32 MiB are
//! mmapped and unmapped on free) each one pays first-touch page faults for its output. To measure
//! the backend without them, let glibc keep freed memory:
//! `MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=17179869184
//! MALLOC_TOP_PAD_=0`. Results and discussion: `docs/benchmarks.md`.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::{Comm, LocalWorld, ReduceOp};

const MIB: usize = 1 << 20;

struct Args {
    ranks: usize,
    mib: usize,
    iters: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        ranks: 4,
        mib: 64,
        iters: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{flag} needs a positive integer"))
        };
        match flag.as_str() {
            "--ranks" => args.ranks = value(),
            "--mib" => args.mib = value(),
            "--iters" => args.iters = value(),
            other => panic!("unknown argument {other}; use --ranks N --mib N --iters N"),
        }
    }
    assert!(args.ranks > 0 && args.mib > 0 && args.iters > 0);
    args
}

fn best_and_median(mut ts: Vec<Duration>) -> (Duration, Duration) {
    ts.sort();
    (ts[0], ts[ts.len() / 2])
}

/// Single-thread memcpy of `bytes` bytes: into a touched buffer, and into a fresh allocation.
fn memcpy(bytes: usize, iters: usize) -> ((Duration, Duration), (Duration, Duration)) {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![1u8; bytes];
    let mut warm = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        warm.push(t0.elapsed());
        std::hint::black_box(&mut dst);
    }
    let mut fresh = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        let copy = std::hint::black_box(&src).clone();
        fresh.push(t0.elapsed());
        drop(std::hint::black_box(copy));
    }
    (best_and_median(warm), best_and_median(fresh))
}

/// Times `op` on every rank of a `ranks`-rank world; per iteration, the slowest rank's time.
fn time_collective(
    ranks: usize,
    iters: usize,
    input_elems: usize,
    op: impl Fn(&Comm, &Tensor) -> candle_parallel::Result<Tensor> + Sync,
) -> (Duration, Duration) {
    let per_rank = LocalWorld::run(ranks, |comm| -> candle_parallel::Result<Vec<Duration>> {
        let x = Tensor::full(comm.rank() as f32 + 1.0, input_elems, &Device::Cpu)?;
        // Warm-up, so the allocator has seen these sizes once.
        drop(op(&comm, &x)?);
        let mut ts = Vec::with_capacity(iters);
        for _ in 0..iters {
            comm.barrier()?;
            let t0 = Instant::now();
            let y = op(&comm, &x)?;
            ts.push(t0.elapsed());
            drop(y);
        }
        Ok(ts)
    })
    .expect("benchmark world failed");
    let slowest: Vec<Duration> = (0..iters)
        .map(|i| per_rank.iter().map(|ts| ts[i]).max().unwrap())
        .collect();
    best_and_median(slowest)
}

fn gbs(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let Args { ranks, mib, iters } = parse_args();
    let p = ranks;
    let s = mib * MIB;
    let el = DType::F32.size_in_bytes();
    assert!(
        s.is_multiple_of(el * p),
        "--mib must split evenly over the ranks"
    );

    let ((copy_best, copy_med), (fresh_best, fresh_med)) = memcpy(s, iters);
    let copy_bw = gbs(s, copy_best);
    println!(
        "ranks {p}, S = {mib} MiB of f32, best of {iters} (median), 1 GB/s = 1e9 B/s, {} threads available",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("| operation | per-rank input → output | time ms | algbw GB/s | busbw GB/s | busbw / memcpy | algbw / memcpy |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| memcpy, 1 thread, touched dst | {mib} MiB → {mib} MiB | {:.2} ({:.2}) | {:.2} | – | 100% | 100% |",
        ms(copy_best),
        ms(copy_med),
        copy_bw
    );
    println!(
        "| memcpy, 1 thread, fresh dst (Vec clone) | {mib} MiB → {mib} MiB | {:.2} ({:.2}) | {:.2} | – | {:.0}% | {:.0}% |",
        ms(fresh_best),
        ms(fresh_med),
        gbs(s, fresh_best),
        100.0 * gbs(s, fresh_best) / copy_bw,
        100.0 * gbs(s, fresh_best) / copy_bw,
    );

    let pf = p as f64;
    let n = s / el;
    let rows: Vec<(&str, String, f64, (Duration, Duration))> = vec![
        (
            "all_reduce (sum)",
            format!("{mib} MiB → {mib} MiB"),
            2.0 * (pf - 1.0) / pf,
            time_collective(p, iters, n, |c, x| c.all_reduce(x, ReduceOp::Sum)),
        ),
        (
            "all_gather (dim 0)",
            format!("{} MiB → {mib} MiB", mib as f64 / pf),
            (pf - 1.0) / pf,
            time_collective(p, iters, n / p, |c, x| c.all_gather(x, 0)),
        ),
        (
            "all_to_all",
            format!("{mib} MiB → {mib} MiB"),
            (pf - 1.0) / pf,
            time_collective(p, iters, n, |c, x| c.all_to_all(x, 0, 0)),
        ),
        (
            "reduce_scatter (sum)",
            format!("{mib} MiB → {} MiB", mib as f64 / pf),
            (pf - 1.0) / pf,
            time_collective(p, iters, n, |c, x| c.reduce_scatter(x, 0, ReduceOp::Sum)),
        ),
    ];
    for (name, sizes, factor, (best, med)) in rows {
        let alg = gbs(s, best);
        let bus = alg * factor;
        println!(
            "| {name} | {sizes} | {:.2} ({:.2}) | {alg:.2} | {bus:.2} | {:.0}% | {:.0}% |",
            ms(best),
            ms(med),
            100.0 * bus / copy_bw,
            100.0 * alg / copy_bw
        );
    }
}

fn ms(t: Duration) -> f64 {
    t.as_secs_f64() * 1e3
}
