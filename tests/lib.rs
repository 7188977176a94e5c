//! Shared helpers for the cross-crate integration tests: the LLaMA fixtures made by
//! `scripts/make_llama_fixtures.py` and a runner that trains one step of a fixture model under
//! any parallel layout (and memory plan: ZeRO-3 parameter sharding, activation checkpointing)
//! and returns the loss and the full gradients, in global form.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::{AttnMask, SpConfig, Strategy};
use candle_parallel::comm::{Comm, LocalWorld, ReduceOp};
use candle_parallel::mesh::{DeviceMesh, Dim, MeshConfig};
use candle_parallel::nn::{
    Adapters, Batch, CrossEntropyOptions, ParallelCtx, Param, ParamMode, TensorSource,
    TpActivations,
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
    load_fixture_lm_with(name, ctx, dtype, None)
}

/// [`load_fixture_lm`] with LoRA `adapters` (the base frozen, the adapters trainable).
pub fn load_fixture_lm_with(
    name: &str,
    ctx: &ParallelCtx,
    dtype: Option<DType>,
    adapters: Option<Arc<Adapters>>,
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
            adapters,
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
    /// The same inputs with right padding, where the fixture has a padded run (`padded.*`).
    pub padded: Option<PaddedReference>,
}

/// A fixture's run with right-padded rows: transformers given an `attention_mask`.
pub struct PaddedReference {
    /// Per row, its trailing padding tokens (the attention mask's zeros).
    pub padding: Vec<usize>,
    /// The labels, `-100` on the padding too.
    pub labels: Tensor,
    pub loss: f32,
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
    let grads_under = |prefix: &str| -> HashMap<String, Tensor> {
        t.iter()
            .filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n.to_string(), v.clone())))
            .collect()
    };
    let scalar = |k: &str| -> f32 {
        t[k].to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()[0]
    };
    let padded = t.get("padded.attention_mask").map(|m| {
        let rows = m.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap();
        let padding = rows
            .iter()
            .map(|r| {
                let real = r.iter().take_while(|&&x| x == 1).count();
                assert!(
                    r[real..].iter().all(|&x| x == 0),
                    "{name}: the padded run's attention mask is not right padding"
                );
                r.len() - real
            })
            .collect();
        PaddedReference {
            padding,
            labels: t["padded.labels"].to_dtype(DType::I64).unwrap(),
            loss: scalar("padded.loss"),
            grads: grads_under("padded.grad."),
        }
    });
    let grads = grads_under("grad.");
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
        padded,
    }
}

pub use testkit::{assert_close, assert_identical, max_abs, rel_err};

/// A `(rows, cols)` matrix of values in [-0.3, 0.3) from `seed` (random LoRA adapters).
pub fn random_matrix(rows: usize, cols: usize, seed: u64, dev: &Device) -> Tensor {
    let n = rows * cols;
    let ints = testkit::random_docs(seed, 1, n..n + 1, 1 << 20).remove(0);
    let v: Vec<f32> = ints
        .iter()
        .map(|&x| (x as f32 / (1 << 20) as f32 - 0.5) * 0.6)
        .collect();
    Tensor::from_vec(v, (rows, cols), dev).unwrap()
}

/// A parallel layout for [`run_layout`].
#[derive(Debug, Clone)]
pub struct Layout {
    pub name: &'static str,
    pub ranks: usize,
    pub mesh: MeshConfig,
    pub sp: SpConfig,
    pub tp: TpActivations,
    /// Expert parallelism (1: none).
    pub ep: usize,
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
            ep: 1,
        }
    }

    /// The same layout with its mixtures of experts divided over `ep` of the ranks holding
    /// different tokens.
    pub fn with_ep(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
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
        let plan = candle_parallel::plan::Layout::new(self.mesh.clone(), self.sp.clone(), self.tp)
            .with_expert_parallel(self.ep);
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
    /// Full gradient of every trainable parameter, under the checkpoint's names (Phi-3's q,
    /// k and v gradients fused as `qkv_proj`'s, like transformers').
    pub grads: HashMap<String, Tensor>,
}

/// `got` equals `want` (the one-rank run) within `tol` relative: loss, logits and every
/// gradient (the same names), every gradient non-zero (and not NaN). Panics name `case`.
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
    assert_loss_and_gradients(name, &got, r.loss, &r.grads);
}

