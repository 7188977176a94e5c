//! Fine-tuning under every parallel layout against the single-rank run.
//!
//! LoRA SFT (packed examples with document masks, loss on the reply tokens only), full SFT, and
//! LoRA DPO, 3 AdamW steps each on the `gqa` fixture, also pipelined (pp2, pp2 × ring2; DPO's
//! reference runs forward through the same stages): every layout gives the same loss at every
//! step as one rank (1e-5 relative, f32) and the same final trained weights (1e-5 relative per
//! tensor, tensor-parallel slices gathered). One example has a long prompt whose few trained
//! tokens all land on one rank of the ring layouts: the loss is normalised by the global count
//! of trained tokens, so the ranks without any still agree. The adapters start from random
//! non-zero `A` and `B` (PEFT starts `B` at zero, which would leave `A`'s gradient zero in the
//! first step and hide a wrong `A` gradient).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::Strategy;
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::{Adapters, LoraConfig, LoraTargets, ParamMode, TensorMap};
use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule, ZeroStage};
use candle_parallel::pipeline::ScheduleKind;
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_bf16_follows, assert_bf16_follows_scalar, assert_identical, fixture_files,
    random_matrix, rel_err, whole_weights, Layout,
};
use models::llama;
use testkit::assert_identical_scalars;
use train::finetune::{
    DpoConfig, DpoTrainer, Example, Overlong, PairDataset, Reference, SftDataset, SftOptions,
};
use train::trainer::{PipelineConfig, TrainConfig, Trainer};

const TOL: f64 = 1e-5;
const SEQ: usize = 32;
const STEPS: u64 = 3;

fn config(batch: usize, grad_accum: usize, memory: MemoryPlan) -> TrainConfig {
    TrainConfig {
        seq_len: SEQ,
        steps: STEPS,
        batch,
        grad_accum,
        doc_mask: true,
        seed: 11,
        shuffle: true,
        adamw: AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        schedule: LrSchedule {
            peak_lr: 1e-2,
            min_lr: 1e-3,
            warmup_steps: 1,
            total_steps: STEPS,
            decay: Decay::Cosine,
        },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: 16,
        memory,
        pipeline: None,
        seq_len_schedule: None,
    }
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: LoraTargets::AllLinear,
        use_rslora: false,
        seed: 5,
        target_parameters: Vec::new(),
        alpha_pattern: Default::default(),
        rank_pattern: Default::default(),
    }
}

/// Random non-zero adapters for every linear layer of the `gqa` fixture (hidden 32, q 64, kv
/// 16, intermediate 64, 2 layers), as a source the model reads them from.
fn random_adapters() -> Arc<Adapters> {
    let r = 4;
    let mut t = HashMap::new();
    let shapes = [
        ("self_attn.q_proj", 64, 32),
        ("self_attn.k_proj", 16, 32),
        ("self_attn.v_proj", 16, 32),
        ("self_attn.o_proj", 32, 64),
        ("mlp.gate_proj", 64, 32),
        ("mlp.up_proj", 64, 32),
        ("mlp.down_proj", 32, 64),
    ];
    let dev = Device::Cpu;
    let mut seed = 100u64;
    for l in 0..2 {
        for (name, out, inp) in shapes {
            let p = format!("model.layers.{l}.{name}");
            seed += 1;
            t.insert(
                format!("{p}.lora_A.weight"),
                random_matrix(r, inp, seed, &dev),
            );
            t.insert(
                format!("{p}.lora_B.weight"),
                random_matrix(out, r, seed + 1000, &dev),
            );
        }
    }
    Adapters::new(
        lora_config(),
        Some(Arc::new(TensorMap::new(t, "test adapters"))),
    )
    .unwrap()
}

/// Chat-like examples: a prompt (not trained) then a reply (trained). The last one has a
/// 28-token prompt and a 4-token reply: in a window of its own (32 tokens) its trained tokens
/// fall in one chunk of the sequence layouts.
fn examples() -> Vec<Example> {
    let mut out = cpl_integration_tests::prompt_reply_examples(0xF1_7E, 14, 256);
    let long = testkit::random_docs(0xB16, 1, 32..33, 256).remove(0);
    out.push(Example {
        trained: (0..32).map(|j| j >= 28).collect(),
        ids: long,
    });
    out
}

fn sft_data(packing: bool) -> SftDataset {
    let opts = SftOptions {
        seq_len: SEQ,
        packing,
        overlong: Overlong::Truncate,
        pad_id: 0,
    };
    SftDataset::new(&examples(), &opts, 256).unwrap().0
}

