//! How much attention work the kernels did: the number of query-key scores computed (rows times
//! columns of the tiles and strips a kernel evaluated, summed over heads and batch; masked tiles
//! that are skipped cost nothing). The forward counts each score once, the backward once more.
//!
//! The count belongs to the thread that called the kernel (a rank's thread, whatever pool
//! threads did the work), so ranks running as threads of one process count apart. Only the CPU
//! kernels count; the composite path and other devices add nothing.

use std::cell::Cell;

thread_local! {
    static SCORES: Cell<u64> = const { Cell::new(0) };
}

/// Adds `n` scores to the calling thread's count.
pub(crate) fn add(n: u64) {
    SCORES.with(|s| s.set(s.get().saturating_add(n)));
}

/// Scores the calling thread's kernel calls computed since the last [`take_scores`].
pub fn scores() -> u64 {
    SCORES.with(|s| s.get())
}

/// [`scores`], and the count starts again from zero.
pub fn take_scores() -> u64 {
    SCORES.with(|s| s.replace(0))
}
