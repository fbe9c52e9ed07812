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
new = {"w": torch.full((48 << 20,), 2.0), "tag": "new"}
print("ready", flush=True)
while True:
    tierstore.save(new, path)
"""


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sigkill_leaves_old_or_new_file(tmp_path: pathlib.Path, backend_name: str) -> None:
    if not _available(backend_name):
        pytest.skip("io_uring unavailable")
    rng = random.Random(1234)
    p = tmp_path / "ckpt.pt"
    old = {"w": torch.full((1000,), 1.0), "tag": "old"}
    outcomes = set()
    for _ in range(6):
        tierstore.save(old, p)
        with subprocess.Popen(
            [sys.executable, "-c", CHILD, str(p), backend_name], stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        back = tierstore.load(p)
        assert back["tag"] in ("old", "new"), "the file is the old one or the new one, never a mixture"
        want = 1.0 if back["tag"] == "old" else 2.0
        assert bool((back["w"] == want).all())
        outcomes.add(back["tag"])
        # The next completed save removes what the killed process left behind.
        tierstore.save(old, p)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt.pt"]


INTERRUPT_CHILD = r"""
import sys, time, torch, tierstore
path = sys.argv[1]
state = {"w": torch.randn(160 << 20)}  # 640 MiB: each save takes a while
print("ready", flush=True)
try:
    while True:
        tierstore.save(state, path)
except KeyboardInterrupt:
    print("interrupted", time.time(), flush=True)
"""


def test_ctrl_c_interrupts_promptly_and_leaves_no_partial_file(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "big.pt"
    with subprocess.Popen([sys.executable, "-c", INTERRUPT_CHILD, str(p)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        proc.wait(timeout=30)
    assert line and line[0] == "interrupted"
    assert float(line[1]) - sent < 1.0, "KeyboardInterrupt within a second of Ctrl-C"
    names = [x.name for x in tmp_path.iterdir()]
    assert all("tierstore-tmp" not in n for n in names), names
    if names:  # a save that completed before the interrupt is whole
        assert tierstore.load(p)["w"].numel() == 160 << 20


def test_durable_false_still_atomic(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x.pt"
    tierstore.save({"a": torch.ones(3)}, p, durable=False)
    assert torch.equal(tierstore.load(p)["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["x.pt"]
