//! Times one AdamW step with clipping over `n` million parameters (default 111, the MoE
//! benchmark model's count) in `dtype` (f32 or bf16; gradients in the same dtype): the
//! trainer's path (`step_clipped`: the clipping, the update and the parameter's write in one
//! pass) against `clip_grad_norm` followed by `step` (the gradients scaled into new tensors
//! first). Same bits either way (`tests/optim.rs`); this measures the memory traffic saved.
//!
//! `cargo run -p candle-parallel --release --example adamw_timing -- [millions] [f32|bf16] [repeats]`

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::optim::{
    clip_coefficient, clip_grad_norm, global_grad_norm, AdamW, AdamWConfig, OptimParam,
};
use candle_parallel::Comm;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn no_shard(_: &str) -> Option<Comm> {
    None
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let millions: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(111);
    let dtype = match args.get(2).map(String::as_str) {
        Some("bf16") => DType::BF16,
        _ => DType::F32,
    };
    let repeats: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    // Parameters of 4M elements each, as a model's matrices.
    let per = 4 << 20;
    let count = (millions << 20).div_ceil(per);
    let dev = Device::Cpu;
    let mut params = Vec::new();
    let mut grads = Vec::new();
    for i in 0..count {
        let w = Tensor::randn(0f32, 0.02, (per / 512, 512), &dev)?.to_dtype(dtype)?;
        let name = format!("p{i:03}.weight");
        params.push(OptimParam::new(name.clone(), Var::from_tensor(&w)?));
        let g = Tensor::randn(0f32, 1.0, (per / 512, 512), &dev)?.to_dtype(dtype)?;
        grads.push((name, g));
    }
    let mut opt = AdamW::new(params, AdamWConfig::default())?;
    let (mut fused, mut separate) = (f64::MAX, f64::MAX);
    for _ in 0..repeats {
        let t = Instant::now();
        let norm = global_grad_norm(&grads, &no_shard)?;
        opt.step_clipped(&grads, 1e-4, clip_coefficient(norm, 1.0)?)?;
        fused = fused.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut g = grads.clone();
        clip_grad_norm(&mut g, 1.0, &no_shard)?;
        opt.step(&g, 1e-4)?;
        separate = separate.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{} M {dtype:?} parameters: clip + step in one pass {:.1} ms, clip then step {:.1} ms \
         ({:.2}x)",
        (count * per) >> 20,
        fused * 1e3,
        separate * 1e3,
        separate / fused
    );
    Ok(())
}
