//! Benchmark of sequence-parallel attention on local ranks (threads of one process), next to
//! single-device flash-ring. Not a test.
//!
//! ```text
//! cargo run --release -p candle-parallel --example bench_sp_attention -- \
//!     [--seq 16384] [--heads 8] [--kv-heads 8] [--head-dim 64] [--ranks 4] [--mask causal] \
//!     [--write docs/benchmarks.md]
//! ```
//!
//! For every strategy: wall time of forward and backward (slowest rank), bytes sent per rank
//! (from the communicator's traffic accounting), peak memory, and per rank the time spent in
//! block kernels plus the exact number of unmasked score entries it computes (the load). Peak
//! memory is the process's peak resident set (VmHWM, reset through `/proc/self/clear_refs`
//! before each strategy) minus the resident set before it, divided by the number of ranks: an
//! average per rank, including communication buffers. Run with `MALLOC_MMAP_THRESHOLD_=131072`
//! so that freed tensors return to the OS and the peaks are comparable.
//!
//! `--write FILE` replaces (or appends) the section "## Sequence-parallel attention (issue 4)"
//! of FILE with the results.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::block::{
    set_kernel_scheduling, take_block_compute_time, KernelScheduling,
};
use candle_parallel::attention::{
    AttnCall, AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy,
};
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::DeviceMesh;
use flash_ring::Positions;

const SECTION: &str = "## Sequence-parallel attention (issue 4)";

