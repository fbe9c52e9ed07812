"""The Checkpointer's cascade: a captured snapshot is flushed to the local
disk tier as a sharded checkpoint, promoted to the farther tiers, and old
steps are removed by each tier's retention; the host pool keeps the durable
snapshots ``HostTier.keep_last`` asks for.

The cascade runs on the flush and promotion threads. It shares with the
Checkpointer, by reference and under ``lock``, the list of live snapshots,
the handles, and the set of step directories being written (retention never
removes those); it never rebinds them.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore import _ckpt_codec, _core, _gc, _tier_codec, _tier_steps
from tierstore._ckpt_peers import NodeCopies, Ring, commit_files, own_files
from tierstore._ckpt_pool import HostPool
from tierstore._ckpt_restore import META, STEP_DIR, step_dirs
from tierstore._ckpt_snapshot import CheckpointHandle, Residency, Snapshot
from tierstore._dist import all_true, barrier, scatter
from tierstore._engine import get_engine
from tierstore._fs import make_dir, write_json_atomic
from tierstore._nodes import Node
from tierstore.codec import CODEC
from tierstore.errors import InvalidArgumentError, TierstoreError, UsageError
from tierstore.sharded import write_sharded
from tierstore.shardmeta import MANIFEST, read_manifest
from tierstore.tiers import DiskTier, HostTier


def copy_offload_pins(snap: Snapshot, d: Path) -> None:
    """Copies the pinned subgroup files of offloaded optimizers into the
    checkpoint directory ``d`` (reflink where the file system can)."""
    if not snap.offload_pins:
        return
    d.mkdir(parents=True, exist_ok=True)
    engine = get_engine()
    for pin, name in snap.offload_pins:
        _core.copy_file(engine, pin, d / name, background=True)


def drop_offload_pins(snap: Snapshot) -> None:
    for pin, _name in snap.offload_pins:
        with contextlib.suppress(OSError):
            pin.unlink()
    snap.offload_pins = []


class Cascade:
    """Flush, promotion and retention of one Checkpointer's snapshots."""

    def __init__(
        self,
        *,
        path: Path,
        host: HostTier,
        disks: list[DiskTier],
        pool: HostPool,
        rank: int,
        world: int,
        pg_flush: Any,
        pg_promote: Any,
        lock: threading.Lock,
        snaps: list[Snapshot],
        handles: list[CheckpointHandle],
        busy_dirs: set[Path],
        promote_q: queue.Queue[Snapshot | None],
        closed: Callable[[], bool],
        node: Node | None = None,
        ring: Ring | None = None,
    ) -> None:
        self.ring = ring
        self.path, self.host, self.disks, self.pool = path, host, disks, pool
        self.node = node if node is not None else Node("node", 0, True, 1)
        self.rank, self.world = rank, world
        self._pg_flush, self._pg_promote = pg_flush, pg_promote
        self._lock, self._snaps, self._handles, self._busy_dirs = lock, snaps, handles, busy_dirs
        self._promote_q = promote_q
        self._is_closed = closed
        self.peers = NodeCopies(
            rank=rank,
            world=world,
            node=self.node,
            ring=ring,
            pg_promote=pg_promote,
            first_disk=disks[0] if disks else None,
            tier_paths=self.tier_paths,
        )

    @property
    def _closed(self) -> bool:
        return self._is_closed()

    def delete_step(self, step: int, tier: str | None) -> list[str]:
        """:meth:`Checkpointer.delete`: the step's directories on every disk
        tier (or on ``tier``), deleted by rank 0 once none is busy and no
        kept delta references one of them."""
        tiers = [t for t in self.disks if tier is None or t.name == tier]
        if tier is not None and not tiers:
            raise InvalidArgumentError(f"no disk tier named {tier!r}: {[t.name for t in self.disks]}")
        name = f"step-{step:012d}"
        dirs = [p / name for t in tiers for p in self.tier_paths(t) if (p / name).is_dir()]
        with self._lock:
            busy = set(self._busy_dirs)
        if any(d in busy for d in dirs):
            raise UsageError(f"step {step} is being written or promoted; wait() first")
        if self.rank != 0:
            return []
        for d in dirs:
            if _tier_steps.dependents(d):
                _tier_steps.delete_checkpoint(d)  # raises, naming the dependents
        for d in dirs:
            _tier_steps.delete_checkpoint(d)
        return [str(d) for d in dirs]

    def tier_paths(self, t: DiskTier) -> list[Path]:
        """The tier's directories as this rank sees them (a node-scoped
        tier's ``{node}`` made this node's name)."""
        ps = [str(p) for p in t.paths]  # type: ignore[union-attr]
        if t.scope == "node":
            ps = [p.replace("{node}", self.node.name) for p in ps]
        return [self.path / p for p in ps]

    def dir_for(self, t: DiskTier, snap: Snapshot) -> Path:
        ps = self.tier_paths(t)
        return ps[snap.ordinal % len(ps)] / f"step-{snap.step:012d}"

    def selected(self, t: DiskTier, snap: Snapshot) -> bool:
        return snap.ordinal % t.every == 0

    def write_meta(self, d: Path, snap: Snapshot, t: DiskTier | None = None) -> None:
        if t is not None and t.scope == "node":
            make_dir(d, durable=True)  # every node's copy of the step's directory
        if self.rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            meta: dict[str, Any] = {
                "step": snap.step,
                "world_size": self.world,
                "tree": snap.tree,
                "created_unix": time.time(),
            }
            if t is not None and t.scope == "node":
                # Where each rank's files are: per node, its name and rank runs.
                meta["nodes"] = [[n, [list(r) for r in runs]] for n, runs in self.node.ranks]
            write_json_atomic(d / META, meta)

    def spread_commit(self, d: Path, t: DiskTier, pg: Any) -> None:
        """A node-scoped tier: rank 0 committed the checkpoint in its node's
        copy; each other node's leader gets the commit (the index, the key
        tree, the job-wide objects file and manifest.json, written in that
        order) for its own copy, so that every node's copy names its files
        and restores on its own."""
        if t.scope != "node" or self.world == 1:
            return
        payload: list[Any] | None = None
        if self.rank == 0:
            m = read_manifest(d)
            # With the commit, the objects file of the job-wide objects (rank
            # 0's: every rank reads them on restore) so that no node needs
            # another's copy.
            files = [(n, (d / n).read_bytes()) for n in commit_files(d, m)]
            others = set(self.node.leader_ranks) - {0}
            payload = [files if r in others else None for r in range(self.world)]
        mine = scatter(payload, self.world, pg)
        err: BaseException | None = None
        if mine is not None:
            try:
                self.peers.keep_received(d, [(0, mine)])
            except (OSError, TierstoreError) as e:
                err = e
        if not all_true(err is None, self.world, pg):
            raise TierstoreError(f"{d}: a node could not commit its copy of the checkpoint ({err or 'another node'})")

    # The collector is paused while a snapshot is written to the first disk
    # tier (a local one: a fraction of a second per snapshot): the flush
    # allocates a few thousand objects (pickle, manifest, layout rules),
    # enough to start collections that walk every object of the process
    # while holding the GIL the training thread needs (about 40% of the
    # flush thread's CPU in a profile of the gpt bench state).
    @_gc.paused
    def flush(self, snap: Snapshot) -> None:
        h = snap.handle
        # Debug mode: the training thread checks the snapshot at its next
        # synchronisation point (step hook, wait_capture, save, wait).
        while not snap.verified.wait(0.1):
            if self._closed:
                return
        if snap.error is not None:
            return
        local = self.disks[0]
        t0 = time.perf_counter()
        written: Path | None = None
        if self.selected(local, snap):
            d = self.dir_for(local, snap)
            with self._lock:
                self._busy_dirs.add(d)
            try:
                self.write_meta(d, snap, local)
                copy_offload_pins(snap, d)
                write_sharded(
                    snap.state, d, self._pg_flush, durable=True, background=True, gates=snap.gates, attachments=(META,)
                )
                self.spread_commit(d, local, self._pg_flush)
                snap.captured.wait()
                if snap.error is not None:
                    raise TierstoreError(f"the capture failed: {snap.error}")
                written = d
                h.paths[local.name] = str(d)
                h.timings["flush"] = time.perf_counter() - t0
                h.timings["to_local"] = time.perf_counter() - snap.t_save
                h._set(local.name, "durable")
            except (OSError, TierstoreError) as e:
                with self._lock:
                    self._busy_dirs.discard(d)
                with contextlib.suppress(OSError):
                    shutil.rmtree(d)
                snap.captured.wait()
                if snap.error is not None:  # the capture failed: the handle says so already
                    return
                h._set(local.name, "failed")
                farther = [t.name for t in self.disks[1:]]
                warnings.warn(
                    f"tierstore: checkpoint of step {snap.step} could not be written to the {local.name!r} tier "
                    f"({e}); " + (f"writing it to {farther[0]!r} instead" if farther else "it is lost"),
                    stacklevel=1,
                )
                if not farther:
                    h.error = e
        else:
            h._set(local.name, "skipped")
        if written is not None:
            snap.local_dir = written
            snap.release_host(Residency.EVICTABLE)  # durable: the host copy may be dropped when room is needed
            self.trim_host()
            self.gc(local, written)
        self._promote_q.put(snap)

    def trim_host(self) -> None:
        """Keeps ``HostTier.keep_last`` durable snapshots in memory; the
        buffers of older ones become free for the next captures."""
        with self._lock:
            retained = [s for s in self._snaps if s.evictable and s.in_host and s.error is None]
        retained.sort(key=lambda s: s.ordinal)
        for s in retained[: max(0, len(retained) - self.host.keep_last)]:
            with self.pool.cond:
                self.pool._evict_snapshot(s)
        self.pool.notify()

    def promote(self, snap: Snapshot) -> None:
        h = snap.handle
        try:
            local = self.disks[0]
            if snap.local_dir is not None:
                self.peers.replicate_on(local, snap, snap.local_dir)
            for t in self.disks[1:]:
                if not self.selected(t, snap) and snap.local_dir is not None:
                    h._set(t.name, "skipped")
                    continue
                t0 = time.perf_counter()
                d = self.dir_for(t, snap)
                with self._lock:
                    self._busy_dirs.add(d)
                try:
                    if snap.local_dir is not None:
                        self.copy_dir(snap.local_dir, d, t)
                        self.spread_commit(d, t, self._pg_promote)
                        self.peers.replicate_on(t, snap, d)
                    else:  # the local tier failed: write from host memory
                        snap.captured.wait()
                        if snap.error is not None:
                            return
                        self.write_meta(d, snap, t)
                        copy_offload_pins(snap, d)
                        write_sharded(
                            snap.state, d, self._pg_promote, durable=True, background=True, attachments=(META,)
                        )
                        self.spread_commit(d, t, self._pg_promote)
                        snap.local_dir = d
                    h.paths[t.name] = str(d)
                    h.timings["to_remote"] = time.perf_counter() - snap.t_save
                    h.timings["promote"] = time.perf_counter() - t0
                    if t is self.disks[-1]:
                        drop_offload_pins(snap)  # before wait() can return
                    h._set(t.name, "durable")
                    self.gc(t, d)
                except (OSError, TierstoreError) as e:
                    h._set(t.name, "failed")
                    h.error = e
                    warnings.warn(
                        f"tierstore: checkpoint of step {snap.step} could not be copied to the {t.name!r} tier: {e}",
                        stacklevel=1,
                    )
                finally:
                    with self._lock:
                        self._busy_dirs.discard(d)
        finally:
            drop_offload_pins(snap)
            if self.disks[0].name in h.paths:
                with self._lock:
                    self._busy_dirs.discard(Path(h.paths[self.disks[0].name]))
                # Retention on the first tier again: a step promoted while the
                # next one was flushed was in use when that flush's retention ran.
                with contextlib.suppress(OSError):
                    self.gc(self.disks[0], snap.local_dir)
            snap.captured.wait()  # the capture no longer writes into the buffers
            snap.release_host(Residency.EVICTABLE)
            if h.state in ("failed", "skipped", "captured"):
                snap.release_host(Residency.EVICTED)  # nothing durable: the host copy is no restore point
                self.pool.release(snap)
            self.pool.notify()
            with self._lock:
                self._snaps[:] = [s for s in self._snaps if s.in_host or not s.evictable]
                if len(self._handles) > 256:  # keep the recent and the unsettled ones
                    old, recent = self._handles[:-128], self._handles[-128:]
                    self._handles[:] = [x for x in old if not x.settled()] + recent

    def copy_dir(self, src: Path, dst: Path, t: DiskTier | None = None) -> None:
        """Copies this rank's files of the committed checkpoint ``src`` to
        ``dst`` (encoded where tier ``t`` has a codec); rank 0 commits
        ``dst`` with its manifest once every rank's files are durable there."""
        m = read_manifest(src)
        sid = m["save_id"]
        # The step directory's entry (and any tier directory made here) made
        # durable in their parents before the manifest commits the copy.
        make_dir(dst, durable=True)
        engine = get_engine()
        mine = own_files(src, self.rank, sid)
        if self.rank == 0 and (src / META).exists():
            mine.append(META)
        if self.rank == 0 and "index" in m:
            mine.append(m["index"]["name"])  # a large manifest's index, committed with it
        spec = t.codec_spec if t is not None else None
        refs: list[Path] = []
        if spec is not None:
            assert t is not None
            step = _tier_steps.step_of(dst)
            if step is not None:
                refs = _ckpt_codec.plan_references(
                    dst.parent, step, t.keyframe_every, self.world, t.reference, t.keyframe_share
                )
        err: BaseException | None = None
        try:
            for f in mine:
                if spec is not None and _tier_codec.encodable(f):
                    assert t is not None
                    self._encode(src / f, dst, t, refs)
                else:
                    _core.copy_file(engine, src / f, dst / f, background=True)
            if spec is not None and self.rank == 0:
                assert t is not None
                info = {
                    "format": "tierstore-tier-codec",
                    "codec": CODEC,
                    "keyframe": not refs,
                    # The first candidate (files written before `references` name only this one).
                    "reference": refs[0].name if refs else None,
                    "references": [r.name for r in refs],
                    "chain": t.reference,
                    "keyframe_every": t.keyframe_every,
                    "keyframe_share": t.keyframe_share,
                    "level": spec.level,
                }
                write_json_atomic(dst / _tier_codec.CODEC_META, info)
        except (OSError, TierstoreError) as e:
            err = e
        ok = all_true(err is None, self.world, self._pg_promote)
        if err is not None:
            raise err
        if not ok:
            raise TierstoreError(f"{dst}: another rank failed to copy its files; not committed")
        if self.rank == 0:
            _core.copy_file(engine, src / MANIFEST, dst / MANIFEST, background=True)
        barrier(self.world, self._pg_promote)

    def _encode(self, src: Path, dst: Path, t: DiskTier, refs: list[Path]) -> None:
        """Stores file ``src`` encoded in ``dst`` (``<name>.tsd``): against
        this rank's files of the candidate references ``refs`` that are at
        hand and intact (of two, each record against the one a sample of it
        encodes smaller against), else on its own (a keyframe). The raw file is kept in the
        reference cache when later deltas may be encoded against it: a
        keyframe's, and with ``reference="parent"``/``"best"`` every
        checkpoint's (with the keyframe's, for ``"best"``)."""
        cache = _ckpt_codec.ReferenceCache(self.path / ".tierstore-refs" / t.name)
        found: list[tuple[str, Path]] = []
        for ref_dir in refs:
            name = _ckpt_codec.reference_file(ref_dir, src.name)
            want = _ckpt_codec.expected_files(ref_dir).get(name) if name is not None else None
            raw = cache.raw(ref_dir, name, want) if name is not None and want is not None else None
            if raw is not None:
                found.append((ref_dir.name, raw))
        assert t.codec_spec is not None
        # Each record against the candidate a sample of it encodes smallest against.
        _tier_codec.encode_file(src, dst / (src.name + _tier_codec.SUFFIX), t.codec_spec, found or None)
        if not refs:
            cache.keep(dst.name, src)
        elif t.reference != "keyframe":
            cache.keep(dst.name, src, also=refs[0].name if t.reference == "best" else None)

    def gc(self, t: DiskTier, just: Path | None = None) -> None:
        """Retention on tier ``t`` (rank 0 only): keeps the newest ``keep_last``
        complete checkpoints, multiples of ``keep_every`` and anything in use;
        removes older incomplete directories left by crashes. A node-scoped
        tier's retention runs on each node's leader, over its node's copy.
        ``just``: the step directory just committed there, kept whatever
        else the tier holds (a node's copy may hold newer steps of an
        earlier run, which must not push this job's newest out)."""
        if not (self.node.leader if t.scope == "node" else self.rank == 0):
            return
        complete: list[tuple[int, Path]] = []
        incomplete: list[tuple[int, Path]] = []
        for p in self.tier_paths(t):
            for d in step_dirs(p, t.name):
                m = STEP_DIR.match(d.name)
                if m:
                    (complete if (d / MANIFEST).exists() else incomplete).append((int(m.group(1)), d))
        if not complete:
            return
        complete.sort(reverse=True)
        newest = complete[0][0]
        keep = {d for _s, d in complete[: t.keep_last]} if t.keep_last is not None else {d for _s, d in complete}
        keep.add(complete[0][1])
        if just is not None:
            keep.add(just)
        if t.keep_every:
            keep |= {d for s, d in complete if s % t.keep_every == 0}
        if t.codec_spec is not None:
            _tier_steps.add_references(keep)
        with self._lock:
            busy = set(self._busy_dirs)
        for _s, d in complete:
            if d not in keep and d not in busy:
                shutil.rmtree(d, ignore_errors=True)
        for s, d in incomplete:
            if s < newest and d not in busy:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------------------
    # restore
