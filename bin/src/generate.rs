//! `cpl generate`: text continuation with a KV cache (one rank, tensor parallel, pipeline
//! stages).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_parallel::comm::Comm;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::ParamMode;
use candle_parallel::pipeline::split_layers;
use models::llama::{self, Llama, LlamaConfig};
use models::tokenizer::{SpecialTokens, Tokenizer};

use crate::eval::DtypeArg;
use crate::launch::{launch_pipelined, load_llama_stage};
use crate::layout::LayoutArgs;

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// Model directory or Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// A LoRA adapter (PEFT directory, e.g. a `cpl finetune` checkpoint) applied to --model.
    #[arg(long)]
    pub adapter: Option<std::path::PathBuf>,
    /// Vision-language models (LLaVA): image files the prompt is about (PNG or JPEG; repeat or
    /// separate with commas).
    #[arg(long, value_delimiter = ',', help_heading = "Vision-language")]
    pub image: Vec<std::path::PathBuf>,
    /// The text to continue (language models).
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Nucleus sampling: sample among the most likely tokens whose probabilities sum to top-p.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Compute dtype (default: the checkpoint's).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Diffusion models (DiT): the classes to sample, e.g. `1,2,3` (one image each).
    #[arg(long, help_heading = "Diffusion")]
    pub class_labels: Option<String>,
    /// Diffusion models: sampling steps.
    #[arg(long, default_value_t = 50, help_heading = "Diffusion")]
    pub steps: usize,
    /// Diffusion models: classifier-free guidance scale (1: none).
    #[arg(long, default_value_t = 4.0, help_heading = "Diffusion")]
    pub guidance: f64,
    /// Diffusion models: the sampler (flow for rectified-flow models).
    #[arg(long, value_enum, default_value_t = crate::dit_cmd::SamplerArg::Ddim, help_heading = "Diffusion")]
    pub sampler: crate::dit_cmd::SamplerArg,
    /// Diffusion models: where the PNG grid of samples goes.
    #[arg(long, help_heading = "Diffusion")]
    pub out: Option<std::path::PathBuf>,
    /// Diffusion models: images per row of the grid (0: a square grid).
    #[arg(long, default_value_t = 0, help_heading = "Diffusion")]
    pub cols: usize,
    /// Diffusion models: pixels per image pixel in the grid.
    #[arg(long, default_value_t = 4, help_heading = "Diffusion")]
    pub scale: usize,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

/// A small deterministic generator (splitmix64) for sampling.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks the next token from `logits` (vocab) by temperature and top-p.
pub(crate) fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &l)| {
                if l > best.1 {
                    (i, l)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = Vec::new();
    let mut acc = 0.0;
    for (i, p) in probs {
        acc += p / total;
        kept.push((i, p));
        if acc >= top_p {
            break;
        }
    }
    let mass: f64 = kept.iter().map(|p| p.1).sum();
    let mut r = rng.next_f64() * mass;
    for (i, p) in &kept {
        r -= p;
        if r <= 0.0 {
            return *i as u32;
        }
    }
    kept.last().map(|k| k.0 as u32).unwrap_or_else(argmax)
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let model = crate::model_arg::resolve(&args.model)?;
    match model.family.kind {
        models::Kind::Diffusion => return crate::dit_cmd::generate(args, &model.dir),
        models::Kind::VisionLanguage => return crate::llava_cmd::generate(args, &model.dir),
        models::Kind::CausalLm => {}
    }
    if !args.image.is_empty() {
        bail!("--image: {} is not a vision-language model", args.model);
    }
    let Some(prompt) = &args.prompt else {
        bail!("--prompt: the text to continue is required for a language model");
    };
    if !(0.0..=1.0).contains(&args.top_p) || args.top_p == 0.0 {
        bail!("--top-p {} must be in (0, 1]", args.top_p);
    }
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!("--temperature {} must be >= 0", args.temperature);
    }
    if args.layout.ulysses > 1 || args.layout.ring > 1 || args.layout.tp_sp {
        bail!("cpl generate runs on one rank, with --tp or with --pp (not --ulysses, --ring or --tp-sp)");
    }
    let files = models::hub::resolve(&args.model)?;
    let tok = Tokenizer::from_model(&files)?;
    let dtype = args.dtype.map(DType::from);
    let prompt = tok.encode(prompt, SpecialTokens::Keep)?;
    if prompt.is_empty() {
        bail!("--prompt: the prompt encodes to no tokens");
    }
    let adapter = crate::launch::read_adapter(args.adapter.as_deref())?;
    // Under --pp the decoder layers are cut into one stage per pipeline rank (the default
    // split of `cpl train`).
    let num_layers = LlamaConfig::from_file(&files.config)?.num_hidden_layers;
    let pp = args.layout.pp;
    let ranges = split_layers(num_layers, pp, None)
        .with_context(|| format!("--pp {pp} for the {num_layers} layers of {}", files.source))?;
    let text = launch_pipelined(&args.layout, |rank| {
        let m = load_llama_stage(
            &files,
            rank,
            dtype,
            ParamMode::Frozen,
            &args.layout,
            &ranges,
            adapter.as_ref(),
        )?;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= m.config.vocab_size) {
            bail!("the prompt holds token id {bad}, outside the model's vocabulary");
        }
        let stages = Stages {
            pp: rank.mesh.comm(Dim::Pp),
            layers: ranges[rank.mesh.coord(Dim::Pp)].clone(),
            hidden: m.config.hidden_size,
            dtype: m
                .params
                .sorted()
                .first()
                .map(|p| p.tensor.dtype())
                .unwrap_or(DType::F32),
        };
        let mut cache = llama::KvCache::default();
        let mut rng = Rng(args.seed);
        let mut out = prompt.clone();
        let dev = rank.ctx.device();
        let mut next = Tensor::from_vec(prompt.clone(), (1, prompt.len()), dev)?;
        for _ in 0..args.max_new_tokens {
            // Every rank samples the same token: the last stage's logits are broadcast.
            let logits = stages.forward(&m.model, &next, &mut cache)?;
            let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let t = sample(&logits, args.temperature, args.top_p, &mut rng);
            out.push(t);
            if Some(t) == tok.eos_token_id {
                break;
            }
            next = Tensor::from_vec(vec![t], (1, 1), dev)?;
        }
        Ok(tok.decode(&out, SpecialTokens::Drop)?)
    })
    .context("generating")?;
    if let Some(text) = text {
        println!("{text}");
    }
    Ok(())
}

