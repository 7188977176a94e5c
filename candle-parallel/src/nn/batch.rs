//! What one forward pass of a token model works on: this rank's sequence shard of a batch.

use candle_core::Tensor;

use super::{ParallelCtx, Pass, IGNORE_INDEX};
use crate::attention::AttnMask;
use crate::error::{Error, Result};

/// This rank's sequence shard of a batch of equal-length token sequences.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `(batch, n)` u32 token ids of this rank's sequence shard.
    pub input_ids: Tensor,
    /// Global positions (RoPE) of the `n` local tokens.
    pub positions: Vec<u32>,
    /// The attention mask of the global sequence.
    pub mask: AttnMask,
}

impl Batch {
    /// This rank's shard of equal-length global sequences and their next-token labels
    /// (`(batch, n)` i64, label [`IGNORE_INDEX`] after the last token of each sequence), cut by
    /// the layout of `ctx`. Errors when the length does not fit the layout.
    pub fn from_sequences(
        ctx: &ParallelCtx,
        seqs: &[Vec<u32>],
        mask: AttnMask,
    ) -> Result<(Self, Tensor)> {
        let labels: Vec<Vec<i64>> = seqs
            .iter()
            .map(|s| {
                s.iter()
                    .skip(1)
                    .map(|&t| t as i64)
                    .chain(std::iter::once(IGNORE_INDEX))
                    .collect()
            })
            .collect();
        Self::from_tokens(ctx, seqs, &labels, mask)
    }

    /// This rank's shard of equal-length global sequences `ids` and their `labels` (the target
    /// of each token, [`IGNORE_INDEX`] ignored), cut by the layout of `ctx` for `mask`; returns the batch
    /// and the local labels `(batch, n)` i64.
    pub fn from_tokens(
        ctx: &ParallelCtx,
        ids: &[Vec<u32>],
        labels: &[Vec<i64>],
        mask: AttnMask,
    ) -> Result<(Self, Tensor)> {
        let len = ids.first().map(|s| s.len()).unwrap_or(0);
        if len == 0 || ids.iter().any(|s| s.len() != len) {
            return Err(Error::invalid(
                "batch",
                "a batch needs one or more non-empty sequences of equal length",
            ));
        }
        if labels.len() != ids.len() || labels.iter().any(|l| l.len() != len) {
            return Err(Error::invalid(
                "batch",
                "labels must have the shape of the token ids",
            ));
        }
        let dev = ctx.device();
        let flat_ids: Vec<u32> = ids.iter().flatten().copied().collect();
        let flat_labels: Vec<i64> = labels.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat_ids, (ids.len(), len), dev)?;
        let labels = Tensor::from_vec(flat_labels, (labels.len(), len), dev)?;
        let labels = ctx.shard_tokens_for(&labels, &mask)?;
        let batch = Batch {
            input_ids: ctx.shard_tokens_for(&ids, &mask)?,
            positions: ctx.attention_positions_for(len, &mask)?,
            mask,
        };
        Ok((batch, labels))
    }

    /// The pass of this batch with `ctx`'s attention (see [`Pass`]). Errors when the positions
    /// do not match the local tokens.
    pub fn pass<'a>(&'a self, ctx: &'a ParallelCtx) -> Result<Pass<'a>> {
        let (_, n) = self.input_ids.dims2()?;
        if self.positions.len() != n {
            return Err(Error::invalid(
                "batch",
                format!("{} positions for {n} tokens", self.positions.len()),
            ));
        }
        Ok(Pass::new(ctx, &self.positions, &self.mask))
    }
}
