//! Chunk checksums: one checksum per fixed-size chunk of a record, so that a
//! read of part of a record (every resharding load) is verified without
//! reading the whole record.
//!
//! A record of `size` bytes whose data starts at file offset `data_offset` is
//! cut into chunks of `chunk` bytes, the last one shorter: chunk `i` covers
//! the record's bytes `[i * chunk, min((i + 1) * chunk, size))`. tierstore
//! writes 512-byte chunks ([`CHUNK`]; files written before have 4096-byte
//! ones, read as their tables say): a reader checks whole every chunk it
//! returns bytes of, so the chunk is what a column shard (a 1-2 KiB slice of
//! every row) reads and checksums beyond its own bytes. The checksums (4
//! bytes per chunk) cost 0.8% of the data.
//!
//! [`read_ranges_verified`] reads byte ranges of a file into caller memory and
//! verifies every chunk the ranges touch (or every chunk of every table, for
//! [`Coverage::Full`]):
//!
//! - a chunk that exactly one range covers entirely is read straight into
//!   that range's memory and checksummed there (no copy), where such chunks
//!   follow one another for at least 64 KiB (a lone chunk inside a short
//!   run is checked in the mapping with its neighbours, below, rather than
//!   read by a 4 KiB request of its own);
//! - any other touched chunk (the partial chunks at the ends of a range, the
//!   chunks that many short ranges share in a column shard) is checksummed
//!   whole in a read-only mapping of the file, and the ranges' parts of it
//!   are copied from there, in file order, window by window (8 MiB): the
//!   next windows are asked of the kernel ahead while one is checked, so the
//!   device streams, and pages a neighbour rank already brought into the
//!   page cache are used in place.
//!
//! With [`Coverage::Shared`] (a load that several ranks make together), a
//! chunk this call's ranges touch only in part is not read whole: the spans
//! it reads of the chunk are checksummed and returned as [`Piece`]s, which
//! the caller proves with the other ranks' pieces of the same chunk
//! ([`prove_pieces`]: their checksums, combined in file order, must give the
//! chunk's) and re-reads with [`Coverage::Touched`] where they cannot.
//!
//! Without verification ([`Coverage::None`]) long ranges are read into place
//! and short ones copied through the same windows; exactly the ranges' bytes
//! are read.
//!
//! A record without chunk checksums (files written before they existed) is
//! one chunk as long as the record, checked against the record's CRC-32.
//! Every returned byte was covered by a checksum that matched, or the call
//! fails naming the record and the chunk.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::EngineFile;
use crate::io::{Class, Op};
use crate::ranges::{self, IoRange};
use crate::task::TaskState;

/// The chunk size written by tierstore.
pub const CHUNK: u64 = 512;

/// A checksum function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// CRC-32 (IEEE, as zip uses).
    Crc32,
    /// CRC-32C (Castagnoli; hardware accelerated on x86-64 and aarch64).
    Crc32c,
}

impl Algo {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "crc32" => Some(Algo::Crc32),
            "crc32c" => Some(Algo::Crc32c),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Algo::Crc32 => "crc32",
            Algo::Crc32c => "crc32c",
        }
    }

    pub fn sum(self, data: &[u8]) -> u32 {
        match self {
            Algo::Crc32 => crc32fast::hash(data),
            Algo::Crc32c => crc32c::crc32c(data),
        }
    }
}

/// Number of chunks of a record of `size` bytes.
pub fn chunk_count(size: u64, chunk: u64) -> u64 {
    size.div_ceil(chunk.max(1))
}

/// The checksum of every `chunk`-byte chunk of `data`, into `out`.
///
/// # Panics
///
/// When `out` does not have one slot per chunk.
pub fn compute_into(data: &[u8], chunk: usize, algo: Algo, out: &mut [u32]) {
    assert_eq!(
        out.len() as u64,
        chunk_count(data.len() as u64, chunk as u64)
    );
    for (c, slot) in data.chunks(chunk.max(1)).zip(out.iter_mut()) {
        *slot = algo.sum(c);
    }
}

/// The chunk checksums of several regions, on `threads` threads: one vector
/// per region, in order.
pub fn compute(regions: &[&[u8]], chunk: usize, algo: Algo, threads: usize) -> Vec<Vec<u32>> {
    let chunk = chunk.max(1);
    let mut out: Vec<Vec<u32>> = regions
        .iter()
        .map(|r| vec![0u32; chunk_count(r.len() as u64, chunk as u64) as usize])
        .collect();
    // Work items of about 4 MiB, so that threads share large regions.
    let per = ((4usize << 20) / chunk.max(1)).max(1);
    let mut work: Vec<(&[u8], &mut [u32])> = Vec::new();
    for (r, o) in regions.iter().zip(out.iter_mut()) {
        for (i, slots) in o.chunks_mut(per).enumerate() {
            let start = i * per * chunk;
            let end = (start + slots.len() * chunk).min(r.len());
            work.push((&r[start..end], slots));
        }
    }
    let threads = threads.clamp(1, work.len().max(1));
    if threads == 1 {
        for (d, s) in work {
            compute_into(d, chunk, algo, s);
        }
        return out;
    }
    let work = Mutex::new(work);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let item = work.lock().expect("lock").pop();
                let Some((d, s)) = item else { break };
                compute_into(d, chunk, algo, s);
            });
        }
    });
    out
}

/// The checksums of one record's chunks.
#[derive(Clone, Debug)]
pub struct ChunkTable {
    /// The record's name (for messages).
    pub record: String,
    pub data_offset: u64,
    pub size: u64,
    /// Chunk size; a whole-record checksum is one chunk of `size` bytes.
    pub chunk: u64,
    pub algo: Algo,
    pub sums: Vec<u32>,
}

impl ChunkTable {
    fn chunk_span(&self, i: u64) -> (u64, u64) {
        let s = i * self.chunk;
        (s, (s + self.chunk).min(self.size))
    }

    fn check(&self, file: &EngineFile) -> Result<()> {
        if self.chunk == 0 {
            return Err(Error::corrupt(
                &file.path,
                Some(&self.record),
                "chunk size 0",
            ));
        }
        if self
            .data_offset
            .checked_add(self.size)
            .is_none_or(|e| e > file.len)
        {
            return Err(Error::truncated(
                &file.path,
                format!(
                    "record '{}' [{}, +{}) lies beyond the end of the file ({} bytes)",
                    self.record, self.data_offset, self.size, file.len
                ),
            ));
        }
        let want = chunk_count(self.size, self.chunk);
        if self.sums.len() as u64 != want {
            return Err(Error::corrupt(
                &file.path,
                Some(&self.record),
                format!(
                    "{} chunk checksums for {want} chunks of {} bytes",
                    self.sums.len(),
                    self.chunk
                ),
            ));
        }
        Ok(())
    }

