"""How an offloaded optimizer's subgroups move: host memory within its
budget (:class:`HostMemory`) and the transfers between it and the paths
(:class:`SubgroupStore`).

Reads and writes are O_DIRECT, in place, from and into reused page-aligned
buffers, each on its path's worker and in a turn of its device; every read
is checked against the CRC-32 computed when the subgroup was written.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tierstore import _core
from tierstore._engine import host_buffer
from tierstore._offload_io import StoragePath
from tierstore._offload_placement import Placement
from tierstore._offload_subgroup import Residence, Subgroup
from tierstore.errors import ChecksumError


class HostMemory:
    """Page-aligned buffers within ``budget`` bytes, reused (fresh memory
    costs page faults on every step). ``cond`` is also the lock of the
    subgroups' transfer state and of the statistics."""

    def __init__(self, budget: int, stats: dict[str, float]) -> None:
        self.budget = budget
        self.cond = threading.Condition()
        self.held = 0  # bytes of buffers allocated (resident, in flight, free)
        self.writes_in_flight = 0
        self.free: dict[int, list[torch.Tensor]] = {}
        self.stats = stats

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` (reused when one is free). The caller has
        reserved the room (:meth:`try_reserve`)."""
        with self.cond:
            free = self.free.get(nbytes)
            if free:
                return free.pop()
            self.held += nbytes
            self.stats["alloc_bytes"] += nbytes
        return host_buffer(nbytes, huge=True)  # allocated once, reused: worth the first touch

    def release(self, buf: torch.Tensor | None) -> None:
        """Returns a buffer for reuse, or to the system while more than the budget is held."""
        if buf is None:
            return
        with self.cond:
            if self.held > self.budget:
                self.held -= buf.numel()
            else:
                self.free.setdefault(buf.numel(), []).append(buf)
            self.cond.notify_all()

    def in_use(self) -> int:
        return self.held - sum(len(v) * n for n, v in self.free.items())

    def try_reserve(self, nbytes: int, force: bool = False) -> bool:
        """Whether a buffer of ``nbytes`` fits the budget now (dropping free
        buffers of other sizes to make room). ``force``: the working minimum,
        one subgroup in use, is always allowed."""
        with self.cond:
            over = self.held - self.budget + (0 if self.free.get(nbytes) else nbytes)
            for n in sorted(self.free, reverse=True):
                while over > 0 and self.free[n] and n != nbytes:
                    self.free[n].pop()
                    self.held -= n
                    over -= n
            return over <= 0 or force or self.in_use() == 0

    def wait(self, timeout: float = 0.05) -> None:
        with self.cond:
            self.cond.wait(timeout)


class SubgroupStore:
    """The subgroups, their buffers and their transfers."""

    def __init__(
        self,
        subgroups: list[Subgroup],
        memory: HostMemory,
        placement: Placement,
        engine: _core.Engine,
        warn: Callable[[str], None],
        threads: int,
        subgroup_bytes: int,
    ) -> None:
        self.subgroups = subgroups
        self.subgroup_bytes = subgroup_bytes
        self.memory = memory
        self.placement = placement
        self.engine = engine
        self.warn = warn
        self.threads = threads
        self.stats = memory.stats

    def keep_budget(self) -> int:
        """Bytes of subgroups that stay resident between steps; the rest of
        the budget is room for reads ahead and writes behind."""
        big = max((sg.nbytes for sg in self.subgroups), default=0) or self.subgroup_bytes
        # Room for a read and a write in flight on every path, and the one being updated.
        lanes = 2 * max(1, len(self.placement.live())) + 1
        stream = min(self.memory.budget // 2, lanes * big)
        return max(0, self.memory.budget - stream)

    def wait_room(self, nbytes: int) -> None:
        """Waits until a buffer of ``nbytes`` fits the budget: write-backs in
        flight free their buffers; with none in flight, it goes ahead anyway
        (the working minimum of one subgroup)."""
        while not self.memory.try_reserve(nbytes, force=self.memory.writes_in_flight == 0):
            self.memory.wait()
            self.reap_writes()

    def reap_writes(self) -> None:
        for sg in self.subgroups:
            if sg.writing is not None and sg.writing.done():
                self.settle(sg)

    def pack(self, sg: Subgroup) -> None:
        """Moves the subgroup's tensors into one flat buffer (a new layout)."""
        items = sg.tensors()
        layout, nbytes = sg.plan(items)
        self.wait_room(nbytes)
        buf = self.memory.alloc(nbytes)
        sg.fill(buf, layout, items, self.threads)
        old = sg.buf
        sg.layout, sg.nbytes = layout, nbytes
        self.placement.map = {}  # sizes changed (the state was created): a new placement
        sg.attach(buf)
        self.memory.release(old)
        sg.dirty = True

    def adopt(self, sg: Subgroup, buf: torch.Tensor) -> None:
        """Makes ``buf`` (laid out as ``sg.layout`` says) the subgroup's state."""
        self.placement.map = {}
        sg.attach(buf)
        sg.dirty = True

    def spill(self, sg: Subgroup, resident: int) -> int:
        """Counts the freshly packed ``sg`` as resident, writing it out when
        the resident total passes the keep budget; returns the new total."""
        resident += sg.nbytes
        if resident > self.keep_budget():
            self.write_sync(sg)
            resident -= sg.nbytes
        return resident

    def drop(self, sg: Subgroup) -> None:
        self.memory.release(sg.detach())

    # --- transfers

    def write(self, sg: Subgroup, p: StoragePath | None = None, ticket: tuple[int, int] | None = None) -> None:
        """Writes the resident subgroup to path ``p`` (default: the one the
        placement picks) on a path worker or the training thread; its buffer
        stays attached."""
        assert sg.buf is not None
        buf = sg.buf
        (crc,) = _core.crc32_regions([(buf.data_ptr(), sg.nbytes)], 1)
        while True:
            if p is None or p.full:
                with self.memory.cond:
                    p = self.placement.choose(sg, self.subgroups)
            if sg.path is p and not sg.pinned and sg.file is not None:
                f = sg.file
            else:
                sg.generation += 1
                f = p.dir / f"sg-{sg.index:06d}.{sg.generation}.bin"
            try:
                t0 = time.perf_counter()
                _core.transfer_ranges(
                    self.engine,
                    f,
                    [0],
                    [sg.nbytes],
                    [buf.data_ptr()],
                    write=True,
                    size=sg.nbytes,
                    direct=True,
                    turns=p.device.native,
                    ticket=ticket,
                )
                dt = time.perf_counter() - t0
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if f != sg.file:
                    f.unlink(missing_ok=True)
                p.full = True
                if not self.placement.live():
                    raise
                self.warn(
                    f"tierstore offload: {p.root} is full; its share of the optimizer state moves to the other paths"
                )
                p, ticket = None, None
                continue
            break
        p.observe("write", sg.nbytes, dt)
        old_file = sg.file
        with self.memory.cond:
            self.stats["write_bytes"] += sg.nbytes
            self.stats["writes"] += 1
            self.stats["write_s"] += dt
        if old_file is not None and old_file != f:
            old_file.unlink(missing_ok=True)  # a checkpoint's pin keeps its own link
        sg.path, sg.file, sg.crc, sg.pinned = p, f, crc, False
        sg.dirty = False

    def read(self, sg: Subgroup, buf: torch.Tensor, ticket: tuple[int, int] | None = None) -> None:
        """Reads the subgroup's file into ``buf`` and checks it."""
        assert sg.file is not None and sg.path is not None
        p = sg.path
        t0 = time.perf_counter()
        try:
            # Verified by the engine as the chunks arrive (against the CRC-32 of the write).
            _core.transfer_ranges(
                self.engine,
                sg.file,
                [0],
                [sg.nbytes],
                [buf.data_ptr()],
                direct=True,
                turns=p.device.native,
                ticket=ticket,
                crc32=sg.crc,
                record=f"subgroup {sg.index}",
            )
        except ChecksumError as e:
            raise ChecksumError(
                f"{sg.file}: offloaded optimizer state of subgroup {sg.index} is damaged ({e}); it is not used",
                path=str(sg.file),
                record=f"subgroup {sg.index}",
            ) from None
        dt = time.perf_counter() - t0
        p.observe("read", sg.nbytes, dt)
        with self.memory.cond:
            self.stats["read_bytes"] += sg.nbytes
            self.stats["reads"] += 1
            self.stats["read_s"] += dt

    def write_sync(self, sg: Subgroup) -> None:
        self.write(sg)
        self.drop(sg)

    def load_sync(self, sg: Subgroup) -> None:
        """Makes ``sg`` resident now (waiting for its I/O in flight)."""
        self.settle(sg)
        if sg.resident:
            return
        sg.move(Residence.RESIDENT)
        self.memory.try_reserve(sg.nbytes, force=True)
        buf = self.memory.alloc(sg.nbytes)
        try:
            self.read(sg, buf)
        except BaseException:
            self.memory.release(buf)
            raise
        sg.attach(buf)
        sg.dirty = False

    def start_read(self, sg: Subgroup) -> None:
        sg.move(Residence.READING)
        assert sg.path is not None
        buf = self.memory.alloc(sg.nbytes)
        ticket = sg.path.device.ticket()

        def job() -> None:
            try:
                self.read(sg, buf, ticket)
            except BaseException:
                self.memory.release(buf)
                raise
            sg.attach(buf)
            sg.dirty = False

        sg.reading = self._submit(sg.path, "read", job)

    def start_write(self, sg: Subgroup) -> None:
        """Writes ``sg`` back and frees its buffer when done (unless the step
        has asked for it meanwhile: see :meth:`want`)."""
        sg.move(Residence.WRITING)
        with self.memory.cond:
            p = self.placement.choose(sg, self.subgroups)
        ticket = p.device.ticket()

        def job() -> None:
            try:
                self.write(sg, p, ticket)
                with self.memory.cond:
                    if not sg.wanted:  # else this step needs it again soon: it stays
                        self.drop(sg)
            finally:
                with self.memory.cond:
                    self.memory.writes_in_flight -= 1

        with self.memory.cond:
            self.memory.writes_in_flight += 1
        sg.writing = self._submit(p, "write", job)

    def want(self, sg: Subgroup) -> bool:
        """Asks a subgroup whose write-back is in flight to stay resident
        after it (the step is about to use it again); whether it will."""
        with self.memory.cond:
            if sg.resident:
                sg.wanted = True
            return sg.resident

    def _submit(self, p: StoragePath, what: str, job: Callable[[], None]) -> Future[None]:
        cond = self.memory.cond

        def run() -> None:
            try:
                job()
            finally:
                with cond:
                    cond.notify_all()

        return p.pools[what].submit(run)

    @staticmethod
    def settle(sg: Subgroup) -> None:
        """Waits for the subgroup's read or write in flight; raises its error."""
        for attr in ("reading", "writing"):
            f = getattr(sg, attr)
            if f is not None:
                try:
                    f.result()
                finally:
                    setattr(sg, attr, None)

    def settle_all(self) -> None:
        for sg in self.subgroups:
            self.settle(sg)

    def visit(self, sg: Subgroup) -> bool:
        """Makes ``sg`` resident for a look at its state; returns whether it
        was resident before (pass to :meth:`leave`)."""
        was = sg.resident
        self.load_sync(sg)
        return was

    def leave(self, sg: Subgroup, was_resident: bool) -> None:
        """Lets go of a subgroup made resident only to be looked at (its file is still valid)."""
        if not was_resident and not sg.dirty:
            self.drop(sg)
