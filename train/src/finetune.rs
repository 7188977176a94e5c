//! Fine-tuning data and objectives: supervised fine-tuning (SFT) on tokenized conversations,
//! packed or one per sequence, and DPO on preference pairs.
//!
//! Labels are shifted once, here, before any sharding: the label of token `i` is token `i+1`
//! when that token is trained (an assistant token, see [`crate::chat`]), else ignored. The SFT
//! loss is the trainer's: the sum over every trained token of the global batch divided by their
//! global count ([`crate::data::Batching::global_tokens`]), so a rank whose shard holds only
//! prompt tokens contributes nothing and biases nothing (the known per-rank averaging bug of
//! sequence-parallel SFT).
//!
//! Packing (`packing = true`, LLaMA-Factory's `neat_packing`): examples are placed in order into
//! windows of `seq_len` tokens, a new window when the next example does not fit; each window is
//! trained with a document mask, so an example attends only to itself. Positions are not
//! restarted per example: with a document mask and rotary embeddings (which depend on relative
//! positions only) the result is the same as restarting them, and the tests assert packed losses
//! equal the examples run one by one. The rest of a window is padding (ignored labels, its own
//! document). Without packing every example has its own padded window.
//!
//! DPO ([`DpoLoss`], an [`Objective`]; pipelined too: the reference runs forward through the
//! same stages first): the sigmoid loss of Rafailov et al. as TRL computes it,
//! `-log σ(β((π_c - ρ_c) - (π_r - ρ_r)))`, with `π`/`ρ` the summed log-probabilities of the
//! chosen/rejected replies under the policy and the frozen reference, averaged over the global
//! batch of pairs. Each sequence's log-probability is summed over the sequence-parallel group
//! with a reduction whose backward is the identity, so every rank of the group computes the
//! same loss and backpropagates it through its own tokens only.

use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor};
use candle_parallel::collectives::reduce_from_parallel_region;
use candle_parallel::comm::ReduceOp;
use candle_parallel::nn::{Adapters, Batch, CrossEntropyOptions};
use candle_parallel::pipeline::{
    run_stage_step, PipelineSchedule, StageLoss, StageStep, StagedModel,
};
use models::causal_lm::{CausalLm, LmStages, StageMicroBatch};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::data::{Window, Windows, IGNORE};
use crate::error::{Error, Result};
use crate::objective::{Objective, StepCtx};
use crate::trainer::{StepStats, TrainConfig, Trainer};

/// A tokenized example: its ids and which tokens are trained (targets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    /// `trained[i]`: token `i` is a target (predicted from token `i-1`).
    pub trained: Vec<bool>,
}

impl Example {
    /// The next-token labels of the example: `labels[i] = ids[i+1]` when token `i+1` is trained,
    /// else [`IGNORE`]; the last label is [`IGNORE`].
    pub fn labels(&self) -> Vec<i64> {
        (0..self.ids.len())
            .map(|i| match (self.ids.get(i + 1), self.trained.get(i + 1)) {
                (Some(&t), Some(true)) => t as i64,
                _ => IGNORE,
            })
            .collect()
    }

    /// Trained tokens that have a label (every trained token but a first one).
    pub fn trained_labels(&self) -> usize {
        self.trained.iter().skip(1).filter(|&&t| t).count()
    }
}

/// What to do with an example longer than the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    /// Keep its first `seq_len` tokens.
    #[default]
    Truncate,
    /// Leave it out.
    Drop,
}

impl std::str::FromStr for Overlong {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "truncate" => Ok(Self::Truncate),
            "drop" => Ok(Self::Drop),
            _ => Err(format!("`{s}`: expected truncate or drop")),
        }
    }
}

/// How examples become windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SftOptions {
    pub seq_len: usize,
    /// Several examples per window with document masks (else one per window).
    pub packing: bool,
    pub overlong: Overlong,
    /// Token id of the padding (its labels are ignored).
    pub pad_id: u32,
}

/// What building a dataset did to the examples (logged by the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PackStats {
    pub examples: usize,
    pub windows: usize,
    /// Examples cut to the window.
    pub truncated: usize,
    /// Examples left out: too long (with [`Overlong::Drop`]) or with no trained token left.
    pub dropped: usize,
    /// Labels of trained tokens over all windows.
    pub trained_tokens: usize,
    pub padding_tokens: usize,
}

