//! Collectives built from one primitive, a grouped send/receive (NCCL's `groupStart` / `send` /
//! `recv` / `groupEnd`): what the NCCL communicator runs, written once over a trait so that the
//! same code is tested on CPU over the local backend's [`Communicator::exchange`], against the
//! local backend's own collectives, bit for bit.
//!
//! - `all_reduce`: chunk `j` of every rank goes to rank `j` ([`chunk_bounds`]), which reduces
//!   the `P` contributions in rank order (f32 for half precision, [`reduce_in_rank_order`]) and
//!   sends the result back to every rank: the bytes of a ring all-reduce, the bits of the other
//!   backends.
//! - `reduce_scatter`: the same first half. `all_gather`, `all_to_all`, `broadcast`: one group.
//!
//! Inputs must be contiguous and on the device the primitive works on (the caller stages them);
//! argument errors are the shared ones of [`super::rules`]. Traffic is the caller's to record.

use candle_core::Tensor;

use super::rules::{
    check_dim, check_divisible, check_rank, chunk_bounds, concat_blocks, pack_chunks,
    reduce_in_rank_order,
};
use super::{RecvSpec, ReduceOp};
use crate::error::{Error, Result};

/// A group of ranks whose only communication is a grouped send/receive.
pub(crate) trait GroupedP2p {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Posts every send and receive as one group (all to or from OTHER ranks); returns the
    /// received tensors in the order of `recvs`.
    fn group(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Vec<Tensor>>;
}

/// A grouped exchange in which sends to and receives from this rank itself are local: the `k`-th
/// receive from this rank is the `k`-th send to it.
pub(crate) fn exchange(
    c: &impl GroupedP2p,
    sends: Vec<(usize, Tensor)>,
    recvs: Vec<RecvSpec>,
) -> Result<Vec<Tensor>> {
    let me = c.rank();
    let (own, sends): (Vec<_>, Vec<_>) = sends.into_iter().partition(|(d, _)| *d == me);
    let remote: Vec<RecvSpec> = recvs.iter().filter(|r| r.src != me).cloned().collect();
    let mut got = c.group(sends, remote)?.into_iter();
    let mut own = own.into_iter().map(|(_, t)| t);
    recvs
        .iter()
        .map(|r| {
            let t = if r.src == me {
                let t = own.next().ok_or_else(|| {
                    Error::invalid("exchange", "a receive from this rank without a send to it")
                })?;
                if t.shape() != &r.shape || t.dtype() != r.dtype {
                    return Err(Error::invalid(
                        "exchange",
                        format!(
                            "the send to this rank is {:?} {:?}, its receive expects {:?} {:?}",
                            t.dims(),
                            t.dtype(),
                            r.shape.dims(),
                            r.dtype
                        ),
                    ));
                }
                t
            } else {
                got.next()
                    .ok_or_else(|| Error::invalid("exchange", "internal: a receive is missing"))?
            };
            Ok(t)
        })
        .collect()
}

/// Row `j` of `rows` (shape `(p, m)`) to rank `j`; the `p` rows received, in rank order.
fn all_to_all_rows(c: &impl GroupedP2p, rows: &Tensor) -> Result<Vec<Tensor>> {
    let p = c.size();
    let sends: Vec<(usize, Tensor)> = (0..p)
        .map(|j| Ok((j, rows.get(j)?)))
        .collect::<Result<_>>()?;
    let recvs: Vec<RecvSpec> = (0..p).map(|j| RecvSpec::like(j, &sends[j].1)).collect();
    exchange(c, sends, recvs)
}

pub(crate) fn all_reduce(c: &impl GroupedP2p, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let (p, me) = (c.size(), c.rank());
    let flat = x.flatten_all()?;
    if x.elem_count() < p {
        // Fewer elements than ranks (a loss, a token count): some chunks would be empty, so
        // every rank reduces the whole tensor instead: the same arithmetic per element, the
        // same bits.
        let sends: Vec<(usize, Tensor)> = (0..p).map(|j| (j, flat.clone())).collect();
        let recvs: Vec<RecvSpec> = (0..p).map(|j| RecvSpec::like(j, &flat)).collect();
        let parts = exchange(c, sends, recvs)?;
        return Ok(reduce_in_rank_order(&parts, op, p)?.reshape(x.shape())?);
    }
    let bounds = chunk_bounds(x.elem_count(), p);
    let sends: Vec<(usize, Tensor)> = bounds
        .iter()
        .enumerate()
        .map(|(j, &(s, l))| Ok((j, flat.narrow(0, s, l)?)))
        .collect::<Result<_>>()?;
    let mine = bounds[me].1;
    let recvs: Vec<RecvSpec> = (0..p).map(|j| RecvSpec::new(j, mine, x.dtype())).collect();
    let parts = exchange(c, sends, recvs)?;
    let reduced = reduce_in_rank_order(&parts, op, p)?;
    let sends: Vec<(usize, Tensor)> = (0..p).map(|j| (j, reduced.clone())).collect();
    let recvs: Vec<RecvSpec> = bounds
        .iter()
        .enumerate()
        .map(|(j, &(_, l))| RecvSpec::new(j, l, x.dtype()))
        .collect();
    let back = exchange(c, sends, recvs)?;
    Ok(Tensor::cat(&back, 0)?.reshape(x.shape())?)
}

pub(crate) fn all_gather(c: &impl GroupedP2p, x: &Tensor, dim: usize) -> Result<Tensor> {
    check_dim("all_gather", x, dim)?;
    let p = c.size();
    let sends: Vec<(usize, Tensor)> = (0..p).map(|j| (j, x.clone())).collect();
    let recvs: Vec<RecvSpec> = (0..p).map(|j| RecvSpec::like(j, x)).collect();
    let got = exchange(c, sends, recvs)?;
    let flat = Tensor::stack(&got, 0)?.flatten_all()?;
    concat_blocks(&flat, x.dims(), p, dim)
}

pub(crate) fn reduce_scatter(
    c: &impl GroupedP2p,
    x: &Tensor,
    dim: usize,
    op: ReduceOp,
) -> Result<Tensor> {
    check_dim("reduce_scatter", x, dim)?;
    let chunk = check_divisible("reduce_scatter", x, dim, c.size())?;
    let p = c.size();
    let rows = pack_chunks(x, dim, p)?.reshape((p, ()))?;
    let parts = all_to_all_rows(c, &rows)?;
    let mut dims = x.dims().to_vec();
    dims[dim] = chunk;
    Ok(reduce_in_rank_order(&parts, op, p)?.reshape(dims)?)
}

pub(crate) fn all_to_all(
    c: &impl GroupedP2p,
    x: &Tensor,
    split_dim: usize,
    concat_dim: usize,
) -> Result<Tensor> {
    check_dim("all_to_all", x, split_dim)?;
    check_dim("all_to_all", x, concat_dim)?;
    let chunk = check_divisible("all_to_all", x, split_dim, c.size())?;
    let p = c.size();
    let rows = pack_chunks(x, split_dim, p)?.reshape((p, ()))?;
    let got = Tensor::stack(&all_to_all_rows(c, &rows)?, 0)?.flatten_all()?;
    let mut piece = x.dims().to_vec();
    piece[split_dim] = chunk;
    concat_blocks(&got, &piece, p, concat_dim)
}

pub(crate) fn broadcast(c: &impl GroupedP2p, x: &Tensor, root: usize) -> Result<Tensor> {
    check_rank("broadcast", "root", root, c.size())?;
    if c.rank() == root {
        let sends = (0..c.size())
            .filter(|&j| j != root)
            .map(|j| (j, x.clone()))
            .collect();
        c.group(sends, Vec::new())?;
        Ok(x.clone())
    } else {
        c.group(Vec::new(), vec![RecvSpec::like(root, x)])?
            .pop()
            .ok_or_else(|| Error::invalid("broadcast", "internal: nothing received"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Comm, LocalWorld};
    use candle_core::{DType, Device};

    /// The primitive over the local backend's grouped exchange.
    struct ViaExchange(Comm);

    impl GroupedP2p for ViaExchange {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn size(&self) -> usize {
            self.0.size()
        }
        fn group(&self, sends: Vec<(usize, Tensor)>, recvs: Vec<RecvSpec>) -> Result<Vec<Tensor>> {
            self.0.exchange(sends, recvs)?.wait()
        }
    }

    fn input(rank: usize, dtype: DType) -> Tensor {
        // (2, 5, 7): 70 elements, uneven all_reduce chunks on 3 and 4 ranks.
        let v: Vec<f32> = (0..70)
            .map(|i| ((i * 7 + rank * 13) % 29) as f32 * 0.37 - 5.0 + rank as f32 * 1e-3)
            .collect();
        Tensor::from_vec(v, (2, 5, 7), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        t.to_dtype(DType::F64)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f64>())
            .unwrap()
            .into_iter()
            .map(f64::to_bits)
            .collect()
    }

    /// Every collective over grouped send/receive equals the local backend's, bit for bit, for
    /// 1 to 4 ranks (uneven all_reduce chunks on 3 and 4; tensors with fewer elements than
    /// ranks), every reduction, f32 and bf16.
    #[test]
    fn collectives_over_grouped_p2p_equal_the_local_backend() {
        for p in [1usize, 2, 3, 4] {
            for dtype in [DType::F32, DType::BF16] {
                LocalWorld::run(p, |comm| -> Result<()> {
                    let x = input(comm.rank(), dtype);
                    let via = ViaExchange(comm.clone());
                    let same = |what: &str, a: Tensor, b: Tensor| {
                        assert_eq!(a.dims(), b.dims(), "{what} p={p} {dtype:?}");
                        assert_eq!(bits(&a), bits(&b), "{what} p={p} {dtype:?}");
                    };
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                        same(
                            "all_reduce",
                            all_reduce(&via, &x, op)?,
                            comm.all_reduce(&x, op)?,
                        );
                    }
                    for dim in 0..3 {
                        same(
                            "all_gather",
                            all_gather(&via, &x, dim)?,
                            comm.all_gather(&x, dim)?,
                        );
                    }
                    let wide = Tensor::cat(&vec![x.clone(); p], 1)?; // dim 1 divisible by p
                    for (split, cat) in [(1, 0), (1, 2), (1, 1)] {
                        same(
                            "all_to_all",
                            all_to_all(&via, &wide, split, cat)?,
                            comm.all_to_all(&wide, split, cat)?,
                        );
                    }
                    same(
                        "reduce_scatter",
                        reduce_scatter(&via, &wide, 1, ReduceOp::Sum)?,
                        comm.reduce_scatter(&wide, 1, ReduceOp::Sum)?,
                    );
                    let root = p - 1;
                    same(
                        "broadcast",
                        broadcast(&via, &x, root)?,
                        comm.broadcast(&x, root)?,
                    );
                    Ok(())
                })
                .unwrap();
            }
        }
    }

    #[test]
    fn bad_arguments_are_the_shared_errors() {
        LocalWorld::run(2, |comm| -> Result<()> {
            let via = ViaExchange(comm.clone());
            let x = input(comm.rank(), DType::F32); // (2, 5, 7)
            let msg = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(msg(all_gather(&via, &x, 3)).contains("dim 3 is out of range"));
            assert!(msg(reduce_scatter(&via, &x, 1, ReduceOp::Sum)).contains("not divisible"));
            assert!(msg(all_to_all(&via, &x, 2, 1)).contains("not divisible"));
            assert!(msg(broadcast(&via, &x, 2)).contains("root 2 is out of range"));
            let wrong = exchange(
                &via,
                vec![(comm.rank(), x.clone())],
                vec![RecvSpec::new(comm.rank(), (2, 2), DType::F32)],
            );
            assert!(msg(wrong.map(|mut v| v.remove(0))).contains("its receive expects"));
            Ok(())
        })
        .unwrap();
    }
}
