//! How ranks talk: one [`Communicator`] abstraction over candle [`Tensor`]s, with backends.
//!
//! Contract shared by every backend:
//! - Collectives (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`,
//!   `barrier`, `split`) must be called by every rank of the communicator, in the same order,
//!   with tensors of the same shape and dtype (except where a method says otherwise). A mismatch
//!   is reported as [`Error::Mismatch`] instead of corrupting data.
//! - dtype and shape are preserved; inputs may be non-contiguous; outputs are contiguous.
//! - Point-to-point messages between one pair of ranks arrive in the order they were sent.
//!   A receiver names the shape and dtype it expects, as NCCL needs preallocated buffers.
//! - [`Communicator::exchange`] posts a batch of sends and receives at once (NCCL's grouped
//!   send/recv) and returns a [`Pending`] handle, so a ring step can compute while its next
//!   block is in flight.
//! - Every backend records, per rank and per [`OpKind`], the calls and the payload bytes sent to
//!   and received from *other* ranks (see [`traffic`] for the exact counting rules).
//! - If a rank fails, the other ranks' pending or next operation returns [`Error::PeerFailed`]
//!   naming it (local backend), instead of hanging.
//!
//! Backends: [`local`] (ranks as threads of one process; the default on CPU and in tests),
//! behind the `mpi` feature `mpi` (one process per rank through OpenMPI), and behind the `nccl`
//! feature `nccl` (CUDA tensors, one process per GPU; bootstrapped by [`nccl_bootstrap`]).

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod nccl_bootstrap;
// Used by the NCCL communicator; tested in every build.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod p2p;
mod rules;
mod stream_copy;
pub mod traffic;

use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

pub use local::{solo, LocalWorld, DEFAULT_TIMEOUT};
pub use traffic::{take_comm_seconds, CommTimer, OpKind, OpStats, Traffic, TrafficSnapshot};

use crate::error::{Error, Result};

/// The reduction applied by `all_reduce` and `reduce_scatter`.
///
/// Reductions accumulate in f32 for bf16/f16 inputs and combine the ranks' contributions in rank
/// order, so every rank obtains bit-identical results and runs are deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
}

/// A communicator shared by the code of one rank.
pub type Comm = Arc<dyn Communicator>;

/// A group of ranks that exchange candle tensors.
pub trait Communicator: Send + Sync {
    /// This rank's index in the communicator, `0..size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the communicator.
    fn size(&self) -> usize;

    /// Element-wise reduction over all ranks; every rank receives the full result.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Concatenates every rank's `x` along `dim`, in rank order. All inputs share one shape.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor>;

    /// Reduces over ranks, then rank `r` keeps the `r`-th of `size` equal chunks along `dim`.
    /// `x.dim(dim)` must be divisible by `size`.
    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;

    /// Splits `x` into `size` equal chunks along `split_dim`, sends chunk `j` to rank `j`, and
    /// concatenates the chunks received from every rank along `concat_dim`, in rank order.
    /// With (batch, seq/P, heads, d) input, `split_dim = 2, concat_dim = 1` is Ulysses'
    /// sequence-to-head exchange; the inverse is `split_dim = 1, concat_dim = 2`.
    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor>;

    /// Every rank receives `root`'s tensor. Other ranks pass a tensor of the same shape and
    /// dtype (its values are ignored), which is how NCCL sizes its buffers.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;

    /// Blocking send of `x` to `dst`. It may return before `dst` has received the message.
    fn send(&self, x: &Tensor, dst: usize) -> Result<()>;

    /// Blocking receive of a tensor of `shape` and `dtype` from `src`.
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor>;

