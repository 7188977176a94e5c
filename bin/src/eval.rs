//! `cpl eval`: mean next-token loss, perplexity and token count of a model on a data file.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_parallel::attention::ShardPlan;
use candle_parallel::nn::ParamMode;
use models::tokenizer::Tokenizer;

use crate::args::{EvalArgs, PasskeyGridArgs};
use crate::launch::{launch_pipelined, load_causal_lm, Rank};
use crate::layout::LayoutArgs;
use train::evaluation::{
    activation_dtype, position_buckets, score, ByPosition, EvalReport, ScoreOptions,
};

/// The largest length `<= len` that the layout can shard (0 if none).
fn fit_to_layout(len: usize, layout: &LayoutArgs) -> Result<usize> {
    let sp = layout.sp_config()?;
    let mut l = len;
    while l >= 2 {
        if ShardPlan::new(l, sp.layout, sp.ring, sp.ulysses).is_ok() {
            return Ok(l);
        }
        l -= 1;
    }
    Ok(0)
}

/// The shortest length from `len` to `max` that the layout can split (`max` itself when none
/// shorter is).
fn pad_to_layout(len: usize, max: usize, layout: &LayoutArgs) -> Result<usize> {
    let sp = layout.sp_config()?;
    Ok((len..max)
        .find(|&l| ShardPlan::new(l, sp.layout, sp.ring, sp.ulysses).is_ok())
        .unwrap_or(max))
}

/// The sequences to evaluate and the scored length of each (the tokens after it pad the
/// sequence to a length the layout can split).
struct Sequences {
    seqs: Vec<Vec<u32>>,
    lengths: Vec<usize>,
}

/// The sequences to evaluate, from `--tokens` or `--data`.
fn sequences(
    args: &EvalArgs,
    files: &models::hub::ModelFiles,
    vocab_size: usize,
) -> Result<Sequences> {
    let sp = args.layout.sp_config()?;
    if let Some(path) = &args.tokens {
        let seqs = train::data::read_token_sequences(path, vocab_size, "--tokens")?;
        for (i, s) in seqs.iter().enumerate() {
            ShardPlan::new(s.len(), sp.layout, sp.ring, sp.ulysses).with_context(|| {
                format!(
                    "--tokens {}: sequence {i} ({} tokens) cannot be split by the layout flags \
                     (--ring {} --ulysses {} --ring-layout {})",
                    path.display(),
                    s.len(),
                    sp.ring,
                    sp.ulysses,
                    sp.layout
                )
            })?;
        }
        let lengths = seqs.iter().map(Vec::len).collect();
        return Ok(Sequences { seqs, lengths });
    }
    let Some(path) = &args.data else {
        bail!("give the data to evaluate with --data FILE (text or jsonl) or --tokens FILE");
    };
    if args.seq_len < 2 {
        bail!("--seq-len {} must be at least 2", args.seq_len);
    }
    let window = fit_to_layout(args.seq_len, &args.layout)?;
    if window != args.seq_len {
        bail!(
            "--seq-len {} cannot be split by the layout flags (--ring {} --ulysses {} --ring-layout {}); \
             {window} can",
            args.seq_len,
            sp.ring,
            sp.ulysses,
            sp.layout
        );
    }
    let tok = Tokenizer::from_model(files)?;
    let docs = train::data::read_documents(path, &args.text_field, "--data")?;
    let ids = train::data::TokenStream::from_documents(&tok, &docs, vocab_size)
        .with_context(|| format!("tokenizing --data {}", path.display()))?
        .ids;
    let mut seqs: Vec<Vec<u32>> = ids.chunks(window).map(|c| c.to_vec()).collect();
    let mut lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    if seqs.last().is_some_and(|s| s.len() < 2) {
        seqs.pop();
        lengths.pop();
    }
    if seqs.is_empty() {
        bail!("--data {}: fewer than 2 tokens to evaluate", path.display());
    }
    // The last window, shorter than the others, is padded to a length the layout can split:
    // every layout scores the same tokens.
    if let Some(last) = seqs.last_mut() {
        let padded = pad_to_layout(last.len(), window, &args.layout)?;
        last.resize(padded, 0);
    }
    Ok(Sequences { seqs, lengths })
}

