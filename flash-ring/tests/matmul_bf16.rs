//! bf16 products on the CPU's bf16 dot products (`flash_ring::cpu::gemm_bf16`, AVX512-BF16)
//! against the f32 computation of the same bf16 inputs and against float64, and the bf16
//! candle op (forward and gradients) on every instruction set of this machine: the dot
//! products under `Isa::Avx512` where the CPU has AVX512-BF16, widening to f32 elsewhere.
//!
//! The kernel tests need a CPU with AVX512-BF16; on one without, they print a `SKIPPED:` line
//! (which CI counts) after checking that the kernel is reported absent, and the op still gives
//! the widened result (the tests of the op run on every machine).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::cpu::gemm::{gemm, Mat};
use flash_ring::cpu::gemm_bf16::{available, gemm_bf16, narrow_to_bf16, CHAIN};
use flash_ring::KernelConfig;
use half::bf16;

/// Reports a kernel test that cannot run here (a visible `SKIPPED:` line that CI counts).
fn skip(test: &str) {
    testkit::skip(
        &format!("flash-ring/matmul_bf16::{test}"),
        "no AVX512-BF16 on this CPU",
    );
}

/// A `rows x cols` bf16 matrix of random values (see `common::store`).
fn store(
    rows: usize,
    cols: usize,
    col_major: bool,
    pad: usize,
    r: &mut rand::rngs::StdRng,
) -> (Vec<bf16>, usize, usize) {
    common::store(rows, cols, col_major, pad, bf16::NAN, || {
        bf16::from_f32(common::randv(r, 1)[0])
    })
}

fn mat<T>(data: &[T], rows: usize, cols: usize, rs: usize, cs: usize) -> Mat<'_, T> {
    Mat {
        data,
        rows,
        cols,
        rs,
        cs,
    }
}

/// `gemm_bf16` on A `(m, k)` and B `(k, n)` in the given layouts, against float64 (every element
/// within `(KC + ceil(k / KC) + 2) u sum_t |a_t b_t|`: the products of bf16 numbers are exact,
/// so only the sums round, in chains as long as the f32 product's) and against the f32 product
/// of the same inputs widened (within twice that bound).
fn check(m: usize, k: usize, n: usize, a_cm: bool, b_cm: bool, seed: u64) {
    let mut r = common::rng(seed);
    let (ad, ars, acs) = store(m, k, a_cm, 3, &mut r);
    let (bd, brs, bcs) = store(k, n, b_cm, 5, &mut r);
    let c = gemm_bf16(mat(&ad[3..], m, k, ars, acs), mat(&bd[5..], k, n, brs, bcs));
    assert_eq!(c.len(), m * n);
    let (af, bf): (Vec<f32>, Vec<f32>) = (
        ad.iter().map(|x| x.to_f32()).collect(),
        bd.iter().map(|x| x.to_f32()).collect(),
    );
    let wide = gemm(
        flash_ring::cpu::Isa::Portable,
        mat(&af[3..], m, k, ars, acs),
        mat(&bf[5..], k, n, brs, bcs),
    );
    for i in 0..m {
        for j in 0..n {
            let (exact, bound) = common::exact_dot_chains(
                k,
                CHAIN,
                |t| af[3 + i * ars + t * acs] as f64,
                |t| bf[5 + t * brs + j * bcs] as f64,
            );
            let (got, f32_got) = (c[i * n + j] as f64, wide[i * n + j] as f64);
            let at = format!("m={m} k={k} n={n} a_cm={a_cm} b_cm={b_cm} ({i}, {j})");
            assert!((got - exact).abs() <= bound, "{at}: {got} vs {exact}");
            assert!(
                (got - f32_got).abs() <= 2.0 * bound,
                "{at}: {got} vs f32 {f32_got}"
            );
        }
    }
}

#[test]
fn bf16_dot_products_match_the_f32_product_of_the_same_inputs() {
    if !available() {
        #[cfg(target_arch = "x86_64")]
        assert!(!std::arch::is_x86_feature_detected!("avx512bf16"));
        return skip("bf16_dot_products_match_the_f32_product_of_the_same_inputs");
    }
    // The shared shapes (odd depths: padded pairs; row counts off the kernel's 8; the swapped
    // path, few rows against W^T), an odd depth past two super-chunks and a wide B (packed per
    // column block).
    let shapes = common::GEMM_SHAPES
        .iter()
        .copied()
        .chain([(4, 2101, 17), (40, 96, 4100)]);
    for (i, (m, k, n)) in shapes.enumerate() {
        for (a_cm, b_cm) in common::LAYOUTS {
            check(m, k, n, a_cm, b_cm, i as u64);
        }
    }
}

