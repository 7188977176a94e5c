//! [`DecoderSpec`]: what a decoder-only language model is, independent of the family whose
//! `config.json` it came from. Each family's file reads its config and maps it onto a spec
//! (`Qwen2Config::spec`, ...); the model ([`super::Decoder`]), its parameter names and shapes,
//! its description for the planner and the FLOPs formula are written once, against the spec.

use std::path::Path;

use candle_parallel::nn::{
    Activation, AttentionConfig, EmbeddingConfig, MlpConfig, MoeConfig, NormConfig,
};
use candle_parallel::ops::RotaryEmbedding;

use super::fused::{FusedLayout, FUSED_GATE_UP, FUSED_QKV};
use crate::error::{Error, Result};
use crate::family::Description;

/// How a norm's stored weight scales the normalised activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormStyle {
    /// `weight * x / rms(x)` (LLaMA, Qwen, Mistral).
    Weight,
    /// `(1 + weight) * x / rms(x)`, in f32 (Gemma).
    UnitOffset,
}

/// The sparse feed-forward blocks of a mixture-of-experts model (Mixtral, Qwen2-MoE,
/// Qwen3-MoE).
#[derive(Debug, Clone)]
pub struct MoeSpec {
    /// Each sparse block (router, experts, shared expert).
    pub block: MoeConfig,
    /// The sparse block's folder in a layer: `mlp` (Qwen) or `block_sparse_moe` (Mixtral).
    pub folder: &'static str,
    /// Per layer: sparse, or a dense MLP of `intermediate_size` at `mlp` (Qwen's
    /// `decoder_sparse_step` and `mlp_only_layers`).
    pub sparse: Vec<bool>,
    /// The load-balancing loss's coefficient when the loss includes it (transformers adds it
    /// when `output_router_logits` is true: `router_aux_loss_coef`); `None`: not added.
    pub aux_loss_coef: Option<f64>,
}

/// One decoder layer's attention: its window and its rotary embedding.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    /// Sliding window in tokens (`pq - pk < window`); `None`: global attention.
    pub window: Option<usize>,
    pub rope: RotaryEmbedding,
}

/// A decoder-only transformer (see the [module docs](self)). Checkpoint names are
/// transformers' LLaMA names (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
/// `mlp.gate_proj`, `input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`),
/// plus `self_attn.q_norm` / `k_norm` with q/k norms and `pre_feedforward_layernorm` /
/// `post_feedforward_layernorm` with sandwich norms. With [`DecoderSpec::fused_projections`]
/// the checkpoint fuses q/k/v and gate/up (Phi-3), which the model loads and saves through
/// [`super::fused`].
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    /// The family's short name, for errors.
    pub family: &'static str,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub norm_eps: f64,
    pub norm: NormStyle,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorms of q and k before RoPE.
    pub qk_norm: bool,
    /// [`Activation::SwiGlu`] or [`Activation::GeGluTanh`].
    pub activation: Activation,
    /// Gemma's four norms per layer: the attention's and the MLP's outputs are normalised
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) before their residual add,
    /// and the MLP's input by `pre_feedforward_layernorm`. Without: LLaMA's two pre-norms
    /// (`input_layernorm`, and `post_attention_layernorm` before the MLP).
    pub sandwich_norms: bool,
    /// The embeddings are multiplied by this (rounded to their dtype first, as transformers
    /// does: Gemma's `sqrt(hidden_size)`).
    pub embed_scale: Option<f64>,
    /// Softmax scale (`1/sqrt(head_dim)` unless the family says otherwise).
    pub attn_scale: f32,
    /// Attention-logit soft-cap (Gemma 2's `attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// Final-logit soft-cap (Gemma 2's `final_logit_softcapping`), in the loss and the logits.
    pub final_softcap: Option<f32>,
    pub tie_word_embeddings: bool,
    /// The checkpoint stores q, k and v fused as `self_attn.qkv_proj` and gate and up as
    /// `mlp.gate_up_proj` (Phi-3): see [`super::fused`]. The model's parameters keep the
    /// parts' names; [`DecoderSpec::fused_layout`] maps them.
    pub fused_projections: bool,
    /// Sparse feed-forward blocks (mixture of experts) instead of dense MLPs, where set.
    pub moe: Option<MoeSpec>,
    /// One per decoder layer.
    pub layers: Vec<LayerSpec>,
}

