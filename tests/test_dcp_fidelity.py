"""What DCP and FSDP2 users have: optimizer state dicts flattened by DCP's
rules, FSDP2 (DTensor) models and optimizers saved by ``dcp.save`` and
loaded on another mesh, the Checkpointer attached to an FSDP2 optimizer, and
``consolidate`` of a DCP checkpoint equal to ``dcp_to_torch_save``. Real
processes on gloo, real DCP, real files."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

import tierstore
from tests.dist_util import run_world
from tierstore.errors import TierstoreError
from tierstore.sharded import consolidate

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal bit for bit, structure and types included (a
    dict and an OrderedDict count as the same)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        m(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


# ----------------------------------------------------------------------------------------------
# a plain optimizer.state_dict(): DCP's keys, tensor records


def test_load_sharded_of_a_dcp_checkpoint_fills_a_plain_optimizer_state_dict(tmp_path: pathlib.Path) -> None:
    import torch.distributed.checkpoint as dcp

    m, opt = trained()
    dcp.save({"model": m.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    m2, opt2 = trained(seed=1, steps=1)
    opt2.param_groups[0]["lr"] = 5.0
    target = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    tierstore.load_sharded(tmp_path, target)
    opt2.load_state_dict(target["optim"])
    m2.load_state_dict(target["model"])
    same(opt2.state_dict(), opt.state_dict(), "optim")
    same(m2.state_dict(), m.state_dict(), "model")


def test_optimizer_state_is_stored_as_tensor_records(tmp_path: pathlib.Path) -> None:
    m, opt = trained()
    tierstore.save_sharded({"model": m.state_dict(), "optim": opt.state_dict()}, tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert "optim.state.0.exp_avg" in man["tensors"] and "optim.state.3.exp_avg_sq" in man["tensors"]
    assert "optim.param_groups.0.lr" in man["objects"]
    assert man["paths"]["optim.state.0.exp_avg"] == ["optim", "state", {"int": 0}, "exp_avg"]
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    (objects_file,) = tmp_path.glob("objects-*.pt")
    assert objects_file.stat().st_size < state_bytes + 64 * 1024, "the state tensors went into the objects file"
    assert not [t for t in tierstore.load(objects_file)["objects"].values() if isinstance(t, torch.Tensor)]

    # Into a stepped optimizer (its state has the shapes), and into a fresh one (rebuilt from the keys).
    for fresh in (False, True):
        m2, opt2 = trained(seed=1, steps=0 if fresh else 1)
        target = {"model": m2.state_dict(), "optim": opt2.state_dict()}
        assert (target["optim"]["state"] == {}) is fresh
        tierstore.load_sharded(tmp_path, target)
        opt2.load_state_dict(target["optim"])
        same(opt2.state_dict(), opt.state_dict(), f"optim (fresh={fresh})")
    # The Checkpointer's restore without a target rebuilds the same nesting.
    back = consolidate(tmp_path)
    assert back["optim.state.0.exp_avg"].shape == opt.state[next(iter(opt.state))]["exp_avg"].shape


def test_dcp_flattening_rules_are_torchs() -> None:
    """Our walker gives exactly DCP's flat keys (and its object paths)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from tierstore import _tree

    m, opt = trained()
    sd = {
        "model": m.state_dict(),
        "optim": opt.state_dict(),
        "lists": [[1, 2], [torch.ones(1)], ({"a": torch.ones(1)},), [{}], []],
        "extra": {"int_keys": {3: "x", 4: torch.zeros(2)}, "empty": {}, "t": (1, torch.ones(1))},
        "n": 3,
    }
    flat, mapping = flatten_state_dict(sd)
    ours = {leaf.key: leaf for leaf in _tree.flatten(sd, dcp=True)}
    assert list(ours) == list(flat)
    for k, leaf in ours.items():
        assert leaf.value is flat[k], k
        assert leaf.path == mapping[k], k
    # Our own checkpoints keep an empty dict as a value (DCP drops it) and integer keys as integers.
    own = {leaf.key: leaf for leaf in _tree.flatten(sd)}
    assert set(own) == set(flat) | {"extra.empty", "lists.3.0"}
    assert own["extra.int_keys.3"].path == ("extra", "int_keys", {"int": 3})


