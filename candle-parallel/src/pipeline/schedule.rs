//! Pipeline schedules as data: every rank's ordered list of [`Action`]s, generated for GPipe,
//! 1F1B and interleaved 1F1B, for any number of micro-batches (also not a multiple of the
//! stages, Llama 3's flexible pipeline, and fewer than the stages), and checked by
//! [`PipelineSchedule::validate`] before anything runs.
//!
//! Model chunks: with `v` chunks per rank ([`ScheduleKind::Interleaved`]; 1 otherwise) the model
//! is cut into `p * v` virtual stages and chunk `c` of rank `r` is virtual stage `c * p + r`
//! (Megatron's looped placement): activations go round the ranks `v` times.
//!
//! Communication semantics the validator assumes, and the executor must give: a send never
//! waits for its receiver (it is buffered or posted asynchronously); a receive waits for its
//! message. Under these, a schedule that the validator runs to the end cannot deadlock.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::error::{Error, Result};

/// Which schedule to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ScheduleKind {
    /// Every forward, then every backward (GPipe). Holds all `m` micro-batches' activations.
    #[cfg_attr(feature = "clap", value(name = "gpipe"))]
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward after a warm-up of `p - rank - 1` forwards (PipeDream-Flush,
    /// Megatron's default). Holds at most `p - rank` micro-batches' activations.
    #[cfg_attr(feature = "clap", value(name = "1f1b"))]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `v` model chunks per rank (Megatron's virtual pipeline): the bubble shrinks by
    /// `v`, point-to-point traffic grows by `v`.
    #[cfg_attr(feature = "clap", value(name = "interleaved"))]
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl std::fmt::Display for ScheduleKind {
    /// The name `--pp-schedule` takes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        })
    }
}

/// What a rank does at one step of its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActionKind {
    /// Run the chunk's forward on the micro-batch.
    Forward,
    /// Run the chunk's backward on the micro-batch (frees its activations).
    Backward,
    /// Send the forward's output to the next virtual stage.
    SendActivation,
    /// Receive the chunk's input from the previous virtual stage.
    RecvActivation,
    /// Send the gradient of the chunk's input to the previous virtual stage.
    SendGradient,
    /// Receive the gradient of the chunk's output from the next virtual stage.
    RecvGradient,
}

/// One step of a rank's schedule: `kind` for `micro_batch` on the rank's model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub kind: ActionKind,
    pub micro_batch: usize,
    pub chunk: usize,
}

impl std::fmt::Display for Action {
    /// torch's notation: `F3`, `B3`, `SEND_F3`, ... with `.c1` for chunk 1 of an interleaved
    /// schedule.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = match self.kind {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::SendActivation => "SEND_F",
            ActionKind::RecvActivation => "RECV_F",
            ActionKind::SendGradient => "SEND_B",
            ActionKind::RecvGradient => "RECV_B",
        };
        write!(f, "{k}{}", self.micro_batch)?;
        if self.chunk > 0 {
            write!(f, ".c{}", self.chunk)?;
        }
        Ok(())
    }
}

/// Every rank's list of actions for one optimizer step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSchedule {
    /// The schedule these lists were generated for.
    pub kind: ScheduleKind,
    /// Pipeline ranks `p`.
    pub stages: usize,
    /// Micro-batches `m` per step.
    pub micro_batches: usize,
    /// Model chunks `v` per rank.
    pub chunks: usize,
    /// `ranks[r]`: rank `r`'s actions, in order.
    pub ranks: Vec<Vec<Action>>,
    /// Forwards only (evaluation, [`PipelineSchedule::forward_only`]): no backward, and an
    /// activation is dropped once sent.
    pub forward_only: bool,
}

