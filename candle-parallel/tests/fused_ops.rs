//! The fused ops (`rms_norm`, `RotaryEmbedding`, `swiglu`, `gelu_tanh`) against composite candle
//! computations built from differentiable primitives: values and gradients of every input.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_parallel::ops::{gelu_tanh, inv_freq, rms_norm, swiglu, RopeScaling, RotaryEmbedding};
use common::zigzag;
use rand::{rngs::StdRng, Rng, SeedableRng};

const DTYPES: [(DType, f64); 3] = [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 1e-2)];

/// Random non-zero values: magnitude in [0.05, 2), random sign.
fn rand_tensor(rng: &mut StdRng, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let m = rng.random_range(0.05f32..2.0);
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// max |a - b| / max |b|, both compared in f32.
fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> Result<()> {
    testkit::assert_close(a, b, tol, what);
    Ok(())
}

/// A `Var` holding `t`'s values upcast to f32 (exact for bf16/f16).
fn var_f32(t: &Var) -> Result<Var> {
    Var::from_tensor(&t.as_tensor().to_dtype(DType::F32)?)
}

/// Value of `f(inputs)` and the gradients of `sum(f(inputs) * g)` w.r.t. every input,
/// asserting each one gets a gradient.
fn value_and_grads(
    what: &str,
    inputs: &[&Var],
    g: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let ts: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts)?;
    let loss = (&out * g.to_dtype(out.dtype())?)?.sum_all()?;
    let grads = loss.backward()?;
    let gs = inputs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            grads
                .get(v.as_tensor())
                .cloned()
                .unwrap_or_else(|| panic!("{what}: input {i} got no gradient"))
        })
        .collect();
    Ok((out, gs))
}

/// Compares the fused op (in the inputs' dtype) with the composite reference evaluated in f32 on
/// the same (upcast) values: output and every input gradient. For bf16/f16 also compares the
/// output with the composite evaluated in the low dtype (HF's rounding points).
fn check_op(
    what: &str,
    inputs: &[&Var],
    g: &Tensor,
    tol: f64,
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    composite: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let (out, grads) = value_and_grads(what, inputs, g, &fused)?;
    assert_eq!(out.dtype(), inputs[0].dtype(), "{what}: output dtype");
    let vars32: Vec<Var> = inputs.iter().map(|v| var_f32(v)).collect::<Result<_>>()?;
    let refs32: Vec<&Var> = vars32.iter().collect();
    let g32 = g.to_dtype(DType::F32)?;
    let (out_ref, grads_ref) = value_and_grads(what, &refs32, &g32, &composite)?;
    assert_close(&format!("{what} value"), &out, &out_ref, tol)?;
    for (i, (gr, rr)) in grads.iter().zip(&grads_ref).enumerate() {
        assert_eq!(gr.dtype(), inputs[i].dtype(), "{what}: grad {i} dtype");
        assert_eq!(gr.dims(), inputs[i].dims(), "{what}: grad {i} shape");
        assert_close(&format!("{what} grad {i}"), gr, rr, tol)?;
    }
    if inputs[0].dtype() != DType::F32 {
        let ts: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().detach()).collect();
        let same = composite(&ts)?;
        assert_eq!(same.dtype(), out.dtype());
        // The fused kernels round where HF rounds: at most about one ulp of the dtype apart.
        assert_close(
            &format!("{what} value vs low-precision composite"),
            &out,
            &same,
            4e-3,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------- RMSNorm

const EPS: f64 = 1e-5;

/// HF `LlamaRMSNorm` from primitives.
fn rms_norm_ref(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let r = (x32.sqr()?.mean_keepdim(D::Minus1)? + EPS)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&r)?.to_dtype(x.dtype())?.broadcast_mul(w)
}

#[test]
fn rms_norm_matches_composite() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(7);
    for (dt, tol) in DTYPES {
        // Transposed input: stored (2, 48, 5), used as (2, 5, 48).
        let xv = Var::from_tensor(&rand_tensor(&mut rng, &[2, 48, 5], dt)?)?;
        let wv = Var::from_tensor(&rand_tensor(&mut rng, &[48], dt)?)?;
        let g = rand_tensor(&mut rng, &[2, 5, 48], dt)?;
        check_op(
            &format!("rms_norm transposed {dt:?}"),
            &[&xv, &wv],
            &g,
            tol,
            |t| rms_norm(&t[0].transpose(1, 2)?, &t[1], EPS),
            |t| rms_norm_ref(&t[0].transpose(1, 2)?, &t[1]),
        )?;
        // Narrowed input with enough rows for several backward blocks: (3, 40, 512) -> (3, 32, 512).
        let xv = Var::from_tensor(&rand_tensor(&mut rng, &[3, 40, 512], dt)?)?;
        let wv = Var::from_tensor(&rand_tensor(&mut rng, &[512], dt)?)?;
        let g = rand_tensor(&mut rng, &[3, 32, 512], dt)?;
        check_op(
            &format!("rms_norm narrowed {dt:?}"),
            &[&xv, &wv],
            &g,
            tol,
            |t| rms_norm(&t[0].narrow(1, 5, 32)?, &t[1], EPS),
            |t| rms_norm_ref(&t[0].narrow(1, 5, 32)?, &t[1]),
        )?;
    }
    Ok(())
}

