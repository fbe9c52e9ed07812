"""Lazy, asynchronous, multi-level checkpointing.

::

    ckpt = tierstore.Checkpointer("runs/exp1")          # host memory + local disk
    ckpt.attach(optimizer)
    for step, batch in enumerate(loader):
        loss = model(batch); loss.backward()
        optimizer.step()                                # waits only for the last capture
        if ckpt.due(step):
            ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
    ckpt.wait()
    state = ckpt.load_latest()

``save`` returns at once with a :class:`CheckpointHandle`. A capture thread
copies the tensors into reusable host buffers (pinned, on a side stream, for
GPU tensors) while the next forward and backward run; the optimizer step
pre-hook installed by :meth:`Checkpointer.attach` blocks only until the
tensors the step will change are copied. A flush thread writes each captured
snapshot as a sharded checkpoint (see :mod:`tierstore.sharded`) to the local
disk tier through the engine's background class, and a promotion thread
copies it on to farther tiers. Every checkpoint is a directory
``step-<step>`` per tier, committed by its ``manifest.json``; a crash at any
moment leaves the previous checkpoints loadable.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import math
import os
import queue
import re
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstore import _core, _metadata, _paths, _threads, _tree
from tierstore._dist import all_gather, group_info
from tierstore._engine import get_engine, host_buffer
from tierstore._fs import make_dir, write_json_atomic
from tierstore._offload_entry import OFFLOAD_KEY, is_offload_parts, offload_meta, restore_state_dict
from tierstore.errors import InvalidArgumentError, LayoutError, TierstoreError, TornSnapshotError, WaitTimeoutError
from tierstore.layout import Layout, layout_of
from tierstore.layout import attach as attach_layout
from tierstore.sharded import (
    PerRank,
    consolidate,
    is_dtensor,
    load_sharded,
    tensor_and_layout,
    write_sharded,
)
from tierstore.shardmeta import MANIFEST, read_attachment, read_manifest

# The tiers live in tierstore.tiers; re-exported here, where users import them from.
from tierstore.tiers import DiskTier, HostTier, RemoteTier, parse_size

__all__ = [
    "CheckpointHandle",
    "Checkpointer",
    "DiskTier",
    "HostTier",
    "RemoteTier",
    "TornSnapshotError",
    "parse_size",
]


STEP_DIR = re.compile(r"^step-(\d{12})$")
META = "checkpoint.json"
_ALIGN = 64  # small tensors in a slab
_PAGE = 4096  # tensors of _BIG bytes or more start on a page (direct writes)
_BIG = 64 << 10

# ----------------------------------------------------------------------------------------------
# host buffers


class _Slab:
    """One host buffer. Each captured tensor gets its own storage over a slice
    of it (a storage per tensor, as a torch checkpoint needs); the views of
    the last layout used are kept, so a repeated save reuses them."""

    __slots__ = ("buf", "holder", "mem", "nbytes", "views", "views_key")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        # Offsets count from the first page boundary, so that page-aligned
        # tensors are written to O_DIRECT files straight from this memory.
        base = -buf.data_ptr() % _PAGE
        self.mem = memoryview(buf.numpy())[base:]  # type: ignore[arg-type]
        self.nbytes = buf.numel() - _PAGE
        self.holder: _Snapshot | None = None
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


class _HostPool:
    """Capture buffers within a byte budget, reused across saves.

    A slab is *busy* while its snapshot is not yet durable on a disk tier,
    *retained* while it holds a durable snapshot (evictable), and *free*.
    """

    def __init__(self, budget: int, pinned: bool) -> None:
        self.budget = budget
        self.pinned = pinned
        self.slabs: list[_Slab] = []
        self.cond = threading.Condition()
        self.peak = 0

    @property
    def allocated(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def in_use(self) -> int:
        with self.cond:
            return sum(s.nbytes for s in self.slabs if s.holder is not None and not s.holder.evictable)

    def _try(self, nbytes: int, snap: _Snapshot) -> _Slab | None:
        def free(s: _Slab) -> bool:
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
        take: list[_Slab] = []
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
            buf = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=True)
        else:  # huge pages: the flush's direct writes go out in full-size requests
            buf = host_buffer(nbytes + _PAGE)
        s = _Slab(buf)
        s.holder = snap
        self.slabs.append(s)
        self.peak = max(self.peak, self.allocated)
        return s

    @staticmethod
    def _evict(s: _Slab) -> None:
        if s.holder is not None:
            s.holder.host_evicted()
            s.holder = None

    def _evict_snapshot(self, snap: _Snapshot) -> None:
        for s in self.slabs:
            if s.holder is snap:
                self._evict(s)

    def reserve(self, nbytes: int, snap: _Snapshot, block: bool, timeout: float | None = None) -> _Slab | None:
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

    def release(self, snap: _Snapshot) -> None:
        with self.cond:
            for s in self.slabs:
                if s.holder is snap:
                    s.holder = None
            self.cond.notify_all()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


# ----------------------------------------------------------------------------------------------
# snapshots and handles


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
class _Item:
    src: torch.Tensor
    dst: torch.Tensor
    version: int
    mutable: bool  # an attached optimizer changes it (or no optimizer is attached)
    layout: Layout | None  # attached to the copy (layouts and DTensor placements)


class _Snapshot:
    def __init__(self, step: int, ordinal: int, handle: CheckpointHandle) -> None:
        self.step = step
        self.ordinal = ordinal
        self.handle = handle
        self.state: dict[str, Any] = {}
        self.tree: list[tuple[str, list[str]]] = []
        self.items: list[_Item] = []
        self.mutable_done = threading.Event()
        self.captured = threading.Event()
        self.verified = threading.Event()  # the debug check passed (set at once without debug)
        self.error: BaseException | None = None
        self.evictable = False
        self.in_host = True
        self.t_save = time.perf_counter()
        self.event: Any = None  # CUDA event recorded on the training stream at save()
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

    def release_sources(self) -> None:
        """Drops the references to the training tensors."""
        for it in self.items:
            it.src = it.dst

    def host_evicted(self) -> None:
        self.in_host = False
        self.state = {}
        if self.handle.tiers.get("host") == "captured":
            self.handle._set("host", "evicted")


def _copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for the capture thread: dense host tensors go
    through libc's memmove on this one thread, with the GIL released (ctypes
    releases it); for large sizes it uses non-temporal stores, so the copy
    leaves the training's working set in the caches, and it starts no OpenMP
    team. Anything else goes through torch."""
    n = src.numel() * src.element_size()
    if (
        n >= _BIG
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
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


def _checkpoints_itself(obj: Any) -> bool:
    """Whether ``obj`` takes part in checkpoints through the protocol an
    ``OffloadedOptimizer`` implements: ``checkpoint_parts(prefix, tag,
    file_prefix) -> (parts, pins)`` (its entry, see
    :mod:`tierstore._offload_entry`, and files to copy) and
    ``restore_from_checkpoint(meta, tensors, directory)``. The Checkpointer
    needs no import of the optimizer's module."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping))
        and callable(getattr(obj, "checkpoint_parts", None))
        and callable(getattr(obj, "restore_from_checkpoint", None))
    )


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local shard's)."""
    if is_dtensor(t):
        t = t.to_local()
    return int(t.untyped_storage().data_ptr())


def _flat_tree(sd: Mapping[str, Any]) -> list[tuple[str, list[Any]]]:
    """(flat key, key path) per leaf, with the flattening rules of save_sharded."""
    try:
        return [(leaf.key, list(leaf.path)) for leaf in _tree.flatten(sd, where="Checkpointer.save")]
    except ValueError as e:  # two values with one key
        raise LayoutError(str(e)) from None


def _unflatten(flat: Mapping[str, Any], tree: list[list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    placed = set()
    for key, path in tree:
        if key not in flat:
            continue
        _tree.set_path(out, path, flat[key])
        placed.add(key)
    for key, v in flat.items():  # global tensors saved under layouts of other names
        if key not in placed:
            out[key] = v
    return out


# ----------------------------------------------------------------------------------------------
# the checkpointer


class Checkpointer:
    """Lazy asynchronous checkpoints cascading host memory → local disk → remote.

    ``path``: the job's checkpoint directory; relative :class:`DiskTier`
    paths are under it (a :class:`RemoteTier`'s are relative to the working
    directory).
    ``tiers``: nearest first; default ``[HostTier(), DiskTier(".")]``.
    ``on_busy``: when a save arrives while the host budget is still occupied by
    snapshots not yet durable: ``"wait"`` (block until there is room) or
    ``"skip"`` (drop this save with a warning). ``interval`` and
    ``max_overhead`` drive :meth:`due`: with ``max_overhead`` (a fraction, e.g.
    0.02) the interval grows when the measured blocking time exceeds that
    share of the step time. ``debug`` checks that no tensor changed before
    its capture finished (raises :class:`TornSnapshotError`).
    ``rate_limit``: bytes per second for background flush and promotion I/O.
    ``process_group``: the ranks saving together (default: the whole world);
    the checkpointer's own collectives (on gloo groups of those ranks, off the
    training thread) give up after ``collective_timeout`` seconds, so a rank
    that died fails that checkpoint instead of hanging the others.
    ``priority``: the scheduling class of the capture, flush and promotion
    threads (and the engine threads they start): ``"normal"`` (default),
    ``"low"`` (nice 19) or ``"idle"`` (``SCHED_IDLE``: only cores training
    leaves idle); see :mod:`tierstore._threads` for why the default is not
    lower.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tiers: list[HostTier | DiskTier] | None = None,
        *,
        on_busy: str = "wait",
        interval: int = 1,
        max_overhead: float | None = None,
        debug: bool = False,
        rate_limit: int | str | None = None,
        process_group: Any = None,
        eager_unowned: bool = True,
        collective_timeout: float = 600.0,
        priority: str = "normal",
    ) -> None:
        _threads.check_priority(priority)
        if on_busy not in ("wait", "skip"):
            raise InvalidArgumentError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if interval < 1:
            raise InvalidArgumentError(f"interval must be at least 1, got {interval}")
        self.path = Path(path)
        tiers = list(tiers) if tiers is not None else [HostTier(), DiskTier(".")]
        hosts = [t for t in tiers if isinstance(t, HostTier)]
        self.disks: list[DiskTier] = [t for t in tiers if isinstance(t, DiskTier)]
        if len(hosts) > 1 or (hosts and tiers[0] is not hosts[0]):
            raise InvalidArgumentError("at most one HostTier, and it must come first")
        if not self.disks:
            raise InvalidArgumentError("at least one DiskTier is needed for checkpoints to be durable")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"tier names must differ: {names}")
        self.host = hosts[0] if hosts else HostTier()
        pinned = self.host.pinned if self.host.pinned is not None else torch.cuda.is_available()
        self.pool = _HostPool(int(self.host.budget), pinned)
        self.tier_names = [self.host.name] + [t.name for t in self.disks]
        self.on_busy = on_busy
        self.interval = interval
        self.min_interval = interval
        self.max_overhead = max_overhead
        self.debug = debug
        self.eager_unowned = eager_unowned
        if rate_limit is not None:
            get_engine().set_background_rate(parse_size(rate_limit))
        self.rank, self.world, pg = group_info(process_group)
        self._pg_ctl = self._pg_flush = self._pg_promote = None
        if self.world > 1:
            from datetime import timedelta

            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            to = timedelta(seconds=collective_timeout)
            self._pg_ctl = dist.new_group(ranks, backend="gloo", timeout=to)
            self._pg_flush = dist.new_group(ranks, backend="gloo", timeout=to)
            self._pg_promote = dist.new_group(ranks, backend="gloo", timeout=to)
        for t in self.disks:
            for p in self._tier_paths(t):
                p.mkdir(parents=True, exist_ok=True)
        self._ordinal = 0
        self._last_step: int | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._pending: list[_Snapshot] = []  # not yet captured
        self._snaps: list[_Snapshot] = []  # every snapshot still holding host memory or in flight
        self._handles: list[CheckpointHandle] = []
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._capture_errors: list[BaseException] = []
        self._owned_cache: tuple[Any, set[int]] | None = None
        self._busy_dirs: set[Path] = set()
        self._step_times: list[float] = []
        self._last_hook: float | None = None
        self._stream: Any = None
        self.restored: dict[str, Any] | None = None
        self.priority = priority
        # The engine's own threads serve foreground loads too: start it here,
        # so that they take this thread's class, not the background threads'.
        get_engine()
        self.priority_error: str | None = None  # why the threads could not be lowered, if they could not
        self._capture_q: queue.Queue[_Snapshot | None] = queue.Queue()
        self._flush_q: queue.Queue[_Snapshot | None] = queue.Queue()
        self._promote_q: queue.Queue[_Snapshot | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, args=(self._capture_q, self._capture, "ts-capture"), name="ts-capture"),
            threading.Thread(target=self._run, args=(self._flush_q, self._flush, "ts-flush"), name="ts-flush"),
            threading.Thread(target=self._run, args=(self._promote_q, self._promote, "ts-promote"), name="ts-promote"),
        ]
        for th in self._threads:
            th.daemon = True
            th.start()
        self._closed = False

    # ------------------------------------------------------------------------------------------
    # public API

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Makes ``optimizer.step()`` wait until the tensors it changes are
        captured (a step pre-hook); nothing else waits."""
        self._optimizers.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step`` under the (adaptive) interval."""
        if self._last_step is None:
            return step % self.interval == 0
        return step - self._last_step >= self.interval

    def save(self, step: int, state: Mapping[str, Any]) -> CheckpointHandle:
        """Starts a checkpoint of ``state`` at ``step`` and returns at once.

        Tensors are captured in the background: until :meth:`wait_capture`
        returns (or, with :meth:`attach`, until the optimizer step), the caller
        must not modify them. Non-tensor values are copied now.
        """
        # A collection in the middle of a save would add its pause to the
        # training loop; the save allocates little, so it waits until after.
        gc_on = gc.isenabled()
        gc.disable()
        try:
            return self._save(step, state)
        finally:
            if gc_on:
                gc.enable()

    def _save(self, step: int, state: Mapping[str, Any]) -> CheckpointHandle:
        t0 = time.perf_counter()
        self._verify()
        self._raise_errors()
        if self._closed:
            raise TierstoreError("this Checkpointer is closed")
        if step < 0:
            raise InvalidArgumentError(f"step must be non-negative, got {step}")
        handle = CheckpointHandle(step, self.tier_names)
        snap = _Snapshot(step, self._ordinal, handle)
        state, offload_buffers = self._expand_offloaded(state, snap)
        owned = self._owned_storages() if (self._optimizers and self.eager_unowned) else None
        if owned is not None and offload_buffers:
            owned = owned | offload_buffers  # changed by the next step: captured lazily, before it
        plan: list[tuple[torch.Tensor, Any]] = []
        memo: dict[int, Any] = {}
        nbytes = [0]

        def reserve(t: torch.Tensor) -> int:
            n = t.numel() * t.element_size()
            a = _PAGE if n >= _BIG else _ALIGN
            off = -(-nbytes[0] // a) * a
            nbytes[0] = off + n
            return off

        state_copy = self._copy_tree(state, snap, plan, memo, reserve, owned, "")
        snap.tree = list(_flat_tree(state_copy)) if isinstance(state_copy, Mapping) else []
        # Room in host memory, else the backpressure policy.
        block = self.on_busy == "wait"
        slab = self.pool.reserve(nbytes[0], snap, block=False)
        if self.world > 1 and self.on_busy == "skip":
            oks = all_gather(slab is not None, self.world, self._pg_ctl)
            if not all(oks) and slab is not None:
                self.pool.release(snap)
                slab = None
        elif slab is None and block:
            slab = self.pool.reserve(nbytes[0], snap, block=True)
        if slab is None:
            self._drop_offload_pins(snap)
            for name in self.tier_names:
                handle._set(name, "skipped")
            busy = [s.step for s in self._snaps if not s.evictable]
            warnings.warn(
                f"tierstore: checkpoint of step {step} skipped: the host budget "
                f"({self.pool.budget / 2**20:.0f} MiB) is still held by step(s) {busy} not yet durable "
                f"(on_busy='skip')",
                stacklevel=2,
            )
            handle.timings["blocked"] = time.perf_counter() - t0
            self._handles.append(handle)
            return handle
        self._adapt_interval()
        self._ordinal += 1
        self._last_step = step
        views = slab.views_for([(off, t.numel() * t.element_size(), t.dtype, tuple(t.shape)) for t, off in plan])
        for view, item in zip(views, snap.items, strict=True):
            item.dst.set_(view)  # type: ignore[call-overload]  # the placeholder becomes the host copy
            if item.layout is not None:
                attach_layout(item.dst, item.layout)
        snap.state = state_copy
        # Eager part: tensors no attached optimizer changes (buffers, counters).
        lazy: list[_Item] = []
        for it in snap.items:
            if not it.mutable and it.src.device.type == "cpu":
                with torch.no_grad():
                    it.dst.copy_(it.src)
            else:
                lazy.append(it)
        lazy.sort(key=lambda it: not it.mutable)  # what the step changes first
        snap.items = lazy
        snap.taken = [False] * len(lazy)
        snap.done = [False] * len(lazy)
        snap.n_mutable = sum(1 for it in lazy if it.mutable)
        if not self.debug:
            snap.verified.set()
            snap.gate = _core.Gate()
            snap.gates = {it.dst.untyped_storage().data_ptr(): (snap.gate, i + 1) for i, it in enumerate(lazy)}
        if any(it.src.is_cuda for it in lazy):
            snap.event = torch.cuda.Event()
            snap.event.record()
        with self._lock:
            self._snaps.append(snap)
            self._pending.append(snap)
            self._handles.append(handle)
        self._capture_q.put(snap)
        if snap.gate is not None:
            self._flush_q.put(snap)  # pipelined: writes follow the capture
        handle.timings["blocked"] = time.perf_counter() - t0
        return handle

    def _expand_offloaded(self, state: Mapping[str, Any], snap: _Snapshot) -> tuple[Mapping[str, Any], set[int]]:
        """Replaces each offloaded optimizer in ``state`` by its checkpoint
        parts (resident subgroups as tensors, the others as pinned files that
        the flush copies), attaching it so that its next step waits for the
        capture. Returns the new state and the storages of those tensors."""
        buffers: set[int] = set()
        count = [0]

        def walk(obj: Any) -> Any:
            if _checkpoints_itself(obj):
                if obj not in self._optimizers:
                    self.attach(obj)
                prefix = f"r{self.rank:05d}-o{count[0]}-" if self.world > 1 else f"o{count[0]}-"
                tag = f"{os.getpid()}-{snap.ordinal}-{count[0]}"
                parts, pins = obj.checkpoint_parts(prefix, tag, f"offload-{self.rank:05d}.")
                count[0] += 1
                snap.has_offload = True
                snap.offload_pins.extend(pins)
                for v in parts.values():
                    if isinstance(v, torch.Tensor):
                        buffers.add(v.untyped_storage().data_ptr())
                if self.world > 1:
                    parts[OFFLOAD_KEY] = PerRank(parts[OFFLOAD_KEY])
                return parts
            if isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor):
                if not any(_checkpoints_itself(v) or isinstance(v, Mapping) for v in obj.values()):
                    return obj
                out = dict(obj)
                for k, v in obj.items():
                    out[k] = walk(v)
                return out
            return obj

        return walk(state), buffers

    def _copy_offload_pins(self, snap: _Snapshot, d: Path) -> None:
        """Copies the pinned subgroup files of offloaded optimizers into the
        checkpoint directory ``d`` (reflink where the file system can)."""
        if not snap.offload_pins:
            return
        d.mkdir(parents=True, exist_ok=True)
        engine = get_engine()
        for pin, name in snap.offload_pins:
            _core.copy_file(engine, pin, d / name, background=True)

    @staticmethod
    def _drop_offload_pins(snap: _Snapshot) -> None:
        for pin, _name in snap.offload_pins:
            with contextlib.suppress(OSError):
                pin.unlink()
        snap.offload_pins = []

    def _adapt_interval(self) -> None:
        """With ``max_overhead``: sets the interval so that the blocking time of
        the last checkpoint, spread over the interval's steps, stays under
        that share of the measured step time."""
        if self.max_overhead is None or not self._step_times:
            return
        prev = [h for h in self._handles if h.state not in ("skipped", "failed")]
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

    def wait_capture(self) -> None:
        """Blocks until every started checkpoint is captured (needed before
        modifying saved tensors when no optimizer is attached)."""
        t0 = time.perf_counter()
        with self._lock:
            pending = list(self._pending)
        for s in pending:
            s.captured.wait()
        if pending:
            pending[-1].handle.timings["blocked"] += time.perf_counter() - t0
        self._verify()
        self._raise_errors()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every checkpoint in flight is settled on every tier
        (durable where it is destined). Raises the error of a checkpoint that
        failed everywhere, or of an unexpected failure in a background thread;
        a failure on one tier that another tier made up for is a warning."""
        if self.debug:
            self.wait_capture()
        for h in list(self._handles):
            with contextlib.suppress(BaseException):
                h.wait(None, timeout)
        self._raise_errors()
        if self._errors:
            e = self._errors.pop(0)
            self._errors.clear()
            raise e
        for h in self._handles:
            if h.state == "failed" and h.error is not None and not h.reported:
                h.reported = True
                raise h.error

    def handles(self) -> list[CheckpointHandle]:
        """Every checkpoint started by this checkpointer, oldest first."""
        return list(self._handles)

    def stats(self) -> dict[str, Any]:
        """Host memory (budget, allocated, in use, peak), the interval and the
        bytes and requests completed per device by the engine."""
        return {
            "host_budget": self.pool.budget,
            "host_allocated": self.pool.allocated,
            "host_in_use": self.pool.in_use(),
            "host_peak": self.pool.peak,
            "interval": self.interval,
            "engine_paths": get_engine().path_stats(),
        }

    def checkpoints(self) -> list[dict[str, Any]]:
        """Complete checkpoints per tier: ``[{"step", "tier", "path"}]``, newest first,
        nearest tier first."""
        out: list[dict[str, Any]] = []
        with self._lock:
            snaps = list(self._snaps)
        for s in snaps:
            if (
                s.in_host
                and not s.has_offload
                and s.captured.is_set()
                and s.error is None
                and s.handle.tiers.get("host") == "captured"
            ):
                out.append({"step": s.step, "tier": self.host.name, "path": None, "rank": 0, "_snap": s})
        for ti, t in enumerate(self.disks):
            for p in self._tier_paths(t):
                for d in _step_dirs(p, t.name):
                    m = STEP_DIR.match(d.name)
                    mp = d / MANIFEST
                    if m and mp.is_file():
                        out.append({"step": int(m.group(1)), "tier": t.name, "path": str(d), "rank": ti + 1})
                    elif m and (mp.exists() or mp.is_symlink()):
                        _warn_once(f"tierstore: {mp} on tier {t.name!r} is not a regular file; step {int(m.group(1))} "
                                   "is skipped")  # fmt: skip
        out.sort(key=lambda c: (-c["step"], c["rank"]))
        for c in out:
            c.pop("rank")
        return out

    def load_latest(
        self,
        into: Any = None,
        *,
        weights_only: bool = True,
        per_rank_policy: Any = None,
    ) -> Any:
        """The newest complete checkpoint, from the nearest tier that has it.

        Without ``into``: returns the saved state (nested as saved; tensors
        whole). With ``into`` (a state dict of tensors in any layout, as for
        :func:`~tierstore.load_sharded`): fills it in place and returns it.
        A copy that fails to load (damaged, missing files) is reported with a
        warning and the next copy (farther tier, then older step) is tried.
        Returns None when no checkpoint exists (or, without ``into``, when no
        copy is usable); with ``into``, when copies exist and none is usable,
        raises ``TierstoreError`` (a failed copy may have written part of
        ``into``). :attr:`restored` tells which copy was used.
        """
        self._raise_errors()
        cands = self.checkpoints()
        if self.world > 1:
            # Every rank must take the same copy: agree on the candidates of rank 0.
            disk = [{k: v for k, v in c.items() if k != "_snap"} for c in cands if c["path"] is not None]
            cands = all_gather(disk, self.world, self._pg_ctl)[0]
        failures: list[str] = []
        for c in cands:
            err: BaseException | None = None
            result: Any = None
            try:
                result = self._load_one(c, into, weights_only, per_rank_policy)
            except Exception as e:  # any damage to this copy: the next one is tried
                err = e
            ok = [err is None]
            if self.world > 1:
                ok = all_gather(err is None, self.world, self._pg_ctl)
            if all(ok):
                self.restored = {"step": c["step"], "tier": c["tier"], "path": c["path"]}
                return result
            where = c["path"] or "host memory"
            why = err if err is not None else "another rank could not read it"
            warnings.warn(
                f"tierstore: checkpoint of step {c['step']} on tier {c['tier']!r} ({where}) cannot be used: "
                f"{why}; trying the next copy",
                stacklevel=2,
            )
            failures.append(f"step {c['step']} on tier {c['tier']!r}: {why}")
        self.restored = None
        if into is not None and failures:
            # A copy that failed may have written part of its bytes into
            # `into` before its damage was found: never let that pass for "no
            # checkpoint" (the caller would train on from those tensors).
            raise TierstoreError(
                f"no usable checkpoint among {len(failures)} copies; the tensors of `into` may have been partly "
                "overwritten by a copy that then failed its checks: " + "; ".join(failures)
            )
        return None

    def close(self, wait: bool = True) -> None:
        """Waits for everything in flight (unless ``wait=False``), stops the
        threads and removes the optimizer hooks."""
        if self._closed:
            return
        try:
            if wait:
                self.wait()
        finally:
            self._closed = True
            for q in (self._capture_q, self._flush_q, self._promote_q):
                q.put(None)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            for th in self._threads:
                th.join(timeout=None if wait else 5)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=exc[0] is None)

    # ------------------------------------------------------------------------------------------
    # capture

    def _owned_storages(self) -> set[int]:
        """Storages the attached optimizers change (cached until their state grows)."""
        key = tuple((id(o), len(o.state), sum(len(g["params"]) for g in o.param_groups)) for o in self._optimizers)
        if self._owned_cache is not None and self._owned_cache[0] == key:
            return self._owned_cache[1]
        ptrs: set[int] = set()
        for opt in self._optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    ptrs.add(_storage_ptr(p))
            for st in opt.state.values():
                for v in st.values() if isinstance(st, Mapping) else []:
                    if isinstance(v, torch.Tensor):
                        ptrs.add(_storage_ptr(v))
        self._owned_cache = (key, ptrs)
        return ptrs

    def _copy_tree(
        self,
        obj: Any,
        snap: _Snapshot,
        plan: list[tuple[torch.Tensor, Any]],
        memo: dict[int, Any],
        reserve: Callable[[torch.Tensor], int],
        owned: set[int] | None,
        key: str,
    ) -> Any:
        """The state with each tensor replaced by a placeholder that becomes
        its host copy; other leaves deep-copied now."""
        if isinstance(obj, torch.Tensor):
            if id(obj) in memo:
                return memo[id(obj)]
            keep_layout = layout_of(obj)
            local = obj
            if keep_layout is None and is_dtensor(obj):
                local, keep_layout = tensor_and_layout(key, obj, self.world)
            # Plain tensors get their layout (whole, replicated over the ranks) when written.
            # The capture runs under no_grad, so the source needs no detach().
            src = local
            dst = torch.empty(0, dtype=src.dtype)
            mutable = owned is None or src.untyped_storage().data_ptr() in owned
            snap.items.append(_Item(src, dst, src._version, mutable, keep_layout))
            plan.append((src, reserve(src)))
            memo[id(obj)] = dst
            return dst
        if isinstance(obj, PerRank):
            return PerRank(self._copy_tree(obj.value, snap, plan, memo, reserve, owned, key))
        if isinstance(obj, Mapping):
            out = copy.copy(obj)
            nested = _tree.walks(obj)
            for k, v in obj.items():
                child = _tree.child(key, k) if nested else key
                out[k] = self._copy_tree(v, snap, plan, memo, reserve, owned, child)  # type: ignore[index]
            return out
        if isinstance(obj, list):
            nested = _tree.walks(obj)
            return [
                self._copy_tree(v, snap, plan, memo, reserve, owned, _tree.child(key, i) if nested else key)
                for i, v in enumerate(obj)
            ]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copy_tree(v, snap, plan, memo, reserve, owned, key) for v in obj)
        return copy.deepcopy(obj, memo)

    def _capture(self, snap: _Snapshot) -> None:
        with torch.no_grad():
            self._capture_inner(snap)

    def _capture_inner(self, snap: _Snapshot) -> None:
        if snap.event is None:
            self._capture_host(snap)
            return
        try:
            if snap.event is not None:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                self._stream.wait_event(snap.event)
            done_mutable = False
            gate = snap.gate
            on_device = snap.event is not None  # copies finish at stream syncs, not in order
            for i, it in enumerate(snap.items):
                if not it.mutable and not done_mutable:
                    self._sync(snap)
                    snap.mutable_done.set()
                    done_mutable = True
                    if gate is not None:
                        gate.advance(i)
                if it.src.is_cuda:
                    with torch.cuda.stream(self._stream):
                        it.dst.copy_(it.src, non_blocking=True)
                else:
                    it.dst.copy_(it.src)
                if gate is not None and not on_device:
                    gate.advance(i + 1)  # the flush may write this tensor now
            self._sync(snap)
            if gate is not None:
                gate.advance(len(snap.items))
        except BaseException as e:
            self._fail_snapshot(snap, e)
            self._capture_errors.append(e)
        finally:
            snap.handle.timings["capture"] = time.perf_counter() - snap.t_save
            snap.mutable_done.set()
            snap.captured.set()
            with self._lock:
                if snap in self._pending:
                    self._pending.remove(snap)
            if not self.debug:
                snap.release_sources()
                snap.verified.set()
        if snap.error is None:
            snap.handle._set(self.host.name, "captured")
            if snap.gate is None:
                self._flush_q.put(snap)

    def _capture_host(self, snap: _Snapshot) -> None:
        """Capture of host tensors: this (low-priority) thread copies items in
        order while training runs; the step pre-hook copies whatever mutable
        items are still untaken when the step arrives (see :meth:`_steal`)."""
        try:
            if snap.n_mutable == 0:
                snap.mutable_done.set()
            while True:
                with snap.cap_lock:
                    i = snap.cap_next
                    while i < len(snap.items) and snap.taken[i]:
                        i += 1
                    snap.cap_next = i + 1
                    if i >= len(snap.items):
                        break
                    snap.taken[i] = True
                it = snap.items[i]
                _copy_host(it.dst, it.src)
                self._copied(snap, (i,))
            # Items the training thread took are copied before their sources are released.
            while not snap.mutable_done.wait(0.1):
                if snap.error is not None:
                    break
        except BaseException as e:
            self._fail_snapshot(snap, e)
            self._capture_errors.append(e)
        finally:
            if snap.gate is not None and snap.error is None:
                snap.gate.advance(len(snap.items))
            snap.handle.timings["capture"] = time.perf_counter() - snap.t_save
            snap.mutable_done.set()
            snap.captured.set()
            with self._lock:
                if snap in self._pending:
                    self._pending.remove(snap)
            if not self.debug:
                snap.release_sources()
                snap.verified.set()
        if snap.error is None:
            snap.handle._set(self.host.name, "captured")
            if snap.gate is None:
                self._flush_q.put(snap)

    @staticmethod
    def _copied(snap: _Snapshot, idxs: tuple[int, ...] | list[int]) -> None:
        with snap.cap_lock:
            for i in idxs:
                snap.done[i] = True
            n = len(snap.items)
            while snap.done_prefix < n and snap.done[snap.done_prefix]:
                snap.done_prefix += 1
            if snap.gate is not None:
                snap.gate.advance(snap.done_prefix)  # the flush may write these tensors now
            if snap.done_prefix >= snap.n_mutable:
                snap.mutable_done.set()

    def _steal(self, snap: _Snapshot) -> None:
        """On the training thread, at the optimizer step: copies the mutable
        items the capture thread has not started (it runs at low priority and
        may not have had a core), instead of waiting for it."""
        with snap.cap_lock:
            mine = [k for k in range(snap.cap_next, snap.n_mutable) if not snap.taken[k]]
            for k in mine:
                snap.taken[k] = True
        if not mine:
            return
        try:
            with torch.no_grad():
                for k in mine:
                    it = snap.items[k]
                    it.dst.copy_(it.src)
        except BaseException as e:
            self._fail_snapshot(snap, e)
            self._capture_errors.append(e)
        finally:
            snap.stolen += len(mine)
            self._copied(snap, mine)

    def _fail_snapshot(self, snap: _Snapshot, e: BaseException) -> None:
        self._drop_offload_pins(snap)
        if snap.gate is not None:
            snap.gate.fail()  # a flush already writing this snapshot stops
        snap.error = e
        snap.handle.error = e
        for n, st in snap.handle.tiers.items():
            if st in ("pending", "captured"):
                snap.handle._set(n, "failed")
        snap.evictable = True
        snap.in_host = False
        self.pool.release(snap)
        snap.verified.set()
        with self._lock:
            if snap in self._snaps:
                self._snaps.remove(snap)

    def _verify(self) -> None:
        """Debug check, on the training thread at each synchronisation point:
        a saved tensor whose version counter moved since ``save`` was changed
        before the capture was waited for, so the snapshot may be torn; it is
        discarded (never written) and the error raised here."""
        if not self.debug:
            return
        with self._lock:
            snaps = [s for s in self._snaps if s.captured.is_set() and not s.verified.is_set()]
        torn: TornSnapshotError | None = None
        for snap in snaps:
            bad = next((it for it in snap.items if it.src._version != it.version), None)
            if bad is not None:
                err = TornSnapshotError(self._torn_msg(snap, bad))
                self._fail_snapshot(snap, err)
                snap.handle.reported = True  # raised here; wait() does not raise it again
                torn = torn or err
            snap.release_sources()
            snap.verified.set()
        if torn is not None:
            raise torn

    def _sync(self, snap: _Snapshot) -> None:
        if snap.event is not None and self._stream is not None:
            self._stream.synchronize()

    @staticmethod
    def _torn_msg(snap: _Snapshot, it: _Item) -> str:
        return (
            f"checkpoint of step {snap.step}: a tensor of shape {tuple(it.src.shape)} ({it.src.dtype}) was modified "
            f"before its capture finished (version {it.version} -> {it.src._version}); call wait_capture() or "
            f"Checkpointer.attach(optimizer) before changing saved tensors. The snapshot was discarded."
        )

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        if self._last_hook is not None:
            self._step_times.append(now - self._last_hook)
            del self._step_times[:-50]
        with self._lock:
            pending = list(self._pending)
        for s in pending:
            if s.event is None:
                self._steal(s)
            # The debug check compares version counters once the capture is
            # complete, so there the step waits for all of it.
            (s.captured if self.debug else s.mutable_done).wait()
        waited = time.perf_counter() - now
        if pending:
            pending[-1].handle.timings["blocked"] += waited
        self._last_hook = time.perf_counter()
        self._verify()
        self._raise_errors()

    def _raise_errors(self) -> None:
        """A capture that failed (other than the debug check) is raised on the
        training thread at its next synchronisation point."""
        if self._capture_errors:
            e = self._capture_errors.pop(0)
            raise TierstoreError(f"a checkpoint capture failed: {e}") from e

    # ------------------------------------------------------------------------------------------
    # flush and promotion

    def _run(self, q: queue.Queue[_Snapshot | None], fn: Callable[[_Snapshot], None], name: str) -> None:
        _threads.set_name(name)
        why = _threads.lower_priority(self.priority)
        if why is not None:
            self.priority_error = why
        while True:
            snap = q.get()
            if snap is None:
                return
            try:
                fn(snap)
            except BaseException as e:  # reported through the handle and wait()
                if isinstance(e, Exception) and not isinstance(e, TierstoreError):
                    # e.g. a collective's error when another rank died: named for the user
                    wrapped = TierstoreError(
                        f"{self.path}: checkpoint of step {snap.step} failed in {name} on rank {self.rank} of "
                        f"{self.world}" + (" (a rank died or timed out?)" if self.world > 1 else "") + f": {e}"
                    )
                    wrapped.__cause__ = e
                    e = wrapped
                self._drop_offload_pins(snap)
                snap.handle.error = e
                self._errors.append(e)
                for name, st in snap.handle.tiers.items():
                    if st == "pending":
                        snap.handle._set(name, "failed")
                snap.evictable = True
                self.pool.release(snap)

    def _tier_paths(self, t: DiskTier) -> list[Path]:
        return [self.path / p for p in t.paths]  # type: ignore[union-attr]

    def _dir_for(self, t: DiskTier, snap: _Snapshot) -> Path:
        ps = self._tier_paths(t)
        return ps[snap.ordinal % len(ps)] / f"step-{snap.step:012d}"

    def _selected(self, t: DiskTier, snap: _Snapshot) -> bool:
        return snap.ordinal % t.every == 0

    def _write_meta(self, d: Path, snap: _Snapshot) -> None:
        if self.rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            meta = {"step": snap.step, "world_size": self.world, "tree": snap.tree, "created_unix": time.time()}
            write_json_atomic(d / META, meta)

    def _flush(self, snap: _Snapshot) -> None:
        h = snap.handle
        # Debug mode: the training thread checks the snapshot at its next
        # synchronisation point (step hook, wait_capture, save, wait).
        while not snap.verified.wait(0.1):
            if self._closed:
                return
        if snap.error is not None:
            return
        local = self.disks[0]
        t0 = time.perf_counter()
        written: Path | None = None
        if self._selected(local, snap):
            d = self._dir_for(local, snap)
            with self._lock:
                self._busy_dirs.add(d)
            try:
                self._write_meta(d, snap)
                self._copy_offload_pins(snap, d)
                write_sharded(
                    snap.state,
                    d,
                    process_group=self._pg_flush,
                    background=True,
                    gates=snap.gates,
                    attachments=(META,),
                )
                snap.captured.wait()
                if snap.error is not None:
                    raise TierstoreError(f"the capture failed: {snap.error}")
                written = d
                h.paths[local.name] = str(d)
                h.timings["flush"] = time.perf_counter() - t0
                h.timings["to_local"] = time.perf_counter() - snap.t_save
                h._set(local.name, "durable")
            except (OSError, TierstoreError) as e:
                with self._lock:
                    self._busy_dirs.discard(d)
                with contextlib.suppress(OSError):
                    shutil.rmtree(d)
                snap.captured.wait()
                if snap.error is not None:  # the capture failed: the handle says so already
                    return
                h._set(local.name, "failed")
                farther = [t.name for t in self.disks[1:]]
                warnings.warn(
                    f"tierstore: checkpoint of step {snap.step} could not be written to the {local.name!r} tier "
                    f"({e}); " + (f"writing it to {farther[0]!r} instead" if farther else "it is lost"),
                    stacklevel=1,
                )
                if not farther:
                    h.error = e
        else:
            h._set(local.name, "skipped")
        if written is not None:
            snap.local_dir = written
            snap.evictable = True  # durable: the host copy may be dropped when room is needed
            self._trim_host()
            self._gc(local)
        self._promote_q.put(snap)

    def _trim_host(self) -> None:
        """Keeps ``HostTier.keep_last`` durable snapshots in memory; the
        buffers of older ones become free for the next captures."""
        with self._lock:
            retained = [s for s in self._snaps if s.evictable and s.in_host and s.error is None]
        retained.sort(key=lambda s: s.ordinal)
        for s in retained[: max(0, len(retained) - self.host.keep_last)]:
            with self.pool.cond:
                self.pool._evict_snapshot(s)
        self.pool.notify()

    def _promote(self, snap: _Snapshot) -> None:
        h = snap.handle
        try:
            for t in self.disks[1:]:
                if not self._selected(t, snap) and snap.local_dir is not None:
                    h._set(t.name, "skipped")
                    continue
                t0 = time.perf_counter()
                d = self._dir_for(t, snap)
                with self._lock:
                    self._busy_dirs.add(d)
                try:
                    if snap.local_dir is not None:
                        self._copy_dir(snap.local_dir, d)
                    else:  # the local tier failed: write from host memory
                        snap.captured.wait()
                        if snap.error is not None:
                            return
                        self._write_meta(d, snap)
                        self._copy_offload_pins(snap, d)
                        write_sharded(
                            snap.state, d, process_group=self._pg_promote, background=True, attachments=(META,)
                        )
                        snap.local_dir = d
                    h.paths[t.name] = str(d)
                    h.timings["to_remote"] = time.perf_counter() - snap.t_save
                    h.timings["promote"] = time.perf_counter() - t0
                    if t is self.disks[-1]:
                        self._drop_offload_pins(snap)  # before wait() can return
                    h._set(t.name, "durable")
                    self._gc(t)
                except (OSError, TierstoreError) as e:
                    h._set(t.name, "failed")
                    h.error = e
                    warnings.warn(
                        f"tierstore: checkpoint of step {snap.step} could not be copied to the {t.name!r} tier: {e}",
                        stacklevel=1,
                    )
                finally:
                    with self._lock:
                        self._busy_dirs.discard(d)
        finally:
            self._drop_offload_pins(snap)
            if self.disks[0].name in h.paths:
                with self._lock:
                    self._busy_dirs.discard(Path(h.paths[self.disks[0].name]))
            snap.evictable = True
            if h.state in ("failed", "skipped", "captured"):
                self.pool.release(snap)  # nothing durable: the host copy is no restore point
                snap.in_host = False
            self.pool.notify()
            with self._lock:
                self._snaps = [s for s in self._snaps if s.in_host or not s.evictable]
                if len(self._handles) > 256:  # keep the recent and the unsettled ones
                    old, recent = self._handles[:-128], self._handles[-128:]
                    self._handles = [x for x in old if not x.settled()] + recent

    def _copy_dir(self, src: Path, dst: Path) -> None:
        """Copies this rank's files of the committed checkpoint ``src`` to
        ``dst``; rank 0 commits ``dst`` with its manifest once every rank's
        files are durable there."""
        m = read_manifest(src)
        sid = m["save_id"]
        # The step directory's entry (and any tier directory made here) made
        # durable in their parents before the manifest commits the copy.
        make_dir(dst, durable=True)
        engine = get_engine()
        mine = [
            f
            for f in sorted(os.listdir(src))
            if (f".{sid}." in f and f.startswith((f"rank-{self.rank:05d}.", f"objects-{self.rank:05d}.")))
            or f.startswith(f"offload-{self.rank:05d}.")
        ]
        if self.rank == 0 and (src / META).exists():
            mine.append(META)
        err: BaseException | None = None
        try:
            for f in mine:
                _core.copy_file(engine, src / f, dst / f, background=True)
        except (OSError, TierstoreError) as e:
            err = e
        oks = all_gather(err is None, self.world, self._pg_promote)
        if err is not None:
            raise err
        if not all(oks):
            raise TierstoreError(f"{dst}: another rank failed to copy its files; not committed")
        if self.rank == 0:
            _core.copy_file(engine, src / MANIFEST, dst / MANIFEST, background=True)
        if self.world > 1:
            all_gather(True, self.world, self._pg_promote)

    def _gc(self, t: DiskTier) -> None:
        """Retention on tier ``t`` (rank 0 only): keeps the newest ``keep_last``
        complete checkpoints, multiples of ``keep_every`` and anything in use;
        removes older incomplete directories left by crashes."""
        if self.rank != 0:
            return
        complete: list[tuple[int, Path]] = []
        incomplete: list[tuple[int, Path]] = []
        for p in self._tier_paths(t):
            for d in _step_dirs(p, t.name):
                m = STEP_DIR.match(d.name)
                if m:
                    (complete if (d / MANIFEST).exists() else incomplete).append((int(m.group(1)), d))
        if not complete:
            return
        complete.sort(reverse=True)
        newest = complete[0][0]
        keep = {d for _s, d in complete[: t.keep_last]} if t.keep_last is not None else {d for _s, d in complete}
        keep.add(complete[0][1])
        if t.keep_every:
            keep |= {d for s, d in complete if s % t.keep_every == 0}
        with self._lock:
            busy = set(self._busy_dirs)
        for _s, d in complete:
            if d not in keep and d not in busy:
                shutil.rmtree(d, ignore_errors=True)
        for s, d in incomplete:
            if s < newest and d not in busy:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------------------
    # restore

    def _load_one(self, c: dict[str, Any], into: Any, weights_only: bool, per_rank_policy: Any) -> Any:
        snap: _Snapshot | None = c.get("_snap")
        if c["path"] is None:
            if snap is None or not snap.in_host:
                raise TierstoreError("the host copy was dropped")
            if into is not None:
                raise TierstoreError("host copies restore only without `into`")
            return _clone_tree(snap.state)
        d = Path(c["path"])
        tree = _read_meta(d, c["step"])
        if into is not None:
            return self._load_into(d, into, weights_only, per_rank_policy)
        flat = consolidate(d, weights_only=weights_only, per_rank_policy=per_rank_policy)
        if tree is None:
            return _offload_state_dicts(flat, d)
        return _offload_state_dicts(_unflatten(flat, tree), d)

    def _load_into(self, d: Path, into: Any, weights_only: bool, per_rank_policy: Any) -> Any:
        """``load_sharded`` into ``into``, where offloaded optimizers get their
        saved subgroups back as they are (no per-parameter work)."""
        found: list[tuple[MutableMapping[str, Any], str, Any]] = []

        def walk(obj: Any) -> Any:
            if isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor):
                out = dict(obj)
                for k, v in obj.items():
                    if _checkpoints_itself(v):
                        out[k] = {OFFLOAD_KEY: None}
                        found.append((out, k, v))
                    else:
                        out[k] = walk(v)
                return out
            return obj

        template = walk(into) if isinstance(into, Mapping) else into
        if not found:
            return load_sharded(d, into, process_group=None, per_rank_policy=per_rank_policy, weights_only=weights_only)
        # The offload entries' metadata first (small), then every tensor in one load.
        probe = _only_offload_meta(template)
        load_sharded(d, probe, process_group=None, per_rank_policy=per_rank_policy, weights_only=weights_only)
        metas = [offload_meta(m[OFFLOAD_KEY], str(d)) for m in _offload_entries(probe)]
        for (parent, k, _opt), meta in zip(found, metas, strict=True):
            entry: dict[str, Any] = {OFFLOAD_KEY: None}
            for e in meta["subgroups"]:
                if "tensor" in e:
                    entry[e["tensor"]] = torch.empty(e["nbytes"], dtype=torch.uint8)
            parent[k] = entry
        load_sharded(d, template, process_group=None, per_rank_policy=per_rank_policy, weights_only=weights_only)
        for (parent, k, opt), meta in zip(found, metas, strict=True):
            tensors = {n: t for n, t in parent[k].items() if isinstance(t, torch.Tensor)}
            opt.restore_from_checkpoint(meta, tensors, d)
        _copy_back(into, template)
        return into


