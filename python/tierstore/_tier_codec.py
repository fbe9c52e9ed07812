"""Encoded copies of a checkpoint's files on a tier with a codec
(``RemoteTier(codec=tierstore.Delta(keyframe_every=8))``).

A data or objects file of a sharded checkpoint is stored on such a tier as
``<name>.tsd``: the file's exact bytes, encoded. Its own manifest splits it
into segments: each storage record of at least 64 KiB is one segment coded
by ``tsz1`` with the element width of its dtype, predicted from the record
of the same name, dtype and size in the reference file (the same rank's
file of the tier's last keyframe checkpoint); the bytes between them
(zip headers, the pickle, the manifest) are coded without a reference.
Decoding gives back the identical file, so the checkpoint's
``manifest.json`` (copied as it is) still describes it: its length, its
manifest record's CRC-32 and every record's chunk checksums are checked
when the decoded file is read, on top of the codec's xxh3 per chunk.

Layout of a ``.tsd`` file (the header last, so that each segment's stream
is written as soon as it is encoded)::

    b"TSDELTA1" | streams | header (JSON) | u32 header length | u32 CRC-32 of the header | b"TSDELTA1"

The header: ``format``, ``version``, ``codec``, ``name`` (the file it
encodes), ``bytes`` (its length), ``reference`` (``null`` for a keyframe,
else ``{"step_dir", "name", "bytes", "manifest_crc32"}``: the reference
file, in a sibling step directory of the same tier, and the fingerprint it
had), ``segments``: ``[at, length, width, reference offset or -1,
stream length]`` covering ``[0, bytes)`` in order, and ``labels``: per
segment the tensor its record holds (``""`` between records), for
``tierstore stats``; the streams are in the same order. Version 2 (a file
whose records are encoded against more than one reference, each record
against the candidate a sample of it encodes smallest against) adds
``references`` (the list; ``reference`` is its first) and a sixth field
per segment, the index of its reference in that list (-1: none). See
docs/FORMAT.md.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import mmap
import os
import re
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import _archive, _core, _metadata, manifest
from tierstore import codec as _codec
from tierstore._fs import fsync_dir
from tierstore.errors import CorruptFileError, InvalidArgumentError, NotFoundError, TierstoreError

MAGIC = b"TSDELTA1"
SUFFIX = ".tsd"
FORMAT = "tierstore-delta-file"
VERSION = 1
#: A file whose segments are encoded against several references.
VERSION_REFS = 2
MAX_REFS = 4
#: Bytes of a record encoded against each candidate reference to choose one.
SEGMENT_SAMPLE = 256 << 10
CODEC_META = "codec.json"
MAX_HEADER = 64 << 20
STEP_DIR = re.compile(r"^step-\d{12}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
MAX_DEPTH = 64
MANIFEST = "manifest.json"  # a step directory's commit point (tierstore.shardmeta)
#: Where readers decode encoded files (a Checkpointer's restore: under its
#: first disk tier, node-local storage meant for checkpoints).
DECODE_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("tierstore_decode_root", default=None)
_SYNC_EVERY = 32 << 20
_AHEAD = 256 << 20


def encodable(name: str) -> bool:
    """Files of a checkpoint stored encoded on a codec tier: the ranks' data
    and objects files (tierstore files with their own manifest)."""
    return name.startswith(("rank-", "objects-")) and name.endswith(".pt")


def _map(path: Path) -> tuple[torch.Tensor, Any]:
    """The file's bytes as a uint8 tensor over a private mapping (pages read
    as they are touched); the mapping is returned to be closed."""
    with open(path, "rb") as f:
        n = os.fstat(f.fileno()).st_size
        if n == 0:
            return torch.empty(0, dtype=torch.uint8), None
        mm = mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.uint8), mm


def storage_records(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    """The storage records of tierstore file ``path`` (from its own
    manifest; each with ``label``, the dotted path of the first tensor
    viewing it), its length and its manifest record's CRC-32."""
    arch, fm, _offsets = _archive.open_archive(str(path))
    if fm is None:
        raise CorruptFileError(f"{path}: no tierstore manifest; not a checkpoint file", path=str(path))
    mrec = arch.records[manifest.MANIFEST_NAME]
    labels: dict[str, str] = {}
    for t in fm.get("tensors", ()):
        if isinstance(t, dict) and isinstance(t.get("path"), list):
            labels.setdefault(str(t.get("record")), ".".join(str(x) for x in t["path"][1:]))
    recs = [
        {**r, "label": labels.get(r["name"], "")}
        for r in fm["records"]
        if r.get("kind") == "storage" and r.get("codec") in (None, "raw")
    ]
    return recs, arch.file_len, mrec.crc32


