//! Dense matrix product for candle tensors with short f32 accumulation chains (see
//! [`crate::cpu::gemm`]): the products of the linear layers whose sums must stay accurate
//! when their terms are large and of one sign.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::cpu::gemm::{gemm, Mat};
use crate::cpu::{Isa, KernelConfig};
use crate::error::{Error, Result};
use crate::f32_to_storage;

/// `a @ b` for `a` `(m, k)` and `b` `(k, n)`.
///
/// - Inputs: f32, bf16 or f16 (both the same dtype), any strides (transposed views cost
///   nothing extra for `b`; a column-major `a` is copied once). Arithmetic is f32; the result
///   `(m, n)` is contiguous, in the inputs' dtype.
/// - Each output element sums its `k` products in register chains of
///   [`crate::cpu::gemm::KC`] products, then adds the chain sums, so its rounding error grows
///   with `KC + k / KC` instead of `k` (see [`crate::cpu::gemm`]); results do not depend on
///   the number of threads.
/// - Differentiable with respect to both inputs. The gradients are computed with candle's
///   own matmul (`grad @ b^T`, `a^T @ grad`), as `Tensor::matmul` would.
/// - On other devices (CUDA, Metal) this is candle's own `Tensor::matmul` (cuBLAS on CUDA).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_with_config(a, b, &KernelConfig::default())
}

/// [`matmul`] with an explicit instruction set (`cfg.isa`; the tile sizes are not used).
pub fn matmul_with_config(a: &Tensor, b: &Tensor, cfg: &KernelConfig) -> Result<Tensor> {
    let isa = cfg.check()?;
    let (_, k) = dims2("a", a)?;
    let (kb, _) = dims2("b", b)?;
    if kb != k {
        return Err(Error::Shape {
            tensor: "b",
            got: b.dims().to_vec(),
            expected: format!("({k}, n) to match a {:?}", a.dims()),
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
        return Ok(a.matmul(b)?);
    }
    Ok(a.apply_op2(b, MatMulOp { isa })?)
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

/// The elements of a rank-2 storage as f32 with its strides: borrowed for f32, converted
/// (contiguously) otherwise.
fn f32_view<'a>(
    name: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
    buf: &'a mut Vec<f32>,
) -> Result<Mat<'a>> {
    let (rows, cols) = match l.dims() {
        &[r, c] => (r, c),
        d => {
            return Err(Error::Rank {
                tensor: name,
                expected: 2,
                layout: "rows, cols",
                got: d.to_vec(),
            })
        }
    };
    let (rs, cs) = (l.stride()[0], l.stride()[1]);
    let o = l.start_offset();
    let strided = |i: usize| o + (i / cols.max(1)) * rs + (i % cols.max(1)) * cs;
    match s {
        CpuStorage::F32(v) => Ok(Mat {
            data: &v[o.min(v.len())..],
            rows,
            cols,
            rs,
            cs,
        }),
        CpuStorage::BF16(v) => {
            *buf = (0..rows * cols).map(|i| v[strided(i)].to_f32()).collect();
            Ok(Mat::row_major(buf, rows, cols))
        }
        CpuStorage::F16(v) => {
            *buf = (0..rows * cols).map(|i| v[strided(i)].to_f32()).collect();
            Ok(Mat::row_major(buf, rows, cols))
        }
        other => Err(Error::DType {
            tensor: name,
            got: other.dtype(),
            expected: "f32, bf16 or f16",
        }),
    }
}

/// `CustomOp2` over `(a, b)` returning `a @ b`.
struct MatMulOp {
    isa: Isa,
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
        let (mut b1, mut b2) = (Vec::new(), Vec::new());
        let a = f32_view("a", s1, l1, &mut b1)?;
        let b = f32_view("b", s2, l2, &mut b2)?;
        if a.cols != b.rows {
            candle_core::bail!(
                "flash-ring-matmul: a is {}x{} but b is {}x{}",
                a.rows,
                a.cols,
                b.rows,
                b.cols
            );
        }
        let (m, n) = (a.rows, b.cols);
        let c = gemm(self.isa, a, b);
        Ok((f32_to_storage(c, s1.dtype()), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Only the gradients that flow somewhere: a frozen weight (LoRA's base) has none, which
        // saves a third of a linear layer's backward.
        let da = a.track_op().then(|| grad.matmul(&b.t()?)).transpose()?;
        let db = b.track_op().then(|| a.t()?.matmul(grad)).transpose()?;
        Ok((da, db))
    }
}
