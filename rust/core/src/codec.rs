//! The record codec `tsz1`: lossless compression of one storage's bytes,
//! optionally as a difference against a reference (the same record of an
//! earlier checkpoint or of a base model).
//!
//! The data is cut into chunks of a fixed size (1 MiB by default, a multiple
//! of the element width), so that chunk *i* of a tensor lines up with chunk
//! *i* of its reference. Each chunk is, in order of preference:
//!
//! - `zero`: all zero bytes (no payload);
//! - `same`: byte for byte the reference's chunk *i* (no payload);
//! - `dup`: byte for byte an earlier chunk of this record (no payload);
//! - `coded`: optionally predicted from the reference chunk (`isub`: the
//!   integer difference of the elements' bit patterns, zigzag-encoded;
//!   `xor`: their exclusive or; `scaled`, for 4-byte elements: `isub`
//!   against the reference's element times a scale, for state that decays
//!   by a common factor between checkpoints, as Adam's moments of rows that
//!   saw no gradient do), split into byte planes (byte *k* of every
//!   element together: the exponent bytes of floats compress, the low
//!   mantissa bytes mostly do not), each plane zstd-coded or stored as it is
//!   where coding does not gain 2%;
//! - `raw`: the bytes as they are, where coding does not pay.
//!
//! Every chunk carries the xxh3-64 of its decoded bytes, checked on decode.
//! The transform is chosen per record by trial on a sample of its chunks;
//! the scale of `scaled` is the most common ratio of element to reference
//! element in the sample, where one ratio is common enough to be worth a
//! trial.
//!
//! ```text
//! header (32 bytes): "TSZ1", version u16 = 1, width u8, transform u8,
//!                    chunk size u32, chunk count u32, decoded length u64,
//!                    flags u32 (bit 0: predicted from a reference),
//!                    scale u32 (`scaled`: the scale's binary32 bits, else 0)
//! directory: one 32-byte entry per chunk:
//!                    kind u8, plane mask u8, 0 u16, arg u32 (dup: chunk),
//!                    payload offset u64, payload length u64, xxh3 u64
//! payload:  coded chunk = width x u32 plane lengths, then the planes
//! ```
//!
//! Integers are little-endian; payload offsets count from the end of the
//! directory. Nothing here allocates more than the decoded length the caller
//! provides room for, plus one chunk of scratch per thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_64;

use crate::planes::{self, Pred, Scale};

pub const MAGIC: &[u8; 4] = b"TSZ1";
pub const VERSION: u16 = 1;
pub const HEADER: usize = 32;
pub const ENTRY: usize = 32;
/// The chunk size by default: large enough for zstd to find its statistics,
/// small enough that a partial read decodes little it does not need.
pub const DEFAULT_CHUNK: usize = 1 << 20;
pub const MIN_CHUNK: usize = 4096;
pub const MAX_CHUNK: usize = 4 << 20;
/// A plane is coded only when coding saves at least 1/50 of it.
const PLANE_GAIN: usize = 50;
/// Bytes per sampled piece when choosing the transform.
const SAMPLE: usize = 64 << 10;
const SAMPLES: usize = 4;

const KIND_RAW: u8 = 0;
const KIND_CODED: u8 = 1;
const KIND_DUP: u8 = 2;
const KIND_SAME: u8 = 3;
const KIND_ZERO: u8 = 4;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The encoded bytes are not a well-formed `tsz1` stream.
    #[error("{0}")]
    Malformed(String),
    /// A chunk decoded to bytes other than those encoded.
    #[error(
        "chunk {chunk} (decoded bytes [{start}, {end})): decoded bytes do not match their checksum (stored xxh3 {expected:016x}, computed {actual:016x})"
    )]
    Mismatch {
        chunk: usize,
        start: u64,
        end: u64,
        expected: u64,
        actual: u64,
    },
    /// The reference is missing or has another length than the encoder's.
    #[error("{0}")]
    Reference(String),
    /// A caller passed arguments the codec cannot use.
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, CodecError>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transform {
    None = 0,
    Isub = 1,
    Xor = 2,
    /// `isub` against the reference times a scale (4-byte elements; the
    /// scale is in the header). Asked of the encoder, it means: estimate a
    /// scale, and use `isub` where none is found.
    Scaled = 3,
}

impl Transform {
    pub fn name(self) -> &'static str {
        match self {
            Transform::None => "none",
            Transform::Isub => "isub",
            Transform::Xor => "xor",
            Transform::Scaled => "scaled",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Transform::None),
            "isub" => Some(Transform::Isub),
            "xor" => Some(Transform::Xor),
            "scaled" => Some(Transform::Scaled),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Transform::None),
            1 => Some(Transform::Isub),
            2 => Some(Transform::Xor),
            3 => Some(Transform::Scaled),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    /// zstd level (1: fast; higher levels gain little on tensor bytes).
    pub level: i32,
    pub chunk: usize,
    pub threads: usize,
    /// None: chosen by trial on a sample.
    pub transform: Option<Transform>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            level: 1,
            chunk: DEFAULT_CHUNK,
            threads: 1,
            transform: None,
        }
    }
}

/// How many chunks went each way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub raw: usize,
    pub coded: usize,
    pub dup: usize,
    pub same: usize,
    pub zero: usize,
}

pub struct Encoded {
    pub bytes: Vec<u8>,
    pub transform: Transform,
    pub stats: Stats,
}

/// An encoding in pieces: the header and directory, then each chunk's
/// payload, so that a caller writes them straight into memory of its own
/// (one copy, no intermediate buffer of the whole stream).
pub struct EncodedParts {
    pub head: Vec<u8>,
    pub payloads: Vec<Vec<u8>>,
    pub transform: Transform,
    pub stats: Stats,
}

