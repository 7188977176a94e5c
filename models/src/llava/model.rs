//! The LLaVA model: vision tower, projector, and a LLaMA whose embedded sequence has the image
//! features in place of the image tokens.
//!
//! Contract of a forward (every rank calls it with the same global batch): the token ids and
//! labels are global `(batch, S)`; the images are `(n, C, H, W)` in the order their token runs
//! appear (row-major over the batch). Every rank embeds the global sequence (tokens through the
//! vocab-parallel embedding, images through the vision tower and projector), puts the image
//! features in place of the image tokens, and then takes its shard of the merged sequence
//! ([`ParallelCtx::layer_tokens`]): from there it is a LLaMA sequence, under any
//! sequence-parallel strategy and tp. The gradients of the embedding, tower and projector come
//! from each rank's own tokens and add up over the ranks like every replicated parameter's.

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::AttnMask;
use candle_parallel::nn::{
    linear, Batch, CrossEntropyOptions, ParallelCtx, ParamBuilder, Track, Unit, UnitOps,
};
use candle_parallel::plan::Parallelize;

use super::config::LlavaConfig;
use crate::error::{Error, Result};
use crate::llama::Llama;
use crate::vision::VisionTower;

/// The 2-layer MLP from vision features to text embeddings (`linear_1`, activation,
/// `linear_2`).
#[derive(Debug, Clone)]
pub struct Projector {
    w1: Tensor,
    b1: Option<Tensor>,
    w2: Tensor,
    b2: Option<Tensor>,
    act: String,
}

impl Projector {
    pub fn new(cfg: &LlavaConfig, vb: ParamBuilder) -> Result<Self> {
        let layers = cfg
            .vision_feature_layer
            .indices(cfg.vision_config.num_hidden_layers)?
            .len();
        let (vin, h) = (
            cfg.vision_config.hidden_size * layers,
            cfg.text().hidden_size,
        );
        let bias = cfg.multimodal_projector_bias;
        let l1 = vb.pp("linear_1");
        let l2 = vb.pp("linear_2");
        Ok(Self {
            w1: l1.get((h, vin), "weight")?,
            b1: if bias { Some(l1.get(h, "bias")?) } else { None },
            w2: l2.get((h, h), "weight")?,
            b2: if bias { Some(l2.get(h, "bias")?) } else { None },
            act: cfg.projector_hidden_act.clone(),
        })
    }

    /// `(.., vision hidden · layers)` → `(.., text hidden)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = linear(x, &self.w1, self.b1.as_ref())?;
        let h = match self.act.as_str() {
            "gelu_pytorch_tanh" => candle_parallel::ops::gelu_tanh(&h)?,
            "quick_gelu" => candle_parallel::nn::mlp::quick_gelu(&h)?,
            _ => h.gelu_erf()?,
        };
        Ok(linear(&h, &self.w2, self.b2.as_ref())?)
    }
}

/// A LLaVA model on one rank; see the [module docs](self).
pub struct Llava {
    pub llama: Llama,
    /// The vision tower and projector (on the first pipeline stage only).
    vision: Option<(VisionTower, Unit<Projector>)>,
    /// Whether the tower or the projector has trainable parameters.
    trains_vision: bool,
    /// Image tokens each image fills.
    per_image: usize,
    dtype: DType,
    cfg: LlavaConfig,
    ctx: ParallelCtx,
}

/// Which parts of a LLaVA model train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Freeze {
    pub vision_tower: bool,
    pub language_model: bool,
}

impl Llava {
    /// Builds the model (names as the [`super::KeyLayout`]-renamed checkpoint's: `model.*` and
    /// `lm_head.weight` for the LLaMA, `vision_tower.*`, `multi_modal_projector.*`). Parts
    /// `freeze` names load frozen. Local.
    pub fn new(
        cfg: &LlavaConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        freeze: Freeze,
    ) -> Result<Self> {
        let all = 0..cfg.text().num_hidden_layers;
        Self::new_stage(cfg, vb, ctx, freeze, std::slice::from_ref(&all), true, true)
    }

