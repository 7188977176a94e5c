//! candle-parallel: the distributed runtime of the project.
//!
//! Data flows through the modules in this order and never back:
//! `comm` (how ranks talk) → `mesh` (who talks to whom) → `collectives` (differentiable
//! communication inside candle graphs) → attention strategies and parallel layers (later issues).

pub mod attention;
pub mod collectives;
pub mod comm;
pub mod error;
pub mod layers;
pub mod mesh;
pub mod ops;
pub mod optim;
pub mod recompute;

pub use attention::{
    AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy,
};
pub use comm::{Comm, Communicator, LocalWorld, ReduceOp};
pub use error::{Error, Result};
pub use mesh::{DeviceMesh, MeshConfig};
