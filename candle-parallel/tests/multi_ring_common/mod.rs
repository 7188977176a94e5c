//! Shared harness of `sp_double_ring.rs` and `sp_startrail.rs`: run one sequence-parallel
//! configuration on a local world, gather out, lse, dq, dk, dv to global order, compare them
//! with single-device flash-ring, and hand back each rank's traffic of the forward and of the
//! backward.

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, Var};
use candle_parallel::attention::{
    AttnCall, AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig,
};
use candle_parallel::comm::{LocalWorld, OpKind, TrafficSnapshot};
use candle_parallel::mesh::DeviceMesh;
use flash_ring::AttnSpec;
use flash_ring::MaskKind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const TOL: f64 = 1e-5;

/// The masks of the issue: full, causal, and documents (crossing shard borders, one of
/// length 1), causal or bidirectional inside documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskSel {
    Full,
    Causal,
    Docs,
    DocsFull,
    /// Causal documents all shorter than 8 tokens (`2·R` for 4 ring ranks): lengths 1 to 7
    /// in turn, the last one cut to fit.
    ShortDocs,
    /// One document over the whole window (a window cut from a document longer than it).
    OneDoc,
}

impl MaskSel {
    pub const ALL: [MaskSel; 4] = [
        MaskSel::Full,
        MaskSel::Causal,
        MaskSel::Docs,
        MaskSel::DocsFull,
    ];

    /// Document boundaries for `s` tokens: lengths 5, 1, 17, 17, 1 and the rest, so that
    /// documents cross every shard border of the layouts used and two have length 1.
    pub fn mask(self, s: usize) -> AttnMask {
        let cu = [0, 5, 6, 23, 40, 41, s];
        match self {
            MaskSel::Full => AttnMask::Full,
            MaskSel::Causal => AttnMask::Causal,
            MaskSel::Docs => AttnMask::from_cu_seqlens(&cu, MaskKind::Causal).unwrap(),
            MaskSel::DocsFull => AttnMask::from_cu_seqlens(&cu, MaskKind::Full).unwrap(),
            MaskSel::ShortDocs => {
                let mut cu = vec![0];
                for l in (1..=7).cycle() {
                    let end = (cu[cu.len() - 1] + l).min(s);
                    cu.push(end);
                    if end == s {
                        break;
                    }
                }
                AttnMask::from_cu_seqlens(&cu, MaskKind::Causal).unwrap()
            }
            MaskSel::OneDoc => AttnMask::documents(vec![0u32; s]),
        }
    }
}

/// One run: a configuration, a mask and global shapes `(1, s, hq, d)` / `(1, s, hkv, d)`.
#[derive(Debug, Clone)]
pub struct Case {
    pub cfg: SpConfig,
    pub mask: MaskSel,
    pub b: usize,
    pub s: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub dtype: DType,
    /// A sliding window of this many tokens on top of the mask.
    pub window: Option<usize>,
    /// Logit soft-capping `tanh(s / c) · c` of the scores.
    pub softcap: Option<f32>,
}

impl Case {
    pub fn new(cfg: SpConfig, mask: MaskSel, hq: usize, hkv: usize) -> Self {
        Self {
            cfg,
            mask,
            b: 1,
            s: 64,
            hq,
            hkv,
            d: 32,
            dtype: DType::F32,
            window: None,
            softcap: None,
        }
    }

    /// With a sliding window of `w` tokens and soft-cap `c`.
    pub fn with_window_and_softcap(mut self, w: Option<usize>, c: Option<f32>) -> Self {
        (self.window, self.softcap) = (w, c);
        self
    }

    /// The attention call of every rank: the mask, the scale, the window and the cap.
    pub fn call(&self) -> AttnCall {
        AttnCall::new(self.mask.mask(self.s), self.scale())
            .with_window(self.window)
            .with_softcap(self.softcap)
    }

    pub fn with_batch(mut self, b: usize) -> Self {
        self.b = b;
        self
    }

    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Bytes of one element of q, k, v.
    pub fn elem_bytes(&self) -> u64 {
        self.dtype.size_in_bytes() as u64
    }

    /// The tolerance of [`check_numerics`]: 1e-5 in f32, bf16 rounding otherwise.
    pub fn tol(&self) -> f64 {
        if self.dtype == DType::F32 {
            TOL
        } else {
            2e-2
        }
    }

    pub fn with_layout(mut self, layout: SeqLayout) -> Self {
        self.cfg = self.cfg.with_layout(layout);
        self
    }

    pub fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    pub fn world(&self) -> usize {
        self.cfg.degree()
    }

    /// Tokens per rank.
    pub fn n(&self) -> usize {
        self.s / self.world()
    }
}

