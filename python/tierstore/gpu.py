"""The GPU data path: the shim in ``hip/`` and torch's pinned copies behind one interface.

Bytes move between GPU memory and page-locked host memory that the engine
reads from or writes to directly: device -> pinned I/O buffer -> disk, and
back, with no bounce copy through pageable memory. Two ways to drive the
copies, chosen per process:

``shim``
    ``libtierstore_gpu.so``, built from ``hip/tierstore_gpu.cpp`` with
    ``nvcc`` (NVIDIA) or ``hipcc`` (AMD) into a cache folder, on first use
    or with ``python -m tierstore.gpu build``, and loaded with ctypes. It
    page-locks the engine's own buffers (``hipHostRegister`` /
    ``cudaHostRegister``) and copies on its own low-priority streams.
``torch``
    The fallback when no shim can be built or loaded: the same buffers
    registered through ``torch.cuda.cudart()``, copies as
    ``copy_(non_blocking=True)`` on a side stream of torch's.

``TIERSTORE_GPU_SHIM``: ``auto`` (default: the shim when a GPU and a
toolchain are present), ``0``/``off`` (torch's copies), or the path of a
built library (used or refused, never silently replaced).
``TIERSTORE_GPU_TOOLCHAIN``: the compiler to build with (a path to ``nvcc``
or ``hipcc``). ``tierstore info`` prints which path is in use and why.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tierstore._gpu_build import (
    ABI_VERSION,
    LIB_NAME,
    SOURCES,
    Toolchain,
    build,
    cache_dir,
    cuda_toolchain,
    find_toolchain,
    source_dir,
)
from tierstore.errors import DeviceError, InvalidArgumentError

# The build's names are re-exported: ``python -m tierstore.gpu build`` and
# callers find the whole shim here.
__all__ = [
    "ABI_VERSION",
    "LIB_NAME",
    "SOURCES",
    "Copier",
    "DeviceError",
    "PinnedBuffer",
    "Toolchain",
    "build",
    "cache_dir",
    "copier",
    "find_toolchain",
    "shim",
    "source_dir",
    "status",
]


D2H, H2D, D2D = 0, 1, 2


# ---------------------------------------------------------------------- shim


class Shim:
    """``libtierstore_gpu.so`` through ctypes. Every call that fails raises
    :class:`DeviceError` with the runtime's own message."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise DeviceError(f"cannot load the GPU shim {self.path}: {e}") from None
        self.lib = lib
        vp, sz, i, p_i, p_vp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_int), None
        p_vp = ctypes.POINTER(ctypes.c_void_p)
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "ts_gpu_abi_version": (i, []),
            "ts_gpu_platform": (ctypes.c_char_p, []),
            "ts_gpu_error_string": (ctypes.c_char_p, [i]),
            "ts_gpu_error_name": (ctypes.c_char_p, [i]),
            "ts_gpu_runtime_version": (i, [p_i]),
            "ts_gpu_driver_version": (i, [p_i]),
            "ts_gpu_device_count": (i, [p_i]),
            "ts_gpu_device_name": (i, [i, ctypes.c_char_p, i]),
            "ts_gpu_get_device": (i, [p_i]),
            "ts_gpu_set_device": (i, [i]),
            "ts_gpu_host_register": (i, [vp, sz]),
            "ts_gpu_host_unregister": (i, [vp]),
            "ts_gpu_is_pinned": (i, [vp]),
            "ts_gpu_pointer_device": (i, [vp, p_i]),
            "ts_gpu_stream_create": (i, [p_vp, i]),
            "ts_gpu_stream_destroy": (i, [vp]),
            "ts_gpu_stream_synchronize": (i, [vp]),
            "ts_gpu_stream_wait_event": (i, [vp, vp]),
            "ts_gpu_copy_async": (i, [vp, vp, sz, i, vp]),
            "ts_gpu_copy2d_async": (i, [vp, sz, vp, sz, sz, sz, i, vp]),
            "ts_gpu_event_create": (i, [p_vp, i]),
            "ts_gpu_event_destroy": (i, [vp]),
            "ts_gpu_event_record": (i, [vp, vp]),
            "ts_gpu_event_query": (i, [vp]),
            "ts_gpu_event_synchronize": (i, [vp]),
            "ts_gpu_event_elapsed_ms": (i, [ctypes.POINTER(ctypes.c_float), vp, vp]),
        }
        for name, (res, args) in sigs.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise DeviceError(f"the GPU shim {self.path} lacks {name}: rebuild it") from None
            fn.restype, fn.argtypes = res, args
        abi = lib.ts_gpu_abi_version()
        if abi != ABI_VERSION:
            raise DeviceError(
                f"the GPU shim {self.path} has C ABI {abi}, this tierstore needs {ABI_VERSION}: rebuild it"
            )
        self.platform: str = lib.ts_gpu_platform().decode()

    def check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.ts_gpu_error_string(err)
            raise DeviceError(
                f"{what} failed: {msg.decode() if msg else 'error ' + str(err)} (GPU runtime error {err})"
            )

    def call(self, name: str, *args: Any) -> None:
        self.check(getattr(self.lib, name)(*args), name)

    def int_out(self, name: str, *args: Any) -> int:
        v = ctypes.c_int(0)
        self.call(name, *args, ctypes.byref(v))
        return v.value

    def device_count(self) -> tuple[int, str | None]:
        n = ctypes.c_int(0)
        err = self.lib.ts_gpu_device_count(ctypes.byref(n))
        if err != 0:
            return 0, self.lib.ts_gpu_error_string(err).decode()
        return n.value, None

    def versions(self) -> tuple[int, int]:
        rt = self.int_out("ts_gpu_runtime_version")
        drv = ctypes.c_int(0)
        self.lib.ts_gpu_driver_version(ctypes.byref(drv))
        return rt, drv.value

    def device_name(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.call("ts_gpu_device_name", dev, buf, 256)
        return buf.value.decode(errors="replace")

    def is_pinned(self, addr: int) -> bool:
        return bool(self.lib.ts_gpu_is_pinned(ctypes.c_void_p(addr)))

    def pointer_device(self, addr: int) -> int:
        return self.int_out("ts_gpu_pointer_device", ctypes.c_void_p(addr))


_shim_lock = threading.Lock()
_shim_state: tuple[Shim | None, str] | None = None


def _torch_platform() -> str | None:
    if getattr(torch.version, "hip", None):
        return "hip"
    if torch.version.cuda:
        return "cuda"
    return None


def _resolve_shim() -> tuple[Shim | None, str]:
    mode = os.environ.get("TIERSTORE_GPU_SHIM", "auto").strip()
    if mode.lower() in ("0", "off", "no", "false", "torch"):
        return None, "TIERSTORE_GPU_SHIM=" + mode
    plat = _torch_platform()
    if mode.lower() not in ("", "auto", "1", "on", "yes", "true"):
        s = Shim(mode)  # an explicit library: used or refused with the reason
        if plat is not None and s.platform != plat:
            raise DeviceError(f"the GPU shim {mode} is built for {s.platform} but torch runs on {plat}")
        return s, f"TIERSTORE_GPU_SHIM={mode}"
    if plat is None:
        return None, "this torch has no GPU support"
    if not torch.cuda.is_available():
        return None, "no GPU visible to torch"
    tc = find_toolchain(plat)
    if tc is None:
        return (
            None,
            f"no {'hipcc' if plat == 'hip' else 'nvcc'} found to build the shim (torch's pinned copies instead)",
        )
    try:
        lib = build(tc)
        s = Shim(lib)
    except DeviceError as e:
        return None, f"the shim could not be built or loaded ({str(e).splitlines()[0][:300]})"
    n, err = s.device_count()
    if n == 0:
        return None, f"the shim sees no device ({err})"
    return s, f"built with {tc.compiler} into {lib.parent}"


def shim() -> Shim | None:
    """The loaded shim, or ``None`` when torch's copies are used (see
    :func:`status` for why)."""
    global _shim_state
    with _shim_lock:
        if _shim_state is None:
            _shim_state = _resolve_shim()
        return _shim_state[0]


def _reset_for_tests() -> None:
    global _shim_state
    with _shim_lock:
        _shim_state = None
        _copiers.clear()


def status() -> dict[str, Any]:
    """Which GPU path is in use and why (``tierstore info``)."""
    d: dict[str, Any] = {"torch_platform": _torch_platform()}
    try:
        s = shim()
        reason = _shim_state[1] if _shim_state else ""
    except DeviceError as e:
        return {**d, "path": "error", "reason": str(e)}
    if s is not None:
        rt, drv = s.versions()
        n, _ = s.device_count()
        d.update(
            path="shim",
            reason=reason,
            library=s.path,
            platform=s.platform,
            runtime_version=rt,
            driver_version=drv,
            devices=[s.device_name(i) for i in range(n)],
        )
    elif _torch_platform() is not None and torch.cuda.is_available():
        d.update(
            path="torch",
            reason=reason,
            devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        )
    else:
        d.update(path="none", reason=reason)
    return d


# -------------------------------------------------------------- pinned memory


class PinnedBuffer:
    """``nbytes`` of the engine's aligned host memory, page-locked for DMA
    (through the shim, or torch's runtime binding). Unlocked when dropped."""

    def __init__(self, nbytes: int) -> None:
        from tierstore._engine import host_buffer

        self.tensor = host_buffer(max(nbytes, 1))
        self.nbytes = nbytes
        self.addr = self.tensor.data_ptr()
        self.mem = memoryview(self.tensor.numpy())  # type: ignore[arg-type]
        s = shim()
        addr, size = self.addr, self.tensor.numel()
        self.pinned = True
        # The unlocking owns no reference to this object (else it would never
        # be collected); it runs before the memory itself is released.
        try:
            if s is not None:
                s.call("ts_gpu_host_register", ctypes.c_void_p(addr), ctypes.c_size_t(size))
                weakref.finalize(self, s.lib.ts_gpu_host_unregister, ctypes.c_void_p(addr))
            else:
                rt = torch.cuda.cudart()
                err = rt.cudaHostRegister(addr, size, 1)  # 1: portable
                if int(err) != 0:
                    raise DeviceError(f"{rt.cudaGetErrorString(err)} (GPU runtime error {int(err)})")
                weakref.finalize(self, rt.cudaHostUnregister, addr)
        except DeviceError as e:
            # Still correct, only slower: the runtime copies through its own
            # staging buffers. A save or load must not fail for want of it.
            self.pinned = False
            warnings.warn(
                f"tierstore: page-locking {size} bytes of host memory failed ({e}); GPU copies go through "
                "pageable memory, more slowly",
                RuntimeWarning,
                stacklevel=3,
            )

    def view(self, off: int, n: int) -> torch.Tensor:
        """A uint8 tensor over ``[off, off + n)``: its own storage of exactly
        ``n`` bytes (what a record or a torch checkpoint needs)."""
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mem[off : off + n], dtype=torch.uint8)


