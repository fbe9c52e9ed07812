"""Optimizer state offloaded to host memory and several disk paths.

::

    opt = tierstore.offload(torch.optim.AdamW, model.parameters(), lr=3e-4,
                            tiers=[tierstore.HostTier("4GiB"),
                                   tierstore.DiskTier(["/nvme0/off", "/nvme1/off"]),
                                   tierstore.DiskTier("/pfs/job42/off")])
    loss.backward(); opt.step(); opt.zero_grad()

The fp32 master weights and every state tensor of the wrapped optimizer live
in *subgroups*: flat, page-aligned host buffers of about ``subgroup_bytes``
that live on the disk paths when the host budget does not hold them. Each
subgroup's update is the wrapped optimizer's own step on its parameters, so
results equal the in-memory optimizer's (bitwise on the CPU).

A step walks the subgroups in an order that alternates every step; the last
subgroups of one step stay in host memory and are the first of the next
(MLP-Offload's cache-friendly order), so a step moves only what does not fit.
While subgroup *i* is updated, the next ones are read ahead as far as the host
budget allows and the updated ones are written back, each path working on its
own queue; reads and writes are O_DIRECT, in place, from and into reused
page-aligned buffers. Gradients stay in their training dtype and are converted
to fp32 only inside the update, into one reused buffer.

Subgroups are placed over every path of every disk tier in proportion to the
path's bandwidth: probed at start, then re-estimated from the engine's timing
of each transfer, so a path that slows down receives less. A write-back may
go to another path at no extra cost (every updated subgroup is written
anyway); a full path hands its share to the others with a warning.

Several processes on one machine (one per GPU) share devices through
machine-wide turns per device and direction (``device_slots`` lock files in
``/dev/shm``, flock: released by the kernel when a process dies), one taken
for each transfer, so they stream in turn instead of thrashing the device;
each process has at most ``io_slots`` transfers in flight per direction. Offload I/O
is foreground-class engine work; checkpoint flushes are background-class.

Every read is checked against the CRC-32 computed when the subgroup was
written; damaged state raises :class:`~tierstore.errors.ChecksumError`.
Files live in a per-process session directory that only its process reads;
a killed process's session is removed by the next optimizer on that path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore._engine import get_engine, host_buffer
from tierstore._offload_entry import (
    OFFLOAD_FORMAT,
    OFFLOAD_FORMATS_READ,
    OFFLOAD_KEY,
    is_offload_parts,
    offload_meta,
    restore_state_dict,
    state_dtype,
    subgroup_bytes,
)
from tierstore._offload_io import SESSION, DeviceTurns, StoragePath, lock_dir, remove_dead_sessions
from tierstore._offload_subgroup import Entry, Subgroup
from tierstore.errors import ChecksumError, InvalidArgumentError, TierstoreError
from tierstore.tiers import DiskTier, HostTier, parse_size

# The checkpoint entry's names, re-exported where they were first defined.
__all__ = [
    "OFFLOAD_FORMAT",
    "OFFLOAD_FORMATS_READ",
    "OFFLOAD_KEY",
    "OffloadedOptimizer",
    "is_offload_parts",
    "offload",
    "offload_meta",
    "restore_state_dict",
]

_PAGE = 4096
_RELAYOUT = 0.05  # change of a path's share that makes a new layout


def _default_tiers() -> list[HostTier | DiskTier]:
    scratch = os.environ.get("TIERSTORE_OFFLOAD_DIR", os.path.join(tempfile.gettempdir(), "tierstore-offload"))
    return [HostTier(os.environ.get("TIERSTORE_OFFLOAD_HOST", "1GiB")), DiskTier(scratch)]


_lock_dir = lock_dir  # the name tests/test_offload.py knows


class OffloadedOptimizer(torch.optim.Optimizer):
    """Behaves like the wrapped optimizer (``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``, ``param_groups``, step hooks, LR
    schedulers) while its fp32 master weights and state live in the tiers.

    ``subgroup_bytes``: size of a subgroup (master + state), the unit of I/O.
    ``io_slots``: transfers of this process in flight per device and
    direction. ``device_slots``: transfers in flight per device and direction
    for all processes on the machine together (at least ``io_slots``; by
    default two: two processes then never wait for each other, which measured
    3% faster than one at a time on a disk that serves two streams as fast as
    one, while eight ranks still cannot interleave eight streams).
    ``duplex``: reads and writes at a device at once (True), in one line
    (False), or whichever the device is measured to serve faster (None).
    ``exclusive_io``: take those turns across processes (lock files); False
    limits only this process. ``split_masters``: where a subgroup's
    parameters are bf16, store only the low 16 bits of each fp32 master, the
    high 16 being the parameter (rounded to nearest, ties away from zero), so
    that 10 rather than 12 bytes per parameter of AdamW move; the masters are
    rebuilt exactly for each update. The master then follows the parameter if
    the parameter is changed between steps. ``balance``: ``"bandwidth"`` (measured) or
    ``"even"`` placement over the paths. ``pipeline=False``: the naive
    synchronous baseline (each subgroup read, updated and written in turn,
    nothing kept in memory, nothing overlapped)."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        *,
        tiers: list[HostTier | DiskTier] | None = None,
        subgroup_bytes: int | str = "64MiB",
        io_slots: int = 1,
        device_slots: int | None = None,
        duplex: bool | None = None,
        exclusive_io: bool = True,
        balance: str = "bandwidth",
        pipeline: bool = True,
        split_masters: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        if balance not in ("bandwidth", "even"):
            raise InvalidArgumentError(f"balance must be 'bandwidth' or 'even', got {balance!r}")
        tiers = tiers if tiers is not None else _default_tiers()
        hosts = [t for t in tiers if isinstance(t, HostTier)]
        disks = [t for t in tiers if isinstance(t, DiskTier)]
        if not disks:
            raise InvalidArgumentError(
                "offload needs at least one DiskTier (a directory for the state that does not fit)"
            )
        if len(hosts) > 1:
            raise InvalidArgumentError("offload takes at most one HostTier")
        self.budget = int(hosts[0].budget) if hosts else parse_size("1GiB")
        self.subgroup_bytes = max(_PAGE, parse_size(subgroup_bytes))
        self.pipeline = pipeline
        self.split_masters = split_masters
        self.balance = balance
        self.cls = optimizer_class
        self.kwargs = optimizer_kwargs
        self.engine = get_engine()
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        super().__init__(params, dict(probe.defaults))
        del probe
        # --- paths
        self.session = f"{SESSION}{os.getpid()}-{secrets.token_hex(4)}"
        self.paths: list[StoragePath] = []
        self._layout_map: dict[int, StoragePath] = {}
        self._layout_shares: dict[StoragePath, float] = {}
        devices: dict[int, DeviceTurns] = {}
        self._alive_fds: list[int] = []
        roots: list[Path] = []
        for t in disks:
            for p in t.paths:  # type: ignore[union-attr]
                root = Path(p).resolve()
                if root in roots:
                    continue
                roots.append(root)
        for root in roots:
            root.mkdir(parents=True, exist_ok=True)
            remove_dead_sessions(root)
            (root / self.session).mkdir()
            fd = os.open(root / self.session / ".alive", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._alive_fds.append(fd)
            dev = os.stat(root).st_dev
            if dev not in devices:
                shared = max(io_slots, 2) if device_slots is None else device_slots
                devices[dev] = DeviceTurns(dev, io_slots, exclusive_io, duplex, shared)
            # Per direction, one worker more than the device's slots: one
            # checksums while the others transfer.
            pools = {
                w: ThreadPoolExecutor(io_slots + 1, thread_name_prefix=f"tierstore-offload-{len(self.paths)}{w[0]}")
                for w in ("read", "write")
            }
            self.paths.append(StoragePath(root, self.session, devices[dev], pools))
        self.devices = list(devices.values())
        # --- host memory
        self._mem = threading.Condition()
        self._held = 0  # bytes of buffers allocated (resident, in flight, free)
        self._writes_in_flight = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._grad32: torch.Tensor | None = None  # the reused fp32 gradient buffer
        self._master32: torch.Tensor | None = None  # the reused buffer of rebuilt split masters
        self._threads = max(1, torch.get_num_threads())
        self._errors: list[BaseException] = []
        self._warned: set[str] = set()
        self._pending_warnings: list[str] = []
        self.steps = 0
        self._closed = False
        self.stats: dict[str, float] = {
            "read_bytes": 0,
            "write_bytes": 0,
            "read_s": 0.0,
            "write_s": 0.0,
            "wait_s": 0.0,
            "update_s": 0.0,
            "alloc_bytes": 0,
        }
        # --- subgroups, masters packed; what does not fit goes to the paths
        self.subgroups: list[Subgroup] = []
        first = 0
        for gi, g in enumerate(self.param_groups):
            cur: list[torch.Tensor] = []
            size = 0
            for p in g["params"]:
                need = 12 * p.numel()  # master + two state tensors of fp32, for sizing
                if cur and size + need > self.subgroup_bytes:
                    self.subgroups.append(Subgroup(len(self.subgroups), gi, cur, first))
                    first += len(cur)
                    cur, size = [], 0
                cur.append(p)
                size += need
            if cur:
                self.subgroups.append(Subgroup(len(self.subgroups), gi, cur, first))
                first += len(cur)
        self._probe_paths()
        resident = 0
        for sg in self.subgroups:
            sg.masters = [p.detach().to("cpu", torch.float32, copy=True) for p in sg.params]
            self._pack(sg)
            resident += sg.nbytes
            if resident > self._keep_budget():
                self._write_sync(sg)
                resident -= sg.nbytes

    # -------------------------------------------------------------------------------------------
    # host memory

    def _keep_budget(self) -> int:
        """Bytes of subgroups that stay resident between steps; the rest of
        the budget is room for reads ahead and writes behind."""
        big = max((sg.nbytes for sg in self.subgroups), default=0) or self.subgroup_bytes
        # Room for a read and a write in flight on every path, and the one being updated.
        lanes = 2 * max(1, sum(not p.full for p in self.paths)) + 1
        stream = min(self.budget // 2, lanes * big)
        return max(0, self.budget - stream)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """A page-aligned host buffer of ``nbytes`` (reused when one is free).
        The caller has reserved the room (:meth:`_try_reserve`)."""
        with self._mem:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self._held += nbytes
            self.stats["alloc_bytes"] += nbytes
        return host_buffer(nbytes)

    def _release(self, buf: torch.Tensor) -> None:
        """Returns a buffer for reuse (fresh memory costs page faults on every
        step), or to the system while more than the budget is held."""
        with self._mem:
            if self._held > self.budget:
                self._held -= buf.numel()
            else:
                self._free.setdefault(buf.numel(), []).append(buf)
            self._mem.notify_all()

    def _in_use(self) -> int:
        return self._held - sum(len(v) * n for n, v in self._free.items())

    def _try_reserve(self, nbytes: int, force: bool = False) -> bool:
        """Whether a buffer of ``nbytes`` fits the budget now (dropping free
        buffers of other sizes to make room). ``force``: the working minimum,
        one subgroup in use, is always allowed."""
        with self._mem:
            over = self._held - self.budget + (0 if self._free.get(nbytes) else nbytes)
            for n in sorted(self._free, reverse=True):
                while over > 0 and self._free[n] and n != nbytes:
                    self._free[n].pop()
                    self._held -= n
                    over -= n
            return over <= 0 or force or self._in_use() == 0

    def _wait_room(self, nbytes: int) -> None:
        """Waits until a buffer of ``nbytes`` fits the budget: write-backs in
        flight free their buffers; with none in flight, it goes ahead anyway
        (the working minimum of one subgroup)."""
        while not self._try_reserve(nbytes, force=self._writes_in_flight == 0):
            with self._mem:
                self._mem.wait(0.05)
            self._reap_writes()

    def _reap_writes(self) -> None:
        for sg in self.subgroups:
            if sg.writing is not None and sg.writing.done():
                self._settle(sg)

    # -------------------------------------------------------------------------------------------
    # layout of a subgroup's flat buffer

    def _tensors(self, sg: Subgroup) -> list[tuple[int, str | None, torch.Tensor]]:
        out: list[tuple[int, str | None, torch.Tensor]] = []
        for i, m in enumerate(sg.masters):
            out.append((i, None, m))
            if sg.inner is not None:
                st = sg.inner.state.get(m, {})
                for k in sorted(st):
                    if isinstance(st[k], torch.Tensor):
                        out.append((i, k, st[k]))
        return out

    def _pack(self, sg: Subgroup) -> None:
        """Moves the subgroup's tensors into one flat buffer (a new layout)."""
        items = self._tensors(sg)
        layout: list[Entry] = []
        off = 0
        for i, k, t in items:
            dt = torch.int16 if k is None and sg.split else t.dtype  # low halves of the masters
            n = t.numel() * dt.itemsize
            off = -(-off // 64) * 64
            layout.append((i, k, off, n, dt, tuple(t.shape)))
            off += n
        nbytes = -(-max(off, 1) // _PAGE) * _PAGE
        self._wait_room(nbytes)
        buf = self._alloc(nbytes)
        for (i, k, o, n, dt, shape), (_i2, _k2, t) in zip(layout, items, strict=True):
            if k is None and sg.split:
                self._split_master(sg.params[i], t, buf[o : o + n].view(dt))
            else:
                buf[o : o + n].view(dt).view(shape).copy_(t)
        old = sg.buf
        sg.layout, sg.nbytes = layout, nbytes
        self._layout_map = {}  # sizes changed (the state was created): a new layout
        self._attach(sg, buf)
        if old is not None:
            self._release(old)
        sg.dirty = True

    def _attach(self, sg: Subgroup, buf: torch.Tensor) -> None:
        """Points masters and state tensors at views of ``buf``."""
        sg.buf = buf
        for i, k, o, n, dt, shape in sg.layout:
            v = buf[o : o + n].view(dt).view(shape)
            if k is None:
                if not sg.split:  # split masters are rebuilt for each update
                    sg.masters[i].data = v
            else:
                assert sg.inner is not None
                sg.inner.state[sg.masters[i]][k] = v

    def _detach(self, sg: Subgroup) -> None:
        empty = torch.empty(0)
        for i, k, *_ in sg.layout:
            if k is None:
                sg.masters[i].data = empty
            else:
                assert sg.inner is not None
                sg.inner.state[sg.masters[i]][k] = empty
        if sg.buf is not None:
            self._release(sg.buf)
        sg.buf = None

    # -------------------------------------------------------------------------------------------
    # split masters: the low halves in the layout, the high halves in the bf16 parameters

    def _splits(self, sg: Subgroup) -> bool:
        """Whether the subgroup's masters are to be stored split (all its parameters bf16)."""
        return self.split_masters and all(p.dtype == torch.bfloat16 for p in sg.params)

    def _low_halves(self, sg: Subgroup) -> list[torch.Tensor]:
        """Views of the stored low halves of the split subgroup's masters, in parameter order."""
        assert sg.buf is not None
        buf = sg.buf
        return [buf[o : o + n].view(torch.int16) for _i, k, o, n, _dt, _shape in sg.layout if k is None]

    def _split_master(self, p: torch.Tensor, master: torch.Tensor, lo: torch.Tensor) -> None:
        """Stores fp32 ``master``: its low halves into ``lo``, its rounded
        high halves into the bf16 parameter ``p``."""
        n = master.numel()
        src = master.detach().contiguous()
        direct = p.device.type == "cpu" and p.dtype == torch.bfloat16 and p.is_contiguous()
        hi = p.detach() if direct else torch.empty(n, dtype=torch.bfloat16)
        _core.split_halves(src.data_ptr(), hi.data_ptr(), lo.data_ptr(), n, self._threads)
        if not direct:
            p.detach().copy_(hi.view(p.shape))

    def _join_master(self, p: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> None:
        """Rebuilds the fp32 master into ``out`` from the parameter's high
        halves and the stored low halves."""
        hi = p.detach()
        if hi.device.type != "cpu" or hi.dtype != torch.bfloat16 or not hi.is_contiguous():
            hi = hi.to("cpu", torch.bfloat16).contiguous()
        _core.join_halves(hi.data_ptr(), lo.data_ptr(), out.data_ptr(), out.numel(), self._threads)

    @staticmethod
    def _drop_masters(sg: Subgroup) -> None:
        """Lets go of a split subgroup's fp32 masters (rebuilt for each update)."""
        empty = torch.empty(0)
        for m in sg.masters:
            m.data = empty

    def _rebuild_masters(self, sg: Subgroup, into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The split subgroup's fp32 masters, rebuilt into views of ``into``
        (default: new tensors)."""
        out: list[torch.Tensor] = []
        off = 0
        for p, lo in zip(sg.params, self._low_halves(sg), strict=True):
            m = torch.empty(p.shape) if into is None else into[off : off + p.numel()].view(p.shape)
            self._join_master(p, lo, m)
            out.append(m)
            off += p.numel()
        return out

    # -------------------------------------------------------------------------------------------
    # paths and transfers

    def _probe_paths(self) -> None:
        """A write and a read of a few MiB per path: the starting estimate
        (refined by every transfer after)."""
        n = 8 << 20
        probe = host_buffer(n)
        probe.fill_(7)
        for p in self.paths:
            f = p.dir / "probe.bin"
            try:
                for what in ("write", "read"):
                    fn = _core.write_ranges if what == "write" else _core.read_ranges
                    with p.device.turn(what, n):
                        t0 = time.perf_counter()
                        fn(self.engine, f, [0], [n], [probe.data_ptr()], direct=True)
                        p.observe(what, n, time.perf_counter() - t0)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                p.full = True
                self._warn(f"tierstore offload: {p.root} is full; it gets no optimizer state")
            finally:
                f.unlink(missing_ok=True)
        if all(p.full for p in self.paths):
            raise TierstoreError("offload: every path is full: " + ", ".join(str(p.root) for p in self.paths))

    def _warn(self, msg: str) -> None:
        """Queues a warning (workers call this); the training thread issues it."""
        if msg not in self._warned:
            self._warned.add(msg)
            self._pending_warnings.append(msg)

    def _flush_warnings(self) -> None:
        while self._pending_warnings:
            warnings.warn(self._pending_warnings.pop(0), stacklevel=3)

    def _targets(self) -> dict[StoragePath, float]:
        live = [p for p in self.paths if not p.full]
        if self.balance == "even":
            return {p: 1.0 / len(live) for p in live}
        total = sum(p.speed() for p in live)
        return {p: p.speed() / total for p in live}

    def _layout(self) -> dict[int, StoragePath]:
        """The path of each subgroup: interleaved over the subgroups' order in
        proportion to the paths' shares (smooth weighted round robin), so that
        any run of consecutive subgroups, the reads and write-backs in flight
        at one time, spans the paths in those proportions and every path
        works at once. Kept while the shares move by less than
        ``_RELAYOUT`` (every write-back rewrites its subgroup anyway, so a new
        layout costs no extra bytes, only new files)."""
        targets = self._targets()
        old = self._layout_shares
        if (
            self._layout_map
            and old.keys() == targets.keys()
            and max(abs(targets[q] - old[q]) for q in targets) <= _RELAYOUT
        ):
            return self._layout_map
        acc = dict.fromkeys(targets, 0.0)
        seen = 0
        layout: dict[int, StoragePath] = {}
        for sg in self.subgroups:
            seen += sg.nbytes
            p = max(targets, key=lambda q: targets[q] * seen - acc[q])
            acc[p] += sg.nbytes
            layout[sg.index] = p
        self._layout_map, self._layout_shares = layout, targets
        return layout

    def _choose_path(self, sg: Subgroup) -> StoragePath:
        """Where ``sg`` is written back (see :meth:`_layout`), counted there
        from now on."""
        with self._mem:
            p = self._layout()[sg.index]
            if sg.home is not None:
                sg.home.stored -= sg.home_bytes
            p.stored += sg.nbytes
            sg.home, sg.home_bytes = p, sg.nbytes
            return p

    def _write(self, sg: Subgroup, p: StoragePath | None = None, ticket: tuple[int, int] | None = None) -> None:
        """Writes the resident subgroup to path ``p`` (default: the one
        :meth:`_choose_path` picks) on a path worker or the training thread;
        its buffer stays attached."""
        assert sg.buf is not None
        buf = sg.buf
        (crc,) = _core.crc32_regions([(buf.data_ptr(), sg.nbytes)], 1)
        while True:
            p = p if p is not None and not p.full else self._choose_path(sg)
            if sg.path is p and not sg.pinned and sg.file is not None:
                f = sg.file
            else:
                sg.generation += 1
                f = p.dir / f"sg-{sg.index:06d}.{sg.generation}.bin"
            try:
                with p.device.turn("write", sg.nbytes, ticket):
                    t0 = time.perf_counter()
                    _core.write_ranges(self.engine, f, [0], [sg.nbytes], [buf.data_ptr()], size=sg.nbytes, direct=True)
                    dt = time.perf_counter() - t0
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if f != sg.file:
                    f.unlink(missing_ok=True)
                p.full = True
                if all(q.full for q in self.paths):
                    raise
                self._warn(
                    f"tierstore offload: {p.root} is full; its share of the optimizer state moves to the other paths"
                )
                p, ticket = None, None
                continue
            break
        p.observe("write", sg.nbytes, dt)
        old_file = sg.file
        with self._mem:
            self.stats["write_bytes"] += sg.nbytes
            self.stats["write_s"] += dt
        if old_file is not None and old_file != f:
            old_file.unlink(missing_ok=True)  # a checkpoint's pin keeps its own link
        sg.path, sg.file, sg.crc, sg.pinned = p, f, crc, False
        sg.dirty = False

    def _read(self, sg: Subgroup, buf: torch.Tensor, ticket: tuple[int, int] | None = None) -> None:
        """Reads the subgroup's file into ``buf`` and checks it."""
        assert sg.file is not None and sg.path is not None
        p = sg.path
        with p.device.turn("read", sg.nbytes, ticket):
            t0 = time.perf_counter()
            _core.read_ranges(self.engine, sg.file, [0], [sg.nbytes], [buf.data_ptr()], direct=True)
            dt = time.perf_counter() - t0
        p.observe("read", sg.nbytes, dt)
        with self._mem:
            self.stats["read_bytes"] += sg.nbytes
            self.stats["read_s"] += dt
        (crc,) = _core.crc32_regions([(buf.data_ptr(), sg.nbytes)], 1)
        if crc != sg.crc:
            raise ChecksumError(
                f"{sg.file}: offloaded optimizer state of subgroup {sg.index} is damaged "
                f"(CRC-32 {crc:08x}, written {sg.crc:08x}); it is not used",
                path=str(sg.file),
                record=f"subgroup {sg.index}",
            )

    def _write_sync(self, sg: Subgroup) -> None:
        self._write(sg)
        self._detach(sg)

    def _load_sync(self, sg: Subgroup) -> None:
        """Makes ``sg`` resident now (waiting for its I/O in flight)."""
        self._settle(sg)
        if sg.resident:
            return
        self._try_reserve(sg.nbytes, force=True)
        buf = self._alloc(sg.nbytes)
        try:
            self._read(sg, buf)
        except BaseException:
            self._release(buf)
            raise
        self._attach(sg, buf)
        sg.dirty = False

    def _start_read(self, sg: Subgroup) -> None:
        assert sg.path is not None and sg.reading is None
        buf = self._alloc(sg.nbytes)
        ticket = sg.path.device.ticket()

        def job() -> None:
            try:
                self._read(sg, buf, ticket)
            except BaseException:
                self._release(buf)
                raise
            self._attach(sg, buf)
            sg.dirty = False

        sg.reading = self._submit(sg.path, "read", job)

    def _start_write(self, sg: Subgroup) -> None:
        """Writes ``sg`` back and frees its buffer when done (unless the step
        has asked for it meanwhile: see :meth:`_want`)."""
        assert sg.writing is None
        p = self._choose_path(sg)
        ticket = p.device.ticket()

        def job() -> None:
            try:
                self._write(sg, p, ticket)
                with self._mem:
                    if not sg.wanted:  # else this step needs it again soon: it stays
                        self._detach(sg)
            finally:
                with self._mem:
                    self._writes_in_flight -= 1

        with self._mem:
            self._writes_in_flight += 1
        sg.writing = self._submit(p, "write", job)

    def _want(self, sg: Subgroup) -> bool:
        """Asks a subgroup whose write-back is in flight to stay resident
        after it (the step is about to use it again); whether it will."""
        with self._mem:
            if sg.resident:
                sg.wanted = True
            return sg.resident

    def _submit(self, p: StoragePath, what: str, job: Callable[[], None]) -> Future[None]:
        def run() -> None:
            try:
                job()
            finally:
                with self._mem:
                    self._mem.notify_all()

        return p.pools[what].submit(run)

    def _settle(self, sg: Subgroup) -> None:
        """Waits for the subgroup's read or write in flight; raises its error."""
        for attr in ("reading", "writing"):
            f = getattr(sg, attr)
            if f is not None:
                try:
                    f.result()
                finally:
                    setattr(sg, attr, None)

    # -------------------------------------------------------------------------------------------
    # the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._closed:
            raise TierstoreError("this offloaded optimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for d in self.devices:
            d.end_period()
        order = self.subgroups if self.steps % 2 == 0 else self.subgroups[::-1]
        active = [sg for sg in order if any(p.grad is not None for p in sg.params)]
        try:
            if self.pipeline:
                self._step_pipelined(active)
            else:
                for sg in active:
                    self._load_sync(sg)
                    self._update(sg)
                    self._write_sync(sg)
        finally:
            self._flush_warnings()
        self.steps += 1
        return loss

    def _step_pipelined(self, order: list[Subgroup]) -> None:
        # What stays resident for the next step (the last subgroups of this
        # order, the first of the next one).
        keep: set[int] = set()
        room = self._keep_budget()
        for sg in reversed(order):
            size = sg.nbytes if sg.inner is not None else 3 * sg.nbytes  # state is created in the first step
            if size > room:
                continue  # the tail need not be contiguous: smaller ones may still fit
            keep.add(sg.index)
            room -= size
        # A subgroup resident now but not wanted until much later is written
        # back first, making room for the reads this step needs soon.
        nxt = 0  # next position in `order` to read ahead
        for pos, sg in enumerate(order):
            nxt = max(nxt, pos)
            nxt = self._read_ahead(order, nxt)
            t0 = time.perf_counter()
            while True:
                f = sg.writing or sg.reading
                if f is not None:
                    if f is sg.writing:
                        self._want(sg)
                    if f.done():
                        self._settle(sg)
                        continue
                elif sg.resident:
                    break
                elif self._try_reserve(sg.nbytes, force=self._writes_in_flight == 0):
                    # Not started for lack of room; there is room now (or
                    # nothing in flight will make any: the working minimum).
                    self._start_read(sg)
                    continue
                with self._mem:
                    self._mem.wait(0.05)
                nxt = self._read_ahead(order, nxt)
            self.stats["wait_s"] += time.perf_counter() - t0
            sg.wanted = False
            self._update(sg)
            if sg.index not in keep:
                self._start_write(sg)
            self._check_errors(order[: pos + 1])
        # The write-backs finish during the next forward and backward.

    def _read_ahead(self, order: list[Subgroup], nxt: int) -> int:
        """Starts reads of ``order[nxt:]`` while the budget has room; returns
        the first position not started."""
        while nxt < len(order):
            sg = order[nxt]
            if sg.writing is not None and sg.writing.done():
                self._settle(sg)
            if sg.writing is not None and not self._want(sg):
                break  # written back and let go: read it once the write is done
            if sg.resident or sg.reading is not None:
                nxt += 1
                continue
            if not self._try_reserve(sg.nbytes):
                break
            self._start_read(sg)
            nxt += 1
        return nxt

    def _check_errors(self, done: list[Subgroup]) -> None:
        for sg in done:
            f = sg.writing
            if f is not None and f.done() and f.exception() is not None:
                self._settle(sg)

    def _sync_hyper(self, sg: Subgroup) -> None:
        assert sg.inner is not None
        for k, v in self.param_groups[sg.group].items():
            if k != "params":
                sg.inner.param_groups[0][k] = v

    def _grad_buffer(self, numel: int) -> torch.Tensor:
        if self._grad32 is None or self._grad32.numel() < numel:
            self._grad32 = torch.empty(numel, dtype=torch.float32)
        return self._grad32[:numel]

    def _update(self, sg: Subgroup) -> None:
        """The wrapped optimizer's step on the resident subgroup; the updated
        masters are copied into the model parameters."""
        t0 = time.perf_counter()
        if sg.inner is None:
            hyper = {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}
            sg.inner = self.cls([{"params": sg.masters, **hyper}], **self.kwargs)
        self._sync_hyper(sg)
        if sg.split:
            if self._master32 is None or self._master32.numel() < sg.numel:
                self._master32 = torch.empty(sg.numel, dtype=torch.float32)
            for m, v in zip(sg.masters, self._rebuild_masters(sg, self._master32), strict=True):
                m.data = v
        # Gradients are converted to fp32 here only, into one reused buffer.
        scratch = self._grad_buffer(sg.numel)
        off = 0
        for p, m in zip(sg.params, sg.masters, strict=True):
            g = p.grad
            if g is None:
                m.grad = None
                continue
            if g.dtype == torch.float32 and g.device.type == "cpu" and not g.is_sparse:
                m.grad = g.detach()
            else:
                view = scratch[off : off + g.numel()].view(g.shape)
                view.copy_(g.detach())
                m.grad = view
                off += g.numel()
        before = len(self._tensors(sg))
        sg.inner.step()
        for m in sg.masters:
            m.grad = None
        split = self._splits(sg)
        if len(self._tensors(sg)) != before or split != sg.split:
            # The first step created state, or the parameters' dtype changed:
            # a new layout (split masters are stored, parameters set, by _pack).
            sg.split = split
            self._pack(sg)
        elif split:
            for p, m, lo in zip(sg.params, sg.masters, self._low_halves(sg), strict=True):
                self._split_master(p, m, lo)
        if split:
            self._drop_masters(sg)
        else:
            for p, m in zip(sg.params, sg.masters, strict=True):
                p.copy_(m)
        sg.dirty = True
        self.stats["update_s"] += time.perf_counter() - t0

    # -------------------------------------------------------------------------------------------
    # the rest of the optimizer interface

    def wait_io(self) -> None:
        """Waits for the reads and write-backs in flight; raises their errors."""
        for sg in self.subgroups:
            self._settle(sg)
        self._flush_warnings()

    def placement(self) -> dict[str, int]:
        """Bytes of optimizer state (fp32 masters included) resident in host
        memory (``"host"``) and stored on each path (by directory)."""
        self.wait_io()
        out = {"host": sum(sg.nbytes for sg in self.subgroups if sg.resident)}
        for p in self.paths:
            out[str(p.root)] = sum(sg.nbytes for sg in self.subgroups if not sg.resident and sg.path is p)
        return out

    def bandwidth(self) -> dict[str, dict[str, float]]:
        """The current estimate per path: read and write bytes per second,
        the share of state it is given, the bytes moved."""
        targets = self._targets()
        return {
            str(p.root): {
                "read": p.rate["read"],
                "write": p.rate["write"],
                "share": targets.get(p, 0.0),
                "read_bytes": p.moved["read"],
                "write_bytes": p.moved["write"],
                "full": float(p.full),
                "duplex": float(p.device.duplex),
            }
            for p in self.paths
        }

    def master_params(self) -> list[torch.Tensor]:
        """Copies of the fp32 master weights, in parameter order (read back
        from the tiers where they are not resident)."""
        out: list[torch.Tensor] = []
        for sg in self.subgroups:
            was = sg.resident
            self._load_sync(sg)
            if sg.split:
                out.extend(self._rebuild_masters(sg))
            else:
                out.extend(m.detach().clone() for m in sg.masters)
            if not was and not sg.dirty:
                self._detach(sg)
        return out

    def host_bytes(self) -> int:
        """Bytes of host memory held for state (resident, in flight and free buffers)."""
        with self._mem:
            return self._held

    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: state by parameter index, param_groups."""
        state: dict[int, dict[str, Any]] = {}
        index = self._index()
        for sg in self.subgroups:
            was = sg.resident
            self._load_sync(sg)
            if sg.inner is not None:
                for p, m in zip(sg.params, sg.masters, strict=True):
                    st = sg.inner.state.get(m)
                    if st:
                        state[index[id(p)]] = {
                            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()
                        }
            if not was and not sg.dirty:
                self._detach(sg)  # its file is still valid
        groups = []
        for g in self.param_groups:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [index[id(p)] for p in g["params"]]
            groups.append(g2)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state dict (or one of ours): fp32
        masters from the model parameters, state into the tiers."""
        sd = state_dict
        if len(sd["param_groups"]) != len(self.param_groups):
            raise InvalidArgumentError("loaded state dict has a different number of parameter groups")
        for g, g2 in zip(self.param_groups, sd["param_groups"], strict=True):
            if len(g["params"]) != len(g2["params"]):
                raise InvalidArgumentError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
        for g, g2 in zip(self.param_groups, sd["param_groups"], strict=True):
            g.update({k: v for k, v in g2.items() if k != "params"})
        index = self._index()
        resident = 0
        for sg in self.subgroups:
            self._load_sync(sg)
            hyper = {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}
            if sg.inner is None:
                sg.inner = self.cls([{"params": sg.masters, **hyper}], **self.kwargs)
            sg.split = False  # the masters from the parameters, whole (split again by the next update)
            for p, m in zip(sg.params, sg.masters, strict=True):
                m.data = p.detach().to("cpu", torch.float32, copy=True)
                st = sd["state"].get(index[id(p)])
                if st is not None:
                    sg.inner.state[m] = {
                        k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items()
                    }
                else:
                    sg.inner.state.pop(m, None)
            self._pack(sg)
            resident += sg.nbytes
            if resident > self._keep_budget():
                self._write_sync(sg)
                resident -= sg.nbytes

    # -------------------------------------------------------------------------------------------
    # checkpoints (called by tierstore.Checkpointer)

    def checkpoint_parts(
        self, prefix: str, pin_tag: str, file_prefix: str = ""
    ) -> tuple[dict[str, Any], list[tuple[Path, str]]]:
        """The state as a checkpoint takes it, between steps, without reading
        anything back: resident subgroups (and those whose write-back is in
        flight: their buffers are unchanged until the next step) as flat byte
        tensors, to be captured before the next step changes them; the others
        as their files, pinned by a hard link (a later write-back goes to a new
        file, never into a pinned one) and copied by the checkpointer.

        Returns ``({"__tierstore_offload__": ("tierstore-offload/2", meta),
        "<prefix>sg-000003": tensor,
        ...}, [(pin, file name in the checkpoint), ...])``."""
        self._flush_warnings()
        index = self._index()
        parts: dict[str, Any] = {}
        pins: list[tuple[Path, str]] = []
        subgroups = []
        for sg in self.subgroups:
            entry: dict[str, Any] = {
                "index": sg.index,
                "group": sg.group,
                "first": sg.first,
                "count": len(sg.params),
                "nbytes": sg.nbytes,
                "split": sg.split,
                "layout": [
                    [i, k, o, n, str(dt).removeprefix("torch."), list(shape)] for i, k, o, n, dt, shape in sg.layout
                ],
                "objects": self._objects(sg),
            }
            if sg.buf is None and sg.reading is not None:
                self._settle(sg)  # only a state_dict() read can be in flight here
            if sg.buf is not None:
                entry["tensor"] = f"{prefix}sg-{sg.index:06d}"
                parts[entry["tensor"]] = sg.buf
            else:
                assert sg.file is not None
                name = f"{file_prefix}{prefix}sg-{sg.index:06d}.bin"
                pin = sg.file.parent / f"pin-{pin_tag}-sg-{sg.index:06d}.bin"
                try:
                    os.link(sg.file, pin)
                    sg.pinned = True
                except OSError:  # no hard links here: take the bytes now
                    buf = host_buffer(sg.nbytes)
                    self._read(sg, buf)
                    entry["tensor"] = f"{prefix}sg-{sg.index:06d}"
                    parts[entry["tensor"]] = buf
                else:
                    entry["file"] = name
                    entry["crc32"] = sg.crc
                    pins.append((pin, name))
            subgroups.append(entry)
        groups = []
        for g in self.param_groups:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [index[id(p)] for p in g["params"]]
            groups.append(g2)
        meta = {
            "optimizer": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "steps": self.steps,
            "param_groups": groups,
            "params": [
                {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                for g in self.param_groups
                for p in g["params"]
            ],
            "subgroups": subgroups,
        }
        # A (format, meta) pair: saved as one object, not flattened into keys.
        parts[OFFLOAD_KEY] = (OFFLOAD_FORMAT, meta)
        return parts, pins

    def _objects(self, sg: Subgroup) -> dict[str, dict[str, Any]]:
        """Non-tensor state values (kept in memory), by parameter index in the subgroup."""
        out: dict[str, dict[str, Any]] = {}
        if sg.inner is None:
            return out
        for i, m in enumerate(sg.masters):
            st = sg.inner.state.get(m, {})
            o = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
            if o:
                out[str(i)] = o
        return out

    def _matches(self, meta: dict[str, Any]) -> bool:
        """Whether a checkpoint's subgroups are this optimizer's (same
        parameters, same partition), so that its bytes go in as they are."""
        params = [p for g in self.param_groups for p in g["params"]]
        if meta.get("optimizer") != f"{self.cls.__module__}.{self.cls.__qualname__}":
            return False
        if [tuple(q["shape"]) for q in meta["params"]] != [tuple(p.shape) for p in params]:
            return False
        mine = [(sg.group, sg.first, len(sg.params)) for sg in self.subgroups]
        return mine == [(e["group"], e["first"], e["count"]) for e in meta["subgroups"]]

    @torch.no_grad()
    def restore_from_checkpoint(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], d: Path) -> None:
        """Puts a checkpoint's offloaded state back (see :meth:`_checkpoint_parts`):
        each subgroup's bytes, checked, straight into host memory or a path;
        with another partition, through the wrapped optimizer's state dict."""
        if not self._matches(meta):
            self.load_state_dict(restore_state_dict(meta, tensors, d))
            return
        self.wait_io()
        for g, g2 in zip(self.param_groups, meta["param_groups"], strict=True):
            g.update({k: v for k, v in g2.items() if k != "params"})
        resident = 0
        for sg, e in zip(self.subgroups, meta["subgroups"], strict=True):
            if sg.buf is not None:
                self._detach(sg)
            self._wait_room(e["nbytes"])
            buf = self._alloc(e["nbytes"])
            try:
                subgroup_bytes(e, tensors, d, out=buf)
            except BaseException:
                self._release(buf)
                raise
            if sg.inner is None:
                hyper = {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}
                sg.inner = self.cls([{"params": sg.masters, **hyper}], **self.kwargs)
            sg.inner.state.clear()
            for i, objs in e["objects"].items():
                sg.inner.state[sg.masters[int(i)]].update(objs)
            sg.layout = [(i, k, o, n, state_dtype(dt), tuple(shape)) for i, k, o, n, dt, shape in e["layout"]]
            sg.nbytes = e["nbytes"]
            sg.split = bool(e.get("split", False))
            if sg.split:  # rebuilt from the parameters (restored with the model) at the next update
                self._drop_masters(sg)
            self._layout_map = {}
            for i, k, *_ in sg.layout:
                if k is not None:
                    sg.inner.state.setdefault(sg.masters[i], {})
            self._attach(sg, buf)
            sg.dirty = True
            resident += sg.nbytes
            if resident > self._keep_budget():
                self._write_sync(sg)
                resident -= sg.nbytes
        self.steps = int(meta.get("steps", 0))

    def close(self) -> None:
        """Removes this process's offload files (the optimizer is unusable after)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for sg in self.subgroups:
            with contextlib.suppress(Exception):
                self._settle(sg)
        for p in self.paths:
            for pool in p.pools.values():
                pool.shutdown(wait=True)
            shutil.rmtree(p.dir, ignore_errors=True)
        for d in self.devices:
            d.close()
        for fd in self._alive_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._alive_fds = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (
            f"OffloadedOptimizer({self.cls.__name__}, {len(self.subgroups)} subgroups, "
            f"host budget {self.budget / 2**20:.0f} MiB, paths {[str(p.root) for p in self.paths]})"
        )


def offload(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    *,
    tiers: list[HostTier | DiskTier] | None = None,
    **optimizer_kwargs: Any,
) -> OffloadedOptimizer:
    """Wraps ``optimizer_class`` so that its fp32 master weights and state live
    in ``tiers`` (default: ``TIERSTORE_OFFLOAD_HOST`` of host memory, 1 GiB,
    and the scratch directory ``TIERSTORE_OFFLOAD_DIR``). The options of
    :class:`OffloadedOptimizer` (``subgroup_bytes``, ``io_slots``, ``device_slots``, ``duplex``,
    ``exclusive_io``, ``balance``, ``pipeline``, ``split_masters``) may be passed among the
    optimizer's keyword arguments."""
    names = (
        "subgroup_bytes",
        "io_slots",
        "device_slots",
        "duplex",
        "exclusive_io",
        "balance",
        "pipeline",
        "split_masters",
    )
    extra = {k: optimizer_kwargs.pop(k) for k in names if k in optimizer_kwargs}
    return OffloadedOptimizer(optimizer_class, params, tiers=tiers, **extra, **optimizer_kwargs)
