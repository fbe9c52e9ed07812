"""The load side of sharded checkpoints: planning which saved bytes each
target piece needs (from the manifest alone), reading exactly those ranges
with their chunks verified, consolidation into whole tensors, and the
non-tensor state. ``tierstore.sharded`` re-exports its public names."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierstore import _core, _dist, _gc, _limits, _shared_verify, _tree, gpu
from tierstore._engine import get_engine
from tierstore._leaves import flatten, is_dtensor, tensor_and_layout
from tierstore.errors import (
    ChecksumError,
    FormatError,
    InvalidArgumentError,
    LayoutError,
    MissingRecordError,
    TierstoreError,
)
from tierstore.layout import Box, Layout, Piece, layout_of
from tierstore.reshard import CoverageError, Source, block_for, prove_coverage
from tierstore.shardmeta import (
    MANIFEST,
    Checkpoint,
    closing_scope,
    dtype_of,
)

# What a load verifies: every chunk its reads touch (default), every chunk
# of every record it reads from, every chunk its reads touch with the chunks
# read in part proven with the other ranks' reads, or nothing.
VERIFY_MODES = ("touched", "full", "shared", False)

# Data files read at once by one load (see read_plan).
_FILES_AT_ONCE = 4


@dataclass
class Target:
    key: str
    dest: torch.Tensor  # where the bytes land (contiguous; may be a temporary)
    final: torch.Tensor  # the user's tensor
    layout: Layout


@dataclass
class Plan:
    """Which saved pieces each target piece reads, with the intersections
    (global boxes): the result of planning, from metadata alone."""

    # (target index, target piece, [(source, intersection), ...])
    steps: list[tuple[int, Piece, list[tuple[Source, Box]]]]
    needed: dict[str, int]


def make_plan(ck: Checkpoint, targets: list[Target]) -> Plan:
    """Intersects every target piece with the saved pieces of its global
    tensor and proves coverage. No file is read, no collective is used."""
    steps: list[tuple[int, Piece, list[tuple[Source, Box]]]] = []
    needed: dict[str, int] = {}
    for ti, t in enumerate(targets):
        inters_all: list[list[Box]] = []
        item = t.dest.element_size()
        for piece in t.layout.pieces:
            idx = ck.lookup(piece.tensor)
            if idx is None:
                raise CoverageError(f"tensor {t.key!r}: global tensor {piece.tensor!r} is not in the checkpoint")
            if tuple(idx.shape) != tuple(t.layout.global_shapes[piece.tensor]):
                raise CoverageError(
                    f"tensor {t.key!r}: global tensor {piece.tensor!r} has shape {idx.shape} in the checkpoint, "
                    f"but the target layout says {t.layout.global_shapes[piece.tensor]}"
                )
            ck.check_tensor(piece.tensor)
            hits = idx.overlapping(piece.box)
            for src, _b in hits:
                if src.itemsize != item:
                    raise CoverageError(f"tensor {t.key!r}: element sizes differ between checkpoint and target")
            inters_all.append([b for _s, b in hits])
            steps.append((ti, piece, hits))
        prove_coverage(t.key, t.layout, inters_all)
        needed[t.key] = sum(p.box.numel for p in t.layout.pieces) * item
    return Plan(steps, needed)


@dataclass
class FileBlocks:
    """The copy blocks of one data file: rows of 64-bit integers ``[file
    offset, address, run bytes, then per outer dimension (count, file stride,
    memory stride)]`` with ``dims`` outer dimensions per row (unused ones have
    count 1), as ``_core.read_blocks`` takes them."""

    rows: np.ndarray
    dims: int

    @property
    def bytes_needed(self) -> int:
        r = self.rows
        if not len(r):
            return 0
        n = r[:, 2].copy()
        for k in range(self.dims):
            n *= r[:, 3 + 3 * k]
        return int(n.sum())


def expand_plan(plan: Plan, targets: list[Target], ck: Checkpoint | None = None) -> dict[int, FileBlocks]:
    """Turns a plan into copy blocks per file: one block (an affine grid of
    byte runs) per pair of saved and target pieces, however many runs it
    holds; the engine expands and merges them. Sources of rule positions get
    their offsets from their data files' manifests (through ``ck``)."""
    from tierstore.reshard import affine_map

    per_file: dict[int, list[tuple[int, int, int, list[tuple[int, int, int]]]]] = {}
    src_aff: dict[int, tuple[Source, tuple[int, list[int]]]] = {}
    for ti, piece, hits in plan.steps:
        t = targets[ti]
        item = t.dest.element_size()
        base = t.dest.data_ptr()
        nd = len(piece.box.offsets)
        daff = affine_map(piece, t.layout.local_shape, nd)
        for planned, inter in hits:
            # Keyed by the planned source (the plan holds it, so its id is stable).
            got = src_aff.get(id(planned))
            if got is None:
                src = planned
                if src.offset < 0:
                    assert ck is not None, "a plan with rule positions is expanded with its checkpoint"
                    src = ck.resolve(src)
                got = src_aff[id(planned)] = (src, affine_map(src.piece, src.local_shape, nd))
            src, saff = got
            s0, d0, run, outer = block_for(inter, src, piece, t.layout.local_shape, saff, daff)
            per_file.setdefault(src.file, []).append((
                src.offset + s0 * item, base + d0 * item, run * item,
                [(n, ss * item, ds * item) for n, ss, ds in outer],
            ))  # fmt: skip
    out: dict[int, FileBlocks] = {}
    for f, blocks in per_file.items():
        dims = max(len(b[3]) for b in blocks)
        rows = np.ones((len(blocks), 3 + 3 * dims), dtype=np.int64)
        for i, (so, do, run, outer) in enumerate(blocks):
            rows[i, :3] = (so, do, run)
            for k, dim in enumerate(outer):
                rows[i, 3 + 3 * k : 6 + 3 * k] = dim
        out[f] = FileBlocks(rows, dims)
    return out


