//! DiT with its diffusion loss as pipeline stages ([`DitStages`], a
//! [`StagedModel`](candle_parallel::pipeline::StagedModel) for
//! [`run_stage_step`](candle_parallel::pipeline::run_stage_step)).
//!
//! The first virtual stage embeds the patches, the last runs the output layer and the loss.
//! Both hold the patch embedding and output layer (one unit), and the last also block 0's
//! condition embedding when it does not hold block 0 (the output layer is conditioned by it):
//! [`Dit::end_params`] names them, and their gradients are summed between the two ends after
//! the step. Every stage reads the micro-batch's conditioning itself. Activations between
//! stages are the blocks' input on this rank: `(batch, tokens, hidden)`, the tokens this rank's
//! sequence shard (divided over tp under TP-sp). The file names no communicator.

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{Shape, Tensor};
use candle_parallel::nn::Track;
use candle_parallel::pipeline::{StageLoss, StagedModel};

use super::loss::{loss_from_output, model_input, NoisedBatch};
use super::model::Dit;
use crate::diffusion::GaussianDiffusion;
use crate::error::Result;

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

/// A DiT and its noise schedule as pipeline stages; the loss parts are (mse, vb).
pub struct DitStages<'a> {
    pub model: &'a Dit,
    pub diffusion: &'a GaussianDiffusion,
}

impl StagedModel for DitStages<'_> {
    type Micro = DitMicroBatch;

    fn activation_shape(&self, m: &DitMicroBatch) -> candle_parallel::Result<Shape> {
        let (gh, gw) = self.model.check_input(&m.x_in)?;
        let ctx = self.model.ctx();
        let n = ctx.layer_token_count(ctx.local_tokens(gh * gw)?);
        let b = m.batch.labels.len();
        Ok(Shape::from((b, n, self.model.config().hidden_size())))
    }

    fn embed(&self, m: &DitMicroBatch) -> candle_parallel::Result<Tensor> {
        let ends = self.model.ends(Track::Grad)?;
        Ok(self.model.embed(&ends, &m.x_in)?)
    }

    fn run_layers(
        &self,
        layers: Range<usize>,
        x: &Tensor,
        m: &DitMicroBatch,
    ) -> candle_parallel::Result<Tensor> {
        let (gh, gw) = self.model.check_input(&m.x_in)?;
        Ok(self.model.run_blocks(layers, x, &m.cond, gh * gw)?)
    }

    fn head_loss(&self, x: &Tensor, m: &DitMicroBatch) -> candle_parallel::Result<StageLoss> {
        let ends = self.model.ends(Track::Grad)?;
        let out = self.model.head(&ends, x, &m.cond)?;
        let l = loss_from_output(
            self.model.config(),
            self.model.ctx(),
            self.diffusion,
            &m.batch,
            &m.x_in,
            &out,
        )?;
        Ok(StageLoss {
            sum: l.total,
            parts: vec![l.mse, l.vb],
        })
    }

    fn backward(&self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        self.model.ctx().backward(root)
    }

    fn shared_params(&self) -> Vec<String> {
        self.model.end_params()
    }
}
