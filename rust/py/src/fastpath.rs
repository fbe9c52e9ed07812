//! How the Rust fast paths (the pickler of `fast_dumps` and the weights-only
//! unpickler) stop: with an error to propagate, or by giving up, in which
//! case the caller takes the Python path, which decides as Python would.

use pyo3::PyErr;

/// The fast path declines: the Python path handles the input.
#[derive(Debug)]
pub struct GiveUp;

pub enum Stop {
    GiveUp,
    /// An error raised by Python code the fast path called (e.g. the
    /// persistent loader reporting a missing record): propagated as is.
    Py(PyErr),
}

impl From<GiveUp> for Stop {
    fn from(_: GiveUp) -> Self {
        Stop::GiveUp
    }
}

impl From<PyErr> for Stop {
    fn from(e: PyErr) -> Self {
        Stop::Py(e)
    }
}
