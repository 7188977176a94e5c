//! The one configuration value of sequence-parallel attention: strategy, degrees, layout.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim, MeshConfig, Placement};

/// Which sequence-parallel attention algorithm runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Strategy {
    /// Ring attention over the ring group (ulysses degree must be 1).
    Ring,
    /// DeepSpeed-Ulysses all-to-all over the ulysses group (ring degree must be 1).
    Ulysses,
    /// USP: Ulysses over the ulysses group × ring attention over the ring group.
    #[cfg_attr(feature = "clap", value(alias = "hybrid"))]
    Usp,
    /// LoongTrain 2D attention: Ulysses × double ring with inner rings of `inner_ring` ranks.
    #[cfg_attr(feature = "clap", value(alias = "doublering", alias = "loongtrain"))]
    DoubleRing,
    /// StarTrail / WallFacer concentric rings in teams of `team` ranks.
    #[cfg_attr(
        feature = "clap",
        value(name = "startrail", alias = "star-trail", alias = "wallfacer")
    )]
    StarTrail,
    /// Llama 3 all-gather context parallelism over the ring group (ulysses degree must be 1).
    #[cfg_attr(feature = "clap", value(alias = "allgather", alias = "llama3"))]
    AllGather,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::Ring,
        Strategy::Ulysses,
        Strategy::Usp,
        Strategy::DoubleRing,
        Strategy::StarTrail,
        Strategy::AllGather,
    ];

    /// `ring`, `ulysses`, `usp`, `double-ring`, `startrail` or `all-gather`.
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::Ring => "ring",
            Strategy::Ulysses => "ulysses",
            Strategy::Usp => "usp",
            Strategy::DoubleRing => "double-ring",
            Strategy::StarTrail => "startrail",
            Strategy::AllGather => "all-gather",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = Error;

    /// Case-insensitive names of [`Strategy::name`]; also `loongtrain`, `wallfacer`,
    /// `llama3`, `allgather`, `hybrid` (usp), `_` for `-`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "ring" => Ok(Strategy::Ring),
            "ulysses" => Ok(Strategy::Ulysses),
            "usp" | "hybrid" => Ok(Strategy::Usp),
            "double-ring" | "doublering" | "loongtrain" => Ok(Strategy::DoubleRing),
            "startrail" | "star-trail" | "wallfacer" => Ok(Strategy::StarTrail),
            "all-gather" | "allgather" | "llama3" => Ok(Strategy::AllGather),
            _ => Err(Error::Layout(format!(
                "unknown sequence-parallel strategy {s:?}; expected one of ring, ulysses, usp, \
                 double-ring, startrail, all-gather"
            ))),
        }
    }
}

/// How the global sequence is split over the `P` ranks of the ring (context-parallel) group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum SeqLayout {
    /// Rank `r` holds tokens `[r·S/P, (r+1)·S/P)`. Causal work is unbalanced. `S % P == 0`.
    #[cfg_attr(feature = "clap", value(alias = "contig"))]
    Contiguous,
    /// `2P` chunks; rank `r` holds chunks `r` and `2P-1-r` (in that order). Balanced for causal
    /// masks. `S % 2P == 0`.
    #[default]
    #[cfg_attr(feature = "clap", value(alias = "load-balanced"))]
    Zigzag,
    /// Token `i` goes to rank `i mod P` (in increasing order). `S % P == 0`.
    #[cfg_attr(feature = "clap", value(alias = "stripe"))]
    Striped,
    /// Zigzag per packed document (Megatron's THD packing): each document of a document mask
    /// is cut into `2P` chunks, rank `r` holding chunks `r` and `2P-1-r` of every one; short
    /// documents and remainders are placed by the rule of [`super::doc_layout`]. The plan then
    /// depends on the batch's documents ([`super::ShardPlan::for_mask`]); without a document
    /// mask it is [`SeqLayout::Zigzag`]. `S % 2P == 0`.
    #[cfg_attr(feature = "clap", value(alias = "per-document"))]
    DocZigzag,
}

