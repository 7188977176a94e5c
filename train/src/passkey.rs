//! Passkey retrieval, the classic long-context check (Mohtashami & Jaggi, "Landmark Attention",
//! 2023; used by LongLoRA, YaRN, EasyContext): a random number hidden at a depth in filler text,
//! the model asked to repeat it.
//!
//! A prompt of `length` tokens is: filler, the needle "The pass key is K. Remember it. K is the
//! pass key." at `depth` (0: right after the start, 1: right before the question), more filler,
//! then "What is the pass key? The pass key is" and the answer " K". Every part is tokenized by
//! the model's own tokenizer; the filler is the usual repeated sentences, cut by tokens to fit.
//!
//! Scoring (teacher-forced greedy, [`score_answer`]): the prompt and answer run forward once;
//! the answer is retrieved when the argmax of the logits at every answer position is the answer
//! token, which is exactly when greedy generation from the prompt would emit the answer's tokens.
//! The answer tokens' mean log-likelihood is reported beside it. Keys are drawn from a fixed
//! seed, so a grid is the same for every model with the same tokenizer.
//!
//! [`evaluate`] scores a grid on every rank under any layout but a pipeline: `cpl eval
//! --passkey` calls it on a loaded checkpoint, `cpl train --eval-passkey` on the model being
//! trained at each evaluation.

use candle_core::{DType, Device, Tensor, D};
use candle_parallel::attention::AttnMask;
use candle_parallel::comm::ReduceOp;
use candle_parallel::mesh::{DeviceMesh, Dim};
use candle_parallel::nn::{Batch, ParallelCtx, IGNORE_INDEX};
use models::diffusion::DrawStream;
use models::CausalLm;

use crate::error::{Error, Result};

/// The filler sentences (as in the passkey papers).
pub const FILLER: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. \
                          There and back again. ";

/// One prompt of the grid.
#[derive(Clone, Debug, PartialEq)]
pub struct PasskeyPrompt {
    /// Tokens of the prompt followed by the answer's tokens (`tokens.len()` is the length).
    pub tokens: Vec<u32>,
    /// Index of the first answer token in `tokens`; the answer runs to the end.
    pub answer_start: usize,
    pub key: u32,
    pub length: usize,
    pub depth: f64,
}

/// Builds the prompt of `length` tokens with `key` at `depth` in `[0, 1]`. `encode` is the
/// model's tokenizer without special tokens; `bos`, when the model has one, starts the prompt.
/// Errors when `length` cannot hold the needle, the question and the answer.
pub fn build_prompt(
    encode: &dyn Fn(&str) -> Result<Vec<u32>>,
    bos: Option<u32>,
    length: usize,
    depth: f64,
    key: u32,
) -> Result<PasskeyPrompt> {
    if !(0.0..=1.0).contains(&depth) {
        return Err(Error::Invalid(format!(
            "passkey depth {depth} is not in [0, 1]"
        )));
    }
    let needle = encode(&format!(
        " The pass key is {key}. Remember it. {key} is the pass key."
    ))?;
    let question = encode(" What is the pass key? The pass key is")?;
    let answer = encode(&format!(" {key}"))?;
    let filler_unit = encode(FILLER)?;
    if filler_unit.is_empty() || answer.is_empty() {
        return Err(Error::Invalid(
            "the tokenizer gives no tokens for the passkey filler or answer".into(),
        ));
    }
    let fixed = usize::from(bos.is_some()) + needle.len() + question.len() + answer.len();
    if length <= fixed {
        return Err(Error::Invalid(format!(
            "passkey length {length}: the needle, question and answer alone take {fixed} tokens"
        )));
    }
    let filler_len = length - fixed;
    let filler: Vec<u32> = filler_unit
        .iter()
        .copied()
        .cycle()
        .take(filler_len)
        .collect();
    let before = (filler_len as f64 * depth).round() as usize;
    let mut tokens = Vec::with_capacity(length);
    tokens.extend(bos);
    tokens.extend_from_slice(&filler[..before]);
    tokens.extend_from_slice(&needle);
    tokens.extend_from_slice(&filler[before..]);
    tokens.extend_from_slice(&question);
    let answer_start = tokens.len();
    tokens.extend_from_slice(&answer);
    debug_assert_eq!(tokens.len(), length);
    Ok(PasskeyPrompt {
        tokens,
        answer_start,
        key,
        length,
        depth,
    })
}

/// The grid's prompts: for each length and depth, `trials` keys (5 digits, from `seed`).
pub fn grid(
    encode: &dyn Fn(&str) -> Result<Vec<u32>>,
    bos: Option<u32>,
    lengths: &[usize],
    depths: &[f64],
    trials: usize,
    seed: u64,
) -> Result<Vec<PasskeyPrompt>> {
    // The stable splitmix64 stream the crate's other seeded draws use.
    let mut rng = DrawStream::new(seed, 0);
    let mut out = Vec::new();
    for &length in lengths {
        for &depth in depths {
            for _ in 0..trials {
                let key = 10_000 + (rng.next_u64() % 90_000) as u32;
                out.push(build_prompt(encode, bos, length, depth, key)?);
            }
        }
    }
    Ok(out)
}

