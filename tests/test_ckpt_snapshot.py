"""A Checkpointer snapshot's states only move forward, and its host copy is
never released while its capture still writes into the buffers."""

from __future__ import annotations

import pytest

from tierstore._ckpt_snapshot import Capture, CheckpointHandle, Residency, Snapshot
from tierstore.errors import InternalError


def _snap() -> Snapshot:
    return Snapshot(1, 0, CheckpointHandle(1, ["host", "local"]))


def test_host_copy_is_not_released_while_the_capture_copies() -> None:
    s = _snap()
    with pytest.raises(InternalError, match="still copies"):
        s.release_host(Residency.EVICTABLE)
    assert s.residency is Residency.HELD and s.in_host and not s.evictable
    s.advance(Capture.MUTABLE_DONE)
    with pytest.raises(InternalError):
        s.release_host(Residency.EVICTED)
    s.advance(Capture.CAPTURED)
    s.release_host(Residency.EVICTABLE)
    assert s.evictable and s.in_host
    s.release_host(Residency.HELD)  # a state passed: kept
    s.release_host(Residency.EVICTED)
    assert s.residency is Residency.EVICTED and not s.in_host


def test_capture_moves_forward_and_failure_is_final() -> None:
    s = _snap()
    s.advance(Capture.CAPTURED)
    assert s.mutable_done.is_set() and s.captured.is_set()
    s.advance(Capture.MUTABLE_DONE)  # already passed
    assert s.capture is Capture.CAPTURED
    f = _snap()
    err = RuntimeError("boom")
    f.fail(err)
    f.fail(RuntimeError("later"))
    assert f.capture is Capture.FAILED and f.error is err
    f.advance(Capture.CAPTURED)  # waiters are released; the state stays failed
    assert f.capture is Capture.FAILED and f.captured.is_set()
    with pytest.raises(InternalError):
        f.advance(Capture.FAILED)
