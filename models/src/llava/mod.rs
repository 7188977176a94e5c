//! LLaVA-style vision-language models: transformers' `LlavaForConditionalGeneration` (a CLIP
//! or SigLIP vision tower, a 2-layer projector, a LLaMA), loaded from and saved to its
//! checkpoints.
//!
//! Every key layout transformers has written is read ([`KeyLayout`]): transformers 5's
//! parameter names (`model.language_model.*`, `model.vision_tower.*`,
//! `model.multi_modal_projector.*`, `lm_head.weight`), what its `save_pretrained` writes
//! (`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*`,
//! `multi_modal_projector.*`) and transformers 4's (the same with `vision_tower.vision_model.*`).
//! Inside, the model names its parameters as the LLaMA and tower modules do
//! (`model.layers.0...`, `lm_head.weight`, `vision_tower.vision_model...`,
//! `multi_modal_projector...`); [`KeyLayout::stored`] maps them to a checkpoint's names, and
//! checkpoints are written in transformers 4's layout, which transformers 4 and 5 both read.

pub mod config;
pub mod model;
pub mod pipeline;
pub mod preprocess;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::nn::{ParallelCtx, ParamBuilder, ParamList, ParamMode, Shard, TensorSource};

pub use config::{FeatureLayer, LlavaConfig};
pub use model::{Freeze, Llava, Projector};
pub use pipeline::{LlavaMicroBatch, LlavaStages};

use crate::checkpoint::CheckpointReader;
use crate::error::{Error, Result};
use crate::hub::ModelFiles;

/// How a LLaVA checkpoint names its tensors (the model's own names are the LLaMA's `model.*`
/// and `lm_head.weight`, `vision_tower.vision_model.*` and `multi_modal_projector.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLayout {
    /// What transformers 5 `save_pretrained` writes: `language_model.model.*`,
    /// `language_model.lm_head.weight`, `vision_tower.*` (no `vision_model.` level),
    /// `multi_modal_projector.*`. Checkpoints are written in this layout.
    Saved,
    /// transformers 4 (llava-hf): as [`KeyLayout::Saved`] with `vision_tower.vision_model.*`.
    V4,
    /// transformers 5's parameter names (`state_dict()`): `model.language_model.*`,
    /// `lm_head.weight`, `model.vision_tower.*`, `model.multi_modal_projector.*`.
    StateDict,
}

impl KeyLayout {
    /// The layout of a checkpoint with tensors `names`; an error naming `location` when it is
    /// none of them.
    pub fn detect(names: &[String], location: &str) -> Result<Self> {
        let has = |n: &str| names.iter().any(|x| x == n);
        if has("model.language_model.embed_tokens.weight") {
            Ok(Self::StateDict)
        } else if has("language_model.model.embed_tokens.weight") {
            if names
                .iter()
                .any(|n| n.starts_with("vision_tower.vision_model."))
            {
                Ok(Self::V4)
            } else {
                Ok(Self::Saved)
            }
        } else {
            Err(Error::Invalid(format!(
                "{location}: not a LLaVA checkpoint (no model.language_model.embed_tokens.weight \
                 and no language_model.model.embed_tokens.weight)"
            )))
        }
    }

    /// The checkpoint name of the model's parameter `name`.
    pub fn stored(self, name: &str) -> String {
        let vision = name.strip_prefix("vision_tower.vision_model.");
        match self {
            Self::Saved | Self::V4 => {
                if name.starts_with("model.") || name.starts_with("lm_head.") {
                    format!("language_model.{name}")
                } else if let (Some(rest), Self::Saved) = (vision, self) {
                    format!("vision_tower.{rest}")
                } else {
                    name.to_string()
                }
            }
            Self::StateDict => {
                if let Some(rest) = name.strip_prefix("model.") {
                    format!("model.language_model.{rest}")
                } else if let Some(rest) = vision {
                    format!("model.vision_tower.{rest}")
                } else if name.starts_with("multi_modal_projector.") {
                    format!("model.{name}")
                } else {
                    name.to_string()
                }
            }
        }
    }
}

/// A checkpoint read under the model's names ([`KeyLayout::stored`]).
pub struct LlavaSource {
    reader: CheckpointReader,
    layout: KeyLayout,
}

impl TensorSource for LlavaSource {
    fn location(&self) -> String {
        self.reader.location().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.reader.contains(&self.layout.stored(name))
    }

    fn shape(&self, name: &str) -> candle_parallel::Result<Vec<usize>> {
        TensorSource::shape(&self.reader, &self.layout.stored(name))
    }

    fn read(&self, name: &str, shard: Shard, dev: &Device) -> candle_parallel::Result<Tensor> {
        TensorSource::read(&self.reader, &self.layout.stored(name), shard, dev)
    }
}

/// A loaded LLaVA with the list of its parameters and its config.
pub struct LoadedLlava {
    pub model: Llava,
    pub params: ParamList,
    pub config: LlavaConfig,
    pub layout: KeyLayout,
}

/// Loads the LLaVA `files` for `ctx`'s layout in `dtype` (default: the text config's stored
/// dtype, else f32), the parts `freeze` names frozen. Errors name the file and tensor.
pub fn load(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    freeze: Freeze,
) -> Result<LoadedLlava> {
    load_stage(files, ctx, dtype, mode, freeze, None)
}

/// A pipeline stage of a LLaVA model: what [`Llava::new_stage`] holds.
#[derive(Debug, Clone, Copy)]
pub struct LlavaStage<'a> {
    /// The language model's decoder layers of this rank's chunks.
    pub layers: &'a [std::ops::Range<usize>],
    /// Whether this rank holds the first or the last stage (embedding and head).
    pub ends: bool,
    /// Whether this rank holds the first stage (the vision tower and projector).
    pub first: bool,
}

/// [`load`] for a pipeline stage (`None`: the whole model).
pub fn load_stage(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    freeze: Freeze,
    stage: Option<LlavaStage<'_>>,
) -> Result<LoadedLlava> {
    let config = LlavaConfig::from_file(&files.config)?;
    let reader = CheckpointReader::open(&files.weights)?;
    let layout = KeyLayout::detect(&reader.names(), reader.location())?;
    let dtype = match dtype {
        Some(d) => d,
        None => config
            .text()
            .stored_dtype(&files.config)?
            .unwrap_or(DType::F32),
    };
    let source = Arc::new(LlavaSource { reader, layout });
    let (vb, params) = ParamBuilder::new(source, dtype, ctx.device(), mode);
    let model = match stage {
        Some(s) => Llava::new_stage(&config, vb, ctx, freeze, s.layers, s.ends, s.first)?,
        None => Llava::new(&config, vb, ctx, freeze)?,
    };
    Ok(LoadedLlava {
        model,
        params,
        config,
        layout,
    })
}
