//! Logit soft-capping (Gemma 2/3): the softmax takes `c tanh(s / c)` of the scaled logit
//! `s = scale q.k`, the mask applies after the cap.
//!
//! Every path against the float64 reference (`flash_ring::reference`): the CPU kernels (default
//! and small tiles, every instruction set, f32 and bf16/f16 inputs), the composite path, the
//! differentiable op and naive attention; blocks of keys merged by LSE as in a ring. q and k are
//! scaled up (`QK_MUL`) so that the cap matters: the scaled logits spread over about +-3 `CAP`,
//! so `tanh(s / c)` is saturated for part of them and linear for the rest (asserted in
//! `inputs_saturate_the_cap`). Tolerances, max-norm relative (see `common::rel`): out, lse, dq,
//! dk, dv within `F32_TOL` = 1e-5 for f32 as the other f32 tests, `HALF_TOL` = 1e-2 for bf16 and
//! f16 inputs.

mod common;

use candle_core::{DType, Tensor};
use common::{rel, to_f64, vars, Case};
use flash_ring::flash_attn_plan::plan_flash_attn;
use flash_ring::reference::{attention_bwd_f64, attention_f64, RefShape};
use flash_ring::{
    composite, flash_attention, flash_bwd, flash_bwd_f32, flash_fwd, merge, naive_attention,
    AttnSpec, CompositeConfig, Error, KernelConfig, MaskKind, Positions,
};

const F32_TOL: f64 = 1e-5;
const HALF_TOL: f64 = 1e-2;
/// The soft-cap of the tests.
const CAP: f32 = 5.0;
/// Factor on the default test inputs' q and k (see the module docs).
const QK_MUL: f32 = 3.0;
/// q rows and k rows: odd sizes, across the small tiles' borders (16 and 32 rows).
const SQ: usize = 53;
const SK: usize = 67;

fn small_tiles() -> KernelConfig {
    KernelConfig {
        q_tile: 16,
        k_tile: 32,
        isa: None,
        ..KernelConfig::default()
    }
}

const COMPOSITE_TILES: CompositeConfig = CompositeConfig {
    q_tile: 16,
    k_tile: 24,
};

/// Capped specs for head dim `d` on q rows at positions `SK - SQ..SK` and k rows at `0..SK`:
/// both masks, with and without documents (one of a single token), without a window and with
/// windows of 1 (every row sees exactly one key), 2 and 9.
fn capped_specs(d: usize) -> Vec<AttnSpec> {
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 20, 21, 45, SK]).expect("cu_seqlens");
    let mut v = Vec::new();
    for mask in [MaskKind::Full, MaskKind::Causal] {
        for with_docs in [false, true] {
            for window in [None, Some(1), Some(2), Some(9)] {
                let mut spec = AttnSpec::new(
                    1.0 / (d as f32).sqrt(),
                    mask,
                    Positions::range(SK - SQ, SQ),
                    Positions::range(0, SK),
                )
                .with_softcap(CAP);
                if with_docs {
                    spec = spec.with_doc_ids(docs.clone());
                }
                if let Some(w) = window {
                    spec = spec.with_window(w);
                }
                v.push(spec);
            }
        }
    }
    v
}

fn case(hq: usize, hkv: usize, d: usize, spec: AttnSpec) -> Case {
    Case::new(1, SQ, SK, hq, hkv, d, spec).qk_mul(QK_MUL)
}

#[test]
fn capped_every_mask_and_head_dim_f32() {
    for d in [64, 128, 256] {
        for spec in capped_specs(d) {
            case(4, 2, d, spec.clone()).check(F32_TOL);
            case(4, 2, d, spec).cfg(small_tiles()).check(F32_TOL);
        }
    }
}