    fn verify(&self, file: &EngineFile, i: u64, data: &[u8]) -> Result<()> {
        let actual = self.algo.sum(data);
        let expected = self.sums[i as usize];
        if actual == expected {
            return Ok(());
        }
        let (start, end) = self.chunk_span(i);
        Err(Error::ChunkChecksum {
            path: file.path.clone(),
            record: self.record.clone(),
            chunk: i,
            start,
            end,
            algo: self.algo.as_str(),
            expected,
            actual,
        })
    }
}

/// Which chunks a verified read checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Every chunk the ranges touch.
    Touched,
    /// Every chunk of every table given.
    Full,
    /// None: the ranges are read, checked only to lie inside their records.
    None,
    /// As `Touched`, except that a chunk the ranges cover only in part (and
    /// shorter than 2 GiB) is not read whole: the spans read of it come back
    /// as [`Piece`]s (their bytes unchecked until the caller proves them).
    Shared,
}

/// A span of a chunk that a [`Coverage::Shared`] read copied out without
/// checking the chunk: its checksum, and the chunk's, so that the spans
/// other readers read of the same chunk can complete the proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// File offset and length of the chunk.
    pub chunk_offset: u64,
    pub chunk_len: u64,
    /// File offset and length of the span (inside the chunk).
    pub offset: u64,
    pub len: u64,
    /// The span's checksum, and the chunk's expected one.
    pub sum: u32,
    pub expected: u32,
    pub algo: Algo,
}

/// Caller memory a [`Coverage::Shared`] read filled from a chunk it read in
/// part: `len` bytes of the file at `offset`, now at address `mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filled {
    pub chunk_offset: u64,
    pub offset: u64,
    pub len: u64,
    pub mem: usize,
}

/// What a verified read did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verified {
    /// Bytes of the file read (ranges plus the rest of their partial chunks).
    pub read: u64,
    /// Bytes whose checksum was checked.
    pub checked: u64,
    /// [`Coverage::Shared`]: the spans of chunks read in part, unchecked, in
    /// file order, and the memory they filled.
    pub pieces: Vec<Piece>,
    pub filled: Vec<Filled>,
}

/// One range of a verified read: `range` lies inside the record of table `table`.
#[derive(Clone, Copy, Debug)]
pub struct TableRange {
    pub range: IoRange,
    pub table: usize,
}

/// Bytes of direct reads per batch (verified while the next ones are read).
const DIRECT_BATCH: usize = 32 << 20;

/// Batches of direct reads in flight beyond the one being verified.
const DIRECT_AHEAD: usize = 3;

/// Bytes of a window of [`stream`].
const WINDOW: u64 = 8 << 20;

/// Windows of [`stream`] asked of the kernel ahead of the one checked.
const AHEAD: usize = 4;

/// The most bytes of consecutive chunks checked as one unit of [`stream`].
const UNIT_MAX: u64 = 64 << 10;

/// The span of file a thread of [`stream`] brings in and checks at a time.
const GROUP: u64 = 1 << 20;

/// Unverified ranges at least this long are read into place; shorter ones
/// are copied out of windows.
const DIRECT_MIN: usize = 64 << 10;

/// A span of the file read into a window: checked as the chunks `check`
/// (table, first chunk, count: whole chunks of one record, one after
/// another) where given, or checksummed into piece `sum`, then its `parts`
/// copied out to caller memory.
struct Unit {
    off: u64,
    len: u64,
    check: Option<(usize, u64, u64)>,
    sum: Option<usize>,
    parts: std::ops::Range<usize>,
}

/// Bytes `[off, off + len)` of the file, for caller memory `mem`.
#[derive(Clone, Copy)]
struct Part {
    off: u64,
    len: usize,
    mem: SendPtr,
}

