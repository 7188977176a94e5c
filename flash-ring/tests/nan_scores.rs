//! A NaN score poisons exactly the softmax rows that see it, as PyTorch's softmax does: the
//! row's out and lse are NaN, and so is the gradient of its query. The vector exponential maps
//! NaN to 0 (masked scores rely on it), so before this rule a NaN key or query dropped out of its
//! rows' softmax: a NaN in a key projection's weight gave every row `out = 0` and a finite loss,
//! and training went on with a poisoned weight that the non-finite-loss stop never saw.
//!
//! A `+inf` score (an overflow) makes its row NaN too, where the exponential would have made the
//! row look empty.
//!
//! Every path: the CPU kernels (f32; bf16 on the dot products and widened), with a soft-cap,
//! the composite path, and keys split into blocks whose partials are merged (a ring's steps).
//! Rows that cannot see the NaN key (causal rows before it, the other kv head's q heads, the
//! other batch) keep their values bit for bit.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{kernels, to_f64};
use flash_ring::{AttnSpec, Bf16Products, CompositeConfig, KernelConfig, MaskKind, Positions};
use testkit::assert_identical_scalars;

/// (batch, seq, q heads, kv heads, head dim); the NaN sits in key `NAN_AT` of batch 0, kv head 0.
const B: usize = 2;
const S: usize = 200;
const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 32;
const NAN_AT: usize = 130;

/// q, k, v, dout; with `poison`, element 5 of key `NAN_AT` in batch 0, kv head 0 is that value.
fn inputs_with(dtype: DType, poison: Option<f32>) -> [Tensor; 4] {
    let mut r = common::rng(7);
    let q = common::randv(&mut r, B * S * HQ * D);
    let mut k = common::randv(&mut r, B * S * HKV * D);
    let v = common::randv(&mut r, B * S * HKV * D);
    let dout = common::randv(&mut r, B * S * HQ * D);
    if let Some(x) = poison {
        k[(NAN_AT * HKV) * D + 5] = x;
    }
    let dev = Device::Cpu;
    let t = |x: Vec<f32>, h: usize| {
        Tensor::from_vec(x, (B, S, h, D), &dev)
            .and_then(|t| t.to_dtype(dtype))
            .expect("tensor")
    };
    [t(q, HQ), t(k, HKV), t(v, HKV), t(dout, HQ)]
}

fn inputs(dtype: DType, poisoned: bool) -> [Tensor; 4] {
    inputs_with(dtype, poisoned.then_some(f32::NAN))
}

/// Whether query row `s` of q head `h` in batch `b` sees the NaN key.
fn sees_nan(mask: MaskKind, b: usize, s: usize, h: usize) -> bool {
    b == 0 && h / (HQ / HKV) == 0 && (mask == MaskKind::Full || s >= NAN_AT)
}

enum Run {
    Kernel(KernelConfig),
    Composite,
    /// The keys in `n` blocks, each run alone, partials merged, backward per block.
    Blocks(usize),
}

/// out, lse, dq, dk, dv as f64.
fn run(how: &Run, spec: &AttnSpec, x: &[Tensor; 4]) -> [Vec<f64>; 5] {
    let [q, k, v, dout] = x;
    let (out, lse, dq, dk, dv) = match how {
        Run::Kernel(cfg) => {
            let (o, l) = flash_ring::flash_fwd_with_config(q, k, v, spec, cfg).expect("fwd");
            let (a, b, c) =
                flash_ring::flash_bwd_with_config(q, k, v, &o, &l, dout, spec, cfg, false)
                    .expect("bwd");
            (o, l, a, b, c)
        }
        Run::Composite => {
            let cfg = CompositeConfig {
                q_tile: 64,
                k_tile: 48,
            };
            let (o, l) = flash_ring::composite::forward(q, k, v, spec, &cfg).expect("fwd");
            let (a, b, c) =
                flash_ring::composite::backward(q, k, v, &o, &l, dout, spec, &cfg, false)
                    .expect("bwd");
            (o, l, a, b, c)
        }
        Run::Blocks(n) => {
            let cuts: Vec<usize> = (0..=*n).map(|i| i * S / n).collect();
            let block = |t: &Tensor, i: usize| t.narrow(1, cuts[i], cuts[i + 1] - cuts[i]);
            let spec_of = |i: usize| {
                AttnSpec::new(
                    spec.scale,
                    spec.mask,
                    Positions::range(0, S),
                    Positions::range(cuts[i], cuts[i + 1] - cuts[i]),
                )
            };
            let mut acc: Option<(Tensor, Tensor)> = None;
            for i in 0..*n {
                let (kb, vb) = (block(k, i).expect("k"), block(v, i).expect("v"));
                let (o, l) = flash_ring::flash_fwd(q, &kb, &vb, &spec_of(i)).expect("fwd");
                acc = Some(match acc {
                    None => (o.to_dtype(DType::F32).expect("f32"), l),
                    Some((ao, al)) => flash_ring::merge(&ao, &al, &o, &l).expect("merge"),
                });
            }
            let (o, l) = acc.expect("one block at least");
            let o = o.to_dtype(q.dtype()).expect("dtype");
            let (mut dq, mut dks, mut dvs) = (None::<Tensor>, Vec::new(), Vec::new());
            for i in 0..*n {
                let (kb, vb) = (block(k, i).expect("k"), block(v, i).expect("v"));
                let (a, b, c) =
                    flash_ring::flash_bwd_f32(q, &kb, &vb, &o, &l, dout, &spec_of(i)).expect("bwd");
                dq = Some(match dq {
                    None => a,
                    Some(x) => (x + a).expect("sum"),
                });
                dks.push(b);
                dvs.push(c);
            }
            let cat = |v: &[Tensor]| Tensor::cat(v, 1).expect("cat");
            (o, l, dq.expect("dq"), cat(&dks), cat(&dvs))
        }
    };
    [out, lse, dq, dk, dv].map(|t| to_f64(&t))
}

