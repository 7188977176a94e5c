//! The workspace's candle-core patch `reduce-sum-runs` (third_party/README.md): a sum over
//! leading dims (a bias's or a broadcast's gradient) adds whole runs of the kept trailing dims
//! instead of one element at a time. It must give candle's result bit for bit: every output
//! element is the sum of its inputs in increasing index order, one rounding per addition.
//!
//! The inputs mix magnitudes (1e-3 to 1e4) so that any other order of the additions changes
//! the low bits of most outputs.

use candle_core::{DType, Device, Result, Tensor};

/// Random values of mixed magnitude, deterministic.
fn mixed(shape: &[usize], seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let scale = [1e-3f32, 1.0, 37.0, 1e4][(state >> 20) as usize % 4];
            (u - 0.5) * scale
        })
        .collect()
}

/// The reference: each output element is the sum, in increasing source index, of the inputs
/// whose index agrees with it on every kept dim (`add` rounds after each addition).
fn sequential_sum<T: Copy>(
    values: &[T],
    shape: &[usize],
    reduced: &[usize],
    zero: T,
    add: impl Fn(T, T) -> T,
) -> Vec<T> {
    let out_shape: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &n)| if reduced.contains(&d) { 1 } else { n })
        .collect();
    let mut out = vec![zero; out_shape.iter().product()];
    for (i, &v) in values.iter().enumerate() {
        // The multi-index of `i`, then its output index with the reduced dims at 0.
        let mut rest = i;
        let mut index = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            index[d] = rest % shape[d];
            rest /= shape[d];
        }
        let mut o = 0;
        for d in 0..shape.len() {
            o = o * out_shape[d] + if reduced.contains(&d) { 0 } else { index[d] };
        }
        out[o] = add(out[o], v);
    }
    out
}

/// (shape, reduced dims): leading dims, a middle dim, two separated dims, runs of one. The
/// last dim is kept in each: a sum over trailing dims takes candle's vectorised row sum
/// (`vec_reduce_sum`), whose order is its own and which the patch does not touch.
const CASES: &[(&[usize], &[usize])] = &[
    (&[513, 96], &[0]),
    (&[8, 256, 40], &[0, 1]),
    (&[6, 33, 17], &[1]),
    (&[5, 7, 3, 24], &[0, 2]),
    (&[12, 1], &[0]),
];

#[test]
fn sums_over_leading_dims_are_sequential_bit_for_bit_f32() -> Result<()> {
    for (k, &(shape, reduced)) in CASES.iter().enumerate() {
        let values = mixed(shape, k as u64 + 1);
        let t = Tensor::from_vec(values.clone(), shape, &Device::Cpu)?;
        let got: Vec<f32> = t.sum_keepdim(reduced)?.flatten_all()?.to_vec1()?;
        let want = sequential_sum(&values, shape, reduced, 0f32, |a, b| a + b);
        assert_eq!(got.len(), want.len(), "{shape:?} over {reduced:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{shape:?} over {reduced:?}, element {i}: {g} vs sequential {w}"
            );
        }
        // A strided (transposed) input takes candle's element loop: the same sums.
        if shape.len() >= 2 && shape[0] > 1 && shape[shape.len() - 1] > 1 {
            let last = shape.len() - 1;
            let tt = t.transpose(0, last)?.contiguous()?.transpose(0, last)?;
            assert!(!tt.is_contiguous());
            let strided: Vec<f32> = tt.sum_keepdim(reduced)?.flatten_all()?.to_vec1()?;
            assert_eq!(strided, got, "{shape:?} over {reduced:?}, strided input");
        }
    }
    Ok(())
}

