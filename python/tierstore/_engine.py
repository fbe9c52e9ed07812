"""The process-wide I/O engine and its configuration.

One engine serves every save and load in a process: its I/O threads and its
staging buffers are created once and reused. It is configured by
:func:`configure` or, before first use, by environment variables:

``TIERSTORE_BACKEND``
    ``io_uring``, ``threads`` or ``buffered`` (default: io_uring when the
    kernel allows it, else threads; buffered per file where O_DIRECT is refused).
``TIERSTORE_QUEUE_DEPTH``, ``TIERSTORE_CHUNK_MIB``, ``TIERSTORE_POOL_MIB``,
``TIERSTORE_CPU_THREADS``
    Requests in flight, transfer size, staging memory bound, copy/checksum threads.
``TIERSTORE_HUGE_PAGES``
    ``1``, ``0`` or ``auto`` (default): whether the engine's buffers of 4 MiB
    or more (the write staging pool, the buffers a load fills) ask for
    transparent huge pages (auto: yes, except on a virtual machine with free
    page reporting; ``tierstore info`` says which and why).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore.errors import InvalidArgumentError

__all__ = ["configure", "get_engine", "host_buffer", "info"]

_HUGE_PAGE = 2 << 20

_lock = threading.Lock()
_engine: _core.Engine | None = None
# Engines abandoned in a forked child: their threads do not exist there, so
# they must never be dropped (dropping joins the threads).
_orphans: list[_core.Engine] = []


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={v!r} is not an integer") from None


def _env_bool(name: str) -> bool | None:
    """``1``/``yes``/``on``/``true`` or ``0``/``no``/``off``/``false``; unset,
    empty or ``auto``: ``None`` (the automatic choice)."""
    v = os.environ.get(name)
    if v is None or v.strip().lower() in ("", "auto"):
        return None
    t = v.strip().lower()
    if t in ("1", "yes", "on", "true"):
        return True
    if t in ("0", "no", "off", "false"):
        return False
    raise InvalidArgumentError(f"environment variable {name}={v!r} is not one of 1, 0 or auto")


def lock_dir() -> Path:
    """Where the machine-wide device-turn lock files are: a RAM file system
    where there is one (they are per boot), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _env_turns(e: _core.Engine) -> None:
    """Machine-wide turns at the devices ``TIERSTORE_TAKE_TURNS`` names
    (paths separated by ``:``; see :mod:`tierstore.devices`), held as long
    as the engine."""
    v = os.environ.get("TIERSTORE_TAKE_TURNS", "").strip()
    held = []
    for p in (x for x in v.split(":") if x.strip()):
        try:
            dev = os.stat(p).st_dev
        except OSError as err:
            raise InvalidArgumentError(f"TIERSTORE_TAKE_TURNS names {p!r}, which cannot be used: {err}") from None
        held.append(_core.DeviceTurns(e, dev, slots=1, exclusive=True, shared=2, lock_dir=str(lock_dir()), duplex=True))
    _env_held[id(e)] = held


_env_held: dict[int, list[_core.DeviceTurns]] = {}


def _from_env() -> _core.Engine:
    backend = os.environ.get("TIERSTORE_BACKEND") or None
    if backend is not None and backend.strip().lower() == "auto":
        backend = None
    chunk = _env_int("TIERSTORE_CHUNK_MIB")
    pool = _env_int("TIERSTORE_POOL_MIB")
    return _core.Engine(
        backend,
        queue_depth=_env_int("TIERSTORE_QUEUE_DEPTH"),
        chunk_bytes=chunk << 20 if chunk else None,
        pool_bytes=pool << 20 if pool else None,
        cpu_threads=_env_int("TIERSTORE_CPU_THREADS"),
        huge_pages=_env_bool("TIERSTORE_HUGE_PAGES"),
        forced_by="TIERSTORE_BACKEND" if backend else None,
    )


def get_engine() -> _core.Engine:
    """The process's engine, started on first use."""
    global _engine
    e = _engine
    if e is not None:
        return e
    with _lock:
        if _engine is None:
            e = _from_env()
            _env_turns(e)
            _engine = e
        return _engine


def configure(
    backend: str | None = None,
    *,
    queue_depth: int | None = None,
    chunk_mib: int | None = None,
    pool_mib: int | None = None,
    cpu_threads: int | None = None,
    huge_pages: bool | None = None,
) -> _core.Engine:
    """Replaces the process's engine with one built from these settings.

    ``backend`` is ``"io_uring"``, ``"threads"``, ``"buffered"`` or ``None``
    (automatic). ``huge_pages`` says whether the engine's buffers of 4 MiB or
    more (the write staging pool, the buffers a load fills) ask for
    transparent huge pages; ``None`` (automatic) does unless the machine is
    a virtual one with free page reporting, where each fresh huge page costs
    the host an allocation and may stall on compaction. Returns the new engine; operations in flight on the old one
    finish first.
    """
    global _engine
    e = _core.Engine(
        backend,
        queue_depth=queue_depth,
        chunk_bytes=chunk_mib << 20 if chunk_mib else None,
        pool_bytes=pool_mib << 20 if pool_mib else None,
        cpu_threads=cpu_threads,
        huge_pages=huge_pages,
        forced_by="tierstore.configure()" if backend else None,
    )
    _env_turns(e)
    with _lock:
        _engine = e
    return e


def _after_fork_in_child() -> None:
    global _engine
    if _engine is not None:
        _orphans.append(_engine)
    _engine = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def info(path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """What the engine chose and why, and what the file system at ``path`` allows."""
    from tierstore import __version__

    d: dict[str, Any] = {"version": __version__}
    d.update(get_engine().info())
    d["path"] = _core.probe_path(os.fspath(path))
    return d


def _huge_choice() -> bool:
    """Whether the process's engine uses transparent huge pages."""
    e = get_engine()
    got = _HUGE_CHOICE.get(id(e))
    if got is None:
        got = _HUGE_CHOICE[id(e)] = bool(e.info().get("huge_pages"))
    return got


_HUGE_CHOICE: dict[int, bool] = {}


def host_buffer(nbytes: int, huge: bool | None = None) -> torch.Tensor:
    """``nbytes`` of host memory for O_DIRECT transfers: a uint8 tensor on
    anonymous memory, aligned to 2 MiB and, with ``huge`` (default: the
    engine's choice, ``TIERSTORE_HUGE_PAGES``), advised for transparent huge
    pages. A caller that allocates once, before the work that uses it (the
    offload wrapper), may ask for them whatever the engine chose; buffers
    first touched while training runs (a Checkpointer's capture slabs)
    follow the engine, since on a VM with free page reporting a fresh huge
    page may stall on compaction for hundreds of milliseconds.

    Direct I/O from physically contiguous memory is not split at the block
    layer's segment limit (a virtio disk takes 254 segments of a page each, so
    buffers of scattered 4 KiB pages make requests of at most ~1 MiB); here
    that doubles what the disk delivers (measured: reads 1.4 -> 2.7 GiB/s,
    reads and writes at once 2.4 -> 3.7 GiB/s). The memory goes back to the
    system when the tensor and its views are gone; the unaligned margin is
    never touched, so it costs address space, not memory. Buffers under 4 MiB
    are page-aligned on ordinary pages.
    """
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    if nbytes < 2 * _HUGE_PAGE:  # small: page-aligned, ordinary pages (a huge one would be mostly waste)
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge is None:
        huge = bool(_huge_choice())
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off in this kernel: plain pages, still correct
            m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # keeps ``m`` alive
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes]
