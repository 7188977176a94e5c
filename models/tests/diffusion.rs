//! `models::diffusion` against closed forms evaluated here in f64: DiT's schedule tables and
//! respacing rule, the DDPM and rectified-flow training terms (values, gradients, the sharding
//! contract), and the samplers with closure models whose answers are known; then the respaced
//! schedules and `q_sample` against DiT's own numbers (`tests/fixtures/dit/tiny`).
//!
//! Tolerances: schedule tables 1e-15 relative (the same f64 operations in another order at
//! most); f32 tensor results against f64 closed forms 1e-5 to 1e-6 relative to the largest
//! value compared (single f32 roundings, sums of at most 96 elements); finite differences
//! of the bound 1e-3 (central differences in f64, step 1e-4, against an f32 gradient).

use std::f64::consts::{LN_2, PI};

use candle_core::{DType, Device, Tensor, Var};
use models::diffusion::schedule::extract;
use models::diffusion::{
    flow_sample, flow_sample_euler, flow_terms, flow_timestep, logit_normal, DrawStream,
    GaussianDiffusion, Guidance,
};

type Res<T = ()> = anyhow::Result<T>;

/// A standard normal tensor of `shape`, deterministic in `seed`.
fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut d = DrawStream::new(seed, 0);
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| d.normal() as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `|got − want| ≤ tol · max(max |want|, floor)` elementwise.
fn assert_close(got: &[f64], want: &[f64], tol: f64, floor: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    // nan-ok: each element is then compared with `<=` and `is_finite`, which fail on NaN.
    let scale = want.iter().fold(floor, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && (g - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

fn rel_close(a: f64, b: f64, tol: f64, what: &str) {
    assert!(
        (a - b).abs() <= tol * b.abs(),
        "{what}: {a} vs {b} (rel {})",
        (a - b).abs() / b.abs()
    );
}

/// Elements per sample of a `(batch, ..)` tensor.
fn per_sample(t: &Tensor) -> usize {
    t.elem_count() / t.dim(0).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Schedule.

#[test]
fn linear_schedule_matches_its_closed_form() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    assert_eq!(d.num_timesteps(), 1000);
    assert_eq!(d.timestep_map, (0..1000).collect::<Vec<u32>>());
    // numpy's linspace: i · step + start, the last set to the end exactly.
    assert_eq!(d.betas[0], 1e-4);
    assert_eq!(d.betas[999], 0.02);
    let step = (0.02 - 1e-4) / 999.0;
    for i in [1usize, 2, 500, 998] {
        assert_eq!(d.betas[i], i as f64 * step + 1e-4, "beta {i}");
    }
    // ᾱ as a running product, and its neighbours by hand.
    let mut prod = 1.0f64;
    for (i, &b) in d.betas.iter().enumerate() {
        let prev = prod;
        prod *= 1.0 - b;
        rel_close(d.alphas_cumprod[i], prod, 1e-15, "alphas_cumprod");
        rel_close(d.alphas_cumprod_prev[i], prev, 1e-15, "alphas_cumprod_prev");
    }
    rel_close(d.alphas_cumprod[0], 0.9999, 1e-15, "ᾱ_0");
    rel_close(
        d.alphas_cumprod[1],
        0.9999 * (1.0 - (1e-4 + step)),
        1e-15,
        "ᾱ_1",
    );
    // The well-known end of the DDPM schedule: ᾱ_999 ≈ 4.036e-5.
    rel_close(d.alphas_cumprod[999], 4.036e-5, 1e-3, "ᾱ_999");
    // The posterior at t = 0: variance 0 (log clipped to t = 1's), mean x0.
    assert_eq!(d.posterior_variance[0], 0.0);
    // β_0 / (1 − ᾱ_0) = 1 up to the cancellation in 1 − ᾱ_0 (1e-16 / 1e-4).
    rel_close(d.posterior_mean_coef1[0], 1.0, 1e-11, "coef1 at 0");
    assert_eq!(d.posterior_mean_coef2[0], 0.0);
    let v1 = (1e-4 + step) * 1e-4 / (1.0 - d.alphas_cumprod[1]);
    rel_close(d.posterior_variance[1], v1, 1e-11, "posterior variance 1");
    rel_close(
        d.posterior_log_variance_clipped[0],
        v1.ln(),
        1e-11,
        "clip 0",
    );
    assert_eq!(
        d.posterior_log_variance_clipped[0],
        d.posterior_log_variance_clipped[1]
    );
    for t in [1usize, 2, 10, 500, 999] {
        let (a, ap, b) = (d.alphas_cumprod[t], d.alphas_cumprod[t - 1], d.betas[t]);
        rel_close(d.sqrt_alphas_cumprod[t], a.sqrt(), 1e-15, "sqrt ᾱ");
        rel_close(
            d.sqrt_one_minus_alphas_cumprod[t],
            (1.0 - a).sqrt(),
            1e-15,
            "√(1−ᾱ)",
        );
        rel_close(
            d.sqrt_recip_alphas_cumprod[t],
            1.0 / a.sqrt(),
            1e-15,
            "√(1/ᾱ)",
        );
        rel_close(
            d.sqrt_recipm1_alphas_cumprod[t],
            ((1.0 - a) / a).sqrt(),
            1e-11, // 1/ᾱ − 1 cancels near t = 0
            "√(1/ᾱ−1)",
        );
        let pv = b * (1.0 - ap) / (1.0 - a);
        rel_close(d.posterior_variance[t], pv, 1e-15, "posterior variance");
        rel_close(
            d.posterior_log_variance_clipped[t],
            pv.ln(),
            1e-15,
            "log pv",
        );
        rel_close(
            d.posterior_mean_coef1[t],
            b * ap.sqrt() / (1.0 - a),
            1e-15,
            "coef1",
        );
        rel_close(
            d.posterior_mean_coef2[t],
            (1.0 - ap) * (1.0 - b).sqrt() / (1.0 - a),
            1e-15,
            "coef2",
        );
        rel_close(d.log_betas[t], b.ln(), 1e-15, "log beta");
    }
    // T ≠ 1000 scales the ends by 1000 / T.
    let d = GaussianDiffusion::linear(500)?;
    assert_eq!((d.betas[0], d.betas[499]), (2e-4, 0.04));
    let d = GaussianDiffusion::linear(4000)?;
    assert_eq!((d.betas[0], d.betas[3999]), (0.25 * 1e-4, 0.25 * 0.02));
    // One step (numpy's linspace of one value is the start).
    let d = GaussianDiffusion::linear(1)?;
    assert_eq!(d.betas, vec![1000.0 * 1e-4]);
    assert_eq!(d.posterior_log_variance_clipped, vec![d.betas[0].ln()]);
    Ok(())
}

#[test]
fn bad_schedules_are_errors() -> Res {
    assert!(GaussianDiffusion::linear(0).is_err());
    // Betas above 1 (DiT asserts), from T < 20; T = 20 ends at exactly 1.
    assert!(GaussianDiffusion::linear(19).is_err());
    assert!(GaussianDiffusion::linear(20).is_ok());
    assert!(GaussianDiffusion::from_betas(vec![0.5, 0.0], vec![0, 1]).is_err());
    assert!(GaussianDiffusion::from_betas(vec![0.5, 0.2], vec![0]).is_err());
    assert!(GaussianDiffusion::from_betas(vec![], vec![]).is_err());
    let d = GaussianDiffusion::linear(1000)?;
    assert!(d.respaced(0).is_err());
    assert!(d.respaced(1001).is_err());
    Ok(())
}

/// DiT's `space_timesteps(T, [n])`: `round(c_k)`, `c` accumulated by `(T − 1)/(n − 1)` in f64,
/// Python's round-half-even. Lists written out from running that rule by hand.
#[test]
fn respacing_keeps_dits_timesteps() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    let r5 = d.respaced(5)?;
    // 249.75 → 250, 499.5 → 500 (half to even), 749.25 → 749.
    assert_eq!(r5.timestep_map, vec![0, 250, 500, 749, 999]);
    let r50 = d.respaced(50)?;
    let want50: Vec<u32> = vec![
        0, 20, 41, 61, 82, 102, 122, 143, 163, 183, 204, 224, 245, 265, 285, 306, 326, 347, 367,
        387, 408, 428, 449, 469, 489, 510, 530, 550, 571, 591, 612, 632, 652, 673, 693, 714, 734,
        754, 775, 795, 816, 836, 856, 877, 897, 917, 938, 958, 979, 999,
    ];
    assert_eq!(r50.timestep_map, want50);
    // Stride 49.95 accumulated: c_10 = 499.49999.. (not 10 · 49.95 = 499.5 → 500).
    let r21 = d.respaced(21)?;
    let want21: Vec<u32> = vec![
        0, 50, 100, 150, 200, 250, 300, 350, 400, 450, 499, 549, 599, 649, 699, 749, 799, 849, 899,
        949, 999,
    ];
    assert_eq!(r21.timestep_map, want21);
    assert_eq!(d.respaced(1)?.timestep_map, vec![0]);
    assert_eq!(d.respaced(1000)?.timestep_map, d.timestep_map);
    // Ties at .5 go to the even step.
    let small = |t: usize| GaussianDiffusion::from_betas(vec![0.01; t], (0..t as u32).collect());
    assert_eq!(small(10)?.respaced(3)?.timestep_map, vec![0, 4, 9]); // 4.5 → 4
    assert_eq!(small(6)?.respaced(3)?.timestep_map, vec![0, 2, 5]); // 2.5 → 2
    assert_eq!(small(4)?.respaced(3)?.timestep_map, vec![0, 2, 3]); // 1.5 → 2
                                                                    // Respacing a respaced schedule maps through to the original timesteps.
    assert_eq!(
        r50.respaced(5)?.timestep_map,
        vec![0, want50[12], want50[24], want50[37], 999]
    );
    for r in [&r5, &r50, &r21] {
        assert_eq!(r.num_timesteps(), r.timestep_map.len());
    }
    Ok(())
}

#[test]
fn respaced_betas_reproduce_the_kept_alphas() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    for n in [1usize, 5, 21, 50, 1000] {
        let r = d.respaced(n)?;
        let mut prod = 1.0f64;
        for (i, (&b, &t)) in r.betas.iter().zip(&r.timestep_map).enumerate() {
            prod *= 1.0 - b;
            let want = d.alphas_cumprod[t as usize];
            rel_close(prod, want, 1e-13, &format!("respace{n}: ᾱ of step {i}"));
            rel_close(r.alphas_cumprod[i], want, 1e-13, "respaced table");
        }
    }
    Ok(())
}

#[test]
fn extract_gives_per_sample_f32_values() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    let e = extract(&d.sqrt_alphas_cumprod, &[3, 0, 999], 4)?;
    assert_eq!(e.dims(), &[3, 1, 1, 1]);
    assert_eq!(e.dtype(), DType::F32);
    let want: Vec<f32> = [3, 0, 999]
        .iter()
        .map(|&t| d.sqrt_alphas_cumprod[t] as f32)
        .collect();
    assert_eq!(e.flatten_all()?.to_vec1::<f32>()?, want);
    assert_eq!(extract(&d.betas, &[1, 2], 1)?.dims(), &[2]);
    assert!(extract(&d.betas, &[1000], 2).is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Training terms.

#[test]
fn q_sample_is_the_closed_form() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    let (x0, noise) = (randn(&[3, 2, 4, 4], 1), randn(&[3, 2, 4, 4], 2));
    let t = [0u32, 500, 999];
    let got = values(&d.q_sample(&x0, &t, &noise)?);
    let (x, n) = (values(&x0), values(&noise));
    let k = per_sample(&x0);
    let want: Vec<f64> = (0..x.len())
        .map(|i| {
            let t = t[i / k] as usize;
            d.sqrt_alphas_cumprod[t] * x[i] + d.sqrt_one_minus_alphas_cumprod[t] * n[i]
        })
        .collect();
    assert_close(&got, &want, 1e-6, 1.0, "q_sample");
    assert!(d.q_sample(&x0, &t[..2], &noise).is_err());
    assert!(d.q_sample(&x0, &t, &noise.narrow(3, 0, 2)?).is_err());
    Ok(())
}

/// DiT's bound term of one element in bits, in f64 (the model's mean from `eps`, its log
/// variance the learned range of `var`).
fn vb_element(d: &GaussianDiffusion, t: u32, x0: f64, x_t: f64, eps: f64, var: f64) -> f64 {
    let t = t as usize;
    let (c1, c2) = (d.posterior_mean_coef1[t], d.posterior_mean_coef2[t]);
    let true_mean = c1 * x0 + c2 * x_t;
    let true_lv = d.posterior_log_variance_clipped[t];
    let x0_pred = d.sqrt_recip_alphas_cumprod[t] * x_t - d.sqrt_recipm1_alphas_cumprod[t] * eps;
    let mean = c1 * x0_pred + c2 * x_t;
    let frac = (var + 1.0) / 2.0;
    let lv = frac * d.betas[t].ln() + (1.0 - frac) * true_lv;
    if t > 0 {
        let kl = 0.5
            * (-1.0 + lv - true_lv
                + (true_lv - lv).exp()
                + (true_mean - mean).powi(2) * (-lv).exp());
        kl / LN_2
    } else {
        let cdf = |x: f64| 0.5 * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
        let inv_stdv = (-0.5 * lv).exp();
        let plus = cdf(inv_stdv * (x0 - mean + 1.0 / 255.0));
        let minus = cdf(inv_stdv * (x0 - mean - 1.0 / 255.0));
        let log_p = if x0 < -0.999 {
            plus.max(1e-12).ln()
        } else if x0 > 0.999 {
            (1.0 - minus).max(1e-12).ln()
        } else {
            (plus - minus).max(1e-12).ln()
        };
        -log_p / LN_2
    }
}

/// A DDPM batch `(4, 2, 3, 4)` at t = 0, 1, 500, 999 with x0 in (−1, 1) and some exact ±1
/// (sample 0, t = 0: both edge branches of the likelihood).
struct Batch {
    d: GaussianDiffusion,
    t: Vec<u32>,
    x0: Tensor,
    noise: Tensor,
    x_t: Tensor,
    eps: Tensor,
    var: Tensor,
}

fn batch() -> Batch {
    let d = GaussianDiffusion::linear(1000).unwrap();
    let shape = [4, 2, 3, 4];
    let t = vec![0u32, 1, 500, 999];
    let mut x0 = values(&randn(&shape, 3).tanh().unwrap());
    for (i, v) in [-1.0, 1.0, -1.0, 1.0, 0.9995, -0.9995]
        .into_iter()
        .enumerate()
    {
        x0[i * 3] = v; // sample 0
        x0[24 + i * 3] = v; // sample 1
    }
    let x0 = Tensor::from_vec(x0, &shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let noise = randn(&shape, 4);
    let x_t = d.q_sample(&x0, &t, &noise).unwrap();
    let eps = (&noise + (randn(&shape, 5) * 0.3).unwrap()).unwrap();
    let var = randn(&shape, 6).tanh().unwrap();
    Batch {
        d,
        t,
        x0,
        noise,
        x_t,
        eps,
        var,
    }
}

/// Per-sample sums of [`vb_element`] over the given tensors, with `var` perturbed by `dv` at
/// flat element `at`.
fn vb_reference(b: &Batch, var: &Tensor, perturb: Option<(usize, f64)>) -> Vec<f64> {
    let (x0, x_t, eps) = (values(&b.x0), values(&b.x_t), values(&b.eps));
    let mut v = values(var);
    if let Some((at, dv)) = perturb {
        v[at] += dv;
    }
    let k = per_sample(&b.x0);
    let mut sums = vec![0.0; b.t.len()];
    for i in 0..x0.len() {
        sums[i / k] += vb_element(&b.d, b.t[i / k], x0[i], x_t[i], eps[i], v[i]);
    }
    sums
}

#[test]
fn ddpm_terms_equal_dits_formulas_per_element() -> Res {
    let b = batch();
    let terms =
        b.d.ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &b.eps, &b.var)?;
    assert_eq!(terms.mse_sum.dims(), &[4]);
    assert_eq!(terms.vb_sum.dims(), &[4]);
    let (n, e) = (values(&b.noise), values(&b.eps));
    let k = per_sample(&b.x0);
    let mut mse = [0.0; 4];
    for i in 0..n.len() {
        mse[i / k] += (n[i] - e[i]).powi(2);
    }
    let got_mse = values(&terms.mse_sum);
    let got_vb = values(&terms.vb_sum);
    for s in 0..4 {
        rel_close(got_mse[s], mse[s], 1e-5, "mse_sum");
    }
    let want_vb = vb_reference(&b, &b.var, None);
    for s in 0..4 {
        // Each sample on its own scale: the t = 0 likelihood is far larger than the KLs.
        rel_close(
            got_vb[s],
            want_vb[s],
            1e-5,
            &format!("vb_sum at t = {}", b.t[s]),
        );
        assert!(want_vb[s] > 0.0);
    }
    Ok(())
}

#[test]
fn ddpm_gradients_mse_trains_the_noise_and_the_bound_only_the_variance() -> Res {
    let b = batch();
    let eps = Var::from_tensor(&b.eps)?;
    let var = Var::from_tensor(&b.var)?;
    // The bound: no gradient into the noise prediction (DiT's frozen_out).
    let terms = b.d.ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &eps, &var)?;
    let grads = terms.vb_sum.sum_all()?.backward()?;
    if let Some(g) = grads.get(&eps) {
        assert!(values(g).iter().all(|&v| v == 0.0), "vb moved eps");
    }
    let g_var = values(grads.get(&var).expect("vb trains the variance"));
    assert!(g_var.iter().all(|v| v.is_finite()));
    // Against central differences of the f64 formula: each element's gradient is its own
    // branch's (the other branch adds exactly nothing).
    let k = per_sample(&b.x0);
    for at in [0usize, 3, 7, k + 1, k + 10, 2 * k + 5, 3 * k + 20] {
        let h = 1e-4;
        let up = vb_reference(&b, &b.var, Some((at, h)));
        let down = vb_reference(&b, &b.var, Some((at, -h)));
        let fd = (up[at / k] - down[at / k]) / (2.0 * h);
        assert!(
            (g_var[at] - fd).abs() <= 1e-3 * fd.abs().max(1e-3),
            "d vb / d var[{at}] (t = {}): {} vs {fd}",
            b.t[at / k],
            g_var[at]
        );
    }
    // The MSE: gradient 2 (ε̂ − noise) into ε̂, none into the variance.
    let terms = b.d.ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &eps, &var)?;
    let grads = terms.mse_sum.sum_all()?.backward()?;
    let want: Vec<f64> = values(&b.eps)
        .iter()
        .zip(values(&b.noise))
        .map(|(e, n)| 2.0 * (e - n))
        .collect();
    assert_close(
        &values(grads.get(&eps).unwrap()),
        &want,
        1e-6,
        1.0,
        "d mse / d eps",
    );
    assert!(grads.get(&var).is_none());
    // Both together: the noise gradient is the MSE's alone.
    let terms = b.d.ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &eps, &var)?;
    let grads = (terms.mse_sum + terms.vb_sum)?.sum_all()?.backward()?;
    assert_close(
        &values(grads.get(&eps).unwrap()),
        &want,
        1e-6,
        1.0,
        "d loss / d eps",
    );
    Ok(())
}

