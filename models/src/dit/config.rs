//! The `config.json` of a diffusers `DiTTransformer2DModel` (field names as diffusers writes
//! them), validated.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A DiT's `config.json`. Unknown fields are kept out; fields this port does not implement are
/// checked to hold the only value it supports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DitConfig {
    #[serde(
        rename = "_class_name",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub class_name: Option<String>,
    #[serde(
        rename = "_diffusers_version",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub diffusers_version: Option<String>,
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    /// `2 * in_channels` for a learned variance (DiT's learned sigma), else `in_channels`.
    #[serde(default)]
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default = "default_groups")]
    pub norm_num_groups: usize,
    #[serde(default = "default_true")]
    pub attention_bias: bool,
    /// Height and width of the input in pixels (or latent pixels).
    pub sample_size: usize,
    pub patch_size: usize,
    #[serde(default = "default_activation")]
    pub activation_fn: String,
    /// Number of classes (the label table has one more row: the null class of guidance).
    pub num_embeds_ada_norm: Option<usize>,
    #[serde(default)]
    pub upcast_attention: bool,
    #[serde(default = "default_norm_type")]
    pub norm_type: String,
    #[serde(default)]
    pub norm_elementwise_affine: bool,
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
}

fn default_groups() -> usize {
    32
}
fn default_true() -> bool {
    true
}
fn default_activation() -> String {
    "gelu-approximate".into()
}
fn default_norm_type() -> String {
    "ada_norm_zero".into()
}
fn default_norm_eps() -> f64 {
    1e-5
}

/// The diffusers class this config describes.
pub const DIT_CLASS: &str = "DiTTransformer2DModel";

impl DitConfig {
    /// Reads and validates `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses and validates a config; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text)
            .map_err(|e| Error::config(path, format!("not a valid DiT config.json: {e}")))?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(Error::config(path, msg));
        if let Some(c) = &self.class_name {
            if c != DIT_CLASS {
                return bad(format!(
                    "unsupported _class_name `{c}` (supported: {DIT_CLASS})"
                ));
            }
        }
        if self.norm_type != "ada_norm_zero" {
            return bad(format!(
                "unsupported norm_type `{}` (supported: ada_norm_zero)",
                self.norm_type
            ));
        }
        if self.activation_fn != "gelu-approximate" {
            return bad(format!(
                "unsupported activation_fn `{}` (supported: gelu-approximate)",
                self.activation_fn
            ));
        }
        if self.dropout != 0.0 {
            return bad(format!(
                "dropout {} is not supported (DiT trains without dropout: set 0.0)",
                self.dropout
            ));
        }
        if self.upcast_attention {
            return bad("upcast_attention is not supported (attention runs in f32 already)".into());
        }
        for (name, v) in [
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("in_channels", self.in_channels),
            ("num_layers", self.num_layers),
            ("sample_size", self.sample_size),
            ("patch_size", self.patch_size),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if !self.sample_size.is_multiple_of(self.patch_size) {
            return bad(format!(
                "sample_size {} is not a multiple of patch_size {}",
                self.sample_size, self.patch_size
            ));
        }
        let out = self.out_channels();
        if out != self.in_channels && out != 2 * self.in_channels {
            return bad(format!(
                "out_channels {out} must be in_channels ({}) or twice that (learned sigma)",
                self.in_channels
            ));
        }
        match self.num_embeds_ada_norm {
            Some(n) if n > 0 => {}
            _ => {
                return bad(
                    "num_embeds_ada_norm (the number of classes) is required by ada_norm_zero"
                        .into(),
                )
            }
        }
        if !self.hidden_size().is_multiple_of(2) {
            return bad("the hidden size must be even (2D sin-cos positions)".into());
        }
        Ok(())
    }

    /// The transformer width: heads × head dim.
    pub fn hidden_size(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Whether the model predicts a variance besides the noise (DiT's learned sigma).
    pub fn learn_sigma(&self) -> bool {
        self.out_channels() == 2 * self.in_channels
    }

    /// Number of classes (the null class of guidance is the next index).
    pub fn num_classes(&self) -> usize {
        self.num_embeds_ada_norm.unwrap_or(0)
    }

    /// The MLP width (diffusers' FeedForward: 4 × hidden).
    pub fn intermediate_size(&self) -> usize {
        4 * self.hidden_size()
    }

    /// Patch tokens of a `height × width` input: errors unless the patch divides both.
    pub fn num_patches(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let p = self.patch_size;
        if height == 0 || width == 0 || !height.is_multiple_of(p) || !width.is_multiple_of(p) {
            return Err(Error::Invalid(format!(
                "a {height}x{width} input does not split into {p}x{p} patches"
            )));
        }
        Ok((height / p, width / p))
    }

    /// Every parameter's checkpoint name and shape, as diffusers stores them.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, p) = (self.hidden_size(), self.patch_size);
        let i = self.intermediate_size();
        let mut v = vec![
            (
                "pos_embed.proj.weight".to_string(),
                vec![h, self.in_channels, p, p],
            ),
            ("pos_embed.proj.bias".into(), vec![h]),
            ("proj_out_1.weight".into(), vec![2 * h, h]),
            ("proj_out_1.bias".into(), vec![2 * h]),
            (
                "proj_out_2.weight".into(),
                vec![p * p * self.out_channels(), h],
            ),
            ("proj_out_2.bias".into(), vec![p * p * self.out_channels()]),
        ];
        for l in 0..self.num_layers {
            let b = |n: &str| format!("transformer_blocks.{l}.{n}");
            let e = "norm1.emb";
            v.extend([
                (
                    b(&format!("{e}.class_embedder.embedding_table.weight")),
                    vec![self.num_classes() + 1, h],
                ),
                (
                    b(&format!("{e}.timestep_embedder.linear_1.weight")),
                    vec![h, TIMESTEP_CHANNELS],
                ),
                (b(&format!("{e}.timestep_embedder.linear_1.bias")), vec![h]),
                (
                    b(&format!("{e}.timestep_embedder.linear_2.weight")),
                    vec![h, h],
                ),
                (b(&format!("{e}.timestep_embedder.linear_2.bias")), vec![h]),
                (b("norm1.linear.weight"), vec![6 * h, h]),
                (b("norm1.linear.bias"), vec![6 * h]),
            ]);
            for n in ["to_q", "to_k", "to_v", "to_out.0"] {
                v.push((b(&format!("attn1.{n}.weight")), vec![h, h]));
                if self.attention_bias || n == "to_out.0" {
                    v.push((b(&format!("attn1.{n}.bias")), vec![h]));
                }
            }
            if self.norm_elementwise_affine {
                v.push((b("norm2.weight"), vec![h]));
                v.push((b("norm2.bias"), vec![h]));
            }
            v.extend([
                (b("ff.net.0.proj.weight"), vec![i, h]),
                (b("ff.net.0.proj.bias"), vec![i]),
                (b("ff.net.2.weight"), vec![h, i]),
                (b("ff.net.2.bias"), vec![h]),
            ]);
        }
        v
    }

    /// Total parameter count.
    pub fn num_parameters(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// Width of the sinusoidal timestep features (diffusers' `Timesteps(256, ..)`).
pub const TIMESTEP_CHANNELS: usize = 256;
