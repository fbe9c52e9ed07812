"""The Checkpointer's background threads yield the CPU to training."""

from __future__ import annotations

import ast
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import _threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling classes")


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _policies(new_since: set[str] | None = None) -> dict[str, list[int]]:
    """Scheduling policy of the threads of this process (those started since
    ``new_since``, when given), by thread name."""
    out: dict[str, list[int]] = {}
    for tid in _tids() - (new_since or set()):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            out.setdefault(name, []).append(os.sched_getscheduler(int(tid)))
        except OSError:
            continue
    return out


def _save_one(tmp_path: Path, **kw: object) -> tuple[dict[str, list[int]], tierstore.Checkpointer]:
    model = torch.nn.Linear(64, 64)
    tierstore.get_engine()  # started before: its threads are not new
    before = _tids()
    ck = tierstore.Checkpointer(tmp_path / "run", **kw)  # type: ignore[arg-type]
    seen: dict[str, list[int]] = {}
    # Sample while a checkpoint is in flight and after: the threads live as long as the Checkpointer.
    ck.save(1, {"model": model.state_dict()})
    ck.wait()
    seen = _policies(before)
    return seen, ck


def test_background_threads_run_under_sched_idle_when_asked(tmp_path: Path) -> None:
    seen, ck = _save_one(tmp_path, priority="idle")
    try:
        for name in ("ts-capture", "ts-flush", "ts-promote"):
            assert set(seen.get(name, [])) == {os.SCHED_IDLE}, (name, seen)
        assert ck.priority_error is None
        # The training thread and the engine's I/O thread (which serves foreground loads) are untouched.
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        uring = [
            os.sched_getscheduler(int(t))
            for t in _tids()
            if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "tierstore-uring"
        ]
        assert set(uring) <= {os.SCHED_OTHER}, uring
        assert ck.load_latest()["model"]["weight"].shape == (64, 64)
    finally:
        ck.close()


def test_normal_priority_by_default_leaves_threads_alone(tmp_path: Path) -> None:
    seen, ck = _save_one(tmp_path)
    try:
        assert ck.priority == "normal"
        for name in ("ts-capture", "ts-flush", "ts-promote"):
            assert set(seen.get(name, [])) == {os.SCHED_OTHER}, (name, seen)
    finally:
        ck.close()


def test_low_priority_is_nice_19(tmp_path: Path) -> None:
    before = _tids()
    ck = tierstore.Checkpointer(tmp_path / "run", priority="low")
    try:
        ck.save(1, {"w": torch.ones(8)})
        ck.wait()
        nice: dict[str, int] = {}
        for tid in _tids() - before:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if name.startswith("ts-"):
                stat = Path(f"/proc/self/task/{tid}/stat").read_text()
                nice[name] = int(stat[stat.rindex(")") + 2 :].split()[16])
        assert set(nice) == {"ts-capture", "ts-flush", "ts-promote"} and set(nice.values()) == {19}, nice
    finally:
        ck.close()


def test_engine_threads_started_by_a_background_thread_inherit_its_class() -> None:
    """The flush's checksum and write workers are started from the flush
    thread: they must not come back at normal priority."""
    out: list[int] = []

    def body() -> None:
        assert _threads.lower_priority("idle") is None
        inner = threading.Thread(target=lambda: out.append(os.sched_getscheduler(0)))
        inner.start()
        inner.join()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out == [os.SCHED_IDLE]


def test_bad_priority_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="priority must be one of"):
        tierstore.Checkpointer(tmp_path / "run", priority="realtime")


def test_engine_started_by_a_checkpointer_keeps_normal_priority(tmp_path: Path) -> None:
    """The engine's I/O thread serves foreground loads too: a Checkpointer
    that is the first user of the engine must not start it at idle priority."""
    code = f"""
import os, torch, tierstore
from pathlib import Path
ck = tierstore.Checkpointer({str(tmp_path / "run")!r}, priority="idle")
ck.save(1, {{"w": torch.ones(1024)}})
ck.wait()
pol = [os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")
       if Path(f"/proc/self/task/{{t}}/comm").read_text().strip().startswith("tierstore-")]
ck.close()
print(pol)
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    pol = ast.literal_eval(out.strip().splitlines()[-1])
    assert pol and set(pol) == {os.SCHED_OTHER}, pol


def test_the_step_copies_what_the_capture_thread_has_not_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture thread that gets no core (idle class on a busy machine) does
    not stall the step: the step pre-hook copies the untaken tensors itself,
    and the checkpoint still holds the values as of save()."""
    from tierstore.checkpointer import Checkpointer

    gate = threading.Event()
    real = Checkpointer._capture_host

    def held(self: Checkpointer, snap: object) -> None:
        gate.wait(30)  # the capture thread gets no CPU until the step is done
        real(self, snap)  # type: ignore[arg-type]

    monkeypatch.setattr(Checkpointer, "_capture_host", held)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    ck = Checkpointer(tmp_path / "run")
    try:
        ck.attach(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(1, state)
        snap = ck._snaps[-1]
        model(torch.randn(8, 256)).sum().backward()
        opt.step()  # must not wait for the held capture thread
        assert not gate.is_set()
        assert snap.stolen == snap.n_mutable > 0
        assert not torch.equal(model[0].weight, expect["0.weight"])  # the step ran
        gate.set()
        ck.wait()
        got = ck.load_latest()
        for k, v in expect.items():
            assert torch.equal(got["model"][k], v), k
    finally:
        gate.set()
        ck.close()
