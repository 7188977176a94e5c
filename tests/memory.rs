//! Activation memory and recomputation traffic of one training step, measured.
//!
//! Memory is read from a counting global allocator (this test binary's own): the bytes
//! allocated and not yet freed, and their peak. One forward and backward of an 8-layer LLaMA
//! (random weights, hidden 64) on one sequence of 2048 tokens; the activation memory of a run is
//! its peak minus the bytes held just before the forward (model, optimizer-free, batch). With
//! local ranks every rank is a thread of this process, so a multi-rank run's peak is the peak of
//! the sum over ranks; divided by the ranks it is the mean per-rank peak (the ranks of a zigzag
//! ring hold equal shapes). `train/examples/bench_memory.rs` measures the same way at the
//! benchmark model's size for every layout and memory plan (`docs/benchmarks.md`).
//!
//! Asserted:
//! - 4 ranks of zigzag ring attention: at most 1/3 of the single-rank activation memory per rank;
//! - checkpointing: full < selective < none on one rank (and the losses bit-identical);
//! - selective recomputation never runs attention's forward again: the bytes every rank sends in
//!   a step equal those without checkpointing, while full recomputation sends more;
//! - pipeline schedules (pp 2, 4 micro-batches of 512 tokens): 1F1B holds at most p - rank
//!   micro-batches' activations (3 over both ranks) where GPipe holds m on each (8), so its
//!   step's peak is well under GPipe's.

use std::alloc::System;

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, Strategy};
use candle_parallel::comm::{Comm, LocalWorld};
use candle_parallel::mesh::Dim;
use candle_parallel::nn::{Batch, CrossEntropyOptions, ParamMode};
use candle_parallel::pipeline::{
    run_schedule, split_layers, PipelineSchedule, ScheduleKind, Stage, StageStep,
};
use candle_parallel::plan::MemoryPlan;
use candle_parallel::recompute::Checkpointing;
use cpl_integration_tests::{trainable_vars, Layout};
use models::llama;
use models::{LmStages, StageMicroBatch};
use train::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc<System> = CountingAlloc::new(System);

const SEQ: usize = 2048;

/// The tests of this binary share the allocator's counters: each holds this lock while it
/// measures.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test checkpoint, written once per process.
fn model_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(write_model).clone()
}

fn write_model() -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("memory-llama-8x64");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "float32"
    });
    llama::write_random_checkpoint(&dir, &config, 7).unwrap();
    dir
}

struct Measured {
    /// Peak bytes above the level before the forward, summed over ranks.
    activation: isize,
    loss: f32,
    /// Bytes sent by each rank during the step.
    sent: Vec<u64>,
}

/// Collective: the bytes held now (the same on every rank, read between two barriers), with
/// the peak counter restarted from there.
fn start_peak(world: &Comm) -> candle_parallel::Result<isize> {
    world.barrier()?;
    let before = ALLOC.current();
    if world.rank() == 0 {
        ALLOC.reset_peak(before);
    }
    world.barrier()?;
    Ok(before)
}

/// One forward and backward of one sequence under `layout` and `ckpt`.
fn measure(layout: &Layout, ckpt: Checkpointing) -> Measured {
    let files = models::hub::from_dir("memory", &model_dir()).unwrap();
    let ids: Vec<u32> = (0..SEQ).map(|i| ((i * 7919 + 13) % 512) as u32).collect();
    let results = LocalWorld::run(layout.ranks, |world| -> Result<(f32, u64, isize), String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (_mesh, ctx) = layout.context(world.clone())?;
        let mut m = llama::load(&files, &ctx, Some(DType::F32), ParamMode::Trainable)
            .map_err(|x| e(&x))?
            .model;
        let plan = MemoryPlan {
            checkpointing: ckpt,
            ..MemoryPlan::default()
        };
        plan.apply(&mut m, None).map_err(|x| e(&x))?;
        let (batch, labels) =
            Batch::from_sequences(&ctx, std::slice::from_ref(&ids), AttnMask::Causal)
                .map_err(|x| e(&x))?;
        let before = start_peak(&world).map_err(|x| e(&x))?;
        let sent0 = world.traffic().snapshot().bytes_sent();
        let opts = CrossEntropyOptions::default();
        let (sum, _) = m.loss_sum(&batch, &labels, &opts).map_err(|x| e(&x))?;
        let loss = sum.to_scalar::<f32>().map_err(|x| e(&x))?;
        let grads = m
            .backward(&(sum / SEQ as f64).unwrap())
            .map_err(|x| e(&x))?;
        drop(grads);
        let sent = world.traffic().snapshot().bytes_sent() - sent0;
        world.barrier().map_err(|x| e(&x))?;
        let peak = ALLOC.peak() - before;
        Ok((loss, sent, peak))
    })
    .unwrap_or_else(|x| panic!("{x}"));
    let loss_sum: f32 = results.iter().map(|r| r.0).sum();
    Measured {
        activation: results[0].2,
        loss: loss_sum,
        sent: results.iter().map(|r| r.1).collect(),
    }
}

