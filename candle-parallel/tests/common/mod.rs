//! Helpers shared by the tests of this crate.
#![allow(dead_code)]

use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor, Var};
use candle_parallel::comm::{Comm, LocalWorld};
use rand::rngs::StdRng;
use rand::Rng;

/// The gradient of `v`, or an error naming it if backward produced none.
pub fn grad(grads: &GradStore, v: &Var, what: &str) -> Result<Tensor> {
    grads
        .get(v.as_tensor())
        .cloned()
        .ok_or_else(|| candle_core::Error::Msg(format!("no gradient for {what}")))
}

#[allow(unused_imports)]
pub use testkit::{assert_close, max_abs, rel_err};

/// `n` values with magnitude in `[lo, hi)` and a random sign: never zero.
pub fn signed_values(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(lo..hi);
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect()
}

/// A tensor of `dims` with values of magnitude in `[0.25, 1)` and a random sign.
pub fn rand_t(rng: &mut StdRng, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(signed_values(rng, n, 0.25, 1.0), dims, &Device::Cpu).unwrap()
}

/// Runs `f` on `p` local ranks (a 60 s timeout, so a hang fails) and returns each rank's value;
/// panics naming the world size on any rank's error.
pub fn world<T: Send>(p: usize, f: impl Fn(Comm) -> Result<T> + Sync) -> Vec<T> {
    LocalWorld::new(p)
        .with_timeout(Duration::from_secs(60))
        .launch(f)
        .unwrap_or_else(|e| panic!("world of {p} ranks: {e}"))
}

/// Zigzag order of `n` rows offset by `base` (first, last, second, second-to-last, ...): the
/// order of the positions a context-parallel rank holds.
pub fn zigzag(n: usize, base: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(n);
    let (mut lo, mut hi) = (0usize, n);
    while lo < hi {
        out.push(base + lo as u32);
        lo += 1;
        if lo < hi {
            hi -= 1;
            out.push(base + hi as u32);
        }
    }
    out
}
