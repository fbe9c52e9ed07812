"""A sharded checkpoint as one flat dict of full tensors
(:func:`consolidate`, ``tierstore consolidate``): sizes checked against what
the files hold and the memory there is before anything is allocated, tied
weights allocated once, then read by :func:`tierstore.load_sharded`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierstore import _dist, _limits, _paths, _tier_codec
from tierstore._sharded_read import load_sharded
from tierstore.errors import NotFoundError
from tierstore.reshard import CoverageError
from tierstore.shardmeta import MANIFEST, Checkpoint, closing_scope, dtype_of


def consolidate(
    path: str | os.PathLike[str],
    *,
    weights_only: bool = True,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None = None,
    checkpoint: Checkpoint | None = None,
) -> dict[str, Any]:
    """The whole checkpoint as one flat dict ``{global name: full tensor}``,
    plus its replicated objects (for inference or upload), plus its per-rank
    objects where a value can be chosen: this rank's when the saving world
    had this rank and size, else by ``per_rank_policy`` (as for
    :func:`load_sharded`); without one they are left out."""
    with closing_scope():
        return _consolidate(path, weights_only=weights_only, per_rank_policy=per_rank_policy, checkpoint=checkpoint)


def _consolidate(
    path: str | os.PathLike[str],
    *,
    weights_only: bool,
    per_rank_policy: str | Callable[[dict[int, Any]], Any] | None,
    checkpoint: Checkpoint | None,
) -> dict[str, Any]:
    from tierstore import dcp

    if not (Path(path) / MANIFEST).exists() and dcp.is_dcp(path):
        return dcp.to_state_dict(path, weights_only, nested=True)
    ck = checkpoint if checkpoint is not None else Checkpoint(path)
    m = ck.manifest
    _check_consolidated_size(Path(path), m, ck)
    ck.check_all_files()  # the global shapes it allocates, against what each file holds
    # Tensors saved as the same bytes (tied weights) come back as one tensor,
    # as torch.load gives one storage for them.
    shared = shared_tensors(ck)
    sd: dict[str, Any] = {}
    for name, g in m["tensors"].items():
        sd[name] = sd[shared[name]] if name in shared else torch.empty(g["shape"], dtype=dtype_of(g["dtype"]))
    for key in m["objects"]:
        sd[key] = None
    rank, world, _pg = _dist.group_info(None)
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
    load_sharded(ck, sd, weights_only=weights_only, per_rank_policy=per_rank_policy)
    flat_sd.update(sd)
    return flat_sd


def shared_tensors(ck: Checkpoint) -> dict[str, str]:
    """Each global tensor whose saved bytes are exactly those of an earlier
    one (:meth:`Checkpoint.saved_view`), mapped to that one."""
    # Only tensors alike in shape, dtype and split can share bytes: the full
    # view (every piece) is built for those alone, so a checkpoint without
    # tied weights costs one pass over its global entries.
    alike: dict[tuple[Any, ...], list[str]] = {}
    for name, g in ck.manifest["tensors"].items():
        how = (
            json.dumps({k: v for k, v in g["rule"].items() if k != "tensor"}, sort_keys=True)
            if "rule" in g
            else len(g["pieces"])
        )
        alike.setdefault((json.dumps(g["shape"]), g["dtype"], how), []).append(name)
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name in (n for names in alike.values() if len(names) > 1 for n in names):
        view = ck.saved_view(name)
        if view is None:
            continue
        f = first.setdefault(view, name)
        if f != name:
            out[name] = f
    return out


def _check_consolidated_size(d: Path, m: dict[str, Any], ck: Checkpoint | None = None) -> None:
    """Refuses to allocate the full tensors of a manifest before their sizes
    are checked against what its pieces and files hold, and against the
    memory there is. Tensors saved as the same bytes (tied weights) are
    allocated once (:func:`shared_tensors`), so they count once; that is
    asked of the files' own manifests only when the sum of all exceeds
    what the files hold."""
    where = str(d / MANIFEST)
    total = 0
    sizes: dict[str, int] = {}
    for name, g in m["tensors"].items():
        numel = math.prod(g["shape"])
        # A rule's positions tile the tensor (proven when the manifest was read).
        held = numel if "rule" in g else sum(math.prod(p[1][1]) for p in g["pieces"])
        if held != numel:
            raise CoverageError(
                f"{where}: global tensor {name!r} of shape {tuple(g['shape'])} has {numel} elements but its pieces "
                f"hold {held}; the manifest is damaged"
            )
        sizes[name] = numel * torch.empty((), dtype=dtype_of(g["dtype"])).element_size()
        total += sizes[name]
    on_disk = 0
    copies = ck.copies if ck is not None else [d]
    for i, fe in enumerate(m["files"]):
        for c in copies:
            p = _paths.member(c, fe["name"], source=where, field=f"files[{i}].name")
            try:
                on_disk += p.stat().st_size
                break
            except FileNotFoundError:
                enc = _tier_codec.encoded_of(p.parent, p.name)
                if enc is not None:  # a codec tier's copy: the size its header declares (checked on decode)
                    on_disk += _tier_codec.read_header(enc)[0]["bytes"]
                    break
                continue
        else:
            p = d / fe["name"]
            raise NotFoundError(f"{p}: shard file of the checkpoint is missing (files[{i}])", path=str(p))
    if total > on_disk and ck is not None:
        total -= sum(sizes[n] for n in shared_tensors(ck))
    if total > on_disk:
        raise CoverageError(
            f"{where}: the global tensors add up to {total} bytes but the shard files hold only {on_disk}; "
            "the manifest is damaged"
        )
    _limits.check_allocation(total, f"the {len(m['tensors'])} full tensors of {d}", str(d))
