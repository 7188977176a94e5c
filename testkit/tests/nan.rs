//! The measures see a NaN wherever it is, which candle's `max_all` does not.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Whether `f` panics.
fn fails(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

use candle_core::{Device, Tensor};
use testkit::{
    assert_close, assert_close_scalar, assert_finite, assert_identical, assert_identical_scalars,
    max_abs, max_abs_values, max_or_nan, rel_err,
};

/// 1..=n, with element `at` set to `x`.
fn planted(n: usize, at: usize, x: f32) -> Tensor {
    let mut v: Vec<f32> = (1..=n).map(|i| i as f32).collect();
    v[at] = x;
    Tensor::from_vec(v, (n / 4, 4), &Device::Cpu).unwrap()
}

#[test]
fn candle_max_all_skips_a_nan_in_the_middle() {
    // The reason this crate exists: if this ever starts failing, candle fixed it.
    let t = planted(64, 30, f32::NAN);
    let m = t
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(!m.is_nan(), "candle's max_all now propagates NaN");
}

#[test]
fn a_nan_in_the_middle_fails_every_measure() {
    let clean = planted(64, 30, 31.0);
    for nan_at in [1, 30, 62] {
        let dirty = planted(64, nan_at, f32::NAN);
        for (got, want) in [(&dirty, &clean), (&clean, &dirty), (&dirty, &dirty)] {
            assert_eq!(rel_err(got, want), f64::INFINITY);
            assert!(fails(|| assert_close(got, want, 1e-3, "t")));
            assert!(fails(|| assert_identical(got, want, "t")));
        }
        assert!(max_abs(&dirty).is_nan());
        assert!(fails(|| assert_finite(&dirty, "t")));
    }
    // The clean pair passes.
    assert_eq!(rel_err(&clean, &clean), 0.0);
    assert_close(&clean, &clean, 0.0, "clean");
    assert_identical(&clean, &clean, "clean");
}

#[test]
fn infinities_must_match() {
    let a = planted(16, 5, f32::NEG_INFINITY);
    let b = planted(16, 5, f32::INFINITY);
    let c = planted(16, 6, f32::NEG_INFINITY);
    // Matched -inf (an empty attention row's lse) is left out of the norm.
    assert_eq!(rel_err(&a, &a), 0.0);
    assert_eq!(rel_err(&a, &b), f64::INFINITY);
    assert_eq!(rel_err(&a, &c), f64::INFINITY);
    assert!(fails(|| assert_identical(&a, &a, "inf")));
}

#[test]
fn scalar_checks_fail_on_nan_and_on_any_difference() {
    assert_identical_scalars(&[1.0, 2.0], &[1.0, 2.0], "ok");
    assert!(fails(|| assert_identical_scalars(
        &[1.0, f64::NAN],
        &[1.0, f64::NAN],
        "n"
    )));
    assert!(fails(|| assert_identical_scalars(
        &[1.0, 2.0],
        &[1.0, 2.0 + 1e-15],
        "d"
    )));
    assert!(fails(|| assert_close_scalar(f64::NAN, 1.0, 1.0, "n")));
    assert!(fails(|| assert_close_scalar(1.1, 1.0, 1e-2, "far")));
    assert_close_scalar(1.0 + 1e-9, 1.0, 1e-8, "near");
}

#[test]
fn a_small_error_is_measured_relative_to_the_reference() {
    let want = planted(8, 0, 1.0);
    let got = (&want + 0.004).unwrap();
    let e = rel_err(&got, &want);
    assert!((e - 0.0005).abs() < 1e-7, "{e}");
    assert_close(&got, &want, 1e-3, "within");
    assert!(fails(|| assert_close(&got, &want, 1e-4, "beyond")));
}

#[test]
fn slice_maxima_see_a_nan_in_the_middle() {
    // What they replace: `f64::max` returns the other operand of a NaN.
    let xs = [1.0, -3.0, f64::NAN, 2.0];
    assert_eq!(xs.iter().map(|x| x.abs()).fold(0.0, f64::max), 3.0);
    assert!(max_abs_values(&xs).is_nan());
    assert!(max_or_nan(1.0, f64::NAN).is_nan() && max_or_nan(f64::NAN, 1.0).is_nan());
    assert_eq!(max_abs_values(&[1.0, -3.0, 2.0]), 3.0);
    assert_eq!(max_abs_values(&[]), 0.0);
    assert_eq!(max_or_nan(1.0, 2.0), 2.0);
}