@dataclass
class _Wanted:
    """A non-tensor value to load (or a plain tensor saved inside an object)."""

    key: str
    parent: Any
    slot: Any
    path: tuple[Any, ...]
    like: torch.Tensor | None


def _target(ck: Checkpoint, key: str, v: torch.Tensor, world: int) -> Target:
    local, lay = tensor_and_layout(key, v, world if is_dtensor(v) or layout_of(v) else 1)
    if tuple(local.shape) != lay.local_shape:
        raise LayoutError(f"{key}: local tensor of shape {tuple(local.shape)} but layout for {lay.local_shape}")
    src_dtype = None
    for p in lay.pieces:
        if p.tensor in ck.manifest["tensors"]:
            src_dtype = ck.dtype_of(p.tensor)
            break
    dest = local
    if not local.is_contiguous() or (src_dtype is not None and src_dtype != local.dtype):
        dest = torch.empty(local.shape, dtype=src_dtype or local.dtype)
    elif local.device.type == "cuda":
        dest = gpu.pinned_empty(local.shape, local.dtype)  # the reads land in page-locked memory: one DMA each
    elif local.device.type != "cpu":
        dest = torch.empty(local.shape, dtype=local.dtype)
    if sum(p.box.numel for p in lay.pieces) < local.numel():
        dest.zero_()  # padding is recreated as zeros
    return Target(key, dest, local, lay)


def _stored_path(m: Mapping[str, Any], key: str) -> tuple[Any, ...]:
    return tuple(m.get("paths", {}).get(key) or _tree.split_key(key))


def _object_prefix(m: Mapping[str, Any], key: str) -> str | None:
    """The longest key saved as one object that ``key`` lies inside (``a.b``
    for ``a.b.0.c``), if any."""
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        k = ".".join(parts[:n])
        if k in m["objects"] or k in m["per_rank_objects"]:
            return k
    return None


