//! `tierstore._core`: the thin PyO3 binding of `tierstore-core`.
//!
//! Each module registers its own classes and functions. Every long call runs
//! on engine threads while this thread waits with the GIL released, looking
//! for Ctrl-C between short waits (see `wait`); errors are mapped once, in
//! `errors`, onto the `tierstore.errors` hierarchy.

// PyO3 functions take their arguments by value (PathBuf, Bound, Vec), and
// some methods exist for Python's protocol without using `self`.
#![allow(clippy::needless_pass_by_value, clippy::unused_self)]

use pyo3::prelude::*;

mod archive;
mod buffer;
mod codec;
mod engine;
mod errors;
mod fastpath;
mod pickler;
mod reader;
mod turns;
mod unpickle;
mod wait;
mod writer;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    archive::register(m)?;
    buffer::register(m)?;
    codec::register(m)?;
    engine::register(m)?;
    reader::register(m)?;
    turns::register(m)?;
    writer::register(m)?;
    unpickle::register(m)?;
    pickler::register(m)?;
    Ok(())
}
