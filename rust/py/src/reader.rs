//! Reading containers: the zip directory, small records, and record data
//! straight into aligned buffers.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::chunks;
use tierstore_core::file::EngineFile;
use tierstore_core::gather;
use tierstore_core::io::{Class, Op};
use tierstore_core::ranges;
use tierstore_core::reader::{self, ReadSpec};
use tierstore_core::task::{Task, TaskState};
use tierstore_core::zip::{self, Directory};

use crate::archive::{record, Record};
use crate::buffer::Buffer;
use crate::engine::PyEngine;
use crate::errors::IntoPy;
use crate::turns::PyDeviceTurns;
use crate::wait::wait_task;

fn to_specs(specs: Vec<(String, u64, u64, Option<u32>)>) -> Vec<ReadSpec> {
    specs
        .into_iter()
        .map(|(name, offset, size, crc)| ReadSpec {
            name,
            offset,
            size,
            crc,
        })
        .collect()
}

pub(crate) fn class_of(background: bool) -> Class {
    if background {
        Class::Background
    } else {
        Class::Foreground
    }
}

/// A Python binary file object seen as a random-access source: the `len`
/// bytes from `start` on, read with `seek` and `read` under the GIL (only
/// the zip structures go through here; the records' data is read by the
/// caller straight into tensor storage).
struct PyStream {
    f: Py<PyAny>,
    start: u64,
    len: u64,
}

impl zip::ReadAt for PyStream {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.len)
        {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Python::attach(|py| -> PyResult<std::io::Result<()>> {
            let f = self.f.bind(py);
            f.call_method1("seek", (self.start + offset,))?;
            let mut got = 0;
            while got < buf.len() {
                let chunk = f.call_method1("read", (buf.len() - got,))?;
                let chunk = chunk.cast::<PyBytes>()?;
                let b = chunk.as_bytes();
                if b.is_empty() {
                    return Ok(Err(std::io::ErrorKind::UnexpectedEof.into()));
                }
                let n = b.len().min(buf.len() - got);
                buf[got..got + n].copy_from_slice(&b[..n]);
                got += n;
            }
            Ok(Ok(()))
        })
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
    }
}

/// The zip directory of an archive that starts at offset `start` of the
/// binary file object `f`, of which `avail` bytes remain: more may follow
/// the archive in the stream, so its end is found from its start
/// ([`zip::archive_extent`]), or, where that finds none, taken to be the
/// stream's end.
/// Returns (records, central_directory_offset, archive_length, data offsets)
/// with offsets relative to `start`.
#[pyfunction]
fn read_directory_stream(
    py: Python<'_>,
    f: Py<PyAny>,
    start: u64,
    avail: u64,
    name: PathBuf,
) -> PyResult<(Vec<Record>, u64, u64, Vec<u64>)> {
    let src = PyStream {
        f,
        start,
        len: avail,
    };
    let len = zip::archive_extent(&src).unwrap_or(avail);
    let w = zip::Window { src: &src, len };
    let go = || -> tierstore_core::Result<(Directory, Vec<u64>)> {
        let dir = zip::read_directory(&w, &name)?;
        let offs = zip::data_offsets(&w, &dir, &name)?;
        Ok((dir, offs))
    };
    let (dir, offs) = go().py_err(py)?;
    let records = dir.entries.iter().map(record).collect();
    Ok((records, dir.cd_offset, dir.file_len, offs))
}

/// A read running in the background: its buffers exist at once (to build
/// tensors on), their contents are valid once `wait` returns.
#[pyclass(module = "tierstore._core")]
pub struct PendingRead {
    task: Option<Task<()>>,
    buffers: Vec<Py<Buffer>>,
}

#[pymethods]
impl PendingRead {
    /// One buffer per spec, in order. Do not read them before `wait` returns.
    #[getter]
    fn buffers(&self, py: Python<'_>) -> Vec<Py<Buffer>> {
        self.buffers.iter().map(|b| b.clone_ref(py)).collect()
    }

