"""A sharded checkpoint's ``manifest.json``: written, read and checked.

Nothing a manifest says is used before it is checked: the file's checksum
(format version 2 and later; see :mod:`tierstore._metadata`), then every
field's type and range, every name confined to the checkpoint directory
(:mod:`tierstore._paths`), every piece inside its global tensor and inside
the stored local tensor it reads from, every stored tensor's global dtype
equal to its stored dtype. A large manifest's global tensors and rule groups
live in an index file read in part (:mod:`tierstore._index`). The data files
are checked against the manifest where they are opened
(:class:`tierstore.shardmeta.Checkpoint`).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import os
import stat
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from tierstore import _index, _metadata, _paths, _tree
from tierstore._fs import write_atomic
from tierstore.errors import LayoutError, ManifestError, MissingKeyError, NotFoundError
from tierstore.layout import Box, Rule
from tierstore.layout import position_inside as _inside

MANIFEST = "manifest.json"
FORMAT = "tierstore-sharded"
FORMAT_VERSION = 3
# The largest manifest.json read (a damaged or hostile one is refused before
# it is read).
MAX_MANIFEST_BYTES = 4 << 30
_U32 = 0xFFFFFFFF

_T = TypeVar("_T")


def dtype_of(name: Any, where: str = "checkpoint manifest", field: str = "dtype") -> torch.dtype:
    dt = _metadata.dtype_named(name)
    if dt is None:
        raise ManifestError(f"{where}: {field}: unknown dtype {str(name)[:80]!r}", path=where, record=field)
    return dt


def itemsize(dt: torch.dtype) -> int:
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
        nbytes = math.prod(shape) * itemsize(dt)
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
