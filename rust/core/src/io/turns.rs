//! Machine-wide turns at a device: how transfers of this process and of
//! every other process on the machine share one device, per direction.
//!
//! A [`DeviceTurns`] holds a read and a write [`Lane`] (*duplex*: a read and
//! a write may run at once) or uses the read lane for both (*simplex*: for a
//! device whose throughput drops when reads and writes interleave). A lane
//! grants a turn to at most `slots` transfers of this process at a time, in
//! ticket order (class first, then the order in which the transfers were
//! queued); with `exclusive`, each granted turn also holds one of `shared`
//! lock files (`flock`) in a directory every process on the machine uses, so
//! that several processes stream to one device in turn instead of thrashing
//! it. A process that dies releases its locks with its descriptors.
//!
//! The engine keeps the turns of each device that has them
//! ([`crate::engine::Engine::register_turns`]); every transfer the engine
//! runs on such a device (range reads and writes, container loads and
//! saves, from any caller) takes a turn there for its duration, so that one
//! place schedules every byte that goes to that device.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::{Class, Op};

/// A place in line: lower goes first. `class` 1 is foreground, 2 background
/// (0 is left for work that must go before either).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket {
    pub class: u8,
    pub seq: u64,
}

/// How a device's turns are set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnsConfig {
    /// Transfers of this process in flight per direction.
    pub slots: usize,
    /// Take machine-wide turns (lock files) as well.
    pub exclusive: bool,
    /// Transfers of every process together per direction (lock files per lane).
    pub shared: usize,
    /// Where the lock files live (one directory for the whole machine).
    pub lock_dir: PathBuf,
    /// `Some(duplex)` fixes the mode; `None` starts duplex and lets the
    /// caller measure which is faster ([`DeviceTurns::set_duplex`]).
    pub duplex: Option<bool>,
}

#[derive(Debug, Default)]
struct LaneState {
    busy: usize,
    /// Tickets of the transfers waiting here.
    waiting: BinaryHeap<Reverse<Ticket>>,
    /// Lock files no transfer of this process holds.
    free: Vec<RawFd>,
}

/// The turns in one direction at one device.
#[derive(Debug)]
pub struct Lane {
    slots: usize,
    state: Mutex<LaneState>,
    cond: Condvar,
    files: Vec<File>,
    /// Nanoseconds spent waiting for other processes' locks.
    lock_wait_ns: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Lane {
    fn new(dir: &Path, dev: u64, what: char, cfg: &TurnsConfig) -> Result<Self> {
        let slots = cfg.slots.max(1);
        let mut files = Vec::new();
        if cfg.exclusive {
            for i in 0..slots.max(cfg.shared) {
                let p = dir.join(format!("tierstore-io-{dev:x}-{what}{i}.lock"));
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o666)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(&p)
                    .map_err(|e| Error::io(&p, "open lock file", e))?;
                files.push(f);
            }
        }
        let free = files.iter().map(AsRawFd::as_raw_fd).collect();
        Ok(Lane {
            slots,
            state: Mutex::new(LaneState {
                free,
                ..LaneState::default()
            }),
            cond: Condvar::new(),
            files,
            lock_wait_ns: AtomicU64::new(0),
        })
    }

    /// Waits for a turn (in ticket order) and returns it; the turn ends when
    /// the returned guard is dropped.
    fn take(&self, ticket: Ticket) -> LaneTurn<'_> {
        let mut st = lock(&self.state);
        st.waiting.push(Reverse(ticket));
        // (no free lock file: another transfer of ours is choosing one)
        while st.busy >= self.slots
            || st.waiting.peek() != Some(&Reverse(ticket))
            || (!self.files.is_empty() && st.free.is_empty())
        {
            st = self.cond.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.waiting.pop();
        st.busy += 1;
        let mine = std::mem::take(&mut st.free);
        self.cond.notify_all();
        drop(st);
        let mut turn = LaneTurn {
            lane: self,
            fd: None,
        };
        if !mine.is_empty() {
            let fd = self.lock_any(&mine);
            let mut st = lock(&self.state);
            st.free.extend(mine.iter().copied().filter(|&x| x != fd));
            self.cond.notify_all();
            turn.fd = Some(fd);
        }
        turn
    }

