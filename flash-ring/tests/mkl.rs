//! Intel MKL's products (`flash_ring::cpu::mkl`, `Gemm::Mkl`): against float64 for every
//! shape class and layout (one f32 chain per output: the bound `(k + 2) u sum |a b|`), bf16
//! products exact before their sums, bit-identical under 1, 2 and 3 threads, the candle op's
//! outputs and gradients against flash-ring's kernels, and the choice's errors.
//!
//! MKL is opened from `FLASH_RING_MKL` (e.g. the `mkl` wheel's `lib/libmkl_rt.so.3`) or the
//! loader's path. Where it does not load, each test prints a visible skip, unless
//! `FLASH_RING_MKL_REQUIRED` is set (as `.ci/run` sets it), which makes that a failure.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::cpu::gemm::Mat;
use flash_ring::cpu::mkl::{self, Mkl};
use flash_ring::{Gemm, KernelConfig};
use half::bf16;

/// The loaded MKL, or `None` after printing a skip (a failure under `FLASH_RING_MKL_REQUIRED`).
fn mkl_or_skip(test: &str) -> Option<&'static Mkl> {
    match mkl::mkl() {
        Ok(lib) => Some(lib),
        Err(e) => {
            assert!(
                std::env::var_os("FLASH_RING_MKL_REQUIRED").is_none(),
                "FLASH_RING_MKL_REQUIRED is set but MKL did not load: {e}"
            );
            testkit::skip(test, &format!("MKL did not load: {e}"));
            None
        }
    }
}

/// Every element of `c = a b` within `(k + 2) u sum_t |a_t b_t|` of the float64 sum (a single
/// f32 chain over the depth, then nothing else).
fn check_against_f64<T: Copy>(a: &Mat<T>, b: &Mat<T>, c: &[f32], to_f64: fn(T) -> f64, what: &str) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(c.len(), m * n, "{what}: result length");
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut mag) = (0.0f64, 0.0f64);
            for t in 0..k {
                let p = to_f64(a.data[i * a.rs + t * a.cs]) * to_f64(b.data[t * b.rs + j * b.cs]);
                exact += p;
                mag += p.abs();
            }
            let bound = (k + 2) as f64 * common::U * mag;
            let got = c[i * n + j] as f64;
            assert!(
                (got - exact).abs() <= bound,
                "{what} m={m} k={k} n={n} ({i}, {j}): {got} vs {exact} (bound {bound:.3e})"
            );
        }
    }
}

/// The shared shapes, a depth past one chunk of flash-ring's kernels, and shapes past one MKL
/// tile in rows and in columns.
fn shapes() -> Vec<(usize, usize, usize)> {
    let mut s = common::GEMM_SHAPES.to_vec();
    s.extend([
        (4, 2100, 17),
        (mkl::TILE_ROWS + 37, 33, 40),
        (3, 20, mkl::TILE_COLS + 50),
    ]);
    s
}

/// A `rows x cols` operand in one of the layouts: row-major, column-major, or every other
/// column of a wider row-major matrix (no unit stride: MKL gets a copy).
fn operand<T: Copy>(
    rows: usize,
    cols: usize,
    layout: usize,
    filler: T,
    f: &mut impl FnMut() -> T,
) -> (Vec<T>, usize, usize) {
    match layout {
        0 | 1 => common::store(rows, cols, layout == 1, 0, filler, f),
        _ => {
            let mut data = vec![filler; rows * cols * 2];
            for r in 0..rows {
                for c in 0..cols {
                    data[r * cols * 2 + c * 2] = f();
                }
            }
            (data, cols * 2, 2)
        }
    }
}

