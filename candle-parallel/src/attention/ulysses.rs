//! DeepSpeed-Ulysses: all-to-all from (sequence shard, all heads) to (whole sequence, head
//! shard), local attention, and the inverse all-to-all.
//!
//! With degree `P`, rank `u` receives q heads `[u·hq/P, (u+1)·hq/P)` and exactly the kv heads
//! those q heads use. Any `P` that divides the q heads works, whatever the GQA ratio: every kv
//! head is first replicated `rep = P / gcd(P, hkv)` times (LoongTrain 4.2 generalised), so that
//! the `hkv·rep` heads split evenly over the ranks and the q heads of each rank map onto its kv
//! heads in the usual contiguous GQA grouping (`rep` always divides `hq / hkv` when `P` divides
//! `hq`). The backward of the replication sums the replicas' gradients. Examples: 28 q / 4 kv
//! heads on 7 ranks (Qwen2.5-7B) replicate 7 times (each rank's 4 q heads straddle two kv
//! heads); 32 / 8 on 16 twice; 32 / 8 on 4 not at all.
//!
//! Traffic per rank (every all-to-all sends `(P-1)/P` of its input), with `Q` the bytes of the
//! local q and `K'` those of the local k after replication (`hkv·rep` heads): forward sends
//! `(P-1)/P · (2Q + 2K')` (q, k, v in; out back), backward the same (the adjoint all-to-alls of
//! the output gradient and of dq, dk, dv). `attention_with_lse` adds `(P-1)/P` of the local lse.
//!
//! `HeadParallel` is the head-parallel wrapping (all-to-alls, replication, forward and
//! explicit backward) that Ulysses, [`super::usp`] and [`super::double_ring`] share; they differ
//! only in what runs on the ring group inside it (nothing, a ring, a double ring).

use candle_core::{DType, Tensor};

use super::block::kernel_err;
use super::layout::{positions, ShardPlan};
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::collectives;
use crate::comm::Comm;
use crate::error::{Error, Result};

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The kv replication factor of Ulysses of `degree` over `q_heads` / `kv_heads` heads,
/// `degree / gcd(degree, kv_heads)` (1 when the kv heads split evenly), or a clear error when
/// the query heads do not split over the degree.
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
    let rep = degree / gcd(degree, kv_heads);
    // `degree | q_heads = kv_heads · group` implies `rep | group`: replicas stay within a group.
    debug_assert!((q_heads / kv_heads).is_multiple_of(rep));
    Ok(rep)
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

/// The head-parallel wrapping of a strategy over `group`: the ulysses all-to-alls (with kv
/// replication) around an inner attention that sees, for `1/U` of the heads, the tokens of this
/// rank's ring rank ([`ShardPlan::ring_positions`]) and runs over the ring group.
pub(crate) struct HeadParallel<'a> {
    /// The strategy's name, for errors.
    pub name: &'static str,
    pub group: &'a SpGroup,
}

impl<'a> HeadParallel<'a> {
    /// The head-parallel wrapping of `strategy` (its name and group).
    pub fn of(strategy: &'a impl SequenceParallelAttention) -> Self {
        Self {
            name: strategy.name(),
            group: strategy.group(),
        }
    }

    /// Checks the inputs, moves q, k, v to the head-parallel view, runs `inner` there (it
    /// returns a differentiable `out` and the detached `lse` of that view, given the plan of the
    /// global sequence) and moves `out` (and, when wanted, `lse`) back. Collective.
    pub fn forward(
        &self,
        qkv: &Qkv,
        call: &AttnCall,
        want_lse: bool,
        inner: impl FnOnce(&Qkv, &ShardPlan) -> Result<(Tensor, Tensor)>,
    ) -> Result<AttnOut> {
        let (dims, plan) = self.group.check(self.name, qkv, &call.mask)?;
        let comm = &self.group.ulysses;
        let rep = kv_replication(dims.q_heads, dims.kv_heads, comm.size())?;
        let heads = Qkv {
            q: seq_to_heads(&qkv.q, comm)?,
            k: seq_to_heads(&repeat_kv(&qkv.k, rep)?, comm)?,
            v: seq_to_heads(&repeat_kv(&qkv.v, rep)?, comm)?,
        };
        let (out, lse) = inner(&heads, &plan)?;
        let out = heads_to_seq(&out, comm)?;
        let lse = if want_lse {
            Some(lse_heads_to_seq(&lse, comm)?)
        } else {
            None
        };
        Ok((out, lse))
    }

