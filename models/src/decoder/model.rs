//! The decoder-only transformer of every LLaMA-like family (LLaMA, Qwen2/2.5, Qwen3, Mistral,
//! Gemma 3, ...), described by a [`DecoderSpec`], from the parallel modules of
//! [`candle_parallel::nn`].
//!
//! The file describes the model and nothing else: every module is built by its
//! `fn new(cfg, vb, ctx)` with `vb.pp(..)` mirroring the checkpoint keys, and the layout (how the
//! heads, hidden units, vocabulary and tokens are split, which sequence-parallel strategy runs)
//! is the [`ParallelCtx`]'s. Each decoder layer, and the parameters at the two ends (embedding,
//! final norm, head: one unit, so that tied weights stay one parameter), is a [`Unit`], which a
//! [`candle_parallel::plan::MemoryPlan`] shards (ZeRO-3) or recomputes (activation
//! checkpointing) from outside ([`Parallelize`]).

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::sync::Arc;

use candle_parallel::nn::{
    Adapters, Batch, Block, CrossEntropyOptions, LayerKv, LmHead, Mlp, ParallelAttention,
    ParallelCtx, ParamBuilder, Pass, RmsNorm, RouterAux, SparseMoe, Track, Unit, UnitOps,
    VocabParallelEmbedding,
};
use candle_parallel::plan::Parallelize;

use super::spec::DecoderSpec;
use super::ToDecoderSpec;
use crate::causal_lm::KvCache;
use crate::error::{Error, Result};

/// A decoder layer's feed-forward block: a dense MLP, or a mixture of experts
/// ([`DecoderSpec::moe`]).
// One per layer, built once: the size difference of the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// `x` `(batch, tokens', hidden)` at sequence `positions` → the same shape. Collective
    /// over tp (and, for a sparse block, the ranks holding the tokens).
    /// `routed`: which tokens count in the routing statistics ([`Pass::routed`]).
    pub fn forward(
        &self,
        x: &Tensor,
        positions: &[u32],
        routed: Option<&[bool]>,
    ) -> candle_parallel::Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(x),
            Self::Sparse(m) => m.forward_at(x, Some(positions), routed),
        }
    }
}

/// One decoder layer: attention and MLP, each pre-normed with a residual add; with sandwich
/// norms ([`DecoderSpec::sandwich_norms`]) their outputs are normed too before the add.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: ParallelAttention,
    /// Before the MLP (LLaMA), or on the attention's output (sandwich norms).
    post_attention_layernorm: RmsNorm,
    /// Sandwich norms: before the MLP and on its output.
    feedforward_norms: Option<(RmsNorm, RmsNorm)>,
    mlp: FeedForward,
}

impl DecoderLayer {
    /// Layer `i` of `spec`, `vb` at `model.layers.{i}`; a sparse block records its router's
    /// statistics in `aux` ([`Decoder::router_aux`]).
    pub fn new(
        spec: &DecoderSpec,
        i: usize,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        aux: Option<Arc<RouterAux>>,
    ) -> Result<Self> {
        let norm = spec.norm_config(spec.hidden_size);
        let feedforward_norms = if spec.sandwich_norms {
            Some((
                RmsNorm::new(&norm, vb.pp("pre_feedforward_layernorm"), ctx)?,
                RmsNorm::new(&norm, vb.pp("post_feedforward_layernorm"), ctx)?,
            ))
        } else {
            None
        };
        Ok(Self {
            input_layernorm: RmsNorm::new(&norm, vb.pp("input_layernorm"), ctx)?,
            self_attn: ParallelAttention::new(&spec.attention_config(i)?, vb.pp("self_attn"), ctx)?,
            post_attention_layernorm: RmsNorm::new(&norm, vb.pp("post_attention_layernorm"), ctx)?,
            feedforward_norms,
            mlp: match spec.sparse_block(i) {
                Some(m) => FeedForward::Sparse(SparseMoe::new(
                    &m.block,
                    vb.pp(m.folder),
                    ctx,
                    aux.map(|a| (a, i)),
                )?),
                None => FeedForward::Dense(Mlp::new(&spec.mlp_config(), vb.pp("mlp"), ctx)?),
            },
        })
    }

