//! `cpl train`: continued pretraining of a Hugging Face checkpoint under any parallel layout.
//!
//! With no arguments it runs the embedded default: the small LLaMA in `assets/default/model`
//! (trained at context 128) continues pretraining on the bundled Shakespeare corpus at context
//! 512 across 4 local ranks with zigzag ring attention.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::ReduceOp;
use candle_parallel::mesh::{Dim, MeshLayout};
use candle_parallel::nn::ParamMode;
use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule, ZeroStage};
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use models::family::LoadSpec;
use models::tokenizer::Tokenizer;
use models::Kind;
use train::checkpoint;
use train::checkpoint::EvalPoint;
use train::data::{PackedDataset, Packing, TokenStream};
use train::trainer::{TrainConfig, Trainer};

use crate::eval::DtypeArg;
use crate::launch::{launch_pipelined, stage_layers};
use crate::layout::{LayoutArgs, PipelineArgs};
use crate::progress::{peak_rss_mib, Progress, StepLine};

/// The repository's bundled default model and corpus.
pub fn default_asset(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../assets/default")
        .join(rel)
}

#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// TOML file whose keys are the flags of this command (e.g. `seq-len = 512`); flags given
    /// on the command line win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model directory or Hugging Face Hub id to continue training.
    #[arg(long)]
    pub model: Option<String>,
    /// Training text: .txt, .jsonl or .parquet (Hugging Face datasets) files, or directories of
    /// them. For a diffusion model (DiT): a .safetensors file of `latents` (N, C, H, W) and
    /// `labels` (N), or a folder with one sub-folder of PNG/JPEG images per class.
    #[arg(long, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Pre-tokenized documents: a JSON array of token-id arrays.
    #[arg(long, conflicts_with = "data")]
    pub tokens: Option<PathBuf>,
    /// The text field of .jsonl records and the text column of .parquet files.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Sequences per micro-batch on each data-parallel rank.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    pub grad_accum: usize,
    /// Llama 3 document masking of packed documents.
    #[arg(long)]
    pub doc_mask: bool,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 2e-4)]
    pub min_lr: f64,
    /// Warmup steps (linear from 0, as in transformers: step 0 has lr 0).
    #[arg(long, default_value_t = 10)]
    pub warmup: u64,
    /// Decay after warmup.
    #[arg(long, value_enum, default_value_t = Decay::Cosine)]
    pub decay: Decay,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f64,
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Clip gradients to this global norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Parameter dtype (master weights and moments are f32 regardless). Default: f32.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Keep the data in stream order.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Save a checkpoint every K steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    pub keep: usize,
    /// Output directory: metrics.jsonl, step-N/ checkpoints, loss.png.
    #[arg(long, default_value = "runs/default")]
    pub out: PathBuf,
    /// Continue from the last checkpoint in --out.
    #[arg(long)]
    pub resume: bool,
    /// Held-out text to evaluate on (same formats as --data); its mean loss goes to eval.jsonl
    /// and loss.png.
    #[arg(long, num_args = 1.., help_heading = "Evaluation")]
    pub eval_data: Vec<PathBuf>,
    /// Held-out pre-tokenized documents (a JSON array of token-id arrays).
    #[arg(long, conflicts_with = "eval_data", help_heading = "Evaluation")]
    pub eval_tokens: Option<PathBuf>,
    /// Evaluate every K steps (0: only after the last step).
    #[arg(long, default_value_t = 0, help_heading = "Evaluation")]
    pub eval_every: u64,
    /// Windows of --seq-len tokens evaluated each time (the first ones of the eval data).
    #[arg(long, default_value_t = 16, help_heading = "Evaluation")]
    pub eval_windows: usize,
    /// Tokens per chunk of the vocab-parallel loss. A chunk's logits (chunk x vocab / tp f32
    /// values) are a fixed memory cost of every rank that more ranks do not shrink: lower it
    /// (e.g. 128) to save memory at long context or with a large vocabulary.
    #[arg(long, default_value_t = 1024, help_heading = "Memory")]
    pub loss_chunk: usize,
    /// ZeRO stage: 0 (off), 1 (shard optimizer states), 2 (and gradients), 3 (and parameters),
    /// over the ulysses x ring x dp ranks.
    #[arg(long, value_enum, default_value_t = ZeroStage::Off, help_heading = "Memory")]
    pub zero: ZeroStage,
    /// Ranks per ZeRO sharding group (divides ulysses x ring x dp; default: all of them; 1:
    /// full replicas; between: hybrid sharding, replicated across groups).
    #[arg(long, help_heading = "Memory")]
    pub zero_group: Option<usize>,
    /// Activation checkpointing of every decoder layer: full keeps each layer's input and
    /// recomputes the layer; selective also keeps attention's output and lse, so attention and
    /// its communication run once.
    #[arg(long, value_enum, default_value_t = Checkpointing::None, help_heading = "Memory")]
    pub checkpointing: Checkpointing,
    /// Print a progress line every N steps (when stderr is not a terminal; a terminal shows a
    /// progress bar redrawn every step).
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Diffusion models (DiT): the training objective.
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Ddpm, help_heading = "Diffusion")]
    pub objective: ObjectiveArg,
    /// Diffusion models: probability of training a sample with the null class label
    /// (classifier-free guidance).
    #[arg(long, default_value_t = 0.1, help_heading = "Diffusion")]
    pub class_dropout: f64,
    /// Diffusion models: train from scratch: initialise the weights from --model's
    /// config.json as DiT does (adaLN-Zero; seeded by --seed) instead of reading them.
    #[arg(long, help_heading = "Diffusion")]
    pub from_scratch: bool,
    /// Chat data (cpl finetune, LLaVA): the chat template of the conversations, a built-in
    /// name (chatml, plain) or a .jinja file. Default: the model's own (chat_template.jinja or
    /// tokenizer_config.json), else plain.
    #[arg(long, help_heading = "Chat data")]
    pub template: Option<String>,
    /// Vision-language models: do not train the vision tower.
    #[arg(long, help_heading = "Vision-language")]
    pub freeze_vision_tower: bool,
    /// Vision-language models: do not train the language model (with --freeze-vision-tower:
    /// projector-only pretraining, LLaVA's stage 1).
    #[arg(long, help_heading = "Vision-language")]
    pub freeze_language_model: bool,
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

