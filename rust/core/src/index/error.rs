//! The index's errors.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum IndexError {
    /// The payload is not a KV event batch; nothing was applied.
    #[error("{0}")]
    Decode(String),
    #[error("unknown worker {name:?}")]
    UnknownWorker { name: String },
    #[error("worker {name:?} is already registered")]
    DuplicateWorker { name: String },
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub type IndexResult<T> = std::result::Result<T, IndexError>;
