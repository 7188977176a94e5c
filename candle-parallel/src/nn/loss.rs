//! Vocab-parallel, chunked cross-entropy fused with the LM head.
//!
//! Long-context training cannot materialise the `(tokens × vocab)` logits. This loss computes
//! `hidden @ weight^T` one chunk of tokens at a time against this rank's vocabulary shard, keeps
//! only the per-token log-sum-exp (`N` floats) for the backward, and recomputes each chunk's
//! logits in the backward. With [`CrossEntropyOptions::eager_gradients`] (training steps, whose
//! backward always follows) it instead takes each chunk's gradients right after its logits in
//! the forward, as Liger-Kernel's fused linear cross-entropy does, and the backward only scales
//! them by the loss's gradient: one `N × V/P × H` product fewer per step (the head's logits are
//! computed once, not twice), for `d_hidden` and `d_weight` held from forward to backward
//! instead of being formed there.
//!
//! Per chunk of `c` tokens, forward: local logits `(c, V/P)` in f32, an all-reduce (max) of the
//! row maxima, then one all-reduce (sum) of the row sums of `exp(logit - max)` together with the
//! target logits (each target lives on exactly one rank; the others contribute 0). Backward:
//! `dlogits = g · (softmax - onehot)` (zero rows for ignored labels), `d_weight += dlogitsᵀ @ h`,
//! `d_hidden = dlogits @ weight`, and finally one all-reduce (sum) of `d_hidden` over the group
//! (every rank's shard contributes to every token's hidden gradient).
//!
//! # Precision
//! The logits are f32 sums of the products of the hidden states and weight as stored. When both
//! are bf16 on a CPU with bf16 dot products (`flash_ring::bf16_dot_products`), the products run
//! on them without widening (exact products, f32 sums: the same logits up to summation order),
//! and `dlogits` is rounded to bf16 for the two backward products, as a bf16 head is in
//! PyTorch. Otherwise everything is f32. On the CPU the row softmax is one pass per row with
//! flash-ring's vector exponential (`ops::softmax_rows`).
//!
//! # Memory
//! With `c = chunk_tokens`, `S = V/P` and `H` the hidden size, the logit-sized temporaries are
//! one `(c, S)` f32 tensor on the CPU (the backward forms `dlogits` over the recomputed logits;
//! a bf16 `dlogits` is a second, half-size buffer) and at most two on other devices, never
//! `(N, S)`. Besides:
//! - an f32 copy of the weight shard (`S × H`) while forward or backward runs, only when the
//!   weight is neither f32 nor used as bf16 (an f32 weight is used as is);
//! - the per-token lse, `N` f32, kept from forward to backward (with the labels' `N`-sized masks);
//! - in backward, the gradients themselves: `d_weight` (`S × H` f32, accumulated in place on CPU,
//!   plus one chunk's `S × H` contribution at a time; out of place on other devices) and
//!   `d_hidden` (`N × H` f32, then its all-reduced copy), converted to the inputs' dtypes.
//!   In eager mode the same gradients are formed in the forward and kept until the backward,
//!   which scales them (a second `N × H` and `S × H` while it does).
//!
//! # Devices
//! The loss node is device-generic: its forward and backward are candle tensor ops (and the
//! communicator's collectives) on the inputs' device, and the node hands over its precomputed
//! result on CPU, CUDA and Metal storages alike. Nothing is copied to the CPU but the labels
//! (read once, to validate them). [`vocab_parallel_cross_entropy_composite`] computes the same
//! loss with candle's autograd and differentiable collectives instead of the node: a reference
//! for tests, which keeps every chunk's logits alive until backward.

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, DType, Device, InplaceOp2, Layout, MetalStorage, Shape,
    Storage, Tensor,
};

use super::embedding::load_vocab_rows;
use super::{EmbeddingConfig, ParallelCtx, ParamBuilder, TpGroup, VocabParallelEmbedding};
use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};

const OP: &str = "vocab_parallel_cross_entropy";

/// Label value that is skipped (PyTorch / Hugging Face convention).
pub const IGNORE_INDEX: i64 = -100;

