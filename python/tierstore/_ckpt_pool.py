"""Host memory for Checkpointer captures: slabs within a byte budget, reused
across saves, and the copy the capture thread makes into them.

A slab is *busy* while its snapshot is not yet durable on a disk tier,
*retained* while it holds a durable snapshot (its snapshot's residency is
``EVICTABLE``), and *free*; a retained slab is taken back, oldest first, when
a new capture needs room (:meth:`HostPool.reserve`).
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from tierstore import _core
from tierstore._ckpt_snapshot import Snapshot
from tierstore._engine import host_buffer
from tierstore.errors import InvalidArgumentError

PAGE = 4096  # tensors of BIG bytes or more start on a page (direct writes)
BIG = 64 << 10
SMALL_ALIGN = 64  # smaller tensors in a slab


class Slab:
    """One host buffer. Each captured tensor gets its own storage over a slice
    of it (a storage per tensor, as a torch checkpoint needs); the views of
    the last layout used are kept, so a repeated save reuses them."""

    __slots__ = ("buf", "holder", "mem", "nbytes", "views", "views_key")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        # Offsets count from the first page boundary, so that page-aligned
        # tensors are written to O_DIRECT files straight from this memory.
        base = -buf.data_ptr() % PAGE
        self.mem = memoryview(buf.numpy())[base:]  # type: ignore[arg-type]
        self.nbytes = buf.numel() - PAGE
        self.holder: Snapshot | None = None
        self.views: list[torch.Tensor] = []
        self.views_key: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []

    def views_for(self, plan: list[tuple[int, int, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        if plan != self.views_key:
            self.views = [
                torch.frombuffer(self.mem[off : off + n], dtype=dt).view(shape) if n else torch.empty(shape, dtype=dt)
                for off, n, dt, shape in plan
            ]
            self.views_key = plan
        return self.views


class HostPool:
    """Capture buffers within a byte budget, reused across saves.

    A slab is *busy* while its snapshot is not yet durable on a disk tier,
    *retained* while it holds a durable snapshot (evictable), and *free*.
    """

    def __init__(self, budget: int, pinned: bool) -> None:
        self.budget = budget
        self.pinned = pinned
        self.slabs: list[Slab] = []
        self.cond = threading.Condition()
        self.peak = 0

    @property
    def allocated(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def in_use(self) -> int:
        with self.cond:
            return sum(s.nbytes for s in self.slabs if s.holder is not None and not s.holder.evictable)

    def _try(self, nbytes: int, snap: Snapshot) -> Slab | None:
        def free(s: Slab) -> bool:
            return s.holder is None or s.holder.evictable

        cands = [s for s in self.slabs if free(s) and s.nbytes >= nbytes]
        if cands:
            # Prefer empty slabs, then the oldest retained snapshot; smallest fit.
            s = min(cands, key=lambda s: (s.holder is not None, s.holder.ordinal if s.holder else 0, s.nbytes))
            self._evict(s)
            s.holder = snap
            return s
        # Make room: drop free and retained slabs (oldest first) until it fits.
        room = self.budget - self.allocated
        victims = sorted((s for s in self.slabs if free(s)), key=lambda s: s.holder.ordinal if s.holder else -1)
        take: list[Slab] = []
        for v in victims:
            if room >= nbytes:
                break
            take.append(v)
            room += v.nbytes
        if room < nbytes:
            return None
        for v in take:
            self._evict(v)
            self.slabs.remove(v)
        if self.pinned:
            buf = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
        else:  # huge pages: the flush's direct writes go out in full-size requests
            buf = host_buffer(nbytes + PAGE)
        s = Slab(buf)
        s.holder = snap
        self.slabs.append(s)
        self.peak = max(self.peak, self.allocated)
        return s

    @staticmethod
    def _evict(s: Slab) -> None:
        if s.holder is not None:
            s.holder.host_evicted()
            s.holder = None

    def _evict_snapshot(self, snap: Snapshot) -> None:
        for s in self.slabs:
            if s.holder is snap:
                self._evict(s)

    def reserve(self, nbytes: int, snap: Snapshot, block: bool, timeout: float | None = None) -> Slab | None:
        if nbytes > self.budget:
            raise InvalidArgumentError(
                f"a snapshot needs {nbytes / 2**20:.1f} MiB of host memory but the host tier's budget is "
                f"{self.budget / 2**20:.1f} MiB; raise HostTier(budget=...) (or TIERSTORE_HOST_BUDGET) to at "
                f"least the state's size, ideally twice it so that a capture overlaps the previous flush"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                s = self._try(nbytes, snap)
                if s is not None or not block:
                    return s
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(0.05 if left is None else min(left, 0.05))

    def release(self, snap: Snapshot) -> None:
        with self.cond:
            for s in self.slabs:
                if s.holder is snap:
                    s.holder = None
            self.cond.notify_all()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


def copy_host(dst: torch.Tensor, src: torch.Tensor, gate: _core.Gate | None = None, at: int = 0) -> None:
    """``dst.copy_(src)`` for the capture thread. Dense host tensors are
    copied on this one thread with the GIL released and start no OpenMP
    team: with ``gate`` (a flush may already be waiting to write ``dst``),
    by the engine, which checksums each 512-byte chunk in the same pass and
    leaves the sums with the gate for position ``at`` so that the writer does
    not read the copy again; otherwise by libc's memmove (non-temporal stores
    for large sizes). Anything else goes through torch."""
    n = src.numel() * src.element_size()
    if (
        (n >= BIG or (gate is not None and n > 0))
        and src.device.type == "cpu"
        and src.layout == torch.strided
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_quantized
        and not src.is_conj()
        and not src.is_neg()
    ):
        if gate is not None:
            gate.copy_in(at, dst.data_ptr(), src.data_ptr(), n)
        else:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)
