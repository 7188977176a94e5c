//! Training terms: DDPM noise prediction with DiT's variational bound for a learned variance,
//! and rectified flow. Inputs are f32 tensors of one shape `(batch, ..)`, holding all or part
//! of each sample's elements (one rank's tokens); every per-sample reduction is a sum over the
//! elements given, so parts held by different ranks add up. The caller divides by the number
//! of elements per sample for DiT's `mean_flat`.

use candle_core::{DType, Tensor, D};

use super::schedule::{extract, extract_as, GaussianDiffusion};
use crate::error::{Error, Result};

/// Per-sample sums `(batch)` of the DDPM terms over the elements given.
#[derive(Debug, Clone)]
pub struct DdpmTerms {
    /// Σ (noise − ε̂)².
    pub mse_sum: Tensor,
    /// Σ of the variational-bound term in bits: KL(q(x_{t−1}|x_t, x0) ‖ p(x_{t−1}|x_t)) for
    /// t > 0, the negative discretized log-likelihood of x0 for t = 0 (ε̂ detached).
    pub vb_sum: Tensor,
}

/// Sum over every dim but the first: `(batch, ..)` → `(batch)`.
fn per_sample(x: &Tensor) -> Result<Tensor> {
    let b = x.dim(0)?;
    Ok(x.reshape((b, ()))?.sum(D::Minus1)?)
}

fn same_shape(what: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dims() != b.dims() {
        return Err(Error::Invalid(format!(
            "{what}: shapes {:?} and {:?} differ",
            a.dims(),
            b.dims()
        )));
    }
    Ok(())
}

fn one_step_per_sample(what: &str, t: usize, x: &Tensor) -> Result<()> {
    if x.rank() == 0 || t != x.dim(0)? {
        return Err(Error::Invalid(format!(
            "{what}: {t} timesteps for a batch of shape {:?}",
            x.dims()
        )));
    }
    Ok(())
}

/// DiT's `approx_standard_normal_cdf`: `0.5 (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
fn approx_cdf(x: &Tensor) -> Result<Tensor> {
    let c = (2.0f64 / std::f64::consts::PI).sqrt();
    let x3 = x.sqr()?.mul(x)?;
    Ok((((x + (x3 * 0.044715)?)? * c)?.tanh()? + 1.0)?.affine(0.5, 0.0)?)
}

/// `log(max(x, 1e-12))`.
fn clamped_log(x: &Tensor) -> Result<Tensor> {
    Ok(x.maximum(1e-12f64)?.log()?)
}

impl GaussianDiffusion {
    /// `√ᾱ_t · x0 + √(1 − ᾱ_t) · noise` (coefficients as f32), `x0` and `noise` f32 of one shape
    /// `(batch, ..)`, `t` one step per sample.
    pub fn q_sample(&self, x0: &Tensor, t: &[u32], noise: &Tensor) -> Result<Tensor> {
        same_shape("q_sample", x0, noise)?;
        one_step_per_sample("q_sample", t.len(), x0)?;
        let n = x0.rank();
        let a = extract(&self.sqrt_alphas_cumprod, t, n)?;
        let b = extract(&self.sqrt_one_minus_alphas_cumprod, t, n)?;
        Ok((x0.broadcast_mul(&a)? + noise.broadcast_mul(&b)?)?)
    }

    /// Mean of q(x_{t−1} | x_t, x0).
    fn posterior_mean(&self, x0: &Tensor, x_t: &Tensor, t: &[u32]) -> Result<Tensor> {
        let (n, d) = (x0.rank(), x0.dtype());
        let c1 = extract_as(&self.posterior_mean_coef1, t, n, d)?;
        let c2 = extract_as(&self.posterior_mean_coef2, t, n, d)?;
        Ok((x0.broadcast_mul(&c1)? + x_t.broadcast_mul(&c2)?)?)
    }

