"""Names that a checkpoint's files give to other files, confined to the checkpoint.

A manifest names its data files, a DCP ``.metadata`` its ``relative_path``s,
a Checkpointer tier its step directories. Every such name is a relative path
inside the checkpoint directory: no absolute path, no ``..``, no empty or
``.`` component, no NUL, no symlink that leads out, and what it names is a
regular file (a FIFO would block a reader forever, a device would never
end). :func:`member` checks a name before anything is opened;
:func:`read_regular` opens without blocking and checks the descriptor itself,
so a path swapped after the check cannot slip through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from tierstore.errors import CorruptFileError, NotFoundError, TruncatedFileError, UnsafePathError, os_error

__all__ = ["inside", "member", "read_regular"]

# Names longer than this are refused (no file system takes them anyway).
_MAX_NAME = 4096


def inside(root: Path, p: Path) -> bool:
    """True when ``p`` (symlinks resolved) lies inside ``root`` (resolved)."""
    r = os.path.realpath(root)
    q = os.path.realpath(p)
    return q == r or q.startswith(r.rstrip(os.sep) + os.sep)


def member(root: str | os.PathLike[str], name: Any, *, source: str, field: str, regular: bool = True) -> Path:
    """``root / name`` after checking that ``name`` stays inside ``root``.

    ``source`` (the metadata file) and ``field`` (where the name is in it)
    go into the error. A name that exists must be a regular file (or, with
    ``regular=False``, anything but a symlink leading out); a missing one is
    returned as it is, for the caller to report.
    """
    rootp = Path(root)
    text: str = check_name(rootp, name, source=source, field=field)

    def bad(why: str) -> UnsafePathError:
        return UnsafePathError(
            f"{source}: {field}: {why}; a checkpoint may only name files inside {rootp}", path=source, record=field
        )

    p = rootp / text
    if not inside(rootp, p):
        raise bad(f"name {text[:200]!r} leads outside the checkpoint (through a symlink)")
    if regular:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return p
        except OSError as e:
            raise os_error(e, str(p), "stat") from None
        if not stat.S_ISREG(st.st_mode):
            raise bad(f"{text[:200]!r} is not a regular file ({_kind(st.st_mode)})")
    return p


def check_name(root: Path, name: Any, *, source: str, field: str) -> str:
    """The checks of :func:`member` that need no file system: ``name`` is a
    relative path with no empty, '.' or '..' component (a reader that checks
    a table of many names this way checks each with :func:`member` before
    it opens it)."""
    rootp = root

    def bad(why: str) -> UnsafePathError:
        return UnsafePathError(
            f"{source}: {field}: {why}; a checkpoint may only name files inside {rootp}", path=source, record=field
        )

    if not isinstance(name, str):
        raise bad(f"expected a file name, got {type(name).__name__}")
    if not name or len(name) > _MAX_NAME or "\0" in name:
        raise bad(f"name {name[:100]!r} is empty, too long or holds a NUL byte")
    if os.path.isabs(name) or name.startswith("~"):
        raise bad(f"name {name[:200]!r} is an absolute path")
    parts = name.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise bad(f"name {name[:200]!r} has an empty, '.' or '..' component")
    return name


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "not a file"


def read_regular(path: str | os.PathLike[str], limit: int, what: str, *, at: tuple[int, int] | None = None) -> bytes:
    """The whole of the regular file ``path``, refused beyond ``limit`` bytes;
    with ``at=(offset, length)``, only those bytes, refused where they end
    past the end of the file.

    Opens without blocking (a FIFO does not wait for a writer) and checks the
    open descriptor, so nothing but a regular file of bounded size is read.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFoundError(f"{p}: {what} is missing", path=p) from None
    except OSError as e:
        raise os_error(e, p, f"open {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{p}: {what} is not a regular file ({_kind(st.st_mode)})", path=p)
        offset, length = at if at is not None else (0, st.st_size)
        if at is None and st.st_size > limit:
            raise CorruptFileError(
                f"{p}: {what} is {st.st_size} bytes, more than the {limit} any tierstore {what} holds", path=p
            )
        if at is not None and (offset < 0 or length < 0 or offset + length > st.st_size):
            raise TruncatedFileError(
                f"{p}: {what}: bytes {offset}..{offset + length} end past the end of the file ({st.st_size} bytes); "
                "the file is cut short",
                path=p,
            )
        chunks = []
        done = 0
        while done < length:
            b = os.pread(fd, min(length - done, 16 << 20), offset + done)
            if not b:
                break
            chunks.append(b)
            done += len(b)
        if done != length:
            raise TruncatedFileError(f"{p}: {what} was cut short while it was read", path=p)
        return b"".join(chunks)
    except OSError as e:
        raise os_error(e, p, f"read {what}") from None
    finally:
        os.close(fd)
