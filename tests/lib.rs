//! Shared helpers for the cross-crate integration tests: the LLaMA fixtures made by
//! `scripts/make_llama_fixtures.py` and a runner that trains one step of a fixture model under
//! any parallel layout (and memory plan: ZeRO-3 parameter sharding, activation checkpointing)
//! and returns the loss and the full gradients, in global form.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, SpConfig, Strategy};
use candle_parallel::comm::{Comm, LocalWorld, ReduceOp};
use candle_parallel::mesh::{DeviceMesh, Dim, MeshConfig};
use candle_parallel::nn::{
    Batch, CrossEntropyOptions, ParallelCtx, Param, ParamMode, TpActivations,
};
use candle_parallel::optim::{collect_gradients, reduce_gradients, ZeroGroups, ZeroStage};
use candle_parallel::plan::{MemoryPlan, PlannedParams};
use candle_parallel::recompute::Checkpointing;
use models::hub::ModelFiles;

/// `tests/fixtures/llama/<name>`, or `tests/fixtures/<name>` for a name with a folder
/// (`zoo/qwen2`). `tests/` is where this crate was built, or `CPL_TESTS_DIR` when set: a
/// prebuilt test binary run from another copy of the repository (`scripts/gpu_check.sh` runs the
/// bundled GPU suite so).
pub fn fixture_dir(name: &str) -> PathBuf {
    let fixtures = std::env::var_os("CPL_TESTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("fixtures");
    if name.contains('/') {
        fixtures.join(name)
    } else {
        fixtures.join("llama").join(name)
    }
}

/// The causal LM of fixture `name` for `ctx`'s layout, loaded through the family registry
/// (whole, trainable).
pub fn load_fixture_lm(
    name: &str,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
) -> models::Result<models::family::LoadedCausalLm> {
    let files = fixture_files(name);
    let family = models::family::detect(&files.config)?;
    let load = family.load_causal_lm.ok_or_else(|| {
        models::Error::Invalid(format!("{name}: family {} is no causal LM", family.name))
    })?;
    let desc = (family.describe)(&files.config)?;
    let all = 0..desc.layers;
    load(
        &files,
        &models::family::LoadSpec {
            ctx,
            dtype,
            mode: ParamMode::Trainable,
            layers: std::slice::from_ref(&all),
            ends: true,
            adapters: None,
        },
    )
}

pub fn fixture_files(name: &str) -> ModelFiles {
    let dir = fixture_dir(name);
    models::hub::from_dir(name, &dir).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

/// The reference of a fixture: transformers' input, labels, logits, loss and gradients.
pub struct Reference {
    pub input_ids: Vec<Vec<u32>>,
    /// transformers' labels (unshifted, `-100` ignored), `(batch, seq)`.
    pub labels: Tensor,
    pub logits: Tensor,
    pub loss: f32,
    /// Parameter name -> gradient.
    pub grads: HashMap<String, Tensor>,
}

pub fn reference(name: &str) -> Reference {
    let path = fixture_dir(name).join("reference.safetensors");
    let t = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ids = t["input_ids"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let input_ids = ids
        .iter()
        .map(|r| r.iter().map(|&x| x as u32).collect())
        .collect();
    let grads = t
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n.to_string(), v.clone())))
        .collect();
    Reference {
        input_ids,
        labels: t["labels"].to_dtype(DType::I64).unwrap(),
        logits: t["logits"].clone(),
        loss: t["loss"]
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap_or_else(|_| t["loss"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]),
        grads,
    }
}

pub use testkit::{assert_close, assert_identical, max_abs, rel_err};

/// A parallel layout for [`run_layout`].
#[derive(Debug, Clone)]
pub struct Layout {
    pub name: &'static str,
    pub ranks: usize,
    pub mesh: MeshConfig,
    pub sp: SpConfig,
    pub tp: TpActivations,
}

impl Layout {
    pub fn single() -> Self {
        Self::new("single", 1, 1, 1, Strategy::Ring)
    }

