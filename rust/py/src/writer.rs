//! Writing containers: `Writer` (a file, through the engine) and `Stream`
//! (pieces for a Python file object).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::io::Class;
use tierstore_core::plan::{Gate, Plan, Source};
use tierstore_core::task::{Task, TaskState};
use tierstore_core::writer::{ContainerStream, ContainerWriter, WriteOptions};

use crate::engine::PyEngine;
use crate::errors::IntoPy;
use crate::wait::wait_task;

/// One record of a container being written, where the writer put it.
#[pyclass(module = "tierstore._core", frozen, get_all)]
pub struct PlannedRecord {
    /// The full name, archive folder included.
    name: String,
    header_offset: u64,
    data_offset: u64,
    size: u64,
    /// CRC-32 of the data; None until a memory record's bytes were read.
    crc32: Option<u32>,
}

#[pymethods]
impl PlannedRecord {
    fn __repr__(&self) -> String {
        format!(
            "PlannedRecord(name={:?}, data_offset={}, size={})",
            self.name, self.data_offset, self.size
        )
    }
}

fn plan_entries(plan: &Plan) -> Vec<PlannedRecord> {
    plan.entries()
        .iter()
        .enumerate()
        .map(|(i, e)| PlannedRecord {
            name: e.name.clone(),
            header_offset: e.header_offset,
            data_offset: e.data_offset,
            size: e.size,
            crc32: plan.crc(i),
        })
        .collect()
}

fn closed() -> PyErr {
    PyValueError::new_err("the writer is closed (committed, aborted or failed)")
}

/// A container file being written. Memory records borrow caller memory: the
/// `owner` passed with each is kept alive until the writer is done with it.
#[pyclass(module = "tierstore._core")]
pub struct Writer {
    inner: Option<ContainerWriter>,
    /// A `write_data` running in the background (see `start_data`).
    pending: Option<Task<ContainerWriter>>,
    owners: Vec<Py<PyAny>>,
}

