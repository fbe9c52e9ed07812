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

import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstore import _archive, _metadata, _paths, manifest
from tierstore._fs import write_atomic
from tierstore.errors import ManifestError, NotFoundError
from tierstore.layout import Box, Piece
from tierstore.reshard import GlobalIndex, Source, prove_tiling_arrays

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "Checkpoint", "dtype_of", "read_manifest", "write_manifest"]

MANIFEST = "manifest.json"
FORMAT = "tierstore-sharded"
FORMAT_VERSION = 2
# The largest manifest.json read (a damaged or hostile one is refused before
# it is read).
MAX_MANIFEST_BYTES = 4 << 30
_U32 = 0xFFFFFFFF


def dtype_of(name: Any, where: str = "checkpoint manifest", field: str = "dtype") -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"{where}: {field}: unknown dtype {str(name)[:80]!r}", path=where, record=field)
    return dt


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def write_manifest(d: Path, m: dict[str, Any], durable: bool = True) -> None:
    write_atomic(d / MANIFEST, _metadata.dumps(m), durable)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the sharded checkpoint at ``path``."""
    d = Path(path)
    mp = d / MANIFEST
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
        f.fail("format_version", "1 or 2", v)
    if v >= 2 and not _metadata._TRAILER.search(data):
        raise ManifestError(f"{where}: format_version {v} requires a checksum and the file has none", path=where)
    f.string(f.get(m, "save_id", "save_id"), "save_id", most=64)
    world = f.uint(f.get(m, "world_size", "world_size"), "world_size", most=1 << 24)
    if world < 1:
        f.fail("world_size", "at least 1", world)
    files = f.array(f.get(m, "files", "files"), "files")
    for i, fe in enumerate(files):
        fld = f"files[{i}]"
        f.mapping(fe, fld)
        f.uint(f.get(fe, "rank", f"{fld}.rank"), f"{fld}.rank", most=world - 1)
        _paths.member(d, f.get(fe, "name", f"{fld}.name"), source=where, field=f"{fld}.name")
        f.uint(f.get(fe, "bytes", f"{fld}.bytes"), f"{fld}.bytes")
        if v >= 2:
            f.uint(f.get(fe, "manifest_crc32", f"{fld}.manifest_crc32"), f"{fld}.manifest_crc32", most=_U32)
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
    tensors = f.mapping(f.get(m, "tensors", "tensors"), "tensors")
    for name, g in tensors.items():
        fld = f"tensors[{name[:100]!r}]"
        f.mapping(g, fld)
        gshape = f.shape(f.get(g, "shape", f"{fld}.shape"), f"{fld}.shape")
        dtype_of(f.get(g, "dtype", f"{fld}.dtype"), where, f"{fld}.dtype")
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
    for k, pth in paths.items():
        fld = f"paths[{k[:100]!r}]"
        if k not in held:
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


class Checkpoint:
    """A committed sharded checkpoint: its checked manifest, indexed for
    planning, and its data files, each checked against the manifest when it
    is first used (:meth:`check_file`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.dir = Path(path)
        self.manifest_path = str(self.dir / MANIFEST)
        self.manifest = read_manifest(path)
        m = self.manifest
        self.version = int(m["format_version"])
        self.files = [self.dir / f["name"] for f in m["files"]]
        stored = m["stored"]
        self.stored = stored
        self._checked: dict[int, dict[str, ChunkTable]] = {}
        self._tiled: set[str] = set()
        # stored index -> the pieces manifest.json says it holds, in a form
        # comparable with the layout the data file recorded for the tensor.
        self._pieces_of: dict[int, list[tuple[Any, ...]]] = {}
        for name, g in m["tensors"].items():
            for sidx, box, local in g["pieces"]:
                self._pieces_of.setdefault(sidx, []).append(_piece_key(name, box, local))
        self.index: dict[str, GlobalIndex] = {}
        items = {name: _itemsize(dtype_of(g["dtype"])) for name, g in m["tensors"].items()}
        for name, g in m["tensors"].items():
            sources = []
            for sidx, box, local in g["pieces"]:
                s = stored[sidx]
                piece_local: Box | int = Box.from_json(local) if isinstance(local, list) else int(local)
                sources.append(
                    Source(
                        file=s["file"],
                        offset=s["offset"],
                        local_shape=tuple(s["shape"]),
                        itemsize=items[name],
                        piece=Piece(name, Box.from_json(box), piece_local),
                        stored=sidx,
                    )
                )
            self.index[name] = GlobalIndex.build(g["shape"], sources)

    def dtype_of(self, name: str) -> torch.dtype:
        return dtype_of(self.manifest["tensors"][name]["dtype"])

    def check_tensor(self, name: str) -> None:
        """Proves (once) that the saved pieces of global tensor ``name`` tile
        it exactly: the planner relies on it for every region it reads."""
        if name in self._tiled:
            return
        idx = self.index[name]
        prove_tiling_arrays(name, idx.shape, idx.lo, idx.hi, self.manifest_path)
        self._tiled.add(name)

    def check_file(self, fi: int) -> dict[str, ChunkTable]:
        """Checks data file ``fi`` against the manifest (once) and returns the
        chunk table of each record its stored tensors are in."""
        got = self._checked.get(fi)
        if got is not None:
            return got
        fe = self.manifest["files"][fi]
        p = str(self.files[fi])
        if not os.path.exists(p):
            raise NotFoundError(f"{p}: shard file of the checkpoint is missing", path=p)
        arch, fm, offsets = _archive.open_archive(p)
        where = f"{self.manifest_path}: files[{fi}] ({fe['name']})"

        def bad(detail: str) -> ManifestError:
            return ManifestError(
                f"{p}: the shard file does not match manifest.json: {detail}; the file is damaged or from another "
                "checkpoint or rank",
                path=p,
            )

        if arch.file_len != fe["bytes"]:
            raise bad(f"it is {arch.file_len} bytes long, the manifest says {fe['bytes']} ({where})")
        if fm is None:
            raise bad("it has no tierstore manifest record")
        if self.version >= 2:
            mcrc = arch.records[manifest.MANIFEST_NAME].crc32
            if mcrc != fe["manifest_crc32"]:
                raise bad(
                    f"its manifest record has crc32 {mcrc:08x}, manifest.json recorded {fe['manifest_crc32']:08x}"
                )
        recs = {r["name"]: r for r in fm["records"] if isinstance(r, dict)}
        tens: dict[str, dict[str, Any]] = {}
        for t in fm.get("tensors", []):
            path = t.get("path") if isinstance(t, dict) else None
            if isinstance(path, list) and len(path) == 2 and path[0] == "tensors" and isinstance(path[1], str):
                tens[path[1]] = t
        tables: dict[str, ChunkTable] = {}
        for si, s in enumerate(self.stored):
            if s["file"] != fi:
                continue
            key, rname = s["key"], s["record"]
            t = tens.get(key)
            r = recs.get(rname)
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
                tables[rname] = self._table(p, arch, fm, offsets, r)
        self._checked[fi] = tables
        return tables

    def check_all_files(self) -> None:
        """Checks every data file against the manifest (for readers that take
        the manifest's word for whole tensors: consolidate, verify)."""
        for fi in range(len(self.files)):
            self.check_file(fi)

    def _check_layout(self, si: int, s: dict[str, Any], lay_json: Any, bad: Any) -> None:
        """The pieces manifest.json gives stored tensor ``si`` against the
        layout its data file recorded for it: every piece it names must be
        one the file holds, with the same global shape, and every piece of
        the file's no global tensor references must be a replica (held and
        referenced elsewhere). So no manifest can move, drop, reshape or
        transpose what a data file says it holds."""
        from tierstore.layout import Layout

        key = s["key"]
        try:
            lay = Layout.from_json(lay_json)
        except Exception as e:  # any malformed layout in the data file
            raise bad(f"stored[{si}] ({key!r}): the file records no valid layout for it ({type(e).__name__})") from None
        if lay.local_shape != tuple(s["shape"]):
            raise bad(f"stored[{si}] ({key!r}): the file's layout is for a local shape {list(lay.local_shape)}")
        held = {_piece_key(p.tensor, p.box.to_json(), _local_json(p)): p for p in lay.pieces}
        named = self._pieces_of.get(si, [])
        tensors = self.manifest["tensors"]
        for pk in named:
            if pk not in held:
                raise bad(
                    f"stored[{si}] ({key!r}): manifest.json says it holds {pk[0]!r} box {list(pk[1])}, which its "
                    "data file's layout does not"
                )
            if tuple(tensors[pk[0]]["shape"]) != tuple(lay.global_shapes.get(pk[0], ())):
                raise bad(
                    f"stored[{si}] ({key!r}): global tensor {pk[0]!r} has shape {tensors[pk[0]]['shape']} in "
                    f"manifest.json and {list(lay.global_shapes.get(pk[0], ()))} in the data file's layout"
                )
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
        it (its length and the CRC-32 of its manifest record; version 2)."""
        p = _paths.member(self.dir, name, source=self.manifest_path, field="objects")
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
