//! The flags of the commands that several modules share: `cpl train`'s ([`TrainArgs`], also
//! those of DiT and LLaVA training and `cpl finetune`), `cpl eval`'s ([`EvalArgs`]), `cpl
//! generate`'s ([`GenerateArgs`]) and the dtype flag. A leaf module: the commands depend on it,
//! it depends on no command.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::DType;
use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule, ZeroStage};
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use train::driver::RunOptions;
use train::schedule::SeqLenSchedule;
use train::trainer::TrainConfig;

use crate::layout::{Backend, DeviceArg, LayoutArgs, PipelineArgs};

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
    /// Model directory or Hugging Face Hub id to continue training: LlamaForCausalLM, Qwen2ForCausalLM (Qwen2, Qwen2.5), Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, LLaVA, diffusers DiT; the family is detected from config.json.
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
    /// A length curriculum instead of one --seq-len (text models): `LEN:STEPS` phases in
    /// order, e.g. 1024:100,4096:200 (Llama 3, EasyContext), each STEPS optimizer steps on
    /// sequences of LEN tokens; the run has the sum of the steps unless --steps says otherwise
    /// (fewer stop inside the schedule, more continue at its last length). The
    /// tokens of a step stay the first phase's (--batch x --grad-accum sequences of the first
    /// length per data-parallel rank): a phase k times longer trains k times fewer sequences
    /// (fewer per micro-batch first, then fewer micro-batches), so every length must divide
    /// those tokens. Every length is checked against the layout and the model's
    /// max_position_embeddings before the first step; evaluations use windows of the current
    /// length; checkpoints record the schedule and resume anywhere in it.
    #[arg(long, value_name = "LEN:STEPS,...", conflicts_with = "seq_len")]
    pub seq_len_schedule: Option<String>,
    /// Optimizer steps [default: 200, or the sum of --seq-len-schedule's steps].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per micro-batch on each data-parallel rank.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 4)]
    pub grad_accum: usize,
    /// Llama 3 document masking of packed documents.
    #[arg(long)]
    pub doc_mask: bool,
    /// Context extension: a new RoPE for the run (text models).
    #[command(flatten)]
    pub rope: RopeArgs,
    /// Mixture of experts: the routers' load-balancing loss coefficient (0: none); written into
    /// the run's config.json as `router_aux_loss_coef` with `output_router_logits` [default:
    /// the config's, added only when its `output_router_logits` is true].
    #[arg(long, value_name = "COEF")]
    pub router_aux_loss_coef: Option<f64>,
    /// Mixture of experts: token dropping, each expert taking at most `ceil(F x tokens x top-k /
    /// experts)` of a micro-batch's assignments, the most probable (written into the run's
    /// config.json as `moe_capacity_factor`) [default: dropless].
    #[arg(long, value_name = "F")]
    pub moe_capacity_factor: Option<f64>,
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
    /// Parameter dtype (master weights and moments are f32 regardless). Default: f32. On a CPU
    /// with AMX, bf16 products run on Intel MKL when FLASH_RING_MKL names its libmkl_rt
    /// (FLASH_RING_GEMM=native|mkl overrides; see the README); otherwise on AVX512-BF16's dot
    /// products except on Intel's CPUs, where they are widened to f32
    /// (FLASH_RING_BF16=dot|widen overrides).
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
    /// Skip up to N steps whose loss or gradient norm is not finite (their update is not
    /// applied; each is logged and written to metrics.jsonl). Without it the first such step
    /// stops the run, saving nothing over the last checkpoint.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub skip_nonfinite_steps: u64,
    /// Check every layer's output (forward) and every gradient (backward) for NaN and infinity,
    /// and stop at the first with its step, rank, micro-batch and module (e.g.
    /// model.layers.7). Costs a reduction per layer output.
    #[arg(long)]
    pub detect_anomaly: bool,
    #[command(flatten)]
    pub peak: PeakArgs,
    /// Write a Chrome/Perfetto trace of the run (one track per rank: steps, layers' forward,
    /// backward, each communication call with its bytes, optimizer, data, eval, checkpoints) to
    /// FILE; under mpirun each process writes FILE with `.rank<r>` before its extension. Read
    /// it in chrome://tracing or ui.perfetto.dev, or with `cpl trace summarize`.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// With --trace: record steps a to b-1 only (`a..b`).
    #[arg(long, value_name = "A..B", requires = "trace")]
    pub trace_steps: Option<String>,
    /// Write TensorBoard event files (loss, lr, gradient norm, tokens/s, MFU, peak memory, eval
    /// loss and every other number of metrics.jsonl; the command line as text) to DIR, or to
    /// OUT/tb without a value.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    #[allow(clippy::option_option)]
    pub tensorboard: Option<Option<PathBuf>>,
    /// Checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    pub keep: usize,
    /// Largest weight file of a checkpoint, as transformers' `max_shard_size`: bytes, or with a
    /// unit (`5GB`, `500MB`, `200KB`: powers of 10; `2GiB`, `512MiB`: powers of 2). Larger
    /// models are saved as `model-0000i-of-0000n.safetensors` with an index.
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: usize,
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
    /// Each evaluation also gives the loss by position bucket ([1, 16), [16, 32), ... doubling;
    /// causal over each held-out window) in eval.jsonl and TensorBoard, as `cpl eval
    /// --by-position` does on a checkpoint. Not with --pp.
    #[arg(long, help_heading = "Evaluation")]
    pub eval_by_position: bool,
    /// Each evaluation (--eval-every, and after the last step) also scores passkey retrieval on
    /// the grid of --passkey-lengths x --passkey-depths (--passkey-trials keys per cell,
    /// --passkey-seed), as `cpl eval --passkey` does on a checkpoint: the accuracy and answer
    /// log-likelihood of each cell in eval.jsonl (`passkey`) and TensorBoard (eval/passkey/...).
    /// Needs no held-out data; under any sequence-parallel layout, not with --pp.
    #[arg(long, help_heading = "Evaluation")]
    pub eval_passkey: bool,
    #[command(flatten)]
    pub passkey_grid: PasskeyGridArgs,
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
        let schedule = self
            .seq_len_schedule
            .as_deref()
            .map(str::parse::<SeqLenSchedule>)
            .transpose()?;
        let (seq_len, steps) = match &schedule {
            Some(s) => (s.first_len(), self.steps.unwrap_or(s.total_steps())),
            None => (self.seq_len, self.steps.unwrap_or(200)),
        };
        if steps == 0 {
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
            seq_len,
            steps,
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
                total_steps: steps,
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
            seq_len_schedule: schedule,
        })
    }
}

