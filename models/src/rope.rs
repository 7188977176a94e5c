//! The rotary-embedding keys of a Hugging Face `config.json`, read as transformers 5 reads them
//! (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` / `standardize_rope_params` and the
//! `ROPE_INIT_FUNCTIONS` of `modeling_rope_utils.py`), for every model family.
//!
//! A family's config fills a [`RopeFields`] with its keys and calls [`RopeFields::resolve`],
//! which gives the [`RopeSpec`] that builds the [`RotaryEmbedding`] of its attention layers.
//! Both forms of the keys are read:
//! - v4: a top-level `rope_theta` and `rope_scaling: {"type" | "rope_type": .., ..}`;
//! - v5: `rope_parameters: {"rope_type": .., "rope_theta": .., ..}`, or per layer type
//!   (`rope_parameters: {"full_attention": {..}, "sliding_attention": {..}}`, Gemma 3), for which
//!   [`RopeFields::layer_type`] picks the entry; Gemma 3's v4 per-layer keys (`rope_theta` and
//!   `rope_scaling` for global layers, `rope_local_base_freq` for sliding ones) through
//!   [`RopeFields::gemma3_layer`].
//!
//! As in transformers: a non-empty `rope_scaling` takes precedence over a flat
//! `rope_parameters`; `rope_theta` and `partial_rotary_factor` inside the parameters win over the
//! top-level keys; `original_max_position_embeddings` defaults to `max_position_embeddings`, and
//! a top-level `original_max_position_embeddings` (Phi-3) overrides the one of flat parameters;
//! `rope_type` defaults to `type`, then `default`. Two quirks of transformers 5.23 are kept:
//! yarn's `truncate` is read from the top level of `rope_parameters`, so per-layer-type
//! parameters always truncate; yarn's `beta_fast` / `beta_slow` of 0 mean the defaults (32, 1),
//! like missing ones (Python's `or`).
//!
//! Unlike transformers, which only warns, out-of-range values are errors naming the field:
//! non-positive or non-finite factors, a longrope factor list of the wrong length, a partial
//! rotary factor outside (0, 1].

use std::path::Path;

use candle_parallel::ops::{
    longrope_attention_factor, yarn_attention_factor, RopeScaling, RotaryEmbedding,
};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The RoPE types [`RopeFields::resolve`] reads (transformers' names).
pub const SUPPORTED_TYPES: [&str; 6] =
    ["default", "linear", "dynamic", "yarn", "longrope", "llama3"];

/// Where a config keeps its rotary-embedding keys; see the [module docs](self).
#[derive(Debug, Clone, Copy)]
pub struct RopeFields<'a> {
    /// v4: the top-level base (also the fallback of v5 parameters without one).
    pub rope_theta: Option<f64>,
    /// v4: `{"type" | "rope_type": .., "factor": .., ..}`.
    pub rope_scaling: Option<&'a Value>,
    /// v5: flat, or one entry per layer type.
    pub rope_parameters: Option<&'a Value>,
    pub max_position_embeddings: usize,
    /// A top-level `original_max_position_embeddings` (Phi-3): overrides that of flat parameters
    /// for llama3, yarn and longrope.
    pub original_max_position_embeddings: Option<usize>,
    /// The attention head dimension.
    pub head_dim: usize,
    /// A top-level `partial_rotary_factor` (one inside the parameters wins).
    pub partial_rotary_factor: Option<f64>,
    /// The layer type whose entry of per-layer-type `rope_parameters` to read (`full_attention`,
    /// `sliding_attention`); flat parameters apply to every layer type.
    pub layer_type: Option<&'a str>,
    /// The base when neither the parameters nor `rope_theta` give one (transformers'
    /// `default_theta`: 10 000 for most families).
    pub default_theta: f64,
}

