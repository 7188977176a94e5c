//! Pipeline schedules without tensors (issue 13): a sweep over (stages, micro-batches, chunks)
//! in which every generated schedule validates (every send received, forward before backward,
//! activations in flight never negative and zero at the end, no deadlock), holds at most `m`
//! activations per rank under GPipe and at most `p - rank` under 1F1B, and has a simulated
//! bubble equal to the formula where the formula is exact; and planted defects that the
//! validator must reject.

use candle_parallel::pipeline::{Action, ActionKind, PipelineSchedule, ScheduleKind};

fn kinds(v: usize) -> Vec<ScheduleKind> {
    if v == 1 {
        vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB]
    } else {
        vec![ScheduleKind::Interleaved]
    }
}

#[test]
fn every_generated_schedule_validates_over_a_sweep() {
    for p in 1..=6 {
        for m in 1..=13 {
            for v in 1..=3 {
                for kind in kinds(v) {
                    let what = format!("{kind:?} p={p} m={m} v={v}");
                    let s = PipelineSchedule::new(kind, p, m, v)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let stats = s.validate().unwrap_or_else(|e| panic!("{what}: {e}"));
                    // Each rank runs every (micro-batch, chunk) forward and backward once.
                    for (r, acts) in s.ranks.iter().enumerate() {
                        let f = acts
                            .iter()
                            .filter(|a| a.kind == ActionKind::Forward)
                            .count();
                        let b = acts
                            .iter()
                            .filter(|a| a.kind == ActionKind::Backward)
                            .count();
                        assert_eq!((f, b), (m * v, m * v), "{what}: rank {r}");
                    }
                    for (r, &peak) in stats.peak_in_flight.iter().enumerate() {
                        match kind {
                            ScheduleKind::GPipe => assert_eq!(peak, m, "{what}: rank {r}"),
                            ScheduleKind::OneFOneB => {
                                assert!(peak <= (p - r).min(m), "{what}: rank {r} holds {peak}")
                            }
                            ScheduleKind::Interleaved => assert!(peak <= m * v, "{what}"),
                        }
                    }
                    if kind != ScheduleKind::Interleaved {
                        // Equal stages, backward = 2 forwards: the idle time of every rank is
                        // exactly (p - 1)(F + B), so the mean bubble is the formula.
                        let e = (stats.mean_bubble() - s.bubble_formula()).abs();
                        assert!(
                            e < 1e-12,
                            "{what}: bubble {} vs {}",
                            stats.mean_bubble(),
                            s.bubble_formula()
                        );
                    }
                }
            }
        }
    }
}

/// Interleaving shrinks the bubble at equal micro-batches: below 1F1B, and exactly the formula
/// `(p - 1) / (v m + p - 1)` when `m` is a multiple of `p`; with other `m` (Llama 3's flexible
/// pipeline) it stays below 1F1B.
#[test]
fn interleaving_shrinks_the_bubble() {
    for (p, m) in [
        (2, 4),
        (4, 4),
        (4, 8),
        (4, 16),
        (3, 6),
        (4, 6),
        (3, 7),
        (4, 5),
    ] {
        let one = PipelineSchedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap();
        for v in [2, 3, 4] {
            let inter = PipelineSchedule::new(ScheduleKind::Interleaved, p, m, v).unwrap();
            let b1 = one.validate().unwrap().mean_bubble();
            let bv = inter.validate().unwrap().mean_bubble();
            assert!(bv < b1, "p={p} m={m} v={v}: interleaved {bv} vs 1f1b {b1}");
            if m % p == 0 {
                let f = inter.bubble_formula();
                assert!(
                    (bv - f).abs() < 1e-12,
                    "p={p} m={m} v={v}: bubble {bv} vs formula {f}"
                );
            }
        }
    }
}

