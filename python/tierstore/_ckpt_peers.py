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
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore import _core, _metadata, _paths
from tierstore._ckpt_restore import META
from tierstore._ckpt_snapshot import Snapshot
from tierstore._dist import all_max, all_true, barrier, gather, scatter
from tierstore._engine import get_engine
from tierstore._fs import fsync_dir, make_dir, write_atomic
from tierstore._nodes import Node, find_node, node_name
from tierstore.errors import TierstoreError
from tierstore.shardmeta import MANIFEST, read_manifest
from tierstore.tiers import DiskTier

# Files move in pieces of at most this many bytes (one tensor each).
PIECE = 32 << 20


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


def node_and_ring(disks: Sequence[DiskTier], world: int, pg: Any) -> tuple[Node, Ring | None]:
    """The node this rank runs on (found with one gather and one scatter
    where some tier is node-scoped), and one ring for every node-scoped tier
    with peer replicas (each uses its first ``replicas`` distances; None
    without such a tier, or with one node)."""
    node = (
        find_node(world, pg)
        if world > 1 and any(t.scope == "node" for t in disks)
        else Node(node_name(), 0, True, 1, (0,), ((node_name(), ((0, world - 1),)),))
    )
    most = max((t.replicas for t in disks), default=0)
    return node, (ring(node, most, world, pg) if world > 1 and most and node.count > 1 else None)


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


def created_unix(d: Path) -> float:
    """When the checkpoint in ``d`` was made, from its ``checkpoint.json``
    (0 where that cannot be read: such a copy loses every tie)."""
    try:
        meta, _had = _metadata.loads(
            _paths.read_regular(_paths.member(d, META, source=str(d), field=META), 1 << 30, META),
            str(d / META),
            required=False,
        )
        t = meta.get("created_unix", 0.0)
        return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
    except (OSError, TierstoreError, ValueError):
        return 0.0


def commit_files(d: Path, m: dict[str, Any]) -> list[str]:
    """The files of a step directory that make it a copy of the
    checkpoint (not one rank's): the index, the key tree and the job-wide
    objects file, then manifest.json (written last)."""
    shared = sorted(set(m.get("objects", {}).values()))
    names = [n for n in (m.get("index", {}).get("name"), META, *shared) if n and (d / n).exists()]
    return [*names, MANIFEST]


