//! Runs one rank's list of a [`PipelineSchedule`] on its model chunks.
//!
//! The executor owns the communication and the bookkeeping: it receives activations and
//! gradients from the neighbour ranks of the `pp` communicator, makes each received activation
//! a leaf so its gradient can be read, keeps every micro-batch's output until its backward,
//! differentiates `sum(output * received gradient)` (or the loss on the last virtual stage),
//! and sends the input's gradient back. Sends are posted without waiting
//! ([`Communicator::exchange`](crate::comm::Communicator::exchange)), as the validator assumes;
//! they are completed before [`run_schedule`] returns.

use std::collections::{HashMap, VecDeque};

use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor, Var};

use super::schedule::{ActionKind, PipelineSchedule};
use crate::comm::{Comm, Pending, ReduceOp};
use crate::error::{Error, Result};

/// What a rank's model chunks do under a pipeline schedule.
///
/// Virtual stage `chunk * p + rank` is chunk `chunk` of this rank. The first virtual stage
/// reads its micro-batch's input itself; the last computes the loss.
pub trait StageModel {
    /// Shape and dtype of the activation entering `chunk` for `micro_batch` (the gradient
    /// leaving it has the same): what the executor receives.
    fn activation_spec(&self, chunk: usize, micro_batch: usize) -> Result<(Shape, DType)>;

    /// Forward of `chunk` on `micro_batch`. `input` is `None` on the first virtual stage and
    /// the received activation otherwise. Returns the activation for the next virtual stage,
    /// or on the last virtual stage the scalar to differentiate (this micro-batch's share of
    /// the loss).
    fn forward(
        &mut self,
        chunk: usize,
        micro_batch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor>;

    /// Differentiates the scalar `root`, adds this rank's parameter gradients to its own
    /// accumulators, and returns the store (the executor reads the input's gradient from it).
    fn backward(&mut self, root: &Tensor) -> Result<GradStore>;

    /// Lengths of the f64 vectors that travel besides each activation (forward) and each
    /// gradient (backward): statistics the loss needs from every stage (a mixture of experts'
    /// routing). `(0, 0)`, the default: nothing more travels.
    fn carry_lens(&self) -> (usize, usize) {
        (0, 0)
    }

    /// The vector that came with `micro_batch`'s activation into `chunk` (`backward` false) or
    /// with its gradient into `chunk` (true), before that chunk's forward or backward of it.
    fn receive_carry(
        &mut self,
        backward: bool,
        chunk: usize,
        micro_batch: usize,
        carry: Vec<f64>,
    ) -> Result<()> {
        let _ = (backward, chunk, micro_batch, carry);
        Ok(())
    }

    /// The vector to send with `micro_batch`'s activation out of `chunk` (after its forward)
    /// or with its gradient out of `chunk` (after its backward), of [`StageModel::carry_lens`]'s
    /// length.
    fn send_carry(&mut self, backward: bool, chunk: usize, micro_batch: usize) -> Result<Vec<f64>> {
        let _ = (backward, chunk, micro_batch);
        Ok(Vec::new())
    }

    /// Called before the [`StageModel::backward`] of `chunk` on `micro_batch`.
    fn begin_backward(&mut self, chunk: usize, micro_batch: usize) -> Result<()> {
        let _ = (chunk, micro_batch);
        Ok(())
    }
}

/// The gradient accumulators of a pipeline stage over one step: every backward's gradients of
/// the stage's variables (by parameter name) added up in f32.
#[derive(Debug, Default)]
pub struct StageGrads {
    params: Vec<(String, Var)>,
    grads: HashMap<String, Tensor>,
}

impl StageGrads {
    /// Accumulators of `params` (name and the variable differentiated).
    pub fn new(params: Vec<(String, Var)>) -> Self {
        Self {
            params,
            grads: HashMap::new(),
        }
    }