def _subtree(
    ck: Checkpoint, key: str, path: tuple[Any, ...]
) -> tuple[Any, dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any, tuple[Any, ...]]]] | None:
    """For a target value (an empty dict, None) whose key the checkpoint holds
    only as the prefix of others (``optim.state`` of ``optim.state.0.exp_avg``):
    the saved structure rebuilt, with full empty tensors and the places of the
    objects to fill; None when it holds no key under it."""
    m = ck.manifest
    pre = key + "."
    names = [n for n in m["tensors"] if n.startswith(pre)]
    objs = [n for n in (*m["objects"], *m["per_rank_objects"]) if n.startswith(pre)]
    if not names and not objs:
        return None
    total = sum(math.prod(m["tensors"][n]["shape"]) * dtype_of(m["tensors"][n]["dtype"]).itemsize for n in names)
    _limits.check_allocation(total, f"the {len(names)} tensors under {key!r} of {ck.dir}", str(ck.dir))
    root: dict[str, Any] = {}
    tensors: dict[str, tuple[Any, Any]] = {}
    places: dict[str, tuple[Any, Any, tuple[Any, ...]]] = {}
    order = {k: i for i, k in enumerate(m.get("paths", {}))}
    for n in sorted([*names, *objs], key=lambda n: (order.get(n, len(order)), n.split("."))):
        sp = _stored_path(m, n)
        cut = next((i for i in range(1, len(sp) + 1) if _tree.key_of(sp[:i]) == key), None)
        if cut is None or cut == len(sp):
            continue  # a name under the prefix by its text only ("a.b" of a key "a.b.c" with a dotted part)
        rel = ("_", *sp[cut:])
        try:
            if n in m["tensors"]:
                g = m["tensors"][n]
                tensors[n] = _tree.set_path(root, rel, torch.empty(g["shape"], dtype=dtype_of(g["dtype"])))
            else:
                holder, slot = _tree.set_path(root, rel, None)
                places[n] = (holder, slot, (*path, *sp[cut:]))
        except (ValueError, TypeError, AttributeError) as e:
            raise FormatError(f"{ck.dir / MANIFEST}: paths[{n[:100]!r}] does not fit the others ({e})",
                              path=str(ck.dir / MANIFEST), record=f"paths[{n[:100]!r}]") from None  # fmt: skip
    if "_" not in root:
        return None
    return root["_"], tensors, places


@_gc.paused
def load_sharded(
    path: str | os.PathLike[str] | Checkpoint,
    state_dict: MutableMapping[str, Any],
    *,
    process_group: Any = None,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None = None,
    weights_only: bool = True,
    stats: dict[str, Any] | None = None,
    verify: str | bool = "touched",
) -> MutableMapping[str, Any]:
    """Fills ``state_dict`` in place from the checkpoint at ``path``.

    ``path`` is the checkpoint's directory, or a
    :class:`tierstore.shardmeta.Checkpoint` already opened (its manifest is
    then not read and checked again). Tensors receive exactly their local
    pieces (any layout: attached :class:`Layout`, DTensor placements, or
    plain tensors standing for the whole logical tensor); only the bytes
    each needs are read. Non-tensor values are replaced by the saved ones.
    Per-rank objects saved by a different number of ranks need
    ``per_rank_policy``: ``"rank0"`` (take rank 0's) or a function of
    ``{rank: value}``.

    ``verify`` says which checksums are checked: ``"touched"`` (default)
    every 512-byte chunk a read touches, reading the rest of a chunk it touches
    in part; ``"full"`` every chunk of every record read from; ``"shared"``
    every chunk a read touches, where a chunk this rank needs only part of is
    proven together with the other ranks of ``process_group`` that read the
    rest of it (so a column shard reads only its own bytes, at the price of
    an exchange between the ranks and some work per piece: meant for
    storage where bytes read cost more than that; from a fast local disk it
    is slower than ``"touched"``; every rank of the group must call
    ``load_sharded`` with ``verify="shared"``; a rank that fails before its
    reads are done makes the others check alone, never wait); ``False``
    none (the metadata is still checked). ``stats``, if
    given, receives the bytes read, verified and needed. Returns
    ``state_dict``.
    """
    with closing_scope():
        return _load_sharded(path, state_dict, process_group, per_rank_policy, weights_only, stats, verify)


