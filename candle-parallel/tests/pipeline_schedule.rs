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
/// `(p - 1) / (v m + p - 1)` for every `m >= p`, multiples of `p` or not (Llama 3's flexible
/// pipeline; before the schedule ran torchtitan's rounds, `p = 4, m = 5, v = 3` idled 32% of the
/// step against the formula's 17%).
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
            if m >= p {
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
    remove_where(s, r, |a| a.kind == kind && a.micro_batch == mb);
}

/// Removes the first action of rank `r` that `hit` selects.
fn remove_where(s: &mut PipelineSchedule, r: usize, hit: impl Fn(&Action) -> bool) {
    let i = s.ranks[r].iter().position(hit).expect("action to remove");
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

    // Deadlocks on later chunks of an interleaved schedule with more chunks than ranks name
    // the rank each receive waits for (virtual stage c·p + r takes activations from the
    // previous virtual stage's owner and gradients from the next one's).
    let inter = PipelineSchedule::new(ScheduleKind::Interleaved, 2, 2, 3).unwrap();
    let drop_send = |kind: ActionKind, chunk: usize| {
        let mut s = inter.clone();
        remove_where(&mut s, 1, |a| {
            a.kind == kind && a.micro_batch == 0 && a.chunk == chunk
        });
        s
    };
    // Virtual stage 3 (rank 1, chunk 1) sends micro-batch 0 to virtual stage 4 (rank 0, chunk 2).
    let s = drop_send(ActionKind::SendActivation, 1);
    expect_invalid(&s, "rank 0 waits at RECV_F0.c2 for rank 1");
    // Virtual stage 5 (rank 1, chunk 2) sends its gradient to virtual stage 4 (rank 0, chunk 2).
    let s = drop_send(ActionKind::SendGradient, 2);
    expect_invalid(&s, "rank 0 waits at RECV_B0.c2 for rank 1");
    // Virtual stage 3 (rank 1, chunk 1) sends its gradient to virtual stage 2 (rank 0, chunk 1).
    let s = drop_send(ActionKind::SendGradient, 1);
    expect_invalid(&s, "rank 0 waits at RECV_B0.c1 for rank 1");

    // A forward on a later stage whose input never arrives (its receive moved after it).
    let mut s = good.clone();
    let i = s.ranks[1]
        .iter()
        .position(|a| a.kind == ActionKind::RecvActivation && a.micro_batch == 0)
        .unwrap();
    let recv = s.ranks[1].remove(i);
    s.ranks[1].insert(i + 1, recv);
    expect_invalid(&s, "forward before its input was received");
}

