//! Tensor-parallel linear layers (`ColumnParallelLinear`, `RowParallelLinear`) on 1, 2 and 4
//! local ranks against the plain single-device `y = x W^T + b`, with and without biases, with
//! `gather_output` / `input_is_parallel` on and off, and with and without Megatron sequence
//! parallelism (TP-sp: `TpActivations::SequenceSharded`), plus a column → row MLP pair.
//!
//! Every rank builds its layer from its slice of one random global weight (and bias), runs
//! forward on random non-zero input, and backpropagates `Σ y ⊙ G` for a random output weight `G`
//! (so the upstream gradient is `G`). Every parameter and input is a `Var`; a missing gradient
//! is an error (the rank fails, so the test fails). The test then puts every rank's output and
//! gradients back into global form (concatenating slices, or summing the partial bias gradients
//! of a row-parallel layer under TP-sp) and compares them with the single-device output and
//! autograd gradients: f32, relative error `max|a - b| / max|ref|` at most 1e-5.
//!
//! Loss semantics (see `candle_parallel::collectives`): where a layer returns the same full
//! output on every rank (`gather_output`, or a row-parallel layer without TP-sp) every rank
//! computes the whole loss `Σ y ⊙ G`; where it returns this rank's part (column slice, or
//! under TP-sp the token chunk) each rank computes its part of the loss, the parts summing to
//! the global loss.

mod common;
use common::grad;
use common::{rand_t, world};

use candle_core::{DType, Result, Tensor, Var};
use candle_parallel::nn::{
    ColumnOutput, ColumnParallelLinear, RowInput, RowParallelLinear, TpActivations, TpGroup,
};

/// The activations of TP-sp (`sp`) or plain tensor parallelism.
fn activations(sp: bool) -> TpActivations {
    if sp {
        TpActivations::SequenceSharded
    } else {
        TpActivations::Replicated
    }
}
use rand::rngs::StdRng;
use rand::SeedableRng;

const WORLDS: [usize; 3] = [1, 2, 4];
const TOL: f64 = 1e-5;
/// Batch, tokens, input and output features: tokens and features divide over 4 ranks.
const B: usize = 2;
const T: usize = 8;
const IN: usize = 12;
const OUT: usize = 16;

/// Chunk `r` of `p` equal chunks of `t` along `dim`.
fn chunk(t: &Tensor, dim: usize, p: usize, r: usize) -> Result<Tensor> {
    let c = t.dim(dim)? / p;
    t.narrow(dim, r * c, c)
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), DType::F32, "{what}: dtype");
    common::assert_close(got, want, TOL, what);
}

fn cat(parts: &[Tensor], dim: usize) -> Tensor {
    Tensor::cat(parts, dim).unwrap()
}

fn sum(parts: &[Tensor]) -> Tensor {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc = (acc + p).unwrap();
    }
    acc
}

/// The plain single-device `x W^T + b` on `(B, T, in)` input, as one 2-D matmul.
fn plain_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (b_, t, i) = x.dims3()?;
    let y = x.reshape((b_ * t, i))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    y.reshape((b_, t, w.dim(0)?))
}

/// One layer's global data and its single-device output and gradients.
struct Reference {
    x: Tensor,
    w: Tensor,
    b: Option<Tensor>,
    /// The output weight: the loss is `Σ y ⊙ g`.
    g: Tensor,
    y: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Option<Tensor>,
}

fn reference(rng: &mut StdRng, with_bias: bool) -> Reference {
    let x = rand_t(rng, &[B, T, IN]);
    let w = rand_t(rng, &[OUT, IN]);
    let b = with_bias.then(|| rand_t(rng, &[OUT]));
    let g = rand_t(rng, &[B, T, OUT]);
    let xv = Var::from_tensor(&x).unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let bv = b.as_ref().map(|b| Var::from_tensor(b).unwrap());
    let y = plain_linear(
        xv.as_tensor(),
        wv.as_tensor(),
        bv.as_ref().map(|b| b.as_tensor()),
    )
    .unwrap();
    let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    Reference {
        dx: grad(&grads, &xv, "reference x").unwrap(),
        dw: grad(&grads, &wv, "reference w").unwrap(),
        db: bv.as_ref().map(|b| grad(&grads, b, "reference b").unwrap()),
        y: y.detach(),
        x,
        w,
        b,
        g,
    }
}

