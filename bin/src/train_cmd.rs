//! `cpl train`: continued pretraining of a Hugging Face checkpoint under any parallel layout.
//!
//! With no arguments it runs the embedded default: the small LLaMA in `assets/default/model`
//! (trained at context 128) continues pretraining on the bundled Shakespeare corpus at context
//! 512 across 4 local ranks with zigzag ring attention.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_parallel::mesh::{Dim, MeshLayout};
use candle_parallel::nn::ParamMode;
use models::tokenizer::Tokenizer;
use models::Kind;
use train::data::{PackedDataset, Packing, TokenStream};
use train::driver::tasks::{CurriculumPhase, LengthCurriculum, NextTokenTask};
use train::driver::{self, Resume};
use train::trainer::{TrainConfig, Trainer};

use crate::args::{default_asset, interrupt_flag, TrainArgs};
use crate::launch::{launch_pipelined, load_causal_lm};

pub fn run(args: &TrainArgs) -> Result<()> {
    if let Some(model) = &args.model {
        let m = crate::model_arg::resolve(model)?;
        if m.family.kind != Kind::CausalLm && args.rope.to_override()?.is_some() {
            bail!(
                "--rope-*: only text models (causal LMs) take a RoPE change; --model {model} is a \
                 {} model",
                m.family.name
            );
        }
        for (flag, given) in [
            (
                "--router-aux-loss-coef",
                args.router_aux_loss_coef.is_some(),
            ),
            ("--moe-capacity-factor", args.moe_capacity_factor.is_some()),
        ] {
            if m.family.kind != Kind::CausalLm && given {
                bail!(
                    "{flag}: only mixture-of-experts text models have routers; --model {model} \
                     is a {} model",
                    m.family.name
                );
            }
        }
        if m.family.kind != Kind::CausalLm && args.seq_len_schedule.is_some() {
            bail!(
                "--seq-len-schedule: only text models (causal LMs) train on a length curriculum; \
                 --model {model} is a {} model",
                m.family.name
            );
        }
        if m.family.kind != Kind::CausalLm && (args.eval_passkey || args.eval_by_position) {
            bail!(
                "--eval-passkey / --eval-by-position: only text models (causal LMs) are evaluated \
                 by position or passkey; --model {model} is a {} model",
                m.family.name
            );
        }
        match m.family.kind {
            Kind::Diffusion => return crate::dit_cmd::train(args, &m.dir),
            Kind::VisionLanguage => return crate::llava_cmd::train(args, &m.dir),
            Kind::CausalLm => {}
        }
    }
    if args.from_scratch {
        bail!("--from-scratch: only diffusion models (DiT) are initialised from their config");
    }
    if args.template.is_some() || args.freeze_vision_tower || args.freeze_language_model {
        bail!(
            "--template / --freeze-vision-tower / --freeze-language-model are for vision-language \
             models (LLaVA); to train a text model on chat data use cpl finetune"
        );
    }
    let args = &TrainArgs {
        layout: args.layout.clone().for_documents(args.doc_mask),
        ..args.clone()
    };
    let mut cfg = args.train_config()?;
    // Flag checks that need the layout, before the data is read and tokenized.
    let sp = args.layout.sp_config()?;
    if let Some(z) = cfg.memory.zero_group {
        let mesh = args.layout.mesh_config()?;
        let g = MeshLayout::new(&mesh, args.layout.ranks)?.group_size(&[
            Dim::Ulysses,
            Dim::Ring,
            Dim::Dp,
        ]);
        if !g.is_multiple_of(z) {
            bail!(
                "--zero-group {z} does not divide the {g} ranks that hold the same parameters \
                 (ulysses x ring x dp)"
            );
        }
        let ep = args.layout.ep;
        if ep > 1 && !z.is_multiple_of(ep) && !ep.is_multiple_of(z) {
            bail!(
                "--zero-group {z} with --ep {ep}: one must divide the other (each expert is \
                 sharded over the ranks of a ZeRO group that hold it: --zero-group / --ep of them)"
            );
        }
    }
    // Every length of the run splits under the layout, checked before anything runs.
    match &cfg.seq_len_schedule {
        Some(s) => {
            for (i, p) in s.phases().iter().enumerate() {
                args.layout.check_seq_len(p.seq_len).with_context(|| {
                    format!(
                        "--seq-len-schedule {s}: phase {} (length {})",
                        i + 1,
                        p.seq_len
                    )
                })?;
            }
        }
        None => args.layout.check_seq_len(cfg.seq_len)?,
    }
    let model_id = match &args.model {
        Some(m) => m.clone(),
        None => default_asset("model").display().to_string(),
    };
    let mut files = models::hub::resolve(&model_id)?;
    // Files copied into every checkpoint so that it is a complete HF model directory (read
    // before --rope-* points the config elsewhere).
    let mut extra =
        crate::model_arg::checkpoint_files(models::family::detect(&files.config)?, &files)?;
    let resume = Resume::find(args.resume, &args.out)?;
    let changes = crate::model_arg::train_config_changes(
        &args.rope,
        args.router_aux_loss_coef,
        args.moe_capacity_factor,
    )?;
    crate::model_arg::apply_config_changes(
        &mut files,
        &changes,
        &args.out,
        &mut extra,
        resume
            .as_ref()
            .map(|r| r.dir.join("config.json"))
            .as_deref(),
    )?;
    // The family of the checkpoint (the registry), its size and FLOPs, and its loader.
    let family = models::family::detect(&files.config)?;
    if family.load_causal_lm.is_none() {
        bail!(
            "--model {model_id}: the {} family does not load as a causal language model",
            family.name
        );
    }
    let desc = (family.describe)(&files.config)?;
    let costs = desc.stage_costs(cfg.seq_len, models::family::Work::Training);
    let ranges = args
        .pipeline
        .configure(&mut cfg, args.layout.pp, &costs, &files.config)?;
    // A length curriculum's phases: their shapes (the tokens of a step kept), within the
    // model's positions (after --rope-* and --max-position-embeddings).
    let shapes = match &cfg.seq_len_schedule {
        Some(s) => {
            s.check_max_position(max_position_embeddings(&files.config)?)?;
            let shapes = s.shapes(cfg.batch, cfg.grad_accum)?;
            // Under a pipeline, every phase's micro-batches make a schedule.
            for (i, shape) in shapes.iter().enumerate() {
                args.pipeline
                    .schedule(args.layout.pp, shape.grad_accum)
                    .with_context(|| {
                        format!(
                            "--seq-len-schedule {s}: phase {} ({} micro-batches of {} sequences)",
                            i + 1,
                            shape.grad_accum,
                            shape.batch
                        )
                    })?;
            }
            Some(shapes)
        }
        None => None,
    };
    let dtype = args.dtype.map(DType::from).unwrap_or(DType::F32);
    // Data: tokenized once, identical on every rank.
    let tokenizer = || Tokenizer::from_model(&files);
    let data = dataset(
        args.tokens.as_ref().map(|t| (t, "--tokens")),
        (&args.data, "--data"),
        Some(default_asset("corpus/shakespeare.jsonl")),
        &tokenizer,
        &args.text_field,
        desc.vocab,
        &cfg,
    )?
    .context("no training data")?;
    let eval_data = dataset(
        args.eval_tokens.as_ref().map(|t| (t, "--eval-tokens")),
        (&args.eval_data, "--eval-data"),
        None,
        &tokenizer,
        &args.text_field,
        desc.vocab,
        &cfg,
    )?;
    // Each phase's windows and held-out windows (the same token streams).
    let phase_data = match &shapes {
        Some(shapes) => {
            let at = |d: &PackedDataset, len: usize| {
                d.with_seq_len(len)
                    .with_context(|| format!("--seq-len-schedule: the phase of length {len}"))
            };
            let mut out = Vec::new();
            for s in shapes {
                let eval = eval_data.as_ref().map(|e| at(e, s.seq_len)).transpose()?;
                let flops = desc.flops_per_token(s.seq_len, models::family::Work::Training);
                out.push((*s, at(&data, s.seq_len)?, eval, flops));
            }
            Some(out)
        }
        None => None,
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    let interrupted = interrupt_flag()?;
    let flops_per_token = desc.flops_per_token(cfg.seq_len, models::family::Work::Training);
    let load_files = match &resume {
        Some(r) => models::hub::from_dir(&r.dir.display().to_string(), &r.dir)?,
        None => files.clone(),
    };
    let sequences = args.layout.dp_degree()? * cfg.batch * cfg.grad_accum;
    let shape = match &cfg.seq_len_schedule {
        Some(s) => format!(
            "seq-len schedule {s} ({} tokens/step)",
            cfg.seq_len * sequences
        ),
        None => format!("seq {} x {sequences} sequences/step", cfg.seq_len),
    };
    let banner = format!(
        "cpl train: {} ({:.2} M params) on {} tokens, {shape}, {} steps, {} rank(s), {}",
        model_id,
        desc.params as f64 / 1e6,
        data.num_tokens(),
        cfg.steps,
        args.layout.ranks,
        sp.strategy.name()
    );
    if args.eval_by_position && (eval_data.is_none() || cfg.pipeline.is_some()) {
        bail!(
            "--eval-by-position needs held-out data (--eval-data or --eval-tokens) and no --pp \
             (every sequence-parallel layout is fine)"
        );
    }
    let passkey = args
        .eval_passkey
        .then(|| {
            crate::eval::passkey_prompts(
                &args.passkey_grid,
                &files,
                desc.vocab,
                Some(&args.layout),
                "--eval-passkey",
            )
        })
        .transpose()?;
    let opts = args.run_options(cfg.steps, extra, flops_per_token, banner)?;
    let _trace = args.start_trace()?;
    let final_history = launch_pipelined(&args.layout, |rank| {
        // The loaded parameter list is dropped here, so that under ZeRO-3 the whole tensors
        // are freed once the trainer has sharded them.
        let model = load_causal_lm(
            &load_files,
            rank,
            &ranges,
            Some(dtype),
            ParamMode::Trainable,
            &args.layout,
            None,
        )?
        .model;
        let mut trainer = Trainer::new(model, &rank.mesh, &rank.ctx, cfg.clone())?;
        if let Some(r) = &resume {
            r.restore(&mut trainer)?;
        }
        let mut task = NextTokenTask {
            trainer,
            data: &data,
            eval: eval_data.as_ref().map(|d| (d, args.eval_windows)),
            count_key: "tokens",
            processed_tokens: None,
            by_position: args.eval_by_position.then_some(&rank.mesh),
            passkey: passkey.as_deref().map(|p| (&rank.mesh, p)),
        };
        let world = rank.world();
        let history = Resume::history(resume.as_ref());
        let Some(phases) = &phase_data else {
            return Ok(driver::run(
                &mut task,
                &world,
                &opts,
                history,
                &interrupted,
            )?);
        };
        let phases = phases
            .iter()
            .map(|(shape, data, eval, flops)| CurriculumPhase {
                shape: *shape,
                data,
                eval: eval.as_ref(),
                flops_per_token: *flops,
            })
            .collect();
        let mut task = LengthCurriculum::new(task, phases)?;
        Ok(driver::run(
            &mut task,
            &world,
            &opts,
            history,
            &interrupted,
        )?)
    })?;
    if let Some(history) = final_history {
        let model_name = std::path::Path::new(&model_id)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| model_id.clone());
        let title = format!("{model_name}: {} ({})", args.layout.flags(), sp.strategy);
        driver::finish(&history, &opts, &title)?;
    }
    Ok(())
}

