//! The container's zip structures: layout, encoding and validated parsing.
//!
//! A tierstore data file is an uncompressed ("stored") zip archive, the same
//! kind `torch.save` writes, so that `torch.load`, Python's `zipfile` and
//! `unzip` all open it. What is ours is where the bytes go: every record's data
//! starts on an `align` boundary (4096 by default), which makes O_DIRECT and
//! `mmap` work on any record without copying. See docs/FORMAT.md for the map.
//!
//! Local file header (30 bytes, then name, then extra):
//!
//! ```text
//!  0  u32  signature 0x04034b50 ("PK\x03\x04")
//!  4  u16  version needed (20, or 45 with zip64)
//!  6  u16  flags (0)
//!  8  u16  method (0 = stored)
//! 10  u16  time (0), 12 u16 date (0x21 = 1980-01-01)
//! 14  u32  crc-32 of the data
//! 18  u32  compressed size   (0xffffffff when in the zip64 extra)
//! 22  u32  uncompressed size (0xffffffff when in the zip64 extra)
//! 26  u16  name length, 28 u16 extra length
//! 30  name, then extra fields:
//!       [0x0001 zip64: u64 uncompressed size, u64 compressed size]  only if needed
//!       0x4246 ("FB") padding: zero bytes so that the data starts aligned
//! ```
//!
//! All integers are little-endian.

use std::io;

mod extent;
mod read;
#[cfg(test)]
pub(crate) mod tests;
mod write;

pub use extent::*;
pub use read::*;
pub use write::*;

pub const LOCAL_SIG: u32 = 0x0403_4b50;
pub const CENTRAL_SIG: u32 = 0x0201_4b50;
pub const EOCD_SIG: u32 = 0x0605_4b50;
pub const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
pub const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;

pub const LOCAL_HEADER_LEN: u64 = 30;
pub const CENTRAL_HEADER_LEN: u64 = 46;
pub const EOCD_LEN: u64 = 22;
pub const ZIP64_EOCD_LEN: u64 = 56;
pub const ZIP64_LOCATOR_LEN: u64 = 20;

/// Extra-field id of the zip64 extended information field.
pub const ZIP64_EXTRA_ID: u16 = 0x0001;
/// Extra-field id of the alignment padding (the id torch uses, "FB").
pub const PADDING_EXTRA_ID: u16 = 0x4246;

const U32_MAX: u64 = 0xffff_ffff;
const U16_MAX: u64 = 0xffff;
/// Largest EOCD comment, and so the furthest the EOCD can sit from the end.
const MAX_COMMENT: u64 = 0xffff;
/// Date field for 1980-01-01, the zip epoch (time fields are zero).
const DOS_DATE: u16 = 0x21;

/// Largest record alignment we write (the padding length must fit a u16).
pub const MAX_ALIGN: u64 = 32768;

/// A record placed in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Full name inside the archive, including the archive-name prefix.
    pub name: String,
    pub size: u64,
    pub crc: u32,
    /// Offset of the local file header.
    pub header_offset: u64,
    /// Offset of the first data byte.
    pub data_offset: u64,
}

impl Entry {
    fn local_zip64(&self) -> bool {
        self.size >= U32_MAX
    }

    /// End of the data (exclusive).
    pub fn data_end(&self) -> u64 {
        self.data_offset + self.size
    }
}

/// Random-access byte source the parser reads from (a file or memory).
pub trait ReadAt {
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl ReadAt for [u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start
            .checked_add(buf.len())
            .filter(|&e| e <= <[u8]>::len(self))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(&self[start..end]);
        Ok(())
    }
}

/// A record as the central directory describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdEntry {
    pub name: String,
    pub crc: u32,
    pub size: u64,
    pub compressed_size: u64,
    pub method: u16,
    pub header_offset: u64,
}

/// The parsed central directory of an archive.
///
/// Built only by [`read_directory`], which promises: the directory lies
/// inside the file, every entry's local header and data (at least
/// `30 + name + compressed_size` bytes from its header) fit in the record area
/// before the directory, and no two entries overlap. [`check_data_range`]
/// then confines each entry's data to the space between its own local header
/// and the next one.
#[derive(Clone, Debug)]
pub struct Directory {
    pub entries: Vec<CdEntry>,
    /// Offset of the central directory (the end of the record area).
    pub cd_offset: u64,
    pub file_len: u64,
    /// Every entry's local header offset, sorted (all distinct).
    header_starts: Vec<u64>,
}

impl Directory {
    /// Where the space of a record whose local header is at `header_offset`
    /// ends: the next record's local header, or the central directory.
    pub fn space_end(&self, header_offset: u64) -> u64 {
        let i = self.header_starts.partition_point(|&s| s <= header_offset);
        self.header_starts
            .get(i)
            .map_or(self.cd_offset, |&s| s.min(self.cd_offset))
    }
}

pub(super) fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}
pub(super) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}
pub(super) fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}