/// Reads `units` (sorted by offset, disjoint) window by window from a
/// read-only mapping of the file: the next [`AHEAD`] windows are asked of
/// the kernel (`MADV_WILLNEED`, so the device streams) while one is checked
/// and copied out on `threads` threads, each taking about [`GROUP`] bytes at
/// a time, brought in first (`MADV_POPULATE_READ`: a device error or a file
/// cut short is an error here, not a `SIGBUS`). Pages the page cache already
/// holds (a neighbour rank read them) are used in place, with no copy into a
/// buffer.
/// Returns the bytes read.
fn stream(
    file: &Arc<EngineFile>,
    units: &[Unit],
    parts: &[Part],
    tables: &[ChunkTable],
    pieces: &[(Algo, AtomicU32)],
    threads: usize,
) -> Result<u64> {
    if units.is_empty() {
        return Ok(0);
    }
    let mut windows: Vec<std::ops::Range<usize>> = Vec::new();
    let (mut first, mut bytes) = (0usize, 0u64);
    for (k, u) in units.iter().enumerate() {
        if k > first && bytes + u.len > WINDOW {
            windows.push(first..k);
            (first, bytes) = (k, 0);
        }
        bytes += u.len;
    }
    windows.push(first..units.len());
    let map = Mapping::new(file)?;
    // The spans of a window's units, joined across gaps of under 64 KiB
    // (a hint: the kernel reads whole pages and around them anyway).
    let spans = |w: usize, f: &dyn Fn(u64, u64)| {
        let Some(r) = windows.get(w) else { return };
        let us = &units[r.clone()];
        let (mut s, mut e) = (us[0].off, us[0].off + us[0].len);
        for u in &us[1..] {
            if u.off > e + (64 << 10) {
                f(s, e - s);
                s = u.off;
            }
            e = e.max(u.off + u.len);
        }
        f(s, e - s);
    };
    for w in 0..AHEAD {
        spans(w, &|s, n| map.will_need(s, n));
    }
    for (w, r) in windows.iter().cloned().enumerate() {
        spans(w + AHEAD, &|s, n| map.will_need(s, n));
        // The window's units in groups of about GROUP bytes of file, each
        // brought in (one `populate` over its span) by the thread that then
        // checks it, so that threads fault pages in side by side.
        let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
        let mut first = r.start;
        for k in r.clone() {
            if k > first && units[k].off + units[k].len - units[first].off > GROUP {
                groups.push(first..k);
                first = k;
            }
        }
        groups.push(first..r.end);
        par_each(&groups, threads, 1, |g| {
            let us = &units[g.clone()];
            // Spans joined across gaps of under 64 KiB, as the read-ahead hints.
            let (mut s, mut e) = (us[0].off, us[0].off + us[0].len);
            for u in &us[1..] {
                if u.off > e + (64 << 10) {
                    map.populate(file, s, e - s)?;
                    s = u.off;
                }
                e = e.max(u.off + u.len);
            }
            map.populate(file, s, e - s)?;
            for u in us {
                let data = map.slice(u.off, u.len);
                if let Some((ti, first, count)) = u.check {
                    let t = &tables[ti];
                    let base = t.chunk_span(first).0;
                    for i in first..first + count {
                        let (cs, ce) = t.chunk_span(i);
                        t.verify(file, i, &data[(cs - base) as usize..(ce - base) as usize])?;
                    }
                }
                if let Some(k) = u.sum {
                    let (algo, slot) = &pieces[k];
                    slot.store(algo.sum(data), Ordering::Relaxed);
                }
                for p in &parts[u.parts.clone()] {
                    let from = (p.off - u.off) as usize;
                    // SAFETY: the part lies inside the unit (built so); the
                    // destination is the caller's (contract of the public functions).
                    unsafe {
                        std::ptr::copy_nonoverlapping(data.as_ptr().add(from), p.mem.0, p.len);
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(units.iter().map(|u| u.len).sum())
}

/// Unverified reads: long ranges into place, short ones through windows.
fn read_unverified(
    engine: &Arc<Engine>,
    file: &Arc<EngineFile>,
    ranges: &[TableRange],
    class: Class,
    threads: usize,
) -> Result<Verified> {
    let mut direct: Vec<IoRange> = Vec::new();
    let mut short: Vec<IoRange> = Vec::new();
    for r in ranges.iter().filter(|r| r.range.len > 0) {
        if r.range.len >= DIRECT_MIN {
            direct.push(r.range);
        } else {
            short.push(r.range);
        }
    }
    crate::ranges::sort_unless_sorted(&mut short, |r| r.offset);
    let mut units: Vec<Unit> = Vec::new();
    let mut parts: Vec<Part> = Vec::with_capacity(short.len());
    for r in &short {
        let end = r.offset + r.len as u64;
        match units.last_mut() {
            Some(u) if r.offset <= u.off + u.len => {
                u.len = u.len.max(end - u.off);
                u.parts.end += 1;
            }
            _ => units.push(Unit {
                off: r.offset,
                len: r.len as u64,
                check: None,
                sum: None,
                parts: parts.len()..parts.len() + 1,
            }),
        }
        parts.push(Part {
            off: r.offset,
            len: r.len,
            mem: SendPtr(r.buf),
        });
    }
    let direct_bytes: u64 = direct.iter().map(|r| r.len as u64).sum();
    let task = if direct.is_empty() {
        None
    } else {
        // SAFETY: the destinations are the caller's (contract of
        // `read_ranges_verified`); the task is joined (or, on an error,
        // dropped: cancelled and joined) before this function returns.
        Some(unsafe {
            ranges::transfer_ranges(
                engine,
                Arc::clone(file),
                direct,
                Op::Read,
                class,
                TaskState::new(),
                None,
                None,
            )
        }?)
    };
    let streamed = stream(file, &units, &parts, &[], &[], threads)?;
    if let Some(t) = task {
        t.join()?;
    }
    Ok(Verified {
        read: direct_bytes + streamed,
        ..Verified::default()
    })
}

/// A read-only shared mapping of a whole file, unmapped on drop.
pub(crate) struct Mapping {
    base: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only; it is only read, from any thread.
unsafe impl Sync for Mapping {}
// SAFETY: as above.
unsafe impl Send for Mapping {}

impl Mapping {
    pub(crate) fn new(file: &EngineFile) -> Result<Self> {
        let len = file.len as usize;
        if len == 0 {
            return Ok(Mapping {
                base: std::ptr::null(),
                len: 0,
            });
        }
        // SAFETY: a read-only shared mapping of a file held open by the caller.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io(
                &file.path,
                "mmap",
                std::io::Error::last_os_error(),
            ));
        }
        // Page cache read for this mapping comes in large folios, mapped
        // whole: a fraction of the faults and TLB misses of 4 KiB pages
        // (a hint; where transparent huge pages are off it does nothing).
        // SAFETY: advice on our own mapping.
        unsafe { libc::madvise(base, len, libc::MADV_HUGEPAGE) };
        Ok(Mapping {
            base: base.cast::<u8>().cast_const(),
            len,
        })
    }

    /// Bytes `[offset, offset + len)` of the file.
    ///
    /// # Panics
    ///
    /// When the range lies outside the file (callers check tables first).
    pub(crate) fn slice(&self, offset: u64, len: u64) -> &[u8] {
        let (o, n) = (offset as usize, len as usize);
        assert!(
            o.checked_add(n).is_some_and(|e| e <= self.len),
            "range inside the mapping"
        );
        if n == 0 {
            return &[];
        }
        // SAFETY: inside the mapping (asserted), which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.add(o), n) }
    }
}

impl Mapping {
    /// Asks the kernel to read `[offset, offset + len)` ahead (a hint; a
    /// refusal is not an error).
    fn will_need(&self, offset: u64, len: u64) {
        let page = 4096u64;
        let start = offset / page * page;
        let end = (offset + len).min(self.len as u64);
        if self.len == 0 || start >= end {
            return;
        }
        // SAFETY: a range inside our own mapping; MADV_WILLNEED only schedules reads.
        unsafe {
            libc::madvise(
                self.base.add(start as usize).cast_mut().cast(),
                (end - start) as usize,
                libc::MADV_WILLNEED,
            );
        }
    }
}

impl Mapping {
    /// Brings `[offset, offset + len)` into the page cache and the mapping
    /// before it is checked (`crate::mapped::populate`: a cold mapping read
    /// straight by the checksum measured erratically slow). A file cut short
    /// or a device error is an error here, not a `SIGBUS` later.
    fn populate(&self, file: &EngineFile, offset: u64, len: u64) -> Result<()> {
        let end = (offset + len).min(self.len as u64);
        if self.len == 0 || offset >= end {
            return Ok(());
        }
        // SAFETY: a range inside our own mapping.
        let done = unsafe {
            crate::mapped::populate(self.base.add(offset as usize), (end - offset) as usize)
        };
        match done {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EFAULT) => Err(Error::truncated(
                &file.path,
                format!("the file ends before bytes [{offset}, {end}) (it shrank while it was being read)"),
            )),
            Err(e) => Err(Error::io(&file.path, "read (mapped)", e)),
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: mapped in `new` with this length.
            unsafe { libc::munmap(self.base.cast_mut().cast(), self.len) };
        }
    }
}

/// Per-table chunk bookkeeping: how many ranges touch each chunk, and whether
/// the single range touching it covers it whole.
struct Touch {
    /// Ranges touching each chunk (only 0, 1 and more matter: saturating).
    count: Vec<u8>,
    whole: Vec<bool>,
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: destinations belong to the caller for the whole call (contract of
// `read_ranges_verified`); each byte is written by one copy only.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Runs `f` on every item, on up to `threads` threads, in batches of about
/// `batch` items; the first error wins and stops the others.
fn par_each<T: Sync>(
    items: &[T],
    threads: usize,
    batch: usize,
    f: impl Fn(&T) -> Result<()> + Sync,
) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    let batch = batch.max(1);
    let threads = threads.clamp(1, items.len().div_ceil(batch));
    if threads == 1 {
        return items.iter().try_for_each(f);
    }
    let next = AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let b = next.fetch_add(1, Ordering::Relaxed) * batch;
                    if b >= items.len() {
                        break;
                    }
                    for item in &items[b..(b + batch).min(items.len())] {
                        if let Err(e) = f(item) {
                            stop.store(true, Ordering::Relaxed);
                            failed.lock().expect("lock").get_or_insert(e);
                            return;
                        }
                    }
                }
            });
        }
    });
    match failed.into_inner().expect("lock") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Part of a range that lies in chunks `c0..c1` of table `ti` that are
