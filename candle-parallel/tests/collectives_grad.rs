//! Gradients of every differentiable collective, on 1, 2, 3, 4 and 8 local ranks, compared with
//! the same computation on one rank with plain candle ops.
//!
//! Each test builds a global computation from random non-zero inputs and a non-linear loss
//! (`Σ y² ⊙ w` with a random `w`, or a matmul chain), computes the reference gradients with
//! respect to global `Var`s, then runs the sharded computation on every rank (each rank's shard
//! a `Var`), calls `backward()` on each rank's loss and compares each rank's gradients with the
//! matching slice of the reference gradients (f32, relative error `max|a - b| / max|ref|`).
//!
//! Two loss semantics appear (see `candle_parallel::collectives`):
//! - *sum over ranks*: each rank's loss covers its part of the global loss; the global loss is
//!   the sum of the per-rank losses;
//! - *replicated*: every rank computes the whole global loss identically.
//!
//! A missing gradient is an error (the rank fails, so the test fails).

mod common;
use common::grad;
use common::{rand_t, world};

use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_parallel::collectives::{
    all_gather, all_to_all, copy_to_parallel_region, gather, reduce_from_parallel_region,
    reduce_scatter, scatter,
};
use candle_parallel::comm::LocalWorld;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// World sizes under test; every sharded dim below is a multiple of 24.
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];
const TOL: f64 = 1e-5;

fn rand_ts(rng: &mut StdRng, n: usize, dims: &[usize]) -> Vec<Tensor> {
    (0..n).map(|_| rand_t(rng, dims)).collect()
}

/// Chunk `r` of `p` equal chunks of `t` along `dim`.
fn chunk(t: &Tensor, dim: usize, p: usize, r: usize) -> Result<Tensor> {
    let c = t.dim(dim)? / p;
    t.narrow(dim, r * c, c)
}

/// `Σ y² ⊙ w`: non-linear, so the gradients depend on the forward values.
fn weighted_sq(y: &Tensor, w: &Tensor) -> Result<Tensor> {
    (y.sqr()? * w)?.sum_all()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    common::assert_close(got, want, TOL, what);
}

/// Sum over ranks. Each rank `r` holds `X[chunk r along dim]`; `all_gather` rebuilds `X` on every
/// rank and rank `r`'s loss is `Σ X² ⊙ W_r`. Reference: `Σ_r Σ X² ⊙ W_r`.
#[test]
fn all_gather_grad() {
    let mut rng = StdRng::seed_from_u64(1);
    let shape = [24, 24, 3];
    for dim in [0, 1] {
        for p in WORLDS {
            let x = rand_t(&mut rng, &shape);
            let ws = rand_ts(&mut rng, p, &shape);
            let xv = Var::from_tensor(&x).unwrap();
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
            for w in &ws {
                loss = (loss + weighted_sq(xv.as_tensor(), w).unwrap()).unwrap();
            }
            let gx = grad(&loss.backward().unwrap(), &xv, "x").unwrap();

            let out = world(p, |comm| {
                let r = comm.rank();
                let xr = Var::from_tensor(&chunk(&x, dim, p, r)?)?;
                let y = all_gather(&xr, &comm, dim)?;
                let g = weighted_sq(&y, &ws[r])?.backward()?;
                Ok((y.detach(), grad(&g, &xr, "x shard")?))
            });
            for (r, (y, g)) in out.iter().enumerate() {
                let what = format!("all_gather dim {dim}, P={p}, rank {r}");
                assert_close(y, &x, &format!("{what}: forward"));
                assert_close(g, &chunk(&gx, dim, p, r).unwrap(), &what);
            }
        }
    }
}

