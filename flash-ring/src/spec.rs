//! Attention specification: global token positions of a block, mask kinds, documents, window.
//!
//! A query row `i` may attend a key row `j` iff, with `pq`/`pk` their global positions:
//! `(mask == Full || pk <= pq) && same_doc(pq, pk) && within_window(pq, pk)`, where
//! `same_doc` holds when no `doc_ids` are given or `doc_ids[pq] == doc_ids[pk]`, and
//! `within_window` holds when no window is given, or `pq - pk < w` (causal; `pk <= pq` already
//! holds) / `|pq - pk| < w` (full).
//!
//! Logits: with `s = scale * (q . k)`, the softmax takes `s` itself, or `c * tanh(s / c)` with a
//! logit soft-cap `c` ([`AttnSpec::softcap`], Gemma 2/3's `attn_logit_softcapping`). The cap
//! applies after the scale and before the mask: masked pairs are left out (`-inf`) whatever
//! their capped value, and the returned LSE is that of the capped logits.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Global positions of the tokens of a block, in the block's row order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Positions {
    /// Rows hold positions `start, start + 1, ..., start + len - 1`.
    Range { start: usize, len: usize },
    /// Row `i` holds position `list[i]` (any order, e.g. striped or zigzag gathers).
    List(Arc<[u32]>),
}

impl Positions {
    /// Contiguous positions `start..start + len`.
    pub fn range(start: usize, len: usize) -> Self {
        Positions::Range { start, len }
    }

    /// Explicit positions, one per row.
    pub fn list(positions: impl Into<Arc<[u32]>>) -> Self {
        Positions::List(positions.into())
    }

    /// Number of rows described.
    pub fn len(&self) -> usize {
        match self {
            Positions::Range { len, .. } => *len,
            Positions::List(l) => l.len(),
        }
    }

    /// True when no rows are described.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Global position of row `i`. `i` must be `< len()` (panics otherwise, like slice indexing).
    pub fn get(&self, i: usize) -> usize {
        match self {
            Positions::Range { start, .. } => start + i,
            Positions::List(l) => l[i] as usize,
        }
    }

    /// Positions of rows `offset..offset + len` (e.g. a key block cut out of a longer sequence).
    pub fn slice(&self, offset: usize, len: usize) -> Result<Positions> {
        let end = offset.checked_add(len).filter(|&e| e <= self.len());
        if end.is_none() {
            return Err(Error::Config(format!(
                "Positions::slice({offset}, {len}) out of range for {} rows",
                self.len()
            )));
        }
        Ok(match self {
            Positions::Range { start, .. } => Positions::Range {
                start: start + offset,
                len,
            },
            Positions::List(l) => Positions::List(l[offset..offset + len].into()),
        })
    }

    /// Largest position, `None` when empty.
    pub fn max(&self) -> Option<usize> {
        match self {
            Positions::Range { start, len } => (*len > 0).then(|| start + len - 1),
            Positions::List(l) => l.iter().max().map(|&p| p as usize),
        }
    }
}

/// Kind of positional mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskKind {
    /// Every key is visible (bidirectional, e.g. DiT).
    Full,
    /// A query sees keys at global positions `<=` its own.
    Causal,
}

/// What an attention call computes: scale, mask and the global positions of its rows.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnSpec {
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Positional mask.
    pub mask: MaskKind,
    /// Global positions of the q rows (length must equal seq_q).
    pub q_pos: Positions,
    /// Global positions of the k/v rows (length must equal seq_k).
    pub k_pos: Positions,
    /// Per-token document id indexed by GLOBAL position (whole sequence). A token may attend
    /// another only when both have the same id.
    pub doc_ids: Option<Arc<[u32]>>,
    /// Sliding window: allowed iff `pq - pk < w` (causal) or `|pq - pk| < w` (full).
    pub window: Option<usize>,
    /// Logit soft-cap `c` (Gemma 2/3's `attn_logit_softcapping`): the softmax takes
    /// `c * tanh(s / c)` for the scaled logit `s = scale * (q . k)`, capping logits to
    /// `(-c, c)`; the mask applies after the cap (masked pairs stay excluded), the LSE is of
    /// the capped logits and the backward carries `d(capped)/ds = 1 - tanh^2(s / c)`. `None`:
    /// no cap (the softmax takes `s`). Must be finite and `> 0` (checked by every call).
    pub softcap: Option<f32>,
}

