//! flash-ring: blockwise attention that returns the softmax log-sum-exp (LSE), its backward,
//! and the numerically stable merge of partial results — the kernel under every ring.
//!
//! Layout is flash-attn's: q `(batch, seq_q, q_heads, head_dim)`, k and v
//! `(batch, seq_k, kv_heads, head_dim)` with `q_heads % kv_heads == 0` (GQA/MQA); lse is f32
//! `(batch, q_heads, seq_q)` in natural log. Inputs may be f32, bf16 or f16 (all three the same)
//! and any strides; arithmetic is f32. A query row with no allowed key gets `out = 0` and
//! `lse = -inf`, and contributes zero gradients. A NaN or `+inf` score (a NaN or an overflow in
//! q or in a key the row may attend) makes the row's out, lse and query gradient NaN, as
//! PyTorch's softmax does (a `-inf` score is a key of weight 0); a key the row may not attend
//! never reaches its out.
//!
//! The mask is given by global token positions ([`Positions`]) of the q and k rows, so the same
//! call serves any (q block, kv block) pair of a ring, zigzag or striped layout. See
//! [`AttnSpec`] for the rule.
//!
//! Logit soft-capping (Gemma 2/3, [`AttnSpec::with_softcap`]): the softmax takes `c tanh(s / c)`
//! of the scaled logit `s = scale q.k`, masked pairs excluded after the cap; the lse is that of
//! the capped logits, so [`merge`] combines capped partial results exactly, and the backward
//! includes the cap's derivative `1 - tanh^2(s / c)`. Every path here implements it (CPU kernels,
//! composite path, references); [`flash_attn_plan`] refuses a capped spec.
//!
//! [`matmul`] is the dense product of the layers around attention, on the same CPU kernels,
//! with short accumulation chains (accurate sums of large same-sign terms).
//!
//! The functions here take candle tensors and dispatch on the device: CPU tensors run the tiled
//! CPU kernels ([`cpu`]); CUDA tensors run flash-ring's CUDA kernels (`cuda`, feature `cuda`,
//! compiled at run time by NVRTC) for f32/bf16/f16 and head dims up to 256; everything else on
//! a device (Metal, larger head dims, `FLASH_RING_CUDA=composite`) runs the [`composite`] path,
//! the same blockwise algorithm in candle tensor ops, which is also the oracle a device kernel is
//! tested against. Nothing is copied to the CPU behind the caller's back.

pub mod composite;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod flash_attn_plan;
mod matmul;
mod merge;
mod op;
pub mod reference;
mod spec;
pub mod work;

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor};
use rayon::prelude::*;

pub use composite::CompositeConfig;
pub use cpu::{Bf16Products, Gemm, Isa, KernelConfig};
pub use error::{Error, Result};
pub use matmul::{bf16_dot_products, matmul, matmul_nt, matmul_to_f32, matmul_with_config};
pub use merge::merge;
pub use op::{owned_copy, record3, Backward3};
pub use reference::{naive_attention, naive_attention_with_lse};
pub use spec::{doc_ids_from_cu_seqlens, AttnSpec, MaskKind, Positions};

use cpu::View;

/// Forward: returns `out` (batch, seq_q, q_heads, head_dim) in q's dtype and `lse`
/// (batch, q_heads, seq_q) f32. Nothing is recorded for autograd (see [`flash_attention`]).
pub fn flash_fwd(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec) -> Result<(Tensor, Tensor)> {
    flash_fwd_with_config(q, k, v, spec, &KernelConfig::default())
}

