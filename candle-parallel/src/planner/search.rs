//! Every layout of a world that the model, the sequence and the memory allow, ranked by
//! predicted step time.
//!
//! Enumerated: `tp x ulysses x ring x pp x dp = world` (tp dividing the heads, kv heads,
//! intermediate size and vocabulary; ulysses dividing the heads of a tensor-parallel rank; the
//! sequence splitting over the sequence-parallel ranks); for `ring > 1` the ring, all-gather,
//! double-ring (every proper inner ring size) and StarTrail (every team size `C > 1` with `C^2`
//! dividing the ring) attentions; for both `ulysses > 1` and `ring > 1` USP and double ring, each
//! with the head-first and the context-first placement; TP with and without sequence-sharded
//! activations; for a mixture of experts, every expert-parallel degree dividing both the
//! experts and the `ulysses x ring x dp` ranks; every ZeRO stage and checkpointing mode. Layouts whose predicted memory exceeds
//! a rank's share of the device are dropped (and counted).

use crate::attention::{SeqLayout, SpConfig, Strategy};
use crate::error::{Error, Result};
use crate::mesh::{MeshConfig, Placement};
use crate::nn::TpActivations;
use crate::optim::ZeroStage;
use crate::plan::{Layout, MemoryPlan};
use crate::recompute::Checkpointing;

use super::cost::{memory_per_rank, predict, Candidate, Prediction, Workload};
use super::hardware::Hardware;
use super::GIB;

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub work: Workload,
    pub world: usize,
    /// Allow pipeline parallelism.
    pub pipeline: bool,
}

/// The ranked layouts and what was left out.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// Fitting layouts, fastest first (ties: less memory first).
    pub ranked: Vec<(Candidate, Prediction)>,
    /// Layouts the model and sequence allow but the memory does not.
    pub too_big: Vec<(Candidate, Prediction)>,
    /// Bytes a rank may use.
    pub memory_per_rank: f64,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The attention configurations of a `(ulysses, ring)` grid.
fn attentions(u: usize, r: usize) -> Vec<SpConfig> {
    let mut out = Vec::new();
    let placements: &[Placement] = if u > 1 && r > 1 {
        &[Placement::HeadFirst, Placement::ContextFirst]
    } else {
        &[Placement::HeadFirst]
    };
    for &pl in placements {
        let base = |s: Strategy| SpConfig::new(s, u, r).with_placement(pl);
        match (u > 1, r > 1) {
            (false, false) => out.push(base(Strategy::Ring)),
            (true, false) => out.push(base(Strategy::Ulysses)),
            (false, true) => {
                out.push(base(Strategy::Ring));
                out.push(base(Strategy::AllGather));
                for c in (2..r).filter(|c| r.is_multiple_of(c * c)) {
                    out.push(base(Strategy::StarTrail).with_team(c));
                }
            }
            (true, true) => out.push(base(Strategy::Usp)),
        }
        if r > 1 {
            for w in (2..r).filter(|w| r.is_multiple_of(*w)) {
                out.push(base(Strategy::DoubleRing).with_inner_ring(w));
            }
        }
    }
    // Each ring in the contiguous layout too: unbalanced under a causal mask (the last rank's
    // queries see the most keys, `cost::attention_imbalance`), but under a sliding window
    // shorter than a rank's tokens balanced and with the fewest ring steps to send.
    let contiguous: Vec<SpConfig> = out
        .iter()
        .filter(|c| {
            r > 1
                && matches!(
                    c.strategy,
                    Strategy::Ring | Strategy::Usp | Strategy::DoubleRing | Strategy::AllGather
                )
        })
        .map(|c| c.clone().with_layout(SeqLayout::Contiguous))
        .collect();
    out.extend(contiguous);
    out
}

