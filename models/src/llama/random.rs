//! Randomly initialised LLaMA checkpoints of any shape, written in the Hugging Face layout: for
//! tests, benchmarks and trying a parallel layout without downloading a model.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::LlamaConfig;
use crate::checkpoint::{write_hf_dir, SaveOptions};
use crate::decoder::{NormStyle, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::hub::ModelFiles;

/// Writes `config` (a `config.json` value) and [`random_weights`] of seed `seed` to `dir` and
/// returns the model's files: the same call writes the same bytes.
pub fn write_random_checkpoint(
    dir: &Path,
    config: &serde_json::Value,
    seed: u64,
) -> Result<ModelFiles> {
    let text =
        serde_json::to_string_pretty(config).map_err(|e| Error::Invalid(format!("config: {e}")))?;
    let cfg = LlamaConfig::from_json(&text, &dir.join("config.json"))?;
    let tensors = random_weights(&cfg, seed)?;
    let opts = SaveOptions {
        dtype: DType::F32,
        extra_files: vec![("config.json".into(), text.into_bytes())],
        ..Default::default()
    };
    write_hf_dir(&tensors, dir, &opts)?;
    crate::hub::from_dir(&dir.display().to_string(), dir)
}

/// Random f32 weights of a model of `cfg`, by checkpoint name (sorted): uniform with standard
/// deviation 0.02 (norm weights 1, or 0 where the norm scales by `1 + weight`; biases 0), from a
/// generator seeded by `seed`. In memory they load with [`super::build`] (or
/// [`crate::decoder::build`]) through a `TensorMap`.
pub fn random_weights<C: ToDecoderSpec + ?Sized>(
    cfg: &C,
    seed: u64,
) -> Result<Vec<(String, Tensor)>> {
    let spec = cfg.decoder_spec()?;
    let norm_weight = match spec.norm {
        NormStyle::Weight => 1.0,
        NormStyle::UnitOffset => 0.0,
    };
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    let a = 0.02 * 3f32.sqrt();
    let mut tensors = Vec::new();
    for (name, shape) in spec.parameter_shapes() {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![norm_weight; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            (0..n).map(|_| (2.0 * next() - 1.0) * a).collect()
        };
        tensors.push((name, Tensor::from_vec(values, shape, &Device::Cpu)?));
    }
    tensors.sort_by(|x, y| x.0.cmp(&y.0));
    Ok(tensors)
}