    /// The layer around an attention output `attn` of the normed input: the residual adds and
    /// the MLP.
    fn finish(
        &self,
        x: &Tensor,
        attn: Tensor,
        pos: &[u32],
        routed: Option<&[bool]>,
    ) -> candle_parallel::Result<Tensor> {
        match &self.feedforward_norms {
            None => {
                let x = (x + attn)?;
                let h = self.post_attention_layernorm.forward(&x)?;
                Ok((&x + self.mlp.forward(&h, pos, routed)?)?)
            }
            Some((pre, post)) => {
                let x = (x + self.post_attention_layernorm.forward(&attn)?)?;
                let h = self.mlp.forward(&pre.forward(&x)?, pos, routed)?;
                Ok((&x + post.forward(&h)?)?)
            }
        }
    }

    /// Incremental forward for generation, see [`ParallelAttention::forward_cached`].
    pub fn forward_cached(&self, x: &Tensor, pos: &[u32], cache: &mut LayerKv) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let attn = self.self_attn.forward_cached(&h, pos, cache)?;
        Ok(self.finish(x, attn, pos, None)?)
    }
}

impl Block for DecoderLayer {
    fn forward(&self, x: &Tensor, pass: &Pass) -> candle_parallel::Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let attn = self.self_attn.forward(&h, pass)?;
        self.finish(x, attn, pass.positions, pass.routed)
    }
}

/// The parameters at both ends of the model: the token embedding, the final norm and the LM
/// head (the embedding's weight when tied). One unit, so that tied weights are one parameter
/// under every memory plan.
#[derive(Debug, Clone)]
pub struct Ends {
    embed_tokens: VocabParallelEmbedding,
    norm: RmsNorm,
    lm_head: LmHead,
}

impl Ends {
    /// `vb` at the checkpoint root (`model.embed_tokens`, `model.norm`, `lm_head`).
    pub fn new(spec: &DecoderSpec, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let m = vb.pp("model");
        let emb = spec.embedding_config();
        let embed_tokens = VocabParallelEmbedding::new(&emb, m.pp("embed_tokens"), ctx)?;
        let lm_head = if spec.tie_word_embeddings {
            LmHead::tied(&embed_tokens, ctx)
        } else {
            LmHead::new(&emb, vb.pp("lm_head"), ctx)?
        }
        .with_softcap(spec.final_softcap)?;
        Ok(Self {
            norm: RmsNorm::new(&spec.norm_config(spec.hidden_size), m.pp("norm"), ctx)?,
            embed_tokens,
            lm_head,
        })
    }
}

/// A decoder-only language model; see the [module docs](self). Parameter gradients arrive
/// through [`Decoder::backward`] (`loss.backward()` plus those of recomputed layers).
#[derive(Debug, Clone)]
pub struct Decoder {
    /// `None` on a pipeline stage that holds neither the first nor the last layer.
    ends: Option<Unit<Ends>>,
    /// `None` for layers another pipeline stage holds.
    layers: Vec<Option<Unit<DecoderLayer>>>,
    ctx: ParallelCtx,
    spec: Arc<DecoderSpec>,
    /// The LoRA adapters the model was built with (see [`ParamBuilder::with_adapters`]).
    adapters: Option<Arc<Adapters>>,
    /// Mixture of experts: the routers' statistics of the current micro-batch, and the
    /// coefficient of the load-balancing loss when the loss includes it.
    router_aux: Option<(Arc<RouterAux>, Option<f64>)>,
}

impl Decoder {
    /// Builds the model of `cfg` (a family's config, or a [`DecoderSpec`]) for this rank's
    /// layout, loading its slice of every parameter through `vb` (keys as in the Hugging Face
    /// checkpoint). Local. Errors (naming the config field) when the layout does not divide the
    /// heads, the hidden units or the vocabulary.
    pub fn new<C: ToDecoderSpec + ?Sized>(
        cfg: &C,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
    ) -> Result<Self> {
        let spec = cfg.decoder_spec()?;
        let all = 0..spec.num_layers();
        Self::new_stage(&spec, vb, ctx, std::slice::from_ref(&all), true)
    }

