//! The composite paths of the fused ops (what they run on CUDA and Metal: the same function from
//! plain differentiable candle ops) against the CPU kernels, on the CPU: outputs and the
//! gradients of every input, f32, bf16 and f16, contiguous and strided inputs; the chunked
//! vocab-parallel cross-entropy on 1, 2 and 4 local ranks against its composite (autograd and
//! differentiable collectives), ignored labels included; and identical validation errors.
//!
//! The composite path is forced on CPU tensors by calling the `#[doc(hidden)]` public
//! composites directly: `ops::{rms_norm_composite, swiglu_composite, gelu_tanh_composite}`,
//! `RotaryEmbedding::apply_composite` and `nn::loss::vocab_parallel_cross_entropy_composite`.
//!
//! Tolerances (max-norm relative error `max|a - b| / max|b|`, `b` the kernel's result, see
//! `testkit`):
//! - f32: 1e-5. Both paths compute in f32 and differ only in the order of their f32 sums and
//!   products (observed: at most 5e-7).
//! - bf16: [`BF16_TOL`] = 2^-7 (7.8e-3), one bf16 ulp at the scale of the largest element. Both
//!   paths compute in f32 from the same bf16 values, round at the same points (the composites
//!   round where the kernels do, forward only, and cast each result once) and so differ only
//!   where f32 values a few f32 ulps apart fall on either side of a bf16 rounding boundary: one
//!   ulp of that element, at most 2^-7 of it (8 significant bits). Such flips are rare (about
//!   2^-14 per element), so bf16/f16 results must also be bit-identical on all but
//!   [`MAX_DIFFERING`] (1%) of their elements: a rounding point that one path misses makes a
//!   large share of the elements differ by one ulp, which the tolerance alone would not catch
//!   (checked by removing the composites' intermediate rounding: 26% and 25% of the bf16
//!   SwiGLU and RMSNorm outputs then differ). Observed: bit-identical but for one element.
//! - f16: [`F16_TOL`] = 2^-10 (9.8e-4), the same argument with 11 significant bits (observed: at
//!   most 5.7e-4, at most 10 differing elements of 30720).
//! - RoPE runs in the dtype on both paths, product for product and sum for sum (HF's rounding
//!   points), and is asserted bit-identical in every dtype, forward and backward.
//! - The loss computes in f32 from the inputs' values in every dtype: 1e-5 for the loss;
//!   gradients, rounded once to the dtype, with the dtype's tolerance above.

mod common;
use common::{grad, signed_values, world, zigzag};

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_parallel::comm::Comm;
use candle_parallel::nn::loss::vocab_parallel_cross_entropy_composite;
use candle_parallel::nn::{vocab_parallel_cross_entropy, CrossEntropyOptions, IGNORE_INDEX};
use candle_parallel::ops::{
    gelu_tanh, gelu_tanh_composite, rms_norm, rms_norm_composite, swiglu, swiglu_composite,
    RopeScaling, RotaryEmbedding,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// f32: relative tolerance 1e-5 (see the docs at the top of this file).
const F32_TOL: f64 = 1e-5;
/// bf16: one ulp of the largest element, 2^-7 relative (see the docs at the top of this file).
const BF16_TOL: f64 = 1.0 / 128.0;
/// f16: one ulp of the largest element, 2^-10 relative.
const F16_TOL: f64 = 1.0 / 1024.0;

const DTYPES: [(DType, f64); 3] = [
    (DType::F32, F32_TOL),
    (DType::BF16, BF16_TOL),
    (DType::F16, F16_TOL),
];

/// A tensor of `dims` with non-zero values of magnitude in `[0.05, 2)` and a random sign, rounded
/// to `dtype`.
fn rand_t(rng: &mut StdRng, dims: &[usize], dtype: DType) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(signed_values(rng, n, 0.05, 2.0), dims, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
}

fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).unwrap()
}

