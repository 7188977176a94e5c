//! The model zoo: LLaMA-family (and later DiT and multimodal) models described as plain model
//! code, loaded from and saved to Hugging Face checkpoint layouts.
//!
//! Model files are built from the modules of [`candle_parallel::nn`] and name no rank, no
//! communicator and no collective: the layout is the [`ParallelCtx`](candle_parallel::nn::ParallelCtx)'s
//! the modules are built with, and the memory plan is applied to the model's units from outside
//! ([`candle_parallel::plan`]).
//!
//! - [`family`]: the model-family registry (detection from `config.json`, description, FLOPs,
//!   loading of causal LMs); every command routes through it;
//! - [`hub`]: a model directory or a Hub id (through the Hub cache) to its files;
//! - [`checkpoint`]: safetensors reading (each rank only its slice: the
//!   [`TensorSource`](candle_parallel::nn::TensorSource) models load through), atomic saving in
//!   the HF layout;
//! - [`tokenizer`]: `tokenizer.json` and the special tokens of `tokenizer_config.json`;
//! - [`causal_lm`]: what every causal LM family provides ([`CausalLm`]) and its pipeline stage;
//! - [`decoder`]: the decoder-only transformer every LLaMA-like family shares ([`decoder::DecoderSpec`]);
//! - [`llama`]: the `LlamaForCausalLM` family; [`zoo`]: Qwen2/2.5, Qwen3, Mistral;
//! - [`peft`]: LoRA adapters in PEFT's format (load, save, merge);
//! - [`rope`]: the rotary-embedding keys of every family's `config.json` (every RoPE type of
//!   transformers, v4 and v5 forms, per layer type);
//! - [`dit`]: diffusers' `DiTTransformer2DModel` (class-conditional diffusion transformer).

pub mod causal_lm;
pub mod checkpoint;
pub mod decoder;
pub mod diffusion;
pub mod dit;
pub mod error;
pub mod family;
pub mod hub;
pub mod llama;
pub mod llava;
pub mod peft;
pub mod rope;
pub mod rope_override;
pub mod tokenizer;
pub mod vision;
pub mod zoo;

pub use causal_lm::{CausalLm, LmStages, StageMicroBatch};
pub use error::{Error, Result};
pub use family::{Family, Kind};
