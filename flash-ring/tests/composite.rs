//! The composite path (candle tensor ops, what non-CPU devices run) forced on CPU tensors:
//! out, lse, dq, dk, dv against the float64 reference within 1e-5 (f32) and 1e-2 (bf16, f16)
//! max-norm relative error, the tolerances the CPU kernels meet (`tests/reference.rs`); and
//! against the CPU kernels themselves, for every mask kind, GQA ratio and tile shape.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{mask_specs, to_f64, Case};
use flash_ring::reference::{attention_bwd_f64, attention_f64};
use flash_ring::{AttnSpec, CompositeConfig, MaskKind, Positions};

const F32_TOL: f64 = 1e-5;
const HALF_TOL: f64 = 1e-2;

/// Tiles that cut every test sequence into several uneven pieces (and a q tile of one row).
const TILES: [CompositeConfig; 3] = [
    CompositeConfig {
        q_tile: 512,
        k_tile: 1024,
    },
    CompositeConfig {
        q_tile: 37,
        k_tile: 50,
    },
    CompositeConfig {
        q_tile: 1,
        k_tile: 128,
    },
];

#[test]
fn every_mask_f32_every_tiling() {
    for (name, spec, sq, sk) in mask_specs(64) {
        eprintln!("mask: {name}");
        for (i, tiles) in TILES.into_iter().enumerate() {
            // The one-row tiles on one shape only (slow in candle ops).
            if i == 2 && sq > 200 {
                continue;
            }
            Case::new(2, sq, sk, 4, 2, 64, spec.clone())
                .composite(tiles)
                .check(F32_TOL);
        }
        Case::new(1, sq, sk, 3, 1, 32, spec_for(&spec, 32))
            .composite(TILES[1])
            .check(F32_TOL);
    }
}

/// The spec with the softmax scale of head dim `d`.
fn spec_for(spec: &AttnSpec, d: usize) -> AttnSpec {
    AttnSpec {
        scale: 1.0 / (d as f32).sqrt(),
        ..spec.clone()
    }
}

#[test]
fn every_mask_bf16_f16() {
    for (name, spec, sq, sk) in mask_specs(64) {
        eprintln!("mask: {name}");
        Case::new(1, sq, sk, 4, 2, 64, spec.clone())
            .dtype(DType::BF16)
            .composite(TILES[1])
            .check(HALF_TOL);
        Case::new(1, sq, sk, 2, 1, 64, spec)
            .dtype(DType::F16)
            .composite(TILES[0])
            .check(HALF_TOL);
    }
}

#[test]
fn head_dims_and_gqa_ratios() {
    for d in [64, 128] {
        for hkv in [8, 4, 2, 1] {
            let spec = AttnSpec::dense(1.0 / (d as f32).sqrt(), MaskKind::Causal, 90, 90);
            Case::new(1, 90, 90, 8, hkv, d, spec)
                .composite(TILES[1])
                .check(F32_TOL);
        }
    }
}

/// The composite path and the CPU kernels agree with each other as closely as each agrees
/// with the f64 reference (both f32 arithmetic, different summation orders): 1e-5.
#[test]
fn composite_matches_cpu_kernels() {
    for (name, spec, sq, sk) in mask_specs(64) {
        let case = Case::new(2, sq, sk, 4, 2, 64, spec.clone());
        let [q, k, v, dout] = case.tensors();
        let (o1, l1) = flash_ring::flash_fwd(&q, &k, &v, &spec).expect("kernel fwd");
        let (o2, l2) =
            flash_ring::composite::forward(&q, &k, &v, &spec, &TILES[1]).expect("composite fwd");
        let g1 = flash_ring::flash_bwd_f32(&q, &k, &v, &o1, &l1, &dout, &spec).expect("bwd");
        let g2 =
            flash_ring::composite::backward(&q, &k, &v, &o2, &l2, &dout, &spec, &TILES[1], true)
                .expect("composite bwd");
        assert_eq!(g2.0.dtype(), DType::F32, "f32_grads gives f32");
        for (what, a, b) in [
            ("out", &o2, &o1),
            ("lse", &l2, &l1),
            ("dq", &g2.0, &g1.0),
            ("dk", &g2.1, &g1.1),
            ("dv", &g2.2, &g1.2),
        ] {
            assert_eq!(a.dims(), b.dims(), "{name}: {what} shape");
            let e = common::rel(&to_f64(a), &to_f64(b));
            assert!(e <= F32_TOL, "{name}: {what} composite vs kernel {e:.3e}");
        }
    }
}

