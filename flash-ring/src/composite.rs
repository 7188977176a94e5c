//! The composite path: flash attention written in plain candle tensor ops, so it runs on any
//! device candle runs on (CUDA through cuBLAS, Metal), with the crate's exact contract.
//!
//! It is what [`crate::flash_fwd`], [`crate::flash_bwd`] and [`crate::flash_attention`] run for
//! tensors that are not on the CPU (until a device has its own kernel, and after it for head
//! dims or masks that kernel does not support), and the oracle a device kernel is tested against.
//!
//! - Blockwise: q is cut into tiles of `q_tile` rows and k/v into tiles of `k_tile` rows; the
//!   forward keeps an online softmax (running max, running sum, f32 accumulator) over the k tiles
//!   of each q tile. Extra memory is one `(batch, q_heads, q_tile, k_tile)` f32 score tile plus
//!   O(seq x head_dim) accumulators, never `seq_q x seq_k`.
//! - GQA without copies: q heads are grouped by their k/v head, `(b, kv_heads, group * rows, d)`,
//!   so one matmul per tile serves every q head of a group, and the backward's `dk`/`dv` products
//!   sum over the group by themselves.
//! - The mask is evaluated on the host from the spec ([`AttnSpec::allowed`]) one tile at a time
//!   and uploaded as a u8 tensor of allowed pairs; a tile with no allowed pair is skipped and a
//!   fully allowed tile gets no mask. Rows with no allowed key get `out = 0`, `lse = -inf` and
//!   zero gradients. A NaN score makes its row's out and lse NaN (candle's exponential keeps
//!   NaN), as in the CPU kernels; a masked NaN is replaced and stays out of the row.
//! - A logit soft-cap ([`AttnSpec::softcap`]) is applied to each score tile right after the
//!   product, before the mask: `c * tanh(s / c)`; the backward multiplies dS by
//!   `1 - tanh^2(s / c)` (its own backward, not candle's autograd, see [`backward`]).
//! - Arithmetic in f32 whatever the input dtype (as the CPU kernel), outputs in q's dtype
//!   (gradients optionally in f32).
//!
//! Masked scores become the finite [`MASKED`] rather than `-inf`, so no `-inf - -inf` appears
//! in the online softmax: a row's masked scores are weighted `e^(MASKED - m)`, which is exactly 0
//! once the row has seen any allowed key (scores are many orders of magnitude above `MASKED`),
//! and a row that never sees one is set to `out = 0`, `lse = -inf` at the end from the host mask.

use candle_core::{DType, Device, Tensor, D};

use crate::error::{Error, Result};
use crate::spec::AttnSpec;

/// The value a masked score is replaced with (finite, see the module doc).
pub const MASKED: f32 = -1.0e30;

/// Tile sizes of the composite path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompositeConfig {
    /// Query rows per tile (>= 1).
    pub q_tile: usize,
    /// Key rows per tile (>= 1).
    pub k_tile: usize,
}

impl Default for CompositeConfig {
    /// 512 x 1024: a score tile of 2 MiB per (batch, head), large enough for cuBLAS to be
    /// efficient and small enough for 128K-token sequences.
    fn default() -> Self {
        CompositeConfig {
            q_tile: 512,
            k_tile: 1024,
        }
    }
}

impl CompositeConfig {
    fn check(&self) -> Result<()> {
        if self.q_tile == 0 || self.k_tile == 0 {
            return Err(Error::Config(format!(
                "composite tiles must be >= 1, got q_tile {} k_tile {}",
                self.q_tile, self.k_tile
            )));
        }
        Ok(())
    }
}

/// Shapes of one call: batch, q rows, q heads, k rows, k/v heads, head dim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) sq: usize,
    pub(crate) hq: usize,
    pub(crate) sk: usize,
    pub(crate) hkv: usize,
    pub(crate) d: usize,
}