/// A column-major A (a weight's gradient `grad^T @ x`) is packed in groups of 8 rows, a
/// row-major one read in place: the same products in the same chains, so the same bits. The
/// shapes cover a last group of fewer than 8 rows, an odd count of groups, odd depths (a zero
/// second half of the last pair), several packing tasks of several groups, a wide B and depths
/// past one super-chunk.
#[test]
fn bf16_column_major_a_gives_the_bits_of_row_major_a() {
    if !available() {
        return skip("bf16_column_major_a_gives_the_bits_of_row_major_a");
    }
    for (i, &(m, k, n)) in [
        (3, 4, 16),
        (13, 7, 20),
        (200, 130, 50),
        (4099, 33, 40),
        (1030, 1100, 300),
    ]
    .iter()
    .enumerate()
    {
        let mut r = common::rng(30 + i as u64);
        let (cm, _, ld) = store(m, k, true, 0, &mut r);
        let rm: Vec<bf16> = (0..m * k).map(|e| cm[(e % k) * ld + e / k]).collect();
        let (b, _, _) = store(k, n, false, 0, &mut r);
        let got = gemm_bf16(mat(&cm, m, k, 1, ld), Mat::row_major(&b, k, n));
        let want = gemm_bf16(Mat::row_major(&rm, m, k), Mat::row_major(&b, k, n));
        let same = got
            .iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "m={m} k={k} n={n}: column-major A changed the result");
    }
}

#[test]
fn bf16_dot_products_read_any_strides() {
    if !available() {
        return skip("bf16_dot_products_read_any_strides");
    }
    // Every other element of a row-major matrix: neither stride is 1 (A is copied into rows
    // of pairs, B packed element by element).
    let (m, k, n) = (21, 67, 45);
    let mut r = common::rng(12);
    let (ad, _, _) = store(m, 2 * k, false, 0, &mut r);
    let (bd, _, _) = store(k, 2 * n, false, 0, &mut r);
    let c = gemm_bf16(mat(&ad, m, k, 2 * k, 2), mat(&bd, k, n, 2 * n, 2));
    for i in 0..m {
        for j in 0..n {
            let (exact, bound) = common::exact_dot_chains(
                k,
                CHAIN,
                |t| ad[i * 2 * k + 2 * t].to_f64(),
                |t| bd[t * 2 * n + 2 * j].to_f64(),
            );
            let got = c[i * n + j] as f64;
            assert!((got - exact).abs() <= bound, "({i}, {j}): {got} vs {exact}");
        }
    }
}

#[test]
fn bf16_dot_products_do_not_depend_on_the_thread_count() {
    if !available() {
        return skip("bf16_dot_products_do_not_depend_on_the_thread_count");
    }
    let (m, k, n) = (150, 1500, 70);
    let mut r = common::rng(9);
    let (a, _, _) = store(m, k, false, 0, &mut r);
    let (b, _, _) = store(k, n, true, 0, &mut r);
    common::assert_same_bits_on(&[2, 3], || {
        gemm_bf16(Mat::row_major(&a, m, k), Mat::col_major(&b, k, n))
    });
}

#[test]
fn bf16_dot_products_propagate_nan_and_inf() {
    if !available() {
        return skip("bf16_dot_products_propagate_nan_and_inf");
    }
    let (m, k, n) = (9, 70, 40);
    let mut r = common::rng(11);
    let (mut a, _, _) = store(m, k, false, 0, &mut r);
    let (b, _, _) = store(k, n, false, 0, &mut r);
    a[2 * k + 5] = bf16::NAN;
    a[6 * k + 69] = bf16::INFINITY;
    let c = gemm_bf16(Mat::row_major(&a, m, k), Mat::row_major(&b, k, n));
    for i in 0..m {
        for j in 0..n {
            let x = c[i * n + j];
            match i {
                2 => assert!(x.is_nan(), "row 2 col {j}: {x}"),
                6 => assert!(x.is_infinite() || x.is_nan(), "row 6 col {j}: {x}"),
                _ => assert!(x.is_finite(), "row {i} col {j}: {x}"),
            }
        }
    }
}

fn t2(v: Vec<f32>, r: usize, c: usize) -> Tensor {
    Tensor::from_vec(v, (r, c), &Device::Cpu).expect("tensor")
}

/// Relative distance of each element of `got` (bf16) from `want` (the f32 computation),
/// scaled by the largest `|want|` of the tensor: within 2^-8 (one rounding to bf16) plus the
/// f32 sums' difference.
fn close_to_bf16_of(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dtype(), DType::BF16);
    common::rel(&common::to_f64(got), &common::to_f64(want))
}

/// A linear layer's product `y = x w^T` on bf16 `x (m, k)` and `w (n, k)`, and its f32
/// reference: the same (bf16-rounded) numbers multiplied in f32, with the gradients of
/// `sum(y * g)` (`g` rounded to bf16 too, applied in f32 as training's loss does).
struct LinearCase {
    x: Tensor,
    w: Tensor,
    g: Tensor,
    y: Tensor,
    grads: [Tensor; 2],
}