impl AttnSpec {
    /// A spec with no documents and no window.
    pub fn new(scale: f32, mask: MaskKind, q_pos: Positions, k_pos: Positions) -> Self {
        AttnSpec {
            scale,
            mask,
            q_pos,
            k_pos,
            doc_ids: None,
            window: None,
            softcap: None,
        }
    }

    /// Plain single-block attention: q rows at positions `0..seq_q`, k rows at `0..seq_k`.
    pub fn dense(scale: f32, mask: MaskKind, seq_q: usize, seq_k: usize) -> Self {
        Self::new(
            scale,
            mask,
            Positions::range(0, seq_q),
            Positions::range(0, seq_k),
        )
    }

    /// Adds per-token document ids (indexed by global position).
    pub fn with_doc_ids(mut self, doc_ids: Arc<[u32]>) -> Self {
        self.doc_ids = Some(doc_ids);
        self
    }

    /// Adds document ids built from cumulative sequence lengths (see [`doc_ids_from_cu_seqlens`]).
    pub fn with_cu_seqlens(self, cu_seqlens: &[usize]) -> Result<Self> {
        Ok(self.with_doc_ids(doc_ids_from_cu_seqlens(cu_seqlens)?))
    }

    /// Adds a sliding window of `window` tokens.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    /// Caps the logits softly at `c`: the softmax takes `c * tanh(s / c)`, `s = scale * q . k`
    /// (see [`AttnSpec::softcap`]). `c` must be finite and `> 0`; a call with any other value
    /// fails with [`Error::Config`].
    pub fn with_softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }

    /// The same spec (scale, mask, documents, window, soft-cap) for another pair of blocks (e.g.
    /// the next ring step).
    pub fn with_positions(&self, q_pos: Positions, k_pos: Positions) -> Self {
        AttnSpec {
            q_pos,
            k_pos,
            ..self.clone()
        }
    }

    /// Whether a query at global position `pq` may attend a key at `pk`. Positions outside
    /// `doc_ids` are treated as not allowed (validation rejects them before any kernel runs).
    pub fn allowed(&self, pq: usize, pk: usize) -> bool {
        if self.mask == MaskKind::Causal && pk > pq {
            return false;
        }
        if let Some(w) = self.window {
            if pq.abs_diff(pk) >= w {
                return false;
            }
        }
        if let Some(d) = &self.doc_ids {
            match (d.get(pq), d.get(pk)) {
                (Some(a), Some(b)) if a == b => {}
                _ => return false,
            }
        }
        true
    }

    /// Checks the soft-cap: finite, `> 0`, and `scale / c` finite (the kernels scale q by it).
    pub(crate) fn check_softcap(&self) -> Result<()> {
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::Config(format!(
                    "spec.softcap must be finite and > 0, got {c}"
                )));
            }
            // The kernels scale q by `scale / c`.
            if self.scale.is_finite() && !(self.scale / c).is_finite() {
                return Err(Error::Config(format!(
                    "spec.softcap {c} is too small for spec.scale {}: scale / softcap overflows",
                    self.scale
                )));
            }
        }
        Ok(())
    }

    /// Checks the positions against the row counts and the document table, the scale and the
    /// soft-cap.
    pub(crate) fn validate(&self, seq_q: usize, seq_k: usize) -> Result<()> {
        for (positions, tensor, len, rows) in [
            ("spec.q_pos", "q", self.q_pos.len(), seq_q),
            ("spec.k_pos", "k", self.k_pos.len(), seq_k),
        ] {
            if len != rows {
                return Err(Error::PositionsLen {
                    positions,
                    tensor,
                    len,
                    rows,
                });
            }
        }
        if !self.scale.is_finite() {
            return Err(Error::Config(format!(
                "spec.scale must be finite, got {}",
                self.scale
            )));
        }
        self.check_softcap()?;
        if let Some(d) = &self.doc_ids {
            for (name, p) in [("spec.q_pos", &self.q_pos), ("spec.k_pos", &self.k_pos)] {
                if let Some(m) = p.max() {
                    if m >= d.len() {
                        return Err(Error::DocIdsTooShort {
                            positions: name,
                            pos: m,
                            len: d.len(),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

/// Document ids from cumulative sequence lengths `[0, l0, l0 + l1, ...]` (as in flash-attn
/// varlen): token `t` with `cu[i] <= t < cu[i + 1]` gets id `i`. Must start at 0 and not decrease.
pub fn doc_ids_from_cu_seqlens(cu_seqlens: &[usize]) -> Result<Arc<[u32]>> {
    match cu_seqlens.first() {
        None => return Err(Error::CuSeqlens("empty".into())),
        Some(&f) if f != 0 => {
            return Err(Error::CuSeqlens(format!("must start at 0, starts at {f}")))
        }
        _ => {}
    }
    if cu_seqlens.len() - 1 > u32::MAX as usize {
        return Err(Error::CuSeqlens("too many documents".into()));
    }
    let mut ids = Vec::with_capacity(*cu_seqlens.last().unwrap_or(&0));
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(Error::CuSeqlens(format!(
                "decreases at index {}: {} < {}",
                i + 1,
                w[1],
                w[0]
            )));
        }
        ids.extend(std::iter::repeat_n(i as u32, w[1] - w[0]));
    }
    Ok(ids.into())
}

// ----------------------------------------------------------------------------------------------
// Tile-level mask machinery shared by the kernels.

/// Summary of the positions of one tile of rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileStats {
    pub min: i64,
    pub max: i64,
    /// `Some(p0)` when the rows hold `p0, p0 + 1, ...` (then a row interval mask applies).
    pub contiguous_start: Option<i64>,
    /// Smallest and largest document id in the tile (when documents are used).
    pub doc_min: u32,
    pub doc_max: u32,
}

/// How a (q tile, k tile) pair is masked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TileClass {
    /// Nothing allowed: skip without computing.
    Skip,
    /// Everything allowed: no per-element mask.
    Full,
    /// Mixed: apply the per-element mask.
    Partial,
}

/// Positions and documents of a block resolved into flat arrays, with per-tile stats.
pub(crate) struct BlockPos {
    pub pos: Vec<i64>,
    pub doc: Option<Vec<u32>>,
    pub tiles: Vec<TileStats>,
    pub tile: usize,
}

impl BlockPos {
    /// Resolves `p` with tiles of `tile` rows. `spec.validate` must have passed.
    pub fn new(p: &Positions, doc_ids: Option<&Arc<[u32]>>, tile: usize) -> Self {
        let n = p.len();
        let pos: Vec<i64> = (0..n).map(|i| p.get(i) as i64).collect();
        let doc: Option<Vec<u32>> = doc_ids.map(|d| pos.iter().map(|&q| d[q as usize]).collect());
        let mut tiles = Vec::with_capacity(n.div_ceil(tile.max(1)));
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + tile).min(n);
            let sl = &pos[t0..t1];
            let (mut min, mut max) = (i64::MAX, i64::MIN);
            let mut contiguous = true;
            for (k, &q) in sl.iter().enumerate() {
                min = min.min(q);
                max = max.max(q);
                if q != sl[0] + k as i64 {
                    contiguous = false;
                }
            }
            let (mut doc_min, mut doc_max) = (0, 0);
            if let Some(d) = &doc {
                doc_min = d[t0..t1].iter().copied().min().unwrap_or(0);
                doc_max = d[t0..t1].iter().copied().max().unwrap_or(0);
            }
            tiles.push(TileStats {
                min,
                max,
                contiguous_start: contiguous.then_some(sl[0]),
                doc_min,
                doc_max,
            });
            t0 = t1;
        }
        BlockPos {
            pos,
            doc,
            tiles,
            tile,
        }
    }
}

/// The mask of a spec, in the integer form the kernels use.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaskRule {
    pub causal: bool,
    pub window: Option<i64>,
    pub docs: bool,
}

