//! DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers") as diffusers'
//! `DiTTransformer2DModel`, from the parallel modules of [`candle_parallel::nn`].
//!
//! The image `(batch, C, H, W)` is cut into `p × p` patches (the patch embedding's
//! convolution, as a linear map of each patch), plus fixed 2D sin-cos positions; the patch
//! tokens run through adaLN-Zero blocks with full (bidirectional) attention, and the output
//! layer maps each token back to `p × p × out_channels` values (noise, and with a learned sigma
//! the variance interpolation). Every block conditions on the timestep and class label through
//! its own embedder (`transformer_blocks.N.norm1.emb`, as diffusers stores DiT); the output
//! layer uses block 0's.
//!
//! The file describes the model and nothing else: the layout is the [`ParallelCtx`]'s. The
//! patch tokens are this rank's sequence-parallel shard ([`ParallelCtx::shard_tokens`]), heads
//! and MLP units are split over the tensor-parallel group, and each block and the two ends are
//! [`Unit`]s a memory plan shards or recomputes. The per-sample conditioning reaches the blocks
//! through [`Pass::cond`]: a `(batch, 2)` f32 tensor of (timestep, class label).

use candle_core::{DType, Device, Tensor, D};
use candle_parallel::attention::AttnMask;
use candle_parallel::nn::{
    linear, Activation, AttentionConfig, Block, LayerNorm, Mlp, MlpConfig, NormConfig,
    ParallelAttention, ParallelCtx, ParamBuilder, Pass, Track, Unit, UnitOps,
};
use candle_parallel::ops::{embedding_lookup, gated_residual};
use candle_parallel::plan::Parallelize;

use super::config::{DitConfig, TIMESTEP_CHANNELS};
use crate::error::{Error, Result};

/// eps of the parameter-free LayerNorms of adaLN-Zero and of the output layer (diffusers).
const ADA_NORM_EPS: f64 = 1e-6;

