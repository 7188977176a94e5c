//! Qwen3 (`Qwen3ForCausalLM`): Qwen2's fields and sliding-window rules, with a per-head RMSNorm
//! on q and k before RoPE (`q_norm`, `k_norm`), an explicit `head_dim`, and `attention_bias`
//! (default none) on all four projections as in LLaMA.

use std::path::Path;

use super::qwen2::Qwen2Config;
use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::Result;
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// `config.json` of `Qwen3ForCausalLM`: the fields of Qwen2's.
#[derive(Debug, Clone)]
pub struct Qwen3Config(pub Qwen2Config);

impl ToDecoderSpec for Qwen3Config {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        let mut spec = self.0.windowed_spec("qwen3", Path::new("config.json"))?;
        spec.qk_norm = true;
        Ok(spec)
    }
}

impl DecoderConfig for Qwen3Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Qwen2Config::parse_as(text, path, "Qwen3ForCausalLM", "qwen3").map(Self)
    }

    fn base(&self) -> &LlamaConfig {
        &self.0.base
    }
}

/// `Qwen3ForCausalLM` (dense Qwen3 models).
pub static QWEN3: Family = Family {
    name: "qwen3",
    kind: Kind::CausalLm,
    architectures: &["Qwen3ForCausalLM"],
    model_types: &["qwen3"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Qwen3Config>,
    load_causal_lm: Some(crate::decoder::load_family::<Qwen3Config>),
};
