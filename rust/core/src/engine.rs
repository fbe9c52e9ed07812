//! The engine: configuration, the chosen backend, I/O workers, the staging
//! buffer pool and per-path limits. One engine serves every operation of a
//! process; its threads and buffers are reused across calls.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use crate::buf::BufferPool;
use crate::error::{Error, Result};
use crate::io::turns::{DeviceTurns, TurnsConfig};
use crate::io::{self, Dispatcher, PathSlot, Request};
use crate::probe;

/// Which rung of the fallback ladder the engine runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// io_uring with O_DIRECT (buffered per file where O_DIRECT is refused).
    IoUring,
    /// A pool of threads doing `pread`/`pwrite`, with O_DIRECT.
    Threads,
    /// A pool of threads doing `pread`/`pwrite` through the page cache.
    Buffered,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::IoUring => "io_uring",
            Mode::Threads => "threads",
            Mode::Buffered => "buffered",
        }
    }

    pub fn direct(self) -> bool {
        !matches!(self, Mode::Buffered)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "io_uring" | "uring" | "iouring" => Ok(Mode::IoUring),
            "threads" | "thread" | "pread" | "threadpool" => Ok(Mode::Threads),
            "buffered" | "buffer" | "pagecache" => Ok(Mode::Buffered),
            other => Err(Error::Invalid(format!(
                "unknown backend '{other}': expected io_uring, threads or buffered"
            ))),
        }
    }
}

/// Engine settings. `Default` gives the automatic choices.
#[derive(Clone, Debug)]
pub struct Config {
    /// `None`: io_uring when the kernel allows it, else threads.
    pub mode: Option<Mode>,
    /// Requests in flight per ring (io_uring) or number of threads (threads).
    pub queue_depth: usize,
    /// Size of one transfer; large records are split into chunks of this size.
    pub chunk_size: usize,
    /// Upper bound on staging memory for writes.
    pub pool_bytes: usize,
    /// Requests in flight per path (device).
    pub path_limit: usize,
    /// Threads that copy and checksum data during a save or a load.
    pub cpu_threads: usize,
    /// Whether the engine's buffers of 4 MiB or more (the write staging pool,
    /// the buffers a load fills) ask for transparent huge pages. `None`: yes,
    /// unless the memory is a virtual machine's with free page reporting:
    /// there each fresh huge page costs a host allocation, and a fault may
    /// stall on compaction.
    pub huge_pages: Option<bool>,
}

impl Default for Config {
    fn default() -> Self {
        let ncpu = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        Config {
            mode: None,
            queue_depth: 64,
            chunk_size: 8 << 20,
            pool_bytes: 256 << 20,
            path_limit: 64,
            cpu_threads: ncpu.clamp(1, 8),
            huge_pages: None,
        }
    }
}

/// What `tierstore info` reports about the engine.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub mode: Mode,
    /// Why this mode: "auto" choice, or forced and by what.
    pub mode_reason: String,
    pub io_uring: std::result::Result<(), String>,
    pub config: Config,
    pub pool_allocated: usize,
    /// Whether the engine's large buffers use huge pages, and why.
    pub huge_pages: bool,
    pub huge_pages_reason: String,
}

pub struct Engine {
    config: Config,
    mode: Mode,
    mode_reason: String,
    huge_pages: bool,
    huge_pages_reason: String,
    dispatcher: Arc<Dispatcher>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    pool: Arc<BufferPool>,
    paths: Mutex<HashMap<u64, Arc<PathSlot>>>,
    /// The machine-wide turns of each device that has them (held by their users).
    turns: Mutex<HashMap<u64, Weak<DeviceTurns>>>,
}

impl Engine {
    /// Starts an engine. `forced_by` names where a forced mode came from (an
    /// option, an environment variable) for the report.
    pub fn start(mut config: Config, forced_by: Option<&str>) -> Result<Arc<Self>> {
        if !config.chunk_size.is_power_of_two() || config.chunk_size < 64 << 10 {
            return Err(Error::Invalid(format!(
                "chunk size {} must be a power of two of at least 64 KiB",
                config.chunk_size
            )));
        }
        config.queue_depth = config.queue_depth.clamp(1, 4096);
        config.cpu_threads = config.cpu_threads.clamp(1, 64);
        let uring = probe::io_uring_status();
        let (mode, mode_reason) = match config.mode {
            Some(Mode::IoUring) => {
                if let Err(why) = &uring {
                    return Err(Error::Invalid(format!(
                        "io_uring was requested but is unavailable: {why}"
                    )));
                }
                (
                    Mode::IoUring,
                    format!("forced by {}", forced_by.unwrap_or("option")),
                )
            }
            Some(m) => (m, format!("forced by {}", forced_by.unwrap_or("option"))),
            None => match &uring {
                Ok(()) => (Mode::IoUring, "auto: io_uring available".to_owned()),
                Err(why) => (Mode::Threads, format!("auto: io_uring unavailable ({why})")),
            },
        };
        let (huge_pages, huge_pages_reason) = match config.huge_pages {
            Some(h) => (h, "set by configuration".to_owned()),
            None if probe::free_page_reporting() => (
                false,
                "auto: virtio balloon with free page reporting (a fresh huge page costs a host allocation)"
                    .to_owned(),
            ),
            None => (true, "auto".to_owned()),
        };
        let nbufs = (config.pool_bytes / config.chunk_size).max(2);
        let pool = BufferPool::new(
            config.chunk_size,
            crate::buf::DEFAULT_ALIGN,
            nbufs,
            huge_pages,
        );
        let engine = Arc::new(Engine {
            mode,
            mode_reason,
            huge_pages,
            huge_pages_reason,
            dispatcher: Dispatcher::new(),
            workers: Mutex::new(Vec::new()),
            pool,
            paths: Mutex::new(HashMap::new()),
            turns: Mutex::new(HashMap::new()),
            config,
        });
        engine.spawn_workers()?;
        Ok(engine)
    }

