//! `cpl finetune`: supervised fine-tuning (SFT) and DPO of a Hugging Face checkpoint on chat
//! data, with LoRA adapters or all weights, under every layout and memory flag of `cpl train`;
//! `cpl finetune merge` folds an adapter into its base.
//!
//! With no `--data` it runs the bundled demo: LoRA SFT of `assets/default/model` on
//! `assets/chat/dialogue.jsonl` (`--stage dpo`: `assets/chat/dialogue-dpo.jsonl`) with the
//! built-in `plain` template (the bundled model has no chat template of its own).
//!
//! Checkpoints (`OUT/step-N/`) of a LoRA run are PEFT adapter directories (`adapter_config.json`,
//! `adapter_model.safetensors`) plus the optimizer and trainer state; of a full run, Hugging Face
//! model directories as `cpl train` writes them. `--resume` continues from the last one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_parallel::attention::ShardPlan;
use candle_parallel::nn::{Adapters, LoraConfig, LoraTargets, ParamMode, TensorSource};

use models::tokenizer::Tokenizer;
use train::chat::{ChatTemplate, TrainOn};
use train::finetune::{DpoConfig, DpoTrainer, Overlong, Reference, SftOptions};
use train::finetune_data::{ChatTokenizing, FinetuneData};
use train::trainer::Trainer;

use crate::args::{default_asset, interrupt_flag, TrainArgs};
use crate::launch::{launch_pipelined, load_causal_lm_adapted, Rank};
use train::driver::tasks::{DpoTask, NextTokenTask};
use train::driver::{self, Resume};

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct FinetuneCli {
    #[command(subcommand)]
    pub command: Option<FinetuneCommand>,
    #[command(flatten)]
    pub args: Box<FinetuneArgs>,
}

#[derive(clap::Subcommand, Debug)]
pub enum FinetuneCommand {
    /// Fold a LoRA adapter into its base model (W + alpha/r · B A) and write a plain Hugging
    /// Face model directory.
    Merge(MergeArgs),
}

#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The base model (directory or Hub id).
    #[arg(long)]
    pub model: String,
    /// The adapter directory (PEFT format: adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Output directory (written atomically).
    #[arg(long)]
    pub out: PathBuf,
}

/// `--stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Stage {
    /// Supervised fine-tuning: next-token loss on the assistant tokens.
    Sft,
    /// Direct preference optimisation on chosen/rejected pairs (sigmoid loss).
    Dpo,
}

/// `--finetuning-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FinetuningType {
    /// Low-rank adapters on a frozen base.
    Lora,
    /// Every weight trains.
    Full,
}

