"""Two retention rules on their own: which offload subgroups stay resident
for the next step, and which step directories a codec tier keeps because a
kept delta is encoded against them."""

from __future__ import annotations

from pathlib import Path

import torch

from tierstore import _metadata
from tierstore._offload_pipeline import _kept
from tierstore._offload_subgroup import Subgroup
from tierstore._tier_format import CODEC_META
from tierstore._tier_steps import add_references


def _sg(index: int, nbytes: int, stepped: bool) -> Subgroup:
    sg = Subgroup(index, 0, [torch.zeros(1)], 0)
    sg.nbytes = nbytes
    if stepped:
        sg.inner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return sg


def test_kept_fills_the_room_from_the_end_of_the_order() -> None:
    order = [_sg(i, n, True) for i, n in enumerate([10, 40, 30, 20])]
    assert _kept(order, 55) == {3, 2}  # 20 + 30; 40 no longer fits, 10 would not either (5 left)
    assert _kept(order, 65) == {3, 2, 0}  # the tail need not be contiguous: 10 fits after 40 did not
    assert _kept(order, 0) == set()
    # Before the first step a subgroup will also hold its new state: three times its size.
    fresh = [_sg(0, 10, False), _sg(1, 10, True)]
    assert _kept(fresh, 35) == {1}  # 10 for the stepped one; 30 for the fresh one no longer fits
    assert _kept(fresh, 40) == {0, 1}


def _step(root: Path, step: int, refs: list[str] | None = None, reference: str | None = None) -> Path:
    d = root / f"step-{step:012d}"
    d.mkdir()
    meta: dict[str, object] = {"step": step}
    if refs is not None:
        meta["references"] = refs
    if reference is not None:
        meta["reference"] = reference
    (d / CODEC_META).write_bytes(_metadata.dumps(meta))
    return d


def test_add_references_follows_the_chain(tmp_path: Path) -> None:
    k = _step(tmp_path, 0)
    d1 = _step(tmp_path, 1, refs=[k.name])
    d2 = _step(tmp_path, 2, reference=d1.name)  # written before "references": one reference
    other = _step(tmp_path, 3)
    damaged = tmp_path / "step-000000000004"
    damaged.mkdir()
    (damaged / CODEC_META).write_bytes(b"{not json")
    keep = {d2, damaged}
    add_references(keep)
    assert keep == {d2, d1, k, damaged}  # the whole chain; a damaged step adds nothing
    assert other not in keep
