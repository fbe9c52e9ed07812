"""Peer replicas of a node-scoped tier (``DiskTier(scope="node",
replicas=k)``): each node's part of a checkpoint is also copied to the local
tier of the next ``k`` nodes in a ring (so that any ``k`` lost nodes leave a
copy of every part), and a node that lost its copy gets its ranks' files
back from a peer before a restore.

Bytes move over the job's own process group, point to point
(``torch.distributed`` ``isend``/``irecv`` of byte tensors: gloo on CPU),
never through home-made networking. The placement is fixed when the
Checkpointer starts: rank 0, which knows every rank's node, tells each rank
to whom it sends its files at each ring distance and from whom it receives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore._dist import scatter
from tierstore._nodes import Node
from tierstore.errors import TierstoreError

# Files move in pieces of at most this many bytes (one tensor each).
PIECE = 64 << 20


@dataclass(frozen=True)
class Ring:
    """This rank's part of the replica ring: ``send_to[s]`` is the rank that
    keeps a replica of this rank's files at ring distance ``s + 1``;
    ``recv_from[s]`` the ranks whose files this rank keeps at that distance."""

    send_to: tuple[int, ...]
    recv_from: tuple[tuple[int, ...], ...]
    #: On rank 0 only: every rank's ``send_to`` (who keeps its replicas).
    table: tuple[tuple[int, ...], ...] = ()


def ring(node: Node, replicas: int, world: int, pg: Any) -> Ring:
    """Every rank's :class:`Ring` for ``replicas`` copies (one scatter from
    rank 0). The j-th rank of node i sends to the j-th rank (modulo its
    size) of node i + s, s = 1..replicas."""
    told: list[Any] | None = None
    if node.ranks:  # rank 0
        nodes = [[r for a, b in runs for r in range(a, b + 1)] for _name, runs in node.ranks]
        n = len(nodes)
        k = min(replicas, n - 1)
        send: list[list[int]] = [[] for _ in range(world)]
        recv: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(world)]
        for i, ranks in enumerate(nodes):
            for s in range(1, k + 1):
                peers = nodes[(i + s) % n]
                for j, r in enumerate(ranks):
                    p = peers[j % len(peers)]
                    send[r].append(p)
                    recv[p][s - 1].append(r)
        told = [(tuple(send[r]), tuple(tuple(x) for x in recv[r])) for r in range(world)]
    got = scatter(told, world, pg)
    table = tuple(t[0] for t in told) if told is not None else ()
    return Ring(tuple(got[0]), tuple(tuple(x) for x in got[1]), table)


def own_files(d: Path, rank: int, save_id: str) -> list[str]:
    """This rank's files of the checkpoint in ``d`` (its data, objects and
    offloaded-optimizer files)."""
    return sorted(
        f
        for f in os.listdir(d)
        if (f".{save_id}." in f and f.startswith((f"rank-{rank:05d}.", f"objects-{rank:05d}.")))
        or f.startswith(f"offload-{rank:05d}.")
    )


def exchange(
    sends: list[tuple[int, list[tuple[str, Path]]]], recvs: list[int], pg: Any
) -> list[tuple[int, list[tuple[str, bytes]]]]:
    """Sends each ``(rank, [(name, path)])`` its files and receives the files
    each rank of ``recvs`` sends here, point to point (all sends posted
    before the receives, so a ring does not wait on itself)."""
    import torch
    import torch.distributed as dist

    def glob(r: int) -> int:
        return dist.get_global_rank(pg, r) if pg is not None else r

    def recv(t: Any, src: int) -> None:
        w = dist.irecv(t, glob(src), group=pg)
        if w is not None:
            w.wait()

    works = []
    keep: list[Any] = []
    for dst, files in sends:
        head = json.dumps([(name, p.stat().st_size) for name, p in files]).encode()
        for t in (torch.tensor([len(head)], dtype=torch.int64), torch.frombuffer(bytearray(head), dtype=torch.uint8)):
            keep.append(t)
            works.append(dist.isend(t, glob(dst), group=pg))
        for _name, p in files:
            data = bytearray(p.read_bytes())
            for a in range(0, len(data), PIECE):
                t = torch.frombuffer(data, dtype=torch.uint8, offset=a, count=min(PIECE, len(data) - a))
                keep.append(t)
                works.append(dist.isend(t, glob(dst), group=pg))
    out: list[tuple[int, list[tuple[str, bytes]]]] = []
    for src in recvs:
        n = torch.zeros(1, dtype=torch.int64)
        recv(n, src)
        if not 0 < int(n.item()) < 1 << 30:
            raise TierstoreError(f"rank {src} sent a replica header of {int(n.item())} bytes")
        header = torch.empty(int(n.item()), dtype=torch.uint8)
        recv(header, src)
        try:
            listing = json.loads(header.numpy().tobytes())
            sizes = [(str(name), int(size)) for name, size in listing]
        except (ValueError, TypeError) as e:
            raise TierstoreError(f"rank {src} sent a replica header that is not a file list ({e})") from None
        got = []
        for name, size in sizes:
            if not 0 <= size < 1 << 44:
                raise TierstoreError(f"rank {src} sent a replica of {name[:100]!r} of {size} bytes")
            buf = bytearray(size)
            for a in range(0, size, PIECE):
                recv(torch.frombuffer(buf, dtype=torch.uint8, offset=a, count=min(PIECE, size - a)), src)
            got.append((str(name), bytes(buf)))
        out.append((src, got))
    for w in works:
        if w is not None:
            w.wait()
    return out