#[derive(clap::Args, Debug, Clone)]
pub struct FinetuneArgs {
    /// SFT or DPO.
    #[arg(long, value_enum, default_value_t = Stage::Sft, help_heading = "Fine-tuning")]
    pub stage: Stage,
    /// LoRA adapters or all weights.
    #[arg(long, value_enum, default_value_t = FinetuningType::Lora, help_heading = "Fine-tuning")]
    pub finetuning_type: FinetuningType,
    /// LoRA rank r.
    #[arg(long, default_value_t = 8, help_heading = "Fine-tuning")]
    pub lora_rank: usize,
    /// LoRA alpha (scale alpha / r). Default: 2 x rank.
    #[arg(long, help_heading = "Fine-tuning")]
    pub lora_alpha: Option<f64>,
    /// LoRA dropout. Only 0 is supported (the default of PEFT and LLaMA-Factory).
    #[arg(long, default_value_t = 0.0, help_heading = "Fine-tuning")]
    pub lora_dropout: f64,
    /// Layers that get adapters: all-linear (PEFT's: on a mixture of experts also the router),
    /// or module names (q_proj,v_proj; Phi-3 has qkv_proj, o_proj, gate_up_proj, down_proj; a
    /// mixture of experts' router is `gate`). Default: every linear layer of the blocks but a
    /// mixture of experts' router, which stays frozen unless named.
    #[arg(long, help_heading = "Fine-tuning")]
    pub lora_targets: Option<String>,
    /// Parameters adapted directly (PEFT's `target_parameters`), comma-separated: a mixture of
    /// experts' stacked experts, `gate_up_proj,down_proj` (Qwen2-MoE's, which `all-linear`
    /// leaves out; Mixtral's and Qwen3-MoE's come with `all-linear` or their module names).
    #[arg(long, value_delimiter = ',', help_heading = "Fine-tuning")]
    pub lora_target_parameters: Vec<String>,
    /// rsLoRA scaling alpha / sqrt(r).
    #[arg(long, help_heading = "Fine-tuning")]
    pub use_rslora: bool,
    /// Start from this PEFT adapter (its rank, alpha and targets) instead of fresh adapters.
    #[arg(long, help_heading = "Fine-tuning")]
    pub adapter: Option<PathBuf>,
    /// Train on the prompt tokens too (system and user turns).
    #[arg(long, help_heading = "Fine-tuning")]
    pub train_on_prompt: bool,
    /// Train on the last assistant turn only.
    #[arg(long, help_heading = "Fine-tuning")]
    pub mask_history: bool,
    /// Pack several examples per --seq-len window (document masks keep them apart).
    #[arg(long, help_heading = "Fine-tuning")]
    pub packing: bool,
    /// Examples longer than --seq-len: truncate or drop.
    #[arg(long, default_value = "truncate", help_heading = "Fine-tuning")]
    pub overlong: Overlong,
    /// Use only the first N examples (pairs) of the data.
    #[arg(long, help_heading = "Fine-tuning")]
    pub max_examples: Option<usize>,
    /// Train for this many passes over the data (overrides --steps).
    #[arg(long, help_heading = "Fine-tuning")]
    pub epochs: Option<f64>,
    /// Warmup as a fraction of the steps (overrides --warmup).
    #[arg(long, help_heading = "Fine-tuning")]
    pub warmup_ratio: Option<f64>,
    /// DPO beta.
    #[arg(long, default_value_t = 0.1, help_heading = "Fine-tuning")]
    pub dpo_beta: f64,
    /// DPO reference model for full fine-tuning (default: --model). LoRA's reference is the
    /// base model (adapters off).
    #[arg(long, help_heading = "Fine-tuning")]
    pub ref_model: Option<String>,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// LLaMA-Factory config keys and the flags they mean here (`None`: accepted, no effect).
const LLAMA_FACTORY_KEYS: &[(&str, Option<&str>)] = &[
    ("model_name_or_path", Some("model")),
    ("dataset", Some("data")),
    ("eval_dataset", Some("eval-data")),
    ("cutoff_len", Some("seq-len")),
    ("learning_rate", Some("lr")),
    ("num_train_epochs", Some("epochs")),
    ("max_steps", Some("steps")),
    ("per_device_train_batch_size", Some("batch")),
    ("gradient_accumulation_steps", Some("grad-accum")),
    ("lr_scheduler_type", Some("decay")),
    ("warmup_steps", Some("warmup")),
    ("lora_target", Some("lora-targets")),
    ("pref_beta", Some("dpo-beta")),
    ("output_dir", Some("out")),
    ("save_steps", Some("save-every")),
    ("logging_steps", Some("log-every")),
    ("max_samples", Some("max-examples")),
    ("neat_packing", Some("packing")),
    ("adapter_name_or_path", Some("adapter")),
    ("ref_model", Some("ref-model")),
    ("do_train", None),
    ("overwrite_output_dir", None),
    ("overwrite_cache", None),
    ("plot_loss", None),
    ("report_to", None),
    ("preprocessing_num_workers", None),
    ("dataloader_num_workers", None),
    ("ddp_timeout", None),
    ("trust_remote_code", None),
    ("resume_from_checkpoint", None),
    ("save_only_model", None),
];

/// The flags of a `cpl finetune --config` file (YAML or TOML by extension; LLaMA-Factory's key
/// names where they mean the same, or this command's flag names with `_` or `-`).
pub fn config_flags(path: &str) -> Result<Vec<(String, Vec<String>)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--config {path}: cannot read"))?;
    let lower = path.to_ascii_lowercase();
    let table: Vec<(String, serde_json::Value)> =
        if lower.ends_with(".yaml") || lower.ends_with(".yml") {
            let v: serde_json::Value = serde_yaml::from_str(&text)
                .with_context(|| format!("--config {path}: not valid YAML"))?;
            match v {
                serde_json::Value::Object(m) => m.into_iter().collect(),
                serde_json::Value::Null => Vec::new(),
                _ => bail!("--config {path}: expected a mapping of keys to values"),
            }
        } else {
            let t: toml::Table = text
                .parse()
                .with_context(|| format!("--config {path}: not valid TOML"))?;
            let v = serde_json::to_value(t)?;
            v.as_object()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .collect()
        };
    // As in transformers: max_steps > 0 wins over num_train_epochs, warmup_steps > 0 over
    // warmup_ratio.
    let positive = |key: &str| {
        table
            .iter()
            .any(|(k, v)| k == key && v.as_f64().is_some_and(|x| x > 0.0))
    };
    let (has_max_steps, has_warmup_steps) = (positive("max_steps"), positive("warmup_steps"));
    let table: Vec<(String, serde_json::Value)> = table
        .into_iter()
        .filter(|(k, _)| {
            !(has_max_steps && k == "num_train_epochs" || has_warmup_steps && k == "warmup_ratio")
        })
        .collect();
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let scalar = |k: &str, v: &serde_json::Value| -> Result<String> {
        Ok(match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            other => bail!("--config {path}: key {k:?} has an unsupported value {other}"),
        })
    };
    for (k, v) in table {
        let err = |msg: &str| anyhow::anyhow!("--config {path}: key {k:?}: {msg}");
        match k.as_str() {
            "stage" => {
                let s = scalar(&k, &v)?;
                if s != "sft" && s != "dpo" {
                    return Err(err(&format!("stage {s:?}: only sft and dpo are supported")));
                }
                out.push(("--stage".into(), vec![s]));
                continue;
            }
            "finetuning_type" => {
                let s = scalar(&k, &v)?;
                if s != "lora" && s != "full" {
                    return Err(err(&format!("{s:?}: only lora and full are supported")));
                }
                out.push(("--finetuning-type".into(), vec![s]));
                continue;
            }
            "bf16" | "fp16" | "pure_bf16" => {
                if v.as_bool() == Some(true) {
                    let d = if k == "fp16" { "f16" } else { "bf16" };
                    out.push(("--dtype".into(), vec![d.into()]));
                }
                continue;
            }
            "lora_target" => {
                let s = match &v {
                    serde_json::Value::Array(a) => a
                        .iter()
                        .map(|x| scalar(&k, x))
                        .collect::<Result<Vec<_>>>()?
                        .join(","),
                    _ => scalar(&k, &v)?,
                };
                let s = if s == "all" { "all-linear".into() } else { s };
                out.push(("--lora-targets".into(), vec![s]));
                continue;
            }
            "sequence_parallel_size" => {
                let n = scalar(&k, &v)?;
                out.push(("--ring".into(), vec![n.clone()]));
                out.push(("--ranks".into(), vec![n]));
                continue;
            }
            "deepspeed" | "fsdp" => {
                return Err(err("use --zero 1|2|3 (ZeRO sharding is built in)"));
            }
            "resume_from_checkpoint" => {
                match &v {
                    serde_json::Value::Bool(true) => out.push(("--resume".into(), vec![])),
                    serde_json::Value::Bool(false) | serde_json::Value::Null => {}
                    _ => {
                        return Err(err(
                            "give the run's output_dir and `resume_from_checkpoint: true` (it \
                             resumes from the last checkpoint there)",
                        ))
                    }
                }
                continue;
            }
            "template" => {
                // LLaMA-Factory's template names (llama3, qwen, ...) name its own Python
                // templates: the model's own chat template stands in for them.
                let t = scalar(&k, &v)?;
                if train::chat::BUILTIN_TEMPLATES.contains(&t.as_str()) || Path::new(&t).is_file() {
                    out.push(("--template".into(), vec![t]));
                } else {
                    eprintln!(
                        "--config {path}: template {t:?} is not a built-in template or a file: \
                         using the model's own chat template"
                    );
                }
                continue;
            }
            _ => {}
        }
        let flag = match LLAMA_FACTORY_KEYS.iter().find(|(name, _)| *name == k) {
            Some((_, Some(f))) => f.to_string(),
            Some((_, None)) => continue,
            None => k.replace('_', "-"),
        };
        let flag = format!("--{flag}");
        match v {
            serde_json::Value::Bool(true) => out.push((flag, vec![])),
            serde_json::Value::Bool(false) | serde_json::Value::Null => {}
            serde_json::Value::Array(a) => {
                let vals = a.iter().map(|x| scalar(&k, x)).collect::<Result<_>>()?;
                out.push((flag, vals));
            }
            serde_json::Value::String(s) if flag == "--data" || flag == "--eval-data" => {
                out.push((flag, s.split(',').map(|x| x.trim().to_string()).collect()));
            }
            other => out.push((flag, vec![scalar(&k, &other)?])),
        }
    }
    // One value per flag: the last key that sets it (e.g. `bf16` and `pure_bf16`).
    let mut dedup: Vec<(String, Vec<String>)> = Vec::new();
    for (f, v) in out {
        dedup.retain(|(g, _)| *g != f);
        dedup.push((f, v));
    }
    Ok(dedup)
}

