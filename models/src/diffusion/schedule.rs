//! DiT's Gaussian diffusion schedule: float64 tables indexed by timestep, and respacing.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// The tables of a Gaussian diffusion with `T` steps (all float64, as DiT computes them with
/// numpy), and the original timestep of each step (`timestep_map`: the identity for the base
/// schedule, the kept steps for a respaced one; the model is called with these).
#[derive(Debug, Clone, PartialEq)]
pub struct GaussianDiffusion {
    /// β_t, `(T)`.
    pub betas: Vec<f64>,
    /// ᾱ_t = Π_{s ≤ t} (1 − β_s).
    pub alphas_cumprod: Vec<f64>,
    /// ᾱ_{t−1}, with ᾱ_{−1} = 1.
    pub alphas_cumprod_prev: Vec<f64>,
    /// √ᾱ_t.
    pub sqrt_alphas_cumprod: Vec<f64>,
    /// √(1 − ᾱ_t).
    pub sqrt_one_minus_alphas_cumprod: Vec<f64>,
    /// √(1 / ᾱ_t).
    pub sqrt_recip_alphas_cumprod: Vec<f64>,
    /// √(1 / ᾱ_t − 1).
    pub sqrt_recipm1_alphas_cumprod: Vec<f64>,
    /// Variance of q(x_{t−1} | x_t, x0): β_t (1 − ᾱ_{t−1}) / (1 − ᾱ_t) (0 at t = 0).
    pub posterior_variance: Vec<f64>,
    /// Its log with t = 0 taking t = 1's value.
    pub posterior_log_variance_clipped: Vec<f64>,
    /// Coefficient of x0 in the posterior mean: β_t √ᾱ_{t−1} / (1 − ᾱ_t).
    pub posterior_mean_coef1: Vec<f64>,
    /// Coefficient of x_t in the posterior mean: (1 − ᾱ_{t−1}) √(1 − β_t) / (1 − ᾱ_t).
    pub posterior_mean_coef2: Vec<f64>,
    /// log β_t (the upper end of a learned variance's range).
    pub log_betas: Vec<f64>,
    /// The model timestep of each step (original indices for a respaced schedule).
    pub timestep_map: Vec<u32>,
}

impl GaussianDiffusion {
    /// DiT's linear schedule: betas `linspace(s·1e-4, s·0.02, T)` with `s = 1000 / T` (numpy's
    /// `i · step + start`, the last set to the end), identity `timestep_map`. Errors for `T = 0`
    /// and where a beta exceeds 1 (`T < 20`), as DiT asserts.
    pub fn linear(num_timesteps: usize) -> Result<Self> {
        if num_timesteps == 0 {
            return Err(Error::Invalid(
                "a diffusion needs at least one timestep".into(),
            ));
        }
        let scale = 1000.0 / num_timesteps as f64;
        let (start, stop) = (scale * 1e-4, scale * 0.02);
        let betas = if num_timesteps == 1 {
            vec![start]
        } else {
            let step = (stop - start) / (num_timesteps - 1) as f64;
            let mut b: Vec<f64> = (0..num_timesteps)
                .map(|i| i as f64 * step + start)
                .collect();
            b[num_timesteps - 1] = stop;
            b
        };
        Self::from_betas(betas, (0..num_timesteps as u32).collect())
    }

