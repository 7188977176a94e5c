//! The error type of candle-parallel.

/// Everything that can go wrong in communication, layouts and parallel layers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A peer rank returned an error or panicked; every later or pending collective reports it.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },

    /// A peer rank finished its work while this rank still waited for a message from it.
    #[error(
        "{op} on rank {me}: rank {peer} exited without sending the message this rank waits for"
    )]
    PeerExited {
        op: &'static str,
        me: usize,
        peer: usize,
    },

    /// No message arrived within the communicator's timeout.
    #[error("{op} on rank {me}: timed out after {secs:.1}s waiting for rank {peer}")]
    Timeout {
        op: &'static str,
        me: usize,
        peer: usize,
        secs: f64,
    },

    /// Ranks called collectives that do not match (different op, shape, dtype or arguments).
    #[error("{op} on rank {me}: mismatch with rank {peer}: {msg}")]
    Mismatch {
        op: &'static str,
        me: usize,
        peer: usize,
        msg: String,
    },

    /// A call whose arguments cannot work (bad dim, indivisible size, rank out of range, ...).
    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// An impossible parallel layout (degrees that do not multiply to the world size, ...).
    #[error("invalid parallel layout: {0}")]
    Layout(String),

    /// A parameter is missing from its source, or has the wrong shape.
    #[error("checkpoint {location}: tensor `{name}`: {msg}")]
    Tensor {
        location: String,
        name: String,
        msg: String,
    },

    /// An error reported by the MPI backend.
    #[error("MPI: {0}")]
    Mpi(String),

    /// An error reported by NCCL (the `nccl` feature's communicator), naming the call.
    #[error("NCCL: {0}")]
    Nccl(String),

    /// Anomaly detection found NaN or infinity (see [`crate::nn::anomaly`]): `what` of `module`
    /// (a unit's checkpoint prefix, or a parameter's name for a gradient).
    #[error("non-finite values (NaN or inf) in the {what} of {module}")]
    NonFinite { module: String, what: &'static str },

    /// An error from a candle tensor operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }
}

/// Into candle's error (for `?` in candle ops and custom ops); the message is kept.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result alias of candle-parallel.
pub type Result<T> = std::result::Result<T, Error>;
