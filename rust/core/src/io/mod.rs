//! Requests, priority classes, per-path limits and the dispatcher that feeds
//! the I/O workers.
//!
//! Submitters push [`Request`]s onto two lock-free queues (crossbeam channels),
//! one per [`Class`]. Workers take from them through the [`Dispatcher`], which
//! applies the priority rule and the per-path in-flight limits:
//!
//! - foreground first; a waiting background request is let through after
//!   `BG_EVERY` consecutive foreground dispatches, so it is never starved;
//! - a path never has more than its limit in flight, and background requests
//!   may fill at most half of it, so a foreground burst always finds room.

use std::collections::VecDeque;
use std::io;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender};

pub mod threads;
pub mod turns;
pub mod uring;

/// Direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// Priority class of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Work a user waits on: loads, saves, offload reads.
    Foreground,
    /// Flushes and promotions that may yield to foreground traffic.
    Background,
}

/// Called once, on a worker thread, when a request has finished: with the
/// number of bytes transferred (less than asked only at end of file) or the
/// error. Must be quick and must not block on other requests.
pub type Callback = Box<dyn FnOnce(io::Result<usize>) + Send>;

/// In-flight accounting of one path (one device or file system).
#[derive(Debug)]
pub struct PathSlot {
    pub id: u64,
    pub limit: usize,
    inflight: AtomicUsize,
    bg_inflight: AtomicUsize,
    /// Bytes and busy nanoseconds completed on this path (for bandwidth estimates).
    pub bytes: AtomicU64,
    pub ops: AtomicU64,
}

