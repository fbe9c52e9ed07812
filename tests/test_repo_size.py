"""The repository holds code, docs and small fixtures, never a benchmark's
output: a stop whose commits add a multi-GB scratch file is refused whole
(a stop was lost that way), so a large tracked file fails here first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4 << 20  # the largest file the repository needs is well under 1 MiB


def test_no_tracked_file_is_large() -> None:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    big = []
    for name in r.stdout.decode().split("\0"):
        p = ROOT / name
        if name and p.is_file() and not p.is_symlink() and p.stat().st_size > LIMIT:
            big.append(f"{name} ({p.stat().st_size / 2**20:.0f} MiB)")
    assert not big, f"tracked files over {LIMIT >> 20} MiB (scratch output? add it to .gitignore): {big}"