    /// x0 predicted from the noise prediction `eps` at `x_t`: `√(1/ᾱ_t) x_t − √(1/ᾱ_t − 1) eps`
    /// (coefficients rounded to `x_t`'s dtype).
    pub fn predict_x0(&self, x_t: &Tensor, t: &[u32], eps: &Tensor) -> Result<Tensor> {
        let (n, d) = (x_t.rank(), x_t.dtype());
        let a = extract_as(&self.sqrt_recip_alphas_cumprod, t, n, d)?;
        let b = extract_as(&self.sqrt_recipm1_alphas_cumprod, t, n, d)?;
        Ok((x_t.broadcast_mul(&a)? - eps.broadcast_mul(&b)?)?)
    }

    /// The model's distribution p(x_{t−1} | x_t) as DiT's `p_mean_variance` (no clipping):
    /// `(mean, log variance, predicted x0)`, all of `x_t`'s shape and dtype. The log variance is
    /// the learned range `frac·log β_t + (1 − frac)·posterior_log_variance_clipped_t` with
    /// `frac = (var + 1)/2` when `var` is given, else DiT's default for a model without a learned
    /// sigma (`create_diffusion(learn_sigma=False)`: FIXED_LARGE, `log β_t`, at t = 0 the clipped
    /// posterior log variance).
    pub fn p_mean_variance(
        &self,
        x_t: &Tensor,
        t: &[u32],
        eps: &Tensor,
        var: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, d) = (x_t.rank(), x_t.dtype());
        let log_var = match var {
            Some(v) => {
                let min_log = extract_as(&self.posterior_log_variance_clipped, t, n, d)?;
                let max_log = extract_as(&self.log_betas, t, n, d)?;
                let frac = ((v + 1.0)? / 2.0)?;
                let one_minus = frac.affine(-1.0, 1.0)?;
                (frac.broadcast_mul(&max_log)? + one_minus.broadcast_mul(&min_log)?)?
            }
            None => {
                // FIXED_LARGE: log [posterior_variance[1], betas[1..]].
                let large: Vec<f64> = (0..self.num_timesteps())
                    .map(|i| {
                        if i == 0 {
                            self.posterior_log_variance_clipped[0]
                        } else {
                            self.log_betas[i]
                        }
                    })
                    .collect();
                extract_as(&large, t, n, d)?
                    .broadcast_as(x_t.shape())?
                    .contiguous()?
            }
        };
        let x0 = self.predict_x0(x_t, t, eps)?;
        let mean = self.posterior_mean(&x0, x_t, t)?;
        Ok((mean, log_var, x0))
    }

    /// The DDPM terms of DiT's `training_losses` (MSE loss, learned-range variance). `eps_pred`
    /// and `var_pred` are the model's two output halves on the elements given; the bound's
    /// mean uses `eps_pred` detached, so the bound trains only the variance. Each sample takes
    /// the likelihood (t = 0) or the KL (t > 0) by a 0/1 mask: the other branch is finite (the
    /// 1e-12 clamps) and adds exactly zero to values and gradients. `mse_sum` is f32 with the
    /// gradient `2 (ε̂ − noise)`; `vb_sum` f32.
    ///
    /// The bound is evaluated in f64 (returned in f32): in f32 DiT's formulas cancel badly,
    /// the KL of two nearly equal variances at large t (`exp(Δ) − 1 − Δ`) and the difference
    /// of two saturated normal CDFs of the t = 0 likelihood; PyTorch's f32 run of DiT's code
    /// is off from its f64 run by 15% in some gradients and 4% in the t = 0 term
    /// (`tests/dit.rs` measures both against float64).
    pub fn ddpm_terms(
        &self,
        x0: &Tensor,
        x_t: &Tensor,
        t: &[u32],
        noise: &Tensor,
        eps_pred: &Tensor,
        var_pred: &Tensor,
    ) -> Result<DdpmTerms> {
        for (what, x) in [
            ("x_t", x_t),
            ("noise", noise),
            ("eps_pred", eps_pred),
            ("var_pred", var_pred),
        ] {
            same_shape(what, x0, x)?;
        }
        one_step_per_sample("ddpm_terms", t.len(), x0)?;
        let n = x0.rank();
        let mse_sum = per_sample(&(noise - eps_pred)?.sqr()?)?;
        let wide = |x: &Tensor| x.to_dtype(DType::F64);
        let (x0, x_t) = (&wide(x0)?, &wide(x_t)?);
        let (eps, var) = (wide(&eps_pred.detach())?, wide(var_pred)?);
        // The true posterior and the model's distribution.
        let true_mean = self.posterior_mean(x0, x_t, t)?;
        let true_log_var = extract_as(&self.posterior_log_variance_clipped, t, n, DType::F64)?;
        let (mean, log_var, _) = self.p_mean_variance(x_t, t, &eps, Some(&var))?;
        // normal_kl(true_mean, true_log_var, mean, log_var).
        let kl = (log_var.broadcast_sub(&true_log_var)?
            + true_log_var.broadcast_sub(&log_var)?.exp()?
            + (&true_mean - &mean)?.sqr()?.mul(&log_var.neg()?.exp()?)?)?;
        let kl = ((kl - 1.0)? * 0.5)?;
        // −log p(x0) of the discretized Gaussian with mean `mean`, log scale log_var / 2.
        let centered = (x0 - &mean)?;
        let inv_stdv = (log_var * -0.5)?.exp()?;
        let cdf_plus = approx_cdf(&(&centered + 1.0 / 255.0)?.mul(&inv_stdv)?)?;
        let cdf_min = approx_cdf(&(&centered - 1.0 / 255.0)?.mul(&inv_stdv)?)?;
        let log_cdf_plus = clamped_log(&cdf_plus)?;
        let log_one_minus_cdf_min = clamped_log(&cdf_min.affine(-1.0, 1.0)?)?;
        let log_delta = clamped_log(&(&cdf_plus - &cdf_min)?)?;
        let low = x0.lt(-0.999f64)?.to_dtype(DType::F64)?;
        let high = x0.gt(0.999f64)?.to_dtype(DType::F64)?;
        let mid = (low.affine(-1.0, 1.0)? - &high)?;
        let log_probs =
            ((low * log_cdf_plus)? + (high * log_one_minus_cdf_min)? + (mid * log_delta)?)?;
        let ln2 = std::f64::consts::LN_2;
        let kl_bits = (per_sample(&kl)? / ln2)?;
        let nll_bits = (per_sample(&log_probs)? / -ln2)?;
        let first: Vec<f64> = t.iter().map(|&t| f64::from(u8::from(t == 0))).collect();
        let first = Tensor::from_vec(first, t.len(), x0.device())?;
        let vb_sum = ((&first * nll_bits)? + (first.affine(-1.0, 1.0)? * kl_bits)?)?;
        let vb_sum = vb_sum.to_dtype(DType::F32)?;
        Ok(DdpmTerms { mse_sum, vb_sum })
    }
}

