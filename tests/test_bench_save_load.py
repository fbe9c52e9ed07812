"""The save/load benchmark's device counters (benches/saveload_child.py):
the requests the file's block device served, read from /proc/diskstats,
move with real I/O to that device."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

import saveload_child  # noqa: E402


def test_device_counts_follow_a_durable_write(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "f.bin"
    before = saveload_child.device_counts(p)  # the file does not exist yet: its folder's device
    if before is None:
        pytest.skip(f"{tmp_path} is on no block device in /proc/diskstats")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, os.urandom(1 << 20))
        os.fsync(fd)
    finally:
        os.close(fd)
    after = saveload_child.device_counts(p)
    assert after is not None
    writes, written = after[2] - before[2], after[3] - before[3]
    assert writes >= 1 and written >= 1 << 20  # the MiB reached the device, in at least one request
    assert after[0] >= before[0] and after[1] >= before[1]  # counters only grow


def test_the_fresh_memory_floor_populates_every_page(tmp_path: pathlib.Path) -> None:
    """The floor the bench prints beside the loads' CPU: a child run of
    ``"op": "floor"`` maps the state's size of anonymous memory and populates
    it, so the kernel faults in at least every huge page of it (every 4 KiB
    page where the mapping gets ordinary pages)."""
    import json
    import subprocess

    job = {"op": "floor", "system": "floor", "file": str(tmp_path / "floor"), "dataset": "small",
           "small_count": 64, "large_gib": 0.01, "level": False}  # fmt: skip
    out = tmp_path / "floor.json"
    subprocess.run([sys.executable, str(ROOT / "benches" / "saveload_child.py"), json.dumps(job), str(out)], check=True)
    got = json.loads(out.read_text())
    want = saveload_child.spec_bytes(saveload_child.small_spec(64))
    assert got["bytes"] == want
    assert got["minor_faults"] >= want // (2 << 20)
    assert got["seconds"] > 0 and got["cpu_seconds"] >= 0
