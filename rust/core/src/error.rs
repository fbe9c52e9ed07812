//! Errors of the engine and the container format.
//!
//! Every variant names the file and, where it applies, the record, so that the
//! message alone tells a user what is damaged and where. The Python binding maps
//! each variant once onto the `tierstore.TierstoreError` hierarchy.

use std::io;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call failed. `op` says which step (open, write,
    /// fsync, rename, ...) so that "read-only file system" during a rename is
    /// told apart from one during the first write.
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The file does not hold a zip archive at all.
    #[error("{}: not a tierstore or torch zip archive: {detail}", path.display())]
    NotAContainer { path: PathBuf, detail: String },
    /// The file ends before the bytes that its own directory promises.
    #[error("{}: truncated file: {detail}", path.display())]
    Truncated { path: PathBuf, detail: String },
    /// A structure inside the archive is inconsistent (sizes or offsets that
    /// point outside the file, overlapping records, bad signatures).
    #[error("{}: {}{detail}", path.display(), record_prefix(record.as_deref()))]
    Corrupt {
        path: PathBuf,
        record: Option<String>,
        detail: String,
    },
    /// The bytes of a record do not match the checksum stored for it.
    #[error(
        "{}: record '{record}': checksum mismatch (stored crc32 {expected:08x}, computed {actual:08x}); the record is damaged",
        path.display()
    )]
    Checksum {
        path: PathBuf,
        record: String,
        expected: u32,
        actual: u32,
    },
    /// A chunk of a record does not match its chunk checksum (partial reads).
    #[error(
        "{}: record '{record}': checksum mismatch in bytes [{start}, {end}) (chunk {chunk}; stored {algo} {expected:08x}, computed {actual:08x}); the record is damaged",
        path.display()
    )]
    ChunkChecksum {
        path: PathBuf,
        record: String,
        chunk: u64,
        start: u64,
        end: u64,
        algo: &'static str,
        expected: u32,
        actual: u32,
    },
    /// A path names something other than a regular file (a FIFO, a device, a
    /// socket): reading it could block forever or never end.
    #[error("{}: not a regular file ({kind}); a checkpoint holds only regular files", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    /// A record the caller asked for is not in the archive.
    #[error("{}: missing record '{record}'", path.display())]
    MissingRecord { path: PathBuf, record: String },
    /// The operation was cancelled (Ctrl-C in the caller); nothing was committed.
    #[error("operation cancelled")]
    Cancelled,
    /// A caller passed an argument the engine cannot use.
    #[error("invalid argument: {0}")]
    Invalid(String),
}

fn record_prefix(record: Option<&str>) -> String {
    match record {
        Some(r) => format!("record '{r}': "),
        None => String::new(),
    }
}

impl Error {
    pub fn io(path: &Path, op: &'static str, source: io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }

    pub fn corrupt(path: &Path, record: Option<&str>, detail: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.to_path_buf(),
            record: record.map(str::to_owned),
            detail: detail.into(),
        }
    }

    pub fn truncated(path: &Path, detail: impl Into<String>) -> Self {
        Error::Truncated {
            path: path.to_path_buf(),
            detail: detail.into(),
        }
    }

    /// The record this error is about, if any.
    pub fn record(&self) -> Option<&str> {
        match self {
            Error::Corrupt { record, .. } => record.as_deref(),
            Error::Checksum { record, .. }
            | Error::ChunkChecksum { record, .. }
            | Error::MissingRecord { record, .. } => Some(record),
            _ => None,
        }
    }

    /// The file this error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::Io { path, .. }
            | Error::NotAContainer { path, .. }
            | Error::Truncated { path, .. }
            | Error::Corrupt { path, .. }
            | Error::Checksum { path, .. }
            | Error::ChunkChecksum { path, .. }
            | Error::NotRegular { path, .. }
            | Error::MissingRecord { path, .. } => Some(path),
            Error::Cancelled | Error::Invalid(_) => None,
        }
    }
}
