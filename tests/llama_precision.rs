//! Accuracy on large activations (issue 21): the `massive` fixture of
//! `scripts/make_precision_fixture.py` is a one-layer LLaMA whose MLP outputs are long sums of
//! large same-sign products that cancel to small results, the sums that made `cpl eval` lose
//! precision on a trained SmolLM2. Its reference logits are float64.
//!
//! Tolerance: the error of transformers' own f32 forward (eager attention) against the same
//! reference, measured by the script and stored with it (`hf_f32_eager_rel_err`, 1.6e-5). The
//! issue asks for at most 2x PyTorch's error; `cpl` is at 0.4-0.6x of it (single rank, ring and
//! tensor-parallel layouts), while one running sum per block of 512 products (`Tensor::matmul`
//! through the `gemm` crate, the order before the fix) gives 2.3x (`long_chain_rel_err`, and the
//! same measured with the old kernel: see `docs/accuracy.md`).
//!
//! Error metric: `max |logits - reference| / max |reference|`, in f64.

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::AttnMask;
use candle_parallel::comm::LocalWorld;
use candle_parallel::nn::Batch;
use candle_parallel::nn::ParamMode;
use cpl_integration_tests::{fixture_dir, fixture_files, Layout};
use models::llama;

struct Reference {
    input_ids: Vec<u32>,
    logits: Vec<f64>,
    hf_eager: f64,
    long_chain: f64,
}

fn reference() -> Reference {
    let path = fixture_dir("massive").join("reference.safetensors");
    let t = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let scalar = |k: &str| {
        t[k].to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    Reference {
        input_ids: t["input_ids"]
            .flatten_all()
            .unwrap()
            .to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| x as u32)
            .collect(),
        logits: t["logits"].flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        hf_eager: scalar("hf_f32_eager_rel_err"),
        long_chain: scalar("long_chain_rel_err"),
    }
}

/// `max |a - r| / max |r|` in f64; `+inf` on a NaN anywhere (testkit's measure).
fn rel(a: &[f64], r: &[f64]) -> f64 {
    testkit::rel_err_values(a, r)
}

/// The fixture's logits under `layout`, in global token order, as f64.
fn logits(layout: &Layout, ids: &[u32]) -> Vec<f64> {
    let files = fixture_files("massive");
    let seqs = vec![ids.to_vec()];
    let mut out = LocalWorld::run(layout.ranks, |world| -> Result<Vec<f64>, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (_mesh, ctx) = layout.context(world)?;
        let model = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Frozen)
            .map_err(|x| e(&x))?
            .model;
        let (batch, _) = Batch::from_sequences(&ctx, &seqs, AttnMask::Causal).map_err(|x| e(&x))?;
        let l = model.logits(&batch).map_err(|x| e(&x))?;
        let l: Tensor = ctx.gather_tokens(&l).map_err(|x| e(&x))?;
        l.to_dtype(DType::F64)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f64>())
            .map_err(|x| e(&x))
    })
    .unwrap_or_else(|e| panic!("{}: {e}", layout.name));
    out.swap_remove(0)
}

fn check(layout: Layout) {
    let r = reference();
    // The fixture separates the two accumulation orders (else it proves nothing).
    assert!(
        r.long_chain > 2.0 * r.hf_eager,
        "fixture: long-chain error {} vs transformers {}",
        r.long_chain,
        r.hf_eager
    );
    let got = logits(&layout, &r.input_ids);
    let err = rel(&got, &r.logits);
    assert!(
        err <= r.hf_eager,
        "{}: logits error {err:.3e} against float64, transformers f32 {:.3e} (old order {:.3e})",
        layout.name,
        r.hf_eager,
        r.long_chain
    );
}

#[test]
fn single_rank_is_as_accurate_as_transformers() {
    check(Layout::single());
}

#[test]
fn ring_attention_is_as_accurate_as_transformers() {
    check(Layout::new(
        "ring2",
        1,
        1,
        2,
        candle_parallel::attention::Strategy::Ring,
    ));
}

#[test]
fn tensor_parallel_is_as_accurate_as_transformers() {
    check(Layout::new(
        "tp2",
        2,
        1,
        1,
        candle_parallel::attention::Strategy::Ring,
    ));
}