def _load_sharded(
    source: str | os.PathLike[str] | Checkpoint,
    state_dict: MutableMapping[str, Any],
    process_group: Any,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None,
    weights_only: bool,
    stats: dict[str, Any] | None,
    verify: str | bool,
) -> MutableMapping[str, Any]:
    checkpoint: Checkpoint | None = None
    path: str | os.PathLike[str]
    if isinstance(source, Checkpoint):
        checkpoint, path = source, source.dir
    else:
        path = source
    if verify is True:
        verify = "touched"
    if verify not in VERIFY_MODES:
        raise InvalidArgumentError(f"verify must be 'touched', 'full', 'shared' or False, not {verify!r}")
    rank, world, pg = _dist.group_info(process_group)
    from tierstore import dcp

    shared = verify == "shared" and world > 1
    if verify == "shared" and not shared:
        verify = "touched"
    pending: list[_shared_verify.FilePieces] | None = []
    try:
        if not (Path(path) / MANIFEST).exists() and dcp.is_dcp(path):
            # DCP's files have no chunk checksums: each rank checks its own (and
            # tells the others, which may have found a tierstore checkpoint here).
            if shared:
                shared = False
                _shared_verify.settle(None, world, pg)
            return _load_from_dcp(
                path, state_dict, world, weights_only, stats, "touched" if verify == "shared" else verify
            )
        ck = checkpoint if checkpoint is not None else Checkpoint(path)
        targets, objects_wanted = _targets(ck, path, state_dict, world)
        t_plan = time.perf_counter()
        the_plan = make_plan(ck, targets)
        plan_seconds = time.perf_counter() - t_plan
        plan = expand_plan(the_plan, targets, ck)
        read, checked, blocks = read_plan(ck, plan, verify, pending)
    except BaseException:
        if shared:
            # The other ranks check their chunks alone rather than wait for this one.
            with contextlib.suppress(Exception):
                _shared_verify.settle(None, world, pg)
        raise
    if shared:
        proven, r, c = _shared_verify.settle(pending, world, pg)
        read, checked = read + r, checked + c + proven
    to_device = [(t.final, t.dest) for t in targets if t.dest is not t.final and t.final.is_cuda]
    for t in targets:
        if t.dest is not t.final and not t.final.is_cuda:
            t.final.copy_(t.dest)
    if to_device:
        gpu.copy_to_device(to_device)
    _load_objects(ck, objects_wanted, rank, world, per_rank_policy, weights_only)
    if stats is not None:
        stats["bytes_read"] = read
        stats["bytes_verified"] = checked
        stats["bytes_needed"] = sum(the_plan.needed.values())
        stats["bytes_needed_blocks"] = blocks
        stats["manifest_bytes"] = (ck.dir / MANIFEST).stat().st_size
        stats["plan_seconds"] = plan_seconds
    return state_dict


def _targets(
    ck: Checkpoint, path: str | os.PathLike[str], state_dict: MutableMapping[str, Any], world: int
) -> tuple[list[Target], list[_Wanted]]:
    """The tensors of ``state_dict`` to fill and the objects to replace."""
    m = ck.manifest
    targets: list[Target] = []
    objects_wanted: list[_Wanted] = []
    for leaf in flatten(state_dict, f"load_sharded({path})"):
        key, v = leaf.key, leaf.value
        if isinstance(v, torch.Tensor):
            plain = not is_dtensor(v) and layout_of(v) is None
            if plain and key not in m["tensors"] and _object_prefix(m, key) is not None:
                # Saved inside an object (by an older tierstore that kept lists and integer-keyed dicts whole).
                objects_wanted.append(_Wanted(key, leaf.parent, leaf.slot, leaf.path, v))
                continue
            targets.append(_target(ck, key, v, world))
        elif key in m["objects"] or key in m["per_rank_objects"]:
            objects_wanted.append(_Wanted(key, leaf.parent, leaf.slot, leaf.path, None))
        else:
            sub = _subtree(ck, key, leaf.path)
            if sub is None:
                objects_wanted.append(_Wanted(key, leaf.parent, leaf.slot, leaf.path, None))
                continue
            tree, tensors, objs = sub
            leaf.parent[leaf.slot] = tree
            for name, (holder, slot) in tensors.items():
                t = holder[slot]
                targets.append(Target(name, t, t, Layout.full(name, tuple(t.shape))))
            for name, (holder, slot, pth) in objs.items():
                objects_wanted.append(_Wanted(name, holder, slot, pth, None))
    return targets, objects_wanted


