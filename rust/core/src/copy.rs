//! Whole-file copies through the engine, for tier promotion (local disk to
//! remote storage) and for checkpointing offloaded state.
//!
//! The copy first asks the file system for a reflink (`FICLONE`: instant and
//! space-sharing on XFS, Btrfs, bcachefs); otherwise it moves the bytes in
//! pool-sized chunks, each read and then written by engine requests of the
//! caller's [`Class`], so a background promotion yields to foreground loads
//! and honours the background rate limit. The destination is written under a
//! temporary name and atomically renamed when complete (see [`AtomicFile`]).

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::bounded;

use crate::buf::{align_up, PooledBuf};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::file::{AtomicFile, EngineFile};
use crate::io::{Class, Op, Request};
use crate::task::{Task, TaskState};

/// How a copy was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyHow {
    /// The file system shared the extents (no bytes moved).
    Reflink,
    /// The bytes went through the engine.
    Engine,
}

impl CopyHow {
    pub fn as_str(self) -> &'static str {
        match self {
            CopyHow::Reflink => "reflink",
            CopyHow::Engine => "engine",
        }
    }
}

/// Concurrent chunks of one copy (each is a read followed by a write).
const COPY_STREAMS: usize = 4;

fn try_reflink(src: &EngineFile, dst: &AtomicFile) -> bool {
    // FICLONE = _IOW(0x94, 9, int)
    const FICLONE: libc::c_ulong = 0x4004_9409;
    // SAFETY: two valid descriptors; the ioctl takes the source fd by value.
    let rc = unsafe { libc::ioctl(dst.inner.fd(), FICLONE, src.file.as_raw_fd()) };
    rc == 0
}

/// Copies `src` to `dst` (replacing it atomically), returning the bytes copied
/// and how. `reflink` allows the extent-sharing shortcut.
pub fn copy_file(
    engine: &Arc<Engine>,
    src: &Path,
    dst: &Path,
    class: Class,
    durable: bool,
    reflink: bool,
    state: Arc<TaskState>,
) -> Result<Task<(u64, CopyHow)>> {
    let direct = engine.mode().direct();
    let input = Arc::new(EngineFile::open_read(src, direct)?);
    let out = Arc::new(AtomicFile::create(dst, direct)?);
    let len = input.len;
    state.bytes_total.store(len, Ordering::Relaxed);
    let engine = Arc::clone(engine);
    Task::spawn("tierstore-copy", state, move |st| {
        if reflink && try_reflink(&input, &out) {
            st.bytes_done.store(len, Ordering::Relaxed);
            let out = Arc::try_unwrap(out)
                .map_err(|_| Error::Invalid("copy: file still shared".into()))?;
            out.commit(durable)?;
            return Ok((len, CopyHow::Reflink));
        }
        out.reserve(len)?;
        let chunk = engine.pool().buf_size() as u64;
        let njobs = len.div_ceil(chunk) as usize;
        let next = AtomicUsize::new(0);
        let streams = COPY_STREAMS.min(njobs.max(1));
        std::thread::scope(|sc| {
            for _ in 0..streams {
                sc.spawn(|| {
                    while !st.should_stop() {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= njobs {
                            break;
                        }
                        let s = i as u64 * chunk;
                        let e = (s + chunk).min(len);
                        if let Err(err) = copy_chunk(&engine, &input, &out, s, e, class, &st) {
                            st.fail(err);
                        }
                    }
                });
            }
        });
        st.outcome()?;
        let out =
            Arc::try_unwrap(out).map_err(|_| Error::Invalid("copy: file still shared".into()))?;
        if out.inner.direct || len % out.inner.align.max(1) != 0 {
            out.set_len(len)?;
        }
        out.commit(durable)?;
        Ok((len, CopyHow::Engine))
    })
}

/// One request, waited for on this thread. Returns the bytes transferred.
#[allow(clippy::too_many_arguments)]
fn transfer(
    engine: &Engine,
    op: Op,
    fd: i32,
    path: &Path,
    buf: *mut u8,
    len: usize,
    offset: u64,
    class: Class,
    slot: Arc<crate::io::PathSlot>,
) -> Result<usize> {
    let (tx, rx) = bounded::<std::io::Result<usize>>(1);
    let done = Box::new(move |r: std::io::Result<usize>| {
        let _ = tx.send(r);
    });
    // SAFETY: the caller keeps `buf` (len bytes) and `fd` alive and
    // untouched until this function returns, which is after the callback.
    let req = unsafe { Request::new(op, fd, buf, len, offset, class, slot, done) };
    engine.submit(req);
    let what = if op == Op::Read { "read" } else { "write" };
    match rx.recv() {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(Error::io(path, what, e)),
        Err(_) => Err(Error::Invalid(format!(
            "{}: engine stopped during a copy",
            path.display()
        ))),
    }
}

fn acquire(engine: &Engine, st: &TaskState) -> Option<PooledBuf> {
    loop {
        if let Some(b) = engine.pool().acquire(Duration::from_millis(50)) {
            return Some(b);
        }
        if st.should_stop() {
            return None;
        }
    }
}

fn copy_chunk(
    engine: &Engine,
    input: &EngineFile,
    out: &AtomicFile,
    s: u64,
    e: u64,
    class: Class,
    st: &TaskState,
) -> Result<()> {
    let Some(mut buf) = acquire(engine, st) else {
        return Ok(());
    };
    let want = (e - s) as usize;
    let rlen = align_up(want as u64, input.align.max(1)) as usize;
    let ptr = buf.as_mut_ptr();
    let in_path: PathBuf = input.path.clone();
    let mut got = 0usize;
    // Short reads are resumed (buffered reads may return less than asked).
    while got < want {
        let n = transfer(
            engine,
            Op::Read,
            input.fd(),
            &in_path,
            // SAFETY: got < want <= rlen <= buffer capacity.
            unsafe { ptr.add(got) },
            rlen - got,
            s + got as u64,
            class,
            engine.path_slot(input.dev),
        )?;
        if n == 0 {
            return Err(Error::corrupt(
                &in_path,
                None,
                format!(
                    "file shrank during the copy: ended at {} of {}",
                    s + got as u64,
                    input.len
                ),
            ));
        }
        got += n;
        if input.align > 1 && got < want && got as u64 % input.align != 0 {
            return Err(Error::corrupt(&in_path, None, "unaligned short read"));
        }
    }
    let wlen = align_up(want as u64, out.inner.align.max(1)) as usize;
    if wlen > want {
        buf.as_mut_slice()[want..wlen].fill(0);
    }
    let n = transfer(
        engine,
        Op::Write,
        out.inner.fd(),
        out.final_path(),
        ptr,
        wlen,
        s,
        class,
        engine.path_slot(out.inner.dev),
    )?;
    if n != wlen {
        return Err(Error::io(
            out.final_path(),
            "write",
            std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("short write: {n} of {wlen} bytes"),
            ),
        ));
    }
    st.bytes_done.fetch_add(want as u64, Ordering::Relaxed);
    Ok(())
}
