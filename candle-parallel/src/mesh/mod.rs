//! Who talks to whom: the device mesh.
//!
//! The `W` ranks of a world are viewed as a five-dimensional grid
//! `W = tp × ulysses × ring × pp × dp`:
//!
//! | [`Dim`]          | parallelism                                      | traffic                |
//! |------------------|--------------------------------------------------|------------------------|
//! | [`Dim::Tp`]      | tensor (Megatron) parallelism                    | all-reduce per layer   |
//! | [`Dim::Ulysses`] | head parallelism (DeepSpeed-Ulysses, LoongTrain "HP") | all-to-all per layer |
//! | [`Dim::Ring`]    | context parallelism (ring attention, LoongTrain "CP", Llama 3 "CP") | P2P per block |
//! | [`Dim::Pp`]      | pipeline parallelism                             | P2P per micro-batch    |
//! | [`Dim::Dp`]      | data parallelism / ZeRO                          | gradient reduction     |
//!
//! # Rank order
//!
//! A world rank is the mixed-radix number whose digits are the rank's coordinates, taken in the
//! *effective order*, innermost (fastest-varying, stride 1) first:
//!
//! ```text
//! rank = Σ coord(d) · stride(d),   stride(order[0]) = 1,
//!                                  stride(order[i+1]) = stride(order[i]) · degree(order[i])
//! ```
//!
//! Ranks that differ only in the innermost dims are neighbours (same node, NVLink), so the most
//! communication-hungry dims go first. [`MeshConfig::order`] lists the five dims innermost
//! first; the default is `tp, ulysses, ring, dp, pp` (USP paper, tip 7) and
//! [`MeshConfig::llama3_order`] gives Llama 3's `tp, cp, pp, dp` (with ulysses next to ring).
//!
//! # Placement of the (ulysses, ring) pair
//!
//! LoongTrain (sec. 4.4) places the 2D-attention grid `d_hp × d_cp` in one of two ways:
//! - [`Placement::HeadFirst`]: the ranks of one head-parallel (ulysses) group are as close as
//!   possible — Ulysses' all-to-all stays on NVLink, ring P2P crosses nodes more often.
//! - [`Placement::ContextFirst`]: the ranks of one context-parallel (ring) group are as close as
//!   possible — ring P2P stays on NVLink, the all-to-all crosses nodes more often.
//!
//! Here the order names *slots*: of the two slots that [`MeshConfig::order`] gives to
//! `ulysses` and `ring`, the inner one (closer to the front) goes to `ulysses` under head-first
//! and to `ring` under context-first, whatever their relative order in `MeshConfig::order`.
//! Everything else in the order is kept. Example, default order and `tp = 2`: head-first gives
//! the effective order `tp, ulysses, ring, dp, pp` (a ulysses group is `{r, r+2, ...}`, only
//! the tp pair sits in between), context-first gives `tp, ring, ulysses, dp, pp`.
//! [`MeshLayout::order`] returns the effective order.
//!
//! # Groups
//!
//! The group of a set of dims `S` containing `rank` is the set of world ranks that share all
//! coordinates *outside* `S` with `rank`; there are `W / Π_{d∈S} degree(d)` such groups. Inside
//! a group, the group-local rank is the mixed-radix number of the coordinates in `S`, taken in
//! the effective mesh order (innermost fastest), independent of the order in which the caller
//! lists `S`. Because the strides grow along the same order, group rank order is ascending
//! world-rank order. The group index (the split "color") is the same mixed-radix number over
//! the dims *not* in `S`.
//!
//! [`MeshLayout`] is the pure arithmetic (no communication; usable for planning and tests);
//! [`DeviceMesh`] builds the communicators of the groups from a world communicator.
//!
//! ```
//! use candle_parallel::comm::LocalWorld;
//! use candle_parallel::mesh::{DeviceMesh, Dim, MeshConfig, MeshLayout, Placement};
//!
//! let cfg = MeshConfig::default().with_tp(2).with_ulysses(2).with_ring(2);
//! let layout = MeshLayout::new(&cfg, 8)?;
//! assert_eq!(layout.group_ranks(0, &[Dim::Ulysses]), vec![0, 2]); // head-first
//! let cf = cfg.clone().with_placement(Placement::ContextFirst);
//! assert_eq!(MeshLayout::new(&cf, 8)?.group_ranks(0, &[Dim::Ring]), vec![0, 2]);
//!
//! // Every rank builds the mesh, then asks for its groups' communicators.
//! let sp_ranks = LocalWorld::run(8, |world| -> candle_parallel::Result<usize> {
//!     let mesh = DeviceMesh::new(&cfg, world)?;
//!     let sp = mesh.group(&[Dim::Ulysses, Dim::Ring])?;
//!     assert_eq!(mesh.comm(Dim::Tp).rank(), mesh.coord(Dim::Tp));
//!     Ok(sp.rank())
//! })?;
//! assert_eq!(sp_ranks, vec![0, 0, 1, 1, 2, 2, 3, 3]);
//! # Ok::<(), candle_parallel::Error>(())
//! ```

mod config;
mod device;
mod layout;

pub use config::{Dim, MeshConfig, Placement};
pub use device::DeviceMesh;
pub use layout::{Coords, MeshLayout, RankGroups};