/// A rank's pipeline stage for generation: its decoder layers, and the pipeline group through
/// which hidden states go forward and the last stage's logits come back.
struct Stages {
    pp: Comm,
    layers: std::ops::Range<usize>,
    hidden: usize,
    /// Dtype of the hidden states between stages (the parameters').
    dtype: DType,
}

impl Stages {
    /// The logits `(1, vocab)` f32 of the last of the new tokens `ids` `(1, n)`, on every rank
    /// of the pipeline; extends this stage's layers in `cache`. Collective over the world.
    fn forward(&self, model: &Llama, ids: &Tensor, cache: &mut llama::KvCache) -> Result<Tensor> {
        let (p, r) = (self.pp.size(), self.pp.rank());
        let n = ids.dim(1)?;
        let x = if r == 0 {
            model.embed_cached(ids)?
        } else {
            let shape = candle_core::Shape::from((1, n, self.hidden));
            self.pp.recv(r - 1, &shape, self.dtype)?
        };
        let x = model.layers_cached(&x, self.layers.clone(), cache)?;
        cache.advance(n);
        if r + 1 < p {
            self.pp.send(&x, r + 1)?;
        }
        let logits = if r + 1 == p {
            model.head_cached(&x)?
        } else {
            Tensor::zeros((1, model.config().vocab_size), DType::F32, x.device())?
        };
        Ok(if p > 1 {
            self.pp.broadcast(&logits, p - 1)?
        } else {
            logits
        })
    }
}
