//! The decoder-only transformer every LLaMA-like family shares: what it is ([`DecoderSpec`],
//! [`spec`]), the model ([`Decoder`], [`model`]), and loading it from a checkpoint for a layout
//! ([`load`]). A family's file parses its `config.json`, maps it onto a [`DecoderSpec`]
//! ([`ToDecoderSpec`]) and registers itself ([`crate::family`]); nothing else about it is
//! written twice.

pub mod experts;
pub mod fused;
pub mod model;
pub mod spec;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle_core::DType;
use candle_parallel::nn::{Adapters, ParamBuilder, ParamList, TensorSource};

pub use model::{Decoder, DecoderLayer, Ends};
pub use spec::{DecoderSpec, LayerSpec, MoeSpec, NormStyle};

use crate::checkpoint::CheckpointReader;
use crate::error::Result;
use crate::family::{Description, LoadSpec, LoadedCausalLm};
use crate::hub::ModelFiles;
use crate::llama::LlamaConfig;

/// A family's config that describes a decoder ([`DecoderSpec`]).
pub trait ToDecoderSpec {
    /// The model this config describes; errors name the config field.
    fn decoder_spec(&self) -> Result<DecoderSpec>;
}

impl ToDecoderSpec for DecoderSpec {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        Ok(self.clone())
    }
}

/// A family's `config.json`: parsed and validated from a file, sharing LLaMA's fields
/// ([`LlamaConfig`]), describing a decoder. [`describe`] and [`load_family`] serve every such
/// family's registry entry.
pub trait DecoderConfig: ToDecoderSpec + Sized {
    /// Parses and validates a `config.json`'s text; `path` names it in errors, which name the
    /// field.
    fn from_json(text: &str, path: &Path) -> Result<Self>;

    /// Reads and validates `path`.
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| crate::Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// The fields every LLaMA-like config shares (sizes, RoPE, dtype).
    fn base(&self) -> &LlamaConfig;
}

/// [`crate::Family::describe`] of a decoder family with config `C`.
pub fn describe<C: DecoderConfig>(path: &Path) -> Result<Description> {
    Ok(C::from_file(path)?.decoder_spec()?.description())
}

/// [`crate::Family::load_causal_lm`] of a decoder family with config `C`.
pub fn load_family<C: DecoderConfig>(
    files: &ModelFiles,
    spec: &LoadSpec<'_>,
) -> Result<LoadedCausalLm> {
    let cfg = C::from_file(&files.config)?;
    let stored = cfg.base().stored_dtype(&files.config)?;
    Ok(load(files, &cfg.decoder_spec()?, stored, spec)?.into())
}

/// A decoder loaded for a layout, with the list of its parameters.
pub struct LoadedDecoder {
    pub model: Decoder,
    pub params: ParamList,
}

/// Loads the decoder `spec` from `files` for `load`'s layout: only this rank's slice of each
/// split parameter, only the layers of its pipeline chunks, the ends only where it holds them.
/// `load.dtype` defaults to `stored` (the checkpoint's declared dtype), else f32. With adapters,
/// the base parameters are frozen and every adapter tensor must adapt a layer.
pub fn load(
    files: &ModelFiles,
    spec: &DecoderSpec,
    stored: Option<DType>,
    load: &LoadSpec<'_>,
) -> Result<LoadedDecoder> {
    let dtype = load.dtype.or(stored).unwrap_or(DType::F32);
    let reader = Arc::new(CheckpointReader::open(&files.weights)?);
    let loaded = build_as(spec, reader, dtype, load)?;
    if let Some(ad) = loaded.model.adapters() {
        check_adapters_used(spec, ad, &loaded.params, load.layers)?;
    }
    Ok(loaded)
}

/// The whole model `spec` from weights that are not files (e.g. random weights in a
/// `TensorMap`), for `load`'s layout: [`load`] without a checkpoint.
pub fn build(
    spec: &DecoderSpec,
    source: Arc<dyn TensorSource>,
    load: &LoadSpec<'_>,
) -> Result<LoadedDecoder> {
    build_as(spec, source, load.dtype.unwrap_or(DType::F32), load)
}

/// The model `spec` in `dtype` from `source` and `load.adapters`, both under the checkpoint's
/// names ([`checkpoint_source`] maps them to the model's).
fn build_as(
    spec: &DecoderSpec,
    source: Arc<dyn TensorSource>,
    dtype: DType,
    load: &LoadSpec<'_>,
) -> Result<LoadedDecoder> {
    let adapters = match load.adapters.as_ref() {
        Some(a) => {
            let cfg = crate::peft::for_transformers5(&a.cfg, spec.family)?;
            Some(a.with_config_and_source(
                cfg,
                a.source().map(|s| checkpoint_source(spec, s.clone())),
            ))
        }
        None => None,
    };
    let source = checkpoint_source(spec, source);
    let (vb, params) = ParamBuilder::new(source, dtype, load.ctx.device(), load.mode);
    let model = Decoder::new_stage(
        spec,
        vb.with_adapters(adapters),
        load.ctx,
        load.layers,
        load.ends,
    )?;
    Ok(LoadedDecoder { model, params })
}

