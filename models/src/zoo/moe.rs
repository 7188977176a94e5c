//! The mixture-of-experts fields that Mixtral's, Qwen2-MoE's and Qwen3-MoE's `config.json`
//! share, and how they become a [`MoeSpec`]. The families themselves are in [`super::mixtral`]
//! and [`super::qwen_moe`].

use std::path::Path;

use candle_parallel::nn::MoeConfig;
use serde::Deserialize;

use crate::decoder::{DecoderSpec, MoeSpec};
use crate::error::{Error, Result};

/// The load-balancing loss's fields: transformers adds `router_aux_loss_coef · aux` to the loss
/// when `output_router_logits` is true.
#[derive(Debug, Clone, Deserialize)]
pub struct RouterLossFields {
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default = "default_aux_coef")]
    pub router_aux_loss_coef: f64,
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

/// Replaces the dense MLPs of `spec`'s `sparse` layers by `block`, at `folder` in each layer.
/// Errors (naming `path`) when the block's top-k is impossible.
pub fn make_sparse(
    spec: &mut DecoderSpec,
    block: candle_parallel::Result<MoeConfig>,
    folder: &'static str,
    sparse: Vec<bool>,
    aux_loss_coef: Option<f64>,
    path: &Path,
) -> Result<()> {
    let block = block.map_err(|e| Error::config(path, e.to_string()))?;
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
    let mut cfg: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| Error::config(path, format!("not a JSON object: {e}")))?;
    let experts = ["num_local_experts", "num_experts"]
        .iter()
        .any(|k| cfg.get(*k).and_then(|v| v.as_u64()).unwrap_or(0) > 0);
    if !experts {
        return Err(Error::config(
            path,
            "--router-aux-loss-coef: the model has no experts (no `num_local_experts` or \
             `num_experts`): only mixture-of-experts models have routers",
        ));
    }
    if !coef.is_finite() || coef < 0.0 {
        return Err(Error::config(
            path,
            format!("--router-aux-loss-coef must be a finite number >= 0, got {coef}"),
        ));
    }
    cfg.insert("router_aux_loss_coef".into(), coef.into());
    cfg.insert("output_router_logits".into(), (coef > 0.0).into());
    let mut out = serde_json::to_string_pretty(&cfg)
        .map_err(|e| Error::config(path, format!("writing the changed config: {e}")))?;
    out.push('\n');
    Ok(out)
}
