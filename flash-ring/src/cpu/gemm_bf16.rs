//! bf16 matrix product `C = A B` with the CPU's bf16 dot products (AVX512-BF16 `vdpbf16ps`).
//!
//! `vdpbf16ps` multiplies 16 pairs of bf16 elements of one register by 16 pairs of another and
//! adds each pair's two products to an f32 lane: twice the products per instruction of an f32
//! FMA, without widening the operands to f32 first. The products of two bf16 numbers are exact
//! in f32, so each step rounds only its two additions (round to nearest even, as an f32 sum
//! would); subnormal inputs and results are flushed to zero, as the instruction always does
//! (bf16 subnormals lie below 1.2e-38).
//!
//! The blocking and the order of the chunk sums are those of [`super::gemm`] (its driver runs
//! this kernel), so the result has short accumulation chains and does not depend on the thread
//! count. The chains are [`CHAIN`] = 2 [`KC`] products long (64 `vdpbf16ps` steps) instead of
//! the f32 kernels' [`KC`]: each call of the register block then does twice the work per read
//! and write of its C tile, which made the products 3-9% faster on a Zen 4 EPYC (`cpl bench
//! matmul --dtype bf16`, docs/accuracy.md), and the longer chain's rounding (at most
//! `(CHAIN + k / CHAIN + 2) u` of `sum |a b|`, u = 2^-24) stays below a 200th of the bf16
//! result's own rounding. What differs too is the packing: B's panels hold pairs of depths side by side (`(t, j)` and `(t + 1, j)` in adjacent
//! elements, the layout the instruction reads), and A is read as pairs of adjacent depths
//! (in place when its rows are contiguous and the depth is even; a column-major A, a weight's
//! gradient `grad^T @ x`, is packed in groups of 8 rows by interleaving pairs of A^T's rows,
//! see `groups_of_pairs`; anything else is copied once into rows with the depth padded to even
//! by a zero).
//!
//! The caller checks [`available`] first; elsewhere bf16 products are widened to f32.
//!
//! Where the CPU has the instruction, [`used_under`] still decides by vendor ([`Bf16Products`]),
//! from measurements (docs/accuracy.md, "bf16 products on AVX512-BF16"):
//! - on a 2-core AMD EPYC (Zen 4) these products ran at 700-850 GFLOP/s against the f32
//!   product's 450-475 (`cpl bench matmul --dtype bf16`, 2026-11-25): the dot products there;
//! - on a 2-core Intel Xeon with AVX512-BF16 and AMX (issue 39) they lost to the same products
//!   widened to f32: attention's kernels 150-200 against 230-270 GFLOP/s, a `cpl train` bf16
//!   step 361 against the f32 step's 606 tokens/s (before the dot products, widened bf16
//!   attention ran as fast as f32 on an Intel Xeon: docs/benchmarks.md). A bf16 run must
//!   never be the slow choice, so on Intel's CPUs bf16 products are widened by default (where
//!   MKL runs them, on AMX, it takes the dense products first: [`super::mkl`]).
//! - Products of at most [`MEMORY_BOUND_ROWS`] rows (decoding, small batches) keep the dot
//!   products on Intel's CPUs too: they are bound by reading the weight, which the dot
//!   products read in place as bf16, where widening writes an f32 copy of all of it first.
//!   On the Zen 4 EPYC, decoding SmolLM2's LM head (1 x 576 x 49152) took 2.3 ms on the dot
//!   products and 58-61 ms widened (candle: 21 ms).
//!
//! The rule depends only on the CPU (CPUID), never on a timing, so a run's bits stay the same
//! from one run to the next; `FLASH_RING_BF16=dot|widen` overrides it.

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::gemm::{
    blocked, blocked_into, few_rows, swapped_operands, to_row_major, trivial_product, Chunk, Mat,
    PanelKernel, KC, ROW_GROUP,
};
use super::simd::CHUNK;

/// Whether this CPU has AVX-512F, AVX-512BW/VL and AVX512-BF16 (detected once; every CPU with
/// AVX512-BF16 has the others).
pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Products per register chain of the blocked bf16 product (see the module doc).
pub const CHAIN: usize = 2 * KC;

/// The variable that chooses [`Bf16Products`] under [`Bf16Products::Auto`].
pub const BF16_ENV: &str = "FLASH_RING_BF16";

/// Whether bf16 products (the dense product's and attention's) run on the CPU's bf16 dot
/// products or are widened to f32 and run on the f32 kernels. Either way each product of two
/// bf16 numbers is exact and the sums are f32 in short chains (the dense product's: [`CHAIN`]
/// products on the dot products, [`KC`] widened); on the dot products attention also rounds P
/// and dS to bf16 for the products with them (see `cpu::bf16_pairs`), widened it does not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Products {
    /// `FLASH_RING_BF16` when set; otherwise the dot products on a CPU with AVX512-BF16 that is
    /// not Intel's (AMD Zen 4 and later); on Intel's, widened except for products of a few rows
    /// (see the module doc).
    #[default]
    Auto,
    /// The dot products wherever the CPU has AVX512-BF16 (under the AVX-512 kernels).
    Dot,
    /// Always widened to f32.
    Widen,
}

