//! Tests of the in-process backend [`LocalWorld`] against the [`Communicator`] contract.
//!
//! Every collective runs on world sizes 1, 2, 3, 4 and 8, on f32 and bf16 (f16 for the
//! reductions), on contiguous and non-contiguous (transposed, strided) inputs. Each rank's input
//! is distinct random non-zero data derived from a seed and its rank; the expected result is
//! computed on the test thread from all ranks' inputs with plain candle ops. Data movement must be
//! exact; reductions follow the documented semantics (contributions combined in rank order, in
//! f32 for half types), and every rank must obtain bit-identical results. The per-rank traffic of
//! every call is compared with the formulas of `comm/traffic.rs`.
//!
//! The failure tests check that a failing, panicking, exiting, slow or mismatched rank turns into
//! an error on its peers, quickly, never a hang or a panic.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::{
    Comm, LocalWorld, OpKind, OpStats, RecvSpec, ReduceOp, TrafficSnapshot,
};
use candle_parallel::Error;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type R<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SIZES: [usize; 5] = [1, 2, 3, 4, 8];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
const CPU: Device = Device::Cpu;

/// How an input tensor is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Contiguous,
    /// First and last dims swapped (a transposed view).
    Transposed,
    /// Every third element of a larger buffer (a strided view with an offset).
    Strided,
    /// A window of the last dim of a wider buffer (contiguous runs with gaps between them).
    Narrowed,
}

const LAYOUTS: [Layout; 4] = [
    Layout::Contiguous,
    Layout::Transposed,
    Layout::Strided,
    Layout::Narrowed,
];