#[test]
fn rms_norm_rejects_bad_inputs() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(8);
    let x = rand_tensor(&mut rng, &[2, 3, 16], DType::F32)?;
    let w16 = rand_tensor(&mut rng, &[16], DType::BF16)?;
    assert!(rms_norm(&x, &w16, EPS).is_err(), "weight dtype != x dtype");
    let w8 = rand_tensor(&mut rng, &[8], DType::F32)?;
    assert!(rms_norm(&x, &w8, EPS).is_err(), "weight length != hidden");
    let xi = x.to_dtype(DType::U32)?;
    let wi = w8.to_dtype(DType::U32)?;
    assert!(rms_norm(&xi, &wi, EPS).is_err(), "integer dtype");
    Ok(())
}

// ---------------------------------------------------------------- SwiGLU

/// HF's MLP product from primitives: `silu(gate)` evaluated in f32 and cast to the dtype (as
/// torch's low-precision silu kernel does), then multiplied by `up` in the dtype.
fn swiglu_ref(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let g32 = gate.to_dtype(DType::F32)?;
    let sig = (g32.neg()?.exp()? + 1.0)?.recip()?;
    (g32 * sig)?.to_dtype(gate.dtype())?.mul(up)
}

#[test]
fn swiglu_matches_composite() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(11);
    for (dt, tol) in DTYPES {
        // gate transposed (stored (2, 24, 7)), up narrowed (from (2, 9, 24)); used as (2, 7, 24).
        let gv = Var::from_tensor(&(rand_tensor(&mut rng, &[2, 24, 7], dt)? * 3.0)?)?;
        let uv = Var::from_tensor(&rand_tensor(&mut rng, &[2, 9, 24], dt)?)?;
        let g = rand_tensor(&mut rng, &[2, 7, 24], dt)?;
        check_op(
            &format!("swiglu {dt:?}"),
            &[&gv, &uv],
            &g,
            tol,
            |t| swiglu(&t[0].transpose(1, 2)?, &t[1].narrow(1, 1, 7)?),
            |t| swiglu_ref(&t[0].transpose(1, 2)?, &t[1].narrow(1, 1, 7)?),
        )?;
        // Contiguous and larger than one parallel chunk.
        let gv = Var::from_tensor(&(rand_tensor(&mut rng, &[3, 5000], dt)? * 3.0)?)?;
        let uv = Var::from_tensor(&rand_tensor(&mut rng, &[3, 5000], dt)?)?;
        let g = rand_tensor(&mut rng, &[3, 5000], dt)?;
        check_op(
            &format!("swiglu contiguous {dt:?}"),
            &[&gv, &uv],
            &g,
            tol,
            |t| swiglu(&t[0], &t[1]),
            |t| swiglu_ref(&t[0], &t[1]),
        )?;
    }
    Ok(())
}

