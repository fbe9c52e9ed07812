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

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore import _core, _paths
from tierstore._dist import scatter
from tierstore._engine import get_engine
from tierstore._fs import fsync_dir, make_dir
from tierstore._nodes import Node
from tierstore.errors import TierstoreError

# Files move in pieces of at most this many bytes (one tensor each).
PIECE = 32 << 20
MANIFEST = "manifest.json"


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


def exchange(sends: list[tuple[int, list[tuple[str, Path]]]], recvs: list[int], pg: Any, into: Path) -> int:
    """Sends each ``(rank, [(name, path)])`` its files and receives the files
    each rank of ``recvs`` sends here into directory ``into`` (each name
    confined to it; written through a temporary name, fsynced, renamed;
    ``manifest.json`` renamed last). Returns the bytes received.

    Files are read by the engine in the background class (the Checkpointer's
    ``rate_limit`` applies) and move in pieces of at most :data:`PIECE`
    bytes, never whole: memory
    stays one piece per destination and per source whatever the files'
    sizes. Point to point, in rounds: round ``j`` posts every rank's ``j``-th
    piece to each destination and the receives of each source's ``j``-th
    piece, then waits for them, so that no ring of senders waits on itself.
    """
    import torch
    import torch.distributed as dist

    def glob(r: int) -> int:
        return dist.get_global_rank(pg, r) if pg is not None else r

    def wait(works: list[Any]) -> None:
        for w in works:
            if w is not None:
                w.wait()

    # Round 0: the file lists (names, sizes).
    heads = {dst: json.dumps([(name, p.stat().st_size) for name, p in files]).encode() for dst, files in sends}
    lens = {src: torch.zeros(1, dtype=torch.int64) for src in recvs}
    keep: list[Any] = [torch.tensor([len(h)], dtype=torch.int64) for h in heads.values()]
    works = [dist.isend(t, glob(dst), group=pg) for t, dst in zip(keep, heads, strict=True)]
    works += [dist.irecv(lens[src], glob(src), group=pg) for src in recvs]
    wait(works)
    for src, hl in lens.items():
        if not 0 < int(hl.item()) < 1 << 30:
            raise TierstoreError(f"rank {src} sent a replica header of {int(hl.item())} bytes")
    hbufs = {src: torch.empty(int(lens[src].item()), dtype=torch.uint8) for src in recvs}
    keep = [torch.frombuffer(bytearray(h), dtype=torch.uint8) for h in heads.values()]
    works = [dist.isend(t, glob(dst), group=pg) for t, dst in zip(keep, heads, strict=True)]
    works += [dist.irecv(hbufs[src], glob(src), group=pg) for src in recvs]
    wait(works)
    listings: dict[int, list[tuple[str, int]]] = {}
    for src, hb in hbufs.items():
        try:
            listing = json.loads(hb.numpy().tobytes())
            sizes = [(str(name), int(size)) for name, size in listing]
        except (ValueError, TypeError) as e:
            raise TierstoreError(f"rank {src} sent a replica header that is not a file list ({e})") from None
        for name, size in sizes:
            if not 0 <= size < 1 << 44:
                raise TierstoreError(f"rank {src} sent a replica of {name[:100]!r} of {size} bytes")
        listings[src] = sizes

    # The pieces each destination gets and each source sends, in order.
    def pieces(files: list[tuple[Any, int]]) -> list[tuple[Any, int, int]]:
        return [(f, a, min(PIECE, size - a)) for f, size in files for a in range(0, size, PIECE)]

    out_pieces = {dst: pieces([(p, p.stat().st_size) for _name, p in files]) for dst, files in sends}
    in_pieces = {src: pieces([(i, n) for i, (_name, n) in enumerate(sizes)]) for src, sizes in listings.items()}
    # Where each received file goes: its temporary name, then its own.
    paths = {
        src: [_paths.member(into, name, source=f"rank {src}", field="replica") for name, _size in sizes]
        for src, sizes in listings.items()
    }
    if listings:
        make_dir(into, durable=True)
    temps: dict[tuple[int, int], Any] = {}
    done: list[tuple[Path, Path]] = []
    total = 0
    try:
        for src, sizes in listings.items():
            for i, (_name, size) in enumerate(sizes):
                p = paths[src][i]
                tmp = p.with_name(f".{p.name}.replica.{os.getpid()}.{src}.{i}")
                f = open(tmp, "wb")  # noqa: SIM115 - closed below, after its last piece
                temps[(src, i)] = (f, tmp)
                if size == 0:
                    done.append((tmp, p))
        rounds = max([len(v) for v in (*out_pieces.values(), *in_pieces.values())], default=0)
        for j in range(rounds):
            read: dict[tuple[Path, int], torch.Tensor] = {}
            works, keep = [], []
            for dst, ps in out_pieces.items():
                if j < len(ps):
                    path, a, n = ps[j]
                    t = read.get((path, a))
                    if t is None:
                        # Read by the engine in the background class: the
                        # Checkpointer's rate limit applies, foreground loads go first.
                        t = read[(path, a)] = torch.empty(n, dtype=torch.uint8)
                        got_n = _core.transfer_ranges(get_engine(), path, [a], [n], [t.data_ptr()], background=True)
                        if got_n != n:
                            raise TierstoreError(f"{path}: shorter than its listing while sent as a replica")
                    keep.append(t)
                    works.append(dist.isend(t, glob(dst), group=pg))
            got: list[tuple[int, int, torch.Tensor]] = []
            for src, ps in in_pieces.items():
                if j < len(ps):
                    i, _a, n = ps[j]
                    t = torch.empty(n, dtype=torch.uint8)
                    got.append((src, i, t))
                    works.append(dist.irecv(t, glob(src), group=pg))
            wait(works)
            for src, i, t in got:
                f, tmp = temps[(src, i)]
                f.write(t.numpy().data)
                total += t.numel()
                last = in_pieces[src][j]
                if last[1] + last[2] == listings[src][i][1]:  # the file's last piece
                    done.append((tmp, paths[src][i]))
        for f, _tmp in temps.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        # Every file in place, manifest.json last, then the directory's entries.
        done.sort(key=lambda x: x[1].name == MANIFEST)
        for tmp, p in done:
            os.replace(tmp, p)
        if done:
            fsync_dir(into)
    finally:
        for f, tmp in temps.values():
            f.close()
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return total
