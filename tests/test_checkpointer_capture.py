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


@pytest.mark.parametrize("name", list(_cases()))
def test_copy_host_with_a_gate_equals_torch_copy(name: str) -> None:
    """The capture thread's copy through the gate (the engine's copy that
    checksums as it goes) gives the bytes torch's copy gives."""
    from tierstore import _core

    src = _cases()[name]
    dst = torch.empty(src.shape, dtype=src.dtype)
    _copy_host(dst, src, _core.Gate(), 1)
    assert torch.equal(dst.resolve_conj().resolve_neg(), src.resolve_conj().resolve_neg())


@pytest.mark.parametrize("torn", [False, True])
def test_writer_takes_the_capture_sums_and_a_torn_copy_is_damage(tmp_path: Path, torn: bool) -> None:
    """The writer takes the sums the capture computed from the source instead
    of reading the copy again: a copy that differs from what was summed (a
    source changed during its copy) is written with sums that do not match,
    and a load reports the damage instead of returning torn values."""
    from tierstore import _core
    from tierstore.api import write_file

    src = torch.randn(300_000)  # 1.2 MB: whole and partial 4 KiB chunks
    dst = torch.empty_like(src)
    gate = _core.Gate()
    _copy_host(dst, src, gate, 1)
    assert torch.equal(dst, src)
    if torn:
        dst[123_456] += 1.0  # after the sums were taken, before the writer reads it
    gate.advance(1)
    path = tmp_path / "snap.pt"
    write_file({"t": dst}, path, gates={dst.untyped_storage().data_ptr(): (gate, 1)}, chunk_checksums=True)
    if not torn:
        assert torch.equal(tierstore.load(path)["t"], src)
        return
    with pytest.raises(tierstore.TierstoreError) as e:
        tierstore.load(path)
    assert "snap.pt" in str(e.value)


def test_copy_in_refuses_overlap_and_null() -> None:
    from tierstore import _core

    t = torch.zeros(4096, dtype=torch.uint8)
    g = _core.Gate()
    with pytest.raises(ValueError, match="overlap"):
        g.copy_in(1, t.data_ptr() + 8, t.data_ptr(), 1024)
    with pytest.raises(ValueError, match="null"):
        g.copy_in(1, 0, t.data_ptr(), 16)


def test_tied_weights_are_captured_once_and_restored_shared(tmp_path: Path) -> None:
    """A state dict holds a separate tensor object per name, so tied weights
    (an embedding and an output head) are two tensors over one storage. The
    capture copies and writes that memory once, and the restored state
    shares it as the saved one did (and as ``torch.save``'s file does);
    other views of the same storage are still captured exactly."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10_000, 64)
    head = torch.nn.Linear(64, 10_000, bias=False)
    head.weight = emb.weight
    sd = torch.nn.Sequential(emb, head).state_dict()
    assert sd["0.weight"] is not sd["1.weight"]
    assert sd["0.weight"].data_ptr() == sd["1.weight"].data_ptr()
    w = emb.weight.detach()
    state = {"model": sd, "rows": w[3:], "cols": w.t()}
    with tierstore.Checkpointer(tmp_path / "run") as ck:
        ck.save(1, state)
        ck.wait()
        # Three copies of the weight's bytes (the tied pair once, rows, cols), not four.
        assert ck.pool.peak < 3 * w.nbytes + (1 << 20)
    with tierstore.Checkpointer(tmp_path / "run") as ck:
        got = ck.load_latest()
    m = got["model"]
    assert torch.equal(m["0.weight"], w) and torch.equal(m["1.weight"], w)
    assert m["0.weight"].untyped_storage().data_ptr() == m["1.weight"].untyped_storage().data_ptr()
    assert torch.equal(got["rows"], w[3:]) and torch.equal(got["cols"], w.t())
