//! What a run optimises ([`Objective`]): how a step's data becomes this rank's micro-batches,
//! what one micro-batch's loss is on the whole model, and the same loss on pipeline stages.
//! [`Trainer::run_step`](crate::trainer::Trainer::run_step) is the one step loop over any
//! objective: micro-batches → (pipeline or not) forward and backward → accumulate → apply.
//!
//! Objectives here: [`NextToken`] (the next-token loss of any [`CausalLm`] on packed windows).
//! The diffusion loss ([`crate::diffusion`]), LLaVA's loss on image-text conversations
//! ([`crate::multimodal`]) and DPO ([`crate::finetune`]) live beside their data.

use candle_parallel::nn::{Batch, CrossEntropyOptions, ParallelCtx};
use candle_parallel::pipeline::{StageLoss, StagedModel};
use models::causal_lm::{CausalLm, LmStages, StageMicroBatch};

use crate::data::{Batching, Windows};
use crate::error::{Error, Result};
use crate::trainer::TrainConfig;

/// What an objective sees of the trainer when it deals a step's data.
#[derive(Clone, Copy)]
pub struct StepCtx<'a> {
    /// The layout (sequence shards of a batch).
    pub ctx: &'a ParallelCtx,
    pub cfg: &'a TrainConfig,
    /// How the step's global batch is dealt to the data-parallel ranks.
    pub batching: &'a Batching,
    /// This rank's data-parallel coordinate.
    pub dp_rank: usize,
    /// The pipeline group (one rank without a pipeline), for objectives that run a forward
    /// pass to prepare their micro-batches.
    pub pp: &'a candle_parallel::comm::Comm,
    /// Dtype of the activations between pipeline stages.
    pub dtype: candle_core::DType,
}

/// A training objective on models `M` (see the [module docs](self)).
///
/// Contract: [`Objective::global_count`] is the same on every rank without communication; the
/// step's loss is the sum over every micro-batch of every rank holding different data of
/// [`Objective::loss`]'s sum, divided by it. Parts are summed the same way and reported divided
/// by it too.
pub trait Objective<M> {
    /// The dataset a step draws from.
    type Data: ?Sized;
    /// One micro-batch, ready for the model (the same on every pipeline stage).
    type Micro;
    /// The model with this objective's loss as pipeline stages.
    type Staged<'a>: StagedModel<Micro = Self::Micro>
    where
        Self: 'a,
        M: 'a;

