"""The storage tiers a Checkpointer and an offloaded optimizer place state
on (host memory, local disks, remote storage), and byte sizes as users
write them ("4GiB")."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstore.errors import InvalidArgumentError

__all__ = ["DiskTier", "HostTier", "RemoteTier", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(v: int | str) -> int:
    """``"4GiB"``, ``"512MB"``, ``"1.5g"`` or a byte count."""
    if isinstance(v, int):
        if v < 0:
            raise InvalidArgumentError(f"a size must not be negative, got {v}")
        return v
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"cannot read {v!r} as a size: expected e.g. 4GiB, 512MiB, 2GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ----------------------------------------------------------------------------------------------
# tiers


@dataclass
class HostTier:
    """Host memory: the capture buffers, with a byte budget.

    Buffers are allocated once and reused across saves; a snapshot stays in
    memory after it is durable (the nearest copy for ``load_latest``) until
    its space is needed. ``pinned`` (default: when CUDA is available) makes
    device-to-host copies asynchronous. ``keep_last`` durable snapshots stay
    in memory as restore points; older ones give their buffer back for reuse.
    The default budget comes from ``TIERSTORE_HOST_BUDGET`` (else 2 GiB).

    ``shm=True`` (or a directory): each node also keeps its ranks'
    checkpoints, as files, in its shared memory (default
    ``/dev/shm/tierstore-<uid>-<job>/{node}``), where they outlive the
    training processes: a restart after a process failure restores from
    memory, not from disk. ``replicas=k`` (implies ``shm``): each node's
    part is also copied into the shared memory of the next ``k`` nodes
    (Gemini-style in-memory replicas, over the job's process group), so
    that a replaced node gets its part back from a peer's memory. The copies
    form the nearest disk-like tier, named ``"<name>-shm"``: node-scoped,
    ``keep_last`` steps kept, written by the flush before the disk tiers
    get theirs. A clean :meth:`Checkpointer.close` of a Checkpointer that
    saved frees this node's copies once a farther tier holds the newest
    checkpoint; a crash leaves them for the restart. They take memory beyond ``budget``: about
    ``keep_last x (1 + replicas)`` times a node's part of a checkpoint.
    """

    budget: int | str = field(default_factory=lambda: os.environ.get("TIERSTORE_HOST_BUDGET", "2GiB"))
    pinned: bool | None = None
    keep_last: int = 1
    name: str = "host"
    shm: bool | str | os.PathLike[str] = False
    replicas: int = 0

    def __post_init__(self) -> None:
        self.budget = parse_size(self.budget)
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 0:
            raise InvalidArgumentError(f"tier {self.name!r}: replicas must be a count >= 0, got {self.replicas!r}")
        if self.replicas and self.shm is False:
            self.shm = True  # replicas are kept where they outlive the processes

    def shm_tier(self, job: str | os.PathLike[str]) -> DiskTier | None:
        """The node-scoped tier of this host tier's shared-memory copies (None
        without ``shm``); ``job``: the Checkpointer's path, which names the
        default directory so that two jobs on a node keep theirs apart."""
        if self.shm is False:
            return None
        if self.shm is True:
            import hashlib

            tag = hashlib.sha1(os.path.abspath(os.fspath(job)).encode()).hexdigest()[:12]
            path = f"/dev/shm/tierstore-{os.getuid()}-{tag}/{{node}}"
        else:
            path = os.fspath(self.shm)
        return DiskTier(
            path, keep_last=max(1, self.keep_last), name=f"{self.name}-shm", scope="node", replicas=self.replicas
        )


@dataclass
class DiskTier:
    """A disk tier: one or more directories (relative ones are taken under the
    checkpointer's path). Checkpoints rotate over the paths.

    ``every``: this tier receives every n-th checkpoint. Retention:
    ``keep_last`` newest complete checkpoints, plus those whose step is a
    multiple of ``keep_every``; ``None`` keeps all. The newest complete
    checkpoint is never deleted.

    ``scope="node"``: the path is valid on every node and its contents are
    local to each (a node's own NVMe). Each node's copy holds its ranks'
    files and the checkpoint's manifest, and a restore reads each file from
    the nearest intact copy (this node's, else a farther tier's). A
    ``{node}`` in a path is replaced by the node's name (nodes sharing one
    file system, and tests, keep their copies apart). Nodes are found from
    ``TIERSTORE_NODE`` (this process's node name), else torchrun's
    ``GROUP_RANK``, else the host name. ``replicas=k`` (node scope): each
    node's part is also copied, in the background after the node's own
    copy, to the next ``k`` nodes' copies (a ring: any ``k`` lost nodes
    leave a copy of every part), over the job's process group, in pieces
    (never a whole file in memory); any node-scoped tier may have replicas.
    A node that lost its copy of a step gets its ranks' files back from a
    peer before that step is restored (the newest, or an older one the
    restore falls back to). With or without replicas, a resharding restore
    fetches the files its node's ranks need from the nodes whose copies
    hold them before it reads a farther tier.

    ``codec``: how checkpoints are stored on this tier (None: raw, the
    default; ``"zstd"``; ``tierstore.Delta(keyframe_every=K)``). With a
    codec each data and objects file is stored as ``<name>.tsd``, its exact
    bytes encoded; with ``Delta`` every K-th checkpoint on the tier is a
    keyframe (encoded on its own) and the others are encoded against the
    latest keyframe (a star: a restore decodes two files, a delta can be
    deleted on its own), or with ``Delta(reference="parent")`` against the
    previous checkpoint (a chain), or with ``reference="best"`` each rank's
    file against whichever of the two encodes it smaller. Reads decode
    transparently; retention keeps every checkpoint a kept delta needs,
    directly or along its chain. Lossless only here (lossy
    ``keep_bits`` belongs to single files). Not on the first disk tier
    (written raw by the flush, for restores at disk speed) nor on
    node-scoped tiers.
    """

    paths: str | os.PathLike[str] | list[str | os.PathLike[str]] = "."
    keep_last: int | None = 3
    keep_every: int | None = None
    every: int = 1
    name: str = "local"
    scope: str = "job"
    replicas: int = 0
    codec: Any = None
    codec_spec: Any = field(default=None, init=False, repr=False, compare=False)
    keyframe_every: int = field(default=1, init=False, repr=False, compare=False)
    keyframe_share: float | None = field(default=None, init=False, repr=False, compare=False)
    reference: str = field(default="keyframe", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ps = self.paths if isinstance(self.paths, list) else [self.paths]
        if not ps:
            raise InvalidArgumentError(f"tier {self.name!r}: at least one path is needed")
        self.paths = [os.fspath(p) for p in ps]
        if self.every < 1:
            raise InvalidArgumentError(f"tier {self.name!r}: every must be at least 1, got {self.every}")
        if self.scope not in ("job", "node"):
            raise InvalidArgumentError(f"tier {self.name!r}: scope must be 'job' or 'node', got {self.scope!r}")
        if self.replicas < 0 or (self.replicas and self.scope != "node"):
            raise InvalidArgumentError(
                f"tier {self.name!r}: replicas (peer copies of each node's part) need scope='node' and a count >= 0"
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise InvalidArgumentError(f"tier {self.name!r}: keep_last must be at least 1 (or None to keep all)")
        from tierstore import codec as _codec

        spec = _codec.resolve(self.codec)
        if spec is not None:
            if spec.keep_bits:
                raise InvalidArgumentError(
                    f"tier {self.name!r}: a tier's codec is lossless (keep_bits is for tierstore.save of one file)"
                )
            if spec.base is not None:
                raise InvalidArgumentError(
                    f"tier {self.name!r}: a tier's deltas reference its own keyframes; Delta(base=...) is for "
                    "tierstore.save of one file"
                )
            if self.scope == "node":
                raise InvalidArgumentError(f"tier {self.name!r}: a codec on a node-scoped tier is not supported")
        self.codec_spec = spec
        every = self.codec.keyframe_every if isinstance(self.codec, _codec.Delta) else 1
        self.keyframe_every = every
        self.reference = self.codec.reference if isinstance(self.codec, _codec.Delta) else "keyframe"
        self.keyframe_share = self.codec.keyframe_share if isinstance(self.codec, _codec.Delta) else None


@dataclass
class RemoteTier(DiskTier):
    """Remote storage (a shared or parallel file system): like
    :class:`DiskTier`, keeping everything unless told otherwise. A relative
    path is taken as it reads, relative to the working directory when the
    tier is made (remote storage lies outside the job's checkpoint
    directory), not under the checkpointer's path as a DiskTier's is."""

    keep_last: int | None = None
    name: str = "remote"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.paths = [os.path.abspath(p) for p in self.paths]  # type: ignore[union-attr]


def checkpoint_tiers(
    tiers: Sequence[HostTier | DiskTier] | None, path: Path
) -> tuple[HostTier, list[DiskTier], DiskTier | None]:
    """A Checkpointer's tiers, checked: the host tier (at most one, first;
    a default one where none is given), the disk-like tiers nearest first
    (the host tier's shared-memory copy, ``HostTier(shm=...)``, first of
    them, node-scoped and written first by the flush), and that copy's tier
    (None without). Default: host memory, then the working directory."""
    tiers = list(tiers) if tiers is not None else [HostTier(), DiskTier(".")]
    hosts = [t for t in tiers if isinstance(t, HostTier)]
    disks: list[DiskTier] = [t for t in tiers if isinstance(t, DiskTier)]
    if len(hosts) > 1 or (hosts and tiers[0] is not hosts[0]):
        raise InvalidArgumentError("at most one HostTier, and it must come first")
    if not disks:
        raise InvalidArgumentError("at least one DiskTier is needed for checkpoints to be durable")
    if disks[0].codec_spec is not None:
        raise InvalidArgumentError(
            f"tier {disks[0].name!r}: the first disk tier is written raw (restores at disk speed); "
            "give the codec to a tier checkpoints are promoted to (RemoteTier(..., codec=...))"
        )
    host = hosts[0] if hosts else HostTier()
    shm = host.shm_tier(path)
    if shm is not None:
        disks.insert(0, shm)
    names = [t.name for t in tiers] + ([shm.name] if shm is not None else [])
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"tier names must differ: {names}")
    return host, disks, shm


def offload_tiers(tiers: Sequence[HostTier | DiskTier]) -> tuple[int, list[Path]]:
    """An offloaded optimizer's tiers, checked: the host memory budget (at
    most one HostTier; 1 GiB without) and the storage paths of its disk
    tiers, resolved, each once, in order."""
    hosts = [t for t in tiers if isinstance(t, HostTier)]
    disks = [t for t in tiers if isinstance(t, DiskTier)]
    if not disks:
        raise InvalidArgumentError("offload needs at least one DiskTier (a directory for the state that does not fit)")
    if len(hosts) > 1:
        raise InvalidArgumentError("offload takes at most one HostTier")
    roots: list[Path] = []
    for t in disks:
        # (``paths`` is a list once the tier is made: see DiskTier.__post_init__.)
        for p in t.paths:  # type: ignore[union-attr]
            root = Path(p).resolve()
            if root not in roots:
                roots.append(root)
    return int(hosts[0].budget) if hosts else parse_size("1GiB"), roots