/// `ex` fitted to `seq_len` by `overlong`: `None` when left out. Counts into `stats`.
fn fit(ex: &Example, seq_len: usize, overlong: Overlong, stats: &mut PackStats) -> Option<Example> {
    let ex = if ex.ids.len() > seq_len {
        match overlong {
            Overlong::Drop => {
                stats.dropped += 1;
                return None;
            }
            Overlong::Truncate => {
                stats.truncated += 1;
                Example {
                    ids: ex.ids[..seq_len].to_vec(),
                    trained: ex.trained[..seq_len].to_vec(),
                }
            }
        }
    } else {
        ex.clone()
    };
    if ex.trained_labels() == 0 {
        stats.dropped += 1;
        return None;
    }
    Some(ex)
}

/// Builds windows from documents (examples placed in order), padding each to `seq_len`.
struct WindowBuilder {
    seq_len: usize,
    pad_id: u32,
    ids: Vec<u32>,
    labels: Vec<i64>,
    doc_ids: Vec<u32>,
    docs: u32,
    out: Vec<Window>,
}

impl WindowBuilder {
    fn new(seq_len: usize, pad_id: u32) -> Self {
        Self {
            seq_len,
            pad_id,
            ids: Vec::new(),
            labels: Vec::new(),
            doc_ids: Vec::new(),
            docs: 0,
            out: Vec::new(),
        }
    }

    fn room(&self) -> usize {
        self.seq_len - self.ids.len()
    }

    fn push(&mut self, ex: &Example) {
        self.ids.extend_from_slice(&ex.ids);
        self.labels.extend(ex.labels());
        self.doc_ids
            .extend(std::iter::repeat_n(self.docs, ex.ids.len()));
        self.docs += 1;
    }

    fn close(&mut self, stats: &mut PackStats) {
        if self.ids.is_empty() {
            return;
        }
        let pad = self.room();
        stats.padding_tokens += pad;
        self.ids.extend(std::iter::repeat_n(self.pad_id, pad));
        self.labels.extend(std::iter::repeat_n(IGNORE, pad));
        self.doc_ids.extend(std::iter::repeat_n(self.docs, pad));
        self.out.push(Window {
            ids: std::mem::take(&mut self.ids),
            labels: std::mem::take(&mut self.labels),
            doc_ids: std::mem::take(&mut self.doc_ids),
            padding: pad,
        });
        self.docs = 0;
    }
}

/// Fine-tuning examples as training windows (see the [module docs](self)); train them with a
/// document mask (`doc_mask` of the run).
#[derive(Debug, Clone)]
pub struct SftDataset {
    windows: Vec<Window>,
}

impl SftDataset {
    /// Packs `examples` (ids below `vocab_size`). Errors when no example is left.
    pub fn new(
        examples: &[Example],
        opts: &SftOptions,
        vocab_size: usize,
    ) -> Result<(Self, PackStats)> {
        if opts.seq_len < 2 {
            return Err(Error::Invalid(
                "the sequence length must be at least 2".into(),
            ));
        }
        let mut stats = PackStats {
            examples: examples.len(),
            ..Default::default()
        };
        let mut b = WindowBuilder::new(opts.seq_len, opts.pad_id);
        for (i, ex) in examples.iter().enumerate() {
            check_example(ex, i, vocab_size)?;
            let Some(ex) = fit(ex, opts.seq_len, opts.overlong, &mut stats) else {
                continue;
            };
            if !opts.packing || ex.ids.len() > b.room() {
                b.close(&mut stats);
            }
            stats.trained_tokens += ex.trained_labels();
            b.push(&ex);
        }
        b.close(&mut stats);
        stats.windows = b.out.len();
        if b.out.is_empty() {
            return Err(Error::Invalid(format!(
                "no example left to train on ({} examples: {} dropped as too long or without a \
                 trained token)",
                stats.examples, stats.dropped
            )));
        }
        Ok((Self { windows: b.out }, stats))
    }
}

impl Windows for SftDataset {
    fn num_windows(&self) -> usize {
        self.windows.len()
    }

    fn window(&self, i: usize) -> Window {
        self.windows[i].clone()
    }
}

fn check_example(ex: &Example, i: usize, vocab_size: usize) -> Result<()> {
    if ex.ids.len() != ex.trained.len() {
        return Err(Error::Invalid(format!(
            "example {i}: {} ids but {} trained flags",
            ex.ids.len(),
            ex.trained.len()
        )));
    }
    if let Some(&t) = ex.ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(Error::Invalid(format!(
            "example {i} holds token id {t}, outside the model's vocabulary of {vocab_size}"
        )));
    }
    Ok(())
}

/// Preference pairs as padded windows of `seq_len` tokens: chosen and rejected, one sequence each.
#[derive(Debug, Clone)]
pub struct PairDataset {
    chosen: Vec<Window>,
    rejected: Vec<Window>,
}

