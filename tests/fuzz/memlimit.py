"""The address-space limit the fuzz workers run under: what the process has
mapped once warmed up (torch, the library) plus a fixed headroom, so that a
file that makes a loader allocate what it does not hold fails as a
``MemoryError`` instead of taking the machine's memory."""

from __future__ import annotations

import resource

ADDRESS_SPACE_HEADROOM = 3 << 30


def vm_size() -> int:
    """This process's mapped address space in bytes (``VmSize``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def limit_address_space() -> int:
    """Caps ``RLIMIT_AS`` at :func:`vm_size` plus the headroom (never above
    the hard limit); returns the limit set."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_size() + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit
