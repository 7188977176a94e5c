//! Benchmark of the flash-ring CPU kernels (later `cpl bench attention`).
//!
//! For shape (batch 1, 8 heads, S tokens, head_dim 64), S in {2048, 8192}, causal and full,
//! f32 and bf16, reports forward and forward+backward time of flash-ring and of naive candle
//! attention, this machine's f32 matmul rate (candle matmul, 2048 x 2048, same run), achieved
//! GFLOP/s (causal counted as half; forward = 4 S^2 D per head, backward = 2.5 x forward) and,
//! given `--torch FILE` (JSON from `scripts/bench_attention_torch.py`), the ratio to PyTorch.
//!
//! Usage: `cargo run -p flash-ring --release --example bench_attention -- [--seqs 2048,8192]
//!         [--dtypes f32,bf16] [--masks causal,full] [--repeats N] [--naive-max-seq N]
//!         [--torch torch.json] [--json out.json]`

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::{flash_bwd, flash_fwd, naive_attention, AttnSpec, MaskKind};

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;

struct Args {
    seqs: Vec<usize>,
    dtypes: Vec<String>,
    masks: Vec<String>,
    repeats: usize,
    naive_max_seq: usize,
    torch: Option<String>,
    json: Option<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        seqs: vec![2048, 8192],
        dtypes: vec!["f32".into(), "bf16".into()],
        masks: vec!["causal".into(), "full".into()],
        repeats: 3,
        naive_max_seq: 2048,
        torch: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--seqs" => {
                a.seqs = val()?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()?
            }
            "--dtypes" => a.dtypes = val()?.split(',').map(String::from).collect(),
            "--masks" => a.masks = val()?.split(',').map(String::from).collect(),
            "--repeats" => a.repeats = val()?.parse()?,
            "--naive-max-seq" => a.naive_max_seq = val()?.parse()?,
            "--torch" => a.torch = Some(val()?),
            "--json" => a.json = Some(val()?),
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

/// Best wall time in seconds of `repeats` runs of `f` (after one warm-up run).
fn best_of(repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn matmul_gflops(repeats: usize) -> anyhow::Result<f64> {
    let n = 2048;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let t = best_of(repeats.max(10), || {
        let _c = a.matmul(&b)?;
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / t / 1e9)
}

fn parse_dtype(s: &str) -> anyhow::Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => anyhow::bail!("unknown dtype {s}"),
    })
}

