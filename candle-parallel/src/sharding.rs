//! How one tensor is cut into equal chunks over a group of ranks ([`FlatShard`]): flattened in
//! row-major order, padded with zeros to a multiple of the group's size; rank `r` holds chunk
//! `r`. ZeRO's sharding ([`crate::optim::zero`]) and the ZeRO-3 units of [`crate::nn::unit`]
//! both use it; it sits below both so that `nn` does not depend on `optim`.

use candle_core::{DType, Tensor};

use crate::collectives;
use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};

/// How one tensor of `numel` elements is split over a sharding group of `size` ranks: flattened,
/// padded with zeros to `size · chunk` elements, rank `rank` holding elements
/// `[rank·chunk, (rank+1)·chunk)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatShard {
    pub numel: usize,
    pub chunk: usize,
    pub rank: usize,
    pub size: usize,
}

impl FlatShard {
    /// Errors when `size` is 0 or `rank >= size`.
    pub fn new(numel: usize, rank: usize, size: usize) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "FlatShard::new",
                format!("rank {rank} of a sharding group of {size}"),
            ));
        }
        Ok(Self {
            numel,
            chunk: numel.div_ceil(size).max(1),
            rank,
            size,
        })
    }

    /// Elements of the tensor (not padding) in this rank's chunk.
    pub fn valid(&self) -> usize {
        self.numel
            .saturating_sub(self.rank * self.chunk)
            .min(self.chunk)
    }

    fn check_full(&self, op: &'static str, full: &Tensor) -> Result<()> {
        if full.elem_count() != self.numel {
            return Err(Error::invalid(
                op,
                format!(
                    "tensor of shape {:?} ({} elements) for a shard of a {}-element tensor",
                    full.dims(),
                    full.elem_count(),
                    self.numel
                ),
            ));
        }
        Ok(())
    }

    /// `full` flattened and padded to `size · chunk` elements.
    fn padded(&self, full: &Tensor) -> Result<Tensor> {
        let flat = full.flatten_all()?;
        let pad = self.size * self.chunk - self.numel;
        if pad == 0 {
            return Ok(flat);
        }
        let zeros = Tensor::zeros(pad, flat.dtype(), flat.device())?;
        Ok(Tensor::cat(&[&flat, &zeros], 0)?)
    }

    /// This rank's chunk `(chunk,)` of `full` (any shape with `numel` elements), a new tensor.
    /// Local.
    pub fn take(&self, full: &Tensor) -> Result<Tensor> {
        self.check_full("FlatShard::take", full)?;
        let start = self.rank * self.chunk;
        let valid = self.valid();
        let flat = full.flatten_all()?;
        let mine = if valid == 0 {
            Tensor::zeros(0, flat.dtype(), flat.device())?
        } else {
            flat.narrow(0, start, valid)?
        };
        if valid == self.chunk {
            return Ok(mine.copy()?);
        }
        let zeros = Tensor::zeros(self.chunk - valid, flat.dtype(), flat.device())?;
        Ok(Tensor::cat(&[&mine, &zeros], 0)?)
    }

    fn check_shard(&self, op: &'static str, shard: &Tensor) -> Result<()> {
        if shard.dims() != [self.chunk] {
            return Err(Error::invalid(
                op,
                format!(
                    "shard of shape {:?}, expected ({},)",
                    shard.dims(),
                    self.chunk
                ),
            ));
        }
        Ok(())
    }

    /// Errors unless `group` is the sharding group this shard was made for (its size and this
    /// rank's place in it): another group would gather or reduce the wrong chunks silently.
    fn check_group(&self, op: &'static str, group: &Comm) -> Result<()> {
        if group.size() != self.size || group.rank() != self.rank {
            return Err(Error::invalid(
                op,
                format!(
                    "shard {} of {} used on rank {} of a group of {}",
                    self.rank,
                    self.size,
                    group.rank(),
                    group.size()
                ),
            ));
        }
        Ok(())
    }

    /// The whole tensor, shaped `shape`, from every rank's chunk. Collective over `group`
    /// (size `self.size`); records nothing.
    pub fn gather(&self, shard: &Tensor, group: &Comm, shape: &[usize]) -> Result<Tensor> {
        self.check_shard("FlatShard::gather", shard)?;
        self.check_group("FlatShard::gather", group)?;
        let all = group.all_gather(&shard.contiguous()?, 0)?;
        Ok(all.narrow(0, 0, self.numel)?.reshape(shape)?)
    }

    /// [`FlatShard::gather`] as a differentiable op: the backward reduce-scatters (sums) the
    /// gradient of the whole tensor over `group`, so a shard `Var` receives the sum over the
    /// group of every rank's gradient for its chunk. Collective (forward and backward).
    pub fn gather_differentiable(
        &self,
        shard: &Tensor,
        group: &Comm,
        shape: &[usize],
    ) -> Result<Tensor> {
        self.check_shard("FlatShard::gather_differentiable", shard)?;
        self.check_group("FlatShard::gather_differentiable", group)?;
        let all = collectives::all_gather(&shard.contiguous()?, group, 0)?;
        Ok(all.narrow(0, 0, self.numel)?.reshape(shape)?)
    }

    /// The sum over `group` of every rank's `full` (any shape with `numel` elements), this
    /// rank's chunk of it, accumulated in f32: the stage 2 gradient reduction. Collective.
    pub fn reduce_scatter(&self, full: &Tensor, group: &Comm) -> Result<Tensor> {
        self.check_full("FlatShard::reduce_scatter", full)?;
        self.check_group("FlatShard::reduce_scatter", group)?;
        let padded = self.padded(&full.to_dtype(DType::F32)?)?;
        group.reduce_scatter(&padded, 0, ReduceOp::Sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn shards_cover_the_tensor_with_zero_padding() {
        let full = Tensor::arange(0f32, 10., &Device::Cpu)
            .unwrap()
            .reshape((2, 5))
            .unwrap();
        let mut seen = Vec::new();
        for r in 0..4 {
            let s = FlatShard::new(10, r, 4).unwrap();
            assert_eq!(s.chunk, 3);
            let t = s.take(&full).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(t.len(), 3);
            seen.extend(t[..s.valid()].iter().copied());
            assert!(t[s.valid()..].iter().all(|&x| x == 0.0));
        }
        assert_eq!(seen, (0..10).map(|x| x as f32).collect::<Vec<_>>());
        assert_eq!(FlatShard::new(10, 3, 4).unwrap().valid(), 1);
        assert!(FlatShard::new(10, 4, 4).is_err());
        assert!(FlatShard::new(9, 0, 3)
            .unwrap()
            .take(&Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap())
            .is_err());
    }
}
