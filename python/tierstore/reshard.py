"""The reshard planner: (saved pieces, target layout) -> byte ranges to read.

Planning uses metadata alone (the checkpoint manifest and the target layouts)
and no collectives. For each target piece it intersects the saved pieces of
the same global tensor (vectorised with NumPy), then describes each
intersection as one copy block (an affine grid of byte runs, contiguous both
in the source file and in the destination tensor) that the engine expands,
merges and reads in Rust.

Before the data is used, :func:`prove_coverage` shows that every element of
the target came from exactly one saved element: saved pieces are checked to be
disjoint when the checkpoint is committed, so it is enough that the target's
intersections add up to its volume and do not overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierstore.errors import CoverageError
from tierstore.layout import Box, Layout, Piece

__all__ = ["CoverageError", "GlobalIndex", "Source", "block_for", "prove_coverage"]


@dataclass(frozen=True)
class Source:
    """A saved piece: where its local tensor lives and how it maps to global."""

    file: int
    offset: int  # byte offset of the local tensor's element 0 in the file
    local_shape: tuple[int, ...]
    itemsize: int
    piece: Piece
    stored: int = -1  # index of the stored local tensor in the manifest
    key: str = ""  # a rule position's: the key its data file holds it under (offset -1 until resolved)
    coords: tuple[int, ...] = ()  # ... and its position in the rule


@dataclass
class GlobalIndex:
    """The saved pieces of one global tensor, with their boxes as arrays and
    an interval index: the pieces sorted along the dimension where their
    offsets differ most (the one the tensor is split on), so that a query
    finds its candidates by binary search (O(log k + candidates), not a
    scan of every piece, for a tensor split over thousands of ranks)."""

    shape: tuple[int, ...]
    sources: list[Source]
    lo: np.ndarray  # (k, nd) box offsets
    hi: np.ndarray  # (k, nd) box ends
    dim: int = 0  # the sweep dimension
    order: np.ndarray | None = None  # pieces by lo[:, dim]
    lo_sorted: np.ndarray | None = None
    # The largest end along ``dim`` among the sorted pieces so far: a piece
    # that starts before the query's start can only reach into it if this
    # prefix maximum does, so the candidates are a contiguous run.
    hi_prefix_max: np.ndarray | None = None

    @staticmethod
    def build(shape: Sequence[int], sources: list[Source]) -> GlobalIndex:
        nd = len(shape)
        k = len(sources)
        lo = np.array([s.piece.box.offsets for s in sources], dtype=np.int64).reshape(k, nd)
        hi = np.array([s.piece.box.ends for s in sources], dtype=np.int64).reshape(k, nd)
        idx = GlobalIndex(tuple(shape), sources, lo, hi)
        if nd and k > 1:
            distinct = [len(np.unique(lo[:, d])) for d in range(nd)]
            idx.dim = int(np.argmax(distinct))
            idx.order = np.argsort(lo[:, idx.dim], kind="stable")
            idx.lo_sorted = lo[idx.order, idx.dim]
            idx.hi_prefix_max = np.maximum.accumulate(hi[idx.order, idx.dim])
        return idx

    def _candidates(self, box: Box) -> np.ndarray:
        """Indices of the pieces that may meet ``box`` (a superset, sorted)."""
        if self.order is None:
            return np.arange(len(self.sources))
        assert self.lo_sorted is not None and self.hi_prefix_max is not None
        d = self.dim
        qlo, qhi = box.offsets[d], box.offsets[d] + box.lengths[d]
        end = int(np.searchsorted(self.lo_sorted, qhi, side="left"))  # pieces starting before the query ends
        start = int(np.searchsorted(self.hi_prefix_max[:end], qlo, side="right"))  # ... and reaching into it
        return np.sort(self.order[start:end])

    def overlapping(self, box: Box) -> list[tuple[Source, Box]]:
        if not self.sources:
            return []
        if not box.offsets:  # 0-dim tensors
            return [(s, box) for s in self.sources]
        cand = self._candidates(box)
        blo = np.array(box.offsets, dtype=np.int64)
        bhi = np.array(box.ends, dtype=np.int64)
        ilo = np.maximum(self.lo[cand], blo)
        ihi = np.minimum(self.hi[cand], bhi)
        hit = cand[np.nonzero(np.all(ihi > ilo, axis=1))[0]]
        lo_l = np.maximum(self.lo[hit], blo).tolist()
        ln_l = (np.minimum(self.hi[hit], bhi) - np.maximum(self.lo[hit], blo)).tolist()
        return [
            (self.sources[i], Box.trusted(tuple(a), tuple(b))) for i, a, b in zip(hit.tolist(), lo_l, ln_l, strict=True)
        ]


def _c_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def affine_map(piece: Piece, local_shape: Sequence[int], nd: int) -> tuple[int, list[int]]:
    """``(base, strides)`` such that the local flat index of global element x
    (inside the piece's box) is ``base + sum(strides[d] * (x[d] - box.offsets[d]))``."""
    box = piece.box
    if isinstance(piece.local, int):
        return piece.local, _c_strides(box.lengths)
    lbox = piece.local
    lstr = _c_strides(local_shape)
    base = sum(o * s for o, s in zip(lbox.offsets, lstr, strict=True))
    gdims = [d for d in range(nd) if box.lengths[d] != 1]
    ldims = [d for d in range(len(local_shape)) if lbox.lengths[d] != 1]
    strides = [0] * nd
    for g, ld in zip(gdims, ldims, strict=True):
        strides[g] = lstr[ld]
    return base, strides


def block_for(
    inter: Box,
    src: Source,
    dst_piece: Piece,
    dst_shape: Sequence[int],
    src_affine: tuple[int, list[int]] | None = None,
    dst_affine: tuple[int, list[int]] | None = None,
) -> tuple[int, int, int, list[tuple[int, int, int]]]:
    """The copy of ``inter`` from the saved piece to the target piece as one
    block, in elements: ``(source local flat index, destination local flat
    index, run length, [(count, source stride, destination stride), ...])``,
    the runs of ``run`` elements laid out in an affine grid on both sides
    (the engine expands it; see ``tierstore_core::gather``)."""
    nd = len(inter.offsets)
    sbase, sstr = src_affine or affine_map(src.piece, src.local_shape, nd)
    dbase, dstr = dst_affine or affine_map(dst_piece, dst_shape, nd)
    sbox, dbox = src.piece.box.offsets, dst_piece.box.offsets
    s0, d0 = sbase, dbase
    nonunit = []
    for d in range(nd):
        o = inter.offsets[d]
        s0 += (o - sbox[d]) * sstr[d]
        d0 += (o - dbox[d]) * dstr[d]
        if inter.lengths[d] != 1:
            nonunit.append(d)
    # The innermost dimensions contiguous on both sides make the run.
    run = 1
    i = len(nonunit)
    while i and sstr[nonunit[i - 1]] == run and dstr[nonunit[i - 1]] == run:
        run *= inter.lengths[nonunit[i - 1]]
        i -= 1
    return s0, d0, run, [(inter.lengths[d], sstr[d], dstr[d]) for d in nonunit[:i]]


def prove_coverage(name: str, target: Layout, inters: list[list[Box]]) -> None:
    """Raises :class:`CoverageError` unless the intersections found for each
    target piece cover it exactly once.

    The proof is exact and trusts nothing the checkpoint says: the
    intersections lie inside the piece by construction, so they cover it
    exactly once if and only if they are pairwise disjoint and their volumes
    add up to the piece's.
    """
    for piece, boxes in zip(target.pieces, inters, strict=True):
        got = sum(b.numel for b in boxes)
        want = piece.box.numel
        overlap = overlapping_pair(boxes)
        if overlap is not None:
            a, b = boxes[overlap[0]], boxes[overlap[1]]
            raise CoverageError(
                f"tensor {name!r}: region {piece.box.offsets}+{piece.box.lengths} of {piece.tensor!r} would be "
                f"read from overlapping saved pieces ({a.offsets}+{a.lengths} and {b.offsets}+{b.lengths}); "
                "the checkpoint's manifest is damaged"
            )
        if got == want:
            continue
        where = _uncovered_point(piece.box, boxes)
        raise CoverageError(
            f"tensor {name!r}: {want - got} of {want} elements of {piece.tensor!r} in region "
            f"{piece.box.offsets}+{piece.box.lengths} are not in the checkpoint (e.g. element {where})"
        )


def prove_tiling(name: str, shape: Sequence[int], boxes: Sequence[Box], where: str = "checkpoint") -> None:
    """Raises :class:`CoverageError` unless ``boxes`` (each inside ``shape``)
    tile the global tensor ``name`` exactly once: no overlap, no hole.

    A load checks this for every global tensor it reads from, not only inside
    the region it needs: a manifest whose pieces overlap elsewhere says two
    different things about where some saved element belongs, so none of its
    claims about that tensor can be trusted.
    """
    nd = len(shape)
    lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    hi = lo + np.array([b.lengths for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    prove_tiling_arrays(name, shape, lo, hi, where)


def prove_tiling_arrays(name: str, shape: Sequence[int], lo: np.ndarray, hi: np.ndarray, where: str) -> None:
    """:func:`prove_tiling` of boxes given as ``(k, nd)`` arrays of starts and ends."""
    # Each box lies inside the shape (checked when the manifest was read), so
    # no product below overflows; the sum is taken in Python integers.
    total = sum((hi - lo).prod(axis=1).tolist()) if len(lo) else 0
    want = math.prod(shape)
    pair = _overlapping_pair(lo, hi)
    if pair is not None:
        i, j = pair
        raise CoverageError(
            f"{where}: global tensor {name!r}: saved pieces {tuple(lo[i].tolist())}+{tuple((hi[i] - lo[i]).tolist())} "
            f"and {tuple(lo[j].tolist())}+{tuple((hi[j] - lo[j]).tolist())} overlap; the manifest is damaged"
        )
    if total != want:
        raise CoverageError(
            f"{where}: global tensor {name!r} of shape {tuple(shape)}: its saved pieces hold {total} of {want} "
            "elements; the manifest is damaged"
        )


def overlapping_pair(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Two boxes that overlap, or None when all are pairwise disjoint.

    A sweep along the dimension where the boxes' starts spread furthest:
    after sorting by start there, each box is compared only with the boxes
    that start before it ends (vectorised), so blocks, rows, columns and flat
    ranges cost about n log n; the worst case stays exact.
    """
    n = len(boxes)
    if n < 2:
        return None
    nd = len(boxes[0].offsets)
    lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(n, nd)
    hi = lo + np.array([b.lengths for b in boxes], dtype=np.int64).reshape(n, nd)
    return _overlapping_pair(lo, hi)


def _overlapping_pair(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    n, nd = lo.shape
    if n < 2:
        return None
    if nd == 0:
        return (0, 1)  # two pieces of one 0-dim tensor
    empty = np.any(hi <= lo, axis=1)
    # The dimension whose starts spread furthest across the boxes' extent
    # (only speed depends on the choice, never the answer).
    spread = np.ptp(lo, axis=0) / np.maximum(hi.max(axis=0) - lo.min(axis=0), 1)
    dim = int(np.argmax(spread))
    order = np.argsort(lo[:, dim], kind="stable")
    order = order[~empty[order]]
    slo, shi = lo[order], hi[order]
    starts = slo[:, dim]
    # Box k overlaps in `dim` with the boxes after it that start before it ends.
    stop = np.searchsorted(starts, shi[:, dim], side="left")
    # Only those boxes need a look (none, for row or column shards and flat ranges).
    for k in np.nonzero(stop > np.arange(1, len(order) + 1))[0].tolist():
        j0, j1 = k + 1, int(stop[k])
        meet = np.all(np.maximum(slo[j0:j1], slo[k]) < np.minimum(shi[j0:j1], shi[k]), axis=1)
        hit = np.nonzero(meet)[0]
        if len(hit):
            return int(order[k]), int(order[j0 + hit[0]])
    return None


def _disjoint(boxes: list[Box]) -> bool:
    return overlapping_pair(boxes) is None


def _uncovered_point(box: Box, boxes: list[Box]) -> tuple[int, ...]:
    """One element of ``box`` outside every one of ``boxes`` (by sampling the
    box's corners and then its elements in steps)."""
    rng = np.random.default_rng(0)
    lo = np.array(box.offsets)
    n = np.array(box.lengths)
    candidates = [lo, lo + n - 1] + [lo + (rng.random(len(n)) * n).astype(np.int64) for _ in range(4096)]
    for c in candidates:
        if not any(all(b.offsets[d] <= c[d] < b.ends[d] for d in range(len(c))) for b in boxes):
            return tuple(int(x) for x in c)
    return tuple(int(x) for x in lo)