fn parse_mask(s: &str) -> anyhow::Result<MaskKind> {
    Ok(match s {
        "causal" => MaskKind::Causal,
        "full" => MaskKind::Full,
        _ => anyhow::bail!("unknown mask {s}"),
    })
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let threads = rayon::current_num_threads();
    let torch_doc: serde_json::Value = match &args.torch {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p)?)?,
        None => serde_json::Value::Null,
    };
    let torch: BTreeMap<String, serde_json::Value> = torch_doc
        .get("results")
        .and_then(|r| r.as_object())
        .map(|o| o.clone().into_iter().collect())
        .unwrap_or_default();
    let torch_mm = torch_doc.get("matmul_f32_gflops").and_then(|x| x.as_f64());
    let mm = matmul_gflops(args.repeats)?;
    println!(
        "threads: {threads}; f32 matmul 2048^3: candle {mm:.1} GFLOP/s{}",
        torch_mm.map_or(String::new(), |t| format!(", PyTorch {t:.1} GFLOP/s"))
    );
    println!("GF/s: flash-ring forward+backward rate (causal counted as half); %mm: of candle's matmul rate; %mkl: of PyTorch's");
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
    let mut rows = Vec::new();
    for dts in &args.dtypes {
        let dtype = parse_dtype(dts)?;
        for &s in &args.seqs {
            for ms in &args.masks {
                let mask = parse_mask(ms)?;
                let dev = Device::Cpu;
                let shape = (1, s, HEADS, HEAD_DIM);
                let q = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(dtype)?;
                let k = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(dtype)?;
                let v = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(dtype)?;
                let dout = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(dtype)?;
                let spec = AttnSpec::dense(1.0 / (HEAD_DIM as f32).sqrt(), mask, s, s);
                let fwd = best_of(args.repeats, || {
                    flash_fwd(&q, &k, &v, &spec)?;
                    Ok(())
                })?;
                let fb = best_of(args.repeats, || {
                    let (o, l) = flash_fwd(&q, &k, &v, &spec)?;
                    flash_bwd(&q, &k, &v, &o, &l, &dout, &spec)?;
                    Ok(())
                })?;
                let (naive_f, naive_fb) = if s <= args.naive_max_seq {
                    let qv = Var::from_tensor(&q)?;
                    let kv = Var::from_tensor(&k)?;
                    let vv = Var::from_tensor(&v)?;
                    let nf = best_of(1, || {
                        naive_attention(&q, &k, &v, &spec)?;
                        Ok(())
                    })?;
                    let nfb = best_of(1, || {
                        let o =
                            naive_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &spec)?;
                        let g = (o.to_dtype(DType::F32)? * dout.to_dtype(DType::F32)?)?
                            .sum_all()?
                            .backward()?;
                        anyhow::ensure!(g.get(qv.as_tensor()).is_some(), "naive: no grad");
                        Ok(())
                    })?;
                    (Some(nf), Some(nfb))
                } else {
                    (None, None)
                };
                let causal_f = if mask == MaskKind::Causal { 0.5 } else { 1.0 };
                let fwd_flop = 4.0 * (s as f64).powi(2) * HEAD_DIM as f64 * HEADS as f64 * causal_f;
                let fb_flop = 3.5 * fwd_flop;
                let gf = fb_flop / fb / 1e9;
                let key = format!("{dts}_{s}_{ms}");
                let tt = torch.get(&key);
                let t_f = tt.and_then(|x| x.get("fwd_s")).and_then(|x| x.as_f64());
                let t_fb = tt.and_then(|x| x.get("fwd_bwd_s")).and_then(|x| x.as_f64());
                let fmt = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{:.1}", t * 1e3));
                println!(
                    "{:<6} {:>5} {:<6} | {:>9.1} {:>9.1} {:>7.1} {:>5.0}% {:>6} | {:>9} {:>9} | {:>9} {:>9} {:>7}",
                    dts,
                    s,
                    ms,
                    fwd * 1e3,
                    fb * 1e3,
                    gf,
                    100.0 * gf / mm,
                    torch_mm.map_or("-".to_string(), |t| format!("{:.0}%", 100.0 * gf / t)),
                    fmt(naive_f),
                    fmt(naive_fb),
                    fmt(t_f),
                    fmt(t_fb),
                    t_fb.map_or("-".to_string(), |t| format!("{:.2}", t / fb)),
                );
                rows.push(serde_json::json!({
                    "key": key, "dtype": dts, "seq": s, "mask": ms,
                    "fwd_s": fwd, "fwd_bwd_s": fb,
                    "fwd_gflops": fwd_flop / fwd / 1e9, "fwd_bwd_gflops": gf,
                    "fraction_of_matmul": gf / mm,
                    "fraction_of_torch_matmul": torch_mm.map(|t| gf / t),
                    "naive_fwd_s": naive_f, "naive_fwd_bwd_s": naive_fb,
                    "torch_fwd_s": t_f, "torch_fwd_bwd_s": t_fb,
                    "speedup_vs_torch_fwd_bwd": t_fb.map(|t| t / fb),
                }));
            }
        }
    }
    if let Some(p) = &args.json {
        let doc = serde_json::json!({
            "threads": threads, "matmul_f32_gflops": mm, "torch_matmul_f32_gflops": torch_mm,
            "shape": "(batch 1, heads 8, S, head_dim 64)", "results": rows,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
