//! Sequence-parallel attention against single-device flash-ring, for every strategy.
//!
//! Each case draws global q, k, v and an output weight g, computes the single-device result
//! (flash-ring on the whole sequence; out, lse and the gradients of `Σ out ⊙ g`), then runs the
//! strategy on local ranks: every rank cuts its shard with `SpAttention::shard`, runs
//! `attention_with_lse` (or `attention`), backpropagates `Σ out_local ⊙ g_local`, and returns
//! out, lse, dq, dk, dv. The shards are put back in global order with `ShardPlan::unshard` and
//! compared with the reference (f32, `max|a - b| / max|ref| <= 1e-5`). A missing gradient fails.
//!
//! Every case also asserts the bytes each rank sends in forward and in backward (and the number
//! of ring exchanges), from formulas written here from the shapes alone:
//! with `el` bytes per element, `n = S / (U·R)` local tokens, `rep` the Ulysses kv replication,
//! `Q = b·n·hq·d·el`, `K = b·n·hkv·d·el`, `K' = rep·K`, `a2a(x) = x·(U-1)/U`:
//! - ring:        fwd `(R-1)·2K`,                 bwd `(R-1)·2K + R·2·K_f32` (dk/dv travel in f32);
//!   under a window `m·2K` and `m·2K + (m + h)·2·K_f32`, `m` the ring steps after step 0 that
//!   some rank needs (found here by brute force over every pair of positions), `h = 1` unless
//!   only step 0 runs
//! - ulysses:     fwd `2·a2a(Q) + 2·a2a(K')` (+ `a2a(b·hq·n·4)` for lse), bwd `2·a2a(Q) + 2·a2a(K')`
//! - usp:         the ulysses terms over U plus the ring terms over R with `K'` for `K`
//! - all-gather:  fwd `2·(R-1)·K` (all-gather), bwd `2·(R-1)·K` (reduce-scatter)
//!
//! and that the planner's cost model (`planner::traffic`) predicts the same bytes and exchanges.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::{
    AttnCall, AttnMask, SeqLayout, SequenceParallelAttention, ShardPlan, SpAttention, SpConfig,
    Strategy,
};
use candle_parallel::comm::{LocalWorld, OpKind, TrafficSnapshot};
use candle_parallel::mesh::{DeviceMesh, Placement};
use candle_parallel::planner::traffic::{
    attention_traffic, windowed_attention_traffic, AttentionTraffic, AttnShape,
};
use candle_parallel::Error;
use flash_ring::{AttnSpec, Positions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TOL: f64 = 1e-5;

#[derive(Debug, Clone, Copy, PartialEq)]
enum M {
    Full,
    Causal,
    /// Causal documents: lengths 5, 1, ... crossing shard borders.
    Docs,
    /// Bidirectional documents.
    DocsFull,
}

#[derive(Debug, Clone)]
struct Case {
    cfg: SpConfig,
    b: usize,
    s: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    mask: M,
    with_lse: bool,
    dtype: DType,
    /// A sliding window of this many tokens on top of the mask.
    window: Option<usize>,
    /// Logit soft-capping `tanh(s / c) · c` of the scores.
    softcap: Option<f32>,
}

impl Case {
    fn new(cfg: SpConfig, hq: usize, hkv: usize, mask: M) -> Self {
        Self {
            cfg,
            b: 1,
            s: 64,
            hq,
            hkv,
            d: 32,
            mask,
            with_lse: true,
            dtype: DType::F32,
            window: None,
            softcap: None,
        }
    }

    fn window(mut self, w: usize) -> Self {
        self.window = Some(w);
        self
    }

    fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }

    fn call(&self) -> AttnCall {
        AttnCall::new(self.attn_mask(), self.scale())
            .with_window(self.window)
            .with_softcap(self.softcap)
    }

    fn batch(mut self, b: usize) -> Self {
        self.b = b;
        self
    }

    fn seq(mut self, s: usize) -> Self {
        self.s = s;
        self
    }

    fn no_lse(mut self) -> Self {
        self.with_lse = false;
        self
    }

    fn scale(&self) -> f32 {
        1.3 / (self.d as f32).sqrt()
    }

    /// Documents `[0,5) [5,6) [6,S/2+3) [S/2+3, 3S/4+1) [3S/4+1, S)`.
    fn doc_ids(&self) -> Arc<[u32]> {
        let s = self.s;
        let cu = [0, 5, 6, s / 2 + 3, 3 * s / 4 + 1, s];
        flash_ring::doc_ids_from_cu_seqlens(&cu).unwrap()
    }

    fn attn_mask(&self) -> AttnMask {
        match self.mask {
            M::Full => AttnMask::Full,
            M::Causal => AttnMask::Causal,
            M::Docs => AttnMask::Documents(self.doc_ids()),
            M::DocsFull => AttnMask::DocumentsFull(self.doc_ids()),
        }
    }
}

struct Global {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
}

fn rand_t(rng: &mut StdRng, dims: &[usize], dtype: DType) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn inputs(c: &Case, seed: u64) -> Global {
    let mut rng = StdRng::seed_from_u64(seed);
    Global {
        q: rand_t(&mut rng, &[c.b, c.s, c.hq, c.d], c.dtype),
        k: rand_t(&mut rng, &[c.b, c.s, c.hkv, c.d], c.dtype),
        v: rand_t(&mut rng, &[c.b, c.s, c.hkv, c.d], c.dtype),
        g: rand_t(&mut rng, &[c.b, c.s, c.hq, c.d], c.dtype),
    }
}

/// out, lse, dq, dk, dv.
type Five = [Tensor; 5];

/// The case's attention over the whole sequence on one device: its mask kind, documents and
/// window, positions `0..S`, softmax scale `scale`.
fn whole_sequence_spec(c: &Case, scale: f32) -> AttnSpec {
    let m = c.attn_mask();
    let mut spec = AttnSpec::new(
        scale,
        m.kind(),
        Positions::range(0, c.s),
        Positions::range(0, c.s),
    );
    if let Some(d) = m.doc_ids() {
        spec = spec.with_doc_ids(d.clone());
    }
    if let Some(w) = c.window {
        spec = spec.with_window(w);
    }
    if let Some(cap) = c.softcap {
        spec = spec.with_softcap(cap);
    }
    spec
}