#[pymethods]
impl Writer {
    /// Appends a record holding a copy of `data`; returns its index. `align`
    /// (default: the file's record alignment) may be smaller for metadata.
    #[pyo3(signature = (name, data, align=None))]
    fn add_bytes(
        &mut self,
        py: Python<'_>,
        name: &str,
        data: &[u8],
        align: Option<u64>,
    ) -> PyResult<usize> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        match align {
            Some(a) => w.add_aligned(name, Source::Bytes(data.into()), a),
            None => w.add(name, Source::Bytes(data.into())),
        }
        .py_err(py)
    }

    /// Appends a record that reads `nbytes` at `address`; `owner` (e.g. the
    /// storage) must keep that memory alive and is held until the writer ends.
    /// With `gate`, the memory is still being filled: it is read only once
    /// the gate has reached `ready_at`.
    #[pyo3(signature = (name, address, nbytes, owner, gate=None, ready_at=0))]
    #[allow(clippy::too_many_arguments)]
    fn add_memory(
        &mut self,
        py: Python<'_>,
        name: &str,
        address: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        gate: Option<&PyGate>,
        ready_at: u64,
    ) -> PyResult<usize> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        // SAFETY: `owner` keeps the memory alive; it is stored in `self.owners`
        // and dropped only after the writer (and every task using this source)
        // is gone. The caller promises not to modify it during the save (once
        // the gate is reached, for gated memory).
        let src = unsafe {
            match gate {
                Some(g) => {
                    Source::gated(address as *const u8, nbytes, Arc::clone(&g.inner), ready_at)
                }
                None => Source::mem(address as *const u8, nbytes),
            }
        };
        let i = w.add(name, src).py_err(py)?;
        self.owners.push(owner);
        Ok(i)
    }

    /// Appends one memory record per `(name, address, nbytes, owner)`, as
    /// `add_memory` does for each, in one call (a state of many small
    /// tensors adds them between two writes: one call, not one per tensor).
    fn add_memories(
        &mut self,
        py: Python<'_>,
        records: Vec<(String, usize, usize, Py<PyAny>)>,
    ) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        add_memory_records(py, records, &mut self.owners, |name, src| w.add(name, src))
    }

    /// Starts writing every record added so far in the background and
    /// returns at once; `wait_data` waits for it. Python code (e.g. pickling)
    /// runs meanwhile; the records' memory must not change until then.
    fn start_data(&mut self, py: Python<'_>) -> PyResult<()> {
        let w = self.inner.take().ok_or_else(closed)?;
        self.pending = Some(w.write_data(TaskState::new()).py_err(py)?);
        Ok(())
    }

    /// Waits for `start_data`; returns the CRC-32 of every record so far.
    #[pyo3(signature = (progress=None))]
    fn wait_data(
        &mut self,
        py: Python<'_>,
        progress: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Option<u32>>> {
        let task = self
            .pending
            .take()
            .ok_or_else(|| PyValueError::new_err("no write in progress (call start_data first)"))?;
        let w = wait_task(py, task, progress.as_ref())?;
        let crcs = (0..w.plan().len()).map(|i| w.plan().crc(i)).collect();
        self.inner = Some(w);
        Ok(crcs)
    }

    /// Writes every record added so far; returns their CRC-32s.
    #[pyo3(signature = (progress=None))]
    fn write_data(
        &mut self,
        py: Python<'_>,
        progress: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Option<u32>>> {
        self.start_data(py)?;
        self.wait_data(py, progress)
    }

    /// Writes the rest, makes the file durable and renames it into place.
    /// Returns the file's length.
    #[pyo3(signature = (progress=None))]
    fn commit(&mut self, py: Python<'_>, progress: Option<Bound<'_, PyAny>>) -> PyResult<u64> {
        let w = self.inner.take().ok_or_else(closed)?;
        let task = w.commit(TaskState::new()).py_err(py)?;
        let r = wait_task(py, task, progress.as_ref());
        self.owners.clear();
        Ok(r?.file_len)
    }

    /// Abandons the write; the temporary file is removed.
    fn abort(&mut self, py: Python<'_>) {
        if let Some(t) = self.pending.take() {
            t.cancel();
            let _ = py.detach(|| t.join());
        }
        self.inner = None;
        self.owners.clear();
    }

    /// The CRC-32 of every 512-byte chunk of record `index`, little-endian
    /// u32s (from the write pass where it saw the record whole, else computed
    /// now from its memory).
    fn chunk_table<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        if index >= w.plan().len() {
            return Err(PyValueError::new_err(format!("no record {index}")));
        }
        let t = py.detach(|| w.plan().chunk_table(index)).py_err(py)?;
        let mut out = Vec::with_capacity(t.len() * 4);
        for x in t {
            out.extend_from_slice(&x.to_le_bytes());
        }
        Ok(PyBytes::new(py, &out))
    }

    /// Every record so far, where the writer put it.
    fn entries(&self) -> PyResult<Vec<PlannedRecord>> {
        Ok(plan_entries(self.inner.as_ref().ok_or_else(closed)?.plan()))
    }

    /// End of the record area (where the next record's header would go).
    #[getter]
    fn records_end(&self) -> PyResult<u64> {
        Ok(self.inner.as_ref().ok_or_else(closed)?.plan().records_end())
    }

    #[getter]
    fn direct(&self) -> PyResult<bool> {
        Ok(self.inner.as_ref().ok_or_else(closed)?.direct().0)
    }

    #[getter]
    fn buffered_reason(&self) -> PyResult<Option<String>> {
        Ok(self.inner.as_ref().ok_or_else(closed)?.direct().1)
    }
}

/// Starts writing a container to `path` (atomically replaced on commit).
/// With `chunk_sums`, memory records also get a CRC-32 per 512-byte chunk
/// in the same pass as their CRC (`Writer.chunk_table`).
#[pyfunction]
#[pyo3(signature = (engine, path, *, align=4096, durable=true, background=false, chunk_sums=false))]
fn create_writer(
    py: Python<'_>,
    engine: &PyEngine,
    path: PathBuf,
    align: u64,
    durable: bool,
    background: bool,
    chunk_sums: bool,
) -> PyResult<Writer> {
    let opts = WriteOptions {
        align,
        durable,
        class: if background {
            Class::Background
        } else {
            Class::Foreground
        },
        chunk_sums,
    };
    let e = &engine.inner;
    let w = py
        .detach(|| ContainerWriter::create(e, &path, opts))
        .py_err(py)?;
    Ok(Writer {
        inner: Some(w),
        pending: None,
        owners: Vec::new(),
    })
}

/// A container produced piece by piece, for writing to a Python file object.
#[pyclass(module = "tierstore._core")]
pub struct Stream {
    inner: ContainerStream,
    owners: Vec<Py<PyAny>>,
}

#[pymethods]
impl Stream {
    #[new]
    #[pyo3(signature = (*, align=4096, chunk_bytes=8_388_608, threads=2))]
    fn new(py: Python<'_>, align: u64, chunk_bytes: usize, threads: usize) -> PyResult<Self> {
        Ok(Stream {
            inner: ContainerStream::new(align, chunk_bytes.max(4096), threads).py_err(py)?,
            owners: Vec::new(),
        })
    }

