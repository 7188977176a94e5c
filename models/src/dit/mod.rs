//! DiT: configuration ([`config`]) and model ([`model`]) of diffusers' `DiTTransformer2DModel`,
//! loaded from and saved to its layout (`config.json` + `diffusion_pytorch_model.safetensors`,
//! or numbered shards with `diffusion_pytorch_model.safetensors.index.json`).

pub mod config;
pub mod init;
pub mod loss;
pub mod model;
pub mod pipeline;

use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use candle_parallel::nn::{ParallelCtx, ParamBuilder, ParamList, ParamMode};

pub use config::DitConfig;
pub use model::{condition, patchify_output, split_output, unpatchify, Dit, DitBlock, DitEnds};

use crate::checkpoint::CheckpointReader;
use crate::error::Result;
use crate::hub::ModelFiles;

/// The weight-file stem diffusers uses.
pub const WEIGHTS_NAME: &str = "diffusion_pytorch_model";

/// The files of a diffusers DiT directory.
pub fn files(dir: &Path) -> Result<ModelFiles> {
    crate::hub::from_dir_named(&dir.display().to_string(), dir, WEIGHTS_NAME)
}

/// A loaded DiT with the list of its parameters.
pub struct LoadedDit {
    pub model: Dit,
    pub params: ParamList,
    pub config: DitConfig,
}

/// Loads `files` for this rank's layout (this rank's slices only), in `dtype` (f32 when none).
pub fn load(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
) -> Result<LoadedDit> {
    let config = DitConfig::from_file(&files.config)?;
    let all = 0..config.num_layers;
    load_stage(files, ctx, dtype, mode, std::slice::from_ref(&all), true)
}

/// [`load`] for a pipeline stage: the blocks in `layers` and, with `ends`, the patch embedding
/// and output layer (see [`Dit::new_stage`]).
pub fn load_stage(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    layers: &[std::ops::Range<usize>],
    ends: bool,
) -> Result<LoadedDit> {
    let config = DitConfig::from_file(&files.config)?;
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamBuilder::new(reader, dtype.unwrap_or(DType::F32), ctx.device(), mode);
    let model = Dit::new_stage(&config, vb, ctx, layers, ends)?;
    Ok(LoadedDit {
        model,
        params,
        config,
    })
}
