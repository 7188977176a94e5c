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
