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
//!
//! [`RankCountingAlloc`] counts the same bytes per local rank: a thread names the rank it runs
//! ([`RankCountingAlloc::attribute_thread`]), every allocation it makes is tagged with that rank,
//! and a free (from whichever thread: a tensor sent to another rank is freed there) is
//! subtracted from the rank that allocated it. Each rank's peak is then what one process of an
//! MPI run would hold, whatever the other threads were doing at that moment, which a process-wide
//! peak cannot tell (thread-ranks' peaks coincide or not depending on scheduling).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
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

/// How many ranks [`RankCountingAlloc`] counts separately; allocations of other threads (and of
/// ranks from this number on) are counted as [`RankCountingAlloc::unattributed`].
pub const COUNTED_RANKS: usize = 16;

thread_local! {
    /// The rank this thread's allocations are counted for (`COUNTED_RANKS`: none).
    static RANK: Cell<usize> = const { Cell::new(COUNTED_RANKS) };
}

/// A global allocator that counts the live bytes of `A` and their peak for each local rank.
///
/// Every allocation carries a small header (at least 16 bytes, the allocation's alignment if
/// larger) holding the rank it is counted for, so it is meant for test and benchmark binaries.
pub struct RankCountingAlloc<A> {
    inner: A,
    /// Index `COUNTED_RANKS` counts the threads that named no rank.
    current: [AtomicIsize; COUNTED_RANKS + 1],
    peak: [AtomicIsize; COUNTED_RANKS + 1],
}

impl<A> RankCountingAlloc<A> {
    /// Wraps `inner` with zero counts.
    pub const fn new(inner: A) -> Self {
        RankCountingAlloc {
            inner,
            current: [const { AtomicIsize::new(0) }; COUNTED_RANKS + 1],
            peak: [const { AtomicIsize::new(0) }; COUNTED_RANKS + 1],
        }
    }

    /// Counts this thread's allocations from now on for `rank` (`None`: for no rank). Ranks from
    /// [`COUNTED_RANKS`] on are counted as unattributed.
    pub fn attribute_thread(&self, rank: Option<usize>) {
        RANK.with(|r| r.set(rank.unwrap_or(COUNTED_RANKS).min(COUNTED_RANKS)));
    }

    /// Bytes allocated by `rank` and not yet freed.
    pub fn current(&self, rank: usize) -> isize {
        self.current[rank.min(COUNTED_RANKS)].load(Ordering::SeqCst)
    }

    /// The largest [`current`](Self::current) of `rank` since the last
    /// [`reset_peaks`](Self::reset_peaks).
    pub fn peak(&self, rank: usize) -> isize {
        self.peak[rank.min(COUNTED_RANKS)].load(Ordering::SeqCst)
    }

    /// Bytes allocated by threads that named no rank and not yet freed.
    pub fn unattributed(&self) -> isize {
        self.current(COUNTED_RANKS)
    }

    /// Starts a new peak measurement for every rank from its current count.
    pub fn reset_peaks(&self) {
        for (c, p) in self.current.iter().zip(&self.peak) {
            p.store(c.load(Ordering::SeqCst), Ordering::SeqCst);
        }
    }

    fn grew(&self, rank: usize, by: isize) {
        let now = self.current[rank].fetch_add(by, Ordering::SeqCst) + by;
        self.peak[rank].fetch_max(now, Ordering::SeqCst);
    }

    /// The header's size for an alignment: a multiple of it, with room for the rank.
    fn header(align: usize) -> usize {
        align.max(16)
    }

    /// The inner allocation's layout for `l`, or `None` when it would overflow.
    fn outer(l: Layout) -> Option<Layout> {
        let size = l.size().checked_add(Self::header(l.align()))?;
        Layout::from_size_align(size, l.align()).ok()
    }

    /// Tags the inner allocation `base` with this thread's rank and returns the caller's pointer.
    ///
    /// # Safety
    /// `base` is a live allocation of `outer(l)`.
    unsafe fn tag(&self, base: *mut u8, l: Layout) -> *mut u8 {
        let rank = RANK.with(Cell::get);
        let p = unsafe { base.add(Self::header(l.align())) };
        unsafe {
            p.sub(size_of::<usize>())
                .cast::<usize>()
                .write_unaligned(rank)
        };
        self.grew(rank, l.size() as isize);
        p
    }

    /// An allocation for `l` made by `inner_alloc` (one of `inner`'s) with its header, tagged.
    ///
    /// # Safety
    /// `inner_alloc` returns null or a live allocation of the layout it is given.
    unsafe fn alloc_by(&self, l: Layout, inner_alloc: impl FnOnce(Layout) -> *mut u8) -> *mut u8 {
        let Some(outer) = Self::outer(l) else {
            return std::ptr::null_mut();
        };
        let base = inner_alloc(outer);
        if base.is_null() {
            return base;
        }
        unsafe { self.tag(base, l) }
    }

