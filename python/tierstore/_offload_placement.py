"""Where an offloaded optimizer's subgroups live: the storage paths of its
disk tiers (a session directory each, the turns of each device) and the
placement of the subgroups over them in proportion to their bandwidth.

The bandwidth is probed at start and re-estimated from every transfer
(:meth:`StoragePath.observe`); the placement interleaves the subgroups over
the paths by smooth weighted round robin, so that any run of consecutive
subgroups (the reads and write-backs in flight at one time) spans the paths in
those proportions and every path works at once. A full path gets no share.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore import _core
from tierstore._engine import host_buffer
from tierstore._offload_io import DeviceTurns, StoragePath, remove_dead_sessions
from tierstore._offload_subgroup import Subgroup
from tierstore.errors import TierstoreError

RELAYOUT = 0.05  # change of a path's share that makes a new placement


class Placement:
    """The paths (one per distinct directory of the disk tiers) and the
    subgroup -> path map. ``balance``: ``"bandwidth"`` or ``"even"``."""

    def __init__(
        self,
        roots: list[Path],
        session: str,
        engine: _core.Engine,
        *,
        io_slots: int,
        device_slots: int | None,
        exclusive_io: bool,
        duplex: bool | None,
        balance: str,
    ) -> None:
        self.balance = balance
        self.paths: list[StoragePath] = []
        self.map: dict[int, StoragePath] = {}
        self.shares: dict[StoragePath, float] = {}
        self._alive_fds: list[int] = []
        devices: dict[int, DeviceTurns] = {}
        for root in roots:
            root.mkdir(parents=True, exist_ok=True)
            remove_dead_sessions(root)
            (root / session).mkdir()
            # Held while the process lives: the next optimizer on this path
            # removes a session whose lock is free (its process died).
            fd = os.open(root / session / ".alive", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._alive_fds.append(fd)
            dev = os.stat(root).st_dev
            if dev not in devices:
                shared = max(io_slots, 2) if device_slots is None else device_slots
                devices[dev] = DeviceTurns(engine, dev, io_slots, exclusive_io, duplex, shared)
            # Per direction, one worker more than the device's slots: one
            # checksums while the others transfer.
            pools = {
                w: ThreadPoolExecutor(io_slots + 1, thread_name_prefix=f"tierstore-offload-{len(self.paths)}{w[0]}")
                for w in ("read", "write")
            }
            self.paths.append(StoragePath(root, session, devices[dev], pools))
        self.devices = list(devices.values())

    def live(self) -> list[StoragePath]:
        return [p for p in self.paths if not p.full]

    def probe(self, engine: _core.Engine, warn: Callable[[str], None]) -> None:
        """A write and a read of a few MiB per path: the starting estimate
        (refined by every transfer after)."""
        n = 8 << 20
        probe = host_buffer(n, huge=True)
        probe.fill_(7)
        for p in self.paths:
            f = p.dir / "probe.bin"
            try:
                for what in ("write", "read"):
                    t0 = time.perf_counter()
                    _core.transfer_ranges(
                        engine,
                        f,
                        [0],
                        [n],
                        [probe.data_ptr()],
                        write=what == "write",
                        direct=True,
                        turns=p.device.native,
                    )
                    p.observe(what, n, time.perf_counter() - t0)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                p.full = True
                warn(f"tierstore offload: {p.root} is full; it gets no optimizer state")
            finally:
                f.unlink(missing_ok=True)
        if not self.live():
            raise TierstoreError("offload: every path is full: " + ", ".join(str(p.root) for p in self.paths))

    def targets(self) -> dict[StoragePath, float]:
        """Each live path's share of the state."""
        live = self.live()
        if self.balance == "even":
            return {p: 1.0 / len(live) for p in live}
        total = sum(p.speed() for p in live)
        return {p: p.speed() / total for p in live}

    def layout(self, subgroups: list[Subgroup]) -> dict[int, StoragePath]:
        """The path of each subgroup (by index), interleaved over the
        subgroups' order in proportion to the paths' shares. Kept while the
        shares move by less than ``RELAYOUT`` (every write-back rewrites its
        subgroup anyway, so a new placement costs no extra bytes, only new
        files)."""
        targets = self.targets()
        old = self.shares
        if self.map and old.keys() == targets.keys() and max(abs(targets[q] - old[q]) for q in targets) <= RELAYOUT:
            return self.map
        acc = dict.fromkeys(targets, 0.0)
        seen = 0
        layout: dict[int, StoragePath] = {}
        for sg in subgroups:
            seen += sg.nbytes
            p = max(targets, key=lambda q: targets[q] * seen - acc[q])
            acc[p] += sg.nbytes
            layout[sg.index] = p
        self.map, self.shares = layout, targets
        return layout

    def choose(self, sg: Subgroup, subgroups: list[Subgroup]) -> StoragePath:
        """Where ``sg`` is written back, counted there from now on (the
        caller holds the optimizer's lock)."""
        p = self.layout(subgroups)[sg.index]
        if sg.home is not None:
            sg.home.stored -= sg.home_bytes
        p.stored += sg.nbytes
        sg.home, sg.home_bytes = p, sg.nbytes
        return p

    def bandwidth(self) -> dict[str, dict[str, float]]:
        """The current estimate per path: read and write bytes per second,
        the share of state it is given, the bytes moved."""
        targets = self.targets()
        return {
            str(p.root): {
                "read": p.rate["read"],
                "write": p.rate["write"],
                "share": targets.get(p, 0.0),
                "read_bytes": p.moved["read"],
                "write_bytes": p.moved["write"],
                "full": float(p.full),
                "duplex": float(p.device.duplex),
            }
            for p in self.paths
        }

    def end_period(self) -> None:
        for d in self.devices:
            d.end_period()

    def close(self) -> None:
        """Stops the path workers and removes the session directories."""
        for p in self.paths:
            for pool in p.pools.values():
                pool.shutdown(wait=True)
            shutil.rmtree(p.dir, ignore_errors=True)
        for d in self.devices:
            d.close()
        for fd in self._alive_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._alive_fds = []
