//! Qwen2-MoE (`Qwen2MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen2's and Qwen3's
//! decoders with sparse blocks at `mlp`: a router (`gate`), `num_experts` SwiGLU experts of
//! `moe_intermediate_size` (`experts.{e}.gate_proj`, `up_proj`, `down_proj`),
//! `num_experts_per_tok` per token, renormalised when `norm_topk_prob`; Qwen2-MoE adds a shared
//! expert (`shared_expert`, `shared_expert_intermediate_size`) scaled by a sigmoid gate
//! (`shared_expert_gate`). Layer `i` is sparse when it is not in `mlp_only_layers` and
//! `(i + 1) % decoder_sparse_step == 0`, as transformers decides; other layers have a dense MLP
//! of `intermediate_size`.

use std::path::Path;

use candle_parallel::nn::MoeConfig;
use serde::Deserialize;

use super::moe::{make_sparse, RouterLossFields};
use super::qwen2::Qwen2Config;
use crate::decoder::{DecoderConfig, DecoderSpec, ToDecoderSpec};
use crate::error::{Error, Result};
use crate::family::{Family, Kind};
use crate::llama::LlamaConfig;

/// The sparse fields of a Qwen MoE `config.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct QwenMoeFields {
    /// `num_experts` on the Hub; transformers 5 writes `num_local_experts` for Qwen3-MoE.
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(flatten)]
    pub router_loss: RouterLossFields,
}

fn one() -> usize {
    1
}

/// `config.json` of a Qwen MoE family: Qwen2's fields and the sparse ones.
#[derive(Debug, Clone)]
pub struct QwenMoeConfig {
    pub dense: Qwen2Config,
    pub moe: QwenMoeFields,
    /// Qwen3-MoE (q/k norms, no attention biases, no shared expert) or Qwen2-MoE.
    pub qwen3: bool,
}

impl QwenMoeConfig {
    fn parse(text: &str, path: &Path, qwen3: bool) -> Result<Self> {
        let (arch, model_type) = if qwen3 {
            ("Qwen3MoeForCausalLM", "qwen3_moe")
        } else {
            ("Qwen2MoeForCausalLM", "qwen2_moe")
        };
        let dense = Qwen2Config::parse_as(text, path, arch, model_type)?;
        let moe: QwenMoeFields = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid {arch} config.json: {e}")))?;
        let cfg = Self { dense, moe, qwen3 };
        cfg.spec(path)?;
        Ok(cfg)
    }

    fn spec(&self, path: &Path) -> Result<DecoderSpec> {
        let family = if self.qwen3 { "qwen3_moe" } else { "qwen2_moe" };
        let mut spec = self.dense.windowed_spec(family, path)?;
        if self.qwen3 {
            spec.qk_norm = true;
        } else {
            (spec.qkv_bias, spec.o_bias) = (true, false);
        }
        let m = &self.moe;
        if m.decoder_sparse_step == 0 {
            return Err(Error::config(
                path,
                "`decoder_sparse_step` must be positive",
            ));
        }
        let layers = spec.num_layers();
        if let Some(&l) = m.mlp_only_layers.iter().find(|&&l| l >= layers) {
            return Err(Error::config(
                path,
                format!("`mlp_only_layers` names layer {l} of {layers} (num_hidden_layers)"),
            ));
        }
        let sparse = (0..layers)
            .map(|i| {
                m.num_experts > 0
                    && !m.mlp_only_layers.contains(&i)
                    && (i + 1) % m.decoder_sparse_step == 0
            })
            .collect();
        let shared = m.shared_expert_intermediate_size.filter(|_| !self.qwen3);
        let block = MoeConfig::new(
            spec.hidden_size,
            m.moe_intermediate_size,
            m.num_experts,
            m.num_experts_per_tok,
        )
        .map(|b| {
            b.with_norm_topk_prob(m.norm_topk_prob)
                .with_shared_expert(shared)
        });
        make_sparse(&mut spec, block, "mlp", sparse, &m.router_loss, path)?;
        Ok(spec)
    }
}

impl ToDecoderSpec for QwenMoeConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.spec(Path::new("config.json"))
    }
}

/// `config.json` of `Qwen2MoeForCausalLM`.
#[derive(Debug, Clone)]
pub struct Qwen2MoeConfig(pub QwenMoeConfig);

/// `config.json` of `Qwen3MoeForCausalLM`.
#[derive(Debug, Clone)]
pub struct Qwen3MoeConfig(pub QwenMoeConfig);

impl ToDecoderSpec for Qwen2MoeConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.0.decoder_spec()
    }
}

impl ToDecoderSpec for Qwen3MoeConfig {
    fn decoder_spec(&self) -> Result<DecoderSpec> {
        self.0.decoder_spec()
    }
}

impl DecoderConfig for Qwen2MoeConfig {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        QwenMoeConfig::parse(text, path, false).map(Self)
    }

    fn base(&self) -> &LlamaConfig {
        &self.0.dense.base
    }
}

impl DecoderConfig for Qwen3MoeConfig {
    fn from_json(text: &str, path: &Path) -> Result<Self> {
        QwenMoeConfig::parse(text, path, true).map(Self)
    }

    fn base(&self) -> &LlamaConfig {
        &self.0.dense.base
    }
}

/// `Qwen2MoeForCausalLM` (Qwen1.5-MoE, Qwen2-57B-A14B).
pub static QWEN2_MOE: Family = Family {
    name: "qwen2_moe",
    kind: Kind::CausalLm,
    architectures: &["Qwen2MoeForCausalLM"],
    model_types: &["qwen2_moe"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Qwen2MoeConfig>,
    load_causal_lm: Some(crate::decoder::load_family::<Qwen2MoeConfig>),
};

/// `Qwen3MoeForCausalLM` (Qwen3-30B-A3B, Qwen3-235B-A22B).
pub static QWEN3_MOE: Family = Family {
    name: "qwen3_moe",
    kind: Kind::CausalLm,
    architectures: &["Qwen3MoeForCausalLM"],
    model_types: &["qwen3_moe"],
    weights_name: "model",
    extra_files: crate::family::TEXT_FILES,
    describe: crate::decoder::describe::<Qwen3MoeConfig>,
    load_causal_lm: Some(crate::decoder::load_family::<Qwen3MoeConfig>),
};
