//! LLaMA `config.json`, with both the transformers v4 keys (`rope_theta`, `rope_scaling`,
//! `torch_dtype`) and the v5 keys (`rope_parameters`, `dtype`, explicit `head_dim`); the RoPE
//! keys are read by [`crate::rope`].

use std::path::Path;

use candle_core::DType;
use candle_parallel::nn::Activation;
use candle_parallel::ops::RopeScaling;
use serde::Deserialize;

use crate::decoder::{DecoderConfig, DecoderSpec, LayerSpec, NormStyle, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::Description;
use crate::rope::{RopeFields, RopeSpec};

/// `config.json` as Hugging Face writes it (the fields LLaMA-family models use).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// v5 (and some v4 models): explicit head_dim, possibly != hidden / heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// v4: top-level rope base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// v4: `{"type"|"rope_type": "linear"|"llama3"|..., "factor": ...}`.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// v5: `{"rope_theta": ..., "rope_type": ..., scaling fields}`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// A top-level pre-scaling context length (overrides the one of `rope_scaling` /
    /// `rope_parameters`, as in transformers).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Rotation of part of each head: transformers' `LlamaForCausalLM` rotates whole heads, so
    /// only 1 is accepted.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// v4 name of the stored dtype.
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// v5 name of the stored dtype.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Dropout on the attention probabilities: only 0 is supported (training runs without
    /// dropout; every family's configs read it).
    #[serde(default)]
    pub attention_dropout: Option<f64>,
    /// A quantized checkpoint's settings (bitsandbytes, GPTQ, AWQ, ...): not supported.
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_max_pos() -> usize {
    2048
}

impl LlamaConfig {
    /// Reads and validates `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses and validates a config; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid LLaMA config.json: {e}")))?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        self.check_names(path, "LlamaForCausalLM", "llama")?;
        self.check_activation(path, "silu")?;
        self.validate_common(path)?;
        self.rope(path)?;
        Ok(())
    }

    /// Fails unless `architectures` (when given) names only `architecture` and `model_type`
    /// (when given) is `model_type`.
    pub fn check_names(&self, path: &Path, architecture: &str, model_type: &str) -> Result<()> {
        if let Some(archs) = &self.architectures {
            if let Some(a) = archs.iter().find(|a| a.as_str() != architecture) {
                return Err(Error::config(
                    path,
                    format!("unsupported architecture `{a}` (supported: {architecture})"),
                ));
            }
        }
        if let Some(t) = &self.model_type {
            if t != model_type {
                return Err(Error::config(
                    path,
                    format!("unsupported model_type `{t}` (supported: {model_type})"),
                ));
            }
        }
        Ok(())
    }

    /// Fails unless `hidden_act` (when given) is `act`.
    pub fn check_activation(&self, path: &Path, act: &str) -> Result<()> {
        match &self.hidden_act {
            Some(a) if a != act => Err(Error::config(
                path,
                format!("unsupported hidden_act `{a}` (supported: {act})"),
            )),
            _ => Ok(()),
        }
    }

    /// The checks every family sharing these fields needs: positive sizes, heads that divide,
    /// an even head_dim, a positive eps, no attention dropout, no quantization and a dtype
    /// this crate reads (the RoPE keys are
    /// checked when the family builds its spec: some read them per layer type).
    pub fn validate_common(&self, path: &Path) -> Result<()> {
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
            ("head_dim", self.head_dim()),
            ("num_key_value_heads", self.num_kv_heads()),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return Err(Error::config(path, format!("`{k}` must be positive")));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(Error::config(
                path,
                format!(
                    "hidden_size {} is not divisible by num_attention_heads {} and no head_dim is given",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(Error::config(
                path,
                format!(
                    "head_dim {} must be even (rotary embeddings)",
                    self.head_dim()
                ),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(Error::config(
                path,
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads,
                    self.num_kv_heads()
                ),
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(Error::config(path, "`rms_norm_eps` must be positive"));
        }
        if let Some(p) = self.attention_dropout.filter(|&p| p != 0.0) {
            return Err(Error::config(
                path,
                format!("`attention_dropout` {p} is not supported (training runs without dropout)"),
            ));
        }
        if let Some(q) = self.quantization_config.as_ref().filter(|q| !q.is_null()) {
            let method = q
                .get("quant_method")
                .and_then(|m| m.as_str())
                .unwrap_or("?");
            // transformers dequantizes a GGUF file when it loads it: a directory it saved from
            // one holds plain tensors under this note.
            if method != "gguf" {
                return Err(Error::config(
                    path,
                    format!(
                    "`quantization_config` ({method}): quantized checkpoints are not supported; \
                     load the unquantized (or dequantized) weights"
                ),
                ));
            }
        }
        self.stored_dtype(path)?;
        Ok(())
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The RoPE keys of this config (see [`crate::rope`]).
    pub fn rope_fields(&self) -> RopeFields<'_> {
        RopeFields {
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.as_ref(),
            rope_parameters: self.rope_parameters.as_ref(),
            original_max_position_embeddings: self.original_max_position_embeddings,
            partial_rotary_factor: self.partial_rotary_factor,
            ..RopeFields::new(self.head_dim(), self.max_position_embeddings)
        }
    }

    /// The rotary embeddings of the attention layers, from whichever keys the file uses (see
    /// [`crate::rope`]; theta defaults to 10000). Every RoPE type of transformers; whole heads
    /// only (`partial_rotary_factor` other than 1 is refused: transformers' LLaMA cannot apply
    /// it).
    pub fn rope_spec(&self, path: &Path) -> Result<RopeSpec> {
        let spec = self.rope_fields().resolve(path)?;
        if spec.dim != spec.head_dim {
            return Err(Error::config(
                path,
                format!(
                    "`partial_rotary_factor` {:?}: LLaMA rotates whole heads (transformers' \
                     LlamaForCausalLM does not apply a partial rotation)",
                    self.partial_rotary_factor
                ),
            ));
        }
        Ok(spec)
    }

    /// `(theta, scaling)` of the rotary embeddings (see [`LlamaConfig::rope_spec`]).
    pub fn rope(&self, path: &Path) -> Result<(f64, RopeScaling)> {
        let spec = self.rope_spec(path)?;
        Ok((spec.theta, spec.scaling))
    }

    /// The dtype the checkpoint declares (`dtype`, else `torch_dtype`), if any.
    pub fn stored_dtype(&self, path: &Path) -> Result<Option<DType>> {
        let Some(name) = self.dtype.as_ref().or(self.torch_dtype.as_ref()) else {
            return Ok(None);
        };
        parse_dtype(name)
            .map(Some)
            .ok_or_else(|| Error::config(path, format!("unsupported dtype `{name}`")))
    }

    /// The decoder these fields describe with LLaMA's choices (RMSNorm, SwiGLU,
    /// `attention_bias` on all four projections, every layer global with one RoPE): the base
    /// other families change. `family` names the family in errors.
    pub fn base_spec(&self, family: &'static str, path: &Path) -> Result<DecoderSpec> {
        self.base_spec_with_rope(family, self.rope_spec(path)?.embedding()?)
    }

    /// [`LlamaConfig::base_spec`] with every layer's rotary embedding `rope` (a family that
    /// reads its RoPE keys another way: Gemma 3's per-layer types).
    pub fn base_spec_with_rope(
        &self,
        family: &'static str,
        rope: candle_parallel::ops::RotaryEmbedding,
    ) -> Result<DecoderSpec> {
        Ok(DecoderSpec {
            family,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_kv_heads(),
            head_dim: self.head_dim(),
            norm_eps: self.rms_norm_eps,
            norm: NormStyle::Weight,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: false,
            activation: Activation::SwiGlu,
            sandwich_norms: false,
            embed_scale: None,
            attn_scale: 1.0 / (self.head_dim() as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            tie_word_embeddings: self.tie_word_embeddings,
            fused_projections: false,
            moe: None,
            layers: vec![LayerSpec { window: None, rope }; self.num_hidden_layers],
        })
    }
}

impl LlamaConfig {
    /// Size and FLOPs terms of this model ([`Description`]).
    pub fn description(&self) -> Result<Description> {
        Ok(self.decoder_spec()?.description())
    }
}

impl DecoderConfig for LlamaConfig {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        LlamaConfig::from_json(text, path)
    }

    fn base(&self) -> &LlamaConfig {
        self
    }
}

impl ToDecoderSpec for LlamaConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.base_spec("llama", Path::new("config.json"))
    }
}

/// `"float32"`, `"bfloat16"`, `"float16"` (also `f32`, `bf16`, `f16`).
pub fn parse_dtype(name: &str) -> Option<DType> {
    match name.trim().to_ascii_lowercase().as_str() {
        "float32" | "f32" | "fp32" | "torch.float32" => Some(DType::F32),
        "bfloat16" | "bf16" | "torch.bfloat16" => Some(DType::BF16),
        "float16" | "f16" | "fp16" | "half" | "torch.float16" => Some(DType::F16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner's parameter count is the checkpoint's, tied or not, with GQA and an explicit
    /// head_dim.
    #[test]
    fn planner_shape_counts_the_parameters() {
        for tied in [false, true] {
            let text = format!(
                r#"{{"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
                    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12,
                    "vocab_size": 50, "rms_norm_eps": 1e-6, "tie_word_embeddings": {tied}}}"#
            );
            let cfg = LlamaConfig::from_json(&text, Path::new("planner")).unwrap();
            let spec = cfg.decoder_spec().unwrap();
            let shape = spec.planner_shape();
            assert_eq!(
                shape.params() as usize,
                spec.num_parameters(),
                "tied {tied}"
            );
            assert_eq!((shape.head_dim, shape.kv_heads), (12, 2));
        }
    }
}
