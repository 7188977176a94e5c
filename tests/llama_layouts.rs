//! The same LLaMA under every parallel layout: loss, logits and the full gradient of every
//! parameter equal the single-rank run within 1e-5 relative (f32; max-abs / max|ref| per
//! tensor). Gradients are reduced over the ranks sharing a parameter and tensor-parallel slices
//! gathered, so what is compared is each parameter's whole gradient.

use candle_parallel::attention::{SeqLayout, Strategy};
use candle_parallel::mesh::Placement;
use cpl_integration_tests::{rel_err, run_layout, Layout, StepResult};

const TOL: f32 = 1e-5;

fn compare(name: &str, layout: &Layout, want: &StepResult) {
    let got = run_layout(name, layout);
    let le = (got.loss - want.loss).abs() / want.loss.abs();
    assert!(
        le <= TOL,
        "{name} / {}: loss {} vs {} (rel {le})",
        layout.name,
        got.loss,
        want.loss
    );
    let e = rel_err(&got.logits, &want.logits);
    assert!(e <= TOL, "{name} / {}: logits rel err {e}", layout.name);
    assert_eq!(
        got.grads.len(),
        want.grads.len(),
        "{name} / {}",
        layout.name
    );
    for (n, g) in &want.grads {
        let ours = got
            .grads
            .get(n)
            .unwrap_or_else(|| panic!("{name} / {}: no gradient for {n}", layout.name));
        let e = rel_err(ours, g);
        assert!(
            e <= TOL,
            "{name} / {}: gradient of {n}: rel err {e}",
            layout.name
        );
    }
}

fn layouts() -> Vec<Layout> {
    vec![
        Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        Layout::new("tp2 + tp-sp", 2, 1, 1, Strategy::Ring).with_tp_sp(),
        Layout::new("ulysses2 x ring2 (usp)", 1, 2, 2, Strategy::Usp),
        Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring),
        Layout::new("contiguous ring4", 1, 1, 4, Strategy::Ring)
            .with_sp(|s| s.with_layout(SeqLayout::Contiguous)),
        Layout::new("double ring w2 on 4", 1, 1, 4, Strategy::DoubleRing)
            .with_sp(|s| s.with_inner_ring(2)),
        Layout::new(
            "double ring 2x2 context-first",
            1,
            2,
            2,
            Strategy::DoubleRing,
        )
        .with_sp(|s| s.with_inner_ring(2).with_placement(Placement::ContextFirst)),
        Layout::new("startrail C2 on 8", 1, 1, 8, Strategy::StarTrail).with_sp(|s| s.with_team(2)),
        Layout::new("all-gather CP 4", 1, 1, 4, Strategy::AllGather),
        Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring),
        Layout::new("tp2 + tp-sp x ulysses2", 2, 2, 1, Strategy::Ulysses).with_tp_sp(),
    ]
}

#[test]
fn every_layout_matches_single_rank_mha() {
    let want = run_layout("mha", &Layout::single());
    for l in layouts() {
        compare("mha", &l, &want);
    }
}

#[test]
fn every_layout_matches_single_rank_gqa() {
    let want = run_layout("gqa", &Layout::single());
    for l in layouts() {
        compare("gqa", &l, &want);
    }
}

#[test]
fn tied_embeddings_under_tp_and_ring() {
    let want = run_layout("tied", &Layout::single());
    compare("tied", &Layout::new("tp2", 2, 1, 1, Strategy::Ring), &want);
    compare(
        "tied",
        &Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring),
        &want,
    );
}
