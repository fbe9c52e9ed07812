"""The capture copies every kind of host tensor exactly, whichever thread copies it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.checkpointer import _copy_host


def _cases() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.randn(64, 1024)  # 256 KiB: the memmove path
    c = torch.randn(128, 128, dtype=torch.complex64)
    return {
        "big": big,
        "big_view_with_offset": big[8:],
        "big_transposed": big.t(),  # not contiguous: torch's copy
        "conj": c.conj(),  # a lazy conjugate: its bytes are not the values
        "neg": torch.randn(128, 256, dtype=torch.complex64).conj().imag,  # negative-bit view
        "bf16": torch.randn(256, 512).to(torch.bfloat16),
        "int8": torch.randint(-128, 127, (300_000,), dtype=torch.int8),
        "bool": torch.rand(100_000) > 0.5,
        "scalar": torch.tensor(3.5),
        "small": torch.arange(7, dtype=torch.float64),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_copy_host_equals_torch_copy(name: str) -> None:
    src = _cases()[name]
    dst = torch.empty(src.shape, dtype=src.dtype)
    _copy_host(dst, src)
    assert torch.equal(dst.resolve_conj().resolve_neg(), src.resolve_conj().resolve_neg())


def test_checkpoint_of_every_kind_round_trips(tmp_path: Path) -> None:
    state = _cases()
    expect = {k: v.clone() for k, v in state.items()}
    with tierstore.Checkpointer(tmp_path / "run") as ck:
        ck.save(1, state)
        ck.wait()
    with tierstore.Checkpointer(tmp_path / "run") as ck:
        got = ck.load_latest()
    for k, v in expect.items():
        g = got[k]
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg()), k