/// Saturated likelihoods (the mean far from x0, extreme variances): the 1e-12 clamps keep the
/// bound and every gradient finite, in both branches.
#[test]
fn ddpm_bound_stays_finite_when_saturated() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    let shape = [4, 1, 2, 3];
    let x0 = Tensor::from_vec(
        [-1.0f32, 1.0, 0.0, -1.0, 1.0, 0.5].repeat(4),
        &shape,
        &Device::Cpu,
    )?;
    let noise = randn(&shape, 7);
    let t = [0u32, 0, 999, 999];
    let x_t = d.q_sample(&x0, &t, &noise)?;
    for (offset, v) in [(60.0, -1.0), (-60.0, 1.0), (1e4, 0.0)] {
        let eps = Var::from_tensor(&(&noise + offset)?)?;
        let var = Var::from_tensor(&Tensor::full(v as f32, &shape, &Device::Cpu)?)?;
        let terms = d.ddpm_terms(&x0, &x_t, &t, &noise, &eps, &var)?;
        let vb = values(&terms.vb_sum);
        assert!(vb.iter().all(|v| v.is_finite() && *v >= 0.0), "{vb:?}");
        let grads = (terms.vb_sum + terms.mse_sum)?.sum_all()?.backward()?;
        for g in [grads.get(&eps).unwrap(), grads.get(&var).unwrap()] {
            assert!(values(g).iter().all(|v| v.is_finite()), "offset {offset}");
        }
    }
    Ok(())
}