impl DecoderSpec {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The attention of layer `i`.
    pub fn attention_config(&self, i: usize) -> Result<AttentionConfig> {
        let layer = self.layer(i)?;
        let qk_norm = self.qk_norm.then(|| self.norm_config(self.head_dim));
        Ok(AttentionConfig::new(
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        .with_biases(self.qkv_bias, self.o_bias)
        .with_qk_norm(qk_norm)
        .with_window(layer.window)
        .with_scale(self.attn_scale)
        .with_softcap(self.attn_softcap)
        .with_rope(layer.rope.clone())
        .with_fused_qkv(self.fused_projections.then_some(FUSED_QKV)))
    }

    fn layer(&self, i: usize) -> Result<&LayerSpec> {
        self.layers.get(i).ok_or_else(|| {
            Error::Invalid(format!(
                "layer {i} of a model with {} layers",
                self.layers.len()
            ))
        })
    }

    /// The gated MLP of a decoder layer.
    pub fn mlp_config(&self) -> MlpConfig {
        MlpConfig::swiglu(self.hidden_size, self.intermediate_size)
            .with_activation(self.activation)
            .with_bias(self.mlp_bias)
            .with_fused_gate_up(self.fused_projections.then_some(FUSED_GATE_UP))
    }

    /// How a mixture of experts' adapters are stored (PEFT's stacked experts), if it has one.
    pub fn experts_layout(&self) -> Option<super::experts::ExpertsLayout> {
        self.moe
            .as_ref()
            .map(|m| super::experts::ExpertsLayout::new(m.folder, &m.block))
    }

    /// How the checkpoint fuses projections the model runs apart (Phi-3), if it does.
    pub fn fused_layout(&self) -> Option<FusedLayout> {
        self.fused_projections.then(|| {
            FusedLayout::phi3(
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.intermediate_size,
            )
        })
    }

    /// The names of the linear layers of a decoder layer that LoRA can target, in checkpoint
    /// names.
    pub fn linear_names(&self) -> &'static [&'static str] {
        if self.moe.is_some() {
            // The experts and routers are targeted as parameters (PEFT's target_parameters:
            // experts.gate_up_proj, experts.down_proj, gate.weight; see crate::peft).
            &["q_proj", "k_proj", "v_proj", "o_proj"]
        } else if self.fused_projections {
            &[FUSED_QKV, "o_proj", FUSED_GATE_UP, "down_proj"]
        } else {
            &[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
        }
    }

    /// A norm of `features` features in this model's style.
    pub fn norm_config(&self, features: usize) -> NormConfig {
        NormConfig::new(features, self.norm_eps)
            .with_unit_offset(self.norm == NormStyle::UnitOffset)
    }

    /// The embedding table and the LM head.
    pub fn embedding_config(&self) -> EmbeddingConfig {
        EmbeddingConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
        }
    }

    /// The sparse block of layer `i`, or `None` for a dense MLP.
    pub fn sparse_block(&self, i: usize) -> Option<&MoeSpec> {
        self.moe
            .as_ref()
            .filter(|m| m.sparse.get(i).copied().unwrap_or(false))
    }

