//! The dense product (`flash_ring::matmul`, `flash_ring::cpu::gemm`) against float64: every
//! shape class and layout on every available instruction set, the accuracy that short
//! accumulation chains buy on sums of one sign, bit-reproducibility across thread counts, and
//! the candle op (dtypes, strides, errors, gradients).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::cpu::gemm::{gemm, Mat};
use flash_ring::{Isa, KernelConfig};

/// Checks `gemm` on A `(m, k)` and B `(k, n)` in the given layouts against float64: every
/// element within `(KC + ceil(k / KC) + 2) u sum_t |a_t b_t|`, the worst-case bound of its
/// summation (a chain of at most KC products, then at most ceil(k / KC) chain sums).
fn check_gemm(isa: Isa, m: usize, k: usize, n: usize, a_cm: bool, b_cm: bool, seed: u64) {
    let mut r = common::rng(seed);
    let mut gen = || common::randv(&mut r, 1)[0];
    let (ad, ars, acs) = common::store(m, k, a_cm, 3, f32::NAN, &mut gen);
    let (bd, brs, bcs) = common::store(k, n, b_cm, 5, f32::NAN, &mut gen);
    let a = Mat {
        data: &ad[3..],
        rows: m,
        cols: k,
        rs: ars,
        cs: acs,
    };
    let b = Mat {
        data: &bd[5..],
        rows: k,
        cols: n,
        rs: brs,
        cs: bcs,
    };
    let c = gemm(isa, a, b);
    assert_eq!(c.len(), m * n);
    for i in 0..m {
        for j in 0..n {
            let (exact, bound) = common::exact_dot(
                k,
                |t| a.data[i * ars + t * acs] as f64,
                |t| b.data[t * brs + j * bcs] as f64,
            );
            let err = (c[i * n + j] as f64 - exact).abs();
            assert!(
                err <= bound,
                "{isa:?} m={m} k={k} n={n} a_cm={a_cm} b_cm={b_cm} ({i}, {j}): {} vs {exact}",
                c[i * n + j]
            );
        }
    }
}

#[test]
fn gemm_matches_f64_for_every_shape_layout_and_isa() {
    // The shared shapes and a depth past two super-chunks.
    let shapes = common::GEMM_SHAPES.iter().copied().chain([(4, 2100, 17)]);
    for isa in flash_ring::cpu::available() {
        for (i, (m, k, n)) in shapes.clone().enumerate() {
            for (a_cm, b_cm) in common::LAYOUTS {
                check_gemm(isa, m, k, n, a_cm, b_cm, i as u64);
            }
        }
    }
}

/// A wide B (many column blocks: each task packs its own columns) and a tall A.
#[test]
fn gemm_matches_f64_for_wide_and_tall_products() {
    for isa in flash_ring::cpu::available() {
        check_gemm(isa, 40, 96, 4100, false, true, 1);
        check_gemm(isa, 700, 40, 24, false, false, 2);
    }
}

/// Few rows against a weight's transpose (decoding one token, short sequences: the unpacked
/// dot-product path), with depths over several of its blocks, and the same bits on every ISA.
#[test]
fn few_row_products_match_f64_and_every_isa() {
    for &(m, k, n) in &[(1, 3000, 700), (5, 1030, 67), (32, 2048, 33), (33, 100, 40)] {
        let mut results = Vec::new();
        for isa in flash_ring::cpu::available() {
            check_gemm(isa, m, k, n, false, true, 4);
            check_gemm(isa, m, k, n, true, true, 5);
            let mut r = common::rng(6);
            let a = common::randv(&mut r, m * k);
            let w = common::randv(&mut r, n * k);
            let c = gemm(isa, Mat::row_major(&a, m, k), Mat::col_major(&w, k, n));
            results.push(c.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        if m <= 32 {
            assert!(
                results.windows(2).all(|w| w[0] == w[1]),
                "({m}, {k}, {n}): ISAs differ"
            );
        }
    }
}

/// Sums of 4096 positive products (the kind that builds a transformer's large activations):
/// short chains lose at most a third of what one running sum per output loses (measured:
/// 6.5e-7 against 2.8e-6).
#[test]
fn short_chains_beat_one_long_chain_on_same_sign_sums() {
    let (m, k, n) = (8, 4096, 64);
    let mut r = common::rng(3);
    let a: Vec<f32> = common::randv(&mut r, m * k)
        .iter()
        .map(|x| 1.0 + 0.5 * x)
        .collect();
    let b: Vec<f32> = common::randv(&mut r, k * n)
        .iter()
        .map(|x| 1.0 + 0.5 * x)
        .collect();
    let (mut worst_chain, mut worst_long) = (0.0f64, 0.0f64);
    for isa in flash_ring::cpu::available() {
        let c = gemm(isa, Mat::row_major(&a, m, k), Mat::row_major(&b, k, n));
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut long) = (0.0f64, 0.0f32);
                for t in 0..k {
                    let (x, y) = (a[i * k + t], b[t * n + j]);
                    exact += x as f64 * y as f64;
                    long = x.mul_add(y, long);
                }
                let (e_chain, e_long) = (
                    (c[i * n + j] as f64 - exact).abs() / exact,
                    (long as f64 - exact).abs() / exact,
                );
                worst_chain = testkit::max_or_nan(worst_chain, e_chain);
                worst_long = testkit::max_or_nan(worst_long, e_long);
            }
        }
    }
    assert!(
        worst_chain <= worst_long / 3.0,
        "short chains {worst_chain:.2e} vs one running sum {worst_long:.2e}"
    );
    assert!(worst_chain <= 64.0 * common::U, "{worst_chain:.2e}");
}

