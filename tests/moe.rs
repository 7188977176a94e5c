//! Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers and under
//! every layout that composes with them today.
//!
//! - Each fixture of `scripts/make_moe_fixtures.py` on one rank: logits, the training loss (LM
//!   loss plus 0.3 times the router's load-balancing loss) and every parameter's gradient
//!   (routers, experts, shared expert) equal transformers' float64 reference within 1e-5
//!   relative (transformers' own float32 run is 0.5e-6 to 2.4e-6 from it; without the balancing
//!   loss the routers' gradients would differ by 65-89%, see the fixtures' README).
//! - Each family under tp2, tp2 with TP-sp, zigzag ring4, USP 2x2, tp2 x ring2 and ZeRO-3 with
//!   selective and full checkpointing: loss, logits and every parameter's whole gradient equal
//!   one rank (1e-5 relative). The balancing loss's statistics are summed over the ranks that
//!   hold the micro-batch's tokens; its gradient reaches recomputed routers. With 16 tokens per
//!   rank under ring4, some experts receive no token on some ranks (exact zero gradients there).
//! - Bad configs and unsupported combinations are errors naming the field or flag.

use candle_parallel::attention::Strategy;
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_loss_and_gradients, assert_same_registry_run, assert_same_step, check_kv_cache,
    check_reference, check_saved_under_tp2_reloads, fixture_files, reference, run_layout,
    run_layout_padded, run_layout_with, train_through_registry, Layout, StepPlan,
};

use models::decoder::DecoderConfig;
use train::data::PackedDataset;

const TOL: f64 = 1e-5;
const FAMILIES: [&str; 3] = ["moe/mixtral", "moe/qwen2_moe", "moe/qwen3_moe"];

#[test]
fn mixtral_matches_transformers() {
    check_reference("moe/mixtral");
}

#[test]
fn qwen2_moe_with_shared_expert_and_dense_layer_matches_transformers() {
    check_reference("moe/qwen2_moe");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_reference("moe/qwen3_moe");
}

#[test]
fn every_moe_fixture_is_detected_as_its_family() {
    for (name, family) in [
        ("moe/mixtral", "mixtral"),
        ("moe/qwen2_moe", "qwen2_moe"),
        ("moe/qwen3_moe", "qwen3_moe"),
    ] {
        let f = models::family::detect(&fixture_files(name).config).unwrap();
        assert_eq!(f.name, family, "{name}");
        let d = (f.describe)(&fixture_files(name).config).unwrap();
        assert!(d.summary.contains("8 experts"), "{name}: {}", d.summary);
        // FLOPs count the active parameters: 2 of 8 experts.
        assert!(d.matmul_params < d.params, "{name}: {d:?}");
        // The planner's shape counts the checkpoint's parameters (Qwen2-MoE: a dense layer, a
        // shared expert and its gate), less what the cost model leaves out: Qwen2's q/k/v
        // biases (3 layers x (32 + 16 + 16)) and Qwen3's q/k norms (2 layers x 2 x 16).
        let shape = d.planner_shape.expect("the planner plans MoE models");
        let left_out = match family {
            "qwen2_moe" => 3 * 64,
            "qwen3_moe" => 2 * 32,
            _ => 0,
        };
        assert_eq!(shape.params() + left_out, d.params, "{name}: {shape:?}");
        assert_eq!(
            shape.moe.map(|m| (m.experts, m.top_k)),
            Some((8, 2)),
            "{name}"
        );
    }
}

fn layouts() -> Vec<(Layout, StepPlan)> {
    let plain = StepPlan::default();
    let zero3 = |checkpointing| StepPlan {
        checkpointing,
        zero3: true,
        dtype: None,
    };
    vec![
        (Layout::new("tp2", 2, 1, 1, Strategy::Ring), plain),
        (
            Layout::new("tp2 TP-sp", 2, 1, 1, Strategy::Ring).with_tp_sp(),
            plain,
        ),
        (Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring), plain),
        (Layout::new("usp 2x2", 1, 2, 2, Strategy::Usp), plain),
        (
            Layout::new("tp2 TP-sp x ring2", 2, 1, 2, Strategy::Ring).with_tp_sp(),
            plain,
        ),
        (
            Layout::new("zero3 + selective zigzag ring4", 1, 1, 4, Strategy::Ring),
            zero3(Checkpointing::Selective),
        ),
        (
            Layout::new("zero3 + full tp2 x ring2", 2, 1, 2, Strategy::Ring),
            zero3(Checkpointing::Full),
        ),
    ]
}

#[test]
fn every_moe_family_under_every_layout_matches_one_rank() {
    for name in FAMILIES {
        let want = run_layout(name, &Layout::single());
        for (layout, plan) in layouts() {
            let got = run_layout_with(name, &layout, plan);
            assert_same_step(&format!("{name} / {}", layout.name), &got, &want, TOL);
        }
    }
}

