//! How a model's layers are cut into pipeline stages: by their cost ([`split_by_cost`], the
//! default), evenly as Llama 3 and torchtitan do ([`split_layers`]), or as the user says
//! ([`LayerSplit`], `--pp-layers`).

use std::ops::Range;
use std::str::FromStr;

use crate::error::{Error, Result};

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid("pipeline stages", msg)
}

/// The decoder layers of each of `virtual_stages` stages (in virtual-stage order), covering
/// `0..num_layers` in order.
///
/// - `explicit`: layers per virtual stage as the user gave them (`--pp-layers`); they must
///   have one entry per virtual stage and add up to `num_layers`.
/// - Otherwise the default of Llama 3 and torchtitan: the embedding and the output layer with
///   the loss each count as one layer, the `num_layers + 2` units are split as evenly as
///   possible (earlier stages take the remainder), and the first and last stage each give up
///   the unit they hold for the embedding and the loss, so they get fewer decoder layers.
///
/// Errors when a stage would get no layer in the middle of the pipeline (the model is too
/// shallow for this many stages) or the explicit counts do not fit.
pub fn split_layers(
    num_layers: usize,
    virtual_stages: usize,
    explicit: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    if virtual_stages == 0 {
        return Err(invalid("no pipeline stage"));
    }
    let counts: Vec<usize> = match explicit {
        Some(c) => {
            if c.len() != virtual_stages {
                return Err(invalid(format!(
                    "{} layer counts given for {virtual_stages} stages (--pp times \
                     --virtual-stages)",
                    c.len()
                )));
            }
            let total: usize = c.iter().sum();
            if total != num_layers {
                return Err(invalid(format!(
                    "layer counts {c:?} add up to {total}, the model has {num_layers} layers"
                )));
            }
            c.to_vec()
        }
        None if virtual_stages == 1 => vec![num_layers],
        None => {
            let units = num_layers + 2;
            if units < virtual_stages {
                return Err(invalid(format!(
                    "{num_layers} layers (plus the embedding and the loss) cannot fill \
                     {virtual_stages} stages"
                )));
            }
            let (base, extra) = (units / virtual_stages, units % virtual_stages);
            let mut c: Vec<usize> = (0..virtual_stages)
                .map(|s| base + usize::from(s < extra))
                .collect();
            c[0] -= 1;
            c[virtual_stages - 1] -= 1;
            c
        }
    };
    if let Some(s) = (1..virtual_stages.saturating_sub(1)).find(|&s| counts[s] == 0) {
        return Err(invalid(format!(
            "stage {s} of {virtual_stages} would hold no decoder layer ({counts:?})"
        )));
    }
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|&n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect())
}

/// What each piece of a model costs, in any one unit (FLOPs per token, seconds): the layers in
/// order, and what the first and the last stage hold besides their layers (the embedding, a
/// vision tower; the final norm, the head and the loss).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StageCosts {
    pub first: f64,
    pub layers: Vec<f64>,
    pub last: f64,
}

impl StageCosts {
    /// `num_layers` layers of cost 1 and free ends.
    pub fn uniform(num_layers: usize) -> Self {
        Self {
            first: 0.0,
            layers: vec![1.0; num_layers],
            last: 0.0,
        }
    }

    /// The cost of each of `ranges` (covering the layers in order), the first with
    /// [`StageCosts::first`] and the last with [`StageCosts::last`].
    pub fn of(&self, ranges: &[Range<usize>]) -> Vec<f64> {
        let n = ranges.len();
        ranges
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let mut c: f64 = self.layers[r.clone()].iter().sum();
                if k == 0 {
                    c += self.first;
                }
                if k + 1 == n {
                    c += self.last;
                }
                c
            })
            .collect()
    }
}

/// How `--pp-layers` cuts the layers into virtual stages: `auto` (the default: by cost,
/// [`split_by_cost`]), `even` (Llama 3's and torchtitan's rule, [`split_layers`]) or the
/// layers of each virtual stage (`3,5,5,3`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum LayerSplit {
    #[default]
    Auto,
    Even,
    Counts(Vec<usize>),
}