fn pair_data() -> PairDataset {
    let prompts = testkit::random_docs(0xD90, 6, 3..12, 256);
    let replies = testkit::random_docs(0xD91, 12, 2..16, 256);
    let side = |p: &Vec<u32>, r: &Vec<u32>| Example {
        ids: p.iter().chain(r).copied().collect(),
        trained: p
            .iter()
            .map(|_| false)
            .chain(r.iter().map(|_| true))
            .collect(),
    };
    let pairs: Vec<(Example, Example)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (side(p, &replies[2 * i]), side(p, &replies[2 * i + 1])))
        .collect();
    let opts = SftOptions {
        seq_len: SEQ,
        packing: false,
        overlong: Overlong::Truncate,
        pad_id: 0,
    };
    PairDataset::new(&pairs, &opts, 256).unwrap().0
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Job {
    LoraSft,
    FullSft,
    LoraDpo,
}

struct Run {
    losses: Vec<f64>,
    /// Global gradient norm of every step (before clipping): Adam's update hides a gradient's
    /// scale, the norm does not.
    norms: Vec<f64>,
    weights: HashMap<String, Tensor>,
}

fn run(layout: &Layout, memory: MemoryPlan, job: Job) -> Run {
    run_with(
        layout,
        memory,
        job,
        DType::F32,
        config(1, 1, memory).adamw.eps,
    )
}

/// [`run`] with the model's parameters (and activations) in `dtype` and AdamW's `eps`.
fn run_with(layout: &Layout, memory: MemoryPlan, job: Job, dtype: DType, adam_eps: f64) -> Run {
    let dp = layout.mesh.degree(Dim::Dp);
    let pp = layout.mesh.pp;
    let mut cfg = config(1, 2 / dp, memory);
    cfg.adamw.eps = adam_eps;
    if pp > 1 {
        // One decoder layer per stage of the 2-layer fixture.
        cfg.pipeline = Some(PipelineConfig {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            layers: vec![1; pp],
        });
    }
    let files = fixture_files("gqa");
    let sft = sft_data(true);
    let pairs = pair_data();
    let mut results = LocalWorld::run(layout.ranks, |world| -> Result<Run, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world.clone())?;
        let adapters = (job != Job::FullSft).then(random_adapters);
        // This rank's pipeline stage: its layers, and the ends on the first and last stage.
        let r = mesh.coord(Dim::Pp);
        let layers = match &cfg.pipeline {
            Some(pc) => vec![pc.ranges()[r].clone()],
            None => std::iter::once(0..2).collect(),
        };
        let m = llama::load_stage_adapted(
            &files,
            &ctx,
            Some(dtype),
            ParamMode::Trainable,
            &layers,
            r == 0 || r + 1 == pp,
            adapters.clone(),
        )
        .map_err(|x| e(&x))?;
        let model: Box<dyn models::CausalLm> = Box::new(m.model);
        let t = Trainer::new(model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        let mut losses = Vec::new();
        let mut norms = Vec::new();
        let t = match job {
            Job::LoraSft | Job::FullSft => {
                let mut t = t;
                while t.step < STEPS {
                    let s = t.step(&sft).map_err(|x| e(&x))?;
                    losses.push(s.loss);
                    norms.push(s.grad_norm);
                }
                t
            }
            Job::LoraDpo => {
                let reference = Reference::BaseOfAdapters(adapters.clone().unwrap());
                let mut d =
                    DpoTrainer::new(t, reference, DpoConfig { beta: 0.5 }).map_err(|x| e(&x))?;
                while d.trainer.step < STEPS {
                    let s = d.step(&pairs).map_err(|x| e(&x))?;
                    assert!(s.accuracy >= 0.0 && s.accuracy <= 1.0);
                    losses.push(s.stats.loss);
                    norms.push(s.stats.grad_norm);
                }
                d.trainer
            }
        };
        let weights = whole_weights(&t, &mesh)?;
        Ok(Run {
            losses,
            norms,
            weights,
        })
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // Every rank's weights: ranks holding a parameter (pipeline stages hold different ones;
    // a parameter both ends hold) have the same copy.
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    for (r, other) in results.iter().enumerate() {
        let who = format!("{}: rank {r} vs rank 0", layout.name);
        assert_identical_scalars(&other.losses, &results[0].losses, &who);
        assert_identical_scalars(&other.norms, &results[0].norms, &who);
        for (n, w) in &other.weights {
            if let Some(prev) = weights.insert(n.clone(), w.clone()) {
                assert_identical(&prev, w, &format!("{who}: copies of {n}"));
            }
        }
    }
    let mut first = results.swap_remove(0);
    first.weights = weights;
    first
}

fn assert_same(name: &str, got: &Run, want: &Run) {
    assert_eq!(got.losses.len(), want.losses.len(), "{name}");
    for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
        testkit::assert_close_scalar(*a, *b, TOL, &format!("{name}: step {i}: loss"));
    }
    for (i, (a, b)) in got.norms.iter().zip(&want.norms).enumerate() {
        testkit::assert_close_scalar(*a, *b, TOL, &format!("{name}: step {i}: gradient norm"));
    }
    assert_eq!(
        got.weights.len(),
        want.weights.len(),
        "{name}: trained parameters"
    );
    for (n, w) in &want.weights {
        let e = rel_err(&got.weights[n], w);
        assert!(e <= TOL, "{name}: final weight {n}: rel err {e}");
    }
}

