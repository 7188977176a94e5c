//! flash-ring's own CUDA kernels: forward with LSE, and backward (dq; dk and dv), compiled at
//! run time by NVRTC and launched on candle's CUDA stream. Same contract and mask rule as the CPU
//! kernels (positions, causal, documents, window, soft-cap, GQA, rows with no allowed key), so
//! every sequence-parallel strategy runs on them unchanged.
//!
//! Why NVRTC and not a patched candle-flash-attn (docs/gpu.md, "Attention on CUDA"): it needs no
//! CUTLASS and no hours-long build (a kernel set compiles in about a second, once per process,
//! dtype and head dim), it can be compiled and checked for registers and spills on a machine
//! without a GPU, and the mask is flash-ring's exact rule evaluated per pair in the kernel: no
//! decomposition into flash-attn calls and no host-side mask.
//!
//! Two kernel sets ([`KernelSet`]), one file each, sharing `common.cuh` (mask rule, tile spans):
//! - `flash_mma.cu`, the default for bf16/f16 at head dims 16, 32, ..., 128: FlashAttention-2's
//!   layout on tensor cores (`mma.sync` m16n8k16, f32 accumulation, `ldmatrix`), 64 rows a block;
//! - `flash.cu`, everything else up to head dim [`MAX_HEAD_DIM`] (f32 above all, which must stay
//!   exact to 1e-5): f32 arithmetic on CUDA cores, one row per group of threads.
//!
//! `FLASH_RING_CUDA=simt` forces the CUDA-core set; `FLASH_RING_CUDA=composite` selects the
//! composite path ([`crate::composite`]), which stays the oracle and the fallback and serves head
//! dims above [`MAX_HEAD_DIM`], dtypes other than f32/bf16/f16 and empty shapes.
//!
//! Results are deterministic (no atomics): dq and dk/dv are separate kernels that each recompute
//! the scores.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Storage, Tensor, D};

use crate::composite;
use crate::error::{Error, Result};
use crate::spec::{AttnSpec, MaskKind};

/// What both kernel sets share (the element type, the mask rule, tile spans), prepended to each.
pub const COMMON: &str = include_str!("common.cuh");

/// The CUDA-core kernels (`flash.cu`): f32 arithmetic, any dtype and head dim up to
/// [`MAX_HEAD_DIM`].
pub const SOURCE: &str = include_str!("flash.cu");

/// The tensor-core kernels (`flash_mma.cu`): bf16 and f16, head dims that are multiples of 16 up
/// to [`MAX_MMA_HEAD_DIM`].
pub const MMA_SOURCE: &str = include_str!("flash_mma.cu");

/// The kernels' entry points, in the PTX of every variant of either set.
pub const ENTRY_POINTS: [&str; 3] = ["flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"];

/// The largest head dim the kernels are compiled for; larger ones run the composite path.
pub const MAX_HEAD_DIM: usize = 256;

/// The largest head dim of the tensor-core kernels (their accumulators live in registers).
pub const MAX_MMA_HEAD_DIM: usize = 128;

/// The virtual architecture the PTX targets at run time: sm_80 and every later GPU JIT it (the
/// tensor-core kernels' `mma.sync` bf16 shape needs sm_80).
pub const RUNTIME_ARCH: &str = "compute_80";

/// Threads per block (`NT` in `common.cuh`), both sets.
const THREADS: u32 = 128;

/// Rows a block of the tensor-core kernels owns (`BM` in `flash_mma.cu`).
const MMA_ROWS: u32 = 64;

/// The two kernel sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelSet {
    /// `flash.cu`: f32 arithmetic on CUDA cores; f32, bf16 and f16; head dims 1 to 256.
    Simt,
    /// `flash_mma.cu`: `mma.sync` m16n8k16 on tensor cores with f32 accumulation; bf16 and f16;
    /// head dims 16, 32, ..., 128.
    TensorCore,
}

impl KernelSet {
    /// Whether this set serves the dtype and head dim.
    pub fn serves(self, dtype: DType, head_dim: usize) -> bool {
        match self {
            KernelSet::Simt => {
                matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
                    && (1..=MAX_HEAD_DIM).contains(&head_dim)
            }
            KernelSet::TensorCore => {
                matches!(dtype, DType::BF16 | DType::F16)
                    && head_dim.is_multiple_of(16)
                    && (16..=MAX_MMA_HEAD_DIM).contains(&head_dim)
            }
        }
    }