_pool_lock = threading.Lock()
_pool: list[PinnedBuffer] = []  # idle staging buffers kept for the next save
_ring: list[PinnedBuffer] = []  # idle slots of the load pipeline
_POOL_KEEP = 1  # the largest idle staging buffer: a training job saves the same state again and again


def take_pinned(nbytes: int) -> PinnedBuffer:
    """An idle cached staging buffer of at least ``nbytes`` (page-locking
    is costly: saves of the same state reuse one), else a new one."""
    with _pool_lock:
        fits = [b for b in _pool if b.nbytes >= nbytes]
        if fits:
            b = min(fits, key=lambda b: b.nbytes)
            _pool.remove(b)
            return b
    return PinnedBuffer(nbytes)


def give_back(buf: PinnedBuffer) -> None:
    """Returns a staging buffer to the cache, which keeps the largest."""
    with _pool_lock:
        _pool.append(buf)
        _pool.sort(key=lambda b: -b.nbytes)
        del _pool[_POOL_KEEP:]


def empty_cache() -> None:
    """Unlocks and frees the cached pinned buffers (staging and load slots)."""
    with _pool_lock:
        _pool.clear()
        _ring.clear()


# -------------------------------------------------------------------- copies


class Event:
    """A point in a copy stream: ``query()`` without blocking, ``wait()``."""

    __slots__ = ("_shim", "handle", "torch_event")

    def __init__(self, s: Shim | None, handle: int | None = None, torch_event: Any = None) -> None:
        self._shim, self.handle, self.torch_event = s, handle, torch_event

    def query(self) -> bool:
        if self._shim is None:
            return bool(self.torch_event.query())
        r = self._shim.lib.ts_gpu_event_query(ctypes.c_void_p(self.handle))
        if r in (0, 1):
            return bool(r == 0)
        self._shim.check(1 if r == -1 else r, "ts_gpu_event_query")  # -1: code 1, told apart from "not yet"
        return False

    def wait(self) -> None:
        if self._shim is None:
            self.torch_event.synchronize()
        else:
            self._shim.call("ts_gpu_event_synchronize", ctypes.c_void_p(self.handle))

    def __del__(self) -> None:
        if self._shim is not None and self.handle:
            self._shim.lib.ts_gpu_event_destroy(ctypes.c_void_p(self.handle))
            self.handle = None


