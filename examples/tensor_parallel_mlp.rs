//! Library use of candle-parallel from a plain Candle program.
//!
//! A two-layer MLP is trained for a few SGD steps twice: once on one rank, and once split
//! Megatron-style across 4 local ranks (first weight by columns, second by rows, with the
//! differentiable collectives `copy_to_parallel_region` / `reduce_from_parallel_region` around
//! the parallel region). The program checks that both runs give the same losses.
//!
//! Run with `cargo run -p cpl-examples --example tensor_parallel_mlp`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_parallel::collectives::{copy_to_parallel_region, reduce_from_parallel_region};
use candle_parallel::{Comm, LocalWorld};

const RANKS: usize = 4;
const BATCH: usize = 8;
const IN: usize = 16;
const HIDDEN: usize = 32;
const OUT: usize = 4;
const STEPS: usize = 5;
const LR: f64 = 0.05;

/// Deterministic inputs, targets and full weights, identical on every rank.
fn problem() -> candle_core::Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let ramp = |n: usize, a: f64, b: f64| -> candle_core::Result<Tensor> {
        Tensor::arange(0u32, n as u32, &dev)?
            .to_dtype(DType::F32)?
            .affine(a, b)?
            .sin()
    };
    let x = ramp(BATCH * IN, 0.37, 0.1)?.reshape((BATCH, IN))?;
    let y = ramp(BATCH * OUT, 0.91, 0.5)?.reshape((BATCH, OUT))?;
    let w1 = (ramp(IN * HIDDEN, 1.3, 0.2)?.reshape((IN, HIDDEN))? * 0.3)?;
    let w2 = (ramp(HIDDEN * OUT, 0.7, 0.9)?.reshape((HIDDEN, OUT))? * 0.3)?;
    Ok((x, y, w1, w2))
}

/// Trains on one rank (`comm = None`) or on this rank's slice of the weights.
fn train(comm: Option<&Comm>) -> candle_core::Result<Vec<f32>> {
    let (x, y, w1, w2) = problem()?;
    let (w1, w2) = match comm {
        None => (w1, w2),
        Some(c) => {
            let part = HIDDEN / c.size();
            let start = c.rank() * part;
            (w1.narrow(1, start, part)?, w2.narrow(0, start, part)?)
        }
    };
    let (w1, w2) = (Var::from_tensor(&w1)?, Var::from_tensor(&w2)?);
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let input = match comm {
            Some(c) => copy_to_parallel_region(&x, c)?,
            None => x.clone(),
        };
        let partial = input
            .matmul(w1.as_tensor())?
            .gelu()?
            .matmul(w2.as_tensor())?;
        let pred = match comm {
            Some(c) => reduce_from_parallel_region(&partial, c)?,
            None => partial,
        };
        let loss = (pred - &y)?.sqr()?.sum(D::Minus1)?.mean_all()?;
        let grads = loss.backward()?;
        for w in [&w1, &w2] {
            let g = grads
                .get(w.as_tensor())
                .ok_or_else(|| candle_core::Error::Msg("a weight received no gradient".into()))?;
            w.set(&(w.as_tensor() - (g * LR)?)?)?;
        }
        losses.push(loss.to_scalar::<f32>()?);
    }
    Ok(losses)
}

fn main() -> Result<()> {
    let single = train(None)?;
    let parallel = LocalWorld::run(RANKS, |comm| train(Some(&comm)))?;
    println!("step  single-rank loss  {RANKS}-rank tensor-parallel loss (rank 0)");
    for (step, (a, b)) in single.iter().zip(&parallel[0]).enumerate() {
        println!("{step:>4}  {a:>16.8}  {b:>16.8}");
    }
    for (rank, losses) in parallel.iter().enumerate() {
        for (a, b) in single.iter().zip(losses) {
            ensure!(
                (a - b).abs() <= 1e-5 * a.abs().max(1e-6),
                "rank {rank}: loss {b} differs from the single-rank loss {a}"
            );
        }
    }
    ensure!(
        single.last() < single.first(),
        "the loss did not fall: {single:?}"
    );
    println!("the tensor-parallel run matches the single-rank run");
    Ok(())
}