/// The elements of row `s` of head `h` (of `hn` heads) in batch `b` of a (B, S, hn, D) tensor.
fn row(b: usize, s: usize, h: usize, hn: usize) -> std::ops::Range<usize> {
    let o = ((b * S + s) * hn + h) * D;
    o..o + D
}

/// [`check_mask`] under the causal and the full mask.
fn check(name: &str, how: &Run, dtype: DType, softcap: Option<f32>) {
    for mask in [MaskKind::Causal, MaskKind::Full] {
        check_mask(&format!("{name} {mask:?}"), how, dtype, mask, softcap);
    }
}

fn check_mask(name: &str, how: &Run, dtype: DType, mask: MaskKind, softcap: Option<f32>) {
    let mut spec = AttnSpec::dense(0.3, mask, S, S);
    if let Some(c) = softcap {
        spec = spec.with_softcap(c);
    }
    let clean = run(how, &spec, &inputs(dtype, false));
    let got = run(how, &spec, &inputs(dtype, true));
    let [co, cl, ..] = &clean;
    let [go, gl, gdq, gdk, gdv] = &got;
    for b in 0..B {
        for h in 0..HQ {
            for s in 0..S {
                let l = gl[(b * HQ + h) * S + s];
                let (o, dq) = (&go[row(b, s, h, HQ)], &gdq[row(b, s, h, HQ)]);
                let at = format!("{name}: batch {b} head {h} row {s}");
                if sees_nan(mask, b, s, h) {
                    assert!(l.is_nan(), "{at}: lse {l}, not NaN");
                    assert!(o.iter().all(|x| x.is_nan()), "{at}: out not NaN");
                    assert!(dq.iter().all(|x| x.is_nan()), "{at}: dq not NaN");
                } else {
                    // Bit for bit the clean run's values: the NaN key never entered this row.
                    let cl = cl[(b * HQ + h) * S + s];
                    assert_identical_scalars(&[l], &[cl], &format!("{at}: lse"));
                    assert_identical_scalars(o, &co[row(b, s, h, HQ)], &format!("{at}: out"));
                }
            }
        }
    }
    // The keys and values the poisoned rows saw get NaN gradients; the other kv head's and the
    // other batch's are untouched.
    assert!(
        gdk[row(0, 0, 0, HKV)].iter().any(|x| x.is_nan()),
        "{name}: dk"
    );
    assert!(
        gdv[row(0, 0, 0, HKV)].iter().any(|x| x.is_nan()),
        "{name}: dv"
    );
    let [.., cdq, cdk, cdv] = &clean;
    for (g, c, hn, what) in [
        (gdq, cdq, HQ, "dq"),
        (gdk, cdk, HKV, "dk"),
        (gdv, cdv, HKV, "dv"),
    ] {
        // Batch 1 is the second half of each tensor.
        let half = g.len() / 2;
        assert_identical_scalars(
            &g[half..],
            &c[half..],
            &format!("{name}: {what} of batch 1"),
        );
        if what != "dq" {
            for s in 0..S {
                let (x, y) = (&g[row(0, s, 1, hn)], &c[row(0, s, 1, hn)]);
                assert_identical_scalars(x, y, &format!("{name}: {what} of kv head 1"));
            }
        }
    }
}

