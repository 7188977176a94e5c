//! Merging partial attention results computed over disjoint key sets.
//!
//! With `m = max(lse_a, lse_b)`: `lse = m + ln(e^(lse_a - m) + e^(lse_b - m))` and
//! `out = w_a * out_a + w_b * out_b` with `w_x = e^(lse_x - lse)`. No exponential of a positive
//! number is taken, so nothing overflows; a partial with `lse = -inf` has weight exactly 0 (its
//! `out` is ignored, even if it is not finite), and two `-inf` partials give `lse = -inf`,
//! `out = 0`. A NaN `lse` (a partial whose softmax saw a NaN score) makes the merged row's `lse`
//! and `out` NaN, as one softmax over all the keys would be.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::cpu::View;
use crate::error::{Error, Result};

/// Merges `(out_a, lse_a)` and `(out_b, lse_b)`.
///
/// `out_*`: (batch, seq, heads, head_dim), any float dtype, any strides; `lse_*`: (batch, heads,
/// seq) f32. Returns `out` in **f32** (so repeated merges accumulate in f32; convert once at the
/// end) and `lse` in f32, both contiguous.
pub fn merge(
    out_a: &Tensor,
    lse_a: &Tensor,
    out_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dims = check(out_a, lse_a, out_b, lse_b)?;
    if out_a.device().is_cpu() {
        merge_cpu(out_a, lse_a, out_b, lse_b, dims)
    } else {
        merge_tensor_ops(out_a, lse_a, out_b, lse_b)
    }
}

fn check(out_a: &Tensor, lse_a: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<[usize; 4]> {
    let d = out_a.dims();
    if d.len() != 4 {
        return Err(Error::Rank {
            tensor: "out_a",
            expected: 4,
            layout: "batch, seq, heads, head_dim",
            got: d.to_vec(),
        });
    }
    if out_b.dims() != d {
        return Err(Error::Shape {
            tensor: "out_b",
            got: out_b.dims().to_vec(),
            expected: format!("{d:?} (the shape of out_a)"),
        });
    }
    let want = [d[0], d[2], d[1]];
    for (name, l) in [("lse_a", lse_a), ("lse_b", lse_b)] {
        if l.dims() != want {
            return Err(Error::Shape {
                tensor: name,
                got: l.dims().to_vec(),
                expected: format!("{want:?} (batch, heads, seq)"),
            });
        }
        if l.dtype() != DType::F32 {
            return Err(Error::DType {
                tensor: name,
                got: l.dtype(),
                expected: "f32",
            });
        }
    }
    for (name, t) in [("out_b", out_b), ("lse_a", lse_a), ("lse_b", lse_b)] {
        if !t.device().same_device(out_a.device()) {
            return Err(Error::DeviceMismatch { tensor: name });
        }
    }
    Ok([d[0], d[1], d[2], d[3]])
}

/// Weights `(w_a, w_b)` and merged lse of one row, -inf safe.
#[inline]
pub(crate) fn merge_weights(la: f32, lb: f32) -> (f32, f32, f32) {
    if la.is_nan() || lb.is_nan() {
        // A partial whose softmax saw a NaN score: the merged row is NaN.
        return (f32::NAN, f32::NAN, f32::NAN);
    }
    let m = la.max(lb);
    if m == f32::NEG_INFINITY {
        return (0.0, 0.0, f32::NEG_INFINITY);
    }
    let ea = (la - m).exp();
    let eb = (lb - m).exp();
    let s = ea + eb;
    (ea / s, eb / s, m + s.ln())
}

fn merge_cpu(
    out_a: &Tensor,
    lse_a: &Tensor,
    out_b: &Tensor,
    lse_b: &Tensor,
    [b, s, h, d]: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    let la: Vec<f32> = lse_a.flatten_all()?.to_vec1()?;
    let lb: Vec<f32> = lse_b.flatten_all()?.to_vec1()?;
    let (ga, la_) = out_a.storage_and_layout();
    let (gb, lb_) = out_b.storage_and_layout();
    let va = View::new("out_a", &ga, la_)?;
    let vb = View::new("out_b", &gb, lb_)?;
    let mut out = vec![0.0f32; b * s * h * d];
    let mut lse = vec![0.0f32; b * h * s];
    let weights: Vec<(f32, f32, f32)> = la
        .iter()
        .zip(&lb)
        .map(|(&x, &y)| merge_weights(x, y))
        .collect();
    for (i, w) in weights.iter().enumerate() {
        lse[i] = w.2;
    }
    out.par_chunks_mut(h * d.max(1))
        .enumerate()
        .for_each(|(row, o)| {
            let (bi, si) = (row / s, row % s);
            let mut tb = vec![0.0f32; d];
            for hi in 0..h {
                let (wa, wb, _) = weights[(bi * h + hi) * s + si];
                let dst = &mut o[hi * d..(hi + 1) * d];
                if wa != 0.0 {
                    va.read(bi, si, hi, dst, wa);
                }
                if wb != 0.0 {
                    vb.read(bi, si, hi, &mut tb, wb);
                    dst.iter_mut().zip(&tb).for_each(|(x, y)| *x += y);
                }
            }
        });
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(out, (b, s, h, d), &dev)?,
        Tensor::from_vec(lse, (b, h, s), &dev)?,
    ))
}