impl SeqLayout {
    pub const ALL: [SeqLayout; 4] = [
        SeqLayout::Contiguous,
        SeqLayout::Zigzag,
        SeqLayout::Striped,
        SeqLayout::DocZigzag,
    ];

    /// `contiguous`, `zigzag`, `striped` or `doc-zigzag`.
    pub const fn name(self) -> &'static str {
        match self {
            SeqLayout::Contiguous => "contiguous",
            SeqLayout::Zigzag => "zigzag",
            SeqLayout::Striped => "striped",
            SeqLayout::DocZigzag => "doc-zigzag",
        }
    }

    /// The number of equal pieces the sequence is cut into for `parts` ranks: `seq_len` must be
    /// a multiple of it.
    pub const fn pieces(self, parts: usize) -> usize {
        match self {
            SeqLayout::Zigzag | SeqLayout::DocZigzag => 2 * parts,
            SeqLayout::Contiguous | SeqLayout::Striped => parts,
        }
    }
}

impl fmt::Display for SeqLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SeqLayout {
    type Err = Error;

    /// Case-insensitive; also `contig`, `load-balanced` (zigzag), `stripe`, `per-document`
    /// (doc-zigzag), `_` for `-`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "contiguous" | "contig" => Ok(SeqLayout::Contiguous),
            "zigzag" | "load-balanced" => Ok(SeqLayout::Zigzag),
            "striped" | "stripe" => Ok(SeqLayout::Striped),
            "doc-zigzag" | "per-document" => Ok(SeqLayout::DocZigzag),
            _ => Err(Error::Layout(format!(
                "unknown sequence layout {s:?}; expected contiguous, zigzag, striped or \
                 doc-zigzag"
            ))),
        }
    }
}

/// Everything that selects a sequence-parallel attention: strategy, degrees, layout, inner ring
/// size `w` (double ring), team size `C` (StarTrail) and placement.
///
/// The degrees and placement must be those of the mesh the strategy runs on
/// ([`SpConfig::mesh_config`] builds a matching [`MeshConfig`], [`SpConfig::for_mesh`] reads
/// them from a mesh).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpConfig {
    pub strategy: Strategy,
    /// Ring layout of the sequence (default zigzag).
    pub layout: SeqLayout,
    /// Head-parallel degree ([`Dim::Ulysses`]).
    pub ulysses: usize,
    /// Context-parallel degree ([`Dim::Ring`]).
    pub ring: usize,
    /// Inner ring size `w` of [`Strategy::DoubleRing`]; must divide `ring`.
    pub inner_ring: usize,
    /// Team size `C` of [`Strategy::StarTrail`]; `C²` must divide the group size.
    pub team: usize,
    /// Which of the (ulysses, ring) pair is intra-node (LoongTrain 4.4).
    pub placement: Placement,
}

impl SpConfig {
    /// `strategy` on a `ulysses × ring` grid, zigzag layout, `w = C = 1`, head-first.
    pub fn new(strategy: Strategy, ulysses: usize, ring: usize) -> Self {
        Self {
            strategy,
            layout: SeqLayout::Zigzag,
            ulysses,
            ring,
            inner_ring: 1,
            team: 1,
            placement: Placement::HeadFirst,
        }
    }

    /// `strategy` with the degrees and placement of `mesh`.
    pub fn for_mesh(strategy: Strategy, mesh: &DeviceMesh) -> Self {
        Self::new(strategy, mesh.size(Dim::Ulysses), mesh.size(Dim::Ring))
            .with_placement(mesh.layout().placement())
    }

    pub fn with_layout(mut self, layout: SeqLayout) -> Self {
        self.layout = layout;
        self
    }

    pub fn with_inner_ring(mut self, w: usize) -> Self {
        self.inner_ring = w;
        self
    }

    pub fn with_team(mut self, c: usize) -> Self {
        self.team = c;
        self
    }

    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Ranks of the sequence-parallel group, `ulysses × ring`.
    pub fn degree(&self) -> usize {
        self.ulysses * self.ring
    }