/// bf16 end to end for each mixture of experts: a tp2 x ring2 step follows the one-rank bf16
/// step ([`cpl_integration_tests::check_bf16_follows_one_rank`]: loss, logits, and every
/// gradient, the routers' and each expert's, finite, non-zero and no further from one bf16 rank
/// than that run is from f32). Expert parallelism in bf16: `bin/tests/train_cli.rs`.
#[test]
fn every_moe_family_in_bf16_follows_its_one_rank_run() {
    for name in FAMILIES {
        let layout = Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring);
        cpl_integration_tests::check_bf16_follows_one_rank(name, &layout);
    }
}

/// A right-padded batch (row 1's last 15 of 32 tokens, as TRL pads fine-tuning batches): the
/// padding is left out of the balancing loss as transformers leaves it out given an
/// `attention_mask`, so the training loss and every gradient equal transformers' (1e-5 relative;
/// counting the padding moves the balancing loss by 0.4-1.3%, see the fixtures' README), on one
/// rank and under layouts that cut the padding across ranks (the padding starts in ring4's
/// third and TP-sp's second shard) with recomputed routers.
#[test]
fn padding_is_left_out_of_the_balancing_loss_like_transformers() {
    for name in FAMILIES {
        let r = reference(name).padded.expect("a padded run in the fixture");
        let got = run_layout_padded(name, &Layout::single(), StepPlan::default());
        assert_loss_and_gradients(&format!("{name} padded"), &got, r.loss, &r.grads);
        for (layout, plan) in [&layouts()[1], &layouts()[2], &layouts()[6]] {
            let under = run_layout_padded(name, layout, *plan);
            assert_same_step(
                &format!("{name} / {} padded", layout.name),
                &under,
                &got,
                TOL,
            );
        }
    }
}

/// Generation with the KV cache: a prompt of 3 tokens, then one token at a time, each token's
/// logits equal transformers' (1e-5), on one rank and under tp2 (the router runs on one token).
#[test]
fn moe_kv_cache_follows_transformers() {
    for name in FAMILIES {
        check_kv_cache(name, 3, TOL);
    }
}

/// Saved under tp2, each family's checkpoint is the Hub's per-expert layout, bit for bit, and
/// reloads with the same logits.
#[test]
fn every_moe_family_saved_under_tp2_reloads_identically() {
    for name in FAMILIES {
        check_saved_under_tp2_reloads(name);
    }
}

fn config(steps: u64, grad_accum: usize) -> train::trainer::TrainConfig {
    cpl_integration_tests::small_train_config(steps, Default::default(), grad_accum, 5)
}

fn data() -> PackedDataset {
    cpl_integration_tests::synthetic_windows(16, 41, 13)
}

/// 3 AdamW steps through the registry and the trainer (4 micro-batches per step, each with its
/// own balancing loss weighted by its labelled tokens, as the LM loss is): tp2 x ring2, TP-sp
/// tp2 x ring2 with ZeRO-3 and full checkpointing, and dp2 with 2 micro-batches each (the same
/// micro-batches) equal one rank: losses, gradient norms, held-out loss, final weights (1e-5).
#[test]
fn every_moe_family_trains_like_one_rank() {
    let data = data();
    let zero3_full = candle_parallel::plan::MemoryPlan {
        zero: candle_parallel::optim::ZeroStage::Parameters,
        checkpointing: Checkpointing::Full,
        ..Default::default()
    };
    for name in FAMILIES {
        let files = fixture_files(name);
        let want = train_through_registry(&files, &Layout::single(), &config(3, 4), &data);
        assert!(want.losses.iter().all(|l| l.is_finite()), "{name}");
        let mut sharded = config(3, 4);
        sharded.memory = zero3_full;
        for (layout, cfg) in [
            (
                Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring),
                config(3, 4),
            ),
            (
                Layout::new(
                    "TP-sp tp2 x ring2, ZeRO-3, full checkpointing",
                    2,
                    1,
                    2,
                    Strategy::Ring,
                )
                .with_tp_sp(),
                sharded,
            ),
            (Layout::single().with_dp(2), config(3, 2)),
        ] {
            let got = train_through_registry(&files, &layout, &cfg, &data);
            assert_same_registry_run(&format!("{name} / {}", layout.name), &got, &want, TOL);
        }
    }
}

