//! CPU kernels: tiled, multithreaded (rayon) flash attention forward and backward in f32.
//!
//! Inputs are read through strided views (any strides, f32/bf16/f16) and converted to f32 once
//! while packing, except where bf16 inputs meet the CPU's bf16 dot products (AVX512-BF16 under
//! the AVX-512 kernels): `Q K^T` and `dO V^T` then multiply the stored bf16 values
//! (`panel_product`: exact products, f32 sums), and P and dS are rounded to bf16 for the
//! products with them (`P V`, `P^T dO`, `dS^T Q`, `dS K`), as FlashAttention-2 and PyTorch do,
//! with the common part of dS's rounding added back (`bf16_pairs`).
//!
//! Extra memory: packed copies of the inputs and f32 gradient accumulators (O(seq x head_dim)
//! per head) plus O(tile x tile) scratch per task; never O(seq_q x seq_k). The packed buffers
//! come from a process-wide pool that keeps up to [`POOL_BYTES`] cached between calls
//! (first-touch page faults otherwise cost as much as the attention at short lengths);
//! [`release_buffers`] frees it.

pub(crate) mod backward;
pub(crate) mod bf16_pairs;
pub(crate) mod forward;
pub mod gemm;
pub mod gemm_bf16;
pub mod mkl;
pub(crate) mod pool;
pub(crate) mod simd;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Storage};
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::reference::RefShape;
pub use gemm_bf16::Bf16Products;
pub use mkl::Gemm;
use pool::PoolBuf;
pub use pool::{release_buffers, POOL_BYTES};
pub use simd::{available, detect, isa_choice, Isa, ISA_ENV};

/// A choice read once per process from the variable `var` (`cell` holds it): `None` when the
/// variable is unset or empty, else `parse`'s value; the error reads `VAR="value": <why>`. The
/// one reader of `FLASH_RING_GEMM`, `FLASH_RING_BF16` and `FLASH_RING_ISA`.
pub(crate) fn env_choice<T: Clone>(
    cell: &'static std::sync::OnceLock<std::result::Result<Option<T>, String>>,
    var: &str,
    parse: impl FnOnce(&str) -> std::result::Result<T, String>,
) -> std::result::Result<Option<T>, String> {
    cell.get_or_init(|| match std::env::var(var) {
        Ok(v) if !v.is_empty() => parse(&v).map(Some).map_err(|e| format!("{var}={v:?}: {e}")),
        _ => Ok(None),
    })
    .clone()
}

/// `x[i] = exp(x[i] - shift)` in place for every element; returns their f32 sum.
///
/// The attention kernels' vector exponential on this CPU's best instruction set: `2^t` with
/// `t = (x - shift) log2(e)`, max relative error about 2e-7 plus `|x - shift|` ulps of the
/// exponent's rounding (libm's `expf` is within 1 ulp, one element at a time); elements below
/// `shift - 87` (and NaN) give 0, elements above `shift + 88` give `2^127` (about 1.7e38, never
/// inf), on every instruction set. Deterministic: the sum's order depends only on `x.len()`.
/// For the softmax of a loss over a large vocabulary, whose far terms are negligible against
/// the sum (activations, where every element is a result, take [`exp_in_place`]).
pub fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    simd::exp_shift_sum(simd::detect(), x, shift)
}

/// The sum [`exp_shifted`] returns (the same bits), without writing the exponentials: a
/// softmax's normaliser over a row it only reads.
pub fn exp_shifted_sum(x: &[f32], shift: f32) -> f32 {
    simd::exp_shift_sum_of(simd::detect(), x, shift)
}

/// `x[j] = e^(x[j])` on this CPU's best instruction set, within 2.5e-7 relative (2 ulps; libm's
/// `expf` 1) at every argument, vectorized; `x` below about -87.3 (`-inf` and NaN
/// included) gives 0, above about 88.03 `2^127` (never inf). For activations (SiLU's `e^{-x}`,
/// GELU's `e^{-2u}`), whose every element is a result; [`exp_shifted`] is the softmax's.
pub fn exp_in_place(x: &mut [f32]) {
    simd::exp_in_place(simd::detect(), x)
}

