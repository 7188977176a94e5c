//! `cpl generate`: text continuation with a KV cache (one rank, tensor parallel, pipeline
//! stages).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_parallel::comm::Comm;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::ParamMode;
use candle_parallel::pipeline::split_layers;
use models::causal_lm::{CausalLm, KvCache};
use models::tokenizer::{SpecialTokens, Tokenizer};

use crate::args::GenerateArgs;
use crate::launch::{launch_pipelined, load_causal_lm};
use crate::sampling::{sample, Rng};

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
    // The family of the checkpoint (the registry): its layers, width and vocabulary. Under
    // --pp the decoder layers are cut into one stage per pipeline rank (the default split of
    // `cpl train`).
    let desc = (models::family::detect(&files.config)?.describe)(&files.config)?;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= desc.vocab) {
        bail!("the prompt holds token id {bad}, outside the model's vocabulary");
    }
    let (num_layers, pp) = (desc.layers, args.layout.pp);
    let ranges = split_layers(num_layers, pp, None)
        .with_context(|| format!("--pp {pp} for the {num_layers} layers of {}", files.source))?;
    let text = launch_pipelined(&args.layout, |rank| {
        let m = load_causal_lm(
            &files,
            rank,
            &ranges,
            dtype,
            ParamMode::Frozen,
            &args.layout,
            adapter.as_ref(),
        )?;
        let stages = Stages {
            pp: rank.mesh.comm(Dim::Pp),
            layers: ranges[rank.mesh.coord(Dim::Pp)].clone(),
            hidden: desc.hidden,
            vocab: desc.vocab,
            dtype: crate::eval::activation_dtype(&m.params),
        };
        let mut cache = KvCache::default();
        let mut rng = Rng(args.seed);
        let mut out = prompt.clone();
        let dev = rank.ctx.device();
        let mut next = Tensor::from_vec(prompt.clone(), (1, prompt.len()), dev)?;
        for _ in 0..args.max_new_tokens {
            // Every rank samples the same token: the last stage's logits are broadcast.
            let logits = stages.forward(m.model.as_ref(), &next, &mut cache)?;
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
    vocab: usize,
    /// Dtype of the hidden states between stages (the parameters').
    dtype: DType,
}

impl Stages {
    /// The logits `(1, vocab)` f32 of the last of the new tokens `ids` `(1, n)`, on every rank
    /// of the pipeline; extends this stage's layers in `cache`. Collective over the world.
    fn forward(&self, model: &dyn CausalLm, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
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
            Tensor::zeros((1, self.vocab), DType::F32, x.device())?
        };
        Ok(if p > 1 {
            self.pp.broadcast(&logits, p - 1)?
        } else {
            logits
        })
    }
}
