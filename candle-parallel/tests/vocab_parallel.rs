//! The vocab-parallel embedding and the vocab-parallel chunked cross-entropy on 1, 2 and 4 local
//! ranks, compared with the same computation on one rank with plain (differentiable) candle ops.
//!
//! Every rank's shard of a weight is a `Var`; gradients are compared with the matching rows of
//! the single-rank gradient (f32, relative error `max|a - b| / max|ref|`). A missing gradient is
//! an error (the rank fails, so the test fails).

mod common;
use common::{grad, rand_t, world};

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_parallel::comm::Comm;
use candle_parallel::nn::{
    vocab_parallel_cross_entropy, CrossEntropyOptions, TpActivations, TpGroup,
    VocabParallelEmbedding, IGNORE_INDEX,
};
use candle_parallel::ops::{embedding_lookup, embedding_lookup_composite};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORLDS: [usize; 3] = [1, 2, 4];

fn tp(comm: &Comm) -> TpGroup {
    TpGroup::new(comm.clone(), TpActivations::Replicated)
}
const TOL: f64 = 1e-5;
/// Tolerance of the bf16 case (inputs rounded to bf16; arithmetic in f32 on both sides).
const BF16_TOL: f64 = 1e-2;

/// Labels in `[0, vocab)`, every `ignore_every`-th one (and the first) set to `IGNORE_INDEX`.
fn rand_labels(rng: &mut StdRng, n: usize, vocab: usize, ignore_every: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            if i % ignore_every == 0 {
                IGNORE_INDEX
            } else {
                rng.random_range(0..vocab as i64)
            }
        })
        .collect()
}

/// Rows of shard `r` of `p` of `t` (dim 0).
fn shard(t: &Tensor, p: usize, r: usize) -> Result<Tensor> {
    let c = t.dim(0)? / p;
    t.narrow(0, r * c, c)
}

/// This rank's vocab-parallel loss and token count, with its trainable `hidden` and weight shard.
fn rank_loss(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    comm: &Comm,
    opts: &CrossEntropyOptions,
) -> Result<(Tensor, usize, Var, Var)> {
    let hr = Var::from_tensor(hidden)?;
    let wr = Var::from_tensor(&shard(weight, comm.size(), comm.rank())?)?;
    let (loss, count) =
        vocab_parallel_cross_entropy(hr.as_tensor(), wr.as_tensor(), labels, comm, opts)?;
    Ok((loss, count, hr, wr))
}

fn assert_close_tol(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    testkit::assert_close(got, want, tol, what)
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_close_tol(got, want, TOL, what)
}

fn assert_scalar_close(got: f32, want: f32, tol: f64, what: &str) {
    testkit::assert_close_scalar(got as f64, want as f64, tol, what)
}