impl PairDataset {
    /// Pairs of (chosen, rejected) examples; a pair is left out (and counted) when either side
    /// is dropped.
    pub fn new(
        pairs: &[(Example, Example)],
        opts: &SftOptions,
        vocab_size: usize,
    ) -> Result<(Self, PackStats)> {
        let one = SftOptions {
            packing: false,
            ..*opts
        };
        let mut stats = PackStats {
            examples: pairs.len(),
            ..Default::default()
        };
        let (mut chosen, mut rejected) = (Vec::new(), Vec::new());
        for (i, (c, r)) in pairs.iter().enumerate() {
            check_example(c, i, vocab_size)?;
            check_example(r, i, vocab_size)?;
            let mut s = PackStats::default();
            let (Some(c), Some(r)) = (
                fit(c, one.seq_len, one.overlong, &mut s),
                fit(r, one.seq_len, one.overlong, &mut s),
            ) else {
                stats.dropped += 1;
                continue;
            };
            stats.truncated += s.truncated.min(1);
            let (cw, _) = SftDataset::new(&[c], &one, vocab_size)?;
            let (rw, _) = SftDataset::new(&[r], &one, vocab_size)?;
            chosen.push(cw.window(0));
            rejected.push(rw.window(0));
        }
        stats.windows = chosen.len();
        if chosen.is_empty() {
            return Err(Error::Invalid(format!(
                "no preference pair left to train on ({} pairs: {} dropped)",
                stats.examples, stats.dropped
            )));
        }
        Ok((Self { chosen, rejected }, stats))
    }

    pub fn len(&self) -> usize {
        self.chosen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chosen.is_empty()
    }

    /// Pair `i`: (chosen, rejected).
    pub fn pair(&self, i: usize) -> (&Window, &Window) {
        (&self.chosen[i], &self.rejected[i])
    }
}

/// DPO settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DpoConfig {
    /// β, the strength of the KL penalty toward the reference (TRL's default 0.1).
    pub beta: f64,
}

/// The frozen reference of DPO.
pub enum Reference {
    /// The policy's base model: the policy with its LoRA adapters switched off.
    BaseOfAdapters(Arc<Adapters>),
    /// A separate frozen model (full fine-tuning: the starting checkpoint).
    Model(Box<dyn CausalLm>),
}

/// What one DPO step reports (means over the global batch of pairs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DpoStats {
    #[serde(flatten)]
    pub stats: StepStats,
    /// `β (π_c - ρ_c)`.
    pub chosen_reward: f64,
    /// `β (π_r - ρ_r)`.
    pub rejected_reward: f64,
    /// chosen - rejected reward.
    pub margin: f64,
    /// Fraction of pairs whose chosen reward is above the rejected one.
    pub accuracy: f64,
    /// A mixture of experts' routing of the policy's forwards, means over the pairs
    /// ([`crate::objective::ROUTER_PARTS`] and each sparse layer's load); empty for a dense
    /// model.
    #[serde(skip)]
    pub routing: Vec<(String, f64)>,
}

/// Per-pair DPO quantities of a micro-batch on this rank (every rank of the sequence group
/// holds the same values).
#[derive(Debug, Clone)]
pub struct DpoTerms {
    /// Summed over the micro-batch's pairs, differentiable through the policy.
    pub loss_sum: Tensor,
    pub chosen_rewards: Vec<f64>,
    pub rejected_rewards: Vec<f64>,
    pub losses: Vec<f64>,
    /// Policy and reference log-probabilities: chosen then rejected, `(2 · pairs,)`.
    pub policy_logps: Vec<f64>,
    pub reference_logps: Vec<f64>,
}

/// One DPO micro-batch: the chosen then the rejected windows of its pairs as this rank's
/// shard, with the reference's log-probabilities of every sequence.
pub struct DpoMicroBatch {
    pub batch: Batch,
    pub labels: Tensor,
    /// Pairs in the micro-batch (the batch has twice as many sequences).
    pub pairs: usize,
    /// The reference's summed log-probabilities, chosen then rejected, `(2 · pairs,)` f64,
    /// whole over the sequence group.
    pub reference_logps: Tensor,
}

/// The DPO objective (see the [module docs](self)) with its frozen reference: the mean over
/// the global batch of pairs; parts: the summed chosen and rejected rewards and the pairs
/// ranked right.
pub struct DpoLoss {
    pub cfg: DpoConfig,
    pub reference: Reference,
    pub opts: CrossEntropyOptions,
    /// A mixture of experts' sparse layers: the loss also reports the policy's routing
    /// ([`crate::objective::ROUTER_PARTS`] and each layer's load). `None` for a dense model.
    pub router_layers: Option<Vec<usize>>,
}

