//! LoRA adapters in PEFT's format: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`, whose tensors are named `base_model.model.<layer>.lora_A.weight`
//! and `...lora_B.weight` (`A` `(r, in)`, `B` `(out, r)`, scale `lora_alpha / r`, or
//! `lora_alpha / √r` with `use_rslora`). PEFT's `PeftModel.from_pretrained(base, dir)` loads what
//! [`adapter_config`] and the trainer's checkpoints write; [`load`] reads PEFT's output back.
//! [`merge`] folds an adapter into its base checkpoint (`W + s · B A`), as PEFT's
//! `merge_and_unload` does, into a plain Hugging Face model directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::nn::lora::{is_adapter_param, merge as merge_weight};
use candle_parallel::nn::{LoraConfig, LoraTargets, Shard, TensorSource};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{write_hf_dir, CheckpointReader, SaveOptions};
use crate::error::{Error, Result};
use crate::hub::ModelFiles;

/// Prefix of every tensor name in `adapter_model.safetensors`.
pub const PREFIX: &str = "base_model.model.";
/// Stem of the adapter's weight file.
pub const WEIGHTS_NAME: &str = "adapter_model";
pub const CONFIG_NAME: &str = "adapter_config.json";

/// The fields of PEFT's `adapter_config.json` that LoRA uses (others are kept when read and
/// written back).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    #[serde(default)]
    pub task_type: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    /// A list of names, or a string (`"all-linear"`, or a regular expression, which is not
    /// supported).
    pub target_modules: serde_json::Value,
    #[serde(default)]
    pub lora_dropout: f64,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default = "bias_none")]
    pub bias: String,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

fn bias_none() -> String {
    "none".into()
}

impl AdapterConfig {
    /// The config PEFT writes for `cfg` (task `CAUSAL_LM`, no bias, no dropout).
    pub fn from_lora(cfg: &LoraConfig, base_model: &str) -> Self {
        let mut rest = BTreeMap::from([
            ("inference_mode".into(), serde_json::Value::Bool(true)),
            ("modules_to_save".into(), serde_json::Value::Null),
            ("init_lora_weights".into(), serde_json::Value::Bool(true)),
        ]);
        if !cfg.target_parameters.is_empty() {
            rest.insert(
                "target_parameters".into(),
                serde_json::json!(cfg.target_parameters),
            );
        }
        if !cfg.rank_pattern.is_empty() || !cfg.alpha_pattern.is_empty() {
            rest.insert("rank_pattern".into(), serde_json::json!(cfg.rank_pattern));
            rest.insert("alpha_pattern".into(), serde_json::json!(cfg.alpha_pattern));
        }
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: cfg.rank,
            lora_alpha: cfg.alpha,
            target_modules: cfg.targets.to_peft(),
            lora_dropout: 0.0,
            use_rslora: cfg.use_rslora,
            fan_in_fan_out: false,
            bias: "none".into(),
            base_model_name_or_path: Some(base_model.into()),
            rest,
        }
    }

    /// The LoRA configuration this file describes; `path` names it in errors.
    pub fn to_lora(&self, path: &Path, seed: u64) -> Result<LoraConfig> {
        let bad = |msg: String| Error::config(path, msg);
        if self.peft_type != "LORA" {
            return Err(bad(format!(
                "peft_type {:?}: only LORA adapters are supported",
                self.peft_type
            )));
        }
        if self.bias != "none" {
            return Err(bad(format!(
                "bias {:?}: only adapters without bias terms (\"none\") are supported",
                self.bias
            )));
        }
        if self.fan_in_fan_out {
            return Err(bad(
                "fan_in_fan_out: true (GPT-2 Conv1D layers) is not supported".into(),
            ));
        }
        // PEFT options that change which layers train or how: not silently ignored.
        let set = |k: &str| {
            self.rest.get(k).filter(|v| match v {
                serde_json::Value::Null | serde_json::Value::Bool(false) => false,
                serde_json::Value::Array(a) => !a.is_empty(),
                serde_json::Value::Object(o) => !o.is_empty(),
                serde_json::Value::String(s) => !s.is_empty(),
                _ => true,
            })
        };
        for k in [
            "modules_to_save",
            "layers_to_transform",
            "layers_pattern",
            "exclude_modules",
            "use_dora",
            "lora_bias",
        ] {
            if let Some(v) = set(k) {
                return Err(bad(format!("{k} {v} is not supported")));
            }
        }
        let targets = match &self.target_modules {
            serde_json::Value::String(s) if s == "all-linear" => LoraTargets::AllLinear,
            serde_json::Value::String(s) => {
                return Err(bad(format!(
                    "target_modules {s:?} is a regular expression; list the module names instead"
                )))
            }
            serde_json::Value::Array(a) => LoraTargets::Names(
                a.iter()
                    .map(|v| {
                        v.as_str()
                            .map(String::from)
                            .ok_or_else(|| bad(format!("target_modules holds {v}, not a name")))
                    })
                    .collect::<Result<_>>()?,
            ),
            other => {
                return Err(bad(format!(
                    "target_modules {other} is not a list of names"
                )))
            }
        };
        let field = |k: &str| self.rest.get(k).filter(|v| !v.is_null());
        let target_parameters = match field("target_parameters") {
            None => Vec::new(),
            Some(v) => serde_json::from_value::<Vec<String>>(v.clone()).map_err(|_| {
                bad(format!(
                    "target_parameters {v} is not a list of parameter names"
                ))
            })?,
        };
        let rank_pattern = match field("rank_pattern") {
            None => BTreeMap::new(),
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|_| bad(format!("rank_pattern {v} is not a map of names to ranks")))?,
        };
        let alpha_pattern = match field("alpha_pattern") {
            None => BTreeMap::new(),
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|_| bad(format!("alpha_pattern {v} is not a map of names to alphas")))?,
        };
        let cfg = LoraConfig {
            rank: self.r,
            alpha: self.lora_alpha,
            targets,
            use_rslora: self.use_rslora,
            seed,
            target_parameters,
            rank_pattern,
            alpha_pattern,
        };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }

    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).map_err(|e| Error::Invalid(e.to_string()))
    }
}

