//! Times the fused elementwise ops of a training step's forward (SwiGLU, GELU, RMSNorm) on an
//! MLP-sized activation: `rows x width` elements (default 4096 x 1536,
//! the benchmark models' MLP), f32 or bf16, best of `repeats`; and `bias_add` forward and
//! backward against candle's broadcast addition on the same shape.
//!
//! `cargo run -p candle-parallel --release --example elementwise_timing -- [f32|bf16] [rows] [width] [repeats]`

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::ops::{bias_add, gelu_tanh, rms_norm, swiglu};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn best<T>(repeats: usize, mut f: impl FnMut() -> Res<T>) -> Res<f64> {
    f()?;
    let mut t = f64::MAX;
    for _ in 0..repeats {
        let t0 = Instant::now();
        f()?;
        t = t.min(t0.elapsed().as_secs_f64());
    }
    Ok(t * 1e3)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.get(1).map(String::as_str) {
        Some("bf16") => DType::BF16,
        _ => DType::F32,
    };
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, width, repeats) = (arg(2, 4096), arg(3, 1536), arg(4, 10));
    let dev = Device::Cpu;
    let gate = Tensor::randn(0f32, 3.0, (rows, width), &dev)?.to_dtype(dtype)?;
    let up = Tensor::randn(0f32, 1.0, (rows, width), &dev)?.to_dtype(dtype)?;
    let fwd = best(repeats, || Ok(swiglu(&gate, &up)?))?;
    let gelu = best(repeats, || Ok(gelu_tanh(&gate)?))?;
    let x = Tensor::randn(0f32, 1.0, (rows, 512), &dev)?.to_dtype(dtype)?;
    let w = Tensor::ones(512, dtype, &dev)?;
    let norm = best(repeats, || Ok(rms_norm(&x, &w, 1e-5)?))?;
    println!(
        "{dtype:?} {rows} x {width}: swiglu {fwd:.2} ms, gelu {gelu:.2} ms; rms_norm {rows} x 512 \
         {norm:.2} ms"
    );
    let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, width, &dev)?.to_dtype(dtype)?)?;
    let y = Var::from_tensor(&up)?;
    let step = |fused: bool| -> Res<()> {
        let out = if fused {
            bias_add(y.as_tensor(), b.as_tensor())?
        } else {
            y.as_tensor().broadcast_add(b.as_tensor())?
        };
        let grads = (out * &gate)?.sum_all()?.backward()?;
        std::hint::black_box(grads.get(b.as_tensor()));
        Ok(())
    };
    let add_fwd = [true, false].map(|fused| {
        best(repeats, || {
            Ok(if fused {
                bias_add(&up, b.as_tensor())?
            } else {
                up.broadcast_add(b.as_tensor())?
            })
        })
    });
    let add_step = [true, false].map(|fused| best(repeats, || step(fused)));
    println!(
        "bias add {rows} x {width}: forward {:.2} ms (candle {:.2}); forward, times a gradient, \
         backward {:.2} ms (candle {:.2})",
        add_fwd[0].as_ref().map_err(|e| e.to_string())?,
        add_fwd[1].as_ref().map_err(|e| e.to_string())?,
        add_step[0].as_ref().map_err(|e| e.to_string())?,
        add_step[1].as_ref().map_err(|e| e.to_string())?,
    );
    Ok(())
}
