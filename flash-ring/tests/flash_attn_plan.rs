//! Planning flash-attn (FlashAttention-2) kernel calls for a spec: every planned call is run with
//! the CPU kernel under flash-attn's own mask semantics (bottom-right aligned causal / local
//! window on the call's rows), its LSE put into flash-attn's convention (`+inf` for fully masked
//! rows), and the partials merged by LSE; the result must equal `flash_fwd` on the whole spec
//! (f32, relative 1e-5, `-inf` rows exactly). Mask-level checks: every allowed (query, key) pair
//! is covered by exactly one call, no disallowed pair by any, the window sizes survive
//! candle-flash-attn's and flash-attn's clamping, and call counts stay small.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::{rel, rng, to_f64, Case};
use flash_ring::flash_attn_plan::{
    lse_from_flash_attn, lse_to_flash_attn, plan_flash_attn, plan_flash_attn_with_options,
    remap_lse_from_flash_attn, remap_lse_to_flash_attn, FlashAttnAccumulator, FlashAttnCall,
    FlashAttnMask, FlashAttnPlan, FlashAttnPlanOptions,
};
use flash_ring::{doc_ids_from_cu_seqlens, flash_fwd, AttnSpec, Error, MaskKind, Positions};
use rand::rngs::StdRng;
use rand::Rng;

const TOL: f64 = 1e-5;

fn opts(allow_local: bool) -> FlashAttnPlanOptions {
    FlashAttnPlanOptions {
        allow_local,
        max_calls: None,
    }
}

fn list(v: impl IntoIterator<Item = usize>) -> Positions {
    Positions::list(v.into_iter().map(|x| x as u32).collect::<Vec<_>>())
}

/// Zigzag rows of `rank` in a world of `world`: chunks `rank` and `2 * world - 1 - rank` of `c`.
fn zigzag(rank: usize, world: usize, c: usize) -> Positions {
    let hi = 2 * world - 1 - rank;
    list((rank * c..(rank + 1) * c).chain(hi * c..(hi + 1) * c))
}

/// Striped rows of `rank`: row `i` holds position `i * p + rank`.
fn striped(rank: usize, p: usize, n: usize) -> Positions {
    list((0..n).map(|i| i * p + rank))
}

// ---------------------------------------------------------------------------------------------
// flash-attn semantics, written here independently of the crate.

/// flash-attn's rule for a call with `sq` queries and `sk` keys after the argument handling of
/// candle-flash-attn (`candle = true`: sizes `> seqlen_k` become -1) or of flash-attn's own
/// `mha_fwd` (sizes `>= seqlen_k` become -1), then `set_params_fprop` (a -1 opposite a
/// non-negative size becomes `seqlen_k`).
fn fa_kernel_allows(
    sq: usize,
    sk: usize,
    m: FlashAttnMask,
    i: usize,
    j: usize,
    candle: bool,
) -> bool {
    let clamp = |w: Option<usize>| -> i64 {
        match w {
            Some(x) if (candle && x <= sk) || (!candle && x < sk) => x as i64,
            _ => -1,
        }
    };
    let (mut l, mut r) = (clamp(m.window_size_left), clamp(m.window_size_right));
    if l < 0 && r >= 0 {
        l = sk as i64;
    }
    if l >= 0 && r < 0 {
        r = sk as i64;
    }
    if l < 0 && r < 0 {
        return true;
    }
    let base = i as i64 + sk as i64 - sq as i64;
    j as i64 >= base - l && j as i64 <= base + r
}

/// The brief's rule: `i + sk - sq - left <= j <= i + sk - sq + right`, `None` unbounded.
fn fa_nominal_allows(sq: usize, sk: usize, m: FlashAttnMask, i: usize, j: usize) -> bool {
    let base = i as i64 + sk as i64 - sq as i64;
    m.window_size_left
        .is_none_or(|l| j as i64 >= base - l as i64)
        && m.window_size_right
            .is_none_or(|r| j as i64 <= base + r as i64)
}

/// A flash-ring spec with flash-attn's semantics for `call` (rows renumbered from 0): causal with
/// the q positions shifted by `sk - sq + right`, and window `left + right + 1`.
fn call_spec(call: &FlashAttnCall, scale: f32) -> AttnSpec {
    let (sq, sk) = (call.seq_q(), call.seq_k());
    match (call.mask.window_size_left, call.mask.window_size_right) {
        (None, None) => AttnSpec::dense(scale, MaskKind::Full, sq, sk),
        (left, Some(r)) => {
            let shift = sk as i64 - sq as i64 + r as i64;
            let kb = (-shift).max(0);
            let qb = kb + shift;
            let mut s = AttnSpec::new(
                scale,
                MaskKind::Causal,
                Positions::range(qb as usize, sq),
                Positions::range(kb as usize, sk),
            );
            s.window = left.map(|l| l + r + 1);
            s
        }
        (Some(_), None) => panic!("plan emitted a left window without a right one: {call:?}"),
    }
}

