//! Activation checkpointing: run a block (a transformer layer, say) without keeping its
//! intermediate activations, and recompute them in the backward pass.
//!
//! [`checkpoint`] runs `block(x)` and records one node whose backward recomputes the block from
//! its saved input, backpropagates through the recomputed graph and returns the gradient of
//! `x`. The modes ([`Checkpointing`]):
//!
//! | mode        | kept per block until backward          | recomputed in backward                 |
//! |-------------|----------------------------------------|----------------------------------------|
//! | `None`      | every intermediate activation          | nothing                                |
//! | `Full`      | the block's input                      | the whole block, attention included    |
//! | `Selective` | the input, attention's `out` and `lse` | everything but attention (LoongTrain's Selective Checkpoint++): q, k, v are recomputed and attention's backward runs from the kept `out` and `lse` ([`SequenceParallelAttention::backward`]), so attention's forward and its communication run once |
//!
//! Recomputation is exact: the block runs the same kernels on the same inputs, so outputs and
//! gradients are bit-identical to `None` (`tests/recompute.rs` asserts it for every strategy).
//!
//! Communication: `Full` runs the block's forward collectives twice (attention's kv ring, the
//! tensor-parallel all-reduces). `Selective` repeats the tensor-parallel ones but not
//! attention's forward: for ring attention it sends exactly what `None` sends (asserted in
//! `tests/memory.rs`). Strategies whose backward works on another layout of q, k, v than the
//! caller's redo that move in the explicit backward: Ulysses, USP and the double ring
//! all-to-all q, k, v, out and lse to the head-parallel layout again, StarTrail re-gathers its
//! team's q, k, v and re-places the kv block.
//!
//! **Parameter gradients.** The recomputation's backward computes the gradients of the block's
//! parameters inside the node's backward, where candle offers no way to hand them to the outer
//! [`GradStore`]. They go to a [`GradSink`] instead, and the caller merges them after
//! `backward()`: use [`GradSink::backward`] in place of `loss.backward()`. A parameter whose
//! gradient is in the sink but not merged simply appears to receive none (trainers assert
//! every parameter's gradient).
//!
//! Collectives inside the block (tensor-parallel all-reduces, ring attention) run again during
//! recomputation, on every rank in the same order, since every rank recomputes the same blocks
//! in the same order of the backward pass.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use crate::attention::op::record_attention;
use crate::attention::{AttnCall, AttnOut, Grads, Qkv, Saved, SequenceParallelAttention, SpGroup};
use crate::error::{Error, Result};

/// Which activations a checkpointed block keeps; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Checkpointing {
    /// Keep every activation.
    #[default]
    None,
    /// Keep each block's input; recompute the block, attention included.
    Full,
    /// Also keep attention's output and lse; recompute everything but attention.
    Selective,
}

impl Checkpointing {
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Full => "full",
            Self::Selective => "selective",
        }
    }
}

impl std::fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Checkpointing {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Self::None),
            "full" => Ok(Self::Full),
            "selective" => Ok(Self::Selective),
            other => Err(Error::invalid(
                "checkpointing",
                format!("{other:?}: expected none, full or selective"),
            )),
        }
    }
}

/// Parameter gradients computed by the backward of recomputed blocks, waiting to be merged into
/// the [`GradStore`] of the `backward()` call that produced them. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct GradSink(Arc<Mutex<HashMap<TensorId, Tensor>>>);

impl std::fmt::Debug for GradSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSink")
            .field("pending", &self.lock().len())
            .finish()
    }
}

impl GradSink {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TensorId, Tensor>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds the gradients in `grads` of every variable among `vars` but `skip`.
    fn deposit(&self, vars: &[&Tensor], grads: &GradStore, skip: TensorId) -> Result<()> {
        let mut pending = self.lock();
        for v in vars.iter().filter(|v| v.id() != skip) {
            let Some(g) = grads.get(v) else { continue };
            // Detached: candle detaches a gradient when it passes through a node, but a
            // variable's comes straight from the op that consumed it, and may still reference
            // that op's inputs (the block's recomputed activations), which the sink would then
            // keep alive until the merge (every block's, at once).
            let g = g.detach();
            let g = match pending.remove(&v.id()) {
                Some(acc) => (acc + g)?,
                None => g,
            };
            pending.insert(v.id(), g);
        }
        Ok(())
    }

    /// Moves every pending gradient into `grads` (added to a gradient already there).
    pub fn merge_into(&self, grads: &mut GradStore) -> Result<()> {
        let pending = std::mem::take(&mut *self.lock());
        for (id, g) in pending {
            let g = match grads.get_id(id) {
                Some(existing) => (existing + g)?,
                None => g,
            };
            grads.insert_id(id, g);
        }
        Ok(())
    }

    /// `loss.backward()` with the gradients of recomputed blocks merged in: the gradients of
    /// every variable `loss` depends on, whether or not it sits in a checkpointed block.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut grads = loss.backward()?;
        self.merge_into(&mut grads)?;
        Ok(grads)
    }

    /// Whether no gradient is waiting to be merged.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// A block as [`checkpoint`] runs it: `(x, attention) -> y`. It must compute the same function
/// every time it is called (no randomness that is not seeded by its inputs) and use the
/// attention it is given for every attention call.
pub type Block =
    Arc<dyn Fn(&Tensor, &dyn SequenceParallelAttention) -> Result<Tensor> + Send + Sync>;

