//! The `tsz1` record codec (`tierstore_core::codec`) for Python: encode and
//! decode between caller-owned memory, with the GIL released.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierstore_core::codec::{self, CodecError, Options, Transform};

/// What `codec_encode` returns: the encoded bytes, the transform, and the
/// chunk counts (raw, coded, dup, same, zero).
type EncodeResult = (
    Py<PyBytes>,
    &'static str,
    (usize, usize, usize, usize, usize),
);

/// A slice of `len` bytes at `addr` (None when `len` is 0).
///
/// # Safety
///
/// The caller keeps `len` bytes at `addr` alive and unchanged for the call.
unsafe fn slice<'a>(addr: usize, len: usize) -> PyResult<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if addr == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("null address"));
    }
    // SAFETY: per the function's contract.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
}

/// A writable slice of `len` bytes at `addr` (empty when `len` is 0).
///
/// # Safety
///
/// The caller keeps `len` bytes at `addr` alive for the call and writes
/// them only through the slice returned.
unsafe fn slice_mut<'a>(addr: usize, len: usize) -> PyResult<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if addr == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "null output address",
        ));
    }
    // SAFETY: per the function's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) })
}

/// A decode's reference (none where `ref_addr` is 0) and its output.
///
/// # Safety
///
/// As for `slice` (the reference) and `slice_mut` (the output).
unsafe fn decode_buffers<'a>(
    ref_addr: usize,
    ref_len: usize,
    out: usize,
    out_len: usize,
) -> PyResult<(Option<&'a [u8]>, &'a mut [u8])> {
    // SAFETY: per the function's contract.
    let reference = unsafe { slice(ref_addr, ref_len)? };
    // SAFETY: per the function's contract.
    let dst = unsafe { slice_mut(out, out_len)? };
    Ok(((ref_addr != 0).then_some(reference), dst))
}

fn to_pyerr(py: Python<'_>, e: CodecError, path: Option<&str>, record: Option<&str>) -> PyErr {
    let kind = match e {
        CodecError::Mismatch { .. } => "checksum",
        CodecError::Malformed(_) | CodecError::Reference(_) => "corrupt",
        CodecError::Invalid(_) => "invalid",
    };
    let mut msg = String::new();
    if let Some(p) = path {
        msg.push_str(p);
        msg.push_str(": ");
    }
    if let Some(r) = record {
        msg.push_str("record '");
        msg.push_str(r);
        msg.push_str("': ");
    }
    msg.push_str(&e.to_string());
    let made = py
        .import("tierstore.errors")
        .and_then(|m| m.getattr("_from_engine"))
        .and_then(|f| f.call1((kind, msg.clone(), path, record, None::<i32>)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(msg),
    }
}

/// Encodes `n` bytes at `src` (elements of `width` bytes), against the
/// reference at `ref_addr` (`ref_len` bytes; 0: none). Returns the encoded
/// bytes, the transform used and the chunk counts (raw, coded, dup, same,
/// zero).
#[pyfunction]
#[pyo3(signature = (src, n, width, ref_addr = 0, ref_len = 0, *, level = 1, chunk = 1_048_576, threads = 1, transform = None))]
#[allow(clippy::too_many_arguments)]
fn codec_encode(
    py: Python<'_>,
    src: usize,
    n: usize,
    width: usize,
    ref_addr: usize,
    ref_len: usize,
    level: i32,
    chunk: usize,
    threads: usize,
    transform: Option<&str>,
) -> PyResult<EncodeResult> {
    let transform = match transform {
        None => None,
        Some(t) => Some(Transform::from_name(t).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "unknown transform {t:?} (none, isub, xor, scaled)"
            ))
        })?),
    };
    // SAFETY: the caller keeps both buffers alive and unchanged for the call.
    let (data, reference) = unsafe { (slice(src, n)?, slice(ref_addr, ref_len)?) };
    let reference = (ref_addr != 0).then_some(reference);
    let opts = Options {
        level,
        chunk,
        threads,
        transform,
    };
    let enc = py
        .detach(|| codec::encode_parts(data, width, reference, &opts))
        .map_err(|e| to_pyerr(py, e, None, None))?;
    let s = &enc.stats;
    // The stream goes straight into the bytes object (one copy).
    let bytes = PyBytes::new_with(py, enc.len(), |buf| {
        enc.write_to(buf);
        Ok(())
    })?;
    Ok((
        bytes.unbind(),
        enc.transform.name(),
        (s.raw, s.coded, s.dup, s.same, s.zero),
    ))
}