/// Sum over ranks. Rank `r` holds a full-size `X_r`; `reduce_scatter` gives chunk `r` of
/// `S = Σ_r X_r` and rank `r`'s loss is `Σ chunk_r(S)² ⊙ W_r`.
#[test]
fn reduce_scatter_grad() {
    let mut rng = StdRng::seed_from_u64(2);
    let shape = [24, 24, 3];
    for dim in [0, 1] {
        for p in WORLDS {
            let xs = rand_ts(&mut rng, p, &shape);
            let mut wshape = shape;
            wshape[dim] /= p;
            let ws = rand_ts(&mut rng, p, &wshape);
            let xvs: Vec<Var> = xs.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
            let mut s = xvs[0].as_tensor().clone();
            for xv in &xvs[1..] {
                s = (s + xv.as_tensor()).unwrap();
            }
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
            for (r, w) in ws.iter().enumerate() {
                let part = weighted_sq(&chunk(&s, dim, p, r).unwrap(), w).unwrap();
                loss = (loss + part).unwrap();
            }
            let grads = loss.backward().unwrap();
            let s = s.detach();

            let out = world(p, |comm| {
                let r = comm.rank();
                let xr = Var::from_tensor(&xs[r])?;
                let y = reduce_scatter(&xr, &comm, dim)?;
                let g = weighted_sq(&y, &ws[r])?.backward()?;
                Ok((y.detach(), grad(&g, &xr, "x_r")?))
            });
            for (r, (y, g)) in out.iter().enumerate() {
                let what = format!("reduce_scatter dim {dim}, P={p}, rank {r}");
                assert_close(y, &chunk(&s, dim, p, r).unwrap(), &format!("{what}: fwd"));
                assert_close(g, &grad(&grads, &xvs[r], "x_r").unwrap(), &what);
            }
        }
    }
}

/// Sum over ranks. `X` is replicated; rank `r`'s loss is `Σ f(X)² ⊙ W_r`; every rank gets the
/// full gradient of `Σ_r Σ X² ⊙ W_r`.
#[test]
fn copy_to_parallel_region_grad() {
    let mut rng = StdRng::seed_from_u64(3);
    for p in WORLDS {
        let x = rand_t(&mut rng, &[24, 5]);
        let ws = rand_ts(&mut rng, p, &[24, 5]);
        let xv = Var::from_tensor(&x).unwrap();
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for w in &ws {
            loss = (loss + weighted_sq(xv.as_tensor(), w).unwrap()).unwrap();
        }
        let gx = grad(&loss.backward().unwrap(), &xv, "x").unwrap();

        let out = world(p, |comm| {
            let xr = Var::from_tensor(&x)?;
            let y = copy_to_parallel_region(&xr, &comm)?;
            let g = weighted_sq(&y, &ws[comm.rank()])?.backward()?;
            Ok((y.detach(), grad(&g, &xr, "x")?))
        });
        for (r, (y, g)) in out.iter().enumerate() {
            let what = format!("copy_to_parallel_region P={p}, rank {r}");
            assert_close(y, &x, &format!("{what}: forward"));
            assert_close(g, &gx, &what);
        }
    }
}

/// Replicated. Rank `r` holds a partial `X_r`; `reduce_from_parallel_region` gives
/// `S = Σ_r X_r` everywhere and every rank computes `L = Σ S² ⊙ W`.
#[test]
fn reduce_from_parallel_region_grad() {
    let mut rng = StdRng::seed_from_u64(4);
    for p in WORLDS {
        let xs = rand_ts(&mut rng, p, &[24, 5]);
        let w = rand_t(&mut rng, &[24, 5]);
        let xvs: Vec<Var> = xs.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
        let mut s = xvs[0].as_tensor().clone();
        for xv in &xvs[1..] {
            s = (s + xv.as_tensor()).unwrap();
        }
        let grads = weighted_sq(&s, &w).unwrap().backward().unwrap();
        let s = s.detach();

        let out = world(p, |comm| {
            let xr = Var::from_tensor(&xs[comm.rank()])?;
            let y = reduce_from_parallel_region(&xr, &comm)?;
            let g = weighted_sq(&y, &w)?.backward()?;
            Ok((y.detach(), grad(&g, &xr, "x_r")?))
        });
        for (r, (y, g)) in out.iter().enumerate() {
            let what = format!("reduce_from_parallel_region P={p}, rank {r}");
            assert_close(y, &s, &format!("{what}: forward"));
            assert_close(g, &grad(&grads, &xvs[r], "x_r").unwrap(), &what);
        }
    }
}

