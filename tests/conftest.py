"""Shared fixtures: the I/O backend matrix, helpers for subprocesses and mounts.

Tests that need root (a tmpfs mount, a remount, loop devices, ptrace) skip
through :func:`skip_for_privilege`, whose reason starts with
``PRIVILEGE_SKIP``; the terminal summary counts those skips in a line of its
own, so that a CI machine without root cannot drop them silently, and
``TIERSTORE_REQUIRE_ROOT_TESTS=1`` turns each of them into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

import tierstore
from tierstore import _core

BACKENDS = ["io_uring", "threads", "buffered"]

PRIVILEGE_SKIP = "needs root: "
REQUIRE_ROOT_ENV = "TIERSTORE_REQUIRE_ROOT_TESTS"


def skip_for_privilege(why: str) -> NoReturn:
    """Skips a test that cannot run without root (or fails it when
    ``TIERSTORE_REQUIRE_ROOT_TESTS=1``); counted in the terminal summary."""
    msg = f"{PRIVILEGE_SKIP}{why}"
    if os.environ.get(REQUIRE_ROOT_ENV, "") not in ("", "0"):
        pytest.fail(f"{msg} ({REQUIRE_ROOT_ENV} is set)", pytrace=False)
    pytest.skip(msg)


def _skip_reason(rep: pytest.TestReport) -> str:
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line counting the tests skipped for lack of privilege, in red."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _skip_reason(r).startswith(PRIVILEGE_SKIP)]
    if not skipped:
        return
    terminalreporter.write_sep(
        "!",
        f"{len(skipped)} test(s) SKIPPED FOR LACK OF PRIVILEGE (run as root, or set {REQUIRE_ROOT_ENV}=1 to fail)",
        red=True,
        bold=True,
    )
    for r in skipped:
        terminalreporter.write_line(f"  {r.nodeid}: {_skip_reason(r)}")


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
        skip_for_privilege(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
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
