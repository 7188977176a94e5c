//! LoRA (Hu et al. 2021) on the tensor-parallel linear layers, in PEFT's conventions.
//!
//! A targeted layer `y = x Wᵀ` becomes `y = x Wᵀ + s · (x Aᵀ) Bᵀ` with `A` `(r, in)`, `B`
//! `(out, r)` and `s = alpha / r` (`alpha / √r` with rsLoRA). The adapter weights are named
//! `<layer>.lora_A.weight` and `<layer>.lora_B.weight` next to the layer's `weight`, as PEFT
//! names them under `base_model.model.`; `A` starts as PEFT's Kaiming-uniform draw
//! (`U(-1/√in, 1/√in)`, from a generator keyed by the seed and the name, so every layout draws the
//! same whole tensor) and `B` as zeros, so training starts from the base model.
//!
//! LoRA is switched on for a model by the [`ParamBuilder`](super::ParamBuilder) it is built with
//! ([`ParamBuilder::with_adapters`](super::ParamBuilder::with_adapters)): every linear layer whose
//! name the [`LoraConfig`] targets then loads (or initialises) its adapter, and the base
//! parameters are loaded frozen. Model files do not change.
//!
//! Tensor parallelism splits the adapters with their layer:
//! - column-parallel (`W` rows split): `B` is split by rows like `W`, `A` is replicated. The
//!   low-rank product `x Aᵀ` is taken before the layer enters the tensor-parallel region and
//!   enters it itself (`r` features instead of `in`), so `A`'s gradient is complete on every
//!   rank (or, under TP-sp, each rank's tokens' part, summed like other replicated parameters).
//! - row-parallel (`W` columns split): `A` is split by columns like `W`, `B` is replicated; the
//!   partial `x_r A_rᵀ` is reduced over the group like the layer's output (all-reduce, or
//!   reduce-scatter of tokens under TP-sp), then multiplied by `B` on every rank.
//!
//! - a checkpoint's fused projection (Phi-3's `qkv_proj`, `gate_up_proj`), which the model
//!   runs as its parts (q, k, v; gate, up): one LoRA on the fused module, as PEFT has it, whose
//!   `A` the parts share and whose `B` rows they split
//!   ([`ColumnParallelLinear::new_part`](super::ColumnParallelLinear::new_part)); each part's
//!   `B` is split over tp like its weight, so every rank holds its heads' rows.
//!
//! - a parameter adapted directly (PEFT's `target_parameters`: a mixture of experts' router
//!   `gate.weight` and its experts' `gate_up_proj` and `down_proj`, see [`super::moe`]): the
//!   block asks [`Adapters::for_parameter`] for the adapters of that parameter (its rank and
//!   alpha from `rank_pattern` / `alpha_pattern`) and builds its linear layers with them.
//!
//! [`Adapters::set_enabled`] turns every adapter of a model off at once (the reference model of
//! DPO is the base model); every rank must set the same value.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::TensorSource;
use crate::error::{Error, Result};

/// Which linear layers get adapters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoraTargets {
    /// Every linear layer of the blocks (PEFT's `"all-linear"`: not the output head, which
    /// here is the vocab-parallel [`LmHead`](super::LmHead), not a linear layer).
    AllLinear,
    /// Layers whose last name segment is one of these (`q_proj`, `v_proj`), or whose full name
    /// ends with `.<name>` (PEFT's suffix match).
    Names(Vec<String>),
}

impl LoraTargets {
    /// Parses `all-linear` (also `all`, LLaMA-Factory's spelling) or a comma-separated list.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "all-linear" || s == "all" {
            return Ok(Self::AllLinear);
        }
        let names: Vec<String> = s
            .split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err(Error::invalid(
                "lora",
                "no target modules: name them (q_proj,v_proj) or use all-linear",
            ));
        }
        Ok(Self::Names(names))
    }

    /// Whether the linear layer at `path` (`model.layers.0.self_attn.q_proj`) is targeted.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            Self::AllLinear => true,
            Self::Names(names) => names
                .iter()
                .any(|n| path == n || path.ends_with(&format!(".{n}"))),
        }
    }

    /// The value PEFT's `adapter_config.json` stores in `target_modules`.
    pub fn to_peft(&self) -> serde_json::Value {
        match self {
            Self::AllLinear => serde_json::Value::String("all-linear".into()),
            Self::Names(n) => serde_json::json!(n),
        }
    }
}

