//! Dense f32 matrix product `C = A B` with short accumulation chains.
//!
//! Each element of C is a sum of `k` products. A GEMM that keeps one running sum per element
//! over the whole depth (the `gemm` crate does, over blocks of at least 512) adds every product
//! to a partial sum that grows to the size of the result: when the terms share a sign (the
//! coherent sums that make a transformer's large activations) the rounding error grows with
//! `k` (about `k/4` ulps of the result on average). Here every element is accumulated in
//! registers over chunks of [`KC`] products only; each chunk's sum is then added to C, so an
//! element's error is about `KC + k / KC` roundings of partial sums instead of `k` (about 5x
//! smaller at k = 1536). The chunk boundaries and their order depend only on `k`, never on the
//! thread count, so results are bit-reproducible.
//!
//! B is packed once per call into column panels of `CHUNK` columns; A is read in place
//! through its strides. Work is split over rayon tasks of `MB` rows by `NB` columns of C;
//! each task runs the register-blocked kernel of `MatMul` over its block one super-chunk of
//! depth at a time, so its block of C stays in the L2 cache between them. On AVX-512 the
//! kernel sums a super-chunk's chains and their running sum in registers
//! ([`MatMul::run_chained`]); the other kernels take one chain per call and add it to C. Both
//! give the same bits.

use rayon::prelude::*;

use super::simd::{Isa, MatMul, CHUNK};

/// Products per register accumulation chain (see the module docs).
pub const KC: usize = 64;
/// Depth of a super-chunk: the sums of its [`KC`]-chunks are added in a scratch block, which
/// is then added to C, so even very long depths add only `k / SUPER` terms to C.
const SUPER: usize = 16 * KC;
/// Rows of C per task (a multiple of the AVX2 kernel's 3 rows and the AVX-512 kernel's 8).
const MB: usize = 96;
/// Columns of C per task (a multiple of [`CHUNK`]).
const NB: usize = 256;
/// Row blocks are multiples of this (the kernels' row counts: 3 for AVX2, 8 for AVX-512).
const ROW_ALIGN: usize = 24;

/// A strided matrix (f32 unless said): element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a, T = f32> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// A `rows x cols` matrix stored row by row.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// A `rows x cols` matrix stored column by column (the transpose of a row-major
    /// `cols x rows` one, e.g. `W^T` of a `(out, in)` weight).
    pub fn col_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: 1,
            cs: rows,
        }
    }

    /// The number of elements `data` must hold at least (0 for an empty matrix).
    pub(crate) fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }
}

/// A shared, disjointly written output (f32 unless said).
pub(crate) struct OutPtr<E = f32>(pub(crate) *mut E);
// SAFETY: tasks write disjoint elements (see `gemm`, `blocked_into`); the buffer outlives them.
unsafe impl<E: Send> Send for OutPtr<E> {}
unsafe impl<E: Send> Sync for OutPtr<E> {}

impl<E> OutPtr<E> {
    pub(crate) fn get(&self) -> *mut E {
        self.0
    }
}

/// `C = A B` with `A` `(m, k)` and `B` `(k, n)`: returns C `(m, n)` row-major.
///
/// Panics (internal bug, never user input) when the operands disagree on `k` or a slice is
/// shorter than its strides require.
pub fn gemm(isa: Isa, a: Mat, b: Mat) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if let Some(trivial) = trivial_product(&a, &b) {
        return trivial;
    }
    // The dot products read A's rows contiguous in the depth (a column-major A is transposed
    // once for them); the blocked product and the swapped one read any strides.
    let a_rows;
    let a = if a.cs != 1 && k > 1 && m <= FEW_ROWS && b.rs == 1 {
        a_rows = to_row_major(&a);
        Mat::row_major(&a_rows, m, k)
    } else {
        a
    };
    if m <= FEW_ROWS && b.rs == 1 {
        return few_rows(a, b, |rows, col, out| {
            dot_group_dispatch(isa, rows, col, out)
        });
    }
    if let Some((w, at)) = swapped_operands(&a, &b) {
        let ct = gemm(isa, w, at);
        return to_row_major(&Mat::col_major(&ct, m, n));
    }
    blocked(&F32Panels { isa, a, b })
}

