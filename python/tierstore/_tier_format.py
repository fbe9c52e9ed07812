"""The ``.tsd`` format of a codec tier's encoded files (see
:mod:`tierstore._tier_codec` for the layout): its constants, which files are
encoded, a file's storage records and fingerprint, and a header read and
checked.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from tierstore import _archive, _core, manifest
from tierstore import codec as _codec
from tierstore.errors import CorruptFileError

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
NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")
MAX_DEPTH = 64
MANIFEST = "manifest.json"  # a step directory's commit point (tierstore.shardmeta)


def encodable(name: str) -> bool:
    """Files of a checkpoint stored encoded on a codec tier: the ranks' data
    and objects files (tierstore files with their own manifest)."""
    return name.startswith(("rank-", "objects-")) and name.endswith(".pt")


def map_file(path: Path) -> tuple[torch.Tensor, Any]:
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
    if not is_uint(n) or not isinstance(h.get("name"), str) or not NAME.match(h["name"]):
        raise bad("bad name or size")

    def good_ref(ref: Any) -> bool:
        return (
            isinstance(ref, dict)
            and isinstance(ref.get("step_dir"), str)
            and STEP_DIR.match(ref["step_dir"]) is not None
            and isinstance(ref.get("name"), str)
            and NAME.match(ref["name"]) is not None
            and is_uint(ref.get("bytes"))
            and is_uint(ref.get("manifest_crc32"))
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
        if not (isinstance(s, list) and len(s) == fields and all(is_int(x) for x in s)):
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


def is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