/// The single-device gradients of `L = Σ (tanh(X A) B)² ⊙ W` with respect to X, A and B.
fn mlp_reference(x: &Tensor, a: &Tensor, b: &Tensor, w: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (xv, av, bv) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(a).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let z = xv.matmul(&av).unwrap().tanh().unwrap().matmul(&bv).unwrap();
    let grads = weighted_sq(&z, w).unwrap().backward().unwrap();
    (
        grad(&grads, &xv, "x").unwrap(),
        grad(&grads, &av, "a").unwrap(),
        grad(&grads, &bv, "b").unwrap(),
    )
}

/// Replicated (Megatron tensor-parallel MLP, a chain of `f` and `g`): `X` replicated, `A`
/// column-sharded, `B` row-sharded, `Z = g(tanh(f(X) A_r) B_r)`, every rank computes
/// `L = Σ Z² ⊙ W`. Reference: `Z = tanh(X A) B`.
#[test]
fn megatron_mlp_f_g_chain_grad() {
    let mut rng = StdRng::seed_from_u64(5);
    for p in WORLDS {
        let x = rand_t(&mut rng, &[6, 8]);
        let a = rand_t(&mut rng, &[8, 24]);
        let b = rand_t(&mut rng, &[24, 8]);
        let w = rand_t(&mut rng, &[6, 8]);
        let (gx, ga, gb) = mlp_reference(&x, &a, &b, &w);

        let out = world(p, |comm| {
            let r = comm.rank();
            let xr = Var::from_tensor(&x)?;
            let ar = Var::from_tensor(&chunk(&a, 1, p, r)?)?;
            let br = Var::from_tensor(&chunk(&b, 0, p, r)?)?;
            let h = copy_to_parallel_region(&xr, &comm)?.matmul(&ar)?.tanh()?;
            let z = reduce_from_parallel_region(&h.matmul(&br)?, &comm)?;
            let g = weighted_sq(&z, &w)?.backward()?;
            Ok((
                grad(&g, &xr, "x")?,
                grad(&g, &ar, "a")?,
                grad(&g, &br, "b")?,
            ))
        });
        for (r, (gxr, gar, gbr)) in out.iter().enumerate() {
            let what = format!("Megatron MLP P={p}, rank {r}");
            assert_close(gxr, &gx, &format!("{what}: x"));
            assert_close(gar, &chunk(&ga, 1, p, r).unwrap(), &format!("{what}: a"));
            assert_close(gbr, &chunk(&gb, 0, p, r).unwrap(), &format!("{what}: b"));
        }
    }
}

/// Sum over ranks (sequence-parallel MLP, a chain of `all_gather` and `reduce_scatter`): rank
/// `r` holds sequence chunk `X_r`, `A` column-sharded, `B` row-sharded;
/// `Z_r = reduce_scatter(tanh(all_gather(X_r) A_r) B_r)` is sequence chunk `r` of
/// `Z = tanh(X A) B`, and rank `r`'s loss is `Σ Z_r² ⊙ W_r`.
#[test]
fn sequence_parallel_mlp_chain_grad() {
    let mut rng = StdRng::seed_from_u64(6);
    for p in WORLDS {
        let x = rand_t(&mut rng, &[24, 8]);
        let a = rand_t(&mut rng, &[8, 24]);
        let b = rand_t(&mut rng, &[24, 8]);
        let w = rand_t(&mut rng, &[24, 8]);
        let (gx, ga, gb) = mlp_reference(&x, &a, &b, &w);

        let out = world(p, |comm| {
            let r = comm.rank();
            let xr = Var::from_tensor(&chunk(&x, 0, p, r)?)?;
            let ar = Var::from_tensor(&chunk(&a, 1, p, r)?)?;
            let br = Var::from_tensor(&chunk(&b, 0, p, r)?)?;
            let h = all_gather(&xr, &comm, 0)?.matmul(&ar)?.tanh()?;
            let z = reduce_scatter(&h.matmul(&br)?, &comm, 0)?;
            let g = weighted_sq(&z, &chunk(&w, 0, p, r)?)?.backward()?;
            Ok((
                grad(&g, &xr, "x")?,
                grad(&g, &ar, "a")?,
                grad(&g, &br, "b")?,
            ))
        });
        for (r, (gxr, gar, gbr)) in out.iter().enumerate() {
            let what = format!("sequence-parallel MLP P={p}, rank {r}");
            assert_close(gxr, &chunk(&gx, 0, p, r).unwrap(), &format!("{what}: x"));
            assert_close(gar, &chunk(&ga, 1, p, r).unwrap(), &format!("{what}: a"));
            assert_close(gbr, &chunk(&gb, 0, p, r).unwrap(), &format!("{what}: b"));
        }
    }
}

