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

/// transformers 4 writes each sub-config as its difference from the class defaults (e.g.
/// llava-1.5's `text_config` holds little more than `vocab_size`): the defaults of
/// transformers' `LlamaConfig`, `CLIPVisionConfig` and `SiglipVisionConfig` are filled in where a
/// field is absent, and the top-level `dtype` stands for the text model's when it has none.
fn fill_defaults(v: &mut serde_json::Value) {
    use serde_json::json;
    let Some(root) = v.as_object_mut() else {
        return;
    };
    // `image_token_index` and `image_token_id` name the same field.
    if root.contains_key("image_token_id") {
        root.remove("image_token_index");
    }
    let dtype = root
        .get("dtype")
        .or_else(|| root.get("torch_dtype"))
        .cloned();
    let text = root.entry("text_config").or_insert_with(|| json!({}));
    if let Some(t) = text.as_object_mut() {
        let heads = t.get("num_attention_heads").cloned().unwrap_or(json!(32));
        for (k, d) in [
            ("model_type", json!("llama")),
            ("vocab_size", json!(32000)),
            ("hidden_size", json!(4096)),
            ("intermediate_size", json!(11008)),
            ("num_hidden_layers", json!(32)),
            ("num_attention_heads", json!(32)),
            ("num_key_value_heads", heads),
            ("rms_norm_eps", json!(1e-6)),
            ("max_position_embeddings", json!(2048)),
            ("hidden_act", json!("silu")),
        ] {
            t.entry(k).or_insert(d);
        }
        if let Some(d) = dtype {
            if !t.contains_key("dtype") && !t.contains_key("torch_dtype") {
                t.insert("dtype".into(), d);
            }
        }
    }
    let vision = root.entry("vision_config").or_insert_with(|| json!({}));
    if let Some(t) = vision.as_object_mut() {
        let siglip = t
            .get("model_type")
            .and_then(|m| m.as_str())
            .is_some_and(|m| m.starts_with("siglip"));
        t.entry("model_type").or_insert(json!("clip_vision_model"));
        for (k, d) in [
            ("hidden_size", json!(768)),
            ("intermediate_size", json!(3072)),
            ("num_hidden_layers", json!(12)),
            ("num_attention_heads", json!(12)),
            ("image_size", json!(224)),
            ("patch_size", json!(if siglip { 16 } else { 32 })),
        ] {
            t.entry(k).or_insert(d);
        }
    }
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
    /// Image tokens an image fills: the tower's patches (and CLIP's class token), less the
    /// class token under the `default` feature strategy. Errors name an unknown tower.
    pub fn tokens_per_image(&self) -> Result<usize> {
        let v = &self.vision_config;
        let clip = v.kind("vision_config")? == crate::vision::TowerKind::Clip;
        let n = v.num_patches() + usize::from(clip);
        Ok(if self.vision_feature_select_strategy == "default" {
            n - 1
        } else {
            n
        })
    }

    /// Model FLOPs of one image through the vision tower and the projector, for MFU
    /// (`2 N T` for the matrices over the image's tokens, `4 d T²` for each layer's full
    /// attention, as [`crate::family::Description::flops_per_token`] counts a text token). The
    /// tower runs the patch embedding and the layers up to the deepest feature layer; the
    /// projector maps the [`Self::tokens_per_image`] features. A training step: the projector
    /// always trains (three times its forward); a trained tower three times its forward, a
    /// frozen one its forward only (no gradient is needed below the projector then).
    pub fn vision_training_flops_per_image(&self, tower_trains: bool) -> Result<f64> {
        let v = &self.vision_config;
        let clip = v.kind("vision_config")? == crate::vision::TowerKind::Clip;
        let (d, inter) = (v.hidden_size as f64, v.intermediate_size as f64);
        let patches = v.num_patches() as f64;
        let tokens = patches + f64::from(u8::from(clip));
        let indices = self.vision_feature_layer.indices(v.num_hidden_layers)?;
        let layers = indices.iter().copied().max().unwrap_or(0) as f64;
        let patch_embed = 2.0 * d * (v.num_channels * v.patch_size * v.patch_size) as f64 * patches;
        let per_layer = 2.0 * (4.0 * d * d + 2.0 * d * inter) * tokens + 4.0 * d * tokens * tokens;
        let tower = patch_embed + layers * per_layer;
        let features = d * indices.len() as f64;
        let h = self.text().hidden_size as f64;
        let projector = 2.0 * (features * h + h * h) * self.tokens_per_image()? as f64;
        Ok(if tower_trains {
            3.0 * (tower + projector)
        } else {
            tower + 3.0 * projector
        })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        fill_defaults(&mut v);
        let mut cfg: Self = serde_json::from_value(v)
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