/// LoRA hyper-parameters (PEFT's `LoraConfig` names in comments).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// `r`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `target_modules`.
    pub targets: LoraTargets,
    /// `use_rslora`: scale `alpha / √r` instead of `alpha / r`.
    #[serde(default)]
    pub use_rslora: bool,
    /// Seed of the initial `A` matrices.
    #[serde(default)]
    pub seed: u64,
    /// `target_parameters`: parameters adapted directly, matched like `target_modules` names
    /// against the parameter's name (`model.layers.0.mlp.experts.gate_up_proj`,
    /// `...mlp.gate.weight`): a mixture of experts' router and experts ([`super::moe`]).
    #[serde(default)]
    pub target_parameters: Vec<String>,
    /// `rank_pattern`: the rank of the targets whose name matches a key (`.*\.gate_up_proj`,
    /// or a plain name: the name or a `.`-separated suffix of it); others have `rank`.
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, usize>,
    /// `alpha_pattern`: the alpha of the targets whose name matches a key (as `rank_pattern`).
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, f64>,
}

/// The suffix a `rank_pattern` / `alpha_pattern` key stands for: PEFT's keys are regular
/// expressions matched at the end of a name (`(.*\.)?KEY$`); only `NAME`, `.*NAME` and
/// `.*\.NAME` with `NAME` a dotted name (dots escaped or not) are understood.
fn pattern_suffix(key: &str) -> Result<String> {
    let k = key.strip_prefix('^').unwrap_or(key);
    let k = k.strip_suffix('$').unwrap_or(k);
    let k = k
        .strip_prefix(".*\\.")
        .or_else(|| k.strip_prefix(".*"))
        .unwrap_or(k);
    let name = k.replace("\\.", ".");
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if name.is_empty() || !plain || name.starts_with('.') {
        return Err(Error::invalid(
            "lora",
            format!(
                "rank_pattern / alpha_pattern key {key:?}: only a module name or `.*\\.NAME` is \
                 supported"
            ),
        ));
    }
    Ok(name)
}

/// Whether `path` is `name` or ends with `.name` (PEFT's suffix match).
fn suffix_match(path: &str, name: &str) -> bool {
    path == name || path.ends_with(&format!(".{name}"))
}

impl LoraConfig {
    /// Checks the settings: a positive rank and a finite alpha.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::invalid("lora", "the LoRA rank must be at least 1"));
        }
        if !self.alpha.is_finite() {
            return Err(Error::invalid("lora", "lora_alpha must be a finite number"));
        }
        // Patterns are honoured for target parameters only (the linear layers targeted by
        // module name take `rank` and `alpha`): any other pattern is refused, not ignored.
        let keys = self.rank_pattern.keys().chain(self.alpha_pattern.keys());
        for k in keys {
            let s = pattern_suffix(k)?;
            let last = s.rsplit('.').next().unwrap_or(&s);
            let of_parameter = self
                .target_parameters
                .iter()
                .any(|t| t.rsplit('.').next() == Some(last));
            if !of_parameter {
                return Err(Error::invalid(
                    "lora",
                    format!(
                        "rank_pattern / alpha_pattern key {k:?}: only the target parameters' \
                         ranks and alphas may differ (here {:?})",
                        self.target_parameters
                    ),
                ));
            }
        }
        for (k, &r) in &self.rank_pattern {
            pattern_suffix(k)?;
            if r == 0 {
                return Err(Error::invalid(
                    "lora",
                    format!("rank_pattern {k:?}: the rank must be at least 1"),
                ));
            }
        }
        for (k, a) in &self.alpha_pattern {
            pattern_suffix(k)?;
            if !a.is_finite() {
                return Err(Error::invalid(
                    "lora",
                    format!("alpha_pattern {k:?}: alpha must be a finite number"),
                ));
            }
        }
        Ok(())
    }

    /// Whether the parameter `name` (`model.layers.0.mlp.experts.gate_up_proj`) is one of
    /// `target_parameters`.
    pub fn targets_parameter(&self, name: &str) -> bool {
        self.target_parameters.iter().any(|t| suffix_match(name, t))
    }

    /// The rank of the target `name` (`rank_pattern`, else `rank`).
    pub fn rank_of(&self, name: &str) -> usize {
        self.rank_pattern
            .iter()
            .find(|(k, _)| pattern_suffix(k).is_ok_and(|s| suffix_match(name, &s)))
            .map_or(self.rank, |(_, &r)| r)
    }

    /// The alpha of the target `name` (`alpha_pattern`, else `alpha`).
    pub fn alpha_of(&self, name: &str) -> f64 {
        self.alpha_pattern
            .iter()
            .find(|(k, _)| pattern_suffix(k).is_ok_and(|s| suffix_match(name, &s)))
            .map_or(self.alpha, |(_, &a)| a)
    }

    /// This configuration for the one target `name`: its rank and alpha, targeting every
    /// linear layer built with it (or none when `name` is not a target parameter).
    fn for_parameter(&self, name: &str) -> Self {
        let targeted = self.targets_parameter(name);
        Self {
            rank: self.rank_of(name),
            alpha: self.alpha_of(name),
            targets: if targeted {
                LoraTargets::AllLinear
            } else {
                LoraTargets::Names(Vec::new())
            },
            use_rslora: self.use_rslora,
            seed: self.seed,
            target_parameters: Vec::new(),
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
        }
    }

    /// The factor `s` of the low-rank update.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}

