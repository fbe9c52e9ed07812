"""The sharded checkpoint's metadata: ``manifest.json``, read and checked.

Nothing a manifest says is used before it is checked:

1. the file's checksum (format version 2; see :mod:`tierstore._metadata`);
2. every field's type and range, every name confined to the checkpoint
   directory (:mod:`tierstore._paths`), every piece inside its global tensor
   and inside the stored local tensor it reads from, every stored tensor's
   global dtype equal to its stored dtype;
3. when a data file is first used, the stored entries that point into it
   against the file's own zip directory and manifest (record, offset, size,
   CRC-32, dtype, shape, contiguity), and the file against the manifest
   (its length and, in version 2, the CRC-32 of its own manifest record);
4. the chunk checksums of every record that is read (their table's own
   CRC-32 is in the data file's manifest), so that every byte returned is
   verified even when a record is read in parts.

Version 1 manifests (no checksum, no chunk checksums) still load: every
check their fields allow is made, and a record read in part is read whole
and checked against its CRC-32 (``verify="touched"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import json
import math
import os
import stat
import warnings
import weakref
import zlib
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tierstore import _archive, _index, _metadata, _paths, _pickle, _tier_codec, _tree, manifest
from tierstore._fs import write_atomic
from tierstore.errors import LayoutError, ManifestError, MissingKeyError, NotFoundError, TierstoreError
from tierstore.layout import Box, Layout, Piece, Rule
from tierstore.layout import position_inside as _inside
from tierstore.reshard import GlobalIndex, Source, prove_tiling_arrays

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "Checkpoint", "dtype_of", "read_manifest", "write_manifest"]

MANIFEST = "manifest.json"
FORMAT = "tierstore-sharded"
FORMAT_VERSION = 3
# The largest manifest.json read (a damaged or hostile one is refused before
# it is read).
MAX_MANIFEST_BYTES = 4 << 30
_U32 = 0xFFFFFFFF

_T = TypeVar("_T")


def dtype_of(name: Any, where: str = "checkpoint manifest", field: str = "dtype") -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"{where}: {field}: unknown dtype {str(name)[:80]!r}", path=where, record=field)
    return dt


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


# manifest.json holds its global tensors inline up to this many bytes of
# them; beyond, they go to an index file a loading rank reads in part
# (:mod:`tierstore._index`). TIERSTORE_MANIFEST_INDEX_BYTES overrides it.
INDEX_MIN_BYTES = 1 << 20


def _index_min_bytes() -> int:
    v = os.environ.get("TIERSTORE_MANIFEST_INDEX_BYTES")
    return int(v) if v is not None and v.strip().isdigit() else INDEX_MIN_BYTES


# A group of rule positions with at least this many positions that fills a
# grid with files in mesh order is stored as the grid and the map (O(1)
# bytes, :class:`Grid`); smaller ones as their list. TIERSTORE_GRID_MIN
# overrides it.
GRID_MIN = 64


def grid_min() -> int:
    v = os.environ.get("TIERSTORE_GRID_MIN")
    return int(v) if v is not None and v.strip().isdigit() else GRID_MIN


def index_name(save_id: str) -> str:
    return f"index.{save_id}.bin"


def write_manifest(d: Path, m: dict[str, Any], durable: bool = True) -> None:
    """Commits manifest ``m`` (an atomic replace of manifest.json). A large
    one's global tensors and rule groups go to an index file first
    (written and made durable before the manifest that names it)."""
    tensors, groups = m.get("tensors", {}), m.get("groups", [])
    threshold = _index_min_bytes()
    size = len(m.get("files", ())) * 96  # a file entry is about 90 bytes of JSON
    for name, g in tensors.items():
        size += len(name) + 64 + (len(g["pieces"]) * 48 if "pieces" in g else 160)
        if size > threshold:
            break
    if size > threshold or len(groups) * 32 > threshold:
        # Many files: their entries go to sections too, so that a loading rank
        # reads those of the files it opens, not one entry per rank.
        files = m["files"] if len(m["files"]) > _index.files_per_section() else None
        data, rec = _index.build(tensors, groups, files)
        name = index_name(str(m["save_id"]))
        write_atomic(d / name, data, durable)
        m = {k: v for k, v in m.items() if k not in ("tensors", "groups")}
        m["index"] = {"name": name, **rec}
        if files is not None:
            m["files"] = []
    write_atomic(d / MANIFEST, _metadata.dumps(m), durable)


_MANIFESTS: contextvars.ContextVar[dict[tuple[Any, ...], dict[str, Any]] | None] = contextvars.ContextVar(
    "tierstore_manifests", default=None
)


@contextlib.contextmanager
def manifests_cached() -> Iterator[None]:
    """Inside, :func:`read_manifest` checks each manifest file once: a
    restore that looks at a step's copies several times (candidates, peer
    repair, what to fetch, the load) parses each one once. Keyed by the
    file's identity (device, inode, size, modification time), so a manifest
    replaced meanwhile (written under a new name and renamed) is read anew;
    only regular files are kept. The dicts returned are shared: callers
    inside must not change them."""
    if _MANIFESTS.get() is not None:
        yield
        return
    token = _MANIFESTS.set({})
    try:
        yield
    finally:
        _MANIFESTS.reset(token)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the sharded checkpoint at ``path``."""
    d = Path(path)
    mp = d / MANIFEST
    cache = _MANIFESTS.get()
    key: tuple[Any, ...] | None = None
    if cache is not None:
        try:
            st = os.lstat(mp)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            key = (os.path.abspath(mp), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            got = cache.get(key)
            if got is not None:
                return got
    m = _read_manifest(d, mp)
    if cache is not None and key is not None:
        cache[key] = m
    return m


def _read_manifest(d: Path, mp: Path) -> dict[str, Any]:
    if not d.exists():
        raise NotFoundError(f"{d}: no such checkpoint directory", path=str(d))
    if not mp.exists() and not mp.is_symlink():
        raise NotFoundError(
            f"{d}: no committed checkpoint (manifest.json is missing; a save may have been interrupted)",
            path=str(mp),
        )
    _paths.member(d, MANIFEST, source=str(d), field="manifest.json")
    data = _paths.read_regular(mp, MAX_MANIFEST_BYTES, "manifest")
    m, _had = _metadata.loads(data, str(mp), required=False)
    return _validate(m, d, str(mp), data)


def _validate(m: dict[str, Any], d: Path, where: str, data: bytes) -> dict[str, Any]:
    f = _metadata.Fields(where)
    if m.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a tierstore sharded checkpoint manifest", path=where)
    v = f.uint(f.get(m, "format_version", "format_version"), "format_version")
    if v > FORMAT_VERSION:
        raise ManifestError(
            f"{where}: format_version {v} is newer than this tierstore understands ({FORMAT_VERSION}); "
            "upgrade tierstore",
            path=where,
        )
    if v < 1:
        f.fail("format_version", "1, 2 or 3", v)
    if v >= 2 and not _metadata._TRAILER.search(data):
        raise ManifestError(f"{where}: format_version {v} requires a checksum and the file has none", path=where)
    f.string(f.get(m, "save_id", "save_id"), "save_id", most=64)
    world = f.uint(f.get(m, "world_size", "world_size"), "world_size", most=1 << 24)
    if world < 1:
        f.fail("world_size", "at least 1", world)
    indexed = v >= 3 and "index" in m
    idx = _open_index(f, m, d, where) if indexed else None
    files: Any = f.array(f.get(m, "files", "files"), "files")
    if idx is not None and "files" in m["index"]:
        # The entries are in index sections, each checked when first used.
        if files:
            f.fail("files", "[] (the index holds the entries)", f"{len(files)} entries")
        files = _Files(idx, f, d, where, world, f.uint(m["index"]["files"], "index.files"))
    else:
        for i, fe in enumerate(files):
            _file_entry(f, fe, i, d, where, world, v)
    stored = f.array(f.get(m, "stored", "stored"), "stored")
    for i, s in enumerate(stored):
        fld = f"stored[{i}]"
        f.mapping(s, fld)
        fi = f.uint(f.get(s, "file", f"{fld}.file"), f"{fld}.file", most=max(len(files) - 1, 0))
        if fi >= len(files):
            f.fail(f"{fld}.file", f"an index into files (of {len(files)})", fi)
        f.string(f.get(s, "key", f"{fld}.key"), f"{fld}.key", most=1 << 16)
        f.string(f.get(s, "record", f"{fld}.record"), f"{fld}.record")
        dt = dtype_of(f.get(s, "dtype", f"{fld}.dtype"), where, f"{fld}.dtype")
        shape = f.shape(f.get(s, "shape", f"{fld}.shape"), f"{fld}.shape")
        off = f.uint(f.get(s, "offset", f"{fld}.offset"), f"{fld}.offset")
        roff = f.uint(f.get(s, "record_offset", f"{fld}.record_offset"), f"{fld}.record_offset")
        rsize = f.uint(f.get(s, "record_size", f"{fld}.record_size"), f"{fld}.record_size")
        f.uint(f.get(s, "crc32", f"{fld}.crc32"), f"{fld}.crc32", most=_U32)
        nbytes = math.prod(shape) * _itemsize(dt)
        if off < roff or off + nbytes > roff + rsize:
            f.fail(
                f"{fld}.offset",
                f"a tensor of {nbytes} bytes inside its record [{roff}, +{rsize})",
                off,
            )
        if roff + rsize > files[fi]["bytes"]:
            f.fail(f"{fld}.record_offset", f"a record inside its file ({files[fi]['bytes']} bytes)", roff)
    m["files"] = files
    proven: set[tuple[int, tuple[int, ...]]] = set()
    groups: Any
    if idx is not None:
        groups = _Groups(idx, f, len(files))

        def check(name: str, g: Any) -> Any:
            _tensor_entry(f, name, g, v, groups, proven, stored, where)
            return g

        tensors: Any = _index.Sections(idx, check)
        m["index_file"] = idx
    else:
        tensors = f.mapping(f.get(m, "tensors", "tensors"), "tensors")
        groups = _groups(f, m.get("groups", []) if v >= 3 else [], len(files))
        for name, g in tensors.items():
            _tensor_entry(f, name, g, v, groups, proven, stored, where)
    m["tensors"] = tensors
    m["groups"] = groups
    objects = f.mapping(m.get("objects", {}), "objects")
    for k, name in objects.items():
        _paths.member(d, name, source=where, field=f"objects[{k[:100]!r}]")
    per_rank = f.mapping(m.get("per_rank_objects", {}), "per_rank_objects")
    for k, holders in per_rank.items():
        f.mapping(holders, f"per_rank_objects[{k[:100]!r}]")
        for r, name in holders.items():
            if not r.isdigit() or int(r) >= world:
                f.fail(f"per_rank_objects[{k[:100]!r}]", f"ranks below {world}", r)
            _paths.member(d, name, source=where, field=f"per_rank_objects[{k[:100]!r}][{r}]")
    if v >= 2:
        for i, oe in enumerate(f.array(f.get(m, "object_files", "object_files"), "object_files")):
            fld = f"object_files[{i}]"
            f.mapping(oe, fld)
            _paths.member(d, f.get(oe, "name", f"{fld}.name"), source=where, field=f"{fld}.name")
            f.uint(f.get(oe, "bytes", f"{fld}.bytes"), f"{fld}.bytes")
            f.uint(f.get(oe, "manifest_crc32", f"{fld}.manifest_crc32"), f"{fld}.manifest_crc32", most=_U32)
        for name, a in f.mapping(m.get("attachments", {}), "attachments").items():
            fld = f"attachments[{name[:100]!r}]"
            _paths.member(d, name, source=where, field=fld)
            f.mapping(a, fld)
            f.uint(f.get(a, "bytes", f"{fld}.bytes"), f"{fld}.bytes")
            f.uint(f.get(a, "crc32", f"{fld}.crc32"), f"{fld}.crc32", most=_U32)
    from tierstore import _tree

    paths = f.mapping(m.get("paths", {}), "paths")
    held = {s.get("key") for s in stored} | set(tensors) | set(objects) | set(per_rank) if paths else set()
    if paths and not indexed:
        held.update(p[1] for g in tensors.values() for p in g.get("parts", ()))
    for k, pth in paths.items():
        fld = f"paths[{k[:100]!r}]"
        if k not in held and not indexed:  # (an indexed manifest's keys are in sections not read here)
            f.fail(fld, "the path of a key the checkpoint holds", k[:100])
        got = _tree.check_path(pth, k)
        if got is None:
            f.fail(fld, f"the key path of {k[:100]!r} (strings, list indices, {{'int': n}} keys; joined by '.' "
                        "they give the key)", pth)  # fmt: skip
        paths[k] = got
    m["paths"] = paths
    m.setdefault("objects", {})
    m.setdefault("per_rank_objects", {})
    return m


def _file_entry(f: _metadata.Fields, fe: Any, i: int, d: Path, where: str, world: int, v: int) -> None:
    fld = f"files[{i}]"
    f.mapping(fe, fld)
    f.uint(f.get(fe, "rank", f"{fld}.rank"), f"{fld}.rank", most=world - 1)
    # The name's text here; the file system (symlinks, file type) when the file is first used.
    _paths.check_name(d, f.get(fe, "name", f"{fld}.name"), source=where, field=f"{fld}.name")
    f.uint(f.get(fe, "bytes", f"{fld}.bytes"), f"{fld}.bytes")
    if v >= 2:
        f.uint(f.get(fe, "manifest_crc32", f"{fld}.manifest_crc32"), f"{fld}.manifest_crc32", most=_U32)


class _Files:
    """The files[] of a manifest whose index holds them: a section of
    entries read and checked (as manifest.json's would be) when one of its
    files is first used."""

    def __init__(self, idx: _index.Index, f: _metadata.Fields, d: Path, where: str, world: int, n: int) -> None:
        self.idx, self.f, self.d, self.where, self.world, self.n = idx, f, d, where, world, n
        self.per = int(idx.rec_files_per)
        self._got: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self.n))

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            self.f.fail("files", f"an entry {i} among {self.n}", i)
        b = i // self.per
        got = self._got.get(b)
        if got is None:
            k = self.idx.find(_index.FILES, str(b))
            if k is None:
                self.f.fail("index", f"a section for files {b * self.per}..", "none")
            want = min(self.per, self.n - b * self.per)
            got = self.f.array(self.idx.section(k), f"files[{b * self.per}:]", length=want)
            for j, fe in enumerate(got):
                _file_entry(self.f, fe, b * self.per + j, self.d, self.where, self.world, 3)
            self._got[b] = got
        return got[i - b * self.per]


