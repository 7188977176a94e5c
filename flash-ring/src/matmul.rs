//! Dense matrix product for candle tensors with short f32 accumulation chains (see
//! [`crate::cpu::gemm`]): the products of the linear layers whose sums must stay accurate
//! when their terms are large and of one sign.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use rayon::prelude::*;

use crate::cpu::gemm::{gemm, Mat};
use crate::cpu::mkl::{self, Mkl};
use crate::cpu::{gemm_bf16, Bf16Products, Isa, KernelConfig};
use crate::error::{Error, Result};
use crate::f32_to_storage;

/// `a @ b` for `a` `(m, k)` and `b` `(k, n)`.
///
/// - Inputs: f32, bf16 or f16 (both the same dtype), any strides (transposed views cost
///   nothing extra for `b`; a column-major `a` is read in place in f32 and packed in one pass
///   for the bf16 dot products; other strides of `a` are copied once). Arithmetic is f32; the result
///   `(m, n)` is contiguous, in the inputs' dtype.
/// - Each output element sums its `k` products in register chains of
///   [`crate::cpu::gemm::KC`] products, then adds the chain sums, so its rounding error grows
///   with `KC + k / KC` instead of `k` (see [`crate::cpu::gemm`]); results do not depend on
///   the number of threads.
/// - bf16 on a CPU with AVX512-BF16 (under [`Isa::Avx512`]) where `cfg.bf16`
///   ([`crate::cpu::Bf16Products`]) chooses them (by default: not on Intel's CPUs, where they
///   were measured slower): the products are the CPU's bf16 dot products with f32 sums in
///   chains of [`crate::cpu::gemm_bf16::CHAIN`] products ([`crate::cpu::gemm_bf16`]), without
///   widening the operands; elsewhere bf16 and f16 are widened to f32.
/// - Intel MKL instead of these kernels where `cfg.gemm` ([`crate::cpu::Gemm`]) routes the
///   dtype there: by default bf16 on a CPU with AMX where MKL loads (its products run on the
///   tile unit; one f32 chain per output over the whole depth, see [`crate::cpu::mkl`]).
/// - Differentiable with respect to both inputs. `a`'s gradient `grad @ b^T` is this product
///   again (short chains); `b`'s gradient `a^T @ grad` is candle's own matmul, as
///   `Tensor::matmul` would compute it, except where MKL runs the products and for bf16 on the
///   bf16 dot products, where it is this product again.
/// - On other devices (CUDA, Metal) this is candle's own `Tensor::matmul` (cuBLAS on CUDA).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_with_config(a, b, &KernelConfig::default())
}

/// `a @ w^T` for `a` `(m, k)` and `w` `(n, k)` (a linear layer's product with its `(out, in)`
/// weight): [`matmul`] of `a` and `w.t()`, with the same bits, except that `w`'s gradient is
/// computed as `grad^T @ a` and comes back contiguous in `w`'s own layout.
///
/// Through `matmul(a, &w.t())` the gradient of `w.t()` comes back `(k, n)` row-major, and
/// candle's backward of the transposition hands `w` a transposed view of it, which the
/// gradient store copies element by element on the calling thread (about 2 ns an element on a
/// 2-core Zen 4: an eighth of that thread's time in the MoE benchmark's bf16 step, with the
/// other cores idle). The two weight gradients are the same sums of the same products.
pub fn matmul_nt(a: &Tensor, w: &Tensor) -> Result<Tensor> {
    product_of(a, w, &KernelConfig::default(), false, true)
}

/// [`matmul`] with an explicit instruction set (`cfg.isa`), products' library (`cfg.gemm`) and
/// bf16 products (`cfg.bf16`); the tile sizes are not used. An error names `FLASH_RING_GEMM`,
/// `FLASH_RING_MKL` or `FLASH_RING_BF16` when the choice cannot be used.
pub fn matmul_with_config(a: &Tensor, b: &Tensor, cfg: &KernelConfig) -> Result<Tensor> {
    product(a, b, cfg, false)
}