/// The adapters of one model: their configuration, where trained adapter weights come from
/// (none: fresh ones), and the switch that turns them all off. Shared by every layer.
pub struct Adapters {
    pub cfg: LoraConfig,
    source: Option<Arc<dyn TensorSource>>,
    /// Shared with the adapters [`Adapters::with_source`] derives.
    enabled: Arc<AtomicBool>,
}

impl std::fmt::Debug for Adapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapters")
            .field("cfg", &self.cfg)
            .field("source", &self.source.as_ref().map(|s| s.location()))
            .field("enabled", &self.enabled())
            .finish()
    }
}

impl Adapters {
    /// Adapters of `cfg`, read from `source` (names as the model's: `<layer>.lora_A.weight`)
    /// when given, else initialised.
    pub fn new(cfg: LoraConfig, source: Option<Arc<dyn TensorSource>>) -> Result<Arc<Self>> {
        cfg.validate()?;
        Ok(Arc::new(Self {
            cfg,
            source,
            enabled: Arc::new(AtomicBool::new(true)),
        }))
    }

    /// These adapters reading their stored weights from `source` instead (a view of the same
    /// tensors under the model's names: Phi-3's fused `lora_B` split into its parts), with the
    /// same configuration and the same on/off switch.
    pub fn with_source(&self, source: Option<Arc<dyn TensorSource>>) -> Arc<Self> {
        Arc::new(Self {
            cfg: self.cfg.clone(),
            source,
            enabled: self.enabled.clone(),
        })
    }

    /// These adapters with configuration `cfg` (the same targets, converted: see
    /// `models::peft::for_transformers5`) reading from `source`, with the same on/off switch.
    pub fn with_config_and_source(
        &self,
        cfg: LoraConfig,
        source: Option<Arc<dyn TensorSource>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            source,
            enabled: self.enabled.clone(),
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    /// The adapters of the directly adapted parameter `name` (an expert's `gate_up_proj`, a
    /// router's `gate.weight`; see [`LoraConfig::target_parameters`]), for building its linear
    /// layers: every layer built with them is adapted, with the parameter's rank and alpha,
    /// when `name` is targeted, and none is otherwise. The same source and on/off switch.
    pub fn for_parameter(&self, name: &str) -> Arc<Self> {
        Arc::new(Self {
            cfg: self.cfg.for_parameter(name),
            source: self.source.clone(),
            enabled: self.enabled.clone(),
        })
    }

    /// Turns every adapter on or off (off: the base model). Every rank must set the same value.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst)
    }

    /// Where stored adapter weights come from, if any.
    pub fn source(&self) -> Option<&Arc<dyn TensorSource>> {
        self.source.as_ref()
    }
}

/// Whether a parameter name is an adapter's.
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// The initial value of adapter `name` with whole shape `shape` (`lora_A`: PEFT's
/// Kaiming-uniform bound `1/√in`; `lora_B`: zeros), f32, drawn from a generator keyed by `seed`
/// and `name` alone.
pub fn initial_adapter(name: &str, shape: &[usize], seed: u64, dev: &Device) -> Result<Tensor> {
    if name.ends_with(".lora_B.weight") {
        return Ok(Tensor::zeros(shape, DType::F32, dev)?);
    }
    let fan_in = *shape.last().unwrap_or(&1);
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let mut state = seed ^ fnv1a(name.as_bytes());
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let u = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect();
    Ok(Tensor::from_vec(values, shape, dev)?)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The adapter of one linear layer: this rank's `A` and `B` blocks and the model's switch.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    /// `(r, in)` or, row-parallel, this rank's columns `(r, in/P)`.
    pub a: Tensor,
    /// `(out, r)` or, column-parallel, this rank's rows `(out/P, r)`.
    pub b: Tensor,
    pub scale: f64,
    adapters: Arc<Adapters>,
}