impl EncodedParts {
    pub fn len(&self) -> usize {
        self.head.len() + self.payloads.iter().map(Vec::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the stream into `out` (exactly [`EncodedParts::len`] bytes).
    pub fn write_to(&self, out: &mut [u8]) {
        let (h, mut rest) = out.split_at_mut(self.head.len());
        h.copy_from_slice(&self.head);
        for p in &self.payloads {
            let (a, b) = rest.split_at_mut(p.len());
            a.copy_from_slice(p);
            rest = b;
        }
    }
}

/// The header of an encoded stream, checked.
#[derive(Clone, Debug)]
pub struct Header {
    pub width: usize,
    pub transform: Transform,
    pub chunk: usize,
    pub count: usize,
    pub decoded_len: u64,
    pub predicted: bool,
    /// `scaled`: the scale's binary32 bits (checked: a positive normal
    /// number); else 0.
    pub scale: u32,
}

impl Header {
    /// How chunks that are predicted from their reference are predicted.
    fn pred(&self) -> Pred {
        if !self.predicted {
            return Pred::None;
        }
        pred_of(self.transform, self.scale)
    }
}

/// The predictor of `transform` (`scale`: binary32 bits, for `scaled`).
fn pred_of(transform: Transform, scale: u32) -> Pred {
    match transform {
        Transform::None => Pred::None,
        Transform::Isub => Pred::Isub,
        Transform::Xor => Pred::Xor,
        Transform::Scaled => Scale::from_bits(scale).map_or(Pred::Isub, Pred::Scaled),
    }
}

struct Entry {
    kind: u8,
    mask: u8,
    arg: u32,
    offset: u64,
    len: u64,
    hash: u64,
}

/// Encodes `data` (elements of `width` bytes) against `reference` (same
/// length) when given.
pub fn encode(
    data: &[u8],
    width: usize,
    reference: Option<&[u8]>,
    opts: &Options,
) -> Result<Encoded> {
    let parts = encode_parts(data, width, reference, opts)?;
    let mut bytes = vec![0u8; parts.len()];
    parts.write_to(&mut bytes);
    Ok(Encoded {
        bytes,
        transform: parts.transform,
        stats: parts.stats,
    })
}

/// [`encode`] in pieces (see [`EncodedParts`]).
pub fn encode_parts(
    data: &[u8],
    width: usize,
    reference: Option<&[u8]>,
    opts: &Options,
) -> Result<EncodedParts> {
    if !matches!(width, 1 | 2 | 4 | 8) || data.len() % width != 0 {
        return Err(CodecError::Invalid(format!(
            "element width {width} must be 1, 2, 4 or 8 and divide the length {}",
            data.len()
        )));
    }
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&opts.chunk) || opts.chunk % 8 != 0 {
        return Err(CodecError::Invalid(format!(
            "chunk size {} must be a multiple of 8 between {MIN_CHUNK} and {MAX_CHUNK}",
            opts.chunk
        )));
    }
    if let Some(r) = reference {
        if r.len() != data.len() {
            return Err(CodecError::Reference(format!(
                "the reference holds {} bytes, the data {}",
                r.len(),
                data.len()
            )));
        }
    }
    let chunk = opts.chunk;
    let count = data.len().div_ceil(chunk);
    let u32_count =
        u32::try_from(count).map_err(|_| CodecError::Invalid("too many chunks".into()))?;
    let (transform, scale) = match (reference, opts.transform) {
        (None, _) => (Transform::None, 0),
        (Some(r), Some(Transform::Scaled)) => match estimate_scale(data, r, width, chunk) {
            Some(sc) => (Transform::Scaled, sc.bits()),
            None => (Transform::Isub, 0),
        },
        (Some(_), Some(t)) => (t, 0),
        (Some(r), None) => choose_transform(data, r, width, chunk, opts.level),
    };
    let pred = pred_of(transform, scale);
    let span = |i: usize| (i * chunk, ((i + 1) * chunk).min(data.len()));
    // Hashes first (in parallel): duplicates are found in chunk order.
    let hashes = parallel_map(count, opts.threads, |i| {
        let (s, e) = span(i);
        xxh3_64(&data[s..e])
    });
    let dup_of = find_dups(data, &hashes, chunk);
    let level = opts.level;
    let parts: Vec<(Entry, Vec<u8>)> = parallel_map_state(
        count,
        opts.threads,
        || Scratch::new(chunk, level),
        |sc, i| {
            let (s, e) = span(i);
            encode_chunk(
                &data[s..e],
                reference.map(|r| &r[s..e]),
                hashes[i],
                dup_of[i],
                width,
                pred,
                sc,
            )
        },
    );
    let mut stats = Stats::default();
    let mut out = Vec::with_capacity(HEADER + ENTRY * count);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(width as u8);
    out.push(transform as u8);
    out.extend_from_slice(&(chunk as u32).to_le_bytes());
    out.extend_from_slice(&u32_count.to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    let predicted = reference.is_some() && transform != Transform::None;
    out.extend_from_slice(&u32::from(predicted).to_le_bytes());
    out.extend_from_slice(&scale.to_le_bytes());
    let mut at = 0u64;
    for (ent, p) in &parts {
        match ent.kind {
            KIND_RAW => stats.raw += 1,
            KIND_CODED => stats.coded += 1,
            KIND_DUP => stats.dup += 1,
            KIND_SAME => stats.same += 1,
            _ => stats.zero += 1,
        }
        out.push(ent.kind);
        out.push(ent.mask);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&ent.arg.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(&ent.hash.to_le_bytes());
        at += p.len() as u64;
    }
    Ok(EncodedParts {
        head: out,
        payloads: parts.into_iter().map(|(_, p)| p).collect(),
        transform,
        stats,
    })
}

/// For each chunk, the first earlier chunk with the same bytes (if any).
fn find_dups(data: &[u8], hashes: &[u64], chunk: usize) -> Vec<Option<u32>> {
    let span = |i: usize| (i * chunk, ((i + 1) * chunk).min(data.len()));
    let mut dup_of: Vec<Option<u32>> = vec![None; hashes.len()];
    let mut first: std::collections::HashMap<(u64, usize), usize> =
        std::collections::HashMap::new();
    for (i, &h) in hashes.iter().enumerate() {
        let (s, e) = span(i);
        match first.get(&(h, e - s)) {
            Some(&j) if data[span(j).0..span(j).1] == data[s..e] => dup_of[i] = Some(j as u32),
            Some(_) => {}
            None => {
                first.insert((h, e - s), i);
            }
        }
    }
    dup_of
}

/// One chunk's directory entry and payload (see the module's doc).
fn encode_chunk(
    d: &[u8],
    rchunk: Option<&[u8]>,
    hash: u64,
    dup_of: Option<u32>,
    width: usize,
    pred: Pred,
    sc: &mut Scratch,
) -> (Entry, Vec<u8>) {
    let mut ent = Entry {
        kind: KIND_RAW,
        mask: 0,
        arg: 0,
        offset: 0,
        len: 0,
        hash,
    };
    if is_zero(d) {
        ent.kind = KIND_ZERO;
        return (ent, Vec::new());
    }
    if rchunk == Some(d) {
        ent.kind = KIND_SAME;
        return (ent, Vec::new());
    }
    if let Some(j) = dup_of {
        ent.kind = KIND_DUP;
        ent.arg = j;
        return (ent, Vec::new());
    }
    sized(&mut sc.planes, d.len());
    let t = if rchunk.is_some() { pred } else { Pred::None };
    planes::predict_split(d, rchunk, width, t, &mut sc.planes);
    match code_planes(width, sc) {
        Some((mask, payload)) if payload.len() < d.len() => {
            ent.kind = KIND_CODED;
            ent.mask = mask;
            (ent, payload)
        }
        _ => (ent, d.to_vec()),
    }
}

/// Reads and checks the header of `enc`.
pub fn header(enc: &[u8]) -> Result<Header> {
    if enc.len() < HEADER || &enc[..4] != MAGIC {
        return Err(CodecError::Malformed(
            "not a tsz1 stream (bad magic or shorter than its header)".into(),
        ));
    }
    let version = u16::from_le_bytes([enc[4], enc[5]]);
    if version != VERSION {
        return Err(CodecError::Malformed(format!(
            "tsz1 version {version}: this tierstore reads version {VERSION} only"
        )));
    }
    let width = usize::from(enc[6]);
    let transform = Transform::from_u8(enc[7])
        .ok_or_else(|| CodecError::Malformed(format!("unknown transform {}", enc[7])))?;
    let chunk = u32::from_le_bytes(enc[8..12].try_into().expect("4 bytes")) as usize;
    let count = u32::from_le_bytes(enc[12..16].try_into().expect("4 bytes")) as usize;
    let decoded_len = u64::from_le_bytes(enc[16..24].try_into().expect("8 bytes"));
    let flags = u32::from_le_bytes(enc[24..28].try_into().expect("4 bytes"));
    if !matches!(width, 1 | 2 | 4 | 8) || decoded_len % width as u64 != 0 {
        return Err(CodecError::Malformed(format!(
            "element width {width} does not divide the decoded length {decoded_len}"
        )));
    }
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) || chunk % 8 != 0 {
        return Err(CodecError::Malformed(format!(
            "chunk size {chunk} out of range"
        )));
    }
    if decoded_len.div_ceil(chunk as u64) != count as u64 {
        return Err(CodecError::Malformed(format!(
            "{count} chunks of {chunk} bytes cannot hold {decoded_len} bytes"
        )));
    }
    if (enc.len() - HEADER) / ENTRY < count {
        return Err(CodecError::Malformed(format!(
            "the directory of {count} chunks runs past the end of the stream ({} bytes)",
            enc.len()
        )));
    }
    if flags & !1 != 0 {
        return Err(CodecError::Malformed(format!("unknown flags {flags:#x}")));
    }
    let scale = u32::from_le_bytes(enc[28..32].try_into().expect("4 bytes"));
    if transform == Transform::Scaled {
        if width != 4 || Scale::from_bits(scale).is_none() {
            return Err(CodecError::Malformed(format!(
                "transform scaled needs 4-byte elements and a positive normal scale (width {width}, scale bits {scale:#010x})"
            )));
        }
    } else if scale != 0 {
        return Err(CodecError::Malformed(format!(
            "a scale ({scale:#010x}) with transform {}",
            transform.name()
        )));
    }
    Ok(Header {
        width,
        transform,
        chunk,
        count,
        decoded_len,
        predicted: flags & 1 != 0,
        scale,
    })
}

/// Per-kind chunk counts of `enc` (for `tierstore inspect`).
pub fn stats(enc: &[u8]) -> Result<(Header, Stats)> {
    let h = header(enc)?;
    let mut s = Stats::default();
    for i in 0..h.count {
        match entry(enc, i).kind {
            KIND_RAW => s.raw += 1,
            KIND_CODED => s.coded += 1,
            KIND_DUP => s.dup += 1,
            KIND_SAME => s.same += 1,
            KIND_ZERO => s.zero += 1,
            k => {
                return Err(CodecError::Malformed(format!(
                    "chunk {i}: unknown kind {k}"
                )))
            }
        }
    }
    Ok((h, s))
}

fn entry(enc: &[u8], i: usize) -> Entry {
    let b = &enc[HEADER + i * ENTRY..HEADER + (i + 1) * ENTRY];
    Entry {
        kind: b[0],
        mask: b[1],
        arg: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
        offset: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        len: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        hash: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
    }
}

/// Decodes `enc` into `out` (exactly the decoded length), with the
/// reference it was encoded against where it used one.
pub fn decode(enc: &[u8], reference: Option<&[u8]>, out: &mut [u8], threads: usize) -> Result<()> {
    let h = header(enc)?;
    if out.len() as u64 != h.decoded_len {
        return Err(CodecError::Malformed(format!(
            "the stream decodes to {} bytes, {} expected",
            h.decoded_len,
            out.len()
        )));
    }
    let head = HEADER + h.count * ENTRY;
    let sp = Span {
        first: 0,
        last: h.count,
        start: 0,
        end: h.decoded_len,
        payload_lo: 0,
        payload_hi: (enc.len() - head) as u64,
    };
    decode_span(
        &enc[..head],
        (enc.len() - head) as u64,
        &sp,
        &enc[head..],
        reference,
        out,
        threads,
    )
}

/// The streams of a chain ([`decode_chain`]), level 0 the top.
struct Levels<'a> {
    heads: &'a [Header],
    entries: &'a [Vec<Entry>],
    /// Each level's payload bytes from `bases[k]` on (a window of it).
    payloads: &'a [&'a [u8]],
    bases: &'a [u64],
}