/// Expert parallelism through the registry and the trainer, 3 AdamW steps with the balancing
/// loss (coefficient 0.3): ep2 over dp2, ep4 over dp4, ep2 over the two ranks of a zigzag ring,
/// ep4 over ulysses2 x dp2, ep2 with ZeRO-1, ep2 with ZeRO-2 and selective checkpointing, tp2 x
/// dp2 with ep2 (each expert also split over tp), dp4 with ep2 and ZeRO-3 (the experts sharded
/// over the 2 ranks holding them) with selective checkpointing, tp2 x ring2 with ep2, ZeRO-3 and
/// full checkpointing, TP-sp tp2 x ring2 with ep2, ZeRO-1 and full checkpointing, each
/// with the same micro-batches as one rank: losses, gradient norms, the held-out loss and final
/// weights equal one rank (1e-5); the checkpoint each saves (the experts gathered from their
/// owners) equals one rank's (1e-5). (`cpl train --ep` with held-out windows that the data ranks
/// share unevenly is `bin/tests/train_cli.rs`'s.)
#[test]
fn every_moe_family_trains_under_expert_parallelism_like_one_rank() {
    use candle_parallel::optim::ZeroStage;
    let data = data();
    let dir = std::env::temp_dir().join(format!("cpl-moe-ep-{}", std::process::id()));
    let with = |mut cfg: train::trainer::TrainConfig, zero, checkpointing| {
        cfg.memory.zero = zero;
        cfg.memory.checkpointing = checkpointing;
        cfg
    };
    let grouped = |mut cfg: train::trainer::TrainConfig, z| {
        cfg.memory.zero_group = Some(z);
        cfg
    };
    for name in FAMILIES {
        let files = fixture_files(name);
        let run = |layout: &Layout, cfg: &train::trainer::TrainConfig| {
            let out = dir.join(format!("{}-{}", name.replace('/', "-"), layout.name));
            let run = cpl_integration_tests::drive_through_registry(
                &files, layout, cfg, &data, None, &out,
            );
            let saved = models::hub::from_dir("saved", &out.join("step-3"))
                .unwrap_or_else(|e| panic!("{}: {e}", layout.name));
            (run, cpl_integration_tests::stored_tensors(&saved))
        };
        let (want, want_saved) = run(&Layout::single(), &config(3, 4));
        for (layout, cfg) in [
            (Layout::single().with_dp(2).with_ep(2), config(3, 2)),
            (Layout::single().with_dp(4).with_ep(4), config(3, 1)),
            (
                Layout::new("zigzag ring2", 1, 1, 2, Strategy::Ring).with_ep(2),
                config(3, 4),
            ),
            (
                Layout::new("ulysses2", 1, 2, 1, Strategy::Ulysses)
                    .with_dp(2)
                    .with_ep(4),
                config(3, 2),
            ),
            (
                Layout::single().with_dp(2).with_ep(2),
                with(
                    config(3, 2),
                    ZeroStage::OptimizerStates,
                    Checkpointing::None,
                ),
            ),
            (
                Layout::single().with_dp(2).with_ep(2),
                with(config(3, 2), ZeroStage::Gradients, Checkpointing::Selective),
            ),
            (
                Layout::new("tp2", 2, 1, 1, Strategy::Ring)
                    .with_dp(2)
                    .with_ep(2),
                config(3, 2),
            ),
            (
                Layout::single().with_dp(4).with_ep(2),
                with(
                    config(3, 1),
                    ZeroStage::Parameters,
                    Checkpointing::Selective,
                ),
            ),
            (
                Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring).with_ep(2),
                with(config(3, 4), ZeroStage::Parameters, Checkpointing::Full),
            ),
            // --zero-group: the experts sharded over the ranks of a sharding group that hold
            // them (none of the 2 when z = ep; 2 of 4 under ring2 x dp4 with z 4), replicated
            // over the other groups.
            (
                Layout::single().with_dp(4).with_ep(2),
                grouped(
                    with(config(3, 1), ZeroStage::Parameters, Checkpointing::None),
                    2,
                ),
            ),
            (
                Layout::single().with_dp(4).with_ep(4),
                grouped(
                    with(
                        config(3, 1),
                        ZeroStage::OptimizerStates,
                        Checkpointing::None,
                    ),
                    2,
                ),
            ),
            (
                Layout::new("zigzag ring2", 1, 1, 2, Strategy::Ring)
                    .with_dp(4)
                    .with_ep(2),
                grouped(
                    with(
                        config(3, 1),
                        ZeroStage::Parameters,
                        Checkpointing::Selective,
                    ),
                    4,
                ),
            ),
            (
                Layout::new("TP-sp tp2 x ring2", 2, 1, 2, Strategy::Ring)
                    .with_tp_sp()
                    .with_ep(2),
                with(
                    config(3, 4),
                    ZeroStage::OptimizerStates,
                    Checkpointing::Full,
                ),
            ),
        ] {
            let case = format!(
                "{name} / {} ep{} ZeRO {} (group {:?}) {}",
                layout.name,
                layout.ep,
                cfg.memory.zero,
                cfg.memory.zero_group,
                cfg.memory.checkpointing
            );
            let (got, saved) = run(&layout, &cfg);
            assert_same_registry_run(&case, &got, &want, TOL);
            cpl_integration_tests::assert_same_saved(&case, &saved, &want_saved, TOL);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of fixture `name` whose config says `coef` for the balancing loss (what
/// `cpl train --router-aux-loss-coef` writes), in a fresh directory.
fn with_aux_coef(name: &str, coef: f64) -> (models::hub::ModelFiles, std::path::PathBuf) {
    with_changed_config(name, &format!("aux{coef}"), |t, p| {
        models::zoo::moe::set_router_aux_loss_coef(t, coef, p)
    })
}

/// A copy of fixture `name` (in a fresh directory named by `tag`) whose config is `change`d.
fn with_changed_config(
    name: &str,
    tag: &str,
    change: impl Fn(&str, &std::path::Path) -> models::Result<String>,
) -> (models::hub::ModelFiles, std::path::PathBuf) {
    let src = fixture_files(name);
    let dir = std::env::temp_dir().join(format!(
        "cpl-moe-{}-{}-{tag}",
        std::process::id(),
        name.replace('/', "-")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(&src.config).unwrap();
    let changed = change(&text, &src.config).unwrap();
    std::fs::write(dir.join("config.json"), changed).unwrap();
    std::fs::copy(&src.weights[0], dir.join("model.safetensors")).unwrap();
    // transformers' reference (input, labels) too, so that the copy runs as a fixture.
    let reference = cpl_integration_tests::fixture_dir(name).join("reference.safetensors");
    std::fs::copy(&reference, dir.join("reference.safetensors")).unwrap();
    (models::hub::from_dir("moe", &dir).unwrap(), dir)
}

/// The routing metrics of each step of a run's `metrics.jsonl` (the balancing loss, the
/// busiest expert's load overall and per sparse layer, the dropped share), by name.
fn router_metrics(out: &std::path::Path) -> Vec<Vec<(String, f64)>> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("router_aux_loss").is_some())
        .map(|v| {
            let mut m: Vec<(String, f64)> = v
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.starts_with("router_") || k.starts_with("expert_"))
                .map(|(k, x)| (k.clone(), x.as_f64().unwrap()))
                .collect();
            m.sort_by(|a, b| a.0.cmp(&b.0));
            m
        })
        .collect()
}

/// Under a pipeline each micro-batch's load-balancing loss spans the stages: every stage's
/// routing statistics travel with the activation, and the totals its routers' gradient needs
/// travel back with the gradient. With the fixtures' coefficient (0.3), pp2 under 1F1B, under
/// GPipe (every micro-batch's loss before any backward, so the last stage keeps several
/// micro-batches' totals), interleaved with 2 chunks per rank (Qwen2-MoE's 3 layers split
/// 1, 1, 1, 0: the last virtual stage holds only the head) and pp2 x dp2 with ep2 train like one
/// rank: losses, gradient norms, the held-out loss (which, as transformers', includes the
/// balancing loss) and the final weights within 1e-5, and so does every routing metric of
/// `metrics.jsonl` (the balancing loss, the busiest expert's load overall and per layer). The
/// coefficient changes training (a run without it differs), so the routers' gradient is seen.
#[test]
fn moe_under_a_pipeline_trains_like_one_rank_with_the_balancing_loss() {
    use candle_parallel::pipeline::ScheduleKind;
    use cpl_integration_tests::drive_through_registry;
    use train::trainer::PipelineConfig;
    let data = data();
    let cfg = config(2, 4);
    let pipeline = |schedule, virtual_stages, layers: &[usize]| {
        let mut c = cfg.clone();
        c.pipeline = Some(PipelineConfig {
            schedule,
            virtual_stages,
            layers: layers.to_vec(),
        });
        c
    };
    for name in FAMILIES {
        let files = fixture_files(name);
        let dir = std::env::temp_dir().join(format!(
            "cpl-moe-pp-{}-{}",
            std::process::id(),
            name.replace('/', "-")
        ));
        let want = drive_through_registry(
            &files,
            &Layout::single(),
            &cfg,
            &data,
            None,
            &dir.join("single"),
        );
        let want_metrics = router_metrics(&dir.join("single"));
        assert_eq!(want_metrics.len(), 2, "{name}");
        let layers = (models::family::detect(&files.config).unwrap().describe)(&files.config)
            .unwrap()
            .layers;
        let mut cases = vec![
            ("pp2 1f1b", Layout::single().with_pp(2), cfg.clone()),
            (
                "pp2 gpipe",
                Layout::single().with_pp(2),
                pipeline(ScheduleKind::GPipe, 1, &[layers / 2, layers - layers / 2]),
            ),
            (
                "pp2 x dp2, ep2",
                Layout::single().with_pp(2).with_dp(2).with_ep(2),
                config(2, 2),
            ),
        ];
        if layers == 3 {
            cases.push((
                "interleaved pp2 x 2 chunks",
                Layout::single().with_pp(2),
                pipeline(ScheduleKind::Interleaved, 2, &[1, 1, 1, 0]),
            ));
        }
        for (case, layout, c) in cases {
            let case = format!("{name} / {case}");
            let out = dir.join(case.replace(['/', ' ', ','], "-"));
            let got = drive_through_registry(&files, &layout, &c, &data, None, &out);
            assert_same_registry_run(&case, &got, &want, TOL);
            let metrics = router_metrics(&out);
            assert_eq!(metrics.len(), want_metrics.len(), "{case}");
            for (step, (g, w)) in metrics.iter().zip(&want_metrics).enumerate() {
                let names = |m: &[(String, f64)]| m.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
                assert_eq!(names(g), names(w), "{case}: step {step}");
                assert!(w.iter().any(|(k, _)| k.contains("_layer")), "{case}: {w:?}");
                for ((k, a), (_, b)) in g.iter().zip(w) {
                    testkit::assert_close_scalar(*a, *b, TOL, &format!("{case}: step {step} {k}"));
                }
            }
        }
        let (no_aux, aux_dir) = with_aux_coef(name, 0.0);
        let without = train_through_registry(&no_aux, &Layout::single(), &cfg, &data);
        assert!(
            (without.grad_norms[0] - want.grad_norms[0]).abs() > 1e-3 * want.grad_norms[0],
            "{name}: the balancing loss changes nothing"
        );
        std::fs::remove_dir_all(aux_dir).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Bad configs are errors naming the field: top-k above the experts, router noise, a dense
/// layer that does not exist, a negative coefficient; the coefficient on a dense model names
/// the flag.
#[test]
fn bad_moe_configs_name_the_field() {
    let path = fixture_files("moe/qwen3_moe").config;
    let text = std::fs::read_to_string(&path).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    let family = models::family::detect(&path).unwrap();
    for (field, value, want) in [
        (
            "num_experts_per_tok",
            serde_json::json!(9),
            "num_experts_per_tok",
        ),
        ("mlp_only_layers", serde_json::json!([5]), "mlp_only_layers"),
        (
            "router_aux_loss_coef",
            serde_json::json!(-1.0),
            "router_aux_loss_coef",
        ),
        (
            "decoder_sparse_step",
            serde_json::json!(0),
            "decoder_sparse_step",
        ),
    ] {
        let old = cfg[field].clone();
        cfg[field] = value;
        let dir = std::env::temp_dir().join(format!("cpl-moe-bad-{}-{field}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        std::fs::write(&p, cfg.to_string()).unwrap();
        let e = (family.describe)(&p).unwrap_err().to_string();
        assert!(
            e.contains(want) && e.contains("config.json"),
            "{field}: {e}"
        );
        cfg[field] = old;
        std::fs::remove_dir_all(dir).unwrap();
    }
    let mixtral = fixture_files("moe/mixtral").config;
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mixtral).unwrap()).unwrap();
    m["router_jitter_noise"] = serde_json::json!(0.1);
    let e = models::zoo::MixtralConfig::from_json(&m.to_string(), &mixtral)
        .unwrap_err()
        .to_string();
    assert!(e.contains("router_jitter_noise"), "{e}");
    let dense = fixture_files("zoo/qwen3").config;
    let e = models::zoo::moe::set_router_aux_loss_coef(
        &std::fs::read_to_string(&dense).unwrap(),
        0.1,
        &dense,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--router-aux-loss-coef"), "{e}");
}

/// One rank's result of [`run_block`]: the block's output, the loss with the balancing term,
/// the input's gradient and each parameter's gradient by name.
struct BlockRun {
    out: candle_core::Tensor,
    aux: f64,
    dx: candle_core::Tensor,
    grads: std::collections::HashMap<String, candle_core::Tensor>,
    /// What the rank sent during the forward, and during the balancing statistics and the
    /// backward.
    forward_traffic: candle_parallel::comm::TrafficSnapshot,
    backward_traffic: candle_parallel::comm::TrafficSnapshot,
}

/// The sparse block of `cfg` (random weights named `mlp.*`) on `ranks` local ranks, expert
/// parallel over all of them, each rank holding `tokens` of the `(ranks, tokens, hidden)`
/// input `x` (row `r` on rank `r`); loss `Σ out ⊙ g` plus `0.5 · aux · tokens` per rank with
/// the balancing statistics summed over the ranks.
fn run_block(
    cfg: &candle_parallel::nn::MoeConfig,
    weights: &std::collections::HashMap<String, candle_core::Tensor>,
    x: &candle_core::Tensor,
    g: &candle_core::Tensor,
    ranks: usize,
) -> Vec<BlockRun> {
    use candle_core::{DType, Device, Var};
    use candle_parallel::comm::LocalWorld;
    use candle_parallel::nn::{ParamBuilder, ParamMode, RouterAux, SparseMoe, TensorMap};
    use std::sync::Arc;
    let per_rank = x.dim(0).unwrap() / ranks;
    LocalWorld::run(ranks, |world| -> Result<BlockRun, String> {
        let e = |e: &dyn std::fmt::Display| e.to_string();
        let layout = if ranks == 1 {
            Layout::single()
        } else {
            Layout::single().with_dp(ranks)
        };
        let (_mesh, ctx) = layout.context(world.clone())?;
        let source = Arc::new(TensorMap::new(weights.clone(), "random"));
        let (vb, params) =
            ParamBuilder::new(source, DType::F32, &Device::Cpu, ParamMode::Trainable);
        let aux = RouterAux::new(cfg.num_experts);
        let block = SparseMoe::new_with_ep(
            cfg,
            vb.pp("mlp"),
            &ctx,
            Some((aux.clone(), 0)),
            Some(world.clone()),
        )
        .map_err(|x| e(&x))?;
        let r = world.rank();
        let xv = Var::from_tensor(&x.narrow(0, r * per_rank, per_rank).unwrap()).unwrap();
        aux.begin();
        world.traffic().reset();
        let out = block.forward(xv.as_tensor()).map_err(|x| e(&x))?;
        let forward_traffic = world.traffic().snapshot();
        world.traffic().reset();
        let gr = g.narrow(0, r * per_rank, per_rank).unwrap();
        let sum = (&out * &gr).unwrap().sum_all().unwrap();
        let count = out.dim(0).unwrap() * out.dim(1).unwrap();
        let stats = aux
            .finish(count, &[&world], &world, &Device::Cpu)
            .map_err(|x| e(&x))?;
        let loss = aux.add_to_loss(&sum, count, 0.5).map_err(|x| e(&x))?;
        let store = loss.backward().map_err(|x| e(&x))?;
        let backward_traffic = world.traffic().snapshot();
        let mut grads = std::collections::HashMap::new();
        for p in params.sorted() {
            let v = p.var.as_ref().ok_or("a frozen parameter")?;
            let gp = store
                .get(v.as_tensor())
                .ok_or_else(|| format!("rank {r}: {} received no gradient", p.name))?;
            grads.insert(p.name.clone(), gp.clone());
        }
        Ok(BlockRun {
            out,
            aux: stats.aux,
            dx: store
                .get(xv.as_tensor())
                .ok_or("no input gradient")?
                .clone(),
            grads,
            forward_traffic,
            backward_traffic,
        })
    })
    .unwrap()
}

/// Expert parallelism of the sparse block (library level, over data-parallel ranks that each
/// hold their own tokens): on 2, 4 and 8 ranks of 8 experts, top-2 with a shared expert, each
/// rank's output and input gradient equal the one-rank block's rows of that rank, each expert's
/// gradient on its owner equals the one-rank gradient, the router's and shared expert's
/// gradients summed over the ranks equal one rank's, and the balancing loss is the same
/// (1e-5). With 2 tokens per rank on 8 ranks most experts receive no row on most steps.
#[test]
fn expert_parallel_block_matches_one_rank() {
    use candle_core::{Device, Tensor};
    use cpl_integration_tests::{random_matrix, rel_err};
    let (h, inter, experts) = (16, 8, 8);
    let cfg = candle_parallel::nn::MoeConfig::new(h, inter, experts, 2)
        .unwrap()
        .with_norm_topk_prob(true)
        .with_shared_expert(Some(12));
    let weights: std::collections::HashMap<String, Tensor> = cfg
        .parameter_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let t = random_matrix(shape[0], shape[1], 900 + i as u64, &Device::Cpu);
            (format!("mlp.{name}"), (t * 3.0).unwrap())
        })
        .collect();
    for (ranks, tokens) in [(2, 6), (4, 6), (8, 2)] {
        let n = ranks * tokens;
        let x = random_matrix(n, h, 7 + ranks as u64, &Device::Cpu)
            .reshape((ranks, tokens, h))
            .unwrap();
        let g = random_matrix(n, h, 70 + ranks as u64, &Device::Cpu)
            .reshape((ranks, tokens, h))
            .unwrap();
        let want = run_block(&cfg, &weights, &x, &g, 1).remove(0);
        let got = run_block(&cfg, &weights, &x, &g, ranks);
        let case = format!("ep{ranks}");
        let per = experts / ranks;
        for (r, run) in got.iter().enumerate() {
            let rows = |t: &Tensor| t.narrow(0, r, 1).unwrap();
            let err = rel_err(&run.out, &rows(&want.out));
            assert!(err <= TOL, "{case} rank {r}: output rel err {err}");
            let err = rel_err(&run.dx, &rows(&want.dx));
            assert!(err <= TOL, "{case} rank {r}: input gradient rel err {err}");
            testkit::assert_close_scalar(run.aux, want.aux, TOL, &format!("{case}: aux"));
            for e in 0..experts {
                let mine = e / per == r;
                for part in ["gate_proj", "up_proj", "down_proj"] {
                    let name = format!("mlp.experts.{e}.{part}.weight");
                    assert_eq!(
                        run.grads.contains_key(&name),
                        mine,
                        "{case} rank {r}: {name}"
                    );
                    if mine {
                        let err = rel_err(&run.grads[&name], &want.grads[&name]);
                        assert!(err <= TOL, "{case} rank {r}: {name}: rel err {err}");
                    }
                }
            }
        }
        for name in want.grads.keys().filter(|n| !n.contains(".experts.")) {
            let mut sum = got[0].grads[name].clone();
            for run in &got[1..] {
                sum = (sum + &run.grads[name]).unwrap();
            }
            let err = rel_err(&sum, &want.grads[name]);
            assert!(
                err <= TOL,
                "{case}: {name} summed over the ranks: rel err {err}"
            );
        }
    }
}

/// The planner's all-to-all volume for expert parallelism (`planner::expert_traffic`) is what
/// the ranks send: on 2, 4 and 8 ranks of 8 experts, top-2, each rank's all-gathered and
/// exchanged bytes, forward and backward, equal the formula for the rows its tokens send to
/// other ranks' experts and the rows it receives, counted from the router's choices here (ties
/// impossible with random weights). Rows differ between ranks (the router is not uniform), so a
/// formula in the tokens alone would fail.
#[test]
fn expert_parallel_traffic_is_the_planners_formula() {
    use candle_core::{Device, Tensor};
    use candle_parallel::comm::OpKind;
    use candle_parallel::planner::expert_traffic;
    use cpl_integration_tests::random_matrix;
    let (h, inter, experts, k) = (16, 8, 8, 2);
    let cfg = candle_parallel::nn::MoeConfig::new(h, inter, experts, k).unwrap();
    let weights: std::collections::HashMap<String, Tensor> = cfg
        .parameter_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let t = random_matrix(shape[0], shape[1], 300 + i as u64, &Device::Cpu);
            (format!("mlp.{name}"), (t * 3.0).unwrap())
        })
        .collect();
    let router = weights["mlp.gate.weight"].to_vec2::<f32>().unwrap();
    let mut uneven = false;
    for (ranks, tokens) in [(2, 6), (4, 5), (8, 3)] {
        let n = ranks * tokens;
        let x = random_matrix(n, h, 17 + ranks as u64, &Device::Cpu);
        let g = random_matrix(n, h, 71 + ranks as u64, &Device::Cpu)
            .reshape((ranks, tokens, h))
            .unwrap();
        // The owner of each (token, expert) row: the top-k logits of each token.
        let per = experts / ranks;
        let mut sent = vec![0u64; ranks];
        let mut received = vec![0u64; ranks];
        for (t, row) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
            let logits: Vec<f64> = router
                .iter()
                .map(|w| w.iter().zip(row).map(|(a, b)| *a as f64 * *b as f64).sum())
                .collect();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let home = t / tokens;
            for &e in &order[..k] {
                if e / per != home {
                    sent[home] += 1;
                    received[e / per] += 1;
                }
            }
        }
        uneven |= sent.iter().any(|&s| s != sent[0]) || received != sent;
        let x = x.reshape((ranks, tokens, h)).unwrap();
        let runs = run_block(&cfg, &weights, &x, &g, ranks);
        for (r, run) in runs.iter().enumerate() {
            let want = expert_traffic(ranks, sent[r], received[r], h, 4);
            let case = format!(
                "ep{ranks} rank {r} ({} rows out, {} in)",
                sent[r], received[r]
            );
            let (f, b) = (&run.forward_traffic, &run.backward_traffic);
            assert_eq!(
                f.get(OpKind::Exchange).bytes_sent,
                want.forward.exchange,
                "{case}: forward"
            );
            assert_eq!(
                f.get(OpKind::AllGather).bytes_sent,
                want.forward.all_gather,
                "{case}: forward"
            );
            assert_eq!(f.get(OpKind::AllGather).calls, want.forward_calls, "{case}");
            assert_eq!(
                b.get(OpKind::Exchange).bytes_sent,
                want.backward.exchange,
                "{case}: backward"
            );
            assert_eq!(
                b.get(OpKind::AllGather).bytes_sent,
                want.backward.all_gather,
                "{case}: backward"
            );
            assert_eq!(
                b.get(OpKind::AllGather).calls,
                want.backward_calls,
                "{case}"
            );
            assert_eq!(
                f.bytes_sent(),
                want.forward.total(),
                "{case}: nothing else forward"
            );
        }
    }
    assert!(
        uneven,
        "every rank sent as many rows as it received: the test shows nothing"
    );
}

