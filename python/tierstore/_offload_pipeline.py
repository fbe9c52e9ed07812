"""The order of work in one pipelined step of the offloaded optimizer.

The subgroups are updated in ``order`` (which alternates every step). While
one is updated, the next ones are read ahead as far as the host budget
allows and the updated ones are written back; the last subgroups of the
order that fit the budget stay resident, since the next step (walking the
other way) starts with them. A subgroup resident now but not wanted until
much later is written back first, making room for the reads this step needs
soon. The write-backs finish during the next forward and backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tierstore._offload_store import HostMemory, SubgroupStore
from tierstore._offload_subgroup import Subgroup


def step_pipelined(
    store: SubgroupStore,
    memory: HostMemory,
    order: list[Subgroup],
    update: Callable[[Subgroup], None],
    stats: dict[str, float],
) -> None:
    """Runs ``update`` on every subgroup of ``order`` once it is resident;
    the time spent waiting for reads is added to ``stats["wait_s"]``."""
    keep = _kept(order, store.keep_budget())
    nxt = 0  # next position in `order` to read ahead
    for pos, sg in enumerate(order):
        nxt = max(nxt, pos)
        nxt = _read_ahead(store, memory, order, nxt)
        t0 = time.perf_counter()
        while True:
            f = sg.writing or sg.reading
            if f is not None:
                if f is sg.writing:
                    store.want(sg)
                if f.done():
                    store.settle(sg)
                    continue
            elif sg.resident:
                break
            elif memory.try_reserve(sg.nbytes, force=memory.writes_in_flight == 0):
                # Not started for lack of room; there is room now (or
                # nothing in flight will make any: the working minimum).
                store.start_read(sg)
                continue
            memory.wait()
            nxt = _read_ahead(store, memory, order, nxt)
        stats["wait_s"] += time.perf_counter() - t0
        sg.wanted = False
        update(sg)
        if sg.index not in keep:
            store.start_write(sg)
        for done in order[: pos + 1]:  # a failed write-back raises here, not a step later
            f = done.writing
            if f is not None and f.done() and f.exception() is not None:
                store.settle(done)


def _kept(order: list[Subgroup], room: int) -> set[int]:
    """The subgroups that stay resident for the next step: from the end of
    ``order``, each that fits in what is left of ``room`` bytes (the tail
    need not be contiguous: smaller ones may still fit)."""
    keep: set[int] = set()
    for sg in reversed(order):
        size = sg.nbytes if sg.inner is not None else 3 * sg.nbytes  # state is created in the first step
        if size <= room:
            keep.add(sg.index)
            room -= size
    return keep


def _read_ahead(store: SubgroupStore, memory: HostMemory, order: list[Subgroup], nxt: int) -> int:
    """Starts reads of ``order[nxt:]`` while the budget has room; returns
    the first position not started."""
    while nxt < len(order):
        sg = order[nxt]
        if sg.writing is not None and sg.writing.done():
            store.settle(sg)
        if sg.writing is not None and not store.want(sg):
            break  # written back and let go: read it once the write is done
        if sg.resident or sg.reading is not None:
            nxt += 1
            continue
        if not memory.try_reserve(sg.nbytes):
            break
        store.start_read(sg)
        nxt += 1
    return nxt
