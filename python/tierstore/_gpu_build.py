"""Building the GPU shim: finding a toolchain (``nvcc`` from the CUDA
toolkit or the ``nvidia-cuda-nvcc`` wheel, ``hipcc``), compiling ``hip/``
into a cache folder keyed by the sources and the compiler, once per machine
(a lock file keeps concurrent builders from racing). The library is loaded
and used in :mod:`tierstore.gpu`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tierstore.errors import DeviceError, InvalidArgumentError

ABI_VERSION = 1
LIB_NAME = "libtierstore_gpu.so"
SOURCES = ("tierstore_gpu.cpp", "ts_gpu_runtime.h")


def source_dir() -> Path | None:
    """Where the shim's sources are: ``TIERSTORE_GPU_SRC``, else ``hip/`` of
    the source tree this package runs from."""
    env = os.environ.get("TIERSTORE_GPU_SRC")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    cands += [here / "_hip", here.parents[1] / "hip"]
    for c in cands:
        if all((c / s).is_file() for s in SOURCES):
            return c
    return None


def cache_dir() -> Path:
    base = os.environ.get("TIERSTORE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tierstore"
    )
    return Path(base) / "gpu"


# ----------------------------------------------------------------- toolchain


@dataclass(frozen=True)
class Toolchain:
    """A compiler for the shim and what it needs beside it."""

    kind: str  # "cuda" or "hip"
    compiler: Path
    include: tuple[Path, ...] = ()
    runtime_lib: Path | None = None  # libcudart.so.N to link (CUDA)

    def command(self, src: Path, out: Path) -> list[str]:
        if self.kind == "cuda":
            cmd = [str(self.compiler), "-O2", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra", "-cudart", "none"]
            cmd += [f"-I{p}" for p in self.include]
            cmd += ["-DTS_GPU_USE_CUDA", str(src), "-o", str(out)]
            if self.runtime_lib is not None:
                # Linked by its full path so that the library's soname
                # (libcudart.so.N) is what the shim needs at run time: the
                # copy torch has loaded already when present, the same runtime
                # instance and so the same streams and events.
                cmd += ["-Xlinker", str(self.runtime_lib), "-Xlinker", f"-rpath,{self.runtime_lib.parent}"]
            return cmd
        # hipcc: host code only (no kernels), so no offload architecture matters;
        # naming one keeps hipcc from probing for devices on a machine without any.
        return [
            str(self.compiler),
            "--offload-arch=gfx90a",
            "-DTS_GPU_USE_HIP",
            "-D__HIP_PLATFORM_AMD__",
            "-x",
            "c++",
            "-O2",
            "-fPIC",
            "-Wall",
            "-Wextra",
            "-shared",
            *[f"-I{p}" for p in self.include],
            str(src),
            "-o",
            str(out),
        ]


def _nvidia_dirs() -> list[Path]:
    """``nvidia/cuNN`` folders of pip-installed CUDA wheels on ``sys.path``
    (the nvcc, crt and runtime wheels, or those torch depends on)."""
    out: list[Path] = []
    for p in sys.path + os.environ.get("TIERSTORE_GPU_TOOLCHAIN_PATH", "").split(os.pathsep):
        if not p:
            continue
        base = Path(p) / "nvidia"
        if base.is_dir():
            out += sorted(d for d in base.iterdir() if d.is_dir() and (d / "include").is_dir())
            out += [d for d in (base / "cuda_runtime", base / "cuda_nvcc") if d.is_dir()]
    return out


def cuda_toolchain(nvcc: Path) -> Toolchain:
    roots = [nvcc.resolve().parent.parent, *_nvidia_dirs()]
    include = [r / "include" for r in roots if (r / "include" / "cuda_runtime_api.h").is_file()]
    crt = [r / "include" for r in roots if (r / "include" / "crt" / "host_defines.h").is_file()]
    runtime = None
    for r in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            libs = sorted((r / sub).glob("libcudart.so.[0-9]*")) if (r / sub).is_dir() else []
            libs = [p for p in libs if p.name.count(".") == 2]  # libcudart.so.N
            if libs:
                runtime = libs[-1]
                break
        if runtime is not None:
            break
    inc = tuple(dict.fromkeys(include + crt))
    return Toolchain("cuda", nvcc, inc, runtime)


def find_toolchain(kind: str | None = None) -> Toolchain | None:
    """The compiler the shim is built with: ``TIERSTORE_GPU_TOOLCHAIN``, else
    ``hipcc`` for a ROCm build of torch and ``nvcc`` otherwise (on ``PATH``,
    under ``CUDA_HOME``/``ROCM_PATH``, or from the pip wheels)."""
    env = os.environ.get("TIERSTORE_GPU_TOOLCHAIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise InvalidArgumentError(f"TIERSTORE_GPU_TOOLCHAIN={env!r} is not a file")
        return Toolchain("hip", p) if "hipcc" in p.name else cuda_toolchain(p)
    if kind is None:
        kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
    if kind == "hip":
        cands = [shutil.which("hipcc")]
        rocm = os.environ.get("ROCM_PATH") or "/opt/rocm"
        cands.append(os.path.join(rocm, "bin", "hipcc"))
        for c in cands:
            if c and os.path.isfile(c):
                return Toolchain("hip", Path(c))
        return None
    cands = [shutil.which("nvcc")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    cands += [str(d / "bin" / "nvcc") for d in _nvidia_dirs()]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return cuda_toolchain(Path(c))
    return None


def _build_key(tc: Toolchain, src: Path) -> str:
    h = hashlib.sha256()
    for s in SOURCES:
        h.update((src / s).read_bytes())
    h.update(" ".join(tc.command(Path("x.cpp"), Path("x.so"))).encode())
    try:
        st = tc.compiler.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        pass
    return h.hexdigest()[:16]


def build(
    toolchain: Toolchain | None = None, out_dir: Path | None = None, *, force: bool = False, quiet: bool = True
) -> Path:
    """Builds the shim (once per source and compiler; a cached build is
    reused) and returns the library's path. Raises :class:`DeviceError`
    when there is no source or no compiler, or the compile fails."""
    src = source_dir()
    if src is None:
        raise DeviceError(
            "the GPU shim's sources (hip/tierstore_gpu.cpp) are not found: set TIERSTORE_GPU_SRC to the "
            "hip/ folder of a tierstore source tree"
        )
    tc = toolchain or find_toolchain()
    if tc is None:
        raise DeviceError(
            "no GPU compiler found to build the shim: install the CUDA toolkit (nvcc) or ROCm (hipcc), "
            "or set TIERSTORE_GPU_TOOLCHAIN to its path"
        )
    out = (out_dir or cache_dir() / f"{tc.kind}-{_build_key(tc, src)}") / LIB_NAME
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Ranks of one node share the cache: one builds, the others wait for it.
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and not force:
            return out
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            part = Path(tmp) / LIB_NAME
            cmd = tc.command(src / SOURCES[0], part)
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0 or not part.is_file():
                raise DeviceError(
                    f"building the GPU shim failed ({' '.join(cmd)}), exit status {r.returncode}:\n"
                    f"{(r.stderr or r.stdout)[-4000:]}"
                )
            if not quiet:
                print(" ".join(cmd))
            os.replace(part, out)
    return out