    /// A pipeline stage of the model: only the decoder layers in `layers` (one range per model
    /// chunk of this rank) and, with `ends`, the embedding, final norm and head (the first and
    /// the last stage hold them; see [`crate::causal_lm::LmStages`]). Loads nothing else.
    pub fn new_stage<C: ToDecoderSpec + ?Sized>(
        cfg: &C,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        layers: &[std::ops::Range<usize>],
        ends: bool,
    ) -> Result<Self> {
        let spec = Arc::new(cfg.decoder_spec()?);
        let unit_err = |e: candle_parallel::Error| Error::Parallel(e);
        if let Some(r) = layers.iter().find(|r| r.end > spec.num_layers()) {
            return Err(Error::Invalid(format!(
                "layers {r:?} of a model with {} layers (num_hidden_layers)",
                spec.num_layers()
            )));
        }
        let router_aux = spec
            .moe
            .as_ref()
            .map(|m| (RouterAux::new(m.block.num_experts), m.aux_loss_coef));
        let ends = if ends {
            let (c, x) = (spec.clone(), ctx.clone());
            Some(
                Unit::new(&vb, move |vb| {
                    Ends::new(&c, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map_err(unit_err)?,
            )
        } else {
            None
        };
        let layers = (0..spec.num_layers())
            .map(|i| {
                if !layers.iter().any(|r| r.contains(&i)) {
                    return Ok(None);
                }
                let (c, x) = (spec.clone(), ctx.clone());
                let aux = router_aux.as_ref().map(|(a, _)| a.clone());
                let vb = vb.pp("model").pp("layers").pp(i);
                Unit::new(&vb, move |vb| {
                    DecoderLayer::new(&c, i, vb, &x, aux.clone())
                        .map_err(candle_parallel::Error::from)
                })
                .map(Some)
                .map_err(unit_err)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            ends,
            layers,
            ctx: ctx.clone(),
            spec,
            adapters: vb.adapters().cloned(),
            router_aux,
        })
    }

    /// A forward pass starts: the routers' statistics of the previous one are forgotten, so
    /// that no stale load-balancing gradient reaches a later backward.
    fn begin_pass(&self) {
        if let Some((aux, _)) = &self.router_aux {
            aux.begin();
        }
    }

    /// The routers' statistics (mixture-of-experts models).
    pub fn router_aux(&self) -> Option<&Arc<RouterAux>> {
        self.router_aux.as_ref().map(|(a, _)| a)
    }

    /// Sets the load-balancing loss's coefficient (`None` or 0: the loss is the LM loss alone).
    /// Errors on a dense model.
    pub fn set_router_aux_loss_coef(&mut self, coef: Option<f64>) -> Result<()> {
        match &mut self.router_aux {
            Some((_, c)) => {
                *c = coef;
                Ok(())
            }
            None => Err(Error::Invalid(format!(
                "a router auxiliary-loss coefficient for a dense model ({}): only \
                 mixture-of-experts models have routers",
                self.spec.family
            ))),
        }
    }

    /// What the model is.
    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    /// Token embeddings times the family's embedding scale (rounded to their dtype first).
    fn scale_embeddings(&self, x: Tensor) -> Result<Tensor> {
        match self.spec.embed_scale {
            None => Ok(x),
            Some(s) => {
                let s = Tensor::new(s, x.device())?.to_dtype(x.dtype())?;
                Ok(x.broadcast_mul(&s)?)
            }
        }
    }

    /// The LoRA adapters of the model, if it was built with them (switch them off with
    /// [`Adapters::set_enabled`] for the base model's outputs).
    pub fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.adapters.as_ref()
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// `loss.backward()` plus the parameter gradients computed inside recomputed layers.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Ok(self.ctx.backward(loss)?)
    }

    /// The embedding/norm/head unit with whole weights (gathered under ZeRO-3).
    pub fn ends(&self, track: Track) -> Result<Ends> {
        let ends = self.ends.as_ref().ok_or_else(|| {
            Error::Invalid("this pipeline stage holds no embedding, norm or head".into())
        })?;
        Ok(ends.get(track)?)
    }

    /// The first stage's work: token embeddings `(batch, n', hidden)` of this rank's shard
    /// (under TP-sp its tensor-parallel part of the tokens). Collective over tp.
    pub fn embed(&self, ends: &Ends, batch: &Batch) -> Result<Tensor> {
        batch.pass(&self.ctx)?;
        self.begin_pass();
        self.scale_embeddings(ends.embed_tokens.forward(&batch.input_ids)?)
    }

    /// Decoder layers `layers` on `x` (the embeddings, or the previous stage's output), each
    /// under its unit's checkpointing. Collective over the model-parallel group.
    pub fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        batch: &Batch,
    ) -> Result<Tensor> {
        if layers.end > self.layers.len() || layers.start > layers.end {
            return Err(Error::Invalid(format!(
                "layers {layers:?} of a model with {} layers",
                self.layers.len()
            )));
        }
        let pass = batch.pass(&self.ctx)?;
        let mut x = x.clone();
        for i in layers {
            x = self.layer(i)?.forward(&x, &pass)?;
        }
        Ok(x)
    }

    /// Decoder layer `i`, or an error naming it when another pipeline stage holds it.
    fn layer(&self, i: usize) -> Result<&Unit<DecoderLayer>> {
        self.layers[i]
            .as_ref()
            .ok_or_else(|| Error::Invalid(format!("layer {i} is held by another pipeline stage")))
    }

    /// Token embeddings of `ids` (any shape, u32) replicated on every rank (no sequence or
    /// TP-sp split): for models that change the embedded sequence before sharding it
    /// (image features in a vision-language model). Collective over tp.
    pub fn embed_global(&self, ends: &Ends, ids: &Tensor) -> Result<Tensor> {
        self.begin_pass();
        self.scale_embeddings(ends.embed_tokens.lookup(ids)?)
    }

    /// Logits `(.., tokens, V)` f32 of final hidden states `h` (see [`Decoder::logits`]).
    /// Collective over tp.
    pub fn head_logits(&self, ends: &Ends, h: &Tensor) -> Result<Tensor> {
        Ok(ends.lm_head.logits(h)?)
    }

    /// The number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The last stage's work before the head: the final norm, `(batch, n', hidden)`.
    pub fn final_norm(&self, ends: &Ends, x: &Tensor) -> Result<Tensor> {
        Ok(ends.norm.forward(x)?)
    }

    fn hidden_with(&self, ends: &Ends, batch: &Batch) -> Result<Tensor> {
        let x = self.embed(ends, batch)?;
        let x = self.run_layers(0..self.layers.len(), &x, batch)?;
        self.final_norm(ends, &x)
    }

    /// Sum of the next-token cross-entropies of this rank's tokens and their count: `labels`
    /// `(batch, n)` i64, already shifted (label of token i = id of token i+1) and sharded like the
    /// tokens, `-100` ignored. Never forms full-vocabulary logits. Divide by the global count
    /// (summed over the sequence group) for the mean loss.
    pub fn loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let ends = self.ends(Track::Grad)?;
        let h = self.hidden_with(&ends, batch)?;
        self.head_loss(&ends, &h, labels, opts)
    }