impl FromStr for LayerSplit {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "even" => Ok(Self::Even),
            counts => counts
                .split(',')
                .map(|c| c.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Self::Counts)
                .map_err(|_| {
                    format!(
                        "`{s}`: give `auto`, `even` or the layers of each virtual stage, \
                         e.g. 3,5,5,3"
                    )
                }),
        }
    }
}

impl std::fmt::Display for LayerSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Even => f.write_str("even"),
            Self::Counts(c) => {
                let c: Vec<String> = c.iter().map(|n| n.to_string()).collect();
                f.write_str(&c.join(","))
            }
        }
    }
}

impl LayerSplit {
    /// The layers of each of `virtual_stages` stages of a model whose pieces cost `costs`.
    /// Errors as [`split_layers`] and [`split_by_cost`].
    pub fn split(&self, costs: &StageCosts, virtual_stages: usize) -> Result<Vec<Range<usize>>> {
        let n = costs.layers.len();
        match self {
            Self::Auto => split_by_cost(costs, virtual_stages),
            Self::Even => split_layers(n, virtual_stages, None),
            Self::Counts(c) => split_layers(n, virtual_stages, Some(c)),
        }
    }
}

/// Relative slack under which two costs count as equal (the costs' own rounding).
const COST_TIE: f64 = 1e-9;

