//! Sharding of a global sequence over the `ring × ulysses` ranks of a sequence-parallel group.
//!
//! Two levels (USP's Algorithm 2, generalised to any ring layout):
//! 1. the ring layout gives each ring rank `r` a list of `S / ring` global positions
//!    ([`ShardPlan::ring_positions`]): contiguous `[r·S/P, (r+1)·S/P)`, zigzag chunks `r` and
//!    `2P-1-r` of `2P`, striped `r, r+P, r+2P, ...`, or zigzag per document of the window's
//!    document mask ([`ShardPlan::for_mask`], rule in [`super::doc_layout`]);
//! 2. that list is cut into `ulysses` contiguous pieces; ulysses rank `u` holds piece `u`
//!    ([`ShardPlan::local_positions`]).
//!
//! After Ulysses' all-to-all (which concatenates the pieces of a ulysses group in rank order),
//! every rank of ring rank `r` holds exactly the tokens of `ring_positions(r)`, in that order:
//! the kv block that travels on the ring. Positions for RoPE, labels and document ids follow the
//! same permutation: cut them with [`ShardPlan::shard`] like the activations.
//!
//! Nothing here communicates except [`ShardPlan::gather`].

use std::sync::Arc;

use candle_core::Tensor;
use flash_ring::Positions;

use super::config::SeqLayout;
use super::doc_layout::doc_zigzag_order;
use super::mask::AttnMask;
use crate::collectives;
use crate::comm::Comm;
use crate::error::{Error, Result};

/// The global positions of every rank's tokens for one sequence length, layout and grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    seq_len: usize,
    layout: SeqLayout,
    ring: usize,
    ulysses: usize,
    /// [`SeqLayout::DocZigzag`] with documents: every ring rank's positions, concatenated.
    doc_order: Option<Arc<[u32]>>,
}

impl ShardPlan {
    /// Validates that `seq_len` splits: a multiple of `layout.pieces(ring)` and of
    /// `ring · ulysses`, at least one token per rank, and below `u32::MAX`. With one ring rank
    /// every layout is the contiguous one (zigzag's two chunks of rank 0 are in order), so any
    /// length works there.
    pub fn new(seq_len: usize, layout: SeqLayout, ring: usize, ulysses: usize) -> Result<Self> {
        let op = "shard plan";
        let layout = if ring == 1 {
            SeqLayout::Contiguous
        } else {
            layout
        };
        if ring == 0 || ulysses == 0 {
            return Err(Error::invalid(
                op,
                format!("degrees must be at least 1, got ring {ring} x ulysses {ulysses}"),
            ));
        }
        if seq_len >= u32::MAX as usize {
            return Err(Error::invalid(
                op,
                format!("sequence length {seq_len} does not fit u32 positions"),
            ));
        }
        let pieces = layout.pieces(ring);
        if seq_len == 0 || !seq_len.is_multiple_of(pieces) {
            return Err(Error::invalid(
                op,
                format!(
                    "sequence length {seq_len} is not a positive multiple of the {pieces} chunks \
                     that the {layout} layout needs on {ring} ring ranks"
                ),
            ));
        }
        if !(seq_len / ring).is_multiple_of(ulysses) {
            return Err(Error::invalid(
                op,
                format!(
                    "sequence length {seq_len} over {ring} ring ranks gives {} tokens each, not \
                     divisible by the ulysses degree {ulysses}",
                    seq_len / ring
                ),
            ));
        }
        Ok(Self {
            seq_len,
            layout,
            ring,
            ulysses,
            doc_order: None,
        })
    }

