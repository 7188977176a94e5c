//! `cpl bench matmul`: `flash_ring::matmul` (short accumulation chains, issue 21) against
//! candle's `Tensor::matmul` (the `gemm` crate) on the products of the LLaMA layers, with each
//! one's error against float64 on a sample of the outputs.
//!
//! Shapes: `x @ w^T` of the benchmark model of `docs/benchmarks.md` (4096 tokens, hidden 512,
//! intermediate 1536, vocab 32000 in loss chunks of 1024 tokens) and of SmolLM2-135M on 199
//! tokens (hidden 576, intermediate 1536, vocab 49152), also one token at a time (decoding) and
//! 8 to 48 rows (either side of the few-rows paths' limits); inputs N(0, 1). Interleaved runs,
//! best time of each.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use flash_ring::{Bf16Products, Gemm, Isa, KernelConfig};
use serde_json::json;

use super::{at_least_one, print_report, Machine};
use crate::args::DtypeArg;

#[derive(clap::Args, Debug, Clone)]
pub struct MatmulArgs {
    /// flash-ring's kernels (default: the best this CPU has).
    #[arg(long, value_enum)]
    pub isa: Option<IsaArg>,
    /// The library of flash-ring's products: `auto` (FLASH_RING_GEMM when set; else Intel MKL
    /// for bf16 on a CPU with AMX where MKL loads, FLASH_RING_MKL naming libmkl_rt),
    /// `native` (flash-ring's kernels) or `mkl` (MKL for f32 and bf16).
    #[arg(long, default_value = "auto")]
    pub gemm: Gemm,
    /// bf16 products of flash-ring's kernels: `auto` (FLASH_RING_BF16 when set; else the CPU's
    /// bf16 dot products where it has AVX512-BF16, except on Intel's CPUs, where they were
    /// measured slower than the same products widened to f32), `dot` or `widen`.
    #[arg(long, default_value = "auto")]
    pub bf16: Bf16Products,
    /// Timed runs of each product; the best is reported.
    #[arg(long, default_value_t = 10)]
    pub repeats: usize,
    /// Dtype of both operands (bf16: flash-ring uses the CPU's bf16 dot products as `--bf16`
    /// chooses, or MKL as `--gemm` does; candle widens to f32).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DtypeArg,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// A flash-ring instruction set flag.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsaArg {
    Avx512,
    Avx2,
    Portable,
}

impl From<IsaArg> for Isa {
    fn from(i: IsaArg) -> Self {
        match i {
            IsaArg::Avx512 => Isa::Avx512,
            IsaArg::Avx2 => Isa::Avx2,
            IsaArg::Portable => Isa::Portable,
        }
    }
}

/// The products timed: name, m, k, n of `(m x k) @ (k x n)`.
const SHAPES: [(&str, usize, usize, usize); 16] = [
    ("bench q/k/v/o", 4096, 512, 512),
    ("bench gate/up", 4096, 512, 1536),
    ("bench down", 4096, 1536, 512),
    ("bench LM head chunk", 1024, 512, 32000),
    ("SmolLM2 q/o", 199, 576, 576),
    ("SmolLM2 gate/up", 199, 576, 1536),
    ("SmolLM2 down", 199, 1536, 576),
    ("SmolLM2 LM head", 199, 576, 49152),
    ("SmolLM2 decode q/o", 1, 576, 576),
    ("SmolLM2 decode gate/up", 1, 576, 1536),
    ("SmolLM2 decode down", 1, 1536, 576),
    ("SmolLM2 decode LM head", 1, 576, 49152),
    ("SmolLM2 8 rows down", 8, 1536, 576),
    ("SmolLM2 16 rows down", 16, 1536, 576),
    ("SmolLM2 32 rows down", 32, 1536, 576),
    ("SmolLM2 48 rows down", 48, 1536, 576),
];

