//! Host-side planning of FlashAttention-2 kernel calls (candle-flash-attn) for an [`AttnSpec`].
//!
//! flash-attn only knows masks on a call over contiguous rows `q[0..sq)`, `k[0..sk)`: none,
//! causal aligned to the bottom right (query `i` sees key `j` iff `j <= i + sk - sq`), and a
//! local window `(left, right)`: `i + sk - sq - left <= j <= i + sk - sq + right`, an absent
//! bound being unbounded (causal is `(None, Some(0))`). [`plan_flash_attn`] turns a spec for a
//! `(seq_q, seq_k)` block into a list of such calls, each on a contiguous row range of q and of
//! k, such that running every call and merging the partial `(out, lse)` by LSE
//! ([`FlashAttnAccumulator`], or [`crate::merge`] per row range) gives exactly flash-ring's
//! attention for the spec. Every allowed (query, key) pair is covered by exactly one call and no
//! disallowed pair by any.
//!
//! # Decomposition
//! 1. The q rows and the k rows are split into maximal segments of consecutive rows whose global
//!    positions form an arithmetic progression (`pos = p0 + i * stride`, any stride: 1 for
//!    contiguous and zigzag blocks, `P` for striped layouts, -1 for reversed rows) with one
//!    document id. A one-row segment fits any stride.
//! 2. For a (q segment, k segment) pair with the same stride and document, the allowed keys of
//!    local query row `i` are `j - i in [L, U]` (the mask, the window and the stride give the
//!    band). Rows and keys that see nothing are trimmed away; the remaining rectangle is one call
//!    with no mask, causal, or a local window, bottom-right aligned to its own `sq`, `sk`. Pairs
//!    whose documents differ or that are entirely masked give no call.
//! 3. Where that one call would need window sizes flash-attn cannot take (see the invariants),
//!    or a local window when [`FlashAttnPlanOptions::allow_local`] is false, the pair is split
//!    into at most three calls: rows whose band ends inside the keys (causal or `(left, 0)`),
//!    rows that see every key (no mask), rows that see a suffix of the keys (`(left, sq - 1)`).
//!    With `allow_local == false`, a part that would still need a local window is emitted as one
//!    unmasked call per row (or per key column, whichever is fewer).
//! 4. Segments of different strides (both longer than one row; rare: e.g. a striped q block
//!    against a contiguous k block) fall back to one call per row of the shorter segment.
//!
//! A call count is in [`FlashAttnPlan::num_calls`]; [`FlashAttnPlanOptions::max_calls`] stops the
//! planning early with [`Error::FlashAttnPlan`] so a caller can take another path (the CPU
//! kernel or the composite path) for specs that would need too many calls. Planning costs
//! O(rows + segment pairs of the same document): cheap for block layouts, quadratic in the rows
//! for unstructured position lists (where every row is its own segment).
//!
//! # Invariants of the emitted calls
//! - `q_rows` and `k_rows` are non-empty; every q row of a call sees at least one key of the call
//!   and every key is seen by at least one row (no fully masked row inside a call).
//! - A window size, when `Some`, is `< sk` of its call, so neither candle-flash-attn's clamping
//!   (`> seqlen_k` becomes unbounded) nor flash-attn's (`>= seqlen_k` becomes unbounded) changes
//!   it; `window_size_left` is never `Some` while `window_size_right` is `None` (flash-attn
//!   would turn that right bound into `seqlen_k`).
//! - The same plan serves every batch entry and head (GQA/MQA included); the softmax scale is the
//!   spec's.
//!
//! # Soft-capping
//! A spec with a logit soft-cap ([`AttnSpec::softcap`]) is refused with
//! [`Error::FlashAttnPlan`] naming the soft-cap: the calls planned here carry no cap, and
//! running them would silently compute uncapped attention. Such specs take another path (the
//! CPU kernel or the composite path, which both cap).
//!
//! # LSE conventions
//! flash-attn writes `lse = +inf` for a fully masked row, flash-ring `-inf` (and `out = 0`).
//! [`remap_lse_from_flash_attn`] / [`lse_from_flash_attn`] convert; [`FlashAttnAccumulator`]
//! accepts either convention and leaves rows that no call covers at `out = 0`, `lse = -inf`.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::spec::{AttnSpec, MaskKind, Positions};