    /// The explicit backward: checks the inputs, moves them to the head-parallel view as the
    /// forward's all-to-alls did, runs `inner` there (it returns the f32 gradients of that
    /// view's `saved`, given the plan) and moves the gradients back to this rank's sequence
    /// shard, summing the kv replicas, in the dtypes of q and k/v. Collective; records nothing.
    pub fn backward(
        &self,
        saved: &Saved,
        dout: &Tensor,
        call: &AttnCall,
        inner: impl FnOnce(&Saved, &Tensor, &ShardPlan) -> Result<Grads>,
    ) -> Result<Grads> {
        let (dims, plan) = self
            .group
            .check_backward(self.name, saved, dout, &call.mask)?;
        let comm = &self.group.ulysses;
        let rep = kv_replication(dims.q_heads, dims.kv_heads, comm.size())?;
        let a2a = |x: &Tensor| seq_to_heads(&x.detach(), comm);
        let heads = Saved {
            q: a2a(&saved.q)?,
            k: a2a(&repeat_kv(&saved.k, rep)?)?,
            v: a2a(&repeat_kv(&saved.v, rep)?)?,
            out: a2a(&saved.out)?,
            lse: lse_seq_to_heads(&saved.lse.detach(), comm)?,
        };
        let (dq, dk, dv) = inner(&heads, &a2a(dout)?, &plan)?;
        let unrep = |x: Tensor| -> Result<Tensor> {
            let x = heads_to_seq(&x.to_dtype(DType::F32)?, comm)?;
            if rep == 1 {
                return Ok(x);
            }
            let (b, n, h, d) = x.dims4()?;
            Ok(x.reshape((b, n, h / rep, rep, d))?.sum(3)?)
        };
        saved.cast_grads((heads_to_seq(&dq, comm)?, unrep(dk)?, unrep(dv)?))
    }
}

/// The spec of attention over the whole sequence in order (the head-parallel view with ring
/// degree 1).
fn whole_sequence(plan: &ShardPlan, call: &AttnCall) -> flash_ring::AttnSpec {
    let all = positions(&plan.ring_positions(0));
    call.spec(all.clone(), all)
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
    strategy_accessors!("ulysses");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        // Ring degree 1: after the all-to-all every rank holds the whole sequence, in order.
        HeadParallel::of(self).forward(qkv, call, want_lse, |h, plan| {
            let spec = whole_sequence(plan, call);
            flash_ring::flash_attention_with_lse(&h.q, &h.k, &h.v, &spec).map_err(kernel_err)
        })
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        HeadParallel::of(self).backward(saved, dout, call, |h, dout, plan| {
            let spec = whole_sequence(plan, call);
            flash_ring::flash_bwd_f32(&h.q, &h.k, &h.v, &h.out, &h.lse, dout, &spec)
                .map_err(kernel_err)
        })
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
        assert!(kv_replication(8, 3, 4).is_err()); // not GQA-valid
                                                   // Any degree dividing the q heads: the kv heads neither divide nor are divided.
        assert_eq!(kv_replication(12, 3, 2).unwrap(), 2); // 3 kv heads over 2 ranks
        assert_eq!(kv_replication(28, 4, 7).unwrap(), 7); // Qwen2.5-7B on 7 ranks
        assert_eq!(kv_replication(6, 2, 3).unwrap(), 3);
        assert_eq!(kv_replication(32, 8, 16).unwrap(), 2);
        assert_eq!(kv_replication(24, 8, 12).unwrap(), 3); // gcd 4
        for (hq, hkv) in [(28, 4), (6, 2), (12, 3), (24, 8), (32, 8), (8, 1)] {
            for p in (1..=hq).filter(|p| hq % p == 0) {
                let rep = kv_replication(hq, hkv, p).unwrap();
                // The replicated kv heads split evenly and stay inside their GQA group.
                assert_eq!(hkv * rep % p, 0, "{hq}/{hkv} on {p}");
                assert_eq!((hq / hkv) % rep, 0, "{hq}/{hkv} on {p}");
            }
        }
    }
}
