//! The decoder families besides LLaMA (Qwen2/2.5, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3; the
//! mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE), one file each: the family's `config.json`, how it maps
//! onto the shared [`crate::decoder::DecoderSpec`], and its registry entry
//! ([`crate::family::Family`]).

pub mod gemma;
pub mod mistral;
pub mod mixtral;
pub mod moe;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen_moe;

pub use gemma::{GemmaConfig, GEMMA2, GEMMA3};
pub use mistral::{MistralConfig, MISTRAL};
pub use mixtral::{MixtralConfig, MIXTRAL};
pub use phi3::{Phi3Config, PHI3};
pub use qwen2::{Qwen2Config, QWEN2};
pub use qwen3::{Qwen3Config, QWEN3};
pub use qwen_moe::{Qwen2MoeConfig, Qwen3MoeConfig, QWEN2_MOE, QWEN3_MOE};