#[test]
fn swiglu_rejects_bad_inputs() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(12);
    let a = rand_tensor(&mut rng, &[4, 6], DType::F32)?;
    let b16 = a.to_dtype(DType::BF16)?;
    assert!(swiglu(&a, &b16).is_err(), "dtype mismatch");
    let c = rand_tensor(&mut rng, &[4, 5], DType::F32)?;
    assert!(swiglu(&a, &c).is_err(), "shape mismatch");
    let ai = a.to_dtype(DType::U32)?;
    assert!(swiglu(&ai, &ai).is_err(), "integer dtype");
    Ok(())
}

// ---------------------------------------------------------------- GELU (tanh)

#[test]
fn gelu_tanh_matches_composite_and_float64() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(13);
    for (dt, tol) in DTYPES {
        // Transposed (strided) and larger than one parallel chunk; values up to ±6 reach both
        // tails. candle's own `gelu` (composite backward) is the reference.
        for shape in [[3usize, 24, 7], [2, 5000, 1]] {
            let xv = Var::from_tensor(&(rand_tensor(&mut rng, &shape, dt)? * 3.0)?)?;
            let g = rand_tensor(&mut rng, &[shape[0], shape[2], shape[1]], dt)?;
            check_op(
                &format!("gelu_tanh {dt:?} {shape:?}"),
                &[&xv],
                &g,
                tol,
                |t| gelu_tanh(&t[0].transpose(1, 2)?),
                |t| t[0].transpose(1, 2)?.gelu(),
            )?;
        }
    }
    // f32 against the formula and its derivative in float64: 4e-7 relative for the value; the
    // derivative's `1 - tanh²` cancels in f32 in the tails (an absolute error of 6e-8 there times
    // up to 10), so 2e-6 absolute (the derivative is at most 1.13).
    let xs: Vec<f32> = (-600..=600).map(|i| i as f32 / 97.0).collect();
    let x = Var::from_tensor(&Tensor::new(xs.as_slice(), &Device::Cpu)?)?;
    let y = gelu_tanh(x.as_tensor())?;
    let grads = y.sum_all()?.backward()?;
    let dy = grads
        .get(x.as_tensor())
        .expect("gelu_tanh: a gradient")
        .to_vec1::<f32>()?;
    let (k, c) = ((2.0f64 / std::f64::consts::PI).sqrt(), 0.044715f64);
    for ((&xf, &yf), &df) in xs.iter().zip(&y.to_vec1::<f32>()?).zip(&dy) {
        let x = xf as f64;
        let t = (k * (x + c * x * x * x)).tanh();
        let (y64, d64) = (
            0.5 * x * (1.0 + t),
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x),
        );
        assert!(
            (yf as f64 - y64).abs() <= 4e-7 * y64.abs().max(1.0),
            "gelu({x}) = {yf}, float64 {y64}"
        );
        assert!(
            (df as f64 - d64).abs() <= 2e-6,
            "gelu'({x}) = {df}, float64 {d64}"
        );
    }
    assert!(
        gelu_tanh(&x.as_tensor().to_dtype(DType::U32)?).is_err(),
        "integer dtype"
    );
    Ok(())
}

// ---------------------------------------------------------------- RoPE

