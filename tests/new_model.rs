//! A new model written in one file from `candle_parallel::nn` alone: a 2-layer pre-norm
//! transformer with LayerNorm, causal GQA attention without positional encoding (NoPE), a GELU
//! MLP with biases, a vocab-parallel embedding and LM head, and a KV cache for generation. The
//! model names no rank, no communicator and no collective; the layout is the context's, the
//! memory plan is applied to its units from outside, and LoRA adapters come with its parameter
//! builder.
//!
//! Under tp2, zigzag ring4, ulysses2 x ring2 (USP) and ZeRO-3 (with and without selective
//! checkpointing) it trains with the losses and final weights of one rank (1e-5 relative, f32),
//! and every parameter receives a finite, non-zero gradient on every layout.
//!
//! The same model is then a family of the registry (`models::family`), registered from outside
//! the models crate with its `config.json` architecture, description and loader: detected,
//! loaded for each rank's layout and pipeline stage, and run through every task of the engine
//! (the driver's training and LoRA fine-tuning, evaluation, generation) under tp2, ring2 and
//! pp2 with the results of one rank.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask as AttnMaskKind, Strategy};
use candle_parallel::comm::LocalWorld;
use candle_parallel::nn::{
    Activation, Adapters, AttentionConfig, Batch, Block, CrossEntropyOptions, EmbeddingConfig,
    LayerKv, LayerNorm, LmHead, LoraConfig, LoraTargets, Mlp, MlpConfig, NormConfig,
    ParallelAttention, ParallelCtx, ParamBuilder, ParamMode, Pass, TensorMap, Track, Unit, UnitOps,
    VocabParallelEmbedding,
};
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::{MemoryPlan, Parallelize};
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_identical, drive_through_registry, eval_through_registry, generate_through_registry,
    load_through_registry, prompt_reply_examples, rel_err, whole_weights, Layout,
};
use models::causal_lm::KvCache;
use models::family::{Description, Family, Kind, LoadSpec, LoadedCausalLm};
use models::hub::ModelFiles;
use models::CausalLm;
use testkit::{assert_close_scalar, assert_finite, max_abs};
use train::data::{PackedDataset, Packing, TokenStream};
use train::finetune::{Overlong, SftDataset, SftOptions};
use train::trainer::{TrainConfig, TrainModel, Trainer};

// ------------------------------------------------------------------------------------------
// The model
// ------------------------------------------------------------------------------------------

/// The model's `config.json`.
#[derive(Debug, Clone)]
struct EncoderConfig {
    vocab_size: usize,
    hidden_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    intermediate_size: usize,
    num_layers: usize,
    eps: f64,
}

/// `layers.N`: pre-norm attention and MLP with residuals.
#[derive(Debug, Clone)]
struct EncoderLayer {
    norm1: LayerNorm,
    attn: ParallelAttention,
    norm2: LayerNorm,
    mlp: Mlp,
}