/// Single-device flash-ring on the whole sequence.
fn reference(c: &Case, x: &Global) -> Five {
    let q = Var::from_tensor(&x.q).unwrap();
    let k = Var::from_tensor(&x.k).unwrap();
    let v = Var::from_tensor(&x.v).unwrap();
    let spec = whole_sequence_spec(c, c.scale());
    let (out, lse) = flash_ring::flash_attention_with_lse(&q, &k, &v, &spec).unwrap();
    let grads = (&out * &x.g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gr = |t: &Var| grads.get(t).expect("reference gradient").clone();
    [out, lse, gr(&q), gr(&k), gr(&v)]
}

struct RankOut {
    coords: (usize, usize),
    /// out, lse (or a dummy), dq, dk, dv: local shards.
    t: Five,
    fwd: TrafficSnapshot,
    /// Everything sent during backward.
    bwd_sent: u64,
    bwd_p2p: u64,
    bwd_exchanges: u64,
}

fn e2s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn run_ranks(c: &Case, x: &Global) -> Result<Vec<RankOut>, String> {
    let mask = c.attn_mask();
    let world = LocalWorld::new(c.cfg.degree()).with_timeout(std::time::Duration::from_secs(60));
    world
        .launch(|comm| -> Result<RankOut, String> {
            let mesh = DeviceMesh::new(&c.cfg.mesh_config(), comm.clone()).map_err(e2s)?;
            let sp = SpAttention::new(&c.cfg, &mesh).map_err(e2s)?;
            let var = |t: &Tensor| -> Result<Var, String> {
                Var::from_tensor(&sp.shard_for(t, 1, &mask).map_err(e2s)?).map_err(e2s)
            };
            let (q, k, v) = (var(&x.q)?, var(&x.k)?, var(&x.v)?);
            let g = sp.shard_for(&x.g, 1, &mask).map_err(e2s)?;
            comm.traffic().reset();
            let (out, lse) = if c.with_lse {
                sp.attention_with_lse(&q, &k, &v, &c.call()).map_err(e2s)?
            } else {
                let out = sp.attention(&q, &k, &v, &c.call()).map_err(e2s)?;
                (
                    out,
                    Tensor::zeros(1, DType::F32, &Device::Cpu).map_err(e2s)?,
                )
            };
            let fwd = comm.traffic().snapshot();
            let grads = (&out * &g)
                .and_then(|y| y.sum_all())
                .and_then(|l| l.backward())
                .map_err(e2s)?;
            let total = comm.traffic().snapshot();
            let grad = |t: &Var, name: &str| -> Result<Tensor, String> {
                grads
                    .get(t)
                    .cloned()
                    .ok_or_else(|| format!("rank {}: no gradient for {name}", comm.rank()))
            };
            let t = [out, lse, grad(&q, "q")?, grad(&k, "k")?, grad(&v, "v")?];
            Ok(RankOut {
                coords: sp.shard_coords(),
                t,
                bwd_sent: total.bytes_sent() - fwd.bytes_sent(),
                bwd_p2p: total.p2p_bytes_sent() - fwd.p2p_bytes_sent(),
                bwd_exchanges: total.get(OpKind::Exchange).calls - fwd.get(OpKind::Exchange).calls,
                fwd,
            })
        })
        .map_err(e2s)
}

use testkit::rel_err;

/// What each rank must send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Traffic {
    fwd: u64,
    bwd: u64,
    /// Point-to-point part of `bwd`.
    bwd_p2p: u64,
    fwd_exchanges: u64,
    bwd_exchanges: u64,
}

/// The ring steps some ring rank needs, by brute force: step `s` when some query of ring rank
/// `j` may attend (mask, documents, window) some key of ring rank `(j - s) mod R`. Step 0
/// always runs.
fn needed_ring_steps(c: &Case, plan: &ShardPlan) -> Vec<usize> {
    let r = c.cfg.ring;
    let spec = whole_sequence_spec(c, 1.0);
    let pos: Vec<Vec<u32>> = (0..r).map(|j| plan.ring_positions(j)).collect();
    let needed = |s: usize| {
        (0..r).any(|j| {
            pos[j].iter().any(|&q| {
                pos[(j + r - s) % r]
                    .iter()
                    .any(|&k| spec.allowed(q as usize, k as usize))
            })
        })
    };
    std::iter::once(0)
        .chain((1..r).filter(|&s| needed(s)))
        .collect()
}

/// The ring steps that run: those some rank needs under a window (ring, USP, and the double
/// ring, which then runs the ring loop), every one otherwise.
fn ring_steps_run(c: &Case, plan: &ShardPlan) -> Vec<usize> {
    match (c.window, c.cfg.strategy) {
        (Some(_), Strategy::Ring | Strategy::Usp | Strategy::DoubleRing) => {
            needed_ring_steps(c, plan)
        }
        _ => (0..c.cfg.ring).collect(),
    }
}

