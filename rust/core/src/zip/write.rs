//! Laying out and encoding the zip structures a tierstore file is written with.

use super::{
    Entry, CENTRAL_SIG, DOS_DATE, EOCD_SIG, LOCAL_HEADER_LEN, LOCAL_SIG, MAX_ALIGN,
    PADDING_EXTRA_ID, U16_MAX, U32_MAX, ZIP64_EOCD_LEN, ZIP64_EOCD_SIG, ZIP64_EXTRA_ID,
    ZIP64_LOCATOR_SIG,
};
use crate::error::{Error, Result};

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

pub(super) fn put_u16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
pub(super) fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
pub(super) fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// The fields a local and a central header share, in the same order:
/// version needed (2.0, or 4.5 with zip64), flags, method (stored), time
/// (0) and date (the zip epoch), and the CRC-32.
fn put_common(v: &mut Vec<u8>, zip64: bool, crc: u32) {
    put_u16(v, if zip64 { 45 } else { 20 });
    put_u16(v, 0);
    put_u16(v, 0);
    put_u16(v, 0);
    put_u16(v, DOS_DATE);
    put_u32(v, crc);
}

/// Encodes the local header of `e`, padded so that it ends at `e.data_offset`.
pub fn local_header(e: &Entry) -> Vec<u8> {
    let total = (e.data_offset - e.header_offset) as usize;
    let name = e.name.as_bytes();
    let zip64 = e.local_zip64();
    let mut v = Vec::with_capacity(total);
    put_u32(&mut v, LOCAL_SIG);
    put_common(&mut v, zip64, e.crc);
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
        put_common(&mut v, zip64, e.crc);
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