/// Stands for an infinite band offset (far beyond any row count or position).
const INF: i128 = 1 << 100;

/// The mask arguments of one flash-attn call, in candle-flash-attn's convention
/// (`flash_attn_windowed(q, k, v, scale, window_size_left, window_size_right)`): `None` is
/// unbounded; `(None, Some(0))` is causal (`flash_attn(.., causal = true)`); `(None, None)` is no
/// mask. Query `i` of a call sees key `j` iff
/// `i + sk - sq - left <= j <= i + sk - sq + right` (bounds that are `None` dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashAttnMask {
    /// Keys allowed to the left of the (bottom-right aligned) diagonal; `None`: unbounded.
    pub window_size_left: Option<usize>,
    /// Keys allowed to the right of the (bottom-right aligned) diagonal; `None`: unbounded.
    pub window_size_right: Option<usize>,
}

impl FlashAttnMask {
    /// No mask: every query sees every key of the call.
    pub const NONE: FlashAttnMask = FlashAttnMask {
        window_size_left: None,
        window_size_right: None,
    };
    /// Bottom-right aligned causal mask.
    pub const CAUSAL: FlashAttnMask = FlashAttnMask {
        window_size_left: None,
        window_size_right: Some(0),
    };

    /// True for no mask (`flash_attn(.., causal = false)`).
    pub fn is_unmasked(&self) -> bool {
        *self == Self::NONE
    }

    /// True for the causal mask (`flash_attn(.., causal = true)`).
    pub fn is_causal(&self) -> bool {
        *self == Self::CAUSAL
    }

    /// True when the call needs flash-attn's local (sliding-window) kernels: neither unmasked
    /// nor causal.
    pub fn is_local(&self) -> bool {
        !self.is_unmasked() && !self.is_causal()
    }

    /// The window sizes as flash-attn's kernel takes them (`-1` for unbounded).
    pub fn kernel_window_sizes(&self) -> (i64, i64) {
        let f = |w: Option<usize>| w.map_or(-1, |x| i64::try_from(x).unwrap_or(i64::MAX));
        (f(self.window_size_left), f(self.window_size_right))
    }

    /// Whether query `i` sees key `j` in a call with `seq_q` queries and `seq_k` keys
    /// (flash-attn's rule, as documented on the type).
    pub fn allows(&self, seq_q: usize, seq_k: usize, i: usize, j: usize) -> bool {
        // off = j - i - (sk - sq): the distance to the bottom-right aligned diagonal.
        let off = j as i128 - i as i128 - (seq_k as i128 - seq_q as i128);
        self.window_size_left.is_none_or(|l| off >= -(l as i128))
            && self.window_size_right.is_none_or(|r| off <= r as i128)
    }
}

/// One flash-attn call: rows `q_rows` of q (and of out, lse), rows `k_rows` of k and v.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlashAttnCall {
    /// Contiguous rows of q (sequence dimension) this call computes partial results for.
    pub q_rows: Range<usize>,
    /// Contiguous rows of k and v this call reads.
    pub k_rows: Range<usize>,
    /// The mask, bottom-right aligned to `q_rows.len()`, `k_rows.len()`.
    pub mask: FlashAttnMask,
}

impl FlashAttnCall {
    /// flash-attn's `causal` flag for this call (true iff the mask is [`FlashAttnMask::CAUSAL`]).
    pub fn causal(&self) -> bool {
        self.mask.is_causal()
    }

    /// Number of q rows of the call.
    pub fn seq_q(&self) -> usize {
        self.q_rows.len()
    }

    /// Number of k rows of the call.
    pub fn seq_k(&self) -> usize {
        self.k_rows.len()
    }
}