/// bf16 sums (patch `sum-f32`): the same sequential order, accumulated in f32 and
/// rounded once to bf16 at the end, as PyTorch sums half-precision tensors (in bf16, every
/// addition rounded to 8 bits, a long sum stops growing; see the bias test below).
#[test]
fn sums_over_leading_dims_are_sequential_bit_for_bit_bf16() -> Result<()> {
    for (k, &(shape, reduced)) in CASES.iter().enumerate() {
        let t = Tensor::from_vec(mixed(shape, k as u64 + 11), shape, &Device::Cpu)?
            .to_dtype(DType::BF16)?;
        let values: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        let got: Vec<half::bf16> = t.sum_keepdim(reduced)?.flatten_all()?.to_vec1()?;
        let want: Vec<half::bf16> = sequential_sum(&values, shape, reduced, 0f32, |a, b| a + b)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "bf16 {shape:?} over {reduced:?}, element {i}: {g} vs sequential {w}"
            );
        }
        // The same values as a view at an offset of a larger buffer (contiguous) and as a
        // transposed view (strided): the widening takes each layout as it is, the same sums.
        let bits = |v: Vec<half::bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let padded = Tensor::cat(&[&t.narrow(0, 0, 1)?, &t], 0)?.narrow(0, 1, shape[0])?;
        assert!(padded.is_contiguous());
        let offset: Vec<half::bf16> = padded.sum_keepdim(reduced)?.flatten_all()?.to_vec1()?;
        assert_eq!(
            bits(offset),
            bits(got.clone()),
            "bf16 {shape:?}: view at an offset"
        );
        if shape.len() >= 2 && shape[0] > 1 && shape[shape.len() - 1] > 1 {
            let last = shape.len() - 1;
            let tt = t.transpose(0, last)?.contiguous()?.transpose(0, last)?;
            assert!(!tt.is_contiguous());
            let strided: Vec<half::bf16> = tt.sum_keepdim(reduced)?.flatten_all()?.to_vec1()?;
            assert_eq!(
                bits(strided),
                bits(got.clone()),
                "bf16 {shape:?}: strided input"
            );
        }
    }
    Ok(())
}

/// A bias's gradient, the case the patch is for: `y = x W^T + b` (b broadcast over the rows).
/// Its gradient is the column sum of the upstream gradient, in row order.
#[test]
fn a_broadcast_bias_gets_the_row_order_column_sum() -> Result<()> {
    let (rows, n) = (300, 48);
    let upstream = mixed(&[rows, n], 99);
    let g = Tensor::from_vec(upstream.clone(), (rows, n), &Device::Cpu)?;
    let b = candle_core::Var::zeros(n, DType::F32, &Device::Cpu)?;
    let x = Tensor::from_vec(mixed(&[rows, n], 7), (rows, n), &Device::Cpu)?;
    let y = x.broadcast_add(b.as_tensor())?;
    let grads = (y * &g)?.sum_all()?.backward()?;
    let got: Vec<f32> = grads
        .get(b.as_tensor())
        .expect("the bias gets a gradient")
        .to_vec1()?;
    let want = sequential_sum(&upstream, &[rows, n], &[0], 0f32, |a, b| a + b);
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert!(got.iter().any(|&v| v != 0.0));
    Ok(())
}

/// A bf16 bias's gradient over 4096 rows, and a bf16 sum over the trailing dim (the other
/// code path: a broadcast weight's gradient, e.g. MoE routing weights times expert outputs):
/// within one bf16 rounding (2^-8 relative) of the float64 sum. Summed in bf16 (candle's
/// own), the bias's sums stopped near 1024 where they should reach about 2100 (53% off).
#[test]
fn bf16_sums_are_within_one_rounding_of_float64() -> Result<()> {
    let (rows, n) = (4096, 24);
    // Upstream gradients of mean 0.5 (a loss's usually have a sign).
    let up: Vec<f32> = mixed(&[rows, n], 77)
        .iter()
        .map(|v| 0.5 + (v / 1e4).clamp(-0.4, 0.4))
        .collect();
    let t = Tensor::from_vec(up, (rows, n), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let exact = t.to_dtype(DType::F64)?;
    for (what, dim) in [("over rows", 0), ("over the trailing dim", 1)] {
        let got: Vec<f32> = t
            .sum_keepdim(dim)?
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let want: Vec<f64> = exact.sum_keepdim(dim)?.flatten_all()?.to_vec1()?;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let rel = (g as f64 - w).abs() / w.abs();
            assert!(
                rel <= 2f64.powi(-8),
                "{what}, element {i}: {g} vs float64 {w} ({rel:e})"
            );
        }
    }
    Ok(())
}