/// What [`PipelineSchedule::validate`] measured by running the schedule with unit costs
/// (forward 1, backward 2, communication 0).
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleStats {
    /// Most micro-batch activations (forwards not yet backwarded, over all chunks) each rank
    /// held at once.
    pub peak_in_flight: Vec<usize>,
    /// Time from the start to the last rank's last action.
    pub makespan: f64,
    /// Each rank's idle fraction of the makespan.
    pub bubble: Vec<f64>,
    /// Each rank's start time of every compute action, in its list's order (for the timetable).
    pub starts: Vec<Vec<(Action, f64)>>,
}

impl ScheduleStats {
    /// Mean idle fraction over the ranks.
    pub fn mean_bubble(&self) -> f64 {
        self.bubble.iter().sum::<f64>() / self.bubble.len().max(1) as f64
    }
}

/// Cost of a forward and of a backward in [`PipelineSchedule::validate`]'s simulation.
const FORWARD_COST: f64 = 1.0;
const BACKWARD_COST: f64 = 2.0;

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid("pipeline schedule", msg)
}

impl PipelineSchedule {
    /// Generates `kind` for `stages` ranks, `micro_batches` per step and `chunks` model chunks
    /// per rank (1 unless `kind` is [`ScheduleKind::Interleaved`]), and validates it.
    ///
    /// Errors (never a schedule that hangs): zero stages or micro-batches, `chunks != 1` for
    /// GPipe and 1F1B, `chunks < 2` for interleaved, or a combination the schedule cannot run.
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
        chunks: usize,
    ) -> Result<Self> {
        if stages == 0 {
            return Err(invalid("the pipeline needs at least one stage"));
        }
        if micro_batches == 0 {
            return Err(invalid("a step needs at least one micro-batch"));
        }
        match kind {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if chunks != 1 => {
                return Err(invalid(format!(
                    "{chunks} model chunks per rank need the interleaved schedule \
                     (gpipe and 1f1b run one chunk per rank)"
                )))
            }
            ScheduleKind::Interleaved if chunks < 2 => {
                return Err(invalid(format!(
                    "the interleaved schedule needs at least 2 model chunks per rank, got {chunks}"
                )))
            }
            _ => {}
        }
        let compute_orders = match kind {
            ScheduleKind::GPipe => vec![gpipe_order(micro_batches); stages],
            ScheduleKind::OneFOneB | ScheduleKind::Interleaved => {
                one_f_one_b_orders(stages, micro_batches, chunks)?
            }
        };
        Self::from_compute_orders(kind, stages, micro_batches, chunks, &compute_orders)
    }

    /// A schedule from each rank's order of forwards and backwards (`compute_orders[r]`, only
    /// [`ActionKind::Forward`] and [`ActionKind::Backward`]), as torchtitan loads one from a
    /// CSV file: each forward gets its receive before and send after, each backward likewise,
    /// and the whole is validated. `kind` names the schedule the orders follow.
    ///
    /// Errors: not one order per stage, a communication action in an order, or any defect
    /// [`PipelineSchedule::validate`] finds (a deadlock, a missing or repeated action).
    pub fn from_compute_orders(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
        chunks: usize,
        compute_orders: &[Vec<Action>],
    ) -> Result<Self> {
        if compute_orders.len() != stages {
            return Err(invalid(format!(
                "{} compute orders for {stages} stages",
                compute_orders.len()
            )));
        }
        if let Some((r, a)) = compute_orders.iter().enumerate().find_map(|(r, o)| {
            o.iter()
                .find(|a| !matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
                .map(|a| (r, a))
        }) {
            return Err(invalid(format!(
                "rank {r}'s compute order holds {a}: only forwards and backwards (the \
                 communication is added)"
            )));
        }
        let ranks = compute_orders
            .iter()
            .enumerate()
            .map(|(r, order)| with_communication(order, r, stages, chunks))
            .collect();
        let s = Self {
            kind,
            stages,
            micro_batches,
            chunks,
            ranks,
            forward_only: false,
        };
        s.validate().map_err(|e| {
            invalid(format!(
                "{kind} cannot run {micro_batches} micro-batches on {stages} stages with \
                 {chunks} chunk(s) per rank: {e}"
            ))
        })?;
        Ok(s)
    }

    /// An evaluation schedule: every micro-batch through every virtual stage, forwards only,
    /// in micro-batch order, for `stages` ranks with `chunks` model chunks each (any number:
    /// the chunks of a rank are consecutive virtual stages `c * p + rank`). Validated.
    pub fn forward_only(stages: usize, micro_batches: usize, chunks: usize) -> Result<Self> {
        if stages == 0 || micro_batches == 0 || chunks == 0 {
            return Err(invalid(
                "an evaluation pipeline needs at least one stage, micro-batch and chunk",
            ));
        }
        let order: Vec<Action> = (0..micro_batches)
            .flat_map(|mb| (0..chunks).map(move |c| compute(ActionKind::Forward, mb, c)))
            .collect();
        let ranks = (0..stages)
            .map(|r| with_communication(&order, r, stages, chunks))
            .collect();
        let s = Self {
            kind: ScheduleKind::GPipe,
            stages,
            micro_batches,
            chunks,
            ranks,
            forward_only: true,
        };
        s.validate()?;
        Ok(s)
    }

    /// The virtual stage of `chunk` on `rank`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// Virtual stages in all: `p * v`.
    pub fn virtual_stages(&self) -> usize {
        self.stages * self.chunks
    }

    /// The fraction of a step each rank idles in theory, with equal stages and backward twice
    /// the forward: `(p - 1) / (v m + p - 1)`.
    pub fn bubble_formula(&self) -> f64 {
        let p = self.stages as f64;
        (p - 1.0) / ((self.chunks * self.micro_batches) as f64 + p - 1.0)
    }

    /// Runs every rank's list with unit costs and checks it: every action names an existing
    /// chunk and micro-batch, a forward has its input (received, or the first virtual stage), a
    /// backward follows its forward and has its output gradient (received, or the last virtual
    /// stage), every send is received by the right neighbour and every receive sent, each
    /// (micro-batch, virtual stage) runs forward and backward exactly once, activations in
    /// flight never go negative and end at zero, and no rank waits forever (a deadlock is
    /// reported with what each stuck rank waits for).
    pub fn validate(&self) -> Result<ScheduleStats> {
        self.simulate(None)
    }

    /// [`PipelineSchedule::validate`] with stages of unequal cost: virtual stage `vs`'s forward
    /// takes `forward_costs[vs]` and its backward twice that (e.g. each stage's FLOPs over the
    /// mean stage's, [`super::StageCosts::of`]): the bubble of a model's actual split. Errors
    /// as `validate`, or when the costs are not one positive finite number per virtual stage.
    pub fn validate_weighted(&self, forward_costs: &[f64]) -> Result<ScheduleStats> {
        let n = self.stages * self.chunks;
        if forward_costs.len() != n {
            return Err(invalid(format!(
                "{} stage costs for {n} virtual stages",
                forward_costs.len()
            )));
        }
        if let Some(c) = forward_costs.iter().find(|c| !c.is_finite() || **c <= 0.0) {
            return Err(invalid(format!(
                "a stage cost of {c}: costs must be finite and positive"
            )));
        }
        self.simulate(Some(forward_costs))
    }

    /// The run behind [`PipelineSchedule::validate`] (`weights`: each virtual stage's forward
    /// cost, unit when `None`).
    fn simulate(&self, weights: Option<&[f64]>) -> Result<ScheduleStats> {
        let (p, v, m) = (self.stages, self.chunks, self.micro_batches);
        let weight = |vs: usize| weights.map_or(1.0, |w| w[vs]);
        if self.ranks.len() != p {
            return Err(invalid(format!(
                "{} rank lists for {p} stages",
                self.ranks.len()
            )));
        }
        let last = p * v - 1;
        let owner = |vs: usize| vs % p;
        // Messages posted and not yet received: (kind, micro-batch, receiving virtual stage) ->
        // post time. Activations travel vs -> vs + 1, gradients vs -> vs - 1.
        let mut posted: HashMap<(ActionKind, usize, usize), f64> = HashMap::new();
        let mut done_fwd: HashSet<(usize, usize)> = HashSet::new();
        let mut done_bwd: HashSet<(usize, usize)> = HashSet::new();
        let mut have_input: HashSet<(usize, usize)> = HashSet::new();
        let mut have_grad: HashSet<(usize, usize)> = HashSet::new();
        let mut next = vec![0usize; p];
        let mut clock = vec![0.0f64; p];
        let mut busy = vec![0.0f64; p];
        let mut in_flight = vec![0usize; p];
        let mut peak = vec![0usize; p];
        let mut starts: Vec<Vec<(Action, f64)>> = vec![Vec::new(); p];
        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(&a) = self.ranks[r].get(next[r]) {
                    let at = |what: &str| format!("rank {r}, action {} ({a}): {what}", next[r]);
                    if a.chunk >= v || a.micro_batch >= m {
                        return Err(invalid(at("no such chunk or micro-batch")));
                    }
                    let vs = a.chunk * p + r;
                    let key = (a.micro_batch, vs);
                    match a.kind {
                        ActionKind::Forward => {
                            if vs > 0 && !have_input.contains(&key) {
                                return Err(invalid(at("forward before its input was received")));
                            }
                            if !done_fwd.insert(key) {
                                return Err(invalid(at("second forward of this micro-batch")));
                            }
                            starts[r].push((a, clock[r]));
                            clock[r] += FORWARD_COST * weight(vs);
                            busy[r] += FORWARD_COST * weight(vs);
                            if !self.forward_only {
                                in_flight[r] += 1;
                                peak[r] = peak[r].max(in_flight[r]);
                            }
                        }
                        ActionKind::Backward if self.forward_only => {
                            return Err(invalid(at("backward in a forward-only schedule")));
                        }
                        ActionKind::Backward => {
                            if !done_fwd.contains(&key) {
                                return Err(invalid(at("backward before its forward")));
                            }
                            if vs < last && !have_grad.contains(&key) {
                                return Err(invalid(at(
                                    "backward before its output gradient was received",
                                )));
                            }
                            if !done_bwd.insert(key) {
                                return Err(invalid(at("second backward of this micro-batch")));
                            }
                            in_flight[r] = in_flight[r]
                                .checked_sub(1)
                                .ok_or_else(|| invalid(at("activations in flight below zero")))?;
                            starts[r].push((a, clock[r]));
                            clock[r] += BACKWARD_COST * weight(vs);
                            busy[r] += BACKWARD_COST * weight(vs);
                        }
                        ActionKind::SendActivation | ActionKind::SendGradient => {
                            let fwd = a.kind == ActionKind::SendActivation;
                            let ready = if fwd {
                                done_fwd.contains(&key)
                            } else {
                                done_bwd.contains(&key)
                            };
                            if !ready {
                                return Err(invalid(at("send before the computation it sends")));
                            }
                            let to = match (fwd, vs) {
                                (true, vs) if vs < last => vs + 1,
                                (false, vs) if vs > 0 => vs - 1,
                                _ => return Err(invalid(at("no neighbour to send to"))),
                            };
                            let recv_kind = if fwd {
                                ActionKind::RecvActivation
                            } else {
                                ActionKind::RecvGradient
                            };
                            if posted
                                .insert((recv_kind, a.micro_batch, to), clock[r])
                                .is_some()
                            {
                                return Err(invalid(at("the same message sent twice")));
                            }
                        }
                        ActionKind::RecvActivation | ActionKind::RecvGradient => {
                            let fwd = a.kind == ActionKind::RecvActivation;
                            if (fwd && vs == 0) || (!fwd && vs == last) {
                                return Err(invalid(at("no neighbour to receive from")));
                            }
                            let Some(t) = posted.remove(&(a.kind, a.micro_batch, vs)) else {
                                break; // waits for the message
                            };
                            clock[r] = clock[r].max(t);
                            if fwd {
                                have_input.insert(key);
                            } else {
                                have_grad.insert(key);
                            }
                        }
                    }
                    next[r] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|r| next[r] == self.ranks[r].len()) {
                break;
            }
            if !progressed {
                let stuck: Vec<String> = (0..p)
                    .filter(|&r| next[r] < self.ranks[r].len())
                    .map(|r| {
                        let a = self.ranks[r][next[r]];
                        let from = if a.kind == ActionKind::RecvActivation {
                            owner(a.chunk * p + r + p * v - 1)
                        } else {
                            owner(a.chunk * p + r + 1)
                        };
                        format!("rank {r} waits at {a} for rank {from}")
                    })
                    .collect();
                return Err(invalid(format!("deadlock: {}", stuck.join("; "))));
            }
        }
        if let Some(((kind, mb, vs), _)) = posted.iter().next() {
            return Err(invalid(format!(
                "a message for micro-batch {mb} to virtual stage {vs} ({kind:?}) is never received"
            )));
        }
        for mb in 0..m {
            for vs in 0..p * v {
                let backward_done = self.forward_only || done_bwd.contains(&(mb, vs));
                if !done_fwd.contains(&(mb, vs)) || !backward_done {
                    return Err(invalid(format!(
                        "micro-batch {mb} does not run forward and backward on virtual stage {vs}"
                    )));
                }
            }
        }
        if let Some(r) = (0..p).find(|&r| in_flight[r] != 0) {
            return Err(invalid(format!(
                "rank {r} ends with {} activations in flight",
                in_flight[r]
            )));
        }
        let makespan = clock.iter().cloned().fold(0.0, f64::max);
        let bubble = busy
            .iter()
            .map(|b| {
                if makespan > 0.0 {
                    1.0 - b / makespan
                } else {
                    0.0
                }
            })
            .collect();
        Ok(ScheduleStats {
            peak_in_flight: peak,
            makespan,
            bubble,
            starts,
        })
    }

    /// Per-rank timetable of the unit-cost run (`F`/`B` with micro-batch, `.cN` for chunk N,
    /// one column per time unit, `.` idle), then the bubble against the formula.
    pub fn render(&self) -> Result<String> {
        let stats = self.validate()?;
        let width = stats.makespan.ceil() as usize;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} schedule: {} stages x {} micro-batches x {} chunk(s) per rank \
             (forward 1 time unit, backward 2)",
            self.kind, self.stages, self.micro_batches, self.chunks
        );
        for (r, starts) in stats.starts.iter().enumerate() {
            let mut cells = vec![String::from("."); width];
            for &(a, t) in starts {
                let len = if a.kind == ActionKind::Forward {
                    FORWARD_COST
                } else {
                    BACKWARD_COST
                } as usize;
                let t = t as usize;
                cells[t] = a.to_string();
                for c in cells.iter_mut().skip(t + 1).take(len - 1) {
                    *c = String::from("-");
                }
            }
            let cell_w = cells.iter().map(|c| c.len()).max().unwrap_or(1);
            let row: Vec<String> = cells.iter().map(|c| format!("{c:<cell_w$}")).collect();
            let _ = writeln!(
                out,
                "rank {r}: {}  | peak {} in flight, idle {:.1}%",
                row.join(" "),
                stats.peak_in_flight[r],
                100.0 * stats.bubble[r]
            );
        }
        let _ = writeln!(
            out,
            "bubble: {:.1}% of the step (mean over ranks); formula (p-1)/(v*m+p-1) = {:.1}%",
            100.0 * stats.mean_bubble(),
            100.0 * self.bubble_formula()
        );
        Ok(out)
    }
}