impl MaskRule {
    pub fn new(spec: &AttnSpec) -> Self {
        MaskRule {
            causal: spec.mask == MaskKind::Causal,
            window: spec.window.map(|w| w.min(i64::MAX as usize) as i64),
            docs: spec.doc_ids.is_some(),
        }
    }

    /// Classifies a (q tile, k tile) pair from the tiles' stats alone.
    pub fn classify(&self, q: &TileStats, k: &TileStats) -> TileClass {
        let mut full = true;
        if self.causal {
            if k.min > q.max {
                return TileClass::Skip;
            }
            full &= k.max <= q.min;
        }
        if let Some(w) = self.window {
            // Allowed iff pq - pk < w and (full mask) pk - pq < w.
            if q.min - k.max >= w {
                return TileClass::Skip;
            }
            full &= q.max - k.min < w;
            if !self.causal {
                if k.min - q.max >= w {
                    return TileClass::Skip;
                }
                full &= k.max - q.min < w;
            }
        }
        if self.docs {
            if q.doc_max < k.doc_min || k.doc_max < q.doc_min {
                return TileClass::Skip;
            }
            full &= q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min;
        }
        if full {
            TileClass::Full
        } else {
            TileClass::Partial
        }
    }

    /// Whether the single pair is allowed.
    #[inline]
    pub fn allowed(&self, pq: i64, pk: i64, dq: u32, dk: u32) -> bool {
        if self.causal && pk > pq {
            return false;
        }
        if let Some(w) = self.window {
            if (pq - pk).abs() >= w {
                return false;
            }
        }
        !self.docs || dq == dk
    }

