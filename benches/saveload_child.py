"""One save or one cold load in a fresh process, for ``bench_save_load.py``.

Run by the benchmark, one process per measurement, so that no earlier
measurement has set the memory high-water mark, warmed an allocator or left
buffers behind:

    python benches/saveload_child.py '{"op": "load", "system": "tierstore", ...}' result.json

``"op": "floor"`` measures no system: it populates fresh memory of the state's
size (see ``fresh_memory``), the floor of every load into memory of its own.

For a save it builds the state dict (deterministically) first; for a load it
starts from the file alone. Just before the operation it levels memory (see
``prefault``), writes back dirty data, and, for loads, evicts the file from the
page cache (fsync, ``POSIX_FADV_DONTNEED``) and checks with ``mincore`` that
none of it is left. During the operation a thread samples the
current RSS from ``/proc/self/statm`` every 2 ms, and the kernel's own peak
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before) catches
anything between samples. It reports wall and CPU time, the RSS baseline, the
peak above it, the RSS once the operation is over (a load's result still
held), the bytes the process read from and wrote to the block layer
(``/proc/self/io``), and, for tierstore, the engine's own buffer accounting.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import random
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def large_spec(total: int) -> list[tuple[str, torch.dtype, int]]:
    """``large``: six fp32 tensors (3/4 of ``total``) and four bf16 ones."""
    n32 = int(total * 0.75) // 6 // 4
    n16 = int(total * 0.25) // 4 // 2
    return [(f"layer{i}.weight", torch.float32, n32) for i in range(6)] + [
        (f"emb{i}.weight", torch.bfloat16, n16) for i in range(4)
    ]


def small_spec(count: int) -> list[tuple[str, torch.dtype, int]]:
    """``small``: ``count`` tensors of 4-256 KiB, fp32 and bf16 alternating."""
    rng = random.Random(0)
    out = []
    for i in range(count):
        nbytes = rng.randint(4, 256) * 1024
        if i % 2:
            out.append((f"blk{i}.w", torch.float32, nbytes // 4))
        else:
            out.append((f"blk{i}.w", torch.bfloat16, nbytes // 2))
    return out


def spec_for(dataset: str, large_gib: float, small_count: int) -> list[tuple[str, torch.dtype, int]]:
    return large_spec(int(large_gib * (1 << 30))) if dataset == "large" else small_spec(small_count)


def spec_bytes(spec: list[tuple[str, torch.dtype, int]]) -> int:
    return sum(n * torch.empty(0, dtype=dt).element_size() for _, dt, n in spec)


def build(spec: list[tuple[str, torch.dtype, int]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name, dt, n in spec:
        out[name] = torch.randn(n, generator=g).to(dt)
    return out


def prefault(nbytes: int) -> None:
    """Touches and frees ``nbytes`` (+256 MiB) of memory before a measurement.

    On a virtual machine the first touch of guest memory that the host has
    reclaimed is many times slower than later touches; every measurement
    starts right after this, so none pays (or escapes) that cost by luck of
    ordering. On bare metal it changes nothing.
    """
    t = torch.empty(nbytes + (256 << 20), dtype=torch.uint8)
    t.fill_(1)
    del t


def fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def evict(path: Path) -> None:
    """Makes ``path`` cold: written back, then its pages dropped from the page
    cache (``POSIX_FADV_DONTNEED``; ``resident_bytes`` checks that none is
    left). The file's pages alone: dropping every clean page (``drop_caches``)
    here would also evict the parts of torch's libraries that the operation
    runs for the first time, and the measurement would read them back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module names it from 3.13