/// Ranks every layout of `req` on `hw`. Errors (never an empty answer) when no layout divides
/// the world, the model and the sequence, or when none fits the memory (naming the smallest
/// prediction against the budget).
pub fn search(req: &Request, hw: &Hardware) -> Result<SearchResult> {
    let w = &req.work;
    w.model.validate()?;
    if req.world == 0 {
        return Err(Error::Layout(
            "the world must have at least one rank".into(),
        ));
    }
    if req.world > hw.devices() {
        return Err(Error::Layout(format!(
            "a world of {} ranks does not fit {} ({} nodes x {} devices)",
            req.world, hw.name, hw.nodes, hw.devices_per_node
        )));
    }
    let budget = memory_per_rank(hw, req.world);
    let mut ranked = Vec::new();
    let mut too_big = Vec::new();
    let mut first_error: Option<Error> = None;
    for tp in divisors(req.world) {
        for u in divisors(req.world / tp) {
            for r in divisors(req.world / (tp * u)) {
                for pp in divisors(req.world / (tp * u * r)) {
                    if pp > 1 && !req.pipeline {
                        continue;
                    }
                    let dp = req.world / (tp * u * r * pp);
                    let mesh = MeshConfig::default()
                        .with_tp(tp)
                        .with_ulysses(u)
                        .with_ring(r)
                        .with_pp(pp)
                        .with_dp(dp);
                    for sp in attentions(u, r) {
                        let tp_modes: &[TpActivations] = if tp > 1 {
                            &[TpActivations::Replicated, TpActivations::SequenceSharded]
                        } else {
                            &[TpActivations::Replicated]
                        };
                        let eps: Vec<usize> = match &w.model.moe {
                            Some(moe) => divisors(u * r * dp)
                                .into_iter()
                                .filter(|ep| moe.experts.is_multiple_of(*ep))
                                .collect(),
                            None => vec![1],
                        };
                        for (&tpa, &ep) in tp_modes
                            .iter()
                            .flat_map(|t| eps.iter().map(move |e| (t, e)))
                        {
                            let layout = Layout::new(
                                mesh.clone().with_placement(sp.placement),
                                sp.clone(),
                                tpa,
                            )
                            .with_expert_parallel(ep);
                            for zero in [
                                ZeroStage::Off,
                                ZeroStage::OptimizerStates,
                                ZeroStage::Gradients,
                                ZeroStage::Parameters,
                            ] {
                                if zero != ZeroStage::Off && u * r * dp == 1 {
                                    continue;
                                }
                                for checkpointing in [
                                    Checkpointing::None,
                                    Checkpointing::Selective,
                                    Checkpointing::Full,
                                ] {
                                    let cand = Candidate {
                                        layout: layout.clone(),
                                        memory: MemoryPlan {
                                            zero,
                                            zero_group: None,
                                            checkpointing,
                                        },
                                    };
                                    match predict(&cand, w, hw) {
                                        Ok(p) if p.memory.total <= budget => ranked.push((cand, p)),
                                        Ok(p) => too_big.push((cand, p)),
                                        Err(e) => {
                                            first_error.get_or_insert(e);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if ranked.is_empty() && too_big.is_empty() {
        return Err(Error::Layout(format!(
            "no layout of {} ranks divides the model ({} heads, {} kv heads, {} layers) and a \
             sequence of {} tokens with {} sequences per step{}",
            req.world,
            w.model.heads,
            w.model.kv_heads,
            w.model.layers,
            w.seq_len,
            w.sequences,
            first_error
                .map(|e| format!(" (for example: {e})"))
                .unwrap_or_default()
        )));
    }
    if ranked.is_empty() {
        let least = too_big
            .iter()
            .map(|(_, p)| p.memory.total)
            .fold(f64::INFINITY, f64::min);
        return Err(Error::Layout(format!(
            "no layout of {} ranks fits a sequence of {} tokens in memory: the leanest needs \
             {:.2} GiB per rank, {} gives {:.2} GiB (more ranks, a shorter sequence, or a \
             smaller --loss-chunk)",
            req.world,
            w.seq_len,
            least / GIB,
            hw.name,
            budget / GIB
        )));
    }
    ranked.sort_by(|a, b| {
        a.1.time
            .total
            .total_cmp(&b.1.time.total)
            .then(a.1.memory.total.total_cmp(&b.1.memory.total))
    });
    Ok(SearchResult {
        ranked,
        too_big,
        memory_per_rank: budget,
    })
}
