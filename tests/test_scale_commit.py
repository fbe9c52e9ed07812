"""The sharded commit at scale (issue 16, item 1): no rank's metadata is sent
to every rank. What a rank other than 0 sends and receives while saving
depends on what it holds, not on the number of ranks; collectives are
counted on real processes (gloo over loopback)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import _dist
from tierstore.layout import Layout, attach


def _save_job(rank: int, world: int, path: str) -> dict[str, Any]:
    # Each rank: one row shard of a tensor and a ZeRO-style flat range of
    # another, a replicated tensor and an object (per-rank state is the same
    # size whatever the world size).
    rows = 4
    w = attach(torch.full((rows, 8), float(rank)), Layout.shard("w", (rows * world, 8), dim=0, rank=rank, world=world))
    n = 16
    flat = attach(torch.arange(n, dtype=torch.float32) + rank * n, Layout.flat("f", (world, n), rank * n, n))
    state = {"w": w, "f": flat, "bias": torch.ones(8), "step": 3}
    with _dist.traffic() as t:
        tierstore.save_sharded(state, path)
    return {"sent": t.sent, "received": t.received, "steps": [s[0] for s in t.steps]}


@pytest.mark.parametrize("world", [2, 4])
def test_non_zero_ranks_send_and_receive_what_they_hold(tmp_path: pathlib.Path, world: int) -> None:
    out = run_world(world, _save_job, str(tmp_path / f"ck{world}"))
    steps = out[1]["steps"]
    assert "all_gather" not in steps and steps.count("gather") == 2, steps
    for r in range(1, world):
        assert out[r]["received"] < 600, out[r]  # its writer decisions, the save id, the outcome
        assert out[r]["sent"] < 4000, out[r]
    # Rank 0 receives every rank's part once.
    assert out[0]["received"] >= sum(out[r]["sent"] for r in range(1, world))
    sd = {"w": torch.zeros(4 * world, 8), "f": torch.zeros(world, 16), "bias": torch.zeros(8), "step": None}
    tierstore.load_sharded(tmp_path / f"ck{world}", sd)
    assert torch.equal(sd["w"][4:8], torch.ones(4, 8)) and sd["step"] == 3
    assert torch.equal(sd["f"].flatten(), torch.arange(16 * world, dtype=torch.float32))


def test_doubling_the_ranks_doubles_nothing_a_rank_receives(tmp_path: pathlib.Path) -> None:
    small = run_world(2, _save_job, str(tmp_path / "a"))
    large = run_world(4, _save_job, str(tmp_path / "b"))
    # Same per-rank state: what rank 1 receives is the same size (within a few
    # bytes of integers that grow with the rank number).
    assert abs(large[1]["received"] - small[1]["received"]) <= 16
    assert large[3]["received"] <= small[1]["received"] + 16
    assert abs(large[1]["sent"] - small[1]["sent"]) <= 64


def _fail_job(rank: int, world: int, path: str) -> str:
    # The pieces leave rows 4..8 of "w" uncovered: rank 0 refuses the commit
    # and every rank raises the same error (none waits forever).
    w = attach(torch.ones(2, 8), Layout.block("w", (8, 8), (2 * rank, 0), (2, 8)))
    try:
        tierstore.save_sharded({"w": w}, path)
    except tierstore.CoverageError as e:
        return str(e)
    return "no error"


def test_a_refused_commit_is_raised_on_every_rank(tmp_path: pathlib.Path) -> None:
    out = run_world(2, _fail_job, str(tmp_path / "c"), timeout=60)
    assert all("'w'" in o for o in out), out
    assert not (tmp_path / "c" / "manifest.json").exists()


def _agree_job(rank: int, world: int) -> tuple[bool, bool, Any, int]:
    with _dist.traffic() as t:
        both = _dist.all_true(True, world, None)
        one = _dist.all_true(rank != 1, world, None)
        b = _dist.broadcast({"from": rank}, world, None)
    return both, one, b, t.received


def test_agreement_is_one_integer_and_broadcast_comes_from_rank_0() -> None:
    out = run_world(3, _agree_job)
    assert [o[:3] for o in out] == [(True, False, {"from": 0})] * 3
    assert out[2][3] < 100
