//! Multi-head attention over any parallel layout: q/k/v projections column-parallel (heads
//! split over the tensor-parallel group; biases on q/k/v and on the output each optional),
//! optional per-head RMSNorms of q and k, optional rotary embeddings at the tokens' global
//! positions, an optional sliding window and logit soft-cap per layer, the pass's sequence-parallel attention over the ulysses × ring group (any
//! [`Strategy`](crate::attention::Strategy), any [`AttnMask`](crate::attention::AttnMask): causal,
//! full, documents), GQA with any ratio, and a row-parallel output projection. The same module
//! serves a causal LM, a DiT block (full mask, no RoPE) and a vision tower.

use candle_core::Tensor;

use super::{
    ColumnParallelLinear, Entered, LinearConfig, NormConfig, ParallelCtx, ParamBuilder, Pass,
    RmsNorm, RowParallelLinear, TpGroup,
};
use crate::attention::AttnCall;
use crate::error::{Error, Result};
use crate::ops::RotaryEmbedding;

/// The shape and checkpoint names of a [`ParallelAttention`]: `q` `(heads·head_dim, hidden)`,
/// `k`, `v` `(kv_heads·head_dim, hidden)`, `o` `(hidden, heads·head_dim)`.
#[derive(Debug, Clone)]
pub struct AttentionConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Biases on q, k and v.
    pub bias: bool,
    /// A bias on the output projection (default: as [`AttentionConfig::bias`]; Qwen2 has
    /// biases on q, k and v only).
    pub o_bias: bool,
    /// RMSNorm over each head's `head_dim` features of q and k (`q_norm`, `k_norm`, applied
    /// before RoPE: Qwen3, Gemma 3); `None`: no q/k norms.
    pub qk_norm: Option<NormConfig>,
    /// Sliding window of the layer: a query at `pq` sees keys at `pq - pk < window` (on top
    /// of the pass's mask); `None`: global attention.
    pub window: Option<usize>,
    /// Attention-logit soft-cap `c` (the softmax takes `c · tanh(s / c)` of the scaled scores
    /// `s`: Gemma 2); `None`: no cap.
    pub softcap: Option<f32>,
    /// Rotary embeddings of q and k at the tokens' global positions (none: no RoPE).
    pub rope: Option<RotaryEmbedding>,
    /// Softmax scale (default `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sub-module names of the four projections (`vb.pp(..)` keys).
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    /// The checkpoint's fused projection q, k and v are parts of (Phi-3's `qkv_proj`): the
    /// parts load under their own names from a view of the checkpoint that splits it, and a
    /// LoRA adapter is the fused module's (see [`ColumnParallelLinear::new_part`]).
    pub fused_qkv: Option<String>,
}

