"""Boxes and pieces: the geometry a :class:`~tierstore.layout.Layout` is made
of (see :mod:`tierstore.layout`), with the C-order arithmetic of flat ranges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierstore.errors import LayoutError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """An n-D box: ``offsets`` and ``lengths`` per dimension."""

    offsets: Shape
    lengths: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise LayoutError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise LayoutError(f"box {self} has negative offsets or lengths")

    @staticmethod
    def trusted(offsets: Shape, lengths: Shape) -> Box:
        """A box from values already known to be valid (skips the checks; hot paths)."""
        b = object.__new__(Box)
        object.__setattr__(b, "offsets", offsets)
        object.__setattr__(b, "lengths", lengths)
        return b

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> Shape:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(e <= s for e, s in zip(self.ends, shape, strict=True))

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]

    @staticmethod
    def from_json(v: Any) -> Box:
        return Box(tuple(int(x) for x in v[0]), tuple(int(x) for x in v[1]))


def squeezed(lengths: Sequence[int]) -> tuple[int, ...]:
    return tuple(n for n in lengths if n != 1)


@dataclass(frozen=True)
class Piece:
    """Part of a local tensor holding a box of the global tensor ``tensor``.

    ``local`` is either a :class:`Box` of the local tensor (same shape as
    ``box`` up to unit dimensions), or an ``int``: the flat (C-order) offset
    in the local tensor where the box's elements start, one after another in
    the box's C order (flat shards).
    """

    tensor: str
    box: Box
    local: Box | int

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tensor": self.tensor, "box": self.box.to_json()}
        if isinstance(self.local, Box):
            d["local_box"] = self.local.to_json()
        else:
            d["local_flat"] = self.local
        return d

    @staticmethod
    def from_json(v: Mapping[str, Any]) -> Piece:
        local: Box | int = Box.from_json(v["local_box"]) if "local_box" in v else int(v["local_flat"])
        return Piece(str(v["tensor"]), Box.from_json(v["box"]), local)


SPLIT_MODES = ("even", "pad", "chunk")


@dataclass(frozen=True)
class Split:
    """One level of a regular sharding: dimension ``dim`` of the current block
    cut into ``count`` parts.

    - ``even``: equal parts (the length divides);
    - ``pad``: the dimension padded to ``size`` (a multiple of ``count``) and
      cut into equal parts; a part's rows past the logical length are padding
      in the local tensor (a vocabulary padded to a multiple of the TP degree);
    - ``chunk``: ``torch.chunk``'s cut (DTensor ``Shard``): parts of
      ``ceil(length / count)``, the last ones shorter or empty.
    """

    dim: int
    count: int
    mode: str = "even"
    size: int = 0  # pad: the padded length

    def part(self, c: int, offs: list[int], lens: list[int], local: list[int]) -> None:
        """Narrows the block (``offs``, ``lens``, local ``local``) to part ``c``."""
        d = self.dim
        ext = lens[d]
        if self.mode == "even":
            per = ext // self.count
            offs[d] += c * per
            lens[d] = local[d] = per
        elif self.mode == "chunk":
            per = -(-ext // self.count)
            start = min(c * per, ext)
            offs[d] += start
            lens[d] = local[d] = max(0, min(per, ext - c * per))
        else:
            per = self.size // self.count
            start = min(c * per, ext)
            offs[d] += start
            lens[d] = max(0, min(per, ext - c * per))
            local[d] = per

    def per(self, ext: int) -> int:
        if self.mode == "even":
            return ext // self.count
        if self.mode == "chunk":
            return -(-ext // self.count)
        return self.size // self.count


def position_inside(coords: Sequence[int], axes: Sequence[int]) -> bool:
    """Whether ``coords`` is a position of a rule with ``axes``."""
    return len(coords) == len(axes) and all(0 <= c < n for c, n in zip(coords, axes, strict=True))


def contiguous_rows(inter: Box, piece_local: Box, shape: Sequence[int]) -> list[Box]:
    """Splits ``inter`` into boxes whose C-order elements are consecutive in a
    tensor of ``shape`` (one box when it already is)."""
    if c_contiguous_box(inter, shape):
        return [inter]
    nd = len(shape)
    # Split along the outer dimensions until each part is contiguous.
    k = next(d for d in range(nd) if inter.lengths[d] != 1)
    parts = []
    for i in range(inter.lengths[k]):
        off = list(inter.offsets)
        ln = list(inter.lengths)
        off[k] += i
        ln[k] = 1
        parts.extend(contiguous_rows(Box(tuple(off), tuple(ln)), piece_local, shape))
    return parts


def c_contiguous_box(box: Box, shape: Sequence[int]) -> bool:
    """True when the box's C-order elements are consecutive in the tensor:
    every dimension after its first non-unit one is taken whole."""
    first = next((i for i, n in enumerate(box.lengths) if n != 1), None)
    if first is None:
        return True
    return all(box.lengths[j] == shape[j] and box.offsets[j] == 0 for j in range(first + 1, len(shape)))


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[Box, int]]:
    """Decomposes the flat (C-order) range ``[start, end)`` of a tensor of
    ``shape`` into boxes whose elements are consecutive; returns each box with
    its first flat index. At most ``2 * ndim - 1`` boxes."""
    shape = tuple(shape)
    nd = len(shape)
    if nd == 0:
        return [(Box((), ()), 0)] if start < end else []
    strides = [math.prod(shape[i + 1 :]) for i in range(nd)]
    out: list[tuple[Box, int]] = []
    pos = start
    while pos < end:
        idx = []
        rem = pos
        for st in strides:
            idx.append(rem // st)
            rem %= st
        # The outermost dimension whose whole steps start at pos and fit.
        k = next(d for d in range(nd) if (pos % strides[d] == 0 and pos + strides[d] <= end) or d == nd - 1)
        if k == nd - 1:
            steps = min(end - pos, shape[-1] - idx[-1])
        else:
            steps = min((end - pos) // strides[k], shape[k] - idx[k])
        lengths = [1] * k + [steps] + list(shape[k + 1 :])
        offsets = idx[: k + 1] + [0] * (nd - k - 1)
        out.append((Box(tuple(offsets), tuple(lengths)), pos))
        pos += steps * strides[k]
    return out