/// [`flash_fwd`] with explicit tile sizes / instruction set.
pub fn flash_fwd_with_config(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &KernelConfig,
) -> Result<(Tensor, Tensor)> {
    check_devices(q, &[("k", k), ("v", v)])?;
    if !q.device().is_cpu() {
        #[cfg(feature = "cuda")]
        if cuda_kernels(q) {
            return cuda::forward(q, k, v, spec);
        }
        return composite::forward(q, k, v, spec, &CompositeConfig::default());
    }
    let (gq, lq) = q.storage_and_layout();
    let (gk, lk) = k.storage_and_layout();
    let (gv, lv) = v.storage_and_layout();
    let qv = view4("q", &gq, lq)?;
    let kv = view4("k", &gk, lk)?;
    let vv = view4("v", &gv, lv)?;
    let r = cpu::forward::forward(&qv, &kv, &vv, spec, cfg)?;
    let dm = r.dims;
    let out = f32_to_tensor(r.out, (dm.b, dm.sq, dm.hq, dm.d), qv.dtype())?;
    let lse = Tensor::from_vec(r.lse, (dm.b, dm.hq, dm.sq), &Device::Cpu)?;
    Ok((out, lse))
}

/// Backward of one (q block, kv block) pair, given the FINAL (merged over all kv blocks) `out`
/// and `lse`, so the returned gradients are exact partial sums over blocks.
///
/// `out`, `dout`: shape of q, any float dtype; `lse`: (batch, q_heads, seq_q) f32. Returns
/// `dq` (like q), `dk`, `dv` (like k, v; for GQA summed over the q heads of each kv group) in
/// the input dtype. See [`flash_bwd_f32`] for f32 gradients.
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    flash_bwd_impl(
        q,
        k,
        v,
        out,
        lse,
        dout,
        spec,
        &KernelConfig::default(),
        false,
    )
}

/// [`flash_bwd`] returning f32 gradients whatever the input dtype (for f32 accumulation in rings).
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd_f32(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    flash_bwd_impl(
        q,
        k,
        v,
        out,
        lse,
        dout,
        spec,
        &KernelConfig::default(),
        true,
    )
}

/// [`flash_bwd`] with explicit kernel config; `f32_grads` selects f32 outputs.
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd_with_config(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
    cfg: &KernelConfig,
    f32_grads: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    flash_bwd_impl(q, k, v, out, lse, dout, spec, cfg, f32_grads)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_bwd_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
    cfg: &KernelConfig,
    f32_grads: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    check_devices(
        q,
        &[
            ("k", k),
            ("v", v),
            ("out", out),
            ("lse", lse),
            ("dout", dout),
        ],
    )?;
    if !q.device().is_cpu() {
        #[cfg(feature = "cuda")]
        if cuda_kernels(q) {
            return cuda::backward(q, k, v, out, lse, dout, spec, f32_grads);
        }
        return composite::backward(
            q,
            k,
            v,
            out,
            lse,
            dout,
            spec,
            &CompositeConfig::default(),
            f32_grads,
        );
    }
    let qd = q.dims();
    if qd.len() == 4 && lse.dims() != [qd[0], qd[2], qd[1]] {
        return Err(Error::Shape {
            tensor: "lse",
            got: lse.dims().to_vec(),
            expected: format!("[{}, {}, {}] (batch, q_heads, seq_q)", qd[0], qd[2], qd[1]),
        });
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            tensor: "lse",
            got: lse.dtype(),
            expected: "f32",
        });
    }
    let lse_v: Vec<f32> = lse.flatten_all()?.to_vec1()?;
    let (gq, lq) = q.storage_and_layout();
    let (gk, lk) = k.storage_and_layout();
    let (gv, lv) = v.storage_and_layout();
    let (go, lo) = out.storage_and_layout();
    let (gd, ld) = dout.storage_and_layout();
    let qv = view4("q", &gq, lq)?;
    let kv = view4("k", &gk, lk)?;
    let vv = view4("v", &gv, lv)?;
    let ov = view4("out", &go, lo)?;
    let dv = view4("dout", &gd, ld)?;
    let r = cpu::backward::backward(&qv, &kv, &vv, &ov, &lse_v, &dv, spec, cfg)?;
    let dm = r.dims;
    let dt = if f32_grads { DType::F32 } else { qv.dtype() };
    Ok((
        f32_to_tensor(r.dq, (dm.b, dm.sq, dm.hq, dm.d), dt)?,
        f32_to_tensor(r.dk, (dm.b, dm.sk, dm.hkv, dm.d), dt)?,
        f32_to_tensor(r.dv, (dm.b, dm.sk, dm.hkv, dm.d), dt)?,
    ))
}

