//! Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): LLaMA's decoder (RMSNorm, SwiGLU, no
//! biases) whose checkpoint fuses q, k and v into `self_attn.qkv_proj` and gate and up into
//! `mlp.gate_up_proj` (split at load and fused back on save, see [`crate::decoder::fused`]),
//! with an optional partial rotation (`partial_rotary_factor`: Phi-4-mini's 0.75), LongRoPE
//! (`rope_scaling` type `longrope`, or the names Phi-3 configs first used, `su` and `yarn`,
//! which transformers reads as `longrope`) with a top-level `original_max_position_embeddings`,
//! and one sliding window on every layer (`sliding_window`; `null`: none).

use std::path::Path;

use candle_parallel::ops::{RopeScaling, RotaryEmbedding};
use serde::Deserialize;
use serde_json::Value;

use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;
use crate::rope::RopeFields;

/// `config.json` of `Phi3ForCausalLM`.
#[derive(Debug, Clone, Deserialize)]
pub struct Phi3Config {
    #[serde(flatten)]
    pub base: LlamaConfig,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub resid_pdrop: Option<f64>,
    #[serde(default)]
    pub embd_pdrop: Option<f64>,
}

/// The RoPE type names Phi-3 configs used before `longrope` (transformers' `Phi3Config` reads
/// both as `longrope`).
const LEGACY_LONGROPE: [&str; 2] = ["su", "yarn"];

/// `params` (a `rope_scaling` or `rope_parameters` object) with a legacy type name replaced by
/// `longrope`, as `Phi3Config.convert_rope_params_to_dict` does (`rope_type`, else `type`).
fn with_longrope_name(params: Option<&Value>) -> Option<Value> {
    let mut v = params?.clone();
    if let Some(obj) = v.as_object_mut() {
        let kind = obj
            .get("rope_type")
            .filter(|t| !t.is_null())
            .or_else(|| obj.get("type"))
            .and_then(Value::as_str);
        if kind.is_some_and(|k| LEGACY_LONGROPE.contains(&k)) {
            obj.insert("rope_type".into(), Value::String("longrope".into()));
        }
    }
    Some(v)
}

impl Phi3Config {
    /// Parses and validates a config; `path` names it in errors.
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid Phi-3 config.json: {e}")))?;
        cfg.base.check_names(path, "Phi3ForCausalLM", "phi3")?;
        cfg.base.check_activation(path, "silu")?;
        cfg.base.validate_common(path)?;
        // transformers' Phi-3 has no biases whatever these say: a config that sets them
        // describes another model.
        for (name, on) in [
            ("attention_bias", cfg.base.attention_bias),
            ("mlp_bias", cfg.base.mlp_bias),
        ] {
            if on {
                return Err(Error::config(
                    path,
                    format!("`{name}: true` is not supported (Phi-3 has no biases)"),
                ));
            }
        }
        for (name, p) in [
            ("resid_pdrop", cfg.resid_pdrop),
            ("embd_pdrop", cfg.embd_pdrop),
        ] {
            if let Some(p) = p.filter(|&p| p != 0.0) {
                return Err(Error::config(
                    path,
                    format!("`{name}` {p} is not supported (training runs without dropout)"),
                ));
            }
        }
        if cfg.sliding_window == Some(0) {
            return Err(Error::config(path, "`sliding_window` must be positive"));
        }
        cfg.spec(path)?;
        Ok(cfg)
    }

    /// The rotary embedding: `default` or `longrope` (transformers' `Phi3Config` refuses the
    /// other types), partial rotation allowed.
    fn rope(&self, path: &Path) -> Result<RotaryEmbedding> {
        let scaling = with_longrope_name(self.base.rope_scaling.as_ref());
        let parameters = with_longrope_name(self.base.rope_parameters.as_ref());
        let fields = RopeFields {
            rope_scaling: scaling.as_ref(),
            rope_parameters: parameters.as_ref(),
            ..self.base.rope_fields()
        };
        let spec = fields.resolve(path)?;
        match spec.scaling {
            RopeScaling::Default | RopeScaling::LongRope { .. } => spec.embedding(),
            other => Err(Error::config(
                path,
                format!(
                    "`rope_scaling` / `rope_parameters`: Phi-3 takes RoPE type `default` or \
                     `longrope` (also spelled `su`, `yarn`), not {other:?}"
                ),
            )),
        }
    }

    fn spec(&self, path: &Path) -> Result<DecoderSpec> {
        let mut spec = self.base.base_spec_with_rope("phi3", self.rope(path)?)?;
        spec.fused_projections = true;
        for layer in &mut spec.layers {
            layer.window = self.sliding_window;
        }
        Ok(spec)
    }
}

impl ToDecoderSpec for Phi3Config {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.spec(Path::new("config.json"))
    }
}

impl DecoderConfig for Phi3Config {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Self::parse(text, path)
    }

    fn base(&self) -> &LlamaConfig {
        &self.base
    }
}

/// `Phi3ForCausalLM` (Phi-3 mini and medium, Phi-3.5-mini, Phi-4-mini).
pub static PHI3: Family = Family {
    name: "phi3",
    kind: Kind::CausalLm,
    architectures: &["Phi3ForCausalLM"],
    model_types: &["phi3"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Phi3Config>,
    load_causal_lm: Some(crate::decoder::load_family::<Phi3Config>),
};

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: serde_json::Value) -> String {
        let mut v = serde_json::json!({
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 256,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v.to_string()
    }

    fn parse(extra: serde_json::Value) -> Result<Phi3Config> {
        Phi3Config::parse(&config(extra), Path::new("phi/config.json"))
    }

    #[test]
    fn legacy_longrope_names_read_as_longrope() {
        for kind in ["su", "yarn", "longrope"] {
            let cfg = parse(serde_json::json!({
                "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": kind, "short_factor": [1.0, 1.5],
                                 "long_factor": [2.0, 4.0]},
            }))
            .unwrap();
            let spec = cfg.decoder_spec().unwrap();
            assert!(spec.fused_projections);
            assert!(
                format!("{:?}", spec.layers[0].rope).contains("LongRope"),
                "{kind}"
            );
        }
    }

    #[test]
    fn unsupported_fields_are_named() {
        for (extra, field) in [
            (
                serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
                "rope_scaling",
            ),
            (
                serde_json::json!({"attention_bias": true}),
                "attention_bias",
            ),
            (serde_json::json!({"resid_pdrop": 0.1}), "resid_pdrop"),
            (serde_json::json!({"sliding_window": 0}), "sliding_window"),
            (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
            (
                serde_json::json!({"partial_rotary_factor": 1.5}),
                "partial_rotary_factor",
            ),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains("phi/config.json"),
                "{field}: {e}"
            );
        }
        assert!(parse(serde_json::json!({"sliding_window": null, "resid_pdrop": 0.0})).is_ok());
    }
}