    /// The set a call of this dtype and head dim takes by default: the tensor cores where they
    /// serve, unless `FLASH_RING_CUDA=simt`; `None` where neither set serves (the composite path
    /// does).
    pub fn default_for(dtype: DType, head_dim: usize) -> Option<KernelSet> {
        static SIMT: OnceLock<bool> = OnceLock::new();
        let simt = *SIMT.get_or_init(|| {
            std::env::var("FLASH_RING_CUDA").is_ok_and(|v| v.eq_ignore_ascii_case("simt"))
        });
        if !simt && KernelSet::TensorCore.serves(dtype, head_dim) {
            Some(KernelSet::TensorCore)
        } else if KernelSet::Simt.serves(dtype, head_dim) {
            Some(KernelSet::Simt)
        } else {
            None
        }
    }
}

/// One compiled variant: kernel set, element type and head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Variant {
    set: KernelSet,
    dtype: DType,
    head_dim: usize,
}

impl Variant {
    fn new(set: KernelSet, dtype: DType, head_dim: usize) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                tensor: "q",
                got: dtype,
                expected: "f32, bf16 or f16 (flash-ring's CUDA kernels)",
            });
        }
        if !set.serves(dtype, head_dim) {
            return Err(Error::Config(format!(
                "flash-ring's {set:?} CUDA kernels do not serve {dtype:?} at head dim {head_dim} \
                 (CUDA cores: f32/bf16/f16, head dims 1..={MAX_HEAD_DIM}; tensor cores: bf16/f16, \
                 multiples of 16 up to {MAX_MMA_HEAD_DIM})"
            )));
        }
        Ok(Variant {
            set,
            dtype,
            head_dim,
        })
    }

    /// CUDA-core set: threads per row, the least power of two that leaves each thread at most
    /// 32 dims. Tensor-core set: 4 (a row of an mma fragment is spread over 4 lanes).
    fn group(&self) -> usize {
        if self.set == KernelSet::TensorCore {
            return 4;
        }
        let mut g = 1;
        while self.head_dim.div_ceil(g) > 32 {
            g *= 2;
        }
        g
    }

    /// Rows per block.
    fn rows(&self) -> u32 {
        match self.set {
            KernelSet::Simt => THREADS / self.group() as u32,
            KernelSet::TensorCore => MMA_ROWS,
        }
    }

    /// Rows of the other side per shared-memory tile (forward; the tensor-core backward streams
    /// 32 key rows for dq and 16 query rows for dk/dv).
    fn tile(&self) -> usize {
        match self.set {
            KernelSet::TensorCore => 64,
            KernelSet::Simt if self.head_dim <= 128 => 32,
            KernelSet::Simt => 16,
        }
    }

    fn elem_kind(&self) -> u32 {
        match self.dtype {
            DType::BF16 => 1,
            DType::F16 => 2,
            _ => 0,
        }
    }

    fn module_name(&self) -> String {
        let set = match self.set {
            KernelSet::Simt => "simt",
            KernelSet::TensorCore => "mma",
        };
        format!("flash_ring_{set}_{:?}_d{}", self.dtype, self.head_dim).to_lowercase()
    }

    fn source(&self) -> String {
        match self.set {
            KernelSet::Simt => format!(
                "#define HEAD_DIM {}\n#define ELEM_KIND {}\n#define G {}\n#define BT {}\n{COMMON}\n{SOURCE}",
                self.head_dim,
                self.elem_kind(),
                self.group(),
                self.tile()
            ),
            KernelSet::TensorCore => format!(
                "#define HEAD_DIM {}\n#define ELEM_KIND {}\n{COMMON}\n{MMA_SOURCE}",
                self.head_dim,
                self.elem_kind()
            ),
        }
    }
}

/// Whether the kernels serve attention of this dtype and head dim (the composite path serves the
/// rest).
pub fn supports(dtype: DType, head_dim: usize) -> bool {
    KernelSet::default_for(dtype, head_dim).is_some()
}

/// The CUDA C source of one variant (kernel set, dtype, head dim), with its defines.
pub fn variant_source(set: KernelSet, dtype: DType, head_dim: usize) -> Result<String> {
    Ok(Variant::new(set, dtype, head_dim)?.source())
}

