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
import gc
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tierstore import _core, _threads, _tree
from tierstore._ckpt_cascade import Cascade, drop_offload_pins
from tierstore._ckpt_pool import BIG, PAGE, SMALL_ALIGN, HostPool, copy_host
from tierstore._ckpt_restore import (
    STEP_DIR,
    WARNED,
    checkpoints_itself,
    flat_tree,
    load_copy,
    step_dirs,
    warn_once,
)
from tierstore._ckpt_snapshot import Capture, CheckpointHandle, Item, Residency, Snapshot
from tierstore._dist import all_gather, group_info
from tierstore._engine import get_engine
from tierstore._offload_entry import OFFLOAD_KEY
from tierstore.errors import InvalidArgumentError, TierstoreError, TornSnapshotError
from tierstore.layout import attach as attach_layout
from tierstore.layout import layout_of
from tierstore.sharded import (
    PerRank,
    is_dtensor,
    tensor_and_layout,
)
from tierstore.shardmeta import MANIFEST

# The tiers live in tierstore.tiers; re-exported here, where users import them from.
from tierstore.tiers import DiskTier, HostTier, RemoteTier, parse_size

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


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local shard's)."""
    if is_dtensor(t):
        t = t.to_local()
    return int(t.untyped_storage().data_ptr())


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
        self.pool = HostPool(int(self.host.budget), pinned)
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
        self._ordinal = 0
        self._last_step: int | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._pending: list[Snapshot] = []  # not yet captured
        self._snaps: list[Snapshot] = []  # every snapshot still holding host memory or in flight
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
        self._capture_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._flush_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._promote_q: queue.Queue[Snapshot | None] = queue.Queue()
        self._closed = False
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
        snap = Snapshot(step, self._ordinal, handle)
        state, offload_buffers = self._expand_offloaded(state, snap)
        owned = self._owned_storages() if (self._optimizers and self.eager_unowned) else None
        if owned is not None and offload_buffers:
            owned = owned | offload_buffers  # changed by the next step: captured lazily, before it
        plan: list[tuple[torch.Tensor, Any]] = []
        memo: dict[int, Any] = {}
        nbytes = [0]

        def reserve(t: torch.Tensor) -> int:
            n = t.numel() * t.element_size()
            a = PAGE if n >= BIG else SMALL_ALIGN
            off = -(-nbytes[0] // a) * a
            nbytes[0] = off + n
            return off

        state_copy = self._copy_tree(state, snap, plan, memo, reserve, owned, "")
        snap.tree = list(flat_tree(state_copy)) if isinstance(state_copy, Mapping) else []
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
            drop_offload_pins(snap)
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
        lazy: list[Item] = []
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

    def _expand_offloaded(self, state: Mapping[str, Any], snap: Snapshot) -> tuple[Mapping[str, Any], set[int]]:
        """Replaces each offloaded optimizer in ``state`` by its checkpoint
        parts (resident subgroups as tensors, the others as pinned files that
        the flush copies), attaching it so that its next step waits for the
        capture. Returns the new state and the storages of those tensors."""
        buffers: set[int] = set()
        count = [0]

        def walk(obj: Any) -> Any:
            if checkpoints_itself(obj):
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
                if not any(checkpoints_itself(v) or isinstance(v, Mapping) for v in obj.values()):
                    return obj
                out = dict(obj)
                for k, v in obj.items():
                    out[k] = walk(v)
                return out
            return obj

        return walk(state), buffers

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
            for p in self.cascade.tier_paths(t):
                for d in step_dirs(p, t.name):
                    m = STEP_DIR.match(d.name)
                    mp = d / MANIFEST
                    if m and mp.is_file():
                        out.append({"step": int(m.group(1)), "tier": t.name, "path": str(d), "rank": ti + 1})
                    elif m and (mp.exists() or mp.is_symlink()):
                        warn_once(f"tierstore: {mp} on tier {t.name!r} is not a regular file; step {int(m.group(1))} "
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
                result = load_copy(c, into, weights_only, per_rank_policy)
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
        snap: Snapshot,
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
            snap.items.append(Item(src, dst, src._version, mutable, keep_layout))
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

    def _capture(self, snap: Snapshot) -> None:
        with torch.no_grad():
            self._capture_inner(snap)

    def _capture_inner(self, snap: Snapshot) -> None:
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
                    snap.advance(Capture.MUTABLE_DONE)
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
            self._finish_capture(snap)

    def _capture_host(self, snap: Snapshot) -> None:
        """Capture of host tensors: this (low-priority) thread copies items in
        order while training runs; the step pre-hook copies whatever mutable
        items are still untaken when the step arrives (see :meth:`_steal`)."""
        try:
            if snap.n_mutable == 0:
                snap.advance(Capture.MUTABLE_DONE)
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
                copy_host(it.dst, it.src)
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
            self._finish_capture(snap)

    def _finish_capture(self, snap: Snapshot) -> None:
        """The end of a capture, whatever its outcome: waiters are released,
        a failed snapshot's buffers go back to the pool (nothing writes into
        them any more), and a good one goes on to the flush."""
        snap.handle.timings["capture"] = time.perf_counter() - snap.t_save
        snap.advance(Capture.CAPTURED)
        if snap.error is not None:
            self._release_failed(snap)
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
    def _copied(snap: Snapshot, idxs: tuple[int, ...] | list[int]) -> None:
        with snap.cap_lock:
            for i in idxs:
                snap.done[i] = True
            n = len(snap.items)
            while snap.done_prefix < n and snap.done[snap.done_prefix]:
                snap.done_prefix += 1
            if snap.gate is not None:
                snap.gate.advance(snap.done_prefix)  # the flush may write these tensors now
            if snap.done_prefix >= snap.n_mutable:
                snap.advance(Capture.MUTABLE_DONE)

    def _steal(self, snap: Snapshot) -> None:
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

    def _fail_snapshot(self, snap: Snapshot, e: BaseException) -> None:
        drop_offload_pins(snap)
        if snap.gate is not None:
            snap.gate.fail()  # a flush already writing this snapshot stops
        snap.fail(e)
        snap.handle.error = e
        for n, st in snap.handle.tiers.items():
            if st in ("pending", "captured"):
                snap.handle._set(n, "failed")
        if snap.copying_done:
            self._release_failed(snap)
        # else the capture thread gives the buffers back when it stops copying
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

    def _sync(self, snap: Snapshot) -> None:
        if snap.event is not None and self._stream is not None:
            self._stream.synchronize()

    @staticmethod
    def _torn_msg(snap: Snapshot, it: Item) -> str:
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
            except BaseException as e:  # reported through the handle and wait()
                if isinstance(e, Exception) and not isinstance(e, TierstoreError):
                    # e.g. a collective's error when another rank died: named for the user
                    wrapped = TierstoreError(
                        f"{self.path}: checkpoint of step {snap.step} failed in {name} on rank {self.rank} of "
                        f"{self.world}" + (" (a rank died or timed out?)" if self.world > 1 else "") + f": {e}"
                    )
                    wrapped.__cause__ = e
                    e = wrapped
                drop_offload_pins(snap)
                snap.handle.error = e
                self._errors.append(e)
                for name, st in snap.handle.tiers.items():
                    if st == "pending":
                        snap.handle._set(name, "failed")
                self._wait_copied(snap)
                snap.release_host(Residency.EVICTABLE)
                self.pool.release(snap)

    def _release_failed(self, snap: Snapshot) -> None:
        """A failed snapshot's host copy is no restore point: its buffers go
        back to the pool (once its capture no longer writes into them)."""
        snap.release_host(Residency.EVICTED)
        self.pool.release(snap)

    def _wait_copied(self, snap: Snapshot) -> None:
        """Until the capture no longer writes into the snapshot's buffers
        (it always ends: its thread sets ``captured`` in a ``finally``)."""
        snap.captured.wait()