/// Mask-level checks of a plan against its spec (see the module docs).
fn check_cover(spec: &AttnSpec, plan: &FlashAttnPlan) {
    let (sq, sk) = (plan.seq_q, plan.seq_k);
    assert_eq!(plan.softmax_scale, spec.scale);
    let mut count = vec![0u32; sq * sk];
    for call in &plan.calls {
        let (n, m) = (call.seq_q(), call.seq_k());
        assert!(n > 0 && m > 0, "empty call {call:?}");
        assert!(call.q_rows.end <= sq && call.k_rows.end <= sk, "{call:?}");
        let mk = call.mask;
        if mk.window_size_left.is_some() {
            assert!(mk.window_size_right.is_some(), "{call:?}");
        }
        for w in [mk.window_size_left, mk.window_size_right]
            .into_iter()
            .flatten()
        {
            assert!(w < m, "window size {w} >= sk {m}: {call:?}");
        }
        assert_eq!(call.causal(), mk == FlashAttnMask::CAUSAL);
        let cs = call_spec(call, spec.scale);
        let mut row_any = vec![false; n];
        let mut col_any = vec![false; m];
        for i in 0..n {
            for j in 0..m {
                let a = fa_nominal_allows(n, m, mk, i, j);
                assert_eq!(a, mk.allows(n, m, i, j), "{call:?} ({i},{j})");
                assert_eq!(
                    a,
                    fa_kernel_allows(n, m, mk, i, j, true),
                    "{call:?} ({i},{j})"
                );
                assert_eq!(
                    a,
                    fa_kernel_allows(n, m, mk, i, j, false),
                    "{call:?} ({i},{j})"
                );
                assert_eq!(a, cs.allowed(cs.q_pos.get(i), cs.k_pos.get(j)), "{call:?}");
                if a {
                    count[(call.q_rows.start + i) * sk + call.k_rows.start + j] += 1;
                    row_any[i] = true;
                    col_any[j] = true;
                }
            }
        }
        assert!(row_any.iter().all(|&x| x), "a fully masked row in {call:?}");
        assert!(col_any.iter().all(|&x| x), "an unused key in {call:?}");
    }
    for i in 0..sq {
        for j in 0..sk {
            let want = spec.allowed(spec.q_pos.get(i), spec.k_pos.get(j));
            let c = count[i * sk + j];
            assert_eq!(
                c,
                want as u32,
                "pair (q row {i} at {}, k row {j} at {}) covered {c} times, allowed {want}",
                spec.q_pos.get(i),
                spec.k_pos.get(j)
            );
        }
    }
}

/// Runs every call of `plan` on the CPU kernel with flash-attn semantics and `+inf` LSEs, merges
/// them and compares with `flash_fwd` on the whole spec.
fn check_numeric(spec: &AttnSpec, plan: &FlashAttnPlan, shape: [usize; 6]) {
    let [b, sq, sk, hq, hkv, d] = shape;
    assert_eq!((plan.seq_q, plan.seq_k), (sq, sk));
    let case = Case::new(b, sq, sk, hq, hkv, d, spec.clone());
    let [q, k, v, _] = case.tensors();
    let (ro, rl) = flash_fwd(&q, &k, &v, spec).expect("flash_fwd on the whole spec");
    let mut acc = FlashAttnAccumulator::new(b, sq, hq, d, &Device::Cpu).expect("accumulator");
    for call in &plan.calls {
        let qc = q
            .narrow(1, call.q_rows.start, call.seq_q())
            .expect("narrow");
        let kc = k
            .narrow(1, call.k_rows.start, call.seq_k())
            .expect("narrow");
        let vc = v
            .narrow(1, call.k_rows.start, call.seq_k())
            .expect("narrow");
        let cs = call_spec(call, plan.softmax_scale);
        let (o, l) = flash_fwd(&qc, &kc, &vc, &cs).expect("call");
        // What flash-attn would hand back: +inf for fully masked rows.
        let l = lse_to_flash_attn(&l).expect("to flash-attn lse");
        acc.add(call, &o, &l).expect("add");
    }
    let (out, lse) = acc.finish();
    assert_eq!(out.dims(), &[b, sq, hq, d]);
    assert_eq!(lse.dims(), &[b, hq, sq]);
    let (lv, rlv) = (to_f64(&lse), to_f64(&rl));
    let (ov, rov) = (to_f64(&out), to_f64(&ro));
    for (x, y) in lv.iter().zip(&rlv) {
        assert_eq!(
            *x == f64::NEG_INFINITY,
            *y == f64::NEG_INFINITY,
            "-inf lse rows differ: {x} vs {y}"
        );
    }
    let e_out = rel(&ov, &rov);
    let e_lse = rel(&lv, &rlv);
    assert!(
        e_out <= TOL,
        "out rel err {e_out:.3e} ({} calls)",
        plan.num_calls()
    );
    assert!(
        e_lse <= TOL,
        "lse rel err {e_lse:.3e} ({} calls)",
        plan.num_calls()
    );
    // Rows with no allowed key: out exactly 0.
    for bi in 0..b {
        for h in 0..hq {
            for s in 0..sq {
                if lv[(bi * hq + h) * sq + s] == f64::NEG_INFINITY {
                    let o0 = ((bi * sq + s) * hq + h) * d;
                    assert!(ov[o0..o0 + d].iter().all(|&x| x == 0.0));
                }
            }
        }
    }
}

