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
use std::path::Path;

use crate::error::{Error, Result};

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

/// Places records one after another so that each record's data is aligned.
#[derive(Debug)]
pub struct LayoutBuilder {
    align: u64,
    cursor: u64,
    entries: Vec<Entry>,
}

impl LayoutBuilder {
    /// `align` must be a power of two no larger than [`MAX_ALIGN`].
    pub fn new(align: u64) -> Result<Self> {
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(Error::Invalid(format!(
                "record alignment {align} is not a power of two <= {MAX_ALIGN}"
            )));
        }
        Ok(LayoutBuilder {
            align,
            cursor: 0,
            entries: Vec::new(),
        })
    }

    pub fn align(&self) -> u64 {
        self.align
    }

    /// Appends a record of `size` bytes, its data aligned to the builder's
    /// alignment, and returns its placement.
    pub fn push(&mut self, name: &str, size: u64) -> Result<&Entry> {
        self.push_aligned(name, size, self.align)
    }

    /// Appends a record whose data is aligned to `align` (a power of two no
    /// larger than the builder's), for small records that need no page alignment.
    pub fn push_aligned(&mut self, name: &str, size: u64, align: u64) -> Result<&Entry> {
        if !align.is_power_of_two() || align > self.align {
            return Err(Error::Invalid(format!(
                "record alignment {align} must be a power of two <= {}",
                self.align
            )));
        }
        if name.is_empty() || name.len() as u64 > U16_MAX {
            return Err(Error::Invalid(format!(
                "record name must have 1..=65535 bytes, got {}",
                name.len()
            )));
        }
        let zip64_len = if size >= U32_MAX { 4 + 16 } else { 0 };
        let header_offset = self.cursor;
        let base = header_offset + LOCAL_HEADER_LEN + name.len() as u64 + zip64_len + 4;
        let data_offset = base.div_ceil(align) * align;
        self.entries.push(Entry {
            name: name.to_owned(),
            size,
            crc: 0,
            header_offset,
            data_offset,
        });
        self.cursor = data_offset + size;
        Ok(self.entries.last().expect("just pushed"))
    }

    /// Where the next local header (or the central directory) would start.
    pub fn end(&self) -> u64 {
        self.cursor
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    pub fn entries_mut(&mut self) -> &mut [Entry] {
        &mut self.entries
    }
}

fn put_u16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// Encodes the local header of `e`, padded so that it ends at `e.data_offset`.
pub fn local_header(e: &Entry) -> Vec<u8> {
    let total = (e.data_offset - e.header_offset) as usize;
    let name = e.name.as_bytes();
    let zip64 = e.local_zip64();
    let mut v = Vec::with_capacity(total);
    put_u32(&mut v, LOCAL_SIG);
    put_u16(&mut v, if zip64 { 45 } else { 20 });
    put_u16(&mut v, 0);
    put_u16(&mut v, 0);
    put_u16(&mut v, 0);
    put_u16(&mut v, DOS_DATE);
    put_u32(&mut v, e.crc);
    let small = if zip64 { U32_MAX as u32 } else { e.size as u32 };
    put_u32(&mut v, small);
    put_u32(&mut v, small);
    put_u16(&mut v, name.len() as u16);
    let extra_len = total - LOCAL_HEADER_LEN as usize - name.len();
    put_u16(&mut v, extra_len as u16);
    v.extend_from_slice(name);
    if zip64 {
        put_u16(&mut v, ZIP64_EXTRA_ID);
        put_u16(&mut v, 16);
        put_u64(&mut v, e.size);
        put_u64(&mut v, e.size);
    }
    let pad = total - v.len() - 4;
    put_u16(&mut v, PADDING_EXTRA_ID);
    put_u16(&mut v, pad as u16);
    v.resize(total, 0);
    v
}