fn layouts() -> Vec<(Layout, MemoryPlan)> {
    let plain = MemoryPlan::default();
    let zero3 = MemoryPlan {
        zero: ZeroStage::Parameters,
        zero_group: None,
        checkpointing: Checkpointing::Full,
    };
    let zero2 = MemoryPlan {
        zero: ZeroStage::Gradients,
        zero_group: None,
        checkpointing: Checkpointing::Selective,
    };
    vec![
        (Layout::new("tp2", 2, 1, 1, Strategy::Ring), plain),
        (
            Layout::new("tp2 + tp-sp", 2, 1, 1, Strategy::Ring).with_tp_sp(),
            plain,
        ),
        (Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring), plain),
        (
            Layout::new("ulysses2 x ring2 (usp)", 1, 2, 2, Strategy::Usp),
            plain,
        ),
        (
            Layout::new(
                "ring2 x dp2, ZeRO-3, full checkpointing",
                1,
                1,
                2,
                Strategy::Ring,
            )
            .with_dp(2),
            zero3,
        ),
        (
            Layout::new(
                "tp2 x dp2, ZeRO-2, selective checkpointing",
                2,
                1,
                1,
                Strategy::Ring,
            )
            .with_dp(2),
            zero2,
        ),
        // Pipelines: the stages' losses, gradient norms (parameters of the two ends counted
        // once) and weights, and for DPO the reference's forward through the same stages.
        (Layout::single().with_pp(2), plain),
        (
            Layout::new("pp2 x ring2", 1, 1, 2, Strategy::Ring).with_pp(2),
            plain,
        ),
    ]
}

fn check_job(job: Job) {
    let want = run(&Layout::single(), MemoryPlan::default(), job);
    assert!(want.losses.iter().all(|l| l.is_finite() && *l > 0.0));
    assert!(
        (want.losses[0] - want.losses[STEPS as usize - 1]).abs() > 1e-4,
        "training changed nothing: {:?}",
        want.losses
    );
    for (layout, memory) in layouts() {
        let got = run(&layout, memory, job);
        assert_same(layout.name, &got, &want);
    }
}