/// Whether `flag` (`--lr`) is on the command line `raw`, as `--lr X` or `--lr=X`.
pub fn has_flag(raw: &[String], flag: &str) -> bool {
    raw.iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// Defaults of `cpl finetune` where they differ from `cpl train`'s (fine-tuning's usual values,
/// as in transformers and LLaMA-Factory): applied when the flag is not given.
pub const FINETUNE_DEFAULTS: &[(&str, &str)] = &[
    ("--lr", "1e-4"),
    ("--min-lr", "0"),
    ("--warmup", "0"),
    ("--beta2", "0.999"),
    ("--weight-decay", "0"),
];

/// The command line of `cpl finetune` with its `--config` file's flags (flags given on the
/// line win) and [`FINETUNE_DEFAULTS`]. `raw[1]` is `finetune`.
pub fn expand_args(raw: Vec<String>) -> Result<Vec<String>> {
    if raw.get(2).map(String::as_str) == Some("merge") {
        return Ok(raw);
    }
    let mut out = raw[..2].to_vec();
    let mut rest: Vec<String> = raw[2..].to_vec();
    if let Some(pos) = rest.iter().position(|a| a == "--config") {
        let Some(path) = rest.get(pos + 1).cloned() else {
            bail!("--config needs a file");
        };
        rest.drain(pos..pos + 2);
        for (flag, values) in config_flags(&path)? {
            if !has_flag(&rest, &flag) {
                out.push(flag);
                out.extend(values);
            }
        }
    }
    out.extend(rest);
    for (flag, value) in FINETUNE_DEFAULTS {
        if !has_flag(&out, flag) {
            out.extend([flag.to_string(), value.to_string()]);
        }
    }
    Ok(out)
}

pub fn run(cli: &FinetuneCli) -> Result<()> {
    match &cli.command {
        Some(FinetuneCommand::Merge(m)) => merge(m),
        None => finetune(&cli.args),
    }
}

fn merge(a: &MergeArgs) -> Result<()> {
    let files = models::hub::resolve(&a.model)?;
    let adapter = models::peft::load(&a.adapter)
        .with_context(|| format!("--adapter {}", a.adapter.display()))?;
    let merged = models::peft::merge(&files, &adapter, &a.out)
        .with_context(|| format!("merging {} into {}", a.adapter.display(), a.model))?;
    eprintln!(
        "merged {} adapted weights (scale {}) into {}",
        merged.len(),
        adapter.lora.scale(),
        a.out.display()
    );
    Ok(())
}

/// The tokenized data of a run.
/// The LoRA settings of the flags, or of `--adapter` (whose tensors it returns too).
fn lora_settings(a: &FinetuneArgs) -> Result<(LoraConfig, Option<Arc<dyn TensorSource>>)> {
    if a.lora_dropout != 0.0 {
        bail!(
            "--lora-dropout {}: only 0 is supported (LoRA dropout would need a mask that every \
             layout and every recomputation draws alike)",
            a.lora_dropout
        );
    }
    if let Some(dir) = &a.adapter {
        let ad = models::peft::load(dir).with_context(|| format!("--adapter {}", dir.display()))?;
        eprintln!(
            "--adapter {}: its settings (r {}, alpha {}) replace --lora-rank, --lora-alpha and \
             --lora-targets",
            dir.display(),
            ad.lora.rank,
            ad.lora.alpha
        );
        let mut cfg = ad.lora;
        cfg.seed = a.train.seed;
        return Ok((cfg, Some(ad.source as Arc<dyn TensorSource>)));
    }
    let cfg = LoraConfig {
        rank: a.lora_rank,
        alpha: a.lora_alpha.unwrap_or(2.0 * a.lora_rank as f64),
        targets: LoraTargets::parse(a.lora_targets.as_deref().unwrap_or("all-linear"))
            .context("--lora-targets")?,
        use_rslora: a.use_rslora,
        seed: a.train.seed,
        target_parameters: a.lora_target_parameters.clone(),
        rank_pattern: Default::default(),
        alpha_pattern: Default::default(),
    };
    cfg.validate().context("--lora-rank / --lora-alpha")?;
    Ok((cfg, None))
}

fn finetune(a: &FinetuneArgs) -> Result<()> {
    let t = &a.train;
    if t.eval_tokens.is_some() || t.tokens.is_some() {
        bail!("--tokens / --eval-tokens: cpl finetune reads chat data (--data, --eval-data)");
    }
    if t.rope.to_override()?.is_some() {
        // A LoRA adapter would not carry the base model's new RoPE, so its users would load it
        // onto the old one.
        bail!(
            "--rope-*: cpl finetune does not change the RoPE yet; extend the context with cpl \
             train --rope-*, then fine-tune its checkpoint"
        );
    }
    if t.eval_by_position || t.eval_passkey {
        bail!(
            "--eval-by-position / --eval-passkey: cpl finetune evaluates chat data by example; \
             use cpl train"
        );
    }
    if t.seq_len_schedule.is_some() {
        bail!(
            "--seq-len-schedule: cpl finetune trains on examples of their own lengths; a length \
             curriculum is cpl train's"
        );
    }
    if t.from_scratch || t.freeze_vision_tower || t.freeze_language_model {
        bail!(
            "--from-scratch / --freeze-vision-tower / --freeze-language-model: cpl finetune \
             fine-tunes text LLaMA models (LoRA or full); vision-language models train with cpl train"
        );
    }
    // Fine-tuning rates are often below `cpl train`'s default --min-lr.
    let mut t_args = t.clone();
    if t_args.min_lr > t_args.lr {
        t_args.min_lr = 0.1 * t_args.lr;
        eprintln!(
            "--min-lr {} is above --lr {}: decaying to {} instead",
            t.min_lr, t.lr, t_args.min_lr
        );
    }
    let mut cfg = t_args.train_config()?;
    cfg.doc_mask = true;
    let sp = t.layout.sp_config()?;
    ShardPlan::new(cfg.seq_len, sp.layout, sp.ring, sp.ulysses).with_context(|| {
        format!(
            "--seq-len {} cannot be split by --ring {} --ulysses {} --ring-layout {}",
            cfg.seq_len, sp.ring, sp.ulysses, sp.layout
        )
    })?;
    let demo = t.data.is_empty();
    let model_id = match &t.model {
        Some(m) => m.clone(),
        None => default_asset("model").display().to_string(),
    };
    let files = models::hub::resolve(&model_id)?;
    let family = models::family::detect(&files.config)?;
    if family.kind != models::Kind::CausalLm {
        bail!(
            "{}: cpl finetune takes a causal language model; {} is a {} family",
            files.config.display(),
            family.name,
            match family.kind {
                models::Kind::Diffusion => "diffusion",
                _ => "vision-language",
            }
        );
    }
    let model_desc = (family.describe)(&files.config)?;
    // LoRA's base weights get no gradients.
    let work = match a.finetuning_type {
        FinetuningType::Lora => models::family::Work::FrozenTraining,
        FinetuningType::Full => models::family::Work::Training,
    };
    let costs = model_desc.stage_costs(cfg.seq_len, work);
    let ranges = t
        .pipeline
        .configure(&mut cfg, t.layout.pp, &costs, &files.config)?;
    let tok = Tokenizer::from_model(&files)?;
    // The bundled model has no chat template of its own.
    let template = match (&t.template, t.model.is_none()) {
        (None, true) => Some("plain".to_string()),
        (spec, _) => spec.clone(),
    };
    let tpl = ChatTemplate::resolve(template.as_deref(), &files, &tok, "--template").with_context(
        || match &template {
            Some(spec) => format!("--template {spec}"),
            None => "the chat template".into(),
        },
    )?;
    let data_paths = if demo {
        let f = match a.stage {
            Stage::Sft => "dialogue.jsonl",
            Stage::Dpo => "dialogue-dpo.jsonl",
        };
        vec![default_asset("../chat").join(f)]
    } else {
        t.data.clone()
    };
    let opts = SftOptions {
        seq_len: cfg.seq_len,
        packing: a.packing,
        overlong: a.overlong,
        pad_id: tok.eos_token_id.unwrap_or(0),
    };
    if a.packing && a.stage == Stage::Dpo {
        bail!("--packing: DPO keeps each reply in its own sequence; drop --packing");
    }
    let train_on = TrainOn {
        prompt: a.train_on_prompt,
        mask_history: a.mask_history,
    };
    let how = ChatTokenizing {
        template: &tpl,
        tokenizer: &tok,
        train_on,
        max_examples: a.max_examples,
        opts: &opts,
        vocab: model_desc.vocab,
    };
    let dpo = a.stage == Stage::Dpo;
    let (data, stats) = FinetuneData::read(&data_paths, "--data", dpo, &how)?;
    if !t.eval_data.is_empty() && dpo {
        bail!("--eval-data: held-out evaluation is for --stage sft (DPO reports rewards and accuracy per step)");
    }
    let how = ChatTokenizing {
        max_examples: None,
        ..how
    };
    let eval_data = match t.eval_data.is_empty() {
        true => None,
        false => match FinetuneData::read(&t.eval_data, "--eval-data", false, &how)?.0 {
            FinetuneData::Sft(d) => Some(d),
            FinetuneData::Dpo(_) => None,
        },
    };
    eprintln!(
        "data: {} examples -> {} {} ({} truncated, {} dropped; {} trained tokens, {} padding tokens); template {}",
        stats.examples,
        stats.windows,
        if a.stage == Stage::Dpo { "pairs" } else { "sequences" },
        stats.truncated,
        stats.dropped,
        stats.trained_tokens,
        stats.padding_tokens,
        tpl.name()
    );
    // Epochs: steps to see every window (pair) `epochs` times.
    let global = t.layout.dp_degree()? * cfg.batch * cfg.grad_accum;
    if let Some(e) = a.epochs {
        if !(e > 0.0 && e.is_finite()) {
            bail!("--epochs {e} must be positive");
        }
        cfg.steps = ((e * data.len() as f64) / global as f64).ceil().max(1.0) as u64;
        cfg.schedule.total_steps = cfg.steps;
    }
    if let Some(r) = a.warmup_ratio {
        if !(0.0..1.0).contains(&r) {
            bail!("--warmup-ratio {r} must be in [0, 1)");
        }
        cfg.schedule.warmup_steps = (r * cfg.steps as f64).ceil() as u64;
    }
    let lora = match a.finetuning_type {
        FinetuningType::Lora => {
            // Where PEFT puts the adapters of this model (a mixture of experts' router and
            // experts are targeted as parameters under transformers 5).
            let (c, src) = lora_settings(a)?;
            let c = models::peft::for_model(&c, &files.config).context(if a.adapter.is_some() {
                "--adapter"
            } else {
                "--lora-targets"
            })?;
            // Unless asked for (`all-linear` or `gate` named, or its parameter given), the
            // router stays frozen.
            let fresh_default = a.adapter.is_none()
                && a.lora_targets.is_none()
                && !a
                    .lora_target_parameters
                    .iter()
                    .any(|p| p == models::peft::ROUTER_PARAMETER);
            let c = if fresh_default {
                models::peft::without_router(&c)
            } else {
                c
            };
            Some((c, src))
        }
        FinetuningType::Full => {
            if a.adapter.is_some() {
                bail!("--adapter needs --finetuning-type lora");
            }
            None
        }
    };
    let resume = Resume::find(t.resume, &t.out)?;
    let resume_from = resume.as_ref().map(|r| &r.dir);
    // Under LoRA a checkpoint holds the adapters; otherwise the whole model.
    let (mut load_files, lora) = match (resume_from, lora) {
        (Some(dir), Some((cfg, _))) => {
            // The checkpoint's adapters and their configuration (rank, alpha, targets).
            let ad = models::peft::load(dir)
                .with_context(|| format!("--resume from {}", dir.display()))?;
            let mut saved = ad.lora;
            saved.seed = cfg.seed;
            if saved != cfg {
                eprintln!(
                    "--resume: continuing with the checkpoint's LoRA settings (r {}, alpha {}, {:?})",
                    saved.rank, saved.alpha, saved.targets
                );
            }
            (
                files.clone(),
                Some((saved, Some(ad.source as Arc<dyn TensorSource>))),
            )
        }
        (Some(dir), None) => (
            models::hub::from_dir(&dir.display().to_string(), dir)?,
            None,
        ),
        (None, l) => (files.clone(), l),
    };
    let ref_files = match (&a.ref_model, a.stage, &lora) {
        (Some(_), _, Some(_)) => {
            bail!("--ref-model: LoRA's reference is its base model; drop --ref-model")
        }
        (Some(r), Stage::Dpo, None) => Some(models::hub::resolve(r)?),
        (None, Stage::Dpo, None) => Some(files.clone()),
        (Some(_), Stage::Sft, None) => bail!("--ref-model is for --stage dpo"),
        _ => None,
    };
    std::fs::create_dir_all(&t.out).with_context(|| format!("--out {}", t.out.display()))?;
    let mut extra =
        train::finetune_data::checkpoint_files(&files, lora.as_ref().map(|l| &l.0), &model_id)?;
    // --router-aux-loss-coef (LLaMA-Factory's `moe_aux_loss_coef`) and --moe-capacity-factor:
    // the training run's routing. A full fine-tune's checkpoints carry them in their
    // config.json; a LoRA checkpoint carries the run's config as run-config.json (its adapter
    // loads onto the base model's config, so an adapter's users route as that config says).
    // Resuming checks either against the flags.
    let changes = crate::model_arg::train_config_changes(
        &Default::default(),
        t.router_aux_loss_coef,
        t.moe_capacity_factor,
    )?;
    let saved_config = if lora.is_some() {
        crate::model_arg::RUN_CONFIG
    } else {
        "config.json"
    };
    let resumed_config = resume_from.map(|d| d.join(saved_config));
    if lora.is_some() && !changes.is_empty() {
        extra.push((crate::model_arg::RUN_CONFIG.to_string(), Vec::new()));
    }
    if let (Some(saved), Some(_), true) = (&resumed_config, &lora, changes.is_empty()) {
        if saved.exists() {
            bail!(
                "--resume: the checkpoint was saved with --router-aux-loss-coef or \
                 --moe-capacity-factor ({}); resume with the flags of the run that saved it",
                saved.display()
            );
        }
    }
    crate::model_arg::apply_config_changes(
        &mut load_files,
        &changes,
        &t.out,
        &mut extra,
        resumed_config.as_deref(),
    )?;
    if let (Some(f), Some(_)) = (t.moe_capacity_factor, &lora) {
        eprintln!(
            "--moe-capacity-factor {f}: this run drops tokens; its adapters load onto the base \
             model's config ({}), which routes as it says (dropless without \
             moe_capacity_factor)",
            files.config.display()
        );
    }
    // Full DPO's reference is a frozen copy of the policy's base: it routes as the policy does.
    let ref_files = match (ref_files, &a.ref_model) {
        (Some(mut r), None) => {
            r.config = load_files.config.clone();
            Some(r)
        }
        (r, _) => r,
    };
    let dtype = t.dtype.map(DType::from).unwrap_or(DType::F32);
    let interrupted = interrupt_flag()?;
    // Model FLOPs per token for the MFU estimate.
    let flops_per_token = model_desc.flops_per_token(cfg.seq_len, work);
    // Tokens a step processes: its sequences' (both sides of every DPO pair).
    let sequences = if a.stage == Stage::Dpo { 2 } else { 1 };
    let processed_tokens = (global * cfg.seq_len * sequences) as f64;
    let banner = format!(
        "cpl finetune: {} {} of {} ({}), seq {} x {} {}/step, {} steps, {} rank(s), {}",
        match a.finetuning_type {
            FinetuningType::Lora => "LoRA",
            FinetuningType::Full => "full",
        },
        match a.stage {
            Stage::Sft => "SFT",
            Stage::Dpo => "DPO",
        },
        model_id,
        lora.as_ref()
            .map(|(c, _)| {
                let params = if c.target_parameters.is_empty() {
                    String::new()
                } else {
                    format!(" + parameters {:?}", c.target_parameters)
                };
                format!("r {} alpha {} {:?}{params}", c.rank, c.alpha, c.targets)
            })
            .unwrap_or_else(|| "all weights".into()),
        cfg.seq_len,
        global,
        if a.stage == Stage::Dpo {
            "pairs"
        } else {
            "sequences"
        },
        cfg.steps,
        t.layout.ranks,
        sp.strategy.name()
    );
    let opts = t.run_options(cfg.steps, extra, flops_per_token, banner)?;
    let _trace = t.start_trace()?;
    let history0 = Resume::history(resume.as_ref());
    let result = launch_pipelined(&t.layout, |rank: &Rank| {
        let adapters = match &lora {
            Some((c, src)) => Some(Adapters::new(c.clone(), src.clone())?),
            None => None,
        };
        let m = load_causal_lm_adapted(
            &load_files,
            rank,
            &ranges,
            Some(dtype),
            ParamMode::Trainable,
            &t.layout,
            adapters.clone(),
        )?;
        let mut trainer = Trainer::new(m.model, &rank.mesh, &rank.ctx, cfg.clone())?;
        drop(m.params);
        if let Some(r) = &resume {
            r.restore(&mut trainer)?;
        }
        let world = rank.world();
        let history = match (a.stage, &data) {
            (Stage::Sft, FinetuneData::Sft(windows)) => {
                let mut task = NextTokenTask {
                    trainer,
                    data: windows,
                    eval: eval_data.as_ref().map(|d| (d, t.eval_windows)),
                    count_key: "trained_tokens",
                    processed_tokens: Some(processed_tokens),
                    by_position: None,
                    passkey: None,
                };
                driver::run(&mut task, &world, &opts, history0.clone(), &interrupted)?
            }
            (Stage::Dpo, FinetuneData::Dpo(pairs)) => {
                let reference = match (&adapters, &ref_files) {
                    (Some(ad), _) => Reference::BaseOfAdapters(ad.clone()),
                    (None, Some(rf)) => {
                        let r = load_causal_lm_adapted(
                            rf,
                            rank,
                            &ranges,
                            Some(dtype),
                            ParamMode::Frozen,
                            &t.layout,
                            None,
                        )
                        .with_context(|| format!("loading the reference {}", rf.source))?;
                        Reference::Model(r.model)
                    }
                    (None, None) => bail!("internal: DPO without a reference"),
                };
                let mut task = DpoTask {
                    trainer: DpoTrainer::new(trainer, reference, DpoConfig { beta: a.dpo_beta })?,
                    data: pairs,
                    processed_tokens,
                };
                driver::run(&mut task, &world, &opts, history0.clone(), &interrupted)?
            }
            _ => bail!("internal: stage and data disagree"),
        };
        Ok(history)
    })?;
    if let Some(history) = result {
        let title = format!("cpl finetune {model_id}: {}", t.layout.flags());
        driver::finish(&history, &opts, &title)?;
    }
    Ok(())
}
