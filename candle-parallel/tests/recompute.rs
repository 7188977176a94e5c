//! Activation checkpointing (`recompute::checkpoint`) under every mode, with every
//! sequence-parallel strategy, against the single-device computation.
//!
//! The model is two attention layers `y = x + tanh(attn(x Wq, x Wk, x Wv) Wo)` (GQA: 4 query
//! heads, 2 kv heads, causal), each run through `checkpoint`. Each rank holds its sequence
//! shard of one random non-zero input `x` and the whole (replicated) weights, backpropagates
//! `Σ y_local ⊙ G_local` through `GradSink::backward` and hands back its output, the gradient
//! of its input shard and of every weight. The reference runs the same layers with a plain
//! softmax attention on one device. Checked, f32, `max|a - b| / max|ref|` at most 1e-5:
//! - every rank's output and input gradient against its shard of the reference;
//! - every weight gradient, summed over the ranks, against the reference;
//! - `Full` and `Selective` against `None` on the same ranks, bit for bit, as the module docs
//!   promise (recomputation runs the same kernels on the same inputs).
//!
//! `Selective` exercises each strategy's explicit `SequenceParallelAttention::backward` from
//! the kept `out` and `lse`. A missing gradient, or one left in the sink, fails the test.
//! A recomputation that does not repeat the forward's attention calls, and a second backward
//! through a selective block, are errors, not panics.