class Copier:
    """Asynchronous copies between one device and pinned host memory, on a
    dedicated low-priority stream, through the shim when loaded, else
    through torch. Addresses are raw pointers: device tensors' ``data_ptr()``
    and :class:`PinnedBuffer` addresses."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.shim = shim()
        self.lock = threading.Lock()
        self.copies = 0  # copies issued, for the tests that count them
        self.torch_stream: torch.cuda.Stream
        if self.shim is not None:
            with torch.cuda.device(device):
                h = ctypes.c_void_p()
                self.shim.call("ts_gpu_set_device", device.index)
                self.shim.call("ts_gpu_stream_create", ctypes.byref(h), 1)
                self.stream_handle = h.value
                self.torch_stream = torch.cuda.ExternalStream(h.value, device=device)
        else:
            self.torch_stream = torch.cuda.Stream(device=device, priority=0)
            self.stream_handle = self.torch_stream.cuda_stream

    def after_current(self) -> None:
        """Copies issued after this wait for the work already queued on
        torch's current stream of the device (the step that produced the
        tensors), and for nothing else."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.torch_stream.wait_event(ev)

    def _issue(self, dst: int, src: int, n: int, kind: int) -> None:
        if n == 0:
            return
        self.copies += 1
        if self.shim is not None:
            self.shim.call(
                "ts_gpu_copy_async", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), kind,
                ctypes.c_void_p(self.stream_handle),
            )  # fmt: skip
            return

        # torch: uint8 views over both sides; pinned host memory makes the copy a DMA.
        def view(addr: int, on_device: bool) -> torch.Tensor:
            if on_device:
                return _device_view(addr, n, self.device)
            return torch.frombuffer((ctypes.c_ubyte * n).from_address(addr), dtype=torch.uint8)

        d = view(dst, kind != D2H)
        s = view(src, kind != H2D)
        with torch.cuda.stream(self.torch_stream):
            d.copy_(s, non_blocking=True)

    def d2h(self, host: int, dev: int, n: int) -> None:
        self._issue(host, dev, n, D2H)

    def h2d(self, dev: int, host: int, n: int) -> None:
        self._issue(dev, host, n, H2D)

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int) -> None:
        """``height`` rows of ``width`` bytes between strided memory (a
        column shard straight into a device tensor)."""
        if width == 0 or height == 0:
            return
        self.copies += 1
        if self.shim is not None:
            self.shim.call(
                "ts_gpu_copy2d_async", ctypes.c_void_p(dst), ctypes.c_size_t(dpitch), ctypes.c_void_p(src),
                ctypes.c_size_t(spitch), ctypes.c_size_t(width), ctypes.c_size_t(height), kind,
                ctypes.c_void_p(self.stream_handle),
            )  # fmt: skip
            return
        span_d = dpitch * (height - 1) + width
        span_s = spitch * (height - 1) + width
        if kind == H2D:
            d = _device_view(dst, span_d, self.device).as_strided((height, width), (dpitch, 1))
            s = torch.frombuffer((ctypes.c_ubyte * span_s).from_address(src), dtype=torch.uint8)
            s = s.as_strided((height, width), (spitch, 1))
        else:
            d = torch.frombuffer((ctypes.c_ubyte * span_d).from_address(dst), dtype=torch.uint8)
            d = d.as_strided((height, width), (dpitch, 1))
            s = _device_view(src, span_s, self.device).as_strided((height, width), (spitch, 1))
        with torch.cuda.stream(self.torch_stream):
            d.copy_(s, non_blocking=True)

    def record(self) -> Event:
        if self.shim is None:
            ev = torch.cuda.Event()
            ev.record(self.torch_stream)
            return Event(None, torch_event=ev)
        h = ctypes.c_void_p()
        self.shim.call("ts_gpu_event_create", ctypes.byref(h), 0)
        self.shim.call("ts_gpu_event_record", h, ctypes.c_void_p(self.stream_handle))
        return Event(self.shim, h.value)

    def synchronize(self) -> None:
        if self.shim is None:
            self.torch_stream.synchronize()
        else:
            self.shim.call("ts_gpu_stream_synchronize", ctypes.c_void_p(self.stream_handle))