/// `source` (a checkpoint or an adapter, under its names) under the names of the model of
/// `spec`: the parts of fused projections as views ([`fused::FusedSource`]), a mixture of
/// experts' adapters per expert ([`experts::ExpertsSource`]), else itself.
pub fn checkpoint_source(
    spec: &DecoderSpec,
    source: Arc<dyn TensorSource>,
) -> Arc<dyn TensorSource> {
    let source = match spec.experts_layout() {
        Some(layout) => Arc::new(experts::ExpertsSource::new(source, layout)),
        None => source,
    };
    match spec.fused_layout() {
        Some(layout) => Arc::new(fused::FusedSource::new(source, layout)),
        None => source,
    }
}

impl From<LoadedDecoder> for LoadedCausalLm {
    fn from(l: LoadedDecoder) -> Self {
        LoadedCausalLm {
            model: Box::new(l.model),
            params: l.params,
        }
    }
}

/// Every tensor of the adapters' source (for the layers this stage holds) was loaded by a
/// targeted linear layer, and at least one layer is adapted: an adapter for a layer this model
/// does not adapt (e.g. PEFT's `lm_head`), or targets that match nothing, are errors rather
/// than silently ignored.
fn check_adapters_used(
    spec: &DecoderSpec,
    adapters: &Adapters,
    params: &ParamList,
    layers: &[Range<usize>],
) -> Result<()> {
    // Each target parameter names one a model of this family has (a mixture of experts' router
    // weight, or its experts' stacked projections).
    use crate::peft::ROUTER_PARAMETER;
    use candle_parallel::nn::moe::{EXPERT_DOWN, EXPERT_GATE_UP};
    let targetable: Vec<String> = match spec.moe {
        Some(_) => vec![
            format!("model.layers.0.mlp.{ROUTER_PARAMETER}"),
            format!("model.layers.0.mlp.experts.{EXPERT_GATE_UP}"),
            format!("model.layers.0.mlp.experts.{EXPERT_DOWN}"),
        ],
        None => Vec::new(),
    };
    for t in &adapters.cfg.target_parameters {
        let one = candle_parallel::nn::LoraConfig {
            target_parameters: vec![t.clone()],
            ..adapters.cfg.clone()
        };
        if !targetable.iter().any(|p| one.targets_parameter(p)) {
            return Err(crate::Error::Invalid(format!(
                "the LoRA target parameter `{t}` (--lora-target-parameters, PEFT's \
                 target_parameters) names no parameter of this {} model ({})",
                spec.family,
                if targetable.is_empty() {
                    "it has no mixture of experts; adapt its linear layers with --lora-targets"
                        .to_string()
                } else {
                    format!(
                        "its parameters are {ROUTER_PARAMETER} (the routers), {EXPERT_GATE_UP} \
                         and {EXPERT_DOWN} (the experts)"
                    )
                }
            )));
        }
    }
    let loaded: std::collections::HashSet<String> =
        params.sorted().into_iter().map(|p| p.name).collect();
    if !loaded
        .iter()
        .any(|n| candle_parallel::nn::lora::is_adapter_param(n))
    {
        let params = if spec.moe.is_some() {
            " and, as target parameters, gate.weight (the routers), gate_up_proj and down_proj \
             (the experts)"
        } else {
            ""
        };
        return Err(crate::Error::Invalid(format!(
            "the LoRA targets {:?} (--lora-targets) match no linear layer of the model (its \
             layers are {}{params})",
            adapters.cfg.targets,
            spec.linear_names().join(", ")
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
    // Under expert parallelism this rank holds some experts (and their adapters) only.
    let experts = spec.experts_layout();
    let held_experts: std::collections::HashSet<String> = match &experts {
        Some(l) => loaded.iter().filter_map(|n| l.expert_folder(n)).collect(),
        None => Default::default(),
    };
    let expert_here = |name: &str| -> bool {
        match experts.as_ref().and_then(|l| l.expert_folder(name)) {
            Some(folder) => held_experts.contains(&folder),
            None => true,
        }
    };
    let mut unused: Vec<&String> = names
        .iter()
        .filter(|n| held(n) && expert_here(n) && !loaded.contains(*n))
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