/// The true posterior predicted (ε̂ = noise, var = −1: log variance = the clipped posterior's)
/// has no KL.
#[test]
fn kl_vanishes_at_the_true_posterior() -> Res {
    let d = GaussianDiffusion::linear(1000)?;
    let shape = [4, 2, 3, 4];
    let t = [1u32, 10, 500, 999];
    let x0 = randn(&shape, 8).tanh()?;
    let noise = randn(&shape, 9);
    let x_t = d.q_sample(&x0, &t, &noise)?;
    let var = Tensor::full(-1.0f32, &shape, &Device::Cpu)?;
    let terms = d.ddpm_terms(&x0, &x_t, &t, &noise, &noise, &var)?;
    for v in values(&terms.vb_sum) {
        assert!(v.abs() < 1e-6, "KL {v}");
    }
    assert!(values(&terms.mse_sum).iter().all(|&v| v == 0.0));
    // Any other variance costs bits (little at large t, where β_t and the posterior variance,
    // the ends of the range, nearly agree).
    let var = Tensor::full(0.5f32, &shape, &Device::Cpu)?;
    let terms = d.ddpm_terms(&x0, &x_t, &t, &noise, &noise, &var)?;
    let vb = values(&terms.vb_sum);
    assert!(
        vb.iter().all(|&v| v > 0.0) && vb[0] > 1e-2 && vb[1] > 1e-2,
        "{vb:?}"
    );
    Ok(())
}