/// Encodes the central directory of `entries`, placed at `cd_offset`, with the
/// zip64 end records when they are needed and the end-of-central-directory.
pub fn central_directory(entries: &[Entry], cd_offset: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(entries.len() * 80 + 128);
    for e in entries {
        let big_size = e.size >= U32_MAX;
        let big_off = e.header_offset >= U32_MAX;
        let mut extra = Vec::new();
        if big_size || big_off {
            let mut body = Vec::new();
            if big_size {
                put_u64(&mut body, e.size);
                put_u64(&mut body, e.size);
            }
            if big_off {
                put_u64(&mut body, e.header_offset);
            }
            put_u16(&mut extra, ZIP64_EXTRA_ID);
            put_u16(&mut extra, body.len() as u16);
            extra.extend_from_slice(&body);
        }
        let zip64 = !extra.is_empty();
        put_u32(&mut v, CENTRAL_SIG);
        put_u16(&mut v, 0x0300 | if zip64 { 0x2d } else { 0x14 }); // made by: unix, 4.5 or 2.0
        put_u16(&mut v, if zip64 { 45 } else { 20 });
        put_u16(&mut v, 0);
        put_u16(&mut v, 0);
        put_u16(&mut v, 0);
        put_u16(&mut v, DOS_DATE);
        put_u32(&mut v, e.crc);
        let small = if big_size {
            U32_MAX as u32
        } else {
            e.size as u32
        };
        put_u32(&mut v, small);
        put_u32(&mut v, small);
        put_u16(&mut v, e.name.len() as u16);
        put_u16(&mut v, extra.len() as u16);
        put_u16(&mut v, 0); // comment
        put_u16(&mut v, 0); // disk
        put_u16(&mut v, 0); // internal attributes
        put_u32(&mut v, 0o100_644 << 16); // external attributes: regular file, rw-r--r--
        put_u32(
            &mut v,
            if big_off {
                U32_MAX as u32
            } else {
                e.header_offset as u32
            },
        );
        v.extend_from_slice(e.name.as_bytes());
        v.extend_from_slice(&extra);
    }
    let cd_size = v.len() as u64;
    let n = entries.len() as u64;
    let need64 = n >= U16_MAX || cd_offset >= U32_MAX || cd_size >= U32_MAX;
    if need64 {
        let z64_offset = cd_offset + cd_size;
        put_u32(&mut v, ZIP64_EOCD_SIG);
        put_u64(&mut v, ZIP64_EOCD_LEN - 12);
        put_u16(&mut v, 0x0300 | 0x2d); // made by: unix, version 4.5
        put_u16(&mut v, 45);
        put_u32(&mut v, 0);
        put_u32(&mut v, 0);
        put_u64(&mut v, n);
        put_u64(&mut v, n);
        put_u64(&mut v, cd_size);
        put_u64(&mut v, cd_offset);
        put_u32(&mut v, ZIP64_LOCATOR_SIG);
        put_u32(&mut v, 0);
        put_u64(&mut v, z64_offset);
        put_u32(&mut v, 1);
    }
    put_u32(&mut v, EOCD_SIG);
    put_u16(&mut v, 0);
    put_u16(&mut v, 0);
    let n16 = if need64 { U16_MAX as u16 } else { n as u16 };
    put_u16(&mut v, n16);
    put_u16(&mut v, n16);
    put_u32(
        &mut v,
        if need64 {
            U32_MAX as u32
        } else {
            cd_size as u32
        },
    );
    put_u32(
        &mut v,
        if need64 {
            U32_MAX as u32
        } else {
            cd_offset as u32
        },
    );
    put_u16(&mut v, 0);
    v
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

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

pub(crate) fn read_at(
    src: &(impl ReadAt + ?Sized),
    path: &Path,
    off: u64,
    len: u64,
    what: &str,
) -> Result<Vec<u8>> {
    let end = off
        .checked_add(len)
        .filter(|&e| e <= src.len())
        .ok_or_else(|| {
            Error::truncated(
                path,
                format!(
                "{what} at offset {off} (+{len} bytes) lies beyond the end of the file ({} bytes)",
                src.len()
            ),
            )
        })?;
    let _ = end;
    let mut buf = vec![0u8; len as usize];
    src.read_exact_at(&mut buf, off)
        .map_err(|e| Error::io(path, "read", e))?;
    Ok(buf)
}

/// Finds the end records and returns (entries, central directory offset, size).
#[allow(clippy::too_many_lines)] // one linear sequence of checks, each with its message
fn find_directory(src: &(impl ReadAt + ?Sized), path: &Path) -> Result<(u64, u64, u64)> {
    let file_len = src.len();
    if file_len < EOCD_LEN {
        let head = read_at(src, path, 0, file_len.min(4), "file start")?;
        if head.starts_with(b"PK") {
            return Err(Error::truncated(path, format!("only {file_len} bytes")));
        }
        return Err(Error::NotAContainer {
            path: path.to_path_buf(),
            detail: format!("file is {file_len} bytes long, too short for a zip archive"),
        });
    }
    // The end record without a comment, as every torch and tierstore file
    // ends, is read alone; only a file ending otherwise needs the 64 KiB
    // a comment may take searched.
    let last = read_at(src, path, file_len - EOCD_LEN, EOCD_LEN, "end of file")?;
    let plain_end = u32_at(&last, 0) == EOCD_SIG && u16_at(&last, 20) == 0;
    let tail_len = if plain_end {
        EOCD_LEN
    } else {
        file_len.min(EOCD_LEN + MAX_COMMENT)
    };
    let tail_start = file_len - tail_len;
    let tail = if plain_end {
        last
    } else {
        read_at(src, path, tail_start, tail_len, "end of file")?
    };
    let mut eocd_rel = None;
    let mut i = tail.len() - EOCD_LEN as usize;
    loop {
        if u32_at(&tail, i) == EOCD_SIG {
            let comment = u64::from(u16_at(&tail, i + 20));
            if i as u64 + EOCD_LEN + comment == tail_len {
                eocd_rel = Some(i);
                break;
            }
        }
        if i == 0 {
            break;
        }
        i -= 1;
    }
    let Some(eocd_rel) = eocd_rel else {
        let head = read_at(src, path, 0, 4, "file start")?;
        if u32_at(&head, 0) == LOCAL_SIG {
            return Err(Error::truncated(
                path,
                "the file starts as a zip archive but has no end-of-central-directory record \
                 (it was cut short, e.g. by a crash or a full disk)",
            ));
        }
        return Err(Error::NotAContainer {
            path: path.to_path_buf(),
            detail: "no zip end-of-central-directory record".into(),
        });
    };
    let eocd_off = tail_start + eocd_rel as u64;
    let e = &tail[eocd_rel..];
    let mut n_entries = u64::from(u16_at(e, 10));
    let mut cd_size = u64::from(u32_at(e, 12));
    let mut cd_offset = u64::from(u32_at(e, 16));
    let mut cd_end_limit = eocd_off;
    let saturated = n_entries == U16_MAX || cd_size == U32_MAX || cd_offset == U32_MAX;
    let loc = if eocd_off >= ZIP64_LOCATOR_LEN {
        Some(read_at(
            src,
            path,
            eocd_off - ZIP64_LOCATOR_LEN,
            ZIP64_LOCATOR_LEN,
            "zip64 locator",
        )?)
    } else {
        None
    };
    let has_locator = loc
        .as_ref()
        .is_some_and(|l| u32_at(l, 0) == ZIP64_LOCATOR_SIG);
    if saturated && !has_locator {
        return Err(Error::corrupt(
            path,
            None,
            "zip64 locator missing or damaged",
        ));
    }
    if let (true, Some(loc)) = (has_locator, loc) {
        // A zip64 end record (torch writes one into every archive): used
        // where the end record's fields are saturated, and otherwise required
        // to agree with them, so that no reader (ours on a stream, Python's
        // zipfile) takes another directory from the file than this one does.
        let z64_off = u64_at(&loc, 8);
        if z64_off
            .checked_add(ZIP64_EOCD_LEN)
            .is_none_or(|end| end > eocd_off - ZIP64_LOCATOR_LEN)
        {
            return Err(Error::corrupt(
                path,
                None,
                format!("zip64 end record offset {z64_off} is outside the file"),
            ));
        }
        let z = read_at(src, path, z64_off, ZIP64_EOCD_LEN, "zip64 end record")?;
        if u32_at(&z, 0) != ZIP64_EOCD_SIG {
            return Err(Error::corrupt(path, None, "zip64 end record damaged"));
        }
        let (zn, zsize, zoff) = (u64_at(&z, 32), u64_at(&z, 40), u64_at(&z, 48));
        if !saturated && (zn, zsize, zoff) != (n_entries, cd_size, cd_offset) {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "the zip64 end record ({zn} records, directory of {zsize} bytes at {zoff}) disagrees \
                     with the end record ({n_entries} records, {cd_size} bytes at {cd_offset})"
                ),
            ));
        }
        (n_entries, cd_size, cd_offset) = (zn, zsize, zoff);
        cd_end_limit = z64_off;
    }
    let cd_end = cd_offset
        .checked_add(cd_size)
        .ok_or_else(|| Error::corrupt(path, None, "central directory offset and size overflow"))?;
    if cd_end > cd_end_limit {
        if cd_end > file_len {
            return Err(Error::truncated(
                path,
                format!("central directory ends at {cd_end}, past the end of the file ({file_len} bytes)"),
            ));
        }
        return Err(Error::corrupt(
            path,
            None,
            format!("central directory [{cd_offset}, {cd_end}) overlaps its end record at {cd_end_limit}"),
        ));
    }
    if n_entries > cd_size / CENTRAL_HEADER_LEN {
        return Err(Error::corrupt(
            path,
            None,
            format!("central directory claims {n_entries} records in {cd_size} bytes"),
        ));
    }
    Ok((n_entries, cd_offset, cd_size))
}

