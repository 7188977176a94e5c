//! The model zoo (Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3) against transformers and under
//! every layout.
//!
//! - Each fixture of `scripts/make_zoo_fixtures.py` on one rank: logits, loss and every
//!   parameter's gradient equal transformers' float64 reference within 1e-5 relative (max-abs /
//!   max|ref| per tensor; transformers' own float32 run is 1e-6 to 7e-6 from it, see the
//!   fixtures' README). The sequence (32) is longer than the sliding windows (8), whose removal
//!   changes the logits by 70-110%.
//! - Each family under tp2, zigzag ring4, USP 2x2, double ring, all-gather CP and ZeRO-3 with
//!   selective checkpointing: loss, logits and every parameter's whole gradient equal one rank
//!   (1e-5 relative), every gradient non-zero.
//! - Each family trains 3 AdamW steps through the registry under pp2 (and Qwen2 under pp2 x
//!   ring2): losses, gradient norms, held-out loss and final weights equal one rank (1e-5).

use candle_parallel::attention::Strategy;
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    check_reference, fixture_dir, fixture_files, max_abs, rel_err, run_layout, run_layout_with,
    train_through_registry, Layout, StepPlan,
};
use train::data::{PackedDataset, Packing, TokenStream};

const TOL: f64 = 1e-5;
const FAMILIES: [&str; 7] = [
    "zoo/qwen2",
    "zoo/qwen2_v4",
    "zoo/qwen3",
    "zoo/mistral",
    "zoo/gemma2",
    "zoo/gemma3",
    "zoo/gemma3_v4",
];

#[test]
fn qwen2_with_sliding_windows_matches_transformers() {
    check_reference("zoo/qwen2");
}

#[test]
fn qwen2_5_hub_config_without_window_matches_transformers() {
    check_reference("zoo/qwen2_v4");
}

#[test]
fn qwen3_matches_transformers() {
    check_reference("zoo/qwen3");
}

#[test]
fn mistral_matches_transformers() {
    check_reference("zoo/mistral");
}

#[test]
fn gemma2_with_soft_caps_matches_transformers() {
    check_reference("zoo/gemma2");
}

#[test]
fn gemma3_with_per_layer_rope_matches_transformers() {
    check_reference("zoo/gemma3");
}

#[test]
fn gemma3_hub_config_matches_transformers() {
    check_reference("zoo/gemma3_v4");
}

/// Every fixture directory has a test above, and the registry names its family.
#[test]
fn every_zoo_fixture_is_tested_and_detected() {
    let root = fixture_dir("zoo/x");
    let root = root.parent().unwrap();
    let mut found: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("reference.safetensors").is_file())
        .map(|e| format!("zoo/{}", e.file_name().to_string_lossy()))
        .collect();
    found.sort();
    let mut want: Vec<String> = FAMILIES.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(found, want);
    for (name, family) in [
        ("zoo/qwen2", "qwen2"),
        ("zoo/qwen2_v4", "qwen2"),
        ("zoo/qwen3", "qwen3"),
        ("zoo/mistral", "mistral"),
        ("zoo/gemma2", "gemma2"),
        ("zoo/gemma3", "gemma3"),
        ("zoo/gemma3_v4", "gemma3"),
    ] {
        let f = models::family::detect(&fixture_files(name).config).unwrap();
        assert_eq!(f.name, family, "{name}");
    }
}

fn layouts() -> Vec<(Layout, StepPlan)> {
    let plain = StepPlan::default();
    vec![
        (Layout::new("tp2", 2, 1, 1, Strategy::Ring), plain),
        (Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring), plain),
        (Layout::new("usp 2x2", 1, 2, 2, Strategy::Usp), plain),
        (
            Layout::new("double ring w2 on 4", 1, 1, 4, Strategy::DoubleRing)
                .with_sp(|s| s.with_inner_ring(2)),
            plain,
        ),
        (
            Layout::new("all-gather CP 4", 1, 1, 4, Strategy::AllGather),
            plain,
        ),
        (
            Layout::new("zero3 + selective zigzag ring4", 1, 1, 4, Strategy::Ring),
            StepPlan {
                checkpointing: Checkpointing::Selective,
                zero3: true,
                dtype: None,
            },
        ),
    ]
}

#[test]
fn every_family_under_every_layout_matches_one_rank() {
    for name in [
        "zoo/qwen2",
        "zoo/qwen3",
        "zoo/mistral",
        "zoo/gemma2",
        "zoo/gemma3",
    ] {
        let want = run_layout(name, &Layout::single());
        for (layout, plan) in layouts() {
            let got = run_layout_with(name, &layout, plan);
            let case = format!("{name} / {}", layout.name);
            testkit::assert_close_scalar(
                got.loss as f64,
                want.loss as f64,
                TOL,
                &format!("{case}: loss"),
            );
            let e = rel_err(&got.logits, &want.logits);
            assert!(e <= TOL, "{case}: logits rel err {e}");
            assert_eq!(got.grads.len(), want.grads.len(), "{case}");
            for (n, g) in &want.grads {
                let ours = &got.grads[n];
                assert!(max_abs(ours) > 0.0, "{case}: the gradient of {n} is zero");
                let e = rel_err(ours, g);
                assert!(e <= TOL, "{case}: gradient of {n}: rel err {e}");
            }
        }
    }
}

