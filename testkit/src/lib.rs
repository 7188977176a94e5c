//! Error measures for numerical checks: the one place tests, self-tests and benchmarks compare
//! tensors.
//!
//! Why not candle's own reductions: `max`/`max_all` skip a NaN that is not the first element, so
//! `(a - b).abs().max_all()` reports a small error for a tensor full of NaNs, and a bit-identity
//! check written as `rel_err(a, b) == 0.0` then passes on NaN. Every measure here walks the
//! values itself and treats non-finite values explicitly:
//! - a NaN anywhere (in either tensor) makes the error `+inf`, so every `err <= tol` fails, and
//!   the `assert_*` helpers name its position;
//! - an infinity must be matched by the same infinity at the same position (the log-sum-exp of a
//!   fully masked attention row is `-inf` in both); such positions are left out of the norms,
//!   and any other infinity makes the error `+inf`.
//!
//! The measure is the max-norm relative error `max_i |a_i - b_i| / max_i |b_i|` in f64, with `b`
//! the reference.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let want = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
//! let got = Tensor::new(&[1f32, 2., f32::NAN, 4.], &Device::Cpu)?;
//! assert_eq!(testkit::rel_err(&got, &want), f64::INFINITY);
//! let check = || testkit::assert_close(&got, &want, 1e-5, "x");
//! assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err());
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{DType, Tensor};

/// The values of `t` as f64, flattened (any float or integer dtype).
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .unwrap_or_else(|e| panic!("reading a tensor of shape {:?}: {e}", t.dims()))
}

/// The first position where `got` and `want` disagree on a non-finite value, with a
/// description: a NaN in either, or an infinity not matched by the same infinity.
pub fn first_non_finite(got: &[f64], want: &[f64]) -> Option<(usize, String)> {
    got.iter().zip(want).enumerate().find_map(|(i, (&a, &b))| {
        if a.is_nan() || b.is_nan() {
            Some((i, format!("NaN at element {i} (got {a}, want {b})")))
        } else if (a.is_infinite() || b.is_infinite()) && a != b {
            Some((
                i,
                format!("unmatched infinity at element {i} (got {a}, want {b})"),
            ))
        } else {
            None
        }
    })
}

/// `max|got - want| / max|want|` over `want`'s finite values with the denominator floored at
/// `floor`; `+inf` on any NaN or unmatched infinity (see the crate docs). Panics on a length
/// mismatch.
pub fn rel_err_floor(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_err: lengths differ");
    if first_non_finite(got, want).is_some() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in got.iter().zip(want) {
        if b.is_infinite() {
            continue; // matched infinities (checked above)
        }
        num = num.max((a - b).abs());
        den = den.max(b.abs());
    }
    if num == 0.0 {
        0.0
    } else {
        num / den.max(floor)
    }
}

/// [`rel_err_floor`] with the denominator floored at the smallest positive f64.
pub fn rel_err_values(got: &[f64], want: &[f64]) -> f64 {
    rel_err_floor(got, want, f64::MIN_POSITIVE)
}

/// The max-norm relative error of `got` against the reference `want` (see the crate docs).
/// Panics if the shapes differ.
pub fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "rel_err: shapes differ");
    rel_err_values(&values(got), &values(want))
}

/// `max|t|`, NaN if `t` holds a NaN anywhere (candle's `max_all` would skip it).
pub fn max_abs(t: &Tensor) -> f64 {
    max_abs_values(&values(t))
}

/// `max_i |x_i|` (0 for no values), NaN if any value is NaN: `fold(0.0, f64::max)` and
/// `m.max(x)` would skip it, since `f64::max` returns the other operand of a NaN.
pub fn max_abs_values(xs: &[f64]) -> f64 {
    xs.iter().fold(0.0, |m, &x| max_or_nan(m, x.abs()))
}

/// The larger of `a` and `b`, NaN if either is NaN (where `a.max(b)` returns the other one):
/// for running maxima of errors, `worst = max_or_nan(worst, e)`.
pub fn max_or_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Reports a test that cannot run on this machine (a missing instruction set): one line
/// `SKIPPED: {test}: {why}` written straight to stdout, past the test harness's output capture,
/// so that `cargo test` shows it even though the test passes, and CI counts such lines. `test`
/// names the test without spaces (`crate/file::function`).
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("SKIPPED: {test}: {why}\n");
    // One write of the whole line (a concurrent test's output does not split it).
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
}

/// Asserts equal shapes, a reference with a non-zero value, no NaN or unmatched infinity, and
/// a relative error of at most `tol`. `what` names the compared quantity in the message.
#[track_caller]
pub fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let (g, w) = (values(got), values(want));
    if let Some((_, msg)) = first_non_finite(&g, &w) {
        panic!("{what}: {msg}");
    }
    assert!(
        w.iter().any(|&x| x.is_finite() && x != 0.0),
        "{what}: the reference is all zeros, a relative error means nothing"
    );
    let e = rel_err_values(&g, &w);
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// Asserts that every value of `t` is finite.
#[track_caller]
pub fn assert_finite(t: &Tensor, what: &str) {
    if let Some(i) = values(t).iter().position(|x| !x.is_finite()) {
        panic!("{what}: non-finite value at element {i}");
    }
}

/// Asserts that `got` and `want` have the same shape and dtype and the same bits, and that no
/// value is NaN or infinite (two NaN results are not a reproduced result).
#[track_caller]
pub fn assert_identical(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes differ");
    let (g, w) = (values(got), values(want));
    if let Some(i) = g.iter().chain(&w).position(|x| !x.is_finite()) {
        panic!("{what}: non-finite value at element {}", i % g.len().max(1));
    }
    // Every dtype converts to f64 exactly, so equal f64 bits are equal source bits (up to the
    // sign of zero, which the to_bits comparison keeps).
    if let Some(i) = g
        .iter()
        .zip(&w)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: differs at element {i}: {} vs {} (not bit-identical)",
            g[i], w[i]
        );
    }
}

/// Asserts that two sequences of scalars (losses, norms) are bit-identical and finite.
#[track_caller]
pub fn assert_identical_scalars(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: lengths differ: {got:?} vs {want:?}"
    );
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.is_finite() && b.is_finite(),
            "{what}: non-finite value at {i}: {a} vs {b}"
        );
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}: element {i} differs: {a} vs {b} (not bit-identical)\n got: {got:?}\nwant: {want:?}"
        );
    }
}

/// Asserts `|got - want| <= tol · |want|` for scalars (a loss), failing on NaN and infinity.
#[track_caller]
pub fn assert_close_scalar(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        got.is_finite() && want.is_finite(),
        "{what}: non-finite: {got} vs {want}"
    );
    let e = (got - want).abs() / want.abs().max(f64::MIN_POSITIVE);
    assert!(
        e <= tol,
        "{what}: {got} vs {want}: relative error {e:.3e} > {tol:.0e}"
    );
}

/// `count` pseudo-random documents of `lens` tokens each (uniform lengths) with ids below
/// `vocab`, the same for a given `seed` on every machine (an LCG): packed-data fixtures.
pub fn random_docs(
    seed: u64,
    count: usize,
    lens: std::ops::Range<usize>,
    vocab: u32,
) -> Vec<Vec<u32>> {
    let mut state = seed;
    let mut next = |m: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % m
    };
    let span = (lens.end - lens.start).max(1) as u64;
    (0..count)
        .map(|_| {
            let len = lens.start + next(span) as usize;
            (0..len).map(|_| next(vocab as u64) as u32).collect()
        })
        .collect()
}
