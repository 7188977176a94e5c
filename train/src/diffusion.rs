//! The training step of a diffusion transformer (DiT) under any layout and memory plan.
//!
//! Contract of [`DiffusionTrainer::step`] (collective over the world): the step's global batch
//! is `dp · batch · grad_accum` images dealt by the same [`Sampler`](crate::data::Sampler) as text windows (epoch
//! permutations of the dataset); data-parallel rank `d` trains on its `batch · grad_accum` in
//! micro-batches of `batch`. Each image's random draws (timestep or `s`, noise, label dropout)
//! come from a generator seeded by the run's seed and the image's global sample index, so every
//! layout and every resume sees the same draws. The loss is the mean over the global batch of
//! each image's loss ([`models::dit::loss`]); gradients, clipping, AdamW and ZeRO are the
//! [`Trainer`]'s, and [`Trainer::run_step`] is the step ([`DiffusionLoss`] is the objective).

use candle_core::{Device, Tensor};
use candle_parallel::pipeline::StageLoss;
use models::diffusion::{logit_normal, DrawStream, GaussianDiffusion};
use models::dit::loss::{loss_sum, NoiseLevel, NoisedBatch, Objective as DitObjective};
use models::dit::pipeline::{DitMicroBatch, DitStages};
use models::dit::Dit;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::images::ImageDataset;
use crate::objective::{Objective, StepCtx};
use crate::trainer::{StepStats, TrainModel, Trainer};

impl TrainModel for Dit {
    fn end_params(&self) -> Vec<String> {
        Dit::end_params(self)
    }

    fn weights_name(&self) -> &'static str {
        models::dit::WEIGHTS_NAME
    }
}

/// What a diffusion run adds to a [`crate::trainer::TrainConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DiffusionConfig {
    pub objective: DitObjective,
    /// Probability of replacing a label by the null class (classifier-free guidance).
    pub class_dropout: f64,
    /// DDPM steps of the noise schedule (DiT: 1000).
    pub num_timesteps: usize,
}

impl Default for DiffusionConfig {
    fn default() -> Self {
        Self {
            objective: DitObjective::Ddpm,
            class_dropout: 0.1,
            num_timesteps: 1000,
        }
    }
}

/// A micro-batch's summed loss, its (mse, vb) parts and this rank's gradients.
pub type MicroGrads = (f64, (f64, f64), Vec<(String, Tensor)>);

/// The diffusion loss of a DiT on an [`ImageDataset`] (see the [module docs](self)): the mean
/// over the global batch's images, with its (mse, vb) parts.
pub struct DiffusionLoss {
    pub cfg: DiffusionConfig,
    pub diffusion: GaussianDiffusion,
}

impl DiffusionLoss {
    /// Errors on an impossible configuration.
    pub fn new(cfg: DiffusionConfig) -> Result<Self> {
        if !(0.0..1.0).contains(&cfg.class_dropout) {
            return Err(Error::Invalid(format!(
                "the class dropout {} must be in [0, 1)",
                cfg.class_dropout
            )));
        }
        let diffusion = GaussianDiffusion::linear(cfg.num_timesteps)?;
        Ok(Self { cfg, diffusion })
    }

    /// The micro-batch of images `samples` (global sample indices) with their draws, for a
    /// run of seed `seed` (shuffled or not).
    pub fn noised_batch(
        &self,
        data: &ImageDataset,
        samples: &[u64],
        seed: u64,
        shuffle: bool,
    ) -> Result<NoisedBatch> {
        let sampler = data.sampler(seed, shuffle);
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
            let mut d = DrawStream::new(seed, k);
            match self.cfg.objective {
                DitObjective::Ddpm => ddpm.push(
                    ((d.uniform() * self.cfg.num_timesteps as f64) as u32)
                        .min(self.cfg.num_timesteps as u32 - 1),
                ),
                DitObjective::Flow => flow.extend(logit_normal(1, || d.normal())),
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
                DitObjective::Ddpm => NoiseLevel::Ddpm(ddpm),
                DitObjective::Flow => NoiseLevel::Flow(flow),
            },
        })
    }

    /// Data-parallel rank `s.dp_rank`'s micro-batches of `step` (global sample indices, the
    /// same for any dataset).
    pub fn micro_samples(&self, s: &StepCtx<'_>, data: &ImageDataset, step: u64) -> Vec<Vec<u64>> {
        s.batching
            .micro_samples(&s.batching.sampler(data.len()), step, s.dp_rank)
    }
}

