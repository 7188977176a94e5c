//! Mistral (`MistralForCausalLM`): LLaMA's decoder with every layer's attention windowed to
//! `sliding_window` tokens (`null`: global attention, as in Mistral 7B v0.2 and later; absent:
//! 4096, transformers' default).

use std::path::Path;

use serde::Deserialize;

use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// `config.json` of `MistralForCausalLM`.
#[derive(Debug, Clone, Deserialize)]
pub struct MistralConfig {
    #[serde(flatten)]
    pub base: LlamaConfig,
    /// Absent: transformers' default, 4096; `null`: no window.
    #[serde(default = "default_sliding_window")]
    pub sliding_window: Option<usize>,
}

fn default_sliding_window() -> Option<usize> {
    Some(4096)
}

impl MistralConfig {
    /// Parses and validates a config; `path` names it in errors.
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid Mistral config.json: {e}")))?;
        cfg.base
            .check_names(path, "MistralForCausalLM", "mistral")?;
        cfg.base.check_activation(path, "silu")?;
        cfg.base.validate_common(path)?;
        if cfg.sliding_window == Some(0) {
            return Err(Error::config(path, "`sliding_window` must be positive"));
        }
        Ok(cfg)
    }
}

impl ToDecoderSpec for MistralConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        let mut spec = self.base.base_spec("mistral", Path::new("config.json"))?;
        for layer in &mut spec.layers {
            layer.window = self.sliding_window;
        }
        Ok(spec)
    }
}

impl DecoderConfig for MistralConfig {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Self::parse(text, path)
    }

    fn base(&self) -> &LlamaConfig {
        &self.base
    }
}

/// `MistralForCausalLM` (Mistral 7B, Mistral NeMo, Ministral's global-attention configs).
pub static MISTRAL: Family = Family {
    name: "mistral",
    kind: Kind::CausalLm,
    architectures: &["MistralForCausalLM"],
    model_types: &["mistral"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<MistralConfig>,
    load_causal_lm: Some(crate::decoder::load_family::<MistralConfig>),
};