fn check_shapes<T: Copy + mkl::MklElem>(
    lib: &Mkl,
    of_f32: fn(f32) -> T,
    to_f64: fn(T) -> f64,
    what: &str,
) {
    for (i, (m, k, n)) in shapes().into_iter().enumerate() {
        for (la, lb) in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 2)] {
            let mut r = common::rng(i as u64);
            let mut gen = || of_f32(common::randv(&mut r, 1)[0]);
            let (ad, ars, acs) = operand(m, k, la, of_f32(f32::NAN), &mut gen);
            let (bd, brs, bcs) = operand(k, n, lb, of_f32(f32::NAN), &mut gen);
            let a = Mat {
                data: &ad,
                rows: m,
                cols: k,
                rs: ars,
                cs: acs,
            };
            let b = Mat {
                data: &bd,
                rows: k,
                cols: n,
                rs: brs,
                cs: bcs,
            };
            let c = mkl::gemm(lib, a, b).expect("the shapes fit MKL's integers");
            check_against_f64(&a, &b, &c, to_f64, &format!("{what} layouts ({la}, {lb})"));
        }
    }
}

#[test]
fn mkl_f32_products_match_f64_for_every_shape_and_layout() {
    let Some(lib) = mkl_or_skip("flash-ring/mkl::mkl_f32_products_match_f64") else {
        return;
    };
    check_shapes(lib, |x| x, |x| x as f64, "f32");
}

#[test]
fn mkl_bf16_products_are_exact_before_their_f32_sums() {
    let Some(lib) = mkl_or_skip("flash-ring/mkl::mkl_bf16_products_are_exact") else {
        return;
    };
    check_shapes(lib, bf16::from_f32, |x| x.to_f64(), "bf16");
}

#[test]
fn mkl_products_do_not_depend_on_the_thread_count() {
    let Some(lib) = mkl_or_skip("flash-ring/mkl::mkl_products_do_not_depend_on_the_thread_count")
    else {
        return;
    };
    // Several tiles in both directions, a column-major B (a linear layer's W^T).
    let (m, k, n) = (2 * mkl::TILE_ROWS + 5, 300, mkl::TILE_COLS + 70);
    let mut r = common::rng(11);
    let a = common::randv(&mut r, m * k);
    let w = common::randv(&mut r, n * k);
    common::assert_same_bits_on(&[1, 2, 3], || {
        let c = mkl::gemm(lib, Mat::row_major(&a, m, k), Mat::col_major(&w, k, n));
        c.expect("fits")
    });
    let (ab, wb): (Vec<bf16>, Vec<bf16>) = (
        a.iter().map(|&x| bf16::from_f32(x)).collect(),
        w.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    common::assert_same_bits_on(&[1, 2, 3], || {
        let c = mkl::gemm(lib, Mat::row_major(&ab, m, k), Mat::col_major(&wb, k, n));
        c.expect("fits")
    });
}

/// `y = x @ w^T` and its gradients for `sum(y * g)` under `gemm`.
fn linear(x: &Tensor, w: &Tensor, g: &Tensor, gemm: Gemm) -> (Tensor, Tensor, Tensor) {
    let (xv, wv) = (
        Var::from_tensor(x).expect("x"),
        Var::from_tensor(w).expect("w"),
    );
    let cfg = KernelConfig {
        gemm,
        ..KernelConfig::default()
    };
    let y =
        flash_ring::matmul_with_config(xv.as_tensor(), &wv.t().expect("t"), &cfg).expect("matmul");
    let loss = (y.to_dtype(DType::F32).expect("f32") * g)
        .expect("mul")
        .sum_all()
        .expect("sum");
    let grads = loss.backward().expect("backward");
    let dx = grads.get(xv.as_tensor()).expect("x's gradient").clone();
    let dw = grads.get(wv.as_tensor()).expect("w's gradient").clone();
    (y, dx, dw)
}

#[test]
fn mkl_linear_layer_outputs_and_gradients_match_flash_rings_kernels() {
    let Some(_) = mkl_or_skip("flash-ring/mkl::mkl_linear_layer_outputs_and_gradients") else {
        return;
    };
    let dev = Device::Cpu;
    let (m, k, n) = (300, 96, 130);
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev).expect("x");
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev).expect("w");
    let g = Tensor::randn(0f32, 1.0, (m, n), &dev).expect("g");
    // f32: the sums differ in order only (well below 1e-5 of the largest entry at these
    // depths); bf16 outputs and gradients are rounded to bf16, where one summation order can
    // round an element to the neighbouring bf16 number: 2^-8 of it.
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 8e-3), (DType::F16, 2e-3)] {
        let (x, w) = (x.to_dtype(dtype).expect("x"), w.to_dtype(dtype).expect("w"));
        let (y, dx, dw) = linear(&x, &w, &g, Gemm::Mkl);
        let (y0, dx0, dw0) = linear(&x, &w, &g, Gemm::Native);
        for (got, want, what) in [(&y, &y0, "y"), (&dx, &dx0, "dx"), (&dw, &dw0, "dw")] {
            assert_eq!(got.dtype(), dtype, "{what} keeps the inputs' dtype");
            testkit::assert_close(got, want, tol, &format!("{dtype:?} {what}"));
            assert!(testkit::max_abs(got) > 0.0, "{dtype:?} {what} is all zeros");
        }
    }
}

