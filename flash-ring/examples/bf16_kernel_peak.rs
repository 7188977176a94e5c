//! How fast the bf16 register block of `gemm_bf16` can run on this CPU, away from everything
//! around it: one thread, `vdpbf16ps` on `MR` rows of A (each depth pair broadcast) times `NV`
//! 16-lane vectors of a B panel, summed in registers over `pairs` depth pairs, the sums added to
//! C once per block; the loop and the operands' layout of the real kernel
//! (`flash_ring::cpu::gemm_bf16`, groups of 8 rows), at several register blockings and operand
//! footprints (B from L1, L2; A streaming from L2, L3).
//!
//! `cargo run -p flash-ring --release --example bf16_kernel_peak`. Prints GFLOP/s per thread
//! (2 FLOPs per product; one `vdpbf16ps` is 32 products). Needs AVX512-BF16; elsewhere it says
//! so and exits. On a Zen 4 EPYC every case ran at 229-235 GFLOP/s (docs/benchmarks.md, "The
//! bf16 register block at the instruction peak"): what a training step loses against this rate is
//! outside the loop.

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::x86_64::*;

    /// `C[MR x 16 NV] += A B` over `pairs` depth pairs: pair `p` of row `i` of A at
    /// `a + i * a_rs + p * a_ps` (in i32 units, one bf16 pair each), B's pair rows of `16 NV`
    /// lanes one after the other.
    ///
    /// # Safety
    /// AVX512-BF16 present; every read and write within the slices the caller passed.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn block<const MR: usize, const NV: usize>(
        pairs: usize,
        a: *const i32,
        a_rs: usize,
        a_ps: usize,
        b: *const f32,
        c: *mut f32,
        c_rs: usize,
    ) {
        let rows: [*const i32; MR] = std::array::from_fn(|i| a.add(i * a_rs));
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let mut bp = b;
        for p in 0..pairs {
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(bp.add(v * 16));
            }
            for (i, ri) in acc.iter_mut().enumerate() {
                let pair = rows[i].add(p * a_ps).read_unaligned();
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                for v in 0..NV {
                    ri[v] =
                        _mm512_dpbf16_ps(ri[v], av, std::mem::transmute::<__m512, __m512bh>(bv[v]));
                }
            }
            bp = bp.add(NV * 16);
        }
        for (i, ri) in acc.iter().enumerate() {
            for (v, x) in ri.iter().enumerate() {
                let cp = c.add(i * c_rs + v * 16);
                _mm512_storeu_ps(cp, _mm512_add_ps(_mm512_loadu_ps(cp), *x));
            }
        }
    }
}

/// Best GFLOP/s of `reps` runs of the product of `rows` rows of A (depth `2 pairs`, groups of 8
/// rows as the real kernel packs a column-major A, or plain rows) with `chunks` panels of B.
#[cfg(target_arch = "x86_64")]
fn run<const MR: usize, const NV: usize>(
    rows: usize,
    chunks: usize,
    pairs: usize,
    grouped: bool,
    reps: usize,
) -> f64 {
    let rows = rows.div_ceil(MR) * MR;
    let a: Vec<i32> = (0..rows * pairs)
        .map(|i| 0x3f80_3f80 ^ (i as i32 & 0x7f))
        .collect();
    let width = NV * 16;
    let b: Vec<f32> = (0..chunks * pairs * width)
        .map(|i| f32::from_bits(0x3f80_3f80 ^ (i as u32 % 13)))
        .collect();
    let mut c = vec![0f32; rows * chunks * width];
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for ch in 0..chunks {
            for i in (0..rows).step_by(MR) {
                let (a_rs, a_ps) = if grouped { (1, MR) } else { (pairs, 1) };
                // SAFETY: AVX512-BF16 was checked by the caller; block `i` of A holds `MR`
                // rows of `pairs` pairs, chunk `ch` of B `pairs * width` lanes, and C's rows
                // `i..i + MR` hold `chunks * width` columns.
                unsafe {
                    kernel::block::<MR, NV>(
                        pairs,
                        a.as_ptr().add(i * pairs),
                        a_rs,
                        a_ps,
                        b.as_ptr().add(ch * pairs * width),
                        c.as_mut_ptr().add(i * chunks * width + ch * width),
                        chunks * width,
                    )
                };
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    (rows * chunks * width * pairs * 4) as f64 / best / 1e9
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        println!("bf16 register block, one thread, GFLOP/s:");
        type Case = (&'static str, fn() -> f64);
        let cases: [Case; 9] = [
            ("8 x 2 vectors (the kernel's), A and B in L1", || {
                run::<8, 2>(64, 4, 128, true, 300)
            }),
            ("4 x 4", || run::<4, 4>(64, 2, 128, true, 300)),
            ("6 x 4", || run::<6, 4>(66, 2, 128, true, 300)),
            ("12 x 2", || run::<12, 2>(72, 4, 128, true, 300)),
            ("8 x 2, B 256 pairs (32 KiB, L1/L2), 512 rows", || {
                run::<8, 2>(512, 4, 256, true, 30)
            }),
            ("8 x 2, B 512 pairs (64 KiB, L2), 512 rows", || {
                run::<8, 2>(512, 4, 512, true, 20)
            }),
            ("8 x 2, B 512 pairs, A as plain rows", || {
                run::<8, 2>(512, 4, 512, false, 20)
            }),
            ("8 x 2, B 2048 pairs (256 KiB, L2), 512 rows", || {
                run::<8, 2>(512, 2, 2048, true, 5)
            }),
            ("8 x 2, B 512 pairs, 4096 rows (A 8 MiB, L3)", || {
                run::<8, 2>(4096, 2, 512, true, 5)
            }),
        ];
        for (name, f) in cases {
            println!("  {name}: {:.1}", f());
        }
        return;
    }
    println!("SKIPPED: this CPU has no AVX512-BF16");
}
