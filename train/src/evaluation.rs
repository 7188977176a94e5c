//! Held-out evaluation of a causal language model under any layout: the mean next-token loss
//! of whole sequences (pipelined or not), optionally by position bucket and with the global
//! logits. `cpl eval`, `cpl bench eval` and library users call [`score`] on every rank.

use candle_core::{DType, Device, Tensor};
use candle_parallel::attention::AttnMask;
use candle_parallel::comm::ReduceOp;
use candle_parallel::mesh::{DeviceMesh, Dim};
use candle_parallel::nn::{Batch, CrossEntropyOptions, ParallelCtx, IGNORE_INDEX};
use models::{CausalLm, StageMicroBatch};

use crate::error::{Error, Result};
use crate::trainer::{pipeline_eval, PipelineConfig};

/// The result of an evaluation (`cpl eval --json` prints it, for every model).
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub loss: f64,
    pub perplexity: f64,
    pub tokens: u64,
    pub sequences: usize,
    /// Wall time of the forward passes (slowest rank; loading excluded).
    pub seconds: f64,
    /// Tokens scored per second over `seconds`.
    pub tokens_per_sec: f64,
    /// `--by-position`: the model evaluated and the loss of each position bucket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_position: Option<ByPosition>,
}

/// The loss by token position of one evaluation (`cpl eval --by-position`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ByPosition {
    pub model: String,
    pub buckets: Vec<PositionBucket>,
}

/// Tokens at positions `from..to` (the number of tokens before each): their mean loss.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PositionBucket {
    pub from: usize,
    pub to: usize,
    pub loss: f64,
    pub tokens: u64,
}

/// The position buckets of sequences of at most `len` tokens: `[1, 16), [16, 32), ...`
/// doubling, the last ending at `len` (a token's position is the number of tokens before it;
/// position 0 has no label).
pub fn position_buckets(len: usize) -> Vec<(usize, usize)> {
    let (mut from, mut to, mut v) = (1, 16, Vec::new());
    while from < len {
        v.push((from, to.min(len)));
        from = to;
        to *= 2;
    }
    v
}

/// Dtype of a model's activations: that of its parameters (f32 when it has none).
pub fn activation_dtype(params: &candle_parallel::nn::ParamList) -> DType {
    params
        .sorted()
        .first()
        .map(|p| p.tensor.dtype())
        .unwrap_or(DType::F32)
}

/// What [`score`] computes besides the loss.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScoreOptions<'a> {
    /// The pipeline whose stage the model is (the model then holds this rank's layers).
    pub pipeline: Option<&'a PipelineConfig>,
    /// World rank 0 also returns every sequence's global logits (no pipeline).
    pub logits: bool,
    /// The loss of each position bucket (no pipeline; see [`position_buckets`]).
    pub buckets: Option<&'a [(usize, usize)]>,
    /// The scored length of each sequence: the tokens after it are padding (the last window
    /// of a text, padded to a length the layout can split), neither scored nor predicted, and
    /// cut from the logits. `None`: every token is scored.
    pub lengths: Option<&'a [usize]>,
}

/// The next-token labels of `seq` when only its first `len` tokens are real: the label of
/// position `p` is token `p + 1` while that is real, [`IGNORE_INDEX`] after.
fn scored_labels(seq: &[u32], len: usize) -> Vec<i64> {
    (0..seq.len())
        .map(|p| match seq.get(p + 1) {
            Some(&t) if p + 1 < len => t as i64,
            _ => IGNORE_INDEX,
        })
        .collect()
}

