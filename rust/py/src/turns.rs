//! `DeviceTurns`: the engine's machine-wide turns at one device, held by
//! the Python object that registered them (an offloaded optimizer).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use tierstore_core::io::turns::{DeviceTurns, Ticket, TurnsConfig};
use tierstore_core::ranges::Ticketed;

use crate::engine::PyEngine;
use crate::errors::IntoPy;
use crate::reader::class_of;

/// Turns at device `dev`, registered in the engine: every transfer the
/// engine runs there takes one while this object is open.
#[pyclass(module = "tierstore._core", name = "DeviceTurns")]
pub struct PyDeviceTurns {
    inner: Option<Arc<DeviceTurns>>,
}

impl PyDeviceTurns {
    fn turns(&self) -> PyResult<&Arc<DeviceTurns>> {
        self.inner.as_ref().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("these device turns are closed")
        })
    }

    /// The turns with a place in line: `ticket` as `ticket()` gave it.
    pub(crate) fn ticketed(
        &self,
        ticket: Option<(u8, u64)>,
        background: bool,
    ) -> PyResult<Ticketed> {
        let turns = Arc::clone(self.turns()?);
        let ticket = match ticket {
            Some((class, seq)) => Ticket { class, seq },
            None => turns.ticket(class_of(background)),
        };
        Ok(Ticketed { turns, ticket })
    }
}

#[pymethods]
impl PyDeviceTurns {
    #[new]
    #[pyo3(signature = (engine, dev, *, slots, exclusive, shared, lock_dir, duplex=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: &PyEngine,
        dev: u64,
        slots: usize,
        exclusive: bool,
        shared: usize,
        lock_dir: PathBuf,
        duplex: Option<bool>,
    ) -> PyResult<Self> {
        let config = TurnsConfig {
            slots,
            exclusive,
            shared,
            lock_dir,
            duplex,
        };
        let t = engine.inner.register_turns(dev, config).py_err(py)?;
        Ok(PyDeviceTurns { inner: Some(t) })
    }

    /// A place in line, taken when a transfer is queued (pass it to the transfer).
    #[pyo3(signature = (background=false))]
    fn ticket(&self, background: bool) -> PyResult<(u8, u64)> {
        let t = self.turns()?.ticket(class_of(background));
        Ok((t.class, t.seq))
    }

    #[getter]
    fn dev(&self) -> PyResult<u64> {
        Ok(self.turns()?.dev)
    }

    /// Whether reads and writes have a lane each (else they share one).
    #[getter]
    fn get_duplex(&self) -> PyResult<bool> {
        Ok(self.turns()?.duplex())
    }

    #[setter]
    fn set_duplex(&self, duplex: bool) -> PyResult<()> {
        self.turns()?.set_duplex(duplex);
        Ok(())
    }

    /// Bytes moved at the device (by every transfer with a turn) since the last call.
    fn take_bytes(&self) -> PyResult<u64> {
        Ok(self.turns()?.take_bytes())
    }

    /// Seconds spent waiting for other processes' turns.
    #[getter]
    fn lock_wait_s(&self) -> f64 {
        self.inner.as_ref().map_or(0.0, |t| t.lock_wait_s())
    }

    /// Lets go of the turns (the lock files close once no transfer holds them).
    fn close(&mut self) {
        self.inner = None;
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceTurns>()
}