/// The largest element of `x` (`-inf` when empty), on this CPU's best instruction set: exact,
/// whatever the order, and NaN when any element is NaN (as PyTorch's `max`; candle's keeps a
/// NaN only in first position). For the row maxima of a loss over a large vocabulary, where a
/// NaN logit must make the loss NaN.
pub fn row_max(x: &[f32]) -> f32 {
    simd::row_max::<true>(simd::detect(), x)
}

/// Tile sizes and instruction set of the CPU kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// Query rows per tile (>= 1).
    pub q_tile: usize,
    /// Key rows per tile (a positive multiple of 32).
    pub k_tile: usize,
    /// Instruction set; `None` picks `FLASH_RING_ISA` when set, else the best one of this
    /// machine ([`detect`]).
    pub isa: Option<Isa>,
    /// The library of the dense products ([`crate::matmul`]; not used by attention).
    pub gemm: Gemm,
    /// Whether bf16 products run on the CPU's bf16 dot products or widened to f32 (the dense
    /// products and all of attention's, P and dS then rounded to bf16; widened, attention
    /// computes in f32 and rounds nothing but its outputs).
    pub bf16: Bf16Products,
}

impl Default for KernelConfig {
    fn default() -> Self {
        KernelConfig {
            q_tile: 128,
            k_tile: 128,
            isa: None,
            gemm: Gemm::Auto,
            bf16: Bf16Products::Auto,
        }
    }
}

impl KernelConfig {
    pub(crate) fn check(&self) -> Result<Isa> {
        if self.q_tile == 0 {
            return Err(Error::Config("q_tile must be >= 1".into()));
        }
        if self.k_tile == 0 || !self.k_tile.is_multiple_of(simd::CHUNK) {
            return Err(Error::Config(format!(
                "k_tile must be a positive multiple of {}, got {}",
                simd::CHUNK,
                self.k_tile
            )));
        }
        match self.isa {
            // A bad FLASH_RING_ISA stops every kernel call, named; a good one is `detect`'s.
            None => {
                simd::isa_from_env().map_err(Error::Config)?;
                Ok(simd::detect())
            }
            Some(i) if !simd::available().contains(&i) => Err(Error::Config(format!(
                "{i:?} requested but not available on this CPU"
            ))),
            Some(i) => Ok(i),
        }
    }

    /// Whether bf16 products bound by their arithmetic (attention's, a dense product of many
    /// rows) or, with `few_rows`, by reading the weight, run on the CPU's bf16 dot products
    /// under `isa` and this configuration's [`Bf16Products`] (see [`gemm_bf16::used_under`]).
    pub(crate) fn bf16_dot(&self, isa: Isa, few_rows: bool) -> Result<bool> {
        gemm_bf16::used_under(isa, self.bf16, few_rows)
    }
}

/// Elements of a CPU tensor, by dtype.
#[derive(Clone, Copy)]
pub(crate) enum Data<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A rank-4 strided view of a CPU tensor (as candle lays it out).
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: Data<'a>,
    pub dims: [usize; 4],
    pub strides: [usize; 4],
    pub offset: usize,
}

impl<'a> View<'a> {
    /// Views a candle storage with its layout. `name` is used in errors.
    pub fn new(name: &'static str, storage: &'a Storage, layout: &Layout) -> Result<Self> {
        match storage {
            Storage::Cpu(cs) => Self::from_cpu(name, cs, layout),
            Storage::Cuda(_) => Err(Error::Device {
                tensor: name,
                device: "cuda".into(),
            }),
            Storage::Metal(_) => Err(Error::Device {
                tensor: name,
                device: "metal".into(),
            }),
        }
    }