#[test]
fn capped_gqa_ratios_f32() {
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 30, SK]).expect("cu_seqlens");
    for hkv in [8, 4, 1] {
        for spec in [
            capped_specs(64)[0].clone(),
            AttnSpec::dense(0.125, MaskKind::Causal, SQ, SK)
                .with_doc_ids(docs.clone())
                .with_window(13)
                .with_softcap(CAP),
        ] {
            case(8, hkv, 64, spec).cfg(small_tiles()).check(F32_TOL);
        }
    }
}

#[test]
fn capped_every_isa_f32() {
    for isa in flash_ring::cpu::available() {
        let cfg = KernelConfig {
            isa: Some(isa),
            ..small_tiles()
        };
        for d in [64, 256] {
            for spec in capped_specs(d).into_iter().step_by(3) {
                case(2, 1, d, spec).cfg(cfg.clone()).check(F32_TOL);
            }
        }
    }
}

/// bf16 and f16 inputs (on a CPU with AVX512-BF16, bf16 `Q K^T` runs on the bf16 dot products
/// and the scale then goes into the cap's `tanh`).
#[test]
fn capped_bf16_f16() {
    for d in [64, 256] {
        for spec in capped_specs(d).into_iter().step_by(2) {
            case(4, 2, d, spec.clone())
                .dtype(DType::BF16)
                .cfg(small_tiles())
                .check(HALF_TOL);
            case(2, 1, d, spec).dtype(DType::F16).check(HALF_TOL);
        }
    }
}

#[test]
fn capped_composite_f32() {
    for d in [64, 256] {
        for spec in capped_specs(d) {
            case(4, 2, d, spec.clone())
                .composite(COMPOSITE_TILES)
                .check(F32_TOL);
        }
    }
    for spec in capped_specs(128).into_iter().step_by(5) {
        case(4, 2, 128, spec)
            .composite(CompositeConfig::default())
            .check(F32_TOL);
    }
}

/// The logits of the test inputs spread well past the cap: between a tenth and nine tenths of
/// the allowed scaled logits have `|s| > CAP`, and the cap changes the output and every gradient
/// by more than 5% (so the checks above test the cap, and its `1 - tanh^2` factor).
#[test]
fn inputs_saturate_the_cap() {
    let d = 64;
    for spec in capped_specs(d).into_iter().filter(|s| s.window != Some(1)) {
        let c = case(4, 2, d, spec.clone());
        let sh = c.shape();
        let [q, k, v, dout] = c
            .inputs()
            .map(|x| x.iter().map(|&y| y as f64).collect::<Vec<_>>());
        let (mut over, mut all) = (0usize, 0usize);
        for h in 0..sh.hq {
            let kh = h / (sh.hq / sh.hkv);
            for i in 0..sh.sq {
                for j in 0..sh.sk {
                    if !spec.allowed(spec.q_pos.get(i), spec.k_pos.get(j)) {
                        continue;
                    }
                    let qo = (i * sh.hq + h) * d;
                    let ko = (j * sh.hkv + kh) * d;
                    let s: f64 =
                        (0..d).map(|t| q[qo + t] * k[ko + t]).sum::<f64>() * spec.scale as f64;
                    all += 1;
                    over += (s.abs() > CAP as f64) as usize;
                }
            }
        }
        let frac = over as f64 / all as f64;
        assert!(
            (0.1..0.9).contains(&frac),
            "{frac} of the logits over the cap"
        );
        let plain = AttnSpec {
            softcap: None,
            ..spec.clone()
        };
        let capped = ref_all(&q, &k, &v, &dout, sh, &spec);
        let uncapped = ref_all(&q, &k, &v, &dout, sh, &plain);
        for (name, (a, b)) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(capped.iter().zip(&uncapped))
        {
            let e = rel(b, a);
            assert!(e > 0.05, "{name}: the cap changes it by only {e:.2e}");
        }
    }
}

/// Reference out, dq, dk, dv.
fn ref_all(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    sh: RefShape,
    spec: &AttnSpec,
) -> [Vec<f64>; 4] {
    let (out, _) = attention_f64(q, k, v, sh, spec);
    let (dq, dk, dv) = attention_bwd_f64(q, k, v, dout, sh, spec);
    [out, dq, dk, dv]
}

