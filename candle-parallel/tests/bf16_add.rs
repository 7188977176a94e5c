//! The workspace's candle-core patch `bf16-add` (third_party/README.md): bf16 additions on
//! AVX512-BF16 CPUs run 16 lanes at a time with the conversions inlined. The result must stay
//! candle's: the f32 sum of the two values rounded to nearest even, for every length (vector
//! body and scalar tail), ties, signed zeros, infinities and NaN.

use candle_core::{Device, Result, Tensor};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// `a + b` in bf16 by the rule candle's addition follows: the exact f32 sum (two bf16 values
/// add exactly in f32 unless their exponents differ by more than 16; rounded once there)
/// rounded to nearest even. Inputs here stay in the normal range, where `vcvtneps2bf16` (which
/// flushes subnormal inputs) and `half`'s conversion agree.
fn expected(a: bf16, b: bf16) -> bf16 {
    bf16::from_f32(a.to_f32() + b.to_f32())
}

fn check(a: &[bf16], b: &[bf16], what: &str) -> Result<()> {
    let n = a.len();
    let ta = Tensor::from_slice(a, n, &Device::Cpu)?;
    let tb = Tensor::from_slice(b, n, &Device::Cpu)?;
    let got = (&ta + &tb)?.to_vec1::<bf16>()?;
    for i in 0..n {
        let want = expected(a[i], b[i]);
        let same = got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan());
        assert!(
            same,
            "{what}, n={n}, element {i}: {} + {} gave {} ({:#06x}), expected {} ({:#06x})",
            a[i],
            b[i],
            got[i],
            got[i].to_bits(),
            want,
            want.to_bits()
        );
    }
    Ok(())
}

#[test]
fn bf16_addition_rounds_each_f32_sum_to_nearest_even() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(23);
    let value = |rng: &mut StdRng| {
        let m = rng.random_range(0.5f32..2.0) * 2f32.powi(rng.random_range(-20..20));
        bf16::from_f32(if rng.random_bool(0.5) { m } else { -m })
    };
    for n in (0..70).chain([4096 + 5, 100_003]) {
        let a: Vec<bf16> = (0..n).map(|_| value(&mut rng)).collect();
        let b: Vec<bf16> = (0..n).map(|_| value(&mut rng)).collect();
        check(&a, &b, "random")?;
    }
    // Ties (1 + 2^-8 lies halfway between two bf16 values: to the even one), cancellation to
    // +0 and -0, overflow to inf, inf - inf and NaN; placed in the vector body (first 16) and
    // repeated into the tail.
    let ulp = 2f32.powi(-8);
    let pairs: Vec<(f32, f32)> = vec![
        (1.0, ulp),
        (1.0 + 2.0 * ulp, ulp),
        (-1.0, -ulp),
        (3.0, -3.0),
        (-0.0, -0.0),
        (0.0, -0.0),
        (3.0e38, 3.0e38),
        (f32::INFINITY, 1.0),
        (f32::INFINITY, f32::NEG_INFINITY),
        (f32::NAN, 1.0),
        (1.0, f32::NAN),
        (65504.0, 0.5),
        (1e-30, 1.0),
        (-2.5, 0.75),
        (7.0, 2.0 * ulp),
        (1.5, 1.5 * ulp),
        (-1.0 - 2.0 * ulp, -ulp),
    ];
    let (a, b): (Vec<bf16>, Vec<bf16>) = pairs
        .iter()
        .cycle()
        .take(3 * pairs.len())
        .map(|&(x, y)| (bf16::from_f32(x), bf16::from_f32(y)))
        .unzip();
    check(&a, &b, "special values")?;
    Ok(())
}