    /// Appends a record holding a copy of `data`, aligned to `align`.
    fn add_bytes(
        &mut self,
        py: Python<'_>,
        name: &str,
        data: &[u8],
        align: u64,
    ) -> PyResult<usize> {
        self.inner
            .add_aligned(name, Source::Bytes(data.into()), align)
            .py_err(py)
    }

    /// Appends one memory record per `(name, address, nbytes, owner)`, as
    /// `Writer.add_memories` does.
    fn add_memories(
        &mut self,
        py: Python<'_>,
        records: Vec<(String, usize, usize, Py<PyAny>)>,
    ) -> PyResult<()> {
        let s = &mut self.inner;
        add_memory_records(py, records, &mut self.owners, |name, src| s.add(name, src))
    }

    /// CRC-32 of every record added so far (computed with the GIL released).
    fn checksums(&mut self, py: Python<'_>) -> Vec<u32> {
        let s = &mut self.inner;
        py.detach(|| s.checksums())
    }

    fn entries(&self) -> Vec<PlannedRecord> {
        plan_entries(self.inner.plan())
    }

    /// The next piece of the file, or None at the end.
    fn next_chunk<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let s = &mut self.inner;
        let v = py.detach(|| s.next_chunk()).py_err(py)?;
        Ok(v.map(|v| PyBytes::new(py, &v)))
    }
}

/// Adds each `(name, address, nbytes, owner)` through `add`, holding its
/// `owner` in `owners`, which must live as long as the container does.
fn add_memory_records(
    py: Python<'_>,
    records: Vec<(String, usize, usize, Py<PyAny>)>,
    owners: &mut Vec<Py<PyAny>>,
    mut add: impl FnMut(&str, Source) -> tierstore_core::Result<usize>,
) -> PyResult<()> {
    owners.reserve(records.len());
    for (name, address, nbytes, owner) in records {
        let src = if nbytes == 0 {
            Source::Bytes(Arc::from(&[][..]))
        } else {
            // SAFETY: `owner` keeps the memory alive and is held in `owners`
            // until the container is gone; the caller promises not to modify
            // it while the container is written.
            unsafe { Source::mem(address as *const u8, nbytes) }
        };
        add(&name, src).py_err(py)?;
        owners.push(owner);
    }
    Ok(())
}

/// A counter that a producer (a checkpoint capture) advances as it fills
/// memory a writer is already consuming (see `Writer.add_memory`).
#[pyclass(frozen, module = "tierstore._core", name = "Gate")]
pub struct PyGate {
    inner: Arc<Gate>,
}

#[pymethods]
impl PyGate {
    #[new]
    fn new() -> Self {
        PyGate { inner: Gate::new() }
    }

    /// Raises the counter to `to`; readers waiting for it or less proceed.
    fn advance(&self, to: u64) {
        self.inner.advance(to);
    }

    /// The producer gave up: every reader waiting on this gate fails.
    fn fail(&self) {
        self.inner.fail();
    }

    #[getter]
    fn value(&self) -> u64 {
        self.inner.value()
    }

    /// Copies `nbytes` from address `src` to address `dst` with the GIL
    /// released, checksumming each 512-byte chunk in the same pass, and
    /// leaves the sums for the memory that becomes readable at `at` (the
    /// writer takes them instead of reading `dst` again). The caller keeps
    /// both ranges alive and advances the gate past `at` afterwards.
    fn copy_in(
        &self,
        py: Python<'_>,
        at: u64,
        dst: usize,
        src: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        if nbytes == 0 {
            self.inner.put_sums(at, Vec::new());
            return Ok(());
        }
        if dst == 0 || src == 0 {
            return Err(PyValueError::new_err("Gate.copy_in: null address"));
        }
        let overlap = dst < src.saturating_add(nbytes) && src < dst.saturating_add(nbytes);
        if overlap || dst.checked_add(nbytes).is_none() || src.checked_add(nbytes).is_none() {
            return Err(PyValueError::new_err(
                "Gate.copy_in: the source and destination ranges overlap or wrap",
            ));
        }
        let sums = py.detach(|| {
            // SAFETY: the caller promises that both ranges are valid for
            // `nbytes` and alive for the call; they do not overlap (checked).
            let (d, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst as *mut u8, nbytes),
                    std::slice::from_raw_parts(src as *const u8, nbytes),
                )
            };
            tierstore_core::crc::copy_and_sum(d, s)
        });
        self.inner.put_sums(at, sums);
        Ok(())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGate>()?;
    m.add_class::<Writer>()?;
    m.add_class::<Stream>()?;
    m.add_class::<PlannedRecord>()?;
    m.add_function(wrap_pyfunction!(create_writer, m)?)?;
    Ok(())
}