/// Parses `n_entries` central-directory entries from `cd` (read at `cd_offset`),
/// and returns them with their local header offsets, sorted.
fn parse_entries(
    cd: &[u8],
    n_entries: u64,
    cd_offset: u64,
    path: &Path,
) -> Result<(Vec<CdEntry>, Vec<u64>)> {
    let mut entries = Vec::with_capacity(n_entries as usize);
    // (local header offset, least end of the record's bytes, entry index)
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(n_entries as usize);
    let mut p = 0usize;
    for idx in 0..n_entries {
        if p + CENTRAL_HEADER_LEN as usize > cd.len() || u32_at(cd, p) != CENTRAL_SIG {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "central directory entry {idx} at offset {} is damaged",
                    cd_offset + p as u64
                ),
            ));
        }
        let method = u16_at(cd, p + 10);
        let crc = u32_at(cd, p + 16);
        let mut compressed_size = u64::from(u32_at(cd, p + 20));
        let mut size = u64::from(u32_at(cd, p + 24));
        let name_len = usize::from(u16_at(cd, p + 28));
        let extra_len = usize::from(u16_at(cd, p + 30));
        let comment_len = usize::from(u16_at(cd, p + 32));
        let mut header_offset = u64::from(u32_at(cd, p + 42));
        let var_start = p + CENTRAL_HEADER_LEN as usize;
        let next = var_start + name_len + extra_len + comment_len;
        if next > cd.len() {
            return Err(Error::corrupt(
                path,
                None,
                format!("central directory entry {idx} runs past the directory"),
            ));
        }
        let name = String::from_utf8_lossy(&cd[var_start..var_start + name_len]).into_owned();
        // zip64 extended information: only the fields that are 0xffffffff, in order.
        let mut x = var_start + name_len;
        let xend = x + extra_len;
        while x + 4 <= xend {
            let id = u16_at(cd, x);
            let len = usize::from(u16_at(cd, x + 2));
            let body = x + 4;
            if body + len > xend {
                break;
            }
            if id == ZIP64_EXTRA_ID {
                let mut q = body;
                let mut take = |field: &mut u64| {
                    if *field == U32_MAX && q + 8 <= body + len {
                        *field = u64_at(cd, q);
                        q += 8;
                    }
                };
                take(&mut size);
                take(&mut compressed_size);
                take(&mut header_offset);
            }
            x = body + len;
        }
        if header_offset
            .checked_add(LOCAL_HEADER_LEN + name_len as u64)
            .is_none_or(|end| end > cd_offset)
        {
            return Err(Error::corrupt(
                path,
                Some(&name),
                format!("local header offset {header_offset} lies outside the record area (which ends at {cd_offset})"),
            ));
        }
        if compressed_size > cd_offset {
            return Err(Error::corrupt(
                path,
                Some(&name),
                format!(
                    "size {compressed_size} is larger than the record area ({cd_offset} bytes)"
                ),
            ));
        }
        // The least a record occupies: its local header with the name the
        // directory gives, then its data.
        let least_end =
            (header_offset + LOCAL_HEADER_LEN + name_len as u64).saturating_add(compressed_size);
        if least_end > cd_offset {
            return Err(Error::corrupt(
                path,
                Some(&name),
                format!(
                    "record at {header_offset} ({compressed_size} bytes of data) runs into the central directory at {cd_offset}"
                ),
            ));
        }
        spans.push((header_offset, least_end, entries.len()));
        entries.push(CdEntry {
            name,
            crc,
            size,
            compressed_size,
            method,
            header_offset,
        });
        p = next;
    }
    check_disjoint(&mut spans, &entries, path)?;
    Ok((entries, spans.into_iter().map(|s| s.0).collect()))
}