/// `got`'s loss and every parameter's gradient equal transformers' `loss` and `grads` (1e-5
/// relative; the same parameters have gradients).
pub fn assert_loss_and_gradients(
    name: &str,
    got: &StepResult,
    loss: f32,
    grads: &HashMap<String, Tensor>,
) {
    testkit::assert_close_scalar(
        got.loss as f64,
        loss as f64,
        1e-5,
        &format!("{name}: loss vs transformers"),
    );
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    let mut ours: Vec<&String> = got.grads.keys().collect();
    ours.sort();
    assert_eq!(
        ours, names,
        "{name}: parameters with gradients differ from transformers'"
    );
    for n in names {
        let e = rel_err(&got.grads[n], &grads[n]);
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

/// [`run_layout_with`] of the fixture with LoRA `adapters`: the gradients are the adapters'.
pub fn run_layout_lora(
    name: &str,
    layout: &Layout,
    plan: StepPlan,
    adapters: Option<Arc<Adapters>>,
) -> StepResult {
    run_layout_full(name, layout, plan, &AttnMask::Causal, adapters)
}

/// [`run_layout_with`] under attention `mask` (a document mask of the fixture's sequence
/// length: the batch is cut, and the logits gathered, with the plan of that mask).
pub fn run_layout_masked(
    name: &str,
    layout: &Layout,
    plan: StepPlan,
    mask: &AttnMask,
) -> StepResult {
    run_layout_full(name, layout, plan, mask, None)
}

/// [`run_layout_with`] under attention `mask` with LoRA `adapters`.
pub fn run_layout_full(
    name: &str,
    layout: &Layout,
    plan: StepPlan,
    mask: &AttnMask,
    adapters: Option<Arc<Adapters>>,
) -> StepResult {
    run_layout_inputs(name, layout, plan, mask, adapters, false)
}

/// [`run_layout_with`] on the fixture's padded run ([`Reference::padded`]): its labels, and
/// the batch told which tokens are padding ([`Batch::from_padded_tokens`]).
pub fn run_layout_padded(name: &str, layout: &Layout, plan: StepPlan) -> StepResult {
    run_layout_inputs(name, layout, plan, &AttnMask::Causal, None, true)
}

fn run_layout_inputs(
    name: &str,
    layout: &Layout,
    plan: StepPlan,
    mask: &AttnMask,
    adapters: Option<Arc<Adapters>>,
    padded: bool,
) -> StepResult {
    let r = reference(name);
    let (labels, padding) = match (&r.padded, padded) {
        (_, false) => (&r.labels, vec![0; r.input_ids.len()]),
        (Some(p), true) => (&p.labels, p.padding.clone()),
        (None, true) => panic!("{name}: the fixture has no padded run"),
    };
    let labels = labels.to_vec2::<i64>().unwrap();
    let seqs = r.input_ids.clone();
    let mut results = LocalWorld::run(layout.ranks, |world| -> Result<StepResult, String> {
        let e = |e: &dyn std::fmt::Display| format!("{}: {e}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let dtype = Some(plan.dtype.unwrap_or(DType::F32));
        let mut model = load_fixture_lm_with(name, &ctx, dtype, adapters.clone())
            .map_err(|x| e(&x))?
            .model;
        let memory = plan.memory();
        let zero = memory.zero_groups(&mesh).map_err(|x| e(&x))?;
        let planned = memory.apply(&mut model, zero.as_ref()).map_err(|x| e(&x))?;
        let unshifted: Vec<Vec<i64>> = seqs
            .iter()
            .map(|s| s.iter().map(|&t| t as i64).collect())
            .collect();
        let (batch, _) = Batch::from_padded_tokens(&ctx, &seqs, &unshifted, mask.clone(), &padding)
            .map_err(|x| e(&x))?;
        // transformers' loss: logits[:, i] against labels[:, i + 1].
        let shifted: Vec<i64> = labels
            .iter()
            .flat_map(|row| row[1..].iter().copied().chain(std::iter::once(-100)))
            .collect();
        let (b, s) = (seqs.len(), seqs[0].len());
        let shifted = Tensor::from_vec(shifted, (b, s), &Device::Cpu).unwrap();
        let local_labels = ctx.shard_tokens_for(&shifted, mask).map_err(|x| e(&x))?;
        let (sum, count) = model
            .training_loss_sum(&batch, &local_labels, &CrossEntropyOptions::default())
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
        let grads = model
            .to_checkpoint(grads.into_iter().collect())
            .map_err(|x| e(&x))?
            .into_iter()
            .collect();
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
    /// The whole final weights (the trained ones: the adapters under LoRA), merged over the
    /// pipeline stages.
    pub weights: HashMap<String, Tensor>,
}

/// The pipeline of `layout` for a model of `layers` decoder layers: `None` without stages,
/// else 1F1B with the layers split evenly (the first stages take one more where they do not
/// divide).
pub fn registry_pipeline(layout: &Layout, layers: usize) -> Option<train::trainer::PipelineConfig> {
    let pp = layout.mesh.pp;
    (pp > 1).then(|| train::trainer::PipelineConfig {
        schedule: candle_parallel::pipeline::ScheduleKind::OneFOneB,
        virtual_stages: 1,
        layers: (0..pp)
            .map(|r| layers / pp + usize::from(r < layers % pp))
            .collect(),
    })
}

/// Loads the causal LM of `files` through the family registry for this rank of `layout`'s
/// `mesh` (its pipeline stage's layers under `pipeline`), f32, with `adapters`.
pub fn load_through_registry(
    files: &ModelFiles,
    mesh: &DeviceMesh,
    ctx: &ParallelCtx,
    pipeline: Option<&train::trainer::PipelineConfig>,
    mode: ParamMode,
    adapters: Option<std::sync::Arc<candle_parallel::nn::Adapters>>,
) -> Result<models::family::LoadedCausalLm, String> {
    let family = models::family::detect(&files.config).map_err(|e| e.to_string())?;
    let desc = (family.describe)(&files.config).map_err(|e| e.to_string())?;
    let load = family
        .load_causal_lm
        .ok_or_else(|| format!("{} is no causal LM family", family.name))?;
    let (r, pp) = (mesh.coord(Dim::Pp), mesh.size(Dim::Pp));
    let layers: Vec<std::ops::Range<usize>> = match pipeline {
        // Every chunk of this rank: virtual stages r, r + pp, ...
        Some(pc) => pc.ranges().into_iter().skip(r).step_by(pp).collect(),
        None => std::iter::once(0..desc.layers).collect(),
    };
    let spec = models::family::LoadSpec {
        ctx,
        dtype: Some(DType::F32),
        mode,
        layers: &layers,
        ends: r == 0 || r + 1 == pp,
        adapters,
    };
    load(files, &spec).map_err(|e| e.to_string())
}

/// Two runs of [`train_through_registry`] agree within `tol` relative: every step's loss and
/// gradient norm, the held-out loss, and every final weight. Panics name `case`.
pub fn assert_same_registry_run(case: &str, got: &RegistryRun, want: &RegistryRun, tol: f64) {
    assert_same_registry_run_weights(case, got, want, tol, tol)
}

/// [`assert_same_registry_run`] with the final weights compared within `weights_tol` (a
/// caller argues why it differs from `tol`).
pub fn assert_same_registry_run_weights(
    case: &str,
    got: &RegistryRun,
    want: &RegistryRun,
    tol: f64,
    weights_tol: f64,
) {
    assert_eq!(got.losses.len(), want.losses.len(), "{case}: steps");
    for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
        testkit::assert_close_scalar(*a, *b, tol, &format!("{case}: step {i} loss"));
    }
    for (i, (a, b)) in got.grad_norms.iter().zip(&want.grad_norms).enumerate() {
        testkit::assert_close_scalar(*a, *b, tol, &format!("{case}: step {i} grad norm"));
    }
    testkit::assert_close_scalar(got.eval_loss, want.eval_loss, tol, &format!("{case}: eval"));
    assert_eq!(got.weights.len(), want.weights.len(), "{case}");
    for (n, w) in &want.weights {
        let e = rel_err(&got.weights[n], w);
        assert!(e <= weights_tol, "{case}: final weight {n}: rel err {e:e}");
    }
}

/// Final weights of two AdamW runs that saw the same gradients up to rounding: every tensor
/// within `tol` relative, once the entries AdamW may legitimately move apart are set aside.
/// AdamW's update `lr m / (sqrt(v) + eps)` turns the absolute rounding error of a gradient entry
/// that cancels to about `eps` into a change of up to `lr` per step (here: a factor lr / eps =
/// 5e5), so such entries can differ by up to `2 lr` per step and nothing else. They are
/// isolated: at most `1e-3` of all entries (a different routing or dropping decision would move
/// whole rows and expert matrices, hundreds of entries at once), each within `2 lr steps`.
pub fn assert_weights_close_up_to_adam(
    case: &str,
    got: &RegistryRun,
    want: &RegistryRun,
    lr: f64,
    tol: f64,
) {
    let steps = want.losses.len() as f64;
    let (mut total, mut apart) = (0usize, 0usize);
    assert_eq!(got.weights.len(), want.weights.len(), "{case}");
    for (n, w) in &want.weights {
        let a = got.weights[n]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = b
            .iter()
            .fold(0.0, |m, x| testkit::max_or_nan(m, x.abs() as f64));
        let (mut kept_a, mut kept_b) = (Vec::new(), Vec::new());
        for (x, y) in a.iter().zip(&b) {
            let d = (*x as f64 - *y as f64).abs();
            assert!(
                d <= 2.0 * lr * steps,
                "{case}: {n}: an entry moved {d:e} apart, more than AdamW's 2 lr per step allow"
            );
            if d > tol * scale {
                apart += 1;
            } else {
                kept_a.push(*x as f64);
                kept_b.push(*y as f64);
            }
        }
        total += b.len();
        let e = testkit::rel_err_values(&kept_a, &kept_b);
        assert!(e <= tol, "{case}: final weight {n}: rel err {e:e}");
    }
    assert!(
        apart as f64 <= 1e-3 * total as f64,
        "{case}: {apart} of {total} weight entries apart"
    );
}

/// Trains the model of `files`, loaded through the family registry, for `cfg.steps` steps of
/// `data` under `layout` (f32), through the run driver (see [`drive_through_registry`]); the
/// run's directory is removed afterwards.
pub fn train_through_registry(
    files: &ModelFiles,
    layout: &Layout,
    cfg: &train::trainer::TrainConfig,
    data: &train::data::PackedDataset,
) -> RegistryRun {
    let out = std::env::temp_dir().join(format!(
        "cpl-registry-{}-{}-{:?}",
        std::process::id(),
        layout.name,
        std::thread::current().id()
    ));
    let run = drive_through_registry(files, layout, cfg, data, None, &out);
    let _ = std::fs::remove_dir_all(&out);
    run
}

/// The driver's next-token task (what `cpl train` runs, and `cpl finetune`'s SFT with a LoRA
/// config and the adapters' initial values, else PEFT's initialisation) on the model of `files`, loaded through the family registry, under `layout` (f32):
/// `cfg.steps` steps of `data`, the held-out loss of its first 4 windows after the last step,
/// `metrics.jsonl` and the final checkpoint (`step-N`, with `files`' `config.json`, and under
/// LoRA the adapters with PEFT's `adapter_config.json`) in `out`.
/// With pipeline stages (`layout.mesh.pp > 1`) and no `cfg.pipeline`, the layers are split as
/// [`registry_pipeline`] does. Every rank's losses, norms and weights are asserted
/// bit-identical. Panics name the layout.
pub fn drive_through_registry<W: train::data::Windows + Sync + 'static>(
    files: &ModelFiles,
    layout: &Layout,
    cfg: &train::trainer::TrainConfig,
    data: &W,
    lora: Option<(
        &candle_parallel::nn::LoraConfig,
        Option<std::sync::Arc<dyn TensorSource>>,
    )>,
    out: &std::path::Path,
) -> RegistryRun {
    use std::sync::atomic::AtomicBool;
    use train::driver::tasks::NextTokenTask;
    use train::driver::RunOptions;
    use train::trainer::Trainer;
    let family = models::family::detect(&files.config).unwrap_or_else(|e| panic!("{e}"));
    let desc = (family.describe)(&files.config).unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = cfg.clone();
    if cfg.pipeline.is_none() {
        cfg.pipeline = registry_pipeline(layout, desc.layers);
    }
    std::fs::create_dir_all(out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let config = std::fs::read(&files.config).unwrap_or_else(|e| panic!("{e}"));
    let mut extra_files = vec![("config.json".to_string(), config)];
    if let Some((l, _)) = &lora {
        // What `cpl finetune` writes beside the adapters.
        let json = models::peft::AdapterConfig::from_lora(l, "base").to_json();
        extra_files.push((
            models::peft::CONFIG_NAME.into(),
            json.unwrap_or_else(|e| panic!("{e}")),
        ));
    }
    let opts = RunOptions {
        out: out.to_path_buf(),
        steps: cfg.steps,
        save_every: 0,
        keep: 1,
        eval_every: 0,
        log_every: 1,
        extra_files,
        max_shard_bytes: usize::MAX,
        flops_per_token: f64::NAN,
        peak_gflops: f64::NAN,
        peak_source: String::new(),
        banner: format!("{} under {}", family.name, layout.name),
        local_ranks: true,
        skip_nonfinite_steps: 0,
        tensorboard: None,
        detect_anomaly: false,
    };
    let out = LocalWorld::run(layout.ranks, |world| -> Result<_, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world.clone())?;
        let adapters = lora
            .as_ref()
            .map(|(c, src)| candle_parallel::nn::Adapters::new((*c).clone(), src.clone()))
            .transpose()
            .map_err(|x| e(&x))?;
        let mode = ParamMode::Trainable;
        let m = load_through_registry(files, &mesh, &ctx, cfg.pipeline.as_ref(), mode, adapters)
            .map_err(|x| e(&x))?;
        let trainer = Trainer::new(m.model, &mesh, &ctx, cfg.clone()).map_err(|x| e(&x))?;
        let mut task = NextTokenTask {
            trainer,
            data,
            eval: Some((data, 4)),
            count_key: "tokens",
            processed_tokens: None,
            by_position: None,
            passkey: None,
        };
        let history = train::driver::run(
            &mut task,
            &world,
            &opts,
            Default::default(),
            &AtomicBool::new(false),
        )
        .map_err(|x| e(&x))?;
        let losses = history.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
        let norms = history
            .steps
            .iter()
            .map(|s| s.grad_norm)
            .collect::<Vec<_>>();
        let eval = history.evals.last().map_or(f64::NAN, |p| p.loss);
        Ok((losses, norms, eval, whole_weights(&task.trainer, &mesh)?))
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

/// A frozen model's rank of `layout`: its mesh and context, the model of `files` loaded
/// through the registry (f32; this rank's pipeline stage), the family's description and the
/// pipeline.
pub struct FrozenRank<'a> {
    pub mesh: DeviceMesh,
    pub ctx: ParallelCtx,
    pub model: models::family::LoadedCausalLm,
    pub desc: &'a models::family::Description,
    pub pipeline: Option<&'a train::trainer::PipelineConfig>,
}

/// Runs `f` on every rank of `layout` with the frozen model of `files` (see [`FrozenRank`]);
/// errors name the layout.
pub fn with_frozen_model<T: Send>(
    files: &ModelFiles,
    layout: &Layout,
    f: impl Fn(&FrozenRank<'_>) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let family = models::family::detect(&files.config).map_err(|e| e.to_string())?;
    let desc = (family.describe)(&files.config).map_err(|e| e.to_string())?;
    let pipeline = registry_pipeline(layout, desc.layers);
    LocalWorld::run(layout.ranks, |world| -> Result<_, String> {
        let e = |x: &dyn std::fmt::Display| format!("{}: {x}", layout.name);
        let (mesh, ctx) = layout.context(world)?;
        let frozen = ParamMode::Frozen;
        let model = load_through_registry(files, &mesh, &ctx, pipeline.as_ref(), frozen, None)
            .map_err(|x| e(&x))?;
        let rank = FrozenRank {
            mesh,
            ctx,
            model,
            desc: &desc,
            pipeline: pipeline.as_ref(),
        };
        f(&rank).map_err(|x| e(&x))
    })
    .map_err(|e| e.to_string())
}

/// `cpl eval`'s scoring ([`train::evaluation::score`]) of the model of `files`, loaded
/// through the registry (frozen, f32) under `layout` (pipelined under `layout.mesh.pp > 1`):
/// the mean loss of `seqs` and, without a pipeline, their global logits. Every rank's loss is
/// asserted bit-identical.
pub fn eval_through_registry(
    files: &ModelFiles,
    layout: &Layout,
    seqs: &[Vec<u32>],
) -> (f64, Vec<Tensor>) {
    let out = with_frozen_model(files, layout, |r| {
        let act = train::evaluation::activation_dtype(&r.model.params);
        let opts = train::evaluation::ScoreOptions {
            pipeline: r.pipeline,
            logits: r.pipeline.is_none(),
            ..Default::default()
        };
        let model = r.model.model.as_ref();
        let (report, logits) = train::evaluation::score(&r.mesh, &r.ctx, model, act, seqs, &opts)
            .map_err(|x| x.to_string())?;
        Ok((report.loss, logits))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (i, (l, _)) in out.iter().enumerate() {
        let who = format!("{}: rank {i} vs rank 0: eval loss", layout.name);
        testkit::assert_identical_scalars(&[*l], &[out[0].0], &who);
    }
    out.into_iter().next().expect("one rank at least")
}

/// `cpl generate`'s greedy decoding ([`train::generation::generate`]) of `max_new` tokens
/// after `prompt` by the model of `files`, loaded through the registry (frozen, f32) under
/// `layout` (its pipeline stages under `layout.mesh.pp > 1`); every rank's tokens asserted
/// identical. Errors (a layout generation refuses) name the layout.
pub fn generate_through_registry(
    files: &ModelFiles,
    layout: &Layout,
    prompt: &[u32],
    max_new: usize,
) -> Result<Vec<u32>, String> {
    use train::generation::{argmax, generate, Stages};
    let out = with_frozen_model(files, layout, |r| {
        let layers = match r.pipeline {
            Some(pc) => pc.ranges()[r.mesh.coord(Dim::Pp)].clone(),
            None => 0..r.desc.layers,
        };
        let act = train::evaluation::activation_dtype(&r.model.params);
        let stages = Stages::new(&r.mesh, layers, r.desc.hidden, r.desc.vocab, act);
        generate(
            r.model.model.as_ref(),
            &stages,
            prompt,
            max_new,
            None,
            argmax,
        )
        .map_err(|x| x.to_string())
    })?;
    for (i, t) in out.iter().enumerate() {
        let who = format!("{}: rank {i} vs rank 0: generated tokens", layout.name);
        assert_eq!(t, &out[0], "{who}");
    }
    Ok(out.into_iter().next().unwrap_or_default())
}

/// `n` chat-like examples of 5 to 23 tokens from `seed` (ids below `vocab`): a prompt (not
/// trained) then a reply (trained), the prompts of varied lengths.
pub fn prompt_reply_examples(seed: u64, n: usize, vocab: u32) -> Vec<train::finetune::Example> {
    testkit::random_docs(seed, n, 5..24, vocab)
        .into_iter()
        .enumerate()
        .map(|(i, ids)| {
            let prompt = 1 + (i * 3) % (ids.len() - 2);
            let trained = (0..ids.len()).map(|j| j >= prompt).collect();
            train::finetune::Example { ids, trained }
        })
        .collect()
}

/// bf16 follows one bf16 rank: `got` (a parallel bf16 run's value) is no further from `want`
/// (the one-rank bf16 run's) than 1.5x `want`'s own distance to `f32` (the one-rank f32 run's),
/// floored at `floor`. Two bf16 runs round their reductions in different orders, so they differ
/// by about as much as bf16 differs from f32; a lost term (a shard, a ring step, a mask block)
/// moves a value by far more. Relative errors as [`rel_err`] (NaN fails).
pub fn assert_bf16_follows(got: &Tensor, want: &Tensor, f32: &Tensor, floor: f64, what: &str) {
    testkit::assert_finite(got, what);
    // A NaN in the references would make the bound the floor (`f64::max` drops NaN).
    testkit::assert_finite(want, &format!("{what} (one bf16 rank)"));
    testkit::assert_finite(f32, &format!("{what} (one f32 rank)"));
    let own = rel_err(want, f32);
    let e = rel_err(got, want);
    assert!(
        e <= 1.5 * own.max(floor),
        "{what}: {e:.3e} from one bf16 rank, which is {own:.3e} from f32 (bound 1.5 x max(own, {floor:e}))"
    );
}

/// [`assert_bf16_follows`] for scalars (a loss, a gradient norm).
pub fn assert_bf16_follows_scalar(got: f64, want: f64, f32: f64, floor: f64, what: &str) {
    let t = |x: f64| Tensor::new(&[x], &Device::Cpu).expect("a scalar tensor");
    assert_bf16_follows(&t(got), &t(want), &t(f32), floor, what);
}

/// Packed 32-token windows of `docs` synthetic documents of 40 tokens over a vocabulary of 256
/// (token `i` of document `d` is `(d · a + i · b + i²) mod 256`), continuous packing: the data
/// the family tests train on.
pub fn synthetic_windows(docs: u32, a: u32, b: u32) -> train::data::PackedDataset {
    use train::data::{PackedDataset, Packing, TokenStream};
    let docs: Vec<Vec<u32>> = (0..docs)
        .map(|d| (0..40).map(|i| (d * a + i * b + i * i) % 256).collect())
        .collect();
    PackedDataset::new(
        TokenStream::from_sequences(&docs, 256).unwrap(),
        32,
        Packing::Continuous,
    )
    .unwrap()
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
        seq_len_schedule: None,
    }
}
/// Generation with the KV cache of fixture `name`, a prompt of `prompt` tokens then one token
/// at a time over the fixture's sequence: each token's logits equal transformers' reference
/// logits of the full sequence (`tol` relative), on one rank and under tp2; a layer with a
/// sliding window keeps only the `w - 1` tokens later ones can see.
pub fn check_kv_cache(name: &str, prompt: usize, tol: f64) {
    use candle_core::{Device, Tensor};
    use candle_parallel::comm::LocalWorld;
    use models::causal_lm::KvCache;

    {
        let r = reference(name);
        let ids = r.input_ids[0].clone();
        let want = r.logits.narrow(0, 0, 1).unwrap().squeeze(0).unwrap();
        let config = fixture_files(name).config;
        let family = models::family::detect(&config).unwrap();
        let windows: Vec<usize> = (family.describe)(&config)
            .unwrap()
            .windowed
            .iter()
            .map(|&(_, w)| w)
            .collect();
        for layout in [
            Layout::single(),
            Layout::new("tp2", 2, 1, 1, Strategy::Ring),
        ] {
            LocalWorld::run(layout.ranks, |world| -> Result<(), String> {
                let (_mesh, ctx) = layout.context(world)?;
                let m = load_fixture_lm(name, &ctx, None)
                    .map_err(|e| e.to_string())?
                    .model;
                let mut cache = KvCache::default();
                // A prompt, then one token per step.
                let mut at = 0;
                for n in std::iter::once(prompt).chain(std::iter::repeat_n(1, ids.len() - prompt)) {
                    let next =
                        Tensor::from_vec(ids[at..at + n].to_vec(), (1, n), &Device::Cpu).unwrap();
                    let x = m.embed_cached(&next).map_err(|e| e.to_string())?;
                    let x = m
                        .layers_cached(&x, 0..m.num_layers(), &mut cache)
                        .map_err(|e| e.to_string())?;
                    cache.advance(n);
                    let logits = m.head_cached(&x).map_err(|e| e.to_string())?;
                    at += n;
                    let row = want.narrow(0, at - 1, 1).unwrap();
                    let e = rel_err(&logits, &row);
                    assert!(
                        e <= tol,
                        "{name} / {}: token {}: rel err {e}",
                        layout.name,
                        at - 1
                    );
                    // A windowed layer keeps the w - 1 tokens later ones can see, others all:
                    // as many trimmed layers as the family describes windowed ones.
                    let mut kept: Vec<usize> =
                        (0..m.num_layers()).map(|i| cache.layer_len(i)).collect();
                    kept.sort_unstable();
                    let mut want: Vec<usize> = windows
                        .iter()
                        .map(|&w| at.min(w - 1))
                        .chain(std::iter::repeat_n(at, m.num_layers() - windows.len()))
                        .collect();
                    want.sort_unstable();
                    assert_eq!(kept, want, "{name}: cached tokens per layer at {at}");
                }
                Ok(())
            })
            .unwrap();
        }
    }
}

/// bf16 end to end: fixture `name`'s bf16 step under `layout` follows the one-rank bf16 step.
/// bf16 keeps 8 bits and a parallel run rounds its reductions in another order, so the two bf16
/// runs differ by about as much as bf16 differs from f32. Asserted: the loss within 1e-2 and the
/// logits within 7e-2 of one bf16 rank (as `llama_layouts`' bf16 test argues), and every
/// gradient finite, non-zero and no further from the one-rank bf16 gradient than 1.5x the
/// one-rank bf16 run's own distance to f32 (floored at 5e-2): a lost term (a missing shard, ring
/// step, mask block or expert) moves a gradient by 25-100%, far more. (k biases are skipped:
/// their gradient is zero up to rounding.)
pub fn check_bf16_follows_one_rank(name: &str, layout: &Layout) {
    let bf16 = StepPlan {
        dtype: Some(candle_core::DType::BF16),
        ..StepPlan::default()
    };
    let f32_run = run_layout(name, &Layout::single());
    let want = run_layout_with(name, &Layout::single(), bf16);
    let got = run_layout_with(name, layout, bf16);
    let case = format!("{name} bf16 {}", layout.name);
    testkit::assert_close_scalar(
        got.loss as f64,
        want.loss as f64,
        1e-2,
        &format!("{case}: loss"),
    );
    testkit::assert_close(&got.logits, &want.logits, 7e-2, &format!("{case}: logits"));
    let mut worst = (0.0f64, 0.0f64);
    for (n, g) in &want.grads {
        let ours = &got.grads[n];
        testkit::assert_finite(ours, &format!("{case}: gradient of {n}"));
        assert!(max_abs(ours) > 0.0, "{case}: the gradient of {n} is zero");
        // The k bias's gradient is zero in exact arithmetic (the softmax does not change
        // when every score of a query moves by the same q·b): what remains is rounding.
        if n.ends_with("k_proj.bias") {
            continue;
        }
        let own = rel_err(g, &f32_run.grads[n]);
        let e = rel_err(ours, g);
        assert!(
            e <= 1.5 * own.max(5e-2),
            "{case}: gradient of {n}: {e:.3e} from one bf16 rank, which is {own:.3e} from f32"
        );
        worst = (worst.0.max(e), worst.1.max(own));
    }
    eprintln!(
        "{case}: worst gradient {:.2e} from one bf16 rank, {:.2e} bf16 vs f32",
        worst.0, worst.1
    );
}

/// Fixture `name` loaded under tp2 and saved (gathered, in the checkpoint's layout: fused
/// projections fused back, experts per expert; sharded with an index, its config copied) reloads
/// through the registry on one rank with bit-identical logits, and the saved tensors are the
/// fixture's checkpoint's, bit for bit.
pub fn check_saved_under_tp2_reloads(name: &str) {
    use candle_parallel::comm::LocalWorld;
    use models::checkpoint::{gather_tp, write_hf_dir, SaveOptions};

    let out = std::env::temp_dir();
    {
        let want = run_layout(name, &Layout::single()).logits;
        let dir = out.join(format!(
            "cpl-saved-{}-{}-tp2",
            std::process::id(),
            name.replace('/', "-")
        ));
        let opts = SaveOptions {
            dtype: candle_core::DType::F32,
            max_shard_bytes: 60_000,
            extra_files: vec![(
                "config.json".into(),
                std::fs::read(fixture_dir(name).join("config.json")).unwrap(),
            )],
            ..Default::default()
        };
        let layout = Layout::new("tp2", 2, 1, 1, Strategy::Ring);
        LocalWorld::run(2, |world| -> Result<(), String> {
            let (_mesh, ctx) = layout.context(world)?;
            let m = load_fixture_lm(name, &ctx, None).map_err(|e| e.to_string())?;
            let tp = ctx.tp().comm();
            let keep = tp.rank() == 0;
            let full =
                gather_tp(&m.params.sorted(), tp, keep, opts.dtype).map_err(|e| e.to_string())?;
            if keep {
                let full = m.model.to_checkpoint(full).map_err(|e| e.to_string())?;
                write_hf_dir(&full, &dir, &opts).map_err(|e| e.to_string())?;
            }
            Ok(())
        })
        .unwrap();
        assert!(dir.join("model.safetensors.index.json").is_file(), "{name}");
        let saved = models::hub::from_dir("saved", &dir).unwrap();
        assert!(
            stored_tensors(&saved) == stored_tensors(&fixture_files(name)),
            "{name}: the saved tensors differ from the checkpoint's"
        );
        let family = models::family::detect(&saved.config).unwrap();
        let load = family.load_causal_lm.unwrap();
        let ids = reference(name).input_ids;
        let got = LocalWorld::run(1, |world| -> Result<candle_core::Tensor, String> {
            let (_mesh, ctx) = Layout::single().context(world)?;
            let all = 0..load_fixture_lm(name, &ctx, None)
                .map_err(|e| e.to_string())?
                .model
                .num_layers();
            let spec = models::family::LoadSpec {
                ctx: &ctx,
                dtype: None,
                mode: candle_parallel::nn::ParamMode::Frozen,
                layers: std::slice::from_ref(&all),
                ends: true,
                adapters: None,
            };
            let m = load(&saved, &spec).map_err(|e| e.to_string())?;
            let (batch, _) = candle_parallel::nn::Batch::from_sequences(
                &ctx,
                &ids,
                candle_parallel::attention::AttnMask::Causal,
            )
            .map_err(|e| e.to_string())?;
            m.model.logits(&batch).map_err(|e| e.to_string())
        })
        .unwrap()
        .swap_remove(0);
        testkit::assert_identical(&got, &want, &format!("{name}: reloaded logits"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Every tensor of a checkpoint, by name, as f32 values.
pub fn stored_tensors(files: &models::hub::ModelFiles) -> Vec<(String, Vec<f32>)> {
    let r = models::checkpoint::CheckpointReader::open(&files.weights).unwrap();
    let mut names = r.names();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let whole = candle_parallel::nn::Shard::replicated();
            let t = r.read(&n, whole, &candle_core::Device::Cpu).unwrap();
            (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// Two sets of saved tensors (as [`stored_tensors`] reads them) hold the same names in the same
/// order and values within `tol` relative (NaN fails). Panics name `case`.
pub fn assert_same_saved(
    case: &str,
    got: &[(String, Vec<f32>)],
    want: &[(String, Vec<f32>)],
    tol: f64,
) {
    assert_eq!(got.len(), want.len(), "{case}: saved tensors");
    let f = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m, "{case}");
        let e = testkit::rel_err_values(&f(a), &f(b));
        assert!(e <= tol, "{case}: saved {n}: rel err {e:e}");
    }
}
