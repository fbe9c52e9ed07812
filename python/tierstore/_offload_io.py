"""The offloaded optimizer's I/O turns and storage paths.

A :class:`DeviceTurns` is the turns at one device (one ``st_dev``): a read
and a write :class:`Lane` (duplex) or one lane for both (simplex, or measured
with ``duplex=None``), each granting at most ``slots`` transfers at a time by
ticket and, with ``exclusive``, one of a set of machine-wide lock files, so
that several processes offloading to one device take turns. A
:class:`StoragePath` is one directory of a disk tier: its session directory,
its device's turns and its bandwidth estimate. Session directories whose
process died are removed (:func:`remove_dead_sessions`).
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SESSION = "session-"
ALPHA = 0.3  # weight of a new bandwidth sample in the estimate


def lock_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class Lane:
    """Turns in one direction (reads or writes) at one device (one
    ``st_dev``), for the transfers of this process and, with ``exclusive``,
    of every process on the machine.

    In the process: at most ``slots`` transfers at a time, granted by ticket
    (first come, first served). Across processes: each granted transfer also
    holds one of ``shared`` lock files (flock), so that several processes
    offloading to one device take turns instead of thrashing it. A process
    that dies releases its locks with its descriptors."""

    def __init__(self, dev: int, what: str, slots: int, exclusive: bool, shared: int | None = None) -> None:
        self.slots = max(1, slots)
        self.cond = threading.Condition()
        self.busy = 0
        self.waiting: list[tuple[int, int]] = []  # heap of (priority, ticket) of the transfers here now
        self.fds: list[int] = []
        self.lock_wait_s = 0.0  # time spent waiting for other processes
        if exclusive:
            base = lock_dir()
            for i in range(max(self.slots, shared or 0)):
                f = base / f"tierstore-io-{dev:x}-{what[0]}{i}.lock"
                self.fds.append(os.open(f, os.O_RDWR | os.O_CREAT, 0o666))
        self.free_fds = list(self.fds)

    @contextlib.contextmanager
    def turn(self, ticket: tuple[int, int]) -> Iterator[None]:
        with self.cond:
            heapq.heappush(self.waiting, ticket)
            # (no free lock file: another transfer of ours is choosing one)
            while self.busy >= self.slots or self.waiting[0] != ticket or (self.fds and not self.free_fds):
                self.cond.wait()
            heapq.heappop(self.waiting)
            self.busy += 1
            mine = list(self.free_fds)  # the slots no transfer of this process holds
            self.free_fds.clear()
            self.cond.notify_all()
        fd = -1
        try:
            if mine:
                try:
                    fd = self._lock_any(mine)
                finally:
                    with self.cond:
                        self.free_fds.extend(x for x in mine if x != fd)
                        self.cond.notify_all()
            yield
        finally:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_UN)
            with self.cond:
                self.busy -= 1
                if fd >= 0:
                    self.free_fds.append(fd)
                self.cond.notify_all()

    def _lock_any(self, fds: list[int]) -> int:
        """Takes whichever of ``fds`` no other process holds, waiting while
        all are held: blocked in the kernel on a single one (woken the moment
        it is let go: the device is not left idle between two processes'
        transfers), polled 0.2 to 2 ms apart on several."""
        t0 = time.perf_counter()
        if len(fds) == 1:
            try:
                fcntl.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fcntl.flock(fds[0], fcntl.LOCK_EX)  # releases the GIL while it waits
                self.lock_wait_s += time.perf_counter() - t0
            return fds[0]
        pause = 0.0002
        while True:
            for fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                self.lock_wait_s += time.perf_counter() - t0
                return fd
            time.sleep(pause)
            pause = min(2 * pause, 0.002)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.free_fds = []


class DeviceTurns:
    """The turns at one device, and how its two directions share it.

    *Duplex*: a read lane and a write lane, a read and a write at once (a
    device that serves both directions in parallel: most NVMe drives, and
    devices throttled per direction). *Simplex*: one lane for both (a device
    whose throughput drops when reads and writes interleave). With
    ``duplex=None`` the mode is measured: a step each way, then the faster
    (bytes per second of the device's busy time), with a step of the other
    mode every 50 steps in case the device changed; the measure is bytes per
    second of the training loop's time. Tickets are taken in one
    order for both lanes, when a transfer is queued."""

    EXPLORE_EVERY = 50

    def __init__(self, dev: int, slots: int, exclusive: bool, duplex: bool | None, shared: int | None = None) -> None:
        self.dev = dev
        self.lanes = {w: Lane(dev, w, slots, exclusive, shared) for w in ("read", "write")}
        self.adaptive = duplex is None
        self.duplex = True if duplex is None else duplex
        self.tickets = itertools.count()
        self.acct = threading.Lock()
        self.bytes = 0  # moved since the last step began
        self.period_start = time.perf_counter()
        self.period = 0
        self.rates: dict[bool, list[float]] = {True: [], False: []}

    def ticket(self) -> tuple[int, int]:
        """A place in line, taken when a transfer is queued."""
        return (1, next(self.tickets))

    @contextlib.contextmanager
    def turn(self, what: str, nbytes: int, ticket: tuple[int, int] | None = None) -> Iterator[None]:
        lane = self.lanes[what if self.duplex else "read"]
        with lane.turn(ticket if ticket is not None else self.ticket()):
            try:
                yield
            finally:
                with self.acct:
                    self.bytes += nbytes

    def end_period(self) -> None:
        """At each step: the rate of the mode used since the last step (bytes
        moved at this device per second of the training loop's time, so that
        what counts is what the loop waits for), and the mode for the next."""
        now = time.perf_counter()
        with self.acct:
            nbytes, self.bytes = self.bytes, 0
        elapsed, self.period_start = now - self.period_start, now
        if self.period > 1 and nbytes >= (64 << 20) and elapsed > 0:  # the first step creates the state
            self.rates[self.duplex].append(nbytes / elapsed)
            del self.rates[self.duplex][:-3]
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
        return sum(lane.lock_wait_s for lane in self.lanes.values())

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()


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