def _device_view(addr: int, n: int, device: torch.device) -> torch.Tensor:
    """A uint8 device tensor over ``n`` bytes at ``addr`` (memory the caller
    holds), through the ``__cuda_array_interface__`` protocol."""
    cai = {"shape": (n,), "typestr": "|u1", "data": (addr, False), "version": 3, "strides": None}
    return torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=cai), device=device)


_copiers: dict[torch.device, Copier] = {}
_copiers_lock = threading.Lock()


def copier(device: torch.device | str | int) -> Copier:
    """The process's copier for ``device`` (one stream per device)."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise InvalidArgumentError(f"{dev} is not a GPU device")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _copiers_lock:
        c = _copiers.get(dev)
        if c is None:
            c = _copiers[dev] = Copier(dev)
        return c


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor in page-locked memory of its own, locked
    while this tensor lives (a view made from it does not keep it locked)."""
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    buf = PinnedBuffer(nbytes)
    t = buf.view(0, nbytes).view(dtype).view(tuple(shape))
    t._tierstore_pin = buf  # type: ignore[attr-defined]
    return t


def copy_to_device(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``final.copy_(host)`` for each pair of a device tensor and a host
    tensor, all issued at once on the copy streams (after the work queued on
    the current streams) and waited for together: one DMA each from pinned
    memory where both are dense and alike."""
    used: dict[torch.device, Copier] = {}
    for final, host in pairs:
        c = used.get(final.device)
        if c is None:
            c = used[final.device] = copier(final.device)
            c.after_current()
        if final.is_contiguous() and host.is_contiguous() and final.dtype == host.dtype and final.shape == host.shape:
            c.h2d(final.data_ptr(), host.data_ptr(), host.numel() * host.element_size())
        else:
            with torch.cuda.stream(c.torch_stream):
                final.copy_(host, non_blocking=True)
    for c in used.values():
        c.synchronize()


# --------------------------------------------------------------- save staging


class Staged:
    """Device storages copied into one pinned buffer, asynchronously: a gate
    per storage says when its bytes are in (the writer waits on it)."""

    def __init__(self, storages: Sequence[torch.UntypedStorage]) -> None:
        from tierstore import _core

        self.storages = list(storages)
        offs, at = [], 0
        for st in self.storages:
            offs.append(at)
            at += -(-st.nbytes() // 4096) * 4096
        self.buf = take_pinned(at)
        self.gate = _core.Gate()
        self.host: list[torch.UntypedStorage] = []
        events: list[Event] = []
        ordered: set[torch.device] = set()
        for st, off in zip(self.storages, offs, strict=True):
            c = copier(st.device)
            if st.device not in ordered:
                c.after_current()
                ordered.add(st.device)
            n = st.nbytes()
            c.d2h(self.buf.addr + off, st.data_ptr(), n)
            events.append(c.record())
            self.host.append(self.buf.view(off, n).untyped_storage())
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._advance, args=(events,), name="tierstore-d2h", daemon=True)
        self._thread.start()

    def _advance(self, events: list[Event]) -> None:
        try:
            for i, ev in enumerate(events):
                ev.wait()
                self.gate.advance(i + 1)
        except BaseException as e:  # the writer sees a failed gate and stops
            self.error = e
            self.gate.fail()

    def gates(self) -> dict[int, tuple[Any, int]]:
        return {st.data_ptr(): (self.gate, i + 1) for i, st in enumerate(self.host) if st.nbytes()}

    def wait(self) -> None:
        self._thread.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise DeviceError(f"copying tensors from the GPU failed: {self.error}") from self.error

    def release(self) -> None:
        """The pinned buffer goes back to the cache once every copy is done
        and nothing reads it any more."""
        self._thread.join()
        self.host.clear()
        give_back(self.buf)


# ------------------------------------------------------- load pipeline slots


RING_SLOT = 64 << 20  # bytes of one slot of the load pipeline
_RING_SLOTS = 4


def take_ring() -> list[PinnedBuffer]:
    """The load pipeline's pinned slots (idle cached ones, else new)."""
    with _pool_lock:
        slots = _ring[:_RING_SLOTS]
        del _ring[:_RING_SLOTS]
    return slots + [PinnedBuffer(RING_SLOT) for _ in range(_RING_SLOTS - len(slots))]


def give_ring(slots: list[PinnedBuffer]) -> None:
    """Returns the load pipeline's slots to the cache."""
    with _pool_lock:
        _ring.extend(slots)
        del _ring[_RING_SLOTS:]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m tierstore.gpu", description="tierstore's GPU shim")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the shim into the cache folder and print its path")
    b.add_argument("--toolchain", help="nvcc or hipcc to build with (default: found on this machine)")
    b.add_argument("--out", help="folder to build into (default: the cache folder)")
    b.add_argument("--force", action="store_true", help="rebuild even when a build is cached")
    sub.add_parser("info", help="which GPU path is in use and why (JSON)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        tc = None
        if a.toolchain:
            p = Path(a.toolchain)
            tc = Toolchain("hip", p) if "hipcc" in p.name else cuda_toolchain(p)
        try:
            lib = build(tc, Path(a.out) if a.out else None, force=a.force, quiet=False)
        except DeviceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(lib)
        return 0
    print(json.dumps(status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
