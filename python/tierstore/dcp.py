"""PyTorch Distributed Checkpoint (DCP) interoperability.

A DCP checkpoint is a directory with a pickled ``.metadata`` (global tensor
shapes, dtypes, and the n-D chunks that were saved, each with its file,
offset and length) and ``__<rank>_<i>.distcp`` files in which every chunk is
a ``torch.save`` blob. tierstore maps each chunk to a piece of the global
tensor and reshards exactly as for its own checkpoints: the planner finds the
chunks a target needs and the coverage proof checks the result. DCP chunks
are opaque blobs, so a chunk is read whole even when only part of it is
needed (what DCP itself does).

Nothing in a DCP checkpoint is trusted:

- ``.metadata`` is a pickle, and unpickling it with plain ``pickle`` (what
  DCP's own reader does) runs whatever code the file names. tierstore first
  walks its opcodes without running them (:func:`_scan`: memo indices and
  lengths bounded by the file, nesting bounded, each global on the
  allow-list, ``BUILD`` only on objects the pickle itself created, never on a
  class or a shared singleton), then unpickles it with an unpickler whose
  ``find_class`` admits only DCP's metadata classes, ``torch.Size``, torch
  dtypes, layouts and memory formats, the memory-format enum,
  ``collections.OrderedDict`` and ``pathlib`` paths (:func:`allowed_globals`).
  ``weights_only=False`` uses the plain unpickler instead (the caller's
  explicit choice; the opcode walk still bounds memory and nesting).
- Every field of the result is checked for its type and range, every
  ``relative_path`` is confined to the checkpoint and must be a regular file,
  every chunk's byte range must lie inside its file, apart from every other
  chunk's, and be large enough for the elements it claims; the chunks of a
  tensor must be pairwise disjoint and inside its shape, and tile it exactly
  before a whole tensor is allocated (and then only within the memory there
  is).
- Every chunk is read with tierstore's own loader, which verifies the zip
  CRC-32s of the blob (torch does not), with ``weights_only=True``; the
  tensor must have the shape and dtype the metadata gives it.

Every failure is a :class:`~tierstore.errors.TierstoreError` naming the file
and the field or chunk.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from tierstore import _limits, _paths, _tree
from tierstore._dcp_pickle import (
    MAX_NESTING,
    allowed_globals,
    error_text,
    metadata_classes,
    scan_pickle,
    unpickle_metadata,
)
from tierstore.errors import (
    CorruptFileError,
    CoverageError,
    FormatError,
    InvalidArgumentError,
    ManifestError,
    MissingRecordError,
    NotFoundError,
    TierstoreError,
    TruncatedFileError,
    os_error,
)
from tierstore.layout import Box, Layout, Piece
from tierstore.reshard import GlobalIndex, Source, overlapping_pair, prove_coverage

__all__ = [
    "MAX_NESTING",
    "DcpCheckpoint",
    "allowed_globals",
    "is_dcp",
    "load_dcp_into",
    "save_dcp",
    "scan_pickle",
    "to_state_dict",
    "verify",
]

METADATA = ".metadata"
#: The largest ``.metadata`` read (a DCP checkpoint of 16k ranks and
#: thousands of tensors stays well below).
MAX_METADATA_BYTES = 1 << 30
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62
_MAX_NAME = 1 << 16
_VERIFY_MODES = ("touched", "full", True, False)


def is_dcp(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / METADATA).is_file()


# --------------------------------------------------------------------------
# Checking what the pickle held


def _show(v: Any) -> str:
    """A short description of ``v`` that cannot fail or run for long."""
    if v is None or isinstance(v, (bool, float)):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() < 200 else f"an integer of {v.bit_length()} bits"
    if isinstance(v, str):
        return repr(v[:80]) + ("..." if len(v) > 80 else "")
    if isinstance(v, (tuple, list, dict, set, frozenset)) and type(v).__module__ == "builtins":
        return f"a {type(v).__name__} of {len(v)} items"
    return f"a {type(v).__module__}.{type(v).__qualname__}"


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(
        self, field: str, expected: str, got: Any = ..., cls: type[FormatError] = ManifestError, detail: str = ""
    ) -> NoReturn:
        tail = "" if got is ... else f", got {_show(got)}"
        tail += f"; {detail}" if detail else ""
        raise cls(f"{self.where}: {field}: expected {expected}{tail}", path=self.where, record=field)

    def attr(self, obj: Any, name: str, field: str) -> Any:
        try:
            return getattr(obj, name)
        except AttributeError:
            self.fail(f"{field}.{name}", "a value (the field is missing)")
        except Exception as e:
            self.fail(f"{field}.{name}", f"a plain field ({type(e).__name__}: {error_text(e)})")

    def of(self, v: Any, types: Any, field: str, expected: str) -> Any:
        if not isinstance(v, types):
            self.fail(field, expected, v)
        return v

    def string(self, v: Any, field: str) -> str:
        if not isinstance(v, str) or len(v) > _MAX_NAME:
            self.fail(field, f"a string of at most {_MAX_NAME} characters", v)
        return str(v)

    def uint(self, v: Any, field: str, most: int = _MAX_ELEMENTS) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= most:
            self.fail(field, f"an integer in [0, {most}]", v)
        return int(v)

    def dims(self, v: Any, field: str, ndim: int | None = None) -> tuple[int, ...]:
        if not isinstance(v, tuple):
            self.fail(field, "a torch.Size", v)
        if len(v) > _MAX_DIMS or (ndim is not None and len(v) != ndim):
            self.fail(field, f"a size of {ndim if ndim is not None else f'at most {_MAX_DIMS}'} dimensions", v)
        out = tuple(self.uint(x, f"{field}[{i}]") for i, x in enumerate(v))
        if math.prod(out) > _MAX_ELEMENTS:
            self.fail(field, f"at most 2^62 elements, got {out}")
        return out


def _field(fqn: str) -> str:
    return f"state_dict_metadata[{fqn[:200]!r}]"


def _chunk_what(fqn: str, j: int, box: Box) -> str:
    return f"chunk {j} of {fqn[:200]!r} (offsets {box.offsets}, sizes {box.lengths})"


class DcpCheckpoint:
    """A DCP checkpoint directory, its ``.metadata`` read safely and checked.

    ``tensors`` maps each tensor's fqn to ``(shape, dtype, [(box, info)])``
    (``info`` is DCP's ``_StorageInfo``: ``relative_path``, ``offset``,
    ``length``), ``objects`` each non-tensor's fqn to its ``info``. With
    ``weights_only=True`` (the default) ``.metadata`` is unpickled with the
    allow-list of :func:`allowed_globals`.
    """

    def __init__(self, path: str | os.PathLike[str], weights_only: bool = True, data: bytes | None = None) -> None:
        self.dir = Path(path)
        self._index: dict[str, GlobalIndex] = {}
        mp = _paths.member(self.dir, METADATA, source=str(self.dir), field=METADATA)
        self.metadata_path = str(mp)
        where = self.metadata_path
        if data is None:
            data = _paths.read_regular(mp, MAX_METADATA_BYTES, METADATA)
        self.meta = unpickle_metadata(data, where, weights_only)
        classes = metadata_classes()
        c = _Check(where)
        if not isinstance(self.meta, classes["Metadata"]):
            c.fail("the pickled object", "a torch.distributed.checkpoint.metadata.Metadata", self.meta)
        sdm = c.of(
            c.attr(self.meta, "state_dict_metadata", "Metadata"),
            dict,
            "state_dict_metadata",
            "a dict of fqn to storage metadata",
        )
        sdata = c.of(
            c.attr(self.meta, "storage_data", "Metadata"), dict, "storage_data", "a dict of MetadataIndex to storage"
        )
        # storage_data: every name confined to the checkpoint, every range inside its file.
        where_of: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        files: dict[str, tuple[Path, int]] = {}
        self._files = files
        regions: list[tuple[str, int, int, str]] = []
        for k, (idx, info) in enumerate(sdata.items()):
            fld = f"storage_data[{k}]"
            c.of(idx, classes["MetadataIndex"], f"{fld} key", "a MetadataIndex")
            fqn = c.string(c.attr(idx, "fqn", f"{fld} key"), f"{fld} key.fqn")
            fld = f"storage_data[{fqn[:200]!r}]"
            off = c.attr(idx, "offset", fld)
            key = (fqn, None if off is None else c.dims(off, f"{fld}.offset"))
            fld = f"storage_data[{fqn[:200]!r}, {key[1]}]" if key[1] is not None else fld
            c.of(info, classes["_StorageInfo"], fld, "a _StorageInfo")
            rel = c.attr(info, "relative_path", fld)
            start = c.uint(c.attr(info, "offset", fld), f"{fld}.offset")
            length = c.uint(c.attr(info, "length", fld), f"{fld}.length")
            tds = getattr(info, "transform_descriptors", None)
            if tds is not None:
                c.of(tds, (list, tuple), f"{fld}.transform_descriptors", "None or a list of names")
                if tds:
                    raise FormatError(
                        f"{where}: {fld}.transform_descriptors: the chunk was stored through DCP transforms "
                        f"({', '.join(_show(t) for t in list(tds)[:4])}), which tierstore does not read",
                        path=where,
                        record=f"{fld}.transform_descriptors",
                    )
            if not isinstance(rel, str):
                c.fail(f"{fld}.relative_path", "a file name", rel)
            if rel not in files:
                p = _paths.member(self.dir, rel, source=where, field=f"{fld}.relative_path")
                try:
                    size = os.stat(p).st_size
                except FileNotFoundError:
                    raise NotFoundError(
                        f"{p}: data file of the DCP checkpoint is missing (named by {where}: {fld}.relative_path)",
                        path=str(p),
                    ) from None
                except OSError as e:
                    raise os_error(e, str(p), "stat") from None
                files[rel] = (p, size)
            p, size = files[rel]
            if start + length > size:
                raise TruncatedFileError(
                    f"{p}: {fld}: bytes {start}..{start + length} lie past the end of the file ({size} bytes); "
                    "the file is cut short",
                    path=str(p),
                    record=fld,
                )
            if key in where_of:
                c.fail(fld, "one storage entry per chunk (this one is listed twice)")
            where_of[key] = info
            if length:
                regions.append((rel, start, length, fld))
        regions.sort()
        for ra, rb in itertools.pairwise(regions):
            if ra[0] == rb[0] and rb[1] < ra[1] + ra[2]:
                c.fail(rb[3], f"a byte range apart from {ra[3]} ({ra[1]}+{ra[2]}) in {ra[0]!r}", f"{rb[1]}+{rb[2]}")
        # state_dict_metadata: tensors whose chunks lie apart inside their shape.
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Box, Any]]]] = {}
        self.objects: dict[str, Any] = {}
        self._expect: dict[int, tuple[str, tuple[int, ...], torch.dtype]] = {}
        used: set[int] = set()
        for fqn, md in sdm.items():
            if not isinstance(fqn, str) or len(fqn) > _MAX_NAME:
                c.fail("state_dict_metadata key", "a string", fqn)
            fld = _field(fqn)
            if isinstance(md, classes["TensorStorageMetadata"]):
                props = c.of(c.attr(md, "properties", fld), classes["TensorProperties"], f"{fld}.properties",
                             "a TensorProperties")  # fmt: skip
                dtype = c.of(c.attr(props, "dtype", f"{fld}.properties"), torch.dtype, f"{fld}.properties.dtype",
                             "a torch.dtype")  # fmt: skip
                shape = c.dims(c.attr(md, "size", fld), f"{fld}.size")
                item = _itemsize(dtype)
                chunks = c.of(c.attr(md, "chunks", fld), list, f"{fld}.chunks", "a list of chunks")
                out: list[tuple[Box, Any]] = []
                for j, ch in enumerate(chunks):
                    cf = f"{fld}.chunks[{j}]"
                    c.of(ch, classes["ChunkStorageMetadata"], cf, "a ChunkStorageMetadata")
                    offs = c.dims(c.attr(ch, "offsets", cf), f"{cf}.offsets", len(shape))
                    lens = c.dims(c.attr(ch, "sizes", cf), f"{cf}.sizes", len(shape))
                    if any(o + s > d for o, s, d in zip(offs, lens, shape, strict=True)):
                        inside = f"a chunk inside the tensor's size {shape}"
                        c.fail(cf, inside, detail=f"it has offsets {offs}, sizes {lens}", cls=CoverageError)
                    info = where_of.get((fqn, offs))
                    if info is None:
                        c.fail(cf, f"a storage_data entry for offsets {offs}", detail="no storage_data entry names it")
                    box = Box(offs, lens)
                    if box.numel * item > info.length:
                        c.fail(cf, f"a blob of at least {box.numel * item} bytes for {box.numel} elements of "
                                   f"{dtype}", f"{info.length} bytes")  # fmt: skip
                    if id(info) in used:
                        c.fail(cf, "a storage entry of its own (another chunk uses this one)")
                    used.add(id(info))
                    self._expect[id(info)] = (fqn, lens, dtype)
                    out.append((box, info))
                pair = overlapping_pair([b for b, _ in out])
                if pair is not None:
                    a, b = out[pair[0]][0], out[pair[1]][0]
                    raise CoverageError(
                        f"{where}: {fld}: chunks {pair[0]} ({a.offsets}+{a.lengths}) and {pair[1]} "
                        f"({b.offsets}+{b.lengths}) overlap; the metadata is damaged",
                        path=where,
                        record=fld,
                    )
                self.tensors[fqn] = (shape, dtype, out)
            elif isinstance(md, classes["BytesStorageMetadata"]):
                info = where_of.get((fqn, None))
                if info is None:
                    c.fail(fld, "a storage_data entry for this object", detail="no storage_data entry names it")
                self.objects[fqn] = info
            else:
                c.fail(fld, "a TensorStorageMetadata or BytesStorageMetadata", md)
        self._planner_data = getattr(self.meta, "planner_data", None)

    def chunks_meeting(self, fqn: str, box: Box) -> list[tuple[Box, Any, Box]]:
        """The saved chunks of tensor ``fqn`` that meet ``box``: (chunk box,
        storage info, intersection), found through an interval index built
        once per tensor (O(log chunks + hits), not a scan of every chunk)."""
        idx = self._index.get(fqn)
        if idx is None:
            shape, _dt, chunks = self.tensors[fqn]
            sources = [
                Source(file=-1, offset=0, local_shape=b.lengths, itemsize=1, piece=Piece(fqn, b, Box.whole(b.lengths)),
                       stored=j)
                for j, (b, _info) in enumerate(chunks)
            ]  # fmt: skip
            idx = self._index[fqn] = GlobalIndex.build(shape, sources)
        chunks = self.tensors[fqn][2]
        return [(chunks[s.stored][0], chunks[s.stored][1], inter) for s, inter in idx.overlapping(box)]

    def key_paths(self) -> dict[str, tuple[Any, ...]]:
        """How DCP's flattening nested each saved key (``planner_data``), for a
        rebuild of the structure. It only shapes the nesting: keys whose path
        does not fit are left flat, with a warning."""
        paths: dict[str, tuple[Any, ...]] = {}
        pdata = self._planner_data
        bad: list[str] = []
        if pdata is not None and not isinstance(pdata, dict):
            bad.append(f"planner_data is {_show(pdata)}, not a dict")
            pdata = None
        for fqn, pth in (pdata or {}).items():
            if not isinstance(fqn, str) or (fqn not in self.tensors and fqn not in self.objects):
                continue  # paths of keys not saved (DCP keeps the planner's whole mapping)
            got = _tree.check_path(list(pth) if isinstance(pth, tuple) else pth, fqn)
            if got is None or any(isinstance(i, dict) for i in got):
                bad.append(f"planner_data[{fqn[:200]!r}] is {_show(pth)}, not its key path")
                continue
            paths[fqn] = got
        if bad:
            warnings.warn(
                f"{self.metadata_path}: {'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}: those keys are left flat",
                stacklevel=3,
            )
        return paths

    # -- reading chunks

    def _blob(self, info: Any, what: str) -> tuple[bytes, str]:
        rel = info.relative_path
        known = self._files.get(rel) if isinstance(rel, str) else None
        p = known[0] if known is not None else None
        if p is None:
            p = _paths.member(self.dir, rel, source=self.metadata_path, field=f"{what}: relative_path")
        return (
            _paths.read_regular(
                p, 0, f"data file of the DCP checkpoint ({what})", at=(int(info.offset), int(info.length))
            ),
            str(p),
        )

    def _load_blob(self, blob: bytes, file: str, what: str, weights_only: bool, verify: bool, **kw: Any) -> Any:
        from tierstore import api

        bio = io.BytesIO(blob)
        bio.name = f"{file} ({what})"
        try:
            return api.load(bio, weights_only=weights_only, verify=verify, **kw)
        except TierstoreError as e:
            e._locate(file, e.record)
            raise
        except Exception as e:
            raise CorruptFileError(
                f"{file}: {what}: not a torch.save blob tierstore can load ({type(e).__name__}: {error_text(e)})",
                path=file,
            ) from e

    def chunk(self, info: Any, verify: str | bool = True) -> torch.Tensor:
        """The tensor of one chunk, its CRC-32s checked (unless ``verify`` is
        False), with the shape and dtype the metadata gives it."""
        exp = self._expect.get(id(info))
        what = "chunk" if exp is None else f"chunk of {exp[0][:200]!r}"
        what = f"{what} at bytes {info.offset}+{info.length}"
        blob, file = self._blob(info, what)
        t = self._load_blob(blob, file, what, True, verify is not False, map_location="cpu")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise CorruptFileError(f"{file}: {what}: expected a dense tensor, got {_show(t)}", path=file)
        if exp is not None and (tuple(t.shape) != exp[1] or t.dtype != exp[2]):
            raise CorruptFileError(
                f"{file}: {what}: holds a tensor of shape {tuple(t.shape)} and dtype {t.dtype}; the metadata "
                f"({self.metadata_path}) says shape {exp[1]} and dtype {exp[2]}",
                path=file,
            )
        return t

    def obj(self, fqn: str, weights_only: bool, verify: str | bool = True) -> Any:
        """The object saved for ``fqn``, loaded with ``weights_only``."""
        info = self.objects[fqn]
        what = f"object {fqn[:200]!r} at bytes {info.offset}+{info.length}"
        blob, file = self._blob(info, what)
        return self._load_blob(blob, file, what, weights_only, verify is not False)


_opened: OrderedDict[tuple[Any, ...], DcpCheckpoint] = OrderedDict()
_opened_lock = threading.Lock()
_OPENED_MAX = 4


def open_checked(path: str | os.PathLike[str], weights_only: bool = True) -> DcpCheckpoint:
    """The checked :class:`DcpCheckpoint` at ``path``, unpickled and checked
    once per process: loads of one process (a model, then its optimizer;
    several ranks' targets) share it while ``.metadata`` holds the same bytes
    (its digest is the key; the file is read each time, which costs little
    next to unpickling and checking it). Data chunks are always read afresh."""
    mp = _paths.member(Path(path), METADATA, source=str(path), field=METADATA)
    data = _paths.read_regular(mp, MAX_METADATA_BYTES, METADATA)
    key = (os.path.realpath(mp), hashlib.blake2b(data, digest_size=32).digest(), weights_only)
    with _opened_lock:
        ck = _opened.get(key)
        if ck is not None:
            _opened.move_to_end(key)
            return ck
    ck = DcpCheckpoint(path, weights_only=weights_only, data=data)
    with _opened_lock:
        _opened[key] = ck
        while len(_opened) > _OPENED_MAX:
            _opened.popitem(last=False)
    return ck


def _same_width_int(dtype: torch.dtype) -> torch.dtype:
    """An integer dtype of ``dtype``'s width, to copy its bits (the dtype
    itself where there is none: complex128)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(_itemsize(dtype), dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return max(1, int(dtype.itemsize))


# --------------------------------------------------------------------------
# Loading


def _check_verify(verify: str | bool) -> str | bool:
    if verify is True:
        return "touched"
    if verify not in _VERIFY_MODES:
        raise InvalidArgumentError(f"verify must be 'touched', 'full' or False, not {verify!r}")
    return verify


def load_dcp_into(
    path: str | os.PathLike[str],
    targets: list[tuple[str, torch.Tensor, Layout]],
    objects: list[tuple[str, MutableMapping[str, Any], str]],
    weights_only: bool = True,
    stats: dict[str, Any] | None = None,
    verify: str | bool = "touched",
    *,
    empties: Sequence[str] = (),
) -> None:
    """Fills each target's pieces from the DCP checkpoint at ``path`` and
    sets each object. ``verify``: ``"touched"`` or ``"full"`` check the
    CRC-32s of every chunk read (a DCP chunk is read whole, so the two are
    the same), ``False`` none. ``empties``: keys of empty dicts in the
    target, which DCP's rules skip; a warning names those the checkpoint
    holds values under."""
    verify = _check_verify(verify)
    ck = open_checked(path, weights_only=weights_only)
    where = ck.metadata_path
    for key in empties:
        under = [k for k in (*ck.tensors, *ck.objects) if k.startswith(key + ".")]
        if under:
            warnings.warn(
                f"{where}: the target's {key!r} is an empty dict, so (as with DCP) the {len(under)} values the "
                f"checkpoint holds under it ({', '.join(repr(k) for k in under[:3])}"
                f"{', ...' if len(under) > 3 else ''}) are not loaded; give it their entries first (an optimizer "
                "whose state exists: after a step, or from torch.distributed.checkpoint.state_dict.get_state_dict)",
                stacklevel=3,
            )
    cache: dict[int, torch.Tensor] = {}
    read = 0
    needed = 0
    for key, dest, lay in targets:
        inters_all = []
        flat = dest.view(-1)
        for p in lay.pieces:
            if p.tensor not in ck.tensors:
                raise CoverageError(
                    f"{where}: tensor {key!r}: the DCP checkpoint has no tensor {p.tensor!r}", path=where
                )
            shape, _dt, _chunks = ck.tensors[p.tensor]
            want = lay.global_shapes.get(p.tensor) if lay.global_shapes else None
            if (want is not None and tuple(want) != shape) or not p.box.within(shape):
                raise CoverageError(
                    f"{where}: tensor {key!r}: global tensor {p.tensor!r} has shape {shape} in the checkpoint, "
                    f"but the target asks for region {p.box.offsets}+{p.box.lengths}"
                    + (f" of shape {tuple(want)}" if want is not None else ""),
                    path=where,
                )
            boxes = []
            for box, info, inter in ck.chunks_meeting(p.tensor, p.box):
                boxes.append(inter)
                k = id(info)
                if k not in cache:
                    cache[k] = ck.chunk(info, verify)
                    read += info.length
                where_ = zip(inter.offsets, box.offsets, inter.lengths, strict=True)
                src = cache[k][tuple(slice(o - b, o - b + n) for o, b, n in where_)]
                rel = [o - b for o, b in zip(inter.offsets, p.box.offsets, strict=True)]
                if isinstance(p.local, Box):
                    lb = p.local
                    gd = [d for d in range(len(p.box.lengths)) if p.box.lengths[d] != 1]
                    ld = [d for d in range(len(lb.lengths)) if lb.lengths[d] != 1]
                    off = list(lb.offsets)
                    ln = [1] * len(lb.lengths)
                    for g, d in zip(gd, ld, strict=True):
                        off[d] = lb.offsets[d] + rel[g]
                        ln[d] = inter.lengths[g]
                    dest[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))] = src.reshape(ln)
                else:
                    # Flat local: copy element runs in the piece box's C order.
                    idx = torch.arange(p.box.numel).reshape(p.box.lengths)
                    sel = idx[tuple(slice(r, r + n) for r, n in zip(rel, inter.lengths, strict=True))].reshape(-1)
                    # Indexed copies of raw bits (index_put lacks some dtypes, uint16 among them).
                    bits = _same_width_int(flat.dtype)
                    flat.view(bits)[p.local + sel] = src.reshape(-1).to(flat.dtype).view(bits)
            inters_all.append(boxes)
            needed += p.box.numel * dest.element_size()
        prove_coverage(key, lay, inters_all)
    for key, parent, pkey in objects:
        if key not in ck.objects:
            raise MissingRecordError(f"{where}: the DCP checkpoint has no value for {key!r}", path=where)
        parent[pkey] = ck.obj(key, weights_only, verify)
    if stats is not None:
        stats["bytes_read"] = read
        stats["bytes_verified"] = read if verify is not False else 0
        stats["bytes_needed"] = needed