/// Rows with no allowed key: out exactly 0, lse exactly -inf, gradients exactly 0, also when
/// every tile of the call is skipped.
#[test]
fn rows_without_keys() {
    let spec = AttnSpec::new(
        0.125,
        MaskKind::Causal,
        Positions::range(0, 20),
        Positions::range(30, 40),
    );
    let case = Case::new(1, 20, 40, 2, 1, 64, spec.clone());
    let [q, k, v, dout] = case.tensors();
    let (o, l) = flash_ring::composite::forward(&q, &k, &v, &spec, &TILES[1]).expect("fwd");
    assert!(to_f64(&o).iter().all(|&x| x == 0.0));
    assert!(to_f64(&l).iter().all(|&x| x == f64::NEG_INFINITY));
    let (dq, dk, dv) =
        flash_ring::composite::backward(&q, &k, &v, &o, &l, &dout, &spec, &TILES[1], false)
            .expect("bwd");
    for g in [dq, dk, dv] {
        assert!(to_f64(&g).iter().all(|&x| x == 0.0));
    }
    // Half the rows dead (documents): the live half matches the reference, the dead half is 0.
    let docs: std::sync::Arc<[u32]> = (0..60u32).map(|i| u32::from(i >= 30)).collect();
    let spec = AttnSpec::new(
        0.125,
        MaskKind::Full,
        Positions::range(20, 20),
        Positions::range(0, 25),
    )
    .with_doc_ids(docs);
    Case::new(1, 20, 25, 2, 1, 64, spec)
        .composite(TILES[1])
        .check(F32_TOL);
}

/// `composite::attention` (what `flash_attention` runs off the CPU) is differentiable: the
/// gradients candle's autograd delivers to q, k and v are the reference's.
#[test]
fn differentiable_attention_gives_reference_gradients() {
    let (name, spec, sq, sk) = mask_specs(64)
        .into_iter()
        .find(|m| m.0 == "causal docs window")
        .expect("mask case");
    let case = Case::new(1, sq, sk, 4, 2, 64, spec.clone());
    let [q, k, v, dout] = case.tensors();
    let vars = common::vars([&q, &k, &v]);
    let (out, lse) = flash_ring::composite::attention(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        &spec,
        &TILES[1],
    )
    .expect("attention");
    let loss = (&out * &dout).and_then(|x| x.sum_all()).expect("loss");
    let grads = loss.backward().expect("backward");
    let shape = case.shape();
    let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
    let (ro, rl) = attention_f64(&qf, &kf, &vf, shape, &spec);
    let (rdq, rdk, rdv) = attention_bwd_f64(&qf, &kf, &vf, &df, shape, &spec);
    assert!(common::rel(&to_f64(&out), &ro) <= F32_TOL, "{name}: out");
    assert!(common::rel(&to_f64(&lse), &rl) <= F32_TOL, "{name}: lse");
    for (var, r, what) in [
        (&vars[0], &rdq, "dq"),
        (&vars[1], &rdk, "dk"),
        (&vars[2], &rdv, "dv"),
    ] {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{what}: no gradient reached the input"));
        let e = common::rel(&to_f64(g), r);
        assert!(e <= F32_TOL, "{name}: {what} rel err {e:.3e}");
    }
    // Untracked inputs: a plain tensor comes back, nothing recorded.
    let (plain, _) = flash_ring::composite::attention(&q, &k, &v, &spec, &TILES[1]).expect("plain");
    assert!(!plain.track_op());
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, 8, 8);
    let t = |s: &[usize]| Tensor::ones(s, DType::F32, &dev).expect("tensor");
    let (q, k) = (t(&[1, 8, 4, 16]), t(&[1, 8, 2, 16]));
    let cfg = CompositeConfig::default();
    let fwd = |q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec, cfg: &CompositeConfig| {
        flash_ring::composite::forward(q, k, v, spec, cfg)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(fwd(&t(&[8, 4, 16]), &k, &k, &spec, &cfg).contains("q: expected rank 4"));
    assert!(fwd(&q, &t(&[1, 8, 3, 16]), &t(&[1, 8, 3, 16]), &spec, &cfg).contains("heads"));
    assert!(fwd(&q, &k, &t(&[1, 7, 2, 16]), &spec, &cfg).contains("v:"));
    assert!(fwd(&q, &k, &t(&[1, 8, 2, 8]), &spec, &cfg).contains("v:"));
    let short = AttnSpec::dense(0.125, MaskKind::Causal, 7, 8);
    assert!(fwd(&q, &k, &k, &short, &cfg).contains("spec.q_pos"));
    let zero = CompositeConfig {
        q_tile: 0,
        k_tile: 4,
    };
    assert!(fwd(&q, &k, &k, &spec, &zero).contains("q_tile"));
    let ints = q.to_dtype(DType::U32).expect("u32");
    assert!(fwd(&ints, &k, &k, &spec, &cfg).contains("dtype"));
    let (o, l) = flash_ring::composite::forward(&q, &k, &k, &spec, &cfg).expect("fwd");
    let bwd = |l: &Tensor, o: &Tensor| {
        flash_ring::composite::backward(&q, &k, &k, o, l, o, &spec, &cfg, false)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(bwd(&l.to_dtype(DType::BF16).expect("bf16"), &o).contains("lse"));
    assert!(bwd(&l.narrow(2, 0, 4).expect("narrow"), &o).contains("lse"));
    assert!(bwd(&l, &o.narrow(1, 0, 4).expect("narrow")).contains("out"));
}