    /// The norms of a decoder layer, in checkpoint names.
    pub fn layer_norm_names(&self) -> &'static [&'static str] {
        if self.sandwich_norms {
            &[
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ]
        } else {
            &["input_layernorm", "post_attention_layernorm"]
        }
    }

    /// The name and shape of every parameter, as in a Hugging Face checkpoint (fused
    /// projections fused).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let parts = self.part_shapes();
        match self.fused_layout() {
            Some(layout) => layout.fuse_shapes(parts),
            None => parts,
        }
    }

    /// The name and shape of every parameter of the model (q, k, v, gate and up apart).
    fn part_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let mut out = vec![
            ("model.embed_tokens.weight".to_string(), vec![v, h]),
            ("model.norm.weight".to_string(), vec![h]),
        ];
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".into(), vec![v, h]));
        }
        for l in 0..self.num_layers() {
            let p = |n: &str| format!("model.layers.{l}.{n}");
            for norm in self.layer_norm_names() {
                out.push((p(&format!("{norm}.weight")), vec![h]));
            }
            if self.qk_norm {
                out.push((p("self_attn.q_norm.weight"), vec![self.head_dim]));
                out.push((p("self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            let mut linears = vec![
                ("self_attn.q_proj", vec![q, h], self.qkv_bias),
                ("self_attn.k_proj", vec![kv, h], self.qkv_bias),
                ("self_attn.v_proj", vec![kv, h], self.qkv_bias),
                ("self_attn.o_proj", vec![h, q], self.o_bias),
            ];
            match self.sparse_block(l) {
                Some(m) => {
                    for (name, shape) in m.block.parameter_shapes() {
                        out.push((p(&format!("{}.{name}", m.folder)), shape));
                    }
                }
                None => linears.extend([
                    ("mlp.gate_proj", vec![i, h], self.mlp_bias),
                    ("mlp.up_proj", vec![i, h], self.mlp_bias),
                    ("mlp.down_proj", vec![h, i], self.mlp_bias),
                ]),
            }
            for (name, shape, bias) in linears {
                if bias {
                    out.push((p(&format!("{name}.bias")), vec![shape[0]]));
                }
                out.push((p(&format!("{name}.weight")), shape));
            }
        }
        out
    }

    /// Number of parameters of the whole model.
    pub fn num_parameters(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// Parameters of the sparse blocks a token does not use (the experts it is not routed
    /// to): total minus active parameters.
    pub fn inactive_parameters(&self) -> usize {
        (0..self.num_layers())
            .filter_map(|l| self.sparse_block(l))
            .map(|m| {
                let b = &m.block;
                (b.num_experts - b.top_k) * 3 * b.hidden_size * b.expert_intermediate_size
            })
            .sum()
    }

    /// The shape `cpl plan --auto`'s cost model plans for: the windowed layers' count, which
    /// they are (up to 128 layers), and their window (the largest, should the layers' windows
    /// differ: every family of the registry gives its windowed layers one `sliding_window`).
    pub fn planner_shape(&self) -> candle_parallel::planner::ModelShape {
        let windows = self.layers.iter().filter_map(|l| l.window);
        let windowed = windows.clone().count();
        let layer_mask = (self.layers.len() <= 128).then(|| {
            self.layers
                .iter()
                .enumerate()
                .filter(|(_, l)| l.window.is_some())
                .fold(0u128, |m, (i, _)| m | 1u128 << i)
        });
        candle_parallel::planner::ModelShape {
            layers: self.num_layers(),
            hidden: self.hidden_size,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate_size,
            vocab: self.vocab_size,
            tied_embeddings: self.tie_word_embeddings,
            moe: self.moe.as_ref().map(|m| {
                let b = &m.block;
                candle_parallel::planner::MoeShape {
                    experts: b.num_experts,
                    top_k: b.top_k,
                    expert_intermediate: b.expert_intermediate_size,
                    shared_intermediate: b.shared_expert.unwrap_or(0),
                    sparse_layers: m.sparse.iter().filter(|&&s| s).count(),
                }
            }),
            window: windows
                .max()
                .map(|window| candle_parallel::planner::WindowShape {
                    window,
                    windowed_layers: windowed,
                    layer_mask,
                }),
        }
    }

    /// Size and FLOPs terms ([`Description`]); windowed layers count the keys their window
    /// lets a query see.
    pub fn description(&self) -> Description {
        let lookup = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * self.hidden_size
        };
        let params = self.num_parameters() as u64;
        let inactive = self.inactive_parameters() as u64;
        Description {
            params,
            matmul_params: params.saturating_sub(lookup as u64 + inactive),
            layers: self.num_layers(),
            hidden: self.hidden_size,
            vocab: self.vocab_size,
            attention_width: self
                .layers
                .iter()
                .filter(|l| l.window.is_none())
                .map(|_| (self.num_heads * self.head_dim) as u64)
                .sum(),
            windowed: self
                .layers
                .iter()
                .filter_map(|l| l.window)
                .map(|w| ((self.num_heads * self.head_dim) as u64, w))
                .collect(),
            causal: true,
            planner_shape: Some(self.planner_shape()),
            pieces: Some(self.pieces()),
            summary: self.summary(),
        }
    }

    /// The terms of [`DecoderSpec::description`] piece by piece: each layer's parameters (its
    /// experts' active share) and attention; the input embedding is a lookup on the first
    /// stage; the final norm and the head (the tied embedding, or `lm_head`) on the last.
    fn pieces(&self) -> crate::family::Pieces {
        use crate::family::{Piece, Pieces};
        let width = (self.num_heads * self.head_dim) as u64;
        let mut pieces = Pieces {
            layers: self
                .layers
                .iter()
                .map(|l| match l.window {
                    Some(w) => Piece {
                        windowed: Some((width, w)),
                        ..Piece::default()
                    },
                    None => Piece {
                        attention_width: width,
                        ..Piece::default()
                    },
                })
                .collect(),
            ..Pieces::default()
        };
        for (name, shape) in self.parameter_shapes() {
            let n = shape.iter().product::<usize>() as f64;
            let layer = name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|l| l.parse::<usize>().ok());
            match layer {
                Some(l) if l < pieces.layers.len() => pieces.layers[l].matmul_params += n,
                _ if name == "model.embed_tokens.weight" && !self.tie_word_embeddings => {}
                _ => pieces.last.matmul_params += n,
            }
        }
        for (l, piece) in pieces.layers.iter_mut().enumerate() {
            if let Some(m) = self.sparse_block(l) {
                let b = &m.block;
                piece.matmul_params -=
                    ((b.num_experts - b.top_k) * 3 * b.hidden_size * b.expert_intermediate_size)
                        as f64;
            }
        }
        pieces
    }

    /// `2 layers, hidden 32, intermediate 64, 4 heads / 2 kv heads, head_dim 8, vocab 256`,
    /// then what differs from LLaMA (tied embeddings, biases, q/k norms, GeGLU, sandwich norms,
    /// windows, ...).
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} layers, hidden {}, intermediate {}, {} heads / {} kv heads, head_dim {}, vocab {}",
            self.num_layers(),
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size
        );
        let mut add = |on: bool, what: &str| {
            if on {
                s.push_str(", ");
                s.push_str(what);
            }
        };
        add(self.tie_word_embeddings, "tied embeddings");
        add(self.qkv_bias && self.o_bias, "attention biases");
        add(self.qkv_bias && !self.o_bias, "q/k/v biases");
        add(self.mlp_bias, "MLP biases");
        add(self.qk_norm, "q/k norms");
        add(self.activation == Activation::GeGluTanh, "GeGLU (tanh)");
        add(self.fused_projections, "fused qkv / gate-up projections");
        add(self.norm == NormStyle::UnitOffset, "(1 + w) RMSNorm");
        add(self.sandwich_norms, "pre/post norms");
        add(self.embed_scale.is_some(), "scaled embeddings");
        add(self.attn_softcap.is_some(), "attention logit soft-cap");
        add(self.final_softcap.is_some(), "final logit soft-cap");
        if let Some(m) = &self.moe {
            let b = &m.block;
            let sparse = m.sparse.iter().filter(|&&s| s).count();
            s.push_str(&format!(
                ", {} experts of {} (top {}{}) on {sparse} of {} layers{}, {} of {} parameters \
                 active",
                b.num_experts,
                b.expert_intermediate_size,
                b.top_k,
                if b.norm_topk_prob {
                    ", renormalised"
                } else {
                    ""
                },
                self.num_layers(),
                b.shared_expert
                    .map_or(String::new(), |i| format!(", shared expert of {i}")),
                self.num_parameters() - self.inactive_parameters(),
                self.num_parameters(),
            ));
        }
        let windows: Vec<usize> = self.layers.iter().filter_map(|l| l.window).collect();
        if let Some(w) = windows.first() {
            s.push_str(&format!(
                ", sliding window {w} on {} of {} layers",
                windows.len(),
                self.num_layers()
            ));
        }
        // The rotary embedding: one for every layer, or one for the global and one for the
        // windowed layers (Gemma 3).
        let of = |windowed: bool| -> Vec<String> {
            let mut v: Vec<String> = self
                .layers
                .iter()
                .filter(|l| l.window.is_some() == windowed)
                .map(|l| rope_summary(&l.rope))
                .collect();
            v.dedup();
            v
        };
        let (global, local) = (of(false), of(true));
        if global.len() <= 1 && local.len() <= 1 {
            match (global.first(), local.first()) {
                (Some(g), Some(l)) if g != l => s.push_str(&format!(
                    ", RoPE {g} on global layers, {l} on windowed layers"
                )),
                (Some(r), _) | (None, Some(r)) => s.push_str(&format!(", RoPE {r}")),
                (None, None) => {}
            }
        } else {
            s.push_str(", RoPE per layer");
        }
        s
    }
}

