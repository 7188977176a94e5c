//! The parallel plan of a run, applied to a built model from outside it (torchtitan's
//! `parallelize`): the layout (tensor, head and context parallelism, their strategy), the memory
//! plan (ZeRO stage and sharding groups, activation checkpointing) and the dtype.
//!
//! The layout is applied when the model is built: the [`ParallelCtx`] it gives every module
//! decides what each rank loads and how each module communicates. The memory plan is applied
//! after, by walking the model's units ([`Parallelize::units`]): no parameter name is parsed,
//! no model file changes. The dtype is the one parameters are loaded in.
//!
//! ```
//! use candle_parallel::attention::{SpConfig, Strategy};
//! use candle_parallel::mesh::MeshConfig;
//! use candle_parallel::nn::TpActivations;
//! use candle_parallel::optim::ZeroStage;
//! use candle_parallel::plan::{Layout, MemoryPlan};
//! use candle_parallel::recompute::Checkpointing;
//!
//! // tp2 x zigzag ring2 on 4 ranks, ZeRO-3 with selective checkpointing.
//! let layout = Layout::new(
//!     MeshConfig::default().with_tp(2).with_ring(2),
//!     SpConfig::new(Strategy::Ring, 1, 2),
//!     TpActivations::Replicated,
//! );
//! assert_eq!(layout.ranks(), 4);
//! let memory = MemoryPlan {
//!     zero: ZeroStage::Parameters,
//!     zero_group: None,
//!     checkpointing: Checkpointing::Selective,
//! };
//! assert!(memory.shards_parameters());
//! ```

use std::collections::BTreeMap;

use crate::attention::SpConfig;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, MeshConfig};
use crate::nn::{ParallelCtx, Param, ShardedParam, TpActivations, UnitOps};
use crate::optim::{ZeroGroups, ZeroStage};
use crate::recompute::Checkpointing;

/// How the ranks are arranged and what runs on them: the mesh (tp × ulysses × ring × pp × dp,
/// order and placement), the sequence-parallel attention, and where tensor-parallel
/// activations live (TP-sp).
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub mesh: MeshConfig,
    pub attention: SpConfig,
    pub tp: TpActivations,
    /// Expert parallelism: ranks over which every mixture-of-experts block divides its experts,
    /// carved from the ranks holding different tokens ([`ParallelCtx::with_expert_parallel`]);
    /// 1 for none.
    pub ep: usize,
}

impl Layout {
    pub fn new(mesh: MeshConfig, attention: SpConfig, tp: TpActivations) -> Self {
        Self {
            mesh,
            attention,
            tp,
            ep: 1,
        }
    }

    /// This layout with expert parallelism of degree `ep`.
    pub fn with_expert_parallel(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
    }

    /// One rank, no parallelism.
    pub fn single() -> Self {
        let attention = SpConfig::new(crate::attention::Strategy::Ring, 1, 1);
        Self::new(
            attention.mesh_config(),
            attention,
            TpActivations::Replicated,
        )
    }

    /// The number of ranks of the mesh.
    pub fn ranks(&self) -> usize {
        self.mesh.world_size().unwrap_or(0)
    }

    /// This rank's mesh and parallel context. Collective over `world` (every rank calls it).
    pub fn context(&self, world: Comm) -> Result<(DeviceMesh, ParallelCtx)> {
        let mesh = DeviceMesh::new(&self.mesh, world)?;
        let ctx = ParallelCtx::new(&mesh, &self.attention, self.tp)?
            .with_expert_parallel(&mesh, self.ep)?;
        Ok((mesh, ctx))
    }
}

/// Where parameters, gradients, optimizer states and activations live; none of it changes a
/// result beyond rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct MemoryPlan {
    /// ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.
    #[serde(default)]
    pub zero: ZeroStage,
    /// Ranks per ZeRO sharding group (none: all of ulysses × ring × dp).
    #[serde(default)]
    pub zero_group: Option<usize>,
    /// Activation checkpointing of the model's blocks.
    #[serde(default)]
    pub checkpointing: Checkpointing,
}

/// A model whose units a plan can walk.
pub trait Parallelize {
    /// Every unit of the model (blocks and the parameters at its ends), each parameter in
    /// exactly one unit.
    fn units(&mut self) -> Vec<&mut dyn UnitOps>;
}

/// A model's trainable parameters once the memory plan is applied, sorted by name.
#[derive(Debug, Clone)]
pub enum PlannedParams {
    /// The whole tensor-parallel slices (ZeRO stages 0 to 2).
    Resident(Vec<Param>),
    /// This rank's chunks (ZeRO-3).
    Sharded(Vec<ShardedParam>),
}

impl MemoryPlan {
    /// Whether units hold only chunks of their parameters (ZeRO-3).
    pub fn shards_parameters(&self) -> bool {
        self.zero == ZeroStage::Parameters
    }

    /// The ZeRO groups of this plan on `mesh` (none without ZeRO). Collective over the world.
    pub fn zero_groups(&self, mesh: &DeviceMesh) -> Result<Option<ZeroGroups>> {
        match self.zero {
            ZeroStage::Off => Ok(None),
            _ => Ok(Some(ZeroGroups::new(mesh, self.zero_group)?)),
        }
    }

    /// Applies the plan to `model`: sets every unit's checkpointing and, under ZeRO-3, shards
    /// every unit over `zero`'s sharding group. Returns the model's parameters. Errors when a
    /// parameter belongs to two units (ZeRO-3 would shard it twice) or when ZeRO-3 is asked
    /// without groups. Local (the groups were built collectively).
    pub fn apply(
        &self,
        model: &mut dyn Parallelize,
        zero: Option<&ZeroGroups>,
    ) -> Result<PlannedParams> {
        let mut units = model.units();
        let mut owner: BTreeMap<String, String> = BTreeMap::new();
        for u in &units {
            for p in u.params() {
                if let Some(other) = owner.insert(p.name.clone(), u.name()) {
                    if other != u.name() {
                        return Err(Error::Layout(format!(
                            "parameter `{}` belongs to units `{other}` and `{}`; each parameter \
                             must be in one unit",
                            p.name,
                            u.name()
                        )));
                    }
                }
            }
        }
        for u in units.iter_mut() {
            u.set_checkpointing(self.checkpointing);
        }
        if !self.shards_parameters() {
            let mut params: Vec<Param> = units.iter().flat_map(|u| u.params().to_vec()).collect();
            params.sort_by(|a, b| a.name.cmp(&b.name));
            return Ok(PlannedParams::Resident(params));
        }
        let group = zero
            .ok_or_else(|| Error::Layout("ZeRO-3 needs the sharding groups of the mesh".into()))?;
        let mut chunks = Vec::new();
        for u in units.iter_mut() {
            chunks.extend(u.shard(&group.shard, group.expert_shard())?);
        }
        chunks.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(PlannedParams::Sharded(chunks))
    }
}
