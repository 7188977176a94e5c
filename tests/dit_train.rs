//! DiT training steps (the [`DiffusionTrainer`]) under layouts and memory plans against one
//! rank: losses of every step (1e-5 relative, f32) and the final weights (1e-5 relative, except
//! the attention key biases, whose exact gradient is 0: Adam turns both sides' rounding noise
//! into different updates, so they are only checked to stay finite); both objectives; data
//! parallelism with gradient accumulation; ZeRO 1, 2 and 3 with checkpointing; exact resume.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use candle_parallel::attention::Strategy;
use candle_parallel::comm::LocalWorld;
use candle_parallel::mesh::Dim;
use candle_parallel::nn::ParamMode;
use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule, ZeroStage};
use candle_parallel::pipeline::ScheduleKind;
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{
    assert_bf16_follows, assert_bf16_follows_scalar, assert_identical, rel_err, whole_weights,
    Layout,
};
use models::dit;
use models::dit::loss::Objective;
use testkit::assert_close_scalar;
use train::diffusion::{DiffusionConfig, DiffusionTrainer};
use train::images::{ImageDataset, ImageOptions};
use train::trainer::{PipelineConfig, TrainConfig, Trainer};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/dit/tiny")
}

/// 24 random 4x8x8 "latents" of 10 classes, written once as a safetensors file.
fn dataset() -> ImageDataset {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dit-train-latents.safetensors");
    let n = 24;
    let latents: Vec<f32> = (0..n * 4 * 64)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.9)
        .collect();
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 10).collect();
    let map = HashMap::from([
        (
            "latents".to_string(),
            Tensor::from_vec(latents, (n, 4, 8, 8), &Device::Cpu).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_vec(labels, n, &Device::Cpu).unwrap(),
        ),
    ]);
    // One temporary name per call: the tests of this binary run on threads of one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        "dit-train-latents.{}.{call}.tmp",
        std::process::id()
    ));
    candle_core::safetensors::save(&map, &tmp).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    ImageDataset::load(
        &path,
        &ImageOptions {
            channels: 4,
            size: 8,
        },
    )
    .unwrap()
}

fn config(steps: u64, memory: MemoryPlan, batch: usize, grad_accum: usize) -> TrainConfig {
    TrainConfig {
        seq_len: 0,
        steps,
        batch,
        grad_accum,
        doc_mask: false,
        seed: 7,
        shuffle: true,
        adamw: AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        schedule: LrSchedule {
            peak_lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 1,
            total_steps: steps,
            decay: Decay::Cosine,
        },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: 1024,
        memory,
        pipeline: None,
        seq_len_schedule: None,
    }
}

struct Run {
    losses: Vec<f64>,
    /// Global gradient norm of every step (before clipping): Adam's update is nearly blind to
    /// a gradient's scale, the norm is not.
    grad_norms: Vec<f64>,
    weights: HashMap<String, Tensor>,
}

/// `steps` steps of a 4-image global batch (dp x batch x grad-accum) under `layout`; with
/// pipeline stages (one block each) under `schedule`.
fn train(layout: &Layout, memory: MemoryPlan, objective: Objective, steps: u64) -> Run {
    train_with(layout, memory, objective, steps, ScheduleKind::OneFOneB)
}

fn train_with(
    layout: &Layout,
    memory: MemoryPlan,
    objective: Objective,
    steps: u64,
    schedule: ScheduleKind,
) -> Run {
    train_in(layout, memory, objective, steps, schedule, None)
}