    /// The rank `p` was counted for and the inner allocation's start.
    ///
    /// # Safety
    /// `p` was returned by this allocator for layout `l`.
    unsafe fn untag(p: *mut u8, l: Layout) -> (usize, *mut u8) {
        let rank = unsafe { p.sub(size_of::<usize>()).cast::<usize>().read_unaligned() };
        (rank, unsafe { p.sub(Self::header(l.align())) })
    }
}

// SAFETY: every allocation is one of `inner` (a header larger, same alignment: the header is a
// multiple of the alignment, so the caller's pointer stays aligned); the header is written only
// inside it, and deallocation and reallocation hand `inner` its own pointer and layout back.
unsafe impl<A: GlobalAlloc> GlobalAlloc for RankCountingAlloc<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        unsafe { self.alloc_by(l, |o| self.inner.alloc(o)) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        unsafe { self.alloc_by(l, |o| self.inner.alloc_zeroed(o)) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        let (rank, base) = unsafe { Self::untag(p, l) };
        // `outer(l)` succeeded when `p` was allocated.
        let outer = unsafe {
            Layout::from_size_align_unchecked(l.size() + Self::header(l.align()), l.align())
        };
        unsafe { self.inner.dealloc(base, outer) };
        self.current[rank].fetch_sub(l.size() as isize, Ordering::SeqCst);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let header = Self::header(l.align());
        let Some(new_outer) = new.checked_add(header) else {
            return std::ptr::null_mut();
        };
        if Layout::from_size_align(new_outer, l.align()).is_err() {
            return std::ptr::null_mut();
        }
        let (rank, base) = unsafe { Self::untag(p, l) };
        let outer = unsafe { Layout::from_size_align_unchecked(l.size() + header, l.align()) };
        // The header moves with the contents: the allocation stays counted for its rank.
        let q = unsafe { self.inner.realloc(base, outer, new_outer) };
        if q.is_null() {
            return q;
        }
        self.grew(rank, new as isize - l.size() as isize);
        unsafe { q.add(header) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    #[test]
    fn each_rank_counts_what_it_allocated_wherever_it_is_freed() {
        let a = RankCountingAlloc::new(System);
        let l = Layout::from_size_align(1000, 64).unwrap();
        // Rank 3 allocates; rank 5 frees (a tensor sent to another rank).
        let p = std::thread::scope(|s| {
            s.spawn(|| {
                a.attribute_thread(Some(3));
                let p = unsafe { a.alloc(l) };
                assert!(!p.is_null());
                assert_eq!(
                    p as usize % 64,
                    0,
                    "the caller's pointer keeps its alignment"
                );
                unsafe { std::ptr::write_bytes(p, 7, 1000) };
                p as usize
            })
            .join()
            .unwrap()
        });
        assert_eq!((a.current(3), a.peak(3)), (1000, 1000));
        std::thread::scope(|s| {
            s.spawn(|| {
                a.attribute_thread(Some(5));
                let p = p as *mut u8;
                assert_eq!(unsafe { *p.add(999) }, 7);
                // Grown by the other rank: still rank 3's, contents kept.
                let q = unsafe { a.realloc(p, l, 3000) };
                assert!(!q.is_null() && (q as usize).is_multiple_of(64));
                assert_eq!(unsafe { *q.add(999) }, 7);
                assert_eq!((a.current(3), a.peak(3), a.current(5)), (3000, 3000, 0));
                let l3 = Layout::from_size_align(3000, 64).unwrap();
                unsafe { a.dealloc(q, l3) };
            });
        });
        assert_eq!((a.current(3), a.peak(3)), (0, 3000));
        assert_eq!((a.current(5), a.peak(5)), (0, 0));
        a.reset_peaks();
        assert_eq!(a.peak(3), 0);
    }

    #[test]
    fn threads_without_a_rank_are_counted_apart_and_zeroed_memory_is_zero() {
        let a = RankCountingAlloc::new(System);
        a.attribute_thread(None);
        let l = Layout::from_size_align(24, 1).unwrap();
        let p = unsafe { a.alloc_zeroed(l) };
        assert!(!p.is_null());
        assert!((0..24).all(|i| unsafe { *p.add(i) } == 0));
        assert_eq!(a.unattributed(), 24);
        assert!((0..COUNTED_RANKS).all(|r| a.current(r) == 0));
        a.attribute_thread(Some(COUNTED_RANKS + 4));
        let q = unsafe { a.alloc(l) };
        assert_eq!(
            a.unattributed(),
            48,
            "ranks past COUNTED_RANKS count as unattributed"
        );
        unsafe {
            a.dealloc(p, l);
            a.dealloc(q, l);
        }
        assert_eq!(a.unattributed(), 0);
        a.attribute_thread(None);
    }
}
