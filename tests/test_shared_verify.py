"""``load_sharded(..., verify="shared")``: the chunks a rank needs only part
of are proven with the pieces the other ranks read, on real processes over
gloo, with real files; damage is still reported by every rank that needs it,
and a rank that fails early leaves no other rank waiting."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import ChecksumError, Layout, attach

ROWS, COLS = 96, 1280  # rows of 5,120 bytes: a 512-byte chunk at each edge of a column shard's 1,280


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(ROWS, COLS, generator=g)


NAMES = ("a", "b")


def save_job(rank: int, world: int, path: str) -> None:
    sd = {n: attach(full(n).chunk(world)[rank].clone(), Layout.shard(n, (ROWS, COLS), 0, rank, world)) for n in NAMES}
    tierstore.save_sharded(sd, path)


def load_job(rank: int, world: int, path: str, verify: Any, tp: int) -> dict[str, int]:
    """Column shards over ``tp`` ranks (``world // tp`` replicas of each)."""
    t = rank % tp
    sd = {n: attach(torch.zeros(ROWS, COLS // tp), Layout.shard(n, (ROWS, COLS), 1, t, tp)) for n in NAMES}
    stats: dict[str, int] = {}
    tierstore.load_sharded(path, sd, verify=verify, stats=stats)
    for n in NAMES:
        assert torch.equal(sd[n], full(n).chunk(tp, dim=1)[t]), n
    return stats


@pytest.fixture(scope="module")
def rows_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("shared") / "ckpt")
    run_world(4, save_job, path)
    return path


def test_column_shards_read_only_their_bytes_and_are_verified(rows_ckpt: str) -> None:
    shared = run_world(4, load_job, rows_ckpt, "shared", 4)
    touched = run_world(4, load_job, rows_ckpt, "touched", 4)
    for s, t in zip(shared, touched, strict=True):
        need = s["bytes_needed"]
        # Alone, a rank reads every chunk it touches whole: each 1,280-byte
        # slice of a row touches three 512-byte chunks (1,536 bytes).
        assert t["bytes_read"] == pytest.approx(1.2 * need, rel=0.01), t
        assert t["bytes_verified"] == t["bytes_read"], t
        # Together, each reads its own bytes (within a few partial pages) ...
        assert s["bytes_read"] <= 1.1 * need, s
        # ... and every one of them is covered by a checksum that matched.
        assert s["bytes_verified"] >= need, s


def test_replicas_of_a_shard_prove_their_chunks_too(rows_ckpt: str) -> None:
    # TP 2 x 2 replicas: two ranks read the same spans; a duplicate is proven with its twin.
    for s in run_world(4, load_job, rows_ckpt, "shared", 2):
        assert s["bytes_read"] <= 1.1 * s["bytes_needed"], s
        assert s["bytes_verified"] >= s["bytes_needed"], s


def test_one_rank_is_the_same_as_touched(rows_ckpt: str) -> None:
    sd = {n: torch.zeros(ROWS, COLS) for n in NAMES}
    stats: dict[str, int] = {}
    tierstore.load_sharded(rows_ckpt, sd, verify="shared", stats=stats)
    for n in NAMES:
        assert torch.equal(sd[n], full(n))
    assert stats["bytes_verified"] == stats["bytes_read"] >= stats["bytes_needed"]


def damaged_job(rank: int, world: int, path: str, verify: str) -> str:
    try:
        load_job(rank, world, path, verify, world)
    except ChecksumError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("verify", ["shared", "touched"])
def test_damage_is_reported_by_every_rank_that_needs_the_chunk(
    rows_ckpt: str, tmp_path: pathlib.Path, verify: str
) -> None:
    import shutil

    path = tmp_path / "damaged"
    shutil.copytree(rows_ckpt, path)
    rows = full("a").chunk(4)[1].numpy().tobytes()  # rank 1's rows of "a", as saved
    data, at = next(
        (p, p.read_bytes().find(rows)) for p in sorted(path.rglob("*")) if rows in p.read_bytes()[: 1 << 24]
    )
    # One bit of row 5, byte 1,100: in column shard 0's bytes, in chunk 52
    # ([26,624, 27,136) of the record: bytes 1,024 to 1,536 of the row), which
    # column shards 0 and 1 share; shards 2 and 3 never touch it.
    with open(data, "r+b") as f:
        f.seek(at + 5 * 5120 + 1100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    errors = run_world(4, damaged_job, str(path), verify)
    for e in errors[:2]:
        assert data.name in e and "record 'rank-00001" in e and "(chunk 52;" in e, e
    assert errors[2:] == ["no error", "no error"], errors


def early_failure_job(rank: int, world: int, path: str) -> str:
    if rank == 1:  # asks for a tensor the checkpoint does not hold: fails in planning, before any read
        sd = {"nope": attach(torch.zeros(4, 4), Layout.shard("nope", (16, 4), 0, 1, world))}
        try:
            tierstore.load_sharded(path, sd, verify="shared")
        except tierstore.TierstoreError as e:
            return type(e).__name__
        return "no error"
    load_job(rank, world, path, "shared", world)
    return "loaded"


def test_a_rank_that_fails_early_leaves_no_rank_waiting(rows_ckpt: str) -> None:
    got = run_world(4, early_failure_job, rows_ckpt, timeout=60)
    assert got[1] != "no error" and got[1] != "loaded"
    assert [got[r] for r in (0, 2, 3)] == ["loaded"] * 3


def broken_rank_job(rank: int, world: int, path: str, where: str) -> str:
    """Rank 1 fails inside the load: while reading (an error no TierstoreError
    wraps, or an interrupt) or while proving the other ranks' pieces."""
    if rank == 1:
        import tierstore._sharded_read as sr
        from tierstore import _core

        def boom(*_a: Any, **_k: Any) -> Any:
            raise KeyboardInterrupt if where == "interrupt" else RuntimeError("injected")

        if where == "prove":
            _core.prove_pieces = boom  # type: ignore[attr-defined]
        else:
            sr.read_plan = boom  # type: ignore[assignment]
        try:
            load_job(rank, world, path, "shared", world)
        except (RuntimeError, KeyboardInterrupt) as e:
            return type(e).__name__
        return "no error"
    load_job(rank, world, path, "shared", world)  # checks its bytes
    return "loaded"


@pytest.mark.parametrize("where", ["read", "interrupt", "prove"])
def test_a_rank_that_fails_mid_load_leaves_no_rank_waiting(rows_ckpt: str, where: str) -> None:
    got = run_world(4, broken_rank_job, rows_ckpt, where, timeout=60)
    assert got[1] == ("KeyboardInterrupt" if where == "interrupt" else "RuntimeError")
    assert [got[r] for r in (0, 2, 3)] == ["loaded"] * 3