/// GPipe's compute order: all forwards, then all backwards, in micro-batch order.
fn gpipe_order(m: usize) -> Vec<Action> {
    let f = (0..m).map(|mb| compute(ActionKind::Forward, mb, 0));
    let b = (0..m).map(|mb| compute(ActionKind::Backward, mb, 0));
    f.chain(b).collect()
}

fn compute(kind: ActionKind, micro_batch: usize, chunk: usize) -> Action {
    Action {
        kind,
        micro_batch,
        chunk,
    }
}

/// 1F1B's compute order on every rank (interleaved when `v > 1`), by list scheduling: the
/// ranks are run with unit costs (forward 1, backward 2); a free rank alternates (after a
/// backward a ready forward goes first, otherwise a ready backward) and starts a forward only
/// while it holds fewer than its limit of activations
/// (`p - rank` for one chunk, the warm-up plus one, `2 (p - rank - 1) + (v - 1) g + 1`, for
/// several, `g` the longest of the [`Rounds`]), else waits. Among ready actions it takes
/// Megatron's order: micro-batches round by round, forwards chunk by chunk, backwards with the
/// chunks reversed. With `m` a multiple of `p` the rounds are Megatron's groups of `p` and
/// the orders Megatron's (tested); for any `m` (Llama 3's flexible pipeline) the bubble is the
/// formula `(p - 1) / (v m + p - 1)` once `m >= p`, and bubble and activation peaks equal
/// PyTorch's `ScheduleInterleaved1F1B` wherever it accepts `m` (tested). With fewer
/// micro-batches than stages: when every rank is idle and none may start a forward under its
/// limit, the limit is lifted for that moment instead of a hang. The order is that of a
/// valid run, so it cannot deadlock under buffered sends.
fn one_f_one_b_orders(p: usize, m: usize, v: usize) -> Result<Vec<Vec<Action>>> {
    let last = p * v - 1;
    let rounds = Rounds::new(p, m);
    let limit = |r: usize| {
        if v == 1 {
            p - r
        } else {
            2 * (p - r - 1) + (v - 1) * rounds.largest() + 1
        }
    };
    // Megatron's order among ready actions of one rank, round by round.
    let key = |a: &Action| {
        let c = if a.kind == ActionKind::Forward {
            a.chunk
        } else {
            v - 1 - a.chunk
        };
        (rounds.of(a.micro_batch), c, a.micro_batch)
    };
    // Time at which (micro-batch, virtual stage)'s input / output gradient is available.
    let mut input_at: HashMap<(usize, usize), u64> = (0..m).map(|mb| ((mb, 0), 0)).collect();
    let mut grad_at: HashMap<(usize, usize), u64> = HashMap::new();
    let mut pending_f: Vec<Vec<Action>> = (0..p)
        .map(|_| {
            (0..v)
                .flat_map(|c| (0..m).map(move |mb| compute(ActionKind::Forward, mb, c)))
                .collect()
        })
        .collect();
    let mut pending_b: Vec<Vec<Action>> = vec![Vec::new(); p];
    let mut free_at = vec![0u64; p];
    let mut in_flight = vec![0usize; p];
    let mut orders: Vec<Vec<Action>> = vec![Vec::new(); p];
    let mut last_kind: Vec<Option<ActionKind>> = vec![None; p];
    let total = 2 * m * v;
    let mut t = 0u64;
    // Set when no rank could start anything under its limit: the next pass lets ranks exceed
    // it (a ready forward always exists then), so a schedule never stalls.
    let mut over_limit = false;
    while orders.iter().map(Vec::len).sum::<usize>() < p * total {
        let mut any_running = false;
        let mut started = false;
        for r in 0..p {
            if free_at[r] > t {
                any_running = true;
                continue;
            }
            let vs = |a: &Action| a.chunk * p + r;
            let ready_b = pending_b[r]
                .iter()
                .filter(|a| {
                    vs(a) == last
                        || grad_at
                            .get(&(a.micro_batch, vs(a)))
                            .is_some_and(|&g| g <= t)
                })
                .min_by_key(|a| key(a))
                .copied();
            let ready_f = || {
                pending_f[r]
                    .iter()
                    .filter(|a| {
                        input_at
                            .get(&(a.micro_batch, vs(a)))
                            .is_some_and(|&i| i <= t)
                    })
                    .min_by_key(|a| key(a))
                    .copied()
            };
            let may_f = over_limit || in_flight[r] < limit(r);
            // One forward, one backward: after a backward a forward goes first.
            let pick = if last_kind[r] == Some(ActionKind::Backward) && may_f {
                ready_f().or(ready_b)
            } else {
                ready_b.or_else(|| if may_f { ready_f() } else { None })
            };
            let Some(a) = pick else { continue };
            let (mb, s) = (a.micro_batch, vs(&a));
            if a.kind == ActionKind::Forward {
                pending_f[r].retain(|x| *x != a);
                pending_b[r].push(compute(ActionKind::Backward, mb, a.chunk));
                in_flight[r] += 1;
                free_at[r] = t + FORWARD_COST as u64;
                if s < last {
                    input_at.insert((mb, s + 1), free_at[r]);
                }
            } else {
                pending_b[r].retain(|x| *x != a);
                in_flight[r] -= 1;
                free_at[r] = t + BACKWARD_COST as u64;
                if s > 0 {
                    grad_at.insert((mb, s - 1), free_at[r]);
                }
            }
            orders[r].push(a);
            last_kind[r] = Some(a.kind);
            any_running = true;
            started = true;
        }
        if !any_running {
            if over_limit {
                return Err(invalid("no rank can make progress"));
            }
            over_limit = true;
            continue;
        }
        if started {
            over_limit = false;
        }
        t += 1;
    }
    Ok(orders)
}