    /// Views a CPU storage with its layout (rank 4 or rank 3 with a leading 1 added by caller).
    pub fn from_cpu(name: &'static str, cs: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let data = match cs {
            CpuStorage::F32(v) => Data::F32(v),
            CpuStorage::BF16(v) => Data::BF16(v),
            CpuStorage::F16(v) => Data::F16(v),
            _ => {
                return Err(Error::DType {
                    tensor: name,
                    got: cs.dtype(),
                    expected: "f32, bf16 or f16",
                })
            }
        };
        let d = layout.dims();
        let st = layout.stride();
        let (dims, strides) = match d.len() {
            4 => ([d[0], d[1], d[2], d[3]], [st[0], st[1], st[2], st[3]]),
            3 => ([1, d[0], d[1], d[2]], [0, st[0], st[1], st[2]]),
            _ => {
                return Err(Error::Rank {
                    tensor: name,
                    expected: 4,
                    layout: "batch, seq, heads, head_dim",
                    got: d.to_vec(),
                })
            }
        };
        Ok(View {
            data,
            dims,
            strides,
            offset: layout.start_offset(),
        })
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
        }
    }

    /// Copies `x[i0, i1, i2, 0..n]` (n = `out.len()`, at most dims[3]) times `mul` into `out`.
    #[inline]
    pub fn read(&self, i0: usize, i1: usize, i2: usize, out: &mut [f32], mul: f32) {
        let n = out.len();
        self.read_rows(i0, i1, i2, 1, out, n, mul);
    }

    /// Copies rows `x[i0, i1 + r, i2, 0..n]` for `r < rows` times `mul` into
    /// `out[r * out_rs..r * out_rs + n]`, with n = `min(out_rs, dims[3])`.
    #[allow(clippy::too_many_arguments)]
    pub fn read_rows(
        &self,
        i0: usize,
        i1: usize,
        i2: usize,
        rows: usize,
        out: &mut [f32],
        out_rs: usize,
        mul: f32,
    ) {
        let contiguous = self.strides[3] == 1 || out_rs.min(self.dims[3]) <= 1;
        let at = (i0, i1, i2, rows);
        match self.data {
            Data::F32(v) if mul == 1.0 && contiguous => {
                let n = out_rs.min(self.dims[3]);
                let base0 = self.offset + i0 * self.strides[0] + i2 * self.strides[2];
                for (r, o) in out.chunks_mut(out_rs.max(1)).take(rows).enumerate() {
                    let base = base0 + (i1 + r) * self.strides[1];
                    o[..n].copy_from_slice(&v[base..base + n]);
                }
            }
            Data::F32(v) => self.copy_rows(v, at, out, out_rs, |x| x * mul),
            Data::BF16(v) => self.copy_rows(v, at, out, out_rs, |x| x.to_f32() * mul),
            Data::F16(v) => self.copy_rows(v, at, out, out_rs, |x| x.to_f32() * mul),
        }
    }

    /// Rows `x[i0, i1 + r, i2, 0..n]` for `r < rows` (`at = (i0, i1, i2, rows)`) of the
    /// elements `v` of this view, mapped by `f`, into `out[r * out_rs..r * out_rs + n]`, with
    /// n = `min(out_rs, dims[3])`.
    #[inline]
    fn copy_rows<T: Copy, U>(
        &self,
        v: &[T],
        (i0, i1, i2, rows): (usize, usize, usize, usize),
        out: &mut [U],
        out_rs: usize,
        f: impl Fn(T) -> U,
    ) {
        let n = out_rs.min(self.dims[3]);
        let base0 = self.offset + i0 * self.strides[0] + i2 * self.strides[2];
        let (s1, s3) = (self.strides[1], self.strides[3]);
        for (r, o) in out.chunks_mut(out_rs.max(1)).take(rows).enumerate() {
            let base = base0 + (i1 + r) * s1;
            let o = &mut o[..n];
            if s3 == 1 || n <= 1 {
                for (o, x) in o.iter_mut().zip(&v[base..base + n]) {
                    *o = f(*x);
                }
            } else {
                for (t, o) in o.iter_mut().enumerate() {
                    *o = f(v[base + t * s3]);
                }
            }
        }
    }
}

