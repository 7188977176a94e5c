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
    assert_same_step, check_reference, fixture_files, run_layout, run_layout_with, Layout, StepPlan,
};

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
