"""Crash and interrupt behaviour of saves: SIGKILL at random moments, Ctrl-C."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import BACKENDS, _available

import tierstore

CHILD = r"""
import sys, torch, tierstore
path, backend = sys.argv[1], sys.argv[2]
tierstore.configure(backend)
new = {"w": torch.full((48 << 20,), 2.0), "tag": "new"}  # 192 MiB: a save takes a while
print("ready", flush=True)
tierstore.save(new, path)
print("saved", flush=True)
while True:
    tierstore.save(new, path)
"""

MIN_WRITTEN = 16 << 20  # a kill "during the save" comes after this much of the new data is on disk


def _stop_during_first_save(proc: subprocess.Popen[str], d: pathlib.Path, old_inode: int) -> bool:
    """Waits until the child's first save has written part of its data into
    its temporary file, then stops the child (SIGSTOP) and tells whether it
    stopped before the commit: the temporary file still there, the old file
    not yet replaced."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for name in os.listdir(d):
            if "tierstore-tmp" in name:
                try:
                    written = os.stat(d / name).st_blocks * 512
                except FileNotFoundError:  # renamed or removed meanwhile
                    continue
                if written >= MIN_WRITTEN:
                    proc.send_signal(signal.SIGSTOP)
                    tmp_left = any("tierstore-tmp" in x.name for x in d.iterdir())
                    assert (d / "ckpt.pt").exists(), "the old file is gone while the new one is being written"
                    return tmp_left and (d / "ckpt.pt").stat().st_ino == old_inode
    return False


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sigkill_leaves_old_or_new_file(tmp_path: pathlib.Path, backend_name: str) -> None:
    """SIGKILL (a process crash; not a power loss) during a save leaves the
    old file, after its commit the new one, at a random moment one or the
    other, never a mixture. Kills of each kind are made to happen: at a
    point in the middle of the first save's writes (the child stopped there
    first, to see that it is before the commit), after the first save
    returned, and at random moments; both outcomes must be seen."""
    if not _available(backend_name):
        pytest.skip("io_uring unavailable")
    rng = random.Random(1234)
    p = tmp_path / "ckpt.pt"
    old = {"w": torch.full((1000,), 1.0), "tag": "old"}
    plan = ["during", "during", "after", "random", "random", "random"]
    outcomes: dict[str, list[str]] = {k: [] for k in set(plan)}
    stops_missed = 0
    for kind in plan:
        tierstore.save(old, p)
        old_inode = p.stat().st_ino
        with subprocess.Popen(
            [sys.executable, "-c", CHILD, str(p), backend_name], stdout=subprocess.PIPE, text=True
        ) as proc:
            try:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready"
                if kind == "during":
                    before_commit = _stop_during_first_save(proc, tmp_path, old_inode)
                    if not before_commit:  # the save committed before the stop landed: it counts as random
                        stops_missed += 1
                        kind = "random"
                elif kind == "after":
                    assert proc.stdout.readline().strip() == "saved"
                else:
                    time.sleep(rng.uniform(0.0, 0.6))
            finally:
                proc.send_signal(signal.SIGKILL)  # also a child stopped by a failed check
                proc.wait()
        back = tierstore.load(p)
        assert back["tag"] in ("old", "new"), "the file is the old one or the new one, never a mixture"
        want = 1.0 if back["tag"] == "old" else 2.0
        assert bool((back["w"] == want).all())
        outcomes[kind].append(back["tag"])
        # The next completed save removes what the killed process left behind.
        tierstore.save(old, p)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt.pt"]
    assert stops_missed < 2, "no kill landed in the middle of a save"
    assert set(outcomes["during"]) == {"old"}, outcomes  # killed before its commit: the old file
    assert set(outcomes["after"]) == {"new"}, outcomes  # killed after a save returned: the new file
    seen = {tag for tags in outcomes.values() for tag in tags}
    assert seen == {"old", "new"}, outcomes


INTERRUPT_CHILD = r"""
import signal, sys, time, torch, tierstore
path = sys.argv[1]
state = {"w": torch.randn(256 << 20)}  # 1 GiB: each save takes a while
t0 = time.time()
tierstore.save(state, path)
print("ready", time.time() - t0, flush=True)
handled = []


def on_sigint(signum, frame):  # Python's own handler, which also notes when it ran
    handled.append(time.time())
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, on_sigint)
try:
    while True:
        print("saving", flush=True)
        tierstore.save(state, path)
except KeyboardInterrupt:
    print("interrupted", handled[0], time.time(), flush=True)
"""


def test_ctrl_c_interrupts_promptly_and_leaves_no_partial_file(tmp_path: pathlib.Path) -> None:
    """Ctrl-C a fifth of the way into a save reaches Python code within a
    tenth of the time a whole save takes (measured by the child on a save of
    the same state first) and the save raises KeyboardInterrupt, its
    temporary file removed, within half of it: a save that finished first
    would take some 0.8 of it. No temporary file is left."""
    p = tmp_path / "big.pt"
    with subprocess.Popen([sys.executable, "-c", INTERRUPT_CHILD, str(p)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready and ready[0] == "ready", ready
        took = float(ready[1])
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(took / 5)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        proc.wait(timeout=60)
    assert line and line[0] == "interrupted", line
    handled, raised = float(line[1]) - sent, float(line[2]) - sent
    facts = (
        f"handler {handled:.3f} s and KeyboardInterrupt {raised:.3f} s after Ctrl-C; a whole save takes {took:.2f} s"
    )
    assert handled < 0.1 * took, facts
    assert raised < 0.5 * took, facts
    names = [x.name for x in tmp_path.iterdir()]
    assert names == ["big.pt"], names  # the first save's file, no temporary file
    assert tierstore.load(p, mmap=True)["w"].numel() == 256 << 20  # whole


def test_durable_false_still_atomic(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x.pt"
    tierstore.save({"a": torch.ones(3)}, p, durable=False)
    assert torch.equal(tierstore.load(p)["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["x.pt"]
