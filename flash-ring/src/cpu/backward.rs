//! Backward pass (FlashAttention-2): P is recomputed from the final lse, `D = rowsum(dO * O)`,
//! `dS = P * (dP - D)`. One rayon task per (batch, q head, chunk of key tiles).
//!
//! With a logit soft-cap `c` the scores are recomputed as the forward computes them (see
//! `forward::logit_units`) and dS gets the cap's derivative: `dS = P (dP - D) (1 - tanh^2(s/c))`
//! is the gradient with respect to the uncapped logit `s = scale q.k`.
//!
//! Deterministic whatever the thread timing (a rank's gradients must not depend on which task
//! finishes first, or multi-rank runs drift apart): every floating-point sum has a fixed order.
//! - dK/dV: each task owns the rows of its key tiles in a per-q-head accumulator (no other task
//!   writes them); for GQA the q heads of a kv head are summed at the end in head order.
//! - dQ: with one chunk per head the task owns the head's dQ. With several, each task's partial
//!   dQ is added to the head's in chunk order: a task that finishes before its predecessors
//!   parks its buffer, and whichever task completes the prefix adds the parked ones in order.

use rayon::prelude::*;
use std::f32::consts::LN_2;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::bf16_pairs::{narrow_pairs, pair_panels_len, RowsAndErrors};
use super::forward::logit_units;
use super::gemm_bf16::{PairLayout, TileProduct};
use super::pool::PoolBuf;
use super::simd::{self, MatMul, CHUNK};
use super::{
    pack_depth_pairs, pack_pair_panels, pack_panels, pack_rows, pack_rows_bf16,
    pack_transposed_bf16, panel_product, row_dots_bf16, row_mean, Dims, KernelConfig,
    PanelOperands, View,
};
use crate::error::{Error, Result};
use crate::reference::RefShape;
use crate::spec::{AttnSpec, BlockPos, MaskRule, TileClass};
use half::bf16;

/// Rows per strip when a tile is partially masked.
const STRIP: usize = 32;

/// Gradients in f32, contiguous: dq (b, sq, hq, d), dk and dv (b, sk, hkv, d).
pub(crate) struct BwdOut {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dims: Dims,
}

/// Query-side operands of one (batch, q head).
struct PackedQ {
    /// Q * qmul (see `forward::logit_units`), rows of length dp; empty with P and dS rounded.
    q: PoolBuf,
    /// dO, rows of length dp; empty with P and dS rounded.
    dout: PoolBuf,
    /// Q and dO as stored (bf16, rows of dp), with bf16 dot products; empty otherwise.
    q16: Vec<bf16>,
    dout16: Vec<bf16>,
    /// With P and dS rounded: Q and dO as stored, transposed (`pack_transposed_bf16`), and
    /// Q's mean row (for the rounding's compensation, `bf16_pairs`); empty otherwise.
    qt16: Vec<bf16>,
    doutt16: Vec<bf16>,
    q_mean: Vec<f32>,
    /// The rows' natural-log lse (see `simd::p_ds_row` for why not in log2 units).
    lse: Vec<f32>,
    /// D = rowsum(dO * O) per row.
    dd: Vec<f32>,
}