    /// For a key tile of contiguous positions starting at `k0` with `kn` rows and no documents,
    /// the allowed columns of a query at `pq` are one interval `[lo, hi)`.
    #[inline]
    pub fn row_interval(&self, pq: i64, k0: i64, kn: usize) -> (usize, usize) {
        let kn_i = kn as i64;
        let mut lo = 0i64;
        let mut hi = kn_i;
        if self.causal {
            hi = hi.min(pq - k0 + 1);
        }
        if let Some(w) = self.window {
            lo = lo.max(pq - w - k0 + 1);
            if !self.causal {
                hi = hi.min(pq + w - k0);
            }
        }
        let lo = lo.clamp(0, kn_i) as usize;
        let hi = hi.clamp(0, kn_i) as usize;
        (lo, hi.max(lo))
    }

    /// Columns `[lo, hi)` of key tile `kt` (with `kn` rows) that hold every allowed key of the
    /// query rows `rows` (indices into `qb`): the union of their row intervals when the tile is
    /// contiguous and no documents are used, else all of `[0, kn)`. `lo >= hi` means no row of
    /// `rows` sees any key of the tile.
    pub fn col_window(
        &self,
        qb: &BlockPos,
        rows: std::ops::Range<usize>,
        kb: &BlockPos,
        kt: usize,
        kn: usize,
    ) -> (usize, usize) {
        match (kb.tiles[kt].contiguous_start, self.docs) {
            (Some(k0), false) => {
                let (mut lo, mut hi) = (kn, 0);
                for i in rows {
                    let (a, b) = self.row_interval(qb.pos[i], k0, kn);
                    if a < b {
                        lo = lo.min(a);
                        hi = hi.max(b);
                    }
                }
                (lo, hi)
            }
            _ => (0, kn),
        }
    }