impl Levels<'_> {
    fn needs_ref(&self, k: usize, e: &Entry) -> bool {
        e.kind == KIND_SAME || (e.kind == KIND_CODED && self.heads[k].predicted)
    }

    /// Decodes chunk `i` (decoded bytes from `s`) of the top into `dst`,
    /// with the reference chunks it needs decoded into `scratch`, level by
    /// level from the deepest one needed.
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        i: usize,
        s: usize,
        dst: &mut [u8],
        scratch: &mut [Vec<u8>],
        planes: &mut Vec<u8>,
        mut dctx: Option<&mut zstd::bulk::Decompressor<'static>>,
    ) -> Result<()> {
        let last = self.entries.len() - 1;
        let en = s + dst.len();
        let mut depth = 0;
        while depth < last && self.needs_ref(depth, &self.entries[depth][i]) {
            depth += 1;
        }
        for k in (0..=depth).rev() {
            let e = &self.entries[k][i];
            let from = (e.offset - self.bases[k]) as usize;
            let p = &self.payloads[k][from..from + e.len as usize];
            let h = &self.heads[k];
            let pred = h.pred();
            let (below, here) = scratch.split_at_mut(k + 1);
            let rchunk = if k < depth {
                Some(&here[0][..en - s])
            } else {
                None
            };
            let out: &mut [u8] = if k == 0 {
                &mut *dst
            } else {
                sized(&mut below[k], en - s);
                &mut below[k][..]
            };
            decode_chunk(
                e,
                p,
                rchunk,
                out,
                h.width,
                pred,
                planes,
                dctx.as_deref_mut(),
            )
            .and_then(|()| check(i, s, en, e.hash, out))
            .map_err(|err| {
                let err = in_chunk(i, s, en, err);
                if k == 0 {
                    err
                } else {
                    CodecError::Reference(format!("reference stream {k}: {err}"))
                }
            })?;
        }
        Ok(())
    }
}

/// Decodes a chain of streams into `out`: `encs[0]` was encoded against
/// the decoding of `encs[1]`, that one against `encs[2]`'s, and so on; the
/// last needs no reference. Chunk by chunk: each reference chunk a chunk
/// needs is decoded into per-thread scratch (it stays in cache and is never
/// stored whole), and every decoded chunk's checksum is checked at every
/// level. Returns `Ok(false)`, having written nothing, where the chain
/// cannot be decoded this way (a reference stream that copies its own
/// chunks, or streams of other lengths or chunk sizes): decode the
/// references whole instead.
pub fn decode_chain(encs: &[&[u8]], out: &mut [u8], threads: usize) -> Result<bool> {
    let mut heads: Vec<&[u8]> = Vec::with_capacity(encs.len());
    let mut windows: Vec<&[u8]> = Vec::with_capacity(encs.len());
    for e in encs {
        let h = header(e)?;
        let (head, payload) = e.split_at(HEADER + h.count * ENTRY);
        heads.push(head);
        windows.push(payload);
    }
    let lens: Vec<u64> = windows.iter().map(|w| w.len() as u64).collect();
    let bases = vec![0u64; encs.len()];
    let count = match heads.first() {
        Some(h) => header(h)?.count,
        None => return Err(CodecError::Invalid("an empty chain".into())),
    };
    decode_chain_span(&heads, &lens, &windows, &bases, 0, count, out, threads)
}

/// [`decode_chain`] of chunks `first..last` only (decoded bytes `[first *
/// chunk, min(last * chunk, length))` into `out`), from each level's header
/// and directory `heads[k]` (its payload `payload_lens[k]` bytes long) and
/// a window of its payload, `windows[k]`, which starts at payload offset
/// `bases[k]` and must hold every one of those chunks' payloads. A copy of
/// a chunk before `first` at the top is refused (widen the span first).
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
pub fn decode_chain_span(
    heads: &[&[u8]],
    payload_lens: &[u64],
    windows: &[&[u8]],
    bases: &[u64],
    first: usize,
    last: usize,
    out: &mut [u8],
    threads: usize,
) -> Result<bool> {
    let n = heads.len();
    if n == 0 || payload_lens.len() != n || windows.len() != n || bases.len() != n {
        return Err(CodecError::Invalid("a chain's levels do not match".into()));
    }
    let hs: Vec<Header> = heads.iter().map(|e| header(e)).collect::<Result<_>>()?;
    let h0 = &hs[0];
    let chunk = h0.chunk;
    let total = usize::try_from(h0.decoded_len)
        .map_err(|_| CodecError::Invalid("a stream longer than memory".into()))?;
    if first > last || last > h0.count {
        return Err(CodecError::Invalid(format!(
            "chunks {first}..{last} of a stream of {}",
            h0.count
        )));
    }
    let start = first * chunk;
    let end = (last * chunk).min(total).max(start);
    if out.len() != end - start {
        return Err(CodecError::Malformed(format!(
            "chunks {first}..{last} decode to {} bytes, {} expected",
            end - start,
            out.len()
        )));
    }
    let mut entries: Vec<Vec<Entry>> = Vec::with_capacity(n);
    for (k, (e, h)) in heads.iter().zip(&hs).enumerate() {
        let dir: Vec<Entry> = (0..h.count).map(|i| entry(e, i)).collect();
        check_entries(&dir, h, payload_lens[k], h.decoded_len)?;
        if h.decoded_len != h0.decoded_len
            || h.chunk != h0.chunk
            || (k > 0 && dir.iter().any(|x| x.kind == KIND_DUP))
        {
            return Ok(false);
        }
        for x in &dir[first..last] {
            if x.len > 0
                && (x.offset < bases[k] || x.offset + x.len > bases[k] + windows[k].len() as u64)
            {
                return Err(CodecError::Invalid(format!(
                    "level {k}: a chunk's payload [{}, +{}) lies outside the window read [{}, +{})",
                    x.offset,
                    x.len,
                    bases[k],
                    windows[k].len()
                )));
            }
        }
        if k == 0
            && dir[first..last]
                .iter()
                .any(|x| x.kind == KIND_DUP && (x.arg as usize) < first)
        {
            return Err(CodecError::Invalid(
                "a copied chunk's source lies before the span".into(),
            ));
        }
        entries.push(dir);
    }
    let bottom = n - 1;
    let needs_ref =
        |k: usize, e: &Entry| e.kind == KIND_SAME || (e.kind == KIND_CODED && hs[k].predicted);
    if entries[bottom][first..last]
        .iter()
        .any(|e| needs_ref(bottom, e))
    {
        return Err(CodecError::Reference(
            "the last stream of a chain is a difference against a reference, and none was given"
                .into(),
        ));
    }
    // Chunk i's decoded bytes, absolute.
    let span = |i: usize| (i * chunk, ((i + 1) * chunk).min(total));
    let first_err: Mutex<Option<(usize, CodecError)>> = Mutex::new(None);
    let base = SendPtr(out.as_mut_ptr());
    let next = AtomicUsize::new(first);
    let nthreads = threads.clamp(1, (last - first).max(1));
    let levels = Levels {
        heads: &hs,
        entries: &entries,
        payloads: windows,
        bases,
    };
    std::thread::scope(|sc| {
        for _ in 0..nthreads {
            sc.spawn(|| {
                let mut planes: Vec<u8> = Vec::new();
                let mut scratch: Vec<Vec<u8>> = vec![Vec::new(); n];
                let mut dctx = zstd::bulk::Decompressor::new().ok();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= last {
                        break;
                    }
                    if entries[0][i].kind == KIND_DUP {
                        continue; // after every other chunk
                    }
                    let (s, en) = span(i);
                    // SAFETY: chunks are disjoint ranges of `out`, each
                    // written by one thread only; `out` outlives the scope.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(base.get().add(s - start), en - s)
                    };
                    let r = levels.chunk(i, s, dst, &mut scratch, &mut planes, dctx.as_mut());
                    if let Err(err) = r {
                        let mut f = first_err.lock().expect("lock");
                        if f.as_ref().is_none_or(|(j, _)| i < *j) {
                            *f = Some((i, err));
                        }
                    }
                }
            });
        }
    });
    if let Some((_, e)) = first_err.into_inner().expect("lock") {
        return Err(e);
    }
    copy_dups(&entries[0], first, last, chunk, total, start, out)?;
    Ok(true)
}

/// The copies among chunks `first..last` (of `chunk` bytes; the stream
/// decodes to `total`), made after every other chunk: each from its source
/// in `out`, which holds decoded bytes from `start` on, then checked.
fn copy_dups(
    entries: &[Entry],
    first: usize,
    last: usize,
    chunk: usize,
    total: usize,
    start: usize,
    out: &mut [u8],
) -> Result<()> {
    let span = |i: usize| (i * chunk, ((i + 1) * chunk).min(total));
    for (k, e) in entries[first..last].iter().enumerate() {
        let i = first + k;
        if e.kind == KIND_DUP {
            let (s, en) = span(i);
            let (js, je) = span(e.arg as usize);
            if je - js != en - s || js < start {
                return Err(CodecError::Malformed(format!(
                    "chunk {i}: a copy of chunk {} of another length",
                    e.arg
                )));
            }
            out.copy_within(js - start..je - start, s - start);
            check(i, s, en, e.hash, &out[s - start..en - start])?;
        }
    }
    Ok(())
}