/// Shape checks shared by the products: panics on an internal bug (see [`gemm`]); returns the
/// result when it has no products to sum (an empty C, or `k = 0`).
pub(crate) fn trivial_product<T>(a: &Mat<T>, b: &Mat<T>) -> Option<Vec<f32>> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm: inner dimensions differ");
    assert!(a.data.len() >= a.extent(), "gemm: a too short");
    assert!(b.data.len() >= b.extent(), "gemm: b too short");
    if m == 0 || n == 0 {
        Some(Vec::new())
    } else if k == 0 {
        Some(vec![0.0; m * n])
    } else {
        None
    }
}

/// `(W, A^T)` when `C = A B` with B = W^T (contiguous columns) against a few rows of A is
/// better computed as `C^T = W A^T`: packing W would cost more than the product, so A^T is
/// packed instead and the caller transposes C^T. Every output sums the same products in the
/// same chains: the same bits.
pub(crate) fn swapped_operands<'a, T>(
    a: &Mat<'a, T>,
    b: &Mat<'a, T>,
) -> Option<(Mat<'a, T>, Mat<'a, T>)> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if !(b.rs == 1 && b.cs != 1 && m * SWAP_RATIO <= k.min(n)) {
        return None;
    }
    let w = Mat {
        data: b.data,
        rows: n,
        cols: k,
        rs: b.cs,
        cs: 1,
    };
    let at = Mat {
        data: a.data,
        rows: k,
        cols: m,
        rs: a.cs,
        cs: a.rs,
    };
    Some((w, at))
}

/// A register kernel with its packed layout of B, run by [`blocked`] over blocks of C.
///
/// B is packed in panels of [`CHUNK`] columns, `panel_len()` elements each, laid out so that
/// depth `t` of a panel starts at `t * CHUNK` (pairs of depths share a row of `2 * CHUNK` in
/// the bf16 layout: the same offsets at even `t`). Chunk boundaries are multiples of [`KC`].
pub(crate) trait PanelKernel: Sync {
    /// Element of the packed panels.
    type Packed: Copy + Default + Send + Sync;
    /// Rows, depth and columns of the product.
    fn dims(&self) -> (usize, usize, usize);
    /// Elements of one packed panel.
    fn panel_len(&self) -> usize;
    /// Columns `j0..j0 + CHUNK` of B (zeros past its last column) into the zeroed `panel`.
    fn pack_panel(&self, j0: usize, panel: &mut [Self::Packed]);
    /// `dst (+)= A[rows, depth] B[depth, panels]` for one [`Chunk`] of `depth <=
    /// call_depth()`, summing every element's products in register chains of
    /// [`PanelKernel::chain`] and the chains' sums in depth order; `panels` starts at depth 0
    /// of the first panel of the block's columns.
    fn chunk(&self, at: Chunk, panels: &[Self::Packed], dst: &mut [f32]);
    /// Products per register chain: [`KC`] unless the kernel says otherwise (a divisor of
    /// [`SUPER`] and a multiple of [`KC`]).
    fn chain(&self) -> usize {
        KC
    }
    /// Depth handed to [`PanelKernel::chunk`] per call: a multiple of [`PanelKernel::chain`]
    /// dividing [`SUPER`]. Above one chain the kernel sums the call's chains and adds their
    /// sums in depth order itself (to C with `accumulate`), as one call per chain would.
    fn call_depth(&self) -> usize;
}

/// One depth chunk of one block of C, as [`blocked`] hands it to a [`PanelKernel`]: rows
/// `r0..r0 + rows` of A over depths `k0..k0 + depth` (`k0` a multiple of [`KC`]) against
/// `cols` packed columns (a multiple of 16), into a destination of row stride `dst_rs`, added
/// to it with `accumulate`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunk {
    pub r0: usize,
    pub rows: usize,
    pub k0: usize,
    pub depth: usize,
    pub cols: usize,
    pub dst_rs: usize,
    pub accumulate: bool,
}