impl Dims {
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

/// Checks the shapes, dtypes and spec of a call (shared with the CUDA kernels' host code).
pub(crate) fn dims(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttnSpec) -> Result<Dims> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            return Err(crate::rank_err(name, t.dims()));
        }
        if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                tensor: name,
                got: t.dtype(),
                expected: "f32, bf16 or f16",
            });
        }
    }
    let (b, sq, hq, d) = q.dims4()?;
    let (kb, sk, hkv, kd) = k.dims4()?;
    if kb != b || kd != d {
        return Err(Error::Shape {
            tensor: "k",
            got: k.dims().to_vec(),
            expected: format!("({b}, seq_k, kv_heads, {d})"),
        });
    }
    if v.dims() != k.dims() {
        return Err(Error::Shape {
            tensor: "v",
            got: v.dims().to_vec(),
            expected: format!("{:?} (the shape of k)", k.dims()),
        });
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(Error::Heads {
            q_heads: hq,
            kv_heads: hkv,
        });
    }
    spec.validate(sq, sk)?;
    Ok(Dims {
        b,
        sq,
        hq,
        sk,
        hkv,
        d,
    })
}

/// [`dims`] of a backward call, also checking `out` and `dout` (shape of q) and `lse`
/// ((batch, q_heads, seq_q) f32); shared with the CUDA kernels' host code.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dims(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
) -> Result<Dims> {
    let dm = dims(q, k, v, spec)?;
    for (name, t) in [("out", out), ("dout", dout)] {
        if t.dims() != q.dims() {
            return Err(Error::Shape {
                tensor: name,
                got: t.dims().to_vec(),
                expected: format!("{:?} (the shape of q)", q.dims()),
            });
        }
    }
    if lse.dims() != [dm.b, dm.hq, dm.sq] {
        return Err(Error::Shape {
            tensor: "lse",
            got: lse.dims().to_vec(),
            expected: format!("[{}, {}, {}] (batch, q_heads, seq_q)", dm.b, dm.hq, dm.sq),
        });
    }
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            tensor: "lse",
            got: lse.dtype(),
            expected: "f32",
        });
    }
    Ok(dm)
}

/// How a (q tile, k tile) pair is masked.
enum TileMask {
    /// No pair allowed: the tile is skipped.
    Empty,
    /// Every pair allowed: no mask.
    Full,
    /// A `(q rows, k rows)` u8 tensor on the device: 1 where allowed, 0 elsewhere.
    Allowed(Tensor),
}

/// The host-side mask of a spec, evaluated tile by tile.
struct HostMask<'a> {
    spec: &'a AttnSpec,
    dev: Device,
}

impl HostMask<'_> {
    /// The mask of q rows `q0..q0 + qn` against k rows `k0..k0 + kn`; sets `alive[i]` for every
    /// row `q0 + i` that may attend a key of the tile.
    fn tile(
        &self,
        q0: usize,
        qn: usize,
        k0: usize,
        kn: usize,
        alive: &mut [bool],
    ) -> Result<TileMask> {
        let mut allowed_pairs = vec![0u8; qn * kn];
        let mut allowed = 0usize;
        for (i, alive) in alive.iter_mut().enumerate().take(qn) {
            let pq = self.spec.q_pos.get(q0 + i);
            for j in 0..kn {
                if self.spec.allowed(pq, self.spec.k_pos.get(k0 + j)) {
                    allowed += 1;
                    *alive = true;
                    allowed_pairs[i * kn + j] = 1;
                }
            }
        }
        Ok(if allowed == 0 {
            TileMask::Empty
        } else if allowed == qn * kn {
            TileMask::Full
        } else {
            TileMask::Allowed(Tensor::from_vec(allowed_pairs, (qn, kn), &self.dev)?)
        })
    }
}

/// A tile of logits: `(b, hkv, g * qn, kn)`, soft-capped and masked.
struct Scores {
    s: Tensor,
    /// With a soft-cap: `tanh(s / c)` of every entry (masked ones too), for the backward's
    /// `d(capped)/ds = 1 - tanh^2(s / c)`.
    tanh: Option<Tensor>,
}

