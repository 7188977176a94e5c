//! The products' output is allocated without zero-filling (each task stores its own block of
//! C once, from a scratch block): every element must still be written. This test binary's allocator
//! fills every allocation that is not asked to be zeroed with the bits of a NaN, so an element
//! of C no task wrote reads as NaN here, whatever memory the system hands out.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};

use flash_ring::cpu::gemm::{gemm, Mat};

/// [`System`], with every non-zeroed allocation filled with 0xFF bytes (an f32 NaN).
struct Poisoned;

// SAFETY: forwards to `System`; the fill writes only the bytes just allocated.
unsafe impl GlobalAlloc for Poisoned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            unsafe { std::ptr::write_bytes(p, 0xFF, layout.size()) };
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { System.alloc_zeroed(layout) }
    }
}

#[global_allocator]
static ALLOC: Poisoned = Poisoned;

/// A fresh allocation really is poisoned here (else the test below could not fail).
#[test]
fn this_binary_poisons_fresh_allocations() {
    let v: Vec<f32> = Vec::with_capacity(1000);
    // SAFETY: reads the initialised bytes of the allocation as f32 (any bits are an f32).
    let first = unsafe { *v.as_ptr() };
    assert!(first.is_nan(), "{first}");
}

/// Every element of C is written, for the product's block shapes on every instruction set and
/// thread count: columns that are not a multiple of 16 (padding), several row and column
/// blocks, the wide-B path (one column block per task, at least 8 per thread), a depth past one
/// super-chunk (a scratch block). Each element against float64 within its summation's bound.
#[test]
fn products_write_every_element_of_an_unzeroed_output() {
    let mut r = common::rng(31);
    for (m, k, n) in [
        (100, 70, 300),
        (40, 33, 8200),
        (30, 1100, 100),
        (200, 64, 1040),
    ] {
        let a = common::randv(&mut r, m * k);
        let b = common::randv(&mut r, k * n);
        let want = product_f64(&a, &b, (m, k, n), f64::from);
        for isa in flash_ring::cpu::available() {
            for threads in [1, 3] {
                let c = common::on_threads(threads, || {
                    gemm(isa, Mat::row_major(&a, m, k), Mat::row_major(&b, k, n))
                });
                check(&c, &want, &format!("{isa:?} {m}x{k}x{n} on {threads}"));
            }
        }
        // The bf16 dot-product kernel shares the blocking (where the CPU has it).
        if flash_ring::cpu::gemm_bf16::available() {
            let (ah, bh) = (to_bf16(&a), to_bf16(&b));
            let want = product_f64(&ah, &bh, (m, k, n), f64::from);
            let c = flash_ring::cpu::gemm_bf16::gemm_bf16(
                Mat::row_major(&ah, m, k),
                Mat::row_major(&bh, k, n),
            );
            check(&c, &want, &format!("bf16 {m}x{k}x{n}"));
            // Rounded to bf16 block by block: every element written (0xFFFF is a bf16 NaN),
            // each the rounding of the f32 sum.
            let rounded = flash_ring::cpu::gemm_bf16::gemm_bf16_rounded(
                Mat::row_major(&ah, m, k),
                Mat::row_major(&bh, k, n),
            );
            let mut want16 = vec![half::bf16::ZERO; c.len()];
            flash_ring::cpu::gemm_bf16::narrow_to_bf16(&c, &mut want16);
            assert_eq!(rounded.len(), c.len());
            for (i, (r, w)) in rounded.iter().zip(&want16).enumerate() {
                let what = format!("bf16 rounded {m}x{k}x{n} element {i}");
                assert_eq!(r.to_bits(), w.to_bits(), "{what}");
            }
        } else {
            testkit::skip(
                "products_write_every_element_of_an_unzeroed_output (bf16)",
                "this CPU has no AVX512-BF16",
            );
        }
    }
}

/// Row-major `A (m, k) @ B (k, n)` in float64.
fn product_f64<T: Copy>(
    a: &[T],
    b: &[T],
    (m, k, n): (usize, usize, usize),
    f: fn(T) -> f64,
) -> Vec<f64> {
    (0..m * n)
        .map(|e| {
            (0..k)
                .map(|t| f(a[e / n * k + t]) * f(b[t * n + e % n]))
                .sum()
        })
        .collect()
}

/// Every element of `c` written (no NaN) and within 1e-5 of `want`.
fn check(c: &[f32], want: &[f64], what: &str) {
    assert_eq!(c.len(), want.len(), "{what}");
    let nan = c.iter().position(|x| !x.is_finite());
    assert!(nan.is_none(), "{what}: element {nan:?} not written");
    let c: Vec<f64> = c.iter().map(|&x| f64::from(x)).collect();
    let e = common::rel(&c, want);
    assert!(e <= 1e-5, "{what}: {e}");
}

fn to_bf16(v: &[f32]) -> Vec<half::bf16> {
    v.iter().map(|&x| half::bf16::from_f32(x)).collect()
}