def _tensor_entry(
    f: _metadata.Fields,
    name: str,
    g: Any,
    v: int,
    groups: Any,
    proven: set[tuple[int, tuple[int, ...]]],
    stored: list[Any],
    where: str,
) -> None:
    """Checks one global tensor's entry: a rule's (version 3), or its pieces'."""
    fld = f"tensors[{name[:100]!r}]"
    f.mapping(g, fld)
    gshape = f.shape(f.get(g, "shape", f"{fld}.shape"), f"{fld}.shape")
    dtype_of(f.get(g, "dtype", f"{fld}.dtype"), where, f"{fld}.dtype")
    if v >= 3 and "rule" in g:
        _rule_entry(f, name, g, gshape, groups, proven, fld)
        return
    pieces = f.array(f.get(g, "pieces", f"{fld}.pieces"), f"{fld}.pieces")
    for j, pc in enumerate(pieces):
        pf = f"{fld}.pieces[{j}]"
        f.array(pc, pf, length=3)
        si = f.uint(pc[0], f"{pf}[0]")
        if si >= len(stored):
            f.fail(f"{pf}[0]", f"an index into stored (of {len(stored)})", si)
        s = stored[si]
        if s["dtype"] != g["dtype"]:
            f.fail(f"{fld}.dtype", f"the dtype of stored[{si}] ({s['dtype']})", g["dtype"])
        box = _box(f, pc[1], f"{pf}[1]", len(gshape))
        if not box.within(gshape):
            f.fail(f"{pf}[1]", f"a box inside the global shape {list(gshape)}", pc[1])
        lshape = tuple(s["shape"])
        if isinstance(pc[2], list):
            lbox = _box(f, pc[2], f"{pf}[2]", len(lshape))
            if not lbox.within(lshape):
                f.fail(f"{pf}[2]", f"a box inside the stored shape {list(lshape)}", pc[2])
            if [n for n in lbox.lengths if n != 1] != [n for n in box.lengths if n != 1]:
                f.fail(f"{pf}[2]", f"a box of the global box's shape {list(box.lengths)}", pc[2])
        else:
            at = f.uint(pc[2], f"{pf}[2]")
            if at + box.numel > math.prod(lshape):
                f.fail(f"{pf}[2]", f"a flat offset with {box.numel} elements inside stored[{si}]", at)


