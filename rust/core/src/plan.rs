//! The byte plan of a container being written: which record covers which file
//! range, where each record's bytes come from, and how to gather any range of
//! the file into a buffer while computing CRC-32s on the way.
//!
//! Local headers hold the CRC of the data that follows them. When a chunk is
//! gathered before the CRC of a record is known (its data continues in a later
//! chunk), the blocks that hold its header are left out of that chunk's writes
//! ("deferred") and written once every CRC is known.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use crc32fast::Hasher;

use crate::buf::{align_down, align_up};
use crate::crc;
use crate::error::{Error, Result};
use crate::zip::{self, Entry, LayoutBuilder};

/// Where a record's bytes come from.
#[derive(Clone)]
pub enum Source {
    /// Bytes owned by the plan (metadata records).
    Bytes(Arc<[u8]>),
    /// Caller memory (tensor storages), borrowed for the duration of the write.
    Mem { ptr: *const u8, len: usize },
    /// Caller memory that is still being filled: readable once `gate` has
    /// reached `ready_at` (a checkpoint capture writes while the flush runs).
    Gated {
        ptr: *const u8,
        len: usize,
        gate: Arc<Gate>,
        ready_at: u64,
    },
}

/// A counter a producer advances as it fills memory that a writer is
/// already consuming; readers wait for the value they need. A producer that
/// gives up calls [`Gate::fail`], which makes every waiter fail.
///
/// A producer that checksummed what it copied (see [`crate::crc::copy_and_sum`])
/// leaves the chunk table with the gate ([`Gate::put_sums`]); a writer takes it
/// ([`Gate::sums`]) instead of reading the memory a second time.
#[derive(Default)]
pub struct Gate {
    state: Mutex<(u64, bool)>,
    cv: Condvar,
    sums: Mutex<HashMap<u64, Arc<[u32]>>>,
}

impl Gate {
    pub fn new() -> Arc<Self> {
        Arc::new(Gate::default())
    }

    /// Raises the counter to `to` (never lowers it).
    pub fn advance(&self, to: u64) {
        let mut g = self.state.lock().expect("gate lock");
        g.0 = g.0.max(to);
        self.cv.notify_all();
    }

    pub fn fail(&self) {
        self.state.lock().expect("gate lock").1 = true;
        self.cv.notify_all();
    }

    pub fn value(&self) -> u64 {
        self.state.lock().expect("gate lock").0
    }

    /// Leaves the CRC-32 of every [`crate::crc::CHUNK`] of the memory that
    /// becomes readable at `at`. Put them before advancing past `at`.
    pub fn put_sums(&self, at: u64, sums: Vec<u32>) {
        self.sums
            .lock()
            .expect("gate sums lock")
            .insert(at, sums.into());
    }

    /// The chunk sums left for position `at`, once the gate has reached it
    /// (before that the memory, and so its sums, may still change) and
    /// unless the producer failed.
    pub fn sums(&self, at: u64) -> Option<Arc<[u32]>> {
        {
            let g = self.state.lock().expect("gate lock");
            if g.0 < at || g.1 {
                return None;
            }
        }
        self.sums.lock().expect("gate sums lock").get(&at).cloned()
    }

    /// Blocks until the counter reaches `at`; an error if the producer failed.
    pub fn wait(&self, at: u64) -> Result<()> {
        let mut g = self.state.lock().expect("gate lock");
        while g.0 < at {
            if g.1 {
                return Err(Error::Invalid(
                    "the memory being written was never filled (its producer failed)".into(),
                ));
            }
            g = self.cv.wait(g).expect("gate lock");
        }
        Ok(())
    }
}

// SAFETY: `Mem` and `Gated` are only created through `Source::mem` and
// `Source::gated`, whose contracts make the caller keep the memory alive (and
// unchanged once ready) while any plan refers to it; the plan only reads it,
// and reads gated memory only after its gate is reached.
unsafe impl Send for Source {}
// SAFETY: see `Send`; shared access is read-only.
unsafe impl Sync for Source {}

impl Source {
    /// # Safety
    ///
    /// `ptr` must be valid for reads of `len` bytes, and the memory must stay
    /// alive and unmodified until every plan, writer and task holding this
    /// source has been dropped.
    pub unsafe fn mem(ptr: *const u8, len: usize) -> Self {
        Source::Mem { ptr, len }
    }

