//! Exact heap accounting for memory tests and benchmarks.
//!
//! [`CountingAlloc`] wraps a global allocator and counts the bytes allocated and not yet freed,
//! and their peak, without changing where memory comes from. Install it in a test or benchmark
//! binary:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: train::memory::CountingAlloc<std::alloc::System> =
//!     train::memory::CountingAlloc::new(std::alloc::System);
//! ```
//!
//! The counts are bytes asked for (not RSS: allocator overhead and fragmentation are excluded),
//! summed over every thread of the process, so with local ranks they are the sum over ranks.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicIsize, Ordering};

/// A global allocator that counts the live bytes of `A` and their peak.
pub struct CountingAlloc<A> {
    inner: A,
    current: AtomicIsize,
    peak: AtomicIsize,
}

impl<A> CountingAlloc<A> {
    /// Wraps `inner` with zero counts.
    pub const fn new(inner: A) -> Self {
        CountingAlloc {
            inner,
            current: AtomicIsize::new(0),
            peak: AtomicIsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed.
    pub fn current(&self) -> isize {
        self.current.load(Ordering::SeqCst)
    }

    /// The largest [`current`](Self::current) since the last [`reset_peak`](Self::reset_peak).
    pub fn peak(&self) -> isize {
        self.peak.load(Ordering::SeqCst)
    }

    /// Starts a new peak measurement from `from` (usually [`current`](Self::current)).
    pub fn reset_peak(&self, from: isize) {
        self.peak.store(from, Ordering::SeqCst);
    }

    fn grew(&self, by: isize) {
        let now = self.current.fetch_add(by, Ordering::SeqCst) + by;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }
}

// SAFETY: every call is forwarded unchanged to `inner`, which upholds the contract; the counts
// are only bookkeeping.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { self.inner.alloc(l) };
        if !p.is_null() {
            self.grew(l.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { self.inner.alloc_zeroed(l) };
        if !p.is_null() {
            self.grew(l.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { self.inner.dealloc(p, l) };
        self.current.fetch_sub(l.size() as isize, Ordering::SeqCst);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { self.inner.realloc(p, l, new) };
        if !q.is_null() {
            self.grew(new as isize - l.size() as isize);
        }
        q
    }
}
