//! Differentiable collectives: communication that lives inside candle graphs.
//!
//! Each function runs a [`Communicator`](crate::comm::Communicator) collective in forward and
//! records a node whose backward runs the adjoint collective on the output gradient, so
//! `loss.backward()` on every rank yields that rank's correct local gradients.
//!
//! | function                        | forward                   | backward                  | loss semantics |
//! |---------------------------------|---------------------------|---------------------------|----------------|
//! | [`all_gather`]                  | all-gather along `dim`    | reduce-scatter (sum)      | sum over ranks |
//! | [`reduce_scatter`]              | reduce-scatter (sum)      | all-gather                | sum over ranks |
//! | [`copy_to_parallel_region`]     | identity                  | all-reduce (sum)          | sum over ranks |
//! | [`reduce_from_parallel_region`] | all-reduce (sum)          | identity                  | replicated     |
//! | [`all_to_all`]                  | all-to-all                | inverse all-to-all        | sum over ranks |
//! | [`all_to_all_v`]                | rows to ranks by counts   | the rows sent back        | sum over ranks |
//! | [`scatter`]                     | keep this rank's chunk    | all-gather                | sum over ranks |
//! | [`gather`]                      | all-gather along `dim`    | keep this rank's chunk    | replicated     |
//!
//! "Loss semantics" says which objective the gradients are those of, given that every rank calls
//! `backward()` on its own scalar `loss_r`:
//! - *sum over ranks*: gradients of `Σ_r loss_r`, where each rank's loss may differ (each rank
//!   computes on its own shard downstream of the collective);
//! - *replicated*: gradients of one loss `L` that every rank computes identically from the
//!   collective's (identical) output; `loss_r = L` on every rank, and the gradients are those
//!   of `L`, not of `P · L`.
//!
//! A gradient of a tensor that is replicated on every rank comes out replicated too (the full
//! gradient on every rank). Parameters that are replicated but only see a rank's shard of the
//! data (norm weights in a sequence-parallel region, say) receive partial gradients that the
//! caller must all-reduce, as in Megatron.
//!
//! # Rules every rank must follow
//! - Every rank of `comm` calls the same collectives in the same order with tensors of the same
//!   shape and dtype (the [`Communicator`](crate::comm::Communicator) contract), and then calls
//!   `backward()` on a loss that depends on every collective output it produced. candle walks
//!   an identical graph in an identical order, so the backward collectives are issued in the
//!   same order on every rank.
//! - **Pruning hazard.** candle drops from the backward pass every node whose inputs do not reach
//!   a [`Var`](candle_core::Var). If on some rank the input of a collective does not reach a
//!   `Var` (a received activation, a detached tensor, an input built from data), that rank skips
//!   the backward collective while its peers wait for it. The local backend reports this as
//!   [`Error::PeerExited`] or [`Error::Timeout`] on the waiting ranks rather than hanging; NCCL
//!   would hang. Wrap such tensors in `Var::from_tensor` on *every* rank, so that each
//!   collective's node survives everywhere. The same hazard arises if a rank's loss does not
//!   depend on a collective's output.
//! - When `x` tracks no gradient (`!x.track_op()`), nothing is recorded: the collective runs in
//!   forward only and its plain result is returned. That is correct only if this holds on every
//!   rank.
//!
//! # Costs and devices
//! When a node is recorded, the collective's result is copied once into the recorded node's
//! output (candle offers no public way to attach a backward to an existing tensor). The copy
//! goes through the storage backend's strided copy, so CPU, CUDA and Metal storages are all
//! handled; only the CPU path is exercised by the tests.

use std::sync::Mutex;

use candle_core::shape::Dim;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Result, Shape, Storage, Tensor,
};

use crate::comm::{Comm, ReduceOp};
use crate::error::Error;
pub(crate) use flash_ring::owned_copy;

/// Concatenates every rank's `x` along `dim`, in rank order.
///
/// Shapes: `x` is `[.., n, ..]` (`n` at `dim`) on every rank; the result is `[.., P·n, ..]`.
/// Called by every rank of `comm`.
///
/// Backward: reduce-scatter (sum) of the output gradient along `dim`: rank `r` receives the sum
/// over ranks of chunk `r` of their gradients. Use it when each rank computes something
/// *different* downstream of the gathered tensor (sequence parallelism: every rank's queries
/// attend over the gathered keys); the gradients are those of `Σ_r loss_r`. This is Megatron's
/// `gather_from_sequence_parallel_region`. When the consumer is computed identically on every
/// rank, use [`gather`] instead.
pub fn all_gather<D: Dim>(x: &Tensor, comm: &Comm, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "all_gather")?;
    let bwd = comm.clone();
    record(
        x,
        "cpl-all-gather",
        |x| comm.all_gather(x, dim),
        move |g| bwd.reduce_scatter(g, dim, ReduceOp::Sum),
    )
}