/// The same merge in plain candle ops (any device). Used off-CPU; tested on CPU.
pub(crate) fn merge_tensor_ops(
    out_a: &Tensor,
    lse_a: &Tensor,
    out_b: &Tensor,
    lse_b: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let m = lse_a.maximum(lse_b)?;
    // Rows where both are -inf: shift by 0 instead, so both weights are e^-inf = 0.
    let dead = m.eq(f64::NEG_INFINITY)?;
    let zeros = m.zeros_like()?;
    let m_safe = dead.where_cond(&zeros, &m)?;
    let ea = lse_a.sub(&m_safe)?.exp()?;
    let eb = lse_b.sub(&m_safe)?.exp()?;
    let s = (&ea + &eb)?;
    let lse = (s.log()? + &m_safe)?;
    let ones = s.ones_like()?;
    let s_safe = dead.where_cond(&ones, &s)?;
    // (b, h, s) -> (b, s, h, 1) to broadcast over head_dim.
    let to_out = |w: Tensor| -> Result<Tensor> {
        Ok(w.broadcast_div(&s_safe)?.transpose(1, 2)?.unsqueeze(3)?)
    };
    let wa = to_out(ea)?;
    let wb = to_out(eb)?;
    // A zero weight must ignore its partial, even a non-finite one.
    let oa = out_a.to_dtype(DType::F32)?;
    let ob = out_b.to_dtype(DType::F32)?;
    let za = wa.eq(0.0)?.broadcast_as(oa.shape())?;
    let zb = wb.eq(0.0)?.broadcast_as(ob.shape())?;
    let zo = oa.zeros_like()?;
    let ta = za.where_cond(&zo, &oa.broadcast_mul(&wa)?)?;
    let tb = zb.where_cond(&zo, &ob.broadcast_mul(&wb)?)?;
    Ok(((ta + tb)?.contiguous()?, lse.contiguous()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_tensor_ops_paths_agree() {
        let dev = Device::Cpu;
        let (b, s, h, d) = (2, 5, 3, 4);
        let oa = Tensor::arange(0f32, (b * s * h * d) as f32, &dev)
            .and_then(|t| t.reshape((b, s, h, d)))
            .and_then(|t| t.sin())
            .unwrap();
        let ob = oa.cos().unwrap();
        let mut la: Vec<f32> = (0..b * h * s)
            .map(|i| (i as f32 * 0.37).sin() * 30.0)
            .collect();
        let mut lb: Vec<f32> = (0..b * h * s)
            .map(|i| (i as f32 * 0.11).cos() * 30.0)
            .collect();
        la[0] = f32::NEG_INFINITY;
        lb[1] = f32::NEG_INFINITY;
        la[2] = f32::NEG_INFINITY;
        lb[2] = f32::NEG_INFINITY;
        la[3] = 80.0; // large values must not overflow
        lb[3] = 79.0;
        let la = Tensor::from_vec(la, (b, h, s), &dev).unwrap();
        let lb = Tensor::from_vec(lb, (b, h, s), &dev).unwrap();
        // Non-contiguous out_b.
        let ob_t = ob
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let (o1, l1) = merge(&oa, &la, &ob_t, &lb).unwrap();
        let (o2, l2) = merge_tensor_ops(&oa, &la, &ob_t, &lb).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in v(&o1).iter().zip(v(&o2)) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
        }
        for (x, y) in v(&l1).iter().zip(v(&l2)) {
            assert!(x == &y || (x - y).abs() <= 1e-5 * y.abs(), "{x} vs {y}");
        }
        assert!(v(&o1).iter().all(|x| x.is_finite()));
        assert_eq!(v(&l1)[2], f32::NEG_INFINITY);
        // Row (b 0, h 0, s 2) has both partials -inf: its out is 0.
        assert!(v(&o1)[2 * h * d..2 * h * d + d].iter().all(|&x| x == 0.0));
    }

    /// A NaN lse on either side (or both, or against -inf) makes the merged row NaN on both
    /// paths; the other rows keep their values.
    #[test]
    fn a_nan_partial_makes_the_merged_row_nan_on_both_paths() {
        let dev = Device::Cpu;
        let ones = Tensor::ones((1, 5, 1, 2), DType::F32, &dev).unwrap();
        let n = f32::NAN;
        let ninf = f32::NEG_INFINITY;
        let la = Tensor::new(&[[[n, 0.0, n, n, 0.0]]], &dev).unwrap();
        let lb = Tensor::new(&[[[0.0, n, n, ninf, 1.0]]], &dev).unwrap();
        for (o, l) in [
            merge(&ones, &la, &ones, &lb).unwrap(),
            merge_tensor_ops(&ones, &la, &ones, &lb).unwrap(),
        ] {
            let o: Vec<f32> = o.flatten_all().unwrap().to_vec1().unwrap();
            let l: Vec<f32> = l.flatten_all().unwrap().to_vec1().unwrap();
            assert!(l[..4].iter().all(|x| x.is_nan()) && o[..8].iter().all(|x| x.is_nan()));
            assert!((l[4] - (1.0 + (1.0 + (-1.0f32).exp()).ln())).abs() < 1e-6);
            assert!(o[8..].iter().all(|&x| (x - 1.0).abs() < 1e-6));
        }
    }
}
