//! A block of f32 values narrowed to bf16 in the layouts of the bf16 dot products, with the sums
//! of what the rounding dropped: how the bf16 backward feeds P and dS to [`TileProduct`].
//!
//! FlashAttention-2 and PyTorch's CPU kernel round P and dS to the inputs' 16-bit type before
//! the backward's three products with them (`dV += P^T dO`, `dK += dS^T Q`, `dQ += dS K`), so
//! those products run at the 16-bit rate. The rounding has one weak spot: every row of dS sums
//! to zero (`sum_k P (dP - D) = 0`), so `dQ = dS K` cancels the keys' common part, and rounded
//! dS no longer sums to zero: on keys with a large mean (`K = c + d`) the error grows with
//! `|c|`, not `|d|` (1.6e-2 max-norm relative at a mean of 20, against 3e-3 unrounded; PyTorch's
//! own bf16 SDPA gives 1.5 there, `docs/accuracy.md`). The same holds for `dK = dS^T Q` on
//! queries with a large mean. So the backward also adds back the dropped part's common term:
//! with `e = dS - bf16(dS)`, `dS K = bf16(dS) K + e K = bf16(dS) K + (sum_k e) c + e (K - c)`;
//! the first two terms are computed (the second from this module's row sums of `e`, `c` the
//! mean key) and only `e (K - c)` is lost, an error in `|K - c|` as without the rounding.
//!
//! Hand-written (AVX512-BF16's `vcvtne2ps2bf16` two rows at a time, their halves interleaved
//! into column pairs in registers): a scalar narrowing of each P and dS element cost as much as
//! the three products it feeds.

use half::bf16;

use super::simd::CHUNK;

/// Where [`narrow_pairs`] also writes the block row-major and the sums of the rounding errors.
pub(crate) struct RowsAndErrors<'a> {
    /// Row `r` narrowed at `rows[r * rs..]`, `cols.next_multiple_of(16)` elements (zeros past
    /// `cols`).
    pub rows: &'a mut [bf16],
    pub rs: usize,
    /// `row_err[r] += sum_c (x - bf16(x))` over row `r`.
    pub row_err: &'a mut [f32],
    /// `col_err[c] += sum_r (x - bf16(x))` over column `c` (rows in pairs: `(e_2p + e_2p+1)`
    /// added pair after pair).
    pub col_err: &'a mut [f32],
}

/// Elements of the pair panels [`narrow_pairs`] writes for `rows` x `cols`: panels of
/// [`CHUNK`] columns, each `rows.next_multiple_of(2) * CHUNK` long.
pub(crate) fn pair_panels_len(rows: usize, cols: usize) -> usize {
    cols.div_ceil(CHUNK) * rows.next_multiple_of(2) * CHUNK
}

