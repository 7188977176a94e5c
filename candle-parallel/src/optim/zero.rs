//! ZeRO (Rajbhandari et al.): sharding optimizer states (stage 1), gradients (stage 2) and
//! parameters (stage 3) over the ranks that hold the same parameters, with hybrid and partial
//! sharding groups (LoongTrain's hybrid ZeRO over dp × ring × ulysses, AMSP, HSDP).
//!
//! Every tensor is sharded the same way ([`FlatShard`]): flattened in row-major order, padded
//! with zeros to a multiple of the sharding group's size, and cut into equal chunks; rank `r` of
//! the group holds chunk `r`. Sharding is per tensor (as torchtitan's FSDP2), so each shard
//! keeps its parameter's name, weight-decay rule and checkpoint entry.
//!
//! The groups ([`ZeroGroups`]): the ranks that hold the same (tensor-parallel slice of the)
//! parameters are those of `ulysses × ring × dp` with one tensor-parallel and one pipeline
//! coordinate. They are cut into sharding groups of `shard_size` consecutive ranks (in the
//! mesh's group order, innermost dim first); the ranks at the same position of every sharding
//! group form a replica group. `shard_size` = the whole group is full sharding, 1 is plain data
//! parallelism (full replicas), anything between is partial (hybrid) sharding: a gradient is
//! reduce-scattered in its sharding group and all-reduced over its replica group.

use candle_core::{DType, Tensor};

use crate::collectives;
use crate::comm::{Comm, ReduceOp};
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};

/// What ZeRO shards.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(try_from = "u8", into = "u8")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ZeroStage {
    /// Nothing: every rank holds whole parameters, gradients and optimizer states.
    #[default]
    #[cfg_attr(feature = "clap", value(name = "0"))]
    Off,
    /// Stage 1: optimizer states (f32 master weights and moments).
    #[cfg_attr(feature = "clap", value(name = "1"))]
    OptimizerStates,
    /// Stage 2: optimizer states and gradients.
    #[cfg_attr(feature = "clap", value(name = "2"))]
    Gradients,
    /// Stage 3: optimizer states, gradients and parameters (gathered for each use).
    #[cfg_attr(feature = "clap", value(name = "3"))]
    Parameters,
}

impl ZeroStage {
    pub const fn number(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::OptimizerStates => 1,
            Self::Gradients => 2,
            Self::Parameters => 3,
        }
    }
}

impl TryFrom<u8> for ZeroStage {
    type Error = Error;

    fn try_from(n: u8) -> Result<Self> {
        match n {
            0 => Ok(Self::Off),
            1 => Ok(Self::OptimizerStates),
            2 => Ok(Self::Gradients),
            3 => Ok(Self::Parameters),
            other => Err(Error::invalid(
                "zero",
                format!("stage {other}: expected 0, 1, 2 or 3"),
            )),
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(s: ZeroStage) -> u8 {
        s.number()
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

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

/// The communicators of ZeRO sharding for one rank; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct ZeroGroups {
    /// The sharding group: ranks holding different chunks of the same tensors.
    pub shard: Comm,
    /// The ranks holding the same chunk in the other sharding groups (size 1 under full
    /// sharding): gradients are all-reduced over it after the reduce-scatter.
    pub replica: Comm,
    /// `replica` together with the tensor-parallel group: where the gradient chunks of
    /// replicated parameters are summed under Megatron sequence parallelism (TP-sp), whose
    /// tensor-parallel ranks see different tokens.
    pub replica_tp: Comm,
    /// `shard` together with the tensor-parallel group: the ranks whose chunks make up every
    /// tensor-parallel slice of a split parameter once (for its global norm).
    pub shard_tp: Comm,
}

impl ZeroGroups {
    /// Cuts the `ulysses × ring × dp` group of this rank into sharding groups of `shard_size`
    /// consecutive ranks (`None`: the whole group). Collective over the world (every rank
    /// calls it with the same `shard_size`). Errors when `shard_size` is 0 or does not divide
    /// the group.
    pub fn new(mesh: &DeviceMesh, shard_size: Option<usize>) -> Result<Self> {
        let group = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let g = group.size();
        let z = shard_size.unwrap_or(g);
        if z == 0 || !g.is_multiple_of(z) {
            return Err(Error::Layout(format!(
                "the ZeRO sharding group size {z} does not divide the {g} ranks that hold the same \
                 parameters (ulysses {} x ring {} x dp {})",
                mesh.size(Dim::Ulysses),
                mesh.size(Dim::Ring),
                mesh.size(Dim::Dp)
            )));
        }
        let r = group.rank();
        let shard = group.split(r / z, r % z)?;
        let replica = group.split(r % z, r / z)?;
        let with_tp = mesh.group(&[Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let replica_tp = with_tp.split(r % z, with_tp.rank())?;
        let shard_tp = with_tp.split(r / z, with_tp.rank())?;
        Ok(Self {
            shard,
            replica,
            replica_tp,
            shard_tp,
        })
    }

    /// The sharding of a tensor of `numel` elements for this rank.
    pub fn flat_shard(&self, numel: usize) -> Result<FlatShard> {
        FlatShard::new(numel, self.shard.rank(), self.shard.size())
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

    #[test]
    fn stages_parse_from_numbers() {
        assert_eq!(ZeroStage::try_from(2).unwrap(), ZeroStage::Gradients);
        assert!(ZeroStage::try_from(4).is_err());
        assert_eq!(ZeroStage::Parameters.to_string(), "3");
    }
}
