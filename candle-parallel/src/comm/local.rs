//! The in-process backend: `N` ranks as threads of one process.
//!
//! Messages are candle tensors handed over through per-pair FIFO queues; a tensor's storage is
//! shared, never copied, on the way (candle tensors are immutable), so the cost of a collective is
//! the work of building its output (concatenation, reduction). Reductions are split across ranks
//! (reduce-scatter then all-gather), so every rank's thread reduces `1/P` of the data.
//!
//! Results that are the same on every rank are built once and shared rather than once per rank:
//! on CPU (f32, f64, bf16, f16) a leader rank (rotating with each call) allocates the output of
//! an `all_reduce` or `all_gather`, and every rank reduces its `1/P` (all_reduce) or copies its
//! input (all_gather) straight into it; elsewhere the leader concatenates once. Ranks then hold the same tensor storage, like a received message: never write into a
//! collective's output in place (`Var::from_tensor` copies, so making a variable of it is safe).
//! Copies into an output stream runs of 4 MiB and more past the caches (`comm/stream_copy.rs`).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_parallel::comm::{LocalWorld, ReduceOp};
//!
//! let sums = LocalWorld::run(4, |comm| {
//!     let x = Tensor::new(&[comm.rank() as f32], &Device::Cpu)?;
//!     let s = comm.all_reduce(&x, ReduceOp::Sum)?;
//!     s.to_vec1::<f32>()
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![6.0f32]; 4]);
//! ```

use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Shape, Tensor};

use super::rules::{
    self, check_dim, check_divisible, check_exchange, check_rank, chunk_bounds, op_code,
    panic_message,
};
use super::traffic::{OpKind, Traffic};
use super::{payload_bytes, Comm, Communicator, Pending, PendingOp, RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// Default time a rank waits for a peer before reporting [`Error::Timeout`] (30 minutes, as
/// PyTorch's default process-group timeout). Override per world with
/// [`LocalWorld::with_timeout`] or with the environment variable `CPL_COMM_TIMEOUT_SECS`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Stack size of each rank thread: candle's backward pass recurses over the graph.
const RANK_STACK_BYTES: usize = 256 << 20;

/// A world of ranks running as threads of this process.
#[derive(Debug, Clone)]
pub struct LocalWorld {
    size: usize,
    timeout: Duration,
}

impl LocalWorld {
    /// A world of `size` ranks with the default timeout (or `CPL_COMM_TIMEOUT_SECS`).
    pub fn new(size: usize) -> Self {
        let timeout = std::env::var("CPL_COMM_TIMEOUT_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Self { size, timeout }
    }

    /// Sets how long a rank waits for a peer's message before failing with a timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs `f` on `size` ranks (threads) and returns each rank's value in rank order.
    /// If any rank fails, returns [`Error::PeerFailed`] naming the first rank that failed.
    pub fn run<T, E, F>(size: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        E: Display,
        F: Fn(Comm) -> std::result::Result<T, E> + Sync,
    {
        Self::new(size).launch(f)
    }

    /// As [`LocalWorld::run`], on this world's size and timeout.
    pub fn launch<T, E, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        E: Display,
        F: Fn(Comm) -> std::result::Result<T, E> + Sync,
    {
        let (results, first_failure) = self.launch_inner(f)?;
        if let Some((rank, reason)) = first_failure {
            return Err(Error::PeerFailed { rank, reason });
        }
        results.into_iter().collect()
    }

    /// Runs `f` on every rank and returns each rank's own outcome: its value, or
    /// [`Error::PeerFailed`] naming that rank with its error (or panic) message.
    pub fn launch_each<T, E, F>(&self, f: F) -> Vec<Result<T>>
    where
        T: Send,
        E: Display,
        F: Fn(Comm) -> std::result::Result<T, E> + Sync,
    {
        match self.launch_inner(f) {
            Ok((results, _)) => results,
            Err(e) => {
                let msg = e.to_string();
                (0..self.size)
                    .map(|rank| {
                        Err(Error::PeerFailed {
                            rank,
                            reason: msg.clone(),
                        })
                    })
                    .collect()
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn launch_inner<T, E, F>(&self, f: F) -> Result<(Vec<Result<T>>, Option<(usize, String)>)>
    where
        T: Send,
        E: Display,
        F: Fn(Comm) -> std::result::Result<T, E> + Sync,
    {
        if self.size == 0 {
            return Err(Error::Layout(
                "a local world needs at least one rank".into(),
            ));
        }
        let shared = Arc::new(Shared::new(self.size, self.timeout));
        let f = &f;
        let results = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(self.size);
            for rank in 0..self.size {
                let rank_shared = shared.clone();
                let comm: Comm = Arc::new(LocalComm::world(shared.clone(), rank));
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .stack_size(RANK_STACK_BYTES)
                    .spawn_scoped(scope, move || {
                        let outcome = match catch_unwind(AssertUnwindSafe(|| f(comm))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(payload) => Err(format!("panicked: {}", panic_message(&payload))),
                        };
                        rank_shared.mark_exited(rank, outcome.as_ref().err());
                        outcome.map_err(|reason| Error::PeerFailed { rank, reason })
                    });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        let reason = format!("could not start the thread of rank {rank}: {e}");
                        shared.mark_exited(rank, Some(&reason));
                        return Err(Error::PeerFailed { rank, reason });
                    }
                }
            }
            Ok(handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|p| {
                        Err(Error::PeerFailed {
                            rank,
                            reason: format!("panicked: {}", panic_message(&p)),
                        })
                    })
                })
                .collect::<Vec<_>>())
        })?;
        let first = shared.lock().failed.clone();
        Ok((results, first))
    }
}

/// A communicator of this rank alone (size 1): for a group that must exist but has no peer,
/// such as the attention of a vision tower that every rank runs whole. Local.
pub fn solo() -> Comm {
    Arc::new(LocalComm::world(
        Arc::new(Shared::new(1, DEFAULT_TIMEOUT)),
        0,
    ))
}

/// A queue is identified by group, group-local source and destination, and channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct QueueKey {
    group: u64,
    src: usize,
    dst: usize,
    p2p: bool,
}

struct Msg {
    /// Collective sequence number of the sender in this group (0 for point-to-point).
    seq: u64,
    kind: OpKind,
    /// Scalar arguments of the call (dim, root, reduce op, split color/key, ...).
    args: Vec<usize>,
    tensor: Option<Tensor>,
    /// The output buffer of an all_reduce or all_gather, sent by the round's leader with its
    /// chunks.
    shared: Option<Arc<fused::SharedOut>>,
}

