//! Error type of the crate.

/// Errors returned by flash-ring. Every shape or argument error names the tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor does not have the expected rank.
    #[error("{tensor}: expected rank {expected} ({layout}), got shape {got:?}")]
    Rank {
        tensor: &'static str,
        expected: usize,
        layout: &'static str,
        got: Vec<usize>,
    },
    /// A tensor's shape is inconsistent with the other arguments.
    #[error("{tensor}: shape {got:?} does not match the expected {expected}")]
    Shape {
        tensor: &'static str,
        got: Vec<usize>,
        expected: String,
    },
    /// A dtype is not supported or does not match.
    #[error("{tensor}: dtype {got:?} not supported here (expected {expected})")]
    DType {
        tensor: &'static str,
        got: candle_core::DType,
        expected: &'static str,
    },
    /// The number of q heads is not a multiple of the number of k/v heads.
    #[error(
        "q has {q_heads} heads, which is not a positive multiple of the {kv_heads} heads of k/v"
    )]
    Heads { q_heads: usize, kv_heads: usize },
    /// A positions list does not match the number of rows of its tensor.
    #[error("{positions}: {len} positions given but {tensor} has {rows} rows")]
    PositionsLen {
        positions: &'static str,
        tensor: &'static str,
        len: usize,
        rows: usize,
    },
    /// A position is outside the `doc_ids` table.
    #[error("{positions}: position {pos} is outside doc_ids (length {len})")]
    DocIdsTooShort {
        positions: &'static str,
        pos: usize,
        len: usize,
    },
    /// cu_seqlens is not a valid list of cumulative sequence lengths.
    #[error("cu_seqlens: {0}")]
    CuSeqlens(String),
    /// The tensors live on a device this build has no kernel for.
    #[error("{tensor}: device {device} is not supported here")]
    Device {
        tensor: &'static str,
        device: String,
    },
    /// Tensors passed together live on different devices.
    #[error("{tensor}: on a different device than q")]
    DeviceMismatch { tensor: &'static str },
    /// An invalid kernel configuration.
    #[error("invalid kernel config: {0}")]
    Config(String),
    /// The products' library asked for (`FLASH_RING_GEMM`, `Gemm::Mkl`) cannot be used.
    #[error("products' library: {0}")]
    Gemm(String),
    /// A spec cannot be planned as flash-attn kernel calls within the given limits (see
    /// `flash_attn_plan`), or a call does not fit the accumulator it is added to.
    #[error("flash-attn plan: {0}")]
    FlashAttnPlan(String),
    /// An error from candle itself.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Into candle's error (for `?` in candle ops and custom ops); the message is kept.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, Error>;
