//! LLaMA against transformers: for each fixture of `scripts/make_llama_fixtures.py` (tiny random
//! checkpoints with MHA, GQA 4:1, tied embeddings, Llama 3, YaRN, LongRoPE and dynamic-NTK rope
//! scaling (the last three on inputs longer than the original context), v4- and v5-style config
//! keys, a sharded checkpoint), our single-rank logits, loss and the gradient of every parameter
//! equal transformers' (computed in f64, stored in f32).
//!
//! Tolerances: logits 1e-4 relative (max-abs / max|ref|), loss 1e-5 relative, gradients 1e-4
//! relative, per parameter. Every parameter of the checkpoint must receive a gradient.

use cpl_integration_tests::{check_reference, reference, rel_err, run_layout, Layout};

const FIXTURES: [&str; 10] = [
    "mha",
    "gqa",
    "tied",
    "llama3_rope",
    "yarn_rope",
    "longrope_rope",
    "dynamic_rope",
    "v4_keys",
    "v5_keys",
    "sharded",
];

fn check(name: &str) {
    check_reference(name)
}

#[test]
fn mha_matches_transformers() {
    check("mha");
}

#[test]
fn gqa_matches_transformers() {
    check("gqa");
}

#[test]
fn tied_embeddings_match_transformers() {
    check("tied");
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    check("llama3_rope");
}

#[test]
fn yarn_rope_scaling_matches_transformers() {
    check("yarn_rope");
}

#[test]
fn longrope_scaling_matches_transformers() {
    check("longrope_rope");
}

#[test]
fn dynamic_ntk_rope_scaling_matches_transformers() {
    check("dynamic_rope");
}

#[test]
fn v4_config_keys_match_transformers() {
    check("v4_keys");
}

#[test]
fn v5_config_keys_match_transformers() {
    check("v5_keys");
}

#[test]
fn sharded_checkpoint_matches_transformers() {
    check("sharded");
}

/// Fixtures whose reference has another format, checked by another test file.
const TESTED_ELSEWHERE: [&str; 1] = [
    "massive", // tests/llama_precision.rs: float64 logits of large-activation sums
];

#[test]
fn every_fixture_is_tested() {
    let dir = cpl_integration_tests::fixture_dir("");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        if entry.path().join("reference.safetensors").is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            assert!(
                FIXTURES.contains(&name.as_str()) || TESTED_ELSEWHERE.contains(&name.as_str()),
                "fixture {name} has no test"
            );
        }
    }
}

/// Generation with the KV cache: the logits of each new token equal those of a full forward
/// pass over the whole sequence so far (1e-5 relative), single rank and tensor parallel.
#[test]
fn kv_cache_matches_full_forward() {
    use candle_core::{Device, Tensor};
    use candle_parallel::attention::AttnMask;
    use candle_parallel::comm::LocalWorld;
    use candle_parallel::nn::{Batch, ParamMode};

    use models::llama::{self, KvCache};

    for name in ["mha", "gqa"] {
        let files = cpl_integration_tests::fixture_files(name);
        for layout in [
            Layout::single(),
            Layout::new("tp2", 2, 1, 1, candle_parallel::attention::Strategy::Ring),
        ] {
            LocalWorld::run(layout.ranks, |world| -> Result<(), String> {
                let (_mesh, ctx) = layout.context(world)?;
                let m = llama::load(&files, &ctx, None, ParamMode::Frozen)
                    .map_err(|e| e.to_string())?
                    .model;
                let mut seq: Vec<u32> = vec![1, 17, 42, 99, 5];
                let mut cache = KvCache::default();
                let mut next = Tensor::from_vec(seq.clone(), (1, seq.len()), &Device::Cpu).unwrap();
                for step in 0..6 {
                    let cached = m
                        .forward_cached(&next, &mut cache)
                        .map_err(|e| e.to_string())?;
                    let (batch, _) = Batch::from_sequences(&ctx, &[seq.clone()], AttnMask::Causal)
                        .map_err(|e| e.to_string())?;
                    let full = m.logits(&batch).map_err(|e| e.to_string())?;
                    let last = full
                        .narrow(1, seq.len() - 1, 1)
                        .unwrap()
                        .squeeze(1)
                        .unwrap();
                    let e = rel_err(&cached, &last);
                    assert!(
                        e <= 1e-5,
                        "{name} / {}: step {step}: cached logits rel err {e}",
                        layout.name
                    );
                    let t = cached
                        .squeeze(0)
                        .unwrap()
                        .argmax(0)
                        .unwrap()
                        .to_scalar::<u32>()
                        .unwrap();
                    seq.push(t);
                    next = Tensor::from_vec(vec![t], (1, 1), &Device::Cpu).unwrap();
                }
                assert_eq!(cache.len(), seq.len() - 1);
                Ok(())
            })
            .unwrap();
        }
    }
}

