//! Reference attention, for tests and as the benchmark's baseline.
//!
//! - [`naive_attention`]: plain candle ops (differentiable through candle's autograd),
//!   materialises the full `seq_q x seq_k` score matrix.
//! - [`attention_f64`] / [`attention_bwd_f64`]: straightforward float64 loops on flat slices,
//!   an oracle independent of candle and of the flash kernels.
//!
//! Both follow the crate's conventions: a row with no allowed key has `out = 0`, `lse = -inf`
//! and zero gradients; a logit soft-cap `c` ([`AttnSpec::softcap`]) turns the scaled logit `s`
//! into `c tanh(s / c)` before the mask.

use candle_core::{DType, Device, Tensor, D};

use crate::error::{Error, Result};
use crate::spec::AttnSpec;

/// Allowed-mask of a spec as a `seq_q x seq_k` 0/1 f32 tensor, plus per-row "any allowed".
fn mask_tensors(spec: &AttnSpec, sq: usize, sk: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    spec.validate(sq, sk)?;
    let mut add = vec![0.0f32; sq * sk];
    let mut any = vec![0.0f32; sq];
    for i in 0..sq {
        let pq = spec.q_pos.get(i);
        for j in 0..sk {
            if spec.allowed(pq, spec.k_pos.get(j)) {
                any[i] = 1.0;
            } else {
                add[i * sk + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok((
        Tensor::from_vec(add, (sq, sk), dev)?,
        Tensor::from_vec(any, (sq, 1), dev)?,
    ))
}

/// Naive attention in candle ops; same contract as [`crate::flash_attention`] (f16 inputs are
/// computed in f32 and converted back). Differentiable.
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec) -> Result<Tensor> {
    Ok(naive_attention_with_lse(q, k, v, spec)?.0)
}

/// [`naive_attention`] also returning lse (batch, q_heads, seq_q) f32.
pub fn naive_attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
) -> Result<(Tensor, Tensor)> {
    let in_dtype = q.dtype();
    let (b, sq, hq, d) = q.dims4()?;
    let (kb, sk, hkv, kd) = k.dims4()?;
    if kb != b || kd != d || v.dims() != k.dims() {
        return Err(Error::Shape {
            tensor: "k/v",
            got: k.dims().to_vec(),
            expected: format!("({b}, seq_k, kv_heads, {d}), v like k"),
        });
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(Error::Heads {
            q_heads: hq,
            kv_heads: hkv,
        });
    }
    let work = if in_dtype == DType::F16 {
        DType::F32
    } else {
        in_dtype
    };
    let g = hq / hkv;
    let qt = q.to_dtype(work)?.transpose(1, 2)?.contiguous()?; // (b, hq, sq, d)
    let expand = |x: &Tensor| -> Result<Tensor> {
        let x = x.to_dtype(work)?.transpose(1, 2)?.contiguous()?; // (b, hkv, sk, d)
        Ok(x.unsqueeze(2)?
            .broadcast_as((b, hkv, g, sk, d))?
            .contiguous()?
            .reshape((b, hq, sk, d))?)
    };
    let kt = expand(k)?;
    let vt = expand(v)?;
    let (add, any) = mask_tensors(spec, sq, sk, q.device())?;
    let add = add.to_dtype(work)?;
    let scores = (qt.matmul(&kt.t()?)? * spec.scale as f64)?; // (b, hq, sq, sk)
    let scores = match spec.softcap {
        // Capped before the mask (differentiable: candle's tanh has a backward).
        Some(c) => ((scores / c as f64)?.tanh()? * c as f64)?,
        None => scores,
    };
    let s = scores.broadcast_add(&add)?;
    // Shift by the (detached) row max; rows with nothing allowed shift by a finite -1e30 so
    // that exp gives exactly 0 and no NaN appears.
    let m = s.max_keepdim(D::Minus1)?.detach().maximum(-1e30)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let any = any.to_dtype(work)?;
    // sum + (1 - any): 1 on dead rows (where e == 0), unchanged elsewhere.
    let denom = sum.broadcast_add(&any.affine(-1.0, 1.0)?)?;
    let p = e.broadcast_div(&denom)?;
    let out = p
        .matmul(&vt)?
        .transpose(1, 2)?
        .contiguous()?
        .to_dtype(in_dtype)?;
    let lse = (sum.to_dtype(DType::F32)?.log()? + m.to_dtype(DType::F32)?)?
        .squeeze(D::Minus1)?
        .detach();
    Ok((out, lse))
}

/// Sizes of a reference call; tensors are flat, contiguous (batch, seq, heads, head_dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefShape {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
}

impl RefShape {
    fn qi(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.sq + s) * self.hq + h) * self.d
    }
    fn ki(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.sk + s) * self.hkv + h) * self.d
    }
}