/// A forward returning `(out, lse)`.
type Fwd = fn(&Tensor, &Tensor, &Tensor, &AttnSpec) -> flash_ring::Result<(Tensor, Tensor)>;

/// The backward of a block given the final out and lse: `(q, k, v, out, lse, dout, spec)`.
type Bwd = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &AttnSpec,
) -> flash_ring::Result<(Tensor, Tensor, Tensor)>;

/// The functions of one path as a ring uses them: forward with lse, and the backward of a block
/// given the final out and lse, with f32 gradients.
struct RingPath {
    fwd: Fwd,
    bwd: Bwd,
}

fn composite_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnSpec,
) -> flash_ring::Result<(Tensor, Tensor)> {
    composite::forward(q, k, v, s, &COMPOSITE_TILES)
}

#[allow(clippy::too_many_arguments)]
fn composite_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    l: &Tensor,
    d: &Tensor,
    s: &AttnSpec,
) -> flash_ring::Result<(Tensor, Tensor, Tensor)> {
    composite::backward(q, k, v, o, l, d, s, &COMPOSITE_TILES, true)
}

/// Keys split in two blocks (as two ring steps): each block's forward, merged by LSE, equals the
/// single call and the reference; each block's backward with the merged out and lse, dq summed
/// and dk, dv put together, equals the reference gradients.
#[test]
fn capped_blocks_merge_by_lse() {
    let paths = [
        (
            "kernel",
            RingPath {
                fwd: flash_fwd,
                bwd: flash_bwd_f32,
            },
        ),
        (
            "composite",
            RingPath {
                fwd: composite_fwd,
                bwd: composite_bwd,
            },
        ),
    ];
    let d = 64;
    for (name, path) in &paths {
        for spec in capped_specs(d) {
            for cut in [30, 45] {
                check_merge(name, path, &case(4, 2, d, spec.clone()), cut);
            }
        }
    }
}

fn check_merge(name: &str, path: &RingPath, case: &Case, cut: usize) {
    let [q, k, v, dout] = case.tensors();
    let spec = &case.spec;
    let sh = case.shape();
    let block = |off: usize, len: usize| {
        let bspec = spec.with_positions(
            spec.q_pos.clone(),
            spec.k_pos.slice(off, len).expect("slice"),
        );
        assert_eq!(bspec.softcap, Some(CAP), "with_positions keeps the cap");
        let kb = k.narrow(1, off, len).expect("narrow");
        let vb = v.narrow(1, off, len).expect("narrow");
        (bspec, kb, vb)
    };
    let blocks = [block(0, cut), block(cut, SK - cut)];
    let (o1, l1) = (path.fwd)(&q, &k, &v, spec).expect("single fwd");
    let mut parts = blocks
        .iter()
        .map(|(s, kb, vb)| (path.fwd)(&q, kb, vb, s).expect("block fwd"));
    let (oa, la) = parts.next().expect("a");
    let (ob, lb) = parts.next().expect("b");
    let (om, lm) = merge(&oa, &la, &ob, &lb).expect("merge");
    let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
    let (ro, rl) = attention_f64(&qf, &kf, &vf, sh, spec);
    let (rdq, rdk, rdv) = attention_bwd_f64(&qf, &kf, &vf, &df, sh, spec);
    let what = format!("{name}, cut {cut}, {spec:?}");
    for (x, a, b) in [
        ("merged out vs reference", to_f64(&om), &ro),
        ("merged lse vs reference", to_f64(&lm), &rl),
        ("merged out vs one call", to_f64(&om), &to_f64(&o1)),
        ("merged lse vs one call", to_f64(&lm), &to_f64(&l1)),
    ] {
        let e = rel(&a, b);
        assert!(e <= F32_TOL, "{x}: {e:.3e} ({what})");
    }
    let (mut dq, mut dks, mut dvs) = (None::<Tensor>, Vec::new(), Vec::new());
    for (s, kb, vb) in &blocks {
        let (a, b, c) = (path.bwd)(&q, kb, vb, &om, &lm, &dout, s).expect("block bwd");
        dq = Some(match dq {
            None => a,
            Some(x) => (x + a).expect("add"),
        });
        dks.push(b);
        dvs.push(c);
    }
    let dq = dq.expect("dq");
    let dk = Tensor::cat(&dks, 1).expect("cat");
    let dv = Tensor::cat(&dvs, 1).expect("cat");
    // Window 1: every row sees one key, dq and dk are exactly 0 in the reference (see
    // `Case::check`): measured against max |dv| then.
    let dv_scale = testkit::max_abs_values(&rdv);
    for (x, a, r) in [("dq", &dq, &rdq), ("dk", &dk, &rdk), ("dv", &dv, &rdv)] {
        let floor = if r.iter().all(|&y| y == 0.0) {
            dv_scale
        } else {
            1e-30
        };
        let e = common::rel_floor(&to_f64(a), r, floor);
        assert!(e <= F32_TOL, "{x} summed over blocks: {e:.3e} ({what})");
    }
}

