//! Self-test of the MPI backend, run as `mpirun -np P mpi_selftest` (any P >= 1).
//!
//! Every rank regenerates every rank's inputs from a fixed seed, so the expected result of each
//! collective is computed locally, as one rank would compute it alone (reductions in rank order,
//! in f32 for bf16). Checks cover every collective on f32, bf16 and non-contiguous inputs, the
//! bit-identity of results across ranks, exact traffic numbers, split into subgroups, send/recv
//! and exchange around a ring, and mismatch/argument errors.
//!
//! The checks that only need a [`Comm`] live in [`backend_checks`]; [`attention_checks`] runs
//! every sequence-parallel attention strategy that fits the world size against single-device
//! flash-ring (forward, autograd backward and explicit backward). `--local P` runs the
//! same checks on the in-process backend (ranks as threads) for comparison.
//!
//! `--abort-test R [error|panic|signal]` checks the MPI failure behaviour instead: rank R
//! returns an error, panics, or is killed by SIGKILL while the others wait in a barrier; the
//! job must stop (through `MPI_Abort`, or mpirun noticing the dead process) with a non-zero
//! exit code instead of hanging.
//!
//! Output: rank 0 prints one line per check and, last, `mpi selftest: N passed, M failed`
//! (a check fails if it fails on any rank). The exit code is 1 if any check failed.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Shape, Tensor};
use candle_parallel::attention::selftest;
use candle_parallel::comm::mpi::MpiWorld;
use candle_parallel::comm::{
    Comm, LocalWorld, OpKind, OpStats, RecvSpec, ReduceOp, TrafficSnapshot,
};
use candle_parallel::Error;

type Check = Result<(), String>;

const SEED: u64 = 0x5EED_2026;
const CPU: Device = Device::Cpu;
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// What the backend under test guarantees beyond the common contract.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// A communicator stays usable after a collective reported a mismatch (true on MPI, where
    /// the metadata exchange fails every rank at the same point).
    pub usable_after_mismatch: bool,
}

/// The named outcome of every check run on this rank, in order.
#[derive(Default)]
pub struct Tally {
    pub results: Vec<(String, Option<String>)>,
}

impl Tally {
    /// Runs one check; an error or panic fails it (and is printed with this rank's number).
    pub fn check(&mut self, comm: &Comm, name: &str, f: impl FnOnce() -> Check) {
        let outcome = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(p) => Err(format!(
                "panicked: {}",
                p.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default()
            )),
        };
        if let Err(msg) = &outcome {
            eprintln!("rank {}: FAIL {name}: {msg}", comm.world_rank());
        }
        self.results.push((name.to_string(), outcome.err()));
    }
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

fn e2s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Deterministic pseudo-random values in [-1, 1) with 24 significant bits.
fn gen(case: u64, rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut z = SEED
                ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ ((rank as u64 + 1) << 32)
                ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Rank `rank`'s input of case `case`: shape `dims`, `dtype`; when `transposed`, a transposed
/// (non-contiguous) view of data generated with the first and last dims swapped.
fn input(case: u64, rank: usize, dims: &[usize], dtype: DType, transposed: bool) -> Tensor {
    let n = dims.iter().product();
    let mut gen_dims = dims.to_vec();
    let last = dims.len() - 1;
    if transposed {
        gen_dims.swap(0, last);
    }
    let t = Tensor::from_vec(gen(case, rank, n), gen_dims, &CPU)
        .and_then(|t| t.to_dtype(dtype))
        .expect("building an input");
    if transposed {
        t.transpose(0, last).expect("transposing an input")
    } else {
        t
    }
}

fn inputs(case: u64, p: usize, dims: &[usize], dtype: DType, transposed: bool) -> Vec<Tensor> {
    (0..p)
        .map(|r| input(case, r, dims, dtype, transposed))
        .collect()
}

fn values(t: &Tensor) -> Result<Vec<f32>, String> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(e2s)
}

