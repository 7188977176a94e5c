//! Blockwise use as in a ring: split the keys into 2..8 blocks, run each block separately and
//! merge; backward per block with the merged (final) out and lse, summed over blocks, must give
//! the single-call gradients. Also fully masked rows (no NaN anywhere).

mod common;

use candle_core::{DType, Device, Tensor};
use common::{rel, to_f64, Case};
use flash_ring::{flash_bwd_f32, flash_fwd, merge, AttnSpec, MaskKind, Positions};

const TOL: f64 = 1e-5;

/// Uneven split of `n` rows into `parts` blocks (some blocks may be short).
fn split(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> = (0..=parts).map(|i| i * n / parts).collect();
    // Make the blocks uneven but keep them non-empty when possible.
    for c in cuts.iter_mut().take(parts).skip(1) {
        *c = (*c + 7).min(n);
    }
    cuts.windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| (w[0], w[1] - w[0]))
        .collect()
}

fn check_blocks(case: &Case, parts: usize) {
    let [q, k, v, dout] = case.tensors();
    let spec = &case.spec;
    let (out1, lse1) = flash_fwd(&q, &k, &v, spec).expect("single fwd");
    let (dq1, dk1, dv1) = flash_bwd_f32(&q, &k, &v, &out1, &lse1, &dout, spec).expect("single bwd");

    let blocks = split(case.shape.sk, parts);
    let mut acc: Option<(Tensor, Tensor)> = None;
    for &(off, len) in &blocks {
        let kb = k.narrow(1, off, len).expect("narrow"); // non-contiguous view
        let vb = v.narrow(1, off, len).expect("narrow");
        let bspec = spec.with_positions(
            spec.q_pos.clone(),
            spec.k_pos.slice(off, len).expect("slice"),
        );
        let (o, l) = flash_fwd(&q, &kb, &vb, &bspec).expect("block fwd");
        acc = Some(match acc {
            None => (o.to_dtype(DType::F32).expect("f32"), l),
            Some((ao, al)) => merge(&ao, &al, &o, &l).expect("merge"),
        });
    }
    let (out_m, lse_m) = acc.expect("at least one block");
    let e_out = rel(
        &to_f64(&out_m),
        &to_f64(&out1.to_dtype(DType::F32).expect("f32")),
    );
    let e_lse = rel(&to_f64(&lse_m), &to_f64(&lse1));
    assert!(e_out <= TOL, "merged out: {e_out:.3e} ({parts} blocks)");
    assert!(e_lse <= TOL, "merged lse: {e_lse:.3e} ({parts} blocks)");

    // Backward per block with the FINAL out and lse; dq summed, dk/dv concatenated.
    let out_final = out_m.to_dtype(q.dtype()).expect("dtype");
    let mut dq = Tensor::zeros_like(&dq1).expect("zeros");
    let mut dks = Vec::new();
    let mut dvs = Vec::new();
    for &(off, len) in &blocks {
        let kb = k.narrow(1, off, len).expect("narrow");
        let vb = v.narrow(1, off, len).expect("narrow");
        let bspec = spec.with_positions(
            spec.q_pos.clone(),
            spec.k_pos.slice(off, len).expect("slice"),
        );
        let (a, b, c) =
            flash_bwd_f32(&q, &kb, &vb, &out_final, &lse_m, &dout, &bspec).expect("block bwd");
        assert_eq!(a.dtype(), DType::F32);
        dq = (dq + a).expect("add");
        dks.push(b);
        dvs.push(c);
    }
    let dk = Tensor::cat(&dks, 1).expect("cat");
    let dv = Tensor::cat(&dvs, 1).expect("cat");
    for (name, a, b) in [("dq", &dq, &dq1), ("dk", &dk, &dk1), ("dv", &dv, &dv1)] {
        let e = rel(&to_f64(a), &to_f64(b));
        assert!(e <= TOL, "{name} summed over {parts} blocks: {e:.3e}");
    }
}

#[test]
fn split_keys_and_merge_f32() {
    let d = 64;
    let scale = 0.125;
    let n = 300;
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 40, 170, 171, 300]).expect("cu");
    let specs = [
        AttnSpec::dense(scale, MaskKind::Full, n, n),
        AttnSpec::dense(scale, MaskKind::Causal, n, n),
        AttnSpec::dense(scale, MaskKind::Causal, n, n).with_doc_ids(docs.clone()),
        AttnSpec::dense(scale, MaskKind::Full, n, n).with_window(33),
    ];
    for spec in specs {
        for parts in 2..=8 {
            let case = Case::new(2, n, n, 4, 2, d, spec.clone());
            check_blocks(&case, parts);
        }
    }
}

