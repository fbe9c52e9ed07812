//! The one place where engine errors become Python exceptions.
//!
//! The exception classes live in `tierstore.errors` (they subclass builtins
//! such as `FileNotFoundError` and `ValueError`, which `create_exception!`
//! cannot do with multiple bases); `tierstore.errors._from_engine` builds the
//! right one from the kind, message, file, record and errno given here.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tierstore_core::Error;

pub fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let kind = match &e {
        Error::Io { .. } => "io",
        Error::NotAContainer { .. } => "not_a_container",
        Error::Truncated { .. } => "truncated",
        Error::Corrupt { .. } => "corrupt",
        Error::Checksum { .. } | Error::ChunkChecksum { .. } => "checksum",
        Error::NotRegular { .. } => "not_regular",
        Error::MissingRecord { .. } => "missing_record",
        Error::Cancelled => "cancelled",
        _ => "invalid",
    };
    let errno = match &e {
        Error::Io { source, .. } => source.raw_os_error(),
        _ => None,
    };
    let path = e.path().map(|p| p.display().to_string());
    let record = e.record().map(str::to_owned);
    let message = e.to_string();
    let made = py
        .import("tierstore.errors")
        .and_then(|m| m.getattr("_from_engine"))
        .and_then(|f| f.call1((kind, message.clone(), path, record, errno)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// `Result` of the core turned into a `PyResult`.
pub trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for tierstore_core::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}