/// The teacher-forced greedy score of one answer: `predicted[i]` is the argmax token of the
/// logits at the position that predicts `answer[i]`. Retrieved iff every answer token is
/// predicted.
pub fn score_answer(predicted: &[u32], answer: &[u32]) -> bool {
    !answer.is_empty() && predicted.len() == answer.len() && predicted == answer
}

/// Accuracy of each (length, depth) cell: `(length, depth, retrieved, trials)`.
pub fn cells(prompts: &[PasskeyPrompt], retrieved: &[bool]) -> Vec<(usize, f64, usize, usize)> {
    let mut out: Vec<(usize, f64, usize, usize)> = Vec::new();
    for (p, &ok) in prompts.iter().zip(retrieved) {
        match out.iter_mut().find(|c| c.0 == p.length && c.1 == p.depth) {
            Some(c) => {
                c.2 += usize::from(ok);
                c.3 += 1;
            }
            None => out.push((p.length, p.depth, usize::from(ok), 1)),
        }
    }
    out
}

/// A scored grid: `cpl eval --passkey --json` prints it as `passkey`, `cpl train
/// --eval-passkey` writes it into each evaluation's line of `eval.jsonl`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PasskeyReport {
    /// The model scored (empty during training: the run's model at the line's step).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    /// Retrieved prompts over all prompts.
    pub accuracy: f64,
    pub cells: Vec<PasskeyCell>,
}

/// One (length, depth) cell of a scored grid.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PasskeyCell {
    pub length: usize,
    pub depth: f64,
    pub retrieved: usize,
    pub trials: usize,
    pub accuracy: f64,
    /// Mean log-likelihood (nats) of the answer tokens, over the cell's prompts.
    pub answer_loglik: f64,
}

impl PasskeyReport {
    /// The report of `prompts` given, for each, whether it was retrieved and its answer tokens'
    /// mean log-likelihood.
    pub fn new(prompts: &[PasskeyPrompt], retrieved: &[bool], loglik: &[f64]) -> Self {
        let cells = cells(prompts, retrieved)
            .into_iter()
            .map(|(length, depth, r, n)| {
                let ll: Vec<f64> = prompts
                    .iter()
                    .zip(loglik)
                    .filter(|(p, _)| p.length == length && p.depth == depth)
                    .map(|(_, &l)| l)
                    .collect();
                PasskeyCell {
                    length,
                    depth,
                    retrieved: r,
                    trials: n,
                    accuracy: r as f64 / n as f64,
                    answer_loglik: ll.iter().sum::<f64>() / ll.len().max(1) as f64,
                }
            })
            .collect();
        let hits = retrieved.iter().filter(|&&r| r).count();
        Self {
            model: String::new(),
            accuracy: hits as f64 / retrieved.len().max(1) as f64,
            cells,
        }
    }
}

