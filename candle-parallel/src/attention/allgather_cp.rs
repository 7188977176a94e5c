//! Llama 3 all-gather context parallelism.
//!
//! The sequence is cut into `2·cp` chunks and rank `i` holds chunks `i` and `2cp-1-i` (the
//! zigzag layout; contiguous and striped work too). Every rank all-gathers K and V over the ring
//! (context-parallel) group, then computes its local q rows against the gathered keys with the
//! mask on global positions, so each local q chunk attends exactly to the keys it may see (the
//! kernel skips the masked tiles; with documents, only its documents). Backward: the
//! all-gather's adjoint reduce-scatters (sums) dK and dV back to their owners.
//!
//! Traffic per rank, with `K` the bytes of the local k block (v the same): forward sends
//! `2·(cp-1)·K` (all-gather of k and v, exposed, not overlapped), backward `2·(cp-1)·K`
//! (reduce-scatter of dk and dv).
//!
//! **Sliding windows** ([`AttnCall::window`]): a rank gathers only the keys its queries' windows
//! reach. Which rows of rank `j`'s keys rank `i` needs follows from the plan's positions alone
//! ([`visible_rows`]), so every rank knows what to send to whom and what it receives: one
//! grouped exchange of k and v (each rank sends its rows that another rank's windows reach),
//! the kernel on the received keys at their global positions, and in backward the gradients of
//! the received rows sent back to their owners, who add them in rank order. Traffic per rank
//! then falls with the window: forward `2 · el · b · hkv · d · Σ_{j≠i} |rows of i that j
//! needs|`, backward that again (k and v gathered again) plus the f32 gradients of the rows it
//! received. With a window of `w` tokens at least the chunk length `S / 2cp` long, each of a
//! zigzag rank's two chunks needs about `w` keys before it: `2w` keys in all, against `S`.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use flash_ring::MaskKind;