    /// The tables of `betas` (DiT's `GaussianDiffusion.__init__`); `timestep_map[i]` is the
    /// model timestep of step `i`. Errors unless every beta is in (0, 1] and there is one
    /// `timestep_map` entry per beta.
    ///
    /// A one-step schedule (DiT's code has no clipped log variance for it) clips its posterior
    /// log variance at t = 0 to `log β_0`.
    pub fn from_betas(betas: Vec<f64>, timestep_map: Vec<u32>) -> Result<Self> {
        if betas.is_empty() || betas.iter().any(|b| !(*b > 0.0 && *b <= 1.0)) {
            return Err(Error::Invalid(format!(
                "betas must be in (0, 1], at least one, got {betas:?}"
            )));
        }
        if timestep_map.len() != betas.len() {
            return Err(Error::Invalid(format!(
                "{} timestep map entries for {} betas",
                timestep_map.len(),
                betas.len()
            )));
        }
        let n = betas.len();
        let mut ac = Vec::with_capacity(n);
        let mut prod = 1.0f64;
        for b in &betas {
            prod *= 1.0 - b;
            ac.push(prod);
        }
        let mut ac_prev = vec![1.0];
        ac_prev.extend_from_slice(&ac[..n - 1]);
        let map = |f: &dyn Fn(usize) -> f64| (0..n).map(f).collect::<Vec<f64>>();
        let posterior_variance = map(&|i| betas[i] * (1.0 - ac_prev[i]) / (1.0 - ac[i]));
        // log([v_1, v_1, v_2, ..]): the posterior variance is 0 at t = 0.
        let posterior_log_variance_clipped = map(&|i| match (i, n) {
            (0, 1) => betas[0].ln(),
            (0, _) => posterior_variance[1].ln(),
            _ => posterior_variance[i].ln(),
        });
        Ok(Self {
            sqrt_alphas_cumprod: map(&|i| ac[i].sqrt()),
            sqrt_one_minus_alphas_cumprod: map(&|i| (1.0 - ac[i]).sqrt()),
            sqrt_recip_alphas_cumprod: map(&|i| (1.0 / ac[i]).sqrt()),
            sqrt_recipm1_alphas_cumprod: map(&|i| (1.0 / ac[i] - 1.0).sqrt()),
            posterior_mean_coef1: map(&|i| betas[i] * ac_prev[i].sqrt() / (1.0 - ac[i])),
            posterior_mean_coef2: map(&|i| {
                (1.0 - ac_prev[i]) * (1.0 - betas[i]).sqrt() / (1.0 - ac[i])
            }),
            log_betas: map(&|i| betas[i].ln()),
            posterior_variance,
            posterior_log_variance_clipped,
            alphas_cumprod: ac,
            alphas_cumprod_prev: ac_prev,
            betas,
            timestep_map,
        })
    }

    /// The number of steps `T` of this schedule.
    pub fn num_timesteps(&self) -> usize {
        self.betas.len()
    }

    /// The schedule of `steps` sampling steps (DiT's `space_timesteps(T, [steps])` and
    /// `SpacedDiffusion`): steps `round(c_k)` with `c_0 = 0`, `c_{k+1} = c_k + (T − 1)/(steps − 1)`
    /// accumulated in f64 and Python's round-half-even, betas `1 − ᾱ_i / ᾱ_(previous kept)`,
    /// `timestep_map` the kept steps' model timesteps. Errors for 0 steps or more than `T`.
    pub fn respaced(&self, steps: usize) -> Result<Self> {
        let t = self.num_timesteps();
        if steps == 0 || steps > t {
            return Err(Error::Invalid(format!(
                "cannot sample in {steps} steps from a {t}-step diffusion"
            )));
        }
        let stride = if steps <= 1 {
            1.0
        } else {
            (t - 1) as f64 / (steps - 1) as f64
        };
        let mut keep = std::collections::BTreeSet::new();
        let mut cur = 0.0f64;
        for _ in 0..steps {
            keep.insert(cur.round_ties_even() as usize);
            cur += stride;
        }
        let mut betas = Vec::new();
        let mut map = Vec::new();
        let mut last = 1.0f64;
        for (i, &a) in self.alphas_cumprod.iter().enumerate() {
            if keep.contains(&i) {
                betas.push(1.0 - a / last);
                last = a;
                map.push(self.timestep_map[i]);
            }
        }
        Self::from_betas(betas, map)
    }
}

/// `table[t]` for every sample as f32 (DiT casts after indexing the float64 table), shaped
/// `(batch, 1, ..)` with `ndim` dims for broadcasting.
pub fn extract(table: &[f64], t: &[u32], ndim: usize) -> Result<Tensor> {
    extract_as(table, t, ndim, DType::F32)
}

/// [`extract`] in `dtype` (rounded once from the float64 table).
pub fn extract_as(table: &[f64], t: &[u32], ndim: usize, dtype: DType) -> Result<Tensor> {
    let v =
        t.iter()
            .map(|&t| {
                table.get(t as usize).copied().ok_or_else(|| {
                    Error::Invalid(format!("timestep {t} outside 0..{}", table.len()))
                })
            })
            .collect::<Result<Vec<f64>>>()?;
    let mut shape = vec![t.len()];
    shape.extend(std::iter::repeat_n(1, ndim.saturating_sub(1)));
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
}