    /// A pipeline stage: the language model's decoder layers in `layers` (one range per chunk
    /// of this rank), its embedding and head with `ends` (the first and last stage), and the
    /// vision tower and projector with `first` (the stage that embeds). Loads nothing else.
    pub fn new_stage(
        cfg: &LlavaConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        freeze: Freeze,
        layers: &[std::ops::Range<usize>],
        ends: bool,
        first: bool,
    ) -> Result<Self> {
        let text_vb = if freeze.language_model {
            vb.clone().frozen()
        } else {
            vb.clone()
        };
        let llama = Llama::new_stage(cfg.text(), text_vb, ctx, layers, ends)?;
        let dtype = vb.dtype();
        if !first {
            let per_image = cfg.tokens_per_image()?;
            return Ok(Self {
                llama,
                vision: None,
                trains_vision: false,
                per_image,
                dtype,
                cfg: cfg.clone(),
                ctx: ctx.clone(),
            });
        }
        let vision_vb = vb.pp("vision_tower");
        let vision_vb = if freeze.vision_tower {
            vision_vb.frozen()
        } else {
            vision_vb
        };
        let used = cfg
            .vision_feature_layer
            .indices(cfg.vision_config.num_hidden_layers)?
            .into_iter()
            .max()
            .unwrap_or(0);
        // Under TP-sp the tower's patches are not split over tp: every tp rank runs the whole
        // tower (see `image_features`). Otherwise it is tensor-parallel like the LLaMA.
        let vision_ctx = if ctx.tp().sequence_parallel() {
            ctx.without_tp()
        } else {
            ctx.clone()
        };
        let vision = VisionTower::new(&cfg.vision_config, vision_vb, &vision_ctx, used)?;
        let c = cfg.clone();
        let projector = Unit::new(&vb.pp("multi_modal_projector"), move |vb| {
            Projector::new(&c, vb).map_err(candle_parallel::Error::from)
        })
        .map_err(Error::Parallel)?;
        let mut all = vision.params();
        all.extend(projector.params().iter().cloned());
        let trains_vision = all.iter().any(|p| p.var.is_some());
        let per_image = cfg.tokens_per_image()?;
        Ok(Self {
            llama,
            vision: Some((vision, projector)),
            trains_vision,
            per_image,
            dtype,
            cfg: cfg.clone(),
            ctx: ctx.clone(),
        })
    }

    /// The vision tower (none on a pipeline stage that does not embed).
    pub fn vision_tower(&self) -> Option<&VisionTower> {
        self.vision.as_ref().map(|(v, _)| v)
    }

    /// The tower and projector, or an error on a pipeline stage that does not hold them.
    fn vision(&self) -> Result<&(VisionTower, Unit<Projector>)> {
        self.vision.as_ref().ok_or_else(|| {
            Error::Invalid("this pipeline stage holds no vision tower or projector".into())
        })
    }