    /// `tp × ulysses × ring` ranks with `strategy` (zigzag ring layout).
    pub fn new(
        name: &'static str,
        tp: usize,
        ulysses: usize,
        ring: usize,
        strategy: Strategy,
    ) -> Self {
        let sp = SpConfig::new(strategy, ulysses, ring);
        let mesh = MeshConfig::default()
            .with_tp(tp)
            .with_ulysses(ulysses)
            .with_ring(ring);
        Self {
            name,
            ranks: tp * ulysses * ring,
            mesh,
            sp,
            tp: TpActivations::Replicated,
        }
    }

    pub fn with_sp(mut self, f: impl FnOnce(SpConfig) -> SpConfig) -> Self {
        self.sp = f(self.sp);
        self.mesh = self.mesh.with_placement(self.sp.placement);
        self
    }

    pub fn with_tp_sp(mut self) -> Self {
        self.tp = TpActivations::SequenceSharded;
        self
    }

    /// The same layout in each of `pp` pipeline stages.
    pub fn with_pp(mut self, pp: usize) -> Self {
        self.mesh.pp = pp;
        self.ranks *= pp;
        self
    }

    /// The same layout replicated `dp` times (data parallel).
    pub fn with_dp(mut self, dp: usize) -> Self {
        self.mesh = self.mesh.with_dp(dp);
        self.ranks *= dp;
        self
    }

    /// This rank's mesh and parallel context (collective over `world`); errors name the layout.
    pub fn context(&self, world: Comm) -> Result<(DeviceMesh, ParallelCtx), String> {
        let plan = candle_parallel::plan::Layout::new(self.mesh.clone(), self.sp.clone(), self.tp);
        plan.context(world)
            .map_err(|e| format!("{}: {e}", self.name))
    }
}

/// One layout per sequence-parallel strategy, plus TP with and without sequence-sharded
/// activations: the set every model-level test runs. Tests add their own extra layouts.
pub fn every_strategy() -> Vec<Layout> {
    vec![
        Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        Layout::new("tp2 + tp-sp", 2, 1, 1, Strategy::Ring).with_tp_sp(),
        Layout::new("ulysses2 x ring2 (usp)", 1, 2, 2, Strategy::Usp),
        Layout::new("zigzag ring4", 1, 1, 4, Strategy::Ring),
        Layout::new("double ring w2 on 4", 1, 1, 4, Strategy::DoubleRing)
            .with_sp(|s| s.with_inner_ring(2)),
        Layout::new("startrail C2 on 8", 1, 1, 8, Strategy::StarTrail).with_sp(|s| s.with_team(2)),
        Layout::new("all-gather CP 4", 1, 1, 4, Strategy::AllGather),
    ]
}

/// What one rank of [`run_layout`] returns, already in global form (identical on every rank).
pub struct StepResult {
    /// Mean next-token loss over the batch.
    pub loss: f32,
    /// Logits `(batch, seq, vocab)` in global token order.
    pub logits: Tensor,
    /// Full gradient of every parameter, by name.
    pub grads: HashMap<String, Tensor>,
}

/// Gathers a tensor-parallel slice of a parameter's gradient to the full tensor.
fn gather_param(g: &Tensor, p: &Param, tp: &Comm) -> Tensor {
    if p.shard.is_split() {
        tp.all_gather(&g.contiguous().unwrap(), p.shard.dim)
            .unwrap()
    } else {
        g.clone()
    }
}

/// Where [`run_layout_with`] keeps parameters and activations, and their dtype.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepPlan {
    /// Activation checkpointing of every decoder layer (parameter gradients of recomputed
    /// layers then arrive through the context's `GradSink`, not candle's autograd).
    pub checkpointing: Checkpointing,
    /// ZeRO-3: every unit's parameters sharded over the ranks that hold the same parameters
    /// (`ulysses x ring`) and gathered for each use.
    pub zero3: bool,
    /// Dtype of the parameters and activations (`None`: f32). The loss, logits and gradients
    /// are returned in f32.
    pub dtype: Option<DType>,
}