/// The differentiable op (CPU kernels under candle's autograd) and naive attention (candle ops,
/// candle's own backward of `tanh`) with a cap, against the reference.
#[test]
fn capped_autograd_op_and_naive() {
    let d = 32;
    for spec in capped_specs(d).into_iter().step_by(3) {
        let c = case(4, 2, d, spec.clone());
        let [q, k, v, dout] = c.tensors();
        let [qv, kv, vv] = vars([&q, &k, &v]);
        let loss = |o: &Tensor| (o * &dout).and_then(|t| t.sum_all()).expect("loss");
        let (qt, kt, vt) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
        let out_f = flash_attention(qt, kt, vt, &spec).expect("flash");
        let gf = loss(&out_f).backward().expect("backward");
        let out_n = naive_attention(qt, kt, vt, &spec).expect("naive");
        let gn = loss(&out_n).backward().expect("backward");
        let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
        let [ro, rdq, rdk, rdv] = ref_all(&qf, &kf, &vf, &df, c.shape(), &spec);
        assert!(rel(&to_f64(&out_f), &ro) <= F32_TOL, "flash out");
        // Naive attention is plain f32 candle ops (f32 exp/tanh, a full-row softmax): 1e-4,
        // as for its uncapped gradients in candle_op.rs.
        assert!(rel(&to_f64(&out_n), &ro) <= 1e-4, "naive out");
        let dv_scale = testkit::max_abs_values(&rdv);
        for (var, r) in [(&qv, &rdq), (&kv, &rdk), (&vv, &rdv)] {
            let floor = if r.iter().all(|&y| y == 0.0) {
                dv_scale
            } else {
                1e-30
            };
            let a = gf.get(var.as_tensor()).expect("flash grad present");
            let b = gn.get(var.as_tensor()).expect("naive grad present");
            let ea = common::rel_floor(&to_f64(a), r, floor);
            let eb = common::rel_floor(&to_f64(b), r, floor);
            assert!(ea <= F32_TOL, "flash grad {ea:.3e} ({spec:?})");
            assert!(eb <= 1e-4, "naive grad {eb:.3e} ({spec:?})");
        }
    }
}