/// The families whose experts transformers 5 fuses and whose LoRA targets PEFT converts from
/// transformers 4's module names (`_MOE_TARGET_MODULE_MAPPING` of PEFT's
/// `transformers_weight_conversion`), with those names: router, gate, up, down. Qwen2-MoE is
/// not converted by PEFT 0.21 (its names target the shared expert and the dense layers).
const CONVERTED_FAMILIES: [(&str, [&str; 4]); 2] = [
    ("mixtral", ["gate", "w1", "w3", "w2"]),
    ("qwen3_moe", ["gate", "gate_proj", "up_proj", "down_proj"]),
];

/// The attention's linear layers: what `all-linear` still finds as `nn.Linear` in Mixtral and
/// Qwen3-MoE under transformers 5.
const ATTENTION_LINEAR: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

/// `cfg` as PEFT 0.21 converts it for a model of `family` under transformers 5
/// (`convert_peft_config_for_transformers`), so that the adapters are where PEFT puts them:
/// for Mixtral and Qwen3-MoE, `all-linear` becomes the attention's projections plus the
/// parameters `gate.weight` (the router), `gate_up_proj` and `down_proj` (the experts); the
/// module names of the router and the experts (`gate`; `gate_proj`, `up_proj`, `down_proj`, or
/// Mixtral's `w1`, `w3`, `w2`) become those parameters. Gate and up are fused: targeting one
/// without the other is an error, both give `gate_up_proj` twice the rank and alpha
/// (`rank_pattern` / `alpha_pattern` `.*\.gate_up_proj`). Other families, and configurations
/// already converted, are returned as they are.
pub fn for_transformers5(cfg: &LoraConfig, family: &str) -> candle_parallel::Result<LoraConfig> {
    let Some((_, [router, gate, up, down])) = CONVERTED_FAMILIES.iter().find(|(f, _)| *f == family)
    else {
        return Ok(cfg.clone());
    };
    let names: Vec<String> = match &cfg.targets {
        LoraTargets::AllLinear => ATTENTION_LINEAR
            .iter()
            .chain([router, gate, up, down])
            .map(|s| s.to_string())
            .collect(),
        LoraTargets::Names(n) => n.clone(),
    };
    let ends = |t: &str, n: &str| t == n || t.ends_with(&format!(".{n}"));
    let mut out = cfg.clone();
    let mut modules = Vec::new();
    let mut params: std::collections::BTreeSet<String> =
        cfg.target_parameters.iter().cloned().collect();
    let (mut has_gate, mut has_up) = (false, false);
    for t in names {
        if ends(&t, router) {
            params.insert(ROUTER_PARAMETER.into());
        } else if ends(&t, gate) || ends(&t, up) {
            has_gate |= ends(&t, gate);
            has_up |= ends(&t, up);
            params.insert(candle_parallel::nn::moe::EXPERT_GATE_UP.into());
        } else if ends(&t, down) {
            params.insert(candle_parallel::nn::moe::EXPERT_DOWN.into());
        } else {
            modules.push(t);
        }
    }
    if has_gate != has_up {
        let (present, missing) = if has_gate { (gate, up) } else { (up, gate) };
        return Err(candle_parallel::Error::InvalidArgument {
            op: "lora",
            msg: format!(
                "the LoRA targets name the experts' `{present}` without `{missing}`: they are \
                 fused into `gate_up_proj` (transformers 5, PEFT), so target both or neither"
            ),
        });
    }
    if has_gate {
        let key = ".*\\.gate_up_proj".to_string();
        out.rank_pattern.insert(key.clone(), 2 * cfg.rank);
        out.alpha_pattern.insert(key, 2.0 * cfg.alpha);
    }
    modules.sort();
    modules.dedup();
    out.targets = LoraTargets::Names(modules);
    out.target_parameters = params.into_iter().collect();
    Ok(out)
}