fn config(steps: u64) -> train::trainer::TrainConfig {
    use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule};
    train::trainer::TrainConfig {
        seq_len: 32,
        steps,
        batch: 1,
        grad_accum: 2,
        doc_mask: false,
        seed: 5,
        shuffle: true,
        adamw: AdamWConfig {
            lr: 5e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule: LrSchedule {
            peak_lr: 5e-3,
            min_lr: 5e-4,
            warmup_steps: 1,
            total_steps: steps,
            decay: Decay::Cosine,
        },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: 16,
        memory: Default::default(),
        pipeline: None,
    }
}

fn data() -> PackedDataset {
    let docs: Vec<Vec<u32>> = (0..12)
        .map(|d| {
            (0..40)
                .map(|i| ((d * 37 + i * 11 + i * i) % 256) as u32)
                .collect()
        })
        .collect();
    PackedDataset::new(
        TokenStream::from_sequences(&docs, 256).unwrap(),
        32,
        Packing::Continuous,
    )
    .unwrap()
}

#[test]
fn every_family_trains_under_a_pipeline_like_one_rank() {
    let cfg = config(3);
    let data = data();
    for (name, layouts) in [
        ("zoo/qwen2_v4", vec![Layout::single().with_pp(2)]),
        ("zoo/qwen3", vec![Layout::single().with_pp(2)]),
        ("zoo/mistral", vec![Layout::single().with_pp(2)]),
        ("zoo/gemma2", vec![Layout::single().with_pp(2)]),
        ("zoo/gemma3", vec![Layout::single().with_pp(2)]),
        (
            "zoo/qwen2",
            vec![Layout::new("pp2 x ring2", 1, 1, 2, Strategy::Ring).with_pp(2)],
        ),
    ] {
        let files = fixture_files(name);
        let want = train_through_registry(&files, &Layout::single(), &cfg, &data);
        assert!(want.losses.iter().all(|l| l.is_finite()), "{name}");
        for layout in layouts {
            let got = train_through_registry(&files, &layout, &cfg, &data);
            let case = format!("{name} / {}", layout.name);
            for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
                testkit::assert_close_scalar(*a, *b, TOL, &format!("{case}: step {i} loss"));
            }
            for (i, (a, b)) in got.grad_norms.iter().zip(&want.grad_norms).enumerate() {
                testkit::assert_close_scalar(*a, *b, TOL, &format!("{case}: step {i} grad norm"));
            }
            testkit::assert_close_scalar(
                got.eval_loss,
                want.eval_loss,
                TOL,
                &format!("{case}: eval"),
            );
            assert_eq!(got.weights.len(), want.weights.len(), "{case}");
            for (n, w) in &want.weights {
                let e = rel_err(&got.weights[n], w);
                assert!(e <= TOL, "{case}: final weight {n}: rel err {e:e}");
            }
        }
    }
}

/// Generation with the KV cache, one token at a time over the fixture's 32 tokens (longer than
/// the windows): each token's logits equal transformers' reference logits of the full sequence
/// (1e-5 relative), on one rank and under tp2, so the window holds in the cache too.
#[test]
fn kv_cache_follows_transformers_through_the_windows() {
    use candle_core::{Device, Tensor};
    use candle_parallel::comm::LocalWorld;
    use cpl_integration_tests::{load_fixture_lm, reference};
    use models::causal_lm::KvCache;

    for name in [
        "zoo/qwen2",
        "zoo/qwen3",
        "zoo/mistral",
        "zoo/gemma2",
        "zoo/gemma3",
    ] {
        let r = reference(name);
        let ids = r.input_ids[0].clone();
        let want = r.logits.narrow(0, 0, 1).unwrap().squeeze(0).unwrap();
        for layout in [
            Layout::single(),
            Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        ] {
            LocalWorld::run(layout.ranks, |world| -> Result<(), String> {
                let (_mesh, ctx) = layout.context(world)?;
                let m = load_fixture_lm(name, &ctx, None)
                    .map_err(|e| e.to_string())?
                    .model;
                let mut cache = KvCache::default();
                // A prompt of 3 tokens, then one token per step.
                let mut at = 0;
                for n in std::iter::once(3).chain(std::iter::repeat_n(1, ids.len() - 3)) {
                    let next =
                        Tensor::from_vec(ids[at..at + n].to_vec(), (1, n), &Device::Cpu).unwrap();
                    let x = m.embed_cached(&next).map_err(|e| e.to_string())?;
                    let x = m
                        .layers_cached(&x, 0..m.num_layers(), &mut cache)
                        .map_err(|e| e.to_string())?;
                    cache.advance(n);
                    let logits = m.head_cached(&x).map_err(|e| e.to_string())?;
                    at += n;
                    let row = want.narrow(0, at - 1, 1).unwrap();
                    let e = rel_err(&logits, &row);
                    assert!(
                        e <= TOL,
                        "{name} / {}: token {}: rel err {e}",
                        layout.name,
                        at - 1
                    );
                }
                Ok(())
            })
            .unwrap();
        }
    }
}