/// Reference: `Σ_{i not ignored} -log_softmax(cap(h W^T))[i, label_i]` with plain
/// differentiable ops (`cap(x) = c · tanh(x / c)` with a soft-cap, else `x`).
fn reference_loss(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[i64],
    softcap: Option<f32>,
) -> Result<Tensor> {
    let logits = hidden.matmul(&weight.t()?)?;
    let logits = match softcap {
        Some(c) => ((logits / c as f64)?.tanh()? * c as f64)?,
        None => logits,
    };
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let log_probs = shifted.broadcast_sub(&lse)?;
    let n = labels.len();
    let idx: Vec<u32> = labels.iter().map(|&l| l.max(0) as u32).collect();
    let mask: Vec<f32> = labels
        .iter()
        .map(|&l| if l == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let idx = Tensor::from_vec(idx, (n, 1), &Device::Cpu)?;
    let mask = Tensor::from_vec(mask, (n, 1), &Device::Cpu)?;
    (log_probs.gather(&idx, 1)? * mask)?.sum_all()?.neg()
}

struct CeCase {
    n: usize,
    hidden: usize,
    vocab: usize,
    chunk: usize,
    ignore_every: usize,
    /// Upstream gradient of the loss sum (`backward` of `scale · loss_sum`).
    scale: f64,
    /// Final-logit soft-cap.
    softcap: Option<f32>,
}

/// Runs the vocab-parallel loss on `p` ranks against the single-rank reference.
fn check_cross_entropy(rng: &mut StdRng, case: &CeCase, dtype: DType, tol: f64) {
    let CeCase {
        n,
        hidden: h,
        vocab: v,
        chunk,
        ignore_every,
        scale,
        softcap,
    } = *case;
    // Inputs rounded to `dtype` once; the reference sees the same values in f32.
    let hidden = rand_t(rng, &[n, h]).to_dtype(dtype).unwrap();
    let weight = rand_t(rng, &[v, h]).to_dtype(dtype).unwrap();
    let labels = rand_labels(rng, n, v, ignore_every);
    let expected_count = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();

    let hv = Var::from_tensor(&hidden.to_dtype(DType::F32).unwrap()).unwrap();
    let wv = Var::from_tensor(&weight.to_dtype(DType::F32).unwrap()).unwrap();
    let ref_loss = reference_loss(hv.as_tensor(), wv.as_tensor(), &labels, softcap).unwrap();
    let grads = ref_loss.affine(scale, 0.).unwrap().backward().unwrap();
    let ref_gh = grad(&grads, &hv, "reference hidden").unwrap();
    let ref_gw = grad(&grads, &wv, "reference weight").unwrap();
    let ref_loss = ref_loss.to_scalar::<f32>().unwrap();
    let labels_t = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
    // Gradients recomputed in the backward, and taken in the forward (eager).
    for (p, eager) in WORLDS.iter().flat_map(|&p| [(p, false), (p, true)]) {
        let opts = CrossEntropyOptions {
            chunk_tokens: chunk,
            softcap,
            eager_gradients: eager,
            ..Default::default()
        };
        let out = world(p, |comm| {
            let (loss, count, hr, wr) = rank_loss(&hidden, &weight, &labels_t, &comm, &opts)?;
            assert_eq!(loss.dtype(), DType::F32);
            assert_eq!(loss.dims(), &[] as &[usize]);
            let grads = loss.affine(scale, 0.)?.backward()?;
            let gh = grad(&grads, &hr, "hidden")?;
            let gw = grad(&grads, &wr, "weight shard")?;
            // A second backward of the same node (its eager gradients were handed over and
            // freed by the first) recomputes them.
            let again = loss.affine(scale, 0.)?.backward()?;
            let gh2 = grad(&again, &hr, "hidden, second backward")?;
            assert_close_tol(&gh2, &gh, tol, "d_hidden of a second backward");
            assert_eq!(gh.dtype(), dtype);
            assert_eq!(gw.dtype(), dtype);
            // Without tracked inputs no node is recorded; the value is the same.
            let (plain, plain_count) = vocab_parallel_cross_entropy(
                &hidden,
                &shard(&weight, p, comm.rank())?,
                &labels_t,
                &comm,
                &opts,
            )?;
            assert!(!plain.track_op());
            assert_eq!(plain_count, count);
            assert_eq!(plain.to_scalar::<f32>()?, loss.to_scalar::<f32>()?);
            Ok((loss.to_scalar::<f32>()?, count, gh, gw))
        });
        let (loss0, _, gh0, _) = &out[0];
        let gh0 = gh0.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let gh0 = gh0.to_vec1::<f32>().unwrap();
        for (r, (loss, count, gh, gw)) in out.iter().enumerate() {
            let what = format!("{dtype:?} N={n} chunk={chunk} P={p} eager {eager} rank {r}");
            // Replicated results are bit-identical on every rank.
            assert_eq!(loss, loss0, "{what}: loss differs from rank 0");
            let ghv = gh.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            assert_eq!(
                ghv.to_vec1::<f32>().unwrap(),
                gh0,
                "{what}: d_hidden differs from rank 0"
            );
            assert_eq!(*count, expected_count, "{what}: count");
            assert_scalar_close(*loss, ref_loss, tol, &format!("{what}: loss"));
            assert_close_tol(gh, &ref_gh, tol, &format!("{what}: d_hidden"));
            let want = shard(&ref_gw, p, r).unwrap();
            assert_close_tol(gw, &want, tol, &format!("{what}: d_weight"));
        }
    }
}

#[test]
fn cross_entropy_matches_single_rank() {
    let mut rng = StdRng::seed_from_u64(11);
    for (chunk, scale) in [(8, 1.0), (5, 0.37), (64, 1.0)] {
        let case = CeCase {
            n: 37,
            hidden: 16,
            vocab: 64,
            chunk,
            ignore_every: 5,
            scale,
            softcap: None,
        };
        check_cross_entropy(&mut rng, &case, DType::F32, TOL);
    }
}

#[test]
fn cross_entropy_bf16() {
    let mut rng = StdRng::seed_from_u64(12);
    let case = CeCase {
        n: 37,
        hidden: 16,
        vocab: 64,
        chunk: 8,
        ignore_every: 4,
        scale: 1.0,
        softcap: None,
    };
    check_cross_entropy(&mut rng, &case, DType::BF16, BF16_TOL);
}

/// Final-logit soft-capping (Gemma 2) in the fused loss: loss and both gradients equal the
/// capped reference on 1, 2 and 4 ranks (f32 1e-5; bf16 inputs 1e-2 as above), with a cap small
/// enough that the logits (|x| up to about 3 here) sit on the tanh's curved part; and the cap
/// matters (the uncapped loss differs by more than 1%).
#[test]
fn cross_entropy_with_soft_capped_logits() {
    let mut rng = StdRng::seed_from_u64(14);
    for (dtype, tol, chunk) in [
        (DType::F32, TOL, 8),
        (DType::F32, TOL, 64),
        (DType::BF16, BF16_TOL, 5),
    ] {
        let case = CeCase {
            n: 37,
            hidden: 16,
            vocab: 64,
            chunk,
            ignore_every: 5,
            scale: 0.7,
            softcap: Some(1.5),
        };
        check_cross_entropy(&mut rng, &case, dtype, tol);
    }
    let hidden = rand_t(&mut rng, &[20, 16]);
    let weight = rand_t(&mut rng, &[64, 16]);
    let labels = rand_labels(&mut rng, 20, 64, 7);
    let capped = reference_loss(&hidden, &weight, &labels, Some(1.5)).unwrap();
    let plain = reference_loss(&hidden, &weight, &labels, None).unwrap();
    let (c, p) = (
        capped.to_scalar::<f32>().unwrap(),
        plain.to_scalar::<f32>().unwrap(),
    );
    assert!(
        (c - p).abs() > 0.01 * p.abs(),
        "the cap changes nothing: {c} vs {p}"
    );
    // A cap that is not positive is refused by name.
    let bad = CrossEntropyOptions {
        softcap: Some(0.0),
        ..Default::default()
    };
    let labels_t = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
    let comm = candle_parallel::comm::solo();
    let err = vocab_parallel_cross_entropy(&hidden, &weight, &labels_t, &comm, &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("soft-cap"), "{err}");
}

#[test]
fn cross_entropy_all_ignored() {
    let mut rng = StdRng::seed_from_u64(13);
    let (n, h, v) = (19, 8, 32);
    let hidden = rand_t(&mut rng, &[n, h]);
    let weight = rand_t(&mut rng, &[v, h]);
    let labels = Tensor::new(vec![IGNORE_INDEX; n].as_slice(), &Device::Cpu).unwrap();
    let opts = CrossEntropyOptions {
        chunk_tokens: 8,
        ..Default::default()
    };
    for p in WORLDS {
        let out = world(p, |comm| {
            let (loss, count, hr, wr) = rank_loss(&hidden, &weight, &labels, &comm, &opts)?;
            let grads = loss.backward()?;
            let gh = grad(&grads, &hr, "hidden")?;
            let gw = grad(&grads, &wr, "weight shard")?;
            Ok((loss.to_scalar::<f32>()?, count, gh, gw))
        });
        for (r, (loss, count, gh, gw)) in out.iter().enumerate() {
            assert_eq!(*loss, 0.0, "P={p} rank {r}: loss");
            assert_eq!(*count, 0, "P={p} rank {r}: count");
            for (what, g) in [("d_hidden", gh), ("d_weight", gw)] {
                let vals = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    vals.iter().all(|&x| x == 0.0),
                    "P={p} rank {r}: {what} is not all zeros (NaN or non-zero)"
                );
            }
        }
    }
}