#[test]
fn a_nan_key_poisons_the_rows_that_see_it_on_the_cpu_kernels() {
    let widened = KernelConfig {
        bf16: Bf16Products::Widen,
        ..KernelConfig::default()
    };
    let dot = || Run::Kernel(kernels());
    check("f32", &dot(), DType::F32, None);
    check("f32 capped", &dot(), DType::F32, Some(5.0));
    check("bf16", &dot(), DType::BF16, None);
    check("bf16 capped", &dot(), DType::BF16, Some(5.0));
    check("bf16 widened", &Run::Kernel(widened), DType::BF16, None);
}

#[test]
fn a_nan_key_poisons_the_rows_that_see_it_on_the_composite_path() {
    check("composite", &Run::Composite, DType::F32, None);
    check("composite capped", &Run::Composite, DType::F32, Some(5.0));
}

#[test]
fn a_nan_key_poisons_the_merged_rows_of_a_ring() {
    for n in [2, 3, 5] {
        check(&format!("{n} blocks"), &Run::Blocks(n), DType::F32, None);
    }
}

/// An infinite key element: the rows whose score is `+inf` (their query's element 5 positive)
/// are NaN, as PyTorch's softmax (`e^(inf - inf)`); the vector exponential alone would have made
/// them look empty (out 0, lse `-inf`). Rows whose score is `-inf` give that key weight 0 and
/// stay finite; rows that cannot see it keep their values bit for bit.
#[test]
fn an_infinite_score_makes_its_row_nan() {
    let widened = KernelConfig {
        bf16: Bf16Products::Widen,
        ..KernelConfig::default()
    };
    let runs = [
        ("f32", Run::Kernel(kernels()), DType::F32),
        ("bf16", Run::Kernel(kernels()), DType::BF16),
        ("bf16 widened", Run::Kernel(widened), DType::BF16),
        ("composite", Run::Composite, DType::F32),
        ("3 blocks", Run::Blocks(3), DType::F32),
    ];
    for (name, how, dtype) in &runs {
        for mask in [MaskKind::Causal, MaskKind::Full] {
            let spec = AttnSpec::dense(0.3, mask, S, S);
            let clean = run(how, &spec, &inputs_with(*dtype, None));
            let x = inputs_with(*dtype, Some(f32::INFINITY));
            let q = to_f64(&x[0]);
            let got = run(how, &spec, &x);
            let (mut nan_rows, mut finite_rows) = (0, 0);
            for b in 0..B {
                for h in 0..HQ {
                    for s in 0..S {
                        let l = got[1][(b * HQ + h) * S + s];
                        let o = &got[0][row(b, s, h, HQ)];
                        let at = format!("{name} {mask:?}: batch {b} head {h} row {s}");
                        if !sees_nan(mask, b, s, h) {
                            let c = &clean[0][row(b, s, h, HQ)];
                            assert_identical_scalars(o, c, &format!("{at}: out"));
                        } else if q[row(b, s, h, HQ).start + 5] >= 0.0 {
                            nan_rows += 1;
                            assert!(l.is_nan() && o.iter().all(|x| x.is_nan()), "{at}: {l}");
                        } else {
                            finite_rows += 1;
                            assert!(l.is_finite() && o.iter().all(|x| x.is_finite()), "{at}");
                        }
                    }
                }
            }
            assert!(
                nan_rows > 10 && finite_rows > 10,
                "{name}: {nan_rows} {finite_rows}"
            );
        }
    }
}

#[test]
fn merging_a_nan_partial_gives_nan() {
    let dev = Device::Cpu;
    let ones = Tensor::ones((1, 3, 2, 4), DType::F32, &dev).expect("ones");
    let nan = Tensor::full(f32::NAN, (1, 2, 3), &dev).expect("nan");
    let ninf = Tensor::full(f32::NEG_INFINITY, (1, 2, 3), &dev).expect("ninf");
    let zero = Tensor::zeros((1, 2, 3), DType::F32, &dev).expect("zero");
    for (la, lb) in [
        (&nan, &zero),
        (&zero, &nan),
        (&nan, &nan),
        (&nan, &ninf),
        (&ninf, &nan),
    ] {
        let (o, l) = flash_ring::merge(&ones, la, &ones, lb).expect("merge");
        assert!(to_f64(&o).iter().all(|x| x.is_nan()));
        assert!(to_f64(&l).iter().all(|x| x.is_nan()));
    }
}
