//! Waiting on engine tasks from Python.
//!
//! The work runs on engine threads; this thread releases the GIL and wakes
//! every few milliseconds to let Python run its signal handlers. Ctrl-C
//! cancels the task, waits for the requests already in flight (their buffers
//! must not be freed under the kernel), lets the task clean up (a save removes
//! its temporary file) and re-raises `KeyboardInterrupt`.

use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tierstore_core::task::Task;

use crate::errors::to_pyerr;

const TICK: Duration = Duration::from_millis(20);
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

pub fn wait_task<T: Send + 'static>(
    py: Python<'_>,
    task: Task<T>,
    progress: Option<&Bound<'_, PyAny>>,
) -> PyResult<T> {
    let mut last = Instant::now();
    loop {
        if py.detach(|| task.wait_timeout(TICK)) {
            break;
        }
        if let Err(e) = py.check_signals() {
            task.cancel();
            let _ = py.detach(|| task.join());
            return Err(e);
        }
        if let Some(cb) = progress {
            if last.elapsed() >= PROGRESS_EVERY {
                last = Instant::now();
                let (done, total) = task.progress();
                if let Err(e) = cb.call1((done, total)) {
                    task.cancel();
                    let _ = py.detach(|| task.join());
                    return Err(e);
                }
            }
        }
    }
    if let Some(cb) = progress {
        let (done, total) = task.progress();
        cb.call1((done, total))?;
    }
    py.detach(|| task.join()).map_err(|e| to_pyerr(py, e))
}