/// Checks that no two records' least spans `(header offset, least end,
/// entry)` overlap, and sorts them by header offset. Overlapping entries
/// would let a small file claim far more data than it holds (a zip bomb
/// without compression).
fn check_disjoint(spans: &mut [(u64, u64, usize)], entries: &[CdEntry], path: &Path) -> Result<()> {
    spans.sort_unstable();
    for w in spans.windows(2) {
        let ((a_start, a_end, a), (b_start, _, b)) = (w[0], w[1]);
        if a_end > b_start {
            return Err(Error::corrupt(
                path,
                Some(&entries[b].name),
                format!(
                    "record at {b_start} overlaps record '{}' at {a_start} (which needs at least [{a_start}, {a_end}))",
                    entries[a].name
                ),
            ));
        }
    }
    Ok(())
}

/// Reads and validates the central directory. Every size and offset is checked
/// against the file length before anything is allocated from it, and entries
/// whose records would overlap are refused (see [`Directory`]).
///
/// An archive followed by other bytes (trailing data, or a second archive
/// saved after it) has its end records before the end of the source; when
/// none are found at the end, the archive's extent is found by walking
/// forward from the start ([`archive_extent`]) and the directory is read
/// from that prefix, as `torch.load` reads such files.
pub fn read_directory(src: &(impl ReadAt + ?Sized), path: &Path) -> Result<Directory> {
    match read_directory_at_end(src, path) {
        Ok(dir) => Ok(dir),
        Err(err) => match extent(src, false) {
            Some(len) if len < src.len() => {
                read_directory_at_end(&Window { src, len }, path).map_err(|_| err)
            }
            _ => Err(err),
        },
    }
}

fn read_directory_at_end(src: &(impl ReadAt + ?Sized), path: &Path) -> Result<Directory> {
    let file_len = src.len();
    let (n_entries, cd_offset, cd_size) = find_directory(src, path)?;
    let cd = read_at(src, path, cd_offset, cd_size, "central directory")?;
    let (entries, header_starts) = parse_entries(&cd, n_entries, cd_offset, path)?;
    Ok(Directory {
        entries,
        cd_offset,
        file_len,
        header_starts,
    })
}

/// A view of the first `len` bytes of another source: an archive that sits
/// at the start of a longer stream (objects saved one after another in one
/// file).
pub struct Window<'a, S: ReadAt + ?Sized> {
    pub src: &'a S,
    pub len: u64,
}

impl<S: ReadAt + ?Sized> ReadAt for Window<'_, S> {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.len)
        {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.src.read_exact_at(buf, offset)
    }
}

/// Where an archive that starts at offset 0 of `src` ends, when more may
/// follow it (objects saved one after another in one stream, or trailing
/// bytes), so that its end cannot simply be searched for from the back.
/// Tried in order of cost:
///
/// 1. a walk over its local records (sizes in their headers), central
///    directory and end records, reading only the headers;
/// 2. end records at the very end of `src` whose directory ends right
///    before them, as an archive alone in its stream has;
/// 3. a forward scan of the bytes for the first end record whose directory
///    ends right before it (archives whose records give their sizes only
///    after the data, flag bit 3, as torch's writer does).
///
/// `None` when none finds an end. The result is only a proposal:
/// [`read_directory`] over a [`Window`] of that length validates everything.
///
/// This is for streams, whose bytes a load reads anyway; the fallback of
/// [`read_directory`] for files scans only for archives that need it.
pub fn archive_extent(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
    extent(src, true)
}

/// [`archive_extent`]; with `scan_on_damage` false the forward scan runs
/// only when the walk met a record whose sizes follow its data (torch's
/// writer), so that a damaged or cut-short file is not read whole to
/// report it.
fn extent(src: &(impl ReadAt + ?Sized), scan_on_damage: bool) -> Option<u64> {
    match walk_extent(src) {
        Walk::End(end) => Some(end),
        Walk::DataDescriptor => end_at_tail(src).or_else(|| scan_extent(src)),
        // A local header that lies (damage the directory does not share).
        Walk::Failed => {
            end_at_tail(src).or_else(|| scan_on_damage.then(|| scan_extent(src)).flatten())
        }
    }
}

/// What the walk over an archive's headers found.
#[derive(Debug, PartialEq, Eq)]
enum Walk {
    End(u64),
    /// A record with flag bit 3: its sizes follow its data.
    DataDescriptor,
    Failed,
}

fn read_vec(src: &(impl ReadAt + ?Sized), off: u64, n: u64) -> Option<Vec<u8>> {
    if off.checked_add(n)? > src.len() {
        return None;
    }
    let mut b = vec![0u8; usize::try_from(n).ok()?];
    src.read_exact_at(&mut b, off).ok()?;
    Some(b)
}

