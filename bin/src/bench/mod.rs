//! `cpl bench`: what this machine does with candle-parallel: the attention kernel, the local
//! communicator's bandwidth, training and evaluation throughput of a causal LM of any family,
//! dense products.
//!
//! Every subcommand prints a table, or with `--json` one JSON object that also describes the
//! machine (CPU, ISA flags, threads, cpl version). The comparisons with PyTorch and
//! transformers stay in `scripts/` (they read these objects).

mod attention;
mod calibrate;
mod comm;
mod eval;
mod matmul;
mod train;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_parallel::nn::{ParamMode, TensorMap};
use models::family::{Description, LoadedCausalLm};
use models::hub::ModelFiles;
use models::llama::{self, LlamaConfig};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::args::{DtypeArg, PeakArgs};
use crate::launch::{load_causal_lm, Rank};
use crate::layout::LayoutArgs;

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// flash-ring attention forward and forward+backward against naive candle attention (and
    /// PyTorch's SDPA with --torch), with this machine's matmul rate.
    Attention(attention::AttentionArgs),
    /// Bandwidth of the collectives of local ranks (NCCL-tests conventions: algbw, busbw)
    /// next to this machine's memcpy bandwidth.
    Comm(comm::CommArgs),
    /// Training tokens/s of a causal LM of any family (default: a random 4-layer, hidden-512
    /// LLaMA built in memory), peak memory and model FLOPs utilisation, under any layout.
    Train(train::TrainBenchArgs),
    /// Forward tokens/s of a causal LM of any family as `cpl eval` measures it, under any
    /// layout.
    Eval(eval::EvalBenchArgs),
    /// flash-ring's dense product against candle's matmul on the products of the LLaMA
    /// layers, with each one's error against float64.
    Matmul(matmul::MatmulArgs),
    /// Measure this machine (matmul and attention rates, memory bandwidth, local collectives,
    /// memory) and write the hardware description of `cpl plan --auto --hardware FILE`.
    #[command(long_flag = "calibrate")]
    Calibrate(calibrate::CalibrateArgs),
}

pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Attention(a) => attention::run(a),
        BenchCommand::Comm(a) => comm::run(a),
        BenchCommand::Train(a) => train::run(a),
        BenchCommand::Eval(a) => eval::run(a),
        BenchCommand::Matmul(a) => matmul::run(a),
        BenchCommand::Calibrate(a) => calibrate::run(a),
    }
}

/// The machine a benchmark ran on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    /// `model name` of /proc/cpuinfo.
    pub cpu: String,
    /// The ISA extensions that decide the kernels' speed.
    pub avx2: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512_bf16: bool,
    /// Any AMX tile unit (amx_tile).
    pub amx: bool,
    /// The kernels flash-ring runs here.
    pub flash_ring_isa: String,
    /// Threads of candle's CPU pool (RAYON_NUM_THREADS or the logical CPUs).
    pub threads: usize,
    pub cpl_version: String,
}

impl Machine {
    pub fn detect() -> Self {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let flags = field("flags").unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        Self {
            cpu: field("model name").unwrap_or_else(|| "unknown".into()),
            avx2: has("avx2"),
            fma: has("fma"),
            avx512f: has("avx512f"),
            avx512_bf16: has("avx512_bf16"),
            amx: has("amx_tile"),
            flash_ring_isa: format!("{:?}", flash_ring::cpu::detect()),
            threads: candle_core::utils::get_num_threads(),
            cpl_version: env!("CARGO_PKG_VERSION").into(),
        }
    }

    /// One line for the top of a table.
    pub fn line(&self) -> String {
        let isa: Vec<&str> = [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("avx512f", self.avx512f),
            ("avx512_bf16", self.avx512_bf16),
            ("amx", self.amx),
        ]
        .into_iter()
        .filter_map(|(n, on)| on.then_some(n))
        .collect();
        format!(
            "machine: {}; {} threads; {}; flash-ring kernels {}; cpl {}",
            self.cpu,
            self.threads,
            if isa.is_empty() {
                "no x86 SIMD flags".to_string()
            } else {
                isa.join(" ")
            },
            self.flash_ring_isa,
            self.cpl_version
        )
    }
}

/// Prints benchmark `name`'s JSON object, one line: the fields of `body` and the machine.
pub fn print_report(name: &str, body: Value) -> Result<()> {
    let mut doc = json!({ "bench": name, "machine": Machine::detect() });
    if let (Some(d), Value::Object(b)) = (doc.as_object_mut(), body) {
        d.extend(b);
    }
    println!("{}", serde_json::to_string(&doc)?);
    Ok(())
}

