//! What every causal language model family provides ([`CausalLm`]), and the pipeline stage of
//! any of them ([`LmStages`]).
//!
//! A family's model file implements [`CausalLm`] on its model type: its two ends (embedding;
//! final norm, head and loss) and its layer stack, which unit holds the parameters both ends of
//! a pipeline share, and the fused whole-model loss. Training, evaluation, pipelining and
//! generation are written once against this trait (`cpl-train`'s trainer, the commands).
//!
//! [`LmStages`] is a [`StagedModel`] of any [`CausalLm`] for
//! [`candle_parallel::pipeline::run_stage_step`]: the first virtual stage embeds the tokens,
//! the last applies the final norm, the head and the loss. Activations between stages are the
//! layers' input on this rank: `(batch, tokens, hidden)`, the tokens this rank's sequence shard
//! (divided over tp under TP-sp).

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Shape, Tensor};
use candle_parallel::nn::{
    Adapters, Batch, CrossEntropyOptions, LayerKv, ParallelCtx, RouterAux, RouterStats,
};
use candle_parallel::pipeline::{StageLoss, StagedModel};
use candle_parallel::plan::Parallelize;

use crate::error::Result;

/// A causal language model of any family, on one rank (see the [module docs](self)). Every
/// method is collective over the model-parallel ranks (tp, sequence) unless it says otherwise.
pub trait CausalLm: Parallelize + Send + Sync {
    /// The layout the model was built for.
    fn ctx(&self) -> &ParallelCtx;

    /// Width of the activations between layers.
    fn hidden_size(&self) -> usize;

    /// Decoder layers of the whole model (this rank may hold only some of them).
    fn num_layers(&self) -> usize;

    /// The first stage's work: token embeddings `(batch, n', hidden)` of this rank's shard.
    fn embed_tokens(&self, batch: &Batch) -> Result<Tensor>;

    /// Decoder layers `layers` on `x`, each under its unit's checkpointing.
    fn run_layers(&self, layers: Range<usize>, x: &Tensor, batch: &Batch) -> Result<Tensor>;

    /// The last stage's work: final norm, head and the summed next-token loss of the last
    /// layer's output `x` with its count of labelled tokens (`labels` as in
    /// [`CausalLm::loss_sum`]).
    fn norm_head_loss(
        &self,
        x: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)>;

    /// The last stage's work for evaluation: final norm and head, the logits `(.., tokens, V)`
    /// f32 of the last layer's output `x` (all-gathered over the vocabulary shards).
    fn norm_head_logits(&self, x: &Tensor) -> Result<Tensor>;

    /// Logits `(batch, n, vocab)` f32 of this rank's tokens (for evaluation and generation, not
    /// for long-context training).
    fn logits(&self, batch: &Batch) -> Result<Tensor> {
        let x = self.embed_tokens(batch)?;
        let x = self.run_layers(0..self.num_layers(), &x, batch)?;
        self.norm_head_logits(&x)
    }