/// The f32 kernels of [`MatMul`] on A read through its strides (a column-major A in place: on
/// a Zen 4 EPYC an LM head's weight gradient, 32000 x 1024 x 512, ran at 183-190 GFLOP/s so, at
/// 190-193 from a row-major copy made beforehand, whose making it saves).
struct F32Panels<'a> {
    isa: Isa,
    a: Mat<'a>,
    b: Mat<'a>,
}

impl PanelKernel for F32Panels<'_> {
    type Packed = f32;

    fn dims(&self) -> (usize, usize, usize) {
        (self.a.rows, self.a.cols, self.b.cols)
    }

    fn panel_len(&self) -> usize {
        self.a.cols * CHUNK
    }

    fn pack_panel(&self, j0: usize, panel: &mut [f32]) {
        pack_panel(&self.b, j0, panel)
    }

    fn chunk(&self, at: Chunk, panels: &[f32], dst: &mut [f32]) {
        let k = self.a.cols;
        let mm = MatMul {
            m: at.rows,
            n: at.cols,
            k: at.depth,
            a_rs: self.a.rs,
            a_ks: self.a.cs,
            b_rs: CHUNK,
            b_cs: k * CHUNK,
            c_rs: at.dst_rs,
            accumulate: at.accumulate,
        };
        let a = &self.a.data[at.r0 * self.a.rs + at.k0 * self.a.cs..];
        let b = &panels[at.k0 * CHUNK..];
        mm.run_chained(self.isa, self.chain(), a, b, dst);
    }

    fn call_depth(&self) -> usize {
        SUPER
    }
}

/// The blocked product of `kern`: C `(m, n)` row-major, in f32.
///
/// Each task's block of C is summed in place (rows padded to whole 16-column vectors, removed
/// at the end): zeroed in cache just before its first depth chunk overwrites it (a serial fill
/// of the whole of C, up to 128 MiB for an LM head chunk, ran on the calling thread while the
/// workers waited, and sent C to memory twice), which costs less than summing it in a scratch
/// block and copying that out.
pub(crate) fn blocked<K: PanelKernel>(kern: &K) -> Vec<f32> {
    let (m, k, n) = kern.dims();
    let np = n.div_ceil(16) * 16;
    let mut c: Vec<f32> = Vec::with_capacity(m * np);
    let out = OutPtr(c.as_mut_ptr());
    let c_len = m * np;
    run_blocks(kern, |panels, tmp: &mut Vec<f32>, r0, rows, c0, cols| {
        let c_off = r0 * np + c0;
        let c_need = (rows - 1) * np + cols;
        assert!(c_off + c_need <= c_len, "gemm: c block out of range");
        // SAFETY: every (row block, column block) pair is computed by exactly one task, and
        // the range was checked above; the block's rows are initialised (zeroed) by this task
        // before it is viewed as a slice. The bytes between its rows are other tasks' columns:
        // they are zeroed by those tasks, and this task neither reads nor writes them.
        let cblk = unsafe {
            for r in 0..rows {
                std::ptr::write_bytes(out.get().add(c_off + r * np), 0, cols);
            }
            std::slice::from_raw_parts_mut(out.get().add(c_off), c_need)
        };
        sum_block(kern, panels, cblk, np, tmp, (r0, rows, cols), k);
    });
    // SAFETY: the tasks above initialised every element of C (the row blocks cover rows
    // 0..m, the column blocks columns 0..np).
    unsafe { c.set_len(m * np) };
    if np != n {
        for r in 1..m {
            c.copy_within(r * np..r * np + n, r * n);
        }
        c.truncate(m * n);
    }
    c
}