    /// Cancels the read and waits for the requests in flight (for error paths).
    fn abandon(&mut self, py: Python<'_>) {
        if let Some(t) = self.task.take() {
            t.cancel();
            let _ = py.detach(|| t.join());
        }
    }

    /// Waits for every byte and checksum; raises on damage or I/O errors.
    #[pyo3(signature = (progress=None))]
    fn wait(&mut self, py: Python<'_>, progress: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        match self.task.take() {
            Some(t) => wait_task(py, t, progress.as_ref()),
            None => Ok(()),
        }
    }
}

/// Starts reading records of `path` into new aligned buffers, one per spec
/// `(name, data_offset, size, crc32 or None)`, verifying CRCs if asked, and
/// returns at once with the buffers they will fill (valid once `wait`
/// returns; `wait(progress)` calls `progress(done, total)` while it waits).
#[pyfunction]
#[pyo3(signature = (engine, path, specs, *, verify=true, background=false))]
fn start_read(
    py: Python<'_>,
    engine: &PyEngine,
    path: PathBuf,
    specs: Vec<(String, u64, u64, Option<u32>)>,
    verify: bool,
    background: bool,
) -> PyResult<PendingRead> {
    let want_direct = engine.inner.mode().direct();
    let file = py
        .detach(|| EngineFile::open_read(&path, want_direct))
        .py_err(py)?;
    let specs = to_specs(specs);
    let e = &engine.inner;
    let plan = py
        .detach(|| reader::plan_read(e, &file, &specs))
        .py_err(py)?;
    let class = class_of(background);
    let task = reader::start_read(
        &engine.inner,
        Arc::new(file),
        specs,
        &plan,
        verify,
        class,
        TaskState::new(),
    )
    .py_err(py)?;
    let buffers = plan
        .records
        .into_iter()
        .map(|r| Py::new(py, Buffer::new(r)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PendingRead {
        task: Some(task),
        buffers,
    })
}

/// CRC-32 of each `(address, nbytes)` region, computed on `threads` threads
/// with the GIL released.
///
/// The caller must keep every region's memory alive and unchanged during the
/// call (Python passes `data_ptr()`s of storages it holds).
#[pyfunction]
#[pyo3(signature = (regions, threads=2))]
fn crc32_regions(py: Python<'_>, regions: Vec<(usize, usize)>, threads: usize) -> Vec<u32> {
    use tierstore_core::plan::{Plan, Source};
    py.detach(|| {
        let mut plan = Plan::new(4096).expect("valid alignment");
        for (i, &(addr, len)) in regions.iter().enumerate() {
            // SAFETY: the caller keeps the memory alive for this call.
            let src = unsafe { Source::mem(addr as *const u8, len) };
            plan.add(&format!("r{i}"), src).expect("valid name");
        }
        plan.compute_missing_crcs(threads);
        (0..regions.len())
            .map(|i| plan.crc(i).unwrap_or(0))
            .collect()
    })
}

/// CRC-32 of each `(address, nbytes)` region of file-mapped memory, each
/// window's pages brought in before it is summed (`tierstore_core::mapped`),
/// on `threads` threads with the GIL released.
///
/// Returns `(crcs, None)`, or `([], (region, errno))` for the first region
/// (in address order) whose pages could not be read: `EFAULT` where the file
/// ends before it, `EIO` where the device failed.
///
/// The caller must keep every region mapped and unchanged during the call.
#[pyfunction]
#[pyo3(signature = (regions, threads=2))]
fn crc32_mapped(
    py: Python<'_>,
    regions: Vec<(usize, usize)>,
    threads: usize,
) -> (Vec<u32>, Option<(usize, i32)>) {
    py.detach(|| {
        // SAFETY: the caller keeps the regions mapped for this call.
        match unsafe { tierstore_core::mapped::crc32_regions(&regions, threads) } {
            Ok(crcs) => (crcs, None),
            Err(e) => (
                Vec::new(),
                Some((e.region, e.error.raw_os_error().unwrap_or(libc::EIO))),
            ),
        }
    })
}

/// The CRC-32 of `a`'s bytes followed by `b`'s, from their CRCs and the
/// length of `b` (zlib's `crc32_combine`): a record checked in windows.
#[pyfunction]
fn crc32_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    tierstore_core::crc::combine(crc_a, crc_b, len_b)
}