    /// The whole model at once: sum of the next-token cross-entropies of this rank's tokens and
    /// their count. `labels` `(batch, n)` i64, already shifted and sharded like the tokens,
    /// `-100` ignored. Divide by the global count for the mean loss.
    fn loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let x = self.embed_tokens(batch)?;
        let x = self.run_layers(0..self.num_layers(), &x, batch)?;
        self.norm_head_loss(&x, labels, opts)
    }

    /// What the training objective minimises: [`CausalLm::loss_sum`] plus, for a mixture of
    /// experts ([`CausalLm::routers`]), the routers' load-balancing loss (`coef · aux · count`
    /// on each rank, the statistics summed over the ranks holding the micro-batch's tokens, see
    /// [`RouterAux`]). Collective like [`CausalLm::loss_sum`].
    fn training_loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let (sum, count) = self.loss_sum(batch, labels, opts)?;
        let Some((aux, coef)) = self.routers() else {
            return Ok((sum, count));
        };
        aux.finish_in(self.ctx(), count, sum.device())?;
        Ok((with_balancing_loss(aux, coef, sum, count)?, count))
    }

    /// A mixture of experts' routers: their statistics of the current micro-batch, and the
    /// coefficient of their load-balancing loss in the training loss (0: not added).
    fn routers(&self) -> Option<(&Arc<RouterAux>, f64)> {
        None
    }

    /// Whether the model has routers (a mixture of experts): its training loss then reports
    /// [`CausalLm::router_stats`].
    fn has_routers(&self) -> bool {
        self.routers().is_some()
    }

    /// The layers with a router (a sparse block), of the whole model whatever stage this is.
    fn router_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The routing of the last micro-batch [`CausalLm::training_loss_sum`] ran (mixtures of
    /// experts).
    fn router_stats(&self) -> Option<RouterStats> {
        self.routers().and_then(|(a, _)| a.last_stats())
    }

    /// Per-sequence sums of this rank's token cross-entropies, `(batch,)` f32 (the negative
    /// log-likelihood of each sequence's labelled tokens on this rank; sum over the sequence
    /// group for the whole sequence), for preference losses (DPO). `labels` as in
    /// [`CausalLm::loss_sum`]; a sequence with no labelled token here gives 0.
    fn sequence_loss_sums(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<Tensor> {
        let x = self.embed_tokens(batch)?;
        let x = self.run_layers(0..self.num_layers(), &x, batch)?;
        let sums = (0..x.dim(0)?)
            .map(|i| {
                let (s, _) =
                    self.norm_head_loss(&x.narrow(0, i, 1)?, &labels.narrow(0, i, 1)?, opts)?;
                Ok(s.reshape(1)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&sums, 0)?)
    }

    /// This rank's token cross-entropy sums and counts for several label sets of one batch (each
    /// `(batch, n)` i64 like [`CausalLm::loss_sum`]'s, e.g. the labels of one position bucket
    /// with every other label `-100`): one forward, then one head loss per set. Collective over
    /// tp: every rank passes the same number of sets.
    fn loss_sums_per_labels(
        &self,
        batch: &Batch,
        labels: &[Tensor],
        opts: &CrossEntropyOptions,
    ) -> Result<Vec<(Tensor, usize)>> {
        let x = self.embed_tokens(batch)?;
        let x = self.run_layers(0..self.num_layers(), &x, batch)?;
        labels
            .iter()
            .map(|l| self.norm_head_loss(&x, l, opts))
            .collect()
    }

    /// `loss.backward()` plus the parameter gradients computed inside recomputed layers.
    fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Ok(self.ctx().backward(loss)?)
    }

    /// Generation, the first stage's work: the embeddings of the new tokens `ids` `(batch, n)`.
    /// A family without cached generation errors.
    fn embed_cached(&self, ids: &Tensor) -> Result<Tensor> {
        let _ = ids;
        Err(no_generation())
    }

    /// Generation: decoder layers `layers` on the new tokens' hidden states `x`, at positions
    /// `cache.len()..`, extending those layers' keys and values in `cache`
    /// ([`KvCache::advance`] moves the position once every range of the step has run).
    fn layers_cached(
        &self,
        x: &Tensor,
        layers: Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let _ = (x, layers, cache);
        Err(no_generation())
    }

    /// Generation, the last stage's work: the logits `(batch, vocab)` f32 of the last of the
    /// new tokens.
    fn head_cached(&self, x: &Tensor) -> Result<Tensor> {
        let _ = x;
        Err(no_generation())
    }

    /// Names of the parameters of this rank's end units (embedding, final norm, head), which
    /// the first and the last pipeline stage both hold. Local.
    fn end_params(&self) -> Vec<String>;

    /// The LoRA adapters the model was built with, if any.
    fn adapters(&self) -> Option<&Arc<Adapters>> {
        None
    }

    /// Whole tensors named as the model's parameters (values, gradients; with any prefix such
    /// as PEFT's) under the names and layout of the family's checkpoint: Phi-3's q, k and v
    /// fused into `qkv_proj`, its gate and up into `gate_up_proj`. Most families store their
    /// parameters as they are.
    fn to_checkpoint(&self, tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        Ok(tensors)
    }
}

/// The keys and values of every layer for incremental generation, and the position of the
/// next tokens.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
}

impl KvCache {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Moves the position of the next tokens on by `n`, once every layer has cached them.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The tokens layer `i` keeps (all of them, or those its sliding window can still reach).
    pub fn layer_len(&self, i: usize) -> usize {
        self.layers.get(i).map_or(0, LayerKv::len)
    }

