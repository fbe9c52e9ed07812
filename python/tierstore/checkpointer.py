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
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tierstore import _gc, _threads
from tierstore._ckpt_capture import Capturer
from tierstore._ckpt_cascade import Cascade, drop_offload_pins
from tierstore._ckpt_interval import AdaptiveInterval
from tierstore._ckpt_peers import free_shm_copies, node_and_ring
from tierstore._ckpt_pool import HostPool, copy_host
from tierstore._ckpt_restore import (
    WARNED,
    Restorer,
    checkpoints_itself,
    list_checkpoints,
)
from tierstore._ckpt_snapshot import CheckpointHandle, Residency, Snapshot
from tierstore._dist import all_true, group_info, side_groups
from tierstore._engine import get_engine
from tierstore._offload_entry import OFFLOAD_KEY
from tierstore.errors import InvalidArgumentError, TierstoreError, TornSnapshotError
from tierstore.sharded import PerRank
from tierstore.shardmeta import manifests_cached

# The tiers live in tierstore.tiers; re-exported here, where users import them from.
from tierstore.tiers import DiskTier, HostTier, RemoteTier, checkpoint_tiers, parse_size

_copy_host = copy_host  # the name tests/test_checkpointer_capture.py knows
_WARNED = WARNED  # warnings given once per process (the fuzz campaign clears it between cases)

__all__ = [
    "CheckpointHandle",
    "Checkpointer",
    "DiskTier",
    "HostTier",
    "RemoteTier",
    "TornSnapshotError",
    "parse_size",
]


# ----------------------------------------------------------------------------------------------
# the checkpointer


def expand_offloaded(
    state: Mapping[str, Any],
    snap: Snapshot,
    rank: int,
    world: int,
    attached: Callable[[Any], bool],
    attach: Callable[[Any], None],
) -> tuple[Mapping[str, Any], set[int]]:
    """Replaces each offloaded optimizer in ``state`` by its checkpoint
    parts (resident subgroups as tensors, the others as pinned files that
    the flush copies), attaching it (``attach`` where not ``attached``) so
    that its next step waits for the capture. Returns the new state and the
    storages of those tensors."""
    buffers: set[int] = set()
    count = [0]

    def walk(obj: Any) -> Any:
        if checkpoints_itself(obj):
            if not attached(obj):
                attach(obj)
            prefix = f"r{rank:05d}-o{count[0]}-" if world > 1 else f"o{count[0]}-"
            tag = f"{os.getpid()}-{snap.ordinal}-{count[0]}"
            parts, pins = obj.checkpoint_parts(prefix, tag, f"offload-{rank:05d}.")
            count[0] += 1
            snap.has_offload = True
            snap.offload_pins.extend(pins)
            for v in parts.values():
                if isinstance(v, torch.Tensor):
                    buffers.add(v.untyped_storage().data_ptr())
            if world > 1:
                parts[OFFLOAD_KEY] = PerRank(parts[OFFLOAD_KEY])
            return parts
        if isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor):
            if not any(checkpoints_itself(v) or isinstance(v, Mapping) for v in obj.values()):
                return obj
            out = dict(obj)
            for k, v in obj.items():
                out[k] = walk(v)
            return out
        return obj

    return walk(state), buffers


def _skipped(handle: CheckpointHandle, budget: int, busy: list[int]) -> None:
    """Marks the checkpoint of ``handle`` skipped on every tier, with a
    warning naming the steps that hold the host ``budget``."""
    for name in list(handle.tiers):
        handle._set(name, "skipped")
    warnings.warn(
        f"tierstore: checkpoint of step {handle.step} skipped: the host budget ({budget / 2**20:.0f} MiB) is still "
        f"held by step(s) {busy} not yet durable (on_busy='skip')",
        stacklevel=3,
    )