#[test]
fn split_keys_zigzag_queries() {
    // q rows: zigzag chunks 0 and 3 of 4; keys: the whole sequence split in blocks.
    let n = 256;
    let qpos: Vec<u32> = (0..64).chain(192..256).collect();
    let spec = AttnSpec::new(
        0.125,
        MaskKind::Causal,
        Positions::list(qpos),
        Positions::range(0, n),
    );
    for parts in [2, 5, 8] {
        check_blocks(&Case::new(1, 128, n, 2, 1, 64, spec.clone()), parts);
    }
}

#[test]
fn split_keys_bf16_inputs() {
    // bf16 inputs, f32 merge and f32 gradients: still exact partial sums (same kernel math).
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, 200, 200);
    let case = Case::new(1, 200, 200, 2, 2, 64, spec).dtype(DType::BF16);
    let [q, k, v, _] = case.tensors();
    let (o1, l1) = flash_fwd(&q, &k, &v, &case.spec).expect("fwd");
    let (oa, la) = flash_fwd(
        &q,
        &k.narrow(1, 0, 90).expect("n"),
        &v.narrow(1, 0, 90).expect("n"),
        &case
            .spec
            .with_positions(case.spec.q_pos.clone(), Positions::range(0, 90)),
    )
    .expect("a");
    let (ob, lb) = flash_fwd(
        &q,
        &k.narrow(1, 90, 110).expect("n"),
        &v.narrow(1, 90, 110).expect("n"),
        &case
            .spec
            .with_positions(case.spec.q_pos.clone(), Positions::range(90, 110)),
    )
    .expect("b");
    let (om, lm) = merge(&oa, &la, &ob, &lb).expect("merge");
    assert_eq!(om.dtype(), DType::F32);
    // Partials are rounded to bf16 before merging: within bf16 rounding of the single call.
    assert!(rel(&to_f64(&om), &to_f64(&o1)) <= 1e-2);
    assert!(rel(&to_f64(&lm), &to_f64(&l1)) <= 1e-5);
}

#[test]
fn fully_masked_rows_no_nan() {
    let dev = Device::Cpu;
    // q rows 0..10 see keys 5..25 causally: rows 0..4 see nothing. Documents make more rows
    // empty: doc 0 = [0, 3), doc 1 = [3, 25).
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 3, 25]).expect("cu");
    let spec = AttnSpec::new(
        0.2,
        MaskKind::Causal,
        Positions::range(0, 10),
        Positions::range(5, 20),
    )
    .with_doc_ids(docs);
    let case = Case::new(2, 10, 20, 2, 1, 32, spec.clone());
    let worst = case.check(TOL);
    assert!(worst.is_finite());
    let [q, k, v, dout] = case.tensors();
    let (out, lse) = flash_fwd(&q, &k, &v, &spec).expect("fwd");
    let lse_v: Vec<f32> = lse.flatten_all().and_then(|t| t.to_vec1()).expect("lse");
    let out_v: Vec<f32> = out.flatten_all().and_then(|t| t.to_vec1()).expect("out");
    for bh in 0..4 {
        for s in 0..10 {
            let l = lse_v[bh * 10 + s];
            if s < 5 {
                assert_eq!(l, f32::NEG_INFINITY, "row {s} must be empty");
            } else {
                assert!(l.is_finite());
            }
        }
    }
    // out rows of empty queries are exactly zero: (b, s, h, d) with s < 5.
    for b in 0..2 {
        for s in 0..5 {
            let o = ((b * 10 + s) * 2) * 32;
            assert!(out_v[o..o + 64].iter().all(|&x| x == 0.0));
        }
    }
    let (dq, dk, dv) = flash_bwd_f32(&q, &k, &v, &out, &lse, &dout, &spec).expect("bwd");
    for t in [&dq, &dk, &dv] {
        assert!(to_f64(t).iter().all(|x| x.is_finite()));
    }
    // An empty key block and a zero window: every row is empty, no NaN.
    let k0 = Tensor::zeros((2, 0, 1, 32), DType::F32, &dev).expect("empty k");
    let spec0 = AttnSpec::new(
        0.2,
        MaskKind::Full,
        Positions::range(0, 10),
        Positions::range(0, 0),
    );
    let (o0, l0) = flash_fwd(&q, &k0, &k0, &spec0).expect("empty block fwd");
    assert!(to_f64(&o0).iter().all(|&x| x == 0.0));
    assert!(to_f64(&l0).iter().all(|&x| x == f64::NEG_INFINITY));
    let (a, b, c) = flash_bwd_f32(&q, &k0, &k0, &o0, &l0, &dout, &spec0).expect("empty bwd");
    assert!(to_f64(&a).iter().all(|&x| x == 0.0));
    assert_eq!((b.dims()[1], c.dims()[1]), (0, 0));
    let specw = AttnSpec::dense(0.2, MaskKind::Causal, 10, 20).with_window(0);
    let (ow, lw) = flash_fwd(&q, &k, &v, &specw).expect("window 0");
    assert!(to_f64(&ow).iter().all(|&x| x == 0.0));
    assert!(to_f64(&lw).iter().all(|&x| x == f64::NEG_INFINITY));
    // Merging two all -inf partials: lse -inf, out 0, no NaN, even with garbage outs.
    let nan = Tensor::full(f32::NAN, (1, 3, 2, 4), &dev).expect("nan");
    let ninf = Tensor::full(f32::NEG_INFINITY, (1, 2, 3), &dev).expect("ninf");
    let (o, l) = merge(&nan, &ninf, &nan, &ninf).expect("merge");
    assert!(to_f64(&o).iter().all(|&x| x == 0.0));
    assert!(to_f64(&l).iter().all(|&x| x == f64::NEG_INFINITY));
    // -inf merged with a finite partial returns the finite one unchanged.
    let ones = Tensor::ones((1, 3, 2, 4), DType::F32, &dev).expect("ones");
    let zl = Tensor::zeros((1, 2, 3), DType::F32, &dev).expect("zl");
    let (o, l) = merge(&nan, &ninf, &ones, &zl).expect("merge");
    assert!(to_f64(&o).iter().all(|&x| x == 1.0));
    assert!(to_f64(&l).iter().all(|&x| x == 0.0));
}

