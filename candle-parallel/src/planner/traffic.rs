//! Bytes one rank sends in one sequence-parallel attention call, forward and backward, for every
//! strategy: the formulas `tests/sp_attention.rs`, `tests/sp_double_ring.rs` and
//! `tests/sp_startrail.rs` assert against the communicators' counters (those tests also assert
//! that this module agrees with what the ranks sent).
//!
//! With `U` the ulysses and `R` the ring degree, `n = S / (U R)` local tokens, element size `el`:
//! `Q = b n hq d el`, `K = b n hkv d el`, `K' = rep K` (Ulysses' kv replication
//! `rep = U / gcd(U, hkv)`), `a2a(x) = x (U - 1) / U`:
//! - ring: forward `(R-1) 2K` in `R-1` exchanges; backward `(R-1) 2K + R 2K_f32` in `2R-1`;
//! - ulysses: `2 a2a(Q) + 2 a2a(K')` each way (plus `a2a(b hq n 4)` for a returned lse);
//! - usp and double ring: the ulysses terms plus the ring terms with `K'` for `K`;
//! - startrail: [`StarTrailPlan`]'s per-rank formulas (the largest over the ranks);
//! - all-gather: `2 K` all-gathered forward, reduce-scattered backward.
//!
//! [`expert_traffic`]: the same for one sparse block under expert parallelism
//! ([`crate::nn::moe`]'s dispatch).
//! Under a sliding window ([`windowed_attention_traffic`]) the ring and USP's ring send only the
//! steps some rank needs ([`crate::attention::ring_steps`]) and all-gather CP only the rows the
//! windows reach ([`crate::attention::allgather_cp::visible_rows`], counted on the ranks' runs
//! by [`visible_row_count`]); the tests assert these too.

use flash_ring::MaskKind;

use crate::attention::allgather_cp::visible_row_count;
use crate::attention::multi_ring_plan::{ShardElems, StarTrailPlan, StrategyBytes};
use crate::attention::ulysses::kv_replication;
use crate::attention::{
    ring_steps, ring_traffic, AttnCall, AttnMask, ShardPlan, SpConfig, Strategy,
};
use crate::error::{Error, Result};

/// The global attention problem of one call, as one tensor-parallel rank sees it (its heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    /// Tokens of the whole sequence.
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes of an element of q, k, v.
    pub elem_bytes: usize,
    /// The call returns the softmax lse (Ulysses sends it back through an all-to-all).
    pub with_lse: bool,
}

/// What one rank sends in one attention call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionTraffic {
    pub forward: StrategyBytes,
    pub backward: StrategyBytes,
    /// Ring exchanges of the forward and of the backward: the steps whose transfers overlap
    /// the next block's compute.
    pub forward_steps: u64,
    pub backward_steps: u64,
    /// kv heads a rank holds during the ring steps (after Ulysses' kv replication).
    pub kv_heads_per_rank: u64,
}