/// Options of [`vocab_parallel_cross_entropy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyOptions {
    /// Tokens per chunk: at most `chunk_tokens × V/P` logits exist at a time. Default 1024.
    pub chunk_tokens: usize,
    /// Labels equal to this value are skipped. Default [`IGNORE_INDEX`].
    pub ignore_index: i64,
    /// Final-logit soft-capping (Gemma 2's `final_logit_softcapping`): the loss is taken of
    /// `c · tanh(logit / c)`, and the logits' gradient gets the factor `1 - tanh²`. Default
    /// none; an [`LmHead`] with a cap sets it.
    pub softcap: Option<f32>,
    /// Compute the gradients in the forward (see the [module docs](self)) when `hidden` or
    /// `weight` tracks gradients. For training steps, whose backward follows every forward; an
    /// evaluation of a trainable model would pay two products for nothing. Default false.
    pub eager_gradients: bool,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        Self {
            chunk_tokens: 1024,
            ignore_index: IGNORE_INDEX,
            softcap: None,
            eager_gradients: false,
        }
    }
}

/// `c · tanh(x / c)` (soft-capping of logits), or `x` without a cap.
pub fn soft_cap(x: &Tensor, cap: Option<f32>) -> Result<Tensor> {
    Ok(match cap {
        None => x.clone(),
        Some(c) => ((x / c as f64)?.tanh()? * c as f64)?,
    })
}

/// Sum of token cross-entropies of `hidden @ weight^T` against `labels`, with the vocabulary
/// split over `comm`.
///
/// - `hidden`: `(N, H)` this rank's tokens (f32/bf16/f16), identical on every rank of `comm`;
/// - `weight`: this rank's vocabulary shard `(V/P, H)` of the LM head (rank `r` holds rows
///   `[r·V/P, (r+1)·V/P)`);
/// - `labels`: `(N,)` i64 (u32/u8 accepted too), values in `[0, V)` or `opts.ignore_index`.
///
/// Returns `(loss_sum, count)`: `loss_sum` is an f32 scalar, differentiable with respect to
/// `hidden` and `weight` and equal on every rank; `count` is the number of non-ignored labels.
/// The caller divides by the (global) count. Arithmetic is in f32; gradients come back in the
/// dtypes of `hidden` and `weight`.
///
/// Collective: every rank of `comm` calls it with the same `hidden` and `labels`. Forward issues
/// two all-reduces per chunk; backward one all-reduce of `d_hidden`. With one rank there is no
/// communication. Invalid shapes, dtypes or labels are reported before any communication. When
/// neither `hidden` nor `weight` tracks gradients, no node is recorded (this must then hold on
/// every rank). If only `weight` tracks, `d_hidden` is still computed and all-reduced, so that
/// every rank issues the same collectives.
pub fn vocab_parallel_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    comm: &Comm,
    opts: &CrossEntropyOptions,
) -> Result<(Tensor, usize)> {
    let plan = Plan::new(hidden, weight, labels, comm, opts)?;
    let count = plan.count;
    let tracks = hidden.track_op() || weight.track_op();
    let eager = (tracks && opts.eager_gradients).then(|| weight.track_op());
    let (loss, lse, grads) = plan.forward(hidden, weight, eager)?;
    if !tracks {
        return Ok((loss, count));
    }
    let out = crate::collectives::owned_copy(&loss)?.0;
    drop(loss);
    let node = hidden.apply_op2(
        weight,
        ChunkedCrossEntropy {
            plan,
            lse,
            out: Mutex::new(Some(out)),
            grads: Mutex::new(grads),
        },
    )?;
    Ok((node, count))
}