#[test]
fn split_queries_matches_single_call() {
    // q blocks need no merge: each block's rows equal the single call's rows.
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, 200, 200);
    let case = Case::new(1, 200, 200, 2, 2, 64, spec.clone());
    let [q, k, v, _] = case.tensors();
    let (o1, l1) = flash_fwd(&q, &k, &v, &spec).expect("fwd");
    let qb = q.narrow(1, 130, 70).expect("narrow");
    let (o, l) = flash_fwd(
        &qb,
        &k,
        &v,
        &spec.with_positions(Positions::range(130, 70), spec.k_pos.clone()),
    )
    .expect("fwd block");
    assert!(rel(&to_f64(&o), &to_f64(&o1.narrow(1, 130, 70).expect("n"))) <= TOL);
    assert!(rel(&to_f64(&l), &to_f64(&l1.narrow(2, 130, 70).expect("n"))) <= TOL);
}

#[test]
fn strided_inputs_match_contiguous() {
    // Same values laid out as (b, h, s, d) transposed to (b, s, h, d), and with a strided head
    // dim, for f32 (read in place) and bf16 (converted while packing).
    for dtype in [DType::F32, DType::BF16] {
        let spec = AttnSpec::dense(0.125, MaskKind::Causal, 70, 70);
        let case = Case::new(2, 70, 70, 4, 2, 64, spec.clone()).dtype(dtype);
        let [q, k, v, dout] = case.tensors();
        let (o1, l1) = flash_fwd(&q, &k, &v, &spec).expect("fwd");
        let (dq1, dk1, dv1) = flash_bwd_f32(&q, &k, &v, &o1, &l1, &dout, &spec).expect("bwd");
        let perm = |t: &Tensor| {
            t.transpose(1, 2)
                .and_then(|t| t.contiguous())
                .and_then(|t| t.transpose(1, 2))
                .expect("perm")
        };
        // Head dim with stride 2: take every other column of a doubled tensor.
        let spread = |t: &Tensor| {
            Tensor::cat(&[t, t], 3)
                .and_then(|x| x.reshape((t.dims()[0], t.dims()[1], t.dims()[2], 2, 64)))
                .and_then(|x| x.transpose(3, 4))
                .and_then(|x| x.contiguous())
                .and_then(|x| x.narrow(4, 0, 1))
                .and_then(|x| x.squeeze(4))
                .expect("spread")
        };
        for (name, f) in [
            ("transposed", &perm as &dyn Fn(&Tensor) -> Tensor),
            ("strided d", &spread),
        ] {
            let (q2, k2, v2, d2) = (f(&q), f(&k), f(&v), f(&dout));
            assert!(!q2.is_contiguous(), "{name}: test layout must be strided");
            let (o2, l2) = flash_fwd(&q2, &k2, &v2, &spec).expect("fwd");
            let (dq2, dk2, dv2) =
                flash_bwd_f32(&q2, &k2, &v2, &f(&o1), &l2, &d2, &spec).expect("bwd");
            for (a, b) in [
                (&o2, &o1),
                (&l2, &l1),
                (&dq2, &dq1),
                (&dk2, &dk1),
                (&dv2, &dv1),
            ] {
                assert!(rel(&to_f64(a), &to_f64(b)) <= 1e-6, "{name} {dtype:?}");
            }
        }
    }
}