impl Bf16Products {
    /// `auto`, `dot` or `widen` (any case); the error lists them.
    fn parse(s: &str) -> std::result::Result<Bf16Products, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Bf16Products::Auto),
            "dot" => Ok(Bf16Products::Dot),
            "widen" => Ok(Bf16Products::Widen),
            _ => Err("expected auto, dot or widen".into()),
        }
    }
}

impl std::str::FromStr for Bf16Products {
    type Err = crate::error::Error;

    /// `auto`, `dot` or `widen` (any case); the error lists them.
    fn from_str(s: &str) -> crate::error::Result<Bf16Products> {
        Bf16Products::parse(s)
            .map_err(|e| crate::error::Error::Config(format!("bf16 products {s:?}: {e}")))
    }
}

/// `FLASH_RING_BF16` (read once): `Auto` when unset or empty; the error names the variable.
fn from_env() -> crate::error::Result<Bf16Products> {
    static ENV: OnceLock<std::result::Result<Option<Bf16Products>, String>> = OnceLock::new();
    super::env_choice(&ENV, BF16_ENV, Bf16Products::parse)
        .map(Option::unwrap_or_default)
        .map_err(crate::error::Error::Config)
}

/// Whether this CPU is Intel's (CPUID vendor `GenuineIntel`; detected once).
pub fn intel() -> bool {
    static IS: OnceLock<bool> = OnceLock::new();
    *IS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let r = std::arch::x86_64::__cpuid(0);
            [r.ebx, r.edx, r.ecx]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .eq(*b"GenuineIntel")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Rows of A up to which a dense product counts as bound by reading its weight (see the module
/// doc): the dot products run there under `Auto` on Intel's CPUs too.
pub const MEMORY_BOUND_ROWS: usize = 32;

/// The rule of [`used_under`] for a CPU described by `has_dot` (AVX512-BF16 present) and
/// `intel`, with `choice` already resolved from the environment (`Auto` means no choice), for a
/// product bound by reading its weight (`few_rows`) or by its arithmetic.
pub fn dot_products_on(
    isa: super::Isa,
    choice: Bf16Products,
    has_dot: bool,
    intel: bool,
    few_rows: bool,
) -> bool {
    let possible = isa == super::Isa::Avx512 && has_dot;
    match choice {
        Bf16Products::Dot => possible,
        Bf16Products::Widen => false,
        Bf16Products::Auto => possible && (few_rows || !intel),
    }
}

/// Whether bf16 products under the instruction set `isa` and `choice` run on these dot
/// products (the one place that decides it, for the dense product and the attention kernels
/// alike): only under the AVX-512 kernels on a CPU with AVX512-BF16, and under `Auto` on
/// Intel's CPUs only for products of at most [`MEMORY_BOUND_ROWS`] rows (`few_rows`; attention's
/// products never are). An error names `FLASH_RING_BF16` when it holds something else than
/// `auto`, `dot` or `widen`.
pub fn used_under(
    isa: super::Isa,
    choice: Bf16Products,
    few_rows: bool,
) -> crate::error::Result<bool> {
    let choice = match choice {
        Bf16Products::Auto => from_env()?,
        c => c,
    };
    Ok(dot_products_on(isa, choice, available(), intel(), few_rows))
}

/// `dst[i] = bf16(src[i])`, rounded to nearest even; with AVX512-BF16's `vcvtneps2bf16` where
/// [`available`] (16 at a time; it flushes f32 subnormals, below 1.2e-38, to zero), with
/// `half`'s conversion elsewhere (which keeps them). NaN stays NaN. Hand-written because
/// `half` converts bf16 slices one element at a time.
///
/// Panics (internal bug) when the slices differ in length.
pub fn narrow_to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "narrow_to_bf16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX-512F and AVX512-BF16; the lengths are equal.
        unsafe { avx512bf16::narrow(src, dst) };
        return;
    }
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, s)| *d = bf16::from_f32(*s));
}

/// `src` rounded to bf16 by [`narrow_to_bf16`], in parallel blocks.
pub fn narrowed(src: &[f32]) -> Vec<bf16> {
    const BLOCK: usize = 1 << 14;
    let mut out = vec![bf16::ZERO; src.len()];
    out.par_chunks_mut(BLOCK)
        .zip(src.par_chunks(BLOCK))
        .for_each(|(o, s)| narrow_to_bf16(s, o));
    out
}