impl EncoderLayer {
    fn new(
        cfg: &EncoderConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> candle_parallel::Result<Self> {
        let (h, heads) = (cfg.hidden_size, cfg.num_heads);
        let norm = NormConfig::new(h, cfg.eps).with_bias(true);
        // No attention biases: the key bias has an exactly zero gradient (it shifts all scores
        // of a query alike), and Adam turns its rounding noise into updates that differ between
        // layouts; the MLP and the norms carry biases.
        let attn = AttentionConfig::new(h, heads, cfg.num_kv_heads, h / heads);
        let mlp = MlpConfig::gelu(h, cfg.intermediate_size, Activation::Gelu);
        Ok(Self {
            norm1: LayerNorm::new(&norm, vb.pp("norm1"), ctx)?,
            attn: ParallelAttention::new(&attn, vb.pp("attn"), ctx)?,
            norm2: LayerNorm::new(&norm, vb.pp("norm2"), ctx)?,
            mlp: Mlp::new(&mlp, vb.pp("mlp"), ctx)?,
        })
    }
}

impl EncoderLayer {
    /// Generation: the new tokens `x` at positions `pos`, extending this layer's `cache`.
    fn forward_cached(
        &self,
        x: &Tensor,
        pos: &[u32],
        cache: &mut LayerKv,
    ) -> candle_parallel::Result<Tensor> {
        let a = self
            .attn
            .forward_cached(&self.norm1.forward(x)?, pos, cache)?;
        let x = (x + a)?;
        Ok((&x + self.mlp.forward(&self.norm2.forward(&x)?)?)?)
    }
}

impl Block for EncoderLayer {
    fn forward(&self, x: &Tensor, pass: &Pass) -> candle_parallel::Result<Tensor> {
        let x = (x + self.attn.forward(&self.norm1.forward(x)?, pass)?)?;
        Ok((&x + self.mlp.forward(&self.norm2.forward(&x)?)?)?)
    }
}

/// `embed`, `norm`, `head`: one unit.
#[derive(Debug, Clone)]
struct EncoderEnds {
    embed: VocabParallelEmbedding,
    norm: LayerNorm,
    head: LmHead,
}

impl EncoderEnds {
    fn new(
        cfg: &EncoderConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> candle_parallel::Result<Self> {
        let emb = EmbeddingConfig {
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
        };
        let norm = NormConfig::new(cfg.hidden_size, cfg.eps).with_bias(true);
        Ok(Self {
            embed: VocabParallelEmbedding::new(&emb, vb.pp("embed"), ctx)?,
            norm: LayerNorm::new(&norm, vb.pp("norm"), ctx)?,
            head: LmHead::new(&emb, vb.pp("head"), ctx)?,
        })
    }
}

struct Encoder {
    /// `None` on a pipeline stage that holds neither end.
    ends: Option<Unit<EncoderEnds>>,
    /// `None` for layers another pipeline stage holds.
    layers: Vec<Option<Unit<EncoderLayer>>>,
    ctx: ParallelCtx,
    /// The LoRA adapters its linear layers were built with (from the parameter builder).
    adapters: Option<Arc<Adapters>>,
}

impl Encoder {
    fn new(
        cfg: &EncoderConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> candle_parallel::Result<Self> {
        Self::new_stage(
            cfg,
            vb,
            ctx,
            std::slice::from_ref(&(0..cfg.num_layers)),
            true,
        )
    }

    /// A pipeline stage: the layers in `layers` and, with `ends`, the embedding and head.
    fn new_stage(
        cfg: &EncoderConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        layers: &[std::ops::Range<usize>],
        ends: bool,
    ) -> candle_parallel::Result<Self> {
        let (c, x) = (cfg.clone(), ctx.clone());
        let ends = ends
            .then(|| Unit::new(&vb, move |vb| EncoderEnds::new(&c, vb, &x)))
            .transpose()?;
        let layers = (0..cfg.num_layers)
            .map(|i| {
                if !layers.iter().any(|r| r.contains(&i)) {
                    return Ok(None);
                }
                let (c, x) = (cfg.clone(), ctx.clone());
                Unit::new(&vb.pp("layers").pp(i), move |vb| {
                    EncoderLayer::new(&c, vb, &x)
                })
                .map(Some)
            })
            .collect::<candle_parallel::Result<Vec<_>>>()?;
        Ok(Self {
            ends,
            layers,
            ctx: ctx.clone(),
            adapters: vb.adapters().cloned(),
        })
    }

    fn ends(&self) -> models::Result<EncoderEnds> {
        let ends = self
            .ends
            .as_ref()
            .ok_or_else(|| models::Error::Invalid("no ends on this stage".into()))?;
        Ok(ends.get(Track::Grad)?)
    }

    fn layer(&self, i: usize) -> models::Result<&Unit<EncoderLayer>> {
        self.layers
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| models::Error::Invalid(format!("layer {i} is on another stage")))
    }
}

impl Parallelize for Encoder {
    fn units(&mut self) -> Vec<&mut dyn UnitOps> {
        let mut units: Vec<&mut dyn UnitOps> = Vec::new();
        units.extend(self.ends.iter_mut().map(|u| u as &mut dyn UnitOps));
        units.extend(
            self.layers
                .iter_mut()
                .flatten()
                .map(|u| u as &mut dyn UnitOps),
        );
        units
    }
}

impl TrainModel for Encoder {
    fn end_params(&self) -> Vec<String> {
        CausalLm::end_params(self)
    }
}

impl CausalLm for Encoder {
    fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    fn hidden_size(&self) -> usize {
        CFG.hidden_size
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn embed_tokens(&self, batch: &Batch) -> models::Result<Tensor> {
        Ok(self.ends()?.embed.forward(&batch.input_ids)?)
    }

    fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        batch: &Batch,
    ) -> models::Result<Tensor> {
        let pass = batch.pass(&self.ctx)?;
        let mut x = x.clone();
        for i in layers {
            x = self.layer(i)?.forward(&x, &pass)?;
        }
        Ok(x)
    }

