//! The model-family registry: which family a checkpoint belongs to, what it is, how it is
//! described and saved. Every command routes through it; none names a family.
//!
//! A family is one [`Family`] value: the `architectures` (or diffusers `_class_name`) and
//! `model_type` values of `config.json` it claims, its [`Kind`] (which objectives and commands
//! it runs), the stem of its weight files, the files copied beside the weights into every
//! checkpoint, and [`Family::describe`]: its size and its model FLOPs per token
//! ([`Description::flops_per_token`], the one formula every progress line, metrics file,
//! benchmark and the planner use). Causal LM families also load themselves for a layout
//! ([`Family::load_causal_lm`]) as a [`CausalLm`].
//!
//! The built-in families are [`LLAMA`], those of [`crate::zoo`] (Qwen2, Qwen3, Mistral, Gemma 2
//! and 3, Phi-3, and the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE),
//! [`DIT`] and [`LLAVA`]; [`register`] adds one from
//! outside the crate (a program with its own model file).

use std::path::Path;
use std::sync::{Arc, RwLock};

use candle_core::DType;
use candle_parallel::nn::{Adapters, ParallelCtx, ParamList, ParamMode};
use candle_parallel::pipeline::StageCosts;
use candle_parallel::planner::ModelShape;

use crate::causal_lm::CausalLm;
use crate::error::{Error, Result};
use crate::hub::ModelFiles;

/// What a family's models are, which decides the objectives and commands they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A causal language model ([`CausalLm`]): train, finetune, eval, generate.
    CausalLm,
    /// A class-conditional diffusion transformer (diffusers' DiT).
    Diffusion,
    /// A vision-language model: a vision tower and projector in front of a causal LM.
    VisionLanguage,
}

/// What a model's FLOPs are counted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// The forward pass (eval).
    Forward,
    /// Forward and backward, with the weights' gradients (full training).
    Training,
    /// Forward and backward of frozen weights (LoRA): the inputs' gradients but not the
    /// weights'; the adapters' own products are not counted.
    FrozenTraining,
}

/// A model's size and the terms of its FLOPs (see [`Description::flops_per_token`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Description {
    /// Every parameter.
    pub params: u64,
    /// Parameters that multiply an activation (all but lookups: an input embedding that is
    /// not also the head's matrix).
    pub matmul_params: u64,
    /// Blocks (decoder layers).
    pub layers: usize,
    /// Width of the activations between blocks.
    pub hidden: usize,
    /// Token vocabulary (0 for models that read no tokens).
    pub vocab: usize,
    /// Σ over the layers with global attention of query heads × head dim: attention's work
    /// per pair of tokens.
    pub attention_width: u64,
    /// The layers with a sliding window: `(query heads × head dim, window)` each (causal
    /// models).
    pub windowed: Vec<(u64, usize)>,
    /// Whether attention is causal (a token attends to half the pairs on average); causal
    /// models default to the zigzag ring layout, full-attention models to contiguous.
    pub causal: bool,
    /// The shape the planner models (causal LMs).
    pub planner_shape: Option<ModelShape>,
    /// The same terms piece by piece, for cutting the model into pipeline stages
    /// ([`Description::stage_costs`]); `None`: layers alike and free ends.
    pub pieces: Option<Pieces>,
    /// The architecture in one line, for `cpl inspect` (`2 layers, hidden 32, ...`).
    pub summary: String,
}

/// The FLOPs terms of one piece of a model (see [`Pieces`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Piece {
    /// Parameters that multiply an activation, per token (fractional where a parameter applies
    /// once per image and is spread over the image's tokens).
    pub matmul_params: f64,
    /// Query heads × head dim of its global attention (0: none).
    pub attention_width: u64,
    /// Its sliding-window attention: `(query heads × head dim, window)`.
    pub windowed: Option<(u64, usize)>,
}

/// A model's FLOPs terms split into what a pipeline cuts: what only the first stage runs (the
/// embedding, a patch embedding), each layer, and what only the last runs (the final norm, the
/// head). Summed, the terms of [`Description`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Pieces {
    pub first: Piece,
    pub layers: Vec<Piece>,
    pub last: Piece,
}