/// `--objective` of diffusion models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ObjectiveArg {
    /// DDPM noise prediction with DiT's schedule (and the variational-bound term of a learned
    /// sigma).
    Ddpm,
    /// Rectified flow (velocity noise - x0 at logit-normal s).
    Flow,
}

impl From<ObjectiveArg> for models::dit::loss::Objective {
    fn from(o: ObjectiveArg) -> Self {
        match o {
            ObjectiveArg::Ddpm => Self::Ddpm,
            ObjectiveArg::Flow => Self::Flow,
        }
    }
}

/// Turns the keys of a TOML config into command-line flags placed before the real ones.
pub fn args_with_config(raw: Vec<String>) -> Result<Vec<String>> {
    if raw.get(1).map(String::as_str) == Some("finetune") {
        return crate::finetune_cmd::expand_args(raw);
    }
    let Some(pos) = raw.iter().position(|a| a == "--config") else {
        return Ok(raw);
    };
    let Some(path) = raw.get(pos + 1) else {
        bail!("--config needs a file");
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--config {path}: cannot read"))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {path}: not valid TOML"))?;
    let mut flags = Vec::new();
    for (k, v) in table {
        let flag = format!("--{}", k.replace('_', "-"));
        if raw.contains(&flag) {
            continue;
        }
        match v {
            toml::Value::Boolean(true) => flags.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => flags.extend([flag, s]),
            toml::Value::Integer(i) => flags.extend([flag, i.to_string()]),
            toml::Value::Float(f) => flags.extend([flag, f.to_string()]),
            toml::Value::Array(a) => {
                flags.push(flag.clone());
                for x in a {
                    match x {
                        toml::Value::String(s) => flags.push(s),
                        other => flags.push(other.to_string()),
                    }
                }
            }
            other => bail!("--config {path}: key {k:?} has an unsupported value {other}"),
        }
    }
    // Insert after the subcommand name.
    let sub = raw
        .iter()
        .position(|a| a == "train")
        .map(|i| i + 1)
        .unwrap_or(1);
    let mut out = raw[..sub].to_vec();
    out.extend(flags);
    out.extend(raw[sub..].iter().cloned());
    Ok(out)
}

