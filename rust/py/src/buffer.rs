//! `Buffer`: an aligned engine buffer exposed through the buffer protocol.
//!
//! `torch.frombuffer(buf, dtype=torch.uint8)` and `numpy.frombuffer(buf)` view
//! the memory without a copy; the view holds a reference to the `Buffer`, so
//! the memory lives exactly as long as the last tensor or array that uses it.

use std::ffi::{c_int, c_void};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use tierstore_core::reader::RecordBuf;

#[pyclass(frozen, module = "tierstore._core")]
pub struct Buffer {
    inner: RecordBuf,
}

impl Buffer {
    pub fn new(inner: RecordBuf) -> Self {
        Buffer { inner }
    }
}

#[pymethods]
impl Buffer {
    fn __len__(&self) -> usize {
        self.inner.len
    }

    /// Address of the first byte (for diagnostics and alignment checks).
    #[getter]
    fn address(&self) -> usize {
        self.inner.buf.as_ptr() as usize + self.inner.start
    }

    /// # Safety
    ///
    /// Called by CPython with a valid `view`. The exported memory is owned by
    /// this object, which the view keeps alive through `view.obj`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let len = this.inner.len;
        if len == 0 {
            return Err(PyBufferError::new_err("empty buffer"));
        }
        // SAFETY: `start + len` lies inside the allocation (RecordBuf invariant);
        // the pointer is derived from the owned allocation and stays valid while
        // `slf` is alive, which `view.obj` guarantees.
        let ptr = unsafe { this.inner.buf.as_ptr().add(this.inner.start) }.cast_mut();
        // SAFETY: `view` is valid per the caller; FillInfo sets view.obj = slf
        // with a new reference.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr.cast::<c_void>(),
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    ///
    /// Nothing to release: `PyBuffer_FillInfo` allocates nothing.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Buffer>()
}
