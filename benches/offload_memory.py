"""Current memory of this process, sampled in a thread while a benchmark runs.

``ru_maxrss`` is a high-water mark: once an earlier phase (or an earlier mode
in the same process) set the peak, later phases cannot show anything. This
samples the *current* resident set (``/proc/self/statm``, every ``interval``
seconds) and, where given, an engine's own count of the host buffers it holds,
and tags every sample with the phase the benchmark says it is in (setup,
warm-up steps, timed steps), so that each phase has its own maximum and its
steady value (the median of its samples). At each phase change it also reads
``/proc/self/smaps_rollup`` once (anonymous, huge-page, locked and file-backed
parts of the resident set).

Standard library only: benches/ds_baseline.py (run by DeepSpeed's own
interpreter) uses it too. Linux only.

    mem = RssSampler(engine=lambda: opt.host_bytes())
    mem.start()            # phase "start"; the base is read here
    mem.phase("timed", trim=True)   # the heap's free memory given back first
    ...
    summary = mem.stop()   # {"base_bytes": ..., "phases": {"timed": {"max": ..., "median": ...}}, ...}
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")
ROLLUP_KEYS = ("Rss", "Anonymous", "AnonHugePages", "Locked", "Shared_Clean", "Private_Clean")


def rss_now() -> int:
    """Bytes resident now (statm's second field, in pages)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def rollup() -> dict[str, int]:
    """Parts of the resident set in bytes, from /proc/self/smaps_rollup (empty where missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, rest = line.partition(":")
                if k in ROLLUP_KEYS:
                    out[k] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def trim_heap() -> int:
    """Returns the C heap's free memory to the system (glibc ``malloc_trim(0)``);
    the bytes of RSS that went. Tensors of a few MiB are allocated on the heap
    (glibc raises its mmap threshold up to 32 MiB), so what a setup allocated
    and freed stays resident, though free, until this or a reuse."""
    before = rss_now()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return 0
    return before - rss_now()


def _stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"samples": 0}
    return {
        "samples": len(values),
        "max": max(values),
        "median": int(statistics.median(values)),
        "min": min(values),
        "last": values[-1],
    }


class RssSampler:
    """Samples the current RSS (and ``engine()``, bytes the engine says it holds) every ``interval`` s."""

    def __init__(self, interval: float = 0.02, engine: Callable[[], int] | None = None) -> None:
        self.interval = interval
        self.engine = engine
        self._phase = "start"
        self._samples: list[tuple[str, int, int | None]] = []
        self._rollups: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.base_bytes = 0
        self.trimmed: dict[str, int] = {}  # phase -> bytes malloc_trim returned at its start

    def start(self) -> RssSampler:
        self.base_bytes = rss_now()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def set_engine(self, engine: Callable[[], int] | None) -> None:
        self.engine = engine

    def _sample(self) -> None:
        eng = None
        if self.engine is not None:
            try:
                eng = int(self.engine())
            except Exception:  # the object is being closed: no reading this time
                eng = None
        with self._lock:
            self._samples.append((self._phase, rss_now(), eng))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def phase(self, name: str, trim: bool = False) -> None:
        """Samples now, notes the resident set's parts at the end of the phase
        that ends, and starts ``name``; ``trim``: first returns the heap's free
        memory to the system (:func:`trim_heap`), noting how much that was."""
        self._sample()
        with self._lock:
            self._rollups[self._phase] = rollup()
        if trim:
            self.trimmed[name] = trim_heap()
        with self._lock:
            self._phase = name
        self._sample()

    def stop(self) -> dict[str, Any]:
        self.phase("end")
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        phases: dict[str, Any] = {}
        with self._lock:
            names = list(dict.fromkeys(p for p, _, _ in self._samples))
            for name in names:
                rss = [r for p, r, _ in self._samples if p == name]
                eng = [e for p, _, e in self._samples if p == name and e is not None]
                phases[name] = {"rss": _stats(rss), "engine": _stats(eng)}
                if name in self._rollups:
                    phases[name]["rollup_at_end"] = self._rollups[name]
        return {
            "base_bytes": self.base_bytes,
            "interval_s": self.interval,
            "phases": phases,
            "trimmed_bytes": dict(self.trimmed),
            # The old measure, for comparison: the process's high-water mark (kernel's KiB).
            "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "time": time.time(),
        }
