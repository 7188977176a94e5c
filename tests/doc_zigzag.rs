//! Per-document zigzag (`--ring-layout doc-zigzag`) under every strategy with document masks:
//! the loss, the logits and every parameter's gradient (each non-zero) equal the single-rank
//! run within 1e-5 relative (f32), for documents crossing shard borders, documents all shorter
//! than `2·R` tokens, and one document longer than the window (the window is inside it).

use candle_parallel::attention::{AttnMask, SeqLayout};
use cpl_integration_tests::{
    assert_same_step, every_strategy, run_layout_masked, Layout, StepPlan,
};

const TOL: f64 = 1e-5;

/// The causal document mask of consecutive documents of `lens` tokens.
fn documents(lens: &[usize]) -> AttnMask {
    let ids: Vec<u32> = lens
        .iter()
        .enumerate()
        .flat_map(|(d, &l)| std::iter::repeat_n(d as u32, l))
        .collect();
    AttnMask::documents(ids)
}

#[test]
fn every_strategy_matches_single_rank_with_documents() {
    // The fixture's windows have 32 tokens; ring 4 cuts documents into 8 chunks, ring 8
    // (StarTrail) into 16.
    for (what, lens) in [
        ("mixed", vec![5, 1, 13, 9, 4]),
        ("all shorter than 2 x ring", vec![3, 7, 1, 6, 2, 5, 4, 4]),
        ("one document longer than the window", vec![32]),
    ] {
        let mask = documents(&lens);
        let want = run_layout_masked("gqa", &Layout::single(), StepPlan::default(), &mask);
        for layout in every_strategy() {
            let layout = layout.with_sp(|s| s.with_layout(SeqLayout::DocZigzag));
            let got = run_layout_masked("gqa", &layout, StepPlan::default(), &mask);
            assert_same_step(
                &format!("doc-zigzag {} / {what}", layout.name),
                &got,
                &want,
                TOL,
            );
        }
    }
}