/// The blocked product of `kern`, each element of C `(m, n)` row-major stored by `store` (a
/// rounding to bf16).
///
/// Each task sums its block in a scratch block of its own, which stays in L2; when the block's
/// depth is done, `store` writes its rows into C (`store(sums, out)`, equal lengths), once per
/// element: C is neither zero-filled nor read back, and a bf16 result is rounded from cache
/// instead of from an f32 copy of C in memory.
pub(crate) fn blocked_into<K, E>(kern: &K, store: impl Fn(&[f32], &mut [E]) + Sync) -> Vec<E>
where
    K: PanelKernel,
    E: Copy + Send + Sync,
{
    let (m, k, n) = kern.dims();
    let mut c: Vec<E> = Vec::with_capacity(m * n);
    let out = OutPtr(c.as_mut_ptr());
    run_blocks(
        kern,
        |panels, (sums, tmp): &mut Scratch, r0, rows, c0, cols| {
            // The first depth chunk overwrites the block (`accumulate` false): the scratch is
            // resized, never cleared.
            sums.resize(rows * cols, 0.0);
            sum_block(kern, panels, sums, cols, tmp, (r0, rows, cols), k);
            // Columns past n are the kernel's padding.
            let width = cols.min(n - c0);
            for (r, row) in sums.chunks_exact(cols).enumerate() {
                let at = (r0 + r) * n + c0;
                assert!(at + width <= m * n, "gemm: c block out of range");
                // SAFETY: every (row block, column block) pair is stored by exactly one task, each
                // of its rows' `width` elements once, within C's capacity (checked above); the
                // elements are written before they are read (they are never read here).
                let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(at), width) };
                store(&row[..width], dst);
            }
        },
    );
    // SAFETY: the tasks above stored every element of C: the row blocks cover rows 0..m, the
    // column blocks columns 0..np, and each block stores its columns below n.
    unsafe { c.set_len(m * n) };
    c
}

/// Rows `r0..r0 + rows` by the `cols` packed columns of `panels`, summed over the whole depth
/// `k` into `dst` (row stride `dst_rs`) one depth chunk at a time; depths beyond one
/// super-chunk are summed in `tmp` first, then added.
fn sum_block<K: PanelKernel>(
    kern: &K,
    panels: &[K::Packed],
    dst: &mut [f32],
    dst_rs: usize,
    tmp: &mut Vec<f32>,
    (r0, rows, cols): (usize, usize, usize),
    k: usize,
) {
    let chunks = |s0: usize, dst: &mut [f32], dst_rs: usize| {
        let kc = kern.call_depth();
        for k0 in (s0..k.min(s0 + SUPER)).step_by(kc) {
            let at = Chunk {
                r0,
                rows,
                k0,
                depth: kc.min(k - k0),
                cols,
                dst_rs,
                accumulate: k0 > s0,
            };
            kern.chunk(at, panels, dst);
        }
    };
    chunks(0, dst, dst_rs);
    if k > SUPER {
        tmp.resize(rows * cols, 0.0);
        for s0 in (SUPER..k).step_by(SUPER) {
            chunks(s0, tmp, cols);
            for (crow, trow) in dst.chunks_mut(dst_rs).zip(tmp.chunks_exact(cols)) {
                crow[..cols].iter_mut().zip(trow).for_each(|(c, t)| *c += t);
            }
        }
    }
}