fn expected_traffic(c: &Case, steps: &[usize]) -> Traffic {
    let el = c.dtype.size_in_bytes() as u64;
    let (u, r) = (c.cfg.ulysses as u64, c.cfg.ring as u64);
    let n = c.s as u64 / (u * r);
    let (b, hq, hkv, d) = (c.b as u64, c.hq as u64, c.hkv as u64, c.d as u64);
    let q = b * n * hq * d * el;
    let kv = b * n * hkv * d * el;
    // Ulysses' kv replication: u / gcd(u, hkv).
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let rep = u / gcd(u, hkv);
    let a2a = |x: u64| x * (u - 1) / u;
    // Ring over R ranks with kv blocks of `k` bytes: (fwd, bwd, fwd exchanges, bwd exchanges).
    // `m` jumps between the steps that run, and one exchange home unless only step 0 runs.
    let m = steps.len() as u64 - 1;
    let home = u64::from(steps.last().is_some_and(|&l| l > 0));
    assert!(r > 1 || m == 0);
    let ring = |k: u64| -> (u64, u64, u64, u64) {
        let k32 = k / el * 4;
        (m * 2 * k, m * 2 * k + (m + home) * 2 * k32, m, 2 * m + home)
    };
    let lse = if c.with_lse { a2a(b * hq * n * 4) } else { 0 };
    let (fwd, bwd, bwd_p2p, fwd_exchanges, bwd_exchanges) = match c.cfg.strategy {
        Strategy::Ring => {
            let (f, bw, ef, eb) = ring(kv);
            (f, bw, bw, ef, eb)
        }
        Strategy::Ulysses => {
            let x = 2 * a2a(q) + 2 * a2a(kv * rep);
            (x + lse, x, 0, 0, 0)
        }
        // The double ring moves exactly the ring's bytes in as many exchanges (LoongTrain 4.5.3).
        Strategy::Usp | Strategy::DoubleRing => {
            // After the all-to-all a rank holds S/R tokens of hkv·rep/U kv heads: K' bytes.
            let x = 2 * a2a(q) + 2 * a2a(kv * rep);
            let (rf, rb, ef, eb) = ring(kv * rep);
            (x + lse + rf, x + rb, rb, ef, eb)
        }
        Strategy::AllGather => (2 * (r - 1) * kv, 2 * (r - 1) * kv, 0, 0, 0),
        other => panic!("no traffic formula for {other}"),
    };
    Traffic {
        fwd,
        bwd,
        bwd_p2p,
        fwd_exchanges,
        bwd_exchanges,
    }
}

/// Runs one case and asserts numerics and traffic; returns a description on failure.
fn check(c: &Case, seed: u64) -> Result<(), String> {
    let x = inputs(c, seed);
    let refs = reference(c, &x);
    let ranks = run_ranks(c, &x)?;
    let plan = c.cfg.plan_for(c.s, &c.attn_mask()).map_err(e2s)?;
    let mut ordered: Vec<Option<&RankOut>> = vec![None; ranks.len()];
    for ro in &ranks {
        ordered[plan.shard_index(ro.coords.0, ro.coords.1)] = Some(ro);
    }
    let ordered: Vec<&RankOut> = ordered
        .into_iter()
        .map(|o| o.ok_or("two ranks reported the same coords"))
        .collect::<Result<_, _>>()?;
    let tol = if c.dtype == DType::F32 { TOL } else { 2e-2 };
    let names = ["out", "lse", "dq", "dk", "dv"];
    for (i, name) in names.iter().enumerate() {
        if i == 1 && !c.with_lse {
            continue;
        }
        let dim = if i == 1 { 2 } else { 1 };
        let parts: Vec<Tensor> = ordered.iter().map(|ro| ro.t[i].clone()).collect();
        let global = plan.unshard(&parts, dim).map_err(e2s)?;
        let err = rel_err(&global, &refs[i]);
        if err > tol {
            return Err(format!("{name}: relative error {err:e} > {tol:e}"));
        }
    }
    if let (Some(w), Strategy::AllGather) = (c.window, c.cfg.strategy) {
        return check_windowed_allgather_traffic(c, w, &plan, &ranks);
    }
    // A window skips block pairs' compute and, on the ring (and USP's ring), the steps nobody
    // needs: their transfers too.
    let steps = ring_steps_run(c, &plan);
    let want = expected_traffic(c, &steps);
    for ro in &ranks {
        let got = Traffic {
            fwd: ro.fwd.bytes_sent(),
            bwd: ro.bwd_sent,
            bwd_p2p: ro.bwd_p2p,
            fwd_exchanges: ro.fwd.get(OpKind::Exchange).calls,
            bwd_exchanges: ro.bwd_exchanges,
        };
        if got != want {
            return Err(format!(
                "rank {:?}: traffic {got:?}, expected {want:?} (ring steps {steps:?})",
                ro.coords
            ));
        }
    }
    // The planner's cost model uses the same bytes (under a window: without documents; they
    // can only shorten the ring further).
    let planned = planned_traffic(c)?;
    let (pf, pb) = (planned.forward, planned.backward);
    if c.window.is_some() && c.attn_mask().doc_ids().is_some() {
        if c.cfg.layout == SeqLayout::DocZigzag {
            // The plan follows the documents, which the planner does not know.
            return Ok(());
        }
        if want.fwd > pf.total() || want.bwd > pb.total() {
            return Err(format!("planner traffic {planned:?} below {want:?}"));
        }
        return Ok(());
    }
    if (
        pf.total(),
        pb.total(),
        pb.exchange,
        planned.forward_steps,
        planned.backward_steps,
    ) != (
        want.fwd,
        want.bwd,
        want.bwd_p2p,
        want.fwd_exchanges,
        want.bwd_exchanges,
    ) {
        return Err(format!("planner traffic {planned:?}, expected {want:?}"));
    }
    Ok(())
}

/// What the planner predicts for case `c` (with its window, if any).
fn planned_traffic(c: &Case) -> Result<AttentionTraffic, String> {
    let shape = AttnShape {
        batch: c.b,
        seq: c.s,
        heads: c.hq,
        kv_heads: c.hkv,
        head_dim: c.d,
        elem_bytes: c.dtype.size_in_bytes(),
        with_lse: c.with_lse,
    };
    match c.window {
        Some(w) => windowed_attention_traffic(&c.cfg, &shape, w, c.attn_mask().kind()),
        None => attention_traffic(&c.cfg, &shape),
    }
    .map_err(e2s)
}