def fingerprint(path: Path) -> tuple[int, int]:
    """A checkpoint file's length and its manifest record's CRC-32 (which
    covers its save id and every record's CRC): what a delta records of its
    reference and checks before decoding against it."""
    arch = _archive.open_directory(str(path))
    mrec = arch.records.get(manifest.MANIFEST_NAME)
    if mrec is None:
        raise CorruptFileError(f"{path}: no tierstore manifest; not a checkpoint file", path=str(path))
    return arch.file_len, mrec.crc32


def encode_file(
    src: Path,
    dst: Path,
    spec: _codec.Spec,
    reference: tuple[str, Path] | list[tuple[str, Path]] | None = None,
) -> dict[str, Any]:
    """Writes ``dst`` (``<name>.tsd``): file ``src`` encoded, against
    ``reference`` = (its step directory's name, its raw bytes' path) where
    given, durably (fsynced, renamed into place). Given a list of candidate
    references, each storage record is encoded against the candidate
    against which a sample of it (up to 256 KiB from its middle) encodes
    smallest, among those holding the same record (ties to the first
    listed). The encoding of each segment overlaps the writing of the one
    before (the codec runs without the GIL on a worker thread) and the
    written bytes are flushed to the device every 32 MiB, so that on a slow
    tier the device is busy while the codec works. Returns the header and
    the encoded size."""
    recs, n, _crc = storage_records(src)
    given = [] if reference is None else [reference] if isinstance(reference, tuple) else list(reference)
    if len(given) > MAX_REFS:
        raise InvalidArgumentError(f"at most {MAX_REFS} references, got {len(given)}")
    ref_recs: list[dict[tuple[str, str, int], int]] = []
    ref_metas: list[dict[str, Any]] = []
    ref_maps: list[tuple[torch.Tensor, Any]] = []
    src_t, src_mm = _map(src)
    try:
        for step_dir, rpath in given:
            rr, rn, rcrc = storage_records(rpath)
            ref_recs.append({(r["name"], r.get("dtype", ""), r["size"]): r["offset"] for r in rr})
            ref_metas.append({"step_dir": step_dir, "name": rpath.name, "bytes": rn, "manifest_crc32": rcrc})
            ref_maps.append(_map(rpath))
        return _encode_segments(src, dst, spec, recs, n, src_t, ref_recs, ref_metas, [t for t, _mm in ref_maps])
    finally:
        del src_t
        for mm in [src_mm, *(mm for _t, mm in ref_maps)]:
            if mm is not None:
                mm.close()


