//! One rank's training loop state: the model, its optimizer and learning-rate schedule, and the
//! step that turns a global batch into an optimizer update.
//!
//! Contract of [`Trainer::run_step`] (collective over the world, every rank calls it with the
//! same step number and objective): the step's global batch is `dp · batch · grad_accum`
//! sequences (samples, pairs) dealt by the [`Objective`]; data-parallel rank `d` trains on its
//! `batch · grad_accum`; each micro-batch is cut into this rank's sequence shard by the layout
//! and run forward and backward on its own, with this rank's loss scaled to its share of the
//! global mean; gradients are accumulated in f32, summed over the ranks sharing each parameter,
//! clipped by the global norm, and applied by AdamW (f32 master weights and moments) in
//! [`Trainer::apply`]. The mean loss over the global batch is returned, identical on every
//! rank. [`Trainer::step`] is that step with the next-token loss ([`NextToken`]).
//!
//! The memory plan ([`TrainConfig::memory`]) is applied to the model's units by
//! [`MemoryPlan::apply`]: ZeRO stage 1 keeps each rank's optimizer state for its chunk of every
//! parameter only (all-gathering the updated parameters after the step), stage 2 also
//! reduce-scatters each micro-batch's gradients into chunks, stage 3 also shards the parameters
//! themselves (each unit gathers its parameters for each use; see [`candle_parallel::nn::unit`]).
//! The sharding group is `ulysses × ring × dp` or a part of it ([`ZeroGroups`]). Activation
//! checkpointing recomputes each block in backward ([`candle_parallel::recompute`]). Under a
//! pipeline ([`TrainConfig::pipeline`]) each rank holds one stage's parameters and a step's
//! micro-batches run through the stages by the schedule (the objective's
//! [`Objective::staged`] model under [`run_stage_step`]); the gradient norm adds over the
//! stages, counting a parameter held by two stages once. None of these changes a loss or a
//! weight beyond rounding (the tests assert 1e-5 against the single-rank run).

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::comm::{Comm, ReduceOp};
use candle_parallel::mesh::{DeviceMesh, Dim};
use candle_parallel::nn::{Batch, CrossEntropyOptions, ParallelCtx, Param, Shard, IGNORE_INDEX};
use candle_parallel::optim::{
    clip_coefficient, decays, global_grad_norm_staged, AdamW, AdamWConfig, Decay, FlatShard,
    LrSchedule, OptimParam, StageNorm, ZeroGroups, ZeroStage,
};
use candle_parallel::pipeline::{
    run_stage_step, ExecTimes, PipelineSchedule, ScheduleKind, StageLoss, StageStep,
};
use candle_parallel::plan::{MemoryPlan, Parallelize, PlannedParams};
use models::causal_lm::{CausalLm, LmStages, StageMicroBatch};
use models::llama::Llama;
use serde::{Deserialize, Serialize};

use crate::data::{Batching, MicroBatch, Windows};
use crate::error::{Error, Result};
use crate::objective::{NextToken, Objective, StepCtx};
use crate::schedule::{SeqLenSchedule, StepShape};

/// A model the trainer can optimise: units a memory plan can walk, and which parameters
/// several pipeline stages hold.
pub trait TrainModel: Parallelize + Send {
    /// Names of the parameters this rank holds that the other end of a pipeline holds too
    /// (the model's end units): they count once in the global gradient norm, on the first
    /// stage. Local.
    fn end_params(&self) -> Vec<String> {
        Vec::new()
    }

    /// Stem of the checkpoint's weight files ([`models::checkpoint::SaveOptions::weights_name`]).
    fn weights_name(&self) -> &'static str {
        "model"
    }

    /// The name parameter `name` is saved under (PEFT's `base_model.model.` prefix for
    /// adapters, a multimodal checkpoint's layout).
    fn saved_name(&self, name: &str) -> String {
        name.to_string()
    }

    /// The whole saved tensors (by [`TrainModel::saved_name`]) in the layout of the family's
    /// checkpoint (Phi-3's fused projections, see [`CausalLm::to_checkpoint`]).
    fn checkpoint_tensors(
        &self,
        tensors: Vec<(String, Tensor)>,
    ) -> models::Result<Vec<(String, Tensor)>> {
        Ok(tensors)
    }

    /// Whether checkpoints hold the frozen parameters too (a frozen vision tower: yes; the
    /// base model under LoRA: no, only the adapters).
    fn saves_frozen(&self) -> bool {
        true
    }
}

/// A pipeline step's schedule, the blocks of every virtual stage, and the variables a stage
/// differentiates by name ([`Trainer::pipeline_setup`]).
pub type PipelineSetup = (
    PipelineSchedule,
    Vec<std::ops::Range<usize>>,
    Vec<(String, Var)>,
);

/// What one step of an objective reports: the step's statistics and the means of the loss
/// parts over the global count ([`Objective::part_names`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub stats: StepStats,
    pub parts: Vec<f64>,
}

/// The training behaviour of every causal LM: with LoRA only the adapters train, and
/// checkpoints are PEFT adapters.
macro_rules! causal_lm_train_model {
    ($t:ty) => {
        impl TrainModel for $t {
            fn end_params(&self) -> Vec<String> {
                CausalLm::end_params(self)
            }

            fn weights_name(&self) -> &'static str {
                if CausalLm::adapters(self).is_some() {
                    models::peft::WEIGHTS_NAME
                } else {
                    "model"
                }
            }

            fn saved_name(&self, name: &str) -> String {
                if CausalLm::adapters(self).is_some() {
                    format!("{}{name}", models::peft::PREFIX)
                } else {
                    name.to_string()
                }
            }

            fn saves_frozen(&self) -> bool {
                CausalLm::adapters(self).is_none()
            }

            fn checkpoint_tensors(
                &self,
                tensors: Vec<(String, Tensor)>,
            ) -> models::Result<Vec<(String, Tensor)>> {
                CausalLm::to_checkpoint(self, tensors)
            }
        }
    };
}

causal_lm_train_model!(Llama);
// Any registered family's causal LM ([`models::family::Family::load_causal_lm`]).
causal_lm_train_model!(Box<dyn CausalLm>);