/// What one rank returns.
pub struct RankOut {
    /// `(ring_rank, ulysses_rank)`.
    pub coords: (usize, usize),
    pub out: Tensor,
    pub lse: Tensor,
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    pub fwd: TrafficSnapshot,
    pub bwd: TrafficSnapshot,
}

/// Global inputs of a case, fixed by `seed`.
pub struct Inputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub dout: Tensor,
}

fn rand_t(rng: &mut StdRng, dims: (usize, usize, usize, usize), dtype: DType) -> Tensor {
    let n = dims.0 * dims.1 * dims.2 * dims.3;
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

pub fn inputs(case: &Case, seed: u64) -> Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    Inputs {
        q: rand_t(&mut rng, (case.b, case.s, case.hq, case.d), case.dtype),
        k: rand_t(&mut rng, (case.b, case.s, case.hkv, case.d), case.dtype),
        v: rand_t(&mut rng, (case.b, case.s, case.hkv, case.d), case.dtype),
        dout: rand_t(&mut rng, (case.b, case.s, case.hq, case.d), case.dtype),
    }
}

/// Runs the case on a local world: every rank shards the inputs, runs attention with lse,
/// backpropagates `sum(out * dout)`, and returns its results and traffic.
pub fn run(case: &Case, x: &Inputs) -> Vec<RankOut> {
    let mask = case.mask.mask(case.s);
    LocalWorld::run(case.world(), |world| -> candle_parallel::Result<RankOut> {
        let mesh = DeviceMesh::new(&case.cfg.mesh_config(), world.clone())?;
        let sp = SpAttention::new(&case.cfg, &mesh)?;
        let shard = |t: &Tensor| sp.shard_for(t, 1, &mask);
        let q = Var::from_tensor(&shard(&x.q)?)?;
        let k = Var::from_tensor(&shard(&x.k)?)?;
        let v = Var::from_tensor(&shard(&x.v)?)?;
        let dout = shard(&x.dout)?;
        let traffic = world.traffic();
        traffic.reset();
        let (out, lse) =
            sp.attention_with_lse(q.as_tensor(), k.as_tensor(), v.as_tensor(), &case.call())?;
        let fwd = traffic.snapshot();
        traffic.reset();
        let grads = (&out * &dout)?.sum_all()?.backward()?;
        let bwd = traffic.snapshot();
        let grad = |var: &Var, name: &str| {
            grads.get(var.as_tensor()).cloned().ok_or_else(|| {
                candle_parallel::Error::Layout(format!(
                    "rank {}: no gradient for {name}",
                    world.rank()
                ))
            })
        };
        Ok(RankOut {
            coords: sp.shard_coords(),
            out,
            lse,
            dq: grad(&q, "q")?,
            dk: grad(&k, "k")?,
            dv: grad(&v, "v")?,
            fwd,
            bwd,
        })
    })
    .unwrap_or_else(|e| panic!("{case:?}: {e}"))
}

/// Single-device flash-ring in f32 (on the same, possibly bf16-rounded, inputs):
/// `(out, lse, dq, dk, dv)` of the whole sequence.
pub fn reference(case: &Case, x: &Inputs) -> [Tensor; 5] {
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let x = &Inputs {
        q: f(&x.q),
        k: f(&x.k),
        v: f(&x.v),
        dout: f(&x.dout),
    };
    let mut spec: AttnSpec = case.mask.mask(case.s).spec(
        case.scale(),
        flash_ring::Positions::range(0, case.s),
        flash_ring::Positions::range(0, case.s),
    );
    if let Some(w) = case.window {
        spec = spec.with_window(w);
    }
    if let Some(c) = case.softcap {
        spec = spec.with_softcap(c);
    }
    let (out, lse) = flash_ring::flash_fwd(&x.q, &x.k, &x.v, &spec).unwrap();
    let (dq, dk, dv) = flash_ring::flash_bwd(&x.q, &x.k, &x.v, &out, &lse, &x.dout, &spec).unwrap();
    [out, lse, dq, dk, dv]
}

/// `max |a - b| / max |b|`, with equal infinities counted as equal.
pub use testkit::rel_err;

/// Gathers every rank's `pick` to global order (sequence at `dim`).
pub fn unshard(
    case: &Case,
    ranks: &[RankOut],
    dim: usize,
    pick: impl Fn(&RankOut) -> &Tensor,
) -> Tensor {
    let plan = case.cfg.plan_for(case.s, &case.mask.mask(case.s)).unwrap();
    let mut parts: Vec<Option<Tensor>> = vec![None; ranks.len()];
    for r in ranks {
        let i = plan.shard_index(r.coords.0, r.coords.1);
        parts[i] = Some(pick(r).clone());
    }
    let parts: Vec<Tensor> = parts.into_iter().map(|p| p.expect("every shard")).collect();
    plan.unshard(&parts, dim).unwrap()
}

