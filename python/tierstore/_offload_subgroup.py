"""A subgroup of an offloaded optimizer: the parameters updated together,
whose fp32 masters and optimizer state live in one flat, page-padded buffer
(resident in host memory, or in a file on one of the disk paths).

Its lifecycle (:class:`Residence`, derived from what it holds so that it can
never disagree with it): ``ON_DISK`` (no buffer, a file) → ``READING`` (a read
in flight into a buffer not yet attached) → ``RESIDENT`` (a buffer; ``dirty``
once the step changed it) → ``WRITING`` (a write-back in flight; ``wanted``
keeps it resident after the write) → ``ON_DISK`` again, or ``RESIDENT`` when
wanted. A transfer starts only from a state that allows it (:data:`MOVES`,
checked by :meth:`Subgroup.move`).
A file linked by a checkpoint (``pinned``) is never rewritten in place: the
next write-back goes to a new ``generation``.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore._offload_io import StoragePath
from tierstore.errors import InternalError

PAGE = 4096
ALIGN = 64  # of each tensor in the flat buffer

# layout entry: (index of the parameter in the subgroup, state key or None for
# the master, byte offset, byte length, dtype, shape)
Entry = tuple[int, str | None, int, int, torch.dtype, tuple[int, ...]]


class Residence(enum.Enum):
    NEW = "new"  # packed neither in memory nor on disk yet
    ON_DISK = "on disk"
    READING = "reading"
    RESIDENT = "resident"
    WRITING = "writing back"


# The moves a subgroup may make (a read or write-back starts only from the
# state it leaves; a load in the training thread goes straight from disk to
# resident; a write-back ends resident when the step wanted it again).
MOVES: dict[Residence, frozenset[Residence]] = {
    Residence.NEW: frozenset({Residence.RESIDENT}),
    Residence.ON_DISK: frozenset({Residence.READING, Residence.RESIDENT}),
    Residence.READING: frozenset({Residence.RESIDENT, Residence.ON_DISK}),
    Residence.RESIDENT: frozenset({Residence.WRITING, Residence.ON_DISK}),
    Residence.WRITING: frozenset({Residence.ON_DISK, Residence.RESIDENT}),
}


def split_master(
    p: torch.Tensor, master: torch.Tensor, lo: torch.Tensor, threads: int, hi_out: torch.Tensor | None = None
) -> None:
    """Stores fp32 ``master``: its low halves into ``lo``, its rounded high
    halves into the bf16 parameter ``p`` (or into the host tensor ``hi_out``,
    which the caller copies into ``p``)."""
    n = master.numel()
    src = master.detach().contiguous()
    direct = p.device.type == "cpu" and p.dtype == torch.bfloat16 and p.is_contiguous()
    hi = hi_out if hi_out is not None else (p.detach() if direct else torch.empty(n, dtype=torch.bfloat16))
    _core.split_halves(src.data_ptr(), hi.data_ptr(), lo.data_ptr(), n, threads)
    if not direct and hi_out is None:
        p.detach().copy_(hi.view(p.shape))


def join_master(
    p: torch.Tensor, lo: torch.Tensor, out: torch.Tensor, threads: int, hi: torch.Tensor | None = None
) -> None:
    """Rebuilds the fp32 master into ``out`` from the parameter's high halves
    (or their host copy ``hi``) and the stored low halves."""
    if hi is None:
        hi = p.detach()
    if hi.device.type != "cpu" or hi.dtype != torch.bfloat16 or not hi.is_contiguous():
        hi = hi.to("cpu", torch.bfloat16).contiguous()
    _core.join_halves(hi.data_ptr(), lo.data_ptr(), out.data_ptr(), out.numel(), threads)


class Subgroup:
    def __init__(self, index: int, group: int, params: list[torch.Tensor], first: int) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.first = first  # index of its first parameter among all parameters
        self.masters: list[torch.Tensor] = []
        self.inner: torch.optim.Optimizer | None = None
        self.buf: torch.Tensor | None = None  # resident flat bytes
        self.layout: list[Entry] = []
        self.nbytes = 0
        self.path: StoragePath | None = None
        self.file: Path | None = None
        self.home: StoragePath | None = None  # where it is written back (counted in that path's `stored`)
        self.home_bytes = 0
        self.crc = 0
        self.dirty = True  # resident and changed since its file was written
        self.reading: Future[None] | None = None
        self.writing: Future[None] | None = None
        self.pinned = False  # its file is linked by a checkpoint: rewrite elsewhere
        self.wanted = False  # stays resident after its write-back in flight
        self.generation = 0
        self.numel = sum(p.numel() for p in params)
        # Split masters: the layout's master entries hold only the low 16 bits
        # of each fp32 master; the high 16 bits are the bf16 parameter itself.
        self.split = False

    @property
    def resident(self) -> bool:
        return self.buf is not None

    @property
    def state(self) -> Residence:
        if self.writing is not None:
            return Residence.WRITING
        if self.reading is not None:
            return Residence.READING
        if self.buf is not None:
            return Residence.RESIDENT
        return Residence.ON_DISK if self.file is not None else Residence.NEW

    def move(self, to: Residence) -> None:
        """Refuses a move the lifecycle does not allow from the current state
        (:data:`MOVES`); the move itself is made by what the subgroup then
        holds (a buffer, a file, a transfer in flight)."""
        now = self.state
        if to not in MOVES[now]:
            raise InternalError(f"offload subgroup {self.index} is {now.value}: it cannot become {to.value}")

    # --- the flat buffer's layout

    def tensors(self) -> list[tuple[int, str | None, torch.Tensor]]:
        """(parameter index, state key or None for the master, tensor), in layout order."""
        out: list[tuple[int, str | None, torch.Tensor]] = []
        for i, m in enumerate(self.masters):
            out.append((i, None, m))
            if self.inner is not None:
                st = self.inner.state.get(m, {})
                for k in sorted(st):
                    if isinstance(st[k], torch.Tensor):
                        out.append((i, k, st[k]))
        return out

    def plan(self, items: list[tuple[int, str | None, torch.Tensor]]) -> tuple[list[Entry], int]:
        """The layout of ``items`` in one buffer and its page-padded size."""
        layout: list[Entry] = []
        off = 0
        for i, k, t in items:
            dt = torch.int16 if k is None and self.split else t.dtype  # low halves of the masters
            n = t.numel() * dt.itemsize
            off = -(-off // ALIGN) * ALIGN
            layout.append((i, k, off, n, dt, tuple(t.shape)))
            off += n
        return layout, -(-max(off, 1) // PAGE) * PAGE

    def fill(
        self, buf: torch.Tensor, layout: list[Entry], items: list[tuple[int, str | None, torch.Tensor]], threads: int
    ) -> None:
        """Copies ``items`` into ``buf`` as ``layout`` places them."""
        for (i, k, o, n, dt, shape), (_i, _k, t) in zip(layout, items, strict=True):
            if k is None and self.split:
                split_master(self.params[i], t, buf[o : o + n].view(dt), threads)
            else:
                buf[o : o + n].view(dt).view(shape).copy_(t)

    def attach(self, buf: torch.Tensor) -> None:
        """Points masters and state tensors at views of ``buf``."""
        self.buf = buf
        for i, k, o, n, dt, shape in self.layout:
            v = buf[o : o + n].view(dt).view(shape)
            if k is None:
                if not self.split:  # split masters are rebuilt for each update
                    self.masters[i].data = v
            else:
                assert self.inner is not None
                self.inner.state[self.masters[i]][k] = v

    def detach(self) -> torch.Tensor | None:
        """Lets go of the views of the buffer; returns the buffer (for reuse)."""
        empty = torch.empty(0)
        for i, k, *_ in self.layout:
            if k is None:
                self.masters[i].data = empty
            else:
                assert self.inner is not None
                self.inner.state[self.masters[i]][k] = empty
        buf, self.buf = self.buf, None
        return buf

    # --- split masters: the low halves in the layout, the high halves in the bf16 parameters

    def low_halves(self) -> list[torch.Tensor]:
        """Views of the stored low halves of the split subgroup's masters, in parameter order."""
        assert self.buf is not None
        buf = self.buf
        return [buf[o : o + n].view(torch.int16) for _i, k, o, n, _dt, _shape in self.layout if k is None]

    def drop_masters(self) -> None:
        """Lets go of a split subgroup's fp32 masters (rebuilt for each update)."""
        empty = torch.empty(0)
        for m in self.masters:
            m.data = empty

    def rebuild_masters(
        self, threads: int, into: torch.Tensor | None = None, his: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The split subgroup's fp32 masters, rebuilt into views of ``into``
        (default: new tensors), from the parameters or their host copies ``his``."""
        out: list[torch.Tensor] = []
        off = 0
        for i, (p, lo) in enumerate(zip(self.params, self.low_halves(), strict=True)):
            m = torch.empty(p.shape) if into is None else into[off : off + p.numel()].view(p.shape)
            join_master(p, lo, m, threads, None if his is None else his[i])
            out.append(m)
            off += p.numel()
        return out

    def store_split(self, threads: int, his: list[torch.Tensor] | None = None) -> None:
        """Stores the updated fp32 masters split: low halves into the layout,
        high halves into the parameters (or into host tensors ``his`` that
        the caller copies into them)."""
        for i, (p, m, lo) in enumerate(zip(self.params, self.masters, self.low_halves(), strict=True)):
            split_master(p, m, lo, threads, None if his is None else his[i])

    # --- the wrapped optimizer on this subgroup

    def take_grads(self, scratch: torch.Tensor, grads: list[torch.Tensor | None] | None = None) -> None:
        """Gives each master its parameter's gradient (or ``grads[i]``, its
        host copy): an fp32 CPU gradient as it is, any other converted to fp32
        into ``scratch`` (one reused buffer of at least ``numel`` elements: the
        only conversion)."""
        off = 0
        for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
            g = p.grad if grads is None else grads[i]
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

    def ensure_inner(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], hyper: dict[str, Any]) -> None:
        if self.inner is None:
            self.inner = cls([{"params": self.masters, **hyper}], **kwargs)

    def objects(self) -> dict[str, dict[str, Any]]:
        """Non-tensor state values (kept in memory), by parameter index in the subgroup."""
        out: dict[str, dict[str, Any]] = {}
        if self.inner is None:
            return out
        for i, m in enumerate(self.masters):
            st = self.inner.state.get(m, {})
            o = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
            if o:
                out[str(i)] = o
        return out


def partition(param_groups: list[dict[str, Any]], subgroup_bytes: int) -> list[Subgroup]:
    """Consecutive parameters of a group, about ``subgroup_bytes`` of master
    and AdamW-sized state (12 bytes per parameter) each."""
    subgroups: list[Subgroup] = []
    first = 0
    for gi, g in enumerate(param_groups):
        cur: list[torch.Tensor] = []
        size = 0
        for p in g["params"]:
            need = 12 * p.numel()
            if cur and size + need > subgroup_bytes:
                subgroups.append(Subgroup(len(subgroups), gi, cur, first))
                first += len(cur)
                cur, size = [], 0
            cur.append(p)
            size += need
        if cur:
            subgroups.append(Subgroup(len(subgroups), gi, cur, first))
            first += len(cur)
    return subgroups
