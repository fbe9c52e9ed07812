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


def _hold_a_pause(inside: threading.Event, release: threading.Event) -> threading.Thread:
    @_gc.paused
    def long() -> None:
        inside.set()
        release.wait(10)

    t = threading.Thread(target=long)
    t.start()
    assert inside.wait(10)
    return t


def test_the_unpickler_does_not_switch_the_collector_on_under_another_threads_pause() -> None:
    """The fast unpickler pauses the collector (a load of many tensors makes
    many small objects); its pause nests with the others. Here another
    thread (a Checkpointer's flush, say) starts a pause while the unpickler
    runs: the collector stays off until that pause ends too."""
    import io
    import pickle

    from tierstore import _pickle

    class Pid:
        def __init__(self, key: str) -> None:
            self.key = key

    class P(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", torch.UntypedStorage, obj.key, "cpu", 4) if isinstance(obj, Pid) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"x": torch._utils._rebuild_tensor_v2, "s": Pid("0")})
    threads: list[threading.Thread] = []
    inside, release = threading.Event(), threading.Event()

    def persistent_load(pid: tuple[object, ...]) -> torch.UntypedStorage:
        assert not gc.isenabled()  # the unpickler's own pause
        threads.append(_hold_a_pause(inside, release))
        return torch.UntypedStorage(4)

    gc.enable()
    try:
        got = _pickle.fast_weights_only(buf.getvalue(), persistent_load)
        assert got is not None and threads
        assert not gc.isenabled()  # the other thread's pause is still on
    finally:
        release.set()
        for t in threads:
            t.join()
    assert gc.isenabled()


def test_a_load_does_not_switch_the_collector_on_under_another_threads_pause(tmp_path: pathlib.Path) -> None:
    """The unpicklers pause the collector too (a load of many tensors makes
    many small objects); their pause nests with the others: a load on the
    training thread while a Checkpointer's flush holds a pause must leave
    the collector off until the flush ends."""
    tierstore.save({"t": torch.ones(3), "u": [1, 2]}, tmp_path / "a.pt")
    torch.save({"t": torch.ones(3)}, tmp_path / "b.pt")
    inside, release = threading.Event(), threading.Event()
    t = _hold_a_pause(inside, release)
    try:
        got = tierstore.load(tmp_path / "a.pt")  # the fast weights-only unpickler
        assert not gc.isenabled()
        tierstore.load(tmp_path / "b.pt")  # torch's file: data.pkl scanned first
        assert not gc.isenabled()
    finally:
        release.set()
        t.join()
    assert torch.equal(got["t"], torch.ones(3)) and gc.isenabled()