    /// Per-sequence sums of this rank's token cross-entropies, `(batch,)` f32 (the negative
    /// log-likelihood of each sequence's labelled tokens on this rank; sum over the sequence
    /// group for the whole sequence), for preference losses (DPO). `labels` as in
    /// [`Decoder::loss_sum`]; a sequence with no labelled token here gives 0. Collective over tp.
    pub fn sequence_loss_sums(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<Tensor> {
        let ends = self.ends(Track::Grad)?;
        let h = self.hidden_with(&ends, batch)?;
        let sums = (0..h.dim(0)?)
            .map(|i| {
                let (s, _) =
                    self.head_loss(&ends, &h.narrow(0, i, 1)?, &labels.narrow(0, i, 1)?, opts)?;
                Ok(s.reshape(1)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&sums, 0)?)
    }

    /// The loss of the LM head on final hidden states `h` (see [`Decoder::loss_sum`]). Collective
    /// over tp.
    pub fn head_loss(
        &self,
        ends: &Ends,
        h: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        Ok(ends.lm_head.loss_sum(h, labels, opts)?)
    }

    /// Logits `(batch, n, vocab)` f32 of this rank's tokens (all-gathered over the vocab shards;
    /// for evaluation and generation, not for long-context training).
    pub fn logits(&self, batch: &Batch) -> Result<Tensor> {
        let ends = self.ends(Track::Grad)?;
        let h = self.hidden_with(&ends, batch)?;
        Ok(ends.lm_head.logits(&h)?)
    }

    /// Generation step: runs the new tokens `ids` `(batch, n)` (positions `cache.len()..`)
    /// through the model, extends `cache`, and returns the logits `(batch, vocab)` f32 of the
    /// last token. Needs a layout without sequence parallelism (tensor parallelism is fine).
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let x = self.embed_cached(ids)?;
        let x = self.layers_cached(&x, 0..self.layers.len(), cache)?;
        cache.advance(ids.dim(1)?);
        self.head_cached(&x)
    }

    /// Generation through pipeline stages, the first stage's work: the embeddings
    /// `(batch, n, hidden)` of the new tokens `ids`. Collective over tp.
    pub fn embed_cached(&self, ids: &Tensor) -> Result<Tensor> {
        self.check_generation_layout()?;
        self.scale_embeddings(self.ends(Track::NoGrad)?.embed_tokens.lookup(ids)?)
    }

    /// Generation through pipeline stages: decoder layers `layers` on the hidden states `x`
    /// `(batch, n, hidden)` of the new tokens, at positions `cache.len()..`, extending those
    /// layers' keys and values in `cache`. [`KvCache::advance`] moves the position on once
    /// every range of the step has run. Collective over tp.
    pub fn layers_cached(
        &self,
        x: &Tensor,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.check_generation_layout()?;
        let n = x.dim(1)?;
        let start = cache.len();
        let positions: Vec<u32> = (start..start + n).map(|p| p as u32).collect();
        let mut x = x.clone();
        for i in layers {
            let c = cache.layer(i, self.layers.len())?;
            x = self
                .layer(i)?
                .get(Track::NoGrad)?
                .forward_cached(&x, &positions, c)?;
        }
        Ok(x)
    }

    /// Generation through pipeline stages, the last stage's work: the logits `(batch, vocab)`
    /// f32 of the last token of `x` `(batch, n, hidden)`. Collective over tp.
    pub fn head_cached(&self, x: &Tensor) -> Result<Tensor> {
        let ends = self.ends(Track::NoGrad)?;
        let n = x.dim(1)?;
        let x = ends.norm.forward(&x.narrow(1, n - 1, 1)?)?;
        Ok(ends.lm_head.logits(&x.squeeze(1)?)?)
    }

    fn check_generation_layout(&self) -> Result<()> {
        let tp = self.ctx.tp();
        if self.ctx.sequence_group().size() > 1 || tp.sequence_parallel() {
            return Err(Error::Parallel(candle_parallel::Error::Layout(
                "generation runs without sequence parallelism (ulysses and ring degree 1, no \
                 TP-sp)"
                    .into(),
            )));
        }
        Ok(())
    }
}

impl crate::causal_lm::CausalLm for Decoder {
    fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    fn hidden_size(&self) -> usize {
        self.spec.hidden_size
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn embed_tokens(&self, batch: &Batch) -> Result<Tensor> {
        self.embed(&self.ends(Track::Grad)?, batch)
    }

    fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        batch: &Batch,
    ) -> Result<Tensor> {
        Decoder::run_layers(self, layers, x, batch)
    }