/// Scores `prompts` with `model` (this rank's part of it, built for `ctx`; any layout but a
/// pipeline): one forward pass of each prompt and its answer, the answer retrieved when every
/// answer token is the argmax of its position's logits ([`score_answer`]). Data-parallel ranks
/// share the prompts out; each sequence-parallel rank scores the answer tokens it holds.
/// Collective over the world of `mesh`, `prompts` the same on every rank; every rank returns
/// the report.
pub fn evaluate(
    mesh: &DeviceMesh,
    ctx: &ParallelCtx,
    model: &dyn CausalLm,
    prompts: &[PasskeyPrompt],
) -> Result<PasskeyReport> {
    let Some(first) = prompts.first() else {
        return Err(Error::Invalid("no passkey prompts to score".into()));
    };
    let (dp, dp_rank) = (mesh.size(Dim::Dp), mesh.coord(Dim::Dp));
    // Per prompt: the answer tokens' summed log-likelihood, their count and the wrong argmaxes.
    let mut local = vec![0f64; 3 * prompts.len()];
    for round in 0..prompts.len().div_ceil(dp) {
        let i = round * dp + dp_rank;
        // A rank past the last prompt runs the first one again and drops it, so that every rank
        // runs as many forward passes (ZeRO-3 gathers parameters in each).
        let (p, keep) = prompts.get(i).map_or((first, false), |p| (p, true));
        let (batch, labels) =
            Batch::from_sequences(ctx, std::slice::from_ref(&p.tokens), AttnMask::Causal)?;
        let labels = labels.flatten_all()?.to_vec1::<i64>()?;
        // This rank's answer tokens: the labels of positions answer_start - 1 and later.
        let rows: Vec<(u32, i64)> = labels
            .iter()
            .zip(&batch.positions)
            .enumerate()
            .filter(|(_, (&l, &pos))| l != IGNORE_INDEX && pos as usize + 1 >= p.answer_start)
            .map(|(j, (&l, _))| (j as u32, l))
            .collect();
        let logits = model.logits(&batch)?;
        if !keep || rows.is_empty() {
            continue;
        }
        let idx: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let at = logits
            .index_select(&Tensor::new(idx.as_slice(), logits.device())?, 1)?
            .squeeze(0)?
            .to_dtype(DType::F64)?;
        let max = at.max_keepdim(D::Minus1)?;
        let lse = (at
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + &max)?;
        let predicted = at.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let logp = at.broadcast_sub(&lse)?.to_vec2::<f64>()?;
        for (k, &(_, l)) in rows.iter().enumerate() {
            local[3 * i] += logp[k][l as usize];
            local[3 * i + 1] += 1.0;
            local[3 * i + 2] += f64::from(u8::from(i64::from(predicted[k]) != l));
        }
    }
    let group = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
    let t = group
        .all_reduce(&Tensor::new(local, &Device::Cpu)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?;
    let retrieved: Vec<bool> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (count, wrong) = (t[3 * i + 1], t[3 * i + 2]);
            count as usize == p.tokens.len() - p.answer_start && wrong == 0.0
        })
        .collect();
    let loglik: Vec<f64> = (0..prompts.len())
        .map(|i| t[3 * i] / t[3 * i + 1].max(1.0))
        .collect();
    Ok(PasskeyReport::new(prompts, &retrieved, &loglik))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy tokenizer: one token per byte.
    fn bytes(s: &str) -> Result<Vec<u32>> {
        Ok(s.bytes().map(u32::from).collect())
    }

    #[test]
    fn prompts_have_the_length_the_needle_at_its_depth_and_the_answer_last() {
        for depth in [0.0, 0.3, 1.0] {
            let p = build_prompt(&bytes, Some(1), 400, depth, 48213).unwrap();
            assert_eq!(p.tokens.len(), 400);
            assert_eq!(p.tokens[0], 1);
            let text: String = p.tokens[1..].iter().map(|&t| t as u8 as char).collect();
            assert!(text.ends_with(" What is the pass key? The pass key is 48213"));
            assert_eq!(&text[p.answer_start - 1..], " 48213");
            let at = text.find(" The pass key is 48213.").unwrap();
            let filler = 400
                - 1
                - (text.len() - (400 - 1))
                - " The pass key is 48213. Remember it. 48213 is the pass key.".len()
                - " What is the pass key? The pass key is".len()
                - " 48213".len();
            let expected = (filler as f64 * depth).round() as usize;
            assert_eq!(at, expected, "depth {depth}");
        }
        assert!(build_prompt(&bytes, None, 50, 0.5, 12345).is_err());
        assert!(build_prompt(&bytes, None, 400, 1.5, 12345).is_err());
    }

    #[test]
    fn the_grid_is_seeded_and_scored_per_cell() {
        let a = grid(&bytes, None, &[200, 300], &[0.0, 1.0], 3, 7).unwrap();
        let b = grid(&bytes, None, &[200, 300], &[0.0, 1.0], 3, 7).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 12);
        assert!(a.iter().all(|p| (10_000..100_000).contains(&p.key)));
        let keys: std::collections::HashSet<u32> = a.iter().map(|p| p.key).collect();
        assert!(keys.len() > 6, "keys vary");
        let retrieved: Vec<bool> = (0..12).map(|i| i % 3 != 0).collect();
        let c = cells(&a, &retrieved);
        assert_eq!(
            c,
            vec![
                (200, 0.0, 2, 3),
                (200, 1.0, 2, 3),
                (300, 0.0, 2, 3),
                (300, 1.0, 2, 3)
            ]
        );
        let loglik: Vec<f64> = (0..12).map(|i| -f64::from(i)).collect();
        let r = PasskeyReport::new(&a, &retrieved, &loglik);
        assert_eq!(r.accuracy, 8.0 / 12.0);
        assert_eq!(r.cells.len(), 4);
        assert_eq!(
            (r.cells[1].length, r.cells[1].depth, r.cells[1].retrieved),
            (200, 1.0, 2)
        );
        assert_eq!(r.cells[1].accuracy, 2.0 / 3.0);
        assert_eq!(r.cells[1].answer_loglik, -4.0, "the mean of -3, -4, -5");
    }

    #[test]
    fn the_scorer_needs_every_answer_token() {
        assert!(score_answer(&[5, 6, 7], &[5, 6, 7]));
        assert!(!score_answer(&[5, 6, 8], &[5, 6, 7]));
        assert!(!score_answer(&[5, 6], &[5, 6, 7]));
        assert!(!score_answer(&[], &[]));
    }
}