/// Options of [`plan_flash_attn_with_options`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlashAttnPlanOptions {
    /// Allow calls with a local window (needs flash-attn built without
    /// `FLASHATTENTION_DISABLE_LOCAL`). When false only unmasked and causal calls are emitted:
    /// parts of a window band that need a local window become one call per row (or key column).
    /// Default: true.
    pub allow_local: bool,
    /// Stop with [`Error::FlashAttnPlan`] as soon as the plan would need more calls than this.
    /// Default: no limit.
    pub max_calls: Option<usize>,
}

impl Default for FlashAttnPlanOptions {
    fn default() -> Self {
        FlashAttnPlanOptions {
            allow_local: true,
            max_calls: None,
        }
    }
}

/// The flash-attn calls computing one (q block, k block) spec; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct FlashAttnPlan {
    /// Rows of q (and of the result) the plan was made for.
    pub seq_q: usize,
    /// Rows of k and v the plan was made for.
    pub seq_k: usize,
    /// The softmax scale to pass to every call (the spec's).
    pub softmax_scale: f32,
    /// The calls, grouped by q segment. Run them in any order and merge by LSE.
    pub calls: Vec<FlashAttnCall>,
}

impl FlashAttnPlan {
    /// Number of kernel calls (a caller may fall back to another path above some count).
    pub fn num_calls(&self) -> usize {
        self.calls.len()
    }

    /// True when some call needs flash-attn's local (sliding-window) kernels.
    pub fn needs_local(&self) -> bool {
        self.calls.iter().any(|c| c.mask.is_local())
    }

    /// For each q row, whether some call covers it (rows not covered have no allowed key and
    /// end with `out = 0`, `lse = -inf`).
    pub fn covered_q_rows(&self) -> Vec<bool> {
        let mut v = vec![false; self.seq_q];
        for c in &self.calls {
            v[c.q_rows.clone()].fill(true);
        }
        v
    }
}

/// Plans the flash-attn calls for `spec` on a block of `seq_q` q rows and `seq_k` k rows with the
/// default options (local windows allowed, no call limit).
///
/// Errors: the spec's positions do not match `seq_q` / `seq_k`, a position lies outside
/// `doc_ids`, the scale is not finite, or the spec has a soft-cap (not planned, see the module
/// docs).
pub fn plan_flash_attn(spec: &AttnSpec, seq_q: usize, seq_k: usize) -> Result<FlashAttnPlan> {
    plan_flash_attn_with_options(spec, seq_q, seq_k, &FlashAttnPlanOptions::default())
}

/// [`plan_flash_attn`] with explicit options; also errors ([`Error::FlashAttnPlan`]) when the
/// plan would exceed `opts.max_calls`.
pub fn plan_flash_attn_with_options(
    spec: &AttnSpec,
    seq_q: usize,
    seq_k: usize,
    opts: &FlashAttnPlanOptions,
) -> Result<FlashAttnPlan> {
    spec.validate(seq_q, seq_k)?;
    if let Some(c) = spec.softcap {
        return Err(Error::FlashAttnPlan(format!(
            "spec.softcap = {c}: flash-attn calls are planned without a logit soft-cap; \
             use the CPU kernel or the composite path for a soft-capped spec"
        )));
    }
    let docs = spec.doc_ids.as_deref();
    let qsegs = segments(&spec.q_pos, docs);
    let ksegs = segments(&spec.k_pos, docs);
    let mut p = Planner {
        rule: Rule {
            causal: spec.mask == MaskKind::Causal,
            window: spec.window.map(|w| w as i128),
        },
        opts,
        calls: Vec::new(),
    };
    if docs.is_some() {
        let mut by_doc: HashMap<Option<u32>, Vec<usize>> = HashMap::new();
        for (i, s) in ksegs.iter().enumerate() {
            by_doc.entry(s.doc).or_default().push(i);
        }
        for qs in &qsegs {
            if let Some(ks) = by_doc.get(&qs.doc) {
                for &k in ks {
                    p.pair(qs, &ksegs[k])?;
                }
            }
        }
    } else {
        for qs in &qsegs {
            for ks in &ksegs {
                p.pair(qs, ks)?;
            }
        }
    }
    Ok(FlashAttnPlan {
        seq_q,
        seq_k,
        softmax_scale: spec.scale,
        calls: p.calls,
    })
}

