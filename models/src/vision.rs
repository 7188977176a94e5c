//! Vision towers of vision-language models: the CLIP and SigLIP vision transformers
//! (transformers' `CLIPVisionModel` and `SiglipVisionModel`), written from the
//! `candle_parallel::nn` modules.
//!
//! An image `(3, H, W)` is cut into `p × p` patches, each embedded by the patch convolution (a
//! linear map of the patch's `(c, y, x)` values), plus learned positions; CLIP prepends a class
//! token and normalises (`pre_layrnorm`) before the encoder. Each encoder layer is pre-norm:
//! `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, with full (bidirectional) attention with biases
//! and an `fc1`/`fc2` MLP (`quick_gelu` for CLIP, `gelu_pytorch_tanh` for SigLIP).
//! [`VisionTower::hidden_states`] returns the hidden states as transformers numbers them:
//! index 0 is the embeddings' output, index `i` the output of layer `i`; a vision-language model
//! selects one (or several) of them. The final `post_layernorm` (and SigLIP's pooling head) are
//! loaded and saved but not applied: LLaVA reads encoder hidden states.
//!
//! Parallelism: attention heads and MLP units are split over the tensor-parallel group; every
//! rank runs the whole image (its patches are not sequence-sharded, see
//! [`Pass::local`]); each layer is a [`Unit`] (ZeRO-3 shards it), but it is not recomputed
//! under activation checkpointing (the patches of an image are few next to the text).

use candle_core::{DType, Tensor};
use candle_parallel::attention::AttnMask;
use candle_parallel::nn::{
    linear, Activation, AttentionConfig, Block, LayerNorm, Mlp, MlpConfig, NormConfig,
    ParallelAttention, ParallelCtx, ParamBuilder, Pass, Track, Unit, UnitOps,
};
use serde::Deserialize;

use crate::error::{Error, Result};

/// Which vision transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TowerKind {
    Clip,
    Siglip,
}

/// A vision tower's `vision_config` (CLIP's or SigLIP's field names).
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "three")]
    pub num_channels: usize,
    pub image_size: usize,
    pub patch_size: usize,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub layer_norm_eps: Option<f64>,
    /// SigLIP: whether the pooling head exists (its weights are then loaded and saved).
    #[serde(default)]
    pub vision_use_head: Option<bool>,
}

fn three() -> usize {
    3
}

impl VisionConfig {
    /// The tower kind of `model_type`; `what` names the config in errors.
    pub fn kind(&self, what: &str) -> Result<TowerKind> {
        match self.model_type.as_str() {
            "clip_vision_model" | "clip" => Ok(TowerKind::Clip),
            "siglip_vision_model" | "siglip" => Ok(TowerKind::Siglip),
            other => Err(Error::Invalid(format!(
                "{what}: vision tower model_type {other:?} is not supported (supported: \
                 clip_vision_model, siglip_vision_model)"
            ))),
        }
    }

    /// Patches per image side and in all.
    pub fn num_patches(&self) -> usize {
        let side = self.image_size / self.patch_size;
        side * side
    }

    fn activation(&self, kind: TowerKind) -> Result<Activation> {
        let act = self.hidden_act.as_deref().unwrap_or(match kind {
            TowerKind::Clip => "quick_gelu",
            TowerKind::Siglip => "gelu_pytorch_tanh",
        });
        match act {
            "quick_gelu" => Ok(Activation::QuickGelu),
            "gelu" => Ok(Activation::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Activation::GeluTanh),
            other => Err(Error::Invalid(format!(
                "vision_config.hidden_act {other:?} is not supported (quick_gelu, gelu, \
                 gelu_pytorch_tanh)"
            ))),
        }
    }

    fn eps(&self, kind: TowerKind) -> f64 {
        self.layer_norm_eps.unwrap_or(match kind {
            TowerKind::Clip => 1e-5,
            TowerKind::Siglip => 1e-6,
        })
    }

    /// Checks the shapes (patch size divides the image, heads divide the hidden size).
    pub fn validate(&self) -> Result<()> {
        if self.patch_size == 0
            || !self.image_size.is_multiple_of(self.patch_size)
            || self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(Error::Invalid(format!(
                "vision_config: image_size {} must be a multiple of patch_size {}, and \
                 hidden_size {} of num_attention_heads {}",
                self.image_size, self.patch_size, self.hidden_size, self.num_attention_heads
            )));
        }
        Ok(())
    }
}

/// Patch and position embeddings (and CLIP's class token and pre-norm).
#[derive(Debug, Clone)]
pub struct VisionEmbeddings {
    /// `(hidden, C·p·p)`: the patch convolution as a linear map.
    patch: Tensor,
    patch_bias: Option<Tensor>,
    class: Option<Tensor>,
    positions: Tensor,
    pre_norm: Option<LayerNorm>,
    patch_size: usize,
}