/// Ulysses layout: `(b, s, h, d) = (2, 24, 24, 3)`.
const QKV: [usize; 4] = [2, 24, 24, 3];

/// Sum over ranks. Rank `r` holds sequence chunk `r` of `Q` `(b, s/P, h, d)`;
/// `all_to_all(.., 2, 1)` gives head chunk `r` `(b, s, h/P, d)`, and rank `r`'s loss is
/// `Σ Q[heads r]² ⊙ W[heads r]`.
#[test]
fn all_to_all_ulysses_grad() {
    let mut rng = StdRng::seed_from_u64(7);
    for p in WORLDS {
        let q = rand_t(&mut rng, &QKV);
        let w = rand_t(&mut rng, &QKV);
        let qv = Var::from_tensor(&q).unwrap();
        let grads = weighted_sq(qv.as_tensor(), &w).unwrap().backward().unwrap();
        let gq = grad(&grads, &qv, "q").unwrap();

        let out = world(p, |comm| {
            let r = comm.rank();
            let qr = Var::from_tensor(&chunk(&q, 1, p, r)?)?;
            let y = all_to_all(&qr, &comm, 2, 1)?;
            let g = weighted_sq(&y, &chunk(&w, 2, p, r)?)?.backward()?;
            Ok((y.detach(), grad(&g, &qr, "q shard")?))
        });
        for (r, (y, g)) in out.iter().enumerate() {
            let what = format!("all_to_all P={p}, rank {r}");
            assert_close(y, &chunk(&q, 2, p, r).unwrap(), &format!("{what}: forward"));
            assert_close(g, &chunk(&gq, 1, p, r).unwrap(), &what);
        }
    }
}

/// Per-head sequence mixing `(b, s, h, d) -> (b, s, h, d)`, attention-like: `(T Tᵀ) T` per head,
/// returned as a non-contiguous view.
fn mix_per_head(t: &Tensor) -> Result<Tensor> {
    let t = t.permute((0, 2, 1, 3))?.contiguous()?;
    let scores = (t.matmul(&t.t()?)? * 0.1)?;
    scores.matmul(&t)?.permute((0, 2, 1, 3))
}

/// Sum over ranks (Ulysses chain: sequence-to-head all-to-all, per-head mixing over the whole
/// sequence, head-to-sequence all-to-all): rank `r`'s loss is `Σ O[seq r]² ⊙ W[seq r]`, with
/// `O = mix_per_head(Q)`.
#[test]
fn all_to_all_ulysses_round_trip_chain_grad() {
    let mut rng = StdRng::seed_from_u64(8);
    for p in WORLDS {
        let q = rand_t(&mut rng, &QKV);
        let w = rand_t(&mut rng, &QKV);
        let qv = Var::from_tensor(&q).unwrap();
        let o = mix_per_head(qv.as_tensor()).unwrap();
        let grads = weighted_sq(&o, &w).unwrap().backward().unwrap();
        let gq = grad(&grads, &qv, "q").unwrap();
        let o = o.detach();

        let out = world(p, |comm| {
            let r = comm.rank();
            let qr = Var::from_tensor(&chunk(&q, 1, p, r)?)?;
            let heads = all_to_all(&qr, &comm, 2, 1)?;
            let or = all_to_all(&mix_per_head(&heads)?, &comm, 1, 2)?;
            let g = weighted_sq(&or, &chunk(&w, 1, p, r)?)?.backward()?;
            Ok((or.detach(), grad(&g, &qr, "q shard")?))
        });
        for (r, (or, g)) in out.iter().enumerate() {
            let what = format!("Ulysses round trip P={p}, rank {r}");
            assert_close(
                or,
                &chunk(&o, 1, p, r).unwrap(),
                &format!("{what}: forward"),
            );
            assert_close(g, &chunk(&gq, 1, p, r).unwrap(), &what);
        }
    }
}

