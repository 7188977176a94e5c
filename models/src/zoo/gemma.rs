//! Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`): LLaMA's
//! decoder with `(1 + w)` RMSNorms in f32, four norms per layer (the attention's and the MLP's
//! outputs normed before their residual add), GeGLU (`gelu_pytorch_tanh`), embeddings scaled by
//! `sqrt(hidden_size)` (rounded to f32, then to the embeddings' dtype, as transformers does),
//! the softmax scale `query_pre_attn_scalar ** -0.5`, and sliding-window layers alternating
//! with global ones (`layer_types`; by default every other layer in Gemma 2, five of every six
//! in Gemma 3, `sliding_window_pattern`).
//!
//! Gemma 2 soft-caps the attention logits (`attn_logit_softcapping`, 50 when absent) and the
//! final logits (`final_logit_softcapping`, 30 when absent); Gemma 3 norms q and k per head
//! instead, and soft-caps the final logits only when its config sets the cap.

use std::path::Path;

use candle_parallel::nn::Activation;
use serde::Deserialize;

use crate::decoder::spec::{sliding_layers, FULL_ATTENTION, SLIDING_ATTENTION};
use crate::decoder::{DecoderConfig, DecoderSpec, NormStyle, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// Which Gemma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    Gemma2,
    Gemma3,
}

/// `config.json` of `Gemma2ForCausalLM` and of Gemma 3's text model.
#[derive(Debug, Clone, Deserialize)]
pub struct GemmaConfig {
    #[serde(flatten)]
    pub base: LlamaConfig,
    /// Gemma ties its head to the embedding unless the config says otherwise.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default = "default_query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f64,
    #[serde(default = "default_sliding_window")]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3 configs on the Hub (before `layer_types`): one global layer every this many.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Absent: the generation's default (Gemma 2: 30, Gemma 3: none); `null`: none.
    #[serde(default, deserialize_with = "present")]
    pub final_logit_softcapping: Option<Option<f64>>,
    /// Absent: the generation's default (Gemma 2: 50, Gemma 3: none); `null`: none.
    #[serde(default, deserialize_with = "present")]
    pub attn_logit_softcapping: Option<Option<f64>>,
    #[serde(default)]
    pub use_bidirectional_attention: Option<bool>,
    /// Gemma 3's RoPE base of sliding layers in the Hub's (v4) spelling.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    #[serde(skip)]
    pub generation: Option<Generation>,
}

fn default_query_pre_attn_scalar() -> f64 {
    256.0
}

fn default_sliding_window() -> Option<usize> {
    Some(4096)
}

/// A field that is present (`Some`, holding `None` for `null`), as opposed to absent (`None`
/// through `#[serde(default)]`), so that an absent field takes transformers' default and
/// `null` does not.
fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

