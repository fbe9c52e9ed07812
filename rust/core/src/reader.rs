//! Reading records straight into their final, aligned buffers.
//!
//! Each record gets its own buffer, sized and aligned so that the file range
//! `[align_down(offset), align_up(offset + size))` can be read with O_DIRECT;
//! the record's bytes sit at `start` inside it. Large records are read in
//! chunks, many in flight; CRCs are checked as chunks arrive, on `cpu_threads`
//! threads, so verification overlaps the I/O.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crc32fast::Hasher;

use crate::buf::{align_down, align_up, AlignedBuf};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::{EngineFile, FileSource};
use crate::io::{Class, Op, Request};
use crate::plan::CrcPiece;
use crate::ranges::{turns_for, windowed};
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

/// A record's bytes: `buf[start .. start + len]`. Small records that lie
/// close together in the file share one buffer (one read, one allocation);
/// the buffer lives until the last record using it is dropped.
pub struct RecordBuf {
    pub buf: Arc<AlignedBuf>,
    pub start: usize,
    pub len: usize,
}

impl RecordBuf {
    pub fn data(&self) -> &[u8] {
        &self.buf.as_slice()[self.start..self.start + self.len]
    }
}

/// Records up to this size may share a buffer with their neighbours.
const SMALL_RECORD: u64 = 1 << 20;
/// Largest gap (headers, padding, records not asked for) read over to keep a
/// group together.
const MAX_GAP: u64 = 64 << 10;

/// One buffer and the file range it mirrors.
#[derive(Clone)]
struct Arena {
    /// File offset of `buf[0]`.
    file_start: u64,
    cap: usize,
    /// (record index, offset in the buffer, length).
    records: Vec<(usize, usize, usize)>,
}

/// Groups records into arenas: small neighbours together, large ones alone.
fn plan_arenas(specs: &[ReadSpec], a: u64, max_span: u64) -> Vec<Arena> {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| specs[i].offset);
    let mut arenas: Vec<Arena> = Vec::new();
    let mut open: Option<(Arena, u64)> = None; // arena and the file end it covers
    let close = |arena: Arena, end: u64, arenas: &mut Vec<Arena>| {
        let mut arena = arena;
        arena.cap = (align_up(end, a) - arena.file_start) as usize;
        arenas.push(arena);
    };
    for i in order {
        let s = &specs[i];
        let (lo, hi) = (align_down(s.offset, a), s.offset + s.size);
        let small = s.size <= SMALL_RECORD;
        if let Some((mut arena, end)) = open.take() {
            let fits = small
                && lo <= end + MAX_GAP
                && lo >= arena.file_start
                && align_up(hi, a) - arena.file_start <= max_span;
            if fits {
                arena
                    .records
                    .push((i, (s.offset - arena.file_start) as usize, s.size as usize));
                open = Some((arena, end.max(hi)));
                continue;
            }
            close(arena, end, &mut arenas);
        }
        let arena = Arena {
            file_start: lo,
            cap: 0,
            records: vec![(i, (s.offset - lo) as usize, s.size as usize)],
        };
        if small {
            open = Some((arena, hi));
        } else {
            close(arena, hi, &mut arenas);
        }
    }
    if let Some((arena, end)) = open {
        close(arena, end, &mut arenas);
    }
    arenas
}