impl DpoLoss {
    /// Errors on an impossible β.
    pub fn new(cfg: DpoConfig, reference: Reference, tcfg: &TrainConfig) -> Result<Self> {
        if !(cfg.beta.is_finite() && cfg.beta > 0.0) {
            return Err(Error::Invalid(format!(
                "the DPO beta {} must be a positive number",
                cfg.beta
            )));
        }
        Ok(Self {
            cfg,
            reference,
            opts: CrossEntropyOptions {
                chunk_tokens: tcfg.loss_chunk_tokens,
                ..Default::default()
            },
            router_layers: None,
        })
    }

    /// Data-parallel rank `s.dp_rank`'s micro-batches of pair indices for `step`.
    pub fn micro_pairs(&self, s: &StepCtx<'_>, data: &PairDataset, step: u64) -> Vec<Vec<usize>> {
        let sampler = s.batching.sampler(data.len());
        s.batching
            .micro_samples(&sampler, step, s.dp_rank)
            .into_iter()
            .map(|m| m.into_iter().map(|k| sampler.window_of(k)).collect())
            .collect()
    }

    /// The reference's per-sequence log-probabilities of a batch on the whole model (no
    /// pipeline), whole over the sequence group. Collective over the world.
    fn reference_logps(
        &self,
        model: &dyn CausalLm,
        batch: &Batch,
        labels: &Tensor,
    ) -> Result<Tensor> {
        let sums = match &self.reference {
            Reference::BaseOfAdapters(a) => {
                a.set_enabled(false);
                let r = model.sequence_loss_sums(batch, labels, &self.opts);
                a.set_enabled(true);
                r?
            }
            Reference::Model(m) => m.sequence_loss_sums(batch, labels, &self.opts)?,
        };
        whole_sequences(sums.detach().neg()?, model.ctx(), false)
    }

    /// The reference's per-sequence log-probabilities of every micro-batch through the
    /// pipeline stages (forward only). Collective over the world.
    fn pipelined_reference_logps(
        &self,
        s: &StepCtx<'_>,
        model: &dyn CausalLm,
        micro: &[StageMicroBatch],
        pc: &crate::trainer::PipelineConfig,
    ) -> Result<Vec<Tensor>> {
        let schedule = PipelineSchedule::forward_only(s.pp.size(), micro.len(), pc.virtual_stages)?;
        let ranges = pc.ranges();
        let step = StageStep {
            schedule: &schedule,
            layers: &ranges,
            pp: s.pp,
            global_count: 1,
            dtype: s.dtype,
        };
        // Each micro-batch's sequences at their offset among every micro-batch's.
        let mut rows = 0;
        let placed = micro
            .iter()
            .map(|m| {
                let at = rows;
                rows += m.labels.dim(0)?;
                Ok(PlacedMicroBatch { at, m })
            })
            .collect::<Result<Vec<_>>>()?;
        let run = |m: &dyn CausalLm| -> Result<Vec<f64>> {
            let staged = SequenceLogps {
                model: m,
                opts: self.opts,
                rows,
            };
            Ok(run_stage_step(&staged, &step, &placed, Vec::new(), rows)?.parts)
        };
        let all = match &self.reference {
            Reference::BaseOfAdapters(a) => {
                a.set_enabled(false);
                let r = run(model);
                a.set_enabled(true);
                r?
            }
            Reference::Model(m) => run(m)?,
        };
        let mut at = 0;
        micro
            .iter()
            .map(|m| {
                let n = m.labels.dim(0)?;
                let t = Tensor::new(&all[at..at + n], &candle_core::Device::Cpu)?;
                at += n;
                Ok(t.to_device(model.ctx().device())?)
            })
            .collect()
    }

    /// For a mixture of experts: the micro-batch's DPO loss `l` (which every rank holding its
    /// tokens computes whole) plus `coef · aux · pairs`, the routers' load-balancing loss of the
    /// policy's forward over the chosen and rejected sequences (padding left out), as TRL's DPO
    /// adds `router_aux_loss_coef` times the policy's `aux_loss` to the mean loss when the config
    /// sets `output_router_logits` (the coefficient is 0 otherwise: nothing is added); the
    /// routing parts ([`DpoLoss::router_layers`]) weighted by the pairs. `staged`: on a
    /// pipeline's last stage, with the other stages' statistics carried here. Collective over
    /// the ranks holding the micro-batch's tokens.
    fn with_balancing_loss(
        &self,
        model: &dyn CausalLm,
        mut l: StageLoss,
        pairs: usize,
        staged: bool,
    ) -> Result<StageLoss> {
        let Some((aux, coef)) = model.routers() else {
            return Ok(l);
        };
        let ctx = model.ctx();
        let stats = if staged {
            aux.finish_stage(ctx, pairs)?
        } else {
            aux.finish_in(ctx, pairs, l.sum.device())?
        };
        if coef != 0.0 {
            l.sum = aux.add_to_whole_loss(&l.sum, pairs, coef)?;
        }
        if staged {
            aux.park();
        }
        if let Some(layers) = &self.router_layers {
            l.parts
                .extend(models::causal_lm::router_parts(&stats, pairs, layers)?);
        }
        Ok(l)
    }