/// The router's weight of a mixture of experts as PEFT targets it under transformers 5 (a
/// parameter, in `target_parameters`).
pub const ROUTER_PARAMETER: &str = "gate.weight";

/// `cfg` (converted by [`for_transformers5`]) without the router: what `cpl finetune` adapts
/// when no targets are named, since a router trained by LoRA changes which experts every token
/// reaches (PEFT's `all-linear` includes it; naming `gate` or `all-linear` asks for it).
/// Configurations that do not target the router are returned as they are.
pub fn without_router(cfg: &LoraConfig) -> LoraConfig {
    let mut out = cfg.clone();
    out.target_parameters.retain(|p| p != ROUTER_PARAMETER);
    out
}

/// [`for_transformers5`] for the model whose `config.json` is `config` (its `model_type`).
pub fn for_model(cfg: &LoraConfig, config: &Path) -> Result<LoraConfig> {
    let text = std::fs::read_to_string(config).map_err(|e| Error::io(config, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(config, format!("not valid JSON: {e}")))?;
    let family = v.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
    for_transformers5(cfg, family).map_err(|e| Error::Invalid(e.to_string()))
}

/// An adapter's tensors under the model's own names (PEFT's prefix removed): the
/// [`TensorSource`] a model built with LoRA reads its adapters from.
pub struct AdapterSource {
    reader: CheckpointReader,
}

impl AdapterSource {
    fn stored(name: &str) -> String {
        format!("{PREFIX}{name}")
    }

    /// The model's names of the adapter's tensors.
    pub fn names(&self) -> Vec<String> {
        self.reader
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix(PREFIX).map(String::from))
            .collect()
    }
}

impl TensorSource for AdapterSource {
    fn location(&self) -> String {
        self.reader.location().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.reader.contains(&Self::stored(name))
    }

    fn shape(&self, name: &str) -> candle_parallel::Result<Vec<usize>> {
        TensorSource::shape(&self.reader, &Self::stored(name))
    }

    fn read(&self, name: &str, shard: Shard, dev: &Device) -> candle_parallel::Result<Tensor> {
        TensorSource::read(&self.reader, &Self::stored(name), shard, dev)
    }

    fn names(&self) -> Option<Vec<String>> {
        Some(AdapterSource::names(self))
    }
}

/// A PEFT adapter directory: its configuration and its tensors.
pub struct Adapter {
    pub dir: PathBuf,
    pub config: AdapterConfig,
    pub lora: LoraConfig,
    pub source: Arc<AdapterSource>,
}

