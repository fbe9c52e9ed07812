"""The GPU data path on a GPU (marker ``gpu``; skipped without one; run by
``make gpu-check``): bit-exact saves and loads of device tensors through
pinned buffers with no pageable copy, the Checkpointer's capture during real
training steps, and a resharding load into device memory."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import api, gpu
from tierstore.errors import ChecksumError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def _state() -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(300, 257, device="cuda", generator=g)
    return {
        "w": base,
        "view": base[7:19],  # shares w's storage
        "t": torch.randn(129, 65, device="cuda", generator=g).t(),  # not contiguous
        "bf16": torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16),
        "half": torch.randn(33, device="cuda", generator=g).half(),
        "ints": torch.randint(-(2**40), 2**40, (1000,), device="cuda", generator=g),
        "empty": torch.empty(0, 3, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda"),
        "cpu": torch.arange(10),
        "n": 7,
    }


def _same(a: object, b: object) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, dict):
        assert a.keys() == b.keys()  # type: ignore[attr-defined]
        for k in a:
            _same(a[k], b[k])  # type: ignore[index]
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.cpu(), b.cpu())
    else:
        assert a == b


@pytest.fixture
def no_pageable(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Inside it, ``storage.cpu()`` and ``storage.cuda()`` (pageable copies,
    torch's own GPU path) fail: tierstore's GPU path must not use them."""
    import contextlib

    @contextlib.contextmanager
    def refusing():  # type: ignore[no-untyped-def]
        def refuse(*_a: object, **_k: object) -> None:
            raise AssertionError("a pageable copy through storage.cpu()/.cuda()")

        with monkeypatch.context() as m:
            m.setattr(torch.UntypedStorage, "cpu", refuse)
            m.setattr(torch.UntypedStorage, "cuda", refuse)
            yield

    return refusing


def test_the_shim_is_in_use_where_a_compiler_is_found() -> None:
    st = gpu.status()
    if gpu.find_toolchain() is not None and os.environ.get("TIERSTORE_GPU_SHIM", "auto") == "auto":
        assert st["path"] == "shim", st
        assert st["devices"] and st["runtime_version"] > 0
    else:
        assert st["path"] == "torch", st


def test_save_and_load_gpu_tensors_bit_exact_both_ways(tmp_path: Path, no_pageable) -> None:  # type: ignore[no-untyped-def]
    sd = _state()
    p = tmp_path / "a.pt"
    with no_pageable():
        tierstore.save(sd, p)
        got = tierstore.load(p, map_location="cuda")
    _same(sd, got)
    assert got["w"].is_cuda and got["cpu"].is_cuda
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()  # still shared
    # torch reads tierstore's file, tierstore reads torch's.
    _same(sd, torch.load(p, map_location="cuda", weights_only=True))
    q = tmp_path / "t.pt"
    torch.save(sd, q)
    with no_pageable():
        _same(sd, tierstore.load(q, map_location="cuda:0"))
        _same(sd, tierstore.load(q, map_location=torch.device("cuda")))
    # A file object (streamed) too.
    buf = io.BytesIO()
    with no_pageable():
        tierstore.save(sd, buf)
    buf.seek(0)
    _same(sd, torch.load(buf, map_location="cuda", weights_only=True))


def test_each_storage_is_one_copy_into_pinned_memory_the_writer_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pageable
) -> None:  # type: ignore[no-untyped-def]
    """Count the copies: device -> pinned I/O buffer (one per storage) -> disk."""
    sd = {f"t{i}": torch.full((1000 + i,), float(i), device="cuda") for i in range(5)}
    seen: list[torch.UntypedStorage] = []
    real = api._add_storages

    def spy(
        target: object, prefix: str, storages: list[tuple[str, torch.UntypedStorage]], gates: object = None
    ) -> None:
        seen.extend(st for _k, st in storages)
        real(target, prefix, storages, gates)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "_add_storages", spy)
    c = gpu.copier("cuda")
    before = c.copies
    with no_pageable():
        tierstore.save(sd, tmp_path / "c.pt")
    assert c.copies - before == len(sd)
    assert len(seen) == len(sd)
    s = gpu.shim()
    for st in seen:
        assert st.device.type == "cpu"
        if s is not None:
            assert s.is_pinned(st.data_ptr()), "the writer reads pinned memory the GPU copied into"
        else:
            assert torch.empty(0).set_(st).is_pinned()
    before = c.copies
    with no_pageable():
        got = tierstore.load(tmp_path / "c.pt", map_location="cuda")
    assert c.copies - before >= len(sd)  # one or more windows per record, each one H2D copy
    _same(sd, got)