/// checked in the mapping (shared or partial chunks, or direct ones
/// demoted): file bytes `[off, off + len)` for caller memory `mem`.
#[derive(Clone, Copy)]
struct Seg {
    ti: usize,
    c0: u64,
    c1: u64,
    off: u64,
    len: usize,
    mem: SendPtr,
}

impl Seg {
    /// The caller memory each segment fills, as the [`Part`]s of [`stream`].
    fn parts(segs: &[Seg]) -> Vec<Part> {
        segs.iter()
            .map(|g| Part {
                off: g.off,
                len: g.len,
                mem: g.mem,
            })
            .collect()
    }

    /// Adds the part of chunk `i` at `off` (for `mem`), extending the last
    /// segment where it continues it in the file, in memory and in chunks.
    fn push(segs: &mut Vec<Seg>, ti: usize, i: u64, off: u64, len: usize, mem: *mut u8) {
        if let Some(g) = segs.last_mut() {
            // The address right after the segment, only compared.
            if g.ti == ti
                && g.c1 == i
                && g.off + g.len as u64 == off
                && g.mem.0.wrapping_add(g.len) == mem
            {
                g.c1 += 1;
                g.len += len;
                return;
            }
        }
        segs.push(Seg {
            ti,
            c0: i,
            c1: i + 1,
            off,
            len,
            mem: SendPtr(mem),
        });
    }
}

/// The units of a Touched or Full read: each segment's chunks checked whole
/// (segments whose chunks overlap, or follow each other up to [`UNIT_MAX`]
/// bytes, join one unit), and for Full every chunk no range touches.
/// `segs` are sorted by offset; the units come sorted by offset.
fn units_of_segments(
    tables: &[ChunkTable],
    touch: &[Touch],
    segs: &[Seg],
    coverage: Coverage,
) -> Vec<Unit> {
    let mut units: Vec<Unit> = Vec::with_capacity(segs.len());
    let join =
        |units: &mut Vec<Unit>, ti: usize, c0: u64, c1: u64, parts: std::ops::Range<usize>| {
            let t = &tables[ti];
            let (start, end) = (
                t.data_offset + t.chunk_span(c0).0,
                t.data_offset + t.chunk_span(c1 - 1).1,
            );
            if let Some(u) = units.last_mut() {
                if let Some((uti, first, count)) = u.check.as_mut() {
                    let u_end = u.off + u.len;
                    let same = *uti == ti && u.parts.end == parts.start;
                    let overlaps = start >= u.off && start < u_end;
                    if same && (overlaps || (start == u_end && u.len + (end - start) <= UNIT_MAX)) {
                        if end > u_end {
                            u.len = end - u.off;
                            *count = c1 - *first;
                        }
                        u.parts.end = parts.end;
                        return;
                    }
                }
            }
            units.push(Unit {
                off: start,
                len: end - start,
                check: Some((ti, c0, c1 - c0)),
                sum: None,
                parts,
            });
        };
    for (k, g) in segs.iter().enumerate() {
        join(&mut units, g.ti, g.c0, g.c1, k..k + 1);
    }
    if coverage == Coverage::Full {
        let at = segs.len();
        for (ti, t) in tables.iter().enumerate() {
            for i in 0..t.sums.len() {
                if touch[ti].count[i] == 0 {
                    join(&mut units, ti, i as u64, i as u64 + 1, at..at);
                }
            }
        }
    }
    crate::ranges::sort_unless_sorted(&mut units, |u| u.off);
    units
}

/// A part of a segment in a chunk it covers only in part (its first or
/// last chunk), for [`units_shared`].
struct Edge {
    /// File offsets of the chunk, and its table and index.
    cs: u64,
    ce: u64,
    ti: usize,
    i: u64,
    /// The part: file bytes `[off, off + len)` for memory `mem`.
    off: u64,
    len: usize,
    mem: SendPtr,
    /// The segment it belongs to, and whether it is its first chunk.
    seg: usize,
    head: bool,
}

/// The parts of `segs` (sorted by offset) in chunks they cover in part
/// (only a segment's first and last chunk can be), sorted by chunk and
/// offset.
fn shared_edges(tables: &[ChunkTable], segs: &[Seg]) -> Vec<Edge> {
    let mut edges: Vec<Edge> = Vec::new();
    for (k, g) in segs.iter().enumerate() {
        let t = &tables[g.ti];
        let end = g.off + g.len as u64;
        let span = |i: u64| {
            let (cs, ce) = t.chunk_span(i);
            (t.data_offset + cs, t.data_offset + ce)
        };
        let (cs, ce) = span(g.c0);
        if g.off > cs || end < ce {
            edges.push(Edge {
                cs,
                ce,
                ti: g.ti,
                i: g.c0,
                off: g.off,
                len: (end.min(ce) - g.off) as usize,
                mem: g.mem,
                seg: k,
                head: true,
            });
        }
        if g.c1 - 1 > g.c0 {
            let (cs, ce) = span(g.c1 - 1);
            if end < ce {
                // SAFETY: inside the segment's memory.
                let mem = unsafe { g.mem.0.add((cs - g.off) as usize) };
                edges.push(Edge {
                    cs,
                    ce,
                    ti: g.ti,
                    i: g.c1 - 1,
                    off: cs,
                    len: (end - cs) as usize,
                    mem: SendPtr(mem),
                    seg: k,
                    head: false,
                });
            }
        }
    }
    crate::ranges::sort_unless_sorted(&mut edges, |e| (e.cs, e.ti, e.i, e.off));
    edges
}

