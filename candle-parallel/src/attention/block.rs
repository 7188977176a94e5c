//! The blockwise building blocks every ring-like strategy shares: forward and backward of one
//! (q block, kv block) pair with mask skipping, and the running merge of partial results.
//!
//! The math (flash-ring): a pair's forward gives `(out_blk, lse_blk)`; partials over disjoint key
//! sets merge through their lse ([`Partial`]). The backward of a pair, given the FINAL merged
//! `out` and `lse`, gives exact partial sums of `dq`, `dk`, `dv`: no rescaling is needed when
//! summing them over blocks. Accumulation is f32 whatever the input dtype.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use super::mask::{AttnMask, MaskBlock};
use super::AttnCall;
use crate::error::{Error, Result};

/// A flash-ring error as this crate's error.
pub(crate) fn kernel_err(e: flash_ring::Error) -> Error {
    Error::Candle(e.into())
}

thread_local! {
    /// Time this thread spent in block kernels (see [`take_block_compute_time`]).
    static BLOCK_COMPUTE: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// The time the calling thread spent inside [`block_fwd`] / [`block_bwd`] kernel calls since the
/// previous call, and resets it. With [`crate::comm::LocalWorld`] every rank is a thread, so
/// this is a rank's compute time (the load-balance measure of the benchmarks).
pub fn take_block_compute_time() -> Duration {
    BLOCK_COMPUTE.with(|c| c.replace(Duration::ZERO))
}

static SERIALIZE: AtomicBool = AtomicBool::new(false);
static KERNEL_LOCK: Mutex<()> = Mutex::new(());

/// How the block kernels of the threads (ranks) of this process run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelScheduling {
    /// Concurrently (the default).
    Concurrent,
    /// One at a time, so that [`take_block_compute_time`] measures each rank's compute without
    /// contention from the ranks that share its cores (wall times are then meaningless): a
    /// benchmarking aid.
    Serialized,
}

/// Sets how block kernels run (see [`KernelScheduling`]).
pub fn set_kernel_scheduling(s: KernelScheduling) {
    SERIALIZE.store(s == KernelScheduling::Serialized, Ordering::SeqCst);
}

fn timed<T>(f: impl FnOnce() -> T) -> T {
    let _guard = SERIALIZE
        .load(Ordering::SeqCst)
        .then(|| KERNEL_LOCK.lock().unwrap_or_else(|p| p.into_inner()));
    let t0 = Instant::now();
    let r = f();
    BLOCK_COMPUTE.with(|c| c.set(c.get() + t0.elapsed()));
    r
}

/// Forward of `q` `(b, nq, hq, d)` (rows at `qb`) against `k`, `v` `(b, nk, hkv, d)` (rows at
/// `kb`): `Some((out, lse))` with `out` in q's dtype and `lse` `(b, hq, nq)` f32, or `None`
/// when the mask hides every pair (the kernel is not called). Rows that [`AttnMask::trim`]
/// excludes are not passed to the kernel (their `out` is 0 and `lse` is `-inf`).
pub fn block_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    call: &AttnCall,
    qb: &MaskBlock,
    kb: &MaskBlock,
) -> Result<Option<(Tensor, Tensor)>> {
    let mask = &call.mask;
    if !call.may_attend(qb, kb) {
        return Ok(None);
    }
    let t = Trimmed::new(mask, qb, kb)?;
    let spec = call.spec(t.qb.positions().clone(), t.kb.positions().clone());
    let (qs, ks, vs) = (t.q(q)?, t.k(k)?, t.k(v)?);
    let (out, lse) = timed(|| flash_ring::flash_fwd(&qs, &ks, &vs, &spec)).map_err(kernel_err)?;
    if t.q0 == 0 {
        return Ok(Some((out, lse)));
    }
    let (b, _, h, d) = out.dims4()?;
    let zeros = Tensor::zeros((b, t.q0, h, d), out.dtype(), out.device())?;
    let none = Tensor::full(f32::NEG_INFINITY, (b, h, t.q0), lse.device())?;
    Ok(Some((
        Tensor::cat(&[&zeros, &out], 1)?,
        Tensor::cat(&[&none, &lse], 2)?,
    )))
}

/// The query side of a blockwise backward: q rows `(b, nq, hq, d)` with their FINAL (merged
/// over every kv block) `out` (q's shape) and `lse` `(b, hq, nq)` f32, and the output gradient
/// `dout` (q's shape). What travels together in StarTrail's backward.
#[derive(Debug, Clone)]
pub struct QRows {
    pub q: Tensor,
    pub out: Tensor,
    pub lse: Tensor,
    pub dout: Tensor,
}

