//! `cpl`'s two thread pools on cores they share: candle runs its element-wise ops on its own
//! pool (`BarrierPool`), flash-ring runs the products and attention on rayon's, and both size
//! themselves to the machine. After each op candle's workers spin for the next one before they
//! park (25,000 `pause` instructions by default, about half a millisecond); when the next
//! work is a product on rayon's threads, the spinning workers take cores from it. A training
//! step alternates the two hundreds of times, so `cpl` shortens the spin to [`SPIN_LIMIT`]
//! (about 40 microseconds) unless `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set.
//!
//! Measured on a 2-vCPU AMD EPYC (Zen 4), DiT-S/2 training at 256 tokens per image (`cpl
//! train`, best of 4 steps, images/s, runs alternating): the default averaged 4.19 over 12 runs
//! (4.00-4.42), 2000 averaged 4.34 over 14 (3.81-4.50), +3.5%; 200,000 gave 3.42. The
//! LLaMA-shaped f32 and bf16 steps did not move beyond their noise (docs/benchmarks.md,
//! "The optimizer in one pass").

/// The variable candle reads, once, when it builds its pool.
pub const SPIN_LIMIT_ENV: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// The spin `cpl` asks for.
pub const SPIN_LIMIT: u32 = 2000;

/// Sets [`SPIN_LIMIT_ENV`] to [`SPIN_LIMIT`] unless the environment sets it. Call first thing
/// in `main`, before any thread starts (and before candle's first op builds its pool).
pub fn shorter_candle_spin() {
    if std::env::var_os(SPIN_LIMIT_ENV).is_none() {
        std::env::set_var(SPIN_LIMIT_ENV, SPIN_LIMIT.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vendored candle still reads the variable under this name, as a number.
    #[test]
    fn candle_reads_the_spin_limit_variable() {
        let utils = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../third_party/candle-core/src/utils.rs"
        );
        let src = std::fs::read_to_string(utils).expect("the vendored candle-core's utils.rs");
        assert!(
            src.contains(&format!("std::env::var(\"{SPIN_LIMIT_ENV}\")")),
            "candle no longer reads {SPIN_LIMIT_ENV}"
        );
        assert!(
            src.contains("u32::from_str(&s)"),
            "candle parses it otherwise"
        );
    }
}
