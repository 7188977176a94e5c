//! candle-parallel: the distributed runtime of the project.
//!
//! Data flows through the modules in this order and never back:
//! [`comm`] (how ranks talk: local threads, MPI) → [`mesh`] (who talks to whom: tp × ulysses ×
//! ring × pp × dp groups) → [`collectives`] (differentiable communication inside candle graphs)
//! → [`attention`] (every sequence-parallel attention strategy behind one contract), [`ops`]
//! (fused RMSNorm, RoPE, SwiGLU with backward) → [`nn`] (the building blocks of parallel models:
//! column- and row-parallel linear, vocab-parallel embedding and LM head with the fused loss,
//! attention over any strategy, MLP, norms, parameters loaded by slice, units; and the
//! [`nn::ParallelCtx`] a model is built with) → [`recompute`] (activation checkpointing, full or
//! selective), [`optim`] (AdamW with f32 master weights, clipping, schedules, ZeRO sharding) and
//! [`plan`] (layout and memory plan, applied to a built model by walking its units).
//!
//! A tensor-parallel MLP on two local ranks, trained through an activation-checkpointed block,
//! equals the single-device computation:
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor, Var};
//! use candle_parallel::nn::{
//!     ColumnOutput, ColumnParallelLinear, RowInput, RowParallelLinear, TpActivations, TpGroup,
//! };
//! use candle_parallel::recompute::{checkpoint, Block, Checkpointing, GradSink};
//! use candle_parallel::{LocalWorld, SequenceParallelAttention, SpAttention, SpConfig, Strategy};
//!
//! let (d, h) = (8, 16);
//! let w1 = Tensor::randn(0f32, 1., (h, d), &Device::Cpu)?;
//! let w2 = Tensor::randn(0f32, 1., (d, h), &Device::Cpu)?;
//! let x = Tensor::randn(0f32, 1., (1, 4, d), &Device::Cpu)?;
//! let grads = LocalWorld::run(2, |comm| -> candle_parallel::Result<Tensor> {
//!     let (r, tp) = (comm.rank(), TpGroup::new(comm.clone(), TpActivations::Replicated));
//!     // Each rank holds half of the hidden units: rows of w1, columns of w2.
//!     let w1r = Var::from_tensor(&w1.narrow(0, r * h / 2, h / 2)?)?;
//!     let w2r = Var::from_tensor(&w2.narrow(1, r * h / 2, h / 2)?)?;
//!     let up = ColumnParallelLinear::from_weights(
//!         w1r.as_tensor().clone(), None, tp.clone(), ColumnOutput::Sharded);
//!     let down = RowParallelLinear::from_weights(
//!         w2r.as_tensor().clone(), None, tp, RowInput::Sharded);
//!     let block: Block = Arc::new(move |x, _attn| down.forward(&up.forward(x)?.relu()?));
//!     // No attention in this block; a one-rank attention stands in for the argument.
//!     let solo = comm.split(r, 0)?;
//!     let attn: Arc<dyn SequenceParallelAttention> = Arc::new(SpAttention::from_comms(
//!         &SpConfig::new(Strategy::Ring, 1, 1), solo.clone(), solo)?);
//!     let sink = GradSink::new();
//!     let y = checkpoint(Checkpointing::Full, &x, &attn, &sink, block)?;
//!     let g = sink.backward(&y.sqr()?.sum_all()?)?;
//!     Ok(g.get(w1r.as_tensor()).expect("w1 received a gradient").clone())
//! })?;
//! // The single-device gradient of w1, rows of rank 0.
//! let w1v = Var::from_tensor(&w1)?;
//! let y = x.broadcast_matmul(&w1v.t()?)?.relu()?.broadcast_matmul(&w2.t()?)?;
//! let want = y.sqr()?.sum_all()?.backward()?.get(w1v.as_tensor()).unwrap().narrow(0, 0, h / 2)?;
//! // Every element within 1e-4 of the largest (`<=` fails on a NaN, which `max_all` skips).
//! let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
//! let err = (&grads[0] - &want)?.abs()?.flatten_all()?.to_vec1::<f32>()?;
//! assert!(err.iter().all(|&e| e <= 1e-4 * scale));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod attention;
pub mod collectives;
pub mod comm;
pub mod error;
pub mod mesh;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod plan;
pub mod planner;
pub mod recompute;
pub mod sharding;

pub use attention::{
    AttnMask, SeqLayout, SequenceParallelAttention, SpAttention, SpConfig, Strategy,
};
pub use comm::{Comm, Communicator, LocalWorld, ReduceOp};
pub use error::{Error, Result};
pub use mesh::{DeviceMesh, MeshConfig};
