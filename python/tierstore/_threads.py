"""Background threads that yield the CPU to training.

A checkpoint's capture, checksums and write submission run while the model
trains on every core; whatever CPU they take, the step loses, and on a
machine whose cores the step keeps busy, a background thread that preempts
one of torch's OpenMP workers stalls the whole parallel region at its next
barrier. So tierstore's background threads run under a lower scheduling
class:

``"idle"`` (default)
    Linux ``SCHED_IDLE``: the thread runs only on cores the training leaves
    idle and is preempted at once when a training thread wakes. If training
    never leaves a core idle, background work slows down and the
    Checkpointer's backpressure (``on_busy``) takes over, which never costs
    more than a synchronous save.
``"low"``
    nice 19 in the normal class: a small share of a contended core.
``"normal"``
    no change.

Threads the engine starts from such a thread (checksum and write workers)
inherit its class. Names are set for profilers (``ts-capture``, ...).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

PRIORITIES = ("idle", "low", "normal")
_PR_SET_NAME = 15

_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(map(repr, PRIORITIES))}, got {priority!r}")
    return priority


def set_name(name: str) -> None:
    """Names the calling OS thread (at most 15 bytes are kept)."""
    libc = _get_libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def lower_priority(priority: str) -> str | None:
    """Moves the calling thread to the scheduling class ``priority``; returns
    why it could not (None when it did, or nothing was asked)."""
    if priority == "normal":
        return None
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
            return None
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # per thread on Linux
        return None
    except (OSError, AttributeError) as e:
        return str(e)


def current_policy() -> str:
    """The calling thread's scheduling class, as :data:`PRIORITIES` names it."""
    if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE:
        return "idle"
    return "low" if os.getpriority(os.PRIO_PROCESS, 0) > 0 else "normal"
