//! Backend-generic self-checks of sequence-parallel attention (test support).
//!
//! [`check_case`] runs on every rank of any world communicator (local threads or MPI
//! processes): each rank regenerates the same global q, k, v and output weight `g` from a seed,
//! computes single-device flash-ring on the whole sequence (out, lse, and the gradients of
//! `Σ out ⊙ g`), runs the strategy on its shard, backpropagates `Σ out_local ⊙ g_local`, and
//! compares its shards of out, lse, dq, dk, dv with the reference's, relative to the largest
//! magnitude of the GLOBAL reference (so the worst rank's error is the global
//! `max|a - b| / max|ref|`). A missing gradient is an error. The strategy's explicit
//! [`SequenceParallelAttention::backward`] (from q, k, v, out, lse and the output gradient, as
//! selective recomputation uses it) must give the same dq, dk, dv. [`default_cases`] gives one
//! configuration per strategy that fits a world size; the MPI self-test runs them.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use flash_ring::Positions;

use super::block::kernel_err;
use super::config::{SeqLayout, SpConfig, Strategy};
use super::mask::AttnMask;
use super::{AttnCall, Saved, SequenceParallelAttention, SpAttention};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;

/// One self-check: a strategy configuration and the shapes and mask of a global batch.
#[derive(Debug, Clone)]
pub struct SelfTestCase {
    pub cfg: SpConfig,
    pub batch: usize,
    pub seq_len: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The mask of the global sequence (documents of length `seq_len`).
    pub mask: AttnMask,
    pub seed: u64,
    /// Largest accepted `max|a - b| / max|ref|` (f32: 1e-5).
    pub tol: f32,
}

impl SelfTestCase {
    /// Batch 1, 64 tokens, 8 q heads, 2 kv heads, head_dim 32, causal documents of lengths
    /// 5, 1, 29, 14, 15 (crossing shard borders, one of length 1).
    pub fn small(cfg: SpConfig) -> Self {
        Self {
            cfg,
            batch: 1,
            seq_len: 64,
            q_heads: 8,
            kv_heads: 2,
            head_dim: 32,
            mask: AttnMask::Documents(documents(64)),
            seed: 0x5EED,
            tol: 1e-5,
        }
    }

    /// A short description for reports.
    pub fn name(&self) -> String {
        let mask = match &self.mask {
            AttnMask::Full => "full",
            AttnMask::Causal => "causal",
            AttnMask::Documents(_) => "documents",
            AttnMask::DocumentsFull(_) => "documents-full",
        };
        let sub = match self.cfg.strategy {
            Strategy::DoubleRing => format!(" (inner rings of {})", self.cfg.inner_ring),
            Strategy::StarTrail => format!(" (teams of {})", self.cfg.team),
            _ => String::new(),
        };
        format!(
            "{} ulysses {} x ring {}{sub} {} {mask} hq {} hkv {}",
            self.cfg.strategy,
            self.cfg.ulysses,
            self.cfg.ring,
            self.cfg.layout,
            self.q_heads,
            self.kv_heads
        )
    }
}

/// Document ids `[0,5) [5,6) [6,S/2+3) [S/2+3,3S/4+1) [3S/4+1,S)` for `S >= 16`.
pub fn documents(seq_len: usize) -> Arc<[u32]> {
    let s = seq_len;
    let cu = [0, 5, 6, s / 2 + 3, 3 * s / 4 + 1, s];
    let mut ids = vec![0u32; s];
    for (doc, w) in cu.windows(2).enumerate() {
        for id in ids.iter_mut().take(w[1].min(s)).skip(w[0]) {
            *id = doc as u32;
        }
    }
    ids.into()
}

/// One configuration per strategy that runs on `world_size` ranks (2 or more): ring (zigzag),
/// Ulysses (with kv replication when the degree exceeds 2), USP and the 2D strategies on
/// square-ish grids, and all-gather CP.
pub fn default_cases(world_size: usize) -> Vec<SelfTestCase> {
    let p = world_size;
    let mut cfgs = vec![
        SpConfig::new(Strategy::Ring, 1, p).with_layout(SeqLayout::Zigzag),
        SpConfig::new(Strategy::AllGather, 1, p),
    ];
    if 8usize.is_multiple_of(p) {
        cfgs.push(SpConfig::new(Strategy::Ulysses, p, 1));
    }
    if p.is_multiple_of(2) && p >= 4 {
        cfgs.push(SpConfig::new(Strategy::Usp, 2, p / 2));
        cfgs.push(SpConfig::new(Strategy::DoubleRing, 2, p / 2).with_inner_ring(p / 4));
    }
    if p.is_multiple_of(4) {
        cfgs.push(SpConfig::new(Strategy::StarTrail, 1, p).with_team(2));
    }
    // A layout that cannot cut the small case's 64 tokens (zigzag on 3 ring ranks needs a
    // multiple of 6) is left out, as a strategy that does not fit the world is.
    cfgs.into_iter()
        .filter(|c| c.validate().is_ok() && c.plan(64).is_ok())
        .map(SelfTestCase::small)
        .collect()
}

/// What one rank measured in [`check_case`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelfTestReport {
    /// Relative errors of out, lse, dq, dk, dv on this rank's shard.
    pub errors: [f32; 5],
    /// Relative errors of dq, dk, dv from the explicit backward.
    pub explicit_bwd_errors: [f32; 3],
    /// Bytes this rank sent in forward (`attention_with_lse`) and in backward.
    pub fwd_bytes: u64,
    pub bwd_bytes: u64,
}

