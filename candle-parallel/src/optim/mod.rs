//! Training optimizer: AdamW with fp32 master weights ([`AdamW`]), global gradient-norm clipping
//! across tensor-parallel shards ([`clip_grad_norm`]), learning-rate schedules ([`LrSchedule`])
//! and ZeRO sharding of optimizer states, gradients and parameters ([`zero`]); [`grads`]
//! collects a model's gradients, accumulates them over micro-batches and sums them over the
//! ranks that share each parameter.
//!
//! candle-nn's `AdamW` keeps its moments in the parameter dtype, has no clipping, no schedule and
//! no state save/load; this module provides all four. One training step is:
//!
//! ```text
//! let lr = schedule.lr(opt.step_count());
//! let norm = clip_grad_norm(&mut grads, max_norm, &shard_group)?;
//! opt.step(&grads, lr)?;
//! ```

pub mod adamw;
pub mod grads;
pub mod schedule;
pub mod zero;

use candle_core::{DType, Tensor, Var};

pub use adamw::{AdamW, AdamWConfig};
pub use grads::{accumulate, collect_gradients, reduce_gradients};
pub use schedule::{Decay, LrSchedule};
pub use zero::{ExpertZeroGroups, FlatShard, ZeroGroups, ZeroStage};

use rayon::prelude::*;

use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};
use crate::ops::{dispatch_float, Elem};

/// One trainable parameter as the optimizer sees it.
#[derive(Debug, Clone)]
pub struct OptimParam {
    pub name: String,
    pub var: Var,
    pub weight_decay: bool,
}

impl OptimParam {
    /// A parameter whose weight decay follows [`decays`].
    pub fn new(name: impl Into<String>, var: Var) -> Self {
        let name = name.into();
        let weight_decay = decays(&name, var.dims());
        Self {
            name,
            var,
            weight_decay,
        }
    }
}

/// Which parameters get weight decay: tensors of two or more dimensions (matmul weights,
/// embeddings), except a tensor named `bias` or `*.bias`. One-dimensional tensors (norm weights,
/// biases) and scalars get none.
pub fn decays(name: &str, shape: &[usize]) -> bool {
    let bias = name == "bias" || name.ends_with(".bias");
    shape.len() >= 2 && !bias
}

/// Global gradient norm over the ranks: `sqrt(sum over params of sum(g^2))`.
///
/// A parameter for which `sharded(name)` returns a communicator is split across its ranks
/// (tensor-parallel slices): its local squared sum is all-reduced (Sum) over that communicator.
/// Any other parameter is replicated and counted once. Squares are summed in f64. Gradients are
/// visited in name order, so every rank issues its all-reduces in the same sequence whatever the
/// order of `grads`; every rank of each shard group must call this with the same sharded names.
/// Duplicate names are an error.
pub fn global_grad_norm(
    grads: &[(String, Tensor)],
    sharded: &dyn Fn(&str) -> Option<Comm>,
) -> Result<f64> {
    global_grad_norm_staged(grads, sharded, None)
}

/// How the pipeline stages of a model share a global gradient norm: each stage holds its own
/// parameters, so the squared sums add over `comm` (the `pp` group); a parameter that several
/// stages hold (a tied embedding on the first and last stage) counts only where
/// `counted(name)` is true.
pub struct StageNorm<'a> {
    pub comm: &'a Comm,
    pub counted: &'a dyn Fn(&str) -> bool,
}

/// [`global_grad_norm`] over pipeline stages (see [`StageNorm`]); `None` is one stage.
/// Collective over each shard group and, with stages, over their communicator.
pub fn global_grad_norm_staged(
    grads: &[(String, Tensor)],
    sharded: &dyn Fn(&str) -> Option<Comm>,
    stages: Option<&StageNorm>,
) -> Result<f64> {
    let mut order: Vec<&(String, Tensor)> = grads.iter().collect();
    order.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = order.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::invalid(
            "global_grad_norm",
            format!("gradient of `{}` is given twice", w[0].0),
        ));
    }
    let mut total = 0.0f64;
    for (name, g) in order {
        let sq = match sharded(name) {
            Some(comm) => comm
                .all_reduce(&sum_of_squares(g)?.reshape(1)?, ReduceOp::Sum)?
                .to_device(&candle_core::Device::Cpu)?
                .to_vec1::<f64>()?[0],
            None => sum_of_squares(g)?.to_scalar::<f64>()?,
        };
        if stages.is_none_or(|s| (s.counted)(name)) {
            total += sq;
        }
    }
    if let Some(s) = stages.filter(|s| s.comm.size() > 1) {
        total = s
            .comm
            .all_reduce(
                &Tensor::new(&[total], &candle_core::Device::Cpu)?,
                ReduceOp::Sum,
            )?
            .to_vec1::<f64>()?[0];
    }
    Ok(total.sqrt())
}