impl AttentionConfig {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj` without bias or RoPE, scale `1/sqrt(head_dim)`.
    pub fn new(hidden_size: usize, num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            bias: false,
            o_bias: false,
            qk_norm: None,
            window: None,
            softcap: None,
            rope: None,
            scale: 1.0 / (head_dim as f32).sqrt(),
            q: "q_proj".into(),
            k: "k_proj".into(),
            v: "v_proj".into(),
            o: "o_proj".into(),
            fused_qkv: None,
        }
    }

    /// Biases on all four projections.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self.o_bias = bias;
        self
    }

    /// Biases on q, k, v (`qkv`) and on the output projection (`o`) separately.
    pub fn with_biases(mut self, qkv: bool, o: bool) -> Self {
        self.bias = qkv;
        self.o_bias = o;
        self
    }

    /// Per-head RMSNorms of q and k before RoPE (`norm.hidden_size` must be `head_dim`).
    pub fn with_qk_norm(mut self, norm: Option<NormConfig>) -> Self {
        self.qk_norm = norm;
        self
    }

    /// A sliding window of `window` tokens (`None`: global attention).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// Attention logits soft-capped at `softcap` (`None`: no cap).
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    /// Another softmax scale (Gemma's `query_pre_attn_scalar ** -0.5`).
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    pub fn with_rope(mut self, rope: RotaryEmbedding) -> Self {
        self.rope = Some(rope);
        self
    }

    /// q, k and v as parts of the fused projection `fused` (Phi-3's `qkv_proj`); `None`:
    /// three projections.
    pub fn with_fused_qkv(mut self, fused: Option<&str>) -> Self {
        self.fused_qkv = fused.map(String::from);
        self
    }

    /// Other checkpoint names of the q, k, v and output projections (CLIP's `out_proj`,
    /// diffusers' `to_q`, ..., `to_out.0`).
    pub fn with_names(mut self, q: &str, k: &str, v: &str, o: &str) -> Self {
        (self.q, self.k, self.v, self.o) = (q.into(), k.into(), v.into(), o.into());
        self
    }
}

/// The keys and values one attention layer keeps for incremental generation: `(batch, tokens,
/// kv_heads, head_dim)` each, of the positions `start..start + tokens`. A layer with a sliding
/// window of `w` keeps only the last `w - 1` (all that later tokens can see), so its cache stays
/// bounded however long the generation.
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    kv: Option<(Tensor, Tensor)>,
    start: usize,
}

impl LayerKv {
    /// The number of cached tokens.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dim(1).unwrap_or(0))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Attention over any parallel layout; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ParallelAttention {
    q_proj: ColumnParallelLinear,
    k_proj: ColumnParallelLinear,
    v_proj: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    rope: Option<RotaryEmbedding>,
    /// Per-head norms of q and k.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Heads of this tensor-parallel rank.
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    tp: TpGroup,
}

impl ParallelAttention {
    /// Loads this rank's heads. Errors (naming the config fields) when the tensor-parallel
    /// degree does not divide the heads and kv heads, when the q heads are not a multiple of the
    /// kv heads, or when the ulysses degree does not divide the heads of a tensor-parallel rank.
    pub fn new(cfg: &AttentionConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let tp = ctx.tp().clone();
        let (hq, hkv, d, h) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(Error::invalid(
                "attention",
                format!("num_attention_heads {hq} is not a multiple of num_key_value_heads {hkv}"),
            ));
        }
        ctx.check_tp_divides("num_attention_heads", hq)?;
        ctx.check_tp_divides("num_key_value_heads", hkv)?;
        let u = ctx.attention().group().ulysses.size();
        if !(hq / tp.size()).is_multiple_of(u) {
            return Err(Error::Layout(format!(
                "the ulysses degree {u} does not divide the {} attention heads per \
                 tensor-parallel rank (num_attention_heads {hq} / tp {})",
                hq / tp.size(),
                tp.size()
            )));
        }
        if let Some(rope) = &cfg.rope {
            if rope.head_dim() != d {
                return Err(Error::invalid(
                    "attention",
                    format!(
                        "rotary embeddings of dim {} for head_dim {d}",
                        rope.head_dim()
                    ),
                ));
            }
        }
        if cfg.window == Some(0) {
            return Err(Error::invalid("attention", "a sliding window of 0 tokens"));
        }
        if let Some(c) = cfg.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(Error::invalid(
                "attention",
                format!("attn_logit_softcapping {c} must be a positive number"),
            ));
        }
        let qk_norm = match &cfg.qk_norm {
            Some(n) if n.hidden_size != d => {
                return Err(Error::invalid(
                    "attention",
                    format!("q/k norms of {} features for head_dim {d}", n.hidden_size),
                ))
            }
            Some(n) => Some((
                RmsNorm::new_per_head(n, vb.pp("q_norm"), ctx)?,
                RmsNorm::new_per_head(n, vb.pp("k_norm"), ctx)?,
            )),
            None => None,
        };
        let proj = |out: usize, name: &str| -> Result<ColumnParallelLinear> {
            let lin = LinearConfig::new(h, out).with_bias(cfg.bias);
            let part = vb.pp(name);
            let fused = cfg
                .fused_qkv
                .as_ref()
                .map_or_else(|| part.clone(), |f| vb.pp(f));
            ColumnParallelLinear::new_part(&lin, part, &fused, ctx)
        };
        Ok(Self {
            q_proj: proj(hq * d, &cfg.q)?,
            k_proj: proj(hkv * d, &cfg.k)?,
            v_proj: proj(hkv * d, &cfg.v)?,
            o_proj: RowParallelLinear::new(
                &LinearConfig::new(hq * d, h).with_bias(cfg.o_bias),
                vb.pp(&cfg.o),
                ctx,
            )?,
            rope: cfg.rope.clone(),
            qk_norm,
            window: cfg.window,
            softcap: cfg.softcap,
            q_heads: hq / tp.size(),
            kv_heads: hkv / tp.size(),
            head_dim: d,
            scale: cfg.scale,
            tp,
        })
    }

    /// q, k, v `(b, n, heads, head_dim)` of this rank's heads, rotated at `positions` with the
    /// frequencies of a sequence of `seq_len` tokens, from `x` `(b, n', hidden)` (under TP-sp
    /// `n'` is this rank's part of the `n` tokens).
    fn qkv(
        &self,
        x: &Tensor,
        positions: &[u32],
        seq_len: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let x = Entered::new(x, &self.tp)?;
        let (b, n, _) = x.entered.dims3()?;
        let heads = |p: &ColumnParallelLinear, h: usize| -> Result<Tensor> {
            Ok(p.forward_entered(&x)?.reshape((b, n, h, self.head_dim))?)
        };
        let (q, k) = (
            heads(&self.q_proj, self.q_heads)?,
            heads(&self.k_proj, self.kv_heads)?,
        );
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let (q, k) = match &self.rope {
            Some(rope) => (
                rope.apply_seq(&q, positions, seq_len)?,
                rope.apply_seq(&k, positions, seq_len)?,
            ),
            None => (q, k),
        };
        Ok((q, k, heads(&self.v_proj, self.kv_heads)?))
    }

    /// `x` `(batch, tokens', hidden)` → the same shape: attention of this rank's tokens over
    /// the whole sequence with the pass's mask and strategy. Collective over tp and the
    /// sequence-parallel group.
    pub fn forward(&self, x: &Tensor, pass: &Pass) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, pass.positions, pass.seq_len)?;
        let (b, n) = (q.dim(0)?, q.dim(1)?);
        let call = AttnCall::new(pass.mask.clone(), self.scale)
            .with_window(self.window)
            .with_softcap(self.softcap);
        let o = pass.attention.attention(&q, &k, &v, &call)?;
        self.o_proj
            .forward(&o.reshape((b, n, self.q_heads * self.head_dim))?)
    }

    /// Incremental causal attention for generation (no sequence parallelism): `x` `(b, n,
    /// hidden)` new tokens at positions `pos` (the ones after the cache's), appended to `cache`
    /// (keys and values of the earlier tokens); with a sliding window, the keys no later token
    /// can see are dropped from it. Collective over tp.
    ///
    /// RoPE as in transformers' `generate`: the new tokens rotated with the frequencies of the
    /// sequence so far (`max(pos) + 1` tokens, which matters for dynamic and longrope), the
    /// cached keys keeping the rotation they were given when they were new.
    pub fn forward_cached(&self, x: &Tensor, pos: &[u32], cache: &mut LayerKv) -> Result<Tensor> {
        let seq_len = pos.iter().max().map_or(0, |&p| p as usize + 1);
        let (q, k, v) = self.qkv(x, pos, seq_len)?;
        let (b, n) = (q.dim(0)?, q.dim(1)?);
        let (k, v) = match cache.kv.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        let (start, len) = (cache.start, k.dim(1)?);
        let spec = flash_ring::AttnSpec::new(
            self.scale,
            flash_ring::MaskKind::Causal,
            flash_ring::Positions::list(pos.to_vec()),
            flash_ring::Positions::range(start, len),
        );
        let spec = match self.window {
            Some(w) => spec.with_window(w),
            None => spec,
        };
        let spec = match self.softcap {
            Some(c) => spec.with_softcap(c),
            None => spec,
        };
        let (o, _) = flash_ring::flash_fwd(&q, &k, &v, &spec)
            .map_err(crate::attention::block::kernel_err)?;
        // A later token at position p >= start + len sees keys at p - w < j: none before
        // start + len + 1 - w.
        let keep_from = match self.window {
            Some(w) => (start + len + 1).saturating_sub(w).max(start),
            None => start,
        };
        let drop = keep_from - start;
        *cache = LayerKv {
            kv: Some((
                k.narrow(1, drop, len - drop)?,
                v.narrow(1, drop, len - drop)?,
            )),
            start: keep_from,
        };
        self.o_proj
            .forward(&o.reshape((b, n, self.q_heads * self.head_dim))?)
    }
}