/// Maps flash-attn's `+inf` LSE of fully masked rows to flash-ring's `-inf`, in place. Other
/// values are left alone.
pub fn remap_lse_from_flash_attn(lse: &mut [f32]) {
    for x in lse.iter_mut().filter(|x| **x == f32::INFINITY) {
        *x = f32::NEG_INFINITY;
    }
}

/// The inverse of [`remap_lse_from_flash_attn`]: flash-ring's `-inf` to flash-attn's `+inf`.
pub fn remap_lse_to_flash_attn(lse: &mut [f32]) {
    for x in lse.iter_mut().filter(|x| **x == f32::NEG_INFINITY) {
        *x = f32::INFINITY;
    }
}

/// [`remap_lse_from_flash_attn`] on an f32 tensor of any shape and device (tensor ops).
pub fn lse_from_flash_attn(lse: &Tensor) -> Result<Tensor> {
    replace_value(lse, f32::INFINITY, f32::NEG_INFINITY)
}

/// [`remap_lse_to_flash_attn`] on an f32 tensor of any shape and device (tensor ops).
pub fn lse_to_flash_attn(lse: &Tensor) -> Result<Tensor> {
    replace_value(lse, f32::NEG_INFINITY, f32::INFINITY)
}

fn replace_value(lse: &Tensor, from: f32, to: f32) -> Result<Tensor> {
    if lse.dtype() != DType::F32 {
        return Err(Error::DType {
            tensor: "lse",
            got: lse.dtype(),
            expected: "f32",
        });
    }
    let hit = lse.eq(from as f64)?;
    let fill = Tensor::full(to, lse.shape(), lse.device())?;
    Ok(hit.where_cond(&fill, lse)?)
}

/// Accumulates the partial results of a plan's calls into the block's `out` (f32) and `lse`.
///
/// Starts at `out = 0`, `lse = -inf` for every row, so rows that no call covers keep flash-ring's
/// fully-masked result. Each [`add`](Self::add) merges one call's partial into its `q_rows` with
/// [`crate::merge`] (tensor ops off the CPU); it copies the accumulator once per call.
pub struct FlashAttnAccumulator {
    out: Tensor,
    lse: Tensor,
    dims: [usize; 4],
}

impl FlashAttnAccumulator {
    /// An empty accumulator for a block of `seq_q` rows: `out` (batch, seq_q, q_heads, head_dim)
    /// f32 zeros, `lse` (batch, q_heads, seq_q) f32 `-inf`, on `device`.
    pub fn new(
        batch: usize,
        seq_q: usize,
        q_heads: usize,
        head_dim: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(FlashAttnAccumulator {
            out: Tensor::zeros((batch, seq_q, q_heads, head_dim), DType::F32, device)?,
            lse: Tensor::full(f32::NEG_INFINITY, (batch, q_heads, seq_q), device)?,
            dims: [batch, seq_q, q_heads, head_dim],
        })
    }

    /// Merges the result of `call`: `out` (batch, call rows, q_heads, head_dim), any float
    /// dtype; `lse` (batch, q_heads, call rows) f32 in either convention (`+inf` is read as a
    /// fully masked row, like `-inf`).
    pub fn add(&mut self, call: &FlashAttnCall, out: &Tensor, lse: &Tensor) -> Result<()> {
        let [b, sq, h, d] = self.dims;
        let (q0, q1) = (call.q_rows.start, call.q_rows.end);
        if q0 > q1 || q1 > sq {
            return Err(Error::FlashAttnPlan(format!(
                "call q_rows {q0}..{q1} outside the {sq} rows of the accumulator"
            )));
        }
        let n = q1 - q0;
        if out.dims() != [b, n, h, d] {
            return Err(Error::Shape {
                tensor: "out",
                got: out.dims().to_vec(),
                expected: format!("[{b}, {n}, {h}, {d}] (batch, call rows, q_heads, head_dim)"),
            });
        }
        if lse.dims() != [b, h, n] {
            return Err(Error::Shape {
                tensor: "lse",
                got: lse.dims().to_vec(),
                expected: format!("[{b}, {h}, {n}] (batch, q_heads, call rows)"),
            });
        }
        let lse = lse_from_flash_attn(lse)?;
        if n == 0 || b == 0 || h == 0 || d == 0 {
            return Ok(());
        }
        let cur_o = self.out.narrow(1, q0, n)?;
        let cur_l = self.lse.narrow(2, q0, n)?;
        let (mo, ml) = crate::merge::merge(&cur_o, &cur_l, out, &lse)?;
        self.out = splice(&self.out, 1, q0, q1, mo)?;
        self.lse = splice(&self.lse, 2, q0, q1, ml)?;
        Ok(())
    }

