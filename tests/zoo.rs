//! The model zoo (Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3) against transformers and
//! under every layout.
//!
//! - Each fixture of `scripts/make_zoo_fixtures.py` on one rank: logits, loss and every
//!   parameter's gradient equal transformers' float64 reference within 1e-5 relative (max-abs /
//!   max|ref| per tensor; transformers' own float32 run is 1e-6 to 7e-6 from it, see the
//!   fixtures' README). The sequence (32) is longer than the sliding windows (8), whose removal
//!   changes the logits by 70-110%.
//! - Each family under tp2, zigzag and contiguous ring4, USP 2x2, double ring, all-gather CP and ZeRO-3 with
//!   selective checkpointing: loss, logits and every parameter's whole gradient equal one rank
//!   (1e-5 relative), every gradient non-zero; likewise LoRA on Phi-3's fused modules.
//! - Each family trains 3 AdamW steps through the registry under pp2 (and Qwen2 under pp2 x
//!   ring2) and under every layout above: losses, gradient norms, held-out loss and final
//!   weights equal one rank (1e-5).

use candle_parallel::attention::Strategy;
use candle_parallel::recompute::Checkpointing;
use std::collections::HashMap;
use std::sync::Arc;

use candle_parallel::nn::{Adapters, LoraConfig, LoraTargets, TensorMap};
use cpl_integration_tests::{
    assert_same_registry_run, assert_same_registry_run_weights, assert_same_step,
    assert_weights_close_up_to_adam, check_bf16_follows_one_rank, check_kv_cache, check_reference,
    check_saved_under_tp2_reloads, fixture_dir, fixture_files, random_matrix, rel_err, run_layout,
    run_layout_lora, run_layout_with, train_through_registry, Layout, StepPlan,
};
use train::data::PackedDataset;

const TOL: f64 = 1e-5;
const FAMILIES: [&str; 9] = [
    "zoo/qwen2",
    "zoo/qwen2_v4",
    "zoo/qwen3",
    "zoo/mistral",
    "zoo/gemma2",
    "zoo/gemma3",
    "zoo/gemma3_v4",
    "zoo/phi3",
    "zoo/phi3_longrope",
];
/// One fixture per family and feature, run under every layout, with the KV cache, saved and
/// reloaded, in bf16.
const LAYOUT_FAMILIES: [&str; 7] = [
    "zoo/qwen2",
    "zoo/qwen3",
    "zoo/mistral",
    "zoo/gemma2",
    "zoo/gemma3",
    "zoo/phi3",
    "zoo/phi3_longrope",
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

#[test]
fn phi3_with_fused_projections_matches_transformers() {
    check_reference("zoo/phi3");
}

#[test]
fn phi3_with_longrope_partial_rotation_and_window_matches_transformers() {
    check_reference("zoo/phi3_longrope");
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
        ("zoo/phi3", "phi3"),
        ("zoo/phi3_longrope", "phi3"),
    ] {
        let f = models::family::detect(&fixture_files(name).config).unwrap();
        assert_eq!(f.name, family, "{name}");
    }
}

/// A copy of fixture `name`'s `config.json` edited by `edit`, in a fresh directory.
fn edited_config(
    name: &str,
    tag: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> std::path::PathBuf {
    let src = fixture_files(name).config;
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&src).unwrap()).unwrap();
    edit(&mut v);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("zoo-config-{}-{tag}", name.replace('/', "-")));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(&path, v.to_string()).unwrap();
    path
}