impl StepPlan {
    fn memory(&self) -> MemoryPlan {
        MemoryPlan {
            zero: if self.zero3 {
                ZeroStage::Parameters
            } else {
                ZeroStage::Off
            },
            zero_group: None,
            checkpointing: self.checkpointing,
        }
    }
}

/// Fixture `name` on one rank against its transformers reference: logits and loss within 1e-5
/// relative, and every stored parameter's gradient within 1e-5 relative (max-abs / max|ref|,
/// per tensor), with exactly the checkpoint's parameters receiving gradients.
pub fn check_reference(name: &str) {
    let r = reference(name);
    let got = run_layout(name, &Layout::single());
    let e = rel_err(&got.logits, &r.logits);
    assert!(e <= 1e-5, "{name}: logits rel err {e}");
    testkit::assert_close_scalar(
        got.loss as f64,
        r.loss as f64,
        1e-5,
        &format!("{name}: loss vs transformers"),
    );
    let mut names: Vec<&String> = r.grads.keys().collect();
    names.sort();
    let mut ours: Vec<&String> = got.grads.keys().collect();
    ours.sort();
    assert_eq!(
        ours, names,
        "{name}: parameters with gradients differ from transformers'"
    );
    for n in names {
        let e = rel_err(&got.grads[n], &r.grads[n]);
        assert!(e <= 1e-5, "{name}: gradient of {n}: rel err {e}");
    }
}

/// [`run_layout_with`] with every parameter resident and no checkpointing.
pub fn run_layout(name: &str, layout: &Layout) -> StepResult {
    run_layout_with(name, layout, StepPlan::default())
}

/// Loads fixture `name` under `layout` and `plan` on local ranks, runs forward (logits and loss
/// with the transformers labels of the fixture, shifted) and backward, reduces the gradients and
/// gathers everything to global form. Returns rank 0's result (every other rank's is checked to
/// be bit-identical). Errors (as a panic naming the layout) when a parameter receives no gradient.
pub fn run_layout_with(name: &str, layout: &Layout, plan: StepPlan) -> StepResult {
    run_layout_masked(name, layout, plan, &AttnMask::Causal)
}