/// The sharding contract: the sums over two parts of every sample's elements (non-contiguous
/// slices, as one rank's tokens) add up to the sum over the whole.
#[test]
fn terms_of_parts_add_up_to_the_whole() -> Res {
    let b = batch();
    let d = &b.d;
    let whole = d.ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &b.eps, &b.var)?;
    let part = |lo: usize, len: usize| {
        let p = |x: &Tensor| x.narrow(3, lo, len).unwrap();
        d.ddpm_terms(
            &p(&b.x0),
            &p(&b.x_t),
            &b.t,
            &p(&b.noise),
            &p(&b.eps),
            &p(&b.var),
        )
        .unwrap()
    };
    let (a, c) = (part(0, 1), part(1, 3));
    for (sum, w) in [
        ((&a.mse_sum + &c.mse_sum)?, &whole.mse_sum),
        ((&a.vb_sum + &c.vb_sum)?, &whole.vb_sum),
    ] {
        let (s, w) = (values(&sum), values(w));
        for i in 0..4 {
            rel_close(s[i], w[i], 1e-5, "parts vs whole");
        }
    }
    let (x0, noise, pred) = (&b.x0, &b.noise, &b.eps);
    let whole = values(&flow_terms(x0, noise, pred)?);
    let p = |x: &Tensor, lo, len| x.narrow(2, lo, len).unwrap();
    let sum = (flow_terms(&p(x0, 0, 2), &p(noise, 0, 2), &p(pred, 0, 2))?
        + flow_terms(&p(x0, 2, 1), &p(noise, 2, 1), &p(pred, 2, 1))?)?;
    for (s, w) in values(&sum).iter().zip(&whole) {
        rel_close(*s, *w, 1e-5, "flow parts vs whole");
    }
    Ok(())
}