/// Which chunks of `edges` the segments (sorted by offset) leave in part,
/// and so become pieces: the edges of each (ranges of `edges`), and for
/// each segment whether its first and last chunk are such.
#[allow(clippy::type_complexity)]
fn pieced_chunks(edges: &[Edge], segs: &[Seg]) -> (Vec<(bool, bool)>, Vec<std::ops::Range<usize>>) {
    // The file bytes the segments cover together (joined where they meet).
    let mut covered: Vec<(u64, u64)> = Vec::new();
    for g in segs {
        let (s, e) = (g.off, g.off + g.len as u64);
        match covered.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => covered.push((s, e)),
        }
    }
    let whole = |cs: u64, ce: u64| {
        let k = covered.partition_point(|&(s, _)| s <= cs);
        k > 0 && covered[k - 1].1 >= ce
    };
    // A chunk the segments leave in part becomes pieces: its edges are cut
    // from their segments.
    let mut cut = vec![(false, false); segs.len()];
    let mut pieced: Vec<std::ops::Range<usize>> = Vec::new();
    let mut a = 0;
    while a < edges.len() {
        let key = (edges[a].cs, edges[a].ti, edges[a].i);
        let mut b = a + 1;
        while b < edges.len() && (edges[b].cs, edges[b].ti, edges[b].i) == key {
            b += 1;
        }
        let (cs, ce) = (edges[a].cs, edges[a].ce);
        // A chunk of 2 GiB or more (a whole-record checksum of an old file)
        // is checked here: pieces describe spans within 31 bits.
        if !whole(cs, ce) && ce - cs < 1 << 31 {
            for e in &edges[a..b] {
                if e.head {
                    cut[e.seg].0 = true;
                } else {
                    cut[e.seg].1 = true;
                }
            }
            pieced.push(a..b);
        }
        a = b;
    }
    (cut, pieced)
}

/// `segs` less the edges `cut` marks (a segment left empty goes).
fn trim_pieced(tables: &[ChunkTable], segs: &mut Vec<Seg>, cut: &[(bool, bool)]) {
    let mut k = 0;
    segs.retain_mut(|g| {
        let (head, tail) = cut[k];
        k += 1;
        let t = &tables[g.ti];
        if tail {
            g.c1 -= 1;
            let cs = t.data_offset + t.chunk_span(g.c1).0;
            g.len = cs.saturating_sub(g.off) as usize;
        }
        if head && g.c0 < g.c1 {
            let ce = t.data_offset + t.chunk_span(g.c0).1;
            let head_len = (ce - g.off).min(g.len as u64);
            g.c0 += 1;
            g.off += head_len;
            g.len -= head_len as usize;
            // SAFETY: inside the segment's memory (or one past its end).
            g.mem = SendPtr(unsafe { g.mem.0.add(head_len as usize) });
        }
        g.c0 < g.c1 && g.len > 0
    });
}

/// The units and parts of a Shared read: as for Touched (each segment's
/// chunks checked whole, [`units_of_segments`]), except for a chunk the
/// segments together cover only in part (and shorter than 2 GiB): only the
/// spans they read of it are read, checksummed into pieces (`out.pieces`,
/// `out.filled`, their sums in `sums`) and proven later with the other
/// ranks'. Only a segment's first and last chunk can be covered in part,
/// so the bookkeeping is per segment, with one entry per such edge.
/// `segs` are sorted by offset; the units come sorted by offset.
fn units_shared(
    tables: &[ChunkTable],
    touch: &[Touch],
    mut segs: Vec<Seg>,
    out: &mut Verified,
    sums: &mut Vec<(Algo, AtomicU32)>,
) -> (Vec<Unit>, Vec<Part>) {
    let edges = shared_edges(tables, &segs);
    let (cut, pieced) = pieced_chunks(&edges, &segs);
    trim_pieced(tables, &mut segs, &cut);
    drop(cut);
    crate::ranges::sort_unless_sorted(&mut segs, |g| g.off);
    let local = units_of_segments(tables, touch, &segs, Coverage::Touched);
    let mut parts = Seg::parts(&segs);
    drop(segs);
    // The local units with the pieces between them, in file order (they lie
    // in different chunks); each span of overlapping parts of a pieced chunk
    // is one piece.
    let mut units: Vec<Unit> = Vec::with_capacity(local.len() + pieced.len());
    let mut local = local.into_iter().peekable();
    for r in pieced {
        let cs = edges[r.start].cs;
        units.extend(std::iter::from_fn(|| local.next_if(|u| u.off < cs)));
        // The chunk's parts from here on: a piece joins only those.
        let group_parts = parts.len();
        for e in &edges[r] {
            let k = parts.len();
            parts.push(Part {
                off: e.off,
                len: e.len,
                mem: e.mem,
            });
            out.filled.push(Filled {
                chunk_offset: e.cs,
                offset: e.off,
                len: e.len as u64,
                mem: e.mem.0 as usize,
            });
            let joins = units.last().is_some_and(|u| {
                u.sum.is_some() && u.parts.start >= group_parts && e.off <= u.off + u.len
            });
            match units.last_mut() {
                Some(u) if joins => {
                    u.len = u.len.max(e.off + e.len as u64 - u.off);
                    u.parts.end = k + 1;
                }
                _ => {
                    let t = &tables[e.ti];
                    units.push(Unit {
                        off: e.off,
                        len: e.len as u64,
                        check: None,
                        sum: Some(sums.len()),
                        parts: k..k + 1,
                    });
                    sums.push((t.algo, AtomicU32::new(0)));
                    out.pieces.push(Piece {
                        chunk_offset: e.cs,
                        chunk_len: e.ce - e.cs,
                        offset: e.off,
                        len: 0,
                        sum: 0,
                        expected: t.sums[e.i as usize],
                        algo: t.algo,
                    });
                }
            }
        }
    }
    units.extend(local);
    (units, parts)
}