/// What one rank hands back: its output and the gradients of its input, weight and bias.
struct RankOut {
    y: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Option<Tensor>,
}

/// The rank's loss part, backward, and every gradient (an error if one is missing).
fn backprop(
    y: Tensor,
    g: &Tensor,
    x: &Var,
    w: &Var,
    b: Option<&Var>,
    rank: usize,
) -> Result<RankOut> {
    let grads = (&y * g)?.sum_all()?.backward()?;
    Ok(RankOut {
        dx: grad(&grads, x, &format!("rank {rank}: input"))?,
        dw: grad(&grads, w, &format!("rank {rank}: weight slice"))?,
        db: b
            .map(|b| grad(&grads, b, &format!("rank {rank}: bias")))
            .transpose()?,
        y,
    })
}

/// Column-parallel: rank `r` holds rows `r` of `W` and of `b`; the input is the full `x`, or
/// under TP-sp token chunk `r` of it.
fn check_column(rf: &Reference, p: usize, sp: bool, gather_output: bool) {
    let what = format!(
        "column p={p} sp={sp} gather_output={gather_output} bias={}",
        rf.b.is_some()
    );
    let ranks = world(p, |comm| {
        let r = comm.rank();
        let tp = TpGroup::new(comm, activations(sp));
        // TP-sp is off on one rank: the layer then sees the plain layout.
        assert_eq!(tp.sequence_parallel(), sp && p > 1);
        let w = Var::from_tensor(&chunk(&rf.w, 0, p, r)?)?;
        let b =
            rf.b.as_ref()
                .map(|b| Var::from_tensor(&chunk(b, 0, p, r)?))
                .transpose()?;
        let x = if tp.sequence_parallel() {
            chunk(&rf.x, 1, p, r)?
        } else {
            rf.x.clone()
        };
        let x = Var::from_tensor(&x)?;
        let output = if gather_output {
            ColumnOutput::Gathered
        } else {
            ColumnOutput::Sharded
        };
        let layer = ColumnParallelLinear::from_weights(
            w.as_tensor().clone(),
            b.as_ref().map(|b| b.as_tensor().clone()),
            tp,
            output,
        );
        let y = layer.forward(x.as_tensor())?;
        // Gathered: every rank computes the whole loss; otherwise its columns of it.
        let g = if gather_output {
            rf.g.clone()
        } else {
            chunk(&rf.g, 2, p, r)?
        };
        backprop(y, &g, &x, &w, b.as_ref(), r)
    });
    let sp = sp && p > 1;
    let ys: Vec<Tensor> = ranks.iter().map(|o| o.y.clone()).collect();
    if gather_output {
        for (r, y) in ys.iter().enumerate() {
            assert_close(y, &rf.y, &format!("{what}: rank {r} output"));
        }
    } else {
        assert_close(&cat(&ys, 2), &rf.y, &format!("{what}: output columns"));
    }
    let dxs: Vec<Tensor> = ranks.iter().map(|o| o.dx.clone()).collect();
    if sp {
        assert_close(&cat(&dxs, 1), &rf.dx, &format!("{what}: input grad tokens"));
    } else {
        for (r, dx) in dxs.iter().enumerate() {
            assert_close(dx, &rf.dx, &format!("{what}: rank {r} input grad"));
        }
    }
    let dws: Vec<Tensor> = ranks.iter().map(|o| o.dw.clone()).collect();
    assert_close(&cat(&dws, 0), &rf.dw, &format!("{what}: weight grad rows"));
    if let Some(db) = &rf.db {
        let dbs: Vec<Tensor> = ranks
            .iter()
            .map(|o| o.db.clone().expect("a bias gradient"))
            .collect();
        assert_close(&cat(&dbs, 0), db, &format!("{what}: bias grad"));
    }
}