/// `got` has `want`'s dtype, shape and exactly its values.
fn same(got: &Tensor, want: &Tensor, ctx: &str) -> Check {
    ensure(
        got.dtype() == want.dtype() && got.dims() == want.dims(),
        || {
            format!(
                "{ctx}: got {:?} {:?}, want {:?} {:?}",
                got.dtype(),
                got.dims(),
                want.dtype(),
                want.dims()
            )
        },
    )?;
    ensure(got.is_contiguous(), || {
        format!("{ctx}: output is not contiguous")
    })?;
    let (g, w) = (values(got)?, values(want)?);
    match g
        .iter()
        .zip(&w)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!("{ctx}: element {i} is {}, want {}", g[i], w[i])),
    }
}

/// The documented reduction done on one rank: rank order, f32 accumulation, rounded once.
fn reduce_expected(parts: &[Tensor], op: ReduceOp) -> Result<Tensor, String> {
    let vals = parts.iter().map(values).collect::<Result<Vec<_>, _>>()?;
    let p = parts.len();
    let mut acc = vals[0].clone();
    for v in &vals[1..] {
        for (a, b) in acc.iter_mut().zip(v) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + *b,
                ReduceOp::Max => a.max(*b),
            };
        }
    }
    if op == ReduceOp::Avg {
        // Division by the world size as candle's `tensor / f64` computes it.
        let inv = (1.0 / p as f64) as f32;
        acc.iter_mut().for_each(|a| *a = *a * inv + 0.0);
    }
    Tensor::from_vec(acc, parts[0].dims(), &CPU)
        .and_then(|t| t.to_dtype(parts[0].dtype()))
        .map_err(e2s)
}

/// Every rank holds bit-identical `t`.
fn same_on_all_ranks(comm: &Comm, t: &Tensor, ctx: &str) -> Check {
    let flat = t.flatten_all().map_err(e2s)?;
    let all = comm.all_gather(&flat, 0).map_err(e2s)?;
    let n = flat.elem_count();
    for r in 0..comm.size() {
        let theirs = all.narrow(0, r * n, n).map_err(e2s)?;
        same(&theirs, &flat, &format!("{ctx}: rank {r} vs this rank"))?;
    }
    Ok(())
}

fn stats(calls: u64, sent: u64, recv: u64) -> OpStats {
    OpStats {
        calls,
        bytes_sent: sent,
        bytes_recv: recv,
    }
}

/// Bytes an all_reduce of `n` elements of `el` bytes moves each way on rank `r` of `p`.
fn all_reduce_bytes(n: usize, el: usize, p: usize, r: usize) -> u64 {
    let len = |j: usize| n / p + usize::from(j < n % p);
    let others: usize = (0..p).filter(|&j| j != r).map(len).sum();
    ((others + len(r) * (p - 1)) * el) as u64
}

fn mismatch_of(res: candle_parallel::Result<Tensor>, ctx: &str) -> Check {
    match res {
        Err(Error::Mismatch { .. }) => Ok(()),
        Err(e) => Err(format!("{ctx}: expected a Mismatch error, got: {e}")),
        Ok(t) => Err(format!(
            "{ctx}: expected a Mismatch error, got a {:?} tensor",
            t.dims()
        )),
    }
}

