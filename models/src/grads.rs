//! Gradients of a model's parameters after `backward()`, reduced over the ranks that share them.

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_parallel::comm::ReduceOp;
use candle_parallel::layers::ParallelCtx;

use crate::checkpoint::Param;
use crate::error::{Error, Result};

/// For every parameter (in name order, the order every rank agrees on): its gradient from
/// `grads`, summed over the ranks that hold the same parameter but see other tokens
/// ([`ParallelCtx::grad_group`]). The result is this rank's slice of the full gradient of the
/// global loss, provided each rank's loss is its share of it (e.g. its loss sum divided by the
/// global token count). Collective over the world; errors naming a trainable parameter that
/// received no gradient.
pub fn reduce_gradients(
    params: &[Param],
    grads: &GradStore,
    ctx: &ParallelCtx,
) -> Result<Vec<(String, Tensor)>> {
    let mut sorted: Vec<&Param> = params.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::with_capacity(sorted.len());
    for p in sorted {
        let var = p.var.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "parameter `{}` was loaded as not trainable",
                p.name
            ))
        })?;
        let g = grads.get(var.as_tensor()).ok_or_else(|| {
            Error::Invalid(format!("parameter `{}` received no gradient", p.name))
        })?;
        let group = ctx.grad_group(p.shard.is_split());
        let g = if group.size() > 1 {
            group.all_reduce(g, ReduceOp::Sum)?
        } else {
            g.clone()
        };
        out.push((p.name.clone(), g));
    }
    Ok(out)
}
