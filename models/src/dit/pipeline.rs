//! DiT as pipeline stages: one rank's model chunks under a
//! [`candle_parallel::pipeline::PipelineSchedule`].
//!
//! Virtual stage `c * p + r` (chunk `c` of pipeline rank `r`) runs the blocks
//! [`split_layers`](candle_parallel::pipeline::split_layers) gives it; the first virtual stage
//! also embeds the patches, the last runs the output layer and the loss. Both load the patch
//! embedding and output layer (one unit), and the last also block 0's condition embedding when
//! it does not hold block 0 (the output layer is conditioned by it): the gradients of these
//! parameters are summed between the stages after the step
//! ([`finish_step`](candle_parallel::pipeline::finish_step) with [`DitStage::shared`]). Every
//! stage reads the micro-batch's conditioning itself. Activations between stages are the
//! blocks' input on this rank: `(batch, tokens, hidden)`, the tokens this rank's sequence
//! shard (divided over tp under TP-sp). The file names no communicator.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor, Var};
use candle_parallel::nn::Track;
use candle_parallel::pipeline::{PipelineSchedule, StageGrads, StageModel};

use super::loss::{loss_from_output, model_input, NoisedBatch};
use super::model::Dit;
use crate::diffusion::GaussianDiffusion;
use crate::error::{Error, Result};

/// Whether parameter `name` is held by both the first and the last pipeline stage.
pub fn replicated_across_stages(name: &str) -> bool {
    !name.starts_with("transformer_blocks.") || name.starts_with("transformer_blocks.0.norm1.emb.")
}

/// One micro-batch as every stage sees it.
pub struct DitMicroBatch {
    pub batch: NoisedBatch,
    /// The model input (noised samples) and conditioning of [`model_input`].
    pub x_in: Tensor,
    pub cond: Tensor,
}

impl DitMicroBatch {
    pub fn new(model: &Dit, diffusion: &GaussianDiffusion, batch: NoisedBatch) -> Result<Self> {
        let (x_in, cond) = model_input(model.config(), diffusion, &batch)?;
        model.check_input(&x_in)?;
        model.check_condition(&cond, batch.labels.len())?;
        Ok(Self { batch, x_in, cond })
    }
}

/// This rank's chunks of a pipelined DiT for one step (see the [module docs](self)).
pub struct DitStage<'a> {
    model: &'a Dit,
    diffusion: &'a GaussianDiffusion,
    grads: StageGrads,
    rank: usize,
    stages: usize,
    chunks: Vec<Range<usize>>,
    last_virtual: usize,
    micro: &'a [DitMicroBatch],
    global_count: f64,
    dtype: DType,
    loss_sum: f64,
    parts: (f64, f64),
}

impl<'a> DitStage<'a> {
    /// `model` built with [`Dit::new_stage`] for `layers[c * p + rank]` of every chunk `c`;
    /// `params` the variables whose gradients to accumulate; `global_count` the samples of the
    /// whole step (the loss is a sum over micro-batches divided by it).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'a Dit,
        diffusion: &'a GaussianDiffusion,
        params: Vec<(String, Var)>,
        schedule: &PipelineSchedule,
        rank: usize,
        layers: &[Range<usize>],
        micro: &'a [DitMicroBatch],
        global_count: u64,
        dtype: DType,
    ) -> Result<Self> {
        if layers.len() != schedule.virtual_stages() || micro.len() != schedule.micro_batches {
            return Err(Error::Invalid(format!(
                "{} block ranges and {} micro-batches for a schedule of {} virtual stages and \
                 {} micro-batches",
                layers.len(),
                micro.len(),
                schedule.virtual_stages(),
                schedule.micro_batches
            )));
        }
        let chunks = (0..schedule.chunks)
            .map(|c| layers[schedule.virtual_stage(rank, c)].clone())
            .collect();
        Ok(Self {
            model,
            diffusion,
            grads: StageGrads::new(params),
            rank,
            stages: schedule.stages,
            chunks,
            last_virtual: schedule.virtual_stages() - 1,
            micro,
            global_count: global_count as f64,
            dtype,
            loss_sum: 0.0,
            parts: (0.0, 0.0),
        })
    }

    fn micro(&self, mb: usize) -> Result<&'a DitMicroBatch> {
        self.micro
            .get(mb)
            .ok_or_else(|| Error::Invalid(format!("no micro-batch {mb}")))
    }

    /// The parameters this stage shares with the other end of the pipeline.
    pub fn shared(&self) -> Vec<(String, Var)> {
        self.grads.shared(replicated_across_stages)
    }

    /// This rank's accumulated gradients (f32), the loss summed on this rank and its (mse, vb)
    /// parts (the last stage's; 0 elsewhere), once the schedule has run.
    pub fn into_parts(self) -> (HashMap<String, Tensor>, f64, (f64, f64)) {
        (self.grads.into_grads(), self.loss_sum, self.parts)
    }

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
            (None, Some(e)) if vs == 0 => self.model.embed(e, &m.x_in)?,
            _ => return Err(Error::Invalid(format!("virtual stage {vs} got no input"))),
        };
        let (gh, gw) = self.model.check_input(&m.x_in)?;
        let x = self
            .model
            .run_blocks(self.chunks[chunk].clone(), &x, &m.cond, gh * gw)?;
        match &ends {
            Some(e) if vs == self.last_virtual => {
                let out = self.model.head(e, &x, &m.cond)?;
                let l = loss_from_output(
                    self.model.config(),
                    self.model.ctx(),
                    self.diffusion,
                    &m.batch,
                    &m.x_in,
                    &out,
                )?;
                self.loss_sum += l.total.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                self.parts.0 += l.mse;
                self.parts.1 += l.vb;
                Ok((l.total / self.global_count)?)
            }
            _ => Ok(x),
        }
    }
}

impl StageModel for DitStage<'_> {
    fn activation_spec(
        &self,
        _chunk: usize,
        micro_batch: usize,
    ) -> candle_parallel::Result<(Shape, DType)> {
        let m = self
            .micro(micro_batch)
            .map_err(candle_parallel::Error::from)?;
        let (gh, gw) = self
            .model
            .check_input(&m.x_in)
            .map_err(candle_parallel::Error::from)?;
        let ctx = self.model.ctx();
        let n = ctx.layer_token_count(ctx.local_tokens(gh * gw)?);
        let b = m.batch.labels.len();
        Ok((
            Shape::from((b, n, self.model.config().hidden_size())),
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
        let store = self.model.ctx().backward(root)?;
        self.grads.add(&store)?;
        Ok(store)
    }
}
