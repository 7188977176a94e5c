//! Library use of candle-parallel from a plain Candle program: see the `[[example]]` programs.
