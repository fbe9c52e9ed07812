"""The few torch.distributed steps tierstore takes: who this rank is in a
group, a gather of small Python objects to rank 0, a scatter and a broadcast
from it, an agreement on a flag, a barrier. With one process (no
initialized process group) they are no-ops.

No step sends one rank's metadata to every rank: what a rank sends and
receives grows with what it holds, not with the number of ranks (a job of
16,384 ranks must not all-gather). :func:`traffic` counts the bytes each
step moves, for tests and the scale benchmark.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tierstore.errors import TierstoreError


def group_info(pg: Any) -> tuple[int, int, Any]:
    """``(rank, world size, group)`` of ``pg`` (default: the whole world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(pg), dist.get_world_size(pg), pg
    if pg is not None:
        raise TierstoreError("a process group was given but torch.distributed is not initialised")
    return 0, 1, None


def side_groups(pg: Any, n: int, world: int, timeout_s: float) -> list[Any]:
    """``n`` gloo groups of the ranks of ``pg`` (None: the whole world), for
    collectives that run off the training thread and give up after
    ``timeout_s`` seconds (a rank that died fails them instead of hanging
    the others); ``[None] * n`` with one process."""
    if world <= 1:
        return [None] * n
    from datetime import timedelta

    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(pg) if pg is not None else None
    to = timedelta(seconds=timeout_s)
    return [dist.new_group(ranks, backend="gloo", timeout=to) for _ in range(n)]


@dataclass
class Traffic:
    """Bytes this rank sent and received through the steps below (pickled
    sizes, as torch.distributed's object collectives send them), per step."""

    sent: int = 0
    received: int = 0
    steps: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, what: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.steps.append((what, sent, received))


_traffic: list[Traffic] = []


@contextlib.contextmanager
def traffic() -> Iterator[Traffic]:
    """Counts the bytes of every step this process takes inside the block."""
    t = Traffic()
    _traffic.append(t)
    try:
        yield t
    finally:
        _traffic.remove(t)


def _count(what: str, sent: int, received: int) -> None:
    for t in _traffic:
        t.add(what, sent, received)


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj)) if _traffic else 0


def _root(pg: Any) -> int:
    """The global rank of the group's rank 0."""
    import torch.distributed as dist

    return 0 if pg is None else dist.get_global_rank(pg, 0)


def gather(obj: Any, world: int, pg: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order, on the group's rank 0 (None elsewhere)."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=_root(pg), group=pg)
    if rank == 0:
        assert out is not None
        _count("gather", 0, sum(_size(o) for o in out[1:]))
    else:
        _count("gather", _size(obj), 0)
    return out


def scatter(objs: list[Any] | None, world: int, pg: Any) -> Any:
    """Rank 0's ``objs[r]`` on each rank ``r`` (``objs`` is read on rank 0 only)."""
    if world == 1:
        assert objs is not None
        return objs[0]
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    out: list[Any] = [None]
    dist.scatter_object_list(out, objs if rank == 0 else None, src=_root(pg), group=pg)
    if rank == 0:
        assert objs is not None
        _count("scatter", sum(_size(o) for o in objs[1:]), 0)
    else:
        _count("scatter", 0, _size(out[0]))
    return out[0]


def broadcast(obj: Any, world: int, pg: Any) -> Any:
    """Rank 0's ``obj`` on every rank (keep it small: every rank receives it)."""
    if world == 1:
        return obj
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=_root(pg), group=pg)
    n = _size(box[0])
    _count("broadcast", n * (world - 1) if rank == 0 else 0, 0 if rank == 0 else n)
    return box[0]


def all_true(flag: bool, world: int, pg: Any) -> bool:
    """Whether ``flag`` holds on every rank (one integer reduced, whatever
    the number of ranks)."""
    if world == 1:
        return flag
    import torch
    import torch.distributed as dist

    dev = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
    _count("all_true", 4, 4)
    return bool(t.item())


def all_max(values: list[int], world: int, pg: Any) -> list[int]:
    """The element-wise maximum of ``values`` (int64s, the same length on
    every rank) over the ranks: one small all-reduce."""
    if world == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    dev = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    _count("all_max", 8 * len(values), 8 * len(values))
    return [int(x) for x in t.tolist()]


def barrier(world: int, pg: Any) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=pg)


def exchange(parts: list[Any] | None, world: int, pg: Any) -> list[Any] | None:
    """Sends ``parts[r]`` (a 2-D numpy array; every rank uses the same dtype
    and row width) to rank ``r`` and returns, in rank order, what each rank
    sent this one: two all-to-alls, one of row counts and one of the rows,
    so a rank sends and receives what it exchanges plus one integer per rank.
    A rank that passes None (it failed before its part) sends nothing; then
    every rank gets None and no further collective is made, so a rank that
    failed never leaves the others waiting."""
    if world == 1:
        return None if parts is None else [parts[0]]
    import numpy as np
    import torch
    import torch.distributed as dist

    dev = "cuda" if dist.get_backend(pg) == "nccl" else "cpu"
    counts = [-1] * world if parts is None else [len(p) for p in parts]
    sent = torch.tensor(counts, dtype=torch.int64, device=dev)
    got = torch.empty(world, dtype=torch.int64, device=dev)
    dist.all_to_all_single(got, sent, group=pg)
    _count("exchange counts", 8 * world, 8 * world)
    got_counts = [int(x) for x in got.tolist()]
    if parts is None or min(got_counts) < 0:
        return None
    width = parts[0].shape[1] if parts[0].ndim == 2 else 1
    dtype = parts[0].dtype
    flat = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)).reshape(-1)).to(dev)
    out = torch.empty(sum(got_counts) * width, dtype=flat.dtype, device=dev)
    dist.all_to_all_single(
        out,
        flat,
        output_split_sizes=[c * width for c in got_counts],
        input_split_sizes=[c * width for c in counts],
        group=pg,
    )
    rows = out.cpu().numpy().reshape(-1, width).astype(dtype, copy=False)
    _count("exchange", flat.numel() * flat.element_size(), out.numel() * out.element_size())
    ends = np.cumsum(got_counts)
    return [rows[e - c : e] for c, e in zip(got_counts, ends.tolist(), strict=True)]
