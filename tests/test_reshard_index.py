"""The planner's interval index finds exactly the saved pieces a target box
meets (against a scan of every piece), for n-D block tilings and flat
ranges, and looks at few pieces of a tensor split over many ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tierstore.layout import Box, Layout, Piece, flat_range_boxes
from tierstore.reshard import GlobalIndex, Source


def _sources(pieces: list[Box], name: str = "t") -> list[Source]:
    return [Source(file=0, offset=0, local_shape=b.lengths, itemsize=4, piece=Piece(name, b, Box.whole(b.lengths)))
            for b in pieces]  # fmt: skip


def _scan(boxes: list[Box], q: Box) -> list[tuple[int, Box]]:
    out = []
    for i, b in enumerate(boxes):
        x = b.intersect(q)
        if x is not None:
            out.append((i, x))
    return out


def _grid(shape: tuple[int, int], rows: int, cols: int) -> list[Box]:
    rs, cs = shape[0] // rows, shape[1] // cols
    return [Box((i * rs, j * cs), (rs, cs)) for i in range(rows) for j in range(cols)]


@pytest.mark.parametrize("seed", range(20))
def test_index_matches_a_scan(seed: int) -> None:
    rng = random.Random(seed)
    shape = (48, 36)
    kind = seed % 3
    if kind == 0:
        boxes = _grid(shape, rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 2, 3, 4, 6]))
    elif kind == 1:  # flat ranges of the flattened tensor (ZeRO / FSDP1)
        cuts = sorted(rng.sample(range(1, 48 * 36), 7))
        boxes = []
        for a, b in zip([0, *cuts], [*cuts, 48 * 36], strict=True):
            boxes.extend(bx for bx, _off in flat_range_boxes(shape, a, b))
    else:  # uneven row blocks
        cuts = sorted(rng.sample(range(1, 48), 5))
        boxes = [Box((a, 0), (b - a, 36)) for a, b in zip([0, *cuts], [*cuts, 48], strict=True)]
    rng.shuffle(boxes)
    idx = GlobalIndex.build(shape, _sources(boxes))
    for _ in range(30):
        r0, c0 = rng.randrange(48), rng.randrange(36)
        q = Box((r0, c0), (rng.randint(1, 48 - r0), rng.randint(1, 36 - c0)))
        got = sorted((idx.sources.index(s), b) for s, b in idx.overlapping(q))
        want = _scan(boxes, q)
        assert [(i, b.offsets, b.lengths) for i, b in got] == [(i, b.offsets, b.lengths) for i, b in want]


def test_a_query_looks_at_few_pieces_of_a_tensor_split_over_many_ranks() -> None:
    world = 16384
    shape = (world * 4, 8)
    boxes = [Layout.shard("t", shape, 0, r, world).pieces[0].box for r in range(world)]
    idx = GlobalIndex.build(shape, _sources(boxes))
    q = Box((4 * 1000 + 2, 0), (8, 8))  # rows of ranks 1000..1002
    cand = idx._candidates(q)
    assert len(cand) <= 3 and set(np.asarray(cand).tolist()) == {1000, 1001, 1002}
    assert [s.piece.box.offsets[0] // 4 for s, _b in idx.overlapping(q)] == [1000, 1001, 1002]
