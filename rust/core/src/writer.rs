//! Writing a container file through the engine.
//!
//! ```text
//! create ─► add records ─► write_data (bulk, in chunks, CRCs on the way)
//!        ─► add trailing records (data.pkl, manifest) ─► commit
//!             (deferred header blocks, trailing records, central directory,
//!              truncate, fsync, rename, fsync directory)
//! ```
//!
//! Staging buffers come from the engine's bounded pool, so memory stays flat
//! whatever the size of the save. Filling a buffer (memcpy + CRC) runs on
//! `cpu_threads` threads while earlier buffers are in flight.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::buf::{align_down, align_up, AlignedBuf, PooledBuf};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::AtomicFile;
use crate::io::{Class, Op, PathSlot, Request};
use crate::plan::{CrcPiece, Plan, Source};
use crate::ranges::turns_for;
use crate::task::{Task, TaskState};

/// The shortest part of a record written straight from its memory when a
/// chunk holds several records (shorter ones are copied with their
/// neighbours into the chunk's staging buffer: one request instead of many).
/// At 64 KiB, a state of 20,000 tensors of 4-256 KiB (a tenth of them at
/// addresses the disk's direct I/O accepts) went out in 6,000 requests of a
/// record or less, and every record next to one written from its memory had
/// its header deferred to the commit (2,200 more): its data took 1.3 s
/// against 0.87 s for the same bytes as one record. At 1 MiB: 0.96 s, 318
/// deferred headers (the records over chunk boundaries).
const DIRECT_MIN: u64 = 1 << 20;

/// The file-system block size direct writes are cut at (see `granule`).
const FS_BLOCK: u64 = 4096;

/// The largest staging buffer for a chunk's gaps taken from the heap rather
/// than the engine's pool.
const PACKED_MAX: u64 = 256 << 10;

/// Staging memory for the parts of a chunk not written from record memory.
enum Staging {
    /// A small buffer holding the gaps packed one after another.
    Packed(AlignedBuf),
    /// A pool buffer laid out like the chunk.
    Pooled(PooledBuf),
}

impl Staging {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Staging::Packed(b) => b.as_mut_slice(),
            Staging::Pooled(b) => b.as_mut_slice(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Staging::Packed(b) => b.as_mut_ptr(),
            Staging::Pooled(b) => b.as_mut_ptr(),
        }
    }
}

/// A file range `[start, end)`.
type Range = (u64, u64);

/// A file in place: where it is and how long it is.
#[derive(Clone, Debug)]
pub struct Committed {
    pub path: PathBuf,
    pub file_len: u64,
}

/// How a container is written.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Alignment of every record's data in the file.
    pub align: u64,
    /// fsync the file and its directory before returning.
    pub durable: bool,
    pub class: Class,
    /// Also a CRC-32 per 512-byte chunk of every memory record, computed in
    /// the pass that computes the record's CRC (see [`Plan::chunk_table`]).
    pub chunk_sums: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            align: crate::buf::DEFAULT_ALIGN as u64,
            durable: true,
            class: Class::Foreground,
            chunk_sums: false,
        }
    }
}

pub struct ContainerWriter {
    engine: Arc<Engine>,
    file: AtomicFile,
    opts: WriteOptions,
    plan: Plan,
    slot: Arc<PathSlot>,
    /// `[0, written_to)` is on disk, except the deferred ranges.
    written_to: u64,
    deferred: Vec<(u64, u64)>,
}

impl ContainerWriter {
    pub fn create(engine: &Arc<Engine>, path: &Path, opts: WriteOptions) -> Result<Self> {
        let mut plan = Plan::new(opts.align)?;
        plan.set_chunk_sums(opts.chunk_sums);
        let mut file = AtomicFile::create(path, engine.mode().direct())?;
        // O_DIRECT only when our record alignment and staging buffers satisfy
        // the file system's requirements; otherwise write through the cache.
        if file.inner.direct
            && (file.inner.align > opts.align
                || file.inner.dio.mem > crate::buf::DEFAULT_ALIGN as u64)
        {
            drop(file);
            file = AtomicFile::create(path, false)?;
            file.inner.buffered_reason =
                Some("the file system's O_DIRECT alignment exceeds the record alignment".into());
        }
        let slot = engine.path_slot(file.inner.dev);
        Ok(ContainerWriter {
            engine: Arc::clone(engine),
            file,
            opts,
            plan,
            slot,
            written_to: 0,
            deferred: Vec::new(),
        })
    }

    /// Whether the file is written with O_DIRECT, and if not, why.
    pub fn direct(&self) -> (bool, Option<String>) {
        (
            self.file.inner.direct,
            self.file.inner.buffered_reason.clone(),
        )
    }

