//! `kvslots._core`: a thin pyo3 layer over kvslots-core. Conversions, exceptions, GIL release;
//! no slot logic lives here.
//!
//! One file per exposed class or function group; [`errors`] maps every engine error to its
//! Python exception and [`convert`] holds the argument and result conversions they share. This
//! file only registers them in the module.

mod apply_stats;
mod connector;
mod convert;
mod copy;
mod device_manager;
mod disk_tier;
mod errors;
mod events;
mod hash;
mod host_cache;
mod prefix_index;
mod slot_info;
mod slot_manager;
mod slot_tracker;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<slot_manager::SlotManager>()?;
    m.add_class::<slot_tracker::SlotTracker>()?;
    m.add_class::<slot_info::SlotInfo>()?;
    m.add_class::<host_cache::HostCache>()?;
    m.add_class::<connector::ConnectorPlanner>()?;
    m.add_class::<disk_tier::DiskIndex>()?;
    m.add_class::<disk_tier::DiskStore>()?;
    m.add_class::<prefix_index::PrefixIndex>()?;
    m.add_class::<apply_stats::ApplyStats>()?;
    m.add_function(wrap_pyfunction!(prefix_index::lora_key, m)?)?;
    m.add_function(wrap_pyfunction!(hash::block_hash, m)?)?;
    m.add_function(wrap_pyfunction!(events::encode_event_batch, m)?)?;
    m.add_class::<copy::BlockRegion>()?;
    m.add_function(wrap_pyfunction!(copy::copy_blocks, m)?)?;
    device_manager::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_ITER_ITEMS", convert::MAX_ITER_ITEMS)?;
    // Counts fork()s for the locks that a thread of the parent may hold in the child (not a
    // name of the module).
    let after_fork = wrap_pyfunction!(prefix_index::after_fork_in_child, m)?;
    let kwargs = pyo3::types::PyDict::new(m.py());
    kwargs.set_item("after_in_child", after_fork)?;
    m.py().import("os")?.call_method("register_at_fork", (), Some(&kwargs))?;
    Ok(())
}