    fn spawn_workers(&self) -> Result<()> {
        let mut ws = self.workers.lock().expect("engine lock");
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Error::Invalid(format!("cannot start an I/O thread: {e}")))
        };
        match self.mode {
            Mode::IoUring => {
                let d = Arc::clone(&self.dispatcher);
                let depth = self.config.queue_depth as u32;
                ws.push(spawn(
                    "tierstore-uring".into(),
                    Box::new(move || {
                        if let Err(e) = io::uring::worker(&d, depth) {
                            // The ring failed after start-up (should not happen
                            // once probed); serve the queue with blocking I/O
                            // rather than leave requests hanging.
                            eprintln!("tierstore: io_uring worker failed ({e}); continuing with blocking I/O");
                            io::threads::worker(&d);
                        }
                    }),
                )?);
            }
            Mode::Threads | Mode::Buffered => {
                for i in 0..self.config.queue_depth.min(64) {
                    let d = Arc::clone(&self.dispatcher);
                    ws.push(spawn(
                        format!("tierstore-io-{i}"),
                        Box::new(move || io::threads::worker(&d)),
                    )?);
                }
            }
        }
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    pub fn info(&self) -> EngineInfo {
        EngineInfo {
            mode: self.mode,
            mode_reason: self.mode_reason.clone(),
            io_uring: probe::io_uring_status(),
            config: self.config.clone(),
            pool_allocated: self.pool.allocated_bytes(),
            huge_pages: self.huge_pages,
            huge_pages_reason: self.huge_pages_reason.clone(),
        }
    }

    /// Whether the engine's large buffers ask for huge pages (resolved from
    /// `Config::huge_pages`).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The in-flight accounting of the device `dev`.
    pub fn path_slot(&self, dev: u64) -> Arc<PathSlot> {
        let mut m = self.paths.lock().expect("engine lock");
        Arc::clone(
            m.entry(dev)
                .or_insert_with(|| PathSlot::new(dev, self.config.path_limit)),
        )
    }

    /// Turns at device `dev` from now on: every transfer the engine runs on
    /// it takes one (see [`crate::io::turns`]) while a holder of the returned
    /// handle lives. A holder of turns with the same settings shares them;
    /// other settings make new turns, which later transfers use.
    pub fn register_turns(&self, dev: u64, config: TurnsConfig) -> Result<Arc<DeviceTurns>> {
        let mut m = self.turns.lock().expect("engine lock");
        if let Some(t) = m.get(&dev).and_then(Weak::upgrade) {
            if t.config == config {
                return Ok(t);
            }
        }
        let t = Arc::new(DeviceTurns::new(dev, config)?);
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(dev, Arc::downgrade(&t));
        Ok(t)
    }

    /// The turns of device `dev`, if it has any.
    pub fn turns(&self, dev: u64) -> Option<Arc<DeviceTurns>> {
        let m = self.turns.lock().expect("engine lock");
        m.get(&dev).and_then(Weak::upgrade)
    }

    /// Limits the background class to `bytes_per_sec` (0: unlimited).
    pub fn set_background_rate(&self, bytes_per_sec: u64) {
        self.dispatcher.set_background_rate(bytes_per_sec);
    }

    pub fn background_rate(&self) -> u64 {
        self.dispatcher.background_rate()
    }

    /// Bytes completed on each path so far: (device id, bytes, requests).
    pub fn path_stats(&self) -> Vec<(u64, u64, u64)> {
        let m = self.paths.lock().expect("engine lock");
        m.values()
            .map(|p| {
                (
                    p.id,
                    p.bytes.load(std::sync::atomic::Ordering::Relaxed),
                    p.ops.load(std::sync::atomic::Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Hands a request to the workers.
    pub fn submit(&self, req: Request) {
        self.dispatcher.submit(req);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.dispatcher.shut_down();
        for h in self.workers.lock().expect("engine lock").drain(..) {
            let _ = h.join();
        }
    }
}