/// Sums `x` over ranks, then rank `r` keeps the `r`-th of `P` equal chunks along `dim`.
///
/// Shapes: `x` is `[.., P·n, ..]` on every rank (`x.dim(dim)` divisible by `P`); the result is
/// `[.., n, ..]`. Called by every rank of `comm`.
///
/// Backward: all-gather of the output gradient along `dim` (every rank's `x` contributes to
/// every chunk). Gradients are those of `Σ_r loss_r`. This is Megatron's
/// `reduce_scatter_to_sequence_parallel_region` (the row-parallel linear's output under
/// sequence parallelism).
pub fn reduce_scatter<D: Dim>(x: &Tensor, comm: &Comm, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "reduce_scatter")?;
    let bwd = comm.clone();
    record(
        x,
        "cpl-reduce-scatter",
        |x| comm.reduce_scatter(x, dim, ReduceOp::Sum),
        move |g| bwd.all_gather(g, dim),
    )
}

/// Identity in forward, all-reduce (sum) of the gradient in backward: Megatron's `f`.
///
/// Shapes: any; the result has `x`'s shape. Called by every rank of `comm`; forward does not
/// communicate, backward does.
///
/// Use it where a tensor replicated on every rank enters a region that each rank computes on
/// its own shard of the weights (the input of a column-parallel linear). The gradient of `x` is
/// that of `Σ_r loss_r`, the same on every rank.
pub fn copy_to_parallel_region(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    let bwd = comm.clone();
    record(
        x,
        "cpl-copy-to-parallel-region",
        |x| Ok(x.clone()),
        move |g| bwd.all_reduce(g, ReduceOp::Sum),
    )
}

/// The identity in forward; the gradient times `factor` in backward. Local.
pub fn scale_gradient(x: &Tensor, factor: f64) -> Result<Tensor> {
    record(
        x,
        "cpl-scale-gradient",
        |x| Ok(x.clone()),
        move |g| Ok((g * factor)?),
    )
}

/// All-reduce (sum) in forward, identity in backward: Megatron's `g`.
///
/// Shapes: any, the same on every rank; the result has `x`'s shape. Called by every rank of
/// `comm`; forward communicates, backward does not.
///
/// Use it where each rank holds a partial sum (the output of a row-parallel linear) and the
/// code after it runs identically on every rank. The gradients are those of the replicated loss
/// `L` (every rank computes the same `L` from the reduced tensor).
pub fn reduce_from_parallel_region(x: &Tensor, comm: &Comm) -> Result<Tensor> {
    record(
        x,
        "cpl-reduce-from-parallel-region",
        |x| comm.all_reduce(x, ReduceOp::Sum),
        |g| Ok(g.clone()),
    )
}

/// Sends `send_counts[j]` consecutive rows (dim 0) of `x` to rank `j` and returns the rows
/// received, in rank order, with the count from each rank
/// ([`Communicator::all_to_all_v`](crate::comm::Communicator::all_to_all_v)).
///
/// Shapes: `x` `(n, ..)` with `Σ send_counts = n`; the result `(Σ received, ..)`, the same
/// trailing shape. Called by every rank of `comm`. Backward: the gradient's rows go back to the
/// ranks they came from (the same exchange with the received counts), so rank `r`'s input
/// gradient is that of `Σ_r loss_r`. Expert parallelism's dispatch and combine.
pub fn all_to_all_v(
    x: &Tensor,
    comm: &Comm,
    send_counts: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let (y, received) = comm.all_to_all_v(&x.detach(), send_counts)?;
    let (bwd, back) = (comm.clone(), received.clone());
    let y = record(
        x,
        "cpl-all-to-all-v",
        move |_| Ok(y),
        move |g| Ok(bwd.all_to_all_v(g, &back)?.0),
    )?;
    Ok((y, received))
}

/// Splits `x` into `P` equal chunks along `split_dim`, sends chunk `j` to rank `j` and
/// concatenates the received chunks along `concat_dim`, in rank order.
///
/// Shapes: `x.dim(split_dim)` divisible by `P`; the result has `split_dim` divided by `P` and
/// `concat_dim` multiplied by `P` (both apply when they are the same dim). Called by every rank
/// of `comm`. For Ulysses with `(b, s/P, h, d)` activations, `all_to_all(x, comm, 2, 1)` gives
/// `(b, s, h/P, d)` and `all_to_all(y, comm, 1, 2)` brings it back.
///
/// Backward: the inverse all-to-all (`split_dim` and `concat_dim` swapped) of the output
/// gradient. Gradients are those of `Σ_r loss_r`.
pub fn all_to_all<D1: Dim, D2: Dim>(
    x: &Tensor,
    comm: &Comm,
    split_dim: D1,
    concat_dim: D2,
) -> Result<Tensor> {
    let split_dim = split_dim.to_index(x.shape(), "all_to_all")?;
    let concat_dim = concat_dim.to_index(x.shape(), "all_to_all")?;
    let bwd = comm.clone();
    record(
        x,
        "cpl-all-to-all",
        |x| comm.all_to_all(x, split_dim, concat_dim),
        move |g| bwd.all_to_all(g, concat_dim, split_dim),
    )
}

