//! Reading a zip directory and local headers back, every field validated
//! against the file and against the others.

use std::path::Path;

use super::extent::extent;
use super::{
    u16_at, u32_at, u64_at, CdEntry, Directory, ReadAt, Window, CENTRAL_HEADER_LEN, CENTRAL_SIG,
    EOCD_LEN, EOCD_SIG, LOCAL_HEADER_LEN, LOCAL_SIG, MAX_COMMENT, U16_MAX, U32_MAX, ZIP64_EOCD_LEN,
    ZIP64_EOCD_SIG, ZIP64_EXTRA_ID, ZIP64_LOCATOR_LEN, ZIP64_LOCATOR_SIG,
};
use crate::error::{Error, Result};

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
    src.read_exact_at(&mut buf, off).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            // The directory was read from a longer file: it shrank since.
            Error::truncated(
                path,
                format!("{what} at offset {off} (+{len} bytes): the file ends before it (it shrank after it was opened)"),
            )
        } else {
            Error::io(path, "read", e)
        }
    })?;
    Ok(buf)
}

/// Finds the end records and returns (entries, central directory offset, size).
#[allow(clippy::too_many_lines)] // one linear sequence of checks, each with its message
pub(super) fn find_directory(src: &(impl ReadAt + ?Sized), path: &Path) -> Result<(u64, u64, u64)> {
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
pub(super) fn parse_entries(
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
pub(super) fn check_disjoint(
    spans: &mut [(u64, u64, usize)],
    entries: &[CdEntry],
    path: &Path,
) -> Result<()> {
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
/// forward from the start ([`archive_extent`](super::archive_extent)) and the directory is read
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

pub(super) fn read_directory_at_end(
    src: &(impl ReadAt + ?Sized),
    path: &Path,
) -> Result<Directory> {
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
