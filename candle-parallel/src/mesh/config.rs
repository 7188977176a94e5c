//! The mesh's dimensions, placement and configuration (degrees, order), with validation.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Per-dimension getter and setter for a struct with one `usize` field per [`Dim`]
/// (`tp`, `ulysses`, `ring`, `pp`, `dp`).
macro_rules! per_dim_fields {
    ($ty:ty, $(#[$get_doc:meta])* $get:ident, $(#[$set_doc:meta])* $set:ident) => {
        impl $ty {
            $(#[$get_doc])*
            pub fn $get(&self, dim: Dim) -> usize {
                match dim {
                    Dim::Tp => self.tp,
                    Dim::Ulysses => self.ulysses,
                    Dim::Ring => self.ring,
                    Dim::Pp => self.pp,
                    Dim::Dp => self.dp,
                }
            }

            $(#[$set_doc])*
            pub fn $set(&mut self, dim: Dim, value: usize) {
                match dim {
                    Dim::Tp => self.tp = value,
                    Dim::Ulysses => self.ulysses = value,
                    Dim::Ring => self.ring = value,
                    Dim::Pp => self.pp = value,
                    Dim::Dp => self.dp = value,
                }
            }
        }
    };
}
pub(crate) use per_dim_fields;

per_dim_fields!(
    MeshConfig,
    /// The degree of `dim`.
    degree,
    /// Sets the degree of `dim`.
    set_degree
);

/// One dimension of the device mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dim {
    /// Tensor parallelism.
    Tp,
    /// Head parallelism: DeepSpeed-Ulysses all-to-all (LoongTrain's "HP").
    Ulysses,
    /// Context parallelism: ring attention (LoongTrain's and Llama 3's "CP").
    Ring,
    /// Pipeline parallelism.
    Pp,
    /// Data parallelism (and the ZeRO sharding group).
    Dp,
}

impl Dim {
    /// The five dims, in the order of the formula `world = tp x ulysses x ring x pp x dp`.
    pub const ALL: [Dim; 5] = [Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Pp, Dim::Dp];

    /// Position of the dim in [`Dim::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The canonical lower-case name: `tp`, `ulysses`, `ring`, `pp` or `dp`.
    pub const fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Ulysses => "ulysses",
            Dim::Ring => "ring",
            Dim::Pp => "pp",
            Dim::Dp => "dp",
        }
    }

    /// Parses a comma-separated list of dims (e.g. an order `"tp,ulysses,ring,dp,pp"`);
    /// whitespace around names is ignored. Accepts the names and aliases of [`Dim::from_str`].
    pub fn parse_list(s: &str) -> Result<Vec<Dim>> {
        s.split(',').map(|part| part.trim().parse()).collect()
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dim {
    type Err = Error;

    /// Case-insensitive. Besides the canonical names, accepts `tensor`; `hp`, `head` (ulysses);
    /// `cp`, `context` (ring, as in LoongTrain and Llama 3); `pipeline`; `data`, `zero` (dp).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tp" | "tensor" => Ok(Dim::Tp),
            "ulysses" | "hp" | "head" => Ok(Dim::Ulysses),
            "ring" | "cp" | "context" => Ok(Dim::Ring),
            "pp" | "pipeline" => Ok(Dim::Pp),
            "dp" | "data" | "zero" => Ok(Dim::Dp),
            _ => Err(Error::Layout(format!(
                "unknown mesh dimension {s:?}; expected one of tp, ulysses (hp), ring (cp), pp, dp"
            ))),
        }
    }
}

/// Where the ranks of the (ulysses, ring) 2D-attention grid go (LoongTrain, sec. 4.4).
///
/// Of the two slots of the rank order that hold ulysses and ring, the placement decides which
/// dim takes the inner one (see the [module docs](crate::mesh)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Placement {
    /// Ulysses inside ring: a head-parallel group's ranks are neighbours, so the Ulysses
    /// all-to-all runs intra-node and the ring P2P crosses nodes.
    #[default]
    HeadFirst,
    /// Ring inside ulysses: a context-parallel group's ranks are neighbours, so the ring P2P
    /// runs intra-node and the Ulysses all-to-all crosses nodes.
    ContextFirst,
}

impl Placement {
    /// The dim of the pair that varies faster (the inner slot).
    pub const fn inner(self) -> Dim {
        match self {
            Placement::HeadFirst => Dim::Ulysses,
            Placement::ContextFirst => Dim::Ring,
        }
    }

    /// The dim of the pair that varies slower (the outer slot).
    pub const fn outer(self) -> Dim {
        match self {
            Placement::HeadFirst => Dim::Ring,
            Placement::ContextFirst => Dim::Ulysses,
        }
    }

    /// `head-first` or `context-first`.
    pub const fn name(self) -> &'static str {
        match self {
            Placement::HeadFirst => "head-first",
            Placement::ContextFirst => "context-first",
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Placement {
    type Err = Error;

    /// Case-insensitive; `-` and `_` are interchangeable: `head-first` (`hf`, `head`) or
    /// `context-first` (`cf`, `context`).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "head-first" | "headfirst" | "hf" | "head" => Ok(Placement::HeadFirst),
            "context-first" | "contextfirst" | "cf" | "context" => Ok(Placement::ContextFirst),
            _ => Err(Error::Layout(format!(
                "unknown placement {s:?}; expected head-first (hf) or context-first (cf)"
            ))),
        }
    }
}

