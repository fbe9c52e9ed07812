"""The small TP x DP model the layout tests save and load (test_rules,
test_zero_groups, test_scale_sections): each tensor's value, its TP layout,
a rank's local tensor under any layout, and the ZeRO-3 layouts of a rank.
Functions of this module run in spawned ranks too, so they take the shapes
as an argument instead of reading a test module's globals."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch

from tierstore.layout import Layout, tp_column, tp_row, tp_vocab, zero_partition

Shapes = Mapping[str, tuple[int, ...]]
SHAPES: Shapes = {"emb": (50, 8), "col": (12, 8), "row": (8, 12), "norm": (8,)}


def value(name: str, shapes: Shapes = SHAPES) -> torch.Tensor:
    """The whole tensor ``name``: distinct values, offset per tensor."""
    n = math.prod(shapes[name])
    return (torch.arange(n, dtype=torch.float32) + 1000 * list(shapes).index(name)).reshape(shapes[name])


def param(name: str, tp_r: int, tp: int, shapes: Shapes = SHAPES) -> Layout:
    """TP rank ``tp_r``'s layout of ``name``: vocabulary-padded rows (emb),
    column or row shards, or the whole tensor replicated over TP (norm)."""
    if name == "emb":
        return tp_vocab(name, shapes[name], tp_r, tp, divisible_by=4)
    if name == "col":
        return tp_column(name, shapes[name], tp_r, tp)
    if name == "row":
        return tp_row(name, shapes[name], tp_r, tp)
    return Layout.full(name, shapes[name])


def local(lay: Layout, shapes: Shapes = SHAPES, fill: float = 0.0) -> torch.Tensor:
    """A rank's local tensor under ``lay`` (flat or boxed pieces), ``fill`` where no piece lies."""
    out = torch.full(lay.local_shape, fill)
    for p in lay.pieces:
        src = value(p.tensor, shapes)[tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))]
        if isinstance(p.local, int):
            out.view(-1)[p.local : p.local + p.box.numel] = src.reshape(-1)
        else:
            out[tuple(slice(o, o + n) for o, n in zip(p.local.offsets, p.local.lengths, strict=True))] = src
    return out


def zero3(tp: int, dp: int, rank: int, shapes: Shapes = SHAPES) -> dict[str, Layout]:
    """Rank ``rank``'s ZeRO-3 (over DP) partition of each TP-sharded tensor."""
    tp_r, dp_r = rank % tp, rank // tp
    return {k: zero_partition([param(k, tp_r, tp, shapes)], dp_r, dp, stage=3) for k in shapes}


def explicit(lay: Layout) -> Layout:
    """The same layout with no rule: what the constructors returned before rules."""
    return Layout(lay.local_shape, tuple(lay.pieces), dict(lay.global_shapes), lay.replicated, lay.replicated_tensors)


def elements(lay: Layout) -> set[tuple[str, tuple[int, ...]]]:
    """Every (tensor, index) element the layout's pieces hold."""
    out: set[tuple[str, tuple[int, ...]]] = set()
    for p in lay.pieces:
        for e in itertools.product(*[range(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True)]):
            out.add((p.tensor, e))
    return out


__all__: list[Any] = ["SHAPES", "elements", "explicit", "local", "param", "value", "zero3"]