/// Schedules are data: each rank's first actions under 1F1B with 4 stages and 6 micro-batches
/// (Megatron's order: warm-up of p - rank - 1 forwards, then one forward, one backward).
#[test]
fn one_f_one_b_order_is_megatrons() {
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 4, 6, 1).unwrap();
    let compute = |r: usize| -> Vec<String> {
        s.ranks[r]
            .iter()
            .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
            .map(|a| a.to_string())
            .collect()
    };
    assert_eq!(
        compute(0),
        ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    );
    assert_eq!(
        compute(3),
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    );
    let r1: Vec<String> = s.ranks[1].iter().take(4).map(|a| a.to_string()).collect();
    assert_eq!(r1, ["RECV_F0", "F0", "SEND_F0", "RECV_F1"]);
}

fn expect_invalid(s: &PipelineSchedule, needle: &str) {
    match s.validate() {
        Ok(_) => panic!("planted defect ({needle}) was accepted"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "expected '{needle}', got: {e}"
        ),
    }
}

fn remove(s: &mut PipelineSchedule, r: usize, kind: ActionKind, mb: usize) {
    let i = s.ranks[r]
        .iter()
        .position(|a| a.kind == kind && a.micro_batch == mb)
        .expect("action to remove");
    s.ranks[r].remove(i);
}

#[test]
fn the_validator_rejects_planted_defects() {
    let good = PipelineSchedule::new(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();

    let mut s = good.clone();
    remove(&mut s, 0, ActionKind::SendActivation, 2);
    expect_invalid(&s, "rank 1 waits at RECV_F2 for rank 0");

    let mut s = good.clone();
    remove(&mut s, 1, ActionKind::RecvGradient, 0);
    expect_invalid(&s, "backward before its output gradient was received");

    let mut s = good.clone();
    remove(&mut s, 2, ActionKind::Backward, 3);
    expect_invalid(&s, "send before the computation it sends");

    let mut s = good.clone();
    remove(&mut s, 0, ActionKind::RecvGradient, 3);
    remove(&mut s, 0, ActionKind::Backward, 3);
    expect_invalid(&s, "is never received");

    // Backward moved before its forward on the last stage.
    let mut s = good.clone();
    let i = s.ranks[2]
        .iter()
        .position(|a| a.kind == ActionKind::Backward)
        .unwrap();
    let b = s.ranks[2].remove(i);
    s.ranks[2].insert(0, b);
    expect_invalid(&s, "backward before its forward");

    // A forward run twice.
    let mut s = good.clone();
    let f = Action {
        kind: ActionKind::Forward,
        micro_batch: 0,
        chunk: 0,
    };
    s.ranks[0].insert(1, f);
    expect_invalid(&s, "second forward");

    // A rank that ends holding an activation (its backward and gradient send dropped, and the
    // matching receive on the previous rank dropped too).
    let mut s = good.clone();
    remove(&mut s, 0, ActionKind::Backward, 1);
    expect_invalid(&s, "micro-batch 1 does not run forward and backward");

    let mut s = good.clone();
    s.ranks[1][0].micro_batch = 9;
    expect_invalid(&s, "no such chunk or micro-batch");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let err = |k, p, m, v| PipelineSchedule::new(k, p, m, v).unwrap_err().to_string();
    assert!(err(ScheduleKind::OneFOneB, 0, 4, 1).contains("at least one stage"));
    assert!(err(ScheduleKind::GPipe, 2, 0, 1).contains("at least one micro-batch"));
    assert!(err(ScheduleKind::OneFOneB, 2, 4, 2).contains("need the interleaved schedule"));
    assert!(err(ScheduleKind::Interleaved, 2, 4, 1).contains("at least 2 model chunks"));
}

#[test]
fn the_timetable_shows_every_rank_and_the_bubble() {
    let s = PipelineSchedule::new(ScheduleKind::Interleaved, 4, 6, 2).unwrap();
    let t = s.render().unwrap();
    for r in 0..4 {
        assert!(t.contains(&format!("rank {r}: ")), "{t}");
    }
    assert!(t.contains("F0.c1"), "{t}");
    assert!(t.contains("formula (p-1)/(v*m+p-1) = 20.0%"), "{t}");
}
