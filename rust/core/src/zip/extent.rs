//! Where an archive ends inside a longer stream (objects saved one after
//! another in one file), found from its end records or, on damage, by
//! walking its local headers.

use super::{
    io, u16_at, u32_at, u64_at, ReadAt, CENTRAL_HEADER_LEN, CENTRAL_SIG, EOCD_LEN, EOCD_SIG,
    LOCAL_HEADER_LEN, LOCAL_SIG, MAX_COMMENT, U16_MAX, U32_MAX, ZIP64_EOCD_LEN, ZIP64_EOCD_SIG,
    ZIP64_EXTRA_ID, ZIP64_LOCATOR_LEN, ZIP64_LOCATOR_SIG,
};

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
/// [`read_directory`](super::read_directory) over a [`Window`] of that length validates everything.
///
/// This is for streams, whose bytes a load reads anyway; the fallback of
/// [`read_directory`](super::read_directory) for files scans only for archives that need it.
pub fn archive_extent(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
    extent(src, true)
}

/// [`archive_extent`]; with `scan_on_damage` false the forward scan runs
/// only when the walk met a record whose sizes follow its data (torch's
/// writer), so that a damaged or cut-short file is not read whole to
/// report it.
pub(super) fn extent(src: &(impl ReadAt + ?Sized), scan_on_damage: bool) -> Option<u64> {
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
pub(super) enum Walk {
    End(u64),
    /// A record with flag bit 3: its sizes follow its data.
    DataDescriptor,
    Failed,
}

pub(super) fn read_vec(src: &(impl ReadAt + ?Sized), off: u64, n: u64) -> Option<Vec<u8>> {
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
pub(super) fn end_at(src: &(impl ReadAt + ?Sized), pos: u64) -> Option<u64> {
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
pub(super) fn end_at_tail(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
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
pub(super) fn scan_extent(src: &(impl ReadAt + ?Sized)) -> Option<u64> {
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
pub(super) fn walk_extent(src: &(impl ReadAt + ?Sized)) -> Walk {
    walk_headers(src).unwrap_or(Walk::Failed)
}

pub(super) fn walk_headers(src: &(impl ReadAt + ?Sized)) -> Option<Walk> {
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