impl GemmaConfig {
    /// Parses and validates a config; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path, generation: Generation) -> Result<Self> {
        let mut cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid Gemma config.json: {e}")))?;
        cfg.generation = Some(generation);
        let (arch, model_type) = match generation {
            Generation::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
            Generation::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        };
        cfg.base.check_names(path, arch, model_type)?;
        cfg.base.check_activation(path, "gelu_pytorch_tanh")?;
        if let Some(a) = cfg
            .hidden_activation
            .as_deref()
            .filter(|a| *a != "gelu_pytorch_tanh")
        {
            return Err(Error::config(
                path,
                format!("unsupported hidden_activation `{a}` (supported: gelu_pytorch_tanh)"),
            ));
        }
        if cfg.use_bidirectional_attention == Some(true) {
            return Err(Error::config(
                path,
                "`use_bidirectional_attention: true` (an encoder variant) is not supported",
            ));
        }
        if !(cfg.query_pre_attn_scalar.is_finite() && cfg.query_pre_attn_scalar > 0.0) {
            return Err(Error::config(
                path,
                "`query_pre_attn_scalar` must be positive",
            ));
        }
        for (name, cap) in [
            ("attn_logit_softcapping", cfg.attn_cap()),
            ("final_logit_softcapping", cfg.final_cap()),
        ] {
            if cap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
                return Err(Error::config(path, format!("`{name}` must be positive")));
            }
        }
        if cfg.sliding_window == Some(0) || cfg.sliding_window_pattern == Some(0) {
            return Err(Error::config(
                path,
                "`sliding_window` and `sliding_window_pattern` must be positive",
            ));
        }
        cfg.base.validate_common(path)?;
        cfg.spec(path)?;
        Ok(cfg)
    }

    fn generation(&self) -> Generation {
        self.generation.unwrap_or(Generation::Gemma2)
    }

    /// The attention-logit soft-cap: the config's, else transformers' default (Gemma 2: 50).
    fn attn_cap(&self) -> Option<f64> {
        self.attn_logit_softcapping
            .unwrap_or(match self.generation() {
                Generation::Gemma2 => Some(50.0),
                Generation::Gemma3 => None,
            })
    }

    /// The final-logit soft-cap: the config's, else transformers' default (Gemma 2: 30).
    fn final_cap(&self) -> Option<f64> {
        self.final_logit_softcapping
            .unwrap_or(match self.generation() {
                Generation::Gemma2 => Some(30.0),
                Generation::Gemma3 => None,
            })
    }

    fn spec(&self, path: &Path) -> Result<DecoderSpec> {
        let generation = self.generation();
        let mut spec = match generation {
            Generation::Gemma2 => self.base.base_spec("gemma2", path)?,
            // Each layer type has its own RoPE (set below); global layers' to start with.
            Generation::Gemma3 => self
                .base
                .base_spec_with_rope("gemma3", self.layer_rope(FULL_ATTENTION, path)?)?,
        };
        spec.norm = NormStyle::UnitOffset;
        spec.activation = Activation::GeGluTanh;
        spec.sandwich_norms = true;
        spec.tie_word_embeddings = self.tie_word_embeddings.unwrap_or(true);
        // transformers keeps sqrt(hidden) in an f32 buffer and casts it to the weights' dtype.
        spec.embed_scale = Some((self.base.hidden_size as f64).sqrt() as f32 as f64);
        spec.attn_scale = self.query_pre_attn_scalar.powf(-0.5) as f32;
        let every = match generation {
            Generation::Gemma2 => 2,
            Generation::Gemma3 => self.sliding_window_pattern.unwrap_or(6),
        };
        let sliding = sliding_layers(
            self.layer_types.as_deref(),
            |i| !(i + 1).is_multiple_of(every),
            spec.num_layers(),
            path,
        )?;
        for (layer, s) in spec.layers.iter_mut().zip(sliding) {
            layer.window = self.sliding_window.filter(|_| s);
            if generation == Generation::Gemma3 {
                // Each layer type its own RoPE (per-layer-type parameters, or the v4 keys).
                let kind = if s { SLIDING_ATTENTION } else { FULL_ATTENTION };
                layer.rope = self.layer_rope(kind, path)?;
            }
        }
        spec.final_softcap = self.final_cap().map(|c| c as f32);
        match generation {
            Generation::Gemma2 => spec.attn_softcap = self.attn_cap().map(|c| c as f32),
            Generation::Gemma3 => {
                spec.qk_norm = true;
                if self.attn_cap().is_some() {
                    return Err(Error::config(
                        path,
                        "Gemma 3 with `attn_logit_softcapping` set is not supported: \
                         transformers' Gemma 3 reads the field but never applies it, so a \
                         checkpoint trained with it is ambiguous; set it to null",
                    ));
                }
            }
        }
        Ok(spec)
    }
}

impl GemmaConfig {
    /// Gemma 3's rotary embedding of the layers of `kind` (`full_attention`,
    /// `sliding_attention`), from per-layer-type `rope_parameters` or the v4 keys.
    fn layer_rope(&self, kind: &str, path: &Path) -> Result<candle_parallel::ops::RotaryEmbedding> {
        self.base
            .rope_fields()
            .gemma3_layer(kind, self.rope_local_base_freq)
            .resolve(path)?
            .embedding()
    }
}

impl ToDecoderSpec for GemmaConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.spec(Path::new("config.json"))
    }
}

/// Gemma 2's config (the [`DecoderConfig`] of [`GEMMA2`]).
#[derive(Debug, Clone)]
pub struct Gemma2Config(pub GemmaConfig);

impl ToDecoderSpec for Gemma2Config {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.0.decoder_spec()
    }
}

impl DecoderConfig for Gemma2Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        GemmaConfig::from_json(text, path, Generation::Gemma2).map(Self)
    }

    fn base(&self) -> &LlamaConfig {
        &self.0.base
    }
}

/// `Gemma2ForCausalLM` (Gemma 2 2B, 9B, 27B).
pub static GEMMA2: Family = Family {
    name: "gemma2",
    kind: Kind::CausalLm,
    architectures: &["Gemma2ForCausalLM"],
    model_types: &["gemma2"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Gemma2Config>,
    load_causal_lm: Some(crate::decoder::load_family::<Gemma2Config>),
};

/// Gemma 3's text config (the [`DecoderConfig`] of [`GEMMA3`]).
#[derive(Debug, Clone)]
pub struct Gemma3Config(pub GemmaConfig);

impl ToDecoderSpec for Gemma3Config {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.0.decoder_spec()
    }
}

impl DecoderConfig for Gemma3Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        GemmaConfig::from_json(text, path, Generation::Gemma3).map(Self)
    }

    fn base(&self) -> &LlamaConfig {
        &self.0.base
    }
}

/// `Gemma3ForCausalLM` (Gemma 3 1B, and the text model of the larger ones).
pub static GEMMA3: Family = Family {
    name: "gemma3",
    kind: Kind::CausalLm,
    architectures: &["Gemma3ForCausalLM"],
    model_types: &["gemma3_text"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Gemma3Config>,
    load_causal_lm: Some(crate::decoder::load_family::<Gemma3Config>),
};