def _check_tiled(ck: DcpCheckpoint) -> int:
    """Checks that each tensor's chunks tile it exactly; returns the bytes of all tensors."""
    where = ck.metadata_path
    total = 0
    for fqn, (shape, dtype, chunks) in ck.tensors.items():
        # Chunks are inside the shape and pairwise disjoint (checked on
        # opening), so they tile it exactly when their volumes add up.
        got = sum(b.numel for b, _ in chunks)
        want = math.prod(shape)
        if got != want:
            raise CoverageError(
                f"{where}: {_field(fqn)}: the chunks hold {got} of the tensor's {want} elements (shape {shape}); "
                "the checkpoint is incomplete or its metadata is damaged",
                path=where,
                record=_field(fqn),
            )
        total += want * _itemsize(dtype)
    return total


def to_state_dict(
    path: str | os.PathLike[str], weights_only: bool = True, verify: str | bool = "touched", *, nested: bool = False
) -> dict[str, Any]:
    """A DCP checkpoint as one dict of full tensors and objects: flat (one
    key per fqn) or, with ``nested=True``, nested as the saved state dict was
    (from the metadata's ``planner_data``, as ``dcp_to_torch_save`` does).

    Each tensor's chunks must tile it exactly, and the whole must fit in the
    memory there is, before anything is allocated."""
    verify = _check_verify(verify)
    ck = DcpCheckpoint(path, weights_only=weights_only)
    total = _check_tiled(ck)
    _limits.check_allocation(total, f"the {len(ck.tensors)} tensors of the DCP checkpoint", ck.metadata_path)
    flat: dict[str, Any] = {}
    for fqn, (shape, dtype, chunks) in ck.tensors.items():
        t = torch.empty(shape, dtype=dtype)
        for box, info in chunks:
            t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))] = ck.chunk(info, verify)
        flat[fqn] = t
    for fqn in ck.objects:
        flat[fqn] = ck.obj(fqn, weights_only, verify)
    if not nested:
        return flat
    out: dict[str, Any] = {}
    paths = ck.key_paths()
    for fqn, v in flat.items():
        pth = paths.get(fqn)
        if pth is None:
            out[fqn] = v
            continue
        try:
            _tree.set_path(out, pth, v)
        except (ValueError, TypeError, AttributeError) as e:
            raise FormatError(
                f"{ck.metadata_path}: planner_data[{fqn[:200]!r}]: the key path {list(pth)} does not fit the "
                f"others ({e}); the metadata is damaged",
                path=ck.metadata_path,
                record=f"planner_data[{fqn[:200]!r}]",
            ) from None
    return out


