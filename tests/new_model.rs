//! A new model written in one file from `candle_parallel::nn` alone: a 2-layer pre-norm
//! transformer with LayerNorm, full (bidirectional) GQA attention without RoPE, a GELU MLP with
//! biases, a vocab-parallel embedding and LM head. The model names no rank, no communicator and
//! no collective; the layout is the context's and the memory plan is applied to its units from
//! outside. Trained with the next-token loss (full attention sees the token it predicts, so the
//! loss falls fast: the test is about the parallel arithmetic, not the objective).
//!
//! Under tp2, zigzag ring4, ulysses2 x ring2 (USP) and ZeRO-3 (with and without selective
//! checkpointing) it trains with the losses and final weights of one rank (1e-5 relative, f32),
//! and every parameter receives a finite, non-zero gradient on every layout.
//!
//! The same model is then a family of the registry (`models::family`), registered from outside
//! the models crate with its `config.json` architecture, description and loader: detected,
//! loaded for each rank's layout and pipeline stage, and trained through the engine under tp2,
//! ring2 and pp2 with the losses, gradient norms and weights of one rank.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, Strategy};
use candle_parallel::comm::LocalWorld;
use candle_parallel::nn::{
    Activation, AttentionConfig, Batch, Block, CrossEntropyOptions, EmbeddingConfig, LayerNorm,
    LmHead, Mlp, MlpConfig, NormConfig, ParallelAttention, ParallelCtx, ParamBuilder, ParamMode,
    Pass, TensorMap, Track, Unit, UnitOps, VocabParallelEmbedding,
};
use candle_parallel::optim::ZeroStage;
use candle_parallel::plan::{MemoryPlan, Parallelize};
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_identical, rel_err, train_through_registry, whole_weights, Layout,
};
use models::family::{Description, Family, Kind, LoadSpec, LoadedCausalLm};
use models::hub::ModelFiles;
use models::CausalLm;
use testkit::{assert_close_scalar, assert_finite, max_abs};
use train::data::{PackedDataset, Packing, TokenStream};
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
        })
    }

    fn ends(&self) -> models::Result<EncoderEnds> {
        let ends = self
            .ends
            .as_ref()
            .ok_or_else(|| models::Error::Invalid("no ends on this stage".into()))?;
        Ok(ends.get(Track::Grad)?)
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
        // Bidirectional: every token sees the whole sequence, whatever the data's mask.
        let pass = Pass::new(&self.ctx, &batch.positions, &AttnMask::Full);
        let mut x = x.clone();
        for i in layers {
            let layer = self.layers[i]
                .as_ref()
                .ok_or_else(|| models::Error::Invalid(format!("layer {i} is on another stage")))?;
            x = layer.forward(&x, &pass)?;
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

/// Deterministic weights (splitmix64), the same on every rank: normal-ish matrices of scale
/// 0.2, norm weights around 1, biases around 0.
fn weights() -> HashMap<String, Tensor> {
    let mut state = 0x5eed_u64;
    let mut tensor = |shape: &[usize], center: f32, scale: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32;
                center + scale * (2.0 * u - 1.0)
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let (v, h, i) = (CFG.vocab_size, CFG.hidden_size, CFG.intermediate_size);
    let kv = CFG.num_kv_heads * h / CFG.num_heads;
    let mut w = HashMap::new();
    for (name, shape) in [("embed.weight", vec![v, h]), ("head.weight", vec![v, h])] {
        w.insert(name.to_string(), tensor(&shape, 0.0, 0.3));
    }
    w.insert("norm.weight".into(), tensor(&[h], 1.0, 0.3));
    w.insert("norm.bias".into(), tensor(&[h], 0.0, 0.1));
    for l in 0..CFG.num_layers {
        let p = |n: &str| format!("layers.{l}.{n}");
        for (n, out, inp) in [
            ("attn.q_proj", h, h),
            ("attn.k_proj", kv, h),
            ("attn.v_proj", kv, h),
            ("attn.o_proj", h, h),
            ("mlp.fc1", i, h),
            ("mlp.fc2", h, i),
        ] {
            w.insert(p(&format!("{n}.weight")), tensor(&[out, inp], 0.0, 0.3));
            if n.starts_with("mlp") {
                w.insert(p(&format!("{n}.bias")), tensor(&[out], 0.0, 0.1));
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
        causal: false,
        planner_shape: None,
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

/// Trains the registry's model of `dir` under `layout` (see [`train_through_registry`]).
fn registry_run(dir: &std::path::Path, layout: &Layout, steps: u64) -> (Run, Vec<f64>) {
    let files = models::hub::from_dir("toy", dir).unwrap();
    let dp = layout.mesh.degree(candle_parallel::mesh::Dim::Dp);
    let cfg = config(steps, MemoryPlan::default(), 2 / dp);
    let got = train_through_registry(&files, layout, &cfg, &data());
    let mut norms = got.grad_norms;
    norms.push(got.eval_loss);
    let run = Run {
        losses: got.losses,
        weights: got.weights,
        grad_max: Vec::new(),
    };
    (run, norms)
}

/// A family registered from outside the models crate is detected from its `config.json`
/// (`architectures`), described (FLOPs), loaded by its own loader for each rank's layout and
/// pipeline stage, and trains and evaluates through the engine under tp2, ring2 and pp2 with
/// the losses, gradient norms, held-out loss and final weights of one rank (1e-5). An unknown architecture lists the
/// supported families, the registered one among them.
#[test]
fn a_family_registered_from_outside_trains_through_the_registry() {
    models::family::register(&TOY).unwrap();
    assert!(models::family::register(&TOY).is_err(), "registered twice");
    let dir = toy_checkpoint();
    let family = models::family::detect(&dir.join("config.json")).unwrap();
    assert_eq!(family.name, "toy-encoder");
    let desc = (family.describe)(&dir.join("config.json")).unwrap();
    let flops = desc.flops_per_token(32, models::family::Work::Training);
    assert!(flops > 6.0 * desc.matmul_params as f64, "{flops}");
    let steps = 3;
    let (want, want_norms) = registry_run(&dir, &Layout::single(), steps);
    assert!(want.losses.iter().all(|l| l.is_finite()));
    assert_eq!(
        want.weights.len(),
        weights().len(),
        "every parameter trained"
    );
    for layout in [
        Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        Layout::new("ring2", 1, 1, 2, Strategy::Ring),
        Layout::single().with_pp(2),
    ] {
        let (got, norms) = registry_run(&dir, &layout, steps);
        for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
            assert_close_scalar(*a, *b, 1e-5, &format!("{}: step {i}: loss", layout.name));
        }
        // Gradient norms of every step, then the held-out loss after training.
        assert_eq!(norms.len(), steps as usize + 1);
        for (i, (g, w)) in norms.iter().zip(&want_norms).enumerate() {
            let what = format!("{}: step {i}: gradient norm / eval loss", layout.name);
            assert_close_scalar(*g, *w, 1e-5, &what);
        }
        assert_eq!(got.weights.len(), want.weights.len(), "{}", layout.name);
        for (n, w) in &want.weights {
            let e = rel_err(&got.weights[n], w);
            assert!(
                e <= 1e-5,
                "{}: final weight {n}: rel err {e:e}",
                layout.name
            );
        }
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