/// Reads the adapter in `dir` (PEFT's `save_pretrained` output). Errors name the file.
pub fn load(dir: &Path) -> Result<Adapter> {
    let cfg_path = dir.join(CONFIG_NAME);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let config: AdapterConfig = serde_json::from_str(&text)
        .map_err(|e| Error::config(&cfg_path, format!("not a PEFT adapter config: {e}")))?;
    let lora = config.to_lora(&cfg_path, 0)?;
    let weights = dir.join(format!("{WEIGHTS_NAME}.safetensors"));
    if !weights.is_file() {
        return Err(Error::NotFound {
            model: dir.display().to_string(),
            msg: format!(
                "{} does not exist (only safetensors adapters are read)",
                weights.display()
            ),
        });
    }
    let reader = CheckpointReader::open(std::slice::from_ref(&weights))?;
    let source = AdapterSource { reader };
    let names = source.names();
    if names.is_empty() || names.iter().any(|n| !is_adapter_param(n)) {
        let odd: Vec<String> = source
            .reader
            .names()
            .into_iter()
            .filter(|n| !n.strip_prefix(PREFIX).is_some_and(is_adapter_param))
            .take(3)
            .collect();
        return Err(Error::config(
            &weights,
            format!(
                "holds tensors that are not LoRA A/B weights under `{PREFIX}` (e.g. {odd:?}) \
                 or none at all"
            ),
        ));
    }
    Ok(Adapter {
        dir: dir.to_path_buf(),
        config,
        lora,
        source: Arc::new(source),
    })
}

/// Folds `adapter` into the base checkpoint `base` and writes the merged model to `out` (a
/// Hugging Face model directory, atomically; the base's config, tokenizer and generation files
/// are copied). Every `lora_A`/`lora_B` pair must sit on a 2-D base weight of matching shape.
/// Returns the names of the merged weights.
pub fn merge(base: &ModelFiles, adapter: &Adapter, out: &Path) -> Result<Vec<String>> {
    let reader = CheckpointReader::open(&base.weights)?;
    let dev = Device::Cpu;
    let scale = adapter.lora.scale();
    let mut layers: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
    for n in adapter.source.names() {
        if let Some(l) = n.strip_suffix(".lora_A.weight") {
            layers.entry(l.to_string()).or_default().0 = Some(n.clone());
        } else if let Some(l) = n.strip_suffix(".lora_B.weight") {
            layers.entry(l.to_string()).or_default().1 = Some(n.clone());
        }
    }
    let mut merged = BTreeMap::new();
    let mut dtype = DType::F32;
    for (layer, (a, b)) in &layers {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(Error::config(
                adapter.dir.join(format!("{WEIGHTS_NAME}.safetensors")),
                format!("layer `{layer}` has only one of lora_A and lora_B"),
            ));
        };
        if layer.ends_with(".experts") || layer.ends_with(".experts.base_layer") {
            return Err(Error::config(
                &adapter.dir,
                format!(
                    "`{layer}`: merging LoRA on a mixture of experts' experts \
                     (target_parameters) is not supported yet"
                ),
            ));
        }
        let wname = format!("{layer}.weight");
        if !reader.contains(&wname) {
            return Err(Error::config(
                &base.source,
                format!("the adapter targets `{layer}`, but the base has no `{wname}`"),
            ));
        }
        let w = reader.read(&wname, Shard::replicated(), &dev)?;
        dtype = w.dtype();
        let a = adapter.source.read(a, Shard::replicated(), &dev)?;
        let b = adapter.source.read(b, Shard::replicated(), &dev)?;
        let (out_f, in_f) = w.dims2()?;
        let (r, a_in) = a.dims2()?;
        let (b_out, b_r) = b.dims2()?;
        if a_in != in_f || b_out != out_f || b_r != r {
            return Err(Error::config(
                &adapter.dir,
                format!(
                    "`{layer}`: lora_A {:?} and lora_B {:?} do not fit the base weight {:?}",
                    a.dims(),
                    b.dims(),
                    w.dims()
                ),
            ));
        }
        merged.insert(wname, merge_weight(&w, &a, &b, scale)?);
    }
    let mut tensors = Vec::new();
    for name in reader.names() {
        let t = match merged.remove(&name) {
            Some(t) => t,
            None => reader.read(&name, Shard::replicated(), &dev)?,
        };
        tensors.push((name, t));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut extra = Vec::new();
    let files = [
        Some(&base.config),
        base.tokenizer.as_ref(),
        base.tokenizer_config.as_ref(),
        base.chat_template.as_ref(),
        base.generation_config.as_ref(),
    ];
    for f in files.into_iter().flatten() {
        let bytes = std::fs::read(f).map_err(|e| Error::io(f, e))?;
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        extra.push((name, bytes));
    }
    let opts = SaveOptions {
        dtype,
        extra_files: extra,
        ..Default::default()
    };
    write_hf_dir(&tensors, out, &opts)?;
    Ok(layers.keys().map(|l| format!("{l}.weight")).collect())
}
