//! Copies for the large outputs of the local collectives.
//!
//! A collective's output of tens of MiB is larger than the caches; a copy into it with ordinary
//! stores first reads every destination line into the cache (to own it), then writes it back:
//! a third of its memory traffic goes to reading bytes about to be overwritten. Non-temporal
//! (streaming) stores write whole lines without reading them. With 4 local ranks on 2 cores the
//! copies are memory-bound, so the saving is time: a 64 MiB all-to-all on 4 ranks runs 1.25-1.4x
//! faster (docs/benchmarks.md, "Allocation"). glibc's `memcpy` streams too, but only above a
//! threshold it derives from the cache size the CPU reports; on the virtual machines this
//! project measures on that is 288 MiB, so it never does for these sizes.
//!
//! Hand-written with SSE2 (part of every x86-64 CPU, so no run-time detection); other
//! architectures copy with `copy_nonoverlapping`.

/// Runs of at least this many bytes are streamed: beyond a core's L2, where the output would
/// not stay cached for its reader anyway.
pub(crate) const STREAM_BYTES: usize = 4 << 20;

/// Copies `n` elements from `src` to `dst`, streaming runs of [`STREAM_BYTES`] and more.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes of `n`
/// elements, the two not overlapping.
pub(crate) unsafe fn copy_run<T: Copy>(src: *const T, dst: *mut T, n: usize) {
    let bytes = n * std::mem::size_of::<T>();
    if bytes >= STREAM_BYTES {
        // SAFETY: the caller's contract, in bytes.
        unsafe { stream(src.cast(), dst.cast(), bytes) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
    }
}

/// Copies `bytes` bytes with non-temporal stores (ordinary copies for the unaligned head and
/// the tail), then fences: the stores are visible to any thread that synchronises with this one
/// afterwards (the collectives hand their outputs over through a mutex).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`] for `bytes` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn stream(src: *const u8, dst: *mut u8, bytes: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    let head = dst.align_offset(16).min(bytes);
    // SAFETY: within the caller's ranges; `head <= bytes`.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let (mut at, lines) = (head, (bytes - head) / LINE);
    for _ in 0..lines {
        // SAFETY: `at + LINE <= bytes`; `dst + at` is 16-byte aligned (`head` aligned it and
        // `LINE` is a multiple of 16); loads are unaligned.
        unsafe {
            let (s, d) = (src.add(at), dst.add(at));
            let v0 = _mm_loadu_si128(s.cast::<__m128i>());
            let v1 = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let v2 = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let v3 = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), v0);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), v1);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), v2);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), v3);
        }
        at += LINE;
    }
    // SAFETY: the rest of the caller's ranges.
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), bytes - at);
        _mm_sfence();
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream(src: *const u8, dst: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length up to a few lines, from every source and destination misalignment, copies
    /// exactly and writes nothing outside its range.
    #[test]
    fn stream_copies_exactly_at_every_alignment() {
        let src: Vec<u8> = (0..512u32).map(|i| (i * 37 + 11) as u8).collect();
        for len in 0..300 {
            for (so, doff) in [(0, 0), (1, 0), (0, 1), (3, 7), (15, 9), (16, 16)] {
                let mut dst = vec![0xAAu8; 512];
                // SAFETY: both ranges lie in their vectors (offsets < 16, len < 300 < 496).
                unsafe { stream(src.as_ptr().add(so), dst.as_mut_ptr().add(doff), len) };
                assert_eq!(
                    &dst[doff..doff + len],
                    &src[so..so + len],
                    "len {len}, {so}/{doff}"
                );
                assert!(
                    dst[..doff].iter().all(|&b| b == 0xAA),
                    "wrote before the range"
                );
                assert!(
                    dst[doff + len..].iter().all(|&b| b == 0xAA),
                    "wrote after the range"
                );
            }
        }
    }

    /// At and above the threshold (the streamed path) and below it, whole element runs.
    #[test]
    fn copy_run_copies_both_sides_of_the_threshold() {
        let n = STREAM_BYTES / 4 + 5;
        let src: Vec<f32> = (0..n + 1).map(|i| i as f32 * 0.5 - 7.0).collect();
        for (offset, len) in [(1, n), (0, STREAM_BYTES / 4), (1, STREAM_BYTES / 4 - 1)] {
            let mut dst = vec![0f32; n + 1];
            // SAFETY: `offset + len <= n + 1` for both vectors.
            unsafe { copy_run(src.as_ptr().add(offset), dst.as_mut_ptr().add(offset), len) };
            assert_eq!(dst[offset..offset + len], src[offset..offset + len]);
        }
    }
}