/// Deterministic values in `[-1, 1)` (splitmix64), identical on every rank and process.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(seed: u64, dims: (usize, usize, usize, usize)) -> Result<Tensor> {
    let n = dims.0 * dims.1 * dims.2 * dims.3;
    Ok(Tensor::from_vec(values(seed, n), dims, &Device::Cpu)?)
}

fn fail(msg: String) -> Error {
    Error::invalid("sp attention selftest", msg)
}

/// Collective over `world` (whose size must be `case.cfg.degree()`): builds the mesh and the
/// strategy, runs forward and backward on this rank's shard and compares with single-device
/// flash-ring. Returns this rank's errors and traffic, or an error naming the first quantity
/// over tolerance.
pub fn check_case(world: &Comm, case: &SelfTestCase) -> Result<SelfTestReport> {
    let c = case;
    let mesh = DeviceMesh::new(&c.cfg.mesh_config(), world.clone())?;
    let sp = SpAttention::new(&c.cfg, &mesh)?;
    let (b, s, d) = (c.batch, c.seq_len, c.head_dim);
    let q = tensor(c.seed, (b, s, c.q_heads, d))?;
    let k = tensor(c.seed + 1, (b, s, c.kv_heads, d))?;
    let v = tensor(c.seed + 2, (b, s, c.kv_heads, d))?;
    let g = tensor(c.seed + 3, (b, s, c.q_heads, d))?;
    let scale = 1.0 / (d as f32).sqrt();

    // Reference: single-device flash-ring on the whole sequence.
    let (qv, kv, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let spec = c
        .mask
        .spec(scale, Positions::range(0, s), Positions::range(0, s));
    let (r_out, r_lse) =
        flash_ring::flash_attention_with_lse(&qv, &kv, &vv, &spec).map_err(kernel_err)?;
    let r_grads = (&r_out * &g)?.sum_all()?.backward()?;
    let rg = |t: &Var| {
        r_grads
            .get(t)
            .cloned()
            .ok_or_else(|| fail("reference gradient missing".into()))
    };
    let refs = [r_out, r_lse, rg(&qv)?, rg(&kv)?, rg(&vv)?];

    // The strategy on this rank's shard.
    let ql = Var::from_tensor(&sp.shard_for(&q, 1, &c.mask)?)?;
    let kl = Var::from_tensor(&sp.shard_for(&k, 1, &c.mask)?)?;
    let vl = Var::from_tensor(&sp.shard_for(&v, 1, &c.mask)?)?;
    let before = world.traffic().snapshot().bytes_sent();
    let call = AttnCall::new(c.mask.clone(), scale);
    let (out, lse) = sp.attention_with_lse(&ql, &kl, &vl, &call)?;
    let mid = world.traffic().snapshot().bytes_sent();
    let grads = (&out * &sp.shard_for(&g, 1, &c.mask)?)?
        .sum_all()?
        .backward()?;
    let after = world.traffic().snapshot().bytes_sent();
    let lg = |t: &Var, name: &str| {
        grads
            .get(t)
            .cloned()
            .ok_or_else(|| fail(format!("rank {}: no gradient for {name}", world.rank())))
    };
    let g_local = sp.shard_for(&g, 1, &c.mask)?;
    let saved = Saved::new(&ql, &kl, &vl, &out, &lse);
    let explicit = sp.backward(&saved, &g_local, &call)?;
    let got = [out, lse, lg(&ql, "q")?, lg(&kl, "k")?, lg(&vl, "v")?];

    let names = ["out", "lse", "dq", "dk", "dv"];
    let mut errors = [0f32; 5];
    for i in 0..5 {
        let dim = if i == 1 { 2 } else { 1 };
        let want = sp.shard_for(&refs[i], dim, &c.mask)?;
        errors[i] = rel_err(&got[i], &want, &refs[i])?;
        if errors[i] > c.tol || errors[i].is_nan() {
            return Err(fail(format!(
                "{}: rank {}: {} relative error {:e} > {:e}",
                c.name(),
                world.rank(),
                names[i],
                errors[i],
                c.tol
            )));
        }
    }
    let mut explicit_bwd_errors = [0f32; 3];
    for (i, e) in [explicit.0, explicit.1, explicit.2].iter().enumerate() {
        let want = sp.shard_for(&refs[i + 2], 1, &c.mask)?;
        explicit_bwd_errors[i] = rel_err(e, &want, &refs[i + 2])?;
        if explicit_bwd_errors[i] > c.tol || explicit_bwd_errors[i].is_nan() {
            return Err(fail(format!(
                "{}: rank {}: explicit backward {} relative error {:e} > {:e}",
                c.name(),
                world.rank(),
                names[i + 2],
                explicit_bwd_errors[i],
                c.tol
            )));
        }
    }
    Ok(SelfTestReport {
        errors,
        explicit_bwd_errors,
        fwd_bytes: mid - before,
        bwd_bytes: after - mid,
    })
}

/// `max|a - b| / max|global|` over finite values; equal infinities (lse of empty rows) match.
fn rel_err(a: &Tensor, b: &Tensor, global: &Tensor) -> Result<f32> {
    let flat = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (a, b, gl) = (flat(a)?, flat(b)?, flat(global)?);
    if a.len() != b.len() {
        return Err(fail(format!("{} values, expected {}", a.len(), b.len())));
    }
    let scale = gl
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| {
            if x == y {
                0.0
            } else if x.is_finite() && y.is_finite() {
                (x - y).abs() / scale
            } else {
                f32::INFINITY
            }
        })
        .fold(0f32, f32::max))
}
