//! `kvslots._core.block_hash`: the engine's chained block hash, for tests and tools.

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::IntArg;

/// xxh3 chained block hash, identical to the engine's (for tests and tools).
#[pyfunction]
#[pyo3(signature = (parent, tokens, lora_id=None))]
pub(crate) fn block_hash(
    parent: u64,
    tokens: &Bound<'_, PyAny>,
    lora_id: Option<u64>,
) -> PyResult<u64> {
    let t = IntArg::<u32>::extract(tokens, "tokens", None)?;
    Ok(core::block_hash(parent, t.as_slice(), lora_id))
}
