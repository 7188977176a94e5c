//! Library use of candle-parallel from a plain Candle program: a small transformer written with
//! the parallel modules of `candle_parallel::nn`, with no rank or communicator in the model.
//!
//! One pre-norm block (RMSNorm, attention with rotary embeddings over zigzag ring attention,
//! RMSNorm, SwiGLU MLP) between a vocab-parallel embedding and a vocab-parallel LM head with the
//! fused loss; weights from a map of whole tensors (each rank takes its slices). It is trained
//! for a few SGD steps twice: on one rank, and on 4 local ranks laid out as tensor-parallel 2 ×
//! ring 2. After each backward, every parameter's gradient is summed over the ranks that share
//! it (`ParallelCtx::grad_group`). The program checks that both runs give the same losses (1e-5
//! relative) and that the loss falls.
//!
//! Run with `cargo run -p cpl-examples --example parallel_transformer`.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, SpConfig, Strategy};
use candle_parallel::comm::ReduceOp;
use candle_parallel::mesh::MeshConfig;
use candle_parallel::nn::{
    AttentionConfig, Batch, CrossEntropyOptions, EmbeddingConfig, LmHead, Mlp, MlpConfig,
    NormConfig, ParallelAttention, ParallelCtx, ParamBuilder, ParamMode, Pass, RmsNorm, TensorMap,
    TpActivations, VocabParallelEmbedding,
};
use candle_parallel::ops::{RopeScaling, RotaryEmbedding};
use candle_parallel::plan::Layout;
use candle_parallel::LocalWorld;

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

/// The whole model's initial weights by checkpoint name (what a safetensors file would hold).
fn weights() -> Result<HashMap<String, Tensor>> {
    let ones = Tensor::ones(HIDDEN, DType::F32, &Device::Cpu)?;
    Ok(HashMap::from([
        ("embed.weight".into(), init(VOCAB, HIDDEN, 0.1)?),
        ("norm1.weight".into(), ones.clone()),
        ("attn.q_proj.weight".into(), init(HIDDEN, HIDDEN, 0.2)?),
        ("attn.k_proj.weight".into(), init(HIDDEN, HIDDEN, 0.3)?),
        ("attn.v_proj.weight".into(), init(HIDDEN, HIDDEN, 0.4)?),
        ("attn.o_proj.weight".into(), init(HIDDEN, HIDDEN, 0.5)?),
        ("norm2.weight".into(), ones),
        ("mlp.gate_proj.weight".into(), init(FFN, HIDDEN, 0.6)?),
        ("mlp.up_proj.weight".into(), init(FFN, HIDDEN, 0.7)?),
        ("mlp.down_proj.weight".into(), init(HIDDEN, FFN, 0.8)?),
        ("head.weight".into(), init(VOCAB, HIDDEN, 0.9)?),
    ]))
}

/// The model: written once, with no rank or communicator in it.
struct Model {
    embed: VocabParallelEmbedding,
    norm1: RmsNorm,
    attn: ParallelAttention,
    norm2: RmsNorm,
    mlp: Mlp,
    head: LmHead,
}

impl Model {
    fn new(vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let rope = RotaryEmbedding::new(HEAD_DIM, 10000.0, &RopeScaling::Default)?;
        let attn = AttentionConfig::new(HIDDEN, HEADS, HEADS, HEAD_DIM).with_rope(rope);
        let emb = EmbeddingConfig {
            vocab_size: VOCAB,
            hidden_size: HIDDEN,
        };
        let norm = NormConfig::new(HIDDEN, 1e-5);
        Ok(Self {
            embed: VocabParallelEmbedding::new(&emb, vb.pp("embed"), ctx)?,
            norm1: RmsNorm::new(&norm, vb.pp("norm1"), ctx)?,
            attn: ParallelAttention::new(&attn, vb.pp("attn"), ctx)?,
            norm2: RmsNorm::new(&norm, vb.pp("norm2"), ctx)?,
            mlp: Mlp::new(&MlpConfig::swiglu(HIDDEN, FFN), vb.pp("mlp"), ctx)?,
            head: LmHead::new(&emb, vb.pp("head"), ctx)?,
        })
    }

    /// This rank's summed next-token loss and its label count.
    fn loss_sum(&self, batch: &Batch, labels: &Tensor, pass: &Pass) -> Result<(Tensor, usize)> {
        let x = self.embed.forward(&batch.input_ids)?;
        let x = (&x + self.attn.forward(&self.norm1.forward(&x)?, pass)?)?;
        let x = (&x + self.mlp.forward(&self.norm2.forward(&x)?)?)?;
        Ok(self
            .head
            .loss_sum(&x, labels, &CrossEntropyOptions::default())?)
    }
}

/// Trains on the layout of `ctx` and returns the global mean loss of every step.
fn train(ctx: &ParallelCtx) -> Result<Vec<f32>> {
    let source = Arc::new(TensorMap::new(weights()?, "initial weights"));
    let (vb, params) = ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable);
    let model = Model::new(vb, ctx)?;
    let tokens: Vec<u32> = (0..SEQ as u32)
        .map(|i| (i * 7 + 3) % VOCAB as u32)
        .collect();
    // This rank's tokens (zigzag order), their global positions and next-token labels.
    let (batch, labels) = Batch::from_sequences(ctx, &[tokens], AttnMask::Causal)?;
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let (sum, count) = model.loss_sum(&batch, &labels, &batch.pass(ctx)?)?;
        // Every rank's loss is its share of the global mean.
        let seq = ctx.sequence_group();
        let total = seq.all_reduce(&Tensor::new(&[count as f32], &Device::Cpu)?, ReduceOp::Sum)?;
        let loss = sum.broadcast_div(&total.reshape(())?)?;
        losses.push(seq.all_reduce(&loss, ReduceOp::Sum)?.to_scalar::<f32>()?);
        let grads = ctx.backward(&loss)?;
        // SGD; each gradient summed over the ranks that share the parameter.
        for p in params.sorted() {
            let var = p.var.context("parameters are trainable")?;
            let g = grads
                .get(var.as_tensor())
                .context("a parameter received no gradient")?;
            let g = ctx
                .grad_group(&p.shard, p.expert_parallel)
                .all_reduce(g, ReduceOp::Sum)?;
            var.set(&(var.as_tensor() - (g * LR)?)?)?;
        }
    }
    Ok(losses)
}

/// Builds the mesh and parallel context of `tp × ring` local ranks and trains on each.
fn run(tp: usize, ring: usize) -> Result<Vec<f32>> {
    let layout = Layout::new(
        MeshConfig::default().with_tp(tp).with_ring(ring),
        SpConfig::new(Strategy::Ring, 1, ring),
        TpActivations::Replicated,
    );
    let mut results = LocalWorld::run(layout.ranks(), |world| -> Result<Vec<f32>> {
        let (_mesh, ctx) = layout.context(world)?;
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
