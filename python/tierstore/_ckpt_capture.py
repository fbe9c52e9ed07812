"""The capture of a Checkpointer snapshot: the state's tensors copied into
host buffers while training goes on.

:meth:`Capturer.plan` replaces each tensor of the state by a placeholder and
reserves its place in one slab; :meth:`Capturer.place` points the
placeholders at the slab, copies at once what no attached optimizer changes,
and orders the rest with the tensors the step changes first. The capture
thread then copies those (:meth:`Capturer.capture_host`, or
:meth:`Capturer.capture_device` on a side stream for GPU tensors) while the
training thread, at the optimizer step, copies whatever mutable tensors the
capture thread has not reached (:meth:`Capturer.steal`) instead of waiting.
A flush follows the copy through the snapshot's gate: tensor *i* may be
written once the gate has passed *i*.

Invariants: a snapshot's buffers go back to the pool only once no copy
writes into them (:meth:`Snapshot.release_host` checks it); a failed
capture fails its gate, so a flush writing it stops; its error is raised on
the training thread at the next synchronisation point.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierstore import _core, _tree, gpu
from tierstore._ckpt_cascade import drop_offload_pins
from tierstore._ckpt_pool import BIG, PAGE, SMALL_ALIGN, HostPool, Slab, copy_host
from tierstore._ckpt_restore import flat_tree
from tierstore._ckpt_snapshot import Capture, Item, Residency, Snapshot
from tierstore.errors import TierstoreError, TornSnapshotError
from tierstore.layout import attach as attach_layout
from tierstore.layout import layout_of
from tierstore.sharded import PerRank, is_dtensor, tensor_and_layout


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local shard's)."""
    if is_dtensor(t):
        t = t.to_local()
    return int(t.untyped_storage().data_ptr())


