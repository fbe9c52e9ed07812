"""The Rust pickler writes what Python's pickler writes for torch.save, or gives up."""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch
from conftest import tensors_equal
from hypothesis import HealthCheck, given, settings
from test_roundtrip import objects
from test_weights_only import _torch_unpickle

from tierstore import _core, _pickle


def _fast(obj: Any) -> bytes | None:
    col = _pickle.StorageCollector()
    return _core.fast_dumps(obj, torch.Tensor, OrderedDict, col.tensor_args)


def _slow(obj: Any) -> bytes:
    buf = io.BytesIO()
    _pickle._Pickler(buf, 2, _pickle.StorageCollector()).dump(obj)
    return buf.getvalue()


def _structure(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.requires_grad)
    if isinstance(x, dict):
        return (type(x).__name__, [(k, _structure(v)) for k, v in x.items()], getattr(x, "__dict__", None))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_structure(v) for v in x])
    return (type(x).__name__, x)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=objects)
def test_fast_pickle_unpickles_like_python_pickle(obj: Any) -> None:
    fast = _fast(obj)
    if fast is None:
        return
    assert _structure(_torch_unpickle(fast)) == _structure(_torch_unpickle(_slow(obj)))


def test_state_dict_takes_the_fast_path_and_keeps_order_sharing_and_metadata() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    sd.move_to_end("0.weight")  # OrderedDict order differs from insertion order
    shared = [1, 2]
    t = torch.randn(3)
    obj = {"sd": sd, "a": shared, "b": shared, "t1": t, "t2": t, "view": t[1:], "big": 2**62, "neg": -(2**40)}
    data = _fast(obj)
    assert data is not None
    back = _torch_unpickle(data)
    assert list(back["sd"]) == list(sd), "OrderedDict order is kept"
    assert back["sd"]._metadata == sd._metadata
    assert back["a"] is back["b"], "shared objects stay shared"
    assert back["t1"] is back["t2"]
    assert back["view"].storage_offset() == 1
    assert back["big"] == 2**62 and back["neg"] == -(2**40)


def test_gives_up_on_what_it_does_not_know() -> None:
    class Custom:
        pass

    assert _fast({"c": Custom()}) is None
    assert _fast({"p": torch.nn.Parameter(torch.ones(2))}) is None
    assert _fast({"s": {1, 2}}) is None
    assert _fast({"huge": 2**80}) is None
    t = torch.ones(2)
    t.note = "python state"  # type: ignore[attr-defined]
    assert _fast({"t": t}) is None


def test_fallback_file_is_identical_in_content(tmp_path: Any) -> None:
    import tierstore

    obj = {"p": torch.nn.Parameter(torch.ones(2)), "t": torch.arange(3)}
    tierstore.save(obj, tmp_path / "x.pt")
    back = torch.load(tmp_path / "x.pt")
    assert isinstance(back["p"], torch.nn.Parameter)
    assert tensors_equal(back["t"], obj["t"])
