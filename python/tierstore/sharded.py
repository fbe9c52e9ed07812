"""Sharded checkpoints with load-time resharding.

``save_sharded(state_dict, path)`` is called by every rank with its local
state; ``load_sharded(path, state_dict)`` by every rank of any other layout
fills its state dict in place, reading only the bytes it needs. Values may be
tensors with a :class:`~tierstore.layout.Layout` attached
(:func:`~tierstore.layout.attach`), DTensors (their placements are read
automatically), plain tensors (the whole logical tensor, replicated across
the group) or other objects (replicated, written once; wrap per-rank objects
such as RNG states in :class:`PerRank`).

A checkpoint is a directory::

    manifest.json                 written last: the commit point
    rank-00000.<save id>.pt       one tierstore file per writing rank; torch.load opens it
    objects-00000.<save id>.pt    non-tensor state of that rank, if any

Saving is two-phase: every rank writes and fsyncs its files under a new save
id, the ranks' metadata is gathered once, and rank 0 checks that the saved
pieces of every global tensor are disjoint and cover it, then atomically
replaces ``manifest.json``. A rank that fails before that leaves the previous
checkpoint in place and loadable.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

from tierstore import _core, _dist, _limits, _tree, api
from tierstore._engine import get_engine
from tierstore._fs import make_dir
from tierstore.errors import FormatError, InvalidArgumentError, LayoutError, MissingRecordError, NotFoundError
from tierstore.layout import Box, Layout, Piece, layout_of
from tierstore.reshard import CoverageError, Source, merge_runs, overlapping_pair, prove_coverage, runs_for
from tierstore.shardmeta import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Checkpoint,
    ChunkTable,
    dtype_of,
    write_manifest,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "PerRank",
    "consolidate",
    "init_optimizer_state",
    "load_optimizer_state_dict",
    "load_sharded",
    "optimizer_state_dict",
    "save_sharded",
]

# What a load verifies: every chunk its reads touch (default), every chunk
# of every record it reads from, or nothing.
VERIFY_MODES = ("touched", "full", False)


@dataclass
class PerRank:
    """A non-tensor value that differs per rank (RNG state, data-loader
    position): each rank saves its own, and a load gets its rank's value."""

    value: Any


# ----------------------------------------------------------------------------------------------
# process groups


# Called through these names (a test stands in for _all_gather to kill a rank mid-save).
_group_info = _dist.group_info
_all_gather = _dist.all_gather
_barrier = _dist.barrier


# ----------------------------------------------------------------------------------------------
# state dict flattening


def _flatten(sd: Mapping[str, Any], where: str = "state dict", dcp: bool = False) -> Iterator[_tree.Leaf]:
    """Every leaf of ``sd`` under DCP's flattening rules (see :mod:`tierstore._tree`)."""
    try:
        yield from _tree.flatten(sd, dcp=dcp, where=where)
    except ValueError as e:
        raise LayoutError(str(e)) from None