impl Description {
    /// Model FLOPs per token at `seq_len` tokens per sequence: `2 N + 4 A S c` forward (N
    /// the multiplying parameters, A the attention width, c one half for causal attention and
    /// one for full), plus `4 A_w K(S, w)` for each windowed layer, where `K` is the keys a
    /// query sees on average (`S / 2` up to `S = w`, then `w - w² / 2S`); training three times
    /// that, frozen-weight training `4 N + 3 · 4 A S c` (no weight gradients). Recomputation
    /// (activation checkpointing) is not useful work and is not counted. The only FLOPs formula
    /// of the workspace.
    pub fn flops_per_token(&self, seq_len: usize, work: Work) -> f64 {
        self.term_flops(
            self.matmul_params as f64,
            self.attention_width,
            &self.windowed,
            seq_len,
            work,
        )
    }

    /// Model FLOPs per token of each pipeline piece at `seq_len` tokens per sequence, by the
    /// formula of [`Description::flops_per_token`] applied to each piece's terms (their sum is
    /// that total); without [`Description::pieces`], the total over equal layers and free ends.
    /// What `--pp-layers auto` balances.
    pub fn stage_costs(&self, seq_len: usize, work: Work) -> StageCosts {
        match &self.pieces {
            Some(p) => {
                let f = |piece: &Piece| {
                    let windowed: Vec<(u64, usize)> = piece.windowed.into_iter().collect();
                    self.term_flops(
                        piece.matmul_params,
                        piece.attention_width,
                        &windowed,
                        seq_len,
                        work,
                    )
                };
                StageCosts {
                    first: f(&p.first),
                    layers: p.layers.iter().map(f).collect(),
                    last: f(&p.last),
                }
            }
            None => {
                let per_layer = self.flops_per_token(seq_len, work) / self.layers.max(1) as f64;
                StageCosts {
                    first: 0.0,
                    layers: vec![per_layer; self.layers],
                    last: 0.0,
                }
            }
        }
    }

    /// The formula of [`Description::flops_per_token`] for some of the terms.
    fn term_flops(
        &self,
        matmul_params: f64,
        attention_width: u64,
        windowed: &[(u64, usize)],
        seq_len: usize,
        work: Work,
    ) -> f64 {
        let weights = 2.0 * matmul_params;
        let share = if self.causal { 0.5 } else { 1.0 };
        let s = seq_len as f64;
        let windowed: f64 = windowed
            .iter()
            .map(|&(width, w)| {
                let w = w as f64;
                let keys = if s <= w {
                    s / 2.0
                } else {
                    w - w * w / (2.0 * s)
                };
                4.0 * width as f64 * keys
            })
            .sum();
        let attn = 4.0 * attention_width as f64 * s * share + windowed;
        match work {
            Work::Forward => weights + attn,
            Work::Training => 3.0 * (weights + attn),
            Work::FrozenTraining => 2.0 * weights + 3.0 * attn,
        }
    }
}

/// What loading a model for a layout needs besides its files.
#[derive(Clone)]
pub struct LoadSpec<'a> {
    pub ctx: &'a ParallelCtx,
    /// Parameter dtype (default: the checkpoint's declared dtype, else f32).
    pub dtype: Option<DType>,
    /// Trainable or frozen parameters.
    pub mode: ParamMode,
    /// The layers of this rank's pipeline chunks (every layer without a pipeline).
    pub layers: &'a [std::ops::Range<usize>],
    /// Whether this rank holds the model's two ends (embedding and head).
    pub ends: bool,
    /// LoRA adapters of the linear layers.
    pub adapters: Option<Arc<Adapters>>,
}

/// A causal LM loaded for a layout, with its parameter list.
pub struct LoadedCausalLm {
    pub model: Box<dyn CausalLm>,
    pub params: ParamList,
}

/// One model family (see the [module docs](self)).
pub struct Family {
    /// Short name (`llama`, `dit`, `llava`), as errors and `cpl inspect` print it.
    pub name: &'static str,
    pub kind: Kind,
    /// `architectures` entries of `config.json` (diffusers: `_class_name`) it claims.
    pub architectures: &'static [&'static str],
    /// `model_type` values it claims (a config without `architectures`).
    pub model_types: &'static [&'static str],
    /// Stem of the weight files (`model` for `model.safetensors`).
    pub weights_name: &'static str,
    /// Files of the model directory copied beside the weights into every checkpoint, when
    /// present (`config.json` always is).
    pub extra_files: &'static [&'static str],
    /// Size and FLOPs terms from `config.json` at the given path; errors name the file and
    /// field.
    pub describe: fn(&Path) -> Result<Description>,
    /// Loads the model for a layout (causal LM families).
    pub load_causal_lm: Option<fn(&ModelFiles, &LoadSpec<'_>) -> Result<LoadedCausalLm>>,
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("architectures", &self.architectures)
            .finish()
    }
}