/// `f(inputs)` and the gradients of `sum(f(inputs) * g)` with respect to every input, asserting
/// that each receives one (with the input's shape and dtype).
fn value_and_grads(
    what: &str,
    inputs: &[&Var],
    g: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let ts: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts).unwrap_or_else(|e| panic!("{what}: {e}"));
    let loss = (&out * g).and_then(|t| t.sum_all()).unwrap();
    let grads = loss.backward().unwrap();
    let gs = inputs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let gi = grad(&grads, v, &format!("{what}: input {i}")).unwrap();
            assert_eq!(gi.dims(), v.dims(), "{what}: gradient {i} shape");
            assert_eq!(gi.dtype(), v.dtype(), "{what}: gradient {i} dtype");
            gi
        })
        .collect();
    (out, gs)
}

/// Runs `fused` and `composite` on the same inputs and upstream gradient `g` and compares the
/// outputs and every input gradient: bit-identical when `tol` is `None`.
fn compare(
    what: &str,
    inputs: &[&Var],
    g: &Tensor,
    tol: Option<f64>,
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    composite: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let (out_f, grads_f) = value_and_grads(&format!("{what} fused"), inputs, g, fused);
    let (out_c, grads_c) = value_and_grads(&format!("{what} composite"), inputs, g, composite);
    assert_eq!(out_c.dtype(), out_f.dtype(), "{what}: output dtype");
    let low_precision = inputs[0].dtype() != DType::F32;
    let check = |got: &Tensor, want: &Tensor, name: String| match tol {
        Some(tol) => {
            testkit::assert_close(got, want, tol, &name);
            if low_precision {
                assert_rarely_differ(got, want, &name);
            }
        }
        None => testkit::assert_identical(got, want, &name),
    };
    check(&out_c, &out_f, format!("{what}: output"));
    for (i, (gc, gf)) in grads_c.iter().zip(&grads_f).enumerate() {
        check(gc, gf, format!("{what}: gradient of input {i}"));
    }
}

/// Asserts that at most [`MAX_DIFFERING`] of the elements of two bf16/f16 results differ. Both
/// paths round at the same points from f32 values a few f32 ulps apart, so a rounding lands on
/// different sides of a boundary with a probability of about 2^-14 per element (bf16) or 2^-11
/// (f16); a rounding point that one path misses or adds makes a large share of the elements
/// differ by an ulp, which the max-norm tolerance alone would not catch.
#[track_caller]
fn assert_rarely_differ(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (testkit::values(got), testkit::values(want));
    let differ = g
        .iter()
        .zip(&w)
        // Compared as values: a zero's sign is not a rounding point (candle keeps a `-0`
        // gradient where one path multiplies by a zero and the other stores `0 + -0`).
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ as f64 <= MAX_DIFFERING * g.len() as f64,
        "{what}: {differ} of {} elements differ (more than {MAX_DIFFERING} of them: a rounding \
         point differs between the paths)",
        g.len()
    );
}

/// The largest share of elements whose bits may differ between the paths in bf16/f16.
const MAX_DIFFERING: f64 = 0.01;

/// Both results are errors with the same message.
#[track_caller]
fn assert_same_error<T: std::fmt::Debug, E: std::fmt::Display>(
    what: &str,
    fused: std::result::Result<T, E>,
    composite: std::result::Result<T, E>,
) {
    let f = fused.expect_err(&format!("{what}: the fused path accepted it"));
    let c = composite.expect_err(&format!("{what}: the composite path accepted it"));
    // Messages without candle's backtrace (captured when RUST_BACKTRACE is set), which names
    // the calling function.
    let message = |e: E| {
        let s = e.to_string();
        s.split("\n   0: ").next().unwrap_or_default().to_string()
    };
    let (f, c) = (message(f), message(c));
    assert!(!f.is_empty(), "{what}: empty error message");
    assert_eq!(c, f, "{what}: errors differ");
}

// ---------------------------------------------------------------- RMSNorm

const EPS: f64 = 1e-5;

