//! Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): LLaMA's decoder with biases on q, k and v (not on the
//! output projection) and, where the config asks for it, sliding windows on the upper layers.
//!
//! Windows follow transformers: `use_sliding_window: false` means no window whatever
//! `sliding_window` says (Qwen2.5's configs ship so); when on, `layer_types` (written by
//! transformers 5) decides, else layers from `max_window_layers` up are windowed.

use std::path::Path;

use serde::Deserialize;

use crate::decoder::spec::sliding_layers;
use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// `config.json` of `Qwen2ForCausalLM`: LLaMA's fields plus [`QwenWindows`].
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Config {
    #[serde(flatten)]
    pub base: LlamaConfig,
    #[serde(flatten)]
    pub windows: QwenWindows,
}

/// The sliding-window fields Qwen2, Qwen2.5 and Qwen3 configs share.
#[derive(Debug, Clone, Deserialize)]
pub struct QwenWindows {
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default = "default_max_window_layers")]
    pub max_window_layers: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

fn default_max_window_layers() -> usize {
    28
}

impl QwenWindows {
    /// Each layer's window, as transformers' `Qwen2Config` resolves it.
    pub fn windows(&self, layers: usize, path: &Path) -> Result<Vec<Option<usize>>> {
        let window = self.sliding_window.filter(|_| self.use_sliding_window);
        if window == Some(0) {
            return Err(Error::config(path, "`sliding_window` must be positive"));
        }
        let sliding = sliding_layers(
            self.layer_types.as_deref(),
            |i| window.is_some() && i >= self.max_window_layers,
            layers,
            path,
        )?;
        Ok(sliding.into_iter().map(|s| window.filter(|_| s)).collect())
    }
}

impl Qwen2Config {
    /// Parses and validates a config of `architecture` / `model_type` (Qwen3's config has the
    /// same fields); `path` names it in errors.
    pub(crate) fn parse_as(
        text: &str,
        path: &Path,
        architecture: &str,
        model_type: &'static str,
    ) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| {
            Error::config(path, format!("not a valid {architecture} config.json: {e}"))
        })?;
        cfg.base.check_names(path, architecture, model_type)?;
        cfg.base.check_activation(path, "silu")?;
        cfg.base.validate_common(path)?;
        cfg.windowed_spec(model_type, path)?;
        Ok(cfg)
    }

    /// LLaMA's decoder of these fields with Qwen's windows; `family` names it in errors.
    pub(crate) fn windowed_spec(&self, family: &'static str, path: &Path) -> Result<DecoderSpec> {
        let mut spec = self.base.base_spec(family, path)?;
        let windows = self.windows.windows(spec.num_layers(), path)?;
        for (layer, window) in spec.layers.iter_mut().zip(windows) {
            layer.window = window;
        }
        Ok(spec)
    }
}

impl ToDecoderSpec for Qwen2Config {
    /// Biases on q, k and v, none on the output projection.
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        let mut spec = self.windowed_spec("qwen2", Path::new("config.json"))?;
        (spec.qkv_bias, spec.o_bias) = (true, false);
        Ok(spec)
    }
}

impl DecoderConfig for Qwen2Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Self::parse_as(text, path, "Qwen2ForCausalLM", "qwen2")
    }

    fn base(&self) -> &LlamaConfig {
        &self.base
    }
}

/// `Qwen2ForCausalLM` (Qwen2, Qwen2.5, their Instruct and 1M-context variants).
pub static QWEN2: Family = Family {
    name: "qwen2",
    kind: Kind::CausalLm,
    architectures: &["Qwen2ForCausalLM"],
    model_types: &["qwen2"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Qwen2Config>,
    load_causal_lm: Some(crate::decoder::load_family::<Qwen2Config>),
};