    /// The DPO terms of a micro-batch from the policy's per-sequence log-probabilities (whole
    /// over the sequence group, differentiable).
    fn terms_of(&self, policy: &Tensor, m: &DpoMicroBatch) -> Result<DpoTerms> {
        dpo_terms(policy, &m.reference_logps, m.pairs, self.cfg.beta)
    }
}

/// The loss of a micro-batch's DPO terms and its parts: summed chosen and rejected rewards
/// and the pairs ranked right.
fn dpo_loss(t: DpoTerms) -> StageLoss {
    let (mut rc, mut rr, mut right) = (0f64, 0f64, 0f64);
    for (c, r) in t.chosen_rewards.iter().zip(&t.rejected_rewards) {
        rc += c;
        rr += r;
        right += f64::from(u8::from(c > r));
    }
    StageLoss {
        sum: t.loss_sum,
        parts: vec![rc, rr, right],
    }
}

/// `local` per-sequence values summed over the sequence group in f64: with a backward that is
/// the identity (`grad`), or plainly. Collective over the sequence group.
fn whole_sequences(
    local: Tensor,
    ctx: &candle_parallel::nn::ParallelCtx,
    grad: bool,
) -> Result<Tensor> {
    let group = ctx.sequence_group();
    let local = local.to_dtype(DType::F64)?;
    Ok(match (group.size() > 1, grad) {
        (false, _) => local,
        (true, true) => reduce_from_parallel_region(&local, group)?,
        (true, false) => group.all_reduce(&local, ReduceOp::Sum)?,
    })
}

/// The DPO terms of `n` pairs from the policy's and the reference's per-sequence
/// log-probabilities (chosen then rejected, `(2n,)` f64).
fn dpo_terms(policy: &Tensor, reference: &Tensor, n: usize, beta: f64) -> Result<DpoTerms> {
    let (pc, pr) = (policy.narrow(0, 0, n)?, policy.narrow(0, n, n)?);
    let (rc, rr) = (reference.narrow(0, 0, n)?, reference.narrow(0, n, n)?);
    let chosen = ((pc - &rc)? * beta)?;
    let rejected = ((pr - &rr)? * beta)?;
    let z = (&chosen - &rejected)?;
    let losses = log_sigmoid(&z)?.neg()?;
    let (chosen, rejected) = (chosen.detach(), rejected.detach());
    Ok(DpoTerms {
        loss_sum: losses.sum_all()?,
        chosen_rewards: chosen.to_vec1()?,
        rejected_rewards: rejected.to_vec1()?,
        losses: losses.detach().to_vec1()?,
        policy_logps: policy.detach().to_vec1()?,
        reference_logps: reference.to_vec1()?,
    })
}

/// The chosen then rejected windows of `pairs` as this rank's shard of one batch.
fn pair_batch(
    ctx: &candle_parallel::nn::ParallelCtx,
    data: &PairDataset,
    pairs: &[usize],
) -> Result<(Batch, Tensor)> {
    let (mut ids, mut labels, mut padding) = (Vec::new(), Vec::new(), Vec::new());
    for side in 0..2 {
        for &i in pairs {
            let (c, r) = data.pair(i);
            let w = if side == 0 { c } else { r };
            ids.push(w.ids.clone());
            labels.push(w.labels.clone());
            padding.push(w.padding);
        }
    }
    // Padding sits at the end of each window: a causal mask keeps it out of the replies.
    let mask = candle_parallel::attention::AttnMask::Causal;
    Ok(Batch::from_padded_tokens(
        ctx, &ids, &labels, mask, &padding,
    )?)
}