/// Distinct random non-zero data of shape `dims` for `rank`, derived from `seed`.
fn input(seed: u64, rank: usize, dims: &[usize], dtype: DType, layout: Layout) -> Tensor {
    let mut rng = StdRng::seed_from_u64(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (rank as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let last = dims.len().saturating_sub(1);
    let layout = if dims.len() < 2 && layout == Layout::Transposed {
        Layout::Strided
    } else {
        layout
    };
    let mut gen_dims = dims.to_vec();
    match layout {
        Layout::Contiguous => {}
        Layout::Transposed => gen_dims.swap(0, last),
        Layout::Strided => gen_dims.push(3),
        Layout::Narrowed => match gen_dims.last_mut() {
            Some(d) => *d += 5,
            None => gen_dims.push(3),
        },
    }
    let n: usize = gen_dims.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(0.25..4.0);
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect();
    let t = Tensor::from_vec(data, gen_dims.clone(), &CPU)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let t = match layout {
        Layout::Contiguous => t,
        Layout::Transposed => t.transpose(0, last).unwrap(),
        Layout::Strided => {
            let d = gen_dims.len() - 1;
            t.narrow(d, 1, 1).unwrap().squeeze(d).unwrap()
        }
        Layout::Narrowed if dims.is_empty() => t.narrow(0, 2, 1).unwrap().squeeze(0).unwrap(),
        Layout::Narrowed => t.narrow(last, 2, dims[last]).unwrap(),
    };
    assert_eq!(t.dims(), dims);
    let strided = match layout {
        Layout::Contiguous => false,
        Layout::Narrowed => dims.len() >= 2,
        Layout::Transposed | Layout::Strided => !dims.is_empty(),
    };
    if strided && dims.iter().all(|&d| d > 1) {
        assert!(
            !t.is_contiguous(),
            "the {layout:?} input {dims:?} should be non-contiguous"
        );
    }
    t
}

fn inputs(seed: u64, p: usize, dims: &[usize], dtype: DType, layout: Layout) -> Vec<Tensor> {
    (0..p)
        .map(|r| input(seed, r, dims, dtype, layout))
        .collect()
}

/// The raw bits of every element, in row-major order.
fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::BF16 => t
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F16 => t
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F64 => t
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::U32 => t
            .to_vec1::<u32>()
            .unwrap()
            .iter()
            .map(|&v| v as u64)
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn payload(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// `got` is a contiguous tensor equal, bit for bit, to `want`.
fn assert_exact(got: &Tensor, want: &Tensor, ctx: &str) {
    assert_eq!(got.dims(), want.dims(), "shape of {ctx}");
    assert_eq!(got.dtype(), want.dtype(), "dtype of {ctx}");
    assert!(got.is_contiguous(), "output of {ctx} is not contiguous");
    assert!(bits(got) == bits(want), "values of {ctx} differ");
}

/// `got` is the reduction of `parts` (in rank order): f32 within 1e-6 relative to the exact
/// result; half types bit-identical to the f32 accumulation in rank order, rounded once.
fn assert_reduced(got: &Tensor, parts: &[Tensor], op: ReduceOp, ctx: &str) {
    let p = parts.len();
    assert_eq!(got.dims(), parts[0].dims(), "shape of {ctx}");
    assert_eq!(got.dtype(), parts[0].dtype(), "dtype of {ctx}");
    assert!(got.is_contiguous(), "output of {ctx} is not contiguous");
    match got.dtype() {
        DType::F32 => {
            let xs: Vec<Vec<f64>> = parts.iter().map(values).collect();
            for (i, g) in values(got).into_iter().enumerate() {
                let col = xs.iter().map(|x| x[i]);
                let scale: f64 = col.clone().map(f64::abs).sum();
                let (want, tol) = match op {
                    ReduceOp::Sum => (col.sum::<f64>(), 1e-6 * scale),
                    ReduceOp::Avg => (col.sum::<f64>() / p as f64, 1e-6 * scale / p as f64),
                    // nan-ok: the expected maximum of generated finite inputs; `g` is compared
                    // with `<=` below, which fails on NaN.
                    ReduceOp::Max => (col.fold(f64::NEG_INFINITY, f64::max), 0.0),
                };
                assert!(
                    (g - want).abs() <= tol,
                    "{ctx}: element {i} is {g}, expected {want} (tolerance {tol})"
                );
            }
        }
        DType::BF16 | DType::F16 => {
            let mut acc = parts[0].to_dtype(DType::F32).unwrap();
            for t in &parts[1..] {
                let t = t.to_dtype(DType::F32).unwrap();
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => (acc + t).unwrap(),
                    ReduceOp::Max => acc.maximum(&t).unwrap(),
                };
            }
            if op == ReduceOp::Avg {
                let div = Tensor::new(p as f32, &CPU).unwrap();
                acc = acc.broadcast_div(&div).unwrap();
            }
            let want = acc.to_dtype(got.dtype()).unwrap();
            assert!(
                bits(got) == bits(&want),
                "{ctx}: not the f32 rank-order reduction rounded to {:?}\n got {}\nwant {}",
                got.dtype(),
                got,
                want
            );
        }
        d => panic!("unexpected dtype {d:?}"),
    }
}

/// Every rank obtained bit-identical tensors.
fn assert_same_on_all_ranks(outs: &[&Tensor], ctx: &str) {
    for (r, t) in outs.iter().enumerate() {
        assert!(
            bits(t) == bits(outs[0]),
            "{ctx}: rank {r} differs from rank 0"
        );
    }
}

/// Runs one call on a rank and returns its result with the traffic it recorded.
fn measure<T>(
    comm: &Comm,
    f: impl FnOnce() -> candle_parallel::Result<T>,
) -> R<(T, TrafficSnapshot)> {
    comm.traffic().reset();
    let v = f()?;
    Ok((v, comm.traffic().snapshot()))
}

/// The snapshot holds exactly these `(kind, calls, bytes_sent, bytes_recv)` entries.
fn assert_traffic(snap: &TrafficSnapshot, want: &[(OpKind, u64, u64, u64)], ctx: &str) {
    let mut expected = TrafficSnapshot::default();
    for &(kind, calls, bytes_sent, bytes_recv) in want {
        expected.ops.insert(
            kind,
            OpStats {
                calls,
                bytes_sent,
                bytes_recv,
            },
        );
    }
    assert_eq!(snap, &expected, "traffic of {ctx}");
}

/// Bytes sent (and received) by rank `r` in an all-reduce of `n` elements of `el` bytes:
/// reduce-scatter then all-gather with chunks of ceil/floor size, the first `n % p` chunks
/// larger (traffic.rs).
fn all_reduce_bytes(n: usize, el: usize, p: usize, r: usize) -> u64 {
    let mine = n / p + usize::from(r < n % p);
    (((n - mine) + (p - 1) * mine) * el) as u64
}

/// A world whose ranks give up after 20 s: a hang fails the test instead of blocking it.
fn run<T: Send>(p: usize, f: impl Fn(Comm) -> R<T> + Sync) -> Vec<T> {
    LocalWorld::new(p)
        .with_timeout(Duration::from_secs(20))
        .launch(f)
        .unwrap_or_else(|e| panic!("world of {p} ranks failed: {e}"))
}

struct Case {
    ctx: String,
    inputs: Vec<Tensor>,
    op: ReduceOp,
    dim: usize,
}

/// Runs every all_reduce case on `p` ranks and checks each rank's result against the reduction
/// in rank order, its traffic (the closed form `2 (P-1) N / P` when `P` divides the element
/// count) and that every rank holds the same bits.
fn check_all_reduce(p: usize, cases: &[Case]) {
    let outs = run(p, |comm| {
        let r = comm.rank();
        cases
            .iter()
            .map(|c| measure(&comm, || comm.all_reduce(&c.inputs[r], c.op)))
            .collect::<R<Vec<_>>>()
    });
    for (i, c) in cases.iter().enumerate() {
        let n = c.inputs[0].elem_count();
        let el = c.inputs[0].dtype().size_in_bytes();
        for (r, out) in outs.iter().enumerate() {
            let (got, snap) = &out[i];
            assert_reduced(got, &c.inputs, c.op, &format!("{} (rank {r})", c.ctx));
            let b = all_reduce_bytes(n, el, p, r);
            if n.is_multiple_of(p) {
                assert_eq!(b, 2 * (p as u64 - 1) * payload(&c.inputs[0]) / p as u64);
            }
            assert_traffic(snap, &[(OpKind::AllReduce, 1, b, b)], &c.ctx);
        }
        let all: Vec<&Tensor> = outs.iter().map(|o| &o[i].0).collect();
        assert_same_on_all_ranks(&all, &c.ctx);
    }
}

#[test]
fn all_reduce_matches_single_rank() {
    let shapes: [&[usize]; 2] = [&[4, 6], &[3, 5, 7]];
    for p in SIZES {
        let mut cases = Vec::new();
        for (s, dims) in shapes.iter().enumerate() {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for layout in LAYOUTS {
                    for op in OPS {
                        let seed = cases.len() as u64 + 1000 * s as u64;
                        cases.push(Case {
                            ctx: format!(
                                "all_reduce {op:?} of {dtype:?} {dims:?} {layout:?} on {p} ranks"
                            ),
                            inputs: inputs(seed, p, dims, dtype, layout),
                            op,
                            dim: 0,
                        });
                    }
                }
            }
        }
        check_all_reduce(p, &cases);
    }
}

/// Tensors with fewer elements than ranks, one element, a 0-d tensor and no elements at all.
#[test]
fn all_reduce_of_tiny_tensors() {
    let shapes: [&[usize]; 5] = [&[3], &[1], &[], &[2, 1], &[0]];
    for p in SIZES {
        let mut cases = Vec::new();
        for (s, dims) in shapes.iter().enumerate() {
            for dtype in [DType::F32, DType::BF16] {
                for layout in [Layout::Contiguous, Layout::Strided] {
                    if dims.contains(&0) && layout == Layout::Strided {
                        // candle 0.11 panics converting an empty view with an offset.
                        continue;
                    }
                    for op in OPS {
                        let seed = 50_000 + cases.len() as u64 + 1000 * s as u64;
                        cases.push(Case {
                            ctx: format!(
                                "all_reduce {op:?} of {dtype:?} {dims:?} {layout:?} on {p} ranks"
                            ),
                            inputs: inputs(seed, p, dims, dtype, layout),
                            op,
                            dim: 0,
                        });
                    }
                }
            }
        }
        check_all_reduce(p, &cases);
    }
}

#[test]
fn all_gather_matches_cat() {
    let dims = [3, 4, 5];
    for p in SIZES {
        let mut cases = Vec::new();
        for dim in 0..3 {
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32] {
                for layout in LAYOUTS {
                    cases.push(Case {
                        ctx: format!(
                            "all_gather dim {dim} of {dtype:?} {dims:?} {layout:?} on {p} ranks"
                        ),
                        inputs: inputs(100 + cases.len() as u64, p, &dims, dtype, layout),
                        op: ReduceOp::Sum,
                        dim,
                    });
                }
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            cases
                .iter()
                .map(|c| measure(&comm, || comm.all_gather(&c.inputs[r], c.dim)))
                .collect::<R<Vec<_>>>()
        });
        for (i, c) in cases.iter().enumerate() {
            let want = Tensor::cat(&c.inputs, c.dim).unwrap();
            let b = (p as u64 - 1) * payload(&c.inputs[0]);
            for (r, out) in outs.iter().enumerate() {
                let (got, snap) = &out[i];
                assert_exact(got, &want, &format!("{} (rank {r})", c.ctx));
                assert_traffic(snap, &[(OpKind::AllGather, 1, b, b)], &c.ctx);
            }
        }
    }
}