/// Row-parallel: rank `r` holds columns `r` of `W` and the whole (replicated) `b`; the input is
/// columns `r` of the full `x` (`input_is_parallel`) or the full `x`. The output is the full
/// `y`, or under TP-sp token chunk `r` of it.
fn check_row(rf: &Reference, p: usize, sp: bool, input_is_parallel: bool) {
    let what = format!(
        "row p={p} sp={sp} input_is_parallel={input_is_parallel} bias={}",
        rf.b.is_some()
    );
    let ranks = world(p, |comm| {
        let r = comm.rank();
        let tp = TpGroup::new(comm, activations(sp));
        // TP-sp is off on one rank: the layer then sees the plain layout.
        assert_eq!(tp.sequence_parallel(), sp && p > 1);
        let w = Var::from_tensor(&chunk(&rf.w, 1, p, r)?)?;
        let b = rf.b.as_ref().map(Var::from_tensor).transpose()?;
        let x = if input_is_parallel {
            chunk(&rf.x, 2, p, r)?
        } else {
            rf.x.clone()
        };
        let x = Var::from_tensor(&x)?;
        let g = if tp.sequence_parallel() {
            chunk(&rf.g, 1, p, r)?
        } else {
            rf.g.clone()
        };
        let input = if input_is_parallel {
            RowInput::Sharded
        } else {
            RowInput::Whole
        };
        let layer = RowParallelLinear::from_weights(
            w.as_tensor().clone(),
            b.as_ref().map(|b| b.as_tensor().clone()),
            tp,
            input,
        );
        let y = layer.forward(x.as_tensor())?;
        backprop(y, &g, &x, &w, b.as_ref(), r)
    });
    let sp = sp && p > 1;
    let ys: Vec<Tensor> = ranks.iter().map(|o| o.y.clone()).collect();
    if sp {
        assert_close(&cat(&ys, 1), &rf.y, &format!("{what}: output tokens"));
    } else {
        for (r, y) in ys.iter().enumerate() {
            assert_close(y, &rf.y, &format!("{what}: rank {r} output"));
        }
    }
    let dxs: Vec<Tensor> = ranks.iter().map(|o| o.dx.clone()).collect();
    if input_is_parallel {
        assert_close(
            &cat(&dxs, 2),
            &rf.dx,
            &format!("{what}: input grad columns"),
        );
    } else {
        for (r, dx) in dxs.iter().enumerate() {
            assert_close(dx, &rf.dx, &format!("{what}: rank {r} input grad"));
        }
    }
    let dws: Vec<Tensor> = ranks.iter().map(|o| o.dw.clone()).collect();
    assert_close(
        &cat(&dws, 1),
        &rf.dw,
        &format!("{what}: weight grad columns"),
    );
    if let Some(db) = &rf.db {
        let dbs: Vec<Tensor> = ranks
            .iter()
            .map(|o| o.db.clone().expect("a bias gradient"))
            .collect();
        if sp {
            // The replicated bias only sees this rank's tokens: rank r's gradient is the sum of
            // G over token chunk r, and the sum over ranks (the caller's all-reduce) is db.
            for (r, d) in dbs.iter().enumerate() {
                let want = chunk(&rf.g, 1, p, r).unwrap().sum((0, 1)).unwrap();
                assert_close(d, &want, &format!("{what}: rank {r} partial bias grad"));
            }
            assert_close(&sum(&dbs), db, &format!("{what}: summed bias grad"));
        } else {
            for (r, d) in dbs.iter().enumerate() {
                assert_close(d, db, &format!("{what}: rank {r} bias grad"));
            }
        }
    }
}

#[test]
fn column_parallel_linear_matches_single_device() {
    let mut rng = StdRng::seed_from_u64(1);
    for with_bias in [true, false] {
        let rf = reference(&mut rng, with_bias);
        for p in WORLDS {
            for sp in [false, true] {
                for gather_output in [false, true] {
                    check_column(&rf, p, sp, gather_output);
                }
            }
        }
    }
}

#[test]
fn row_parallel_linear_matches_single_device() {
    let mut rng = StdRng::seed_from_u64(2);
    for with_bias in [true, false] {
        let rf = reference(&mut rng, with_bias);
        for p in WORLDS {
            for sp in [false, true] {
                for input_is_parallel in [false, true] {
                    check_row(&rf, p, sp, input_is_parallel);
                }
            }
        }
    }
}