impl PathSlot {
    pub fn new(id: u64, limit: usize) -> Arc<Self> {
        Arc::new(PathSlot {
            id,
            limit: limit.max(1),
            inflight: AtomicUsize::new(0),
            bg_inflight: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            ops: AtomicU64::new(0),
        })
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    fn bg_limit(&self) -> usize {
        (self.limit / 2).max(1)
    }

    fn try_acquire(&self, class: Class) -> bool {
        if class == Class::Background {
            let b = self.bg_inflight.fetch_add(1, Ordering::AcqRel);
            if b >= self.bg_limit() {
                self.bg_inflight.fetch_sub(1, Ordering::AcqRel);
                return false;
            }
        }
        let n = self.inflight.fetch_add(1, Ordering::AcqRel);
        if n >= self.limit {
            self.inflight.fetch_sub(1, Ordering::AcqRel);
            if class == Class::Background {
                self.bg_inflight.fetch_sub(1, Ordering::AcqRel);
            }
            return false;
        }
        true
    }

    fn release(&self, class: Class) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
        if class == Class::Background {
            self.bg_inflight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One transfer between a memory buffer and a file.
pub struct Request {
    pub op: Op,
    pub fd: RawFd,
    /// Destination (read) or source (write).
    pub buf: *mut u8,
    pub len: usize,
    pub offset: u64,
    pub class: Class,
    pub path: Arc<PathSlot>,
    pub done: Callback,
}

// SAFETY: the raw pointer is only dereferenced by the kernel or a worker while
// the request is in flight; `Request::new` makes the submitter promise that the
// buffer and the fd outlive the request.
unsafe impl Send for Request {}

impl Request {
    /// # Safety
    ///
    /// `buf` must be valid for `len` bytes (writable for reads, readable for
    /// writes) and `fd` must stay open until `done` has been called; nothing
    /// else may write the buffer meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        op: Op,
        fd: RawFd,
        buf: *mut u8,
        len: usize,
        offset: u64,
        class: Class,
        path: Arc<PathSlot>,
        done: Callback,
    ) -> Self {
        Request {
            op,
            fd,
            buf,
            len,
            offset,
            class,
            path,
            done,
        }
    }
}

/// After this many foreground dispatches in a row, a waiting background
/// request goes next.
const BG_EVERY: u32 = 8;

/// The two queues plus the rules for taking from them.
pub struct Dispatcher {
    fg_tx: Sender<Request>,
    fg_rx: Receiver<Request>,
    bg_tx: Sender<Request>,
    bg_rx: Receiver<Request>,
    /// Requests whose path was at its limit when taken; retried first.
    deferred: Mutex<VecDeque<Request>>,
    deferred_len: AtomicUsize,
    fg_streak: AtomicU32,
    shutdown: AtomicBool,
    /// Background bytes per second (0: unlimited), enforced by a token bucket.
    bg_rate: AtomicU64,
    bucket: Mutex<Bucket>,
}

/// Token bucket of the background rate limit: `tokens` bytes may start now;
/// it refills at the rate and holds at most a quarter second's worth. A
/// request may start while the balance is positive and then charges its full
/// length, so one large request is never blocked forever.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Dispatcher {
    pub fn new() -> Arc<Self> {
        let (fg_tx, fg_rx) = crossbeam_channel::unbounded();
        let (bg_tx, bg_rx) = crossbeam_channel::unbounded();
        Arc::new(Dispatcher {
            fg_tx,
            fg_rx,
            bg_tx,
            bg_rx,
            deferred: Mutex::new(VecDeque::new()),
            deferred_len: AtomicUsize::new(0),
            fg_streak: AtomicU32::new(0),
            shutdown: AtomicBool::new(false),
            bg_rate: AtomicU64::new(0),
            bucket: Mutex::new(Bucket {
                tokens: 0.0,
                at: Instant::now(),
            }),
        })
    }

    /// Limits background traffic to `bytes_per_sec` (0: no limit).
    pub fn set_background_rate(&self, bytes_per_sec: u64) {
        let mut b = self.bucket.lock().expect("dispatcher lock");
        b.tokens = 0.0;
        b.at = Instant::now();
        self.bg_rate.store(bytes_per_sec, Ordering::Release);
    }

    pub fn background_rate(&self) -> u64 {
        self.bg_rate.load(Ordering::Acquire)
    }

    /// For a request that holds its path slot: whether the rate limit lets it
    /// start; gives the slot back when it does not.
    fn admit(&self, r: &Request) -> bool {
        if r.class == Class::Foreground || self.bg_admit(r.len) {
            return true;
        }
        r.path.release(r.class);
        false
    }

    /// Whether a background request of `len` bytes may start now; charges
    /// the bucket when it may.
    fn bg_admit(&self, len: usize) -> bool {
        let rate = self.bg_rate.load(Ordering::Acquire);
        if rate == 0 {
            return true;
        }
        let mut b = self.bucket.lock().expect("dispatcher lock");
        let now = Instant::now();
        let cap = rate as f64 / 4.0;
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate as f64).min(cap);
        b.at = now;
        if b.tokens < 0.0 {
            return false;
        }
        b.tokens -= len as f64;
        true
    }

    pub fn submit(&self, req: Request) {
        let tx = match req.class {
            Class::Foreground => &self.fg_tx,
            Class::Background => &self.bg_tx,
        };
        // Both receivers live in `self`, so the channel cannot be disconnected.
        let _ = tx.send(req);
    }

