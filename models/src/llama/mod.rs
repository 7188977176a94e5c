//! LLaMA: configuration ([`config`]) and model ([`model`]).

pub mod config;
pub mod model;
pub mod pipeline;
pub mod random;

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_parallel::nn::{Adapters, ParallelCtx, ParamBuilder, ParamList, ParamMode};

pub use config::LlamaConfig;
pub use model::{DecoderLayer, Ends, KvCache, Llama};
pub use pipeline::{replicated_across_stages, LlamaStage, StageMicroBatch};
pub use random::write_random_checkpoint;

use crate::checkpoint::CheckpointReader;
use crate::error::Result;
use crate::hub::ModelFiles;

/// A loaded model with the list of its parameters (for training, gradient reduction, saving).
pub struct LoadedLlama {
    pub model: Llama,
    pub params: ParamList,
    pub config: LlamaConfig,
}

/// Loads `files` for this rank's layout: only this rank's slice of each split parameter is read.
/// `dtype` defaults to the checkpoint's declared dtype (f32 when none); parameters are `Var`s
/// when [`ParamMode::Trainable`].
pub fn load(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
) -> Result<LoadedLlama> {
    let config = LlamaConfig::from_file(&files.config)?;
    let all = 0..config.num_hidden_layers;
    load_stage(files, ctx, dtype, mode, std::slice::from_ref(&all), true)
}

/// [`load`] for a pipeline stage: only the decoder layers in `layers` (this rank's chunks)
/// and, with `ends`, the embedding, final norm and head (see [`Llama::new_stage`]).
pub fn load_stage(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    layers: &[std::ops::Range<usize>],
    ends: bool,
) -> Result<LoadedLlama> {
    load_stage_adapted(files, ctx, dtype, mode, layers, ends, None)
}

/// [`load`] with LoRA `adapters` on the linear layers they target: the base parameters are
/// frozen and, with [`ParamMode::Trainable`], the adapters train (see
/// [`candle_parallel::nn::lora`]).
pub fn load_adapted(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    adapters: Option<Arc<Adapters>>,
) -> Result<LoadedLlama> {
    let config = LlamaConfig::from_file(&files.config)?;
    let all = 0..config.num_hidden_layers;
    load_stage_adapted(
        files,
        ctx,
        dtype,
        mode,
        std::slice::from_ref(&all),
        true,
        adapters,
    )
}

/// [`load_stage`] with LoRA `adapters` (see [`load_adapted`]).
pub fn load_stage_adapted(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    mode: ParamMode,
    layers: &[std::ops::Range<usize>],
    ends: bool,
    adapters: Option<Arc<Adapters>>,
) -> Result<LoadedLlama> {
    let config = LlamaConfig::from_file(&files.config)?;
    let dtype = match dtype {
        Some(d) => d,
        None => config.stored_dtype(&files.config)?.unwrap_or(DType::F32),
    };
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamBuilder::new(reader, dtype, &Device::Cpu, mode);
    let model = Llama::new_stage(&config, vb.with_adapters(adapters), ctx, layers, ends)?;
    Ok(LoadedLlama {
        model,
        params,
        config,
    })
}
