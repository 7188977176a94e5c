//! The pure arithmetic of a mesh: coordinates, ranks and groups. No communication.

use std::fmt;
use std::fmt::Write as _;
use std::ops::Index;

use super::config::{per_dim_fields, Dim, MeshConfig, Placement};
use crate::error::{Error, Result};

/// A rank's coordinate in each of the five dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Coords {
    pub tp: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub pp: usize,
    pub dp: usize,
}

per_dim_fields!(
    Coords,
    /// The coordinate in `dim`.
    get,
    /// Sets the coordinate in `dim`.
    set
);

impl Coords {
    /// A copy with the coordinate in `dim` replaced by `value`.
    pub fn with(mut self, dim: Dim, value: usize) -> Self {
        self.set(dim, value);
        self
    }
}

impl Index<Dim> for Coords {
    type Output = usize;

    fn index(&self, dim: Dim) -> &usize {
        match dim {
            Dim::Tp => &self.tp,
            Dim::Ulysses => &self.ulysses,
            Dim::Ring => &self.ring,
            Dim::Pp => &self.pp,
            Dim::Dp => &self.dp,
        }
    }
}

impl fmt::Display for Coords {
    /// `tp=0 ulysses=1 ring=0 pp=0 dp=1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, dim) in Dim::ALL.into_iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{dim}={}", self.get(dim))?;
        }
        Ok(())
    }
}

/// A set of dims as a bit mask over [`Dim::index`].
pub(crate) fn dim_mask(dims: &[Dim]) -> u8 {
    dims.iter().fold(0u8, |m, d| m | (1 << d.index()))
}

fn in_mask(mask: u8, dim: Dim) -> bool {
    mask & (1 << dim.index()) != 0
}

/// The rank arithmetic of a validated [`MeshConfig`] over a world of a given size.
///
/// See the [module docs](crate::mesh) for the rank order, the placement and the numbering of
/// groups. Methods taking a `rank` panic if it is not below [`MeshLayout::world_size`], as an
/// out-of-range index would; ranks are program values here, never user input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshLayout {
    config: MeshConfig,
    world_size: usize,
    /// The effective order, innermost first.
    order: [Dim; 5],
    /// By [`Dim::index`].
    degrees: [usize; 5],
    /// By [`Dim::index`].
    strides: [usize; 5],
}

/// Groups of world ranks, each in group order.
pub type RankGroups = Vec<Vec<usize>>;

impl MeshLayout {
    /// Validates `config` against `world_size` (see [`MeshConfig::validate`]).
    pub fn new(config: &MeshConfig, world_size: usize) -> Result<Self> {
        config.validate(world_size)?;
        let order = config.effective_order()?;
        let degrees = Dim::ALL.map(|d| config.degree(d));
        let mut strides = [0usize; 5];
        let mut stride = 1usize;
        for dim in order {
            strides[dim.index()] = stride;
            // Cannot overflow: the product of all degrees equals `world_size`.
            stride *= degrees[dim.index()];
        }
        Ok(Self {
            config: config.clone(),
            world_size,
            order,
            degrees,
            strides,
        })
    }

    pub fn config(&self) -> &MeshConfig {
        &self.config
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The effective rank order, innermost first (placement applied).
    pub fn order(&self) -> [Dim; 5] {
        self.order
    }

    pub fn placement(&self) -> Placement {
        self.config.placement
    }

    pub fn degree(&self, dim: Dim) -> usize {
        self.degrees[dim.index()]
    }

    /// How far apart in world rank two ranks are whose coordinates differ by one in `dim` only.
    pub fn stride(&self, dim: Dim) -> usize {
        self.strides[dim.index()]
    }

    fn check_rank(&self, rank: usize) {
        assert!(
            rank < self.world_size,
            "rank {rank} is out of range for a mesh of {} ranks",
            self.world_size
        );
    }

    /// The coordinate of `rank` in `dim`, `0..degree(dim)`.
    pub fn coord(&self, rank: usize, dim: Dim) -> usize {
        self.check_rank(rank);
        (rank / self.stride(dim)) % self.degree(dim)
    }

    /// All five coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Coords {
        let mut c = Coords::default();
        for dim in Dim::ALL {
            c.set(dim, self.coord(rank, dim));
        }
        c
    }

    /// The world rank at `coords`; fails if a coordinate is not below its degree.
    pub fn rank_of(&self, coords: &Coords) -> Result<usize> {
        let mut rank = 0;
        for dim in Dim::ALL {
            let c = coords.get(dim);
            if c >= self.degree(dim) {
                return Err(Error::Layout(format!(
                    "{dim} coordinate {c} is out of range for {dim} degree {} (coords {coords})",
                    self.degree(dim)
                )));
            }
            rank += c * self.stride(dim);
        }
        Ok(rank)
    }

    /// The number of ranks in a group of `dims`: the product of their degrees. `dims` is a
    /// set: repeats are ignored, and no dims give groups of one rank.
    pub fn group_size(&self, dims: &[Dim]) -> usize {
        let mask = dim_mask(dims);
        Dim::ALL
            .into_iter()
            .filter(|&d| in_mask(mask, d))
            .map(|d| self.degree(d))
            .product()
    }