def _encode_segments(
    src: Path,
    dst: Path,
    spec: _codec.Spec,
    recs: list[dict[str, Any]],
    n: int,
    src_t: torch.Tensor,
    ref_recs: list[dict[tuple[str, str, int], int]],
    ref_metas: list[dict[str, Any]],
    ref_ts: list[torch.Tensor],
) -> dict[str, Any]:
    """:func:`encode_file` of the mapped file ``src_t`` against the mapped
    references ``ref_ts`` (their storage records' offsets ``ref_recs``)."""
    src_addr = src_t.data_ptr() if n else 0
    ref_bases = [t.data_ptr() if t.numel() else 0 for t in ref_ts]
    # at, length, width, candidates [(reference, its offset)], label
    plan: list[tuple[int, int, int, list[tuple[int, int]], str]] = []
    pos = 0
    for r in sorted(recs, key=lambda r: r["offset"]):
        at, size = r["offset"], r["size"]
        if size < _codec.MIN_BYTES or at < pos or at + size > n:
            continue
        if at > pos:
            plan.append((pos, at - pos, 1, [], ""))
        dtype = _metadata.dtype_named(r.get("dtype"))
        width = _codec.element_width(dtype) if dtype is not None else 1
        if size % width:
            width = 1
        key = (r["name"], r.get("dtype", ""), size)
        cands = [(k, rr[key]) for k, rr in enumerate(ref_recs) if key in rr]
        plan.append((at, size, width, cands, r["label"]))
        pos = at + size
    if n > pos:
        plan.append((pos, n - pos, 1, [], ""))

    def encode(seg: tuple[int, int, int, list[tuple[int, int]], str]) -> tuple[bytes, tuple[int, int] | None]:
        """A segment's stream, against the candidate a sample of it encodes
        smallest against (none without candidates), and that candidate."""
        at, length, width, cands, _label = seg
        chosen = None
        ref_addr = ref_len = 0
        if cands:
            refs = [ref_bases[k] + ro for k, ro in cands]
            chosen = cands[_codec.closest_reference(src_addr + at, length, width, refs, spec, SEGMENT_SAMPLE)]
            ref_addr, ref_len = ref_bases[chosen[0]] + chosen[1], length
        data, _transform, _stats = _core.codec_encode(
            src_addr + at,
            length,
            width,
            ref_addr,
            ref_len,
            level=spec.level,
            threads=_codec.threads(),
            transform=spec.transform if chosen is not None else None,
        )
        return data, chosen

    segments: list[list[int]] = []
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    pool = ThreadPoolExecutor(1, thread_name_prefix="tierstore-encode")
    written = 0
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.write(MAGIC)
            written = len(MAGIC)
            synced = written
            # The encoder runs ahead of the writer by up to _AHEAD bytes of
            # input; each written stream's writeback is started at once, so
            # the device works while the codec does.
            pending: collections.deque[tuple[Any, tuple[int, int, int, list[tuple[int, int]], str]]] = (
                collections.deque()
            )
            chosen: list[int] = []  # per segment, the reference it is encoded against (-1: none)
            ahead = 0
            nxt = 0
            for _ in range(len(plan)):
                while nxt < len(plan) and (not pending or ahead + plan[nxt][1] <= _AHEAD):
                    pending.append((pool.submit(encode, plan[nxt]), plan[nxt]))
                    ahead += plan[nxt][1]
                    nxt += 1
                fut, seg = pending.popleft()
                data, ref = fut.result()
                ahead -= seg[1]
                f.write(data)
                segments.append([seg[0], seg[1], seg[2], ref[1] if ref is not None else -1, len(data)])
                chosen.append(ref[0] if ref is not None else -1)
                if not _start_writeback(f.fileno(), written, len(data)) and written + len(data) - synced >= _SYNC_EVERY:
                    os.fdatasync(f.fileno())
                    synced = written + len(data)
                written += len(data)
            # The references used, in the order given; one (or none used:
            # the first, as a single reference always was) keeps version 1.
            used = sorted({k for k in chosen if k >= 0})
            header = {
                "format": FORMAT,
                "version": VERSION,
                "codec": _codec.CODEC,
                "name": src.name,
                "bytes": n,
                "reference": ref_metas[used[0] if used else 0] if ref_metas else None,
                "segments": segments,
                "labels": [seg[4] for seg in plan],
            }
            if len(used) > 1:
                index = {k: i for i, k in enumerate(used)}
                header["version"] = VERSION_REFS
                header["references"] = [ref_metas[k] for k in used]
                for row, k in zip(segments, chosen, strict=True):
                    row.append(index[k] if k >= 0 else -1)
            hb = json.dumps(header, separators=(",", ":")).encode()
            f.write(hb + struct.pack("<II", len(hb), zlib.crc32(hb)) + MAGIC)
            written += len(hb) + 16
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(wait=True)
    header["encoded_bytes"] = written
    return header