/// f32 matmul rate of this machine (GFLOP/s), for the MFU estimate: a quick measurement
/// (512^3, best of 5); NaN when it fails.
/// Installs the Ctrl-C handler once per process: the driver saves a checkpoint and stops.
pub fn interrupt_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    Ok(train::driver::interrupt_flag()?)
}

impl TrainArgs {
    /// Starts the trace of `--trace` (kept open by the returned guard until the run ends).
    pub fn start_trace(&self) -> Result<Option<train::driver::trace::TraceGuard>> {
        let Some(path) = &self.trace else {
            return Ok(None);
        };
        let steps = match &self.trace_steps {
            None => None,
            Some(r) => {
                let parsed = r.split_once("..").and_then(|(a, b)| {
                    Some((a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?))
                });
                match parsed {
                    Some((a, b)) if a < b => Some(a..b),
                    _ => bail!("--trace-steps {r}: expected A..B with A < B, e.g. 2..4"),
                }
            }
        };
        // One file per process under MPI (the rank from the launcher's environment).
        let rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
            .iter()
            .find_map(|k| std::env::var(k).ok());
        let path = match (rank, self.layout.backend == Backend::Mpi) {
            (Some(r), true) => {
                let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
                let ext = path
                    .extension()
                    .map(|e| format!(".{}", e.to_string_lossy()));
                path.with_file_name(format!(
                    "{}.rank{r}{}",
                    stem.unwrap_or_default(),
                    ext.unwrap_or_default()
                ))
            }
            _ => path.clone(),
        };
        let guard = train::driver::trace::start(&path, steps)
            .map_err(|e| anyhow::anyhow!("--trace {}: {e}", path.display()))?;
        Ok(Some(guard))
    }