/// The per-sequence log-probabilities of the last layer's output `x`, whole over the sequence
/// group (differentiable with `grad`).
fn sequence_logps(
    model: &dyn CausalLm,
    x: &Tensor,
    labels: &Tensor,
    opts: &CrossEntropyOptions,
    grad: bool,
) -> Result<Tensor> {
    let sums = (0..x.dim(0)?)
        .map(|i| {
            let (s, _) =
                model.norm_head_loss(&x.narrow(0, i, 1)?, &labels.narrow(0, i, 1)?, opts)?;
            Ok(s.reshape(1)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let sums = Tensor::cat(&sums, 0)?;
    let sums = if grad { sums } else { sums.detach() };
    whole_sequences(sums.neg()?, model.ctx(), grad)
}

/// A micro-batch and the offset of its first sequence among the step's.
struct PlacedMicroBatch<'a> {
    at: usize,
    m: &'a StageMicroBatch,
}

/// A causal LM as pipeline stages whose last stage reports every sequence's summed
/// log-probability as the loss parts (the DPO reference, forward only): `rows` parts, each
/// micro-batch's at its offset (the parts of micro-batches add up, so the others are 0).
struct SequenceLogps<'a> {
    model: &'a dyn CausalLm,
    opts: CrossEntropyOptions,
    rows: usize,
}

impl<'a> StagedModel for SequenceLogps<'a> {
    type Micro = PlacedMicroBatch<'a>;

    fn activation_shape(&self, p: &PlacedMicroBatch<'a>) -> candle_parallel::Result<Shape> {
        LmStages {
            model: self.model,
            opts: self.opts,
            balancing_loss: false,
        }
        .activation_shape(p.m)
    }

    fn embed(&self, p: &PlacedMicroBatch<'a>) -> candle_parallel::Result<Tensor> {
        Ok(self.model.embed_tokens(&p.m.batch)?)
    }

    fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        p: &PlacedMicroBatch<'a>,
    ) -> candle_parallel::Result<Tensor> {
        Ok(CausalLm::run_layers(self.model, layers, x, &p.m.batch)?)
    }

    fn head_loss(
        &self,
        x: &Tensor,
        p: &PlacedMicroBatch<'a>,
    ) -> candle_parallel::Result<StageLoss> {
        let logps = sequence_logps(self.model, x, &p.m.labels, &self.opts, false)
            .map_err(|e| candle_parallel::Error::Candle(candle_core::Error::wrap(e)))?
            .to_vec1::<f64>()?;
        let mut parts = vec![0.0; self.rows];
        parts[p.at..p.at + logps.len()].copy_from_slice(&logps);
        Ok(StageLoss {
            sum: Tensor::zeros((), DType::F32, x.device())?,
            parts,
        })
    }

    fn backward(&self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        Ok(CausalLm::backward(self.model, root)?)
    }

    fn shared_params(&self) -> Vec<String> {
        CausalLm::end_params(self.model)
    }
}

/// The policy with the DPO loss as pipeline stages.
pub struct DpoStages<'a> {
    model: &'a dyn CausalLm,
    loss: &'a DpoLoss,
}

impl StagedModel for DpoStages<'_> {
    type Micro = DpoMicroBatch;

    fn activation_shape(&self, m: &DpoMicroBatch) -> candle_parallel::Result<Shape> {
        let micro = StageMicroBatch {
            batch: m.batch.clone(),
            labels: m.labels.clone(),
        };
        LmStages {
            model: self.model,
            opts: self.loss.opts,
            balancing_loss: false,
        }
        .activation_shape(&micro)
    }

    fn embed(&self, m: &DpoMicroBatch) -> candle_parallel::Result<Tensor> {
        Ok(self.model.embed_tokens(&m.batch)?)
    }

    fn run_layers(
        &self,
        layers: std::ops::Range<usize>,
        x: &Tensor,
        m: &DpoMicroBatch,
    ) -> candle_parallel::Result<Tensor> {
        Ok(CausalLm::run_layers(self.model, layers, x, &m.batch)?)
    }

    /// The DPO loss, plus a mixture of experts' balancing loss of every stage's routers (their
    /// statistics carried here, see [`with_balancing_loss`]).
    fn head_loss(&self, x: &Tensor, m: &DpoMicroBatch) -> candle_parallel::Result<StageLoss> {
        let wrap = |e: Error| candle_parallel::Error::Candle(candle_core::Error::wrap(e));
        let policy =
            sequence_logps(self.model, x, &m.labels, &self.loss.opts, true).map_err(wrap)?;
        let l = dpo_loss(self.loss.terms_of(&policy, m).map_err(wrap)?);
        self.loss
            .with_balancing_loss(self.model, l, m.pairs, true)
            .map_err(wrap)
    }

    fn backward(&self, root: &Tensor) -> candle_parallel::Result<GradStore> {
        Ok(CausalLm::backward(self.model, root)?)
    }

    fn shared_params(&self) -> Vec<String> {
        CausalLm::end_params(self.model)
    }

    // A mixture of experts' routing statistics travel between the stages as under the
    // next-token loss.
    fn carry_lens(&self) -> (usize, usize) {
        self.lm().carry_lens()
    }

    fn begin_forward(
        &self,
        micro_batch: usize,
        carried: Option<&[f64]>,
    ) -> candle_parallel::Result<()> {
        self.lm().begin_forward(micro_batch, carried)
    }

    fn forward_carry(&self, micro_batch: usize) -> candle_parallel::Result<Vec<f64>> {
        self.lm().forward_carry(micro_batch)
    }

    fn begin_backward(
        &self,
        micro_batch: usize,
        carried: Option<&[f64]>,
    ) -> candle_parallel::Result<()> {
        self.lm().begin_backward(micro_batch, carried)
    }

    fn backward_carry(&self, micro_batch: usize) -> candle_parallel::Result<Vec<f64>> {
        self.lm().backward_carry(micro_batch)
    }
}

