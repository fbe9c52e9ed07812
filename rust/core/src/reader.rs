//! Reading records straight into their final, aligned buffers.
//!
//! Each record gets its own buffer, sized and aligned so that the file range
//! `[align_down(offset), align_up(offset + size))` can be read with O_DIRECT;
//! the record's bytes sit at `start` inside it. Large records are read in
//! chunks, many in flight; CRCs are checked as chunks arrive, on `cpu_threads`
//! threads, so verification overlaps the I/O.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crc32fast::Hasher;

use crate::buf::{align_down, align_up, AlignedBuf};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::{EngineFile, FileSource};
use crate::io::{Class, Op, Request};
use crate::plan::CrcPiece;
use crate::task::{Task, TaskState};
use crate::zip::{self, Directory, ReadAt};

/// Memory alignment of record buffers (a page: good for O_DIRECT and SIMD).
const BUF_ALIGN: usize = 4096;

/// One record to read.
#[derive(Clone, Debug)]
pub struct ReadSpec {
    pub name: String,
    pub offset: u64,
    pub size: u64,
    /// Expected CRC-32 of the data, checked when verification is on.
    pub crc: Option<u32>,
}

/// A record's bytes: `buf[start .. start + len]`.
pub struct RecordBuf {
    pub buf: AlignedBuf,
    pub start: usize,
    pub len: usize,
}

impl RecordBuf {
    pub fn data(&self) -> &[u8] {
        &self.buf.as_slice()[self.start..self.start + self.len]
    }
}