/// Runs `block` on `x` with `attention` under `mode` and returns `y`. With `mode` other than
/// `None`, only `x` (and for `Selective` each attention call's `out` and `lse`) is kept until
/// backward, where the block is recomputed; the gradients of the block's parameters go to
/// `sink`. Collective exactly as the block is. If `x` tracks no gradient it is made a `Var`
/// (a copy), so that the node is recorded on every rank.
pub fn checkpoint(
    mode: Checkpointing,
    x: &Tensor,
    attention: &Arc<dyn SequenceParallelAttention>,
    sink: &GradSink,
    block: Block,
) -> Result<Tensor> {
    if mode == Checkpointing::None {
        return block(x, attention.as_ref());
    }
    let x = if x.track_op() {
        x.clone()
    } else {
        Var::from_tensor(x)?.as_tensor().clone()
    };
    // Forward without keeping anything: the graph the block builds is dropped with `y`.
    let (y, kept) = match mode {
        Checkpointing::Selective => {
            let rec = Recording::new(attention.as_ref());
            let y = block(&x.detach(), &rec)?.detach();
            (y, rec.into_kept())
        }
        _ => (block(&x.detach(), attention.as_ref())?.detach(), Vec::new()),
    };
    let saved_x = x.detach();
    let attention = attention.clone();
    let sink = sink.clone();
    let kept = Mutex::new(Some(kept));
    let backward = move |g: &Tensor| -> Result<Tensor> {
        let _span = tracing::info_span!("recompute", mode = %mode).entered();
        let xv = Var::from_tensor(&saved_x)?;
        let y2 = match mode {
            Checkpointing::Selective => {
                let kept = kept
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .ok_or_else(|| {
                        Error::invalid("checkpoint", "selective block backpropagated twice")
                    })?;
                let replay = Replay::new(attention.clone(), kept);
                let y2 = block(xv.as_tensor(), &replay)?;
                replay.finish()?;
                y2
            }
            _ => block(xv.as_tensor(), attention.as_ref())?,
        };
        let objective = (y2 * g.detach())?.sum_all()?;
        let grads = objective.backward()?;
        let vars: Vec<&Tensor> = objective
            .sorted_nodes()
            .into_iter()
            .filter(|t| t.is_variable())
            .collect();
        sink.deposit(&vars, &grads, xv.as_tensor().id())?;
        match grads.get(xv.as_tensor()) {
            Some(dx) => Ok(dx.clone()),
            None => Ok(saved_x.zeros_like()?),
        }
    };
    Ok(crate::collectives::record(
        &x,
        "cpl-checkpoint",
        move |_| Ok(y),
        backward,
    )?)
}

/// What one attention call of a selective block keeps: its output and lse.
type Kept = (Tensor, Tensor);

/// The attention a selective block's first forward sees: runs the real one on detached inputs
/// and keeps `(out, lse)`.
struct Recording<'a> {
    inner: &'a dyn SequenceParallelAttention,
    kept: Mutex<Vec<Kept>>,
}

impl<'a> Recording<'a> {
    fn new(inner: &'a dyn SequenceParallelAttention) -> Self {
        Self {
            inner,
            kept: Mutex::new(Vec::new()),
        }
    }

    fn into_kept(self) -> Vec<Kept> {
        self.kept.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

impl SequenceParallelAttention for Recording<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn group(&self) -> &SpGroup {
        self.inner.group()
    }

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (out, lse) = self.inner.forward(&qkv.detached(), call, true)?;
        let lse = lse.ok_or_else(|| Error::invalid(self.name(), "the strategy returned no lse"))?;
        self.kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((out.clone(), lse.clone()));
        Ok((out, want_lse.then_some(lse)))
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        self.inner.backward(saved, dout, call)
    }
}

/// The attention a selective block's recomputation sees: returns the kept `out` (in order of
/// the calls) as a node of the recomputed q, k, v whose backward is the strategy's
/// [`SequenceParallelAttention::backward`].
struct Replay {
    inner: Arc<dyn SequenceParallelAttention>,
    kept: Mutex<VecDeque<Kept>>,
}

impl Replay {
    fn new(inner: Arc<dyn SequenceParallelAttention>, kept: Vec<Kept>) -> Self {
        Self {
            inner,
            kept: Mutex::new(kept.into()),
        }
    }

    /// Errors if the recomputation made fewer attention calls than the forward.
    fn finish(&self) -> Result<()> {
        let left = self.kept.lock().unwrap_or_else(|p| p.into_inner()).len();
        if left > 0 {
            return Err(Error::invalid(
                "checkpoint",
                format!("the recomputed block made {left} fewer attention calls than its forward"),
            ));
        }
        Ok(())
    }
}

impl SequenceParallelAttention for Replay {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn group(&self) -> &SpGroup {
        self.inner.group()
    }

    fn forward(&self, qkv: &Qkv, call: &AttnCall, want_lse: bool) -> Result<AttnOut> {
        let (out, lse) = self
            .kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front()
            .ok_or_else(|| {
                Error::invalid(
                    "checkpoint",
                    "the recomputed block made more attention calls than its forward",
                )
            })?;
        if out.dims() != qkv.q.dims() {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "recomputed q has shape {:?}, the kept attention output {:?}",
                    qkv.q.dims(),
                    out.dims()
                ),
            ));
        }
        let (inner, call) = (self.inner.clone(), call.clone());
        let out = record_attention("cpl-replayed-attention", qkv, out, &lse, move |s, dout| {
            inner.backward(s, dout, &call)
        })?;
        Ok((out, want_lse.then_some(lse)))
    }

    fn backward(&self, saved: &Saved, dout: &Tensor, call: &AttnCall) -> Result<Grads> {
        self.inner.backward(saved, dout, call)
    }
}
