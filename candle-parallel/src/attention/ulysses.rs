//! DeepSpeed-Ulysses: all-to-all from (sequence shard, all heads) to (whole sequence, head
//! shard), local attention, and the inverse all-to-all.
//!
//! With degree `P`, rank `u` receives q heads `[u·hq/P, (u+1)·hq/P)` and the kv heads of their
//! groups. When `P` exceeds the kv-head count, every kv head is first replicated `P / hkv` times
//! (LoongTrain 4.2), so that each rank receives exactly the kv head of its q heads; the backward
//! of the replication sums the replicas' gradients. Requirements (checked before any
//! communication): `hq % P == 0` and either `hkv % P == 0` or `P % hkv == 0`.
//!
//! Traffic per rank (every all-to-all sends `(P-1)/P` of its input), with `Q` the bytes of the
//! local q and `K'` those of the local k after replication (`hkv·rep` heads): forward sends
//! `(P-1)/P · (2Q + 2K')` (q, k, v in; out back), backward the same (the adjoint all-to-alls of
//! the output gradient and of dq, dk, dv). `attention_with_lse` adds `(P-1)/P` of the local lse.
//!
//! The helpers ([`seq_to_heads`], [`heads_to_seq`], [`repeat_kv`], [`kv_replication`]) are
//! shared with [`super::usp`] and the other 2D strategies.

use candle_core::{DType, Tensor};

use super::layout::{positions, ShardPlan};
use super::mask::AttnMask;
use super::{block::kernel_err, SequenceParallelAttention, SpGroup};
use crate::collectives;
use crate::comm::Comm;
use crate::error::{Error, Result};

/// The kv replication factor of Ulysses of `degree` over `q_heads` / `kv_heads` heads (1 when
/// no replication is needed), or a clear error when the heads do not split.
pub fn kv_replication(q_heads: usize, kv_heads: usize, degree: usize) -> Result<usize> {
    let op = "ulysses";
    if degree == 0 || !q_heads.is_multiple_of(degree) {
        return Err(Error::invalid(
            op,
            format!("{q_heads} query heads do not divide over the ulysses degree {degree}"),
        ));
    }
    if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(Error::invalid(
            op,
            format!("{q_heads} query heads are not a multiple of {kv_heads} kv heads"),
        ));
    }
    if kv_heads.is_multiple_of(degree) {
        Ok(1)
    } else if degree.is_multiple_of(kv_heads) {
        Ok(degree / kv_heads)
    } else {
        Err(Error::invalid(
            op,
            format!(
                "{kv_heads} kv heads neither divide over nor replicate evenly to the ulysses \
                 degree {degree} (need kv_heads % degree == 0 or degree % kv_heads == 0)"
            ),
        ))
    }
}

/// Repeats every head `rep` times: `(b, n, h, d)` → `(b, n, h·rep, d)`, head `j` becoming heads
/// `j·rep .. (j+1)·rep`. Differentiable (the backward sums the replicas).
pub fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, n, h, d) = x.dims4()?;
    Ok(x.unsqueeze(3)?
        .broadcast_as((b, n, h, rep, d))?
        .contiguous()?
        .reshape((b, n, h * rep, d))?)
}

/// `(b, n, h, d)` → `(b, n·P, h/P, d)`: the sequence-to-head all-to-all over `comm` (pieces
/// concatenated in rank order). Differentiable (backward: [`heads_to_seq`]). Collective.
pub fn seq_to_heads(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(x.clone());
    }
    Ok(collectives::all_to_all(x, comm, 2, 1)?)
}

/// `(b, n·P, h/P, d)` → `(b, n, h, d)`: the inverse of [`seq_to_heads`]. Differentiable.
pub fn heads_to_seq(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(x.clone());
    }
    Ok(collectives::all_to_all(x, comm, 1, 2)?)
}

/// lse `(b, h/P, n·P)` → `(b, h, n)` over `comm` (not differentiable). Collective.
pub fn lse_heads_to_seq(lse: &Tensor, comm: &Comm) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(lse.clone());
    }
    comm.all_to_all(lse, 2, 1)
}

/// lse `(b, h, n)` → `(b, h/P, n·P)` over `comm`, the inverse of [`lse_heads_to_seq`] (not
/// differentiable). Collective.
fn lse_seq_to_heads(lse: &Tensor, comm: &Comm) -> Result<Tensor> {
    if comm.size() == 1 {
        return Ok(lse.clone());
    }
    comm.all_to_all(lse, 1, 2)
}

/// The tensors of a backward in the head-parallel view (whole sequence of the ulysses group,
/// `1/P` of the heads), as [`head_parallel_backward`] hands them to its inner backward.
pub(crate) struct HeadView {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub out: Tensor,
    pub dout: Tensor,
    pub lse: Tensor,
}

/// Moves a backward's inputs from the sequence-shard view to the head-parallel view over `comm`
/// (kv heads replicated `rep` times first), as the forward's all-to-alls did. Collective;
/// records nothing.
#[allow(clippy::too_many_arguments)]
fn to_heads(
    comm: &Comm,
    rep: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
) -> Result<HeadView> {
    let a2a = |x: &Tensor| seq_to_heads(&x.detach(), comm);
    Ok(HeadView {
        q: a2a(q)?,
        k: a2a(&repeat_kv(k, rep)?)?,
        v: a2a(&repeat_kv(v, rep)?)?,
        out: a2a(out)?,
        dout: a2a(dout)?,
        lse: lse_seq_to_heads(&lse.detach(), comm)?,
    })
}

