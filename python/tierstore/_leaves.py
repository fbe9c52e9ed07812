"""The leaves of a sharded state dict: values that differ per rank
(:class:`PerRank`), and tensors with their layout (attached, from DTensor
placements, or whole and replicated), found under DCP's flattening rules
(:mod:`tierstore._tree`). The save and the load side both read state dicts
through these."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from tierstore import _tree
from tierstore.errors import LayoutError
from tierstore.layout import Layout, Rule, Split, layout_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass
class PerRank:
    """A non-tensor value that differs per rank (RNG state, data-loader
    position): each rank saves its own, and a load gets its rank's value."""

    value: Any


def flatten(sd: Mapping[str, Any], where: str = "state dict", dcp: bool = False) -> Iterator[_tree.Leaf]:
    """Every leaf of ``sd`` under DCP's flattening rules (see :mod:`tierstore._tree`)."""
    try:
        yield from _tree.flatten(sd, dcp=dcp, where=where)
    except ValueError as e:
        raise LayoutError(str(e)) from None


def dtensor_layout(key: str, t: Any) -> tuple[torch.Tensor, Layout]:
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
    rule_lay = _dtensor_rule(key, t, gshape, replicated)
    # The rule (stored once for every rank) is used where it gives exactly the
    # block torch computes; anything else is stored as this rank's box.
    if rule_lay is not None and rule_lay.local_shape == tuple(shape):
        if not rule_lay.pieces and math.prod(shape) == 0:
            return local, rule_lay
        if rule_lay.pieces and rule_lay.pieces[0].box.offsets == tuple(offset):
            return local, rule_lay
    lay = Layout.block(key, gshape, tuple(offset), tuple(shape), replicated=replicated)
    if math.prod(shape) == 0:
        lay = Layout(tuple(shape), (), {key: gshape}, replicated)
    return local, lay


def _dtensor_rule(key: str, t: Any, gshape: tuple[int, ...], replicated: bool) -> Layout | None:
    """The layout of ``t`` as a position of a :class:`Rule` (its ``Shard``
    placements as chunked splits in mesh order), or None."""
    from torch.distributed.tensor import Shard

    coord = t.device_mesh.get_coordinate()
    if coord is None or type(t).__name__ != "DTensor":
        return None
    splits, coords = [], []
    for i, p in enumerate(t.placements):
        if isinstance(p, Shard):
            if type(p) is not Shard:  # _StridedShard and other orders: stored as boxes
                return None
            splits.append(Split(p.dim % max(len(gshape), 1), t.device_mesh.size(i), "chunk"))
            coords.append(coord[i])
    rule = Rule(key, gshape, tuple(splits), 0, replicated)
    try:
        rule.validate(key)
        return rule.layout_at(coords)
    except LayoutError:
        return None


def is_dtensor(v: Any) -> TypeGuard[DTensor]:
    """Whether ``v`` is a DTensor (False where torch has no distributed
    tensors). No DTensor exists until ``torch.distributed.tensor`` has been
    imported, so this never imports it (that import costs about a second)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dt = getattr(mod, "DTensor", None) if mod is not None else None
    return dt is not None and isinstance(v, dt)


def tensor_and_layout(key: str, v: torch.Tensor, world: int) -> tuple[torch.Tensor, Layout]:
    """The local tensor of ``v`` and its layout: attached, from DTensor placements, or whole (replicated)."""
    if is_dtensor(v):
        return dtensor_layout(key, v)
    lay = layout_of(v)
    if lay is None:
        lay = Layout.full(key, tuple(v.shape), replicated=world > 1)
    return v, lay