/// What [`RotaryEmbedding::with_rotary_dim`] needs, resolved from a config.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub head_dim: usize,
    /// transformers' `int(head_dim * partial_rotary_factor)`: the first `2 · ceil(dim / 2)` dims
    /// of each head rotate.
    pub dim: usize,
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// The rotary embedding of this spec (already validated by [`RopeFields::resolve`]).
    pub fn embedding(&self) -> Result<RotaryEmbedding> {
        Ok(RotaryEmbedding::with_rotary_dim(
            self.head_dim,
            self.dim,
            self.theta,
            &self.scaling,
        )?)
    }
}

/// The parameters one layer type reads, with where each key comes from (for error messages).
struct Params<'a> {
    /// `(prefix, dict)`, searched in order: v4 `rope_scaling` merged over a per-layer entry
    /// comes first.
    dicts: Vec<(String, &'a Map<String, Value>)>,
    nested: bool,
}

impl<'a> Params<'a> {
    fn get(&self, key: &str) -> Option<(String, &'a Value)> {
        self.dicts
            .iter()
            .find_map(|(p, d)| d.get(key).map(|v| (format!("{p}.{key}"), v)))
    }

    /// The field name of `key` for messages (where it is, or would be read).
    fn name(&self, key: &str) -> String {
        match self.get(key) {
            Some((n, _)) => n,
            None => format!(
                "{}.{key}",
                self.dicts
                    .first()
                    .map_or("rope_parameters", |(p, _)| p.as_str())
            ),
        }
    }
}

impl<'a> RopeFields<'a> {
    /// No RoPE keys: the default type with base 10 000 over whole heads.
    pub fn new(head_dim: usize, max_position_embeddings: usize) -> Self {
        Self {
            rope_theta: None,
            rope_scaling: None,
            rope_parameters: None,
            max_position_embeddings,
            original_max_position_embeddings: None,
            head_dim,
            partial_rotary_factor: None,
            layer_type: None,
            default_theta: 10_000.0,
        }
    }

    /// These fields for the layers of Gemma 3's `layer_type` (its `Gemma3TextConfig`): v5
    /// per-layer-type `rope_parameters` pick the entry; v4 keys give `sliding_attention`
    /// layers `rope_local_base_freq` (default 10 000) and no scaling, the others `rope_theta`
    /// (default 1 000 000) and `rope_scaling`.
    pub fn gemma3_layer(mut self, layer_type: &'a str, rope_local_base_freq: Option<f64>) -> Self {
        self.layer_type = Some(layer_type);
        if layer_type == "sliding_attention" {
            self.rope_theta = rope_local_base_freq;
            self.rope_scaling = None;
            self.default_theta = 10_000.0;
        } else {
            self.default_theta = 1_000_000.0;
        }
        self
    }

    /// The spec of the rotary embedding these keys describe; `path` names the config in errors,
    /// which name the field (`rope_scaling.factor`, `rope_parameters.full_attention.rope_type`).
    pub fn resolve(&self, path: &Path) -> Result<RopeSpec> {
        let err = |msg: String| Error::config(path, msg);
        let params = self.params(path)?;
        let num = |key: &str| -> Result<Option<f64>> {
            match params.get(key) {
                None => Ok(None),
                Some((_, Value::Null)) => Ok(None),
                Some((name, v)) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(format!("`{name}` must be a number, got {v}"))),
            }
        };
        let kind = match params.get("rope_type").or_else(|| params.get("type")) {
            None | Some((_, Value::Null)) => "default",
            Some((name, v)) => v
                .as_str()
                .ok_or_else(|| err(format!("`{name}` must be a string, got {v}")))?,
        };
        if !SUPPORTED_TYPES.contains(&kind) {
            return Err(err(format!(
                "`{}`: unsupported RoPE type `{kind}` (supported: {})",
                params.name(if params.get("rope_type").is_some() {
                    "rope_type"
                } else {
                    "type"
                }),
                SUPPORTED_TYPES.join(", ")
            )));
        }
        let required = |key: &str| -> Result<f64> {
            num(key)?.ok_or_else(|| {
                err(format!(
                    "RoPE type `{kind}` needs a numeric `{}`",
                    params.name(key)
                ))
            })
        };
        let positive = |key: &str, v: f64| -> Result<f64> {
            if v > 0.0 && v.is_finite() {
                Ok(v)
            } else {
                Err(err(format!(
                    "`{}` must be positive and finite, got {v}",
                    params.name(key)
                )))
            }
        };
        let length = |key: &str, v: f64| -> Result<usize> {
            if v >= 1.0 && v.fract() == 0.0 && v <= u32::MAX as f64 {
                Ok(v as usize)
            } else {
                Err(err(format!(
                    "`{}` must be a positive integer, got {v}",
                    params.name(key)
                )))
            }
        };

