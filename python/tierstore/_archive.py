"""Reading the directory of a container: records, manifest, data offsets,
and whole-file verification (``tierstore verify``)."""

from __future__ import annotations

import struct
import sys
import zlib
from collections.abc import Callable
from typing import Any

from tierstore import _core, manifest
from tierstore._engine import get_engine
from tierstore.errors import (
    ChecksumError,
    CorruptFileError,
    ManifestError,
    MissingRecordError,
    TruncatedFileError,
)

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
# Records are verified in batches of at most this many bytes, so that
# verifying a file needs bounded memory whatever its size.
_VERIFY_BATCH = 256 << 20


class Archive:
    """The directory of an archive: record name (without prefix) -> entry."""

    def __init__(self, path: str, entries: list[tuple[str, int, int, int, int, int]], cd_offset: int, file_len: int):
        self.path = path
        self.cd_offset = cd_offset
        self.file_len = file_len
        if not entries:
            raise MissingRecordError(f"{path}: missing record 'data.pkl' (the archive is empty)", path=path)
        first = entries[0][0]
        self.prefix = first.split("/", 1)[0] if "/" in first else ""
        cut = len(self.prefix) + 1 if self.prefix else 0
        self.records: dict[str, tuple[int, int, int, int, int]] = {}
        for name, crc, size, csize, method, hdr in entries:
            if cut and not name.startswith(self.prefix + "/"):
                raise CorruptFileError(
                    f"{path}: record '{name}' is outside the archive folder '{self.prefix}/'",
                    path=path,
                    record=name,
                )
            self.records[name[cut:]] = (crc, size, csize, method, hdr)

    def full(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel


def load_small(path: str, offset: int, size: int, what: str) -> bytes:
    data: bytes = _core.read_small(path, offset, size, what)
    return data


def check_crc(path: str, record: str, data: Any, expected: int) -> None:
    actual = zlib.crc32(data)
    if actual != expected:
        raise ChecksumError(
            f"{path}: record '{record}': checksum mismatch (stored crc32 {expected:08x}, "
            f"computed {actual:08x}); the record is damaged",
            path=path,
            record=record,
        )


def _local_data_offset(path: str, arch: Archive, rel: str, header: bytes) -> int:
    hdr = arch.records[rel][4]
    if len(header) < 30:
        raise TruncatedFileError(
            f"{path}: truncated file: record '{arch.full(rel)}' is cut short",
            path=path,
            record=arch.full(rel),
        )
    sig, _v, _fl, _m, _t, _d, _c, _cs, _us, nlen, xlen = _LOCAL_HEADER.unpack_from(header)
    if sig != _LOCAL_SIG:
        raise CorruptFileError(
            f"{path}: record '{arch.full(rel)}': no local file header at offset {hdr}",
            path=path,
            record=arch.full(rel),
        )
    return int(hdr + 30 + nlen + xlen)


def read_manifest(path: str, arch: Archive) -> dict[str, Any] | None:
    rel = manifest.MANIFEST_NAME
    if rel not in arch.records:
        return None
    crc, size, _csize, _method, hdr = arch.records[rel]
    if size > manifest.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: record '{arch.full(rel)}': absurd size {size}", path=path, record=rel)
    probe = min(30 + len(arch.full(rel)) + 512, arch.cd_offset - hdr)
    off = _local_data_offset(path, arch, rel, load_small(path, hdr, probe, "manifest header"))
    if off + size > arch.cd_offset:
        raise ManifestError(f"{path}: record '{arch.full(rel)}' runs past the record area", path=path, record=rel)
    data = load_small(path, off, size, "manifest")
    check_crc(path, arch.full(rel), data, crc)
    m = manifest.parse(data, path, arch.file_len)
    m["_offset"] = off
    return m


def record_offsets(path: str, arch: Archive, m: dict[str, Any] | None) -> dict[str, int]:
    """Data offset of every record: from the manifest (checked against the
    directory) or from the local headers."""
    if m is None:
        offs = _core.data_offsets(path)
        return {rel: off for rel, off in zip(arch.records, offs, strict=True)}
    out: dict[str, int] = {}
    for r in m["records"]:
        rel = r["name"]
        ent = arch.records.get(rel)
        if ent is None:
            raise ManifestError(
                f"{path}: record '{manifest.MANIFEST_NAME}': lists record '{rel}', which the archive lacks",
                path=path,
                record=manifest.MANIFEST_NAME,
            )
        crc, size, _cs, _m, _hdr = ent
        if r["size"] != size or r["crc32"] != crc:
            raise ManifestError(
                f"{path}: record '{manifest.MANIFEST_NAME}': entry for '{rel}' (size {r['size']}, crc32 "
                f"{r['crc32']:08x}) disagrees with the zip directory (size {size}, crc32 {crc:08x})",
                path=path,
                record=manifest.MANIFEST_NAME,
            )
        out[rel] = r["offset"]
    out[manifest.MANIFEST_NAME] = m["_offset"]
    _core.check_offsets(path, [(arch.full(rel), off) for rel, off in out.items()])
    missing = [rel for rel in arch.records if rel not in out]
    if missing:
        offs = _core.data_offsets(path)
        all_off = dict(zip(arch.records, offs, strict=True))
        for rel in missing:
            out[rel] = all_off[rel]
    return out


def default_byteorder() -> str:
    """The byte order of a file without a ``byteorder`` record, as torch.load
    takes it: ``torch.serialization.set_default_load_endianness`` if set,
    else little-endian."""
    import torch

    get = getattr(torch.serialization, "get_default_load_endianness", None)
    v = get() if get is not None else None
    name = str(getattr(v, "name", v)).upper() if v is not None else "LITTLE"
    if name == "BIG":
        return "big"
    if name == "NATIVE":
        return sys.byteorder
    return "little"


def byteorder(arch: Archive, offsets: dict[str, int], read: Callable[[int, int], bytes]) -> str:
    if "byteorder" not in arch.records:
        return default_byteorder()
    size = arch.records["byteorder"][1]
    if size > 16:
        raise CorruptFileError(
            f"{arch.path}: record 'byteorder' is {size} bytes long", path=arch.path, record="byteorder"
        )
    v = read(offsets["byteorder"], size)
    if v not in (b"little", b"big"):
        raise CorruptFileError(
            f"{arch.path}: record 'byteorder' holds {v!r}, expected 'little' or 'big'",
            path=arch.path,
            record="byteorder",
        )
    return v.decode()


def refuse_compressed(path: str, arch: Archive) -> None:
    """``CorruptFileError`` naming the first record that is not stored uncompressed."""
    for rel, (_crc, size, csize, method, _h) in arch.records.items():
        if method != 0 or csize != size:
            raise CorruptFileError(
                f"{path}: record '{arch.full(rel)}' is compressed (method {method}); torch and tierstore "
                "archives store records uncompressed",
                path=path,
                record=arch.full(rel),
            )


def open_archive(path: str) -> tuple[Archive, dict[str, Any] | None, dict[str, int]]:
    """Directory, manifest (None for files torch wrote) and data offsets of ``path``."""
    entries, cd_offset, file_len = _core.read_directory(path)
    arch = Archive(path, entries, cd_offset, file_len)
    refuse_compressed(path, arch)
    m = read_manifest(path, arch)
    return arch, m, record_offsets(path, arch, m)


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Checks every record's CRC-32; returns (records, bytes) checked.

    Raises ``ChecksumError`` naming the first damaged record, or another
    ``FormatError`` for structural damage.
    """
    arch, m, offsets = open_archive(path)
    if m is not None:
        # Readers without our manifest (torch.load, zipfile) find each record
        # through its local header: those must agree with the manifest too.
        local = dict(zip(arch.records, _core.data_offsets(path), strict=True))
        for rel, off in offsets.items():
            if local.get(rel) != off:
                raise CorruptFileError(
                    f"{path}: record '{arch.full(rel)}': its local header puts the data at {local.get(rel)}, the "
                    f"manifest at {off}; the header is damaged (torch.load would fail)",
                    path=path,
                    record=arch.full(rel),
                )
    specs = [
        (arch.full(rel), offsets[rel], size, crc)
        for rel, (crc, size, _cs, _m2, _h) in sorted(arch.records.items(), key=lambda kv: offsets[kv[0]])
    ]
    total = sum(s[2] for s in specs)
    done = 0
    batch: list[tuple[str, int, int, int | None]] = []
    size = 0

    def flush() -> None:
        nonlocal done, batch, size
        if not batch:
            return
        base = done
        cb = None if progress is None else (lambda d, _t: progress(base + d, total))
        _core.read_records(get_engine(), path, batch, verify=True, progress=cb)
        done += size
        batch, size = [], 0

    for s in specs:
        if size + s[2] > _VERIFY_BATCH:
            flush()
        batch.append(s)
        size += s[2]
    flush()
    return len(specs), total