/// HF `apply_rotary_pos_emb` from primitives: cos/sin of `pos as f32 * inv_freq` in f32, cast to
/// x's dtype, `x * cos + rotate_half(x) * sin`. `x`: (batch, seq, heads, head_dim).
fn rope_ref(x: &Tensor, inv: &[f32], positions: &[u32]) -> Result<Tensor> {
    let d = x.dim(3)?;
    let half = d / 2;
    let seq = positions.len();
    let mut cos = Vec::with_capacity(seq * d);
    let mut sin = Vec::with_capacity(seq * d);
    for &p in positions {
        for _ in 0..2 {
            for &f in inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    let cos = Tensor::from_vec(cos, (1, seq, 1, d), x.device())?.to_dtype(x.dtype())?;
    let sin = Tensor::from_vec(sin, (1, seq, 1, d), x.device())?.to_dtype(x.dtype())?;
    let x1 = x.narrow(3, 0, half)?;
    let x2 = x.narrow(3, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
}

#[test]
fn rope_matches_composite() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(21);
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let rope = RotaryEmbedding::new(32, 500_000.0, &scaling)?;
    let inv = rope.inv_freq().to_vec();
    assert_eq!(inv.len(), 16);
    let positions = zigzag(6, 100_000);
    for (dt, tol) in DTYPES {
        // Stored (batch, heads, seq, head_dim), used as (batch, seq, heads, head_dim).
        let xv = Var::from_tensor(&rand_tensor(&mut rng, &[2, 3, 6, 32], dt)?)?;
        let g = rand_tensor(&mut rng, &[2, 6, 3, 32], dt)?;
        check_op(
            &format!("rope transposed {dt:?}"),
            &[&xv],
            &g,
            tol,
            |t| rope.apply(&t[0].transpose(1, 2)?, &positions),
            |t| rope_ref(&t[0].transpose(1, 2)?, &inv, &positions),
        )?;
        // Contiguous, positions 0..seq.
        let pos: Vec<u32> = (0..9).collect();
        let xv = Var::from_tensor(&rand_tensor(&mut rng, &[3, 9, 2, 32], dt)?)?;
        let g = rand_tensor(&mut rng, &[3, 9, 2, 32], dt)?;
        check_op(
            &format!("rope contiguous {dt:?}"),
            &[&xv],
            &g,
            tol,
            |t| rope.apply(&t[0], &pos),
            |t| rope_ref(&t[0], &inv, &pos),
        )?;
    }
    Ok(())
}

#[test]
fn rope_arbitrary_positions_are_row_permutations() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(22);
    let rope = RotaryEmbedding::new(16, 10_000.0, &RopeScaling::Default)?;
    let n = 10usize;
    let base = 4096u32;
    // A non-monotone permutation of the rows: zigzag, then a few swaps.
    let mut perm: Vec<u32> = zigzag(n, 0);
    perm.swap(1, 6);
    perm.swap(3, 8);
    for dt in [DType::F32, DType::BF16] {
        let x = rand_tensor(&mut rng, &[2, n, 3, 16], dt)?;
        let all: Vec<u32> = (0..n as u32).map(|p| base + p).collect();
        let full = rope.apply(&x, &all)?;
        let idx = Tensor::new(perm.as_slice(), &Device::Cpu)?;
        let x_perm = x.index_select(&idx, 1)?;
        let pos_perm: Vec<u32> = perm.iter().map(|&p| base + p).collect();
        let got = rope.apply(&x_perm, &pos_perm)?;
        let want = full.index_select(&idx, 1)?;
        testkit::assert_identical(
            &got,
            &want,
            &format!("{dt:?}: permuted positions vs permuted rows"),
        );
    }
    Ok(())
}

#[test]
fn rope_backward_is_inverse_rotation() -> Result<()> {
    // For an orthogonal rotation R, grad_x of sum(R(x) * g) is R^T g = R^{-1} g, so rotating
    // it forward again gives back g.
    let mut rng = StdRng::seed_from_u64(23);
    let rope = RotaryEmbedding::new(8, 10_000.0, &RopeScaling::Linear { factor: 2.0 })?;
    let pos = zigzag(5, 77);
    let xv = Var::from_tensor(&rand_tensor(&mut rng, &[1, 5, 2, 8], DType::F32)?)?;
    let g = rand_tensor(&mut rng, &[1, 5, 2, 8], DType::F32)?;
    let out = rope.apply(xv.as_tensor(), &pos)?;
    let grads = (out * &g)?.sum_all()?.backward()?;
    let gx = grads.get(xv.as_tensor()).expect("x got no gradient");
    assert_close("R(R^T g) == g", &rope.apply(gx, &pos)?, &g, 1e-6)?;
    Ok(())
}

#[test]
fn rope_inv_freq_llama3() {
    let (head_dim, theta) = (64usize, 500_000f64);
    let (factor, low, high, orig) = (8.0f64, 1.0f64, 4.0f64, 8192usize);
    let got = inv_freq(
        head_dim,
        theta,
        &RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig,
        },
    );
    assert_eq!(got.len(), head_dim / 2);
    let (low_wl, high_wl) = (orig as f64 / low, orig as f64 / high);
    let mut regimes = [0usize; 3];
    for (i, &v) in got.iter().enumerate() {
        let base = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / base;
        let want = if wavelen < high_wl {
            regimes[0] += 1;
            base
        } else if wavelen > low_wl {
            regimes[2] += 1;
            base / factor
        } else {
            regimes[1] += 1;
            let s = (orig as f64 / wavelen - low) / (high - low);
            (1.0 - s) * base / factor + s * base
        };
        let rel = ((v as f64 - want) / want).abs();
        assert!(
            rel <= 1e-6,
            "inv_freq[{i}] = {v}, want {want} (rel {rel:e})"
        );
    }
    assert!(
        regimes.iter().all(|&c| c > 0),
        "test should cover high, medium and low frequencies: {regimes:?}"
    );
}

