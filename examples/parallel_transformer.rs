//! Library use of candle-parallel from a plain Candle program: a small transformer built from
//! the parallel layers and a sequence-parallel attention.
//!
//! One pre-norm block (RMSNorm, column-parallel q/k/v, rotary embeddings, zigzag ring attention,
//! row-parallel output; RMSNorm, SwiGLU MLP) between a vocab-parallel embedding and a
//! vocab-parallel cross-entropy. It is trained for a few SGD steps twice: on one rank, and on
//! 4 local ranks laid out as tensor-parallel 2 × ring 2. After each backward, every parameter's
//! gradient is summed over the ranks that share it (`ParallelCtx::grad_group`). The program
//! checks that both runs give the same losses (1e-5 relative) and that the loss falls.
//!
//! Run with `cargo run -p cpl-examples --example parallel_transformer`.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::{AttnCall, AttnMask, SpConfig, Strategy};
use candle_parallel::comm::ReduceOp;
use candle_parallel::layers::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, CrossEntropyOptions, ParallelCtx,
    RowParallelLinear, VocabParallelEmbedding,
};
use candle_parallel::mesh::{DeviceMesh, MeshConfig};
use candle_parallel::ops::{rms_norm, swiglu, RopeScaling, RotaryEmbedding};
use candle_parallel::{LocalWorld, SequenceParallelAttention};

const VOCAB: usize = 64;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 64;
const SEQ: usize = 32;
const STEPS: usize = 6;
const LR: f64 = 0.2;