#[derive(Default)]
struct State {
    queues: HashMap<QueueKey, VecDeque<Msg>>,
    /// The first rank that failed, with its message.
    failed: Option<(usize, String)>,
    exited: Vec<bool>,
    /// (parent group, split sequence number, color) -> group id.
    groups: HashMap<(u64, u64, usize), u64>,
    next_group: u64,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
}

impl Shared {
    fn new(size: usize, timeout: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                exited: vec![false; size],
                next_group: 1,
                ..State::default()
            }),
            cv: Condvar::new(),
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_exited(&self, rank: usize, failure: Option<&String>) {
        let mut st = self.lock();
        st.exited[rank] = true;
        if let Some(reason) = failure {
            if st.failed.is_none() {
                st.failed = Some((rank, reason.clone()));
            }
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// State of one rank's membership in one group; shared with pending exchanges.
struct Endpoint {
    shared: Arc<Shared>,
    group: u64,
    /// World ranks of the group's members, in group-rank order.
    members: Arc<[usize]>,
    rank: usize,
}

impl Endpoint {
    fn world_rank_of(&self, r: usize) -> usize {
        self.members[r]
    }

    fn check_failed(&self, st: &State) -> Result<()> {
        match &st.failed {
            Some((rank, reason)) => Err(Error::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn post(&self, dst: usize, p2p: bool, msg: Msg) -> Result<()> {
        let mut st = self.shared.lock();
        self.check_failed(&st)?;
        let key = QueueKey {
            group: self.group,
            src: self.rank,
            dst,
            p2p,
        };
        st.queues.entry(key).or_default().push_back(msg);
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    fn take(&self, src: usize, p2p: bool, op: &'static str) -> Result<Msg> {
        let key = QueueKey {
            group: self.group,
            src,
            dst: self.rank,
            p2p,
        };
        let start = Instant::now();
        let mut st = self.shared.lock();
        loop {
            self.check_failed(&st)?;
            if let Some(m) = st.queues.get_mut(&key).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            let peer_world = self.world_rank_of(src);
            if st.exited[peer_world] {
                return Err(Error::PeerExited {
                    op,
                    me: self.world_rank_of(self.rank),
                    peer: peer_world,
                });
            }
            let elapsed = start.elapsed();
            if elapsed >= self.shared.timeout {
                return Err(Error::Timeout {
                    op,
                    me: self.world_rank_of(self.rank),
                    peer: peer_world,
                    secs: elapsed.as_secs_f64(),
                });
            }
            let (guard, _) = self
                .shared
                .cv
                .wait_timeout(st, self.shared.timeout - elapsed)
                .unwrap_or_else(|p| p.into_inner());
            st = guard;
        }
    }
}

/// One rank's handle on one group of a [`LocalWorld`].
pub struct LocalComm {
    ep: Arc<Endpoint>,
    seq: AtomicU64,
    traffic: Traffic,
}

impl LocalComm {
    fn world(shared: Arc<Shared>, rank: usize) -> Self {
        let size = shared.lock().exited.len();
        Self {
            ep: Arc::new(Endpoint {
                shared,
                group: 0,
                members: (0..size).collect::<Vec<_>>().into(),
                rank,
            }),
            seq: AtomicU64::new(0),
            traffic: Traffic::new(),
        }
    }

    fn size_(&self) -> usize {
        self.ep.members.len()
    }

    /// Sends one message of the current collective to every other rank.
    fn post_all(
        &self,
        seq: u64,
        kind: OpKind,
        args: &[usize],
        tensor: impl Fn(usize) -> Option<Tensor>,
    ) -> Result<()> {
        for dst in 0..self.size_() {
            if dst != self.ep.rank {
                self.ep.post(
                    dst,
                    false,
                    Msg {
                        seq,
                        kind,
                        args: args.to_vec(),
                        tensor: tensor(dst),
                        shared: None,
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Receives the message of the current collective from `src` and checks that it belongs to
    /// the same call (kind, sequence number, arguments) and has the expected dtype and shape.
    fn take_checked(
        &self,
        src: usize,
        seq: u64,
        kind: OpKind,
        args: &[usize],
        expect: Option<(&Shape, DType)>,
    ) -> Result<Msg> {
        let m = self.ep.take(src, false, kind.name())?;
        let mismatch = |msg: String| Error::Mismatch {
            op: kind.name(),
            me: self.ep.world_rank_of(self.ep.rank),
            peer: self.ep.world_rank_of(src),
            msg,
        };
        if m.kind != kind || m.seq != seq {
            return Err(mismatch(format!(
                "this rank is in collective #{seq} ({}), the peer sent collective #{} ({})",
                kind.name(),
                m.seq,
                m.kind.name()
            )));
        }
        if m.args != args {
            return Err(mismatch(format!(
                "arguments differ: this rank passed {args:?}, the peer passed {:?}",
                m.args
            )));
        }
        if let (Some((shape, dtype)), Some(t)) = (expect, &m.tensor) {
            if t.dtype() != dtype || t.shape() != shape {
                return Err(mismatch(format!(
                    "this rank expects {dtype:?} {:?}, the peer sent {:?} {:?}",
                    shape.dims(),
                    t.dtype(),
                    t.dims()
                )));
            }
        }
        Ok(m)
    }

    /// Sends one tensor-less message of the current collective to `dst`.
    fn post_signal(&self, dst: usize, seq: u64, kind: OpKind, args: &[usize]) -> Result<()> {
        self.ep.post(
            dst,
            false,
            Msg {
                seq,
                kind,
                args: args.to_vec(),
                tensor: None,
                shared: None,
            },
        )
    }

    /// Sends one message of the current collective to `dst`.
    fn post_to(&self, dst: usize, seq: u64, kind: OpKind, args: &[usize], t: Tensor) -> Result<()> {
        self.ep.post(
            dst,
            false,
            Msg {
                seq,
                kind,
                args: args.to_vec(),
                tensor: Some(t),
                shared: None,
            },
        )
    }

    /// The rank that builds the result of collective `seq` when every rank gets the same tensor
    /// (all_gather, all_reduce): building it once and sharing it (candle tensors are immutable)
    /// saves `P - 1` allocations and copies of the output. The role rotates to spread the work.
    fn leader(&self, seq: u64) -> usize {
        (seq % self.size_() as u64) as usize
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn tensor_of(m: Msg, op: &'static str) -> Result<Tensor> {
        m.tensor
            .ok_or_else(|| Error::invalid(op, "internal: a collective message carried no tensor"))
    }

    /// The end of a collective whose ranks fill a shared output (`args[1]` numbers its rounds):
    /// each rank reports its part written; the round's leader wraps the buffer once every part
    /// is, and every rank receives that tensor of `shape`.
    fn complete_shared(
        &self,
        shared: Arc<fused::SharedOut>,
        seq: u64,
        kind: OpKind,
        args: &mut [usize],
        shape: &Shape,
        dtype: DType,
    ) -> Result<Tensor> {
        let (p, me, leader) = (self.size_(), self.ep.rank, self.leader(seq));
        args[1] = 1;
        if me == leader {
            for src in (0..p).filter(|&src| src != me) {
                self.take_checked(src, seq, kind, args, None)?;
            }
            let out = shared.finish(shape)?;
            args[1] = 2;
            self.post_all(seq, kind, args, |_| Some(out.clone()))?;
            Ok(out)
        } else {
            self.post_signal(leader, seq, kind, args)?;
            drop(shared);
            args[1] = 2;
            let m = self.take_checked(leader, seq, kind, args, Some((shape, dtype)))?;
            Self::tensor_of(m, kind.name())
        }
    }

    /// Reduce-scatter over explicit element ranges of a flat tensor; returns this rank's reduced
    /// chunk. Used by `all_reduce` (uneven chunks) and `reduce_scatter` (via narrow views).
    fn reduce_chunks(
        &self,
        chunks: Vec<Tensor>,
        kind: OpKind,
        seq: u64,
        args: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor> {
        let (parts, _) = self.exchange_chunks(chunks, kind, seq, args, None)?;
        reduce_in_rank_order(&parts, op, self.size_())
    }

    /// Sends chunk `j` to rank `j` (with `attach`, if any) and returns this rank's chunk as held
    /// by every rank, in rank order, with the shared output a peer attached, if any.
    fn exchange_chunks(
        &self,
        chunks: Vec<Tensor>,
        kind: OpKind,
        seq: u64,
        args: &[usize],
        attach: Option<&Arc<fused::SharedOut>>,
    ) -> Result<(Vec<Tensor>, Option<Arc<fused::SharedOut>>)> {
        let me = self.ep.rank;
        for (dst, c) in chunks.iter().enumerate() {
            if dst != me {
                self.ep.post(
                    dst,
                    false,
                    Msg {
                        seq,
                        kind,
                        args: args.to_vec(),
                        tensor: Some(c.detach()),
                        shared: attach.cloned(),
                    },
                )?;
            }
        }
        let mine = &chunks[me];
        let mut parts = Vec::with_capacity(self.size_());
        let mut shared = None;
        for src in 0..self.size_() {
            if src == me {
                parts.push(mine.clone());
            } else {
                let mut m =
                    self.take_checked(src, seq, kind, args, Some((mine.shape(), mine.dtype())))?;
                shared = shared.or(m.shared.take());
                parts.push(Self::tensor_of(m, kind.name())?);
            }
        }
        Ok((parts, shared))
    }
}

/// `parts` (equal shapes) concatenated along `dim`, contiguous.
fn concat(parts: &[Tensor], dim: usize) -> Result<Tensor> {
    if let [only] = parts {
        return Ok(only.contiguous()?);
    }
    match fused::concat(parts, dim)? {
        Some(out) => Ok(out),
        // `cat` returns its only input as is, and a strided result for some strided inputs.
        None => Ok(Tensor::cat(parts, dim)?.contiguous()?),
    }
}

/// Combines the ranks' contributions in rank order, in f32 for half-precision inputs.
fn reduce_in_rank_order(parts: &[Tensor], op: ReduceOp, world: usize) -> Result<Tensor> {
    match fused::reduce(parts, op, world)? {
        Some(out) => Ok(out),
        None => rules::reduce_in_rank_order(parts, op, world),
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.ep.rank
    }

    fn size(&self) -> usize {
        self.size_()
    }

    fn world_rank(&self) -> usize {
        self.ep.world_rank_of(self.ep.rank)
    }

    fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_reduce");
        let kind = OpKind::AllReduce;
        let seq = self.next_seq();
        let p = self.size_();
        let me = self.ep.rank;
        let n = x.elem_count();
        let el = x.dtype().size_in_bytes() as u64;
        let flat = x.detach().flatten_all()?;
        let bounds = chunk_bounds(n, p);
        let chunks = bounds
            .iter()
            // Empty chunks (fewer elements than ranks) start at 0: candle places an empty view
            // of a strided tensor past the end of its storage, and its copies then panic.
            .map(|&(s, l)| flat.narrow(0, if l == 0 { 0 } else { s }, l))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // The shape is part of the arguments: chunks alone would not tell [2, 3] from [3, 2].
        let mut args = vec![op_code(op), 0];
        args.extend_from_slice(x.dims());
        let leader = self.leader(seq);
        // On CPU, the leader allocates the output, sends it with its chunks, and every rank
        // reduces its chunk straight into it (see `fused::SharedOut`).
        let own = if me == leader && p > 1 {
            fused::SharedOut::new(x.dtype(), x.device(), n).map(Arc::new)
        } else {
            None
        };
        let (parts, from_leader) = self.exchange_chunks(chunks, kind, seq, &args, own.as_ref())?;
        if let Some(shared) = own.or(from_leader) {
            let (start, len) = bounds[me];
            shared.reduce_into(&parts, op, p, start, len)?;
            drop(parts);
            let out = self.complete_shared(shared, seq, kind, &mut args, x.shape(), x.dtype())?;
            self.traffic.record_all_reduce(&bounds, me, el);
            return Ok(out);
        }
        let reduced = reduce_in_rank_order(&parts, op, p)?;
        drop(parts);
        // All-gather the reduced chunks (second round of the same collective): the round's
        // leader concatenates them once and every rank receives that same tensor.
        args[1] = 1;
        let out = if me == leader {
            let mut parts = Vec::with_capacity(p);
            for (src, &(_, len)) in bounds.iter().enumerate() {
                if src == me {
                    parts.push(reduced.clone());
                } else {
                    let shape = Shape::from(len);
                    let m = self.take_checked(src, seq, kind, &args, Some((&shape, x.dtype())))?;
                    parts.push(Self::tensor_of(m, kind.name())?);
                }
            }
            let out = Tensor::cat(&parts, 0)?.reshape(x.shape())?;
            args[1] = 2;
            self.post_all(seq, kind, &args, |_| Some(out.clone()))?;
            out
        } else {
            self.post_to(leader, seq, kind, &args, reduced)?;
            args[1] = 2;
            let m = self.take_checked(leader, seq, kind, &args, Some((x.shape(), x.dtype())))?;
            Self::tensor_of(m, kind.name())?
        };
        self.traffic.record_all_reduce(&bounds, me, el);
        Ok(out)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_gather");
        let kind = OpKind::AllGather;
        check_dim(kind.name(), x, dim)?;
        let seq = self.next_seq();
        let (p, me) = (self.size_(), self.ep.rank);
        let x = x.detach();
        let mut dims = x.dims().to_vec();
        dims[dim] *= p;
        let shape = Shape::from(dims);
        let leader = self.leader(seq);
        // On CPU, the leader allocates the output and sends it with its input; every rank copies
        // its input straight into its slot (in parallel), and every rank receives the buffer.
        let own = if me == leader && p > 1 {
            fused::SharedOut::new(x.dtype(), x.device(), x.elem_count() * p).map(Arc::new)
        } else {
            None
        };
        let mut args = vec![dim, 0];
        let (parts, from_leader) =
            self.exchange_chunks(vec![x.clone(); p], kind, seq, &args, own.as_ref())?;
        // Every rank has checked every input.
        let out = if let Some(shared) = own.or(from_leader) {
            drop(parts);
            shared.place(&x, fused::Slot::new(&x, dim, me, p))?;
            self.complete_shared(shared, seq, kind, &mut args, &shape, x.dtype())?
        } else if me == leader {
            // The round's leader concatenates the inputs once; every rank receives that tensor.
            let out = concat(&parts, dim)?;
            args[1] = 2;
            self.post_all(seq, kind, &args, |_| Some(out.clone()))?;
            out
        } else {
            drop(parts);
            args[1] = 2;
            let m = self.take_checked(leader, seq, kind, &args, Some((&shape, x.dtype())))?;
            Self::tensor_of(m, kind.name())?
        };
        self.traffic
            .record_symmetric(kind, payload_bytes(&x), self.size_());
        Ok(out)
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("reduce_scatter");
        let kind = OpKind::ReduceScatter;
        check_dim(kind.name(), x, dim)?;
        let c = check_divisible(kind.name(), x, dim, self.size_())?;
        let seq = self.next_seq();
        let chunks = (0..self.size_())
            .map(|j| x.narrow(dim, j * c, c))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let args = [dim, op_code(op)];
        let out = self.reduce_chunks(chunks, kind, seq, &args, op)?;
        self.traffic
            .record_symmetric(kind, payload_bytes(&out), self.size_());
        Ok(out)
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("all_to_all");
        let kind = OpKind::AllToAll;
        check_dim(kind.name(), x, split_dim)?;
        check_dim(kind.name(), x, concat_dim)?;
        let c = check_divisible(kind.name(), x, split_dim, self.size_())?;
        let seq = self.next_seq();
        let args = [split_dim, concat_dim];
        let x = x.detach();
        let pieces = (0..self.size_())
            .map(|j| x.narrow(split_dim, j * c, c))
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.post_all(seq, kind, &args, |dst| Some(pieces[dst].clone()))?;
        let me = self.ep.rank;
        let mut parts = Vec::with_capacity(self.size_());
        for src in 0..self.size_() {
            if src == me {
                parts.push(pieces[me].clone());
            } else {
                let expect = (pieces[me].shape(), x.dtype());
                let m = self.take_checked(src, seq, kind, &args, Some(expect))?;
                parts.push(Self::tensor_of(m, kind.name())?);
            }
        }
        let out = concat(&parts, concat_dim)?;
        self.traffic
            .record_symmetric(kind, payload_bytes(&pieces[me]), self.size_());
        Ok(out)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("broadcast");
        let kind = OpKind::Broadcast;
        check_rank(kind.name(), "root", root, self.size_())?;
        let seq = self.next_seq();
        let args = [root];
        let b = payload_bytes(x);
        if self.ep.rank == root {
            // Made contiguous once here rather than by every receiver.
            let x = x.detach().contiguous()?;
            self.post_all(seq, kind, &args, |_| Some(x.clone()))?;
            self.traffic.record(kind, b * (self.size_() as u64 - 1), 0);
            Ok(x)
        } else {
            let m = self.take_checked(root, seq, kind, &args, Some((x.shape(), x.dtype())))?;
            self.traffic.record(kind, 0, b);
            Ok(Self::tensor_of(m, kind.name())?.contiguous()?)
        }
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("send");
        let kind = OpKind::Send;
        check_rank(kind.name(), "destination", dst, self.size_())?;
        self.ep.post(
            dst,
            true,
            Msg {
                seq: 0,
                kind,
                args: vec![],
                tensor: Some(x.detach()),
                shared: None,
            },
        )?;
        self.traffic.record_send(x, self.ep.rank, dst);
        Ok(())
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let _comm = super::traffic::CommTimer::start("recv");
        let kind = OpKind::Recv;
        check_rank(kind.name(), "source", src, self.size_())?;
        let t = recv_p2p(&self.ep, src, shape, dtype, kind.name())?;
        self.traffic.record_recv(&t, self.ep.rank, src);
        Ok(t)
    }

    fn exchange(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Pending> {
        let _comm = super::traffic::CommTimer::start("exchange");
        check_exchange(&sends, &recvs, self.size_())?;
        self.traffic.record_exchange(&sends, &recvs, self.ep.rank);
        for (dst, t) in sends {
            self.ep.post(
                dst,
                true,
                Msg {
                    seq: 0,
                    kind: OpKind::Send,
                    args: vec![],
                    tensor: Some(t.detach()),
                    shared: None,
                },
            )?;
        }
        Ok(Pending::new(Box::new(LocalPending {
            ep: self.ep.clone(),
            recvs,
        })))
    }

    fn barrier(&self) -> Result<()> {
        let _comm = super::traffic::CommTimer::start("barrier");
        let kind = OpKind::Barrier;
        let seq = self.next_seq();
        self.post_all(seq, kind, &[], |_| None)?;
        for src in 0..self.size_() {
            if src != self.ep.rank {
                self.take_checked(src, seq, kind, &[], None)?;
            }
        }
        self.traffic.record(kind, 0, 0);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Comm> {
        let kind = OpKind::Split;
        let seq = self.next_seq();
        let me = self.ep.rank;
        let mut entries = Vec::with_capacity(self.size_());
        for dst in 0..self.size_() {
            if dst != me {
                self.ep.post(
                    dst,
                    false,
                    Msg {
                        seq,
                        kind,
                        args: vec![color, key],
                        tensor: None,
                        shared: None,
                    },
                )?;
            }
        }
        for src in 0..self.size_() {
            if src == me {
                entries.push((color, key));
            } else {
                let m = self.ep.take(src, false, kind.name())?;
                if m.kind != kind || m.seq != seq || m.args.len() != 2 {
                    return Err(Error::Mismatch {
                        op: kind.name(),
                        me: self.world_rank(),
                        peer: self.ep.world_rank_of(src),
                        msg: format!(
                            "this rank is in collective #{seq} (split), the peer sent collective #{} ({})",
                            m.seq,
                            m.kind.name()
                        ),
                    });
                }
                entries.push((m.args[0], m.args[1]));
            }
        }
        // `entries[src]` is rank src's (color, key).
        let plan = super::plan_split(&entries, me)?;
        let members: Arc<[usize]> = plan
            .members
            .iter()
            .map(|&r| self.ep.world_rank_of(r))
            .collect::<Vec<_>>()
            .into();
        let new_rank = plan.rank;
        let group_id = {
            let mut st = self.ep.shared.lock();
            let next = st.next_group;
            let id = *st.groups.entry((self.ep.group, seq, color)).or_insert(next);
            if id == next {
                st.next_group += 1;
            }
            id
        };
        self.traffic.record(kind, 0, 0);
        Ok(Arc::new(LocalComm {
            ep: Arc::new(Endpoint {
                shared: self.ep.shared.clone(),
                group: group_id,
                members,
                rank: new_rank,
            }),
            seq: AtomicU64::new(0),
            traffic: self.traffic.clone(),
        }))
    }
}

fn recv_p2p(
    ep: &Endpoint,
    src: usize,
    shape: &Shape,
    dtype: DType,
    op: &'static str,
) -> Result<Tensor> {
    let m = ep.take(src, true, op)?;
    let t = m.tensor.ok_or_else(|| {
        Error::invalid(op, "internal: a point-to-point message carried no tensor")
    })?;
    if t.dtype() != dtype || t.shape() != shape {
        return Err(Error::Mismatch {
            op,
            me: ep.world_rank_of(ep.rank),
            peer: ep.world_rank_of(src),
            msg: format!(
                "expected {dtype:?} {:?}, received {:?} {:?}",
                shape.dims(),
                t.dtype(),
                t.dims()
            ),
        });
    }
    // The sender's tensor may be a strided view; outputs are contiguous.
    Ok(t.contiguous()?)
}

struct LocalPending {
    ep: Arc<Endpoint>,
    recvs: Vec<RecvSpec>,
}

impl PendingOp for LocalPending {
    fn wait(self: Box<Self>) -> Result<Vec<Tensor>> {
        self.recvs
            .iter()
            .map(|r| recv_p2p(&self.ep, r.src, &r.shape, r.dtype, OpKind::Exchange.name()))
            .collect()
    }
}

/// One-pass reductions of CPU tensors: every contribution is read once and only the output is
/// allocated, where the generic path allocates a temporary per rank (and an f32 copy of every
/// contribution for half types). The arithmetic is the generic path's, bit for bit: accumulation
/// in rank order, in f32 for bf16/f16, `Avg` as candle's `affine(1/world, 0)`, rounded once.
mod fused {
    use std::mem::MaybeUninit;
    use std::sync::Mutex;

    use candle_core::{DType, Device, Shape, Storage, StridedBlocks, Tensor, WithDType};
    use half::{bf16, f16};

    use super::ReduceOp;
    use crate::comm::stream_copy::copy_run;
    use crate::error::{Error, Result};

    /// Elements combined per pass over the contributions (16 KiB of f32 accumulators).
    const SEGMENT: usize = 4096;
    /// Contiguous reductions of at least this many elements run on candle's CPU thread pool,
    /// in units of `PAR_UNIT` elements, like candle's own element-wise ops.
    const PAR_MIN: usize = 64 * 1024;
    const PAR_UNIT: usize = 4 * SEGMENT;
    /// Strided contributions with shorter contiguous runs are copied to contiguous first.
    const MIN_RUN: usize = 16;

    fn supported(device: &Device, dtype: DType) -> bool {
        device.is_cpu() && matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    fn internal(msg: &str) -> Error {
        Error::invalid("local collective", format!("internal: {msg}"))
    }

    /// The reduction, or `None` where the generic path must do it (other devices or dtypes).
    pub(super) fn reduce(parts: &[Tensor], op: ReduceOp, world: usize) -> Result<Option<Tensor>> {
        let first = &parts[0];
        let n = first.elem_count();
        if n == 0 || !supported(first.device(), first.dtype()) {
            return Ok(None);
        }
        let parts = prepare(parts)?;
        let out = match first.dtype() {
            DType::F32 => new_vec::<f32>(n, |dst| {
                run::<f32, f32>(&parts, op, world, |v| v, |a| a, dst)
            })?,
            DType::F64 => new_vec::<f64>(n, |dst| {
                run::<f64, f64>(&parts, op, world, |v| v, |a| a, dst)
            })?,
            DType::BF16 => new_vec::<bf16>(n, |dst| {
                run::<bf16, f32>(&parts, op, world, bf16::to_f32, bf16::from_f32, dst)
            })?,
            DType::F16 => new_vec::<f16>(n, |dst| {
                run::<f16, f32>(&parts, op, world, f16::to_f32, f16::from_f32, dst)
            })?,
            _ => return Ok(None),
        };
        Ok(Some(out.into_tensor(first.shape(), first.device())?))
    }

    /// A typed CPU buffer.
    enum Buf {
        F32(Vec<f32>),
        F64(Vec<f64>),
        BF16(Vec<bf16>),
        F16(Vec<f16>),
    }

    impl Buf {
        fn into_tensor(self, shape: &Shape, device: &Device) -> Result<Tensor> {
            Ok(match self {
                Buf::F32(v) => Tensor::from_vec(v, shape, device)?,
                Buf::F64(v) => Tensor::from_vec(v, shape, device)?,
                Buf::BF16(v) => Tensor::from_vec(v, shape, device)?,
                Buf::F16(v) => Tensor::from_vec(v, shape, device)?,
            })
        }
    }

    /// Types that `Buf` holds.
    trait BufElem: WithDType {
        fn buf(v: Vec<Self>) -> Buf;
    }
    impl BufElem for f32 {
        fn buf(v: Vec<Self>) -> Buf {
            Buf::F32(v)
        }
    }
    impl BufElem for f64 {
        fn buf(v: Vec<Self>) -> Buf {
            Buf::F64(v)
        }
    }
    impl BufElem for bf16 {
        fn buf(v: Vec<Self>) -> Buf {
            Buf::BF16(v)
        }
    }
    impl BufElem for f16 {
        fn buf(v: Vec<Self>) -> Buf {
            Buf::F16(v)
        }
    }

    /// A vector of `n` elements, every one of which `fill` writes.
    fn new_vec<T: BufElem>(
        n: usize,
        fill: impl FnOnce(&mut [MaybeUninit<T>]) -> Result<()>,
    ) -> Result<Buf> {
        let mut v = Vec::<T>::with_capacity(n);
        fill(&mut v.spare_capacity_mut()[..n])?;
        // SAFETY: `fill` (`run`) initialised all `n` elements, or returned an error.
        unsafe { v.set_len(n) };
        Ok(T::buf(v))
    }

    /// The output of one all_reduce or all_gather, which the ranks fill in place: each rank
    /// reduces its chunk (all_reduce) or copies its input (all_gather) straight into its own
    /// elements, then the round's leader wraps the whole buffer
    /// in a tensor that every rank receives. This replaces `P` chunk allocations and the
    /// leader's concatenation of the chunks by one allocation and no copy.
    pub(super) struct SharedOut {
        /// The buffer (length 0 until [`SharedOut::finish`], which takes it).
        buf: Mutex<Option<Buf>>,
        /// Start of the buffer's allocation, for the ranks' writes.
        base: *mut u8,
        dtype: DType,
        n: usize,
        device: Device,
    }

    // SAFETY: `base` points into the allocation owned by `buf`, which lives as long as `self`
    // (it is only taken by `finish`, after every write). The ranks write through it in disjoint
    // ranges (`reduce_into`, `place`), and `finish` reads only after every rank has reported its write
    // done through the world's mutex-protected queues, which orders the writes before the read.
    unsafe impl Send for SharedOut {}
    unsafe impl Sync for SharedOut {}

    impl SharedOut {
        /// A buffer for `n` elements of `dtype`, or `None` where the generic path must be used.
        pub(super) fn new(dtype: DType, device: &Device, n: usize) -> Option<Self> {
            if n == 0 || !supported(device, dtype) {
                return None;
            }
            fn alloc<T: BufElem>(n: usize) -> (Buf, *mut u8) {
                let mut v = Vec::<T>::with_capacity(n);
                let base = v.as_mut_ptr() as *mut u8;
                (T::buf(v), base)
            }
            let (buf, base) = match dtype {
                DType::F32 => alloc::<f32>(n),
                DType::F64 => alloc::<f64>(n),
                DType::BF16 => alloc::<bf16>(n),
                DType::F16 => alloc::<f16>(n),
                _ => return None,
            };
            Some(Self {
                buf: Mutex::new(Some(buf)),
                base,
                dtype,
                n,
                device: device.clone(),
            })
        }

        /// Reduces `parts` (this rank's chunk as held by every rank, in rank order) into elements
        /// `start..start + len` of the buffer. Each rank calls this once, for its own chunk; the
        /// chunks of the ranks are disjoint and cover the buffer.
        pub(super) fn reduce_into(
            &self,
            parts: &[Tensor],
            op: ReduceOp,
            world: usize,
            start: usize,
            len: usize,
        ) -> Result<()> {
            if start.checked_add(len).is_none_or(|end| end > self.n)
                || parts.iter().any(|p| {
                    p.dtype() != self.dtype || p.elem_count() != len || !p.device().is_cpu()
                })
            {
                return Err(internal("chunk does not fit the shared output"));
            }
            if len == 0 {
                return Ok(());
            }
            let parts = prepare(parts)?;
            let (p, w) = (&parts[..], world);
            match self.dtype {
                DType::F32 => {
                    self.with_range(start, len, |d| run::<f32, f32>(p, op, w, |v| v, |a| a, d))
                }
                DType::F64 => {
                    self.with_range(start, len, |d| run::<f64, f64>(p, op, w, |v| v, |a| a, d))
                }
                DType::BF16 => self.with_range(start, len, |d| {
                    run::<bf16, f32>(p, op, w, bf16::to_f32, bf16::from_f32, d)
                }),
                DType::F16 => self.with_range(start, len, |d| {
                    run::<f16, f32>(p, op, w, f16::to_f32, f16::from_f32, d)
                }),
                _ => Err(internal("unsupported dtype")),
            }
        }

        /// Copies `part` (this rank's input of an all_gather) into its `slot` of the buffer.
        /// Each rank calls this once, for its own slot; the slots are disjoint and cover it.
        pub(super) fn place(&self, part: &Tensor, slot: Slot) -> Result<()> {
            if part.dtype() != self.dtype || !part.device().is_cpu() {
                return Err(internal("part does not fit the shared output"));
            }
            // SAFETY: the buffer holds `n` elements of its dtype, which is the part's, and stays
            // alive during the call; no one reads it before every rank has placed its part, and
            // the ranks' slots are disjoint (see `SharedOut`'s Send/Sync).
            unsafe {
                match self.dtype {
                    DType::F32 => place::<f32>(part, slot, self.base as *mut f32, self.n),
                    DType::F64 => place::<f64>(part, slot, self.base as *mut f64, self.n),
                    DType::BF16 => place::<bf16>(part, slot, self.base as *mut bf16, self.n),
                    DType::F16 => place::<f16>(part, slot, self.base as *mut f16, self.n),
                    _ => Err(internal("unsupported dtype")),
                }
            }
        }

        /// Runs `f` on elements `start..start + len` of the buffer, which must hold `T`s.
        fn with_range<T: WithDType, R>(
            &self,
            start: usize,
            len: usize,
            f: impl FnOnce(&mut [MaybeUninit<T>]) -> R,
        ) -> R {
            assert!(start + len <= self.n && T::DTYPE == self.dtype);
            // SAFETY: these `len` elements of `T` (the buffer's dtype) lie in the allocation,
            // which `self` owns and keeps alive during the call. No one else touches the range:
            // each rank writes only its own chunk, the ranks' chunks are disjoint, and the buffer
            // is read only after every write is done (see `SharedOut`'s Send/Sync).
            let dst = unsafe {
                std::slice::from_raw_parts_mut((self.base as *mut MaybeUninit<T>).add(start), len)
            };
            f(dst)
        }

        /// The buffer as a tensor of `shape`. Call once, after every rank's `reduce_into` is done.
        pub(super) fn finish(&self, shape: &Shape) -> Result<Tensor> {
            if shape.elem_count() != self.n {
                return Err(internal("shape does not fit the shared output"));
            }
            let buf = self
                .buf
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .ok_or_else(|| internal("shared output finished twice"))?;
            // SAFETY: every rank wrote its chunk, and the chunks cover all `n` elements.
            let buf = unsafe {
                match buf {
                    Buf::F32(mut v) => {
                        v.set_len(self.n);
                        Buf::F32(v)
                    }
                    Buf::F64(mut v) => {
                        v.set_len(self.n);
                        Buf::F64(v)
                    }
                    Buf::BF16(mut v) => {
                        v.set_len(self.n);
                        Buf::BF16(v)
                    }
                    Buf::F16(mut v) => {
                        v.set_len(self.n);
                        Buf::F16(v)
                    }
                }
            };
            buf.into_tensor(shape, &self.device)
        }
    }

    /// Where one part goes in a concatenation of `count` equally shaped parts along a dimension:
    /// the output is a sequence of blocks of `count * block` elements, and part `index` fills
    /// elements `index * block .. (index + 1) * block` of every one (`block` = the part's
    /// elements from the concatenation dimension on).
    #[derive(Clone, Copy)]
    pub(super) struct Slot {
        pub index: usize,
        pub count: usize,
        pub block: usize,
    }

    impl Slot {
        /// Slot `index` of `count` parts shaped like `part`, concatenated along `dim`.
        pub(super) fn new(part: &Tensor, dim: usize, index: usize, count: usize) -> Self {
            Self {
                index,
                count,
                block: part.dims()[dim..].iter().product(),
            }
        }
    }

    /// The concatenation of `parts` (equal shapes, any strides) along `dim`, copied run by run
    /// straight into one new buffer, or `None` where the generic path must do it. Candle's
    /// `cat` of strided views (the pieces of an all-to-all) copies element by element.
    pub(super) fn concat(parts: &[Tensor], dim: usize) -> Result<Option<Tensor>> {
        let first = &parts[0];
        let n = first.elem_count() * parts.len();
        if n == 0 || !supported(first.device(), first.dtype()) {
            return Ok(None);
        }
        // Every slot must be written before `set_len`: equal shapes make the slots tile the
        // output (equal element counts alone would not).
        if parts
            .iter()
            .any(|p| p.dims() != first.dims() || p.dtype() != first.dtype() || !p.device().is_cpu())
        {
            return Err(internal(
                "parts of a concatenation differ in shape, dtype or device",
            ));
        }
        let mut dims = first.dims().to_vec();
        dims[dim] *= parts.len();
        fn fill<T: BufElem>(parts: &[Tensor], dim: usize, n: usize) -> Result<Buf> {
            new_vec::<T>(n, |dst| {
                for (index, part) in parts.iter().enumerate() {
                    let slot = Slot::new(part, dim, index, parts.len());
                    // SAFETY: `dst` holds `n` = parts x part elements, which is what the slots
                    // of `parts.len()` parts address; `dst` is borrowed mutably here.
                    unsafe { place(part, slot, dst.as_mut_ptr() as *mut T, n)? };
                }
                Ok(())
            })
        }
        let buf = match first.dtype() {
            DType::F32 => fill::<f32>(parts, dim, n)?,
            DType::F64 => fill::<f64>(parts, dim, n)?,
            DType::BF16 => fill::<bf16>(parts, dim, n)?,
            DType::F16 => fill::<f16>(parts, dim, n)?,
            _ => return Ok(None),
        };
        Ok(Some(buf.into_tensor(&Shape::from(dims), first.device())?))
    }

    /// Copies `part` (any strides) into its `slot` of the `n`-element output at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `n` elements of `T`, the part's dtype, and no one may
    /// read or write the slot's elements during the call.
    unsafe fn place<T: WithDType>(part: &Tensor, slot: Slot, dst: *mut T, n: usize) -> Result<()> {
        let Slot {
            index,
            count,
            block,
        } = slot;
        let total = part.elem_count();
        if index >= count || block == 0 || !total.is_multiple_of(block) || total * count != n {
            return Err(internal("part does not fit its slot of the output"));
        }
        let guard = part.storage_and_layout().0;
        let src = match &*guard {
            Storage::Cpu(c) => c.as_slice::<T>()?,
            _ => return Err(internal("not a CPU tensor")),
        };
        let mut k = 0;
        for (start, len) in runs(part) {
            // The runs must cover the part's elements exactly: the caller's `set_len` relies on
            // every slot being written.
            if k + len > total {
                return Err(internal("a part's runs exceed its elements"));
            }
            let (mut at, mut left) = (start, len);
            while left > 0 {
                let (i, j) = (k / block, k % block);
                let m = left.min(block - j);
                let to = (i * count + index) * block + j;
                // SAFETY: `to + m <= n`: `i < total / block`, `j + m <= block`, so
                // `to + m <= ((i * count + index) + 1) * block <= count * total = n`; the source
                // run lies in the storage; the caller owns the destination range.
                unsafe { copy_run(src[at..at + m].as_ptr(), dst.add(to), m) };
                (at, left, k) = (at + m, left - m, k + m);
            }
        }
        if k != total {
            return Err(internal("a part's runs do not cover its elements"));
        }
        Ok(())
    }

    /// The contributions, with those whose contiguous runs are too short copied to contiguous.
    fn prepare(parts: &[Tensor]) -> Result<Vec<Tensor>> {
        let n = parts[0].elem_count();
        Ok(parts
            .iter()
            .map(|t| {
                if min_run(t) < MIN_RUN.min(n) {
                    t.contiguous()
                } else {
                    Ok(t.clone())
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?)
    }

    fn min_run(t: &Tensor) -> usize {
        match t.strided_blocks() {
            StridedBlocks::SingleBlock { len, .. } => len,
            StridedBlocks::UniformBlocks { block_len, .. }
            | StridedBlocks::MultipleBlocks { block_len, .. } => block_len,
        }
    }

    /// The `(start, len)` runs of contiguous elements of `t` in its storage, in logical order.
    fn runs(t: &Tensor) -> Box<dyn Iterator<Item = (usize, usize)> + '_> {
        match t.strided_blocks() {
            StridedBlocks::SingleBlock { start_offset, len } => {
                Box::new(std::iter::once((start_offset, len)))
            }
            StridedBlocks::UniformBlocks {
                start_offset,
                block_len,
                count,
                src_stride,
            } => Box::new((0..count).map(move |i| (start_offset + i * src_stride, block_len))),
            StridedBlocks::MultipleBlocks {
                block_start_index,
                block_len,
            } => Box::new(block_start_index.map(move |s| (s, block_len))),
        }
    }

    /// Accumulator arithmetic, as candle's binary ops and `affine` compute it.
    trait Acc:
        Copy
        + Send
        + Sync
        + std::ops::Add<Output = Self>
        + std::ops::Mul<Output = Self>
        + PartialOrd
    {
        const ZERO: Self;
        fn from_f64(v: f64) -> Self;
    }
    impl Acc for f32 {
        const ZERO: Self = 0.0;
        fn from_f64(v: f64) -> Self {
            v as f32
        }
    }
    impl Acc for f64 {
        const ZERO: Self = 0.0;
        fn from_f64(v: f64) -> Self {
            v
        }
    }

    /// Reduces `parts` into `dst` (as many elements as each part), writing every element.
    fn run<T: WithDType, A: Acc>(
        parts: &[Tensor],
        op: ReduceOp,
        world: usize,
        load: impl Fn(T) -> A + Copy + Sync,
        store: impl Fn(A) -> T + Copy + Sync,
        dst: &mut [MaybeUninit<T>],
    ) -> Result<()> {
        let guards: Vec<_> = parts.iter().map(|t| t.storage_and_layout().0).collect();
        let srcs = guards
            .iter()
            .map(|g| match &**g {
                Storage::Cpu(c) => Ok(Some(c.as_slice::<T>()?)),
                _ => Ok(None),
            })
            .collect::<candle_core::Result<Option<Vec<&[T]>>>>()?
            .ok_or_else(|| internal("not a CPU tensor"))?;
        let (mul, add) = (A::from_f64(1.0 / world as f64), A::ZERO);
        match op {
            ReduceOp::Sum => combine(parts, &srcs, load, |a, b| a + b, store, dst),
            ReduceOp::Max => combine(parts, &srcs, load, max, store, dst),
            ReduceOp::Avg => combine(
                parts,
                &srcs,
                load,
                |a, b| a + b,
                move |a| store(a * mul + add),
                dst,
            ),
        }
        Ok(())
    }

    /// Candle's `maximum`.
    #[inline(always)]
    fn max<A: PartialOrd>(a: A, b: A) -> A {
        if a < b {
            b
        } else {
            a
        }
    }

    /// The output pointer shared by the units of a parallel reduction.
    struct DstPtr<T>(*mut MaybeUninit<T>);
    // SAFETY: the units of `combine` write disjoint ranges through it.
    unsafe impl<T: Send> Sync for DstPtr<T> {}
    impl<T> DstPtr<T> {
        fn get(&self) -> *mut MaybeUninit<T> {
            self.0
        }
    }

    /// `dst = store(op(...op(op(load(x0), load(x1)), load(x2))..., load(xP-1)))` element-wise.
    /// Contiguous contributions are combined on candle's thread pool when large; strided ones
    /// by walking their contiguous runs in segments of at most [`SEGMENT`] elements.
    fn combine<T: Copy + Send + Sync, A: Acc>(
        parts: &[Tensor],
        srcs: &[&[T]],
        load: impl Fn(T) -> A + Sync,
        op: impl Fn(A, A) -> A + Sync,
        store: impl Fn(A) -> T + Sync,
        dst: &mut [MaybeUninit<T>],
    ) {
        let n = parts[0].elem_count();
        assert_eq!(dst.len(), n, "reduction output of the wrong size");
        let starts: Option<Vec<usize>> = parts
            .iter()
            .map(|t| match t.strided_blocks() {
                StridedBlocks::SingleBlock { start_offset, .. } => Some(start_offset),
                _ => None,
            })
            .collect();
        if let Some(starts) = starts {
            let srcs: Vec<&[T]> = srcs
                .iter()
                .zip(&starts)
                .map(|(s, &o)| &s[o..o + n])
                .collect();
            if n < PAR_MIN {
                combine_slices(&srcs, 0, &load, &op, &store, dst);
                return;
            }
            let out = DstPtr(dst.as_mut_ptr());
            candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(PAR_UNIT), |units| {
                let (lo, hi) = (units.start * PAR_UNIT, (units.end * PAR_UNIT).min(n));
                // SAFETY: `lo..hi` lies in `dst` (`hi <= n = dst.len()`), and the pool hands out
                // disjoint ranges of units, so no two threads write the same elements; `dst` is
                // borrowed mutably for the duration of `execute_chunked`, which returns once
                // every unit is done.
                let d = unsafe { std::slice::from_raw_parts_mut(out.get().add(lo), hi - lo) };
                combine_slices(&srcs, lo, &load, &op, &store, d);
            });
            return;
        }
        let mut blocks: Vec<_> = parts.iter().map(runs).collect();
        // Per contribution: position in its storage and elements left in its current run.
        let mut cursors = vec![(0usize, 0usize); parts.len()];
        let mut acc: Vec<A> = Vec::with_capacity(SEGMENT);
        let mut done = 0;
        while done < n {
            for (c, r) in cursors.iter_mut().zip(blocks.iter_mut()) {
                while c.1 == 0 {
                    *c = r.next().expect("a tensor's runs cover its elements");
                }
            }
            let len = cursors
                .iter()
                .map(|c| c.1)
                .fold(SEGMENT.min(n - done), usize::min);
            acc.clear();
            let p0 = cursors[0].0;
            acc.extend(srcs[0][p0..p0 + len].iter().map(|&v| load(v)));
            for (src, &(p, _)) in srcs[1..].iter().zip(&cursors[1..]) {
                for (a, &v) in acc.iter_mut().zip(&src[p..p + len]) {
                    *a = op(*a, load(v));
                }
            }
            for (d, &a) in dst[done..done + len].iter_mut().zip(&acc) {
                d.write(store(a));
            }
            for c in cursors.iter_mut() {
                c.0 += len;
                c.1 -= len;
            }
            done += len;
        }
    }

    /// [`combine`] of contiguous contributions: `dst[i]` from `srcs[..][lo + i]`.
    fn combine_slices<T: Copy, A: Acc>(
        srcs: &[&[T]],
        lo: usize,
        load: &impl Fn(T) -> A,
        op: &impl Fn(A, A) -> A,
        store: &impl Fn(A) -> T,
        dst: &mut [MaybeUninit<T>],
    ) {
        let mut acc = [A::ZERO; SEGMENT];
        for (k, d) in dst.chunks_mut(SEGMENT).enumerate() {
            let (at, len) = (lo + k * SEGMENT, d.len());
            let acc = &mut acc[..len];
            for (a, &v) in acc.iter_mut().zip(&srcs[0][at..at + len]) {
                *a = load(v);
            }
            for src in &srcs[1..] {
                for (a, &v) in acc.iter_mut().zip(&src[at..at + len]) {
                    *a = op(*a, load(v));
                }
            }
            for (d, &a) in d.iter_mut().zip(acc.iter()) {
                d.write(store(a));
            }
        }
    }
}