/// [`vocab_parallel_cross_entropy`] built from differentiable candle ops and the differentiable
/// collectives of [`crate::collectives`], on any device: the same validation and errors, the same
/// chunks and f32 arithmetic, the same collectives in forward (per chunk an all-reduce (max) of
/// the row maxima and one all-reduce (sum) of the row sums of `exp(logit - max)` with the target
/// logits) and one all-reduce (sum) of `d_hidden` in backward (when `hidden` tracks gradients).
///
/// A reference for tests (public for them, hidden from the docs): candle's autograd keeps every
/// chunk's `(c, V/P)` logits and exponentials until backward, `O(N · V/P)` memory, which the
/// fused loss avoids. Collective, with the same rules as [`vocab_parallel_cross_entropy`].
#[doc(hidden)]
pub fn vocab_parallel_cross_entropy_composite(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    comm: &Comm,
    opts: &CrossEntropyOptions,
) -> Result<(Tensor, usize)> {
    let plan = Plan::new(hidden, weight, labels, comm, opts)?;
    let parallel = comm.size() > 1;
    // Identity in forward, all-reduce (sum) of the f32 gradient in backward: every rank's shard
    // contributes to every token's hidden gradient.
    let h32 = hidden.to_dtype(DType::F32)?;
    let h32 = if parallel {
        crate::collectives::copy_to_parallel_region(&h32, comm)?
    } else {
        h32
    };
    let w32 = weight.to_dtype(DType::F32)?;
    let mut loss = Tensor::zeros((), DType::F32, hidden.device())?;
    for (s, c) in plan.chunks() {
        let logits = soft_cap(&h32.narrow(0, s, c)?.matmul(&w32.t()?)?, plan.softcap)?;
        let here = plan.here.narrow(0, s, c)?;
        let idx = plan.local_idx.narrow(0, s, c)?;
        let target = (logits.gather(&idx, 1)? * &here)?;
        // A constant shift (log-sum-exp does not depend on it): no gradient through the max.
        let max = plan.all_reduce(&logits.detach().max_keepdim(1)?, ReduceOp::Max)?;
        let sum_exp = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?;
        let both = Tensor::cat(&[&sum_exp, &target], 1)?;
        // All-reduce (sum) in forward, identity in backward: the loss is replicated.
        let both = if parallel {
            crate::collectives::reduce_from_parallel_region(&both, comm)?
        } else {
            both
        };
        let lse = (max + both.narrow(1, 0, 1)?.log()?)?;
        let valid = plan.valid.narrow(0, s, c)?;
        let chunk_loss = ((lse - both.narrow(1, 1, 1)?)? * valid)?.sum_all()?;
        loss = (loss + chunk_loss)?;
    }
    Ok((loss, plan.count))
}

/// The output projection of a language model, `(V, H)` split by vocabulary rows over the
/// tensor-parallel group, with the fused chunked loss: the full-vocabulary logits of long
/// sequences are never formed.
#[derive(Debug, Clone)]
pub struct LmHead {
    /// This rank's rows `(V/P, H)`.
    weight: Tensor,
    tp: TpGroup,
    /// Final-logit soft-capping (see [`CrossEntropyOptions::softcap`]).
    softcap: Option<f32>,
}

impl LmHead {
    /// Loads this rank's rows of `vb`'s `weight` (`lm_head.weight`).
    pub fn new(cfg: &EmbeddingConfig, vb: ParamBuilder, ctx: &ParallelCtx) -> Result<Self> {
        Ok(Self {
            weight: load_vocab_rows(cfg, &vb, ctx)?,
            tp: ctx.tp().clone(),
            softcap: None,
        })
    }

    /// The same head with its logits soft-capped at `cap` (`c · tanh(logit / c)`; `None`: no
    /// cap), in the loss and in [`LmHead::logits`]. Errors on a cap that is not positive.
    pub fn with_softcap(mut self, cap: Option<f32>) -> Result<Self> {
        if let Some(c) = cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(Error::invalid(
                "lm_head",
                format!("final_logit_softcapping {c} must be a positive number"),
            ));
        }
        self.softcap = cap;
        Ok(self)
    }

    /// The head tied to `embedding` (`tie_word_embeddings`): the same tensor, one parameter.
    pub fn tied(embedding: &VocabParallelEmbedding, ctx: &ParallelCtx) -> Self {
        Self {
            weight: embedding.weight().clone(),
            tp: ctx.tp().clone(),
            softcap: None,
        }
    }

    /// This rank's rows `(V/P, H)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The summed cross-entropy of final hidden states `h` `(batch, tokens', H)` (under TP-sp
    /// this rank's part of the tokens) against `labels` `(batch, tokens)` i64 (already shifted:
    /// the label of token i is the id of token i+1; [`IGNORE_INDEX`] skipped), and the number of
    /// labels counted. Divide by the global count for the mean. Collective over tp.
    pub fn loss_sum(
        &self,
        h: &Tensor,
        labels: &Tensor,
        opts: &CrossEntropyOptions,
    ) -> Result<(Tensor, usize)> {
        let h = self.tp.gather_tokens(h)?;
        let (b, n, hd) = h.dims3()?;
        let opts = CrossEntropyOptions {
            softcap: self.softcap.or(opts.softcap),
            ..*opts
        };
        vocab_parallel_cross_entropy(
            &h.reshape((b * n, hd))?,
            &self.weight,
            &labels.flatten_all()?,
            self.tp.comm(),
            &opts,
        )
    }

    /// Logits `(.., tokens, V)` f32 of final hidden states `(.., tokens', H)` (under TP-sp this
    /// rank's part of the tokens), all-gathered over the vocabulary shards: for evaluation and
    /// generation, not for long-context training. Collective over tp.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let h = if h.rank() >= 2 {
            self.tp.gather_tokens(h)?
        } else {
            h.clone()
        };
        let local = soft_cap(
            &super::linear(
                &h.to_dtype(DType::F32)?,
                &self.weight.to_dtype(DType::F32)?,
                None,
            )?,
            self.softcap,
        )?;
        if self.tp.size() == 1 {
            return Ok(local);
        }
        let last = local.rank() - 1;
        Ok(crate::collectives::gather(&local, self.tp.comm(), last)?)
    }
}