/// [`matmul`] with an f32 result for every input dtype: the f32 sums of the products, not
/// rounded to the inputs' dtype (a loss's logits from bf16 hidden states and weights). The
/// gradients flowing back are rounded to the inputs' dtype before their products. Off the CPU
/// this is candle's matmul followed by a conversion.
pub fn matmul_to_f32(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    product(a, b, &KernelConfig::default(), true)
}

/// Whether bf16 products of [`matmul`] run on this CPU's bf16 dot products (AVX512-BF16,
/// [`crate::cpu::gemm_bf16`]) with the default kernels and choice; otherwise they are widened
/// to f32 (also when `FLASH_RING_BF16` holds a bad value, which the products report).
pub fn bf16_dot_products() -> bool {
    gemm_bf16::used_under(crate::cpu::detect(), Bf16Products::Auto, false).unwrap_or(false)
}

fn product(a: &Tensor, b: &Tensor, cfg: &KernelConfig, f32_out: bool) -> Result<Tensor> {
    product_of(a, b, cfg, f32_out, false)
}

/// `a @ b`, or with `b_transposed` `a @ b^T`.
fn product_of(
    a: &Tensor,
    b: &Tensor,
    cfg: &KernelConfig,
    f32_out: bool,
    b_transposed: bool,
) -> Result<Tensor> {
    let isa = cfg.check()?;
    let (_, k) = dims2("a", a)?;
    let (b0, b1) = dims2("b", b)?;
    let kb = if b_transposed { b1 } else { b0 };
    if kb != k {
        return Err(Error::Shape {
            tensor: "b",
            got: b.dims().to_vec(),
            expected: if b_transposed {
                format!("(n, {k}) to match a {:?}", a.dims())
            } else {
                format!("({k}, n) to match a {:?}", a.dims())
            },
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DType {
            tensor: "b",
            got: b.dtype(),
            expected: "the dtype of a",
        });
    }
    if !matches!(a.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType {
            tensor: "a",
            got: a.dtype(),
            expected: "f32, bf16 or f16",
        });
    }
    if !b.device().same_device(a.device()) {
        return Err(Error::DeviceMismatch { tensor: "b" });
    }
    if !a.device().is_cpu() {
        // Other devices: the device's own matmul (cuBLAS on CUDA), differentiable as is.
        let c = if b_transposed {
            a.matmul(&b.t()?)?
        } else {
            a.matmul(b)?
        };
        return Ok(if f32_out { c.to_dtype(DType::F32)? } else { c });
    }
    let mkl = mkl::route(cfg.gemm, a.dtype() == DType::BF16)?;
    let bf16_dot = cfg.bf16_dot(isa, false)?;
    let bf16_dot_few_rows = cfg.bf16_dot(isa, true)?;
    Ok(a.apply_op2(
        b,
        MatMulOp {
            isa,
            mkl,
            bf16_dot,
            bf16_dot_few_rows,
            f32_out,
            b_transposed,
        },
    )?)
}

fn dims2(name: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.dims() {
        &[r, c] => Ok((r, c)),
        d => Err(Error::Rank {
            tensor: name,
            expected: 2,
            layout: "rows, cols",
            got: d.to_vec(),
        }),
    }
}

/// Rows, columns, strides and start offset of a rank-2 layout.
fn mat_layout(name: &'static str, l: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[r, c], &[rs, cs]) => Ok((r, c, rs, cs, l.start_offset())),
        (d, _) => Err(Error::Rank {
            tensor: name,
            expected: 2,
            layout: "rows, cols",
            got: d.to_vec(),
        }),
    }
}

/// A strided view of a rank-2 storage's elements (no copy).
fn mat_view<'a, T>(name: &'static str, v: &'a [T], l: &Layout) -> Result<Mat<'a, T>> {
    let (rows, cols, rs, cs, o) = mat_layout(name, l)?;
    Ok(Mat {
        data: &v[o.min(v.len())..],
        rows,
        cols,
        rs,
        cs,
    })
}