/// Saving: a model loaded under tensor parallelism 2 and saved (gathered, sharded into several
/// files with an index, config and tokenizer copied) reloads on one rank with bit-identical
/// logits; a bf16 save reloads within bf16 precision. The directories are kept under
/// `target/tmp/` so that `scripts/check_hf_roundtrip.py` can load them in transformers.
#[test]
fn saved_checkpoints_reload_identically() {
    use candle_core::DType;
    use candle_parallel::comm::LocalWorld;
    use candle_parallel::nn::ParamMode;

    use models::checkpoint::{save_hf, SaveOptions};
    use models::llama;

    let files = cpl_integration_tests::fixture_files("mha");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let want = run_layout("mha", &Layout::single()).logits;
    for (dir_name, dtype, tol) in [
        ("saved-mha-tp2", DType::F32, 0.0f64),
        ("saved-mha-tp2-bf16", DType::BF16, 2e-2),
    ] {
        let dir = out.join(dir_name);
        // A stale directory is replaced whole.
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("stale.txt"), "old").unwrap();
        let layout = Layout::new("tp2", 2, 1, 1, candle_parallel::attention::Strategy::Ring);
        let mut extra = Vec::new();
        for f in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            extra.push((
                f.to_string(),
                std::fs::read(cpl_integration_tests::fixture_dir("mha").join(f)).unwrap(),
            ));
        }
        let opts = SaveOptions {
            dtype,
            max_shard_bytes: 40_000,
            extra_files: extra,
            ..Default::default()
        };
        LocalWorld::run(2, |world| -> Result<(), String> {
            let (_mesh, ctx) = layout.context(world)?;
            let m =
                llama::load(&files, &ctx, None, ParamMode::Frozen).map_err(|e| e.to_string())?;
            save_hf(&m.params.sorted(), ctx.tp().comm(), Some(&dir), &opts)
                .map_err(|e| e.to_string())
        })
        .unwrap();
        assert!(
            !dir.join("stale.txt").exists(),
            "the old directory was not replaced"
        );
        assert!(dir.join("model.safetensors.index.json").is_file());
        let saved = models::hub::from_dir(dir_name, &dir).unwrap();
        assert!(saved.weights.len() > 1, "expected a sharded save");
        // Reload with the saved config and compare logits on one rank.
        let r = reference("mha");
        let got = LocalWorld::run(1, |world| -> Result<candle_core::Tensor, String> {
            let l = Layout::single();
            let (_mesh, ctx) = l.context(world)?;
            let m = llama::load(&saved, &ctx, Some(DType::F32), ParamMode::Frozen)
                .map_err(|e| e.to_string())?;
            let (batch, _) = candle_parallel::nn::Batch::from_sequences(
                &ctx,
                &r.input_ids,
                candle_parallel::attention::AttnMask::Causal,
            )
            .map_err(|e| e.to_string())?;
            m.model.logits(&batch).map_err(|e| e.to_string())
        })
        .unwrap()
        .swap_remove(0);
        let e = rel_err(&got, &want);
        assert!(e <= tol, "{dir_name}: reloaded logits rel err {e}");
    }
}

/// The tokenizer gives transformers' ids (with and without special tokens) and reads the
/// special tokens from tokenizer_config.json.
#[test]
fn tokenizer_matches_transformers() {
    let dir = cpl_integration_tests::fixture_dir("tokenizer");
    let sample: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sample.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        sample[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    use models::tokenizer::SpecialTokens;
    let tok = models::tokenizer::Tokenizer::from_files(
        &dir.join("tokenizer.json"),
        Some(&dir.join("tokenizer_config.json")),
    )
    .unwrap();
    let text = sample["text"].as_str().unwrap();
    assert_eq!(tok.encode(text, SpecialTokens::Drop).unwrap(), ids("ids"));
    assert_eq!(
        tok.encode(text, SpecialTokens::Keep).unwrap(),
        ids("ids_with_special")
    );
    assert_eq!(tok.bos_token_id, Some(1));
    assert_eq!(tok.eos_token_id, Some(2));
    assert_eq!(tok.vocab_size(), 256);
    assert_eq!(tok.decode(&ids("ids"), SpecialTokens::Drop).unwrap(), text);
}
