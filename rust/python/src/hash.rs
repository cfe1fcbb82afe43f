//! `kvslots._core.block_hash`: the engine's chained block hash, for tests and tools.

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::{int, opt_int, IntArg};

/// xxh3 chained block hash, identical to the engine's (for tests and tools).
#[pyfunction]
#[pyo3(signature = (parent, tokens, lora_id=None))]
pub(crate) fn block_hash(
    parent: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    lora_id: Option<&Bound<'_, PyAny>>,
) -> PyResult<u64> {
    let parent = int::<u64>(parent, "parent", None)?;
    let t = IntArg::<u32>::extract(tokens, "tokens", None)?;
    let lora = opt_int::<u64>(lora_id, "lora_id", None)?;
    Ok(core::block_hash(parent, t.as_slice(), lora))
}
