"""The optimizer offload wrapper: same results as the wrapped optimizer in
memory, state in the tiers, multi-path placement, checksums, state_dict."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import ChecksumError, DiskTier, HostTier
from tierstore.offload import offload


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _step(model: torch.nn.Module, opt: Any, step: int) -> None:
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _fast_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


@pytest.mark.parametrize("subgroup", ["64KiB", "300KiB", "64MiB"])
def test_equal_to_the_optimizer_in_memory(tmp_path: Path, subgroup: str) -> None:
    m_ref, m_off = _model(), _model()
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = offload(
        torch.optim.AdamW,
        m_off.parameters(),
        lr=1e-3,
        weight_decay=0.1,
        tiers=[HostTier("256KiB"), DiskTier(str(tmp_path))],
        subgroup_bytes=subgroup,
    )
    for step in range(8):
        _step(m_ref, ref, step)
        _step(m_off, opt, step)
        for a, b in zip(m_ref.parameters(), m_off.parameters(), strict=True):
            assert torch.equal(a, b), (subgroup, step)
    placed = opt.placement()
    if subgroup != "64MiB":
        assert placed[str(tmp_path)] > 0  # state really went to disk
        assert opt.stats["read_bytes"] > 0 and opt.stats["write_bytes"] > 0
    sd, rs = opt.state_dict(), ref.state_dict()
    assert sd["param_groups"] == rs["param_groups"]
    for i, st in rs["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v)
    opt.close()
    assert not any(tmp_path.iterdir())  # the session's files are removed


def test_other_optimizers_and_bf16_params(tmp_path: Path) -> None:
    m_ref, m_off = _model(), _model()
    ref = torch.optim.SGD(m_ref.parameters(), lr=0.05, momentum=0.9)
    opt = offload(
        torch.optim.SGD, m_off.parameters(), lr=0.05, momentum=0.9, tiers=[HostTier(0), DiskTier(str(tmp_path))]
    )
    for step in range(4):
        _step(m_ref, ref, step)
        _step(m_off, opt, step)
    assert all(torch.equal(a, b) for a, b in zip(m_ref.parameters(), m_off.parameters(), strict=True))
    opt.close()
    # bf16 model parameters: fp32 masters in the tiers, the model gets the rounded values.
    mb = _model().to(torch.bfloat16)
    m32 = _model()
    ref32 = torch.optim.AdamW(m32.parameters(), lr=1e-3)
    optb = offload(torch.optim.AdamW, mb.parameters(), lr=1e-3, tiers=[HostTier(0), DiskTier(str(tmp_path))])
    for step in range(3):
        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
        mb(x.bfloat16()).float().pow(2).mean().backward()
        assert all(p.grad.dtype == torch.bfloat16 for p in mb.parameters())
        optb.step()
        optb.zero_grad()
        _step(m32, ref32, step)
    for pb, p32 in zip(mb.parameters(), m32.parameters(), strict=True):
        torch.testing.assert_close(pb.float(), p32, rtol=0.05, atol=0.02)
    optb.close()


def test_multi_path_follows_bandwidth(tmp_path: Path) -> None:
    fast = _fast_dir() / f"ts-off-{os.getpid()}"
    fast.mkdir(exist_ok=True)
    try:
        model = _model()
        opt = offload(
            torch.optim.AdamW,
            model.parameters(),
            lr=1e-3,
            tiers=[HostTier(0), DiskTier([str(tmp_path), str(fast)])],
            subgroup_bytes="100KiB",
        )
        for step in range(4):
            _step(model, opt, step)
        opt.wait_io()
        slow_p, fast_p = opt.paths
        # Each path's share of the stored bytes follows its share of the
        # measured bandwidth, to within one subgroup.
        total = slow_p.bytes + fast_p.bytes
        stored = sum(sg.nbytes for sg in opt.subgroups if sg.file is not None)
        assert total == stored > 0
        biggest = max(sg.nbytes for sg in opt.subgroups)
        for p in (slow_p, fast_p):
            share = p.bw / (fast_p.bw + slow_p.bw)
            assert abs(p.bytes - share * total) <= biggest + 1, (p.dir, p.bw, p.bytes, total)
        opt.close()
    finally:
        import shutil

        shutil.rmtree(fast, ignore_errors=True)


def test_damaged_state_is_reported(tmp_path: Path) -> None:
    model = _model()
    tiers = [HostTier(0), DiskTier(str(tmp_path))]
    opt = offload(torch.optim.AdamW, model.parameters(), lr=1e-3, tiers=tiers, subgroup_bytes="64KiB")
    _step(model, opt, 0)
    opt.wait_io()
    sg = next(s for s in opt.subgroups if s.buf is None and s.file is not None)
    with open(sg.file, "r+b") as f:
        f.seek(sg.data_offset + 10)
        b = f.read(1)
        f.seek(sg.data_offset + 10)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError, match=f"subgroup {sg.index} is damaged"):
        _step(model, opt, 1)
    opt.close()


def test_state_dict_round_trip(tmp_path: Path) -> None:
    m1 = _model()
    opt = offload(torch.optim.AdamW, m1.parameters(), lr=1e-3, tiers=[HostTier(0), DiskTier(str(tmp_path))])
    for step in range(3):
        _step(m1, opt, step)
    sd = opt.state_dict()
    tierstore.save({"model": m1.state_dict(), "optim": sd}, tmp_path / "ck.pt")
    back = tierstore.load(tmp_path / "ck.pt")
    # Into the plain optimizer (compatible format) and into a new offloaded one.
    m2, m3 = _model(), _model()
    m2.load_state_dict(back["model"])
    m3.load_state_dict(back["model"])
    plain = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    plain.load_state_dict(back["optim"])
    opt3 = offload(torch.optim.AdamW, m3.parameters(), lr=1e-3, tiers=[HostTier(0), DiskTier(str(tmp_path / "b"))])
    opt3.load_state_dict(back["optim"])
    for step in range(3, 6):
        _step(m1, opt, step)
        _step(m2, plain, step)
        _step(m3, opt3, step)
    for a, b, c in zip(m1.parameters(), m2.parameters(), m3.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    opt.close()
    opt3.close()


def _shared_path_job(path: str, q: Any) -> None:
    torch.set_num_threads(1)
    m_ref, m_off = _model(1), copy.deepcopy(_model(1))
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3)
    opt = offload(torch.optim.AdamW, m_off.parameters(), lr=1e-3, tiers=[HostTier(0), DiskTier(path)])
    for step in range(5):
        _step(m_ref, ref, step)
        _step(m_off, opt, step)
    q.put(all(torch.equal(a, b) for a, b in zip(m_ref.parameters(), m_off.parameters(), strict=True)))
    opt.close()


def test_two_processes_share_one_path(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_shared_path_job, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results == [True, True]
    assert not any(tmp_path.iterdir())


def test_default_tiers_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_OFFLOAD_DIR", str(tmp_path / "scratch"))
    monkeypatch.setenv("TIERSTORE_OFFLOAD_HOST", "0")
    model = _model()
    opt = tierstore.offload(torch.optim.AdamW, model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    opt.wait_io()
    assert opt.placement()[str(tmp_path / "scratch")] > 0
    assert opt.param_groups[0]["lr"] == 1e-3
    opt.close()
