//! `cpl bench attention`: the flash-ring CPU kernel against naive candle attention.
//!
//! `--device cuda[:N]` times the same calls on a GPU (flash-ring's composite path there), with
//! the device synchronised after every timed run, against the GPU's f32 and bf16 matmul rates.
//! `cpl bench eval` refuses a GPU (its timings do not synchronise it); `cpl bench train` synchronises
//! after every step.
//!
//! Shape (batch 1, --heads, S, --head-dim) for every S of --seqs, dtype and mask: forward and
//! forward+backward time of flash-ring and of naive candle attention (up to --naive-max-seq),
//! this machine's f32 matmul rate (candle, 2048^3, same run), the achieved GFLOP/s (forward =
//! 4 S^2 D per head, backward = 2.5 x forward, causal counted as half) and, given `--torch FILE`
//! (JSON of `scripts/bench_attention_torch.py`), PyTorch's times and the ratio to them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use flash_ring::{flash_bwd, flash_fwd, naive_attention, AttnSpec, MaskKind};
use serde_json::{json, Value};

use super::{at_least_one, best_of_on, print_report, Machine, MatmulRate};
use crate::args::DtypeArg;
use crate::layout::DeviceArg;

#[derive(clap::Args, Debug, Clone)]
pub struct AttentionArgs {
    /// Sequence lengths S.
    #[arg(long, value_delimiter = ',', default_values_t = [2048, 8192])]
    pub seqs: Vec<usize>,
    /// Dtypes of q, k and v.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [DtypeArg::F32, DtypeArg::Bf16]
    )]
    pub dtypes: Vec<DtypeArg>,
    /// Masks.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = [MaskArg::Causal, MaskArg::Full]
    )]
    pub masks: Vec<MaskArg>,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Timed runs of each measurement (after a warm-up); the best is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Longest S that naive candle attention runs at (it forms S x S scores per head).
    #[arg(long, default_value_t = 2048)]
    pub naive_max_seq: usize,
    /// PyTorch timings of the same shapes (JSON of scripts/bench_attention_torch.py).
    #[arg(long)]
    pub torch: Option<PathBuf>,
    #[command(flatten)]
    pub matmul: MatmulRate,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Where q, k, v live and attention runs: cpu, cuda or cuda:N (needs a build with
    /// `--features cuda`); on a GPU every timing waits for the device.
    #[arg(long, default_value = "cpu", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
}

/// An attention mask flag.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskArg {
    Causal,
    Full,
}

impl MaskArg {
    fn kind(self) -> MaskKind {
        match self {
            Self::Causal => MaskKind::Causal,
            Self::Full => MaskKind::Full,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Causal => "causal",
            Self::Full => "full",
        }
    }
}

/// The PyTorch timings of `--torch`: its matmul rate and, by `<dtype>_<S>_<mask>`, the times.
struct Torch {
    matmul_gflops: Option<f64>,
    results: BTreeMap<String, Value>,
}