        let theta = match num("rope_theta")? {
            Some(t) => t,
            None => self.rope_theta.unwrap_or(self.default_theta),
        };
        positive("rope_theta", theta)?;
        let partial = match num("partial_rotary_factor")? {
            Some(f) => Some(f),
            None => self.partial_rotary_factor,
        };
        let dim = match partial {
            None => self.head_dim,
            Some(f) if f > 0.0 && f <= 1.0 => (self.head_dim as f64 * f) as usize,
            Some(f) => {
                return Err(err(format!(
                    "`{}` must be in (0, 1], got {f}",
                    params.name("partial_rotary_factor")
                )))
            }
        };
        let mpe = self.max_position_embeddings;
        // llama3, yarn and longrope: the pre-scaling context length.
        let original = || -> Result<usize> {
            if let (Some(top), false) = (self.original_max_position_embeddings, params.nested) {
                return Ok(top);
            }
            match num("original_max_position_embeddings")? {
                Some(v) => length("original_max_position_embeddings", v),
                None => Ok(mpe),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: positive("factor", required("factor")?)?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: positive("factor", required("factor")?)?,
                max_position_embeddings: mpe,
            },
            "llama3" => {
                let low = positive("low_freq_factor", required("low_freq_factor")?)?;
                let high = positive("high_freq_factor", required("high_freq_factor")?)?;
                if high <= low {
                    return Err(err(format!(
                        "`{}` ({high}) must be greater than `{}` ({low})",
                        params.name("high_freq_factor"),
                        params.name("low_freq_factor")
                    )));
                }
                RopeScaling::Llama3 {
                    factor: positive("factor", required("factor")?)?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: original()?,
                }
            }
            "yarn" => {
                let omp = original()?;
                // A `factor` key is required; null means `max_position_embeddings / original`.
                if params.get("factor").is_none() {
                    return Err(err(format!(
                        "RoPE type `yarn` needs a numeric `{}`",
                        params.name("factor")
                    )));
                }
                let factor = match num("factor")? {
                    Some(f) => f,
                    None => mpe as f64 / omp as f64,
                };
                let factor = positive("factor", factor)?;
                let attention_factor = match num("attention_factor")? {
                    Some(a) => positive("attention_factor", a)?,
                    None => yarn_attention_factor(factor, num("mscale")?, num("mscale_all_dim")?),
                };
                let beta = |key: &str, default: f64| -> Result<f64> {
                    match num(key)? {
                        Some(b) if b != 0.0 => {
                            if b.is_finite() {
                                Ok(b)
                            } else {
                                Err(err(format!("`{}` must be finite", params.name(key))))
                            }
                        }
                        _ => Ok(default),
                    }
                };
                let truncate = if params.nested {
                    true
                } else {
                    match params.get("truncate") {
                        None | Some((_, Value::Null)) => true,
                        Some((name, v)) => v.as_bool().ok_or_else(|| {
                            err(format!("`{name}` must be true or false, got {v}"))
                        })?,
                    }
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: omp,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    truncate,
                    attention_factor,
                }
            }
            "longrope" => {
                let omp = original()?;
                let freqs = dim.div_ceil(2);
                let list = |key: &str| -> Result<Vec<f64>> {
                    let name = params.name(key);
                    let Some((_, v)) = params.get(key) else {
                        return Err(err(format!(
                            "RoPE type `longrope` needs `{name}`, a list of {freqs} numbers"
                        )));
                    };
                    let values = v
                        .as_array()
                        .and_then(|a| a.iter().map(|x| x.as_f64()).collect::<Option<Vec<_>>>())
                        .ok_or_else(|| err(format!("`{name}` must be a list of numbers")))?;
                    if values.len() != freqs {
                        return Err(err(format!(
                            "`{name}` has {} values; a rotary dim of {dim} has {freqs} \
                             frequencies",
                            values.len()
                        )));
                    }
                    if let Some(bad) = values.iter().find(|&&f| !(f > 0.0 && f.is_finite())) {
                        return Err(err(format!(
                            "`{name}` values must be positive and finite, got {bad}"
                        )));
                    }
                    Ok(values)
                };
                let factor = match num("factor")? {
                    Some(f) => positive("factor", f)?,
                    None => mpe as f64 / omp as f64,
                };
                let attention_factor = match num("attention_factor")? {
                    Some(a) => positive("attention_factor", a)?,
                    None => longrope_attention_factor(factor, omp),
                };
                RopeScaling::LongRope {
                    short_factor: list("short_factor")?,
                    long_factor: list("long_factor")?,
                    original_max_position_embeddings: omp,
                    attention_factor,
                }
            }
            _ => unreachable!("checked against SUPPORTED_TYPES"),
        };
        let spec = RopeSpec {
            head_dim: self.head_dim,
            dim,
            theta,
            scaling,
        };
        // The remaining checks (dims, lengths): the embedding's own.
        spec.embedding().map_err(|e| {
            err(format!(
                "RoPE `{kind}` ({}): {e}",
                params
                    .dicts
                    .first()
                    .map_or("rope_theta", |(p, _)| p.as_str())
            ))
        })?;
        Ok(spec)
    }

    /// The parameter dicts of this layer type, in the order transformers' merging gives them
    /// precedence.
    fn params(&self, path: &Path) -> Result<Params<'a>> {
        let err = |msg: String| Error::config(path, msg);
        let object = |name: &str, v: &'a Value| -> Result<Option<&'a Map<String, Value>>> {
            match v {
                Value::Null => Ok(None),
                Value::Object(m) => Ok(Some(m)),
                other => Err(err(format!("`{name}` must be an object, got {other}"))),
            }
        };
        let scaling = match self.rope_scaling {
            Some(v) => object("rope_scaling", v)?.filter(|m| !m.is_empty()),
            None => None,
        };
        let parameters = match self.rope_parameters {
            Some(v) => object("rope_parameters", v)?,
            None => None,
        };
        let nested = parameters.filter(|m| is_nested(m));
        if let Some(per_type) = nested {
            let Some(layer_type) = self.layer_type else {
                return Err(err(format!(
                    "`rope_parameters` is given per layer type ({}), but this model has no \
                     layer types",
                    per_type.keys().cloned().collect::<Vec<_>>().join(", ")
                )));
            };
            let mut dicts = Vec::new();
            if let Some(s) = scaling {
                dicts.push(("rope_scaling".to_string(), s));
            }
            let name = format!("rope_parameters.{layer_type}");
            if let Some(v) = per_type.get(layer_type) {
                if let Some(m) = object(&name, v)? {
                    dicts.push((name, m));
                }
            }
            return Ok(Params {
                dicts,
                nested: true,
            });
        }
        let dicts = match (scaling, parameters) {
            (Some(s), _) => vec![("rope_scaling".to_string(), s)],
            (None, Some(p)) => vec![("rope_parameters".to_string(), p)],
            (None, None) => Vec::new(),
        };
        Ok(Params {
            dicts,
            nested: false,
        })
    }
}

/// Per-layer-type parameters: every value an object (or null) and none of the keys of flat
/// parameters (`rope_type`, `type`, `rope_theta`).
fn is_nested(m: &Map<String, Value>) -> bool {
    !m.is_empty()
        && !["rope_type", "type", "rope_theta"]
            .iter()
            .any(|k| m.contains_key(*k))
        && m.values().all(|v| v.is_object() || v.is_null())
}