/// The checks that need nothing but a communicator. Every rank must call this together.
pub fn backend_checks(comm: &Comm, opts: Options, t: &mut Tally) {
    let p = comm.size();
    let me = comm.rank();

    t.check(comm, "world: rank and size", || {
        ensure(me < p && comm.world_rank() == me, || {
            format!("rank {me}, size {p}, world rank {}", comm.world_rank())
        })
    });

    // all_reduce: f32 and bf16, contiguous and transposed, even and uneven chunks.
    let mut case = 100;
    for (dtype, transposed, dims) in [
        (DType::F32, false, vec![4, 2 * p]),
        (DType::F32, false, vec![3, 5]),
        (DType::F32, true, vec![3, 7]),
        (DType::BF16, false, vec![2, 3 * p]),
        (DType::BF16, true, vec![5, 3]),
        (DType::F32, false, vec![1]),
        (DType::F32, false, vec![512, 1024 + 1]),
    ] {
        for op in OPS {
            case += 1;
            let name = format!("all_reduce {op:?} {dtype:?} {dims:?} transposed={transposed}");
            t.check(comm, &name, || {
                let xs = inputs(case, p, &dims, dtype, transposed);
                let got = comm.all_reduce(&xs[me], op).map_err(e2s)?;
                same(&got, &reduce_expected(&xs, op)?, &name)?;
                same_on_all_ranks(comm, &got, &name)
            });
        }
    }

    // all_gather along every dim.
    for (dtype, transposed, dims) in [
        (DType::F32, false, vec![2, 3, 4]),
        (DType::BF16, false, vec![3, 2]),
        (DType::F32, true, vec![4, 3]),
    ] {
        for dim in 0..dims.len() {
            case += 1;
            let name = format!("all_gather dim {dim} {dtype:?} {dims:?} transposed={transposed}");
            t.check(comm, &name, || {
                let xs = inputs(case, p, &dims, dtype, transposed);
                let got = comm.all_gather(&xs[me], dim).map_err(e2s)?;
                same(&got, &Tensor::cat(&xs, dim).map_err(e2s)?, &name)
            });
        }
    }

    // reduce_scatter: reduce then keep this rank's chunk.
    for (dtype, transposed, dims, dim) in [
        (DType::F32, false, vec![2 * p, 3], 0),
        (DType::F32, false, vec![3, 2 * p, 2], 1),
        (DType::BF16, false, vec![2, 4 * p], 1),
        (DType::F32, true, vec![p, 5], 0),
    ] {
        for op in OPS {
            case += 1;
            let name = format!(
                "reduce_scatter {op:?} dim {dim} {dtype:?} {dims:?} transposed={transposed}"
            );
            t.check(comm, &name, || {
                let xs = inputs(case, p, &dims, dtype, transposed);
                let got = comm.reduce_scatter(&xs[me], dim, op).map_err(e2s)?;
                let c = dims[dim] / p;
                let want = reduce_expected(&xs, op)?
                    .narrow(dim, me * c, c)
                    .map_err(e2s)?;
                same(&got, &want, &name)
            });
        }
    }

    // all_to_all: Ulysses' sequence-to-head exchange and its inverse, plus other dims.
    for (dtype, transposed, dims, split, concat) in [
        (DType::F32, false, vec![2, 3, 2 * p, 4], 2, 1),
        (DType::BF16, false, vec![2, 3 * p, 2, 4], 1, 2),
        (DType::F32, true, vec![p, 3, 2], 0, 2),
        (DType::F32, false, vec![2 * p, 3], 0, 0),
    ] {
        case += 1;
        let name = format!(
            "all_to_all split {split} concat {concat} {dtype:?} {dims:?} transposed={transposed}"
        );
        t.check(comm, &name, || {
            let xs = inputs(case, p, &dims, dtype, transposed);
            let got = comm.all_to_all(&xs[me], split, concat).map_err(e2s)?;
            let c = dims[split] / p;
            let pieces = xs
                .iter()
                .map(|x| x.narrow(split, me * c, c))
                .collect::<candle_core::Result<Vec<_>>>()
                .map_err(e2s)?;
            same(&got, &Tensor::cat(&pieces, concat).map_err(e2s)?, &name)
        });
    }
    case += 1;
    t.check(comm, "all_to_all round trip is the identity", || {
        let x = input(case, me, &[2, 3, 2 * p, 4], DType::BF16, false);
        let y = comm.all_to_all(&x, 2, 1).map_err(e2s)?;
        let back = comm.all_to_all(&y, 1, 2).map_err(e2s)?;
        same(&back, &x, "round trip")
    });

    // all_to_all_v: uneven counts, some chunks empty (rank `r` sends `(3r + 5j + 1) % 4` rows to
    // rank `j`), each row naming its source, destination and index: exact in f32 and bf16.
    for dtype in [DType::F32, DType::BF16] {
        let name = format!("all_to_all_v uneven counts with empty chunks {dtype:?}");
        t.check(comm, &name, || {
            let count = |r: usize, j: usize| (3 * r + 5 * j + 1) % 4;
            let rows = |src: usize, dst: usize| -> Vec<f32> {
                (0..count(src, dst))
                    .flat_map(|i| [src as f32, dst as f32, i as f32])
                    .collect()
            };
            let mine: Vec<f32> = (0..p).flat_map(|j| rows(me, j)).collect();
            let n = mine.len() / 3;
            let x = Tensor::from_vec(mine, (n, 3), &CPU)
                .and_then(|x| x.to_dtype(dtype))
                .map_err(e2s)?;
            let sends: Vec<usize> = (0..p).map(|j| count(me, j)).collect();
            let (got, from) = comm.all_to_all_v(&x, &sends).map_err(e2s)?;
            let want: Vec<f32> = (0..p).flat_map(|j| rows(j, me)).collect();
            let m = want.len() / 3;
            let want = Tensor::from_vec(want, (m, 3), &CPU)
                .and_then(|x| x.to_dtype(dtype))
                .map_err(e2s)?;
            ensure(
                from == (0..p).map(|j| count(j, me)).collect::<Vec<_>>(),
                || format!("received counts {from:?}"),
            )?;
            same(&got, &want, &name)
        });
    }

    // broadcast from the first and the last rank; other ranks pass zeros.
    for (dtype, transposed, root) in [
        (DType::F32, false, 0),
        (DType::BF16, false, p - 1),
        (DType::F32, true, p / 2),
    ] {
        case += 1;
        let name = format!("broadcast root {root} {dtype:?} transposed={transposed}");
        t.check(comm, &name, || {
            let dims = [3, 5];
            let want = input(case, root, &dims, dtype, transposed);
            let x = if me == root {
                want.clone()
            } else {
                Tensor::zeros(&dims[..], dtype, &CPU).map_err(e2s)?
            };
            let got = comm.broadcast(&x, root).map_err(e2s)?;
            same(&got, &want, &name)
        });
    }

    t.check(comm, "barrier", || comm.barrier().map_err(e2s));

    // send/recv around a ring: large enough to need MPI's rendezvous protocol, so a blocking
    // MPI_Send would deadlock here; sends are buffered like the local backend's.
    let (next, prev) = ((me + 1) % p, (me + p - 1) % p);
    for (dtype, transposed, dims) in [
        (DType::F32, false, vec![256, 1024]),
        (DType::BF16, true, vec![7, 3]),
    ] {
        case += 1;
        let name = format!("send/recv ring {dtype:?} {dims:?} transposed={transposed}");
        t.check(comm, &name, || {
            let x = input(case, me, &dims, dtype, transposed);
            comm.send(&x, next).map_err(e2s)?;
            let got = comm.recv(prev, &dims.clone().into(), dtype).map_err(e2s)?;
            same(&got, &input(case, prev, &dims, dtype, transposed), &name)
        });
    }

    // exchange: one step with two tensors each way, then a full ring pass with compute between
    // posting and waiting (ring attention's pattern).
    case += 1;
    t.check(comm, "exchange: both directions, two dtypes", || {
        let a = input(case, me, &[2, 3], DType::F32, false);
        let b = input(case + 1000, me, &[4], DType::BF16, false);
        let pending = comm
            .exchange(
                vec![(next, a), (prev, b)],
                vec![
                    RecvSpec::new(prev, (2, 3), DType::F32),
                    RecvSpec::new(next, 4, DType::BF16),
                ],
            )
            .map_err(e2s)?;
        let got = pending.wait().map_err(e2s)?;
        ensure(got.len() == 2, || format!("{} tensors received", got.len()))?;
        same(
            &got[0],
            &input(case, prev, &[2, 3], DType::F32, false),
            "from prev",
        )?;
        same(
            &got[1],
            &input(case + 1000, next, &[4], DType::BF16, false),
            "from next",
        )
    });
    case += 1;
    t.check(comm, "exchange: ring pass of every block", || {
        let dims = [4, 8];
        let mut block = input(case, me, &dims, DType::F32, false);
        let mut acc = block.clone();
        for step in 1..p {
            let pending = comm
                .exchange(
                    vec![(next, block.clone())],
                    vec![RecvSpec::like(prev, &block)],
                )
                .map_err(e2s)?;
            // Work while the block is in flight.
            let _busy = block.sqr().and_then(|b| b.sum_all()).map_err(e2s)?;
            block = pending.wait().map_err(e2s)?.remove(0);
            let src = (me + p - step) % p;
            same(
                &block,
                &input(case, src, &dims, DType::F32, false),
                "ring block",
            )?;
            acc = (acc + &block).map_err(e2s)?;
        }
        // The blocks arrive in the order me, me-1, ..., so compare with that summation order.
        let order: Vec<Tensor> = (0..p)
            .map(|s| input(case, (me + p - s) % p, &dims, DType::F32, false))
            .collect();
        same(&acc, &reduce_expected(&order, ReduceOp::Sum)?, "ring sum")
    });

    case += 1;
    t.check(
        comm,
        "exchange waited on another thread during a collective",
        || {
            let x = input(case, me, &[16, 16], DType::F32, false);
            let pending = comm
                .exchange(vec![(next, x.clone())], vec![RecvSpec::like(prev, &x)])
                .map_err(e2s)?;
            let (got, sum) = std::thread::scope(|s| {
                let waiter = s.spawn(move || pending.wait());
                let sum = comm.all_reduce(&x, ReduceOp::Sum);
                (waiter.join(), sum)
            });
            let got = got
                .map_err(|_| "the waiting thread panicked".to_string())?
                .map_err(e2s)?;
            same(
                &got[0],
                &input(case, prev, &[16, 16], DType::F32, false),
                "received",
            )?;
            let xs = inputs(case, p, &[16, 16], DType::F32, false);
            same(
                &sum.map_err(e2s)?,
                &reduce_expected(&xs, ReduceOp::Sum)?,
                "all_reduce",
            )
        },
    );

    // Exact traffic of a sequence of calls, against the formulas of comm/traffic.rs.
    case += 1;
    t.check(comm, "traffic: exact payload bytes per op", || {
        comm.traffic().reset();
        let pu = p as u64;
        let f32x = |dims: &[usize]| input(case, me, dims, DType::F32, false);
        comm.all_gather(&f32x(&[4, 6]), 1).map_err(e2s)?; // N = 96 bytes
        comm.reduce_scatter(&f32x(&[4 * p, 3]), 0, ReduceOp::Sum)
            .map_err(e2s)?; // N = 48p
        comm.all_reduce(&f32x(&[2 * p, 5]), ReduceOp::Sum)
            .map_err(e2s)?; // N = 40p, divisible
        comm.all_reduce(&f32x(&[7]), ReduceOp::Max).map_err(e2s)?; // uneven chunks
        let bf = input(case, me, &[2, 2 * p, 3], DType::BF16, false); // N = 24p
        comm.all_to_all(&bf, 1, 2).map_err(e2s)?;
        comm.broadcast(&f32x(&[5]), 0).map_err(e2s)?; // N = 20
        comm.barrier().map_err(e2s)?;
        comm.send(&f32x(&[3]), next).map_err(e2s)?; // 12 bytes
        comm.recv(prev, &Shape::from(3), DType::F32).map_err(e2s)?;
        let pending = comm
            .exchange(
                vec![(next, f32x(&[2, 2])), (prev, bf.clone())],
                vec![
                    RecvSpec::new(prev, (2, 2), DType::F32),
                    RecvSpec::like(next, &bf),
                ],
            )
            .map_err(e2s)?;
        pending.wait().map_err(e2s)?;
        let got = comm.traffic().snapshot();
        let p2p = |b: u64| if p > 1 { b } else { 0 };
        let ar = all_reduce_bytes(10 * p, 4, p, me) + all_reduce_bytes(7, 4, p, me);
        let want = TrafficSnapshot {
            ops: BTreeMap::from([
                (OpKind::AllGather, stats(1, (pu - 1) * 96, (pu - 1) * 96)),
                (
                    OpKind::ReduceScatter,
                    stats(1, (pu - 1) * 48, (pu - 1) * 48),
                ),
                (OpKind::AllReduce, stats(2, ar, ar)),
                (OpKind::AllToAll, stats(1, (pu - 1) * 24, (pu - 1) * 24)),
                (
                    OpKind::Broadcast,
                    if me == 0 {
                        stats(1, (pu - 1) * 20, 0)
                    } else {
                        stats(1, 0, 20)
                    },
                ),
                (OpKind::Barrier, stats(1, 0, 0)),
                (OpKind::Send, stats(1, p2p(12), 0)),
                (OpKind::Recv, stats(1, 0, p2p(12))),
                (
                    OpKind::Exchange,
                    stats(1, p2p(16 + 24 * pu), p2p(16 + 24 * pu)),
                ),
            ]),
        };
        ensure(got == want, || format!("got {got:?}, want {want:?}"))?;
        // The 40p-byte all_reduce alone is 2(P-1)N/P.
        ensure(
            all_reduce_bytes(10 * p, 4, p, me) == 2 * (pu - 1) * 40,
            || "all_reduce formula".to_string(),
        )
    });

    // split: even/odd ranks, reversed keys; a huge color exercises the color mapping.
    case += 1;
    t.check(comm, "split: even/odd groups with reversed keys", || {
        comm.traffic().reset();
        let color = if me.is_multiple_of(2) {
            7
        } else {
            usize::MAX - 3
        };
        let sub = comm.split(color, p - me).map_err(e2s)?;
        // Members in the new order: same parity, descending rank.
        let members: Vec<usize> = (0..p).rev().filter(|r| r % 2 == me % 2).collect();
        let pos = members.iter().position(|&r| r == me).unwrap_or(usize::MAX);
        ensure(
            sub.size() == members.len() && sub.rank() == pos && sub.world_rank() == me,
            || {
                format!(
                    "sub rank {} of {} (world {}), want {pos} of {}",
                    sub.rank(),
                    sub.size(),
                    sub.world_rank(),
                    members.len()
                )
            },
        )?;
        let dims = [3, 2 * members.len()];
        let xs: Vec<Tensor> = members
            .iter()
            .map(|&r| input(case, r, &dims, DType::BF16, false))
            .collect();
        let got = sub.all_reduce(&xs[pos], ReduceOp::Sum).map_err(e2s)?;
        same(
            &got,
            &reduce_expected(&xs, ReduceOp::Sum)?,
            "sub all_reduce",
        )?;
        let got = sub.all_gather(&xs[pos], 1).map_err(e2s)?;
        same(&got, &Tensor::cat(&xs, 1).map_err(e2s)?, "sub all_gather")?;
        // Nested split: one group, same order.
        let again = sub.split(0, 0).map_err(e2s)?;
        ensure(again.rank() == pos && again.size() == members.len(), || {
            "nested split changed the order".to_string()
        })?;
        again.barrier().map_err(e2s)?;
        // Traffic is shared with the parent's accounting.
        let snap = comm.traffic().snapshot();
        let m = members.len() as u64;
        ensure(
            snap.get(OpKind::Split).calls == 2
                && snap.get(OpKind::AllGather).calls == 1
                && snap.get(OpKind::AllGather).bytes_sent == (m - 1) * 3 * 2 * m * 2,
            || format!("split traffic: {snap:?}"),
        )
    });

    // Errors: a shape mismatch is an error on every rank, not a crash or a hang.
    t.check(comm, "mismatch: all_gather shape differs on rank 0", || {
        let dims: &[usize] = if me == 0 { &[3, 2] } else { &[2, 2] };
        let x = Tensor::ones(dims, DType::F32, &CPU).map_err(e2s)?;
        let res = comm.all_gather(&x, 0);
        if p == 1 {
            return res.map(drop).map_err(e2s);
        }
        mismatch_of(res, "all_gather")
    });
    if p > 1 {
        t.check(
            comm,
            "mismatch: different collectives and arguments",
            || {
                let x = Tensor::ones((2 * p, 2), DType::F32, &CPU).map_err(e2s)?;
                let res = if me == 0 {
                    comm.all_reduce(&x, ReduceOp::Sum)
                } else {
                    comm.all_gather(&x, 0)
                };
                mismatch_of(res, "all_reduce vs all_gather")?;
                let op = if me == 0 {
                    ReduceOp::Max
                } else {
                    ReduceOp::Sum
                };
                mismatch_of(comm.reduce_scatter(&x, 0, op), "reduce_scatter Max vs Sum")
            },
        );
    }
    if opts.usable_after_mismatch {
        t.check(comm, "communicator usable after mismatches", || {
            let x = input(case, me, &[2, 3], DType::F32, false);
            let got = comm.all_reduce(&x, ReduceOp::Sum).map_err(e2s)?;
            same(
                &got,
                &reduce_expected(&inputs(case, p, &[2, 3], DType::F32, false), ReduceOp::Sum)?,
                "after mismatch",
            )
        });
    }
    t.check(comm, "invalid argument: indivisible reduce_scatter", || {
        let x = Tensor::ones((p + 1, 2), DType::F32, &CPU).map_err(e2s)?;
        match comm.reduce_scatter(&x, 0, ReduceOp::Sum) {
            Err(Error::InvalidArgument { .. }) if p > 1 => Ok(()),
            Ok(_) if p == 1 => Ok(()),
            other => Err(format!("got {:?}", other.map(|t| t.dims().to_vec()))),
        }
    });
    case += 1;
    t.check(
        comm,
        "recv: wrong expected shape is a Mismatch, next message intact",
        || {
            let a = input(case, me, &[3], DType::F32, false);
            let b = input(case + 1, me, &[2, 2], DType::BF16, false);
            comm.send(&a, next).map_err(e2s)?;
            comm.send(&b, next).map_err(e2s)?;
            let res = comm.recv(prev, &Shape::from(4), DType::F32);
            mismatch_of(res, "recv")?;
            let got = comm
                .recv(prev, &Shape::from((2, 2)), DType::BF16)
                .map_err(e2s)?;
            same(
                &got,
                &input(case + 1, prev, &[2, 2], DType::BF16, false),
                "next message",
            )
        },
    );
}

