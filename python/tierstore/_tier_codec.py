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
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import _core, _metadata
from tierstore import codec as _codec
from tierstore._fs import fsync_dir
from tierstore._tier_decode import DECODE_ROOT, Decoder
from tierstore._tier_format import (
    CODEC_META,
    FORMAT,
    MAGIC,
    MAX_REFS,
    SEGMENT_SAMPLE,
    SUFFIX,
    VERSION,
    VERSION_REFS,
    encodable,
    fingerprint,
    map_file,
    read_header,
    storage_records,
)
from tierstore.errors import InvalidArgumentError

# Re-exported for the codec tier's users (the Checkpointer's cascade and
# restore, the CLI): the decoder and the format names they need.
__all__ = [
    "CODEC_META",
    "DECODE_ROOT",
    "SEGMENT_SAMPLE",
    "SUFFIX",
    "VERSION",
    "VERSION_REFS",
    "Decoder",
    "encodable",
    "encode_file",
    "encoded_of",
    "fingerprint",
    "read_header",
]

_SYNC_EVERY = 32 << 20
_AHEAD = 256 << 20


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
    src_t, src_mm = map_file(src)
    try:
        for step_dir, rpath in given:
            rr, rn, rcrc = storage_records(rpath)
            ref_recs.append({(r["name"], r.get("dtype", ""), r["size"]): r["offset"] for r in rr})
            ref_metas.append({"step_dir": step_dir, "name": rpath.name, "bytes": rn, "manifest_crc32": rcrc})
            ref_maps.append(map_file(rpath))
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


def encoded_of(copy: Path, name: str) -> Path | None:
    """``copy/name.tsd`` where the copy holds file ``name`` encoded."""
    p = copy / (name + SUFFIX)
    return p if p.is_file() and not (copy / name).exists() else None