impl TrainArgs {
    /// The embedded default: 4 local ranks, zigzag ring attention.
    pub fn embedded_default() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: TrainArgs,
        }
        let mut a = P::parse_from(["cpl"]).a;
        a.layout.ranks = 4;
        a.layout.ring = 4;
        a
    }

    /// The training settings of the flags (checked).
    pub fn train_config(&self) -> Result<TrainConfig> {
        if self.seq_len < 2 {
            bail!("--seq-len {} must be at least 2", self.seq_len);
        }
        if self.steps == 0 {
            bail!("--steps must be at least 1");
        }
        if self.batch == 0 || self.grad_accum == 0 {
            bail!("--batch and --grad-accum must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) || self.min_lr < 0.0 || self.min_lr > self.lr {
            bail!(
                "--lr {} must be positive and --min-lr {} in [0, --lr]",
                self.lr,
                self.min_lr
            );
        }
        if self.max_grad_norm < 0.0 {
            bail!("--max-grad-norm must be >= 0");
        }
        if self.loss_chunk == 0 {
            bail!("--loss-chunk must be at least 1");
        }
        let zero = self.zero;
        if self.zero_group == Some(0) {
            bail!("--zero-group must be at least 1");
        }
        if self.zero_group.is_some() && zero == ZeroStage::Off {
            bail!("--zero-group needs --zero 1, 2 or 3");
        }
        let checkpointing = self.checkpointing;
        Ok(TrainConfig {
            seq_len: self.seq_len,
            steps: self.steps,
            batch: self.batch,
            grad_accum: self.grad_accum,
            doc_mask: self.doc_mask,
            seed: self.seed,
            shuffle: !self.no_shuffle,
            adamw: AdamWConfig {
                lr: self.lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
            },
            schedule: LrSchedule {
                peak_lr: self.lr,
                min_lr: self.min_lr,
                warmup_steps: self.warmup,
                total_steps: self.steps,
                decay: self.decay,
            },
            max_grad_norm: (self.max_grad_norm > 0.0).then_some(self.max_grad_norm),
            loss_chunk_tokens: self.loss_chunk,
            memory: MemoryPlan {
                zero,
                zero_group: self.zero_group,
                checkpointing,
            },
            pipeline: None,
        })
    }
}

/// f32 matmul rate of this machine (GFLOP/s), for the MFU estimate: a quick measurement
/// (512^3, best of 5); NaN when it fails.
pub fn matmul_gflops() -> f64 {
    crate::bench::MatmulRate { matmul_size: 512 }
        .gflops(5)
        .unwrap_or(f64::NAN)
}