/// The gradients of the head-parallel view back to this rank's sequence shard: the inverse
/// all-to-all of `dq`, `dk`, `dv`, summing the gradients of the `rep` replicas of each kv head
/// (in f32), cast to the dtypes of q and of k/v. Collective; records nothing.
fn grads_to_seq(
    comm: &Comm,
    rep: usize,
    (dq, dk, dv): (Tensor, Tensor, Tensor),
    q_dtype: DType,
    kv_dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let unrep = |x: Tensor| -> Result<Tensor> {
        let x = heads_to_seq(&x.to_dtype(DType::F32)?, comm)?;
        if rep == 1 {
            return Ok(x);
        }
        let (b, n, h, d) = x.dims4()?;
        Ok(x.reshape((b, n, h / rep, rep, d))?.sum(3)?)
    };
    Ok((
        heads_to_seq(&dq, comm)?.to_dtype(q_dtype)?,
        unrep(dk)?.to_dtype(kv_dtype)?,
        unrep(dv)?.to_dtype(kv_dtype)?,
    ))
}

/// The explicit [`SequenceParallelAttention::backward`] of a head-parallel strategy (Ulysses,
/// USP, the double ring): checks the inputs, moves them to the head-parallel view over the
/// ulysses group as the forward's all-to-alls did, runs `inner` there (it returns the f32
/// gradients of that view, given the shard plan) and moves the gradients back to this rank's
/// sequence shard in the dtypes of q and k/v. Collective; records nothing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_parallel_backward(
    group: &SpGroup,
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    mask: &AttnMask,
    inner: impl FnOnce(&HeadView, &ShardPlan) -> Result<(Tensor, Tensor, Tensor)>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dims, plan) = group.check_backward(op, q, k, v, out, lse, dout, mask)?;
    let comm = &group.ulysses;
    let rep = kv_replication(dims.q_heads, dims.kv_heads, comm.size())?;
    let h = to_heads(comm, rep, q, k, v, out, dout, lse)?;
    let grads = inner(&h, &plan)?;
    grads_to_seq(comm, rep, grads, q.dtype(), k.dtype())
}

/// Ulysses sequence parallelism over the ulysses group (ring degree 1).
pub struct UlyssesAttention {
    group: SpGroup,
}

impl UlyssesAttention {
    /// Fails if the group's ring degree is not 1 (use [`super::UspAttention`]).
    pub fn new(group: SpGroup) -> Result<Self> {
        if group.ring.size() != 1 {
            return Err(Error::Layout(format!(
                "ulysses runs on the ulysses group only; the ring degree is {} (use usp)",
                group.ring.size()
            )));
        }
        Ok(Self { group })
    }
}

impl SequenceParallelAttention for UlyssesAttention {
    fn name(&self) -> &'static str {
        "ulysses"
    }

    fn plan(&self, seq_len: usize) -> Result<ShardPlan> {
        self.group.plan(seq_len)
    }

    fn shard_coords(&self) -> (usize, usize) {
        self.group.coords()
    }

    fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        scale: f32,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (dims, plan) = self.group.check("ulysses", q, k, v, mask)?;
        let comm = &self.group.ulysses;
        let rep = kv_replication(dims.q_heads, dims.kv_heads, comm.size())?;
        let q2 = seq_to_heads(q, comm)?;
        let k2 = seq_to_heads(&repeat_kv(k, rep)?, comm)?;
        let v2 = seq_to_heads(&repeat_kv(v, rep)?, comm)?;
        // Ring degree 1: after the all-to-all every rank holds the whole sequence, in order.
        let all = positions(&plan.ring_positions(0));
        let spec = mask.spec(scale, all.clone(), all);
        let (out, lse) =
            flash_ring::flash_attention_with_lse(&q2, &k2, &v2, &spec).map_err(kernel_err)?;
        let out = heads_to_seq(&out, comm)?;
        let lse = if want_lse {
            Some(lse_heads_to_seq(&lse, comm)?)
        } else {
            None
        };
        Ok((out, lse))
    }

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        mask: &AttnMask,
        scale: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let inner = |h: &HeadView, plan: &ShardPlan| {
            // Ring degree 1: the head view holds the whole sequence, in order.
            let all = positions(&plan.ring_positions(0));
            let spec = mask.spec(scale, all.clone(), all);
            flash_ring::flash_bwd_f32(&h.q, &h.k, &h.v, &h.out, &h.lse, &h.dout, &spec)
                .map_err(kernel_err)
        };
        head_parallel_backward(&self.group, "ulysses", q, k, v, out, lse, dout, mask, inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replication_factors() {
        assert_eq!(kv_replication(8, 8, 4).unwrap(), 1);
        assert_eq!(kv_replication(8, 4, 4).unwrap(), 1);
        assert_eq!(kv_replication(8, 2, 4).unwrap(), 2);
        assert_eq!(kv_replication(8, 1, 8).unwrap(), 8);
        assert!(kv_replication(6, 3, 4).is_err()); // q heads do not divide
        assert!(kv_replication(12, 3, 2).is_err()); // 3 kv heads over 2 ranks
        assert!(kv_replication(8, 3, 4).is_err()); // not GQA-valid
    }
}