/// `C = A B` for bf16 `A` `(m, k)` and `B` `(k, n)` (any strides): C `(m, n)` row-major in f32.
///
/// Panics (internal bug, never user input) when [`available`] is false, the operands disagree
/// on `k` or a slice is shorter than its strides require.
pub fn gemm_bf16(a: Mat<bf16>, b: Mat<bf16>) -> Vec<f32> {
    product(a, b, |c| c, |kern| blocked(kern))
}

/// [`gemm_bf16`] rounded to bf16 ([`narrow_to_bf16`]): the same sums, each rounded once. The
/// blocked product rounds each block of C from cache as it completes, without an f32 copy of
/// C in memory (on a Zen 4 EPYC the copy, its zero-filling and its rounding pass were about 4%
/// of a bf16 LLaMA training step).
pub fn gemm_bf16_rounded(a: Mat<bf16>, b: Mat<bf16>) -> Vec<bf16> {
    product(
        a,
        b,
        |c| narrowed(&c),
        |kern| blocked_into(kern, narrow_to_bf16),
    )
}

/// `a @ b` by the blocked kernel (`blocked_path`), or where another path computes it in f32
/// (an empty product, a few rows against W^T, the swapped product) that result through
/// `f32_path`.
fn product<R>(
    a: Mat<bf16>,
    b: Mat<bf16>,
    f32_path: impl FnOnce(Vec<f32>) -> R,
    blocked_path: impl FnOnce(&Bf16Panels) -> R,
) -> R {
    let (a, b) = match f32_paths(a, b) {
        Ok(c) => return f32_path(c),
        Err(operands) => operands,
    };
    let (m, k) = (a.rows, a.cols);
    let packed;
    let (a_data, a_layout) = if a.cs == 1 && k.is_multiple_of(2) {
        (a.data, PairLayout::rows(a.rs))
    } else if a.rs == 1 {
        // Column-major (a weight's gradient `grad^T @ x`): packed in groups of rows.
        packed = groups_of_pairs(&a);
        (&packed[..], PairLayout::groups(k))
    } else {
        packed = rows_of_pairs(&a);
        (&packed[..], PairLayout::rows(k.next_multiple_of(2)))
    };
    blocked_path(&Bf16Panels {
        a: a_data,
        a_rows: m,
        a_layout,
        b,
    })
}

/// The two operands of a product.
type Operands<'a> = (Mat<'a, bf16>, Mat<'a, bf16>);

/// The products that are not the blocked one, in f32: an empty one, a few rows against W^T,
/// or the swapped product; otherwise the operands back.
fn f32_paths<'a>(a: Mat<'a, bf16>, b: Mat<'a, bf16>) -> Result<Vec<f32>, Operands<'a>> {
    assert!(available(), "gemm_bf16: this CPU has no AVX512-BF16");
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if let Some(trivial) = trivial_product(&a, &b) {
        return Ok(trivial);
    }
    if m <= BF16_FEW_ROWS && b.rs == 1 {
        // A few rows against W^T (decoding): dot products of A's rows with W's rows.
        let a_rows;
        let a = if a.cs != 1 && k > 1 {
            a_rows = to_row_major(&a);
            Mat::row_major(&a_rows, m, k)
        } else {
            a
        };
        return Ok(few_rows(a, b, dot_group));
    }
    if let Some((w, at)) = swapped_operands(&a, &b) {
        let ct = gemm_bf16(w, at);
        return Ok(to_row_major(&Mat::col_major(&ct, m, n)));
    }
    Err((a, b))
}

/// Rows of A up to which a product with B = W^T takes the dot-product path (reading W once,
/// unpacked) instead of the swapped blocked one. Measured on 2 cores (AMD EPYC) against a
/// 576 x 1536 weight: 0.03 ms for 1 row, 0.14 ms for 8; the swapped path takes 0.14 ms for 16
/// rows and 0.20 ms for 32, where the dot products took 0.22 and 0.42 ms.
const BF16_FEW_ROWS: usize = 8;