    /// The peak that MFU is measured against in GFLOP/s, and what it is ([`PeakArgs::resolve`]
    /// on the run's device and dtype).
    pub fn mfu_peak(&self) -> Result<(f64, String)> {
        let dtype = self.dtype.map(DType::from).unwrap_or(DType::F32);
        self.peak.resolve(&self.layout.device, dtype, None)
    }

    /// The run driver's options of these flags for a run of `steps` steps, `extra_files`
    /// copied into every checkpoint, at `flops_per_token` (NaN: no MFU), printing `banner`
    /// first.
    pub fn run_options(
        &self,
        steps: u64,
        extra_files: Vec<(String, Vec<u8>)>,
        flops_per_token: f64,
        banner: String,
    ) -> Result<RunOptions> {
        let (peak_gflops, peak_source) = self.mfu_peak()?;
        Ok(RunOptions {
            out: self.out.clone(),
            steps,
            save_every: self.save_every,
            keep: self.keep,
            eval_every: self.eval_every,
            log_every: self.log_every,
            extra_files,
            max_shard_bytes: self.max_shard_size,
            flops_per_token,
            peak_gflops,
            peak_source,
            banner,
            local_ranks: self.layout.backend == Backend::Local,
            skip_nonfinite_steps: self.skip_nonfinite_steps,
            detect_anomaly: self.detect_anomaly,
            tensorboard: self
                .tensorboard
                .as_ref()
                .map(|d| d.clone().unwrap_or_else(|| self.out.join("tb"))),
        })
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json) or Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// A LoRA adapter (PEFT directory, e.g. a `cpl finetune` checkpoint) applied to --model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Text (.txt), JSON-lines (.jsonl) or Parquet (.parquet) file to evaluate on; documents
    /// are joined with EOS and cut into windows of --seq-len tokens; a shorter last window is padded
    /// (the padding not scored) to a length the layout can split, so every layout scores the same
    /// tokens.
    #[arg(long, conflicts_with = "tokens")]
    pub data: Option<PathBuf>,
    /// JSON array of token-id arrays; each is evaluated as one sequence.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Tokens per window of --data.
    #[arg(long, default_value_t = 1024)]
    pub seq_len: usize,
    /// The text field of .jsonl records and the text column of .parquet files.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Compute dtype (default: the checkpoint's).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the logits of every sequence (`logits.<i>`, (tokens, vocab) f32) to this
    /// safetensors file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Long context: the loss by token position, in buckets [1, 16), [16, 32), ... doubling up
    /// to the sequence length (a token's position is the number of tokens before it); under any
    /// sequence-parallel layout (each rank scores its own tokens).
    #[arg(long, help_heading = "Long context")]
    pub by_position: bool,
    /// With --by-position: draw the loss by position as this PNG, with the curves of earlier
    /// `cpl eval --by-position --json` outputs given by --compare.
    #[arg(long, requires = "by_position", help_heading = "Long context")]
    pub by_position_plot: Option<PathBuf>,
    /// JSON outputs of earlier `cpl eval --by-position --json` runs (e.g. before an extension) to
    /// draw beside this one in --by-position-plot.
    #[arg(long, num_args = 1.., requires = "by_position_plot", help_heading = "Long context")]
    pub compare: Vec<PathBuf>,
    /// Long context: passkey retrieval instead of the loss: a 5-digit key hidden at each depth
    /// of filler text of each length, scored by teacher-forced greedy decoding (every answer
    /// token the argmax), under any sequence-parallel layout (not --pp). Needs no --data.
    #[arg(long, conflicts_with_all = ["by_position", "logits_out"], help_heading = "Long context")]
    pub passkey: bool,
    #[command(flatten)]
    pub passkey_grid: PasskeyGridArgs,
    /// Draw the passkey accuracy as a length x depth heatmap PNG.
    #[arg(long, requires = "passkey", help_heading = "Long context")]
    pub passkey_plot: Option<PathBuf>,
    /// Vision-language models (LLaVA): image files (PNG, JPEG) that fill the image-token runs
    /// of the --tokens sequences in order (comma-separated).
    #[arg(long, value_delimiter = ',', help_heading = "Vision-language")]
    pub images: Vec<PathBuf>,
    /// Vision-language models: preprocessed images, a safetensors file with `pixel_values`
    /// (images, C, H, W), instead of --images.
    #[arg(long, help_heading = "Vision-language")]
    pub pixel_values: Option<PathBuf>,
    /// Diffusion models (DiT): a safetensors file with `sample` (B, C, H, W), `timestep` (B),
    /// `class_labels` (B) and optionally `noise` (then `sample` is the clean image, noised at
    /// `timestep`, and the DDPM loss is printed).
    #[arg(long, help_heading = "Diffusion")]
    pub inputs: Option<PathBuf>,
    /// Diffusion models: write the model output (`sample`) to this safetensors file.
    #[arg(long, help_heading = "Diffusion")]
    pub outputs_out: Option<PathBuf>,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// With --pp: the model's stages (--virtual-stages, --pp-layers); the sequences run forward
    /// through them one after the other.
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

/// A compute dtype flag.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
            DtypeArg::F16 => DType::F16,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// Model directory or Hugging Face Hub id: LlamaForCausalLM, Qwen2ForCausalLM (Qwen2, Qwen2.5), Qwen3ForCausalLM, MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, LLaVA, diffusers DiT; the family is detected from config.json.
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
    #[arg(long, value_enum, default_value_t = SamplerArg::Ddim, help_heading = "Diffusion")]
    pub sampler: SamplerArg,
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

/// The sampler of `cpl generate` on a diffusion model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SamplerArg {
    /// DDIM (eta 0) on the respaced DDPM schedule.
    Ddim,
    /// Ancestral DDPM on the respaced schedule (learned variance when the model has one).
    Ddpm,
    /// Euler steps of a rectified-flow model.
    Flow,
}