/// Runs `block(panels, scratch, r0, rows, c0, cols)` once for every block of C of the blocked
/// product of `kern` over rayon's threads (`scratch` per task, `panels` starting at column
/// `c0`): tasks of at most [`MB`] rows by [`NB`] columns; B packed once, or for a wide B one
/// column block per task.
fn run_blocks<K, S>(
    kern: &K,
    block: impl Fn(&[K::Packed], &mut S, usize, usize, usize, usize) + Sync,
) where
    K: PanelKernel,
    S: Default + Send,
{
    let (m, _, n) = kern.dims();
    let panel_len = kern.panel_len();
    let np = n.div_ceil(16) * 16;
    let col_blocks = np.div_ceil(NB);
    let threads = rayon::current_num_threads().max(1);
    // Row blocks of at most MB rows, of equal size (a multiple of ROW_ALIGN but the last).
    let nblk = m.div_ceil(MB);
    let blk = m.div_ceil(nblk).div_ceil(ROW_ALIGN) * ROW_ALIGN;
    let row_blocks = m.div_ceil(blk);
    if col_blocks >= 8 * threads {
        // Wide B (an LM head): each task packs one column block and runs every row against
        // it while it is in cache.
        (0..col_blocks).into_par_iter().for_each_init(
            || (Vec::new(), S::default()),
            |(panels, scratch): &mut (Vec<K::Packed>, S), cb| {
                let (c0, cols) = (cb * NB, NB.min(np - cb * NB));
                panels.clear();
                panels.resize(cols.div_ceil(CHUNK) * panel_len, K::Packed::default());
                for (p, panel) in panels.chunks_exact_mut(panel_len).enumerate() {
                    kern.pack_panel(c0 + p * CHUNK, panel);
                }
                for rb in 0..row_blocks {
                    block(panels, scratch, rb * blk, blk.min(m - rb * blk), c0, cols);
                }
            },
        );
    } else {
        // B packed once, shared by fine-grained (row block, column block) tasks.
        let npan = np.div_ceil(CHUNK);
        let mut panels = vec![K::Packed::default(); npan * panel_len];
        panels
            .par_chunks_mut(panel_len)
            .enumerate()
            .for_each(|(p, panel)| kern.pack_panel(p * CHUNK, panel));
        (0..row_blocks * col_blocks)
            .into_par_iter()
            .for_each_init(S::default, |scratch, task| {
                let (rb, cb) = (task / col_blocks, task % col_blocks);
                let c0 = cb * NB;
                block(
                    &panels[(c0 / CHUNK) * panel_len..],
                    scratch,
                    rb * blk,
                    blk.min(m - rb * blk),
                    c0,
                    NB.min(np - c0),
                );
            });
    }
}

/// A task's scratch blocks of [`blocked_into`]: the block's sums, and the sums of one
/// super-chunk.
type Scratch = (Vec<f32>, Vec<f32>);

/// Rows of A up to which a product with a B of contiguous columns (`B = W^T`, a linear layer's
/// weight) takes [`few_rows`]: packing B would cost as much as the product (decoding one token
/// at a time, short sequences).
const FEW_ROWS: usize = 32;
/// A product with B = W^T is computed as `(W A^T)^T` when A has at most `1/SWAP_RATIO` as
/// many rows as W has rows and columns (measured on 2 cores: 1.5x faster at 48 rows against
/// a 576 x 1536 weight, slower from about 200 rows on, where transposing C costs more than
/// packing W in cache-sized blocks).
const SWAP_RATIO: usize = 8;
/// Lanes of [`few_rows`]' accumulators (one AVX-512 or two AVX2 vectors).
pub(crate) const LANES: usize = 16;
/// Rows of A that [`few_rows`] runs against each column of B while it is in L1.
pub(crate) const ROW_GROUP: usize = 4;

/// `C = A B` for A with contiguous rows and B with contiguous columns, as dot products of A's
/// rows with B's columns, reading B once and never packing it.
///
/// The same short chains as the blocked path: depth blocks of `LANES * KC` products, each lane
/// summing at most [`KC`] of them, the lanes added pairwise, then the block sums added in order.
/// Plain multiplies and adds (no FMA), so the result is the same on every instruction set;
/// columns are split over rayon tasks, never the depth, so it does not depend on the thread
/// count either.
///
/// `dot(rows, col, out)` computes up to [`ROW_GROUP`] rows' sums (see [`dot_group_dispatch`]).
pub(crate) fn few_rows<T: Sync>(
    a: Mat<T>,
    b: Mat<T>,
    dot: impl Fn(&[&[T]], &[T], &mut [f32]) + Sync,
) -> Vec<f32> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let rows: Vec<&[T]> = (0..m).map(|r| &a.data[r * a.rs..r * a.rs + k]).collect();
    // Columns of C per task: enough work to amortise a task, at least two tasks per thread.
    let per_task = (n / (2 * rayon::current_num_threads().max(1))).clamp(1, 64);
    let blocks: Vec<Vec<f32>> = (0..n.div_ceil(per_task))
        .into_par_iter()
        .map(|blk| {
            let (j0, j1) = (blk * per_task, (blk * per_task + per_task).min(n));
            // This task's columns of C, column-major: (j - j0) * m + r.
            let mut out = vec![0.0f32; (j1 - j0) * m];
            for (j, dst) in (j0..j1).zip(out.chunks_exact_mut(m)) {
                let col = &b.data[j * b.cs..j * b.cs + k];
                for (group, d) in rows.chunks(ROW_GROUP).zip(dst.chunks_mut(ROW_GROUP)) {
                    dot(group, col, d);
                }
            }
            out
        })
        .collect();
    let mut c = vec![0.0f32; m * n];
    for (blk, out) in blocks.iter().enumerate() {
        let j0 = blk * per_task;
        for (jj, col) in out.chunks_exact(m).enumerate() {
            for (r, v) in col.iter().enumerate() {
                c[r * n + j0 + jj] = *v;
            }
        }
    }
    c
}