/// `out[r] = sum_t rows[r][t] col[t]` for up to [`ROW_GROUP`] rows (the few-rows path of
/// [`super::gemm`], with the same chains: blocks of 1024 products, each of 16 lanes summing
/// 64 of them in 32 dot-product steps, the lanes added pairwise, the block sums in order).
fn dot_group(rows: &[&[bf16]], col: &[bf16], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only reached from `gemm_bf16`, which checked `available()`; the kernel reads
    // `col.len()` elements of each row (the rows are `k` long, as `col` is).
    unsafe {
        assert!(rows.iter().all(|r| r.len() >= col.len()) && out.len() >= rows.len());
        match rows.len() {
            1 => avx512bf16::dot_rows::<1>(rows, col, out),
            2 => avx512bf16::dot_rows::<2>(rows, col, out),
            3 => avx512bf16::dot_rows::<3>(rows, col, out),
            _ => avx512bf16::dot_rows::<ROW_GROUP>(rows, col, out),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "gemm_bf16 without AVX512-BF16: {} {} {}",
        rows.len(),
        col.len(),
        out.len()
    )
}

/// A column-major `a` (`a.rs == 1`: the rows of A^T are contiguous) as depth pairs in groups
/// of [`GROUP`] rows ([`PairLayout::groups`]): a group's pairs lie one after the other, each
/// holding its rows' two depths side by side (`2 * GROUP` elements), so the register block
/// reads one contiguous run per group; the second half of the last pair is zero when `k` is
/// odd, and a last group's missing rows are zero (never read). Copying A to contiguous rows
/// instead is an element-by-element transposition: on a Zen 4 EPYC it made an LM head's
/// weight gradient (`grad^T @ x`, 32000 x 1024 x 512) run at 155-162 GFLOP/s, against
/// 290-320 for the same product with a row-major A; pairs of A^T's rows interleaved whole
/// (a stride of `2m` between pairs) missed L1 and the TLB at every pair (225-235).
fn groups_of_pairs(a: &Mat<bf16>) -> Vec<bf16> {
    let (m, k) = (a.rows, a.cols);
    let layout = PairLayout::groups(k);
    let groups = m.div_ceil(GROUP);
    let mut out = vec![bf16::ZERO; groups * layout.gs];
    // Tasks of whole groups, enough of them for every thread, at most 16 groups (a run of 128
    // elements of each of A^T's rows) each.
    let per_task = (groups / (8 * rayon::current_num_threads().max(1))).clamp(1, 16);
    out.par_chunks_mut(per_task * layout.gs)
        .enumerate()
        .for_each(|(task, dst)| {
            let r0 = task * per_task * GROUP;
            let rows = (per_task * GROUP).min(m - r0);
            for p in 0..k.div_ceil(2) {
                let t = 2 * p;
                let first = &a.data[t * a.cs + r0..][..rows];
                let second = (t + 1 < k).then(|| &a.data[(t + 1) * a.cs + r0..][..rows]);
                let at = p * layout.ps;
                // Two whole groups at a time in registers, then what is left.
                let whole = match second {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: only reached from `gemm_bf16`, which checked `available()` (AVX-512
                    // implies AVX2); the kernel checks the lengths.
                    Some(second) => unsafe {
                        avx512bf16::interleave_groups(first, second, &mut dst[at..], layout.gs)
                    },
                    _ => 0,
                };
                for g in whole..rows.div_ceil(GROUP) {
                    let (lo, hi) = (g * GROUP, (g * GROUP + GROUP).min(rows));
                    let out = &mut dst[at + g * layout.gs..];
                    interleave_pairs(&first[lo..hi], second.map(|s| &s[lo..hi]), out);
                }
            }
        });
    out
}

/// Rows of A per group of [`PairLayout::groups`]: the register block's rows.
const GROUP: usize = 8;

/// Where A's depth pairs lie for the register block: pair `p` (depths `2p`, `2p + 1`, two
/// adjacent bf16) of row `i` at `(i / 8) * gs + (i % 8) * rs + p * ps`. The register block
/// reads rows `8g..8g + 8` at a time, so a caller's slice may start at any row for a layout of
/// rows and at a multiple of 8 for one of groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PairLayout {
    pub gs: usize,
    pub rs: usize,
    pub ps: usize,
}

impl PairLayout {
    /// Rows `rs` apart, each with its pairs contiguous.
    pub fn rows(rs: usize) -> Self {
        PairLayout {
            gs: GROUP * rs,
            rs,
            ps: 2,
        }
    }

    /// Groups of [`GROUP`] rows of a depth `k` (rounded up to even), each group's pairs one
    /// after the other with its rows' pairs side by side ([`groups_of_pairs`]).
    pub fn groups(k: usize) -> Self {
        PairLayout {
            gs: GROUP * k.next_multiple_of(2),
            rs: 2,
            ps: 2 * GROUP,
        }
    }

    /// The offset of pair `p` of row `i`.
    pub fn at(&self, i: usize, p: usize) -> usize {
        (i / GROUP) * self.gs + (i % GROUP) * self.rs + p * self.ps
    }
}

/// `out[2j] = first[j]`, `out[2j + 1] = second[j]` (zero without a second row): two depths of
/// a run of columns side by side, the layout `vdpbf16ps` reads. Panics (internal bug) when
/// `out` is shorter than twice `first`, or `second` shorter than `first`.
pub(crate) fn interleave_pairs(first: &[bf16], second: Option<&[bf16]>, out: &mut [bf16]) {
    let out = &mut out[..2 * first.len()];
    match second {
        Some(second) => {
            let second = &second[..first.len()];
            for ((o, x), y) in out.chunks_exact_mut(2).zip(first).zip(second) {
                o[0] = *x;
                o[1] = *y;
            }
        }
        None => {
            for (o, x) in out.chunks_exact_mut(2).zip(first) {
                o[0] = *x;
                o[1] = bf16::ZERO;
            }
        }
    }
}

/// A copy of `a` with contiguous rows of `k` rounded up to even elements (the last one zero
/// when `k` is odd).
fn rows_of_pairs(a: &Mat<bf16>) -> Vec<bf16> {
    let (m, k) = (a.rows, a.cols);
    let kp = k.next_multiple_of(2);
    let transposed;
    let (src, rs) = if a.cs == 1 {
        (a.data, a.rs)
    } else {
        transposed = to_row_major(a);
        (&transposed[..], k)
    };
    let mut out = vec![bf16::ZERO; m * kp];
    out.par_chunks_mut(kp).enumerate().for_each(|(r, row)| {
        row[..k].copy_from_slice(&src[r * rs..r * rs + k]);
    });
    out
}

/// The `vdpbf16ps` kernel over A read as depth pairs and B packed in pair-interleaved panels.
struct Bf16Panels<'a> {
    /// A's depth pairs, laid out as `a_layout` says.
    a: &'a [bf16],
    a_rows: usize,
    a_layout: PairLayout,
    /// `(k, n)`: `b.rows` is the depth of the product.
    b: Mat<'a, bf16>,
}

