//! One rank's training loop state: the model, its optimizer and learning-rate schedule, and the
//! step that turns a global batch of windows into an optimizer update.
//!
//! Contract of [`Trainer::step`] (collective over the world, every rank calls it with the same
//! step number): the step's global batch is `dp · batch · grad_accum` windows chosen by the
//! [`Sampler`]; data-parallel rank `d` trains on its `batch · grad_accum`; each micro-batch of
//! `batch` windows is cut into this rank's sequence shard by the layout, run forward and
//! backward on its own, with this rank's loss scaled to its share of the global mean; gradients
//! are accumulated in f32, summed over the ranks sharing each parameter, clipped by the global
//! norm, and applied by AdamW (f32 master weights and moments). The mean loss over the global
//! batch is returned, identical on every rank.

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::AttnMask;
use candle_parallel::comm::{Comm, ReduceOp};
use candle_parallel::layers::{CrossEntropyOptions, ParallelCtx};
use candle_parallel::mesh::{DeviceMesh, Dim};
use candle_parallel::optim::{clip_grad_norm, decays, AdamW, AdamWConfig, LrSchedule, OptimParam};
use models::checkpoint::Param;
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

/// One rank's trainer.
pub struct Trainer {
    pub model: Llama,
    pub params: Vec<Param>,
    pub optimizer: AdamW,
    pub cfg: TrainConfig,
    ctx: ParallelCtx,
    tp: Comm,
    /// ulysses × ring × dp: the ranks whose losses add up to the global loss.
    loss_group: Comm,
    dp: usize,
    dp_rank: usize,
    /// Optimizer steps taken (the next step's index).
    pub step: u64,
}

impl Trainer {
    /// Builds the optimizer over `params` (sorted by name; no weight decay on 1-D tensors).
    /// Collective only through the mesh's cached groups.
    pub fn new(
        model: Llama,
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
        let optim_params = params
            .iter()
            .map(|p| {
                let var = p.var.clone().ok_or_else(|| {
                    Error::Invalid(format!("parameter `{}` is not trainable", p.name))
                })?;
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
            params,
            optimizer,
            ctx: ctx.clone(),
            tp: mesh.comm(Dim::Tp),
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

    /// Runs optimizer step `self.step` on `data` and advances. Collective over the world.
    pub fn step(&mut self, data: &PackedDataset) -> Result<StepStats> {
        let step = self.step;
        // Every rank knows the whole global batch, hence the global label count, locally.
        let global_tokens: u64 = (0..self.dp)
            .flat_map(|d| self.windows(data, step, d))
            .map(|w| w.labels.iter().filter(|&&l| l != IGNORE).count() as u64)
            .sum();
        if global_tokens == 0 {
            return Err(Error::Invalid(format!(
                "step {step}: no labelled token in the batch"
            )));
        }
        let windows = self.windows(data, step, self.dp_rank);
        let opts = CrossEntropyOptions {
            chunk_tokens: self.cfg.loss_chunk_tokens,
            ..Default::default()
        };
        let mut acc: Vec<(String, Tensor)> = Vec::new();
        let mut loss_sum = 0f64;
        for micro in windows.chunks(self.cfg.batch) {
            // One forward per micro-batch; with document masks each sequence has its own mask.
            let groups: Vec<&[Window]> = if self.cfg.doc_mask {
                micro.chunks(1).collect()
            } else {
                vec![micro]
            };
            for g in groups {
                let mask = if self.cfg.doc_mask {
                    AttnMask::documents(g[0].doc_ids.clone())
                } else {
                    AttnMask::Causal
                };
                let ids: Vec<Vec<u32>> = g.iter().map(|w| w.ids.clone()).collect();
                let labels: Vec<Vec<i64>> = g.iter().map(|w| w.labels.clone()).collect();
                let (batch, local_labels) = Batch::from_tokens(&self.ctx, &ids, &labels, mask)?;
                let (sum, _) = self.model.loss_sum(&batch, &local_labels, &opts)?;
                loss_sum += sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                let share = (sum / global_tokens as f64)?;
                let grads = share.backward()?;
                accumulate(&mut acc, collect_gradients(&self.params, &grads)?)?;
            }
        }
        let mut grads = reduce_gradients(&self.params, acc, &self.ctx)?;
        let split: std::collections::HashSet<String> = self
            .params
            .iter()
            .filter(|p| p.shard.is_split())
            .map(|p| p.name.clone())
            .collect();
        let tp = self.tp.clone();
        let sharded = |name: &str| split.contains(name).then(|| tp.clone());
        let grad_norm = match self.cfg.max_grad_norm {
            Some(max) => clip_grad_norm(&mut grads, max, &sharded)?,
            None => candle_parallel::optim::global_grad_norm(&grads, &sharded)?,
        };
        let lr = self.cfg.schedule.lr(step);
        self.optimizer.step(&grads, lr)?;
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
