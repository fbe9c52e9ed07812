"""Machine-wide device turns for processes without an offloaded optimizer
(tierstore.take_turns and TIERSTORE_TAKE_TURNS)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_one_house import _blocked_while_held, _lock

import tierstore


def test_take_turns_makes_saves_and_loads_wait_for_other_processes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(1 << 16)}
    tierstore.save(state, data / "a.pt")
    writes = [_lock(data, "w", i) for i in range(2)]
    reads = [_lock(data, "r", i) for i in range(2)]
    blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "b.pt"))
    assert not blocked, "without turns nothing waits for the lock files"
    with tierstore.take_turns(data) as share:
        assert tierstore.take_turns(data) is share, "one set of turns per device"
        blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "c.pt"))
        assert blocked, "a save ran while another process held every write turn at the device"
        blocked, _ = _blocked_while_held(reads, lambda: tierstore.save(state, data / "d.pt"))
        assert not blocked, "a save waited for read turns (duplex: reads and writes have their own)"
        got: dict[str, torch.Tensor] = {}
        blocked, _ = _blocked_while_held(reads, lambda: got.update(tierstore.load(data / "a.pt")))
        assert blocked, "a load ran while another process held every read turn"
        assert torch.equal(got["w"], state["w"])
        assert share.lock_wait_s > 0.5
    assert not share.active
    blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "e.pt"))
    assert not blocked, "turns given up: nothing waits"
    for n in "bcde":
        assert torch.equal(tierstore.load(data / f"{n}.pt")["w"], state["w"])


def test_simplex_turns_make_a_save_wait_for_read_turns(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(1 << 12)}
    # One lane for both directions (the engine's read lane): a save waits for read turns.
    with tierstore.take_turns(data, duplex=False, device_slots=1):
        lock = [_lock(data, "r", 0)]
        blocked, _ = _blocked_while_held(lock, lambda: tierstore.save(state, data / "x.pt"))
        assert blocked


def test_turns_from_the_environment(tmp_path: Path) -> None:
    """TIERSTORE_TAKE_TURNS registers the turns when the engine starts, with
    no code change: a child's save waits while the lock files are held."""
    data = tmp_path / "data"
    data.mkdir()
    script = (
        "import sys, time, torch, tierstore\n"
        "tierstore.get_engine()\n"
        "print('start', flush=True)\n"
        "t0 = time.perf_counter()\n"
        "tierstore.save({'w': torch.ones(8)}, sys.argv[1])\n"
        "print(time.perf_counter() - t0, flush=True)\n"
    )
    hold = (
        "import fcntl, os, sys\n"
        + "".join(
            f"fcntl.flock(os.open({f!r}, os.O_RDWR | os.O_CREAT, 0o666), fcntl.LOCK_EX)\n"
            for f in [_lock(data, "w", i) for i in range(2)]
        )
        + "print('held', flush=True)\nsys.stdin.readline()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    env = {**os.environ, "TIERSTORE_TAKE_TURNS": str(data)}
    try:
        assert holder.stdout.readline().strip() == "held"
        child = subprocess.Popen(
            [sys.executable, "-c", script, str(data / "y.pt")], env=env, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "start"
        time.sleep(1.0)
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    took = float(child.stdout.readline().strip())
    child.stdout.close()
    assert child.wait(timeout=60) == 0
    assert took > 0.8, "the save did not wait for the turns the environment asked for"
    env = {**os.environ, "TIERSTORE_TAKE_TURNS": str(tmp_path / "missing")}
    bad = subprocess.run([sys.executable, "-c", script, str(data / "z.pt")], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "TIERSTORE_TAKE_TURNS" in bad.stderr


def test_take_turns_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(tierstore.InvalidArgumentError):
        tierstore.take_turns(tmp_path, device_slots=0)
    with pytest.raises(tierstore.NotFoundError):
        tierstore.take_turns(tmp_path / "nope")
