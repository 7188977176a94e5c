//! The in-process backend: `N` ranks as threads of one process.
//!
//! Messages are candle tensors handed over through per-pair FIFO queues; a tensor's storage is
//! shared, never copied, on the way (candle tensors are immutable), so the cost of a collective is
//! the work of building its output (concatenation, reduction). Reductions are split across ranks
//! (reduce-scatter then all-gather), so every rank's thread reduces `1/P` of the data.
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
            return Err(Error::Layout("a local world needs at least one rank".into()));
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

fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
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

    fn check_rank(&self, op: &'static str, what: &str, r: usize) -> Result<()> {
        if r >= self.size_() {
            return Err(Error::invalid(
                op,
                format!("{what} {r} is out of range for a communicator of {} ranks", self.size_()),
            ));
        }
        Ok(())
    }

    fn check_dim(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
        if dim >= x.rank() {
            return Err(Error::invalid(
                op,
                format!("dim {dim} is out of range for a tensor of shape {:?}", x.dims()),
            ));
        }
        Ok(())
    }

    fn check_divisible(&self, op: &'static str, x: &Tensor, dim: usize) -> Result<usize> {
        let n = x.dim(dim)?;
        let p = self.size_();
        if n % p != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "dim {dim} of shape {:?} has size {n}, not divisible by the {p} ranks",
                    x.dims()
                ),
            ));
        }
        Ok(n / p)
    }

    /// Sends one message of the current collective to every other rank.
    fn post_all(&self, seq: u64, kind: OpKind, args: &[usize], tensor: impl Fn(usize) -> Option<Tensor>) -> Result<()> {
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

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn tensor_of(m: Msg, op: &'static str) -> Result<Tensor> {
        m.tensor
            .ok_or_else(|| Error::invalid(op, "internal: a collective message carried no tensor"))
    }

    /// Reduce-scatter over explicit element ranges of a flat tensor; returns this rank's reduced
    /// chunk. Used by `all_reduce` (uneven chunks) and `reduce_scatter` (via narrow views).
    fn reduce_chunks(&self, chunks: Vec<Tensor>, kind: OpKind, seq: u64, args: &[usize], op: ReduceOp) -> Result<Tensor> {
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
                    },
                )?;
            }
        }
        let mine = &chunks[me];
        let mut parts = Vec::with_capacity(self.size_());
        for src in 0..self.size_() {
            if src == me {
                parts.push(mine.clone());
            } else {
                let m = self.take_checked(src, seq, kind, args, Some((mine.shape(), mine.dtype())))?;
                parts.push(Self::tensor_of(m, kind.name())?);
            }
        }
        reduce_in_rank_order(&parts, op, self.size_())
    }
}