pub fn run(args: &TrainArgs) -> Result<()> {
    if let Some(model) = &args.model {
        let m = crate::model_arg::resolve(model)?;
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
    }
    args.layout.check_seq_len(cfg.seq_len)?;
    let model_id = match &args.model {
        Some(m) => m.clone(),
        None => default_asset("model").display().to_string(),
    };
    let files = models::hub::resolve(&model_id)?;
    // The family of the checkpoint (the registry), its size and FLOPs, and its loader.
    let family = models::family::detect(&files.config)?;
    let load = family.load_causal_lm.with_context(|| {
        format!(
            "--model {model_id}: the {} family does not load as a causal language model",
            family.name
        )
    })?;
    let desc = (family.describe)(&files.config)?;
    let ranges = args
        .pipeline
        .configure(&mut cfg, args.layout.pp, desc.layers, &files.config)?;
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
    // Resume point.
    let resume_from = if args.resume {
        match checkpoint::list_checkpoints(&args.out).pop() {
            Some((_, dir)) => Some(dir),
            None => bail!("--resume: no checkpoint in {}", args.out.display()),
        }
    } else {
        None
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("--out {}", args.out.display()))?;
    // Files copied into every checkpoint so that it is a complete HF model directory.
    let mut extra = Vec::new();
    for p in [
        Some(&files.config),
        files.tokenizer.as_ref(),
        files.tokenizer_config.as_ref(),
        files.generation_config.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        extra.push((name, bytes));
    }
    let interrupted = interrupt_flag()?;
    let peak = matmul_gflops();
    let n_params = desc.params as f64;
    let flops_per_token = desc.flops_per_token(cfg.seq_len, models::family::Work::Training);
    let resume_state = match &resume_from {
        Some(dir) => Some(checkpoint::read_state(dir)?),
        None => None,
    };
    let state_history = resume_state
        .as_ref()
        .map(|s| s.history.clone())
        .unwrap_or_default();
    let load_files = match &resume_from {
        Some(dir) => models::hub::from_dir(&dir.display().to_string(), dir)?,
        None => files.clone(),
    };
    let metrics_path = args.out.join("metrics.jsonl");
    let eval_path = args.out.join("eval.jsonl");
    let final_history = launch_pipelined(&args.layout, |rank| {
        // The loaded parameter list is dropped here, so that under ZeRO-3 the whole tensors
        // are freed once the trainer has sharded them.
        let (layers, ends) = stage_layers(rank, &ranges);
        let spec = LoadSpec {
            ctx: &rank.ctx,
            dtype: Some(dtype),
            mode: ParamMode::Trainable,
            layers: &layers,
            ends,
            adapters: None,
        };
        let model = load(&load_files, &spec)
            .with_context(|| format!("loading {} with {}", load_files.source, args.layout.flags()))?
            .model;
        let mut trainer = Trainer::new(model, &rank.mesh, &rank.ctx, cfg.clone())?;
        if let (Some(dir), Some(state)) = (&resume_from, &resume_state) {
            checkpoint::restore(&mut trainer, dir, state)?;
        }
        let world = rank.world();
        let main = rank.is_main();
        let mut history = state_history.clone();
        // Lines of steps after the resume point (from a run that died later) are dropped.
        let mut metrics = main
            .then(|| JsonLines::continue_at(&metrics_path, trainer.step))
            .transpose()?;
        let mut evals = main
            .then(|| JsonLines::continue_at(&eval_path, trainer.step + 1))
            .transpose()?;
        if main {
            eprintln!(
                "cpl train: {} ({:.2} M params) on {} tokens, seq {} x {} sequences/step, {} steps, {} rank(s), {}",
                model_id,
                n_params / 1e6,
                data.num_tokens(),
                cfg.seq_len,
                trainer.global_batch(),
                cfg.steps,
                world.size(),
                sp.strategy.name()
            );
        }
        let start = Instant::now();
        let first = trainer.step;
        let mut progress = main.then(|| Progress::new(cfg.steps, args.log_every));
        while trainer.step < cfg.steps {
            let t0 = Instant::now();
            let stats = trainer.step(&data)?;
            let dt = t0.elapsed().as_secs_f64();
            let tps = stats.tokens as f64 / dt;
            history.steps.push(stats);
            if let Some(f) = metrics.as_mut() {
                let mut line = serde_json::json!({
                    "step": stats.step, "loss": stats.loss, "lr": stats.lr,
                    "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                    "tokens_per_sec": tps, "seconds": dt, "peak_rss_mib": peak_rss_mib(),
                });
                if let Some(b) = stats.pp_bubble {
                    line["pp_bubble"] = serde_json::json!(b);
                }
                f.write(&line)?;
            }
            if let Some(p) = progress.as_mut() {
                let done = trainer.step - first;
                let elapsed = start.elapsed().as_secs_f64();
                p.step(&StepLine {
                    step: trainer.step,
                    loss: stats.loss,
                    lr: stats.lr,
                    grad_norm: stats.grad_norm,
                    tokens_per_sec: tps,
                    mfu: tps * flops_per_token / (peak * 1e9),
                    eta_secs: elapsed / done as f64 * (cfg.steps - trainer.step) as f64,
                });
            }
            let eval_due = args.eval_every > 0 && trainer.step % args.eval_every == 0;
            if let (Some(ed), true) = (&eval_data, eval_due || trainer.step == cfg.steps) {
                let (loss, tokens) = trainer.eval_loss(ed, args.eval_windows)?;
                let point = EvalPoint {
                    step: trainer.step,
                    loss,
                    tokens,
                };
                history.evals.push(point);
                if let Some(f) = evals.as_mut() {
                    f.write(&serde_json::to_value(point)?)?;
                }
                if let Some(p) = progress.as_mut() {
                    p.message(&format!(
                        "step {}: eval loss {loss:.4} ({tokens} tokens)",
                        point.step
                    ));
                }
            }
            // Ctrl-C on any rank stops every rank after this step, with a checkpoint.
            save_or_stop(
                &trainer,
                args,
                cfg.steps,
                &world,
                &interrupted,
                &extra,
                &history,
                progress.as_mut(),
            )?;
        }
        drop(progress);
        // Peak memory: every rank's process (one process for local ranks).
        let mine = peak_rss_mib().unwrap_or(f64::NAN);
        let peaks = world
            .all_gather(&Tensor::new(&[mine], &Device::Cpu)?, 0)?
            .to_vec1::<f64>()?;
        if main && mine.is_finite() {
            if args.layout.backend != crate::layout::Backend::Local {
                let max = peaks.iter().copied().fold(f64::MIN, f64::max);
                let min = peaks.iter().copied().fold(f64::MAX, f64::min);
                eprintln!("peak memory per rank (RSS): max {max:.0} MiB, min {min:.0} MiB");
            } else {
                eprintln!(
                    "peak memory: {mine:.0} MiB (RSS of this process, {} local rank(s); ZeRO {}, \
                     checkpointing {})",
                    world.size(),
                    cfg.memory.zero,
                    cfg.memory.checkpointing
                );
            }
        }
        Ok(history)
    })?;
    let Some(history) = final_history else {
        return Ok(());
    };
    if let (Some(first), Some(last)) = (history.steps.first(), history.steps.last()) {
        eprintln!(
            "loss {:.4} -> {:.4} over {} steps; metrics in {}",
            first.loss,
            last.loss,
            history.steps.len(),
            metrics_path.display()
        );
        let png = args.out.join("loss.png");
        let model_name = std::path::Path::new(&model_id)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| model_id.clone());
        let title = format!("{model_name}: {} ({})", args.layout.flags(), sp.strategy);
        crate::plot::loss_curve(&history.steps, &history.evals, &title, &png)?;
        eprintln!("loss curve in {}", png.display());
    }
    Ok(())
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