/// [`run_layout_with`] under attention `mask` (a document mask of the fixture's sequence
/// length: the batch is cut, and the logits gathered, with the plan of that mask).
pub fn run_layout_masked(
    name: &str,
    layout: &Layout,
    plan: StepPlan,
    mask: &AttnMask,
) -> StepResult {
    let r = reference(name);
    let labels = r.labels.to_vec2::<i64>().unwrap();
    let seqs = r.input_ids.clone();
    let mut results = LocalWorld::run(layout.ranks, |world| -> Result<StepResult, String> {
        let e = |e: &dyn std::fmt::Display| format!("{}: {e}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let dtype = Some(plan.dtype.unwrap_or(DType::F32));
        let mut model = load_fixture_lm(name, &ctx, dtype).map_err(|x| e(&x))?.model;
        let memory = plan.memory();
        let zero = memory.zero_groups(&mesh).map_err(|x| e(&x))?;
        let planned = memory.apply(&mut model, zero.as_ref()).map_err(|x| e(&x))?;
        let (batch, _) = Batch::from_sequences(&ctx, &seqs, mask.clone()).map_err(|x| e(&x))?;
        // transformers' loss: logits[:, i] against labels[:, i + 1].
        let shifted: Vec<i64> = labels
            .iter()
            .flat_map(|row| row[1..].iter().copied().chain(std::iter::once(-100)))
            .collect();
        let (b, s) = (seqs.len(), seqs[0].len());
        let shifted = Tensor::from_vec(shifted, (b, s), &Device::Cpu).unwrap();
        let local_labels = ctx.shard_tokens_for(&shifted, mask).map_err(|x| e(&x))?;
        let (sum, count) = model
            .loss_sum(&batch, &local_labels, &CrossEntropyOptions::default())
            .map_err(|x| e(&x))?;
        let seq_group = mesh.group(&[Dim::Ulysses, Dim::Ring]).map_err(|x| e(&x))?;
        let total = seq_group
            .all_reduce(
                &Tensor::new(&[count as f32], &Device::Cpu).unwrap(),
                ReduceOp::Sum,
            )
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()[0];
        let local_loss = (sum / total as f64).unwrap();
        let loss = seq_group
            .all_reduce(&local_loss.detach(), ReduceOp::Sum)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let grads = model.backward(&local_loss).map_err(|x| e(&x))?;
        let grads = global_gradients(layout, &mesh, &ctx, &planned, zero.as_ref(), &grads)?;
        let logits = model.logits(&batch).map_err(|x| e(&x))?;
        let logits = ctx
            .gather_tokens_for(&logits.detach(), mask)
            .map_err(|x| e(&x))?;
        Ok(StepResult {
            loss,
            logits,
            grads,
        })
    })
    .unwrap_or_else(|e| panic!("{}: {e}", layout.name));
    let first = results.swap_remove(0);
    // Every rank holds the same global loss, logits and gradients, to the bit.
    for (r, other) in results.iter().enumerate() {
        let who = format!("{}: rank {} vs rank 0", layout.name, r + 1);
        testkit::assert_identical_scalars(&[other.loss as f64], &[first.loss as f64], &who);
        assert_identical(&other.logits, &first.logits, &format!("{who}: logits"));
        assert_eq!(other.grads.len(), first.grads.len(), "{who}");
        for (n, g) in &first.grads {
            assert_identical(&other.grads[n], g, &format!("{who}: gradient of {n}"));
        }
    }
    first
}

/// Asserts that `got` equals `want` within `tol` relative (`case` names the run): the loss, the
/// logits and every parameter's gradient, each of which must be non-zero.
pub fn assert_same_step(case: &str, got: &StepResult, want: &StepResult, tol: f64) {
    testkit::assert_close_scalar(
        got.loss as f64,
        want.loss as f64,
        tol,
        &format!("{case}: loss"),
    );
    let e = rel_err(&got.logits, &want.logits);
    assert!(e <= tol, "{case}: logits rel err {e}");
    assert_eq!(got.grads.len(), want.grads.len(), "{case}");
    for (n, g) in &want.grads {
        let ours = got
            .grads
            .get(n)
            .unwrap_or_else(|| panic!("{case}: no gradient for {n}"));
        let max = max_abs(ours);
        assert!(max > 0.0, "{case}: the gradient of {n} is zero (or NaN)");
        let e = rel_err(ours, g);
        assert!(e <= tol, "{case}: gradient of {n}: rel err {e}");
    }
}

/// Every parameter's whole gradient (f32) from this rank's backward `grads` of a model loaded
/// under `layout` with the memory plan's `planned` parameters: reduced over the ranks sharing
/// each parameter and gathered over tp (and the ZeRO-3 sharding group). Collective over the
/// world. Errors name the layout and any parameter without a gradient.
pub fn global_gradients(
    layout: &Layout,
    mesh: &DeviceMesh,
    ctx: &ParallelCtx,
    planned: &PlannedParams,
    zero: Option<&ZeroGroups>,
    grads: &GradStore,
) -> Result<HashMap<String, Tensor>, String> {
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", layout.name);
    let tp = mesh.comm(Dim::Tp);
    let grads: HashMap<String, Tensor> = match (planned, zero) {
        (PlannedParams::Resident(params), _) => {
            // Frozen parameters (weights a model only keeps, a frozen part) have none.
            let params: Vec<Param> = params.iter().filter(|p| p.var.is_some()).cloned().collect();
            let params = &params;
            let collected = collect_gradients(params, grads).map_err(|x| e(&x))?;
            let reduced = reduce_gradients(params, collected, ctx).map_err(|x| e(&x))?;
            params
                .iter()
                .zip(reduced)
                .map(|(p, (n, g))| (n, gather_param(&g, p, &tp)))
                .collect()
        }
        // A chunk's gradient is already summed over the sharding group (the backward of the
        // gather reduce-scatters); under TP-sp replicated parameters also sum over tp.
        (PlannedParams::Sharded(chunks), Some(z)) => chunks
            .iter()
            .filter(|p| p.trainable)
            .map(|p| {
                let g = grads
                    .get(p.var.as_tensor())
                    .ok_or_else(|| e(&format!("parameter `{}` received no gradient", p.name)))?;
                let tp_sp = layout.tp == TpActivations::SequenceSharded;
                let g = if tp_sp && !p.shard.is_split() && z.replica_tp.size() > 1 {
                    z.replica_tp
                        .all_reduce(g, ReduceOp::Sum)
                        .map_err(|x| e(&x))?
                } else {
                    g.clone()
                };
                let whole = p
                    .flat
                    .gather(&g, &z.shard, &p.local_shape)
                    .map_err(|x| e(&x))?;
                let whole = if p.shard.is_split() {
                    tp.all_gather(&whole.contiguous().unwrap(), p.shard.dim)
                        .unwrap()
                } else {
                    whole
                };
                Ok((p.name.clone(), whole))
            })
            .collect::<Result<_, String>>()?,
        (PlannedParams::Sharded(_), None) => return Err(e(&"ZeRO-3 without groups")),
    };
    Ok(grads
        .into_iter()
        .map(|(n, g): (String, Tensor)| (n, g.to_dtype(DType::F32).unwrap()))
        .collect())
}

/// Every parameter of `trainer`'s model whole (tensor-parallel slices gathered), by name, in
/// the parameters' dtype. Collective over the world (ZeRO-3 gathers, tp gathers).
pub fn whole_weights<M: train::trainer::TrainModel>(
    trainer: &train::trainer::Trainer<M>,
    mesh: &DeviceMesh,
) -> Result<HashMap<String, Tensor>, String> {
    let tp = mesh.comm(Dim::Tp);
    trainer
        .whole_params()
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|p| {
            let w = if p.shard.is_split() {
                tp.all_gather(
                    &p.tensor.contiguous().map_err(|e| e.to_string())?,
                    p.shard.dim,
                )
                .map_err(|e| e.to_string())?
            } else {
                p.tensor
            };
            Ok((p.name, w))
        })
        .collect()
}