impl LinearCase {
    fn new(seed: u64, m: usize, k: usize, n: usize) -> Self {
        let mut r = common::rng(seed);
        let mut bf = |rows, cols| {
            t2(common::randv(&mut r, rows * cols), rows, cols)
                .to_dtype(DType::BF16)
                .expect("bf16")
        };
        let (x, w, g) = (bf(m, k), bf(n, k), bf(m, n));
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).expect("f32");
        let (xf, wf) = (
            Var::from_tensor(&f32_of(&x)).expect("var"),
            Var::from_tensor(&f32_of(&w)).expect("var"),
        );
        let g = f32_of(&g);
        let y = xf
            .as_tensor()
            .matmul(&wf.as_tensor().t().expect("t"))
            .expect("mm");
        let grads = (&y * &g)
            .and_then(|p| p.sum_all())
            .and_then(|s| s.backward())
            .expect("f32 backward");
        let grads = [&xf, &wf].map(|v| grads.get(v.as_tensor()).expect("f32 grad").clone());
        Self { x, w, g, y, grads }
    }

    /// `product(x, w^T)` on variables of the bf16 inputs, and the gradients of `sum(y * g)`
    /// (the product's result taken to f32 first) against each of x and w.
    fn run(&self, product: impl Fn(&Tensor, &Tensor) -> Tensor) -> (Tensor, [Tensor; 2]) {
        let (xv, wv) = (
            Var::from_tensor(&self.x).expect("var"),
            Var::from_tensor(&self.w).expect("var"),
        );
        let y = product(xv.as_tensor(), &wv.as_tensor().t().expect("t"));
        let grads = (y.to_dtype(DType::F32).expect("f32") * &self.g)
            .and_then(|p| p.sum_all())
            .and_then(|s| s.backward())
            .expect("backward");
        let got = [&xv, &wv].map(|v| grads.get(v.as_tensor()).expect("grad").clone());
        (y, got)
    }

    /// Asserts that bf16 gradients follow the f32 ones within 4e-3 (one rounding of the
    /// upstream gradient and one of the result).
    fn assert_grads(&self, got: &[Tensor; 2], what: &str) {
        for (name, (g, want)) in ["x", "w"].iter().zip(got.iter().zip(&self.grads)) {
            let e = close_to_bf16_of(g, want);
            assert!(e <= 4e-3, "{what} grad {name}: {e}");
        }
    }
}

#[test]
fn bf16_op_forward_and_gradients_follow_the_f32_computation_on_every_isa() {
    let case = LinearCase::new(4, 300, 130, 90);
    for isa in flash_ring::cpu::available() {
        // The dot products wherever the CPU has them (`Auto` widens on Intel's CPUs).
        let cfg = KernelConfig {
            isa: Some(isa),
            ..common::kernels()
        };
        let (y, grads) =
            case.run(|x, wt| flash_ring::matmul_with_config(x, wt, &cfg).expect("matmul"));
        let e = close_to_bf16_of(&y, &case.y);
        assert!(e <= 4e-3, "{isa:?} forward: {e}");
        case.assert_grads(&grads, &format!("{isa:?}"));
    }
}

/// `matmul_to_f32` of bf16 inputs: an f32 result, the f32 sums of the same products as the f32
/// computation (1e-5 relative: both sum exact products in f32 chains, in other orders), and
/// bf16 gradients that follow the f32 ones as the bf16 op's do.
#[test]
fn f32_output_product_keeps_the_sums_and_its_gradients_follow_f32() {
    let case = LinearCase::new(5, 200, 130, 70);
    let (y, grads) = case.run(|x, wt| flash_ring::matmul_to_f32(x, wt).expect("matmul_to_f32"));
    assert_eq!(y.dtype(), DType::F32);
    let e = common::rel(&common::to_f64(&y), &common::to_f64(&case.y));
    assert!(e <= 1e-5, "forward: {e}");
    case.assert_grads(&grads, "matmul_to_f32");
}

#[test]
fn narrowing_to_bf16_rounds_as_half_does() {
    let mut r = common::rng(13);
    let mut src: Vec<f32> = common::randv(&mut r, 1000)
        .into_iter()
        .enumerate()
        .map(|(i, x)| x * 10f32.powi(i as i32 % 60 - 30))
        .collect();
    // Ties (round to even), the largest finite values, infinities, NaN, signed zeros.
    src.extend([
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::MAX,
        -f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        1e-30,
    ]);
    // Every length of the vector loop's tail.
    for len in [src.len(), 17, 16, 15, 1, 0] {
        let mut got = vec![bf16::ZERO; len];
        narrow_to_bf16(&src[..len], &mut got);
        for (g, s) in got.iter().zip(&src) {
            let want = bf16::from_f32(*s);
            if want.is_nan() {
                assert!(g.is_nan(), "{s}");
            } else {
                assert_eq!(g.to_bits(), want.to_bits(), "{s:e}");
            }
        }
    }
}