/// A weight's transpose against a short sequence is computed as `(W A^T)^T` (packing A, not
/// W): the same bits as the direct product of a row-major copy of B, and within the bound.
#[test]
fn transposed_weight_products_take_the_swapped_path_with_the_same_bits() {
    let (m, k, n) = (40, 400, 2000);
    let mut r = common::rng(8);
    let a = common::randv(&mut r, m * k);
    let w = common::randv(&mut r, n * k);
    let mut b = vec![0.0f32; k * n];
    for j in 0..n {
        for t in 0..k {
            b[t * n + j] = w[j * k + t];
        }
    }
    for isa in flash_ring::cpu::available() {
        check_gemm(isa, m, k, n, false, true, 9);
        let am = Mat::row_major(&a, m, k);
        let swapped = gemm(isa, am, Mat::col_major(&w, k, n));
        let direct = gemm(isa, am, Mat::row_major(&b, k, n));
        assert!(
            swapped
                .iter()
                .zip(&direct)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{isa:?}: swapped and direct products differ"
        );
    }
}

/// A column-major A (a weight's gradient `grad^T @ x`) is read in place by the blocked
/// product's kernels, a row-major one too: the same products in the same order, so the same
/// bits, on every instruction set; also through the swapped path (a few rows against W^T) and
/// the few-rows one (which copy A to rows first).
#[test]
fn column_major_a_gives_the_bits_of_row_major_a() {
    for (i, &(m, k, n, b_cm)) in [
        (97, 130, 300, false),
        (1030, 1100, 70, false),
        (40, 400, 2000, true),
        (5, 300, 48, true),
    ]
    .iter()
    .enumerate()
    {
        let mut r = common::rng(40 + i as u64);
        let cm = common::randv(&mut r, m * k);
        let rm: Vec<f32> = (0..m * k).map(|e| cm[(e % k) * m + e / k]).collect();
        let b = common::randv(&mut r, k * n);
        let bm = if b_cm {
            Mat::col_major(&b, k, n)
        } else {
            Mat::row_major(&b, k, n)
        };
        for isa in flash_ring::cpu::available() {
            let got = gemm(isa, Mat::col_major(&cm, m, k), bm);
            let want = gemm(isa, Mat::row_major(&rm, m, k), bm);
            let same = got
                .iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{isa:?} m={m} k={k} n={n}: column-major A changed the result"
            );
        }
    }
}

#[test]
fn gemm_results_do_not_depend_on_the_thread_count() {
    let (m, k, n) = (150, 1500, 70);
    let mut r = common::rng(9);
    let a = common::randv(&mut r, m * k);
    let b = common::randv(&mut r, n * k);
    common::assert_same_bits_on(&[2, 3, 5], || {
        gemm(
            flash_ring::cpu::available()[0],
            Mat::row_major(&a, m, k),
            Mat::col_major(&b, k, n),
        )
    });
}

fn t2(v: Vec<f32>, r: usize, c: usize) -> Tensor {
    Tensor::from_vec(v, (r, c), &Device::Cpu).expect("tensor")
}

