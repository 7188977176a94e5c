//! The training step of a diffusion transformer (DiT) under any layout and memory plan.
//!
//! Contract of [`DiffusionTrainer::step`] (collective over the world): the step's global batch
//! is `dp · batch · grad_accum` images dealt by the same [`Sampler`](crate::data::Sampler) as text windows (epoch
//! permutations of the dataset); data-parallel rank `d` trains on its `batch · grad_accum` in
//! micro-batches of `batch`. Each image's random draws (timestep or `s`, noise, label dropout)
//! come from a generator seeded by the run's seed and the image's global sample index, so every
//! layout and every resume sees the same draws. The loss is the mean over the global batch of
//! each image's loss ([`models::dit::loss`]); gradients, clipping, AdamW and ZeRO are the
//! [`Trainer`]'s.

use candle_core::{Device, Tensor};
use candle_parallel::comm::ReduceOp;
use candle_parallel::pipeline::{finish_step, run_schedule};
use models::diffusion::{logit_normal, DrawStream, GaussianDiffusion};
use models::dit::loss::{loss_sum, NoiseLevel, NoisedBatch, Objective};
use models::dit::pipeline::{DitMicroBatch, DitStage};
use models::dit::Dit;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::images::ImageDataset;
use crate::trainer::{StepStats, TrainModel, Trainer};

impl TrainModel for Dit {
    fn replicated_across_stages(&self, name: &str) -> bool {
        models::dit::pipeline::replicated_across_stages(name)
    }

    fn weights_name(&self) -> &'static str {
        models::dit::WEIGHTS_NAME
    }
}

/// What a diffusion run adds to a [`crate::trainer::TrainConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DiffusionConfig {
    pub objective: Objective,
    /// Probability of replacing a label by the null class (classifier-free guidance).
    pub class_dropout: f64,
    /// DDPM steps of the noise schedule (DiT: 1000).
    pub num_timesteps: usize,
}

impl Default for DiffusionConfig {
    fn default() -> Self {
        Self {
            objective: Objective::Ddpm,
            class_dropout: 0.1,
            num_timesteps: 1000,
        }
    }
}

/// A micro-batch's summed loss, its (mse, vb) parts and this rank's gradients.
pub type MicroGrads = (f64, (f64, f64), Vec<(String, Tensor)>);

/// A pipeline step's summed loss, its (mse, vb) parts, this rank's gradients and the bubble.
type PipelineGrads = (f64, (f64, f64), Vec<(String, Tensor)>, Option<f64>);

/// One rank's diffusion trainer: a [`Trainer`] of a [`Dit`] plus the noise schedule.
pub struct DiffusionTrainer {
    pub trainer: Trainer<Dit>,
    pub diffusion: GaussianDiffusion,
    pub cfg: DiffusionConfig,
}

/// What a step reports besides [`StepStats`] (its `tokens` field counts images).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DiffusionStats {
    pub stats: StepStats,
    /// Mean MSE part of the loss over the global batch.
    pub mse: f64,
    /// Mean variational-bound part (DDPM with a learned sigma).
    pub vb: f64,
}

impl DiffusionTrainer {
    /// Wraps `trainer`. Errors on an impossible configuration.
    pub fn new(trainer: Trainer<Dit>, cfg: DiffusionConfig) -> Result<Self> {
        if !(0.0..1.0).contains(&cfg.class_dropout) {
            return Err(Error::Invalid(format!(
                "the class dropout {} must be in [0, 1)",
                cfg.class_dropout
            )));
        }
        let diffusion = GaussianDiffusion::linear(cfg.num_timesteps)?;
        Ok(Self {
            trainer,
            diffusion,
            cfg,
        })
    }

