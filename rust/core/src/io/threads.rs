//! The thread-pool backend: blocking `pread`/`pwrite` on several threads.
//!
//! Used where io_uring is refused (containers often disable it) and for the
//! buffered mode; each thread has one request in flight, so the queue depth is
//! the number of threads.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use super::{complete, Dispatcher, Op, Request};

fn transfer(req: &Request) -> io::Result<usize> {
    let mut done = 0usize;
    while done < req.len {
        let rem = req.len - done;
        let off = (req.offset + done as u64) as libc::off_t;
        // SAFETY: `buf` is valid for `len` bytes until the callback runs
        // (contract of `Request::new`), and `done < len`.
        let rc = unsafe {
            let p = req.buf.add(done);
            match req.op {
                Op::Read => libc::pread(req.fd, p.cast(), rem, off),
                Op::Write => libc::pwrite(req.fd, p.cast_const().cast(), rem, off),
            }
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EAGAIN) {
                continue;
            }
            return Err(e);
        }
        if rc == 0 {
            return match req.op {
                Op::Read => Ok(done),
                Op::Write => Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write returned 0 bytes",
                )),
            };
        }
        done += rc as usize;
    }
    Ok(done)
}

/// Runs until the dispatcher shuts down and its queues are empty.
pub fn worker(disp: &Arc<Dispatcher>) {
    loop {
        if let Some(req) = disp.try_next() {
            let result = transfer(&req);
            complete(disp, req, result);
        } else {
            if disp.is_shut_down() && disp.queued() == 0 {
                return;
            }
            disp.wait_ready(Duration::from_millis(50));
        }
    }
}