def fresh_memory(nbytes: int) -> dict[str, Any]:
    """The floor of a load into fresh memory: ``nbytes`` of anonymous memory
    mapped and populated (``MADV_POPULATE_WRITE``: each page allocated,
    zeroed and mapped, nothing read), after the same levelling as a load.

    Every loader that returns its tensors in memory of their own (not mapped
    from the file's page cache) pays at least this, whatever it reads and
    however; a loader that maps the file privately pays none of it. The
    pages are the kernel's default for the mapping (no huge-page advice)."""
    size = (nbytes + PAGE - 1) // PAGE * PAGE
    addr = _libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the fresh-memory floor failed")
    try:
        method = "MADV_POPULATE_WRITE"
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if _libc.madvise(addr, size, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE failed")
            method = "memset"  # a kernel before 5.14: the pages faulted in by writing them
            ctypes.memset(addr, 0, size)
        dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        _libc.munmap(addr, size)
    return {
        "seconds": dt,
        "cpu_seconds": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
        "sys_seconds": r1.ru_stime - r0.ru_stime,
        "minor_faults": r1.ru_minflt - r0.ru_minflt,
        "bytes": nbytes,
        "method": method,
    }


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` on a mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return -1
            return bytes(vec).count(b"\x01") * PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def proc_io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def device_counts(path: Path) -> tuple[int, int, int, int] | None:
    """Requests and bytes the block device holding ``path`` has completed
    (reads, read bytes, writes, written bytes; ``/proc/diskstats``, the
    whole device's: nothing else runs during a measurement), or None where
    ``path`` is on no block device (tmpfs, a network file system)."""
    st = os.stat(path.parent if not path.exists() else path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if len(f) >= 10 and int(f[0]) == major and int(f[1]) == minor:
                return int(f[3]), int(f[5]) * 512, int(f[7]), int(f[9]) * 512
    except (OSError, ValueError):
        return None
    return None


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
        return True
    except OSError:
        return False


class RSSSampler:
    """Samples current RSS (and its anonymous part) from /proc/self/statm every
    2 ms in a thread; keeps the peak and the longest gap between samples."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.base, self.base_anon = self.read()
        self.peak, self.peak_anon = self.base, self.base_anon
        self.samples = 0
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def read(self) -> tuple[int, int]:
        f = os.pread(self.fd, 256, 0).split()
        rss, shared = int(f[1]) * PAGE, int(f[2]) * PAGE
        return rss, rss - shared

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            rss, anon = self.read()
            self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
            self.samples += 1
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            time.sleep(0.002)

    def __enter__(self) -> RSSSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        rss, anon = self.read()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)


def touch(obj: Any) -> None:
    """Reads one byte of every page of every tensor (forces lazy loads)."""
    vals = obj.values() if isinstance(obj, dict) else obj
    acc = 0
    for t in vals:
        if isinstance(t, torch.Tensor) and t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            acc += int(flat[::4096].sum())
    if acc == -1:
        print("impossible")


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle_rss(sampler: RSSSampler) -> int:
    """Current RSS once the operation is over (after a collection and 200 ms)."""
    gc.collect()
    time.sleep(0.2)
    return sampler.read()[0]


def main() -> int:
    job = json.loads(sys.argv[1])
    out_path = Path(sys.argv[2])
    op, system, path = job["op"], job["system"], Path(job["file"])
    torch.manual_seed(0)
    spec = spec_for(job["dataset"], job["large_gib"], job["small_count"])
    nbytes = spec_bytes(spec)
    if op == "floor":
        if job["level"]:
            prefault(nbytes)
        out_path.write_text(json.dumps(fresh_memory(nbytes)))
        return 0
    res: dict[str, Any] = {}
    engine_start_s = None
    if system.startswith("tierstore"):
        import tierstore

        t0 = time.perf_counter()
        tierstore.get_engine()  # started before the clock, as in a process that saves more than once
        engine_start_s = time.perf_counter() - t0
    if system == "safetensors":
        import safetensors.torch as st
    fn: Any
    if op == "save":
        sd = build(spec)
        path.unlink(missing_ok=True)
        if system == "tierstore":

            def fn() -> None:
                tierstore.save(sd, path)
        elif system == "torch.save":

            def fn() -> None:
                with open(path, "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_path(path)
        elif system == "safetensors":

            def fn() -> None:
                st.save_file(sd, str(path))
                fsync_path(path)
        else:
            raise ValueError(system)
    else:
        loaders = {
            "tierstore": lambda: tierstore.load(path),
            "tierstore mmap": lambda: tierstore.load(path, mmap=True),
            "torch.load": lambda: torch.load(path),
            "torch.load mmap": lambda: torch.load(path, mmap=True),
            "safetensors": lambda: st.load_file(str(path)),
        }
        load = loaders[system]
        held: list[Any] = []

        def fn() -> None:
            obj = load()
            touch(obj)
            held.append(obj)

    if job["level"]:
        prefault(nbytes)
    os.sync()  # every operation starts with nothing dirty in the cache
    if op == "load":
        evict(path)
        res["file_cached_before"] = resident_bytes(path)
    gc.collect()
    io0 = proc_io()
    dev0 = device_counts(path)
    hwm_ok = reset_hwm()
    with RSSSampler() as rss:
        c0, t0 = cpu_now(), time.perf_counter()
        fn()
        dt, dc = time.perf_counter() - t0, cpu_now() - c0
        hwm = vm_hwm() if hwm_ok else 0
    io1 = proc_io()
    dev1 = device_counts(path)
    if dev0 is not None and dev1 is not None:
        # The requests the device served for the operation and their mean size:
        # how the block layer cut what was asked (a virtio disk: at most its
        # segments per request, ~1 MiB from scattered 4 KiB pages).
        k = 0 if op == "load" else 2
        res["device_requests"] = dev1[k] - dev0[k]
        res["device_request_bytes"] = dev1[k + 1] - dev0[k + 1]
    after = settle_rss(rss)
    res.update(
        seconds=dt,
        cpu_seconds=dc,
        bytes=nbytes,
        file_bytes=path.stat().st_size,
        rss_base=rss.base,
        rss_peak_sampled=rss.peak,
        rss_peak_hwm=hwm,
        rss_peak=max(rss.peak, hwm),
        rss_peak_anon=rss.peak_anon,
        rss_after=after,
        rss_samples=rss.samples,
        rss_max_gap_s=rss.max_gap,
        read_bytes=io1["read_bytes"] - io0["read_bytes"],
        write_bytes=io1["write_bytes"] - io0["write_bytes"],
        rchar=io1["rchar"] - io0["rchar"],
    )
    if system.startswith("tierstore"):
        res["engine_start_s"] = engine_start_s
        res["engine_pool_allocated_bytes"] = tierstore.get_engine().info()["pool_allocated_bytes"]
    if op == "load":
        held.clear()
        res["rss_released"] = settle_rss(rss)
    out_path.write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
