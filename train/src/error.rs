//! The error type of the training engine.

use std::path::PathBuf;

/// What can go wrong in data preparation, training steps and checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A data file that cannot be used; names the flag and the file.
    #[error("{flag} {path}: {msg}")]
    Data {
        flag: String,
        path: PathBuf,
        msg: String,
    },

    /// A checkpoint directory that cannot be used for resuming.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },

    /// An image dataset, image file or image grid that cannot be read or written; names the
    /// file.
    #[error("{path}: {msg}")]
    Image { path: PathBuf, msg: String },

    /// A chat template that cannot be read, compiled or rendered, or that cannot mark the
    /// trained tokens of an example; names the template (and the example, in `msg`).
    #[error("chat template {template}: {msg}")]
    Template { template: String, msg: String },

    /// Invalid settings or inputs.
    #[error("{0}")]
    Invalid(String),

    /// Optimizer step `step` had a non-finite loss or gradient norm (`what`): its update was
    /// not applied (the step is consumed). The run driver stops, or skips the step when
    /// allowed.
    #[error("step {step}: {what}; the update was not applied")]
    NonFinite { step: u64, what: String },

    /// Anomaly detection (`--detect-anomaly`) found NaN or infinity: where (`msg` names the
    /// module and the pass, or the parameter of a gradient).
    #[error("step {step}, rank {rank}, {micro}: {msg}")]
    Anomaly {
        step: u64,
        rank: usize,
        micro: String,
        msg: String,
    },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A length curriculum that cannot be used (names `--seq-len-schedule`).
    #[error(transparent)]
    Schedule(#[from] crate::schedule::ScheduleError),

    #[error(transparent)]
    Model(#[from] models::Error),

    #[error(transparent)]
    Parallel(#[from] candle_parallel::Error),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        Error::Io { path, source }
    }
}

/// Result alias of the training engine.
pub type Result<T> = std::result::Result<T, Error>;
