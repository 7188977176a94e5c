//! DiT's initialisation for training from scratch (facebookresearch/DiT `initialize_weights`):
//! Xavier-uniform linear and patch weights with zero biases, normal(0.02) class table and
//! timestep MLP weights, and adaLN-Zero: every block's modulation and the whole output layer
//! start at zero, so each block starts as the identity and the model's output as 0.

use candle_core::{Device, Tensor};

use super::config::DitConfig;
use crate::diffusion::DrawStream;
use crate::error::Result;

/// Every parameter of `cfg` (diffusers names, sorted) initialised as DiT does, from `seed`.
pub fn initial_weights(cfg: &DitConfig, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (i, (name, shape)) in cfg.parameter_shapes().into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let mut d = DrawStream::new(seed, i as u64);
        let zeros = name.ends_with(".bias")
            || name.contains("norm1.linear")
            || name.starts_with("proj_out_");
        let v: Vec<f32> = if zeros {
            vec![0.0; n]
        } else if name.contains("embedding_table") || name.contains("timestep_embedder") {
            (0..n).map(|_| (0.02 * d.normal()) as f32).collect()
        } else {
            // Xavier uniform over (out, in·...) as PyTorch computes fan-in and fan-out.
            let fan_out = shape[0];
            let fan_in = n / fan_out;
            let a = (6.0 / (fan_in + fan_out) as f64).sqrt();
            (0..n)
                .map(|_| (a * (2.0 * d.uniform() - 1.0)) as f32)
                .collect()
        };
        out.push((name, Tensor::from_vec(v, shape, &Device::Cpu)?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