/// The passkey grid of `cpl eval --passkey` and `cpl train --eval-passkey`
/// ([`train::passkey`]).
#[derive(clap::Args, Debug, Clone)]
pub struct PasskeyGridArgs {
    /// Passkey prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [256usize, 512, 1024, 2048], help_heading = "Long context")]
    pub passkey_lengths: Vec<usize>,
    /// Passkey depths in [0, 1] (0: the key right after the start).
    #[arg(long, value_delimiter = ',', default_values_t = [0.0f64, 0.25, 0.5, 0.75, 1.0], help_heading = "Long context")]
    pub passkey_depths: Vec<f64>,
    /// Keys per (length, depth) cell.
    #[arg(long, default_value_t = 4, help_heading = "Long context")]
    pub passkey_trials: usize,
    /// Seed of the keys.
    #[arg(long, default_value_t = 0, help_heading = "Long context")]
    pub passkey_seed: u64,
}

/// `--rope-*`: a new rotary embedding for a run (context extension), written into the config the
/// run loads and every checkpoint it saves, in the form the checkpoint's `config.json` uses
/// (`models::rope_override` states the defaults).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RopeArgs {
    /// New RoPE base (`rope_theta`), e.g. 500000.
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_theta: Option<f64>,
    /// RoPE scaling type: default (none), linear, dynamic, yarn, longrope or llama3.
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_scaling: Option<String>,
    /// Scaling factor (> 1): the extension ratio.
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_factor: Option<f64>,
    /// The context the checkpoint was trained at (yarn, longrope, llama3; default: its
    /// max_position_embeddings).
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub original_max_position: Option<usize>,
    /// llama3: low frequency factor.
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_low_freq_factor: Option<f64>,
    /// llama3: high frequency factor.
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_high_freq_factor: Option<f64>,
    /// yarn: beta_fast (default 32).
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_beta_fast: Option<f64>,
    /// yarn: beta_slow (default 1).
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_beta_slow: Option<f64>,
    /// yarn, longrope: attention factor (default: the type's formula).
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub rope_attention_factor: Option<f64>,
    /// longrope: short factors, one per rotated dim pair, comma-separated.
    #[arg(long, value_delimiter = ',', help_heading = "Context extension (RoPE)")]
    pub rope_short_factor: Option<Vec<f64>>,
    /// longrope: long factors, comma-separated.
    #[arg(long, value_delimiter = ',', help_heading = "Context extension (RoPE)")]
    pub rope_long_factor: Option<Vec<f64>>,
    /// New max_position_embeddings (default with a factor: original x factor; dynamic keeps it).
    #[arg(long, help_heading = "Context extension (RoPE)")]
    pub max_position_embeddings: Option<usize>,
}