/// Set by Ctrl-C (the handler is installed here): a training loop checks it after each step
/// with [`stop_requested`] and stops with a checkpoint. Without the handler Ctrl-C would kill
/// the run without its checkpoint: not optional.
pub fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the Ctrl-C handler (needed to save a checkpoint on Ctrl-C)")?;
    Ok(interrupted)
}

/// The end of every training step of a command: saves a checkpoint every `--save-every` steps,
/// at the last step and when Ctrl-C reached any rank (then stops with an error telling to
/// resume). Collective over `world`.
#[allow(clippy::too_many_arguments)]
pub fn save_or_stop<M: train::trainer::TrainModel>(
    trainer: &Trainer<M>,
    args: &TrainArgs,
    total_steps: u64,
    world: &candle_parallel::comm::Comm,
    interrupted: &AtomicBool,
    extra: &[(String, Vec<u8>)],
    history: &train::checkpoint::History,
    progress: Option<&mut Progress>,
) -> Result<()> {
    let stop = stop_requested(world, interrupted)?;
    let periodic = args.save_every > 0 && trainer.step.is_multiple_of(args.save_every);
    if periodic || stop || trainer.step == total_steps {
        let dir = checkpoint::save(trainer, &args.out, world, extra, history, args.keep)?;
        if let Some(p) = progress {
            p.message(&format!("saved {}", dir.display()));
        }
    }
    if stop {
        bail!(
            "interrupted (Ctrl-C) after step {}; resume with --resume",
            trainer.step
        );
    }
    Ok(())
}

/// Whether Ctrl-C reached any rank of `world` (collective over it).
pub fn stop_requested(world: &candle_parallel::comm::Comm, flag: &AtomicBool) -> Result<bool> {
    let stop = f32::from(flag.load(Ordering::SeqCst));
    Ok(world
        .all_reduce(&Tensor::new(&[stop], &Device::Cpu)?, ReduceOp::Max)?
        .to_vec1::<f32>()?[0]
        > 0.0)
}

/// A JSON-lines log (metrics, evaluations) continued by a resumed run.
pub struct JsonLines(std::fs::File);

impl JsonLines {
    /// `path` with the lines of steps before `step` kept (a later run's are dropped).
    pub fn continue_at(path: &std::path::Path, step: u64) -> Result<Self> {
        let kept: Vec<String> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s < step)
            })
            .map(String::from)
            .collect();
        let mut f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        for l in kept {
            writeln!(f, "{l}")?;
        }
        Ok(Self(f))
    }

    pub fn write(&mut self, line: &serde_json::Value) -> Result<()> {
        writeln!(self.0, "{line}")?;
        Ok(self.0.flush()?)
    }
}