impl Bf16Panels<'_> {
    fn depth_padded(&self) -> usize {
        self.b.rows.next_multiple_of(2)
    }
}

impl PanelKernel for Bf16Panels<'_> {
    type Packed = bf16;

    fn dims(&self) -> (usize, usize, usize) {
        (self.a_rows, self.b.rows, self.b.cols)
    }

    fn panel_len(&self) -> usize {
        self.depth_padded() * CHUNK
    }

    /// Depth pair `p` of the panel is a row of `2 * CHUNK` elements: `(2p, j)` at `2j`,
    /// `(2p + 1, j)` at `2j + 1`, so one 32-element load holds 16 columns' pairs.
    fn pack_panel(&self, j0: usize, panel: &mut [bf16]) {
        let (b, k) = (&self.b, self.b.rows);
        let w = CHUNK.min(b.cols.saturating_sub(j0));
        if b.rs == 1 && b.cs != 1 {
            // Columns are contiguous (B = W^T): each column's pair of depths is adjacent in
            // memory already.
            // Element by element: a slice copy of each pair was a `memcpy` call per 4 bytes.
            for jj in 0..w {
                let col = &b.data[(j0 + jj) * b.cs..][..k];
                for (row, pair) in panel.chunks_exact_mut(2 * CHUNK).zip(col.chunks_exact(2)) {
                    row[2 * jj] = pair[0];
                    row[2 * jj + 1] = pair[1];
                }
                if k % 2 == 1 {
                    panel[(k / 2) * 2 * CHUNK + 2 * jj] = col[k - 1];
                }
            }
        } else if b.cs == 1 {
            // Rows are contiguous: interleave two rows at a time.
            for (p, row) in panel.chunks_exact_mut(2 * CHUNK).enumerate() {
                let t = 2 * p;
                let first = &b.data[t * b.rs + j0..][..w];
                let second = (t + 1 < k).then(|| &b.data[(t + 1) * b.rs + j0..][..w]);
                interleave_pairs(first, second, row);
            }
        } else {
            for (p, row) in panel.chunks_exact_mut(2 * CHUNK).enumerate() {
                for h in 0..2.min(k - 2 * p) {
                    let t = 2 * p + h;
                    for jj in 0..w {
                        row[2 * jj + h] = b.data[t * b.rs + (j0 + jj) * b.cs];
                    }
                }
            }
        }
    }

    fn chain(&self) -> usize {
        CHAIN
    }

    fn chunk(&self, at: Chunk, panels: &[bf16], dst: &mut [f32]) {
        // The driver's row blocks start at multiples of the register block's rows.
        assert!(at.k0.is_multiple_of(2) && at.r0.is_multiple_of(GROUP));
        TileProduct {
            rows: at.rows,
            cols: at.cols,
            pairs: at.depth.div_ceil(2),
            a: self.a_layout,
            b_cs: self.panel_len(),
            c_rs: at.dst_rs,
        }
        .run_chained(
            &self.a[self.a_layout.at(at.r0, at.k0 / 2)..],
            &panels[at.k0 * CHUNK..],
            dst,
            at.accumulate,
            self.chain() / 2,
        );
    }

    fn call_depth(&self) -> usize {
        // Four chains: 2-3% off a LLaMA-shaped bf16 training step against one chain per call
        // (Zen 4, 7 alternated pairs of runs); a whole super-chunk kept B's column chunk (64
        // KiB) out of L1 and lost on the LM head's product.
        4 * CHAIN
    }
}

