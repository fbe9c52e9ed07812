"""`make demo` is one of the README's two commands: a small run of it must
finish, pass its own checks and print no warnings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_demo_runs_its_checks_and_prints_no_warnings(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.run(
        [sys.executable, "-m", "tierstore.demo", "--layers", "1", "--width", "64", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for check in (
        "identical tensors in all four loads: yes",
        "tied weights still share one storage after tierstore.load: yes",
        "shards equal the full tensors: yes",
        "parameters equal to AdamW in memory after every step: yes",
        "2 more steps equal AdamW in memory: yes",
    ):
        assert check in out, f"{check!r} missing from the demo's output:\n{out}"
    assert "NO" not in out.split(), out
    # What a checkpoint costs the loop, by the loop's clock, for each method.
    assert "what it costs the training loop" in out, out
    for method in ("no checkpoint", "torch.save + fsync", "DCP async_save", "tierstore.Checkpointer"):
        assert method in out, out
    assert "Warning" not in p.stderr and "Warning" not in out, p.stderr