/// Windowed all-gather CP: each rank sends the rows of its k and v that another rank's windows
/// reach (counted here by brute force over every pair of positions), once forward and again in
/// backward, plus the f32 gradients of the rows it received; one exchange forward, two in
/// backward. Ring rank `i`'s rows are `plan.ring_positions(i)`.
fn check_windowed_allgather_traffic(
    c: &Case,
    w: usize,
    plan: &ShardPlan,
    ranks: &[RankOut],
) -> Result<(), String> {
    let r = c.cfg.ring;
    let causal = matches!(c.mask, M::Causal | M::Docs);
    let sees = |q: u32, k: u32| {
        let (q, k) = (q as i64, k as i64);
        if causal {
            q >= k && q - k < w as i64
        } else {
            (q - k).abs() < w as i64
        }
    };
    // rows[i][j]: rows of rank i's keys that a query of rank j sees.
    let rows = |i: usize, j: usize| -> u64 {
        let qs = plan.ring_positions(j);
        plan.ring_positions(i)
            .iter()
            .filter(|&&k| qs.iter().any(|&q| sees(q, k)))
            .count() as u64
    };
    let row = (c.b * c.hkv * c.d) as u64;
    let el = c.dtype.size_in_bytes() as u64;
    // The planner: the busiest rank's bytes, forward and backward (unless the plan follows
    // the documents, which the planner does not know).
    let planned = planned_traffic(c)?;
    let most = |f: &dyn Fn(&RankOut) -> u64| ranks.iter().map(f).max().unwrap_or(0);
    let counted = (most(&|ro| ro.fwd.bytes_sent()), most(&|ro| ro.bwd_sent));
    let doc_plan = c.cfg.layout == SeqLayout::DocZigzag && c.attn_mask().doc_ids().is_some();
    if !doc_plan && counted != (planned.forward.total(), planned.backward.total()) {
        return Err(format!(
            "planner traffic {planned:?}, counted busiest (fwd, bwd) {counted:?}"
        ));
    }
    for ro in ranks {
        let i = ro.coords.0;
        let sent: u64 = (0..r).filter(|&j| j != i).map(|j| rows(i, j)).sum();
        let received: u64 = (0..r).filter(|&j| j != i).map(|j| rows(j, i)).sum();
        let fwd = 2 * sent * row * el;
        let got = (
            ro.fwd.bytes_sent(),
            ro.bwd_sent,
            ro.bwd_p2p,
            ro.fwd.get(OpKind::Exchange).calls,
            ro.bwd_exchanges,
        );
        let bwd = fwd + 2 * received * row * 4;
        let want = (fwd, bwd, bwd, 1, 2);
        if got != want {
            return Err(format!(
                "ring rank {i}: (fwd, bwd, bwd p2p, fwd exchanges, bwd exchanges) = {got:?}, \
                 expected {want:?}"
            ));
        }
    }
    Ok(())
}