/// Everything about the labels and the split that forward and backward share.
struct Plan {
    comm: Comm,
    n: usize,
    hidden_size: usize,
    shard: usize,
    chunk: usize,
    count: usize,
    /// `(N, 1)` u32: the label's row in this rank's shard, 0 when it is not here.
    local_idx: Tensor,
    /// `(N, 1)` f32: 1 where the (non-ignored) label is in this rank's shard.
    here: Tensor,
    /// `(N, 1)` f32: 1 where the label is not ignored.
    valid: Tensor,
    /// Per token: the label's row in this rank's shard where it is here (host copy of
    /// `local_idx` and `here`, for the CPU softmax kernels).
    target_here: Vec<Option<u32>>,
    /// Final-logit soft-capping.
    softcap: Option<f32>,
}

impl Plan {
    fn new(
        hidden: &Tensor,
        weight: &Tensor,
        labels: &Tensor,
        comm: &Comm,
        opts: &CrossEntropyOptions,
    ) -> Result<Self> {
        if opts.chunk_tokens == 0 {
            return Err(Error::invalid(OP, "chunk_tokens must be positive"));
        }
        let (n, h) = hidden.dims2().map_err(|_| {
            Error::invalid(
                OP,
                format!("hidden must be (N, H), got shape {:?}", hidden.dims()),
            )
        })?;
        let (shard, hw) = weight.dims2().map_err(|_| {
            Error::invalid(
                OP,
                format!("weight must be (V/P, H), got shape {:?}", weight.dims()),
            )
        })?;
        if hw != h {
            return Err(Error::invalid(
                OP,
                format!(
                    "hidden {:?} has {h} features but the weight shard {:?} has {hw}",
                    hidden.dims(),
                    weight.dims()
                ),
            ));
        }
        if shard == 0 {
            return Err(Error::invalid(OP, "the weight shard has no rows"));
        }
        for (what, t) in [("hidden", hidden), ("weight", weight)] {
            if !t.dtype().is_float() {
                return Err(Error::invalid(
                    OP,
                    format!("{what} must be a float tensor, got {:?}", t.dtype()),
                ));
            }
        }
        if labels.dims() != [n] {
            return Err(Error::invalid(
                OP,
                format!(
                    "labels must be ({n},) to match hidden {:?}, got shape {:?}",
                    hidden.dims(),
                    labels.dims()
                ),
            ));
        }
        let labels: Vec<i64> = match labels.dtype() {
            DType::I64 => labels.to_vec1()?,
            DType::U32 | DType::U8 => labels.to_dtype(DType::I64)?.to_vec1()?,
            other => {
                return Err(Error::invalid(
                    OP,
                    format!("labels must be i64 (or u32/u8), got {other:?}"),
                ))
            }
        };
        let p = comm.size();
        let vocab = (shard * p) as i64;
        if let Some((pos, &bad)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l != opts.ignore_index && !(0..vocab).contains(&l))
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "label {bad} at position {pos} is outside [0, {vocab}) and is not the ignore \
                     index {}",
                    opts.ignore_index
                ),
            ));
        }
        let start = (comm.rank() * shard) as i64;
        let end = start + shard as i64;
        let mut local_idx = Vec::with_capacity(n);
        let mut here = Vec::with_capacity(n);
        let mut valid = Vec::with_capacity(n);
        let mut count = 0;
        for &l in &labels {
            let is_valid = l != opts.ignore_index;
            let is_here = is_valid && (start..end).contains(&l);
            count += usize::from(is_valid);
            valid.push(if is_valid { 1f32 } else { 0. });
            here.push(if is_here { 1f32 } else { 0. });
            local_idx.push(if is_here { (l - start) as u32 } else { 0 });
        }
        let device = hidden.device();
        let target_here = local_idx
            .iter()
            .zip(&here)
            .map(|(&i, &h)| (h > 0.0).then_some(i))
            .collect();
        if let Some(c) = opts.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(Error::invalid(
                OP,
                format!("the logit soft-cap {c} must be a positive number"),
            ));
        }
        Ok(Self {
            softcap: opts.softcap,
            target_here,
            comm: comm.clone(),
            n,
            hidden_size: h,
            shard,
            chunk: opts.chunk_tokens,
            count,
            local_idx: Tensor::from_vec(local_idx, (n, 1), device)?,
            here: Tensor::from_vec(here, (n, 1), device)?,
            valid: Tensor::from_vec(valid, (n, 1), device)?,
        })
    }

    /// `(start, len)` of every chunk of tokens.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.n)
            .step_by(self.chunk)
            .map(|s| (s, self.chunk.min(self.n - s)))
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.comm.size() == 1 {
            Ok(x.clone())
        } else {
            self.comm.all_reduce(x, op)
        }
    }

    /// The weight as the head's products take it: as stored when hidden states and weight are
    /// bf16 on a CPU with bf16 dot products (`flash_ring::bf16_dot_products`: the products of
    /// two bf16 numbers are exact, so their f32 sums are the f32 logits at twice the f32 rate),
    /// widened to f32 otherwise.
    fn product_weight(hidden: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let bf16_dot = hidden.dtype() == DType::BF16
            && weight.dtype() == DType::BF16
            && hidden.device().is_cpu()
            && flash_ring::bf16_dot_products();
        let w = weight.detach();
        Ok(if bf16_dot { w } else { w.to_dtype(DType::F32)? })
    }

    /// This chunk's f32 logits against the local shard `(c, V/P)` (soft-capped with a cap);
    /// `w` from [`Self::product_weight`].
    fn logits(&self, hidden: &Tensor, w: &Tensor, s: usize, c: usize) -> Result<Tensor> {
        let h = hidden.narrow(0, s, c)?;
        let logits = if w.dtype() == DType::BF16 {
            flash_ring::matmul_to_f32(&h, &w.t()?).map_err(crate::attention::block::kernel_err)?
        } else {
            let h = h.to_dtype(DType::F32)?.contiguous()?;
            super::linear::matmul(&h, &w.t()?)?
        };
        soft_cap(&logits, self.softcap)
    }

    /// The derivative of the soft-cap at capped logits `capped`: `1 - (capped / c)²`
    /// (`None` without a cap).
    fn cap_slope(&self, capped: &Tensor) -> Result<Option<Tensor>> {
        let Some(c) = self.softcap else {
            return Ok(None);
        };
        let t = (capped / c as f64)?;
        Ok(Some((t.sqr()?.neg()? + 1.0)?))
    }

    /// Forward on detached inputs: the scalar f32 loss sum, the per-token lse `(N, 1)` and,
    /// with `eager` = `Some(want_weight)`, the gradients of the loss sum ([`Self::backward`]'s
    /// with `g = 1`).
    fn forward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        eager: Option<bool>,
    ) -> Result<(Tensor, Tensor, Option<Grads>)> {
        let hidden = hidden.detach();
        let device = hidden.device();
        let w = Self::product_weight(&hidden, weight)?;
        let mut loss = Tensor::zeros((), DType::F32, device)?;
        let mut lses = Vec::new();
        let mut grads = GradParts::default();
        for (s, c) in self.chunks() {
            let logits = self.logits(&hidden, &w, s, c)?;
            let here = self.here.narrow(0, s, c)?;
            let idx = self.local_idx.narrow(0, s, c)?;
            let target = (logits.gather(&idx, 1)? * &here)?;
            let (max, sum_exp) = if logits.device().is_cpu() {
                let local = crate::ops::softmax_rows::max_rows(&logits)?;
                let max = self.all_reduce(&local, ReduceOp::Max)?;
                let sum_exp = crate::ops::softmax_rows::sum_exp_rows(&logits, &max, &local)?;
                (max, sum_exp)
            } else {
                let max = self.all_reduce(&logits.max_keepdim(1)?, ReduceOp::Max)?;
                let sum_exp = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?;
                (max, sum_exp)
            };
            // Kept for the chunk's gradients in eager mode.
            let logits = match eager {
                Some(_) => Some(logits),
                None => {
                    drop(logits);
                    None
                }
            };
            let both = self.all_reduce(&Tensor::cat(&[&sum_exp, &target], 1)?, ReduceOp::Sum)?;
            let lse = (max + both.narrow(1, 0, 1)?.log()?)?;
            let target = both.narrow(1, 1, 1)?;
            let valid = self.valid.narrow(0, s, c)?;
            let chunk_loss = ((&lse - target)? * &valid)?.sum_all()?;
            loss = (loss + chunk_loss)?;
            if let (Some(want_weight), Some(logits)) = (eager, logits) {
                grads.add_chunk(self, &hidden, &w, logits, &lse, &valid, s, want_weight)?;
            }
            lses.push(lse);
        }
        let lse = if lses.is_empty() {
            Tensor::zeros((0, 1), DType::F32, device)?
        } else {
            Tensor::cat(&lses, 0)?
        };
        let grads = match eager {
            Some(want_weight) => Some(grads.finish(self, device, want_weight)?),
            None => None,
        };
        Ok((loss, lse, grads))
    }

    /// Gradients of `g · loss_sum` (f32) with respect to `hidden` (all-reduced) and, when
    /// `want_weight` (the weight trains: not a frozen head under LoRA), `weight`: each chunk's
    /// logits recomputed.
    fn backward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        lse: &Tensor,
        g: &Tensor,
        want_weight: bool,
    ) -> Result<Grads> {
        let hidden = hidden.detach();
        let device = hidden.device();
        let w = Self::product_weight(&hidden, weight)?;
        let g = g.detach().to_dtype(DType::F32)?.reshape((1, 1))?;
        let mut grads = GradParts::default();
        for (s, c) in self.chunks() {
            let logits = self.logits(&hidden, &w, s, c)?;
            let scale = self.valid.narrow(0, s, c)?.broadcast_mul(&g)?;
            let lse_c = lse.narrow(0, s, c)?;
            grads.add_chunk(self, &hidden, &w, logits, &lse_c, &scale, s, want_weight)?;
        }
        grads.finish(self, device, want_weight)
    }
}

