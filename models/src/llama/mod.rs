//! LLaMA: configuration ([`config`]) and model ([`model`]).

pub mod config;
pub mod model;
pub mod random;

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_parallel::layers::ParallelCtx;

pub use config::LlamaConfig;
pub use model::{Attention, Batch, DecoderLayer, Ends, KvCache, Llama, Mlp, RmsNorm};
pub use random::write_random_checkpoint;

use crate::checkpoint::{CheckpointReader, ParamList, ParamStore};
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
/// when `trainable`.
pub fn load(
    files: &ModelFiles,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    trainable: bool,
) -> Result<LoadedLlama> {
    let config = LlamaConfig::from_file(&files.config)?;
    let dtype = match dtype {
        Some(d) => d,
        None => config.stored_dtype(&files.config)?.unwrap_or(DType::F32),
    };
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamStore::builder(reader, dtype, &Device::Cpu, trainable);
    let model = Llama::new(&config, ctx, vb)?;
    Ok(LoadedLlama {
        model,
        params,
        config,
    })
}
