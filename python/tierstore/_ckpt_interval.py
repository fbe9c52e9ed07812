"""When a checkpoint is due: every ``interval`` steps, and with
``max_overhead`` an interval that grows while a checkpoint's blocking time,
spread over the interval's steps, exceeds that share of the step time (and
shrinks back when it is four times what is needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tierstore._ckpt_snapshot import CheckpointHandle

# The step time is the median of this many last steps.
STEPS_KEPT = 50


class AdaptiveInterval:
    """The Checkpointer's schedule: :meth:`due` answers the training loop,
    :meth:`step_began` / :meth:`step_resumed` time the steps (from the
    optimizer pre-hook: the time the hook waited is not step time), and
    :meth:`saved` adapts the interval before each checkpoint starts."""

    def __init__(self, interval: int, max_overhead: float | None) -> None:
        self.interval = interval
        self.min_interval = interval
        self.max_overhead = max_overhead
        self.last_step: int | None = None
        self._step_times: list[float] = []
        self._resumed: float | None = None

    def due(self, step: int) -> bool:
        if self.last_step is None:
            return step % self.interval == 0
        return step - self.last_step >= self.interval

    def step_began(self, now: float) -> None:
        if self._resumed is not None:
            self._step_times.append(now - self._resumed)
            del self._step_times[:-STEPS_KEPT]

    def step_resumed(self, now: float) -> None:
        self._resumed = now

    def saved(self, step: int, handles: Sequence[CheckpointHandle]) -> None:
        """A checkpoint of ``step`` starts; ``handles``: the earlier ones, the
        newest of which (not skipped or failed) gives the blocking time."""
        self._adapt(handles)
        self.last_step = step

    def _adapt(self, handles: Sequence[CheckpointHandle]) -> None:
        if self.max_overhead is None or not self._step_times:
            return
        prev = [h for h in handles if h.state not in ("skipped", "failed")]
        if not prev:
            return
        blocked = prev[-1].timings.get("blocked", 0.0)
        step_t = sorted(self._step_times)[len(self._step_times) // 2]
        if step_t <= 0:
            return
        need = max(self.min_interval, math.ceil(blocked / (self.max_overhead * step_t)))
        if need > self.interval:
            self.interval = need
        elif need * 4 <= self.interval:
            self.interval = max(self.min_interval, self.interval // 2)