#[test]
fn ddpm_terms_reject_mismatched_inputs() -> Res {
    let b = batch();
    let d = &b.d;
    let short = b.var.narrow(3, 0, 2)?;
    assert!(d
        .ddpm_terms(&b.x0, &b.x_t, &b.t, &b.noise, &b.eps, &short)
        .is_err());
    assert!(d
        .ddpm_terms(&b.x0, &b.x_t, &b.t[..3], &b.noise, &b.eps, &b.var)
        .is_err());
    assert!(d
        .ddpm_terms(&b.x0, &b.x_t, &[0, 1, 2, 1000], &b.noise, &b.eps, &b.var)
        .is_err());
    Ok(())
}

#[test]
fn rectified_flow_terms() -> Res {
    let shape = [3, 2, 2, 2];
    let (x0, noise, pred) = (randn(&shape, 10), randn(&shape, 11), randn(&shape, 12));
    let s = [0.0f32, 0.3, 1.0];
    let xs = flow_sample(&x0, &noise, &s)?;
    let (x, n, p) = (values(&x0), values(&noise), values(&pred));
    let k = per_sample(&x0);
    let want: Vec<f64> = (0..x.len())
        .map(|i| {
            let s = s[i / k] as f64;
            (1.0 - s) * x[i] + s * n[i]
        })
        .collect();
    assert_close(&values(&xs), &want, 1e-6, 1.0, "flow_sample");
    // The ends exactly.
    assert_eq!(values(&xs.get(0)?), values(&x0.get(0)?));
    assert_eq!(values(&xs.get(2)?), values(&noise.get(2)?));
    assert!(flow_sample(&x0, &noise, &s[..2]).is_err());

    let pv = Var::from_tensor(&pred)?;
    let terms = flow_terms(&x0, &noise, &pv)?;
    assert_eq!(terms.dims(), &[3]);
    let mut want = [0.0f64; 3];
    for i in 0..x.len() {
        want[i / k] += (p[i] - (n[i] - x[i])).powi(2);
    }
    for (g, w) in values(&terms).iter().zip(want) {
        rel_close(*g, w, 1e-5, "flow_terms");
    }
    let grads = terms.sum_all()?.backward()?;
    let want: Vec<f64> = (0..x.len()).map(|i| 2.0 * (p[i] - (n[i] - x[i]))).collect();
    assert_close(
        &values(grads.get(&pv).unwrap()),
        &want,
        1e-6,
        1.0,
        "d flow / d pred",
    );
    assert!(flow_terms(&x0, &noise, &pred.narrow(0, 0, 2)?).is_err());

    assert_eq!(flow_timestep(0.25), 250.0);
    assert_eq!(flow_timestep(1.0), 1000.0);
    let mut zs = [0.0, 3f64.ln(), -(3f64.ln())].into_iter();
    let s = logit_normal(3, || zs.next().unwrap());
    assert_close(
        &s.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &[0.5, 0.75, 0.25],
        1e-7,
        1.0,
        "logit_normal",
    );
    let draw = |seed| {
        let mut d = DrawStream::new(seed, 3);
        logit_normal(64, || d.normal())
    };
    let s = draw(1);
    assert!(s.iter().all(|&v| v > 0.0 && v < 1.0));
    assert_eq!(s, draw(1));
    assert_ne!(s, draw(2));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Samplers.

/// `x ↦ e` for every input: the noise prediction `e` (and variance values `v` when given).
fn constant_model(
    e: Tensor,
    v: Option<Tensor>,
    seen: &mut Vec<Vec<f32>>,
) -> impl FnMut(&Tensor, &[f32], &[u32]) -> models::Result<Tensor> + '_ {
    move |x, t, _y| {
        seen.push(t.to_vec());
        assert_eq!(x.dims(), e.dims());
        Ok(match &v {
            Some(v) => Tensor::cat(&[&e, v], 1)?,
            None => e.clone(),
        })
    }
}

