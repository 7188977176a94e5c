//! Attention masks of sequence-parallel attention, expressed on GLOBAL token positions.
//!
//! A mask is a property of the global sequence; every block pair of every strategy builds its
//! flash-ring [`AttnSpec`] from it with the global positions of its rows, so the same mask works
//! for any layout. [`MaskBlock`] summarises a block's positions so that a strategy can skip
//! a block pair that is certainly fully masked (it still forwards the block on its ring, except
//! the steps a sliding window leaves to nobody: [`super::ring::ring_steps`]).

use std::sync::Arc;

use flash_ring::{AttnSpec, MaskKind, Positions};

use super::layout::positions;
use crate::error::{Error, Result};

/// Which keys a query may attend, on global positions `pq`, `pk`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttnMask {
    /// Every key (bidirectional, e.g. DiT).
    Full,
    /// Keys at `pk <= pq`.
    Causal,
    /// Packed documents, causal within each: `pk <= pq` and `doc[pk] == doc[pq]`. The ids are
    /// per token of the GLOBAL sequence (length `S`), identical on every rank (Llama 3).
    Documents(Arc<[u32]>),
    /// Packed documents, bidirectional within each: `doc[pk] == doc[pq]`.
    DocumentsFull(Arc<[u32]>),
}

impl AttnMask {
    /// Causal document mask from per-token ids of the global sequence.
    pub fn documents(doc_ids: impl Into<Arc<[u32]>>) -> Self {
        AttnMask::Documents(doc_ids.into())
    }

    /// A document mask from cumulative sequence lengths `[0, l0, l0 + l1, ..., S]` (flash-attn
    /// varlen convention): causal within each document ([`MaskKind::Causal`]) or bidirectional
    /// ([`MaskKind::Full`]).
    pub fn from_cu_seqlens(cu_seqlens: &[usize], within: MaskKind) -> Result<Self> {
        let ids = flash_ring::doc_ids_from_cu_seqlens(cu_seqlens)
            .map_err(|e| Error::invalid("mask", e.to_string()))?;
        Ok(match within {
            MaskKind::Causal => AttnMask::Documents(ids),
            MaskKind::Full => AttnMask::DocumentsFull(ids),
        })
    }

    /// The positional part of the mask.
    pub fn kind(&self) -> MaskKind {
        match self {
            AttnMask::Full | AttnMask::DocumentsFull(_) => MaskKind::Full,
            AttnMask::Causal | AttnMask::Documents(_) => MaskKind::Causal,
        }
    }

    /// Per-token document ids of the global sequence, if any.
    pub fn doc_ids(&self) -> Option<&Arc<[u32]>> {
        match self {
            AttnMask::Documents(d) | AttnMask::DocumentsFull(d) => Some(d),
            AttnMask::Full | AttnMask::Causal => None,
        }
    }

    /// The flash-ring spec of one (q block, kv block) pair.
    pub fn spec(&self, scale: f32, q_pos: Positions, k_pos: Positions) -> AttnSpec {
        let spec = AttnSpec::new(scale, self.kind(), q_pos, k_pos);
        match self.doc_ids() {
            Some(d) => spec.with_doc_ids(d.clone()),
            None => spec,
        }
    }