impl RopeArgs {
    /// The override these flags ask for; `None` when no flag is given. A scaling parameter
    /// without `--rope-scaling` is an error naming it.
    pub fn to_override(&self) -> Result<Option<models::rope_override::RopeOverride>> {
        use models::rope_override::{RopeOverride, RopeScalingArgs};
        let params = [
            ("--rope-factor", self.rope_factor.is_some()),
            (
                "--original-max-position",
                self.original_max_position.is_some(),
            ),
            (
                "--rope-low-freq-factor",
                self.rope_low_freq_factor.is_some(),
            ),
            (
                "--rope-high-freq-factor",
                self.rope_high_freq_factor.is_some(),
            ),
            ("--rope-beta-fast", self.rope_beta_fast.is_some()),
            ("--rope-beta-slow", self.rope_beta_slow.is_some()),
            (
                "--rope-attention-factor",
                self.rope_attention_factor.is_some(),
            ),
            ("--rope-short-factor", self.rope_short_factor.is_some()),
            ("--rope-long-factor", self.rope_long_factor.is_some()),
        ];
        let scaling = match &self.rope_scaling {
            Some(t) => Some(RopeScalingArgs {
                rope_type: t.clone(),
                factor: self.rope_factor,
                original_max_position_embeddings: self.original_max_position,
                low_freq_factor: self.rope_low_freq_factor,
                high_freq_factor: self.rope_high_freq_factor,
                beta_fast: self.rope_beta_fast,
                beta_slow: self.rope_beta_slow,
                attention_factor: self.rope_attention_factor,
                short_factor: self.rope_short_factor.clone(),
                long_factor: self.rope_long_factor.clone(),
            }),
            None => {
                if let Some((flag, _)) = params.iter().find(|(_, given)| *given) {
                    anyhow::bail!("{flag} needs --rope-scaling (the RoPE type it parameterises)");
                }
                None
            }
        };
        let o = RopeOverride {
            theta: self.rope_theta,
            scaling,
            max_position_embeddings: self.max_position_embeddings,
        };
        Ok((!o.is_empty()).then_some(o))
    }
}