    pub fn final_path(&self) -> &Path {
        self.file.final_path()
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Appends a record; returns its index.
    pub fn add(&mut self, name: &str, source: Source) -> Result<usize> {
        self.plan.add(name, source)
    }

    /// Appends a record with a smaller data alignment (small metadata records).
    pub fn add_aligned(&mut self, name: &str, source: Source, align: u64) -> Result<usize> {
        self.plan.add_aligned(name, source, align)
    }

    /// Writes every record added so far, in the background. The task returns
    /// the writer, with the CRC of every written record known.
    pub fn write_data(self, state: Arc<TaskState>) -> Result<Task<ContainerWriter>> {
        Task::spawn("tierstore-save", state, move |st| {
            let mut w = self;
            let granule = w.granule();
            let end = align_down(w.plan.records_end(), granule);
            w.file.reserve(w.plan.records_end())?;
            st.bytes_total
                .fetch_add(end - w.written_to, Ordering::Relaxed);
            // One turn at the device for the records, where it has turns.
            let turn = turns_for(&w.engine, w.file.inner.dev, w.opts.class, None);
            let _turn = turn
                .as_ref()
                .map(|t| t.turns.take(Op::Write, end - w.written_to, t.ticket));
            let (mut pieces, deferred) = w.write_range(&st, w.written_to, end, &[], true)?;
            // The last partial block is written by `commit`; checksum its bytes
            // now so that every record's CRC is known when this returns.
            let tail_len = (w.plan.records_end() - end) as usize;
            if tail_len > 0 {
                let mut scratch = vec![0u8; tail_len];
                pieces.extend(w.plan.gather(end, &mut scratch, granule, true)?.pieces);
            }
            w.plan.absorb(pieces);
            w.deferred.extend(deferred);
            w.written_to = end;
            Ok(w)
        })
    }

    /// Writes what remains (deferred header blocks, records added since
    /// `write_data`, the central directory), then makes the file durable and
    /// renames it into place.
    pub fn commit(self, state: Arc<TaskState>) -> Result<Task<Committed>> {
        Task::spawn("tierstore-commit", state, move |st| {
            let mut w = self;
            w.plan.compute_missing_crcs(w.engine.config().cpu_threads);
            w.plan.finalize()?;
            let granule = w.granule();
            let file_end = w.plan.file_end();
            let end = align_up(file_end, granule);
            let deferred = std::mem::take(&mut w.deferred);
            st.bytes_total.fetch_add(
                end - w.written_to + deferred.iter().map(|(s, e)| e - s).sum::<u64>(),
                Ordering::Relaxed,
            );
            w.file.reserve(file_end)?;
            let start = w.written_to;
            let t0 = std::time::Instant::now();
            let turn = turns_for(&w.engine, w.file.inner.dev, w.opts.class, None);
            let tail = turn
                .as_ref()
                .map(|t| t.turns.take(Op::Write, end - start, t.ticket));
            w.write_range(&st, start, end, &deferred, false)?;
            drop(tail);
            let t1 = std::time::Instant::now();
            if end != file_end || w.file.inner.direct {
                w.file.set_len(file_end)?;
            }
            let path = w.file.final_path().to_path_buf();
            let durable = w.opts.durable;
            w.file.commit(durable)?;
            if std::env::var_os("TIERSTORE_TRACE").is_some() {
                eprintln!(
                    "tierstore: commit {}: tail+{} deferred ranges {:?}, truncate+fsync+rename {:?}",
                    path.display(),
                    deferred.len(),
                    t1 - t0,
                    t1.elapsed()
                );
            }
            Ok(Committed {
                path,
                file_len: file_end,
            })
        })
    }

    /// Gathers and writes `[start, end)` plus the `extra` ranges, in chunks.
    fn write_range(
        &self,
        st: &Arc<TaskState>,
        start: u64,
        end: u64,
        extra: &[(u64, u64)],
        allow_defer: bool,
    ) -> Result<(Vec<CrcPiece>, Vec<Range>)> {
        let chunk = self.engine.pool().buf_size() as u64;
        let mut jobs: Vec<(u64, u64)> = Vec::new();
        let mut s = start;
        while s < end {
            // Chunk boundaries fall on multiples of the chunk size so that a
            // range written in two passes still meets aligned boundaries.
            let e = (align_down(s, chunk) + chunk).min(end);
            jobs.push((s, e));
            s = e;
        }
        for &(s, e) in extra {
            let mut p = s;
            while p < e {
                let q = (p + chunk).min(e);
                jobs.push((p, q));
                p = q;
            }
        }
        let next = AtomicUsize::new(0);
        let pieces = Mutex::new(Vec::new());
        let deferred = Mutex::new(Vec::new());
        let nthreads = self.engine.config().cpu_threads.clamp(1, jobs.len().max(1));
        std::thread::scope(|sc| {
            for _ in 0..nthreads {
                sc.spawn(|| {
                    while !st.should_stop() {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(s, e)) = jobs.get(i) else { break };
                        if let Err(err) =
                            self.write_chunk(st, s, e, allow_defer, &pieces, &deferred)
                        {
                            st.fail(err);
                        }
                    }
                });
            }
        });
        st.wait_idle();
        st.outcome()?;
        let mut d = deferred.into_inner().expect("lock");
        d.sort_unstable();
        Ok((pieces.into_inner().expect("lock"), d))
    }