/// Splits `n` 32-bit words at `src` into their rounded high halves at `hi`
/// and their low halves at `lo` (see `tierstore_core::halves`).
#[pyfunction]
#[pyo3(signature = (src, hi, lo, n, threads = 1))]
fn split_halves(
    py: Python<'_>,
    src: usize,
    hi: usize,
    lo: usize,
    n: usize,
    threads: usize,
) -> PyResult<()> {
    halves(py, src, hi, lo, n, threads, true)
}

/// Joins `n` halves at `hi` and `lo` (made by `split_halves`) into 32-bit
/// words at `out`.
#[pyfunction]
#[pyo3(signature = (hi, lo, out, n, threads = 1))]
fn join_halves(
    py: Python<'_>,
    hi: usize,
    lo: usize,
    out: usize,
    n: usize,
    threads: usize,
) -> PyResult<()> {
    halves(py, out, hi, lo, n, threads, false)
}

/// Splits the 32-bit words at `words` into halves at `hi` and `lo`
/// (`split`), or joins those halves back into `words`.
fn halves(
    py: Python<'_>,
    words: usize,
    hi: usize,
    lo: usize,
    n: usize,
    threads: usize,
    split: bool,
) -> PyResult<()> {
    if n == 0 {
        return Ok(());
    }
    check_words(&[(words, 4), (hi, 2), (lo, 2)])?;
    py.detach(|| {
        // SAFETY: the caller keeps `n` words at `words` and `n` halves at `hi`
        // and `lo` alive and unaliased for this call (the side written is
        // not read through any other slice); alignment is checked above.
        unsafe {
            if split {
                tierstore_core::halves::split(
                    std::slice::from_raw_parts(words as *const u32, n),
                    std::slice::from_raw_parts_mut(hi as *mut u16, n),
                    std::slice::from_raw_parts_mut(lo as *mut u16, n),
                    threads,
                );
            } else {
                tierstore_core::halves::join(
                    std::slice::from_raw_parts(hi as *const u16, n),
                    std::slice::from_raw_parts(lo as *const u16, n),
                    std::slice::from_raw_parts_mut(words as *mut u32, n),
                    threads,
                );
            }
        }
    });
    Ok(())
}

fn check_words(addrs: &[(usize, usize)]) -> PyResult<()> {
    for &(a, align) in addrs {
        if a == 0 || a % align != 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "address {a:#x} is null or not aligned to {align} bytes"
            )));
        }
    }
    Ok(())
}

/// Chunk checksums of each `(address, nbytes)` region, on the engine's CPU
/// threads with the GIL released: the little-endian 32-bit sums of every
/// region's chunks, one region after another, as one `bytes`.
///
/// The caller keeps every region's memory alive and unchanged during the call.
#[pyfunction]
#[pyo3(signature = (engine, regions, chunk, algo="crc32c"))]
fn chunk_checksums<'py>(
    py: Python<'py>,
    engine: &PyEngine,
    regions: Vec<(usize, usize)>,
    chunk: usize,
    algo: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let algo = parse_algo(algo)?;
    if chunk == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "chunk must be positive",
        ));
    }
    let threads = engine.inner.config().cpu_threads;
    let sums = py.detach(|| {
        let slices: Vec<&[u8]> = regions
            .iter()
            .map(|&(addr, len)| {
                if len == 0 {
                    &[][..]
                } else {
                    // SAFETY: the caller keeps the memory alive for this call.
                    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
                }
            })
            .collect();
        chunks::compute(&slices, chunk, algo, threads)
    });
    let mut out = Vec::with_capacity(sums.iter().map(|v| v.len() * 4).sum());
    for v in sums {
        for x in v {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    Ok(PyBytes::new(py, &out))
}

fn parse_algo(algo: &str) -> PyResult<chunks::Algo> {
    chunks::Algo::parse(algo).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!("unknown checksum {algo:?}"))
    })
}