/// Elements per parallel block of the optimizer's CPU paths ([`sum_of_squares`], [`scaled`],
/// AdamW's conversions): a fixed size, so that the blocks, and the order [`sum_of_squares`]
/// adds their sums in, never depend on the thread count.
pub(crate) const BLOCK: usize = 1 << 15;

/// `f(storage, (start, end))` for a contiguous f32, bf16 or f16 CPU tensor (its elements are
/// `start..end` of the storage), `None` for any other tensor (the callers' candle path).
pub(crate) fn cpu_floats<R>(
    t: &Tensor,
    f: impl FnOnce(&candle_core::CpuStorage, (usize, usize)) -> candle_core::Result<R>,
) -> Result<Option<R>> {
    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(s), Some(range)) => Ok(Some(f(s, range)?)),
        _ => Ok(None),
    }
}

/// The elements of a contiguous f32, bf16 or f16 CPU tensor as f32, widened in parallel (exactly:
/// every bf16 and f16 value is an f32); `None` for any other tensor. candle's `to_dtype` widens
/// on the calling thread, one element at a time: the gradients of a bf16 MoE model's 111M
/// parameters took about 1% of its training step so.
pub(crate) fn widened_in_parallel(t: &Tensor) -> Result<Option<Vec<f32>>> {
    fn widened<T: Elem>(
        s: &candle_core::CpuStorage,
        (a, b): (usize, usize),
    ) -> candle_core::Result<Vec<f32>> {
        Ok(T::cpu_storage_as_slice(s)?[a..b]
            .par_iter()
            .with_min_len(BLOCK)
            .map(|&x| x.to_f32())
            .collect())
    }
    cpu_floats(t, |s, range| {
        dispatch_float!("to_f32", s, widened(s, range))
    })
}

/// `t` in f32 ([`widened_in_parallel`] where it applies, candle's `to_dtype` elsewhere; `t`
/// itself when it is f32 already): the same values either way.
pub fn to_f32(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t.clone());
    }
    match widened_in_parallel(t)? {
        Some(v) => Ok(Tensor::from_vec(v, t.shape(), t.device())?),
        None => Ok(t.to_dtype(DType::F32)?),
    }
}

/// `sum(g^2)` in f64 as a scalar f64 tensor on `g`'s device.
///
/// A contiguous f32, bf16 or f16 CPU tensor is read in place: its blocks of [`BLOCK`] elements
/// are summed in parallel, each in 8 interleaved f64 lanes (the lanes added in order), then the
/// block sums in order, so the result is the same bits on any number of threads. Each square is
/// exact in f64. Candle's `to_dtype(F64).sqr().sum_all()` (the path of every other tensor)
/// writes two f64 copies of the gradient and sums on one thread: for the 111M parameters of the
/// MoE benchmark model it took about a tenth of a second per step, with the other cores idle.
fn sum_of_squares(g: &Tensor) -> Result<Tensor> {
    fn blocks<T: Elem>(
        s: &candle_core::CpuStorage,
        (a, b): (usize, usize),
    ) -> candle_core::Result<f64> {
        let partial: Vec<f64> = T::cpu_storage_as_slice(s)?[a..b]
            .par_chunks(BLOCK)
            .map(|block| {
                let mut lanes = [0f64; 8];
                let mut eights = block.chunks_exact(8);
                for e in &mut eights {
                    for (l, &x) in lanes.iter_mut().zip(e) {
                        let x = f64::from(x.to_f32());
                        *l += x * x;
                    }
                }
                for (l, &x) in lanes.iter_mut().zip(eights.remainder()) {
                    let x = f64::from(x.to_f32());
                    *l += x * x;
                }
                lanes.iter().sum::<f64>()
            })
            .collect();
        Ok(partial.iter().sum())
    }
    match cpu_floats(g, |s, range| {
        dispatch_float!("sum_of_squares", s, blocks(s, range))
    })? {
        Some(sum) => Ok(Tensor::new(sum, g.device())?),
        None => Ok(g.to_dtype(DType::F64)?.sqr()?.sum_all()?),
    }
}

