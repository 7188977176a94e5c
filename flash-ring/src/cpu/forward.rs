//! Forward pass: online softmax over key tiles, one rayon task per (batch, q head, q tile).
//!
//! Scores are kept in log2 units: without a soft-cap q is packed times `scale * log2 e`, so
//! `Q K^T` is the logit in log2 units; with a soft-cap `c` q is packed times `scale / c` and each
//! row of `Q K^T` becomes `c log2 e * tanh(.)` before the mask (one branch per row of a strip,
//! the uncapped loop untouched).

use rayon::prelude::*;
use std::f32::consts::{LN_2, LOG2_E};
use std::sync::atomic::{AtomicU64, Ordering};

use super::gemm_bf16::{narrow_to_bf16, PairLayout, TileProduct};
use super::pool::PoolBuf;
use super::simd::{self, Isa, MatMul, CHUNK};
use super::{
    pack_depth_pairs, pack_pair_panels, pack_panels, pack_rows, panel_product, Dims, KernelConfig,
    PanelOperands, SharedOut, View,
};
use crate::error::Result;
use crate::reference::RefShape;
use crate::spec::{AttnSpec, BlockPos, MaskRule, TileClass};
use half::bf16;

/// Rows per strip when a tile is partially masked.
const STRIP: usize = 32;

/// Result of the forward kernel, always f32.
pub(crate) struct FwdOut {
    /// (batch, seq_q, q_heads, head_dim), contiguous.
    pub out: Vec<f32>,
    /// (batch, q_heads, seq_q), natural log; `-inf` for rows with no allowed key.
    pub lse: Vec<f32>,
    pub dims: Dims,
}

/// Keys and values of one (batch, kv head), packed for the forward kernel.
struct PackedKv {
    /// K^T in panels of 32 keys (see `pack_panels`); empty with bf16 dot products.
    kt: PoolBuf,
    /// K^T as stored (bf16) in pair-interleaved panels (`pack_pair_panels`), with bf16 dot
    /// products; empty otherwise.
    kt16: Vec<bf16>,
    /// V rows (seq_k x dp); empty with bf16 dot products.
    v: PoolBuf,
    /// V as stored (bf16) with the keys as depth (`pack_depth_pairs`), with bf16 dot
    /// products; empty otherwise.
    vpairs: Vec<bf16>,
}