/// One chunk table: (record name, data offset, size, chunk size, algorithm,
/// little-endian 32-bit sums).
type TableTuple = (String, u64, u64, u64, String, Vec<u8>);

/// Reads byte ranges of `path` into memory, as `transfer_ranges` does, and
/// verifies every chunk they touch against `tables` (`full`: every chunk of
/// every table). `table_ids[i]` is the table whose record holds range `i`.
/// Returns `(bytes read, bytes verified)`.
///
/// The caller keeps the destination memory alive and untouched during the
/// call, and the ranges must not overlap in memory.
#[pyfunction]
#[pyo3(signature = (engine, path, offsets, lengths, dests, table_ids, tables, *, full=false, background=false))]
#[allow(clippy::too_many_arguments)]
fn read_ranges_verified(
    py: Python<'_>,
    engine: &PyEngine,
    path: PathBuf,
    offsets: Vec<u64>,
    lengths: Vec<usize>,
    dests: Vec<usize>,
    table_ids: Vec<usize>,
    tables: Vec<TableTuple>,
    full: bool,
    background: bool,
) -> PyResult<(u64, u64)> {
    if offsets.len() != lengths.len()
        || offsets.len() != dests.len()
        || offsets.len() != table_ids.len()
    {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "offsets, lengths, addresses and table ids differ in length",
        ));
    }
    let tabs = chunk_tables(tables)?;
    let ranges: Vec<chunks::TableRange> = offsets
        .iter()
        .zip(&lengths)
        .zip(&dests)
        .zip(&table_ids)
        .map(|(((&offset, &len), &addr), &table)| chunks::TableRange {
            range: ranges::IoRange {
                offset,
                len,
                buf: addr as *mut u8,
            },
            table,
        })
        .collect();
    let e = &engine.inner;
    let coverage = if full {
        chunks::Coverage::Full
    } else {
        chunks::Coverage::Touched
    };
    let class = class_of(background);
    let v = py
        .detach(|| {
            let file = Arc::new(EngineFile::open_read(&path, false)?);
            // SAFETY: the caller's contract above (the Python side passes the
            // data pointers of tensors it holds for the duration of this call).
            unsafe { chunks::read_ranges_verified(e, &file, &ranges, &tabs, coverage, class) }
        })
        .py_err(py)?;
    Ok((v.read, v.checked))
}

/// Reads the runs of copy blocks from `path` into memory and verifies them
/// against `tables` (the chunk tables of the file's records): `blocks` holds
/// rows of little-endian 64-bit integers `[file offset, address, run bytes,
/// then per outer dimension count, file stride, memory stride]` with `dims`
/// outer dimensions per row (see `tierstore_core::gather`); `verify` is
/// `"touched"`, `"full"`, `"shared"` or `"none"`. The runs are expanded,
/// merged and read in Rust. Returns `(bytes read, bytes verified, bytes of
/// the 4 KiB blocks the runs touch, pieces, filled)`: with `"shared"`, the
/// spans of chunks read in part and left unchecked, as piece rows (see
/// [`piece_row`]), and the memory they filled, as rows of four
/// little-endian u64 `[chunk offset, offset, length, address]`; otherwise
/// both empty.
///
/// The caller keeps the destination memory alive and untouched during the
/// call, and the runs must not overlap in memory.
/// What [`read_blocks`] returns.
type BlocksResult<'py> = (u64, u64, u64, Bound<'py, PyBytes>, Bound<'py, PyBytes>);