/// A NaN logit makes the loss NaN, as PyTorch's `cross_entropy` does, wherever it sits: in the
/// row of a token's label or off it, in the first or the last vocabulary shard, f32 and bf16
/// products. (The vector exponential sends NaN to 0 and the maxima's all-reduce keeps a NaN
/// only from some ranks, so without the rows' NaN check a poisoned vocabulary entry that no
/// label names gave a finite loss, and training went on with it.) The same inputs without the
/// NaN give a finite loss.
#[test]
fn cross_entropy_nan_logit_gives_nan_loss() {
    let mut rng = StdRng::seed_from_u64(17);
    let (n, h, v) = (9, 8, 32);
    let hidden = rand_t(&mut rng, &[n, h]);
    let clean = rand_t(&mut rng, &[v, h]);
    // Every label is 5 (or ignored): entries 0 and 31 are never a label.
    let labels: Vec<i64> = (0..n)
        .map(|i| if i == 3 { IGNORE_INDEX } else { 5 })
        .collect();
    let labels = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
    let poisoned = |entry: usize| {
        let mut w = clean.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        w[entry * h + 2] = f32::NAN;
        Tensor::from_vec(w, (v, h), &Device::Cpu).unwrap()
    };
    for (dtype, eager) in [(DType::F32, false), (DType::F32, true), (DType::BF16, true)] {
        let opts = CrossEntropyOptions {
            chunk_tokens: 4,
            eager_gradients: eager,
            ..Default::default()
        };
        let hidden = hidden.to_dtype(dtype).unwrap();
        for (what, weight, nan) in [
            ("clean", clean.clone(), false),
            ("entry 0", poisoned(0), true),
            ("entry 31", poisoned(v - 1), true),
            ("the label's entry", poisoned(5), true),
        ] {
            let weight = weight.to_dtype(dtype).unwrap();
            for p in WORLDS {
                let out = world(p, |comm| {
                    let (loss, _, _, _) = rank_loss(&hidden, &weight, &labels, &comm, &opts)?;
                    loss.to_dtype(DType::F32)?.to_scalar::<f32>()
                });
                for (r, loss) in out.iter().enumerate() {
                    assert_eq!(
                        loss.is_nan(),
                        nan,
                        "{dtype:?} eager {eager}, {what}, P={p} rank {r}: loss {loss}"
                    );
                }
            }
        }
    }
}

