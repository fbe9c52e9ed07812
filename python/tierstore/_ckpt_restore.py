"""Restoring Checkpointer checkpoints: finding the step directories of a
tier, reading and checking a step's ``checkpoint.json`` (the key tree), and
loading one copy, from host memory or disk, as the saved nested state or into
a target (offloaded optimizers get their subgroups back as they are)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from tierstore import _metadata, _paths, _tree
from tierstore._ckpt_snapshot import Snapshot
from tierstore._consolidate import consolidate
from tierstore._dist import all_true, broadcast, gather
from tierstore._offload_entry import OFFLOAD_KEY, is_offload_parts, offload_meta, restore_state_dict
from tierstore._sharded_read import load_sharded, needed_files
from tierstore._tier_codec import DECODE_ROOT
from tierstore.errors import LayoutError, ManifestError, TierstoreError
from tierstore.sharded import PerRank
from tierstore.shardmeta import MANIFEST, Checkpoint, closing_scope, read_attachment, read_manifest
from tierstore.tiers import DiskTier

STEP_DIR = re.compile(r"^step-(\d{12})$")
META = "checkpoint.json"


def checkpoints_itself(obj: Any) -> bool:
    """Whether ``obj`` takes part in checkpoints through the protocol an
    ``OffloadedOptimizer`` implements: ``checkpoint_parts(prefix, tag,
    file_prefix) -> (parts, pins)`` (its entry, see
    :mod:`tierstore._offload_entry`, and files to copy) and
    ``restore_from_checkpoint(meta, tensors, directory)``. The Checkpointer
    needs no import of the optimizer's module."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping))
        and callable(getattr(obj, "checkpoint_parts", None))
        and callable(getattr(obj, "restore_from_checkpoint", None))
    )


def flat_tree(sd: Mapping[str, Any]) -> list[tuple[str, list[Any]]]:
    """(flat key, key path) per leaf, with the flattening rules of save_sharded."""
    try:
        return [(leaf.key, list(leaf.path)) for leaf in _tree.flatten(sd, where="Checkpointer.save")]
    except ValueError as e:  # two values with one key
        raise LayoutError(str(e)) from None