/// `C (rows x cols) (+)= A B` over `pairs` depth pairs on the bf16 dot products, for callers that
/// hold bf16 operands in this module's layouts (the blocked product, the attention kernels):
/// A's depth pairs where [`PairLayout`] `a` says (from the slice's start); B in pair-interleaved panels
/// of [`CHUNK`] columns (see `Bf16Panels::pack_panel`), panel `p` at `b[p * b_cs..]`; row `i` of
/// C at `c[i * c_rs..]`. `cols` is a multiple of 16.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileProduct {
    pub rows: usize,
    pub cols: usize,
    pub pairs: usize,
    pub a: PairLayout,
    pub b_cs: usize,
    pub c_rs: usize,
}

impl TileProduct {
    /// Checks the slices against the layout; false when C is empty. Panics (internal bug)
    /// when [`available`] is false or a slice is too short.
    fn check(&self, a: &[bf16], b: &[bf16], c: &[f32]) -> bool {
        let s = *self;
        if s.rows == 0 || s.cols == 0 {
            return false;
        }
        assert!(
            available(),
            "bf16 tile product: this CPU has no AVX512-BF16"
        );
        assert!(
            s.cols.is_multiple_of(16),
            "bf16 tile product: cols {}",
            s.cols
        );
        if s.pairs > 0 {
            assert!(
                a.len() >= s.a.at(s.rows - 1, s.pairs - 1) + 2,
                "bf16 tile product: a too short"
            );
            // The end of chunk `ch`'s reads; the furthest is in the last chunk or, when that
            // one is narrower and `b_cs` small, in the last full one.
            let end = |ch: usize| {
                let w = CHUNK.min(s.cols - ch * CHUNK);
                ch * s.b_cs + (s.pairs - 1) * 2 * CHUNK + 2 * w
            };
            let last = (s.cols - 1) / CHUNK;
            let need = end(last).max(if last > 0 { end(last - 1) } else { 0 });
            assert!(b.len() >= need, "bf16 tile product: b too short");
        }
        assert!(
            c.len() >= (s.rows - 1) * s.c_rs + s.cols,
            "bf16 tile product: c too short"
        );
        true
    }

    /// Runs it. Panics (internal bug) when [`available`] is false or a slice is too short.
    pub fn run(&self, a: &[bf16], b: &[bf16], c: &mut [f32], accumulate: bool) {
        self.run_chained(a, b, c, accumulate, self.pairs.max(1));
    }