#[test]
fn cross_entropy_rejects_bad_input() {
    let mut rng = StdRng::seed_from_u64(14);
    let (n, h, v) = (6, 4, 8);
    let hidden = rand_t(&mut rng, &[n, h]);
    let weight = rand_t(&mut rng, &[v, h]);
    let opts = CrossEntropyOptions::default();
    for p in [1, 2] {
        let msgs = world(p, |comm| {
            let w = shard(&weight, p, comm.rank())?;
            let mut msgs = Vec::new();
            for bad in [v as i64, -1] {
                let labels = Tensor::new(&[0i64, 1, bad, IGNORE_INDEX, 3, 2], &Device::Cpu)?;
                match vocab_parallel_cross_entropy(&hidden, &w, &labels, &comm, &opts) {
                    Ok(_) => panic!("label {bad} accepted"),
                    Err(e) => msgs.push((bad, e.to_string())),
                }
            }
            // Shape errors: wrong label count, wrong hidden size.
            let labels = Tensor::new(&[0i64, 1, 2], &Device::Cpu)?;
            let e = vocab_parallel_cross_entropy(&hidden, &w, &labels, &comm, &opts)
                .expect_err("label count mismatch accepted");
            msgs.push((0, e.to_string()));
            let labels = Tensor::new(&[0i64; 6], &Device::Cpu)?;
            let e =
                vocab_parallel_cross_entropy(&hidden.narrow(1, 0, 3)?, &w, &labels, &comm, &opts)
                    .expect_err("hidden size mismatch accepted");
            msgs.push((0, e.to_string()));
            Ok(msgs)
        });
        for rank_msgs in msgs {
            for (bad, msg) in &rank_msgs[..2] {
                assert!(
                    msg.contains(&format!("label {bad} at position 2")),
                    "P={p}: unclear error {msg:?}"
                );
            }
            assert!(
                rank_msgs[2].1.contains("labels must be (6,)"),
                "{}",
                rank_msgs[2].1
            );
            assert!(rank_msgs[3].1.contains("features"), "{}", rank_msgs[3].1);
        }
    }
}

#[test]
fn embedding_matches_single_rank() {
    let mut rng = StdRng::seed_from_u64(21);
    let (v, h) = (32, 8);
    let weight = rand_t(&mut rng, &[v, h]);
    // Every shard of the 4-rank split gets at least one id, and one id repeats (its gradient
    // accumulates); the rest are random.
    let mut ids: Vec<u32> = (0..14).map(|_| rng.random_range(0..v as u32)).collect();
    for k in 0..4 {
        ids[3 * k] = (k * v / 4) as u32 + rng.random_range(0..(v / 4) as u32);
    }
    ids[13] = ids[3];
    let ids = Tensor::from_vec(ids, (2, 7), &Device::Cpu).unwrap();
    let g = rand_t(&mut rng, &[2, 7, h]);

    let wv = Var::from_tensor(&weight).unwrap();
    let want = wv
        .as_tensor()
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, 7, h))
        .unwrap();
    let grads = (&want * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let ref_gw = grad(&grads, &wv, "reference weight").unwrap();
    let want = want.detach();

    for p in WORLDS {
        let out = world(p, |comm| {
            let r = comm.rank();
            let wr = Var::from_tensor(&shard(&weight, p, r)?)?;
            let emb = VocabParallelEmbedding::from_weight(wr.as_tensor().clone(), v, tp(&comm))
                .map_err(candle_core::Error::wrap)?;
            assert_eq!(emb.vocab_range(), r * v / p..(r + 1) * v / p);
            assert_eq!(emb.weight().dims(), &[v / p, h]);
            let out = emb.forward(&ids).map_err(candle_core::Error::wrap)?;
            let grads = (&out * &g)?.sum_all()?.backward()?;
            Ok((out.detach(), grad(&grads, &wr, "weight shard")?))
        });
        for (r, (out, gw)) in out.iter().enumerate() {
            let what = format!("embedding P={p} rank {r}");
            assert_close(out, &want, &format!("{what}: forward"));
            assert_close(
                gw,
                &shard(&ref_gw, p, r).unwrap(),
                &format!("{what}: d_weight"),
            );
        }
    }
}

/// The ids of the embedding gradient tests: 4096 tokens, row 3 of a 16-row table looked up at
/// least 3072 times (a frequent token), the others at random.
fn frequent_ids(rng: &mut StdRng, v: usize) -> Vec<u32> {
    (0..4096)
        .map(|i| {
            if i % 4 != 0 {
                3
            } else {
                rng.random_range(0..v as u32)
            }
        })
        .collect()
}

