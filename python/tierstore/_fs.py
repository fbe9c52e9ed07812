"""Durable file-system steps shared by every writer of metadata and
directories: an atomic replace (temporary name, fsync, rename, fsync of the
directory), checksummed JSON written that way, and directories whose entries
survive a power loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tierstore import _metadata


def fsync_dir(d: Path) -> None:
    """Makes the entries of directory ``d`` durable."""
    _fsync(d, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(p: Path) -> None:
    """Makes the contents of file ``p`` durable (not its name: see :func:`fsync_dir`)."""
    _fsync(p, os.O_RDONLY)


def _fsync(p: Path, flags: int) -> None:
    fd = os.open(p, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Writes ``data`` to ``path`` through a temporary name, fsynced, renamed,
    directory fsynced; ``durable=False`` skips both fsyncs (the replace stays
    atomic against a process crash, not against a power loss)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """``data`` as checksummed JSON (see :mod:`tierstore._metadata`), atomically and durably."""
    write_atomic(path, _metadata.dumps(data))


def make_dir(d: Path, durable: bool) -> None:
    """Creates ``d`` and its missing parents. When ``durable``, fsyncs the
    parent of each directory made here, and ``d``'s parent in any case (the
    caller may just have made ``d``, as a Checkpointer makes its step
    directory), so that the checkpoint's directory entry survives a power loss
    once the manifest is committed."""
    made: list[Path] = []
    p = d
    while not os.path.lexists(p) and p.parent != p:
        made.append(p)
        p = p.parent
    d.mkdir(parents=True, exist_ok=True)
    if durable:
        for parent in dict.fromkeys([d.parent, *(m.parent for m in made)]):
            fsync_dir(parent)