/// Rectified flow's noised sample `(1 − s)·x0 + s·noise`, `s` per sample.
pub fn flow_sample(x0: &Tensor, noise: &Tensor, s: &[f32]) -> Result<Tensor> {
    same_shape("flow_sample", x0, noise)?;
    if s.len() != x0.dim(0)? {
        return Err(Error::Invalid(format!(
            "{} flow levels for a batch of {}",
            s.len(),
            x0.dim(0)?
        )));
    }
    let mut shape = vec![s.len()];
    shape.extend(std::iter::repeat_n(1, x0.rank() - 1));
    let s = Tensor::from_vec(s.to_vec(), shape, x0.device())?;
    Ok((x0.broadcast_mul(&s.affine(-1.0, 1.0)?)? + noise.broadcast_mul(&s)?)?)
}

/// Σ (pred − (noise − x0))² per sample: rectified flow's velocity loss.
pub fn flow_terms(x0: &Tensor, noise: &Tensor, pred: &Tensor) -> Result<Tensor> {
    same_shape("flow_terms", x0, noise)?;
    same_shape("flow_terms", x0, pred)?;
    per_sample(&(pred - (noise - x0)?)?.sqr()?)
}

/// The model timestep of flow level `s`: `1000 s` (SD3's convention).
pub fn flow_timestep(s: f32) -> f32 {
    s * 1000.0
}

/// Logit-normal levels `sigmoid(z)`, `z` standard normal from `normal`.
pub fn logit_normal(n: usize, mut normal: impl FnMut() -> f64) -> Vec<f32> {
    (0..n)
        .map(|_| (1.0 / (1.0 + (-normal()).exp())) as f32)
        .collect()
}