/// Only the adapters train under LoRA: 2 layers x 7 linear layers x (A, B).
#[test]
fn lora_trains_only_the_adapters() {
    let want = run(&Layout::single(), MemoryPlan::default(), Job::LoraSft);
    assert_eq!(want.weights.len(), 28);
    assert!(want
        .weights
        .keys()
        .all(|n| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight")));
}

#[test]
fn lora_sft_under_every_layout_equals_one_rank() {
    check_job(Job::LoraSft);
}

#[test]
fn full_sft_under_every_layout_equals_one_rank() {
    check_job(Job::FullSft);
}

#[test]
fn lora_dpo_under_every_layout_equals_one_rank() {
    check_job(Job::LoraDpo);
}

/// bf16 LoRA SFT and LoRA DPO: a tp2 x ring2 run follows the one-rank bf16 run. The two bf16
/// runs round their reductions in different orders, so they differ by about as much as bf16
/// differs from f32 (the argument of the zoo's bf16 test, `tests/zoo.rs`), provided the update
/// is Lipschitz in the gradient. AdamW's first update, `lr·g/(|g|+eps)`, is `lr·sign(g)` with the
/// default eps of 1e-8: a component whose sign bf16's rounding decides then moves by 2·lr
/// between two runs, a jump no rounding argument bounds (measured on DPO's third step: the two
/// bf16 runs 4.8e-2 apart, the one-rank run 1.2e-2 from f32). So these runs take eps = 1e-3,
/// 7% of the clipped gradient's RMS component (norm 1 over 4608 adapter weights: 1.5e-2): the
/// typical component still moves by about lr, the ones near zero by at most lr·|g|/eps. Asserted are every
/// step's loss within 1e-2 (the loss is summed in f32 from bf16 logits) or, for DPO, whose
/// loss comes from differences of log-likelihoods that cancel, within 1.5x the largest distance
/// of the one-rank bf16 loss to f32 over the steps, absolutely (see the test); every step's gradient norm and every final adapter no further from the one-rank bf16 run than 1.5x that run's own
/// distance to f32 (floored at 5e-2); a lost term (a shard, a ring step, a mask block, the
/// reference's forward) moves them by far more.
#[test]
fn lora_sft_and_dpo_in_bf16_follow_their_one_rank_run() {
    const LIPSCHITZ_EPS: f64 = 1e-3;
    let plain = MemoryPlan::default();
    let layout = Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring);
    for job in [Job::LoraSft, Job::LoraDpo] {
        let f32_run = run_with(&Layout::single(), plain, job, DType::F32, LIPSCHITZ_EPS);
        let want = run_with(&Layout::single(), plain, job, DType::BF16, LIPSCHITZ_EPS);
        let got = run_with(&layout, plain, job, DType::BF16, LIPSCHITZ_EPS);
        let case = format!("{job:?} bf16 {}", layout.name);
        assert_eq!(got.losses.len(), STEPS as usize, "{case}");
        // DPO's loss `-log σ(z)` comes from `z`, differences of summed log-likelihoods, which
        // cancel: its bf16 error is `σ(-z) |δz|`, where `δz`, the rounding of the
        // log-likelihoods, is absolute (their size does not change over three steps) and
        // `σ(-z) <= 1`. So each step's two bf16 losses may differ by 1.5x the largest own
        // distance to f32 of the one-rank bf16 loss over the steps (at step 0, the loss near 8,
        // `σ(-z)` is about 1 and `|δz|` shows whole), not by a share of a loss that falls
        // tenfold. Measured (Zen 4 EPYC, bf16 dot products): at step 2 the two bf16 runs 0.024
        // apart at 0.78, the one-rank run 0.012 from f32 there and 0.060 at step 0.
        let own: Vec<f64> = (0..STEPS as usize)
            .map(|i| want.losses[i] - f32_run.losses[i])
            .collect();
        let dpo_scale = testkit::max_abs_values(&own);
        for i in 0..STEPS as usize {
            let (g, w, f) = (got.losses[i], want.losses[i], f32_run.losses[i]);
            let what = format!("{case}: step {i}: loss");
            if job == Job::LoraDpo {
                // NaN-aware: a NaN scale or loss makes the bound NaN, and the check fail.
                let bound = 1.5 * testkit::max_or_nan(dpo_scale, 1e-2 / 1.5 * w.abs());
                assert!(
                    g.is_finite() && (g - w).abs() <= bound,
                    "{what}: {g} against one bf16 rank's {w}, whose largest distance to f32 over \
                     the steps is {dpo_scale:.3e} (bound 1.5x that)"
                );
            } else {
                assert_bf16_follows_scalar(g, w, f, 1e-2 / 1.5, &what);
            }
            let (g, w, f) = (got.norms[i], want.norms[i], f32_run.norms[i]);
            let what = format!("{case}: step {i}: gradient norm");
            assert_bf16_follows_scalar(g, w, f, 5e-2, &what);
        }
        assert_eq!(got.weights.len(), want.weights.len(), "{case}: adapters");
        for (n, w) in &want.weights {
            let what = format!("{case}: final {n}");
            assert_bf16_follows(&got.weights[n], w, &f32_run.weights[n], 5e-2, &what);
        }
    }
}

/// Packing examples into one window with document masks trains on the same tokens with the same
/// losses as one example per window: the first step's loss (before any update) is equal.
#[test]
fn packed_examples_have_their_own_losses() {
    let packed = sft_data(true);
    let single = sft_data(false);
    use train::data::Windows;
    assert!(packed.num_windows() < single.num_windows());
    let loss = |data: &SftDataset| -> f64 {
        let files = fixture_files("gqa");
        LocalWorld::run(1, |world| -> Result<f64, String> {
            let (mesh, ctx) = Layout::single().context(world)?;
            let m = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Trainable)
                .map_err(|e| e.to_string())?;
            let t = Trainer::new(m.model, &mesh, &ctx, config(1, 1, MemoryPlan::default()))
                .map_err(|e| e.to_string())?;
            let (l, _) = t.eval_loss(data, 1000).map_err(|e| e.to_string())?;
            Ok(l)
        })
        .unwrap()
        .remove(0)
    };
    let (a, b) = (loss(&packed), loss(&single));
    testkit::assert_close_scalar(a, b, TOL, "packed vs one per window: mean loss");
}
