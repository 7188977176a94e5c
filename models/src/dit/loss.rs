//! The training losses of a DiT, computed on this rank's patch tokens.
//!
//! The noised input is made from whole images on every rank (cheap, elementwise); the model
//! returns this rank's sequence-parallel shard of output tokens, and the targets are cut into
//! the same tokens ([`patchify_output`] then [`ParallelCtx::shard_tokens`]), so every loss term
//! is a sum over this rank's elements. Each sample's loss is a mean over its `C·H·W` elements:
//! this rank adds its elements' terms divided by `C·H·W`, and the ranks' sums add up to the
//! batch's summed loss (the trainer divides by the global number of samples).
//!
//! - DDPM (DiT): `mse(noise, ε̂) + vb`, vb the variational-bound term of the learned variance
//!   in bits (model noise detached), see [`GaussianDiffusion::ddpm_terms`];
//! - rectified flow: `mse(v̂, noise − x0)` at `x_s = (1 − s)·x0 + s·noise`, timestep `1000 s`.

use candle_core::{DType, Tensor};
use candle_parallel::nn::ParallelCtx;
use serde::{Deserialize, Serialize};

use super::config::DitConfig;
use super::model::{condition, patchify_output, split_output, Dit};
use crate::diffusion::{flow_sample, flow_terms, flow_timestep, GaussianDiffusion};
use crate::error::{Error, Result};

/// The training objective of a diffusion model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// DDPM noise prediction (DiT's), with the variational-bound term of a learned sigma.
    Ddpm,
    /// Rectified flow: velocity `noise − x0` at logit-normal `s`.
    Flow,
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Objective::Ddpm => "ddpm",
            Objective::Flow => "flow",
        })
    }
}

/// Where each sample of a batch sits on the noising path.
#[derive(Debug, Clone, PartialEq)]
pub enum NoiseLevel {
    /// DDPM timestep indices `0..T`.
    Ddpm(Vec<u32>),
    /// Rectified-flow `s ∈ (0, 1)`.
    Flow(Vec<f32>),
}

