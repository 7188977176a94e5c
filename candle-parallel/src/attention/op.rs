//! Attaching a distributed backward to a result computed outside the graph (3 inputs).
//!
//! A strategy computes its output with communication and kernels on detached tensors, then
//! [`record3`] returns a copy of that output recorded as a `CustomOp3` node of `(q, k, v)` whose
//! backward runs the strategy's distributed backward. This is the 3-input sibling of the
//! 1-input recorder of [`crate::collectives`].
//!
//! The backward communicates, so the pruning rule of [`crate::collectives`] applies: on every
//! rank at least one of `q`, `k`, `v` must track gradients (reach a `Var`), and every rank's
//! loss must depend on the output.

use candle_core::Tensor;

use super::{Grads, Qkv, Saved};
use crate::error::Result;

/// The backward of a recorded node: `(q, k, v, out, grad_out) -> (dq, dk, dv)`, each gradient
/// shaped like its input.
pub type Backward3 = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor, Tensor)>
        + Send
        + Sync,
>;

/// Returns `out` as a node of `(q, k, v)` whose backward is `backward` ([`flash_ring::record3`],
/// with this crate's errors). When none of the inputs tracks gradients, returns `out` itself and
/// drops `backward`. `out` is copied once.
pub fn record3(
    name: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: Tensor,
    backward: Backward3,
) -> Result<Tensor> {
    let backward: flash_ring::Backward3 = Box::new(move |q, k, v, out, dout| {
        backward(q, k, v, out, dout).map_err(candle_core::Error::from)
    });
    Ok(flash_ring::record3(name, q, k, v, out, backward)?)
}

/// Records `out` (computed from `qkv`, detached) as a node of `qkv` whose backward is
/// `backward(saved, dout)`: the f32 gradients of `saved` (the inputs, `out` and `lse`), cast
/// here to the inputs' dtypes. What every blockwise strategy attaches to its result.
pub fn record_attention(
    name: &'static str,
    qkv: &Qkv,
    out: Tensor,
    lse: &Tensor,
    backward: impl Fn(&Saved, &Tensor) -> Result<Grads> + Send + Sync + 'static,
) -> Result<Tensor> {
    let lse = lse.clone();
    let bwd = move |q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, dout: &Tensor| {
        let saved = Saved::new(q, k, v, out, &lse);
        saved.cast_grads(backward(&saved, dout)?)
    };
    record3(name, &qkv.q, &qkv.k, &qkv.v, out, Box::new(bwd))
}