    /// Writes `fill` into the columns of `row` (a query at global index `qi` of `qb`) that
    /// are masked against key tile `kt` of `kb`. `row` holds the tile's `kn` columns.
    #[inline]
    pub fn mask_row(
        &self,
        qb: &BlockPos,
        qi: usize,
        kb: &BlockPos,
        kt: usize,
        row: &mut [f32],
        fill: f32,
    ) {
        let kn = row.len();
        let pq = qb.pos[qi];
        let k_start = kt * kb.tile;
        match (kb.tiles[kt].contiguous_start, self.docs) {
            (Some(k0), false) => {
                let (lo, hi) = self.row_interval(pq, k0, kn);
                row[..lo].fill(fill);
                row[hi..].fill(fill);
            }
            _ => {
                let dq = qb.doc.as_ref().map_or(0, |d| d[qi]);
                let kpos = &kb.pos[k_start..k_start + kn];
                for (j, x) in row.iter_mut().enumerate() {
                    let dk = kb.doc.as_ref().map_or(0, |d| d[k_start + j]);
                    if !self.allowed(pq, kpos[j], dq, dk) {
                        *x = fill;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_to_doc_ids() {
        let d = doc_ids_from_cu_seqlens(&[0, 2, 2, 5]).unwrap();
        assert_eq!(&*d, &[0, 0, 2, 2, 2]);
        assert!(doc_ids_from_cu_seqlens(&[1, 2]).is_err());
        assert!(doc_ids_from_cu_seqlens(&[0, 3, 2]).is_err());
        assert!(doc_ids_from_cu_seqlens(&[]).is_err());
    }

    #[test]
    fn classify_matches_elementwise() {
        // Exhaustive check: the tile class must agree with the per-element rule.
        let docs: Arc<[u32]> = (0..40u32).map(|i| i / 7).collect::<Vec<_>>().into();
        for mask in [MaskKind::Full, MaskKind::Causal] {
            for window in [None, Some(1), Some(5), Some(13)] {
                for use_docs in [false, true] {
                    let mut spec = AttnSpec::dense(1.0, mask, 40, 40);
                    spec.window = window;
                    if use_docs {
                        spec.doc_ids = Some(docs.clone());
                    }
                    let rule = MaskRule::new(&spec);
                    let qp = Positions::list((0..20u32).map(|i| (i * 7) % 40).collect::<Vec<_>>());
                    let qb = BlockPos::new(&qp, spec.doc_ids.as_ref(), 4);
                    let kb = BlockPos::new(&Positions::range(3, 30), spec.doc_ids.as_ref(), 8);
                    for (qt, qs) in qb.tiles.iter().enumerate() {
                        for (kt, ks) in kb.tiles.iter().enumerate() {
                            let c = rule.classify(qs, ks);
                            let qn = (qb.pos.len() - qt * 4).min(4);
                            let kn = (kb.pos.len() - kt * 8).min(8);
                            let mut any = false;
                            let mut all = true;
                            for i in 0..qn {
                                let mut row = vec![0.0f32; kn];
                                rule.mask_row(&qb, qt * 4 + i, &kb, kt, &mut row, -1.0);
                                for (j, &x) in row.iter().enumerate() {
                                    let pq = qb.pos[qt * 4 + i] as usize;
                                    let pk = kb.pos[kt * 8 + j] as usize;
                                    let ok = spec.allowed(pq, pk);
                                    assert_eq!(ok, x == 0.0, "mask_row disagrees at {pq},{pk}");
                                    any |= ok;
                                    all &= ok;
                                }
                            }
                            match c {
                                TileClass::Skip => assert!(!any),
                                TileClass::Full => assert!(all),
                                TileClass::Partial => {}
                            }
                        }
                    }
                }
            }
        }
    }
}
