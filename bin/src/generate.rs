//! `cpl generate`: text continuation with a KV cache (one rank, tensor parallel, pipeline
//! stages; a mixture of experts' experts divided over data-parallel ranks with `--ep`).

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::ParamMode;
use candle_parallel::pipeline::split_by_cost;
use models::tokenizer::{SpecialTokens, Tokenizer};
use train::evaluation::activation_dtype;
use train::generation::{generate, sample, Rng, Stages};

use crate::args::GenerateArgs;
use crate::launch::{launch_pipelined, load_causal_lm};

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
    // The stages balanced by their work on the prompt and the new tokens (as --pp-layers auto).
    let (num_layers, pp) = (desc.layers, args.layout.pp);
    let costs = desc.stage_costs(
        prompt.len() + args.max_new_tokens,
        models::family::Work::Forward,
    );
    let ranges = split_by_cost(&costs, pp)
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
        let stages = Stages::new(
            &rank.mesh,
            ranges[rank.mesh.coord(Dim::Pp)].clone(),
            desc.hidden,
            desc.vocab,
            activation_dtype(&m.params),
        );
        let mut rng = Rng(args.seed);
        let out = generate(
            m.model.as_ref(),
            &stages,
            &prompt,
            args.max_new_tokens,
            tok.eos_token_id,
            |logits| sample(logits, args.temperature, args.top_p, &mut rng),
        )?;
        Ok(tok.decode(&out, SpecialTokens::Drop)?)
    })
    .context("generating")?;
    if let Some(text) = text {
        println!("{text}");
    }
    Ok(())
}