/// The interleaved schedule's rounds: torchtitan's flexible rounds, `max(1, m / p)` of them,
/// as even as `m` allows (the first `m % rounds` one micro-batch longer), so each holds at least
/// `p` micro-batches when `m >= p`. Megatron's groups of `p` when `m` is a multiple of `p`; one
/// round of all `m` when `m < p`. (PyTorch takes only `m` that its rounds divide; `m = 13, p = 4`
/// here runs rounds of 5, 4 and 4.)
struct Rounds {
    size: usize,
    longer: usize,
}

impl Rounds {
    fn new(p: usize, m: usize) -> Self {
        let count = (m / p).max(1);
        Self {
            size: m / count,
            longer: m % count,
        }
    }

    /// Micro-batches in the longest round.
    fn largest(&self) -> usize {
        self.size + usize::from(self.longer > 0)
    }

    /// The round of micro-batch `mb < m`.
    fn of(&self, mb: usize) -> usize {
        let in_longer = self.longer * (self.size + 1);
        if mb < in_longer {
            mb / (self.size + 1)
        } else {
            self.longer + (mb - in_longer) / self.size
        }
    }
}

/// Wraps each compute action of `rank` with its communication: receive the input before a
/// forward (unless first virtual stage), send the output after it (unless last); receive the
/// output gradient before a backward (unless last), send the input gradient after (unless
/// first).
fn with_communication(compute_order: &[Action], rank: usize, p: usize, v: usize) -> Vec<Action> {
    let last = p * v - 1;
    let mut out = Vec::with_capacity(compute_order.len() * 3);
    for &a in compute_order {
        let vs = a.chunk * p + rank;
        let with = |kind| Action { kind, ..a };
        match a.kind {
            ActionKind::Forward => {
                if vs > 0 {
                    out.push(with(ActionKind::RecvActivation));
                }
                out.push(a);
                if vs < last {
                    out.push(with(ActionKind::SendActivation));
                }
            }
            ActionKind::Backward => {
                if vs < last {
                    out.push(with(ActionKind::RecvGradient));
                }
                out.push(a);
                if vs > 0 {
                    out.push(with(ActionKind::SendGradient));
                }
            }
            _ => out.push(a),
        }
    }
    out
}