    /// Adds the gradients of the stage's variables found in `store`.
    pub fn add(&mut self, store: &GradStore) -> Result<()> {
        for (name, var) in &self.params {
            if let Some(g) = store.get(var.as_tensor()) {
                let g = g.to_dtype(DType::F32)?;
                let sum = match self.grads.remove(name) {
                    Some(a) => (a + g)?,
                    None => g,
                };
                self.grads.insert(name.clone(), sum);
            }
        }
        Ok(())
    }

    /// The accumulated gradients by name.
    pub fn into_grads(self) -> HashMap<String, Tensor> {
        self.grads
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid("pipeline", msg)
}

/// Where a rank's time went in [`run_schedule`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ExecTimes {
    /// Seconds in the model's forward and backward.
    pub compute: f64,
    /// Seconds from the first action to the last send completed.
    pub wall: f64,
}

impl ExecTimes {
    /// The fraction of the wall time this rank did not compute (waiting for its neighbours,
    /// communicating): the measured bubble.
    pub fn idle(&self) -> f64 {
        if self.wall > 0.0 {
            (1.0 - self.compute / self.wall).max(0.0)
        } else {
            0.0
        }
    }
}

/// Runs rank `comm.rank()`'s actions of `schedule` and returns where its time went. Collective
/// over `comm`, the pipeline communicator (its rank `r` is stage `r`): every rank of it must
/// call this with the same schedule. A failing rank makes the others return the
/// communicator's error naming it.
pub fn run_schedule<M: StageModel>(
    schedule: &PipelineSchedule,
    comm: &Comm,
    model: &mut M,
) -> Result<ExecTimes> {
    let start = std::time::Instant::now();
    let mut compute = 0.0f64;
    let mut timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
        let t = std::time::Instant::now();
        let r = f();
        compute += t.elapsed().as_secs_f64();
        r
    };
    let (p, rank) = (schedule.stages, comm.rank());
    if comm.size() != p {
        return Err(invalid(format!(
            "a schedule for {p} stages on a pipeline group of {} ranks",
            comm.size()
        )));
    }
    let last = schedule.virtual_stages() - 1;
    let owner = |vs: usize| vs % p;
    let (forward_carry, backward_carry) = model.carry_lens();
    let carry_len = |kind: ActionKind| {
        if kind == ActionKind::RecvGradient {
            backward_carry
        } else {
            forward_carry
        }
    };
    // Messages between two ranks arrive in the order they were sent, which need not be the
    // order the receiver uses them in (interleaved schedules, and p = 2 where activations and
    // gradients share one channel). Every rank knows every list: for each sender, the
    // messages it sends here, in order, as (kind, micro-batch, receiving chunk).
    let mut expected: Vec<VecDeque<(ActionKind, usize, usize)>> = vec![VecDeque::new(); p];
    for (src, acts) in schedule.ranks.iter().enumerate() {
        for a in acts {
            let vs = schedule.virtual_stage(src, a.chunk);
            let (kind, to) = match a.kind {
                ActionKind::SendActivation => (ActionKind::RecvActivation, vs + 1),
                ActionKind::SendGradient if vs > 0 => (ActionKind::RecvGradient, vs - 1),
                _ => continue,
            };
            if owner(to) == rank && src != rank {
                expected[src].push_back((kind, a.micro_batch, to / p));
            }
        }
    }
    // Received (or sent to this rank itself) and not yet used: (kind, micro-batch, chunk).
    let mut arrived: HashMap<(ActionKind, usize, usize), Tensor> = HashMap::new();
    let mut inputs: HashMap<(usize, usize), Tensor> = HashMap::new();
    let mut out_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
    // (micro-batch, chunk) -> (input leaf, output), from forward until backward.
    let mut live: HashMap<(usize, usize), (Option<Var>, Tensor)> = HashMap::new();
    let mut in_grads: HashMap<(usize, usize), Tensor> = HashMap::new();
    let mut sends: Vec<Pending> = Vec::new();
    // Posts `t` and the model's carried vector (when it has one) to rank `dst` without
    // waiting, or keeps them when `dst` is this rank. The carry follows its tensor in the same
    // group, so a receiver takes it right after.
    let send = |model: &mut M,
                arrived: &mut HashMap<(ActionKind, usize, usize), Tensor>,
                sends: &mut Vec<Pending>,
                key: (ActionKind, usize, usize),
                from_chunk: usize,
                dst: usize,
                t: Tensor|
     -> Result<()> {
        let backward = key.0 == ActionKind::RecvGradient;
        let carry = if carry_len(key.0) > 0 {
            Some(model.send_carry(backward, from_chunk, key.1)?)
        } else {
            None
        };
        if dst == rank {
            if let Some(c) = carry {
                model.receive_carry(backward, key.2, key.1, c)?;
            }
            // As a transfer would: a gradient computed from this rank's weights must not
            // carry their graph into the previous chunk's backward.
            arrived.insert(key, t.detach());
        } else {
            let device = t.device().clone();
            let mut msgs = vec![(dst, t)];
            if let Some(c) = carry {
                let n = c.len();
                msgs.push((dst, Tensor::from_vec(c, n, &device)?));
            }
            sends.push(comm.exchange(msgs, vec![])?);
        }
        Ok(())
    };
    for a in &schedule.ranks[rank] {
        let _span = tracing::info_span!(
            "pipeline_action",
            kind = ?a.kind,
            micro_batch = a.micro_batch,
            chunk = a.chunk
        )
        .entered();
        let key = (a.micro_batch, a.chunk);
        let vs = schedule.virtual_stage(rank, a.chunk);
        let missing = |what: &str| invalid(format!("rank {rank} at {a}: no {what}"));
        match a.kind {
            ActionKind::RecvActivation | ActionKind::RecvGradient => {
                let want = (a.kind, a.micro_batch, a.chunk);
                let src = if a.kind == ActionKind::RecvActivation {
                    owner(vs + p * schedule.chunks - 1)
                } else {
                    owner(vs + 1)
                };
                // Receive from `src` in its send order until the wanted message is here.
                while !arrived.contains_key(&want) {
                    let next = expected[src].pop_front().ok_or_else(|| {
                        invalid(format!("rank {rank} at {a}: rank {src} sends nothing more"))
                    })?;
                    let (shape, dtype) = model.activation_spec(next.2, next.1)?;
                    arrived.insert(next, comm.recv(src, &shape, dtype)?);
                    let n = carry_len(next.0);
                    if n > 0 {
                        let c = comm.recv(src, &Shape::from(n), DType::F64)?;
                        let backward = next.0 == ActionKind::RecvGradient;
                        model.receive_carry(backward, next.2, next.1, c.to_vec1::<f64>()?)?;
                    }
                }
                let t = arrived.remove(&want).ok_or_else(|| missing("message"))?;
                if a.kind == ActionKind::RecvActivation {
                    inputs.insert(key, t);
                } else {
                    out_grads.insert(key, t);
                }
            }
            ActionKind::Forward if schedule.forward_only => {
                let x = inputs.remove(&key);
                if x.is_none() && vs > 0 {
                    return Err(missing("received input"));
                }
                let mut out = None;
                timed(&mut || {
                    out = Some(model.forward(a.chunk, a.micro_batch, x.as_ref())?);
                    Ok(())
                })?;
                let out = out.ok_or_else(|| missing("forward output"))?;
                if vs < last {
                    live.insert(key, (None, out.detach()));
                }
            }
            ActionKind::Forward => {
                let leaf = match inputs.remove(&key) {
                    Some(x) => Some(Var::from_tensor(&x)?),
                    None if vs == 0 => None,
                    None => return Err(missing("received input")),
                };
                let mut out = None;
                timed(&mut || {
                    let x = leaf.as_ref().map(|v| v.as_tensor());
                    out = Some(model.forward(a.chunk, a.micro_batch, x)?);
                    Ok(())
                })?;
                let out = out.ok_or_else(|| missing("forward output"))?;
                live.insert(key, (leaf, out));
            }
            ActionKind::SendActivation => {
                let out = if schedule.forward_only {
                    live.remove(&key).map(|(_, o)| o)
                } else {
                    live.get(&key).map(|(_, o)| o.clone())
                };
                let out = out.ok_or_else(|| missing("forward output"))?;
                let to = vs + 1;
                send(
                    model,
                    &mut arrived,
                    &mut sends,
                    (ActionKind::RecvActivation, a.micro_batch, to / p),
                    a.chunk,
                    owner(to),
                    out.detach(),
                )?;
            }
            ActionKind::Backward => {
                let (leaf, out) = live.remove(&key).ok_or_else(|| missing("forward"))?;
                let root = if vs == last {
                    out
                } else {
                    let g = out_grads
                        .remove(&key)
                        .ok_or_else(|| missing("received gradient"))?;
                    (out * g)?.sum_all()?
                };
                model.begin_backward(a.chunk, a.micro_batch)?;
                let mut store = None;
                timed(&mut || {
                    store = Some(model.backward(&root)?);
                    Ok(())
                })?;
                let store = store.ok_or_else(|| missing("gradients"))?;
                if let Some(leaf) = leaf {
                    let g = match store.get(leaf.as_tensor()) {
                        Some(g) => g.clone(),
                        // The input does not reach the output (cannot happen in a transformer,
                        // but the gradient is then zero, not missing).
                        None => leaf.as_tensor().zeros_like()?,
                    };
                    in_grads.insert(key, g);
                }
            }
            ActionKind::SendGradient => {
                let g = in_grads
                    .remove(&key)
                    .ok_or_else(|| missing("input gradient"))?;
                let to = vs.checked_sub(1).ok_or_else(|| missing("previous stage"))?;
                send(
                    model,
                    &mut arrived,
                    &mut sends,
                    (ActionKind::RecvGradient, a.micro_batch, to / p),
                    a.chunk,
                    owner(to),
                    g,
                )?;
            }
        }
    }
    for s in sends {
        s.wait()?;
    }
    if let Some((mb, c)) = live.keys().next() {
        return Err(invalid(format!(
            "rank {rank}: micro-batch {mb} of chunk {c} ran forward without backward"
        )));
    }
    Ok(ExecTimes {
        compute,
        wall: start.elapsed().as_secs_f64(),
    })
}