/// Each row's gradient through the (vocab-parallel) embedding, on `p` ranks: `(shard rows,
/// hidden)` per rank, in the table's dtype.
fn embedding_grads(table: &Tensor, ids: &Tensor, g: &Tensor, p: usize) -> Vec<Tensor> {
    let v = table.dim(0).unwrap();
    world(p, |comm| {
        let wr = Var::from_tensor(&shard(table, p, comm.rank())?)?;
        let emb = VocabParallelEmbedding::from_weight(wr.as_tensor().clone(), v, tp(&comm))
            .map_err(candle_core::Error::wrap)?;
        let out = emb.forward(ids).map_err(candle_core::Error::wrap)?;
        let grads = (&out * g)?.sum_all()?.backward()?;
        grad(&grads, &wr, "weight shard")
    })
}

/// Each rank's gradient `grads[r]` equals rows `[r·V/P, (r+1)·V/P)` of `want` (the whole
/// table's gradient) bit for bit.
fn assert_shards_identical(grads: &[Tensor], want: &Tensor, what: &str) {
    for (r, got) in grads.iter().enumerate() {
        let want = shard(want, grads.len(), r).unwrap();
        testkit::assert_identical(got, &want, &format!("{what}, rank {r}"));
    }
}

/// A bf16 table's gradient is each row's token gradients summed in f32 in token order and
/// rounded once, on 1, 2 and 4 ranks: bit for bit, and within half a bf16 ulp of the float64
/// sum. Candle's `index_select` backward (as PyTorch's CPU embedding) sums in bf16: the frequent
/// token (3136 lookups here) with gradient 0.5 got 128 instead of 1568.
#[test]
fn embedding_bf16_gradient_sums_in_f32() {
    let mut rng = StdRng::seed_from_u64(5);
    let (v, h) = (16, 8);
    let flat = frequent_ids(&mut rng, v);
    let n = flat.len();
    let ids = Tensor::from_vec(flat.clone(), (2, n / 2), &Device::Cpu).unwrap();
    let table = rand_t(&mut rng, &[v, h]).to_dtype(DType::BF16).unwrap();
    let halves = Tensor::full(0.5f32, (2, n / 2, h), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let random = rand_t(&mut rng, &[2, n / 2, h])
        .to_dtype(DType::BF16)
        .unwrap();
    let count3 = flat.iter().filter(|&&id| id == 3).count();
    for (g, name) in [(&halves, "halves"), (&random, "random")] {
        let gf = testkit::values(g);
        // Reference: f32 sums in token order (and float64 sums), rounded once to bf16.
        let mut sum32 = vec![0f32; v * h];
        let mut sum64 = vec![0f64; v * h];
        for (p, &id) in flat.iter().enumerate() {
            for j in 0..h {
                sum32[id as usize * h + j] += gf[p * h + j] as f32;
                sum64[id as usize * h + j] += gf[p * h + j];
            }
        }
        if name == "halves" {
            assert_eq!(sum32[3 * h], 0.5 * count3 as f32, "the frequent row's sum");
        }
        let want: Vec<half::bf16> = sum32.iter().map(|&x| half::bf16::from_f32(x)).collect();
        for (x, y) in want.iter().zip(&sum64) {
            // bf16 keeps 8 significant bits: the spacing at y is 2^(exponent of y - 7).
            let ulp = 2f64.powi(y.abs().max(1e-30).log2().floor() as i32 - 7);
            assert!(
                (x.to_f64() - y).abs() <= 0.5 * ulp + 1e-6 * y.abs(),
                "{name}: the f32 sum rounded once ({x}) is not the float64 sum {y} rounded"
            );
        }
        let want = Tensor::from_vec(want, (v, h), &Device::Cpu).unwrap();
        for p in WORLDS {
            let what = format!("{name}, P={p}: against the f32 sums rounded once");
            assert_shards_identical(&embedding_grads(&table, &ids, g, p), &want, &what);
        }
    }
}

/// In f32 the lookup's gradient is bit for bit candle's `index_select` backward (the same sums
/// in the same order), repeated ids included, on 1, 2 and 4 ranks.
#[test]
fn embedding_f32_gradient_is_candles_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(6);
    let (v, h) = (16, 8);
    let flat = frequent_ids(&mut rng, v);
    let n = flat.len();
    let ids = Tensor::from_vec(flat, (2, n / 2), &Device::Cpu).unwrap();
    let table = rand_t(&mut rng, &[v, h]);
    let g = rand_t(&mut rng, &[2, n / 2, h]);
    let wv = Var::from_tensor(&table).unwrap();
    let out = wv
        .as_tensor()
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, n / 2, h))
        .unwrap();
    let grads = (&out * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let want = grad(&grads, &wv, "reference").unwrap();
    for p in WORLDS {
        let what = format!("P={p}: against candle's index_select backward");
        assert_shards_identical(&embedding_grads(&table, &ids, &g, p), &want, &what);
    }
}