/// Evaluation of a causal LM through a pipeline: `micro` (this rank's sequence shards) forward
/// through the stages ([`PipelineSchedule::forward_only`]). Returns the summed loss (the same
/// on every pipeline rank) and the labelled tokens of this rank's shards. Collective over `pp`;
/// nothing to do (and no communication) when `micro` is empty, which it then is on every rank
/// of `pp`.
pub fn pipeline_eval<M: CausalLm + ?Sized>(
    model: &M,
    pp: &Comm,
    pc: &PipelineConfig,
    micro: &[StageMicroBatch],
    opts: CrossEntropyOptions,
    dtype: DType,
) -> Result<(f64, u64)> {
    if micro.is_empty() {
        return Ok((0.0, 0));
    }
    let schedule = PipelineSchedule::forward_only(pp.size(), micro.len(), pc.virtual_stages)?;
    let ranges = pc.ranges();
    let step = StageStep {
        schedule: &schedule,
        layers: &ranges,
        pp,
        global_count: 1,
        dtype,
    };
    // The next-token loss alone, as `CausalLm::loss_sum` without a pipeline.
    let staged = LmStages {
        model,
        opts,
        balancing_loss: false,
    };
    let loss = run_stage_step(&staged, &step, micro, Vec::new(), 0)?.loss_sum;
    let mut count = 0u64;
    for m in micro {
        let labels = m.labels.flatten_all()?.to_vec1::<i64>()?;
        count += labels.iter().filter(|&&l| l != IGNORE_INDEX).count() as u64;
    }
    Ok((loss, count))
}

/// Pipeline settings of a run (`--pp` above 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineConfig {
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (2 or more for the interleaved schedule).
    pub virtual_stages: usize,
    /// Decoder layers of every virtual stage, in order (`--pp-layers`, or the default split).
    pub layers: Vec<usize>,
}

impl PipelineConfig {
    /// The layer ranges of the virtual stages.
    pub fn ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut start = 0;
        self.layers
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect()
    }
}

/// Settings of a training run that the step needs (the CLI adds paths and logging).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Optimizer steps of the run.
    pub steps: u64,
    /// Sequences per micro-batch on each data-parallel rank (one forward/backward).
    pub batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Llama 3 document masking of packed sequences.
    pub doc_mask: bool,
    /// Seed of the data order.
    pub seed: u64,
    pub shuffle: bool,
    pub adamw: AdamWConfig,
    pub schedule: LrSchedule,
    /// Clip gradients to this global norm (none: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Tokens per chunk of the vocab-parallel loss.
    pub loss_chunk_tokens: usize,
    /// ZeRO stage and groups, activation checkpointing.
    #[serde(flatten)]
    pub memory: MemoryPlan,
    /// Pipeline schedule and stages (`None`: no pipeline).
    #[serde(default)]
    pub pipeline: Option<PipelineConfig>,
    /// The length curriculum (`None`: every step at `seq_len`). Under one, `seq_len`, `batch`
    /// and `grad_accum` are those of the current phase ([`Trainer::set_shape`]), so a
    /// checkpoint's config says where in the schedule it was saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len_schedule: Option<SeqLenSchedule>,
}

impl TrainConfig {
    /// The run of the benchmarks and memory measurements: one sequence of `seq_len` tokens per
    /// data-parallel rank and step, `steps` steps at the constant learning rate `lr` (AdamW
    /// otherwise torch's defaults), clipping to norm 1, no pipeline, data in order from seed 0.
    pub fn constant_lr(
        seq_len: usize,
        steps: u64,
        lr: f64,
        loss_chunk_tokens: usize,
        memory: MemoryPlan,
    ) -> Self {
        Self {
            seq_len,
            steps,
            batch: 1,
            grad_accum: 1,
            doc_mask: false,
            seed: 0,
            shuffle: false,
            adamw: AdamWConfig {
                lr,
                ..AdamWConfig::default()
            },
            schedule: LrSchedule {
                peak_lr: lr,
                min_lr: lr,
                warmup_steps: 0,
                total_steps: steps,
                decay: Decay::Constant,
            },
            max_grad_norm: Some(1.0),
            loss_chunk_tokens,
            memory,
            pipeline: None,
            seq_len_schedule: None,
        }
    }
}

/// What one optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// 0-based index of the step just taken.
    pub step: u64,
    /// Mean next-token loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens with a label in the global batch.
    pub tokens: u64,
    /// Under a pipeline: the measured bubble, the fraction of the pipeline ranks' step time
    /// outside the model's forward and backward (summed over the pipeline ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_bubble: Option<f64>,
    /// Attention work of the step: the query-key scores flash-ring's CPU kernels computed on
    /// the busiest rank of the ulysses × ring × dp group (forward, backward and recomputation;
    /// masked and out-of-window tiles are skipped, so a window or a document mask lowers it).
    #[serde(default)]
    pub attention_scores: u64,
    /// Balance of that work: the busiest rank's scores over the mean of its sequence-parallel
    /// (ulysses × ring) group, the worst group over the data-parallel replicas. `None` when
    /// nothing was counted (kernels that do not count: the composite path, GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_work_max_over_mean: Option<f64>,
    /// Where the ranks' time went in this step (the straggler report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<RankTimes>,
    /// Payload bytes this rank sent in the step's communication calls (the communicator's
    /// traffic counters; the step's `comm` spans of `--trace` add up to it).
    #[serde(default)]
    pub comm_bytes_sent: u64,
}

/// The step's time on every rank of the world, split into compute (everything but
/// communication) and communication (inside communication calls, waiting for peers included:
/// `candle_parallel::comm::CommTimer`): maxima, means, and the rank with the most compute.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RankTimes {
    pub compute_max: f64,
    pub compute_mean: f64,
    pub comm_max: f64,
    pub comm_mean: f64,
    /// The world rank with the longest compute time: the straggler when `compute_max` stands
    /// out from `compute_mean`.
    pub slowest_rank: usize,
}

/// Where a trainable parameter's value lives under the memory plan: the ZeRO stage as a
/// parameter-state strategy. Each state knows how to give the whole value, take and gather
/// its optimizer entries, and collect a micro-batch's gradient; the trainer does not match on
/// the stage for those.
enum ParamState {
    /// The model's whole tensor-parallel slice, trained in place (no ZeRO).
    Whole(Var),
    /// ZeRO-1/2: the model keeps the whole slice; the optimizer trains this rank's chunk (a
    /// copy), gathered into the whole after each step. Under ZeRO-2 each micro-batch's
    /// gradient is reduce-scattered into the chunk.
    Mirrored {
        whole: Var,
        chunk: Chunk,
        reduce_scatter: bool,
    },
    /// ZeRO-3: the model's unit holds only this rank's chunk, trained directly.
    Sharded(Chunk),
}

/// This rank's chunk of a parameter under ZeRO: the variable, how the tensor is cut, and the
/// sharding group it is cut over.
struct Chunk {
    var: Var,
    flat: FlatShard,
    group: Comm,
    /// The ranks holding the same chunk, whose chunk gradients add up (ZeRO's replica group;
    /// with the tensor-parallel ranks for a replicated parameter under TP-sp).
    replicas: Comm,
}

impl Chunk {
    /// The whole tensor of `chunk` (this rank's chunk of a tensor shaped `shape`). Collective
    /// over the sharding group.
    fn gather(&self, chunk: &Tensor, shape: &[usize]) -> Result<Tensor> {
        Ok(self.flat.gather(chunk, &self.group, shape)?)
    }
}

