//! The mixture-of-experts fields that Mixtral's, Qwen2-MoE's and Qwen3-MoE's `config.json`
//! share, and how they become a [`MoeSpec`]. The families themselves are in [`super::mixtral`]
//! and [`super::qwen_moe`].

use std::path::Path;

use candle_parallel::nn::MoeConfig;
use serde::Deserialize;

use crate::decoder::{DecoderSpec, MoeSpec};
use crate::error::{Error, Result};

/// The routing fields every MoE family shares: the load-balancing loss (transformers adds
/// `router_aux_loss_coef · aux` to the loss when `output_router_logits` is true) and, ours,
/// `moe_capacity_factor` (token dropping, [`MoeConfig::with_capacity_factor`]; absent or null:
/// dropless, as transformers; `cpl train --moe-capacity-factor` writes it).
#[derive(Debug, Clone, Deserialize)]
pub struct RouterLossFields {
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default = "default_aux_coef")]
    pub router_aux_loss_coef: f64,
    #[serde(default)]
    pub moe_capacity_factor: Option<f64>,
}

fn default_aux_coef() -> f64 {
    0.001
}

impl RouterLossFields {
    /// The coefficient the loss uses (`None`: not added).
    pub fn coef(&self, path: &Path) -> Result<Option<f64>> {
        if !self.router_aux_loss_coef.is_finite() || self.router_aux_loss_coef < 0.0 {
            return Err(Error::config(
                path,
                format!(
                    "`router_aux_loss_coef` must be a finite number >= 0, got {}",
                    self.router_aux_loss_coef
                ),
            ));
        }
        Ok(self
            .output_router_logits
            .then_some(self.router_aux_loss_coef))
    }
}

/// Replaces the dense MLPs of `spec`'s `sparse` layers by `block`, at `folder` in each layer,
/// with the routing `fields`. Errors (naming `path` and the field) when the block's top-k is
/// impossible, or the coefficient or the capacity factor is not a finite number in range.
pub fn make_sparse(
    spec: &mut DecoderSpec,
    block: candle_parallel::Result<MoeConfig>,
    folder: &'static str,
    sparse: Vec<bool>,
    fields: &RouterLossFields,
    path: &Path,
) -> Result<()> {
    let aux_loss_coef = fields.coef(path)?;
    let block = block
        .map_err(|e| Error::config(path, e.to_string()))?
        .with_capacity_factor(fields.moe_capacity_factor)
        .map_err(|e| Error::config(path, format!("`moe_capacity_factor`: {e}")))?;
    spec.moe = Some(MoeSpec {
        block,
        folder,
        sparse,
        aux_loss_coef,
    });
    Ok(())
}

/// `config.json` text with the load-balancing loss's coefficient set for a run
/// (`cpl train --router-aux-loss-coef`): `router_aux_loss_coef` = `coef` and
/// `output_router_logits` = `coef > 0` (transformers adds the loss only then), every other
/// field kept. Errors (naming `path`) for a config without experts or a coefficient that is
/// negative or not finite.
pub fn set_router_aux_loss_coef(text: &str, coef: f64, path: &Path) -> Result<String> {
    if !coef.is_finite() || coef < 0.0 {
        return Err(Error::config(
            path,
            format!("--router-aux-loss-coef must be a finite number >= 0, got {coef}"),
        ));
    }
    set_moe_fields(
        text,
        "--router-aux-loss-coef",
        &[
            ("router_aux_loss_coef", coef.into()),
            ("output_router_logits", (coef > 0.0).into()),
        ],
        path,
    )
}

/// `config.json` text with token dropping for a run (`cpl train --moe-capacity-factor`):
/// `moe_capacity_factor` = `factor`, every other field kept. Errors (naming `path` and the flag)
/// for a config without experts or a factor that is not a finite number above 0.
pub fn set_moe_capacity_factor(text: &str, factor: f64, path: &Path) -> Result<String> {
    if !factor.is_finite() || factor <= 0.0 {
        return Err(Error::config(
            path,
            format!("--moe-capacity-factor must be a finite number above 0, got {factor}"),
        ));
    }
    set_moe_fields(
        text,
        "--moe-capacity-factor",
        &[("moe_capacity_factor", factor.into())],
        path,
    )
}

/// `text` with `fields` set, for a config with experts (else an error naming `flag`).
fn set_moe_fields(
    text: &str,
    flag: &str,
    fields: &[(&str, serde_json::Value)],
    path: &Path,
) -> Result<String> {
    let mut cfg: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| Error::config(path, format!("not a JSON object: {e}")))?;
    let experts = ["num_local_experts", "num_experts"]
        .iter()
        .any(|k| cfg.get(*k).and_then(|v| v.as_u64()).unwrap_or(0) > 0);
    if !experts {
        return Err(Error::config(
            path,
            format!(
                "{flag}: the model has no experts (no `num_local_experts` or `num_experts`): \
                 only mixture-of-experts models have routers"
            ),
        ));
    }
    for (k, v) in fields {
        cfg.insert((*k).into(), v.clone());
    }
    let mut out = serde_json::to_string_pretty(&cfg)
        .map_err(|e| Error::config(path, format!("writing the changed config: {e}")))?;
    out.push('\n');
    Ok(out)
}