/// Key-side operands of one (batch, kv head): K^T and V^T in f32 panels, or as stored (bf16)
/// in pair-interleaved panels with bf16 dot products (the others empty); K rows in f32, or,
/// with P and dS rounded, K as stored with the keys as depth (`pack_depth_pairs`) and K's
/// mean row.
struct PackedKv {
    kt: PoolBuf,
    k: PoolBuf,
    vt: PoolBuf,
    kt16: Vec<bf16>,
    vt16: Vec<bf16>,
    kpairs: Vec<bf16>,
    k_mean: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &View,
    k: &View,
    v: &View,
    out: &View,
    lse: &[f32],
    dout: &View,
    spec: &AttnSpec,
    cfg: &KernelConfig,
) -> Result<BwdOut> {
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
    for (name, x) in [("out", out), ("dout", dout)] {
        if x.dims != q.dims {
            return Err(Error::Shape {
                tensor: name,
                got: x.dims.to_vec(),
                expected: format!("{:?} (the shape of q)", q.dims),
            });
        }
    }
    if lse.len() != b * hq * sq {
        return Err(Error::Shape {
            tensor: "lse",
            got: vec![lse.len()],
            expected: format!("({b}, {hq}, {sq}) elements"),
        });
    }
    let (bq, bk) = (cfg.q_tile, cfg.k_tile);
    let mut dq = vec![0.0f32; b * sq * hq * d];
    let mut dk = vec![0.0f32; b * sk * hkv * d];
    let mut dv = vec![0.0f32; b * sk * hkv * d];
    if b * hq * sq == 0 || sk == 0 {
        return Ok(BwdOut { dq, dk, dv, dims });
    }
    let qb = BlockPos::new(&spec.q_pos, spec.doc_ids.as_ref(), bq);
    let kb = BlockPos::new(&spec.k_pos, spec.doc_ids.as_ref(), bk);
    let rule = MaskRule::new(spec);
    let (qmul, cap) = logit_units(spec);
    // dK = dS^T (Q * qmul) times this: `scale / qmul`, i.e. ln 2, or `c` with a cap.
    let dk_mul = spec.softcap.unwrap_or(LN_2);
    // bf16 inputs on AVX512-BF16: S = Q K^T and dP = dO V^T, the two products of stored
    // inputs, on the bf16 dot products (exact products, f32 sums; S scaled afterwards). S is
    // computed as the forward computed it (the same choice, on q), dP where dO is bf16 too; D
    // then in dP's chain.
    let dot_s = q.bf16_dot(dot_products);
    let dot_dp = dot_s && dout.bf16_dot(dot_products);
    let dot_d = dot_dp && out.bf16_dot(dot_products);
    // Then P and dS are rounded to bf16 for the three products with them, as FlashAttention-2
    // and PyTorch's CPU kernel do, and those run on the dot products too (exact products, f32
    // sums), with the rounding's common part added back (`bf16_pairs`). The depth pairs of
    // `dV^T += dO^T P` and `dK^T += Q^T dS` are pairs of query rows, so a q tile of odd length
    // keeps the f32 products.
    let round = dot_dp && bq % 2 == 0;

    let pq: Vec<PackedQ> = (0..b * hq)
        .into_par_iter()
        .map(|i| {
            let (bi, h) = (i / hq, i % hq);
            let qp = if round {
                PoolBuf::zeroed(0)
            } else {
                pack_rows(q, bi, h, sq, dp, qmul)
            };
            let dop = if round && dot_d {
                PoolBuf::zeroed(0)
            } else {
                pack_rows(dout, bi, h, sq, dp, 1.0)
            };
            // D in the order of dP's matmul (see `simd::row_dots`); fully masked rows (P = 0)
            // do not use it.
            let q16 = if dot_s {
                pack_rows_bf16(q, bi, h, sq, dp)
            } else {
                Vec::new()
            };
            let dout16 = if dot_dp {
                pack_rows_bf16(dout, bi, h, sq, dp)
            } else {
                Vec::new()
            };
            let dd = if dot_d {
                row_dots_bf16(&dout16, out, bi, h, sq, dp)
            } else {
                let op = pack_rows(out, bi, h, sq, dp, 1.0);
                let mut dd = vec![0.0f32; sq];
                simd::row_dots(isa, &op, dp, &dop, dp, d, &mut dd);
                dd
            };
            let (qt16, doutt16, q_mean) = if round {
                (
                    pack_transposed_bf16(q, bi, h, sq, dp),
                    pack_transposed_bf16(dout, bi, h, sq, dp),
                    row_mean(q, bi, h, sq, dp),
                )
            } else {
                (Vec::new(), Vec::new(), Vec::new())
            };
            PackedQ {
                q: qp,
                // dO's f32 rows served D's sum above where O is not bf16.
                dout: if round { PoolBuf::zeroed(0) } else { dop },
                q16,
                dout16,
                qt16,
                doutt16,
                q_mean,
                lse: lse[i * sq..(i + 1) * sq].to_vec(),
                dd,
            }
        })
        .collect();
    let pk: Vec<PackedKv> = (0..b * hkv)
        .into_par_iter()
        .map(|i| {
            let (bi, h) = (i / hkv, i % hkv);
            let panels = |x: &View, dot: bool| {
                if dot {
                    (PoolBuf::zeroed(0), pack_pair_panels(x, bi, h, sk, dp))
                } else {
                    (pack_panels(x, bi, h, sk, dp), Vec::new())
                }
            };
            let ((kt, kt16), (vt, vt16)) = (panels(k, dot_s), panels(v, dot_dp));
            let (kf, kpairs, k_mean) = if round {
                (
                    PoolBuf::zeroed(0),
                    pack_depth_pairs(k, bi, h, sk, dp),
                    row_mean(k, bi, h, sk, dp),
                )
            } else {
                (pack_rows(k, bi, h, sk, dp, 1.0), Vec::new(), Vec::new())
            };
            PackedKv {
                kt,
                k: kf,
                vt,
                kt16,
                vt16,
                kpairs,
                k_mean,
            }
        })
        .collect();

    let nqt = sq.div_ceil(bq);
    let nkt = sk.div_ceil(bk);
    // Enough tasks for work stealing to even out load (causal chunks differ in work).
    let want = 8 * rayon::current_num_threads();
    let chunks = want.div_ceil(b * hq).clamp(1, nkt);
    let per_chunk = nkt.div_ceil(chunks);
    let chunks = nkt.div_ceil(per_chunk);
    // Key rows of chunk `ch`.
    let chunk_rows = |ch: usize| (ch * per_chunk * bk)..(((ch + 1) * per_chunk * bk).min(sk));

    // Gradient accumulators, rows of length dp: dq per (b, q head); dk/dv per (b, q head, key
    // chunk), each owned by one task (the q heads of a kv head are summed at the end).
    let dq_acc: Vec<Mutex<OrderedSum>> = (0..b * hq)
        .into_par_iter()
        .map(|_| Mutex::new(OrderedSum::new(sq * dp)))
        .collect();
    let dkv_acc: Vec<Mutex<(PoolBuf, PoolBuf)>> = (0..b * hq * chunks)
        .into_par_iter()
        .map(|t| {
            let n = chunk_rows(t % chunks).len() * dp;
            Mutex::new((PoolBuf::zeroed(n), PoolBuf::zeroed(n)))
        })
        .collect();

    let work = AtomicU64::new(0);
    (0..b * hq * chunks).into_par_iter().try_for_each(|task| {
        let mut scores = 0u64;
        let ch = task % chunks;
        let head = task / chunks;
        let (bi, h) = (head / hq, head % hq);
        let kvh = bi * hkv + h / dims.group();
        let qs = &pq[head];
        let ks = &pk[kvh];
        let mut s = vec![0.0f32; bq * bk];
        let mut g = vec![0.0f32; bq * bk];
        // The key tile's dK and dV: (bk, dp) in f32; transposed, (dp, bk), with P and dS rounded.
        let mut dk_t = vec![0.0f32; bk * dp];
        let mut dv_t = vec![0.0f32; bk * dp];
        // With P and dS rounded: a strip's P and dS in pair panels (query pairs as depth), dS
        // row-major, and the sums of dS's rounding errors by row and by column.
        let mut rounded = round.then(|| StripBuffers {
            p: vec![bf16::ZERO; pair_panels_len(bq, bk)],
            ds: vec![bf16::ZERO; pair_panels_len(bq, bk)],
            ds_rows: vec![bf16::ZERO; bq * bk],
            row_err: vec![0.0f32; bq],
            col_err: vec![0.0f32; bk],
        });
        // d(capped)/ds of the row being processed (soft-cap only).
        let mut dcap = if cap.is_some() {
            vec![0.0f32; bk]
        } else {
            Vec::new()
        };
        // dq target: with one chunk per head this task owns the head's dq (lock held for the
        // whole task, uncontended); otherwise a private buffer added in chunk order at the end.
        let mut own = None;
        if chunks == 1 {
            own = Some(
                dq_acc[head]
                    .lock()
                    .map_err(|_| Error::Config("poisoned dq lock".into()))?,
            );
        }
        let mut local: Option<PoolBuf> = None;
        // This task's dk/dv rows of this q head: no other task writes them.
        let row0 = chunk_rows(ch).start;
        let mut dkv = dkv_acc[task]
            .lock()
            .map_err(|_| Error::Config("poisoned dk/dv lock".into()))?;
        for kt in ch * per_chunk..((ch + 1) * per_chunk).min(nkt) {
            let k0 = kt * bk;
            let kn = bk.min(sk - k0);
            let mut touched = false;
            if round {
                dk_t.fill(0.0);
                dv_t.fill(0.0);
            } else {
                dk_t[..kn * dp].fill(0.0);
                dv_t[..kn * dp].fill(0.0);
            }
            for qt in 0..nqt {
                let class = rule.classify(&qb.tiles[qt], &kb.tiles[kt]);
                if class == TileClass::Skip {
                    continue;
                }
                if own.is_none() && local.is_none() {
                    local = Some(PoolBuf::zeroed(sq * dp));
                }
                touched = true;
                let q0 = qt * bq;
                let qn = bq.min(sq - q0);
                // Partial tiles run in strips of rows over the columns those rows can see.
                let strip = if class == TileClass::Partial {
                    STRIP
                } else {
                    qn
                };
                for r0 in (0..qn).step_by(strip) {
                    let rn = strip.min(qn - r0);
                    let (lo, c1) = if class == TileClass::Partial {
                        rule.col_window(&qb, q0 + r0..q0 + r0 + rn, &kb, kt, kn)
                    } else {
                        (0, kn)
                    };
                    if lo >= c1 {
                        continue;
                    }
                    let c0 = lo / CHUNK * CHUNK;
                    let cn = c1 - c0;
                    scores += (rn * cn) as u64;
                    // Empty where not packed (bf16 dot products, P and dS rounded).
                    let qrows = qs.q.get((q0 + r0) * dp..).unwrap_or_default();
                    let dorows = qs.dout.get((q0 + r0) * dp..).unwrap_or_default();
                    let sb = &mut s[r0 * bk + c0..];
                    let gb = &mut g[r0 * bk + c0..];
                    // S = Qs K^T and dP = dO V^T over whole 32-key panels.
                    let cols = cn.div_ceil(CHUNK) * CHUNK;
                    let kp = (k0 + c0) * dp;
                    let at = (q0 + r0) * dp;
                    let s_ops = if dot_s {
                        PanelOperands::Bf16(&qs.q16[at..], &ks.kt16[kp..])
                    } else {
                        PanelOperands::F32(qrows, &ks.kt[kp..])
                    };
                    let dp_ops = if dot_dp {
                        PanelOperands::Bf16(&qs.dout16[at..], &ks.vt16[kp..])
                    } else {
                        PanelOperands::F32(dorows, &ks.vt[kp..])
                    };
                    panel_product(isa, s_ops, rn, cols, dp, sb, bk);
                    panel_product(isa, dp_ops, rn, cols, dp, gb, bk);
                    // P = e^(S ln 2 - lse) (masked entries and dead rows: 0), dS = P (dP - D).
                    for i in r0..r0 + rn {
                        let row = &mut s[i * bk..i * bk + kn];
                        let grow = &mut g[i * bk + c0..i * bk + c1];
                        let l = qs.lse[q0 + i];
                        if l.is_nan() {
                            // The forward saw a NaN score in this row: its P and dS are NaN
                            // (as PyTorch's softmax gradient), so every gradient it reaches is.
                            row[c0..c1].fill(f32::NAN);
                            grow.fill(f32::NAN);
                            continue;
                        }
                        if !l.is_finite() {
                            // Row with no allowed key anywhere (lse = -inf): P = dS = 0.
                            row[c0..c1].fill(0.0);
                            grow.fill(0.0);
                            continue;
                        }
                        match (cap, dot_s) {
                            (None, false) => {}
                            (None, true) => simd::scale_row(isa, &mut row[c0..c1], qmul),
                            // The cap before the mask, as in the forward.
                            (Some(post), dot) => {
                                let pre = if dot { qmul } else { 1.0 };
                                let dc = Some(&mut dcap[c0..c1]);
                                simd::softcap_row(isa, &mut row[c0..c1], pre, post, dc);
                            }
                        }
                        if class == TileClass::Partial {
                            rule.mask_row(&qb, q0 + i, &kb, kt, row, f32::NEG_INFINITY);
                        }
                        simd::p_ds_row(isa, &mut row[c0..c1], grow, l, qs.dd[q0 + i]);
                        if cap.is_some() {
                            simd::mul_row(isa, grow, &dcap[c0..c1]);
                        }
                    }
                    let dq_target: &mut [f32] = match (own.as_mut(), local.as_mut()) {
                        (Some(g), _) => &mut g.acc[..],
                        (None, Some(l)) => &mut l[..],
                        (None, None) => unreachable!("dq buffer allocated above"),
                    };
                    if let Some(sb16) = rounded.as_mut() {
                        let at = RoundedStrip {
                            q_row: q0 + r0,
                            rows: rn,
                            key: k0 + c0,
                            c0,
                            cols: cn,
                            dp,
                            bk,
                            sq,
                            sk,
                        };
                        sb16.products(
                            &at,
                            &s[r0 * bk + c0..],
                            &g[r0 * bk + c0..],
                            qs,
                            ks,
                            &mut dv_t,
                            &mut dk_t,
                            &mut dq_target[(q0 + r0) * dp..],
                        );
                        continue;
                    }
                    let sb = &s[r0 * bk + c0..];
                    let gb = &g[r0 * bk + c0..];
                    // dV += P^T dO ; dK += dS^T Qs (rescaled by `dk_mul` at the end).
                    let tn = MatMul {
                        m: cn,
                        n: dp,
                        k: rn,
                        a_rs: 1,
                        a_ks: bk,
                        b_rs: dp,
                        b_cs: CHUNK,
                        c_rs: dp,
                        accumulate: true,
                    };
                    tn.run(isa, sb, dorows, &mut dv_t[c0 * dp..]);
                    tn.run(isa, gb, qrows, &mut dk_t[c0 * dp..]);
                    // dQ += dS K (rescaled by scale at the end).
                    MatMul {
                        m: rn,
                        n: dp,
                        k: cn,
                        a_rs: bk,
                        a_ks: 1,
                        b_rs: dp,
                        b_cs: CHUNK,
                        c_rs: dp,
                        accumulate: true,
                    }
                    .run(
                        isa,
                        gb,
                        &ks.k[(k0 + c0) * dp..],
                        &mut dq_target[(q0 + r0) * dp..],
                    );
                }
            }
            if touched && round {
                // dK^T and dV^T (dp, bk) of the tile into the rows of dK and dV; dK's products
                // were of the stored Q, so it gets `qmul` too.
                let (dka, dva) = &mut *dkv;
                let mul = dk_mul * qmul;
                let base = (k0 - row0) * dp;
                for c in 0..kn {
                    let (ka, va) = (
                        &mut dka[base + c * dp..base + (c + 1) * dp],
                        &mut dva[base + c * dp..base + (c + 1) * dp],
                    );
                    for j in 0..dp {
                        ka[j] += dk_t[j * bk + c] * mul;
                        va[j] += dv_t[j * bk + c];
                    }
                }
            } else if touched {
                let (dka, dva) = &mut *dkv;
                let r = (k0 - row0) * dp..(k0 - row0 + kn) * dp;
                for (a, x) in dka[r.clone()].iter_mut().zip(&dk_t[..kn * dp]) {
                    *a += x * dk_mul;
                }
                for (a, x) in dva[r].iter_mut().zip(&dv_t[..kn * dp]) {
                    *a += x;
                }
            }
        }
        drop(dkv);
        if own.is_none() {
            dq_acc[head]
                .lock()
                .map_err(|_| Error::Config("poisoned dq lock".into()))?
                .add(ch, local);
        }
        work.fetch_add(scores, Ordering::Relaxed);
        Ok::<(), Error>(())
    })?;
    crate::work::add(work.into_inner());

    // Scatter the per-head buffers into the (b, s, h, d) outputs.
    let dq_heads: Vec<PoolBuf> = dq_acc
        .into_iter()
        .map(|m| {
            m.into_inner()
                .map_err(|_| Error::Config("poisoned dq lock".into()))
                .and_then(|s| s.finish(chunks))
        })
        .collect::<Result<_>>()?;
    dq.par_chunks_mut(hq * d).enumerate().for_each(|(row, o)| {
        let (bi, s) = (row / sq, row % sq);
        for h in 0..hq {
            let src = &dq_heads[bi * hq + h][s * dp..s * dp + d];
            for (x, y) in o[h * d..(h + 1) * d].iter_mut().zip(src) {
                *x = y * spec.scale;
            }
        }
    });
    let parts: Vec<(PoolBuf, PoolBuf)> = dkv_acc
        .into_iter()
        .map(|m| {
            m.into_inner()
                .map_err(|_| Error::Config("poisoned dk/dv lock".into()))
        })
        .collect::<Result<_>>()?;
    // Each (b, key row, kv head): the sum over the kv head's q heads, in head order.
    let group = dims.group();
    dk.par_chunks_mut(hkv * d)
        .zip(dv.par_chunks_mut(hkv * d))
        .enumerate()
        .for_each(|(row, (ok, ov))| {
            let (bi, s) = (row / sk, row % sk);
            let ch = s / bk / per_chunk;
            let at = (s - chunk_rows(ch).start) * dp;
            for h in 0..hkv {
                let (ok, ov) = (&mut ok[h * d..(h + 1) * d], &mut ov[h * d..(h + 1) * d]);
                for g in 0..group {
                    let (pk, pv) = &parts[(bi * hq + h * group + g) * chunks + ch];
                    let (pk, pv) = (&pk[at..at + d], &pv[at..at + d]);
                    if g == 0 {
                        ok.copy_from_slice(pk);
                        ov.copy_from_slice(pv);
                    } else {
                        ok.iter_mut().zip(pk).for_each(|(a, x)| *a += x);
                        ov.iter_mut().zip(pv).for_each(|(a, x)| *a += x);
                    }
                }
            }
        });
    Ok(BwdOut { dq, dk, dv, dims })
}