/// Evaluates on every rank; returns rank 0's report and logits (`None` in the other processes
/// of an MPI job).
pub fn evaluate(args: &EvalArgs) -> Result<Option<(EvalReport, Vec<Tensor>)>> {
    let files = models::hub::resolve(&args.model)?;
    // The family of the checkpoint (the registry): its layers, vocabulary and loader.
    let family = models::family::detect(&files.config)?;
    let desc = (family.describe)(&files.config)?;
    let dtype = args.dtype.map(DType::from);
    let Sequences { seqs, lengths } = sequences(args, &files, desc.vocab)?;
    let want_logits = args.logits_out.is_some();
    let costs = desc.stage_costs(args.seq_len, models::family::Work::Forward);
    let pipeline = args
        .pipeline
        .stages(args.layout.pp, &costs, &files.config)?;
    if pipeline.is_some() && want_logits {
        bail!("--logits-out is not available with --pp");
    }
    if pipeline.is_some() && args.by_position {
        bail!("--by-position is not available with --pp (every sequence-parallel layout is)");
    }
    let buckets = args
        .by_position
        .then(|| position_buckets(seqs.iter().map(Vec::len).max().unwrap_or(0)));
    let adapter = crate::launch::read_adapter(args.adapter.as_deref())?;
    launch_pipelined(&args.layout, |rank: &Rank| {
        let ranges = match &pipeline {
            Some(pc) => pc.ranges(),
            None => std::iter::once(0..desc.layers).collect(),
        };
        let loaded = load_causal_lm(
            &files,
            rank,
            &ranges,
            dtype,
            ParamMode::Frozen,
            &args.layout,
            adapter.as_ref(),
        )?;
        let act = activation_dtype(&loaded.params);
        score(
            &rank.mesh,
            &rank.ctx,
            loaded.model.as_ref(),
            act,
            &seqs,
            &ScoreOptions {
                pipeline: pipeline.as_ref(),
                logits: want_logits,
                buckets: buckets.as_deref(),
                lengths: Some(&lengths),
            },
        )
        .map_err(Into::into)
    })
}

pub fn run(args: &EvalArgs) -> Result<()> {
    let model = crate::model_arg::resolve(&args.model)?;
    if model.family.kind != models::Kind::CausalLm {
        args.layout
            .require_no_ep("a diffusion or vision-language model has no experts: cpl eval")?;
    }
    if model.family.kind == models::Kind::Diffusion {
        return crate::dit_cmd::eval(args, &model.dir);
    }
    if args.inputs.is_some() || args.outputs_out.is_some() {
        bail!(
            "--inputs and --outputs-out are for diffusion models (DiT); {} is not one",
            args.model
        );
    }
    if args.passkey {
        if model.family.kind != models::Kind::CausalLm {
            bail!("--passkey: {} is not a text model", args.model);
        }
        return passkey_run(args);
    }
    let result = match model.family.kind {
        models::Kind::VisionLanguage => Some(crate::llava_cmd::eval(args, &model.dir)?),
        _ => {
            if !args.images.is_empty() || args.pixel_values.is_some() {
                bail!(
                    "--images and --pixel-values are for vision-language models (LLaVA); {} is \
                     not one",
                    args.model
                );
            }
            evaluate(args)?
        }
    };
    let Some((mut report, logits)) = result else {
        return Ok(());
    };
    if let Some(b) = report.by_position.as_mut() {
        b.model = args.model.clone();
    }
    if let (Some(path), Some(b)) = (&args.by_position_plot, &report.by_position) {
        plot_by_position(b, &args.compare, path)?;
    }
    if let Some(path) = &args.logits_out {
        let map: HashMap<String, Tensor> = logits
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("logits.{i}"), t))
            .collect();
        candle_core::safetensors::save(&map, path)
            .with_context(|| format!("--logits-out {}: cannot write", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "loss {:.6}  perplexity {:.4}  tokens {}  sequences {}",
            report.loss, report.perplexity, report.tokens, report.sequences
        );
        if let Some(b) = &report.by_position {
            println!("| positions | tokens | loss |\n|---|---|---|");
            for k in &b.buckets {
                println!("| {}-{} | {} | {:.4} |", k.from, k.to, k.tokens, k.loss);
            }
        }
    }
    Ok(())
}

/// Draws `--by-position-plot`: this evaluation's curve and those of the `--compare` files
/// (JSON of earlier `cpl eval --by-position --json` runs), each labelled with its model.
fn plot_by_position(
    this: &ByPosition,
    compare: &[std::path::PathBuf],
    path: &std::path::Path,
) -> Result<()> {
    let mut curves = Vec::new();
    for c in compare {
        let text = std::fs::read_to_string(c)
            .with_context(|| format!("--compare {}: cannot read", c.display()))?;
        let v: serde_json::Value = serde_json::from_str(text.trim())
            .with_context(|| format!("--compare {}: not JSON", c.display()))?;
        let b: ByPosition =
            serde_json::from_value(v.get("by_position").cloned().unwrap_or_default())
                .with_context(|| {
                    format!(
                    "--compare {}: no by_position (the JSON of `cpl eval --by-position --json`)",
                    c.display()
                )
                })?;
        curves.push(b);
    }
    curves.push(this.clone());
    let curves: Vec<_> = curves
        .into_iter()
        .map(|b| {
            let pts = b.buckets.iter().map(|k| (k.from, k.to, k.loss)).collect();
            (b.model, pts)
        })
        .collect();
    train::driver::plot::loss_by_position(&curves, "loss by token position", path)
        .with_context(|| format!("--by-position-plot {}", path.display()))
}

