"""Background threads and their scheduling class.

A checkpoint's capture, checksums and write submission run while the model
trains; on a machine whose cores the step keeps busy, whatever CPU they take
the step loses. The Checkpointer's ``priority`` picks their class:

``"normal"`` (default)
    no change: the background work takes its share and finishes soon.
``"low"``
    nice 19 in the normal class: a small share of a contended core.
``"idle"``
    Linux ``SCHED_IDLE``: the thread runs only on cores the training leaves
    idle and is preempted at once when a training thread wakes.

Why the default is not lower (measured with ``benches/bench_checkpoint.py``
on a 2-core machine whose training kept both cores busy): a starved flush
keeps its snapshot's host buffer busy until the next checkpoint, which then
needs a second buffer of the state's size; touching fresh memory costs the
training thread page faults (2 MiB pages zeroed by the kernel; on a virtual
machine, guest memory touched for the first time costs far more), more than
the background work it was meant to yield to. Lower classes help where the
background work is long and cores are idle now and then (a GPU job's host).
The copies the step needs are never starved in any class: the step's
pre-hook copies whatever the capture thread has not taken.

Threads the engine starts from such a thread (checksum and write workers)
inherit its class. Names are set for profilers (``ts-capture``, ...).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

from tierstore.errors import InvalidArgumentError

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
        raise InvalidArgumentError(f"priority must be one of {', '.join(map(repr, PRIORITIES))}, got {priority!r}")
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
