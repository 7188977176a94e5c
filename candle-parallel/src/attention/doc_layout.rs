//! The per-document zigzag layout ([`SeqLayout::DocZigzag`](super::SeqLayout::DocZigzag)):
//! which global positions each ring rank holds when a window packs documents (Megatron's THD
//! packing: zigzag per document instead of over the whole window), and the causal work figure
//! that it balances.
//!
//! The rule, for `R` ring ranks and a window of `S` tokens (`S % 2R == 0`) whose documents are
//! the maximal runs of equal id in its document ids:
//! 1. a document of `L >= 2R` tokens is cut into `2R` chunks of `q = ⌊L / 2R⌋` tokens from its
//!    start; ring rank `r` gets chunks `r` and `2R-1-r` (the same tokens and the same causal
//!    work on every rank). Its last `L - 2Rq < 2R` tokens are its *tail*;
//! 2. documents shorter than `2R` tokens are placed whole, longest first (ties: earlier first),
//!    each on the rank with the most room left (then the least causal work, then the lowest
//!    rank), a rank's room being `S / R` minus the tokens it holds; a short document that fits
//!    whole on no rank is deferred to step 3;
//! 3. the tails in window order, then the deferred short documents, fill the room that is left:
//!    each run goes to the rank with room and the least causal work so far, as many of its
//!    tokens as fit there, the rest to the next such rank.
//!
//! Every ring rank ends with exactly `S / R` tokens, listed in increasing position; nothing is
//! padded (every token is one rank's, once). A short document is cut only in step 3, when whole
//! placement cannot fill every rank exactly (a window of a few short documents only, say).
//!
//! Causal work ([`ring_work`]) counts, for each query, the keys of its document at or before it:
//! what a causal document mask lets attention compute, whatever the strategy and its tiles.

use std::cmp::Reverse;
use std::ops::Range;

use super::layout::ShardPlan;
use crate::error::{Error, Result};

/// Every ring rank's positions, concatenated in ring-rank order (ring rank `r` holds
/// `order[r·S/R .. (r+1)·S/R]`), for a window with per-token `doc_ids` over `ring` ranks.
/// Errors unless `S` is a positive multiple of `2·ring`.
pub fn doc_zigzag_order(doc_ids: &[u32], ring: usize) -> Result<Vec<u32>> {
    let s = doc_ids.len();
    if ring == 0 || s == 0 || !s.is_multiple_of(2 * ring) {
        return Err(Error::invalid(
            "doc-zigzag layout",
            format!("{s} tokens do not split into 2 x {ring} ring chunks"),
        ));
    }
    let cap = s / ring;
    let two = 2 * ring;
    let mut ranks = vec![Held::default(); ring];
    let mut short = Vec::new();
    let mut runs = Vec::new();
    for doc in documents(doc_ids) {
        let q = doc.len() / two;
        if q == 0 {
            short.push(doc);
            continue;
        }
        for (r, held) in ranks.iter_mut().enumerate() {
            for j in [r, two - 1 - r] {
                let c = doc.start + j * q;
                held.take(c..c + q, doc.start);
            }
        }
        if doc.start + two * q < doc.end {
            runs.push((doc.start + two * q..doc.end, doc.start));
        }
    }
    // Step 2: short documents whole, longest first (the sort is stable: earlier first on ties).
    short.sort_by_key(|d| Reverse(d.len()));
    let mut deferred = Vec::new();
    for doc in short {
        let best = (0..ring)
            .max_by_key(|&r| (cap - ranks[r].len(), Reverse(ranks[r].work), Reverse(r)))
            .unwrap_or(0);
        if cap - ranks[best].len() >= doc.len() {
            let start = doc.start;
            ranks[best].take(doc, start);
        } else {
            let start = doc.start;
            deferred.push((doc, start));
        }
    }
    // Step 3: tails, then deferred short documents, fill the room left.
    for (mut run, doc_start) in runs.into_iter().chain(deferred) {
        while !run.is_empty() {
            let r = (0..ring)
                .filter(|&r| ranks[r].len() < cap)
                .min_by_key(|&r| (ranks[r].work, r))
                .ok_or_else(|| {
                    Error::invalid("doc-zigzag layout", "internal: no ring rank has room left")
                })?;
            let n = (cap - ranks[r].len()).min(run.len());
            ranks[r].take(run.start..run.start + n, doc_start);
            run.start += n;
        }
    }
    Ok(ranks
        .into_iter()
        .flat_map(|mut h| {
            h.positions.sort_unstable();
            h.positions
        })
        .collect())
}

