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

#[allow(unused_imports)]
pub use testkit::{assert_close, max_abs, rel_err};
