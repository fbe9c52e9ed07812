"""Which storages a load sends to a GPU, decided before reading: the saved
locations read from data.pkl's opcodes (never by unpickling it), and the
routes map_location makes of them. The device side runs in test_gpu.py."""

from __future__ import annotations

import io
import pickle
import random
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tierstore
from tierstore import _load, _pickle


def _data_pkl(blob: bytes) -> bytes:
    z = zipfile.ZipFile(io.BytesIO(blob))
    return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _ids(data: bytes) -> dict[str, str]:
    """The persistent ids an unpickler actually meets (the reference)."""
    seen: dict[str, str] = {}

    class U(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            seen[pid[2]] = pid[3]
            dtype = torch.uint8 if pid[1] is torch.UntypedStorage else pid[1].dtype
            return torch.storage.TypedStorage(pid[4], dtype=dtype, device="meta")

    with warnings.catch_warnings():  # TypedStorage's deprecation
        warnings.simplefilter("ignore")
        U(io.BytesIO(data)).load()
    return seen


@pytest.fixture
def as_cuda1() -> Iterator[None]:
    """torch.save tags storages as saved on cuda:1 (a tagger ahead of torch's)."""
    entry = (0, lambda obj: "cuda:1", lambda obj, loc: obj)
    torch.serialization._package_registry.insert(0, entry)
    try:
        yield
    finally:
        torch.serialization._package_registry.remove(entry)


def _state() -> dict[str, Any]:
    base = torch.randn(10)
    return {
        "a": base,
        "view": base[2:5],
        "b": [torch.arange(4), torch.ones(2, dtype=torch.bfloat16)],
        "n": {"x": 1, "y": "cpu"},
        "e": torch.empty(0),
    }


@pytest.mark.parametrize("saver", ["torch", "tierstore"])
def test_the_scan_finds_every_storage_location(saver: str) -> None:
    b = io.BytesIO()
    (torch.save if saver == "torch" else tierstore.save)(_state(), b)
    data = _data_pkl(b.getvalue())
    got = _pickle.saved_locations(data)
    assert got == _ids(data) and len(got) == 4 and set(got.values()) == {"cpu"}


def test_the_scan_reads_gpu_locations(as_cuda1: None) -> None:
    b = io.BytesIO()
    torch.save(_state(), b)
    data = _data_pkl(b.getvalue())
    got = _pickle.saved_locations(data)
    assert got == _ids(data) and set(got.values()) == {"cuda:1"}


def test_the_scan_survives_any_damage() -> None:
    b = io.BytesIO()
    torch.save(_state(), b)
    data = _data_pkl(b.getvalue())
    rng = random.Random(7)
    assert _pickle.saved_locations(b"") is None or _pickle.saved_locations(b"") == {}
    for _ in range(2000):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        cut = bytes(bad[: rng.randint(0, len(bad))]) if rng.random() < 0.3 else bytes(bad)
        r = _pickle.saved_locations(cut)  # never raises, never runs anything
        assert r is None or (isinstance(r, dict) and all(isinstance(k, str) for k in r))


def test_routes_follow_map_location(monkeypatch: pytest.MonkeyPatch, as_cuda1: None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    b = io.BytesIO()
    torch.save({"w": torch.ones(3), "v": torch.zeros(2)}, b)
    data = _data_pkl(b.getvalue())
    keys = ["0", "1"]
    c0, c1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert _load._gpu_routes(None, data, keys) == {"0": c1, "1": c1}  # where they were saved
    assert _load._gpu_routes("cuda", data, keys) == {"0": c0, "1": c0}
    assert _load._gpu_routes(torch.device("cuda:1"), data, keys) == {"0": c1, "1": c1}
    assert _load._gpu_routes({"cuda:1": "cuda:0"}, data, keys) == {"0": c0, "1": c0}
    assert _load._gpu_routes({"cuda:1": "cpu"}, data, keys) == {}
    assert _load._gpu_routes("cpu", data, keys) == {}
    assert _load._gpu_routes(lambda s, loc: s, data, keys) == {}  # a callable may do anything: torch's path
    assert _load._gpu_routes("cuda:5", data, keys) == {}  # no such device: torch's restore says so
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load._gpu_routes(None, data, keys) == {}
