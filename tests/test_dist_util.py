"""The multi-process harness retries a world only when gloo's rendezvous
failed before any job code ran, and never a failure of the job itself."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch.distributed as dist
from dist_util import run_world


def _rank(rank: int, world: int) -> int:
    return rank


def _fails(rank: int, world: int, log: str) -> None:
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError(f"job failure on rank {rank}")


def test_a_rendezvous_failure_is_retried_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = dist.init_process_group

    def flaky(*a: Any, **k: Any) -> None:
        marker = tmp_path / f"failed-{k['rank']}"
        if not marker.exists():  # every rank fails its first rendezvous
            marker.touch()
            raise RuntimeError("Gloo connectFullMesh failed (simulated)")
        real(*a, **k)

    monkeypatch.setattr(dist, "init_process_group", flaky)  # the forked ranks inherit it
    assert run_world(2, _rank) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed-0", "failed-1"]


def test_a_rendezvous_that_keeps_failing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **k: Any) -> None:
        raise RuntimeError("Gloo connectFullMesh failed (simulated, every time)")

    monkeypatch.setattr(dist, "init_process_group", broken)
    with pytest.raises(AssertionError, match="rendezvous"):
        run_world(2, _rank)


def test_a_job_failure_is_never_retried(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "runs"
    with pytest.raises(AssertionError, match="job failure"):
        run_world(2, _fails, str(log))
    assert sorted(log.read_text().split()) == ["0", "1"], "each rank ran the job once"