    /// How many disjoint groups of `dims` the world has.
    pub fn num_groups(&self, dims: &[Dim]) -> usize {
        self.world_size / self.group_size(dims)
    }

    /// Mixed-radix number of `rank`'s coordinates in the dims of `mask`, effective order,
    /// innermost fastest.
    fn mixed_radix(&self, rank: usize, mask: u8) -> usize {
        let mut value = 0;
        let mut radix = 1;
        for dim in self.order {
            if in_mask(mask, dim) {
                value += self.coord(rank, dim) * radix;
                radix *= self.degree(dim);
            }
        }
        value
    }

    /// `rank`'s index inside its group of `dims` (`0..group_size(dims)`): the mixed-radix number
    /// of its coordinates in `dims`, in the effective order, innermost fastest. It equals the
    /// position of `rank` in [`MeshLayout::group_ranks`].
    pub fn group_rank(&self, rank: usize, dims: &[Dim]) -> usize {
        self.mixed_radix(rank, dim_mask(dims))
    }

    /// The index of `rank`'s group of `dims` among the [`MeshLayout::num_groups`] groups: the
    /// mixed-radix number of its coordinates in the *other* dims (the color of a split).
    pub fn group_index(&self, rank: usize, dims: &[Dim]) -> usize {
        self.mixed_radix(rank, !dim_mask(dims))
    }

    /// The world ranks of `rank`'s group of `dims` (those sharing every coordinate outside
    /// `dims` with `rank`), ordered by group rank, which is ascending world-rank order.
    pub fn group_ranks(&self, rank: usize, dims: &[Dim]) -> Vec<usize> {
        let mask = dim_mask(dims);
        let inside: Vec<Dim> = self
            .order
            .into_iter()
            .filter(|&d| in_mask(mask, d))
            .collect();
        let base = rank
            - inside
                .iter()
                .map(|&d| self.coord(rank, d) * self.stride(d))
                .sum::<usize>();
        let size = self.group_size(dims);
        (0..size)
            .map(|mut g| {
                let mut member = base;
                for &d in &inside {
                    member += (g % self.degree(d)) * self.stride(d);
                    g /= self.degree(d);
                }
                member
            })
            .collect()
    }

    /// Every group of `dims`, indexed by [`MeshLayout::group_index`].
    pub fn groups(&self, dims: &[Dim]) -> Vec<Vec<usize>> {
        let mut groups = vec![Vec::new(); self.num_groups(dims)];
        for rank in 0..self.world_size {
            let g = self.group_index(rank, dims);
            if groups[g].is_empty() {
                groups[g] = self.group_ranks(rank, dims);
            }
        }
        groups
    }

    /// The expert-parallel groups of degree `ep` (world ranks, in group order) and the expert
    /// replica groups (the ranks holding the same experts), as
    /// [`crate::nn::ParallelCtx::with_expert_parallel`] carves them: each run of `ep`
    /// consecutive ranks of a `ulysses × ring × dp` group is one expert-parallel group. Errors
    /// when `ep` is 0 or does not divide that group.
    pub fn expert_groups(&self, ep: usize) -> Result<(RankGroups, RankGroups)> {
        let tokens = [Dim::Ulysses, Dim::Ring, Dim::Dp];
        let g = self.group_size(&tokens);
        if ep == 0 || !g.is_multiple_of(ep) {
            return Err(Error::Layout(format!(
                "expert parallelism of {ep} does not divide the {g} ranks that hold different \
                 tokens (ulysses x ring x dp)"
            )));
        }
        let (mut groups, mut replicas) = (Vec::new(), Vec::new());
        for group in self.groups(&tokens) {
            groups.extend(group.chunks(ep).map(<[usize]>::to_vec));
            replicas.extend((0..ep).map(|i| group.iter().skip(i).step_by(ep).copied().collect()));
        }
        Ok((groups, replicas))
    }

    /// A human-readable summary (for `cpl plan`): degrees, effective order with strides,
    /// placement, and the first groups of each dim whose degree is above 1.
    pub fn describe(&self) -> String {
        const SHOWN: usize = 8;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "mesh of {} ranks = {}",
            self.world_size,
            self.config.formula()
        );
        let order = self
            .order
            .iter()
            .map(|&d| format!("{d} {} (stride {})", self.degree(d), self.stride(d)))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(s, "rank order, innermost first: {order}");
        let _ = writeln!(
            s,
            "placement: {} ({} inside {})",
            self.placement(),
            self.placement().inner(),
            self.placement().outer()
        );
        for dim in self.order {
            if self.degree(dim) == 1 {
                continue;
            }
            let groups = self.groups(&[dim]);
            let shown = groups
                .iter()
                .take(SHOWN)
                .map(|g| format!("{g:?}"))
                .collect::<Vec<_>>()
                .join(" ");
            let more = if groups.len() > SHOWN {
                format!(" ... ({} more)", groups.len() - SHOWN)
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "{dim} groups ({} of {} ranks): {shown}{more}",
                groups.len(),
                self.degree(dim)
            );
        }
        s
    }
}

impl fmt::Display for MeshLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}
