//! One rank's training loop state: the model, its optimizer and learning-rate schedule, and the
//! step that turns a global batch of windows into an optimizer update.
//!
//! Contract of [`Trainer::step`] (collective over the world, every rank calls it with the same
//! step number): the step's global batch is `dp · batch · grad_accum` windows chosen by the
//! [`Sampler`]; data-parallel rank `d` trains on its `batch · grad_accum`; each micro-batch of
//! `batch` windows is cut into this rank's sequence shard by the layout, run forward and
//! backward on its own ([`Trainer::forward_backward`]), with this rank's loss scaled to its
//! share of the global mean; gradients are accumulated in f32, summed over the ranks sharing
//! each parameter, clipped by the global norm, and applied by AdamW (f32 master weights and
//! moments) in [`Trainer::apply`]. The mean loss over the global batch is returned, identical on
//! every rank.
//!
//! Memory plans ([`TrainConfig::zero`], [`TrainConfig::checkpointing`]): ZeRO stage 1 keeps
//! each rank's optimizer state for its chunk of every parameter only (all-gathering the updated
//! parameters after the step), stage 2 also reduce-scatters each micro-batch's gradients into
//! chunks, stage 3 also shards the parameters themselves (the model gathers each layer for each
//! use; see [`models::unit`]). The sharding group is `ulysses × ring × dp` or a part of it
//! ([`ZeroGroups`]). Activation checkpointing recomputes each decoder layer in backward
//! ([`candle_parallel::recompute`]). None of these changes a loss or a weight beyond rounding
//! (the tests assert 1e-5 against the single-rank run).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::AttnMask;
use candle_parallel::comm::{Comm, ReduceOp};
use candle_parallel::layers::{CrossEntropyOptions, ParallelCtx};
use candle_parallel::mesh::{DeviceMesh, Dim};
use candle_parallel::optim::{
    clip_grad_norm, decays, global_grad_norm, AdamW, AdamWConfig, FlatShard, LrSchedule,
    OptimParam, ZeroGroups, ZeroStage,
};
use candle_parallel::recompute::Checkpointing;
use models::checkpoint::{Param, Shard};
use models::grads::{accumulate, collect_gradients, reduce_gradients};
use models::llama::{Batch, Llama};
use serde::{Deserialize, Serialize};

use crate::data::{PackedDataset, Sampler, Window, IGNORE};
use crate::error::{Error, Result};

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
    /// ZeRO stage.
    #[serde(default)]
    pub zero: ZeroStage,
    /// Ranks per ZeRO sharding group (none: all of ulysses × ring × dp).
    #[serde(default)]
    pub zero_group: Option<usize>,
    /// Activation checkpointing of the decoder layers.
    #[serde(default)]
    pub checkpointing: Checkpointing,
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
}

/// The sequences of one forward and backward pass, in global (unsharded) form.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub ids: Vec<Vec<u32>>,
    pub labels: Vec<Vec<i64>>,
    pub mask: AttnMask,
}

/// One trainable parameter as the trainer handles it.
struct TrainParam {
    name: String,
    /// Tensor-parallel split.
    shard: Shard,
    global_shape: Vec<usize>,
    /// Shape of this rank's tensor-parallel slice.
    local_shape: Vec<usize>,
    /// The model's parameter (whole slice); `None` under ZeRO-3.
    var: Option<Var>,
    /// Under ZeRO: this rank's chunk and the `Var` the optimizer updates (under ZeRO-3 the
    /// model's own; under stages 1 and 2 a copy whose update is gathered into `var`).
    chunk: Option<(FlatShard, Var)>,
}

/// One rank's trainer.
pub struct Trainer {
    pub model: Llama,
    params: Vec<TrainParam>,
    pub optimizer: AdamW,
    pub cfg: TrainConfig,
    ctx: ParallelCtx,
    tp: Comm,
    zero: Option<ZeroGroups>,
    /// ulysses × ring × dp: the ranks whose losses add up to the global loss.
    loss_group: Comm,
    dp: usize,
    dp_rank: usize,
    /// Optimizer steps taken (the next step's index).
    pub step: u64,
}