/// The trainable variables of `params` by name (what a pipeline stage differentiates).
pub fn trainable_vars(params: &[Param]) -> Vec<(String, candle_core::Var)> {
    params
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.var.clone().expect("parameters loaded as trainable"),
            )
        })
        .collect()
}

/// What [`train_through_registry`] returns, identical on every rank.
pub struct RegistryRun {
    /// The loss of every step.
    pub losses: Vec<f64>,
    /// The (pre-clipping) gradient norm of every step.
    pub grad_norms: Vec<f64>,
    /// The held-out loss after training (4 sequences of the data, forward only; through the
    /// stages under a pipeline).
    pub eval_loss: f64,
    /// The whole final weights, merged over the pipeline stages.
    pub weights: HashMap<String, Tensor>,
}

/// Trains the model of `files`, loaded through the family registry, for `cfg.steps` steps of
/// `data` under `layout` (f32). With pipeline stages (`layout.mesh.pp > 1`) and no
/// `cfg.pipeline`, the layers are split over the stages under 1F1B (the first stages take one
/// more where they do not divide). Every rank's losses,
/// norms and weights are asserted bit-identical. Panics name the layout.
pub fn train_through_registry(
    files: &ModelFiles,
    layout: &Layout,
    cfg: &train::trainer::TrainConfig,
    data: &train::data::PackedDataset,
) -> RegistryRun {
    use train::trainer::{PipelineConfig, Trainer};
    let family = models::family::detect(&files.config).unwrap_or_else(|e| panic!("{e}"));
    let desc = (family.describe)(&files.config).unwrap_or_else(|e| panic!("{e}"));
    let load = family
        .load_causal_lm
        .unwrap_or_else(|| panic!("{} is no causal LM family", family.name));
    let pp = layout.mesh.pp;
    let mut cfg = cfg.clone();
    if pp > 1 && cfg.pipeline.is_none() {
        let n = desc.layers;
        cfg.pipeline = Some(PipelineConfig {
            schedule: candle_parallel::pipeline::ScheduleKind::OneFOneB,
            virtual_stages: 1,
            layers: (0..pp).map(|r| n / pp + usize::from(r < n % pp)).collect(),
        });
    }
    let steps = cfg.steps;
    let out = LocalWorld::run(layout.ranks, |world| -> Result<_, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let r = mesh.coord(Dim::Pp);
        let layers = match &cfg.pipeline {
            Some(pc) => vec![pc.ranges()[r].clone()],
            None => std::iter::once(0..desc.layers).collect(),
        };
        let spec = models::family::LoadSpec {
            ctx: &ctx,
            dtype: Some(DType::F32),
            mode: ParamMode::Trainable,
            layers: &layers,
            ends: r == 0 || r + 1 == pp,
            adapters: None,
        };
        let model = load(files, &spec).map_err(|x| e(&x))?.model;
        let mut t = Trainer::new(model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        while t.step < steps {
            let s = t.step(data).map_err(|x| e(&x))?;
            losses.push(s.loss);
            norms.push(s.grad_norm);
        }
        let (eval, _) = t.eval_loss(data, 4).map_err(|x| e(&x))?;
        Ok((losses, norms, eval, whole_weights(&t, &mesh)?))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let mut weights = HashMap::new();
    for (i, (l, g, ev, w)) in out.iter().enumerate() {
        let who = format!("{}: rank {i} vs rank 0", layout.name);
        testkit::assert_identical_scalars(l, &out[0].0, &format!("{who}: losses"));
        testkit::assert_identical_scalars(g, &out[0].1, &format!("{who}: gradient norms"));
        testkit::assert_identical_scalars(&[*ev], &[out[0].2], &format!("{who}: eval loss"));
        for (n, t) in w {
            if let Some(prev) = weights.insert(n.clone(), t.clone()) {
                assert_identical(&prev, t, &format!("{who}: {n}"));
            }
        }
    }
    RegistryRun {
        losses: out[0].0.clone(),
        grad_norms: out[0].1.clone(),
        eval_loss: out[0].2,
        weights,
    }
}

/// The small AdamW run the family tests train: 32-token sequences, one per micro-batch,
/// `grad_accum` micro-batches per step, lr 5e-3 with one warmup step and a cosine decay to 5e-4,
/// weight decay 0.1, clipping at 1.0, loss chunks of 16 tokens, seed `seed`.
pub fn small_train_config(
    steps: u64,
    memory: candle_parallel::plan::MemoryPlan,
    grad_accum: usize,
    seed: u64,
) -> train::trainer::TrainConfig {
    use candle_parallel::optim::{AdamWConfig, Decay, LrSchedule};
    train::trainer::TrainConfig {
        seq_len: 32,
        steps,
        batch: 1,
        grad_accum,
        doc_mask: false,
        seed,
        shuffle: true,
        adamw: AdamWConfig {
            lr: 5e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule: LrSchedule {
            peak_lr: 5e-3,
            min_lr: 5e-4,
            warmup_steps: 1,
            total_steps: steps,
            decay: Decay::Cosine,
        },
        max_grad_norm: Some(1.0),
        loss_chunk_tokens: 16,
        memory,
        pipeline: None,
    }
}
