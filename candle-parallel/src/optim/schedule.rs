//! Learning-rate schedules: linear warmup, then cosine, linear or constant decay.
//!
//! The formulas are those of transformers' `get_cosine_schedule_with_warmup` (with the default
//! `num_cycles = 0.5`), `get_linear_schedule_with_warmup` and `get_constant_schedule_with_warmup`,
//! generalised with a floor `min_lr` on the decay phase (as transformers'
//! `get_cosine_with_min_lr_schedule_with_warmup`). With `min_lr = 0` they give the same numbers as
//! transformers for every step up to `total_steps`.

use serde::{Deserialize, Serialize};

/// The shape of the decay phase, after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Decay {
    /// Half a cosine from `peak_lr` (end of warmup) down to `min_lr` (at `total_steps`).
    Cosine,
    /// A straight line from `peak_lr` (end of warmup) down to `min_lr` (at `total_steps`).
    Linear,
    /// `peak_lr` after warmup (`min_lr` is not used).
    Constant,
}

/// A learning-rate schedule indexed by optimizer step (0-based: the number of optimizer steps
/// already taken, which is what transformers' `LambdaLR` passes to its lambda).
///
/// With `W = warmup_steps`, `T = total_steps`, `s = step`:
///
/// - warmup, `s < W`: `lr = peak_lr * (s / W)`. Step 0 therefore runs with lr 0 when `W > 0`,
///   exactly as in transformers (and the HF `Trainer`); `min_lr` does not apply to warmup.
/// - decay, `s >= W`, with `progress = (s - W) / max(1, T - W)`:
///   - `Cosine`: `lr = min_lr + (peak_lr - min_lr) * max(0, 0.5 * (1 + cos(pi * progress)))`,
///     with `progress` clamped to 1 (see below);
///   - `Linear`: `lr = min_lr + (peak_lr - min_lr) * max(0, (T - s) / max(1, T - W))`;
///   - `Constant`: `lr = peak_lr`.
///
/// After `T`, `Linear` stays at `min_lr` (as transformers stays at 0). `Cosine` also stays at
/// `min_lr`, where transformers' formula would climb back up along the cosine: that is the one
/// place this schedule (deliberately) differs from transformers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub peak_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub decay: Decay,
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (0-based); see the type's documentation.
    pub fn lr(&self, step: u64) -> f64 {
        let warmup = self.warmup_steps;
        if step < warmup {
            // transformers: float(current_step) / float(max(1, num_warmup_steps)).
            return self.peak_lr * (step as f64 / warmup.max(1) as f64);
        }
        let span = self.total_steps.saturating_sub(warmup).max(1) as f64;
        let factor = match self.decay {
            Decay::Constant => return self.peak_lr,
            Decay::Cosine => {
                let progress = ((step - warmup) as f64 / span).min(1.0);
                // transformers: math.pi * float(num_cycles) * 2.0 * progress, num_cycles = 0.5.
                let angle = std::f64::consts::PI * 0.5 * 2.0 * progress;
                (0.5 * (1.0 + angle.cos())).max(0.0)
            }
            Decay::Linear => ((self.total_steps as f64 - step as f64) / span).max(0.0),
        };
        // With min_lr = 0 this is exactly transformers' base_lr * lambda(step).
        self.min_lr + (self.peak_lr - self.min_lr) * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(decay: Decay, min_lr: f64) -> LrSchedule {
        LrSchedule {
            peak_lr: 1.0,
            min_lr,
            warmup_steps: 2,
            total_steps: 6,
            decay,
        }
    }

    #[test]
    fn warmup_then_decay() {
        let c = sched(Decay::Cosine, 0.0);
        assert_eq!(c.lr(0), 0.0);
        assert_eq!(c.lr(1), 0.5);
        assert_eq!(c.lr(2), 1.0);
        assert!((c.lr(4) - 0.5).abs() < 1e-15);
        assert!(c.lr(6).abs() < 1e-15);
        assert!(c.lr(9).abs() < 1e-15, "cosine holds min_lr after total");
        let l = sched(Decay::Linear, 0.1);
        assert!((l.lr(4) - 0.55).abs() < 1e-15);
        assert!((l.lr(6) - 0.1).abs() < 1e-15);
        assert!((l.lr(100) - 0.1).abs() < 1e-15);
        let k = sched(Decay::Constant, 0.1);
        assert_eq!((k.lr(1), k.lr(2), k.lr(100)), (0.5, 1.0, 1.0));
    }
}