/// Compiles one variant with NVRTC for `arch` (e.g. `compute_80`, `compute_90`) and returns its
/// PTX. Needs only the NVRTC library, no GPU.
pub fn compile(
    set: KernelSet,
    dtype: DType,
    head_dim: usize,
    arch: &'static str,
) -> Result<String> {
    compile_variant(Variant::new(set, dtype, head_dim)?, arch)
}

fn compile_variant(v: Variant, arch: &'static str) -> Result<String> {
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(format!("{}.cu", v.module_name())),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(v.source(), opts)
        .map_err(|e| Error::Config(format!("NVRTC failed to compile {}: {e}", v.module_name())))?;
    Ok(ptx.to_src())
}

/// The PTX of a variant for [`RUNTIME_ARCH`], compiled once per process.
fn runtime_ptx(v: Variant) -> Result<Arc<String>> {
    static CACHE: OnceLock<Mutex<HashMap<Variant, Arc<String>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&v) {
        return Ok(p.clone());
    }
    let ptx = Arc::new(compile_variant(v, RUNTIME_ARCH)?);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(v, ptx.clone());
    Ok(ptx)
}

/// Whether calls on CUDA tensors of this dtype and head dim take the kernels: supported, and
/// `FLASH_RING_CUDA` is not `composite`.
pub fn selected(dtype: DType, head_dim: usize) -> bool {
    static COMPOSITE: OnceLock<bool> = OnceLock::new();
    let forced = *COMPOSITE.get_or_init(|| {
        std::env::var("FLASH_RING_CUDA").is_ok_and(|v| v.eq_ignore_ascii_case("composite"))
    });
    !forced && supports(dtype, head_dim)
}

/// The composite path's checks of a call (shapes, dtypes, spec), and k and v in q's dtype (one
/// kernel variant reads all three).
fn same_dtype(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(Error::DType {
                tensor: name,
                got: t.dtype(),
                expected: "the dtype of q",
            });
        }
    }
    Ok(())
}

fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        other => Err(Error::Device {
            tensor: "q",
            device: format!("{:?}", other.location()),
        }),
    }
}

/// The mask of a spec as device arrays: positions and (gathered per row) document ids.
struct MaskArrays {
    q_pos: CudaSlice<i32>,
    k_pos: CudaSlice<i32>,
    docs: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
    /// [`chunk_spans`] of the query and key rows (`int4` in the kernels).
    q_span: CudaSlice<i32>,
    k_span: CudaSlice<i32>,
    causal: i32,
    window: i32,
    scale: f32,
    softcap: f32,
}

fn mask_arrays(dev: &CudaDevice, spec: &AttnSpec) -> Result<MaskArrays> {
    let to_i32 = |name: &str, p: &crate::Positions| -> Result<Vec<i32>> {
        (0..p.len())
            .map(|i| {
                i32::try_from(p.get(i)).map_err(|_| {
                    Error::Config(format!(
                        "{name}: position {} exceeds the CUDA kernels' i32 range",
                        p.get(i)
                    ))
                })
            })
            .collect()
    };
    let qp = to_i32("spec.q_pos", &spec.q_pos)?;
    let kp = to_i32("spec.k_pos", &spec.k_pos)?;
    let (docs, q_span, k_span) = match &spec.doc_ids {
        None => (None, chunk_spans(&qp, None), chunk_spans(&kp, None)),
        Some(ids) => {
            // validate() has checked every position against the table.
            let gather =
                |p: &[i32]| -> Vec<i32> { p.iter().map(|&x| ids[x as usize] as i32).collect() };
            let (qd, kd) = (gather(&qp), gather(&kp));
            let spans = (chunk_spans(&qp, Some(&qd)), chunk_spans(&kp, Some(&kd)));
            (
                Some((dev.clone_htod(&qd)?, dev.clone_htod(&kd)?)),
                spans.0,
                spans.1,
            )
        }
    };
    let window = match spec.window {
        None => -1,
        Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
    };
    Ok(MaskArrays {
        q_pos: dev.clone_htod(&qp)?,
        k_pos: dev.clone_htod(&kp)?,
        docs,
        q_span: dev.clone_htod(&q_span)?,
        k_span: dev.clone_htod(&k_span)?,
        causal: i32::from(spec.mask == MaskKind::Causal),
        window,
        scale: spec.scale,
        softcap: spec.softcap.unwrap_or(0.0),
    })
}