/// Every sequence-parallel attention strategy that fits the world size
/// ([`selftest::default_cases`]): out, lse, dq, dk, dv against single-device flash-ring, and
/// the explicit backward, on this backend.
pub fn attention_checks(comm: &Comm, t: &mut Tally) {
    for case in selftest::default_cases(comm.size()) {
        t.check(comm, &format!("sp attention: {}", case.name()), || {
            let r = selftest::check_case(comm, &case).map_err(e2s)?;
            ensure(r.fwd_bytes > 0 && r.bwd_bytes > 0, || {
                format!("no traffic recorded: {r:?}")
            })
        });
    }
}

/// Combines the per-rank outcomes: a check fails if it failed on any rank. Prints the report on
/// rank 0 and returns the number of failed checks.
fn report(rank: usize, names: &[String], failed_anywhere: &[bool]) -> usize {
    let failed = failed_anywhere.iter().filter(|f| **f).count();
    if rank == 0 {
        for (name, f) in names.iter().zip(failed_anywhere) {
            println!("{} {name}", if *f { "FAIL" } else { "ok  " });
        }
        println!(
            "mpi selftest: {} passed, {failed} failed",
            names.len() - failed
        );
    }
    failed
}

fn run_mpi() -> candle_parallel::Result<usize> {
    let world = MpiWorld::init()?;
    let threads = if world.thread_multiple() {
        "MPI_THREAD_MULTIPLE"
    } else {
        "serialised MPI calls"
    };
    Ok(world.launch(|comm| -> candle_parallel::Result<usize> {
        if comm.rank() == 0 {
            println!("mpi selftest on {} ranks ({threads})", comm.size());
        }
        let mut tally = Tally::default();
        backend_checks(
            &comm,
            Options {
                usable_after_mismatch: true,
            },
            &mut tally,
        );
        attention_checks(&comm, &mut tally);
        // Failure flags of every rank, combined with a max (the checks' count must match too).
        let flags: Vec<f32> = tally
            .results
            .iter()
            .map(|(_, e)| if e.is_some() { 1.0 } else { 0.0 })
            .collect();
        let n = flags.len();
        let any = comm.all_reduce(&Tensor::from_vec(flags, n, &CPU)?, ReduceOp::Max)?;
        let any: Vec<bool> = any.to_vec1::<f32>()?.iter().map(|v| *v > 0.0).collect();
        let names: Vec<String> = tally.results.into_iter().map(|(n, _)| n).collect();
        Ok(report(comm.rank(), &names, &any))
    }))
}

