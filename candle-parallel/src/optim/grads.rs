//! Gradients of a model's parameters after `backward()`, reduced over the ranks that share them.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::nn::{ParallelCtx, Param};

fn invalid(msg: String) -> Error {
    Error::invalid("gradients", msg)
}

/// Every parameter's gradient from `grads` (in name order, the order every rank agrees on).
/// Errors naming a trainable parameter that received no gradient.
pub fn collect_gradients(params: &[Param], grads: &GradStore) -> Result<Vec<(String, Tensor)>> {
    let mut sorted: Vec<&Param> = params.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted
        .into_iter()
        .map(|p| {
            let var = p.var.as_ref().ok_or_else(|| {
                invalid(format!(
                    "parameter `{}` was loaded as not trainable",
                    p.name
                ))
            })?;
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| invalid(format!("parameter `{}` received no gradient", p.name)))?;
            Ok((p.name.clone(), g.clone()))
        })
        .collect()
}

/// Adds `more` into `acc` in f32 (gradient accumulation over micro-batches); `acc` empty starts it.
pub fn accumulate(acc: &mut Vec<(String, Tensor)>, more: Vec<(String, Tensor)>) -> Result<()> {
    if acc.is_empty() {
        for (n, g) in more {
            acc.push((n, g.to_dtype(DType::F32)?));
        }
        return Ok(());
    }
    if acc.len() != more.len() {
        return Err(invalid("gradient lists of different lengths".into()));
    }
    for ((n, a), (m, g)) in acc.iter_mut().zip(more) {
        if *n != m {
            return Err(invalid(format!("gradient order differs: `{n}` vs `{m}`")));
        }
        *a = (&*a + g.to_dtype(DType::F32)?)?;
    }
    Ok(())
}

/// Sums each gradient over the ranks that hold the same parameter but see other tokens
/// ([`ParallelCtx::grad_group`]); `grads` in the order of `params` sorted by name. The result is
/// this rank's slice of the full gradient of the global loss, provided each rank's loss is its
/// share of it (e.g. its loss sum divided by the global token count). Collective over the world.
pub fn reduce_gradients(
    params: &[Param],
    grads: Vec<(String, Tensor)>,
    ctx: &ParallelCtx,
) -> Result<Vec<(String, Tensor)>> {
    let mut sorted: Vec<&Param> = params.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    if sorted.len() != grads.len() {
        return Err(invalid(format!(
            "{} gradients for {} parameters",
            grads.len(),
            sorted.len()
        )));
    }
    sorted
        .into_iter()
        .zip(grads)
        .map(|(p, (n, g))| {
            if p.name != n {
                return Err(invalid(format!(
                    "gradient `{n}` given for parameter `{}`",
                    p.name
                )));
            }
            let group = ctx.grad_group(&p.shard, p.expert_parallel);
            let g = if group.size() > 1 {
                group.all_reduce(&g, ReduceOp::Sum)?
            } else {
                g
            };
            Ok((n, g))
        })
        .collect()
}
