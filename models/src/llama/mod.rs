//! LLaMA (Llama 2, Llama 3.x, TinyLlama, SmolLM) as `LlamaForCausalLM`: its configuration
//! ([`config`]), mapped onto the shared [`crate::decoder`] model.

pub mod config;
pub mod random;

use std::sync::Arc;

use candle_core::DType;
use candle_parallel::nn::{Adapters, ParallelCtx, ParamList, ParamMode, TensorSource};

pub use crate::causal_lm::KvCache;
pub use crate::decoder::{DecoderLayer, Ends};
pub use config::LlamaConfig;
pub use random::{random_weights, write_random_checkpoint};

use crate::decoder::{self, ToDecoderSpec};
use crate::error::Result;
use crate::family::LoadSpec;
use crate::hub::ModelFiles;

/// `LlamaForCausalLM`: the shared decoder (every LLaMA-like family's model).
pub type Llama = crate::decoder::Decoder;

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
    load_adapted(files, ctx, dtype, mode, None)
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
    let spec = config.decoder_spec()?;
    let load = LoadSpec {
        ctx,
        dtype,
        mode,
        layers,
        ends,
        adapters,
    };
    let loaded = decoder::load(files, &spec, config.stored_dtype(&files.config)?, &load)?;
    Ok(LoadedLlama {
        model: loaded.model,
        params: loaded.params,
        config,
    })
}

/// The whole model of `config` from weights that are not files (e.g. [`random_weights`] in a
/// `TensorMap`), for this rank's layout: [`load`] without a checkpoint.
pub fn build(
    config: &LlamaConfig,
    source: Arc<dyn TensorSource>,
    ctx: &ParallelCtx,
    dtype: DType,
    mode: ParamMode,
) -> Result<LoadedLlama> {
    let spec = config.decoder_spec()?;
    let all = 0..spec.num_layers();
    let load = LoadSpec {
        ctx,
        dtype: Some(dtype),
        mode,
        layers: std::slice::from_ref(&all),
        ends: true,
        adapters: None,
    };
    let loaded = decoder::build(&spec, source, &load)?;
    Ok(LoadedLlama {
        model: loaded.model,
        params: loaded.params,
        config: config.clone(),
    })
}