mod common;
use common::{assert_close, grad};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor, Var, D};
use candle_parallel::attention::ulysses::repeat_kv;
use candle_parallel::comm::{Comm, LocalWorld};
use candle_parallel::recompute::{checkpoint, Block, Checkpointing, GradSink};
use candle_parallel::{
    attention::AttnCall, AttnMask, DeviceMesh, SeqLayout, SequenceParallelAttention, SpAttention,
    SpConfig, Strategy,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use testkit::assert_identical;

const TOL: f64 = 1e-5;
const B: usize = 1;
const S: usize = 16;
const HIDDEN: usize = 16;
const HQ: usize = 4;
const HKV: usize = 2;
const HD: usize = 8;
const LAYERS: usize = 2;
const MODES: [Checkpointing; 3] = [
    Checkpointing::None,
    Checkpointing::Full,
    Checkpointing::Selective,
];

fn scale() -> f32 {
    1.0 / (HD as f32).sqrt()
}

/// Uniform values with magnitude in [0.25, 1) times `amp`, random sign: never zero.
fn rand_t(rng: &mut StdRng, dims: &[usize], amp: f32) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let m: f32 = rng.random_range(0.25..1.0) * amp;
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// One layer's weights `[wq, wk, wv, wo]`.
type Weights = [Tensor; 4];

fn random_weights(rng: &mut StdRng) -> Vec<Weights> {
    let a = 1.0 / (HIDDEN as f32).sqrt();
    (0..LAYERS)
        .map(|_| {
            [
                rand_t(rng, &[HQ * HD, HIDDEN], a),
                rand_t(rng, &[HKV * HD, HIDDEN], a),
                rand_t(rng, &[HKV * HD, HIDDEN], a),
                rand_t(rng, &[HIDDEN, HQ * HD], a),
            ]
        })
        .collect()
}

type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_parallel::Result<Tensor>;

/// `x + tanh(attn(x Wq, x Wk, x Wv) Wo)` on `(b, n, hidden)`.
fn layer(x: &Tensor, w: &Weights, attn: Attn) -> candle_parallel::Result<Tensor> {
    let (b, n, _) = x.dims3()?;
    let proj = |w: &Tensor, heads: usize| -> candle_parallel::Result<Tensor> {
        Ok(x.broadcast_matmul(&w.t()?)?.reshape((b, n, heads, HD))?)
    };
    let o = attn(&proj(&w[0], HQ)?, &proj(&w[1], HKV)?, &proj(&w[2], HKV)?)?;
    let y = o.reshape((b, n, HQ * HD))?.broadcast_matmul(&w[3].t()?)?;
    Ok((x + y.tanh()?)?)
}

/// Plain causal softmax attention of the whole sequence on one device.
fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_parallel::Result<Tensor> {
    let rep = HQ / HKV;
    let heads = |t: &Tensor| -> candle_core::Result<Tensor> { t.transpose(1, 2)?.contiguous() };
    let (q, k, v) = (
        heads(q)?,
        heads(&repeat_kv(k, rep)?)?,
        heads(&repeat_kv(v, rep)?)?,
    );
    let n = q.dim(2)?;
    let causal: Vec<f32> = (0..n * n)
        .map(|i| {
            if i % n > i / n {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let causal = Tensor::from_vec(causal, (n, n), &Device::Cpu)?;
    let s = (q.matmul(&k.t()?)? * scale() as f64)?.broadcast_add(&causal)?;
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    Ok(p.matmul(&v)?.transpose(1, 2)?.contiguous()?)
}

/// Output, input gradient and weight gradients (layer-major, `[wq, wk, wv, wo]`).
struct Outcome {
    y: Tensor,
    dx: Tensor,
    dw: Vec<Tensor>,
}

fn reference(x: &Tensor, ws: &[Weights], g: &Tensor) -> Outcome {
    let xv = Var::from_tensor(x).unwrap();
    let wvs: Vec<Vec<Var>> = ws
        .iter()
        .map(|w| w.iter().map(|t| Var::from_tensor(t).unwrap()).collect())
        .collect();
    let mut h = xv.as_tensor().clone();
    for wv in &wvs {
        let w: Weights = std::array::from_fn(|i| wv[i].as_tensor().clone());
        h = layer(&h, &w, &plain_attention).unwrap();
    }
    let grads = (&h * g).unwrap().sum_all().unwrap().backward().unwrap();
    Outcome {
        y: h.detach(),
        dx: grad(&grads, &xv, "reference x").unwrap(),
        dw: wvs
            .iter()
            .flatten()
            .map(|v| grad(&grads, v, "reference weight").unwrap())
            .collect(),
    }
}

/// What one rank computes: its outcome and its shards of the reference output and input
/// gradient (sharded by the strategy's own plan).
struct RankRun {
    got: Outcome,
    want_y: Tensor,
    want_dx: Tensor,
}

fn no_grad(what: &str) -> candle_parallel::Error {
    candle_parallel::Error::Layout(format!("test: no gradient for {what}"))
}

fn run_ranks(
    cfg: &SpConfig,
    mode: Checkpointing,
    x: &Tensor,
    ws: &[Weights],
    g: &Tensor,
    rf: &Outcome,
) -> Vec<RankRun> {
    let p = cfg.degree();
    let run = |comm: Comm| -> candle_parallel::Result<RankRun> {
        let mesh = DeviceMesh::new(&cfg.mesh_config(), comm)?;
        let sp = SpAttention::new(cfg, &mesh)?;
        let x_local = Var::from_tensor(&sp.shard(x, 1)?)?;
        let g_local = sp.shard(g, 1)?;
        let (want_y, want_dx) = (sp.shard(&rf.y, 1)?, sp.shard(&rf.dx, 1)?);
        let attn: Arc<dyn SequenceParallelAttention> = Arc::new(sp);
        let vars: Vec<Vec<Var>> = ws
            .iter()
            .map(|w| w.iter().map(Var::from_tensor).collect())
            .collect::<candle_core::Result<_>>()?;
        let sink = GradSink::new();
        let mut h = x_local.as_tensor().clone();
        for wv in &vars {
            let w: Weights = std::array::from_fn(|i| wv[i].as_tensor().clone());
            let block: Block = Arc::new(move |x, attn| {
                layer(x, &w, &|q, k, v| {
                    attn.attention(q, k, v, &AttnCall::new(AttnMask::Causal, scale()))
                })
            });
            h = checkpoint(mode, &h, &attn, &sink, block)?;
        }
        let grads = sink.backward(&(&h * &g_local)?.sum_all()?)?;
        if !sink.is_empty() {
            return Err(candle_parallel::Error::Layout(
                "test: gradients left in the sink".into(),
            ));
        }
        let dw = vars
            .iter()
            .flatten()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .cloned()
                    .ok_or_else(|| no_grad("a weight"))
            })
            .collect::<candle_parallel::Result<_>>()?;
        let dx = grads
            .get(x_local.as_tensor())
            .cloned()
            .ok_or_else(|| no_grad("the input shard"))?;
        Ok(RankRun {
            got: Outcome {
                y: h.detach(),
                dx,
                dw,
            },
            want_y,
            want_dx,
        })
    };
    LocalWorld::new(p)
        .with_timeout(Duration::from_secs(120))
        .launch(run)
        .unwrap_or_else(|e| panic!("{} {mode}: {e}", cfg.strategy))
}

fn configs() -> Vec<SpConfig> {
    vec![
        SpConfig::new(Strategy::Ring, 1, 2).with_layout(SeqLayout::Zigzag),
        SpConfig::new(Strategy::Ulysses, 2, 1),
        // Ulysses of 4 over 2 kv heads replicates them.
        SpConfig::new(Strategy::Ulysses, 4, 1),
        SpConfig::new(Strategy::AllGather, 1, 2),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::DoubleRing, 2, 2).with_inner_ring(1),
        SpConfig::new(Strategy::StarTrail, 1, 4).with_team(2),
    ]
}

#[test]
fn every_mode_and_strategy_matches_single_device() {
    let mut rng = StdRng::seed_from_u64(7);
    let x = rand_t(&mut rng, &[B, S, HIDDEN], 1.0);
    let g = rand_t(&mut rng, &[B, S, HIDDEN], 1.0);
    let ws = random_weights(&mut rng);
    let rf = reference(&x, &ws, &g);
    for cfg in configs() {
        cfg.validate().unwrap();
        let mut none: Option<Vec<RankRun>> = None;
        for mode in MODES {
            let what = format!("{} u{} r{} {mode}", cfg.strategy, cfg.ulysses, cfg.ring);
            let ranks = run_ranks(&cfg, mode, &x, &ws, &g, &rf);
            for (r, run) in ranks.iter().enumerate() {
                assert_close(&run.got.y, &run.want_y, TOL, &format!("{what}: rank {r} y"));
                assert_close(
                    &run.got.dx,
                    &run.want_dx,
                    TOL,
                    &format!("{what}: rank {r} dx"),
                );
            }
            for (i, want) in rf.dw.iter().enumerate() {
                let mut sum = ranks[0].got.dw[i].clone();
                for run in &ranks[1..] {
                    sum = (sum + &run.got.dw[i]).unwrap();
                }
                let name = ["wq", "wk", "wv", "wo"][i % 4];
                assert_close(&sum, want, TOL, &format!("{what}: layer {} {name}", i / 4));
            }
            match &none {
                None => none = Some(ranks),
                Some(base) => {
                    for (r, (a, b)) in ranks.iter().zip(base).enumerate() {
                        let (a, b) = (&a.got, &b.got);
                        let pairs = [(&a.y, &b.y, "y"), (&a.dx, &b.dx, "dx")]
                            .into_iter()
                            .chain(a.dw.iter().zip(&b.dw).map(|(a, b)| (a, b, "weight grad")));
                        for (a, b, name) in pairs {
                            assert_identical(a, b, &format!("{what}: rank {r} {name} vs none"));
                        }
                    }
                }
            }
        }
    }
}

/// How many attention calls a test block makes on its `i`-th run.
type Calls = fn(usize) -> usize;

/// A ring attention on the one-rank `comm` and a block whose number of attention calls is
/// `calls(i)` on its `i`-th run (0: the forward, 1: the recomputation).
fn solo_block(comm: Comm, calls: Calls) -> (Arc<dyn SequenceParallelAttention>, Block) {
    let cfg = SpConfig::new(Strategy::Ring, 1, 1);
    let attn: Arc<dyn SequenceParallelAttention> =
        Arc::new(SpAttention::from_comms(&cfg, comm.clone(), comm).unwrap());
    let mut rng = StdRng::seed_from_u64(11);
    let w = random_weights(&mut rng).swap_remove(0);
    let w: Weights = std::array::from_fn(|i| Var::from_tensor(&w[i]).unwrap().as_tensor().clone());
    let runs = AtomicUsize::new(0);
    let block: Block = Arc::new(move |x, attn| {
        let n = calls(runs.fetch_add(1, Ordering::SeqCst));
        let mut h = x.clone();
        for _ in 0..n {
            h = layer(&h, &w, &|q, k, v| {
                attn.attention(q, k, v, &AttnCall::new(AttnMask::Causal, scale()))
            })?;
        }
        Ok(h)
    });
    (attn, block)
}

/// Runs `f` on a world of one rank.
fn solo(f: impl Fn(Comm) + Sync) {
    LocalWorld::run(1, |comm| -> candle_parallel::Result<()> {
        f(comm);
        Ok(())
    })
    .unwrap();
}

fn selective_loss(
    attn: &Arc<dyn SequenceParallelAttention>,
    block: Block,
    sink: &GradSink,
) -> (Var, Tensor) {
    let mut rng = StdRng::seed_from_u64(12);
    let x = Var::from_tensor(&rand_t(&mut rng, &[B, 8, HIDDEN], 1.0)).unwrap();
    let y = checkpoint(Checkpointing::Selective, x.as_tensor(), attn, sink, block).unwrap();
    (x, y.sqr().unwrap().sum_all().unwrap())
}

#[test]
fn recomputation_that_changes_the_attention_calls_is_an_error() {
    let cases: [(Calls, &str); 2] = [
        (|i| if i == 0 { 2 } else { 1 }, "fewer"),
        (|i| if i == 0 { 1 } else { 2 }, "more"),
    ];
    for (calls, want) in cases {
        solo(|comm| {
            let (attn, block) = solo_block(comm, calls);
            let sink = GradSink::new();
            let (_, loss) = selective_loss(&attn, block, &sink);
            let err = match sink.backward(&loss) {
                Ok(_) => panic!("{want}: the backward succeeded"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(want), "{want}: {err}");
        });
    }
}

#[test]
fn second_backward_through_a_selective_block_is_an_error() {
    solo(|comm| {
        let (attn, block) = solo_block(comm, |_| 1);
        let sink = GradSink::new();
        let (x, loss) = selective_loss(&attn, block, &sink);
        let grads = sink.backward(&loss).unwrap();
        assert!(grads.get(x.as_tensor()).is_some() && sink.is_empty());
        let err = sink.backward(&loss).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
    });
}

#[test]
fn modes_parse_and_print() {
    for mode in MODES {
        assert_eq!(mode.to_string().parse::<Checkpointing>().unwrap(), mode);
    }
    let err = "partial".parse::<Checkpointing>().unwrap_err().to_string();
    assert!(err.contains("none, full or selective"), "{err}");
    assert_eq!(Checkpointing::default(), Checkpointing::None);
}