/// A deterministic `(rows, cols)` matrix, the same on every rank.
fn init(rows: usize, cols: usize, seed: f64) -> Result<Tensor> {
    let t = Tensor::arange(0u32, (rows * cols) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(0.731, seed)?
        .sin()?
        .affine(0.08, 0.0)?;
    Ok(t.reshape((rows, cols))?)
}

/// A trainable parameter: this rank's slice along `dim` of the full tensor (or all of it).
struct Param {
    var: Var,
    tp_sharded: bool,
}

fn param(full: Tensor, dim: Option<usize>, ctx: &ParallelCtx) -> Result<Param> {
    let tp = ctx.tp();
    let t = match dim {
        Some(d) => {
            let (start, len) = tp.share("a parameter dim", full.dim(d)?)?;
            full.narrow(d, start, len)?
        }
        None => full,
    };
    Ok(Param {
        var: Var::from_tensor(&t)?,
        tp_sharded: dim.is_some() && tp.size() > 1,
    })
}

/// Trains on the layout of `ctx` and returns the global mean loss of every step.
fn train(ctx: &ParallelCtx) -> Result<Vec<f32>> {
    let tokens: Vec<u32> = (0..SEQ as u32)
        .map(|i| (i * 7 + 3) % VOCAB as u32)
        .collect();
    let ids = Tensor::from_vec(tokens.clone(), (1, SEQ), &Device::Cpu)?;
    let labels: Vec<i64> = tokens[1..]
        .iter()
        .map(|&t| t as i64)
        .chain([-100])
        .collect();
    let labels = Tensor::from_vec(labels, (1, SEQ), &Device::Cpu)?;
    // This rank's tokens (zigzag order) and their global positions.
    let local_ids = ctx.shard_tokens(&ids)?;
    let local_labels = ctx.shard_tokens(&labels)?.flatten_all()?;
    let positions = ctx.attention_positions(SEQ)?;

    let emb = param(init(VOCAB, HIDDEN, 0.1)?, Some(0), ctx)?;
    let norm1 = param(Tensor::ones(HIDDEN, DType::F32, &Device::Cpu)?, None, ctx)?;
    let wq = param(init(HIDDEN, HIDDEN, 0.2)?, Some(0), ctx)?;
    let wk = param(init(HIDDEN, HIDDEN, 0.3)?, Some(0), ctx)?;
    let wv = param(init(HIDDEN, HIDDEN, 0.4)?, Some(0), ctx)?;
    let wo = param(init(HIDDEN, HIDDEN, 0.5)?, Some(1), ctx)?;
    let norm2 = param(Tensor::ones(HIDDEN, DType::F32, &Device::Cpu)?, None, ctx)?;
    let gate = param(init(FFN, HIDDEN, 0.6)?, Some(0), ctx)?;
    let up = param(init(FFN, HIDDEN, 0.7)?, Some(0), ctx)?;
    let down = param(init(HIDDEN, FFN, 0.8)?, Some(1), ctx)?;
    let head = param(init(VOCAB, HIDDEN, 0.9)?, Some(0), ctx)?;
    let params = [
        &emb, &norm1, &wq, &wk, &wv, &wo, &norm2, &gate, &up, &down, &head,
    ];
    let rope = RotaryEmbedding::new(HEAD_DIM, 10000.0, &RopeScaling::Default)?;
    let tp = ctx.tp();
    let heads = HEADS / tp.size();
    let col =
        |p: &Param| ColumnParallelLinear::new(p.var.as_tensor().clone(), None, tp.clone(), false);
    let row = |p: &Param| RowParallelLinear::new(p.var.as_tensor().clone(), None, tp.clone(), true);

    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let embed =
            VocabParallelEmbedding::new(emb.var.as_tensor().clone(), VOCAB, tp.comm().clone())?;
        let x = embed.forward(&local_ids)?; // (1, n, HIDDEN)
        let n = x.dim(1)?;
        let h = rms_norm(&x, norm1.var.as_tensor(), 1e-5)?;
        let q = col(&wq).forward(&h)?.reshape((1, n, heads, HEAD_DIM))?;
        let k = col(&wk).forward(&h)?.reshape((1, n, heads, HEAD_DIM))?;
        let v = col(&wv).forward(&h)?.reshape((1, n, heads, HEAD_DIM))?;
        let (q, k) = (rope.apply(&q, &positions)?, rope.apply(&k, &positions)?);
        let call = AttnCall::new(AttnMask::Causal, 1.0 / (HEAD_DIM as f32).sqrt());
        let a = ctx.attention().attention(&q, &k, &v, &call)?;
        let x = (x + row(&wo).forward(&a.reshape((1, n, heads * HEAD_DIM))?)?)?;
        let h = rms_norm(&x, norm2.var.as_tensor(), 1e-5)?;
        let m = swiglu(&col(&gate).forward(&h)?, &col(&up).forward(&h)?)?;
        let x = (x + row(&down).forward(&m)?)?;
        let (sum, count) = vocab_parallel_cross_entropy(
            &x.reshape((n, HIDDEN))?,
            head.var.as_tensor(),
            &local_labels,
            tp.comm(),
            &CrossEntropyOptions::default(),
        )?;
        // Every rank's loss is its share of the global mean.
        let seq = ctx.sequence_group();
        let total = seq.all_reduce(&Tensor::new(&[count as f32], &Device::Cpu)?, ReduceOp::Sum)?;
        let loss = sum.broadcast_div(&total.reshape(())?)?;
        losses.push(seq.all_reduce(&loss, ReduceOp::Sum)?.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        for p in params {
            let g = grads
                .get(p.var.as_tensor())
                .context("a parameter received no gradient")?;
            let g = ctx.grad_group(p.tp_sharded).all_reduce(g, ReduceOp::Sum)?;
            p.var.set(&(p.var.as_tensor() - (g * LR)?)?)?;
        }
    }
    Ok(losses)
}

/// Builds the mesh and parallel context of `tp × ring` local ranks and trains on each.
fn run(tp: usize, ring: usize) -> Result<Vec<f32>> {
    let sp = SpConfig::new(Strategy::Ring, 1, ring);
    let mesh_cfg = MeshConfig::default().with_tp(tp).with_ring(ring);
    let mut results = LocalWorld::run(tp * ring, |world| -> Result<Vec<f32>> {
        let mesh = DeviceMesh::new(&mesh_cfg, world)?;
        let ctx = ParallelCtx::new(&mesh, &sp, false)?;
        train(&ctx)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(results.swap_remove(0))
}

fn main() -> Result<()> {
    let single = run(1, 1)?;
    let parallel = run(2, 2)?;
    println!("step  single-rank loss  tp2 x ring2 loss");
    for (step, (a, b)) in single.iter().zip(&parallel).enumerate() {
        println!("{step:>4}  {a:>16.8}  {b:>16.8}");
        ensure!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "step {step}: loss {b} differs from the single-rank loss {a}"
        );
    }
    ensure!(
        single.last() < single.first(),
        "the loss did not fall: {single:?}"
    );
    println!("the tp2 x ring2 run matches the single-rank run");
    Ok(())
}