/// Completes a pipeline step on every rank of `pp` (collective over it): the gradients of the
/// parameters that both the first and the last stage hold (`shared`: name and the variable,
/// whose shape gives a zero gradient where that stage did not use it) are summed between those
/// two ranks, so the two copies stay equal after the optimizer step; and every rank gets the
/// step's loss sum, computed on the last stage (`loss_sum`: this rank's part, 0 elsewhere).
/// Returns this rank's gradients and the loss sum.
pub fn finish_step(
    pp: &Comm,
    mut grads: HashMap<String, Tensor>,
    shared: &[(String, Var)],
    loss_sum: f64,
) -> Result<(HashMap<String, Tensor>, f64)> {
    let (p, rank) = (pp.size(), pp.rank());
    let ends_rank = rank == 0 || rank + 1 == p;
    // Ranks 0 and p - 1 form one group; every other rank is alone.
    let ends_group = pp.split(if ends_rank { 0 } else { 1 + rank }, rank)?;
    if ends_rank && ends_group.size() > 1 {
        for (name, var) in shared {
            let g = match grads.remove(name) {
                Some(g) => g,
                None => var.as_tensor().to_dtype(DType::F32)?.zeros_like()?,
            };
            grads.insert(name.clone(), ends_group.all_reduce(&g, ReduceOp::Sum)?);
        }
    }
    let loss = pp
        .all_reduce(
            &Tensor::new(&[loss_sum], &candle_core::Device::Cpu)?,
            ReduceOp::Sum,
        )?
        .to_vec1::<f64>()?[0];
    Ok((grads, loss))
}