/// Fields no family implements are errors naming the field and the file, in every family
/// (LLaMA's and the mixtures of experts' included): attention dropout (training runs without
/// dropout) and a quantized checkpoint's `quantization_config`; 0 and `null` load.
#[test]
fn unsupported_config_fields_are_named_in_every_family() {
    let names = FAMILIES.iter().copied().chain([
        "llama/gqa",
        "moe/mixtral",
        "moe/qwen2_moe",
        "moe/qwen3_moe",
    ]);
    for name in names {
        let family = models::family::detect(&fixture_files(name).config).unwrap();
        let describe = |path: &std::path::Path| (family.describe)(path).map(|_| ());
        for (tag, key, value, wanted) in [
            (
                "dropout",
                "attention_dropout",
                serde_json::json!(0.1),
                "`attention_dropout` 0.1",
            ),
            (
                "gptq",
                "quantization_config",
                serde_json::json!({"quant_method": "gptq", "bits": 4}),
                "`quantization_config` (gptq)",
            ),
        ] {
            let path = edited_config(name, tag, |v| v[key] = value.clone());
            let e = describe(&path).unwrap_err().to_string();
            assert!(
                e.contains(wanted) && e.contains(&path.display().to_string()),
                "{name} {key}: {e}"
            );
        }
        let path = edited_config(name, "zero", |v| {
            v["attention_dropout"] = serde_json::json!(0.0);
            v["quantization_config"] = serde_json::Value::Null;
        });
        describe(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Fields a config leaves out take transformers' defaults, and `null` means none: Mistral's
/// window 4096; Gemma 2's caps 50 (attention) and 30 (final logits); Gemma 3 has no cap by
/// default and soft-caps the final logits when its config sets the cap (transformers applies
/// it), while an attention cap, which transformers' Gemma 3 reads but never applies, is an
/// error naming the field.
#[test]
fn absent_config_fields_take_transformers_defaults() {
    use models::decoder::ToDecoderSpec;
    use models::zoo::gemma::{GemmaConfig, Generation};
    let spec_of = |name: &str, tag: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let path = edited_config(name, tag, |v| edit(v));
        let text = std::fs::read_to_string(&path).unwrap();
        match name {
            "zoo/mistral" => {
                <models::zoo::MistralConfig as models::decoder::DecoderConfig>::from_json(
                    &text, &path,
                )
                .and_then(|c| c.decoder_spec())
            }
            "zoo/gemma2" => GemmaConfig::from_json(&text, &path, Generation::Gemma2)
                .and_then(|c| c.decoder_spec()),
            _ => GemmaConfig::from_json(&text, &path, Generation::Gemma3)
                .and_then(|c| c.decoder_spec()),
        }
    };
    let windows = |s: &models::decoder::DecoderSpec| -> Vec<Option<usize>> {
        s.layers.iter().map(|l| l.window).collect()
    };
    let mistral = spec_of("zoo/mistral", "absent", &|v| {
        v.as_object_mut().unwrap().remove("sliding_window");
    })
    .unwrap();
    assert!(
        windows(&mistral).iter().all(|w| *w == Some(4096)),
        "{:?}",
        windows(&mistral)
    );
    let mistral = spec_of("zoo/mistral", "null", &|v| {
        v["sliding_window"] = serde_json::Value::Null
    })
    .unwrap();
    assert!(windows(&mistral).iter().all(Option::is_none));

    let gemma2 = spec_of("zoo/gemma2", "absent", &|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("attn_logit_softcapping");
        o.remove("final_logit_softcapping");
    })
    .unwrap();
    assert_eq!(
        (gemma2.attn_softcap, gemma2.final_softcap),
        (Some(50.0), Some(30.0))
    );
    let gemma2 = spec_of("zoo/gemma2", "null", &|v| {
        v["attn_logit_softcapping"] = serde_json::Value::Null;
        v["final_logit_softcapping"] = serde_json::Value::Null;
    })
    .unwrap();
    assert_eq!((gemma2.attn_softcap, gemma2.final_softcap), (None, None));

    let gemma3 = spec_of("zoo/gemma3", "absent", &|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("attn_logit_softcapping");
        o.remove("final_logit_softcapping");
    })
    .unwrap();
    assert_eq!((gemma3.attn_softcap, gemma3.final_softcap), (None, None));
    let gemma3 = spec_of("zoo/gemma3", "final", &|v| {
        v["final_logit_softcapping"] = serde_json::json!(30.0)
    })
    .unwrap();
    assert_eq!(
        (gemma3.attn_softcap, gemma3.final_softcap),
        (None, Some(30.0))
    );
    let e = spec_of("zoo/gemma3", "attn", &|v| {
        v["attn_logit_softcapping"] = serde_json::json!(50.0)
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("attn_logit_softcapping") && e.contains("config.json"),
        "{e}"
    );
}

fn layouts() -> Vec<(Layout, StepPlan)> {
    let plain = StepPlan::default();
    vec![
        (Layout::new("tp2", 2, 1, 1, Strategy::Ring), plain),
        (Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring), plain),
        // Contiguous blocks of 8 tokens: a window of 8 lets the ring skip whole block pairs.
        (
            Layout::new("contiguous ring4", 1, 1, 4, Strategy::Ring)
                .with_sp(|s| s.with_layout(candle_parallel::attention::SeqLayout::Contiguous)),
            plain,
        ),
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
    for name in LAYOUT_FAMILIES {
        let want = run_layout(name, &Layout::single());
        for (layout, plan) in layouts() {
            let got = run_layout_with(name, &layout, plan);
            assert_same_step(&format!("{name} / {}", layout.name), &got, &want, TOL);
        }
    }
}

/// Random non-zero LoRA adapters (rank 4) on every linear layer of the `phi3` fixture, in
/// PEFT's layout for its fused modules: `qkv_proj` `A` (4, 32) and `B` (64, 4) (q 32 + k 16 +
/// v 16 rows), `gate_up_proj` `B` (128, 4), `o_proj`, `down_proj`.
fn phi3_adapters() -> Arc<Adapters> {
    let dev = candle_core::Device::Cpu;
    let mut t = HashMap::new();
    let mut seed = 300u64;
    for l in 0..2 {
        for (name, out, inp) in [
            ("self_attn.qkv_proj", 64, 32),
            ("self_attn.o_proj", 32, 32),
            ("mlp.gate_up_proj", 128, 32),
            ("mlp.down_proj", 32, 64),
        ] {
            let p = format!("model.layers.{l}.{name}");
            seed += 2;
            t.insert(
                format!("{p}.lora_A.weight"),
                random_matrix(4, inp, seed, &dev),
            );
            t.insert(
                format!("{p}.lora_B.weight"),
                random_matrix(out, 4, seed + 1, &dev),
            );
        }
    }
    let cfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: LoraTargets::AllLinear,
        use_rslora: false,
        seed: 0,
        target_parameters: Vec::new(),
        alpha_pattern: Default::default(),
        rank_pattern: Default::default(),
    };
    Adapters::new(cfg, Some(Arc::new(TensorMap::new(t, "phi3 adapters")))).unwrap()
}

