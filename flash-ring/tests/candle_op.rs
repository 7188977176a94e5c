//! Candle integration: the differentiable op against naive candle attention, the f64 reference
//! and finite differences; a small training loop; errors instead of panics on bad input.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{rel, to_f64, vars, Case};
use flash_ring::reference::{attention_bwd_f64, attention_f64};
use flash_ring::{
    flash_attention, flash_attention_with_lse, flash_bwd, flash_fwd, naive_attention,
    naive_attention_with_lse, AttnSpec, Error, MaskKind, Positions,
};

fn specs(n: usize) -> Vec<AttnSpec> {
    let docs = flash_ring::doc_ids_from_cu_seqlens(&[0, 20, 21, n]).expect("cu");
    vec![
        AttnSpec::dense(0.15, MaskKind::Full, n, n),
        AttnSpec::dense(0.15, MaskKind::Causal, n, n).with_doc_ids(docs),
        AttnSpec::dense(0.15, MaskKind::Causal, n, n).with_window(9),
    ]
}

#[test]
fn autograd_matches_reference_and_naive() {
    for spec in specs(70) {
        let case = Case::new(2, 70, 70, 4, 2, 32, spec.clone());
        let [q, k, v, dout] = case.tensors();
        let [qv, kv, vv] = vars([&q, &k, &v]);
        let loss = |o: Tensor| (o * &dout).and_then(|t| t.sum_all()).expect("loss");
        let out_f =
            flash_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &spec).expect("flash");
        let gf = loss(out_f.clone()).backward().expect("backward");
        let out_n =
            naive_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &spec).expect("naive");
        let gn = loss(out_n.clone()).backward().expect("backward");

        let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
        let (ro, _) = attention_f64(&qf, &kf, &vf, case.shape(), &spec);
        let (rdq, rdk, rdv) = attention_bwd_f64(&qf, &kf, &vf, &df, case.shape(), &spec);
        assert!(rel(&to_f64(&out_f), &ro) <= 1e-5);
        assert!(rel(&to_f64(&out_n), &ro) <= 1e-5, "naive_attention out");
        for (var, r) in [(&qv, &rdq), (&kv, &rdk), (&vv, &rdv)] {
            // Every input must receive a gradient (candle drops missing ones silently).
            let a = gf.get(var.as_tensor()).expect("flash grad present");
            let b = gn.get(var.as_tensor()).expect("naive grad present");
            assert!(rel(&to_f64(a), r) <= 1e-5, "flash grad");
            assert!(rel(&to_f64(b), r) <= 1e-4, "naive grad");
        }
    }
}

#[test]
fn with_lse_returns_kernel_lse() {
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, 50, 50);
    let case = Case::new(1, 50, 50, 2, 1, 64, spec.clone());
    let [q, k, v, _] = case.tensors();
    let (o1, l1) = flash_attention_with_lse(&q, &k, &v, &spec).expect("op");
    let (o2, l2) = flash_fwd(&q, &k, &v, &spec).expect("fwd");
    let (_, l3) = naive_attention_with_lse(&q, &k, &v, &spec).expect("naive");
    assert_eq!(to_f64(&o1), to_f64(&o2));
    assert_eq!(to_f64(&l1), to_f64(&l2));
    assert!(rel(&to_f64(&l1), &to_f64(&l3)) <= 1e-5);
}

#[test]
fn finite_difference_gradcheck() {
    // Tiny case, f32 forward, central differences of L = sum(out * w).
    let spec = AttnSpec::new(
        0.7,
        MaskKind::Causal,
        Positions::range(2, 5),
        Positions::range(0, 7),
    )
    .with_window(5);
    let case = Case::new(1, 5, 7, 2, 1, 8, spec.clone());
    let [q, k, v, w] = case.tensors();
    let [qv, kv, vv] = vars([&q, &k, &v]);
    let out = flash_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &spec).expect("fwd");
    let grads = (out * &w)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.backward())
        .expect("bwd");
    let wv = to_f64(&w);
    let loss = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
        let (o, _) = flash_fwd(q, k, v, &spec).expect("fwd");
        to_f64(&o).iter().zip(&wv).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-2f32;
    for which in 0..3 {
        let base = [&q, &k, &v][which];
        let var = [&qv, &kv, &vv][which];
        let shape = base.shape().clone();
        let vals: Vec<f32> = base.flatten_all().and_then(|t| t.to_vec1()).expect("vals");
        let mut fd = Vec::with_capacity(vals.len());
        for i in 0..vals.len() {
            let eval = |delta: f32| {
                let mut p = vals.clone();
                p[i] += delta;
                let t = Tensor::from_vec(p, shape.clone(), &Device::Cpu).expect("t");
                let mut args = [q.clone(), k.clone(), v.clone()];
                args[which] = t;
                loss(&args[0], &args[1], &args[2])
            };
            fd.push((eval(eps) - eval(-eps)) / (2.0 * eps as f64));
        }
        let an = to_f64(grads.get(var.as_tensor()).expect("grad"));
        let e = rel(&an, &fd);
        assert!(
            e <= 5e-3,
            "finite differences of input {which}: rel err {e:.3e}"
        );
    }
}