/// Bytes the busiest rank of `sp` sends for `shape` (every rank sends the same except under
/// StarTrail, whose initial placement leaves some ranks' blocks at home).
pub fn attention_traffic(sp: &SpConfig, shape: &AttnShape) -> Result<AttentionTraffic> {
    sp.validate()?;
    let (u, r) = (sp.ulysses as u64, sp.ring as u64);
    let p = u * r;
    if shape.seq == 0 || !(shape.seq as u64).is_multiple_of(p) {
        return Err(Error::Layout(format!(
            "{} tokens do not split over {p} sequence-parallel ranks",
            shape.seq
        )));
    }
    let el = shape.elem_bytes as u64;
    let n = shape.seq as u64 / p;
    let (b, hq, hkv, d) = (
        shape.batch as u64,
        shape.heads as u64,
        shape.kv_heads as u64,
        shape.head_dim as u64,
    );
    let q = b * n * hq * d * el;
    let k = b * n * hkv * d * el;
    let a2a = |x: u64| x * (u - 1) / u;
    let lse = if shape.with_lse {
        a2a(b * hq * n * 4)
    } else {
        0
    };
    // The ring over R ranks with kv blocks of `kb` bytes: (forward, backward) exchange bytes
    // and (forward, backward) exchanges.
    let ring = |kb: u64| -> (u64, u64, u64, u64) {
        if r == 1 {
            return (0, 0, 0, 0);
        }
        let k32 = kb / el * 4;
        (
            (r - 1) * 2 * kb,
            (r - 1) * 2 * kb + r * 2 * k32,
            r - 1,
            2 * r - 1,
        )
    };
    let bytes = |a2a: u64, exchange: u64| StrategyBytes {
        all_to_all: a2a,
        exchange,
        ..StrategyBytes::default()
    };
    Ok(match sp.strategy {
        Strategy::Ring => {
            let (f, bw, sf, sb) = ring(k);
            AttentionTraffic {
                forward: bytes(0, f),
                backward: bytes(0, bw),
                forward_steps: sf,
                backward_steps: sb,
                kv_heads_per_rank: hkv,
            }
        }
        Strategy::Ulysses | Strategy::Usp | Strategy::DoubleRing => {
            let rep = kv_replication(shape.heads, shape.kv_heads, sp.ulysses)? as u64;
            let x = 2 * a2a(q) + 2 * a2a(k * rep);
            let (f, bw, sf, sb) = ring(k * rep);
            AttentionTraffic {
                forward: bytes(x + lse, f),
                backward: bytes(x, bw),
                forward_steps: sf,
                backward_steps: sb,
                kv_heads_per_rank: hkv * rep / u,
            }
        }
        Strategy::AllGather => AttentionTraffic {
            forward: StrategyBytes {
                all_gather: 2 * (r - 1) * k,
                ..StrategyBytes::default()
            },
            backward: StrategyBytes {
                reduce_scatter: 2 * (r - 1) * k,
                ..StrategyBytes::default()
            },
            forward_steps: 0,
            backward_steps: 0,
            kv_heads_per_rank: hkv,
        },
        Strategy::StarTrail => {
            let plan = StarTrailPlan::new(p as usize, sp.team)?;
            let e = ShardElems {
                q_elems: b * n * hq * d,
                kv_elems: b * n * hkv * d,
                lse_elems: b * hq * n,
                elem_bytes: el,
            };
            let busiest = |f: &dyn Fn(usize) -> StrategyBytes| {
                (0..p as usize)
                    .map(f)
                    .max_by_key(|s| s.total())
                    .unwrap_or_default()
            };
            let steps = plan.sub_ring_size() as u64;
            AttentionTraffic {
                forward: busiest(&|rank| plan.forward_bytes(rank, &e)),
                backward: busiest(&|rank| plan.backward_bytes(rank, &e)),
                forward_steps: steps.saturating_sub(1),
                backward_steps: steps,
                kv_heads_per_rank: hkv,
            }
        }
    })
}

/// What one rank of an expert-parallel group of `ep` ranks sends in one sparse block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertTraffic {
    pub forward: StrategyBytes,
    pub backward: StrategyBytes,
    /// `all_to_all_v` calls, each one all-gather of the split sizes and one exchange.
    pub forward_calls: u64,
    pub backward_calls: u64,
}

