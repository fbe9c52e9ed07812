"""Sharded checkpoints: save under one parallel layout, load under another,
with real multi-process torch.distributed (gloo on loopback)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import zlib
from typing import Any

import pytest
import torch
from ckpt_util import stored_tensors
from dist_util import run_world

import tierstore
from tierstore.layout import (
    Box,
    Layout,
    attach,
    boost_fused_down,
    boost_stacked_up,
    expert_slice,
    pipeline_layers,
    tp_fused_qkv,
    tp_fused_swiglu,
    tp_row,
    tp_vocab,
    zero_partition,
)
from tierstore.reshard import CoverageError

V, D, FFN, L, NQ, NKV, HD = 10, 8, 16, 4, 8, 4, 1
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def materialize(lay: Layout) -> torch.Tensor:
    """The local tensor a layout describes, built by plain indexing (an
    implementation independent of the planner)."""
    t = torch.zeros(lay.local_shape)
    flat = t.view(-1)
    for p in lay.pieces:
        g = value(p.tensor, lay.global_shapes[p.tensor])[
            tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))
        ]
        if isinstance(p.local, Box):
            where = tuple(slice(o, o + n) for o, n in zip(p.local.offsets, p.local.lengths, strict=True))
            t[where] = g.reshape(p.local.lengths)
        else:
            flat[p.local : p.local + g.numel()] = g.reshape(-1)
    return t


def coords(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    return rank % tp, (rank // tp) % pp, rank // (tp * pp)


def model_layouts(tp: int, pp: int, tp_r: int, pp_r: int) -> dict[str, Layout]:
    m: dict[str, Layout] = {}
    if pp_r == 0:
        m["embed.weight"] = tp_vocab("embed.weight", (V, D), tp_r, tp)
    for i in pipeline_layers(pp_r, pp, L):
        p = f"layers.{i}"
        m[f"{p}.attn.qkv.weight"] = tp_fused_qkv(f"{p}.attn", NQ, NKV, HD, D, tp_r, tp)
        m[f"{p}.attn.o.weight"] = tp_row(f"{p}.attn.o.weight", (D, NQ * HD), tp_r, tp)
        m[f"{p}.mlp.fc1.weight"] = tp_fused_swiglu(f"{p}.mlp", FFN, D, tp_r, tp)
        m[f"{p}.mlp.down.weight"] = tp_row(f"{p}.mlp.down.weight", (D, FFN), tp_r, tp)
        m[f"{p}.ln.weight"] = Layout.full(f"{p}.ln.weight", (D,))
    if pp_r == pp - 1:
        m["final_ln.weight"] = Layout.full("final_ln.weight", (D,))
    return m


def layouts(tp: int, pp: int, dp: int, zero: int, rank: int) -> dict[str, Layout]:
    """Every local tensor of one rank of a (TP, PP, DP + ZeRO) job."""
    tp_r, pp_r, dp_r = coords(rank, tp, pp)
    model = model_layouts(tp, pp, tp_r, pp_r)
    out: dict[str, Layout] = {}
    order = sorted(model)
    if zero == 3:
        for k in order:
            out[f"model.{k}"] = zero_partition([model[k]], dp_r, dp, stage=3)
    else:
        for k in order:
            out[f"model.{k}"] = dataclasses.replace(model[k], replicated=model[k].replicated or dp > 1)
    for s in STATES:
        named = [model[k].renamed(lambda n, s=s: f"optim.{s}.{n}") for k in order]
        if zero:
            out[f"optim.{s}"] = zero_partition(named, dp_r, dp, stage=zero)
        else:
            for k, lay in zip(order, named, strict=True):
                out[f"optim.{s}.{k}"] = dataclasses.replace(lay, replicated=lay.replicated or dp > 1)
    return out


def state_for(lays: dict[str, Layout], fill: bool, rank: int) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for k, lay in lays.items():
        t = materialize(lay) if fill else torch.full(lay.local_shape, float("nan"))
        sd[k] = attach(t, lay)
    sd["optim.step"] = 7 if fill else None
    sd["rng"] = tierstore.PerRank(rank) if fill else None
    return sd


def check(sd: dict[str, Any], lays: dict[str, Layout]) -> None:
    for k, lay in lays.items():
        assert torch.equal(sd[k], materialize(lay)), f"{k} differs after resharding"


def save_job(rank: int, world: int, path: str, cfg: tuple[int, int, int, int]) -> None:
    tp, pp, dp, zero = cfg
    tierstore.save_sharded(state_for(layouts(tp, pp, dp, zero, rank), True, rank), path)


def load_job(rank: int, world: int, path: str, cfg: tuple[int, int, int, int]) -> dict[str, int]:
    tp, pp, dp, zero = cfg
    lays = layouts(tp, pp, dp, zero, rank)
    sd = state_for(lays, False, rank)
    stats: dict[str, int] = {}
    tierstore.load_sharded(path, sd, per_rank_policy="rank0", stats=stats)
    check(sd, lays)
    assert sd["optim.step"] == 7
    # Unverified, exactly the bytes needed are read; verified, the rest of
    # each 4 KiB chunk a read touches as well (the blocks O_DIRECT reads).
    sd = state_for(lays, False, rank)
    raw: dict[str, int] = {}
    tierstore.load_sharded(path, sd, per_rank_policy="rank0", stats=raw, verify=False)
    check(sd, lays)
    stats["unverified_bytes_read"] = raw["bytes_read"]
    return stats


@pytest.fixture(scope="module")
def zero1_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("ck") / "tp2pp2dp2z1")
    run_world(8, save_job, path, (2, 2, 2, 1))
    return path


def test_tp2pp2dp2_zero1_to_tp4dp2_zero2(zero1_checkpoint: str) -> None:
    stats = run_world(8, load_job, zero1_checkpoint, (4, 1, 2, 2))
    for s in stats:
        assert s["unverified_bytes_read"] == s["bytes_needed"], "every rank reads exactly the bytes it needs"
        assert s["bytes_needed"] <= s["bytes_read"] <= s["bytes_needed_blocks"], "and verified, its chunks"
        assert s["bytes_verified"] == s["bytes_read"]


def test_tp2pp2dp2_zero1_to_single_process(zero1_checkpoint: str) -> None:
    load_job(0, 1, zero1_checkpoint, (1, 1, 1, 0))


def test_tp2pp2dp2_zero1_to_dp8_zero3(zero1_checkpoint: str) -> None:
    run_world(8, load_job, zero1_checkpoint, (1, 1, 8, 3))


def test_consolidate_with_plain_tensors(zero1_checkpoint: str) -> None:
    """One process, plain tensors with no layout: whole logical tensors."""
    m = json.loads(pathlib.Path(zero1_checkpoint, "manifest.json").read_text())
    sd: dict[str, Any] = {name: torch.zeros(g["shape"]) for name, g in m["tensors"].items()}
    tierstore.load_sharded(zero1_checkpoint, sd)
    for name, t in sd.items():
        assert torch.equal(t, value(name, tuple(t.shape))), name


def test_per_rank_objects_need_a_policy_on_another_world_size(zero1_checkpoint: str) -> None:
    sd = {"rng": None}
    with pytest.raises(tierstore.FormatError, match="per_rank_policy"):
        tierstore.load_sharded(zero1_checkpoint, sd)
    tierstore.load_sharded(zero1_checkpoint, sd, per_rank_policy="rank0")
    assert sd["rng"] == 0
    tierstore.load_sharded(zero1_checkpoint, sd, per_rank_policy=lambda by_rank: sorted(by_rank.values()))
    assert sd["rng"] == list(range(8))


def vocab_job(rank: int, world: int, path: str, mode: str) -> None:
    lay = tp_vocab("embed.weight", (V, D), rank, world)
    if mode == "save":
        tierstore.save_sharded({"embed": attach(materialize(lay), lay)}, path)
    else:
        t = attach(torch.full(lay.local_shape, float("nan")), lay)
        tierstore.load_sharded(path, {"embed": t})
        assert torch.equal(t, materialize(lay)), "logical rows loaded, padding rows zero"


def test_vocab_padding_tp2_to_tp3(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "vocab")
    run_world(2, vocab_job, path, "save")
    run_world(3, vocab_job, path, "load")  # 10 rows padded to 12, 4 per rank


def moe_job(rank: int, world: int, path: str, mode: str) -> None:
    shape = (8, 4, 6)  # 8 experts
    lay = expert_slice("experts.w1", shape, rank, world)
    if mode == "save":
        tierstore.save_sharded({"w1": attach(materialize(lay), lay)}, path)
    else:
        t = attach(torch.zeros(lay.local_shape), lay)
        tierstore.load_sharded(path, {"w1": t})
        assert torch.equal(t, materialize(lay))


def test_moe_ep4_to_ep2(tmp_path: pathlib.Path) -> None:
    run_world(4, moe_job, str(tmp_path / "moe"), "save")
    run_world(2, moe_job, str(tmp_path / "moe"), "load")


R, OUT = 3, 8
DOWN = [f"attn.{x}.A" for x in "qkv"]
UP = [f"attn.{x}.B" for x in "qkv"]


def boost_layouts(rank: int, tp: int, boost: bool) -> dict[str, Layout]:
    if boost:
        return {
            "down": boost_fused_down(DOWN, R, D, rank, tp),  # [3r, d/tp]
            "up": boost_stacked_up(UP, OUT, R, rank, tp),  # [3, out/tp, r]
        }
    # Vanilla low-rank TP: shard the rank dimension of every factor.
    out = {}
    for a, b in zip(DOWN, UP, strict=True):
        out[a] = Layout.shard(a, (R, D), 0, rank, tp) if R % tp == 0 else Layout.full(a, (R, D))
        out[b] = Layout.shard(b, (OUT, R), 1, rank, tp) if R % tp == 0 else Layout.full(b, (OUT, R))
    return out


def boost_job(rank: int, world: int, path: str, boost: bool, mode: str) -> None:
    lays = boost_layouts(rank, world, boost)
    if mode == "save":
        tierstore.save_sharded({k: attach(materialize(lay), lay) for k, lay in lays.items()}, path)
    else:
        sd = {k: attach(torch.zeros(lay.local_shape), lay) for k, lay in lays.items()}
        tierstore.load_sharded(path, sd)
        for k, lay in lays.items():
            assert torch.equal(sd[k], materialize(lay)), k


def test_boost_to_plain_tp_and_back(tmp_path: pathlib.Path) -> None:
    run_world(2, boost_job, str(tmp_path / "boost"), True, "save")
    run_world(3, boost_job, str(tmp_path / "boost"), False, "load")  # vanilla TP=3 on the rank dim
    run_world(3, boost_job, str(tmp_path / "vanilla"), False, "save")
    run_world(4, boost_job, str(tmp_path / "vanilla"), True, "load")


def dtensor_job(rank: int, world: int, path: str, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = value("w", (8, 12))
    if mode == "save":  # FSDP2-style: Shard(0) over 4 ranks
        mesh = init_device_mesh("cpu", (world,))
        tierstore.save_sharded({"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)}, path)
    else:  # FSDP2 + TP on a 2x2 mesh
        mesh = init_device_mesh("cpu", (2, 2))
        dt = distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1), Shard(0)])
        sd = {"w": dt, "b": torch.zeros(3)}
        tierstore.load_sharded(path, sd)
        assert torch.equal(dt.full_tensor(), full)
        assert torch.equal(sd["b"], torch.ones(3))


def test_fsdp2_dtensor_to_fsdp2_plus_tp(tmp_path: pathlib.Path) -> None:
    run_world(4, dtensor_job, str(tmp_path / "dt"), "save")
    run_world(4, dtensor_job, str(tmp_path / "dt"), "load")


def test_coverage_proof_names_the_tensor_and_region(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cov"
    lay = Layout.block("w", (4, 4), (0, 0), (2, 4))  # only the top half exists...
    with pytest.raises(CoverageError, match="'w'"):  # ...so the save itself refuses
        tierstore.save_sharded({"w": attach(torch.ones(2, 4), lay)}, path)
    tierstore.save_sharded({"w": torch.ones(4, 4)}, path)
    target = attach(torch.zeros(2, 4), Layout.block("w", (6, 4), (4, 0), (2, 4)))
    with pytest.raises(CoverageError, match=r"'w'.*shape"):
        tierstore.load_sharded(path, {"w": target})
    other = attach(torch.zeros(2, 4), Layout.block("missing", (4, 4), (0, 0), (2, 4)))
    with pytest.raises(CoverageError, match="missing"):
        tierstore.load_sharded(path, {"w": other})


def kill_job(rank: int, world: int, path: str, when: str) -> None:
    """Rank 1 dies by SIGKILL inside ``save_sharded``: at its first
    collective (``before``: nothing written yet) or at the one after its data
    file is written and before rank 0 commits (``written``)."""
    if rank == 1:
        import tierstore.sharded as sh

        real, calls = sh._gather, []

        def gather(obj: Any, world: int, pg: Any) -> list[Any] | None:
            calls.append(obj)
            if (when == "before" and len(calls) == 1) or (when == "written" and len(calls) == 2):
                names = sorted(os.listdir(path))
                pathlib.Path(path + f".{when}.seen").write_text("\n".join(names))
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, world, pg)

        sh._gather = gather
    # Each rank holds and writes its half.
    w = attach(torch.full((4,), 2.0), Layout.block("w", (8,), (4 * rank,), (4,)))
    tierstore.save_sharded({"w": w}, path)


@pytest.mark.parametrize("when", ["before", "written"])
def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path: pathlib.Path, when: str) -> None:
    path = str(tmp_path / "ck")
    tierstore.save_sharded({"w": torch.full((8,), 1.0)}, path)
    old_manifest = (tmp_path / "ck" / "manifest.json").read_bytes()
    with pytest.raises(AssertionError, match="rank"):  # rank 1 dies; the others fail or time out
        run_world(2, kill_job, path, when, timeout=20)
    seen = (tmp_path / f"ck.{when}.seen").read_text().split()
    new_files = [n for n in seen if n.startswith("rank-00001.")]
    old_sid = json.loads(old_manifest)["save_id"]
    if when == "written":  # it died in the middle of the save: its new data file was on disk
        assert any(old_sid not in n for n in new_files), seen
    else:
        assert all(old_sid in n for n in new_files), seen
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == old_manifest, "no commit without every rank"
    sd = {"w": torch.zeros(8)}
    tierstore.load_sharded(path, sd)
    assert torch.equal(sd["w"], torch.full((8,), 1.0)), "the previous checkpoint is still the committed one"
    # The next save that completes removes what the dead one left.
    tierstore.save_sharded({"w": torch.full((8,), 3.0)}, path)
    sid = json.loads((tmp_path / "ck" / "manifest.json").read_text())["save_id"]
    assert all(sid in n for n in os.listdir(path) if n.startswith(("rank-", "objects-"))), os.listdir(path)


def test_damaged_shard_is_named(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dmg"
    tierstore.save_sharded({"w": torch.arange(1000.0)}, path)
    m = json.loads((path / "manifest.json").read_text())
    f = path / m["files"][0]["name"]
    data = bytearray(f.read_bytes())
    data[stored_tensors(path)[0]["offset"] + 100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(tierstore.ChecksumError, match=m["files"][0]["name"]):
        tierstore.load_sharded(path, {"w": torch.zeros(1000)})
    f.write_bytes(bytes(data[:5000]))
    with pytest.raises(tierstore.TierstoreError, match=m["files"][0]["name"]):
        tierstore.load_sharded(path, {"w": torch.zeros(1000)})


def test_rank_files_open_with_torch_load(zero1_checkpoint: str) -> None:
    files = sorted(pathlib.Path(zero1_checkpoint).glob("rank-*.pt"))
    assert files
    for f in files:
        assert "tensors" in torch.load(f)


def _gpt() -> tuple[Any, Any, torch.Tensor]:
    from tierstore.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(64, 32, 2, heads=4, ctx=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    return model, opt, data


def _step(model: Any, opt: Any, data: torch.Tensor) -> float:
    logits = model(data[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), data[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def gpt_train_and_save(rank: int, world: int, path: str) -> list[float]:
    """Data parallel with ZeRO-1-style optimizer partitions: every rank trains
    the same replica; each saves only its partition of the Adam moments."""
    from tierstore.sharded import optim_name

    model, opt, data = _gpt()
    losses = [_step(model, opt, data) for _ in range(3)]
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    state: dict[str, Any] = {"model": model.state_dict()}
    st = opt.state_dict()
    for sname in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([st["state"][i][sname].reshape(-1) for i in range(len(names))])
        lay = zero_partition([(optim_name(sname, n), tuple(params[n].shape)) for n in names], rank, world, stage=1)
        part = torch.zeros(lay.local_shape)
        n = min(part.numel(), max(0, flat.numel() - rank * part.numel()))
        part[:n] = flat[rank * part.numel() : rank * part.numel() + n]
        state[f"zero.{sname}"] = attach(part, lay)
    for i, n in enumerate(names):
        state[f"steps.{n}"] = attach(st["state"][i]["step"].clone(), Layout.full(optim_name("step", n), ()))
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in st["param_groups"]]
    state["optim"] = {"param_groups": groups}
    tierstore.save_sharded(state, path)
    return losses


def test_gpt_resumes_on_another_layout_with_the_same_loss_curve(tmp_path: pathlib.Path) -> None:
    from tierstore.sharded import init_optimizer_state, load_optimizer_state_dict, optimizer_state_dict

    model, opt, data = _gpt()
    reference = [_step(model, opt, data) for _ in range(6)]
    path = str(tmp_path / "gpt")
    saved = run_world(2, gpt_train_and_save, path, method="spawn", timeout=300)
    assert saved[0] == pytest.approx(reference[:3], rel=1e-6)
    # Resume in one process, without ZeRO: a fresh model and optimizer.
    torch.manual_seed(123)
    from tierstore.demo import TinyGPT

    model2 = TinyGPT(64, 32, 2, heads=4, ctx=16)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    init_optimizer_state(opt2)
    target = {"model": model2.state_dict(), "optim": optimizer_state_dict(opt2, model2.named_parameters())}
    tierstore.load_sharded(path, target)
    load_optimizer_state_dict(opt2, model2.named_parameters(), target["optim"])
    resumed = [_step(model2, opt2, data) for _ in range(3)]
    assert resumed == pytest.approx(reference[3:], rel=1e-5, abs=1e-6)
