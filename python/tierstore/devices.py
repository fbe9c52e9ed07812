"""Machine-wide turns at a storage device, for any process.

Eight ranks of a node that save, load or flush checkpoints to one NVMe at
the same moment interleave their streams; some devices serve that much
worse than one stream after another. :func:`take_turns` registers turns at
the device holding a path with the process's engine: from then on, every
transfer the engine runs at that device (``tierstore.save`` / ``load``,
sharded checkpoints, Checkpointer flushes and promotions, offload traffic)
waits for one of ``device_slots`` machine-wide turns in its direction, held
through lock files that every process using the device shares, and for one
of ``io_slots`` turns of this process, foreground work before background
work. An offloaded optimizer registers such turns for its own paths
(``tierstore.offload(..., exclusive_io=True)``); this is the same mechanism
for a process without one.

``TIERSTORE_TAKE_TURNS=/path/a:/path/b`` does the same for every process
that starts an engine (the defaults below), without a code change.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType

from tierstore import _core
from tierstore._engine import get_engine, lock_dir
from tierstore.errors import InvalidArgumentError, NotFoundError

__all__ = ["DeviceShare", "lock_dir", "take_turns"]

_lock = threading.Lock()
_active: dict[tuple[int, int], DeviceShare] = {}


class DeviceShare:
    """This process's turns at one device (see :func:`take_turns`); a context
    manager. ``close()`` gives them up; transfers already waiting for a turn
    then go at once."""

    def __init__(self, native: _core.DeviceTurns, dev: int, path: Path, key: tuple[int, int]) -> None:
        self._native: _core.DeviceTurns | None = native
        self.dev = dev
        self.path = path
        self._key = key

    @property
    def active(self) -> bool:
        return self._native is not None

    @property
    def lock_wait_s(self) -> float:
        """Seconds this process's transfers at the device waited for other processes' turns."""
        return self._native.lock_wait_s if self._native is not None else 0.0

    def close(self) -> None:
        with _lock:
            if self._native is not None:
                self._native.close()
                self._native = None
            if _active.get(self._key) is self:
                del _active[self._key]

    def __enter__(self) -> DeviceShare:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeviceShare({str(self.path)!r}, dev={self.dev:#x}, active={self.active})"


def take_turns(
    path: str | os.PathLike[str],
    *,
    device_slots: int = 2,
    io_slots: int = 1,
    duplex: bool = True,
) -> DeviceShare:
    """Takes machine-wide turns at the device holding ``path``.

    ``device_slots`` transfers per direction at a time for the whole machine
    (every process that takes turns there), ``io_slots`` for this process;
    ``duplex=False`` makes reads and writes share one set of turns (for a
    device that serves interleaved directions badly). A second call for the
    same device of the same engine returns the turns already held.
    """
    if device_slots < 1 or io_slots < 1:
        raise InvalidArgumentError(f"device_slots and io_slots must be at least 1, got {device_slots}, {io_slots}")
    p = Path(path)
    try:
        dev = os.stat(p).st_dev
    except FileNotFoundError:
        msg = f"{p}: no such file or directory (take_turns needs an existing path)"
        raise NotFoundError(msg, path=str(p)) from None
    engine = get_engine()
    key = (id(engine), dev)
    with _lock:
        held = _active.get(key)
        if held is not None and held.active:
            return held
        native = _core.DeviceTurns(
            engine,
            dev,
            slots=io_slots,
            exclusive=True,
            shared=device_slots,
            lock_dir=str(lock_dir()),
            duplex=duplex,
        )
        share = DeviceShare(native, dev, p, key)
        _active[key] = share
        return share
