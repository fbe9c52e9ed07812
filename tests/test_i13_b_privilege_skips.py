"""Tests that need root skip loudly: the terminal summary counts them.

The tmpfs fixture, the read-only remount of ``test_errors.py`` and the
throttled loop devices of ``test_offload.py`` skip through
``conftest.skip_for_privilege``; the summary then prints a line of its own
with their number and names, and ``TIERSTORE_REQUIRE_ROOT_TESTS=1`` makes
them fail (for CI on a machine where they must run). Lack of privilege is
simulated here by a ``mount`` on ``PATH`` that refuses, as it does for a user
without root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

_TINY = """
from conftest import skip_for_privilege


def test_needs_root():
    skip_for_privilege("a loop device")


def test_plain_skip():
    import pytest

    pytest.skip("not about privilege")


def test_runs():
    pass
"""


def _pytest(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.pop("TIERSTORE_REQUIRE_ROOT_TESTS", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _tiny_suite(tmp_path: Path) -> Path:
    d = tmp_path / "suite"
    d.mkdir()
    shutil.copy(HERE / "conftest.py", d / "conftest.py")
    (d / "test_tiny.py").write_text(_TINY)
    return d


def test_summary_counts_privilege_skips_only(tmp_path: Path) -> None:
    d = _tiny_suite(tmp_path)
    r = _pytest(["--rootdir", str(d), str(d)], d)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "SKIPPED FOR LACK OF PRIVILEGE" in ln]
    assert len(lines) == 1 and " 1 test(s) SKIPPED" in lines[0], r.stdout
    assert "test_tiny.py::test_needs_root: needs root: a loop device" in r.stdout
    assert "test_plain_skip: " not in r.stdout.split("SKIPPED FOR LACK OF PRIVILEGE")[1].split("short test summary")[0]


def test_required_root_tests_fail_when_asked(tmp_path: Path) -> None:
    d = _tiny_suite(tmp_path)
    r = _pytest(["--rootdir", str(d), str(d)], d, {"TIERSTORE_REQUIRE_ROOT_TESTS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed" in r.stdout and "TIERSTORE_REQUIRE_ROOT_TESTS is set" in r.stdout, r.stdout


def test_tmpfs_and_remount_skips_are_counted(tmp_path: Path) -> None:
    # The repository's own root-only tests, where mount is refused.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mount").write_text("#!/bin/sh\necho 'mount: only root can do that' >&2\nexit 32\n")
    (fake / "mount").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = _pytest([str(HERE / "test_errors.py"), "-k", "read_only_directory or full_disk"], HERE.parent, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 test(s) SKIPPED FOR LACK OF PRIVILEGE" in r.stdout, r.stdout
    assert "test_read_only_directory: needs root: cannot mount a tmpfs here" in r.stdout, r.stdout
