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
//! Then again in bf16 with biases on q, k and v (as Qwen2 has them): the parameters, activations
//! and gradients in bf16, the products summed in f32. The layouts agree there to bf16's
//! rounding (the tensor-parallel output projection adds two bf16 partial sums where one rank
//! rounds one f32 sum). `scripts/outside_examples.sh` runs this program built against crates.io's
//! candle-core (which sums bf16 tensors in bf16) and against this workspace's patched one: the
//! bf16 losses must agree to 1e-6 there too, so no gradient of the library's layers may depend on
//! how candle sums half precision.
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

/// The whole model's initial weights by checkpoint name (what a safetensors file would hold),
/// with biases on q, k and v when `bias`.
fn weights(bias: bool) -> Result<HashMap<String, Tensor>> {
    let ones = Tensor::ones(HIDDEN, DType::F32, &Device::Cpu)?;
    let mut map = HashMap::from([
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
    ]);
    if bias {
        for (i, p) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
            let b = init(1, HIDDEN, 1.0 + i as f64)?.reshape(HIDDEN)?;
            map.insert(format!("attn.{p}.bias"), b);
        }
    }
    Ok(map)
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
    fn new(vb: ParamBuilder, ctx: &ParallelCtx, bias: bool) -> Result<Self> {
        let rope = RotaryEmbedding::new(HEAD_DIM, 10000.0, &RopeScaling::Default)?;
        let attn = AttentionConfig::new(HIDDEN, HEADS, HEADS, HEAD_DIM)
            .with_rope(rope)
            .with_biases(bias, false);
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

/// Trains in `dtype` (with q/k/v biases in bf16) on the layout of `ctx` and returns the global
/// mean loss of every step.
fn train(ctx: &ParallelCtx, dtype: DType) -> Result<Vec<f32>> {
    let bias = dtype == DType::BF16;
    let source = Arc::new(TensorMap::new(weights(bias)?, "initial weights"));
    let (vb, params) = ParamBuilder::new(source, dtype, &Device::Cpu, ParamMode::Trainable);
    let model = Model::new(vb, ctx, bias)?;
    let tokens: Vec<u32> = (0..SEQ as u32)
        .map(|i| (i * 7 + 3) % VOCAB as u32)
        .collect();
    // This rank's tokens (zigzag order), their global positions and next-token labels.
    let (batch, labels) = Batch::from_sequences(ctx, &[tokens], AttnMask::Causal)?;
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let (sum, count) = model.loss_sum(&batch, &labels, &batch.pass(ctx)?)?;
        let sum = sum.to_dtype(DType::F32)?;
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
fn run(tp: usize, ring: usize, dtype: DType) -> Result<Vec<f32>> {
    let layout = Layout::new(
        MeshConfig::default().with_tp(tp).with_ring(ring),
        SpConfig::new(Strategy::Ring, 1, ring),
        TpActivations::Replicated,
    );
    let mut results = LocalWorld::run(layout.ranks(), |world| -> Result<Vec<f32>> {
        let (_mesh, ctx) = layout.context(world)?;
        train(&ctx, dtype)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(results.swap_remove(0))
}

fn main() -> Result<()> {
    // bf16: the layouts' losses differ by rounding differences of the activations that mostly
    // average out in the mean loss; allowed: one bf16 rounding of the loss itself (2^-9).
    for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-3)] {
        let single = run(1, 1, dtype)?;
        let parallel = run(2, 2, dtype)?;
        println!("{dtype:?}: step  single-rank loss  tp2 x ring2 loss");
        for (step, (a, b)) in single.iter().zip(&parallel).enumerate() {
            println!("{step:>4}  {a:>16.8}  {b:>16.8}");
            ensure!(
                (a - b).abs() <= tol * a.abs(),
                "{dtype:?} step {step}: loss {b} differs from the single-rank loss {a}"
            );
        }
        ensure!(
            single.last() < single.first(),
            "{dtype:?}: the loss did not fall: {single:?}"
        );
        println!("{dtype:?}: the tp2 x ring2 run matches the single-rank run");
    }
    Ok(())
}
