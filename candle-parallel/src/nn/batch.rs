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
    /// Which of the local tokens count in a mixture of experts' routing statistics,
    /// `batch · n` flags, sequence-major (see [`Pass::routed`]); `None`: all of them.
    pub routed: Option<Vec<bool>>,
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

    /// [`Batch::from_tokens`] for sequences whose last `padding[i]` tokens are padding: their
    /// routing is left out of a mixture of experts' statistics ([`Batch::routed`]), as
    /// transformers leaves out the tokens its `attention_mask` zeroes. Errors like
    /// `from_tokens`, and when a padding count is missing or exceeds its sequence.
    pub fn from_padded_tokens(
        ctx: &ParallelCtx,
        ids: &[Vec<u32>],
        labels: &[Vec<i64>],
        mask: AttnMask,
        padding: &[usize],
    ) -> Result<(Self, Tensor)> {
        let (mut batch, labels) = Self::from_tokens(ctx, ids, labels, mask)?;
        let len = ids[0].len();
        if padding.len() != ids.len() || padding.iter().any(|&p| p > len) {
            return Err(Error::invalid(
                "batch",
                format!(
                    "padding counts {padding:?} for {} sequences of {len} tokens",
                    ids.len()
                ),
            ));
        }
        if padding.iter().all(|&p| p == 0) {
            return Ok((batch, labels));
        }
        let flags: Vec<u8> = padding
            .iter()
            .flat_map(|&p| (0..len).map(move |i| u8::from(i < len - p)))
            .collect();
        let flags = Tensor::from_vec(flags, (ids.len(), len), ctx.device())?;
        let local = ctx.shard_tokens_for(&flags, &batch.mask)?;
        batch.routed = Some(
            local
                .flatten_all()?
                .to_vec1::<u8>()?
                .into_iter()
                .map(|f| f == 1)
                .collect(),
        );
        Ok((batch, labels))
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
            routed: None,
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
        if let Some(r) = &self.routed {
            let b = self.input_ids.dim(0)?;
            if r.len() != b * n {
                return Err(Error::invalid(
                    "batch",
                    format!("{} routing flags for {b} sequences of {n} tokens", r.len()),
                ));
            }
        }
        Ok(Pass::new(ctx, &self.positions, &self.mask).with_routed(self.routed.as_deref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{SeqLayout, SpConfig, Strategy};
    use crate::comm::LocalWorld;
    use crate::plan::Layout;

    /// Each rank's routing flags are its shard of the padded sequences' (contiguous ring 2:
    /// the first and second halves), and bad padding counts are errors naming the batch.
    #[test]
    fn padding_flags_are_sharded_like_the_tokens_and_bad_counts_are_errors() {
        let ids = vec![vec![1u32, 2, 3, 4, 5, 6], vec![7, 8, 9, 10, 11, 12]];
        let labels = vec![vec![0i64; 6]; 2];
        let sp = SpConfig::new(Strategy::Ring, 1, 2).with_layout(SeqLayout::Contiguous);
        let layout = Layout::new(sp.mesh_config(), sp, crate::nn::TpActivations::Replicated);
        let flags = LocalWorld::run(2, |world| -> Result<_> {
            let (_, ctx) = layout.context(world)?;
            let padded =
                |p: &[usize]| Batch::from_padded_tokens(&ctx, &ids, &labels, AttnMask::Causal, p);
            let (b, _) = padded(&[4, 0])?;
            b.pass(&ctx)?;
            let (none, _) = padded(&[0, 0])?;
            assert_eq!(none.routed, None, "no padding: every token counts");
            // A sequence of padding alone is a padding count, not an error.
            let (all, _) = padded(&[6, 0])?;
            let t = true;
            assert_eq!(all.routed, Some(vec![false, false, false, t, t, t]));
            for bad in [&[1usize][..], &[0, 7]] {
                let e = padded(bad).expect_err("a bad padding count").to_string();
                assert!(e.contains("batch") && e.contains("padding"), "{e}");
            }
            Ok(b.routed)
        })
        .unwrap();
        let t = true;
        assert_eq!(flags[0], Some(vec![t, t, false, t, t, t]));
        assert_eq!(flags[1], Some(vec![false, false, false, t, t, t]));
    }
}