/// Under `Gemm::Mkl` all three products of a linear layer are MKL's: the output, the input's
/// gradient and the weight's gradient equal, bit for bit, `mkl::gemm` of the same operands in
/// the same layouts (f32; bf16 through MKL's bf16 product, rounded to bf16).
#[test]
fn mkl_runs_all_three_products_of_a_linear_layer() {
    let Some(lib) = mkl_or_skip("flash-ring/mkl::mkl_runs_all_three_products_of_a_linear_layer")
    else {
        return;
    };
    let dev = Device::Cpu;
    // The weight's gradient sums over m > 512 rows, where candle's own product (the `gemm`
    // crate) splits its sums in blocks and gives other bits than MKL's.
    let (m, k, n) = (1100, 48, 40);
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev).expect("x");
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev).expect("w");
    let g = Tensor::randn(0f32, 1.0, (m, n), &dev).expect("g");
    let (y, dx, dw) = linear(&x, &w, &g, Gemm::Mkl);
    let v = |t: &Tensor| {
        t.flatten_all()
            .expect("flat")
            .to_vec1::<f32>()
            .expect("f32")
    };
    let (xv, wv, gv) = (v(&x), v(&w), v(&g));
    let same = |got: Vec<f32>, want: Vec<f32>, what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what} is not MKL's product"
        );
    };
    let want = |a: Mat<f32>, b: Mat<f32>| mkl::gemm(lib, a, b).expect("fits");
    same(
        v(&y),
        want(Mat::row_major(&xv, m, k), Mat::col_major(&wv, k, n)),
        "y",
    );
    same(
        v(&dx),
        want(Mat::row_major(&gv, m, n), Mat::row_major(&wv, n, k)),
        "dx",
    );
    same(
        v(&dw.t().expect("t")),
        want(Mat::col_major(&xv, k, m), Mat::row_major(&gv, m, n)),
        "dw",
    );
    // bf16: MKL's bf16 product (exact products, f32 sums), rounded to bf16 once.
    let (xb, wb) = (
        x.to_dtype(DType::BF16).expect("x"),
        w.to_dtype(DType::BF16).expect("w"),
    );
    let (y, _, _) = linear(&xb, &wb, &g, Gemm::Mkl);
    let b = |t: &Tensor| {
        t.flatten_all()
            .expect("flat")
            .to_vec1::<bf16>()
            .expect("bf16")
    };
    let (xbv, wbv) = (b(&xb), b(&wb));
    let c = mkl::gemm(lib, Mat::row_major(&xbv, m, k), Mat::col_major(&wbv, k, n)).expect("fits");
    let rounded: Vec<f32> = c.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    let got: Vec<f32> = b(&y).iter().map(|x| x.to_f32()).collect();
    same(got, rounded, "bf16 y");
}