/// Plans, checks the cover and the numbers, returns the plan.
fn plan_and_check(spec: &AttnSpec, shape: [usize; 6], o: &FlashAttnPlanOptions) -> FlashAttnPlan {
    let plan = plan_flash_attn_with_options(spec, shape[1], shape[2], o).expect("plan");
    check_cover(spec, &plan);
    if !o.allow_local {
        assert!(!plan.needs_local(), "local call with allow_local = false");
    }
    check_numeric(spec, &plan, shape);
    plan
}

fn masks(plan: &FlashAttnPlan) -> Vec<FlashAttnMask> {
    plan.calls.iter().map(|c| c.mask).collect()
}

// ---------------------------------------------------------------------------------------------
// Dense and ring blocks.

#[test]
fn dense_causal_is_one_causal_call() {
    let spec = AttnSpec::dense(0.25, MaskKind::Causal, 45, 45);
    let plan = plan_and_check(&spec, [2, 45, 45, 4, 2, 16], &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::CAUSAL]);
    assert_eq!(plan.calls[0].q_rows, 0..45);
    assert_eq!(plan.calls[0].k_rows, 0..45);
    assert!(plan.calls[0].causal());
}

#[test]
fn dense_full_is_one_unmasked_call() {
    let spec = AttnSpec::dense(0.3, MaskKind::Full, 33, 21);
    let plan = plan_and_check(&spec, [1, 33, 21, 2, 2, 8], &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::NONE]);
    assert_eq!(
        (plan.calls[0].q_rows.clone(), plan.calls[0].k_rows.clone()),
        (0..33, 0..21)
    );
}

#[test]
fn causal_ring_blocks() {
    let n = 32;
    let blk = |i: usize| Positions::range(i * n, n);
    let base = AttnSpec::dense(0.25, MaskKind::Causal, n, n);
    let shape = [2, n, n, 4, 1, 16];
    // q block after k block: everything visible.
    let after = base.with_positions(blk(2), blk(0));
    let plan = plan_and_check(&after, shape, &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::NONE]);
    // q block before k block: nothing visible, no call; every row out 0, lse -inf.
    let before = base.with_positions(blk(0), blk(2));
    let plan = plan_and_check(&before, shape, &opts(true));
    assert_eq!(plan.num_calls(), 0);
    assert!(plan.covered_q_rows().iter().all(|&c| !c));
    // Diagonal block.
    let diag = base.with_positions(blk(1), blk(1));
    let plan = plan_and_check(&diag, shape, &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::CAUSAL]);
    // Uneven blocks (sq != sk) overlapping: q 40..64, k 30..50.
    let uneven = base.with_positions(Positions::range(40, 24), Positions::range(30, 20));
    let plan = plan_and_check(&uneven, [1, 24, 20, 2, 1, 8], &opts(true));
    assert!(plan.num_calls() <= 2, "{:?}", plan.calls);
}