#[pyfunction]
#[pyo3(signature = (engine, path, blocks, dims, tables, *, verify="touched", background=false))]
#[allow(clippy::too_many_arguments)]
fn read_blocks<'py>(
    py: Python<'py>,
    engine: &PyEngine,
    path: PathBuf,
    blocks: &[u8],
    dims: usize,
    tables: Vec<TableTuple>,
    verify: &str,
    background: bool,
) -> PyResult<BlocksResult<'py>> {
    let coverage = match verify {
        "touched" => chunks::Coverage::Touched,
        "full" => chunks::Coverage::Full,
        "shared" => chunks::Coverage::Shared,
        "none" => chunks::Coverage::None,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "verify must be 'touched', 'full', 'shared' or 'none', not {other:?}"
            )))
        }
    };
    let blocks = gather::decode(blocks, dims).py_err(py)?;
    let tabs = chunk_tables(tables)?;
    let e = &engine.inner;
    let class = class_of(background);
    let got = py
        .detach(|| {
            let file = Arc::new(EngineFile::open_read(&path, false)?);
            // SAFETY: the caller's contract above (the Python side passes the
            // data pointers of tensors it holds for the duration of this call).
            unsafe { gather::read_blocks(e, &file, &blocks, tabs, coverage, class) }
        })
        .py_err(py)?;
    let v = &got.verified;
    let mut pieces = Vec::with_capacity(v.pieces.len() * 32);
    for p in &v.pieces {
        for x in piece_row(p) {
            pieces.extend_from_slice(&x.to_le_bytes());
        }
    }
    let mut filled = Vec::with_capacity(v.filled.len() * 32);
    for f in &v.filled {
        for x in [f.chunk_offset, f.offset, f.len, f.mem as u64] {
            filled.extend_from_slice(&x.to_le_bytes());
        }
    }
    Ok((
        v.read,
        v.checked,
        got.blocks_4k,
        PyBytes::new(py, &pieces),
        PyBytes::new(py, &filled),
    ))
}

/// A piece as four little-endian u64 (32 bytes, what ranks exchange):
/// `[chunk offset, (offset in the chunk) << 32 | length, checksum << 32 |
/// expected checksum, key << 32 | algorithm (0 crc32, 1 crc32c) << 31 |
/// chunk length]`, where `key` names the file (chunks of different keys are
/// different chunks; [`read_blocks`] leaves it 0, the caller sets it). A Shared read returns
/// pieces of chunks under 2 GiB only, so every field fits.
fn piece_row(p: &chunks::Piece) -> [u64; 4] {
    let algo = u64::from(p.algo == chunks::Algo::Crc32c);
    [
        p.chunk_offset,
        (p.offset - p.chunk_offset) << 32 | p.len,
        u64::from(p.sum) << 32 | u64::from(p.expected),
        algo << 31 | p.chunk_len,
    ]
}

/// Which pieces the pieces of all readers prove (see
/// `tierstore_core::chunks::prove_pieces`): `rows` holds piece rows (see
/// [`piece_row`]) of any number of readers, with their keys set. Returns
/// one byte per row, 1 where the row's bytes are proven.
#[pyfunction]
fn prove_pieces<'py>(py: Python<'py>, rows: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    if rows.len() % 32 != 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{} bytes of pieces are not whole rows of 32 bytes",
            rows.len()
        )));
    }
    let mut pieces = Vec::with_capacity(rows.len() / 32);
    for r in rows.chunks_exact(32) {
        let w = |i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (at, span, sums, last) = (w(0), w(1), w(2), w(3));
        let algo = if last >> 31 & 1 == 1 {
            chunks::Algo::Crc32c
        } else {
            chunks::Algo::Crc32
        };
        pieces.push((
            last >> 32,
            chunks::Piece {
                chunk_offset: at,
                chunk_len: last & 0x7fff_ffff,
                offset: at.saturating_add(span >> 32),
                len: span & 0xffff_ffff,
                sum: (sums >> 32) as u32,
                expected: sums as u32,
                algo,
            },
        ));
    }
    let proven = py.detach(|| chunks::prove_pieces(&pieces));
    let out: Vec<u8> = proven.into_iter().map(u8::from).collect();
    Ok(PyBytes::new(py, &out))
}