/// Rows per entry of [`chunk_spans`]; every tile of both kernel sets starts at a multiple of it.
pub const SPAN_ROWS: usize = 16;

/// The kernels' tile spans: for each chunk of [`SPAN_ROWS`] rows, `(pmin, pmax, dmin, dmax)` of
/// its positions and documents (documents 0 without them), flattened. Tile-level mask tests
/// (`disjoint`, `covers` in `common.cuh`) combine the chunks of a tile.
pub fn chunk_spans(pos: &[i32], doc: Option<&[i32]>) -> Vec<i32> {
    let mut out = Vec::with_capacity(pos.len().div_ceil(SPAN_ROWS) * 4);
    for (c, chunk) in pos.chunks(SPAN_ROWS).enumerate() {
        let docs = doc.map(|d| &d[c * SPAN_ROWS..c * SPAN_ROWS + chunk.len()]);
        let min_max = |x: &[i32]| {
            let lo = x.iter().copied().min().unwrap_or(0);
            let hi = x.iter().copied().max().unwrap_or(0);
            (lo, hi)
        };
        let (pmin, pmax) = min_max(chunk);
        let (dmin, dmax) = docs.map(min_max).unwrap_or((0, 0));
        out.extend([pmin, pmax, dmin, dmax]);
    }
    out
}

/// A contiguous view of a CUDA tensor's elements of type `T`.
fn view<'a, T: CudaDType + DeviceRepr>(
    name: &'static str,
    storage: &'a Storage,
    start: usize,
) -> Result<CudaView<'a, T>> {
    match storage {
        Storage::Cuda(s) => Ok(s.as_cuda_slice::<T>()?.slice(start..)),
        _ => Err(Error::Device {
            tensor: name,
            device: "not CUDA (every input must be on q's CUDA device)".into(),
        }),
    }
}

fn f32_tensor(dev: &CudaDevice, data: CudaSlice<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(data, dev.clone())),
        shape,
        BackpropOp::none(),
        false,
    )
}