/// `softcap: None` is the uncapped attention: the builder's field cleared gives the very spec
/// of the plain constructor (one code path, the same bits), which matches the uncapped
/// reference; a huge cap (`c tanh(s / c) = s - s^3 / 3c^2`, here `s^3 / 3c^2 < 1e-8`) matches
/// it too.
#[test]
fn no_cap_is_the_uncapped_attention() {
    let plain = AttnSpec::dense(0.125, MaskKind::Causal, SQ, SK).with_window(20);
    let mut cleared = plain.clone().with_softcap(CAP);
    assert_eq!(cleared.softcap, Some(CAP));
    cleared.softcap = None;
    assert_eq!(cleared, plain);
    let c = case(4, 2, 64, plain.clone()).cfg(small_tiles());
    let [q, k, v, dout] = c.tensors();
    let run = |s: &AttnSpec| {
        let (o, l) = flash_fwd(&q, &k, &v, s).expect("fwd");
        let (a, b, d) = flash_bwd(&q, &k, &v, &o, &l, &dout, s).expect("bwd");
        [o, l, a, b, d].map(|t| to_f64(&t))
    };
    assert_eq!(run(&plain), run(&cleared), "same bits");
    c.check(F32_TOL);
    case(4, 2, 64, plain.clone().with_softcap(1e6))
        .cfg(small_tiles())
        .check(F32_TOL);
    // Against the uncapped reference.
    let huge = Case {
        spec: plain.with_softcap(1e6),
        ..case(4, 2, 64, cleared.clone())
    };
    let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
    let r = ref_all(&qf, &kf, &vf, &df, huge.shape(), &cleared);
    let got = run(&huge.spec);
    for (i, (a, b)) in [&got[0], &got[2], &got[3], &got[4]]
        .into_iter()
        .zip(&r)
        .enumerate()
    {
        let e = rel(a, b);
        assert!(e <= F32_TOL, "huge cap vs uncapped, output {i}: {e:.3e}");
    }
}

/// `r` is an `Error::Config` whose message contains `softcap` and `says`.
fn config_err_names_softcap<T: std::fmt::Debug>(r: flash_ring::Result<T>, what: &str, says: &str) {
    match r {
        Err(Error::Config(m)) => {
            assert!(
                m.contains("softcap") && m.contains(says),
                "{what}: message {m:?}"
            )
        }
        other => panic!("{what}: expected Error::Config naming softcap, got {other:?}"),
    }
}

/// A cap that is not finite and positive (or so small that `scale / c` overflows) is refused
/// by every path with `Error::Config` naming `softcap`; the flash-attn planner refuses any cap.
#[test]
fn invalid_softcap_is_refused() {
    let c = case(2, 1, 16, AttnSpec::dense(0.25, MaskKind::Causal, SQ, SK));
    let [q, k, v, dout] = c.tensors();
    let (o, l) = flash_fwd(&q, &k, &v, &c.spec).expect("fwd");
    for cap in [
        0.0,
        -0.0,
        -1.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-45,
    ] {
        let spec = c.spec.clone().with_softcap(cap);
        let what = format!("softcap {cap}");
        let says = if cap == 1e-45 {
            "too small"
        } else {
            "must be finite and > 0"
        };
        config_err_names_softcap(flash_fwd(&q, &k, &v, &spec), &what, says);
        config_err_names_softcap(flash_bwd(&q, &k, &v, &o, &l, &dout, &spec), &what, says);
        config_err_names_softcap(flash_attention(&q, &k, &v, &spec), &what, says);
        config_err_names_softcap(
            composite::forward(&q, &k, &v, &spec, &COMPOSITE_TILES),
            &what,
            says,
        );
        config_err_names_softcap(
            composite::backward(&q, &k, &v, &o, &l, &dout, &spec, &COMPOSITE_TILES, false),
            &what,
            says,
        );
        config_err_names_softcap(naive_attention(&q, &k, &v, &spec), &what, says);
    }
    match plan_flash_attn(&c.spec.clone().with_softcap(CAP), SQ, SK) {
        Err(Error::FlashAttnPlan(m)) => assert!(m.contains("softcap"), "{m:?}"),
        other => panic!("the planner must refuse a soft-cap, got {other:?}"),
    }
    assert!(plan_flash_attn(&c.spec, SQ, SK).is_ok());
}
