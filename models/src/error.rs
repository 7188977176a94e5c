//! The error type of the model zoo.

use std::path::PathBuf;

/// What can go wrong when resolving, loading, building or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A configuration file is malformed or describes an unsupported model.
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },

    /// A checkpoint lacks a tensor, or holds one of the wrong shape or dtype.
    #[error("checkpoint {location}: tensor `{name}`: {msg}")]
    Tensor {
        location: String,
        name: String,
        msg: String,
    },

    /// A model could not be found locally, in the Hub cache, or on the Hub.
    #[error("model `{model}`: {msg}")]
    NotFound { model: String, msg: String },

    /// Tokenizer errors.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },

    /// Invalid arguments (shapes, lengths, token ids).
    #[error("{0}")]
    Invalid(String),

    /// An error of the parallel runtime (layouts, communication).
    #[error(transparent)]
    Parallel(#[from] candle_parallel::Error),

    /// An error of a candle tensor operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

/// Into the runtime's error (for module constructors and blocks run by units, pipeline stages);
/// the message is kept.
impl From<Error> for candle_parallel::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Parallel(p) => p,
            other => candle_parallel::Error::Candle(other.into()),
        }
    }
}

/// Into candle's error (for `?` in candle ops and custom ops); the message is kept.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result alias of the model zoo.
pub type Result<T> = std::result::Result<T, Error>;