    /// The accumulated `out` (batch, seq_q, q_heads, head_dim) f32 and `lse`
    /// (batch, q_heads, seq_q) f32 (`-inf` on rows with no allowed key).
    pub fn finish(self) -> (Tensor, Tensor) {
        (self.out, self.lse)
    }
}

/// `t` with indices `a..b` of dimension `dim` replaced by `mid`.
fn splice(t: &Tensor, dim: usize, a: usize, b: usize, mid: Tensor) -> Result<Tensor> {
    let n = t.dim(dim)?;
    if a == 0 && b == n {
        return Ok(mid);
    }
    let mut parts = Vec::with_capacity(3);
    if a > 0 {
        parts.push(t.narrow(dim, 0, a)?);
    }
    parts.push(mid);
    if b < n {
        parts.push(t.narrow(dim, b, n - b)?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

// ----------------------------------------------------------------------------------------------
// Planning internals. Band offsets are i128 with +-INF for unbounded.

/// Rows `row0..row0 + len` of a block hold positions `pos0 + i * stride` and one document.
#[derive(Clone, Copy, Debug)]
struct Seg {
    row0: usize,
    len: usize,
    pos0: i128,
    /// 0 for a one-row segment (which fits any stride).
    stride: i128,
    doc: Option<u32>,
}

/// Maximal arithmetic-progression segments of `p` with a constant document.
fn segments(p: &Positions, docs: Option<&[u32]>) -> Vec<Seg> {
    let n = p.len();
    if let (Positions::Range { start, len }, None) = (p, docs) {
        if *len == 0 {
            return Vec::new();
        }
        return vec![Seg {
            row0: 0,
            len: *len,
            pos0: *start as i128,
            stride: if *len > 1 { 1 } else { 0 },
            doc: None,
        }];
    }
    let pos = |i: usize| p.get(i) as i128;
    let doc = |i: usize| docs.and_then(|d| d.get(p.get(i)).copied());
    // End of the maximal run starting at row r.
    let run_end = |r: usize| -> usize {
        let d0 = doc(r);
        if r + 1 >= n || doc(r + 1) != d0 {
            return r + 1;
        }
        let s = pos(r + 1) - pos(r);
        let mut e = r + 2;
        while e < n && doc(e) == d0 && pos(e) - pos(e - 1) == s {
            e += 1;
        }
        e
    };
    let mut segs = Vec::new();
    let mut r = 0;
    while r < n {
        let mut e = run_end(r);
        // A two-row run whose second row starts a longer run: keep the first row alone, so the
        // longer run stays whole (e.g. 0, 5, 6, 7 -> [0], [5, 6, 7]).
        if e == r + 2 && run_end(r + 1) >= r + 4 {
            e = r + 1;
        }
        let len = e - r;
        segs.push(Seg {
            row0: r,
            len,
            pos0: pos(r),
            stride: if len > 1 { pos(r + 1) - pos(r) } else { 0 },
            doc: doc(r),
        });
        r = e;
    }
    segs
}

#[derive(Clone, Copy, Debug)]
struct Rule {
    causal: bool,
    window: Option<i128>,
}

impl Rule {
    /// The band `[L, U]` of `m = j - i` allowed between a q segment at `pos0_q + i * s` and a
    /// k segment at `pos0_k + j * s`, or `None` when nothing is allowed.
    fn band(&self, d: i128, s: i128) -> Option<(i128, i128)> {
        // x = pq - pk = d - m * s must lie in [xlo, xhi].
        let mut xlo = if self.causal { 0 } else { -INF };
        let mut xhi = INF;
        if let Some(w) = self.window {
            xhi = xhi.min(w - 1);
            if !self.causal {
                xlo = xlo.max(1 - w);
            }
        }
        if xlo > xhi {
            return None;
        }
        let (lo, hi) = match s.signum() {
            0 => return (xlo <= d && d <= xhi).then_some((-INF, INF)),
            1 => (
                if xhi >= INF {
                    -INF
                } else {
                    ceil_div(d - xhi, s)
                },
                if xlo <= -INF {
                    INF
                } else {
                    floor_div(d - xlo, s)
                },
            ),
            _ => {
                let t = -s;
                (
                    if xlo <= -INF {
                        -INF
                    } else {
                        ceil_div(xlo - d, t)
                    },
                    if xhi >= INF {
                        INF
                    } else {
                        floor_div(xhi - d, t)
                    },
                )
            }
        };
        (lo <= hi).then_some((lo, hi))
    }
}

fn floor_div(a: i128, b: i128) -> i128 {
    a.div_euclid(b)
}

fn ceil_div(a: i128, b: i128) -> i128 {
    -(-a).div_euclid(b)
}

struct Planner<'a> {
    rule: Rule,
    opts: &'a FlashAttnPlanOptions,
    calls: Vec<FlashAttnCall>,
}

/// A band between q rows `q0 + i` (i < nq) and k rows `k0 + j` (j < nk): `j - i in [l, u]`.
#[derive(Clone, Copy, Debug)]
struct Band {
    q0: usize,
    nq: i128,
    k0: usize,
    nk: i128,
    l: i128,
    u: i128,
}

impl Band {
    /// Keys `[kj0, kj1)` seen by some row of `[r0, r1)`.
    fn keys(&self, r0: i128, r1: i128) -> (i128, i128) {
        ((r0 + self.l).max(0), (r1 + self.u).min(self.nk))
    }
}

impl Planner<'_> {
    fn pair(&mut self, qs: &Seg, ks: &Seg) -> Result<()> {
        if qs.doc != ks.doc {
            return Ok(());
        }
        let s = match (qs.len > 1, ks.len > 1) {
            (true, true) if qs.stride != ks.stride => return self.mixed_strides(qs, ks),
            (true, _) => qs.stride,
            (false, true) => ks.stride,
            (false, false) => 0,
        };
        let Some((l, u)) = self.rule.band(qs.pos0 - ks.pos0, s) else {
            return Ok(());
        };
        self.band(Band {
            q0: qs.row0,
            nq: qs.len as i128,
            k0: ks.row0,
            nk: ks.len as i128,
            l,
            u,
        })
    }

    /// Different strides: one call per row of the shorter segment.
    fn mixed_strides(&mut self, qs: &Seg, ks: &Seg) -> Result<()> {
        let one = |s: &Seg, i: usize| Seg {
            row0: s.row0 + i,
            len: 1,
            pos0: s.pos0 + i as i128 * s.stride,
            stride: 0,
            doc: s.doc,
        };
        if qs.len <= ks.len {
            for i in 0..qs.len {
                self.pair(&one(qs, i), ks)?;
            }
        } else {
            for j in 0..ks.len {
                self.pair(qs, &one(ks, j))?;
            }
        }
        Ok(())
    }

    fn band(&mut self, b: Band) -> Result<()> {
        if b.l > b.u {
            return Ok(());
        }
        // Rows with at least one key: i + u >= 0 and i + l <= nk - 1.
        let qi0 = (-b.u).max(0);
        let qi1 = (b.nk - b.l).min(b.nq);
        if qi0 >= qi1 {
            return Ok(());
        }
        let (kj0, kj1) = b.keys(qi0, qi1);
        if kj0 >= kj1 {
            return Ok(());
        }
        if let Some(m) = classify(&b, qi0, qi1, kj0, kj1) {
            if self.opts.allow_local || !m.is_local() {
                return self.push(&b, qi0, qi1, kj0, kj1, m);
            }
        }
        // Split: A = rows whose band ends inside the keys (right = 0), B1 = rows seeing every key,
        // B2 = rows seeing a suffix of the keys.
        let a1 = (b.nk - b.u).clamp(qi0, qi1);
        let b2 = (1 - b.l).clamp(a1, qi1);
        for (r0, r1) in [(qi0, a1), (a1, b2), (b2, qi1)] {
            if r0 < r1 {
                self.part(&b, r0, r1)?;
            }
        }
        Ok(())
    }

    /// One part of a split band: a single call, or per-row / per-key calls where it would need a
    /// local window that the options forbid.
    fn part(&mut self, b: &Band, r0: i128, r1: i128) -> Result<()> {
        let (k0, k1) = b.keys(r0, r1);
        if k0 >= k1 {
            return Ok(());
        }
        match classify(b, r0, r1, k0, k1) {
            Some(m) if self.opts.allow_local || !m.is_local() => self.push(b, r0, r1, k0, k1, m),
            Some(_) => {
                if r1 - r0 <= k1 - k0 {
                    for r in r0..r1 {
                        let (a, c) = b.keys(r, r + 1);
                        self.push(b, r, r + 1, a, c, FlashAttnMask::NONE)?;
                    }
                } else {
                    for k in k0..k1 {
                        // Rows i with k - u <= i <= k - l.
                        let (a, c) = ((k - b.u).max(r0), (k - b.l + 1).min(r1));
                        self.push(b, a, c, k, k + 1, FlashAttnMask::NONE)?;
                    }
                }
                Ok(())
            }
            None => Err(Error::FlashAttnPlan(format!(
                "internal: no valid flash-attn mask for rows {r0}..{r1}, keys {k0}..{k1} of band \
                 [{}, {}]",
                b.l, b.u
            ))),
        }
    }

    fn push(
        &mut self,
        b: &Band,
        r0: i128,
        r1: i128,
        k0: i128,
        k1: i128,
        mask: FlashAttnMask,
    ) -> Result<()> {
        if let Some(max) = self.opts.max_calls {
            if self.calls.len() >= max {
                return Err(Error::FlashAttnPlan(format!(
                    "the spec needs more than {max} flash-attn calls"
                )));
            }
        }
        // All four lie in [0, nq] / [0, nk] here, so the casts are exact.
        self.calls.push(FlashAttnCall {
            q_rows: b.q0 + r0 as usize..b.q0 + r1 as usize,
            k_rows: b.k0 + k0 as usize..b.k0 + k1 as usize,
            mask,
        });
        Ok(())
    }
}

/// The flash-attn mask of the call on rows `[qi0, qi1)`, keys `[kj0, kj1)` of band `b` (every
/// row seeing at least one key), or `None` when flash-attn cannot take the window sizes it needs
/// (a size `>= sk`, or a left bound without a usable right one).
fn classify(b: &Band, qi0: i128, qi1: i128, kj0: i128, kj1: i128) -> Option<FlashAttnMask> {
    let (sq, sk) = (qi1 - qi0, kj1 - kj0);
    // In the call's bottom-right aligned frame: j' - i' - (sk - sq) in [-left, right].
    let right = qi1 + b.u - kj1;
    let left = kj1 - qi1 - b.l;
    let right_binding = right < sq - 1;
    let left_binding = left < sk - 1;
    let size = |x: i128| usize::try_from(x).ok();
    match (left_binding, right_binding) {
        (false, false) => Some(FlashAttnMask::NONE),
        (false, true) if right == 0 => Some(FlashAttnMask::CAUSAL),
        (false, true) => (right < sk).then_some(FlashAttnMask {
            window_size_left: None,
            window_size_right: Some(size(right)?),
        }),
        (true, _) => {
            // A left bound needs an explicit right one (flash-attn would use seqlen_k).
            let r = if right_binding { right } else { sq - 1 };
            (r < sk && left < sk).then_some(FlashAttnMask {
                window_size_left: Some(size(left)?),
                window_size_right: Some(size(r)?),
            })
        }
    }
}
