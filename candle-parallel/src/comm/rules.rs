//! What every backend does alike, in one place: the argument checks of each call, the
//! arithmetic of reductions (in rank order, f32 for half precision, so that every backend gives
//! the same bits) and the chunking of `all_reduce`, and the traffic each call records (the
//! counting rules of [`super::traffic`]).

use candle_core::{DType, Tensor};

use super::traffic::{OpKind, Traffic};
use super::{payload_bytes, RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// Fails unless `r` (the `what` rank of call `op`) is a rank of a communicator of `size`.
pub(crate) fn check_rank(op: &'static str, what: &str, r: usize, size: usize) -> Result<()> {
    if r >= size {
        return Err(Error::invalid(
            op,
            format!("{what} {r} is out of range for a communicator of {size} ranks"),
        ));
    }
    Ok(())
}

/// Fails unless `dim` is a dim of `x`.
pub(crate) fn check_dim(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if dim >= x.rank() {
        return Err(Error::invalid(
            op,
            format!(
                "dim {dim} is out of range for a tensor of shape {:?}",
                x.dims()
            ),
        ));
    }
    Ok(())
}

/// `x.dim(dim) / p`, failing unless `p` divides it.
pub(crate) fn check_divisible(op: &'static str, x: &Tensor, dim: usize, p: usize) -> Result<usize> {
    let n = x.dim(dim)?;
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

/// Checks the ranks of an exchange's sends and receives.
pub(crate) fn check_exchange(
    sends: &[(usize, Tensor)],
    recvs: &[RecvSpec],
    size: usize,
) -> Result<()> {
    let op = OpKind::Exchange.name();
    for (dst, _) in sends {
        check_rank(op, "destination", *dst, size)?;
    }
    for r in recvs {
        check_rank(op, "source", r.src, size)?;
    }
    Ok(())
}

/// The code of a reduction in the arguments that ranks compare.
pub(crate) fn op_code(op: ReduceOp) -> usize {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

/// `(start, len)` of the chunks of `n` elements that `p` ranks reduce in `all_reduce` (chunk
/// `j`, of ceil or floor size, by rank `j`).
pub(crate) fn chunk_bounds(n: usize, p: usize) -> Vec<(usize, usize)> {
    (0..p)
        .map(|j| (j * (n / p) + j.min(n % p), n / p + usize::from(j < n % p)))
        .collect()
}

/// Combines the ranks' contributions in rank order, in f32 for half-precision inputs.
pub(crate) fn reduce_in_rank_order(parts: &[Tensor], op: ReduceOp, world: usize) -> Result<Tensor> {
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

/// Rearranges `x` so that its `p` equal chunks along `dim` follow each other in memory:
/// a contiguous tensor of shape `(p, pre, chunk * post)`.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))]
pub(crate) fn pack_chunks(x: &Tensor, dim: usize, p: usize) -> Result<Tensor> {
    let dims = x.dims();
    let pre: usize = dims[..dim].iter().product();
    let post: usize = dims[dim + 1..].iter().product();
    let c = dims[dim] / p;
    Ok(x.reshape((pre, p, c * post))?
        .transpose(0, 1)?
        .contiguous()?)
}

/// `flat` holds `p` blocks of shape `piece` in rank order; returns their concatenation along
/// `dim`.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))]
pub(crate) fn concat_blocks(
    flat: &Tensor,
    piece: &[usize],
    p: usize,
    dim: usize,
) -> Result<Tensor> {
    let pre: usize = piece[..dim].iter().product();
    let post: usize = piece[dim..].iter().product();
    let mut out = piece.to_vec();
    out[dim] *= p;
    Ok(flat
        .reshape((p, pre, post))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape(out)?)
}

impl Traffic {
    /// A collective in which this rank sends and receives `piece` bytes to and from each of the
    /// `p - 1` others (all_gather, reduce_scatter, all_to_all).
    pub(crate) fn record_symmetric(&self, kind: OpKind, piece: u64, p: usize) {
        let b = piece * (p as u64 - 1);
        self.record(kind, b, b);
    }

    /// An `all_reduce` of `el`-byte elements chunked as `bounds`, by rank `me`: the others'
    /// chunks go out and come back reduced, this rank's chunk comes in from every other rank
    /// and goes back to each.
    pub(crate) fn record_all_reduce(&self, bounds: &[(usize, usize)], me: usize, el: u64) {
        let p = bounds.len() as u64;
        let others: u64 = bounds
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .map(|(_, &(_, l))| l as u64)
            .sum();
        let b = (others + bounds[me].1 as u64 * (p - 1)) * el;
        self.record(OpKind::AllReduce, b, b);
    }

    /// A send of `x` from rank `me` to `dst` (nothing counted to oneself).
    pub(crate) fn record_send(&self, x: &Tensor, me: usize, dst: usize) {
        let b = if dst == me { 0 } else { payload_bytes(x) };
        self.record(OpKind::Send, b, 0);
    }

    /// A receive of `x` by rank `me` from `src`.
    pub(crate) fn record_recv(&self, x: &Tensor, me: usize, src: usize) {
        let b = if src == me { 0 } else { payload_bytes(x) };
        self.record(OpKind::Recv, 0, b);
    }

    /// An exchange of rank `me`.
    pub(crate) fn record_exchange(&self, sends: &[(usize, Tensor)], recvs: &[RecvSpec], me: usize) {
        let sent = sends
            .iter()
            .filter(|(dst, _)| *dst != me)
            .map(|(_, t)| payload_bytes(t))
            .sum();
        let received = recvs
            .iter()
            .filter(|r| r.src != me)
            .map(|r| (r.shape.elem_count() * r.dtype.size_in_bytes()) as u64)
            .sum();
        self.record(OpKind::Exchange, sent, received);
    }
}

/// The message of a panic payload.
pub(crate) fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}
