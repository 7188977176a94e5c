//! Incremental generation with a KV cache through a causal LM's pipeline stages (one rank, tensor
//! parallel, or pipeline stages; sequence parallelism is the models' to refuse). `cpl generate`
//! and library users call [`generate`] on every rank, picking tokens with [`sample`] (temperature,
//! top-p, a seeded [`Rng`]) or [`argmax`].

use std::ops::Range;

use candle_core::{DType, Shape, Tensor};
use candle_parallel::comm::Comm;
use candle_parallel::mesh::{DeviceMesh, Dim};
use models::causal_lm::{CausalLm, KvCache};

use crate::error::{Error, Result};

/// A rank's pipeline stage for generation: its decoder layers, the pipeline group through
/// which hidden states go forward and the last stage's logits come back, and the data-parallel
/// group (ranks generating the same text, e.g. the expert-parallel ranks of a mixture of
/// experts) that takes its first rank's pick of each token.
pub struct Stages {
    pp: Comm,
    dp: Comm,
    layers: Range<usize>,
    hidden: usize,
    vocab: usize,
    /// Dtype of the hidden states between stages (the parameters').
    dtype: DType,
}

impl Stages {
    /// This rank's stage: `layers` (the decoder layers its model holds), the model's `hidden`
    /// width and `vocab`, the activations' `dtype`.
    pub fn new(
        mesh: &DeviceMesh,
        layers: Range<usize>,
        hidden: usize,
        vocab: usize,
        dtype: DType,
    ) -> Self {
        Self {
            pp: mesh.comm(Dim::Pp),
            dp: mesh.comm(Dim::Dp),
            layers,
            hidden,
            vocab,
            dtype,
        }
    }

    /// The logits `(1, vocab)` f32 of the last of the new tokens `ids` `(1, n)`, on every rank
    /// of the pipeline; extends this stage's layers in `cache`. Collective over the world.
    pub fn forward(
        &self,
        model: &dyn CausalLm,
        ids: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (p, r) = (self.pp.size(), self.pp.rank());
        let n = ids.dim(1)?;
        let x = if r == 0 {
            model.embed_cached(ids)?
        } else {
            let shape = Shape::from((1, n, self.hidden));
            self.pp.recv(r - 1, &shape, self.dtype)?
        };
        let x = model.layers_cached(&x, self.layers.clone(), cache)?;
        cache.advance(n);
        if r + 1 < p {
            self.pp.send(&x, r + 1)?;
        }
        let logits = if r + 1 == p {
            model.head_cached(&x)?
        } else {
            Tensor::zeros((1, self.vocab), DType::F32, x.device())?
        };
        Ok(if p > 1 {
            self.pp.broadcast(&logits, p - 1)?
        } else {
            logits
        })
    }

    /// The data-parallel group's first rank's `token` on every rank of it, so that ranks whose
    /// logits differ by rounding never pick (or stop) apart. Collective over the world.
    pub fn agree(&self, token: u32) -> Result<u32> {
        if self.dp.size() == 1 {
            return Ok(token);
        }
        let t = Tensor::new(&[token], &candle_core::Device::Cpu)?;
        Ok(self.dp.broadcast(&t, 0)?.to_vec1::<u32>()?[0])
    }
}

/// Continues `prompt` by up to `max_new` tokens, each chosen by `pick` from the f32 logits of
/// the last token (the same on every rank, so a deterministic `pick` keeps the ranks in step);
/// stops after `eos`. Returns the prompt and the new tokens. Collective over the world.
pub fn generate(
    model: &dyn CausalLm,
    stages: &Stages,
    prompt: &[u32],
    max_new: usize,
    eos: Option<u32>,
    mut pick: impl FnMut(&[f32]) -> u32,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(Error::Invalid("generation needs a non-empty prompt".into()));
    }
    let dev = model.ctx().device().clone();
    let mut cache = KvCache::default();
    let mut out = prompt.to_vec();
    let mut next = Tensor::from_vec(prompt.to_vec(), (1, prompt.len()), &dev)?;
    for _ in 0..max_new {
        let logits = stages.forward(model, &next, &mut cache)?;
        let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let t = stages.agree(pick(&logits))?;
        out.push(t);
        if Some(t) == eos {
            break;
        }
        next = Tensor::from_vec(vec![t], (1, 1), &dev)?;
    }
    Ok(out)
}

/// A small deterministic generator (splitmix64) for sampling.
pub struct Rng(pub u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks the next token from `logits` (vocab) by temperature and top-p (temperature 0:
/// [`argmax`]); the same pick on every rank for the same `rng` state.
pub fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = Vec::new();
    let mut acc = 0.0;
    for (i, p) in probs {
        acc += p / total;
        kept.push((i, p));
        if acc >= top_p {
            break;
        }
    }
    let mass: f64 = kept.iter().map(|p| p.1).sum();
    let mut r = rng.next_f64() * mass;
    for (i, p) in &kept {
        r -= p;
        if r <= 0.0 {
            return *i as u32;
        }
    }
    kept.last()
        .map(|k| k.0 as u32)
        .unwrap_or_else(|| argmax(logits))
}

/// The token of the largest logit (the first on ties): greedy decoding.
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &l)| {
            if l > best.1 {
                (i, l)
            } else {
                best
            }
        })
        .0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_parallel::comm::LocalWorld;
    use candle_parallel::MeshConfig;

    /// Under tp2 x dp2 every rank proposes another token; each takes the one of the rank of
    /// its data-parallel group with dp coordinate 0 (same tp coordinate).
    #[test]
    fn data_parallel_ranks_take_their_first_ranks_pick() {
        let got = LocalWorld::run(4, |world| -> Result<(usize, usize, u32)> {
            let mesh = DeviceMesh::new(&MeshConfig::new().with_tp(2).with_dp(2), world)?;
            let stages = Stages::new(&mesh, 0..1, 8, 16, DType::F32);
            let picked = stages.agree(10 + mesh.rank() as u32)?;
            Ok((mesh.coord(Dim::Tp), mesh.coord(Dim::Dp), picked))
        })
        .unwrap();
        let first = |tp: usize| {
            got.iter()
                .enumerate()
                .find(|(_, g)| g.0 == tp && g.1 == 0)
                .map(|(r, _)| 10 + r as u32)
                .unwrap()
        };
        for (tp, _, picked) in &got {
            assert_eq!(*picked, first(*tp), "{got:?}");
        }
        assert_ne!(first(0), first(1));
    }
}
