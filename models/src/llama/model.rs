//! LLaMA (Llama 2, Llama 3.x, TinyLlama, SmolLM) built from the parallel layers.
//!
//! The model reads top to bottom like the Hugging Face one; every module takes the
//! [`ParallelCtx`] and leaves the layout to it: q/k/v and gate/up are column-parallel, o and down
//! row-parallel, the embedding and LM head vocab-parallel, attention is the configured
//! sequence-parallel strategy. Activations are `(batch, tokens, hidden)` over this rank's
//! sequence shard (and, under TP-sp, its tensor-parallel part of it).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_parallel::attention::{AttnCall, AttnMask, SequenceParallelAttention};
use candle_parallel::comm::Comm;
use candle_parallel::layers::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, CrossEntropyOptions, ParallelCtx,
    RowParallelLinear, TpGroup, VocabParallelEmbedding,
};
use candle_parallel::ops::{rms_norm, swiglu, RotaryEmbedding};
use candle_parallel::recompute::{checkpoint, Block, Checkpointing, GradSink};

use super::config::LlamaConfig;
use crate::checkpoint::{Param, ParamBuilder, Shard};
use crate::error::{Error, Result};
use crate::unit::{Build, ShardedParam, ShardedUnit, Unit};

/// Loads a column-parallel linear `(out, in)` split by rows over the tensor-parallel group.
fn column(
    vb: &ParamBuilder,
    tp: &TpGroup,
    in_f: usize,
    out_f: usize,
    bias: bool,
) -> Result<ColumnParallelLinear> {
    let p = tp.size();
    let shard = Shard::new(0, tp.rank(), p);
    let w = vb.get_with_hints((out_f / p, in_f), "weight", shard)?;
    let b = if bias {
        Some(vb.get_with_hints(out_f / p, "bias", shard)?)
    } else {
        None
    };
    Ok(ColumnParallelLinear::new(w, b, tp.clone(), false))
}

/// Loads a row-parallel linear `(out, in)` split by columns over the tensor-parallel group.
fn row(
    vb: &ParamBuilder,
    tp: &TpGroup,
    in_f: usize,
    out_f: usize,
    bias: bool,
) -> Result<RowParallelLinear> {
    let p = tp.size();
    let w = vb.get_with_hints((out_f, in_f / p), "weight", Shard::new(1, tp.rank(), p))?;
    let b = if bias {
        Some(vb.get_with_hints(out_f, "bias", Shard::replicated())?)
    } else {
        None
    };
    Ok(RowParallelLinear::new(w, b, tp.clone(), true))
}

/// RMSNorm with the Hugging Face `LlamaRMSNorm` semantics.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(hidden: usize, eps: f64, vb: ParamBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(hidden, "weight", Shard::replicated())?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, &self.weight, self.eps)?)
    }
}