#[test]
fn rope_inv_freq_default_and_linear() {
    let def = inv_freq(128, 10_000.0, &RopeScaling::Default);
    let lin = inv_freq(128, 10_000.0, &RopeScaling::Linear { factor: 4.0 });
    assert_eq!(def.len(), 64);
    for i in 0..64 {
        let want = 1.0 / 10_000f64.powf((2 * i) as f64 / 128.0);
        assert!(
            ((def[i] as f64 - want) / want).abs() <= 1e-6,
            "default inv_freq[{i}]"
        );
        assert!(
            ((lin[i] as f64 - want / 4.0) / want * 4.0).abs() <= 1e-6,
            "linear inv_freq[{i}]"
        );
    }
}

#[test]
fn rope_rejects_bad_inputs() -> Result<()> {
    assert!(
        RotaryEmbedding::new(63, 10_000.0, &RopeScaling::Default).is_err(),
        "odd head_dim"
    );
    assert!(
        RotaryEmbedding::new(0, 10_000.0, &RopeScaling::Default).is_err(),
        "zero head_dim"
    );
    assert!(
        RotaryEmbedding::new(64, -1.0, &RopeScaling::Default).is_err(),
        "negative theta"
    );
    let rope = RotaryEmbedding::new(8, 10_000.0, &RopeScaling::Default)?;
    let mut rng = StdRng::seed_from_u64(24);
    let x = rand_tensor(&mut rng, &[1, 4, 2, 8], DType::F32)?;
    assert!(
        rope.apply(&x, &[0, 1, 2]).is_err(),
        "positions shorter than seq"
    );
    assert!(
        rope.apply(&x, &[0, 1, 2, 3, 4]).is_err(),
        "positions longer than seq"
    );
    let x16 = rand_tensor(&mut rng, &[1, 4, 2, 16], DType::F32)?;
    assert!(
        rope.apply(&x16, &[0, 1, 2, 3]).is_err(),
        "head_dim mismatch"
    );
    let x3 = rand_tensor(&mut rng, &[4, 2, 8], DType::F32)?;
    assert!(rope.apply(&x3, &[0, 1, 2, 3]).is_err(), "rank 3");
    assert!(
        rope.apply(&x.to_dtype(DType::U32)?, &[0, 1, 2, 3]).is_err(),
        "integer dtype"
    );
    Ok(())
}