    /// Takes whichever of `fds` no other process holds, waiting while all
    /// are held: blocked in the kernel on a single one (woken the moment it
    /// is let go, so the device is not left idle between two processes'
    /// transfers), polled 0.2 to 2 ms apart on several.
    fn lock_any(&self, fds: &[RawFd]) -> RawFd {
        let t0 = Instant::now();
        let try_lock = |fd: RawFd| {
            // SAFETY: `fd` is one of this lane's open lock files.
            unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0 }
        };
        if let [fd] = *fds {
            if !try_lock(fd) {
                // SAFETY: as above; blocks until the other holder lets go.
                while unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                    if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                        break; // not a lock file any more: go on unlocked rather than hang
                    }
                }
                self.add_wait(t0);
            }
            return fd;
        }
        let mut pause = Duration::from_micros(200);
        loop {
            if let Some(&fd) = fds.iter().find(|&&fd| try_lock(fd)) {
                self.add_wait(t0);
                return fd;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    fn add_wait(&self, t0: Instant) {
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.lock_wait_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// A turn in a lane; ends when dropped.
#[derive(Debug)]
pub struct LaneTurn<'a> {
    lane: &'a Lane,
    fd: Option<RawFd>,
}

impl Drop for LaneTurn<'_> {
    fn drop(&mut self) {
        if let Some(fd) = self.fd {
            // SAFETY: a lock file of the lane, locked by this turn.
            unsafe { libc::flock(fd, libc::LOCK_UN) };
        }
        let mut st = lock(&self.lane.state);
        st.busy -= 1;
        if let Some(fd) = self.fd {
            st.free.push(fd);
        }
        self.lane.cond.notify_all();
    }
}

/// The turns at one device (one `st_dev`).
#[derive(Debug)]
pub struct DeviceTurns {
    pub dev: u64,
    pub config: TurnsConfig,
    read: Lane,
    write: Lane,
    duplex: AtomicBool,
    next: AtomicU64,
    /// Bytes moved at the device since the last [`DeviceTurns::take_bytes`].
    bytes: AtomicU64,
}

impl DeviceTurns {
    pub fn new(dev: u64, config: TurnsConfig) -> Result<Self> {
        let dir = config.lock_dir.clone();
        Ok(DeviceTurns {
            dev,
            read: Lane::new(&dir, dev, 'r', &config)?,
            write: Lane::new(&dir, dev, 'w', &config)?,
            duplex: AtomicBool::new(config.duplex.unwrap_or(true)),
            next: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            config,
        })
    }

    /// A place in line for a transfer of `class`, taken when it is queued.
    pub fn ticket(&self, class: Class) -> Ticket {
        Ticket {
            class: match class {
                Class::Foreground => 1,
                Class::Background => 2,
            },
            seq: self.next.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Waits for a turn to move `nbytes` in direction `op`; the turn ends
    /// (and the bytes are counted) when the guard is dropped.
    pub fn take(&self, op: Op, nbytes: u64, ticket: Ticket) -> Turn<'_> {
        let lane = if op == Op::Write && self.duplex() {
            &self.write
        } else {
            &self.read
        };
        Turn {
            _lane: lane.take(ticket),
            turns: self,
            nbytes,
        }
    }

    pub fn duplex(&self) -> bool {
        self.duplex.load(Ordering::Relaxed)
    }

    /// Sets the mode for the turns taken from now on.
    pub fn set_duplex(&self, duplex: bool) {
        self.duplex.store(duplex, Ordering::Relaxed);
    }

    /// Bytes moved at the device since the last call.
    pub fn take_bytes(&self) -> u64 {
        self.bytes.swap(0, Ordering::Relaxed)
    }

    /// Seconds spent waiting for other processes' turns, both directions.
    pub fn lock_wait_s(&self) -> f64 {
        let ns = self.read.lock_wait_ns.load(Ordering::Relaxed)
            + self.write.lock_wait_ns.load(Ordering::Relaxed);
        ns as f64 / 1e9
    }
}

/// A turn at a device; ends when dropped.
#[derive(Debug)]
pub struct Turn<'a> {
    _lane: LaneTurn<'a>,
    turns: &'a DeviceTurns,
    nbytes: u64,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.turns.bytes.fetch_add(self.nbytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn cfg(dir: &Path, slots: usize, exclusive: bool, shared: usize) -> TurnsConfig {
        TurnsConfig {
            slots,
            exclusive,
            shared,
            lock_dir: dir.to_path_buf(),
            duplex: None,
        }
    }

    #[test]
    fn turns_go_in_ticket_order_and_class_first() {
        let dir = tempfile::tempdir().unwrap();
        let t = Arc::new(DeviceTurns::new(7, cfg(dir.path(), 1, false, 1)).unwrap());
        let first = t.take(Op::Read, 1, t.ticket(Class::Foreground));
        let order = Arc::new(Mutex::new(Vec::new()));
        let bg = t.ticket(Class::Background);
        let fg = t.ticket(Class::Foreground);
        let hs: Vec<_> = [(bg, "bg"), (fg, "fg")]
            .into_iter()
            .map(|(tk, name)| {
                let (t, order) = (Arc::clone(&t), Arc::clone(&order));
                std::thread::spawn(move || {
                    let _turn = t.take(Op::Read, 1, tk);
                    lock(&order).push(name);
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50)); // both are waiting
        drop(first);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*lock(&order), ["fg", "bg"]);
        assert_eq!(t.take_bytes(), 3);
    }

    #[test]
    fn another_holder_of_every_lock_file_makes_us_wait() {
        let dir = tempfile::tempdir().unwrap();
        let t = Arc::new(DeviceTurns::new(9, cfg(dir.path(), 1, true, 1)).unwrap());
        // Another open file description of the same lock file stands for another process.
        let other = File::open(dir.path().join("tierstore-io-9-w0.lock")).unwrap();
        // SAFETY: an open file of ours.
        assert_eq!(unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX) }, 0);
        let t2 = Arc::clone(&t);
        let h = std::thread::spawn(move || {
            let _turn = t2.take(Op::Write, 1, t2.ticket(Class::Foreground));
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!h.is_finished(), "took a turn another process holds");
        let _read = t.take(Op::Read, 1, t.ticket(Class::Foreground)); // the other lane is free
                                                                      // SAFETY: as above.
        unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_UN) };
        h.join().unwrap();
        assert!(t.lock_wait_s() > 0.05);
    }

    #[test]
    fn simplex_shares_one_lane() {
        let dir = tempfile::tempdir().unwrap();
        let t = DeviceTurns::new(3, cfg(dir.path(), 1, false, 1)).unwrap();
        t.set_duplex(false);
        let r = t.take(Op::Read, 1, t.ticket(Class::Foreground));
        assert_eq!(lock(&t.read.state).busy, 1);
        drop(r);
        let w = t.take(Op::Write, 1, t.ticket(Class::Foreground));
        assert_eq!(lock(&t.read.state).busy, 1);
        assert_eq!(lock(&t.write.state).busy, 0);
        drop(w);
    }
}
