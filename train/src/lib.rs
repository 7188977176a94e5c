//! The training engine: data packing ([`data`]), what a run optimises ([`objective`]), the one
//! training step of any model and objective under any parallel layout ([`trainer`]), the run
//! driver around the steps ([`driver`]: progress, metrics, evaluation, checkpoints, Ctrl-C, the
//! loss chart, TensorBoard, traces, the stop on a non-finite step), and training checkpoints with
//! exact resume ([`checkpoint`]); held-out scoring ([`evaluation`]), KV-cache generation through
//! pipeline stages ([`generation`]) and fine-tuning data ([`finetune_data`]) are what `cpl eval`,
//! `cpl generate` and `cpl finetune` call; [`memory`] counts heap bytes for memory tests and
//! benchmarks; [`schedule`] is a run's length curriculum.
//!
//! A step is a list of micro-batches; each micro-batch runs forward and backward on its own
//! and its gradients are accumulated in f32, so pipeline schedules drive the same micro-batches
//! stage by stage.

pub mod chat;
pub mod checkpoint;
pub mod data;
pub mod diffusion;
pub mod driver;
pub mod error;
pub mod evaluation;
pub mod finetune;
pub mod finetune_data;
pub mod generation;
pub mod images;
pub mod memory;
pub mod multimodal;
pub mod objective;
pub mod passkey;
pub mod schedule;
pub mod trainer;

pub use error::{Error, Result};