/// One step with token dropping (`moe_capacity_factor` 0.75) on each fixture's sequence: under a
/// zigzag ring of 4, USP 2x2 and TP-sp x ring2 the loss, the logits and every parameter's
/// gradient equal one rank (1e-5), and every parameter receives one (`run_layout` asserts it);
/// the one-rank loss differs from the dropless one, so assignments were dropped.
#[test]
fn token_dropping_gradients_match_one_rank() {
    for name in FAMILIES {
        let (_, dir) = with_changed_config(name, "capacity-step", |t, p| {
            models::zoo::moe::set_moe_capacity_factor(t, 0.75, p)
        });
        let copy = dir.to_str().unwrap();
        let want = run_layout(copy, &Layout::single());
        let dropless = run_layout(name, &Layout::single());
        assert!(
            (want.loss - dropless.loss).abs() > 1e-4 * dropless.loss.abs(),
            "{name}: nothing dropped ({} vs {})",
            want.loss,
            dropless.loss
        );
        for layout in [
            Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring),
            Layout::new("usp 2x2", 1, 2, 2, Strategy::Usp),
            Layout::new("tp2 TP-sp x ring2", 2, 1, 2, Strategy::Ring).with_tp_sp(),
        ] {
            let got = run_layout(copy, &layout);
            assert_same_step(
                &format!("{name} / {} with dropping", layout.name),
                &got,
                &want,
                TOL,
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// The share of dropped assignments in each step of a run's `metrics.jsonl`.
fn dropped_fractions(out: &std::path::Path) -> Vec<f64> {
    router_metrics(out)
        .iter()
        .map(|step| {
            step.iter()
                .find(|(k, _)| k == "expert_dropped_fraction")
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("no expert_dropped_fraction in {step:?}"))
        })
        .collect()
}

/// Token dropping (`moe_capacity_factor` 0.75, what `cpl train --moe-capacity-factor 0.75`
/// writes): each expert keeps its most probable assignments of the micro-batch, decided over
/// every rank that holds the micro-batch's tokens, so a zigzag ring of 4, USP 2x2, TP-sp x
/// ring2, expert parallelism over a ring of 2 (ep2) and pp2 drop what one rank drops: the same share
/// dropped at every step, losses, gradient norms and the held-out loss equal one rank (1e-5),
/// and so do the final weights apart from isolated entries AdamW may move apart
/// ([`cpl_integration_tests::assert_weights_close_up_to_adam`]; measured: one entry of Qwen3-MoE's embedding and one
/// of Mixtral's layer-1 expert 4, the others within 1e-6). Assignments are dropped (5% to 60%
/// on every step) and dropping changes training (the dropless run differs).
#[test]
fn token_dropping_drops_the_same_assignments_under_every_layout() {
    use cpl_integration_tests::{assert_same_registry_run_weights, drive_through_registry};
    let data = data();
    let cfg = config(2, 2);
    for name in FAMILIES {
        let (files, dir) = with_changed_config(name, "capacity", |t, p| {
            models::zoo::moe::set_moe_capacity_factor(t, 0.75, p)
        });
        let out = dir.join("run-single");
        let want = drive_through_registry(&files, &Layout::single(), &cfg, &data, None, &out);
        let dropped = dropped_fractions(&out);
        assert_eq!(dropped.len(), 2, "{name}: {dropped:?}");
        for d in &dropped {
            assert!((0.05..0.6).contains(d), "{name}: dropped {dropped:?}");
        }
        let dropless = train_through_registry(&fixture_files(name), &Layout::single(), &cfg, &data);
        assert!(
            (dropless.losses[1] - want.losses[1]).abs() > 1e-4 * want.losses[1].abs(),
            "{name}: dropping changed nothing ({} vs {})",
            dropless.losses[1],
            want.losses[1]
        );
        for layout in [
            Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring),
            Layout::new("usp 2x2", 1, 2, 2, Strategy::Usp),
            Layout::new("tp2 TP-sp x ring2", 2, 1, 2, Strategy::Ring).with_tp_sp(),
            Layout::new("ring2, ep2", 1, 1, 2, Strategy::Ring).with_ep(2),
            // The dropped assignments counted on both stages and carried to the last.
            Layout::new("pp2", 1, 1, 1, Strategy::Ring).with_pp(2),
        ] {
            let case = format!("{name} / {}", layout.name);
            let out = dir.join(format!("run-{}", layout.name.replace(' ', "-")));
            let got = drive_through_registry(&files, &layout, &cfg, &data, None, &out);
            let d = dropped_fractions(&out);
            assert_eq!(d.len(), 2, "{case}");
            for (a, b) in d.iter().zip(&dropped) {
                testkit::assert_close_scalar(*a, *b, 1e-12, &format!("{case}: dropped"));
            }
            // Losses, norms and the held-out loss at 1e-5; the weights below.
            assert_same_registry_run_weights(&case, &got, &want, TOL, f64::INFINITY);
            cpl_integration_tests::assert_weights_close_up_to_adam(
                &case,
                &got,
                &want,
                cfg.adamw.lr,
                TOL,
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