/// The layers of each of `virtual_stages` stages, cut so that the costliest stage (its layers,
/// plus [`StageCosts::first`] on the first and [`StageCosts::last`] on the last) costs as little
/// as possible: the stage every micro-batch waits for sets a pipeline's pace. Among the cuts
/// that reach it, the one with the least sum of squared stage costs (the most even), and among
/// those the one whose earlier stages are larger (as [`split_layers`]). With uniform layers and
/// free ends this is the even split. Middle stages get at least one layer; the first and the
/// last may get none when their ends cost as much as layers.
///
/// Errors when there is no stage, the model has fewer layers than middle stages, or a cost is
/// negative or not finite.
pub fn split_by_cost(costs: &StageCosts, virtual_stages: usize) -> Result<Vec<Range<usize>>> {
    let (v, n) = (virtual_stages, costs.layers.len());
    if v == 0 {
        return Err(invalid("no pipeline stage"));
    }
    let all = costs.layers.iter().chain([&costs.first, &costs.last]);
    if let Some(c) = all.into_iter().find(|c| !c.is_finite() || **c < 0.0) {
        return Err(invalid(format!(
            "a layer cost of {c}: costs must be finite and not negative"
        )));
    }
    if v == 1 {
        return Ok(std::iter::once(0..n).collect());
    }
    if n < v - 2 {
        return Err(invalid(format!(
            "{n} layers (plus the embedding and the loss) cannot fill {v} stages"
        )));
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.layers.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    // Stage k over layers i..j: may it be empty, and what does it cost.
    let cost = |k: usize, i: usize, j: usize| {
        let mut c = prefix[j] - prefix[i];
        if k == 0 {
            c += costs.first;
        }
        if k == v - 1 {
            c += costs.last;
        }
        c
    };
    let allowed = |k: usize, i: usize, j: usize| j > i || k == 0 || k == v - 1;
    // best[k][i]: for stages k.. over layers i..n, the least (max stage cost) and then, under
    // `cap`, the least sum of squares; `None` where no cut exists.
    let solve = |cap: Option<f64>| -> Vec<Vec<Option<f64>>> {
        let mut best = vec![vec![None; n + 1]; v + 1];
        best[v][n] = Some(0.0);
        for k in (0..v).rev() {
            for i in 0..=n {
                let mut b: Option<f64> = None;
                // Rows 0..=k, and row k + 1 (the stages after this one).
                let (rows, next) = best.split_at_mut(k + 1);
                for (j, rest) in next[0].iter().enumerate().skip(i) {
                    if !allowed(k, i, j) {
                        continue;
                    }
                    let Some(rest) = *rest else { continue };
                    let c = cost(k, i, j);
                    let val = match cap {
                        None => c.max(rest),
                        Some(cap) if c <= cap => c * c + rest,
                        Some(_) => continue,
                    };
                    if b.is_none_or(|b| val < b) {
                        b = Some(val);
                    }
                }
                rows[k][i] = b;
            }
        }
        best
    };
    let bottleneck =
        solve(None)[0][0].ok_or_else(|| invalid(format!("{n} layers cannot fill {v} stages")))?;
    let cap = bottleneck * (1.0 + COST_TIE) + f64::MIN_POSITIVE;
    let best = solve(Some(cap));
    // Walk forward: at each stage the largest stage whose remainder stays optimal.
    let mut out = Vec::with_capacity(v);
    let mut i = 0;
    for k in 0..v {
        let target = best[k][i].ok_or_else(|| invalid("no cut under the bottleneck"))?;
        let j = (i..=n)
            .rev()
            .filter(|&j| allowed(k, i, j) && cost(k, i, j) <= cap)
            .find(|&j| {
                best[k + 1][j].is_some_and(|rest| {
                    let c = cost(k, i, j);
                    c * c + rest <= target * (1.0 + COST_TIE) + f64::MIN_POSITIVE
                })
            })
            .ok_or_else(|| invalid("no cut under the bottleneck"))?;
        out.push(i..j);
        i = j;
    }
    Ok(out)
}

/// Collective over the pipeline group `pp`: every rank's named tensors arrive on rank 0, which
/// returns all of them sorted by name (a name that several stages hold, such as a tied
/// embedding, is kept once, from the lowest rank); the other ranks return an empty list. For
/// saving a whole model from its stages.
pub fn gather_to_first(
    pp: &crate::comm::Comm,
    named: Vec<(String, candle_core::Tensor)>,
) -> Result<Vec<(String, candle_core::Tensor)>> {
    use candle_core::{DType, Device, Shape, Tensor};
    if pp.rank() != 0 {
        // Header: one line `name <tab> dims <tab> dtype` per tensor, after its byte length.
        let header: String = named
            .iter()
            .map(|(n, t)| {
                let dims: Vec<String> = t.dims().iter().map(|d| d.to_string()).collect();
                format!("{n}\t{}\t{}\n", dims.join(","), t.dtype().as_str())
            })
            .collect();
        let bytes = header.into_bytes();
        let len = bytes.len();
        pp.send(&Tensor::new(&[len as u32], &Device::Cpu)?, 0)?;
        pp.send(&Tensor::from_vec(bytes, len, &Device::Cpu)?, 0)?;
        for (_, t) in &named {
            pp.send(&t.contiguous()?, 0)?;
        }
        return Ok(Vec::new());
    }
    let mut all: std::collections::BTreeMap<String, Tensor> = named.into_iter().collect();
    for src in 1..pp.size() {
        let len = pp
            .recv(src, &Shape::from(1), DType::U32)?
            .to_vec1::<u32>()?[0] as usize;
        let bytes = pp
            .recv(src, &Shape::from(len), DType::U8)?
            .to_vec1::<u8>()?;
        let header = String::from_utf8(bytes).map_err(|e| invalid(e.to_string()))?;
        for line in header.lines() {
            let bad = || invalid(format!("rank {src} sent a bad header line `{line}`"));
            let mut f = line.split('\t');
            let (name, dims, dtype) = match (f.next(), f.next(), f.next()) {
                (Some(n), Some(d), Some(t)) => (n, d, t),
                _ => return Err(bad()),
            };
            let dims = dims
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.parse::<usize>().map_err(|_| bad()))
                .collect::<Result<Vec<_>>>()?;
            let dtype: DType = dtype.parse().map_err(|_| bad())?;
            let t = pp.recv(src, &Shape::from(dims), dtype)?;
            all.entry(name.to_string()).or_insert(t);
        }
    }
    Ok(all.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_get_fewer_layers_by_default() {
        // 30 layers + 2 units over 4 stages: 8 each, the ends give one up.
        assert_eq!(
            split_layers(30, 4, None).unwrap(),
            vec![0..7, 7..15, 15..23, 23..30]
        );
        assert_eq!(
            split_layers(2, 4, None).unwrap(),
            vec![0..0, 0..1, 1..2, 2..2]
        );
        assert_eq!(split_layers(5, 1, None).unwrap(), vec![0..5]);
        assert_eq!(split_layers(6, 3, None).unwrap(), vec![0..2, 2..5, 5..6]);
    }

    #[test]
    fn explicit_counts_and_errors() {
        assert_eq!(
            split_layers(6, 3, Some(&[1, 2, 3])).unwrap(),
            vec![0..1, 1..3, 3..6]
        );
        let e = |n, s, c: Option<&[usize]>| split_layers(n, s, c).unwrap_err().to_string();
        assert!(e(6, 3, Some(&[1, 2])).contains("2 layer counts given for 3 stages"));
        assert!(e(6, 3, Some(&[1, 2, 2])).contains("add up to 5"));
        assert!(e(6, 3, Some(&[3, 0, 3])).contains("stage 1 of 3 would hold no decoder layer"));
        assert!(e(2, 8, None).contains("cannot fill 8 stages"));
        assert!(e(2, 0, None).contains("no pipeline stage"));
    }

    fn costs(first: f64, layers: &[f64], last: f64) -> StageCosts {
        StageCosts {
            first,
            layers: layers.to_vec(),
            last,
        }
    }

    /// Every cut of `n` layers into `v` stages (middle stages not empty), by brute force.
    fn all_cuts(n: usize, v: usize) -> Vec<Vec<Range<usize>>> {
        fn rec(
            i: usize,
            k: usize,
            n: usize,
            v: usize,
            cur: &mut Vec<Range<usize>>,
            out: &mut Vec<Vec<Range<usize>>>,
        ) {
            if k == v {
                if i == n {
                    out.push(cur.clone());
                }
                return;
            }
            for j in i..=n {
                if j == i && k != 0 && k != v - 1 {
                    continue;
                }
                if k == v - 1 && j != n {
                    continue;
                }
                cur.push(i..j);
                rec(j, k + 1, n, v, cur, out);
                cur.pop();
            }
        }
        let mut out = Vec::new();
        rec(0, 0, n, v, &mut Vec::new(), &mut out);
        out
    }

    /// Free ends and equal layers: the even split, earlier stages taking the remainder.
    #[test]
    fn equal_layers_and_free_ends_split_evenly() {
        let split = |n, v| split_by_cost(&StageCosts::uniform(n), v).unwrap();
        assert_eq!(split(8, 2), vec![0..4, 4..8]);
        assert_eq!(split(7, 2), vec![0..4, 4..7]);
        assert_eq!(split(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(split(5, 1), vec![0..5]);
        assert_eq!(split(3, 3), vec![0..1, 1..2, 2..3]);
    }

    /// The benchmark model of docs/benchmarks.md (8 layers, a head of 0.57 layers): 4 + 4 on
    /// two stages (5 + 3 would make the first stage the slowest, 5.0 > 4.57); on four virtual
    /// stages two layers each (the even split's 2, 3, 2, 1 puts 3 layers on one chunk).
    /// Llama 3 8B's shape (32 layers, a head of about 2.4 layers): the head's stage gets
    /// fewer layers than the even split's 7.
    #[test]
    fn the_head_takes_the_place_of_layers() {
        let c = costs(0.0, &[1.0; 8], 0.57);
        assert_eq!(split_by_cost(&c, 2).unwrap(), vec![0..4, 4..8]);
        assert_eq!(split_by_cost(&c, 4).unwrap(), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(
            split_layers(8, 4, None).unwrap(),
            vec![0..2, 2..5, 5..7, 7..8]
        );
        let llama = costs(0.0, &[1.0; 32], 2.4);
        let auto = split_by_cost(&llama, 4).unwrap();
        let even = split_layers(32, 4, None).unwrap();
        let worst_stage = |r: &[Range<usize>]| worst(&llama.of(r));
        assert_eq!(auto, vec![0..9, 9..18, 18..26, 26..32]);
        assert!(
            worst_stage(&auto) < worst_stage(&even),
            "{auto:?} vs {even:?}"
        );
        // The head alone costs more than a stage of layers: the last stage holds no layer.
        let heavy = costs(0.0, &[1.0, 1.0], 1.6);
        assert_eq!(split_by_cost(&heavy, 2).unwrap(), vec![0..2, 2..2]);
    }

    /// The largest of `xs`, NaN if any is NaN.
    fn worst(xs: &[f64]) -> f64 {
        xs.iter()
            .fold(f64::NEG_INFINITY, |m, &x| testkit::max_or_nan(m, x))
    }

    /// Against every cut, by brute force, on uneven layers (windowed and global, sparse and
    /// dense) with costly ends: no cut has a cheaper costliest stage, and among those that tie
    /// none is more even (sum of squares).
    #[test]
    fn the_cut_is_optimal_by_brute_force() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..200 {
            let n = 1 + case % 9;
            let v = 1 + case % 4;
            if n + 2 < v {
                continue;
            }
            let layers: Vec<f64> = (0..n).map(|_| 0.2 + 2.0 * next()).collect();
            let c = costs(1.5 * next(), &layers, 3.0 * next());
            let got = split_by_cost(&c, v).unwrap();
            assert_eq!(got.len(), v);
            assert_eq!(got.first().map(|r| r.start), Some(0));
            assert_eq!(got.last().map(|r| r.end), Some(n));
            let score = |r: &[Range<usize>]| {
                let sc = c.of(r);
                (worst(&sc), sc.iter().map(|x| x * x).sum::<f64>())
            };
            let (max, sq) = score(&got);
            for cut in all_cuts(n, v) {
                let (m, q) = score(&cut);
                assert!(
                    m >= max * (1.0 - 1e-9),
                    "case {case}: {cut:?} ({m}) beats {got:?} ({max})"
                );
                if m <= max * (1.0 + 1e-9) {
                    assert!(
                        q >= sq * (1.0 - 1e-9),
                        "case {case}: {cut:?} is more even than {got:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn layer_split_flag_and_errors() {
        assert_eq!("auto".parse::<LayerSplit>(), Ok(LayerSplit::Auto));
        assert_eq!("even".parse::<LayerSplit>(), Ok(LayerSplit::Even));
        assert_eq!(
            "3, 5,5,3".parse::<LayerSplit>(),
            Ok(LayerSplit::Counts(vec![3, 5, 5, 3]))
        );
        for bad in ["", "3,x", "fast", "-1,2"] {
            let e = bad.parse::<LayerSplit>().unwrap_err();
            assert!(e.contains("`auto`, `even` or the layers"), "{bad}: {e}");
        }
        assert_eq!(LayerSplit::Counts(vec![1, 2]).to_string(), "1,2");
        let c = costs(0.0, &[1.0; 6], 0.0);
        assert_eq!(
            LayerSplit::Even.split(&c, 3).unwrap(),
            split_layers(6, 3, None).unwrap()
        );
        assert_eq!(
            LayerSplit::Counts(vec![1, 2, 3]).split(&c, 3).unwrap(),
            vec![0..1, 1..3, 3..6]
        );
        let e = |c: &StageCosts, v| split_by_cost(c, v).unwrap_err().to_string();
        assert!(e(&c, 0).contains("no pipeline stage"));
        assert!(e(&costs(0.0, &[1.0], 0.0), 4).contains("cannot fill 4 stages"));
        assert!(e(&costs(0.0, &[1.0, f64::NAN], 0.0), 2).contains("finite and not negative"));
        assert!(e(&costs(-1.0, &[1.0], 0.0), 2).contains("finite and not negative"));
    }
}