/// Keeps this rank's chunk of a tensor replicated on every rank: rank `r` gets the `r`-th of
/// `P` equal chunks along `dim`.
///
/// Shapes: `x` is `[.., P·n, ..]` (identical on every rank); the result is `[.., n, ..]`.
/// Called by every rank of `comm`; forward does not communicate, backward does.
///
/// Backward: all-gather of the output gradients along `dim`, so every rank gets the full
/// gradient of `x` for `Σ_r loss_r`. This is Megatron's `scatter_to_sequence_parallel_region`
/// (and `scatter_to_tensor_model_parallel_region` on the last dim).
pub fn scatter<D: Dim>(x: &Tensor, comm: &Comm, dim: D) -> Result<Tensor> {
    let op = "scatter";
    let dim = dim.to_index(x.shape(), op)?;
    let chunk = chunk_size(op, x, dim, comm.size())?;
    let start = comm.rank() * chunk;
    let bwd = comm.clone();
    record(
        x,
        "cpl-scatter",
        |x| Ok(x.narrow(dim, start, chunk)?),
        move |g| bwd.all_gather(g, dim),
    )
}

/// Concatenates every rank's `x` along `dim` (as [`all_gather`]), for a consumer that every rank
/// computes identically.
///
/// Shapes: `x` is `[.., n, ..]` on every rank; the result is `[.., P·n, ..]`. Called by every
/// rank of `comm`; forward communicates, backward does not.
///
/// Backward: rank `r` keeps the `r`-th chunk of the output gradient along `dim`, without
/// communication. This is right when the gathered tensor feeds a computation replicated on
/// every rank (the gradients are those of the replicated loss `L`): Megatron's
/// `gather_from_tensor_model_parallel_region` (column-parallel output gathered before a
/// replicated consumer). If instead each rank's computation downstream differs, the
/// gradients of the gathered tensor differ per rank and must be summed: use [`all_gather`].
pub fn gather<D: Dim>(x: &Tensor, comm: &Comm, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "gather")?;
    let chunk = x.dim(dim)?;
    let start = comm.rank() * chunk;
    record(
        x,
        "cpl-gather",
        |x| comm.all_gather(x, dim),
        move |g| Ok(g.narrow(dim, start, chunk)?),
    )
}

/// Size of each of `parts` equal chunks of `x` along `dim`, or an error if it does not divide.
fn chunk_size(op: &'static str, x: &Tensor, dim: usize, parts: usize) -> Result<usize> {
    let n = x.dim(dim)?;
    if parts == 0 || n % parts != 0 {
        return Err(Error::invalid(
            op,
            format!(
                "dim {dim} of shape {:?} has size {n}, not divisible by the {parts} ranks",
                x.dims()
            ),
        )
        .into());
    }
    Ok(n / parts)
}

/// The gradient function of a recorded collective: output gradient to input gradient.
type BackwardFn = Box<dyn Fn(&Tensor) -> crate::Result<Tensor> + Send + Sync>;

/// The one way every collective enters a graph: runs `forward` on the detached `x` and, when `x`
/// tracks gradients, returns a copy of the result recorded as a [`CustomOp1`] node of `x`
/// whose backward is `backward(grad_of_result)`.
pub(crate) fn record<F, B>(
    x: &Tensor,
    name: &'static str,
    forward: F,
    backward: B,
) -> Result<Tensor>
where
    F: FnOnce(&Tensor) -> crate::Result<Tensor>,
    B: Fn(&Tensor) -> crate::Result<Tensor> + Send + Sync + 'static,
{
    let y = forward(&x.detach())?;
    if !x.track_op() {
        return Ok(y);
    }
    // Copy the result out before applying the op: `apply_op1` holds a read lock on `x`'s storage,
    // which `y` may share (identity, narrow, single-rank gather).
    let out = owned_copy(&y)?;
    drop(y);
    x.apply_op1(Recorded {
        name,
        out: Mutex::new(Some(out)),
        backward: Box::new(backward),
    })
}

/// A collective's node in a candle graph. Its forward hands over the precomputed result (once);
/// its backward runs the adjoint collective.
struct Recorded {
    name: &'static str,
    out: Mutex<Option<(Storage, Shape)>>,
    backward: BackwardFn,
}

impl Recorded {
    fn take_out(&self) -> Result<(Storage, Shape)> {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        out.take().ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: forward result already taken", self.name))
        })
    }

    fn wrong_device(&self, got: &Storage) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "{}: the collective's result is on {:?}, not on its input's device",
            self.name,
            got.device().location()
        ))
    }
}

impl CustomOp1 for Recorded {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        match self.take_out()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            (other, _) => Err(self.wrong_device(&other)),
        }
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        match self.take_out()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            (other, _) => Err(self.wrong_device(&other)),
        }
    }

    fn metal_fwd(&self, _: &MetalStorage, _: &Layout) -> Result<(MetalStorage, Shape)> {
        match self.take_out()? {
            (Storage::Metal(s), shape) => Ok((s, shape)),
            (other, _) => Err(self.wrong_device(&other)),
        }
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.backward)(grad_res)?))
    }
}
