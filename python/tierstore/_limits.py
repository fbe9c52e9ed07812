"""How much memory a load may allocate.

Sizes a file states (a global tensor's shape, a subgroup's byte count, a
pickled ``bytearray``) are checked against what the files hold before
anything is allocated, and then against the memory there is: the kernel's
``MemAvailable`` and the process's address-space limit (``ulimit -v``).
An allocation beyond them is refused with :class:`ResourceLimitError`
instead of reaching the out-of-memory killer.
"""

from __future__ import annotations

import resource

from tierstore.errors import ResourceLimitError

__all__ = ["available_memory", "check_allocation"]


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def available_memory() -> int:
    """Bytes this process can still allocate: the least of the memory the
    kernel says is available and what the address-space limit leaves."""
    limits = []
    avail = _meminfo("MemAvailable")
    if avail is not None:
        limits.append(avail)
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - _vm_size()))
    return min(limits) if limits else 1 << 62


def check_allocation(nbytes: int, what: str, path: str | None = None) -> None:
    """Raises :class:`ResourceLimitError` when ``nbytes`` for ``what`` exceed
    the memory this process can still allocate."""
    avail = available_memory()
    if nbytes > avail:
        raise ResourceLimitError(
            f"{path + ': ' if path else ''}{what} need {nbytes / 2**30:.2f} GiB, more than the "
            f"{avail / 2**30:.2f} GiB of memory available; nothing was allocated",
            path=path,
        )
