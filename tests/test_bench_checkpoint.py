"""The checkpoint benchmark's reference modes (benches/bench_checkpoint.py)
on a short loop: the floor modes do the work they are named for, each
checkpoint is timed, and what they write is removed."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from bench_util import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _child(mode: str, d: pathlib.Path) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benches" / "bench_checkpoint.py"),
            "--child",
            "--workload",
            "mlp",
            "--mode",
            mode,
            "--steps",
            "8",
            "--every",
            "4",
            "--paired",
            "1",
            "--threads",
            "1",
            "--dir",
            str(d),
            "--fast-dir",
            str(d),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["floor checksum", "floor capture", "floor write"])
def test_floor_modes_time_each_checkpoint_and_leave_nothing(mode: str, tmp_path: pathlib.Path) -> None:
    r = _child(mode, tmp_path)
    assert r["mode"] == mode
    # Steps 4 (the one checkpoint of an 8-step loop, 4 steps before its end).
    assert [p["step"] for p in r["per_checkpoint"]] == [4]
    done = r["per_checkpoint"][0]["to_local"]
    assert math.isfinite(done) and done > 0, r["per_checkpoint"]
    assert len(r["paired"]["lost_s"]) == 1
    assert "steal_s" in r
    assert list(tmp_path.iterdir()) == [], "the run's files were not removed"


def test_floor_write_writes_the_state_with_o_direct(tmp_path: pathlib.Path) -> None:
    """``_write_direct`` writes exactly the page-aligned bytes of the buffer."""
    import torch

    mod = load_bench("bench_checkpoint")
    n = 3 * 4096 + 4096  # three pages of data past the first page boundary
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8)
    p = tmp_path / "x.bin"
    mod._write_direct(buf, n, p)
    base = -buf.data_ptr() % 4096
    assert p.read_bytes() == bytes(buf.numpy()[base : base + n - 4096])
