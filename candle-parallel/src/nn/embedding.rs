//! Vocab-parallel embedding (Megatron-LM's `VocabParallelEmbedding`).
//!
//! The `(V, hidden)` table is split by rows over the tensor-parallel group: rank `r` of `P` holds
//! rows `[r·V/P, (r+1)·V/P)`. Each rank looks up the ids that fall in its range (the others
//! contribute zeros) and the partial results are summed over the group with
//! [`reduce_from_parallel_region`] (all-reduce in forward, identity in backward), so every rank
//! obtains the full embedding and its shard receives the gradient of its own rows. Under TP-sp
//! each rank then keeps its own part of the tokens. The lookup is [`embedding_lookup`]: a row's
//! gradient sums its tokens in f32 (candle's `index_select` sums them in the table's dtype).

use std::ops::Range;

use candle_core::{DType, Tensor};

use super::{ParallelCtx, ParamBuilder, Shard, TpGroup};
use crate::collectives::reduce_from_parallel_region;
use crate::error::{Error, Result};
use crate::ops::embedding_lookup;

const OP: &str = "VocabParallelEmbedding";

/// The shape of an embedding table `weight` `(vocab_size, hidden_size)` (also that of a
/// vocab-parallel LM head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
}

/// Embedding whose vocabulary is split over the tensor-parallel group.
///
/// Rank `r` of the group (`P` ranks) holds rows `[r·V/P, (r+1)·V/P)` of the `(V, hidden)` table
/// (`V % P == 0`).
#[derive(Clone, Debug)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    vocab_size: usize,
    tp: TpGroup,
}

impl VocabParallelEmbedding {
    /// Loads this rank's rows of `vb`'s `weight`. Errors when the tensor-parallel degree does
    /// not divide the vocabulary.
    pub fn new(cfg: &EmbeddingConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        let w = load_vocab_rows(cfg, &vb, ctx)?;
        Self::from_weight(w, cfg.vocab_size, ctx.tp().clone())
    }

    /// `weight`: this rank's shard `(V/P, hidden)` (usually a `Var`'s tensor); `vocab_size`: `V`.
    pub fn from_weight(weight: Tensor, vocab_size: usize, tp: TpGroup) -> Result<Self> {
        let p = tp.size();
        if vocab_size == 0 || !vocab_size.is_multiple_of(p) {
            return Err(Error::invalid(
                OP,
                format!("vocab size {vocab_size} is not a positive multiple of the {p} ranks"),
            ));
        }
        let (rows, _hidden) = weight.dims2().map_err(|_| {
            Error::invalid(
                OP,
                format!(
                    "weight must be (V/P, hidden), got shape {:?}",
                    weight.dims()
                ),
            )
        })?;
        if rows != vocab_size / p {
            return Err(Error::invalid(
                OP,
                format!(
                    "weight shard has {rows} rows, expected V/P = {vocab_size}/{p} = {}",
                    vocab_size / p
                ),
            ));
        }
        Ok(Self {
            weight,
            vocab_size,
            tp,
        })
    }

    /// This rank's shard `(V/P, hidden)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The full vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The ids whose rows this rank holds.
    pub fn vocab_range(&self) -> Range<usize> {
        let shard = self.vocab_size / self.tp.size();
        let start = self.tp.rank() * shard;
        start..start + shard
    }

    /// Looks up `ids` `(batch, tokens)` (u32) and returns `(batch, tokens', hidden)`: every
    /// token, identical on every rank, or under TP-sp this rank's part of the tokens.
    ///
    /// Collective over the tensor-parallel group: every rank calls it with the same ids (one
    /// all-reduce of the output in forward; nothing in backward, or the gather of TP-sp). Ids
    /// `>= V` are an error, reported before any communication.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let full = self.lookup(ids)?;
        self.tp.split_tokens(&full)
    }

    /// Looks up `ids` (u32, any shape `(..)`) and returns `(.., hidden)`, identical on every
    /// rank (no TP-sp split). Collective like [`VocabParallelEmbedding::forward`].
    pub fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.dtype() != DType::U32 {
            return Err(Error::invalid(
                OP,
                format!("ids must be u32, got {:?}", ids.dtype()),
            ));
        }
        let hidden = self.weight.dim(1)?;
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(hidden);
        let flat: Vec<u32> = ids.flatten_all()?.to_vec1()?;
        if let Some((pos, &bad)) = flat
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "id {bad} at flat position {pos} is out of range for vocabulary size {}",
                    self.vocab_size
                ),
            ));
        }
        if self.tp.size() == 1 {
            let rows: Vec<Option<u32>> = flat.into_iter().map(Some).collect();
            return Ok(embedding_lookup(&self.weight, &rows)?.reshape(out_dims)?);
        }

        // Ids of other ranks' shards look up zeros here and send this shard no gradient; the
        // shard's gradient is the sum of the output gradient's rows whose ids it holds.
        let range = self.vocab_range();
        let rows: Vec<Option<u32>> = flat
            .iter()
            .map(|&id| {
                range
                    .contains(&(id as usize))
                    .then(|| id - range.start as u32)
            })
            .collect();
        let partial = embedding_lookup(&self.weight, &rows)?;
        let full = reduce_from_parallel_region(&partial, self.tp.comm())?;
        Ok(full.reshape(out_dims)?)
    }
}

/// This rank's rows `(V/P, H)` of `vb`'s `weight` (an embedding table or an LM head).
pub(crate) fn load_vocab_rows(
    cfg: &EmbeddingConfig,
    vb: &ParamBuilder,
    ctx: &ParallelCtx,
) -> Result<Tensor> {
    let tp = ctx.tp();
    let (_, rows) = tp.share(
        &format!("{}.weight rows (vocab_size)", vb.prefix()),
        cfg.vocab_size,
    )?;
    let shard = Shard::new(0, tp.rank(), tp.size());
    vb.get_with_hints((rows, cfg.hidden_size), "weight", shard)
}
