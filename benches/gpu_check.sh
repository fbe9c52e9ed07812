#!/usr/bin/env bash
# Everything GPU-related in one call, for a machine with a GPU (make gpu-check).
# Builds the package, runs the GPU-marked tests (the Checkpointer's device
# capture, optimizer offload with bf16 parameters on the device), then the
# checkpoint benchmark on the device: the device-to-host capture (pinned
# buffers, side stream) overlapped with forward and backward, next to
# torch.save and DCP async_save. Prints a short table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no GPU visible to torch"; print(torch.cuda.get_device_name(0))'
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests || [ $? -eq 5 ]   # 5: no GPU-marked test collected
"$PY" benches/bench_checkpoint.py --layers 12 --width 1024 --steps 16 --every 4 --reps 2 \
    --memory-saves 0 --modes "none,torch.save,dcp.async_save,tierstore" --json "${OUT:-.}/checkpoint_gpu.json"