    /// Fails unless the document ids (if any) cover exactly the `seq_len` global tokens.
    pub fn check(&self, op: &'static str, seq_len: usize) -> Result<()> {
        if let Some(d) = self.doc_ids() {
            if d.len() != seq_len {
                return Err(Error::invalid(
                    op,
                    format!(
                        "the document mask has {} ids, the global sequence has {seq_len} tokens",
                        d.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A block of rows at global positions `pos` (non-empty, inside the document table).
    pub fn block(&self, pos: &[u32]) -> MaskBlock {
        self.block_at(positions(pos))
    }

    /// A block of rows at global positions `pos` (non-empty, inside the document table).
    pub fn block_at(&self, pos: Positions) -> MaskBlock {
        let all = || (0..pos.len()).map(|i| pos.get(i) as u32);
        let min = all().min().unwrap_or(0);
        let max = all().max().unwrap_or(0);
        let (mut doc_min, mut doc_max) = (0, 0);
        if let Some(d) = self.doc_ids() {
            let ids = || all().filter_map(|p| d.get(p as usize).copied());
            doc_min = ids().min().unwrap_or(0);
            doc_max = ids().max().unwrap_or(0);
        }
        MaskBlock {
            positions: pos,
            min,
            max,
            doc_min,
            doc_max,
        }
    }

    /// The rows of the pair (`q`, `k`) worth computing: `(q0, k1)` such that under a causal
    /// mask the q rows before `q0` (a leading run of queries earlier than every key) and the kv
    /// rows from `k1` on (a trailing run of keys later than every query) take part in no
    /// allowed pair. `(0, k.len())` for bidirectional masks. With zigzag blocks this cuts the
    /// half of q or kv that an off-diagonal step cannot use.
    pub fn trim(&self, q: &MaskBlock, k: &MaskBlock) -> (usize, usize) {
        if self.kind() != MaskKind::Causal {
            return (0, k.len());
        }
        let (qp, kp) = (&q.positions, &k.positions);
        let q0 = (0..qp.len())
            .take_while(|&i| (qp.get(i) as u64) < k.min as u64)
            .count();
        let k_tail = (0..kp.len())
            .rev()
            .take_while(|&i| kp.get(i) as u64 > q.max as u64)
            .count();
        (q0, kp.len() - k_tail)
    }

    /// Rows `offset..offset + len` of `b` as a block of this mask.
    pub fn sub_block(&self, b: &MaskBlock, offset: usize, len: usize) -> Result<MaskBlock> {
        let pos = b
            .positions
            .slice(offset, len)
            .map_err(|e| Error::invalid("mask", e.to_string()))?;
        let pos = match pos {
            // A contiguous run cut from a list (a zigzag half) becomes a range.
            Positions::List(l) => positions(&l),
            range => range,
        };
        Ok(self.block_at(pos))
    }

    /// False only when no query of `q` may attend any key of `k` (a conservative test on the
    /// blocks' position and document ranges); a strategy may then skip the pair.
    pub fn may_attend(&self, q: &MaskBlock, k: &MaskBlock) -> bool {
        if self.kind() == MaskKind::Causal && k.min > q.max {
            return false;
        }
        if self.doc_ids().is_some() && (q.doc_max < k.doc_min || k.doc_max < q.doc_min) {
            return false;
        }
        true
    }

    /// False only when no pair of `q` and `k` lies within a sliding window of `w` tokens
    /// (`|pq - pk| < w` for a bidirectional mask, `pq - pk < w` with `pk <= pq` for a causal
    /// one; the causal order itself is [`AttnMask::may_attend`]'s test).
    pub fn window_reaches(&self, q: &MaskBlock, k: &MaskBlock, w: usize) -> bool {
        let w = w as u64;
        let near = |a_min: u32, b_max: u32| (a_min as u64) < b_max as u64 + w;
        match self.kind() {
            MaskKind::Causal => near(q.min, k.max),
            MaskKind::Full => near(q.min, k.max) && near(k.min, q.max),
        }
    }
}

/// The global positions of a block of rows, with the ranges [`AttnMask::may_attend`] reads.
/// Built by [`AttnMask::block`] for one mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskBlock {
    positions: Positions,
    min: u32,
    max: u32,
    doc_min: u32,
    doc_max: u32,
}

impl MaskBlock {
    /// The rows' global positions (a `Range` when contiguous).
    pub fn positions(&self) -> &Positions {
        &self.positions
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_test_is_conservative() {
        let docs: Arc<[u32]> = vec![0, 0, 0, 1, 1, 2, 2, 2].into();
        for mask in [
            AttnMask::Full,
            AttnMask::Causal,
            AttnMask::Documents(docs.clone()),
            AttnMask::DocumentsFull(docs.clone()),
        ] {
            let blocks: Vec<Vec<u32>> =
                vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7], vec![0, 7]];
            for qp in &blocks {
                for kp in &blocks {
                    let spec = mask.spec(1.0, positions(qp), positions(kp));
                    let any = qp
                        .iter()
                        .any(|&a| kp.iter().any(|&b| spec.allowed(a as usize, b as usize)));
                    if any {
                        assert!(mask.may_attend(&mask.block(qp), &mask.block(kp)));
                    }
                }
            }
        }
        assert!(!AttnMask::Causal.may_attend(
            &AttnMask::Causal.block(&[0, 1]),
            &AttnMask::Causal.block(&[2, 3])
        ));
        let d = AttnMask::Documents(docs);
        assert!(!d.may_attend(&d.block(&[6, 7]), &d.block(&[0, 1])));
        assert!(d.check("t", 8).is_ok() && d.check("t", 9).is_err());
    }

    #[test]
    fn trim_cuts_the_unused_zigzag_halves() {
        // Zigzag over 2 ranks, 8 tokens: rank 0 holds [0,1,6,7], rank 1 holds [2,3,4,5].
        let c = AttnMask::Causal;
        let (r0, r1) = (c.block(&[0, 1, 6, 7]), c.block(&[2, 3, 4, 5]));
        assert_eq!(c.trim(&r1, &r0), (0, 2)); // rank 1's q sees only keys 0, 1
        assert_eq!(c.trim(&r0, &r1), (2, 4)); // only queries 6, 7 see rank 1's keys
        assert_eq!(c.trim(&r0, &r0), (0, 4));
        assert_eq!(AttnMask::Full.trim(&r0, &r1), (0, 4));
        let sub = c.sub_block(&r0, 2, 2).unwrap();
        assert_eq!(sub.positions(), &Positions::range(6, 2));
    }
}