struct Piece {
    arena: usize,
    /// Offset of the piece inside the arena's buffer.
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

/// The buffers a read fills, allocated before it starts: `records[i]` is
/// where spec `i` will be. Callers may hand these out at once (to build
/// tensors while the data arrives) and must not read them before the read
/// task has finished successfully.
pub struct ReadPlan {
    arenas: Vec<Arena>,
    bufs: Vec<Arc<AlignedBuf>>,
    pub records: Vec<RecordBuf>,
}

fn check_bounds(file: &EngineFile, specs: &[ReadSpec]) -> Result<()> {
    for s in specs {
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
    Ok(())
}

/// Groups the records into buffers and allocates them.
pub fn plan_read(engine: &Engine, file: &EngineFile, specs: &[ReadSpec]) -> Result<ReadPlan> {
    check_bounds(file, specs)?;
    let a = file.align.max(512);
    let arenas = plan_arenas(specs, a, engine.config().chunk_size as u64);
    let mut bufs = Vec::with_capacity(arenas.len());
    for ar in &arenas {
        let buf =
            AlignedBuf::with_pages(ar.cap, BUF_ALIGN, engine.huge_pages()).ok_or_else(|| {
                Error::Invalid(format!(
                    "cannot allocate {} bytes for record '{}' of {}",
                    ar.cap,
                    specs[ar.records[0].0].name,
                    file.path.display()
                ))
            })?;
        bufs.push(Arc::new(buf));
    }
    let mut records: Vec<Option<RecordBuf>> = (0..specs.len()).map(|_| None).collect();
    for (ai, ar) in arenas.iter().enumerate() {
        for &(rec, start, len) in &ar.records {
            records[rec] = Some(RecordBuf {
                buf: Arc::clone(&bufs[ai]),
                start,
                len,
            });
        }
    }
    let records = records
        .into_iter()
        .map(|r| r.expect("every record is in one arena"))
        .collect();
    Ok(ReadPlan {
        arenas,
        bufs,
        records,
    })
}

/// Reads `specs` from `file`. The task returns one buffer per spec, in order.
pub fn read_records(
    engine: &Arc<Engine>,
    file: Arc<EngineFile>,
    specs: Vec<ReadSpec>,
    verify: bool,
    class: Class,
    state: Arc<TaskState>,
) -> Result<Task<Vec<RecordBuf>>> {
    let plan = plan_read(engine, &file, &specs)?;
    let engine = Arc::clone(engine);
    Task::spawn("tierstore-load", state, move |st| {
        run(&engine, &file, &specs, &plan, verify, class, &st)?;
        Ok(plan.records)
    })
}

/// Starts filling a plan's buffers; the task ends when every byte is in and,
/// with `verify`, every CRC has been checked.
pub fn start_read(
    engine: &Arc<Engine>,
    file: Arc<EngineFile>,
    specs: Vec<ReadSpec>,
    plan: &ReadPlan,
    verify: bool,
    class: Class,
    state: Arc<TaskState>,
) -> Result<Task<()>> {
    // The task keeps its own references to the buffers, so they outlive every
    // request even if the caller drops the plan's records meanwhile.
    let shadow = ReadPlan {
        arenas: plan.arenas.clone(),
        bufs: plan.bufs.clone(),
        records: Vec::new(),
    };
    let engine = Arc::clone(engine);
    Task::spawn("tierstore-load", state, move |st| {
        run(&engine, &file, &specs, &shadow, verify, class, &st)
    })
}

#[allow(clippy::too_many_lines)]
fn run(
    engine: &Arc<Engine>,
    file: &Arc<EngineFile>,
    specs: &[ReadSpec],
    plan: &ReadPlan,
    verify: bool,
    class: Class,
    st: &Arc<TaskState>,
) -> Result<()> {
    let chunk = engine.config().chunk_size;
    let arenas = &plan.arenas;
    let mut work: Vec<(usize, usize, usize, u64)> = Vec::new(); // arena, buf_off, len, file_off
    for (ai, ar) in arenas.iter().enumerate() {
        let mut o = 0;
        while o < ar.cap {
            let n = chunk.min(ar.cap - o);
            work.push((ai, o, n, ar.file_start + o as u64));
            o += n;
        }
    }
    let total: u64 = specs.iter().map(|s| s.size).sum();
    st.bytes_total.fetch_add(total, Ordering::Relaxed);
    let turn = turns_for(engine, file.dev, class, None);
    let _turn = turn
        .as_ref()
        .map(|t| t.turns.take(Op::Read, total, t.ticket));
    let ptrs: Vec<SendPtr> = plan.bufs.iter().map(|b| SendPtr(b.io_ptr())).collect();
    let slot = engine.path_slot(file.dev);
    let window = (engine.config().queue_depth * 2).max(8);
    let mut pieces: Vec<CrcPiece> = Vec::new();
    // CRC pieces of every record (with an expected CRC) overlapping a
    // completed transfer.
    let verifier = |p: &Piece| -> Vec<CrcPiece> {
        let got = *p.got.as_ref().unwrap_or(&0);
        let (plo, phi) = (p.buf_off, p.buf_off + got);
        let mut out = Vec::new();
        for &(rec, start, len) in &arenas[p.arena].records {
            if specs[rec].crc.is_none() {
                continue;
            }
            let (lo, hi) = (plo.max(start), phi.min(start + len));
            if lo >= hi {
                continue;
            }
            // SAFETY: `[lo, hi)` lies inside this arena's buffer and its
            // transfer has completed; no request writes that range any more.
            let data = unsafe {
                std::slice::from_raw_parts(ptrs[p.arena].0.add(lo).cast_const(), hi - lo)
            };
            let mut h = Hasher::new();
            h.update(data);
            out.push(CrcPiece {
                record: rec,
                offset: (lo - start) as u64,
                len: (hi - lo) as u64,
                hasher: h,
                chunks: Vec::new(),
            });
        }
        out
    };
    let nverify = if verify {
        engine.config().cpu_threads.max(1)
    } else {
        1
    };
    let populated = AtomicUsize::new(0);
    // The driver sleeps on this while nothing is in flight and nothing new is
    // populated (spinning there took a core from the populating helper and
    // from the caller's thread on small machines).
    let populate_signal = (std::sync::Mutex::new(()), std::sync::Condvar::new());
    let stop_populate = AtomicBool::new(false);
    let done: Vec<AtomicBool> = (0..work.len()).map(|_| AtomicBool::new(false)).collect();
    std::thread::scope(|sc| -> Result<()> {
        // Helper verifiers (the driver below verifies too).
        let (vtx, vrx) = crossbeam_channel::unbounded::<Piece>();
        let helpers: Vec<_> = (1..nverify)
            .map(|_| {
                let vrx = vrx.clone();
                let verifier = &verifier;
                sc.spawn(move || vrx.iter().flat_map(|p| verifier(&p)).collect::<Vec<_>>())
            })
            .collect();
        drop(vrx);
        // Fresh anonymous memory is zeroed by the kernel when first touched.
        // Left to the reads, that happens inside io_uring submission on the
        // I/O thread and serialises the whole load behind page zeroing;
        // helpers populate the buffers ahead of the reads instead (two where
        // the engine has two CPU threads: one zeroes about 2.5 GiB/s, less
        // than a fast disk reads), and the loop below submits only the
        // populated prefix of the work.
        let npop = engine.config().cpu_threads.clamp(1, 2);
        for h in 0..npop {
            let work = &work;
            let ptrs = &ptrs;
            let populated = &populated;
            let stop_populate = &stop_populate;
            let signal = &populate_signal;
            let done = &done;
            sc.spawn(move || {
                let publish = || {
                    // Advance the populated prefix over every finished item.
                    let mut p = populated.load(Ordering::Acquire);
                    while p < done.len() && done[p].load(Ordering::Acquire) {
                        match populated.compare_exchange(
                            p,
                            p + 1,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        ) {
                            Ok(_) => p += 1,
                            Err(now) => p = now,
                        }
                    }
                    // Taking the lock orders the store before a waiter's check.
                    drop(
                        signal
                            .0
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner),
                    );
                    signal.1.notify_one();
                };
                for i in (h..work.len()).step_by(npop) {
                    if stop_populate.load(Ordering::Relaxed) {
                        break;
                    }
                    let (ai, off, len, _) = work[i];
                    populate(ptrs[ai].0.wrapping_add(off), len);
                    done[i].store(true, Ordering::Release);
                    publish();
                }
            });
        }
        let handle = |p: Piece, pieces: &mut Vec<CrcPiece>| {
            let ar = &arenas[p.arena];
            // Bytes of this transfer that hold record data (the rest is gap).
            let need_end = ar.records.iter().map(|&(_, s, l)| s + l).max().unwrap_or(0);
            let need = need_end.saturating_sub(p.buf_off).min(p.len);
            let name = &specs[ar.records[0].0].name;
            let got = match &p.got {
                Ok(n) => *n,
                Err(e) => {
                    st.fail(Error::io(
                        &file.path,
                        "read",
                        std::io::Error::new(e.kind(), format!("record '{name}': {e}")),
                    ));
                    return;
                }
            };
            if got < need {
                let cut = ar
                    .records
                    .iter()
                    .find(|&&(_, s, l)| s + l > p.buf_off + got)
                    .map_or(name, |&(r, _, _)| &specs[r].name);
                st.fail(Error::truncated(
                    &file.path,
                    format!("record '{cut}' is cut short by the end of the file"),
                ));
                return;
            }
            let data: u64 = ar
                .records
                .iter()
                .map(|&(_, s, l)| {
                    (p.buf_off + got)
                        .min(s + l)
                        .saturating_sub(p.buf_off.max(s)) as u64
                })
                .sum();
            st.bytes_done.fetch_add(data, Ordering::Relaxed);
            if verify {
                if nverify > 1 && vtx.len() < 4 {
                    let _ = vtx.send(p);
                } else {
                    pieces.extend(verifier(&p));
                }
            }
        };
        let wait_populated = |submitted: usize| {
            // Nothing in flight and nothing populated yet: wait for the helper.
            let g = populate_signal
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if populated.load(Ordering::Acquire) <= submitted {
                let _ = populate_signal.1.wait_timeout(g, Duration::from_millis(2));
            }
        };
        windowed(
            engine,
            st,
            work.len(),
            window,
            &|| populated.load(Ordering::Acquire),
            &wait_populated,
            &mut |i, done| {
                let (ai, off, len, foff) = work[i];
                // SAFETY: `[off, off + len)` lies in this arena's buffer, which
                // the task owns until every request has completed (`windowed`
                // waits for all of them); `file` keeps the fd open.
                unsafe {
                    Request::new(
                        Op::Read,
                        file.fd(),
                        ptrs[ai].0.add(off),
                        len,
                        foff,
                        class,
                        Arc::clone(&slot),
                        done,
                    )
                }
            },
            &mut |i, got| {
                if !st.should_stop() {
                    let (arena, buf_off, len, _) = work[i];
                    let p = Piece {
                        arena,
                        buf_off,
                        len,
                        got,
                    };
                    handle(p, &mut pieces);
                }
            },
        );
        stop_populate.store(true, Ordering::Relaxed);
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
    Ok(())
}

/// Makes the kernel allocate (and zero) the pages of `[ptr, ptr + len)` now.
fn populate(ptr: *mut u8, len: usize) {
    const PAGE: usize = 4096;
    let start = (ptr as usize) & !(PAGE - 1);
    let end = (ptr as usize + len).div_ceil(PAGE) * PAGE;
    // SAFETY: the range lies in a buffer owned by the read task; MADV_POPULATE_WRITE
    // only faults pages in (it neither changes contents nor mappings).
    let rc = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if rc != 0 {
        // Older kernels: touch one byte per page. Writing zero over memory
        // that no read has reached yet is harmless (it is about to be filled).
        let mut p = ptr as usize;
        while p < ptr as usize + len {
            // SAFETY: inside the buffer, see above; volatile so it is not elided.
            unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
            p = (p & !(PAGE - 1)) + PAGE;
        }
    }
}

/// Finds the data offset of every entry by reading its local header (for
/// archives written by others; ours record offsets in the manifest). The reads
/// are spread over `threads` threads so that a cold file with thousands of
/// records does not pay one seek at a time.
pub fn resolve_data_offsets(
    src: &FileSource,
    path: &Path,
    dir: &Directory,
    threads: usize,
) -> Result<Vec<u64>> {
    let n = dir.entries.len();
    let next = AtomicUsize::new(0);
    let out: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
    let first_err: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = dir.entries.get(i) else { break };
                let len =
                    zip::local_header_probe_len(e.name.len()).min(dir.cd_offset - e.header_offset);
                let mut buf = vec![0u8; len as usize];
                let r = src
                    .read_exact_at(&mut buf, e.header_offset)
                    .map_err(|err| Error::io(path, "read", err))
                    .and_then(|()| zip::data_offset_from_local(&buf, e, dir, path));
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