/// Piece rows (see [`piece_row`], keys set) ordered by the reader of
/// `world` that proves each (`tierstore_core::chunks::piece_owner`), in
/// their order otherwise; with the number of rows for each reader.
#[pyfunction]
fn route_pieces<'py>(
    py: Python<'py>,
    rows: &[u8],
    world: u64,
) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>)> {
    if rows.len() % 32 != 0 || world == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{} bytes of pieces for {world} readers: not whole rows of 32 bytes, or no reader",
            rows.len()
        )));
    }
    let (out, counts) = py.detach(|| {
        let u64_at = |r: &[u8], i: usize| {
            u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
        };
        let owners: Vec<usize> = rows
            .chunks_exact(32)
            .map(|r| chunks::piece_owner(u64_at(r, 3) >> 32, u64_at(r, 0), world) as usize)
            .collect();
        let mut counts = vec![0usize; world as usize];
        for &o in &owners {
            counts[o] += 1;
        }
        let mut at: Vec<usize> = counts
            .iter()
            .scan(0, |sum, &c| {
                let start = *sum;
                *sum += c;
                Some(start * 32)
            })
            .collect();
        let mut out = vec![0u8; rows.len()];
        for (r, &o) in rows.chunks_exact(32).zip(&owners) {
            out[at[o]..at[o] + 32].copy_from_slice(r);
            at[o] += 32;
        }
        (out, counts)
    });
    Ok((PyBytes::new(py, &out), counts))
}

/// Chunk tables from their Python tuples.
fn chunk_tables(tables: Vec<TableTuple>) -> PyResult<Vec<chunks::ChunkTable>> {
    let mut tabs = Vec::with_capacity(tables.len());
    for (record, data_offset, size, chunk, algo, sums) in tables {
        if sums.len() % 4 != 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "record '{record}': chunk sums are not a whole number of 32-bit words"
            )));
        }
        tabs.push(chunks::ChunkTable {
            record,
            data_offset,
            size,
            chunk,
            algo: parse_algo(&algo)?,
            sums: sums
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        });
    }
    Ok(tabs)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(prove_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(route_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(split_halves, m)?)?;
    m.add_function(wrap_pyfunction!(join_halves, m)?)?;
    m.add_function(wrap_pyfunction!(read_directory_stream, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_regions, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_mapped, m)?)?;
    m.add_function(wrap_pyfunction!(crc32_combine, m)?)?;
    m.add_function(wrap_pyfunction!(start_read, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(read_ranges_verified, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_checksums, m)?)?;
    m.add_class::<PendingRead>()?;
    Ok(())
}

/// Checks that the three lists agree and builds the ranges; `file` falls back
/// to buffered I/O (reopened by `reopen`) when any offset, length or address
/// is not aligned for O_DIRECT.
fn build_ranges(
    py: Python<'_>,
    mut file: EngineFile,
    offsets: &[u64],
    lengths: &[usize],
    addrs: &[usize],
    reopen: impl FnOnce() -> tierstore_core::Result<EngineFile> + Send,
) -> PyResult<(EngineFile, Vec<ranges::IoRange>)> {
    if offsets.len() != lengths.len() || offsets.len() != addrs.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "offsets, lengths and addresses differ in length",
        ));
    }
    if file.direct {
        let a = file.align.max(1);
        let aligned = offsets.iter().all(|o| o % a == 0)
            && lengths.iter().all(|l| *l as u64 % a == 0)
            && addrs.iter().all(|d| *d as u64 % a == 0);
        if !aligned {
            file = py.detach(reopen).py_err(py)?;
        }
    }
    let ranges = offsets
        .iter()
        .zip(lengths)
        .zip(addrs)
        .map(|((&offset, &len), &addr)| ranges::IoRange {
            offset,
            len,
            buf: addr as *mut u8,
        })
        .collect();
    Ok((file, ranges))
}