fn run_all(cases: &[Case]) {
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        if let Err(e) = check(c, 1000 + i as u64) {
            failures.push(format!(
                "{} {}x{} {} {:?} window {:?} b={} hq={} hkv={}: {e}",
                c.cfg.strategy,
                c.cfg.ulysses,
                c.cfg.ring,
                c.cfg.layout,
                c.mask,
                c.window,
                c.b,
                c.hq,
                c.hkv
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn ring_matches_single_device() {
    let mut cases = Vec::new();
    for p in [2, 4, 8] {
        for layout in SeqLayout::ALL {
            let cfg = SpConfig::new(Strategy::Ring, 1, p).with_layout(layout);
            cases.push(Case::new(cfg.clone(), 4, 2, M::Causal));
            cases.push(Case::new(cfg.clone(), 4, 4, M::Full).batch(2));
            cases.push(Case::new(cfg.clone(), 4, 1, M::Docs));
            cases.push(Case::new(cfg.clone(), 4, 4, M::Docs).no_lse());
            if p == 4 {
                cases.push(Case::new(cfg, 4, 2, M::DocsFull));
            }
        }
    }
    run_all(&cases);
}

#[test]
fn ulysses_matches_single_device() {
    let mut cases = Vec::new();
    for (p, hq, hkv) in [
        (2, 8, 8),
        (2, 8, 4),
        (2, 8, 1),
        (4, 8, 8),
        (4, 8, 2),
        (4, 8, 1),
        (4, 4, 4),
    ] {
        let cfg = SpConfig::new(Strategy::Ulysses, p, 1);
        cases.push(Case::new(cfg.clone(), hq, hkv, M::Causal));
        cases.push(Case::new(cfg.clone(), hq, hkv, M::Docs).no_lse());
        cases.push(Case::new(cfg, hq, hkv, M::Full).batch(2));
    }
    cases.push(Case::new(
        SpConfig::new(Strategy::Ulysses, 4, 1),
        8,
        2,
        M::DocsFull,
    ));
    run_all(&cases);
}

/// Any Ulysses degree that divides the query heads works, whatever the GQA ratio: each rank
/// gets exactly the kv heads its query heads use (replicated, gradients summed). Real cases:
/// Qwen2.5-7B's 28 q / 4 kv heads on 7 ranks, 6 / 2 on 3, 12 / 3 on 2 and 4, 24 / 8 on 12;
/// also under USP and the double ring, whose head-parallel part is the same.
#[test]
fn ulysses_takes_any_gqa_ratio() {
    let mut cases = Vec::new();
    for (p, hq, hkv, s) in [
        (7, 28, 4, 56),
        (3, 6, 2, 48),
        (2, 12, 3, 64),
        (4, 12, 3, 64),
        (12, 24, 8, 48),
    ] {
        let cfg = SpConfig::new(Strategy::Ulysses, p, 1);
        cases.push(Case::new(cfg.clone(), hq, hkv, M::Causal).seq(s));
        cases.push(Case::new(cfg, hq, hkv, M::Docs).seq(s).batch(2));
    }
    let usp = SpConfig::new(Strategy::Usp, 3, 2);
    cases.push(Case::new(usp, 6, 2, M::Causal).seq(48));
    let dr = SpConfig::new(Strategy::DoubleRing, 3, 2).with_inner_ring(2);
    cases.push(Case::new(dr, 6, 2, M::Docs).seq(48));
    run_all(&cases);
}

#[test]
fn usp_matches_single_device() {
    let mut cases = Vec::new();
    for (u, r) in [(2, 2), (2, 4), (4, 2)] {
        let cfg = SpConfig::new(Strategy::Usp, u, r);
        cases.push(Case::new(cfg.clone(), 8, 2, M::Causal));
        cases.push(Case::new(cfg.clone(), 8, 8, M::Full).batch(2));
        cases.push(Case::new(cfg.clone(), 8, 4, M::Docs));
        cases.push(Case::new(cfg.clone(), 8, 8, M::Causal).no_lse());
        for layout in [SeqLayout::Contiguous, SeqLayout::Striped] {
            cases.push(Case::new(cfg.clone().with_layout(layout), 8, 2, M::Docs));
        }
    }
    // Ring-inner placement (the ring group's ranks are neighbours).
    let cf = SpConfig::new(Strategy::Usp, 2, 2).with_placement(Placement::ContextFirst);
    cases.push(Case::new(cf.clone(), 8, 1, M::Causal));
    cases.push(Case::new(cf, 4, 4, M::DocsFull));
    run_all(&cases);
}

#[test]
fn allgather_cp_matches_single_device() {
    let mut cases = Vec::new();
    for cp in [2, 4, 8] {
        let cfg = SpConfig::new(Strategy::AllGather, 1, cp);
        cases.push(Case::new(cfg.clone(), 4, 2, M::Causal));
        cases.push(Case::new(cfg.clone(), 4, 4, M::Docs).batch(2));
        cases.push(Case::new(cfg.clone(), 4, 1, M::Full).no_lse());
        cases.push(Case::new(
            cfg.with_layout(SeqLayout::Contiguous),
            4,
            2,
            M::Docs,
        ));
    }
    cases.push(Case::new(
        SpConfig::new(Strategy::AllGather, 1, 4),
        4,
        2,
        M::DocsFull,
    ));
    run_all(&cases);
}

/// Sliding windows under every strategy, every mask kind, GQA: out, lse and the gradients equal
/// one device; windows of 1 (a row sees itself only), shorter than a chunk, longer than a
/// rank's tokens and longer than the sequence. All-gather CP gathers only the keys the windows
/// reach (its bytes checked by brute force), so its traffic falls with the window; the ring
/// and USP send kv only to the steps some rank needs (likewise checked).
#[test]
fn sliding_windows_match_single_device_under_every_strategy() {
    let mut cases = Vec::new();
    for cfg in [
        SpConfig::new(Strategy::AllGather, 1, 4),
        SpConfig::new(Strategy::AllGather, 1, 4).with_layout(SeqLayout::Contiguous),
        SpConfig::new(Strategy::AllGather, 1, 4).with_layout(SeqLayout::Striped),
        SpConfig::new(Strategy::AllGather, 1, 2),
        SpConfig::new(Strategy::AllGather, 1, 8),
        SpConfig::new(Strategy::Ring, 1, 4),
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Contiguous),
        SpConfig::new(Strategy::Ulysses, 2, 1),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(2),
    ] {
        for (mask, w) in [
            (M::Causal, 1),
            (M::Causal, 5),
            (M::Docs, 9),
            (M::Full, 6),
            (M::DocsFull, 20),
            (M::Causal, 200),
        ] {
            cases.push(Case::new(cfg.clone(), 4, 2, mask).window(w));
        }
    }
    let mut doc_zigzag = Case::new(
        SpConfig::new(Strategy::AllGather, 1, 4).with_layout(SeqLayout::DocZigzag),
        4,
        1,
        M::Docs,
    )
    .window(7)
    .batch(2);
    doc_zigzag.with_lse = false;
    cases.push(doc_zigzag);
    run_all(&cases);
}

/// Logit soft-capping (Gemma 2's `tanh(s / c) · c`) under every strategy, with and without a
/// sliding window, every mask kind (documents included), GQA: out, lse and the gradients (the
/// backward's `1 - tanh²` factor) equal one device within 1e-5, and the traffic is the uncapped
/// run's. The cap (0.7) changes the scores of these inputs: the capped reference differs from
/// the uncapped one by more than 1e-2.
#[test]
fn soft_capped_scores_match_single_device_under_every_strategy() {
    let probe = Case::new(SpConfig::new(Strategy::Ring, 1, 4), 4, 2, M::Causal);
    let x = inputs(&probe, 3);
    let (plain, capped) = (
        reference(&probe, &x),
        reference(&probe.clone().softcap(0.7), &x),
    );
    assert!(
        rel_err(&capped[0], &plain[0]) > 1e-2,
        "the cap changes nothing"
    );
    let mut cases = Vec::new();
    for cfg in [
        SpConfig::new(Strategy::Ring, 1, 4),
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Contiguous),
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Striped),
        SpConfig::new(Strategy::Ulysses, 2, 1),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(2),
        SpConfig::new(Strategy::AllGather, 1, 4),
    ] {
        for mask in [M::Causal, M::Docs, M::Full, M::DocsFull] {
            cases.push(Case::new(cfg.clone(), 4, 2, mask).softcap(0.7));
            cases.push(Case::new(cfg.clone(), 4, 2, mask).softcap(0.7).window(9));
        }
    }
    run_all(&cases);
}

/// Ring attention under sliding windows, contiguous layout on 2, 4 and 8 ranks (and zigzag,
/// striped and USP's ring): windows of 1 key, shorter than a chunk, spanning several chunks and
/// longer than the sequence, causal, bidirectional and document masks, GQA. out, lse and the
/// gradients equal one device, and each rank sends exactly the bytes of the ring steps some
/// rank needs (by brute force over the positions, [`needed_ring_steps`]); the double ring under
/// a window too (2D with Ulysses 2, and inner rings of 4 on 8 ranks).
#[test]
fn ring_windows_send_only_the_steps_some_rank_needs() {
    let mut cases = Vec::new();
    for p in [2, 4, 8] {
        let cfg = SpConfig::new(Strategy::Ring, 1, p).with_layout(SeqLayout::Contiguous);
        let chunk = 64 / p;
        for (mask, w, hkv) in [
            (M::Causal, 1, 2),
            (M::Causal, chunk / 2, 1),
            (M::Causal, chunk + 1, 2),
            (M::Causal, chunk + 2, 4),
            (M::Causal, 2 * chunk + 3, 2),
            (M::Docs, chunk / 2 + 1, 1),
            (M::Docs, 3 * chunk, 2),
            (M::Full, 3, 2),
            (M::DocsFull, chunk + 5, 1),
            (M::Causal, 100, 2),
        ] {
            cases.push(Case::new(cfg.clone(), 4, hkv, mask).window(w));
        }
    }
    for layout in [SeqLayout::Zigzag, SeqLayout::Striped] {
        let cfg = SpConfig::new(Strategy::Ring, 1, 4).with_layout(layout);
        for (mask, w) in [(M::Causal, 1), (M::Causal, 3), (M::Docs, 9), (M::Full, 4)] {
            cases.push(Case::new(cfg.clone(), 4, 2, mask).window(w));
        }
    }
    let usp = SpConfig::new(Strategy::Usp, 2, 4).with_layout(SeqLayout::Contiguous);
    cases.push(Case::new(usp.clone(), 8, 2, M::Causal).window(5));
    cases.push(Case::new(usp, 8, 4, M::Docs).window(20).no_lse());
    // The double ring (LoongTrain 2D, inner rings of 2) sends what the ring sends.
    for layout in [SeqLayout::Contiguous, SeqLayout::Zigzag] {
        let dr = SpConfig::new(Strategy::DoubleRing, 2, 4)
            .with_inner_ring(2)
            .with_layout(layout);
        cases.push(Case::new(dr.clone(), 8, 2, M::Causal).window(5));
        cases.push(Case::new(dr, 8, 4, M::Docs).window(20).no_lse());
    }
    let dr8 = SpConfig::new(Strategy::DoubleRing, 1, 8)
        .with_inner_ring(4)
        .with_layout(SeqLayout::Contiguous);
    cases.push(Case::new(dr8.clone(), 4, 2, M::Causal).window(3));
    cases.push(Case::new(dr8, 4, 2, M::Causal).window(100));
    run_all(&cases);
}

/// At 64 tokens on 4 ranks (contiguous, chunks of 16), the forward's sends fall with the window:
/// a window of 4 needs the previous rank's block only (1 exchange of k and v instead of 3), a
/// window of 1 nothing at all; zigzag jumps over the middle step. Backward: the kv exchange and
/// the accumulator's, then the accumulator home.
#[test]
fn ring_traffic_falls_with_the_window() {
    let sent = |layout: SeqLayout, w: Option<usize>| -> (u64, u64, u64, u64) {
        let cfg = SpConfig::new(Strategy::Ring, 1, 4).with_layout(layout);
        let mut c = Case::new(cfg, 4, 2, M::Causal);
        c.window = w;
        let x = inputs(&c, 7);
        let ranks = run_ranks(&c, &x).unwrap();
        let r = &ranks[1];
        for o in &ranks {
            assert_eq!(o.fwd.bytes_sent(), r.fwd.bytes_sent(), "{layout} {w:?}");
            assert_eq!(o.bwd_sent, r.bwd_sent, "{layout} {w:?}");
        }
        (
            r.fwd.bytes_sent(),
            r.fwd.get(OpKind::Exchange).calls,
            r.bwd_sent,
            r.bwd_exchanges,
        )
    };
    // K = 16 tokens x 2 kv heads x 32 x 4 bytes.
    let k = 16 * 2 * 32 * 4;
    let c = SeqLayout::Contiguous;
    assert_eq!(sent(c, None), (3 * 2 * k, 3, 3 * 2 * k + 4 * 2 * k, 7));
    assert_eq!(sent(c, Some(4)), (2 * k, 1, 2 * k + 2 * 2 * k, 3));
    assert_eq!(sent(c, Some(17)), (2 * k, 1, 2 * k + 2 * 2 * k, 3));
    assert_eq!(sent(c, Some(18)), (2 * 2 * k, 2, 2 * 2 * k + 3 * 2 * k, 5));
    assert_eq!(sent(c, Some(1)), (0, 0, 0, 0));
    // Zigzag (chunks of 8): the previous rank's block, then a jump to the next rank's.
    assert_eq!(
        sent(SeqLayout::Zigzag, Some(4)),
        (2 * 2 * k, 2, 2 * 2 * k + 3 * 2 * k, 5)
    );
}

/// The traffic of windowed all-gather CP falls with the window: at 64 tokens on 4 ranks, a
/// window of 4 moves under a third of the full all-gather's bytes, and a window as long as the
/// sequence all of them.
#[test]
fn allgather_cp_traffic_falls_with_the_window() {
    let sent = |w: Option<usize>| -> u64 {
        let mut c = Case::new(SpConfig::new(Strategy::AllGather, 1, 4), 4, 2, M::Causal);
        c.window = w;
        let x = inputs(&c, 7);
        let ranks = run_ranks(&c, &x).unwrap();
        ranks.iter().map(|r| r.fwd.bytes_sent()).sum()
    };
    let full = sent(None);
    assert!(full > 0);
    let small = sent(Some(4));
    assert!(3 * small < full, "window 4: {small} bytes against {full}");
    // A window longer than the sequence reaches every key but each rank's first keys' zigzag
    // partner: causal keys after every query of a rank are never sent.
    let whole = sent(Some(64));
    assert!(
        small < whole && whole <= full,
        "{small} < {whole} <= {full}"
    );
}

#[test]
fn bf16_runs_every_strategy() {
    let mut cases = Vec::new();
    for cfg in [
        SpConfig::new(Strategy::Ring, 1, 4),
        SpConfig::new(Strategy::Ulysses, 4, 1),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::AllGather, 1, 4),
    ] {
        let mut c = Case::new(cfg, 8, 2, M::Docs);
        c.dtype = DType::BF16;
        cases.push(c);
    }
    run_all(&cases);
}