def _named(e: BaseException, what: str, rank: int, world: int) -> BaseException:
    """``e`` if it is a TierstoreError or not an Exception, else a
    TierstoreError saying ``what`` failed on which rank (e.g. a collective's
    error when another rank died), caused by ``e``."""
    if not isinstance(e, Exception) or isinstance(e, TierstoreError):
        return e
    hint = " (a rank died or timed out?)" if world > 1 else ""
    wrapped = TierstoreError(f"{what} on rank {rank} of {world}{hint}: {e}")
    wrapped.__cause__ = e
    return wrapped


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
        self.host, self.disks, self.shm_tier = checkpoint_tiers(tiers, self.path)
        pinned = self.host.pinned if self.host.pinned is not None else torch.cuda.is_available()
        self.pool = HostPool(int(self.host.budget), pinned)
        self.tier_names = [self.host.name] + [t.name for t in self.disks]
        self.on_busy = on_busy
        self.schedule = AdaptiveInterval(interval, max_overhead)
        self.debug = debug
        self.eager_unowned = eager_unowned
        if rate_limit is not None:
            get_engine().set_background_rate(parse_size(rate_limit))
        self.rank, self.world, pg = group_info(process_group)
        # The checkpointer's own collectives, off the training thread.
        self._pg_ctl, self._pg_flush, self._pg_promote = side_groups(pg, 3, self.world, collective_timeout)
        self.node, self.ring = node_and_ring(self.disks, self.world, self._pg_ctl)
        self._ordinal = 0
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._snaps: list[Snapshot] = []  # every snapshot still holding host memory or in flight
        self._handles: list[CheckpointHandle] = []
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._busy_dirs: set[Path] = set()
        self.restored: dict[str, Any] | None = None
        self.priority = priority
        # The engine's own threads serve foreground loads too: start it here,
        # so that they take this thread's class, not the background threads'.
        get_engine()
        self.priority_error: str | None = None  # why the threads could not be lowered, if they could not
        self._capture_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._flush_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._promote_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._closed = False
        self.capturer = Capturer(
            pool=self.pool,
            lock=self._lock,
            snaps=self._snaps,
            optimizers=self._optimizers,
            flush_q=self._flush_q,
            host_name=self.host.name,
            world=self.world,
            debug=debug,
        )
        self.cascade = Cascade(
            path=self.path,
            host=self.host,
            disks=self.disks,
            pool=self.pool,
            rank=self.rank,
            world=self.world,
            pg_flush=self._pg_flush,
            pg_promote=self._pg_promote,
            lock=self._lock,
            snaps=self._snaps,
            handles=self._handles,
            busy_dirs=self._busy_dirs,
            promote_q=self._promote_q,
            closed=lambda: self._closed,
            node=self.node,
            ring=self.ring,
        )
        self.restorer = Restorer(
            cascade=self.cascade,
            disks=self.disks,
            has_shm_tier=self.shm_tier is not None,
            tier_names=self.tier_names,
            rank=self.rank,
            world=self.world,
            pg=self._pg_ctl,
            node_count=self.node.count,
            has_ring=self.ring is not None,
            checkpoints=self.checkpoints,
        )
        for t in self.disks:
            for p in self.cascade.tier_paths(t):
                p.mkdir(parents=True, exist_ok=True)
        run = self._run
        self._threads = [
            threading.Thread(target=run, args=(self._capture_q, self._capture, "ts-capture"), name="ts-capture"),
            threading.Thread(target=run, args=(self._flush_q, self.cascade.flush, "ts-flush"), name="ts-flush"),
            threading.Thread(target=run, args=(self._promote_q, self.cascade.promote, "ts-promote"), name="ts-promote"),
        ]
        for th in self._threads:
            th.daemon = True
            th.start()

    # ------------------------------------------------------------------------------------------
    # public API

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Makes ``optimizer.step()`` wait until the tensors it changes are
        captured (a step pre-hook); nothing else waits."""
        self._optimizers.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step`` under the (adaptive) interval."""
        return self.schedule.due(step)

    @property
    def interval(self) -> int:
        """The interval :meth:`due` applies now (grown with ``max_overhead``)."""
        return self.schedule.interval

    # A collection in the middle of a save would add its pause to the
    # training loop; the save allocates little, so it waits until after.
    @_gc.paused
    def save(self, step: int, state: Mapping[str, Any]) -> CheckpointHandle:
        """Starts a checkpoint of ``state`` at ``step`` and returns at once.

        Tensors are captured in the background: until :meth:`wait_capture`
        returns (or, with :meth:`attach`, until the optimizer step), the caller
        must not modify them. Non-tensor values are copied now.
        """
        return self._save(step, state)

    def _save(self, step: int, state: Mapping[str, Any]) -> CheckpointHandle:
        t0 = time.perf_counter()
        self.capturer.verify()
        self.capturer.raise_errors()
        if self._closed:
            raise TierstoreError("this Checkpointer is closed")
        if step < 0:
            raise InvalidArgumentError(f"step must be non-negative, got {step}")
        handle = CheckpointHandle(step, self.tier_names)
        snap = Snapshot(step, self._ordinal, handle)
        state, offload_buffers = expand_offloaded(
            state, snap, self.rank, self.world, lambda o: o in self._optimizers, self.attach
        )
        owned = self.capturer.owned_storages() if (self._optimizers and self.eager_unowned) else None
        if owned is not None and offload_buffers:
            owned = owned | offload_buffers  # changed by the next step: captured lazily, before it
        state_copy, plan, nbytes = self.capturer.plan(state, snap, owned)
        # Room in host memory, else the backpressure policy.
        block = self.on_busy == "wait"
        slab = self.pool.reserve(nbytes, snap, block=False)
        if self.world > 1 and self.on_busy == "skip":
            ok = all_true(slab is not None, self.world, self._pg_ctl)
            if not ok and slab is not None:
                self.pool.release(snap)
                slab = None
        elif slab is None and block:
            slab = self.pool.reserve(nbytes, snap, block=True)
        if slab is None:
            drop_offload_pins(snap)
            _skipped(handle, self.pool.budget, [s.step for s in self._snaps if not s.evictable])
            handle.timings["blocked"] = time.perf_counter() - t0
            self._handles.append(handle)
            return handle
        self.schedule.saved(step, self._handles)
        self._ordinal += 1
        self.capturer.place(snap, state_copy, slab, plan)
        with self._lock:
            self._snaps.append(snap)
            self.capturer.pending.append(snap)
            self._handles.append(handle)
        self._capture_q.put(snap)
        if snap.gate is not None:
            self._flush_q.put(snap)  # pipelined: writes follow the capture
        handle.timings["blocked"] = time.perf_counter() - t0
        return handle

    def wait_capture(self) -> None:
        """Blocks until every started checkpoint is captured (needed before
        modifying saved tensors when no optimizer is attached)."""
        t0 = time.perf_counter()
        with self._lock:
            pending = list(self.capturer.pending)
        for s in pending:
            s.captured.wait()
        if pending:
            pending[-1].handle.timings["blocked"] += time.perf_counter() - t0
        self.capturer.verify()
        self.capturer.raise_errors()

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
        self.capturer.raise_errors()
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

    def delete(self, step: int, tier: str | None = None) -> list[str]:
        """Deletes the checkpoint of ``step`` from every disk tier (or from
        ``tier``), on rank 0 (call it on every rank); returns the
        directories deleted. On a tier with deltas, a keyframe that kept
        deltas reference is refused (:class:`ReferencedCheckpointError`,
        naming them) before anything is deleted. Not a checkpoint in
        flight."""
        return self.cascade.delete_step(step, tier)

    def checkpoints(self) -> list[dict[str, Any]]:
        """Complete checkpoints per tier: ``[{"step", "tier", "path"}]``, newest first,
        nearest tier first."""
        with self._lock:
            snaps = list(self._snaps)
        return list_checkpoints(snaps, self.host.name, [(t.name, self.cascade.tier_paths(t)) for t in self.disks])

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
        with manifests_cached():  # each copy's manifest parsed once, however many times it is looked at
            return self._load_latest(into, weights_only, per_rank_policy)

    def _load_latest(self, into: Any, weights_only: bool, per_rank_policy: Any) -> Any:
        self.capturer.raise_errors()
        result, self.restored = self.restorer.load(into, weights_only, per_rank_policy)
        return result

    def close(self, wait: bool = True) -> None:
        """Waits for everything in flight (unless ``wait=False``), stops the
        threads and removes the optimizer hooks. After a clean wait, a
        Checkpointer that saved frees this node's shared-memory copies
        (``HostTier(shm=..., replicas=...)``) once a farther tier holds the
        newest checkpoint."""
        if self._closed:
            return
        clean = False
        try:
            if wait:
                self.wait()
                clean = True
        finally:
            self._closed = True
            for q in (self._capture_q, self._flush_q, self._promote_q):
                q.put(None)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            for th in self._threads:
                th.join(timeout=None if wait else 5)
        if clean:
            self._free_shm()

    def _free_shm(self) -> None:
        """Frees this node's shared-memory copies (its leader does) when a
        farther tier holds their newest step: the copies exist to survive a
        crash, and a clean close is not one. Only a Checkpointer that saved
        (the training job) frees them; one that only restored leaves them."""
        shm = self.shm_tier
        if shm is not None and self.node.leader and len(self.disks) >= 2 and self._ordinal > 0:
            free_shm_copies(shm.name, self.cascade.tier_paths(shm), self.checkpoints(), self.host.name)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=exc[0] is None)

    # ------------------------------------------------------------------------------------------
    # capture

    def _capture(self, snap: Snapshot) -> None:
        with torch.no_grad():
            if snap.event is None:
                self._capture_host(snap)
            else:
                self.capturer.capture_device(snap)

    def _capture_host(self, snap: Snapshot) -> None:
        self.capturer.capture_host(snap)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        self.schedule.step_began(now)
        # A torch optimizer changes GPU tensors with work on the current
        # stream: that stream can wait for the capture's copies on the device.
        # An offloaded optimizer copies its own way, so its step waits here.
        pending = self.capturer.wait_for_step(on_device=not hasattr(optimizer, "checkpoint_parts"))
        waited = time.perf_counter() - now
        if pending:
            pending[-1].handle.timings["blocked"] += waited
        self.schedule.step_resumed(time.perf_counter())
        self.capturer.verify()
        self.capturer.raise_errors()

    # ------------------------------------------------------------------------------------------
    # flush and promotion

    def _run(self, q: queue.Queue[Snapshot | None], fn: Callable[[Snapshot], None], name: str) -> None:
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
            except BaseException as exc:  # reported through the handle and wait()
                e = _named(exc, f"{self.path}: checkpoint of step {snap.step} failed in {name}", self.rank, self.world)
                drop_offload_pins(snap)
                snap.handle.error = e
                self._errors.append(e)
                for name, st in snap.handle.tiers.items():
                    if st == "pending":
                        snap.handle._set(name, "failed")
                self.capturer.wait_copied(snap)
                snap.release_host(Residency.EVICTABLE)
                self.pool.release(snap)