/// LoRA on Phi-3's fused modules (one `A` per fused module shared by its parts; `B` split by
/// the parts' rows, and over tp by heads like the weight) under every layout equals one rank:
/// loss, logits and every adapter gradient (`A`'s summed over the parts and, under TP-sp, over
/// tp) within 1e-5, all non-zero, under PEFT's fused names and shapes. The adapters move the
/// logits far from the base model's.
#[test]
fn phi3_fused_lora_under_every_layout_matches_one_rank() {
    let name = "zoo/phi3";
    let adapters = phi3_adapters();
    let single = Layout::single();
    let want = run_layout_lora(name, &single, StepPlan::default(), Some(adapters.clone()));
    let mut got_names: Vec<(String, Vec<usize>)> = want
        .grads
        .iter()
        .map(|(n, g)| (n.clone(), g.dims().to_vec()))
        .collect();
    got_names.sort();
    let source = adapters.source().unwrap();
    let mut names: Vec<(String, Vec<usize>)> = source
        .names()
        .unwrap()
        .into_iter()
        .map(|n| {
            let shape = source.shape(&n).unwrap();
            (n, shape)
        })
        .collect();
    names.sort();
    assert_eq!(
        got_names, names,
        "adapter gradients by PEFT's names and shapes"
    );
    let base = run_layout(name, &single).logits;
    assert!(
        rel_err(&want.logits, &base) > 0.1,
        "the adapters change the logits"
    );
    let tp_sp = Layout::new("tp2 + TP-sp", 2, 1, 1, Strategy::Ring).with_tp_sp();
    for (layout, plan) in layouts().into_iter().chain([(tp_sp, StepPlan::default())]) {
        let got = run_layout_lora(name, &layout, plan, Some(adapters.clone()));
        assert_same_step(&format!("{name} LoRA / {}", layout.name), &got, &want, TOL);
    }
}