def _open_index(f: _metadata.Fields, m: dict[str, Any], d: Path, where: str) -> _index.Index:
    rec = f.mapping(m["index"], "index")
    name = f.get(rec, "name", "index.name")
    p = _paths.member(d, name, source=where, field="index.name")
    for k in ("bytes", "table_bytes", "tensors", "groups"):
        f.uint(f.get(rec, k, f"index.{k}"), f"index.{k}")
    if "files" in rec:
        f.uint(rec["files"], "index.files", most=1 << 24)
        per = f.uint(f.get(rec, "files_per_section", "index.files_per_section"), "index.files_per_section")
        if not 1 <= per <= 1 << 20:
            f.fail("index.files_per_section", "1 to 2**20", per)
    f.uint(f.get(rec, "table_crc32", "index.table_crc32"), "index.table_crc32", most=_U32)
    return _index.Index(p, rec, where)


class _Groups:
    """The rule groups of an indexed manifest, each read and checked when
    first asked for: ``{position: file index}``."""

    def __init__(self, idx: _index.Index, f: _metadata.Fields, nfiles: int) -> None:
        self.idx, self.f, self.nfiles = idx, f, nfiles
        self._n = sum(1 for k, _n in idx.keys if k == _index.GROUP)
        self._got: dict[int, Mapping[tuple[int, ...], int]] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, gi: int) -> Mapping[tuple[int, ...], int]:
        got = self._got.get(gi)
        if got is None:
            i = self.idx.find(_index.GROUP, str(gi))
            if i is None:
                self.f.fail("index", f"a section for group {gi}", "none")
            got = self._got[gi] = _groups(self.f, [self.idx.section(i)], self.nfiles)[0]
        return got


class Grid(Mapping[tuple[int, ...], int]):
    """The placements of a group that holds every position of a grid, each
    in file ``base + position . strides`` (a regular job: ranks in mesh
    order), computed when asked for: a group of W positions in O(1) bytes."""

    def __init__(self, grid: tuple[int, ...], base: int, strides: tuple[int, ...]) -> None:
        self.grid, self.base, self.strides = grid, base, strides

    def __getitem__(self, c: tuple[int, ...]) -> int:
        if not _inside(c, self.grid):
            raise MissingKeyError(f"position {list(c)[:8]} is not in the grid {list(self.grid)[:8]}")
        return self.base + sum(x * s for x, s in zip(c, self.strides, strict=True))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*[range(n) for n in self.grid])

    def __len__(self) -> int:
        return math.prod(self.grid)

    def to_json(self) -> dict[str, Any]:
        return {"grid": list(self.grid), "files_map": [self.base, list(self.strides)]}

    @staticmethod
    def of(coords: Sequence[tuple[int, ...]], files: Sequence[int]) -> Grid | None:
        """The grid ``coords`` (sorted, distinct) fill with files ``files``,
        if they fill one with an affine map of non-negative strides."""
        if not coords or not coords[0] or any(coords[0]):
            return None
        grid = tuple(x + 1 for x in coords[-1])
        if math.prod(grid) != len(coords):
            return None  # sorted, distinct, inside [0, last]: as many as the grid holds only if they fill it
        base = files[0]
        strides = []
        for k in range(len(grid)):
            if grid[k] == 1:
                strides.append(0)
                continue
            unit = tuple(1 if j == k else 0 for j in range(len(grid)))
            strides.append(files[_c_index(unit, grid)] - base)
        g = Grid(grid, base, tuple(strides))
        if min(strides) < 0 or any(g.get(c) != fi for c, fi in zip(coords, files, strict=True)):
            return None
        return g


def _c_index(c: tuple[int, ...], grid: tuple[int, ...]) -> int:
    i = 0
    for x, n in zip(c, grid, strict=True):
        i = i * n + x
    return i


def _groups(f: _metadata.Fields, v: Any, nfiles: int) -> list[Mapping[tuple[int, ...], int]]:
    """The placements of rule positions: per group, {position: file index}
    (a :class:`Grid` for a group stored as one)."""
    out: list[Mapping[tuple[int, ...], int]] = []
    for i, g in enumerate(f.array(v, "groups")):
        fld = f"groups[{i}]"
        f.mapping(g, fld)
        if "grid" in g:
            # Every position of the grid, in file base + position . strides:
            # at most one position of a group per file, so no more than files.
            grid = tuple(f.shape(g["grid"], f"{fld}.grid"))
            fm = f.array(f.get(g, "files_map", f"{fld}.files_map"), f"{fld}.files_map", length=2)
            base = f.uint(fm[0], f"{fld}.files_map[0]")
            strides = tuple(f.shape(fm[1], f"{fld}.files_map[1]", ndim=len(grid)))
            n = 1
            for x in grid:
                n *= x
                if n > nfiles:
                    break
            if not grid or n < 1 or n > nfiles:
                f.fail(f"{fld}.grid", f"a grid of 1 to {nfiles} positions (one per file at most)", list(grid)[:8])
            last = base + sum((x - 1) * st for x, st in zip(grid, strides, strict=True))
            if last >= nfiles:
                f.fail(f"{fld}.files_map", f"files inside files (of {nfiles})", fm)
            out.append(Grid(grid, base, strides))
            continue
        coords = f.array(f.get(g, "coords", f"{fld}.coords"), f"{fld}.coords")
        fis = f.array(f.get(g, "files", f"{fld}.files"), f"{fld}.files", length=len(coords))
        where: dict[tuple[int, ...], int] = {}
        for j, (c, fi) in enumerate(zip(coords, fis, strict=True)):
            pos = tuple(f.shape(c, f"{fld}.coords[{j}]"))
            if f.uint(fi, f"{fld}.files[{j}]") >= nfiles:
                f.fail(f"{fld}.files[{j}]", f"an index into files (of {nfiles})", fi)
            if pos in where:
                f.fail(f"{fld}.coords[{j}]", "each position once", list(pos))
            where[pos] = fi
        out.append(where)
    return out


