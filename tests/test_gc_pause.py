"""save and load pause Python's cyclic collector while they run (it walked
every object of a 20,000-tensor state many times per save) and leave it as
they found it: enabled or not, after an error, and across threads."""

from __future__ import annotations

import gc
import pathlib
import threading
from typing import ClassVar

import pytest
import torch

import tierstore
from tierstore import _gc


def test_collector_is_paused_during_a_save_and_restored(tmp_path: pathlib.Path) -> None:
    seen: list[bool] = []

    class Probe:
        def __reduce__(self) -> tuple[type, tuple[()]]:
            seen.append(gc.isenabled())  # called by the pickler, inside save
            return (dict, ())

    assert gc.isenabled()
    tierstore.save({"t": torch.ones(3), "p": Probe()}, tmp_path / "a.pt")
    assert seen == [False]
    assert gc.isenabled()
    got = tierstore.load(tmp_path / "a.pt", weights_only=False)
    assert torch.equal(got["t"], torch.ones(3)) and gc.isenabled()


def test_a_disabled_collector_stays_disabled(tmp_path: pathlib.Path) -> None:
    gc.disable()
    try:
        tierstore.save({"t": torch.ones(3)}, tmp_path / "a.pt")
        tierstore.load(tmp_path / "a.pt")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_restores_the_collector(tmp_path: pathlib.Path) -> None:
    with pytest.raises(tierstore.TierstoreError):
        tierstore.load(tmp_path / "missing.pt")
    assert gc.isenabled()


def test_pauses_nest_across_threads() -> None:
    inside = threading.Event()
    release = threading.Event()

    @_gc.paused
    def long() -> None:
        inside.set()
        release.wait(10)

    @_gc.paused
    def short() -> bool:
        return gc.isenabled()

    t = threading.Thread(target=long)
    t.start()
    inside.wait(10)
    assert short() is False
    assert not gc.isenabled()  # the other thread's pause is still on
    release.set()
    t.join()
    assert gc.isenabled()


class _Probe:
    """Records, each time it is pickled (or deep-copied), the thread and
    whether the collector was on; the copy is a probe again."""

    seen: ClassVar[list[tuple[str, bool]]] = []

    def __reduce__(self) -> tuple[type, tuple[()]]:
        _Probe.seen.append((threading.current_thread().name, gc.isenabled()))
        return (_Probe, ())


def test_the_checkpointer_writes_a_snapshot_with_the_collector_paused(tmp_path: pathlib.Path) -> None:
    """The flush thread allocates enough (pickle, manifest, layout rules) to
    start collections that walk every object of the process while holding
    the GIL the training thread needs: it pauses the collector while it
    writes a snapshot, and the collector is back on once it is done."""
    _Probe.seen.clear()
    assert gc.isenabled()
    tiers = [tierstore.HostTier("64MiB"), tierstore.DiskTier(str(tmp_path / "disk"))]
    with tierstore.Checkpointer(tmp_path / "ck", tiers=tiers) as ck:
        h = ck.save(1, {"w": torch.ones(8), "probe": _Probe()})
        h.wait()
        flushed = [on for name, on in _Probe.seen if name != "MainThread"]  # the flush or its pickler
        assert flushed and not any(flushed), _Probe.seen  # pickled by the flush, the collector off
    # On again once the flush is over (it ends shortly after the snapshot
    # is durable; close waited for it).
    assert gc.isenabled()
