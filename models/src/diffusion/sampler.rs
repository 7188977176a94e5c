//! Sampling: DDPM (ancestral) and DDIM (eta 0) on a (respaced) [`GaussianDiffusion`], and Euler
//! steps of a rectified flow, each with classifier-free guidance as DiT's `forward_with_cfg`
//! applies it (to the noise channels; a learned variance comes from the conditional half).

use candle_core::Tensor;

use super::schedule::{extract, GaussianDiffusion};
use crate::error::{Error, Result};

/// A denoiser: `(x (batch, C, H, W), model timesteps, labels) → (batch, C or 2C, H, W)`
/// (noise or velocity, then a learned variance's values when 2C).
pub type ModelFn<'a> = dyn FnMut(&Tensor, &[f32], &[u32]) -> Result<Tensor> + 'a;

/// Classifier-free guidance (DiT's `forward_with_cfg`): the model runs on the batch doubled as
/// `[cond; uncond]` (labels, then `null_label` for every sample), and the noise channels are
/// `uncond + scale · (cond − uncond)`; a learned variance comes from the conditional half. A
/// scale of 1 is no guidance (one model call on the labels, as DiT's `sample.py`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Guidance {
    /// The guidance scale (1: off).
    pub scale: f32,
    /// The label of the unconditional model (the number of classes in DiT).
    pub null_label: u32,
}

/// `model(x, times, labels)`, checked to be `(batch, C or 2C, ..)` for `x` `(batch, C, ..)`.
fn call(model: &mut ModelFn, x: &Tensor, times: &[f32], labels: &[u32]) -> Result<Tensor> {
    let out = model(x, times, labels)?;
    let (od, xd) = (out.dims(), x.dims());
    let channels_ok = od.len() >= 2 && (od[1] == xd[1] || od[1] == 2 * xd[1]);
    if od.len() != xd.len() || od[0] != xd[0] || !channels_ok || od[2..] != xd[2..] {
        return Err(Error::Invalid(format!(
            "the model returned shape {od:?} for input {xd:?} (want C or 2C channels)"
        )));
    }
    Ok(out)
}

/// The (guided) prediction `(batch, C_out, ..)` at `x`.
fn predict(
    model: &mut ModelFn,
    x: &Tensor,
    times: &[f32],
    labels: &[u32],
    guidance: Option<Guidance>,
) -> Result<Tensor> {
    let Some(g) = guidance.filter(|g| g.scale != 1.0) else {
        return call(model, x, times, labels);
    };
    let (b, c) = (labels.len(), x.dim(1)?);
    let both = Tensor::cat(&[x, x], 0)?;
    let mut t2 = times.to_vec();
    t2.extend_from_slice(times);
    let mut y2 = labels.to_vec();
    y2.extend(std::iter::repeat_n(g.null_label, b));
    let out = call(model, &both, &t2, &y2)?;
    let cond = out.narrow(0, 0, b)?;
    let uncond = out.narrow(0, b, b)?;
    let (ce, ue) = (cond.narrow(1, 0, c)?, uncond.narrow(1, 0, c)?);
    let guided = (&ue + ((ce - &ue)? * g.scale as f64)?)?;
    let rest = cond.dim(1)? - c;
    if rest == 0 {
        Ok(guided)
    } else {
        Ok(Tensor::cat(&[guided, cond.narrow(1, c, rest)?], 1)?)
    }
}

/// Splits a prediction into the noise part and, with a learned variance, its values.
fn split(out: &Tensor, c: usize) -> Result<(Tensor, Option<Tensor>)> {
    let co = out.dim(1)?;
    match co {
        _ if co == c => Ok((out.clone(), None)),
        _ if co == 2 * c => Ok((out.narrow(1, 0, c)?, Some(out.narrow(1, c, c)?))),
        _ => Err(Error::Invalid(format!(
            "the model returned {co} channels for {c}-channel samples"
        ))),
    }
}

fn check(noise: &Tensor, labels: &[u32]) -> Result<()> {
    if noise.rank() < 2 || noise.dim(0)? != labels.len() {
        return Err(Error::Invalid(format!(
            "{} labels for noise of shape {:?}",
            labels.len(),
            noise.dims()
        )));
    }
    Ok(())
}

impl GaussianDiffusion {
    /// The model's timesteps of step `i` for a batch of `b`.
    fn model_times(&self, i: usize, b: usize) -> Vec<f32> {
        vec![self.timestep_map[i] as f32; b]
    }