#[test]
fn sq_ne_sk() {
    // Queries are the last 10 of 30 keys (bottom-right aligned already): one causal call.
    let spec = AttnSpec::new(
        0.2,
        MaskKind::Causal,
        Positions::range(20, 10),
        Positions::range(0, 30),
    );
    let plan = plan_and_check(&spec, [1, 10, 30, 4, 2, 8], &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::CAUSAL]);
    assert_eq!(plan.calls[0].k_rows, 0..30);
    // More queries than keys, both from 0 (top-left aligned): one call with a right window of 8
    // when local windows are allowed, else causal + unmasked.
    let spec = AttnSpec::dense(0.2, MaskKind::Causal, 20, 12);
    let plan = plan_and_check(&spec, [1, 20, 12, 2, 1, 8], &opts(true));
    assert_eq!(
        masks(&plan),
        vec![FlashAttnMask {
            window_size_left: None,
            window_size_right: Some(8)
        }]
    );
    let plan = plan_and_check(&spec, [1, 20, 12, 2, 1, 8], &opts(false));
    assert_eq!(
        masks(&plan),
        vec![FlashAttnMask::CAUSAL, FlashAttnMask::NONE]
    );
    assert_eq!(plan.calls[0].q_rows, 0..12);
    assert_eq!(plan.calls[1].q_rows, 12..20);
    // A right window that flash-attn could not take (>= sk): split even with local allowed.
    let spec = AttnSpec::dense(0.2, MaskKind::Causal, 30, 12);
    let plan = plan_and_check(&spec, [1, 30, 12, 2, 2, 8], &opts(true));
    assert_eq!(
        masks(&plan),
        vec![FlashAttnMask::CAUSAL, FlashAttnMask::NONE]
    );
    // Fewer queries than keys, top-left aligned (a q block at the start of a longer k block).
    let spec = AttnSpec::dense(0.2, MaskKind::Causal, 7, 19);
    let plan = plan_and_check(&spec, [2, 7, 19, 2, 1, 8], &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::CAUSAL]);
    assert_eq!(plan.calls[0].k_rows, 0..7);
}

// ---------------------------------------------------------------------------------------------
// Zigzag and striped layouts.

#[test]
fn zigzag_pairs() {
    let (world, c) = (2, 12);
    let base = AttnSpec::dense(0.25, MaskKind::Causal, 2 * c, 2 * c);
    let shape = [1, 2 * c, 2 * c, 4, 1, 16];
    let mut counts = Vec::new();
    for qr in 0..world {
        for kr in 0..world {
            let spec = base.with_positions(zigzag(qr, world, c), zigzag(kr, world, c));
            let plan = plan_and_check(&spec, shape, &opts(true));
            assert!(plan.num_calls() <= 4, "zigzag {qr}/{kr}: {:?}", plan.calls);
            assert!(!plan.needs_local());
            counts.push(plan.num_calls());
        }
    }
    // (0,0): chunk0-chunk0 causal, chunk3-chunk0 full, chunk3-chunk3 causal; (0,1): chunk3 sees
    // chunks 1..3 (one contiguous run); (1,0): chunks 1..3 see chunk 0; (1,1): chunks 1, 2 are
    // one contiguous run, so one causal call.
    assert_eq!(counts, vec![3, 1, 1, 1]);
    // Four ranks.
    let (world, c) = (4, 6);
    for (qr, kr) in [(0, 3), (3, 0), (1, 2), (2, 2)] {
        let spec = base.with_positions(zigzag(qr, world, c), zigzag(kr, world, c));
        let plan = plan_and_check(&spec, [1, 2 * c, 2 * c, 2, 2, 8], &opts(true));
        assert!(plan.num_calls() <= 4, "zigzag {qr}/{kr}: {:?}", plan.calls);
    }
}

#[test]
fn striped_pairs_are_one_call() {
    let (p, n) = (4, 16);
    let base = AttnSpec::dense(0.25, MaskKind::Causal, n, n);
    for (qr, kr) in [(2, 1), (1, 2), (3, 3), (0, 3), (3, 0)] {
        let spec = base.with_positions(striped(qr, p, n), striped(kr, p, n));
        let plan = plan_and_check(&spec, [1, n, n, 4, 2, 8], &opts(true));
        assert_eq!(
            masks(&plan),
            vec![FlashAttnMask::CAUSAL],
            "striped {qr}/{kr}"
        );
        if qr < kr {
            // Row i sees keys j < i: the first q row and the last key drop out.
            assert_eq!(plan.calls[0].q_rows, 1..n);
            assert_eq!(plan.calls[0].k_rows, 0..n - 1);
        }
    }
    // Full mask, striped: one unmasked call.
    let spec = AttnSpec::new(0.25, MaskKind::Full, striped(1, p, n), striped(2, p, n));
    let plan = plan_and_check(&spec, [1, n, n, 2, 1, 8], &opts(true));
    assert_eq!(masks(&plan), vec![FlashAttnMask::NONE]);
}

#[test]
fn mixed_strides_fall_back_to_rows() {
    // Striped q (stride 3) against contiguous k: one call per q row that sees a key.
    let spec = AttnSpec::new(
        0.25,
        MaskKind::Causal,
        striped(1, 3, 10),
        Positions::range(5, 20),
    );
    let plan = plan_and_check(&spec, [1, 10, 20, 2, 1, 8], &opts(true));
    assert!(plan.num_calls() <= 10);
    assert!(plan
        .calls
        .iter()
        .all(|c| c.mask.is_unmasked() && c.seq_q() == 1));
    // Reversed rows (stride -1) on both sides: a band, one (local) call or one per row.
    let rev = list((0..20).rev());
    let spec = AttnSpec::new(0.25, MaskKind::Causal, rev.clone(), rev.clone());
    let plan = plan_and_check(&spec, [1, 20, 20, 2, 2, 8], &opts(true));
    assert_eq!(plan.num_calls(), 1);
    let plan = plan_and_check(&spec, [1, 20, 20, 2, 2, 8], &opts(false));
    assert!(plan.num_calls() <= 20);
    // Reversed q against contiguous k.
    let spec = AttnSpec::new(0.25, MaskKind::Full, rev, Positions::range(0, 9)).with_window(4);
    plan_and_check(&spec, [1, 20, 9, 2, 1, 8], &opts(true));
}