/// The end of the archive if an end-of-central-directory record sits at
/// `pos` and the directory it points to ends exactly where the end records
/// begin (no gap, as every writer leaves it), all relative to offset 0.
fn end_at(src: &(impl ReadAt + ?Sized), pos: u64) -> Option<u64> {
    let e = read_vec(src, pos, EOCD_LEN)?;
    if u32_at(&e, 0) != EOCD_SIG {
        return None;
    }
    let end = pos.checked_add(EOCD_LEN + u64::from(u16_at(&e, 20)))?;
    if end > src.len() {
        return None;
    }
    let n = u64::from(u16_at(&e, 10));
    let cd_size = u64::from(u32_at(&e, 12));
    let cd_offset = u64::from(u32_at(&e, 16));
    let zip64 = n == U16_MAX || cd_size == U32_MAX || cd_offset == U32_MAX;
    // Writers may add the zip64 end records even when nothing needs them
    // (torch does): then the directory ends where they begin.
    let loc = pos
        .checked_sub(ZIP64_LOCATOR_LEN)
        .and_then(|at| Some((at, read_vec(src, at, ZIP64_LOCATOR_LEN)?)))
        .filter(|(_, loc)| u32_at(loc, 0) == ZIP64_LOCATOR_SIG);
    let (cd_offset, cd_size, records_at) = match loc {
        Some((loc_at, loc)) => {
            let z_at = u64_at(&loc, 8);
            let z = read_vec(src, z_at, ZIP64_EOCD_LEN)?;
            if u32_at(&z, 0) != ZIP64_EOCD_SIG
                || z_at.checked_add(12)?.checked_add(u64_at(&z, 4))? != loc_at
            {
                return None;
            }
            (u64_at(&z, 48), u64_at(&z, 40), z_at)
        }
        None if zip64 => return None,
        None => (cd_offset, cd_size, pos),
    };
    (cd_offset.checked_add(cd_size)? == records_at).then_some(end)
}

/// Step 2 of [`archive_extent`]: end records ending exactly at the end of `src`.
fn end_at_tail(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
    let len = src.len();
    let tail_len = len.min(EOCD_LEN + MAX_COMMENT);
    let tail_start = len - tail_len;
    let tail = read_vec(src, tail_start, tail_len)?;
    (0..tail.len().checked_sub(EOCD_LEN as usize - 1)?)
        .rev()
        .filter(|&i| u32_at(&tail, i) == EOCD_SIG)
        .find_map(|i| end_at(src, tail_start + i as u64).filter(|&e| e == len))
}

/// Step 3 of [`archive_extent`]: the first consistent end record, scanning
/// forward in 1 MiB pieces.
fn scan_extent(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
    const PIECE: u64 = 1 << 20;
    let len = src.len();
    let mut off = 0u64;
    while off + EOCD_LEN <= len {
        let n = PIECE.min(len - off);
        let b = read_vec(src, off, n)?;
        for i in 0..b.len().saturating_sub(3) {
            if u32_at(&b, i) == EOCD_SIG {
                if let Some(end) = end_at(src, off + i as u64) {
                    return Some(end);
                }
            }
        }
        if off + n >= len {
            break;
        }
        off += n - 3; // a signature across two pieces is found in the next
    }
    None
}

/// Step 1 of [`archive_extent`]: the walk over the headers.
fn walk_extent(src: &(impl ReadAt + ?Sized)) -> Walk {
    walk_headers(src).unwrap_or(Walk::Failed)
}

fn walk_headers(src: &(impl ReadAt + ?Sized)) -> Option<Walk> {
    let len = src.len();
    let get = |off: u64, n: u64| read_vec(src, off, n);
    let mut p = 0u64;
    // Local records.
    loop {
        if u32_at(&get(p, 4)?, 0) != LOCAL_SIG {
            break;
        }
        let h = get(p, LOCAL_HEADER_LEN)?;
        if u16_at(&h, 6) & 0x0008 != 0 {
            return Some(Walk::DataDescriptor);
        }
        let name_len = u64::from(u16_at(&h, 26));
        let extra_len = u64::from(u16_at(&h, 28));
        let mut usize_ = u64::from(u32_at(&h, 22));
        let mut csize = u64::from(u32_at(&h, 18));
        if usize_ == U32_MAX || csize == U32_MAX {
            let extra = get(p + LOCAL_HEADER_LEN + name_len, extra_len)?;
            let mut x = 0usize;
            let mut found = false;
            while x + 4 <= extra.len() {
                let id = u16_at(&extra, x);
                let n = usize::from(u16_at(&extra, x + 2));
                if x + 4 + n > extra.len() {
                    break;
                }
                if id == ZIP64_EXTRA_ID {
                    let mut q = x + 4;
                    for field in [&mut usize_, &mut csize] {
                        if *field == U32_MAX && q + 8 <= x + 4 + n {
                            *field = u64_at(&extra, q);
                            q += 8;
                        }
                    }
                    found = true;
                }
                x += 4 + n;
            }
            if !found || csize == U32_MAX {
                return None;
            }
        }
        p = p
            .checked_add(LOCAL_HEADER_LEN + name_len + extra_len)?
            .checked_add(csize)?;
    }
    // Central directory entries.
    loop {
        let h = get(p, 4)?;
        if u32_at(&h, 0) != CENTRAL_SIG {
            break;
        }
        let h = get(p, CENTRAL_HEADER_LEN)?;
        let var = u64::from(u16_at(&h, 28)) + u64::from(u16_at(&h, 30)) + u64::from(u16_at(&h, 32));
        p = p.checked_add(CENTRAL_HEADER_LEN + var)?;
    }
    // End records: zip64 end record and locator when present, then the EOCD.
    let mut sig = u32_at(&get(p, 4)?, 0);
    if sig == ZIP64_EOCD_SIG {
        let h = get(p, 12)?;
        p = p.checked_add(12)?.checked_add(u64_at(&h, 4))?;
        sig = u32_at(&get(p, 4)?, 0);
    }
    if sig == ZIP64_LOCATOR_SIG {
        p = p.checked_add(ZIP64_LOCATOR_LEN)?;
        sig = u32_at(&get(p, 4)?, 0);
    }
    if sig != EOCD_SIG {
        return None;
    }
    let e = get(p, EOCD_LEN)?;
    p.checked_add(EOCD_LEN + u64::from(u16_at(&e, 20)))
        .filter(|&end| end <= len)
        .map(Walk::End)
}