struct Args {
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ranks: usize,
    causal: bool,
    /// Runs per strategy of the main pass (fastest wall times kept).
    iters: usize,
    /// Runs of the load-balance pass (per-rank fastest kernel time).
    balance_iters: usize,
    write: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seq: 16384,
        heads: 8,
        kv_heads: 8,
        head_dim: 64,
        ranks: 4,
        causal: true,
        iters: 3,
        balance_iters: 7,
        write: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--seq" => a.seq = num(val()?)?,
            "--heads" => a.heads = num(val()?)?,
            "--kv-heads" => a.kv_heads = num(val()?)?,
            "--head-dim" => a.head_dim = num(val()?)?,
            "--ranks" => a.ranks = num(val()?)?,
            "--mask" => a.causal = val()? != "full",
            "--iters" => a.iters = num(val()?)?.max(1),
            "--balance-iters" => a.balance_iters = num(val()?)?.max(1),
            "--write" => a.write = Some(val()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Resident set and its peak, in bytes (Linux; 0 elsewhere).
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

struct RankStats {
    fwd: Duration,
    bwd: Duration,
    kernel: Duration,
    fwd_bytes: u64,
    bwd_bytes: u64,
    /// Unmasked score entries this rank computes (rows x visible keys x heads).
    work: u64,
    /// This rank's output shard and its (ring, ulysses) coords, for the correctness check.
    out: Option<(Tensor, (usize, usize))>,
}

struct Row {
    name: String,
    fwd: Duration,
    bwd: Duration,
    ranks: Vec<RankStats>,
    peak_per_rank: u64,
    /// max|out - single-device out| / max|single-device out|.
    err: f32,
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// Unmasked (q, k) pairs a rank computes: its q rows after any all-to-all against the keys a
/// causal (or full) mask lets them see, times its heads.
fn work_of(cfg: &SpConfig, seq: usize, heads: usize, causal: bool, r: usize) -> u64 {
    let plan = cfg.plan(seq).expect("plan");
    let (ring_rank, uly_rank) = (r / cfg.ulysses, r % cfg.ulysses);
    let (rows, h) = match cfg.strategy {
        // The q rows of ring rank `ring_rank`, hq / U heads.
        Strategy::Ulysses | Strategy::Usp | Strategy::DoubleRing => {
            (plan.ring_positions(ring_rank), heads / cfg.ulysses)
        }
        _ => (plan.local_positions(ring_rank, uly_rank), heads),
    };
    let per_head: u64 = rows
        .iter()
        .map(|&p| if causal { p as u64 + 1 } else { seq as u64 })
        .sum();
    per_head * h as u64
}

fn run_strategy(a: &Args, cfg: &SpConfig, x: &[Tensor; 4], reference: &Tensor) -> Row {
    let [q, k, v, g] = x;
    let mask = if a.causal {
        AttnMask::Causal
    } else {
        AttnMask::Full
    };
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    let base = rss().0;
    reset_peak();
    let stats = LocalWorld::run(a.ranks, |comm| -> candle_parallel::Result<RankStats> {
        let mesh = DeviceMesh::new(&cfg.mesh_config(), comm.clone())?;
        let sp = SpAttention::new(cfg, &mesh)?;
        let ql = Var::from_tensor(&sp.shard(q, 1)?)?;
        let kl = Var::from_tensor(&sp.shard(k, 1)?)?;
        let vl = Var::from_tensor(&sp.shard(v, 1)?)?;
        let gl = sp.shard(g, 1)?;
        comm.barrier()?;
        comm.traffic().reset();
        let _ = take_block_compute_time();
        let t0 = Instant::now();
        let out = sp.attention(&ql, &kl, &vl, &AttnCall::new(mask.clone(), scale))?;
        let fwd = t0.elapsed();
        let fwd_bytes = comm.traffic().snapshot().bytes_sent();
        let t1 = Instant::now();
        let grads = (&out * &gl)?.sum_all()?.backward()?;
        let bwd = t1.elapsed();
        let kernel = take_block_compute_time();
        let total = comm.traffic().snapshot().bytes_sent();
        for t in [&ql, &kl, &vl] {
            if grads.get(t).is_none() {
                return Err(candle_parallel::Error::InvalidArgument {
                    op: "bench",
                    msg: "missing gradient".into(),
                });
            }
        }
        Ok(RankStats {
            fwd,
            bwd,
            kernel,
            fwd_bytes,
            bwd_bytes: total - fwd_bytes,
            work: work_of(cfg, a.seq, a.heads, a.causal, comm.rank()),
            out: Some((out.detach(), sp.shard_coords())),
        })
    })
    .unwrap_or_else(|e| panic!("{}: {e}", cfg.strategy));
    let mut stats = stats;
    let peak = rss().1.saturating_sub(base);
    let plan = cfg.plan(a.seq).expect("plan");
    let mut parts: Vec<(usize, Tensor)> = stats
        .iter_mut()
        .filter_map(|s| s.out.take())
        .map(|(t, (r, u))| (plan.shard_index(r, u), t))
        .collect();
    parts.sort_by_key(|(i, _)| *i);
    let parts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
    let global = plan.unshard(&parts, 1).expect("unshard");
    let err = rel_err(&global, reference);
    let name = match cfg.strategy {
        Strategy::Ring => format!("ring {}", cfg.layout),
        Strategy::Ulysses => format!("ulysses {}", cfg.ulysses),
        Strategy::Usp => format!("usp {}x{} {}", cfg.ulysses, cfg.ring, cfg.layout),
        Strategy::AllGather => format!("all-gather {}", cfg.layout),
        Strategy::DoubleRing => format!("double-ring w={} {}", cfg.inner_ring, cfg.layout),
        Strategy::StarTrail => format!("startrail C={} {}", cfg.team, cfg.layout),
    };
    Row {
        name,
        fwd: stats.iter().map(|s| s.fwd).max().unwrap_or_default(),
        bwd: stats.iter().map(|s| s.bwd).max().unwrap_or_default(),
        peak_per_rank: peak / a.ranks as u64,
        ranks: stats,
        err,
    }
}

fn rel_err(a: &Tensor, r: &Tensor) -> f32 {
    testkit::rel_err(a, r) as f32
}

fn single_device(a: &Args, x: &[Tensor; 4]) -> (Row, Tensor) {
    let [q, k, v, g] = x;
    let mask = if a.causal {
        flash_ring::MaskKind::Causal
    } else {
        flash_ring::MaskKind::Full
    };
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    let spec = flash_ring::AttnSpec::new(
        scale,
        mask,
        Positions::range(0, a.seq),
        Positions::range(0, a.seq),
    );
    let base = rss().0;
    reset_peak();
    let (qv, kv, vv) = (
        Var::from_tensor(q).expect("var"),
        Var::from_tensor(k).expect("var"),
        Var::from_tensor(v).expect("var"),
    );
    let t0 = Instant::now();
    let out = flash_ring::flash_attention(&qv, &kv, &vv, &spec).expect("flash forward");
    let fwd = t0.elapsed();
    let t1 = Instant::now();
    let grads = (&out * g)
        .and_then(|y| y.sum_all())
        .and_then(|l| l.backward())
        .expect("flash backward");
    let bwd = t1.elapsed();
    assert!(grads.get(&qv).is_some() && grads.get(&kv).is_some());
    let peak = rss().1.saturating_sub(base);
    let work = (0..a.seq as u64)
        .map(|p| if a.causal { p + 1 } else { a.seq as u64 })
        .sum::<u64>()
        * a.heads as u64;
    let row = Row {
        name: "single-device flash-ring".into(),
        fwd,
        bwd,
        ranks: vec![RankStats {
            fwd,
            bwd,
            kernel: fwd + bwd,
            fwd_bytes: 0,
            bwd_bytes: 0,
            work,
            out: None,
        }],
        peak_per_rank: peak,
        err: 0.0,
    };
    (row, out.detach())
}

fn report(a: &Args, rows: &[Row], balance: &[Row]) -> String {
    let mut s = String::new();
    let mask = if a.causal { "causal" } else { "full" };
    s.push_str(&format!(
        "{SECTION}\n\nS = {}, {} q heads, {} kv heads, head_dim {}, {mask}, f32, batch 1, {} local \
         ranks (threads of one process sharing the CPU cores), forward + backward, fastest of {} \
         runs \
         (`MALLOC_MMAP_THRESHOLD_=131072 cargo run --release -p candle-parallel --example \
         bench_sp_attention -- --write docs/benchmarks.md`). Machine: {} logical CPUs.\n\n",
        a.seq,
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.ranks,
        a.iters,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    s.push_str(
        "| strategy | fwd s | bwd s | fwd+bwd s | fwd MiB sent/rank | bwd MiB sent/rank | \
         peak MiB/rank | load max/min | out err |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let wmin = r.ranks.iter().map(|x| x.work).min().unwrap_or(1).max(1);
        let wmax = r.ranks.iter().map(|x| x.work).max().unwrap_or(1);
        let fb = r.ranks.iter().map(|x| x.fwd_bytes).max().unwrap_or(0);
        let bb = r.ranks.iter().map(|x| x.bwd_bytes).max().unwrap_or(0);
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.0e} |\n",
            r.name,
            secs(r.fwd),
            secs(r.bwd),
            secs(r.fwd + r.bwd),
            mib(fb),
            mib(bb),
            mib(r.peak_per_rank),
            wmax as f64 / wmin as f64,
            r.err
        ));
    }
    s.push_str(
        "\nLoad balance: per-rank time inside flash-ring block kernels (forward + backward), \
         measured in separate runs with the kernels of all ranks serialised (so no rank's \
         compute is slowed by another's; fastest of `--balance-iters` runs), and the rank's \
         load (unmasked score entries it computes, millions; exact):\n\n| strategy | ",
    );
    for r in 0..a.ranks {
        s.push_str(&format!("rank {r} | "));
    }
    s.push_str("max/min time |\n");
    s.push_str(&"|---".repeat(a.ranks + 2));
    s.push_str("|\n");
    for r in balance {
        s.push_str(&format!("| {} | ", r.name));
        for x in &r.ranks {
            s.push_str(&format!(
                "{} s / {:.0} M | ",
                secs(x.kernel),
                x.work as f64 / 1e6
            ));
        }
        let kmin = r.ranks.iter().map(|x| x.kernel).min().unwrap_or_default();
        let kmax = r.ranks.iter().map(|x| x.kernel).max().unwrap_or_default();
        s.push_str(&format!(
            "{:.2} |\n",
            kmax.as_secs_f64() / kmin.as_secs_f64().max(1e-9)
        ));
    }
    s.push_str(
        "\nBytes are what each rank's communicator recorded (payload to other ranks, see \
         `comm::traffic`, the largest over ranks); they equal the formulas asserted in \
         `tests/sp_attention.rs`. Peak memory is the process peak RSS during the strategy's run \
         minus the RSS before it, divided by the ranks: an average per rank that includes its \
         shards, communication buffers and autograd state (the global inputs are excluded). \
         \"load max/min\" is the ratio of the most to the least loaded rank's unmasked score \
         entries. \"out err\" is max|out - single-device out| / max|single-device out| of the \
         output gathered to global order.\n",
    );
    s
}

fn write_section(path: &str, section: &str) -> std::io::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_else(|_| "# Benchmarks\n".into());
    let new = match old.find(SECTION) {
        Some(start) => {
            let after = start + SECTION.len();
            let end = old[after..]
                .find("\n## ")
                .map_or(old.len(), |i| after + i + 1);
            format!("{}{}{}", &old[..start], section, &old[end..])
        }
        None => format!(
            "{}\n{}",
            old.trim_end_matches('\n').to_string() + "\n",
            section
        ),
    };
    std::fs::write(path, new)
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_sp_attention: {e}");
            std::process::exit(2);
        }
    };
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
    let p = a.ranks;
    let mut cfgs = vec![
        SpConfig::new(Strategy::Ring, 1, p).with_layout(SeqLayout::Contiguous),
        SpConfig::new(Strategy::Ring, 1, p).with_layout(SeqLayout::Zigzag),
        SpConfig::new(Strategy::Ring, 1, p).with_layout(SeqLayout::Striped),
        SpConfig::new(Strategy::Ulysses, p, 1),
        SpConfig::new(Strategy::AllGather, 1, p).with_layout(SeqLayout::Zigzag),
    ];
    if p.is_multiple_of(2) {
        cfgs.push(SpConfig::new(Strategy::Usp, 2, p / 2));
        cfgs.push(SpConfig::new(Strategy::DoubleRing, 1, p).with_inner_ring(2));
    }
    if p.is_multiple_of(4) {
        cfgs.push(SpConfig::new(Strategy::StarTrail, 1, p).with_team(2));
    }
    let (mut single, reference) = single_device(&a, &x);
    for _ in 1..a.iters {
        let again = single_device(&a, &x).0;
        single.fwd = single.fwd.min(again.fwd);
        single.bwd = single.bwd.min(again.bwd);
    }
    let mut rows = vec![single];
    eprintln!(
        "{}: fwd {:?} bwd {:?}",
        rows[0].name, rows[0].fwd, rows[0].bwd
    );
    for cfg in &cfgs {
        if let Err(e) = cfg.validate() {
            eprintln!("skipping {}: {e}", cfg.strategy);
            continue;
        }
        let mut row = run_strategy(&a, cfg, &x, &reference);
        for _ in 1..a.iters {
            let again = run_strategy(&a, cfg, &x, &reference);
            row.fwd = row.fwd.min(again.fwd);
            row.bwd = row.bwd.min(again.bwd);
        }
        eprintln!("{}: fwd {:?} bwd {:?}", row.name, row.fwd, row.bwd);
        rows.push(row);
    }
    // Load balance without contention: the ring-based strategies again, kernels serialised.
    set_kernel_scheduling(KernelScheduling::Serialized);
    let balance: Vec<Row> = cfgs
        .iter()
        .filter(|c| matches!(c.strategy, Strategy::Ring | Strategy::Usp))
        .map(|cfg| {
            let mut runs: Vec<Row> = (0..a.balance_iters)
                .map(|_| run_strategy(&a, cfg, &x, &reference))
                .collect();
            let mut row = runs.remove(0);
            for (r, stats) in row.ranks.iter_mut().enumerate() {
                // Noise only adds time: keep each rank's fastest run.
                for run in &runs {
                    stats.kernel = stats.kernel.min(run.ranks[r].kernel);
                }
            }
            row
        })
        .collect();
    set_kernel_scheduling(KernelScheduling::Concurrent);
    let section = report(&a, &rows, &balance);
    println!("{section}");
    if let Some(path) = &a.write {
        if let Err(e) = write_section(path, &section) {
            eprintln!("bench_sp_attention: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