/// Inputs where the order and precision of accumulation show in the result: rank 0 holds 1 and
/// every other rank a value below half an ulp of 1, so only f32 accumulation in rank order gives
/// the documented result (1 exactly for f32; 1 + (P-1)·2^-9 rounded once for bf16).
#[test]
fn reductions_accumulate_in_f32_in_rank_order() {
    for p in SIZES {
        let mk = |r: usize, small: f32, dtype: DType| {
            let v = if r == 0 { 1.0 } else { small };
            Tensor::full(v, (2, 2 * p), &CPU)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let f32s: Vec<Tensor> = (0..p).map(|r| mk(r, 2f32.powi(-24), DType::F32)).collect();
        let bf16s: Vec<Tensor> = (0..p).map(|r| mk(r, 2f32.powi(-9), DType::BF16)).collect();
        let outs = run(p, |comm| {
            let r = comm.rank();
            Ok((
                comm.all_reduce(&f32s[r], ReduceOp::Sum)?,
                comm.all_reduce(&bf16s[r], ReduceOp::Sum)?,
                comm.reduce_scatter(&bf16s[r], 1, ReduceOp::Avg)?,
            ))
        });
        let want_bf16 = bf16::from_f32(1.0 + (p - 1) as f32 * 2f32.powi(-9));
        let want_avg = bf16::from_f32((1.0 + (p - 1) as f32 * 2f32.powi(-9)) * (1.0 / p as f32));
        for (r, (sum32, sum16, avg16)) in outs.iter().enumerate() {
            let ctx = format!("{p} ranks, rank {r}");
            let ones = sum32.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(ones.iter().all(|&v| v == 1.0), "{ctx}: f32 sum {ones:?}");
            let s = sum16.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
            assert!(
                s.iter().all(|&v| v == want_bf16),
                "{ctx}: bf16 sum {s:?}, want {want_bf16}"
            );
            let a = avg16.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
            assert_eq!(a.len(), 4, "{ctx}");
            assert!(
                a.iter().all(|&v| v == want_avg),
                "{ctx}: bf16 avg {a:?}, want {want_avg}"
            );
            assert_reduced(sum16, &bf16s, ReduceOp::Sum, &ctx);
        }
    }
}

/// Reductions large enough to run on candle's thread pool (chunks of 64K elements or more), and
/// a large strided one.
#[test]
fn large_reductions() {
    for p in [2, 3] {
        let mut cases = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                cases.push(Case {
                    ctx: format!("large all_reduce {op:?} of {dtype:?} on {p} ranks"),
                    inputs: inputs(
                        4000 + cases.len() as u64,
                        p,
                        &[3, 70_001],
                        dtype,
                        Layout::Contiguous,
                    ),
                    op,
                    dim: 1,
                });
            }
        }
        let strided = inputs(4100, p, &[2, 40_000 * p], DType::BF16, Layout::Narrowed);
        let outs = run(p, |comm| {
            let r = comm.rank();
            let mut res = Vec::new();
            for c in &cases {
                res.push(comm.all_reduce(&c.inputs[r], c.op)?);
                res.push(comm.reduce_scatter(
                    &c.inputs[r].flatten_all()?.narrow(0, 0, 210_000)?,
                    0,
                    c.op,
                )?);
            }
            res.push(comm.reduce_scatter(&strided[r], 1, ReduceOp::Max)?);
            Ok(res)
        });
        for (i, c) in cases.iter().enumerate() {
            let flat: Vec<Tensor> = c.inputs.iter().map(|x| x.flatten_all().unwrap()).collect();
            let chunk = 210_000 / p;
            for (r, out) in outs.iter().enumerate() {
                assert_reduced(
                    &out[2 * i],
                    &c.inputs,
                    c.op,
                    &format!("{} (rank {r})", c.ctx),
                );
                let parts: Vec<Tensor> = flat
                    .iter()
                    .map(|x| x.narrow(0, r * chunk, chunk).unwrap())
                    .collect();
                assert_reduced(
                    &out[2 * i + 1],
                    &parts,
                    c.op,
                    &format!("reduce_scatter of {} (rank {r})", c.ctx),
                );
            }
            let all: Vec<&Tensor> = outs.iter().map(|o| &o[2 * i]).collect();
            assert_same_on_all_ranks(&all, &c.ctx);
        }
        for (r, out) in outs.iter().enumerate() {
            let parts: Vec<Tensor> = strided
                .iter()
                .map(|x| x.narrow(1, r * 40_000, 40_000).unwrap())
                .collect();
            assert_reduced(
                out.last().unwrap(),
                &parts,
                ReduceOp::Max,
                &format!("strided reduce_scatter on {p} ranks (rank {r})"),
            );
        }
    }
}