#[test]
fn rms_norm_composite_matches_kernel() {
    let mut rng = StdRng::seed_from_u64(31);
    for (dt, tol) in DTYPES {
        // Contiguous, several backward blocks of rows.
        let x = var(&rand_t(&mut rng, &[3, 40, 256], dt));
        let w = var(&rand_t(&mut rng, &[256], dt));
        let g = rand_t(&mut rng, &[3, 40, 256], dt);
        compare(
            &format!("rms_norm contiguous {dt:?}"),
            &[&x, &w],
            &g,
            Some(tol),
            &|t| rms_norm(&t[0], &t[1], EPS),
            &|t| rms_norm_composite(&t[0], &t[1], EPS),
        );
        // Transposed: stored (2, 48, 5), used as (2, 5, 48); and a narrowed weight.
        let x = var(&rand_t(&mut rng, &[2, 48, 5], dt));
        let w = var(&rand_t(&mut rng, &[60], dt));
        let g = rand_t(&mut rng, &[2, 5, 48], dt);
        compare(
            &format!("rms_norm transposed {dt:?}"),
            &[&x, &w],
            &g,
            Some(tol),
            &|t| rms_norm(&t[0].transpose(1, 2)?, &t[1].narrow(0, 7, 48)?, EPS),
            &|t| rms_norm_composite(&t[0].transpose(1, 2)?, &t[1].narrow(0, 7, 48)?, EPS),
        );
        // Per-head (QK-norm) on GQA-shaped keys: (batch, seq, kv_heads, head_dim) taken from a
        // (batch, kv_heads, seq, head_dim) tensor, one weight of head_dim, a larger eps.
        let x = var(&rand_t(&mut rng, &[2, 2, 7, 32], dt));
        let w = var(&rand_t(&mut rng, &[32], dt));
        let g = rand_t(&mut rng, &[2, 7, 2, 32], dt);
        compare(
            &format!("rms_norm per head {dt:?}"),
            &[&x, &w],
            &g,
            Some(tol),
            &|t| rms_norm(&t[0].transpose(1, 2)?, &t[1], 1e-2),
            &|t| rms_norm_composite(&t[0].transpose(1, 2)?, &t[1], 1e-2),
        );
    }
}

#[test]
fn rms_norm_composite_has_the_same_errors() {
    let mut rng = StdRng::seed_from_u64(32);
    let x = rand_t(&mut rng, &[2, 3, 16], DType::F32);
    let w = rand_t(&mut rng, &[16], DType::F32);
    let cases: [(&str, Tensor, Tensor, f64); 6] = [
        (
            "weight dtype",
            x.clone(),
            w.to_dtype(DType::BF16).unwrap(),
            EPS,
        ),
        ("weight length", x.clone(), w.narrow(0, 0, 8).unwrap(), EPS),
        (
            "scalar x",
            Tensor::new(1f32, &Device::Cpu).unwrap(),
            w.clone(),
            EPS,
        ),
        (
            "integer dtype",
            x.to_dtype(DType::U32).unwrap(),
            w.to_dtype(DType::U32).unwrap(),
            EPS,
        ),
        ("negative eps", x.clone(), w.clone(), -1.0),
        ("NaN eps", x.clone(), w.clone(), f64::NAN),
    ];
    for (what, x, w, eps) in cases {
        assert_same_error(
            &format!("rms_norm {what}"),
            rms_norm(&x, &w, eps),
            rms_norm_composite(&x, &w, eps),
        );
    }
}

// ---------------------------------------------------------------- RoPE

#[test]
fn rope_composite_is_bit_identical_to_kernel() {
    let mut rng = StdRng::seed_from_u64(33);
    let scalings = [
        RopeScaling::Default,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
    ];
    for (si, scaling) in scalings.iter().enumerate() {
        let rope = RotaryEmbedding::new(32, 500_000.0, scaling).unwrap();
        let positions = zigzag(6, 100_000 * si as u32);
        for (dt, _) in DTYPES {
            // GQA: 8 query heads and 2 key heads, both stored (batch, heads, seq, head_dim) and
            // used as (batch, seq, heads, head_dim).
            for heads in [8, 2] {
                let x = var(&rand_t(&mut rng, &[2, heads, 6, 32], dt));
                let g = rand_t(&mut rng, &[2, 6, heads, 32], dt);
                compare(
                    &format!("rope {scaling:?} {dt:?} {heads} heads transposed"),
                    &[&x],
                    &g,
                    None,
                    &|t| rope.apply(&t[0].transpose(1, 2)?, &positions),
                    &|t| rope.apply_composite(&t[0].transpose(1, 2)?, &positions),
                );
            }
            // Contiguous, positions 0..seq; and the rotary part narrowed out of a wider head.
            let pos: Vec<u32> = (0..9).collect();
            let x = var(&rand_t(&mut rng, &[3, 9, 2, 32], dt));
            let g = rand_t(&mut rng, &[3, 9, 2, 32], dt);
            compare(
                &format!("rope {scaling:?} {dt:?} contiguous"),
                &[&x],
                &g,
                None,
                &|t| rope.apply(&t[0], &pos),
                &|t| rope.apply_composite(&t[0], &pos),
            );
            let x = var(&rand_t(&mut rng, &[1, 9, 3, 48], dt));
            let g = rand_t(&mut rng, &[1, 9, 3, 32], dt);
            compare(
                &format!("rope {scaling:?} {dt:?} narrowed"),
                &[&x],
                &g,
                None,
                &|t| rope.apply(&t[0].narrow(3, 8, 32)?, &pos),
                &|t| rope.apply_composite(&t[0].narrow(3, 8, 32)?, &pos),
            );
        }
    }
}

