//! LLaVA as pipeline stages ([`LlavaStages`], a
//! [`StagedModel`](candle_parallel::pipeline::StagedModel)): the first virtual stage embeds the
//! global sequence (tokens, and images through the vision tower and projector, which only the
//! first stage holds) and takes this rank's shard of it; then the language model's decoder
//! layers; the last stage applies the final norm, the head and the loss. The language model's
//! embedding and head (its end unit) are held by both ends, as for any causal LM.

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{Shape, Tensor};
use candle_parallel::nn::{Batch, CrossEntropyOptions};
use candle_parallel::pipeline::{StageLoss, StagedModel};

use super::model::Llava;
use crate::causal_lm::CausalLm;
use crate::error::Result;

/// One micro-batch as every stage sees it: the global token rows, labels and images (for the
/// first stage's embedding) and this rank's shard of the batch and of the labels.
pub struct LlavaMicroBatch {
    pub ids: Vec<Vec<u32>>,
    /// Global labels (the whole model's loss shards them itself).
    pub global_labels: Vec<Vec<i64>>,
    pub pixel_values: Option<Tensor>,
    pub batch: Batch,
    pub labels: Tensor,
}

impl LlavaMicroBatch {
    /// The micro-batch of global `ids` and `labels` (already shifted, `-100` ignored) with its
    /// images for `model`'s layout. Local.
    pub fn new(
        model: &Llava,
        ids: Vec<Vec<u32>>,
        global_labels: Vec<Vec<i64>>,
        pixel_values: Option<Tensor>,
    ) -> Result<Self> {
        let (batch, labels) = model.shard_batch(&ids, &global_labels)?;
        Ok(Self {
            ids,
            global_labels,
            pixel_values,
            batch,
            labels,
        })
    }
}

/// A LLaVA model with its next-token loss as pipeline stages.
pub struct LlavaStages<'a> {
    pub model: &'a Llava,
    pub opts: CrossEntropyOptions,
}

impl StagedModel for LlavaStages<'_> {
    type Micro = LlavaMicroBatch;

    fn activation_shape(&self, m: &LlavaMicroBatch) -> candle_parallel::Result<Shape> {
        let (b, n) = m.batch.input_ids.dims2()?;
        let ctx = self.model.ctx();
        Ok(Shape::from((
            b,
            ctx.layer_token_count(n),
            self.model.config().text().hidden_size,
        )))
    }

    fn embed(&self, m: &LlavaMicroBatch) -> candle_parallel::Result<Tensor> {
        Ok(self.model.embed_shard(&m.ids, m.pixel_values.as_ref())?)
    }

    fn run_layers(
        &self,
        layers: Range<usize>,
        x: &Tensor,
        m: &LlavaMicroBatch,
    ) -> candle_parallel::Result<Tensor> {
        Ok(self.model.llama.run_layers(layers, x, &m.batch)?)
    }

    fn head_loss(&self, x: &Tensor, m: &LlavaMicroBatch) -> candle_parallel::Result<StageLoss> {
        let (sum, _) = self.model.llama.norm_head_loss(x, &m.labels, &self.opts)?;
        Ok(StageLoss::new(sum))
    }

    fn backward(&self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        Ok(self.model.backward(root)?)
    }

    fn shared_params(&self) -> Vec<String> {
        self.model.llama.end_params()
    }
}