impl Objective<Dit> for DiffusionLoss {
    type Data = ImageDataset;
    type Micro = DitMicroBatch;
    type Staged<'a> = DitStages<'a>;

    fn part_names(&self) -> Vec<String> {
        ["mse", "vb"].map(String::from).to_vec()
    }

    fn global_count(&self, s: &StepCtx<'_>, data: &ImageDataset, _step: u64) -> Result<u64> {
        if data.is_empty() {
            return Err(Error::Invalid("the image dataset is empty".into()));
        }
        Ok(s.batching.global_batch() as u64)
    }

    fn micro_batches(
        &self,
        s: &StepCtx<'_>,
        model: &Dit,
        data: &ImageDataset,
        step: u64,
    ) -> Result<Vec<DitMicroBatch>> {
        self.micro_samples(s, data, step)
            .iter()
            .map(|k| {
                let b = self.noised_batch(data, k, s.cfg.seed, s.cfg.shuffle)?;
                Ok(DitMicroBatch::new(model, &self.diffusion, b)?)
            })
            .collect()
    }

    fn loss(&self, model: &Dit, m: &DitMicroBatch) -> Result<StageLoss> {
        let l = loss_sum(model, &self.diffusion, &m.batch)?;
        Ok(StageLoss {
            sum: l.total,
            parts: vec![l.mse, l.vb],
        })
    }

    fn staged<'a>(&'a self, model: &'a Dit) -> Result<DitStages<'a>> {
        Ok(DitStages {
            model,
            diffusion: &self.diffusion,
        })
    }
}

/// One rank's diffusion trainer: a [`Trainer`] of a [`Dit`] and its [`DiffusionLoss`].
pub struct DiffusionTrainer {
    pub trainer: Trainer<Dit>,
    pub loss: DiffusionLoss,
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
        Ok(Self {
            trainer,
            loss: DiffusionLoss::new(cfg)?,
        })
    }

    /// The run's diffusion settings.
    pub fn cfg(&self) -> &DiffusionConfig {
        &self.loss.cfg
    }

    /// Images per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.trainer.global_batch()
    }

    /// The micro-batch of images `samples` (global sample indices) with their draws.
    pub fn noised_batch(&self, data: &ImageDataset, samples: &[u64]) -> Result<NoisedBatch> {
        let c = &self.trainer.cfg;
        self.loss.noised_batch(data, samples, c.seed, c.shuffle)
    }

    /// This rank's micro-batches of `step` (global sample indices, the same for any dataset).
    pub fn micro_samples(&self, data: &ImageDataset, step: u64) -> Vec<Vec<u64>> {
        self.loss
            .micro_samples(&self.trainer.step_ctx(), data, step)
    }

    /// Forward and backward of one micro-batch, this rank's loss scaled by `1 / global_batch`.
    /// Returns this rank's summed loss, its (mse, vb) parts and its gradients. Collective.
    pub fn forward_backward(&self, batch: &NoisedBatch) -> Result<MicroGrads> {
        let l = loss_sum(&self.trainer.model, &self.loss.diffusion, batch)?;
        let (sum, grads) = self
            .trainer
            .backward_collect(&l.total, self.global_batch() as u64)?;
        Ok((sum, (l.mse, l.vb), grads))
    }

    /// Runs optimizer step `self.trainer.step` on `data` and advances
    /// ([`Trainer::run_step`]). Collective over the world.
    pub fn step(&mut self, data: &ImageDataset) -> Result<DiffusionStats> {
        let r = self.trainer.run_step(&self.loss, data)?;
        Ok(DiffusionStats {
            stats: r.stats,
            mse: r.parts[0],
            vb: r.parts[1],
        })
    }
}