/// The files of a text model's directory every checkpoint carries.
pub const TEXT_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// `LlamaForCausalLM` (Llama 2, Llama 3.x, TinyLlama, SmolLM).
pub static LLAMA: Family = Family {
    name: "llama",
    kind: Kind::CausalLm,
    architectures: &["LlamaForCausalLM"],
    model_types: &["llama"],
    weights_name: "model",
    extra_files: TEXT_FILES,
    describe: crate::decoder::describe::<crate::llama::LlamaConfig>,
    load_causal_lm: Some(crate::decoder::load_family::<crate::llama::LlamaConfig>),
};

/// diffusers' `DiTTransformer2DModel`.
pub static DIT: Family = Family {
    name: "dit",
    kind: Kind::Diffusion,
    architectures: &[crate::dit::config::DIT_CLASS],
    model_types: &[],
    weights_name: crate::dit::WEIGHTS_NAME,
    extra_files: &["config.json"],
    describe: describe_dit,
    load_causal_lm: None,
};

/// transformers' `LlavaForConditionalGeneration`.
pub static LLAVA: Family = Family {
    name: "llava",
    kind: Kind::VisionLanguage,
    architectures: &["LlavaForConditionalGeneration"],
    model_types: &["llava"],
    weights_name: "model",
    extra_files: &[
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "preprocessor_config.json",
        "processor_config.json",
    ],
    describe: describe_llava,
    load_causal_lm: None,
};