/// Bytes a rank sends in one sparse block under expert parallelism of `ep`, when it sends
/// `rows_sent` of its (token, expert) rows to experts on other ranks and receives
/// `rows_received` rows from them, `hidden` elements of `elem_bytes` each. The dispatch
/// ([`crate::nn::moe::SparseMoe`]) makes three `all_to_all_v` calls forward (the rows, their
/// expert ids as f32, the experts' outputs back) and two backward (the outputs' gradients to
/// the experts, the rows' gradients back); each call first all-gathers the `ep` split sizes
/// (f64). A rank's rows for its own experts stay home and are not counted
/// ([`crate::comm::traffic`]).
pub fn expert_traffic(
    ep: usize,
    rows_sent: u64,
    rows_received: u64,
    hidden: usize,
    elem_bytes: usize,
) -> ExpertTraffic {
    if ep <= 1 {
        return ExpertTraffic::default();
    }
    let row = (hidden * elem_bytes) as u64;
    let counts = ((ep - 1) * ep * 8) as u64;
    ExpertTraffic {
        forward: StrategyBytes {
            all_gather: 3 * counts,
            exchange: rows_sent * row + rows_sent * 4 + rows_received * row,
            ..StrategyBytes::default()
        },
        backward: StrategyBytes {
            all_gather: 2 * counts,
            exchange: (rows_sent + rows_received) * row,
            ..StrategyBytes::default()
        },
        forward_calls: 3,
        backward_calls: 2,
    }
}

/// The (token, expert) rows a rank sends to other ranks (and, in expectation, receives) when
/// its `tokens` each pick `top_k` of the experts spread evenly over `ep` ranks, and the router
/// spreads the picks evenly (the planner's assumption; a skewed router sends more to the busy
/// ranks).
pub fn uniform_remote_rows(tokens: u64, top_k: usize, ep: usize) -> u64 {
    let ep = ep.max(1) as u64;
    tokens * top_k as u64 * (ep - 1) / ep
}