def verify(
    path: str | os.PathLike[str], weights_only: bool = True, progress: Callable[[int, int], None] | None = None
) -> dict[str, int]:
    """Checks a DCP checkpoint as far as it can be: its metadata (read with
    the restricted unpickler and every field checked), every chunk's tiling
    of its tensor, every chunk read and loaded (its size, shape and dtype
    against the metadata, the CRC-32s of the torch.save blob it is stored
    as), every object loaded. DCP keeps no checksums of its own: damage to
    ``.metadata`` that still parses, or a chunk rewritten with a valid blob,
    cannot be detected. One chunk is held at a time. Returns the counts."""
    ck = DcpCheckpoint(path, weights_only=weights_only)
    _check_tiled(ck)
    total = sum(int(i.length) for _s, _d, parts in ck.tensors.values() for _b, i in parts)
    total += sum(int(i.length) for i in ck.objects.values())
    chunks = nbytes = 0
    for _fqn, (_shape, _dtype, parts) in ck.tensors.items():
        for _box, info in parts:
            ck.chunk(info, "full")
            chunks += 1
            nbytes += int(info.length)
            if progress is not None:
                progress(nbytes, total)
    for fqn in ck.objects:
        info = ck.objects[fqn]
        ck.obj(fqn, weights_only, "full")
        nbytes += int(info.length)
        if progress is not None:
            progress(nbytes, total)
    return {
        "tensors": len(ck.tensors),
        "chunks": chunks,
        "objects": len(ck.objects),
        "files": len(ck._files),
        "bytes": nbytes,
    }


def save_dcp(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``state`` (full tensors and objects) as a DCP checkpoint."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(dict(state), storage_writer=FileSystemWriter(str(path)), no_dist=True)
