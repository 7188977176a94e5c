//! LLaMA as pipeline stages: one rank's model chunks under a
//! [`candle_parallel::pipeline::PipelineSchedule`].
//!
//! Virtual stage `c * p + r` (chunk `c` of pipeline rank `r`) runs the decoder layers
//! [`split_layers`](candle_parallel::pipeline::split_layers) gives it; the first virtual stage
//! also embeds the tokens, the last applies the final norm, the head and the loss. The ranks
//! that hold the first and the last virtual stage both load the embedding, norm and head (one
//! unit, [`Ends`](super::Ends)): each uses its part, and their gradients are summed between the
//! two ranks after the step by the pipeline runtime
//! ([`finish_step`](candle_parallel::pipeline::finish_step) with [`LlamaStage::shared`]), so
//! tied embeddings keep one value (and untied ends get their single gradient on both ranks).
//! This file names no communicator: the stage's position in the pipeline comes from the
//! schedule. Activations between stages have the
//! shape of the layers' input on this rank: `(batch, tokens, hidden)`, the tokens this rank's
//! sequence shard (divided over tp under TP-sp).

use std::collections::HashMap;
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor, Var};
use candle_parallel::nn::{Batch, CrossEntropyOptions, Track};
use candle_parallel::pipeline::{PipelineSchedule, StageGrads, StageModel};

use super::Llama;
use crate::error::{Error, Result};

/// Whether parameter `name` is held by both the first and the last pipeline stage (the
/// embedding, final norm and head), so that its gradient is summed between them and it counts
/// once in a global gradient norm.
pub fn replicated_across_stages(name: &str) -> bool {
    !name.starts_with("model.layers.")
}

/// One micro-batch as every stage sees it: the batch (ids, positions, mask) and the shifted
/// labels of this rank's tokens.
pub struct StageMicroBatch {
    pub batch: Batch,
    pub labels: Tensor,
}

/// This rank's chunks of a pipelined LLaMA for one step (see the [module docs](self)).
pub struct LlamaStage<'a> {
    model: &'a Llama,
    grads: StageGrads,
    rank: usize,
    stages: usize,
    chunks: Vec<Range<usize>>,
    last_virtual: usize,
    micro: &'a [StageMicroBatch],
    global_tokens: f64,
    opts: CrossEntropyOptions,
    dtype: DType,
    loss_sum: f64,
}

impl<'a> LlamaStage<'a> {
    /// `model` built with [`Llama::new_stage`] for `layers[c * p + rank]` of every chunk `c`;
    /// `params` the variables whose gradients to accumulate, by parameter name (the model's
    /// parameters, or under ZeRO-3 the chunks it differentiates); `global_tokens` the labelled tokens of the whole step (the
    /// loss is a sum over micro-batches divided by it, as on one rank).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'a Llama,
        params: Vec<(String, Var)>,
        schedule: &PipelineSchedule,
        rank: usize,
        layers: &[Range<usize>],
        micro: &'a [StageMicroBatch],
        global_tokens: u64,
        opts: CrossEntropyOptions,
        dtype: DType,
    ) -> Result<Self> {
        if layers.len() != schedule.virtual_stages() {
            return Err(Error::Invalid(format!(
                "{} layer ranges for {} virtual stages",
                layers.len(),
                schedule.virtual_stages()
            )));
        }
        if micro.len() != schedule.micro_batches {
            return Err(Error::Invalid(format!(
                "{} micro-batches for a schedule of {}",
                micro.len(),
                schedule.micro_batches
            )));
        }
        let chunks = (0..schedule.chunks)
            .map(|c| layers[schedule.virtual_stage(rank, c)].clone())
            .collect();
        Ok(Self {
            model,
            grads: StageGrads::new(params),
            rank,
            stages: schedule.stages,
            chunks,
            last_virtual: schedule.virtual_stages() - 1,
            micro,
            global_tokens: global_tokens as f64,
            opts,
            dtype,
            loss_sum: 0.0,
        })
    }

    /// Micro-batch `mb` (borrowed from the caller's list, not from `self`).
    fn micro(&self, mb: usize) -> Result<&'a StageMicroBatch> {
        self.micro
            .get(mb)
            .ok_or_else(|| Error::Invalid(format!("no micro-batch {mb}")))
    }

    /// The parameters this stage shares with the other end of the pipeline (the embedding,
    /// norm and head on the first and the last stage): what
    /// [`finish_step`](candle_parallel::pipeline::finish_step) sums between them.
    pub fn shared(&self) -> Vec<(String, Var)> {
        self.grads.shared(replicated_across_stages)
    }

    /// This rank's accumulated gradients by name (f32) and the loss summed on this rank (the
    /// last stage's; 0 elsewhere), once the schedule has run.
    pub fn into_parts(self) -> (HashMap<String, Tensor>, f64) {
        (self.grads.into_grads(), self.loss_sum)
    }

    /// [`StageModel::forward`] with this crate's errors.
    fn forward_chunk(&mut self, chunk: usize, mb: usize, input: Option<&Tensor>) -> Result<Tensor> {
        let vs = chunk * self.stages + self.rank;
        let m = self.micro(mb)?;
        let ends = if vs == 0 || vs == self.last_virtual {
            Some(self.model.ends(Track::Grad)?)
        } else {
            None
        };
        let x = match (input, &ends) {
            (Some(x), _) => x.clone(),
            (None, Some(e)) if vs == 0 => self.model.embed(e, &m.batch)?,
            _ => return Err(Error::Invalid(format!("virtual stage {vs} got no input"))),
        };
        let x = self
            .model
            .run_layers(self.chunks[chunk].clone(), &x, &m.batch)?;
        match &ends {
            Some(e) if vs == self.last_virtual => {
                let h = self.model.final_norm(e, &x)?;
                let (sum, _) = self.model.head_loss(e, &h, &m.labels, &self.opts)?;
                self.loss_sum += sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                Ok((sum / self.global_tokens)?)
            }
            _ => Ok(x),
        }
    }
}

impl StageModel for LlamaStage<'_> {
    fn activation_spec(
        &self,
        _chunk: usize,
        micro_batch: usize,
    ) -> candle_parallel::Result<(Shape, DType)> {
        let m = self
            .micro(micro_batch)
            .map_err(candle_parallel::Error::from)?;
        let (b, n) = m.batch.input_ids.dims2()?;
        let n = self.model.ctx().layer_token_count(n);
        Ok((
            Shape::from((b, n, self.model.config().hidden_size)),
            self.dtype,
        ))
    }

    fn forward(
        &mut self,
        chunk: usize,
        micro_batch: usize,
        input: Option<&Tensor>,
    ) -> candle_parallel::Result<Tensor> {
        self.forward_chunk(chunk, micro_batch, input)
            .map_err(candle_parallel::Error::from)
    }

    fn backward(&mut self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        let store = self
            .model
            .backward(root)
            .map_err(candle_parallel::Error::from)?;
        self.grads.add(&store)?;
        Ok(store)
    }
}
