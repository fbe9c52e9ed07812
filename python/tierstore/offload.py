"""Optimizer state offloaded to host memory and disk paths (first version).

::

    opt = tierstore.offload(torch.optim.AdamW, model.parameters(), lr=3e-4,
                            tiers=[tierstore.HostTier("4GiB"), tierstore.DiskTier(["/nvme0/off", "/nvme1/off"])])
    loss.backward(); opt.step(); opt.zero_grad()

The fp32 master weights and every state tensor of the wrapped optimizer live
in *subgroups*: flat host buffers of about ``subgroup_bytes`` that are written
to the disk paths when the host budget is exceeded and read back for their
update. A step walks the subgroups in an order that alternates every step (the
subgroups touched last are still in memory), reads subgroup i+1 and writes
back i-1 while i is updated, converts each gradient to fp32 only for its
update, and copies the updated master back into the model parameter. Each
subgroup's update is the wrapped optimizer's own step on those parameters, so
results equal the in-memory optimizer's (bitwise on the CPU).

Paths get subgroups in proportion to their bandwidth: probed at start, then
re-estimated from every read and write, so a path that slows down receives
less. A machine-wide lock per path (a lock file under ``/dev/shm``) keeps
several processes from thrashing one device. Files are tierstore containers:
each read is checked against the CRC-32 written with it, and files live in a
per-process directory that is removed at close, so nothing a killed process
leaves is taken for valid state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore._engine import get_engine
from tierstore.checkpointer import DiskTier, HostTier, parse_size
from tierstore.errors import ChecksumError

__all__ = ["OffloadedOptimizer", "offload"]

_PAGE = 4096


def _default_tiers() -> list[HostTier | DiskTier]:
    scratch = os.environ.get("TIERSTORE_OFFLOAD_DIR", os.path.join(tempfile.gettempdir(), "tierstore-offload"))
    return [HostTier(os.environ.get("TIERSTORE_OFFLOAD_HOST", "1GiB")), DiskTier(scratch)]


class _PathLock:
    """A machine-wide lock per device path (flock on a file in /dev/shm)."""

    def __init__(self, path: Path) -> None:
        key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.file = base / f"tierstore-offload-{key}.lock"
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o666)
        # flock excludes other processes; this process's reader and writer
        # threads take turns through the mutex (one transfer per device at a time).
        self.mutex = threading.Lock()

    def __enter__(self) -> None:
        self.mutex.acquire()
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.mutex.release()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Path:
    def __init__(self, root: Path, exclusive: bool) -> None:
        self.dir = root
        self.lock = _PathLock(root) if exclusive else None
        self.bw = 0.0  # bytes per second (EMA)
        self.bytes = 0  # bytes of state stored here now

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes < (1 << 20):
            return
        bw = nbytes / seconds
        self.bw = bw if self.bw == 0 else 0.7 * self.bw + 0.3 * bw

    def io(self) -> Any:
        return self.lock if self.lock is not None else _nolock


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_nolock = _NoLock()


class _Subgroup:
    def __init__(self, index: int, group: int, params: list[torch.Tensor]) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.masters = [torch.empty(0) for _ in params]  # fp32 leaves; .data points into `buf`
        self.inner: torch.optim.Optimizer | None = None
        self.buf: torch.Tensor | None = None  # resident flat bytes
        self.layout: list[tuple[int, str | None, int, int, torch.dtype, tuple[int, ...]]] = []
        self.nbytes = 0
        self.path: _Path | None = None
        self.file: Path | None = None
        self.data_offset = 0
        self.crc = 0
        self.pending: Future[None] | None = None  # read or write in flight
        self.last_used = -1
        self.stored = 0  # bytes of its file counted on `path`


class OffloadedOptimizer:
    """Behaves like the wrapped optimizer (``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``, ``param_groups``) while its fp32
    master weights and state live in the tiers."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        *,
        tiers: list[HostTier | DiskTier] | None = None,
        subgroup_bytes: int | str = "64MiB",
        exclusive_io: bool = True,
        pipeline: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        tiers = tiers if tiers is not None else _default_tiers()
        hosts = [t for t in tiers if isinstance(t, HostTier)]
        disks = [t for t in tiers if isinstance(t, DiskTier)]
        if not disks:
            raise ValueError("offload needs at least one DiskTier")
        self.budget = int(hosts[0].budget) if hosts else parse_size("1GiB")
        self.subgroup_bytes = parse_size(subgroup_bytes)
        self.pipeline = pipeline  # False: the naive baseline (read, update, write, one at a time)
        self.cls = optimizer_class
        self.kwargs = optimizer_kwargs
        self.engine = get_engine()
        session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.paths: list[_Path] = []
        for t in disks:
            for p in t.paths:  # type: ignore[union-attr]
                d = Path(p) / f"session-{session}"
                d.mkdir(parents=True, exist_ok=True)
                self.paths.append(_Path(d, exclusive_io))
        # Hyperparameters and defaults exactly as the wrapped optimizer would set them.
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        self.defaults = dict(probe.defaults)
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups: list[dict[str, Any]] = []
        for g in groups:
            full = {**self.defaults, **{k: v for k, v in g.items() if k != "params"}}
            full["params"] = list(g["params"])
            self.param_groups.append(full)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._free_lock = threading.Lock()
        self.subgroups: list[_Subgroup] = []
        for gi, g in enumerate(self.param_groups):
            cur: list[torch.Tensor] = []
            size = 0
            for p in g["params"]:
                # master + about two state tensors of fp32 per element
                need = 12 * p.numel()
                if cur and size + need > self.subgroup_bytes:
                    self.subgroups.append(_Subgroup(len(self.subgroups), gi, cur))
                    cur, size = [], 0
                cur.append(p)
                size += need
            if cur:
                self.subgroups.append(_Subgroup(len(self.subgroups), gi, cur))
        for sg in self.subgroups:
            sg.masters = [p.detach().to(torch.float32, copy=True).cpu() for p in sg.params]
            self._pack(sg)
        self._probe_paths()
        self.io = ThreadPoolExecutor(2, thread_name_prefix="tierstore-offload")
        self.steps = 0
        self._uses = 0
        self._closed = False
        self.stats: dict[str, float] = {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0}
        self._enforce_budget(keep=[])

    # -------------------------------------------------------------------------------------------
    # layout of a subgroup's flat buffer

    def _tensors(self, sg: _Subgroup) -> list[tuple[int, str | None, torch.Tensor]]:
        out: list[tuple[int, str | None, torch.Tensor]] = []
        for i, m in enumerate(sg.masters):
            out.append((i, None, m))
            if sg.inner is not None:
                st = sg.inner.state.get(m, {})
                for k in sorted(st):
                    if isinstance(st[k], torch.Tensor):
                        out.append((i, k, st[k]))
        return out

    def _pack(self, sg: _Subgroup) -> None:
        """Moves the subgroup's tensors into one flat buffer (new layout)."""
        items = self._tensors(sg)
        layout = []
        off = 0
        for i, k, t in items:
            n = t.numel() * t.element_size()
            off = -(-off // 64) * 64
            layout.append((i, k, off, n, t.dtype, tuple(t.shape)))
            off += n
        nbytes = -(-max(off, 1) // _PAGE) * _PAGE
        buf = self._alloc(nbytes)
        for (_i, _k, o, n, dt, shape), (_i2, _k2, t) in zip(layout, items, strict=True):
            buf[o : o + n].view(dt).view(shape).copy_(t)
        sg.layout, sg.nbytes = layout, nbytes
        self._attach(sg, buf)

    def _attach(self, sg: _Subgroup, buf: torch.Tensor) -> None:
        """Points masters and state tensors at views of ``buf``."""
        sg.buf = buf
        for i, k, o, n, dt, shape in sg.layout:
            v = buf[o : o + n].view(dt).view(shape)
            if k is None:
                sg.masters[i].data = v
            else:
                assert sg.inner is not None
                sg.inner.state[sg.masters[i]][k] = v

    def _detach(self, sg: _Subgroup) -> None:
        for i, k, *_ in sg.layout:
            if k is None:
                sg.masters[i].data = torch.empty(0)
            else:
                assert sg.inner is not None
                sg.inner.state[sg.masters[i]][k] = torch.empty(0)
        if sg.buf is not None:
            self._release(sg.buf)
        sg.buf = None

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes``, reused from evicted subgroups when one fits
        (fresh memory costs page faults on every step)."""
        with self._free_lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
        # Page-aligned, so that reads can use O_DIRECT straight into it.
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        return raw[start : start + nbytes]

    def _release(self, buf: torch.Tensor) -> None:
        with self._free_lock:
            # Keep about two subgroups' worth for reuse; the rest goes back to the system.
            if self._free_bytes + buf.numel() <= 2 * max(self.subgroup_bytes, buf.numel()):
                self._free.setdefault(buf.numel(), []).append(buf)
                self._free_bytes += buf.numel()

    # -------------------------------------------------------------------------------------------
    # paths and I/O

    def _probe_paths(self) -> None:
        """A short write+read per path: the starting bandwidth estimate."""
        probe = torch.full((8 << 20,), 7, dtype=torch.uint8)
        for p in self.paths:
            f = p.dir / "probe.bin"
            _off, _crc, dt = self._write_file(f, probe, p, durable=True)
            p.observe(probe.numel() * 4, dt * 4)  # scaled: a tiny file overstates latency
            p.bw = max(p.bw, 1.0)
            f.unlink(missing_ok=True)

    def _choose_path(self, nbytes: int) -> _Path:
        """The path whose share of the stored bytes is furthest below its
        share of the measured bandwidth."""
        total_bw = sum(p.bw for p in self.paths) or 1.0
        total = sum(p.bytes for p in self.paths) + nbytes
        return max(self.paths, key=lambda p: p.bw / total_bw * total - p.bytes)

    def _write_file(self, f: Path, buf: torch.Tensor, p: _Path, durable: bool = False) -> tuple[int, int, float]:
        """Writes ``buf`` as a one-record container; (data offset, CRC, seconds
        of transfer, not counting the wait for the path's lock)."""
        with p.io():
            t0 = time.perf_counter()
            w = _core.create_writer(self.engine, f, durable=durable)
            w.add_memory("s/data/0", buf.data_ptr(), buf.numel(), buf)
            crcs = w.write_data()
            off = w.entries()[0][2]
            w.commit()
            dt = time.perf_counter() - t0
        crc = crcs[0]
        assert crc is not None
        return off, crc, dt

    def _write_back(self, sg: _Subgroup) -> None:
        assert sg.buf is not None
        buf = sg.buf
        if sg.path is not None:  # its old copy no longer counts for the choice
            sg.path.bytes -= sg.stored
            sg.stored = 0
        p = self._choose_path(sg.nbytes)
        f = p.dir / f"sg-{sg.index:06d}.pt"
        try:
            off, crc, dt = self._write_file(f, buf, p)
        except OSError as e:
            if e.errno != errno.ENOSPC or len(self.paths) == 1:
                raise
            warnings.warn(f"tierstore offload: {p.dir} is full; its share moves to the other paths", stacklevel=1)
            self.paths.remove(p)
            self._write_back(sg)
            return
        p.observe(sg.nbytes, dt)
        self.stats["write_bytes"] += sg.nbytes
        self.stats["write_s"] += dt
        if sg.file is not None and sg.file != f:
            sg.file.unlink(missing_ok=True)
        p.bytes += sg.nbytes
        sg.path, sg.file, sg.data_offset, sg.crc, sg.stored = p, f, off, crc, sg.nbytes

    def _read(self, sg: _Subgroup) -> torch.Tensor:
        assert sg.file is not None and sg.path is not None
        buf = self._alloc(sg.nbytes)
        with sg.path.io():
            t0 = time.perf_counter()
            _core.read_ranges(self.engine, sg.file, [sg.data_offset], [sg.nbytes], [buf.data_ptr()], direct=True)
            dt = time.perf_counter() - t0
        sg.path.observe(sg.nbytes, dt)
        self.stats["read_bytes"] += sg.nbytes
        self.stats["read_s"] += dt
        (crc,) = _core.crc32_regions([(buf.data_ptr(), sg.nbytes)])
        if crc != sg.crc:
            raise ChecksumError(
                f"{sg.file}: offloaded optimizer state of subgroup {sg.index} is damaged "
                f"(CRC-32 {crc:08x}, written {sg.crc:08x})",
                path=str(sg.file),
                record="s/data/0",
            )
        return buf

    def _start_read(self, sg: _Subgroup) -> None:
        if sg.buf is None and sg.pending is None:
            sg.pending = self.io.submit(lambda: self._attach(sg, self._read(sg)))

    def _start_write(self, sg: _Subgroup) -> None:
        def job() -> None:
            self._write_back(sg)
            self._detach(sg)

        if sg.buf is not None and sg.pending is None:
            sg.pending = self.io.submit(job)

    def _settle(self, sg: _Subgroup) -> None:
        if sg.pending is not None:
            f, sg.pending = sg.pending, None
            f.result()

    def _resident(self) -> int:
        return sum(sg.nbytes for sg in self.subgroups if sg.buf is not None or sg.pending is not None)

    def _enforce_budget(self, keep: list[_Subgroup]) -> None:
        """Writes back subgroups (oldest use first, not those in ``keep``)
        until the resident bytes fit the host budget."""
        for sg in sorted(self.subgroups, key=lambda s: s.last_used):
            if self._resident() <= self.budget:
                break
            if sg in keep or sg.buf is None:
                continue
            self._settle(sg)
            self._start_write(sg)

    # -------------------------------------------------------------------------------------------
    # the optimizer interface

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def _sync_hyper(self, sg: _Subgroup) -> None:
        g = self.param_groups[sg.group]
        assert sg.inner is not None
        for k, v in g.items():
            if k != "params":
                sg.inner.param_groups[0][k] = v

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        order = self.subgroups if self.steps % 2 == 0 else self.subgroups[::-1]
        for n, sg in enumerate(order):
            self._load(sg)
            if self.pipeline and n + 1 < len(order) and order[n + 1].pending is None:
                self._start_read(order[n + 1])  # prefetch i+1 while i is updated
            self._uses += 1
            sg.last_used = self._uses
            if sg.inner is None:
                hyper = {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}
                sg.inner = self.cls([{"params": sg.masters, **hyper}], **self.kwargs)
            self._sync_hyper(sg)
            for p, m in zip(sg.params, sg.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
            before = len(self._tensors(sg))
            sg.inner.step()
            for m in sg.masters:
                m.grad = None
            if len(self._tensors(sg)) != before:  # the first step created state: repack
                self._pack(sg)
            for p, m in zip(sg.params, sg.masters, strict=True):
                p.copy_(m)
            if not self.pipeline:
                self._write_back(sg)
                self._detach(sg)
                continue
            self._enforce_budget(keep=[sg, *order[n + 1 : n + 2]])
        # Eviction goes by last use, so what stays within the budget is what
        # this step touched last: the first subgroups of the next (reversed) step.
        self._enforce_budget(keep=[])
        self.steps += 1
        return loss

    def wait_io(self) -> None:
        """Waits for the reads and write-backs in flight."""
        for sg in self.subgroups:
            self._settle(sg)

    def placement(self) -> dict[str, int]:
        """Bytes of optimizer state (masters included) in host memory and on each path."""
        out = {"host": sum(sg.nbytes for sg in self.subgroups if sg.buf is not None)}
        for p in self.paths:
            out[str(p.dir.parent)] = out.get(str(p.dir.parent), 0) + sum(
                sg.nbytes for sg in self.subgroups if sg.buf is None and sg.path is p
            )
        return out

    def _load(self, sg: _Subgroup) -> None:
        """Makes the subgroup resident (after any write or read in flight)."""
        self._settle(sg)
        self._start_read(sg)
        self._settle(sg)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: state by parameter index, param_groups."""
        state: dict[int, dict[str, Any]] = {}
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for sg in self.subgroups:
            self._load(sg)
            if sg.inner is None:
                continue
            for p, m in zip(sg.params, sg.masters, strict=True):
                st = sg.inner.state.get(m)
                if st:
                    state[index[id(p)]] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            self._enforce_budget(keep=[sg])
        groups = []
        for g in self.param_groups:
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = [index[id(p)] for p in g["params"]]
            groups.append(g2)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if len(sd["param_groups"]) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, g2 in zip(self.param_groups, sd["param_groups"], strict=True):
            if len(g["params"]) != len(g2["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            g.update({k: v for k, v in g2.items() if k != "params"})
        where = {id(p): i for i, p in enumerate(params)}
        for sg in self.subgroups:
            self._load(sg)
            hyper = {k: v for k, v in self.param_groups[sg.group].items() if k != "params"}
            if sg.inner is None:
                sg.inner = self.cls([{"params": sg.masters, **hyper}], **self.kwargs)
            for p, m in zip(sg.params, sg.masters, strict=True):
                m.copy_(p.detach().to(torch.float32))
                st = sd["state"].get(where[id(p)])
                if st is not None:
                    sg.inner.state[m] = {
                        k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()
                    }
            self._pack(sg)
            self._enforce_budget(keep=[sg])

    def close(self) -> None:
        """Removes this process's offload files (the optimizer is unusable after)."""
        if self._closed:
            return
        self._closed = True
        for sg in self.subgroups:
            with contextlib.suppress(Exception):
                self._settle(sg)
        self.io.shutdown(wait=True)
        for p in self.paths:
            shutil.rmtree(p.dir, ignore_errors=True)
            if p.lock is not None:
                p.lock.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def offload(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    *,
    tiers: list[HostTier | DiskTier] | None = None,
    **optimizer_kwargs: Any,
) -> OffloadedOptimizer:
    """Wraps ``optimizer_class`` so that its fp32 master weights and state live
    in ``tiers`` (default: ``TIERSTORE_OFFLOAD_HOST`` of host memory, 1 GiB,
    and a scratch directory ``TIERSTORE_OFFLOAD_DIR``). ``subgroup_bytes`` and
    ``exclusive_io`` (the per-path machine-wide lock) and ``pipeline``
    (False: the naive synchronous baseline) may be passed among them."""
    extra = {
        k: optimizer_kwargs.pop(k) for k in ("subgroup_bytes", "exclusive_io", "pipeline") if k in optimizer_kwargs
    }
    return OffloadedOptimizer(optimizer_class, params, tiers=tiers, **extra, **optimizer_kwargs)
