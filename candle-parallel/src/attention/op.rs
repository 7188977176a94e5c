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

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, Layout, MetalStorage, Shape, Storage, Tensor,
};

use super::{Grads, Qkv, Saved};
use crate::error::Result;

/// The backward of a recorded node: `(q, k, v, out, grad_out) -> (dq, dk, dv)`, each gradient
/// shaped like its input.
pub type Backward3 = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor, Tensor)>
        + Send
        + Sync,
>;

/// Returns `out` as a node of `(q, k, v)` whose backward is `backward`. When none of the inputs
/// tracks gradients, returns `out` itself and drops `backward`. `out` is copied once (candle has
/// no public way to attach an op to an existing tensor).
pub fn record3(
    name: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: Tensor,
    backward: Backward3,
) -> Result<Tensor> {
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    // Copy before apply_op3, which read-locks the inputs' storages (out may share one).
    let copy = crate::collectives::owned_copy(&out)?;
    drop(out);
    Ok(q.apply_op3(
        k,
        v,
        Recorded3 {
            name,
            out: Mutex::new(Some(copy)),
            backward,
        },
    )?)
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

struct Recorded3 {
    name: &'static str,
    out: Mutex<Option<(Storage, Shape)>>,
    backward: Backward3,
}

impl Recorded3 {
    fn take(&self) -> candle_core::Result<(Storage, Shape)> {
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        g.take().ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: forward result already taken", self.name))
        })
    }

    fn wrong(&self, s: &Storage) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "{}: result on {:?}, not on the inputs' device",
            self.name,
            s.device().location()
        ))
    }
}

impl CustomOp3 for Recorded3 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(s), sh) => Ok((s, sh)),
            (o, _) => Err(self.wrong(&o)),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(s), sh) => Ok((s, sh)),
            (o, _) => Err(self.wrong(&o)),
        }
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        match self.take()? {
            (Storage::Metal(s), sh) => Ok((s, sh)),
            (o, _) => Err(self.wrong(&o)),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = (self.backward)(q, k, v, res, grad_res)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