/// The causal work of every ring rank of `plan`: for each of its queries, the keys of the same
/// document at or before it (`doc_ids` per token of the window; `None`: one document).
pub fn ring_work(plan: &ShardPlan, doc_ids: Option<&[u32]>) -> Result<Vec<u64>> {
    let s = plan.seq_len();
    let ones;
    let ids = match doc_ids {
        Some(d) if d.len() == s => d,
        Some(d) => {
            return Err(Error::invalid(
                "ring work",
                format!("{} document ids for a window of {s} tokens", d.len()),
            ))
        }
        None => {
            ones = vec![0u32; s];
            &ones
        }
    };
    let mut offset = vec![0u64; s];
    for doc in documents(ids) {
        for (o, p) in doc.enumerate() {
            offset[p] = o as u64;
        }
    }
    Ok((0..plan.ring())
        .map(|r| {
            plan.ring_positions(r)
                .iter()
                .map(|&p| offset[p as usize] + 1)
                .sum()
        })
        .collect())
}

/// The busiest rank's work over the mean (1 when perfectly balanced, and for no work at all).
pub fn max_over_mean(work: &[u64]) -> f64 {
    let max = work.iter().copied().max().unwrap_or(0) as f64;
    let sum: u64 = work.iter().sum();
    if sum == 0 {
        return 1.0;
    }
    max * work.len() as f64 / sum as f64
}

/// The documents of a window: the maximal runs of equal id.
fn documents(doc_ids: &[u32]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=doc_ids.len() {
        if i == doc_ids.len() || doc_ids[i] != doc_ids[start] {
            out.push(start..i);
            start = i;
        }
    }
    out
}

/// What one ring rank holds so far: positions and their causal work.
#[derive(Debug, Clone, Default)]
struct Held {
    positions: Vec<u32>,
    work: u64,
}

impl Held {
    fn len(&self) -> usize {
        self.positions.len()
    }

    /// Takes positions `run` of the document starting at `doc_start`.
    fn take(&mut self, run: Range<usize>, doc_start: usize) {
        for p in run {
            self.positions.push(p as u32);
            self.work += (p - doc_start + 1) as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::SeqLayout;

    fn ids(lens: &[usize]) -> Vec<u32> {
        lens.iter()
            .enumerate()
            .flat_map(|(d, &l)| std::iter::repeat_n(d as u32, l))
            .collect()
    }

    fn ring_lists(order: &[u32], ring: usize) -> Vec<Vec<u32>> {
        order
            .chunks(order.len() / ring)
            .map(|c| c.to_vec())
            .collect()
    }

    #[test]
    fn one_document_is_zigzag() {
        let order = doc_zigzag_order(&[0; 16], 4).unwrap();
        let zigzag = ShardPlan::new(16, SeqLayout::Zigzag, 4, 1).unwrap();
        assert_eq!(order, zigzag.concat_order());
    }

    #[test]
    fn every_document_is_zigzagged() {
        // Documents 8 and 16 over 2 ranks (2R = 4): chunks of 2 and 4.
        let order = doc_zigzag_order(&ids(&[8, 16]), 2).unwrap();
        let r = ring_lists(&order, 2);
        assert_eq!(r[0], vec![0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]);
        assert_eq!(r[1], vec![2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]);
    }

    #[test]
    fn short_documents_whole_and_tails_fill() {
        // 2R = 4: documents 3, 2 and 1 are short; 17 = 4 x 4 + tail 1, 9 = 4 x 2 + tail 1.
        let lens = [3, 17, 2, 9, 1];
        let order = doc_zigzag_order(&ids(&lens), 2).unwrap();
        let r = ring_lists(&order, 2);
        let mut all = order.clone();
        all.sort_unstable();
        assert_eq!(all, (0..32).collect::<Vec<u32>>());
        // Each short document lies whole on one rank.
        for doc in [0..3u32, 20..22, 31..32] {
            let owners: Vec<usize> = (0..2)
                .filter(|&k| r[k].iter().any(|p| doc.contains(p)))
                .collect();
            assert_eq!(owners.len(), 1, "document {doc:?} on ranks {owners:?}");
        }
        // Every rank holds chunks r and 3-r of both long documents, in increasing order.
        for (k, held) in r.iter().enumerate() {
            for (start, q) in [(3u32, 4u32), (22, 2)] {
                for j in [k as u32, 3 - k as u32] {
                    let c = start + j * q;
                    assert!((c..c + q).all(|p| held.contains(&p)), "rank {k} chunk {j}");
                }
            }
            assert!(held.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn only_short_documents_still_fill_every_rank() {
        // 2R = 4, S = 8: documents 3, 3, 2 cannot go whole onto ranks of 4 tokens.
        let order = doc_zigzag_order(&ids(&[3, 3, 2]), 2).unwrap();
        let mut all = order.clone();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
        assert!(doc_zigzag_order(&ids(&[3, 3]), 2).is_err());
    }

    #[test]
    fn work_of_one_document_zigzag_is_balanced() {
        let plan = ShardPlan::new(64, SeqLayout::Zigzag, 4, 1).unwrap();
        let w = ring_work(&plan, None).unwrap();
        assert_eq!(w.iter().sum::<u64>(), 64 * 65 / 2);
        assert_eq!(max_over_mean(&w), 1.0);
        let contiguous = ShardPlan::new(64, SeqLayout::Contiguous, 4, 1).unwrap();
        assert!(max_over_mean(&ring_work(&contiguous, None).unwrap()) > 1.5);
    }
}