/// An error naming `flag` when `value` is 0.
pub fn at_least_one(flag: &str, value: usize) -> Result<()> {
    if value == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(())
}

/// Best wall time in seconds of `repeats` runs of `f`, after one warm-up run.
pub fn best_of(repeats: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    best_of_on(&Device::Cpu, repeats, f)
}

/// [`best_of`] of work queued on `device`: every run (the warm-up too) ends by waiting for the
/// device, so each timing starts on an idle device and ends when its kernels have finished (a
/// no-op on the CPU).
pub fn best_of_on(
    device: &Device,
    repeats: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let mut f = || -> Result<()> {
        f()?;
        device.synchronize()?;
        Ok(())
    };
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The smallest and the median of `xs` (NaN when empty).
pub fn min_and_median(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    match xs.first() {
        Some(&min) => (min, xs[xs.len() / 2]),
        None => (f64::NAN, f64::NAN),
    }
}

/// How the machine's f32 matmul rate is measured (the reference of GFLOP/s and MFU figures).
#[derive(clap::Args, Debug, Clone)]
pub struct MatmulRate {
    /// Side n of the square f32 product (candle's matmul) that measures this machine's rate.
    #[arg(long, default_value_t = 2048)]
    pub matmul_size: usize,
}

impl MatmulRate {
    /// The rate in GFLOP/s: best of `repeats` products after a warm-up.
    pub fn gflops(&self, repeats: usize) -> Result<f64> {
        self.gflops_on(&Device::Cpu, DType::F32, repeats)
    }

    /// The rate in GFLOP/s of `dtype` products on `device`, synchronised around each.
    pub fn gflops_on(&self, device: &Device, dtype: DType, repeats: usize) -> Result<f64> {
        at_least_one("--matmul-size", self.matmul_size)?;
        Ok(::train::driver::progress::matmul_gflops(
            device,
            dtype,
            self.matmul_size,
            repeats,
        )?)
    }
}

pub use models::family::Work;

/// `n` token ids below `vocab` from a generator seeded by `seed`.
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// What `cpl bench train` and `cpl bench eval` share: the model, the sequence, the dtype, the
/// layout.
#[derive(clap::Args, Debug, Clone)]
pub struct LmBenchArgs {
    /// Model directory or Hugging Face Hub id of a causal LM of any family of the registry
    /// (`cpl inspect` lists them; default: a random-weight LLaMA of the shape of the random
    /// model flags, built in memory).
    #[arg(long, conflicts_with = "RandomModel")]
    pub model: Option<String>,
    /// Seed of the random weights and of the random tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 4096)]
    pub seq_len: usize,
    /// Compute dtype (training: the parameters'; master weights and moments are f32).
    /// Default: the checkpoint's, f32 for the random model.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Side n of the square product that measures this machine's matmul rate, MFU's peak
    /// (default: as `cpl train` measures it, 1024 on a CPU, 4096 on a GPU).
    #[arg(long)]
    pub matmul_size: Option<usize>,
    #[command(flatten)]
    pub peak: PeakArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Last: its help heading would also cover the flags after it.
    #[command(flatten, next_help_heading = "Random model")]
    pub random: RandomModel,
}

impl LmBenchArgs {
    /// Errors naming the flags when the sequence length or the layout is not one a benchmark
    /// runs: checked before any model is built.
    pub fn check(&self) -> Result<()> {
        if self.seq_len < 2 {
            bail!("--seq-len {} must be at least 2", self.seq_len);
        }
        if self.layout.pp > 1 {
            bail!(
                "--pp {}: cpl bench runs no pipeline (pipeline parallelism is in `cpl train`)",
                self.layout.pp
            );
        }
        self.peak.check(self.matmul_size)?;
        self.layout.mesh_config()?;
        self.layout.check_seq_len(self.seq_len)
    }

    /// The model of --model (its family from the registry), or the random model.
    pub fn resolve(&self) -> Result<BenchModel> {
        if let Some(m) = &self.model {
            let family = crate::model_arg::resolve(m)?.family;
            if family.load_causal_lm.is_none() {
                bail!(
                    "--model {m}: the {} family does not load as a causal language model \
                     (cpl bench train and eval measure causal LMs)",
                    family.name
                );
            }
            let files = models::hub::resolve(m).with_context(|| format!("--model {m}"))?;
            let desc = (family.describe)(&files.config).with_context(|| format!("--model {m}"))?;
            return Ok(BenchModel {
                name: m.clone(),
                family: family.name,
                desc,
                weights: Weights::Files(files),
            });
        }
        let r = &self.random;
        let flags = format!(
            "--layers {} --hidden {} --heads {} --kv-heads {} --intermediate {} --vocab {}",
            r.layers,
            r.hidden,
            r.heads,
            r.kv_heads.unwrap_or(r.heads),
            r.intermediate,
            r.vocab
        );
        let text = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": r.hidden, "intermediate_size": r.intermediate,
            "num_hidden_layers": r.layers, "num_attention_heads": r.heads,
            "num_key_value_heads": r.kv_heads.unwrap_or(r.heads),
            "vocab_size": r.vocab, "max_position_embeddings": 1 << 20,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        })
        .to_string();
        let config = LlamaConfig::from_json(&text, Path::new("random model"))
            .with_context(|| format!("the random model of {flags}"))?;
        let weights = llama::random_weights(&config, self.seed)?;
        Ok(BenchModel {
            name: "random".into(),
            family: models::family::LLAMA.name,
            desc: config.description()?,
            weights: Weights::Memory(
                Box::new(config),
                Arc::new(TensorMap::new(
                    weights.into_iter().collect(),
                    "random model",
                )),
            ),
        })
    }

    /// Prints benchmark `name`'s JSON object: the model, the run, `rate` and the fields of
    /// `extra`.
    pub fn print_json(
        &self,
        name: &str,
        model: &BenchModel,
        dtype: DType,
        rate: &Throughput,
        extra: Value,
    ) -> Result<()> {
        let mut body = json!({
            "model": model.json(), "family": model.family, "dtype": dtype.as_str(),
            "seq_len": self.seq_len, "layout": self.layout.flags(),
        });
        if let (Some(b), Value::Object(r), Value::Object(e)) =
            (body.as_object_mut(), serde_json::to_value(rate)?, extra)
        {
            b.extend(r);
            b.extend(e);
        }
        print_report(name, body)
    }

    /// MFU's peak in GFLOP/s and the words that name it, for parameters of `dtype`: the same
    /// as `cpl train`'s ([`PeakArgs::resolve`]).
    pub fn peak(&self, dtype: DType) -> Result<(f64, String)> {
        self.peak
            .resolve(&self.layout.device, dtype, self.matmul_size)
    }

    /// Prints the machine, the model, the run's `title` and the table of `rate`.
    pub fn print_table(&self, model: &BenchModel, title: &str, rate: &Throughput) {
        println!("{}", Machine::detect().line());
        println!("model: {}", model.describe());
        println!("{title}, {}", self.layout.flags());
        println!(
            "MFU against {:.1} GFLOP/s: {}",
            rate.peak_gflops, rate.peak_source
        );
        println!("| tokens/s best | tokens/s median | MFU best | MFU median |");
        println!("|---|---|---|---|");
        println!(
            "| {:.0} | {:.0} | {:.1}% | {:.1}% |",
            rate.tokens_per_sec_best,
            rate.tokens_per_sec_median,
            100.0 * rate.mfu_best,
            100.0 * rate.mfu_median
        );
    }
}