def test_a_checkpoint_saved_before_the_dcp_rules_still_loads(tmp_path: pathlib.Path) -> None:
    """A checkpoint whose optimizer ``state`` and ``param_groups`` are whole
    objects (tierstore before these rules) fills today's target keys."""
    m, opt = trained()
    sd = opt.state_dict()
    # What the old rules saved: the int-keyed dict and the list as single objects.
    from tierstore import _tree

    def old_rule(v: Any, dcp: bool = False) -> bool:
        return isinstance(v, dict) and bool(v) and all(isinstance(k, str) for k in v)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_tree, "walks", old_rule)
        tierstore.save_sharded({"model": m.state_dict(), "optim": sd}, tmp_path / "old")
    man = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert "optim.state" in man["objects"] and "optim.param_groups" in man["objects"]
    m2, opt2 = trained(seed=1, steps=1)
    target = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    tierstore.load_sharded(tmp_path / "old", target)
    opt2.load_state_dict(target["optim"])
    same(opt2.state_dict(), opt.state_dict(), "optim")
    bad = {"optim": {"state": {0: {"exp_avg": torch.zeros(5)}}}}
    with pytest.raises(TierstoreError, match="shape"):
        tierstore.load_sharded(tmp_path / "old", bad)
    with pytest.raises(TierstoreError, match=r"no value for 'optim.state.9.exp_avg'"):
        tierstore.load_sharded(tmp_path / "old", {"optim": {"state": {9: {"exp_avg": torch.zeros(8, 6)}}}})


def test_hostile_key_paths_in_the_manifest_are_refused(tmp_path: pathlib.Path) -> None:
    from tierstore import _metadata

    _m, opt = trained()
    tierstore.save_sharded({"optim": opt.state_dict()}, tmp_path)
    raw = (tmp_path / "manifest.json").read_bytes()
    man, _ = _metadata.loads(raw, "manifest", required=True)
    for bad in (["optim", "state", 0, "exp_avg", "x"], "optim.state", [{"int": "0"}], [{"eval": 1}], []):
        m2 = json.loads(json.dumps(man))
        m2["paths"]["optim.state.0.exp_avg"] = bad
        (tmp_path / "manifest.json").write_bytes(_metadata.dumps(m2))
        with pytest.raises(TierstoreError, match=r"paths\['optim.state.0.exp_avg'\]"):
            tierstore.load_sharded(tmp_path, {"optim": {}})


# ----------------------------------------------------------------------------------------------
# FSDP2 + AdamW through dcp.save, loaded on other meshes


def _fsdp_model(world: int, mesh_shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 10))
    # A 2-D mesh is HSDP: replicated over the first dimension, sharded over the second.
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """The whole model and optimizer state (torch.save bytes: tensors do not
    travel through the result queue of a rank that exits)."""
    import io

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buf = io.BytesIO()
    torch.save((msd, osd), buf)
    return buf.getvalue()


def _unpack(results: list[Any]) -> Any:
    import io

    (only,) = [r for r in results if r is not None]
    return torch.load(io.BytesIO(only if isinstance(only, bytes) else only[1]), weights_only=True)


