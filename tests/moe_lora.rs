//! LoRA on a mixture of experts' router and experts, in PEFT's format under transformers 5
//! (`tests/fixtures/moe_lora`, made by `scripts/make_moe_lora_fixtures.py`: PEFT 0.21.2's
//! `all-linear` on the tiny Qwen3-MoE and Mixtral of `tests/fixtures/moe`, and on Qwen2-MoE,
//! which PEFT does not convert, `all-linear` (attention, shared expert and its gate, the dense
//! layer's MLP) with the experts named in `target_parameters`; every factor random).
//!
//! - PEFT's adapter loads, and the model gives PEFT's logits and loss (transformers' training
//!   loss with the balancing loss) within 1e-5 relative and PEFT's gradient of every LoRA tensor
//!   (the experts' stacked `lora_A` / `lora_B`, the routers', the attention's) within 1e-5
//!   relative per tensor (PEFT's own float32 run is up to 2.5e-6 from the float64 reference,
//!   fixture README); on a 4-token input where most experts of a layer get no token, the
//!   gradients equal PEFT's too, every factor of an expert that received no token is exactly
//!   zero, and every factor of one that received a token the loss scores is non-zero (the last
//!   token reaches the loss only through the next layers' routers, and not at all from the last
//!   layer).
//! - tp2, tp2 with TP-sp, a zigzag ring of 4, USP 2x2 and ZeRO-3 with full checkpointing over
//!   tp2 x ring2: loss, logits and every adapter gradient equal one rank (1e-5).
//! - Expert parallelism through the trainer (3 AdamW steps): ep2 over dp2, ep2 over a zigzag
//!   ring of 2, tp2 x dp2 with ep2 (adapter factors replicated over tp), dp4 with ep2 and ZeRO-3:
//!   losses, gradient norms, the held-out loss and the final adapters equal one rank (1e-5), and
//!   the saved PEFT adapter too.
//! - Bad targets are errors naming what to change.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::Strategy;
use candle_parallel::nn::{Adapters, LoraConfig, LoraTargets, TensorSource};
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_same_registry_run, assert_same_step, rel_err, run_layout_lora, Layout, StepPlan,
};

const TOL: f64 = 1e-5;
const FAMILIES: [&str; 3] = ["qwen3_moe", "mixtral", "qwen2_moe"];
const EXPERTS: usize = 8;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn adapter_dir(family: &str) -> PathBuf {
    fixtures().join("moe_lora").join(family).join("adapter")
}