#[test]
fn rope_composite_has_the_same_errors() {
    let mut rng = StdRng::seed_from_u64(34);
    let rope = RotaryEmbedding::new(8, 10_000.0, &RopeScaling::Default).unwrap();
    let x = rand_t(&mut rng, &[1, 4, 2, 8], DType::F32);
    let cases: [(&str, Tensor, Vec<u32>); 5] = [
        ("short positions", x.clone(), vec![0, 1, 2]),
        ("long positions", x.clone(), vec![0, 1, 2, 3, 4]),
        (
            "head_dim",
            rand_t(&mut rng, &[1, 4, 2, 16], DType::F32),
            vec![0, 1, 2, 3],
        ),
        (
            "rank 3",
            rand_t(&mut rng, &[4, 2, 8], DType::F32),
            vec![0, 1, 2, 3],
        ),
        (
            "integer dtype",
            x.to_dtype(DType::U32).unwrap(),
            vec![0, 1, 2, 3],
        ),
    ];
    for (what, x, pos) in cases {
        assert_same_error(
            &format!("rope {what}"),
            rope.apply(&x, &pos),
            rope.apply_composite(&x, &pos),
        );
    }
}

// ---------------------------------------------------------------- SwiGLU

#[test]
fn swiglu_composite_matches_kernel() {
    let mut rng = StdRng::seed_from_u64(35);
    for (dt, tol) in DTYPES {
        // Gate values up to ±6 reach both tails of silu.
        let gate = var(&(rand_t(&mut rng, &[3, 5000], dt) * 3.0).unwrap());
        let up = var(&rand_t(&mut rng, &[3, 5000], dt));
        let g = rand_t(&mut rng, &[3, 5000], dt);
        compare(
            &format!("swiglu contiguous {dt:?}"),
            &[&gate, &up],
            &g,
            Some(tol),
            &|t| swiglu(&t[0], &t[1]),
            &|t| swiglu_composite(&t[0], &t[1]),
        );
        // gate transposed (stored (2, 24, 7)), up narrowed (from (2, 9, 24)); used as (2, 7, 24).
        let gate = var(&(rand_t(&mut rng, &[2, 24, 7], dt) * 3.0).unwrap());
        let up = var(&rand_t(&mut rng, &[2, 9, 24], dt));
        let g = rand_t(&mut rng, &[2, 7, 24], dt);
        compare(
            &format!("swiglu strided {dt:?}"),
            &[&gate, &up],
            &g,
            Some(tol),
            &|t| swiglu(&t[0].transpose(1, 2)?, &t[1].narrow(1, 1, 7)?),
            &|t| swiglu_composite(&t[0].transpose(1, 2)?, &t[1].narrow(1, 1, 7)?),
        );
    }
}

#[test]
fn swiglu_composite_has_the_same_errors() {
    let mut rng = StdRng::seed_from_u64(36);
    let a = rand_t(&mut rng, &[4, 6], DType::F32);
    let cases: [(&str, Tensor, Tensor); 3] = [
        (
            "dtype mismatch",
            a.clone(),
            a.to_dtype(DType::BF16).unwrap(),
        ),
        (
            "shape mismatch",
            a.clone(),
            rand_t(&mut rng, &[4, 5], DType::F32),
        ),
        (
            "integer dtype",
            a.to_dtype(DType::U32).unwrap(),
            a.to_dtype(DType::U32).unwrap(),
        ),
    ];
    for (what, gate, up) in cases {
        assert_same_error(
            &format!("swiglu {what}"),
            swiglu(&gate, &up),
            swiglu_composite(&gate, &up),
        );
    }
}