    fn write_chunk(
        &self,
        st: &Arc<TaskState>,
        s: u64,
        e: u64,
        allow_defer: bool,
        pieces: &Mutex<Vec<CrcPiece>>,
        deferred_out: &Mutex<Vec<(u64, u64)>>,
    ) -> Result<()> {
        let granule = self.granule();
        if let Some((rec, ptr, off)) = self.plan.direct_span(s, e, granule) {
            return self.write_direct(st, rec, ptr, off, s, e, pieces);
        }
        // A chunk over several records: each record's aligned interior goes
        // out straight from its memory; only the edges between them (record
        // tails, headers, padding) are copied into one staging buffer.
        let spans = self
            .plan
            .direct_spans(s, e, granule, DIRECT_MIN.max(granule));
        let mut gaps = Vec::with_capacity(spans.len() + 1);
        let mut pos = s;
        for sp in &spans {
            if sp.start > pos {
                gaps.push((pos, sp.start));
            }
            pos = sp.end;
        }
        if pos < e {
            gaps.push((pos, e));
        }
        for sp in spans {
            self.write_direct(st, sp.record, sp.ptr, sp.offset, sp.start, sp.end, pieces)?;
        }
        if gaps.is_empty() {
            return Ok(());
        }
        // Where each gap goes in the staging memory. A chunk's gaps are
        // mostly record headers and small tensors: packed (each at the same
        // offset modulo 4096 as in the file, so that direct I/O alignment is
        // kept) they fit a small heap buffer, and an 8 MiB pool buffer (whose
        // first use costs page faults) is taken only for a chunk of many small
        // records.
        let page = crate::buf::DEFAULT_ALIGN as u64;
        let mut placed = Vec::with_capacity(gaps.len());
        let mut total = 0u64;
        for &(gs, ge) in &gaps {
            let at = align_up(total, page) + gs % page;
            placed.push((gs, ge, at));
            total = at + (ge - gs);
        }
        let mut buf = if total <= PACKED_MAX {
            Staging::Packed(
                AlignedBuf::new(total as usize, crate::buf::DEFAULT_ALIGN)
                    .ok_or_else(|| Error::Invalid("out of memory for a staging buffer".into()))?,
            )
        } else {
            let pool = self.engine.pool();
            let b = loop {
                if let Some(b) = pool.acquire(Duration::from_millis(50)) {
                    break b;
                }
                if st.should_stop() {
                    return Ok(());
                }
            };
            for p in &mut placed {
                p.2 = p.0 - s; // the chunk's own layout
            }
            Staging::Pooled(b)
        };
        // The pieces of this chunk to write now (file range, offset in the
        // buffer): the gaps, but the deferred ranges.
        let mut writes = Vec::new();
        for (gs, ge, at) in placed {
            let slot = &mut buf.as_mut_slice()[at as usize..(at + ge - gs) as usize];
            let g = self.plan.gather(gs, slot, granule, allow_defer)?;
            pieces.lock().expect("lock").extend(g.pieces);
            let mut pos = gs;
            for &(ds, de) in &g.deferred {
                if ds > pos {
                    writes.push((pos, ds, at + pos - gs));
                }
                pos = pos.max(de);
            }
            if pos < ge {
                writes.push((pos, ge, at + pos - gs));
            }
            deferred_out.lock().expect("lock").extend(g.deferred);
        }
        let base = buf.as_mut_ptr();
        let buf = Arc::new(buf);
        for (ws, we, at) in writes {
            let expect = (we - ws) as usize;
            let done = self.completion(st, expect, Arc::clone(&buf));
            // SAFETY: the buffer is kept alive by `keep` until the callback
            // runs, nothing writes it meanwhile, and the file stays open until
            // `write_range` has waited for every request.
            let req = unsafe {
                Request::new(
                    Op::Write,
                    self.file.inner.fd(),
                    base.add(at as usize),
                    expect,
                    ws,
                    self.opts.class,
                    Arc::clone(&self.slot),
                    done,
                )
            };
            self.engine.submit(req);
        }
        Ok(())
    }
}