impl crate::dit::DitConfig {
    /// Size and FLOPs terms of this DiT ([`Description`]): attention over the patch tokens
    /// is full (not causal). The parameters applied to every patch token (patch embedding,
    /// attention and MLP projections, the output projection) count per token; those applied
    /// once per image to its conditioning (each block's timestep MLP and adaLN projection, the
    /// final modulation) count divided by the tokens of a `sample_size` image; the class
    /// tables are lookups.
    pub fn description(&self) -> Description {
        let params = self.num_parameters() as u64;
        let side = self.sample_size / self.patch_size.max(1);
        let tokens_per_image = (side * side).max(1) as u64;
        let (mut per_token, mut per_image) = (0u64, 0u64);
        let mut pieces = Pieces {
            layers: vec![Piece::default(); self.num_layers],
            ..Pieces::default()
        };
        let width = self.hidden_size() as u64;
        for p in &mut pieces.layers {
            p.attention_width = width;
        }
        for (name, shape) in self.parameter_shapes() {
            let n = shape.iter().product::<usize>() as u64;
            if name.contains("class_embedder") {
                continue;
            }
            let conditioning = name.contains("timestep_embedder")
                || name.contains("norm1.linear")
                || name.starts_with("proj_out_1");
            let per = if conditioning {
                per_image += n;
                n as f64 / tokens_per_image as f64
            } else {
                per_token += n;
                n as f64
            };
            // Blocks by index; the output projections on the last stage; the patch, timestep
            // and class embeddings on the first.
            let block = name
                .strip_prefix("transformer_blocks.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|l| l.parse::<usize>().ok())
                .filter(|&l| l < self.num_layers);
            let piece = match block {
                Some(l) => &mut pieces.layers[l],
                None if name.starts_with("proj_out") || name.starts_with("norm_out") => {
                    &mut pieces.last
                }
                None => &mut pieces.first,
            };
            piece.matmul_params += per;
        }
        let amortized = (per_image + tokens_per_image / 2) / tokens_per_image;
        Description {
            params,
            matmul_params: per_token + amortized,
            layers: self.num_layers,
            hidden: self.hidden_size(),
            vocab: 0,
            attention_width: (self.num_layers * self.hidden_size()) as u64,
            windowed: Vec::new(),
            causal: false,
            planner_shape: None,
            pieces: Some(pieces),
            summary: format!(
                "{} layers, hidden {}, {} heads",
                self.num_layers,
                self.hidden_size(),
                self.num_attention_heads
            ),
        }
    }
}

fn describe_dit(path: &Path) -> Result<Description> {
    Ok(crate::dit::DitConfig::from_file(path)?.description())
}

fn describe_llava(path: &Path) -> Result<Description> {
    use crate::decoder::ToDecoderSpec;
    let cfg = crate::llava::LlavaConfig::from_file(path)?;
    let mut d = cfg.text().decoder_spec()?.description();
    d.planner_shape = None;
    Ok(d)
}

static EXTRA: RwLock<Vec<&'static Family>> = RwLock::new(Vec::new());

/// Adds `family` to the registry (a family written outside this crate). Families registered
/// later are tried first, so a registration can take over an architecture. Errors when a
/// family of the same name is registered.
pub fn register(family: &'static Family) -> Result<()> {
    let mut extra = EXTRA
        .write()
        .map_err(|_| Error::Invalid("the family registry is poisoned".into()))?;
    if families_in(&extra).iter().any(|f| f.name == family.name) {
        return Err(Error::Invalid(format!(
            "a model family named `{}` is already registered",
            family.name
        )));
    }
    extra.push(family);
    Ok(())
}

fn families_in(extra: &[&'static Family]) -> Vec<&'static Family> {
    let mut all: Vec<&'static Family> = extra.iter().rev().copied().collect();
    all.extend([
        &LLAMA,
        &crate::zoo::QWEN2,
        &crate::zoo::QWEN3,
        &crate::zoo::MISTRAL,
        &crate::zoo::GEMMA2,
        &crate::zoo::GEMMA3,
        &crate::zoo::PHI3,
        &crate::zoo::MIXTRAL,
        &crate::zoo::QWEN2_MOE,
        &crate::zoo::QWEN3_MOE,
        &DIT,
        &LLAVA,
    ]);
    all
}

/// Every registered family, the last registered first, then the built-in ones.
pub fn families() -> Vec<&'static Family> {
    match EXTRA.read() {
        Ok(extra) => families_in(&extra),
        Err(_) => families_in(&[]),
    }
}

/// The family of a parsed `config.json`: the first whose architectures include one of its
/// `architectures` (or its `_class_name`), else the first whose model types include its
/// `model_type`. `None` when no family claims it.
pub fn detect_json(config: &serde_json::Value) -> Option<&'static Family> {
    let all = families();
    let mut names: Vec<&str> = config["architectures"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    names.extend(config["_class_name"].as_str());
    if let Some(f) = all
        .iter()
        .find(|f| names.iter().any(|n| f.architectures.contains(n)))
    {
        return Some(f);
    }
    // Only when the config names no architecture: a named, unclaimed one is unsupported
    // even if its model_type is known.
    if !names.is_empty() {
        return None;
    }
    let model_type = config["model_type"].as_str()?;
    all.into_iter()
        .find(|f| f.model_types.contains(&model_type))
}

/// The family of the model whose `config.json` is at `path`. Errors name the file, and when
/// no family claims it, list the supported architectures.
pub fn detect(path: &Path) -> Result<&'static Family> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
    detect_json(&v).ok_or_else(|| {
        let named = v["architectures"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .filter(|s| !s.is_empty())
            .or_else(|| v["_class_name"].as_str().map(String::from))
            .or_else(|| v["model_type"].as_str().map(|t| format!("model_type {t}")))
            .unwrap_or_else(|| "no architectures, _class_name or model_type".into());
        Error::config(
            path,
            format!(
                "unsupported model ({named}); supported families: {}",
                supported_list()
            ),
        )
    })
}

/// The supported families and their architectures, for errors and `--help`.
pub fn supported_list() -> String {
    families()
        .iter()
        .map(|f| format!("{} ({})", f.name, f.architectures.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The family of the model directory `dir` (its `config.json`).
pub fn detect_dir(dir: &Path) -> Result<&'static Family> {
    detect(&dir.join("config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one formula by hand: causal attention counts half the pairs, full attention all;
    /// training is three forwards, frozen-weight training skips the weights' gradients.
    #[test]
    fn flops_per_token_by_hand() {
        let mut d = Description {
            params: 1000,
            matmul_params: 900,
            layers: 2,
            hidden: 8,
            vocab: 10,
            attention_width: 16,
            windowed: Vec::new(),
            causal: true,
            planner_shape: None,
            pieces: None,
            summary: String::new(),
        };
        let (w, a) = (2.0 * 900.0, 4.0 * 16.0 * 32.0 * 0.5);
        assert_eq!(d.flops_per_token(32, Work::Forward), w + a);
        assert_eq!(d.flops_per_token(32, Work::Training), 3.0 * (w + a));
        assert_eq!(
            d.flops_per_token(32, Work::FrozenTraining),
            2.0 * w + 3.0 * a
        );
        d.causal = false;
        assert_eq!(d.flops_per_token(32, Work::Forward), w + 2.0 * a);
        // A windowed layer of width 16 and window 8 at 32 tokens: a query sees 8 - 64/64 = 7
        // keys on average (exactly: (1 + ... + 8 + 24 x 8) / 32 = 7.125); at 8 tokens or fewer,
        // as a global layer.
        d.causal = true;
        d.windowed = vec![(16, 8)];
        assert_eq!(
            d.flops_per_token(32, Work::Forward),
            w + a + 4.0 * 16.0 * 7.0
        );
        assert_eq!(
            d.flops_per_token(8, Work::Forward),
            w + 2.0 * 4.0 * 16.0 * 8.0 * 0.5
        );
    }

    /// DiT by hand (`tests/fixtures/dit/tiny`: hidden 32, 2 blocks, patch 2, 4 in / 8 out
    /// channels, 8x8 latents: 16 tokens): per token the patch embedding 544, per block
    /// attention 4 x (32 x 32 + 32) and MLP 2 x 32 x 128 + 128 + 32, the output 32 x 32 + 32;
    /// per image the blocks' timestep MLPs (32 x 256 + 32, 32 x 32 + 32) and adaLN (192 x 32
    /// + 192), and the final modulation 64 x 32 + 64, over 16 tokens.
    #[test]
    fn dit_flops_per_token_by_hand() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/dit/tiny/config.json");
        let d = describe_dit(&path).unwrap();
        let per_token = 544 + 2 * (4 * (32 * 32 + 32) + (2 * 32 * 128 + 128 + 32)) + 32 * 32 + 32;
        let per_image = 2 * ((32 * 256 + 32) + (32 * 32 + 32) + (192 * 32 + 192)) + 64 * 32 + 64;
        assert_eq!(per_token, 26_752);
        assert_eq!(d.matmul_params, per_token + (per_image + 8) / 16);
        let attn = 4.0 * 64.0 * 16.0; // full attention over 16 tokens, width 2 x 32
        let want = 3.0 * (2.0 * d.matmul_params as f64 + attn);
        assert_eq!(d.flops_per_token(16, Work::Training), want);
        assert_eq!(want, 185_304.0);
    }

    /// Detection by architecture, by model_type when none is named, and not by model_type when
    /// an unclaimed architecture is named.
    #[test]
    fn detection_rules() {
        let j = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        let name = |s: &str| detect_json(&j(s)).map(|f| f.name);
        assert_eq!(
            name(r#"{"architectures": ["LlamaForCausalLM"]}"#),
            Some("llama")
        );
        assert_eq!(name(r#"{"model_type": "llama"}"#), Some("llama"));
        assert_eq!(
            name(r#"{"_class_name": "DiTTransformer2DModel"}"#),
            Some("dit")
        );
        assert_eq!(name(r#"{"model_type": "llava"}"#), Some("llava"));
        assert_eq!(
            name(r#"{"architectures": ["MambaForCausalLM"], "model_type": "llama"}"#),
            None
        );
        for (arch, family) in [
            ("MistralForCausalLM", "mistral"),
            ("Qwen2ForCausalLM", "qwen2"),
            ("Qwen3ForCausalLM", "qwen3"),
            ("Gemma2ForCausalLM", "gemma2"),
            ("Gemma3ForCausalLM", "gemma3"),
        ] {
            let config = format!(r#"{{"architectures": ["{arch}"]}}"#);
            assert_eq!(name(&config), Some(family), "{arch}");
        }
        assert_eq!(name(r#"{}"#), None);
    }
}