#[test]
fn matmul_op_matches_candle_for_dtypes_and_strides() {
    let mut r = common::rng(4);
    let a = t2(common::randv(&mut r, 37 * 70), 37, 70);
    let w = t2(common::randv(&mut r, 50 * 70), 50, 70);
    // x @ w^T with a transposed view, and a narrowed (offset, strided) left operand.
    let cases = [
        (a.clone(), w.t().expect("t")),
        (
            a.narrow(1, 3, 60).expect("narrow"),
            w.narrow(1, 5, 60).expect("narrow").t().expect("t"),
        ),
        (a.t().expect("t"), a.clone()),
    ];
    for (x, y) in &cases {
        let want = common::to_f64(&x.matmul(y).expect("candle"));
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let (xd, yd) = (x.to_dtype(dt).expect("dt"), y.to_dtype(dt).expect("dt"));
            let got = flash_ring::matmul(&xd, &yd).expect("matmul");
            assert_eq!(got.dtype(), dt);
            assert_eq!(got.dims(), &[x.dim(0).unwrap(), y.dim(1).unwrap()]);
            // f32: rounding only; bf16/f16: the inputs' own rounding dominates.
            let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
            let e = common::rel(&common::to_f64(&got), &want);
            assert!(e <= tol, "{dt:?} {:?}: {e}", x.dims());
        }
        for isa in flash_ring::cpu::available() {
            let cfg = KernelConfig {
                isa: Some(isa),
                ..KernelConfig::default()
            };
            let got = flash_ring::matmul_with_config(x, y, &cfg).expect("matmul");
            assert!(common::rel(&common::to_f64(&got), &want) <= 1e-5, "{isa:?}");
        }
    }
}

#[test]
fn matmul_op_rejects_bad_arguments() {
    let a = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).expect("zeros");
    let b = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).expect("zeros");
    let e = flash_ring::matmul(&a, &b).expect_err("inner dims");
    assert!(e.to_string().contains("b: shape [5, 2]"), "{e}");
    let v = Tensor::zeros(4, DType::F32, &Device::Cpu).expect("zeros");
    let e = flash_ring::matmul(&a, &v).expect_err("rank");
    assert!(e.to_string().contains("expected rank 2"), "{e}");
    let h = Tensor::zeros((4, 2), DType::BF16, &Device::Cpu).expect("zeros");
    let e = flash_ring::matmul(&a, &h).expect_err("dtype");
    assert!(e.to_string().contains("dtype"), "{e}");
    let i = Tensor::zeros((3, 4), DType::U32, &Device::Cpu).expect("zeros");
    let j = Tensor::zeros((4, 2), DType::U32, &Device::Cpu).expect("zeros");
    assert!(flash_ring::matmul(&i, &j).is_err());
    // Empty products are fine.
    let z = flash_ring::matmul(
        &Tensor::zeros((0, 4), DType::F32, &Device::Cpu).expect("zeros"),
        &Tensor::zeros((4, 2), DType::F32, &Device::Cpu).expect("zeros"),
    )
    .expect("empty");
    assert_eq!(z.dims(), &[0, 2]);
}

/// `y = a @ w^T`: `a`'s gradient `g @ w` is flash-ring's product again (the same bits as
/// calling it), `w`'s gradient `(a^T @ g)^T` is candle's matmul (the same bits as candle's own
/// backward).
#[test]
fn matmul_op_gradients_are_flash_ring_for_the_input_and_candle_for_the_weight() {
    let mut r = common::rng(5);
    let (m, k, n) = (9, 20, 150);
    let a = Var::from_tensor(&t2(common::randv(&mut r, m * k), m, k)).expect("var");
    let w = Var::from_tensor(&t2(common::randv(&mut r, n * k), n, k)).expect("var");
    let g = t2(common::randv(&mut r, m * n), m, n);
    let ours = flash_ring::matmul(a.as_tensor(), &w.as_tensor().t().expect("t")).expect("matmul");
    let theirs = a
        .as_tensor()
        .matmul(&w.as_tensor().t().expect("t"))
        .expect("matmul");
    let go = (ours * &g)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("bwd");
    let gt = (theirs * &g)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("bwd");
    let da = common::to_f64(go.get(a.as_tensor()).expect("grad"));
    let want_da = flash_ring::matmul(&g, w.as_tensor()).expect("g @ w");
    assert_eq!(da, common::to_f64(&want_da), "input gradient");
    let dw = common::to_f64(go.get(w.as_tensor()).expect("grad"));
    assert_eq!(
        dw,
        common::to_f64(gt.get(w.as_tensor()).expect("grad")),
        "weight gradient"
    );
}