pub(crate) fn forward(
    q: &View,
    k: &View,
    v: &View,
    spec: &AttnSpec,
    cfg: &KernelConfig,
) -> Result<FwdOut> {
    let isa = cfg.check()?;
    let dot_products = cfg.bf16_dot(isa, false)?;
    let dims = Dims::new(q, k, v)?;
    spec.validate(dims.sq, dims.sk)?;
    let RefShape {
        b,
        sq,
        sk,
        hq,
        hkv,
        d,
    } = dims.shape;
    let dp = dims.dp;
    let (bq, bk) = (cfg.q_tile, cfg.k_tile);
    let mut out = vec![0.0f32; b * sq * hq * d];
    let mut lse = vec![f32::NEG_INFINITY; b * hq * sq];
    if b * sq * hq == 0 {
        return Ok(FwdOut { out, lse, dims });
    }
    let qb = BlockPos::new(&spec.q_pos, spec.doc_ids.as_ref(), bq);
    let kb = BlockPos::new(&spec.k_pos, spec.doc_ids.as_ref(), bk);
    let rule = MaskRule::new(spec);
    // bf16 inputs on AVX512-BF16: S = Q K^T on the bf16 dot products (exact products, f32
    // sums), scaled afterwards; P is rounded to bf16 for P V (as FlashAttention-2 and PyTorch's
    // CPU kernel do; the row sums that normalise O are of the unrounded P), which runs on the
    // dot products too.
    let dot = q.bf16_dot(dot_products);
    let packed: Vec<PackedKv> = (0..b * hkv)
        .into_par_iter()
        .map(|i| {
            let (bi, h) = (i / hkv, i % hkv);
            PackedKv {
                kt: if dot {
                    PoolBuf::zeroed(0)
                } else {
                    pack_panels(k, bi, h, sk, dp)
                },
                kt16: if dot {
                    pack_pair_panels(k, bi, h, sk, dp)
                } else {
                    Vec::new()
                },
                v: if dot {
                    PoolBuf::zeroed(0)
                } else {
                    pack_rows(v, bi, h, sk, dp, 1.0)
                },
                vpairs: if dot {
                    pack_depth_pairs(v, bi, h, sk, dp)
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    let nqt = sq.div_ceil(bq);
    let (qmul, cap) = logit_units(spec);
    let out_w = SharedOut::new(&mut out);
    let lse_w = SharedOut::new(&mut lse);
    let work = AtomicU64::new(0);
    (0..b * hq * nqt).into_par_iter().for_each_init(
        || Scratch::new(bq, bk, dp),
        |sc, task| {
            let qt = task % nqt;
            let h = (task / nqt) % hq;
            let bi = task / (nqt * hq);
            let kv = &packed[bi * hkv + h / dims.group()];
            let q0 = qt * bq;
            let qn = bq.min(sq - q0);
            if dot {
                q.read_rows_bf16(bi, q0, h, qn, &mut sc.q16, dp);
            } else {
                q.read_rows(bi, q0, h, qn, &mut sc.q, dp, qmul);
            }
            let t = TileTask {
                dot,
                qmul,
                cap,
                isa,
                dims,
                rule: &rule,
                qb: &qb,
                kb: &kb,
                qt,
                qn,
                bk,
                work: &work,
            };
            t.run(kv, sc);
            // Finalise: out = o / l, lse = m + log(l) (natural log); NaN rows stay NaN.
            for i in 0..qn {
                let row = &mut sc.o[i * dp..i * dp + d];
                let l = sc.l[i];
                let lse_i = if l > 0.0 {
                    simd::scale_row(isa, row, 1.0 / l);
                    (sc.m[i] + l.log2()) * LN_2
                } else if l.is_nan() {
                    row.fill(f32::NAN);
                    f32::NAN
                } else {
                    row.fill(0.0);
                    f32::NEG_INFINITY
                };
                // SAFETY: task (bi, h, qt) is the only writer of rows q0..q0+qn of head h.
                unsafe {
                    out_w.write(((bi * sq + q0 + i) * hq + h) * d, row);
                    lse_w.write((bi * hq + h) * sq + q0 + i, &[lse_i]);
                }
            }
        },
    );
    crate::work::add(work.into_inner());
    Ok(FwdOut { out, lse, dims })
}

/// The factor q is packed with, and the soft-cap's factor after `tanh`: `(scale log2 e, None)`
/// without a cap, `(scale / c, Some(c log2 e))` with cap `c`, so that the kernels' scores are
/// `q.k * qmul` (log2 units) or `c log2 e * tanh(q.k * qmul)`. Shared with the backward.
pub(crate) fn logit_units(spec: &AttnSpec) -> (f32, Option<f32>) {
    match spec.softcap {
        None => (spec.scale * LOG2_E, None),
        Some(c) => (spec.scale / c, Some(c * LOG2_E)),
    }
}

/// Per-thread buffers of the forward kernel (O(tile) memory).
struct Scratch {
    q: Vec<f32>,
    /// The q tile as stored (bf16, rows of dp, zero padded), with bf16 dot products.
    q16: Vec<bf16>,
    o: Vec<f32>,
    s: Vec<f32>,
    /// A strip's P rounded to bf16 (rows of bk), with bf16 dot products.
    p16: Vec<bf16>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn new(bq: usize, bk: usize, dp: usize) -> Self {
        Scratch {
            q: vec![0.0; bq * dp],
            q16: vec![bf16::ZERO; bq * dp],
            o: vec![0.0; bq * dp],
            s: vec![0.0; bq * bk],
            p16: vec![bf16::ZERO; bq * bk],
            m: vec![0.0; bq],
            l: vec![0.0; bq],
        }
    }
}

struct TileTask<'a> {
    /// S = Q K^T on the bf16 dot products (`sc.q16`, `kv.kt16`), times `qmul` afterwards.
    dot: bool,
    /// The factor of q (see `logit_units`).
    qmul: f32,
    /// Soft-cap: scores become `cap * tanh(q.k * qmul)` (see `logit_units`).
    cap: Option<f32>,
    isa: Isa,
    dims: Dims,
    rule: &'a MaskRule,
    qb: &'a BlockPos,
    kb: &'a BlockPos,
    qt: usize,
    qn: usize,
    bk: usize,
    /// Scores computed, summed over the tasks (see [`crate::work`]).
    work: &'a AtomicU64,
}

impl TileTask<'_> {
    /// Accumulates the un-normalised output of q tile `qt` over all key tiles into `sc.o`,
    /// with running row max `sc.m` (log2 units) and row sum `sc.l`.
    fn run(&self, kv: &PackedKv, sc: &mut Scratch) {
        let (dp, bk, qn) = (self.dims.dp, self.bk, self.qn);
        let q0 = self.qt * self.qb.tile;
        sc.o[..qn * dp].fill(0.0);
        sc.m[..qn].fill(f32::NEG_INFINITY);
        sc.l[..qn].fill(0.0);
        let nkt = self.dims.sk.div_ceil(bk);
        let mut scores = 0u64;
        for kt in 0..nkt {
            let class = self
                .rule
                .classify(&self.qb.tiles[self.qt], &self.kb.tiles[kt]);
            if class == TileClass::Skip {
                continue;
            }
            let k0 = kt * bk;
            let kn = bk.min(self.dims.sk - k0);
            // Partial tiles run in strips of rows, each over the columns its rows can see
            // (cuts the masked half of causal diagonal tiles).
            let strip = if class == TileClass::Partial {
                STRIP
            } else {
                qn
            };
            for r0 in (0..qn).step_by(strip) {
                let rn = strip.min(qn - r0);
                let (lo, hi) = if class == TileClass::Partial {
                    self.rule
                        .col_window(self.qb, q0 + r0..q0 + r0 + rn, self.kb, kt, kn)
                } else {
                    (0, kn)
                };
                if lo >= hi {
                    continue; // no row of the strip sees this tile
                }
                let c0 = lo / CHUNK * CHUNK;
                scores += (rn * (hi - c0)) as u64;
                self.strip(kv, sc, class, kt, k0, kn, r0, rn, c0, hi);
            }
        }
        self.work.fetch_add(scores, Ordering::Relaxed);
    }

    /// One strip of rows `r0..r0 + rn` of the q tile against columns `c0..c1` of key tile `kt`
    /// (`c0` a multiple of 32, `c1 <= kn`): online-softmax update of `sc.o`, `sc.m`, `sc.l`.
    #[allow(clippy::too_many_arguments)]
    fn strip(
        &self,
        kv: &PackedKv,
        sc: &mut Scratch,
        class: TileClass,
        kt: usize,
        k0: usize,
        kn: usize,
        r0: usize,
        rn: usize,
        c0: usize,
        c1: usize,
    ) {
        let (isa, dp, bk) = (self.isa, self.dims.dp, self.bk);
        let q0 = self.qt * self.qb.tile;
        // S = (Q * qmul) K^T over whole 32-key panels.
        let cols = (c1 - c0).div_ceil(CHUNK) * CHUNK;
        let ops = if self.dot {
            PanelOperands::Bf16(&sc.q16[r0 * dp..], &kv.kt16[(k0 + c0) * dp..])
        } else {
            PanelOperands::F32(&sc.q[r0 * dp..], &kv.kt[(k0 + c0) * dp..])
        };
        panel_product(isa, ops, rn, cols, dp, &mut sc.s[r0 * bk + c0..], bk);
        for i in r0..r0 + rn {
            let full = &mut sc.s[i * bk..i * bk + kn];
            match (self.cap, self.dot) {
                (None, false) => {}
                (None, true) => simd::scale_row(isa, &mut full[c0..c1], self.qmul),
                // The cap before the mask (masked scores become -inf below).
                (Some(post), dot) => {
                    let pre = if dot { self.qmul } else { 1.0 };
                    simd::softcap_row(isa, &mut full[c0..c1], pre, post, None);
                }
            }
            if class == TileClass::Partial {
                self.rule
                    .mask_row(self.qb, q0 + i, self.kb, kt, full, f32::NEG_INFINITY);
            }
            let row = &mut full[c0..c1];
            let m_row = simd::row_max::<true>(isa, row);
            if m_row.is_nan() || m_row == f32::INFINITY {
                // A NaN or +inf score (a NaN or an overflow in q or in an allowed key): the row's
                // softmax is NaN, as PyTorch's (`e^(inf - inf)`); the vector exponential would
                // give 0 for it and the row would look empty. `l` stays NaN over the later tiles
                // and makes the row's output and lse NaN; this tile adds nothing to `o`.
                sc.l[i] = f32::NAN;
                row.fill(0.0);
                continue;
            }
            let m_old = sc.m[i];
            let m_new = m_old.max(m_row);
            if m_new == f32::NEG_INFINITY {
                // Nothing allowed so far: P = 0, the output row stays 0.
                row.fill(0.0);
                continue;
            }
            let alpha = if m_new == m_old {
                1.0
            } else {
                (m_old - m_new).exp2()
            };
            let sum = simd::exp2_shift_sum(isa, row, m_new);
            sc.l[i] = sc.l[i] * alpha + sum;
            sc.m[i] = m_new;
            if alpha != 1.0 {
                simd::scale_row(isa, &mut sc.o[i * dp..(i + 1) * dp], alpha);
            }
        }
        // O += P V.
        let cn = c1 - c0;
        if self.dot {
            // P rounded to bf16, rows padded to an even length by a zero.
            let w = cn.next_multiple_of(2);
            for i in 0..rn {
                let src = &sc.s[(r0 + i) * bk + c0..(r0 + i) * bk + c1];
                let dst = &mut sc.p16[i * bk..i * bk + w];
                narrow_to_bf16(src, &mut dst[..cn]);
                dst[cn..].fill(bf16::ZERO);
            }
            TileProduct {
                rows: rn,
                cols: dp,
                pairs: w / 2,
                a: PairLayout::rows(bk),
                b_cs: self.dims.sk.next_multiple_of(2) * CHUNK,
                c_rs: dp,
            }
            .run(
                &sc.p16,
                &kv.vpairs[(k0 + c0) * CHUNK..],
                &mut sc.o[r0 * dp..],
                true,
            );
            return;
        }
        MatMul {
            m: rn,
            n: dp,
            k: c1 - c0,
            a_rs: bk,
            a_ks: 1,
            b_rs: dp,
            b_cs: CHUNK,
            c_rs: dp,
            accumulate: true,
        }
        .run(
            isa,
            &sc.s[r0 * bk + c0..],
            &kv.v[(k0 + c0) * dp..],
            &mut sc.o[r0 * dp..],
        );
    }
}
