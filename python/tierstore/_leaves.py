"""The leaves of a sharded state dict: values that differ per rank
(:class:`PerRank`), and tensors with their layout (attached, from DTensor
placements, or whole and replicated), found under DCP's flattening rules
(:mod:`tierstore._tree`). The save and the load side both read state dicts
through these."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from tierstore import _tree
from tierstore.errors import LayoutError
from tierstore.layout import Layout, layout_of

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
        return dtensor_layout(key, v)
    lay = layout_of(v)
    if lay is None:
        lay = Layout.full(key, tuple(v.shape), replicated=world > 1)
    return v, lay