/// Sum over ranks. `X` is replicated; `scatter` keeps chunk `r` and rank `r`'s loss is
/// `Σ X[chunk r]² ⊙ W[chunk r]`; every rank gets the full gradient of `Σ X² ⊙ W`.
#[test]
fn scatter_grad() {
    let mut rng = StdRng::seed_from_u64(9);
    let shape = [24, 24];
    for dim in [0, 1] {
        for p in WORLDS {
            let x = rand_t(&mut rng, &shape);
            let w = rand_t(&mut rng, &shape);
            let xv = Var::from_tensor(&x).unwrap();
            let grads = weighted_sq(xv.as_tensor(), &w).unwrap().backward().unwrap();
            let gx = grad(&grads, &xv, "x").unwrap();

            let out = world(p, |comm| {
                let r = comm.rank();
                let xr = Var::from_tensor(&x)?;
                let y = scatter(&xr, &comm, dim)?;
                let g = weighted_sq(&y, &chunk(&w, dim, p, r)?)?.backward()?;
                Ok((y.detach(), grad(&g, &xr, "x")?))
            });
            for (r, (y, g)) in out.iter().enumerate() {
                let what = format!("scatter dim {dim}, P={p}, rank {r}");
                assert_close(y, &chunk(&x, dim, p, r).unwrap(), &format!("{what}: fwd"));
                assert_close(g, &gx, &what);
            }
        }
    }
}

/// Replicated. Rank `r` holds chunk `r` of `X`; `gather` rebuilds `X` and every rank computes
/// `L = Σ X² ⊙ W`.
#[test]
fn gather_grad() {
    let mut rng = StdRng::seed_from_u64(10);
    let shape = [24, 24];
    for dim in [0, 1] {
        for p in WORLDS {
            let x = rand_t(&mut rng, &shape);
            let w = rand_t(&mut rng, &shape);
            let xv = Var::from_tensor(&x).unwrap();
            let grads = weighted_sq(xv.as_tensor(), &w).unwrap().backward().unwrap();
            let gx = grad(&grads, &xv, "x").unwrap();

            let out = world(p, |comm| {
                let xr = Var::from_tensor(&chunk(&x, dim, p, comm.rank())?)?;
                let y = gather(&xr, &comm, dim)?;
                let g = weighted_sq(&y, &w)?.backward()?;
                Ok((y.detach(), grad(&g, &xr, "x shard")?))
            });
            for (r, (y, g)) in out.iter().enumerate() {
                let what = format!("gather dim {dim}, P={p}, rank {r}");
                assert_close(y, &x, &format!("{what}: forward"));
                assert_close(g, &chunk(&gx, dim, p, r).unwrap(), &what);
            }
        }
    }
}