/// Bytes to read at a local header to learn its data offset in one go
/// (30 bytes, the name, and a generous allowance for the extra field).
pub fn local_header_probe_len(name_len: usize) -> u64 {
    LOCAL_HEADER_LEN + name_len as u64 + 512
}

/// Parses the local header of `e` from `buf` (read at `e.header_offset`) and
/// returns the data offset. Errors if the bytes do not form its header or if
/// the data would run past the record area.
pub fn data_offset_from_local(
    buf: &[u8],
    e: &CdEntry,
    dir: &Directory,
    path: &Path,
) -> Result<u64> {
    if buf.len() < LOCAL_HEADER_LEN as usize || u32_at(buf, 0) != LOCAL_SIG {
        return Err(Error::corrupt(
            path,
            Some(&e.name),
            format!("no local file header at offset {}", e.header_offset),
        ));
    }
    let name_len = u64::from(u16_at(buf, 26));
    let extra_len = u64::from(u16_at(buf, 28));
    let Some(data_offset) = e
        .header_offset
        .checked_add(LOCAL_HEADER_LEN + name_len + extra_len)
    else {
        return Err(Error::corrupt(
            path,
            Some(&e.name),
            format!("local header offset {} is out of range", e.header_offset),
        ));
    };
    check_data_range(e, data_offset, dir, path)?;
    Ok(data_offset)
}

/// Every entry's data offset, from its local header, read one after another
/// from `src` (a stream; files use the engine's parallel reads instead).
pub fn data_offsets(
    src: &(impl ReadAt + ?Sized),
    dir: &Directory,
    path: &Path,
) -> Result<Vec<u64>> {
    dir.entries
        .iter()
        .map(|e| {
            let end = (e.header_offset + local_header_probe_len(e.name.len())).min(dir.cd_offset);
            let b = read_at(
                src,
                path,
                e.header_offset,
                end - e.header_offset,
                "local header",
            )?;
            data_offset_from_local(&b, e, dir, path)
        })
        .collect()
}