/// `d_hidden` `(N, H)` (all-reduced over the vocabulary shards) and `d_weight` `(V/P, H)`
/// (when the weight trains), f32.
type Grads = (Tensor, Option<Tensor>);

/// The gradients of the chunks done so far.
#[derive(Default)]
struct GradParts {
    d_weight: Option<Tensor>,
    d_hidden: Vec<Tensor>,
}

impl GradParts {
    /// Adds the gradients of the chunk of tokens from `s` whose `logits` `(c, V/P)` (capped)
    /// and lse `lse_c` `(c, 1)` are given, each token's scaled by `scale` `(c, 1)` (the
    /// loss's gradient where its label counts, 0 where ignored).
    #[allow(clippy::too_many_arguments)]
    fn add_chunk(
        &mut self,
        plan: &Plan,
        hidden: &Tensor,
        w: &Tensor,
        logits: Tensor,
        lse_c: &Tensor,
        scale: &Tensor,
        s: usize,
        want_weight: bool,
    ) -> Result<()> {
        let c = logits.dim(0)?;
        // With bf16 products the gradient of the logits is rounded to bf16 for them, as a
        // bf16 head's backward does in PyTorch; the sums stay f32.
        let bf16 = w.dtype() == DType::BF16;
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        // With a cap the gradient of the capped logits is taken in f32, times the cap's
        // slope, then rounded.
        let slope = plan.cap_slope(&logits)?;
        let (final_dtype, dtype) = match slope {
            Some(_) => (dtype, DType::F32),
            None => (dtype, dtype),
        };
        let dlogits = if logits.device().is_cpu() {
            let target = plan.target_here[s..s + c].to_vec();
            crate::ops::softmax_rows::softmax_grad_rows(logits, lse_c, scale, target, dtype)?
        } else {
            let probs = logits.broadcast_sub(lse_c)?.exp()?;
            // softmax - onehot, in place on the fresh `probs` (only where the target is here).
            let minus_here = plan.here.narrow(0, s, c)?.neg()?;
            probs.scatter_add_set(&plan.local_idx.narrow(0, s, c)?, &minus_here, 1)?;
            drop(logits);
            probs.broadcast_mul(scale)?.to_dtype(dtype)?
        };
        let dlogits = match slope {
            Some(slope) => (dlogits * slope)?.to_dtype(final_dtype)?,
            None => dlogits,
        };
        let mul = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
            if bf16 {
                flash_ring::matmul_to_f32(a, b).map_err(crate::attention::block::kernel_err)
            } else {
                Ok(a.matmul(b)?)
            }
        };
        if want_weight {
            let h = hidden.narrow(0, s, c)?;
            let h = if bf16 {
                h
            } else {
                h.to_dtype(DType::F32)?.contiguous()?
            };
            let dw = mul(&dlogits.t()?, &h)?;
            self.d_weight = Some(match self.d_weight.take() {
                None => dw,
                Some(acc) => add_assign(acc, &dw)?,
            });
        }
        self.d_hidden.push(mul(&dlogits, w)?);
        Ok(())
    }

    /// The gradients: `d_hidden` all-reduced over the vocabulary shards (collective over the
    /// plan's group), zeros for no chunk.
    fn finish(self, plan: &Plan, device: &Device, want_weight: bool) -> Result<Grads> {
        let d_weight = match (self.d_weight, want_weight) {
            (Some(d), _) => Some(d),
            (None, true) => Some(Tensor::zeros(
                (plan.shard, plan.hidden_size),
                DType::F32,
                device,
            )?),
            (None, false) => None,
        };
        let d_hidden = if self.d_hidden.is_empty() {
            Tensor::zeros((0, plan.hidden_size), DType::F32, device)?
        } else {
            let local = Tensor::cat(&self.d_hidden, 0)?;
            drop(self.d_hidden);
            plan.all_reduce(&local, ReduceOp::Sum)?
        };
        Ok((d_hidden, d_weight))
    }
}