/// The composite that runs off the CPU (`index_select` with a 0/1 mask for other shards' ids)
/// against the kernel on the CPU, f32, with rows of another shard (`None`) and repeated rows:
/// the same values, and the same table gradient (equal as numbers: only a zero's sign may
/// differ, where the mask adds `0 · g`).
#[test]
fn embedding_lookup_composite_matches_the_kernel() {
    let mut rng = StdRng::seed_from_u64(8);
    let (r, h, n) = (6, 5, 40);
    let rows: Vec<Option<u32>> = (0..n)
        .map(|i| (i % 5 != 0).then(|| rng.random_range(0..r as u32)))
        .collect();
    let table = rand_t(&mut rng, &[r, h]);
    let g = rand_t(&mut rng, &[n, h]);
    let run = |composite: bool| -> (Vec<f64>, Vec<f64>) {
        let tv = Var::from_tensor(&table).unwrap();
        let out = if composite {
            embedding_lookup_composite(tv.as_tensor(), &rows)
        } else {
            embedding_lookup(tv.as_tensor(), &rows)
        }
        .unwrap();
        let grads = (&out * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let dt = grad(&grads, &tv, "table").unwrap();
        (testkit::values(&out), testkit::values(&dt))
    };
    let (kernel, composite) = (run(false), run(true));
    assert_eq!(kernel.0, composite.0, "values");
    assert_eq!(kernel.1, composite.1, "table gradient");
    // The masked rows are zeros, and a row no position looks up gets a zero gradient.
    for (i, row) in rows.iter().enumerate() {
        if row.is_none() {
            assert!(
                kernel.0[i * h..(i + 1) * h].iter().all(|&x| x == 0.0),
                "row {i}"
            );
        }
    }
}

/// Under tp, an infinite output gradient at a token of rank 1's shard reaches rank 1's row (as
/// an infinity) and nothing of rank 0's: rank 0's gradient stays finite (through a 0/1 mask it
/// became `inf * 0 = NaN` in rank 0's first row).
#[test]
fn embedding_gradient_of_another_shards_token_stays_there() {
    let mut rng = StdRng::seed_from_u64(7);
    let (v, h) = (8, 4);
    let ids = Tensor::from_vec(vec![1u32, 6, 2, 6], (1, 4), &Device::Cpu).unwrap();
    let table = rand_t(&mut rng, &[v, h]);
    let mut g = vec![1f32; 4 * h];
    g[h] = f32::INFINITY; // position 1, id 6: rank 1's row 2
    let g = Tensor::from_vec(g, (1, 4, h), &Device::Cpu).unwrap();
    let grads = embedding_grads(&table, &ids, &g, 2);
    let r0: Vec<f32> = grads[0].flatten_all().unwrap().to_vec1().unwrap();
    assert!(r0.iter().all(|x| x.is_finite()), "rank 0: {r0:?}");
    assert_eq!(&r0[h..2 * h], &[1.0; 4], "rank 0's row 1");
    let r1: Vec<f32> = grads[1].flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(r1[2 * h], f32::INFINITY, "rank 1's row 2 (id 6)");
    assert_eq!(&r1[2 * h + 1..3 * h], &[2.0; 3], "rank 1's row 2 (id 6)");
}

/// `embedding_lookup` (and its composite) name what is wrong: an id past the table (with its
/// position and the table's rows), a table that is not `(rows, hidden)`, a non-float table.
#[test]
fn embedding_lookup_rejects_bad_input() {
    let table = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
    let msg = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    for lookup in [embedding_lookup, embedding_lookup_composite] {
        let m = msg(lookup(&table, &[Some(1), None, Some(4)]));
        assert!(
            m.contains("id 4 at position 2") && m.contains("4 rows"),
            "{m}"
        );
        let m = msg(lookup(&table.flatten_all().unwrap(), &[Some(0)]));
        assert!(m.contains("(rows, hidden)"), "{m}");
        let m = msg(lookup(&table.to_dtype(DType::U32).unwrap(), &[Some(0)]));
        assert!(m.contains("embedding_lookup") && m.contains("U32"), "{m}");
        assert_eq!(lookup(&table, &[None, Some(3)]).unwrap().dims(), &[2, 3]);
    }
}

#[test]
fn embedding_rejects_bad_input() {
    let weight = Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap();
    let errs = world(2, |comm| {
        let r = comm.rank();
        let indivisible = VocabParallelEmbedding::from_weight(weight.clone(), 15, tp(&comm))
            .expect_err("V % P != 0 accepted")
            .to_string();
        let wrong_rows = VocabParallelEmbedding::from_weight(weight.clone(), 32, tp(&comm))
            .expect_err("wrong shard rows accepted")
            .to_string();
        let emb = VocabParallelEmbedding::from_weight(shard(&weight, 2, r)?, 8, tp(&comm))
            .map_err(candle_core::Error::wrap)?;
        let ids = Tensor::new(&[[1u32, 8]], &Device::Cpu)?;
        let out_of_range = emb.forward(&ids).expect_err("id >= V accepted").to_string();
        Ok([indivisible, wrong_rows, out_of_range])
    });
    for [indivisible, wrong_rows, out_of_range] in errs {
        assert!(indivisible.contains("vocab size 15"), "{indivisible}");
        assert!(wrong_rows.contains("expected V/P"), "{wrong_rows}");
        assert!(out_of_range.contains("id 8"), "{out_of_range}");
    }
}

/// Only what tracks gradients gets one: with the hidden states trainable and the head frozen
/// (a LoRA run's head), or the other way round, the one gradient equals the single-rank
/// reference's (f32, 1e-5) on 1 and 2 ranks, and the loss is the same either way.
#[test]
fn cross_entropy_differentiates_what_tracks() {
    let mut rng = StdRng::seed_from_u64(15);
    let (n, h, v) = (11, 8, 32);
    let hidden = rand_t(&mut rng, &[n, h]);
    let weight = rand_t(&mut rng, &[v, h]);
    let labels = rand_labels(&mut rng, n, v, 4);
    let labels_t = Tensor::new(labels.as_slice(), &Device::Cpu).unwrap();
    let (hv, wv) = (
        Var::from_tensor(&hidden).unwrap(),
        Var::from_tensor(&weight).unwrap(),
    );
    let want = reference_loss(hv.as_tensor(), wv.as_tensor(), &labels, None).unwrap();
    let grads = want.backward().unwrap();
    let ref_gh = grad(&grads, &hv, "reference hidden").unwrap();
    let ref_gw = grad(&grads, &wv, "reference weight").unwrap();
    let want = want.to_scalar::<f32>().unwrap();
    for (p, eager) in [(1, false), (2, false), (1, true), (2, true)] {
        let opts = CrossEntropyOptions {
            chunk_tokens: 4,
            eager_gradients: eager,
            ..Default::default()
        };
        let out = world(p, |comm| {
            let w = shard(&weight, p, comm.rank())?;
            let (hr, wr) = (Var::from_tensor(&hidden)?, Var::from_tensor(&w)?);
            let (only_h, _) =
                vocab_parallel_cross_entropy(hr.as_tensor(), &w, &labels_t, &comm, &opts)?;
            let gh = grad(&only_h.backward()?, &hr, "hidden (head frozen)")?;
            let (only_w, _) =
                vocab_parallel_cross_entropy(&hidden, wr.as_tensor(), &labels_t, &comm, &opts)?;
            let gw = grad(&only_w.backward()?, &wr, "weight shard (hidden frozen)")?;
            Ok((
                only_h.to_scalar::<f32>()?,
                only_w.to_scalar::<f32>()?,
                gh,
                gw,
            ))
        });
        for (r, (loss_h, loss_w, gh, gw)) in out.iter().enumerate() {
            let what = format!("P={p} eager {eager} rank {r}");
            assert_scalar_close(*loss_h, want, TOL, &format!("{what}: loss (head frozen)"));
            assert_scalar_close(*loss_w, want, TOL, &format!("{what}: loss (hidden frozen)"));
            assert_close(gh, &ref_gh, &format!("{what}: d_hidden"));
            assert_close(
                gw,
                &shard(&ref_gw, p, r).unwrap(),
                &format!("{what}: d_weight"),
            );
        }
    }
}

/// The LM head on 1, 2 and 4 tensor-parallel ranks, with replicated activations and under
/// TP-sp, with and without a soft-cap, against plain ops on one rank (f32, 1e-5): its weight
/// is this rank's rows; its logits are `cap(h Wᵀ)` over the whole vocabulary, for
/// `(batch, tokens, H)` hidden states (under TP-sp this rank's tokens) and for one `(H,)`
/// state; its loss sum and count are those of the flattened tokens, with the gradients of
/// this rank's tokens and rows.
#[test]
fn lm_head_matches_single_rank() {
    use candle_parallel::attention::{SpConfig, Strategy};
    use candle_parallel::nn::{
        EmbeddingConfig, LmHead, ParallelCtx, ParamBuilder, ParamMode, TensorMap,
    };
    use candle_parallel::{DeviceMesh, MeshConfig};
    let mut rng = StdRng::seed_from_u64(16);
    let (b, t, h, v) = (2, 4, 8, 32);
    let weight = rand_t(&mut rng, &[v, h]);
    let hidden = rand_t(&mut rng, &[b, t, h]);
    let labels = rand_labels(&mut rng, b * t, v, 3);
    let count = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
    let labels_t = Tensor::from_vec(labels.clone(), (b, t), &Device::Cpu).unwrap();
    let opts = CrossEntropyOptions {
        chunk_tokens: 3,
        ..Default::default()
    };
    let source = Arc::new(TensorMap::new(
        HashMap::from([("lm_head.weight".to_string(), weight.clone())]),
        "test weights",
    ));
    for cap in [None, Some(1.5f32)] {
        let (hv, wv) = (
            Var::from_tensor(&hidden).unwrap(),
            Var::from_tensor(&weight).unwrap(),
        );
        let flat = hv.as_tensor().reshape((b * t, h)).unwrap();
        let loss = reference_loss(&flat, wv.as_tensor(), &labels, cap).unwrap();
        let grads = loss.backward().unwrap();
        let ref_gh = grad(&grads, &hv, "reference hidden").unwrap();
        let ref_gw = grad(&grads, &wv, "reference weight").unwrap();
        let ref_loss = loss.to_scalar::<f32>().unwrap();
        let cap_t = |x: Tensor| candle_parallel::nn::soft_cap(&x, cap).unwrap();
        let ref_logits = cap_t(hidden.broadcast_matmul(&weight.t().unwrap()).unwrap());
        let one = hidden.get(1).unwrap().get(2).unwrap();
        let ref_one = cap_t(weight.matmul(&one.unsqueeze(1).unwrap()).unwrap())
            .squeeze(1)
            .unwrap();
        for (p, act) in [
            (1, TpActivations::Replicated),
            (2, TpActivations::Replicated),
            (4, TpActivations::Replicated),
            (2, TpActivations::SequenceSharded),
            (4, TpActivations::SequenceSharded),
        ] {
            let out = world(p, |comm| {
                let e = candle_core::Error::wrap;
                let mesh = DeviceMesh::new(&MeshConfig::default().with_tp(p), comm).map_err(e)?;
                let single = SpConfig::new(Strategy::Ring, 1, 1);
                let ctx = ParallelCtx::new(&mesh, &single, act).map_err(e)?;
                let (vb, _) = ParamBuilder::new(
                    source.clone(),
                    DType::F32,
                    &Device::Cpu,
                    ParamMode::Trainable,
                );
                let cfg = EmbeddingConfig {
                    vocab_size: v,
                    hidden_size: h,
                };
                let head = LmHead::new(&cfg, vb.pp("lm_head"), &ctx)
                    .and_then(|head| head.with_softcap(cap))
                    .map_err(e)?;
                let hr = Var::from_tensor(&ctx.tp().split_tokens(&hidden).map_err(e)?)?;
                let logits = head.logits(hr.as_tensor()).map_err(e)?;
                let logits_one = head.logits(&one).map_err(e)?;
                let (loss, n) = head.loss_sum(hr.as_tensor(), &labels_t, &opts).map_err(e)?;
                let grads = loss.backward()?;
                let gw = grads
                    .get(head.weight())
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg("no gradient for the head".into()))?;
                Ok((
                    head.weight().detach(),
                    logits,
                    logits_one,
                    loss.to_scalar::<f32>()?,
                    n,
                    grad(&grads, &hr, "hidden")?,
                    gw,
                ))
            });
            for (r, (w, logits, logits_one, loss, n, gh, gw)) in out.iter().enumerate() {
                let what = format!("cap {cap:?}, P={p} {act:?}, rank {r}");
                assert_close(
                    w,
                    &shard(&weight, p, r).unwrap(),
                    &format!("{what}: weight"),
                );
                assert_close(logits, &ref_logits, &format!("{what}: logits"));
                assert_close(logits_one, &ref_one, &format!("{what}: logits of one"));
                assert_scalar_close(*loss, ref_loss, TOL, &format!("{what}: loss"));
                assert_eq!(*n, count, "{what}: count");
                // Under TP-sp this rank holds tokens [r·t/p, (r+1)·t/p) of each sequence.
                let mine = match act {
                    TpActivations::SequenceSharded => ref_gh.narrow(1, r * t / p, t / p).unwrap(),
                    TpActivations::Replicated => ref_gh.clone(),
                };
                assert_close(gh, &mine, &format!("{what}: d_hidden"));
                assert_close(
                    gw,
                    &shard(&ref_gw, p, r).unwrap(),
                    &format!("{what}: d_weight"),
                );
            }
        }
    }
}