/// `out[r] = sum_t rows[r][t] col[t]` for up to [`ROW_GROUP`] rows, see [`few_rows`]: the
/// vector kernels keep lane `l` of the accumulators in lane `l` of their registers and round
/// every product and sum as the portable code does, so all give the same bits.
fn dot_group_dispatch(isa: Isa, rows: &[&[f32]], col: &[f32], out: &mut [f32]) {
    macro_rules! by_rows {
        ($f:ident) => {
            match rows.len() {
                1 => $f::<1>(rows, col, out),
                2 => $f::<2>(rows, col, out),
                3 => $f::<3>(rows, col, out),
                _ => $f::<ROW_GROUP>(rows, col, out),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F is present (see `simd::detect`); the kernel stays in its slices.
        Isa::Avx512 => unsafe { by_rows!(dot_rows_avx512) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 is present (see `Isa::Avx2`); the kernel stays in its slices.
        Isa::Avx2 => unsafe { by_rows!(dot_rows_avx2) },
        _ => by_rows!(dot_rows),
    }
}

/// Depth per block of [`few_rows`]: each lane sums at most [`KC`] products of a block.
pub(crate) const BLOCK: usize = LANES * KC;

/// Adds the tail `t in full..len` of a block to the lanes, reduces them pairwise (16, 8, 4, 2,
/// 1) and returns the block's sum.
#[inline(always)]
pub(crate) fn finish_block(lanes: &mut [f32; LANES], x: &[f32], w: &[f32], full: usize) -> f32 {
    for (l, t) in (full..w.len()).enumerate() {
        lanes[l] += x[t] * w[t];
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
    }
    lanes[0]
}

fn dot_rows<const R: usize>(rows: &[&[f32]], col: &[f32], out: &mut [f32]) {
    let mut total = [0.0f32; R];
    for (bi, wb) in col.chunks(BLOCK).enumerate() {
        let t0 = bi * BLOCK;
        let xs: [&[f32]; R] = std::array::from_fn(|r| &rows[r][t0..t0 + wb.len()]);
        let mut acc = [[0.0f32; LANES]; R];
        let full = wb.len() / LANES * LANES;
        for t in (0..full).step_by(LANES) {
            for r in 0..R {
                for l in 0..LANES {
                    acc[r][l] += xs[r][t + l] * wb[t + l];
                }
            }
        }
        for r in 0..R {
            total[r] += finish_block(&mut acc[r], xs[r], wb, full);
        }
    }
    out[..R].copy_from_slice(&total);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512<const R: usize>(rows: &[&[f32]], col: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut total = [0.0f32; R];
    for (bi, wb) in col.chunks(BLOCK).enumerate() {
        let t0 = bi * BLOCK;
        let xs: [&[f32]; R] = std::array::from_fn(|r| &rows[r][t0..t0 + wb.len()]);
        let mut acc = [_mm512_setzero_ps(); R];
        let full = wb.len() / LANES * LANES;
        for t in (0..full).step_by(LANES) {
            // SAFETY: t + 16 <= full <= every slice's length.
            let w = unsafe { _mm512_loadu_ps(wb.as_ptr().add(t)) };
            for r in 0..R {
                let x = unsafe { _mm512_loadu_ps(xs[r].as_ptr().add(t)) };
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(x, w));
            }
        }
        for r in 0..R {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
            total[r] += finish_block(&mut lanes, xs[r], wb, full);
        }
    }
    out[..R].copy_from_slice(&total);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2<const R: usize>(rows: &[&[f32]], col: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut total = [0.0f32; R];
    for (bi, wb) in col.chunks(BLOCK).enumerate() {
        let t0 = bi * BLOCK;
        let xs: [&[f32]; R] = std::array::from_fn(|r| &rows[r][t0..t0 + wb.len()]);
        // Lanes 0-7 and 8-15.
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let full = wb.len() / LANES * LANES;
        for t in (0..full).step_by(LANES) {
            // SAFETY: t + 16 <= full <= every slice's length.
            let w = unsafe {
                [
                    _mm256_loadu_ps(wb.as_ptr().add(t)),
                    _mm256_loadu_ps(wb.as_ptr().add(t + 8)),
                ]
            };
            for r in 0..R {
                for h in 0..2 {
                    let x = unsafe { _mm256_loadu_ps(xs[r].as_ptr().add(t + 8 * h)) };
                    acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(x, w[h]));
                }
            }
        }
        for r in 0..R {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds 16 floats.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[r][1]);
            }
            total[r] += finish_block(&mut lanes, xs[r], wb, full);
        }
    }
    out[..R].copy_from_slice(&total);
}

/// A copy of `a` with contiguous rows, transposed in 16 x 16 tiles (rows of the copy are
/// far apart in memory: tiling keeps the writes from evicting each other).
pub(crate) fn to_row_major<E: Copy + Default + Send + Sync>(a: &Mat<E>) -> Vec<E> {
    const T: usize = 16;
    let (m, k) = (a.rows, a.cols);
    let mut out = vec![E::default(); m * k];
    out.par_chunks_mut(k * T)
        .enumerate()
        .for_each(|(rt, rows)| {
            let r0 = rt * T;
            let nr = rows.len() / k;
            let mut tile = [[E::default(); T]; T];
            for t0 in (0..k).step_by(T) {
                let nt = T.min(k - t0);
                for (tt, col) in tile.iter_mut().enumerate().take(nt) {
                    for (r, v) in col.iter_mut().enumerate().take(nr) {
                        *v = a.data[(r0 + r) * a.rs + (t0 + tt) * a.cs];
                    }
                }
                for r in 0..nr {
                    for tt in 0..nt {
                        rows[r * k + t0 + tt] = tile[tt][r];
                    }
                }
            }
        });
    out
}

/// Columns `j0..j0 + CHUNK` of B `(k, n)` into the zeroed `panel` (`k * CHUNK`): element
/// `(t, j0 + j)` at `t * CHUNK + j`; columns past `n` stay zero.
fn pack_panel(b: &Mat, j0: usize, panel: &mut [f32]) {
    let k = b.rows;
    let w = CHUNK.min(b.cols.saturating_sub(j0));
    if b.cs == 1 {
        for (t, row) in panel.chunks_exact_mut(CHUNK).enumerate() {
            let s = t * b.rs + j0;
            row[..w].copy_from_slice(&b.data[s..s + w]);
        }
    } else {
        // Columns are the contiguous direction (B = W^T): transpose in blocks of rows so that
        // reads and writes stay in L1.
        const TB: usize = 64;
        for t0 in (0..k).step_by(TB) {
            let tn = TB.min(k - t0);
            for jj in 0..w {
                let src = (j0 + jj) * b.cs + t0 * b.rs;
                for t in 0..tn {
                    panel[(t0 + t) * CHUNK + jj] = b.data[src + t * b.rs];
                }
            }
        }
    }
}