/// Evaluation schedules: forwards only, every micro-batch through every virtual stage, valid
/// for any stages, micro-batches and chunks; a backward planted in one is rejected.
#[test]
fn forward_only_schedules_validate() {
    for p in 1..=5 {
        for m in 1..=7 {
            for v in 1..=3 {
                let s = PipelineSchedule::forward_only(p, m, v)
                    .unwrap_or_else(|e| panic!("p={p} m={m} v={v}: {e}"));
                for acts in &s.ranks {
                    assert_eq!(
                        acts.iter()
                            .filter(|a| a.kind == ActionKind::Forward)
                            .count(),
                        m * v
                    );
                    assert!(acts.iter().all(|a| a.kind != ActionKind::Backward));
                }
            }
        }
    }
    let mut s = PipelineSchedule::forward_only(2, 2, 1).unwrap();
    s.ranks[1].push(Action {
        kind: ActionKind::Backward,
        micro_batch: 0,
        chunk: 0,
    });
    expect_invalid(&s, "backward in a forward-only schedule");
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

mod executor {
    use candle_core::backprop::GradStore;
    use candle_core::{DType, Device, Shape, Tensor, Var};
    use candle_parallel::pipeline::{run_schedule, PipelineSchedule, ScheduleKind, StageModel};
    use candle_parallel::LocalWorld;

    /// Virtual stage `s` multiplies its input by `w[s]` (a scalar parameter) and adds `s`; the
    /// first reads micro-batch `i`'s input `[i + 1, i + 2]`, the last sums its output (the
    /// loss). Optionally fails at the forward of one micro-batch.
    struct Toy {
        rank: usize,
        p: usize,
        w: Vec<Var>,
        grads: Vec<f64>,
        fail_at: Option<usize>,
    }

    impl Toy {
        /// Rank `rank` of `p` with `v` chunks, each weight [`weight`] of its virtual stage.
        fn new(rank: usize, p: usize, v: usize) -> candle_core::Result<Self> {
            let w = (0..v)
                .map(|c| Var::new(weight(c * p + rank), &Device::Cpu))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Self {
                rank,
                p,
                w,
                grads: vec![0.0; v],
                fail_at: None,
            })
        }
    }

    impl StageModel for Toy {
        fn activation_spec(&self, _: usize, _: usize) -> candle_parallel::Result<(Shape, DType)> {
            Ok((Shape::from(2), DType::F64))
        }

        fn forward(
            &mut self,
            chunk: usize,
            mb: usize,
            input: Option<&Tensor>,
        ) -> candle_parallel::Result<Tensor> {
            if self.fail_at == Some(mb) {
                return Err(candle_parallel::Error::InvalidArgument {
                    op: "toy",
                    msg: "planted failure".into(),
                });
            }
            let s = chunk * self.p + self.rank;
            let x = match input {
                Some(x) => x.clone(),
                None => Tensor::new(&[mb as f64 + 1.0, mb as f64 + 2.0], &Device::Cpu)?,
            };
            let y = (x.broadcast_mul(self.w[chunk].as_tensor())? + s as f64)?;
            let last = self.w.len() * self.p - 1;
            Ok(if s == last { y.sum_all()? } else { y })
        }

        fn backward(&mut self, root: &Tensor) -> candle_parallel::Result<GradStore> {
            let store = root.backward()?;
            for (c, w) in self.w.iter().enumerate() {
                if let Some(g) = store.get(w.as_tensor()) {
                    self.grads[c] += g.to_scalar::<f64>()?;
                }
            }
            Ok(store)
        }
    }

    fn weight(s: usize) -> f64 {
        0.5 + 0.25 * s as f64
    }

    /// d loss / d w_s summed over micro-batches, by hand: x_{s+1} = w_s x_s + s, loss = sum of
    /// the last stage's output.
    fn expected(stages: usize, m: usize) -> Vec<f64> {
        let mut g = vec![0.0; stages];
        for mb in 0..m {
            for x0 in [mb as f64 + 1.0, mb as f64 + 2.0] {
                let mut xs = vec![x0];
                for s in 0..stages {
                    xs.push(weight(s) * xs[s] + s as f64);
                }
                // d out / d w_s = x_s * prod_{t > s} w_t
                for s in 0..stages {
                    let tail: f64 = (s + 1..stages).map(weight).product();
                    g[s] += xs[s] * tail;
                }
            }
        }
        g
    }

    /// Schedules, stages and chunks per rank the executor tests run.
    const SCHEDULES: [(ScheduleKind, usize, usize); 4] = [
        (ScheduleKind::GPipe, 3, 1),
        (ScheduleKind::OneFOneB, 4, 1),
        (ScheduleKind::Interleaved, 2, 3),
        (ScheduleKind::Interleaved, 3, 2),
    ];

    /// Every (virtual stage, gradient of its weight) of `got` equals [`expected`]'s within
    /// 1e-12 relative.
    fn assert_hand_gradients(case: &str, stages: usize, m: usize, got: &[(usize, f64)]) {
        let want = expected(stages, m);
        for &(s, g) in got {
            assert!(
                (g - want[s]).abs() <= 1e-12 * want[s].abs(),
                "{case} stage {s}: {g} vs {}",
                want[s]
            );
        }
    }

    #[test]
    fn the_executor_gives_the_hand_computed_gradients() {
        for (kind, p, v) in SCHEDULES {
            for m in [1, 2, 5] {
                let sched = PipelineSchedule::new(kind, p, m, v).unwrap();
                let got =
                    LocalWorld::run(p, |comm| -> candle_parallel::Result<Vec<(usize, f64)>> {
                        let rank = comm.rank();
                        let mut toy = Toy::new(rank, p, v)?;
                        run_schedule(&sched, &comm, &mut toy)?;
                        Ok((0..v).map(|c| (c * p + rank, toy.grads[c])).collect())
                    })
                    .unwrap();
                let got: Vec<(usize, f64)> = got.into_iter().flatten().collect();
                assert_hand_gradients(&format!("{kind} p={p} v={v} m={m}"), p * v, m, &got);
            }
        }
    }

    /// Records what travels besides the activations: each virtual stage adds itself to the
    /// forward carry `[micro-batch, Σ stages so far, stages so far]` and to the backward carry
    /// the other way; the last virtual stage keeps the forward carries it received, the first
    /// the backward ones. Wraps [`Toy`] for the activations.
    struct Carrier {
        toy: Toy,
        /// Received, by (backward, chunk, micro-batch); to send, likewise.
        received: std::collections::HashMap<(bool, usize, usize), Vec<f64>>,
        to_send: std::collections::HashMap<(bool, usize, usize), Vec<f64>>,
        backward_of: Option<(usize, usize)>,
        /// (micro-batch, carry) at the last virtual stage's forward / the first's backward.
        at_last: Vec<(usize, Vec<f64>)>,
        at_first: Vec<(usize, Vec<f64>)>,
    }

    impl Carrier {
        fn stage(&self, chunk: usize) -> usize {
            chunk * self.toy.p + self.toy.rank
        }
        fn last(&self) -> usize {
            self.toy.w.len() * self.toy.p - 1
        }
        fn step(&mut self, backward: bool, chunk: usize, mb: usize) -> Vec<f64> {
            let s = self.stage(chunk);
            let start = (s == 0 && !backward) || (s == self.last() && backward);
            let mut c = if start {
                let mut c = vec![mb as f64, 0.0, 0.0];
                if backward {
                    c.push(-1.0);
                }
                c
            } else {
                self.received
                    .remove(&(backward, chunk, mb))
                    .unwrap_or_else(|| panic!("stage {s}: nothing carried for {mb}"))
            };
            assert_eq!(c[0], mb as f64, "stage {s}: another micro-batch's carry");
            c[1] += s as f64;
            c[2] += 1.0;
            c
        }
    }

    impl StageModel for Carrier {
        fn activation_spec(&self, c: usize, m: usize) -> candle_parallel::Result<(Shape, DType)> {
            self.toy.activation_spec(c, m)
        }

        fn forward(
            &mut self,
            chunk: usize,
            mb: usize,
            input: Option<&Tensor>,
        ) -> candle_parallel::Result<Tensor> {
            let c = self.step(false, chunk, mb);
            if self.stage(chunk) == self.last() {
                self.at_last.push((mb, c));
            } else {
                self.to_send.insert((false, chunk, mb), c);
            }
            self.toy.forward(chunk, mb, input)
        }

        fn backward(&mut self, root: &Tensor) -> candle_parallel::Result<GradStore> {
            let (chunk, mb) = self.backward_of.take().expect("begin_backward first");
            let c = self.step(true, chunk, mb);
            if self.stage(chunk) == 0 {
                self.at_first.push((mb, c));
            } else {
                self.to_send.insert((true, chunk, mb), c);
            }
            self.toy.backward(root)
        }

        /// The backward carry has one more (unused) value, so that the lengths differ.
        fn carry_lens(&self) -> (usize, usize) {
            (3, 4)
        }

        fn receive_carry(
            &mut self,
            backward: bool,
            chunk: usize,
            mb: usize,
            carry: Vec<f64>,
        ) -> candle_parallel::Result<()> {
            self.received.insert((backward, chunk, mb), carry);
            Ok(())
        }

        fn send_carry(
            &mut self,
            backward: bool,
            chunk: usize,
            mb: usize,
        ) -> candle_parallel::Result<Vec<f64>> {
            Ok(self
                .to_send
                .remove(&(backward, chunk, mb))
                .expect("a carry to send"))
        }

        fn begin_backward(&mut self, chunk: usize, mb: usize) -> candle_parallel::Result<()> {
            self.backward_of = Some((chunk, mb));
            Ok(())
        }
    }

    /// Every micro-batch's carried vectors pass through every virtual stage in order, forward
    /// and backward, under every schedule, also from a rank to itself (one rank with two
    /// chunks), and the activations' gradients are unchanged by them.
    #[test]
    fn carried_vectors_travel_with_activations_and_gradients() {
        // One rank with two chunks: every message goes from the rank to itself.
        for (kind, p, v) in SCHEDULES
            .into_iter()
            .chain([(ScheduleKind::Interleaved, 1, 2)])
        {
            let m = 3;
            let sched = PipelineSchedule::new(kind, p, m, v).unwrap();
            type Seen = (
                Vec<(usize, f64)>,
                Vec<(usize, Vec<f64>)>,
                Vec<(usize, Vec<f64>)>,
            );
            let got = LocalWorld::run(p, |comm| -> candle_parallel::Result<Seen> {
                let rank = comm.rank();
                let toy = Toy::new(rank, p, v)?;
                let mut c = Carrier {
                    toy,
                    received: Default::default(),
                    to_send: Default::default(),
                    backward_of: None,
                    at_last: Vec::new(),
                    at_first: Vec::new(),
                };
                run_schedule(&sched, &comm, &mut c)?;
                let grads = (0..v).map(|k| (k * p + rank, c.toy.grads[k])).collect();
                Ok((grads, c.at_last, c.at_first))
            })
            .unwrap();
            let stages = p * v;
            let all: f64 = (0..stages).map(|s| s as f64).sum();
            let (mut last, mut first) = (Vec::new(), Vec::new());
            for (grads, l, f) in got {
                assert_hand_gradients(&format!("{kind} p={p} v={v}"), stages, m, &grads);
                last.extend(l);
                first.extend(f);
            }
            last.sort_by_key(|x| x.0);
            first.sort_by_key(|x| x.0);
            for (seen, what) in [(last, "forward"), (first, "backward")] {
                let want: Vec<(usize, Vec<f64>)> = (0..m)
                    .map(|mb| {
                        let mut c = vec![mb as f64, all, stages as f64];
                        if what == "backward" {
                            c.push(-1.0);
                        }
                        (mb, c)
                    })
                    .collect();
                assert_eq!(seen, want, "{kind} p={p} v={v}: {what} carries");
            }
        }
    }

    /// A rank failing mid-pipeline: every other rank returns an error naming it, no hang.
    #[test]
    fn a_failing_rank_is_named_by_every_other_rank() {
        let p = 3;
        let sched = PipelineSchedule::new(ScheduleKind::OneFOneB, p, 4, 1).unwrap();
        let errs = LocalWorld::run(p, |comm| -> candle_parallel::Result<Option<String>> {
            let rank = comm.rank();
            let w = vec![Var::new(weight(rank), &Device::Cpu)?];
            let fail_at = (rank == 1).then_some(2);
            let mut toy = Toy {
                rank,
                p,
                w,
                grads: vec![0.0],
                fail_at,
            };
            Ok(run_schedule(&sched, &comm, &mut toy)
                .err()
                .map(|e| e.to_string()))
        });
        let errs = errs.unwrap();
        assert!(
            errs[1].as_deref().unwrap_or("").contains("planted failure"),
            "{errs:?}"
        );
        for r in [0, 2] {
            let e = errs[r]
                .as_deref()
                .unwrap_or_else(|| panic!("rank {r} succeeded: {errs:?}"));
            assert!(e.contains("rank 1"), "rank {r}: {e}");
        }
    }
}