fn op_code(op: ReduceOp) -> usize {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

/// Combines the ranks' contributions in rank order, in f32 for half-precision inputs.
fn reduce_in_rank_order(parts: &[Tensor], op: ReduceOp, world: usize) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    let acc_dtype = match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    };
    let mut acc = parts[0].to_dtype(acc_dtype)?;
    for p in &parts[1..] {
        let p = p.to_dtype(acc_dtype)?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => (acc + p)?,
            ReduceOp::Max => acc.maximum(&p)?,
        };
    }
    if op == ReduceOp::Avg {
        acc = (acc / world as f64)?;
    }
    Ok(acc.to_dtype(dtype)?.contiguous()?)
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
        let kind = OpKind::AllReduce;
        let seq = self.next_seq();
        let p = self.size_();
        let me = self.ep.rank;
        let n = x.elem_count();
        let el = x.dtype().size_in_bytes() as u64;
        let flat = x.detach().flatten_all()?;
        let bounds: Vec<(usize, usize)> = (0..p)
            .map(|j| {
                let len = n / p + usize::from(j < n % p);
                let start = j * (n / p) + j.min(n % p);
                (start, len)
            })
            .collect();
        let chunks = bounds
            .iter()
            .map(|&(s, l)| flat.narrow(0, s, l))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // The shape is part of the arguments: chunks alone would not tell [2, 3] from [3, 2].
        let mut args = vec![op_code(op), 0];
        args.extend_from_slice(x.dims());
        let reduced = self.reduce_chunks(chunks, kind, seq, &args, op)?;
        // All-gather the reduced chunks (second round of the same collective).
        args[1] = 1;
        let args2 = args;
        self.post_all(seq, kind, &args2, |_| Some(reduced.clone()))?;
        let mut parts = Vec::with_capacity(p);
        for (src, &(_, len)) in bounds.iter().enumerate() {
            if src == me {
                parts.push(reduced.clone());
            } else {
                let shape = Shape::from(len);
                let m = self.take_checked(src, seq, kind, &args2, Some((&shape, x.dtype())))?;
                parts.push(Self::tensor_of(m, kind.name())?);
            }
        }
        let out = Tensor::cat(&parts, 0)?.reshape(x.shape())?;
        let others: u64 = bounds
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .map(|(_, &(_, l))| l as u64)
            .sum();
        let mine = bounds[me].1 as u64 * (p as u64 - 1);
        self.traffic.record(kind, (others + mine) * el, (others + mine) * el);
        Ok(out)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let kind = OpKind::AllGather;
        Self::check_dim(kind.name(), x, dim)?;
        let seq = self.next_seq();
        let args = [dim];
        let x = x.detach();
        self.post_all(seq, kind, &args, |_| Some(x.clone()))?;
        let mut parts = Vec::with_capacity(self.size_());
        for src in 0..self.size_() {
            if src == self.ep.rank {
                parts.push(x.clone());
            } else {
                let m = self.take_checked(src, seq, kind, &args, Some((x.shape(), x.dtype())))?;
                parts.push(Self::tensor_of(m, kind.name())?);
            }
        }
        // `cat` returns its only input as is, and a strided result for some strided inputs.
        let out = Tensor::cat(&parts, dim)?.contiguous()?;
        let b = payload_bytes(&x) * (self.size_() as u64 - 1);
        self.traffic.record(kind, b, b);
        Ok(out)
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let kind = OpKind::ReduceScatter;
        Self::check_dim(kind.name(), x, dim)?;
        let c = self.check_divisible(kind.name(), x, dim)?;
        let seq = self.next_seq();
        let chunks = (0..self.size_())
            .map(|j| x.narrow(dim, j * c, c))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let args = [dim, op_code(op)];
        let out = self.reduce_chunks(chunks, kind, seq, &args, op)?;
        let b = payload_bytes(&out) * (self.size_() as u64 - 1);
        self.traffic.record(kind, b, b);
        Ok(out)
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let kind = OpKind::AllToAll;
        Self::check_dim(kind.name(), x, split_dim)?;
        Self::check_dim(kind.name(), x, concat_dim)?;
        let c = self.check_divisible(kind.name(), x, split_dim)?;
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
        let out = Tensor::cat(&parts, concat_dim)?.contiguous()?;
        let b = payload_bytes(&pieces[me]) * (self.size_() as u64 - 1);
        self.traffic.record(kind, b, b);
        Ok(out)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let kind = OpKind::Broadcast;
        self.check_rank(kind.name(), "root", root)?;
        let seq = self.next_seq();
        let args = [root];
        let b = payload_bytes(x);
        if self.ep.rank == root {
            let x = x.detach();
            self.post_all(seq, kind, &args, |_| Some(x.clone()))?;
            self.traffic.record(kind, b * (self.size_() as u64 - 1), 0);
            Ok(x.contiguous()?)
        } else {
            let m = self.take_checked(root, seq, kind, &args, Some((x.shape(), x.dtype())))?;
            self.traffic.record(kind, 0, b);
            Ok(Self::tensor_of(m, kind.name())?.contiguous()?)
        }
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let kind = OpKind::Send;
        self.check_rank(kind.name(), "destination", dst)?;
        self.ep.post(
            dst,
            true,
            Msg {
                seq: 0,
                kind,
                args: vec![],
                tensor: Some(x.detach()),
            },
        )?;
        let b = if dst == self.ep.rank { 0 } else { payload_bytes(x) };
        self.traffic.record(kind, b, 0);
        Ok(())
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let kind = OpKind::Recv;
        self.check_rank(kind.name(), "source", src)?;
        let t = recv_p2p(&self.ep, src, shape, dtype, kind.name())?;
        let b = if src == self.ep.rank { 0 } else { payload_bytes(&t) };
        self.traffic.record(kind, 0, b);
        Ok(t)
    }

    fn exchange(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Pending> {
        let kind = OpKind::Exchange;
        for (dst, _) in &sends {
            self.check_rank(kind.name(), "destination", *dst)?;
        }
        for r in &recvs {
            self.check_rank(kind.name(), "source", r.src)?;
        }
        let me = self.ep.rank;
        let mut sent = 0;
        for (dst, t) in sends {
            if dst != me {
                sent += payload_bytes(&t);
            }
            self.ep.post(
                dst,
                true,
                Msg {
                    seq: 0,
                    kind: OpKind::Send,
                    args: vec![],
                    tensor: Some(t.detach()),
                },
            )?;
        }
        let recv_bytes: u64 = recvs
            .iter()
            .filter(|r| r.src != me)
            .map(|r| (r.shape.elem_count() * r.dtype.size_in_bytes()) as u64)
            .sum();
        self.traffic.record(kind, sent, recv_bytes);
        Ok(Pending::new(Box::new(LocalPending {
            ep: self.ep.clone(),
            recvs,
        })))
    }

    fn barrier(&self) -> Result<()> {
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
                    },
                )?;
            }
        }
        for src in 0..self.size_() {
            if src == me {
                entries.push((color, key, src));
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
                entries.push((m.args[0], m.args[1], src));
            }
        }
        let mut group: Vec<(usize, usize)> = entries
            .iter()
            .filter(|(c, _, _)| *c == color)
            .map(|&(_, k, r)| (k, r))
            .collect();
        group.sort_unstable();
        let members: Arc<[usize]> = group
            .iter()
            .map(|&(_, r)| self.ep.world_rank_of(r))
            .collect::<Vec<_>>()
            .into();
        let new_rank = group
            .iter()
            .position(|&(_, r)| r == me)
            .ok_or_else(|| Error::invalid("split", "internal: rank missing from its own group"))?;
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

fn recv_p2p(ep: &Endpoint, src: usize, shape: &Shape, dtype: DType, op: &'static str) -> Result<Tensor> {
    let m = ep.take(src, true, op)?;
    let t = m
        .tensor
        .ok_or_else(|| Error::invalid(op, "internal: a point-to-point message carried no tensor"))?;
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
