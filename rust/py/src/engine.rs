//! `Engine`: the process's I/O engine, and the probes behind `tierstore info`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tierstore_core::engine::{Config, Engine, Mode};
use tierstore_core::probe;

use crate::errors::IntoPy;

#[pyclass(frozen, module = "tierstore._core", name = "Engine")]
pub struct PyEngine {
    pub inner: Arc<Engine>,
}

#[pymethods]
impl PyEngine {
    /// Starts an engine. `backend` is "io_uring", "threads", "buffered" or
    /// None (automatic); `forced_by` says where a forced choice came from.
    #[new]
    #[pyo3(signature = (backend=None, *, queue_depth=None, chunk_bytes=None, pool_bytes=None, path_limit=None, cpu_threads=None, huge_pages=None, forced_by=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: Option<&str>,
        queue_depth: Option<usize>,
        chunk_bytes: Option<usize>,
        pool_bytes: Option<usize>,
        path_limit: Option<usize>,
        cpu_threads: Option<usize>,
        huge_pages: Option<bool>,
        forced_by: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = Config::default();
        if let Some(b) = backend {
            cfg.mode = Some(b.parse::<Mode>().py_err(py)?);
        }
        if let Some(q) = queue_depth {
            cfg.queue_depth = q;
            cfg.path_limit = cfg.path_limit.max(q);
        }
        if let Some(c) = chunk_bytes {
            cfg.chunk_size = c;
        }
        if let Some(p) = pool_bytes {
            cfg.pool_bytes = p;
        }
        if let Some(l) = path_limit {
            cfg.path_limit = l;
        }
        if let Some(t) = cpu_threads {
            cfg.cpu_threads = t;
        }
        cfg.huge_pages = huge_pages;
        let inner = Engine::start(cfg, forced_by).py_err(py)?;
        Ok(PyEngine { inner })
    }

    /// The backend in use: "io_uring", "threads" or "buffered".
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode().as_str()
    }

    /// Limits background-class traffic (flushes, promotions) to
    /// `bytes_per_sec`; 0 removes the limit.
    fn set_background_rate(&self, bytes_per_sec: u64) {
        self.inner.set_background_rate(bytes_per_sec);
    }

    /// The background limit in bytes per second (0: none).
    #[getter]
    fn background_rate(&self) -> u64 {
        self.inner.background_rate()
    }

    /// Bytes and requests completed per device so far: {device: (bytes, requests)}.
    fn path_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (dev, bytes, ops) in self.inner.path_stats() {
            d.set_item(dev, (bytes, ops))?;
        }
        Ok(d)
    }

    /// Everything `tierstore info` reports about this engine.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.inner.info();
        let d = PyDict::new(py);
        d.set_item("backend", i.mode.as_str())?;
        d.set_item("backend_reason", i.mode_reason)?;
        d.set_item("direct_io", i.mode.direct())?;
        d.set_item("io_uring_available", i.io_uring.is_ok())?;
        d.set_item("io_uring_error", i.io_uring.err())?;
        d.set_item("queue_depth", i.config.queue_depth)?;
        d.set_item("chunk_bytes", i.config.chunk_size)?;
        d.set_item("pool_bytes", i.config.pool_bytes)?;
        d.set_item("pool_allocated_bytes", i.pool_allocated)?;
        d.set_item("path_limit", i.config.path_limit)?;
        d.set_item("cpu_threads", i.config.cpu_threads)?;
        d.set_item("huge_pages", i.huge_pages)?;
        d.set_item("huge_pages_reason", i.huge_pages_reason)?;
        Ok(d)
    }
}

/// What the file system under `path` (a directory, or a file's directory)
/// allows: O_DIRECT and its alignment, with where the figure came from.
#[pyfunction]
fn probe_path(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyDict>> {
    let dir = if path.is_dir() {
        path.clone()
    } else {
        path.parent()
            .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf)
    };
    let r = py.detach(|| probe::probe_dir(&dir));
    let p =
        r.map_err(|e| crate::errors::to_pyerr(py, tierstore_core::Error::io(&dir, "probe", e)))?;
    let d = PyDict::new(py);
    d.set_item("path", dir.display().to_string())?;
    d.set_item("fs_type", p.fs_type)?;
    match p.direct {
        Ok(a) => {
            d.set_item("direct_io", true)?;
            d.set_item("mem_align", a.mem)?;
            d.set_item("offset_align", a.offset)?;
            d.set_item("align_source", a.source.as_str())?;
            d.set_item("reason", py.None())?;
        }
        Err(why) => {
            d.set_item("direct_io", false)?;
            d.set_item("mem_align", 1)?;
            d.set_item("offset_align", 1)?;
            d.set_item("align_source", "none")?;
            d.set_item("reason", why)?;
        }
    }
    Ok(d)
}

/// Copies `src` to `dst` (atomically replacing it) by reflink when allowed
/// and possible, else through engine requests of the given class. Returns
/// `(bytes, "reflink" | "engine")`.
#[pyfunction]
#[pyo3(signature = (engine, src, dst, *, background=true, durable=true, reflink=true))]
fn copy_file(
    py: Python<'_>,
    engine: &PyEngine,
    src: PathBuf,
    dst: PathBuf,
    background: bool,
    durable: bool,
    reflink: bool,
) -> PyResult<(u64, &'static str)> {
    let class = crate::reader::class_of(background);
    let task = py
        .detach(|| {
            tierstore_core::copy::copy_file(
                &engine.inner,
                &src,
                &dst,
                class,
                durable,
                reflink,
                tierstore_core::task::TaskState::new(),
            )
        })
        .py_err(py)?;
    let (n, how) = crate::wait::wait_task(py, task, None)?;
    Ok((n, how.as_str()))
}

/// `(True, None)` when io_uring works here, else `(False, reason)`.
#[pyfunction]
fn io_uring_status() -> (bool, Option<String>) {
    match probe::io_uring_status() {
        Ok(()) => (true, None),
        Err(why) => (false, Some(why)),
    }
}

/// Whether a virtio balloon with free page reporting is bound here (the
/// automatic huge-page choice declines then).
#[pyfunction]
fn free_page_reporting() -> bool {
    probe::free_page_reporting()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(probe_path, m)?)?;
    m.add_function(wrap_pyfunction!(io_uring_status, m)?)?;
    m.add_function(wrap_pyfunction!(free_page_reporting, m)?)?;
    m.add_function(wrap_pyfunction!(copy_file, m)?)?;
    Ok(())
}
