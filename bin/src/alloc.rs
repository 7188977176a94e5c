//! `cpl`'s allocator: mimalloc, told to keep the memory that training frees for reuse.
//!
//! A training step allocates and frees the same large tensors every step (activations, their
//! gradients, the collectives' outputs). By default mimalloc returns ("purges") freed memory to
//! the kernel after 1 s, so the next step faults every page back in and the kernel zeroes it
//! again: on the benchmark model that was 100K page faults in 4 steps and a quarter of the
//! step's samples in `clear_page_erms` (docs/benchmarks.md, "Allocation"). With purging off,
//! freed blocks are reused as they are, as PyTorch's caching allocator does: the process holds
//! its peak, which a training loop reaches every step anyway.
//!
//! `MIMALLOC_PURGE_DELAY` in the environment (milliseconds; `-1` never; mimalloc also reads its
//! old name `MIMALLOC_RESET_DELAY`, in any case) still decides when set.

/// Every allocation of `cpl` goes through mimalloc.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (the same index in its v2 and v3 headers;
/// `libmimalloc-sys` has no constant for it). The test below checks it against the documented
/// default.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The purge delay mimalloc uses when nobody sets one (milliseconds).
#[cfg(test)]
const DEFAULT_PURGE_DELAY: std::os::raw::c_long = 1000;

/// Whether the environment sets mimalloc's purge delay, under either of the names mimalloc
/// reads (it matches them in any case).
fn purge_delay_in_env() -> bool {
    std::env::vars_os().any(|(k, _)| {
        k.to_str().is_some_and(|k| {
            k.eq_ignore_ascii_case("MIMALLOC_PURGE_DELAY")
                || k.eq_ignore_ascii_case("MIMALLOC_RESET_DELAY")
        })
    })
}

/// Turns mimalloc's purging of freed memory off, unless the environment sets the purge delay.
/// Call once, first thing in `main`.
pub fn keep_freed_memory() {
    if !purge_delay_in_env() {
        // SAFETY: setting an option is a plain store into mimalloc's option table; the index is
        // one of its options (checked by the test below).
        unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index names the purge delay: before anything sets it, it reads mimalloc's documented
    /// default of 1000 ms (an index shifted by a mimalloc upgrade would read another option's
    /// value: the neighbours are `eager_commit_delay` = 1 and `use_numa_nodes` = 0); after
    /// `keep_freed_memory` it reads -1.
    #[test]
    fn purge_delay_index_names_the_purge_delay_and_is_turned_off() {
        if purge_delay_in_env() {
            // The user's value decides; the index cannot be told from the default then.
            return;
        }
        // SAFETY: reading an option is a plain load from mimalloc's option table.
        let before = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        assert_eq!(
            before, DEFAULT_PURGE_DELAY,
            "option {PURGE_DELAY} is not the purge delay"
        );
        keep_freed_memory();
        // SAFETY: as above.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, -1);
    }
}