impl HostMask<'_> {
    /// The logits of q rows `q0..q0 + qn` (grouped and already scaled, `(b, hkv, g * qn, d)`)
    /// against the k tile `kt` (rows `k0..k0 + kn`): `s = qs · kt^T`, soft-capped to
    /// `c tanh(s / c)` when the spec has a cap, then masked; `None` when no pair of the tile is
    /// allowed. Sets `alive` as [`HostMask::tile`] does.
    fn scores(
        &self,
        qs: &Tensor,
        kt: &Tensor,
        dm: &Dims,
        (q0, qn): (usize, usize),
        (k0, kn): (usize, usize),
        alive: &mut [bool],
    ) -> Result<Option<Scores>> {
        let allowed = match self.tile(q0, qn, k0, kn, alive)? {
            TileMask::Empty => return Ok(None),
            TileMask::Full => None,
            TileMask::Allowed(a) => Some(a),
        };
        let s = qs.matmul(&kt.t()?)?;
        let (s, tanh) = match self.spec.softcap {
            None => (s, None),
            Some(c) => {
                let t = (s / c as f64)?.tanh()?;
                ((&t * c as f64)?, Some(t))
            }
        };
        let s = match allowed {
            Some(allowed) => mask_scores(&s, &allowed, dm, qn, kn)?,
            None => s,
        };
        Ok(Some(Scores { s, tanh }))
    }
}

/// `x` (b, s, h, d) rows `r0..r0 + n` as f32 `(b, kv_heads, group * n, d)`: the heads of one
/// k/v group next to each other (q head `h` belongs to k/v head `h / group`).
fn grouped(x: &Tensor, r0: usize, n: usize, dm: &Dims) -> Result<Tensor> {
    let (b, h, d) = (dm.b, x.dim(2)?, dm.d);
    let g = h / dm.hkv;
    Ok(x.narrow(1, r0, n)?
        .to_dtype(DType::F32)?
        .transpose(1, 2)? // (b, h, n, d)
        .contiguous()?
        .reshape((b, dm.hkv, g * n, d))?)
}

/// The inverse of [`grouped`] for a `(b, kv_heads, group * n, d)` tensor: `(b, n, h, d)`.
fn ungrouped(x: &Tensor, n: usize, dm: &Dims) -> Result<Tensor> {
    let h = x.dim(2)? / n * dm.hkv;
    Ok(x.reshape((dm.b, h, n, dm.d))?
        .transpose(1, 2)?
        .contiguous()?)
}

/// `(b, hkv, g * qn, kn)` scores with the pairs that `allowed` (`(qn, kn)` u8) forbids set to
/// [`MASKED`]: replaced, not offset, so that a NaN score there (a NaN key the row cannot see)
/// stays out of the row, as in the CPU kernels.
fn mask_scores(s: &Tensor, allowed: &Tensor, dm: &Dims, qn: usize, kn: usize) -> Result<Tensor> {
    let shape = (dm.b, dm.hkv, dm.group(), qn, kn);
    let s = s.reshape(shape)?;
    let masked = Tensor::full(MASKED, (), s.device())?.broadcast_as(shape)?;
    Ok(allowed
        .broadcast_as(shape)?
        .where_cond(&s, &masked)?
        .reshape((dm.b, dm.hkv, dm.group() * qn, kn))?)
}

/// `(qn)` flags as a `(b, hkv, g * qn, 1)`-broadcastable f32 tensor of `yes`/`no` values.
fn row_values(alive: &[bool], yes: f32, no: f32, dm: &Dims, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = alive.iter().map(|&a| if a { yes } else { no }).collect();
    let t = Tensor::from_vec(v, (1, 1, 1, alive.len(), 1), dev)?;
    Ok(t.broadcast_as((1, 1, dm.group(), alive.len(), 1))?
        .reshape((1, 1, dm.group() * alive.len(), 1))?)
}

