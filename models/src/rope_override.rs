//! Changing a checkpoint's rotary embedding for a run (context extension): a new `rope_theta`,
//! a RoPE scaling type with its parameters, a new `max_position_embeddings`, written into the
//! checkpoint's `config.json` in the form it already uses, so that the run trains with them and
//! every checkpoint it saves carries them (`cpl train --rope-theta / --rope-scaling ...`).
//!
//! Forms (see [`crate::rope`] for how both are read):
//! - v5 `rope_parameters`, flat: the override replaces its contents with `rope_theta`,
//!   `rope_type` and the type's parameters, exactly as transformers 5 saves a config whose
//!   `rope_parameters` was set to that dict;
//! - v5 per layer type (Gemma 3): the `full_attention` entry changes (sliding layers keep theirs);
//! - v4 (a top-level `rope_theta`, `rope_scaling` or neither; also any config of a transformers
//!   version below 5): `rope_theta` and `rope_scaling: {"rope_type": .., ..}` at the top level.
//!
//! Choices (stated because transformers leaves them to the user):
//! - `original_max_position_embeddings` defaults to the checkpoint's `max_position_embeddings`
//!   (its trained context) and is always written for the types that read it (yarn, longrope,
//!   llama3), so that changing `max_position_embeddings` never moves it;
//! - with a factor and no new `max_position_embeddings`, it becomes `original x factor` (as
//!   extended Qwen and Llama checkpoints declare), except for `dynamic`: transformers' dynamic
//!   NTK reads `max_position_embeddings` itself as the original context, so it is kept.
//! - `--rope-scaling default` removes a scaling; a theta alone keeps the checkpoint's scaling.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// A RoPE scaling type and its parameters, checked against what the type takes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RopeScalingArgs {
    /// transformers' `rope_type`: default, linear, dynamic, yarn, longrope or llama3.
    pub rope_type: String,
    pub factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub attention_factor: Option<f64>,
    pub short_factor: Option<Vec<f64>>,
    pub long_factor: Option<Vec<f64>>,
}

/// What a run changes in the rotary embedding; `None` fields keep the checkpoint's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RopeOverride {
    pub theta: Option<f64>,
    pub scaling: Option<RopeScalingArgs>,
    pub max_position_embeddings: Option<usize>,
}

/// The flag of each parameter, for errors (`cpl train`'s names).
fn flag(field: &str) -> &'static str {
    match field {
        "factor" => "--rope-factor",
        "original_max_position_embeddings" => "--original-max-position",
        "low_freq_factor" => "--rope-low-freq-factor",
        "high_freq_factor" => "--rope-high-freq-factor",
        "beta_fast" => "--rope-beta-fast",
        "beta_slow" => "--rope-beta-slow",
        "attention_factor" => "--rope-attention-factor",
        "short_factor" => "--rope-short-factor",
        "long_factor" => "--rope-long-factor",
        "rope_theta" => "--rope-theta",
        "max_position_embeddings" => "--max-position-embeddings",
        _ => "--rope-scaling",
    }
}

fn bad(path: &Path, msg: String) -> Error {
    Error::config(path, msg)
}