/// The length of a stream's header and directory, from its first
/// [`HEADER`] bytes (what a reader of part of a stream reads first).
pub fn directory_end(first: &[u8]) -> Result<usize> {
    if first.len() < HEADER || &first[..4] != MAGIC {
        return Err(CodecError::Malformed(
            "not a tsz1 stream (bad magic or shorter than its header)".into(),
        ));
    }
    let count = u32::from_le_bytes(first[12..16].try_into().expect("4 bytes")) as usize;
    Ok(HEADER + count * ENTRY)
}

/// The chunks a read of decoded bytes `[lo, hi)` needs decoded: chunks
/// `first..last` (widened back to the source of any copy of an earlier
/// chunk among them), which decode to bytes `[start, end)`, from payload
/// bytes `[payload_lo, payload_hi)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub first: usize,
    pub last: usize,
    pub start: u64,
    pub end: u64,
    pub payload_lo: u64,
    pub payload_hi: u64,
}

/// The [`Span`] of chunks that decoded bytes `[lo, hi)` lie in. `head` is
/// the stream's header and directory ([`directory_end`] bytes) and
/// `payload_len` the length of the payload that follows them; the
/// directory is checked whole against it.
pub fn span(head: &[u8], payload_len: u64, lo: u64, hi: u64) -> Result<Span> {
    let h = header(head)?;
    let entries: Vec<Entry> = (0..h.count).map(|i| entry(head, i)).collect();
    check_entries(&entries, &h, payload_len, h.decoded_len)?;
    let (lo, hi) = (lo.min(h.decoded_len), hi.min(h.decoded_len));
    let chunk = h.chunk as u64;
    if lo >= hi {
        let at = (lo / chunk) as usize;
        return Ok(Span {
            first: at,
            last: at,
            start: at as u64 * chunk,
            end: at as u64 * chunk,
            payload_lo: 0,
            payload_hi: 0,
        });
    }
    let mut first = (lo / chunk) as usize;
    let last = hi.div_ceil(chunk) as usize;
    // A copy of an earlier chunk outside the span: decode from its source on
    // (sources are earlier; a stream's encoder makes copies of the first
    // occurrence only, so this rarely widens at all).
    loop {
        let src = entries[first..last]
            .iter()
            .filter(|e| e.kind == KIND_DUP)
            .map(|e| e.arg as usize)
            .min();
        match src {
            Some(j) if j < first => first = j,
            _ => break,
        }
    }
    let with_payload = entries[first..last].iter().filter(|e| e.len > 0);
    let payload_lo = with_payload.clone().map(|e| e.offset).min().unwrap_or(0);
    let payload_hi = with_payload.map(|e| e.offset + e.len).max().unwrap_or(0);
    Ok(Span {
        first,
        last,
        start: first as u64 * chunk,
        end: (last as u64 * chunk).min(h.decoded_len),
        payload_lo,
        payload_hi: payload_hi.max(payload_lo),
    })
}

/// Decodes the chunks of span `sp` (from [`span`]) into `out` (its `end -
/// start` bytes), from `window` (the payload bytes `[payload_lo,
/// payload_hi)`) and, where the stream was encoded against a reference, the
/// reference's bytes `[start, end)`. Every decoded chunk's checksum is
/// checked.
pub fn decode_span(
    head: &[u8],
    payload_len: u64,
    sp: &Span,
    window: &[u8],
    reference: Option<&[u8]>,
    out: &mut [u8],
    threads: usize,
) -> Result<()> {
    let h = header(head)?;
    let entries: Vec<Entry> = (0..h.count).map(|i| entry(head, i)).collect();
    check_entries(&entries, &h, payload_len, h.decoded_len)?;
    check_span(&h, &entries, sp, window.len(), out.len())?;
    let chunk = h.chunk as u64;
    let reference = span_reference(&h, &entries[sp.first..sp.last], reference, out.len())?;
    // Chunk i's decoded bytes, relative to `out`.
    let span_of = |i: usize| {
        let s = i as u64 * chunk - sp.start;
        let e = ((i as u64 + 1) * chunk).min(h.decoded_len) - sp.start;
        (s as usize, e as usize)
    };
    let first_err: Mutex<Option<(usize, CodecError)>> = Mutex::new(None);
    let base = SendPtr(out.as_mut_ptr());
    let width = h.width;
    let pred = h.pred();
    let next = AtomicUsize::new(sp.first);
    let n = sp.last - sp.first;
    let nthreads = threads.clamp(1, n.max(1));
    std::thread::scope(|sc| {
        for _ in 0..nthreads {
            sc.spawn(|| {
                let mut planes: Vec<u8> = Vec::new();
                let mut dctx = zstd::bulk::Decompressor::new().ok();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= sp.last {
                        break;
                    }
                    let e = &entries[i];
                    if e.kind == KIND_DUP {
                        continue; // after every other chunk
                    }
                    let (s, en) = span_of(i);
                    // SAFETY: chunks are disjoint ranges of `out`, each
                    // written by one thread only; `out` outlives the scope.
                    let dst = unsafe { std::slice::from_raw_parts_mut(base.get().add(s), en - s) };
                    let from = (e.offset.max(sp.payload_lo) - sp.payload_lo) as usize;
                    let p = &window[from..from + e.len as usize];
                    let at = (s as u64 + sp.start) as usize;
                    let r = decode_chunk(
                        e,
                        p,
                        reference.map(|r| &r[s..en]),
                        dst,
                        width,
                        pred,
                        &mut planes,
                        dctx.as_mut(),
                    )
                    .map_err(|err| in_chunk(i, at, at + en - s, err))
                    .and_then(|()| check(i, at, at + en - s, e.hash, dst));
                    if let Err(err) = r {
                        let mut f = first_err.lock().expect("lock");
                        if f.as_ref().is_none_or(|(j, _)| i < *j) {
                            *f = Some((i, err));
                        }
                    }
                }
            });
        }
    });
    if let Some((_, e)) = first_err.into_inner().expect("lock") {
        return Err(e);
    }
    copy_dups(
        &entries,
        sp.first,
        sp.last,
        h.chunk,
        h.decoded_len as usize,
        sp.start as usize,
        out,
    )
}

/// The reference a span is decoded with: refused where it is missing and
/// the span's `entries` need one, or has another length than the `out`
/// bytes decoded.
fn span_reference<'r>(
    h: &Header,
    entries: &[Entry],
    reference: Option<&'r [u8]>,
    out: usize,
) -> Result<Option<&'r [u8]>> {
    let needs_ref = h.predicted || entries.iter().any(|e| e.kind == KIND_SAME);
    Ok(match reference {
        Some(r) if r.len() == out => Some(r),
        Some(r) => {
            return Err(CodecError::Reference(format!(
                "the reference holds {} bytes, the data {}",
                r.len(),
                out
            )))
        }
        None if needs_ref => {
            return Err(CodecError::Reference(
                "the record is a difference against a reference, and none was given".into(),
            ))
        }
        None => None,
    })
}

/// That span `sp` fits the stream of header `h` and directory `entries`, a
/// payload window of `window` bytes and an output of `out` bytes.
fn check_span(h: &Header, entries: &[Entry], sp: &Span, window: usize, out: usize) -> Result<()> {
    let chunk = h.chunk as u64;
    let exact = sp.first <= sp.last
        && sp.last <= h.count
        && sp.start == sp.first as u64 * chunk
        && sp.end == (sp.last as u64 * chunk).min(h.decoded_len).max(sp.start)
        && sp.payload_lo <= sp.payload_hi
        && window as u64 == sp.payload_hi - sp.payload_lo;
    if !exact || out as u64 != sp.end - sp.start {
        return Err(CodecError::Invalid(format!(
            "span {sp:?} with a window of {window} bytes and {out} output bytes does not fit the stream"
        )));
    }
    for e in &entries[sp.first..sp.last] {
        if e.len > 0 && (e.offset < sp.payload_lo || e.offset + e.len > sp.payload_hi) {
            return Err(CodecError::Invalid(format!(
                "a chunk's payload [{}, +{}) lies outside the window read [{}, {})",
                e.offset, e.len, sp.payload_lo, sp.payload_hi
            )));
        }
        if e.kind == KIND_DUP && (e.arg as usize) < sp.first {
            return Err(CodecError::Invalid(
                "a copied chunk's source lies before the span".into(),
            ));
        }
    }
    Ok(())
}

/// The structural checks of a stream's directory, made before any decoding.
fn check_entries(entries: &[Entry], h: &Header, payload_len: u64, total: u64) -> Result<()> {
    let chunk = h.chunk as u64;
    let span = |i: usize| (i as u64 * chunk, ((i as u64 + 1) * chunk).min(total));
    for (i, e) in entries.iter().enumerate() {
        let end = e.offset.checked_add(e.len);
        if end.is_none_or(|x| x > payload_len) {
            return Err(CodecError::Malformed(format!(
                "chunk {i}: payload [{}, +{}) lies outside the stream's {} payload bytes",
                e.offset, e.len, payload_len
            )));
        }
        let (s, en) = span(i);
        let ok = match e.kind {
            KIND_RAW => e.len == en - s,
            KIND_CODED => e.len >= 4 * h.width as u64,
            KIND_DUP => (e.arg as usize) < i && e.len == 0,
            KIND_SAME | KIND_ZERO => e.len == 0,
            _ => false,
        };
        if !ok {
            return Err(CodecError::Malformed(format!(
                "chunk {i}: kind {} with payload length {} (argument {}) is not valid here",
                e.kind, e.len, e.arg
            )));
        }
    }
    Ok(())
}

