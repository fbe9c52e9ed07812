//! Opening containers: one call opens a file, reads and validates its zip
//! directory and hands back typed records; the manifest, other small records
//! and data offsets are then read through the same open file. Python parses
//! no zip bytes.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::archive::Archive;
use tierstore_core::zip::CdEntry;

use crate::errors::IntoPy;

/// One record as the central directory describes it.
#[pyclass(module = "tierstore._core", frozen, get_all)]
pub struct Record {
    /// The full name, archive folder included (`archive/data/0`).
    name: String,
    crc32: u32,
    /// Bytes of data (uncompressed).
    size: u64,
    compressed_size: u64,
    /// Zip compression method (0: stored).
    method: u16,
    /// Offset of the record's local header.
    header_offset: u64,
}

#[pymethods]
impl Record {
    fn __repr__(&self) -> String {
        format!(
            "Record(name={:?}, size={}, crc32={:08x}, header_offset={})",
            self.name, self.size, self.crc32, self.header_offset
        )
    }
}

pub fn record(e: &CdEntry) -> Record {
    Record {
        name: e.name.clone(),
        crc32: e.crc,
        size: e.size,
        compressed_size: e.compressed_size,
        method: e.method,
        header_offset: e.header_offset,
    }
}

/// A container opened once (see `open_container`).
#[pyclass(module = "tierstore._core", frozen)]
pub struct Container {
    inner: Archive,
    records: Vec<Py<Record>>,
}

#[pymethods]
impl Container {
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path.clone()
    }

    /// The records in directory order.
    #[getter]
    fn records(&self, py: Python<'_>) -> Vec<Py<Record>> {
        self.records.iter().map(|r| r.clone_ref(py)).collect()
    }

    /// Offset of the central directory (the end of the record area).
    #[getter]
    fn cd_offset(&self) -> u64 {
        self.inner.dir.cd_offset
    }

    #[getter]
    fn file_len(&self) -> u64 {
        self.inner.dir.file_len
    }

    /// The data offset of the record `name`, from its local header.
    fn local_data_offset(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        py.detach(|| {
            self.inner
                .entry(name)
                .and_then(|e| self.inner.local_data_offset(e))
        })
        .py_err(py)
    }

    /// `length` bytes at `offset` (inside the file; `what` names them in errors).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: u64,
        what: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = py
            .detach(|| self.inner.read(offset, length, what))
            .py_err(py)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Checks data offsets that a manifest states, `(name, offset)` each:
    /// every one must lie in its record's own space.
    fn check_offsets(&self, py: Python<'_>, offsets: Vec<(String, u64)>) -> PyResult<()> {
        py.detach(|| {
            offsets
                .iter()
                .try_for_each(|(name, off)| self.inner.check_offset(name, *off))
        })
        .py_err(py)
    }

    /// Every record's data offset from its local header, in directory order.
    fn data_offsets(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.inner.data_offsets()).py_err(py)
    }
}

/// Opens the container at `path`: its directory read and validated once.
#[pyfunction]
fn open_container(py: Python<'_>, path: PathBuf) -> PyResult<Container> {
    let inner = py.detach(|| Archive::open(&path)).py_err(py)?;
    let records = inner
        .dir
        .entries
        .iter()
        .map(|e| Py::new(py, record(e)))
        .collect::<PyResult<_>>()?;
    Ok(Container { inner, records })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(open_container, m)?)?;
    m.add_class::<Container>()?;
    m.add_class::<Record>()?;
    Ok(())
}
