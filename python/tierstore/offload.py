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
each process has at most ``io_slots`` transfers in flight per direction. The
turns are the engine's: while the optimizer holds them, every transfer the
engine runs at that device (loads, saves, checkpoint flushes) takes them
too. Offload I/O is foreground-class engine work; checkpoint flushes are
background-class and wait behind it in line.

Every read is checked against the CRC-32 computed when the subgroup was
written; damaged state raises :class:`~tierstore.errors.ChecksumError`.
Files live in a per-process session directory that only its process reads;
a killed process's session is removed by the next optimizer on that path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tierstore._engine import get_engine, lock_dir
from tierstore._metadata import dtype_name
from tierstore._offload_checkpoint import restore_subgroups, same_partition, take_subgroups
from tierstore._offload_device import DeviceTransfers, dense_on_one_gpu
from tierstore._offload_entry import (
    OFFLOAD_FORMAT,
    OFFLOAD_FORMATS_READ,
    OFFLOAD_KEY,
    check_sources,
    is_offload_parts,
    offload_meta,
    restore_state_dict,
)
from tierstore._offload_io import SESSION, StoragePath
from tierstore._offload_pipeline import step_pipelined
from tierstore._offload_placement import Placement
from tierstore._offload_store import HostMemory, SubgroupStore
from tierstore._offload_subgroup import PAGE, Subgroup, partition
from tierstore.errors import InvalidArgumentError, TierstoreError
from tierstore.tiers import DiskTier, HostTier, offload_tiers, parse_size

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
        self.budget, roots = offload_tiers(tiers if tiers is not None else _default_tiers())
        self.subgroup_bytes = max(PAGE, parse_size(subgroup_bytes))
        self.pipeline = pipeline
        self.split_masters = split_masters
        self.balance = balance
        self.cls = optimizer_class
        self.kwargs = optimizer_kwargs
        self.engine = get_engine()
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        super().__init__(params, dict(probe.defaults))
        del probe
        self.session = f"{SESSION}{os.getpid()}-{secrets.token_hex(4)}"
        self._closed = True  # until the paths exist
        self._placement = Placement(
            roots,
            self.session,
            self.engine,
            io_slots=io_slots,
            device_slots=device_slots,
            exclusive_io=exclusive_io,
            duplex=duplex,
            balance=balance,
        )
        self._closed = False
        self.paths = self._placement.paths
        self.devices = self._placement.devices
        self._grad32: torch.Tensor | None = None  # the reused fp32 gradient buffer
        self._master32: torch.Tensor | None = None  # the reused buffer of rebuilt split masters
        self._device = DeviceTransfers()  # pinned buffers for parameters on a GPU
        self._threads = max(1, torch.get_num_threads())
        self._warned: set[str] = set()
        self._pending_warnings: list[str] = []
        self.steps = 0
        self.stats: dict[str, float] = {
            "read_bytes": 0,
            "write_bytes": 0,
            "reads": 0,  # subgroup transfers
            "writes": 0,
            "read_s": 0.0,
            "write_s": 0.0,
            "wait_s": 0.0,
            "update_s": 0.0,
            "alloc_bytes": 0,
        }
        self._memory = HostMemory(self.budget, self.stats)
        self.subgroups = partition(self.param_groups, self.subgroup_bytes)
        self._store = SubgroupStore(
            self.subgroups, self._memory, self._placement, self.engine, self._warn, self._threads, self.subgroup_bytes
        )
        self._placement.probe(self.engine, self._warn)
        resident = 0
        for sg in self.subgroups:
            sg.masters = [p.detach().to("cpu", torch.float32, copy=True) for p in sg.params]
            self._store.pack(sg)
            resident = self._store.spill(sg, resident)

    def _warn(self, msg: str) -> None:
        """Queues a warning (workers call this); the training thread issues it."""
        if msg not in self._warned:
            self._warned.add(msg)
            self._pending_warnings.append(msg)

    def _flush_warnings(self) -> None:
        while self._pending_warnings:
            warnings.warn(self._pending_warnings.pop(0), stacklevel=3)

    # The placement as tests/test_offload.py sees it.
    @property
    def _layout_map(self) -> dict[int, StoragePath]:
        return self._placement.map

    @_layout_map.setter
    def _layout_map(self, value: dict[int, StoragePath]) -> None:
        self._placement.map = value

    def _layout(self) -> dict[int, StoragePath]:
        return self._placement.layout(self.subgroups)

    def _hyper(self, sg: Subgroup) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}

    def _inner(self, sg: Subgroup) -> torch.optim.Optimizer:
        """The wrapped optimizer of ``sg`` (made on first use)."""
        sg.ensure_inner(self.cls, self.kwargs, self._hyper(sg))
        assert sg.inner is not None
        return sg.inner

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
        self._placement.end_period()
        order = self.subgroups if self.steps % 2 == 0 else self.subgroups[::-1]
        active = [sg for sg in order if any(p.grad is not None for p in sg.params)]
        try:
            if self.pipeline:
                step_pipelined(self._store, self._memory, active, self._update, self.stats)
            else:
                for sg in active:
                    self._store.load_sync(sg)
                    self._update(sg)
                    self._store.write_sync(sg)
        finally:
            self._flush_warnings()
        self.steps += 1
        return loss

    def _grad_buffer(self, numel: int) -> torch.Tensor:
        if self._grad32 is None or self._grad32.numel() < numel:
            self._grad32 = torch.empty(numel, dtype=torch.float32)
        return self._grad32[:numel]

    def _update(self, sg: Subgroup) -> None:
        """The wrapped optimizer's step on the resident subgroup; the updated
        masters are copied into the model parameters."""
        t0 = time.perf_counter()
        inner = self._inner(sg)
        inner.param_groups[0].update(self._hyper(sg))
        # Parameters on a GPU: they and their gradients come down in one batch
        # of copies into pinned memory, the new values go up the same way.
        dev = dense_on_one_gpu(sg.params)
        his, grads = self._device.fetch(dev, sg.params, sg.split) if dev is not None else (None, None)
        if sg.split:
            if self._master32 is None or self._master32.numel() < sg.numel:
                self._master32 = torch.empty(sg.numel, dtype=torch.float32)
            for m, v in zip(sg.masters, sg.rebuild_masters(self._threads, self._master32, his), strict=True):
                m.data = v
        sg.take_grads(self._grad_buffer(sg.numel), grads)
        before = len(sg.tensors())
        inner.step()
        for m in sg.masters:
            m.grad = None
        split = self.split_masters and all(p.dtype == torch.bfloat16 for p in sg.params)
        if len(sg.tensors()) != before or split != sg.split:
            # The first step created state, or the parameters' dtype changed:
            # a new layout (split masters are stored, parameters set, by pack).
            sg.split = split
            self._store.pack(sg)
        elif split and dev is not None:
            up = self._device.staging(sg.params)
            sg.store_split(self._threads, up)
            self._device.push(dev, sg.params, up)
        elif split:
            sg.store_split(self._threads)
        if split:
            sg.drop_masters()
        else:
            for p, m in zip(sg.params, sg.masters, strict=True):
                p.copy_(m)
        sg.dirty = True
        self.stats["update_s"] += time.perf_counter() - t0

    # -------------------------------------------------------------------------------------------
    # the rest of the optimizer interface

    def wait_io(self) -> None:
        """Waits for the reads and write-backs in flight; raises their errors."""
        self._device.wait()
        self._store.settle_all()
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
        return self._placement.bandwidth()

    def master_params(self) -> list[torch.Tensor]:
        """Copies of the fp32 master weights, in parameter order (read back
        from the tiers where they are not resident)."""
        out: list[torch.Tensor] = []
        for sg in self.subgroups:
            was = self._store.visit(sg)
            if sg.split:
                out.extend(sg.rebuild_masters(self._threads))
            else:
                out.extend(m.detach().clone() for m in sg.masters)
            self._store.leave(sg, was)
        return out

    def host_bytes(self) -> int:
        """Bytes of host memory held for state (resident, in flight and free buffers)."""
        with self._memory.cond:
            return self._memory.held

    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _groups(self) -> list[dict[str, Any]]:
        """The parameter groups with parameters as indices (the state dict's form)."""
        index = self._index()
        groups = []
        for g in self.param_groups:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [index[id(p)] for p in g["params"]]
            groups.append(g2)
        return groups

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: state by parameter index, param_groups."""
        state: dict[int, dict[str, Any]] = {}
        index = self._index()
        for sg in self.subgroups:
            was = self._store.visit(sg)
            if sg.inner is not None:
                for p, m in zip(sg.params, sg.masters, strict=True):
                    st = sg.inner.state.get(m)
                    if st:
                        state[index[id(p)]] = {
                            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()
                        }
            self._store.leave(sg, was)
        return {"state": state, "param_groups": self._groups()}

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
            self._store.load_sync(sg)
            inner = self._inner(sg)
            sg.split = False  # the masters from the parameters, whole (split again by the next update)
            for p, m in zip(sg.params, sg.masters, strict=True):
                m.data = p.detach().to("cpu", torch.float32, copy=True)
                st = sd["state"].get(index[id(p)])
                if st is not None:
                    inner.state[m] = {
                        k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items()
                    }
                else:
                    inner.state.pop(m, None)
            self._store.pack(sg)
            resident = self._store.spill(sg, resident)

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
        entries, tensors, pins = take_subgroups(self._store, prefix, pin_tag, file_prefix)
        parts: dict[str, Any] = dict(tensors)
        meta = {
            "optimizer": self._optimizer_name(),
            "steps": self.steps,
            "param_groups": self._groups(),
            "params": [
                {"shape": list(p.shape), "dtype": dtype_name(p.dtype)} for g in self.param_groups for p in g["params"]
            ],
            "subgroups": entries,
        }
        # A (format, meta) pair: saved as one object, not flattened into keys.
        parts[OFFLOAD_KEY] = (OFFLOAD_FORMAT, meta)
        return parts, pins

    def _optimizer_name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    @torch.no_grad()
    def restore_from_checkpoint(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], d: Path) -> None:
        """Puts a checkpoint's offloaded state back (see :meth:`checkpoint_parts`):
        each subgroup's bytes, checked, straight into host memory or a path;
        with another partition, through the wrapped optimizer's state dict."""
        params = [p for g in self.param_groups for p in g["params"]]
        if not same_partition(meta, self._optimizer_name(), params, self.subgroups):
            self.load_state_dict(restore_state_dict(meta, tensors, d))
            return
        if len(meta["param_groups"]) != len(self.param_groups):
            raise TierstoreError(
                f"{d}: offloaded optimizer state of {len(meta['param_groups'])} parameter groups; "
                f"this optimizer has {len(self.param_groups)}"
            )
        check_sources(meta["subgroups"], tensors, d)  # nothing changed here before every subgroup is known whole
        self.wait_io()
        for g, g2 in zip(self.param_groups, meta["param_groups"], strict=True):
            g.update({k: v for k, v in g2.items() if k != "params"})
        restore_subgroups(self._store, meta["subgroups"], tensors, d, self._inner)
        self.steps = int(meta.get("steps", 0))

    def close(self) -> None:
        """Removes this process's offload files (the optimizer is unusable after)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for sg in self.subgroups:
            with contextlib.suppress(Exception):
                self._store.settle(sg)
        self._placement.close()

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
