//! Candle integration: a differentiable attention op whose backward calls the flash backward.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};

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