/// `yarn θ 10000, factor 4 of 4096 tokens, rotary 32 of 64 dims`: a rotary embedding's type,
/// base and what sets its context, as `cpl inspect` prints it.
fn rope_summary(r: &candle_parallel::ops::RotaryEmbedding) -> String {
    use candle_parallel::ops::RopeScaling as S;
    let mut t = format!("{} θ {}", r.scaling().name(), r.theta());
    match r.scaling() {
        S::Default => {}
        S::Linear { factor } => t.push_str(&format!(", factor {factor}")),
        S::Dynamic {
            factor,
            max_position_embeddings: n,
        } => t.push_str(&format!(", factor {factor} beyond {n} tokens")),
        S::Llama3 {
            factor,
            original_max_position_embeddings: n,
            ..
        }
        | S::Yarn {
            factor,
            original_max_position_embeddings: n,
            ..
        } => t.push_str(&format!(", factor {factor} of {n} tokens")),
        S::LongRope {
            original_max_position_embeddings: n,
            ..
        } => t.push_str(&format!(", long factors beyond {n} tokens")),
    }
    if r.rotated_dims() < r.head_dim() {
        t.push_str(&format!(
            ", rotary {} of {} dims",
            r.rotated_dims(),
            r.head_dim()
        ));
    }
    t
}