impl View<'_> {
    /// Whether the attention kernels multiply this operand with the CPU's bf16 dot products:
    /// it is bf16 and `dot` ([`gemm_bf16::used_under`] for the kernels' configuration).
    pub fn bf16_dot(&self, dot: bool) -> bool {
        matches!(self.data, Data::BF16(_)) && dot
    }

    /// Rows `x[i0, i1 + r, i2, ..]` for `r < rows` as stored (bf16) into
    /// `out[r * out_rs..r * out_rs + d]`. Panics (internal bug) on another dtype.
    pub(crate) fn read_rows_bf16(
        &self,
        i0: usize,
        i1: usize,
        i2: usize,
        rows: usize,
        out: &mut [bf16],
        out_rs: usize,
    ) {
        let Data::BF16(v) = self.data else {
            panic!("read_rows_bf16 on a {:?} view", self.dtype());
        };
        self.copy_rows(v, (i0, i1, i2, rows), out, out_rs, |x| x);
    }
}

/// Operands of [`panel_product`]: rows of A (length `dp`) and B in 32-column panels of depth
/// `dp`, in f32 ([`pack_rows`] scaled, [`pack_panels`]) or as stored bf16 ([`pack_rows_bf16`],
/// [`pack_pair_panels`]), each starting at the block's first row and panel.
pub(crate) enum PanelOperands<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [bf16], &'a [bf16]),
}

/// `C (rows x cols) = A B` for the attention kernels' `Q K^T` and `dO V^T`: C rows `c_rs`
/// apart, `cols` a multiple of 32 (whole panels).
pub(crate) fn panel_product(
    isa: Isa,
    ops: PanelOperands,
    rows: usize,
    cols: usize,
    dp: usize,
    c: &mut [f32],
    c_rs: usize,
) {
    match ops {
        PanelOperands::Bf16(a, b) => gemm_bf16::TileProduct {
            rows,
            cols,
            pairs: dp / 2,
            a: gemm_bf16::PairLayout::rows(dp),
            b_cs: dp * simd::CHUNK,
            c_rs,
        }
        .run(a, b, c, false),
        PanelOperands::F32(a, b) => simd::MatMul {
            m: rows,
            n: cols,
            k: dp,
            a_rs: dp,
            a_ks: 1,
            b_rs: simd::CHUNK,
            b_cs: dp * simd::CHUNK,
            c_rs,
            accumulate: false,
        }
        .run(isa, a, b, c),
    }
}

/// `D[i] = sum_c a[i, c] o[i, c]` for `rows` bf16 rows of `a` (length `dp`, as
/// [`pack_rows_bf16`]) and the rows of head `h` of the bf16 view `o`, summed in exactly the
/// chain in which [`panel_product`] sums `a[i] . v[j]` on the bf16 dot products: the diagonal
/// of a 32 x 32 product per block of 32 rows. A row whose output equals a value row (a
/// saturated softmax) then has `D = dP` bit for bit and `dS = P (dP - D)` exactly 0.
pub(crate) fn row_dots_bf16(
    a: &[bf16],
    o: &View,
    b: usize,
    h: usize,
    rows: usize,
    dp: usize,
) -> Vec<f32> {
    const W: usize = simd::CHUNK;
    let panels = pack_pair_panels(o, b, h, rows, dp);
    let mut block = vec![0.0f32; W * W];
    let mut dd = vec![0.0f32; rows];
    for (p, d) in dd.chunks_mut(W).enumerate() {
        let ops = PanelOperands::Bf16(&a[p * W * dp..], &panels[p * W * dp..]);
        panel_product(Isa::Avx512, ops, d.len(), W, dp, &mut block, W);
        for (i, x) in d.iter_mut().enumerate() {
            *x = block[i * W + i];
        }
    }
    dd
}

/// Rows `0..rows` of head `h` in batch `b` as stored (bf16), row-major with row length `dp`
/// (zero padded): the A operand of [`panel_product`].
pub(crate) fn pack_rows_bf16(x: &View, b: usize, h: usize, rows: usize, dp: usize) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; rows * dp];
    x.read_rows_bf16(b, 0, h, rows, &mut out, dp);
    out
}