/// Probabilities of one (batch, q head) in f64: `p[i * sk + j]`, plus lse per row and the
/// derivative of the (soft-capped) logit with respect to the scaled one, `1 - tanh^2(s / c)`
/// (1 without a cap; 0 where masked).
fn probs(
    q: &[f64],
    k: &[f64],
    sh: &RefShape,
    spec: &AttnSpec,
    b: usize,
    h: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let kh = h / (sh.hq / sh.hkv);
    let mut p = vec![0.0f64; sh.sq * sh.sk];
    let mut dcap = vec![0.0f64; sh.sq * sh.sk];
    let mut lse = vec![f64::NEG_INFINITY; sh.sq];
    for i in 0..sh.sq {
        let qr = &q[sh.qi(b, i, h)..sh.qi(b, i, h) + sh.d];
        let row = &mut p[i * sh.sk..(i + 1) * sh.sk];
        let drow = &mut dcap[i * sh.sk..(i + 1) * sh.sk];
        let mut mx = f64::NEG_INFINITY;
        for (j, x) in row.iter_mut().enumerate() {
            if spec.allowed(spec.q_pos.get(i), spec.k_pos.get(j)) {
                let kr = &k[sh.ki(b, j, kh)..sh.ki(b, j, kh) + sh.d];
                *x = spec.scale as f64 * qr.iter().zip(kr).map(|(a, c)| a * c).sum::<f64>();
                drow[j] = 1.0;
                if let Some(c) = spec.softcap {
                    let t = (*x / c as f64).tanh();
                    *x = c as f64 * t;
                    drow[j] = 1.0 - t * t;
                }
                mx = mx.max(*x);
            } else {
                *x = f64::NEG_INFINITY;
            }
        }
        if mx == f64::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let mut sum = 0.0;
        for x in row.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        row.iter_mut().for_each(|x| *x /= sum);
        lse[i] = mx + sum.ln();
    }
    (p, lse, dcap)
}

/// Forward in f64: returns `out` (b, sq, hq, d) and `lse` (b, hq, sq).
pub fn attention_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    sh: RefShape,
    spec: &AttnSpec,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; sh.b * sh.sq * sh.hq * sh.d];
    let mut lse = vec![0.0; sh.b * sh.hq * sh.sq];
    let g = sh.hq / sh.hkv;
    for b in 0..sh.b {
        for h in 0..sh.hq {
            let (p, l, _) = probs(q, k, &sh, spec, b, h);
            lse[(b * sh.hq + h) * sh.sq..(b * sh.hq + h + 1) * sh.sq].copy_from_slice(&l);
            for i in 0..sh.sq {
                let o = sh.qi(b, i, h);
                for j in 0..sh.sk {
                    let pij = p[i * sh.sk + j];
                    if pij != 0.0 {
                        let vr = sh.ki(b, j, h / g);
                        for t in 0..sh.d {
                            out[o + t] += pij * v[vr + t];
                        }
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Gradients in f64 of `sum(out * dout)`: returns `(dq, dk, dv)` shaped like q, k, v.
pub fn attention_bwd_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    sh: RefShape,
    spec: &AttnSpec,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let g = sh.hq / sh.hkv;
    let sc = spec.scale as f64;
    for b in 0..sh.b {
        for h in 0..sh.hq {
            let kh = h / g;
            let (p, _, dcap) = probs(q, k, &sh, spec, b, h);
            for i in 0..sh.sq {
                let qo = sh.qi(b, i, h);
                let dor = &dout[qo..qo + sh.d];
                // dP_ij = dO_i . V_j ; D_i = sum_j P_ij dP_ij ; dS = P (dP - D) (1 - tanh^2)
                let dp: Vec<f64> = (0..sh.sk)
                    .map(|j| {
                        let vo = sh.ki(b, j, kh);
                        dor.iter().zip(&v[vo..vo + sh.d]).map(|(a, c)| a * c).sum()
                    })
                    .collect();
                let prow = &p[i * sh.sk..(i + 1) * sh.sk];
                let dd: f64 = prow.iter().zip(&dp).map(|(a, c)| a * c).sum();
                for j in 0..sh.sk {
                    let pij = prow[j];
                    if pij == 0.0 {
                        continue;
                    }
                    let ds = pij * (dp[j] - dd) * dcap[i * sh.sk + j];
                    let ko = sh.ki(b, j, kh);
                    for t in 0..sh.d {
                        dv[ko + t] += pij * dor[t];
                        dq[qo + t] += sc * ds * k[ko + t];
                        dk[ko + t] += sc * ds * q[qo + t];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