/// Reads `ranges` of `file` into caller memory and verifies the chunks they
/// touch (see the module documentation).
///
/// # Safety
///
/// Every range's `buf` must be valid for writes of `len` bytes, the ranges
/// must not overlap in memory, and nothing else may access that memory until
/// this call returns.
#[allow(clippy::too_many_lines)]
pub unsafe fn read_ranges_verified(
    engine: &Arc<Engine>,
    file: &Arc<EngineFile>,
    ranges: &[TableRange],
    tables: &[ChunkTable],
    coverage: Coverage,
    class: Class,
) -> Result<Verified> {
    let threads = engine.config().cpu_threads.max(1);
    for t in tables {
        t.check(file)?;
    }
    let mut touch: Vec<Touch> = tables
        .iter()
        .map(|t| Touch {
            count: vec![0; t.sums.len()],
            whole: vec![false; t.sums.len()],
        })
        .collect();
    for r in ranges {
        let Some(t) = tables.get(r.table) else {
            return Err(Error::Invalid(format!(
                "range names table {} of {}",
                r.table,
                tables.len()
            )));
        };
        let s = r.range.offset;
        // `check` made data_offset + size fit in the file, hence in u64.
        let inside = s
            .checked_add(r.range.len as u64)
            .filter(|&e| s >= t.data_offset && e <= t.data_offset + t.size);
        let Some(e) = inside else {
            return Err(Error::corrupt(
                &file.path,
                Some(&t.record),
                format!(
                    "read [{s}, +{}) lies outside the record's data [{}, {})",
                    r.range.len,
                    t.data_offset,
                    t.data_offset + t.size
                ),
            ));
        };
        if s == e {
            continue;
        }
        let (rs, re) = (s - t.data_offset, e - t.data_offset);
        let tc = &mut touch[r.table];
        for i in rs / t.chunk..re.div_ceil(t.chunk) {
            let (cs, ce) = t.chunk_span(i);
            let i = i as usize;
            tc.count[i] = tc.count[i].saturating_add(1);
            tc.whole[i] = rs <= cs && re >= ce;
        }
    }
    if coverage == Coverage::None {
        return read_unverified(engine, file, ranges, class, threads);
    }
    let direct_chunk = |ti: usize, i: usize| touch[ti].count[i] == 1 && touch[ti].whole[i];
    // Split each range into runs of direct chunks (read into place by the
    // engine) and segments: the parts of a range that lie in shared or
    // partial chunks (copied from the mapping), one per run of such chunks
    // (not one per chunk: a column shard's row is one segment).
    let mut direct: Vec<IoRange> = Vec::new();
    // For each direct range, the end of its chunks in `direct_chunks`.
    let mut direct_ends: Vec<usize> = Vec::new();
    let mut direct_chunks: Vec<(usize, u64, SendPtr)> = Vec::new(); // (table, chunk, memory)
    let mut segs: Vec<Seg> = Vec::new();
    for r in ranges {
        let t = &tables[r.table];
        let (s, e) = (r.range.offset, r.range.offset + r.range.len as u64);
        if s == e {
            continue;
        }
        let (rs, re) = (s - t.data_offset, e - t.data_offset);
        let mut i = rs / t.chunk;
        while i * t.chunk < re {
            let (cs, ce) = t.chunk_span(i);
            let (ps, pe) = (cs.max(rs), ce.min(re));
            // SAFETY: `ps - rs` is inside the range's memory (contract).
            let mem = unsafe { r.range.buf.add((ps - rs) as usize) };
            if direct_chunk(r.table, i as usize) {
                direct_chunks.push((r.table, i, SendPtr(mem)));
                match direct.last_mut() {
                    Some(last)
                        if last.offset + last.len as u64 == t.data_offset + ps
                            // SAFETY: pointer arithmetic inside one range's memory.
                            && unsafe { last.buf.add(last.len) } == mem =>
                    {
                        last.len += (pe - ps) as usize;
                        *direct_ends.last_mut().expect("one end per range") = direct_chunks.len();
                    }
                    _ => {
                        direct.push(IoRange {
                            offset: t.data_offset + ps,
                            len: (pe - ps) as usize,
                            buf: mem,
                        });
                        direct_ends.push(direct_chunks.len());
                    }
                }
            } else {
                Seg::push(
                    &mut segs,
                    r.table,
                    i,
                    t.data_offset + ps,
                    (pe - ps) as usize,
                    mem,
                );
            }
            i += 1;
        }
    }
    // A direct read shorter than DIRECT_MIN (a chunk or a few inside a short
    // run, e.g. a column shard's row that happens to cover one) would be a
    // small O_DIRECT read between the mapping's streamed pages: its chunks
    // are checked in the mapping instead, the same bytes read.
    {
        let (mut kept, mut kept_ends, mut kept_chunks) = (Vec::new(), Vec::new(), Vec::new());
        let mut first = 0usize;
        for (r, &end) in direct.iter().zip(&direct_ends) {
            let chunks = &direct_chunks[first..end];
            first = end;
            if r.len >= DIRECT_MIN {
                kept_chunks.extend_from_slice(chunks);
                kept.push(*r);
                kept_ends.push(kept_chunks.len());
                continue;
            }
            for &(ti, i, mem) in chunks {
                let t = &tables[ti];
                let (cs, ce) = t.chunk_span(i);
                Seg::push(
                    &mut segs,
                    ti,
                    i,
                    t.data_offset + cs,
                    (ce - cs) as usize,
                    mem.0,
                );
                touch[ti].whole[i as usize] = false;
            }
        }
        (direct, direct_ends, direct_chunks) = (kept, kept_ends, kept_chunks);
    }
    crate::ranges::sort_unless_sorted(&mut segs, |g| g.off);
    let mut out = Verified::default();
    let direct_bytes: u64 = direct.iter().map(|r| r.len as u64).sum();
    // Direct reads go in batches: batch k is verified in place while batch
    // k + 1 is read, so checksumming hides behind the I/O.
    let mut batches: Vec<(Vec<IoRange>, std::ops::Range<usize>)> = Vec::new();
    let mut first_chunk = 0usize;
    let mut cur: Vec<IoRange> = Vec::new();
    let mut cur_bytes = 0usize;
    for (r, &end) in direct.iter().zip(&direct_ends) {
        cur.push(*r);
        cur_bytes += r.len;
        if cur_bytes >= DIRECT_BATCH {
            batches.push((std::mem::take(&mut cur), first_chunk..end));
            first_chunk = end;
            cur_bytes = 0;
        }
    }
    if !cur.is_empty() {
        batches.push((cur, first_chunk..direct_chunks.len()));
    }
    let start = |b: Vec<IoRange>| {
        // SAFETY: the destinations are the caller's (contract above); every
        // task started here is joined before this function returns.
        unsafe {
            ranges::transfer_ranges(
                engine,
                Arc::clone(file),
                b,
                Op::Read,
                class,
                TaskState::new(),
                None,
                None,
            )
        }
    };
    let verify_direct = |chunks: std::ops::Range<usize>| {
        par_each(&direct_chunks[chunks], threads, 256, |&(ti, i, mem)| {
            let t = &tables[ti];
            let (cs, ce) = t.chunk_span(i);
            // SAFETY: the chunk was read into this memory (its batch was
            // joined); the memory is the caller's.
            let data = unsafe { std::slice::from_raw_parts(mem.0, (ce - cs) as usize) };
            t.verify(file, i, data)
        })
    };
    // Up to DIRECT_AHEAD batches are read while the oldest is verified (one
    // batch ahead left the device idle at each batch's end). On an error,
    // returning drops the batches still in flight, and a dropped task is
    // cancelled and joined (it writes into the caller's memory).
    let mut pending = std::collections::VecDeque::new();
    for (b, chunks) in batches {
        pending.push_back((start(b)?, chunks));
        if pending.len() > DIRECT_AHEAD {
            let (task, prev) = pending.pop_front().expect("a batch in flight");
            task.join()?;
            verify_direct(prev)?;
        }
    }
    while let Some((task, prev)) = pending.pop_front() {
        task.join()?;
        verify_direct(prev)?;
    }
    out.read += direct_bytes;
    out.checked += direct_bytes;
    let mut sums: Vec<(Algo, AtomicU32)> = Vec::new();
    let (units, parts) = if coverage == Coverage::Shared {
        units_shared(tables, &touch, segs, &mut out, &mut sums)
    } else {
        let units = units_of_segments(tables, &touch, &segs, coverage);
        (units, Seg::parts(&segs))
    };
    if units.windows(2).any(|w| w[0].off + w[0].len > w[1].off) {
        return Err(Error::corrupt(
            &file.path,
            None,
            "records whose data overlap in the file".to_owned(),
        ));
    }
    let streamed = stream(file, &units, &parts, tables, &sums, threads)?;
    out.read += streamed;
    out.checked += units
        .iter()
        .filter(|u| u.check.is_some())
        .map(|u| u.len)
        .sum::<u64>();
    for u in &units {
        if let Some(k) = u.sum {
            out.pieces[k].len = u.len;
            out.pieces[k].sum = sums[k].1.load(Ordering::Relaxed);
        }
    }
    Ok(out)
}

