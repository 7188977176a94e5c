//! LLaMA (Llama 2, Llama 3.x, TinyLlama, SmolLM) as `LlamaForCausalLM`, from the parallel
//! modules of [`candle_parallel::nn`].
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
    Adapters, AttentionConfig, Batch, Block, CrossEntropyOptions, EmbeddingConfig, LayerKv, LmHead,
    Mlp, MlpConfig, NormConfig, ParallelAttention, ParallelCtx, ParamBuilder, Pass, RmsNorm, Track,
    Unit, UnitOps, VocabParallelEmbedding,
};
use candle_parallel::plan::Parallelize;

use super::config::LlamaConfig;
use crate::causal_lm::KvCache;
use crate::error::{Error, Result};

impl LlamaConfig {
    /// The attention of a decoder layer (RoPE of this config).
    pub fn attention_config(&self) -> Result<AttentionConfig> {
        let rope = self
            .rope_spec(std::path::Path::new("config.json"))?
            .embedding()?;
        Ok(AttentionConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.num_kv_heads(),
            self.head_dim(),
        )
        .with_bias(self.attention_bias)
        .with_rope(rope))
    }

    /// The SwiGLU MLP of a decoder layer.
    pub fn mlp_config(&self) -> MlpConfig {
        MlpConfig::swiglu(self.hidden_size, self.intermediate_size).with_bias(self.mlp_bias)
    }

    /// The RMSNorms.
    pub fn norm_config(&self) -> NormConfig {
        NormConfig::new(self.hidden_size, self.rms_norm_eps)
    }

    /// The embedding table and the LM head.
    pub fn embedding_config(&self) -> EmbeddingConfig {
        EmbeddingConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
        }
    }
}

/// One decoder layer (pre-norm attention and MLP with residuals).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: ParallelAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    pub fn new(cfg: &LlamaConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let norm = cfg.norm_config();
        Ok(Self {
            input_layernorm: RmsNorm::new(&norm, vb.pp("input_layernorm"), ctx)?,
            self_attn: ParallelAttention::new(&cfg.attention_config()?, vb.pp("self_attn"), ctx)?,
            post_attention_layernorm: RmsNorm::new(&norm, vb.pp("post_attention_layernorm"), ctx)?,
            mlp: Mlp::new(&cfg.mlp_config(), vb.pp("mlp"), ctx)?,
        })
    }

    /// Incremental forward for generation, see [`ParallelAttention::forward_cached`].
    pub fn forward_cached(&self, x: &Tensor, pos: &[u32], cache: &mut LayerKv) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (x + self.self_attn.forward_cached(&h, pos, cache)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h)?)?)
    }
}

impl Block for DecoderLayer {
    fn forward(&self, x: &Tensor, pass: &Pass) -> candle_parallel::Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (x + self.self_attn.forward(&h, pass)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h)?)?)
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
    pub fn new(cfg: &LlamaConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let m = vb.pp("model");
        let emb = cfg.embedding_config();
        let embed_tokens = VocabParallelEmbedding::new(&emb, m.pp("embed_tokens"), ctx)?;
        let lm_head = if cfg.tie_word_embeddings {
            LmHead::tied(&embed_tokens, ctx)
        } else {
            LmHead::new(&emb, vb.pp("lm_head"), ctx)?
        };
        Ok(Self {
            norm: RmsNorm::new(&cfg.norm_config(), m.pp("norm"), ctx)?,
            embed_tokens,
            lm_head,
        })
    }
}

/// `LlamaForCausalLM`; see the [module docs](self). Parameter gradients arrive through
/// [`Llama::backward`] (`loss.backward()` plus those of recomputed layers).
#[derive(Debug, Clone)]
pub struct Llama {
    /// `None` on a pipeline stage that holds neither the first nor the last layer.
    ends: Option<Unit<Ends>>,
    /// `None` for layers another pipeline stage holds.
    layers: Vec<Option<Unit<DecoderLayer>>>,
    ctx: ParallelCtx,
    cfg: LlamaConfig,
    /// The LoRA adapters the model was built with (see [`ParamBuilder::with_adapters`]).
    adapters: Option<Arc<Adapters>>,
}

impl Llama {
    /// Builds the model for this rank's layout, loading its slice of every parameter through
    /// `vb` (keys as in the Hugging Face checkpoint). Local. Errors (naming the config field)
    /// when the layout does not divide the heads, the hidden units or the vocabulary.
    pub fn new(cfg: &LlamaConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let all = 0..cfg.num_hidden_layers;
        Self::new_stage(cfg, vb, ctx, std::slice::from_ref(&all), true)
    }

    /// A pipeline stage of the model: only the decoder layers in `layers` (one range per model
    /// chunk of this rank) and, with `ends`, the embedding, final norm and head (the first and
    /// the last stage hold them; see [`crate::causal_lm::LmStages`]). Loads nothing else.
    pub fn new_stage(
        cfg: &LlamaConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        layers: &[std::ops::Range<usize>],
        ends: bool,
    ) -> Result<Self> {
        let unit_err = |e: candle_parallel::Error| Error::Parallel(e);
        if let Some(r) = layers.iter().find(|r| r.end > cfg.num_hidden_layers) {
            return Err(Error::Invalid(format!(
                "layers {r:?} of a model with {} layers (num_hidden_layers)",
                cfg.num_hidden_layers
            )));
        }
        let ends = if ends {
            let (c, x) = (cfg.clone(), ctx.clone());
            Some(
                Unit::new(&vb, move |vb| {
                    Ends::new(&c, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map_err(unit_err)?,
            )
        } else {
            None
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                if !layers.iter().any(|r| r.contains(&i)) {
                    return Ok(None);
                }
                let (c, x) = (cfg.clone(), ctx.clone());
                let vb = vb.pp("model").pp("layers").pp(i);
                Unit::new(&vb, move |vb| {
                    DecoderLayer::new(&c, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map(Some)
                .map_err(unit_err)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            ends,
            layers,
            ctx: ctx.clone(),
            cfg: cfg.clone(),
            adapters: vb.adapters().cloned(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
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
        Ok(ends.embed_tokens.forward(&batch.input_ids)?)
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
        Ok(ends.embed_tokens.lookup(ids)?)
    }

    /// Logits `(.., tokens, V)` f32 of final hidden states `h` (see [`Llama::logits`]).
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
    /// [`Llama::loss_sum`]; a sequence with no labelled token here gives 0. Collective over tp.
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

    /// The loss of the LM head on final hidden states `h` (see [`Llama::loss_sum`]). Collective
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
        Ok(self.ends(Track::NoGrad)?.embed_tokens.lookup(ids)?)
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

impl crate::causal_lm::CausalLm for Llama {
    fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
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
        Llama::run_layers(self, layers, x, batch)
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
        Llama::logits(self, batch)
    }

    /// The ends are gathered once (under ZeRO-3) for the embedding and the head.
    fn loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        Llama::loss_sum(self, batch, labels, opts)
    }

    fn end_params(&self) -> Vec<String> {
        self.ends
            .iter()
            .flat_map(|u| u.params().iter().map(|p| p.name.clone()))
            .collect()
    }

    fn embed_cached(&self, ids: &Tensor) -> Result<Tensor> {
        Llama::embed_cached(self, ids)
    }

    fn layers_cached(
        &self,
        x: &Tensor,
        layers: std::ops::Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Llama::layers_cached(self, x, layers, cache)
    }

    fn head_cached(&self, x: &Tensor) -> Result<Tensor> {
        Llama::head_cached(self, x)
    }

    fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.adapters.as_ref()
    }
}

impl Parallelize for Llama {
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
