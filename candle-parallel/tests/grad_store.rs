//! The workspace's candle-core patch (third_party/README.md): a gradient's first contribution
//! is stored as it is instead of being added to a fresh tensor of zeros.
//!
//! These tests see whether the patch is in effect (a removed `[patch.crates-io]` fails the first
//! one: the stored gradient is then a new buffer), that accumulation over several contributions
//! is unchanged (also where candle subtracts), that a slice of a larger buffer is not stored as
//! a view (it would keep the buffer alive), and that a contribution of the wrong shape or dtype
//! still fails as candle's addition made it fail.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};

/// Identity forward; the backward returns a fixed tensor (`grad`) whatever it is given.
struct FixedGrad {
    grad: Tensor,
}

impl CustomOp1 for FixedGrad {
    fn name(&self) -> &'static str {
        "fixed-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = match s {
            CpuStorage::F32(v) => v,
            _ => candle_core::bail!("fixed-grad: f32 only"),
        };
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("fixed-grad: contiguous input only".into()))?;
        Ok((CpuStorage::F32(x[start..end].to_vec()), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.grad.clone()))
    }
}

/// The buffer behind a CPU f32 tensor: the address of the tensor's first element and the
/// buffer's length in elements.
fn buffer(t: &Tensor) -> (usize, usize) {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => {
            (v[layout.start_offset()..].as_ptr() as usize, v.len())
        }
        _ => panic!("not an f32 CPU tensor"),
    }
}

fn random(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

/// The gradient the store holds for a fresh variable whose one use contributes `contribution`.
fn stored_grad(contribution: &Tensor) -> Result<Tensor> {
    let x = Var::from_tensor(&random(&[4, 8]))?;
    let y = x.as_tensor().apply_op1(FixedGrad {
        grad: contribution.clone(),
    })?;
    let grads = y.sum_all()?.backward()?;
    Ok(grads.get(x.as_tensor()).expect("x has a gradient").clone())
}

/// One contribution: the store holds that very tensor (no zeros, no addition, no copy).
#[test]
fn single_contribution_is_stored_without_a_copy() -> Result<()> {
    let g = random(&[4, 8]);
    let gx = stored_grad(&g)?;
    assert_eq!(
        buffer(&gx).0,
        buffer(&g).0,
        "the gradient was copied: is the candle-core patch of third_party/ in effect?"
    );
    assert_eq!(gx.to_vec2::<f32>()?, g.to_vec2::<f32>()?);
    Ok(())
}

/// Two contributions to one tensor still sum, in the order candle visits them; a strided first
/// contribution is stored contiguous.
#[test]
fn several_contributions_are_summed() -> Result<()> {
    let x = Var::from_tensor(&random(&[4, 8]))?;
    let g1 = random(&[8, 4]).t()?; // strided
    let g2 = random(&[4, 8]);
    let a = x.as_tensor().apply_op1(FixedGrad { grad: g1.clone() })?;
    let b = x.as_tensor().apply_op1(FixedGrad { grad: g2.clone() })?;
    let grads = (a + b)?.sum_all()?.backward()?;
    let gx = grads.get(x.as_tensor()).expect("x has a gradient");
    let want = (&g1 + &g2)?;
    assert_eq!(gx.to_vec2::<f32>()?, want.to_vec2::<f32>()?);

    let gx = stored_grad(&g1)?;
    assert!(
        gx.is_contiguous(),
        "a strided contribution must be stored contiguous"
    );
    assert_eq!(gx.to_vec2::<f32>()?, g1.to_vec2::<f32>()?);
    Ok(())
}

/// A contribution that is a slice of a larger buffer (as SwiGLU's packed `[d gate; d up]`) is
/// stored as its own compact copy: stored as the view, it would keep the whole buffer alive.
#[test]
fn slice_of_a_larger_buffer_is_stored_compact() -> Result<()> {
    let packed = random(&[2 * 4 * 8]);
    let first = packed.narrow(0, 0, 32)?.reshape((4, 8))?;
    assert_eq!(buffer(&first).1, 64);
    let gx = stored_grad(&first)?;
    assert_eq!(
        buffer(&gx).1,
        32,
        "the stored gradient keeps the packed buffer alive"
    );
    assert_eq!(gx.to_vec2::<f32>()?, first.to_vec2::<f32>()?);
    Ok(())
}

/// An f(x) and its derivative, for the sites that subtract.
type Case = (&'static str, fn(&Tensor) -> Result<Tensor>, fn(f64) -> f64);

/// The sites that subtract their contribution (`a - x`, `a / x`, cos, tanh, neg, recip) give the
/// analytic gradient both as the first contribution (stored negated) and after another one
/// (subtracted from it). f32 with 1e-6 relative tolerance: candle's f32 cos, tanh and division
/// against the f64 formulas.
#[test]
fn subtracting_sites_give_the_analytic_gradient() -> Result<()> {
    let xs: Vec<f32> = (0..32).map(|i| 0.3 + i as f32 * 0.05).collect();
    let x = Var::new(xs.as_slice(), &Device::Cpu)?;
    let cases: [Case; 6] = [
        ("a - x", |x| (x.ones_like()? * 2.5)?.sub(x), |_| -1.0),
        (
            "a / x",
            |x| (x.ones_like()? * 2.5)?.div(x),
            |x| -2.5 / (x * x),
        ),
        ("cos", |x| x.cos(), |x| -x.sin()),
        ("tanh", |x| x.tanh(), |x| 1.0 - x.tanh() * x.tanh()),
        ("neg", |x| x.neg(), |_| -1.0),
        ("recip", |x| x.recip(), |x| -1.0 / (x * x)),
    ];
    for (name, f, df) in cases {
        for second in [false, true] {
            // With `second`, `x` itself (derivative 1) is added after `3 f(x)`: backward meets
            // the addition first, so `f`'s site subtracts from a stored gradient.
            let y = (f(x.as_tensor())? * 3.0)?;
            let y = if second { (y + x.as_tensor())? } else { y };
            let grads = y.sum_all()?.backward()?;
            let got = grads.get(x.as_tensor()).expect("x has a gradient");
            let want: Vec<f32> = xs
                .iter()
                .map(|&v| (3.0 * df(v as f64) + if second { 1.0 } else { 0.0 }) as f32)
                .collect();
            let want = Tensor::new(want.as_slice(), &Device::Cpu)?;
            testkit::assert_close(got, &want, 1e-6, &format!("{name}, second: {second}"));
        }
    }
    Ok(())
}

/// A contribution of the wrong shape or dtype is an error, as the addition to zeros made it.
#[test]
fn mismatched_contribution_is_an_error() -> Result<()> {
    for bad in [random(&[8, 4]), random(&[4, 8]).to_dtype(DType::F64)?] {
        assert!(stored_grad(&bad).is_err());
    }
    Ok(())
}