fn reference(family: &str) -> HashMap<String, Tensor> {
    let p = fixtures()
        .join("moe_lora")
        .join(family)
        .join("reference.safetensors");
    candle_core::safetensors::load(&p, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
}

/// PEFT's adapter of `family`'s fixture, read through `models::peft`.
fn peft_adapters(family: &str) -> Arc<Adapters> {
    let a = models::peft::load(&adapter_dir(family)).unwrap_or_else(|e| panic!("{e}"));
    Adapters::new(a.lora, Some(a.source as Arc<dyn TensorSource>)).unwrap()
}

/// A fixture directory for `run_layout_lora`: the base MoE checkpoint of `family` with the
/// LoRA reference's inputs (`short`: the 4-token input), as `reference.safetensors`.
fn fixture_copy(family: &str, short: bool) -> String {
    let base = fixtures().join("moe").join(family);
    let dir = std::env::temp_dir().join(format!(
        "cpl-moe-lora-{}-{family}-{short}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(base.join(f), dir.join(f)).unwrap();
    }
    let r = reference(family);
    let prefix = if short { "short." } else { "" };
    let keep: HashMap<String, Tensor> = r
        .iter()
        .filter_map(|(k, v)| {
            let k = k.strip_prefix(prefix)?;
            (!k.starts_with("short.")).then(|| (k.to_string(), v.clone()))
        })
        .collect();
    let mut keep = keep;
    if short {
        // No logits are stored for the short input: run_layout_lora does not read them.
        keep.insert(
            "logits".into(),
            Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&keep, dir.join("reference.safetensors")).unwrap();
    dir.display().to_string()
}

fn lora_keys(r: &HashMap<String, Tensor>, prefix: &str) -> Vec<String> {
    let mut k: Vec<String> = r
        .keys()
        .filter_map(|k| k.strip_prefix(prefix).map(String::from))
        .filter(|k| !k.starts_with("short."))
        .collect();
    k.sort();
    k
}

#[test]
fn peft_adapter_on_the_experts_gives_peft_logits_loss_and_gradients() {
    for family in FAMILIES {
        let r = reference(family);
        let dir = fixture_copy(family, false);
        let got = run_layout_lora(
            &dir,
            &Layout::single(),
            StepPlan::default(),
            Some(peft_adapters(family)),
        );
        let e = rel_err(&got.logits, &r["logits"]);
        assert!(e <= TOL, "{family}: logits rel err {e:e}");
        let loss = r["loss"].to_scalar::<f32>().unwrap() as f64;
        testkit::assert_close_scalar(got.loss as f64, loss, TOL, &format!("{family}: loss"));
        let mut ours: Vec<String> = got.grads.keys().cloned().collect();
        ours.sort();
        assert_eq!(ours, lora_keys(&r, "grad."), "{family}: adapter tensors");
        assert!(ours
            .iter()
            .any(|k| k.ends_with("mlp.experts.base_layer.lora_B.weight")));
        for k in &ours {
            let e = rel_err(&got.grads[k], &r[&format!("grad.{k}")]);
            assert!(e <= TOL, "{family}: gradient of {k}: rel err {e:e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Expert `e`'s block of a stacked PEFT factor: rows `e·R..` of `A` `(R·E, in)`, columns
/// `e, e+E, ..` of `B` `(out, R·E)`.
fn expert_block(name: &str, t: &Tensor, e: usize) -> Tensor {
    if name.ends_with("lora_A.weight") {
        let r = t.dim(0).unwrap() / EXPERTS;
        t.narrow(0, e * r, r).unwrap()
    } else {
        let (out, re) = t.dims2().unwrap();
        t.reshape((out, re / EXPERTS, EXPERTS))
            .unwrap()
            .narrow(2, e, 1)
            .unwrap()
    }
}

#[test]
fn experts_without_tokens_get_exact_zero_gradients() {
    for family in FAMILIES {
        let r = reference(family);
        let counts = r["short.tokens_per_expert"].to_vec2::<i64>().unwrap();
        let scored = r["short.scored_tokens_per_expert"]
            .to_vec2::<i64>()
            .unwrap();
        let dir = fixture_copy(family, true);
        let got = run_layout_lora(
            &dir,
            &Layout::single(),
            StepPlan::default(),
            Some(peft_adapters(family)),
        );
        let loss = r["short.loss"].to_scalar::<f32>().unwrap() as f64;
        testkit::assert_close_scalar(got.loss as f64, loss, TOL, &format!("{family}: loss"));
        let (mut empty, mut busy) = (0, 0);
        let layer_of = |k: &str| -> usize {
            k.strip_prefix("model.layers.")
                .and_then(|s| s.split('.').next())
                .and_then(|s| s.parse().ok())
                .unwrap()
        };
        // The counts have a row per sparse layer (Qwen2-MoE's layer 1 is dense).
        let mut sparse: Vec<usize> = lora_keys(&r, "short.grad.")
            .iter()
            .filter(|k| k.contains(".mlp.experts."))
            .map(|k| layer_of(k))
            .collect();
        sparse.sort_unstable();
        sparse.dedup();
        assert_eq!(
            sparse.len(),
            counts.len(),
            "{family}: sparse layers {sparse:?}"
        );
        for k in lora_keys(&r, "short.grad.") {
            let g = &got.grads[&k];
            let e = rel_err(g, &r[&format!("short.grad.{k}")]);
            assert!(e <= TOL, "{family}: gradient of {k}: rel err {e:e}");
            if !k.contains(".mlp.experts.") {
                continue;
            }
            let row = sparse.iter().position(|&l| l == layer_of(&k)).unwrap();
            for (x, &n) in counts[row].iter().enumerate() {
                let m = testkit::max_abs(&expert_block(&k, g, x));
                if n == 0 {
                    assert_eq!(m, 0.0, "{family}: {k}: expert {x} received no token");
                    empty += 1;
                } else if scored[row][x] > 0 {
                    assert!(m > 0.0, "{family}: {k}: expert {x} received {n} slots");
                    busy += 1;
                }
            }
        }
        assert!(empty > 0 && busy > 0, "{family}: {empty} / {busy}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn lora_on_the_experts_under_every_layout_matches_one_rank() {
    let zero3_full = StepPlan {
        checkpointing: Checkpointing::Full,
        zero3: true,
        dtype: None,
    };
    for family in FAMILIES {
        let dir = fixture_copy(family, false);
        let run = |layout: &Layout, plan| {
            run_layout_lora(&dir, layout, plan, Some(peft_adapters(family)))
        };
        let want = run(&Layout::single(), StepPlan::default());
        for (layout, plan) in [
            (
                Layout::new("tp2", 2, 1, 1, Strategy::Ring),
                StepPlan::default(),
            ),
            (
                Layout::new("tp2 TP-sp", 2, 1, 1, Strategy::Ring).with_tp_sp(),
                StepPlan::default(),
            ),
            (
                Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring),
                StepPlan::default(),
            ),
            (
                Layout::new("usp 2x2", 1, 2, 2, Strategy::Usp),
                StepPlan::default(),
            ),
            (
                Layout::new("zero3 + full tp2 x ring2", 2, 1, 2, Strategy::Ring),
                zero3_full,
            ),
        ] {
            let got = run(&layout, plan);
            assert_same_step(&format!("{family} / {}", layout.name), &got, &want, TOL);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn config(steps: u64, grad_accum: usize) -> train::trainer::TrainConfig {
    cpl_integration_tests::small_train_config(steps, Default::default(), grad_accum, 5)
}

fn saved_adapter(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let p = dir.join("adapter_model.safetensors");
    let t = candle_core::safetensors::load(&p, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let mut v: Vec<(String, Vec<f32>)> = t
        .into_iter()
        .map(|(k, x)| (k, x.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn lora_on_the_experts_trains_under_expert_parallelism_like_one_rank() {
    use candle_parallel::optim::ZeroStage;
    let data = cpl_integration_tests::synthetic_windows(16, 41, 13);
    let root = std::env::temp_dir().join(format!("cpl-moe-lora-ep-{}", std::process::id()));
    for family in FAMILIES {
        let files = cpl_integration_tests::fixture_files(&format!("moe/{family}"));
        let adapter = models::peft::load(&adapter_dir(family)).unwrap();
        let lora = models::peft::for_transformers5(&adapter.lora, family).unwrap();
        let source = Some(adapter.source.clone() as Arc<dyn TensorSource>);
        let run = |layout: &Layout, cfg: &train::trainer::TrainConfig| {
            let out = root.join(format!("{family}-{}-{}", layout.name, layout.ep));
            let run = cpl_integration_tests::drive_through_registry(
                &files,
                layout,
                cfg,
                &data,
                Some((&lora, source.clone())),
                &out,
            );
            (run, saved_adapter(&out.join("step-3")))
        };
        let (want, want_saved) = run(&Layout::single(), &config(3, 4));
        assert!(want_saved
            .iter()
            .any(|(k, _)| k.ends_with("mlp.experts.base_layer.lora_A.weight")));
        let mut zero3 = config(3, 1);
        zero3.memory.zero = ZeroStage::Parameters;
        zero3.memory.checkpointing = Checkpointing::Selective;
        for (layout, cfg) in [
            (Layout::single().with_dp(2).with_ep(2), config(3, 2)),
            (
                Layout::new("zigzag ring2", 1, 1, 2, Strategy::Ring).with_ep(2),
                config(3, 4),
            ),
            (
                Layout::new("tp2", 2, 1, 1, Strategy::Ring)
                    .with_dp(2)
                    .with_ep(2),
                config(3, 2),
            ),
            (Layout::single().with_dp(4).with_ep(2), zero3.clone()),
        ] {
            let case = format!("{family} / {} ep{}", layout.name, layout.ep);
            let (got, saved) = run(&layout, &cfg);
            assert_same_registry_run(&case, &got, &want, TOL);
            cpl_integration_tests::assert_same_saved(&case, &saved, &want_saved, TOL);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

fn lora(targets: &str) -> LoraConfig {
    LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: LoraTargets::parse(targets).unwrap(),
        use_rslora: false,
        seed: 3,
        target_parameters: Vec::new(),
        rank_pattern: Default::default(),
        alpha_pattern: Default::default(),
    }
}

/// PEFT 0.21's conversion under transformers 5: `all-linear` and the experts' module names
/// become target parameters (gate and up fused, twice the rank and alpha); Qwen2-MoE is not
/// converted; gate without up is an error naming both.
#[test]
fn targets_convert_as_peft_does() {
    let all = models::peft::for_transformers5(&lora("all-linear"), "qwen3_moe").unwrap();
    assert_eq!(
        all.targets,
        LoraTargets::parse("k_proj,o_proj,q_proj,v_proj").unwrap()
    );
    assert_eq!(
        all.target_parameters,
        ["down_proj", "gate.weight", "gate_up_proj"]
    );
    let key = ".*\\.gate_up_proj".to_string();
    assert_eq!(all.rank_pattern.get(&key), Some(&4));
    assert_eq!(all.alpha_pattern.get(&key), Some(&8.0));
    let mixtral = models::peft::for_transformers5(&lora("q_proj,w1,w3"), "mixtral").unwrap();
    assert_eq!(mixtral.target_parameters, ["gate_up_proj"]);
    assert_eq!(mixtral.targets, LoraTargets::parse("q_proj").unwrap());
    let again = models::peft::for_transformers5(&all, "qwen3_moe").unwrap();
    assert_eq!(again, all, "converting twice changes nothing");
    let qwen2 = models::peft::for_transformers5(&lora("all-linear"), "qwen2_moe").unwrap();
    assert_eq!(qwen2, lora("all-linear"));
    let e = models::peft::for_transformers5(&lora("gate_proj,down_proj"), "qwen3_moe")
        .unwrap_err()
        .to_string();
    assert!(e.contains("gate_proj") && e.contains("up_proj"), "{e}");
    // The written adapter_config.json says what PEFT's does.
    let cfg = models::peft::AdapterConfig::from_lora(&all, "base");
    let json: serde_json::Value = serde_json::from_slice(&cfg.to_json().unwrap()).unwrap();
    assert_eq!(json["target_parameters"][2], "gate_up_proj");
    assert_eq!(json["rank_pattern"][&key], 4);
    let back = cfg.to_lora(Path::new("adapter_config.json"), 3).unwrap();
    assert_eq!(back, all);
}