def _rule_entry(
    f: _metadata.Fields,
    name: str,
    g: dict[str, Any],
    gshape: tuple[int, ...],
    groups: Sequence[Mapping[tuple[int, ...], int]],
    proven: set[tuple[int, tuple[int, ...]]],
    fld: str,
) -> None:
    """A global tensor stored by a rule: the rule well formed and of this
    tensor, its group's positions exactly the rule's (so its pieces tile the
    tensor), its key a string."""
    try:
        rule = Rule.from_json(g["rule"])
    except LayoutError as e:
        f.fail(f"{fld}.rule", "a sharding rule", f"{e}")
    if rule.tensor != name or rule.shape != tuple(gshape):
        f.fail(
            f"{fld}.rule", f"a rule of {name[:100]!r} with shape {list(gshape)}", [rule.tensor[:100], list(rule.shape)]
        )
    parts = f.array(f.get(g, "parts", f"{fld}.parts"), f"{fld}.parts")
    if not parts:
        f.fail(f"{fld}.parts", "at least one [group, key]", parts)
    gis = []
    for j, part in enumerate(parts):
        f.array(part, f"{fld}.parts[{j}]", length=2)
        gi = f.uint(part[0], f"{fld}.parts[{j}][0]")
        if gi >= len(groups):
            f.fail(f"{fld}.parts[{j}][0]", f"an index into groups (of {len(groups)})", gi)
        f.string(part[1], f"{fld}.parts[{j}][1]", most=1 << 16)
        gis.append(gi)
    axes = rule.axes
    if len(gis) == 1 and (gis[0], axes) in proven:
        return
    one = groups[gis[0]]
    if len(gis) == 1 and isinstance(one, Grid) and one.grid == axes:
        proven.add((gis[0], axes))  # every position of the rule's axes, by construction
        return
    held: Any = groups[gis[0]].keys() if len(gis) == 1 else {c for gi in gis for c in groups[gi]}
    total = sum(len(groups[gi]) for gi in gis)
    if len(gis) > 1 and not rule.replicated and total != len(held):
        f.fail(f"{fld}.parts", "groups holding each position of the rule once", gis)
    want = 1
    for n in axes:
        want *= n
        if want > len(held):
            break
    if want != len(held) or not all(_inside(c, axes) for c in held):
        f.fail(f"{fld}.parts", f"groups holding each of the {want} positions of axes {list(axes)} once", gis)
    if len(gis) == 1:
        proven.add((gis[0], axes))


def _box(f: _metadata.Fields, v: Any, field: str, ndim: int) -> Box:
    parts = f.array(v, field, length=2)
    offs = f.shape(parts[0], f"{field}[0]", ndim=ndim)
    lens = f.shape(parts[1], f"{field}[1]", ndim=ndim)
    return Box.trusted(offs, lens)


def read_attachment(d: Path, m: dict[str, Any], name: str, limit: int = 1 << 30) -> bytes | None:
    """The bytes of an attachment the manifest lists (``checkpoint.json``),
    checked against the size and CRC-32 it recorded; None if not listed."""
    a = m.get("attachments", {}).get(name)
    if a is None:
        return None
    p = _paths.member(d, name, source=str(d / MANIFEST), field=f"attachments[{name!r}]")
    data = _paths.read_regular(p, limit, name)
    if len(data) != a["bytes"] or zlib.crc32(data) != a["crc32"]:
        raise ManifestError(
            f"{p}: does not match manifest.json ({len(data)} bytes, crc32 {zlib.crc32(data):08x}; the manifest "
            f"recorded {a['bytes']} bytes, crc32 {a['crc32']:08x}); the file is damaged or from another checkpoint",
            path=str(p),
        )
    return data


def _check_named(
    si: int, key: str, lay: Layout, held: Container[Any], pk: tuple[Any, ...], shape: Sequence[int], bad: Any
) -> None:
    """A piece ``pk`` that manifest.json gives stored tensor ``si`` (key
    ``key``) is one its data file's layout ``lay`` holds (``held``), with the
    global shape ``shape`` manifest.json gives its tensor."""
    if pk not in held:
        raise bad(
            f"stored[{si}] ({key!r}): manifest.json says it holds {pk[0]!r} box {list(pk[1])}, which its data "
            "file's layout does not"
        )
    if tuple(shape) != tuple(lay.global_shapes.get(pk[0], ())):
        raise bad(
            f"stored[{si}] ({key!r}): global tensor {pk[0]!r} has shape {list(shape)} in manifest.json and "
            f"{list(lay.global_shapes.get(pk[0], ()))} in the data file's layout"
        )


def _piece_key(name: str, box: Any, local: Any) -> tuple[Any, ...]:
    """A piece as ``(tensor, box, local)`` of tuples, comparable and hashable."""
    b = (tuple(box[0]), tuple(box[1]))
    lo = ("box", tuple(local[0]), tuple(local[1])) if isinstance(local, list) else ("flat", int(local))
    return (name, b, lo)


def _local_json(p: Piece) -> Any:
    return p.local.to_json() if isinstance(p.local, Box) else p.local


@dataclass
class ChunkTable:
    """The checksums of one record, as ``_core.read_ranges_verified`` takes them."""

    record: str
    data_offset: int
    size: int
    chunk: int
    algo: str
    sums: bytes

    def as_tuple(self) -> tuple[str, int, int, int, str, bytes]:
        return (self.record, self.data_offset, self.size, self.chunk, self.algo, self.sums)


_SCOPE: contextvars.ContextVar[list[Checkpoint] | None] = contextvars.ContextVar("tierstore_checkpoints", default=None)


@contextlib.contextmanager
def closing_scope() -> Iterator[None]:
    """Every :class:`Checkpoint` opened inside is closed at exit (the files
    decoded for its reads removed): a load's decoded copies last as long as
    the load. Nested scopes leave it to the outermost."""
    if _SCOPE.get() is not None:
        yield
        return
    opened: list[Checkpoint] = []
    token = _SCOPE.set(opened)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for ck in opened:
            ck.close()


@dataclass
class _FileView:
    """A data file of the checkpoint, opened: its zip directory, its own
    manifest, and that manifest's records and tensors by name."""

    path: str
    arch: _archive.Archive
    fm: dict[str, Any]
    offsets: dict[str, int]
    recs: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]

    def bad(self, detail: str) -> ManifestError:
        return ManifestError(
            f"{self.path}: the shard file does not match manifest.json: {detail}; the file is damaged or from "
            "another checkpoint or rank",
            path=self.path,
        )


