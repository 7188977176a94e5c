//! How a model's layers are cut into pipeline stages.

use std::ops::Range;

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
}
