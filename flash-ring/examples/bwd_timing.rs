//! Times a linear layer's two backward products as the autograd runs them (candle's matmul):
//! `grad @ w` and `x^T @ grad`, next to flash_ring::matmul on the same views.
//! `cargo run -p flash-ring --release --example bwd_timing -- m k n repeats`
use std::time::Instant;

use candle_core::{Device, Tensor};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn best(repeats: usize, mut f: impl FnMut() -> Tensor) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let t0 = Instant::now();
        f();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    best
}

fn main() -> flash_ring::Result<()> {
    let (m, k, n, repeats) = (arg(1, 2048), arg(2, 384), arg(3, 1152), arg(4, 10));
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
    let g = Tensor::randn(0f32, 1.0, (m, n), &Device::Cpu)?;
    let xt = x.t()?;
    let gf = 2.0 * (m * k * n) as f64 / 1e9;
    let c1 = best(repeats, || g.matmul(&w).unwrap());
    let c2 = best(repeats, || xt.matmul(&g).unwrap());
    let c3 = best(repeats, || g.t().unwrap().matmul(&x).unwrap());
    let f1 = best(repeats, || flash_ring::matmul(&g, &w).unwrap());
    let f2 = best(repeats, || flash_ring::matmul(&xt, &g).unwrap());
    let f3 = best(repeats, || flash_ring::matmul(&g.t().unwrap(), &x).unwrap());
    println!(
        "m {m} k {k} n {n}: dX candle {:.1} flash {:.1} | x^T g candle {:.1} flash {:.1} | g^T x candle {:.1} flash {:.1} GFLOP/s",
        gf / c1, gf / f1, gf / c2, gf / f2, gf / c3, gf / f3
    );
    Ok(())
}