struct Piece {
    record: usize,
    /// Offset of the piece inside the record's buffer.
    buf_off: usize,
    /// Bytes asked for.
    len: usize,
    /// Bytes the transfer returned, or the error.
    got: std::io::Result<usize>,
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer targets a buffer owned by the read task, which outlives
// every request (the task waits for all of them before it returns).
unsafe impl Send for SendPtr {}
// SAFETY: shared access only reads completed ranges (see the verifier).
unsafe impl Sync for SendPtr {}

/// Reads `specs` from `file`. The task returns one buffer per spec, in order.
pub fn read_records(
    engine: &Arc<Engine>,
    file: Arc<EngineFile>,
    specs: Vec<ReadSpec>,
    verify: bool,
    class: Class,
    state: Arc<TaskState>,
) -> Result<Task<Vec<RecordBuf>>> {
    for s in &specs {
        if s.offset.checked_add(s.size).is_none_or(|e| e > file.len) {
            return Err(Error::truncated(
                &file.path,
                format!(
                    "record '{}' [{}, +{}) lies beyond the end of the file ({} bytes)",
                    s.name, s.offset, s.size, file.len
                ),
            ));
        }
    }
    let engine = Arc::clone(engine);
    Task::spawn("tierstore-load", state, move |st| run(&engine, &file, &specs, verify, class, &st))
}

fn run(
    engine: &Arc<Engine>,
    file: &Arc<EngineFile>,
    specs: &[ReadSpec],
    verify: bool,
    class: Class,
    st: &Arc<TaskState>,
) -> Result<Vec<RecordBuf>> {
    let a = file.align.max(1);
    let chunk = engine.config().chunk_size;
    let mut bufs = Vec::with_capacity(specs.len());
    let mut work: Vec<(usize, usize, usize, u64)> = Vec::new(); // record, buf_off, len, file_off
    for (i, s) in specs.iter().enumerate() {
        let first = align_down(s.offset, a);
        let start = (s.offset - first) as usize;
        let cap = align_up(start as u64 + s.size, a) as usize;
        let buf = AlignedBuf::new(cap, BUF_ALIGN).ok_or_else(|| {
            Error::Invalid(format!("cannot allocate {cap} bytes for record '{}' of {}", s.name, file.path.display()))
        })?;
        let mut o = 0;
        while o < cap {
            let n = chunk.min(cap - o);
            work.push((i, o, n, first + o as u64));
            o += n;
        }
        bufs.push(RecordBuf { buf, start, len: s.size as usize });
    }
    st.bytes_total
        .fetch_add(specs.iter().map(|s| s.size).sum(), Ordering::Relaxed);
    let ptrs: Vec<SendPtr> = bufs.iter_mut().map(|b| SendPtr(b.buf.as_mut_ptr())).collect();
    let slot = engine.path_slot(file.dev);
    let (tx, rx) = crossbeam_channel::unbounded::<Piece>();
    let window = (engine.config().queue_depth * 2).max(8);
    let mut submitted = 0usize;
    let mut completed = 0usize;
    let mut pieces: Vec<CrcPiece> = Vec::new();
    let verifier = |p: &Piece| -> Option<CrcPiece> {
        let b = &bufs[p.record];
        let lo = p.buf_off.max(b.start);
        let got = *p.got.as_ref().unwrap_or(&0);
        let hi = (p.buf_off + got).min(b.start + b.len);
        if lo >= hi {
            return None;
        }
        // SAFETY: `[lo, hi)` lies inside this record's buffer and its transfer
        // has completed; no request writes that range any more.
        let data = unsafe { std::slice::from_raw_parts(ptrs[p.record].0.add(lo).cast_const(), hi - lo) };
        let mut h = Hasher::new();
        h.update(data);
        Some(CrcPiece {
            record: p.record,
            offset: (lo - b.start) as u64,
            len: (hi - lo) as u64,
            hasher: h,
        })
    };
    let nverify = if verify { engine.config().cpu_threads.max(1) } else { 1 };
    std::thread::scope(|sc| -> Result<()> {
        // Helper verifiers (the driver below verifies too).
        let (vtx, vrx) = crossbeam_channel::unbounded::<Piece>();
        let helpers: Vec<_> = (1..nverify)
            .map(|_| {
                let vrx = vrx.clone();
                let verifier = &verifier;
                sc.spawn(move || vrx.iter().filter_map(|p| verifier(&p)).collect::<Vec<_>>())
            })
            .collect();
        drop(vrx);
        let handle = |p: Piece, pieces: &mut Vec<CrcPiece>| {
            let s = &specs[p.record];
            let b = &bufs[p.record];
            let need = (b.start + b.len).saturating_sub(p.buf_off).min(p.len);
            let got = match &p.got {
                Ok(n) => *n,
                Err(e) => {
                    st.fail(Error::io(
                        &file.path,
                        "read",
                        std::io::Error::new(e.kind(), format!("record '{}': {e}", s.name)),
                    ));
                    return;
                }
            };
            if got < need {
                st.fail(Error::truncated(
                    &file.path,
                    format!("record '{}' is cut short by the end of the file", s.name),
                ));
                return;
            }
            st.bytes_done.fetch_add(need as u64, Ordering::Relaxed);
            if verify && s.crc.is_some() {
                if nverify > 1 && vtx.len() < 4 {
                    let _ = vtx.send(p);
                } else if let Some(c) = verifier(&p) {
                    pieces.push(c);
                }
            }
        };
        while completed < work.len() {
            while submitted < work.len() && submitted - completed < window && !st.should_stop() {
                let (rec, off, len, foff) = work[submitted];
                let tx = tx.clone();
                let done = Box::new(move |got: std::io::Result<usize>| {
                    let _ = tx.send(Piece {
                        record: rec,
                        buf_off: off,
                        len,
                        got,
                    });
                });
                // SAFETY: the buffer range `[off, off + len)` belongs to this
                // record's buffer, which the task owns until every request has
                // completed (the loop below waits for all of them); the file
                // stays open through `file`.
                let req = unsafe {
                    Request::new(
                        Op::Read,
                        file.fd(),
                        ptrs[rec].0.add(off),
                        len,
                        foff,
                        class,
                        Arc::clone(&slot),
                        done,
                    )
                };
                engine.submit(req);
                submitted += 1;
            }
            if st.should_stop() && submitted == completed {
                break;
            }
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(p) => {
                    completed += 1;
                    if !st.should_stop() {
                        handle(p, &mut pieces);
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            }
        }
        drop(vtx);
        for h in helpers {
            pieces.extend(h.join().expect("verifier thread"));
        }
        Ok(())
    })?;
    st.outcome()?;
    if verify {
        check_crcs(file, specs, pieces)?;
    }
    Ok(bufs)
}

/// Finds the data offset of every entry by reading its local header (for
/// archives written by others; ours record offsets in the manifest). The reads
/// are spread over `threads` threads so that a cold file with thousands of
/// records does not pay one seek at a time.
pub fn resolve_data_offsets(file: &EngineFile, dir: &Directory, threads: usize) -> Result<Vec<u64>> {
    let src = FileSource::open(&file.path)?;
    let n = dir.entries.len();
    let next = AtomicUsize::new(0);
    let out: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
    let first_err: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = dir.entries.get(i) else { break };
                let len = zip::local_header_probe_len(e.name.len()).min(dir.cd_offset - e.header_offset);
                let mut buf = vec![0u8; len as usize];
                let r = src
                    .read_exact_at(&mut buf, e.header_offset)
                    .map_err(|err| Error::io(&file.path, "read", err))
                    .and_then(|()| zip::data_offset_from_local(&buf, e, dir, &file.path));
                match r {
                    Ok(off) => out[i].store(off, Ordering::Relaxed),
                    Err(err) => {
                        first_err.lock().expect("lock").get_or_insert(err);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().expect("lock") {
        return Err(e);
    }
    Ok(out.into_iter().map(AtomicU64::into_inner).collect())
}

fn check_crcs(file: &EngineFile, specs: &[ReadSpec], mut pieces: Vec<CrcPiece>) -> Result<()> {
    pieces.sort_by_key(|p| (p.record, p.offset));
    let mut hashers: Vec<Option<(Hasher, u64)>> = (0..specs.len()).map(|_| None).collect();
    for p in pieces {
        let slot = hashers[p.record].get_or_insert_with(|| (Hasher::new(), 0));
        debug_assert_eq!(slot.1, p.offset);
        slot.0.combine(&p.hasher);
        slot.1 += p.len;
    }
    for (i, s) in specs.iter().enumerate() {
        let Some(expected) = s.crc else { continue };
        let (actual, covered) = match hashers[i].take() {
            Some((h, n)) => (h.finalize(), n),
            None => (0, 0),
        };
        debug_assert!(s.size == 0 || covered == s.size);
        if actual != expected {
            return Err(Error::Checksum {
                path: file.path.clone(),
                record: s.name.clone(),
                expected,
                actual,
            });
        }
    }
    Ok(())
}