    /// Layer `i`'s keys and values of a model of `num_layers` layers. Errors when `i` is out
    /// of range.
    pub fn layer(&mut self, i: usize, num_layers: usize) -> Result<&mut LayerKv> {
        if self.layers.len() != num_layers {
            self.layers = vec![LayerKv::default(); num_layers];
        }
        self.layers.get_mut(i).ok_or_else(|| {
            crate::Error::Invalid(format!("layer {i} of a model with {num_layers} layers"))
        })
    }
}

/// One micro-batch as every stage sees it: the batch (ids, positions, mask) and the shifted
/// labels of this rank's tokens.
pub struct StageMicroBatch {
    pub batch: Batch,
    pub labels: Tensor,
}

fn no_generation() -> crate::Error {
    crate::Error::Invalid("this model family does not generate with a KV cache".into())
}

/// Any [`CausalLm`] as pipeline stages with its next-token loss (see the
/// [module docs](self)).
pub struct LmStages<'a, M: ?Sized> {
    pub model: &'a M,
    pub opts: CrossEntropyOptions,
    /// For a mixture of experts: add the routers' load-balancing loss to the last stage's loss
    /// (the training loss, as [`CausalLm::training_loss_sum`]); false: the next-token loss
    /// alone, as [`CausalLm::loss_sum`] (`cpl eval`).
    pub balancing_loss: bool,
}

impl<M: CausalLm + ?Sized> StagedModel for LmStages<'_, M> {
    type Micro = StageMicroBatch;

    fn activation_shape(&self, m: &StageMicroBatch) -> candle_parallel::Result<Shape> {
        let (b, n) = m.batch.input_ids.dims2()?;
        let n = self.model.ctx().layer_token_count(n);
        Ok(Shape::from((b, n, self.model.hidden_size())))
    }

    fn embed(&self, m: &StageMicroBatch) -> candle_parallel::Result<Tensor> {
        Ok(self.model.embed_tokens(&m.batch)?)
    }

    fn run_layers(
        &self,
        layers: Range<usize>,
        x: &Tensor,
        m: &StageMicroBatch,
    ) -> candle_parallel::Result<Tensor> {
        Ok(self.model.run_layers(layers, x, &m.batch)?)
    }

    /// The next-token loss, and for a mixture of experts (with
    /// [`LmStages::balancing_loss`]) the load-balancing loss of every stage's routers (their
    /// statistics carried here), with [`router_parts`], as [`CausalLm::training_loss_sum`] on
    /// one stage.
    fn head_loss(&self, x: &Tensor, m: &StageMicroBatch) -> candle_parallel::Result<StageLoss> {
        let (sum, count) = self.model.norm_head_loss(x, &m.labels, &self.opts)?;
        let Some((aux, coef)) = self.model.routers() else {
            return Ok(StageLoss::new(sum));
        };
        let stats = aux.finish_stage(self.model.ctx(), count)?;
        let coef = if self.balancing_loss { coef } else { 0.0 };
        let sum = with_balancing_loss(aux, coef, sum, count)?;
        aux.park();
        Ok(StageLoss {
            sum,
            parts: router_parts(&stats, count, &self.model.router_layers())?,
        })
    }

    fn backward(&self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        Ok(self.model.backward(root)?)
    }

    fn shared_params(&self) -> Vec<String> {
        self.model.end_params()
    }

    /// A mixture of experts' routing statistics travel with the activations and the
    /// statistics its routers' gradient needs with the gradients ([`RouterAux`]).
    fn carry_lens(&self) -> (usize, usize) {
        self.aux().map_or((0, 0), |a| {
            (
                a.forward_carry_len(self.model.num_layers()),
                a.backward_carry_len(),
            )
        })
    }

    fn begin_forward(
        &self,
        micro_batch: usize,
        carried: Option<&[f64]>,
    ) -> candle_parallel::Result<()> {
        self.aux().map_or(Ok(()), |a| {
            a.begin_stage(micro_batch, carried, self.model.num_layers())
        })
    }

    fn forward_carry(&self, _micro_batch: usize) -> candle_parallel::Result<Vec<f64>> {
        self.aux().map_or(Ok(Vec::new()), |a| {
            a.forward_carry(self.model.ctx(), self.model.num_layers())
        })
    }

    fn begin_backward(
        &self,
        micro_batch: usize,
        carried: Option<&[f64]>,
    ) -> candle_parallel::Result<()> {
        self.aux()
            .map_or(Ok(()), |a| a.begin_backward(micro_batch, carried))
    }

    fn backward_carry(&self, _micro_batch: usize) -> candle_parallel::Result<Vec<f64>> {
        Ok(self.aux().map(|a| a.backward_carry()).unwrap_or_default())
    }
}