def unflatten(flat: Mapping[str, Any], tree: list[list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    placed = set()
    for key, path in tree:
        if key not in flat:
            continue
        _tree.set_path(out, path, flat[key])
        placed.add(key)
    for key, v in flat.items():  # global tensors saved under layouts of other names
        if key not in placed:
            out[key] = v
    return out


def load_copy(c: dict[str, Any], into: Any, weights_only: bool, per_rank_policy: Any) -> Any:
    """Loads one candidate copy (an entry of ``Checkpointer.checkpoints()``):
    a snapshot still in host memory, or a step directory, into ``into`` or as
    the saved nested state."""
    snap: Snapshot | None = c.get("_snap")
    if c.get("missing"):
        raise TierstoreError(f"this rank sees no copy of step {c['step']} (not on its node, not on a farther tier)")
    if c["path"] is None:
        if snap is None or not snap.in_host:
            raise TierstoreError("the host copy was dropped")
        if into is not None:
            raise TierstoreError("host copies restore only without `into`")
        return clone_tree(snap.state)
    d = Path(c["path"])
    tree = read_meta(d, c["step"])
    alternates = [Path(a) for a in c.get("alternates", ())]
    excluded: set[tuple[str, str]] = set()
    while True:
        # Each file from the nearest copy that holds it intact; a file whose
        # data fails its checksums there is taken from the next copy.
        ck = Checkpoint(d, alternates)
        ck.excluded |= excluded
        try:
            if into is not None:
                out = load_into(d, into, weights_only, per_rank_policy, ck)
            else:
                flat = consolidate(d, weights_only=weights_only, per_rank_policy=per_rank_policy, checkpoint=ck)
                out = _offload_state_dicts(flat if tree is None else unflatten(flat, tree), d)
        except TierstoreError as e:
            bad = _damaged_copy(e, ck)
            if bad is None or bad in excluded or not alternates:
                raise
            tier = c.get("copy_tiers", {}).get(bad[0], c["tier"])
            warnings.warn(f"tierstore: checkpoint of step {c['step']} on tier {tier!r} ({bad[0]}): {bad[1]} cannot "
                          f"be used ({e}); reading it from the next copy", stacklevel=3)  # fmt: skip
            excluded.add(bad)
            continue
        c["bytes_by_copy"] = dict(ck.bytes_by_copy)
        return out


def _damaged_copy(e: TierstoreError, ck: Checkpoint) -> tuple[str, str] | None:
    """The (copy, file name) an error names, when it is one of the
    checkpoint's copies' data or objects files."""
    p = getattr(e, "path", None)
    if not p:
        return None
    p = Path(p)
    for c in ck.copies:
        if p.parent == c and p.name != MANIFEST:
            return str(c), p.name
    return None


def load_into(d: Path, into: Any, weights_only: bool, per_rank_policy: Any, ck: Checkpoint | None = None) -> Any:
    """``load_sharded`` into ``into``, where offloaded optimizers get their
    saved subgroups back as they are (no per-parameter work); ``ck`` the
    checkpoint opened with its other copies."""
    if ck is None:
        ck = Checkpoint(d)
    found: list[tuple[MutableMapping[str, Any], str, Any, str]] = []

    def walk(obj: Any, prefix: str) -> Any:
        if isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor):
            out = dict(obj)
            for k, v in obj.items():
                if checkpoints_itself(v):
                    out[k] = {OFFLOAD_KEY: None}
                    found.append((out, k, v, _tree.child(prefix, k)))
                else:
                    out[k] = walk(v, _tree.child(prefix, k))
            return out
        return obj

    template = walk(into, "") if isinstance(into, Mapping) else into
    opts: dict[str, Any] = {"process_group": None, "per_rank_policy": per_rank_policy, "weights_only": weights_only}
    if not found:
        return load_sharded(ck, into, **opts)
    # The offload entries' metadata first (small), then every tensor in one load.
    probe = _only_offload_meta(template)
    load_sharded(ck, probe, **opts)
    metas = [offload_meta(m[OFFLOAD_KEY], str(d)) for m in _offload_entries(probe)]
    for (parent, k, _opt, key), meta in zip(found, metas, strict=True):
        entry: dict[str, Any] = {OFFLOAD_KEY: None}
        for e in meta["subgroups"]:
            if "tensor" in e:
                entry[e["tensor"]] = torch.empty(_saved_bytes(ck, _tree.child(key, e["tensor"]), e), dtype=torch.uint8)
        parent[k] = entry
    load_sharded(ck, template, **opts)
    for (parent, k, opt, _key), meta in zip(found, metas, strict=True):
        tensors = {n: t for n, t in parent[k].items() if isinstance(t, torch.Tensor)}
        opt.restore_from_checkpoint(meta, tensors, d)
    _copy_back(into, template)
    return into


def step_dirs(p: Path, tier: str) -> list[Path]:
    """The step directories of tier path ``p``: real directories inside it.
    A symlink (to another job's run, or to another step) is never taken for
    a checkpoint of this tier; it is reported once and skipped."""
    out: list[Path] = []
    try:
        entries = list(p.iterdir()) if p.is_dir() else []
    except OSError:
        return out
    for d in entries:
        if not STEP_DIR.match(d.name):
            continue
        try:
            st = d.lstat()
        except FileNotFoundError:
            continue  # removed since the listing (retention on another thread): not a stray entry
        if not stat.S_ISDIR(st.st_mode) or not _paths.inside(p, d):
            warn_once(f"tierstore: {d} on tier {tier!r} is not a step directory of this tier (a symlink or not a "
                       "directory); it is skipped")  # fmt: skip
            continue
        out.append(d)
    return out


WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in WARNED:
        WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def read_meta(d: Path, step: int) -> list[list[Any]] | None:
    """The key tree of step directory ``d``'s ``checkpoint.json``, checked:
    against the size and CRC-32 its manifest recorded (checkpoints written
    since the manifest records it: then a missing file is damage), its own
    checksum, its step, and the shape of every tree entry."""
    m = read_manifest(d)
    where = str(d / META)
    data = read_attachment(d, m, META)
    if data is None:
        if m.get("format_version", 1) >= 2 and "attachments" in m:
            return None  # written by save_sharded directly: no key tree
        if not (d / META).exists():
            return None  # an older checkpoint without one
        data = _paths.read_regular(_paths.member(d, META, source=str(d), field=META), 1 << 30, META)
    meta, _had = _metadata.loads(data, where, required=False)
    f = _metadata.Fields(where)
    if f.uint(f.get(meta, "step", "step"), "step") != step:
        f.fail("step", f"{step} (the step of its directory)", meta["step"])
    f.uint(f.get(meta, "world_size", "world_size"), "world_size", most=1 << 24)
    tree = f.array(f.get(meta, "tree", "tree"), "tree")
    for i, entry in enumerate(tree):
        fld = f"tree[{i}]"
        f.array(entry, fld, length=2)
        key = f.string(entry[0], f"{fld}[0]", most=1 << 16)
        if _tree.check_path(f.array(entry[1], f"{fld}[1]"), key) is None:
            f.fail(f"{fld}[1]", f"the key path of {key!r} (its parts joined by '.' give the key)", entry[1])
    return tree


def _saved_bytes(ck: Checkpoint, name: str, e: dict[str, Any]) -> int:
    """The size of resident subgroup ``e``'s tensor ``name`` as the
    checkpoint holds it (a flat uint8 tensor whose pieces are proven to tile
    it), which must be the size its entry states: the buffer it is loaded
    into is never sized by the entry alone."""
    idx = ck.lookup(name)
    if idx is None or ck.dtype_of(name) != torch.uint8 or tuple(idx.shape) != (e["nbytes"],):
        raise ManifestError(
            f"{ck.dir}: offloaded optimizer subgroup {e['index']}: the checkpoint holds no tensor {name!r} of "
            f"{e['nbytes']} bytes (the entry's size)",
            path=str(ck.dir),
            record=name,
        )
    ck.check_tensor(name)
    return int(e["nbytes"])


def _only_offload_meta(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a load template that holds offload metadata entries."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and OFFLOAD_KEY in v:
            out[k] = {OFFLOAD_KEY: None}
        elif isinstance(v, Mapping):
            sub = _only_offload_meta(v)
            if sub:
                out[k] = sub
    return out


def _offload_entries(tree: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for v in tree.values():
        if isinstance(v, Mapping) and OFFLOAD_KEY in v:
            yield v
        elif isinstance(v, Mapping):
            yield from _offload_entries(v)


def _copy_back(into: Any, template: Any) -> None:
    """Puts what ``load_sharded`` filled into a template back into ``into``
    (offloaded optimizers stay in place: they restored themselves)."""
    if not isinstance(into, MutableMapping):
        return
    for k, v in into.items():
        t = template.get(k)
        if checkpoints_itself(v):
            continue
        if isinstance(v, Mapping) and not isinstance(v, torch.Tensor):
            _copy_back(v, t)
        elif not isinstance(v, torch.Tensor):
            into[k] = t  # non-tensor values are replaced by the saved ones


def _offload_state_dicts(obj: Any, d: Path) -> Any:
    """Turns offloaded optimizers' checkpoint entries into the wrapped
    optimizer's ordinary state dict."""
    if is_offload_parts(obj):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        return restore_state_dict(offload_meta(obj[OFFLOAD_KEY], str(d)), tensors, d)
    if isinstance(obj, dict):
        return {k: _offload_state_dicts(v, d) for k, v in obj.items()}
    return obj


def clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, PerRank):
        return clone_tree(obj.value)
    if isinstance(obj, Mapping):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = clone_tree(v)  # type: ignore[index]
        return out
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def list_checkpoints(
    snaps: list[Snapshot], host_name: str, tiers: list[tuple[str, list[Path]]]
) -> list[dict[str, Any]]:
    """Complete checkpoints: ``[{"step", "tier", "path"}]``, newest first,
    nearest tier first: the snapshots complete in host memory (``path``
    None, ``"_snap"`` the snapshot), then each disk tier's committed step
    directories (``tiers``: name and directories, nearest first)."""
    out: list[dict[str, Any]] = []
    for s in snaps:
        if (
            s.in_host
            and not s.has_offload
            and s.captured.is_set()
            and s.error is None
            and s.handle.tiers.get("host") == "captured"
        ):
            out.append({"step": s.step, "tier": host_name, "path": None, "rank": 0, "_snap": s})
    for ti, (name, paths) in enumerate(tiers):
        for p in paths:
            for d in step_dirs(p, name):
                m = STEP_DIR.match(d.name)
                mp = d / MANIFEST
                if m and mp.is_file():
                    out.append({"step": int(m.group(1)), "tier": name, "path": str(d), "rank": ti + 1})
                elif m and (mp.exists() or mp.is_symlink()):
                    warn_once(
                        f"tierstore: {mp} on tier {name!r} is not a regular file; step {int(m.group(1))} is skipped"
                    )
    out.sort(key=lambda c: (-c["step"], c["rank"]))
    for c in out:
        c.pop("rank")
    return out


def load_first_usable(
    cands: list[dict[str, Any]],
    into: Any,
    weights_only: bool,
    per_rank_policy: Any,
    world: int,
    pg: Any,
    resolve: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any] | None]:
    """Loads the first candidate every rank can read (a damaged copy is
    reported with a warning and the next one tried); returns the state and
    which copy it was, or ``(None, None)``. With ``into``, no usable copy
    among some that exist raises: a copy that failed may have written part
    of its bytes into ``into`` before its damage was found, which must never
    pass for "no checkpoint" (the caller would train on from those tensors)."""
    failures: list[str] = []
    for c in cands:
        if resolve is not None:
            c = resolve(c)  # this rank's copies of the candidate (a collective repair first, where one is due)
        err: BaseException | None = None
        result: Any = None
        try:
            with closing_scope():  # a codec tier's decoded files last as long as this attempt
                result = load_copy(c, into, weights_only, per_rank_policy)
        except Exception as e:  # any damage to this copy: the next one is tried
            err = e
        if all_true(err is None, world, pg):
            used = {"step": c["step"], "tier": c["tier"], "path": c["path"]}
            if "bytes_by_copy" in c:
                used["bytes_by_copy"] = c["bytes_by_copy"]
            return result, used
        where = c["path"] or "host memory"
        why = err if err is not None else "another rank could not read it"
        warnings.warn(
            f"tierstore: checkpoint of step {c['step']} on tier {c['tier']!r} ({where}) cannot be used: "
            f"{why}; trying the next copy",
            stacklevel=3,
        )
        failures.append(f"step {c['step']} on tier {c['tier']!r}: {why}")
    if into is not None and failures:
        raise TierstoreError(
            f"no usable checkpoint among {len(failures)} copies; the tensors of `into` may have been partly "
            "overwritten by a copy that then failed its checks: " + "; ".join(failures)
        )
    return None, None


class Restorer:
    """A Checkpointer's way back: the newest checkpoint every rank can read.

    The ranks agree on the candidates (each step and tier some rank sees
    complete, newest first, nearest tier first); before a step is tried, a
    node that lost its copy gets its ranks' files back from peers' replicas
    or fetches what it needs, and each rank then reads each file from the
    nearest intact copy it sees. Collectives run on ``pg``, the same ones
    on every rank in the same order."""

    def __init__(
        self,
        *,
        cascade: Any,  # the Checkpointer's Cascade (which imports this module)
        disks: list[DiskTier],
        has_shm_tier: bool,
        tier_names: list[str],
        rank: int,
        world: int,
        pg: Any,
        node_count: int,
        has_ring: bool,
        checkpoints: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.cascade, self.disks, self.has_shm_tier, self.tier_names = cascade, disks, has_shm_tier, tier_names
        self.rank, self.world, self.pg = rank, world, pg
        self.node_count, self.has_ring = node_count, has_ring
        self.checkpoints = checkpoints

    def load(self, into: Any, weights_only: bool, per_rank_policy: Any) -> tuple[Any, dict[str, Any] | None]:
        """The state of the newest usable checkpoint (``into`` filled, or
        the saved state) and which copy it came from (see
        :func:`load_first_usable`); ``(None, None)`` where there is none."""
        cands = self.checkpoints()
        mine = [c for c in cands if c["path"] is not None]
        peer_bytes = 0
        if self.world > 1:
            # Every rank must take the same step: agree on the candidates any
            # rank sees (a node that lost its copy sees fewer than its peers).
            cands = self._agreed_candidates(mine)
        repaired: dict[int, int] = {}

        def resolve(c: dict[str, Any]) -> dict[str, Any]:
            # Before a step is tried: a node that lost its copy of it gets its
            # ranks' files back from the peers that keep their replicas; then
            # each rank reads each file from the nearest intact copy it sees
            # of the step (its node's copy of a node-scoped tier, then the
            # farther tiers'), not only from the candidate's own directory.
            nonlocal mine
            step = c["step"]
            if self.world > 1 and step not in repaired:
                got = self._repair(step, cands)
                if got:
                    mine = [x for x in self.checkpoints() if x["path"] is not None]
                fetched, stale = self._fetch(step, cands, into, mine)
                repaired[step] = got + fetched
                if repaired[step]:
                    mine = [x for x in self.checkpoints() if x["path"] is not None]
                if stale is not None:  # this node's copy is another save of the step: not read
                    mine = [x for x in mine if not (x["step"] == step and x["tier"] == stale)]
            return self._with_copies(c, mine)

        restored: dict[str, Any] | None = None
        # Encoded copies (a codec tier's) are decoded under the first disk tier, not the system's temporary folder.
        decode_root = self.cascade.tier_paths(self.disks[1 if self.has_shm_tier else 0])[0]
        token = None
        if os.environ.get("TIERSTORE_DECODE_DIR") is None:
            with contextlib.suppress(OSError):
                decode_root.mkdir(parents=True, exist_ok=True)
                token = DECODE_ROOT.set(decode_root)
        try:
            result, restored = load_first_usable(
                cands, into, weights_only, per_rank_policy, self.world, self.pg, resolve
            )
            peer_bytes = sum(repaired.values())
        finally:
            if token is not None:
                DECODE_ROOT.reset(token)
        if restored is not None and "bytes_by_copy" in restored:
            dirs = {
                str(d): t.name for t in self.disks for p in self.cascade.tier_paths(t) for d in step_dirs(p, t.name)
            }
            by_tier: dict[str, int] = {}
            by_copy = restored.pop("bytes_by_copy")
            for d, n in by_copy.items():
                name = dirs.get(d, d)
                by_tier[name] = by_tier.get(name, 0) + n
            restored["bytes_by_tier"] = by_tier
            restored["bytes_from_peers"] = peer_bytes
            if by_copy and by_tier.get(restored["tier"], 0) == 0:
                # Nothing came from the candidate's copy: name the copy it all came from.
                d = max(by_copy, key=lambda k: by_copy[k])
                restored.update(tier=dirs.get(d, restored["tier"]), path=d)
        return result, restored

    def _agreed_candidates(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The candidates every rank tries, in the same order: each (step,
        tier) that some rank sees complete, newest first, nearest tier first
        (rank 0's list broadcast; where some rank sees a copy rank 0 does
        not, one gather of the small lists to rank 0 and a broadcast)."""
        own = [(c["step"], c["tier"], c["path"]) for c in mine]
        zeros: list[tuple[int, str, str]] = broadcast(own if self.rank == 0 else None, self.world, self.pg)
        known = {(s, t) for s, t, _p in zeros}
        if all_true(all((s, t) in known for s, t, _p in own), self.world, self.pg):
            return [{"step": s, "tier": t, "path": p} for s, t, p in zeros]
        seen = gather(own, self.world, self.pg)
        merged: list[dict[str, Any]] | None = None
        if seen is not None:
            order = {name: i for i, name in enumerate(self.tier_names)}
            first: dict[tuple[int, str], str] = {}
            for lst in seen:
                for step, tier, path in lst:
                    first.setdefault((int(step), str(tier)), str(path))
            keys = sorted(first, key=lambda k: (-k[0], order.get(k[1], len(order))))
            merged = [{"step": k[0], "tier": k[1], "path": first[k]} for k in keys]
        got: list[dict[str, Any]] = broadcast(merged, self.world, self.pg)
        return got

    def _fetch(
        self, step: int, cands: list[dict[str, Any]], into: Any, mine: list[dict[str, Any]]
    ) -> tuple[int, str | None]:
        """The files of ``step`` this node's ranks need for ``into`` (all of
        them without ``into``) and its copy on the nearest node-scoped tier
        holding the step lacks, fetched from the nodes that hold them (a
        collective). Returns the bytes this rank received, and the tier's
        name where this node's copy holds another save of the step (stale
        or foreign: not to be read), else None."""
        if self.node_count < 2:
            return 0, None
        held = {c["tier"] for c in cands if c["step"] == step}
        t = next((t for t in self.disks if t.scope == "node" and t.name in held), None)
        if t is None:
            return 0, None

        def needed(d: Path) -> set[str] | None:
            if into is None:
                return None
            try:
                return needed_files(Checkpoint(d), into, self.rank, self.world)
            except (OSError, TierstoreError):
                return None

        other = any(m["step"] == step and m["tier"] != t.name for m in mine)
        got, usable = self.cascade.peers.fetch(t, step, needed, other, self.pg)
        return got, None if usable else t.name

    def _repair(self, step: int, cands: list[dict[str, Any]]) -> int:
        """Peer repair of ``step`` on the nearest node-scoped tier with
        replicas that holds it (a collective: every rank calls it for the
        same steps). Returns the bytes this rank received."""
        held = {c["tier"] for c in cands if c["step"] == step}
        if not self.has_ring:
            return 0
        for t in self.disks:
            if t.scope == "node" and t.replicas and t.name in held:
                got: int = self.cascade.peers.repair(t, step, self.pg)
                return got
        return 0

    def _with_copies(self, c: dict[str, Any], mine: list[dict[str, Any]]) -> dict[str, Any]:
        """Candidate ``c`` (rank 0's view) as this rank reads it: its own copy
        of that step on that tier first, then its other copies of the step,
        nearest tier first."""
        if c["path"] is None:
            return c
        same = [m["path"] for m in mine if m["step"] == c["step"]]
        own = next((m["path"] for m in mine if m["step"] == c["step"] and m["tier"] == c["tier"]), None)
        order = ([own] if own is not None else []) + [p for p in same if p != own]
        if not order:
            # This rank sees no copy: the load fails here and the ranks move on together.
            return {**c, "path": None, "missing": True}
        tiers = {m["path"]: m["tier"] for m in mine if m["step"] == c["step"]}
        return {**c, "path": order[0], "alternates": order[1:], "copy_tiers": tiers}
