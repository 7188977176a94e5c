//! The cross-entropy's softmax over a chunk of f32 logits `(c, V)` on the CPU, one pass per row
//! with flash-ring's vector exponential ([`flash_ring::cpu::exp_shifted`]).
//!
//! The composite it replaces (`broadcast_sub`, `exp`, `sum_keepdim`, `scatter_add`,
//! `broadcast_mul`, `to_dtype`) makes a fresh `(c, V)` tensor per step and calls libm's `expf`
//! one element at a time: for a 32K vocabulary that was a tenth of a bf16 training step. Rows
//! are split over rayon's threads; each row's sum has a fixed order, so results do not depend
//! on the thread count. No gradients: the loss computes its own backward with these.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::strided;

/// A `(c, 1)` or `(c,)` f32 tensor's values.
fn per_row(t: &Tensor, c: usize) -> Result<Vec<f32>> {
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if v.len() != c {
        candle_core::bail!("softmax rows: {} per-row values for {c} rows", v.len());
    }
    Ok(v)
}

/// `(c, 1)` f32: `max_v logits[r, v]` for f32 logits `(c, V)` on the CPU, rows in parallel
/// ([`flash_ring::cpu::row_max`]; candle's `max_keepdim` runs one element at a time on the
/// calling thread: 3.6% of a bf16 `cpl bench eval`). NaN for a row holding a NaN.
pub(crate) fn max_rows(logits: &Tensor) -> Result<Tensor> {
    logits.apply_op1_no_bwd(&MaxRows)
}

/// `(c, 1)` f32: `sum_v exp(logits[r, v] - shift[r])` for f32 logits `(c, V)` on the CPU, NaN
/// where `local_max[r]` (these logits' [`max_rows`]) is NaN. The exponential sends a NaN to 0,
/// and the maxima's all-reduce over vocabulary shards need not keep a NaN, so a NaN logit
/// reaches the loss through this sum (which all-reduces as a sum).
pub(crate) fn sum_exp_rows(logits: &Tensor, shift: &Tensor, local_max: &Tensor) -> Result<Tensor> {
    let (c, _) = logits.dims2()?;
    let op = SumExpRows {
        shift: per_row(shift, c)?,
        nan: per_row(local_max, c)?.iter().map(|m| m.is_nan()).collect(),
    };
    logits.apply_op1_no_bwd(&op)
}

/// `(c, V)` in `dtype` (f32 or bf16): `scale[r] (exp(logits[r, v] - lse[r]) - [v == target[r]])`,
/// the gradient of `sum_r scale[r] (lse[r] - logits[r, target[r]])` with respect to f32 logits
/// `(c, V)` on the CPU. The subtraction is in f32, before the one rounding to `dtype`.
///
/// `logits` must be a fresh tensor that nothing else holds: an f32 result is written over it
/// (one `(c, V)` buffer at the loss's peak instead of two).
pub(crate) fn softmax_grad_rows(
    logits: Tensor,
    lse: &Tensor,
    scale: &Tensor,
    target: Vec<Option<u32>>,
    dtype: DType,
) -> Result<Tensor> {
    let (c, v) = logits.dims2()?;
    if target.len() != c || target.iter().flatten().any(|&t| t as usize >= v) {
        candle_core::bail!("softmax rows: targets do not match {c} rows of {v} logits");
    }
    let op = SoftmaxGradRows {
        lse: per_row(lse, c)?,
        scale: per_row(scale, c)?,
        target,
        dtype,
    };
    if dtype == DType::F32 && logits.is_contiguous() && !logits.is_variable() {
        logits.inplace_op1(&op)?;
        Ok(logits)
    } else {
        logits.apply_op1_no_bwd(&op)
    }
}

/// The rows of an f32 `(c, V)` storage, contiguous.
fn rows<'a>(
    name: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<(std::borrow::Cow<'a, [f32]>, usize, usize)> {
    let (c, v) = l.shape().dims2()?;
    match s {
        CpuStorage::F32(d) => Ok((strided(d, l), c, v)),
        other => candle_core::bail!("{name}: f32 logits expected, got {:?}", other.dtype()),
    }
}

struct MaxRows;

impl CustomOp1 for MaxRows {
    fn name(&self) -> &'static str {
        "cpl-max-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, c, v) = rows(self.name(), s, l)?;
        let mut maxima = vec![f32::NEG_INFINITY; c];
        if v > 0 {
            maxima
                .par_iter_mut()
                .zip(x.par_chunks(v))
                .for_each(|(m, row)| *m = flash_ring::cpu::row_max(row));
        }
        Ok((CpuStorage::F32(maxima), Shape::from((c, 1))))
    }
}

struct SumExpRows {
    shift: Vec<f32>,
    /// Rows that hold a NaN: their sum is NaN.
    nan: Vec<bool>,
}