// ---------------------------------------------------------------- GELU (tanh)

#[test]
fn gelu_tanh_composite_matches_kernel() {
    let mut rng = StdRng::seed_from_u64(37);
    for (dt, tol) in DTYPES {
        // Values up to ±6 reach both tails; transposed (strided) and larger than one chunk.
        for shape in [[3usize, 24, 7], [2, 5000, 1]] {
            let x = var(&(rand_t(&mut rng, &shape, dt) * 3.0).unwrap());
            let g = rand_t(&mut rng, &[shape[0], shape[2], shape[1]], dt);
            compare(
                &format!("gelu_tanh {dt:?} {shape:?}"),
                &[&x],
                &g,
                Some(tol),
                &|t| gelu_tanh(&t[0].transpose(1, 2)?),
                &|t| gelu_tanh_composite(&t[0].transpose(1, 2)?),
            );
        }
    }
}

#[test]
fn gelu_tanh_composite_has_the_same_errors() {
    let x = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    assert_same_error(
        "gelu_tanh integer dtype",
        gelu_tanh(&x),
        gelu_tanh_composite(&x),
    );
}

// ---------------------------------------------------------------- cross-entropy

/// Labels in `[0, vocab)`, every `ignore_every`-th one (the first included) set to `ignore`.
fn rand_labels(
    rng: &mut StdRng,
    n: usize,
    vocab: usize,
    ignore_every: usize,
    ignore: i64,
) -> Tensor {
    let v: Vec<i64> = (0..n)
        .map(|i| {
            if i % ignore_every == 0 {
                ignore
            } else {
                rng.random_range(0..vocab as i64)
            }
        })
        .collect();
    Tensor::new(v.as_slice(), &Device::Cpu).unwrap()
}

/// Rows of shard `r` of `p` of `t` (dim 0).
fn shard(t: &Tensor, p: usize, r: usize) -> Result<Tensor> {
    let c = t.dim(0)? / p;
    t.narrow(0, r * c, c)
}

type LossFn = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    &Comm,
    &CrossEntropyOptions,
) -> candle_parallel::Result<(Tensor, usize)>;

/// This rank's loss sum, count and the gradients of `scale · loss` with respect to `hidden` and
/// its weight shard (both must receive one).
fn rank_run(
    f: LossFn,
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    comm: &Comm,
    opts: &CrossEntropyOptions,
    scale: f64,
) -> Result<(f32, usize, Tensor, Tensor)> {
    let h = Var::from_tensor(hidden)?;
    let w = Var::from_tensor(&shard(weight, comm.size(), comm.rank())?)?;
    let (loss, count) = f(h.as_tensor(), w.as_tensor(), labels, comm, opts)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    assert_eq!(loss.dtype(), DType::F32);
    assert_eq!(loss.dims(), &[] as &[usize]);
    let grads = loss.affine(scale, 0.)?.backward()?;
    let gh = grad(&grads, &h, "hidden")?;
    let gw = grad(&grads, &w, "weight shard")?;
    assert_eq!(gh.dtype(), hidden.dtype());
    assert_eq!(gw.dtype(), weight.dtype());
    Ok((loss.to_scalar::<f32>()?, count, gh, gw))
}

