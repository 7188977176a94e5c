//! LoRA and DPO against PyTorch + PEFT + TRL (`tests/fixtures/finetune`, made by
//! `scripts/make_finetune_fixtures.py` on the `gqa` fixture).
//!
//! - a PEFT adapter loads and gives PEFT's logits (1e-5 relative to the largest logit), the base
//!   model's logits with the adapters switched off, PEFT's loss (1e-5) and PEFT's gradient of
//!   every `lora_A` / `lora_B` (1e-4 relative per tensor: the fixture's own f32 error against
//!   float64 is up to 2.3e-6, README "Precision"); only adapters are trainable;
//! - fresh adapters (`B = 0`) leave the base model's logits unchanged;
//! - `peft::merge` equals PEFT's `merge_and_unload` weights, and the merged model gives the
//!   adapter's logits;
//! - DPO log-probabilities, losses, rewards (1e-5) and gradients (1e-4) equal TRL's sigmoid loss;
//! - an adapter saved by the trainer is a PEFT adapter directory that loads back to the same
//!   tensors (that PEFT itself loads it is checked by `scripts/check_peft_adapter.py`, see the
//!   fixture README).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::comm::LocalWorld;
use candle_parallel::nn::{
    Adapters, Batch, CrossEntropyOptions, LoraConfig, LoraTargets, ParamMode, Shard, TensorSource,
};
use cpl_integration_tests::{fixture_files, rel_err, Layout};
use models::llama;
use train::finetune::{DpoConfig, DpoTrainer, Reference, SftDataset};

fn constant_lr(lr: f64) -> candle_parallel::optim::LrSchedule {
    candle_parallel::optim::LrSchedule {
        peak_lr: lr,
        min_lr: lr,
        warmup_steps: 0,
        total_steps: 1,
        decay: candle_parallel::optim::Decay::Constant,
    }
}

fn fixture(rel: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/finetune")
        .join(rel)
}

fn load_ref(rel: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(rel), &Device::Cpu).unwrap()
}

fn rows_u32(t: &Tensor) -> Vec<Vec<u32>> {
    t.to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as u32).collect())
        .collect()
}

fn rows_i64(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap()
}

fn fixture_adapters() -> Arc<Adapters> {
    let a = models::peft::load(&fixture("lora/adapter")).unwrap();
    Adapters::new(a.lora, Some(a.source)).unwrap()
}

/// Runs `f` on one rank with the `gqa` model carrying `adapters`.
fn on_one_rank<T: Send>(
    adapters: Option<Arc<Adapters>>,
    f: impl Fn(&llama::Llama, &candle_parallel::nn::ParallelCtx, &candle_parallel::nn::ParamList) -> T
        + Sync,
) -> T {
    let files = fixture_files("gqa");
    LocalWorld::run(1, |world| -> Result<T, String> {
        let (_, ctx) = Layout::single().context(world)?;
        let m = llama::load_adapted(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            adapters.clone(),
        )
        .map_err(|e| e.to_string())?;
        Ok(f(&m.model, &ctx, &m.params))
    })
    .unwrap()
    .remove(0)
}