/// Megatron's pair: column-parallel (no gather) then row-parallel (input is parallel), both
/// with biases: `y = (x W1^T + b1) W2^T + b2`, one all-reduce (or under TP-sp one all-gather
/// and one reduce-scatter) in each direction.
#[test]
fn column_then_row_matches_single_device() {
    const MID: usize = 20;
    let mut rng = StdRng::seed_from_u64(3);
    let x = rand_t(&mut rng, &[B, T, IN]);
    let w1 = rand_t(&mut rng, &[MID, IN]);
    let b1 = rand_t(&mut rng, &[MID]);
    let w2 = rand_t(&mut rng, &[OUT, MID]);
    let b2 = rand_t(&mut rng, &[OUT]);
    let g = rand_t(&mut rng, &[B, T, OUT]);
    let vars: Vec<Var> = [&x, &w1, &b1, &w2, &b2]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let [xv, w1v, b1v, w2v, b2v] = &vars[..] else {
        unreachable!()
    };
    let h = plain_linear(xv.as_tensor(), w1v.as_tensor(), Some(b1v.as_tensor())).unwrap();
    let y_ref = plain_linear(&h, w2v.as_tensor(), Some(b2v.as_tensor())).unwrap();
    let grads = (&y_ref * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let rg = |v: &Var| grad(&grads, v, "reference").unwrap();
    let (dx, dw1, db1, dw2, db2) = (rg(xv), rg(w1v), rg(b1v), rg(w2v), rg(b2v));

    for p in [2, 4] {
        for sp in [false, true] {
            let what = format!("column→row p={p} sp={sp}");
            let ranks = world(p, |comm| {
                let r = comm.rank();
                let tp = TpGroup::new(comm, activations(sp));
                // TP-sp is off on one rank: the layer then sees the plain layout.
                assert_eq!(tp.sequence_parallel(), sp && p > 1);
                let w1 = Var::from_tensor(&chunk(&w1, 0, p, r)?)?;
                let b1 = Var::from_tensor(&chunk(&b1, 0, p, r)?)?;
                let w2 = Var::from_tensor(&chunk(&w2, 1, p, r)?)?;
                let b2 = Var::from_tensor(&b2)?;
                let (xl, gl) = if sp {
                    (chunk(&x, 1, p, r)?, chunk(&g, 1, p, r)?)
                } else {
                    (x.clone(), g.clone())
                };
                let xl = Var::from_tensor(&xl)?;
                let up = ColumnParallelLinear::from_weights(
                    w1.as_tensor().clone(),
                    Some(b1.as_tensor().clone()),
                    tp.clone(),
                    ColumnOutput::Sharded,
                );
                let down = RowParallelLinear::from_weights(
                    w2.as_tensor().clone(),
                    Some(b2.as_tensor().clone()),
                    tp,
                    RowInput::Sharded,
                );
                let y = down.forward(&up.forward(xl.as_tensor())?)?;
                let grads = (&y * &gl)?.sum_all()?.backward()?;
                let gr = |v: &Var, n: &str| grad(&grads, v, &format!("rank {r}: {n}"));
                Ok([
                    y.clone(),
                    gr(&xl, "x")?,
                    gr(&w1, "w1")?,
                    gr(&b1, "b1")?,
                    gr(&w2, "w2")?,
                    gr(&b2, "b2")?,
                ])
            });
            let part = |i: usize| -> Vec<Tensor> { ranks.iter().map(|o| o[i].clone()).collect() };
            if sp {
                assert_close(
                    &cat(&part(0), 1),
                    &y_ref.detach(),
                    &format!("{what}: output"),
                );
                assert_close(&cat(&part(1), 1), &dx, &format!("{what}: input grad"));
                assert_close(&sum(&part(5)), &db2, &format!("{what}: summed b2 grad"));
            } else {
                for r in 0..p {
                    assert_close(&part(0)[r], &y_ref.detach(), &format!("{what}: output"));
                    assert_close(&part(1)[r], &dx, &format!("{what}: input grad"));
                    assert_close(&part(5)[r], &db2, &format!("{what}: b2 grad"));
                }
            }
            assert_close(&cat(&part(2), 0), &dw1, &format!("{what}: w1 grad"));
            assert_close(&cat(&part(3), 0), &db1, &format!("{what}: b1 grad"));
            assert_close(&cat(&part(4), 1), &dw2, &format!("{what}: w2 grad"));
        }
    }
}
