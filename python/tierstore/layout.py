"""The sharding description: where each local tensor's elements sit in the
logical (global) tensors of a model.

A :class:`Layout` is plain data attached to a local tensor. It lists
:class:`Piece` s; each piece says "this part of the local tensor holds that
box of global tensor *T*". One description covers every parallel layout:

- n-D blocks (tensor-parallel rows or columns, expert slices, pipeline stages):
  one piece, a box of the local tensor equal to a box of the global one;
- flat ranges of a flattened tensor (FSDP, ZeRO-3) and of a flat buffer that
  concatenates many parameters with alignment padding (ZeRO-1/2): the local
  side of a piece is a start offset in the local tensor's flat order, and the
  global side a box whose C-order elements follow one another;
- fused and stacked groups (QKV with grouped-query attention, SwiGLU
  gate/up, BOOST's `[3r, d/tp]` and `[g, out/tp, r]` factors): several pieces,
  each mapping a part of the local tensor to a different global tensor;
- padded dimensions (a vocabulary padded to a multiple of the TP degree): the
  global shape is the logical one; local elements no piece covers are padding,
  written as zeros on load;
- replicated tensors: ``replicated=True`` (every rank holds the same pieces;
  one of them writes them).

Global boxes are ``(offsets, lengths)`` in the global tensor's coordinates; a
local box must have the same shape as its global box once dimensions of
length 1 are dropped (so stacking adds or removes unit dimensions freely).
Layouts serialise to JSON (``to_json``/``from_json``) and are stored in the
checkpoint's manifest; docs/FORMAT.md describes the form.
"""

from __future__ import annotations

import torch

from tierstore._boxes import SPLIT_MODES, Box, Piece, Shape, Split, flat_range_boxes, position_inside
from tierstore._layout_algebra import Layout, Rule, RuleLayout
from tierstore._parallel_layouts import (
    boost_fused_down,
    boost_stacked_up,
    expert_slice,
    pipeline_layers,
    tp_column,
    tp_fused_qkv,
    tp_fused_swiglu,
    tp_row,
    tp_vocab,
    zero_partition,
)
from tierstore.errors import LayoutError

__all__ = [
    "SPLIT_MODES",
    "Box",
    "Layout",
    "LayoutError",
    "Piece",
    "Rule",
    "Shape",
    "Split",
    "attach",
    "boost_fused_down",
    "boost_stacked_up",
    "expert_slice",
    "flat_range_boxes",
    "layout_of",
    "pipeline_layers",
    "position_inside",
    "tp_column",
    "tp_fused_qkv",
    "tp_fused_swiglu",
    "tp_row",
    "tp_vocab",
    "zero_partition",
]


# The classes are tierstore.layout's in name too (their repr, and a pickle
# of one refers to them here); a rule's positions were _RuleLayout before.
for _cls in (Box, Piece, Split, Rule, Layout, RuleLayout):
    _cls.__module__ = __name__
_RuleLayout = RuleLayout


_ATTR = "_tierstore_layout"


def attach(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Attaches ``layout`` to the local tensor ``t`` (returns ``t``)."""
    if tuple(t.shape) != layout.local_shape:
        raise LayoutError(
            f"layout for a local tensor of shape {layout.local_shape} attached to one of {tuple(t.shape)}"
        )
    layout.validate()
    setattr(t, _ATTR, layout)
    return t


def layout_of(t: torch.Tensor) -> Layout | None:
    """The layout attached to ``t``, if any."""
    return getattr(t, _ATTR, None)