/// A head's dQ, summed from the partial buffers of its key chunks in chunk order whatever the
/// order in which the chunks finish (see the module docs).
struct OrderedSum {
    acc: PoolBuf,
    /// The next chunk to add.
    next: usize,
    /// Finished chunks waiting for their predecessors (`None`: the chunk touched nothing).
    parked: Vec<(usize, Option<PoolBuf>)>,
}

impl OrderedSum {
    fn new(len: usize) -> Self {
        Self {
            acc: PoolBuf::zeroed(len),
            next: 0,
            parked: Vec::new(),
        }
    }

    /// Chunk `ch` finished with partial sum `part`; adds every chunk now in order.
    fn add(&mut self, ch: usize, part: Option<PoolBuf>) {
        self.parked.push((ch, part));
        while let Some(i) = self.parked.iter().position(|(c, _)| *c == self.next) {
            if let (_, Some(p)) = self.parked.swap_remove(i) {
                self.acc.iter_mut().zip(p.iter()).for_each(|(a, x)| *a += x);
            }
            self.next += 1;
        }
    }

    /// The sum, once all `chunks` were added (with one chunk the owner wrote `acc` directly).
    fn finish(self, chunks: usize) -> Result<PoolBuf> {
        if chunks > 1 && (self.next != chunks || !self.parked.is_empty()) {
            return Err(Error::Config(format!(
                "internal: dq summed {} of {chunks} key chunks",
                self.next
            )));
        }
        Ok(self.acc)
    }
}