/// Forward: `out` (batch, seq_q, q_heads, head_dim) in q's dtype and `lse`
/// (batch, q_heads, seq_q) f32, on q's device. Same contract as [`crate::flash_fwd`]; nothing is
/// recorded for autograd.
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &CompositeConfig,
) -> Result<(Tensor, Tensor)> {
    cfg.check()?;
    let dm = dims(q, k, v, spec)?;
    let dev = q.device().clone();
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let mask = HostMask {
        spec,
        dev: dev.clone(),
    };
    let g = dm.group();
    // k and v once, grouped per k/v head: (b, hkv, sk, d).
    let kg = grouped(&k, 0, dm.sk, &dm)?;
    let vg = grouped(&v, 0, dm.sk, &dm)?;
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for q0 in (0..dm.sq).step_by(cfg.q_tile) {
        let qn = cfg.q_tile.min(dm.sq - q0);
        let qt = (grouped(&q, q0, qn, &dm)? * spec.scale as f64)?; // (b, hkv, g*qn, d)
        let rows = (dm.b, dm.hkv, g * qn, 1);
        let mut m = Tensor::full(MASKED, rows, &dev)?;
        let mut l = Tensor::zeros(rows, DType::F32, &dev)?;
        let mut acc = Tensor::zeros((dm.b, dm.hkv, g * qn, dm.d), DType::F32, &dev)?;
        let mut alive = vec![false; qn];
        for k0 in (0..dm.sk).step_by(cfg.k_tile) {
            let kn = cfg.k_tile.min(dm.sk - k0);
            let kt = kg.narrow(2, k0, kn)?;
            let Some(Scores { s, .. }) =
                mask.scores(&qt, &kt, &dm, (q0, qn), (k0, kn), &mut alive)?
            else {
                continue;
            };
            let vt = vg.narrow(2, k0, kn)?;
            let m_new = m.maximum(&s.max_keepdim(D::Minus1)?)?;
            let p = s.broadcast_sub(&m_new)?.exp()?;
            let alpha = (&m - &m_new)?.exp()?;
            l = ((l * &alpha)? + p.sum_keepdim(D::Minus1)?)?;
            acc = (acc.broadcast_mul(&alpha)? + p.matmul(&vt)?)?;
            m = m_new;
        }
        // Dead rows: out 0 (factor 0), lse -inf (bias -inf).
        let keep = row_values(&alive, 1.0, 0.0, &dm, &dev)?;
        let dead = row_values(&alive, 0.0, f32::NEG_INFINITY, &dm, &dev)?;
        // Dead rows may have l = 0 (every tile skipped): floor it so 0/0 never appears; live rows
        // have l >= 1 (their maximum contributes e^0).
        let l = l.maximum(f32::MIN_POSITIVE)?;
        let o = acc.broadcast_div(&l)?.broadcast_mul(&keep)?;
        let lse = (m + l.log()?)?.broadcast_add(&dead)?; // (b, hkv, g*qn, 1)
        outs.push(ungrouped(&o, qn, &dm)?);
        lses.push(lse.reshape((dm.b, dm.hq, qn))?);
    }
    let (out, lse) = if outs.is_empty() {
        (
            Tensor::zeros((dm.b, 0, dm.hq, dm.d), DType::F32, &dev)?,
            Tensor::zeros((dm.b, dm.hq, 0), DType::F32, &dev)?,
        )
    } else {
        (Tensor::cat(&outs, 1)?, Tensor::cat(&lses, 2)?)
    };
    Ok((out.to_dtype(q.dtype())?, lse.contiguous()?))
}

