#!/usr/bin/env bash
# Everything GPU-related in one call, for a machine with a GPU (make gpu-check):
#   1. builds the GPU shim (hip/) with the toolchain found there (nvcc or hipcc)
#      and prints which GPU path tierstore uses and why (tierstore info);
#   2. runs every test marked `gpu` (bit-exact save/load of GPU tensors with no
#      pageable copy, the Checkpointer's capture during training steps, offload
#      with bf16 parameters on the device, a resharding load into device memory);
#   3. runs benches/bench_gpu.py: copies through the shim against torch's pinned
#      and pageable copies, save/load of a GPU state dict against torch.save /
#      torch.load and the disk's ceilings, the Checkpointer's blocked time in a
#      training loop against torch.save and DCP async_save, the offload step;
# and prints one table at the end. Without a GPU it stops at once (exit 2).
#
#   PY=python3 OUT=results bash benches/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-results/gpu}
GIB=${GPU_CHECK_GIB:-4}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    torch_v=$("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)
    echo "gpu_check: no GPU visible to torch here ($torch_v); nothing was run." \
        "Run it on a machine with an NVIDIA (CUDA) or AMD (ROCm) GPU." >&2
    exit 2
fi

status=0
t0=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== 1. the shim"
if ! "$PY" -m tierstore.gpu build; then
    echo "gpu_check: the shim did not build; the checks below use torch's pinned copies" >&2
    status=1
fi
"$PY" -m tierstore info | tee "$OUT/info.txt"

echo "== 2. GPU tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --timeout=120 tests/test_gpu.py tests/test_offload.py \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || status=1
echo "== 2b. the same device tests on torch's pinned copies (the fallback: TIERSTORE_GPU_SHIM=0)"
TIERSTORE_GPU_SHIM=0 timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --timeout=60 tests/test_gpu.py \
    2>&1 | tee "$OUT/gpu_tests_fallback.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 3. benchmark"
bench_dir=${GPU_CHECK_DIR:-$PWD/bench-gpu-tmp}
timeout 360 "$PY" benches/bench_gpu.py --dir "$bench_dir" --gib "$GIB" --json "$OUT/gpu.json" --out "$OUT/gpu.txt" \
    2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
rm -rf "$bench_dir"

echo
echo "================ gpu_check summary ($(($(date +%s) - t0)) s) ================"
grep -E "^GPU path:" "$OUT/info.txt" || true
echo "gpu tests (shim): $(tail -1 "$OUT/gpu_tests.log")"
echo "gpu tests (torch's copies): $(tail -1 "$OUT/gpu_tests_fallback.log")"
[ -f "$OUT/gpu.txt" ] && cat "$OUT/gpu.txt"
exit $status