class RuleIndex:
    """The saved pieces of a global tensor stored by a rule: the positions
    meeting a box are found in closed form (:meth:`Rule.coords_meeting`), and
    only their data files are opened."""

    def __init__(self, ck: Checkpoint, name: str, rule: Rule, g: dict[str, Any]) -> None:
        self.ck = ck
        self.name = name
        self.rule = rule
        self.shape = tuple(rule.shape)
        self.dtype = g["dtype"]
        self.itemsize = _itemsize(dtype_of(self.dtype))
        parts = g["parts"]
        # position -> (file, key): one part's group as it is, several merged.
        self.key = parts[0][1] if len(parts) == 1 else None
        self.where: dict[tuple[int, ...], Any] = ck.placements[parts[0][0]]
        if len(parts) > 1:
            self.where = {}
            for gi, key in parts:
                for c, fi in ck.placements[gi].items():
                    self.where.setdefault(c, (fi, key))
        self._sources: dict[tuple[int, ...], list[Source]] = {}

    def sources_at(self, coords: tuple[int, ...]) -> list[Source]:
        """The pieces of position ``coords``, from the rule alone: their
        ``offset`` is -1 until :meth:`Checkpoint.resolve` finds it in the data
        file's own manifest (planning reads no file)."""
        got = self._sources.get(coords)
        if got is None:
            fi, key = (self.where[coords], self.key) if self.key is not None else self.where[coords]
            lay = self.rule.layout_at(coords)
            got = [Source(fi, -1, lay.local_shape, self.itemsize, p, key=key, coords=coords) for p in lay.pieces]
            self._sources[coords] = got
        return got

    def all_sources(self) -> list[Source]:
        return [s for c in sorted(self.where) for s in self.sources_at(c)]

    def check_positions(self) -> None:
        """Every position against its data file (the rule, position, dtype
        and shape the file recorded), those that hold no element included:
        a manifest that shrinks a tensor to nothing is refused too."""
        for c in sorted(self.where):
            fi, key = (self.where[c], self.key) if self.key is not None else self.where[c]
            self.ck.rule_source(fi, key, self.rule, c, self.dtype)

    def overlapping(self, box: Box) -> list[tuple[Source, Box]]:
        out = []
        for coords in self.rule.coords_meeting(box):
            for src in self.sources_at(coords):
                inter = src.piece.box.intersect(box)
                if inter is not None:
                    out.append((src, inter))
        return out


class _FilePaths(Sequence[Path]):
    """The paths of a checkpoint's data files (their entries read when used)."""

    def __init__(self, d: Path, files: Sequence[Any]) -> None:
        self.d, self.entries = d, files

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Path]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: Any) -> Any:
        return self.d / self.entries[i]["name"]