/// Backward of one (q block, kv block) pair given the FINAL `out` and `lse` (merged over every
/// kv block), as [`crate::flash_bwd`]: returns `dq` (like q), `dk`, `dv` (like k, v; summed over
/// the q heads of each k/v group), in the input dtype or, with `f32_grads`, in f32.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    spec: &AttnSpec,
    cfg: &CompositeConfig,
    f32_grads: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    cfg.check()?;
    let dm = backward_dims(q, k, v, out, lse, dout, spec)?;
    let dev = q.device().clone();
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let (out, lse, dout) = (out.detach(), lse.detach(), dout.detach());
    let mask = HostMask {
        spec,
        dev: dev.clone(),
    };
    let g = dm.group();
    let scale = spec.scale as f64;
    let kg = grouped(&k, 0, dm.sk, &dm)?;
    let vg = grouped(&v, 0, dm.sk, &dm)?;
    // A row whose final lse is -inf saw no key anywhere: shift it by +inf so every p is 0.
    let lse_safe = {
        let dead = lse.eq(f64::NEG_INFINITY)?;
        dead.where_cond(&Tensor::full(f32::INFINITY, lse.shape(), &dev)?, &lse)?
    };
    // dk, dv per k tile, accumulated over the q tiles.
    let n_kt = dm.sk.div_ceil(cfg.k_tile);
    let mut dk_tiles: Vec<Option<Tensor>> = vec![None; n_kt];
    let mut dv_tiles: Vec<Option<Tensor>> = vec![None; n_kt];
    let mut dqs = Vec::new();
    for q0 in (0..dm.sq).step_by(cfg.q_tile) {
        let qn = cfg.q_tile.min(dm.sq - q0);
        let qt = grouped(&q, q0, qn, &dm)?; // (b, hkv, g*qn, d), unscaled
        let qs = (&qt * scale)?; // as the forward's scores
        let ot = grouped(&out, q0, qn, &dm)?;
        let dot = grouped(&dout, q0, qn, &dm)?;
        // lse (b, hq, sq) -> (b, hkv, g*qn, 1); q head h = kv head h / g, so the reshape groups.
        let lt = lse_safe
            .narrow(2, q0, qn)?
            .reshape((dm.b, dm.hkv, g * qn, 1))?;
        // D_i = rowsum(dout_i * out_i).
        let delta = (&dot * &ot)?.sum_keepdim(D::Minus1)?;
        let mut dq = Tensor::zeros((dm.b, dm.hkv, g * qn, dm.d), DType::F32, &dev)?;
        // Rows' liveness is not needed here (dead rows have lse = -inf, see `lse_safe`).
        let mut seen = vec![false; qn];
        for (t, k0) in (0..dm.sk).step_by(cfg.k_tile).enumerate() {
            let kn = cfg.k_tile.min(dm.sk - k0);
            let kt = kg.narrow(2, k0, kn)?;
            let Some(Scores { s, tanh }) =
                mask.scores(&qs, &kt, &dm, (q0, qn), (k0, kn), &mut seen)?
            else {
                continue;
            };
            let vt = vg.narrow(2, k0, kn)?;
            let p = s.broadcast_sub(&lt)?.exp()?; // (b, hkv, g*qn, kn)
            let dp = dot.matmul(&vt.t()?)?;
            let ds = (&p * dp.broadcast_sub(&delta)?)?;
            // The gradient with respect to the uncapped logit (masked entries: p = 0).
            let ds = match tanh {
                // 1 - t^2 as (1 - t)(1 + t): accurate where t is close to +-1.
                Some(t) => ((ds * t.affine(-1.0, 1.0)?)? * t.affine(1.0, 1.0)?)?,
                None => ds,
            };
            dq = (dq + (ds.matmul(&kt)? * scale)?)?;
            // Products over the g*qn rows: the q heads of a group add up by themselves.
            let dk_part = (ds.t()?.matmul(&qt)? * scale)?;
            let dv_part = p.t()?.matmul(&dot)?;
            dk_tiles[t] = Some(match dk_tiles[t].take() {
                Some(acc) => (acc + dk_part)?,
                None => dk_part,
            });
            dv_tiles[t] = Some(match dv_tiles[t].take() {
                Some(acc) => (acc + dv_part)?,
                None => dv_part,
            });
        }
        dqs.push(ungrouped(&dq, qn, &dm)?);
    }
    let dq = if dqs.is_empty() {
        Tensor::zeros((dm.b, 0, dm.hq, dm.d), DType::F32, &dev)?
    } else {
        Tensor::cat(&dqs, 1)?
    };
    // Tiles no query reached get zeros.
    let assemble = |tiles: Vec<Option<Tensor>>| -> Result<Tensor> {
        if tiles.is_empty() {
            return Ok(Tensor::zeros((dm.b, dm.hkv, 0, dm.d), DType::F32, &dev)?);
        }
        let parts = tiles
            .into_iter()
            .enumerate()
            .map(|(t, x)| match x {
                Some(x) => Ok(x),
                None => {
                    let kn = cfg.k_tile.min(dm.sk - t * cfg.k_tile);
                    Tensor::zeros((dm.b, dm.hkv, kn, dm.d), DType::F32, &dev)
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 2)?)
    };
    let dk = assemble(dk_tiles)?;
    let dv = assemble(dv_tiles)?;
    let dk = ungrouped(&dk, dm.sk, &dm)?;
    let dv = ungrouped(&dv, dm.sk, &dm)?;
    let cast = |t: Tensor, like: &Tensor| -> Result<Tensor> {
        Ok(if f32_grads {
            t
        } else {
            t.to_dtype(like.dtype())?
        })
    };
    Ok((cast(dq, &q)?, cast(dk, &k)?, cast(dv, &v)?))
}

/// Differentiable attention on the composite path: `(out, lse)` as
/// [`crate::flash_attention_with_lse`], with gradients reaching q, k and v through
/// [`backward`]. What [`crate::flash_attention`] runs for tensors that are not on the CPU.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttnSpec,
    cfg: &CompositeConfig,
) -> Result<(Tensor, Tensor)> {
    crate::op::composite_attention(q, k, v, spec, cfg)
}
