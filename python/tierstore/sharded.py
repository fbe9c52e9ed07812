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

import functools
import hashlib
import json
import os
import secrets
import warnings
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import _dist, _gc, _tree, api
from tierstore._consolidate import consolidate
from tierstore._fs import make_dir
from tierstore._leaves import PerRank, flatten, is_dtensor, tensor_and_layout
from tierstore._metadata import dtype_name
from tierstore._sharded_commit import build_manifest
from tierstore._sharded_read import (
    VERIFY_MODES,
    Plan,
    expand_plan,
    load_sharded,
    make_plan,
    read_plan,
)
from tierstore.errors import NotFoundError, TierstoreError
from tierstore.layout import Layout
from tierstore.optim_state import (
    init_optimizer_state,
    load_optimizer_state_dict,
    optim_name,
    optimizer_state_dict,
)
from tierstore.shardmeta import (
    dtype_of,
    index_name,
    write_manifest,
)

# The load side and the optimizer-state helpers live in their own modules; their
# names are this module's public surface too.
__all__ = [
    "VERIFY_MODES",
    "PerRank",
    "Plan",
    "consolidate",
    "expand_plan",
    "init_optimizer_state",
    "is_dtensor",
    "load_optimizer_state_dict",
    "load_sharded",
    "make_plan",
    "optim_name",
    "optimizer_state_dict",
    "read_plan",
    "save_sharded",
    "tensor_and_layout",
    "write_sharded",
]

# ----------------------------------------------------------------------------------------------
# process groups


# Called through these names (a test stands in for _gather to kill a rank mid-save).
_group_info = _dist.group_info
_gather = _dist.gather
_scatter = _dist.scatter
_broadcast = _dist.broadcast
_barrier = _dist.barrier


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
    firsts: dict[str, tuple[int, Any]] = {}
    for r, m in enumerate(metas):
        for g in m.get("groups", ()):
            if g[3] is None:
                continue
            held = firsts.setdefault(_group_key(g), (r, g[3]))
            if held[1] != g[3] and len(odd) < 5:
                odd.append(f"replicated tensors at position {g[0]} of a sharding rule (ranks {held[0]} and {r})")
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
    writes are balanced. Ranks at the same position of the same rules are
    replicas of that position (:func:`_group_key`). Returns {(rank, key):
    writes?} (on rank 0, from the gathered metadata; each rank is sent only
    its own part)."""
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
        for g in m.get("groups", ()):
            gk = _group_key(g)
            groups.setdefault(gk, []).append((rank, gk, g[2]))
    for _rid, holders in sorted(groups.items(), key=lambda kv: -kv[1][0][2]):
        if len(holders) == 1:
            decide[(holders[0][0], holders[0][1])] = True
            load[holders[0][0]] += holders[0][2]
            continue
        best = min(holders, key=lambda h: (load[h[0]], h[0]))
        for h in holders:
            decide[(h[0], h[1])] = h is best
        load[best[0]] += best[2]
    return decide


def rule_table(tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout]) -> dict[tuple[int, ...], list[Any]]:
    """The tensors whose layout is a position of a :class:`~tierstore.layout.Rule`,
    grouped by position: ``{coords: [[key, rule JSON, dtype], ...]}`` sorted
    by key. Every rank at the same position of the same rules holds the same
    table, so rank 0 is sent a digest of it, and one rank's copy."""
    groups: dict[tuple[int, ...], list[Any]] = {}
    for k in sorted(tensors):
        # A shared flat buffer (ZeRO-1/2) is in one table per position of its members' rules.
        for rule, coords in layouts[k].rule_positions():
            groups.setdefault(coords, []).append([k, rule.to_json(), dtype_name(tensors[k].dtype)])
    return groups