fn insert_after(
    s: &mut PipelineSchedule,
    r: usize,
    kind: ActionKind,
    mb: usize,
    chunk: usize,
    new: Action,
) {
    let i = s.ranks[r]
        .iter()
        .position(|a| a.kind == kind && a.micro_batch == mb && a.chunk == chunk)
        .expect("action to insert after");
    s.ranks[r].insert(i + 1, new);
}

fn act(kind: ActionKind, micro_batch: usize, chunk: usize) -> Action {
    Action {
        kind,
        micro_batch,
        chunk,
    }
}

/// Messages with no neighbour, a message sent twice, a chunk or micro-batch just past the
/// last, and deadlocks that name the rank each stuck rank waits for (activations from the
/// previous virtual stage, wrapping from the last rank to the first; gradients from the next).
#[test]
fn the_validator_rejects_messages_without_a_partner() {
    let good = PipelineSchedule::new(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();
    use ActionKind::*;

    let mut s = good.clone();
    insert_after(&mut s, 2, Forward, 0, 0, act(SendActivation, 0, 0));
    expect_invalid(&s, "rank 2, action 2 (SEND_F0): no neighbour to send to");

    let mut s = good.clone();
    insert_after(&mut s, 0, Backward, 0, 0, act(SendGradient, 0, 0));
    expect_invalid(&s, "(SEND_B0): no neighbour to send to");

    let mut s = good.clone();
    s.ranks[0].insert(0, act(RecvActivation, 0, 0));
    expect_invalid(
        &s,
        "rank 0, action 0 (RECV_F0): no neighbour to receive from",
    );

    let mut s = good.clone();
    insert_after(&mut s, 2, Forward, 0, 0, act(RecvGradient, 0, 0));
    expect_invalid(&s, "(RECV_B0): no neighbour to receive from");

    let mut s = good.clone();
    insert_after(&mut s, 0, SendActivation, 1, 0, act(SendActivation, 1, 0));
    expect_invalid(&s, "(SEND_F1): the same message sent twice");

    // Just past the last chunk, and just past the last micro-batch.
    let mut s = good.clone();
    s.ranks[1][0].chunk = 1;
    expect_invalid(&s, "no such chunk or micro-batch");
    let mut s = good.clone();
    s.ranks[1][0].micro_batch = 4;
    expect_invalid(&s, "no such chunk or micro-batch");

    // Interleaved, 3 ranks x 2 chunks: rank 0's chunk 1 (virtual stage 3) takes its input from
    // rank 2's chunk 0.
    let good = PipelineSchedule::new(ScheduleKind::Interleaved, 3, 3, 2).unwrap();
    let mut s = good.clone();
    remove_where(&mut s, 2, |a| *a == act(SendActivation, 0, 0));
    expect_invalid(&s, "rank 0 waits at RECV_F0.c1 for rank 2");
    // Rank 1's chunk 0 (virtual stage 1) takes its output gradient from rank 2's chunk 0.
    let mut s = good.clone();
    remove_where(&mut s, 2, |a| *a == act(SendGradient, 0, 0));
    expect_invalid(&s, "rank 1 waits at RECV_B0 for rank 2");
    // Rank 2's chunk 0 (virtual stage 2) takes its output gradient from rank 0's chunk 1.
    let mut s = good.clone();
    remove_where(&mut s, 0, |a| *a == act(SendGradient, 0, 1));
    expect_invalid(&s, "rank 2 waits at RECV_B0 for rank 0");

    // A deadlock where another rank has finished its list: 2 stages, 1 micro-batch, the last
    // stage's gradient never sent.
    let mut s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
    remove(&mut s, 1, SendGradient, 0);
    expect_invalid(&s, "deadlock: rank 0 waits at RECV_B0 for rank 1");
}

/// A virtual stage past the first ranks that never runs a micro-batch (an evaluation schedule
/// whose last virtual stage skips micro-batch 1: no message is left, only the work) is named.
#[test]
fn the_validator_names_a_virtual_stage_that_skips_a_micro_batch() {
    let mut s = PipelineSchedule::forward_only(3, 2, 2).unwrap();
    use ActionKind::*;
    // Virtual stage 5 is rank 2's chunk 1, fed by virtual stage 4, rank 1's chunk 1.
    for (r, a) in [
        (2, act(RecvActivation, 1, 1)),
        (2, act(Forward, 1, 1)),
        (1, act(SendActivation, 1, 1)),
    ] {
        let i = s.ranks[r].iter().position(|x| *x == a).unwrap();
        s.ranks[r].remove(i);
    }
    expect_invalid(
        &s,
        "micro-batch 1 does not run forward and backward on virtual stage 5",
    );

    // An empty schedule (no micro-batch) is valid, with no idle time rather than 0 / 0.
    let empty = PipelineSchedule {
        kind: ScheduleKind::GPipe,
        stages: 2,
        micro_batches: 0,
        chunks: 1,
        ranks: vec![Vec::new(); 2],
        forward_only: false,
    };
    let stats = empty.validate().unwrap();
    assert_eq!(stats.makespan, 0.0);
    assert_eq!(stats.bubble, [0.0, 0.0]);
}

#[test]
fn forward_only_needs_a_stage_a_micro_batch_and_a_chunk() {
    for (p, m, v) in [(0, 1, 1), (1, 0, 1), (1, 1, 0)] {
        let err = PipelineSchedule::forward_only(p, m, v)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("at least one stage, micro-batch and chunk"),
            "{p} {m} {v}: {err}"
        );
    }
}