// ---------------------------------------------------------------------------------------------
// Documents and windows.

#[test]
fn documents_crossing_block_boundaries() {
    let cu = [0usize, 5, 21, 30, 52, 64];
    let n = 16;
    for mask in [MaskKind::Causal, MaskKind::Full] {
        let base = AttnSpec::dense(0.25, mask, n, n)
            .with_cu_seqlens(&cu)
            .expect("cu_seqlens");
        for qb in 0..4 {
            for kb in 0..4 {
                let spec =
                    base.with_positions(Positions::range(qb * n, n), Positions::range(kb * n, n));
                let plan = plan_and_check(&spec, [1, n, n, 4, 2, 8], &opts(true));
                // At most one call per document the two blocks share.
                let docs = |b: usize| -> Vec<u32> {
                    let d = spec.doc_ids.as_ref().expect("docs");
                    let mut v: Vec<u32> = (b * n..(b + 1) * n).map(|p| d[p]).collect();
                    v.dedup();
                    v
                };
                let shared = docs(qb).iter().filter(|x| docs(kb).contains(x)).count();
                assert!(
                    plan.num_calls() <= shared,
                    "{mask:?} {qb}/{kb}: {:?}",
                    plan.calls
                );
                if mask == MaskKind::Causal && qb < kb {
                    assert_eq!(plan.num_calls(), 0);
                }
            }
        }
    }
    // Documents with zigzag blocks.
    let (world, c) = (2, 8);
    let base = AttnSpec::dense(0.25, MaskKind::Causal, 2 * c, 2 * c)
        .with_cu_seqlens(&[0, 3, 13, 20, 32])
        .expect("cu_seqlens");
    for qr in 0..world {
        for kr in 0..world {
            let spec = base.with_positions(zigzag(qr, world, c), zigzag(kr, world, c));
            let plan = plan_and_check(&spec, [1, 2 * c, 2 * c, 2, 1, 8], &opts(true));
            assert!(plan.num_calls() <= 3, "{qr}/{kr}: {:?}", plan.calls);
        }
    }
}

#[test]
fn sliding_window_causal() {
    let spec = AttnSpec::dense(0.25, MaskKind::Causal, 64, 64).with_window(9);
    let plan = plan_and_check(&spec, [1, 64, 64, 4, 2, 8], &opts(true));
    assert_eq!(
        masks(&plan),
        vec![FlashAttnMask {
            window_size_left: Some(8),
            window_size_right: Some(0)
        }]
    );
    // Without local kernels: exact, causal/unmasked only (more calls).
    let plan = plan_and_check(&spec, [1, 64, 64, 4, 2, 8], &opts(false));
    assert!(plan.num_calls() <= 64);
    // Ring blocks of 32 with the window: q block 1 against k block 0 (only its first 8 rows see
    // anything) and block 0 against block 1 (nothing).
    let n = 32;
    for (qb, kb, max) in [(1, 0, 1), (0, 1, 0), (1, 1, 1), (2, 0, 0)] {
        let s = spec.with_positions(Positions::range(qb * n, n), Positions::range(kb * n, n));
        let plan = plan_and_check(&s, [1, n, n, 2, 1, 8], &opts(true));
        assert!(plan.num_calls() <= max, "{qb}/{kb}: {:?}", plan.calls);
    }
    // Window larger than the block: the diagonal block is plain causal.
    let s = AttnSpec::dense(0.25, MaskKind::Causal, 20, 20).with_window(100);
    let plan = plan_and_check(&s, [1, 20, 20, 2, 1, 8], &opts(false));
    assert_eq!(masks(&plan), vec![FlashAttnMask::CAUSAL]);
}