fn grid(rows: usize, per_block: u32, heads: usize, batch: usize) -> Result<LaunchConfig> {
    let blocks = rows.div_ceil(per_block as usize);
    let fit = |n: usize, what: &str| -> Result<u32> {
        u32::try_from(n).map_err(|_| Error::Config(format!("{what} {n} exceeds a CUDA grid")))
    };
    Ok(LaunchConfig {
        grid_dim: (
            fit(blocks, "row blocks")?,
            fit(heads, "heads")?,
            fit(batch, "batch")?,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `t` contiguous with its first element aligned to 16 bytes (the tensor-core kernels load rows
/// in 16-byte chunks): a view at an unaligned offset is copied.
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    let elems_per_16b = 16 / t.dtype().size_in_bytes();
    if t.layout().start_offset().is_multiple_of(elems_per_16b) {
        Ok(t)
    } else {
        Ok(t.copy()?)
    }
}

/// Forward on CUDA tensors: `(out, lse)` as [`crate::flash_fwd`], on the default kernel set
/// ([`KernelSet::default_for`]). Errors for an unsupported dtype or head dim (see [`supports`]).
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec) -> Result<(Tensor, Tensor)> {
    forward_with(default_set(q), q, k, v, spec)
}

/// The default kernel set for `q`'s dtype and head dim; the CUDA-core set where neither serves
/// (it then errors naming the dtype or head dim, after the shapes are checked).
fn default_set(q: &Tensor) -> KernelSet {
    let head_dim = q.dims().last().copied().unwrap_or(0);
    KernelSet::default_for(q.dtype(), head_dim).unwrap_or(KernelSet::Simt)
}

/// [`forward`] on a chosen kernel set (errors where it does not serve the call).
pub fn forward_with(
    set: KernelSet,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
) -> Result<(Tensor, Tensor)> {
    let s = composite::dims(q, k, v, spec)?;
    same_dtype(q, k, v)?;
    let var = Variant::new(set, q.dtype(), s.d)?;

    if s.b * s.sq * s.hq * s.sk == 0 {
        return composite::forward(q, k, v, spec, &crate::CompositeConfig::default());
    }
    let dev = cuda_device(q)?;
    let ptx = runtime_ptx(var)?;
    let func = dev.get_or_load_custom_func("flash_fwd", &var.module_name(), &ptx)?;
    let m = mask_arrays(&dev, spec)?;
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let mut out = dev.alloc_zeros::<f32>(s.b * s.sq * s.hq * s.d)?;
    let mut lse = dev.alloc_zeros::<f32>(s.b * s.hq * s.sq)?;
    let cfg = grid(s.sq, var.rows(), s.hq, s.b)?;
    {
        let (gq, lq) = q.storage_and_layout();
        let (gk, lk) = k.storage_and_layout();
        let (gv, lv) = v.storage_and_layout();
        let (sq_, sk_, hq_, hkv_) = (s.sq as i32, s.sk as i32, s.hq as i32, s.hkv as i32);
        let null = 0usize;
        macro_rules! launch {
            ($t:ty) => {{
                let qv = view::<$t>("q", &gq, lq.start_offset())?;
                let kv = view::<$t>("k", &gk, lk.start_offset())?;
                let vv = view::<$t>("v", &gv, lv.start_offset())?;
                let mut b = func.builder();
                b.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
                b.arg(&m.q_pos).arg(&m.k_pos);
                match &m.docs {
                    Some((qd, kd)) => b.arg(qd).arg(kd),
                    None => b.arg(&null).arg(&null),
                };
                b.arg(&m.q_span).arg(&m.k_span);
                b.arg(&sq_).arg(&sk_).arg(&hq_).arg(&hkv_);
                b.arg(&m.scale)
                    .arg(&m.softcap)
                    .arg(&m.causal)
                    .arg(&m.window);
                // SAFETY: the arguments match flash_fwd's signature (both sets); the spans hold
                // 4 ints per 16 rows of each side; the views hold
                // the contiguous elements the kernel indexes (shapes checked above), out and lse
                // are sized b*sq*hq*d and b*hq*sq.
                unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
            }};
        }
        match q.dtype() {
            DType::F32 => launch!(f32),
            DType::BF16 => launch!(half::bf16),
            _ => launch!(half::f16),
        }
    }
    let out = f32_tensor(&dev, out, &[s.b, s.sq, s.hq, s.d]).to_dtype(q.dtype())?;
    let lse = f32_tensor(&dev, lse, &[s.b, s.hq, s.sq]);
    Ok((out, lse))
}

/// Backward on CUDA tensors, as [`crate::flash_bwd`] (`f32_grads`: f32 gradients whatever the
/// input dtype), on the default kernel set. `out` and `lse` are the final (merged) forward
/// results.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
    f32_grads: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    backward_with(default_set(q), q, k, v, out, lse, dout, spec, f32_grads)
}

/// [`backward`] on a chosen kernel set (errors where it does not serve the call).
#[allow(clippy::too_many_arguments)]
pub fn backward_with(
    set: KernelSet,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
    f32_grads: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let s = composite::backward_dims(q, k, v, out, lse, dout, spec)?;
    same_dtype(q, k, v)?;
    let var = Variant::new(set, q.dtype(), s.d)?;
    if s.b * s.sq * s.hq * s.sk == 0 {
        return composite::backward(
            q,
            k,
            v,
            out,
            lse,
            dout,
            spec,
            &crate::CompositeConfig::default(),
            f32_grads,
        );
    }
    let dev = cuda_device(q)?;
    let ptx = runtime_ptx(var)?;
    let f_dq = dev.get_or_load_custom_func("flash_bwd_dq", &var.module_name(), &ptx)?;
    let f_dkdv = dev.get_or_load_custom_func("flash_bwd_dkdv", &var.module_name(), &ptx)?;
    let m = mask_arrays(&dev, spec)?;
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let dout = aligned(&dout.to_dtype(DType::F32)?)?;
    // delta_i = rowsum(dout_i * out_i), (b, hq, sq).
    let delta = (&dout * out.to_dtype(DType::F32)?)?
        .sum(D::Minus1)?
        .transpose(1, 2)?
        .contiguous()?;
    let lse = lse.contiguous()?;
    let mut dq = dev.alloc_zeros::<f32>(s.b * s.sq * s.hq * s.d)?;
    let mut dk = dev.alloc_zeros::<f32>(s.b * s.sk * s.hkv * s.d)?;
    let mut dv = dev.alloc_zeros::<f32>(s.b * s.sk * s.hkv * s.d)?;
    let cfg_q = grid(s.sq, var.rows(), s.hq, s.b)?;
    let cfg_k = grid(s.sk, var.rows(), s.hkv, s.b)?;
    {
        let (gq, lq) = q.storage_and_layout();
        let (gk, lk) = k.storage_and_layout();
        let (gv, lv) = v.storage_and_layout();
        let (go, lo) = dout.storage_and_layout();
        let (gl, ll) = lse.storage_and_layout();
        let (gd, ld) = delta.storage_and_layout();
        let dov = view::<f32>("dout", &go, lo.start_offset())?;
        let lsev = view::<f32>("lse", &gl, ll.start_offset())?;
        let dlv = view::<f32>("delta", &gd, ld.start_offset())?;
        let (sq_, sk_, hq_, hkv_) = (s.sq as i32, s.sk as i32, s.hq as i32, s.hkv as i32);
        let null = 0usize;
        macro_rules! launch {
            ($t:ty) => {{
                let qv = view::<$t>("q", &gq, lq.start_offset())?;
                let kv = view::<$t>("k", &gk, lk.start_offset())?;
                let vv = view::<$t>("v", &gv, lv.start_offset())?;
                let mut b = f_dq.builder();
                b.arg(&qv)
                    .arg(&kv)
                    .arg(&vv)
                    .arg(&dov)
                    .arg(&lsev)
                    .arg(&dlv)
                    .arg(&mut dq);
                b.arg(&m.q_pos).arg(&m.k_pos);
                match &m.docs {
                    Some((qd, kd)) => b.arg(qd).arg(kd),
                    None => b.arg(&null).arg(&null),
                };
                b.arg(&m.q_span).arg(&m.k_span);
                b.arg(&sq_).arg(&sk_).arg(&hq_).arg(&hkv_);
                b.arg(&m.scale)
                    .arg(&m.softcap)
                    .arg(&m.causal)
                    .arg(&m.window);
                // SAFETY: as in `forward`; dout is (b, sq, hq, d) f32, lse and delta are
                // (b, hq, sq) f32, dq is sized b*sq*hq*d.
                unsafe { b.launch(cfg_q) }.map_err(candle_core::Error::wrap)?;
                let mut b = f_dkdv.builder();
                b.arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lsev).arg(&dlv);
                b.arg(&mut dk).arg(&mut dv);
                b.arg(&m.q_pos).arg(&m.k_pos);
                match &m.docs {
                    Some((qd, kd)) => b.arg(qd).arg(kd),
                    None => b.arg(&null).arg(&null),
                };
                b.arg(&m.q_span).arg(&m.k_span);
                b.arg(&sq_).arg(&sk_).arg(&hq_).arg(&hkv_);
                b.arg(&m.scale)
                    .arg(&m.softcap)
                    .arg(&m.causal)
                    .arg(&m.window);
                // SAFETY: as above; dk and dv are sized b*sk*hkv*d.
                unsafe { b.launch(cfg_k) }.map_err(candle_core::Error::wrap)?;
            }};
        }
        match q.dtype() {
            DType::F32 => launch!(f32),
            DType::BF16 => launch!(half::bf16),
            _ => launch!(half::f16),
        }
    }
    let dt = if f32_grads { DType::F32 } else { q.dtype() };
    Ok((
        f32_tensor(&dev, dq, &[s.b, s.sq, s.hq, s.d]).to_dtype(dt)?,
        f32_tensor(&dev, dk, &[s.b, s.sk, s.hkv, s.d]).to_dtype(dt)?,
        f32_tensor(&dev, dv, &[s.b, s.sk, s.hkv, s.d]).to_dtype(dt)?,
    ))
}

/// Host-side facts of a variant, for tests and reports: threads per row, rows per block and
/// forward tile rows.
pub fn launch_geometry(
    set: KernelSet,
    dtype: DType,
    head_dim: usize,
) -> Result<(usize, usize, usize)> {
    let v = Variant::new(set, dtype, head_dim)?;
    Ok((v.group(), v.rows() as usize, v.tile()))
}
