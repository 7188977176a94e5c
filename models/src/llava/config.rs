//! `config.json` of transformers' `LlavaForConditionalGeneration`.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::llama::LlamaConfig;
use crate::vision::VisionConfig;

/// `vision_feature_layer`: one hidden state of the vision tower, or several concatenated.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum FeatureLayer {
    One(i64),
    Many(Vec<i64>),
}

impl Default for FeatureLayer {
    fn default() -> Self {
        Self::One(-2)
    }
}

impl FeatureLayer {
    /// The hidden-state indices (0: embeddings, i: layer i's output) of a tower of `layers`.
    pub fn indices(&self, layers: usize) -> Result<Vec<usize>> {
        let all = match self {
            Self::One(l) => vec![*l],
            Self::Many(v) => v.clone(),
        };
        if all.is_empty() {
            return Err(Error::Invalid(
                "vision_feature_layer is an empty list".into(),
            ));
        }
        all.into_iter()
            .map(|l| {
                let i = if l < 0 { layers as i64 + 1 + l } else { l };
                if i < 0 || i > layers as i64 {
                    Err(Error::Invalid(format!(
                        "vision_feature_layer {l} of a vision tower with {layers} layers"
                    )))
                } else {
                    Ok(i as usize)
                }
            })
            .collect()
    }
}

/// The fields of a LLaVA `config.json` the model reads.
#[derive(Debug, Clone, Deserialize)]
pub struct LlavaConfig {
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub text_config: serde_json::Value,
    pub vision_config: VisionConfig,
    /// `image_token_id` (transformers 5) or `image_token_index` (earlier).
    #[serde(default, alias = "image_token_index")]
    pub image_token_id: Option<u32>,
    #[serde(default = "gelu")]
    pub projector_hidden_act: String,
    #[serde(default)]
    pub vision_feature_layer: FeatureLayer,
    #[serde(default = "default_strategy")]
    pub vision_feature_select_strategy: String,
    #[serde(default = "yes")]
    pub multimodal_projector_bias: bool,
    /// The parsed `text_config`.
    #[serde(skip)]
    pub text: Option<LlamaConfig>,
}

fn gelu() -> String {
    "gelu".into()
}

fn default_strategy() -> String {
    "default".into()
}

fn yes() -> bool {
    true
}

impl LlavaConfig {
    /// Whether `text` (a config.json) describes a LLaVA model.
    pub fn is_llava(text: &str) -> bool {
        serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .is_some_and(|v| {
                v["model_type"] == "llava"
                    || v["architectures"]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|x| x == "LlavaForConditionalGeneration"))
            })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut cfg: Self = serde_json::from_str(&text)
            .map_err(|e| Error::config(path, format!("not a valid LLaVA config.json: {e}")))?;
        if let Some(a) = cfg
            .architectures
            .iter()
            .flatten()
            .find(|a| *a != "LlavaForConditionalGeneration")
        {
            return Err(Error::config(
                path,
                format!("architecture `{a}` is not LlavaForConditionalGeneration"),
            ));
        }
        let mut text_cfg = cfg.text_config.clone();
        if let Some(o) = text_cfg.as_object_mut() {
            o.remove("architectures");
            o.entry("model_type").or_insert("llama".into());
        }
        let text = LlamaConfig::from_json(&text_cfg.to_string(), path)
            .map_err(|e| Error::config(path, format!("text_config: {e}")))?;
        cfg.vision_config.kind(&path.display().to_string())?;
        if cfg.image_token_id.is_none() {
            return Err(Error::config(
                path,
                "has no image_token_id (or image_token_index)",
            ));
        }
        if !["default", "full"].contains(&cfg.vision_feature_select_strategy.as_str()) {
            return Err(Error::config(
                path,
                format!(
                    "vision_feature_select_strategy {:?} (supported: default, full)",
                    cfg.vision_feature_select_strategy
                ),
            ));
        }
        if !["gelu", "gelu_pytorch_tanh", "quick_gelu"].contains(&cfg.projector_hidden_act.as_str())
        {
            return Err(Error::config(
                path,
                format!(
                    "projector_hidden_act {:?} is not supported",
                    cfg.projector_hidden_act
                ),
            ));
        }
        cfg.vision_config
            .validate()
            .map_err(|e| Error::config(path, e.to_string()))?;
        cfg.text = Some(text);
        Ok(cfg)
    }

    /// The parsed text model config.
    pub fn text(&self) -> &LlamaConfig {
        self.text.as_ref().expect("parsed by from_file")
    }

    pub fn image_token(&self) -> u32 {
        self.image_token_id.unwrap_or(0)
    }
}