#[test]
fn context_parallelism_and_checkpointing_cut_activation_memory() {
    let _measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu); // warm up candle's lazy statics
    model_dir();
    let single = Layout::single();
    let none = measure(&single, Checkpointing::None);
    let full = measure(&single, Checkpointing::Full);
    let selective = measure(&single, Checkpointing::Selective);
    let mib = |b: isize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "single rank, {SEQ} tokens: none {:.1} MiB, selective {:.1} MiB, full {:.1} MiB",
        mib(none.activation),
        mib(selective.activation),
        mib(full.activation)
    );
    assert_eq!(full.loss.to_bits(), none.loss.to_bits());
    assert_eq!(selective.loss.to_bits(), none.loss.to_bits());
    assert!(
        full.activation < selective.activation && selective.activation < none.activation,
        "expected full < selective < none: {} / {} / {} bytes",
        full.activation,
        selective.activation,
        none.activation
    );
    assert!(
        (full.activation as f64) < 0.5 * none.activation as f64,
        "full checkpointing keeps {} of {} bytes",
        full.activation,
        none.activation
    );

    let ring = Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring);
    let cp = measure(&ring, Checkpointing::None);
    let per_rank = cp.activation as f64 / 4.0;
    eprintln!(
        "zigzag ring4: {:.1} MiB per rank ({:.2} of single rank)",
        per_rank / (1 << 20) as f64,
        per_rank / none.activation as f64
    );
    assert!(
        per_rank <= none.activation as f64 / 3.0,
        "4-rank context parallelism keeps {per_rank} bytes per rank, single rank {}",
        none.activation
    );
    assert!(((cp.loss - none.loss) / none.loss).abs() < 1e-5);

    // Recomputation traffic: selective sends exactly what no checkpointing sends.
    let sel = measure(&ring, Checkpointing::Selective);
    let fullr = measure(&ring, Checkpointing::Full);
    assert_eq!(sel.sent, cp.sent, "selective recomputation communicated");
    for (f, n) in fullr.sent.iter().zip(&cp.sent) {
        assert!(
            f > n,
            "full recomputation sends the forward's kv again: {f} vs {n}"
        );
    }
}

/// Peak bytes above the level before the step of one pipelined training step (pp 2, `m`
/// micro-batches of 512 tokens) under `kind`, summed over the two ranks.
fn pipeline_peak(kind: ScheduleKind, m: usize) -> isize {
    let files = models::hub::from_dir("memory", &model_dir()).unwrap();
    let layout = Layout::single().with_pp(2);
    let schedule = PipelineSchedule::new(kind, 2, m, 1).unwrap();
    let split = split_layers(8, 2, None).unwrap();
    let results = LocalWorld::run(2, |world| -> Result<isize, String> {
        let e = |x: &dyn std::fmt::Display| format!("{kind}: {x}");
        let (mesh, ctx) = layout.context(world.clone())?;
        let pp = mesh.comm(Dim::Pp);
        let rank = pp.rank();
        let loaded = llama::load_stage(
            &files,
            &ctx,
            Some(DType::F32),
            ParamMode::Trainable,
            std::slice::from_ref(&split[rank]),
            true,
        )
        .map_err(|x| e(&x))?;
        let micro: Vec<StageMicroBatch> = (0..m)
            .map(|i| {
                let ids: Vec<u32> = (0..512)
                    .map(|t| ((t * 7919 + i * 31) % 512) as u32)
                    .collect();
                let (batch, labels) =
                    Batch::from_sequences(&ctx, std::slice::from_ref(&ids), AttnMask::Causal)
                        .unwrap();
                StageMicroBatch { batch, labels }
            })
            .collect();
        let staged = LmStages {
            model: &loaded.model,
            opts: CrossEntropyOptions::default(),
            balancing_loss: true,
        };
        let step = StageStep {
            schedule: &schedule,
            layers: &split,
            pp: &pp,
            global_count: (512 * m) as u64,
            dtype: DType::F32,
        };
        let mut stage = Stage::new(
            &staged,
            &step,
            rank,
            &micro,
            trainable_vars(&loaded.params.sorted()),
        )
        .map_err(|x| e(&x))?;
        let before = start_peak(&world).map_err(|x| e(&x))?;
        run_schedule(&schedule, &pp, &mut stage).map_err(|x| e(&x))?;
        world.barrier().map_err(|x| e(&x))?;
        Ok(ALLOC.peak() - before)
    })
    .unwrap_or_else(|x| panic!("{x}"));
    results[0]
}

#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe() {
    let _measuring = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
    model_dir();
    let gpipe = pipeline_peak(ScheduleKind::GPipe, 4);
    let ofob = pipeline_peak(ScheduleKind::OneFOneB, 4);
    let mib = |b: isize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "pp 2, 4 micro-batches: peak 1F1B {:.1} MiB, GPipe {:.1} MiB",
        mib(ofob),
        mib(gpipe)
    );
    // Activations held: GPipe 4 + 4 micro-batches, 1F1B at most 2 + 1. Gradients and transient
    // buffers add the same to both, so the ratio sits above 3/8.
    assert!(
        (ofob as f64) < 0.6 * gpipe as f64,
        "1F1B peak {:.1} MiB vs GPipe {:.1} MiB",
        mib(ofob),
        mib(gpipe)
    );
}