    /// DiT's `ddim_sample_loop` with eta 0 and no clipping, from `noise` `(batch, C, ..)`, over
    /// every step of this (respaced) schedule, largest first; the model sees the steps'
    /// `timestep_map` values. Per step: x0 = `predict_x0(x, ε̂)`, ε = (√(1/ᾱ_t) x − x0) /
    /// √(1/ᾱ_t − 1), x ← √ᾱ_{t−1} x0 + √(1 − ᾱ_{t−1}) ε (a learned variance is ignored). Runs
    /// detached; returns the f32 samples.
    pub fn ddim_sample(
        &self,
        model: &mut ModelFn,
        noise: &Tensor,
        labels: &[u32],
        guidance: Option<Guidance>,
    ) -> Result<Tensor> {
        check(noise, labels)?;
        let (b, c, n) = (labels.len(), noise.dim(1)?, noise.rank());
        let mut x = noise.detach();
        for i in (0..self.num_timesteps()).rev() {
            let t = vec![i as u32; b];
            let out = predict(model, &x, &self.model_times(i, b), labels, guidance)?.detach();
            let (eps, var) = split(&out, c)?;
            let (_, _, x0) = self.p_mean_variance(&x, &t, &eps, var.as_ref())?;
            // DiT recomputes the noise from the predicted x0.
            let eps = ((x.broadcast_mul(&extract(&self.sqrt_recip_alphas_cumprod, &t, n)?)?
                - &x0)?
                .broadcast_div(&extract(&self.sqrt_recipm1_alphas_cumprod, &t, n)?))?;
            let ab_prev = extract(&self.alphas_cumprod_prev, &t, n)?;
            x = (x0.broadcast_mul(&ab_prev.sqrt()?)?
                + eps.broadcast_mul(&ab_prev.affine(-1.0, 1.0)?.sqrt()?)?)?;
        }
        Ok(x)
    }

    /// DiT's `p_sample_loop` (no clipping) from `noise` `(batch, C, ..)`: step `k` (0 at the
    /// largest timestep) takes x ← mean + exp(log_var / 2) · `step_noise(k)` with the mean and
    /// log variance of [`p_mean_variance`](Self::p_mean_variance) (learned range when the model
    /// returns 2C channels, else DiT's fixed-large default). `step_noise` is called once per
    /// step, in order, the last step (t = 0) included as DiT draws there too, but that step adds
    /// no noise. Runs detached.
    pub fn ddpm_sample(
        &self,
        model: &mut ModelFn,
        noise: &Tensor,
        labels: &[u32],
        guidance: Option<Guidance>,
        step_noise: &mut dyn FnMut(usize) -> Result<Tensor>,
    ) -> Result<Tensor> {
        check(noise, labels)?;
        let (b, c) = (labels.len(), noise.dim(1)?);
        let mut x = noise.detach();
        for (k, i) in (0..self.num_timesteps()).rev().enumerate() {
            let t = vec![i as u32; b];
            let out = predict(model, &x, &self.model_times(i, b), labels, guidance)?.detach();
            let (eps, var) = split(&out, c)?;
            let (mean, log_var, _) = self.p_mean_variance(&x, &t, &eps, var.as_ref())?;
            let z = step_noise(k)?;
            if z.dims() != x.dims() {
                return Err(Error::Invalid(format!(
                    "step noise of shape {:?} for samples {:?}",
                    z.dims(),
                    x.dims()
                )));
            }
            x = if i == 0 {
                mean
            } else {
                (mean + (log_var * 0.5)?.exp()?.mul(&z)?)?
            };
        }
        Ok(x)
    }
}

/// Euler integration of a rectified flow from `noise` (s = 1) to s = 0 in `steps` uniform
/// steps `s_k = 1 − k/steps`: `x ← x + (s_{k+1} − s_k) · v(x, 1000 s_k)`, `v` the predicted
/// `noise − x0` (the first C channels of the model's output). Runs detached.
pub fn flow_sample_euler(
    model: &mut ModelFn,
    noise: &Tensor,
    labels: &[u32],
    guidance: Option<Guidance>,
    steps: usize,
) -> Result<Tensor> {
    check(noise, labels)?;
    if steps == 0 {
        return Err(Error::Invalid(
            "flow sampling needs at least one step".into(),
        ));
    }
    let (b, c) = (labels.len(), noise.dim(1)?);
    let mut x = noise.detach();
    for k in 0..steps {
        let s = 1.0 - k as f32 / steps as f32;
        let s_next = 1.0 - (k + 1) as f32 / steps as f32;
        let out = predict(model, &x, &vec![s * 1000.0; b], labels, guidance)?.detach();
        let (v, _) = split(&out, c)?;
        x = (x + (v * (s_next - s) as f64)?)?;
    }
    Ok(x)
}