/// Decodes the `n` encoded bytes at `src` into the `out_len` bytes at `out`,
/// with the reference at `ref_addr` where the encoding used one. Errors name
/// `path` and `record`.
#[pyfunction]
#[pyo3(signature = (src, n, out, out_len, ref_addr = 0, ref_len = 0, *, threads = 1, path = None, record = None))]
#[allow(clippy::too_many_arguments)]
fn codec_decode(
    py: Python<'_>,
    src: usize,
    n: usize,
    out: usize,
    out_len: usize,
    ref_addr: usize,
    ref_len: usize,
    threads: usize,
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<()> {
    // SAFETY: the caller keeps the buffers alive for the call; `out` is
    // written only through the slice made here.
    let (enc, (reference, dst)) = unsafe {
        (
            slice(src, n)?,
            decode_buffers(ref_addr, ref_len, out, out_len)?,
        )
    };
    py.detach(|| codec::decode(enc, reference, dst, threads))
        .map_err(|e| to_pyerr(py, e, path, record))
}

/// Decodes a chain of streams (`srcs`: (address, length) of each, the top
/// first, each encoded against the decoding of the next) into the `out_len`
/// bytes at `out`, chunk by chunk (`codec::decode_chain`). False, with
/// nothing written, where the chain cannot be decoded that way.
#[pyfunction]
#[pyo3(signature = (srcs, out, out_len, *, threads = 1, path = None, record = None))]
fn codec_decode_chain(
    py: Python<'_>,
    srcs: Vec<(usize, usize)>,
    out: usize,
    out_len: usize,
    threads: usize,
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<bool> {
    let mut encs: Vec<&[u8]> = Vec::with_capacity(srcs.len());
    for (addr, n) in srcs {
        // SAFETY: the caller keeps every stream alive and unchanged for the call.
        encs.push(unsafe { slice(addr, n)? });
    }
    // SAFETY: the caller keeps `out_len` bytes at `out` alive for the call,
    // written only through this slice.
    let dst = unsafe { slice_mut(out, out_len)? };
    py.detach(|| codec::decode_chain(&encs, dst, threads))
        .map_err(|e| to_pyerr(py, e, path, record))
}

/// Decodes chunks `first..last` of a chain (`codec::decode_chain_span`):
/// per level, its header and directory, its payload's length, a window of
/// its payload and where that window starts; into `out`, the address and
/// length of the decoded bytes' place. False, with nothing written, where
/// the chain cannot be decoded that way.
#[pyfunction]
#[pyo3(signature = (heads, payload_lens, windows, bases, first, last, out, *, threads = 1, path = None, record = None))]
#[allow(clippy::too_many_arguments)]
fn codec_decode_chain_span(
    py: Python<'_>,
    heads: Vec<Bound<'_, PyBytes>>,
    payload_lens: Vec<u64>,
    windows: Vec<Bound<'_, PyBytes>>,
    bases: Vec<u64>,
    first: usize,
    last: usize,
    out: (usize, usize),
    threads: usize,
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<bool> {
    let (out, out_len) = out;
    let hs: Vec<&[u8]> = heads.iter().map(PyBytesMethods::as_bytes).collect();
    let ws: Vec<&[u8]> = windows.iter().map(PyBytesMethods::as_bytes).collect();
    // SAFETY: the caller keeps `out_len` bytes at `out` alive for the call,
    // written only through this slice.
    let dst = unsafe { slice_mut(out, out_len)? };
    py.detach(|| {
        codec::decode_chain_span(&hs, &payload_lens, &ws, &bases, first, last, dst, threads)
    })
    .map_err(|e| to_pyerr(py, e, path, record))
}

/// The length of an encoded stream's header and directory, from its first
/// `CODEC_HEADER` bytes.
#[pyfunction]
#[pyo3(signature = (first, *, path = None, record = None))]
fn codec_directory_end(
    py: Python<'_>,
    first: &[u8],
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<usize> {
    codec::directory_end(first).map_err(|e| to_pyerr(py, e, path, record))
}

/// What a read of decoded bytes `[lo, hi)` of a stream needs decoded, from
/// its header and directory `head` (the payload of `payload_len` bytes
/// follows them): `(first chunk, end chunk, start byte, end byte, payload
/// from, payload to)`.
#[pyfunction]
#[pyo3(signature = (head, payload_len, lo, hi, *, path = None, record = None))]
fn codec_span(
    py: Python<'_>,
    head: &[u8],
    payload_len: u64,
    lo: u64,
    hi: u64,
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<(usize, usize, u64, u64, u64, u64)> {
    let s = codec::span(head, payload_len, lo, hi).map_err(|e| to_pyerr(py, e, path, record))?;
    Ok((s.first, s.last, s.start, s.end, s.payload_lo, s.payload_hi))
}

/// Decodes the span `sp` (from `codec_span`) of a stream into `out` (the
/// address and length of the decoded bytes' place), from `window` (its
/// payload bytes) and `reference` (the address and length of the
/// reference's bytes of the span, where the stream has one).
#[pyfunction]
#[pyo3(signature = (head, payload_len, sp, window, out, reference = None, *, threads = 1, path = None, record = None))]
#[allow(clippy::too_many_arguments)]
fn codec_decode_span(
    py: Python<'_>,
    head: &[u8],
    payload_len: u64,
    sp: (usize, usize, u64, u64, u64, u64),
    window: &[u8],
    out: (usize, usize),
    reference: Option<(usize, usize)>,
    threads: usize,
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<()> {
    let ((out, out_len), (ref_addr, ref_len)) = (out, reference.unwrap_or((0, 0)));
    let span = codec::Span {
        first: sp.0,
        last: sp.1,
        start: sp.2,
        end: sp.3,
        payload_lo: sp.4,
        payload_hi: sp.5,
    };
    // SAFETY: the caller keeps the buffers alive for the call; `out` is
    // written only through the slice made here.
    let (reference, dst) = unsafe { decode_buffers(ref_addr, ref_len, out, out_len)? };
    py.detach(|| codec::decode_span(head, payload_len, &span, window, reference, dst, threads))
        .map_err(|e| to_pyerr(py, e, path, record))
}

/// The header of an encoded stream and its chunk counts, as a dict.
#[pyfunction]
#[pyo3(signature = (data, *, path = None, record = None))]
fn codec_info<'py>(
    py: Python<'py>,
    data: &[u8],
    path: Option<&str>,
    record: Option<&str>,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let (h, s) = codec::stats(data).map_err(|e| to_pyerr(py, e, path, record))?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("width", h.width)?;
    d.set_item("transform", h.transform.name())?;
    d.set_item("predicted", h.predicted)?;
    if h.transform == Transform::Scaled {
        d.set_item("scale", f32::from_bits(h.scale))?;
    }
    d.set_item("chunk", h.chunk)?;
    d.set_item("chunks", h.count)?;
    d.set_item("decoded", h.decoded_len)?;
    d.set_item("raw", s.raw)?;
    d.set_item("coded", s.coded)?;
    d.set_item("dup", s.dup)?;
    d.set_item("same", s.same)?;
    d.set_item("zero", s.zero)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(codec_encode, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode, m)?)?;
    m.add_function(wrap_pyfunction!(codec_info, m)?)?;
    m.add_function(wrap_pyfunction!(codec_directory_end, m)?)?;
    m.add_function(wrap_pyfunction!(codec_span, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_chain, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_chain_span, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_span, m)?)?;
    m.add("CODEC_HEADER", codec::HEADER)?;
    m.add("CODEC_ENTRY", codec::ENTRY)?;
    Ok(())
}
