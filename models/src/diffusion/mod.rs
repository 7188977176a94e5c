//! Diffusion objectives and samplers, as pure functions on candle tensors.
//!
//! - [`schedule`]: DiT's Gaussian diffusion (facebookresearch/DiT `gaussian_diffusion.py`):
//!   the linear beta schedule and every table derived from it in float64, and respacing to
//!   fewer sampling steps (`respace.py`);
//! - [`objective`]: the DDPM training terms (noise MSE and the variational-bound term of a
//!   learned variance, in bits) and rectified flow, as per-sample sums over the elements given,
//!   so that ranks holding different tokens of a sample add their parts;
//! - [`rng`]: a deterministic generator of uniform and normal draws (noise, timesteps);
//! - [`sampler`]: DDPM (ancestral) and DDIM sampling on a (respaced) schedule and Euler sampling
//!   of a rectified flow, with classifier-free guidance.
//!
//! Written from the formulas of DiT's code (to reproduce its numbers: float64 tables, cast to
//! f32 per sample, the tanh approximation of the normal CDF) rather than taken from a crate: no
//! Rust crate implements DiT's learned-variance bound.

pub mod objective;
pub mod rng;
pub mod sampler;
pub mod schedule;

pub use objective::{flow_sample, flow_terms, flow_timestep, logit_normal, DdpmTerms};
pub use rng::DrawStream;
pub use sampler::{flow_sample_euler, Guidance, ModelFn};
pub use schedule::GaussianDiffusion;