/// `err` with the chunk it happened in.
fn in_chunk(i: usize, s: usize, e: usize, err: CodecError) -> CodecError {
    let at = format!("chunk {i} (decoded bytes [{s}, {e})): ");
    match err {
        CodecError::Malformed(m) => CodecError::Malformed(at + &m),
        CodecError::Reference(m) => CodecError::Reference(at + &m),
        other => other,
    }
}

fn check(i: usize, s: usize, e: usize, expected: u64, d: &[u8]) -> Result<()> {
    let actual = xxh3_64(d);
    if actual == expected {
        Ok(())
    } else {
        Err(CodecError::Mismatch {
            chunk: i,
            start: s as u64,
            end: e as u64,
            expected,
            actual,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn decode_chunk(
    e: &Entry,
    p: &[u8],
    rchunk: Option<&[u8]>,
    dst: &mut [u8],
    width: usize,
    pred: Pred,
    planes: &mut Vec<u8>,
    dctx: Option<&mut zstd::bulk::Decompressor<'static>>,
) -> Result<()> {
    match e.kind {
        KIND_ZERO => dst.fill(0),
        KIND_SAME => dst.copy_from_slice(rchunk.expect("checked: a reference is present")),
        KIND_RAW => dst.copy_from_slice(p),
        _ => {
            let n = dst.len() / width;
            let lens: Vec<usize> = (0..width)
                .map(|k| {
                    u32::from_le_bytes(p[4 * k..4 * k + 4].try_into().expect("4 bytes")) as usize
                })
                .collect();
            if lens.iter().sum::<usize>() != p.len() - 4 * width {
                return Err(CodecError::Malformed(
                    "plane lengths do not add up to the chunk's payload".into(),
                ));
            }
            sized(planes, dst.len());
            let dctx = dctx.ok_or_else(|| CodecError::Malformed("no zstd decoder".into()))?;
            // Coded planes are decoded into `planes`; stored ones are read
            // from the payload where they are.
            let mut at = 4 * width;
            let mut spans = [(0usize, 0usize); 8];
            for (k, &len) in lens.iter().enumerate() {
                let src = &p[at..at + len];
                if e.mask & (1 << k) != 0 {
                    let plane = &mut planes[k * n..(k + 1) * n];
                    let got = dctx
                        .decompress_to_buffer(src, plane)
                        .map_err(|err| CodecError::Malformed(format!("plane {k}: zstd: {err}")))?;
                    if got != n {
                        return Err(CodecError::Malformed(format!(
                            "plane {k}: decoded {got} bytes, {n} expected"
                        )));
                    }
                } else if len != n {
                    return Err(CodecError::Malformed(format!(
                        "plane {k}: stored plane of {len} bytes, {n} expected"
                    )));
                }
                spans[k] = (at, len);
                at += len;
            }
            let views: Vec<&[u8]> = (0..width)
                .map(|k| {
                    if e.mask & (1 << k) != 0 {
                        &planes[k * n..(k + 1) * n]
                    } else {
                        &p[spans[k].0..spans[k].0 + spans[k].1]
                    }
                })
                .collect();
            match (rchunk, pred) {
                (_, Pred::None) => planes::join_unpredict(&views, None, width, pred, dst),
                (Some(r), _) => planes::join_unpredict(&views, Some(r), width, pred, dst),
                (None, _) => {
                    return Err(CodecError::Reference(
                        "a predicted chunk without its reference".into(),
                    ))
                }
            }
        }
    }
    Ok(())
}

struct Scratch {
    planes: Vec<u8>,
    cctx: Option<zstd::bulk::Compressor<'static>>,
}

impl Scratch {
    fn new(chunk: usize, level: i32) -> Self {
        Scratch {
            planes: Vec::with_capacity(chunk),
            cctx: zstd::bulk::Compressor::new(level).ok(),
        }
    }
}

/// The free capacity of a vector from its length on, at most `room` bytes,
/// as a zstd output buffer: zstd writes the coded plane straight into the
/// chunk's payload (no copy), and fails where it would not fit in `room`.
struct Tail<'a> {
    v: &'a mut Vec<u8>,
    start: usize,
    room: usize,
}

// SAFETY: `as_mut_ptr`/`capacity` describe the vector's spare capacity from
// `start` (at most `room` bytes); `filled_until(n)` marks exactly the `n`
// bytes zstd reports written there as the vector's.
unsafe impl zstd::zstd_safe::WriteBuf for Tail<'_> {
    fn as_slice(&self) -> &[u8] {
        &self.v[self.start..]
    }
    fn capacity(&self) -> usize {
        (self.v.capacity() - self.start).min(self.room)
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `start` is the vector's length, inside its allocation.
        unsafe { self.v.as_mut_ptr().add(self.start) }
    }
    unsafe fn filled_until(&mut self, n: usize) {
        // SAFETY: zstd wrote `n` bytes from `start` (the trait's contract),
        // inside the capacity reported above.
        unsafe { self.v.set_len(self.start + n) };
    }
}

/// The size of `plane` under an ideal order-0 entropy coder (the Shannon
/// bound of its byte histogram), in bytes, estimated from a sample: every
/// fourth 4 KiB block of a plane over 64 KiB (a plane of the low mantissa
/// bytes of floats is uniform in any of its blocks).
fn order0_bytes(plane: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    const EVERY: usize = 4;
    // Four histograms: consecutive equal bytes do not wait on each other's
    // increments.
    let mut h = [[0u32; 256]; 4];
    let mut count = |bytes: &[u8]| {
        let mut quads = bytes.chunks_exact(4);
        for q in &mut quads {
            h[0][usize::from(q[0])] += 1;
            h[1][usize::from(q[1])] += 1;
            h[2][usize::from(q[2])] += 1;
            h[3][usize::from(q[3])] += 1;
        }
        for &b in quads.remainder() {
            h[0][usize::from(b)] += 1;
        }
    };
    let sampled = if plane.len() > 16 * BLOCK {
        let mut n = 0usize;
        for b in plane.chunks(BLOCK).step_by(EVERY) {
            count(b);
            n += b.len();
        }
        n
    } else {
        count(plane);
        plane.len()
    };
    let n = sampled as f64;
    let mut bits = 0.0f64;
    let (h0, h1, h2, h3) = (&h[0], &h[1], &h[2], &h[3]);
    for (((a, b), c), d) in h0.iter().zip(h1).zip(h2).zip(h3) {
        let c = f64::from(a + b + c + d);
        if c > 0.0 {
            bits -= c * (c / n).log2();
        }
    }
    (bits / 8.0 * plane.len() as f64 / n) as usize
}

/// `v` holding exactly `n` bytes whose values do not matter (they are
/// overwritten): no zero fill when it already has that length.
fn sized(v: &mut Vec<u8>, n: usize) {
    if v.len() != n {
        v.clear();
        v.resize(n, 0);
    }
}

/// The planes in `sc.planes` (`width` planes of equal length), each
/// zstd-coded where that gains, as a payload (plane lengths, then planes)
/// and the mask of coded planes.
fn code_planes(width: usize, sc: &mut Scratch) -> Option<(u8, Vec<u8>)> {
    let n = sc.planes.len() / width;
    let cctx = sc.cctx.as_mut()?;
    let room = n - n / PLANE_GAIN;
    // Room for every plane stored as it is: pages that zstd's smaller output
    // does not reach are never touched (and given back below).
    let mut payload: Vec<u8> = Vec::with_capacity(4 * width + sc.planes.len());
    payload.resize(4 * width, 0);
    let mut mask = 0u8;
    for k in 0..width {
        let plane = &sc.planes[k * n..(k + 1) * n];
        let start = payload.len();
        // A plane whose bytes are close to uniformly distributed (the low
        // mantissa bytes of floats, of their differences) cannot gain 2%
        // from an order-0 entropy coder and rarely has matches: it is
        // stored as it is without spending zstd's time on it.
        let coded = order0_bytes(plane) < room && {
            let mut tail = Tail {
                v: &mut payload,
                start,
                room,
            };
            // A plane that does not fit in `room` (does not gain 2%) is
            // stored as it is.
            matches!(cctx.compress_to_buffer(plane, &mut tail), Ok(m) if m < room)
        };
        if coded {
            mask |= 1 << k;
        } else {
            payload.truncate(start);
            payload.extend_from_slice(plane);
        }
        let len = (payload.len() - start) as u32;
        payload[4 * k..4 * k + 4].copy_from_slice(&len.to_le_bytes());
    }
    if payload.capacity() - payload.len() > 64 << 10 {
        payload.shrink_to_fit();
    }
    Some((mask, payload))
}

/// The byte ranges of `d` (of `len` bytes, in chunks of `chunk`) that the
/// transform is chosen on: the first `SAMPLE` bytes of up to `SAMPLES`
/// chunks spread over the record.
fn sample_pieces(len: usize, chunk: usize) -> Vec<(usize, usize)> {
    let count = len.div_ceil(chunk);
    let picks: Vec<usize> = if count <= SAMPLES {
        (0..count).collect()
    } else {
        (0..SAMPLES)
            .map(|k| k * (count - 1) / (SAMPLES - 1))
            .collect()
    };
    picks
        .into_iter()
        .map(|i| (i * chunk, (i * chunk + SAMPLE.min(chunk)).min(len)))
        .collect()
}

/// Every how many elements of the sample a ratio is taken for the scale.
const SCALE_STRIDE: usize = 16;

/// The scale of the `scaled` transform for `d` against `r` (4-byte
/// elements read as binary32), where the sample suggests one: the most
/// common ratio of element to reference element (both normal, of one sign,
/// not equal), binned to 2^-18 relative, where at least 1/32 of the ratios
/// (and 32 of them) fall in its bin; the median ratio of that bin. `None`
/// where no ratio is that common, or the common one is 1.
fn estimate_scale(d: &[u8], r: &[u8], width: usize, chunk: usize) -> Option<Scale> {
    if width != 4 {
        return None;
    }
    let word =
        |b: &[u8], i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let mut ratios: Vec<u32> = Vec::new();
    for (s, e) in sample_pieces(d.len(), chunk) {
        let (dp, rp) = (&d[s..e], &r[s..e]);
        for i in (0..dp.len() / 4).step_by(SCALE_STRIDE) {
            let (a, b) = (word(dp, i), word(rp, i));
            let (af, bf) = (f32::from_bits(a), f32::from_bits(b));
            if a == b || !af.is_normal() || !bf.is_normal() || (a ^ b) >> 31 != 0 {
                continue;
            }
            #[allow(clippy::cast_possible_truncation)]
            let q = (f64::from(af) / f64::from(bf)) as f32;
            if q.is_normal() {
                ratios.push(q.to_bits());
            }
        }
    }
    if ratios.len() < 64 {
        return None;
    }
    ratios.sort_unstable();
    let (mut best, mut at, mut i) = (0usize, 0usize, 0usize);
    while i < ratios.len() {
        let mut j = i + 1;
        while j < ratios.len() && ratios[j] >> 5 == ratios[i] >> 5 {
            j += 1;
        }
        if j - i > best {
            (best, at) = (j - i, i);
        }
        i = j;
    }
    if best < 32 || best * 32 < ratios.len() {
        return None;
    }
    let bits = ratios[at + best / 2];
    if bits == 1.0f32.to_bits() {
        return None;
    }
    Scale::from_bits(bits)
}

/// The transform (and for `scaled` its scale's bits) under which a sample
/// of `d` codes smallest against `r`.
fn choose_transform(
    d: &[u8],
    r: &[u8],
    width: usize,
    chunk: usize,
    level: i32,
) -> (Transform, u32) {
    let pieces = sample_pieces(d.len(), chunk);
    let mut sc = Scratch::new(SAMPLE, level);
    let mut candidates = vec![
        (Transform::Isub, Pred::Isub),
        (Transform::Xor, Pred::Xor),
        (Transform::None, Pred::None),
    ];
    if let Some(scale) = estimate_scale(d, r, width, chunk) {
        candidates.push((Transform::Scaled, Pred::Scaled(scale)));
    }
    let mut best = (usize::MAX, Transform::Isub, Pred::Isub);
    for (t, pred) in candidates {
        let mut size = 0usize;
        for &(s, e) in &pieces {
            let piece = &d[s..e];
            sized(&mut sc.planes, piece.len());
            planes::predict_split(piece, Some(&r[s..e]), width, pred, &mut sc.planes);
            size += code_planes(width, &mut sc).map_or(piece.len(), |(_, p)| p.len());
        }
        if size < best.0 {
            best = (size, t, pred);
        }
    }
    match best.2 {
        Pred::Scaled(scale) => (Transform::Scaled, scale.bits()),
        _ => (best.1, 0),
    }
}

fn is_zero(d: &[u8]) -> bool {
    let (pre, mid, post) = unsafe_align_u64(d);
    pre.iter().all(|&b| b == 0) && mid.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

fn unsafe_align_u64(d: &[u8]) -> (&[u8], &[u64], &[u8]) {
    // SAFETY: every bit pattern is a valid u64.
    unsafe { d.align_to::<u64>() }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer is only dereferenced for disjoint ranges (see `decode`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

fn parallel_map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    parallel_map_state(n, threads, || (), |(), i| f(i))
}

/// `f(state, i)` for every `i < n` on up to `threads` threads (each with its
/// own state from `init`), in order.
fn parallel_map_state<S, T: Send>(
    n: usize,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize) -> T + Sync,
) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let nthreads = threads.clamp(1, n.max(1));
    let mut got: Vec<(usize, T)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..nthreads)
            .map(|_| {
                sc.spawn(|| {
                    let mut st = init();
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        out.push((i, f(&mut st, i)));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().expect("codec thread"))
            .collect()
    });
    got.sort_unstable_by_key(|(i, _)| *i);
    got.into_iter().map(|(_, t)| t).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts(chunk: usize, t: Option<Transform>) -> Options {
        Options {
            level: 1,
            chunk,
            threads: 2,
            transform: t,
        }
    }

    fn roundtrip(d: &[u8], w: usize, r: Option<&[u8]>, o: &Options) -> Encoded {
        let enc = encode(d, w, r, o).expect("encode");
        let mut out = vec![0xAAu8; d.len()];
        decode(&enc.bytes, r, &mut out, 2).expect("decode");
        assert_eq!(out, d);
        enc
    }

    fn floats(n: usize, seed: u32) -> Vec<u8> {
        (0..n)
            .flat_map(|i| ((i as f32 * 0.001 + seed as f32).sin() * 0.02).to_le_bytes())
            .collect()
    }

    #[test]
    fn kinds_and_ratio() {
        let mut d = floats(300_000, 1);
        d.extend(vec![0u8; 8192]);
        let r: Vec<u8> = {
            let mut r = d.clone();
            for x in r.chunks_exact_mut(4).step_by(3) {
                x[0] ^= 1; // low mantissa bits move, as a step does
            }
            r
        };
        let o = opts(8192, None);
        let key = roundtrip(&d, 4, None, &o);
        let delta = roundtrip(&d, 4, Some(&r), &o);
        assert!(key.stats.zero >= 1);
        assert!(
            delta.bytes.len() < key.bytes.len() / 2,
            "{} vs {}",
            delta.bytes.len(),
            key.bytes.len()
        );
        assert_ne!(delta.transform, Transform::None);
        // Identical to its reference: nothing but the directory.
        let same = roundtrip(&d, 4, Some(&d), &o);
        assert_eq!(same.stats.same + same.stats.zero, d.len().div_ceil(8192));
    }

    /// A reference with special values among ordinary ones, and data that
    /// is the reference times `s` for most elements (Adam's moments of rows
    /// without a gradient), noise for the others.
    fn decayed(n: usize, s: f32, seed: u64) -> (Vec<u8>, Vec<u8>) {
        let mut x = seed | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let specials = [
            0u32,
            0x8000_0000,
            1,
            0x8000_0003,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_1234,
            0x7f7f_ffff,
        ];
        let mut r = Vec::with_capacity(4 * n);
        let mut d = Vec::with_capacity(4 * n);
        for i in 0..n {
            let rb = if i % 97 == 0 {
                specials[(i / 97) % specials.len()]
            } else {
                (((i as f32) * 0.37).sin() * 1e-3 + 2e-3).to_bits()
            };
            let db = if next() % 4 == 0 {
                next() as u32
            } else {
                (f32::from_bits(rb) * s).to_bits()
            };
            r.extend_from_slice(&rb.to_le_bytes());
            d.extend_from_slice(&db.to_le_bytes());
        }
        (d, r)
    }

    #[test]
    fn scaled_prediction_is_chosen_for_decay_and_roundtrips() {
        let s = 0.9f32.powi(10);
        let (d, r) = decayed(400_000, s, 3);
        let o = opts(1 << 20, None);
        let enc = roundtrip(&d, 4, Some(&r), &o);
        assert_eq!(enc.transform, Transform::Scaled);
        let h = header(&enc.bytes).unwrap();
        let got = f32::from_bits(h.scale);
        assert!((got / s - 1.0).abs() < 1e-5, "scale {got} for {s}");
        let isub = roundtrip(&d, 4, Some(&r), &opts(1 << 20, Some(Transform::Isub)));
        assert!(
            enc.bytes.len() * 10 < isub.bytes.len() * 9,
            "scaled {} vs isub {}",
            enc.bytes.len(),
            isub.bytes.len()
        );
        // Asked for, without a common factor: isub.
        let noise = floats(100_000, 9);
        let plain = roundtrip(
            &noise,
            4,
            Some(&floats(100_000, 8)),
            &opts(8192, Some(Transform::Scaled)),
        );
        assert_eq!(plain.transform, Transform::Isub);
        // Never for other widths.
        let two = roundtrip(&d, 2, Some(&r), &o);
        assert_ne!(two.transform, Transform::Scaled);
        // Through a partial decode and a chain too.
        let mut out = vec![0u8; d.len()];
        assert!(decode_chain(
            &[&enc.bytes, &encode(&r, 4, None, &o).unwrap().bytes],
            &mut out,
            2
        )
        .unwrap());
        assert_eq!(out, d);
    }

    #[test]
    fn a_scale_is_checked_in_the_header() {
        let (d, r) = decayed(50_000, 0.5, 4);
        let enc = encode(&d, 4, Some(&r), &opts(8192, None)).unwrap().bytes;
        assert_eq!(enc[7], Transform::Scaled as u8);
        let with = |at: usize, b: &[u8]| {
            let mut e = enc.clone();
            e[at..at + b.len()].copy_from_slice(b);
            e
        };
        for (bad, why) in [
            (with(28, &0u32.to_le_bytes()), "positive normal scale"),
            (
                with(28, &0x7fc0_0000u32.to_le_bytes()),
                "positive normal scale",
            ),
            (
                with(28, &(-0.5f32).to_bits().to_le_bytes()),
                "positive normal scale",
            ),
            (with(28, &1u32.to_le_bytes()), "positive normal scale"),
            (with(7, &[Transform::Isub as u8]), "a scale"),
        ] {
            let err = header(&bad).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
            let mut out = vec![0u8; d.len()];
            assert!(decode(&bad, Some(&r), &mut out, 2).is_err());
        }
        // A wrong scale that is well formed decodes to other bytes: refused
        // by the chunks' checksums.
        let other = with(28, &0.75f32.to_bits().to_le_bytes());
        let mut out = vec![0u8; d.len()];
        let err = decode(&other, Some(&r), &mut out, 2).unwrap_err();
        assert!(matches!(err, CodecError::Mismatch { .. }), "{err}");
    }

    #[test]
    fn never_grows_by_more_than_the_directory() {
        let mut x = 0x1234_5678_u64;
        let d: Vec<u8> = (0..1_000_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let e = roundtrip(&d, 1, None, &opts(1 << 20, None));
        assert!(e.bytes.len() <= d.len() + HEADER + ENTRY);
        assert_eq!(e.stats.raw, 1);
    }

    #[test]
    fn duplicates_and_damage() {
        let one = floats(4096, 3);
        let d: Vec<u8> = [one.clone(), one.clone(), one].concat();
        let e = roundtrip(&d, 4, None, &opts(16384, None));
        assert_eq!(e.stats.dup, 2);
        // A flipped payload byte is caught by the chunk's checksum or the coder.
        let mut bad = e.bytes.clone();
        let n = bad.len();
        bad[n - 10] ^= 0x40;
        let mut out = vec![0u8; d.len()];
        assert!(decode(&bad, None, &mut out, 1).is_err());
        // A directory naming a later chunk as the original is refused.
        let mut bad = e.bytes.clone();
        bad[HEADER + ENTRY + 4] = 2;
        assert!(matches!(
            decode(&bad, None, &mut out, 1),
            Err(CodecError::Malformed(_))
        ));
        // A truncated stream and a wrong length are refused, not read past.
        assert!(decode(&e.bytes[..40], None, &mut out, 1).is_err());
        let mut short = vec![0u8; d.len() - 4];
        assert!(decode(&e.bytes, None, &mut short, 1).is_err());
    }

    #[test]
    fn delta_needs_its_reference() {
        let d = floats(50_000, 5);
        let r = floats(50_000, 6);
        let e = encode(&d, 4, Some(&r), &opts(4096, Some(Transform::Isub))).unwrap();
        let mut out = vec![0u8; d.len()];
        assert!(matches!(
            decode(&e.bytes, None, &mut out, 1),
            Err(CodecError::Reference(_))
        ));
        let wrong = floats(50_000, 7);
        assert!(decode(&e.bytes, Some(&wrong), &mut out, 1).is_err());
    }

    /// Decodes decoded bytes `[lo, hi)` of `enc` the way a partial reader
    /// does: the directory first, then only the payload window of the span.
    fn decode_part(enc: &[u8], r: Option<&[u8]>, lo: u64, hi: u64) -> Result<(Span, Vec<u8>)> {
        let head_len = directory_end(&enc[..HEADER])?;
        if head_len > enc.len() {
            return Err(CodecError::Malformed(
                "a directory past the stream's end".into(),
            ));
        }
        let (head, payload) = enc.split_at(head_len);
        let sp = span(head, payload.len() as u64, lo, hi)?;
        let window = &payload[sp.payload_lo as usize..sp.payload_hi as usize];
        let mut out = vec![0u8; (sp.end - sp.start) as usize];
        let rs = r.map(|r| &r[sp.start as usize..sp.end as usize]);
        decode_span(head, payload.len() as u64, &sp, window, rs, &mut out, 2)?;
        Ok((sp, out))
    }

    #[test]
    fn a_span_decodes_only_its_chunks_and_equals_the_whole() {
        let chunk = 4096;
        let mut d = floats(10 * 1024 + 7, 1); // 11 chunks of 4 KiB, the last short
        let r = floats(10 * 1024 + 7, 2);
        // Chunk 7 copies chunk 2; chunk 5 equals the reference's; chunk 9 is zero.
        d.copy_within(2 * chunk..3 * chunk, 7 * chunk);
        d[5 * chunk..6 * chunk].copy_from_slice(&r[5 * chunk..6 * chunk]);
        d[9 * chunk..10 * chunk].fill(0);
        let enc = encode(&d, 4, Some(&r), &opts(chunk, Some(Transform::Isub))).unwrap();
        assert_eq!(enc.stats.dup, 1);
        let total = d.len() as u64;
        for (lo, hi) in [
            (0, total),
            (100, 200),
            (4096, 8192),
            (4095, 4097),
            (6 * 4096 + 5, 8 * 4096),
            (total - 1, total),
            (50, 50),
        ] {
            let (sp, out) = decode_part(&enc.bytes, Some(&r), lo, hi).unwrap();
            assert!(
                sp.start <= lo.min(hi) && sp.end >= hi.max(lo) || lo == hi,
                "{sp:?}"
            );
            assert_eq!(out, d[sp.start as usize..sp.end as usize], "[{lo}, {hi})");
        }
        // The copy of chunk 2 in chunk 7: a read of chunk 7 decodes from chunk 2 on.
        let (sp, _) = decode_part(&enc.bytes, Some(&r), 7 * 4096, 7 * 4096 + 1).unwrap();
        assert_eq!((sp.first, sp.last), (2, 8));
        // A read of one chunk reads one chunk's payload, not the stream's.
        let (sp, _) = decode_part(&enc.bytes, Some(&r), 3 * 4096, 3 * 4096 + 10).unwrap();
        assert_eq!((sp.first, sp.last), (3, 4));
        let payload_len = enc.bytes.len() - directory_end(&enc.bytes).unwrap();
        assert!(
            (sp.payload_hi - sp.payload_lo) * 5 < payload_len as u64,
            "{sp:?}"
        );
    }

    #[test]
    fn a_chain_decodes_chunk_by_chunk_as_the_references_whole_would() {
        let chunk = 4096;
        let n = 6 * 1024 + 3; // 7 chunks of 4 KiB, the last short
        let k = floats(n, 1);
        let mut mid = floats(n, 1);
        let mut top = floats(n, 1);
        for (i, (m, t)) in mid.iter_mut().zip(top.iter_mut()).enumerate() {
            if i % 7 == 0 {
                *m ^= 1;
            }
            if i % 5 == 0 {
                *t ^= 2;
            }
        }
        mid[chunk..2 * chunk].copy_from_slice(&k[chunk..2 * chunk]); // mid's chunk 1: same as the keyframe's
        top[2 * chunk..3 * chunk].copy_from_slice(&mid[2 * chunk..3 * chunk]); // top's chunk 2: same as mid's
        top.copy_within(3 * chunk..4 * chunk, 5 * chunk); // top's chunk 5 copies its chunk 3
        top[4 * chunk..5 * chunk].fill(0);
        let o = opts(chunk, Some(Transform::Isub));
        let ek = encode(&k, 4, None, &opts(chunk, None)).unwrap().bytes;
        let em = encode(&mid, 4, Some(&k), &o).unwrap().bytes;
        let et = encode(&top, 4, Some(&mid), &o).unwrap();
        assert!(
            et.stats.dup == 1 && et.stats.same == 1 && et.stats.zero == 1,
            "{:?}",
            et.stats
        );
        let mut out = vec![0u8; top.len()];
        assert!(decode_chain(&[&et.bytes, &em, &ek], &mut out, 2).unwrap());
        assert_eq!(out, top);
        // Two levels; a reference stream that copies its own chunks is
        // declined (decode it whole instead), and a chain whose last stream
        // needs a reference is refused.
        assert!(decode_chain(&[&em, &ek], &mut out, 1).unwrap());
        assert_eq!(out, mid);
        let mut kd = k.clone();
        kd.copy_within(0..chunk, 3 * chunk);
        let ekd = encode(&kd, 4, None, &opts(chunk, None)).unwrap().bytes;
        assert!(!decode_chain(&[&em, &ekd], &mut out, 1).unwrap());
        assert!(decode_chain(&[&et.bytes, &em], &mut out, 1).is_err());
        let short = encode(&k[..k.len() - 4], 4, None, &opts(chunk, None))
            .unwrap()
            .bytes;
        assert!(!decode_chain(&[&em, &short], &mut out, 1).unwrap());
        // Damage in the middle stream's payload of chunk 0 (which the top's
        // chunk 0 needs) is named as the reference's.
        let mut bad = em.clone();
        let at = directory_end(&bad).unwrap() + 40;
        bad[at] ^= 0x40;
        let e = decode_chain(&[&et.bytes, &bad, &ek], &mut out, 2).unwrap_err();
        assert!(e.to_string().contains("reference stream 1"), "{e}");
    }

    #[test]
    fn a_chain_decodes_a_span_from_payload_windows() {
        let chunk = 4096;
        let n = 6 * 1024 + 3;
        let k = floats(n, 5);
        let mid: Vec<u8> = k
            .iter()
            .enumerate()
            .map(|(i, &b)| if i % 9 == 0 { b ^ 1 } else { b })
            .collect();
        let top: Vec<u8> = mid
            .iter()
            .enumerate()
            .map(|(i, &b)| if i % 11 == 0 { b ^ 2 } else { b })
            .collect();
        let o = opts(chunk, Some(Transform::Isub));
        let ek = encode(&k, 4, None, &opts(chunk, None)).unwrap().bytes;
        let em = encode(&mid, 4, Some(&k), &o).unwrap().bytes;
        let et = encode(&top, 4, Some(&mid), &o).unwrap().bytes;
        let encs = [&et[..], &em[..], &ek[..]];
        // Each level: its directory, and only the payload of chunks 2..5.
        let (first, last) = (2usize, 5usize);
        let mut heads = Vec::new();
        let mut lens = Vec::new();
        let mut windows = Vec::new();
        let mut bases = Vec::new();
        for e in encs {
            let hl = directory_end(e).unwrap();
            let (head, payload) = e.split_at(hl);
            let sp = span(
                head,
                payload.len() as u64,
                (first * chunk) as u64,
                (last * chunk) as u64,
            )
            .unwrap();
            assert_eq!((sp.first, sp.last), (first, last));
            heads.push(head);
            lens.push(payload.len() as u64);
            windows.push(&payload[sp.payload_lo as usize..sp.payload_hi as usize]);
            bases.push(sp.payload_lo);
        }
        let mut out = vec![0u8; 3 * chunk];
        assert!(
            decode_chain_span(&heads, &lens, &windows, &bases, first, last, &mut out, 2).unwrap()
        );
        assert_eq!(out, top[2 * chunk..5 * chunk]);
        // A window that misses a chunk's payload is refused, not read past.
        let short = [windows[0], &windows[1][..windows[1].len() - 1], windows[2]];
        assert!(
            decode_chain_span(&heads, &lens, &short, &bases, first, last, &mut out, 2).is_err()
        );
        let mut small = vec![0u8; 2 * chunk];
        assert!(
            decode_chain_span(&heads, &lens, &windows, &bases, first, last, &mut small, 2).is_err()
        );
    }

    #[test]
    fn a_span_with_a_wrong_window_or_reference_is_refused() {
        let d = floats(4096, 3);
        let r = floats(4096, 4);
        let enc = encode(&d, 4, Some(&r), &opts(4096, Some(Transform::Isub)))
            .unwrap()
            .bytes;
        let head_len = directory_end(&enc).unwrap();
        let (head, payload) = enc.split_at(head_len);
        let pl = payload.len() as u64;
        let sp = span(head, pl, 4096, 8192).unwrap();
        let mut out = vec![0u8; (sp.end - sp.start) as usize];
        let rs = &r[sp.start as usize..sp.end as usize];
        let w = &payload[sp.payload_lo as usize..sp.payload_hi as usize];
        // A window one byte short, a span moved by one chunk, no reference.
        assert!(decode_span(head, pl, &sp, &w[1..], Some(rs), &mut out, 1).is_err());
        let moved = Span {
            first: sp.first + 1,
            last: sp.last + 1,
            ..sp
        };
        assert!(decode_span(head, pl, &moved, w, Some(rs), &mut out, 1).is_err());
        assert!(decode_span(head, pl, &sp, w, None, &mut out, 1).is_err());
        // A damaged payload byte: the chunk's checksum names it.
        let mut bad = w.to_vec();
        let k = bad.len() - 1;
        bad[k] ^= 1;
        let e = decode_span(head, pl, &sp, &bad, Some(rs), &mut out, 1).unwrap_err();
        assert!(
            matches!(
                e,
                CodecError::Mismatch { chunk: 1, .. } | CodecError::Malformed(_)
            ),
            "{e}"
        );
        decode_span(head, pl, &sp, w, Some(rs), &mut out, 1).unwrap();
        assert_eq!(out, d[4096..8192]);
        // A directory shorter than its header says.
        assert!(span(&head[..head_len - 1], pl, 0, 10).is_err());
        assert!(directory_end(&enc[..10]).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn roundtrips_any_bits(
            w in prop::sample::select(vec![1usize, 2, 4, 8]),
            n in 0usize..20_000,
            seed in any::<u64>(),
            t in prop::sample::select(vec![None, Some(Transform::Isub), Some(Transform::Xor), Some(Transform::None), Some(Transform::Scaled)]),
            with_ref in any::<bool>(),
        ) {
            let mut x = seed | 1;
            let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let len = n / w * w;
            // Mixed: special float patterns, runs, noise.
            let d: Vec<u8> = (0..len).map(|i| match (i / 4096) % 3 { 0 => 0, 1 => (next() % 4) as u8, _ => next() as u8 }).collect();
            let r: Vec<u8> = d.iter().map(|&b| if next() % 5 == 0 { b ^ (next() as u8) } else { b }).collect();
            let o = opts(4096, t);
            let enc = encode(&d, w, with_ref.then_some(&r[..]), &o).unwrap();
            prop_assert!(enc.bytes.len() <= d.len() + HEADER + ENTRY * d.len().div_ceil(4096));
            let mut out = vec![0x55u8; len];
            decode(&enc.bytes, with_ref.then_some(&r[..]), &mut out, 3).unwrap();
            prop_assert_eq!(out, d);
        }

        /// Data mostly a scaled copy of a reference of any bits (NaN
        /// payloads, infinities, subnormals, signed zeros among them), at
        /// any scale: decoded exactly, whichever transform is chosen.
        #[test]
        fn scaled_roundtrips_any_reference_bits(
            n in 1usize..30_000,
            seed in any::<u64>(),
            scale_bits in 0x0080_0000u32..0x7f80_0000,
            t in prop::sample::select(vec![None, Some(Transform::Scaled)]),
        ) {
            let mut x = seed | 1;
            let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let s = f32::from_bits(scale_bits);
            let r: Vec<u32> = (0..n).map(|_| next() as u32).collect();
            let d: Vec<u32> = r.iter().map(|&b| if next() % 3 == 0 { next() as u32 } else { (f32::from_bits(b) * s).to_bits() }).collect();
            let (d, r): (Vec<u8>, Vec<u8>) = (
                d.iter().flat_map(|v| v.to_le_bytes()).collect(),
                r.iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
            let enc = encode(&d, 4, Some(&r), &opts(4096, t)).unwrap();
            prop_assert!(enc.bytes.len() <= d.len() + HEADER + ENTRY * d.len().div_ceil(4096));
            let mut out = vec![0x55u8; d.len()];
            decode(&enc.bytes, Some(&r), &mut out, 3).unwrap();
            prop_assert_eq!(out, d);
        }

        /// Any span of a stream with any bytes changed: decoded exactly
        /// or refused, never a panic, never other bytes accepted.
        #[test]
        fn spans_of_damaged_streams_decode_exactly_or_fail(
            n in 1usize..12_000,
            seed in any::<u64>(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..4),
            lo in any::<prop::sample::Index>(),
            len in 0usize..20_000,
            scaled in any::<bool>(),
        ) {
            let mut x = seed | 1;
            let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let len_d = n * 4;
            let (d, r) = if scaled {
                decayed(n, 0.7, seed)
            } else {
                let d: Vec<u8> = (0..len_d).map(|i| if (i / 4096) % 2 == 0 { (next() % 3) as u8 } else { next() as u8 }).collect();
                let r: Vec<u8> = d.iter().map(|&b| if next() % 7 == 0 { b ^ 1 } else { b }).collect();
                (d, r)
            };
            let mut enc = encode(&d, 4, Some(&r), &opts(4096, None)).unwrap().bytes;
            for (at, v) in &flips {
                let k = at.index(enc.len());
                enc[k] ^= v;
            }
            let lo = lo.index(len_d) as u64;
            let hi = lo + len as u64;
            if let Ok((sp, out)) = decode_part(&enc, Some(&r), lo, hi) {
                prop_assert_eq!(&out[..], &d[sp.start as usize..sp.end as usize]);
            }
        }
    }
}