#[test]
fn cross_entropy_composite_matches_fused() {
    let mut rng = StdRng::seed_from_u64(38);
    let (n, h, v) = (37usize, 16usize, 64usize);
    // (chunk tokens, ignore index, upstream gradient, dtype, gradient tolerance)
    let cases = [
        (8, IGNORE_INDEX, 1.0, DType::F32, F32_TOL),
        (5, -1, 0.37, DType::F32, F32_TOL),
        (64, IGNORE_INDEX, 1.0, DType::F32, F32_TOL),
        (8, IGNORE_INDEX, 1.0, DType::BF16, BF16_TOL),
        (16, IGNORE_INDEX, 0.5, DType::F16, F16_TOL),
    ];
    for (chunk, ignore, scale, dt, tol) in cases {
        let hidden = rand_t(&mut rng, &[n, h], dt);
        let weight = rand_t(&mut rng, &[v, h], dt);
        let labels = rand_labels(&mut rng, n, v, 5, ignore);
        let expected_count = n - n.div_ceil(5);
        // The fused loss with its gradients recomputed in the backward, and taken in the
        // forward (eager).
        for (p, eager) in [1, 2, 4].into_iter().flat_map(|p| [(p, false), (p, true)]) {
            let opts = CrossEntropyOptions {
                chunk_tokens: chunk,
                ignore_index: ignore,
                softcap: None,
                eager_gradients: eager,
            };
            let what = format!("{dt:?} chunk={chunk} ignore={ignore} P={p} eager {eager}");
            let out = world(p, |comm| {
                let fused = rank_run(
                    vocab_parallel_cross_entropy,
                    &hidden,
                    &weight,
                    &labels,
                    &comm,
                    &opts,
                    scale,
                )?;
                let composite = rank_run(
                    vocab_parallel_cross_entropy_composite,
                    &hidden,
                    &weight,
                    &labels,
                    &comm,
                    &opts,
                    scale,
                )?;
                Ok((fused, composite))
            });
            for (r, ((lf, cf, ghf, gwf), (lc, cc, ghc, gwc))) in out.iter().enumerate() {
                let what = format!("{what} rank {r}");
                assert_eq!(*cf, expected_count, "{what}: fused count");
                assert_eq!(*cc, expected_count, "{what}: composite count");
                testkit::assert_close_scalar(
                    *lc as f64,
                    *lf as f64,
                    F32_TOL,
                    &format!("{what}: loss"),
                );
                testkit::assert_close(ghc, ghf, tol, &format!("{what}: d_hidden"));
                testkit::assert_close(gwc, gwf, tol, &format!("{what}: d_weight"));
                // Replicated results are identical on every rank, on both paths.
                let (l0, _, gh0, _) = &out[0].1;
                assert_eq!(lc, l0, "{what}: composite loss differs from rank 0");
                testkit::assert_identical(
                    ghc,
                    gh0,
                    &format!("{what}: composite d_hidden vs rank 0"),
                );
            }
        }
    }
}

#[test]
fn cross_entropy_composite_has_the_same_errors() {
    let mut rng = StdRng::seed_from_u64(39);
    let hidden = rand_t(&mut rng, &[6, 4], DType::F32);
    let weight = rand_t(&mut rng, &[8, 4], DType::F32);
    let labels = Tensor::new(&[0i64, 1, 2, IGNORE_INDEX, 4, 5], &Device::Cpu).unwrap();
    let opts = CrossEntropyOptions::default();
    let bad_labels = Tensor::new(&[0i64, 1, 2, 3, 8, 5], &Device::Cpu).unwrap();
    let cases: Vec<(&str, Tensor, Tensor, Tensor, CrossEntropyOptions)> = vec![
        (
            "chunk_tokens 0",
            hidden.clone(),
            weight.clone(),
            labels.clone(),
            CrossEntropyOptions {
                chunk_tokens: 0,
                ..opts
            },
        ),
        (
            "hidden rank",
            hidden.flatten_all().unwrap(),
            weight.clone(),
            labels.clone(),
            opts,
        ),
        (
            "hidden size",
            hidden.clone(),
            weight.narrow(1, 0, 3).unwrap(),
            labels.clone(),
            opts,
        ),
        (
            "labels length",
            hidden.clone(),
            weight.clone(),
            labels.narrow(0, 0, 5).unwrap(),
            opts,
        ),
        (
            "labels dtype",
            hidden.clone(),
            weight.clone(),
            labels.to_dtype(DType::F32).unwrap(),
            opts,
        ),
        (
            "integer hidden",
            hidden.to_dtype(DType::U32).unwrap(),
            weight.clone(),
            labels.clone(),
            opts,
        ),
        (
            "label out of range",
            hidden.clone(),
            weight.clone(),
            bad_labels,
            opts,
        ),
    ];
    world(1, |comm| {
        for (what, h, w, l, o) in &cases {
            assert_same_error(
                &format!("cross-entropy {what}"),
                vocab_parallel_cross_entropy(h, w, l, &comm, o),
                vocab_parallel_cross_entropy_composite(h, w, l, &comm, o),
            );
        }
        Ok(())
    });
}
