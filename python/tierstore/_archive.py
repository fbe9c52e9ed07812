"""Reading the directory of a container: records, manifest, data offsets,
and whole-file verification (``tierstore verify``)."""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from typing import Any

from tierstore import _core, manifest
from tierstore._engine import get_engine
from tierstore.errors import (
    ChecksumError,
    CorruptFileError,
    InternalError,
    ManifestError,
    MissingRecordError,
)

# Records are verified in batches of at most this many bytes, so that
# verifying a file needs bounded memory whatever its size.
_VERIFY_BATCH = 256 << 20


class Archive:
    """The directory of an archive: record name (without the archive folder)
    -> its :class:`tierstore._core.Record`. ``container`` is the file opened
    once by :func:`open_directory` (None for a stream, which is read through
    the caller's file object)."""

    def __init__(
        self,
        path: str,
        records: list[_core.Record],
        cd_offset: int,
        file_len: int,
        container: _core.Container | None = None,
    ) -> None:
        self.path = path
        self.cd_offset = cd_offset
        self.file_len = file_len
        self.container = container
        if not records:
            raise MissingRecordError(f"{path}: missing record 'data.pkl' (the archive is empty)", path=path)
        first = records[0].name
        self.prefix = first.split("/", 1)[0] if "/" in first else ""
        cut = len(self.prefix) + 1 if self.prefix else 0
        self.records: dict[str, _core.Record] = {}
        for r in records:
            if cut and not r.name.startswith(self.prefix + "/"):
                raise CorruptFileError(
                    f"{path}: record '{r.name}' is outside the archive folder '{self.prefix}/'",
                    path=path,
                    record=r.name,
                )
            rel = r.name[cut:]
            if rel in self.records:  # torch.save never writes one name twice; which copy is meant is unknowable
                raise CorruptFileError(
                    f"{path}: record '{r.name}' appears twice in the zip directory", path=path, record=r.name
                )
            self.records[rel] = r

    def full(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def opened(self) -> _core.Container:
        if self.container is None:
            raise InternalError(f"{self.path}: a stream's archive has no open container")
        return self.container


def open_directory(path: str) -> Archive:
    """Opens ``path`` once and reads and validates its zip directory (in the
    engine: no zip bytes are parsed in Python)."""
    c = _core.open_container(path)
    return Archive(path, c.records, c.cd_offset, c.file_len, c)


def load_small(arch: Archive, offset: int, size: int, what: str) -> bytes:
    """``size`` bytes at ``offset`` of the archive's open file."""
    data: bytes = arch.opened().read(offset, size, what)
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


def read_manifest(path: str, arch: Archive) -> dict[str, Any] | None:
    rel = manifest.MANIFEST_NAME
    rec = arch.records.get(rel)
    if rec is None:
        return None
    if rec.size > manifest.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: record '{arch.full(rel)}': absurd size {rec.size}", path=path, record=rel)
    off = arch.opened().local_data_offset(rec.name)
    data = load_small(arch, off, rec.size, "manifest")
    check_crc(path, arch.full(rel), data, rec.crc32)
    m = manifest.parse(data, path, arch.file_len)
    m["_offset"] = off
    return m


def record_offsets(path: str, arch: Archive, m: dict[str, Any] | None) -> dict[str, int]:
    """Data offset of every record: from the manifest (checked against the
    directory) or from the local headers."""
    c = arch.opened()
    if m is None:
        return dict(zip(arch.records, c.data_offsets(), strict=True))
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
        size, crc = ent.size, ent.crc32
        if r["size"] != size or r["crc32"] != crc:
            raise ManifestError(
                f"{path}: record '{manifest.MANIFEST_NAME}': entry for '{rel}' (size {r['size']}, crc32 "
                f"{r['crc32']:08x}) disagrees with the zip directory (size {size}, crc32 {crc:08x})",
                path=path,
                record=manifest.MANIFEST_NAME,
            )
        out[rel] = r["offset"]
    out[manifest.MANIFEST_NAME] = m["_offset"]
    c.check_offsets([(arch.full(rel), off) for rel, off in out.items()])
    missing = [rel for rel in arch.records if rel not in out]
    if missing:
        all_off = dict(zip(arch.records, c.data_offsets(), strict=True))
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
    size = arch.records["byteorder"].size
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
    for rel, r in arch.records.items():
        if r.method != 0 or r.compressed_size != r.size:
            raise CorruptFileError(
                f"{path}: record '{arch.full(rel)}' is compressed (method {r.method}); torch and tierstore "
                "archives store records uncompressed",
                path=path,
                record=arch.full(rel),
            )


def manifest_and_offsets(arch: Archive) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """The manifest (None for files torch wrote) and the data offsets of an
    opened archive; compressed records are refused."""
    refuse_compressed(arch.path, arch)
    m = read_manifest(arch.path, arch)
    return m, record_offsets(arch.path, arch, m)


def open_archive(path: str) -> tuple[Archive, dict[str, Any] | None, dict[str, int]]:
    """Directory, manifest (None for files torch wrote) and data offsets of ``path``."""
    arch = open_directory(path)
    return (arch, *manifest_and_offsets(arch))


def verify(path: str, progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Checks every record's CRC-32; returns (records, bytes) checked.

    Raises ``ChecksumError`` naming the first damaged record, or another
    ``FormatError`` for structural damage.
    """
    arch, m, offsets = open_archive(path)
    if m is not None:
        # Readers without our manifest (torch.load, zipfile) find each record
        # through its local header: those must agree with the manifest too.
        local = dict(zip(arch.records, arch.opened().data_offsets(), strict=True))
        for rel, off in offsets.items():
            if local.get(rel) != off:
                raise CorruptFileError(
                    f"{path}: record '{arch.full(rel)}': its local header puts the data at {local.get(rel)}, the "
                    f"manifest at {off}; the header is damaged (torch.load would fail)",
                    path=path,
                    record=arch.full(rel),
                )
    specs = [
        (arch.full(rel), offsets[rel], r.size, r.crc32)
        for rel, r in sorted(arch.records.items(), key=lambda kv: offsets[kv[0]])
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
        _core.start_read(get_engine(), path, batch, verify=True).wait(cb)
        done += size
        batch, size = [], 0

    for s in specs:
        if size + s[2] > _VERIFY_BATCH:
            flush()
        batch.append(s)
        size += s[2]
    flush()
    return len(specs), total