/// The `max_position_embeddings` of the model config at `path` (`None` when it has none).
fn max_position_embeddings(path: &std::path::Path) -> Result<Option<usize>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    Ok(v.get("max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .map(|m| m as usize))
}

/// The packed dataset of `tokens` (a token file and its flag) or of the files of `data` (and
/// their flag), `default` when neither is given; `None` when there is nothing.
fn dataset(
    tokens: Option<(&PathBuf, &str)>,
    (data, data_flag): (&[PathBuf], &str),
    default: Option<PathBuf>,
    tokenizer: &dyn Fn() -> models::Result<Tokenizer>,
    text_field: &str,
    vocab_size: usize,
    cfg: &TrainConfig,
) -> Result<Option<PackedDataset>> {
    let stream = if let Some((t, flag)) = tokens {
        let seqs = train::data::read_token_sequences(t, vocab_size, flag)?;
        TokenStream::from_sequences(&seqs, vocab_size)?
    } else {
        let paths = match (data.is_empty(), default) {
            (false, _) => data.to_vec(),
            (true, Some(d)) => vec![d],
            (true, None) => return Ok(None),
        };
        let docs = train::data::read_corpus(&paths, text_field, data_flag)?;
        TokenStream::from_documents(&tokenizer()?, &docs, vocab_size)?
    };
    let flag = tokens.map(|t| t.1).unwrap_or(data_flag);
    let data = PackedDataset::new(stream, cfg.seq_len, Packing::with_doc_mask(cfg.doc_mask))
        .with_context(|| format!("{flag} with --seq-len {}", cfg.seq_len))?;
    Ok(Some(data))
}