/// Ranks whose inputs have different layouts (so contiguous runs of different lengths meet in
/// one reduction), with runs long enough to be reduced in place rather than copied first.
#[test]
fn reductions_with_mixed_layouts_across_ranks() {
    for p in SIZES {
        let mut cases = Vec::new();
        for (dim, dims) in [
            (1, vec![3, 2 * p, 24]),
            (2, vec![3, 5, 32 * p]),
            (0, vec![2 * p, 40]),
        ] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for op in OPS {
                    let seed = 3000 + cases.len() as u64;
                    let xs: Vec<Tensor> = (0..p)
                        .map(|r| input(seed, r, &dims, dtype, LAYOUTS[(r + dim) % 4]))
                        .collect();
                    cases.push(Case {
                        ctx: format!(
                            "mixed-layout {op:?} dim {dim} of {dtype:?} {dims:?} on {p} ranks"
                        ),
                        inputs: xs,
                        op,
                        dim,
                    });
                }
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            cases
                .iter()
                .map(|c| {
                    let scattered = comm.reduce_scatter(&c.inputs[r], c.dim, c.op)?;
                    let reduced = comm.all_reduce(&c.inputs[r], c.op)?;
                    Ok((scattered, reduced))
                })
                .collect::<R<Vec<_>>>()
        });
        for (i, c) in cases.iter().enumerate() {
            let chunk = c.inputs[0].dim(c.dim).unwrap() / p;
            for (r, out) in outs.iter().enumerate() {
                let (scattered, reduced) = &out[i];
                let parts: Vec<Tensor> = c
                    .inputs
                    .iter()
                    .map(|x| x.narrow(c.dim, r * chunk, chunk).unwrap())
                    .collect();
                assert_reduced(
                    scattered,
                    &parts,
                    c.op,
                    &format!("reduce_scatter {} (rank {r})", c.ctx),
                );
                assert_reduced(
                    reduced,
                    &c.inputs,
                    c.op,
                    &format!("all_reduce {} (rank {r})", c.ctx),
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_reduce_then_narrow() {
    for p in SIZES {
        let mut cases = Vec::new();
        for dim in [1, 2, 0] {
            let mut dims = vec![3, 5, 2];
            dims[dim] = 2 * p;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for layout in LAYOUTS {
                    for op in OPS {
                        cases.push(Case {
                            ctx: format!(
                                "reduce_scatter {op:?} dim {dim} of {dtype:?} {dims:?} {layout:?} on {p} ranks"
                            ),
                            inputs: inputs(200 + cases.len() as u64, p, &dims, dtype, layout),
                            op,
                            dim,
                        });
                    }
                }
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            cases
                .iter()
                .map(|c| measure(&comm, || comm.reduce_scatter(&c.inputs[r], c.dim, c.op)))
                .collect::<R<Vec<_>>>()
        });
        for (i, c) in cases.iter().enumerate() {
            let chunk = c.inputs[0].dim(c.dim).unwrap() / p;
            let b = (p as u64 - 1) * payload(&c.inputs[0]) / p as u64;
            for (r, out) in outs.iter().enumerate() {
                let (got, snap) = &out[i];
                let parts: Vec<Tensor> = c
                    .inputs
                    .iter()
                    .map(|x| x.narrow(c.dim, r * chunk, chunk).unwrap())
                    .collect();
                assert_reduced(got, &parts, c.op, &format!("{} (rank {r})", c.ctx));
                assert_traffic(snap, &[(OpKind::ReduceScatter, 1, b, b)], &c.ctx);
            }
        }
    }
}

/// Rank `r`'s expected all-to-all output: chunk `r` of every rank's input, concatenated.
fn all_to_all_reference(xs: &[Tensor], r: usize, split: usize, concat: usize) -> Tensor {
    let c = xs[0].dim(split).unwrap() / xs.len();
    let parts: Vec<Tensor> = xs
        .iter()
        .map(|x| x.narrow(split, r * c, c).unwrap())
        .collect();
    Tensor::cat(&parts, concat).unwrap()
}

#[test]
fn all_to_all_ulysses_and_inverse() {
    for p in SIZES {
        // (batch, seq/P, heads, head_dim) with two heads per rank.
        let dims = [2, 3, 2 * p, 4];
        let mut cases = Vec::new();
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64, DType::U32] {
            for layout in LAYOUTS {
                cases.push(Case {
                    ctx: format!(
                        "Ulysses all_to_all of {dtype:?} {dims:?} {layout:?} on {p} ranks"
                    ),
                    inputs: inputs(300 + cases.len() as u64, p, &dims, dtype, layout),
                    op: ReduceOp::Sum,
                    dim: 0,
                });
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            cases
                .iter()
                .map(|c| {
                    let fwd = measure(&comm, || comm.all_to_all(&c.inputs[r], 2, 1))?;
                    let back = measure(&comm, || comm.all_to_all(&fwd.0, 1, 2))?;
                    Ok((fwd, back))
                })
                .collect::<R<Vec<_>>>()
        });
        for (i, c) in cases.iter().enumerate() {
            let b = (p as u64 - 1) * payload(&c.inputs[0]) / p as u64;
            for (r, out) in outs.iter().enumerate() {
                let ((seq_full, snap_fwd), (back, snap_back)) = &out[i];
                let want = all_to_all_reference(&c.inputs, r, 2, 1);
                assert_eq!(want.dims(), &[2, 3 * p, 2, 4]);
                assert_exact(seq_full, &want, &format!("{} (rank {r})", c.ctx));
                assert_exact(
                    back,
                    &c.inputs[r],
                    &format!("inverse of {} (rank {r})", c.ctx),
                );
                assert_traffic(snap_fwd, &[(OpKind::AllToAll, 1, b, b)], &c.ctx);
                assert_traffic(snap_back, &[(OpKind::AllToAll, 1, b, b)], &c.ctx);
            }
        }
    }
}

#[test]
fn all_to_all_other_dims() {
    for p in SIZES {
        let dims = [2 * p, 3, 5];
        // (split_dim, concat_dim)
        let pairs = [(0, 2), (0, 0), (0, 1)];
        let xs = inputs(400, p, &dims, DType::BF16, Layout::Transposed);
        let outs = run(p, |comm| {
            let r = comm.rank();
            pairs
                .iter()
                .map(|&(s, c)| measure(&comm, || comm.all_to_all(&xs[r], s, c)))
                .collect::<R<Vec<_>>>()
        });
        let b = (p as u64 - 1) * payload(&xs[0]) / p as u64;
        for (k, &(s, c)) in pairs.iter().enumerate() {
            let ctx = format!("all_to_all split {s} concat {c} on {p} ranks");
            for (r, out) in outs.iter().enumerate() {
                assert_exact(&out[k].0, &all_to_all_reference(&xs, r, s, c), &ctx);
                assert_traffic(&out[k].1, &[(OpKind::AllToAll, 1, b, b)], &ctx);
            }
        }
    }
}

/// Runs of 4 MiB and more are copied with streaming stores (`comm/stream_copy.rs`): all-gather
/// and all-to-all of such runs, odd lengths (an unaligned head and tail in every slot after
/// the first) in f32 and bf16, equal the reference exactly.
#[test]
fn large_runs_gather_and_exchange_exactly() {
    let p = 2;
    for (dtype, len) in [(DType::F32, (1 << 20) + 3), (DType::BF16, (1 << 21) + 5)] {
        let ctx = format!("{dtype:?} runs of {len} elements on {p} ranks");
        let parts = inputs(500, p, &[1, len], dtype, Layout::Contiguous);
        let xs = inputs(501, p, &[p, len], dtype, Layout::Contiguous);
        let outs = run(p, |comm| {
            let r = comm.rank();
            Ok((
                comm.all_gather(&parts[r], 0)?,
                comm.all_to_all(&xs[r], 0, 0)?,
            ))
        });
        let gathered = Tensor::cat(&parts, 0).unwrap();
        for (r, (g, a)) in outs.iter().enumerate() {
            assert_exact(g, &gathered, &format!("all_gather of {ctx} (rank {r})"));
            let want = all_to_all_reference(&xs, r, 0, 0);
            assert_exact(a, &want, &format!("all_to_all of {ctx} (rank {r})"));
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for p in SIZES {
        let mut cases = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            for layout in LAYOUTS {
                cases.push(Case {
                    ctx: format!("broadcast of {dtype:?} {layout:?} on {p} ranks"),
                    inputs: inputs(500 + cases.len() as u64, p, &[3, 4], dtype, layout),
                    op: ReduceOp::Sum,
                    dim: 0,
                });
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            let mut res = Vec::new();
            for c in &cases {
                for root in 0..p {
                    res.push(measure(&comm, || comm.broadcast(&c.inputs[r], root))?);
                }
            }
            Ok(res)
        });
        for (i, c) in cases.iter().enumerate() {
            let n = payload(&c.inputs[0]);
            for root in 0..p {
                let ctx = format!("{} from root {root}", c.ctx);
                for (r, out) in outs.iter().enumerate() {
                    let (got, snap) = &out[i * p + root];
                    assert_exact(got, &c.inputs[root], &format!("{ctx} (rank {r})"));
                    let (sent, recv) = if r == root {
                        ((p as u64 - 1) * n, 0)
                    } else {
                        (0, n)
                    };
                    assert_traffic(snap, &[(OpKind::Broadcast, 1, sent, recv)], &ctx);
                }
            }
        }
    }
}

#[test]
fn send_recv_around_a_ring() {
    for p in SIZES {
        let mut cases = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            for layout in LAYOUTS {
                cases.push((
                    format!("ring send/recv of {dtype:?} {layout:?} on {p} ranks"),
                    inputs(600 + cases.len() as u64, p, &[3, 4], dtype, layout),
                    inputs(700 + cases.len() as u64, p, &[2, 5], dtype, layout),
                ));
            }
        }
        let outs = run(p, |comm| {
            let r = comm.rank();
            let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
            let mut res = Vec::new();
            for (_, xs, ys) in &cases {
                // Two messages to the same peer arrive in order.
                let (got, snap) = measure(&comm, || {
                    comm.send(&xs[r], next)?;
                    comm.send(&ys[r], next)?;
                    let x = comm.recv(prev, xs[prev].shape(), xs[prev].dtype())?;
                    let y = comm.recv(prev, ys[prev].shape(), ys[prev].dtype())?;
                    Ok((x, y))
                })?;
                res.push((got, snap));
            }
            Ok(res)
        });
        for (i, (ctx, xs, ys)) in cases.iter().enumerate() {
            for (r, out) in outs.iter().enumerate() {
                let prev = (r + p - 1) % p;
                let ((x, y), snap) = &out[i];
                assert_exact(x, &xs[prev], &format!("{ctx}: first message (rank {r})"));
                assert_exact(y, &ys[prev], &format!("{ctx}: second message (rank {r})"));
                let b = if p == 1 {
                    0
                } else {
                    payload(&xs[0]) + payload(&ys[0])
                };
                assert_traffic(
                    snap,
                    &[(OpKind::Send, 2, b, 0), (OpKind::Recv, 2, 0, b)],
                    ctx,
                );
            }
        }
    }
}

#[test]
fn exchange_ring_step() {
    for p in SIZES {
        let xs = inputs(800, p, &[4, 3], DType::BF16, Layout::Transposed);
        let outs = run(p, |comm| {
            let r = comm.rank();
            let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
            let mut res = Vec::new();
            for _ in 0..3 {
                res.push(measure(&comm, || {
                    let pending = comm.exchange(
                        vec![(next, xs[r].clone())],
                        vec![RecvSpec::like(prev, &xs[prev])],
                    )?;
                    // Other communication may run while the exchange is in flight.
                    let s = comm.all_reduce(&xs[r], ReduceOp::Max)?;
                    Ok((pending.wait()?, s))
                })?);
            }
            Ok(res)
        });
        let n = payload(&xs[0]);
        for (r, out) in outs.iter().enumerate() {
            let prev = (r + p - 1) % p;
            let ctx = format!("exchange ring step on {p} ranks (rank {r})");
            for ((got, max), snap) in out {
                assert_eq!(got.len(), 1, "{ctx}");
                assert_exact(&got[0], &xs[prev], &ctx);
                assert_reduced(max, &xs, ReduceOp::Max, &ctx);
                let b = if p == 1 { 0 } else { n };
                let ar = all_reduce_bytes(12, 2, p, r);
                assert_traffic(
                    snap,
                    &[(OpKind::AllReduce, 1, ar, ar), (OpKind::Exchange, 1, b, b)],
                    &ctx,
                );
            }
        }
    }
}

/// Every rank sends a differently shaped tensor to every rank (itself included) and a second
/// one to its successor, and receives them in another order than they were posted.
#[test]
fn exchange_many_to_many() {
    for p in SIZES {
        let shape = |src: usize, dst: usize| vec![1 + src, 2 + dst];
        let msg = |src: usize, dst: usize| {
            input(
                900 + (src * p + dst) as u64,
                src,
                &shape(src, dst),
                DType::F32,
                Layout::Transposed,
            )
        };
        let extra = |src: usize| input(990, src, &[2, 2], DType::BF16, Layout::Strided);
        let outs = run(p, |comm| {
            let r = comm.rank();
            let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
            let mut sends: Vec<(usize, Tensor)> = (0..p).map(|dst| (dst, msg(r, dst))).collect();
            sends.push((next, extra(r)));
            let mut recvs: Vec<RecvSpec> = (0..p)
                .rev()
                .map(|src| RecvSpec::new(src, shape(src, r), DType::F32))
                .collect();
            // Messages from one source arrive in the order they were sent.
            recvs.push(RecvSpec::new(prev, (2, 2), DType::BF16));
            measure(&comm, || comm.exchange(sends, recvs)?.wait())
        });
        for (r, (got, snap)) in outs.iter().enumerate() {
            let prev = (r + p - 1) % p;
            let ctx = format!("many-to-many exchange on {p} ranks (rank {r})");
            assert_eq!(got.len(), p + 1, "{ctx}");
            assert_exact(&got[p], &extra(prev), &ctx);
            for (k, src) in (0..p).rev().enumerate() {
                assert_exact(&got[k], &msg(src, r), &format!("{ctx}, from rank {src}"));
            }
            let others = |f: &dyn Fn(usize) -> u64| (0..p).filter(|&j| j != r).map(f).sum::<u64>();
            let extra_b = if p == 1 { 0 } else { 8 };
            let sent = others(&|dst| payload(&msg(r, dst))) + extra_b;
            let recv = others(&|src| payload(&msg(src, r))) + extra_b;
            assert_traffic(snap, &[(OpKind::Exchange, 1, sent, recv)], &ctx);
        }
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    for p in SIZES {
        let entered: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        let outs = run(p, |comm| {
            let mut seen = Vec::new();
            let mut snaps = Vec::new();
            for (round, count) in entered.iter().enumerate() {
                // The last rank arrives late, so a barrier that does not wait lets others see it
                // missing.
                if comm.rank() + 1 == p && round.is_multiple_of(2) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                count.fetch_add(1, Ordering::SeqCst);
                let ((), snap) = measure(&comm, || comm.barrier())?;
                seen.push(count.load(Ordering::SeqCst));
                snaps.push(snap);
            }
            Ok((seen, snaps))
        });
        for (r, (seen, snaps)) in outs.iter().enumerate() {
            assert_eq!(
                seen,
                &vec![p; 4],
                "ranks that passed the barrier on {p} ranks (rank {r})"
            );
            for snap in snaps {
                assert_traffic(snap, &[(OpKind::Barrier, 1, 0, 0)], "barrier");
            }
        }
    }
}

#[test]
fn split_even_odd_with_reversed_keys() {
    for p in SIZES {
        let xs = inputs(1000, p, &[3, 4], DType::BF16, Layout::Transposed);
        let ys = inputs(1001, p, &[5], DType::F32, Layout::Contiguous);
        // Members of a color, in the new rank order: keys are reversed ranks.
        let members =
            |color: usize| -> Vec<usize> { (0..p).rev().filter(|r| r % 2 == color).collect() };
        let outs = run(p, |comm| {
            let r = comm.rank();
            let (sub, split_snap) = measure(&comm, || comm.split(r % 2, p - r))?;
            // Subgroup collectives interleaved with parent collectives.
            let gathered = sub.all_gather(&xs[r], 0)?;
            let parent_sum = comm.all_reduce(&ys[r], ReduceOp::Sum)?;
            let sub_sum = sub.all_reduce(&xs[r], ReduceOp::Sum)?;
            comm.barrier()?;
            let from_root = sub.broadcast(&ys[r], 0)?;
            // A split of the subgroup into itself.
            let nested = sub.split(7, sub.rank())?;
            let nested_sum = nested.all_reduce(&xs[r], ReduceOp::Sum)?;
            let shared_traffic = sub.traffic().snapshot() == comm.traffic().snapshot();
            Ok((
                (sub.size(), sub.rank(), sub.world_rank(), comm.world_rank()),
                (nested.size(), nested.rank(), nested.world_rank()),
                (gathered, parent_sum, sub_sum, from_root, nested_sum),
                split_snap,
                shared_traffic,
            ))
        });
        for (r, out) in outs.iter().enumerate() {
            let ctx = format!("split of {p} ranks (rank {r})");
            let (
                ids,
                nested_ids,
                (gathered, parent_sum, sub_sum, from_root, nested_sum),
                snap,
                shared,
            ) = out;
            let m = members(r % 2);
            let sub_rank = m.iter().position(|&j| j == r).unwrap();
            assert_eq!(
                *ids,
                (m.len(), sub_rank, r, r),
                "{ctx}: (size, rank, world_rank)"
            );
            assert_eq!(*nested_ids, (m.len(), sub_rank, r), "{ctx}: nested split");
            assert_traffic(snap, &[(OpKind::Split, 1, 0, 0)], &ctx);
            assert!(
                shared,
                "{ctx}: a subgroup does not share its rank's traffic"
            );
            let sub_xs: Vec<Tensor> = m.iter().map(|&j| xs[j].clone()).collect();
            assert_exact(
                gathered,
                &Tensor::cat(&sub_xs, 0).unwrap(),
                &format!("{ctx}: all_gather"),
            );
            assert_reduced(
                sub_sum,
                &sub_xs,
                ReduceOp::Sum,
                &format!("{ctx}: sub all_reduce"),
            );
            assert_reduced(
                nested_sum,
                &sub_xs,
                ReduceOp::Sum,
                &format!("{ctx}: nested all_reduce"),
            );
            assert_reduced(
                parent_sum,
                &ys,
                ReduceOp::Sum,
                &format!("{ctx}: parent all_reduce"),
            );
            assert_exact(from_root, &ys[m[0]], &format!("{ctx}: sub broadcast"));
        }
        let sums: Vec<&Tensor> = outs.iter().map(|o| &o.2 .1).collect();
        assert_same_on_all_ranks(&sums, "parent all_reduce after split");
    }
}

/// Traffic of a subgroup collective follows the formulas with the subgroup's size.
#[test]
fn split_traffic_uses_the_group_size() {
    let p = 8;
    let xs = inputs(1100, p, &[4, 6], DType::F32, Layout::Contiguous);
    let outs = run(p, |comm| {
        let r = comm.rank();
        // Groups of 4 consecutive ranks (a tp=4 layout), then groups of 2 with stride 4.
        let tp = comm.split(r / 4, r)?;
        let dp = comm.split(r % 4, r)?;
        let a = measure(&comm, || tp.all_gather(&xs[r], 1))?;
        let b = measure(&comm, || dp.all_reduce(&xs[r], ReduceOp::Avg))?;
        Ok((a, b, tp.rank(), dp.rank()))
    });
    let n = payload(&xs[0]);
    for (r, ((gathered, snap_tp), (avg, snap_dp), tp_rank, dp_rank)) in outs.iter().enumerate() {
        assert_eq!((*tp_rank, *dp_rank), (r % 4, r / 4));
        let tp_group: Vec<Tensor> = (0..4).map(|j| xs[4 * (r / 4) + j].clone()).collect();
        let dp_group: Vec<Tensor> = (0..2).map(|j| xs[r % 4 + 4 * j].clone()).collect();
        assert_exact(
            gathered,
            &Tensor::cat(&tp_group, 1).unwrap(),
            "tp all_gather",
        );
        assert_reduced(avg, &dp_group, ReduceOp::Avg, "dp all_reduce");
        assert_traffic(
            snap_tp,
            &[(OpKind::AllGather, 1, 3 * n, 3 * n)],
            "tp all_gather",
        );
        assert_traffic(snap_dp, &[(OpKind::AllReduce, 1, n, n)], "dp all_reduce");
    }
}

// ---------------------------------------------------------------------------------------------
// Failures. Every world here has a short timeout, so a hang fails the test within seconds.

fn small_world(p: usize) -> LocalWorld {
    LocalWorld::new(p).with_timeout(Duration::from_secs(3))
}

fn ones(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::ones(dims, dtype, &CPU).unwrap()
}

/// What a blocked rank runs while a peer fails.
#[derive(Debug, Clone, Copy)]
enum Blocked {
    AllReduce,
    AllGather,
    Barrier,
    Recv,
    Exchange,
}

const BLOCKED: [Blocked; 5] = [
    Blocked::AllReduce,
    Blocked::AllGather,
    Blocked::Barrier,
    Blocked::Recv,
    Blocked::Exchange,
];

fn blocked_call(comm: &Comm, what: Blocked) -> candle_parallel::Result<()> {
    let x = ones(&[4, 4], DType::F32);
    let failing = 2;
    match what {
        Blocked::AllReduce => comm.all_reduce(&x, ReduceOp::Sum).map(drop),
        Blocked::AllGather => comm.all_gather(&x, 1).map(drop),
        Blocked::Barrier => comm.barrier(),
        Blocked::Recv => comm.recv(failing, x.shape(), DType::F32).map(drop),
        Blocked::Exchange => comm
            .exchange(
                vec![(failing, x.clone())],
                vec![RecvSpec::like(failing, &x)],
            )?
            .wait()
            .map(drop),
    }
}

/// How rank 2 fails.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Failure {
    Error,
    Panic,
}

fn fail(how: Failure) -> R<()> {
    std::thread::sleep(Duration::from_millis(30));
    match how {
        Failure::Error => Err("rank two gives up".into()),
        Failure::Panic => panic!("rank two explodes"),
    }
}

fn failure_text(how: Failure) -> &'static str {
    match how {
        Failure::Error => "rank two gives up",
        Failure::Panic => "rank two explodes",
    }
}

