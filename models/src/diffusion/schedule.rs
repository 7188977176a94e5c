//! DiT's Gaussian diffusion schedule: float64 tables indexed by timestep, and respacing.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// The tables of a Gaussian diffusion with `T` steps (all float64, as DiT computes them with
/// numpy), and the original timestep of each step (`timestep_map`: the identity for the base
/// schedule, the kept steps for a respaced one; the model is called with these).
#[derive(Debug, Clone, PartialEq)]
pub struct GaussianDiffusion {
    pub betas: Vec<f64>,
    pub alphas_cumprod: Vec<f64>,
    pub alphas_cumprod_prev: Vec<f64>,
    pub sqrt_alphas_cumprod: Vec<f64>,
    pub sqrt_one_minus_alphas_cumprod: Vec<f64>,
    pub sqrt_recip_alphas_cumprod: Vec<f64>,
    pub sqrt_recipm1_alphas_cumprod: Vec<f64>,
    pub posterior_variance: Vec<f64>,
    pub posterior_log_variance_clipped: Vec<f64>,
    pub posterior_mean_coef1: Vec<f64>,
    pub posterior_mean_coef2: Vec<f64>,
    pub log_betas: Vec<f64>,
    pub timestep_map: Vec<u32>,
}

impl GaussianDiffusion {
    /// DiT's linear schedule: betas `linspace(s·1e-4, s·0.02, T)` with `s = 1000 / T`.
    pub fn linear(num_timesteps: usize) -> Result<Self> {
        if num_timesteps < 2 {
            return Err(Error::Invalid(format!(
                "a diffusion needs at least 2 timesteps, got {num_timesteps}"
            )));
        }
        let scale = 1000.0 / num_timesteps as f64;
        let (start, stop) = (scale * 1e-4, scale * 0.02);
        let step = (stop - start) / (num_timesteps - 1) as f64;
        let mut betas: Vec<f64> = (0..num_timesteps)
            .map(|i| i as f64 * step + start)
            .collect();
        betas[num_timesteps - 1] = stop;
        Self::from_betas(betas, (0..num_timesteps as u32).collect())
    }

    /// The tables of `betas` (DiT's `GaussianDiffusion.__init__`).
    pub fn from_betas(betas: Vec<f64>, timestep_map: Vec<u32>) -> Result<Self> {
        if betas.iter().any(|b| !(*b > 0.0 && *b <= 1.0)) || betas.len() < 2 {
            return Err(Error::Invalid(
                "betas must be in (0, 1], at least two".into(),
            ));
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
        let posterior_log_variance_clipped = map(&|i| {
            let v = if i == 0 {
                posterior_variance[1]
            } else {
                posterior_variance[i]
            };
            v.ln()
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

    pub fn num_timesteps(&self) -> usize {
        self.betas.len()
    }

    /// The schedule of `steps` sampling steps (DiT's `space_timesteps(T, [steps])` and
    /// `SpacedDiffusion`): steps evenly strided over `0..T` (Python's round-half-even of the
    /// fractional stride), betas `1 − ᾱ_i / ᾱ_previous kept`.
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
