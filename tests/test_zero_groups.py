"""ZeRO-1/2 flat partitions of a parameter group as rules (issue 16, compact
layouts): the group's buffer (its members' local tensors flattened in order,
padded to a multiple of alignment x DP) cut into DP parts is stored as one
rule per member, the same for every data-parallel rank, instead of every
rank's ranges. Checked against the explicit pieces ``Layout.flat_buffer``
makes, against brute force (tiling, positions meeting a box), end to end
over real process groups (TP 2 x ZeRO-2 DP 2 saved by 4 ranks, loaded by 2
ranks of TP 1 x ZeRO-1 DP 2 and whole), and against re-sealed manifests
that redescribe the buffer."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import random
from typing import Any

import pytest
import torch
from dist_util import run_world
from layout_util import SHAPES, elements, explicit, local, param, value

import tierstore
import tierstore.cli
from tierstore import _metadata
from tierstore.errors import TierstoreError
from tierstore.layout import Box, Layout, Rule, Split, attach, tp_column, zero_partition
from tierstore.sharded import consolidate


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_group_partition_is_one_rule_per_member_with_the_flat_buffers_pieces(stage: int, tp: int) -> None:
    for tp_r in range(tp):
        params = [param(k, tp_r, tp) for k in SHAPES]
        for dp in (1, 2, 3, 5):
            rules = None
            for d in range(dp):
                lay = zero_partition(params, d, dp, stage=stage)
                old = zero_partition([explicit(p) for p in params], d, dp, stage=stage)
                assert old.rules == () and lay.rule_positions() == lay.rules and len(lay.rules) == len(SHAPES)
                assert lay.local_shape == old.local_shape and lay.pieces == old.pieces
                assert lay.replicated_tensors == {"norm"} == old.replicated_tensors
                # The same rules on every data-parallel rank, this rank's part the last axis.
                got = tuple(r for r, _c in lay.rules)
                assert rules is None or got == rules
                rules = got
                assert all(c[-1] == d and r.flat == dp and r.flat_per == lay.local_shape[0] for r, c in lay.rules)
                back = Layout.from_json(json.loads(json.dumps(lay.to_json())))
                assert back == lay and back.rule_positions() == lay.rules
                assert "rules" in lay.to_json() and "rules" not in old.to_json()


def test_members_that_are_not_regular_leave_explicit_pieces() -> None:
    chunked = Rule("c", (7, 4), (Split(0, 2, "chunk"),)).layout_at((1,))
    fused = Layout.concat([(tp_column("a", (4, 4), 0, 2), 2), (tp_column("b", (4, 4), 0, 2), 2)], 0)
    boxed = ("x", (6, 4), Box((0, 0), (3, 4)))
    for extra in (chunked, fused, boxed):
        lay = zero_partition([("w", (8, 8)), extra], 0, 2, stage=1)
        assert lay.rules == () and lay.rule_positions() == ()
    changed = zero_partition([("w", (8, 8)), ("b", (5,))], 0, 2, stage=1)
    moved = dataclasses.replace(changed, pieces=changed.pieces[:1])  # pieces changed after the rules were set
    assert moved.rule_positions() == () and "rules" not in moved.to_json()


def _random_member(rng: random.Random) -> tuple[Rule, int]:
    nd = rng.randint(1, 2)
    shape = tuple(rng.randint(1, 8) for _ in range(nd))
    splits: list[Split] = []
    if rng.random() < 0.6:
        d = rng.randrange(nd)
        count = rng.randint(1, 3)
        if shape[d] % count == 0 and rng.random() < 0.5:
            splits.append(Split(d, count, "even"))
        else:
            splits.append(Split(d, count, "pad", -(-shape[d] // count) * count + count * rng.randint(0, 1)))
    base = Rule("t", shape, tuple(splits))
    n = math.prod(base.layout_at((0,) * len(splits)).local_shape)
    flat = rng.randint(1, 4)
    at = rng.randint(0, 6)
    per = -(-(at + n + rng.randint(0, 5)) // flat)
    return dataclasses.replace(base, flat=flat, flat_at=at, flat_per=per), n


def test_random_members_tile_their_tensor_and_are_found_in_closed_form() -> None:
    rng = random.Random(16)
    for _ in range(300):
        rule, _n = _random_member(rng)
        rule.validate()
        seen: set[Any] = set()
        for c in itertools.product(*[range(k) for k in rule.axes]):
            lay = rule.layout_at(c)
            lay.validate()
            assert lay.local_shape == (rule.flat_per,)
            els = elements(lay)
            assert not els & seen, (rule, c)
            seen |= els
        assert len(seen) == math.prod(rule.shape), rule
        offs = tuple(rng.randrange(k) for k in rule.shape)
        box = Box(offs, tuple(rng.randint(1, k - o) for o, k in zip(offs, rule.shape, strict=True)))
        truth = {
            c
            for c in itertools.product(*[range(k) for k in rule.axes])
            if any(p.box.intersect(box) is not None for p in rule.layout_at(c).pieces)
        }
        assert truth <= set(rule.coords_meeting(box)), (rule, box)


def test_a_member_that_overruns_its_buffer_is_refused() -> None:
    from tierstore.errors import LayoutError

    base = {"tensor": "t", "shape": [4, 4], "splits": [], "flat": 2, "replicated": False}
    Rule.from_json({**base, "flat_at": 4, "flat_per": 10})
    for bad in (
        {**base, "flat_at": 5, "flat_per": 10},  # 16 elements from 5 overrun 2 x 10
        {**base, "flat_at": 0, "flat_per": 0, "flat": 2} | {"flat_at": 3},
        {**base, "flat": 0, "flat_at": 0, "flat_per": 16},
        {**base, "splits": [[0, 3, "chunk", 0]], "flat_at": 0, "flat_per": 16},
    ):
        with pytest.raises(LayoutError):
            Rule.from_json(bad)


# ----------------------------------------------------------------------------------------------
# end to end


def _group(tp: int, dp: int, rank: int, stage: int) -> Layout:
    tp_r, dp_r = rank % tp, rank // tp
    return zero_partition([param(k, tp_r, tp) for k in SHAPES], dp_r, dp, stage=stage)


def _save(rank: int, world: int, path: str) -> None:
    lay = _group(2, 2, rank, 2)
    assert lay.rule_positions()
    tierstore.save_sharded({"optim.exp_avg": attach(local(lay, fill=-1.0), lay), "step": 3}, path)


def _load(rank: int, world: int, path: str) -> None:
    lay = _group(1, world, rank, 1)  # TP 1 x ZeRO-1 DP 2: another buffer, another cut
    sd: dict[str, Any] = {"optim.exp_avg": attach(torch.full(lay.local_shape, float("nan")), lay), "step": None}
    stats: dict[str, Any] = {}
    tierstore.load_sharded(path, sd, stats=stats)
    got, want = sd["optim.exp_avg"], local(lay, fill=-1.0)
    used = [p.local + i for p in lay.pieces for i in range(p.box.numel)]  # type: ignore[operator]
    assert torch.equal(got[used], want[used])
    assert sd["step"] == 3


def _saved(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "z2"
    run_world(4, _save, str(d))
    return d


def test_a_tp_zero2_group_saved_by_4_ranks_loads_on_2_of_another_layout(tmp_path: pathlib.Path) -> None:
    d = _saved(tmp_path)
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
    # No per-rank ranges: one rule per member, and two groups (the TP-sharded
    # members at (tp, dp) positions, the TP-replicated norm at (dp,) ones).
    assert m["stored"] == [] and set(m["tensors"]) == set(SHAPES)
    assert all(g["rule"]["flat"] == 2 and g["rule"]["flat_per"] > 0 for g in m["tensors"].values())
    assert m["tensors"]["norm"]["rule"]["replicated"] and not m["tensors"]["col"]["rule"]["replicated"]
    coords = sorted(tuple(map(tuple, g["coords"])) for g in m["groups"])
    assert coords == [((0,), (1,)), ((0, 0), (0, 1), (1, 0), (1, 1))]
    run_world(2, _load, str(d))
    whole = {k: torch.zeros(s) for k, s in SHAPES.items()}
    tierstore.load_sharded(d, whole)
    for k in SHAPES:
        assert torch.equal(whole[k], value(k)), k
    assert tierstore.cli.main(["verify", str(d)]) == 0
    full = consolidate(d)
    for k in SHAPES:
        assert torch.equal(full[k], value(k)), k


def test_the_group_entry_does_not_grow_with_the_ranks(tmp_path: pathlib.Path) -> None:
    """One process holding every data-parallel part of a group for 2, 8 and
    32 ranks: each member's entry is one rule whatever the count."""
    sizes = []
    for dp in (2, 8, 32):
        d = tmp_path / f"dp{dp}"
        sd = {}
        for r in range(dp):
            lay = zero_partition([("a", (64, 4)), ("b", (7,)), ("c", (3, 5))], r, dp, stage=1)
            sd[f"part{r}"] = attach(_local_of(lay), lay)
        tierstore.save_sharded(sd, d)
        m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
        assert m["stored"] == [] and all("pieces" not in g for g in m["tensors"].values())
        sizes.append(sum(len(json.dumps(g["rule"])) for g in m["tensors"].values()))
        out = {"a": torch.zeros(64, 4), "b": torch.zeros(7), "c": torch.zeros(3, 5)}
        tierstore.load_sharded(d, out)
        for k, v in out.items():
            assert torch.equal(v, _named(k, v.shape)), k
    assert max(sizes) - min(sizes) <= 12, sizes  # the counts' digits only