impl ContainerWriter {
    /// The unit writes are cut in: the file's direct I/O alignment, but at
    /// least a file-system block for direct I/O. ext4 serves a direct write
    /// that starts or ends inside a block of preallocated (unwritten) space
    /// only under the inode's exclusive lock and never without blocking, so
    /// io_uring hands each such write to a worker thread, where the writes
    /// of one file run one after another: with 512-byte cuts, 2 of 3 writes
    /// of a checkpoint took that path.
    fn granule(&self) -> u64 {
        let a = self.file.inner.align.max(1);
        if self.file.inner.direct {
            a.max(FS_BLOCK)
        } else {
            a
        }
    }

    /// The callback of one write of `expect` bytes: counts progress or records
    /// the failure, then releases `keep` (the buffer the write reads from).
    fn completion<K: Send + 'static>(
        &self,
        st: &Arc<TaskState>,
        expect: usize,
        keep: K,
    ) -> crate::io::Callback {
        let path = self.file.inner.path.clone();
        st.start_one();
        let st = Arc::clone(st);
        Box::new(move |r: std::io::Result<usize>| {
            match r {
                Ok(n) if n == expect => {
                    st.bytes_done.fetch_add(n as u64, Ordering::Relaxed);
                }
                Ok(n) => st.fail(Error::io(
                    &path,
                    "write",
                    std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        format!("short write: {n} of {expect} bytes"),
                    ),
                )),
                Err(err) => st.fail(Error::io(&path, "write", err)),
            }
            drop(keep);
            st.finish_one();
        })
    }

    /// Writes `[s, e)` straight from the record's memory (no staging copy):
    /// checksums it in place, then hands the memory to the kernel.
    #[allow(clippy::too_many_arguments)]
    fn write_direct(
        &self,
        st: &Arc<TaskState>,
        rec: usize,
        ptr: *const u8,
        off: u64,
        s: u64,
        e: u64,
        pieces: &Mutex<Vec<CrcPiece>>,
    ) -> Result<()> {
        self.plan.source(rec).wait_ready()?;
        let len = (e - s) as usize;
        if self.plan.crc(rec).is_none() {
            // SAFETY: `direct_span` checked that the range lies inside the record's memory.
            let data = unsafe { std::slice::from_raw_parts(ptr, len) };
            let piece = self.plan.piece(rec, off, data);
            pieces.lock().expect("lock").push(piece);
        }
        let done = self.completion(st, len, ());
        // SAFETY: the record's memory outlives the writer (the contract of
        // `Source::mem` / `Source::gated`); a write only reads it; the file
        // stays open until `write_range` has waited for every request.
        let req = unsafe {
            Request::new(
                Op::Write,
                self.file.inner.fd(),
                ptr.cast_mut(),
                len,
                s,
                self.opts.class,
                Arc::clone(&self.slot),
                done,
            )
        };
        self.engine.submit(req);
        Ok(())
    }
}

/// Builds a container in memory-sized pieces for a file object: every CRC is
/// computed first, then the file is produced front to back.
pub struct ContainerStream {
    plan: Plan,
    pos: u64,
    chunk: usize,
    threads: usize,
}

impl ContainerStream {
    pub fn new(align: u64, chunk: usize, threads: usize) -> Result<Self> {
        Ok(ContainerStream {
            plan: Plan::new(align)?,
            pos: 0,
            chunk,
            threads,
        })
    }

    pub fn add(&mut self, name: &str, source: Source) -> Result<usize> {
        self.plan.add(name, source)
    }

    pub fn add_aligned(&mut self, name: &str, source: Source, align: u64) -> Result<usize> {
        self.plan.add_aligned(name, source, align)
    }

    /// CRCs of all records added so far.
    pub fn checksums(&mut self) -> Vec<u32> {
        self.plan.compute_missing_crcs(self.threads);
        (0..self.plan.len())
            .map(|i| self.plan.crc(i).unwrap_or(0))
            .collect()
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The next piece of the file, or `None` at the end. The first call
    /// seals the archive (no more records).
    pub fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        if self.pos == 0 {
            self.plan.compute_missing_crcs(self.threads);
            self.plan.finalize()?;
        }
        let end = self.plan.file_end();
        if self.pos >= end {
            return Ok(None);
        }
        let n = (self.chunk as u64).min(end - self.pos);
        let mut v = vec![0u8; n as usize];
        self.plan.gather(self.pos, &mut v, 1, false)?;
        self.pos += n;
        Ok(Some(v))
    }
}