/// A head's soft-cap must be a positive number; `None` is no cap.
#[test]
fn lm_head_soft_cap_must_be_positive() {
    let weight = Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap();
    world(1, |comm| {
        let mesh = candle_parallel::DeviceMesh::new(&Default::default(), comm.clone())
            .map_err(candle_core::Error::wrap)?;
        let single = candle_parallel::attention::SpConfig::new(
            candle_parallel::attention::Strategy::Ring,
            1,
            1,
        );
        let ctx = candle_parallel::nn::ParallelCtx::new(&mesh, &single, Default::default())
            .map_err(candle_core::Error::wrap)?;
        let emb = VocabParallelEmbedding::from_weight(weight.clone(), 8, tp(&comm))
            .map_err(candle_core::Error::wrap)?;
        let head = candle_parallel::nn::LmHead::tied(&emb, &ctx);
        assert_eq!(head.weight().id(), emb.weight().id(), "tied: one tensor");
        for good in [None, Some(30.0), Some(f32::MIN_POSITIVE)] {
            assert!(head.clone().with_softcap(good).is_ok(), "{good:?} refused");
        }
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let err = head
                .clone()
                .with_softcap(Some(bad))
                .expect_err("a bad cap accepted")
                .to_string();
            assert!(err.contains("final_logit_softcapping"), "{bad}: {err}");
        }
        Ok(())
    });
}