/// Transfers byte ranges between `path` and memory, in place: range `i` is
/// `lengths[i]` bytes at file offset `offsets[i]` and address `addrs[i]`.
/// Reads (default) land straight in that memory; with `write`, the memory
/// is written to the file, which is created when missing and extended
/// (space reserved first) to `size` bytes when shorter, and nothing is
/// fsynced (scratch space, not a commit). `direct`: O_DIRECT when the engine
/// and the file system allow it and every offset, length and address is
/// aligned for it; else buffered. `turns` and `ticket`: the device turns the
/// transfer takes and its place in line (default: the device's, if it has
/// any, with a place taken now). `crc32` (reads): the CRC-32 the ranges
/// must have together, in order, checked by the engine as the chunks arrive;
/// a mismatch raises `ChecksumError` naming `record`. Returns the bytes
/// transferred.
///
/// The caller keeps the memory (tensors) alive during the call, untouched
/// by anything else, and the ranges must not overlap in memory.
#[pyfunction]
#[pyo3(signature = (engine, path, offsets, lengths, addrs, *, write=false, size=0, background=false, direct=false, turns=None, ticket=None, crc32=None, record=None))]
#[allow(clippy::too_many_arguments)]
pub fn transfer_ranges(
    py: Python<'_>,
    engine: &PyEngine,
    path: PathBuf,
    offsets: Vec<u64>,
    lengths: Vec<usize>,
    addrs: Vec<usize>,
    write: bool,
    size: u64,
    background: bool,
    direct: bool,
    turns: Option<PyRef<'_, PyDeviceTurns>>,
    ticket: Option<(u8, u64)>,
    crc32: Option<u32>,
    record: Option<String>,
) -> PyResult<u64> {
    let turn = turns.map(|t| t.ticketed(ticket, background)).transpose()?;
    let expect_crc = crc32.map(|c| (record.unwrap_or_else(|| "ranges".to_owned()), c));
    let want_direct = direct && engine.inner.mode().direct();
    let class = class_of(background);
    let (file, ranges) = if write {
        let end = offsets
            .iter()
            .zip(&lengths)
            .map(|(o, l)| o + *l as u64)
            .max()
            .unwrap_or(0);
        let size = size.max(end);
        let file = py
            .detach(|| EngineFile::open_write(&path, want_direct, size))
            .py_err(py)?;
        build_ranges(py, file, &offsets, &lengths, &addrs, || {
            EngineFile::open_write(&path, false, size)
        })?
    } else {
        let file = py
            .detach(|| EngineFile::open_read(&path, want_direct))
            .py_err(py)?;
        build_ranges(py, file, &offsets, &lengths, &addrs, || {
            EngineFile::open_read(&path, false)
        })?
    };
    // Many small reads: copy through a mapping instead of one request each.
    let small = !write
        && expect_crc.is_none()
        && !file.direct
        && !ranges.is_empty()
        && lengths.iter().sum::<usize>() / lengths.len() < MAPPED_BELOW;
    if small {
        let threads = engine.inner.config().cpu_threads;
        // SAFETY: as below; the copy finishes before this call returns.
        return py
            .detach(|| unsafe { ranges::copy_ranges_mapped(&file, &ranges, threads) })
            .py_err(py);
    }
    let op = if write { Op::Write } else { Op::Read };
    // SAFETY: the caller's contract above (the Python side passes the data
    // pointers of tensors it holds for the duration of this call).
    let task = unsafe {
        ranges::transfer_ranges(
            &engine.inner,
            Arc::new(file),
            ranges,
            op,
            class,
            TaskState::new(),
            turn,
            expect_crc,
        )
    }
    .py_err(py)?;
    wait_task(py, task, None)
}

/// Average range size under which `transfer_ranges` reads through a mapping.
const MAPPED_BELOW: usize = 64 << 10;
