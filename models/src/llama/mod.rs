//! LLaMA: configuration ([`config`]) and model ([`model`]).

pub mod config;
pub mod model;
pub mod random;

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_parallel::nn::{ParallelCtx, ParamBuilder, ParamList, ParamMode};

pub use config::LlamaConfig;
pub use model::{DecoderLayer, Ends, KvCache, Llama};
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
    let dtype = match dtype {
        Some(d) => d,
        None => config.stored_dtype(&files.config)?.unwrap_or(DType::F32),
    };
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamBuilder::new(reader, dtype, &Device::Cpu, mode);
    let model = Llama::new(&config, vb, ctx)?;
    Ok(LoadedLlama {
        model,
        params,
        config,
    })
}
