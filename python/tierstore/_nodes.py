"""Which node each rank runs on, for tiers whose contents are local to a node
(``DiskTier(scope="node")``).

A process's node name is ``TIERSTORE_NODE`` when set (an override: tests
simulate nodes on one machine with it), else ``node<GROUP_RANK>`` as
torchrun sets it, else the host name. Rank 0 gathers the names once and
tells each rank its node's index, whether it is its node's leader (the
lowest rank there) and how many nodes there are; no rank receives the
others' names.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from tierstore._dist import gather, scatter

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def node_name() -> str:
    """This process's node name, made safe for a path component."""
    name = os.environ.get("TIERSTORE_NODE") or ""
    if not name and os.environ.get("GROUP_RANK", "").isdigit():
        name = f"node{int(os.environ['GROUP_RANK'])}"
    if not name:
        name = socket.gethostname() or "node"
    name = _SAFE.sub("_", name)[:100]
    return name if name not in ("", ".", "..") else "node"


@dataclass(frozen=True)
class Node:
    """This rank's node: its name and index (nodes numbered in the order of
    their lowest rank), whether this rank leads it, the number of nodes, and
    (on rank 0 only) the rank that leads each node."""

    name: str
    index: int
    leader: bool
    count: int
    leader_ranks: tuple[int, ...] = ()
    #: On rank 0 only: per node (by index), its name and its ranks as
    #: [first, last] runs (what a checkpoint records of where files are).
    ranks: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()


def find_node(world: int, pg: Any) -> Node:
    """This rank's :class:`Node` (one gather of names to rank 0, one scatter)."""
    me = node_name()
    names = gather(me, world, pg)
    told: list[Any] | None = None
    firsts: list[int] = []
    runs: list[tuple[str, list[list[int]]]] = []
    if names is not None:
        order: dict[str, int] = {}
        marks = []
        for r, n in enumerate(names):
            if n not in order:
                order[n] = len(order)
                firsts.append(r)
                runs.append((n, []))
            i = order[n]
            marks.append(i)
            got = runs[i][1]
            if got and got[-1][1] == r - 1:
                got[-1][1] = r
            else:
                got.append([r, r])
        lead = set(firsts)
        told = [(i, r in lead, len(order)) for r, i in enumerate(marks)]
    index, leader, count = scatter(told, world, pg)
    ranks = tuple((n, tuple((a, b) for a, b in rs)) for n, rs in runs)
    return Node(me, int(index), bool(leader), int(count), tuple(firsts), ranks)