#[test]
fn trains_a_tiny_model() {
    // Learn a q projection so that attention output matches a target: loss must drop.
    let dev = Device::Cpu;
    let case = Case::new(
        1,
        24,
        24,
        2,
        2,
        32,
        AttnSpec::dense(0.2, MaskKind::Causal, 24, 24),
    );
    let [x, k, v, target] = case.tensors();
    let wq = Var::from_tensor(&Tensor::eye(32, DType::F32, &dev).expect("eye")).expect("var");
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..30 {
        let q = x.broadcast_matmul(wq.as_tensor()).expect("proj");
        let out = flash_attention(&q, &k, &v, &case.spec).expect("attn");
        let loss = (out - &target)
            .and_then(|d| d.sqr())
            .and_then(|d| d.mean_all())
            .expect("loss");
        let l = loss.to_scalar::<f32>().expect("scalar");
        first.get_or_insert(l);
        last = l;
        let g = loss.backward().expect("backward");
        let gw = g.get(wq.as_tensor()).expect("wq has a gradient");
        wq.set(&(wq.as_tensor() - (gw * 2.0).expect("lr")).expect("step"))
            .expect("set");
    }
    let first = first.expect("ran");
    assert!(last < 0.97 * first, "loss did not drop: {first} -> {last}");
}

#[test]
fn bf16_through_the_op() {
    let spec = AttnSpec::dense(0.125, MaskKind::Causal, 40, 40);
    let case = Case::new(1, 40, 40, 4, 1, 64, spec.clone()).dtype(DType::BF16);
    let [q, k, v, dout] = case.tensors();
    let qv = Var::from_tensor(&q).expect("var");
    let out = flash_attention(qv.as_tensor(), &k, &v, &spec).expect("fwd");
    assert_eq!(out.dtype(), DType::BF16);
    let g = (out.to_dtype(DType::F32).expect("f32") * dout.to_dtype(DType::F32).expect("f32"))
        .and_then(|t| t.sum_all())
        .and_then(|t| t.backward())
        .expect("bwd");
    let dq = g.get(qv.as_tensor()).expect("dq");
    assert_eq!(dq.dtype(), DType::BF16);
    let (qf, kf, vf, df) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&dout));
    let (rdq, _, _) = attention_bwd_f64(&qf, &kf, &vf, &df, case.shape(), &spec);
    assert!(rel(&to_f64(dq), &rdq) <= 1e-2);
}

#[test]
fn bad_inputs_are_errors_naming_the_tensor() {
    let dev = Device::Cpu;
    let t = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).expect("zeros");
    let spec = AttnSpec::dense(0.1, MaskKind::Causal, 8, 8);
    let msg = |r: Result<(Tensor, Tensor), Error>| format!("{}", r.expect_err("must fail"));
    let q = t(&[1, 8, 4, 16]);
    let k = t(&[1, 8, 2, 16]);
    assert!(msg(flash_fwd(&t(&[8, 4, 16]), &k, &k, &spec)).contains("q"));
    assert!(msg(flash_fwd(&q, &t(&[1, 8, 2, 8]), &k, &spec)).contains("k"));
    assert!(msg(flash_fwd(&q, &k, &t(&[1, 7, 2, 16]), &spec)).contains("v"));
    assert!(msg(flash_fwd(&q, &t(&[1, 8, 3, 16]), &t(&[1, 8, 3, 16]), &spec)).contains("heads"));
    let bad_pos = AttnSpec::dense(0.1, MaskKind::Causal, 7, 8);
    assert!(msg(flash_fwd(&q, &k, &k, &bad_pos)).contains("q_pos"));
    let short_docs = spec.clone().with_doc_ids(vec![0u32; 4].into());
    assert!(msg(flash_fwd(&q, &k, &k, &short_docs)).contains("doc_ids"));
    let kb = k.to_dtype(DType::BF16).expect("bf16");
    assert!(msg(flash_fwd(&q, &kb, &k, &spec)).contains("k"));
    let ki = k.to_dtype(DType::U32).expect("u32");
    assert!(flash_fwd(&q.to_dtype(DType::U32).expect("u32"), &ki, &ki, &spec).is_err());
    let (o, l) = flash_fwd(&q, &k, &k, &spec).expect("fwd");
    let e = flash_bwd(&q, &k, &k, &o, &t(&[1, 4, 7]), &o, &spec).expect_err("lse shape");
    assert!(format!("{e}").contains("lse"));
    let e = flash_bwd(&q, &k, &k, &o, &l, &t(&[1, 8, 4, 8]), &spec).expect_err("dout shape");
    assert!(format!("{e}").contains("dout"));
    assert!(flash_ring::merge(&o, &l, &t(&[1, 8, 4, 8]), &l).is_err());
    let cfg = flash_ring::KernelConfig {
        k_tile: 48,
        ..Default::default()
    };
    assert!(flash_ring::flash_fwd_with_config(&q, &k, &k, &spec, &cfg).is_err());
    // Converts into candle's error for `?` in candle code.
    let ce: candle_core::Error = Error::Heads {
        q_heads: 3,
        kv_heads: 2,
    }
    .into();
    assert!(format!("{ce}").contains("heads"));
}
