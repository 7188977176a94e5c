//! The model zoo: LLaMA-family, DiT and multimodal models described as plain model code.
//! The parallel layout is applied by the modules of `candle-parallel`; model files never
//! branch on a rank or name a communicator. Filled by the model issues.
