"""The Checkpointer's adaptive interval, on timings given by hand: it grows
to keep a checkpoint's blocking time under ``max_overhead`` of the step
time, shrinks back when four times what is needed, and does not count the
time the optimizer hook waited as step time."""

from __future__ import annotations

from tierstore._ckpt_interval import AdaptiveInterval
from tierstore._ckpt_snapshot import CheckpointHandle


def _handle(step: int, blocked: float, state: str = "durable") -> CheckpointHandle:
    h = CheckpointHandle(step, ["host", "disk"])
    for name in h.tiers:
        h._set(name, state)
    h.timings["blocked"] = blocked
    return h


def _steps(s: AdaptiveInterval, step_s: float, waits_s: float, n: int, t: float = 0.0) -> float:
    """``n`` steps of ``step_s`` each, the hook waiting ``waits_s`` in each."""
    for _ in range(n):
        s.step_began(t)
        t += waits_s
        s.step_resumed(t)
        t += step_s
    return t


def test_fixed_interval_without_max_overhead() -> None:
    s = AdaptiveInterval(3, None)
    assert [st for st in range(10) if s.due(st)] == [0, 3, 6, 9]
    s.saved(4, [_handle(0, 100.0)])
    assert s.interval == 3 and not s.due(6) and s.due(7)


def test_grows_with_blocking_and_shrinks_back() -> None:
    s = AdaptiveInterval(1, 0.01)
    _steps(s, 1.0, 0.0, 10)
    s.saved(0, [_handle(0, 0.05)])  # 5% of a step per checkpoint: every 5 steps keeps it at 1%
    assert s.interval == 5
    assert not s.due(4) and s.due(5)
    s.saved(5, [_handle(0, 0.05), _handle(5, 0.2)])  # the newest counts: 20 steps
    assert s.interval == 20
    s.saved(25, [_handle(5, 0.2), _handle(25, 0.05)])  # needs 5: 5 * 4 <= 20, halved
    assert s.interval == 10
    s.saved(35, [_handle(25, 0.05), _handle(35, 0.05)])  # needs 5: 5 * 4 > 10, kept
    assert s.interval == 10


def test_skipped_and_failed_checkpoints_do_not_count() -> None:
    s = AdaptiveInterval(2, 0.01)
    _steps(s, 1.0, 0.0, 5)
    s.saved(0, [_handle(0, 0.5, "skipped"), _handle(1, 0.5, "failed")])
    assert s.interval == 2
    s.saved(2, [_handle(0, 0.08), _handle(1, 0.5, "failed")])
    assert s.interval == 8


def test_hook_wait_is_not_step_time() -> None:
    s = AdaptiveInterval(1, 0.01)
    _steps(s, 1.0, 9.0, 10)  # each step 1 s of training, 9 s waiting in the hook
    s.saved(0, [_handle(0, 0.1)])
    assert s.interval == 10  # 0.1 / (0.01 * 1 s); with the wait counted it would be 1


def test_step_time_is_the_median_of_the_last_steps() -> None:
    s = AdaptiveInterval(1, 0.01)
    t = _steps(s, 100.0, 0.0, 3)  # old, slow steps fall out of the window
    _steps(s, 1.0, 0.0, 60, t)
    s.saved(0, [_handle(0, 0.03)])
    assert s.interval == 3
