//! The io_uring backend: one ring per worker thread, many requests in flight.
//!
//! The worker keeps the ring full up to its queue depth with requests the
//! dispatcher allows, waits for at least one completion, and resubmits the rest
//! of a short transfer until the request is done, fails, or hits end of file.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use super::{complete, Dispatcher, Op, Request};

struct InFlight {
    req: Request,
    /// Bytes already transferred for this request.
    done: usize,
}

fn sqe_for(req: &Request, done: usize, slot: usize) -> squeue::Entry {
    let remaining = req.len - done;
    // A single SQE moves at most u32::MAX bytes; longer requests are split
    // by the short-transfer loop.
    let len = remaining.min(1 << 30) as u32;
    // SAFETY: `done < len` so the offset stays inside the request's buffer.
    let ptr = unsafe { req.buf.add(done) };
    let off = req.offset + done as u64;
    let fd = types::Fd(req.fd);
    match req.op {
        Op::Read => opcode::Read::new(fd, ptr, len).offset(off).build(),
        Op::Write => opcode::Write::new(fd, ptr.cast_const(), len)
            .offset(off)
            .build(),
    }
    .user_data(slot as u64)
}

/// Runs until the dispatcher shuts down and nothing is in flight.
pub fn worker(disp: &Arc<Dispatcher>, depth: u32) -> io::Result<()> {
    let mut ring = IoUring::new(depth.next_power_of_two().max(8))?;
    let depth = depth as usize;
    let mut slots: Vec<Option<InFlight>> = Vec::with_capacity(depth);
    let mut free: Vec<usize> = Vec::new();
    let mut inflight = 0usize;
    let mut pending_resubmit: Vec<usize> = Vec::new();
    loop {
        // Resubmissions of short transfers go first: they hold a slot already.
        for slot in pending_resubmit.drain(..) {
            let f = slots[slot].as_ref().expect("slot in use");
            let sqe = sqe_for(&f.req, f.done, slot);
            // SAFETY: the request's buffer and fd stay valid until its callback
            // runs (contract of `Request::new`); the slot keeps it alive.
            unsafe { push(&mut ring, &sqe)? };
        }
        while inflight < depth {
            let Some(req) = disp.try_next() else { break };
            if req.len == 0 {
                complete(disp, req, Ok(0));
                continue;
            }
            let slot = free.pop().unwrap_or_else(|| {
                slots.push(None);
                slots.len() - 1
            });
            let sqe = sqe_for(&req, 0, slot);
            slots[slot] = Some(InFlight { req, done: 0 });
            // SAFETY: as above.
            unsafe { push(&mut ring, &sqe)? };
            inflight += 1;
        }
        if inflight == 0 {
            if disp.is_shut_down() && disp.queued() == 0 {
                return Ok(());
            }
            disp.wait_ready(Duration::from_millis(50));
            continue;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => return Err(e),
        }
        let cqes: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in cqes {
            let slot = ud as usize;
            let f = slots[slot].as_mut().expect("completion for a slot in use");
            let outcome: Option<io::Result<usize>> = match res {
                r if r < 0 && (-r == libc::EINTR || -r == libc::EAGAIN) => {
                    pending_resubmit.push(slot);
                    None
                }
                r if r < 0 => Some(Err(io::Error::from_raw_os_error(-r))),
                // End of file (reads) or a device that accepts nothing more.
                0 if f.req.op == Op::Read => Some(Ok(f.done)),
                0 => Some(Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write returned 0 bytes",
                ))),
                r => {
                    f.done += r as usize;
                    if f.done < f.req.len {
                        pending_resubmit.push(slot);
                        None
                    } else {
                        Some(Ok(f.done))
                    }
                }
            };
            if let Some(result) = outcome {
                let f = slots[slot].take().expect("slot in use");
                free.push(slot);
                inflight -= 1;
                complete(disp, f.req, result);
            }
        }
    }
}

/// # Safety
///
/// The buffers and fds referenced by `sqe` must stay valid until its completion.
unsafe fn push(ring: &mut IoUring, sqe: &squeue::Entry) -> io::Result<()> {
    loop {
        // SAFETY: forwarded from the caller's contract.
        if unsafe { ring.submission().push(sqe) }.is_ok() {
            return Ok(());
        }
        // Submission queue full: hand what is queued to the kernel first.
        ring.submit()?;
    }
}