/// The input's gradient sums over the layer's outputs (an LM head's vocabulary): with
/// same-sign terms its short chains stay accurate where one long chain drifts.
#[test]
fn input_gradient_of_a_wide_layer_keeps_the_short_chains_accuracy() {
    let (m, k, n) = (4, 16, 8192);
    let mut r = common::rng(9);
    let pos = |v: Vec<f32>| v.iter().map(|x| 1.0 + 0.5 * x).collect::<Vec<f32>>();
    let a = Var::from_tensor(&t2(pos(common::randv(&mut r, m * k)), m, k)).expect("var");
    let wv = pos(common::randv(&mut r, n * k));
    let gv = pos(common::randv(&mut r, m * n));
    let w = t2(wv.clone(), n, k);
    let g = t2(gv.clone(), m, n);
    let y = flash_ring::matmul(a.as_tensor(), &w.t().expect("t")).expect("matmul");
    let grads = (y * &g)
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("bwd");
    let da = common::to_f64(grads.get(a.as_tensor()).expect("grad"));
    let candle = common::to_f64(&g.matmul(&w).expect("candle g @ w"));
    let (mut worst, mut worst_long, mut worst_candle) = (0.0f64, 0.0f64, 0.0f64);
    for i in 0..m {
        for j in 0..k {
            let (mut exact, mut long) = (0.0f64, 0.0f32);
            for t in 0..n {
                exact += gv[i * n + t] as f64 * wv[t * k + j] as f64;
                long = gv[i * n + t].mul_add(wv[t * k + j], long);
            }
            worst = testkit::max_or_nan(worst, (da[i * k + j] - exact).abs() / exact);
            worst_long = testkit::max_or_nan(worst_long, (long as f64 - exact).abs() / exact);
            worst_candle =
                testkit::max_or_nan(worst_candle, (candle[i * k + j] - exact).abs() / exact);
        }
    }
    // Chains of 64, then sums of 16 chains, then of the super-chunks: 1.2e-7 here; candle's
    // gemm (the backward before, running sums over blocks of 512) 3.0e-7; one chain of 8192
    // same-sign products 3.3e-6 (fixed seed: these are the same numbers every run).
    assert!(
        worst < 2e-7,
        "input gradient's worst relative error {worst:e}"
    );
    assert!(
        worst * 2.0 < worst_candle,
        "{worst:e} vs candle's matmul {worst_candle:e}"
    );
    assert!(
        worst * 10.0 < worst_long,
        "{worst:e} vs one long chain {worst_long:e}"
    );
}

