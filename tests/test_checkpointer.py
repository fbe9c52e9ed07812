"""The Checkpointer: lazy capture, the tier cascade, retention, restore with
fallback, bounded memory, backpressure, multi-rank commits and crashes."""

from __future__ import annotations

import os
import random
import resource
import selectors
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tensors_equal
from dist_util import run_world

import tierstore
from tierstore import _core
from tierstore.checkpointer import Checkpointer, DiskTier, HostTier, RemoteTier, TornSnapshotError, parse_size


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 8))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 64, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _tiers(tmp_path: Path, **kw: Any) -> list[Any]:
    return [
        HostTier(kw.pop("budget", "64MiB")),
        DiskTier("local", keep_last=kw.pop("keep_last", 3)),
        RemoteTier(str(tmp_path / "remote"), every=kw.pop("every", 1), keep_every=kw.pop("keep_every", None)),
    ]


def test_parse_size() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("lots")


def test_lazy_checkpoints_match_the_state_at_save(tmp_path: Path) -> None:
    """Training continues right after save(); the optimizer step waits for the
    capture, so every checkpoint holds the values as of its save call."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = {}
    with Checkpointer(tmp_path, tiers=_tiers(tmp_path), debug=True) as ck:
        ck.attach(opt)
        for step in range(5):
            _train_step(model, opt, step)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            expected[step] = type(state["model"])((k, v.clone()) for k, v in model.state_dict().items())
            h = ck.save(step, state)
            assert h.step == step
        ck.wait()
        assert all(h.state == "durable-remote" for h in ck.handles())
        h = ck.handles()[-1]
        assert {"blocked", "capture", "flush", "to_local", "to_remote"} <= set(h.timings)
        assert set(h.tiers) == {"host", "local", "remote"}
        # Nearest copy: host memory.
        got = ck.load_latest()
        assert ck.restored is not None and ck.restored["tier"] == "host" and ck.restored["step"] == 4
        assert tensors_equal(got["model"], expected[4])
    # A new process-like start: the disk tiers.
    ck2 = Checkpointer(tmp_path, tiers=_tiers(tmp_path))
    got = ck2.load_latest()
    assert ck2.restored is not None and ck2.restored["tier"] == "local" and ck2.restored["step"] == 4
    assert tensors_equal(dict(got["model"]), dict(expected[4]))
    assert got["step"] == 4
    opt2 = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    opt2.load_state_dict(got["optim"])  # the optimizer's own format comes back
    assert tensors_equal(opt2.state_dict()["state"], opt.state_dict()["state"])
    # The files are sharded checkpoints; each rank file is a torch zip.
    d = Path(ck2.restored["path"])
    assert (d / "manifest.json").exists()
    rank_file = next(d.glob("rank-00000.*.pt"))
    torch.load(rank_file, weights_only=True)
    ck2.close()


def test_capture_without_attach_needs_wait_capture(tmp_path: Path) -> None:
    t = torch.arange(4_000_000, dtype=torch.float32)
    with Checkpointer(tmp_path, tiers=[HostTier("64MiB"), DiskTier(".")]) as ck:
        ck.save(0, {"t": t})
        ck.wait_capture()
        t.add_(1)  # allowed now
        ck.wait()
        got = Checkpointer(tmp_path).load_latest()
    assert torch.equal(got["t"], torch.arange(4_000_000, dtype=torch.float32))


def test_debug_detects_a_tensor_changed_before_capture(tmp_path: Path) -> None:
    t = torch.zeros(8_000_000)
    ck = Checkpointer(tmp_path, tiers=[HostTier("64MiB"), DiskTier(".")], debug=True)
    h = ck.save(0, {"t": t})
    t.add_(1)  # the contract is broken: no wait_capture / attached step in between
    with pytest.raises(TornSnapshotError, match="modified before its capture"):
        ck.wait_capture()
    assert h.state == "failed"
    ck.save(1, {"t": t})
    ck.wait()
    ck.close()
    # The torn snapshot was never written; the good one was.
    steps = [c["step"] for c in Checkpointer(tmp_path).checkpoints()]
    assert steps == [1]


def test_attach_blocks_the_step_until_captured(tmp_path: Path) -> None:
    """A large parameter: the step must wait, and the saved value is pre-step."""
    p = torch.nn.Parameter(torch.randn(6_000_000))
    before = p.detach().clone()
    opt = torch.optim.SGD([p], lr=1.0)
    with Checkpointer(tmp_path, tiers=[HostTier("256MiB"), DiskTier(".")], debug=True) as ck:
        ck.attach(opt)
        ck.save(0, {"p": p.detach()})
        p.grad = torch.ones_like(p)
        opt.step()  # waits for the capture
        ck.wait()
        got = ck.load_latest()
    assert torch.equal(got["p"], before)
    assert not torch.equal(p.detach(), before)


def test_retention_and_garbage_collection(tmp_path: Path) -> None:
    tiers = [HostTier("16MiB"), DiskTier("local", keep_last=2), RemoteTier(str(tmp_path / "remote"), every=3)]
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        for step in range(0, 100, 10):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait()
        hs = ck.handles()
    local = sorted(p.name for p in (tmp_path / "local").iterdir())
    remote = sorted(p.name for p in (tmp_path / "remote").iterdir())
    assert local == ["step-000000000080", "step-000000000090"]
    # Every third checkpoint (ordinals 0, 3, 6, 9) went to the remote tier, which keeps all.
    assert remote == [f"step-{s:012d}" for s in (0, 30, 60, 90)]
    assert hs[1].tiers["remote"] == "skipped" and hs[3].tiers["remote"] == "durable"


def test_keep_every(tmp_path: Path) -> None:
    tiers = [HostTier("16MiB"), DiskTier("local", keep_last=1, keep_every=50)]
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        for step in range(0, 130, 10):
            ck.save(step, {"w": torch.zeros(10)})
        ck.wait()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [f"step-{s:012d}" for s in (0, 50, 100, 120)]


def _flip_byte_in_data(d: Path) -> None:
    f = next(d.glob("rank-00000.*.pt"))
    from ckpt_util import stored_tensors

    off = next(s for s in stored_tensors(d) if s["file"] == f)["offset"] + 100
    with open(f, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_damaged_local_copy_falls_back_to_remote(tmp_path: Path) -> None:
    w = torch.randn(100_000)
    with Checkpointer(tmp_path, tiers=_tiers(tmp_path)) as ck:
        ck.save(7, {"w": w})
        ck.wait()
    _flip_byte_in_data(tmp_path / "local" / "step-000000000007")
    ck2 = Checkpointer(tmp_path, tiers=_tiers(tmp_path))
    with pytest.warns(UserWarning, match=r"step 7 on tier 'local'.*checksum"):
        got = ck2.load_latest()
    assert ck2.restored is not None and ck2.restored["tier"] == "remote"
    assert torch.equal(got["w"], w)
    ck2.close()


def test_damaged_newest_falls_back_to_older(tmp_path: Path) -> None:
    tiers = [HostTier("16MiB"), DiskTier(".", keep_last=3)]
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((50_000,), float(step))})
        ck.wait()
    _flip_byte_in_data(tmp_path / "step-000000000002")
    ck2 = Checkpointer(tmp_path, tiers=tiers)
    with pytest.warns(UserWarning, match="step 2"):
        got = ck2.load_latest()
    assert ck2.restored is not None and ck2.restored["step"] == 1
    assert torch.equal(got["w"], torch.full((50_000,), 1.0))


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path).load_latest() is None


def test_budget_smaller_than_state_is_a_clear_error(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, tiers=[HostTier("1MiB"), DiskTier(".")])
    with pytest.raises(ValueError, match=r"host tier's budget"):
        ck.save(0, {"w": torch.zeros(1 << 20)})
    ck.close()


def test_backpressure_skip_and_wait(tmp_path: Path) -> None:
    state = {"w": torch.randn(2 << 20)}  # 8 MiB
    engine = tierstore.get_engine()
    try:
        # 4 MiB/s of background I/O: the first flush takes ~2 s (read+write counted).
        with Checkpointer(
            tmp_path / "a", tiers=[HostTier("12MiB"), DiskTier(".")], on_busy="skip", rate_limit="8MiB"
        ) as ck:
            h0 = ck.save(0, state)
            with pytest.warns(UserWarning, match="skipped"):
                h1 = ck.save(1, state)
            assert h1.state == "skipped"
            ck.wait()
            assert h0.state == "durable-local"
        engine.set_background_rate(0)
        with Checkpointer(tmp_path / "b", tiers=[HostTier("12MiB"), DiskTier(".")], on_busy="wait") as ck:
            hs = [ck.save(s, state) for s in range(3)]
            ck.wait()
            assert [h.state for h in hs] == ["durable-local"] * 3
            assert ck.stats()["host_peak"] <= 12 << 20
    finally:
        engine.set_background_rate(0)


def test_background_rate_limit_slows_flushes(tmp_path: Path) -> None:
    engine = tierstore.get_engine()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(12 << 20))
    try:
        t0 = time.perf_counter()
        n, _how = _core.copy_file(engine, src, tmp_path / "fast.bin", reflink=False)
        fast = time.perf_counter() - t0
        engine.set_background_rate(16 << 20)
        t0 = time.perf_counter()
        _core.copy_file(engine, src, tmp_path / "slow.bin", reflink=False)
        slow = time.perf_counter() - t0
        # A foreground copy is not held back.
        t0 = time.perf_counter()
        _core.copy_file(engine, src, tmp_path / "fg.bin", background=False, reflink=False)
        fg = time.perf_counter() - t0
    finally:
        engine.set_background_rate(0)
    assert n == 12 << 20
    assert (tmp_path / "slow.bin").read_bytes() == src.read_bytes() == (tmp_path / "fast.bin").read_bytes()
    assert slow >= 1.2, (fast, slow)  # 24 MiB moved at 16 MiB/s
    assert fg < slow / 2, (fg, slow)


def test_memory_is_flat_over_a_thousand_saves(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    root = Path(os.environ.get("TIERSTORE_TEST_FAST_DIR", shm if shm.is_dir() else tmp_path)) / f"ts-mem-{os.getpid()}"
    state = {"a": torch.randn(64, 1024), "b": torch.randn(1000), "step": 0}
    budget = 2 << 20
    rss: list[int] = []
    try:
        with Checkpointer(root, tiers=[HostTier(budget), DiskTier(".", keep_last=2)]) as ck:
            for step in range(1000):
                state["a"].add_(1)
                state["step"] = step
                ck.save(step, state)
                ck.wait_capture()
                if step in (100, 999):
                    ck.wait()
                    rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
                    assert ck.stats()["host_allocated"] <= budget
            ck.wait()
            got = ck.load_latest()
            assert got["step"] == 999 and torch.equal(got["a"], state["a"])
            assert len(ck.handles()) <= 256
        assert len(list(root.iterdir())) == 2
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    assert rss[1] - rss[0] < 64 << 10, rss  # KiB: no growth with the number of saves


def test_adaptive_interval_grows_with_blocking(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(tmp_path, tiers=[HostTier("64MiB"), DiskTier(".")], max_overhead=0.001)
    ck.attach(opt)
    big = torch.randn(4 << 20)  # capture of 16 MiB per save vs a tiny step
    saves = 0
    for step in range(40):
        _train_step(model, opt, step)
        if ck.due(step):
            ck.save(step, {"model": model.state_dict(), "big": big})
            ck.wait_capture()
            saves += 1
    ck.close()
    assert ck.interval > 1
    assert saves < 40


def test_full_local_disk_degrades_to_remote(tmpfs: Path, tmp_path: Path) -> None:
    tiers = [HostTier("64MiB"), DiskTier(str(tmpfs), keep_last=3), RemoteTier(str(tmp_path / "remote"))]
    w = torch.randn(2 << 20)  # 8 MiB: the second copy does not fit in 16 MiB
    with Checkpointer(tmp_path, tiers=tiers) as ck, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        hs = []
        for step in range(3):
            w.add_(1)
            hs.append(ck.save(step, {"w": w}))
            ck.wait_capture()
        ck.wait()
    assert any("could not be written to the 'local' tier" in str(r.message) for r in rec)
    assert all(h.tiers["remote"] == "durable" for h in hs)
    assert any(h.tiers["local"] == "failed" for h in hs)
    got = Checkpointer(tmp_path, tiers=tiers).load_latest()
    assert torch.equal(got["w"], w)


# ----------------------------------------------------------------------------------------------
# crashes

_CHILD = textwrap.dedent(
    """
    import sys, torch
    from tierstore.checkpointer import Checkpointer, HostTier, DiskTier, RemoteTier
    root, remote = sys.argv[1], sys.argv[2]
    tiers = [HostTier("64MiB"), DiskTier("local", keep_last=2), RemoteTier(remote, every=2, keep_last=3)]
    ck = Checkpointer(root, tiers=tiers)
    prev = ck.load_latest()
    start = 0 if prev is None else prev["step"] + 1
    print("start", start, flush=True)
    seen = {}
    for step in range(start, start + 100000):
        v = float(step)
        state = {"model": {"w": torch.full((256, 1024), v), "b": torch.arange(1000) + step}, "step": step}
        h = ck.save(step, state)
        seen[step] = h
        ck.wait_capture()
        for s, hh in list(seen.items()):
            if hh.state in ("durable-local", "durable-remote"):
                print("durable", s, flush=True)
                del seen[s]
            elif hh.settled():
                del seen[s]
    """
)


def _check_state(state: dict[str, Any]) -> None:
    step = state["step"]
    assert torch.equal(state["model"]["w"], torch.full((256, 1024), float(step)))
    assert torch.equal(state["model"]["b"], torch.arange(1000) + step)


def test_sigkill_at_random_moments_resumes_from_newest_complete(tmp_path: Path) -> None:
    rng = random.Random(1234)
    root, remote = tmp_path / "job", tmp_path / "remote"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    last_durable = -1
    for run in range(12):
        p = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root), str(remote)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("start"):
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"the child did not start: {line}{out}{err}")
        start = int(line.split()[1])
        assert start == last_durable + 1 or start > last_durable, (run, start, last_durable)
        deadline = time.monotonic() + rng.uniform(0.05, 1.5)
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = p.stdout.readline()
                if line.startswith("durable"):
                    last_durable = max(last_durable, int(line.split()[1]))
        sel.close()
        os.kill(p.pid, signal.SIGKILL)
        rest, _err = p.communicate()
        # Lines written before the kill still count (the last one may be cut
        # short: the kill can land between two writes of one print).
        for line in rest.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "durable" and parts[1].isdigit():
                last_durable = max(last_durable, int(parts[1]))
        ck = Checkpointer(root, tiers=[HostTier("64MiB"), DiskTier("local"), RemoteTier(str(remote))])
        state = ck.load_latest()
        if last_durable >= 0:
            assert state is not None, run
            assert state["step"] >= last_durable, (run, state["step"], last_durable)
            _check_state(state)
            last_durable = state["step"]
        ck.close()
    assert last_durable > 0


# ----------------------------------------------------------------------------------------------
# multi-rank


def _rank_job(rank: int, world: int, root: str, remote: str) -> list[str]:
    import torch

    from tierstore.layout import Layout, attach

    tiers = [HostTier("64MiB"), DiskTier("local"), RemoteTier(remote)]
    ck = Checkpointer(root, tiers=tiers)
    full = torch.arange(64 * 10, dtype=torch.float32).reshape(64, 10)
    states = []
    for step in range(3):
        rows = full[rank * 32 : (rank + 1) * 32] + step
        lay = Layout.block("w", (64, 10), (rank * 32, 0), (32, 10))
        state = {"w": attach(rows.clone(), lay), "step": step, "rng": tierstore.PerRank(rank * 100 + step)}
        states.append(ck.save(step, state))
        ck.wait_capture()
    ck.wait()
    out = [h.state for h in states]
    # Load back under the same layout with the 2 ranks.
    into = {"w": attach(torch.zeros(32, 10), Layout.block("w", (64, 10), (rank * 32, 0), (32, 10))), "step": None}
    ck.load_latest(into=into)
    assert torch.equal(into["w"], full[rank * 32 : (rank + 1) * 32] + 2)
    assert into["step"] == 2
    ck.close()
    return out


def test_multi_rank_cascade_and_reshard_on_load(tmp_path: Path) -> None:
    root, remote = str(tmp_path / "job"), str(tmp_path / "remote")
    states = run_world(2, _rank_job, root, remote)
    assert states == [["durable-remote"] * 3] * 2
    d = tmp_path / "remote" / "step-000000000002"
    assert len(list(d.glob("rank-*.pt"))) == 2
    # One process, another layout: the whole tensor (local tier, resharded by the planner).
    ck = Checkpointer(root, tiers=[HostTier("64MiB"), DiskTier("local"), RemoteTier(remote)])
    into = {"w": torch.zeros(64, 10), "step": None}
    ck.load_latest(into=into)
    assert torch.equal(into["w"], torch.arange(640, dtype=torch.float32).reshape(64, 10) + 2)
    with pytest.warns(UserWarning, match="per-rank objects rng were saved by 2 ranks"):
        got = ck.load_latest()
    assert torch.equal(got["w"], into["w"]) and got["step"] == 2 and "rng" not in got
    assert ck.load_latest(per_rank_policy="rank0")["rng"] == 2  # rank 0's value at step 2
    ck.close()


def _dying_rank(rank: int, world: int, root: str, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    ck = Checkpointer(root, tiers=[HostTier("64MiB"), DiskTier("local")], collective_timeout=5)
    for step in (0, 1):
        ck.save(step, {"w": torch.full((1 << 20,), float(step)), "r": tierstore.PerRank(rank)})
        ck.wait_capture()
    ck.wait()
    ck.save(2, {"w": torch.full((1 << 20,), 2.0), "r": tierstore.PerRank(rank)})
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies with step 2 in flight
    try:
        ck.wait()
        q.put("rank 0: step 2 did not fail")
    except Exception as e:  # the dead peer: the checkpoint fails, nothing hangs
        q.put(f"failed: {type(e).__module__}.{type(e).__name__}: {e}")
    q.close()
    q.join_thread()  # the message is in the pipe before the hard exit below
    ck.close(wait=False)
    os._exit(0)  # the group cannot be torn down cleanly with a dead peer


def test_rank_dying_mid_flush_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    import multiprocessing as mp

    # spawn: a fork of this multi-threaded test process may inherit held locks.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dying_rank, args=(r, 2, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # The collective's error on the surviving rank, named as this checkpoint's failure.
    assert msg.startswith("failed: tierstore.errors.TierstoreError: "), msg
    assert "checkpoint of step 2" in msg and "rank 0 of 2" in msg, msg
    ck = Checkpointer(tmp_path, tiers=[HostTier("64MiB"), DiskTier("local")])
    got = ck.load_latest(into={"w": torch.zeros(1 << 20)})
    assert ck.restored is not None and ck.restored["step"] == 1
    assert torch.equal(got["w"], torch.full((1 << 20,), 1.0))
    ck.close()


def test_relative_remote_tier_paths_are_taken_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``RemoteTier("runs/exp1-remote")`` lands in
    ``runs/exp1-remote``, not under the Checkpointer's directory; a
    DiskTier's relative path stays under it."""
    monkeypatch.chdir(tmp_path)
    ck = Checkpointer("runs/exp1", tiers=[HostTier("16MiB"), DiskTier("local"), RemoteTier("runs/exp1-remote")])
    try:
        ck.save(1, {"w": torch.ones(4)})
        ck.wait()
    finally:
        ck.close()
    assert list((tmp_path / "runs" / "exp1-remote").glob("step-*"))
    assert list((tmp_path / "runs" / "exp1" / "local").glob("step-*"))
    assert not (tmp_path / "runs" / "exp1" / "runs").exists()
