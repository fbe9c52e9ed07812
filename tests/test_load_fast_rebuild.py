"""The weights-only fast path builds tensors with its own copy of
``torch._utils._rebuild_tensor_v2`` (the fake-mode check done once per load,
not once per tensor): every tensor must come out exactly as torch.load
builds it, and under a fake tensor mode torch's own function must be used."""

from __future__ import annotations

from pathlib import Path

import torch

import tierstore
from tierstore import _pickle


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
    assert a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
    assert torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg())
    assert a._backward_hooks == b._backward_hooks


def test_tensors_rebuilt_as_torch_load_builds_them(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    c = torch.randn(4, dtype=torch.complex64)
    sd = {
        "plain": base,
        "view": base[1:, 2:7],
        "t": base.t(),
        "grad": torch.ones(3, requires_grad=True),
        "conj": c.conj(),
        "neg": torch.randn(3)._neg_view(),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "bf16": torch.randn(7).bfloat16(),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
    }
    p = tmp_path / "x.pt"
    tierstore.save(sd, p)
    ours, theirs = tierstore.load(p), torch.load(p)
    assert ours.keys() == theirs.keys()
    for k in sd:
        _same(ours[k], theirs[k])
    assert ours["view"].untyped_storage().data_ptr() == ours["plain"].untyped_storage().data_ptr()


def test_fast_rebuild_is_used_only_outside_fake_modes(tmp_path: Path, monkeypatch: object) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = tmp_path / "y.pt"
    tierstore.save({"w": torch.randn(3, 3)}, p)
    calls: list[int] = []
    real = _pickle.rebuild_tensor_v2

    def counting(*a: object, **k: object) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    import pytest

    mp = pytest.MonkeyPatch()
    mp.setattr(_pickle, "rebuild_tensor_v2", counting)
    try:
        tierstore.load(p)
        assert calls == [1]
        with FakeTensorMode():
            got = tierstore.load(p)
            want = torch.load(p)
        assert calls == [1], "under a fake mode torch's own loader runs"
        assert type(got["w"]) is type(want["w"]) and got["w"].shape == (3, 3)
    finally:
        mp.undo()