def _digest(entries: list[Any]) -> str:
    """A rule table's digest (BLAKE2b-128 of a canonical text of its entries;
    every rank runs the same code, so equal tables give equal digests)."""
    parts = []
    for key, rj, dtype in entries:
        sp = ";".join(f"{d},{c},{m},{z}" for d, c, m, z in rj["splits"])
        flat = f"{rj['flat']}@{rj.get('flat_at', 0)}/{rj.get('flat_per', 0)}"
        parts.append(f"{key!r}|{rj['tensor']!r}|{rj['shape']}|{sp}|{flat}|{rj['replicated']}|{dtype}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def holdings_meta(
    tensors: Mapping[str, torch.Tensor],
    layouts: Mapping[str, Layout],
    world: int,
    table: dict[tuple[int, ...], list[Any]] | None = None,
) -> dict[str, Any]:
    """What a rank tells rank 0 before writing. Tensors of a rule: per
    position, the digest of their rule table (:func:`rule_table`), their
    bytes and (replicated ones) a fingerprint of their values. Other tensors:
    per tensor, whether it is a replica, of what, its size, and (replicated
    plain tensors) a fingerprint."""
    out: dict[str, Any] = {
        "tensors": {
            k: {
                "replicated": layouts[k].replicated,
                "replica_id": _replica_id(layouts[k]),
                "nbytes": t.numel() * t.element_size(),
                **({"sample": _sample_crc(t)} if world > 1 and layouts[k].replicated else {}),
            }
            for k, t in tensors.items()
            if not layouts[k].rule_positions()
        },
    }
    groups = []
    for coords, entries in (table if table is not None else rule_table(tensors, layouts)).items():
        keys = list(dict.fromkeys(e[0] for e in entries))
        reps = [k for k in keys if layouts[k].replicated]
        sample = (
            zlib.crc32(json.dumps([_sample_crc(tensors[k]) for k in reps]).encode()) if reps and world > 1 else None
        )
        nbytes = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        groups.append([list(coords), _digest(entries), nbytes, sample])
    if groups:
        out["groups"] = groups
    return out


def decide_writers(metas: list[dict[str, Any]] | None, d: Path, save_id: str) -> list[dict[str, Any]]:
    """On rank 0: each rank's decisions: the save id, the tensors it does not
    write because another holder of the replica does (``skip``; ``skip_groups``
    for positions of rules), and the rule tables it describes in full
    (``describe``: one holder per distinct table)."""
    assert metas is not None
    if len(metas) > 1:
        _warn_unreplicated(metas, d)
    writes = _assign_writers(metas)
    describe: dict[str, int] = {}
    for r, m in enumerate(metas):
        for g in m.get("groups", ()):
            describe.setdefault(g[1], r)
    asked: dict[int, list[str]] = {}
    for digest, r in describe.items():
        asked.setdefault(r, []).append(digest)
    out = []
    for r, m in enumerate(metas):
        dec: dict[str, Any] = {
            "save_id": save_id,
            "skip": sorted(k for k in m["tensors"] if not writes[(r, k)]),
        }
        if m.get("groups"):
            dec["skip_groups"] = [[g[0], g[1]] for g in m["groups"] if not writes[(r, _group_key(g))]]
            dec["describe"] = asked.get(r, [])
        out.append(dec)
    return out


def skipped_keys(table: dict[tuple[int, ...], list[Any]], decision: dict[str, Any]) -> set[str]:
    """The keys a rank does not write: those rank 0 gave another holder, and
    those whose every rule table another rank writes (a shared buffer's
    replicated members are one table, its other members another)."""
    skip = set(decision["skip"])
    skipped = {tuple(c) for c, _dg in decision.get("skip_groups", ())}
    written = {e[0] for c, entries in table.items() if c not in skipped for e in entries}
    skip.update(e[0] for c in skipped for e in table[c] if e[0] not in written)
    return skip


def _group_key(g: list[Any]) -> str:
    """A rule position's replica id: the digest of its table and the position."""
    return f"\0rule:{g[1]}:{','.join(map(str, g[0]))}"