/// Runs one world of a failure test, which must end well before the worlds' 3 s timeout: a
/// failure reaches the peers through the world, not by their timing out.
fn quick<T>(f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let v = f();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    v
}

/// Ranks blocked in a call while rank 2 errors or panics see `PeerFailed { rank: 2 }` at once.
#[test]
fn failing_rank_unblocks_peers_with_peer_failed() {
    for how in [Failure::Error, Failure::Panic] {
        for what in BLOCKED {
            let res = quick(|| {
                small_world(4).launch_each(|comm| -> R<String> {
                    if comm.rank() == 2 {
                        fail(how)?;
                    }
                    match blocked_call(&comm, what) {
                        Err(Error::PeerFailed { rank: 2, reason }) => Ok(reason),
                        other => {
                            Err(format!("expected PeerFailed {{ rank: 2 }}, got {other:?}").into())
                        }
                    }
                })
            });
            for (r, res) in res.iter().enumerate() {
                let ctx = format!("{how:?} of rank 2 during {what:?} (rank {r})");
                match (r, res) {
                    (2, Err(Error::PeerFailed { rank: 2, reason })) => {
                        assert!(reason.contains(failure_text(how)), "{ctx}: {reason}");
                        if how == Failure::Panic {
                            assert!(reason.contains("panicked"), "{ctx}: {reason}");
                        }
                    }
                    (2, other) => panic!("{ctx}: {other:?}"),
                    (_, Ok(reason)) => {
                        assert!(reason.contains(failure_text(how)), "{ctx}: {reason}")
                    }
                    (_, Err(e)) => panic!("{ctx}: {e}"),
                }
            }
        }
    }
}