/// Self-attention: column-parallel q/k/v (heads split over tp), rotary embeddings on global
/// positions, the configured sequence-parallel attention, row-parallel o.
#[derive(Debug, Clone)]
pub struct Attention {
    q_proj: ColumnParallelLinear,
    k_proj: ColumnParallelLinear,
    v_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    tp: TpGroup,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl Attention {
    pub fn new(cfg: &LlamaConfig, ctx: &ParallelCtx, vb: ParamBuilder) -> Result<Self> {
        let tp = ctx.tp().clone();
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let (hq, hkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let b = cfg.attention_bias;
        Ok(Self {
            q_proj: column(&vb.pp("q_proj"), &tp, h, hq * d, b)?,
            k_proj: column(&vb.pp("k_proj"), &tp, h, hkv * d, b)?,
            v_proj: column(&vb.pp("v_proj"), &tp, h, hkv * d, b)?,
            o_proj: row(&vb.pp("o_proj"), &tp, hq * d, h, b)?,
            q_heads: hq / tp.size(),
            kv_heads: hkv / tp.size(),
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            tp,
        })
    }

    /// q, k, v `(b, n, heads, head_dim)` of this rank's heads, rotated at `positions`, from `x`
    /// `(b, n', hidden)` (under TP-sp `n'` is this rank's part of the `n` tokens).
    fn qkv(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        positions: &[u32],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let x = self.tp.enter(x)?;
        let (b, n, _) = x.dims3()?;
        let heads = |p: &ColumnParallelLinear, h: usize| -> Result<Tensor> {
            Ok(p.forward_entered(&x)?.reshape((b, n, h, self.head_dim))?)
        };
        let q = rope.apply(&heads(&self.q_proj, self.q_heads)?, positions)?;
        let k = rope.apply(&heads(&self.k_proj, self.kv_heads)?, positions)?;
        Ok((q, k, heads(&self.v_proj, self.kv_heads)?))
    }

    /// `x` `(b, n', hidden)`; `positions` the global positions of the `n` tokens attention sees.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        positions: &[u32],
        attn: &dyn SequenceParallelAttention,
        mask: &AttnMask,
    ) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, rope, positions)?;
        let (b, n) = (q.dim(0)?, q.dim(1)?);
        let o = attn.attention(&q, &k, &v, &AttnCall::new(mask.clone(), self.scale))?;
        let o = o.reshape((b, n, self.q_heads * self.head_dim))?;
        Ok(self.o_proj.forward(&o)?)
    }
}

impl Attention {
    /// Incremental attention for generation (no sequence parallelism): `x` `(b, n, hidden)` new
    /// tokens at `positions`, appended to `cache` (keys and values of earlier tokens at
    /// positions `0..`).
    pub fn forward_cached(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        positions: &[u32],
        cache: &mut Option<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, rope, positions)?;
        let (b, n) = (q.dim(0)?, q.dim(1)?);
        let (k, v) = match cache.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        *cache = Some((k.clone(), v.clone()));
        let spec = flash_ring::AttnSpec::new(
            self.scale,
            flash_ring::MaskKind::Causal,
            flash_ring::Positions::list(positions.to_vec()),
            flash_ring::Positions::range(0, k.dim(1)?),
        );
        let (o, _) = flash_ring::flash_fwd(&q, &k, &v, &spec)
            .map_err(|e| Error::Invalid(format!("attention: {e}")))?;
        let o = o.reshape((b, n, self.q_heads * self.head_dim))?;
        Ok(self.o_proj.forward(&o)?)
    }
}

/// SwiGLU MLP: column-parallel gate and up, row-parallel down.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: ColumnParallelLinear,
    up_proj: ColumnParallelLinear,
    down_proj: RowParallelLinear,
    tp: TpGroup,
}

impl Mlp {
    pub fn new(cfg: &LlamaConfig, ctx: &ParallelCtx, vb: ParamBuilder) -> Result<Self> {
        let tp = ctx.tp().clone();
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate_proj: column(&vb.pp("gate_proj"), &tp, h, i, b)?,
            up_proj: column(&vb.pp("up_proj"), &tp, h, i, b)?,
            down_proj: row(&vb.pp("down_proj"), &tp, i, h, b)?,
            tp,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.tp.enter(x)?;
        let g = self.gate_proj.forward_entered(&x)?;
        let u = self.up_proj.forward_entered(&x)?;
        Ok(self.down_proj.forward(&swiglu(&g, &u)?)?)
    }
}

/// One decoder layer (pre-norm attention and MLP with residuals).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    pub fn new(cfg: &LlamaConfig, ctx: &ParallelCtx, vb: ParamBuilder) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: RmsNorm::new(h, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, ctx, vb.pp("self_attn"))?,
            post_attention_layernorm: RmsNorm::new(h, eps, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(cfg, ctx, vb.pp("mlp"))?,
        })
    }

    pub fn forward(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        positions: &[u32],
        attn: &dyn SequenceParallelAttention,
        mask: &AttnMask,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (x + self.self_attn.forward(&h, rope, positions, attn, mask)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h)?)?)
    }
}