    /// # Safety
    ///
    /// As for [`Source::mem`], except that the memory may still change until
    /// `gate` reaches `ready_at`, and not after.
    pub unsafe fn gated(ptr: *const u8, len: usize, gate: Arc<Gate>, ready_at: u64) -> Self {
        Source::Gated {
            ptr,
            len,
            gate,
            ready_at,
        }
    }

    /// Waits until the bytes may be read (at once for other sources).
    pub fn wait_ready(&self) -> Result<()> {
        match self {
            Source::Gated { gate, ready_at, .. } => gate.wait(*ready_at),
            _ => Ok(()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Source::Bytes(b) => b.len(),
            Source::Mem { len, .. } | Source::Gated { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slice(&self) -> &[u8] {
        match self {
            Source::Bytes(b) => b,
            Source::Mem { ptr, len } | Source::Gated { ptr, len, .. } => {
                if *len == 0 {
                    return &[];
                }
                // SAFETY: guaranteed by the contract of `Source::mem`.
                unsafe { std::slice::from_raw_parts(*ptr, *len) }
            }
        }
    }
}

/// CRC of `len` bytes of record `record` starting at `offset` in the record.
pub struct CrcPiece {
    pub record: usize,
    pub offset: u64,
    pub len: u64,
    pub hasher: Hasher,
    /// With chunk sums: `(offset in the record, length, CRC-32)` of the
    /// piece's parts cut at the record's chunk boundaries (see [`crate::crc`]).
    pub chunks: Vec<(u64, u32, u32)>,
}

/// A span of a chunk written straight from a record's memory (see
/// [`Plan::direct_spans`]).
pub struct DirectSpan {
    pub record: usize,
    pub ptr: *const u8,
    /// Offset of `start` inside the record's data.
    pub offset: u64,
    pub start: u64,
    pub end: u64,
}

/// What gathering one range produced.
#[derive(Default)]
pub struct Gathered {
    pub pieces: Vec<CrcPiece>,
    /// File ranges inside the gathered range that must not be written yet.
    pub deferred: Vec<(u64, u64)>,
}

pub struct Plan {
    layout: LayoutBuilder,
    sources: Vec<Source>,
    crcs: Vec<Option<u32>>,
    /// Whether memory records get a CRC-32 per 512-byte chunk (computed in
    /// the same pass as their CRC), and the tables once complete.
    chunk_sums: bool,
    chunk_tables: Vec<Option<Vec<u32>>>,
    /// Bytes placed right after the last record (the central directory).
    tail: Option<Vec<u8>>,
}

impl Plan {
    pub fn new(align: u64) -> Result<Self> {
        Ok(Plan {
            layout: LayoutBuilder::new(align)?,
            sources: Vec::new(),
            crcs: Vec::new(),
            chunk_sums: false,
            chunk_tables: Vec::new(),
            tail: None,
        })
    }

    /// Memory records (storages) also get a CRC-32 per 512-byte chunk,
    /// computed in the pass that computes their CRC ([`Plan::chunk_table`]).
    pub fn set_chunk_sums(&mut self, on: bool) {
        self.chunk_sums = on;
    }

    /// The CRC of `data`, the bytes of record `record` from `offset`, as a
    /// piece to [`Plan::absorb`]; with chunk sums, cut at chunk boundaries.
    pub fn piece(&self, record: usize, offset: u64, data: &[u8]) -> CrcPiece {
        let len = data.len() as u64;
        if let Some(p) = self.known_piece(record, offset, data) {
            return p;
        }
        if self.chunk_sums && !matches!(self.sources[record], Source::Bytes(_)) {
            let mut chunks = Vec::with_capacity(data.len() / crc::CHUNK + 2);
            let c = crc::sum_chunks(data, offset, &mut chunks);
            return CrcPiece {
                record,
                offset,
                len,
                hasher: Hasher::new_with_initial_len(c, len),
                chunks,
            };
        }
        let mut hasher = Hasher::new();
        hasher.update(data);
        CrcPiece {
            record,
            offset,
            len,
            hasher,
            chunks: Vec::new(),
        }
    }

    /// The piece of `data`, the bytes of record `record` from `offset`, with
    /// the CRCs of the record's whole chunks inside it taken from the chunk
    /// sums its producer left with its gate (when it left them) and only the
    /// partial chunks at its edges (less than a chunk each) read.
    fn known_piece(&self, record: usize, offset: u64, data: &[u8]) -> Option<CrcPiece> {
        let Source::Gated {
            gate,
            ready_at,
            len: rec_len,
            ..
        } = &self.sources[record]
        else {
            return None;
        };
        let chunk = crc::CHUNK as u64;
        let rec_len = *rec_len as u64;
        let len = data.len() as u64;
        let end = offset + len;
        if len < chunk || end > rec_len {
            return None;
        }
        let table = gate.sums(*ready_at)?;
        if table.len() as u64 != rec_len.div_ceil(chunk) {
            return None;
        }
        let mut acc = 0u32;
        let mut chunks = Vec::new();
        let mut at = offset;
        while at < end {
            let k = at / chunk;
            let (cs, ce) = (k * chunk, ((k + 1) * chunk).min(rec_len));
            let n = ce.min(end) - at;
            let c = if at == cs && ce <= end {
                table[k as usize]
            } else {
                let o = (at - offset) as usize;
                crc32fast::hash(&data[o..o + n as usize])
            };
            acc = crc::append(acc, c, n as usize);
            if self.chunk_sums {
                chunks.push((at, n as u32, c));
            }
            at += n;
        }
        Some(CrcPiece {
            record,
            offset,
            len,
            hasher: Hasher::new_with_initial_len(acc, len),
            chunks,
        })
    }

    /// Whether the write pass built record `record`'s chunk table.
    pub fn chunk_table_built(&self, record: usize) -> bool {
        matches!(self.chunk_tables.get(record), Some(Some(_)))
    }

    /// The CRC-32 of every 512-byte chunk of record `record`: the table the
    /// write pass built, or (a record that pass did not see whole) computed
    /// now from its memory.
    pub fn chunk_table(&self, record: usize) -> Result<Vec<u32>> {
        if let Some(Some(t)) = self.chunk_tables.get(record) {
            return Ok(t.clone());
        }
        let src = &self.sources[record];
        src.wait_ready()?;
        if let Source::Gated { gate, ready_at, .. } = src {
            if let Some(t) = gate.sums(*ready_at) {
                if t.len() as u64 == (src.len() as u64).div_ceil(crc::CHUNK as u64) {
                    return Ok(t.to_vec());
                }
            }
        }
        let mut out =
            vec![0u32; crate::chunks::chunk_count(src.len() as u64, crc::CHUNK as u64) as usize];
        crate::chunks::compute_into(
            src.slice(),
            crc::CHUNK,
            crate::chunks::Algo::Crc32,
            &mut out,
        );
        Ok(out)
    }

    pub fn align(&self) -> u64 {
        self.layout.align()
    }

    /// Appends a record aligned to the plan's alignment; returns its index.
    pub fn add(&mut self, name: &str, source: Source) -> Result<usize> {
        self.add_aligned(name, source, self.layout.align())
    }

    /// Appends a record whose data is aligned to `align` (at most the plan's).
    pub fn add_aligned(&mut self, name: &str, source: Source, align: u64) -> Result<usize> {
        if self.tail.is_some() {
            return Err(Error::Invalid(
                "records cannot be added after the directory".into(),
            ));
        }
        self.layout.push_aligned(name, source.len() as u64, align)?;
        // The CRC-32 of no bytes is 0.
        self.crcs
            .push(if source.is_empty() { Some(0) } else { None });
        self.chunk_tables.push(None);
        self.sources.push(source);
        Ok(self.sources.len() - 1)
    }

    pub fn entries(&self) -> &[Entry] {
        self.layout.entries()
    }

    pub fn len(&self) -> usize {
        self.sources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// End of the record area.
    pub fn records_end(&self) -> u64 {
        self.layout.end()
    }

    /// End of the file (records and, once finalized, the directory).
    pub fn file_end(&self) -> u64 {
        self.layout.end() + self.tail.as_ref().map_or(0, |t| t.len() as u64)
    }

    pub fn crc(&self, record: usize) -> Option<u32> {
        self.crcs[record]
    }

    /// When `[start, end)` lies inside the data of one caller-memory record
    /// and its memory can be handed to the kernel as it is (address, start
    /// and length multiples of `align`): the record, the memory and the
    /// offset in the record. Such a range is written without a staging copy.
    pub fn direct_span(&self, start: u64, end: u64, align: u64) -> Option<(usize, *const u8, u64)> {
        let entries = self.layout.entries();
        let i = entries.partition_point(|e| e.data_end() <= start);
        let e = entries.get(i)?;
        if start < e.data_offset || end > e.data_end() || start >= end {
            return None;
        }
        let (Source::Mem { ptr, .. } | Source::Gated { ptr, .. }) = &self.sources[i] else {
            return None;
        };
        let off = start - e.data_offset;
        // SAFETY: `off` is inside the record, whose memory is valid for its length.
        let p = unsafe { ptr.add(off as usize) };
        let aligned = |x: u64| x % align.max(1) == 0;
        (aligned(p as u64) && aligned(start) && aligned(end - start)).then_some((i, p, off))
    }

    /// The parts of `[start, end)` that can be written straight from record
    /// memory: for each in-memory record the chunk meets, the largest span of
    /// its data inside the chunk whose file offset, memory address and length
    /// are multiples of `align`, when it is at least `min_len` long. Sorted,
    /// disjoint. The rest of the chunk (record edges, headers, padding) is
    /// left to [`Plan::gather`].
    pub fn direct_spans(&self, start: u64, end: u64, align: u64, min_len: u64) -> Vec<DirectSpan> {
        let align = align.max(1);
        let entries = self.layout.entries();
        let first = entries.partition_point(|e| e.data_end() <= start);
        let mut out = Vec::new();
        for (i, e) in entries.iter().enumerate().skip(first) {
            if e.data_offset >= end {
                break;
            }
            let (Source::Mem { ptr, .. } | Source::Gated { ptr, .. }) = &self.sources[i] else {
                continue;
            };
            let s = align_up(e.data_offset.max(start), align);
            let t = align_down(e.data_end().min(end), align);
            if t <= s || t - s < min_len {
                continue;
            }
            let off = s - e.data_offset;
            // SAFETY: `off` is inside the record, whose memory is valid for its length.
            let p = unsafe { ptr.add(off as usize) };
            if (p as u64) % align != 0 {
                continue; // the record's memory is not aligned like its file offset
            }
            out.push(DirectSpan {
                record: i,
                ptr: p,
                offset: off,
                start: s,
                end: t,
            });
        }
        out
    }

    /// The source of record `record`.
    pub fn source(&self, record: usize) -> &Source {
        &self.sources[record]
    }

    /// Combines CRC pieces (from any number of gathers) into record CRCs
    /// (and chunk tables, with chunk sums). A record's CRC is set only when
    /// the pieces cover it entirely.
    pub fn absorb(&mut self, mut pieces: Vec<CrcPiece>) {
        pieces.sort_by_key(|p| (p.record, p.offset));
        let mut i = 0;
        while i < pieces.len() {
            let rec = pieces[i].record;
            let first = i;
            let mut h = Hasher::new();
            let mut covered = 0u64;
            let mut contiguous = true;
            while i < pieces.len() && pieces[i].record == rec {
                let p = &pieces[i];
                if p.offset != covered {
                    contiguous = false;
                }
                covered = p.offset + p.len;
                h.combine(&p.hasher);
                i += 1;
            }
            if contiguous && covered == self.sources[rec].len() as u64 && self.crcs[rec].is_none() {
                self.crcs[rec] = Some(h.finalize());
                if self.chunk_sums && self.chunk_tables[rec].is_none() {
                    self.chunk_tables[rec] = chunk_table_of(&pieces[first..i]);
                }
            }
        }
    }

    /// Computes the CRC of every record that has none yet, on `threads` threads.
    pub fn compute_missing_crcs(&mut self, threads: usize) {
        let todo: Vec<usize> = (0..self.sources.len())
            .filter(|&i| self.crcs[i].is_none())
            .collect();
        if todo.is_empty() {
            return;
        }
        // Split large records into pieces so that threads share the work.
        const PIECE: usize = 4 << 20;
        let mut work: Vec<(usize, usize, usize)> = Vec::new();
        for &r in &todo {
            let len = self.sources[r].len();
            let mut o = 0;
            while o < len {
                let n = PIECE.min(len - o);
                work.push((r, o, n));
                o += n;
            }
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let this = &*self;
        let sources = &self.sources;
        let pieces: Vec<CrcPiece> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads.clamp(1, work.len()))
                .map(|_| {
                    s.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(&(r, o, n)) = work.get(i) else { break };
                            // A failed producer leaves garbage; the gather reports it.
                            let _ = sources[r].wait_ready();
                            out.push(this.piece(r, o as u64, &sources[r].slice()[o..o + n]));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("crc thread"))
                .collect()
        });
        self.absorb(pieces);
    }

    /// Writes the central directory after the records. Every CRC must be known.
    pub fn finalize(&mut self) -> Result<()> {
        for (i, c) in self.crcs.iter().enumerate() {
            let Some(c) = c else {
                return Err(Error::Invalid(format!(
                    "record '{}' has no checksum yet",
                    self.layout.entries()[i].name
                )));
            };
            self.layout.entries_mut()[i].crc = *c;
        }
        let cd = zip::central_directory(self.layout.entries(), self.layout.end());
        self.tail = Some(cd);
        Ok(())
    }

    /// Gathers the file bytes of `[start, start + buf.len())` into `buf`.
    ///
    /// Data of records whose CRC is unknown yields CRC pieces. A local header
    /// whose CRC is unknown and cannot be learnt from this range (its data runs
    /// past it) is not written: its blocks (of `granule` bytes) within the range
    /// are returned as deferred, or, when `allow_defer` is false, an error.
    pub fn gather(
        &self,
        start: u64,
        buf: &mut [u8],
        granule: u64,
        allow_defer: bool,
    ) -> Result<Gathered> {
        let end = start + buf.len() as u64;
        let entries = self.layout.entries();
        let mut out = Gathered::default();
        let mut filled_to = start;
        let first = entries.partition_point(|e| e.data_end() <= start);
        for (idx, e) in entries.iter().enumerate().skip(first) {
            if e.header_offset >= end {
                break;
            }
            let src = &self.sources[idx];
            // Data part.
            let (ds, de) = (e.data_offset.max(start), e.data_end().min(end));
            let mut whole_record_hasher = None;
            if ds < de {
                src.wait_ready()?;
                let from =
                    &src.slice()[(ds - e.data_offset) as usize..(de - e.data_offset) as usize];
                buf[(ds - start) as usize..(de - start) as usize].copy_from_slice(from);
                if self.crcs[idx].is_none() {
                    let piece = self.piece(idx, ds - e.data_offset, from);
                    if ds == e.data_offset && de == e.data_end() {
                        whole_record_hasher = Some(piece.hasher.clone());
                    }
                    out.pieces.push(piece);
                }
            }
            // Header part.
            let (hs, he) = (e.header_offset.max(start), e.data_offset.min(end));
            if hs < he {
                let crc = self.crcs[idx].or_else(|| whole_record_hasher.map(Hasher::finalize));
                match crc {
                    Some(crc) => {
                        let mut e2 = e.clone();
                        e2.crc = crc;
                        let h = zip::local_header(&e2);
                        buf[(hs - start) as usize..(he - start) as usize].copy_from_slice(
                            &h[(hs - e.header_offset) as usize..(he - e.header_offset) as usize],
                        );
                    }
                    None if allow_defer => {
                        let ds = align_down(e.header_offset, granule).max(start);
                        out.deferred.push((ds, he));
                    }
                    None => {
                        return Err(Error::Invalid(format!(
                            "record '{}': checksum unknown when its header is written",
                            e.name
                        )));
                    }
                }
            }
            filled_to = filled_to.max(e.data_end().min(end));
        }
        // After the records: the directory, then zeros.
        if filled_to < end {
            let rec_end = self.layout.end();
            let mut pos = filled_to;
            if let Some(tail) = &self.tail {
                let (ts, te) = (rec_end.max(pos), (rec_end + tail.len() as u64).min(end));
                if ts < te {
                    buf[(pos - start) as usize..(ts - start) as usize].fill(0);
                    buf[(ts - start) as usize..(te - start) as usize]
                        .copy_from_slice(&tail[(ts - rec_end) as usize..(te - rec_end) as usize]);
                    pos = te;
                }
            }
            buf[(pos - start) as usize..].fill(0);
        }
        // Merge overlapping deferred ranges (a small record can put two
        // headers into one block).
        out.deferred.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(out.deferred.len());
        for (s, e) in out.deferred.drain(..) {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        out.deferred = merged;
        Ok(out)
    }
}

/// A record's chunk table from the pieces that cover it, in order (None when
/// a piece has no chunk sums or they leave a gap).
fn chunk_table_of(pieces: &[CrcPiece]) -> Option<Vec<u32>> {
    let chunk = crc::CHUNK as u64;
    let mut table: Vec<u32> = Vec::new();
    let mut at = 0u64;
    for p in pieces {
        if p.len > 0 && p.chunks.is_empty() {
            return None;
        }
        for &(o, n, c) in &p.chunks {
            if o != at {
                return None;
            }
            if o % chunk == 0 {
                table.push(c);
            } else {
                let last = table.last_mut()?;
                *last = crc::append(*last, c, n as usize);
            }
            at += u64::from(n);
        }
    }
    Some(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zip::{read_directory, ReadAt};

    fn records() -> Vec<(String, Vec<u8>)> {
        let mut v = vec![("a/data.pkl".to_string(), b"pickle".to_vec())];
        for (i, n) in [0usize, 1, 5000, 70_000, 3, 200_000].iter().enumerate() {
            v.push((
                format!("a/data/{i}"),
                (0..*n).map(|x| (x * 7 + i) as u8).collect(),
            ));
        }
        v
    }

    /// Gathers the whole file in chunks of `chunk`, deferring headers, then
    /// rewrites the deferred ranges; the result must be a valid archive.
    fn build(chunk: usize) -> Vec<u8> {
        let recs = records();
        let mut plan = Plan::new(4096).unwrap();
        for (n, d) in &recs {
            plan.add(n, Source::Bytes(d.clone().into())).unwrap();
        }
        let data_end = plan.records_end();
        let mut file = vec![0xAAu8; data_end as usize];
        let mut deferred = Vec::new();
        let mut pieces = Vec::new();
        let mut s = 0u64;
        while s < data_end {
            let e = (s + chunk as u64).min(data_end);
            let mut buf = vec![0u8; (e - s) as usize];
            let g = plan.gather(s, &mut buf, 512, true).unwrap();
            // Only the non-deferred bytes reach the "file".
            let mut pos = s;
            for &(ds, de) in &g.deferred {
                file[pos as usize..ds as usize]
                    .copy_from_slice(&buf[(pos - s) as usize..(ds - s) as usize]);
                pos = de;
            }
            file[pos as usize..e as usize].copy_from_slice(&buf[(pos - s) as usize..]);
            deferred.extend(g.deferred);
            pieces.extend(g.pieces);
            s = e;
        }
        plan.absorb(pieces);
        plan.finalize().unwrap();
        for (ds, de) in deferred {
            let mut buf = vec![0u8; (de - ds) as usize];
            let g = plan.gather(ds, &mut buf, 512, false).unwrap();
            assert!(g.deferred.is_empty());
            file[ds as usize..de as usize].copy_from_slice(&buf);
        }
        let end = plan.file_end();
        let mut buf = vec![0u8; (end - data_end) as usize];
        plan.gather(data_end, &mut buf, 512, false).unwrap();
        file.extend_from_slice(&buf);
        file
    }

    #[test]
    fn gated_source_is_read_only_once_ready() {
        let mem = Arc::new(Mutex::new(vec![0u8; 8192]));
        let ptr = mem.lock().unwrap().as_ptr();
        let gate = Gate::new();
        let mut plan = Plan::new(4096).unwrap();
        // SAFETY: `mem` outlives the plan; it is written only before the gate opens.
        plan.add("a/data/0", unsafe {
            Source::gated(ptr, 8192, Arc::clone(&gate), 1)
        })
        .unwrap();
        let end = plan.records_end();
        let filler = {
            let (mem, gate) = (Arc::clone(&mem), Arc::clone(&gate));
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                mem.lock().unwrap().fill(9);
                gate.advance(1);
            })
        };
        let mut buf = vec![0u8; end as usize];
        plan.gather(0, &mut buf, 1, true).unwrap();
        filler.join().unwrap();
        assert!(buf[(end - 8192) as usize..].iter().all(|&b| b == 9));
        // A failed producer makes the reader fail instead of writing garbage.
        let gate2 = Gate::new();
        let mut plan2 = Plan::new(4096).unwrap();
        // SAFETY: as above.
        plan2
            .add("a/data/0", unsafe {
                Source::gated(ptr, 8192, Arc::clone(&gate2), 1)
            })
            .unwrap();
        gate2.fail();
        assert!(plan2.gather(0, &mut buf, 1, true).is_err());
    }

    #[test]
    fn producer_sums_are_taken_instead_of_reading_again() {
        let n = 3 * crc::CHUNK + 100;
        let src: Vec<u8> = (0..n).map(|x| (x * 31 % 251) as u8).collect();
        let mut mem = vec![0u8; n];
        let gate = Gate::new();
        let sums = crc::copy_and_sum(&mut mem, &src);
        // Not readable before the gate passes the position, nor after a failure.
        gate.put_sums(1, sums.clone());
        assert!(gate.sums(1).is_none());
        gate.advance(1);
        assert_eq!(gate.sums(1).as_deref(), Some(&sums[..]));
        assert!(gate.sums(2).is_none());
        // The memory is changed after the copy: a plan that took the
        // producer's sums reports those, proving it did not read the memory.
        mem[5] ^= 1;
        let mut plan = Plan::new(4096).unwrap();
        plan.set_chunk_sums(true);
        // SAFETY: `mem` outlives the plan and is not written while it exists.
        plan.add("a/data/0", unsafe {
            Source::gated(mem.as_ptr(), n, Arc::clone(&gate), 1)
        })
        .unwrap();
        plan.compute_missing_crcs(2);
        assert_eq!(plan.crc(0), Some(crc32fast::hash(&src)));
        assert_eq!(plan.chunk_table(0).unwrap(), sums);
        // A piece's whole chunks come from the table (byte 5 is in chunk 0,
        // so the sums are the source's), its partial edges from memory.
        let p = plan.piece(0, 1, &mem[1..n - 1]);
        assert_eq!(p.hasher.finalize(), crc32fast::hash(&mem[1..n - 1]));
        let p = plan.piece(0, 0, &mem[..2 * crc::CHUNK + 7]);
        assert_eq!(
            p.hasher.finalize(),
            crc32fast::hash(&src[..2 * crc::CHUNK + 7])
        );
        assert_eq!(p.chunks.len(), 3);
        // Pieces on the grid, as a writer cuts them, agree with the table.
        let p = plan.piece(0, crc::CHUNK as u64, &mem[crc::CHUNK..n]);
        assert_eq!(p.hasher.finalize(), crc32fast::hash(&src[crc::CHUNK..n]));
        assert_eq!(p.chunks.len(), 3);
        // A failed gate gives no sums: the writer reads (and then fails).
        let g2 = Gate::new();
        g2.put_sums(1, sums);
        g2.advance(1);
        g2.fail();
        assert!(g2.sums(1).is_none());
    }

    #[test]
    fn chunked_gather_with_deferred_headers_builds_valid_zip() {
        for chunk in [4096usize, 8192, 65536, 1 << 20] {
            let file = build(chunk);
            // The same archive produced in one pass with every CRC known first.
            let mut reference = Plan::new(4096).unwrap();
            for (n, d) in records() {
                reference.add(&n, Source::Bytes(d.into())).unwrap();
            }
            reference.compute_missing_crcs(2);
            reference.finalize().unwrap();
            let mut whole = vec![0u8; reference.file_end() as usize];
            reference.gather(0, &mut whole, 1, false).unwrap();
            assert!(
                whole == file,
                "chunked build with chunk {chunk} differs from the one-pass build"
            );
            let dir = read_directory(file.as_slice(), std::path::Path::new("mem")).unwrap();
            let recs = records();
            assert_eq!(dir.entries.len(), recs.len());
            for (e, (n, d)) in dir.entries.iter().zip(&recs) {
                assert_eq!(&e.name, n);
                assert_eq!(e.crc, crc32fast::hash(d), "chunk {chunk} record {n}");
                let mut h = vec![0u8; 600];
                let l = (file.len() as u64 - e.header_offset).min(600) as usize;
                file.as_slice()
                    .read_exact_at(&mut h[..l], e.header_offset)
                    .unwrap();
                let off =
                    zip::data_offset_from_local(&h, e, &dir, std::path::Path::new("mem")).unwrap();
                assert_eq!(&file[off as usize..off as usize + d.len()], &d[..]);
            }
        }
    }

    #[test]
    fn crc_pass_matches() {
        let mut plan = Plan::new(4096).unwrap();
        let big: Vec<u8> = (0..10_000_000u32).map(|x| x as u8).collect();
        plan.add("a/big", Source::Bytes(big.clone().into()))
            .unwrap();
        plan.add("a/empty", Source::Bytes(Vec::new().into()))
            .unwrap();
        plan.compute_missing_crcs(3);
        assert_eq!(plan.crc(0), Some(crc32fast::hash(&big)));
        assert_eq!(plan.crc(1), Some(0));
    }
}