    pub fn config(&self) -> &LlavaConfig {
        &self.cfg
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// Image tokens each image fills: the tower's tokens, less CLIP's class token under the
    /// `default` strategy.
    pub fn tokens_per_image(&self) -> usize {
        self.per_image
    }

    /// The selected vision features `(n, tokens, vision hidden · layers)` of `pixel_values`
    /// `(n, C, H, W)`. Collective over tp.
    pub fn vision_features(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let idx = self
            .cfg
            .vision_feature_layer
            .indices(self.cfg.vision_config.num_hidden_layers)?;
        let upto = idx.iter().copied().max().unwrap_or(0);
        let (vision, _) = self.vision()?;
        let pv = pixel_values.to_dtype(vision.dtype())?;
        let hs = vision.hidden_states(&pv, upto)?;
        let sel: Vec<&Tensor> = idx.iter().map(|&i| &hs[i]).collect();
        let f = Tensor::cat(&sel, 2)?;
        if self.cfg.vision_feature_select_strategy == "default" {
            let n = f.dim(1)?;
            Ok(f.narrow(1, 1, n - 1)?)
        } else {
            Ok(f)
        }
    }

    /// The projected image features `(n, tokens, text hidden)`. Collective over tp.
    pub fn image_features(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let f = self.vision_features(pixel_values)?;
        let f = self.vision()?.1.get(Track::Grad)?.forward(&f)?;
        // Under TP-sp every tp rank computes the whole features and receives their whole
        // gradient; the tower's and projector's gradients are summed over tp like other
        // replicated parameters', so each rank passes on its share.
        Ok(self.ctx.tp().share_gradient(&f)?)
    }

    /// The merged embeddings `(batch, S, hidden)` of the global `ids` with the features of
    /// `pixel_values` in place of the image tokens, in order. Errors when the image tokens do
    /// not match the images. Collective over tp.
    pub fn merged_embeddings(
        &self,
        ends: &crate::llama::Ends,
        ids: &[Vec<u32>],
        pixel_values: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, s) = (ids.len(), ids.first().map(|r| r.len()).unwrap_or(0));
        if b == 0 || s == 0 || ids.iter().any(|r| r.len() != s) {
            return Err(Error::Invalid(
                "a batch needs one or more token sequences of equal length".into(),
            ));
        }
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let tok = self.cfg.image_token();
        let at: Vec<u32> = flat
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == tok)
            .map(|(i, _)| i as u32)
            .collect();
        let per = self.tokens_per_image();
        let images = pixel_values.map(|p| p.dim(0)).transpose()?.unwrap_or(0);
        let mut runs = Vec::new();
        for (k, &i) in at.iter().enumerate() {
            if k > 0 && i == at[k - 1] + 1 && !(i as usize).is_multiple_of(s) {
                *runs.last_mut().expect("a run") += 1;
            } else {
                runs.push(1usize);
            }
        }
        if let Some(r) = runs.iter().find(|&&r| r % per != 0) {
            return Err(Error::Invalid(format!(
                "a run of {r} image tokens (id {tok}): every image needs its own run of {per}"
            )));
        }
        if at.len() != images * per {
            return Err(Error::Invalid(format!(
                "{} image tokens (id {tok}) in the text but {images} image(s) of {per} tokens \
                 each: every image needs one run of {per} image tokens",
                at.len()
            )));
        }
        let dev = Device::Cpu;
        let ids_t = Tensor::from_vec(flat.clone(), (b * s,), &dev)?;
        let text = self.llama.embed_global(ends, &ids_t)?;
        let merged = match pixel_values {
            // A batch without images still runs the tower (on a black image, its features
            // times 0), when the tower or projector trains: every rank then has the same
            // collectives (ZeRO-3 gathers) and every parameter a gradient, zero here (as
            // LLaMA-Factory does for text-only batches of multimodal models).
            _ if images == 0 && self.trains_vision => {
                let v = &self.cfg.vision_config;
                let black = Tensor::zeros(
                    (1, v.num_channels, v.image_size, v.image_size),
                    DType::F32,
                    &dev,
                )?;
                // Times a zero tensor, not the scalar 0: candle's backward skips `x * 0.0`.
                let sum = self.image_features(&black)?.sum_all()?;
                let zero = (&sum * sum.zeros_like()?)?;
                text.broadcast_add(&zero.to_dtype(text.dtype())?)?
            }
            Some(pv) if images > 0 => {
                let feats = self.image_features(pv)?;
                let h = feats.dim(2)?;
                let feats = feats.reshape((images * per, h))?.to_dtype(text.dtype())?;
                let keep: Vec<f32> = flat
                    .iter()
                    .map(|&t| f32::from(u8::from(t != tok)))
                    .collect();
                let keep = Tensor::from_vec(keep, (b * s, 1), &dev)?.to_dtype(text.dtype())?;
                let index = Tensor::from_vec(at, (images * per,), &dev)?;
                text.broadcast_mul(&keep)?.index_add(&index, &feats, 0)?
            }
            _ => text,
        };
        Ok(merged.reshape((b, s, ()))?)
    }

    /// This rank's shard of the batch (positions, causal mask) and of the global `labels`.
    /// Local.
    pub fn shard_batch(&self, ids: &[Vec<u32>], labels: &[Vec<i64>]) -> Result<(Batch, Tensor)> {
        Ok(Batch::from_tokens(
            &self.ctx,
            ids,
            labels,
            AttnMask::Causal,
        )?)
    }

    /// The first pipeline stage's work: this rank's shard of the merged embeddings of the
    /// global `ids` and the images. Collective over tp.
    pub fn embed_shard(&self, ids: &[Vec<u32>], pixel_values: Option<&Tensor>) -> Result<Tensor> {
        let ends = self.llama.ends(Track::Grad)?;
        let merged = self.merged_embeddings(&ends, ids, pixel_values)?;
        Ok(self.ctx.layer_tokens(&merged)?)
    }

    /// This rank's shard of the batch and of the merged embeddings, and the sharded labels.
    fn shard(
        &self,
        ends: &crate::llama::Ends,
        ids: &[Vec<u32>],
        labels: &[Vec<i64>],
        pixel_values: Option<&Tensor>,
    ) -> Result<(Batch, Tensor, Tensor)> {
        let merged = self.merged_embeddings(ends, ids, pixel_values)?;
        let (batch, labels) = self.shard_batch(ids, labels)?;
        let x = self.ctx.layer_tokens(&merged)?;
        Ok((batch, x, labels))
    }

    /// Final hidden states of this rank's tokens. Collective over the world.
    fn hidden(&self, ends: &crate::llama::Ends, batch: &Batch, x: &Tensor) -> Result<Tensor> {
        let x = self
            .llama
            .run_layers(0..self.llama.num_layers(), x, batch)?;
        self.llama.final_norm(ends, &x)
    }

    /// Summed next-token loss of this rank's tokens and their count: `labels` global and already
    /// shifted (`-100` ignored, as on image tokens). Collective over the world.
    pub fn loss_sum(
        &self,
        ids: &[Vec<u32>],
        labels: &[Vec<i64>],
        pixel_values: Option<&Tensor>,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let ends = self.llama.ends(Track::Grad)?;
        let (batch, x, labels) = self.shard(&ends, ids, labels, pixel_values)?;
        let h = self.hidden(&ends, &batch, &x)?;
        self.llama.head_loss(&ends, &h, &labels, opts)
    }

    /// Logits `(batch, n, vocab)` f32 of this rank's tokens. Collective over the world.
    pub fn logits(&self, ids: &[Vec<u32>], pixel_values: Option<&Tensor>) -> Result<Tensor> {
        let ends = self.llama.ends(Track::Grad)?;
        let labels: Vec<Vec<i64>> = ids.iter().map(|r| vec![-100; r.len()]).collect();
        let (batch, x, _) = self.shard(&ends, ids, &labels, pixel_values)?;
        let h = self.hidden(&ends, &batch, &x)?;
        self.llama.head_logits(&ends, &h)
    }

    /// `loss.backward()` plus the gradients of recomputed layers.
    pub fn backward(&self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        Ok(self.ctx.backward(loss)?)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl Parallelize for Llava {
    fn units(&mut self) -> Vec<&mut dyn UnitOps> {
        let mut u = self.llama.units();
        if let Some((vision, projector)) = &mut self.vision {
            u.extend(vision.units());
            u.push(projector);
        }
        u
    }
}
