//! The [`Task`]s of the commands: one per objective, each a trainer and its data.

use crate::data::Windows;
use crate::diffusion::DiffusionTrainer;
use crate::driver::{StepOutcome, Task};
use crate::error::Result;
use crate::evaluation::{position_buckets, score, PositionBucket, ScoreOptions};
use crate::finetune::{DpoTrainer, PairDataset};
use crate::images::ImageDataset;
use crate::multimodal::{ImageTextDataset, LlavaTrainer};
use crate::trainer::{TrainModel, Trainer};
use models::causal_lm::CausalLm;

/// Next-token training of a causal LM on packed windows (`cpl train`, SFT), evaluated on
/// held-out windows when given.
pub struct NextTokenTask<'a, M, W: 'static> {
    pub trainer: Trainer<M>,
    pub data: &'a W,
    /// Held-out windows and how many of them each evaluation scores.
    pub eval: Option<(&'a W, usize)>,
    /// The metrics key of the step's labelled-token count (`tokens`, SFT's `trained_tokens`).
    pub count_key: &'static str,
    /// Tokens a step processes, for the throughput (none: its labelled tokens).
    pub processed_tokens: Option<f64>,
    /// With the rank's mesh: every evaluation also gives the loss by position bucket
    /// (`--eval-by-position`: causal over each held-out window, position = index in it; no
    /// pipeline).
    pub by_position: Option<&'a candle_parallel::mesh::DeviceMesh>,
}

impl<M: TrainModel + CausalLm, W: Windows + 'static> Task for NextTokenTask<'_, M, W> {
    type Model = M;

    fn trainer(&self) -> &Trainer<M> {
        &self.trainer
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let s = self.trainer.step(self.data)?;
        let tokens = self.processed_tokens.unwrap_or(s.tokens as f64);
        Ok(StepOutcome::new(s, tokens).with(self.count_key, s.tokens))
    }

    fn eval(&mut self) -> Result<Option<(f64, u64)>> {
        self.eval
            .map(|(data, windows)| self.trainer.eval_loss(data, windows))
            .transpose()
    }

    fn eval_by_position(&mut self) -> Result<Option<Vec<PositionBucket>>> {
        let (Some(mesh), Some((data, windows))) = (self.by_position, self.eval) else {
            return Ok(None);
        };
        let n = data.num_windows().min(windows.max(1));
        let seqs: Vec<Vec<u32>> = (0..n).map(|i| data.window(i).ids).collect();
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let buckets = position_buckets(len);
        let t = &self.trainer;
        let opts = ScoreOptions {
            buckets: Some(&buckets),
            ..ScoreOptions::default()
        };
        let (report, _) = score(mesh, t.ctx(), &t.model, t.activation_dtype(), &seqs, &opts)?;
        Ok(report.by_position.map(|b| b.buckets))
    }
}

/// DPO on preference pairs (`cpl finetune --stage dpo`).
pub struct DpoTask<'a> {
    pub trainer: DpoTrainer,
    pub data: &'a PairDataset,
    /// Tokens a step processes (both sides of every pair), for the throughput.
    pub processed_tokens: f64,
}

impl Task for DpoTask<'_> {
    type Model = Box<dyn models::CausalLm>;

    fn trainer(&self) -> &Trainer<Self::Model> {
        &self.trainer.trainer
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let s = self.trainer.step(self.data)?;
        Ok(StepOutcome::new(s.stats, self.processed_tokens)
            .with("pairs", s.stats.tokens)
            .with("chosen_reward", s.chosen_reward)
            .with("rejected_reward", s.rejected_reward)
            .with("margin", s.margin)
            .with("accuracy", s.accuracy))
    }
}

/// A diffusion transformer on images (`cpl train` of a DiT); throughput in images and patch
/// tokens.
pub struct DiffusionTask<'a> {
    pub trainer: DiffusionTrainer,
    pub data: &'a ImageDataset,
    /// Patch tokens of one image.
    pub tokens_per_image: usize,
}

impl Task for DiffusionTask<'_> {
    type Model = models::dit::Dit;

    fn trainer(&self) -> &Trainer<Self::Model> {
        &self.trainer.trainer
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let s = self.trainer.step(self.data)?;
        let images = s.stats.tokens as f64;
        let mut out = StepOutcome::new(s.stats, images * self.tokens_per_image as f64)
            .with("mse", s.mse)
            .with("vb", s.vb)
            .with("images", s.stats.tokens);
        out.rates = vec![("images_per_sec", images)];
        Ok(out)
    }
}

/// A vision-language model on image-text conversations (`cpl train` of a LLaVA).
pub struct LlavaTask<'a> {
    pub trainer: LlavaTrainer,
    pub data: &'a ImageTextDataset,
    /// Tokens a step processes (its sequences' tokens), for the throughput.
    pub processed_tokens: f64,
}

impl Task for LlavaTask<'_> {
    type Model = models::llava::Llava;

    fn trainer(&self) -> &Trainer<Self::Model> {
        &self.trainer.trainer
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let s = self.trainer.step(self.data)?;
        Ok(StepOutcome::new(s, self.processed_tokens).with("trained_tokens", s.tokens))
    }
}
