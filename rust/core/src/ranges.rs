//! Byte ranges moved between a file and caller memory, in place: the
//! engine's one windowed submit/complete loop (`windowed`, which the
//! record reader uses too), range transfers in both directions with their
//! device turns and an optional CRC check as the chunks arrive
//! ([`transfer_ranges`]), and copies through a mapping for many small ranges
//! ([`copy_ranges_mapped`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crc32fast::Hasher;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::EngineFile;
use crate::io::turns::{DeviceTurns, Ticket};
use crate::io::{Callback, Class, Op, Request};
use crate::task::{Task, TaskState};

/// The one windowed submit/complete loop of the engine's transfers: keeps up
/// to `window` of the `n` requests in flight, never beyond `ready()` (the
/// requests whose memory is ready; `wait_ready(submitted)` waits a little for
/// more when nothing is in flight), builds request `i` with `make(i, done)`
/// and hands each completion to `complete(i, result)`. Stops submitting when
/// the task stops; returns once every submitted request has completed, so
/// that no request outlives the memory it names.
#[allow(clippy::too_many_arguments)]
pub(crate) fn windowed(
    engine: &Engine,
    st: &TaskState,
    n: usize,
    window: usize,
    ready: &dyn Fn() -> usize,
    wait_ready: &dyn Fn(usize),
    make: &mut dyn FnMut(usize, Callback) -> Request,
    complete: &mut dyn FnMut(usize, std::io::Result<usize>),
) {
    let (tx, rx) = crossbeam_channel::unbounded::<(usize, std::io::Result<usize>)>();
    let mut submitted = 0usize;
    let mut completed = 0usize;
    while completed < n {
        let avail = ready().min(n);
        if submitted == completed && submitted < n && submitted >= avail && !st.should_stop() {
            wait_ready(submitted);
            continue;
        }
        while submitted < avail && submitted - completed < window && !st.should_stop() {
            let tx = tx.clone();
            let i = submitted;
            let done: Callback = Box::new(move |got: std::io::Result<usize>| {
                let _ = tx.send((i, got));
            });
            engine.submit(make(i, done));
            submitted += 1;
        }
        if st.should_stop() && submitted == completed {
            break;
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((i, got)) => {
                completed += 1;
                complete(i, got);
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// Checks that every range lies inside `file`; returns their total length.
fn check_ranges(file: &EngineFile, ranges: &[IoRange]) -> Result<u64> {
    let mut total = 0u64;
    for r in ranges {
        if r.offset
            .checked_add(r.len as u64)
            .is_none_or(|e| e > file.len)
        {
            return Err(Error::truncated(
                &file.path,
                format!(
                    "range [{}, +{}) lies beyond the end of the file ({} bytes)",
                    r.offset, r.len, file.len
                ),
            ));
        }
        total += r.len as u64;
    }
    Ok(total)
}

/// One transfer of `len` bytes between file `offset` and caller memory at
/// `buf` (the destination of a read, the source of a write).
#[derive(Clone, Copy, Debug)]
pub struct IoRange {
    pub offset: u64,
    pub len: usize,
    pub buf: *mut u8,
}

// SAFETY: the contract of `transfer_ranges` makes the caller
// keep `buf` valid and unaliased until the task ends.
unsafe impl Send for IoRange {}
// SAFETY: shared access only reads the fields; each range's memory is
// accessed by exactly one request at a time.
unsafe impl Sync for IoRange {}

/// Turns at a device with the place in line a transfer took when it was
/// queued (see [`crate::io::turns`]).
pub struct Ticketed {
    pub turns: Arc<DeviceTurns>,
    pub ticket: Ticket,
}

/// The turns a transfer on `dev` takes: the given ones, else the device's
/// (if it has any) with a place in line taken now.
pub(crate) fn turns_for(
    engine: &Engine,
    dev: u64,
    class: Class,
    given: Option<Ticketed>,
) -> Option<Ticketed> {
    given.or_else(|| {
        engine.turns(dev).map(|turns| Ticketed {
            ticket: turns.ticket(class),
            turns,
        })
    })
}

/// Transfers byte ranges between `file` and caller memory, straight into
/// or out of it: reads (`Op::Read`: resharding loads, offloaded optimizer
/// state) or writes in place (`Op::Write`: a file opened with
/// [`EngineFile::open_write`], already long enough; nothing is synced: this
/// is scratch space, not a commit). Long ranges are split into chunks so that
/// many requests are in flight; the whole transfer is one turn at the device,
/// where it has turns (`turn`, or the device's with a place in line taken
/// now). With `expect_crc` (a record name and a CRC-32), a read is verified
/// as it completes: each chunk is checksummed on arrival, overlapped with the
/// chunks still in flight, and the ranges together, in order, must have that
/// CRC-32, else the task fails with a checksum error naming the record. The
/// task returns the number of bytes transferred.
///
/// # Safety
///
/// Every `buf` must be valid for `len` bytes (writable for reads, readable
/// for writes), the ranges must not overlap in memory, and nothing else may
/// access that memory (or, for writes, change it) until the task has ended
/// (joined or dropped).
#[allow(clippy::too_many_arguments)]
pub unsafe fn transfer_ranges(
    engine: &Arc<Engine>,
    file: Arc<EngineFile>,
    ranges: Vec<IoRange>,
    op: Op,
    class: Class,
    state: Arc<TaskState>,
    turn: Option<Ticketed>,
    expect_crc: Option<(String, u32)>,
) -> Result<Task<u64>> {
    check_ranges(&file, &ranges)?;
    let engine = Arc::clone(engine);
    let name = if op == Op::Read {
        "tierstore-ranges"
    } else {
        "tierstore-wranges"
    };
    Task::spawn(name, state, move |st| {
        let slot = engine.path_slot(file.dev);
        let window = (engine.config().queue_depth * 2).max(8);
        let chunk = engine.config().chunk_size;
        let mut work: Vec<IoRange> = Vec::with_capacity(ranges.len());
        for r in ranges {
            let mut o = 0;
            while o < r.len {
                let n = chunk.min(r.len - o);
                // SAFETY: within the caller's range (contract above).
                let buf = unsafe { r.buf.add(o) };
                work.push(IoRange {
                    offset: r.offset + o as u64,
                    len: n,
                    buf,
                });
                o += n;
            }
        }
        let total: u64 = work.iter().map(|r| r.len as u64).sum();
        st.bytes_total.fetch_add(total, Ordering::Relaxed);
        let turn = turns_for(&engine, file.dev, class, turn);
        let _turn = turn.as_ref().map(|t| t.turns.take(op, total, t.ticket));
        let n = work.len();
        let mut sums: Vec<Option<Hasher>> = vec![None; if expect_crc.is_some() { n } else { 0 }];
        windowed(
            &engine,
            &st,
            n,
            window,
            &|| n,
            &|_| {},
            &mut |i, done| {
                let r = work[i];
                // SAFETY: `buf` is valid for `len` bytes until the task ends
                // (contracts of the public functions), and `windowed` waits
                // for every submitted request before returning.
                unsafe {
                    Request::new(
                        op,
                        file.fd(),
                        r.buf,
                        r.len,
                        r.offset,
                        class,
                        Arc::clone(&slot),
                        done,
                    )
                }
            },
            &mut |i, got| match got {
                Ok(n) if n == work[i].len => {
                    st.bytes_done.fetch_add(n as u64, Ordering::Relaxed);
                    if expect_crc.is_some() && op == Op::Read {
                        let mut h = Hasher::new();
                        // SAFETY: chunk `i` has been read into the caller's
                        // memory (contract above) and no request writes it now.
                        h.update(unsafe {
                            std::slice::from_raw_parts(work[i].buf.cast_const(), n)
                        });
                        sums[i] = Some(h);
                    }
                }
                Ok(_) => st.fail(Error::truncated(
                    &file.path,
                    format!(
                        "range at offset {} is cut short by the end of the file",
                        work[i].offset
                    ),
                )),
                Err(e) => st.fail(Error::io(
                    &file.path,
                    if op == Op::Read { "read" } else { "write" },
                    e,
                )),
            },
        );
        st.outcome()?;
        if let Some((record, expected)) = expect_crc.filter(|_| op == Op::Read) {
            let mut all = Hasher::new();
            for h in sums.into_iter().flatten() {
                all.combine(&h);
            }
            let actual = all.finalize();
            if actual != expected {
                return Err(Error::Checksum {
                    path: file.path.clone(),
                    record,
                    expected,
                    actual,
                });
            }
        }
        Ok(total)
    })
}

/// Copies byte ranges of `file` into caller memory through a read-only
/// mapping, on `threads` threads: for many small ranges (a column shard of a
/// row-sharded tensor), a memory copy per range costs far less than an I/O
/// request per range. Page faults bring the data in through the page cache
/// (with the kernel's readahead). Returns the number of bytes copied.
///
/// # Safety
///
/// As for [`transfer_ranges`]: every `dest` valid for `len` bytes, no overlap,
/// no other access until the call returns.
pub unsafe fn copy_ranges_mapped(
    file: &EngineFile,
    ranges: &[IoRange],
    threads: usize,
) -> Result<u64> {
    let total = check_ranges(file, ranges)?;
    if ranges.is_empty() || file.len == 0 {
        return Ok(0);
    }
    let map = crate::chunks::Mapping::new(file)?;
    let per = ranges.len().div_ceil(threads.max(1));
    std::thread::scope(|sc| {
        for part in ranges.chunks(per) {
            let map = &map;
            sc.spawn(move || {
                for r in part {
                    let src = map.slice(r.offset, r.len as u64);
                    // SAFETY: the source is inside the mapping (checked above
                    // and by `slice`); the destination per this function's contract.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), r.buf, r.len) };
                }
            });
        }
    });
    Ok(total)
}

/// Sorts `v` by `key` unless it is in order already (the runs of a read
/// usually are: one block's runs, chunks met in file order), which costs one
/// pass instead of a sort. The sort is the standard library's stable one,
/// which finds runs already in order and merges them: a few sorted runs
/// one after another (e.g. the parts of chunks read in part, then whole
/// chunks checked with them) cost a merge, not a full sort.
pub(crate) fn sort_unless_sorted<T, K: Ord>(v: &mut [T], key: impl Fn(&T) -> K) {
    if !v.is_sorted_by_key(&key) {
        v.sort_by_key(key);
    }
}