    /// [`ShardPlan::new`] for a window under `mask`: with [`SeqLayout::DocZigzag`] and a
    /// document mask, each document is zigzagged over the ring ranks
    /// ([`super::doc_layout`]); any other layout or mask gives [`ShardPlan::new`]'s plan (a
    /// window without documents is one document: doc-zigzag is zigzag). Errors as `new`, and
    /// when the document ids do not cover `seq_len` tokens.
    pub fn for_mask(
        seq_len: usize,
        layout: SeqLayout,
        ring: usize,
        ulysses: usize,
        mask: &AttnMask,
    ) -> Result<Self> {
        let mut plan = Self::new(seq_len, layout, ring, ulysses)?;
        if let (SeqLayout::DocZigzag, Some(ids)) = (plan.layout, mask.doc_ids()) {
            mask.check("shard plan", seq_len)?;
            plan.doc_order = Some(doc_zigzag_order(ids, ring)?.into());
        }
        Ok(plan)
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn layout(&self) -> SeqLayout {
        self.layout
    }

    pub fn ring(&self) -> usize {
        self.ring
    }

    pub fn ulysses(&self) -> usize {
        self.ulysses
    }

    /// Tokens per rank, `S / (ring · ulysses)`.
    pub fn local_len(&self) -> usize {
        self.seq_len / (self.ring * self.ulysses)
    }

    /// Tokens per ring rank (the kv block of the ring), `S / ring`.
    pub fn ring_len(&self) -> usize {
        self.seq_len / self.ring
    }

    /// The global positions covered by ring rank `r` (`r < ring`), in its order.
    pub fn ring_positions(&self, r: usize) -> Vec<u32> {
        let (s, p) = (self.seq_len, self.ring);
        if let Some(order) = &self.doc_order {
            let n = s / p;
            return order[r * n..(r + 1) * n].to_vec();
        }
        match self.layout {
            SeqLayout::Contiguous => {
                let n = s / p;
                (r * n..(r + 1) * n).map(|i| i as u32).collect()
            }
            SeqLayout::Zigzag | SeqLayout::DocZigzag => {
                let c = s / (2 * p);
                let second = 2 * p - 1 - r;
                (r * c..(r + 1) * c)
                    .chain(second * c..(second + 1) * c)
                    .map(|i| i as u32)
                    .collect()
            }
            SeqLayout::Striped => (r..s).step_by(p).map(|i| i as u32).collect(),
        }
    }

    /// [`ShardPlan::ring_positions`] of ring rank `r` as runs of consecutive positions
    /// `[start, end)`, in its order, where they are a few runs: one for contiguous, two for
    /// zigzag. `None` for striped (a run per token) and per-document layouts. For costing
    /// layouts at millions of tokens without listing them.
    pub fn ring_runs(&self, r: usize) -> Option<Vec<(u64, u64)>> {
        let (s, p, r) = (self.seq_len as u64, self.ring as u64, r as u64);
        if self.doc_order.is_some() {
            return None;
        }
        match self.layout {
            SeqLayout::Contiguous => Some(vec![(r * (s / p), (r + 1) * (s / p))]),
            SeqLayout::Zigzag | SeqLayout::DocZigzag => {
                let c = s / (2 * p);
                let second = 2 * p - 1 - r;
                Some(vec![(r * c, (r + 1) * c), (second * c, (second + 1) * c)])
            }
            SeqLayout::Striped => None,
        }
    }

    /// The global positions of the tokens of rank (`ring_rank`, `ulysses_rank`), in local order.
    pub fn local_positions(&self, ring_rank: usize, ulysses_rank: usize) -> Vec<u32> {
        let n = self.local_len();
        let mut all = self.ring_positions(ring_rank);
        all.drain(..ulysses_rank * n);
        all.truncate(n);
        all
    }

    /// The index of rank (`ring_rank`, `ulysses_rank`) in the order [`ShardPlan::unshard`]
    /// expects: `ring_rank · ulysses + ulysses_rank`.
    pub fn shard_index(&self, ring_rank: usize, ulysses_rank: usize) -> usize {
        ring_rank * self.ulysses + ulysses_rank
    }

    /// Every rank's positions concatenated in [`ShardPlan::shard_index`] order (a permutation
    /// of `0..S`).
    pub fn concat_order(&self) -> Vec<u32> {
        if let Some(order) = &self.doc_order {
            return order.to_vec();
        }
        (0..self.ring)
            .flat_map(|r| self.ring_positions(r))
            .collect()
    }

    /// Rank (`ring_rank`, `ulysses_rank`)'s shard of `global`, whose `dim` is the sequence
    /// (length `S`). Differentiable (index_select), no communication.
    pub fn shard(
        &self,
        global: &Tensor,
        dim: usize,
        ring_rank: usize,
        ulysses_rank: usize,
    ) -> Result<Tensor> {
        self.check_len("shard", global, dim, self.seq_len)?;
        if ring_rank >= self.ring || ulysses_rank >= self.ulysses {
            return Err(Error::invalid(
                "shard",
                format!(
                    "rank (ring {ring_rank}, ulysses {ulysses_rank}) outside the grid ring {} x \
                     ulysses {}",
                    self.ring, self.ulysses
                ),
            ));
        }
        let pos = self.local_positions(ring_rank, ulysses_rank);
        take(global, dim, pos)
    }

    /// The global tensor from all shards, `parts[shard_index(r, u)]`, each with `dim` of length
    /// `local_len`. Pure; differentiable.
    pub fn unshard(&self, parts: &[Tensor], dim: usize) -> Result<Tensor> {
        if parts.len() != self.ring * self.ulysses {
            return Err(Error::invalid(
                "unshard",
                format!(
                    "{} parts given for a grid of {} ranks",
                    parts.len(),
                    self.ring * self.ulysses
                ),
            ));
        }
        for p in parts {
            self.check_len("unshard", p, dim, self.local_len())?;
        }
        let cat = Tensor::cat(parts, dim)?;
        self.reorder_concat(&cat, dim)
    }

    /// Collective over `ulysses` then `ring` (sizes of this plan): every rank gets the global
    /// tensor in global order. Differentiable with replicated-loss semantics: the gradient of
    /// the result on every rank flows back to this rank's shard.
    pub fn gather(
        &self,
        local: &Tensor,
        dim: usize,
        ulysses: &Comm,
        ring: &Comm,
    ) -> Result<Tensor> {
        self.check_len("gather", local, dim, self.local_len())?;
        if ulysses.size() != self.ulysses || ring.size() != self.ring {
            return Err(Error::invalid(
                "gather",
                format!(
                    "communicator sizes ulysses {} x ring {} differ from the plan's {} x {}",
                    ulysses.size(),
                    ring.size(),
                    self.ulysses,
                    self.ring
                ),
            ));
        }
        let mut x = local.clone();
        if self.ulysses > 1 {
            x = collectives::gather(&x, ulysses, dim)?;
        }
        if self.ring > 1 {
            x = collectives::gather(&x, ring, dim)?;
        }
        self.reorder_concat(&x, dim)
    }

    /// From [`ShardPlan::concat_order`] to global order along `dim`.
    fn reorder_concat(&self, cat: &Tensor, dim: usize) -> Result<Tensor> {
        let order = self.concat_order();
        if order.iter().enumerate().all(|(i, &p)| p as usize == i) {
            return Ok(cat.clone());
        }
        let mut inverse = vec![0u32; order.len()];
        for (i, &p) in order.iter().enumerate() {
            inverse[p as usize] = i as u32;
        }
        take(cat, dim, inverse)
    }

    fn check_len(&self, op: &'static str, t: &Tensor, dim: usize, want: usize) -> Result<()> {
        let got = t.dim(dim).map_err(|_| {
            Error::invalid(
                op,
                format!("dim {dim} out of range for shape {:?}", t.dims()),
            )
        })?;
        if got != want {
            return Err(Error::invalid(
                op,
                format!(
                    "dim {dim} of shape {:?} has {got} tokens, the plan needs {want} (sequence \
                     {}, {} layout, ring {} x ulysses {})",
                    t.dims(),
                    self.seq_len,
                    self.layout,
                    self.ring,
                    self.ulysses
                ),
            ));
        }
        Ok(())
    }
}

/// Rows `idx` of `t` along `dim` (a contiguous narrow when `idx` is a range).
fn take(t: &Tensor, dim: usize, idx: Vec<u32>) -> Result<Tensor> {
    if let Positions::Range { start, len } = positions(&idx) {
        return Ok(t.narrow(dim, start, len)?);
    }
    let n = idx.len();
    let ids = Tensor::from_vec(idx, n, t.device())?;
    Ok(t.index_select(&ids, dim)?)
}

/// flash-ring [`Positions`] of a list: a `Range` when contiguous, else a `List`.
pub fn positions(pos: &[u32]) -> Positions {
    match pos.first() {
        Some(&p0)
            if pos
                .iter()
                .enumerate()
                .all(|(i, &p)| p as usize == p0 as usize + i) =>
        {
            Positions::range(p0 as usize, pos.len())
        }
        None => Positions::range(0, 0),
        _ => Positions::list(pos.to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_partition_the_sequence() {
        for layout in SeqLayout::ALL {
            for (ring, ulysses) in [
                (1, 1),
                (2, 1),
                (4, 1),
                (8, 1),
                (2, 2),
                (2, 4),
                (4, 2),
                (1, 4),
            ] {
                let plan = ShardPlan::new(64, layout, ring, ulysses).unwrap();
                let mut all: Vec<u32> = (0..ring)
                    .flat_map(|r| (0..ulysses).map(move |u| (r, u)))
                    .flat_map(|(r, u)| plan.local_positions(r, u))
                    .collect();
                all.sort_unstable();
                assert_eq!(
                    all,
                    (0..64).collect::<Vec<u32>>(),
                    "{layout} {ring}x{ulysses}"
                );
            }
        }
    }

    #[test]
    fn zigzag_and_usp_algorithm_2() {
        // USP Figure 3: 16 tokens on 4 ranks, rank 0 holds 0,1,14,15 and rank 3 holds 6,7,8,9.
        let plan = ShardPlan::new(16, SeqLayout::Zigzag, 4, 1).unwrap();
        assert_eq!(plan.ring_positions(0), vec![0, 1, 14, 15]);
        assert_eq!(plan.ring_positions(3), vec![6, 7, 8, 9]);
        // Algorithm 2 with ring 2, ulysses 2: reorder = chunks r, 3-r of 4; ulysses takes halves.
        let usp = ShardPlan::new(16, SeqLayout::Zigzag, 2, 2).unwrap();
        assert_eq!(usp.local_positions(0, 0), vec![0, 1, 2, 3]);
        assert_eq!(usp.local_positions(0, 1), vec![12, 13, 14, 15]);
        assert_eq!(usp.local_positions(1, 1), vec![8, 9, 10, 11]);
        let striped = ShardPlan::new(8, SeqLayout::Striped, 4, 1).unwrap();
        assert_eq!(striped.ring_positions(1), vec![1, 5]);
    }

    #[test]
    fn invalid_lengths() {
        assert!(ShardPlan::new(12, SeqLayout::Zigzag, 4, 1).is_err());
        // One ring rank: every layout is contiguous, odd lengths included.
        let one = ShardPlan::new(5, SeqLayout::Zigzag, 1, 1).unwrap();
        assert_eq!(one.local_positions(0, 0), vec![0, 1, 2, 3, 4]);
        assert!(ShardPlan::new(12, SeqLayout::Contiguous, 4, 1).is_ok());
        assert!(ShardPlan::new(16, SeqLayout::Zigzag, 4, 3).is_err());
        assert!(ShardPlan::new(0, SeqLayout::Striped, 1, 1).is_err());
        assert!(ShardPlan::new(8, SeqLayout::Striped, 0, 1).is_err());
    }

    #[test]
    fn shard_unshard_round_trip() {
        let x = Tensor::arange(0u32, 48, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((2, 24))
            .unwrap();
        for layout in SeqLayout::ALL {
            let plan = ShardPlan::new(24, layout, 2, 3).unwrap();
            let parts: Vec<Tensor> = (0..2)
                .flat_map(|r| (0..3).map(move |u| (r, u)))
                .map(|(r, u)| plan.shard(&x, 1, r, u).unwrap())
                .collect();
            let back = plan.unshard(&parts, 1).unwrap();
            assert_eq!(back.to_vec2::<u32>().unwrap(), x.to_vec2::<u32>().unwrap());
        }
    }
}