/// The loss node: its forward hands over the precomputed loss, its backward recomputes the
/// chunks' logits and returns the gradients of `hidden` and `weight` (or scales those the
/// forward took, in eager mode).
struct ChunkedCrossEntropy {
    plan: Plan,
    lse: Tensor,
    out: Mutex<Option<Storage>>,
    /// The gradients of the loss sum taken in the forward (eager mode), until the backward
    /// takes them (freed then, not kept with the graph).
    grads: Mutex<Option<Grads>>,
}

impl ChunkedCrossEntropy {
    fn take_out(&self) -> candle_core::Result<Storage> {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        out.take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{OP}: forward result already taken")))
    }

    fn wrong_device(&self, got: &Storage) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "{OP}: the loss is on {:?}, not on the inputs' device",
            got.device().location()
        ))
    }
}

impl CustomOp2 for ChunkedCrossEntropy {
    fn name(&self) -> &'static str {
        "cpl-vocab-parallel-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take_out()? {
            Storage::Cpu(s) => Ok((s, Shape::from(()))),
            other => Err(self.wrong_device(&other)),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.take_out()? {
            Storage::Cuda(s) => Ok((s, Shape::from(()))),
            other => Err(self.wrong_device(&other)),
        }
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        match self.take_out()? {
            Storage::Metal(s) => Ok((s, Shape::from(()))),
            other => Err(self.wrong_device(&other)),
        }
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let eager = self.grads.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (dh, dw) = match eager {
            // d(g · loss) = g · d(loss). (A second backward of the node recomputes.)
            Some((dh, dw)) => {
                let g = grad_res.detach().to_dtype(DType::F32)?.reshape((1, 1))?;
                let dw = dw.as_ref().map(|d| d.broadcast_mul(&g)).transpose()?;
                (dh.broadcast_mul(&g)?, dw)
            }
            None => self
                .plan
                .backward(hidden, weight, &self.lse, grad_res, weight.track_op())?,
        };
        Ok((
            Some(dh.to_dtype(hidden.dtype())?),
            dw.map(|d| d.to_dtype(weight.dtype())).transpose()?,
        ))
    }
}