/// DDIM with a constant noise prediction e keeps x0 = (x_T − √(1−ᾱ_T) e) / √ᾱ_T fixed and ends
/// there, for any number of steps; the model sees the steps' original timesteps.
#[test]
fn ddim_reproduces_the_closed_form() -> Res {
    let shape = [2, 3, 2, 2];
    let (noise, e) = (randn(&shape, 20), randn(&shape, 21));
    let base = GaussianDiffusion::linear(1000)?;
    // The one-step identity schedule, a respaced one and the full one.
    for d in [
        GaussianDiffusion::linear(1)?,
        base.respaced(1)?,
        base.respaced(5)?,
        base,
    ] {
        let last = d.num_timesteps() - 1;
        let (a, b) = (
            d.sqrt_alphas_cumprod[last],
            d.sqrt_one_minus_alphas_cumprod[last],
        );
        let want: Vec<f64> = values(&noise)
            .iter()
            .zip(values(&e))
            .map(|(x, e)| (x - b * e) / a)
            .collect();
        let mut seen = Vec::new();
        let got = d.ddim_sample(
            &mut constant_model(e.clone(), None, &mut seen),
            &noise,
            &[1, 2],
            None,
        )?;
        let t = d.num_timesteps();
        assert_close(&values(&got), &want, 1e-5, 1.0, &format!("ddim {t} steps"));
        let times: Vec<Vec<f32>> = d
            .timestep_map
            .iter()
            .rev()
            .map(|&m| vec![m as f32; 2])
            .collect();
        assert_eq!(seen, times);
        // A learned variance does not change DDIM.
        let v = randn(&shape, 22).tanh()?;
        let with_var = d.ddim_sample(
            &mut constant_model(e.clone(), Some(v), &mut Vec::new()),
            &noise,
            &[1, 2],
            None,
        )?;
        assert_eq!(values(&with_var), values(&got));
    }
    Ok(())
}

/// A label-dependent model: noise `0.1 x + 0.01 y`, variance values `0.2 − 0.05 y` (so the
/// null label's differ).
fn label_model(
    calls: &mut Vec<(usize, Vec<f32>, Vec<u32>)>,
) -> impl FnMut(&Tensor, &[f32], &[u32]) -> models::Result<Tensor> + '_ {
    move |x, t, y| {
        calls.push((x.dim(0)?, t.to_vec(), y.to_vec()));
        let per = |f: &dyn Fn(u32) -> f32| -> models::Result<Tensor> {
            let v: Vec<f32> = y.iter().map(|&y| f(y)).collect();
            Ok(Tensor::from_vec(v, (y.len(), 1, 1, 1), &Device::Cpu)?)
        };
        let eps = ((x * 0.1)?.broadcast_add(&per(&|y| 0.01 * y as f32)?))?;
        let var = per(&|y| 0.2 - 0.05 * y as f32)?.broadcast_as(x.shape())?;
        Ok(Tensor::cat(&[&eps, &var], 1)?)
    }
}

