//! The communicators of a mesh, split from a world communicator.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use super::config::{Dim, MeshConfig};
use super::layout::{dim_mask, Coords, MeshLayout};
use crate::comm::Comm;
use crate::error::{Error, Result};

/// One rank's view of the device mesh: its coordinates and the communicators of its groups.
///
/// Built collectively by every rank of a world communicator with [`DeviceMesh::new`], which
/// eagerly creates the communicator of each single dim ([`DeviceMesh::comm`]). Communicators of
/// products of dims (e.g. `[Dp, Ring, Ulysses]` for hybrid ZeRO) are created on first use by
/// [`DeviceMesh::group`] and cached. Group ranks follow [`MeshLayout::group_rank`].
pub struct DeviceMesh {
    layout: MeshLayout,
    world: Comm,
    /// This rank's index in `world`.
    rank: usize,
    /// By [`Dim::index`].
    comms: Vec<Comm>,
    /// Product groups, by the mask of their dims of degree above 1.
    products: Mutex<HashMap<u8, Comm>>,
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("rank", &self.rank)
            .field("coords", &self.coords())
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// Collective over `world`: every rank joins its group of `dims`.
fn split_group(world: &Comm, layout: &MeshLayout, rank: usize, dims: &[Dim]) -> Result<Comm> {
    let color = layout.group_index(rank, dims);
    let key = layout.group_rank(rank, dims);
    let comm = world.split(color, key)?;
    let size = layout.group_size(dims);
    if comm.size() != size || comm.rank() != key {
        return Err(Error::Layout(format!(
            "split of the {} group on rank {rank} returned rank {} of {}, expected rank {key} \
             of {size}",
            dims_name(dims),
            comm.rank(),
            comm.size()
        )));
    }
    Ok(comm)
}

fn dims_name(dims: &[Dim]) -> String {
    dims.iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(" x ")
}

impl DeviceMesh {
    /// Collective: every rank of `world` must call it, with the same `config`.
    ///
    /// Validates `config` against `world.size()` (every rank fails alike if it is wrong, before
    /// any communication) and splits `world` once per dim, in the order of [`Dim::ALL`]. Mesh
    /// ranks are `world` ranks (`world.rank()`), whatever world `world` was split from.
    pub fn new(config: &MeshConfig, world: Comm) -> Result<Self> {
        let layout = MeshLayout::new(config, world.size())?;
        let rank = world.rank();
        let comms = Dim::ALL
            .iter()
            .map(|&dim| split_group(&world, &layout, rank, &[dim]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layout,
            world,
            rank,
            comms,
            products: Mutex::new(HashMap::new()),
        })
    }

    /// The arithmetic of the mesh (all ranks' coordinates and groups).
    pub fn layout(&self) -> &MeshLayout {
        &self.layout
    }

    /// The world communicator the mesh was built from.
    pub fn world(&self) -> Comm {
        self.world.clone()
    }

    /// This rank's index in the world communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.layout.world_size()
    }

    /// This rank's coordinate in `dim` (its rank in [`DeviceMesh::comm`]`(dim)`).
    pub fn coord(&self, dim: Dim) -> usize {
        self.layout.coord(self.rank, dim)
    }

    pub fn coords(&self) -> Coords {
        self.layout.coords(self.rank)
    }

    /// The degree of `dim` (the size of [`DeviceMesh::comm`]`(dim)`).
    pub fn size(&self, dim: Dim) -> usize {
        self.layout.degree(dim)
    }

    /// The communicator of this rank's group of `dim`. Local (no communication).
    pub fn comm(&self, dim: Dim) -> Comm {
        self.comms[dim.index()].clone()
    }

    /// The world ranks of this rank's group of `dims`, in group-rank order. Local.
    pub fn group_ranks(&self, dims: &[Dim]) -> Vec<usize> {
        self.layout.group_ranks(self.rank, dims)
    }

    /// This rank's index in its group of `dims`. Local.
    pub fn group_rank(&self, dims: &[Dim]) -> usize {
        self.layout.group_rank(self.rank, dims)
    }

    /// The communicator of this rank's group of the product of `dims` (e.g.
    /// `[Dim::Dp, Dim::Ring, Dim::Ulysses]` for hybrid ZeRO over the sequence-parallel ranks).
    /// Its rank is [`DeviceMesh::group_rank`], independent of the order in which `dims` are
    /// listed.
    ///
    /// Collective on the world communicator: every rank must make the same sequence of `group`
    /// calls (same dim sets, same order relative to other collectives on the world). A call
    /// communicates only when it must create a communicator: dims of degree 1 are ignored, a
    /// single remaining dim returns [`DeviceMesh::comm`], all dims of degree above 1 return the
    /// world, and an already created product is returned from the cache.
    ///
    /// Fails on an empty `dims` or a dim listed twice.
    pub fn group(&self, dims: &[Dim]) -> Result<Comm> {
        let Some(&first) = dims.first() else {
            return Err(Error::Layout(
                "DeviceMesh::group needs at least one dim".into(),
            ));
        };
        for (i, d) in dims.iter().enumerate() {
            if dims[..i].contains(d) {
                return Err(Error::Layout(format!(
                    "DeviceMesh::group: {d} listed twice in [{}]",
                    dims_name(dims)
                )));
            }
        }
        let active: Vec<Dim> = Dim::ALL
            .into_iter()
            .filter(|d| dims.contains(d) && self.size(*d) > 1)
            .collect();
        let all_active = Dim::ALL.into_iter().filter(|&d| self.size(d) > 1).count();
        match active.as_slice() {
            [] => return Ok(self.comm(first)),
            [single] => return Ok(self.comm(*single)),
            _ if active.len() == all_active => return Ok(self.world()),
            _ => {}
        }
        let key = dim_mask(&active);
        let mut cache = self.products.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(comm) = cache.get(&key) {
            return Ok(comm.clone());
        }
        let comm = split_group(&self.world, &self.layout, self.rank, &active)?;
        cache.insert(key, comm.clone());
        Ok(comm)
    }
}