/// Rows `0..rows` of head `h` in batch `b` as stored (bf16), transposed into the pair-interleaved
/// panels of [`panel_product`]'s B (`dp` even): row `j`, column `c` at
/// `(j / 32) * dp * 32 + (c / 2) * 64 + 2 (j % 32) + c % 2`; padding is zero.
pub(crate) fn pack_pair_panels(x: &View, b: usize, h: usize, rows: usize, dp: usize) -> Vec<bf16> {
    const W: usize = simd::CHUNK;
    let mut out = vec![bf16::ZERO; rows.div_ceil(W) * dp * W];
    for_each_bf16(x, b, h, rows, |j, c, val| {
        out[(j / W) * dp * W + (c / 2) * 2 * W + 2 * (j % W) + c % 2] = val;
    });
    out
}

/// Calls `f(r, c, x[b, r, h, c])` for every row `r < rows` and column `c < d` of head `h` in
/// batch `b`, as stored (bf16), reading 32 rows at a time: the one reader of the bf16 packings.
fn for_each_bf16(x: &View, b: usize, h: usize, rows: usize, mut f: impl FnMut(usize, usize, bf16)) {
    const W: usize = simd::CHUNK;
    let d = x.dims[3];
    let mut tmp = vec![bf16::ZERO; W * d];
    for r0 in (0..rows).step_by(W) {
        let n = W.min(rows - r0);
        x.read_rows_bf16(b, r0, h, n, &mut tmp, d);
        for (r, row) in tmp.chunks_exact(d).take(n).enumerate() {
            for (c, &val) in row.iter().enumerate() {
                f(r0 + r, c, val);
            }
        }
    }
}

/// Rows `0..rows` of head `h` in batch `b` as stored (bf16), transposed: `(dp, rows.next_multiple_of(2))`
/// row-major, zero padded. The A operand of [`gemm_bf16::TileProduct`] whose depth is the rows
/// (adjacent rows are a depth pair).
pub(crate) fn pack_transposed_bf16(
    x: &View,
    b: usize,
    h: usize,
    rows: usize,
    dp: usize,
) -> Vec<bf16> {
    let re = rows.next_multiple_of(2);
    let mut out = vec![bf16::ZERO; dp * re];
    for_each_bf16(x, b, h, rows, |r, c, val| out[c * re + r] = val);
    out
}

/// Rows `0..rows` of head `h` in batch `b` as stored (bf16) as the B operand of
/// [`gemm_bf16::TileProduct`] whose depth is the rows: panels of 32 columns, `(r, c)` at
/// `(c / 32) * re * 32 + (r / 2) * 64 + 2 (c % 32) + r % 2` with `re = rows.next_multiple_of(2)`
/// (so `b_cs = re * 32`); padding is zero.
pub(crate) fn pack_depth_pairs(x: &View, b: usize, h: usize, rows: usize, dp: usize) -> Vec<bf16> {
    const W: usize = simd::CHUNK;
    let re = rows.next_multiple_of(2);
    let mut out = vec![bf16::ZERO; dp.div_ceil(W) * re * W];
    for_each_bf16(x, b, h, rows, |r, c, val| {
        out[(c / W) * re * W + (r / 2) * 2 * W + 2 * (c % W) + r % 2] = val;
    });
    out
}

/// The mean of rows `0..rows` of head `h` in batch `b` (summed in f64 in row order), length
/// `dp` (zero padded); zeros when `rows` is 0.
pub(crate) fn row_mean(x: &View, b: usize, h: usize, rows: usize, dp: usize) -> Vec<f32> {
    let d = x.dims[3];
    let mut sum = vec![0.0f64; d];
    let mut tmp = vec![0.0f32; simd::CHUNK * d];
    for r0 in (0..rows).step_by(simd::CHUNK) {
        let n = simd::CHUNK.min(rows - r0);
        x.read_rows(b, r0, h, n, &mut tmp, d, 1.0);
        for row in tmp.chunks_exact(d).take(n) {
            sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
        }
    }
    let mut out = vec![0.0f32; dp];
    if rows > 0 {
        out.iter_mut()
            .zip(&sum)
            .for_each(|(o, s)| *o = (s / rows as f64) as f32);
    }
    out
}

/// Validated sizes of an attention call: the shape (as the reference names it) and the packed
/// row length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub shape: RefShape,
    /// `d` rounded up to a multiple of 16 (packed row length).
    pub dp: usize,
}