/// The whole timetable of 1F1B on 2 stages and 2 micro-batches, worked by hand with forward 1
/// and backward 2: rank 0 runs F0 F1 (its limit of 2 in flight), waits for B0's gradient (rank
/// 1: F0 at 1, B0 at 2-3), runs B0 at 4-5, idles, B1 at 7-8 (rank 1: F1 at 4, B1 at 5-6).
/// 6 of 9 units busy on each rank: 33.3% idle, the formula's 1 / 3.
#[test]
fn the_timetable_of_a_small_schedule_is_exact() {
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let want = "\
1f1b schedule: 2 stages x 2 micro-batches x 1 chunk(s) per rank (forward 1 time unit, backward 2)
rank 0: F0 F1 .  .  B0 -  .  B1 -   | peak 2 in flight, idle 33.3%
rank 1: .  F0 B0 -  F1 B1 -  .  .   | peak 1 in flight, idle 33.3%
bubble: 33.3% of the step (mean over ranks); formula (p-1)/(v*m+p-1) = 33.3%
";
    assert_eq!(s.render().unwrap(), want);
    let stats = s.validate().unwrap();
    assert_eq!(stats.makespan, 9.0);
    assert_eq!(stats.peak_in_flight, [2, 1]);
    // The schedule kinds' names, as `--pp-schedule` takes them.
    let names: Vec<String> = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    assert_eq!(names, ["gpipe", "1f1b", "interleaved"]);
    // Virtual stages: chunk c of rank r is c · p + r.
    let s = PipelineSchedule::new(ScheduleKind::Interleaved, 3, 3, 2).unwrap();
    assert_eq!(s.virtual_stages(), 6);
    assert_eq!(s.virtual_stage(2, 1), 5);
    assert_eq!(s.virtual_stage(1, 0), 1);
}

