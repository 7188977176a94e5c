//! Library use of candle-parallel from a plain Candle program: see the `[[example]]` programs.

/// The README's code blocks, compiled (and, unless marked `no_run`, run) as doctests so that
/// what the README shows keeps working.
#[doc = include_str!("../README.md")]
pub mod readme {}