impl std::ops::Deref for Dims {
    type Target = RefShape;
    fn deref(&self) -> &RefShape {
        &self.shape
    }
}

impl Dims {
    /// Checks q (b, sq, hq, d), k and v (b, sk, hkv, d).
    pub fn new(q: &View, k: &View, v: &View) -> Result<Self> {
        let [b, sq, hq, d] = q.dims;
        let [kb, sk, hkv, kd] = k.dims;
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            let (tensor, got) = if q.dtype() != k.dtype() {
                ("k", k.dtype())
            } else {
                ("v", v.dtype())
            };
            return Err(Error::DType {
                tensor,
                got,
                expected: "the dtype of q",
            });
        }
        if kb != b || kd != d {
            return Err(Error::Shape {
                tensor: "k",
                got: k.dims.to_vec(),
                expected: format!("({b}, seq_k, kv_heads, {d}) to match q"),
            });
        }
        if v.dims != k.dims {
            return Err(Error::Shape {
                tensor: "v",
                got: v.dims.to_vec(),
                expected: format!("{:?} (the shape of k)", k.dims),
            });
        }
        if hkv == 0 || hq == 0 || hq % hkv != 0 {
            return Err(Error::Heads {
                q_heads: hq,
                kv_heads: hkv,
            });
        }
        if d == 0 {
            return Err(Error::Shape {
                tensor: "q",
                got: q.dims.to_vec(),
                expected: "head_dim >= 1".into(),
            });
        }
        let shape = RefShape {
            b,
            sq,
            sk,
            hq,
            hkv,
            d,
        };
        Ok(Dims {
            shape,
            dp: d.div_ceil(16) * 16,
        })
    }

    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

/// Rows `0..rows` of head `h` in batch `b` packed row-major with row length `dp` (zero padded),
/// times `mul`.
pub(crate) fn pack_rows(x: &View, b: usize, h: usize, rows: usize, dp: usize, mul: f32) -> PoolBuf {
    let d = x.dims[3];
    let mut out = if d == dp {
        PoolBuf::overwritten(rows * dp)
    } else {
        PoolBuf::zeroed(rows * dp)
    };
    x.read_rows(b, 0, h, rows, &mut out, dp, mul);
    out
}

/// Rows `0..rows` of head `h` in batch `b`, transposed into panels of [`simd::CHUNK`] rows:
/// element (row j, col c) at `(j / 32) * dp * 32 + c * 32 + j % 32`; padding is zero.
pub(crate) fn pack_panels(x: &View, b: usize, h: usize, rows: usize, dp: usize) -> PoolBuf {
    const W: usize = simd::CHUNK;
    let d = x.dims[3];
    let npan = rows.div_ceil(W);
    let mut out = if d == dp && rows.is_multiple_of(W) {
        PoolBuf::overwritten(npan * dp * W)
    } else {
        PoolBuf::zeroed(npan * dp * W)
    };
    // Read a panel's rows into a (W x d) block, then write it column by column.
    let mut tmp = vec![0.0f32; W * d];
    for (p, panel) in out.chunks_exact_mut(dp * W).enumerate() {
        let n = W.min(rows - p * W);
        x.read_rows(b, p * W, h, n, &mut tmp, d, 1.0);
        for (c, col) in panel.chunks_exact_mut(W).take(d).enumerate() {
            for (dst, src) in col.iter_mut().zip(tmp.iter().skip(c).step_by(d)).take(n) {
                *dst = *src;
            }
        }
    }
    out
}

/// A shared output buffer written by parallel tasks at disjoint indices.
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks write disjoint indices (documented at each use); the buffer outlives them.
unsafe impl Send for SharedOut<'_> {}
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    pub fn new(buf: &'a mut [f32]) -> Self {
        SharedOut {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _life: std::marker::PhantomData,
        }
    }

    /// Writes `src` at `offset`.
    ///
    /// # Safety
    /// No other task may access `offset..offset + src.len()` concurrently.
    #[inline]
    pub unsafe fn write(&self, offset: usize, src: &[f32]) {
        assert!(
            offset + src.len() <= self.len,
            "SharedOut: write out of range"
        );
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len());
    }
}
