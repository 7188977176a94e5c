//! Anomaly detection (`cpl train --detect-anomaly`): while it is on, the output of every unit
//! that runs as a block ([`Unit::forward`](super::Unit::forward): a model's layers) is checked
//! for NaN and infinity, and the first non-finite one is [`Error::NonFinite`] naming the unit
//! by its checkpoint prefix (`model.layers.7`). The trainer checks the gradients by parameter
//! name the same way and adds the step, rank and micro-batch.
//!
//! Off by default, at the cost of one relaxed atomic load per unit; on, one reduction and a
//! host read per unit output. The switch is process-wide (every local rank of a run shares it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

static ON: AtomicBool = AtomicBool::new(false);
/// The optimizer step being run (published by the trainer for the test hook).
static STEP: AtomicU64 = AtomicU64::new(0);

/// Turns the checks on or off for this process.
pub fn set_detect_anomaly(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether the checks are on.
pub fn detect_anomaly() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Publishes the optimizer step being run (the trainer calls it; the test hook reads it).
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// Whether every value of `t` is finite (`0 · x` is 0 for a finite `x`, NaN otherwise).
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let t = t.detach().to_dtype(DType::F32)?;
    let s = (t * 0.0)?.sum_all()?.to_scalar::<f32>()?;
    Ok(s == 0.0)
}

/// `Err(`[`Error::NonFinite`]`)` naming `module` and `what` (e.g. "forward output") when `t`
/// holds NaN or infinity.
pub fn check_finite(t: &Tensor, module: &str, what: &'static str) -> Result<()> {
    if all_finite(t)? {
        return Ok(());
    }
    Err(Error::NonFinite {
        module: module.to_string(),
        what,
    })
}

/// The forward check of unit `module`'s output `y` when detection is on; with the test hook
/// `CPL_TEST_POISON_FORWARD=<module>@<step>` (never set in normal use), that unit's output at
/// that step becomes NaN first, so a test can watch the check find it.
pub(crate) fn forward_output(y: Tensor, module: &str) -> Result<Tensor> {
    let hook = std::env::var("CPL_TEST_POISON_FORWARD").ok();
    let poisoned = hook
        .as_deref()
        .and_then(|h| h.split_once('@'))
        .is_some_and(|(m, s)| {
            m == module && s.parse::<u64>().ok() == Some(STEP.load(Ordering::Relaxed))
        });
    let y = if poisoned { (y * f64::NAN)? } else { y };
    check_finite(&y, module, "forward output")?;
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn nan_and_infinity_are_found_in_every_dtype() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let ok = Tensor::new(&[1f32, -2.0, 3e30], &Device::Cpu).unwrap();
            let ok = ok.to_dtype(dtype).unwrap();
            assert!(all_finite(&ok).unwrap() || dtype != DType::F32);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let t = Tensor::new(&[1f32, bad, 2.0], &Device::Cpu).unwrap();
                let t = t.to_dtype(dtype).unwrap();
                assert!(!all_finite(&t).unwrap(), "{dtype:?} {bad}");
                let e = check_finite(&t, "model.layers.3", "forward output").unwrap_err();
                assert!(e.to_string().contains("model.layers.3"), "{e}");
            }
        }
        let small = Tensor::new(&[1f32, -2.0, 0.5], &Device::Cpu).unwrap();
        assert!(all_finite(&small.to_dtype(DType::BF16).unwrap()).unwrap());
    }
}
