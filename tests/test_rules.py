"""Sharding rules (issue 16, compact layouts): a regular sharding is stored
as one rule whatever the number of ranks, proven to tile its tensor once,
and a loading rank finds the positions it needs in closed form.

Checked against the explicit layouts the same constructors made before
rules existed (the rule must describe exactly the same pieces), against
brute force (the positions meeting a box), and end to end over real
process groups (ZeRO-3 + TP saved by 4 ranks, loaded by 2 of another
layout; DTensors)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import random

import pytest
import torch
from dist_util import run_world
from layout_util import SHAPES, elements, explicit, local, value, zero3

import tierstore
import tierstore.cli
from tierstore import _metadata
from tierstore.errors import CoverageError, LayoutError
from tierstore.layout import Box, Layout, Rule, Split, attach, tp_column, tp_row, tp_vocab, zero_partition
from tierstore.sharded import consolidate


def _elements(lay: Layout) -> set[tuple[int, ...]]:
    return {e for _t, e in elements(lay)}


def _random_rule(rng: random.Random) -> Rule:
    nd = rng.randint(1, 3)
    shape = tuple(rng.randint(0, 9) for _ in range(nd))
    splits = []
    for _ in range(rng.randint(0, 3)):
        d = rng.randrange(nd)
        mode = rng.choice(["chunk", "even", "pad"])
        count = rng.randint(1, 4)
        if mode == "pad":
            if any(s.dim == d for s in splits):
                mode = "chunk"
            else:
                splits.append(Split(d, count, "pad", -(-max(shape[d], 1) // count) * count + count * rng.randint(0, 1)))
                continue
        if mode == "even":
            ext = shape[d]
            for s in splits:
                if s.dim == d:
                    ext = ext // s.count if s.mode == "even" else -1
            if ext < 0 or ext % count:
                mode = "chunk"
        if mode == "chunk" and any(s.dim == d and s.mode == "pad" for s in splits):
            continue
        splits.append(Split(d, count, mode))
    return Rule("t", shape, tuple(splits), rng.choice([0, 0, 1, 2, 3]), False)


def test_random_rules_tile_their_tensor_exactly() -> None:
    """Every position's pieces are disjoint from every other's and together
    cover the tensor: the proof a checkpoint relies on when it checks only
    that each position was written once."""
    rng = random.Random(5)
    for _ in range(300):
        rule = _random_rule(rng)
        rule.validate()
        seen: set[tuple[int, ...]] = set()
        total = 0
        for coords in itertools.product(*[range(n) for n in rule.axes]):
            lay = rule.layout_at(coords)
            lay.validate()
            els = _elements(lay)
            assert not els & seen, (rule, coords)
            seen |= els
            total += sum(p.box.numel for p in lay.pieces)
        assert total == math.prod(rule.shape) == len(seen), rule


def test_positions_meeting_a_box_are_found_in_closed_form() -> None:
    rng = random.Random(6)
    for _ in range(200):
        rule = _random_rule(rng)
        if not all(rule.shape):
            continue
        offs = tuple(rng.randrange(n) for n in rule.shape)
        box = Box(offs, tuple(rng.randint(1, n - o) for o, n in zip(offs, rule.shape, strict=True)))
        found = set(rule.coords_meeting(box))
        truth = {
            c
            for c in itertools.product(*[range(n) for n in rule.axes])
            if any(p.box.intersect(box) is not None for p in rule.layout_at(c).pieces)
        }
        assert truth <= found, (rule, box)
        if not rule.flat:
            assert found == truth, (rule, box)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_constructors_make_the_pieces_they_made_without_rules(tp: int) -> None:
    for r in range(tp):
        for lay in (
            tp_column("a", (8, 6), r, tp),
            tp_row("b", (6, 8), r, tp),
            tp_vocab("e", (50, 4), r, tp, divisible_by=8),
        ):
            assert lay.rule is not None and lay.rule_holds()
            for dp in (1, 3):
                for d in range(dp):
                    z = zero_partition([lay], d, dp, stage=3)
                    old = zero_partition([explicit(lay)], d, dp, stage=3)
                    assert z.rule is not None and z.coords == (*lay.coords, d)
                    assert z.local_shape == old.local_shape and z.pieces == old.pieces


def test_a_layout_changed_after_its_rule_is_stored_as_pieces(tmp_path: pathlib.Path) -> None:
    """dataclasses.replace of the pieces leaves a rule that no longer holds:
    the save stores the pieces, not the rule."""
    lay = tp_column("w", (8, 4), 0, 2)
    moved = dataclasses.replace(lay, pieces=(dataclasses.replace(lay.pieces[0], box=Box((4, 0), (4, 4))),))
    assert lay.rule_holds() and not moved.rule_holds()
    assert "rule" in lay.to_json() and "rule" not in moved.to_json()
    with pytest.raises(CoverageError, match="'w'"):  # rows 0-3 of w are in no piece
        tierstore.save_sharded({"w": attach(torch.ones(4, 4), moved)}, tmp_path / "a")
    same = dataclasses.replace(lay, replicated=True)  # the rule follows the flag
    assert same.rule is not None and same.rule.replicated and same.rule_holds()


def test_malformed_rules_are_refused() -> None:
    for bad in (
        {"tensor": "t", "shape": [4], "splits": [[1, 2, "even", 0]], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [5], "splits": [[0, 2, "even", 0]], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [5], "splits": [[0, 2, "pad", 5]], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [4], "splits": [[0, 0, "chunk", 0]], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [4], "splits": [[0, 2, "zig", 0]], "flat": 0, "replicated": False},
        {"tensor": "", "shape": [4], "splits": [], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [-1], "splits": [], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [4], "splits": [[0, 2]], "flat": 0, "replicated": False},
        {"tensor": "t", "shape": [4], "splits": [], "flat": True, "replicated": False},
        {"tensor": "t", "shape": [4], "splits": []},
        [],
    ):
        with pytest.raises(LayoutError):
            Rule.from_json(bad)


# ----------------------------------------------------------------------------------------------
# end to end

TP, DP = 2, 2


def _save_zero3(rank: int, world: int, path: str) -> None:
    lays = zero3(TP, DP, rank)
    tierstore.save_sharded({k: attach(local(v), v) for k, v in lays.items()}, path)


def _load_other(rank: int, world: int, path: str) -> None:
    # TP 1 x DP 2 -> each rank a ZeRO-3 half of the whole tensors; and whole tensors.
    lays = zero3(1, world, rank)
    sd = {k: attach(torch.full(v.local_shape, float("nan")), v) for k, v in lays.items()}
    tierstore.load_sharded(path, sd)
    for k, v in lays.items():
        want = local(v)
        used = sum(p.box.numel for p in v.pieces)
        assert torch.equal(sd[k].view(-1)[:used], want.view(-1)[:used]), k
    whole = {k: torch.zeros(s) for k, s in SHAPES.items()}
    tierstore.load_sharded(path, whole)
    for k in SHAPES:
        assert torch.equal(whole[k], value(k)), k


def test_zero3_tp_rules_saved_by_4_ranks_load_on_2_of_another_layout(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "z3"
    run_world(TP * DP, _save_zero3, str(d))
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
    assert m["stored"] == [] and all("rule" in g for g in m["tensors"].values())
    assert m["tensors"]["col"]["rule"]["splits"] == [[0, TP, "even", 12]] and m["tensors"]["col"]["rule"]["flat"] == DP
    assert m["tensors"]["emb"]["rule"]["splits"] == [[0, TP, "pad", 56]]  # 50 rows padded to a multiple of 4 x TP
    # The TP-replicated norm: positions over DP only, each written once.
    norm = m["tensors"]["norm"]
    assert norm["rule"]["replicated"] and m["groups"][norm["parts"][0][0]]["coords"] == [[0], [1]]
    run_world(2, _load_other, str(d))
    assert tierstore.cli.main(["verify", str(d)]) == 0
    full = consolidate(d)
    for k in SHAPES:
        assert torch.equal(full[k], value(k))


def test_manifest_of_a_rule_does_not_grow_with_the_ranks(tmp_path: pathlib.Path) -> None:
    """One process saving every position of a rule for 2, 8 and 32 ranks:
    the rule is the same (a multi-rank save holds each position under one
    key, so the entry is too; see tests/test_bench_scale.py)."""
    sizes = []
    for n in (2, 8, 32):
        d = tmp_path / f"n{n}"
        full = torch.randn(64, 4)
        sd = {
            f"p{r}": attach(full[r * 64 // n : (r + 1) * 64 // n].clone(), tp_column("w", (64, 4), r, n))
            for r in range(n)
        }
        tierstore.save_sharded(sd, d)
        m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
        g = m["tensors"]["w"]
        assert m["stored"] == [] and "pieces" not in g
        assert len(g["parts"]) == n  # one process holds every position, each under its own key
        sizes.append(len(json.dumps(g["rule"])))
        out = {"w": torch.zeros(64, 4)}
        tierstore.load_sharded(d, out)
        assert torch.equal(out["w"], full)
    assert max(sizes) - min(sizes) <= 2, sizes  # the count's digits only


def _dtensor_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # uneven: torch.chunk's cut
    sd = {
        "w": distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
        "r": distribute_tensor(full * 2, mesh, [Replicate(), Shard(0)]),
    }
    tierstore.save_sharded(sd, path)


def test_dtensor_placements_are_stored_as_rules(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "dt"
    run_world(4, _dtensor_save, str(d))
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
    assert m["tensors"]["w"]["rule"]["splits"] == [[0, 2, "chunk", 0], [1, 2, "chunk", 0]]
    assert m["tensors"]["r"]["rule"]["replicated"]
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    out = {"w": torch.zeros(7, 5), "r": torch.zeros(7, 5)}
    tierstore.load_sharded(d, out)
    assert torch.equal(out["w"], full) and torch.equal(out["r"], full * 2)


def _save_rows(rank: int, world: int, path: str) -> None:
    lay = tp_row("row", SHAPES["row"], rank, world)
    tierstore.save_sharded({"row": attach(local(lay), lay)}, path)


def test_a_file_forged_to_hold_a_second_position_fails_on_a_checkpoint_opened_before(tmp_path: pathlib.Path) -> None:
    """manifest.json re-sealed to say that rank 1's file holds both positions
    of a rule. Each position a load reads is checked against what the file
    records, also when an earlier load from the same opened checkpoint (as a
    Checkpointer's restore makes several) already read the file's own
    position: the second load raises, it does not return rank 1's half as
    rank 0's."""
    from tierstore.errors import ManifestError
    from tierstore.shardmeta import Checkpoint

    d = tmp_path / "rows"
    run_world(2, _save_rows, str(d))
    mp = d / "manifest.json"
    m, _ = _metadata.loads(mp.read_bytes(), "m", required=True)
    grp = m["groups"][m["tensors"]["row"]["parts"][0][0]]
    assert grp["coords"] == [[0], [1]] and len(set(grp["files"])) == 2
    grp["files"] = [grp["files"][1], grp["files"][1]]
    mp.write_bytes(_metadata.dumps(m))

    ck = Checkpoint(d)
    lay1 = tp_row("row", SHAPES["row"], 1, 2)
    half = {"row": attach(torch.zeros(lay1.local_shape), lay1)}
    tierstore.load_sharded(ck, half)  # rank 1's own position, from rank 1's file: as saved
    assert torch.equal(half["row"], local(lay1))
    with pytest.raises(ManifestError, match=r"position \[0\] of the rule of 'row'"):
        tierstore.load_sharded(ck, {"row": torch.zeros(SHAPES["row"])})
    with pytest.raises(ManifestError, match=r"position \[0\] of the rule of 'row'"):
        tierstore.load_sharded(d, {"row": torch.zeros(SHAPES["row"])})
