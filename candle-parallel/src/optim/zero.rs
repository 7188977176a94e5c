//! ZeRO (Rajbhandari et al.): sharding optimizer states (stage 1), gradients (stage 2) and
//! parameters (stage 3) over the ranks that hold the same parameters, with hybrid and partial
//! sharding groups (LoongTrain's hybrid ZeRO over dp × ring × ulysses, AMSP, HSDP).
//!
//! Every tensor is sharded the same way ([`FlatShard`], in [`crate::sharding`]): flattened in row-major order, padded
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
//!
//! Under expert parallelism ([`ZeroGroups::with_experts`]) an expert is held by the ranks of
//! its replica group `E` only (`ulysses·ring·dp / ep` ranks, one per expert-parallel group).
//! It is sharded over the ranks of `E` that fall in this rank's dense sharding group: with a
//! sharding group of `z` ranks, `z / ep` of them when `ep` divides `z` (each dense sharding
//! group holds `z / ep` whole expert-parallel groups), none (whole experts, all-reduced over
//! `E`) when `z` divides `ep`; other sizes are refused. Full sharding (`z` = the whole group)
//! shards every expert over all of `E`. So `--zero-group` bounds the span of every
//! reduce-scatter and all-gather, dense or expert, to one dense sharding group.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
pub use crate::sharding::FlatShard;

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
    /// Under expert parallelism, the groups of the experts' parameters; `None` otherwise.
    pub experts: Option<ExpertZeroGroups>,
}

/// The ZeRO communicators of the experts' parameters for one rank under expert parallelism;
/// see the [module docs](self).
#[derive(Clone, Debug)]
pub struct ExpertZeroGroups {
    /// The ranks holding different chunks of the same experts.
    pub shard: Comm,
    /// The ranks holding the same chunk of the same experts in the other sharding groups
    /// (size 1 under full sharding).
    pub replica: Comm,
    /// `shard` with the expert-parallel group: the ranks whose chunks make up every expert
    /// once (for the gradient norm).
    pub norm: Comm,
    /// `norm` with the tensor-parallel group (experts split over tp).
    pub norm_tp: Comm,
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
            experts: None,
        })
    }

    /// These groups with the experts' groups of `experts` (`None`: no expert parallelism) on
    /// `mesh`, whose `ulysses × ring × dp` groups these groups were built on. Collective over
    /// the world (every rank calls it with the same arguments). Errors when the sharding group
    /// size and the expert-parallel degree do not divide one another.
    pub fn with_experts(
        mut self,
        mesh: &DeviceMesh,
        experts: Option<&crate::nn::ExpertGroups>,
    ) -> Result<Self> {
        let Some(e) = experts else {
            self.experts = None;
            return Ok(self);
        };
        let (z, ep) = (self.shard.size(), e.ep.size());
        if !z.is_multiple_of(ep) && !ep.is_multiple_of(z) {
            return Err(Error::Layout(format!(
                "the ZeRO sharding group of {z} ranks and expert parallelism of {ep}: one must \
                 divide the other (an expert is sharded over the ranks of a sharding group that \
                 hold it)"
            )));
        }
        // Ranks holding the same experts sit `ep` apart in the token group; `ze` of them are
        // in one dense sharding group.
        let ze = (z / ep).max(1);
        let tokens = mesh.group(&[Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let t = tokens.rank();
        let i = e.replicas.rank();
        let shard = e.replicas.split(i / ze, i % ze)?;
        let replica = e.replicas.split(i % ze, i / ze)?;
        let norm = tokens.split(t / (ep * ze), t)?;
        let all_tp = mesh.group(&[Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp])?;
        let norm_tp = all_tp.split(t / (ep * ze), all_tp.rank())?;
        self.experts = Some(ExpertZeroGroups {
            shard,
            replica,
            norm,
            norm_tp,
        });
        Ok(self)
    }

    /// The sharding group of the experts' parameters (under expert parallelism).
    pub fn expert_shard(&self) -> Option<&Comm> {
        self.experts.as_ref().map(|e| &e.shard)
    }

    /// The sharding of a tensor of `numel` elements for this rank.
    pub fn flat_shard(&self, numel: usize) -> Result<FlatShard> {
        FlatShard::new(numel, self.shard.rank(), self.shard.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_parse_from_numbers() {
        assert_eq!(ZeroStage::try_from(2).unwrap(), ZeroStage::Gradients);
        assert!(ZeroStage::try_from(4).is_err());
        assert_eq!(ZeroStage::Parameters.to_string(), "3");
        for n in 0..4u8 {
            let stage = ZeroStage::try_from(n).unwrap();
            assert_eq!(u8::from(stage), n);
            assert_eq!(stage.to_string(), n.to_string());
        }
    }
}