/// Degrees, rank order and placement of a device mesh.
///
/// `world = tp x ulysses x ring x pp x dp`; a degree of 1 disables a dim. Build it with
/// `MeshConfig::default()` (everything 1, order `tp, ulysses, ring, dp, pp`, head-first) and
/// the `with_*` helpers, then check it with [`MeshConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MeshConfig {
    pub tp: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub pp: usize,
    pub dp: usize,
    /// The five dims, innermost (stride 1) first; must be a permutation of [`Dim::ALL`].
    /// The relative order of `ulysses` and `ring` is decided by `placement`.
    pub order: Vec<Dim>,
    pub placement: Placement,
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            tp: 1,
            ulysses: 1,
            ring: 1,
            pp: 1,
            dp: 1,
            order: Self::default_order(),
            placement: Placement::default(),
        }
    }
}

impl MeshConfig {
    /// Same as `MeshConfig::default()`.
    pub fn new() -> Self {
        Self::default()
    }

    /// The USP paper's recommendation (tip 7), innermost first: `tp, ulysses, ring, dp, pp`.
    pub fn default_order() -> Vec<Dim> {
        vec![Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Dp, Dim::Pp]
    }

    /// Llama 3's order (sec. 5.2), innermost first: `tp, cp, pp, dp`, where the context-parallel
    /// slot is the (ulysses, ring) pair: `tp, ulysses, ring, pp, dp`.
    pub fn llama3_order() -> Vec<Dim> {
        vec![Dim::Tp, Dim::Ulysses, Dim::Ring, Dim::Pp, Dim::Dp]
    }

    pub fn with_tp(self, degree: usize) -> Self {
        self.with_degree(Dim::Tp, degree)
    }

    pub fn with_ulysses(self, degree: usize) -> Self {
        self.with_degree(Dim::Ulysses, degree)
    }

    pub fn with_ring(self, degree: usize) -> Self {
        self.with_degree(Dim::Ring, degree)
    }

    pub fn with_pp(self, degree: usize) -> Self {
        self.with_degree(Dim::Pp, degree)
    }

    pub fn with_dp(self, degree: usize) -> Self {
        self.with_degree(Dim::Dp, degree)
    }

    /// Sets the degree of `dim`.
    pub fn with_degree(mut self, dim: Dim, degree: usize) -> Self {
        self.set_degree(dim, degree);
        self
    }

    /// Sets the rank order, innermost first (checked by [`MeshConfig::validate`]).
    pub fn with_order(mut self, order: &[Dim]) -> Self {
        self.order = order.to_vec();
        self
    }

    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// The product of the five degrees, or `None` if it overflows `usize`.
    pub fn world_size(&self) -> Option<usize> {
        Dim::ALL
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(self.degree(d)))
    }

    /// The degrees as a formula, e.g. `tp 2 x ulysses 2 x ring 2 x pp 1 x dp 2`.
    pub fn formula(&self) -> String {
        Dim::ALL
            .iter()
            .map(|&d| format!("{d} {}", self.degree(d)))
            .collect::<Vec<_>>()
            .join(" x ")
    }

    /// The rank order actually used, innermost first: [`MeshConfig::order`] with the two slots
    /// of `ulysses` and `ring` filled as the placement says (inner slot first).
    /// Fails if `order` is not a permutation of the five dims.
    pub fn effective_order(&self) -> Result<[Dim; 5]> {
        self.check_order()?;
        let mut order = [Dim::Tp; 5];
        order.copy_from_slice(&self.order);
        let mut sp_slots = order
            .iter()
            .enumerate()
            .filter(|(_, d)| matches!(d, Dim::Ulysses | Dim::Ring))
            .map(|(i, _)| i);
        if let (Some(inner), Some(outer)) = (sp_slots.next(), sp_slots.next()) {
            order[inner] = self.placement.inner();
            order[outer] = self.placement.outer();
        }
        Ok(order)
    }

    /// Checks that every degree is at least 1, that the degrees multiply to `world_size`, and
    /// that `order` is a permutation of the five dims.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        for dim in Dim::ALL {
            if self.degree(dim) == 0 {
                return Err(Error::Layout(format!(
                    "{dim} degree is 0; every degree must be at least 1 (1 disables the \
                     dimension): {}",
                    self.formula()
                )));
            }
        }
        match self.world_size() {
            Some(product) if product == world_size => {}
            Some(product) => {
                return Err(Error::Layout(format!(
                    "{} = {product}, but the world has {world_size} ranks",
                    self.formula()
                )))
            }
            None => {
                return Err(Error::Layout(format!(
                    "{} overflows usize, but the world has {world_size} ranks",
                    self.formula()
                )))
            }
        }
        self.check_order()
    }

    fn check_order(&self) -> Result<()> {
        let mut counts = [0usize; 5];
        for d in &self.order {
            counts[d.index()] += 1;
        }
        if self.order.len() == Dim::ALL.len() && counts.iter().all(|&c| c == 1) {
            return Ok(());
        }
        let listed = self
            .order
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", ");
        let mut problems = Vec::new();
        for dim in Dim::ALL {
            match counts[dim.index()] {
                0 => problems.push(format!("{dim} is missing")),
                1 => {}
                n => problems.push(format!("{dim} appears {n} times")),
            }
        }
        Err(Error::Layout(format!(
            "mesh order must list each of tp, ulysses, ring, pp, dp exactly once (innermost \
             first); got [{listed}]: {}",
            problems.join(", ")
        )))
    }
}