    /// Requests waiting to be dispatched (queued or deferred).
    pub fn queued(&self) -> usize {
        self.fg_rx.len() + self.bg_rx.len() + self.deferred_len.load(Ordering::Relaxed)
    }

    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::Release);
    }

    pub fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// The next request that may start now, if any. The caller must call
    /// [`Dispatcher::finished`] once it has completed.
    pub fn try_next(&self) -> Option<Request> {
        if self.deferred_len.load(Ordering::Acquire) > 0 {
            if let Some(r) = self.take_deferred() {
                return Some(r);
            }
        }
        // Bounded: each iteration either returns or moves one request to the
        // deferred list, which only grows while its path is saturated.
        for _ in 0..64 {
            let bg_turn = self.fg_streak.load(Ordering::Relaxed) >= BG_EVERY;
            let req = if bg_turn {
                self.bg_rx.try_recv().or_else(|_| self.fg_rx.try_recv())
            } else {
                self.fg_rx.try_recv().or_else(|_| self.bg_rx.try_recv())
            };
            let Ok(req) = req else { return None };
            if req.path.try_acquire(req.class) && self.admit(&req) {
                match req.class {
                    Class::Foreground => {
                        self.fg_streak.fetch_add(1, Ordering::Relaxed);
                    }
                    Class::Background => self.fg_streak.store(0, Ordering::Relaxed),
                }
                return Some(req);
            }
            let mut d = self.deferred.lock().expect("dispatcher lock");
            d.push_back(req);
            self.deferred_len.store(d.len(), Ordering::Release);
        }
        None
    }

    fn take_deferred(&self) -> Option<Request> {
        let mut d = self.deferred.lock().expect("dispatcher lock");
        // Foreground before background, then oldest first.
        // One refusal of the rate limit holds back every background request
        // (they share the bucket): the rest are not tried.
        let mut rate_held = false;
        let pick = d
            .iter()
            .position(|r| r.class == Class::Foreground && r.path.try_acquire(r.class))
            .or_else(|| {
                d.iter().position(|r| {
                    if rate_held || r.class != Class::Background || !r.path.try_acquire(r.class) {
                        return false;
                    }
                    let ok = self.admit(r);
                    rate_held = !ok;
                    ok
                })
            });
        let r = pick.and_then(|i| d.remove(i));
        self.deferred_len.store(d.len(), Ordering::Release);
        r
    }

    /// How long until the background rate limit lets a request start again
    /// (`None`: no limit, or it lets one start now).
    fn bg_wait(&self) -> Option<Duration> {
        let rate = self.bg_rate.load(Ordering::Acquire);
        if rate == 0 {
            return None;
        }
        let b = self.bucket.lock().expect("dispatcher lock");
        let tokens = b.tokens + b.at.elapsed().as_secs_f64() * rate as f64;
        (tokens < 0.0).then(|| Duration::from_secs_f64(-tokens / rate as f64))
    }

    fn foreground_deferred(&self) -> bool {
        self.deferred
            .lock()
            .expect("dispatcher lock")
            .iter()
            .any(|r| r.class == Class::Foreground)
    }

    /// Blocks until a request may be ready or `timeout` passes; a new
    /// request ends the wait at once.
    pub fn wait_ready(&self, timeout: Duration) {
        let mut limit = timeout;
        if self.deferred_len.load(Ordering::Acquire) > 0 {
            // Deferred requests become ready when another request on their
            // path completes (polled for briefly) or, held back by the rate
            // limit alone, when the bucket has refilled (slept for: a
            // rate-limited flush must not spin a core it was limited to
            // spare).
            let poll = Duration::from_micros(200);
            // (The deferred list is scanned only while the limit holds.)
            let nap = match self.bg_wait() {
                Some(w) if !self.foreground_deferred() => w.max(poll),
                _ => poll,
            };
            limit = limit.min(nap);
        }
        let mut sel = Select::new();
        sel.recv(&self.fg_rx);
        sel.recv(&self.bg_rx);
        let _ = sel.ready_timeout(limit);
    }

    /// Bookkeeping after a request completed.
    pub fn finished(&self, path: &PathSlot, class: Class, bytes: usize) {
        path.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        path.ops.fetch_add(1, Ordering::Relaxed);
        path.release(class);
    }
}

