"""DCP checkpoints read and resharded directly; convert, consolidate and
inspect for sharded checkpoints."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import torch
from dist_util import run_world

import tierstore
from tierstore import dcp
from tierstore.layout import Layout, attach


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierstore", *args], capture_output=True, text=True, check=False)


def dcp_save_job(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    dist_cp.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}, checkpoint_id=path)


def test_read_a_dcp_checkpoint_and_reshard_it(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "dcp")
    run_world(4, dcp_save_job, path)
    assert dcp.is_dcp(path)
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    # Column shard 1 of 3 (a layout DCP's own chunks never had).
    t = attach(torch.zeros(8, 4), Layout.shard("w", (8, 12), 1, 1, 3))
    sd = {"w": t, "step": None}
    tierstore.load_sharded(path, sd)
    assert torch.equal(t, full[:, 4:8])
    assert sd["step"] == 3


def test_convert_both_ways_and_consolidate(tmp_path: pathlib.Path) -> None:
    state = {"w": torch.randn(6, 5), "b": torch.arange(4), "epoch": 2}
    src = tmp_path / "ts"
    tierstore.save_sharded(state, src)
    r = cli("convert", str(src), str(tmp_path / "as_dcp"))
    assert r.returncode == 0, r.stderr
    back = dcp.to_state_dict(tmp_path / "as_dcp")
    assert torch.equal(back["w"], state["w"]) and back["epoch"] == 2
    r = cli("convert", str(tmp_path / "as_dcp"), str(tmp_path / "again"))
    assert r.returncode == 0, r.stderr
    r = cli("consolidate", str(tmp_path / "again"), str(tmp_path / "full.pt"))
    assert r.returncode == 0, r.stderr
    full = torch.load(tmp_path / "full.pt")
    assert torch.equal(full["w"], state["w"]) and torch.equal(full["b"], state["b"]) and full["epoch"] == 2


def test_inspect_and_verify_a_sharded_checkpoint(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ck"
    lay = Layout.flat("w", (4, 6), 0, 24)
    tierstore.save_sharded({"w": attach(torch.arange(24.0), lay), "b": torch.ones(2)}, path)
    r = cli("inspect", "--json", str(path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {x["tensor"]: x for x in out["tensors"]}
    assert rows["w"]["shape"] == [4, 6] and rows["w"]["covered"] and rows["w"]["layouts"] == ["flat"]
    v = cli("verify", str(path))
    assert v.returncode == 0 and "OK" in v.stdout
