"""Resuming exactly with RunState and ResumableSampler: a job killed with
SIGKILL and resumed from its Checkpointer continues bit for bit (dropout,
shuffled data, numpy and Python randomness, a scheduler); the state loads
with weights_only; world-size changes follow the chosen policy."""

from __future__ import annotations

import io
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tests.dist_util import run_world
from tierstore import _metadata
from tierstore.errors import TierstoreError

JOB = str(pathlib.Path(__file__).with_name("resume_job.py"))
ROOT = str(pathlib.Path(__file__).parent.parent)


def job(d: pathlib.Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    d.mkdir(exist_ok=True)
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, JOB, str(d), str(steps), *extra], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip


def losses(d: pathlib.Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (d / "losses.txt").read_text().split("\n"):
        if line:
            step, v = line.split()
            out.setdefault(int(step), []).append(v)
    return out


def _assert_same_run(ref: pathlib.Path, run: pathlib.Path, steps: int, optim: bool) -> None:
    """The killed and resumed run ``run`` against the uninterrupted ``ref``:
    the same loss at every step, the same final model (and optimizer state)."""
    want, got = losses(ref), losses(run)
    # The last checkpoint before the kill is step 9: steps 10 and 11 ran twice, with the same losses.
    assert [s for s, v in got.items() if len(v) == 2] == [10, 11]
    for s in range(1, steps + 1):
        assert set(got[s]) == set(want[s]), f"step {s}: {got[s]} != {want[s]}"
    a = torch.load(ref / "final.pt", weights_only=True)
    b = torch.load(run / "final.pt", weights_only=True)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    if optim:
        for i, st in a["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)


def test_kill_and_resume_is_bit_exact(tmp_path: pathlib.Path) -> None:
    steps = 16
    ref = job(tmp_path / "ref", steps)
    assert ref.returncode == 0, ref.stderr
    killed = job(tmp_path / "run", steps, "--kill-after", "11")
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    assert not (tmp_path / "run" / "final.pt").exists()
    resumed = job(tmp_path / "run", steps, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(tmp_path / "ref", tmp_path / "run", steps, optim=True)


def test_kill_and_resume_from_remote_deltas_is_bit_exact(tmp_path: pathlib.Path) -> None:
    """The same job with a remote tier storing deltas (a keyframe every
    second checkpoint), SIGKILLed after step 11 and resumed with its local
    tier deleted: the resume decodes the remote copy (a delta against its
    keyframe) and trains on exactly as the uninterrupted run."""
    steps = 16
    ref = job(tmp_path / "ref", steps)
    assert ref.returncode == 0, ref.stderr
    killed = job(tmp_path / "run", steps, "--kill-after", "11", "--delta-remote")
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    remote = tmp_path / "run" / "remote"
    coded = sorted(remote.glob("step-*/rank-*.pt.tsd"))
    assert coded and not list(remote.glob("step-*/rank-*.pt")), "the remote tier holds encoded files only"
    metas = {
        p.parent.name: _metadata.loads((p.parent / "codec.json").read_bytes(), "codec.json", required=True)[0]
        for p in coded
    }
    assert any(not m["keyframe"] for m in metas.values()), metas
    resumed = job(tmp_path / "run", steps, "--resume", "--delta-remote")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(tmp_path / "ref", tmp_path / "run", steps, optim=False)


def test_run_state_restores_every_generator_and_loads_weights_only(tmp_path: pathlib.Path) -> None:
    sampler = tierstore.ResumableSampler(10, seed=3)
    gen = torch.Generator().manual_seed(1)
    npg = np.random.default_rng(2)
    run = tierstore.RunState(sampler=sampler, gen=gen, npg=npg)
    it = iter(sampler)
    first = [next(it) for _ in range(4)]
    saved = run.state_dict()
    assert not isinstance(saved, tierstore.PerRank), "one process: a plain value"

    def draw() -> tuple[object, ...]:
        return (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random(), torch.rand(2, generator=gen)
                .tolist(), npg.random(2).tolist(), list(it))  # fmt: skip

    want = draw()
    tierstore.save({"run": saved}, tmp_path / "run.pt")
    back = torch.load(tmp_path / "run.pt", weights_only=True)["run"]  # plain torch, weights only
    # Scramble everything, then restore.
    torch.manual_seed(99), np.random.seed(99), random.seed(99), gen.manual_seed(99), npg.random(5)
    sampler2 = tierstore.ResumableSampler(10, seed=3)
    run2 = tierstore.RunState(sampler=sampler2, gen=gen, npg=npg)
    run2.load_state_dict(back)
    it = iter(sampler2)
    got = draw()
    assert got == want
    assert sorted(first + want[-1]) == list(range(10)), "the epoch continued where it stopped"  # type: ignore[operator]
    with pytest.raises(TierstoreError, match="order would differ"):
        tierstore.RunState(sampler=tierstore.ResumableSampler(11, seed=3)).load_state_dict(back)
    with pytest.raises(TierstoreError, match="has no 'sched'"):
        tierstore.RunState(sched=sampler).load_state_dict(back)
    with pytest.raises(TypeError, match="no state_dict"):
        tierstore.RunState(x=object())


def test_resumable_sampler_splits_like_distributed_sampler() -> None:
    ref = [list(torch.utils.data.DistributedSampler(range(11), num_replicas=3, rank=r, seed=4, shuffle=False))
           for r in range(3)]  # fmt: skip
    got = [list(tierstore.ResumableSampler(11, shuffle=False, rank=r, world=3)) for r in range(3)]
    assert got == ref
    s = tierstore.ResumableSampler(11, seed=4, rank=1, world=3)
    e0, e1 = list(s), list(s)
    assert s.epoch == 2 and e0 != e1 and len(e0) == len(e1) == 4


def sharded_run_job(rank: int, world: int, path: str, mode: str) -> object:
    torch.manual_seed(100 + rank)
    run = tierstore.RunState(on_world_change="reseed" if mode == "reseed" else "error")
    if mode == "save":
        s = run.state_dict()
        assert isinstance(s, tierstore.PerRank)
        tierstore.save_sharded({"run": s, "w": torch.ones(2)}, path)
        return torch.rand(3).tolist()  # what each rank draws next
    target: dict[str, object] = {"run": None, "w": torch.zeros(2)}
    if mode == "same":
        tierstore.load_sharded(path, target)
        run.load_state_dict(target["run"])
        return torch.rand(3).tolist()
    tierstore.load_sharded(path, target, per_rank_policy="rank0")
    if mode == "error":
        with pytest.raises(TierstoreError, match="same world"):
            run.load_state_dict(target["run"])
        return None
    run.load_state_dict(target["run"])
    return torch.rand(3).tolist()


def test_run_state_per_rank_with_save_sharded_and_a_world_change(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "ck")
    nxt = run_world(2, sharded_run_job, path, "save")
    assert nxt[0] != nxt[1]
    assert run_world(2, sharded_run_job, path, "same") == nxt, "each rank its own generators back"
    run_world(3, sharded_run_job, path, "error")
    a = run_world(3, sharded_run_job, path, "reseed")
    b = run_world(3, sharded_run_job, path, "reseed")
    assert a == b, "reseeded deterministically"
    assert len({tuple(x) for x in a}) == 3, "and differently per rank"


def test_run_state_round_trips_through_a_stream() -> None:
    run = tierstore.RunState()
    buf = io.BytesIO()
    tierstore.save(run.state_dict(), buf)
    want = torch.rand(2)
    buf.seek(0)
    run.load_state_dict(tierstore.load(buf))
    assert torch.equal(torch.rand(2), want), "the draw after a restore is the one after the capture"


def test_saving_does_not_move_the_global_generators(tmp_path: pathlib.Path) -> None:
    """A save (often on a Checkpointer thread) must not draw from the
    training's random streams (it once drew its serialization id from
    Python's global ``random``, which broke the kill-and-resume test)."""
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    tierstore.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    tierstore.save_sharded({"w": torch.ones(3), "o": [1]}, tmp_path / "b")
    ck = tierstore.Checkpointer(tmp_path / "c")
    ck.save(1, {"w": torch.ones(3)})
    ck.wait()
    ck.close()
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])