/// A size in bytes with an optional unit, as transformers' `convert_file_size_to_int`: `KB`,
/// `MB`, `GB` are powers of 10, `KiB`, `MiB`, `GiB` powers of 2 (case-insensitive); at least 1.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let units: [(&str, f64); 7] = [
        ("kib", 1024.0),
        ("mib", 1024.0 * 1024.0),
        ("gib", 1024.0 * 1024.0 * 1024.0),
        ("kb", 1e3),
        ("mb", 1e6),
        ("gb", 1e9),
        ("b", 1.0),
    ];
    let (num, mult) = units
        .iter()
        .find(|(u, _)| lower.ends_with(u))
        .map(|(u, m)| (&t[..t.len() - u.len()], *m))
        .unwrap_or((t, 1.0));
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 5GB, 200MB, 2GiB or a byte count)"))?;
    let bytes = n * mult;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes <= usize::MAX as f64) {
        return Err(format!("`{s}`: a size must be at least 1 byte"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("200kb"), Ok(200_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1234"), Ok(1234));
        assert_eq!(parse_size("1.5MB"), Ok(1_500_000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("five GB").is_err());
        assert!(parse_size("-3KB").is_err());
    }
}

/// The one peak every MFU figure is measured against: the progress line, metrics.jsonl and
/// TensorBoard of `cpl train`, `finetune` and DiT/LLaVA training, and `cpl bench train|eval`.
/// (The planner predicts seconds and memory, not MFU.)
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PeakArgs {
    /// The peak (TFLOP/s) that MFU is reported against, e.g. 989 for an H100's dense bf16
    /// (default: this machine's matmul rate in the run's dtype, measured at start; the log
    /// says which).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
}

impl PeakArgs {
    /// An error naming the flag when `--peak-tflops` is not a positive number or the product's
    /// side `n` is 0: checked before a run starts.
    pub fn check(&self, n: Option<usize>) -> Result<()> {
        if let Some(t) = self.peak_tflops {
            if !(t > 0.0 && t.is_finite()) {
                bail!("--peak-tflops {t} must be a positive number");
            }
        }
        if n == Some(0) {
            bail!("--matmul-size must be at least 1");
        }
        Ok(())
    }

    /// The peak in GFLOP/s and the words that name it: `--peak-tflops`, or the rate of `dtype`
    /// products of side `n` on `device` (by default 1024 on a CPU, 4096 on a GPU), measured now.
    pub fn resolve(
        &self,
        device: &DeviceArg,
        dtype: DType,
        n: Option<usize>,
    ) -> Result<(f64, String)> {
        self.check(n)?;
        if let Some(t) = self.peak_tflops {
            return Ok((t * 1e3, format!("--peak-tflops {t}")));
        }
        let n = match (n, device) {
            (Some(n), _) => n,
            (None, DeviceArg::Cpu) => 1024,
            (None, DeviceArg::Cuda(_)) => 4096,
        };
        // Where MKL runs the products (bf16 on AMX, or FLASH_RING_GEMM=mkl), its rate is the
        // peak, and the line says so; a bad FLASH_RING_GEMM or MKL asked for and missing stops
        // the run here, named.
        let mkl = match device {
            DeviceArg::Cpu => {
                let (gemm, bf16) = (flash_ring::Gemm::Auto, dtype == DType::BF16);
                match flash_ring::cpu::mkl::route(gemm, bf16)? {
                    Some(_) => Some(flash_ring::cpu::mkl::describe(gemm, bf16)?),
                    None => None,
                }
            }
            DeviceArg::Cuda(_) => None,
        };
        // The rate of the products the run itself uses: flash-ring's (on a CPU its kernels or
        // MKL; elsewhere the device's own matmul). Candle's CPU matmul widens bf16 to f32: taken
        // as the peak, it put a bf16 run's MFU above 1 on a CPU with AVX512-BF16.
        let dev = device.open(0)?;
        let g = train::driver::progress::product_gflops(&dev, dtype, n, 5, |a, b| {
            Ok(flash_ring::matmul(a, b)?)
        })?;
        let what = format!(
            "this machine's {} matmul rate on {device} ({n}x{n} product, measured at start){}",
            format!("{dtype:?}").to_lowercase(),
            mkl.map(|on| format!("; the products run on {on}"))
                .unwrap_or_default(),
        );
        Ok((g, what))
    }
}