/// Tokens/s of timed runs, and what they are of MFU's peak.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Throughput {
    pub tokens_per_sec_best: f64,
    pub tokens_per_sec_median: f64,
    /// The peak MFU is measured against (GFLOP/s), and what it is (as `cpl train` logs it).
    pub peak_gflops: f64,
    pub peak_source: String,
    pub flops_per_token: f64,
    /// Model FLOPs utilisation: FLOPs per token x tokens/s over the peak.
    pub mfu_best: f64,
    pub mfu_median: f64,
}

impl Throughput {
    /// From the `seconds` of timed runs of `tokens` tokens each, at `flops_per_token`, against
    /// `peak` (GFLOP/s, and its words).
    pub fn new(seconds: &[f64], tokens: f64, flops_per_token: f64, peak: (f64, String)) -> Self {
        let (fastest, median) = min_and_median(seconds.to_vec());
        let (best, median) = (tokens / fastest, tokens / median);
        let (gflops, source) = peak;
        let mfu = |tps: f64| tps * flops_per_token / (gflops * 1e9);
        Self {
            tokens_per_sec_best: best,
            tokens_per_sec_median: median,
            peak_gflops: gflops,
            peak_source: source,
            flops_per_token,
            mfu_best: mfu(best),
            mfu_median: mfu(median),
        }
    }
}