/// Replicated (sequence-parallel region between a scatter and a gather): `X` and `A`
/// replicated, `Z = gather(tanh(scatter(X) A))`, every rank computes `L = Σ Z² ⊙ W`. `X` gets
/// the full gradient on every rank; `A` only sees its rank's rows of `X`, so its per-rank
/// gradients are partial and sum to the reference.
#[test]
fn scatter_compute_gather_chain_grad() {
    let mut rng = StdRng::seed_from_u64(11);
    for p in WORLDS {
        let x = rand_t(&mut rng, &[24, 6]);
        let a = rand_t(&mut rng, &[6, 6]);
        let w = rand_t(&mut rng, &[24, 6]);
        let (xv, av) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&a).unwrap());
        let z = xv.matmul(&av).unwrap().tanh().unwrap();
        let grads = weighted_sq(&z, &w).unwrap().backward().unwrap();
        let (gx, ga) = (
            grad(&grads, &xv, "x").unwrap(),
            grad(&grads, &av, "a").unwrap(),
        );

        let out = world(p, |comm| {
            let xr = Var::from_tensor(&x)?;
            let ar = Var::from_tensor(&a)?;
            let h = scatter(&xr, &comm, 0)?.matmul(&ar)?.tanh()?;
            let z = gather(&h, &comm, 0)?;
            let g = weighted_sq(&z, &w)?.backward()?;
            Ok((grad(&g, &xr, "x")?, grad(&g, &ar, "a")?))
        });
        let mut ga_sum = out[0].1.zeros_like().unwrap();
        for (r, (gxr, gar)) in out.iter().enumerate() {
            assert_close(
                gxr,
                &gx,
                &format!("scatter-gather chain P={p}, rank {r}: x"),
            );
            ga_sum = (ga_sum + gar).unwrap();
        }
        assert_close(
            &ga_sum,
            &ga,
            &format!("scatter-gather chain P={p}: Σ_r grad a"),
        );
    }
}

/// Sum over ranks, a branching graph with three collectives and a shared input: rank `r` holds
/// row chunk `x_r` of `X` and a full-size `Z_r`; `A = all_gather(x_r, 0)`,
/// `b_r = reduce_scatter(Z_r, 0)`, `C = all_gather(b_r ⊙ x_r, 1)`, and rank `r`'s loss is
/// `Σ A² ⊙ W_r + Σ C² ⊙ V_r`. `x_r` collects gradient from two backward collectives. The local
/// backend checks that every rank issues them in the same order.
#[test]
fn branching_graph_grad() {
    let mut rng = StdRng::seed_from_u64(12);
    for p in WORLDS {
        let x = rand_t(&mut rng, &[24, 6]);
        let zs = rand_ts(&mut rng, p, &[24, 6]);
        let ws = rand_ts(&mut rng, p, &[24, 6]);
        let vs = rand_ts(&mut rng, p, &[24 / p, 6 * p]);
        let xv = Var::from_tensor(&x).unwrap();
        let zvs: Vec<Var> = zs.iter().map(|z| Var::from_tensor(z).unwrap()).collect();
        let reference = || -> Result<Tensor> {
            let mut s = zvs[0].as_tensor().clone();
            for zv in &zvs[1..] {
                s = (s + zv.as_tensor())?;
            }
            let parts = (0..p)
                .map(|r| chunk(&s, 0, p, r)? * chunk(&xv, 0, p, r)?)
                .collect::<Result<Vec<_>>>()?;
            let c = Tensor::cat(&parts, 1)?;
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
            for (w, v) in ws.iter().zip(&vs) {
                loss = (loss + weighted_sq(&xv, w)? + weighted_sq(&c, v)?)?;
            }
            Ok(loss)
        };
        let grads = reference().unwrap().backward().unwrap();
        let gx = grad(&grads, &xv, "x").unwrap();

        let out = world(p, |comm| {
            let r = comm.rank();
            let xr = Var::from_tensor(&chunk(&x, 0, p, r)?)?;
            let zr = Var::from_tensor(&zs[r])?;
            let a = all_gather(&xr, &comm, 0)?;
            let b = reduce_scatter(&zr, &comm, 0)?;
            let c = all_gather(&(b * xr.as_tensor())?, &comm, 1)?;
            let loss = (weighted_sq(&a, &ws[r])? + weighted_sq(&c, &vs[r])?)?;
            let g = loss.backward()?;
            Ok((grad(&g, &xr, "x shard")?, grad(&g, &zr, "z_r")?))
        });
        for (r, (gxr, gzr)) in out.iter().enumerate() {
            let what = format!("branching graph P={p}, rank {r}");
            let gz = grad(&grads, &zvs[r], "z_r").unwrap();
            assert_close(gxr, &chunk(&gx, 0, p, r).unwrap(), &format!("{what}: x"));
            assert_close(gzr, &gz, &format!("{what}: z"));
        }
    }
}