/// One trainable parameter as the trainer handles it.
struct TrainParam {
    name: String,
    /// Tensor-parallel split.
    shard: Shard,
    /// This expert-parallel rank's alone ([`Param::expert_parallel`]).
    expert: bool,
    global_shape: Vec<usize>,
    /// Shape of this rank's tensor-parallel slice.
    local_shape: Vec<usize>,
    state: ParamState,
}

impl TrainParam {
    /// The variable the optimizer updates.
    fn optimized(&self) -> &Var {
        match &self.state {
            ParamState::Whole(v) => v,
            ParamState::Mirrored { chunk, .. } | ParamState::Sharded(chunk) => &chunk.var,
        }
    }

    /// The variable autograd differentiates (whole slice or, under ZeRO-3, the chunk).
    fn differentiated(&self) -> &Var {
        match &self.state {
            ParamState::Whole(v) | ParamState::Mirrored { whole: v, .. } => v,
            ParamState::Sharded(chunk) => &chunk.var,
        }
    }

    /// The chunk the optimizer trains under ZeRO.
    fn chunk(&self) -> Option<&Chunk> {
        match &self.state {
            ParamState::Whole(_) => None,
            ParamState::Mirrored { chunk, .. } | ParamState::Sharded(chunk) => Some(chunk),
        }
    }

    /// The current value of this rank's whole tensor-parallel slice. Collective over the
    /// sharding group under ZeRO-3.
    fn whole_value(&self) -> Result<Tensor> {
        match &self.state {
            ParamState::Whole(v) | ParamState::Mirrored { whole: v, .. } => {
                Ok(v.as_tensor().detach())
            }
            ParamState::Sharded(c) => c.gather(&c.var.as_tensor().detach(), &self.local_shape),
        }
    }

    /// An optimizer entry of this parameter (shaped as the optimized variable) shaped as the
    /// tensor-parallel slice. Collective over the sharding group under ZeRO.
    fn whole_entry(&self, t: Tensor) -> Result<Tensor> {
        match self.chunk() {
            Some(c) => c.gather(&t, &self.local_shape),
            None => Ok(t),
        }
    }

    /// This rank's part of an entry shaped as the tensor-parallel slice. Local.
    fn own_entry(&self, t: &Tensor) -> Result<Tensor> {
        match self.chunk() {
            Some(c) => Ok(c.flat.take(t)?),
            None => Ok(t.clone()),
        }
    }

    /// A micro-batch's gradient `g` of the differentiated variable as it is accumulated: f32,
    /// and under ZeRO-2 this rank's chunk, reduce-scattered over the sharding group
    /// (collective then).
    fn collect(&self, g: &Tensor) -> Result<Tensor> {
        match &self.state {
            ParamState::Mirrored {
                chunk,
                reduce_scatter: true,
                ..
            } => Ok(chunk.flat.reduce_scatter(g, &chunk.group)?),
            _ => Ok(candle_parallel::optim::to_f32(g)?),
        }
    }

    /// The step's accumulated gradient `g` summed over every rank it is summed over: whole
    /// gradients over `grad_group` (the ranks sharing the parameter; ZeRO-1 then keeps this
    /// rank's chunk), chunks already summed over the sharding group over its replicas.
    /// Collective over those groups.
    fn reduce_gradient(&self, g: Tensor, grad_group: &Comm) -> Result<Tensor> {
        match &self.state {
            ParamState::Mirrored {
                chunk,
                reduce_scatter: true,
                ..
            }
            | ParamState::Sharded(chunk) => all_reduce_if(&chunk.replicas, g),
            _ => self.own_entry(&all_reduce_if(grad_group, g)?),
        }
    }

    /// After an optimizer step: the whole slice set from the updated chunks (ZeRO-1/2).
    /// Collective over the sharding group then; nothing to do otherwise.
    fn refresh(&self) -> Result<()> {
        if let ParamState::Mirrored { whole, chunk, .. } = &self.state {
            whole.set(&chunk.gather(chunk.var.as_tensor(), &self.local_shape)?)?;
        }
        Ok(())
    }
}

/// A parameter that does not train, kept for saving: as loaded, or under ZeRO-3 this rank's
/// chunk and its sharding group.
enum FrozenParam {
    Resident(Param),
    Sharded(candle_parallel::nn::ShardedParam, Comm),
}

impl FrozenParam {
    /// Its whole tensor-parallel slice. Collective over the sharding group under ZeRO-3.
    fn whole(&self) -> Result<Param> {
        Ok(match self {
            FrozenParam::Resident(p) => {
                Param::value(&p.name, p.tensor.detach(), p.shard, &p.global_shape)
            }
            FrozenParam::Sharded(c, group) => Param::value(
                &c.name,
                c.flat
                    .gather(&c.var.as_tensor().detach(), group, &c.local_shape)?,
                c.shard,
                &c.global_shape,
            ),
        })
    }
}

/// One rank's trainer of a model `M`.
pub struct Trainer<M = Llama> {
    pub model: M,
    params: Vec<TrainParam>,
    /// Parameters that do not train (saved with checkpoints when the model says so).
    frozen: Vec<FrozenParam>,
    pub optimizer: AdamW,
    pub cfg: TrainConfig,
    ctx: ParallelCtx,
    tp: Comm,
    zero: Option<ZeroGroups>,
    /// ulysses × ring × dp: the ranks whose losses add up to the global loss.
    loss_group: Comm,
    batching: Batching,
    dp_rank: usize,
    /// The pipeline group (one rank without a pipeline).
    pp: Comm,
    /// Schedules by micro-batch count, made when first needed.
    schedules: HashMap<usize, PipelineSchedule>,
    /// Optimizer steps taken (the next step's index).
    /// Every rank (the straggler report; this rank's number in anomaly reports and traces).
    world: Comm,
    pub step: u64,
}

/// Test hook (never set in normal use): with `CPL_TEST_NAN_GRAD_STEP=<step>`, the first
/// accumulated gradient of optimizer step `<step>` becomes NaN on the ranks where `here` (tp
/// and dp rank 0), so a test can watch a run meet a non-finite step (`bin/tests/train_cli.rs`).
fn poison_for_tests(
    mut acc: Vec<(String, Tensor)>,
    step: u64,
    here: bool,
) -> Result<Vec<(String, Tensor)>> {
    let hit = std::env::var("CPL_TEST_NAN_GRAD_STEP")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        == Some(step);
    if let (true, true, Some((_, g))) = (hit, here, acc.first_mut()) {
        *g = (g.ones_like()? * f64::NAN)?;
    }
    Ok(acc)
}

