"""The GPU shim without a GPU: it compiles with nvcc (pip wheels) and with
Debian's hipcc, the loader checks what it loads, and without a device the
GPU path reports why it is not in use (tierstore info)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import gpu
from tierstore.errors import DeviceError

ROOT = Path(__file__).resolve().parent.parent
EXPORTS = [
    "ts_gpu_abi_version",
    "ts_gpu_host_register",
    "ts_gpu_host_unregister",
    "ts_gpu_stream_create",
    "ts_gpu_stream_wait_event",
    "ts_gpu_copy_async",
    "ts_gpu_copy2d_async",
    "ts_gpu_event_record",
    "ts_gpu_event_query",
    "ts_gpu_event_synchronize",
    "ts_gpu_device_count",
    "ts_gpu_driver_version",
]


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERSTORE_GPU_SHIM", raising=False)
    gpu._reset_for_tests()
    yield
    gpu._reset_for_tests()


def _exports(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def _no_warnings(tc: gpu.Toolchain, out: Path) -> None:
    """The shim compiles without a warning (-Wall -Wextra)."""
    src = gpu.source_dir()
    assert src is not None
    r = subprocess.run(tc.command(src / gpu.SOURCES[0], out), capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr


def _nvcc() -> gpu.Toolchain:
    tc = gpu.find_toolchain("cuda")
    if tc is None:
        pytest.skip("no nvcc: `make gpu-toolchains` installs it from pip wheels")
    return tc


def test_the_shim_compiles_with_nvcc_and_loads(tmp_path: Path) -> None:
    tc = _nvcc()
    assert tc.runtime_lib is not None and tc.runtime_lib.name.startswith("libcudart.so.")
    lib = gpu.build(tc, tmp_path)
    assert lib.is_file() and set(EXPORTS) <= _exports(lib)
    _no_warnings(tc, tmp_path / "w.so")
    # It needs the shared CUDA runtime by soname (the copy torch loads, when
    # torch has loaded one): one runtime, one set of streams and events.
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert f"[{tc.runtime_lib.name}]" in needed
    s = gpu.Shim(lib)
    assert s.platform == "cuda"
    rt, _drv = s.versions()
    assert rt >= 12000
    n, err = s.device_count()
    if not torch.cuda.is_available():
        assert n == 0 and err  # the runtime's own reason, not a crash
    # A second build of the same source and compiler is the cached one.
    assert gpu.build(tc, tmp_path) == lib


def test_the_shim_compiles_with_hipcc(tmp_path: Path) -> None:
    if shutil.which("hipcc") is None or not Path("/usr/include/hip/hip_runtime_api.h").is_file():
        pytest.skip("no hipcc with the HIP runtime headers: `make gpu-toolchains` installs them (apt, as root)")
    tc = gpu.find_toolchain("hip")
    assert tc is not None
    lib = gpu.build(tc, tmp_path)
    assert set(EXPORTS) <= _exports(lib)
    _no_warnings(tc, tmp_path / "w.so")
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "libamdhip64.so" in needed


def test_a_build_failure_names_the_compiler_and_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tc = _nvcc()
    src = tmp_path / "src"
    shutil.copytree(ROOT / "hip", src)
    (src / "tierstore_gpu.cpp").write_text("this is not C++\n")
    monkeypatch.setenv("TIERSTORE_GPU_SRC", str(src))
    with pytest.raises(DeviceError, match=r"building the GPU shim failed .*nvcc.*exit status"):
        gpu.build(tc, tmp_path / "out")
    assert not (tmp_path / "out" / gpu.LIB_NAME).exists()  # nothing half-built left to load


def _fake_shim(tmp_path: Path, abi: int) -> Path:
    src = tmp_path / "fake.c"
    src.write_text(f"int ts_gpu_abi_version(void) {{ return {abi}; }}\n")
    lib = tmp_path / f"fake{abi}.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib


def test_the_loader_refuses_a_library_that_is_not_the_shim(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match="cannot load the GPU shim"):
        gpu.Shim(tmp_path / "missing.so")
    with pytest.raises(DeviceError, match="lacks ts_gpu_"):
        gpu.Shim(_fake_shim(tmp_path, 1))


def test_an_explicit_shim_is_used_or_refused_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_GPU_SHIM", str(tmp_path / "missing.so"))
    with pytest.raises(DeviceError, match=r"missing\.so"):
        gpu.shim()
    st = gpu.status()
    assert st["path"] == "error" and "missing.so" in st["reason"]


def test_without_a_gpu_the_path_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert gpu.shim() is None
    st = gpu.status()
    assert st["path"] == "none" and st["reason"] == "no GPU visible to torch"
    gpu._reset_for_tests()
    monkeypatch.setenv("TIERSTORE_GPU_SHIM", "0")
    st = gpu.status()
    assert st["path"] == "none" and st["reason"] == "TIERSTORE_GPU_SHIM=0"


def test_info_reports_the_gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_GPU_SHIM", "0")
    d = tierstore.info()
    assert d["gpu"]["path"] in ("torch", "none") and d["gpu"]["reason"] == "TIERSTORE_GPU_SHIM=0"
    assert "backend" in d and "path" in d
    env = {**os.environ, "TIERSTORE_GPU_SHIM": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "tierstore", "info", "--json"], capture_output=True, text=True, env=env, check=True
    ).stdout
    d = json.loads(out)
    assert d["gpu"]["reason"] == "TIERSTORE_GPU_SHIM=0"
    text = subprocess.run(
        [sys.executable, "-m", "tierstore", "info"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert "GPU path:" in text and "TIERSTORE_GPU_SHIM=0" in text


def test_the_build_command(tmp_path: Path) -> None:
    tc = _nvcc()
    r = subprocess.run(
        [sys.executable, "-m", "tierstore.gpu", "build", "--toolchain", str(tc.compiler), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ},
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]) == tmp_path / gpu.LIB_NAME


def test_records_are_read_in_windows_with_the_crc_combined() -> None:
    """The device load checks a record's CRC-32 window by window: the
    combination equals the CRC of the whole."""
    import zlib

    from tierstore import _core

    data = os.urandom(3 * 4096 + 17)
    buf = ctypes.create_string_buffer(data, len(data))
    addr = ctypes.addressof(buf)
    acc = 0
    for lo in range(0, len(data), 5000):
        n = min(5000, len(data) - lo)
        part = _core.crc32_regions([(addr + lo, n)])[0]
        acc = part if lo == 0 else _core.crc32_combine(acc, part, n)
    assert acc == zlib.crc32(data)


def test_gpu_check_stops_clearly_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = subprocess.run(
        ["bash", str(ROOT / "benches" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PY": sys.executable, "OUT": str(tmp_path)},
        check=False,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no GPU" in r.stderr and "nothing was run" in r.stderr
    assert tierstore.__version__


def test_the_wheel_carries_the_shim_source() -> None:
    """The shim is built on first use from the source inside the package
    (python/tierstore/_hip is hip/, included in the wheel by pyproject)."""
    pkg = ROOT / "python" / "tierstore" / "_hip"
    assert pkg.resolve() == (ROOT / "hip").resolve()
    assert 'path = "python/tierstore/_hip/*"' in (ROOT / "pyproject.toml").read_text()
    src = gpu.source_dir()
    assert src is not None and all((src / s).is_file() for s in gpu.SOURCES)


def test_pinned_memory_is_unlocked_when_its_buffer_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-locked buffer is unlocked once nothing holds it (its finalizer
    must not keep it alive), so a cache that lets buffers go leaks no pinned
    memory. The runtime is a recording stand-in here."""
    import gc
    import weakref

    calls: list[tuple[str, int]] = []

    class FakeLib:
        def ts_gpu_host_unregister(self, p: ctypes.c_void_p) -> int:
            calls.append(("unregister", int(p.value or 0)))
            return 0

    class FakeShim:
        lib = FakeLib()

        def call(self, name: str, p: ctypes.c_void_p, n: ctypes.c_size_t) -> None:
            calls.append(("register", int(p.value or 0)))

    monkeypatch.setattr(gpu, "shim", lambda: FakeShim())
    b = gpu.PinnedBuffer(1 << 20)
    addr = b.addr
    v = b.view(4096, 100)  # a view keeps the memory, not the lock
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None, "the buffer is collected"
    assert calls == [("register", addr), ("unregister", addr)]
    v[:] = 7  # the memory itself is still valid for the view
    assert int(v.sum()) == 700
    monkeypatch.setattr(gpu, "shim", lambda: FakeShim())
    keep = [gpu.take_pinned(1 << 20) for _ in range(3)]
    for k in keep:
        gpu.give_back(k)
    del keep, k
    gc.collect()
    assert sum(1 for c, _a in calls if c == "unregister") == 1 + 2  # the cache keeps one of the three
    gpu.empty_cache()
    gc.collect()
    assert sum(1 for c, _a in calls if c == "register") == sum(1 for c, _a in calls if c == "unregister")


def test_memory_that_cannot_be_page_locked_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime that refuses to page-lock (a memory limit) costs speed, not
    the save or load: the buffer is plain memory, with a warning."""

    class Refusing:
        def call(self, name: str, *args: object) -> None:
            raise DeviceError(f"{name} failed: out of memory (GPU runtime error 2)")

    monkeypatch.setattr(gpu, "shim", lambda: Refusing())
    with pytest.warns(RuntimeWarning, match="page-locking .* failed .*out of memory"):
        b = gpu.PinnedBuffer(1 << 16)
    assert not b.pinned
    v = b.view(0, 16)
    v[:] = 3
    assert int(v.sum()) == 48