/// The elements of a rank-2 storage as f32 with its strides: borrowed for f32, converted
/// otherwise. A dense block (at most as many gaps as elements: row-major, or a transposed
/// weight) is converted element by element keeping its strides, so the product reads it as it
/// reads an f32 tensor of that layout (a transposed weight in place, not transposed while
/// widening: on a Zen 4 that cost the LM head's widened bf16 product a fifth of its time);
/// anything sparser is compacted row-major (rows in parallel).
fn f32_view<'a>(
    name: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
    buf: &'a mut Vec<f32>,
) -> Result<Mat<'a>> {
    /// Converts `m` into `buf`; returns the strides of the result.
    fn widen<T: Copy + Sync>(
        m: Mat<T>,
        to_f32: fn(T) -> f32,
        buf: &mut Vec<f32>,
    ) -> (usize, usize) {
        let extent = m.extent();
        if let Some(block) = m
            .data
            .get(..extent)
            .filter(|_| extent <= 2 * m.rows * m.cols)
        {
            buf.clear();
            buf.resize(extent, 0.0);
            buf.par_chunks_mut(WIDEN_CHUNK)
                .zip(block.par_chunks(WIDEN_CHUNK))
                .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, s)| *o = to_f32(*s)));
            return (m.rs, m.cs);
        }
        buf.clear();
        buf.resize(m.rows * m.cols, 0.0);
        if m.cols == 0 {
            return (0, 1);
        }
        buf.par_chunks_mut(m.cols).enumerate().for_each(|(r, row)| {
            let src = &m.data[r * m.rs..];
            row.iter_mut()
                .enumerate()
                .for_each(|(c, x)| *x = to_f32(src[c * m.cs]));
        });
        (m.cols, 1)
    }
    let (rows, cols, (rs, cs)) = match s {
        CpuStorage::F32(v) => return mat_view(name, v, l),
        CpuStorage::BF16(v) => {
            let m = mat_view(name, v, l)?;
            (m.rows, m.cols, widen(m, half::bf16::to_f32, buf))
        }
        CpuStorage::F16(v) => {
            let m = mat_view(name, v, l)?;
            (m.rows, m.cols, widen(m, half::f16::to_f32, buf))
        }
        other => {
            return Err(Error::DType {
                tensor: name,
                got: other.dtype(),
                expected: "f32, bf16 or f16",
            })
        }
    };
    Ok(Mat {
        data: buf,
        rows,
        cols,
        rs,
        cs,
    })
}

/// Elements per parallel task when widening a dense block.
const WIDEN_CHUNK: usize = 1 << 16;

fn check_inner<T>(a: &Mat<T>, b: &Mat<T>) -> candle_core::Result<()> {
    if a.cols != b.rows {
        candle_core::bail!(
            "flash-ring-matmul: a is {}x{} but b is {}x{}",
            a.rows,
            a.cols,
            b.rows,
            b.cols
        );
    }
    Ok(())
}

/// `CustomOp2` over `(a, b)` returning `a @ b`, in the inputs' dtype or (`f32_out`) f32.
#[derive(Clone, Copy)]
struct MatMulOp {
    isa: Isa,
    /// MKL when the products of this dtype run there ([`mkl::route`]).
    mkl: Option<&'static Mkl>,
    /// bf16 products on the CPU's bf16 dot products ([`gemm_bf16::used_under`]): of any shape,
    /// and of at most [`gemm_bf16::MEMORY_BOUND_ROWS`] rows.
    bf16_dot: bool,
    bf16_dot_few_rows: bool,
    f32_out: bool,
    /// The second input is `W` `(n, k)` and the product `a @ W^T` ([`matmul_nt`]).
    b_transposed: bool,
}

impl MatMulOp {
    /// The second input as the product's B: transposed for [`matmul_nt`].
    fn oriented<'a, T>(&self, b: Mat<'a, T>) -> Mat<'a, T> {
        if self.b_transposed {
            b.t()
        } else {
            b
        }
    }

    /// The f32 result `c` as the op's output storage.
    fn storage(&self, c: Vec<f32>, inputs: DType) -> CpuStorage {
        if self.f32_out {
            CpuStorage::F32(c)
        } else {
            f32_to_storage(c, inputs)
        }
    }
}