impl Torch {
    fn read(path: Option<&PathBuf>, shape: &str) -> Result<Self> {
        let Some(path) = path else {
            return Ok(Self {
                matmul_gflops: None,
                results: BTreeMap::new(),
            });
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--torch {}: cannot read", path.display()))?;
        let doc: Value = serde_json::from_str(&text)
            .with_context(|| format!("--torch {}: not JSON", path.display()))?;
        if let Some(theirs) = doc.get("shape").and_then(Value::as_str) {
            if theirs != shape {
                bail!(
                    "--torch {} holds timings of shape {theirs}, not {shape} (--heads, --head-dim)",
                    path.display()
                );
            }
        }
        Ok(Self {
            matmul_gflops: doc.get("matmul_f32_gflops").and_then(Value::as_f64),
            results: doc
                .get("results")
                .and_then(Value::as_object)
                .map(|o| o.clone().into_iter().collect())
                .unwrap_or_default(),
        })
    }

    /// Forward and forward+backward seconds of `key`.
    fn times(&self, key: &str) -> (Option<f64>, Option<f64>) {
        let t = self.results.get(key);
        let get = |f: &str| t.and_then(|x| x.get(f)).and_then(Value::as_f64);
        (get("fwd_s"), get("fwd_bwd_s"))
    }
}

/// One measured shape.
struct Row {
    dtype: DType,
    seq: usize,
    mask: MaskArg,
    /// `<dtype>_<S>_<mask>`, the key of the PyTorch timings.
    key: String,
    fwd: f64,
    fwd_bwd: f64,
    fwd_gflops: f64,
    gflops: f64,
    naive: Option<(f64, f64)>,
    torch: (Option<f64>, Option<f64>),
}

/// Forward, forward+backward and naive times of one shape, next to PyTorch's.
fn measure(
    args: &AttentionArgs,
    device: &Device,
    torch: &Torch,
    dtype: DType,
    s: usize,
    mask: MaskArg,
) -> Result<Row> {
    let shape = (1, s, args.heads, args.head_dim);
    let randn = || -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?)
    };
    let (q, k, v, dout) = (randn()?, randn()?, randn()?, randn()?);
    let spec = AttnSpec::dense(1.0 / (args.head_dim as f32).sqrt(), mask.kind(), s, s);
    let fwd = best_of_on(device, args.repeats, || {
        flash_fwd(&q, &k, &v, &spec)?;
        Ok(())
    })?;
    let fwd_bwd = best_of_on(device, args.repeats, || {
        let (o, l) = flash_fwd(&q, &k, &v, &spec)?;
        flash_bwd(&q, &k, &v, &o, &l, &dout, &spec)?;
        Ok(())
    })?;
    let half = if mask == MaskArg::Causal { 0.5 } else { 1.0 };
    let fwd_flop = 4.0 * (s as f64).powi(2) * (args.head_dim * args.heads) as f64 * half;
    let key = format!("{}_{s}_{}", dtype.as_str(), mask.name());
    let mut row = Row {
        dtype,
        seq: s,
        mask,
        torch: torch.times(&key),
        key,
        fwd,
        fwd_bwd,
        fwd_gflops: fwd_flop / fwd / 1e9,
        gflops: 3.5 * fwd_flop / fwd_bwd / 1e9,
        naive: None,
    };
    if s > args.naive_max_seq {
        return Ok(row);
    }
    let (qv, kv, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let naive_f = best_of_on(device, 1, || {
        naive_attention(&q, &k, &v, &spec)?;
        Ok(())
    })?;
    let naive_fb = best_of_on(device, 1, || {
        let o = naive_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &spec)?;
        let g = (o.to_dtype(DType::F32)? * dout.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        anyhow::ensure!(
            g.get(qv.as_tensor()).is_some(),
            "naive attention: no gradient"
        );
        Ok(())
    })?;
    row.naive = Some((naive_f, naive_fb));
    Ok(row)
}