def fsdp_save_job(rank: int, world: int, path: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_model(world, (world,))
    _train(model, opt, 3, seed=7)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = _full(model, opt)
    return full if rank == 0 else None


def fsdp_load_job(rank: int, world: int, path: str, mesh_shape: tuple[int, ...]) -> Any:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_model(world, mesh_shape)
    _train(model, opt, 1, seed=99)  # different values everywhere
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    tierstore.load_sharded(path, target)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    full = _full(model, opt)
    return full if rank == 0 else None


@pytest.mark.parametrize(("save_world", "load_world", "mesh"), [(2, 4, (4,)), (4, 2, (2,)), (2, 4, (2, 2))])
def test_fsdp2_adamw_dcp_save_then_load_sharded_on_another_mesh(
    tmp_path: pathlib.Path, save_world: int, load_world: int, mesh: tuple[int, ...]
) -> None:
    path = str(tmp_path / "dcp")
    saved = _unpack(run_world(save_world, fsdp_save_job, path, method="spawn", timeout=240))
    loaded = _unpack(run_world(load_world, fsdp_load_job, path, mesh, method="spawn", timeout=240))
    same(loaded[0], saved[0], "model")
    same(loaded[1], saved[1], "optim")
    assert loaded[1]["state"], "the optimizer state was loaded"


def fsdp_checkpointer_job(rank: int, world: int, path: str) -> Any:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_model(world, (world,))
    ck = tierstore.Checkpointer(path)
    ck.attach(opt)
    try:
        _train(model, opt, 2, seed=3)
        msd, osd = get_state_dict(model, opt)
        ck.save(2, {"model": msd, "optim": osd})
        _train(model, opt, 1, seed=4)  # the attached optimizer's step waits for the capture
        ck.wait()
    finally:
        ck.close()
    # A new job on the same world restores into its own FSDP2 state.
    model2, opt2 = _fsdp_model(world, (world,))
    _train(model2, opt2, 1, seed=5)
    ck2 = tierstore.Checkpointer(path)
    try:
        msd2, osd2 = get_state_dict(model2, opt2)
        target = {"model": msd2, "optim": osd2}
        ck2.load_latest(into=target)
        set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    finally:
        ck2.close()
    got = _full(model2, opt2)
    return got if rank == 0 else None


def fsdp_reference_job(rank: int, world: int) -> Any:
    model, opt = _fsdp_model(world, (world,))
    _train(model, opt, 2, seed=3)
    full = _full(model, opt)
    return full if rank == 0 else None


def test_checkpointer_attached_to_an_fsdp2_optimizer(tmp_path: pathlib.Path) -> None:
    ref = _unpack(run_world(2, fsdp_reference_job, method="spawn", timeout=240))
    got = _unpack(run_world(2, fsdp_checkpointer_job, str(tmp_path / "ck"), method="spawn", timeout=240))
    same(got[0], ref[0], "model")
    same(got[1], ref[1], "optim")


# ----------------------------------------------------------------------------------------------
# consolidate and verify of a DCP checkpoint


def test_consolidate_of_dcp_equals_dcp_to_torch_save(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    m, opt = trained()
    sd = {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7, "sched": {"milestones": [1, 2]}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    same(consolidate(tmp_path / "dcp"), ref, "consolidate")
    cli = [sys.executable, "-m", "tierstore"]
    out = subprocess.run([*cli, "consolidate", str(tmp_path / "dcp"), str(tmp_path / "ts.pt")], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert "tensors" in out.stdout
    same(torch.load(tmp_path / "ts.pt", weights_only=True), ref, "tierstore consolidate")
    v = subprocess.run([*cli, "verify", str(tmp_path / "dcp")], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
    assert "no checksums of its own" in v.stdout and "chunks" in v.stdout
    # A flipped bit in a chunk's data is found by verify, which reads every chunk.
    (data,) = (tmp_path / "dcp").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(m.state_dict()["0.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0x10
    data.write_bytes(bytes(raw))
    v = subprocess.run([*cli, "verify", str(tmp_path / "dcp")], capture_output=True, text=True)
    assert v.returncode != 0 and str(data) in v.stderr, (v.stdout, v.stderr)


def test_checkpointer_restores_an_optimizer_state_dict_with_its_integer_keys(tmp_path: pathlib.Path) -> None:
    m, opt = trained()
    state = {"model": m.state_dict(), "optim": opt.state_dict(), "seen": [1, 2], "empty": {}}
    ck = tierstore.Checkpointer(tmp_path)
    ck.save(1, state)
    ck.wait()
    ck.close()
    ck = tierstore.Checkpointer(tmp_path, tiers=[tierstore.DiskTier(".")])  # from disk, not host memory
    try:
        got = ck.load_latest()
    finally:
        ck.close()
    same(got, state, "restored")


def test_a_fresh_optimizer_target_of_a_dcp_checkpoint_warns(tmp_path: pathlib.Path) -> None:
    """DCP's rules load nothing into an empty ``state``: the user is told."""
    import torch.distributed.checkpoint as dcp

    _m, opt = trained()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    _m2, fresh = trained(seed=1, steps=0)
    with pytest.warns(UserWarning, match=r"'optim.state' is an empty dict.*'optim.state.0.step'"):
        tierstore.load_sharded(tmp_path, {"optim": fresh.state_dict()})


def tp_optim_job(rank: int, world: int, path: str) -> list[str]:
    """Tensor-parallel shards of a parameter, and a plain optimizer.state_dict()
    of them: the state tensors carry no layout."""
    import warnings as w

    from tierstore import Layout, attach

    full = torch.arange(16.0).reshape(4, 4)
    lay = Layout.shard("w", (4, 4), 0, rank, world)
    p = torch.nn.Parameter(full[2 * rank : 2 * rank + 2].clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.full_like(p, float(rank + 1))
    opt.step()
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        tierstore.save_sharded({"w": attach(p.detach(), lay), "optim": opt.state_dict()}, path)
    return [str(x.message) for x in got]


def test_a_plain_optimizer_state_of_sharded_parameters_is_not_silently_deduplicated(tmp_path: pathlib.Path) -> None:
    msgs = run_world(2, tp_optim_job, str(tmp_path / "tp"))
    assert any("optim.state.0.momentum_buffer" in m and "differ between ranks" in m for m in msgs[0]), msgs


def test_two_values_with_one_flat_key_are_refused(tmp_path: pathlib.Path) -> None:
    clash = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(tierstore.LayoutError, match=r"'a\.b'"):
        tierstore.save_sharded(clash, tmp_path / "s")
    ck = tierstore.Checkpointer(tmp_path / "ck")
    try:
        with pytest.raises(tierstore.LayoutError, match=r"'a\.b'"):
            ck.save(1, clash)
    finally:
        ck.close()