/// The mean loss of `model` (this rank's stage, activations in `act`) on `seqs`, timed from a
/// barrier to the slowest rank's end, with what `opts` asks for. Collective over the world of
/// `mesh`; `seqs` the same on every rank. Every rank runs as many forwards as the busiest data
/// rank, since a forward may be collective over the data ranks (ZeRO-3 gathers parameters in
/// each, expert parallelism exchanges tokens): the others score a sequence whose result they
/// drop. With `logits`, every rank runs every sequence's forwards.
pub fn score(
    mesh: &DeviceMesh,
    ctx: &ParallelCtx,
    model: &dyn CausalLm,
    act: DType,
    seqs: &[Vec<u32>],
    opts: &ScoreOptions<'_>,
) -> Result<(EvalReport, Vec<Tensor>)> {
    let ScoreOptions {
        pipeline,
        logits: want_logits,
        buckets,
        lengths,
    } = *opts;
    if lengths
        .is_some_and(|l| l.len() != seqs.len() || l.iter().zip(seqs).any(|(&n, s)| n > s.len()))
    {
        return Err(Error::Invalid(
            "score: one scored length per sequence, at most its length".into(),
        ));
    }
    let len_of = |i: usize| lengths.map_or(seqs[i].len(), |l| l[i]);
    let batch_of = |i: usize| {
        let labels = scored_labels(&seqs[i], len_of(i));
        Batch::from_tokens(
            ctx,
            std::slice::from_ref(&seqs[i]),
            std::slice::from_ref(&labels),
            AttnMask::Causal,
        )
    };
    if pipeline.is_some() && (want_logits || buckets.is_some()) {
        return Err(Error::Invalid(
            "logits and losses by position are not available through pipeline stages".into(),
        ));
    }
    let nb = buckets.map_or(0, <[_]>::len);
    let (mut bucket_sums, mut bucket_counts) = (vec![0f64; nb], vec![0f64; nb]);
    let (dp, dp_rank) = (mesh.size(Dim::Dp), mesh.coord(Dim::Dp));
    let loss_opts = CrossEntropyOptions::default();
    mesh.world().barrier()?;
    let start = std::time::Instant::now();
    let (mut sum, mut count) = (0f64, 0u64);
    let mut logits = Vec::new();
    let n = seqs.len();
    // Forwards per data rank: the busiest rank's.
    let rounds = n.div_ceil(dp) * dp;
    if let Some(pc) = pipeline {
        // This data-parallel rank's sequences, forward through the stages (padded to the
        // busiest rank's count with a sequence whose labels are all ignored).
        let micro = (dp_rank..rounds)
            .step_by(dp)
            .map(|i| {
                let (batch, labels) = batch_of(i % n)?;
                let labels = if i < n {
                    labels
                } else {
                    Tensor::full(IGNORE_INDEX, labels.shape(), labels.device())?
                };
                Ok(StageMicroBatch { batch, labels })
            })
            .collect::<Result<Vec<_>>>()?;
        (sum, count) = pipeline_eval(model, &mesh.comm(Dim::Pp), pc, &micro, loss_opts, act)?;
    }
    let rounds = if want_logits { n } else { rounds };
    for i in (0..rounds).filter(|_| pipeline.is_none()) {
        let mine = i % dp == dp_rank && i < n;
        if i % dp != dp_rank && !want_logits {
            continue;
        }
        let (batch, labels) = batch_of(i % n)?;
        // The ranks that do not score this sequence run its forwards too, and drop the result.
        let (s, c) = model.loss_sum(&batch, &labels, &loss_opts)?;
        if mine {
            sum += s.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            count += c as u64;
        }
        if let Some(b) = buckets {
            // This rank's labels of each bucket, by the global position of the token each
            // predicts (one after the input token's).
            let local = labels.flatten_all()?.to_vec1::<i64>()?;
            let sets = b
                .iter()
                .map(|&(from, to)| {
                    let masked: Vec<i64> = local
                        .iter()
                        .zip(&batch.positions)
                        .map(|(&l, &p)| {
                            let pos = p as usize + 1;
                            if (from..to).contains(&pos) {
                                l
                            } else {
                                IGNORE_INDEX
                            }
                        })
                        .collect();
                    Ok(Tensor::new(masked, labels.device())?.reshape(labels.shape())?)
                })
                .collect::<Result<Vec<_>>>()?;
            let sums = model.loss_sums_per_labels(&batch, &sets, &loss_opts)?;
            for (k, (s, c)) in sums.into_iter().enumerate().filter(|_| mine) {
                bucket_sums[k] += s.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                bucket_counts[k] += c as f64;
            }
        }
        if want_logits {
            let l = model.logits(&batch)?;
            let global = ctx.gather_tokens(&l)?;
            if mesh.rank() == 0 {
                logits.push(global.squeeze(0)?.narrow(0, 0, len_of(i % n))?);
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let seconds = mesh
        .world()
        .all_reduce(&Tensor::new(&[elapsed], &Device::Cpu)?, ReduceOp::Max)?
        .to_vec1::<f64>()?[0];
    let group = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
    let mut local = vec![sum, count as f64];
    local.extend(&bucket_sums);
    local.extend(&bucket_counts);
    let totals = group.all_reduce(&Tensor::new(local, &Device::Cpu)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    let by_position = buckets.map(|b| ByPosition {
        model: String::new(),
        buckets: b
            .iter()
            .enumerate()
            .map(|(k, &(from, to))| {
                let (s, c) = (totals[2 + k], totals[2 + nb + k]);
                PositionBucket {
                    from,
                    to,
                    loss: if c > 0.0 { s / c } else { f64::NAN },
                    tokens: c as u64,
                }
            })
            .collect(),
    });
    let (sum, count) = (totals[0], totals[1] as u64);
    if count == 0 {
        return Err(Error::Invalid("no tokens to evaluate".into()));
    }
    let loss = sum / count as f64;
    Ok((
        EvalReport {
            loss,
            perplexity: loss.exp(),
            tokens: count,
            sequences: seqs.len(),
            seconds,
            tokens_per_sec: count as f64 / seconds.max(1e-12),
            by_position,
        },
        logits,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_is_neither_scored_nor_predicted() {
        let seq = [5, 6, 7, 0, 0];
        let i = IGNORE_INDEX;
        assert_eq!(scored_labels(&seq, 5), vec![6, 7, 0, 0, i]);
        assert_eq!(scored_labels(&seq, 3), vec![6, 7, i, i, i]);
        assert_eq!(scored_labels(&seq, 1), vec![i; 5]);
    }
}
