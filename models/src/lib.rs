//! The model zoo: LLaMA-family (and later DiT and multimodal) models described as plain model
//! code, loaded from and saved to Hugging Face checkpoint layouts.
//!
//! The parallel layout is applied by the modules of `candle-parallel` (through a
//! [`ParallelCtx`](candle_parallel::layers::ParallelCtx)); model files never branch on a rank
//! or name a communicator.
//!
//! - [`hub`]: a model directory or a Hub id (through the Hub cache) to its files;
//! - [`checkpoint`]: safetensors reading (each rank only its slice), the `VarBuilder` backend,
//!   atomic saving in the HF layout;
//! - [`tokenizer`]: `tokenizer.json` and the special tokens of `tokenizer_config.json`;
//! - [`unit`]: a module's parameters, resident or sharded over a ZeRO-3 group;
//! - [`llama`]: the `LlamaForCausalLM` model, from the parallel layers.

pub mod checkpoint;
pub mod error;
pub mod grads;
pub mod hub;
pub mod llama;
pub mod tokenizer;
pub mod unit;

pub use error::{Error, Result};