fn run_local(p: usize) -> candle_parallel::Result<usize> {
    println!("mpi selftest on {p} local ranks (threads)");
    let tallies = LocalWorld::run(p, |comm| -> candle_parallel::Result<Tally> {
        let mut tally = Tally::default();
        backend_checks(
            &comm,
            Options {
                usable_after_mismatch: false,
            },
            &mut tally,
        );
        attention_checks(&comm, &mut tally);
        Ok(tally)
    })?;
    let names: Vec<String> = tallies[0].results.iter().map(|(n, _)| n.clone()).collect();
    let any: Vec<bool> = (0..names.len())
        .map(|i| {
            tallies
                .iter()
                .any(|t| t.results.get(i).is_none_or(|(_, e)| e.is_some()))
        })
        .collect();
    Ok(report(0, &names, &any))
}

/// How the rank of [`run_abort_test`] fails.
#[derive(Debug, Clone, Copy)]
enum Failure {
    /// The rank's closure returns an error.
    Error,
    /// The rank panics.
    Panic,
    /// The rank's process is killed by SIGKILL (no cleanup, no MPI call).
    Signal,
}

/// Checks MPI's failure behaviour: rank `bad` fails as `how` while the others wait in a
/// barrier that can only end by the job being stopped. Exits non-zero when it works.
fn run_abort_test(bad: usize, how: Failure) -> candle_parallel::Result<usize> {
    MpiWorld::run(|comm| -> candle_parallel::Result<usize> {
        if comm.rank() == bad % comm.size() {
            match how {
                Failure::Error => {
                    return Err(candle_parallel::Error::InvalidArgument {
                        op: "abort test",
                        msg: "this rank fails on purpose".into(),
                    })
                }
                Failure::Panic => panic!("this rank panics on purpose"),
                Failure::Signal => {
                    let pid = std::process::id().to_string();
                    let _ = std::process::Command::new("kill")
                        .args(["-KILL", &pid])
                        .status();
                    // SIGKILL is not handled: the process is gone before this line.
                    std::thread::sleep(std::time::Duration::from_secs(600));
                }
            }
        }
        comm.barrier()?;
        Ok(0)
    })
}

const USAGE: &str =
    "usage: mpi_selftest [--local P | --abort-test RANK [error|panic|signal]]   (under mpirun -np P)";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |s: &str| {
        s.parse::<usize>().unwrap_or_else(|_| {
            eprintln!("{USAGE}");
            std::process::exit(2)
        })
    };
    let outcome = match args.as_slice() {
        [] => run_mpi(),
        [flag, r] if flag == "--abort-test" => run_abort_test(number(r), Failure::Error),
        [flag, r, how] if flag == "--abort-test" => {
            let how = match how.as_str() {
                "error" => Failure::Error,
                "panic" => Failure::Panic,
                "signal" => Failure::Signal,
                _ => {
                    eprintln!("{USAGE}");
                    std::process::exit(2)
                }
            };
            run_abort_test(number(r), how)
        }
        [flag, p] if flag == "--local" => run_local(number(p).max(1)),
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2)
        }
    };
    match outcome {
        Ok(0) => {}
        Ok(_) => std::process::exit(1),
        Err(e) => {
            eprintln!("mpi selftest: {e}");
            std::process::exit(1)
        }
    }
}