def _step_dirs(p: Path, tier: str) -> list[Path]:
    """The step directories of tier path ``p``: real directories inside it.
    A symlink (to another job's run, or to another step) is never taken for
    a checkpoint of this tier; it is reported once and skipped."""
    out: list[Path] = []
    try:
        entries = list(p.iterdir()) if p.is_dir() else []
    except OSError:
        return out
    for d in entries:
        if not STEP_DIR.match(d.name):
            continue
        try:
            st = d.lstat()
        except FileNotFoundError:
            continue  # removed since the listing (retention on another thread): not a stray entry
        if not stat.S_ISDIR(st.st_mode) or not _paths.inside(p, d):
            _warn_once(f"tierstore: {d} on tier {tier!r} is not a step directory of this tier (a symlink or not a "
                       "directory); it is skipped")  # fmt: skip
            continue
        out.append(d)
    return out


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def _read_meta(d: Path, step: int) -> list[list[Any]] | None:
    """The key tree of step directory ``d``'s ``checkpoint.json``, checked:
    against the size and CRC-32 its manifest recorded (checkpoints written
    since the manifest records it: then a missing file is damage), its own
    checksum, its step, and the shape of every tree entry."""
    m = read_manifest(d)
    where = str(d / META)
    data = read_attachment(d, m, META)
    if data is None:
        if m.get("format_version", 1) >= 2 and "attachments" in m:
            return None  # written by save_sharded directly: no key tree
        if not (d / META).exists():
            return None  # an older checkpoint without one
        data = _paths.read_regular(_paths.member(d, META, source=str(d), field=META), 1 << 30, META)
    meta, _had = _metadata.loads(data, where, required=False)
    f = _metadata.Fields(where)
    if f.uint(f.get(meta, "step", "step"), "step") != step:
        f.fail("step", f"{step} (the step of its directory)", meta["step"])
    f.uint(f.get(meta, "world_size", "world_size"), "world_size", most=1 << 24)
    tree = f.array(f.get(meta, "tree", "tree"), "tree")
    for i, entry in enumerate(tree):
        fld = f"tree[{i}]"
        f.array(entry, fld, length=2)
        key = f.string(entry[0], f"{fld}[0]", most=1 << 16)
        if _tree.check_path(f.array(entry[1], f"{fld}[1]"), key) is None:
            f.fail(f"{fld}[1]", f"the key path of {key!r} (its parts joined by '.' give the key)", entry[1])
    return tree