/// Asserts out, lse, dq, dk, dv (gathered) equal the single-device result within
/// [`Case::tol`] ([`TOL`] in f32).
pub fn check_numerics(case: &Case, x: &Inputs, ranks: &[RankOut]) {
    let [out, lse, dq, dk, dv] = reference(case, x);
    let got = [
        ("out", unshard(case, ranks, 1, |r| &r.out), out),
        ("lse", unshard(case, ranks, 2, |r| &r.lse), lse),
        ("dq", unshard(case, ranks, 1, |r| &r.dq), dq),
        ("dk", unshard(case, ranks, 1, |r| &r.dk), dk),
        ("dv", unshard(case, ranks, 1, |r| &r.dv), dv),
    ];
    for (name, g, want) in got {
        assert_eq!(g.dims(), want.dims(), "{name} shape, {case:?}");
        let e = rel_err(&g, &want);
        let tol = case.tol();
        assert!(e <= tol, "{name}: relative error {e:e} > {tol:e}, {case:?}");
        assert_eq!(
            g.dtype(),
            if name == "lse" {
                DType::F32
            } else {
                case.dtype
            },
            "{name}"
        );
    }
}

/// Bytes sent by one kind.
pub fn sent(t: &TrafficSnapshot, kind: OpKind) -> u64 {
    t.get(kind).bytes_sent
}

/// Asserts the exact bytes sent by each kind (every other kind sends nothing).
pub fn assert_sent(t: &TrafficSnapshot, expected: &[(OpKind, u64)], what: &str) {
    let mut total = 0;
    for &(kind, bytes) in expected {
        assert_eq!(sent(t, kind), bytes, "{what}: {} bytes sent", kind.name());
        total += bytes;
    }
    assert_eq!(
        t.bytes_sent(),
        total,
        "{what}: total bytes sent ({:?})",
        t.ops
    );
}

/// Runs `case` on inputs from `seed`, checks every rank against the single-device reference
/// and the traffic with the strategy's own `check_traffic`; returns the ranks' results.
pub fn run_checked(
    case: &Case,
    seed: u64,
    check_traffic: impl Fn(&Case, &[RankOut]),
) -> Vec<RankOut> {
    let x = inputs(case, seed);
    let ranks = run(case, &x);
    check_numerics(case, &x, &ranks);
    check_traffic(case, &ranks);
    ranks
}

/// Building the strategy of `cfg` fails on each of `ranks` ranks with a message containing
/// `needle`, before any byte is sent.
pub fn assert_build_rejected(cfg: &SpConfig, ranks: usize, needle: &str) {
    assert_rejected(cfg, ranks, needle, |_| Ok(()));
}

/// A causal call over `seq` tokens (the global length) with `hq` query and `hkv` kv heads of
/// width 8 fails on each of `ranks` ranks with a message containing `needle`, before any byte
/// is sent.
pub fn assert_call_rejected(
    cfg: &SpConfig,
    ranks: usize,
    (seq, hq, hkv): (usize, usize, usize),
    needle: &str,
) {
    assert_rejected(cfg, ranks, needle, |sp| {
        let n = seq / ranks;
        let q = Tensor::zeros((1, n, hq, 8), DType::F32, &Device::Cpu)?;
        let kv = Tensor::zeros((1, n, hkv, 8), DType::F32, &Device::Cpu)?;
        sp.attention(&q, &kv, &kv, &AttnCall::new(AttnMask::Causal, 1.0))
            .map(|_| ())
    });
}

fn assert_rejected(
    cfg: &SpConfig,
    ranks: usize,
    needle: &str,
    call: impl Fn(&SpAttention) -> candle_parallel::Result<()> + Sync,
) {
    let errs = LocalWorld::new(ranks).launch_each(|world| -> candle_parallel::Result<()> {
        let mesh = DeviceMesh::new(&cfg.mesh_config(), world.clone())?;
        world.traffic().reset();
        let res = SpAttention::new(cfg, &mesh).and_then(|sp| call(&sp));
        assert_eq!(world.traffic().snapshot().bytes_sent(), 0, "{needle}");
        res
    });
    for e in errs {
        let msg = e.expect_err(needle).to_string();
        assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
    }
}

/// What the planner's cost model says the busiest rank of `case` sends (the strategies return
/// the lse here, so Ulysses' all-to-alls carry it).
pub fn planned_traffic(case: &Case) -> candle_parallel::planner::traffic::AttentionTraffic {
    use candle_parallel::planner::traffic::{attention_traffic, AttnShape};
    attention_traffic(
        &case.cfg,
        &AttnShape {
            batch: case.b,
            seq: case.s,
            heads: case.hq,
            kv_heads: case.hkv,
            head_dim: case.d,
            elem_bytes: case.elem_bytes() as usize,
            with_lse: true,
        },
    )
    .unwrap()
}