/// Differentiable attention: returns `out` (batch, seq_q, q_heads, head_dim) in q's dtype.
/// Gradients reach q, k and v through [`flash_bwd`]. Drop-in for naive attention in a model.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec) -> Result<Tensor> {
    Ok(flash_attention_with_lse(q, k, v, spec)?.0)
}

/// Like [`flash_attention`] but also returns the (detached) lse (batch, q_heads, seq_q) f32.
pub fn flash_attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
) -> Result<(Tensor, Tensor)> {
    flash_attention_with_config(q, k, v, spec, &KernelConfig::default())
}

/// [`flash_attention_with_lse`] with an explicit kernel config.
pub fn flash_attention_with_config(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &KernelConfig,
) -> Result<(Tensor, Tensor)> {
    check_devices(q, &[("k", k), ("v", v)])?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            return Err(rank_err(name, t.dims()));
        }
    }
    // Before the op, which would wrap the error into a candle error.
    spec.check_softcap()?;
    if !q.device().is_cpu() {
        return op::device_attention(q, k, v, spec, &CompositeConfig::default());
    }
    let cell = Arc::new(Mutex::new(None));
    let op = op::FlashAttnOp {
        spec: spec.clone(),
        cfg: cfg.clone(),
        lse: cell.clone(),
    };
    let out = q.apply_op3(k, v, op)?;
    let lse = cell
        .lock()
        .ok()
        .and_then(|g| g.clone())
        .ok_or_else(|| Error::Config("forward did not produce an lse".into()))?;
    Ok((out, lse))
}

/// Whether a call whose q is `q` (not on the CPU) runs flash-ring's CUDA kernels ([`cuda`])
/// rather than the composite path.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_kernels(q: &Tensor) -> bool {
    q.device().is_cuda() && q.rank() == 4 && cuda::selected(q.dtype(), q.dims()[3])
}

pub(crate) fn rank_err(name: &'static str, dims: &[usize]) -> Error {
    Error::Rank {
        tensor: name,
        expected: 4,
        layout: "batch, seq, heads, head_dim",
        got: dims.to_vec(),
    }
}

fn view4<'a>(name: &'static str, s: &'a Storage, l: &Layout) -> Result<View<'a>> {
    if l.dims().len() != 4 {
        return Err(rank_err(name, l.dims()));
    }
    View::new(name, s, l)
}

fn check_devices(q: &Tensor, others: &[(&'static str, &Tensor)]) -> Result<()> {
    for (name, t) in others {
        if !t.device().same_device(q.device()) {
            return Err(Error::DeviceMismatch { tensor: name });
        }
    }
    Ok(())
}

/// Converts an f32 buffer to a CPU storage of `dtype` (f32, bf16 or f16; others stay f32).
pub(crate) fn f32_to_storage(v: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(cpu::gemm_bf16::narrowed(&v)),
        DType::F16 => CpuStorage::F16(v.par_iter().map(|&x| half::f16::from_f32(x)).collect()),
        _ => CpuStorage::F32(v),
    }
}

fn f32_to_tensor<S: Into<candle_core::Shape>>(
    v: Vec<f32>,
    shape: S,
    dtype: DType,
) -> Result<Tensor> {
    let shape = shape.into();
    let t = match f32_to_storage(v, dtype) {
        CpuStorage::BF16(x) => Tensor::from_vec(x, shape, &Device::Cpu)?,
        CpuStorage::F16(x) => Tensor::from_vec(x, shape, &Device::Cpu)?,
        CpuStorage::F32(x) => Tensor::from_vec(x, shape, &Device::Cpu)?,
        _ => return Err(Error::Config("unexpected storage".into())),
    };
    Ok(t)
}