def needed_files(ck: Checkpoint, state_dict: Any, rank: int, world: int) -> set[str] | None:
    """The data files a load of ``state_dict`` (as :func:`load_sharded`
    would plan it) reads from, plus the checkpoint's objects files; None
    when that cannot be told from the metadata alone (then: all of them).
    Nothing is allocated for the targets and ``state_dict`` is not changed:
    a Checkpointer asks this before a restore, to fetch from peers what this
    node's copy lacks."""
    m = ck.manifest
    try:
        targets: list[Target] = []
        for leaf in flatten(state_dict, "needed files"):
            v = leaf.value
            if not isinstance(v, torch.Tensor):
                if leaf.key not in m["objects"] and leaf.key not in m["per_rank_objects"]:
                    return None  # a subtree placeholder: its tensors are found at load time
                continue
            if not is_dtensor(v) and layout_of(v) is None and leaf.key not in m["tensors"]:
                return None
            local, lay = tensor_and_layout(leaf.key, v, world if is_dtensor(v) or layout_of(v) else 1)
            dtype = next((ck.dtype_of(pc.tensor) for pc in lay.pieces if pc.tensor in m["tensors"]), local.dtype)
            meta = torch.empty(tuple(local.shape), dtype=dtype, device="meta")
            targets.append(Target(leaf.key, meta, meta, lay))
        plan = make_plan(ck, targets)
    except (TierstoreError, ValueError, KeyError, TypeError):
        return None
    files = {src.file for _ti, _p, hits in plan.steps for src, _b in hits}
    names = {ck.manifest["files"][f]["name"] for f in files}
    # The job-wide objects; of the per-rank ones, this rank's own where the
    # world is the saved one, else every rank's (a per-rank policy chooses).
    names |= {str(f) for f in m["objects"].values()}
    same = int(m["world_size"]) == world
    for holders in m["per_rank_objects"].values():
        names |= {str(f) for r, f in holders.items() if not same or int(r) == rank}
    # Only names the manifest lists as its files (checked names, confined to the checkpoint).
    return names & ({f["name"] for f in m["files"]} | {o["name"] for o in m.get("object_files", ())})


def read_plan(
    ck: Checkpoint,
    plan: dict[int, FileBlocks],
    verify: str | bool,
    pending: list[_shared_verify.FilePieces] | None = None,
) -> tuple[int, int, int]:
    """Reads every file's blocks, each file checked against the manifest
    first and its chunks verified per ``verify`` (the runs expanded, merged
    and read in the engine, through reused windows where they are short).
    With ``"shared"``, the pieces of chunks read in part are appended to
    ``pending``, to be proven with the other ranks'. Returns the bytes read,
    verified, and those of the 4 KiB blocks the runs touch."""
    engine = get_engine()
    read = checked = blocks = 0
    mode = "none" if verify is False else str(verify)
    reads: list[tuple[int, str, FileBlocks, list[Any]]] = []
    for f, fb in plan.items():
        tables = ck.check_file(f)
        # An encoded file (a codec tier's copy): whole records decode straight
        # into their destinations; the rest is decoded into the file and read.
        fb, r, c, b = _decode_whole_records(ck, f, fb, tables, mode)
        read, checked, blocks = read + r, checked + c, blocks + b
        ck.count_read(f, r)
        if not len(fb.rows):
            continue
        # An encoded file's decoding: the records these blocks touch (all, to verify every chunk).
        ck.prepare_read(f, None if mode == "full" else block_spans(fb))
        reads.append((f, ck.path_of(f), fb, [t.as_tuple() for t in tables.values()]))

    def one(job: tuple[int, str, FileBlocks, list[Any]]) -> Any:
        _f, p, fb, tabs = job
        return _core.read_blocks(engine, p, fb.rows.tobytes(), fb.dims, tabs, verify=mode)

    # Several files at once (the engine call releases the GIL): each file is
    # one sequential stream through the page cache, and a rank that needs a
    # part of every file (a column shard of row-sharded tensors) keeps the
    # device busy only with several streams in flight. After an error the
    # reads not yet started are dropped; every read started has finished
    # before this returns or raises, so nothing writes into the caller's
    # tensors afterwards. Of the files read, the first in order that failed
    # is the one named.
    if len(reads) > 1:
        with ThreadPoolExecutor(min(_FILES_AT_ONCE, len(reads)), thread_name_prefix="tierstore-read") as ex:
            futures = [ex.submit(one, job) for job in reads]
            wait(futures, return_when=FIRST_EXCEPTION)
            for fu in futures:
                fu.cancel()
        failed = [e for fu in futures if not fu.cancelled() and (e := fu.exception()) is not None]
        if failed:
            raise failed[0]
        results = [fu.result() for fu in futures]
    else:
        results = [one(job) for job in reads]
    for (f, p, _fb, tabs), (r, c, b, pieces, filled) in zip(reads, results, strict=True):
        got = _shared_verify.collect(f, p, tabs, pieces, filled)
        if got is not None:
            if pending is None:
                raise InvalidArgumentError('verify="shared" needs the caller to prove the pieces it returns')
            pending.append(got)
        ck.count_read(f, r)
        read += r
        checked += c
        blocks += b
    return read, checked, blocks