/// When the peers propagate the error, every rank's outcome names rank 2 and `launch`/`run`
/// report `PeerFailed { rank: 2 }`.
#[test]
fn failing_rank_is_named_by_every_outcome() {
    for how in [Failure::Error, Failure::Panic] {
        let body = |comm: Comm| -> R<()> {
            if comm.rank() == 2 {
                fail(how)?;
            }
            comm.all_reduce(&ones(&[8], DType::BF16), ReduceOp::Sum)?;
            Ok(())
        };
        let res = quick(|| small_world(4).launch_each(body));
        assert_eq!(res.len(), 4);
        for (r, res) in res.iter().enumerate() {
            let e = res.as_ref().expect_err("a rank succeeded");
            assert!(
                matches!(e, Error::PeerFailed { rank, .. } if *rank == r),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(text.contains("rank 2"), "{how:?}, rank {r}: {text}");
        }
        match quick(|| small_world(4).launch(body)) {
            Err(Error::PeerFailed { rank: 2, reason }) => {
                assert!(reason.contains(failure_text(how)), "{reason}")
            }
            other => panic!("{how:?}: launch returned {other:?}"),
        }
        // `LocalWorld::run` has the default (long) timeout: watch it from outside.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let res = LocalWorld::run(4, |comm| -> R<()> {
                if comm.rank() == 2 {
                    fail(how)?;
                }
                comm.barrier()?;
                Ok(())
            });
            let _ = tx.send(res);
        });
        let run_res = rx
            .recv_timeout(Duration::from_secs(2))
            .expect("LocalWorld::run did not return within 2 s");
        assert!(
            matches!(run_res, Err(Error::PeerFailed { rank: 2, .. })),
            "{run_res:?}"
        );
    }
}

