//! A bias added to every row, with the bias's gradient summed in f32: a custom op for bf16 and
//! f16 on the CPU, candle's broadcast addition otherwise.
//!
//! Why a kernel: the bias's gradient is the upstream gradient summed over every token, and
//! crates.io's candle-core (0.11) sums bf16 and f16 in their own dtype, so that a bf16 sum stops
//! growing once it is about 256 times its terms (53% off over 4096 tokens,
//! `docs/accuracy.md`). This workspace's vendored candle-core sums them in f32 (patch `sum-f32`),
//! but a program that uses the library with crates.io's candle-core does not get that patch.
//! This op sums in f32 itself, in row order from zero, rounded once: the bits the patched
//! candle gives, whichever candle a program builds with.
//!
//! Rounding: forward `y + b` in f32, rounded once to the dtype (candle's broadcast addition,
//! bit for bit); backward: `y`'s gradient is the upstream gradient itself, `b`'s the column sums
//! of it as above. f32 tensors take candle's broadcast addition itself: every candle-core sums
//! f32 in row order, the same bits, and its addition is faster.

use super::{all_cpu, check_float, dispatch_float, strided, widened, Elem};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

const OP: &str = "bias_add";

/// `y + b` for `y` `(.., n)` and `b` `(n)` of one dtype (f32, bf16, f16), differentiable with
/// respect to both (see the module docs for the bias's gradient).
pub fn bias_add(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_float(OP, "y", y.dtype())?;
    if b.dtype() != y.dtype() {
        bail!(
            "{OP}: y and b must have one dtype, got {:?} and {:?}",
            y.dtype(),
            b.dtype()
        );
    }
    let n = y.dim(D::Minus1)?;
    if b.dims() != [n] {
        bail!(
            "{OP}: b must have shape [{n}] to match y {:?}, got {:?}",
            y.shape(),
            b.shape()
        );
    }
    if all_cpu(&[y, b]) && y.dtype() != DType::F32 {
        y.apply_op2(b, BiasAdd)
    } else {
        // f32: every candle-core sums f32 in row order already (the bits the op would give), and
        // its broadcast addition is faster than this op's on the CPU.
        y.broadcast_add(b)
    }
}

struct BiasAdd;

fn fwd<T: Elem>(
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    let y = strided(T::cpu_storage_as_slice(s1)?, l1);
    let b = widened::<T>(s2, l2)?;
    let n = b.len();
    let len = y.len();
    let mut out: Vec<T> = Vec::with_capacity(len);
    if n > 0 && len > 0 {
        let add = |o: &mut [std::mem::MaybeUninit<T>], ys: &[T]| {
            for (or, yr) in o.chunks_exact_mut(n).zip(ys.chunks_exact(n)) {
                for ((o, y), b) in or.iter_mut().zip(yr).zip(&b) {
                    o.write(T::from_f32(y.to_f32() + b));
                }
            }
        };
        let spare = &mut out.spare_capacity_mut()[..len];
        if len < PARALLEL_FROM {
            add(spare, &y);
        } else {
            let rows_per_task = (TASK / n).max(1);
            spare
                .par_chunks_mut(rows_per_task * n)
                .zip(y.par_chunks(rows_per_task * n))
                .for_each(|(o, ys)| add(o, ys));
        }
        // SAFETY: `len` is a whole number of rows of `n` (y's last dim is n), and every row of
        // the spare capacity was written above.
        unsafe { out.set_len(len) };
    }
    Ok((T::to_cpu_storage_owned(out), l1.shape().clone()))
}

/// Elements from which the op's passes run on rayon's threads (below, waking them costs more
/// than the pass: on a 2-core Zen 4 a 2048 x 384 addition took 0.30 ms split over them, 0.07 ms
/// on the calling thread).
const PARALLEL_FROM: usize = 1 << 22;
/// Elements per parallel task.
const TASK: usize = 1 << 18;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "cpl-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s1, fwd((s1, l1), (s2, l2)))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = grad.apply_op1_no_bwd(&ColumnSums)?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// The column sums `(n)` of a `(.., n)` tensor, in f32 in row order from zero, rounded once to
/// its dtype.
struct ColumnSums;

/// Columns per parallel task of [`ColumnSums`] (each task walks every row over its columns).
const COLUMNS_PER_TASK: usize = 256;

fn column_sums<T: Elem>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let g = strided(T::cpu_storage_as_slice(s)?, l);
    let n = l.dims().last().copied().unwrap_or(1);
    let rows = g.len().checked_div(n).unwrap_or(0);
    let mut out = vec![T::from_f32(0.0); n];
    let sum = |c0: usize, o: &mut [T]| {
        let mut acc = vec![0.0f32; o.len()];
        for r in 0..rows {
            let gr = &g[r * n + c0..][..o.len()];
            acc.iter_mut().zip(gr).for_each(|(a, x)| *a += x.to_f32());
        }
        o.iter_mut()
            .zip(&acc)
            .for_each(|(o, a)| *o = T::from_f32(*a));
    };
    if g.len() < PARALLEL_FROM {
        sum(0, &mut out);
    } else {
        out.par_chunks_mut(COLUMNS_PER_TASK)
            .enumerate()
            .for_each(|(c, o)| sum(c * COLUMNS_PER_TASK, o));
    }
    Ok((T::to_cpu_storage_owned(out), Shape::from(n)))
}

impl candle_core::CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "cpl-bias-add-bwd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(self.name(), s, column_sums(s, l))
    }
}