impl<M: CausalLm + ?Sized> LmStages<'_, M> {
    /// The model's routers' statistics (a mixture of experts).
    fn aux(&self) -> Option<&Arc<RouterAux>> {
        self.model.routers().map(|(a, _)| a)
    }
}

/// `sum` (this rank's summed next-token loss over its `count` labelled tokens) plus
/// `coef · aux · count` ([`RouterAux::add_to_loss`], after its statistics are finished); `sum`
/// itself when `coef` is 0. The one place both the whole-model and the pipelined training loss
/// add the balancing loss.
fn with_balancing_loss(
    aux: &Arc<RouterAux>,
    coef: f64,
    sum: Tensor,
    count: usize,
) -> candle_parallel::Result<Tensor> {
    if coef == 0.0 {
        Ok(sum)
    } else {
        aux.add_to_loss(&sum, count, coef)
    }
}

/// The parts a mixture of experts' next-token loss reports (`train`'s `ROUTER_PARTS`, then the
/// load of each of `layers`), each times the micro-batch's `count` labelled tokens on this rank
/// so that they average like the loss. Errors when a layer has no statistics.
pub fn router_parts(stats: &RouterStats, count: usize, layers: &[usize]) -> Result<Vec<f64>> {
    let n = count as f64;
    let mut parts = vec![
        stats.aux * n,
        stats.load_max_over_mean * n,
        stats.dropped_fraction * n,
    ];
    for layer in layers {
        let load = stats
            .layer_loads
            .iter()
            .find(|(l, _)| l == layer)
            .ok_or_else(|| {
                crate::Error::Invalid(format!("no routing statistics of sparse layer {layer}"))
            })?;
        parts.push(load.1 * n);
    }
    Ok(parts)
}

/// A model of any registered family ([`crate::family::Family::load_causal_lm`]) is a causal LM.
impl Parallelize for Box<dyn CausalLm> {
    fn units(&mut self) -> Vec<&mut dyn candle_parallel::nn::UnitOps> {
        (**self).units()
    }
}

impl CausalLm for Box<dyn CausalLm> {
    fn ctx(&self) -> &ParallelCtx {
        (**self).ctx()
    }

    fn hidden_size(&self) -> usize {
        (**self).hidden_size()
    }

    fn num_layers(&self) -> usize {
        (**self).num_layers()
    }

    fn embed_tokens(&self, batch: &Batch) -> Result<Tensor> {
        (**self).embed_tokens(batch)
    }

    fn run_layers(&self, layers: Range<usize>, x: &Tensor, batch: &Batch) -> Result<Tensor> {
        (**self).run_layers(layers, x, batch)
    }

    fn norm_head_loss(
        &self,
        x: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        (**self).norm_head_loss(x, labels, opts)
    }

    fn loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        (**self).loss_sum(batch, labels, opts)
    }

    fn training_loss_sum(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        (**self).training_loss_sum(batch, labels, opts)
    }

    fn routers(&self) -> Option<(&Arc<RouterAux>, f64)> {
        (**self).routers()
    }

    fn router_layers(&self) -> Vec<usize> {
        (**self).router_layers()
    }

    fn norm_head_logits(&self, x: &Tensor) -> Result<Tensor> {
        (**self).norm_head_logits(x)
    }

    fn logits(&self, batch: &Batch) -> Result<Tensor> {
        (**self).logits(batch)
    }

    fn sequence_loss_sums(
        &self,
        batch: &Batch,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<Tensor> {
        (**self).sequence_loss_sums(batch, labels, opts)
    }

    fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        (**self).backward(loss)
    }

    fn end_params(&self) -> Vec<String> {
        (**self).end_params()
    }

    fn adapters(&self) -> Option<&Arc<Adapters>> {
        (**self).adapters()
    }

    fn to_checkpoint(&self, tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        (**self).to_checkpoint(tensors)
    }

    fn embed_cached(&self, ids: &Tensor) -> Result<Tensor> {
        (**self).embed_cached(ids)
    }

    fn layers_cached(
        &self,
        x: &Tensor,
        layers: Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        (**self).layers_cached(x, layers, cache)
    }

    fn head_cached(&self, x: &Tensor) -> Result<Tensor> {
        (**self).head_cached(x)
    }
}