/// Scales `grads` in place so that their global norm ([`global_grad_norm`]) is at most
/// `max_norm`, with `torch.nn.utils.clip_grad_norm_` semantics: `coef = max_norm / (norm + 1e-6)`,
/// clamped to 1. Returns the norm before clipping. bf16/f16 gradients are scaled in f32 and cast
/// back. If the norm is not finite (inf or NaN gradients), the gradients are left unchanged and
/// the norm is returned: the caller should skip the step (torch would scale them to NaN/0).
pub fn clip_grad_norm(
    grads: &mut [(String, Tensor)],
    max_norm: f64,
    sharded: &dyn Fn(&str) -> Option<Comm>,
) -> Result<f64> {
    clip_grad_norm_staged(grads, max_norm, sharded, None)
}

/// [`clip_grad_norm`] with the norm over pipeline stages ([`global_grad_norm_staged`]).
pub fn clip_grad_norm_staged(
    grads: &mut [(String, Tensor)],
    max_norm: f64,
    sharded: &dyn Fn(&str) -> Option<Comm>,
    stages: Option<&StageNorm>,
) -> Result<f64> {
    check_max_norm(max_norm)?;
    let norm = global_grad_norm_staged(grads, sharded, stages)?;
    if let Some(coef) = clip_coefficient(norm, max_norm)? {
        for (_, g) in grads.iter_mut() {
            *g = scaled(g, coef)?;
        }
    }
    Ok(norm)
}

/// The factor [`clip_grad_norm`] multiplies the gradients by for a global norm `norm`:
/// `max_norm / (norm + 1e-6)` where that is below 1, `None` where the gradients stay as they are
/// (that factor at least 1, or a norm that is not finite). Hand it to [`AdamW::step_clipped`] to
/// clip and step without writing the scaled gradients. An error when `max_norm` is negative
/// or not finite.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Result<Option<f64>> {
    check_max_norm(max_norm)?;
    let coef = max_norm / (norm + 1e-6);
    Ok((norm.is_finite() && coef < 1.0).then_some(coef))
}

fn check_max_norm(max_norm: f64) -> Result<()> {
    if !(max_norm.is_finite() && max_norm >= 0.0) {
        return Err(Error::invalid(
            "clip_grad_norm",
            format!("max_norm must be finite and >= 0, got {max_norm}"),
        ));
    }
    Ok(())
}

/// `g * coef` as a new tensor: f32 gradients as candle's `affine(coef, 0.0)` computes them,
/// bf16/f16 ones the same in f32 then rounded to their dtype. A contiguous CPU gradient is
/// scaled in parallel blocks (candle's element-wise ops run on the calling thread), with the
/// same bits.
pub(crate) fn scaled(g: &Tensor, coef: f64) -> Result<Tensor> {
    fn scale<T: Elem>(
        s: &candle_core::CpuStorage,
        (a, b): (usize, usize),
        mul: f32,
        g: &Tensor,
    ) -> candle_core::Result<Tensor> {
        // candle's affine computes `x * mul + add` in f32; `+ 0.0` turns a -0 into +0.
        let out: Vec<T> = T::cpu_storage_as_slice(s)?[a..b]
            .par_iter()
            .with_min_len(BLOCK)
            .map(|&x| T::from_f32(x.to_f32() * mul + 0.0))
            .collect();
        Tensor::from_vec(out, g.shape(), g.device())
    }
    let mul = coef as f32;
    match cpu_floats(g, |s, range| {
        dispatch_float!("clip_grad_norm", s, scale(s, range, mul, g))
    })? {
        Some(t) => Ok(t),
        None => Ok(match g.dtype() {
            DType::BF16 | DType::F16 => g
                .to_dtype(DType::F32)?
                .affine(coef, 0.0)?
                .to_dtype(g.dtype())?,
            _ => g.affine(coef, 0.0)?,
        }),
    }
}