impl VisionEmbeddings {
    fn new(
        cfg: &VisionConfig,
        kind: TowerKind,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> Result<Self> {
        let (d, c, p) = (cfg.hidden_size, cfg.num_channels, cfg.patch_size);
        let e = vb.pp("vision_model").pp("embeddings");
        let w = e.pp("patch_embedding").get((d, c, p, p), "weight")?;
        let clip = kind == TowerKind::Clip;
        let n = cfg.num_patches() + usize::from(clip);
        Ok(Self {
            patch: w.reshape((d, c * p * p))?,
            patch_bias: if clip {
                None
            } else {
                Some(e.pp("patch_embedding").get(d, "bias")?)
            },
            class: if clip {
                Some(e.get(d, "class_embedding")?)
            } else {
                None
            },
            positions: e.pp("position_embedding").get((n, d), "weight")?,
            pre_norm: if clip {
                Some(LayerNorm::new(
                    &NormConfig::new(d, cfg.eps(kind)).with_bias(true),
                    vb.pp("vision_model").pp("pre_layrnorm"),
                    ctx,
                )?)
            } else {
                None
            },
            patch_size: p,
        })
    }

    /// `pixel_values` `(n, C, H, W)` → `(n, tokens, hidden)`.
    fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let patches = crate::dit::model::patchify_input(pixel_values, self.patch_size)?;
        let x = linear(
            &patches.to_dtype(self.patch.dtype())?,
            &self.patch,
            self.patch_bias.as_ref(),
        )?;
        let (b, _, d) = x.dims3()?;
        let x = match &self.class {
            Some(c) => Tensor::cat(&[&c.reshape((1, 1, d))?.broadcast_as((b, 1, d))?, &x], 1)?,
            None => x,
        };
        let x = x.broadcast_add(&self.positions.unsqueeze(0)?)?;
        Ok(match &self.pre_norm {
            Some(n) => n.forward(&x)?,
            None => x,
        })
    }
}

/// One pre-norm encoder layer.
#[derive(Debug, Clone)]
pub struct EncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: ParallelAttention,
    layer_norm2: LayerNorm,
    mlp: Mlp,
}

