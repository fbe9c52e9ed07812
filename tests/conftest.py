"""Shared fixtures: the I/O backend matrix, helpers for subprocesses and mounts."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import _core

BACKENDS = ["io_uring", "threads", "buffered"]


def _available(backend: str) -> bool:
    return backend != "io_uring" or _core.io_uring_status()[0]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per I/O backend (io_uring, pread/pwrite threads, buffered)."""
    name = request.param
    if not _available(name):
        pytest.skip(f"io_uring unavailable here: {_core.io_uring_status()[1]}")
    tierstore.configure(name, chunk_mib=1, pool_mib=8)
    yield name
    tierstore.configure(None)


def run_python(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    if env:
        e.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        check=False,
    )


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted under tmp_path (needs root; skipped otherwise)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def tensors_equal(a: object, b: object) -> bool:
    """Deep equality that compares tensors bitwise (NaNs included) and dtypes."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.numel() == 0:
            return True
        av = a.detach().cpu().contiguous().view(-1)
        bv = b.detach().cpu().contiguous().view(-1)
        if a.dtype == torch.bool:
            return torch.equal(av, bv)
        if a.element_size() == 1:
            return torch.equal(av.view(torch.uint8), bv.view(torch.uint8))
        return bool((av.view(torch.uint8) == bv.view(torch.uint8)).all())
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and type(a) is type(b)
            and list(a) == list(b)
            and all(tensors_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b