/// Test hook (never set in normal use): with `CPL_TEST_SLOW_RANK=<rank>:<ms>`, world rank
/// `<rank>` sleeps `<ms>` milliseconds at the start of every step, so a test can watch the
/// straggler report name it (`bin/tests/train_cli.rs`).
fn slow_down_for_tests(rank: usize) {
    let Ok(v) = std::env::var("CPL_TEST_SLOW_RANK") else {
        return;
    };
    let parsed = v
        .split_once(':')
        .and_then(|(r, ms)| Some((r.parse::<usize>().ok()?, ms.parse::<u64>().ok()?)));
    if let Some((_, ms)) = parsed.filter(|p| p.0 == rank) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// With anomaly detection on ([`candle_parallel::nn::anomaly`]), the first non-finite gradient
/// of `grads` as an error naming its parameter.
fn check_gradients(grads: &[(String, Tensor)]) -> Result<()> {
    if candle_parallel::nn::anomaly::detect_anomaly() {
        for (name, g) in grads {
            candle_parallel::nn::anomaly::check_finite(g, name, "gradient")?;
        }
    }
    Ok(())
}

/// `e` with the step, the world `rank` and the micro-batch (`None`: the accumulated gradients,
/// or pipeline stages) when it is an anomaly report ([`candle_parallel::Error::NonFinite`],
/// however deep it was wrapped); other errors unchanged.
fn locate(e: Error, step: u64, rank: usize, micro: Option<usize>) -> Error {
    let msg = e.to_string();
    if !msg.contains("non-finite values (NaN or inf) in the") {
        return e;
    }
    let micro = micro.map_or_else(
        || "all micro-batches".into(),
        |m| format!("micro-batch {m}"),
    );
    Error::Anomaly {
        step,
        rank,
        micro,
        msg,
    }
}

fn no_gradient(name: &str) -> Error {
    Error::Invalid(format!("parameter `{name}` received no gradient"))
}

impl<M: TrainModel> Trainer<M> {
    /// Applies the memory plan to `model` (built for `ctx` on `mesh`, trainable) and builds the
    /// optimizer over its parameters (no weight decay on 1-D tensors). Collective over the
    /// world.
    pub fn new(
        mut model: M,
        mesh: &DeviceMesh,
        ctx: &ParallelCtx,
        cfg: TrainConfig,
    ) -> Result<Self> {
        if cfg.batch == 0 || cfg.grad_accum == 0 {
            return Err(Error::Invalid(
                "the batch size and gradient accumulation must be at least 1".into(),
            ));
        }
        match &cfg.pipeline {
            Some(pc) if pc.layers.len() != mesh.size(Dim::Pp) * pc.virtual_stages => {
                return Err(Error::Invalid(format!(
                    "{} layer counts for {} pipeline ranks x {} virtual stages",
                    pc.layers.len(),
                    mesh.size(Dim::Pp),
                    pc.virtual_stages
                )))
            }
            None if mesh.size(Dim::Pp) > 1 => {
                return Err(Error::Invalid(
                    "a pipeline mesh (pp > 1) needs a pipeline configuration".into(),
                ))
            }
            _ => {}
        }
        let experts = ctx.expert_groups().cloned();
        let zero = cfg
            .memory
            .zero_groups(mesh)?
            .map(|z| z.with_experts(mesh, experts.as_ref()))
            .transpose()?;
        let param_meta = |p: &Param| (p.name.clone(), p.shard, p.global_shape.clone());
        let planned = cfg.memory.apply(&mut model, zero.as_ref())?;
        let tp_sp = ctx.tp().sequence_parallel();
        // The sharding group and the replica group of a parameter split (or not) over tp; an
        // expert's are among the ranks holding the same experts.
        let groups = |shard: &Shard, expert: bool| -> Result<(Comm, Comm)> {
            let z = zero.as_ref().ok_or_else(|| {
                Error::Invalid("internal: parameters sharded without ZeRO groups".into())
            })?;
            if let (Some(e), true) = (&z.experts, expert) {
                return Ok((e.shard.clone(), e.replica.clone()));
            }
            let replicas = if tp_sp && !shard.is_split() {
                &z.replica_tp
            } else {
                &z.replica
            };
            Ok((z.shard.clone(), replicas.clone()))
        };
        let frozen: Vec<FrozenParam> = match &planned {
            PlannedParams::Sharded(chunks) => chunks
                .iter()
                .filter(|c| !c.trainable)
                .map(|c| {
                    let group = groups(&c.shard, c.expert_parallel)?.0;
                    Ok(FrozenParam::Sharded(c.clone(), group))
                })
                .collect::<Result<_>>()?,
            PlannedParams::Resident(params) => params
                .iter()
                .filter(|p| p.var.is_none())
                .map(|p| FrozenParam::Resident(p.clone()))
                .collect(),
        };
        let params: Vec<TrainParam> = match planned {
            // Frozen parameters (the base model under LoRA) are not trained.
            PlannedParams::Sharded(chunks) => chunks
                .into_iter()
                .filter(|s| s.trainable)
                .map(|s| {
                    let (group, replicas) = groups(&s.shard, s.expert_parallel)?;
                    Ok(TrainParam {
                        name: s.name,
                        shard: s.shard,
                        expert: s.expert_parallel,
                        global_shape: s.global_shape,
                        local_shape: s.local_shape,
                        state: ParamState::Sharded(Chunk {
                            var: s.var,
                            flat: s.flat,
                            group,
                            replicas,
                        }),
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            PlannedParams::Resident(params) => params
                .iter()
                .filter_map(|p| p.var.clone().map(|whole| (p, whole)))
                .map(|(p, whole)| {
                    let state = match &zero {
                        Some(_) => {
                            // An expert is sharded over the ranks that hold it.
                            let (group, replicas) = groups(&p.shard, p.expert_parallel)?;
                            let flat =
                                FlatShard::new(p.tensor.elem_count(), group.rank(), group.size())?;
                            let var = Var::from_tensor(&flat.take(&p.tensor)?)?;
                            ParamState::Mirrored {
                                whole,
                                chunk: Chunk {
                                    var,
                                    flat,
                                    group,
                                    replicas,
                                },
                                reduce_scatter: cfg.memory.zero == ZeroStage::Gradients,
                            }
                        }
                        None => ParamState::Whole(whole),
                    };
                    let (name, shard, global_shape) = param_meta(p);
                    Ok(TrainParam {
                        name,
                        shard,
                        expert: p.expert_parallel,
                        global_shape,
                        local_shape: p.tensor.dims().to_vec(),
                        state,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if params.is_empty() {
            return Err(Error::Invalid(
                "the model has no trainable parameter (was it loaded frozen?)".into(),
            ));
        }
        let optim_params = params
            .iter()
            .map(|p| OptimParam {
                name: p.name.clone(),
                var: p.optimized().clone(),
                weight_decay: decays(&p.name, &p.global_shape),
            })
            .collect();
        let optimizer = AdamW::new(optim_params, cfg.adamw)?;
        let batching = Batching {
            dp: mesh.size(Dim::Dp),
            batch: cfg.batch,
            grad_accum: cfg.grad_accum,
            doc_mask: cfg.doc_mask,
            seed: cfg.seed,
            shuffle: cfg.shuffle,
        };
        Ok(Self {
            model,
            params,
            frozen,
            optimizer,
            ctx: ctx.clone(),
            tp: mesh.comm(Dim::Tp),
            zero,
            loss_group: mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?,
            batching,
            dp_rank: mesh.coord(Dim::Dp),
            pp: mesh.comm(Dim::Pp),
            schedules: HashMap::new(),
            world: mesh.world(),
            cfg,
            step: 0,
        })
    }

    /// The pipeline group (one rank without a pipeline).
    pub fn pp(&self) -> &Comm {
        &self.pp
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// The tensor-parallel group (for saving).
    pub fn tp(&self) -> &Comm {
        &self.tp
    }

    /// How the step's global batch is dealt.
    pub fn batching(&self) -> &Batching {
        &self.batching
    }

    /// Trains the next steps on sequences of `shape.seq_len` tokens, `shape.batch` per
    /// micro-batch and `shape.grad_accum` micro-batches per step and data-parallel rank (a
    /// length curriculum's phase); the config records it, so checkpoints do.
    pub fn set_shape(&mut self, shape: StepShape) -> Result<()> {
        if shape.batch == 0 || shape.grad_accum == 0 {
            return Err(Error::Invalid(
                "the batch size and gradient accumulation must be at least 1".into(),
            ));
        }
        self.cfg.seq_len = shape.seq_len;
        self.cfg.batch = shape.batch;
        self.cfg.grad_accum = shape.grad_accum;
        self.batching.batch = shape.batch;
        self.batching.grad_accum = shape.grad_accum;
        Ok(())
    }

    /// This rank's coordinate on the data-parallel dimension.
    pub fn dp_rank(&self) -> usize {
        self.dp_rank
    }

    /// Sequences per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.batching.global_batch()
    }

    /// The tensor-parallel split of the parameter an optimizer state entry (`exp_avg.<name>`,
    /// `exp_avg_sq.<name>`, `master.<name>`) belongs to.
    pub fn entry_shard(&self, entry: &str) -> Result<Shard> {
        Ok(self.param(entry)?.shard)
    }

    /// The expert-parallel group when the model's experts are divided over ranks: a parameter
    /// or optimizer entry that [`Trainer::is_expert`] names is held by one rank of it.
    pub fn expert_group(&self) -> Option<&Comm> {
        self.ctx.expert_parallel()
    }

    /// Whether the parameter or optimizer state entry (`exp_avg.<name>`, ...) `entry` is an
    /// expert held by this expert-parallel rank alone.
    pub fn is_expert(&self, entry: &str) -> bool {
        self.param(entry).is_ok_and(|p| p.expert)
    }

    /// The model's parameters with their whole tensor-parallel slices (current values), sorted
    /// by name, for saving and comparing. Collective over the ZeRO sharding group under stage 3
    /// (every rank calls it), local otherwise.
    pub fn whole_params(&self) -> Result<Vec<Param>> {
        let mut out = self.trained_params()?;
        if self.model.saves_frozen() {
            for f in &self.frozen {
                out.push(f.whole()?);
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
        }
        Ok(out)
    }

    /// The trained parameters with their whole tensor-parallel slices (see
    /// [`Trainer::whole_params`]).
    fn trained_params(&self) -> Result<Vec<Param>> {
        self.params
            .iter()
            .map(|p| {
                Ok(
                    Param::value(&p.name, p.whole_value()?, p.shard, &p.global_shape)
                        .with_expert_parallel(p.expert),
                )
            })
            .collect()
    }

    fn param(&self, entry: &str) -> Result<&TrainParam> {
        let name = entry.split_once('.').map(|(_, n)| n).unwrap_or(entry);
        self.params
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Error::Invalid(format!("optimizer state `{entry}` names no parameter")))
    }

    /// The optimizer state ([`AdamW::state_tensors`]: `exp_avg.<name>`, `exp_avg_sq.<name>`,
    /// `master.<name>`) with every tensor shaped as this rank's tensor-parallel slice of its
    /// parameter: gathered over the ZeRO sharding group when sharded (collective then).
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (entry, t) in self.optimizer.state_tensors()? {
            let t = self.param(&entry)?.whole_entry(t)?;
            out.push((entry, t));
        }
        Ok(out)
    }

    /// Restores the optimizer from entries shaped as [`Trainer::optimizer_state`] returns them
    /// (this rank takes its chunks under ZeRO) and the step count, and sets the parameters to
    /// the restored master weights.
    pub fn load_optimizer_state(
        &mut self,
        tensors: HashMap<String, Tensor>,
        step: u64,
    ) -> Result<()> {
        let mut local = HashMap::with_capacity(tensors.len());
        for (entry, t) in tensors {
            let p = self.param(&entry)?;
            if t.dims() != p.local_shape.as_slice() {
                return Err(Error::Invalid(format!(
                    "optimizer state `{entry}` has shape {:?}, this rank's slice of `{}` has {:?}",
                    t.dims(),
                    p.name,
                    p.local_shape
                )));
            }
            let t = p.own_entry(&t)?;
            local.insert(entry, t);
        }
        self.optimizer.load_state(&local, step)?;
        self.gather_updated()?;
        self.step = step;
        Ok(())
    }

    /// Backward of this rank's summed loss `loss_sum` scaled by `1 / global_count` (the global
    /// batch's count of what the loss sums: tokens, samples), and this rank's gradients as
    /// [`Trainer::forward_backward`] returns them. Collective over the world.
    pub fn backward_collect(
        &self,
        loss_sum: &Tensor,
        global_count: u64,
    ) -> Result<(f64, Vec<(String, Tensor)>)> {
        let sum = loss_sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let share = (loss_sum / global_count as f64)?;
        let store = self.ctx.backward(&share)?;
        Ok((sum, self.collect(&store)?))
    }

    /// Ends optimizer step `self.step`: sums this rank's `loss_sum` over the ranks holding
    /// different data (ulysses × ring × dp), applies the accumulated gradients `acc`
    /// ([`Trainer::apply`]) and advances. The loss reported is that sum over `global_count`.
    /// A non-finite loss or gradient norm applies nothing, advances, and is
    /// [`Error::NonFinite`] on every rank. Collective over the world.
    pub fn apply_step(
        &mut self,
        acc: Vec<(String, Tensor)>,
        loss_sum: f64,
        global_count: u64,
        pp_bubble: Option<f64>,
    ) -> Result<StepStats> {
        let step = self.step;
        let total = self
            .loss_group
            .all_reduce(&Tensor::new(&[loss_sum], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        let loss = total / global_count as f64;
        // Every rank decides alike: the loss is the same over a stage's ranks, the gradient
        // norm over the world; the stages compare losses.
        let mut bad = f64::from(u8::from(!loss.is_finite()));
        if self.pp.size() > 1 {
            bad = self
                .pp
                .all_reduce(&Tensor::new(&[bad], &Device::Cpu)?, ReduceOp::Max)?
                .to_vec1::<f64>()?[0];
        }
        let applied = if bad > 0.0 {
            Err(Error::NonFinite {
                step,
                what: format!("the loss is {loss}"),
            })
        } else {
            self.apply(acc, step)
        };
        let (grad_norm, lr) = match applied {
            Err(e @ Error::NonFinite { .. }) => {
                candle_parallel::attention::take_attention_scores();
                self.step += 1;
                return Err(e);
            }
            other => other?,
        };
        // Counted on this rank's thread since the last step (flash-ring counts per caller).
        let scores = candle_parallel::attention::take_attention_scores() as f64;
        let balance = self.work_balance(scores)?;
        let scores = self
            .loss_group
            .all_reduce(&Tensor::new(&[scores], &Device::Cpu)?, ReduceOp::Max)?
            .to_vec1::<f64>()?[0];
        self.step += 1;
        Ok(StepStats {
            step,
            loss,
            lr,
            grad_norm,
            tokens: global_count,
            pp_bubble,
            attention_scores: scores as u64,
            attention_work_max_over_mean: balance,
            ranks: None,
            comm_bytes_sent: 0,
        })
    }

    /// Every rank's compute and communication time since `started` (see [`RankTimes`]).
    /// Collective over the world.
    fn rank_times(&self, started: std::time::Instant) -> Result<RankTimes> {
        let comm = candle_parallel::comm::take_comm_seconds();
        let compute = (started.elapsed().as_secs_f64() - comm).max(0.0);
        let all = self
            .world
            .all_gather(&Tensor::new(&[compute, comm], &Device::Cpu)?, 0)?
            .to_vec1::<f64>()?;
        let n = (all.len() / 2).max(1) as f64;
        let (computes, comms): (Vec<f64>, Vec<f64>) = all.chunks(2).map(|c| (c[0], c[1])).unzip();
        let slowest_rank =
            computes
                .iter()
                .enumerate()
                .fold(0, |best, (i, &c)| if c > computes[best] { i } else { best });
        Ok(RankTimes {
            compute_max: computes.iter().copied().fold(0.0, f64::max),
            compute_mean: computes.iter().sum::<f64>() / n,
            comm_max: comms.iter().copied().fold(0.0, f64::max),
            comm_mean: comms.iter().sum::<f64>() / n,
            slowest_rank,
        })
    }

    /// [`StepStats::attention_work_max_over_mean`] from this rank's `scores`. Collective over
    /// the world (the sequence-parallel group, then the data group).
    fn work_balance(&self, scores: f64) -> Result<Option<f64>> {
        let seq = self.ctx.sequence_group();
        let t = Tensor::new(&[scores], &Device::Cpu)?;
        let max = seq.all_reduce(&t, ReduceOp::Max)?.to_vec1::<f64>()?[0];
        let sum = seq.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?[0];
        let ratio = if sum > 0.0 {
            max * seq.size() as f64 / sum
        } else {
            0.0
        };
        let worst = self
            .loss_group
            .all_reduce(&Tensor::new(&[ratio], &Device::Cpu)?, ReduceOp::Max)?
            .to_vec1::<f64>()?[0];
        Ok((worst > 0.0).then_some(worst))
    }

    /// Sums `values` over the ranks holding different data (ulysses × ring × dp). Collective
    /// over that group.
    pub fn sum_over_data(&self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(self
            .loss_group
            .all_reduce(&Tensor::new(values, &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?)
    }
}

impl<M: TrainModel> Trainer<M> {
    /// What objectives see of this trainer when they deal a step's data.
    pub fn step_ctx(&self) -> StepCtx<'_> {
        StepCtx {
            ctx: &self.ctx,
            cfg: &self.cfg,
            batching: &self.batching,
            dp_rank: self.dp_rank,
            pp: &self.pp,
            dtype: self.activation_dtype(),
        }
    }

    /// Runs optimizer step `self.step` of objective `obj` on `data` and advances: the one step
    /// loop of every model and objective (see the [module docs](self)). Collective over the
    /// world.
    pub fn run_step<O: Objective<M>>(&mut self, obj: &O, data: &O::Data) -> Result<StepReport> {
        let step = self.step;
        // The step's attention work and communication time are counted from here (evaluations
        // in between excluded).
        candle_parallel::attention::take_attention_scores();
        candle_parallel::comm::take_comm_seconds();
        let started = std::time::Instant::now();
        let _span = tracing::info_span!("step", step, rank = self.world.rank()).entered();
        let sent_before = self.world.traffic().snapshot().bytes_sent();
        slow_down_for_tests(self.world.rank());
        let count = obj.global_count(&self.step_ctx(), data, step)?;
        if count == 0 {
            return Err(Error::Invalid(format!(
                "step {step}: nothing to train on in the batch"
            )));
        }
        let micro = tracing::info_span!("data")
            .in_scope(|| obj.micro_batches(&self.step_ctx(), &self.model, data, step))?;
        let num_parts = obj.part_names().len();
        candle_parallel::nn::anomaly::set_step(step);
        let rank = self.world.rank();
        let at = move |e: Error, micro: Option<usize>| locate(e, step, rank, micro);
        let (loss_sum, mut parts, acc, bubble) = if self.cfg.pipeline.is_some() {
            let (schedule, ranges, vars) = self.pipeline_setup(micro.len())?;
            let step = StageStep {
                schedule: &schedule,
                layers: &ranges,
                pp: &self.pp,
                global_count: count,
                dtype: self.activation_dtype(),
            };
            let staged = obj.staged(&self.model)?;
            let mut out = tracing::info_span!("pipeline")
                .in_scope(|| run_stage_step(&staged, &step, &micro, vars, num_parts))
                .map_err(|e| at(e.into(), None))?;
            let acc = self.collect_with(|p| out.grads.remove(&p.name))?;
            let bubble = self.pipeline_bubble(out.times)?;
            (out.loss_sum, out.parts, acc, Some(bubble))
        } else {
            let mut acc: Vec<(String, Tensor)> = Vec::new();
            let (mut loss_sum, mut parts) = (0f64, vec![0f64; num_parts]);
            for (i, m) in micro.iter().enumerate() {
                let _span = tracing::info_span!("micro_batch", i).entered();
                let StageLoss { sum, parts: p } =
                    obj.loss(&self.model, m).map_err(|e| at(e, Some(i)))?;
                let (s, grads) = tracing::info_span!("backward")
                    .in_scope(|| self.backward_collect(&sum, count))?;
                check_gradients(&grads).map_err(|e| at(e, Some(i)))?;
                loss_sum += s;
                for (a, x) in parts.iter_mut().zip(p) {
                    *a += x;
                }
                candle_parallel::optim::accumulate(&mut acc, grads)?;
            }
            (loss_sum, parts, acc, None)
        };
        // A whole-sequence loss is the same on every rank of a sequence group: count it once.
        let counted = !obj.whole_sequence_loss() || self.ctx.sequence_group().rank() == 0;
        let keep = |v: f64| if counted { v } else { 0.0 };
        if num_parts > 0 {
            parts = self
                .sum_over_data(&parts.iter().map(|&v| keep(v)).collect::<Vec<_>>())?
                .into_iter()
                .map(|v| v / count as f64)
                .collect();
        }
        let mut stats = tracing::info_span!("optimizer")
            .in_scope(|| self.apply_step(acc, keep(loss_sum), count, bubble))?;
        stats.ranks = Some(self.rank_times(started)?);
        stats.comm_bytes_sent = self.world.traffic().snapshot().bytes_sent() - sent_before;
        Ok(StepReport { stats, parts })
    }

    /// The summed loss and parts of `micro` (this rank's micro-batches) forward only, through
    /// the pipeline stages under a pipeline: the same on every pipeline rank, this rank's
    /// sequence shards; not summed over the data ranks. Collective over the world; nothing to
    /// do (and no communication) when `micro` is empty, which it then is on every rank.
    pub fn forward_losses<O: Objective<M>>(
        &self,
        obj: &O,
        micro: &[O::Micro],
    ) -> Result<(f64, Vec<f64>)> {
        let num_parts = obj.part_names().len();
        if micro.is_empty() {
            return Ok((0.0, vec![0.0; num_parts]));
        }
        if let Some(pc) = &self.cfg.pipeline {
            let schedule =
                PipelineSchedule::forward_only(self.pp.size(), micro.len(), pc.virtual_stages)?;
            let ranges = pc.ranges();
            let step = StageStep {
                schedule: &schedule,
                layers: &ranges,
                pp: &self.pp,
                global_count: 1,
                dtype: self.activation_dtype(),
            };
            let staged = obj.staged(&self.model)?;
            let out = run_stage_step(&staged, &step, micro, Vec::new(), num_parts)?;
            return Ok((out.loss_sum, out.parts));
        }
        let (mut sum, mut parts) = (0f64, vec![0f64; num_parts]);
        for m in micro {
            let l = obj.loss(&self.model, m)?;
            sum += l.sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            for (a, x) in parts.iter_mut().zip(l.parts) {
                *a += x;
            }
        }
        Ok((sum, parts))
    }
}

impl<M: TrainModel + CausalLm> Trainer<M> {
    /// Forward and backward of one micro-batch with the next-token loss, this rank's loss
    /// scaled by `1 / global_tokens`. Returns this rank's summed loss and its gradients in name
    /// order: of the whole parameter slices, or under ZeRO stages 2 and 3 of this rank's chunks
    /// (reduce-scattered over the sharding group), f32. Collective over the world.
    pub fn forward_backward(
        &self,
        micro: &MicroBatch,
        global_tokens: u64,
    ) -> Result<(f64, Vec<(String, Tensor)>)> {
        let (batch, labels) = Batch::from_padded_tokens(
            &self.ctx,
            &micro.ids,
            &micro.labels,
            micro.mask.clone(),
            &micro.padding,
        )?;
        let l = NextToken::for_model(&self.cfg, &self.model)
            .loss(&self.model, &StageMicroBatch { batch, labels })?;
        self.backward_collect(&l.sum, global_tokens)
    }
}

impl<M: TrainModel> Trainer<M> {
    /// Under a pipeline: the schedule of a step of `micro_batches` (made once per count), the
    /// blocks of every virtual stage, and the variables a stage differentiates by name (the
    /// parameters, or under ZeRO-3 their chunks). Local.
    pub fn pipeline_setup(&mut self, micro_batches: usize) -> Result<PipelineSetup> {
        let pc = self
            .cfg
            .pipeline
            .clone()
            .ok_or_else(|| Error::Invalid("no pipeline configured".into()))?;
        if !self.schedules.contains_key(&micro_batches) {
            let s = PipelineSchedule::new(
                pc.schedule,
                self.pp.size(),
                micro_batches,
                pc.virtual_stages,
            )?;
            self.schedules.insert(micro_batches, s);
        }
        let vars = self
            .params
            .iter()
            .map(|p| (p.name.clone(), p.differentiated().clone()))
            .collect();
        Ok((self.schedules[&micro_batches].clone(), pc.ranges(), vars))
    }

    /// The pipeline's measured bubble of a step from this rank's executor times (see
    /// [`StepStats::pp_bubble`]). Collective over the pipeline group.
    pub fn pipeline_bubble(&self, times: ExecTimes) -> Result<f64> {
        let t = Tensor::new(&[times.compute, times.wall], &Device::Cpu)?;
        let t = self.pp.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?;
        Ok(ExecTimes {
            compute: t[0],
            wall: t[1],
        }
        .idle())
    }

    /// Dtype of the model's activations: that of its parameters.
    pub fn activation_dtype(&self) -> DType {
        self.params
            .first()
            .map(|p| p.differentiated().dtype())
            .unwrap_or(DType::F32)
    }

    /// Every parameter's gradient from `store` in name order, f32; under ZeRO-2 this rank's
    /// chunk of it, reduce-scattered over the sharding group (collective then).
    fn collect(&self, store: &GradStore) -> Result<Vec<(String, Tensor)>> {
        self.collect_with(|p| store.get(p.differentiated().as_tensor()).cloned())
    }

    /// [`Trainer::collect`] from any source of the differentiated variables' gradients.
    fn collect_with(
        &self,
        mut grad_of: impl FnMut(&TrainParam) -> Option<Tensor>,
    ) -> Result<Vec<(String, Tensor)>> {
        self.params
            .iter()
            .map(|p| {
                let g = grad_of(p).ok_or_else(|| no_gradient(&p.name))?;
                Ok((p.name.clone(), p.collect(&g)?))
            })
            .collect()
    }

    /// Sums the accumulated gradients over the ranks that share each parameter, clips them by
    /// the global norm, and applies AdamW with the learning rate of `step`; under ZeRO stages 1
    /// and 2 then gathers the updated parameters. Returns the norm before clipping and the
    /// learning rate. A non-finite norm applies nothing and is [`Error::NonFinite`].
    /// Collective over the world.
    pub fn apply(&mut self, acc: Vec<(String, Tensor)>, step: u64) -> Result<(f64, f64)> {
        if acc.len() != self.params.len() {
            return Err(Error::Invalid(format!(
                "{} gradients for {} parameters",
                acc.len(),
                self.params.len()
            )));
        }
        let mut grads = Vec::with_capacity(acc.len());
        let acc = poison_for_tests(acc, step, self.tp.rank() == 0 && self.dp_rank == 0)?;
        check_gradients(&acc).map_err(|e| locate(e, step, self.world.rank(), None))?;
        for (p, (n, g)) in self.params.iter().zip(acc) {
            if p.name != n {
                return Err(Error::Invalid(format!(
                    "gradient `{n}` given for parameter `{}`",
                    p.name
                )));
            }
            let g = p.reduce_gradient(g, self.ctx.grad_group(&p.shard, p.expert))?;
            grads.push((n, g));
        }
        let split: HashMap<&str, (bool, bool)> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), (p.shard.is_split(), p.expert)))
            .collect();
        let (tp, zero) = (self.tp.clone(), self.zero.clone());
        let experts = self.ctx.expert_groups().cloned();
        // The ranks whose pieces of a parameter make up its gradient once (for the norm).
        let group_of = |name: &str| -> Option<Comm> {
            let (is_split, expert) = split.get(name).copied().unwrap_or((false, false));
            let zero_experts = zero.as_ref().and_then(|z| z.experts.as_ref());
            match (&zero, &experts, zero_experts) {
                // Each expert-parallel rank holds other experts (split over tp, except the
                // adapter factors replicated over it); under ZeRO, chunks of them.
                (None, Some(e), _) if expert && is_split => Some(e.ep_tp.clone()),
                (None, Some(e), _) if expert => Some(e.ep.clone()),
                (_, _, Some(z)) if expert && is_split => Some(z.norm_tp.clone()),
                (_, _, Some(z)) if expert => Some(z.norm.clone()),
                (None, _, _) => is_split.then(|| tp.clone()),
                (Some(z), _, _) if is_split => Some(z.shard_tp.clone()),
                (Some(z), _, _) => Some(z.shard.clone()),
            }
        };
        // Under a pipeline each stage adds its parameters; one held by several stages counts
        // on the first.
        let first_stage = self.pp.rank() == 0;
        let ends: std::collections::HashSet<String> = self.model.end_params().into_iter().collect();
        let counted = |name: &str| first_stage || !ends.contains(name);
        let staged = StageNorm {
            comm: &self.pp,
            counted: &counted,
        };
        let stages = (self.pp.size() > 1).then_some(&staged);
        let grad_norm = global_grad_norm_staged(&grads, &group_of, stages)?;
        // Clipping is applied by the optimizer as it reads the gradients (`step_clipped`).
        let clip = match self.cfg.max_grad_norm {
            Some(max) => clip_coefficient(grad_norm, max)?,
            None => None,
        };
        let lr = self.cfg.schedule.lr(step);
        if !grad_norm.is_finite() {
            // The same norm on every rank: none applies the update.
            return Err(Error::NonFinite {
                step,
                what: format!("the gradient norm is {grad_norm}"),
            });
        }
        self.optimizer.step_clipped(&grads, lr, clip)?;
        self.gather_updated()?;
        Ok((grad_norm, lr))
    }

    /// ZeRO stages 1 and 2: sets every whole parameter from the sharding group's updated
    /// chunks. Collective over the sharding group; nothing to do otherwise.
    fn gather_updated(&self) -> Result<()> {
        for p in &self.params {
            p.refresh()?;
        }
        Ok(())
    }
}

impl<M: TrainModel + CausalLm> Trainer<M> {
    /// The mean next-token loss of the model on the first `max_windows` windows of `data` (in
    /// stream order, dealt round-robin to the data-parallel ranks) and the labelled tokens it
    /// counts. No gradient is applied. Collective over the world.
    pub fn eval_loss(
        &self,
        data: &(impl Windows + ?Sized),
        max_windows: usize,
    ) -> Result<(f64, u64)> {
        let n = data.num_windows().min(max_windows.max(1));
        let mut micro = Vec::new();
        let mut count = 0f64;
        let mine: Vec<usize> = (self.dp_rank..n).step_by(self.batching.dp).collect();
        // Every rank runs as many forwards as the busiest, since a forward may be collective
        // over the data ranks (ZeRO-3 gathers parameters in each, expert parallelism exchanges
        // tokens): the others score a window with no label.
        let runs = n.div_ceil(self.batching.dp);
        for j in 0..runs {
            let (i, pad) = match mine.get(j) {
                Some(&i) => (i, false),
                None => (0, true),
            };
            let mut w = data.window(i);
            if pad {
                w.labels.iter_mut().for_each(|l| *l = IGNORE_INDEX);
            }
            let mask = if self.cfg.doc_mask {
                candle_parallel::attention::AttnMask::documents(w.doc_ids.clone())
            } else {
                candle_parallel::attention::AttnMask::Causal
            };
            let (batch, labels) = Batch::from_padded_tokens(
                &self.ctx,
                &[w.ids],
                std::slice::from_ref(&w.labels),
                mask,
                &[w.padding],
            )?;
            let local = labels.flatten_all()?.to_vec1::<i64>()?;
            count += local.iter().filter(|&&l| l != IGNORE_INDEX).count() as f64;
            micro.push(StageMicroBatch { batch, labels });
        }
        let (sum, _) = self.forward_losses(
            &NextToken::for_model(&self.cfg, &self.model).for_evaluation(),
            &micro,
        )?;
        let t = self
            .loss_group
            .all_reduce(&Tensor::new(&[sum, count], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
        // The sequence-parallel ranks of a window each count their part of its tokens.
        Ok((t[0] / t[1].max(1.0), t[1] as u64))
    }

    /// Runs optimizer step `self.step` with the next-token loss on `data` and advances.
    /// Collective over the world.
    pub fn step(&mut self, data: &(impl Windows + 'static)) -> Result<StepStats> {
        Ok(self.step_with_parts(data)?.0)
    }

    /// [`Trainer::step`] with the loss's named parts (a mixture of experts' routing,
    /// [`crate::objective::ROUTER_PARTS`]; none for other models). Collective over the world.
    pub fn step_with_parts(
        &mut self,
        data: &(impl Windows + 'static),
    ) -> Result<(StepStats, Vec<(String, f64)>)> {
        let obj = NextToken::for_model(&self.cfg, &self.model);
        let report = self.run_step(&obj, data as &dyn Windows)?;
        let names = <NextToken as Objective<M>>::part_names(&obj);
        let parts = names.into_iter().zip(report.parts).collect();
        Ok((report.stats, parts))
    }
}

/// `g` summed over `group` (itself when the group has one rank).
fn all_reduce_if(group: &Comm, g: Tensor) -> Result<Tensor> {
    Ok(if group.size() > 1 {
        group.all_reduce(&g, ReduceOp::Sum)?
    } else {
        g
    })
}