/// `acc + x`, in place into `acc` for contiguous CPU f32 tensors (both are fresh, unshared
/// gradients here), out of place otherwise.
fn add_assign(acc: Tensor, x: &Tensor) -> Result<Tensor> {
    let in_place = matches!(acc.device(), Device::Cpu)
        && acc.dtype() == DType::F32
        && x.dtype() == DType::F32
        && acc.shape() == x.shape()
        && acc.is_contiguous()
        && x.is_contiguous();
    if in_place {
        acc.inplace_op2(x, &AddAssignF32)?;
        Ok(acc)
    } else {
        Ok((acc + x)?)
    }
}

/// `dst += src` for contiguous f32 CPU storages of one shape.
struct AddAssignF32;

impl InplaceOp2 for AddAssignF32 {
    fn name(&self) -> &'static str {
        "cpl-add-assign-f32"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((d0, d1)), Some((s0, s1))) =
            (dst_l.contiguous_offsets(), src_l.contiguous_offsets())
        else {
            candle_core::bail!("{}: operands must be contiguous", self.name())
        };
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) if d1 - d0 == s1 - s0 => {
                for (d, s) in d[d0..d1].iter_mut().zip(&s[s0..s1]) {
                    *d += *s;
                }
                Ok(())
            }
            _ => candle_core::bail!("{}: operands must be f32 of one size", self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// The weight gradient's accumulation: contiguous f32 CPU tensors of one shape are summed
    /// into `acc`'s own storage (a handle to it sees the sum: no second buffer); other dtypes
    /// and non-contiguous operands out of place, with the same values; operands of other
    /// shapes fail, as `+` does, even with as many elements. The values are small integers
    /// and halves: every sum is exact in f32 and bf16.
    #[test]
    fn add_assign_accumulates_in_place_where_it_can() {
        let a = Tensor::arange(0f32, 6., &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let x = (&a * 0.5).unwrap();
        let want: Vec<f32> = (0..6).map(|i| i as f32 * 1.5).collect();
        let before = values(&a);
        // f32, contiguous: in place.
        let acc = a.copy().unwrap();
        let alias = acc.clone();
        assert_eq!(values(&add_assign(acc, &x).unwrap()), want);
        assert_eq!(values(&alias), want, "f32: not accumulated in place");
        // bf16, or a non-contiguous operand (a transposed copy of the same values): the same
        // sums, and `acc` untouched.
        let transposed = |t: &Tensor| t.t().unwrap().contiguous().unwrap().t().unwrap();
        let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        for (what, acc, x) in [
            ("bf16", bf16(&a), bf16(&x)),
            ("non-contiguous x", a.copy().unwrap(), transposed(&x)),
            ("non-contiguous acc", transposed(&a), x.clone()),
        ] {
            let alias = acc.clone();
            assert_eq!(values(&add_assign(acc, &x).unwrap()), want, "{what}");
            assert_eq!(values(&alias), before, "{what}: accumulated in place");
        }
        let other_shape = x.reshape((3, 2)).unwrap();
        assert!(add_assign(a.copy().unwrap(), &other_shape).is_err());
    }

    /// The in-place kernel: `dst += src` over the operands' own ranges of their storages
    /// (offsets included: the rest of the storage is untouched); other sizes, dtypes and
    /// non-contiguous operands are refused, naming the kernel.
    #[test]
    fn add_assign_kernel_adds_over_the_operands_ranges() {
        let dst_all = Tensor::arange(0f32, 8., &Device::Cpu).unwrap();
        let src_all = (Tensor::arange(0f32, 12., &Device::Cpu).unwrap() * 10.).unwrap();
        let dst = dst_all.narrow(0, 2, 4).unwrap();
        dst.inplace_op2(&src_all.narrow(0, 5, 4).unwrap(), &AddAssignF32)
            .unwrap();
        assert_eq!(values(&dst_all), [0., 1., 52., 63., 74., 85., 6., 7.]);
        let square = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        for (what, dst, src) in [
            ("sizes", dst.clone(), src_all.narrow(0, 0, 3).unwrap()),
            ("dtypes", dst.to_dtype(DType::BF16).unwrap(), dst.clone()),
            ("layout", square.t().unwrap(), square.clone()),
        ] {
            let err = dst
                .inplace_op2(&src, &AddAssignF32)
                .expect_err(what)
                .to_string();
            assert!(err.contains("cpl-add-assign-f32"), "{what}: {err}");
        }
    }

    /// The head's products keep a bf16 weight as stored only when the hidden states are bf16
    /// too, on a CPU with bf16 dot products; otherwise the weight is widened to f32.
    #[test]
    fn bf16_products_only_for_bf16_inputs_on_bf16_dot_products() {
        let f = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
        let b = f.to_dtype(DType::BF16).unwrap();
        let both = if flash_ring::bf16_dot_products() {
            DType::BF16
        } else {
            DType::F32
        };
        for (h, w, want) in [
            (&b, &b, both),
            (&f, &b, DType::F32),
            (&b, &f, DType::F32),
            (&f, &f, DType::F32),
        ] {
            let got = Plan::product_weight(h, w).unwrap().dtype();
            assert_eq!(got, want, "hidden {:?}, weight {:?}", h.dtype(), w.dtype());
        }
    }
}
