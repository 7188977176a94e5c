//! Times the CPU kernels on one shape: `cargo run -p flash-ring --release --example
//! attention_timing -- [seq] [heads] [head_dim] [repeats] [softcap]` (defaults 4096, 4, 64, 5,
//! none; causal, f32, batch 1; a soft-cap of 0 is none). Prints the best forward and backward times in milliseconds over `repeats`
//! timed runs after one warm-up, and a hash of the bits of out, lse, dq, dk and dv (inputs from
//! a fixed seed: two builds that print the same hash computed the same bits).

use std::time::Instant;

use candle_core::{Device, Tensor};
use flash_ring::{flash_bwd, flash_fwd, AttnSpec, MaskKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> flash_ring::Result<()> {
    let (s, h, d, repeats) = (arg(1, 4096), arg(2, 4), arg(3, 64), arg(4, 5));
    let mut rng = StdRng::seed_from_u64(7);
    let mut input = || {
        let x: Vec<f32> = (0..s * h * d)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        Tensor::from_vec(x, (1, s, h, d), &Device::Cpu)
    };
    let (q, k, v, dout) = (input()?, input()?, input()?, input()?);
    let mut spec = AttnSpec::dense(1.0 / (d as f32).sqrt(), MaskKind::Causal, s, s);
    let cap = arg(5, 0);
    if cap > 0 {
        spec = spec.with_softcap(cap as f32);
    }
    let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for i in 0..=repeats {
        let t0 = Instant::now();
        let (out, lse) = flash_fwd(&q, &k, &v, &spec)?;
        let t1 = Instant::now();
        let (dq, dk, dv) = flash_bwd(&q, &k, &v, &out, &lse, &dout, &spec)?;
        let t2 = Instant::now();
        if i == 0 {
            for t in [&out, &lse, &dq, &dk, &dv] {
                for x in t.flatten_all()?.to_vec1::<f32>()? {
                    hash = (hash ^ x.to_bits() as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        if i > 0 {
            fwd = fwd.min((t1 - t0).as_secs_f64() * 1e3);
            bwd = bwd.min((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    println!(
        "seq {s} heads {h} head_dim {d} causal f32 softcap {:?}: fwd {fwd:.1} ms, bwd {bwd:.1} ms, \
         bits {hash:016x}",
        spec.softcap
    );
    Ok(())
}