def copy_from_device(c: gpu.Copier, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on the copy stream: one DMA from a dense device
    tensor straight into its pinned slab slice, else torch's strided copy."""
    n = src.numel() * src.element_size()
    if (
        src.is_contiguous()
        and dst.is_contiguous()
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and not src.is_conj()
        and not src.is_neg()
    ):
        c.d2h(dst.data_ptr(), src.data_ptr(), n)
        return
    with torch.cuda.stream(c.torch_stream):
        dst.copy_(src, non_blocking=True)


@dataclass(eq=False, kw_only=True)
class Capturer:
    """The capture side of a Checkpointer: its snapshots not yet captured
    (``pending``), the errors of captures to raise, the side stream."""

    pool: HostPool
    lock: threading.Lock
    snaps: list[Snapshot]
    optimizers: list[torch.optim.Optimizer]
    flush_q: queue.Queue[Snapshot | None]
    host_name: str
    world: int
    debug: bool
    pending: list[Snapshot] = field(default_factory=list, init=False)  # not yet captured
    errors: list[BaseException] = field(default_factory=list, init=False)
    owned_cache: tuple[Any, set[int]] | None = field(default=None, init=False)

    def plan(
        self, state: Mapping[str, Any], snap: Snapshot, owned: set[int] | None
    ) -> tuple[Any, list[tuple[torch.Tensor, int]], int]:
        """The state with placeholders for its tensors (recorded as the
        snapshot's items), each tensor's offset in the slab, the slab's size."""
        plan: list[tuple[torch.Tensor, int]] = []
        memo: dict[int, Any] = {}
        views: dict[tuple[Any, ...], torch.Tensor] = {}
        nbytes = [0]

        def reserve(t: torch.Tensor) -> int:
            n = t.numel() * t.element_size()
            a = PAGE if n >= BIG else SMALL_ALIGN
            off = -(-nbytes[0] // a) * a
            nbytes[0] = off + n
            return off

        state_copy = self.copy_tree(state, snap, plan, memo, views, reserve, owned, "")
        snap.tree = list(flat_tree(state_copy)) if isinstance(state_copy, Mapping) else []
        return state_copy, plan, nbytes[0]

    def place(self, snap: Snapshot, state_copy: Any, slab: Slab, plan: list[tuple[torch.Tensor, int]]) -> None:
        """Points the placeholders at the slab; copies now the tensors no
        attached optimizer changes (buffers, counters) and leaves the rest to
        the capture, those the step changes first."""
        views = slab.views_for([(off, t.numel() * t.element_size(), t.dtype, tuple(t.shape)) for t, off in plan])
        for view, item in zip(views, snap.items, strict=True):
            item.dst.set_(view)  # type: ignore[call-overload]  # the placeholder becomes the host copy
            if item.layout is not None:
                attach_layout(item.dst, item.layout)
        for alias, first in snap.aliases:  # the same memory viewed again (tied weights): one copy, shared
            alias.set_(first.untyped_storage(), first.storage_offset(), first.shape, first.stride())
        snap.state = state_copy
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

    def wait_for_step(self, on_device: bool = False) -> list[Snapshot]:
        """At the optimizer step: copies or waits for the tensors it changes;
        returns the snapshots waited for. ``on_device``: the step changes
        GPU tensors only with work on the current stream, so for a GPU
        snapshot that stream waits for the event after their copies and this
        thread waits only until the copies are issued."""
        with self.lock:
            pending = list(self.pending)
        for s in pending:
            if s.event is None:
                self.steal(s)
            elif on_device and not self.debug:
                s.mutable_issue.wait()
                if s.mutable_event is not None and s.error is None:
                    torch.cuda.current_stream(s.mutable_device).wait_event(s.mutable_event)
                    continue
            # The debug check compares version counters once the capture is
            # complete, so there the step waits for all of it.
            (s.captured if self.debug else s.mutable_done).wait()
        return pending

    def owned_storages(self) -> set[int]:
        """Storages the attached optimizers change (cached until their state grows)."""
        key = tuple((id(o), len(o.state), sum(len(g["params"]) for g in o.param_groups)) for o in self.optimizers)
        if self.owned_cache is not None and self.owned_cache[0] == key:
            return self.owned_cache[1]
        ptrs: set[int] = set()
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    ptrs.add(storage_ptr(p))
            for st in opt.state.values():
                for v in st.values() if isinstance(st, Mapping) else []:
                    if isinstance(v, torch.Tensor):
                        ptrs.add(storage_ptr(v))
        self.owned_cache = (key, ptrs)
        return ptrs

    def copy_tree(
        self,
        obj: Any,
        snap: Snapshot,
        plan: list[tuple[torch.Tensor, Any]],
        memo: dict[int, Any],
        views: dict[tuple[Any, ...], torch.Tensor],
        reserve: Callable[[torch.Tensor], int],
        owned: set[int] | None,
        key: str,
    ) -> Any:
        """The state with each tensor replaced by a placeholder that becomes
        its host copy; other leaves deep-copied now. Plain tensors that view
        the same memory the same way (tied weights: a state dict holds a
        separate tensor object per name) share one copy, as they share one
        storage in the state and in ``torch.save``'s file."""
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
            view = None
            if keep_layout is None and src.layout == torch.strided and src.numel() > 0 and not is_dtensor(obj):
                view = (
                    src.device,
                    src.untyped_storage().data_ptr(),
                    src.storage_offset(),
                    tuple(src.shape),
                    tuple(src.stride()),
                    src.dtype,
                    src.is_conj(),
                    src.is_neg(),
                )
                first = views.get(view)
                if first is not None:
                    alias = torch.empty(0, dtype=src.dtype)
                    snap.aliases.append((alias, first))
                    memo[id(obj)] = alias
                    return alias
            dst = torch.empty(0, dtype=src.dtype)
            mutable = owned is None or src.untyped_storage().data_ptr() in owned
            snap.items.append(Item(src, dst, src._version, mutable, keep_layout))
            plan.append((src, reserve(src)))
            memo[id(obj)] = dst
            if view is not None:
                views[view] = dst
            return dst
        if isinstance(obj, PerRank):
            return PerRank(self.copy_tree(obj.value, snap, plan, memo, views, reserve, owned, key))
        if isinstance(obj, Mapping):
            out = copy.copy(obj)
            nested = _tree.walks(obj)
            for k, v in obj.items():
                child = _tree.child(key, k) if nested else key
                out[k] = self.copy_tree(v, snap, plan, memo, views, reserve, owned, child)  # type: ignore[index]
            return out
        if isinstance(obj, list):
            nested = _tree.walks(obj)
            return [
                self.copy_tree(v, snap, plan, memo, views, reserve, owned, _tree.child(key, i) if nested else key)
                for i, v in enumerate(obj)
            ]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.copy_tree(v, snap, plan, memo, views, reserve, owned, key) for v in obj)
        return copy.deepcopy(obj, memo)

    def capture_device(self, snap: Snapshot) -> None:
        """Capture of GPU tensors: every copy is issued at once on the
        device's copy stream (the shim's, else torch's), ordered after the
        event recorded at ``save``; each tensor's gate advances as its copy
        completes. Once the copies of the tensors the step changes are
        issued, an event after them is what the step waits for, on the device
        (:meth:`wait_for_step`), not on this thread."""
        try:
            c = None
            if snap.event is not None:
                dev = next(it.src.device for it in snap.items if it.src.is_cuda)
                c = gpu.copier(dev)
                c.torch_stream.wait_event(snap.event)
            events: list[tuple[int, gpu.Event]] = []
            for i, it in enumerate(snap.items):
                if i == snap.n_mutable and c is not None:
                    self.mutable_issued(snap, c)
                if it.src.is_cuda and c is not None:
                    copy_from_device(c, it.dst, it.src)
                    events.append((i, c.record()))
                else:
                    it.dst.copy_(it.src)
                    if not events:
                        self.copied(snap, (i,))
                    else:
                        events.append((i, c.record()))  # type: ignore[union-attr]  # in order behind the copies
            if c is not None and len(snap.items) == snap.n_mutable:
                self.mutable_issued(snap, c)
            for i, ev in events:
                ev.wait()
                self.copied(snap, (i,))  # the flush may write it now; the step may run once the mutable ones are
            self.copied(snap, list(range(len(snap.items))))
        except BaseException as e:
            self.fail(snap, e)
            self.errors.append(e)
        finally:
            snap.mutable_issue.set()
            self.finish(snap)

    @staticmethod
    def mutable_issued(snap: Snapshot, c: gpu.Copier) -> None:
        ev = torch.cuda.Event()
        ev.record(c.torch_stream)
        snap.mutable_event = ev
        snap.mutable_device = c.device
        snap.mutable_issue.set()

    def capture_host(self, snap: Snapshot) -> None:
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
                copy_host(it.dst, it.src, snap.gate, i + 1)  # i + 1: where the flush reads it (``place``)
                self.copied(snap, (i,))
            # Items the training thread took are copied before their sources are released.
            while not snap.mutable_done.wait(0.1):
                if snap.error is not None:
                    break
        except BaseException as e:
            self.fail(snap, e)
            self.errors.append(e)
        finally:
            if snap.gate is not None and snap.error is None:
                snap.gate.advance(len(snap.items))
            self.finish(snap)

    def finish(self, snap: Snapshot) -> None:
        """The end of a capture, whatever its outcome: waiters are released,
        a failed snapshot's buffers go back to the pool (nothing writes into
        them any more), and a good one goes on to the flush."""
        snap.handle.timings["capture"] = time.perf_counter() - snap.t_save
        snap.advance(Capture.CAPTURED)
        if snap.error is not None:
            self.release_failed(snap)
        with self.lock:
            if snap in self.pending:
                self.pending.remove(snap)
        if not self.debug:
            snap.release_sources()
            snap.verified.set()
        if snap.error is None:
            snap.handle._set(self.host_name, "captured")
            if snap.gate is None:
                self.flush_q.put(snap)

    @staticmethod
    def copied(snap: Snapshot, idxs: tuple[int, ...] | list[int]) -> None:
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

    def steal(self, snap: Snapshot) -> None:
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
                    copy_host(it.dst, it.src, snap.gate, k + 1)  # with its sums, as the capture thread copies
        except BaseException as e:
            self.fail(snap, e)
            self.errors.append(e)
        finally:
            snap.stolen += len(mine)
            self.copied(snap, mine)

    def fail(self, snap: Snapshot, e: BaseException) -> None:
        drop_offload_pins(snap)
        if snap.gate is not None:
            snap.gate.fail()  # a flush already writing this snapshot stops
        snap.fail(e)
        snap.handle.error = e
        for n, st in snap.handle.tiers.items():
            if st in ("pending", "captured"):
                snap.handle._set(n, "failed")
        if snap.copying_done:
            self.release_failed(snap)
        # else the capture thread gives the buffers back when it stops copying
        snap.verified.set()
        with self.lock:
            if snap in self.snaps:
                self.snaps.remove(snap)

    def verify(self) -> None:
        """Debug check, on the training thread at each synchronisation point:
        a saved tensor whose version counter moved since ``save`` was changed
        before the capture was waited for, so the snapshot may be torn; it is
        discarded (never written) and the error raised here."""
        if not self.debug:
            return
        with self.lock:
            snaps = [s for s in self.snaps if s.captured.is_set() and not s.verified.is_set()]
        torn: TornSnapshotError | None = None
        for snap in snaps:
            bad = next((it for it in snap.items if it.src._version != it.version), None)
            if bad is not None:
                err = TornSnapshotError(self.torn_msg(snap, bad))
                self.fail(snap, err)
                snap.handle.reported = True  # raised here; wait() does not raise it again
                torn = torn or err
            snap.release_sources()
            snap.verified.set()
        if torn is not None:
            raise torn

    @staticmethod
    def torn_msg(snap: Snapshot, it: Item) -> str:
        return (
            f"checkpoint of step {snap.step}: a tensor of shape {tuple(it.src.shape)} ({it.src.dtype}) was modified "
            f"before its capture finished (version {it.version} -> {it.src._version}); call wait_capture() or "
            f"Checkpointer.attach(optimizer) before changing saved tensors. The snapshot was discarded."
        )

    def raise_errors(self) -> None:
        """A capture that failed (other than the debug check) is raised on the
        training thread at its next synchronisation point."""
        if self.errors:
            e = self.errors.pop(0)
            raise TierstoreError(f"a checkpoint capture failed: {e}") from e

    def release_failed(self, snap: Snapshot) -> None:
        """A failed snapshot's host copy is no restore point: its buffers go
        back to the pool (once its capture no longer writes into them)."""
        snap.release_host(Residency.EVICTED)
        self.pool.release(snap)

    def wait_copied(self, snap: Snapshot) -> None:
        """Until the capture no longer writes into the snapshot's buffers
        (it always ends: its thread sets ``captured`` in a ``finally``)."""
        snap.captured.wait()