impl DpoStages<'_> {
    /// The policy as next-token stages: their routing-statistics protocol.
    fn lm(&self) -> LmStages<'_, dyn CausalLm + '_> {
        LmStages {
            model: self.model,
            opts: self.loss.opts,
            balancing_loss: true,
        }
    }
}

impl Objective<Box<dyn CausalLm>> for DpoLoss {
    type Data = PairDataset;
    type Micro = DpoMicroBatch;
    type Staged<'a> = DpoStages<'a>;

    fn part_names(&self) -> Vec<String> {
        let mut names = ["chosen_reward", "rejected_reward", "accuracy"]
            .map(String::from)
            .to_vec();
        if let Some(layers) = &self.router_layers {
            names.extend(crate::objective::ROUTER_PARTS.iter().map(|s| s.to_string()));
            names.extend(
                layers
                    .iter()
                    .map(|l| format!("{}{l}", crate::objective::ROUTER_LAYER_LOAD)),
            );
        }
        names
    }

    fn whole_sequence_loss(&self) -> bool {
        true
    }

    fn global_count(&self, s: &StepCtx<'_>, data: &PairDataset, _step: u64) -> Result<u64> {
        if data.is_empty() {
            return Err(Error::Invalid("the preference dataset is empty".into()));
        }
        Ok(s.batching.global_batch() as u64)
    }

    /// Collective over the world: the reference's log-probabilities are computed here.
    fn micro_batches(
        &self,
        s: &StepCtx<'_>,
        model: &Box<dyn CausalLm>,
        data: &PairDataset,
        step: u64,
    ) -> Result<Vec<DpoMicroBatch>> {
        let pairs = self.micro_pairs(s, data, step);
        let batches = pairs
            .iter()
            .map(|p| {
                let (batch, labels) = pair_batch(s.ctx, data, p)?;
                Ok(StageMicroBatch { batch, labels })
            })
            .collect::<Result<Vec<_>>>()?;
        let reference = match &s.cfg.pipeline {
            Some(pc) => self.pipelined_reference_logps(s, model, &batches, pc)?,
            None => batches
                .iter()
                .map(|b| self.reference_logps(model, &b.batch, &b.labels))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(batches
            .into_iter()
            .zip(reference)
            .zip(&pairs)
            .map(|((b, r), p)| DpoMicroBatch {
                batch: b.batch,
                labels: b.labels,
                pairs: p.len(),
                reference_logps: r,
            })
            .collect())
    }

    fn loss(&self, model: &Box<dyn CausalLm>, m: &DpoMicroBatch) -> Result<StageLoss> {
        let policy = whole_sequences(
            model
                .sequence_loss_sums(&m.batch, &m.labels, &self.opts)?
                .neg()?,
            model.ctx(),
            true,
        )?;
        let l = dpo_loss(self.terms_of(&policy, m)?);
        self.with_balancing_loss(model.as_ref(), l, m.pairs, false)
    }

    fn staged<'a>(&'a self, model: &'a Box<dyn CausalLm>) -> Result<DpoStages<'a>> {
        Ok(DpoStages {
            model: model.as_ref(),
            loss: self,
        })
    }
}

/// A trainer of the DPO objective (see the [module docs](self)).
pub struct DpoTrainer {
    pub trainer: Trainer<Box<dyn CausalLm>>,
    pub loss: DpoLoss,
}

impl DpoTrainer {
    pub fn new(
        trainer: Trainer<Box<dyn CausalLm>>,
        reference: Reference,
        cfg: DpoConfig,
    ) -> Result<Self> {
        let mut loss = DpoLoss::new(cfg, reference, &trainer.cfg)?;
        let model = &trainer.model;
        loss.router_layers = model.has_routers().then(|| model.router_layers());
        Ok(Self { trainer, loss })
    }

    /// Pairs per optimizer step over all data-parallel ranks.
    pub fn global_batch(&self) -> usize {
        self.trainer.global_batch()
    }

    /// This rank's micro-batches of pair indices for `step`.
    pub fn micro_pairs(&self, data: &PairDataset, step: u64) -> Vec<Vec<usize>> {
        self.loss.micro_pairs(&self.trainer.step_ctx(), data, step)
    }