    fn norm_head_loss(
        &self,
        x: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> models::Result<(Tensor, usize)> {
        let ends = self.ends()?;
        Ok(ends.head.loss_sum(&ends.norm.forward(x)?, labels, opts)?)
    }

    fn norm_head_logits(&self, x: &Tensor) -> models::Result<Tensor> {
        let ends = self.ends()?;
        Ok(ends.head.logits(&ends.norm.forward(x)?)?)
    }

    fn end_params(&self) -> Vec<String> {
        self.ends
            .iter()
            .flat_map(|u| u.params())
            .map(|p| p.name.clone())
            .collect()
    }

    fn embed_cached(&self, ids: &Tensor) -> models::Result<Tensor> {
        Ok(self.ends()?.embed.forward(ids)?)
    }

    fn layers_cached(
        &self,
        x: &Tensor,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache,
    ) -> models::Result<Tensor> {
        if self.ctx.sequence_group().size() > 1 {
            return Err(models::Error::Invalid(
                "generation runs without sequence parallelism".into(),
            ));
        }
        let start = cache.len();
        let pos: Vec<u32> = (start..start + x.dim(1)?).map(|p| p as u32).collect();
        let mut x = x.clone();
        for i in layers {
            let c = cache.layer(i, self.layers.len())?;
            x = self
                .layer(i)?
                .get(Track::NoGrad)?
                .forward_cached(&x, &pos, c)?;
        }
        Ok(x)
    }

    fn head_cached(&self, x: &Tensor) -> models::Result<Tensor> {
        let ends = self.ends()?;
        let last = x.narrow(1, x.dim(1)? - 1, 1)?.squeeze(1)?;
        Ok(ends.head.logits(&ends.norm.forward(&last)?)?)
    }

    fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.adapters.as_ref()
    }
}

// ------------------------------------------------------------------------------------------
// The tests
// ------------------------------------------------------------------------------------------

const CFG: EncoderConfig = EncoderConfig {
    vocab_size: 64,
    hidden_size: 32,
    num_heads: 4,
    num_kv_heads: 2,
    intermediate_size: 64,
    num_layers: 2,
    eps: 1e-5,
};

/// Deterministic values (splitmix64 from `state`): a tensor of `shape` uniform in
/// `center ± scale`.
fn splitmix_tensor(state: &mut u64, shape: &[usize], center: f32, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32;
            center + scale * (2.0 * u - 1.0)
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The linear layers of layer `l`: name, output and input width.
fn linears(l: usize) -> Vec<(String, usize, usize)> {
    let (h, i) = (CFG.hidden_size, CFG.intermediate_size);
    let kv = CFG.num_kv_heads * h / CFG.num_heads;
    [
        ("attn.q_proj", h, h),
        ("attn.k_proj", kv, h),
        ("attn.v_proj", kv, h),
        ("attn.o_proj", h, h),
        ("mlp.fc1", i, h),
        ("mlp.fc2", h, i),
    ]
    .into_iter()
    .map(|(n, o, i)| (format!("layers.{l}.{n}"), o, i))
    .collect()
}

/// Deterministic weights (splitmix64), the same on every rank: matrices in ±0.3, norm weights
/// around 1, biases around 0.
fn weights() -> HashMap<String, Tensor> {
    let mut state = 0x5eed_u64;
    let mut tensor = |shape: &[usize], center: f32, scale: f32| {
        splitmix_tensor(&mut state, shape, center, scale)
    };
    let (v, h) = (CFG.vocab_size, CFG.hidden_size);
    let mut w = HashMap::new();
    for (name, shape) in [("embed.weight", vec![v, h]), ("head.weight", vec![v, h])] {
        w.insert(name.to_string(), tensor(&shape, 0.0, 0.3));
    }
    w.insert("norm.weight".into(), tensor(&[h], 1.0, 0.3));
    w.insert("norm.bias".into(), tensor(&[h], 0.0, 0.1));
    for l in 0..CFG.num_layers {
        let p = |n: &str| format!("layers.{l}.{n}");
        for (n, out, inp) in linears(l) {
            w.insert(format!("{n}.weight"), tensor(&[out, inp], 0.0, 0.3));
            if n.contains("mlp") {
                w.insert(format!("{n}.bias"), tensor(&[out], 0.0, 0.1));
            }
        }
        for n in ["norm1", "norm2"] {
            w.insert(p(&format!("{n}.weight")), tensor(&[h], 1.0, 0.3));
            w.insert(p(&format!("{n}.bias")), tensor(&[h], 0.0, 0.1));
        }
    }
    w
}

fn config(steps: u64, memory: MemoryPlan, grad_accum: usize) -> TrainConfig {
    cpl_integration_tests::small_train_config(steps, memory, grad_accum, 3)
}

fn data() -> PackedDataset {
    let docs: Vec<Vec<u32>> = (0..12)
        .map(|d| {
            (0..30)
                .map(|i| ((d * 31 + i * 7 + i * i) % 64) as u32)
                .collect()
        })
        .collect();
    PackedDataset::new(
        TokenStream::from_sequences(&docs, 64).unwrap(),
        32,
        Packing::Continuous,
    )
    .unwrap()
}

struct Run {
    losses: Vec<f64>,
    weights: HashMap<String, Tensor>,
    /// max |gradient| of every parameter in the first micro-batch, per rank.
    grad_max: Vec<HashMap<String, f64>>,
}

/// Trains the encoder `steps` steps under `layout` and `memory`; returns rank 0's losses, the
/// whole final weights (every rank checked bit-identical) and every rank's first gradients.
fn train_run(layout: &Layout, memory: MemoryPlan, steps: u64) -> Run {
    let data = data();
    let grad_accum = 2 / layout.mesh.degree(candle_parallel::mesh::Dim::Dp);
    let cfg = config(steps, memory, grad_accum);
    let source = Arc::new(TensorMap::new(weights(), "encoder init"));
    let results = LocalWorld::run(layout.ranks, |world| -> Result<_, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let (vb, _) = ParamBuilder::new(
            source.clone(),
            DType::F32,
            &Device::Cpu,
            ParamMode::Trainable,
        );
        let model = Encoder::new(&CFG, vb, &ctx).map_err(|x| e(&x))?;
        let mut t = Trainer::new(model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        // Every parameter's gradient of the first micro-batch (the trainer errors on a missing
        // one; here also on a zero or non-finite one).
        let micro =
            &t.batching()
                .micro_batches(&data, 0, mesh.coord(candle_parallel::mesh::Dim::Dp))[0];
        let (_, grads) = t.forward_backward(micro, 64).map_err(|x| e(&x))?;
        let mut grad_max = HashMap::new();
        for (n, g) in &grads {
            assert_finite(g, &format!("{}: gradient of {n}", layout.name));
            grad_max.insert(n.clone(), max_abs(g));
        }
        let mut losses = Vec::new();
        while t.step < steps {
            losses.push(t.step(&data).map_err(|x| e(&x))?.loss);
        }
        let weights = whole_weights(&t, &mesh)?;
        Ok((losses, weights, grad_max))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (losses, weights, _) = &results[0];
    for (r, (l, w, _)) in results.iter().enumerate().skip(1) {
        testkit::assert_identical_scalars(l, losses, &format!("{}: rank {r} losses", layout.name));
        for (n, t) in weights {
            assert_identical(&w[n], t, &format!("{}: rank {r} weight {n}", layout.name));
        }
    }
    Run {
        losses: losses.clone(),
        weights: weights.clone(),
        grad_max: results.into_iter().map(|r| r.2).collect(),
    }
}

#[test]
fn a_new_model_trains_like_one_rank_under_every_layout() {
    let steps = 6;
    let single = train_run(&Layout::single(), MemoryPlan::default(), steps);
    assert!(
        single.losses[steps as usize - 1] < single.losses[0],
        "the loss did not fall: {:?}",
        single.losses
    );
    let names: Vec<String> = weights().into_keys().collect();
    assert_eq!(
        single.weights.len(),
        names.len(),
        "every parameter is trained"
    );
    let zero3 = MemoryPlan {
        zero: ZeroStage::Parameters,
        ..MemoryPlan::default()
    };
    let zero3_selective = MemoryPlan {
        checkpointing: Checkpointing::Selective,
        ..zero3
    };
    let l = Layout::new;
    for (layout, memory) in [
        (l("tp2", 2, 1, 1, Strategy::Ring), MemoryPlan::default()),
        (
            l("zigzag ring4", 1, 1, 4, Strategy::Ring),
            MemoryPlan::default(),
        ),
        (
            l("ulysses2 x ring2", 1, 2, 2, Strategy::Usp),
            MemoryPlan::default(),
        ),
        (l("zero3 ring4", 1, 1, 4, Strategy::Ring), zero3),
        (
            l("zero3 + selective, tp2 x ring2", 2, 1, 2, Strategy::Ring),
            zero3_selective,
        ),
    ] {
        let run = train_run(&layout, memory, steps);
        for (i, (a, b)) in run.losses.iter().zip(&single.losses).enumerate() {
            assert_close_scalar(*a, *b, 1e-5, &format!("{}: step {i}: loss", layout.name));
        }
        for (n, w) in &single.weights {
            let e = rel_err(&run.weights[n], w);
            assert!(
                e <= 1e-5,
                "{}: final weight {n}: rel err {e:e}",
                layout.name
            );
        }
        for (r, grads) in run.grad_max.iter().enumerate() {
            assert_eq!(grads.len(), names.len(), "{}: rank {r}", layout.name);
            for (n, m) in grads {
                assert!(
                    *m > 0.0,
                    "{}: rank {r}: the gradient of {n} is zero",
                    layout.name
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// The same model as a family of the registry, registered from outside the models crate
// ------------------------------------------------------------------------------------------

/// `config.json` of the toy family's checkpoints.
fn toy_config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["ToyEncoderForCausalLM"],
        "model_type": "toy-encoder",
        "vocab_size": CFG.vocab_size,
        "hidden_size": CFG.hidden_size,
        "num_attention_heads": CFG.num_heads,
        "num_key_value_heads": CFG.num_kv_heads,
        "intermediate_size": CFG.intermediate_size,
        "num_hidden_layers": CFG.num_layers,
    })
}

fn describe_toy(path: &std::path::Path) -> models::Result<Description> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(path).map_err(|e| models::Error::Invalid(e.to_string()))?,
    )
    .map_err(|e| models::Error::Invalid(e.to_string()))?;
    let n = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
    let (h, l, i, vocab) = (
        n("hidden_size"),
        n("num_hidden_layers"),
        n("intermediate_size"),
        n("vocab_size"),
    );
    let per_layer = 3 * h * h + 2 * h * i;
    let params = (l * per_layer + 2 * vocab * h) as u64;
    Ok(Description {
        params,
        matmul_params: params - (vocab * h) as u64,
        layers: l,
        hidden: h,
        vocab,
        attention_width: (l * h) as u64,
        windowed: Vec::new(),
        causal: true,
        planner_shape: None,
        pieces: None,
        summary: String::new(),
    })
}

fn load_toy(files: &ModelFiles, spec: &LoadSpec<'_>) -> models::Result<LoadedCausalLm> {
    let reader = Arc::new(models::checkpoint::CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamBuilder::new(
        reader,
        spec.dtype.unwrap_or(DType::F32),
        spec.ctx.device(),
        spec.mode,
    );
    let vb = vb.with_adapters(spec.adapters.clone());
    let model = Encoder::new_stage(&CFG, vb, spec.ctx, spec.layers, spec.ends)?;
    Ok(LoadedCausalLm {
        model: Box::new(model),
        params,
    })
}

static TOY: Family = Family {
    name: "toy-encoder",
    kind: Kind::CausalLm,
    architectures: &["ToyEncoderForCausalLM"],
    model_types: &["toy-encoder"],
    weights_name: "model",
    extra_files: &["config.json"],
    describe: describe_toy,
    load_causal_lm: Some(load_toy),
};

/// A checkpoint of the toy family: `config.json` and `model.safetensors` of [`weights`].
fn toy_checkpoint() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cpl-toy-family-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), toy_config_json().to_string()).unwrap();
    candle_core::safetensors::save(&weights(), dir.join("model.safetensors")).unwrap();
    dir
}

/// The driver's next-token task on the registry's model of `dir` under `layout`, with `lora`
/// (fine-tuning) or without (training), its run directory `out` (see
/// [`drive_through_registry`]): the run, and the gradient norms of every step followed by the
/// held-out loss.
fn registry_run(
    dir: &std::path::Path,
    layout: &Layout,
    steps: u64,
    lora: Option<&LoraConfig>,
    out: &std::path::Path,
) -> (Run, Vec<f64>) {
    let files = models::hub::from_dir("toy", dir).unwrap();
    let dp = layout.mesh.degree(candle_parallel::mesh::Dim::Dp);
    let cfg = config(steps, MemoryPlan::default(), 2 / dp);
    let got = match lora {
        None => drive_through_registry(&files, layout, &cfg, &data(), None, out),
        Some(l) => {
            let lora = (l, Some(toy_adapters()));
            drive_through_registry(&files, layout, &cfg, &sft_data(), Some(lora), out)
        }
    };
    let mut norms = got.grad_norms;
    norms.push(got.eval_loss);
    let run = Run {
        losses: got.losses,
        weights: got.weights,
        grad_max: Vec::new(),
    };
    (run, norms)
}

/// Chat-like examples for fine-tuning: a prompt (not trained) then a reply (trained), packed
/// into 32-token windows with document masks.
fn sft_data() -> SftDataset {
    let examples = prompt_reply_examples(0xF1_7E, 12, CFG.vocab_size as u32);
    let opts = SftOptions {
        seq_len: 32,
        packing: true,
        overlong: Overlong::Truncate,
        pad_id: 0,
    };
    SftDataset::new(&examples, &opts, CFG.vocab_size).unwrap().0
}

/// Random non-zero rank-4 adapters of every linear layer (both matrices in ±0.3): with PEFT's
/// zero-initialised B, Adam's first update of B would be the sign of gradients, some of them
/// rounding noise, and differ between layouts.
fn toy_adapters() -> Arc<dyn candle_parallel::nn::TensorSource> {
    let (mut state, r, mut t) = (0xada_u64, 4, HashMap::new());
    for l in 0..CFG.num_layers {
        for (n, out, inp) in linears(l) {
            let a = splitmix_tensor(&mut state, &[r, inp], 0.0, 0.3);
            let b = splitmix_tensor(&mut state, &[out, r], 0.0, 0.3);
            t.insert(format!("{n}.lora_A.weight"), a);
            t.insert(format!("{n}.lora_B.weight"), b);
        }
    }
    Arc::new(TensorMap::new(t, "toy adapters"))
}

/// `got` equals `want` (losses, gradient norms then the held-out loss, final weights) within
/// 1e-5 relative.
fn assert_same_run(what: &str, got: &(Run, Vec<f64>), want: &(Run, Vec<f64>)) {
    let ((got, norms), (want, want_norms)) = (got, want);
    assert_eq!(got.losses.len(), want.losses.len(), "{what}: steps");
    for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
        assert_close_scalar(*a, *b, 1e-5, &format!("{what}: step {i}: loss"));
    }
    assert_eq!(norms.len(), want_norms.len(), "{what}: norms");
    for (i, (g, w)) in norms.iter().zip(want_norms).enumerate() {
        let m = format!("{what}: step {i}: gradient norm / eval loss");
        assert_close_scalar(*g, *w, 1e-5, &m);
    }
    assert_eq!(got.weights.len(), want.weights.len(), "{what}: weights");
    for (n, w) in &want.weights {
        let e = rel_err(&got.weights[n], w);
        assert!(e <= 1e-5, "{what}: final weight {n}: rel err {e:e}");
    }
}

/// A family registered from outside the models crate is detected from its `config.json`
/// (`architectures`), described (FLOPs), loaded by its own loader for each rank's layout and
/// pipeline stage, and runs every task of the engine under tp2, ring2 and pp2 like one rank
/// (1e-5 relative):
/// - training through the run driver (`cpl train`'s task): losses, gradient norms, held-out
///   loss and final weights; the checkpoint it saves reloads through the registry;
/// - evaluation (`cpl eval`'s scoring) of the trained checkpoint: the loss and, without a
///   pipeline, the global logits;
/// - greedy generation with the KV cache (`cpl generate`'s): the same tokens, each the argmax
///   of a full forward over the text before it; refused under ring2 with a clear error;
/// - LoRA fine-tuning through the driver on SFT windows (`cpl finetune`'s task) from random
///   non-zero adapters: losses, norms and final adapters; the saved adapter reloads and every adapter tensor gets a non-zero
///   gradient.
///
/// An unknown architecture lists the supported families, the registered one among them.
#[test]
fn a_family_registered_from_outside_runs_every_task_of_the_engine() {
    models::family::register(&TOY).unwrap();
    assert!(models::family::register(&TOY).is_err(), "registered twice");
    let dir = toy_checkpoint();
    let family = models::family::detect(&dir.join("config.json")).unwrap();
    assert_eq!(family.name, "toy-encoder");
    let desc = (family.describe)(&dir.join("config.json")).unwrap();
    let flops = desc.flops_per_token(32, models::family::Work::Training);
    assert!(flops > 6.0 * desc.matmul_params as f64, "{flops}");
    let steps = 3;
    let layouts = [
        Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        Layout::new("ring2", 1, 1, 2, Strategy::Ring),
        Layout {
            name: "pp2",
            ..Layout::single().with_pp(2)
        },
    ];
    let out = |job: &str, layout: &Layout| dir.join(format!("{job}-{}", layout.name));
    let step_dir = |job: &str, layout: &Layout| out(job, layout).join(format!("step-{steps}"));

    // Training through the driver.
    let single = Layout::single();
    let want = registry_run(&dir, &single, steps, None, &out("train", &single));
    assert!(want.0.losses.iter().all(|l| l.is_finite()));
    assert_eq!(
        want.0.weights.len(),
        weights().len(),
        "every parameter trained"
    );
    for layout in &layouts {
        let got = registry_run(&dir, layout, steps, None, &out("train", layout));
        assert_same_run(&format!("train {}", layout.name), &got, &want);
    }

    // Evaluation of the trained checkpoint, and of the one saved under tp2.
    let trained = models::hub::from_dir("trained", &step_dir("train", &single)).unwrap();
    assert_eq!(
        models::family::detect(&trained.config).unwrap().name,
        "toy-encoder"
    );
    let seqs = testkit::random_docs(0xE7A1, 3, 32..33, CFG.vocab_size as u32);
    let (want_loss, want_logits) = eval_through_registry(&trained, &single, &seqs);
    assert!(want_loss.is_finite());
    for layout in &layouts {
        let (loss, logits) = eval_through_registry(&trained, layout, &seqs);
        assert_close_scalar(
            loss,
            want_loss,
            1e-5,
            &format!("eval {}: loss", layout.name),
        );
        if layout.mesh.pp == 1 {
            assert_eq!(logits.len(), seqs.len(), "eval {}: logits", layout.name);
            for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
                let e = rel_err(a, b);
                assert!(
                    e <= 1e-5,
                    "eval {}: sequence {i}: logits rel err {e:e}",
                    layout.name
                );
            }
        }
    }
    let tp2 = &layouts[0];
    let saved_tp2 = models::hub::from_dir("tp2", &step_dir("train", tp2)).unwrap();
    let (loss, _) = eval_through_registry(&saved_tp2, &single, &seqs);
    assert_close_scalar(loss, want_loss, 1e-5, "the checkpoint saved under tp2");

