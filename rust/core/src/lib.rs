//! tierstore-core: the I/O engine and container format of tierstore.
//!
//! This crate knows nothing of Python or tensors. It moves bytes between
//! memory and files at the disk's speed (io_uring with O_DIRECT, a thread-pool
//! fallback, buffered I/O where O_DIRECT is refused), and it reads and writes
//! the zip container that both tierstore and `torch.load` understand.
//!
//! - [`engine`]: configuration, backend choice, workers, buffer pool, paths.
//! - [`io`]: requests, priority classes, per-path limits, the backends.
//! - [`writer`] / [`reader`]: container writes and record reads.
//! - [`zip`] / [`plan`]: the on-disk structures and the byte plan of a write.
//! - [`file`]: O_DIRECT opening and the atomic-replace protocol.
//! - [`copy`]: whole-file copies (reflink or engine requests) for tier promotion.
//! - [`chunks`]: checksums per 512-byte chunk of a record, and verified partial reads.
//! - [`gather`]: copy blocks (affine grids of byte runs) expanded into merged runs.
//! - [`crc`]: a record's CRC-32 and its chunks' in one pass (CRC combination).
//! - [`codec`]: the `tsz1` record codec (chunked byte planes, zstd, deltas against a reference).
//! - [`halves`]: 32-bit words split into 16-bit halves and joined (the offload's split masters).

pub mod archive;
pub mod buf;
pub mod chunks;
pub mod codec;
pub mod copy;
pub mod crc;
pub mod engine;
pub mod error;
pub mod file;
pub mod gather;
pub mod halves;
pub mod io;
pub mod mapped;
pub mod plan;
mod planes;
pub mod probe;
pub mod ranges;
pub mod reader;
pub mod task;
pub mod writer;
pub mod zip;

pub use engine::{Config, Engine, Mode};
pub use error::{Error, Result};