#[test]
fn sliding_window_full() {
    let spec = AttnSpec::dense(0.25, MaskKind::Full, 48, 48).with_window(7);
    let plan = plan_and_check(&spec, [2, 48, 48, 2, 2, 8], &opts(true));
    assert_eq!(
        masks(&plan),
        vec![FlashAttnMask {
            window_size_left: Some(6),
            window_size_right: Some(6)
        }]
    );
    plan_and_check(&spec, [1, 48, 48, 2, 1, 8], &opts(false));
    // Off-diagonal blocks, sq != sk, a wide window against few keys (needs the split).
    for (q0, nq, k0, nk, w) in [
        (16, 16, 0, 16, 7),
        (0, 16, 16, 16, 7),
        (0, 20, 8, 2, 10),
        (5, 30, 0, 9, 4),
    ] {
        let s = AttnSpec::new(
            0.25,
            MaskKind::Full,
            Positions::range(q0, nq),
            Positions::range(k0, nk),
        )
        .with_window(w);
        let plan = plan_and_check(&s, [1, nq, nk, 2, 1, 8], &opts(true));
        assert!(plan.num_calls() <= 3, "{:?}", plan.calls);
        plan_and_check(&s, [1, nq, nk, 2, 1, 8], &opts(false));
    }
    // Zigzag with a window.
    let s = AttnSpec::new(0.25, MaskKind::Full, zigzag(0, 2, 10), zigzag(1, 2, 10)).with_window(5);
    let plan = plan_and_check(&s, [1, 20, 20, 2, 1, 8], &opts(true));
    assert!(plan.num_calls() <= 4, "{:?}", plan.calls);
}

#[test]
fn rows_with_no_allowed_key() {
    // q block 16..32 holds documents [10, 20) and [20, 40); k block 0..16 only [10, 20): rows of
    // the second document see nothing.
    let spec = AttnSpec::new(
        0.25,
        MaskKind::Causal,
        Positions::range(16, 16),
        Positions::range(0, 16),
    )
    .with_cu_seqlens(&[0, 10, 20, 40])
    .expect("cu_seqlens");
    let plan = plan_and_check(&spec, [2, 16, 16, 4, 2, 8], &opts(true));
    assert_eq!(plan.num_calls(), 1);
    let cov = plan.covered_q_rows();
    assert_eq!(cov.iter().filter(|&&c| c).count(), 4);
    // A small window: only the first rows of the later block reach the earlier one.
    let spec = AttnSpec::new(
        0.25,
        MaskKind::Causal,
        Positions::range(16, 16),
        Positions::range(0, 16),
    )
    .with_window(4);
    let plan = plan_and_check(&spec, [1, 16, 16, 2, 1, 8], &opts(true));
    assert_eq!(plan.covered_q_rows().iter().filter(|&&c| c).count(), 3);
    // Window 0: nothing at all.
    let spec = AttnSpec::dense(0.25, MaskKind::Full, 8, 8).with_window(0);
    let plan = plan_and_check(&spec, [1, 8, 8, 2, 1, 8], &opts(true));
    assert_eq!(plan.num_calls(), 0);
}

#[test]
fn empty_blocks() {
    let spec = AttnSpec::dense(0.25, MaskKind::Causal, 0, 5);
    assert_eq!(plan_flash_attn(&spec, 0, 5).expect("plan").num_calls(), 0);
    let spec = AttnSpec::dense(0.25, MaskKind::Causal, 5, 0);
    let plan = plan_flash_attn(&spec, 5, 0).expect("plan");
    assert_eq!(plan.num_calls(), 0);
    assert_eq!(plan.covered_q_rows(), vec![false; 5]);
}

// ---------------------------------------------------------------------------------------------
// Randomized: mask-level cover for many layouts, numbers for some.

fn random_positions(r: &mut StdRng, n: usize, total: usize) -> Positions {
    let n = n.min(total);
    match r.random_range(0..7) {
        0 => Positions::range(r.random_range(0..=total - n), n),
        1 => {
            // Zigzag-like: two runs.
            let a = n / 2;
            let s0 = r.random_range(0..=total - n);
            let s1 = r.random_range(0..=total - (n - a));
            list((s0..s0 + a).chain(s1..s1 + n - a))
        }
        2 => {
            let p = r.random_range(1..=4usize);
            let n = n.min(total / p).max(1);
            let off = r.random_range(0..p.min(total));
            list((0..n).map(|i| (i * p + off).min(total - 1)))
        }
        3 => {
            let s = r.random_range(0..=total - n);
            list((s..s + n).rev())
        }
        4 => list((0..n).map(|_| r.random_range(0..total))),
        5 => {
            // Contiguous then striped.
            let a = n / 2;
            let s = r.random_range(0..=total - n);
            list((s..s + a).chain((0..n - a).map(|i| (2 * i + 1).min(total - 1))))
        }
        _ => {
            // Runs with repeated positions.
            let s = r.random_range(0..total);
            list((0..n).map(|i| (s + i / 3).min(total - 1)))
        }
    }
}