impl Trainer {
    /// Builds the optimizer over `params` (the model's, as loaded; no weight decay on 1-D
    /// tensors), applies the configured checkpointing and ZeRO stage (under stage 3 the model's
    /// parameters become chunks and `params` is dropped). Collective over the world.
    pub fn new(
        mut model: Llama,
        params: Vec<Param>,
        mesh: &DeviceMesh,
        ctx: &ParallelCtx,
        cfg: TrainConfig,
    ) -> Result<Self> {
        if cfg.batch == 0 || cfg.grad_accum == 0 {
            return Err(Error::Invalid(
                "--batch and --grad-accum must be at least 1".into(),
            ));
        }
        let mut params = params;
        params.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(p) = params.iter().find(|p| p.var.is_none()) {
            return Err(Error::Invalid(format!(
                "parameter `{}` is not trainable",
                p.name
            )));
        }
        model.set_checkpointing(cfg.checkpointing);
        let zero = match cfg.zero {
            ZeroStage::Off => None,
            _ => Some(ZeroGroups::new(mesh, cfg.zero_group)?),
        };
        let train_params: Vec<TrainParam> = match (&zero, cfg.zero) {
            (Some(z), ZeroStage::Parameters) => model
                .shard_parameters(&params, &z.shard)?
                .into_iter()
                .map(|s| TrainParam {
                    name: s.name,
                    shard: s.shard,
                    global_shape: s.global_shape,
                    local_shape: s.local_shape,
                    var: None,
                    chunk: Some((s.flat, s.var)),
                })
                .collect(),
            (zero, _) => params
                .iter()
                .map(|p| {
                    let chunk = match zero {
                        Some(z) => {
                            let flat = z.flat_shard(p.tensor.elem_count())?;
                            Some((flat, Var::from_tensor(&flat.take(&p.tensor)?)?))
                        }
                        None => None,
                    };
                    Ok(TrainParam {
                        name: p.name.clone(),
                        shard: p.shard,
                        global_shape: p.global_shape.clone(),
                        local_shape: p.tensor.dims().to_vec(),
                        var: p.var.clone(),
                        chunk,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        drop(params);
        let optim_params = train_params
            .iter()
            .map(|p| {
                let var = match (&p.chunk, &p.var) {
                    (Some((_, v)), _) | (None, Some(v)) => v.clone(),
                    (None, None) => {
                        return Err(Error::Invalid(format!(
                            "parameter `{}` has neither a value nor a chunk",
                            p.name
                        )))
                    }
                };
                Ok(OptimParam {
                    name: p.name.clone(),
                    var,
                    weight_decay: decays(&p.name, &p.global_shape),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let optimizer = AdamW::new(optim_params, cfg.adamw)?;
        Ok(Self {
            model,
            params: train_params,
            optimizer,
            ctx: ctx.clone(),
            tp: mesh.comm(Dim::Tp),
            zero,
            loss_group: mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?,
            dp: mesh.size(Dim::Dp),
            dp_rank: mesh.coord(Dim::Dp),
            cfg,
            step: 0,
        })
    }

    pub fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    /// The tensor-parallel group (for saving).
    pub fn tp(&self) -> &Comm {
        &self.tp
    }

    /// Sequences per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.dp * self.cfg.batch * self.cfg.grad_accum
    }

    /// The tensor-parallel split of the parameter an optimizer state entry (`exp_avg.<name>`,
    /// `exp_avg_sq.<name>`, `master.<name>`) belongs to.
    pub fn entry_shard(&self, entry: &str) -> Result<Shard> {
        Ok(self.param(entry)?.shard)
    }

    /// The model's parameters with their whole tensor-parallel slices (current values), sorted
    /// by name, for saving and comparing. Collective over the ZeRO sharding group under stage 3
    /// (every rank calls it), local otherwise.
    pub fn whole_params(&self) -> Result<Vec<Param>> {
        self.params
            .iter()
            .map(|p| {
                let tensor = match (&p.var, &p.chunk, &self.zero) {
                    (Some(v), _, _) => v.as_tensor().detach(),
                    (None, Some((flat, c)), Some(z)) => {
                        flat.gather(&c.as_tensor().detach(), &z.shard, &p.local_shape)?
                    }
                    _ => {
                        return Err(Error::Invalid(format!(
                            "parameter `{}` has no value",
                            p.name
                        )))
                    }
                };
                Ok(Param {
                    name: p.name.clone(),
                    var: None,
                    tensor,
                    shard: p.shard,
                    global_shape: p.global_shape.clone(),
                })
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
            let p = self.param(&entry)?;
            let t = match (&p.chunk, &self.zero) {
                (Some((flat, _)), Some(z)) => flat.gather(&t, &z.shard, &p.local_shape)?,
                _ => t,
            };
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
            let t = match &p.chunk {
                Some((flat, _)) => flat.take(&t)?,
                None => t,
            };
            local.insert(entry, t);
        }
        self.optimizer.load_state(&local, step)?;
        self.gather_updated()?;
        self.step = step;
        Ok(())
    }

    fn sampler(&self, data: &PackedDataset) -> Sampler {
        Sampler {
            num_windows: data.num_windows(),
            seed: self.cfg.seed,
            shuffle: self.cfg.shuffle,
        }
    }

    /// The windows data-parallel rank `d` trains on in `step`.
    fn windows(&self, data: &PackedDataset, step: u64, d: usize) -> Vec<Window> {
        let s = self.sampler(data);
        let micro = self.cfg.batch * self.cfg.grad_accum;
        s.samples(step, self.dp, d, micro)
            .into_iter()
            .map(|k| data.window(s.window_of(k)))
            .collect()
    }

    /// Labelled tokens in the global batch of `step` (known to every rank without
    /// communication).
    pub fn global_tokens(&self, data: &PackedDataset, step: u64) -> u64 {
        (0..self.dp)
            .flat_map(|d| self.windows(data, step, d))
            .map(|w| w.labels.iter().filter(|&&l| l != IGNORE).count() as u64)
            .sum()
    }

    /// This rank's micro-batches of `step`: `grad_accum` groups of `batch` windows (with
    /// document masks one forward per sequence, each with its own mask).
    pub fn micro_batches(&self, data: &PackedDataset, step: u64) -> Vec<MicroBatch> {
        let windows = self.windows(data, step, self.dp_rank);
        let mut out = Vec::new();
        for micro in windows.chunks(self.cfg.batch) {
            let groups: Vec<&[Window]> = if self.cfg.doc_mask {
                micro.chunks(1).collect()
            } else {
                vec![micro]
            };
            for g in groups {
                out.push(MicroBatch {
                    ids: g.iter().map(|w| w.ids.clone()).collect(),
                    labels: g.iter().map(|w| w.labels.clone()).collect(),
                    mask: if self.cfg.doc_mask {
                        AttnMask::documents(g[0].doc_ids.clone())
                    } else {
                        AttnMask::Causal
                    },
                });
            }
        }
        out
    }

    /// Forward and backward of one micro-batch, this rank's loss scaled by `1 / global_tokens`.
    /// Returns this rank's summed loss and its gradients in name order: of the whole
    /// parameter slices, or under ZeRO stages 2 and 3 of this rank's chunks (reduce-scattered
    /// over the sharding group), f32. Collective over the world.
    pub fn forward_backward(
        &self,
        micro: &MicroBatch,
        global_tokens: u64,
    ) -> Result<(f64, Vec<(String, Tensor)>)> {
        let opts = CrossEntropyOptions {
            chunk_tokens: self.cfg.loss_chunk_tokens,
            ..Default::default()
        };
        let (batch, labels) =
            Batch::from_tokens(&self.ctx, &micro.ids, &micro.labels, micro.mask.clone())?;
        let (sum, _) = self.model.loss_sum(&batch, &labels, &opts)?;
        let loss_sum = sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let share = (sum / global_tokens as f64)?;
        let store = self.model.backward(&share)?;
        let grads = match (self.cfg.zero, &self.zero) {
            (ZeroStage::Parameters, _) => self
                .params
                .iter()
                .map(|p| {
                    let (_, chunk) = p.chunk.as_ref().ok_or_else(|| no_chunk(&p.name))?;
                    let g = store.get(chunk.as_tensor()).ok_or_else(|| {
                        Error::Invalid(format!("parameter `{}` received no gradient", p.name))
                    })?;
                    Ok((p.name.clone(), g.to_dtype(DType::F32)?))
                })
                .collect::<Result<Vec<_>>>()?,
            (ZeroStage::Gradients, Some(z)) => {
                let whole = collect_gradients(&self.whole_param_handles(), &store)?;
                self.params
                    .iter()
                    .zip(whole)
                    .map(|(p, (n, g))| {
                        let (flat, _) = p.chunk.as_ref().ok_or_else(|| no_chunk(&p.name))?;
                        Ok((n, flat.reduce_scatter(&g, &z.shard)?))
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => collect_gradients(&self.whole_param_handles(), &store)?,
        };
        Ok((loss_sum, grads))
    }

    /// The model's whole parameters as [`Param`]s (stages 0 to 2), for gradient collection.
    fn whole_param_handles(&self) -> Vec<Param> {
        self.params
            .iter()
            .filter_map(|p| {
                let v = p.var.as_ref()?;
                Some(Param {
                    name: p.name.clone(),
                    var: Some(v.clone()),
                    tensor: v.as_tensor().clone(),
                    shard: p.shard,
                    global_shape: p.global_shape.clone(),
                })
            })
            .collect()
    }

    /// Sums the accumulated gradients over the ranks that share each parameter, clips them by
    /// the global norm, and applies AdamW with the learning rate of `step`; under ZeRO stages 1
    /// and 2 then gathers the updated parameters. Returns the norm before clipping and the
    /// learning rate. Collective over the world.
    pub fn apply(&mut self, acc: Vec<(String, Tensor)>, step: u64) -> Result<(f64, f64)> {
        let mut grads = match (self.cfg.zero, &self.zero) {
            (ZeroStage::Off, _) | (_, None) => {
                reduce_gradients(&self.whole_param_handles(), acc, &self.ctx)?
            }
            (ZeroStage::OptimizerStates, Some(_)) => {
                let whole = reduce_gradients(&self.whole_param_handles(), acc, &self.ctx)?;
                self.params
                    .iter()
                    .zip(whole)
                    .map(|(p, (n, g))| {
                        let (flat, _) = p.chunk.as_ref().ok_or_else(|| no_chunk(&p.name))?;
                        Ok((n, flat.take(&g)?))
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            (_, Some(z)) => {
                // Chunks are summed over the sharding group: add the replicas (and, for
                // replicated parameters under TP-sp, the tensor-parallel ranks).
                let tp_sp = self.ctx.tp().sequence_parallel();
                self.params
                    .iter()
                    .zip(acc)
                    .map(|(p, (n, g))| {
                        let group = if tp_sp && !p.shard.is_split() {
                            &z.replica_tp
                        } else {
                            &z.replica
                        };
                        let g = if group.size() > 1 {
                            group.all_reduce(&g, ReduceOp::Sum)?
                        } else {
                            g
                        };
                        Ok((n, g))
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let split: HashMap<&str, bool> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.shard.is_split()))
            .collect();
        let (tp, zero) = (self.tp.clone(), self.zero.clone());
        let group_of = |name: &str| -> Option<Comm> {
            let is_split = split.get(name).copied().unwrap_or(false);
            match &zero {
                None => is_split.then(|| tp.clone()),
                Some(z) if is_split => Some(z.shard_tp.clone()),
                Some(z) => Some(z.shard.clone()),
            }
        };
        let grad_norm = match self.cfg.max_grad_norm {
            Some(max) => clip_grad_norm(&mut grads, max, &group_of)?,
            None => global_grad_norm(&grads, &group_of)?,
        };
        let lr = self.cfg.schedule.lr(step);
        self.optimizer.step(&grads, lr)?;
        self.gather_updated()?;
        Ok((grad_norm, lr))
    }

    /// ZeRO stages 1 and 2: sets every whole parameter from the sharding group's updated
    /// chunks. Collective over the sharding group; nothing to do otherwise.
    fn gather_updated(&self) -> Result<()> {
        let Some(z) = &self.zero else { return Ok(()) };
        for p in &self.params {
            if let (Some(var), Some((flat, chunk))) = (&p.var, &p.chunk) {
                let whole = flat.gather(chunk.as_tensor(), &z.shard, &p.local_shape)?;
                var.set(&whole)?;
            }
        }
        Ok(())
    }

    /// Runs optimizer step `self.step` on `data` and advances. Collective over the world.
    pub fn step(&mut self, data: &PackedDataset) -> Result<StepStats> {
        let step = self.step;
        let global_tokens = self.global_tokens(data, step);
        if global_tokens == 0 {
            return Err(Error::Invalid(format!(
                "step {step}: no labelled token in the batch"
            )));
        }
        let mut acc: Vec<(String, Tensor)> = Vec::new();
        let mut loss_sum = 0f64;
        for micro in self.micro_batches(data, step) {
            let (sum, grads) = self.forward_backward(&micro, global_tokens)?;
            loss_sum += sum;
            accumulate(&mut acc, grads)?;
        }
        let (grad_norm, lr) = self.apply(acc, step)?;
        let total = self
            .loss_group
            .all_reduce(&Tensor::new(&[loss_sum], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        self.step += 1;
        Ok(StepStats {
            step,
            loss: total / global_tokens as f64,
            lr,
            grad_norm,
            tokens: global_tokens,
        })
    }
}

fn no_chunk(name: &str) -> Error {
    Error::Invalid(format!("internal: parameter `{name}` has no ZeRO chunk"))
}