impl EncoderLayer {
    fn new(
        cfg: &VisionConfig,
        kind: TowerKind,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> Result<Self> {
        let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
        let norm = NormConfig::new(d, cfg.eps(kind)).with_bias(true);
        let attn = AttentionConfig::new(d, h, h, d / h)
            .with_bias(true)
            .with_names("q_proj", "k_proj", "v_proj", "out_proj");
        let mlp = MlpConfig::gelu(d, cfg.intermediate_size, cfg.activation(kind)?);
        Ok(Self {
            layer_norm1: LayerNorm::new(&norm, vb.pp("layer_norm1"), ctx)?,
            self_attn: ParallelAttention::new(&attn, vb.pp("self_attn"), ctx)?,
            layer_norm2: LayerNorm::new(&norm, vb.pp("layer_norm2"), ctx)?,
            mlp: Mlp::new(&mlp, vb.pp("mlp"), ctx)?,
        })
    }
}

impl Block for EncoderLayer {
    fn forward(&self, x: &Tensor, pass: &Pass) -> candle_parallel::Result<Tensor> {
        let h = self
            .self_attn
            .forward(&self.layer_norm1.forward(x)?, pass)?;
        let x = (x + h)?;
        let h = self.mlp.forward(&self.layer_norm2.forward(&x)?)?;
        Ok((x + h)?)
    }
}

/// The weights a vision-language model does not apply but keeps: the final norm (and
/// SigLIP's pooling head). Loaded frozen, saved back.
#[derive(Debug, Clone)]
pub struct Unused;

/// A CLIP or SigLIP vision tower; see the [module docs](self).
pub struct VisionTower {
    pub cfg: VisionConfig,
    pub kind: TowerKind,
    embeddings: Unit<VisionEmbeddings>,
    layers: Vec<Unit<EncoderLayer>>,
    /// Hidden states a model reads: `0..=used`.
    used: usize,
    unused: Unit<Unused>,
    ctx: ParallelCtx,
}

impl VisionTower {
    /// Loads the tower at `vb` (`vision_tower`: `vision_model.embeddings...`), of which a
    /// model reads hidden states up to `used` (layers after it are loaded frozen, kept for
    /// saving, and not run: their gradient would be zero). Local.
    pub fn new(
        cfg: &VisionConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        used: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let kind = cfg.kind("vision_config")?;
        let unit_err = Error::Parallel;
        let (c, x) = (cfg.clone(), ctx.clone());
        let embeddings = Unit::new(&vb, move |vb| {
            VisionEmbeddings::new(&c, kind, vb, &x).map_err(candle_parallel::Error::from)
        })
        .map_err(unit_err)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let (c, x) = (cfg.clone(), ctx.clone());
                let lvb = vb.pp("vision_model").pp("encoder").pp("layers").pp(i);
                let lvb = if i < used { lvb } else { lvb.frozen() };
                Unit::new(&lvb, move |vb| {
                    EncoderLayer::new(&c, kind, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map_err(unit_err)
            })
            .collect::<Result<Vec<_>>>()?;
        let (c, x) = (cfg.clone(), ctx.clone());
        let unused = Unit::new(&vb, move |vb| {
            load_unused(&c, kind, vb.frozen(), &x).map_err(candle_parallel::Error::from)
        })
        .map_err(unit_err)?;
        Ok(Self {
            cfg: cfg.clone(),
            kind,
            embeddings,
            layers,
            used: used.min(cfg.num_hidden_layers),
            unused,
            ctx: ctx.clone(),
        })
    }

    /// Tokens per image at the encoder: patches, plus CLIP's class token.
    pub fn tokens_per_image(&self) -> usize {
        self.cfg.num_patches() + usize::from(self.kind == TowerKind::Clip)
    }

    /// Hidden states `0..=upto` of `pixel_values` `(n, C, H, W)` (resized to `image_size`):
    /// index 0 the embeddings, index `i` layer `i`'s output, each `(n, tokens, hidden)`.
    /// Collective over tp.
    pub fn hidden_states(&self, pixel_values: &Tensor, upto: usize) -> Result<Vec<Tensor>> {
        let (_, c, h, w) = pixel_values.dims4()?;
        let s = self.cfg.image_size;
        if c != self.cfg.num_channels || h != s || w != s {
            return Err(Error::Invalid(format!(
                "pixel values of shape {:?}: the vision tower takes ({}, {s}, {s}) images",
                pixel_values.dims(),
                self.cfg.num_channels
            )));
        }
        if upto > self.used {
            return Err(Error::Invalid(format!(
                "hidden state {upto} of a vision tower built to give states up to {}",
                self.used
            )));
        }
        let x = self.embeddings.get(Track::Grad)?.forward(pixel_values)?;
        let n = x.dim(1)?;
        let positions: Vec<u32> = (0..n as u32).collect();
        let mask = AttnMask::Full;
        let pass = Pass::local(&self.ctx, &positions, &mask);
        let mut out = vec![x];
        for layer in &self.layers[..upto] {
            let prev = out.last().expect("non-empty");
            out.push(layer.get(Track::Grad)?.forward(prev, &pass)?);
        }
        Ok(out)
    }

    /// Every unit of the tower.
    pub fn units(&mut self) -> Vec<&mut dyn UnitOps> {
        let mut u: Vec<&mut dyn UnitOps> = vec![&mut self.embeddings];
        for l in &mut self.layers {
            u.push(l);
        }
        u.push(&mut self.unused);
        u
    }

    /// The parameters of the tower as loaded.
    pub fn params(&self) -> Vec<candle_parallel::nn::Param> {
        let mut out = self.embeddings.params().to_vec();
        for l in &self.layers {
            out.extend(l.params().iter().cloned());
        }
        out.extend(self.unused.params().iter().cloned());
        out
    }

    pub fn dtype(&self) -> DType {
        self.embeddings
            .params()
            .first()
            .map(|p| p.tensor.dtype())
            .unwrap_or(DType::F32)
    }
}

/// Loads (frozen) the final norm and, for SigLIP with a head, the pooling head's weights.
fn load_unused(
    cfg: &VisionConfig,
    kind: TowerKind,
    vb: ParamBuilder,
    ctx: &ParallelCtx,
) -> Result<Unused> {
    let d = cfg.hidden_size;
    let m = vb.pp("vision_model");
    LayerNorm::new(
        &NormConfig::new(d, cfg.eps(kind)).with_bias(true),
        m.pp("post_layernorm"),
        ctx,
    )?;
    if kind == TowerKind::Siglip && cfg.vision_use_head.unwrap_or(true) && m.contains("head.probe")
    {
        let h = m.pp("head");
        h.get((1, 1, d), "probe")?;
        h.pp("attention").get((3 * d, d), "in_proj_weight")?;
        h.pp("attention").get(3 * d, "in_proj_bias")?;
        h.pp("attention").pp("out_proj").get((d, d), "weight")?;
        h.pp("attention").pp("out_proj").get(d, "bias")?;
        h.pp("layernorm").get(d, "weight")?;
        h.pp("layernorm").get(d, "bias")?;
        h.pp("mlp")
            .pp("fc1")
            .get((cfg.intermediate_size, d), "weight")?;
        h.pp("mlp").pp("fc1").get(cfg.intermediate_size, "bias")?;
        h.pp("mlp")
            .pp("fc2")
            .get((d, cfg.intermediate_size), "weight")?;
        h.pp("mlp").pp("fc2").get(d, "bias")?;
    }
    Ok(Unused)
}