/// Narrows `src[r * src_rs + c]` (`r < rows`, `c < cols`) to bf16 (round to nearest even, f32
/// subnormals to zero as the instruction does) into `panels`, the B operand of [`TileProduct`]
/// with the rows as its depth: element `(r, c)` at `(c / CHUNK) * P + (r / 2) * 2 * CHUNK +
/// 2 * (c % CHUNK) + r % 2` with `P = rows.next_multiple_of(2) * CHUNK` (so `b_cs = P`); the
/// partner of an odd last row and the columns up to the next multiple of [`CHUNK`] are zero.
/// With `more`, also the row-major copy and the error sums (see [`RowsAndErrors`]).
///
/// Panics (internal bug) when the CPU has no AVX512-BF16 or a slice is too short.
///
/// [`TileProduct`]: super::gemm_bf16::TileProduct
pub(crate) fn narrow_pairs(
    src: &[f32],
    src_rs: usize,
    rows: usize,
    cols: usize,
    panels: &mut [bf16],
    more: Option<RowsAndErrors>,
) {
    assert!(
        super::gemm_bf16::available(),
        "narrow_pairs: this CPU has no AVX512-BF16"
    );
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(src.len() >= (rows - 1) * src_rs + cols, "narrow_pairs: src");
    assert!(
        panels.len() >= pair_panels_len(rows, cols),
        "narrow_pairs: panels"
    );
    if let Some(m) = &more {
        let w = cols.next_multiple_of(16);
        assert!(
            m.rs >= w && m.rows.len() >= (rows - 1) * m.rs + w,
            "narrow_pairs: rows"
        );
        assert!(m.row_err.len() >= rows && m.col_err.len() >= cols.next_multiple_of(CHUNK));
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX512-BF16 (and AVX-512F/BW); the extents were checked above.
    unsafe {
        avx512::narrow_pairs(src, src_rs, rows, cols, panels, more)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "narrow_pairs without AVX512-BF16: {src_rs} {}",
        more.is_some()
    )
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{RowsAndErrors, CHUNK};
    use half::bf16;
    use std::arch::x86_64::*;

    /// bf16 values (16) widened to f32 exactly.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn widen(h: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn narrow_pairs(
        src: &[f32],
        src_rs: usize,
        rows: usize,
        cols: usize,
        panels: &mut [bf16],
        mut more: Option<RowsAndErrors>,
    ) {
        // Lane 2i takes element i of the first row, lane 2i + 1 element i of the second.
        let idx: [i16; 32] = std::array::from_fn(|l| ((l % 2) * 16 + l / 2) as i16);
        let idx = _mm512_loadu_si512(idx.as_ptr() as *const _);
        let panel = rows.next_multiple_of(2) * CHUNK;
        let groups = cols.div_ceil(CHUNK) * (CHUNK / 16);
        let (s, out) = (src.as_ptr(), panels.as_mut_ptr() as *mut i16);
        for p in 0..rows.div_ceil(2) {
            let (r0, r1) = (2 * p, 2 * p + 1);
            let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for g in 0..groups {
                let c = 16 * g;
                let m = if c >= cols {
                    0
                } else {
                    super::super::simd::avx512::tail_mask((cols - c).min(16))
                };
                let x0 = _mm512_maskz_loadu_ps(m, s.add(r0 * src_rs + c));
                let x1 = if r1 < rows {
                    _mm512_maskz_loadu_ps(m, s.add(r1 * src_rs + c))
                } else {
                    _mm512_setzero_ps()
                };
                // Low half: row r0's 16 values, high half: row r1's.
                let h = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(x1, x0));
                let at = (c / CHUNK) * panel + p * 2 * CHUNK + 2 * (c % CHUNK);
                _mm512_storeu_si512(out.add(at) as *mut _, _mm512_permutexvar_epi16(idx, h));
                if let Some(m) = more.as_mut() {
                    let (h0, h1) = (_mm512_castsi512_si256(h), _mm512_extracti64x4_epi64::<1>(h));
                    let rp = m.rows.as_mut_ptr() as *mut __m256i;
                    if c < cols {
                        _mm256_storeu_si256(rp.byte_add(2 * (r0 * m.rs + c)), h0);
                        if r1 < rows {
                            _mm256_storeu_si256(rp.byte_add(2 * (r1 * m.rs + c)), h1);
                        }
                    }
                    let e0 = _mm512_sub_ps(x0, widen(h0));
                    let e1 = _mm512_sub_ps(x1, widen(h1));
                    acc0 = _mm512_add_ps(acc0, e0);
                    acc1 = _mm512_add_ps(acc1, e1);
                    let ce = m.col_err.as_mut_ptr().add(c);
                    _mm512_storeu_ps(
                        ce,
                        _mm512_add_ps(_mm512_loadu_ps(ce), _mm512_add_ps(e0, e1)),
                    );
                }
            }
            if let Some(m) = more.as_mut() {
                m.row_err[r0] += _mm512_reduce_add_ps(acc0);
                if r1 < rows {
                    m.row_err[r1] += _mm512_reduce_add_ps(acc1);
                }
            }
        }
    }
}