#[test]
fn the_products_library_is_chosen_by_name_and_bad_choices_are_named() {
    assert_eq!("MKL".parse::<Gemm>().expect("mkl"), Gemm::Mkl);
    assert_eq!("native".parse::<Gemm>().expect("native"), Gemm::Native);
    assert_eq!("Auto".parse::<Gemm>().expect("auto"), Gemm::Auto);
    let e = "openblas"
        .parse::<Gemm>()
        .expect_err("not a choice")
        .to_string();
    assert!(
        e.contains("\"openblas\"") && e.contains("auto, native or mkl"),
        "{e}"
    );
    let e = Mkl::open("/nonexistent/libmkl_rt.so.3").expect_err("no such file");
    assert!(
        e.contains("/nonexistent/libmkl_rt.so.3"),
        "the error names the file: {e}"
    );
    assert_eq!(
        mkl::describe(Gemm::Native, true).expect("native"),
        "flash-ring's kernels"
    );
    // `auto` sends bf16 to MKL exactly where the CPU has AMX-BF16 and MKL loads, f32 never
    // (unless FLASH_RING_GEMM says otherwise).
    if std::env::var_os(mkl::GEMM_ENV).is_none() {
        let bf16_on_mkl = mkl::amx_bf16() && mkl::mkl().is_ok();
        let got = mkl::describe(Gemm::Auto, true).expect("auto");
        assert_eq!(got.starts_with("MKL"), bf16_on_mkl, "{got}");
        let got = mkl::describe(Gemm::Auto, false).expect("auto");
        assert_eq!(got, "flash-ring's kernels");
    }
    // Asking for MKL where it does not load is an error naming where it looked.
    if let Err(why) = mkl::mkl() {
        let one = Tensor::ones((1, 1), DType::F32, &Device::Cpu).expect("one");
        let cfg = KernelConfig {
            gemm: Gemm::Mkl,
            ..KernelConfig::default()
        };
        let e = flash_ring::matmul_with_config(&one, &one, &cfg)
            .expect_err("MKL does not load")
            .to_string();
        assert!(e.contains(mkl::MKL_ENV) && e.contains(&why), "{e}");
    }
}

#[test]
fn mkl_results_do_not_depend_on_the_operands_alignment() {
    let Some(lib) = mkl_or_skip("flash-ring/mkl::mkl_results_do_not_depend_on_the_alignment")
    else {
        return;
    };
    // The same operands starting 0..8 elements into their buffers (0-28 bytes off a 32-byte
    // line): strict reproducibility (MKL_CBWR_STRICT) gives the same bits from each.
    let (m, k, n) = (67, 515, 93);
    let mut r = common::rng(5);
    let a = common::randv(&mut r, m * k);
    let b = common::randv(&mut r, k * n);
    let at = |shift: usize| {
        let (mut ab, mut bb) = (vec![0.0f32; shift + m * k], vec![0.0f32; shift + k * n]);
        ab[shift..].copy_from_slice(&a);
        bb[shift..].copy_from_slice(&b);
        let c = mkl::gemm(
            lib,
            Mat::row_major(&ab[shift..], m, k),
            Mat::row_major(&bb[shift..], k, n),
        );
        c.expect("fits")
    };
    let first = at(0);
    for shift in 1..8 {
        let other = at(shift);
        assert!(
            first
                .iter()
                .zip(&other)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "operands {shift} elements off give other bits"
        );
    }
    assert!(
        format!("{lib:?}").contains(&lib.path),
        "{lib:?} names its file"
    );
}

/// `amx_bf16` (CPUID) agrees with the kernel's view of the CPU (`/proc/cpuinfo`'s flags).
#[test]
fn amx_detection_matches_the_kernels_cpu_flags() {
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        testkit::skip("flash-ring/mkl::amx_detection", "no /proc/cpuinfo here");
        return;
    };
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    assert!(!flags.is_empty(), "/proc/cpuinfo has a flags line");
    let listed = flags.contains(&"amx_bf16") && flags.contains(&"amx_tile");
    assert_eq!(
        mkl::amx_bf16(),
        listed,
        "CPUID and /proc/cpuinfo disagree on AMX-BF16"
    );
}