/// `matmul_nt(a, w)` is `matmul(a, w.t())`: the same output bits and input gradient bits, and
/// `w`'s gradient `grad^T @ a` (the same sums of the same products) within rounding of float64,
/// handed back contiguous in `w`'s own `(n, k)` layout (through `w.t()` it came back as a
/// transposed view, which the gradient store then copied). f32, bf16 and f16; shapes with
/// ragged tiles, and one of several row and column blocks.
#[test]
fn matmul_nt_is_matmul_of_the_transposed_weight_with_the_weight_gradient_in_its_layout() {
    let mut r = common::rng(21);
    for (m, k, n) in [(37, 70, 50), (300, 96, 520)] {
        let a32 = t2(common::randv(&mut r, m * k), m, k);
        let w32 = t2(common::randv(&mut r, n * k), n, k);
        let g32 = t2(common::randv(&mut r, m * n), m, n);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let [a, w, g] = [&a32, &w32, &g32].map(|t| t.to_dtype(dt).expect("dtype"));
            let grads = |y: Tensor, a: &Var, w: &Var| grads_of(&y, &g, a, w);
            let (av, wv) = (
                Var::from_tensor(&a).expect("var"),
                Var::from_tensor(&w).expect("var"),
            );
            let y = flash_ring::matmul_nt(av.as_tensor(), wv.as_tensor()).expect("matmul_nt");
            let want_y =
                flash_ring::matmul(&a, &w.t().expect("t")).expect("matmul of the transposed view");
            assert_eq!(y.dims(), &[m, n]);
            assert_eq!(y.dtype(), dt);
            assert_eq!(
                common::to_f64(&y),
                common::to_f64(&want_y),
                "{dt:?} {m}x{k}x{n}: output"
            );
            let (da, dw) = grads(y, &av, &wv);
            let (bv, xv) = (
                Var::from_tensor(&a).expect("var"),
                Var::from_tensor(&w).expect("var"),
            );
            let y2 = flash_ring::matmul(bv.as_tensor(), &xv.as_tensor().t().expect("t"))
                .expect("matmul");
            let (want_da, _) = grads(y2, &bv, &xv);
            assert_eq!(
                common::to_f64(&da),
                common::to_f64(&want_da),
                "{dt:?}: input gradient"
            );
            assert_eq!(dw.dims(), &[n, k], "{dt:?}");
            assert!(
                dw.is_contiguous(),
                "{dt:?}: weight gradient {:?}",
                dw.stride()
            );
            // Against float64 of the rounded operands: f32 to its rounding, the half types to
            // the rounding of their result.
            let (gd, ad) = (common::to_f64(&g), common::to_f64(&a));
            let want: Vec<f64> = (0..n * k)
                .map(|e| (0..m).map(|t| gd[t * n + e / k] * ad[t * k + e % k]).sum())
                .collect();
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            let err = common::rel(&common::to_f64(&dw), &want);
            assert!(err <= tol, "{dt:?} {m}x{k}x{n}: weight gradient {err}");
        }
    }
    // A weight whose width is not the input's is an error naming it.
    let a = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).expect("zeros");
    let w = Tensor::zeros((5, 3), DType::F32, &Device::Cpu).expect("zeros");
    let e = flash_ring::matmul_nt(&a, &w).expect_err("widths");
    assert!(
        e.to_string().contains("b: shape [5, 3]") && e.to_string().contains("(n, 4)"),
        "{e}"
    );
}

/// `matmul_to_f32`'s result is f32 for bf16 inputs, and the gradients flowing back are the
/// inputs' dtype (the backward's products round to it, as `matmul`'s do): the same bits as
/// `matmul`'s gradients for the same upstream gradient.
#[test]
fn matmul_to_f32_gradients_come_back_in_the_inputs_dtype() {
    let mut r = common::rng(23);
    let (m, k, n) = (40, 48, 72);
    let a = t2(common::randv(&mut r, m * k), m, k)
        .to_dtype(DType::BF16)
        .expect("bf16");
    let w = t2(common::randv(&mut r, n * k), n, k)
        .to_dtype(DType::BF16)
        .expect("bf16");
    let g = t2(common::randv(&mut r, m * n), m, n);
    let grads = |to_f32: bool| {
        let (av, wv) = (
            Var::from_tensor(&a).expect("var"),
            Var::from_tensor(&w).expect("var"),
        );
        let wt = wv.as_tensor().t().expect("t");
        let y = if to_f32 {
            flash_ring::matmul_to_f32(av.as_tensor(), &wt).expect("matmul_to_f32")
        } else {
            flash_ring::matmul(av.as_tensor(), &wt)
                .expect("matmul")
                .to_dtype(DType::F32)
                .expect("f32")
        };
        assert_eq!(y.dtype(), DType::F32);
        grads_of(&y, &g, &av, &wv)
    };
    let (da, dw) = grads(true);
    let (want_da, want_dw) = grads(false);
    for (got, want, what) in [(&da, &want_da, "input"), (&dw, &want_dw, "weight")] {
        assert_eq!(got.dtype(), DType::BF16, "{what} gradient");
        assert_eq!(common::to_f64(got), common::to_f64(want), "{what} gradient");
    }
}

/// The gradients of `sum(y · g)` (in f32) with respect to `a` and `w`.
fn grads_of(y: &Tensor, g: &Tensor, a: &Var, w: &Var) -> (Tensor, Tensor) {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
    let gs = (f32(y) * f32(g))
        .expect("mul")
        .sum_all()
        .expect("sum")
        .backward()
        .expect("backward");
    let da = gs.get(a.as_tensor()).expect("grad a").clone();
    let dw = gs.get(w.as_tensor()).expect("grad w").clone();
    (da, dw)
}