/// A linear layer whose parameters are replicated over the tensor-parallel group (the small
/// conditioning and patch layers).
#[derive(Debug, Clone)]
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn new(vb: &ParamBuilder, out_f: usize, in_f: usize) -> Result<Self> {
        Ok(Self {
            weight: vb.get((out_f, in_f), "weight")?,
            bias: vb.get(out_f, "bias")?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(linear(x, &self.weight, Some(&self.bias))?)
    }
}

/// diffusers' `get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=1)`:
/// `(batch)` timesteps → `(batch, 256)` f32 `[cos(t·f), sin(t·f)]`, f = 10000^(-k/127).
/// Computed in f64 and rounded once (diffusers computes `t·f` and its sine in f32, whose
/// argument error at t ≈ 1000 is ~1e-4 rad: these features are closer to the exact ones).
pub fn timestep_features(t: &Tensor) -> Result<Tensor> {
    let half = TIMESTEP_CHANNELS / 2;
    let ln = (10000f64).ln();
    let freqs: Vec<f64> = (0..half)
        .map(|k| (-ln * k as f64 / (half as f64 - 1.0)).exp())
        .collect();
    let t = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let mut out = Vec::with_capacity(t.len() * TIMESTEP_CHANNELS);
    for &t in &t {
        out.extend(freqs.iter().map(|f| (t * f).cos() as f32));
        out.extend(freqs.iter().map(|f| (t * f).sin() as f32));
    }
    Ok(Tensor::from_vec(
        out,
        (t.len(), TIMESTEP_CHANNELS),
        &Device::Cpu,
    )?)
}

/// `transformer_blocks.N.norm1.emb`: timestep MLP plus class embedding (diffusers'
/// `CombinedTimestepLabelEmbeddings`); the label table has a row for the null class.
#[derive(Debug, Clone)]
pub struct ConditionEmbedding {
    linear_1: Dense,
    linear_2: Dense,
    table: Tensor,
}

impl ConditionEmbedding {
    fn new(cfg: &DitConfig, vb: ParamBuilder) -> Result<Self> {
        let h = cfg.hidden_size();
        let t = vb.pp("timestep_embedder");
        Ok(Self {
            linear_1: Dense::new(&t.pp("linear_1"), h, TIMESTEP_CHANNELS)?,
            linear_2: Dense::new(&t.pp("linear_2"), h, h)?,
            table: vb
                .pp("class_embedder")
                .pp("embedding_table")
                .get((cfg.num_classes() + 1, h), "weight")?,
        })
    }

    /// `cond` `(batch, 2)` f32 (timestep, label) → `(batch, hidden)`.
    pub fn forward(&self, cond: &Tensor) -> Result<Tensor> {
        let t = cond.narrow(1, 0, 1)?.squeeze(1)?;
        let labels = cond.narrow(1, 1, 1)?.squeeze(1)?.to_dtype(DType::U32)?;
        let t = timestep_features(&t)?.to_dtype(self.table.dtype())?;
        let t = self.linear_2.forward(&self.linear_1.forward(&t)?.silu()?)?;
        let labels: Vec<Option<u32>> = labels.to_vec1::<u32>()?.into_iter().map(Some).collect();
        Ok((t + embedding_lookup(&self.table, &labels)?)?)
    }
}

/// `transformer_blocks.N`: adaLN-Zero attention and MLP (diffusers' `BasicTransformerBlock`
/// with `norm_type="ada_norm_zero"`).
#[derive(Debug, Clone)]
pub struct DitBlock {
    emb: ConditionEmbedding,
    ada: Dense,
    norm1: LayerNorm,
    attn1: ParallelAttention,
    norm2: LayerNorm,
    ff: Mlp,
}

impl DitBlock {
    pub fn new(cfg: &DitConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let h = cfg.hidden_size();
        let heads = cfg.num_attention_heads;
        let attn = AttentionConfig::new(h, heads, heads, cfg.attention_head_dim)
            .with_bias(cfg.attention_bias)
            .with_names("to_q", "to_k", "to_v", "to_out.0");
        let ff = MlpConfig::gelu(h, cfg.intermediate_size(), Activation::GeluTanh).with_names(
            "net.0.proj",
            "net.2",
            "",
        );
        let norm2 = if cfg.norm_elementwise_affine {
            NormConfig::new(h, cfg.norm_eps).with_bias(true)
        } else {
            NormConfig::new(h, cfg.norm_eps).without_affine()
        };
        Ok(Self {
            emb: ConditionEmbedding::new(cfg, vb.pp("norm1").pp("emb"))?,
            ada: Dense::new(&vb.pp("norm1").pp("linear"), 6 * h, h)?,
            norm1: LayerNorm::new(
                &NormConfig::new(h, ADA_NORM_EPS).without_affine(),
                vb.pp("norm1"),
                ctx,
            )?,
            attn1: ParallelAttention::new(&attn, vb.pp("attn1"), ctx)?,
            norm2: LayerNorm::new(&norm2, vb.pp("norm2"), ctx)?,
            ff: Mlp::new(&ff, vb.pp("ff"), ctx)?,
        })
    }

    /// The block's condition embedding (block 0's also conditions the output layer).
    pub fn embedding(&self) -> &ConditionEmbedding {
        &self.emb
    }
}

impl Block for DitBlock {
    fn forward(&self, x: &Tensor, pass: &Pass) -> candle_parallel::Result<Tensor> {
        let cond = pass
            .cond
            .ok_or_else(|| candle_parallel::Error::InvalidArgument {
                op: "DiT block",
                msg: "the pass carries no conditioning".into(),
            })?;
        let e = self
            .emb
            .forward(cond)
            .map_err(candle_parallel::Error::from)?;
        let m = self
            .ada
            .forward(&e.silu()?)
            .map_err(candle_parallel::Error::from)?;
        let m = m.chunk(6, 1)?;
        let (shift_msa, scale_msa, gate_msa) = (&m[0], &m[1], &m[2]);
        let (shift_mlp, scale_mlp, gate_mlp) = (&m[3], &m[4], &m[5]);
        let h = self.norm1.forward_modulated(x, shift_msa, scale_msa)?;
        let a = self.attn1.forward(&h, pass)?;
        let x = gated_residual(x, &a, gate_msa)?;
        let h = self.norm2.forward_modulated(&x, shift_mlp, scale_mlp)?;
        let f = self.ff.forward(&h)?;
        Ok(gated_residual(&x, &f, gate_mlp)?)
    }
}

/// The patch embedding and the output layer: one unit.
#[derive(Debug, Clone)]
pub struct DitEnds {
    /// `pos_embed.proj`: the patch convolution as `(hidden, C·p·p)`.
    patch: Dense,
    proj_out_1: Dense,
    proj_out_2: Dense,
    norm_out: LayerNorm,
}

impl DitEnds {
    pub fn new(cfg: &DitConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let (h, p, c) = (cfg.hidden_size(), cfg.patch_size, cfg.in_channels);
        let proj = vb.pp("pos_embed").pp("proj");
        let patch = Dense {
            weight: proj.get((h, c, p, p), "weight")?.reshape((h, c * p * p))?,
            bias: proj.get(h, "bias")?,
        };
        Ok(Self {
            patch,
            proj_out_1: Dense::new(&vb.pp("proj_out_1"), 2 * h, h)?,
            proj_out_2: Dense::new(&vb.pp("proj_out_2"), p * p * cfg.out_channels(), h)?,
            norm_out: LayerNorm::new(
                &NormConfig::new(h, ADA_NORM_EPS).without_affine(),
                vb.pp("norm_out"),
                ctx,
            )?,
        })
    }
}

/// diffusers' `get_2d_sincos_pos_embed` for a `gh × gw` patch grid (`base` = sample_size / p,
/// interpolation scale 1): `(gh·gw, hidden)` f32, token `i·gw + j` getting the sin-cos
/// features of column `j` in its first half and of row `i` in its second (computed in f64).
pub fn sincos_positions(hidden: usize, gh: usize, gw: usize, base: usize) -> Result<Tensor> {
    if !hidden.is_multiple_of(4) {
        return Err(Error::Invalid(format!(
            "2D sin-cos positions need a hidden size divisible by 4, got {hidden}"
        )));
    }
    let quarter = hidden / 4;
    let omega: Vec<f64> = (0..quarter)
        .map(|k| 1.0 / 10000f64.powf(k as f64 / quarter as f64))
        .collect();
    let coord = |i: usize, g: usize| i as f64 / (g as f64 / base as f64);
    let mut out = Vec::with_capacity(gh * gw * hidden);
    for i in 0..gh {
        for j in 0..gw {
            for pos in [coord(j, gw), coord(i, gh)] {
                out.extend(omega.iter().map(|w| (pos * w).sin() as f32));
                out.extend(omega.iter().map(|w| (pos * w).cos() as f32));
            }
        }
    }
    Ok(Tensor::from_vec(out, (gh * gw, hidden), &Device::Cpu)?)
}

/// `(batch, C, H, W)` → `(batch, gh·gw, C·p·p)`: each patch's values in the patch
/// convolution's `(c, y, x)` order, patches row-major.
pub fn patchify_input(x: &Tensor, p: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (gh, gw) = (h / p, w / p);
    Ok(x.reshape((b, c, gh, p, gw, p))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((b, gh * gw, c * p * p))?)
}

/// `(batch, C, H, W)` → `(batch, gh·gw, p·p·C)`: the layout of the model's output tokens
/// (`(y, x, c)` within a patch). Targets of the loss are put in this layout.
pub fn patchify_output(x: &Tensor, p: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let (gh, gw) = (h / p, w / p);
    Ok(x.reshape((b, c, gh, p, gw, p))?
        .permute((0, 2, 4, 3, 5, 1))?
        .reshape((b, gh * gw, p * p * c))?)
}

/// The inverse of [`patchify_output`] (diffusers' unpatchify): `(batch, gh·gw, p·p·C)` →
/// `(batch, C, gh·p, gw·p)`.
pub fn unpatchify(x: &Tensor, gh: usize, gw: usize, p: usize) -> Result<Tensor> {
    let (b, n, f) = x.dims3()?;
    if n != gh * gw || !f.is_multiple_of(p * p) {
        return Err(Error::Invalid(format!(
            "unpatchify: {n} tokens of {f} values for a {gh}x{gw} grid of {p}x{p} patches"
        )));
    }
    let c = f / (p * p);
    Ok(x.reshape((b, gh, gw, p, p, c))?
        .permute((0, 5, 1, 3, 2, 4))?
        .reshape((b, c, gh * p, gw * p))?)
}

/// The `(batch, 2)` f32 conditioning of [`Pass::cond`]: (timestep, class label) per sample.
pub fn condition(timesteps: &[f32], labels: &[u32]) -> Result<Tensor> {
    if timesteps.len() != labels.len() {
        return Err(Error::Invalid(format!(
            "{} timesteps for {} class labels",
            timesteps.len(),
            labels.len()
        )));
    }
    let v: Vec<f32> = timesteps
        .iter()
        .zip(labels)
        .flat_map(|(&t, &l)| [t, l as f32])
        .collect();
    Ok(Tensor::from_vec(v, (labels.len(), 2), &Device::Cpu)?)
}

/// The DiT model; see the [module docs](self). Under a pipeline a rank holds some blocks
/// ([`Dit::new_stage`]).
pub struct Dit {
    cfg: DitConfig,
    /// The patch embedding and output layer (on the first and last pipeline stages).
    ends: Option<Unit<DitEnds>>,
    /// Block `i`, when this rank holds it.
    blocks: Vec<Option<Unit<DitBlock>>>,
    /// Block 0's condition embedding for the output layer, on a last pipeline stage that does
    /// not hold block 0 (the first stage's copy gets the other part of its gradient).
    out_cond: Option<Unit<ConditionEmbedding>>,
    /// Checkpoint path of block 0's condition embedding, which the output layer also uses: its
    /// parameters are held by both ends of a pipeline (in block 0's unit on the first stage, in
    /// `out_cond` on the last).
    cond_path: String,
    ctx: ParallelCtx,
}

impl Dit {
    /// Builds the model from `vb` (keys as diffusers stores them) for the layout of `ctx`.
    pub fn new(cfg: &DitConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let all = 0..cfg.num_layers;
        Self::new_stage(cfg, vb, ctx, std::slice::from_ref(&all), true)
    }

    /// A pipeline stage: the blocks in `layers` and, with `ends`, the patch embedding and
    /// output layer (with block 0's condition embedding when block 0 is not among `layers`).
    pub fn new_stage(
        cfg: &DitConfig,
        vb: ParamBuilder,
        ctx: &ParallelCtx,
        layers: &[std::ops::Range<usize>],
        ends: bool,
    ) -> Result<Self> {
        if let Some(r) = layers.iter().find(|r| r.end > cfg.num_layers) {
            return Err(Error::Invalid(format!(
                "blocks {r:?} of a DiT with {} blocks (num_layers)",
                cfg.num_layers
            )));
        }
        let unit_err = Error::Parallel;
        let held = |i: usize| layers.iter().any(|r| r.contains(&i));
        let ends_unit = if ends {
            let (c, x) = (cfg.clone(), ctx.clone());
            Some(
                Unit::new(&vb, move |vb| {
                    DitEnds::new(&c, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map_err(unit_err)?,
            )
        } else {
            None
        };
        let blocks = (0..cfg.num_layers)
            .map(|i| {
                if !held(i) {
                    return Ok(None);
                }
                let (c, x) = (cfg.clone(), ctx.clone());
                Unit::new(&vb.pp("transformer_blocks").pp(i), move |vb| {
                    DitBlock::new(&c, vb, &x).map_err(candle_parallel::Error::from)
                })
                .map(Some)
                .map_err(unit_err)
            })
            .collect::<Result<Vec<_>>>()?;
        let cond_vb = vb.pp("transformer_blocks").pp(0).pp("norm1").pp("emb");
        let cond_path = cond_vb.prefix();
        let out_cond = if ends && !held(0) {
            let c = cfg.clone();
            let path = cond_vb;
            Some(
                Unit::new(&path, move |vb| {
                    ConditionEmbedding::new(&c, vb).map_err(candle_parallel::Error::from)
                })
                .map_err(unit_err)?,
            )
        } else {
            None
        };
        Ok(Self {
            cfg: cfg.clone(),
            ends: ends_unit,
            blocks,
            out_cond,
            cond_path,
            ctx: ctx.clone(),
        })
    }

    /// Names of the parameters this rank holds that both ends of a pipeline hold: the patch
    /// embedding and output layer (the ends unit) and block 0's condition embedding (the
    /// output layer's conditioning), on a rank that holds the ends. Local.
    pub fn end_params(&self) -> Vec<String> {
        if self.ends.is_none() {
            return Vec::new();
        }
        let cond = format!("{}.", self.cond_path);
        let mut names: Vec<String> = self
            .ends
            .iter()
            .flat_map(|u| u.params())
            .chain(self.out_cond.iter().flat_map(|u| u.params()))
            .map(|p| p.name.clone())
            .collect();
        if let Some(Some(b0)) = self.blocks.first() {
            names.extend(
                b0.params()
                    .iter()
                    .filter(|p| p.name.starts_with(&cond))
                    .map(|p| p.name.clone()),
            );
        }
        names
    }

    pub fn config(&self) -> &DitConfig {
        &self.cfg
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// The patch embedding and output layer with whole weights (gathered under ZeRO-3).
    pub fn ends(&self, track: Track) -> Result<DitEnds> {
        let ends = self.ends.as_ref().ok_or_else(|| {
            Error::Invalid("this pipeline stage holds no patch embedding or output layer".into())
        })?;
        Ok(ends.get(track)?)
    }

    /// Checks an input `(batch, C, H, W)` and returns its patch grid.
    pub fn check_input(&self, sample: &Tensor) -> Result<(usize, usize)> {
        let dims = sample.dims();
        if dims.len() != 4 || dims[1] != self.cfg.in_channels {
            return Err(Error::Invalid(format!(
                "DiT input must be (batch, {}, H, W) (in_channels {}), got {dims:?}",
                self.cfg.in_channels, self.cfg.in_channels
            )));
        }
        let (gh, gw) = self.cfg.num_patches(dims[2], dims[3])?;
        let n = gh * gw;
        self.ctx.local_tokens(n).map_err(|e| {
            Error::Invalid(format!(
                "a {}x{} input has {n} patch tokens ({gh}x{gw} patches of {p}x{p}), which this \
                 layout cannot split: {e}",
                dims[2],
                dims[3],
                p = self.cfg.patch_size
            ))
        })?;
        Ok((gh, gw))
    }

    /// Checks the conditioning of a batch of `batch` samples.
    pub fn check_condition(&self, cond: &Tensor, batch: usize) -> Result<()> {
        if cond.dims() != [batch, 2] {
            return Err(Error::Invalid(format!(
                "DiT conditioning must be ({batch}, 2) (timestep, label) for a batch of {batch}, \
                 got {:?}",
                cond.dims()
            )));
        }
        let labels = cond.narrow(1, 1, 1)?.to_vec2::<f32>()?;
        let n = self.cfg.num_classes();
        if let Some(l) = labels
            .iter()
            .map(|l| l[0])
            .find(|&l| l < 0.0 || l > n as f32)
        {
            return Err(Error::Invalid(format!(
                "class label {l} outside 0..={n} ({n} classes and the null class)"
            )));
        }
        Ok(())
    }

    /// The first stage's work: this rank's patch tokens `(batch, n', hidden)` of the whole
    /// input (its sequence shard; under TP-sp its tensor-parallel part). Collective over tp.
    pub fn embed(&self, ends: &DitEnds, sample: &Tensor) -> Result<Tensor> {
        let (gh, gw) = self.check_input(sample)?;
        let dtype = ends.patch.weight.dtype();
        let (h, p) = (self.cfg.hidden_size(), self.cfg.patch_size);
        let base = self.cfg.sample_size / p;
        let pos = sincos_positions(h, gh, gw, base)?.unsqueeze(0)?;
        // Under TP-sp each tensor-parallel rank embeds only its part of the tokens, so that
        // the replicated patch weights' gradients add up over the group.
        let tokens = self
            .ctx
            .layer_tokens(&patchify_input(&sample.to_dtype(dtype)?, p)?)?;
        let pos = self.ctx.layer_tokens(&pos.to_dtype(dtype)?)?;
        Ok(ends.patch.forward(&tokens)?.broadcast_add(&pos)?)
    }

    /// Blocks `layers` on `x` (the patch tokens or the previous stage's output) for a sequence
    /// of `tokens` patch tokens, each under its unit's checkpointing. Collective over the
    /// model-parallel group.
    pub fn run_blocks(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        cond: &Tensor,
        tokens: usize,
    ) -> Result<Tensor> {
        if layers.end > self.blocks.len() || layers.start > layers.end {
            return Err(Error::Invalid(format!(
                "blocks {layers:?} of a DiT with {} blocks",
                self.blocks.len()
            )));
        }
        let positions = self.ctx.attention_positions(tokens)?;
        let mask = AttnMask::Full;
        let pass = Pass::new(&self.ctx, &positions, &mask).with_cond(cond);
        let mut x = x.clone();
        for i in layers {
            let block = self.blocks[i].as_ref().ok_or_else(|| {
                Error::Invalid(format!("block {i} is held by another pipeline stage"))
            })?;
            x = block.forward(&x, &pass)?;
        }
        Ok(x)
    }

    /// The last stage's work: the output layer on the blocks' output, this rank's output
    /// tokens `(batch, n, p·p·out_channels)` (under TP-sp computed on this tensor-parallel
    /// rank's part and gathered: the loss is then the same on every rank of the group).
    /// Collective over tp.
    pub fn head(&self, ends: &DitEnds, x: &Tensor, cond: &Tensor) -> Result<Tensor> {
        let emb = match (&self.out_cond, self.blocks.first()) {
            (Some(u), _) => u.get(Track::Grad)?,
            (None, Some(Some(b))) => b.get(Track::Grad)?.embedding().clone(),
            _ => {
                return Err(Error::Invalid(
                    "the output layer needs block 0's condition embedding".into(),
                ))
            }
        };
        let c = emb.forward(cond)?;
        let m = ends.proj_out_1.forward(&c.silu()?)?.chunk(2, 1)?;
        let x = ends.norm_out.forward_modulated(x, &m[0], &m[1])?;
        Ok(self
            .ctx
            .gather_layer_tokens(&ends.proj_out_2.forward(&x)?)?)
    }

    /// This rank's output tokens `(batch, n, p·p·out_channels)` (its sequence-parallel shard,
    /// in the attention's token order; [`patchify_output`] layout) of the whole input `sample`
    /// `(batch, C, H, W)` (the same on every rank) conditioned on `cond` ([`condition`]).
    /// Collective over the model-parallel group.
    pub fn forward_tokens(&self, sample: &Tensor, cond: &Tensor) -> Result<Tensor> {
        let (gh, gw) = self.check_input(sample)?;
        self.check_condition(cond, sample.dim(0)?)?;
        let ends = self.ends(Track::Grad)?;
        let x = self.embed(&ends, sample)?;
        let x = self.run_blocks(0..self.blocks.len(), &x, cond, gh * gw)?;
        self.head(&ends, &x, cond)
    }

    /// The whole output `(batch, out_channels, H, W)` on every rank (tokens gathered over the
    /// sequence group): the model's `sample` output. Collective over the model-parallel group.
    pub fn forward(&self, sample: &Tensor, timesteps: &[f32], labels: &[u32]) -> Result<Tensor> {
        let (gh, gw) = self.check_input(sample)?;
        let cond = condition(timesteps, labels)?;
        if cond.dim(0)? != sample.dim(0)? {
            return Err(Error::Invalid(format!(
                "{} timesteps and labels for a batch of {}",
                cond.dim(0)?,
                sample.dim(0)?
            )));
        }
        let local = self.forward_tokens(sample, &cond)?;
        let tokens = self.ctx.gather_tokens(&local)?;
        unpatchify(&tokens, gh, gw, self.cfg.patch_size)
    }
}

impl Parallelize for Dit {
    fn units(&mut self) -> Vec<&mut dyn UnitOps> {
        let mut units: Vec<&mut dyn UnitOps> = Vec::new();
        units.extend(self.ends.iter_mut().map(|u| u as &mut dyn UnitOps));
        units.extend(self.out_cond.iter_mut().map(|u| u as &mut dyn UnitOps));
        units.extend(
            self.blocks
                .iter_mut()
                .flatten()
                .map(|u| u as &mut dyn UnitOps),
        );
        units
    }
}

/// The last dim of a `(.., p·p·out_channels)` output token split into the noise prediction
/// and (with a learned sigma) the variance values, each `(.., p·p·C)`.
pub fn split_output(
    tokens: &Tensor,
    out_channels: usize,
    in_channels: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let dims = tokens.dims().to_vec();
    let f = *dims
        .last()
        .ok_or_else(|| Error::Invalid("scalar model output".into()))?;
    let pp = f / out_channels;
    let mut split = dims.clone();
    *split.last_mut().expect("non-empty") = pp;
    split.push(out_channels);
    let t = tokens.reshape(split)?;
    let mut flat = dims;
    *flat.last_mut().expect("non-empty") = pp * in_channels;
    let eps = t.narrow(D::Minus1, 0, in_channels)?.reshape(flat.clone())?;
    let var = if out_channels == 2 * in_channels {
        Some(
            t.narrow(D::Minus1, in_channels, in_channels)?
                .reshape(flat)?,
        )
    } else {
        None
    };
    Ok((eps, var))
}
