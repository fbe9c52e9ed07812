"""The few torch.distributed steps tierstore takes: who this rank is in a
group, an all-gather of small Python objects, a barrier. With one process
(no initialized process group) they are no-ops."""

from __future__ import annotations

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


def all_gather(obj: Any, world: int, pg: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=pg)
    return out


def barrier(world: int, pg: Any) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=pg)