/// Runs a request's callback and does the dispatcher's bookkeeping.
pub(crate) fn complete(disp: &Dispatcher, req: Request, result: io::Result<usize>) {
    let bytes = *result.as_ref().unwrap_or(&0);
    let Request {
        path, class, done, ..
    } = req;
    disp.finished(&path, class, bytes);
    done(result);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(
        class: Class,
        path: &Arc<PathSlot>,
        log: &Arc<Mutex<Vec<&'static str>>>,
        tag: &'static str,
    ) -> Request {
        let log = Arc::clone(log);
        // SAFETY: a zero-length request with a dangling pointer is never dereferenced.
        unsafe {
            Request::new(
                Op::Read,
                -1,
                std::ptr::NonNull::dangling().as_ptr(),
                0,
                0,
                class,
                Arc::clone(path),
                Box::new(move |_| log.lock().unwrap().push(tag)),
            )
        }
    }

    #[test]
    fn foreground_first_background_not_starved() {
        let d = Dispatcher::new();
        let p = PathSlot::new(1, 1000);
        let log = Arc::new(Mutex::new(Vec::new()));
        d.submit(req(Class::Background, &p, &log, "bg"));
        for _ in 0..20 {
            d.submit(req(Class::Foreground, &p, &log, "fg"));
        }
        let mut order = Vec::new();
        while let Some(r) = d.try_next() {
            order.push(r.class);
            complete(&d, r, Ok(0));
        }
        assert_eq!(order[0], Class::Foreground);
        let bg_pos = order.iter().position(|c| *c == Class::Background).unwrap();
        assert_eq!(
            bg_pos, BG_EVERY as usize,
            "background goes after {BG_EVERY} foreground"
        );
        assert_eq!(order.len(), 21);
    }

    #[test]
    fn path_limit_is_respected() {
        let d = Dispatcher::new();
        let slow = PathSlot::new(1, 2);
        let fast = PathSlot::new(2, 8);
        let log = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..5 {
            d.submit(req(Class::Foreground, &slow, &log, "s"));
        }
        for _ in 0..3 {
            d.submit(req(Class::Foreground, &fast, &log, "f"));
        }
        let mut taken = Vec::new();
        while let Some(r) = d.try_next() {
            taken.push(r);
        }
        // Two on the slow path (its limit), all three on the fast one.
        assert_eq!(taken.iter().filter(|r| r.path.id == 1).count(), 2);
        assert_eq!(taken.iter().filter(|r| r.path.id == 2).count(), 3);
        assert_eq!(slow.inflight(), 2);
        // Completing one slow request lets exactly one deferred one through.
        let r = taken.remove(0);
        complete(&d, r, Ok(0));
        let next = d.try_next().expect("a deferred request is released");
        assert_eq!(next.path.id, 1);
        assert!(d.try_next().is_none());
        taken.push(next);
        for r in taken {
            complete(&d, r, Ok(0));
        }
        while let Some(r) = d.try_next() {
            complete(&d, r, Ok(0));
        }
        assert_eq!(log.lock().unwrap().len(), 8);
        assert_eq!(d.queued(), 0);
    }

    #[test]
    fn background_rate_limit() {
        let d = Dispatcher::new();
        let p = PathSlot::new(1, 1000);
        let log = Arc::new(Mutex::new(Vec::new()));
        d.set_background_rate(4 << 20); // 4 MiB/s, chunks of 1 MiB
        let t0 = Instant::now();
        for _ in 0..6 {
            let mut r = req(Class::Background, &p, &log, "bg");
            r.len = 1 << 20;
            d.submit(r);
        }
        let mut n = 0;
        let mut waits = 0;
        while n < 6 {
            if let Some(r) = d.try_next() {
                complete(&d, r, Ok(0));
                n += 1;
            } else {
                d.wait_ready(Duration::from_millis(5));
                waits += 1;
            }
        }
        // 6 MiB at 4 MiB/s, starting from an empty bucket: at least ~1.25 s.
        let took = t0.elapsed();
        // Waited for in naps of the caller's 5 ms (about 250 of them), not
        // polled every 200 us (about 6,000).
        assert!(waits < 1000, "{waits} waits in {took:?}");
        assert!(took >= Duration::from_millis(1100), "took {took:?}");
        assert!(took < Duration::from_secs(4), "took {took:?}");
        // Foreground is never held back by the background limit.
        d.submit(req(Class::Foreground, &p, &log, "fg"));
        assert!(d.try_next().is_some());
    }

    #[test]
    fn background_limited_to_half_a_path() {
        let d = Dispatcher::new();
        let p = PathSlot::new(1, 8);
        let log = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..10 {
            d.submit(req(Class::Background, &p, &log, "bg"));
        }
        let mut taken = Vec::new();
        while let Some(r) = d.try_next() {
            taken.push(r);
        }
        assert_eq!(
            taken.len(),
            4,
            "background fills at most half of a path's slots"
        );
        d.submit(req(Class::Foreground, &p, &log, "fg"));
        let f = d.try_next().expect("foreground finds a free slot");
        assert_eq!(f.class, Class::Foreground);
        taken.push(f);
        for r in taken {
            complete(&d, r, Ok(0));
        }
        while let Some(r) = d.try_next() {
            complete(&d, r, Ok(0));
        }
    }
}