/// Megatron-LM's interleaved 1F1B order of rank `r`
/// (`forward_backward_pipelining_with_interleaving`):
/// virtual micro-batch `k` is micro-batch `(k / (p v)) p + k % p` on chunk `(k % (p v)) / p`
/// (reversed for backwards); `2 (p - r - 1) + (v - 1) p` warm-up forwards (at most `m v`), then
/// one forward and one backward, then the remaining backwards.
fn megatron_interleaved(p: usize, m: usize, v: usize, r: usize) -> Vec<String> {
    let total = m * v;
    let warmup = (2 * (p - r - 1) + (v - 1) * p).min(total);
    let at = |k: usize, forward: bool| {
        let c = (k % (p * v)) / p;
        let mb = (k / (p * v)) * p + k % p;
        if forward {
            Action {
                kind: ActionKind::Forward,
                micro_batch: mb,
                chunk: c,
            }
        } else {
            Action {
                kind: ActionKind::Backward,
                micro_batch: mb,
                chunk: v - 1 - c,
            }
        }
        .to_string()
    };
    let mut out: Vec<String> = (0..warmup).map(|k| at(k, true)).collect();
    for i in 0..total - warmup {
        out.push(at(warmup + i, true));
        out.push(at(i, false));
    }
    out.extend((total - warmup..total).map(|k| at(k, false)));
    out
}