impl LoraWeights {
    pub fn new(a: Tensor, b: Tensor, adapters: Arc<Adapters>) -> Self {
        let scale = adapters.cfg.scale();
        Self {
            a,
            b,
            scale,
            adapters,
        }
    }

    /// Whether the model's adapters are on.
    pub fn enabled(&self) -> bool {
        self.adapters.enabled()
    }

    /// `x Aᵀ` for `x` `(.., in)` → `(.., r)`.
    pub fn down(&self, x: &Tensor) -> Result<Tensor> {
        super::linear(x, &self.a, None)
    }

    /// `s · h Bᵀ` for `h` `(.., r)` → `(.., out)`.
    pub fn up(&self, h: &Tensor) -> Result<Tensor> {
        Ok((super::linear(h, &self.b, None)? * self.scale)?)
    }

    /// These weights with `A` and `B` replaced by `a` and `b` (the same values passed through
    /// an op: a gradient reduction over a group, see [`super::moe`]).
    pub fn with_weights(&self, a: Tensor, b: Tensor) -> Self {
        Self {
            a,
            b,
            scale: self.scale,
            adapters: self.adapters.clone(),
        }
    }
}

/// The merged weight `W + s · B A` of a layer (any split, as long as the blocks match), in
/// `W`'s dtype, computed in f32.
pub fn merge(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let delta = super::matmul(&b.to_dtype(DType::F32)?, &a.to_dtype(DType::F32)?)?;
    Ok((w.to_dtype(DType::F32)? + (delta * scale)?)?.to_dtype(w.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_like_peft() {
        let t = LoraTargets::parse("q_proj, v_proj").unwrap();
        assert!(t.matches("model.layers.0.self_attn.q_proj"));
        assert!(!t.matches("model.layers.0.self_attn.k_proj"));
        assert!(!t.matches("model.layers.0.self_attn.xq_proj"));
        assert!(LoraTargets::parse("all-linear").unwrap().matches("a.b"));
        assert!(LoraTargets::parse(" , ").is_err());
    }

    #[test]
    fn initial_a_is_keyed_by_name_and_bounded() {
        let dev = Device::Cpu;
        let a = initial_adapter("l.lora_A.weight", &[4, 16], 7, &dev).unwrap();
        let again = initial_adapter("l.lora_A.weight", &[4, 16], 7, &dev).unwrap();
        let other = initial_adapter("m.lora_A.weight", &[4, 16], 7, &dev).unwrap();
        let v = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v, again.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert_ne!(v, other.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert!(v.iter().all(|x| x.abs() <= 0.25));
        assert!(v.iter().any(|x| x.abs() > 0.1));
        let b = initial_adapter("l.lora_B.weight", &[16, 4], 7, &dev).unwrap();
        assert_eq!(
            b.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }

    #[test]
    fn scale_follows_peft() {
        let mut c = LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: LoraTargets::AllLinear,
            use_rslora: false,
            seed: 0,
            target_parameters: vec!["gate_up_proj".into(), "down_proj".into()],
            rank_pattern: BTreeMap::from([(".*\\.gate_up_proj".to_string(), 8)]),
            alpha_pattern: BTreeMap::from([(".*\\.gate_up_proj".to_string(), 16.0)]),
        };
        assert_eq!(c.scale(), 2.0);
        let gu = "model.layers.0.mlp.experts.gate_up_proj";
        assert!(c.targets_parameter(gu));
        assert!(!c.targets_parameter("model.layers.0.mlp.gate.weight"));
        assert_eq!((c.rank_of(gu), c.alpha_of(gu)), (8, 16.0));
        let down = "model.layers.0.mlp.experts.down_proj";
        assert_eq!((c.rank_of(down), c.alpha_of(down)), (4, 8.0));
        let p = c.for_parameter(gu);
        assert_eq!(
            (p.rank, p.scale(), p.targets.matches("x.y")),
            (8, 2.0, true)
        );
        assert!(!c.for_parameter("m.gate.weight").targets.matches("x.y"));
        let mut bad = c.clone();
        bad.rank_pattern = BTreeMap::from([("(gate|up)".to_string(), 2)]);
        assert!(bad.validate().is_err());
        c.use_rslora = true;
        assert_eq!(c.scale(), 4.0);
        c.rank = 0;
        assert!(c.validate().is_err());
    }
}