/// The reader (of `world`) that proves the chunk at `chunk_offset` of the
/// file numbered `key`: a hash of both, so that the chunks of a load spread
/// over its readers and every reader of a chunk computes the same one. The
/// chunks of one 4 KiB page go to the same reader.
pub fn piece_owner(key: u64, chunk_offset: u64, world: u64) -> u64 {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (chunk_offset >> 12).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (h >> 33) % world.max(1)
}

/// Proves chunks from the [`Piece`]s that readers read of them: for each
/// piece, whether its bytes are proven, i.e. the pieces of its chunk
/// (identified by `key` and the chunk offset; all giving the same chunk
/// length, expected checksum and algorithm) cover the chunk from its first
/// byte to its last, one after another, and their checksums combined in
/// file order give the chunk's; a piece equal to a piece used (same span
/// and checksum) is proven with it. Pieces that overlap otherwise, leave a
/// gap, or belong to a chunk whose sum does not match are not proven: their
/// readers check those chunks themselves.
pub fn prove_pieces(pieces: &[(u64, Piece)]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    // Stable: the rows come as one run in file order per reader, which a
    // stable sort merges rather than sorts again.
    order.sort_by_key(|&k| {
        let (key, p) = &pieces[k];
        (
            *key,
            p.chunk_offset,
            p.offset,
            std::cmp::Reverse(p.len),
            p.sum,
        )
    });
    let mut proven = vec![false; pieces.len()];
    let mut crc32 = crate::crc::Combiner::default();
    // The spans a chunk's proof used (offset, length, checksum), in order.
    let mut used: Vec<(u64, u64, u32)> = Vec::new();
    let mut g = 0;
    while g < order.len() {
        let (key, first) = pieces[order[g]];
        let mut e = g;
        while e < order.len() && {
            let (k, p) = &pieces[order[e]];
            *k == key && p.chunk_offset == first.chunk_offset
        } {
            e += 1;
        }
        let group = &order[g..e];
        g = e;
        let same = group.iter().all(|&k| {
            let p = &pieces[k].1;
            (p.chunk_len, p.expected, p.algo) == (first.chunk_len, first.expected, first.algo)
        });
        if !same {
            continue;
        }
        let Some(end) = first.chunk_offset.checked_add(first.chunk_len) else {
            continue; // rows no reader could have sent
        };
        let (mut at, mut acc) = (first.chunk_offset, 0u32);
        used.clear();
        let mut gap = false;
        for &k in group {
            let p = &pieces[k].1;
            let fits = p.offset.checked_add(p.len).is_some_and(|e| e <= end);
            if p.offset == at && p.len > 0 && fits {
                acc = match p.algo {
                    Algo::Crc32 => crc32.combine(acc, p.sum, p.len),
                    Algo::Crc32c => crc32c::crc32c_combine(acc, p.sum, p.len as usize),
                };
                at += p.len;
                used.push((p.offset, p.len, p.sum));
            } else if p.offset > at {
                gap = true;
                break;
            }
        }
        if gap || at != end || acc != first.expected {
            continue;
        }
        // `used` is sorted: it follows the group's order.
        for &k in group {
            let p = &pieces[k].1;
            proven[k] = used.binary_search(&(p.offset, p.len, p.sum)).is_ok();
        }
    }
    proven
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(data_offset: u64, size: u64, chunk: u64) -> ChunkTable {
        ChunkTable {
            record: "r".into(),
            data_offset,
            size,
            chunk,
            algo: Algo::Crc32,
            sums: vec![0; chunk_count(size, chunk) as usize],
        }
    }

    /// A column shard of a row-major matrix: one segment and one unit per
    /// row (not one per chunk), each unit the whole chunks its row touches;
    /// with Full, the chunks between the rows join units of their own.
    #[test]
    fn a_column_is_one_segment_and_one_unit_per_row() {
        let t = table(4096, 16 * 5120, 512);
        let mut buf = vec![0u8; 16 * 1280];
        let mut segs = Vec::new();
        for row in 0..16u64 {
            let (s, e) = (row * 5120 + 1280, row * 5120 + 2560);
            // SAFETY: inside `buf`.
            let mem = unsafe { buf.as_mut_ptr().add((row * 1280) as usize) };
            for i in s / 512..e.div_ceil(512) {
                let (cs, ce) = (i * 512, (i + 1) * 512);
                let (ps, pe) = (cs.max(s), ce.min(e));
                // SAFETY: inside `buf`.
                let m = unsafe { mem.add((ps - s) as usize) };
                Seg::push(&mut segs, 0, i, 4096 + ps, (pe - ps) as usize, m);
            }
        }
        assert_eq!(segs.len(), 16);
        assert!(segs.iter().all(|g| g.c1 - g.c0 == 3 && g.len == 1280));
        let mut touch = vec![Touch {
            count: vec![0; t.sums.len()],
            whole: vec![false; t.sums.len()],
        }];
        for g in &segs {
            for i in g.c0..g.c1 {
                touch[0].count[i as usize] = 1;
            }
        }
        let tables = [t];
        let units = units_of_segments(&tables, &touch, &segs, Coverage::Touched);
        assert_eq!(units.len(), 16);
        for (k, u) in units.iter().enumerate() {
            assert_eq!((u.off, u.len), (4096 + k as u64 * 5120 + 1024, 1536));
            assert_eq!(u.check, Some((0, k as u64 * 10 + 2, 3)));
            assert_eq!(u.parts, k..k + 1);
        }
        let full = units_of_segments(&tables, &touch, &segs, Coverage::Full);
        let checked: u64 = full.iter().map(|u| u.len).sum();
        assert_eq!(checked, 16 * 5120, "every chunk once");
        assert!(
            full.windows(2).all(|w| w[0].off + w[0].len <= w[1].off),
            "disjoint, sorted"
        );
        // Chunks 0 and 1 (before the first row's part) are checked too.
        assert_eq!(full[0].off, 4096);
    }

    #[test]
    fn a_shared_column_read_keeps_one_piece_per_row_edge_it_leaves_in_part() {
        let tables = [table(4096, 16 * 5120, 512)];
        let mut buf = vec![0u8; 16 * 1280 + 512];
        let mut segs = Vec::new();
        // Rows' bytes [1280, 2560): chunk 2 in part, chunks 3 and 4 whole.
        for row in 0..16u64 {
            let s = row * 5120 + 1280;
            // SAFETY: inside `buf`.
            let mem = unsafe { buf.as_mut_ptr().add((row * 1280) as usize) };
            Seg::push(&mut segs, 0, s / 512, 4096 + s, 256, mem);
            // SAFETY: inside `buf`.
            let m = unsafe { mem.add(256) };
            Seg::push(&mut segs, 0, 3 + row * 10, 4096 + s + 256, 512, m);
            // SAFETY: inside `buf`.
            let m = unsafe { mem.add(768) };
            Seg::push(&mut segs, 0, 4 + row * 10, 4096 + s + 768, 512, m);
        }
        // Past the rows, chunk 160 read in two halves into memory apart:
        // together they cover it, so it is checked here, not pieced.
        let end = buf.as_mut_ptr();
        let at = 4096 + 16 * 5120 - 512;
        Seg::push(&mut segs, 0, 159, at, 256, end);
        // SAFETY: inside `buf`.
        let m = unsafe { end.add(16 * 1280 + 256) };
        Seg::push(&mut segs, 0, 159, at + 256, 256, m);
        assert_eq!(segs.len(), 18);
        let touch = vec![Touch {
            count: vec![1; tables[0].sums.len()],
            whole: vec![false; tables[0].sums.len()],
        }];
        let (mut out, mut sums) = (Verified::default(), Vec::new());
        let (units, parts) = units_shared(&tables, &touch, segs, &mut out, &mut sums);
        assert_eq!(
            (out.pieces.len(), out.filled.len(), sums.len()),
            (16, 16, 16)
        );
        // Per row a piece (the row's part of chunk 2), then chunks 3 and 4
        // checked as one unit; then chunk 159 as one unit of two parts.
        assert_eq!(units.len(), 33);
        for row in 0..16usize {
            let base = 4096 + row as u64 * 5120;
            let (p, u) = (&units[2 * row], &units[2 * row + 1]);
            assert_eq!(
                (p.off, p.len, p.check, p.sum),
                (base + 1280, 256, None, Some(row))
            );
            assert_eq!((u.off, u.len, u.sum), (base + 1536, 1024, None));
            assert_eq!(u.check, Some((0, row as u64 * 10 + 3, 2)));
            assert_eq!(
                parts[p.parts.clone()]
                    .iter()
                    .map(|q| (q.off, q.len))
                    .collect::<Vec<_>>(),
                [(base + 1280, 256)]
            );
            let piece = out.pieces[row];
            assert_eq!(
                (piece.chunk_offset, piece.chunk_len, piece.offset),
                (base + 1024, 512, base + 1280)
            );
        }
        let last = &units[32];
        assert_eq!(
            (last.off, last.len, last.check),
            (at, 512, Some((0, 159, 1)))
        );
        assert_eq!(last.parts.len(), 2);
    }

    fn piece(data: &[u8], chunk: (u64, u64), span: (u64, u64), algo: Algo) -> Piece {
        let (c, n) = chunk;
        let (s, e) = span;
        Piece {
            chunk_offset: c,
            chunk_len: n,
            offset: s,
            len: e - s,
            sum: algo.sum(&data[s as usize..e as usize]),
            expected: algo.sum(&data[c as usize..(c + n) as usize]),
            algo,
        }
    }

    #[test]
    fn pieces_prove_their_chunk_together() {
        let data: Vec<u8> = (0..10_000u32).map(|x| (x * 7 % 253) as u8).collect();
        for algo in [Algo::Crc32, Algo::Crc32c] {
            let c = (4096, 4096);
            let p = |s: u64, e: u64| piece(&data, c, (s, e), algo);
            // Three readers' spans, one of them read twice (a replica), out of order.
            let all = vec![
                (1, p(6000, 8192)),
                (1, p(4096, 5000)),
                (1, p(5000, 6000)),
                (1, p(5000, 6000)),
            ];
            assert_eq!(prove_pieces(&all), vec![true; 4]);
            // Another file's chunk at the same offset is another chunk.
            let other = vec![(1, p(4096, 5000)), (2, p(5000, 8192))];
            assert_eq!(prove_pieces(&other), vec![false; 2]);
            // A gap proves nothing.
            assert_eq!(
                prove_pieces(&[(1, p(4096, 5000)), (1, p(5001, 8192))]),
                vec![false; 2]
            );
            // A span overlapping two others is not proven by them; they are.
            let straddle = vec![(1, p(4096, 6000)), (1, p(6000, 8192)), (1, p(5000, 7000))];
            assert_eq!(prove_pieces(&straddle), vec![true, true, false]);
            // A damaged span (or a wrong expected sum) fails its whole chunk.
            let mut bad = vec![(1, p(4096, 6000)), (1, p(6000, 8192))];
            bad[1].1.sum ^= 1;
            assert_eq!(prove_pieces(&bad), vec![false; 2]);
            let mut differ = vec![(1, p(4096, 6000)), (1, p(6000, 8192))];
            differ[0].1.expected ^= 1;
            assert_eq!(prove_pieces(&differ), vec![false; 2]);
            // The same span read with different bytes: the copy that does
            // not fit is never proven (the others may be, or fall back too).
            for flip in [1u32, 1 << 31] {
                let mut twice = vec![(1, p(4096, 6000)), (1, p(4096, 6000)), (1, p(6000, 8192))];
                twice[1].1.sum ^= flip;
                let got = prove_pieces(&twice);
                assert!(!got[1] && got[0] == got[2], "{got:?}");
            }
        }
        assert!(prove_pieces(&[]).is_empty());
    }

    #[test]
    fn compute_matches_per_chunk_sums() {
        let data: Vec<u8> = (0..50_000u32).map(|x| (x * 31 % 251) as u8).collect();
        let regions: Vec<&[u8]> = vec![&data, &data[..4096], &[], &data[..1]];
        for threads in [1, 3] {
            let got = compute(&regions, 4096, Algo::Crc32c, threads);
            for (r, sums) in regions.iter().zip(&got) {
                let want: Vec<u32> = r.chunks(4096).map(crc32c::crc32c).collect();
                assert_eq!(sums, &want);
            }
        }
        assert_eq!(chunk_count(0, 4096), 0);
        assert_eq!(chunk_count(4097, 4096), 2);
    }
}