    fn norm_head_loss(
        &self,
        x: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let ends = self.ends(Track::Grad)?;
        let h = self.final_norm(&ends, x)?;
        self.head_loss(&ends, &h, labels, opts)
    }

    fn norm_head_logits(&self, x: &Tensor) -> Result<Tensor> {
        let ends = self.ends(Track::Grad)?;
        let h = self.final_norm(&ends, x)?;
        self.head_logits(&ends, &h)
    }

    /// The ends are gathered once (under ZeRO-3) for the embedding and the head.
    fn logits(&self, batch: &Batch) -> Result<Tensor> {
        Decoder::logits(self, batch)
    }

    /// The ends are gathered once (under ZeRO-3) for the embedding and the head.
    fn loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        Decoder::loss_sum(self, batch, labels, opts)
    }

    fn routers(&self) -> Option<(&Arc<RouterAux>, f64)> {
        self.router_aux
            .as_ref()
            .map(|(a, coef)| (a, coef.unwrap_or(0.0)))
    }

    fn router_layers(&self) -> Vec<usize> {
        (0..self.spec.num_layers())
            .filter(|&i| self.spec.sparse_block(i).is_some())
            .collect()
    }

    /// The ends are gathered once (under ZeRO-3) for the embedding and the head.
    fn sequence_loss_sums(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<Tensor> {
        Decoder::sequence_loss_sums(self, batch, labels, opts)
    }

    fn end_params(&self) -> Vec<String> {
        self.ends
            .iter()
            .flat_map(|u| u.params().iter().map(|p| p.name.clone()))
            .collect()
    }

    fn embed_cached(&self, ids: &Tensor) -> Result<Tensor> {
        Decoder::embed_cached(self, ids)
    }

    fn layers_cached(
        &self,
        x: &Tensor,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Decoder::layers_cached(self, x, layers, cache)
    }

    fn head_cached(&self, x: &Tensor) -> Result<Tensor> {
        Decoder::head_cached(self, x)
    }

    fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.adapters.as_ref()
    }

    fn to_checkpoint(&self, tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let tensors = match self.spec.experts_layout() {
            Some(layout) => layout.fuse(tensors)?,
            None => tensors,
        };
        match self.spec.fused_layout() {
            Some(layout) => layout.fuse_tensors(tensors),
            None => Ok(tensors),
        }
    }
}

impl Parallelize for Decoder {
    fn units(&mut self) -> Vec<&mut dyn UnitOps> {
        let mut units: Vec<&mut dyn UnitOps> = Vec::new();
        units.extend(self.ends.iter_mut().map(|u| u as &mut dyn UnitOps));
        units.extend(
            self.layers
                .iter_mut()
                .flatten()
                .map(|u| u as &mut dyn UnitOps),
        );
        units
    }
}