impl DecoderLayer {
    /// Incremental forward for generation, see [`Attention::forward_cached`].
    pub fn forward_cached(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        positions: &[u32],
        cache: &mut Option<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let x = (x + self.self_attn.forward_cached(&h, rope, positions, cache)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h)?)?)
    }
}

/// The keys and values of every layer for incremental generation.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What one forward pass works on: this rank's sequence shard of a batch.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `(batch, n)` u32 token ids of this rank's sequence shard.
    pub input_ids: Tensor,
    /// Global positions (RoPE) of the `n` local tokens.
    pub positions: Vec<u32>,
    /// The attention mask of the global sequence.
    pub mask: AttnMask,
}

impl Batch {
    /// This rank's shard of equal-length global sequences and their next-token labels
    /// (`(batch, n)` i64, label `-100` after the last token of each sequence), cut by the
    /// layout of `ctx`. Errors when the length does not fit the layout.
    pub fn from_sequences(
        ctx: &ParallelCtx,
        seqs: &[Vec<u32>],
        mask: AttnMask,
    ) -> Result<(Self, Tensor)> {
        let labels: Vec<Vec<i64>> = seqs
            .iter()
            .map(|s| {
                s.iter()
                    .skip(1)
                    .map(|&t| t as i64)
                    .chain(std::iter::once(candle_parallel::layers::IGNORE_INDEX))
                    .collect()
            })
            .collect();
        Self::from_tokens(ctx, seqs, &labels, mask)
    }

    /// This rank's shard of equal-length global sequences `ids` and their `labels` (the target
    /// of each token, `-100` ignored), cut by the layout of `ctx`; returns the batch and the
    /// local labels `(batch, n)` i64.
    pub fn from_tokens(
        ctx: &ParallelCtx,
        ids: &[Vec<u32>],
        labels: &[Vec<i64>],
        mask: AttnMask,
    ) -> Result<(Self, Tensor)> {
        let len = ids.first().map(|s| s.len()).unwrap_or(0);
        if len == 0 || ids.iter().any(|s| s.len() != len) {
            return Err(Error::Invalid(
                "a batch needs one or more non-empty sequences of equal length".into(),
            ));
        }
        if labels.len() != ids.len() || labels.iter().any(|l| l.len() != len) {
            return Err(Error::Invalid(
                "labels must have the shape of the token ids".into(),
            ));
        }
        let dev = candle_core::Device::Cpu;
        let flat_ids: Vec<u32> = ids.iter().flatten().copied().collect();
        let flat_labels: Vec<i64> = labels.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat_ids, (ids.len(), len), &dev)?;
        let labels = Tensor::from_vec(flat_labels, (labels.len(), len), &dev)?;
        let batch = Batch {
            input_ids: ctx.shard_tokens(&ids)?,
            positions: ctx.attention_positions(len)?,
            mask,
        };
        Ok((batch, ctx.shard_tokens(&labels)?))
    }
}

/// The parameters at both ends of the model: the token embedding, the final norm and the LM
/// head (the embedding's weight when tied). One unit, so that tied weights are one parameter
/// under every layout.
#[derive(Debug, Clone)]
pub struct Ends {
    embed_tokens: VocabParallelEmbedding,
    norm: RmsNorm,
    /// This rank's vocab shard `(V/tp, hidden)` of the LM head (the embedding's when tied).
    lm_head: Tensor,
}

impl Ends {
    pub fn new(cfg: &LlamaConfig, ctx: &ParallelCtx, vb: ParamBuilder) -> Result<Self> {
        let tp = ctx.tp();
        let v = cfg.vocab_size;
        let shard = Shard::new(0, tp.rank(), tp.size());
        let m = vb.pp("model");
        let emb_w = m.pp("embed_tokens").get_with_hints(
            (v / tp.size(), cfg.hidden_size),
            "weight",
            shard,
        )?;
        let embed_tokens = VocabParallelEmbedding::new(emb_w.clone(), v, tp.comm().clone())?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            emb_w
        } else {
            vb.pp("lm_head")
                .get_with_hints((v / tp.size(), cfg.hidden_size), "weight", shard)?
        };
        Ok(Self {
            embed_tokens,
            norm,
            lm_head,
        })
    }
}