def test_a_damaged_record_is_refused_on_the_way_to_the_gpu(tmp_path: Path) -> None:
    p = tmp_path / "d.pt"
    tierstore.save({"w": torch.arange(1 << 20, dtype=torch.float32, device="cuda")}, p)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # inside the 4 MiB record
    p.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"d\.pt.*data/0"):
        tierstore.load(p, map_location="cuda")


def test_a_large_record_crosses_many_windows(tmp_path: Path) -> None:
    w = torch.randn(3 * (64 << 20) // 4 + 12345, device="cuda")  # more than the ring holds, not page-sized
    p = tmp_path / "big.pt"
    tierstore.save({"w": w}, p)
    got = tierstore.load(p, map_location="cuda")
    assert torch.equal(got["w"], w)


def test_copy2d_writes_a_column_shard_into_device_memory() -> None:
    c = gpu.copier("cuda")
    host = gpu.pinned_empty((64, 48), torch.float32)
    host.copy_(torch.arange(64 * 48, dtype=torch.float32).view(64, 48))
    dev = torch.zeros(64, 100, device="cuda")
    # columns 16..39 of the host rows into columns 50..73 of the device rows
    es = 4
    c.copy2d(dev.data_ptr() + 50 * es, 100 * es, host.data_ptr() + 16 * es, 48 * es, 24 * es, 64, gpu.H2D)
    c.synchronize()
    want = torch.zeros(64, 100)
    want[:, 50:74] = host[:, 16:40]
    assert torch.equal(dev.cpu(), want)


def test_checkpointer_capture_during_training_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with tierstore.Checkpointer(
        tmp_path / "run", tiers=[tierstore.HostTier("256MiB"), tierstore.DiskTier(str(tmp_path / "disk"))]
    ) as ckpt:
        ckpt.attach(opt)
        for step in range(1, 9):
            loss = model(x).square().mean()
            loss.backward()
            if step % 3 == 0:
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                expected[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                ckpt.save(step, state)  # returns at once; the step below waits on the device only
            opt.step()
            opt.zero_grad()
        ckpt.wait()
        for h in ckpt.handles():
            assert h.error is None and "blocked" in h.timings
    with tierstore.Checkpointer(
        tmp_path / "run", tiers=[tierstore.HostTier("256MiB"), tierstore.DiskTier(str(tmp_path / "disk"))]
    ) as again:
        got = again.load_latest()
    last = max(expected)
    for k, v in expected[last].items():
        assert torch.equal(got["model"][k].cpu(), v.cpu()), k
    # The saved state is the one at save time, not after the step that followed.
    assert not all(torch.equal(got["model"][k].cpu(), p.detach().cpu()) for k, p in model.state_dict().items())


def test_resharding_load_into_device_memory(tmp_path: Path) -> None:
    from tierstore import Layout

    full = torch.randn(64, 96)
    tierstore.save_sharded({"w": full}, tmp_path / "ck")
    # Load a column shard (a TP split of dim 1 in 3) straight onto the GPU.
    lay = Layout.shard("w", (64, 96), dim=1, rank=1, world=3)
    target = {"w": tierstore.attach(torch.zeros(64, 32, device="cuda"), lay)}
    tierstore.load_sharded(tmp_path / "ck", target)
    assert target["w"].is_cuda
    assert torch.equal(target["w"].cpu(), full[:, 32:64])


def test_without_map_location_each_storage_goes_back_where_it_was_saved(tmp_path: Path, no_pageable) -> None:  # type: ignore[no-untyped-def]
    sd = {"g": torch.randn(1000, device="cuda"), "c": torch.randn(10), "h": torch.ones(7, device="cuda").half()}
    p = tmp_path / "m.pt"
    torch.save(sd, p)
    with no_pageable():
        got = tierstore.load(p)  # the GPU storages through pinned memory, the CPU one by the engine
    assert got["g"].is_cuda and got["h"].is_cuda and not got["c"].is_cuda
    _same(sd, got)
    with no_pageable():
        back = tierstore.load(p, map_location={"cuda:0": "cpu"})
    assert not back["g"].is_cuda and torch.equal(back["g"], sd["g"].cpu())
