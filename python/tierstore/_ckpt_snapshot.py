"""A Checkpointer snapshot and its handle: what one ``save`` captured, and
where it stands.

A snapshot's life has two explicit dimensions, each an enum whose states
only move forward, in the enum's order:

- :class:`Capture`, the copy into host memory:
  ``COPYING`` → ``MUTABLE_DONE`` (every tensor the optimizer step changes is
  copied: the step may run) → ``CAPTURED`` (every tensor copied); any of them
  → ``FAILED``. ``FAILED`` is final.
- :class:`Residency`, the host copy: ``HELD`` (needed: not yet durable on a
  disk tier) → ``EVICTABLE`` (durable elsewhere: its buffer may be reused
  when room is needed) → ``EVICTED`` (no longer in host memory).

Asking for a state already passed is a no-op (a capture that failed is
still "finished" for those who wait on it). One move is checked against
the other dimension: the host copy is released (``EVICTABLE`` or
``EVICTED``) only once the capture no longer writes into its buffers, else
:class:`~tierstore.errors.InternalError` is raised. Waiters use the events
``mutable_done`` and ``captured``, which are set by the moves only. ``verified`` is a third,
separate gate: the flush may read the capture (the debug check passed; set
at once without ``debug``, where the flush follows the capture through the
writer's gate).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore.errors import InternalError, WaitTimeoutError
from tierstore.layout import Layout


class Capture(enum.IntEnum):
    COPYING = 0
    MUTABLE_DONE = 1
    CAPTURED = 2
    FAILED = 3


class Residency(enum.IntEnum):
    HELD = 0
    EVICTABLE = 1
    EVICTED = 2


class CheckpointHandle:
    """What :meth:`Checkpointer.save` returns: the checkpoint's progress.

    ``tiers`` maps each tier name to its state for this checkpoint: ``pending``,
    ``captured`` (host), ``durable``, ``evicted`` (host copy dropped after it was
    durable elsewhere), ``skipped`` (not destined for it), ``failed``.
    ``state`` summarises: ``pending`` → ``captured`` → ``durable-local`` →
    ``durable-remote``, or ``skipped`` / ``failed``. ``timings`` holds seconds:
    ``blocked`` (training time spent in ``save`` and in the step hook),
    ``capture``, ``to_local`` (from ``save`` until durable locally), ``flush``
    (the local write), ``to_remote``.
    """

    def __init__(self, step: int, tiers: list[str]) -> None:
        self.step = step
        self.tiers: dict[str, str] = dict.fromkeys(tiers, "pending")
        self.timings: dict[str, float] = {"blocked": 0.0}
        self.error: BaseException | None = None
        self.reported = False
        self.paths: dict[str, str] = {}
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"CheckpointHandle(step={self.step}, state={self.state!r}, tiers={self.tiers})"

    @property
    def state(self) -> str:
        t = self.tiers
        vals = set(t.values())
        if vals <= {"skipped"} or ("failed" in vals and "durable" not in vals and "captured" not in vals):
            return "failed" if "failed" in vals else "skipped"
        disk = [k for k in t if k != "host"]
        if len(disk) > 1 and t[disk[-1]] == "durable":
            return "durable-remote"
        if any(t[k] == "durable" for k in disk):
            return "durable-local"
        if t.get("host") in ("captured", "evicted"):
            return "captured"
        return "pending"

    def _set(self, tier: str, state: str) -> None:
        with self._cond:
            self.tiers[tier] = state
            self._cond.notify_all()

    def settled(self, tier: str | None = None) -> bool:
        """True when nothing more will happen on ``tier`` (all tiers: None)."""
        names = [tier] if tier else list(self.tiers)
        done = {"durable", "skipped", "failed", "evicted"}
        return all(self.tiers[n] in done or (n == "host" and self.tiers[n] == "captured") for n in names)

    def wait(self, tier: str | None = None, timeout: float | None = None) -> str:
        """Waits until ``tier`` (a tier name, ``"captured"``, or None for every
        tier) is settled; returns :attr:`state`. Raises the checkpoint's error
        if it failed everywhere."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                ok = self.tiers.get("host") != "pending" if tier == "captured" else self.settled(tier)
                if ok:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeoutError(f"checkpoint of step {self.step}: still {self.tiers} after {timeout} s")
                self._cond.wait(0.1 if left is None else min(left, 0.1))
        if self.state == "failed" and self.error is not None:
            self.reported = True
            raise self.error
        return self.state


@dataclass
class Item:
    """One tensor of a snapshot: the training tensor and its host copy."""

    src: torch.Tensor
    dst: torch.Tensor
    version: int
    mutable: bool  # an attached optimizer changes it (or no optimizer is attached)
    layout: Layout | None  # attached to the copy (layouts and DTensor placements)