def _only_offload_meta(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a load template that holds offload metadata entries."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and OFFLOAD_KEY in v:
            out[k] = {OFFLOAD_KEY: None}
        elif isinstance(v, Mapping):
            sub = _only_offload_meta(v)
            if sub:
                out[k] = sub
    return out


def _offload_entries(tree: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for v in tree.values():
        if isinstance(v, Mapping) and OFFLOAD_KEY in v:
            yield v
        elif isinstance(v, Mapping):
            yield from _offload_entries(v)


def _copy_back(into: Any, template: Any) -> None:
    """Puts what ``load_sharded`` filled into a template back into ``into``
    (offloaded optimizers stay in place: they restored themselves)."""
    if not isinstance(into, MutableMapping):
        return
    for k, v in into.items():
        t = template.get(k)
        if _checkpoints_itself(v):
            continue
        if isinstance(v, Mapping) and not isinstance(v, torch.Tensor):
            _copy_back(v, t)
        elif not isinstance(v, torch.Tensor):
            into[k] = t  # non-tensor values are replaced by the saved ones


def _offload_state_dicts(obj: Any, d: Path) -> Any:
    """Turns offloaded optimizers' checkpoint entries into the wrapped
    optimizer's ordinary state dict."""
    if is_offload_parts(obj):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        return restore_state_dict(offload_meta(obj[OFFLOAD_KEY], str(d)), tensors, d)
    if isinstance(obj, dict):
        return {k: _offload_state_dicts(v, d) for k, v in obj.items()}
    return obj


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, PerRank):
        return _clone_tree(obj.value)
    if isinstance(obj, Mapping):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _clone_tree(v)  # type: ignore[index]
        return out
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_clone_tree(v) for v in obj)
    return copy.deepcopy(obj)