    /// Images per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.trainer.global_batch()
    }

    /// The micro-batch of images `samples` (global sample indices) with their draws.
    pub fn noised_batch(&self, data: &ImageDataset, samples: &[u64]) -> Result<NoisedBatch> {
        let c = &self.trainer.cfg;
        let sampler = data.sampler(c.seed, c.shuffle);
        let indices: Vec<usize> = samples.iter().map(|&k| sampler.window_of(k)).collect();
        let (x0, labels) = data.batch(&indices)?;
        let null = data.num_classes as u32;
        let dims = x0.dims()[1..].to_vec();
        let per: usize = dims.iter().product();
        let mut noise = Vec::with_capacity(per * samples.len());
        let mut ddpm = Vec::new();
        let mut flow = Vec::new();
        let mut out_labels = Vec::with_capacity(samples.len());
        for (&k, &label) in samples.iter().zip(&labels) {
            let mut d = DrawStream::new(self.trainer.cfg.seed, k);
            match self.cfg.objective {
                Objective::Ddpm => ddpm.push(
                    ((d.uniform() * self.cfg.num_timesteps as f64) as u32)
                        .min(self.cfg.num_timesteps as u32 - 1),
                ),
                Objective::Flow => flow.extend(logit_normal(1, || d.normal())),
            }
            let drop = d.uniform() < self.cfg.class_dropout;
            out_labels.push(if drop { null } else { label });
            noise.extend((0..per).map(|_| d.normal() as f32));
        }
        let mut shape = vec![samples.len()];
        shape.extend(dims);
        Ok(NoisedBatch {
            x0,
            noise: Tensor::from_vec(noise, shape, &Device::Cpu)?,
            labels: out_labels,
            level: match self.cfg.objective {
                Objective::Ddpm => NoiseLevel::Ddpm(ddpm),
                Objective::Flow => NoiseLevel::Flow(flow),
            },
        })
    }

    /// This rank's micro-batches of `step` (global sample indices, the same for any dataset).
    pub fn micro_samples(&self, data: &ImageDataset, step: u64) -> Vec<Vec<u64>> {
        let c = &self.trainer.cfg;
        let dp = self.trainer.batching().dp;
        data.sampler(c.seed, c.shuffle)
            .samples(step, dp, self.trainer.dp_rank(), c.batch * c.grad_accum)
            .chunks(c.batch)
            .map(|c| c.to_vec())
            .collect()
    }

    /// Forward and backward of one micro-batch, this rank's loss scaled by `1 / global_batch`.
    /// Returns this rank's summed loss, its (mse, vb) parts and its gradients. Collective.
    pub fn forward_backward(&self, batch: &NoisedBatch) -> Result<MicroGrads> {
        let l = loss_sum(&self.trainer.model, &self.diffusion, batch)?;
        let (sum, grads) = self
            .trainer
            .backward_collect(&l.total, self.global_batch() as u64)?;
        Ok((sum, (l.mse, l.vb), grads))
    }

    /// The step's micro-batches through this rank's pipeline stage: the summed loss and its
    /// parts (the same on every pipeline rank), this rank's gradients and the measured bubble.
    /// Collective over the world.
    fn pipeline_forward_backward(&mut self, batches: Vec<NoisedBatch>) -> Result<PipelineGrads> {
        let n = self.global_batch() as u64;
        let (schedule, ranges, vars) = self.trainer.pipeline_setup(batches.len())?;
        let model = &self.trainer.model;
        let micro = batches
            .into_iter()
            .map(|b| DitMicroBatch::new(model, &self.diffusion, b))
            .collect::<models::Result<Vec<_>>>()?;
        let pp = self.trainer.pp().clone();
        let dtype = self.trainer.activation_dtype();
        let mut stage = DitStage::new(
            model,
            &self.diffusion,
            vars,
            &schedule,
            pp.rank(),
            &ranges,
            &micro,
            n,
            dtype,
        )?;
        let times = run_schedule(&schedule, &pp, &mut stage)?;
        let shared = stage.shared();
        let (grads, loss, (mse, vb)) = stage.into_parts();
        let (grads, loss) = finish_step(&pp, grads, &shared, loss)?;
        let parts = pp
            .all_reduce(&Tensor::new(&[mse, vb], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
        let acc = self.trainer.collect_named(grads)?;
        let bubble = self.trainer.pipeline_bubble(times)?;
        Ok((loss, (parts[0], parts[1]), acc, Some(bubble)))
    }

    /// Runs optimizer step `self.trainer.step` on `data` and advances. Collective over the
    /// world.
    pub fn step(&mut self, data: &ImageDataset) -> Result<DiffusionStats> {
        if data.is_empty() {
            return Err(Error::Invalid("the image dataset is empty".into()));
        }
        let step = self.trainer.step;
        let n = self.global_batch() as u64;
        let batches = self
            .micro_samples(data, step)
            .iter()
            .map(|s| self.noised_batch(data, s))
            .collect::<Result<Vec<_>>>()?;
        let (loss, (mse, vb), acc, bubble) = if self.trainer.cfg.pipeline.is_some() {
            self.pipeline_forward_backward(batches)?
        } else {
            let mut acc: Vec<(String, Tensor)> = Vec::new();
            let (mut loss, mut mse, mut vb) = (0f64, 0f64, 0f64);
            for batch in &batches {
                let (s, (m, v), grads) = self.forward_backward(batch)?;
                loss += s;
                mse += m;
                vb += v;
                candle_parallel::optim::accumulate(&mut acc, grads)?;
            }
            (loss, (mse, vb), acc, None)
        };
        let parts = self.trainer.sum_over_data(&[mse, vb])?;
        let stats = self.trainer.apply_step(acc, loss, n, bubble)?;
        Ok(DiffusionStats {
            stats,
            mse: parts[0] / n as f64,
            vb: parts[1] / n as f64,
        })
    }
}
