"""A committed sharded checkpoint, opened for reading: its manifest indexed
for planning, and its data files checked against it.

Nothing a manifest says is used before it is checked:

1. the file's checksum, its fields, names and pieces
   (:mod:`tierstore._sharded_manifest`, whose names this module re-exports);
2. when a data file is first used, the stored entries that point into it
   against the file's own zip directory and manifest (record, offset, size,
   CRC-32, dtype, shape, contiguity), and the file against the manifest
   (its length and, in version 2, the CRC-32 of its own manifest record);
3. the chunk checksums of every record that is read (their table's own
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
import json
import math
import os
from collections.abc import Container, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from tierstore import _index
from tierstore._shard_files import ChunkTable, ShardFiles
from tierstore._sharded_manifest import (
    FORMAT,
    FORMAT_VERSION,
    GRID_MIN,
    INDEX_MIN_BYTES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Grid,
    dtype_of,
    grid_min,
    index_name,
    itemsize,
    manifests_cached,
    read_attachment,
    read_manifest,
    write_manifest,
)
from tierstore.layout import Box, Layout, Piece, Rule
from tierstore.reshard import GlobalIndex, Source, prove_tiling_arrays

# The manifest's own names are re-exported: this module is where the
# checkpoint's metadata is read from, whichever half of it a caller needs.
__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "GRID_MIN",
    "INDEX_MIN_BYTES",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "Checkpoint",
    "ChunkTable",
    "Grid",
    "RuleIndex",
    "closing_scope",
    "dtype_of",
    "grid_min",
    "index_name",
    "manifests_cached",
    "read_attachment",
    "read_manifest",
    "write_manifest",
]

_U32 = 0xFFFFFFFF
_T = TypeVar("_T")


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
        self.itemsize = itemsize(dtype_of(self.dtype))
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
        self.shards = ShardFiles(self.manifest_path, m, self.version, [self.dir, *(Path(a) for a in alternates)])
        # The same objects as the opened files' (shared, not copied).
        self.copies, self.excluded = self.shards.copies, self.shards.excluded
        self.bytes_by_copy, self.objects_copy = self.shards.bytes_by_copy, self.shards.objects_copy
        opened = _SCOPE.get()
        if opened is not None:
            opened.append(self)
        stored = m["stored"]
        self.stored = stored
        self._stored_in: dict[int, list[int]] = {}
        for si, s in enumerate(stored):
            self._stored_in.setdefault(s["file"], []).append(si)
        self._checked: dict[int, dict[str, ChunkTable]] = {}
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
        # (file, key, tensor, rule position) -> the offset rule_source found
        # and checked for exactly that position (a file forged to stand for a
        # second position must fail that position's own check).
        self._resolved: dict[tuple[int, str, str, tuple[int, ...]], int] = {}
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
            item = itemsize(dtype_of(g["dtype"]))
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

    def check_file(self, fi: int) -> dict[str, ChunkTable]:
        """Checks data file ``fi`` against the manifest (once) and returns the
        chunk table of each record its stored tensors are in (and of those
        of rule positions looked up so far)."""
        got = self._checked.get(fi)
        if got is not None:
            return got
        view = self.shards.view(fi)
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
            item = itemsize(dt)
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
                tables[rname] = self.shards.table(p, view.arch, view.fm, view.offsets, r)
        self._checked[fi] = tables
        return tables

    def resolve(self, src: Source) -> Source:
        """``src`` with its offset in its data file: a rule position's found
        (and checked) in the file's own manifest; others as they are."""
        if src.offset >= 0:
            return src
        # Per tensor: a shared buffer holds several rules under one key, each checked.
        at = (src.file, src.key, src.piece.tensor, tuple(src.coords))
        got = self._resolved.get(at)
        if got is None:
            idx = self.lookup(src.piece.tensor)
            assert isinstance(idx, RuleIndex)
            got = self._resolved[at] = self.rule_source(src.file, src.key, idx.rule, src.coords, idx.dtype)[0]
        return dataclasses.replace(src, offset=got)

    def rule_source(self, fi: int, key: str, rule: Rule, coords: tuple[int, ...], dtype: str) -> tuple[int, Layout]:
        """Where the tensor of rule position ``coords`` starts in data file
        ``fi`` (stored under ``key``), and its layout, checked against the
        file's own manifest: the file must record that key with the same
        rule and position, the dtype, the rule's local shape, stored
        contiguously inside a storage record (whose chunk table joins the
        file's tables)."""
        view = self.shards.view(fi)
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
        item = itemsize(dtype_of(dtype, view.path))
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
            tables[r["name"]] = self.shards.table(view.path, view.arch, view.fm, view.offsets, r)
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
                    t = self.shards.view(fi).tensors.get(key)
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
        view = self.shards.view(s["file"])
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

    # The files, as opened (see ShardFiles).

    def path_of(self, fi: int) -> str:
        """The path data file ``fi`` is read from (after :meth:`check_file`)."""
        return self.shards.path_of(fi)

    def copy_of(self, fi: int) -> str:
        """The directory data file ``fi`` is read from (after :meth:`check_file`)."""
        return self.shards.copy_of(fi)

    def count_read(self, fi: int, n: int) -> None:
        self.shards.count_read(fi, n)

    def check_objects_file(self, name: str) -> Path:
        """The objects file ``name``, checked against the manifest's record of
        it, from the first copy of the checkpoint that holds it intact."""
        return self.shards.check_objects_file(name)

    def is_decoding(self, fi: int) -> bool:
        return self.shards.is_decoding(fi)

    def decode_into(self, fi: int, at: int, length: int, addr: int) -> bool:
        return self.shards.decode_into(fi, at, length, addr)

    def prepare_read(self, fi: int, spans: list[tuple[int, int]] | None) -> None:
        self.shards.prepare_read(fi, spans)

    def close(self) -> None:
        """Removes the files decoded for this checkpoint's reads (a codec
        tier's copy); its metadata stays usable, its data files do not."""
        self.shards.close()
