//! A small process-wide pool of f32 buffers for the kernels' packed operands and gradient
//! accumulators. Fresh large allocations are served by the OS page by page (a page fault per
//! 4 KiB on first touch), which costs as much as the attention itself for short sequences;
//! reusing buffers across calls avoids that. At most [`POOL_BYTES`] stay cached.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// Upper bound on the bytes kept in the pool between calls.
pub const POOL_BYTES: usize = 512 << 20;
/// Upper bound on the number of cached buffers.
const POOL_BUFFERS: usize = 64;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// A zero-initialised f32 buffer that returns to the pool when dropped.
pub(crate) struct PoolBuf {
    buf: Vec<f32>,
}

impl PoolBuf {
    /// A buffer of `len` zeros, reusing a cached allocation when one is large enough.
    pub fn zeroed(len: usize) -> Self {
        let mut buf = take(len).unwrap_or_default();
        buf.clear();
        buf.resize(len, 0.0);
        PoolBuf { buf }
    }
}

impl PoolBuf {
    /// A buffer of `len` elements with unspecified (but initialised) contents, for callers
    /// that overwrite all of it.
    pub fn overwritten(len: usize) -> Self {
        let mut buf = take(len).unwrap_or_default();
        if buf.len() >= len {
            buf.truncate(len);
        } else {
            buf.resize(len, 0.0);
        }
        PoolBuf { buf }
    }
}

fn take(len: usize) -> Option<Vec<f32>> {
    let mut pool = POOL.lock().ok()?;
    // Best fit: the smallest cached buffer that holds `len`.
    let (i, _) = pool
        .iter()
        .enumerate()
        .filter(|(_, b)| b.capacity() >= len)
        .min_by_key(|(_, b)| b.capacity())?;
    Some(pool.swap_remove(i))
}

/// Frees every cached buffer (the pool refills on the next kernel call).
pub fn release_buffers() {
    if let Ok(mut pool) = POOL.lock() {
        pool.clear();
        pool.shrink_to_fit();
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let bytes = buf.capacity() * 4;
        if bytes == 0 || bytes > POOL_BYTES {
            return;
        }
        if let Ok(mut pool) = POOL.lock() {
            let mut held: usize = pool.iter().map(|b| b.capacity() * 4).sum();
            // Make room by dropping the smallest buffers first.
            while held + bytes > POOL_BYTES || pool.len() >= POOL_BUFFERS {
                let smallest = pool
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, b)| b.capacity())
                    .map(|(i, _)| i);
                match smallest {
                    Some(i) => held -= pool.swap_remove(i).capacity() * 4,
                    None => break,
                }
            }
            pool.push(buf);
        }
    }
}

impl Deref for PoolBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reused_buffers_are_zeroed_and_sized() {
        {
            let mut a = PoolBuf::zeroed(1000);
            a.iter_mut().for_each(|x| *x = 7.0);
        }
        // The dirty buffer comes back zeroed (or a fresh one is made).
        let b = PoolBuf::zeroed(900);
        assert_eq!(b.len(), 900);
        assert!(b.iter().all(|&x| x == 0.0));
        drop(b);
        let c = PoolBuf::overwritten(1200);
        assert_eq!(c.len(), 1200);
        drop(c);
        release_buffers();
        assert_eq!(PoolBuf::zeroed(10).len(), 10);
    }
}