/// A NaN in one key poisons exactly the rows that may attend it under every strategy, as on one
/// device (and as PyTorch's softmax): out and lse NaN at the same places as the single-device
/// result, which has them where the mask says (every row of the key's q heads in its batch
/// without a mask, the rows at or after it with the causal one), every other entry within 1e-5,
/// the query gradient of every poisoned row NaN, and the other batch's gradients within 1e-5.
/// Before the kernels kept NaN scores, a NaN key dropped out of its rows' softmax and the
/// rows stayed finite: a NaN in a key projection gave a finite loss.
#[test]
fn a_nan_key_poisons_the_same_rows_under_every_strategy() {
    const AT: usize = 40;
    let mut failures = Vec::new();
    let cfgs = [
        SpConfig::new(Strategy::Ring, 1, 4),
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Contiguous),
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Striped),
        SpConfig::new(Strategy::Ulysses, 4, 1),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(2),
        SpConfig::new(Strategy::StarTrail, 1, 4).with_team(2),
        SpConfig::new(Strategy::AllGather, 1, 4),
    ];
    for cfg in cfgs {
        for mask in [M::Causal, M::Full] {
            let c = Case::new(cfg.clone(), 4, 2, mask).batch(2);
            let mut x = inputs(&c, 77);
            let mut k: Vec<f32> = x.k.flatten_all().and_then(|t| t.to_vec1()).unwrap();
            k[(AT * c.hkv) * c.d + 3] = f32::NAN; // batch 0, key AT, kv head 0
            x.k = Tensor::from_vec(k, x.k.shape(), &Device::Cpu).unwrap();
            let refs = reference(&c, &x);
            let name = format!("{} {:?} {:?}", cfg.strategy, cfg.layout, mask);
            let got = match run_ranks(&c, &x) {
                Ok(r) => r,
                Err(e) => {
                    failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            let plan = c.cfg.plan_for(c.s, &c.attn_mask()).unwrap();
            let mut ordered: Vec<Option<&RankOut>> = vec![None; got.len()];
            for ro in &got {
                ordered[plan.shard_index(ro.coords.0, ro.coords.1)] = Some(ro);
            }
            let global = |i: usize| -> Vec<f64> {
                let dim = if i == 1 { 2 } else { 1 };
                let parts: Vec<Tensor> = ordered.iter().map(|r| r.unwrap().t[i].clone()).collect();
                testkit::values(&plan.unshard(&parts, dim).unwrap())
            };
            let want_nan =
                |b: usize, s: usize, h: usize| b == 0 && h < 2 && (mask == M::Full || s >= AT);
            // The reference has its NaNs where the mask says.
            let (rl, ro) = (testkit::values(&refs[1]), testkit::values(&refs[0]));
            let lse_at = |b: usize, h: usize, s: usize| (b * c.hq + h) * c.s + s;
            let row_at = |b: usize, s: usize, h: usize| ((b * c.s + s) * c.hq + h) * c.d;
            for b in 0..2 {
                for h in 0..c.hq {
                    for s in 0..c.s {
                        let (l, o) = (rl[lse_at(b, h, s)], ro[row_at(b, s, h)]);
                        assert_eq!(l.is_nan(), want_nan(b, s, h), "reference lse {b} {h} {s}");
                        assert_eq!(o.is_nan(), want_nan(b, s, h), "reference out {b} {s} {h}");
                    }
                }
            }
            for (i, what) in [(0, "out"), (1, "lse")] {
                let (g, r) = (global(i), testkit::values(&refs[i]));
                let same_nans = g.iter().zip(&r).all(|(a, b)| a.is_nan() == b.is_nan());
                let finite =
                    |v: &[f64]| -> Vec<f64> { v.iter().copied().filter(|x| !x.is_nan()).collect() };
                let err = testkit::rel_err_floor(&finite(&g), &finite(&r), 1e-30);
                if !same_nans || err.is_nan() || err > TOL {
                    failures.push(format!(
                        "{name}: {what} NaNs same {same_nans}, error {err:e}"
                    ));
                }
            }
            let dq = global(2);
            let poisoned_dq = (0..c.s).filter(|&s| want_nan(0, s, 0)).all(|s| {
                dq[row_at(0, s, 0)..row_at(0, s, 0) + c.d]
                    .iter()
                    .all(|x| x.is_nan())
            });
            if !poisoned_dq {
                failures.push(format!("{name}: a poisoned row's dq is not NaN"));
            }
            for (i, what, h) in [(2, "dq", c.hq), (3, "dk", c.hkv), (4, "dv", c.hkv)] {
                let (g, r) = (global(i), testkit::values(&refs[i]));
                let half = c.s * h * c.d;
                let err = testkit::rel_err_floor(&g[half..], &r[half..], 1e-30);
                if err.is_nan() || err > TOL {
                    failures.push(format!("{name}: {what} of the clean batch, error {err:e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every rank fails with the same clear error, and nothing was sent.
fn expect_error(
    cfg: &SpConfig,
    q: (usize, usize, usize, usize),
    hkv: usize,
    mask: AttnMask,
    what: &str,
) {
    let world = LocalWorld::new(cfg.degree()).with_timeout(std::time::Duration::from_secs(30));
    let results = world.launch_each(|comm| -> Result<(), String> {
        let mesh = DeviceMesh::new(&cfg.mesh_config(), comm.clone()).map_err(e2s)?;
        let sp = SpAttention::new(cfg, &mesh).map_err(e2s)?;
        let (b, n, hq, d) = q;
        let qt = Tensor::zeros((b, n, hq, d), DType::F32, &Device::Cpu).map_err(e2s)?;
        let kt = Tensor::zeros((b, n, hkv, d), DType::F32, &Device::Cpu).map_err(e2s)?;
        comm.traffic().reset();
        let r = sp.attention(&qt, &kt, &kt, &AttnCall::new(mask.clone(), 1.0));
        let sent = comm.traffic().snapshot().bytes_sent();
        match r {
            Ok(_) => Err("no error".into()),
            Err(e @ (Error::InvalidArgument { .. } | Error::Layout(_))) if sent == 0 => {
                Err(format!("expected: {e}"))
            }
            Err(e) => Err(format!("unexpected error or traffic ({sent} bytes): {e}")),
        }
    });
    for (rank, r) in results.into_iter().enumerate() {
        let msg = match r {
            Err(e) => e.to_string(),
            Ok(()) => "ok".into(),
        };
        assert!(
            msg.contains("expected: ") && msg.contains(what),
            "rank {rank}: {msg} (wanted an error mentioning {what:?})"
        );
    }
}

#[test]
fn invalid_combinations_fail_before_communication() {
    // Zigzag on 4 ranks needs S % 8 == 0: 4 ranks x 9 tokens = 36.
    let ring = SpConfig::new(Strategy::Ring, 1, 4);
    expect_error(
        &ring,
        (1, 9, 4, 8),
        4,
        AttnMask::Causal,
        "not a positive multiple of the 8 chunks",
    );
    // Contiguous accepts it but the document ids must cover the sequence.
    let contig = ring.clone().with_layout(SeqLayout::Contiguous);
    expect_error(
        &contig,
        (1, 9, 4, 8),
        4,
        AttnMask::documents(vec![0u32; 35]),
        "35 ids",
    );
    // Ulysses: 6 query heads over 4 ranks (any kv head count is fine once the q heads divide).
    let uly = SpConfig::new(Strategy::Ulysses, 4, 1);
    expect_error(
        &uly,
        (1, 4, 6, 8),
        6,
        AttnMask::Full,
        "6 query heads do not divide",
    );
    // GQA group mismatch.
    expect_error(
        &ring,
        (1, 8, 4, 8),
        3,
        AttnMask::Full,
        "not a positive multiple of kv_heads",
    );
    // USP checks the Ulysses heads too.
    let usp = SpConfig::new(Strategy::Usp, 4, 2);
    expect_error(
        &usp,
        (1, 2, 6, 8),
        6,
        AttnMask::Causal,
        "6 query heads do not divide",
    );
}

#[test]
fn invalid_configurations_are_rejected() {
    let err = |cfg: SpConfig| -> String {
        LocalWorld::run(cfg.degree(), |comm| -> Result<(), String> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), comm).map_err(e2s)?;
            SpAttention::new(&cfg, &mesh).map(|_| ()).map_err(e2s)
        })
        .expect_err("configuration accepted")
        .to_string()
    };
    assert!(err(SpConfig::new(Strategy::Ring, 2, 2)).contains("use usp"));
    assert!(err(SpConfig::new(Strategy::Ulysses, 2, 2)).contains("use usp"));
    assert!(err(SpConfig::new(Strategy::DoubleRing, 1, 4).with_inner_ring(3)).contains("w = 3"));
    assert!(err(SpConfig::new(Strategy::StarTrail, 1, 4).with_team(4)).contains("C = 4"));
    // The config and the mesh must agree.
    let r = LocalWorld::run(4, |comm| -> Result<(), String> {
        let mesh = DeviceMesh::new(&SpConfig::new(Strategy::Usp, 2, 2).mesh_config(), comm)
            .map_err(e2s)?;
        SpAttention::new(&SpConfig::new(Strategy::Usp, 4, 1), &mesh)
            .map(|_| ())
            .map_err(e2s)
    });
    assert!(r.is_err());
}

#[test]
fn shard_gather_and_positions_follow_one_permutation() {
    let s = 32;
    for cfg in [
        SpConfig::new(Strategy::Ring, 1, 4).with_layout(SeqLayout::Striped),
        SpConfig::new(Strategy::Usp, 2, 2),
        SpConfig::new(Strategy::Usp, 2, 2).with_placement(Placement::ContextFirst),
    ] {
        let tokens = Tensor::arange(0u32, s as u32, &Device::Cpu)
            .unwrap()
            .reshape((1, s))
            .unwrap();
        let out = LocalWorld::run(cfg.degree(), |comm| -> Result<[Vec<u32>; 3], String> {
            let mesh = DeviceMesh::new(&cfg.mesh_config(), comm).map_err(e2s)?;
            let sp = SpAttention::new(&cfg, &mesh).map_err(e2s)?;
            let local = sp.shard(&tokens, 1).map_err(e2s)?;
            let back = sp.gather(&local, 1).map_err(e2s)?;
            Ok([
                local.flatten_all().and_then(|t| t.to_vec1()).map_err(e2s)?,
                sp.local_positions(s).map_err(e2s)?,
                back.flatten_all().and_then(|t| t.to_vec1()).map_err(e2s)?,
            ])
        })
        .unwrap();
        let mut seen = Vec::new();
        for [local, pos, back] in out {
            assert_eq!(local, pos, "positions follow the tokens ({cfg:?})");
            assert_eq!(back, (0..s as u32).collect::<Vec<_>>());
            seen.extend(local);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..s as u32).collect::<Vec<_>>());
    }
}

/// The backend-generic self-checks (also run under MPI by `examples/mpi_selftest.rs`) for every
/// strategy on 2, 4 and 8 local ranks, each with documents, causal and full masks and with GQA
/// and MHA: out, lse and the gradients of autograd, and the gradients of the explicit
/// `SequenceParallelAttention::backward`, against single-device flash-ring (1e-5 relative).
#[test]
fn selftest_cases_pass_on_local_worlds() {
    use candle_parallel::attention::selftest::{check_case, default_cases};
    for p in [2, 4, 8] {
        let cases = default_cases(p);
        let strategies: std::collections::BTreeSet<String> =
            cases.iter().map(|c| c.cfg.strategy.to_string()).collect();
        let want = if p >= 4 { 6 } else { 3 };
        assert!(strategies.len() >= want, "P = {p}: only {strategies:?}");
        for base in cases {
            let mut variants = vec![base.clone()];
            for mask in [AttnMask::Causal, AttnMask::Full] {
                let mut c = base.clone();
                c.mask = mask;
                variants.push(c);
            }
            let mut mha = base.clone();
            mha.kv_heads = mha.q_heads;
            variants.push(mha);
            for case in variants {
                let reports = LocalWorld::run(p, |comm| check_case(&comm, &case))
                    .unwrap_or_else(|e| panic!("{}: {e}", case.name()));
                for r in &reports {
                    assert!(r.fwd_bytes > 0 && r.bwd_bytes > 0, "{}", case.name());
                    assert!(
                        r.errors
                            .iter()
                            .chain(&r.explicit_bwd_errors)
                            .all(|e| *e <= 1e-5),
                        "{}: {r:?}",
                        case.name()
                    );
                }
            }
        }
    }
}