/// With `m` a multiple of `p` (here up to `2 p`), the interleaved schedule's compute order on
/// every rank is Megatron's, and each rank's peak of activations in flight is its warm-up plus
/// one. (With more groups of `p` micro-batches the list scheduler can start a later group's
/// forward sooner than Megatron, e.g. p=4, m=16, v=3: the orders differ, the peaks do not.)
#[test]
fn interleaved_order_is_megatrons() {
    for (p, m, v) in [
        (2, 4, 2),
        (4, 8, 2),
        (4, 4, 2),
        (3, 6, 3),
        (2, 2, 4),
        (4, 16, 3),
    ] {
        let s = PipelineSchedule::new(ScheduleKind::Interleaved, p, m, v).unwrap();
        let stats = s.validate().unwrap();
        for r in 0..p {
            let warmup = 2 * (p - r - 1) + (v - 1) * p;
            assert_eq!(
                stats.peak_in_flight[r],
                (warmup + 1).min(m * v),
                "p={p} m={m} v={v} rank {r}"
            );
            if m > 2 * p {
                continue;
            }
            let got: Vec<String> = s.ranks[r]
                .iter()
                .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
                .map(|a| a.to_string())
                .collect();
            assert_eq!(
                got,
                megatron_interleaved(p, m, v, r),
                "p={p} m={m} v={v} rank {r}"
            );
        }
    }
}

/// The 1F1B rule on an interleaved schedule, worked by hand: 3 ranks x 2 chunks, 2
/// micro-batches (one round of 2: limits 7, 5 and 3). The forwards fill the pipe one unit
/// apart: rank 2 runs F0.c1, the last virtual stage, at 5, and at 6 both its backward B0.c1
/// and the forward F1.c1 (input from rank 1 at 6) are ready; the backward goes first (after a
/// forward, and rank 2 holds its limit of 3), then F1.c1 at 8 (after a backward a forward goes
/// first), B1.c1 at 9.
#[test]
fn after_a_forward_a_ready_backward_goes_first() {
    let s = PipelineSchedule::new(ScheduleKind::Interleaved, 3, 2, 2).unwrap();
    let got: Vec<String> = s.ranks[2]
        .iter()
        .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
        .map(|a| a.to_string())
        .collect();
    assert_eq!(
        got,
        ["F0", "F1", "F0.c1", "B0.c1", "F1.c1", "B1.c1", "B0", "B1"]
    );
}

/// Stages of unequal cost: equal weights give the unit-cost run whatever their scale; two
/// stages and one micro-batch by hand (forward 1 then `w`, backward `2w` then 2: a makespan of
/// `3 + 3w`, rank 0 idle `3w` of it, rank 1 idle 3); a slower stage adds idle time; bad costs
/// are clear errors.
#[test]
fn weighted_stages_by_hand() {
    for (kind, p, m, v) in [
        (ScheduleKind::OneFOneB, 4, 8, 1),
        (ScheduleKind::GPipe, 3, 5, 1),
        (ScheduleKind::Interleaved, 2, 6, 2),
    ] {
        let s = PipelineSchedule::new(kind, p, m, v).unwrap();
        let unit = s.validate().unwrap();
        let scaled = s.validate_weighted(&vec![2.5; p * v]).unwrap();
        assert_eq!(scaled.makespan, 2.5 * unit.makespan, "{kind:?}");
        for (a, b) in scaled.bubble.iter().zip(&unit.bubble) {
            assert!((a - b).abs() <= 1e-12, "{kind:?}: {a} vs {b}");
        }
    }
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
    let w = s.validate_weighted(&[1.0, 2.0]).unwrap();
    assert_eq!(w.makespan, 9.0);
    assert!((w.bubble[0] - 2.0 / 3.0).abs() <= 1e-15, "{:?}", w.bubble);
    assert!((w.bubble[1] - 1.0 / 3.0).abs() <= 1e-15, "{:?}", w.bubble);
    let s = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 8, 1).unwrap();
    let even = s.validate().unwrap().mean_bubble();
    let uneven = s.validate_weighted(&[1.0, 1.3]).unwrap().mean_bubble();
    assert!(uneven > even + 0.05, "{uneven} vs {even}");
    let e = |c: &[f64]| s.validate_weighted(c).unwrap_err().to_string();
    assert!(e(&[1.0]).contains("1 stage costs for 2 virtual stages"));
    assert!(e(&[1.0, 0.0]).contains("finite and positive"));
    assert!(e(&[1.0, f64::NAN]).contains("finite and positive"));
}