class Snapshot:
    """What one ``save`` captured (see the module documentation for its states)."""

    def __init__(self, step: int, ordinal: int, handle: CheckpointHandle) -> None:
        self.step = step
        self.ordinal = ordinal
        self.handle = handle
        self.state: dict[str, Any] = {}
        self.tree: list[tuple[str, list[str]]] = []
        self.items: list[Item] = []
        self.aliases: list[tuple[torch.Tensor, torch.Tensor]] = []  # (placeholder, the copy it views)
        self.capture = Capture.COPYING
        self.residency = Residency.HELD
        self._moves = threading.Lock()
        self.mutable_done = threading.Event()
        self.captured = threading.Event()
        self.verified = threading.Event()  # the flush may read the capture (see the module documentation)
        self.error: BaseException | None = None
        self.t_save = time.perf_counter()
        self.event: Any = None  # CUDA event recorded on the training stream at save()
        # GPU capture: after the copies of the tensors the step changes (on the copy stream)
        self.mutable_event: Any = None
        self.mutable_device: Any = None
        self.mutable_issue = threading.Event()  # set once that event is recorded (or the capture ended)
        self.local_dir: Path | None = None
        # Without the debug check the flush starts at once and writes each
        # tensor as soon as its capture passes this gate (item index + 1).
        self.gate: _core.Gate | None = None
        self.gates: dict[int, tuple[_core.Gate, int]] = {}
        # Offloaded optimizers' subgroup files pinned at save: (link, name in the checkpoint).
        self.offload_pins: list[tuple[Path, str]] = []
        self.has_offload = False  # restored from disk only (its pinned files are not kept in memory)
        # Who copies which item (host captures): the capture thread takes items
        # from the front; the optimizer step pre-hook takes the mutable ones
        # still untaken and copies them itself rather than wait.
        self.cap_lock = threading.Lock()
        self.taken: list[bool] = []
        self.done: list[bool] = []
        self.cap_next = 0  # the capture thread's cursor: items before it are taken
        self.done_prefix = 0  # items [0, done_prefix) are copied
        self.n_mutable = 0  # items [0, n_mutable) are the ones the step changes
        self.stolen = 0  # items the training thread copied

    def __repr__(self) -> str:
        return f"Snapshot(step={self.step}, capture={self.capture.name}, residency={self.residency.name})"

    # -- capture ------------------------------------------------------------------------------

    def advance(self, to: Capture) -> None:
        """Moves the capture to ``to`` (``MUTABLE_DONE`` or ``CAPTURED``) and
        releases those waiting for it. A state already passed, or a failed
        capture, keeps its state (the waiters are released all the same)."""
        if to not in (Capture.MUTABLE_DONE, Capture.CAPTURED):
            raise InternalError(f"{self!r}: advance to {to.name}; failures go through fail()")
        with self._moves:
            cur = self.capture
            if cur != Capture.FAILED and to > cur:
                self.capture = to
        self.mutable_done.set()
        if to == Capture.CAPTURED:
            self.captured.set()

    def fail(self, error: BaseException) -> None:
        """Marks the snapshot failed (final); the first error is kept."""
        with self._moves:
            self.capture = Capture.FAILED
            if self.error is None:
                self.error = error

    @property
    def copying_done(self) -> bool:
        """No thread writes into the snapshot's host buffers any more (its
        capture finished, with or without success)."""
        return self.captured.is_set()

    # -- host residency -----------------------------------------------------------------------

    def release_host(self, to: Residency) -> None:
        """Moves the host copy to ``EVICTABLE`` (durable elsewhere) or
        ``EVICTED``; a state already passed is kept. Refused while the capture
        still writes into the buffers: they must not be given to another
        snapshot before."""
        with self._moves:
            cur = self.residency
            if to <= cur:
                return
            if not self.copying_done:
                raise InternalError(f"{self!r}: host copy released to {to.name} while its capture still copies")
            self.residency = to

    @property
    def evictable(self) -> bool:
        """Its host buffers may be reused when room is needed."""
        return self.residency >= Residency.EVICTABLE

    @property
    def in_host(self) -> bool:
        return self.residency < Residency.EVICTED

    def release_sources(self) -> None:
        """Drops the references to the training tensors."""
        for it in self.items:
            it.src = it.dst

    def host_evicted(self) -> None:
        """Called by the host pool when it takes the buffers back."""
        self.release_host(Residency.EVICTED)
        self.state = {}
        if self.handle.tiers.get("host") == "captured":
            self.handle._set("host", "evicted")
