//! Helpers shared by the gradient tests of this crate.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// The gradient of `v`, or an error naming it if backward produced none.
pub fn grad(grads: &GradStore, v: &Var, what: &str) -> Result<Tensor> {
    grads
        .get(v.as_tensor())
        .cloned()
        .ok_or_else(|| candle_core::Error::Msg(format!("no gradient for {what}")))
}

pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Asserts equal shapes and `max|got - want| / max|want| <= tol` (a finite error, a non-zero
/// reference).
pub fn assert_close(got: &Tensor, want: &Tensor, tol: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let scale = max_abs(want);
    assert!(scale > 0.0, "{what}: reference is all zeros");
    let err = max_abs(&(got - want).unwrap()) / scale;
    assert!(
        err.is_finite() && err <= tol,
        "{what}: relative error {err:e} > {tol:e}"
    );
}