/// `--pp-layers auto` against Llama 3's even split, simulated with each virtual stage's FLOPs:
/// the benchmark model of docs/benchmarks.md (8 layers, a head of 0.57 layers, pp 2) and a
/// Llama-3-8B shape (32 layers, a head of 2.4 layers, pp 4). The auto split's step is never
/// longer; under 1F1B on the Llama 3 shape it is shorter (its last stage drops from 7 layers and
/// the head to 6 and the head). Where the splits agree (8 layers on 2 ranks) they are the same
/// run. Interleaved on the benchmark model, the auto split's chunks are even (2, 2, 2, 2 and the
/// head against 2, 3, 2, 1 and the head) but each rank's total is the same (4 layers, and 4 and
/// the head), and at these micro-batch counts the ranks' totals set the step.
#[test]
fn the_auto_split_shortens_the_simulated_step() {
    use candle_parallel::pipeline::{split_by_cost, split_layers, StageCosts};
    let bench = StageCosts {
        first: 0.0,
        layers: vec![1.0; 8],
        last: 0.57,
    };
    let llama3 = StageCosts {
        first: 0.0,
        layers: vec![1.0; 32],
        last: 2.4,
    };
    for (name, costs, p, v, kind) in [
        ("bench 1f1b", &bench, 2, 1, ScheduleKind::OneFOneB),
        ("bench interleaved", &bench, 2, 2, ScheduleKind::Interleaved),
        ("llama3 1f1b", &llama3, 4, 1, ScheduleKind::OneFOneB),
        (
            "llama3 interleaved",
            &llama3,
            4,
            2,
            ScheduleKind::Interleaved,
        ),
    ] {
        let auto = split_by_cost(costs, p * v).unwrap();
        let even = split_layers(costs.layers.len(), p * v, None).unwrap();
        for m in [4, 8, 16] {
            let s = PipelineSchedule::new(kind, p, m, v).unwrap();
            let run =
                |split: &[std::ops::Range<usize>]| s.validate_weighted(&costs.of(split)).unwrap();
            let (a, e) = (run(&auto), run(&even));
            if auto == even {
                assert_eq!(a, e, "{name} m={m}");
            }
            assert!(
                a.makespan <= e.makespan,
                "{name} m={m}: {} vs {}",
                a.makespan,
                e.makespan
            );
            if name == "llama3 1f1b" {
                assert!(
                    a.makespan < e.makespan,
                    "{name} m={m}: {} vs {}",
                    a.makespan,
                    e.makespan
                );
                // The same work in a shorter step: less idle time.
                assert!(a.mean_bubble() < e.mean_bubble(), "{name} m={m}");
            }
        }
    }
}

/// Megatron's 1F1B on rank `r` of `p` for any `m`: `min(p - r - 1, m)` warm-up forwards, then
/// one forward and one backward at a time, then the remaining backwards.
fn megatron_one_f_one_b(p: usize, m: usize, r: usize) -> Vec<String> {
    let warmup = (p - r - 1).min(m);
    let mut out: Vec<String> = (0..warmup).map(|k| format!("F{k}")).collect();
    for i in 0..m - warmup {
        out.push(format!("F{}", warmup + i));
        out.push(format!("B{i}"));
    }
    out.extend((m - warmup..m).map(|k| format!("B{k}")));
    out
}

/// With one chunk the generated 1F1B order is Megatron's on every rank for every number of
/// micro-batches, multiples of `p` or not, fewer than `p` included (Megatron's 1F1B does not
/// need `m` to be a multiple of `p`; only its interleaved schedule does).
#[test]
fn one_f_one_b_order_is_megatrons_for_any_micro_batches() {
    for p in 1..=6 {
        for m in 1..=13 {
            let s = PipelineSchedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap();
            for r in 0..p {
                let got: Vec<String> = s.ranks[r]
                    .iter()
                    .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
                    .map(|a| a.to_string())
                    .collect();
                assert_eq!(got, megatron_one_f_one_b(p, m, r), "p={p} m={m} rank {r}");
            }
        }
    }
}

/// For every `m >= p` (multiple of `p` or not) and every rank, the interleaved schedule idles
/// exactly the formula `(p - 1) / (v m + p - 1)` of the step, and holds at most its warm-up plus
/// one activations: `2 (p - r - 1) + (v - 1) g + 1`, with `g` the longest round
/// (`ceil(m / max(1, m / p))`), or all `m v`.
#[test]
fn interleaved_bubble_is_the_formula_for_every_m_from_p() {
    for p in 2..=6 {
        for m in p..=3 * p + 1 {
            for v in 2..=4 {
                let s = PipelineSchedule::new(ScheduleKind::Interleaved, p, m, v).unwrap();
                let stats = s.validate().unwrap();
                let (got, want) = (stats.mean_bubble(), s.bubble_formula());
                assert!(
                    (got - want).abs() < 1e-12,
                    "p={p} m={m} v={v}: bubble {got} vs formula {want}"
                );
                let longest = m.div_ceil((m / p).max(1));
                for r in 0..p {
                    let bound = (2 * (p - r - 1) + (v - 1) * longest + 1).min(m * v);
                    assert!(
                        stats.peak_in_flight[r] <= bound,
                        "p={p} m={m} v={v} rank {r}: peak {} above {bound}",
                        stats.peak_in_flight[r]
                    );
                }
            }
        }
    }
}

/// One compute-order name in torch's notation (`F3`, `B3.c1`) as an [`Action`].
fn parse_action(name: &str) -> Action {
    let kind = match name.as_bytes().first() {
        Some(b'F') => ActionKind::Forward,
        Some(b'B') => ActionKind::Backward,
        _ => panic!("not a compute action: {name}"),
    };
    let rest = &name[1..];
    let (mb, chunk) = match rest.split_once(".c") {
        Some((mb, c)) => (mb, c.parse().expect("chunk")),
        None => (rest, 0),
    };
    act(kind, mb.parse().expect("micro-batch"), chunk)
}

