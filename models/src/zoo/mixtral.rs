//! Mixtral (`MixtralForCausalLM`): Mistral's decoder with a sparse block in every layer at
//! `block_sparse_moe`: a router (`gate`) and `num_local_experts` SwiGLU experts
//! (`experts.{e}.w1` gate, `w3` up, `w2` down), `num_experts_per_tok` per token with their
//! probabilities renormalised.

use std::path::Path;

use candle_parallel::nn::MoeConfig;
use serde::Deserialize;

use super::moe::{make_sparse, RouterLossFields};
use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// `config.json` of `MixtralForCausalLM` (`intermediate_size` is each expert's).
#[derive(Debug, Clone, Deserialize)]
pub struct MixtralConfig {
    #[serde(flatten)]
    pub base: LlamaConfig,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub router_jitter_noise: Option<f64>,
    #[serde(flatten)]
    pub router_loss: RouterLossFields,
}

impl MixtralConfig {
    fn parse(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid Mixtral config.json: {e}")))?;
        cfg.base
            .check_names(path, "MixtralForCausalLM", "mixtral")?;
        cfg.base.check_activation(path, "silu")?;
        cfg.base.validate_common(path)?;
        if cfg.sliding_window == Some(0) {
            return Err(Error::config(path, "`sliding_window` must be positive"));
        }
        if cfg.router_jitter_noise.unwrap_or(0.0) != 0.0 {
            return Err(Error::config(
                path,
                "`router_jitter_noise` > 0 (random router noise in training) is not supported: \
                 set it to 0",
            ));
        }
        cfg.spec(path)?;
        Ok(cfg)
    }

    fn spec(&self, path: &Path) -> Result<DecoderSpec> {
        let mut spec = self.base.base_spec("mixtral", path)?;
        for layer in &mut spec.layers {
            layer.window = self.sliding_window;
        }
        let block = MoeConfig::new(
            self.base.hidden_size,
            self.base.intermediate_size,
            self.num_local_experts,
            self.num_experts_per_tok,
        )
        .map(|b| {
            b.with_norm_topk_prob(true)
                .with_expert_names("w1", "w3", "w2")
        });
        let layers = spec.num_layers();
        make_sparse(
            &mut spec,
            block,
            "block_sparse_moe",
            vec![true; layers],
            &self.router_loss,
            path,
        )?;
        Ok(spec)
    }
}

impl ToDecoderSpec for MixtralConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.spec(Path::new("config.json"))
    }
}

impl DecoderConfig for MixtralConfig {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        Self::parse(text, path)
    }

    fn base(&self) -> &LlamaConfig {
        &self.base
    }
}

/// `MixtralForCausalLM` (Mixtral 8x7B, 8x22B).
pub static MIXTRAL: Family = Family {
    name: "mixtral",
    kind: Kind::CausalLm,
    architectures: &["MixtralForCausalLM"],
    model_types: &["mixtral"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<MixtralConfig>,
    load_causal_lm: Some(crate::decoder::load_family::<MixtralConfig>),
};
