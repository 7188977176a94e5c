//! Candle integration: a differentiable attention op whose backward calls the flash backward
//! (CPU), and the recorded composite forward with the composite backward (other devices).

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, Device, Layout, MetalStorage, Shape, Storage, Tensor,
};

use crate::composite::{self, CompositeConfig};
use crate::cpu::{forward::forward, KernelConfig, View};
use crate::spec::AttnSpec;
use crate::{f32_to_storage, flash_bwd_impl};

/// `CustomOp3` over (q, k, v) returning `out`; keeps the lse of its forward for the backward.
pub(crate) struct FlashAttnOp {
    pub spec: AttnSpec,
    pub cfg: KernelConfig,
    /// lse (batch, q_heads, seq_q) f32 of the last forward, shared with the caller.
    pub lse: Arc<Mutex<Option<Tensor>>>,
}

impl CustomOp3 for FlashAttnOp {
    fn name(&self) -> &'static str {
        "flash-ring-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = View::from_cpu("q", s1, l1)?;
        let k = View::from_cpu("k", s2, l2)?;
        let v = View::from_cpu("v", s3, l3)?;
        let r = forward(&q, &k, &v, &self.spec, &self.cfg)?;
        let dm = r.dims;
        let lse = Tensor::from_vec(r.lse, (dm.b, dm.hq, dm.sq), &Device::Cpu)?;
        match self.lse.lock() {
            Ok(mut g) => *g = Some(lse),
            Err(_) => candle_core::bail!("flash-ring-attention: poisoned lse lock"),
        }
        Ok((
            f32_to_storage(r.out, q.dtype()),
            Shape::from((dm.b, dm.sq, dm.hq, dm.d)),
        ))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = match self.lse.lock() {
            Ok(g) => g.clone(),
            Err(_) => candle_core::bail!("flash-ring-attention: poisoned lse lock"),
        };
        let lse = match lse {
            Some(l) => l,
            None => crate::flash_fwd_with_config(q, k, v, &self.spec, &self.cfg)?.1,
        };
        let (dq, dk, dv) =
            flash_bwd_impl(q, k, v, res, &lse, grad_res, &self.spec, &self.cfg, false)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Off the CPU: the device forward (flash-ring's CUDA kernels where they apply, else the
/// [`composite`] path), recorded as a node of `(q, k, v)` whose backward is the same route's
/// backward. Returns `(out, lse)` like [`crate::flash_attention_with_lse`].
pub(crate) fn device_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &CompositeConfig,
) -> crate::Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if crate::cuda_kernels(q) {
        let (out, lse) = crate::cuda::forward(q, k, v, spec)?;
        let (saved_lse, spec) = (lse.clone(), spec.clone());
        let backward: Backward3 = Box::new(move |q, k, v, out, dout| {
            Ok(crate::cuda::backward(
                q, k, v, out, &saved_lse, dout, &spec, false,
            )?)
        });
        return Ok((record3("flash-ring-cuda", q, k, v, out, backward)?, lse));
    }
    composite_attention(q, k, v, spec, cfg)
}

/// The composite forward recorded as a node of `(q, k, v)` whose backward is the composite
/// backward (what [`composite::attention`] runs).
pub(crate) fn composite_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &CompositeConfig,
) -> crate::Result<(Tensor, Tensor)> {
    let (out, lse) = composite::forward(q, k, v, spec, cfg)?;
    let (saved_lse, spec, cfg) = (lse.clone(), spec.clone(), *cfg);
    let backward: Backward3 = Box::new(move |q, k, v, out, dout| {
        Ok(composite::backward(
            q, k, v, out, &saved_lse, dout, &spec, &cfg, false,
        )?)
    });
    Ok((
        record3("flash-ring-composite", q, k, v, out, backward)?,
        lse,
    ))
}

/// The backward of a node recorded by [`record3`]: `(q, k, v, out, grad_out) -> (dq, dk, dv)`,
/// each gradient shaped like its input.
pub type Backward3 = Box<
    dyn Fn(
            &Tensor,
            &Tensor,
            &Tensor,
            &Tensor,
            &Tensor,
        ) -> candle_core::Result<(Tensor, Tensor, Tensor)>
        + Send
        + Sync,
>;

/// Returns `out` (computed from `q`, `k`, `v` outside the graph) as a node of `(q, k, v)`
/// whose backward is `backward`: how a kernel without candle autograd support, or a
/// distributed computation, joins the graph. When none of the inputs tracks gradients, returns
/// `out` itself and drops `backward`. `out` is copied once, on its device (candle has no public
/// way to attach an op to an existing tensor); it must live on the inputs' device.
pub fn record3(
    name: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: Tensor,
    backward: Backward3,
) -> candle_core::Result<Tensor> {
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    // Copy before apply_op3, which read-locks the inputs' storages (out may share one).
    let copy = owned_copy(&out)?;
    drop(out);
    q.apply_op3(
        k,
        v,
        Recorded3 {
            name,
            out: Mutex::new(Some(copy)),
            backward,
        },
    )
}

/// A contiguous copy of `t`'s elements in a storage that nothing else references, on `t`'s
/// device: how an op attaches a backward to a result computed outside the graph.
pub fn owned_copy(t: &Tensor) -> candle_core::Result<(Storage, Shape)> {
    let (storage, layout) = t.storage_and_layout();
    let copy = match &*storage {
        Storage::Cpu(s) => Storage::Cpu(strided_copy(s, layout)?),
        Storage::Cuda(s) => Storage::Cuda(strided_copy(s, layout)?),
        Storage::Metal(s) => Storage::Metal(strided_copy(s, layout)?),
    };
    Ok((copy, layout.shape().clone()))
}

fn strided_copy<S>(src: &S, layout: &Layout) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: `copy_strided_src` writes all `layout.shape().elem_count()` elements of the new
    // buffer (contiguously from offset 0) before it is read or returned.
    let mut dst = unsafe { src.device().alloc_uninit(layout.shape(), src.dtype())? };
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

/// The node [`record3`] creates: the forward hands over the stored result (on whatever device
/// it lives), the backward runs the given closure.
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