def _decode_whole_records(
    ck: Checkpoint, f: int, fb: FileBlocks, tables: dict[str, Any], mode: str
) -> tuple[FileBlocks, int, int, int]:
    """The blocks of data file ``f`` that copy one whole record into
    contiguous memory, where ``f`` is an encoded file's decoding: each
    decoded straight into its destination (no decoded file written or read)
    and, unless ``mode`` is ``"none"``, its chunks checked against the
    record's checksums there. Returns the other blocks, and the bytes read,
    verified and of the 4 KiB blocks those records span."""
    rows = fb.rows
    if not len(rows) or not ck.is_decoding(f):
        return fb, 0, 0, 0
    records = {t.data_offset: t for t in tables.values()}
    single = np.ones(len(rows), dtype=bool)
    for k in range(fb.dims):
        single &= rows[:, 3 + 3 * k] == 1
    keep = np.ones(len(rows), dtype=bool)
    read = checked = blocks = 0
    for j in np.nonzero(single)[0].tolist():
        at, addr, n = (int(x) for x in rows[j, :3])
        t = records.get(at)
        if t is None or t.size != n or n <= 0 or not ck.decode_into(f, at, n, addr):
            continue
        if mode != "none":
            _check_sums(ck.path_of(f), t, addr, n)
            checked += n
        read += n
        blocks += ((at + n + 4095) // 4096 - at // 4096) * 4096
        keep[j] = False
    if keep.all():
        return fb, 0, 0, 0
    return FileBlocks(rows[keep], fb.dims), read, checked, blocks


def _check_sums(path: str, t: Any, addr: int, n: int) -> None:
    """Record ``t``'s chunk checksums against its ``n`` bytes in memory at
    ``addr``; a mismatch raises ChecksumError naming the file, the record
    and the chunk."""
    got = _core.chunk_checksums(get_engine(), [(addr, n)], t.chunk, t.algo)
    if got == t.sums:
        return
    i = next((k for k in range(0, min(len(got), len(t.sums)), 4) if got[k : k + 4] != t.sums[k : k + 4]), 0) // 4
    lo, hi = t.data_offset + i * t.chunk, min(t.data_offset + (i + 1) * t.chunk, t.data_offset + t.size)
    raise ChecksumError(
        f"{path}: record {t.record!r}: chunk {i} (bytes {lo}..{hi}) does not match its {t.algo} checksum "
        "after decoding from the tier's encoded file; the file or its reference is damaged",
        path=path,
        record=t.record,
    )


def block_spans(fb: FileBlocks) -> list[tuple[int, int]]:
    """The byte ranges of a data file that copy blocks ``fb`` read (the
    chunks their verification reads lie in the same records)."""
    r = fb.rows
    spans: list[tuple[int, int]] = []
    if len(r):
        lo = r[:, 0].astype(np.int64)
        ext = r[:, 2].astype(np.int64)
        for k in range(fb.dims):
            ext = ext + (r[:, 3 + 3 * k].astype(np.int64) - 1) * r[:, 4 + 3 * k].astype(np.int64)
        spans = list(zip(lo.tolist(), (lo + ext).tolist(), strict=True))
    return spans


def _load_from_dcp(
    path: str | os.PathLike[str],
    state_dict: MutableMapping[str, Any],
    world: int,
    weights_only: bool,
    stats: dict[str, Any] | None,
    verify: str | bool = "touched",
) -> MutableMapping[str, Any]:
    from tierstore import dcp

    targets = []
    objects = []
    for leaf in flatten(state_dict, f"load_sharded({path})", dcp=True):
        key, v = leaf.key, leaf.value
        if isinstance(v, torch.Tensor):
            local, lay = tensor_and_layout(key, v, world if is_dtensor(v) or layout_of(v) else 1)
            if sum(p.box.numel for p in lay.pieces) < local.numel():
                local.zero_()
            targets.append((key, local, lay))
        else:
            objects.append((key, leaf.parent, leaf.slot))
    # DCP's rules skip an empty dict: say so when the checkpoint holds values under one.
    empties = [leaf.key for leaf in flatten(state_dict) if isinstance(leaf.value, Mapping) and not leaf.value]
    dcp.load_dcp_into(path, targets, objects, weights_only, stats, verify, empties=empties)
    return state_dict


def _load_objects(
    ck: Checkpoint,
    wanted: list[_Wanted],
    rank: int,
    world: int,
    policy: str | Callable[[dict[int, Any]], Any] | None,
    weights_only: bool,
) -> None:
    if not wanted:
        return
    from tierstore.api import load as ts_load

    cache: dict[str, dict[str, Any]] = {}

    def objects_in(name: str) -> dict[str, Any]:
        if name not in cache:
            p = ck.check_objects_file(name)
            got = ts_load(p, weights_only=weights_only)
            c = ck.objects_copy.get(name, str(p.parent))
            ck.bytes_by_copy[c] = ck.bytes_by_copy.get(c, 0) + p.stat().st_size
            if not isinstance(got, dict) or not isinstance(got.get("objects"), dict):
                raise FormatError(f"{p}: not an objects file of a sharded checkpoint", path=str(p))
            cache[name] = got["objects"]
        return cache[name]

    def value(name: str, key: str) -> Any:
        objs = objects_in(name)
        if key not in objs:
            raise FormatError(f"{ck.dir / name}: holds no value for {key!r} (the manifest says it does)",
                              path=str(ck.dir / name))  # fmt: skip
        return objs[key]

    m = ck.manifest
    saved_world = int(m["world_size"])

    def saved(key: str) -> Any:
        if key in m["objects"]:
            return value(m["objects"][key], key)
        holders = {int(r): f for r, f in m["per_rank_objects"][key].items()}
        if saved_world == world and rank in holders:
            return value(holders[rank], key)
        if policy == "rank0":
            return value(holders[min(holders)], key)
        if callable(policy):
            return policy({r: value(f, key) for r, f in holders.items()})
        raise FormatError(
            f"{ck.dir}: per-rank object {key!r} was saved by {saved_world} ranks and is loaded by {world}; "
            "pass per_rank_policy='rank0' or a function of {rank: value} to choose"
        )

    for w in wanted:
        if w.key in m["objects"] or w.key in m["per_rank_objects"]:
            got = saved(w.key)
        else:
            pre = _object_prefix(m, w.key)
            cut = None
            if pre is not None:
                cut = next((i for i in range(1, len(w.path)) if _tree.key_of(w.path[:i]) == pre), None)
            if pre is None or cut is None:
                raise MissingRecordError(f"{ck.dir}: the checkpoint has no value for {w.key!r}", path=str(ck.dir))
            got = _index(saved(pre), w.path[cut:], f"{ck.dir}: the checkpoint has no value for {w.key!r} "
                         f"(its object {pre!r} holds none there)")  # fmt: skip
        if w.like is None:
            w.parent[w.slot] = got
        elif not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(w.like.shape):
            what = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise LayoutError(f"{ck.dir}: {w.key!r} is {what} in the checkpoint; the target is a tensor of shape "
                              f"{tuple(w.like.shape)}")  # fmt: skip
        else:
            with torch.no_grad():
                w.like.copy_(got)


def _index(obj: Any, rest: Sequence[Any], missing: str) -> Any:
    """``obj`` indexed by the path items ``rest`` (string keys that were
    integers, list indices), as an older checkpoint's whole object holds them."""
    for item in rest:
        k = item["int"] if isinstance(item, dict) else item
        if isinstance(obj, Mapping):
            if k in obj:
                obj = obj[k]
                continue
            if isinstance(k, str) and k.lstrip("-").isdigit() and int(k) in obj:
                obj = obj[int(k)]
                continue
        elif isinstance(obj, (list, tuple)) and (isinstance(k, int) or (isinstance(k, str) and k.isdigit())):
            i = int(k)
            if i < len(obj):
                obj = obj[i]
                continue
        raise MissingRecordError(missing)
    return obj