/// Classifier-free guidance: a doubled batch `[cond; null]`, guided noise, the conditional
/// half's variance; scale 1 is no guidance.
#[test]
fn guidance_is_dits_forward_with_cfg() -> Res {
    let d = GaussianDiffusion::linear(1000)?.respaced(5)?;
    let noise = randn(&[2, 3, 2, 2], 30);
    let labels = [3u32, 7];
    let g = Guidance {
        scale: 4.0,
        null_label: 10,
    };
    // Guided, against a model that guides by itself on the undoubled batch.
    let mut calls = Vec::new();
    let guided = d.ddim_sample(&mut label_model(&mut calls), &noise, &labels, Some(g))?;
    assert_eq!(calls.len(), 5);
    for (b, t, y) in &calls {
        assert_eq!((*b, y.as_slice()), (4, &[3, 7, 10, 10][..]));
        assert_eq!(t[..2], t[2..]);
    }
    let mut inner = Vec::new();
    let mut by_hand = {
        let mut m = label_model(&mut inner);
        move |x: &Tensor, t: &[f32], y: &[u32]| -> models::Result<Tensor> {
            let cond = m(x, t, y)?;
            let uncond = m(x, t, &vec![10; y.len()])?;
            let (ce, ue) = (cond.narrow(1, 0, 3)?, uncond.narrow(1, 0, 3)?);
            let eps = (&ue + ((ce - &ue)? * 4.0)?)?;
            Ok(Tensor::cat(&[&eps, &cond.narrow(1, 3, 3)?], 1)?)
        }
    };
    let want = d.ddim_sample(&mut by_hand, &noise, &labels, None)?;
    assert_close(&values(&guided), &values(&want), 1e-6, 1.0, "guided ddim");
    // Ancestral sampling uses the conditional variance.
    let zs: Vec<Tensor> = (0..5).map(|k| randn(&[2, 3, 2, 2], 40 + k)).collect();
    let got = d.ddpm_sample(
        &mut label_model(&mut Vec::new()),
        &noise,
        &labels,
        Some(g),
        &mut |k| Ok(zs[k].clone()),
    )?;
    let want = d.ddpm_sample(&mut by_hand, &noise, &labels, None, &mut |k| {
        Ok(zs[k].clone())
    })?;
    assert_close(&values(&got), &values(&want), 1e-6, 1.0, "guided ddpm");
    // Scale 1: one call on the labels, the unguided result exactly.
    let one = Guidance { scale: 1.0, ..g };
    let mut calls = Vec::new();
    let a = d.ddim_sample(&mut label_model(&mut calls), &noise, &labels, Some(one))?;
    assert!(calls.iter().all(|(b, _, y)| *b == 2 && y == &labels));
    let b = d.ddim_sample(&mut label_model(&mut Vec::new()), &noise, &labels, None)?;
    assert_eq!(values(&a), values(&b));
    // Flow sampling guides the velocity alike.
    let got = flow_sample_euler(
        &mut label_model(&mut Vec::new()),
        &noise,
        &labels,
        Some(g),
        3,
    )?;
    let want = flow_sample_euler(&mut by_hand, &noise, &labels, None, 3)?;
    assert_close(&values(&got), &values(&want), 1e-6, 1.0, "guided flow");
    Ok(())
}

/// Two DDPM steps by hand (kept timesteps 999 and 0): x ← mean + σ z_0, then the mean alone;
/// `step_noise` is called for steps 0 and 1 in order, and the last step's noise is unused.
#[test]
fn ddpm_sample_follows_p_sample_loop() -> Res {
    let d = GaussianDiffusion::linear(1000)?.respaced(2)?;
    assert_eq!(d.timestep_map, vec![0, 999]);
    let shape = [2, 3, 2, 2];
    let (noise, e) = (randn(&shape, 50), randn(&shape, 51));
    let v = randn(&shape, 52).tanh()?;
    let zs = [randn(&shape, 53), randn(&shape, 54)];
    for learned in [true, false] {
        // By hand in f64.
        let (x, ev, vv, z0) = (values(&noise), values(&e), values(&v), values(&zs[0]));
        let mean = |t: usize, x: f64, e: f64| {
            let x0 = d.sqrt_recip_alphas_cumprod[t] * x - d.sqrt_recipm1_alphas_cumprod[t] * e;
            d.posterior_mean_coef1[t] * x0 + d.posterior_mean_coef2[t] * x
        };
        let want: Vec<f64> = (0..x.len())
            .map(|i| {
                let lv = if learned {
                    let frac = (vv[i] + 1.0) / 2.0;
                    frac * d.betas[1].ln() + (1.0 - frac) * d.posterior_log_variance_clipped[1]
                } else {
                    d.betas[1].ln() // fixed large
                };
                let x1 = mean(1, x[i], ev[i]) + (0.5 * lv).exp() * z0[i];
                mean(0, x1, ev[i])
            })
            .collect();
        let run = |last: &Tensor| -> Res<(Tensor, Vec<usize>, Vec<Vec<f32>>)> {
            let mut asked = Vec::new();
            let mut seen = Vec::new();
            let vo = learned.then(|| v.clone());
            let out = d.ddpm_sample(
                &mut constant_model(e.clone(), vo, &mut seen),
                &noise,
                &[0, 1],
                None,
                &mut |k| {
                    asked.push(k);
                    Ok(if k == 0 { zs[0].clone() } else { last.clone() })
                },
            )?;
            Ok((out, asked, seen))
        };
        let (got, asked, seen) = run(&zs[1])?;
        assert_eq!(asked, vec![0, 1]);
        assert_eq!(seen, vec![vec![999.0; 2], vec![0.0; 2]]);
        assert_close(&values(&got), &want, 1e-5, 1.0, "ddpm by hand");
        let (other, _, _) = run(&(&zs[1] * 100.0)?)?;
        assert_eq!(values(&other), values(&got), "noise added at t = 0");
    }
    // The first step's noise is used.
    let mut seen = Vec::new();
    let a = d.ddpm_sample(
        &mut constant_model(e.clone(), None, &mut seen),
        &noise,
        &[0, 1],
        None,
        &mut |_| Ok(zs[0].clone()),
    )?;
    let b = d.ddpm_sample(
        &mut constant_model(e.clone(), None, &mut seen),
        &noise,
        &[0, 1],
        None,
        &mut |_| Ok(zs[1].clone()),
    )?;
    // Different noise gives different samples, and both are numbers (NaN would differ too).
    let (va, vb) = (values(&a), values(&b));
    assert!(
        va.iter().chain(&vb).all(|x| x.is_finite()),
        "non-finite samples"
    );
    assert_ne!(va, vb);
    Ok(())
}