fn random_spec(r: &mut StdRng, total: usize) -> (AttnSpec, usize, usize) {
    let nq = r.random_range(1..=24);
    let nk = r.random_range(1..=24);
    let q = random_positions(r, nq, total);
    let k = random_positions(r, nk, total);
    let (sq, sk) = (q.len(), k.len());
    let mask = if r.random_bool(0.6) {
        MaskKind::Causal
    } else {
        MaskKind::Full
    };
    let mut spec = AttnSpec::new(0.3, mask, q, k);
    if r.random_bool(0.5) {
        spec.window = Some([0, 1, 2, 3, 5, 9, 17, 40, 100][r.random_range(0..9)]);
    }
    if r.random_bool(0.5) {
        let mut cu = vec![0usize];
        while *cu.last().unwrap() < total {
            let next = (cu.last().unwrap() + r.random_range(1..=20)).min(total);
            cu.push(next);
        }
        spec.doc_ids = Some(doc_ids_from_cu_seqlens(&cu).expect("cu"));
    }
    (spec, sq, sk)
}

#[test]
fn random_specs_cover_exactly() {
    let mut r = rng(7);
    for _ in 0..600 {
        let (spec, sq, sk) = random_spec(&mut r, 48);
        for allow_local in [true, false] {
            let plan =
                plan_flash_attn_with_options(&spec, sq, sk, &opts(allow_local)).expect("plan");
            check_cover(&spec, &plan);
            if !allow_local {
                assert!(!plan.needs_local());
            }
        }
    }
}

#[test]
fn random_specs_numeric() {
    let mut r = rng(11);
    for i in 0..40 {
        let (spec, sq, sk) = random_spec(&mut r, 40);
        plan_and_check(&spec, [1, sq, sk, 2, 1, 8], &opts(i % 2 == 0));
    }
}

// ---------------------------------------------------------------------------------------------
// LSE conventions and the accumulator.

#[test]
fn lse_remap_slices_and_tensors() {
    let v = vec![1.5f32, f32::INFINITY, f32::NEG_INFINITY, -3.0, 0.0];
    let mut a = v.clone();
    remap_lse_from_flash_attn(&mut a);
    assert_eq!(
        a,
        vec![1.5, f32::NEG_INFINITY, f32::NEG_INFINITY, -3.0, 0.0]
    );
    let mut b = v.clone();
    remap_lse_to_flash_attn(&mut b);
    assert_eq!(b, vec![1.5, f32::INFINITY, f32::INFINITY, -3.0, 0.0]);
    let t = Tensor::from_vec(v.clone(), (1, 5), &Device::Cpu).expect("tensor");
    let ta: Vec<f32> = lse_from_flash_attn(&t)
        .and_then(|x| Ok(x.flatten_all()?.to_vec1()?))
        .expect("from");
    assert_eq!(ta, a);
    let tb: Vec<f32> = lse_to_flash_attn(&t)
        .and_then(|x| Ok(x.flatten_all()?.to_vec1()?))
        .expect("to");
    assert_eq!(tb, b);
    let t16 = t.to_dtype(DType::F16).expect("f16");
    assert!(matches!(
        lse_from_flash_attn(&t16),
        Err(Error::DType { .. })
    ));
}

#[test]
fn accumulator_takes_flash_attn_inf_rows_and_leaves_uncovered_rows() {
    // A causal call with more queries than keys has fully masked rows in flash-attn (rows 0, 1
    // of q rows 2..6 against keys 0..2): their +inf lse and (poisoned) out must be ignored; rows
    // 0..2 and 6..8 are covered by no call.
    let (b, sq, sk, h, d) = (1, 8, 2, 2, 4);
    let call = FlashAttnCall {
        q_rows: 2..6,
        k_rows: 0..2,
        mask: FlashAttnMask::CAUSAL,
    };
    let case = Case::new(
        b,
        sq,
        sk,
        h,
        h,
        d,
        AttnSpec::dense(0.5, MaskKind::Full, sq, sk),
    );
    let [q, k, v, _] = case.tensors();
    let qc = q.narrow(1, 2, 4).expect("narrow");
    let cs = call_spec(&call, 0.5);
    let (o, l) = flash_fwd(&qc, &k, &v, &cs).expect("call");
    let lv: Vec<f32> = l.flatten_all().and_then(|x| x.to_vec1()).expect("lse");
    let mut lfa = lv.clone();
    remap_lse_to_flash_attn(&mut lfa);
    assert!(lfa.contains(&f32::INFINITY));
    // Poison the out of fully masked rows with NaN.
    let mut ov: Vec<f32> = o.flatten_all().and_then(|x| x.to_vec1()).expect("out");
    for s in 0..4 {
        for hh in 0..h {
            if lv[hh * 4 + s] == f32::NEG_INFINITY {
                ov[(s * h + hh) * d..(s * h + hh + 1) * d].fill(f32::NAN);
            }
        }
    }
    let o = Tensor::from_vec(ov, (b, 4, h, d), &Device::Cpu).expect("out");
    let l = Tensor::from_vec(lfa, (b, h, 4), &Device::Cpu).expect("lse");
    let mut acc = FlashAttnAccumulator::new(b, sq, h, d, &Device::Cpu).expect("acc");
    acc.add(&call, &o, &l).expect("add");
    let (out, lse) = acc.finish();
    // Reference: flash-ring with q row i in 2..6 at position i - 2 and key j at position j + 2
    // (row i sees key j iff j <= (i - 2) - 2, the call's bottom-right causal rule); rows 0, 1,
    // 6, 7 at position 0 see nothing.
    let spec = AttnSpec::new(
        0.5,
        MaskKind::Causal,
        list((0..sq).map(|i| if (2..6).contains(&i) { i - 2 } else { 0 })),
        Positions::range(2, 2),
    );
    let (ro, rl) = flash_fwd(&q, &k, &v, &spec).expect("reference");
    let lo = to_f64(&lse);
    let rlo = to_f64(&rl);
    assert_eq!(
        lo.iter().filter(|x| **x == f64::NEG_INFINITY).count(),
        6 * h
    );
    for (x, y) in lo.iter().zip(&rlo) {
        assert_eq!(*x == f64::NEG_INFINITY, *y == f64::NEG_INFINITY);
    }
    assert!(rel(&lo, &rlo) <= TOL);
    let oo = to_f64(&out);
    assert!(oo.iter().all(|x| x.is_finite()));
    assert!(rel(&oo, &to_f64(&ro)) <= TOL);
}

