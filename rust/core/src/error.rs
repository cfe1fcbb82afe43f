//! Typed errors. Every variant names the request and the numbers involved, and every
//! operation that returns one has left the manager exactly as it was.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SlotError {
    #[error("unknown request {}", shown(.request))]
    UnknownRequest { request: String },

    #[error("request {} already has a slot", shown(.request))]
    DuplicateRequest { request: String },

    #[error(
        "out of blocks for request {}: needs {needed} more block(s), \
         only {available} free or evictable in a pool of {total}",
        shown(.request)
    )]
    OutOfBlocks {
        request: String,
        /// Exact: a request for up to `usize::MAX` tokens on top of those a slot holds (plus its
        /// lookahead) needs more than `u64::MAX` blocks at block size 1. The other counts are
        /// one `usize` each (a pool size, a length), so `u64` holds them.
        needed: u128,
        available: u64,
        total: u64,
    },

    #[error(
        "invalid rollback for request {}: cannot roll back {requested} token(s), \
         only {pending} speculative token(s) are pending after {committed} committed",
        shown(.request)
    )]
    /// Each count is one `usize` (committed + accepted is at most committed + pending, which
    /// the slot's blocks cover), so `u64` holds them exactly.
    InvalidRollback {
        request: String,
        requested: u64,
        pending: u64,
        committed: u64,
    },

    #[error("capacity exceeded for request {}: {what} ({requested} > {limit})", shown(.request))]
    CapacityExceeded {
        request: String,
        what: &'static str,
        /// Exact: committed + pending + new tokens (+ lookahead) can pass `u64::MAX`; the
        /// reference model and the message report the true count, not a saturated one.
        requested: u128,
        limit: u64,
    },

    #[error("invalid argument{}: {message}", request_suffix(.request))]
    InvalidArgument {
        request: Option<String>,
        message: String,
    },
}

fn request_suffix(request: &Option<String>) -> String {
    match request {
        Some(r) => format!(" for request {}", shown(r)),
        None => String::new(),
    }
}

/// Longest request id a message quotes whole, in characters.
pub const SHOWN_ID_CHARS: usize = 64;

/// A request id as a message quotes it: whole up to [`SHOWN_ID_CHARS`] characters, else its
/// start and its length (an id of 10**8 characters made a message of that size).
pub fn shown(request: &str) -> String {
    match request.char_indices().nth(SHOWN_ID_CHARS) {
        None => format!("{request:?}"),
        Some((cut, _)) => format!(
            "{:?}... ({} characters)",
            &request[..cut],
            request.chars().count()
        ),
    }
}

impl SlotError {
    pub fn invalid(request: Option<&str>, message: impl Into<String>) -> Self {
        SlotError::InvalidArgument {
            request: request.map(str::to_owned),
            message: message.into(),
        }
    }

    /// A table sized by a caller's count (`name = n`) that cannot be allocated: an error, since
    /// `vec!` would abort the process.
    pub fn unallocatable(name: &str, n: usize, what: &str) -> Self {
        SlotError::invalid(None, format!("{name} = {n}: {what} cannot be allocated"))
    }

    /// The request the error is about, when there is one.
    pub fn request(&self) -> Option<&str> {
        match self {
            SlotError::UnknownRequest { request }
            | SlotError::DuplicateRequest { request }
            | SlotError::OutOfBlocks { request, .. }
            | SlotError::InvalidRollback { request, .. }
            | SlotError::CapacityExceeded { request, .. } => Some(request),
            SlotError::InvalidArgument { request, .. } => request.as_deref(),
        }
    }
}

pub type Result<T> = std::result::Result<T, SlotError>;