/// transformers' name of a layer with global attention in `layer_types`.
pub const FULL_ATTENTION: &str = "full_attention";
/// transformers' name of a layer with sliding-window attention in `layer_types`.
pub const SLIDING_ATTENTION: &str = "sliding_attention";

/// Whether each of `layers` layers is windowed: from `layer_types` when the config has it
/// (transformers writes it), else `default_sliding(i)` (the family's rule). Errors name
/// `layer_types` when its length or a value is wrong.
pub fn sliding_layers(
    layer_types: Option<&[String]>,
    default_sliding: impl Fn(usize) -> bool,
    layers: usize,
    path: &Path,
) -> Result<Vec<bool>> {
    let Some(types) = layer_types else {
        return Ok((0..layers).map(default_sliding).collect());
    };
    if types.len() != layers {
        return Err(Error::config(
            path,
            format!(
                "`layer_types` has {} entries for {layers} layers (num_hidden_layers)",
                types.len()
            ),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            FULL_ATTENTION => Ok(false),
            SLIDING_ATTENTION => Ok(true),
            other => Err(Error::config(
                path,
                format!(
                    "unsupported `layer_types` entry `{other}` (supported: {FULL_ATTENTION}, \
                     {SLIDING_ATTENTION})"
                ),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use candle_parallel::planner::WindowShape;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/zoo")
            .join(name)
            .join("config.json")
    }

    /// The planner sees the windowed layers and which they are: Mistral's every layer, Gemma
    /// 3's local ones (`layer_types`), with the config's `sliding_window`; none without a
    /// window.
    #[test]
    fn planner_shape_carries_the_windowed_layers() {
        let window = |name: &str| {
            let path = fixture(name);
            let family = crate::family::detect(&path).unwrap();
            let d = (family.describe)(&path).unwrap();
            d.planner_shape.unwrap().window
        };
        let w = |window, windowed_layers, mask| {
            Some(WindowShape {
                window,
                windowed_layers,
                layer_mask: Some(mask),
            })
        };
        assert_eq!(window("mistral"), w(8, 2, 0b11));
        // Gemma 3's `layer_types`: sliding, sliding, full.
        assert_eq!(window("gemma3"), w(8, 2, 0b011));
        let text = r#"{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
            "rms_norm_eps": 1e-6}"#;
        let cfg = crate::llama::LlamaConfig::from_json(text, std::path::Path::new("x")).unwrap();
        use crate::decoder::ToDecoderSpec;
        assert_eq!(cfg.decoder_spec().unwrap().planner_shape().window, None);
    }

    /// The pipeline pieces add up to the whole model's FLOPs for every family (dense, tied,
    /// windowed, sparse; training, frozen and forward; sequences shorter and longer than the
    /// windows), to the sums' rounding (1e-12 relative: a few additions of f64 terms). A
    /// windowed layer costs less than a global one at 64 tokens, a sparse layer counts the
    /// experts a token uses (the sum's test), and the head sits on the last stage.
    #[test]
    fn pipeline_pieces_add_up_to_the_model() {
        use crate::family::Work;
        let dirs = [
            "zoo/qwen2",
            "zoo/qwen3",
            "zoo/mistral",
            "zoo/gemma2",
            "zoo/gemma3",
            "zoo/phi3",
            "llama/gqa",
            "moe/mixtral",
            "moe/qwen2_moe",
            "moe/qwen3_moe",
        ];
        for dir in dirs {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures")
                .join(dir)
                .join("config.json");
            let family = crate::family::detect(&path).unwrap();
            let d = (family.describe)(&path).unwrap();
            assert!(d.pieces.is_some(), "{dir}");
            for work in [Work::Training, Work::FrozenTraining, Work::Forward] {
                for seq in [4, 64] {
                    let c = d.stage_costs(seq, work);
                    assert_eq!(c.layers.len(), d.layers, "{dir}");
                    let sum = c.first + c.layers.iter().sum::<f64>() + c.last;
                    let want = d.flops_per_token(seq, work);
                    assert!(
                        (sum - want).abs() <= 1e-12 * want,
                        "{dir} {work:?} {seq}: pieces {sum} vs {want}"
                    );
                    assert_eq!(c.first, 0.0, "{dir}: the embedding is a lookup");
                    assert!(c.last > 0.0, "{dir}: the head");
                }
            }
        }
        // Gemma 3's fixture: layers 0 and 1 see 8 tokens, layer 2 all 64.
        let path = fixture("gemma3");
        let d = (crate::family::detect(&path).unwrap().describe)(&path).unwrap();
        let g = d.stage_costs(64, Work::Training);
        assert_eq!(g.layers[0], g.layers[1], "{g:?}");
        assert!(g.layers[0] < g.layers[2], "{g:?}");
    }
}