fn seconds(f: impl FnOnce() -> Result<Tensor>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// `max |y - exact| / max |exact|` over the first rows of `y = x @ w^T` (exact: the float64
/// product of the operands as they are, in any dtype).
fn error(x: &Tensor, w: &Tensor, y: &Tensor) -> Result<f64> {
    let rows = x.dim(0)?.min(4);
    let cols = w.dim(0)?.min(512);
    let f32_rows = |t: Tensor| -> Result<Vec<Vec<f32>>> { Ok(t.to_dtype(DType::F32)?.to_vec2()?) };
    let x = f32_rows(x.narrow(0, 0, rows)?)?;
    let w = f32_rows(w.narrow(0, 0, cols)?)?;
    let y = f32_rows(y.narrow(0, 0, rows)?.narrow(1, 0, cols)?)?;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (xr, yr) in x.iter().zip(&y) {
        for (wr, &got) in w.iter().zip(yr) {
            let exact: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
            num = num.max((got as f64 - exact).abs());
            den = den.max(exact.abs());
        }
    }
    Ok(num / den)
}

pub fn run(args: &MatmulArgs) -> Result<()> {
    at_least_one("--repeats", args.repeats)?;
    let cfg = KernelConfig {
        isa: args.isa.map(Isa::from),
        gemm: args.gemm,
        bf16: args.bf16,
        ..KernelConfig::default()
    };
    let isa = cfg.isa.unwrap_or_else(flash_ring::cpu::detect);
    let dtype = DType::from(args.dtype);
    // An ISA this CPU lacks fails here, named by its flag.
    // A library that cannot be used (MKL not found, a bad FLASH_RING_GEMM) fails here, named.
    let products = flash_ring::cpu::mkl::describe(cfg.gemm, dtype == DType::BF16)
        .with_context(|| format!("--gemm {}", format!("{:?}", args.gemm).to_lowercase()))?;
    // A bad FLASH_RING_BF16 fails here, named.
    let bf16_flag = || format!("--bf16 {}", format!("{:?}", args.bf16).to_lowercase());
    let bf16_dot =
        flash_ring::cpu::gemm_bf16::used_under(isa, args.bf16, false).with_context(bf16_flag)?;
    let bf16_dot_few_rows =
        flash_ring::cpu::gemm_bf16::used_under(isa, args.bf16, true).with_context(bf16_flag)?;
    let one = Tensor::ones((1, 1), DType::F32, &Device::Cpu)?;
    flash_ring::matmul_with_config(&one, &one, &cfg)
        .with_context(|| format!("--isa {}", format!("{isa:?}").to_lowercase()))?;
    // How flash-ring multiplies bf16 where MKL does not: None for f32 and for MKL's products.
    let on_mkl = flash_ring::cpu::mkl::route(cfg.gemm, dtype == DType::BF16)?.is_some();
    let dot = "the CPU's bf16 dot products (AVX512-BF16)";
    let bf16_products =
        (dtype == DType::BF16 && !on_mkl).then(|| match (bf16_dot, bf16_dot_few_rows) {
            (true, _) => dot.to_string(),
            (false, true) => format!(
                "widened to f32, except products of at most {} rows: {dot}",
                flash_ring::cpu::gemm_bf16::MEMORY_BOUND_ROWS
            ),
            (false, false) => "widened to f32".to_string(),
        });
    if !args.json {
        println!("{}", Machine::detect().line());
        println!("flash-ring kernels: {isa:?}, dtype {:?}", dtype);
        println!("flash-ring's products on: {products}");
        if let Some(how) = &bf16_products {
            println!("bf16 products: {how}");
        }
        println!(
            "| product | m x k x n | candle ms | GFLOP/s | flash-ring ms | GFLOP/s | speed \
             | err candle | err flash-ring |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    let mut results = Vec::new();
    for (name, m, k, n) in SHAPES {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
        let wt = w.t()?;
        let ours = || Ok(flash_ring::matmul_with_config(&x, &wt, &cfg)?);
        let theirs = || Ok(x.matmul(&wt)?);
        let (y_ours, y_theirs) = (ours()?, theirs()?);
        let (mut t_ours, mut t_theirs) = (f64::MAX, f64::MAX);
        for _ in 0..args.repeats {
            t_theirs = t_theirs.min(seconds(theirs)?);
            t_ours = t_ours.min(seconds(ours)?);
        }
        let gf = 2.0 * (m * k * n) as f64 / 1e9;
        let (err_theirs, err_ours) = (error(&x, &w, &y_theirs)?, error(&x, &w, &y_ours)?);
        if !args.json {
            println!(
                "| {name} | {m} x {k} x {n} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2}x | {:.1e} \
                 | {:.1e} |",
                t_theirs * 1e3,
                gf / t_theirs,
                t_ours * 1e3,
                gf / t_ours,
                t_theirs / t_ours,
                err_theirs,
                err_ours,
            );
        }
        results.push(json!({
            "product": name, "m": m, "k": k, "n": n,
            "candle_s": t_theirs, "candle_gflops": gf / t_theirs,
            "flash_ring_s": t_ours, "flash_ring_gflops": gf / t_ours,
            "speedup": t_theirs / t_ours,
            "candle_error": err_theirs, "flash_ring_error": err_ours,
        }));
    }
    if args.json {
        print_report(
            "matmul",
            json!({ "isa": format!("{isa:?}"), "dtype": dtype.as_str(), "repeats": args.repeats,
                "products": products, "bf16_products": bf16_products,
                "results": results }),
        )?;
    }
    Ok(())
}