    /// The DPO terms of pairs `pairs` of `data` on the whole model (no pipeline). Collective
    /// over the world.
    pub fn terms(&self, data: &PairDataset, pairs: &[usize]) -> Result<DpoTerms> {
        let model = &self.trainer.model;
        let (batch, labels) = pair_batch(self.trainer.ctx(), data, pairs)?;
        let reference_logps = self.loss.reference_logps(model, &batch, &labels)?;
        let m = DpoMicroBatch {
            batch,
            labels,
            pairs: pairs.len(),
            reference_logps,
        };
        let policy = whole_sequences(
            model
                .sequence_loss_sums(&m.batch, &m.labels, &self.loss.opts)?
                .neg()?,
            model.ctx(),
            true,
        )?;
        self.loss.terms_of(&policy, &m)
    }

    /// Runs optimizer step `self.trainer.step` on `data` and advances ([`Trainer::run_step`]
    /// with [`DpoLoss`]). Collective over the world.
    pub fn step(&mut self, data: &PairDataset) -> Result<DpoStats> {
        let r = self.trainer.run_step(&self.loss, data)?;
        // The parts as run_step reports them: means over the global batch of pairs.
        let (rc, rr, right) = (r.parts[0], r.parts[1], r.parts[2]);
        let names = <DpoLoss as Objective<Box<dyn CausalLm>>>::part_names(&self.loss);
        Ok(DpoStats {
            stats: r.stats,
            chosen_reward: rc,
            rejected_reward: rr,
            margin: rc - rr,
            accuracy: right,
            routing: names.into_iter().zip(r.parts).skip(3).collect(),
        })
    }
}

/// `log σ(z)` without overflow, as `m - log(1 + exp(2m - z))` with `m = min(z, 0)` (the
/// exponent is `-|z|`). Written so that its gradient is `1 - σ(z)` everywhere, also at `z = 0`,
/// where candle's backward of `minimum` gives each side half (the first DPO step of a fresh
/// adapter, or of full fine-tuning, has `z = 0` exactly: `min(z, 0) - log(1 + exp(-|z|))`
/// would double its gradient there).
pub fn log_sigmoid(z: &Tensor) -> Result<Tensor> {
    let m = z.minimum(&z.zeros_like()?)?;
    let e = ((&m * 2.0)? - z)?.exp()?;
    Ok((m - (e + 1.0)?.log()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Windows say how many of their last tokens are padding (what a mixture of experts' routing
    /// statistics leave out), packed or not, and DPO's pairs too.
    #[test]
    fn windows_count_their_trailing_padding() {
        let ex = |n: usize| Example {
            ids: (1..=n as u32).collect(),
            trained: vec![true; n],
        };
        let opts = |packing| SftOptions {
            seq_len: 16,
            packing,
            overlong: Overlong::Truncate,
            pad_id: 0,
        };
        let (packed, _) = SftDataset::new(&[ex(5), ex(7)], &opts(true), 64).unwrap();
        assert_eq!(packed.num_windows(), 1);
        let w = packed.window(0);
        assert_eq!(w.padding, 4);
        assert!(w.ids[12..].iter().all(|&t| t == 0) && w.ids[11] != 0);
        let (one_each, stats) = SftDataset::new(&[ex(5), ex(7)], &opts(false), 64).unwrap();
        let pads: Vec<usize> = (0..one_each.num_windows())
            .map(|i| one_each.window(i).padding)
            .collect();
        assert_eq!(pads, [11, 9]);
        assert_eq!(stats.padding_tokens, 20);
        let (pairs, _) = PairDataset::new(&[(ex(3), ex(16))], &opts(true), 64).unwrap();
        let (c, r) = pairs.pair(0);
        assert_eq!((c.padding, r.padding), (13, 0));
    }

    /// Values and gradients of `log σ` against the closed forms, at 0 and far out.
    #[test]
    fn log_sigmoid_and_its_gradient() {
        let zs = [0.0f64, 3.0, -3.0, 60.0, -60.0, 1e-8];
        let z = Var::new(&zs[..], &Device::Cpu).unwrap();
        let y = log_sigmoid(z.as_tensor()).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        let got = y.to_vec1::<f64>().unwrap();
        let grad = g.get(z.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        for (i, &x) in zs.iter().enumerate() {
            let sig = 1.0 / (1.0 + (-x).exp());
            let want = if x < -30.0 { x } else { sig.ln() };
            assert!(
                (got[i] - want).abs() <= 1e-12 * want.abs().max(1.0),
                "log σ({x})"
            );
            assert!(
                (grad[i] - (1.0 - sig)).abs() <= 1e-12,
                "d log σ({x}) = {}",
                grad[i]
            );
        }
    }
}
