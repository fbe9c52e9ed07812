//! Long operations run on engine-side threads and are watched through a
//! [`Task`]: the caller can wait with a timeout (so a Python caller can look
//! for Ctrl-C between waits), read progress, and cancel.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Receiver;

use crate::error::{Error, Result};

/// Shared state of one operation: cancellation, progress, the first error,
/// and a count of requests still in flight.
#[derive(Default)]
pub struct TaskState {
    cancelled: AtomicBool,
    pub bytes_done: AtomicU64,
    pub bytes_total: AtomicU64,
    error: Mutex<Option<Error>>,
    pending: AtomicUsize,
    idle: (Mutex<()>, Condvar),
}

impl TaskState {
    pub fn new() -> Arc<Self> {
        Arc::new(TaskState::default())
    }

    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Records the first error; later ones are dropped (they are usually
    /// consequences of the first).
    pub fn fail(&self, e: Error) {
        let mut g = self.error.lock().expect("task lock");
        if g.is_none() {
            *g = Some(e);
        }
    }

    pub fn has_failed(&self) -> bool {
        self.error.lock().expect("task lock").is_some()
    }

    /// Takes the recorded error, or `Cancelled` if the task was cancelled.
    pub fn outcome(&self) -> Result<()> {
        if let Some(e) = self.error.lock().expect("task lock").take() {
            return Err(e);
        }
        if self.is_cancelled() {
            return Err(Error::Cancelled);
        }
        Ok(())
    }

    /// Should work stop early?
    pub fn should_stop(&self) -> bool {
        self.is_cancelled() || self.has_failed()
    }

    /// One more request in flight.
    pub fn start_one(&self) {
        self.pending.fetch_add(1, Ordering::AcqRel);
    }

    /// One request finished.
    pub fn finish_one(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = self.idle.0.lock().expect("task lock");
            self.idle.1.notify_all();
        }
    }

    /// Blocks until no request is in flight.
    pub fn wait_idle(&self) {
        let mut g = self.idle.0.lock().expect("task lock");
        while self.pending.load(Ordering::Acquire) > 0 {
            g = self
                .idle
                .1
                .wait_timeout(g, Duration::from_millis(100))
                .expect("task lock")
                .0;
        }
    }
}

/// A running operation whose result is a `T`.
pub struct Task<T> {
    state: Arc<TaskState>,
    handle: Option<JoinHandle<Result<T>>>,
    done: Receiver<()>,
}

impl<T: Send + 'static> Task<T> {
    /// Runs `f` on a new thread. The thread drops the sender when it ends,
    /// which wakes `wait_timeout`.
    pub fn spawn(
        name: &str,
        state: Arc<TaskState>,
        f: impl FnOnce(Arc<TaskState>) -> Result<T> + Send + 'static,
    ) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded::<()>(0);
        let st = Arc::clone(&state);
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _tx = tx;
                f(st)
            })
            .map_err(|e| Error::Invalid(format!("cannot start a thread: {e}")))?;
        Ok(Task {
            state,
            handle: Some(handle),
            done: rx,
        })
    }

    /// True once the task has finished (successfully or not).
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        matches!(
            self.done.recv_timeout(timeout),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected)
        )
    }

    pub fn cancel(&self) {
        self.state.cancel();
    }

    /// (bytes done, bytes total).
    pub fn progress(&self) -> (u64, u64) {
        (
            self.state.bytes_done.load(Ordering::Relaxed),
            self.state.bytes_total.load(Ordering::Relaxed),
        )
    }

    /// Waits for the end and returns the result.
    pub fn join(mut self) -> Result<T> {
        let h = self.handle.take().expect("joined once");
        match h.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        // A task is never detached: its thread may reference caller memory.
        if let Some(h) = self.handle.take() {
            self.state.cancel();
            let _ = h.join();
        }
    }
}