    /// A mesh config with this grid (other dims of degree 1).
    pub fn mesh_config(&self) -> MeshConfig {
        MeshConfig::default()
            .with_ulysses(self.ulysses)
            .with_ring(self.ring)
            .with_placement(self.placement)
    }

    /// Checks the degrees against the strategy (pure; no shapes).
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Layout(format!("{}: {msg}", self.strategy)));
        if self.ulysses == 0 || self.ring == 0 {
            return bad(format!(
                "degrees must be at least 1, got ulysses {} x ring {}",
                self.ulysses, self.ring
            ));
        }
        match self.strategy {
            Strategy::Ring | Strategy::AllGather if self.ulysses != 1 => bad(format!(
                "runs on the ring group only, but the ulysses degree is {}; use usp (or \
                 double-ring) to combine both",
                self.ulysses
            )),
            Strategy::Ulysses if self.ring != 1 => bad(format!(
                "runs on the ulysses group only, but the ring degree is {}; use usp to combine \
                 both",
                self.ring
            )),
            Strategy::DoubleRing
                if self.inner_ring == 0 || !self.ring.is_multiple_of(self.inner_ring) =>
            {
                bad(format!(
                    "inner ring size w = {} must be at least 1 and divide the ring degree {}",
                    self.inner_ring, self.ring
                ))
            }
            Strategy::StarTrail
                if self.team == 0 || !self.degree().is_multiple_of(self.team * self.team) =>
            {
                bad(format!(
                    "team size C = {} needs C^2 = {} to divide the group size {}",
                    self.team,
                    self.team * self.team,
                    self.degree()
                ))
            }
            _ => Ok(()),
        }
    }

    /// The sharding of a global sequence of `seq_len` tokens without a document mask (pure;
    /// see [`super::ShardPlan`]).
    pub fn plan(&self, seq_len: usize) -> Result<super::ShardPlan> {
        super::ShardPlan::new(seq_len, self.layout, self.ring, self.ulysses)
    }

    /// The sharding of a global sequence of `seq_len` tokens under `mask` (its documents choose
    /// the [`SeqLayout::DocZigzag`] plan; pure).
    pub fn plan_for(&self, seq_len: usize, mask: &super::AttnMask) -> Result<super::ShardPlan> {
        super::ShardPlan::for_mask(seq_len, self.layout, self.ring, self.ulysses, mask)
    }
}

impl Default for SpConfig {
    /// Single-rank ring (plain attention).
    fn default() -> Self {
        Self::new(Strategy::Ring, 1, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
        }
        for l in SeqLayout::ALL {
            assert_eq!(l.name().parse::<SeqLayout>().unwrap(), l);
        }
        assert_eq!("LLAMA3".parse::<Strategy>().unwrap(), Strategy::AllGather);
        assert!("spiral".parse::<Strategy>().is_err());
        assert!("spiral".parse::<SeqLayout>().is_err());
    }

    #[test]
    fn validation() {
        assert!(SpConfig::new(Strategy::Ring, 1, 4).validate().is_ok());
        assert!(SpConfig::new(Strategy::Ring, 2, 4).validate().is_err());
        assert!(SpConfig::new(Strategy::AllGather, 2, 2).validate().is_err());
        assert!(SpConfig::new(Strategy::Ulysses, 4, 2).validate().is_err());
        assert!(SpConfig::new(Strategy::Usp, 2, 4).validate().is_ok());
        assert!(SpConfig::new(Strategy::Usp, 0, 4).validate().is_err());
        let dr = SpConfig::new(Strategy::DoubleRing, 2, 4);
        assert!(dr.clone().with_inner_ring(2).validate().is_ok());
        assert!(dr.clone().with_inner_ring(3).validate().is_err());
        assert!(dr.with_inner_ring(0).validate().is_err());
        let st = SpConfig::new(Strategy::StarTrail, 1, 8);
        assert!(st.clone().with_team(2).validate().is_ok());
        assert!(st.with_team(4).validate().is_err());
    }
}
