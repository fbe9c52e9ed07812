"""An offloaded subgroup's lifecycle is explicit: its state is derived from
what it holds (so it cannot disagree with it), and a transfer that does not
start from a state that allows it is refused before it touches anything."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore._offload_subgroup import MOVES, Residence, Subgroup
from tierstore.errors import InternalError


def test_the_state_follows_what_the_subgroup_holds() -> None:
    sg = Subgroup(0, 0, [torch.zeros(4)], 0)
    assert sg.state is Residence.NEW
    sg.file = Path("sg-000000.1.bin")
    assert sg.state is Residence.ON_DISK
    sg.reading = Future()
    assert sg.state is Residence.READING
    sg.reading, sg.buf = None, torch.empty(4096, dtype=torch.uint8)
    assert sg.state is Residence.RESIDENT
    sg.writing = Future()
    assert sg.state is Residence.WRITING


def test_moves_outside_the_table_are_refused() -> None:
    sg = Subgroup(3, 0, [torch.zeros(4)], 0)
    sg.file = Path("sg-000003.1.bin")  # on disk
    sg.move(Residence.READING)
    sg.move(Residence.RESIDENT)
    with pytest.raises(InternalError, match="subgroup 3 is on disk: it cannot become writing back"):
        sg.move(Residence.WRITING)
    for state, allowed in MOVES.items():
        assert state not in allowed, f"{state} moves to itself"
    assert all(MOVES[s] for s in Residence), "every state has a way on"


def test_a_write_back_of_a_subgroup_on_disk_is_refused(tmp_path: Path) -> None:
    """Through the store: a write-back needs a resident subgroup, a read one on
    disk; the refusal leaves the optimizer usable."""
    params = [torch.nn.Parameter(torch.randn(1 << 12)) for _ in range(4)]
    opt = tierstore.offload(
        torch.optim.AdamW,
        params,
        tiers=[tierstore.HostTier(0), tierstore.DiskTier(str(tmp_path))],
        subgroup_bytes="64KiB",
    )
    try:
        store = opt._store
        on_disk = next(sg for sg in opt.subgroups if sg.state is Residence.ON_DISK)
        with pytest.raises(InternalError, match="cannot become writing back"):
            store.start_write(on_disk)
        store.load_sync(on_disk)
        assert on_disk.state is Residence.RESIDENT
        with pytest.raises(InternalError, match="cannot become reading"):
            store.start_read(on_disk)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.wait_io()
    finally:
        opt.close()