    /// Runs it with the depth summed in chains of `chain_pairs` depth pairs: each chain sums
    /// from zero, and the chains' sums are added in depth order to C (with `accumulate`) or to
    /// the first chain's. The same bits as [`TileProduct::run`] over each chain in turn, the
    /// first with `accumulate` and the others with it set; the running sum of the chains stays
    /// in registers (as `MatMul::run_chained` does for f32), so C is written once.
    /// [`TileProduct::run`] is this with one chain.
    pub fn run_chained(
        &self,
        a: &[bf16],
        b: &[bf16],
        c: &mut [f32],
        accumulate: bool,
        chain_pairs: usize,
    ) {
        assert!(chain_pairs > 0, "bf16 tile product: empty chain");
        if !self.check(a, b, c) {
            return;
        }
        let s = *self;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `run`.
        unsafe {
            avx512bf16::matmul(
                s.rows,
                s.cols,
                s.pairs,
                chain_pairs,
                a.as_ptr(),
                s.a,
                b.as_ptr(),
                s.b_cs,
                c.as_mut_ptr(),
                s.c_rs,
                accumulate,
            )
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("bf16 tile product without AVX512-BF16: {accumulate} {s:?}")
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    use super::super::gemm::{finish_block, BLOCK, LANES};
    use super::super::simd::avx512::store_block;
    use super::{PairLayout, CHUNK};
    use half::bf16;
    use std::arch::x86_64::*;

    /// See `dot_group`; the caller checked the lengths.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn dot_rows<const R: usize>(rows: &[&[bf16]], col: &[bf16], out: &mut [f32]) {
        let mut total = [0.0f32; R];
        for (bi, wb) in col.chunks(BLOCK).enumerate() {
            let t0 = bi * BLOCK;
            let mut acc = [_mm512_setzero_ps(); R];
            let mut t = 0;
            while t < wb.len() {
                // 32 elements (16 pairs) a step; the tail is zero-filled by a masked load.
                let rem = (wb.len() - t).min(32);
                let mask: __mmask32 = if rem == 32 { !0 } else { (1u32 << rem) - 1 };
                let w = _mm512_maskz_loadu_epi16(mask, wb.as_ptr().add(t) as *const i16);
                let w: __m512bh = std::mem::transmute(w);
                for r in 0..R {
                    let x =
                        _mm512_maskz_loadu_epi16(mask, rows[r].as_ptr().add(t0 + t) as *const i16);
                    acc[r] =
                        _mm512_dpbf16_ps(acc[r], std::mem::transmute::<__m512i, __m512bh>(x), w);
                }
                t += 32;
            }
            for (r, a) in acc.iter().enumerate() {
                let mut lanes = [0.0f32; LANES];
                _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
                total[r] += finish_block(&mut lanes, &[], &[], 0);
            }
        }
        out[..R].copy_from_slice(&total);
    }

    /// Groups `0..2h` of 8 rows (`h` = the whole pairs of groups in `first`) of
    /// `groups_of_pairs`: group `g`'s 16 elements `first[8g + r]`, `second[8g + r]` interleaved
    /// at `out[g * gs..]`. Returns `2h`. Panics when `second` is shorter than `first` or `out`
    /// too short.
    #[target_feature(enable = "avx2")]
    pub unsafe fn interleave_groups(
        first: &[bf16],
        second: &[bf16],
        out: &mut [bf16],
        gs: usize,
    ) -> usize {
        let pairs = first.len() / 16;
        if pairs == 0 {
            return 0;
        }
        assert!(second.len() >= first.len() && out.len() >= (2 * pairs - 1) * gs + 16);
        let o = out.as_mut_ptr();
        for q in 0..pairs {
            let x = _mm256_loadu_si256(first.as_ptr().add(16 * q) as *const __m256i);
            let y = _mm256_loadu_si256(second.as_ptr().add(16 * q) as *const __m256i);
            // Per 128-bit lane (one group): rows 0-3 and 4-7 of the group, interleaved.
            let (lo, hi) = (_mm256_unpacklo_epi16(x, y), _mm256_unpackhi_epi16(x, y));
            let g0 = _mm256_permute2x128_si256(lo, hi, 0x20);
            let g1 = _mm256_permute2x128_si256(lo, hi, 0x31);
            _mm256_storeu_si256(o.add(2 * q * gs) as *mut __m256i, g0);
            _mm256_storeu_si256(o.add((2 * q + 1) * gs) as *mut __m256i, g1);
        }
        2 * pairs
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn narrow(src: &[f32], dst: &mut [bf16]) {
        let n = src.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut j = 0;
        while j + 16 <= n {
            let h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s.add(j)));
            _mm256_storeu_si256(
                d.add(j) as *mut __m256i,
                std::mem::transmute::<__m256bh, __m256i>(h),
            );
            j += 16;
        }
        if j < n {
            let k = crate::cpu::simd::avx512::tail_mask(n - j);
            let h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, s.add(j)));
            _mm256_mask_storeu_epi16(
                d.add(j) as *mut i16,
                k,
                std::mem::transmute::<__m256bh, __m256i>(h),
            );
        }
    }

    /// Register block: `MR` rows x `NV` 16-lane vectors of C over `pairs` depth pairs summed in
    /// chains of `chain` pairs, as the f32 kernel (`simd::avx512`): a single chain is stored
    /// (or added) to C as it is; over several, `total` takes the first chain's sum (added to C
    /// with `accumulate`), then each further one in depth order, and is stored once.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel<const MR: usize, const NV: usize>(
        pairs: usize,
        chain: usize,
        a: *const bf16,
        a_rs: usize,
        a_ps: usize,
        b: *const bf16,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        let rows: [*const bf16; MR] = std::array::from_fn(|i| a.add(i * a_rs));
        let mut bp = b;
        let mut total = [[_mm512_setzero_ps(); NV]; MR];
        let mut p0 = 0;
        loop {
            let len = chain.min(pairs - p0);
            let mut r = [[_mm512_setzero_ps(); NV]; MR];
            for p in p0..p0 + len {
                let mut bv = [_mm512_castsi512_ps(_mm512_setzero_si512()); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(bp.add(v * 32) as *const f32);
                }
                for (i, ri) in r.iter_mut().enumerate() {
                    // The pair (2p, 2p + 1) of row i, broadcast to every lane.
                    let pair = (rows[i].add(p * a_ps) as *const i32).read_unaligned();
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    for v in 0..NV {
                        let bh: __m512bh = std::mem::transmute(bv[v]);
                        ri[v] = _mm512_dpbf16_ps(ri[v], av, bh);
                    }
                }
                bp = bp.add(2 * CHUNK);
            }
            let last = p0 + len >= pairs;
            if p0 == 0 && last {
                store_block(&r, c, c_rs, accumulate);
                return;
            }
            if p0 == 0 {
                total = r;
                if accumulate {
                    for (i, ti) in total.iter_mut().enumerate() {
                        for (v, x) in ti.iter_mut().enumerate() {
                            *x = _mm512_add_ps(_mm512_loadu_ps(c.add(i * c_rs + v * 16)), *x);
                        }
                    }
                }
            } else {
                for (ti, ri) in total.iter_mut().zip(&r) {
                    for v in 0..NV {
                        ti[v] = _mm512_add_ps(ti[v], ri[v]);
                    }
                }
            }
            p0 += len;
            if last {
                break;
            }
        }
        store_block(&total, c, c_rs, false);
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel_rows<const NV: usize>(
        rows: usize,
        pairs: usize,
        chain: usize,
        a: *const bf16,
        a_rs: usize,
        a_ps: usize,
        b: *const bf16,
        c: *mut f32,
        c_rs: usize,
        acc: bool,
    ) {
        match rows {
            1 => kernel::<1, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            2 => kernel::<2, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            3 => kernel::<3, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            4 => kernel::<4, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            5 => kernel::<5, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            6 => kernel::<6, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            7 => kernel::<7, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
            _ => kernel::<8, NV>(pairs, chain, a, a_rs, a_ps, b, c, c_rs, acc),
        }
    }

    /// `C (rows x cols) (+)= A B` over `pairs` depth pairs: pair `p` of row `i` of A at
    /// `a + a_layout.at(i, p)`, panel `ch` of B at `b + ch * b_cs` (pair rows of `2 * CHUNK`),
    /// row `i` of C at `c + i * c_rs`. `cols` is a multiple of 16; the caller checked the
    /// extents. A chunk of B stays in L1 while A's rows stream by.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        rows: usize,
        cols: usize,
        pairs: usize,
        chain: usize,
        a: *const bf16,
        a_layout: PairLayout,
        b: *const bf16,
        b_cs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        const MR: usize = super::GROUP;
        let PairLayout { gs, rs, ps } = a_layout;
        let full = cols / CHUNK;
        for ch in 0..cols.div_ceil(CHUNK) {
            let bp = b.add(ch * b_cs);
            let mut i = 0;
            while i < rows {
                let n = (rows - i).min(MR);
                let (ap, cp) = (a.add(i / MR * gs), c.add(i * c_rs + ch * CHUNK));
                if ch < full {
                    kernel_rows::<2>(n, pairs, chain, ap, rs, ps, bp, cp, c_rs, accumulate);
                } else {
                    // The last, partial chunk is one vector (16 columns) wide.
                    kernel_rows::<1>(n, pairs, chain, ap, rs, ps, bp, cp, c_rs, accumulate);
                }
                i += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> bf16 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        bf16::from_f32(((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
    }

    /// `run_chained` gives the bits of `run` over each chain in turn (the first with the
    /// call's `accumulate`, the others with it set): partial register blocks, a last column
    /// chunk of one vector, depths shorter than, equal to and not a multiple of the chain,
    /// both layouts of A.
    #[test]
    fn chained_tiles_give_the_bits_of_one_call_per_chain() {
        if !available() {
            eprintln!("SKIPPED: this CPU has no AVX512-BF16");
            return;
        }
        let mut seed = 3;
        let shapes: [(usize, usize, usize); 5] = [
            (1, 16, 1),
            (5, 48, 3),
            (8, 32, 64),
            (13, 80, 130),
            (20, 16, 65),
        ];
        for &(rows, cols, pairs) in &shapes {
            let dp = 2 * pairs;
            for layout in [PairLayout::rows(dp), PairLayout::groups(dp)] {
                let a: Vec<bf16> = (0..rows.div_ceil(GROUP) * GROUP * dp)
                    .map(|_| lcg(&mut seed))
                    .collect();
                let b_cs = pairs * 2 * CHUNK;
                let b: Vec<bf16> = (0..cols.div_ceil(CHUNK) * b_cs)
                    .map(|_| lcg(&mut seed))
                    .collect();
                let c_rs = cols + 5;
                let c0: Vec<f32> = (0..rows * c_rs).map(|i| (i % 7) as f32 - 3.0).collect();
                for chain in [1usize, 7, 64] {
                    for accumulate in [false, true] {
                        let tp = TileProduct {
                            rows,
                            cols,
                            pairs,
                            a: layout,
                            b_cs,
                            c_rs,
                        };
                        let mut want = c0.clone();
                        let mut p0 = 0;
                        while p0 < pairs {
                            let len = chain.min(pairs - p0);
                            TileProduct { pairs: len, ..tp }.run(
                                &a[p0 * layout.ps..],
                                &b[p0 * 2 * CHUNK..],
                                &mut want,
                                accumulate || p0 > 0,
                            );
                            p0 += len;
                        }
                        let mut got = c0.clone();
                        tp.run_chained(&a, &b, &mut got, accumulate, chain);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "rows={rows} cols={cols} pairs={pairs} chain={chain} {layout:?} acc={accumulate}"
                        );
                    }
                }
            }
        }
    }
}