/// Euler steps on s = 1, 1 − 1/n, ..: a constant velocity v ends at noise − v; the exact
/// velocity (x − x0)/s of the straight path ends at x0 for any number of steps.
#[test]
fn flow_euler_follows_the_velocity() -> Res {
    let shape = [2, 3, 2, 2];
    let (noise, x0, v) = (randn(&shape, 60), randn(&shape, 61), randn(&shape, 62));
    let mut seen = Vec::new();
    let got = flow_sample_euler(
        &mut constant_model(v.clone(), None, &mut seen),
        &noise,
        &[0, 1],
        None,
        4,
    )?;
    assert_eq!(
        seen,
        [1000.0, 750.0, 500.0, 250.0].map(|t| vec![t; 2]).to_vec()
    );
    let want: Vec<f64> = values(&noise)
        .iter()
        .zip(values(&v))
        .map(|(n, v)| n - v)
        .collect();
    assert_close(&values(&got), &want, 1e-6, 1.0, "constant velocity");
    for steps in [1, 3, 10] {
        let mut exact = |x: &Tensor, t: &[f32], _: &[u32]| -> models::Result<Tensor> {
            Ok(((x - &x0)? / (t[0] as f64 / 1000.0))?)
        };
        let got = flow_sample_euler(&mut exact, &noise, &[0, 1], None, steps)?;
        assert_close(&values(&got), &values(&x0), 1e-5, 1.0, "straight path");
    }
    Ok(())
}

#[test]
fn samplers_reject_bad_models_and_inputs() -> Res {
    let d = GaussianDiffusion::linear(1000)?.respaced(3)?;
    let noise = randn(&[2, 3, 2, 2], 70);
    let wrong = |c: usize, b: usize| {
        move |_: &Tensor, _: &[f32], _: &[u32]| -> models::Result<Tensor> {
            Ok(Tensor::zeros((b, c, 2, 2), DType::F32, &Device::Cpu)?)
        }
    };
    assert!(d
        .ddim_sample(&mut wrong(4, 2), &noise, &[0, 1], None)
        .is_err());
    assert!(d
        .ddim_sample(&mut wrong(3, 1), &noise, &[0, 1], None)
        .is_err());
    assert!(d.ddim_sample(&mut wrong(3, 2), &noise, &[0], None).is_err());
    assert!(d
        .ddim_sample(&mut wrong(3, 2), &noise, &[0, 1], None)
        .is_ok());
    let g = Some(Guidance {
        scale: 2.0,
        null_label: 9,
    });
    // Guidance doubles the batch: a model answering for 2 rows is wrong then.
    assert!(d.ddim_sample(&mut wrong(3, 2), &noise, &[0, 1], g).is_err());
    assert!(d.ddim_sample(&mut wrong(6, 4), &noise, &[0, 1], g).is_ok());
    let mut bad_noise = |_| Ok(Tensor::zeros((2, 3, 2, 1), DType::F32, &Device::Cpu)?);
    assert!(d
        .ddpm_sample(&mut wrong(3, 2), &noise, &[0, 1], None, &mut bad_noise)
        .is_err());
    assert!(flow_sample_euler(&mut wrong(3, 2), &noise, &[0, 1], None, 0).is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// DiT's numbers (`scripts/make_dit_fixtures.py`: numpy float64 schedules, PyTorch f32).

#[test]
fn respaced_schedules_and_q_sample_equal_dits() -> Res {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/dit/tiny/reference.safetensors");
    let r = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let base = GaussianDiffusion::linear(1000)?;
    for n in [50usize, 5] {
        let sp = base.respaced(n)?;
        let betas = r[&format!("respace{n}.betas")].to_vec1::<f64>()?;
        assert_eq!(sp.betas.len(), betas.len());
        for (a, b) in sp.betas.iter().zip(&betas) {
            rel_close(*a, *b, 1e-12, &format!("respace{n} betas"));
        }
        let map = r[&format!("respace{n}.timestep_map")].to_vec1::<i64>()?;
        let ours: Vec<i64> = sp.timestep_map.iter().map(|&t| t as i64).collect();
        assert_eq!(ours, map, "respace{n} timestep_map");
    }
    // x_t of DiT's training step: the same f32 operations on f32-cast coefficients.
    let t: Vec<u32> = r["ddpm.t"]
        .to_vec1::<i64>()?
        .iter()
        .map(|&t| t as u32)
        .collect();
    let x_t = base.q_sample(&r["ddpm.x0"], &t, &r["ddpm.noise"])?;
    assert_close(
        &values(&x_t),
        &values(&r["ddpm.x_t"]),
        1e-6,
        1.0,
        "ddpm.x_t",
    );
    Ok(())
}