/// The prompts of the passkey `grid` in the tokenizer of `files`, for a model of `vocab` tokens
/// under `layout`; `flag` is the flag that asked for them (`--passkey`, `--eval-passkey`). Every
/// value of the grid's flags is checked here, each error naming its flag.
pub fn passkey_prompts(
    grid: &PasskeyGridArgs,
    files: &models::hub::ModelFiles,
    vocab: usize,
    layout: Option<&LayoutArgs>,
    flag: &str,
) -> Result<Vec<train::passkey::PasskeyPrompt>> {
    if layout.is_some_and(|l| l.pp > 1) {
        bail!("{flag} is not available with --pp (every sequence-parallel layout is)");
    }
    if grid.passkey_trials == 0 {
        bail!("--passkey-trials must be at least 1");
    }
    if grid.passkey_lengths.is_empty() || grid.passkey_depths.is_empty() {
        bail!("--passkey-lengths and --passkey-depths need at least one value each");
    }
    if let Some(d) = grid
        .passkey_depths
        .iter()
        .find(|d| !(0.0..=1.0).contains(*d))
    {
        bail!("--passkey-depths: passkey depth {d} is not in [0, 1]");
    }
    let tok = Tokenizer::from_model(files)
        .with_context(|| format!("{flag} needs the model's tokenizer"))?;
    let encode = |s: &str| -> train::Result<Vec<u32>> {
        tok.encode(s, models::tokenizer::SpecialTokens::Drop)
            .map_err(|e| train::error::Error::Invalid(e.to_string()))
    };
    for &l in &grid.passkey_lengths {
        layout
            .map_or(Ok(()), |layout| layout.check_seq_len(l))
            .and_then(|()| {
                train::passkey::build_prompt(&encode, tok.bos_token_id, l, 0.0, 10_000)
                    .map(drop)
                    .map_err(Into::into)
            })
            .with_context(|| format!("--passkey-lengths {l}"))?;
    }
    let prompts = train::passkey::grid(
        &encode,
        tok.bos_token_id,
        &grid.passkey_lengths,
        &grid.passkey_depths,
        grid.passkey_trials,
        grid.passkey_seed,
    )
    .context(flag.to_string())?;
    if let Some(t) = prompts
        .iter()
        .flat_map(|p| &p.tokens)
        .find(|&&t| t as usize >= vocab)
    {
        bail!("{flag}: the tokenizer gives token {t}, outside the model's vocabulary");
    }
    Ok(prompts)
}

/// `cpl eval --passkey`: the grid of [`train::passkey`] scored on every rank
/// ([`train::passkey::evaluate`]), rank 0 printing the report.
fn passkey_run(args: &EvalArgs) -> Result<()> {
    let files = models::hub::resolve(&args.model)?;
    let family = models::family::detect(&files.config)?;
    let desc = (family.describe)(&files.config)?;
    let prompts = passkey_prompts(
        &args.passkey_grid,
        &files,
        desc.vocab,
        Some(&args.layout),
        "--passkey",
    )?;
    let dtype = args.dtype.map(DType::from);
    let out = launch_pipelined(&args.layout, |rank: &Rank| {
        let ranges: Vec<_> = std::iter::once(0..desc.layers).collect();
        let loaded = load_causal_lm(
            &files,
            rank,
            &ranges,
            dtype,
            ParamMode::Frozen,
            &args.layout,
            None,
        )?;
        Ok(train::passkey::evaluate(
            &rank.mesh,
            &rank.ctx,
            loaded.model.as_ref(),
            &prompts,
        )?)
    })?;
    let Some(mut report) = out else {
        return Ok(());
    };
    report.model = args.model.clone();
    if let Some(path) = &args.passkey_plot {
        let cells: Vec<(usize, f64, f64)> = report
            .cells
            .iter()
            .map(|c| (c.length, c.depth, c.accuracy))
            .collect();
        train::driver::plot::passkey_heatmap(
            &cells,
            &format!("passkey retrieval: {}", args.model),
            path,
        )
        .with_context(|| format!("--passkey-plot {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::json!({ "passkey": report }));
    } else {
        println!(
            "passkey accuracy {:.3} ({} prompts)",
            report.accuracy,
            prompts.len()
        );
        println!("| length | depth | retrieved | answer log-likelihood |\n|---|---|---|---|");
        for c in &report.cells {
            println!(
                "| {} | {:.2} | {}/{} | {:.3} |",
                c.length, c.depth, c.retrieved, c.trials, c.answer_loglik
            );
        }
    }
    Ok(())
}
