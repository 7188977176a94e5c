//! Exact per-rank traffic accounting.
//!
//! Counting rules (identical for every backend, so tests can compare them with the papers'
//! formulas): only tensor payload bytes are counted, never headers, shapes or split keys; only
//! bytes that travel to or from *another* rank count (a rank's own chunk does not). With `P`
//! ranks and `N` payload bytes per rank:
//! - `all_gather`: sends `(P-1)·N`, receives `(P-1)·N`.
//! - `reduce_scatter`: sends and receives `(P-1)·N/P`.
//! - `all_reduce` (reduce-scatter then all-gather of the flattened tensor, chunks of
//!   `ceil`/`floor` size): sends and receives `2·(P-1)·N/P` when `P` divides the element count.
//! - `all_to_all`: sends and receives `(P-1)·N/P`.
//! - `broadcast`: the root sends `(P-1)·N`; every other rank receives `N`.
//! - `send`/`recv`/`exchange`: the bytes of the tensors sent and received.
//! - `barrier`, `split`: calls only.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The kind of communication operation, the key of the accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
    Send,
    Recv,
    Exchange,
    Barrier,
    Split,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Broadcast => "broadcast",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Exchange => "exchange",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }

    /// Point-to-point kinds (the traffic of rings).
    pub fn is_p2p(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv | OpKind::Exchange)
    }
}

/// Calls and payload bytes of one [`OpKind`] on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    pub calls: u64,
    pub bytes_sent: u64,
    pub bytes_recv: u64,
}

/// A copy of one rank's accounting at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrafficSnapshot {
    pub ops: BTreeMap<OpKind, OpStats>,
}

impl TrafficSnapshot {
    /// Stats of one kind (zero if never called).
    pub fn get(&self, kind: OpKind) -> OpStats {
        self.ops.get(&kind).copied().unwrap_or_default()
    }

    /// Bytes sent over all kinds.
    pub fn bytes_sent(&self) -> u64 {
        self.ops.values().map(|s| s.bytes_sent).sum()
    }

    /// Bytes received over all kinds.
    pub fn bytes_recv(&self) -> u64 {
        self.ops.values().map(|s| s.bytes_recv).sum()
    }

    /// Bytes sent by point-to-point kinds (send, exchange).
    pub fn p2p_bytes_sent(&self) -> u64 {
        self.ops
            .iter()
            .filter(|(k, _)| k.is_p2p())
            .map(|(_, s)| s.bytes_sent)
            .sum()
    }

    /// Bytes sent by collective kinds.
    pub fn collective_bytes_sent(&self) -> u64 {
        self.bytes_sent() - self.p2p_bytes_sent()
    }
}

/// One rank's live accounting. Cloning shares it (sub-communicators of a rank share one).
#[derive(Debug, Clone, Default)]
pub struct Traffic(Arc<Mutex<BTreeMap<OpKind, OpStats>>>);

impl Traffic {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one call of `kind` moving the given payload bytes (also on the open `comm` span
    /// of a trace, adding to what it holds).
    pub fn record(&self, kind: OpKind, bytes_sent: u64, bytes_recv: u64) {
        record_on_span(bytes_sent, bytes_recv);
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let s = map.entry(kind).or_default();
        s.calls += 1;
        s.bytes_sent += bytes_sent;
        s.bytes_recv += bytes_recv;
    }

    pub fn snapshot(&self) -> TrafficSnapshot {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        TrafficSnapshot { ops: map.clone() }
    }

    /// Clears the counters (e.g. to measure one step).
    pub fn reset(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

thread_local! {
    /// Seconds this thread (a rank) spent inside communication calls since the last take.
    static COMM_SECONDS: Cell<f64> = const { Cell::new(0.0) };
    /// How deep this thread is in communication calls (an op built from others counts once).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Times a communication call: the wall time from [`CommTimer::start`] to its drop is added to
/// this thread's communication time, unless it runs inside another timed call. Every backend's
/// operations and [`super::Pending::wait`] start one, so the time a rank spends in (or blocked
/// on) communication is known whatever the backend: the straggler report's `comm` time. The
/// outermost call is also a `comm` tracing span (field `op`; `bytes_sent` and `bytes_recv` as
/// [`Traffic::record`] counts them), which `--trace` writes to the rank's timeline.
pub struct CommTimer {
    start: Instant,
    _span: Option<tracing::span::EnteredSpan>,
}

impl CommTimer {
    /// Starts timing operation `op` (its name, e.g. `all_reduce`).
    pub fn start(op: &'static str) -> Self {
        let depth = DEPTH.with(|d| {
            d.set(d.get() + 1);
            d.get()
        });
        let span = (depth == 1).then(|| {
            tracing::info_span!(
                "comm",
                op = %op,
                bytes_sent = tracing::field::Empty,
                bytes_recv = tracing::field::Empty
            )
            .entered()
        });
        Self {
            start: Instant::now(),
            _span: span,
        }
    }
}

impl Drop for CommTimer {
    fn drop(&mut self) {
        let depth = DEPTH.with(|d| {
            let v = d.get().saturating_sub(1);
            d.set(v);
            v
        });
        if depth == 0 {
            let dt = self.start.elapsed().as_secs_f64();
            COMM_SECONDS.with(|c| c.set(c.get() + dt));
            SPAN_BYTES.with(|b| b.set((0, 0)));
        }
    }
}

/// This thread's communication time since the last call, and resets it.
pub fn take_comm_seconds() -> f64 {
    COMM_SECONDS.with(|c| c.replace(0.0))
}

thread_local! {
    /// Bytes recorded so far under this thread's open `comm` span.
    static SPAN_BYTES: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Adds the bytes of one recorded call to the current `comm` span (several records of one
/// outermost call add up: an all-reduce made of a reduce-scatter and an all-gather).
fn record_on_span(sent: u64, recv: u64) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let (s, r) = SPAN_BYTES.with(|b| {
        let (s, r) = b.get();
        b.set((s + sent, r + recv));
        (s + sent, r + recv)
    });
    span.record("bytes_sent", s);
    span.record("bytes_recv", r);
}