def _libc_sync_file_range() -> Any:
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, n: int) -> bool:
    """Starts the device writing ``n`` bytes at ``offset`` of ``fd`` without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); the final
    fsync still makes it durable. False where that call is missing."""
    if _SYNC_FILE_RANGE is None or n == 0:
        return False
    return int(_SYNC_FILE_RANGE(fd, offset, n, _SYNC_FILE_RANGE_WRITE)) == 0


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of ``.tsd`` file ``path`` (checked: magic at both ends,
    CRC-32, every field, segment bounds) and where its streams begin."""
    p = str(path)

    def bad(detail: str) -> CorruptFileError:
        return CorruptFileError(f"{p}: encoded checkpoint file: {detail}", path=p, record="header")

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8 or head != MAGIC:
            raise bad(f"not a tierstore delta file (magic {head[:8]!r})")
        if size < 24:
            raise bad(f"{size} bytes: cut short")
        f.seek(size - 16)
        tail = f.read(16)
        hlen, hcrc = struct.unpack("<II", tail[:8])
        if tail[8:] != MAGIC:
            raise bad("its end is not a delta file's trailer; the file is cut short or damaged")
        if hlen > MAX_HEADER or 8 + hlen + 16 > size:
            raise bad(f"header of {hlen} bytes in a file of {size}")
        f.seek(size - 16 - hlen)
        hb = f.read(hlen)
    if zlib.crc32(hb) != hcrc:
        raise bad("header checksum mismatch; the file is damaged")
    try:
        h = json.loads(hb)
    except ValueError as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise bad("header is not a tierstore delta file's")
    version = h.get("version")
    if version not in (VERSION, VERSION_REFS) or h.get("codec") != _codec.CODEC:
        raise bad(f"version {h.get('version')!r} / codec {h.get('codec')!r} is not one this tierstore reads")
    n = h.get("bytes")
    if not _uint(n) or not isinstance(h.get("name"), str) or not _NAME.match(h["name"]):
        raise bad("bad name or size")

    def good_ref(ref: Any) -> bool:
        return (
            isinstance(ref, dict)
            and isinstance(ref.get("step_dir"), str)
            and STEP_DIR.match(ref["step_dir"]) is not None
            and isinstance(ref.get("name"), str)
            and _NAME.match(ref["name"]) is not None
            and _uint(ref.get("bytes"))
            and _uint(ref.get("manifest_crc32"))
        )

    ref = h.get("reference")
    if ref is not None and not good_ref(ref):
        raise bad("bad reference")
    refs: list[dict[str, Any]] = [] if ref is None else [ref]
    fields = 5
    if version == VERSION_REFS:
        refs = h.get("references")  # type: ignore[assignment]
        if not (isinstance(refs, list) and 2 <= len(refs) <= MAX_REFS and all(good_ref(r) for r in refs)):
            raise bad(f"bad references (a list of 2 to {MAX_REFS} references)")
        if ref != refs[0]:
            raise bad("reference is not the first of references")
        fields = 6
    segs = h.get("segments")
    if not isinstance(segs, list):
        raise bad("no segments")
    end = size - 16 - hlen
    pos, stream_at = 0, 8
    seg_refs: list[int] = []
    for i, s in enumerate(segs):
        if not (isinstance(s, list) and len(s) == fields and all(_int(x) for x in s)):
            raise bad(f"segment {i} is malformed")
        at, length, width, ref_at, slen = s[:5]
        k = s[5] if fields == 6 else (0 if ref_at >= 0 else -1)
        if at != pos or length <= 0 or width not in (1, 2, 4, 8) or slen < 0:
            raise bad(f"segment {i} does not follow segment {i - 1} or has a bad size or width")
        if not -1 <= k < len(refs) or (k >= 0) != (ref_at >= 0):
            raise bad(f"segment {i} names no reference of the file's ({k})")
        if ref_at >= 0 and ref_at + length > refs[k]["bytes"]:
            raise bad(f"segment {i} reads outside its reference")
        if ref_at < -1:
            raise bad(f"segment {i} has a bad reference offset")
        seg_refs.append(k)
        # A stream's directory bounds what it decodes to (chunks of at most
        # 4 MiB, 32 bytes each): more is damage, not a reason to allocate.
        if length > (slen // _core.CODEC_ENTRY) * (4 << 20):
            raise bad(f"segment {i} claims {length} bytes from a stream of {slen}")
        pos += length
        stream_at += slen
        if stream_at > end:
            raise bad(f"segment {i}'s stream runs into the header")
    if pos != n:
        raise bad(f"segments cover {pos} bytes, the file is {n}")
    if stream_at != end:
        raise bad(f"{end - stream_at} bytes between the last stream and the header")
    labels = h.get("labels")
    if not (isinstance(labels, list) and len(labels) == len(segs) and all(isinstance(x, str) for x in labels)):
        raise bad("labels do not match the segments")
    # One shape for both versions: five fields per segment, each segment's
    # reference (an index into ``refs``) beside them.
    h["segments"] = [list(x[:5]) for x in segs]
    h["refs"], h["seg_refs"] = refs, seg_refs
    return h, 8


def _uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Open:
    """An encoded file being decoded into ``out`` (sparse: a segment is
    written when a reader needs its bytes)."""

    def __init__(self, enc: Path, header: dict[str, Any], at: int, out: Path, refs: list[_Open | Path]) -> None:
        self.enc, self.header, self.out, self.refs = enc, header, out, refs
        self.starts: list[int] = []
        for seg in header["segments"]:
            self.starts.append(at)
            at += seg[4]
        self.seg_at = [seg[0] for seg in header["segments"]]
        self.done: set[int] = set()  # segments decoded whole
        self.heads: dict[int, bytes] = {}  # a segment's stream header and directory
        self.chunks: dict[int, set[int]] = {}  # a segment's chunks decoded so far
        self.bytes_read = 0  # encoded bytes read
        self.enc_fd = os.open(enc, os.O_RDONLY | os.O_CLOEXEC)
        self.out_fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.out_fd, header["bytes"])

    def close(self) -> None:
        for fd in (self.enc_fd, self.out_fd):
            with contextlib.suppress(OSError, TierstoreError):
                os.close(fd)


class Decoder:
    """Decodes a checkpoint's ``.tsd`` files for readers of the raw format,
    into a private folder removed with the decoder (under ``root``, else
    ``TIERSTORE_DECODE_DIR``, else the system's temporary folder).

    :meth:`raw` gives the decoded file's path at once with only the bytes
    between records decoded (zip directory, pickle, manifest: what opening
    and checking it reads); :meth:`ensure` decodes the records a read
    touches, so a resharding load decodes only the records it reads (and
    their keyframe's), and :meth:`ensure_all` the rest. References are
    followed within the tier, depth at most 64, cycles refused; a reference
    must have the fingerprint the delta recorded."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root if root is not None else DECODE_ROOT.get()
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._open: dict[Path, _Open] = {}  # by encoded path
        self._by_out: dict[str, _Open] = {}
        self._n = 0

    def raw(self, enc: Path, stack: tuple[Path, ...] = ()) -> Path:
        """The decoded path of ``enc`` (a ``.tsd`` file); its records are
        decoded by :meth:`ensure` / :meth:`ensure_all`."""
        return self._open_file(enc, stack).out

    def _open_file(self, enc: Path, stack: tuple[Path, ...] = ()) -> _Open:
        enc = Path(os.path.abspath(enc))
        got = self._open.get(enc)
        if got is not None:
            return got
        if enc in stack or len(stack) >= MAX_DEPTH:
            raise CorruptFileError(f"{enc}: its references form a cycle or a chain deeper than {MAX_DEPTH}")
        h, at = read_header(enc)
        refs: list[_Open | Path] = []
        for r in h["refs"]:
            ref: _Open | Path
            tier = enc.parent.parent
            rdir = tier / str(r["step_dir"])
            coded, plain = rdir / (str(r["name"]) + SUFFIX), rdir / str(r["name"])
            if coded.is_file():
                ref = self._open_file(coded, (*stack, enc))
                rpath = ref.out
            elif plain.is_file():
                ref = rpath = plain
            else:
                raise NotFoundError(
                    f"{enc}: its reference {r['step_dir']}/{r['name']} is missing from {tier}", path=str(enc)
                )
            got_fp = fingerprint(rpath)
            if got_fp != (r["bytes"], r["manifest_crc32"]):
                raise CorruptFileError(
                    f"{enc}: its reference {r['step_dir']}/{r['name']} is not the file it was encoded against "
                    f"({got_fp[0]} bytes, manifest crc32 {got_fp[1]:08x}; recorded {r['bytes']}, "
                    f"{r['manifest_crc32']:08x})",
                    path=str(enc),
                    record="reference",
                )
            refs.append(ref)
        if self._dir is None:
            env = os.environ.get("TIERSTORE_DECODE_DIR")
            root = self._root or (Path(env) if env else None)
            self._dir = tempfile.TemporaryDirectory(prefix=".tierstore-decoded-", dir=root)
        self._n += 1
        sub = Path(self._dir.name) / str(self._n)
        sub.mkdir()
        o = _Open(enc, h, at, sub / enc.name.removesuffix(SUFFIX), refs)
        self._open[enc] = o
        self._by_out[str(o.out)] = o
        try:
            # What opening and checking the file reads: the bytes between records.
            for i, label in enumerate(h["labels"]):
                if not label:
                    self._decode(o, i)
        except BaseException:
            self._forget(o)
            raise
        return o

    def _forget(self, o: _Open) -> None:
        o.close()
        self._open.pop(o.enc, None)
        self._by_out.pop(str(o.out), None)

    def ensure(self, path: str | Path, spans: list[tuple[int, int]]) -> None:
        """Decodes the segments of decoded file ``path`` that the byte
        ranges ``[lo, hi)`` touch (nothing for a file that is not one)."""
        o = self._by_out.get(str(path))
        if o is None:
            return
        import bisect

        for lo, hi in spans:
            if hi <= lo:
                continue
            i = max(0, bisect.bisect_right(o.seg_at, lo) - 1)
            while i < len(o.seg_at) and o.seg_at[i] < hi:
                at = o.seg_at[i]
                self._decode(o, i, max(lo - at, 0), hi - at)
                i += 1

    def ensure_all(self, path: str | Path) -> None:
        o = self._by_out.get(str(path))
        if o is not None:
            for i in range(len(o.seg_at)):
                self._decode(o, i)

    def _read(self, o: _Open, n: int, at: int, i: int, what: str) -> bytes:
        got = os.pread(o.enc_fd, n, at) if n else b""
        if len(got) != n:
            raise CorruptFileError(
                f"{o.enc}: segment {i}: the file is shorter than its header says ({what})", path=str(o.enc)
            )
        o.bytes_read += n
        return got

    def decodes(self, path: str | Path) -> bool:
        """Whether ``path`` is a file this decoder decodes."""
        return str(path) in self._by_out

    def decode_into(self, path: str | Path, at: int, length: int, addr: int) -> bool:
        """Decodes bytes ``[at, at + length)`` of decoded file ``path``
        straight into the ``length`` bytes of memory at ``addr`` (a restore's
        destination), where they are exactly one segment (a record) not yet
        decoded into the file: the file is not written. False (nothing
        done) otherwise: read them from the file."""
        import bisect

        o = self._by_out.get(str(path))
        if o is None or length <= 0:
            return False
        k = bisect.bisect_left(o.seg_at, at)
        if k >= len(o.seg_at) or o.seg_at[k] != at or o.header["segments"][k][1] != length or k in o.done:
            return False
        self._decode(o, k, 0, length, into=addr)
        return True

    def _decode(self, o: _Open, i: int, lo: int = 0, hi: int | None = None, into: int = 0) -> None:
        """Decodes the chunks of segment ``i`` that its decoded bytes ``[lo,
        hi)`` (default: all) lie in, reading only the stream's directory and
        those chunks' payloads (and the reference's bytes of those chunks).
        ``into``: the address of memory for the whole segment to decode into
        instead of the decoded file."""
        if i in o.done and not into:
            return
        at, length, _width, ref_at, slen = o.header["segments"][i]
        hi = length if hi is None else min(hi, length)
        record = f"segment {i} (bytes {at}..{at + length} of {o.header['name']})"
        if ref_at >= 0 and self._decode_chain(o, i, max(lo, 0), hi, into):
            return
        head = self._head(o, i)
        plen = slen - len(head)
        sp = _core.codec_span(head, plen, lo, hi, path=str(o.enc), record=record)
        first_chunk, end_chunk, start, end, p_lo, p_hi = sp
        if into and (start, end) != (0, length):
            raise TierstoreError(f"{o.enc}: {record}: a decode into memory takes the whole segment")
        done = o.chunks.setdefault(i, set())
        if not into and all(c in done for c in range(first_chunk, end_chunk)):
            return
        window = self._read(o, p_hi - p_lo, o.starts[i] + len(head) + p_lo, i, "chunk payloads")
        ref_buf: torch.Tensor | None = None
        if ref_at >= 0:
            ref = o.refs[o.header["seg_refs"][i]]
            n = end - start
            if isinstance(ref, _Open):
                self.ensure(ref.out, [(ref_at + start, ref_at + end)])
                rb = os.pread(ref.out_fd, n, ref_at + start)
            else:
                with open(ref, "rb") as f:
                    f.seek(ref_at + start)
                    rb = f.read(n)
            if len(rb) != n:
                raise CorruptFileError(f"{o.enc}: {record}: its reference is too short", path=str(o.enc))
            ref_buf = torch.frombuffer(bytearray(rb), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(0 if into else end - start, dtype=torch.uint8)
        _core.codec_decode_span(
            head,
            plen,
            sp,
            window,
            into or (out.data_ptr() if end > start else 0),
            end - start,
            (ref_buf.data_ptr() if ref_buf.numel() else 1) if ref_buf is not None else 0,
            ref_buf.numel() if ref_buf is not None else 0,
            threads=_codec.threads(),
            path=str(o.enc),
            record=record,
        )
        if not into:
            self._store(o, i, at + start, out, range(first_chunk, end_chunk))

    def _head(self, o: _Open, i: int) -> bytes:
        """Segment ``i``'s stream header and directory (read once)."""
        head = o.heads.get(i)
        if head is None:
            at, length, _width, _ref_at, slen = o.header["segments"][i]
            record = f"segment {i} (bytes {at}..{at + length} of {o.header['name']})"
            first = self._read(o, min(_core.CODEC_HEADER, slen), o.starts[i], i, "stream header")
            n = _core.codec_directory_end(first, path=str(o.enc), record=record)
            if n > slen:
                raise CorruptFileError(
                    f"{o.enc}: {record}: a directory of {n} bytes in a stream of {slen}", path=str(o.enc)
                )
            head = first + self._read(o, n - len(first), o.starts[i] + len(first), i, "directory")
            o.heads[i] = head
        return head

    def _decode_chain(self, o: _Open, i: int, lo: int, hi: int, into: int = 0) -> bool:
        """Decodes the chunks of segment ``i`` that its bytes ``[lo, hi)``
        lie in, in one pass down its chain of references, where each link is
        a segment of the same length at the reference's offset and the chain
        ends in a keyframe's segment: each link's directory and the payloads
        of the same chunks are read, each reference chunk is decoded into
        scratch (``codec_decode_chain_span``) and none of the links is
        decoded on its own. False (nothing done) where that does not apply
        or fails: then it is decoded link by link, and an error names the
        link it comes from."""
        import bisect

        links: list[tuple[_Open, int]] = [(o, i)]
        cur, j = o, i
        while True:
            _a, length, _w, ref_at, _sl = cur.header["segments"][j]
            if ref_at < 0:
                break
            ref = cur.refs[cur.header["seg_refs"][j]]
            if not isinstance(ref, _Open) or len(links) > MAX_DEPTH:
                return False
            k = bisect.bisect_left(ref.seg_at, ref_at)
            if k >= len(ref.seg_at) or ref.seg_at[k] != ref_at or ref.header["segments"][k][1] != length:
                return False
            cur, j = ref, k
            links.append((cur, j))
        if len(links) < 2:
            return False
        heads = [self._head(lk, k) for lk, k in links]
        plens = [lk.header["segments"][k][4] - len(h) for (lk, k), h in zip(links, heads, strict=True)]
        name = f"segment {i} of {o.header['name']}"
        first, last, start, end, _p_lo, _p_hi = _core.codec_span(
            heads[0], plens[0], lo, hi, path=str(o.enc), record=name
        )
        if into and (start, end) != (0, o.header["segments"][i][1]):
            return False
        done = o.chunks.setdefault(i, set())
        if not into and all(c in done for c in range(first, last)):
            return True
        windows, bases = [], []
        for n, ((lk, k), h) in enumerate(zip(links, heads, strict=True)):
            sp = _core.codec_span(h, plens[n], start, end, path=str(lk.enc), record=f"segment {k}")
            if (sp[0], sp[1]) != (first, last):
                return False  # a link copies its own chunks: decoded link by link
            windows.append(self._read(lk, sp[5] - sp[4], lk.starts[k] + len(h) + sp[4], k, "chunk payloads"))
            bases.append(sp[4])
        out = torch.empty(0 if into else end - start, dtype=torch.uint8)
        try:
            ok = _core.codec_decode_chain_span(
                heads,
                plens,
                windows,
                bases,
                first,
                last,
                into or (out.data_ptr() if end > start else 0),
                end - start,
                threads=_codec.threads(),
                path=str(o.enc),
                record=name,
            )
        except TierstoreError:
            return False
        if not ok:
            return False
        if not into:
            self._store(o, i, o.header["segments"][i][0] + start, out, range(first, last))
        return True

    def _store(self, o: _Open, i: int, at: int, out: torch.Tensor, chunks: range) -> None:
        """Writes decoded bytes ``out`` of segment ``i`` at file offset ``at``
        of its decoded file and marks its ``chunks`` decoded (the segment
        done once all of them are)."""
        mv = memoryview(out.numpy().data)
        written = 0
        while written < len(mv):
            written += os.pwrite(o.out_fd, mv[written:], at + written)
        done = o.chunks.setdefault(i, set())
        done.update(chunks)
        if len(done) == (len(o.heads[i]) - _core.CODEC_HEADER) // _core.CODEC_ENTRY:  # every chunk of the segment
            o.done.add(i)
            o.heads.pop(i, None)
            o.chunks.pop(i, None)

    def close(self) -> None:
        for o in list(self._open.values()):
            o.close()
        self._open.clear()
        self._by_out.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def encoded_of(copy: Path, name: str) -> Path | None:
    """``copy/name.tsd`` where the copy holds file ``name`` encoded."""
    p = copy / (name + SUFFIX)
    return p if p.is_file() and not (copy / name).exists() else None
