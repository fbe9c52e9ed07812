"""The sharded manifest's index: per-tensor sections a loading rank reads in
part (issue 16: metadata that scales).

A large checkpoint's ``manifest.json`` names an index file instead of
holding its global tensors and rule groups inline. The index is::

    header    b"TSINDEX1", u64 count                                   16 bytes
    table     count x (u8 kind, u64 name offset, u32 name length,
                       u64 section offset, u32 section length,
                       u32 CRC-32 of the section)                      29 bytes each
    names     the entries' names, UTF-8, one after another
    sections  each entry's JSON (a global tensor's entry, or a group)

little-endian, the table sorted by (kind, name bytes). ``manifest.json``
records the file's length and the CRC-32 of header + table + names, so a
reader checks the part every rank reads once, then reads (and checks) only
the sections of the tensors it needs, found by binary search.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tierstore import _paths
from tierstore.errors import ManifestError, MissingKeyError

MAGIC = b"TSINDEX1"
_HEAD = struct.Struct("<8sQ")
_ENTRY = struct.Struct("<BQIQII")
TENSOR, GROUP, FILES = 0, 1, 2
# files[] entries per section (kind 2, named by the section's number), when
# there are more files than that; TIERSTORE_INDEX_FILES_PER_SECTION overrides it.
FILES_PER_SECTION = 256


def files_per_section() -> int:
    v = os.environ.get("TIERSTORE_INDEX_FILES_PER_SECTION")
    return max(1, int(v)) if v is not None and v.strip().isdigit() else FILES_PER_SECTION


# The largest section a reader decodes (one tensor's entry or one group).
MAX_SECTION = 256 << 20


def build(
    tensors: Mapping[str, Any], groups: list[Any], files: list[Any] | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The index of ``tensors`` (global name -> entry), ``groups`` and
    (when given) the ``files`` entries in sections of
    :data:`FILES_PER_SECTION`, and what manifest.json records of it
    (without its file name)."""
    items = [(TENSOR, n.encode(), json.dumps(g, separators=(",", ":")).encode()) for n, g in tensors.items()]
    items += [(GROUP, str(i).encode(), json.dumps(g, separators=(",", ":")).encode()) for i, g in enumerate(groups)]
    per = files_per_section()
    for b in range(-(-len(files) // per) if files is not None else 0):
        assert files is not None
        run = json.dumps(files[b * per : (b + 1) * per], separators=(",", ":")).encode()
        items.append((FILES, str(b).encode(), run))
    items.sort(key=lambda it: (it[0], it[1]))
    names = b"".join(it[1] for it in items)
    table_bytes = _HEAD.size + _ENTRY.size * len(items) + len(names)
    table = [_HEAD.pack(MAGIC, len(items))]
    name_at = sec_at = 0
    for kind, name, sec in items:
        table.append(_ENTRY.pack(kind, name_at, len(name), table_bytes + sec_at, len(sec), zlib.crc32(sec)))
        name_at += len(name)
        sec_at += len(sec)
    head = b"".join(table) + names
    data = head + b"".join(it[2] for it in items)
    rec = {
        "bytes": len(data),
        "table_bytes": table_bytes,
        "table_crc32": zlib.crc32(head),
        "tensors": len(tensors),
        "groups": len(groups),
    }
    if files is not None:
        rec["files"] = len(files)
        rec["files_per_section"] = per
    return data, rec


class Index:
    """An index file, its table checked against what manifest.json recorded
    (length, CRC-32) and for consistency (sorted names, sections inside the
    file after the table); sections read and checked on demand."""

    def __init__(self, path: Path, rec: Mapping[str, Any], where: str) -> None:
        self.path = str(path)
        self.where = where
        self.bytes_read = 0
        size, tb = int(rec["bytes"]), int(rec["table_bytes"])
        head = _paths.read_regular(path, 0, "manifest index", at=(0, min(tb, size)))
        self.bytes_read += len(head)
        if os.stat(path).st_size != size:
            self._fail(f"it is {os.stat(path).st_size} bytes, manifest.json recorded {size}")
        if len(head) != tb or zlib.crc32(head) != rec["table_crc32"] or len(head) < _HEAD.size:
            self._fail(f"its table does not match the CRC-32 manifest.json recorded ({rec['table_crc32']:08x})")
        magic, count = _HEAD.unpack_from(head)
        names_at = _HEAD.size + _ENTRY.size * count
        if magic != MAGIC or names_at > tb:
            self._fail("not a tierstore manifest index")
        self.keys: list[tuple[int, str]] = []
        self.spans: list[tuple[int, int, int]] = []
        prev: tuple[int, bytes] | None = None
        for i in range(count):
            kind, no, nl, so, sl, crc = _ENTRY.unpack_from(head, _HEAD.size + i * _ENTRY.size)
            outside = names_at + no + nl > tb or so < tb or so + sl > size or sl > MAX_SECTION
            if outside or kind not in (TENSOR, GROUP, FILES):
                self._fail(f"entry {i} lies outside the file")
            raw = head[names_at + no : names_at + no + nl]
            if prev is not None and (kind, raw) <= prev:
                self._fail(f"entry {i} is out of order (the table is sorted by kind and name)")
            prev = (kind, raw)
            try:
                name = raw.decode()
            except UnicodeDecodeError:
                self._fail(f"entry {i}: its name is not UTF-8")
            self.keys.append((kind, name))
            self.spans.append((so, sl, crc))
        counts = [sum(1 for k, _n in self.keys if k == kind) for kind in (TENSOR, GROUP, FILES)]
        per = self.rec_files_per = int(rec.get("files_per_section", 1))
        if [rec["tensors"], rec["groups"], -(-rec.get("files", 0) // per)] != counts:
            self._fail("it holds another number of tensors, groups or file sections than manifest.json says")

    def _fail(self, detail: str) -> None:
        raise ManifestError(
            f"{self.path}: manifest index: {detail}; the file is damaged or from another checkpoint ({self.where})",
            path=self.path,
        )

    def find(self, kind: int, name: str) -> int | None:
        i = bisect_left(self.keys, (kind, name))
        return i if i < len(self.keys) and self.keys[i] == (kind, name) else None

    def section(self, i: int) -> Any:
        """Entry ``i``'s JSON, read and checked against its CRC-32."""
        so, sl, crc = self.spans[i]
        data = _paths.read_regular(self.path, 0, "manifest index", at=(so, sl))
        self.bytes_read += len(data)
        if zlib.crc32(data) != crc:
            self._fail(f"the section of {self.keys[i][1][:100]!r} is damaged (crc32 {zlib.crc32(data):08x}, "
                       f"expected {crc:08x})")  # fmt: skip
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            self._fail(f"the section of {self.keys[i][1][:100]!r} is not JSON")

    def names(self, kind: int) -> Iterator[str]:
        return (n for k, n in self.keys if k == kind)


class Sections(Mapping[str, Any]):
    """The global tensors of an indexed manifest as a mapping: membership
    and iteration from the table, an entry read, checked (``check(name,
    entry)``) and kept when first asked for."""

    def __init__(self, index: Index, check: Any) -> None:
        self.index = index
        self.check = check
        self._got: dict[str, Any] = {}
        self._n = sum(1 for k, _n in index.keys if k == TENSOR)

    def __getitem__(self, name: str) -> Any:
        got = self._got.get(name)
        if got is None:
            i = self.index.find(TENSOR, name) if isinstance(name, str) else None
            if i is None:
                raise MissingKeyError(name)
            got = self._got[name] = self.check(name, self.index.section(i))
        return got

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._got or self.index.find(TENSOR, name) is not None)

    def __iter__(self) -> Iterator[str]:
        return self.index.names(TENSOR)

    def __len__(self) -> int:
        return self._n
