//! The [`Task`]s of the commands: one per objective, each a trainer and its data.

use crate::data::Windows;
use crate::diffusion::DiffusionTrainer;
use crate::driver::{Change, StepOutcome, Task};
use crate::error::{Error, Result};
use crate::evaluation::{position_buckets, score, PositionBucket, ScoreOptions};
use crate::finetune::{DpoTrainer, PairDataset};
use crate::images::ImageDataset;
use crate::multimodal::{ImageTextDataset, LlavaTrainer};
use crate::passkey::{PasskeyPrompt, PasskeyReport};
use crate::schedule::StepShape;
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
    /// With the rank's mesh: every evaluation also scores these passkey prompts
    /// (`--eval-passkey`, [`crate::passkey::evaluate`]; no pipeline), with or without held-out
    /// windows.
    pub passkey: Option<(&'a candle_parallel::mesh::DeviceMesh, &'a [PasskeyPrompt])>,
}

impl<M: TrainModel + CausalLm, W: Windows + 'static> Task for NextTokenTask<'_, M, W> {
    type Model = M;

    fn trainer(&self) -> &Trainer<M> {
        &self.trainer
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let (s, parts) = self.trainer.step_with_parts(self.data)?;
        let tokens = self.processed_tokens.unwrap_or(s.tokens as f64);
        let mut out = StepOutcome::new(s, tokens).with(self.count_key, s.tokens);
        for (name, value) in parts {
            out = out.with(&name, value);
        }
        Ok(out)
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

    fn eval_passkey(&mut self) -> Result<Option<PasskeyReport>> {
        let Some((mesh, prompts)) = self.passkey else {
            return Ok(None);
        };
        let t = &self.trainer;
        crate::passkey::evaluate(mesh, t.ctx(), &t.model, prompts).map(Some)
    }
}

/// One phase of a [`LengthCurriculum`]: its shape, its windows (and held-out windows) at its
/// length, and the model FLOPs per token at that length.
pub struct CurriculumPhase<'a, W> {
    pub shape: StepShape,
    pub data: &'a W,
    pub eval: Option<&'a W>,
    pub flops_per_token: f64,
}

/// [`NextTokenTask`] under the length curriculum of its trainer's config
/// ([`crate::schedule`]): before each step the phase of the trainer's step gives the trainer its
/// shape ([`Trainer::set_shape`]) and the task that phase's windows and held-out windows (an
/// evaluation scores windows of the current length), and the run logs the change; every
/// metrics line carries the step's `seq_len`. Which phase a step is in depends on the step
/// alone, so a run resumed anywhere in the schedule takes the steps the uninterrupted run took.
pub struct LengthCurriculum<'a, M, W: 'static> {
    task: NextTokenTask<'a, M, W>,
    phases: Vec<CurriculumPhase<'a, W>>,
    current: Option<usize>,
}

impl<'a, M: TrainModel, W: 'static> LengthCurriculum<'a, M, W> {
    /// `task` under its trainer's schedule, with one entry of `phases` per phase of it.
    pub fn new(task: NextTokenTask<'a, M, W>, phases: Vec<CurriculumPhase<'a, W>>) -> Result<Self> {
        let n = match &task.trainer.cfg.seq_len_schedule {
            Some(s) => s.phases().len(),
            None => {
                return Err(Error::Invalid(
                    "a length curriculum needs a schedule".into(),
                ))
            }
        };
        if phases.len() != n {
            return Err(Error::Invalid(format!(
                "a length curriculum of {n} phases was given {} phases' data",
                phases.len()
            )));
        }
        Ok(Self {
            task,
            phases,
            current: None,
        })
    }

    /// What the log says when the run enters phase `p` at `step` (from phase `from`, or at the
    /// start of the run or of a resumed run).
    fn message(&self, from: Option<usize>, p: usize, step: u64) -> String {
        let dp = self.task.trainer.batching().dp;
        let shape = self.phases[p].shape;
        let tokens = dp * shape.tokens();
        let cfg = &self.task.trainer.cfg;
        let (schedule, total) = cfg
            .seq_len_schedule
            .as_ref()
            .map(|s| (s.to_string(), s.total_steps()))
            .unwrap_or_default();
        let n = self.phases.len();
        let steps = match cfg.steps.cmp(&total) {
            std::cmp::Ordering::Equal => String::new(),
            std::cmp::Ordering::Less => format!(
                "; --steps {} stops the run inside the schedule's {total} steps",
                cfg.steps
            ),
            std::cmp::Ordering::Greater => format!(
                "; --steps {}: the last length goes on after the schedule's {total} steps",
                cfg.steps
            ),
        };
        match from {
            Some(f) => {
                let was = self.phases[f].shape;
                format!(
                    "seq-len {} -> {} at step {step}, batch {} -> {} sequences (micro-batches of \
                     {} -> {}, grad-accum {} -> {} per data-parallel rank), {tokens} tokens per \
                     step kept",
                    was.seq_len,
                    shape.seq_len,
                    dp * was.sequences(),
                    dp * shape.sequences(),
                    was.batch,
                    shape.batch,
                    was.grad_accum,
                    shape.grad_accum
                )
            }
            None => format!(
                "seq-len schedule {schedule}: {} at step {step} in phase {} of {n}, seq-len {} x \
                 {} sequences (micro-batches of {}, grad-accum {} per data-parallel rank); \
                 {tokens} tokens per step in every phase (the batch shrinks as the length \
                 grows){steps}",
                if step == 0 { "starting" } else { "resuming" },
                p + 1,
                shape.seq_len,
                dp * shape.sequences(),
                shape.batch,
                shape.grad_accum
            ),
        }
    }
}

impl<M: TrainModel + CausalLm, W: Windows + 'static> Task for LengthCurriculum<'_, M, W> {
    type Model = M;

    fn trainer(&self) -> &Trainer<M> {
        &self.task.trainer
    }

    fn before_step(&mut self) -> Result<Option<Change>> {
        let step = self.task.trainer.step;
        let p = match &self.task.trainer.cfg.seq_len_schedule {
            Some(s) => s.phase_at(step),
            None => return Ok(None),
        };
        if self.current == Some(p) {
            return Ok(None);
        }
        let message = self.message(self.current, p, step);
        let phase = &self.phases[p];
        self.task.trainer.set_shape(phase.shape)?;
        self.task.data = phase.data;
        if let (Some((_, windows)), Some(e)) = (self.task.eval, phase.eval) {
            self.task.eval = Some((e, windows));
        }
        self.current = Some(p);
        Ok(Some(Change {
            message,
            flops_per_token: phase.flops_per_token,
        }))
    }

    fn step(&mut self) -> Result<StepOutcome> {
        let seq_len = self.task.trainer.cfg.seq_len;
        Ok(self.task.step()?.with("seq_len", seq_len))
    }

    fn eval(&mut self) -> Result<Option<(f64, u64)>> {
        self.task.eval()
    }

    fn eval_by_position(&mut self) -> Result<Option<Vec<PositionBucket>>> {
        self.task.eval_by_position()
    }

    fn eval_passkey(&mut self) -> Result<Option<PasskeyReport>> {
        self.task.eval_passkey()
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
        let mut out = StepOutcome::new(s.stats, self.processed_tokens)
            .with("pairs", s.stats.tokens)
            .with("chosen_reward", s.chosen_reward)
            .with("rejected_reward", s.rejected_reward)
            .with("margin", s.margin)
            .with("accuracy", s.accuracy);
        for (name, v) in s.routing {
            out = out.with(&name, v);
        }
        Ok(out)
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