/// A candle-parallel error from a model error (for blocks run by [`checkpoint`]).
fn parallel_err(e: Error) -> candle_parallel::Error {
    match e {
        Error::Parallel(p) => p,
        other => candle_parallel::Error::Candle(other.into()),
    }
}

/// `LlamaForCausalLM`.
///
/// How the layers run is set apart from what they compute: [`Llama::set_checkpointing`]
/// chooses activation checkpointing of every decoder layer, [`Llama::shard_parameters`] shards
/// the parameters ZeRO-3 style (each layer, and the embedding/norm/head unit, gathered for each
/// use). With checkpointing, parameter gradients arrive through [`Llama::backward`] (use it in
/// place of `loss.backward()`).
#[derive(Debug, Clone)]
pub struct Llama {
    ends: Unit<Ends>,
    layers: Vec<Unit<DecoderLayer>>,
    rope: RotaryEmbedding,
    ctx: ParallelCtx,
    cfg: LlamaConfig,
    checkpointing: Checkpointing,
    sink: GradSink,
}

impl Llama {
    /// Builds the model for this rank's layout, loading its slice of every parameter through
    /// `vb` (keys as in the Hugging Face checkpoint). Collective only through `ctx`'s creation;
    /// local here. Errors when the layout does not divide the heads or the vocabulary.
    pub fn new(cfg: &LlamaConfig, ctx: &ParallelCtx, vb: ParamBuilder) -> Result<Self> {
        check_layout(cfg, ctx)?;
        let ends = Ends::new(cfg, ctx, vb.clone())?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                DecoderLayer::new(cfg, ctx, vb.pp("model").pp("layers").pp(i)).map(Unit::Resident)
            })
            .collect::<Result<Vec<_>>>()?;
        let (theta, scaling) = cfg.rope(std::path::Path::new("config.json"))?;
        let rope = RotaryEmbedding::new(cfg.head_dim(), theta, &scaling)?;
        Ok(Self {
            ends: Unit::Resident(ends),
            layers,
            rope,
            ctx: ctx.clone(),
            cfg: cfg.clone(),
            checkpointing: Checkpointing::None,
            sink: GradSink::new(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// Activation checkpointing of every decoder layer (see [`candle_parallel::recompute`]).
    pub fn set_checkpointing(&mut self, mode: Checkpointing) {
        self.checkpointing = mode;
    }

    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpointing
    }

    /// `loss.backward()` plus the parameter gradients computed inside recomputed layers.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Ok(self.sink.backward(loss)?)
    }

    /// ZeRO-3: replaces the resident parameters of every decoder layer and of the
    /// embedding/norm/head unit by this rank's chunks over `group`, and returns the chunks
    /// (sorted by name; the trainable parameters from now on). `params` are the model's
    /// parameters as loaded (each rank of `group` holding the same names and shapes); the caller
    /// should drop them, so that the whole tensors are freed. Local.
    pub fn shard_parameters(
        &mut self,
        params: &[Param],
        group: &Comm,
    ) -> Result<Vec<ShardedParam>> {
        let (cfg, ctx) = (self.cfg.clone(), self.ctx.clone());
        let in_layer = |p: &Param| {
            p.name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
        };
        let mut out = Vec::new();
        for i in 0..self.layers.len() {
            let mine: Vec<&Param> = params.iter().filter(|p| in_layer(p) == Some(i)).collect();
            if mine.is_empty() {
                return Err(Error::Invalid(format!(
                    "no parameters of layer {i} given to shard"
                )));
            }
            let (c, x) = (cfg.clone(), ctx.clone());
            let build: Build<DecoderLayer> = Arc::new(move |vb: ParamBuilder<'static>| {
                DecoderLayer::new(&c, &x, vb.pp("model").pp("layers").pp(i))
            });
            let unit = ShardedUnit::new(&mine, group, build)?;
            out.extend(unit.params().iter().cloned());
            self.layers[i] = Unit::Sharded(Arc::new(unit));
        }
        let ends: Vec<&Param> = params.iter().filter(|p| in_layer(p).is_none()).collect();
        let build: Build<Ends> =
            Arc::new(move |vb: ParamBuilder<'static>| Ends::new(&cfg, &ctx, vb));
        let unit = ShardedUnit::new(&ends, group, build)?;
        out.extend(unit.params().iter().cloned());
        self.ends = Unit::Sharded(Arc::new(unit));
        out.sort_by(|a, b| a.name.cmp(&b.name));
        if out.len() != params.len() {
            return Err(Error::Invalid(format!(
                "{} parameters given, {} sharded",
                params.len(),
                out.len()
            )));
        }
        Ok(out)
    }

    /// The embedding/norm/head unit with whole weights (gathered under ZeRO-3, differentiably
    /// when `grad`).
    pub fn ends(&self, grad: bool) -> Result<Ends> {
        self.ends.get(grad)
    }

    /// The first stage's work: token embeddings `(batch, n', hidden)` of this rank's shard
    /// (under TP-sp its tensor-parallel part of the tokens). Collective over tp.
    pub fn embed(&self, ends: &Ends, batch: &Batch) -> Result<Tensor> {
        let (_, n) = batch.input_ids.dims2()?;
        if batch.positions.len() != n {
            return Err(Error::Invalid(format!(
                "{} positions for {n} tokens",
                batch.positions.len()
            )));
        }
        let x = ends.embed_tokens.forward(&batch.input_ids)?;
        Ok(self.ctx.tp().split_tokens(&x)?)
    }

    /// Decoder layers `layers` on `x` (the embeddings, or the previous stage's output), each
    /// under the model's checkpointing mode. Collective over the model-parallel group.
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
        let attention = self.ctx.attention_handle();
        let positions: Arc<[u32]> = batch.positions.clone().into();
        let mut x = x.clone();
        for unit in &self.layers[layers] {
            x = match self.checkpointing {
                Checkpointing::None => {
                    let layer = unit.get(true)?;
                    layer.forward(&x, &self.rope, &positions, attention.as_ref(), &batch.mask)?
                }
                mode => {
                    let (unit, rope) = (unit.clone(), self.rope.clone());
                    let (positions, mask) = (positions.clone(), batch.mask.clone());
                    let block: Block = Arc::new(move |x, attn| {
                        let layer = unit.get(x.track_op()).map_err(parallel_err)?;
                        layer
                            .forward(x, &rope, &positions, attn, &mask)
                            .map_err(parallel_err)
                    });
                    checkpoint(mode, &x, &attention, &self.sink, block)?
                }
            };
        }
        Ok(x)
    }

    /// The last stage's work before the head: the final norm, with the tokens of the
    /// tensor-parallel group gathered back under TP-sp. `(batch, n, hidden)`.
    pub fn final_norm(&self, ends: &Ends, x: &Tensor) -> Result<Tensor> {
        let x = ends.norm.forward(x)?;
        Ok(self.ctx.tp().gather_tokens(&x)?)
    }

    /// Final hidden states `(batch, n, hidden)` of the rank's sequence shard, replicated over
    /// the tensor-parallel group. Collective over the whole model-parallel group.
    pub fn forward_hidden(&self, batch: &Batch) -> Result<Tensor> {
        let ends = self.ends(true)?;
        self.hidden_with(&ends, batch)
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
        let ends = self.ends(true)?;
        let h = self.hidden_with(&ends, batch)?;
        self.head_loss(&ends, &h, labels, opts)
    }

    /// The loss of the LM head on final hidden states `h` `(batch, n, hidden)` (see
    /// [`Llama::loss_sum`]). Collective over tp.
    pub fn head_loss(
        &self,
        ends: &Ends,
        h: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let (b, n, hd) = h.dims3()?;
        let h = h.reshape((b * n, hd))?;
        let labels = labels.flatten_all()?;
        Ok(vocab_parallel_cross_entropy(
            &h,
            &ends.lm_head,
            &labels,
            self.ctx.tp().comm(),
            opts,
        )?)
    }

    /// Logits `(batch, n, vocab)` f32 of this rank's tokens (all-gathered over the vocab shards;
    /// for evaluation and generation, not for long-context training).
    pub fn logits(&self, batch: &Batch) -> Result<Tensor> {
        let ends = self.ends(true)?;
        let h = self.hidden_with(&ends, batch)?;
        self.logits_with(&ends, &h)
    }

    /// Generation step: runs the new tokens `ids` `(batch, n)` (positions `cache.len()..`)
    /// through the model, extends `cache`, and returns the logits `(batch, vocab)` f32 of the
    /// last token. Needs a layout without sequence parallelism (tensor parallelism is fine).
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let tp = self.ctx.tp();
        if self.ctx.sequence_group().size() > 1 || tp.sequence_parallel() {
            return Err(Error::Parallel(candle_parallel::Error::Layout(
                "generation runs without sequence parallelism (--ulysses 1 --ring 1, no --tp-sp)"
                    .into(),
            )));
        }
        let (_, n) = ids.dims2()?;
        let start = cache.len;
        let positions: Vec<u32> = (start..start + n).map(|p| p as u32).collect();
        if cache.layers.len() != self.layers.len() {
            cache.layers = vec![None; self.layers.len()];
        }
        let ends = self.ends(false)?;
        let mut x = ends.embed_tokens.forward(ids)?;
        for (unit, c) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = unit
                .get(false)?
                .forward_cached(&x, &self.rope, &positions, c)?;
        }
        cache.len += n;
        let x = ends.norm.forward(&x.narrow(1, n - 1, 1)?)?;
        self.logits_with(&ends, &x.squeeze(1)?)
    }

    /// Logits `(.., vocab)` f32 from final hidden states `(.., hidden)`.
    fn logits_with(&self, ends: &Ends, h: &Tensor) -> Result<Tensor> {
        let local = candle_parallel::layers::linear(
            &h.to_dtype(DType::F32)?,
            &ends.lm_head.to_dtype(DType::F32)?,
            None,
        )?;
        let tp = self.ctx.tp();
        if tp.size() == 1 {
            return Ok(local);
        }
        let last = local.rank() - 1;
        Ok(candle_parallel::collectives::gather(
            &local,
            tp.comm(),
            last,
        )?)
    }
}

/// Checks that the layout divides the model before anything is loaded.
fn check_layout(cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<()> {
    let tp = ctx.tp().size();
    let (hq, hkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
    let checks = [
        ("num_attention_heads", hq),
        ("num_key_value_heads", hkv),
        ("vocab_size", cfg.vocab_size),
        ("intermediate_size", cfg.intermediate_size),
    ];
    for (what, n) in checks {
        if !n.is_multiple_of(tp) {
            return Err(Error::Parallel(candle_parallel::Error::Layout(format!(
                "--tp {tp} does not divide {what} = {n} of the model"
            ))));
        }
    }
    let u = ctx.attention().group().ulysses.size();
    if !(hq / tp).is_multiple_of(u) {
        return Err(Error::Parallel(candle_parallel::Error::Layout(format!(
            "--ulysses {u} does not divide the {} attention heads per tensor-parallel rank \
             (num_attention_heads {hq} / tp {tp})",
            hq / tp
        ))));
    }
    Ok(())
}