class Checkpoint:
    """A committed sharded checkpoint: its checked manifest, indexed for
    planning, and its data files, each checked against the manifest when it
    is first used (:meth:`check_file`)."""

    def __init__(self, path: str | os.PathLike[str], alternates: Sequence[str | os.PathLike[str]] = ()) -> None:
        self.dir = Path(path)
        self.manifest_path = str(self.dir / MANIFEST)
        self.manifest = read_manifest(path)
        m = self.manifest
        self.version = int(m["format_version"])
        self.files = _FilePaths(self.dir, m["files"])
        # Other copies of this checkpoint (a Checkpointer's farther tiers, or
        # this node's copy and the remote one): each data or objects file is
        # taken from the first copy where it is present and matches the
        # manifest (its length and manifest record's CRC-32).
        self.copies = [self.dir, *(Path(a) for a in alternates)]
        self.excluded: set[tuple[str, str]] = set()  # (copy, file name) found damaged: not used again
        # A codec tier's copy holds its files encoded (``<name>.tsd``): they
        # are decoded, bit-exact, into a private folder removed with this object.
        self._decoder = _tier_codec.Decoder()
        weakref.finalize(self, self._decoder.close)
        opened = _SCOPE.get()
        if opened is not None:
            opened.append(self)
        self.bytes_by_copy: dict[str, int] = {}
        self.objects_copy: dict[str, str] = {}  # objects file -> the copy it was read from
        self._path_of: dict[int, str] = {}
        stored = m["stored"]
        self.stored = stored
        self._stored_in: dict[int, list[int]] = {}
        for si, s in enumerate(stored):
            self._stored_in.setdefault(s["file"], []).append(si)
        self._checked: dict[int, dict[str, ChunkTable]] = {}
        self._views: dict[int, _FileView] = {}
        self._tiled: set[str] = set()
        # Per group of rule positions: {position: file index} (version 3).
        self.placements: Any = m["groups"]
        self.index_file: _index.Index | None = m.get("index_file")
        # stored index -> the pieces manifest.json says it holds, in a form
        # comparable with the layout the data file recorded for the tensor.
        self._pieces_of: dict[int, list[tuple[Any, ...]]] = {}
        if self.index_file is None:
            for name, g in m["tensors"].items():
                for sidx, box, local in g.get("pieces", ()):
                    self._pieces_of.setdefault(sidx, []).append(_piece_key(name, box, local))
        # (An indexed manifest's explicit pieces are checked against their files
        # as their tensors are looked up: see _check_piece.)
        self._file_layouts: dict[int, Layout] = {}
        self._index: dict[str, GlobalIndex | RuleIndex] = {}
        self._resolved: dict[tuple[int, str, str], int] = {}
        # (file, key) -> the layout the data file recorded for a rule
        # position, and its rules by rule (a shared buffer's members).
        self._rule_layouts: dict[tuple[int, str], tuple[Layout, dict[Rule, tuple[int, ...]]]] = {}

    def lookup(self, name: str) -> GlobalIndex | RuleIndex | None:
        """The saved pieces of global tensor ``name``, indexed for queries by
        box (built when first asked for: a loading rank pays for the tensors
        it loads, not for every tensor of the checkpoint); None if absent."""
        got = self._index.get(name)
        if got is not None:
            return got
        g = self.manifest["tensors"].get(name)
        if g is None:
            return None
        if "rule" in g:
            got = RuleIndex(self, name, Rule.from_json(g["rule"]), g)
        else:
            item = _itemsize(dtype_of(g["dtype"]))
            sources = []
            for sidx, box, local in g["pieces"]:
                s = self.stored[sidx]
                if self.index_file is not None:
                    self._check_piece(sidx, name, box, local, g["shape"])
                piece_local: Box | int = Box.from_json(local) if isinstance(local, list) else int(local)
                sources.append(
                    Source(
                        file=s["file"],
                        offset=s["offset"],
                        local_shape=tuple(s["shape"]),
                        itemsize=item,
                        piece=Piece(name, Box.from_json(box), piece_local),
                        stored=sidx,
                    )
                )
            got = GlobalIndex.build(g["shape"], sources)
        self._index[name] = got
        return got

    @property
    def index(self) -> dict[str, GlobalIndex | RuleIndex]:
        """Every global tensor's index (builds them all; planning uses :meth:`lookup`)."""
        for name in self.manifest["tensors"]:
            self.lookup(name)
        return self._index

    def dtype_of(self, name: str) -> torch.dtype:
        return dtype_of(self.manifest["tensors"][name]["dtype"])

    def check_tensor(self, name: str) -> None:
        """Proves (once) that the saved pieces of global tensor ``name`` tile
        it exactly: the planner relies on it for every region it reads. (A
        rule's positions were proven complete when the manifest was read.)"""
        if name in self._tiled:
            return
        idx = self.lookup(name)
        if isinstance(idx, GlobalIndex):
            prove_tiling_arrays(name, idx.shape, idx.lo, idx.hi, self.manifest_path)
        self._tiled.add(name)

    def _view(self, fi: int) -> _FileView:
        """Data file ``fi`` opened and checked against its files[] entry (its
        length and its manifest record's CRC-32), once."""
        known = self._views.get(fi)
        if known is not None:
            return known
        fe = self.manifest["files"][fi]
        view, c = self._from_copies(fe["name"], lambda c: self._open_view(fi, fe, c), "shard")
        self._views[fi] = view
        self._path_of[fi] = str(c)
        return view

    def _from_copies(self, name: str, open_in: Callable[[Path], _T], what: str) -> tuple[_T, Path]:
        """``open_in(copy)`` for the first copy of the checkpoint where file
        ``name`` opens and matches the manifest (a warning names a copy
        that held it damaged); the first copy's error when none does."""
        first: TierstoreError | None = None
        for c in self.copies:
            if (str(c), name) in self.excluded:
                continue
            try:
                got = open_in(c)
            except TierstoreError as e:  # missing or not this checkpoint's file here: the next copy
                first = first or e
                continue
            if first is not None and not isinstance(first, NotFoundError):
                warnings.warn(f"tierstore: {first}; reading {name} from {c} instead", stacklevel=4)
            return got, c
        if first is None:
            p = str(self.dir / name)
            first = NotFoundError(f"{p}: {what} file of the checkpoint is missing (every copy excluded)", path=p)
        raise first

    def copy_of(self, fi: int) -> str:
        """The directory data file ``fi`` is read from (after :meth:`check_file`)."""
        return self._path_of.get(fi, str(self.dir))

    def path_of(self, fi: int) -> str:
        """The path data file ``fi`` is read from (after :meth:`check_file`)."""
        return self._views[fi].path if fi in self._views else str(self.files[fi])

    def count_read(self, fi: int, n: int) -> None:
        c = self.copy_of(fi)
        self.bytes_by_copy[c] = self.bytes_by_copy.get(c, 0) + n

    def _open_view(self, fi: int, fe: dict[str, Any], copy: Path) -> _FileView:
        p = str(self._member(copy, fe["name"], f"files[{fi}].name"))
        if not os.path.exists(p):
            raise NotFoundError(f"{p}: shard file of the checkpoint is missing", path=p)
        arch, fm, offsets = _archive.open_archive(p)
        where = f"{self.manifest_path}: files[{fi}] ({fe['name']})"
        view = _FileView(p, arch, fm or {}, offsets, {}, {})
        if arch.file_len != fe["bytes"]:
            raise view.bad(f"it is {arch.file_len} bytes long, the manifest says {fe['bytes']} ({where})")
        if fm is None:
            raise view.bad("it has no tierstore manifest record")
        if self.version >= 2:
            mcrc = arch.records[manifest.MANIFEST_NAME].crc32
            if mcrc != fe["manifest_crc32"]:
                raise view.bad(
                    f"its manifest record has crc32 {mcrc:08x}, manifest.json recorded {fe['manifest_crc32']:08x}"
                )
        view.recs.update({r["name"]: r for r in fm["records"] if isinstance(r, dict)})
        for t in fm.get("tensors", []):
            path = t.get("path") if isinstance(t, dict) else None
            if isinstance(path, list) and len(path) == 2 and path[0] == "tensors" and isinstance(path[1], str):
                view.tensors[path[1]] = t
        if view.tensors:
            self._check_pickle(view)
        self._check_key_paths(view.path, fm, list(view.tensors))
        return view

    def _check_key_paths(self, path: str, fm: dict[str, Any], keys: list[str]) -> None:
        """A data or objects file written since it records them holds the key
        paths of its keys (``key_paths``): manifest.json's ``paths`` must say
        the same of each, so that a re-sealed manifest.json that drops, adds
        or changes a path (an integer key read back as a string) is refused."""
        kp = fm.get("key_paths")
        if kp is None:
            return  # a file written before files recorded them
        if not isinstance(kp, dict):
            raise ManifestError(f"{path}: its manifest's key_paths is not a mapping", path=path)
        paths = self.manifest.get("paths", {})
        for key in keys:
            mine = kp.get(key)
            got = _tree.check_path(mine, key) if mine is not None else None
            if mine is not None and got is None:
                raise ManifestError(
                    f"{path}: its manifest's key_paths[{key[:100]!r}] is not a path of the key", path=path
                )
            said = paths.get(key)
            if (tuple(said) if said is not None else None) != got:
                raise ManifestError(
                    f"{path}: the file records the key path of {key[:100]!r} as {mine!r:.200}, manifest.json "
                    f"says {said!r:.200}; manifest.json or the file is damaged or from another checkpoint",
                    path=path,
                )

    @staticmethod
    def _check_pickle(view: _FileView) -> None:
        """The file's own manifest must say of each tensor what its pickle
        says: the same storage record, offset, shape, stride and dtype. The
        pickle is the second witness: a manifest rewritten to point a tensor
        at another record of the same size (its checksums fixed up) is
        caught here, where each record's own checksum cannot catch it."""
        rel = str(view.fm.get("pickle") or "data.pkl")
        rec = view.arch.records.get(rel)
        off = view.offsets.get(rel)
        if rec is None or off is None:
            raise view.bad(f"it has no record '{rel}'")
        if rec.size > manifest.MAX_MANIFEST_BYTES:
            raise view.bad(f"its record '{rel}' is {rec.size} bytes")
        data = _archive.load_small(view.arch, off, rec.size, rel)
        _archive.check_crc(view.path, view.arch.full(rel), data, rec.crc32)
        pickled = _pickle.tensor_views(data, view.path)
        for key, t in view.tensors.items():
            v = pickled.get(("tensors", key))
            said = (t.get("record"), t.get("dtype"), t.get("shape"), t.get("stride"), t.get("storage_offset"))
            if v is None or said != (f"data/{v.key}", v.dtype, v.shape, v.stride, v.storage_offset):
                was = "nothing" if v is None else f"record 'data/{v.key}' {v.dtype} {v.shape} at {v.storage_offset}"
                raise view.bad(
                    f"its manifest puts tensor {key!r} in record {t.get('record')!r} {t.get('dtype')} "
                    f"{t.get('shape')} at {t.get('storage_offset')}, its {rel} says {was}"
                )
        extra = sorted(str(p[1]) for p in pickled if len(p) == 2 and p[0] == "tensors" and p[1] not in view.tensors)
        if extra:
            raise view.bad(f"its {rel} holds tensors its manifest does not list ({', '.join(extra[:5])})")

    def check_file(self, fi: int) -> dict[str, ChunkTable]:
        """Checks data file ``fi`` against the manifest (once) and returns the
        chunk table of each record its stored tensors are in (and of those
        of rule positions looked up so far)."""
        got = self._checked.get(fi)
        if got is not None:
            return got
        view = self._view(fi)
        p, bad = view.path, view.bad
        tables: dict[str, ChunkTable] = {}
        for si in self._stored_in.get(fi, ()):
            s = self.stored[si]
            key, rname = s["key"], s["record"]
            t = view.tensors.get(key)
            r = view.recs.get(rname)
            if t is None or r is None:
                raise bad(f"stored[{si}] names tensor {key!r} in record '{rname}', which the file does not hold")
            dt = dtype_of(s["dtype"], p, f"stored[{si}].dtype")
            item = _itemsize(dt)
            shape = list(s["shape"])
            contiguous = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
            so = t.get("storage_offset")
            checks = [
                (t.get("record") == rname, f"tensor {key!r} is in record {t.get('record')!r}"),
                (t.get("dtype") == s["dtype"], f"tensor {key!r} has dtype {t.get('dtype')!r}, not {s['dtype']!r}"),
                (t.get("shape") == shape, f"tensor {key!r} has shape {t.get('shape')!r}, not {shape}"),
                (
                    t.get("stride") == contiguous or math.prod(shape) <= 1,
                    f"tensor {key!r} has stride {t.get('stride')!r}; shards are stored contiguously",
                ),
                (isinstance(so, int) and not isinstance(so, bool) and so >= 0, f"tensor {key!r}: bad storage_offset"),
                (r.get("kind") == "storage", f"record '{rname}' is not a storage"),
                (r["offset"] == s["record_offset"], f"record '{rname}' starts at {r['offset']}"),
                (r["size"] == s["record_size"], f"record '{rname}' is {r['size']} bytes"),
                (r["crc32"] == s["crc32"], f"record '{rname}' has crc32 {r['crc32']:08x}"),
            ]
            for ok, detail in checks:
                if not ok:
                    raise bad(f"stored[{si}] ({key!r}): {detail}")
            assert isinstance(so, int)
            if s["offset"] != r["offset"] + so * item:
                raise bad(f"stored[{si}] ({key!r}): offset {s['offset']} is not where the tensor starts")
            if self.version >= 2:
                self._check_layout(si, s, t.get("layout"), bad)
            if rname not in tables:
                tables[rname] = self._table(p, view.arch, view.fm, view.offsets, r)
        self._checked[fi] = tables
        return tables

    def resolve(self, src: Source) -> Source:
        """``src`` with its offset in its data file: a rule position's found
        (and checked) in the file's own manifest; others as they are."""
        if src.offset >= 0:
            return src
        # Per tensor: a shared buffer holds several rules under one key, each checked.
        got = self._resolved.get((src.file, src.key, src.piece.tensor))
        if got is None:
            idx = self.lookup(src.piece.tensor)
            assert isinstance(idx, RuleIndex)
            got = self._resolved[(src.file, src.key, src.piece.tensor)] = self.rule_source(
                src.file, src.key, idx.rule, src.coords, idx.dtype
            )[0]
        return dataclasses.replace(src, offset=got)

    def rule_source(self, fi: int, key: str, rule: Rule, coords: tuple[int, ...], dtype: str) -> tuple[int, Layout]:
        """Where the tensor of rule position ``coords`` starts in data file
        ``fi`` (stored under ``key``), and its layout, checked against the
        file's own manifest: the file must record that key with the same
        rule and position, the dtype, the rule's local shape, stored
        contiguously inside a storage record (whose chunk table joins the
        file's tables)."""
        view = self._view(fi)
        tables = self.check_file(fi)
        bad = view.bad
        t = view.tensors.get(key)
        what = f"position {list(coords)} of the rule of {rule.tensor!r} (key {key!r})"
        if t is None:
            raise bad(f"{what}: the file holds no tensor {key!r}")
        known = self._rule_layouts.get((fi, key))
        if known is None:
            try:
                lay = Layout.from_json(t["layout"])
            except Exception as e:  # any malformed layout in the data file
                raise bad(f"{what}: the file records no valid layout for it ({type(e).__name__})") from None
            known = self._rule_layouts[(fi, key)] = (lay, {r: c for r, c in lay.rules})
        lay, members = known
        if lay.rule is None and lay.rules:
            # A buffer several rules share (ZeRO-1/2): this member's rule at this position.
            at = members.get(rule)
            if at is None:
                raise bad(f"{what}: the file records no such rule among the {len(lay.rules)} of its buffer")
            if at != coords:
                raise bad(f"{what}: the file records it at position {list(at)}")
        elif lay.rule != rule:
            got = json.dumps(lay.rule.to_json())[:200] if lay.rule is not None else "no rule"
            raise bad(f"{what}: the file records another layout for it ({got})")
        elif lay.coords != coords:
            raise bad(f"{what}: the file records it at position {list(lay.coords)}")
        local = rule.layout_at(coords)
        shape = list(local.local_shape)
        r = view.recs.get(str(t.get("record")))
        so = t.get("storage_offset")
        item = _itemsize(dtype_of(dtype, view.path))
        contiguous = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        checks = [
            (t.get("dtype") == dtype, f"dtype {t.get('dtype')!r}, not {dtype!r}"),
            (t.get("shape") == shape, f"shape {t.get('shape')!r}, not the rule's {shape}"),
            (t.get("stride") == contiguous or math.prod(shape) <= 1, f"stride {t.get('stride')!r}, not contiguous"),
            (isinstance(so, int) and not isinstance(so, bool) and so >= 0, "a bad storage_offset"),
            (r is not None and r.get("kind") == "storage", f"record {t.get('record')!r}, not a storage"),
        ]
        for ok, detail in checks:
            if not ok:
                raise bad(f"{what}: the file's tensor has {detail}")
        assert r is not None and isinstance(so, int)
        if (so + math.prod(shape)) * item > r["size"]:
            raise bad(f"{what}: the tensor runs past the end of its record '{r['name']}'")
        if r["name"] not in tables:
            tables[r["name"]] = self._table(view.path, view.arch, view.fm, view.offsets, r)
        return r["offset"] + so * item, local

    def saved_view(self, name: str) -> tuple[Any, ...] | None:
        """What global tensor ``name``'s saved bytes are, as the files' own
        manifests (checked against their pickles when opened) describe them:
        its shape, dtype, split and, for each piece, the file, record, offset,
        shape and stride it is read from. Two tensors with equal views hold
        the same values from the same bytes (tied weights: ``save_sharded``
        writes their storage once). None when a piece cannot be described."""
        g = self.manifest["tensors"].get(name)
        if g is None:
            return None
        head: tuple[Any, ...] = (tuple(g["shape"]), g["dtype"])
        if "rule" in g:
            rule = json.dumps({k: v for k, v in g["rule"].items() if k != "tensor"}, sort_keys=True)
            parts: list[tuple[Any, ...]] = []
            for gi, key in g["parts"]:
                for _coords, fi in sorted(self.manifest["groups"][gi].items()):  # position -> file
                    t = self._view(fi).tensors.get(key)
                    if t is None:
                        return None
                    parts.append(
                        (fi, t.get("record"), t.get("storage_offset"), json.dumps(t.get("shape")),
                         json.dumps(t.get("stride")), t.get("dtype"))
                    )  # fmt: skip
            return (*head, rule, tuple(parts))
        pieces = tuple(
            (self.stored[si]["file"], self.stored[si]["offset"], json.dumps(self.stored[si]["shape"]),
             json.dumps(box), json.dumps(local))
            for si, box, local in g["pieces"]
        )  # fmt: skip
        return (*head, pieces)

    def check_all_files(self) -> None:
        """Checks every data file against the manifest (for readers that take
        the manifest's word for whole tensors: consolidate, verify), every
        rule position included."""
        for fi in range(len(self.files)):
            self.check_file(fi)
        for name, g in self.manifest["tensors"].items():
            if "rule" in g:
                idx = self.lookup(name)
                assert isinstance(idx, RuleIndex)
                idx.check_positions()

    def _check_piece(self, si: int, name: str, box: Any, local: Any, shape: Any) -> None:
        """One piece an indexed manifest gives stored tensor ``si``, against the
        layout its data file recorded (as :meth:`_check_layout` does for the
        pieces of a manifest read whole)."""
        lay = self._file_layouts.get(si)
        s = self.stored[si]
        view = self._view(s["file"])
        if lay is None:
            t = view.tensors.get(s["key"])
            try:
                lay = Layout.from_json(t["layout"] if isinstance(t, dict) else None)  # type: ignore[arg-type]
            except Exception as e:  # any malformed layout in the data file
                raise view.bad(f"stored[{si}] ({s['key']!r}): the file records no valid layout for it "
                               f"({type(e).__name__})") from None  # fmt: skip
            self._file_layouts[si] = lay
        held = {_piece_key(p.tensor, p.box.to_json(), _local_json(p)) for p in lay.pieces}
        _check_named(si, s["key"], lay, held, _piece_key(name, box, local), shape, view.bad)

    def _check_layout(self, si: int, s: dict[str, Any], lay_json: Any, bad: Any) -> None:
        """The pieces manifest.json gives stored tensor ``si`` against the
        layout its data file recorded for it: every piece it names must be
        one the file holds, with the same global shape, and every piece of
        the file's no global tensor references must be a replica (held and
        referenced elsewhere). So no manifest can move, drop, reshape or
        transpose what a data file says it holds."""
        key = s["key"]
        try:
            lay = Layout.from_json(lay_json)
        except Exception as e:  # any malformed layout in the data file
            raise bad(f"stored[{si}] ({key!r}): the file records no valid layout for it ({type(e).__name__})") from None
        if lay.local_shape != tuple(s["shape"]):
            raise bad(f"stored[{si}] ({key!r}): the file's layout is for a local shape {list(lay.local_shape)}")
        if self.index_file is not None:
            return  # each piece is checked as its tensor is looked up (_check_piece)
        held = {_piece_key(p.tensor, p.box.to_json(), _local_json(p)): p for p in lay.pieces}
        named = self._pieces_of.get(si, [])
        tensors = self.manifest["tensors"]
        for pk in named:
            _check_named(si, key, lay, held, pk, tensors[pk[0]]["shape"], bad)
        left = set(held) - set(named)
        for pk in left:
            p = held[pk]
            if not lay.is_replica(p):
                raise bad(
                    f"stored[{si}] ({key!r}): its piece of {p.tensor!r} box {list(pk[1])} is referenced by no "
                    "global tensor of manifest.json"
                )

    def check_objects_file(self, name: str) -> Path:
        """The objects file ``name``, checked against the manifest's record of
        it (its length and the CRC-32 of its manifest record; version 2),
        from the first copy of the checkpoint that holds it intact."""
        p, c = self._from_copies(name, lambda c: self._objects_file_in(c, name), "objects")
        self.objects_copy[name] = str(c)
        return p

    def close(self) -> None:
        """Removes the files decoded for this checkpoint's reads (a codec
        tier's copy); its metadata stays usable, its data files do not."""
        self._decoder.close()

    def _member(self, copy: Path, name: str, field: str, whole: bool = False) -> Path:
        """File ``name`` of ``copy`` (confined to it); where the copy holds
        it encoded, the decoded file: its records decoded as reads need
        them (:meth:`prepare_read`), or all of them (``whole``)."""
        p = _paths.member(copy, name, source=self.manifest_path, field=field)
        if not p.exists():
            enc = _tier_codec.encoded_of(p.parent, p.name)
            if enc is not None:
                out = self._decoder.raw(enc)
                if whole:
                    self._decoder.ensure_all(out)
                return out
        return p

    def is_decoding(self, fi: int) -> bool:
        """Whether data file ``fi`` is read from an encoded file's decoding."""
        return self._decoder.decodes(self.path_of(fi))

    def decode_into(self, fi: int, at: int, length: int, addr: int) -> bool:
        """Where data file ``fi`` is an encoded file's decoding and its bytes
        ``[at, at + length)`` are one record not yet decoded: decodes them
        straight into the memory at ``addr`` (True). False: read the file."""
        return self._decoder.decode_into(self.path_of(fi), at, length, addr)

    def prepare_read(self, fi: int, spans: list[tuple[int, int]] | None) -> None:
        """Before data file ``fi`` is read at the byte ranges ``spans``
        (None: all of it): where it is an encoded file's decoding, the
        records those ranges touch are decoded (and their references')."""
        path = self.path_of(fi)
        if spans is None:
            self._decoder.ensure_all(path)
        else:
            self._decoder.ensure(path, spans)

    def _objects_file_in(self, copy: Path, name: str) -> Path:
        p = self._member(copy, name, "objects", whole=True)
        if self.version < 2:
            return p
        want = next((o for o in self.manifest["object_files"] if o["name"] == name), None)
        if want is None:
            raise ManifestError(
                f"{self.manifest_path}: objects file {name!r} is not in object_files", path=self.manifest_path
            )
        if not p.exists():
            raise NotFoundError(f"{p}: objects file of the checkpoint is missing", path=str(p))
        arch = _archive.open_directory(str(p))
        entry = arch.records.get(manifest.MANIFEST_NAME)
        if arch.file_len != want["bytes"] or entry is None or entry.crc32 != want["manifest_crc32"]:
            raise ManifestError(
                f"{p}: the objects file does not match manifest.json ({arch.file_len} bytes, the manifest says "
                f"{want['bytes']}, or another manifest record); it is damaged or from another checkpoint or rank",
                path=str(p),
            )
        fm = _archive.read_manifest(str(p), arch)
        if fm is not None:
            m = self.manifest
            keys = [k for k, f in m["objects"].items() if f == name]
            keys += [k for k, held in m["per_rank_objects"].items() if name in held.values()]
            self._check_key_paths(str(p), fm, keys)
        return p

    def _table(
        self, p: str, arch: _archive.Archive, fm: dict[str, Any], offsets: dict[str, int], r: dict[str, Any]
    ) -> ChunkTable:
        c = r.get("chunks")
        name = arch.full(r["name"])
        if c is None:
            # No chunk checksums (version 1): the record's CRC-32 is one chunk.
            whole = r["crc32"].to_bytes(4, "little") if r["size"] else b""  # an empty record has no chunk
            return ChunkTable(name, r["offset"], r["size"], max(r["size"], 1), "crc32", whole)
        f = _metadata.Fields(f"{p}: record '{manifest.MANIFEST_NAME}': records[{r['name']!r}].chunks")
        f.mapping(c, "chunks")
        size = f.uint(f.get(c, "size", "size"), "size", most=1 << 30)
        algo = f.string(f.get(c, "algo", "algo"), "algo")
        at = f.uint(f.get(c, "at", "at"), "at")
        count = f.uint(f.get(c, "count", "count"), "count")
        crc = f.uint(f.get(c, "crc32", "crc32"), "crc32", most=_U32)
        if size < 1 or algo not in ("crc32", "crc32c"):
            f.fail("chunks", "a positive chunk size and algo crc32 or crc32c", c)
        if count != -(-r["size"] // size):
            f.fail("count", f"{-(-r['size'] // size)} chunks of {size} bytes for {r['size']} bytes", count)
        trec = arch.records.get(manifest.CHUNKS_NAME)
        if trec is None or at + 4 * count > trec.size:
            f.fail("at", f"a part of record '{manifest.CHUNKS_NAME}'", at)
        sums = _archive.load_small(arch, offsets[manifest.CHUNKS_NAME] + at, 4 * count, "chunk checksums")
        if zlib.crc32(sums) != crc:
            raise ManifestError(
                f"{p}: record '{arch.full(manifest.CHUNKS_NAME)}': the chunk checksums of record '{name}' are "
                f"damaged (crc32 {zlib.crc32(sums):08x}, expected {crc:08x})",
                path=p,
                record=arch.full(manifest.CHUNKS_NAME),
            )
        return ChunkTable(name, r["offset"], r["size"], size, algo, sums)
