"""weights_only=True: the Rust fast path follows torch's rules exactly, and
anything outside them goes to torch's own unpickler (which refuses it)."""

from __future__ import annotations

import io
import os
import pathlib
import zipfile
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from conftest import tensors_equal
from hypothesis import HealthCheck, given, settings
from test_roundtrip import objects

import tierstore
from tierstore import _pickle


def _data_pkl(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        return z.read("archive/data.pkl")


def _storage_loader() -> Any:
    cache: dict[str, Any] = {}

    def persistent_load(pid: tuple[Any, ...]) -> Any:
        _, stype, key, _loc, numel = pid
        if key not in cache:
            dtype = torch.uint8 if stype is torch.UntypedStorage else stype.dtype
            raw = torch.UntypedStorage(numel * dtype.itemsize)
            cache[key] = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        return cache[key]

    return persistent_load


def _torch_unpickle(data: bytes) -> Any:
    from torch import _weights_only_unpickler as wo

    u = wo.Unpickler(io.BytesIO(data), encoding="utf-8")
    u.persistent_load = _storage_loader()
    return u.load()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=objects)
def test_fast_path_matches_torch(obj: Any) -> None:
    data = _data_pkl(obj)
    fast = _pickle.fast_weights_only(data, _storage_loader())
    ref = _torch_unpickle(data)
    if fast is not None:
        # Storage contents are not loaded here; compare structure, shapes, dtypes.
        def shape(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return ("T", x.dtype, tuple(x.shape), x.stride(), x.storage_offset())
            if isinstance(x, dict):
                return {k: shape(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(shape(v) for v in x)
            return x

        assert shape(fast) == shape(ref)


def test_state_dicts_take_the_fast_path_with_metadata() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    data = _data_pkl({"model": sd, "n": 3, "x": 2.5, "big": 2**40, "neg": -(2**40)})
    fast = _pickle.fast_weights_only(data, _storage_loader())
    assert fast is not None, "a plain state dict must not fall back to the slow path"
    assert fast["model"]._metadata == sd._metadata
    assert fast["big"] == 2**40 and fast["neg"] == -(2**40)


@given(n=st.integers(-(2**63), 2**63 - 1))
def test_integers(n: int) -> None:
    fast = _pickle.fast_weights_only(_data_pkl({"n": n}), _storage_loader())
    assert fast == {"n": n}


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_not_run(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil(str(marker))}, p)
    assert _pickle.fast_weights_only(_data_pkl({"x": Evil(str(marker))}), _storage_loader()) is None
    with pytest.raises(tierstore.UnsafeObjectError, match="system"):
        tierstore.load(p)
    assert not marker.exists(), "nothing from the file was executed"


def test_safe_globals_are_honoured_by_the_fast_path(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "s.pt"
    sd = {"size": torch.Size([2, 3]), "dev": torch.device("cpu"), "dt": torch.float16, "t": torch.arange(3)}
    tierstore.save(sd, p)
    back = tierstore.load(p)
    assert tensors_equal(back, sd)