impl CustomOp1 for SumExpRows {
    fn name(&self) -> &'static str {
        "cpl-sum-exp-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, c, v) = rows(self.name(), s, l)?;
        let mut sums = vec![0f32; c];
        if v > 0 {
            sums.par_iter_mut()
                .zip(x.par_chunks(v))
                .zip(self.shift.par_iter().zip(&self.nan))
                .for_each(|((sum, src), (&m, &nan))| {
                    *sum = if nan {
                        f32::NAN
                    } else {
                        flash_ring::cpu::exp_shifted_sum(src, m)
                    };
                });
        }
        Ok((CpuStorage::F32(sums), Shape::from((c, 1))))
    }
}

const GRAD_OP: &str = "cpl-softmax-grad-rows";

struct SoftmaxGradRows {
    lse: Vec<f32>,
    scale: Vec<f32>,
    target: Vec<Option<u32>>,
    dtype: DType,
}

impl SoftmaxGradRows {
    /// Row `r` of the result in f32, computed in place over a copy of its logits.
    fn row(&self, r: usize, row: &mut [f32]) {
        flash_ring::cpu::exp_shifted(row, self.lse[r]);
        if let Some(t) = self.target[r] {
            row[t as usize] -= 1.0;
        }
        let s = self.scale[r];
        row.iter_mut().for_each(|x| *x *= s);
    }
}

impl InplaceOp1 for SoftmaxGradRows {
    fn name(&self) -> &'static str {
        GRAD_OP
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (_, v) = l.shape().dims2()?;
        match (s, l.contiguous_offsets()) {
            (CpuStorage::F32(d), Some((start, end))) if v > 0 => {
                d[start..end]
                    .par_chunks_mut(v)
                    .enumerate()
                    .for_each(|(r, row)| self.row(r, row));
                Ok(())
            }
            (_, _) if v == 0 => Ok(()),
            (s, _) => candle_core::bail!(
                "{GRAD_OP}: contiguous f32 logits expected, got {:?}",
                s.dtype()
            ),
        }
    }
}

impl CustomOp1 for SoftmaxGradRows {
    fn name(&self) -> &'static str {
        GRAD_OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, c, v) = rows(GRAD_OP, s, l)?;
        let shape = Shape::from((c, v));
        if v == 0 {
            return Ok((CpuStorage::F32(Vec::new()), shape));
        }
        match self.dtype {
            DType::F32 => {
                let mut out = x.into_owned();
                out.par_chunks_mut(v)
                    .enumerate()
                    .for_each(|(r, row)| self.row(r, row));
                Ok((CpuStorage::F32(out), shape))
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; c * v];
                out.par_chunks_mut(v)
                    .zip(x.par_chunks(v))
                    .enumerate()
                    .for_each_init(
                        || vec![0f32; v],
                        |row, (r, (dst, src))| {
                            row.copy_from_slice(src);
                            self.row(r, row);
                            flash_ring::cpu::gemm_bf16::narrow_to_bf16(row, dst);
                        },
                    );
                Ok((CpuStorage::BF16(out), shape))
            }
            other => candle_core::bail!("{GRAD_OP}: no {other:?} output"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Rows of no logits (an empty chunk of a vocabulary): maxima `-inf`, sums 0, no panic.
    #[test]
    fn empty_rows_have_max_minus_inf_and_sum_zero() -> Result<()> {
        let t = Tensor::zeros((3, 0), candle_core::DType::F32, &Device::Cpu)?;
        let max = max_rows(&t)?;
        assert_eq!(max.flatten_all()?.to_vec1::<f32>()?, [f32::NEG_INFINITY; 3]);
        let shift = Tensor::zeros((3, 1), candle_core::DType::F32, &Device::Cpu)?;
        let sum = sum_exp_rows(&t, &shift, &shift)?;
        assert_eq!(sum.flatten_all()?.to_vec1::<f32>()?, [0.0; 3]);
        Ok(())
    }

    /// The row maxima are candle's `max_keepdim(1)`, bit for bit: row lengths off the vector
    /// widths (1, 17, 33, a vocabulary-sized one), every sign, magnitudes up to 1e30, the
    /// maximum anywhere in the row (first, last, a tail element), and a row of `-inf`.
    #[test]
    fn max_rows_are_candles_row_maxima() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(5);
        for v in [1usize, 17, 33, 1000, 32003] {
            let c = 7;
            let mut x: Vec<f32> = (0..c * v)
                .map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-3..30)))
                .collect();
            // Row 1: its maximum first; row 2: last; row 3: all -inf.
            x[v] = 1e31;
            x[3 * v - 1] = 2e31;
            x[3 * v..4 * v].fill(f32::NEG_INFINITY);
            let t = Tensor::from_vec(x, (c, v), &Device::Cpu)?;
            let got: Vec<u32> = max_rows(&t)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let want: Vec<u32> = t
                .max_keepdim(1)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "rows of {v}");
        }
        Ok(())
    }
}
