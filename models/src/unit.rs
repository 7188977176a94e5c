//! Where a module's parameters live: resident on this rank ([`Unit::Resident`]), or sharded over
//! a ZeRO-3 group and all-gathered for each use ([`Unit::Sharded`]), like FSDP's wrapping of
//! each transformer block.
//!
//! A sharded unit keeps only this rank's flat chunk of each of its parameters (a `Var`, which
//! the optimizer trains directly) and rebuilds the module from the gathered tensors through
//! the same `fn new(cfg, ctx, vb)` constructor that loaded it, so model code does not change.
//! With gradients, the gather is differentiable: its backward reduce-scatters the gradient of
//! each whole parameter into the gradients of the chunks (summed over the sharding group).

use std::sync::Arc;

use candle_core::{DType, Var};
use candle_parallel::comm::Comm;
use candle_parallel::optim::FlatShard;

use crate::checkpoint::{Param, ParamBuilder, ParamStore, Shard};
use crate::error::{Error, Result};

/// One parameter of a [`ShardedUnit`]: this rank's chunk and what rebuilds the whole.
#[derive(Debug, Clone)]
pub struct ShardedParam {
    /// The checkpoint name.
    pub name: String,
    /// The tensor-parallel split of the parameter (as loaded).
    pub shard: Shard,
    /// The shape of the whole parameter, as in the checkpoint.
    pub global_shape: Vec<usize>,
    /// The shape of this rank's tensor-parallel slice (what the module computes with).
    pub local_shape: Vec<usize>,
    /// How the slice is cut over the sharding group.
    pub flat: FlatShard,
    /// This rank's chunk, `(flat.chunk,)` in the parameter's dtype.
    pub var: Var,
}

/// Builds a module from a [`ParamBuilder`] (the model's own constructor).
pub type Build<T> = Arc<dyn Fn(ParamBuilder<'static>) -> Result<T> + Send + Sync>;

/// A module whose parameters are sharded over a ZeRO-3 group.
pub struct ShardedUnit<T> {
    params: Vec<ShardedParam>,
    group: Comm,
    dtype: DType,
    build: Build<T>,
}

impl<T> ShardedUnit<T> {
    /// Shards `params` (this rank's whole tensor-parallel slices, every rank of `group` passing
    /// the same names and shapes) over `group`; the module is rebuilt by `build`. Local: every
    /// rank keeps its chunk of tensors it already holds.
    pub fn new(params: &[&Param], group: &Comm, build: Build<T>) -> Result<Self> {
        let Some(first) = params.first() else {
            return Err(Error::Invalid("a sharded unit needs parameters".into()));
        };
        let dtype = first.tensor.dtype();
        let params = params
            .iter()
            .map(|p| {
                let flat = FlatShard::new(p.tensor.elem_count(), group.rank(), group.size())?;
                let chunk = flat.take(&p.tensor.detach())?;
                Ok(ShardedParam {
                    name: p.name.clone(),
                    shard: p.shard,
                    global_shape: p.global_shape.clone(),
                    local_shape: p.tensor.dims().to_vec(),
                    flat,
                    var: Var::from_tensor(&chunk)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            params,
            group: group.clone(),
            dtype,
            build,
        })
    }

    pub fn params(&self) -> &[ShardedParam] {
        &self.params
    }

    /// The whole (tensor-parallel local) parameters, gathered over the sharding group; with
    /// `grad` differentiably. Collective over the group.
    pub fn gather_params(&self, grad: bool) -> Result<Vec<Param>> {
        self.params
            .iter()
            .map(|p| {
                let chunk = p.var.as_tensor();
                let tensor = if grad {
                    p.flat
                        .gather_differentiable(chunk, &self.group, &p.local_shape)?
                } else {
                    p.flat
                        .gather(&chunk.detach(), &self.group, &p.local_shape)?
                };
                Ok(Param {
                    name: p.name.clone(),
                    var: None,
                    tensor,
                    shard: p.shard,
                    global_shape: p.global_shape.clone(),
                })
            })
            .collect()
    }

    /// The module with its whole parameters (see [`ShardedUnit::gather_params`]).
    pub fn gather(&self, grad: bool) -> Result<T> {
        let params = self.gather_params(grad)?;
        let device = params
            .first()
            .map(|p| p.tensor.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        (self.build)(ParamStore::from_params(params, self.dtype, &device))
    }
}

/// A module's parameters: resident, or sharded over a ZeRO-3 group (see the module docs).
pub enum Unit<T> {
    Resident(T),
    Sharded(Arc<ShardedUnit<T>>),
}

impl<T: Clone> Clone for Unit<T> {
    fn clone(&self) -> Self {
        match self {
            Self::Resident(m) => Self::Resident(m.clone()),
            Self::Sharded(u) => Self::Sharded(u.clone()),
        }
    }
}

impl<T> std::fmt::Debug for Unit<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Resident(_) => f.write_str("Unit::Resident"),
            Self::Sharded(u) => write!(f, "Unit::Sharded({} params)", u.params.len()),
        }
    }
}

impl<T: Clone> Unit<T> {
    /// The module with whole parameters: the resident one, or one rebuilt from the gathered
    /// shards (differentiably when `grad`; collective over the sharding group).
    pub fn get(&self, grad: bool) -> Result<T> {
        match self {
            Self::Resident(m) => Ok(m.clone()),
            Self::Sharded(u) => u.gather(grad),
        }
    }
}