use super::block::kernel_err;
use super::layout::{positions, ShardPlan};
use super::op::record_attention;
use super::{
    strategy_accessors, AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup,
};
use crate::collectives;
use crate::comm::{Comm, RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// All-gather context parallelism over the ring group (ulysses degree 1).
pub struct AllGatherAttention {
    group: SpGroup,
}

impl AllGatherAttention {
    /// Fails if the group's ulysses degree is not 1.
    pub fn new(group: SpGroup) -> Result<Self> {
        group.require_no_ulysses("all-gather", "put the ranks in the ring dim")?;
        Ok(Self { group })
    }

    /// The spec of this rank's q rows against the gathered keys (in rank order: the
    /// concatenation of every rank's positions).
    fn spec(&self, plan: &ShardPlan, call: &AttnCall) -> flash_ring::AttnSpec {
        let q_pos = positions(&plan.ring_positions(self.group.ring.rank()));
        call.spec(q_pos, positions(&plan.concat_order()))
    }
}

/// The rows of rank `k_rank`'s keys (indices into its [`ShardPlan::ring_positions`], ascending)
/// that a query of rank `q_rank` may see within a sliding window of `window` tokens: a key at
/// `pk` and a query at `pq` with `0 <= pq - pk < window` (causal) or `|pq - pk| < window`
/// (bidirectional). A superset of what the mask allows (documents are not consulted). Local.
pub fn visible_rows(
    plan: &ShardPlan,
    kind: MaskKind,
    window: usize,
    q_rank: usize,
    k_rank: usize,
) -> Vec<u32> {
    let mut q: Vec<u64> = plan
        .ring_positions(q_rank)
        .into_iter()
        .map(u64::from)
        .collect();
    q.sort_unstable();
    let w = window as u64;
    plan.ring_positions(k_rank)
        .into_iter()
        .enumerate()
        .filter(|&(_, p)| {
            let p = u64::from(p);
            // The queries that may see the key lie in [lo, p + w).
            let lo = match kind {
                MaskKind::Causal => p,
                MaskKind::Full => (p + 1).saturating_sub(w),
            };
            let i = q.partition_point(|&x| x < lo);
            i < q.len() && q[i] < p + w
        })
        .map(|(i, _)| i as u32)
        .collect()
}

/// `visible_rows(plan, kind, window, q_rank, k_rank).len()`, counted on the ranks' runs
/// ([`ShardPlan::ring_runs`]) where the layout has them: the planner costs the all-gather's
/// windowed traffic of every rank pair of thousands of layouts at up to millions of tokens.
/// A key at `pk` is visible when some query lies in `[pk, pk + w)` (causal) or
/// `(pk - w, pk + w)` (bidirectional), i.e. when `pk` lies in `(c - w, d)` or
/// `(c - w, d + w - 1)` for a query run `[c, d)`. Pure.
pub fn visible_row_count(
    plan: &ShardPlan,
    kind: MaskKind,
    window: usize,
    q_rank: usize,
    k_rank: usize,
) -> u64 {
    let (Some(q_runs), Some(k_runs)) = (plan.ring_runs(q_rank), plan.ring_runs(k_rank)) else {
        return visible_rows(plan, kind, window, q_rank, k_rank).len() as u64;
    };
    let w = window as u64;
    if w == 0 {
        return 0;
    }
    // The key positions each query run reaches, merged into disjoint sorted intervals.
    let mut reach: Vec<(u64, u64)> = q_runs
        .iter()
        .map(|&(c, d)| {
            let hi = match kind {
                MaskKind::Causal => d,
                MaskKind::Full => d + w.saturating_sub(1),
            };
            ((c + 1).saturating_sub(w), hi)
        })
        .collect();
    reach.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(reach.len());
    for (a, b) in reach {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    k_runs
        .iter()
        .map(|&(a, b)| {
            merged
                .iter()
                .map(|&(lo, hi)| hi.min(b).saturating_sub(lo.max(a)))
                .sum::<u64>()
        })
        .sum()
}

/// What one rank of a windowed call exchanges: by ring rank `j`, the rows of this rank's keys
/// that `j`'s windows reach (`to[j]`) and the rows of `j`'s keys that this rank's windows reach
/// (`from[j]`; `to[me] == from[me]`).
struct WindowRoutes {
    to: Vec<Vec<u32>>,
    from: Vec<Vec<u32>>,
}

impl WindowRoutes {
    fn new(plan: &ShardPlan, kind: MaskKind, window: usize, me: usize) -> Self {
        let cp = plan.ring();
        Self {
            to: (0..cp)
                .map(|j| visible_rows(plan, kind, window, j, me))
                .collect(),
            from: (0..cp)
                .map(|j| visible_rows(plan, kind, window, me, j))
                .collect(),
        }
    }

    /// The global positions of the gathered keys: `from[j]`'s rows of every rank `j`, in rank
    /// order.
    fn positions(&self, plan: &ShardPlan) -> Vec<u32> {
        self.from
            .iter()
            .enumerate()
            .flat_map(|(j, rows)| {
                let pos = plan.ring_positions(j);
                rows.iter()
                    .map(move |&i| pos[i as usize])
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// `rows` of `x`'s dim 1 (the sequence) as an index tensor on `x`'s device.
fn row_index(x: &Tensor, rows: &[u32]) -> Result<Tensor> {
    Ok(Tensor::from_slice(rows, rows.len(), x.device())?)
}

/// Sends, for every other rank `j` of `cp`, `parts(j)` (tensors of `rows(j)` rows along dim 1,
/// nothing when empty) and receives from every `j` the tensors of `recv_rows(j)` rows shaped
/// like `like` along the other dims, in `dtype`. Returns what came from each rank (empty for
/// this rank and for empty routes). Collective over `cp`.
fn route(
    cp: &Comm,
    sends: Vec<(usize, Vec<Tensor>)>,
    recv_rows: &[Vec<u32>],
    like: &[&Tensor],
    dtype: DType,
) -> Result<Vec<Vec<Tensor>>> {
    let me = cp.rank();
    let flat_sends = sends
        .into_iter()
        .flat_map(|(j, ts)| ts.into_iter().map(move |t| (j, t)))
        .collect();
    let mut recvs = Vec::new();
    for (j, rows) in recv_rows.iter().enumerate() {
        if j == me || rows.is_empty() {
            continue;
        }
        for t in like {
            let mut shape = t.dims().to_vec();
            shape[1] = rows.len();
            recvs.push(RecvSpec::new(j, shape, dtype));
        }
    }
    let mut got = cp.exchange(flat_sends, recvs)?.wait()?.into_iter();
    let mut out = Vec::with_capacity(recv_rows.len());
    for (j, rows) in recv_rows.iter().enumerate() {
        if j == me || rows.is_empty() {
            out.push(Vec::new());
            continue;
        }
        let mut parts = Vec::with_capacity(like.len());
        for _ in like {
            parts.push(got.next().ok_or_else(|| {
                Error::invalid(
                    "all-gather attention",
                    format!("nothing arrived from rank {j}"),
                )
            })?);
        }
        out.push(parts);
    }
    Ok(out)
}

/// Under a window: the keys and values this rank's queries' windows reach, from every rank of
/// `cp` (k and v in rank order, rows as [`WindowRoutes::positions`]). Collective over `cp`.
fn gather_visible(
    cp: &Comm,
    routes: &WindowRoutes,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let me = cp.rank();
    let mut sends = Vec::new();
    for (j, rows) in routes.to.iter().enumerate() {
        if j != me && !rows.is_empty() {
            let idx = row_index(k, rows)?;
            sends.push((j, vec![k.index_select(&idx, 1)?, v.index_select(&idx, 1)?]));
        }
    }
    let got = route(cp, sends, &routes.from, &[k, v], k.dtype())?;
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for (j, parts) in got.into_iter().enumerate() {
        if j == me {
            let idx = row_index(k, &routes.from[me])?;
            ks.push(k.index_select(&idx, 1)?);
            vs.push(v.index_select(&idx, 1)?);
        } else if let [kj, vj] = parts.as_slice() {
            ks.push(kj.clone());
            vs.push(vj.clone());
        }
    }
    Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
}

/// Under a window: the gradients `dk_sel`, `dv_sel` of the gathered rows sent back to their
/// owners, and this rank's dk, dv (f32, shaped like `k`): the contributions of every rank added
/// in rank order. Collective over `cp`.
fn return_gradients(
    cp: &Comm,
    routes: &WindowRoutes,
    k: &Tensor,
    dk_sel: &Tensor,
    dv_sel: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let me = cp.rank();
    let (dk_sel, dv_sel) = (dk_sel.to_dtype(DType::F32)?, dv_sel.to_dtype(DType::F32)?);
    let mut start = 0;
    let mut own = None;
    let mut sends = Vec::new();
    for (j, rows) in routes.from.iter().enumerate() {
        let n = rows.len();
        if n > 0 {
            let parts = vec![
                dk_sel.narrow(1, start, n)?.contiguous()?,
                dv_sel.narrow(1, start, n)?.contiguous()?,
            ];
            if j == me {
                own = Some(parts);
            } else {
                sends.push((j, parts));
            }
        }
        start += n;
    }
    let got = route(cp, sends, &routes.to, &[k, k], DType::F32)?;
    let mut dk = k.zeros_like()?.to_dtype(DType::F32)?;
    let mut dv = dk.clone();
    for (j, parts) in got.into_iter().enumerate() {
        let parts = if j == me {
            own.take().unwrap_or_default()
        } else {
            parts
        };
        if let [gk, gv] = parts.as_slice() {
            let idx = row_index(k, &routes.to[j])?;
            dk = dk.index_add(&idx, gk, 1)?;
            dv = dv.index_add(&idx, gv, 1)?;
        }
    }
    Ok((dk, dv))
}

/// Windowed all-gather attention of this rank's rows (`qkv` detached) against the keys its
/// windows reach: `out`, `lse`. Collective over `cp`.
fn windowed_forward(
    cp: &Comm,
    plan: &ShardPlan,
    routes: &WindowRoutes,
    qkv: &Qkv,
    call: &AttnCall,
) -> Result<(Tensor, Tensor)> {
    let (k_sel, v_sel) = gather_visible(cp, routes, &qkv.k, &qkv.v)?;
    let spec = windowed_spec(cp, plan, routes, call);
    flash_ring::flash_attention_with_lse(&qkv.q, &k_sel, &v_sel, &spec).map_err(kernel_err)
}

/// The backward of [`windowed_forward`]: f32 `(dq, dk, dv)`. Collective over `cp`.
fn windowed_backward(
    cp: &Comm,
    plan: &ShardPlan,
    routes: &WindowRoutes,
    saved: &Saved,
    dout: &Tensor,
    call: &AttnCall,
) -> Result<Grads> {
    let s = saved.detached();
    let (k_sel, v_sel) = gather_visible(cp, routes, &s.k, &s.v)?;
    let spec = windowed_spec(cp, plan, routes, call);
    let (dq, dk_sel, dv_sel) =
        flash_ring::flash_bwd_f32(&s.q, &k_sel, &v_sel, &s.out, &s.lse, &dout.detach(), &spec)
            .map_err(kernel_err)?;
    let (dk, dv) = return_gradients(cp, routes, &s.k, &dk_sel, &dv_sel)?;
    Ok((dq, dk, dv))
}

/// This rank's rows against the gathered keys at their global positions.
fn windowed_spec(
    cp: &Comm,
    plan: &ShardPlan,
    routes: &WindowRoutes,
    call: &AttnCall,
) -> flash_ring::AttnSpec {
    let q_pos = positions(&plan.ring_positions(cp.rank()));
    call.spec(q_pos, positions(&routes.positions(plan)))
}

impl SequenceParallelAttention for AllGatherAttention {
    strategy_accessors!("all-gather");

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (_, plan) = self.group.check(self.name(), qkv, &call.mask)?;
        let cp = &self.group.ring;
        if let (Some(w), true) = (call.window, cp.size() > 1) {
            let routes = Arc::new(WindowRoutes::new(&plan, call.mask.kind(), w, cp.rank()));
            let (out, lse) = windowed_forward(cp, &plan, &routes, &qkv.detached(), call)?;
            let (cp, call) = (cp.clone(), call.clone());
            let out = record_attention("cpl-allgather-window", qkv, out, &lse, move |s, dout| {
                windowed_backward(&cp, &plan, &routes, s, dout, &call)
            })?;
            return Ok((out, want_lse.then_some(lse)));
        }
        let (k_all, v_all) = if cp.size() > 1 {
            (
                collectives::all_gather(&qkv.k, cp, 1)?,
                collectives::all_gather(&qkv.v, cp, 1)?,
            )
        } else {
            (qkv.k.clone(), qkv.v.clone())
        };
        let spec = self.spec(&plan, call);
        let (out, lse) = flash_ring::flash_attention_with_lse(&qkv.q, &k_all, &v_all, &spec)
            .map_err(kernel_err)?;
        Ok((out, want_lse.then_some(lse)))
    }

    /// All-gathers K and V again (the forward did not keep them), runs the kernel's backward
    /// and reduce-scatters dK, dV to their owners.
    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        let (_, plan) = self
            .group
            .check_backward(self.name(), saved, dout, &call.mask)?;
        let cp = &self.group.ring;
        let s = saved.detached();
        if let (Some(w), true) = (call.window, cp.size() > 1) {
            let routes = WindowRoutes::new(&plan, call.mask.kind(), w, cp.rank());
            let grads = windowed_backward(cp, &plan, &routes, saved, dout, call)?;
            return saved.cast_grads(grads);
        }
        let (k_all, v_all) = (cp.all_gather(&s.k, 1)?, cp.all_gather(&s.v, 1)?);
        let spec = self.spec(&plan, call);
        let (dq, dk_all, dv_all) =
            flash_ring::flash_bwd_f32(&s.q, &k_all, &v_all, &s.out, &s.lse, &dout.detach(), &spec)
                .map_err(kernel_err)?;
        let scatter = |x: &Tensor| cp.reduce_scatter(x, 1, ReduceOp::Sum);
        saved.cast_grads((dq, scatter(&dk_all)?, scatter(&dv_all)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::SeqLayout;

    /// Keys each ring rank gathers, fewest and most over the ranks.
    fn gathered(s: usize, cp: usize, w: usize, layout: SeqLayout) -> (usize, usize) {
        let plan = ShardPlan::new(s, layout, cp, 1).unwrap();
        let keys: Vec<usize> = (0..cp)
            .map(|i| {
                let routes = WindowRoutes::new(&plan, MaskKind::Causal, w, i);
                routes.positions(&plan).len()
            })
            .collect();
        (*keys.iter().min().unwrap(), *keys.iter().max().unwrap())
    }

    /// At 64K tokens on 8 ranks (zigzag, chunks of 4K) a window of 4K gathers at most a quarter
    /// of the sequence: a rank's early chunk and the 4K - 1 keys before it, its late chunk and
    /// the 4K - 1 before that (16,382); the first rank's early chunk has nothing before it.
    #[test]
    fn a_4k_window_at_64k_gathers_a_quarter_of_the_keys() {
        assert_eq!(gathered(65536, 8, 4096, SeqLayout::Zigzag), (12287, 16382));
        // Contiguous: a rank's 8K keys and the 4K - 1 before them.
        assert_eq!(
            gathered(65536, 8, 4096, SeqLayout::Contiguous),
            (8192, 12287)
        );
        // The other rows of docs/benchmarks.md's table.
        assert_eq!(gathered(65536, 8, 16384, SeqLayout::Zigzag), (24575, 40958));
        assert_eq!(gathered(65536, 4, 4096, SeqLayout::Zigzag), (20479, 24574));
        // A window as long as the sequence: every key at or before a rank's last query.
        assert_eq!(gathered(64, 4, 64, SeqLayout::Contiguous), (16, 64));
    }

    /// Causal: a key is visible to a query at or after it within the window; bidirectional:
    /// within the window on either side.
    #[test]
    fn visible_rows_follow_the_window_on_positions() {
        let plan = ShardPlan::new(16, SeqLayout::Contiguous, 4, 1).unwrap();
        // Rank 1 holds 4..8, rank 2 8..12.
        assert_eq!(visible_rows(&plan, MaskKind::Causal, 2, 2, 1), vec![3]);
        assert_eq!(visible_rows(&plan, MaskKind::Causal, 3, 2, 1), vec![2, 3]);
        assert!(visible_rows(&plan, MaskKind::Causal, 8, 1, 2).is_empty());
        assert_eq!(visible_rows(&plan, MaskKind::Full, 2, 1, 2), vec![0]);
        assert_eq!(
            visible_rows(&plan, MaskKind::Full, 1, 1, 1),
            vec![0, 1, 2, 3]
        );
        assert!(visible_rows(&plan, MaskKind::Full, 1, 1, 2).is_empty());
    }

    /// The count on runs equals the listed rows for every rank pair of contiguous and zigzag
    /// rings (striped: the listing itself), causal and bidirectional, windows from 1 token to
    /// longer than the sequence, including windows that end inside, at and past a run.
    #[test]
    fn visible_row_count_equals_the_listed_rows() {
        let mut checked = 0;
        for layout in [SeqLayout::Contiguous, SeqLayout::Zigzag, SeqLayout::Striped] {
            for (s, p) in [(48, 4), (96, 3), (64, 8), (40, 2)] {
                let plan = ShardPlan::new(s, layout, p, 1).unwrap();
                for kind in [MaskKind::Causal, MaskKind::Full] {
                    for window in [0, 1, 2, 3, 5, 6, 7, 11, 12, 13, 24, 47, 48, 49, 200] {
                        for q in 0..p {
                            for k in 0..p {
                                let want = if window == 0 {
                                    0
                                } else {
                                    visible_rows(&plan, kind, window, q, k).len() as u64
                                };
                                let got = visible_row_count(&plan, kind, window, q, k);
                                assert_eq!(
                                    got, want,
                                    "{layout:?} S={s} P={p} {kind:?} w={window} q{q} k{k}"
                                );
                                checked += usize::from(want > 0);
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked} non-empty pairs");
    }
}