/// Where one strip of rows of a tile lies, for [`StripBuffers::products`].
struct RoundedStrip {
    /// First query row of the strip (even) and its rows.
    q_row: usize,
    rows: usize,
    /// First key of the strip's columns (even), their offset in the tile and their count.
    key: usize,
    c0: usize,
    cols: usize,
    dp: usize,
    /// Key tile length (the row length of `s`, `g` and the transposed dK/dV tiles).
    bk: usize,
    sq: usize,
    sk: usize,
}

/// Scratch of one task for the products with P and dS rounded to bf16.
struct StripBuffers {
    p: Vec<bf16>,
    ds: Vec<bf16>,
    ds_rows: Vec<bf16>,
    row_err: Vec<f32>,
    col_err: Vec<f32>,
}

impl StripBuffers {
    /// `dV^T += dO^T P`, `dK^T += Q^T dS + (Q's mean) (column sums of dS's rounding error)`
    /// (unscaled Q: the caller multiplies by `qmul` with `dk_mul`), `dQ += dS K + (row sums of
    /// the error) (K's mean)`, with P and dS rounded to bf16 and every product on the bf16 dot
    /// products (exact products; each element's f32 sum is one chain over the strip's rows or
    /// columns, as the f32 products' are). `p` and `ds` start
    /// at the strip's first row and column (rows `bk` apart); `dvt` and `dkt` are the tile's
    /// transposed accumulators (dp, bk); `dq` starts at the strip's first row (rows `dp` apart).
    #[allow(clippy::too_many_arguments)]
    fn products(
        &mut self,
        at: &RoundedStrip,
        p: &[f32],
        ds: &[f32],
        qs: &PackedQ,
        ks: &PackedKv,
        dvt: &mut [f32],
        dkt: &mut [f32],
        dq: &mut [f32],
    ) {
        let &RoundedStrip {
            q_row,
            rows,
            key,
            c0,
            cols,
            dp,
            bk,
            sq,
            sk,
        } = at;
        let width = cols.div_ceil(CHUNK) * CHUNK;
        narrow_pairs(p, bk, rows, cols, &mut self.p, None);
        self.row_err[..rows].fill(0.0);
        self.col_err[..width].fill(0.0);
        narrow_pairs(
            ds,
            bk,
            rows,
            cols,
            &mut self.ds,
            Some(RowsAndErrors {
                rows: &mut self.ds_rows,
                rs: bk,
                row_err: &mut self.row_err,
                col_err: &mut self.col_err,
            }),
        );
        let (sqe, ske) = (sq.next_multiple_of(2), sk.next_multiple_of(2));
        let by_query = TileProduct {
            rows: dp,
            cols: width,
            pairs: rows.div_ceil(2),
            a: PairLayout::rows(sqe),
            b_cs: rows.next_multiple_of(2) * CHUNK,
            c_rs: bk,
        };
        by_query.run(&qs.doutt16[q_row..], &self.p, &mut dvt[c0..], true);
        by_query.run(&qs.qt16[q_row..], &self.ds, &mut dkt[c0..], true);
        for (j, &m) in qs.q_mean.iter().enumerate() {
            let row = &mut dkt[j * bk + c0..j * bk + c0 + cols];
            row.iter_mut()
                .zip(&self.col_err[..cols])
                .for_each(|(x, e)| *x += m * e);
        }
        TileProduct {
            rows,
            cols: dp,
            pairs: cols.div_ceil(2),
            a: PairLayout::rows(bk),
            b_cs: ske * CHUNK,
            c_rs: dp,
        }
        .run(&self.ds_rows, &ks.kpairs[key * CHUNK..], dq, true);
        for (row, &e) in dq.chunks_mut(dp).zip(&self.row_err[..rows]) {
            row.iter_mut()
                .zip(&ks.k_mean)
                .for_each(|(x, m)| *x += e * m);
        }
    }
}