def _named(name: str, shape: Any) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(tuple(shape)) + 100 * ord(name)


def _local_of(lay: Layout) -> torch.Tensor:
    out = torch.zeros(lay.local_shape)
    for p in lay.pieces:
        src = _named(p.tensor, lay.global_shapes[p.tensor])
        src = src[tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))]
        assert isinstance(p.local, int)
        out.view(-1)[p.local : p.local + p.box.numel] = src.reshape(-1)
    return out


@pytest.mark.parametrize("edit", ["swap_at", "shift_at", "per", "swap_files", "move_position", "drop_norm", "dp"])
def test_a_resealed_group_is_checked_against_the_data_files(tmp_path: pathlib.Path, edit: str) -> None:
    """A re-sealed manifest that moves a member inside the buffer, recuts the
    buffer, or moves or drops a position is refused: against the rules each
    data file recorded for its buffer, or against the coverage proof."""
    d = _saved(tmp_path)
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
    t = m["tensors"]
    big = next(g for g in m["groups"] if len(g["coords"]) == 4)
    if edit == "swap_at":
        col, row = t["col"]["rule"], t["row"]["rule"]
        col["flat_at"], row["flat_at"] = row["flat_at"], col["flat_at"]
    elif edit == "shift_at":
        t["row"]["rule"]["flat_at"] += 1
    elif edit == "per":
        t["col"]["rule"]["flat_per"] += 2
    elif edit == "swap_files":
        big["files"] = big["files"][::-1]
    elif edit == "move_position":
        big["coords"][1] = [1, 1]
    elif edit == "drop_norm":
        small = next(g for g in m["groups"] if len(g["coords"]) == 2)
        small["coords"], small["files"] = small["coords"][:1], small["files"][:1]
    elif edit == "dp":
        t["col"]["rule"]["flat"] = 1
    (d / "manifest.json").write_bytes(_metadata.dumps(m))
    with pytest.raises(TierstoreError):
        consolidate(d)
    with pytest.raises(TierstoreError):
        tierstore.load_sharded(d, {k: torch.zeros(s) for k, s in SHAPES.items()})
