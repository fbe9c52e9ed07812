"""The offloaded optimizer's I/O turns and storage paths.

A :class:`DeviceTurns` holds the engine's turns at one device (one
``st_dev``): a read and a write lane (duplex) or one lane for both (simplex,
or measured with ``duplex=None``), each granting at most ``slots`` transfers
at a time by ticket and, with ``exclusive``, one of a set of machine-wide lock
files, so that several processes using one device take turns; the engine
schedules every transfer at that device through them. A
:class:`StoragePath` is one directory of a disk tier: its session directory,
its device's turns and its bandwidth estimate. Session directories whose
process died are removed (:func:`remove_dead_sessions`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore import _core
from tierstore._engine import lock_dir

SESSION = "session-"
ALPHA = 0.3  # weight of a new bandwidth sample in the estimate


class DeviceTurns:
    """The turns at one device, and how its two directions share it.

    The turns themselves are the engine's (``_core.DeviceTurns``: a lane per
    direction granting at most ``slots`` transfers of this process at a
    time, in ticket order, and with ``exclusive`` one of ``shared``
    machine-wide lock files per transfer); registered there, they are taken
    by every transfer the engine runs at this device, from any caller. This
    object holds them and chooses the mode.

    *Duplex*: a read lane and a write lane, a read and a write at once (a
    device that serves both directions in parallel: most NVMe drives, and
    devices throttled per direction). *Simplex*: one lane for both (a device
    whose throughput drops when reads and writes interleave). With
    ``duplex=None`` the mode is measured: a step each way, then the faster
    (bytes per second of the device's busy time), with a step of the other
    mode every 50 steps in case the device changed; the measure is bytes per
    second of the training loop's time."""

    EXPLORE_EVERY = 50

    def __init__(
        self,
        engine: _core.Engine,
        dev: int,
        slots: int,
        exclusive: bool,
        duplex: bool | None,
        shared: int | None = None,
    ) -> None:
        self.dev = dev
        self.native: _core.DeviceTurns | None = _core.DeviceTurns(
            engine,
            dev,
            slots=max(1, slots),
            exclusive=exclusive,
            shared=shared or 0,
            lock_dir=lock_dir(),
            duplex=duplex,
        )
        self.adaptive = duplex is None
        self.period_start = time.perf_counter()
        self.period = 0
        self.rates: dict[bool, list[float]] = {True: [], False: []}
        self._lock_wait_s = 0.0

    @property
    def duplex(self) -> bool:
        return self.native.duplex if self.native is not None else False

    @duplex.setter
    def duplex(self, value: bool) -> None:
        if self.native is not None:
            self.native.duplex = value

    def ticket(self) -> tuple[int, int]:
        """A place in line, taken when a transfer is queued."""
        assert self.native is not None
        return self.native.ticket()

    def end_period(self) -> None:
        """At each step: the rate of the mode used since the last step (bytes
        moved at this device per second of the training loop's time, so that
        what counts is what the loop waits for), and the mode for the next."""
        if self.native is None:
            return
        now = time.perf_counter()
        nbytes = self.native.take_bytes()
        elapsed, self.period_start = now - self.period_start, now
        mode = self.duplex
        if self.period > 1 and nbytes >= (64 << 20) and elapsed > 0:  # the first step creates the state
            self.rates[mode].append(nbytes / elapsed)
            del self.rates[mode][:-3]
        self.period += 1
        if not self.adaptive:
            return
        if not self.rates[True] or self.period <= 2:
            self.duplex = True
        elif not self.rates[False] or self.period <= 3:
            self.duplex = False
        else:
            best = statistics.median(self.rates[True]) >= statistics.median(self.rates[False])
            self.duplex = best if self.period % self.EXPLORE_EVERY else not best

    @property
    def lock_wait_s(self) -> float:
        """Seconds spent waiting for other processes' turns."""
        return self.native.lock_wait_s if self.native is not None else self._lock_wait_s

    def close(self) -> None:
        if self.native is not None:
            self._lock_wait_s = self.native.lock_wait_s
            self.native.close()
            self.native = None


class StoragePath:
    """One directory of a disk tier: its session directory, its device's
    turns, its bandwidth estimate and the bytes of state stored on it."""

    def __init__(self, root: Path, session: str, device: DeviceTurns, pools: dict[str, ThreadPoolExecutor]) -> None:
        self.root = root
        self.dir = root / session
        self.device = device
        self.pools = pools  # a worker pool per direction: reads never wait behind writes for a thread
        self.rate = {"read": 0.0, "write": 0.0}  # bytes per second
        self.stored = 0  # bytes of the subgroups whose home this is (written or being written)
        self.full = False
        self.moved = {"read": 0, "write": 0}

    def observe(self, what: str, nbytes: int, seconds: float) -> None:
        self.moved[what] += nbytes
        if seconds <= 0 or nbytes < (1 << 20):
            return
        bw = nbytes / seconds
        old = self.rate[what]
        self.rate[what] = bw if old == 0 else (1 - ALPHA) * old + ALPHA * bw

    def speed(self) -> float:
        """Bytes per second of a subgroup that is read and written back once:
        both directions share the device."""
        r, w = self.rate["read"], self.rate["write"]
        if r <= 0 or w <= 0:
            return max(r, w, 1.0)
        return 1.0 / (1.0 / r + 1.0 / w)


def remove_dead_sessions(root: Path) -> None:
    """Removes session directories whose process is gone (its lock file is
    no longer held): nothing a killed process left is ever read."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        if not d.name.startswith(SESSION) or not d.is_dir():
            continue
        lock = d / ".alive"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            # Created and killed before it took its lock, or not ours: only
            # remove it when it is old enough not to be starting right now.
            with contextlib.suppress(OSError):
                if time.time() - d.stat().st_mtime > 60:
                    shutil.rmtree(d, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its process is alive
        shutil.rmtree(d, ignore_errors=True)
        os.close(fd)