pub fn run(args: &AttentionArgs) -> Result<()> {
    at_least_one("--heads", args.heads)?;
    at_least_one("--head-dim", args.head_dim)?;
    at_least_one("--repeats", args.repeats)?;
    if let Some(&s) = args.seqs.iter().find(|&&s| s == 0) {
        bail!("--seqs {s}: every sequence length must be at least 1");
    }
    let shape = format!(
        "(batch 1, heads {}, S, head_dim {})",
        args.heads, args.head_dim
    );
    let torch = Torch::read(args.torch.as_ref(), &shape)?;
    let device = args.device.open(0)?;
    let mm = args
        .matmul
        .gflops_on(&device, DType::F32, args.repeats.max(10))?;
    // On a GPU, bf16 attention is also set against the bf16 matmul rate (tensor cores).
    let mm_bf16 = match args.device {
        DeviceArg::Cpu => None,
        DeviceArg::Cuda(_) => Some(args.matmul.gflops_on(
            &device,
            DType::BF16,
            args.repeats.max(10),
        )?),
    };
    let pct = |x: f64, of: Option<f64>| of.map_or("-".into(), |t| format!("{:.0}%", 100.0 * x / t));
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{:.1}", t * 1e3));
    if !args.json {
        println!("{}; device {}", Machine::detect().line(), args.device);
        println!(
            "shape {shape}; f32 matmul {}^3: candle {mm:.1} GFLOP/s{}{}",
            args.matmul.matmul_size,
            mm_bf16.map_or(String::new(), |b| format!(", bf16 {b:.1} GFLOP/s")),
            torch
                .matmul_gflops
                .map_or(String::new(), |t| format!(", PyTorch {t:.1} GFLOP/s"))
        );
        println!(
            "GF/s: flash-ring forward+backward rate (causal counted as half); %mm: of candle's \
             matmul rate; %mkl: of PyTorch's"
        );
        println!(
            "{:<6} {:>5} {:<6} | {:>9} {:>9} {:>7} {:>6} {:>6} | {:>9} {:>9} | {:>9} {:>9} {:>7}",
            "dtype",
            "S",
            "mask",
            "fwd ms",
            "f+b ms",
            "GF/s",
            "%mm",
            "%mkl",
            "naive f",
            "naive f+b",
            "torch f",
            "torch f+b",
            "x torch"
        );
    }
    let mut rows = Vec::new();
    for &dt in &args.dtypes {
        let dtype = DType::from(dt);
        for &s in &args.seqs {
            for &m in &args.masks {
                let row = measure(args, &device, &torch, dtype, s, m)?;
                if !args.json {
                    println!(
                        "{:<6} {:>5} {:<6} | {:>9.1} {:>9.1} {:>7.1} {:>5.0}% {:>6} | {:>9} {:>9} | {:>9} {:>9} {:>7}",
                        dtype.as_str(),
                        s,
                        m.name(),
                        row.fwd * 1e3,
                        row.fwd_bwd * 1e3,
                        row.gflops,
                        100.0 * row.gflops / mm,
                        pct(row.gflops, torch.matmul_gflops),
                        ms(row.naive.map(|n| n.0)),
                        ms(row.naive.map(|n| n.1)),
                        ms(row.torch.0),
                        ms(row.torch.1),
                        row.torch.1.map_or("-".into(), |t| format!("{:.2}", t / row.fwd_bwd)),
                    );
                }
                rows.push(row);
            }
        }
    }
    if !args.json {
        return Ok(());
    }
    let results: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "key": r.key, "dtype": r.dtype.as_str(), "seq": r.seq, "mask": r.mask.name(),
                "fwd_s": r.fwd, "fwd_bwd_s": r.fwd_bwd,
                "fwd_gflops": r.fwd_gflops, "fwd_bwd_gflops": r.gflops,
                "fraction_of_matmul": r.gflops / mm,
                "fraction_of_bf16_matmul": mm_bf16.map(|b| r.gflops / b),
                "fraction_of_torch_matmul": torch.matmul_gflops.map(|t| r.gflops / t),
                "naive_fwd_s": r.naive.map(|n| n.0), "naive_fwd_bwd_s": r.naive.map(|n| n.1),
                "torch_fwd_s": r.torch.0, "torch_fwd_bwd_s": r.torch.1,
                "speedup_vs_torch_fwd_bwd": r.torch.1.map(|t| t / r.fwd_bwd),
            })
        })
        .collect();
    print_report(
        "attention",
        json!({
            "shape": shape, "batch": 1, "heads": args.heads, "head_dim": args.head_dim,
            "device": args.device.to_string(),
            "repeats": args.repeats, "matmul_f32_gflops": mm, "matmul_bf16_gflops": mm_bf16,
            "matmul_size": args.matmul.matmul_size,
            "torch_matmul_f32_gflops": torch.matmul_gflops, "results": results,
        }),
    )
}