    // Greedy generation with the KV cache.
    let prompt = &seqs[0][..5];
    let new = 8;
    let want_tokens = generate_through_registry(&trained, &single, prompt, new).unwrap();
    assert_eq!(want_tokens.len(), prompt.len() + new);
    assert_eq!(&want_tokens[..prompt.len()], prompt);
    // Each new token is the argmax of a full (uncached) forward over the text before it.
    let text = vec![want_tokens[..want_tokens.len() - 1].to_vec()];
    let (_, full) = eval_through_registry(&trained, &single, &text);
    let full = full[0].to_vec2::<f32>().unwrap();
    for k in prompt.len()..want_tokens.len() {
        let argmax = train::generation::argmax(&full[k - 1]);
        assert_eq!(
            want_tokens[k], argmax,
            "token {k}: the cached step's argmax"
        );
    }
    for layout in &layouts {
        let got = generate_through_registry(&trained, layout, prompt, new);
        if layout.sp.ring > 1 {
            let err = got.unwrap_err();
            assert!(
                err.contains("sequence parallelism"),
                "{}: {err}",
                layout.name
            );
        } else {
            assert_eq!(got.unwrap(), want_tokens, "generate {}", layout.name);
        }
    }

    // LoRA fine-tuning through the driver.
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: LoraTargets::AllLinear,
        use_rslora: false,
        seed: 5,
        target_parameters: Vec::new(),
        alpha_pattern: Default::default(),
        rank_pattern: Default::default(),
    };
    let want = registry_run(&dir, &single, steps, Some(&lora), &out("lora", &single));
    // Two matrices per linear layer: q, k, v, o, fc1, fc2 of each layer.
    assert_eq!(
        want.0.weights.len(),
        2 * 6 * CFG.num_layers,
        "adapters only"
    );
    for layout in &layouts {
        let got = registry_run(&dir, layout, steps, Some(&lora), &out("lora", layout));
        assert_same_run(&format!("lora {}", layout.name), &got, &want);
    }
    // The saved adapter reloads onto the base; its every tensor then gets a gradient.
    let adapter = models::peft::load(&step_dir("lora", &single)).unwrap();
    let files = models::hub::from_dir("toy", &dir).unwrap();
    let grads = LocalWorld::run(1, |world| -> Result<_, String> {
        let (mesh, ctx) = single.context(world)?;
        let ad = Adapters::new(
            lora.clone(),
            Some(adapter.source.clone() as Arc<dyn candle_parallel::nn::TensorSource>),
        )
        .map_err(|e| e.to_string())?;
        let m = load_through_registry(&files, &mesh, &ctx, None, ParamMode::Trainable, Some(ad))?;
        let (batch, labels) = Batch::from_sequences(&ctx, &seqs[..1], AttnMaskKind::Causal)
            .map_err(|e| e.to_string())?;
        let (loss, _) = m
            .model
            .loss_sum(&batch, &labels, &CrossEntropyOptions::default())
            .map_err(|e| e.to_string())?;
        let g = m.model.backward(&loss).map_err(|e| e.to_string())?;
        Ok(m.params
            .sorted()
            .iter()
            .filter_map(|p| Some((p.name.clone(), g.get(p.var.as_ref()?)?.clone())))
            .collect::<Vec<_>>())
    })
    .unwrap()
    .remove(0);
    assert_eq!(
        grads.len(),
        want.0.weights.len(),
        "a gradient for every adapter tensor"
    );
    for (n, g) in &grads {
        assert!(want.0.weights.contains_key(n), "{n}: trained but not saved");
        let m = max_abs(g);
        assert!(m > 0.0 && m.is_finite(), "{n}: gradient max |g| {m}");
    }

    // An architecture no family claims: the error lists the supported ones.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(
        other.join("config.json"),
        r#"{"architectures": ["MambaForCausalLM"]}"#,
    )
    .unwrap();
    let err = models::family::detect(&other.join("config.json"))
        .unwrap_err()
        .to_string();
    for want in ["MambaForCausalLM", "llama", "dit", "llava", "toy-encoder"] {
        assert!(err.contains(want), "{want} in: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