/// The shape of the random model of `cpl bench train|eval` (none of it goes with --model): by
/// default the benchmark LLaMA of `docs/benchmarks.md` (that of `scripts/bench_eval.py`).
#[derive(clap::Args, Debug, Clone)]
#[group(id = "RandomModel", multiple = true)]
pub struct RandomModel {
    /// Decoder layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Key-value heads (default: --heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// MLP intermediate size.
    #[arg(long, default_value_t = 1536)]
    pub intermediate: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
}

/// Where a benchmark's model comes from.
enum Weights {
    /// A checkpoint, loaded by its family.
    Files(ModelFiles),
    /// The random LLaMA, built in memory.
    Memory(Box<LlamaConfig>, Arc<TensorMap>),
}

/// A benchmark's model, loaded on each rank by [`BenchModel::load`].
pub struct BenchModel {
    /// The --model, or "random".
    pub name: String,
    /// Its family's name in the registry (`llama`, `qwen2`, ...).
    pub family: &'static str,
    /// Its size and FLOPs terms (the family's `describe`).
    pub desc: Description,
    weights: Weights,
}

impl BenchModel {
    /// The parameter dtype to load: `arg`, else the checkpoint's (decided by its family's
    /// loader: `None`), f32 for the random model. What ran is the loaded parameters' dtype.
    pub fn dtype(&self, arg: Option<DtypeArg>) -> Option<DType> {
        match (arg, &self.weights) {
            (Some(d), _) => Some(d.into()),
            (None, Weights::Files(_)) => None,
            (None, Weights::Memory(..)) => Some(DType::F32),
        }
    }

    /// This rank's part of the model under `layout` (no pipeline: every layer and both ends);
    /// `--ep` on a model without sparse blocks is an error.
    pub fn load(
        &self,
        rank: &Rank,
        dtype: Option<DType>,
        mode: ParamMode,
        layout: &LayoutArgs,
    ) -> Result<LoadedCausalLm> {
        match &self.weights {
            Weights::Files(files) => {
                let all = 0..self.desc.layers;
                let ranges = std::slice::from_ref(&all);
                load_causal_lm(files, rank, ranges, dtype, mode, layout, None)
            }
            Weights::Memory(config, map) => {
                if layout.ep > 1 {
                    bail!(
                        "--ep {}: the {} model is not a mixture of experts",
                        layout.ep,
                        self.name
                    );
                }
                let dtype = dtype.unwrap_or(DType::F32);
                let l = llama::build(config, map.clone(), &rank.ctx, dtype, mode).with_context(
                    || format!("building the random model with {}", layout.flags()),
                )?;
                Ok(LoadedCausalLm {
                    model: Box::new(l.model),
                    params: l.params,
                })
            }
        }
    }

    /// The model's name, family and shape, for a report.
    pub fn json(&self) -> Value {
        let d = &self.desc;
        let shape = d.planner_shape.as_ref();
        json!({
            "name": self.name, "family": self.family, "layers": d.layers, "hidden": d.hidden,
            "heads": shape.map(|s| s.heads), "kv_heads": shape.map(|s| s.kv_heads),
            "head_dim": shape.map(|s| s.head_dim),
            "intermediate": shape.map(|s| s.intermediate), "vocab": d.vocab,
            "parameters": d.params,
        })
    }

    /// "random (llama: 4 layers, hidden 512, ..., 24.9 M parameters)", for a table's title.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}: {}, {:.1} M parameters)",
            self.name,
            self.family,
            self.desc.summary,
            self.desc.params as f64 / 1e6
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FLOPs per token of a tiny LLaMA, counted by hand: embedding 10 x 8 (a lookup, not
    /// counted), q/k/v/o 4 x 8 x 8 = 256, MLP 3 x 8 x 16 = 384, norms 2 x 8 + 8, LM head
    /// 8 x 10 = 80: N = 744 multiplying parameters; attention 1 layer x 4 tokens x 2 heads x
    /// head_dim 4 = 32.
    #[test]
    fn flops_per_token_of_a_tiny_llama() {
        let cfg = LlamaConfig::from_json(
            r#"{"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 10,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": false}"#,
            Path::new("tiny"),
        )
        .unwrap();
        let (n, attn) = (744.0, 32.0);
        assert_eq!(
            cfg.description().unwrap().flops_per_token(4, Work::Forward),
            2.0 * n + 2.0 * attn
        );
        assert_eq!(
            cfg.description()
                .unwrap()
                .flops_per_token(4, Work::Training),
            6.0 * n + 6.0 * attn
        );
        assert_eq!(
            cfg.description()
                .unwrap()
                .flops_per_token(4, Work::FrozenTraining),
            4.0 * n + 6.0 * attn
        );
    }
}