/// Backward of one pair of `rows` against `k`, `v`: `Some((dq, dk, dv))` in f32 (partial sums
/// over kv blocks, exact since `rows` holds the final `out` and `lse`), or `None` when the mask
/// hides every pair. Rows excluded by [`AttnMask::trim`] get zero gradients.
pub fn block_bwd(
    rows: &QRows,
    k: &Tensor,
    v: &Tensor,
    call: &AttnCall,
    qb: &MaskBlock,
    kb: &MaskBlock,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let mask = &call.mask;
    if !call.may_attend(qb, kb) {
        return Ok(None);
    }
    let t = Trimmed::new(mask, qb, kb)?;
    let spec = call.spec(t.qb.positions().clone(), t.kb.positions().clone());
    let (qs, ks, vs) = (t.q(&rows.q)?, t.k(k)?, t.k(v)?);
    let (os, dos) = (t.q(&rows.out)?, t.q(&rows.dout)?);
    let ls = rows.lse.narrow(2, t.q0, t.nq - t.q0)?;
    let (dq, dk, dv) = timed(|| flash_ring::flash_bwd_f32(&qs, &ks, &vs, &os, &ls, &dos, &spec))
        .map_err(kernel_err)?;
    let pad = |x: Tensor, before: usize, after: usize| -> Result<Tensor> {
        if before == 0 && after == 0 {
            return Ok(x);
        }
        let (b, _, h, d) = x.dims4()?;
        let mut parts = Vec::with_capacity(3);
        if before > 0 {
            parts.push(Tensor::zeros((b, before, h, d), x.dtype(), x.device())?);
        }
        parts.push(x.clone());
        if after > 0 {
            parts.push(Tensor::zeros((b, after, h, d), x.dtype(), x.device())?);
        }
        Ok(Tensor::cat(&parts, 1)?)
    };
    Ok(Some((
        pad(dq, t.q0, 0)?,
        pad(dk, 0, t.nk - t.k1)?,
        pad(dv, 0, t.nk - t.k1)?,
    )))
}

/// The rows of a pair passed to the kernel: q rows `q0..nq`, kv rows `0..k1`.
struct Trimmed {
    q0: usize,
    nq: usize,
    k1: usize,
    nk: usize,
    qb: MaskBlock,
    kb: MaskBlock,
}

impl Trimmed {
    /// Requires `mask.may_attend(qb, kb)` (so at least one q row and one kv row remain).
    fn new(mask: &AttnMask, qb: &MaskBlock, kb: &MaskBlock) -> Result<Self> {
        let (nq, nk) = (qb.len(), kb.len());
        let (q0, k1) = mask.trim(qb, kb);
        let qb = if q0 > 0 {
            mask.sub_block(qb, q0, nq - q0)?
        } else {
            qb.clone()
        };
        let kb = if k1 < nk {
            mask.sub_block(kb, 0, k1)?
        } else {
            kb.clone()
        };
        Ok(Self {
            q0,
            nq,
            k1,
            nk,
            qb,
            kb,
        })
    }

    fn q(&self, x: &Tensor) -> Result<Tensor> {
        Ok(if self.q0 > 0 {
            x.narrow(1, self.q0, self.nq - self.q0)?
        } else {
            x.clone()
        })
    }

    fn k(&self, x: &Tensor) -> Result<Tensor> {
        Ok(if self.k1 < self.nk {
            x.narrow(1, 0, self.k1)?
        } else {
            x.clone()
        })
    }
}

/// The running merge of partial attention results over disjoint key sets, `out` in f32.
#[derive(Debug, Clone, Default)]
pub struct Partial {
    acc: Option<(Tensor, Tensor)>,
}

impl Partial {
    pub fn new() -> Self {
        Self::default()
    }

    /// True until a block was added.
    pub fn is_empty(&self) -> bool {
        self.acc.is_none()
    }

    /// Merges `(out, lse)` of another key set: `out` `(b, n, h, d)` any float dtype, `lse`
    /// `(b, h, n)` f32 (stable, `-inf` safe).
    pub fn add(&mut self, out: &Tensor, lse: &Tensor) -> Result<()> {
        self.acc = Some(match self.acc.take() {
            None => (out.to_dtype(DType::F32)?, lse.clone()),
            Some((o, l)) => flash_ring::merge(&o, &l, out, lse).map_err(kernel_err)?,
        });
        Ok(())
    }

    /// Adds a block result if there is one (see [`block_fwd`]).
    pub fn add_opt(&mut self, block: Option<(Tensor, Tensor)>) -> Result<()> {
        match block {
            Some((o, l)) => self.add(&o, &l),
            None => Ok(()),
        }
    }

    /// The merged `(out f32, lse)`, or `None` when nothing was added.
    pub fn into_parts(self) -> Option<(Tensor, Tensor)> {
        self.acc
    }

    /// The merged `out` (q's shape, dtype and device, contiguous) and `lse` `(b, h, n)`; with
    /// no block added, `out = 0` and `lse = -inf` (every key was masked).
    pub fn finish(self, q: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, n, h, _) = q.dims4()?;
        match self.acc {
            Some((o, l)) => Ok((o.to_dtype(q.dtype())?.contiguous()?, l)),
            None => Ok((
                q.zeros_like()?,
                Tensor::full(f32::NEG_INFINITY, (b, h, n), q.device())?,
            )),
        }
    }
}