fn config(steps: u64) -> train::trainer::TrainConfig {
    cpl_integration_tests::small_train_config(steps, Default::default(), 2, 5)
}

fn data() -> PackedDataset {
    cpl_integration_tests::synthetic_windows(12, 37, 11)
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
        ("zoo/phi3", vec![Layout::single().with_pp(2)]),
        ("zoo/phi3_longrope", vec![Layout::single().with_pp(2)]),
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
            assert_same_registry_run(&format!("{name} / {}", layout.name), &got, &want, TOL);
        }
    }
}

/// Each family trains 3 AdamW steps through the registry (the trainer, its optimizer, the
/// held-out loss) under every layout of [`layouts`] (tp2, zigzag and contiguous rings of 4, USP
/// 2x2, double ring, all-gather CP, ZeRO-3 with selective checkpointing) like one rank: losses,
/// gradient norms and held-out loss within 1e-5, and the final weights within 1e-5 up to the
/// isolated entries AdamW may move apart ([`assert_weights_close_up_to_adam`]: an entry whose
/// gradient cancels to about AdamW's ε turns a rounding difference far inside the gradients'
/// 1e-5 into an update difference of up to `lr`; measured: one entry of Phi-3's embedding under
/// tp2, 1.9e-5 of the tensor's largest weight, the tensor's other entries within 6e-8).
/// The one-step test above compares every gradient; the pipeline's runs are above.
#[test]
fn every_family_trains_three_steps_under_every_layout_like_one_rank() {
    let data = data();
    for name in LAYOUT_FAMILIES {
        let files = fixture_files(name);
        let cfg = config(3);
        let want = train_through_registry(&files, &Layout::single(), &cfg, &data);
        assert!(want.losses.iter().all(|l| l.is_finite()), "{name}");
        for (layout, plan) in layouts() {
            let mut cfg = cfg.clone();
            cfg.memory.checkpointing = plan.checkpointing;
            if plan.zero3 {
                cfg.memory.zero = candle_parallel::optim::ZeroStage::Parameters;
            }
            let case = format!("{name} / {}", layout.name);
            let got = train_through_registry(&files, &layout, &cfg, &data);
            assert_same_registry_run_weights(&case, &got, &want, TOL, f64::INFINITY);
            assert_weights_close_up_to_adam(&case, &got, &want, cfg.adamw.lr, TOL);
        }
    }
}

/// Generation with the KV cache, one token at a time over the fixture's 32 tokens (longer than
/// the windows): each token's logits equal transformers' reference logits of the full sequence
/// (1e-5 relative), on one rank and under tp2, so the window holds in the cache too. Phi-3's
/// LongRoPE fixture starts from a prompt of 17 tokens, longer than its
/// `original_max_position_embeddings` (16), so that every key is rotated with the long factors
/// as in the reference (transformers' `generate` too rotates shorter prompts with the short
/// ones and keeps them in the cache).
#[test]
fn kv_cache_follows_transformers_through_the_windows() {
    for name in LAYOUT_FAMILIES {
        let prompt = if name == "zoo/phi3_longrope" { 17 } else { 3 };
        check_kv_cache(name, prompt, TOL);
    }
}

/// Saving: each family loaded under tp2 and saved (gathered, in the checkpoint's layout: Phi-3's
/// projections fused back; sharded with an index, its config copied) reloads through the
/// registry on one rank with bit-identical logits, and the saved tensors are the fixture's
/// checkpoint's, bit for bit.
#[test]
fn every_family_saved_under_tp2_reloads_identically() {
    for name in LAYOUT_FAMILIES {
        check_saved_under_tp2_reloads(name);
    }
}

/// bf16 end to end for each family: a tp2 x ring2 bf16 run follows the one-rank bf16 run
/// ([`check_bf16_follows_one_rank`]).
#[test]
fn every_family_in_bf16_follows_its_one_rank_run() {
    for name in LAYOUT_FAMILIES {
        check_bf16_follows_one_rank(name, &Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring));
    }
}