impl NoiseLevel {
    pub fn len(&self) -> usize {
        match self {
            NoiseLevel::Ddpm(t) => t.len(),
            NoiseLevel::Flow(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One training micro-batch: whole images, identical on every rank of the model-parallel group.
#[derive(Debug, Clone)]
pub struct NoisedBatch {
    /// Clean samples `(batch, C, H, W)`.
    pub x0: Tensor,
    /// Gaussian noise of the same shape.
    pub noise: Tensor,
    /// Class labels (the null class for dropped labels).
    pub labels: Vec<u32>,
    pub level: NoiseLevel,
}

/// This rank's share of a batch's summed loss, and its parts (f64, summed over the samples).
#[derive(Debug, Clone)]
pub struct LossSum {
    /// Scalar, differentiable.
    pub total: Tensor,
    /// The noise (or velocity) MSE part.
    pub mse: f64,
    /// The variational-bound part (DDPM with a learned sigma; else 0).
    pub vb: f64,
}

/// The whole-image tensor `x` `(batch, C, H, W)` as this rank's output tokens
/// `(batch, n, p·p·C)`.
fn local_tokens(ctx: &ParallelCtx, x: &Tensor, p: usize) -> Result<Tensor> {
    Ok(ctx.shard_tokens(&patchify_output(x, p)?)?)
}

/// The model's input of `batch`: the noised samples `(batch, C, H, W)` and the conditioning
/// `(batch, 2)` ([`condition`]). Checks the batch. Local.
pub fn model_input(
    cfg: &DitConfig,
    diffusion: &GaussianDiffusion,
    batch: &NoisedBatch,
) -> Result<(Tensor, Tensor)> {
    let (b, c, _, _) = batch.x0.dims4()?;
    if c != cfg.in_channels {
        return Err(Error::Invalid(format!(
            "samples have {c} channels, the model {} (in_channels)",
            cfg.in_channels
        )));
    }
    if batch.noise.dims() != batch.x0.dims() {
        return Err(Error::Invalid(format!(
            "noise {:?} and samples {:?} differ in shape",
            batch.noise.dims(),
            batch.x0.dims()
        )));
    }
    if batch.labels.len() != b || batch.level.len() != b {
        return Err(Error::Invalid(format!(
            "{} labels and {} noise levels for a batch of {b}",
            batch.labels.len(),
            batch.level.len()
        )));
    }
    match &batch.level {
        NoiseLevel::Ddpm(t) => {
            if let Some(bad) = t.iter().find(|&&t| t as usize >= diffusion.num_timesteps()) {
                return Err(Error::Invalid(format!(
                    "timestep {bad} outside 0..{}",
                    diffusion.num_timesteps()
                )));
            }
            let x_t = diffusion.q_sample(&batch.x0, t, &batch.noise)?;
            let times: Vec<f32> = t.iter().map(|&t| t as f32).collect();
            Ok((x_t, condition(&times, &batch.labels)?))
        }
        NoiseLevel::Flow(s) => {
            let x_s = flow_sample(&batch.x0, &batch.noise, s)?;
            let times: Vec<f32> = s.iter().map(|&s| flow_timestep(s)).collect();
            Ok((x_s, condition(&times, &batch.labels)?))
        }
    }
}

/// This rank's share of the summed loss of `batch` from its output tokens `out` (what
/// [`Dit::forward_tokens`] returns for `x_in`, the [`model_input`]). Local.
pub fn loss_from_output(
    cfg: &DitConfig,
    ctx: &ParallelCtx,
    diffusion: &GaussianDiffusion,
    batch: &NoisedBatch,
    x_in: &Tensor,
    out: &Tensor,
) -> Result<LossSum> {
    let (_, c, h, w) = batch.x0.dims4()?;
    let per_sample = (c * h * w) as f64;
    let p = cfg.patch_size;
    let x0 = local_tokens(ctx, &batch.x0, p)?;
    let noise = local_tokens(ctx, &batch.noise, p)?;
    let sum_all = |t: &Tensor| -> Result<f64> { Ok(t.sum_all()?.to_scalar::<f32>()? as f64) };
    // The loss in f32 whatever the model's dtype (as diffusers computes it from a bf16 model's
    // output); the gradient flows back through the cast in the model's dtype.
    let out = out.to_dtype(DType::F32)?;
    let (pred, var) = split_output(&out, cfg.out_channels(), cfg.in_channels)?;
    let (total, mse, vb) = match (&batch.level, var) {
        (NoiseLevel::Ddpm(t), Some(var)) => {
            let x_t = local_tokens(ctx, x_in, p)?;
            let terms = diffusion.ddpm_terms(&x0, &x_t, t, &noise, &pred, &var)?;
            let (mse, vb) = (sum_all(&terms.mse_sum)?, sum_all(&terms.vb_sum)?);
            ((terms.mse_sum + terms.vb_sum)?.sum_all()?, mse, vb)
        }
        (NoiseLevel::Ddpm(_), None) => {
            let total = (pred - &noise)?.sqr()?.sum_all()?;
            let mse = sum_all(&total)?;
            (total, mse, 0.0)
        }
        (NoiseLevel::Flow(_), _) => {
            let sums = flow_terms(&x0, &noise, &pred)?;
            (sums.sum_all()?, sum_all(&sums)?, 0.0)
        }
    };
    Ok(LossSum {
        total: (total / per_sample)?,
        mse: mse / per_sample,
        vb: vb / per_sample,
    })
}

/// This rank's share of the summed loss of `batch` (see the [module docs](self)). Collective
/// over the model-parallel group.
pub fn loss_sum(
    model: &Dit,
    diffusion: &GaussianDiffusion,
    batch: &NoisedBatch,
) -> Result<LossSum> {
    let cfg = model.config();
    let (x_in, cond) = model_input(cfg, diffusion, batch)?;
    let out = model.forward_tokens(&x_in, &cond)?;
    loss_from_output(cfg, model.ctx(), diffusion, batch, &x_in, &out)
}