    /// Names of the loss parts [`Objective::loss`] reports, in order (the same on every rank).
    fn part_names(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether every rank of a sequence group computes the same (whole-sequence) loss, as a
    /// pairwise loss does: it then counts once per group. Otherwise each rank's loss covers its
    /// own tokens and the group's losses add up.
    fn whole_sequence_loss(&self) -> bool {
        false
    }

    /// What the step's summed loss is divided by (labelled tokens, samples, pairs of the
    /// global batch). Local.
    fn global_count(&self, s: &StepCtx<'_>, data: &Self::Data, step: u64) -> Result<u64>;

    /// This rank's micro-batches of `step`. Local, or collective over the world when the
    /// objective needs a forward pass to prepare them (every rank calls it).
    fn micro_batches(
        &self,
        s: &StepCtx<'_>,
        model: &M,
        data: &Self::Data,
        step: u64,
    ) -> Result<Vec<Self::Micro>>;

    /// One micro-batch through the whole model on this rank: its summed loss and parts.
    /// Collective over the model-parallel ranks.
    fn loss(&self, model: &M, micro: &Self::Micro) -> Result<StageLoss>;

    /// The model with this loss as pipeline stages, or an error when the objective does not
    /// run under a pipeline.
    fn staged<'a>(&'a self, model: &'a M) -> Result<Self::Staged<'a>>;
}

/// The next-token loss of a causal language model on packed windows ([`Windows`]), averaged
/// over the global batch's labelled tokens; with a mixture of experts its training loss (the
/// routers' balancing loss included, [`CausalLm::training_loss_sum`]) with the parts
/// [`ROUTER_PARTS`].
#[derive(Debug, Clone)]
pub struct NextToken {
    pub opts: CrossEntropyOptions,
    /// Report [`ROUTER_PARTS`] (a model with routers).
    pub router_parts: bool,
    /// Also report each of these sparse layers' load ([`ROUTER_LAYER_LOAD`]; under a pipeline
    /// the last stage sees every stage's, carried to it).
    pub router_layers: Vec<usize>,
}

/// The prefix of a sparse layer's load part (`expert_load_max_over_mean_layer3`): the busiest
/// expert's tokens over the mean in that layer, averaged like [`ROUTER_PARTS`].
pub const ROUTER_LAYER_LOAD: &str = "expert_load_max_over_mean_layer";

/// The parts of a mixture of experts' next-token loss, each averaged over the micro-batches
/// weighted by their labelled tokens: the routers' load-balancing loss (without its
/// coefficient; whether or not the loss includes it), the busiest expert's tokens over the
/// mean in the most unbalanced sparse layer, and the share of (token, expert) assignments the
/// capacity dropped (0 when dropless).
pub const ROUTER_PARTS: &[&str] = &[
    "router_aux_loss",
    "expert_load_max_over_mean",
    "expert_dropped_fraction",
];

impl NextToken {
    /// The training loss with `--loss-chunk` tokens per chunk of the vocab-parallel loss, its
    /// head's gradients taken in the forward ([`CrossEntropyOptions::eager_gradients`]: a
    /// backward follows every forward of a training step).
    pub fn new(cfg: &TrainConfig) -> Self {
        Self {
            opts: CrossEntropyOptions {
                chunk_tokens: cfg.loss_chunk_tokens,
                eager_gradients: true,
                ..Default::default()
            },
            router_parts: false,
            router_layers: Vec::new(),
        }
    }

    /// This loss for forwards that no backward follows (held-out evaluation of a trainable
    /// model): the head's gradients are not taken.
    pub fn for_evaluation(mut self) -> Self {
        self.opts.eager_gradients = false;
        self
    }

    /// [`NextToken::new`] for `model`: with routers, the loss reports [`ROUTER_PARTS`].
    pub fn for_model<M: CausalLm>(cfg: &TrainConfig, model: &M) -> Self {
        Self {
            router_parts: model.has_routers(),
            router_layers: model.router_layers(),
            ..Self::new(cfg)
        }
    }
}

impl<M: CausalLm> Objective<M> for NextToken {
    type Data = dyn Windows;

    fn part_names(&self) -> Vec<String> {
        if !self.router_parts {
            return Vec::new();
        }
        ROUTER_PARTS
            .iter()
            .map(|s| s.to_string())
            .chain(
                self.router_layers
                    .iter()
                    .map(|l| format!("{ROUTER_LAYER_LOAD}{l}")),
            )
            .collect()
    }
    type Micro = StageMicroBatch;
    type Staged<'a>
        = LmStages<'a, M>
    where
        M: 'a;

    fn global_count(&self, s: &StepCtx<'_>, data: &Self::Data, step: u64) -> Result<u64> {
        let n = s.batching.global_tokens(data, step);
        if n == 0 {
            return Err(Error::Invalid(format!(
                "step {step}: no labelled token in the batch"
            )));
        }
        Ok(n)
    }

    fn micro_batches(
        &self,
        s: &StepCtx<'_>,
        _model: &M,
        data: &Self::Data,
        step: u64,
    ) -> Result<Vec<StageMicroBatch>> {
        s.batching
            .micro_batches(data, step, s.dp_rank)
            .into_iter()
            .map(|mb| {
                let (batch, labels) =
                    Batch::from_padded_tokens(s.ctx, &mb.ids, &mb.labels, mb.mask, &mb.padding)?;
                Ok(StageMicroBatch { batch, labels })
            })
            .collect()
    }

    fn loss(&self, model: &M, m: &StageMicroBatch) -> Result<StageLoss> {
        let (sum, count) = model.training_loss_sum(&m.batch, &m.labels, &self.opts)?;
        let mut loss = StageLoss::new(sum);
        if self.router_parts {
            let r = model.router_stats().ok_or_else(|| {
                Error::Invalid("a model with routers reported no routing statistics".into())
            })?;
            loss.parts = models::causal_lm::router_parts(&r, count, &self.router_layers)?;
        }
        Ok(loss)
    }

    fn staged<'a>(&'a self, model: &'a M) -> Result<LmStages<'a, M>> {
        Ok(LmStages {
            model,
            opts: self.opts,
            balancing_loss: true,
        })
    }
}
