//! Times `flash_ring::matmul` (short accumulation chains) against candle's `Tensor::matmul`
//! (the `gemm` crate) on `x (m, k) @ w^T` with `w (n, k)`, a linear layer's forward:
//! `cargo run -p flash-ring --release --example matmul_timing -- [m] [k] [n] [repeats]`
//! (defaults 1024, 512, 1536, 10; f32). Prints the best time of each in milliseconds, their
//! GFLOP/s and ratio, and the largest difference between the two results relative to the
//! largest entry (`testkit::rel_err`).
//!
//! With `--backward` after the numbers: the layer's two backward products instead, as the
//! autograd hands them over (`grad (m, n) @ w`, and the weight's `x^T @ grad` and `grad^T @ x`
//! on transposed views), each by candle and by flash_ring::matmul, in GFLOP/s.
//!
//! With `--bf16`: both operands in bf16 (flash-ring's bf16 products as `FLASH_RING_BF16`
//! chooses; candle widens to f32).
//!
//! With `--cold`: 256 MiB are written before each timed product, so that its operands come
//! from memory, as they do in a training step (where the products read activations written
//! long before), not from the caches the previous repeat warmed.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn best(repeats: usize, mut f: impl FnMut() -> Tensor) -> (f64, Tensor) {
    let cold = std::env::args().any(|a| a == "--cold");
    let mut evict = if cold {
        vec![0u8; 256 << 20]
    } else {
        Vec::new()
    };
    let mut out = f();
    let mut best = f64::MAX;
    for i in 0..repeats {
        evict.iter_mut().for_each(|b| *b = i as u8);
        std::hint::black_box(&evict);
        let t0 = Instant::now();
        out = f();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (best, out)
}

/// The `--backward` comparison (see the module docs).
fn backward(m: usize, k: usize, n: usize, repeats: usize) -> flash_ring::Result<()> {
    let dt = dtype();
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?.to_dtype(dt)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?.to_dtype(dt)?;
    let g = Tensor::randn(0f32, 1.0, (m, n), &Device::Cpu)?.to_dtype(dt)?;
    let (xt, gt) = (x.t()?, g.t()?);
    let gf = 2.0 * (m * k * n) as f64 / 1e9;
    let rate = |a: &Tensor, b: &Tensor| {
        let candle = best(repeats, || a.matmul(b).expect("candle")).0;
        let ours = best(repeats, || flash_ring::matmul(a, b).expect("flash_ring")).0;
        format!("candle {:.1} flash_ring {:.1}", gf / candle, gf / ours)
    };
    println!(
        "m {m} k {k} n {n} (GFLOP/s): grad @ w: {} | x^T @ grad: {} | grad^T @ x: {}",
        rate(&g, &w),
        rate(&xt, &g),
        rate(&gt, &x)
    );
    Ok(())
}

/// The operands' dtype: bf16 with `--bf16`, else f32.
fn dtype() -> DType {
    if std::env::args().any(|a| a == "--bf16") {
        DType::BF16
    } else {
        DType::F32
    }
}

fn main() -> flash_ring::Result<()> {
    let (m, k, n, repeats) = (arg(1, 1024), arg(2, 512), arg(3, 1536), arg(4, 10));
    if std::env::args().any(|a| a == "--backward") {
        return backward(m, k, n, repeats);
    }
    let mut rng = StdRng::seed_from_u64(7);
    let mut input = |r: usize, c: usize| {
        let v: Vec<f32> = (0..r * c).map(|_| rng.random_range(-1.0..1.0)).collect();
        Tensor::from_vec(v, (r, c), &Device::Cpu)?.to_dtype(dtype())
    };
    let (x, w) = (input(m, k)?, input(n, k)?);
    let wt = w.t()?;
    let (t_ring, ours) = best(repeats, || flash_ring::matmul(&x, &wt).expect("flash_ring"));
    let (t_gemm, theirs) = best(repeats, || x.matmul(&wt).expect("candle"));
    let flops = 2.0 * (m * k * n) as f64;
    // NaN-aware: a NaN anywhere makes the printed difference NaN.
    let diff = testkit::rel_err(&ours, &theirs);
    println!(
        "m {m} k {k} n {n}: flash_ring {:.2} ms ({:.1} GFLOP/s), candle {:.2} ms ({:.1} GFLOP/s), \
         flash_ring / candle time {:.2}, max difference {:.1e} of the largest entry",
        t_ring * 1e3,
        flops / t_ring / 1e9,
        t_gemm * 1e3,
        flops / t_gemm / 1e9,
        t_ring / t_gemm,
        diff
    );
    Ok(())
}