fn assert_rel(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    let e = rel_err(
        &got.to_dtype(DType::F32).unwrap(),
        &want.to_dtype(DType::F32).unwrap(),
    );
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

#[test]
fn peft_adapter_gives_peft_logits_loss_and_gradients() {
    let r = load_ref("lora/reference.safetensors");
    let ids = rows_u32(&r["input_ids"]);
    let labels = rows_i64(&r["labels"]);
    let adapters = fixture_adapters();
    on_one_rank(Some(adapters.clone()), |model, ctx, params| {
        let mask = candle_parallel::attention::AttnMask::Causal;
        let (batch, lab) = Batch::from_tokens(ctx, &ids, &labels, mask).unwrap();
        let logits = model.logits(&batch).unwrap();
        assert_rel(&logits, &r["logits"], 1e-5, "adapter logits");
        adapters.set_enabled(false);
        let base = model.logits(&batch).unwrap();
        adapters.set_enabled(true);
        assert_rel(&base, &r["base_logits"], 1e-5, "logits with adapters off");
        let (sum, count) = model
            .loss_sum(&batch, &lab, &CrossEntropyOptions::default())
            .unwrap();
        let loss = (sum / count as f64).unwrap();
        assert_rel(&loss.reshape(1).unwrap(), &r["loss"], 1e-5, "loss");
        let grads = model.backward(&loss).unwrap();
        let all = params.sorted();
        let trainable: Vec<_> = all.iter().filter(|p| p.var.is_some()).collect();
        assert_eq!(trainable.len(), 28, "trainable parameters");
        for p in &all {
            let lora = p.name.contains(".lora_");
            assert_eq!(
                p.var.is_some(),
                lora,
                "{}: trainable only if an adapter",
                p.name
            );
            if let Some(v) = &p.var {
                let g = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{} received no gradient", p.name));
                assert_rel(
                    g,
                    &r[&format!("grad.{}", p.name)],
                    1e-4,
                    &format!("gradient of {}", p.name),
                );
            }
        }
    });
}

#[test]
fn fresh_adapters_start_at_the_base_model() {
    let r = load_ref("lora/reference.safetensors");
    let ids = rows_u32(&r["input_ids"]);
    let cfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: LoraTargets::parse("q_proj,v_proj,down_proj").unwrap(),
        use_rslora: false,
        seed: 1,
        target_parameters: Vec::new(),
        alpha_pattern: Default::default(),
        rank_pattern: Default::default(),
    };
    let adapters = Adapters::new(cfg, None).unwrap();
    on_one_rank(Some(adapters), |model, ctx, params| {
        let (batch, _) =
            Batch::from_sequences(ctx, &ids, candle_parallel::attention::AttnMask::Causal).unwrap();
        let logits = model.logits(&batch).unwrap();
        let e = rel_err(&logits, &r["base_logits"]);
        assert!(e <= 1e-5, "fresh adapters change the logits: {e:.3e}");
        let names: Vec<String> = params
            .sorted()
            .into_iter()
            .filter(|p| p.var.is_some())
            .map(|p| p.name)
            .collect();
        // 2 layers x 3 targeted layers x (A, B); A non-zero, B zero.
        assert_eq!(names.len(), 12, "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.contains("q_proj") || n.contains("v_proj") || n.contains("down_proj")));
        for p in params.sorted().iter().filter(|p| p.var.is_some()) {
            let m = testkit::max_abs(&p.tensor);
            if p.name.ends_with("lora_B.weight") {
                assert_eq!(m, 0.0, "{}", p.name);
            } else {
                assert!(m > 0.0, "{}", p.name);
            }
        }
    });
}

#[test]
fn merge_equals_peft_merge_and_gives_the_adapter_logits() {
    let r = load_ref("lora/reference.safetensors");
    let out = std::env::temp_dir().join(format!("cpl-merge-{}", std::process::id()));
    let adapter = models::peft::load(&fixture("lora/adapter")).unwrap();
    let merged = models::peft::merge(&fixture_files("gqa"), &adapter, &out).unwrap();
    assert_eq!(merged.len(), 14);
    let files = models::hub::from_dir("merged", &out).unwrap();
    let reader = models::checkpoint::CheckpointReader::open(&files.weights).unwrap();
    for name in &merged {
        let got = TensorSource::read(&reader, name, Shard::replicated(), &Device::Cpu).unwrap();
        assert_rel(&got, &r[&format!("merged.{name}")], 1e-6, name);
    }
    let ids = rows_u32(&r["input_ids"]);
    LocalWorld::run(1, |world| -> Result<(), String> {
        let (_, ctx) = Layout::single().context(world)?;
        let m = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Frozen)
            .map_err(|e| e.to_string())?;
        let (batch, _) =
            Batch::from_sequences(&ctx, &ids, candle_parallel::attention::AttnMask::Causal)
                .unwrap();
        assert_rel(
            &m.model.logits(&batch).unwrap(),
            &r["logits"],
            1e-5,
            "merged model logits",
        );
        Ok(())
    })
    .unwrap();
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn bad_adapters_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("cpl-bad-adapter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let msg = |d: &std::path::Path| match models::peft::load(d) {
        Ok(_) => panic!("{} loaded", d.display()),
        Err(e) => e.to_string(),
    };
    let m = msg(&dir);
    assert!(m.contains("adapter_config.json"), "{m}");
    let cfg = std::fs::read_to_string(fixture("lora/adapter/adapter_config.json")).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        cfg.replace("\"LORA\"", "\"IA3\""),
    )
    .unwrap();
    let m = msg(&dir);
    assert!(
        m.contains("IA3") && m.contains("adapter_config.json"),
        "{m}"
    );
    std::fs::write(dir.join("adapter_config.json"), &cfg).unwrap();
    let m = msg(&dir);
    assert!(m.contains("adapter_model.safetensors"), "{m}");
    // An adapter whose shapes do not fit the model.
    std::fs::copy(
        fixture("lora/adapter/adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        cfg.replace("\"r\": 4", "\"r\": 8"),
    )
    .unwrap();
    let a = models::peft::load(&dir).unwrap();
    let adapters = Adapters::new(a.lora, Some(a.source)).unwrap();
    let files = fixture_files("gqa");
    let err = LocalWorld::run(1, |world| -> Result<(), String> {
        let (_, ctx) = Layout::single().context(world)?;
        llama::load_adapted(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            Some(adapters.clone()),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    })
    .unwrap_err();
    let err = err.to_string();
    assert!(err.contains("lora_A") && err.contains("expects"), "{err}");
    // PEFT options that would change the result and cannot be honoured are refused, not
    // ignored (alpha_pattern is honoured for target parameters only).
    let patterned = cfg.replace(
        "\"alpha_pattern\": {}",
        "\"alpha_pattern\": {\"q_proj\": 4}",
    );
    assert_ne!(
        patterned, cfg,
        "the fixture config has an empty alpha_pattern"
    );
    std::fs::write(dir.join("adapter_config.json"), patterned).unwrap();
    let m = msg(&dir);
    assert!(m.contains("alpha_pattern"), "{m}");
    // An adapter tensor for a layer this model does not adapt (PEFT can adapt lm_head).
    std::fs::write(dir.join("adapter_config.json"), &cfg).unwrap();
    let mut tensors = load_ref("lora/adapter/adapter_model.safetensors");
    tensors.insert(
        "base_model.model.lm_head.lora_A.weight".into(),
        Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors")).unwrap();
    let a = models::peft::load(&dir).unwrap();
    let adapters = Adapters::new(a.lora, Some(a.source)).unwrap();
    let err = LocalWorld::run(1, |world| -> Result<(), String> {
        let (_, ctx) = Layout::single().context(world)?;
        llama::load_adapted(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            Some(adapters.clone()),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("lm_head.lora_A.weight") && err.contains("adapt no layer"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dpo_equals_trl() {
    let r = load_ref("dpo/reference.safetensors");
    let beta = r["beta"].to_vec1::<f32>().unwrap()[0] as f64;
    let to_examples = |ids: &str, labels: &str| -> Vec<train::finetune::Example> {
        rows_u32(&r[ids])
            .into_iter()
            .zip(rows_i64(&r[labels]))
            .map(|(ids, labels)| {
                // trained[i] = label[i-1] is scored.
                let trained = (0..ids.len())
                    .map(|i| i > 0 && labels[i - 1] != -100)
                    .collect();
                train::finetune::Example { ids, trained }
            })
            .collect()
    };
    let chosen = to_examples("chosen_ids", "chosen_labels");
    let rejected = to_examples("rejected_ids", "rejected_labels");
    for (ex, labels) in chosen.iter().zip(rows_i64(&r["chosen_labels"])) {
        assert_eq!(ex.labels(), labels, "labels rebuilt from the trained flags");
    }
    let pairs: Vec<_> = chosen.into_iter().zip(rejected).collect();
    let opts = train::finetune::SftOptions {
        seq_len: 12,
        packing: false,
        overlong: train::finetune::Overlong::Drop,
        pad_id: 0,
    };
    let (data, stats) = train::finetune::PairDataset::new(&pairs, &opts, 256).unwrap();
    assert_eq!((stats.windows, stats.dropped), (3, 0));
    let adapters = fixture_adapters();
    let files = fixture_files("gqa");
    LocalWorld::run(1, |world| -> Result<(), String> {
        let (mesh, ctx) = Layout::single().context(world)?;
        let m = llama::load_adapted(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            Some(adapters.clone()),
        )
        .map_err(|e| e.to_string())?;
        let cfg = train::trainer::TrainConfig {
            seq_len: 12,
            steps: 1,
            batch: 3,
            grad_accum: 1,
            doc_mask: false,
            seed: 0,
            shuffle: false,
            adamw: Default::default(),
            schedule: constant_lr(1e-3),
            max_grad_norm: None,
            loss_chunk_tokens: 1024,
            memory: Default::default(),
            pipeline: None,
            seq_len_schedule: None,
        };
        let t = train::trainer::Trainer::new(
            Box::new(m.model) as Box<dyn models::CausalLm>,
            &mesh,
            &ctx,
            cfg,
        )
        .map_err(|e| e.to_string())?;
        let d = DpoTrainer::new(
            t,
            Reference::BaseOfAdapters(adapters.clone()),
            DpoConfig { beta },
        )
        .map_err(|e| e.to_string())?;
        let terms = d.terms(&data, &[0, 1, 2]).map_err(|e| e.to_string())?;
        let v = |xs: &[f64]| Tensor::new(xs, &Device::Cpu).unwrap();
        let cat = |a: &str, b: &str| Tensor::cat(&[&r[a], &r[b]], 0).unwrap();
        assert_rel(
            &v(&terms.policy_logps),
            &cat("policy_chosen_logps", "policy_rejected_logps"),
            1e-5,
            "policy log-probs",
        );
        assert_rel(
            &v(&terms.reference_logps),
            &cat("reference_chosen_logps", "reference_rejected_logps"),
            1e-5,
            "reference log-probs",
        );
        assert_rel(&v(&terms.losses), &r["losses"], 1e-5, "losses");
        assert_rel(
            &v(&terms.chosen_rewards),
            &r["chosen_rewards"],
            1e-5,
            "chosen rewards",
        );
        assert_rel(
            &v(&terms.rejected_rewards),
            &r["rejected_rewards"],
            1e-5,
            "rejected rewards",
        );
        let (sum, grads) = d
            .trainer
            .backward_collect(&terms.loss_sum, 3)
            .map_err(|e| e.to_string())?;
        testkit::assert_close_scalar(
            sum / 3.0,
            r["loss"].to_vec1::<f32>().unwrap()[0] as f64,
            1e-5,
            "loss",
        );
        assert_eq!(grads.len(), 28);
        for (name, g) in &grads {
            assert_rel(
                g,
                &r[&format!("grad.{name}")],
                1e-4,
                &format!("DPO gradient of {name}"),
            );
        }
        Ok(())
    })
    .unwrap();
}

/// The trainer's checkpoint of a LoRA run is a PEFT adapter: `adapter_model.safetensors` with
/// PEFT's key names, which loads back to the trained values.
#[test]
fn saved_adapter_loads_back() {
    // Kept for `scripts/check_peft_adapter.py` (PEFT loads the adapter and must give `ours`'s
    // logits): see the fixture README.
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tmp/lora-saved");
    let _ = std::fs::remove_dir_all(&out);
    let r = load_ref("lora/reference.safetensors");
    let ids = rows_u32(&r["input_ids"]);
    let adapters = fixture_adapters();
    let files = fixture_files("gqa");
    let examples: Vec<train::finetune::Example> = testkit::random_docs(9, 6, 6..14, 256)
        .into_iter()
        .map(|ids| train::finetune::Example {
            trained: ids.iter().map(|_| true).collect(),
            ids,
        })
        .collect();
    let opts = train::finetune::SftOptions {
        seq_len: 16,
        packing: true,
        overlong: train::finetune::Overlong::Truncate,
        pad_id: 0,
    };
    let (data, _) = SftDataset::new(&examples, &opts, 256).unwrap();
    let trained = LocalWorld::run(2, |world| -> Result<HashMap<String, Tensor>, String> {
        let layout = Layout::new("tp2", 2, 1, 1, candle_parallel::attention::Strategy::Ring);
        let (mesh, ctx) = layout.context(world.clone())?;
        let m = llama::load_adapted(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            Some(Adapters::new(adapters.cfg.clone(), adapters.source().cloned()).unwrap()),
        )
        .map_err(|e| e.to_string())?;
        let cfg = train::trainer::TrainConfig {
            seq_len: 16,
            steps: 1,
            batch: 1,
            grad_accum: 1,
            doc_mask: true,
            seed: 0,
            shuffle: false,
            adamw: Default::default(),
            schedule: constant_lr(1e-2),
            max_grad_norm: None,
            loss_chunk_tokens: 1024,
            memory: Default::default(),
            pipeline: None,
            seq_len_schedule: None,
        };
        let mut t =
            train::trainer::Trainer::new(m.model, &mesh, &ctx, cfg).map_err(|e| e.to_string())?;
        t.step(&data).map_err(|e| e.to_string())?;
        let cfg_json = models::peft::AdapterConfig::from_lora(&adapters.cfg, "gqa")
            .to_json()
            .map_err(|e| e.to_string())?;
        train::checkpoint::save(
            &t,
            &out,
            &world,
            &[("adapter_config.json".into(), cfg_json)],
            &Default::default(),
            1,
        )
        .map_err(|e| e.to_string())?;
        let (batch, _) =
            Batch::from_sequences(&ctx, &ids, candle_parallel::attention::AttnMask::Causal)
                .unwrap();
        let logits = t.model.logits(&batch).map_err(|e| e.to_string())?;
        if world.rank() == 0 {
            let ours = HashMap::from([
                ("input_ids".to_string(), r["input_ids"].clone()),
                ("logits".to_string(), logits),
            ]);
            candle_core::safetensors::save(&ours, out.join("ours.safetensors"))
                .map_err(|e| e.to_string())?;
        }
        cpl_integration_tests::whole_weights(&t, &mesh)
    })
    .unwrap()
    .remove(0);
    let dir = out.join("step-1");
    let back = models::peft::load(&dir).unwrap();
    assert_eq!(back.source.names().len(), 28);
    for (name, w) in &trained {
        let got = back
            .source
            .read(name, Shard::replicated(), &Device::Cpu)
            .unwrap();
        assert_eq!(rel_err(&got, w), 0.0, "{name}");
    }
    let fresh = models::peft::load(&fixture("lora/adapter")).unwrap();
    let before = fresh
        .source
        .read(
            "model.layers.0.self_attn.q_proj.lora_B.weight",
            Shard::replicated(),
            &Device::Cpu,
        )
        .unwrap();
    assert!(
        rel_err(
            &trained["model.layers.0.self_attn.q_proj.lora_B.weight"],
            &before
        ) > 1e-4,
        "the step changed nothing"
    );
}