    /// Posts all `sends` and `recvs` as one group and returns at once; [`Pending::wait`] returns
    /// the received tensors in the order of `recvs`. Deadlock-free whatever the order in which
    /// ranks post their groups, as with NCCL's `groupStart`/`groupEnd`.
    fn exchange(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Pending>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Sends consecutive chunks of the rows (dim 0) of `x`, `send_counts[j]` rows to rank `j`
    /// (any count may be 0; they sum to `x.dim(0)`), and returns the rows received from every
    /// rank, concatenated in rank order, with the number that came from each. Every rank
    /// passes the same trailing shape and dtype. Collective: an all-gather of the counts, then
    /// one [`Communicator::exchange`] of the non-empty chunks (so every backend has it). The
    /// exchange of expert parallelism's tokens, whose counts follow the routing.
    fn all_to_all_v(&self, x: &Tensor, send_counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        let (p, me) = (self.size(), self.rank());
        let rows = x.dims().first().copied().unwrap_or(0);
        if send_counts.len() != p || send_counts.iter().sum::<usize>() != rows {
            return Err(Error::invalid(
                "all_to_all_v",
                format!(
                    "{} send counts summing to {} for {p} ranks and {rows} rows",
                    send_counts.len(),
                    send_counts.iter().sum::<usize>()
                ),
            ));
        }
        let counts: Vec<f64> = send_counts.iter().map(|&c| c as f64).collect();
        let all = self
            .all_gather(&Tensor::from_vec(counts, (1, p), x.device())?, 0)?
            .to_vec2::<f64>()?;
        let recv_counts: Vec<usize> = all.iter().map(|row| row[me] as usize).collect();
        let starts: Vec<usize> = send_counts
            .iter()
            .scan(0, |s, &c| {
                let at = *s;
                *s += c;
                Some(at)
            })
            .collect();
        let sends = (0..p)
            .filter(|&j| j != me && send_counts[j] > 0)
            .map(|j| Ok((j, x.narrow(0, starts[j], send_counts[j])?)))
            .collect::<Result<Vec<_>>>()?;
        let trailing = &x.dims()[1.min(x.rank())..];
        let from: Vec<usize> = (0..p).filter(|&j| j != me && recv_counts[j] > 0).collect();
        let recvs = from
            .iter()
            .map(|&j| {
                let mut shape = vec![recv_counts[j]];
                shape.extend_from_slice(trailing);
                RecvSpec::new(j, shape, x.dtype())
            })
            .collect();
        let mut got = self.exchange(sends, recvs)?.wait()?.into_iter();
        let mut parts = Vec::new();
        for (j, &n) in recv_counts.iter().enumerate() {
            if j == me {
                parts.push(x.narrow(0, starts[me], send_counts[me])?);
            } else if n > 0 {
                parts.push(got.next().ok_or_else(|| {
                    Error::invalid("all_to_all_v", format!("no rows arrived from rank {j}"))
                })?);
            }
        }
        Ok((Tensor::cat(&parts, 0)?, recv_counts))
    }

    /// Collective: ranks passing the same `color` form a new communicator, ordered by `key`
    /// then by rank in this communicator.
    fn split(&self, color: usize, key: usize) -> Result<Comm>;

    /// The per-rank traffic accounting; shared by every communicator split from the same rank.
    fn traffic(&self) -> &Traffic;

    /// This rank's index in the world this communicator was split from.
    fn world_rank(&self) -> usize;
}

/// A communicator prints as its rank and size (so that structs holding one derive `Debug`).
impl std::fmt::Debug for dyn Communicator + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank(), self.size())
    }
}

/// The group a rank joins in a split: its members as ranks of the parent communicator, in the
/// new communicator's rank order, and this rank's index among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    pub members: Vec<usize>,
    pub rank: usize,
}

impl SplitPlan {
    /// Number of ranks of the new communicator.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Whether this rank creates the group's id (the group's first member).
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// The group of parent rank `me` given every parent rank's `(color, key)`: the ranks with
/// `me`'s color, ordered by key and then by parent rank, as [`Communicator::split`] promises
/// (every backend plans its splits with it).
pub fn plan_split(entries: &[(usize, usize)], me: usize) -> Result<SplitPlan> {
    let Some(&(color, _)) = entries.get(me) else {
        return Err(Error::invalid(
            "split",
            format!(
                "rank {me} outside a communicator of {} ranks",
                entries.len()
            ),
        ));
    };
    let mut group: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter(|(_, (c, _))| *c == color)
        .map(|(r, &(_, k))| (k, r))
        .collect();
    group.sort_unstable();
    let members: Vec<usize> = group.iter().map(|&(_, r)| r).collect();
    let rank = members
        .iter()
        .position(|&r| r == me)
        .ok_or_else(|| Error::invalid("split", "internal: rank missing from its own group"))?;
    Ok(SplitPlan { members, rank })
}

/// What one receive of an [`Communicator::exchange`] expects.
#[derive(Debug, Clone)]
pub struct RecvSpec {
    pub src: usize,
    pub shape: Shape,
    pub dtype: DType,
}

impl RecvSpec {
    pub fn new(src: usize, shape: impl Into<Shape>, dtype: DType) -> Self {
        Self {
            src,
            shape: shape.into(),
            dtype,
        }
    }

    /// Expects a tensor shaped like `t` from `src`.
    pub fn like(src: usize, t: &Tensor) -> Self {
        Self::new(src, t.shape().clone(), t.dtype())
    }
}

/// A backend's in-flight exchange.
pub trait PendingOp: Send {
    fn wait(self: Box<Self>) -> Result<Vec<Tensor>>;
}

/// Handle of an in-flight [`Communicator::exchange`]. Dropping it without waiting leaves the
/// received messages queued; always call [`Pending::wait`].
#[must_use = "an exchange completes only when waited on"]
pub struct Pending(Box<dyn PendingOp>);

impl Pending {
    pub fn new(op: Box<dyn PendingOp>) -> Self {
        Self(op)
    }

    /// Blocks until every receive of the exchange has arrived; returns them in order.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        let _comm = traffic::CommTimer::start("wait");
        self.0.wait()
    }
}

/// Size in bytes of a tensor's elements.
pub fn payload_bytes(x: &Tensor) -> u64 {
    (x.elem_count() * x.dtype().size_in_bytes()) as u64
}