/// Rank 1's input does not reach a `Var`, so its `all_gather` node is pruned from backward and
/// it never joins the reduce-scatter that rank 0 waits for. The local backend reports it as an
/// error on rank 0 instead of hanging: `PeerExited` when rank 1 has returned, `Timeout` while it
/// is still busy. Wrapping rank 1's input in a `Var` fixes it.
#[test]
fn pruned_backward_collective_is_an_error_not_a_hang() {
    let x = Tensor::arange(0f32, 8., &Device::Cpu).unwrap();
    let w = Tensor::ones(16, DType::F32, &Device::Cpu).unwrap();
    for rank1_busy in [false, true] {
        // Without the hazard being reported, the busy case would wait 300 ms and the other
        // 10 s; with it, rank 0 fails as soon as rank 1 exits.
        let timeout = Duration::from_millis(if rank1_busy { 300 } else { 10_000 });
        let ranks = LocalWorld::new(2).with_timeout(timeout);
        let outcomes = ranks.launch_each(|comm| -> Result<()> {
            let input = if comm.rank() == 0 {
                Var::from_tensor(&x)?.as_tensor().clone()
            } else {
                x.clone()
            };
            let y = all_gather(&input, &comm, 0)?;
            weighted_sq(&y, &w)?.backward()?;
            if rank1_busy && comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            Ok(())
        });
        assert!(
            outcomes[1].is_ok(),
            "rank 1: {:?}",
            outcomes[1].as_ref().err()
        );
        let msg = outcomes[0]
            .as_ref()
            .expect_err("rank 0 must fail in backward")
            .to_string();
        let expected = if rank1_busy {
            "timed out"
        } else {
            "exited without sending"
        };
        assert!(msg.contains(expected), "rank 0 error: {msg}");
    }

    // The fix: every rank's input reaches a Var.
    let grads = world(2, |comm| {
        let input = Var::from_tensor(&x)?;
        let y = all_gather(&input, &comm, 0)?;
        let g = weighted_sq(&y, &w)?.backward()?;
        grad(&g, &input, "x")
    });
    let want = (&x * 4.0).unwrap();
    for g in &grads {
        assert_close(g, &want, "all_gather with Var inputs on every rank");
    }
}

/// Without gradient tracking nothing is recorded and the collective's plain result comes back;
/// other dtypes and negative dims go through the same path.
#[test]
fn untracked_inputs_half_precision_and_negative_dims() {
    let x = Tensor::arange(0f32, 12., &Device::Cpu)
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let out = world(2, |comm| {
        let r = comm.rank() as f64;
        let plain = all_gather(&(&x + r)?, &comm, candle_core::D::Minus1)?;
        let tracked = Var::from_tensor(&(&x + r)?.to_dtype(DType::BF16)?)?;
        let half = gather(&tracked, &comm, candle_core::D::Minus1)?;
        let g = half.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let gt = grad(&g, &tracked, "bf16 input")?;
        Ok((plain, half, gt))
    });
    let want = Tensor::cat(&[&x, &(&x + 1.0).unwrap()], 1).unwrap();
    for (plain, half, gt) in &out {
        assert!(!plain.track_op());
        assert_close(plain, &want, "untracked all_gather");
        assert!(half.track_op());
        assert_eq!(half.dtype(), DType::BF16);
        assert_close(&half.to_dtype(DType::F32).unwrap(), &want, "bf16 gather");
        assert_eq!(gt.dtype(), DType::BF16);
        let ones = Tensor::ones((3, 4), DType::F32, &Device::Cpu).unwrap();
        assert_close(&gt.to_dtype(DType::F32).unwrap(), &ones, "bf16 gather grad");
    }
}

#[test]
fn scatter_rejects_indivisible_dims() {
    let x = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap();
    let outcomes = LocalWorld::new(2).launch_each(|comm| scatter(&x, &comm, 0).map(|_| ()));
    for o in outcomes {
        let msg = o
            .expect_err("5 rows cannot be split over 2 ranks")
            .to_string();
        assert!(msg.contains("not divisible"), "{msg}");
    }
}