impl CustomOp2 for MatMulOp {
    fn name(&self) -> &'static str {
        "flash-ring-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        // bf16 without widening: MKL where it runs them, else the CPU's bf16 dot products.
        if let (CpuStorage::BF16(v1), CpuStorage::BF16(v2)) = (s1, s2) {
            let rows = l1.dims().first().copied().unwrap_or(0);
            let dot =
                self.bf16_dot || (self.bf16_dot_few_rows && rows <= gemm_bf16::MEMORY_BOUND_ROWS);
            if self.mkl.is_some() || dot {
                let a = mat_view("a", v1, l1)?;
                let b = self.oriented(mat_view("b", v2, l2)?);
                check_inner(&a, &b)?;
                let shape = Shape::from((a.rows, b.cols));
                if let Some(c) = self.mkl.and_then(|lib| mkl::gemm(lib, a, b)) {
                    return Ok((self.storage(c, DType::BF16), shape));
                }
                if dot && self.f32_out {
                    return Ok((CpuStorage::F32(gemm_bf16::gemm_bf16(a, b)), shape));
                }
                if dot {
                    // Rounded to bf16 block by block, as the product completes them.
                    return Ok((CpuStorage::BF16(gemm_bf16::gemm_bf16_rounded(a, b)), shape));
                }
            }
        }
        let (mut b1, mut b2) = (Vec::new(), Vec::new());
        let a = f32_view("a", s1, l1, &mut b1)?;
        let b = self.oriented(f32_view("b", s2, l2, &mut b2)?);
        check_inner(&a, &b)?;
        let (m, n) = (a.rows, b.cols);
        let c = match self.mkl.and_then(|lib| mkl::gemm(lib, a, b)) {
            Some(c) => c,
            None => gemm(self.isa, a, b),
        };
        Ok((self.storage(c, s1.dtype()), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Only the gradients that flow somewhere: a frozen weight (LoRA's base) has none, which
        // saves a third of a linear layer's backward. The weight's gradient runs this op again
        // where MKL runs the products, and for bf16 on the CPU's bf16 dot products (candle's
        // bf16 matmul widens both operands to f32). The products run on detached operands, so
        // the gradients reference no graph: under `matmul_nt` the weight's goes straight to its
        // variable, which candle does not detach, and held there (a checkpointed block's
        // parameter gradients wait in a sink until the whole backward ends) it would keep the
        // block's recomputed activations alive.
        let (track_a, track_b) = (a.track_op(), b.track_op());
        let (a, b) = (&a.detach(), &b.detach());
        let grad = grad.detach().to_dtype(a.dtype())?;
        let grad = &grad;
        let op = MatMulOp {
            f32_out: false,
            b_transposed: false,
            ..*self
        };
        let mul = |x: &Tensor, y: &Tensor| {
            if self.mkl.is_some() || (x.dtype() == DType::BF16 && self.bf16_dot) {
                x.apply_op2(y, op)
            } else {
                x.matmul(y)
            }
        };
        // The input's gradient `grad @ b^T` is this product again: B's transposed view costs
        // nothing to pack, and the short chains keep its error from growing with the depth
        // (the layer's width; the vocabulary for an LM head). It is also faster than candle's
        // on the layers' shapes (flash-ring's `matmul_timing --backward` example: 2-core Zen 3,
        // DiT-S/2's 2048-row products, 111-134 GFLOP/s against 85-113). The weight's gradient
        // `a^T @ grad` (a column-major left operand, a depth of every row) stays candle's,
        // which is faster there. Under [`matmul_nt`] the second input is W itself: the input's
        // gradient is `grad @ W`, W's is `grad^T @ a` in W's layout (see there).
        let same = |x: &Tensor, y: &Tensor| x.apply_op2(y, op);
        let (da, db) = if self.b_transposed {
            (
                track_a.then(|| same(grad, b)).transpose()?,
                track_b.then(|| mul(&grad.t()?, a)).transpose()?,
            )
        } else {
            (
                track_a.then(|| same(grad, &b.t()?)).transpose()?,
                track_b.then(|| mul(&a.t()?, grad)).transpose()?,
            )
        };
        Ok((da, db))
    }
}