/// A rank that skips a collective and returns normally: peers waiting for it get `PeerExited`.
#[test]
fn rank_exiting_early_is_reported_as_peer_exited() {
    for what in [
        Blocked::AllReduce,
        Blocked::AllGather,
        Blocked::Barrier,
        Blocked::Recv,
    ] {
        let res = quick(|| {
            small_world(4).launch_each(|comm| -> R<Option<Error>> {
                if comm.rank() == 2 {
                    return Ok(None);
                }
                match blocked_call(&comm, what) {
                    Ok(()) => Err("completed without rank 2".into()),
                    Err(e) => Ok(Some(e)),
                }
            })
        });
        for (r, res) in res.into_iter().enumerate() {
            let ctx = format!("rank 2 skips {what:?} (rank {r})");
            let e = res.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            match (r, e) {
                (2, None) => {}
                (_, Some(Error::PeerExited { me, peer: 2, .. })) if me == r => {}
                (_, other) => panic!("{ctx}: {other:?}"),
            }
        }
    }
    // With `launch`, the first rank to report it fails the world, naming rank 2.
    let res = quick(|| {
        small_world(3).launch(|comm| -> R<()> {
            if comm.rank() != 2 {
                comm.all_reduce(&ones(&[3], DType::F32), ReduceOp::Sum)?;
            }
            Ok(())
        })
    });
    match res {
        Err(Error::PeerFailed { rank, reason }) => {
            assert!(
                rank != 2 && reason.contains("rank 2 exited"),
                "{rank}: {reason}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// A rank slower than the timeout: the others get `Timeout` naming it, after the timeout.
#[test]
fn slow_rank_times_out_its_peers() {
    let timeout = Duration::from_millis(200);
    let start = Instant::now();
    let res = LocalWorld::new(3).with_timeout(timeout).launch_each(
        |comm| -> R<Option<(Error, Duration)>> {
            let x = ones(&[6], DType::F32);
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(700));
                // Too late: whatever this returns, the others have given up.
                let _ = comm.all_reduce(&x, ReduceOp::Sum);
                return Ok(None);
            }
            let t0 = Instant::now();
            match comm.all_reduce(&x, ReduceOp::Sum) {
                Ok(_) => Err("completed without rank 1".into()),
                Err(e) => Ok(Some((e, t0.elapsed()))),
            }
        },
    );
    for (r, res) in res.into_iter().enumerate() {
        let out = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        match (r, out) {
            (1, None) => {}
            (
                _,
                Some((
                    Error::Timeout {
                        me, peer: 1, secs, ..
                    },
                    waited,
                )),
            ) if me == r => {
                assert!(waited >= timeout, "rank {r} gave up after {waited:?}");
                assert!(
                    waited < Duration::from_millis(600),
                    "rank {r} gave up after {waited:?}"
                );
                assert!(secs >= 0.2, "{secs}");
            }
            (_, other) => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
}

/// Runs `f` on `p` ranks and returns the error each rank got (None where it succeeded).
fn errors_of(
    p: usize,
    f: impl Fn(&Comm) -> candle_parallel::Result<()> + Sync,
) -> Vec<Option<Error>> {
    let start = Instant::now();
    let res = small_world(p).launch_each(|comm| -> R<Option<Error>> { Ok(f(&comm).err()) });
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    res.into_iter()
        .enumerate()
        .map(|(r, e)| e.unwrap_or_else(|e| panic!("rank {r} failed: {e}")))
        .collect()
}

/// Every rank in `ranks` got a `Mismatch` naming itself and `peer(rank)`.
fn assert_mismatch(
    errs: &[Option<Error>],
    ranks: &[usize],
    peer: impl Fn(usize) -> usize,
    ctx: &str,
) {
    for &r in ranks {
        match &errs[r] {
            Some(e @ Error::Mismatch { me, peer: q, .. }) => {
                assert_eq!((*me, *q), (r, peer(r)), "{ctx}: {e}");
                let text = e.to_string();
                assert!(text.contains(&format!("rank {r}")), "{ctx}: {text}");
                assert!(text.contains(&format!("rank {}", peer(r))), "{ctx}: {text}");
            }
            other => panic!("{ctx}: rank {r} got {other:?}, expected a mismatch"),
        }
    }
}

#[test]
fn shape_and_dtype_mismatches() {
    // all_gather: rank 2 has a different shape, then a different dtype.
    let errs = errors_of(3, |c| {
        let dims: &[usize] = if c.rank() == 2 { &[2, 4] } else { &[2, 3] };
        c.all_gather(&ones(dims, DType::F32), 0).map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |_| 2, "all_gather shape");
    assert_mismatch(&errs, &[2], |_| 0, "all_gather shape");
    let errs = errors_of(2, |c| {
        let dtype = if c.rank() == 1 {
            DType::BF16
        } else {
            DType::F32
        };
        c.all_gather(&ones(&[2, 3], dtype), 1).map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_gather dtype");

    // all_reduce: different element counts, same count but another shape, another dtype.
    for (ctx, a, b) in [
        ("all_reduce size", vec![2, 3], vec![2, 4]),
        ("all_reduce shape", vec![2, 3], vec![3, 2]),
        ("all_reduce rank", vec![6], vec![2, 3]),
    ] {
        let errs = errors_of(2, |c| {
            let dims = if c.rank() == 1 { &b } else { &a };
            c.all_reduce(&ones(dims, DType::F32), ReduceOp::Sum)
                .map(drop)
        });
        assert_mismatch(&errs, &[0, 1], |r| 1 - r, ctx);
    }
    let errs = errors_of(4, |c| {
        let dtype = if c.rank() == 3 {
            DType::F16
        } else {
            DType::BF16
        };
        c.all_reduce(&ones(&[4, 4], dtype), ReduceOp::Avg).map(drop)
    });
    assert_mismatch(&errs, &[0, 1, 2], |_| 3, "all_reduce dtype");
    assert_mismatch(&errs, &[3], |_| 0, "all_reduce dtype");

    // reduce_scatter and all_to_all with a different shape on rank 1.
    let errs = errors_of(2, |c| {
        let dims: &[usize] = if c.rank() == 1 { &[3, 4] } else { &[2, 4] };
        c.reduce_scatter(&ones(dims, DType::F32), 1, ReduceOp::Sum)
            .map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "reduce_scatter shape");
    let errs = errors_of(2, |c| {
        let dims: &[usize] = if c.rank() == 1 {
            &[2, 2, 4]
        } else {
            &[2, 3, 4]
        };
        c.all_to_all(&ones(dims, DType::F32), 2, 1).map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_to_all shape");

    // broadcast: a non-root rank passing another shape is told so.
    let errs = errors_of(2, |c| {
        let dims: &[usize] = if c.rank() == 1 { &[3, 2] } else { &[2, 3] };
        c.broadcast(&ones(dims, DType::F32), 0).map(drop)
    });
    assert!(errs[0].is_none(), "{:?}", errs[0]);
    assert_mismatch(&errs, &[1], |_| 0, "broadcast shape");
}

#[test]
fn mismatched_calls_and_arguments() {
    let x = ones(&[4, 4], DType::F32);
    // Different collectives.
    let errs = errors_of(2, |c| {
        if c.rank() == 0 {
            c.all_gather(&x, 0).map(drop)
        } else {
            c.all_reduce(&x, ReduceOp::Sum).map(drop)
        }
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_gather vs all_reduce");
    let errs = errors_of(3, |c| {
        if c.rank() == 1 {
            c.barrier()
        } else {
            c.split(0, 0).map(drop)
        }
    });
    assert_mismatch(&errs, &[0, 2], |_| 1, "split vs barrier");
    assert_mismatch(&errs, &[1], |_| 0, "split vs barrier");
    // Same collective, different arguments.
    let errs = errors_of(2, |c| {
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        c.all_reduce(&x, op).map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_reduce Sum vs Max");
    let errs = errors_of(2, |c| c.all_gather(&x, c.rank()).map(drop));
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_gather dims");
    let errs = errors_of(2, |c| {
        c.reduce_scatter(&x, c.rank(), ReduceOp::Sum).map(drop)
    });
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "reduce_scatter dims");
    let errs = errors_of(2, |c| c.all_to_all(&x, 0, c.rank()).map(drop));
    assert_mismatch(&errs, &[0, 1], |r| 1 - r, "all_to_all dims");
}

#[test]
fn invalid_arguments_are_errors_and_leave_the_world_usable() {
    let p = 3;
    let outs = small_world(p).launch(|comm| -> R<Vec<Error>> {
        let x = ones(&[4, 6], DType::F32);
        let me = comm.rank();
        let mut errs = Vec::new();
        let mut push = |r: candle_parallel::Result<()>| match r {
            Ok(()) => Err::<(), Box<dyn std::error::Error + Send + Sync>>(
                "an invalid call succeeded".into(),
            ),
            Err(e) => {
                errs.push(e);
                Ok(())
            }
        };
        push(comm.all_gather(&x, 2).map(drop))?;
        push(comm.reduce_scatter(&x, 2, ReduceOp::Sum).map(drop))?;
        push(comm.reduce_scatter(&x, 0, ReduceOp::Sum).map(drop))?; // 4 rows on 3 ranks
        push(comm.all_to_all(&x, 0, 1).map(drop))?;
        push(comm.all_to_all(&x, 1, 5).map(drop))?;
        push(comm.broadcast(&x, p).map(drop))?;
        push(comm.send(&x, p))?;
        push(comm.recv(p, x.shape(), DType::F32).map(drop))?;
        push(comm.exchange(vec![(p, x.clone())], vec![]).map(drop))?;
        push(
            comm.exchange(vec![], vec![RecvSpec::like(p + 4, &x)])
                .map(drop),
        )?;
        // Receives that expect another shape or dtype than what was sent.
        let (next, prev) = ((me + 1) % p, (me + p - 1) % p);
        comm.send(&x, next)?;
        comm.send(&x, next)?;
        comm.send(&x, next)?;
        push(comm.recv(prev, &(6, 4).into(), DType::F32).map(drop))?;
        push(comm.recv(prev, x.shape(), DType::BF16).map(drop))?;
        push(
            comm.exchange(vec![], vec![RecvSpec::new(prev, 24, DType::F32)])?
                .wait()
                .map(drop),
        )?;
        // The world still works.
        let s = comm.all_reduce(&x, ReduceOp::Sum)?;
        if s.flatten_all()?.to_vec1::<f32>()? != vec![p as f32; 24] {
            return Err("wrong all_reduce after the invalid calls".into());
        }
        comm.barrier()?;
        Ok(errs)
    });
    let outs = outs.unwrap_or_else(|e| panic!("{e}"));
    for (r, errs) in outs.iter().enumerate() {
        assert_eq!(errs.len(), 13, "rank {r}: {errs:?}");
        for (k, e) in errs.iter().enumerate() {
            if k < 10 {
                assert!(
                    matches!(e, Error::InvalidArgument { .. }),
                    "rank {r}, call {k}: {e:?}"
                );
            } else {
                assert!(
                    matches!(e, Error::Mismatch { me, peer, .. } if *me == r && *peer == (r + p - 1) % p),
                    "rank {r}, call {k}: {e:?}"
                );
            }
        }
    }
}

#[test]
fn empty_world_is_an_error() {
    assert!(LocalWorld::new(0).launch(|_| Ok::<_, String>(())).is_err());
}

/// `all_to_all_v` on 1 to 8 ranks with uneven counts, some chunks empty (rank `r` sends
/// `(3r + 5j + 1) % 4` rows to rank `j`; ranks `2, 5, 8` send none at all and rank 1 receives
/// none): each rank receives,
/// bit for bit, the rows addressed to it in source-rank order (each row names its source,
/// destination and index), with the count from each rank; f32 and bf16. A wrong count is an
/// error naming the call.
#[test]
fn all_to_all_v_delivers_uneven_chunks_in_rank_order() {
    for p in 1..=8 {
        for dtype in [DType::F32, DType::BF16] {
            let count = |r: usize, j: usize| {
                if r % 3 == 2 || j == 1 {
                    0
                } else {
                    (3 * r + 5 * j + 1) % 4
                }
            };
            if p >= 3 {
                assert!((0..p).all(|j| count(2, j) == 0) && (0..p).all(|r| count(r, 1) == 0));
                assert!((0..p).any(|r| (0..p).any(|j| count(r, j) > 0)));
            }
            let rows = |src: usize, dst: usize| -> Vec<f32> {
                (0..count(src, dst))
                    .flat_map(|i| [src as f32, dst as f32, i as f32])
                    .collect()
            };
            run(p, |comm| -> R<()> {
                let me = comm.rank();
                let mine: Vec<f32> = (0..p).flat_map(|j| rows(me, j)).collect();
                let x = Tensor::from_vec(mine.clone(), (mine.len() / 3, 3), &Device::Cpu)?
                    .to_dtype(dtype)?;
                let sends: Vec<usize> = (0..p).map(|j| count(me, j)).collect();
                let (got, from) = comm.all_to_all_v(&x, &sends)?;
                let want: Vec<f32> = (0..p).flat_map(|j| rows(j, me)).collect();
                let want = Tensor::from_vec(want.clone(), (want.len() / 3, 3), &Device::Cpu)?
                    .to_dtype(dtype)?;
                assert_exact(&got, &want, &format!("p={p} {dtype:?} rank {me}"));
                assert_eq!(from, (0..p).map(|j| count(j, me)).collect::<Vec<_>>());
                let bad = comm
                    .all_to_all_v(&x, &vec![0; p + 1])
                    .unwrap_err()
                    .to_string();
                assert!(bad.contains("all_to_all_v"), "{bad}");
                Ok(())
            });
        }
    }
}