def tensor_file_info(fname: str, written: api.Written, layouts: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """What a rank tells rank 0 about the tensor file it wrote (``layouts``:
    each tensor's layout in JSON form, :meth:`Layout.to_json`)."""
    out: dict[str, Any] = {"tensors": {}}
    recs = {r["name"]: r for r in written.records}
    for t in written.tensors:
        if len(t["path"]) != 2 or t["path"][0] != "tensors":
            continue
        key = t["path"][1]
        if layouts[key].get("rule") is not None or layouts[key].get("rules"):
            continue  # a position of a rule: the file's own manifest says where it is
        rec = recs[t["record"]]
        item = torch.empty((), dtype=dtype_of(t["dtype"])).element_size()
        out["tensors"][key] = {
            "offset": rec["offset"] + t["storage_offset"] * item,
            "dtype": t["dtype"],
            "shape": t["shape"],
            "record": t["record"],
            "record_offset": rec["offset"],
            "record_size": rec["size"],
            "crc32": rec["crc32"],
            "layout": layouts[key],
        }
    out["file"] = fname
    out["bytes"] = written.file_len
    out["manifest_crc32"] = written.manifest_crc32
    return out


@_gc.paused
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
    write_sharded(state_dict, path, process_group, durable=durable, background=background)


def write_sharded(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    process_group: Any,
    *,
    durable: bool,
    background: bool,
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
    for leaf in flatten(state_dict, f"save_sharded({d})"):
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
    # Rank 0 learns what every rank holds and decides who writes each
    # replicated tensor; each rank is sent only its own decisions (no rank's
    # metadata goes to every rank).
    table = rule_table(tensors, layouts)
    my_meta = holdings_meta(tensors, layouts, world, table)
    metas = _gather(my_meta, world, pg)
    decisions = decide_writers(metas, d, save_id) if rank == 0 else None
    decision = _scatter(decisions, world, pg)
    save_id = decision["save_id"]
    skip = skipped_keys(table, decision)
    mine = {k: t for k, t in tensors.items() if k not in skip}
    file_info: dict[str, Any] = {"rank": rank, "tensors": {}, "objects_file": None, "paths": paths}
    if decision.get("describe"):
        by_digest = {g[1]: table[tuple(g[0])] for g in my_meta.get("groups", ())}
        file_info["rules"] = {dg: by_digest[dg] for dg in decision["describe"]}
    fname = f"rank-{rank:05d}.{save_id}.pt"

    keep_objects = dict(per_rank)
    if rank == 0:
        keep_objects.update(objects)
    # Both files of this rank are written the same way.
    write = functools.partial(api.write_file, durable=durable, background=background, gates=gates)
    # The objects file (e.g. optimizer state) is written while the tensor file is.
    objects_job = None
    if keep_objects:
        oname = f"objects-{rank:05d}.{save_id}.pt"
        pool = ThreadPoolExecutor(1, thread_name_prefix="tierstore-objects")
        # Each file also records the key paths of the keys it holds (the
        # second witness of manifest.json's "paths").
        okp = {"key_paths": {k: paths[k] for k in keep_objects if k in paths}}
        objects_job = pool.submit(write, {"objects": keep_objects}, d / oname, extra=okp)
        pool.shutdown(wait=False)
    try:
        if mine:
            contiguous = {k: (t if t.is_contiguous() else t.contiguous()) for k, t in mine.items()}
            lay_json = {k: layouts[k].to_json() for k in contiguous}
            written = write(
                {"tensors": contiguous},
                d / fname,
                chunk_checksums=True,
                layouts={("tensors", k): v for k, v in lay_json.items()},
                extra={"key_paths": {k: paths[k] for k in contiguous if k in paths}},
            )
            file_info.update(tensor_file_info(fname, written, lay_json))
    finally:
        objects_written = objects_job.result() if objects_job is not None else None  # its error, if any
    if keep_objects:
        file_info["objects_file"] = oname
        file_info["object_keys"] = sorted(keep_objects)
        file_info["per_rank_keys"] = sorted(per_rank)
        assert objects_written is not None
        file_info["objects_bytes"] = objects_written.file_len
        file_info["objects_manifest_crc32"] = objects_written.manifest_crc32
    # The commit: one gather of what each rank wrote, rank 0 checks and
    # writes manifest.json (an atomic rename), and tells every rank how it went.
    infos = _gather(file_info, world, pg)
    failed: BaseException | None = None
    outcome: tuple[str, str] | None = None
    if rank == 0:
        assert infos is not None
        try:
            m = build_manifest(d, save_id, world, infos, metas, decisions)
            m["attachments"] = {}
            for name in attachments:
                data = (d / name).read_bytes()
                m["attachments"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
            write_manifest(d, m, durable)
            _collect_garbage(d, save_id)
        except (OSError, TierstoreError) as e:
            failed = e
            outcome = (type(e).__name__, str(e))
    outcome = _broadcast(outcome, world, pg)
    if failed is not None:
        raise failed
    if outcome is not None:
        raise _error_named(outcome[0])(f"save_sharded({d}): rank 0 could not commit the checkpoint: {outcome[1]}")


def _error_named(name: str) -> type[TierstoreError]:
    """The TierstoreError subclass called ``name`` (rank 0's error, raised on
    the other ranks too)."""
    from tierstore import errors

    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, TierstoreError) else TierstoreError


def _collect_garbage(d: Path, save_id: str) -> None:
    for f in d.iterdir():
        n = f.name
        data = n.startswith(("rank-", "objects-")) and n.endswith(".pt") and f".{save_id}." not in n
        index = n.startswith("index.") and n.endswith(".bin") and n != index_name(save_id)
        if data or index:
            f.unlink(missing_ok=True)