class NodeCopies:
    """The copies of a checkpoint that the nodes of a job keep on a
    node-scoped tier, seen across the nodes: peer replicas sent around the
    ring after a save (:meth:`replicate_on`), a lost node's files brought
    back from those replicas (:meth:`repair`), and the files a node lacks
    for a restore fetched from the nodes that hold them (:meth:`fetch`).
    Every method that moves files is a collective."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        node: Node,
        ring: Ring | None,
        pg_promote: Any,
        first_disk: DiskTier | None,
        tier_paths: Callable[[DiskTier], list[Path]],
    ) -> None:
        self.rank, self.world, self.node, self.ring = rank, world, node, ring
        self.pg_promote, self.first_disk, self.tier_paths = pg_promote, first_disk, tier_paths

    def replicate_on(self, t: DiskTier, snap: Snapshot, d: Path) -> None:
        """Peer replicas of this node's copy ``d`` of a checkpoint on tier
        ``t`` (when ``t`` is node-scoped with ``replicas``); a failure is
        reported with a warning (the node's own copy and farther tiers
        still hold the checkpoint)."""
        if not (t.scope == "node" and t.replicas and self.ring is not None):
            return
        t0 = time.perf_counter()
        try:
            self.replicate(d, t.replicas)
            key = "replicate" if t is self.first_disk else f"replicate_{t.name}"
            snap.handle.timings[key] = time.perf_counter() - t0
        except (OSError, TierstoreError) as e:
            warnings.warn(f"tierstore: step {snap.step}: peer replicas on tier {t.name!r} not made ({e})", stacklevel=1)

    def replicate(self, d: Path, k: int) -> None:
        """Copies this rank's files of the node-local checkpoint ``d`` to its
        ``k`` nearest ring peers' copies of the same step, and keeps there
        the files of the ranks whose peer it is (node leaders send the
        commit too)."""
        assert self.ring is not None
        m = read_manifest(d)
        files = [(f, d / f) for f in own_files(d, self.rank, m["save_id"])]
        if self.node.leader:
            files += [(n, d / n) for n in commit_files(d, m) if n not in {f for f, _p in files}]
        sends = [(dst, files) for dst in self.ring.send_to[:k]]
        recvs = [src for srcs in self.ring.recv_from[:k] for src in srcs]
        exchange(sends, recvs, self.pg_promote, d)
        barrier(self.world, self.pg_promote)

    def keep_received(self, d: Path, got: list[tuple[int, list[tuple[str, bytes]]]]) -> int:
        """Writes files received from other ranks (a commit, peer replicas)
        into this node's step directory ``d`` (each name confined to it;
        manifest.json last). Returns the bytes."""
        make_dir(d, durable=True)
        last: list[tuple[Path, bytes]] = []
        n = 0
        for src, files in got:
            for name, data in files:
                p = _paths.member(d, name, source=f"rank {src}", field="replica")
                n += len(data)
                if name == MANIFEST:
                    last.append((p, data))
                else:
                    write_atomic(p, data, durable=True)
        for p, data in last[:1]:
            write_atomic(p, data, durable=True)
        return n

    def step_dir(self, t: DiskTier, step: int) -> Path:
        """This rank's directory of ``step`` on tier ``t`` (where it is, else
        where the first path would hold it)."""
        name = f"step-{step:012d}"
        for p in self.tier_paths(t):
            if (p / name).is_dir():
                return p / name
        return self.tier_paths(t)[0] / name

    def _holds_own(self, d: Path) -> bool:
        """Whether this node's copy ``d`` is committed and holds this rank's files."""
        try:
            m = read_manifest(d)
        except (OSError, TierstoreError):
            return False
        names = [f["name"] for f in m["files"] if f["rank"] == self.rank] if len(m["files"]) <= 4096 else []
        names += [o["name"] for o in m.get("object_files", ()) if o["name"].startswith(f"objects-{self.rank:05d}.")]
        return all((d / n).is_file() for n in names) and bool(own_files(d, self.rank, m["save_id"]) or not names)

    def repair(self, t: DiskTier, step: int, pg: Any) -> int:
        """Before a restore of ``step`` from node-scoped tier ``t`` with peer
        replicas: each rank whose node lost its copy of the rank's files (a
        replaced node) gets them, and the commit, back from the peer that
        keeps their replica, into its node's copy. Returns the bytes this
        rank received."""
        if not (t.scope == "node" and t.replicas and self.ring is not None and self.world > 1):
            return 0
        d = self.step_dir(t, step)
        mine = self._holds_own(d)
        if all_true(mine, self.world, pg):
            return 0  # every node holds its ranks' files: one all-reduce, nothing moves
        flags = gather(mine, self.world, pg)
        plan: list[Any] | None = None
        if flags is not None:
            missing = {r for r, ok in enumerate(flags) if not ok}
            sends: list[list[tuple[int, bool]]] = [[] for _ in range(self.world)]
            froms: list[int | None] = [None] * self.world
            leaders = set(self.node.leader_ranks)
            for r in sorted(missing):
                holder = next((h for h in self.ring.table[r][: t.replicas] if h not in missing), None)
                if holder is not None:
                    sends[holder].append((r, r in leaders))  # a node's leader gets the commit too
                    froms[r] = holder
            plan = [(sends[r], froms[r]) for r in range(self.world)]
        mine_sends, holder = scatter(plan, self.world, pg)
        out: list[tuple[int, list[tuple[str, Path]]]] = []
        if mine_sends:
            m = read_manifest(d)
            commit = [(n, d / n) for n in commit_files(d, m)]
            for r, lead in mine_sends:
                out.append((r, [(f, d / f) for f in own_files(d, r, m["save_id"])] + (commit if lead else [])))
        n = exchange(out, [holder] if holder is not None else [], pg, d)
        barrier(self.world, pg)
        return n

    def fetch(
        self, t: DiskTier, step: int, needed: Callable[[Path], set[str] | None], sees_other: bool, pg: Any
    ) -> tuple[int, bool]:
        """Before a restore of ``step`` from node-scoped tier ``t``: the files
        this node's ranks need (``needed(d)`` on the node's copy ``d``; None:
        all) and its copy lacks are copied from the nodes whose copies hold
        them, over the job's process group (a resharding restore reads
        other nodes' files from those nodes, not from a farther tier). A
        node with no copy of the step (or another save's) whose ranks see no
        other copy of it (``sees_other``: a farther tier's) first gets the
        commit from a peer. Collective: every rank calls it for the same
        steps; where no rank misses anything and every node's copy is the
        same save it costs one small all-reduce. Returns the bytes this rank
        received and whether this node's copy may be read (False: it holds
        another save of the step, a stale or foreign copy, which the
        restore must not mix with the others)."""
        if not (t.scope == "node" and self.world > 1 and self.node.count > 1):
            return 0, True
        d = self.step_dir(t, step)
        got = 0
        usable = True
        for _round in range(2):  # a second round only after a node got the commit
            try:
                m: dict[str, Any] | None = read_manifest(d)
            except (OSError, TierstoreError):
                m = None
            want: list[str] = []
            have: list[str] = []
            if m is not None:
                names = {f["name"] for f in m["files"]} | {o["name"] for o in m.get("object_files", ())}
                need = needed(d)
                want = sorted(n for n in (names if need is None else need & names) if not (d / n).is_file())
                if self.node.leader:
                    have = sorted(n for n in names if (d / n).is_file())
            sid = m["save_id"] if m is not None else None
            if _round == 0:
                h = zlib.crc32(str(sid).encode()) if sid is not None else None
                lo, hi = -(1 << 62), 1 << 62
                short = int(bool(want) or (m is None and not sees_other))
                n, top, neg_bottom = all_max([short, h if h is not None else lo, -(h if h is not None else hi)],
                                             self.world, pg)  # fmt: skip
                if n == 0 and (top == -neg_bottom or top == lo):
                    break  # nothing missing anywhere, every copy the same save: nothing moves
            told = gather(
                (self.node.index, self.node.leader, sid, sees_other, want, have, created_unix(d)), self.world, pg
            )
            plan = self._fetch_plan(told) if told is not None else None
            kind, sends, recvs, agreed = scatter(plan, self.world, pg)
            usable = sid is None or sid == agreed
            if kind == "none":
                break
            if kind == "commit":
                out = []
                if sends and m is not None:
                    commit = [(n, d / n) for n in commit_files(d, m)]
                    out = [(r, commit) for r in sends]
                got += exchange(out, recvs, pg, d)
                barrier(self.world, pg)
                continue
            out = [
                (r, [(n, _paths.member(d, n, source=str(d / MANIFEST), field="files")) for n in ns]) for r, ns in sends
            ]
            got += exchange(out, recvs, pg, d)
            barrier(self.world, pg)
            break
        return got, usable

    def _fetch_plan(self, told: list[Any]) -> list[Any]:
        """Rank 0's side of :meth:`fetch`: per rank ``(kind, sends, recvs)``.
        ``kind`` is ``"commit"`` when a node without a copy of the agreed
        save (and no farther copy in sight) gets the commit first (``sends``:
        the ranks to send it to), ``"files"`` for the missing files
        (``sends``: ``[(rank, [names])]``), ``"none"`` when nothing moves."""
        world = self.world
        counts: dict[str, tuple[int, float]] = {}
        for _ni, _lead, sid, _o, _w, _h, created in told:
            if sid:
                n, t = counts.get(sid, (0, created))
                counts[sid] = (n + 1, max(t, created))
        if not counts:
            return [("none", [], [], None)] * world
        # The save most ranks' node copies hold; between as many, the newest
        # (a node that missed a save keeps an older one of the same step).
        agreed = max(counts, key=lambda k: counts[k])
        seen = {ni for ni, _lead, _sid, other, _w, _h, _c in told if other}
        holder = next(r for r, x in enumerate(told) if x[2] == agreed)  # any rank whose node's copy is the agreed save
        needy = [
            r for r, (ni, lead, sid, _o, _w, _h, _c) in enumerate(told) if lead and sid != agreed and ni not in seen
        ]
        if needy:
            return [
                ("commit", needy if r == holder else [], [holder] if r in needy else [], agreed) for r in range(world)
            ]
        held: dict[str, list[int]] = {}  # file -> nodes whose copy (of the agreed save) holds it
        for ni, _lead, sid, _o, _w, hv, _c in told:
            if sid == agreed:
                for n in hv:
                    held.setdefault(n, []).append(ni)
        node_ranks = [[r for a, b in runs for r in range(a, b + 1)] for _name, runs in self.node.ranks]
        asked: set[tuple[int, str]] = set()
        sends: dict[int, dict[int, list[str]]] = {}
        recvs: list[set[int]] = [set() for _ in range(world)]
        turn = 0
        for r, (ni, _lead, sid, _o, wants, _hv, _c) in enumerate(told):
            if sid != agreed:
                continue
            for n in wants:
                if (ni, n) in asked or not held.get(n):
                    continue  # another rank of the node asked for it, or no node holds it
                asked.add((ni, n))
                hn = held[n][turn % len(held[n])]
                hr = node_ranks[hn][turn % len(node_ranks[hn])]  # the reads spread over the holder's ranks
                turn += 1
                sends.setdefault(hr, {}).setdefault(r, []).append(n)
                recvs[r].add(hr)
        if not sends:
            return [("none", [], [], agreed)] * world
        return [("files", sorted(sends.get(r, {}).items()), sorted(recvs[r]), agreed) for r in range(world)]


def free_shm_copies(shm: str, dirs: Sequence[Path], checkpoints: Sequence[dict[str, Any]], host: str) -> None:
    """Removes the shared-memory tier ``shm``'s folders ``dirs`` when a tier
    other than it and the host tier holds a step at least as new as its
    newest (``checkpoints``: as :meth:`Checkpointer.checkpoints` lists
    them); else the shared-memory copy is the only one of the newest step
    and stays."""
    newest = max((c["step"] for c in checkpoints if c["tier"] == shm), default=None)
    if newest is None or not any(c["step"] >= newest for c in checkpoints if c["tier"] not in (shm, host)):
        return
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        if d.parent.name.startswith("tierstore-") and str(d.parent).startswith("/dev/shm/"):
            with contextlib.suppress(OSError):
                d.parent.rmdir()  # the default folder, once no node's copy is left in it