def _dtensor_layout(key: str, t: Any) -> tuple[torch.Tensor, Layout]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    gshape = tuple(t.shape)
    for p in t.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise LayoutError(f"{key}: DTensor placement {p} cannot be checkpointed (only Shard and Replicate)")
    shape, offset = compute_local_shape_and_global_offset(gshape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise LayoutError(f"{key}: DTensor local shape {tuple(local.shape)} differs from the computed {shape}")
    replicated = any(isinstance(p, Replicate) for p in t.placements)
    lay = Layout.block(key, gshape, tuple(offset), tuple(shape), replicated=replicated)
    if math.prod(shape) == 0:
        lay = Layout(tuple(shape), (), {key: gshape}, replicated)
    return local, lay


def is_dtensor(v: Any) -> TypeGuard[DTensor]:
    """Whether ``v`` is a DTensor (False where torch has no distributed tensors)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(v, DTensor)


def tensor_and_layout(key: str, v: torch.Tensor, world: int) -> tuple[torch.Tensor, Layout]:
    """The local tensor of ``v`` and its layout: attached, from DTensor placements, or whole (replicated)."""
    if is_dtensor(v):
        return _dtensor_layout(key, v)
    lay = layout_of(v)
    if lay is None:
        lay = Layout.full(key, tuple(v.shape), replicated=world > 1)
    return v, lay


# ----------------------------------------------------------------------------------------------
# save


def _replica_id(lay: Layout) -> str:
    return json.dumps([[p.tensor, p.box.to_json()] for p in lay.pieces])


def _sample_crc(t: torch.Tensor) -> int | None:
    """CRC-32 of 16 elements spread over ``t`` (a cheap fingerprint: replicas
    of one tensor have equal ones); None where it cannot be taken."""
    try:
        t = t.detach()
        n = t.numel()
        if n == 0:
            return 0
        if t.dim() == 0:
            picked = t.reshape(1)
        else:
            # The elements are picked by coordinates: no copy of a non-contiguous tensor.
            idx = torch.linspace(0, n - 1, min(n, 16)).round().long()
            coords = tuple(c.to(t.device) for c in torch.unravel_index(idx, tuple(t.shape)))
            picked = t[coords]
        return zlib.crc32(picked.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError, NotImplementedError):  # quantized, sparse, meta, ...
        return None


def _warn_unreplicated(metas: list[dict[str, Any]], d: Path) -> None:
    """Plain tensors stand for the whole logical tensor, replicated over the
    ranks, and one rank writes each (as DCP does). When the ranks' copies
    differ (a tensor-parallel shard saved without its layout, such as the
    state of a plain ``optimizer.state_dict()`` of sharded parameters), only
    one copy would be kept: say so."""
    seen: dict[str, tuple[int, int, str]] = {}
    odd: list[str] = []
    for r, m in enumerate(metas):
        for key, info in m["tensors"].items():
            if info.get("sample") is None:
                continue
            first = seen.setdefault(info["replica_id"], (r, info["sample"], key))
            if first[1] != info["sample"] and len(odd) < 5:
                odd.append(f"{key!r} (ranks {first[0]} and {r})")
    if odd:
        warnings.warn(
            f"save_sharded({d}): plain tensors differ between ranks: {', '.join(odd)}; a plain tensor stands for "
            "the whole tensor, replicated, and only one rank's copy is written. Attach a Layout to shards (or use "
            "DTensors, or tierstore.optimizer_state_dict for optimizer state that follows its parameters' layouts), "
            "or wrap values that differ per rank in PerRank",
            stacklevel=3,
        )


def _assign_writers(metas: list[dict[str, Any]]) -> dict[tuple[int, str], bool]:
    """For replicated tensors held by several ranks, one holder writes: the
    one with the fewest bytes assigned so far (largest tensors first), so that
    writes are balanced. Returns {(rank, key): writes?}."""
    load = [0] * len(metas)
    groups: dict[str, list[tuple[int, str, int]]] = {}
    decide: dict[tuple[int, str], bool] = {}
    for rank, m in enumerate(metas):
        for key, info in m["tensors"].items():
            if info["replicated"]:
                groups.setdefault(info["replica_id"], []).append((rank, key, info["nbytes"]))
            else:
                decide[(rank, key)] = True
                load[rank] += info["nbytes"]
    for _rid, holders in sorted(groups.items(), key=lambda kv: -kv[1][0][2]):
        best = min(holders, key=lambda h: (load[h[0]], h[0]))
        for h in holders:
            decide[(h[0], h[1])] = h is best
        load[best[0]] += best[2]
    return decide


def save_sharded(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    durable: bool = True,
    background: bool = False,
) -> None:
    """Saves this rank's part of a sharded checkpoint (every rank calls it).

    See the module documentation for what the values may be. Returns after
    the checkpoint is committed (``manifest.json`` written by rank 0).
    ``durable=False`` skips every fsync (of the data files, the manifest and
    the directories): the commit stays atomic against a process crash but
    not against a power loss.
    """
    write_sharded(state_dict, path, process_group=process_group, durable=durable, background=background)


def write_sharded(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    durable: bool = True,
    background: bool = False,
    gates: api.Gates | None = None,
    attachments: Sequence[str] = (),
) -> None:
    """The shard writer under :func:`save_sharded`, for the Checkpointer:
    ``gates`` lets the file writers read tensors still being captured
    (see :func:`tierstore.api.write_file`); ``attachments`` names files rank 0
    wrote into the directory before (``checkpoint.json``), whose size and
    CRC-32 the manifest records."""
    rank, world, pg = _group_info(process_group)
    d = Path(path)
    if rank == 0:
        make_dir(d, durable)
    _barrier(world, pg)
    if not d.is_dir():
        raise NotFoundError(f"{d}: checkpoint directory does not exist", path=str(d))
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, Layout] = {}
    objects: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    paths: dict[str, list[Any]] = {}
    for leaf in _flatten(state_dict, f"save_sharded({d})"):
        key, v = leaf.key, leaf.value
        if not _tree.is_plain(leaf.path):
            paths[key] = list(leaf.path)
        if isinstance(v, torch.Tensor):
            local, lay = tensor_and_layout(key, v, world)
            lay.validate(f"{key}")
            tensors[key] = local.detach()
            layouts[key] = lay
        elif isinstance(v, PerRank):
            per_rank[key] = v.value
        else:
            objects[key] = v
    save_id = secrets.token_hex(6)
    meta = {
        "save_id": save_id,
        "tensors": {
            k: {
                "replicated": layouts[k].replicated,
                "replica_id": _replica_id(layouts[k]),
                "nbytes": t.numel() * t.element_size(),
                **({"sample": _sample_crc(t)} if world > 1 and layouts[k].replicated else {}),
            }
            for k, t in tensors.items()
        },
    }
    metas = _all_gather(meta, world, pg)
    save_id = metas[0]["save_id"]
    if rank == 0 and world > 1:
        _warn_unreplicated(metas, d)
    writes = _assign_writers(metas)
    mine = {k: t for k, t in tensors.items() if writes[(rank, k)]}
    file_info: dict[str, Any] = {"rank": rank, "tensors": {}, "objects_file": None, "paths": paths}
    fname = f"rank-{rank:05d}.{save_id}.pt"

    keep_objects = dict(per_rank)
    if rank == 0:
        keep_objects.update(objects)
    # The objects file (e.g. optimizer state) is written while the tensor file is.
    objects_job = None
    if keep_objects:
        oname = f"objects-{rank:05d}.{save_id}.pt"
        pool = ThreadPoolExecutor(1, thread_name_prefix="tierstore-objects")
        objects_job = pool.submit(
            api.write_file, {"objects": keep_objects}, d / oname, durable=durable, background=background, gates=gates
        )
        pool.shutdown(wait=False)
    try:
        if mine:
            contiguous = {k: (t if t.is_contiguous() else t.contiguous()) for k, t in mine.items()}
            written = api.write_file(
                {"tensors": contiguous},
                d / fname,
                durable=durable,
                background=background,
                gates=gates,
                chunk_checksums=True,
                layouts={("tensors", k): layouts[k].to_json() for k in contiguous},
            )
            recs = {r["name"]: r for r in written.records}
            for t in written.tensors:
                if len(t["path"]) != 2 or t["path"][0] != "tensors":
                    continue
                key = t["path"][1]
                rec = recs[t["record"]]
                item = torch.empty((), dtype=contiguous[key].dtype).element_size()
                file_info["tensors"][key] = {
                    "offset": rec["offset"] + t["storage_offset"] * item,
                    "dtype": t["dtype"],
                    "shape": t["shape"],
                    "record": t["record"],
                    "record_offset": rec["offset"],
                    "record_size": rec["size"],
                    "crc32": rec["crc32"],
                    "layout": layouts[key].to_json(),
                }
            file_info["file"] = fname
            file_info["bytes"] = written.file_len
            file_info["manifest_crc32"] = written.manifest_crc32
    finally:
        objects_written = objects_job.result() if objects_job is not None else None  # its error, if any
    if keep_objects:
        file_info["objects_file"] = oname
        file_info["object_keys"] = sorted(keep_objects)
        file_info["per_rank_keys"] = sorted(per_rank)
        assert objects_written is not None
        file_info["objects_bytes"] = objects_written.file_len
        file_info["objects_manifest_crc32"] = objects_written.manifest_crc32
    infos = _all_gather(file_info, world, pg)
    if rank == 0:
        m = _build_manifest(d, save_id, world, infos)
        m["attachments"] = {}
        for name in attachments:
            data = (d / name).read_bytes()
            m["attachments"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        write_manifest(d, m, durable)
        _collect_garbage(d, save_id)
    _barrier(world, pg)


def _build_manifest(d: Path, save_id: str, world: int, infos: list[dict[str, Any]]) -> dict[str, Any]:
    from tierstore import __version__

    files: list[dict[str, Any]] = []
    stored: list[dict[str, Any]] = []
    globals_: dict[str, dict[str, Any]] = {}
    for info in infos:
        if not info.get("file"):
            continue
        fidx = len(files)
        files.append(
            {
                "rank": info["rank"],
                "name": info["file"],
                "bytes": info["bytes"],
                "manifest_crc32": info["manifest_crc32"],
            }
        )
        for key, t in sorted(info["tensors"].items()):
            sidx = len(stored)
            stored.append({"file": fidx, "key": key, **{k: v for k, v in t.items() if k != "layout"}})
            lay = Layout.from_json(t["layout"])
            for p in lay.pieces:
                g = globals_.setdefault(
                    p.tensor, {"shape": list(lay.global_shapes[p.tensor]), "dtype": t["dtype"], "pieces": []}
                )
                if list(lay.global_shapes[p.tensor]) != g["shape"]:
                    raise LayoutError(
                        f"global tensor {p.tensor!r} has shape {g['shape']} on one rank and "
                        f"{list(lay.global_shapes[p.tensor])} on another"
                    )
                pj = p.to_json()
                g["pieces"].append([sidx, pj["box"], pj.get("local_box", pj.get("local_flat")), lay.is_replica(p)])
            for name, shape in lay.global_shapes.items():
                globals_.setdefault(name, {"shape": list(shape), "dtype": t["dtype"], "pieces": []})
    # Replicas of one box (held by several ranks) are referenced once.
    for g in globals_.values():
        kept: dict[str, list[Any]] = {}
        pieces = []
        for pc in g["pieces"]:
            key = json.dumps(pc[1])
            if key in kept:
                if not (pc[3] and kept[key][3]):
                    pieces.append(pc)  # a genuine overlap: reported below
                continue
            kept[key] = pc
            pieces.append(pc)
        g["pieces"] = [pc[:3] for pc in pieces]
    # Every global tensor must be covered exactly once by what was written.
    for name, g in globals_.items():
        boxes = [Box.from_json(p[1]) for p in g["pieces"]]
        total = sum(b.numel for b in boxes)
        want = math.prod(g["shape"])
        if total != want or overlapping_pair(boxes) is not None:
            raise CoverageError(
                f"save: global tensor {name!r} of shape {tuple(g['shape'])}: the ranks' pieces cover {total} of "
                f"{want} elements{' and overlap' if total >= want else ''}; check the layouts"
            )
    objects = {}
    per_rank: dict[str, dict[str, str]] = {}
    object_files = []
    for info in infos:
        if info.get("objects_file"):
            object_files.append(
                {
                    "name": info["objects_file"],
                    "bytes": info["objects_bytes"],
                    "manifest_crc32": info["objects_manifest_crc32"],
                }
            )
            for k in info["object_keys"]:
                if k in info.get("per_rank_keys", []):
                    per_rank.setdefault(k, {})[str(info["rank"])] = info["objects_file"]
                else:
                    objects[k] = info["objects_file"]
    paths: dict[str, Any] = {}
    for info in infos:
        paths.update(info.get("paths", {}))
    held = {s["key"] for s in stored} | set(objects) | set(per_rank)
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "writer": f"tierstore {__version__}",
        "created_unix": round(time.time(), 3),
        "save_id": save_id,
        "world_size": world,
        "files": files,
        "stored": stored,
        "tensors": globals_,
        "objects": objects,
        "per_rank_objects": per_rank,
        "object_files": object_files,
    }
    # Paths of the keys whose nesting their dotted key does not tell (list
    # indices, integer keys, keys with dots), for a load that rebuilds it.
    kept = {k: p for k, p in paths.items() if k in held}  # in the state dict's order, for a rebuild
    if kept:
        out["paths"] = kept
    return out


def _collect_garbage(d: Path, save_id: str) -> None:
    for f in d.iterdir():
        n = f.name
        if (n.startswith(("rank-", "objects-"))) and n.endswith(".pt") and f".{save_id}." not in n:
            f.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# load


def _dtype(name: str) -> torch.dtype:
    return dtype_of(name)


@dataclass
class _Target:
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


def make_plan(ck: Checkpoint, targets: list[_Target]) -> Plan:
    """Intersects every target piece with the saved pieces of its global
    tensor and proves coverage. No file is read, no collective is used."""
    steps: list[tuple[int, Piece, list[tuple[Source, Box]]]] = []
    needed: dict[str, int] = {}
    for ti, t in enumerate(targets):
        inters_all: list[list[Box]] = []
        item = t.dest.element_size()
        for piece in t.layout.pieces:
            idx = ck.index.get(piece.tensor)
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


def expand_plan(plan: Plan, targets: list[_Target]) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Turns a plan into byte ranges per file: (file offsets, lengths,
    destination addresses), merged where contiguous on both sides."""
    from tierstore.reshard import affine_map

    # Per file: flat Python lists for small results, NumPy arrays for large ones.
    per_file: dict[int, tuple[list[int], list[int], list[int], list[Any]]] = {}
    src_aff: dict[int, tuple[int, list[int]]] = {}
    for ti, piece, hits in plan.steps:
        t = targets[ti]
        item = t.dest.element_size()
        base = t.dest.data_ptr()
        nd = len(piece.box.offsets)
        daff = affine_map(piece, t.layout.local_shape, nd)
        for src, inter in hits:
            saff = src_aff.get(id(src))
            if saff is None:
                saff = src_aff[id(src)] = affine_map(src.piece, src.local_shape, nd)
            s_el, d_el, n_el = runs_for(inter, src, piece, t.layout.local_shape, saff, daff)
            acc = per_file.setdefault(src.file, ([], [], [], []))
            if isinstance(s_el, list):
                so = src.offset
                acc[0].extend([so + x * item for x in s_el])
                acc[1].extend([base + x * item for x in d_el])
                acc[2].extend([x * item for x in n_el])
            else:
                acc[3].append((src.offset + s_el * item, base + d_el * item, n_el * item))
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for f, (ps, pd, pl, arrays) in per_file.items():
        ss = [np.array(ps, dtype=np.int64)] + [a[0] for a in arrays]
        ds = [np.array(pd, dtype=np.int64)] + [a[1] for a in arrays]
        ls = [np.array(pl, dtype=np.int64)] + [a[2] for a in arrays]
        r = merge_runs(np.concatenate(ss), np.concatenate(ds), np.concatenate(ls))
        out[f] = (r.src.tolist(), r.length.tolist(), r.dst.tolist())
    return out


@dataclass
class _Wanted:
    """A non-tensor value to load (or a plain tensor saved inside an object)."""

    key: str
    parent: Any
    slot: Any
    path: tuple[Any, ...]
    like: torch.Tensor | None


def _target(ck: Checkpoint, key: str, v: torch.Tensor, world: int) -> _Target:
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
    elif local.device.type != "cpu":
        dest = torch.empty(local.shape, dtype=local.dtype)
    if sum(p.box.numel for p in lay.pieces) < local.numel():
        dest.zero_()  # padding is recreated as zeros
    return _Target(key, dest, local, lay)


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
    total = sum(math.prod(m["tensors"][n]["shape"]) * _dtype(m["tensors"][n]["dtype"]).itemsize for n in names)
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
                tensors[n] = _tree.set_path(root, rel, torch.empty(g["shape"], dtype=_dtype(g["dtype"])))
            else:
                holder, slot = _tree.set_path(root, rel, None)
                places[n] = (holder, slot, (*path, *sp[cut:]))
        except (ValueError, TypeError, AttributeError) as e:
            raise FormatError(f"{ck.dir / MANIFEST}: paths[{n[:100]!r}] does not fit the others ({e})",
                              path=str(ck.dir / MANIFEST), record=f"paths[{n[:100]!r}]") from None  # fmt: skip
    if "_" not in root:
        return None
    return root["_"], tensors, places


def load_sharded(
    path: str | os.PathLike[str],
    state_dict: MutableMapping[str, Any],
    *,
    process_group: Any = None,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None = None,
    weights_only: bool = True,
    stats: dict[str, Any] | None = None,
    verify: str | bool = "touched",
) -> MutableMapping[str, Any]:
    """Fills ``state_dict`` in place from the checkpoint at ``path``.

    Tensors receive exactly their local pieces (any layout: attached
    :class:`Layout`, DTensor placements, or plain tensors standing for the
    whole logical tensor); only the bytes each needs are read. Non-tensor
    values are replaced by the saved ones. Per-rank objects saved by a
    different number of ranks need ``per_rank_policy``: ``"rank0"`` (take rank
    0's) or a function of ``{rank: value}``.

    ``verify`` says which checksums are checked: ``"touched"`` (default)
    every 4 KiB chunk a read touches, reading the rest of a chunk it touches
    in part; ``"full"`` every chunk of every record read from; ``False``
    none (the metadata is still checked). ``stats``, if given, receives the
    bytes read, verified and needed. Returns ``state_dict``.
    """
    return read_sharded(
        path,
        state_dict,
        process_group=process_group,
        per_rank_policy=per_rank_policy,
        weights_only=weights_only,
        stats=stats,
        verify=verify,
    )


def read_sharded(
    path: str | os.PathLike[str],
    state_dict: MutableMapping[str, Any],
    *,
    process_group: Any = None,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None = None,
    weights_only: bool = True,
    stats: dict[str, Any] | None = None,
    verify: str | bool = "touched",
    checkpoint: Checkpoint | None = None,
) -> MutableMapping[str, Any]:
    """:func:`load_sharded`, given the checkpoint's metadata already read
    and checked (``checkpoint``) where the caller has it."""
    if verify is True:
        verify = "touched"
    if verify not in VERIFY_MODES:
        raise InvalidArgumentError(f"verify must be 'touched', 'full' or False, not {verify!r}")
    rank, world, _pg = _group_info(process_group)
    from tierstore import dcp

    if not (Path(path) / MANIFEST).exists() and dcp.is_dcp(path):
        return _load_from_dcp(path, state_dict, world, weights_only, stats, verify)
    ck = checkpoint if checkpoint is not None else Checkpoint(path)
    m = ck.manifest
    targets: list[_Target] = []
    objects_wanted: list[_Wanted] = []
    for leaf in _flatten(state_dict, f"load_sharded({path})"):
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
                targets.append(_Target(name, t, t, Layout.full(name, tuple(t.shape))))
            for name, (holder, slot, pth) in objs.items():
                objects_wanted.append(_Wanted(name, holder, slot, pth, None))
    t_plan = time.perf_counter()
    the_plan = make_plan(ck, targets)
    plan_seconds = time.perf_counter() - t_plan
    plan = expand_plan(the_plan, targets)
    needed = the_plan.needed
    read, checked, blocks = read_plan(ck, plan, verify)
    for t in targets:
        if t.dest is not t.final:
            t.final.copy_(t.dest)
    _load_objects(ck, objects_wanted, rank, world, per_rank_policy, weights_only)
    if stats is not None:
        stats["bytes_read"] = read
        stats["bytes_verified"] = checked
        stats["bytes_needed"] = sum(needed.values())
        stats["bytes_needed_blocks"] = blocks
        stats["manifest_bytes"] = (ck.dir / MANIFEST).stat().st_size
        stats["plan_seconds"] = plan_seconds
    return state_dict


def _blocks(offs: np.ndarray, lens: np.ndarray, block: int = 4096) -> int:
    """Bytes of the ``block``-byte blocks the ranges touch (each block once)."""
    keep = lens > 0
    if not keep.any():
        return 0
    lo = offs[keep] // block
    hi = -(-(offs[keep] + lens[keep]) // block)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    # A block run starts where a range begins past everything before it.
    start = np.concatenate(([True], lo[1:] >= reach[:-1]))
    group = np.cumsum(start) - 1
    first = lo[start]
    last = np.zeros(len(first), dtype=np.int64)
    np.maximum.at(last, group, hi)
    return int((last - first).sum()) * block


def read_plan(
    ck: Checkpoint, plan: dict[int, tuple[list[int], list[int], list[int]]], verify: str | bool
) -> tuple[int, int, int]:
    """Reads every file's ranges, each file checked against the manifest
    first and every touched chunk verified (per ``verify``). Returns the
    bytes read, verified, and those of the 4 KiB blocks the ranges touch."""
    engine = get_engine()
    read = checked = blocks = 0
    for f, (offs, lens, dests) in plan.items():
        fp = ck.files[f]
        tables = ck.check_file(f)
        o = np.asarray(offs, dtype=np.int64)
        n = np.asarray(lens, dtype=np.int64)
        blocks += _blocks(o, n)
        if verify is False:
            read += _core.read_ranges(engine, str(fp), offs, lens, dests)
            continue
        tl: list[ChunkTable] = sorted(tables.values(), key=lambda t: t.data_offset)
        starts = np.array([t.data_offset for t in tl], dtype=np.int64)
        ids = np.searchsorted(starts, o, side="right") - 1
        if len(ids) and int(ids.min()) < 0:
            raise CoverageError(f"{fp}: a read lies before the first stored record; the manifest is damaged")
        used, local = np.unique(ids, return_inverse=True)
        r, c = _core.read_ranges_verified(
            engine,
            str(fp),
            offs,
            lens,
            dests,
            local.tolist(),
            [tl[i].as_tuple() for i in used.tolist()],
            full=verify == "full",
        )
        read += r
        checked += c
    return read, checked, blocks


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
    for leaf in _flatten(state_dict, f"load_sharded({path})", dcp=True):
        key, v = leaf.key, leaf.value
        if isinstance(v, torch.Tensor):
            local, lay = tensor_and_layout(key, v, world if is_dtensor(v) or layout_of(v) else 1)
            if sum(p.box.numel for p in lay.pieces) < local.numel():
                local.zero_()
            targets.append((key, local, lay))
        else:
            objects.append((key, leaf.parent, leaf.slot))
    # DCP's rules skip an empty dict: say so when the checkpoint holds values under one.
    empties = [leaf.key for leaf in _flatten(state_dict) if isinstance(leaf.value, Mapping) and not leaf.value]
    dcp.load_dcp_into(path, targets, objects, weights_only, stats, verify, empties=empties)
    return state_dict


def consolidate(
    path: str | os.PathLike[str],
    *,
    weights_only: bool = True,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None = None,
) -> dict[str, Any]:
    """The whole checkpoint as one flat dict ``{global name: full tensor}``,
    plus its replicated objects (for inference or upload), plus its per-rank
    objects where a value can be chosen: this rank's when the saving world
    had this rank and size, else by ``per_rank_policy`` (as for
    :func:`load_sharded`); without one they are left out."""
    from tierstore import dcp

    if not (Path(path) / MANIFEST).exists() and dcp.is_dcp(path):
        return dcp.to_state_dict(path, weights_only, nested=True)
    ck = Checkpoint(path)
    m = ck.manifest
    _check_consolidated_size(Path(path), m)
    ck.check_all_files()  # the global shapes it allocates, against what each file holds
    sd: dict[str, Any] = {name: torch.empty(g["shape"], dtype=_dtype(g["dtype"])) for name, g in m["tensors"].items()}
    for key in m["objects"]:
        sd[key] = None
    rank, world, _pg = _group_info(None)
    left_out = []
    for key, holders in m.get("per_rank_objects", {}).items():
        if per_rank_policy is not None or (int(m["world_size"]) == world and str(rank) in holders):
            sd[key] = None
        else:
            left_out.append(key)
    if left_out:
        warnings.warn(
            f"{path}: per-rank objects {', '.join(sorted(left_out))} were saved by {m['world_size']} ranks and "
            f"are left out (this is rank {rank} of {world}); pass per_rank_policy='rank0' or a function of "
            "{rank: value} to get them",
            stacklevel=2,
        )
    flat_sd: dict[str, Any] = {}
    # load_sharded flattens nested dicts; global names are already flat keys.
    read_sharded(path, sd, weights_only=weights_only, per_rank_policy=per_rank_policy, checkpoint=ck)
    flat_sd.update(sd)
    return flat_sd


def _check_consolidated_size(d: Path, m: dict[str, Any]) -> None:
    """Refuses to allocate the full tensors of a manifest before their sizes
    are checked against what its pieces and files hold, and against the
    memory there is."""
    where = str(d / MANIFEST)
    total = 0
    for name, g in m["tensors"].items():
        numel = math.prod(g["shape"])
        held = sum(math.prod(p[1][1]) for p in g["pieces"])
        if held != numel:
            raise CoverageError(
                f"{where}: global tensor {name!r} of shape {tuple(g['shape'])} has {numel} elements but its pieces "
                f"hold {held}; the manifest is damaged"
            )
        total += numel * torch.empty((), dtype=_dtype(g["dtype"])).element_size()
    on_disk = 0
    for i, fe in enumerate(m["files"]):
        p = d / fe["name"]
        try:
            on_disk += p.stat().st_size
        except FileNotFoundError:
            raise NotFoundError(f"{p}: shard file of the checkpoint is missing (files[{i}])", path=str(p)) from None
    if total > on_disk:
        raise CoverageError(
            f"{where}: the global tensors add up to {total} bytes but the shard files hold only {on_disk}; "
            "the manifest is damaged"
        )
    _limits.check_allocation(total, f"the {len(m['tensors'])} full tensors of {d}", str(d))


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


# ----------------------------------------------------------------------------------------------
# optimizer state that follows its parameters


def optim_name(state: str, param: str) -> str:
    """Global name of optimizer state ``state`` (exp_avg, momentum_buffer, step, ...) of ``param``."""
    return f"optim.{state}.{param}"


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    named_params: Any,
    layouts: Mapping[str, Layout] | None = None,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, each state tensor carrying
    its parameter's layout (renamed to ``optim.<state>.<param>``), so that any
    optimizer's state (Adam's moments, Muon's momentum, step counts) reshards
    with its parameter. Scalar states are replicated.

    ``named_params`` is ``model.named_parameters()`` (or pairs in the
    optimizer's parameter order); ``layouts`` gives the layout of parameters
    that are shards (defaults to the layout attached to each parameter).
    """
    pairs = list(named_params)
    by_id = {id(p): (n, p) for n, p in pairs}
    sd = optimizer.state_dict()
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    out_state: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        name, param = by_id[ids[idx]]
        lay = (layouts or {}).get(name) or layout_of(param) or Layout.full(name, tuple(param.shape))
        entry: dict[str, Any] = {}
        for sname, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape):
                entry[sname] = _attach_copy(v, lay.renamed(lambda n, s=sname: optim_name(s, n)))
            elif isinstance(v, torch.Tensor):
                entry[sname] = _attach_copy(v, Layout.full(optim_name(sname, name), tuple(v.shape)))
            else:
                entry[sname] = v
        out_state[name] = entry
    groups = []
    for g in sd["param_groups"]:
        g2 = dict(g)
        g2["params"] = [by_id[ids[i]][0] for i in g["params"]]
        groups.append(g2)
    return {"state": out_state, "param_groups": groups}


def _attach_copy(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """A new tensor object sharing ``t``'s memory, with ``lay`` attached (so a
    load fills the optimizer's own state in place)."""
    from tierstore.layout import attach

    return attach(t.detach(), lay)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates a fresh optimizer's state (one step with zero gradients and a
    zero learning rate, which leaves the parameters unchanged), so that a
    checkpoint can be loaded into it."""
    saved = []
    for g in optimizer.param_groups:
        saved.append(g["lr"])
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, named_params: Any, state: Mapping[str, Any]) -> None:
    """Loads a state produced by :func:`optimizer_state_dict` (and filled by
    :func:`load_sharded`) into ``optimizer``."""
    pairs = list(named_params)
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    index = {name: ids.index(id(p)) for name, p in pairs if id(p) in ids}
    sd = {
        "state": {index[name]: dict(st) for name, st in state["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]],
    }
    optimizer.load_state_dict(sd)