/// [`attention_traffic`] under a sliding window of `window` tokens with a mask of `kind` and
/// no documents (documents can only lower the ring's count): the bytes of the busiest rank.
/// - ring, USP: the steps of [`ring_steps`] on the plan of `sp`, [`ring_traffic`] with `K'`
///   (the Ulysses all-to-alls unchanged);
/// - all-gather: rank `i` sends the rows of its k and v that another rank's windows reach
///   ([`visible_row_count`]) forward (counted as `all_gather`) and again backward, plus the f32
///   gradients of the rows it received (`reduce_scatter`): exposed, not overlapped;
/// - double ring, Ulysses, StarTrail: as without a window.
pub fn windowed_attention_traffic(
    sp: &SpConfig,
    shape: &AttnShape,
    window: usize,
    kind: MaskKind,
) -> Result<AttentionTraffic> {
    let mut t = attention_traffic(sp, shape)?;
    let (u, r) = (sp.ulysses, sp.ring);
    if r == 1 {
        return Ok(t);
    }
    let el = shape.elem_bytes as u64;
    let (b, hkv, d) = (
        shape.batch as u64,
        shape.kv_heads as u64,
        shape.head_dim as u64,
    );
    let plan = ShardPlan::new(shape.seq, sp.layout, r, u)?;
    let mask = match kind {
        MaskKind::Causal => AttnMask::Causal,
        MaskKind::Full => AttnMask::Full,
    };
    match sp.strategy {
        // The double ring runs the ring loop over the steps that run when a window leaves some
        // out (`attention::double_ring`); with every step its traffic is the ring's.
        Strategy::Ring | Strategy::Usp | Strategy::DoubleRing => {
            let rep = kv_replication(shape.heads, shape.kv_heads, u)? as u64;
            // K' as in `attention_traffic`: `rep` times a rank's `b n hkv d el`.
            let kb = b * (shape.seq / (u * r)) as u64 * hkv * d * el * rep;
            let full = ring_traffic(&(0..r).collect::<Vec<_>>(), kb, el);
            let steps = ring_steps(&plan, &AttnCall::new(mask, 1.0).with_window(Some(window)));
            let got = ring_traffic(&steps, kb, el);
            t.forward.exchange = t.forward.exchange - full.forward + got.forward;
            t.backward.exchange = t.backward.exchange - full.backward + got.backward;
            t.forward_steps = got.forward_exchanges;
            t.backward_steps = got.backward_exchanges;
        }
        Strategy::AllGather => {
            let row = b * hkv * d;
            let rows = |q: usize, k: usize| visible_row_count(&plan, kind, window, q, k);
            let by_rank: Vec<(StrategyBytes, StrategyBytes)> = (0..r)
                .map(|i| {
                    let sent: u64 = (0..r).filter(|&j| j != i).map(|j| rows(j, i)).sum();
                    let received: u64 = (0..r).filter(|&j| j != i).map(|j| rows(i, j)).sum();
                    let gathered = 2 * sent * row * el;
                    let fwd = StrategyBytes {
                        all_gather: gathered,
                        ..StrategyBytes::default()
                    };
                    let bwd = StrategyBytes {
                        all_gather: gathered,
                        reduce_scatter: 2 * received * row * 4,
                        ..StrategyBytes::default()
                    };
                    (fwd, bwd)
                })
                .collect();
            let busiest = |f: fn(&(StrategyBytes, StrategyBytes)) -> StrategyBytes| {
                by_rank
                    .iter()
                    .map(f)
                    .max_by_key(|s| s.total())
                    .unwrap_or_default()
            };
            t.forward = busiest(|x| x.0);
            t.backward = busiest(|x| x.1);
        }
        _ => {}
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::SeqLayout;

    fn shape(seq: usize, heads: usize, kv_heads: usize) -> AttnShape {
        AttnShape {
            batch: 1,
            seq,
            heads,
            kv_heads,
            head_dim: 8,
            elem_bytes: 4,
            with_lse: false,
        }
    }

    /// Hand-computed: S 64 over ring 4 -> n 16; K = 16 x 2 x 8 x 4 = 1024 bytes.
    #[test]
    fn ring_by_hand() {
        let t = attention_traffic(&SpConfig::new(Strategy::Ring, 1, 4), &shape(64, 4, 2)).unwrap();
        assert_eq!(t.forward.exchange, 3 * 2 * 1024);
        assert_eq!(t.backward.exchange, 3 * 2 * 1024 + 4 * 2 * 1024);
        assert_eq!((t.forward_steps, t.backward_steps), (3, 7));
        assert_eq!(t.forward.all_to_all + t.backward.all_to_all, 0);
    }

    /// Ulysses 4 with 2 kv heads: rep 2; Q = 16 x 4 x 8 x 4 = 2048, K = 1024, K' = 2048;
    /// a2a(x) = 3x/4.
    #[test]
    fn ulysses_by_hand() {
        let t =
            attention_traffic(&SpConfig::new(Strategy::Ulysses, 4, 1), &shape(64, 4, 2)).unwrap();
        let x = 2 * 1536 + 2 * 1536;
        assert_eq!(t.forward.all_to_all, x);
        assert_eq!(t.backward.all_to_all, x);
        assert_eq!(t.forward.exchange, 0);
    }

    #[test]
    fn double_ring_moves_the_bytes_of_usp() {
        let s = shape(128, 8, 2);
        let usp = attention_traffic(&SpConfig::new(Strategy::Usp, 2, 4), &s).unwrap();
        let dr = attention_traffic(
            &SpConfig::new(Strategy::DoubleRing, 2, 4).with_inner_ring(2),
            &s,
        )
        .unwrap();
        assert_eq!(usp, dr);
    }

    /// ep 4, hidden 8, f32: a row is 32 bytes; the split sizes' all-gathers 3 x 4 x 3 x 8 and
    /// 2 x 4 x 3 x 8; forward 10 rows out (their ids 4 bytes each) and 6 outputs back.
    #[test]
    fn experts_by_hand() {
        let t = expert_traffic(4, 10, 6, 8, 4);
        assert_eq!(t.forward.all_gather, 288);
        assert_eq!(t.forward.exchange, 10 * 32 + 40 + 6 * 32);
        assert_eq!(t.backward.all_gather, 192);
        assert_eq!(t.backward.exchange, 16 * 32);
        assert_eq!((t.forward_calls, t.backward_calls), (3, 2));
        assert_eq!(t.forward.all_to_all + t.backward.reduce_scatter, 0);
        assert_eq!(expert_traffic(1, 10, 6, 8, 4), ExpertTraffic::default());
        // 12 tokens x top-2 over ep 4: 24 rows, 3 of 4 leave the rank.
        assert_eq!(uniform_remote_rows(12, 2, 4), 18);
        assert_eq!(uniform_remote_rows(12, 2, 1), 0);
    }

    /// Windows on 64 tokens over 4 ranks, K = 1024 bytes: the contiguous ring keeps steps 0
    /// and 1 at a window of 4 (one exchange forward; backward one kv, one accumulator hop, one
    /// home), zigzag 0, 1 and 3; a window of 1 sends nothing; a window as long as the sequence
    /// is the full ring. All-gather CP: contiguous, window 4, a rank sends its last 3 keys to
    /// the next (the busiest ranks send 3 rows and receive 3).
    #[test]
    fn windows_by_hand() {
        let s = shape(64, 4, 2);
        let ring = |layout: SeqLayout, w: usize| {
            let sp = SpConfig::new(Strategy::Ring, 1, 4).with_layout(layout);
            let t = windowed_attention_traffic(&sp, &s, w, MaskKind::Causal).unwrap();
            (
                t.forward.exchange,
                t.backward.exchange,
                t.forward_steps,
                t.backward_steps,
            )
        };
        let k = 1024;
        assert_eq!(
            ring(SeqLayout::Contiguous, 4),
            (2 * k, 2 * k + 2 * 2 * k, 1, 3)
        );
        assert_eq!(
            ring(SeqLayout::Zigzag, 4),
            (2 * 2 * k, 2 * 2 * k + 3 * 2 * k, 2, 5)
        );
        assert_eq!(ring(SeqLayout::Contiguous, 1), (0, 0, 0, 0));
        let full = attention_traffic(&SpConfig::new(Strategy::Ring, 1, 4), &s).unwrap();
        let long = windowed_attention_traffic(
            &SpConfig::new(Strategy::Ring, 1, 4),
            &s,
            64,
            MaskKind::Causal,
        )
        .unwrap();
        assert_eq!(long, full);
        let ag = SpConfig::new(Strategy::AllGather, 1, 4).with_layout(SeqLayout::Contiguous);
        let t = windowed_attention_traffic(&ag, &s, 4, MaskKind::Causal).unwrap();
        // A row of k: 2 kv heads x 8 x 4 bytes.
        let row = 2 * 8 * 4;
        assert_eq!(t.forward.all_gather, 2 * 3 * row);
        assert_eq!(t.backward.total(), 2 * 3 * row + 2 * 3 * row);
        assert_eq!(t.forward.exchange + t.backward.exchange, 0);
        // The double ring sends what the ring sends under the window (zigzag, steps 0, 1, 3),
        // and with a window as long as the sequence all of its own steps.
        let dr = SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(2);
        let windowed = windowed_attention_traffic(&dr, &s, 4, MaskKind::Causal).unwrap();
        assert_eq!(
            (windowed.forward.exchange, windowed.backward.exchange),
            (2 * 2 * k, 2 * 2 * k + 3 * 2 * k)
        );
        assert_eq!(
            windowed_attention_traffic(&dr, &s, 64, MaskKind::Causal).unwrap(),
            attention_traffic(&dr, &s).unwrap()
        );
    }

    #[test]
    fn bad_splits_are_errors() {
        assert!(attention_traffic(&SpConfig::new(Strategy::Ring, 1, 3), &shape(64, 4, 2)).is_err());
        assert!(
            attention_traffic(&SpConfig::new(Strategy::Ulysses, 3, 1), &shape(63, 4, 2)).is_err()
        );
    }
}
