//! LLaMA: configuration ([`config`]) and model ([`model`]).

pub mod config;
pub mod model;
pub mod random;

use std::sync::Arc;

use candle_core::DType;
use candle_parallel::nn::{
    Adapters, ParallelCtx, ParamBuilder, ParamList, ParamMode, TensorSource,
};

pub use crate::causal_lm::KvCache;
pub use config::LlamaConfig;
pub use model::{DecoderLayer, Ends, Llama};
pub use random::{random_weights, write_random_checkpoint};

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
    let dtype = match dtype {
        Some(d) => d,
        None => config.stored_dtype(&files.config)?.unwrap_or(DType::F32),
    };
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let (vb, params) = ParamBuilder::new(reader, dtype, ctx.device(), mode);
    let model = Llama::new_stage(
        &config,
        vb.with_adapters(adapters.clone()),
        ctx,
        layers,
        ends,
    )?;
    if let Some(ad) = &adapters {
        check_adapters_used(ad, &params, layers)?;
    }
    Ok(LoadedLlama {
        model,
        params,
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
    let (vb, params) = ParamBuilder::new(source, dtype, ctx.device(), mode);
    Ok(LoadedLlama {
        model: Llama::new(config, vb, ctx)?,
        params,
        config: config.clone(),
    })
}

/// Every tensor of the adapters' source (for the layers this stage holds) was loaded by a
/// targeted linear layer, and at least one layer is adapted: an adapter for a layer this model
/// does not adapt (e.g. PEFT's `lm_head`), or targets that match nothing, are errors rather
/// than silently ignored.
fn check_adapters_used(
    adapters: &Adapters,
    params: &ParamList,
    layers: &[std::ops::Range<usize>],
) -> Result<()> {
    let loaded: std::collections::HashSet<String> =
        params.sorted().into_iter().map(|p| p.name).collect();
    if !loaded
        .iter()
        .any(|n| candle_parallel::nn::lora::is_adapter_param(n))
    {
        return Err(crate::Error::Invalid(format!(
            "the LoRA targets {:?} match no linear layer of the model (its layers are q_proj, \
             k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
            adapters.cfg.targets
        )));
    }
    let Some(names) = adapters.source().and_then(|s| s.names()) else {
        return Ok(());
    };
    let held = |name: &str| -> bool {
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        match layer {
            Some(i) => layers.iter().any(|r| r.contains(&i)),
            // Not a decoder layer's: checked on every stage.
            None => true,
        }
    };
    let mut unused: Vec<&String> = names
        .iter()
        .filter(|n| held(n) && !loaded.contains(*n))
        .collect();
    unused.sort();
    if let Some(first) = unused.first() {
        return Err(crate::Error::Invalid(format!(
            "{}: {} adapter tensor(s) adapt no layer of this model, e.g. `{first}` (only the \
             decoder layers' linear layers take adapters; the adapter's target_modules must \
             match them)",
            adapters.source().map(|s| s.location()).unwrap_or_default(),
            unused.len()
        )));
    }
    Ok(())
}