/// PyTorch's `ScheduleInterleaved1F1B` (torchtitan's interleaved schedule, flexible rounds) for
/// every (p, m, v) it accepts with p <= 6, m <= 13, v <= 3 (100 cases, from
/// `scripts/make_pipeline_fixtures.py`), run through our validator like ours: the same bubble and
/// the same activation peak on every rank, and the same orders wherever the step is one round
/// (`m < 2 p`). With several rounds our list scheduler may start a later round's forward a slot
/// sooner (6 of the cases: p=4, m=12), at the same bubble and peaks.
#[test]
fn interleaved_matches_pytorch_flexible_rounds() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/pipeline/torch_interleaved.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let fixture: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let cases = fixture["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 100);
    let (mut same_orders, mut not_multiple) = (0, 0);
    for case in cases {
        let n = |k: &str| case[k].as_u64().expect(k) as usize;
        let (p, m, v) = (n("p"), n("m"), n("v"));
        let what = format!("p={p} m={m} v={v}");
        let orders: Vec<Vec<Action>> = case["orders"]
            .as_array()
            .expect("orders")
            .iter()
            .map(|o| {
                o.as_array()
                    .expect("order")
                    .iter()
                    .map(|a| parse_action(a.as_str().expect("action")))
                    .collect()
            })
            .collect();
        let torch =
            PipelineSchedule::from_compute_orders(ScheduleKind::Interleaved, p, m, v, &orders)
                .unwrap_or_else(|e| panic!("{what}: torch's order: {e}"));
        let ours = PipelineSchedule::new(ScheduleKind::Interleaved, p, m, v).unwrap();
        let (t, o) = (torch.validate().unwrap(), ours.validate().unwrap());
        assert!(
            (o.mean_bubble() - t.mean_bubble()).abs() < 1e-12,
            "{what}: bubble {} vs torch's {}",
            o.mean_bubble(),
            t.mean_bubble()
        );
        assert_eq!(o.peak_in_flight, t.peak_in_flight, "{what}: peaks");
        not_multiple += usize::from(m % p != 0);
        let compute = |s: &PipelineSchedule, r: usize| -> Vec<Action> {
            s.ranks[r]
                .iter()
                .copied()
                .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
                .collect()
        };
        let equal = (0..p).all(|r| compute(&ours, r) == compute(&torch, r));
        if m < 2 * p {
            assert!(equal, "{what}: one round, orders differ from torch's");
        }
        same_orders += usize::from(equal);
    }
    assert_eq!(same_orders, 94);
    assert!(
        not_multiple >= 20,
        "{not_multiple} cases with m not a multiple of p"
    );
}

/// A schedule from given compute orders: communication added and validated; orders that
/// deadlock, hold communication, or miss a rank are clear errors.
#[test]
fn schedules_from_compute_orders_are_validated() {
    let f = |mb| act(ActionKind::Forward, mb, 0);
    let b = |mb| act(ActionKind::Backward, mb, 0);
    let good = vec![vec![f(0), f(1), b(0), b(1)], vec![f(0), b(0), f(1), b(1)]];
    let s = PipelineSchedule::from_compute_orders(ScheduleKind::OneFOneB, 2, 2, 1, &good).unwrap();
    assert_eq!(
        s,
        PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap()
    );
    let err = |orders: &[Vec<Action>]| {
        PipelineSchedule::from_compute_orders(ScheduleKind::OneFOneB, 2, 2, 1, orders)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&good[..1]).contains("1 compute orders for 2 stages"));
    let mut comm = good.clone();
    comm[1].insert(0, act(ActionKind::RecvActivation, 0, 0));
    assert!(err(&comm).contains("only forwards and backwards"));
    // Rank 0 runs the backward of micro-batch 1 before its forward.
    let stuck = vec![vec![f(0), b(0), b(1), f(1)], good[1].clone()];
    assert!(err(&stuck).contains("cannot run"));
}

/// Uneven rounds put the longer first: 5 micro-batches on 2 ranks make rounds of 3 and 2, so
/// rank 0 runs round 0's three forwards on chunk 0 and then on chunk 1 before round 1 starts
/// (rounds of 2 and 3 would start chunk 1 after F1); 7 on 3 ranks: rounds of 4 and 3.
#[test]
fn uneven_rounds_put_the_longer_round_first() {
    for (p, m, first_round) in [(2, 5, 3), (3, 7, 4)] {
        let s = PipelineSchedule::new(ScheduleKind::Interleaved, p, m, 2).unwrap();
        let got: Vec<String> = s.ranks[0]
            .iter()
            .filter(|a| matches!(a.kind, ActionKind::Forward | ActionKind::Backward))
            .take(2 * first_round)
            .map(|a| a.to_string())
            .collect();
        let want: Vec<String> = (0..first_round)
            .map(|mb| format!("F{mb}"))
            .chain((0..first_round).map(|mb| format!("F{mb}.c1")))
            .collect();
        assert_eq!(got, want, "p={p} m={m}");
    }
}
