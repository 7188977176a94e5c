//! Qwen3 (`Qwen3ForCausalLM`): LLaMA's decoder with a per-head RMSNorm on q and k before RoPE
//! (`q_norm`, `k_norm`), an explicit `head_dim`, and Qwen2's sliding-window rules.

use std::path::Path;

use serde::Deserialize;

use super::qwen2::QwenWindows;
use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// `config.json` of `Qwen3ForCausalLM`.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3Config {
    #[serde(flatten)]
    pub base: LlamaConfig,
    #[serde(flatten)]
    pub windows: QwenWindows,
}

impl Qwen3Config {
    /// Parses and validates a config; `path` names it in errors.
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid Qwen3 config.json: {e}")))?;
        cfg.base.check_names(path, "Qwen3ForCausalLM", "qwen3")?;
        cfg.base.check_activation(path, "silu")?;
        cfg.base.validate_common(path)?;
        cfg.spec(path)?;
        Ok(cfg)
    }

    fn spec(&self, path: &Path) -> Result<DecoderSpec> {
        let mut spec = self.base.base_spec("qwen3", path)?;
        spec.qk_norm = true;
        let windows = self.windows.windows(spec.num_layers(), path)?;
        for (layer, window) in spec.layers.iter_mut().zip(windows) {
            layer.window = window;
        }
        Ok(spec)
    }
}

impl ToDecoderSpec for Qwen3Config {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.spec(Path::new("config.json"))
    }
}

impl DecoderConfig for Qwen3Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Self::parse(text, path)
    }

    fn base(&self) -> &LlamaConfig {
        &self.base
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
