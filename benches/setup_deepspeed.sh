#!/usr/bin/env bash
# Cached environment for benches/ds_baseline.py: DeepSpeed's NVMe optimizer
# swapper (ZeRO-Infinity) on the CPU, to compare against tierstore's offload.
#
#     PY=$(bash benches/setup_deepspeed.sh)    # prints the interpreter to use
#     "$PY" benches/ds_baseline.py --params 50e6 --host 256MiB --dir .
#
# The environment is a separate virtual environment under ~/.cache/tierstore,
# keyed by the DeepSpeed version and the hash of requirements/dev.txt, that
# sees the project's shared dependencies (torch, numpy, psutil, pip, ...)
# through a .pth file, exactly like the checkout's .venv does (see the
# Makefile). DeepSpeed is installed without its dependencies, so no second
# torch comes in; only the small packages that `import deepspeed` needs are
# added. The aio op (and the pin_memory op it loads first) is JIT-built once
# into <venv>/torch_extensions (a few minutes on 2 cores); later runs load it
# at once. Safe to run again and from several shells at once (flock).
#
# Needs: a C++ compiler, libaio-dev (the Debian package, installed here with
# apt-get when missing and run as root), the project's shared dependencies
# (built here with the Makefile's own rule if missing).
# Environment: PY (python3), CACHE (~/.cache/tierstore), DS_VERSION (0.19.8).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-python3}
CACHE=${CACHE:-$HOME/.cache/tierstore}
DS_VERSION=${DS_VERSION:-0.19.8}
# The few packages `import deepspeed` needs that the shared environment lacks
# (DeepSpeed's requirements.txt less torch, numpy, packaging, psutil).
SMALL_DEPS=(hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0 pydantic==2.14.3 msgpack==1.2.4 einops==0.8.2 tqdm==4.70.1)

log() { echo "setup_deepspeed: $*" >&2; }

PYVER=$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
DEPS_HASH=$(cd "$ROOT" && sha256sum requirements/dev.txt | cut -c1-12)
DEPS=$CACHE/deps-$DEPS_HASH
DEPS_SITE=$DEPS/lib/$PYVER/site-packages
VENV=$CACHE/deepspeed-$DS_VERSION-$DEPS_HASH
VPY=$VENV/bin/python
EXT_DIR=$VENV/torch_extensions

if [ ! -f "$DEPS/.complete" ]; then
    log "shared dependencies missing: building them with the Makefile's rule"
    make -s -C "$ROOT" "$DEPS/.complete" PY="$PY" CACHE="$CACHE" >&2
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.deepspeed.lock"
flock 9

# The shared site-packages as a site directory (its own .pth files, such as
# setuptools' distutils shim, are processed too). Rewritten on every run.
write_pth() {
    echo "import site; site.addsitedir('$DEPS_SITE')" >"$VENV/lib/$PYVER/site-packages/_tierstore_deps.pth"
}

if [ ! -f "$VENV/.complete" ]; then
    t0=$SECONDS
    log "creating $VENV (DeepSpeed $DS_VERSION; once per DeepSpeed version and requirements version)"
    # Built in place (not in a temporary folder moved afterwards): console
    # scripts such as bin/ninja, which the JIT build runs, carry the absolute
    # path of the environment. A half-built one has no .complete and is redone.
    if ! dpkg -s libaio-dev >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            log "installing libaio-dev (headers for DeepSpeed's aio op)"
            # Another apt-get (a setup running beside this one) holds dpkg's lock: wait for it.
            apt=(apt-get -o DPkg::Lock::Timeout=600)
            "${apt[@]}" install -y -q libaio-dev >&2 || { "${apt[@]}" update -q >&2 && "${apt[@]}" install -y -q libaio-dev >&2; }
        else
            log "libaio-dev is missing: install it (apt-get install libaio-dev) and run again"
            exit 1
        fi
    fi
    rm -rf "$VENV"
    # No pip or setuptools of its own: those of the shared environment (seen
    # through the .pth file) install into this one and build DeepSpeed's sdist.
    "$PY" -m venv --without-pip "$VENV"
    write_pth
    pipi() { "$VPY" -m pip install -q --disable-pip-version-check "$@" >&2; }
    pipi "${SMALL_DEPS[@]}"
    # DS_BUILD_OPS=0: pure Python install, ops are JIT-built below.
    # DS_ACCELERATOR=cpu: this torch is a CUDA build, but there is no GPU.
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 pipi --no-deps --no-build-isolation "deepspeed==$DS_VERSION"
    # The only torch must be the shared one.
    torch_dir=$("$VPY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    [ "$torch_dir" = "$DEPS_SITE" ] || { log "torch comes from $torch_dir, not $DEPS_SITE"; exit 1; }
    log "installed in $((SECONDS - t0)) s; JIT-building the ops (about 5 minutes on 2 cores)"
    t1=$SECONDS
    mkdir -p "$EXT_DIR"
    PATH=$VENV/bin:$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$EXT_DIR "$VPY" - >&2 <<'EOF'
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import AsyncIOBuilder

builder = AsyncIOBuilder()
if not builder.is_compatible(verbose=True):
    raise SystemExit("DeepSpeed's async_io op is not compatible here (libaio-dev missing?)")
builder.load(verbose=False)  # builds pin_memory first, then async_io
# deepspeed.comm builds this one when it is initialised on the CPU accelerator.
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
EOF
    log "ops built in $((SECONDS - t1)) s"
    cat >"$VENV/env.sh" <<EOF
# Source this before running DeepSpeed code with $VPY.
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR=$EXT_DIR
export PATH=$VENV/bin:\$PATH
EOF
    touch "$VENV/.complete"
fi

write_pth
# Cheap check on every run: the environment imports and the op loads from the cache.
PATH=$VENV/bin:$PATH DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$EXT_DIR "$VPY" - >&2 <<'EOF'
from deepspeed.ops.op_builder import AsyncIOBuilder

AsyncIOBuilder().load(verbose=False)
EOF

echo "$VPY"