impl RopeScalingArgs {
    /// The parameters given, as (transformers field, JSON value).
    fn given(&self) -> Vec<(&'static str, Value)> {
        let mut v = Vec::new();
        let mut num = |k: &'static str, x: Option<f64>| {
            if let Some(x) = x {
                v.push((k, Value::from(x)));
            }
        };
        num("factor", self.factor);
        num("low_freq_factor", self.low_freq_factor);
        num("high_freq_factor", self.high_freq_factor);
        num("beta_fast", self.beta_fast);
        num("beta_slow", self.beta_slow);
        num("attention_factor", self.attention_factor);
        if let Some(o) = self.original_max_position_embeddings {
            v.push(("original_max_position_embeddings", Value::from(o)));
        }
        for (k, l) in [
            ("short_factor", &self.short_factor),
            ("long_factor", &self.long_factor),
        ] {
            if let Some(l) = l {
                v.push((k, Value::from(l.clone())));
            }
        }
        v
    }

    /// (fields the type takes, fields it requires).
    fn fields(&self, path: &Path) -> Result<(&'static [&'static str], &'static [&'static str])> {
        Ok(match self.rope_type.as_str() {
            "default" => (&[], &[]),
            "linear" => (&["factor"], &["factor"]),
            // transformers' dynamic NTK reads max_position_embeddings as the original context.
            "dynamic" => (&["factor"], &["factor"]),
            "yarn" => (
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "attention_factor",
                ],
                &["factor"],
            ),
            "longrope" => (
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "attention_factor",
                    "short_factor",
                    "long_factor",
                ],
                &["short_factor", "long_factor"],
            ),
            "llama3" => (
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "low_freq_factor",
                    "high_freq_factor",
                ],
                &["factor", "low_freq_factor", "high_freq_factor"],
            ),
            other => {
                return Err(bad(
                    path,
                    format!(
                        "--rope-scaling {other}: not a RoPE type (one of {})",
                        crate::rope::SUPPORTED_TYPES.join(", ")
                    ),
                ))
            }
        })
    }

    fn check(&self, path: &Path) -> Result<()> {
        let (takes, requires) = self.fields(path)?;
        let given = self.given();
        for (k, _) in &given {
            if !takes.contains(k) {
                return Err(bad(
                    path,
                    format!(
                        "{}: --rope-scaling {} does not take it (it takes {})",
                        flag(k),
                        self.rope_type,
                        if takes.is_empty() {
                            "no parameters".to_string()
                        } else {
                            takes.iter().map(|k| flag(k)).collect::<Vec<_>>().join(", ")
                        }
                    ),
                ));
            }
        }
        for k in requires {
            if !given.iter().any(|(g, _)| g == k) {
                return Err(bad(
                    path,
                    format!("--rope-scaling {} needs {}", self.rope_type, flag(k)),
                ));
            }
        }
        if let Some(f) = self.factor {
            if !(f.is_finite() && f > 1.0) {
                return Err(bad(
                    path,
                    format!("--rope-factor {f}: must be > 1 (a context extension)"),
                ));
            }
        }
        for (k, x) in [
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
            ("attention_factor", self.attention_factor),
        ] {
            if let Some(x) = x {
                if !(x.is_finite() && x > 0.0) {
                    return Err(bad(
                        path,
                        format!("{} {x}: must be finite and > 0", flag(k)),
                    ));
                }
            }
        }
        if let (Some(lo), Some(hi)) = (self.low_freq_factor, self.high_freq_factor) {
            if hi <= lo {
                return Err(bad(
                    path,
                    format!(
                        "--rope-high-freq-factor {hi} must be above --rope-low-freq-factor {lo}"
                    ),
                ));
            }
        }
        if self.original_max_position_embeddings == Some(0) {
            return Err(bad(path, "--original-max-position must be >= 1".into()));
        }
        for (k, l) in [
            ("short_factor", &self.short_factor),
            ("long_factor", &self.long_factor),
        ] {
            if let Some(l) = l {
                if l.is_empty() || l.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                    return Err(bad(
                        path,
                        format!("{}: a list of positive factors, got {l:?}", flag(k)),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether the type reads `original_max_position_embeddings`.
    fn reads_original(&self) -> bool {
        matches!(self.rope_type.as_str(), "yarn" | "longrope" | "llama3")
    }
}

impl RopeOverride {
    /// True when nothing changes.
    pub fn is_empty(&self) -> bool {
        self.theta.is_none() && self.scaling.is_none() && self.max_position_embeddings.is_none()
    }

    /// `config.json`'s text (read from `path`, named in errors) with the override applied,
    /// pretty-printed. The result still has to load through its family (the caller loads it).
    pub fn apply(&self, text: &str, path: &Path) -> Result<String> {
        let mut doc: Value =
            serde_json::from_str(text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
        let root = doc
            .as_object_mut()
            .ok_or_else(|| bad(path, "not a JSON object".into()))?;
        self.apply_to(root, path)?;
        serde_json::to_string_pretty(&doc)
            .map(|s| s + "\n")
            .map_err(|e| bad(path, format!("cannot write JSON: {e}")))
    }

    fn apply_to(&self, root: &mut Map<String, Value>, path: &Path) -> Result<()> {
        if let Some(t) = self.theta {
            if !(t.is_finite() && t > 0.0) {
                return Err(bad(
                    path,
                    format!("--rope-theta {t}: must be finite and > 0"),
                ));
            }
        }
        if let Some(0) = self.max_position_embeddings {
            return Err(bad(path, "--max-position-embeddings must be >= 1".into()));
        }
        let trained = match root.get("max_position_embeddings") {
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                bad(
                    path,
                    format!("max_position_embeddings {v} is not a positive integer"),
                )
            })? as usize),
            None => None,
        };
        // The scaling's parameters, with the original context made explicit.
        let scaling = match &self.scaling {
            None => None,
            Some(s) => {
                s.check(path)?;
                let mut params = Map::new();
                params.insert("rope_type".into(), Value::from(s.rope_type.clone()));
                for (k, v) in s.given() {
                    params.insert(k.into(), v);
                }
                if s.reads_original() && s.original_max_position_embeddings.is_none() {
                    let o = trained.ok_or_else(|| {
                        bad(
                            path,
                            format!(
                                "--rope-scaling {} needs --original-max-position: the config has \
                                 no max_position_embeddings",
                                s.rope_type
                            ),
                        )
                    })?;
                    params.insert("original_max_position_embeddings".into(), Value::from(o));
                }
                Some((s, params))
            }
        };
        let max_pos = match (self.max_position_embeddings, &scaling) {
            (Some(m), _) => Some(m),
            // Dynamic NTK takes max_position_embeddings as its original context: kept.
            (None, Some((s, params))) => match s.factor.filter(|_| s.rope_type != "dynamic") {
                Some(f) => {
                    let o = params
                        .get("original_max_position_embeddings")
                        .and_then(Value::as_u64)
                        .map(|o| o as usize)
                        .or(trained);
                    o.map(|o| (o as f64 * f).round() as usize)
                }
                None => None,
            },
            (None, None) => None,
        };
        let v5 = root.contains_key("rope_parameters")
            || (!root.contains_key("rope_scaling")
                && !root.contains_key("rope_theta")
                && root
                    .get("transformers_version")
                    .and_then(Value::as_str)
                    .and_then(|v| v.split('.').next())
                    .and_then(|m| m.parse::<u32>().ok())
                    .is_some_and(|m| m >= 5));
        if v5 {
            let theta_now = root.get("rope_theta").cloned();
            let rp = root
                .entry("rope_parameters")
                .or_insert_with(|| Value::Object(Map::new()));
            let rp = rp
                .as_object_mut()
                .ok_or_else(|| bad(path, "rope_parameters is not an object".into()))?;
            let nested = rp.values().any(Value::is_object);
            let target = if nested {
                rp.get_mut("full_attention")
                    .and_then(Value::as_object_mut)
                    .ok_or_else(|| {
                        bad(
                            path,
                            "rope_parameters is per layer type without a `full_attention` entry: \
                             which layers the override is for is ambiguous"
                                .into(),
                        )
                    })?
            } else {
                rp
            };
            let theta = self
                .theta
                .map(Value::from)
                .or_else(|| target.get("rope_theta").cloned())
                .or(theta_now);
            if let Some((_, params)) = &scaling {
                target.clear();
                target.extend(params.clone());
            }
            if let Some(t) = theta {
                target.insert("rope_theta".into(), t);
            }
            if !target.contains_key("rope_type") {
                target.insert("rope_type".into(), Value::from("default"));
            }
            // A stale top-level v4 key would be read before the parameters by nothing, but keep
            // one source of truth.
            root.remove("rope_scaling");
            root.remove("rope_theta");
        } else {
            if let Some(t) = self.theta {
                root.insert("rope_theta".into(), Value::from(t));
            }
            if let Some((s, params)) = scaling {
                if s.rope_type == "default" {
                    root.insert("rope_scaling".into(), Value::Null);
                } else {
                    root.insert("rope_scaling".into(), Value::Object(params));
                }
            }
        }
        if let Some(m) = max_pos {
            root.insert("max_position_embeddings".into(), Value::from(m));
        }
        Ok(())
    }
}