/// Checks that `[data_offset, data_offset + compressed_size)` lies inside the
/// record area, after the entry's local header and before the next record's
/// local header (or the directory), so that no two records share bytes.
pub fn check_data_range(e: &CdEntry, data_offset: u64, dir: &Directory, path: &Path) -> Result<()> {
    let min = e
        .header_offset
        .checked_add(LOCAL_HEADER_LEN + e.name.len() as u64);
    let limit = dir.space_end(e.header_offset);
    let end = data_offset.checked_add(e.compressed_size);
    if min.is_none_or(|min| data_offset < min) || end.is_none_or(|end| end > limit) {
        let next = if limit < dir.cd_offset {
            format!("the next record's header at {limit}")
        } else {
            format!("the directory at {limit}")
        };
        return Err(Error::corrupt(
            path,
            Some(&e.name),
            format!(
                "data [{data_offset}, +{}) does not fit between its header at {} and {next}",
                e.compressed_size, e.header_offset
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The bytes of an archive holding `records`, as the writer lays it out.
    pub(crate) fn build(records: &[(&str, &[u8])], align: u64) -> Vec<u8> {
        let mut lb = LayoutBuilder::new(align).unwrap();
        for (n, d) in records {
            lb.push(n, d.len() as u64).unwrap();
        }
        let end = lb.end();
        let mut file = vec![0u8; end as usize];
        for (e, (_, d)) in lb.entries_mut().iter_mut().zip(records) {
            e.crc = crc32fast::hash(d);
            let h = local_header(e);
            file[e.header_offset as usize..e.data_offset as usize].copy_from_slice(&h);
            file[e.data_offset as usize..e.data_end() as usize].copy_from_slice(d);
        }
        file.extend(central_directory(lb.entries(), end));
        file
    }

    #[test]
    fn archive_extent_finds_the_end_of_the_first_of_several_archives() {
        let a = build(&[("a/data.pkl", b"abc"), ("a/data/0", &[7u8; 5000])], 64);
        let b = build(&[("b/data.pkl", b"xyz")], 64);
        let mut stream = a.clone();
        stream.extend_from_slice(b"between");
        stream.extend_from_slice(&b);
        assert_eq!(archive_extent(stream.as_slice()), Some(a.len() as u64));
        assert_eq!(archive_extent(b.as_slice()), Some(b.len() as u64));
        let w = Window {
            src: stream.as_slice(),
            len: a.len() as u64,
        };
        let dir = read_directory(&w, Path::new("s")).unwrap();
        assert_eq!(dir.entries.len(), 2);
        // An empty archive is its end record alone.
        let empty = build(&[], 64);
        assert_eq!(archive_extent(empty.as_slice()), Some(empty.len() as u64));
    }

    #[test]
    fn read_directory_reads_an_archive_followed_by_other_bytes() {
        let a = build(&[("a/data.pkl", b"abc"), ("a/data/0", &[7u8; 100])], 64);
        for tail in [&b"x"[..], &vec![0u8; 70_000][..], &b"PK\x05\x06"[..]] {
            let mut f = a.clone();
            f.extend_from_slice(tail);
            let dir = read_directory(f.as_slice(), Path::new("t")).unwrap();
            assert_eq!(dir.file_len, a.len() as u64);
            assert_eq!(dir.entries.len(), 2);
        }
        // Damage at the end is still reported as such when no walk succeeds.
        let cut = &a[..a.len() - 3];
        assert!(matches!(
            read_directory(cut, Path::new("t")),
            Err(Error::Truncated { .. })
        ));
    }

    #[test]
    fn archive_extent_declines_what_it_cannot_walk() {
        let a = build(&[("a/data.pkl", b"abc")], 64);
        // Cut anywhere: no end found.
        for cut in [0, 10, 40, a.len() - 1] {
            assert_eq!(archive_extent(&a[..cut]), None, "cut at {cut}");
        }
        // Sizes in a data descriptor (flag bit 3), or a local size that
        // lies: the walk declines, the end records are still found (alone in
        // the stream, or followed by more).
        let mut d = a.clone();
        d[6] |= 0x08;
        assert_eq!(walk_extent(d.as_slice()), Walk::DataDescriptor);
        assert_eq!(archive_extent(d.as_slice()), Some(a.len() as u64));
        let mut dd = d.clone();
        dd.extend_from_slice(&vec![1u8; 3 << 20]);
        dd.extend_from_slice(&a);
        assert_eq!(archive_extent(dd.as_slice()), Some(a.len() as u64));
        // A local size that lies (damage the directory does not share): a
        // stream is scanned; a file's fallback does not read it all.
        let mut l = a.clone();
        l[18] = 0xee;
        assert_eq!(walk_extent(l.as_slice()), Walk::Failed);
        assert_eq!(archive_extent(l.as_slice()), Some(a.len() as u64));
        l.extend_from_slice(&vec![1u8; 3 << 20]);
        l.extend_from_slice(&a);
        assert_eq!(archive_extent(l.as_slice()), Some(a.len() as u64));
        assert_eq!(extent(l.as_slice(), false), None);
        // End records whose directory does not end right before them.
        let mut g = d.clone();
        let eocd = g.len() - 22;
        g[eocd + 16] = g[eocd + 16].wrapping_sub(1);
        assert_eq!(archive_extent(g.as_slice()), None);
        // Not a zip at all.
        assert_eq!(
            archive_extent(&b"\x80\x02hello world, this is not a zip file"[..]),
            None
        );
    }

    #[test]
    fn layout_aligns_every_record() {
        let mut lb = LayoutBuilder::new(4096).unwrap();
        for (i, size) in [0u64, 1, 4095, 4096, 10_000].iter().enumerate() {
            let e = lb
                .push(&format!("archive/data/{i}"), *size)
                .unwrap()
                .clone();
            assert_eq!(e.data_offset % 4096, 0);
            assert!(e.data_offset >= e.header_offset + 30 + e.name.len() as u64 + 4);
            assert!(e.data_offset - e.header_offset < 4096 + 30 + e.name.len() as u64 + 4);
            assert_eq!(
                local_header(&e).len() as u64,
                e.data_offset - e.header_offset
            );
        }
    }

    #[test]
    fn roundtrip_directory() {
        let file = build(
            &[
                ("a/data.pkl", b"hello"),
                ("a/data/0", &[7u8; 5000]),
                ("a/x", b""),
            ],
            4096,
        );
        let dir = read_directory(file.as_slice(), Path::new("mem")).unwrap();
        assert_eq!(dir.entries.len(), 3);
        assert_eq!(dir.entries[1].name, "a/data/0");
        assert_eq!(dir.entries[1].size, 5000);
        assert_eq!(dir.entries[1].crc, crc32fast::hash(&[7u8; 5000]));
        let e = &dir.entries[1];
        let probe = &file[e.header_offset as usize..];
        let off = data_offset_from_local(probe, e, &dir, Path::new("mem")).unwrap();
        assert_eq!(off % 4096, 0);
        assert_eq!(&file[off as usize..off as usize + 5000], &[7u8; 5000][..]);
    }

    #[test]
    fn zip64_fields_roundtrip_in_directory() {
        // A 5 GiB record placed beyond 4 GiB: only the directory is encoded.
        let e = Entry {
            name: "a/data/0".into(),
            size: 5 << 30,
            crc: 0x1234_5678,
            header_offset: 6 << 30,
            data_offset: (6 << 30) + 4096,
        };
        let cd_off = e.data_end();
        let cd = central_directory(std::slice::from_ref(&e), cd_off);
        // Simulate a file whose record area is sparse: a reader over a
        // virtual source that only serves the directory bytes.
        struct Sparse {
            cd_off: u64,
            cd: Vec<u8>,
        }
        impl ReadAt for Sparse {
            fn len(&self) -> u64 {
                self.cd_off + self.cd.len() as u64
            }
            fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
                for (i, b) in buf.iter_mut().enumerate() {
                    let o = offset + i as u64;
                    *b = if o >= self.cd_off {
                        self.cd[(o - self.cd_off) as usize]
                    } else {
                        0
                    };
                }
                Ok(())
            }
        }
        let src = Sparse { cd_off, cd };
        let dir = read_directory(&src, Path::new("virtual")).unwrap();
        assert_eq!(dir.entries[0].size, 5 << 30);
        assert_eq!(dir.entries[0].header_offset, 6 << 30);
        assert_eq!(dir.cd_offset, cd_off);
        let h = local_header(&e);
        assert_eq!(
            u32::from_le_bytes(h[18..22].try_into().unwrap()),
            0xffff_ffff
        );
    }

    fn set(file: &mut [u8], at: usize, v: &[u8]) {
        file[at..at + v.len()].copy_from_slice(v);
    }

    /// Offset of central-directory entry `i` (names of `name_len` bytes, no extras).
    fn cd_entry(dir: &Directory, i: usize, name_len: usize) -> usize {
        dir.cd_offset as usize + i * (CENTRAL_HEADER_LEN as usize + name_len)
    }

    #[test]
    fn overlapping_records_are_refused() {
        let p = Path::new("f");
        let recs: [(&str, &[u8]); 3] = [("a/r0", &[1u8; 100]), ("a/r1", &[2u8; 10]), ("a/r2", b"")];
        let file = build(&recs, 64);
        let dir = read_directory(file.as_slice(), p).unwrap();
        let h1 = dir.entries[1].header_offset as u32;
        // Two entries naming the same local header (and so the same data).
        let mut bad = file.clone();
        set(&mut bad, cd_entry(&dir, 2, 4) + 42, &h1.to_le_bytes());
        let err = read_directory(bad.as_slice(), p).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        // An entry whose header lies inside the data of the one before it:
        // refused with the directory when the least spans overlap, ...
        let mut bad = file.clone();
        set(
            &mut bad,
            cd_entry(&dir, 1, 4) + 42,
            &(h1 - 40).to_le_bytes(),
        );
        let err = read_directory(bad.as_slice(), p).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        // ... and otherwise when the local header places the data.
        let mut bad = file.clone();
        set(
            &mut bad,
            cd_entry(&dir, 1, 4) + 42,
            &(h1 - 20).to_le_bytes(),
        );
        let d = read_directory(bad.as_slice(), p).unwrap();
        assert!(data_offset_from_local(&bad, &d.entries[0], &d, p).is_err());
        // Found by tests/fuzz_parsers.rs: entry 0's header moved into the
        // padding before entry 1's data. Each entry's least span fits, but
        // entry 1's data (per its local header) would cover entry 0's header.
        let file = build(&[("a/data/0", b""), ("a/data/1", b"")], 256);
        let dir = read_directory(file.as_slice(), p).unwrap();
        let mut bad = file.clone();
        let moved = dir.cd_offset as u32 - 38;
        set(&mut bad, cd_entry(&dir, 0, 8) + 42, &moved.to_le_bytes());
        let dir = read_directory(bad.as_slice(), p).unwrap();
        let e = &dir.entries[1];
        let err = data_offset_from_local(&bad[e.header_offset as usize..], e, &dir, p).unwrap_err();
        assert!(err.to_string().contains("next record's header"), "{err}");
    }

    #[test]
    fn data_may_not_run_into_the_next_record() {
        let p = Path::new("f");
        let file = build(&[("a/r0", &[1u8; 100]), ("a/r1", &[2u8; 10])], 64);
        let dir = read_directory(file.as_slice(), p).unwrap();
        let (e0, e1) = (&dir.entries[0], &dir.entries[1]);
        let good = data_offset_from_local(&file, e0, &dir, p).unwrap();
        // A longer extra field in the local header pushes the data over the
        // next record's header; so does an offset a manifest states.
        let mut bad = file.clone();
        set(&mut bad, 28, &(good as u16 - 30 - 4 + 16).to_le_bytes());
        assert!(data_offset_from_local(&bad, e0, &dir, p).is_err());
        assert!(check_data_range(e0, good + 16, &dir, p).is_err());
        assert!(check_data_range(e0, e1.header_offset - 100, &dir, p).is_ok());
        assert!(check_data_range(e0, e1.header_offset - 99, &dir, p).is_err());
        assert_eq!(dir.space_end(e0.header_offset), e1.header_offset);
        assert_eq!(dir.space_end(e1.header_offset), dir.cd_offset);
    }

    #[test]
    fn forged_entries_do_not_overflow() {
        let p = Path::new("f");
        let file = build(&[("a/r0", &[1u8; 100])], 64);
        let dir = read_directory(file.as_slice(), p).unwrap();
        let mut e = dir.entries[0].clone();
        e.header_offset = u64::MAX - 10;
        assert!(data_offset_from_local(&file, &e, &dir, p).is_err());
        assert!(check_data_range(&e, 0, &dir, p).is_err());
        e.header_offset = 0;
        e.compressed_size = u64::MAX;
        assert!(check_data_range(&e, 64, &dir, p).is_err());
    }

    #[test]
    fn rejects_garbage_and_truncation() {
        let p = Path::new("f");
        assert!(matches!(
            read_directory(&b"hello world, not a zip at all"[..], p),
            Err(Error::NotAContainer { .. })
        ));
        let file = build(
            &[("a/data.pkl", b"hello"), ("a/data/0", &[1u8; 9000])],
            4096,
        );
        let cut = &file[..file.len() - 10];
        assert!(matches!(
            read_directory(cut, p),
            Err(Error::Truncated { .. })
        ));
        // Absurd directory size: no huge allocation, a clear error.
        let mut bad = file.clone();
        let n = bad.len();
        bad[n - 10..n - 6].copy_from_slice(&0xfff0_0000u32.to_le_bytes());
        assert!(read_directory(bad.as_slice(), p).is_err());
    }
}