/// [`train_with`] with the parameters in `dtype` (default: the checkpoint's, f32).
fn train_in(
    layout: &Layout,
    memory: MemoryPlan,
    objective: Objective,
    steps: u64,
    schedule: ScheduleKind,
    dtype: Option<candle_core::DType>,
) -> Run {
    let data = dataset();
    let files = dit::files(&fixture_dir()).unwrap();
    let dp = layout.mesh.degree(Dim::Dp);
    let pp = layout.mesh.pp;
    let mut cfg = config(steps, memory, 2, 2 / dp);
    if pp > 1 {
        cfg.pipeline = Some(PipelineConfig {
            schedule,
            virtual_stages: 1,
            layers: vec![1; pp],
        });
    }
    let dcfg = DiffusionConfig {
        objective,
        ..Default::default()
    };
    let out = LocalWorld::run(layout.ranks, |world| -> Result<_, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let (r, p) = (mesh.coord(Dim::Pp), pp);
        let ranges = match &cfg.pipeline {
            Some(pc) => vec![pc.ranges()[r].clone()],
            None => std::iter::once(0..2).collect(),
        };
        let ends = r == 0 || r == p - 1;
        let model = dit::load_stage(&files, &ctx, dtype, ParamMode::Trainable, &ranges, ends)
            .map_err(|x| e(&x))?
            .model;
        let trainer = Trainer::new(model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        let mut t = DiffusionTrainer::new(trainer, dcfg).map_err(|x| e(&x))?;
        let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
        while t.trainer.step < steps {
            let s = t.step(&data).map_err(|x| e(&x))?;
            assert!(s.mse > 0.0);
            losses.push(s.stats.loss);
            grad_norms.push(s.stats.grad_norm);
        }
        let weights = whole_weights(&t.trainer, &mesh)?;
        Ok((losses, weights, grad_norms))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // Every stage's weights (a parameter held by two stages: the two copies are equal).
    let mut weights = HashMap::new();
    for (i, (_, w, _)) in out.iter().enumerate() {
        for (n, t) in w {
            if let Some(prev) = weights.insert(n.clone(), t.clone()) {
                assert_identical(
                    &prev,
                    t,
                    &format!("{}: rank {i}: copies of {n}", layout.name),
                );
            }
        }
    }
    for (i, (l, _, g)) in out.iter().enumerate() {
        let who = format!("{}: rank {i}", layout.name);
        testkit::assert_identical_scalars(l, &out[0].0, &format!("{who} losses"));
        testkit::assert_identical_scalars(g, &out[0].2, &format!("{who} gradient norms"));
    }
    let (losses, grad_norms) = (out[0].0.clone(), out[0].2.clone());
    Run {
        losses,
        grad_norms,
        weights,
    }
}

fn compare(run: &Run, single: &Run, name: &str) {
    assert_eq!(run.losses.len(), single.losses.len(), "{name}: steps");
    for (i, (a, b)) in run.losses.iter().zip(&single.losses).enumerate() {
        assert_close_scalar(*a, *b, 1e-5, &format!("{name}: step {i} loss"));
    }
    for (i, (a, b)) in run.grad_norms.iter().zip(&single.grad_norms).enumerate() {
        assert_close_scalar(*a, *b, 1e-5, &format!("{name}: step {i} gradient norm"));
    }
    assert_eq!(run.weights.len(), single.weights.len(), "{name}");
    for (n, w) in &single.weights {
        testkit::assert_finite(&run.weights[n], &format!("{name}: {n}"));
        if n.ends_with("to_k.bias") {
            continue;
        }
        let e = rel_err(&run.weights[n], w);
        assert!(e <= 1e-5, "{name}: final weight {n}: rel err {e:e}");
    }
}

#[test]
fn training_steps_equal_one_rank() {
    let steps = 3;
    for objective in [Objective::Ddpm, Objective::Flow] {
        let single = train(&Layout::single(), MemoryPlan::default(), objective, steps);
        assert!(single.losses.iter().all(|l| l.is_finite() && *l > 0.0));
        let zero = |z, c| MemoryPlan {
            zero: z,
            zero_group: None,
            checkpointing: c,
        };
        let cases: Vec<(Layout, MemoryPlan)> = match objective {
            Objective::Ddpm => vec![
                (
                    Layout::new("tp2", 2, 1, 1, Strategy::Ring),
                    MemoryPlan::default(),
                ),
                (
                    Layout::new("ulysses2 x ring2", 1, 2, 2, Strategy::Usp),
                    zero(ZeroStage::OptimizerStates, Checkpointing::None),
                ),
                (
                    Layout::new("dp2 x ring2", 1, 1, 2, Strategy::Ring).with_dp(2),
                    zero(ZeroStage::Gradients, Checkpointing::Full),
                ),
                (
                    Layout::new("tp2 x ring2 + tp-sp", 2, 1, 2, Strategy::Ring).with_tp_sp(),
                    zero(ZeroStage::Parameters, Checkpointing::Selective),
                ),
            ],
            Objective::Flow => vec![
                (
                    Layout::new("all-gather CP 4", 1, 1, 4, Strategy::AllGather),
                    zero(ZeroStage::Parameters, Checkpointing::Full),
                ),
                (
                    Layout::new("pp2 x ring2", 1, 1, 2, Strategy::Ring).with_pp(2),
                    zero(ZeroStage::OptimizerStates, Checkpointing::None),
                ),
            ],
        };
        for (layout, memory) in cases {
            let run = train(&layout, memory, objective, steps);
            compare(&run, &single, &format!("{objective}: {}", layout.name));
        }
    }
}

/// bf16 DiT training: a ring2 x tp2 run (3 steps, DDPM objective) follows the one-rank bf16
/// run: every step's loss (within 1e-2, or 1.5x the one-rank bf16 loss's own distance to f32
/// where larger: the noise-prediction MSE is summed in f32 from bf16 activations) and gradient
/// norm, and every final weight, no further from one bf16 rank than 1.5x that run's own
/// distance to f32 (floored at 5e-2; see `assert_bf16_follows`).
#[test]
fn bf16_training_follows_its_one_rank_run() {
    let bf16 = Some(candle_core::DType::BF16);
    let (plain, one) = (MemoryPlan::default(), ScheduleKind::OneFOneB);
    let steps = 3;
    let f32_run = train(&Layout::single(), plain, Objective::Ddpm, steps);
    let want = train_in(&Layout::single(), plain, Objective::Ddpm, steps, one, bf16);
    let layout = Layout::new("tp2 x ring2", 2, 1, 2, Strategy::Ring);
    let got = train_in(&layout, plain, Objective::Ddpm, steps, one, bf16);
    let case = format!("DiT bf16 {}", layout.name);
    assert_eq!(got.losses.len(), steps as usize, "{case}");
    for i in 0..steps as usize {
        let (g, w, f) = (got.losses[i], want.losses[i], f32_run.losses[i]);
        assert_bf16_follows_scalar(g, w, f, 1e-2 / 1.5, &format!("{case}: step {i}: loss"));
        let (g, w, f) = (got.grad_norms[i], want.grad_norms[i], f32_run.grad_norms[i]);
        let what = format!("{case}: step {i}: gradient norm");
        assert_bf16_follows_scalar(g, w, f, 5e-2, &what);
    }
    assert_eq!(got.weights.len(), want.weights.len(), "{case}");
    for (n, w) in &want.weights {
        let what = format!("{case}: final {n}");
        assert_bf16_follows(&got.weights[n], w, &f32_run.weights[n], 5e-2, &what);
    }
}

#[test]
fn pipeline_schedules_equal_one_rank() {
    let steps = 2;
    let single = train(
        &Layout::single(),
        MemoryPlan::default(),
        Objective::Ddpm,
        steps,
    );
    for (name, kind, layout) in [
        (
            "gpipe pp2",
            ScheduleKind::GPipe,
            Layout::single().with_pp(2),
        ),
        (
            "1f1b pp2 x tp2",
            ScheduleKind::OneFOneB,
            Layout::new("tp2", 2, 1, 1, Strategy::Ring).with_pp(2),
        ),
    ] {
        let run = train_with(&layout, MemoryPlan::default(), Objective::Ddpm, steps, kind);
        compare(&run, &single, name);
    }
}

/// From DiT's initialisation (adaLN-Zero: the modulation and output layers start at zero, so
/// at step 0 only the output projection has a non-zero gradient) every parameter is trained:
/// each has a gradient entry from the first step on, and after a few steps every gradient is
/// non-zero (the key biases excepted: their exact gradient is 0).
#[test]
fn from_dits_initialisation_every_parameter_is_trained() {
    let cfg = models::dit::DitConfig::from_file(&fixture_dir().join("config.json")).unwrap();
    let weights = models::dit::init::initial_weights(&cfg, 5).unwrap();
    let zero_at_init: Vec<&String> = weights
        .iter()
        .filter(|(n, _)| n.contains("norm1.linear") || n.starts_with("proj_out_"))
        .map(|(n, _)| n)
        .collect();
    for (n, w) in &weights {
        // A NaN weight is neither zero nor a trained initialisation.
        testkit::assert_finite(w, n);
        let zero = testkit::max_abs(w) == 0.0;
        assert_eq!(
            zero,
            zero_at_init.contains(&n) || n.ends_with(".bias"),
            "{n}: zero at initialisation"
        );
    }
    let source = std::sync::Arc::new(candle_parallel::nn::TensorMap::new(
        weights.into_iter().collect(),
        "DiT init",
    ));
    let data = dataset();
    let out = LocalWorld::run(2, |world| -> Result<Vec<(String, f64)>, String> {
        let layout = Layout::new("ring2", 1, 1, 2, Strategy::Ring);
        let (mesh, ctx) = layout.context(world)?;
        let (vb, _) = candle_parallel::nn::ParamBuilder::new(
            source.clone(),
            candle_core::DType::F32,
            &Device::Cpu,
            ParamMode::Trainable,
        );
        let model = dit::Dit::new(&cfg, vb, &ctx).map_err(|e| e.to_string())?;
        let trainer = Trainer::new(model, &mesh, &ctx, config(6, MemoryPlan::default(), 2, 1))
            .map_err(|e| e.to_string())?;
        let mut t = DiffusionTrainer::new(trainer, DiffusionConfig::default())
            .map_err(|e| e.to_string())?;
        let first = t.noised_batch(&data, &[0, 1]).map_err(|e| e.to_string())?;
        let (_, _, g0) = t.forward_backward(&first).map_err(|e| e.to_string())?;
        g0.iter().for_each(|(n, g)| testkit::assert_finite(g, n));
        let nonzero0: Vec<String> = g0
            .iter()
            .filter(|(_, g)| testkit::max_abs(g) > 0.0)
            .map(|(n, _)| n.clone())
            .collect();
        assert!(
            nonzero0.iter().all(|n| n.starts_with("proj_out_2")),
            "{nonzero0:?}"
        );
        assert_eq!(
            g0.len(),
            cfg.parameter_shapes().len(),
            "a gradient entry for every parameter"
        );
        while t.trainer.step < 5 {
            t.step(&data).map_err(|e| e.to_string())?;
        }
        let (_, _, g) = t.forward_backward(&first).map_err(|e| e.to_string())?;
        Ok(g.into_iter()
            .map(|(n, g)| (n, testkit::max_abs(&g)))
            .collect())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (n, m) in &out[0] {
        if !n.ends_with("to_k.bias") {
            assert!(*m > 0.0, "after 5 steps the gradient of {n} is still zero");
        }
    }
}