// ---------------------------------------------------------------------------------------------
// Bad input.

#[test]
fn bad_input_is_an_error() {
    let spec = AttnSpec::dense(0.25, MaskKind::Causal, 8, 8);
    assert!(matches!(
        plan_flash_attn(&spec, 9, 8),
        Err(Error::PositionsLen { .. })
    ));
    assert!(matches!(
        plan_flash_attn(&spec, 8, 7),
        Err(Error::PositionsLen { .. })
    ));
    let short: Arc<[u32]> = vec![0u32; 5].into();
    assert!(matches!(
        plan_flash_attn(&spec.clone().with_doc_ids(short), 8, 8),
        Err(Error::DocIdsTooShort { .. })
    ));
    let mut nan = spec.clone();
    nan.scale = f32::NAN;
    assert!(matches!(plan_flash_attn(&nan, 8, 8), Err(Error::Config(_))));
    // Call limit.
    let striped_q = AttnSpec::new(
        0.25,
        MaskKind::Causal,
        striped(0, 3, 8),
        Positions::range(0, 24),
    );
    let all = plan_flash_attn(&striped_q, 8, 24).expect("plan");
    assert!(all.num_calls() > 2);
    let limited = FlashAttnPlanOptions {
        allow_local: true,
        max_calls: Some(2),
    };
    assert!(matches!(
        plan_flash_attn_with_options(&striped_q, 8, 24, &limited),
        Err(Error::FlashAttnPlan(_))
    ));
    let exact = FlashAttnPlanOptions {
        allow_local: true,
        max_calls: Some(all.num_calls()),
    };
    assert_eq!(
        plan_flash_attn_with_options(&striped_q, 8, 24, &exact).expect("plan"),
        all
    );

    // Accumulator: shapes, rows, dtypes.
    let dev = Device::Cpu;
    let mut acc = FlashAttnAccumulator::new(1, 8, 2, 4, &dev).expect("acc");
    let call = FlashAttnCall {
        q_rows: 2..5,
        k_rows: 0..3,
        mask: FlashAttnMask::NONE,
    };
    let out = Tensor::zeros((1, 3, 2, 4), DType::F32, &dev).expect("out");
    let lse = Tensor::zeros((1, 2, 3), DType::F32, &dev).expect("lse");
    let bad_out = Tensor::zeros((1, 4, 2, 4), DType::F32, &dev).expect("out");
    let bad_lse = Tensor::zeros((1, 3, 2), DType::F32, &dev).expect("lse");
    assert!(matches!(
        acc.add(&call, &bad_out, &lse),
        Err(Error::Shape { tensor: "out", .. })
    ));
    assert!(matches!(
        acc.add(&call, &out, &bad_lse),
        Err(Error::Shape { tensor: "lse", .. })
    ));
    let lse16 = lse.to_dtype(DType::F16).expect("f16");
    assert!(matches!(
        acc.add(&call, &out, &lse16),
        Err(Error::DType { .. })
    ));
    let outside = FlashAttnCall {
        q_rows: 6..9,
        ..call.clone()
    };
    assert!(matches!(
        acc.add(&outside, &out, &lse),
        Err(Error::FlashAttnPlan(_))
    ));
    acc.add(&call, &out, &lse).expect("a good add still works");
}
