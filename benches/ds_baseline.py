"""DeepSpeed's own NVMe optimizer-state offload (ZeRO-Infinity) as a baseline, on the CPU.

Drives DeepSpeed's optimizer swapper classes (``PipelinedOptimizerSwapper``,
or ``PartitionedOptimizerSwapper`` without pipelining) with its ``aio`` handle
exactly as ZeRO stage 3 does in ``DeepSpeedZeroOptimizer_Stage3.step``, minus
the parts that need a GPU or several ranks: the fp32 master weights and Adam's
``exp_avg`` and ``exp_avg_sq`` of each subgroup are read from files (O_DIRECT,
libaio) into DeepSpeed's page-locked swap buffers, updated by torch's fused CPU
AdamW, and written back, the read of subgroup i+1 and the write of i-1
overlapping the update of i. Gradients are bf16 in host memory and converted
to fp32 on their way into the swapper's gradient buffer; they never go to
disk, so the bytes moved per step are 12 per parameter read and 12 written,
the same as tierstore's offload of the same parameters.

Needs the environment made by ``benches/setup_deepspeed.sh``::

    PY=$(bash benches/setup_deepspeed.sh)
    "$PY" benches/ds_baseline.py --params 50e6 --host 256MiB --dir .   # smoke run
    # or, from Python run by "$PY" with benches/ on sys.path:
    ds_baseline.run_deepspeed_swapper(50_000_000, 256 << 20, 4 << 20, ".", steps=4, seed=0)

What differs from a real ZeRO-3 run, and why (each is marked "work-around" below):

* ``DS_ACCELERATOR=cpu``: DeepSpeed's CPU accelerator; the CPU ``AsyncIOBuilder``
  builds the same aio sources (csrc/aio) as the CUDA one.
* No ``deepspeed.initialize``/engine: the stage-3 optimizer needs a model
  partitioned by ``zero.Init``, an accelerator for the fp16 partitions and its
  gradient hooks. The loop below is the sub-group loop of its ``step`` (swap
  in with prefetch of the next sub-group, optimizer step on the flat fp32
  partition, copy back into the model parameters, swap out with asynchronous
  write), with the swapper constructed as ``_configure_tensor_swapping`` does.
* Gradients are registered as the swapper's *unswapped* (host-resident)
  gradient partitions instead of going through ``swap_out_gradients``, which
  would write them to NVMe as fp32 and read them back (8 more bytes per
  parameter). DeepSpeed takes this same path for gradient pieces under 1 MiB.
* No loss scaling, gradient clipping or overflow check (combined scale 1),
  as in tierstore's offload of plain AdamW.
* The update is ``torch.optim.AdamW(fused=True)`` rather than DeepSpeedCPUAdam
  (another JIT op), driven through ``param_groups[...]['params']`` like
  ``_optimizer_step``.
* One rank: ``deepspeed.comm`` is initialised with gloo, world size 1, on the
  loopback address, because the swapper asks it for the rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Environment for DeepSpeed, set before it is imported (work-around: no GPU,
# use DeepSpeed's CPU accelerator). The aio op is looked for where
# setup_deepspeed.sh built it (<venv>/torch_extensions), and the venv's bin
# (ninja, which torch's JIT loader runs even for a cached op) goes on PATH.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
_VENV_EXT = Path(sys.prefix) / "torch_extensions"
if "TORCH_EXTENSIONS_DIR" not in os.environ and _VENV_EXT.is_dir():
    os.environ["TORCH_EXTENSIONS_DIR"] = str(_VENV_EXT)
_VENV_BIN = str(Path(sys.prefix) / "bin")
if _VENV_BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

import torch  # noqa: E402

SETUP_HINT = "run `bash benches/setup_deepspeed.sh` and use the python interpreter it prints"
TENSOR_ELEMS = 4 << 20  # tensor sizes of bench_offload.make_params
# DeepSpeed timers around the swapper calls of a step (pipelined, then partitioned swapper).
SWAPPER_TIMERS = ("swap_in_state", "swap_out_state", "async_swap_out_state", "swap_in_param", "swap_out_param")


class DeepSpeedUnavailableError(RuntimeError):
    """DeepSpeed or its aio op cannot be used in this interpreter."""


def make_params(n: int, seed: int = 0) -> list[torch.Tensor]:
    """The parameters of bench_offload.make_params: 4M-element tensors, randn * 0.02."""
    g = torch.Generator().manual_seed(seed)
    sizes = [TENSOR_ELEMS] * (n // TENSOR_ELEMS) + ([n % TENSOR_ELEMS] if n % TENSOR_ELEMS else [])
    return [torch.randn(s, generator=g) * 0.02 for s in sizes]


def make_grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The gradients of bench_offload.set_grads for ``step`` (randn * 1e-3), cast to bf16."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * 1e-3).to(torch.bfloat16) for p in params]


def checksum(tensors: list[torch.Tensor]) -> float:
    """Sum as float64, computed as bench_offload computes it (per tensor, then summed)."""
    return float(sum(t.detach().double().sum() for t in tensors))


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as e:
        raise DeepSpeedUnavailableError(f"DeepSpeed is not importable by {sys.executable} ({e}); {SETUP_HINT}") from e
    from deepspeed.utils.logging import logger

    # DeepSpeed logs to stdout: send it to stderr, so that stdout carries only results.
    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    return deepspeed


def _check_aio_op(allow_build: bool) -> None:
    """A clear error instead of a JIT build of several minutes (or a compiler error)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    # async_io (and pin_memory, which it loads first); deepspeed_shm_comm is what
    # deepspeed.comm JIT-builds on the CPU accelerator when it is initialised.
    for op in ("async_io", "pin_memory", "deepspeed_shm_comm"):
        if not allow_build and (ext is None or not (Path(ext) / op / f"{op}.so").is_file()):
            raise DeepSpeedUnavailableError(
                f"DeepSpeed's {op} op is not built (TORCH_EXTENSIONS_DIR={ext}); {SETUP_HINT}"
            )
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise DeepSpeedUnavailableError("DeepSpeed's async_io op is not compatible here (libaio-dev missing?)")
    try:
        builder.load(verbose=False)
    except Exception as e:
        raise DeepSpeedUnavailableError(f"DeepSpeed's async_io op does not load ({e}); {SETUP_HINT}") from e


def _init_comm() -> None:
    """Work-around: one rank, gloo on the loopback address (the swapper asks deepspeed.comm for its rank)."""
    import deepspeed
    from deepspeed import comm as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deepspeed.init_distributed(
        dist_backend="gloo",
        auto_mpi_discovery=False,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        verbose=False,
    )


def _sub_groups(sizes: list[int], sub_group_size: int) -> list[list[int]]:
    """Indices of the tensors of each sub-group, as stage3._create_fp16_sub_groups
    forms them: tensors are added until the sub-group holds sub_group_size elements."""
    groups: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, s in enumerate(sizes):
        cur.append(i)
        n += s
        if n >= sub_group_size or i == len(sizes) - 1:
            groups.append(cur)
            cur, n = [], 0
    return groups


@contextlib.contextmanager
def _count_io(counts: dict[str, int]) -> Any:
    """Counts the bytes the swapper hands to its aio handles (submissions, not assumptions)."""
    from deepspeed.runtime.swap_tensor import (
        optimizer_utils,
        partitioned_optimizer_swapper,
        pipelined_optimizer_swapper,
    )

    mods = [optimizer_utils, partitioned_optimizer_swapper, pipelined_optimizer_swapper]
    saved = [(m, m.swap_in_tensors, m.swap_out_tensors) for m in mods]

    def wrap(fn: Any, key: str) -> Any:
        def counted(handle: Any, buffers: list[torch.Tensor], paths: list[str]) -> Any:
            counts[key] += sum(b.numel() * b.element_size() for b in buffers)
            return fn(handle, buffers, paths)

        return counted

    try:
        for m, sin, sout in saved:
            m.swap_in_tensors = wrap(sin, "read")
            m.swap_out_tensors = wrap(sout, "write")
        yield
    finally:
        for m, sin, sout in saved:
            m.swap_in_tensors, m.swap_out_tensors = sin, sout


def run_deepspeed_swapper(
    nparams: int,
    host_budget_bytes: int,
    subgroup_elems: int,
    swap_dir: str,
    steps: int = 4,
    seed: int = 0,
    *,
    pipeline: bool = True,
    aio: dict[str, Any] | None = None,
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    allow_build: bool = False,
    keep_files: bool = False,
    warm: int = 1,
    memory: bool = False,
) -> dict[str, Any]:
    """AdamW steps over ``nparams`` parameters with their fp32 masters and Adam state
    offloaded by DeepSpeed's NVMe optimizer swapper into ``swap_dir``.

    ``subgroup_elems`` is ZeRO-3's ``sub_group_size`` (elements per sub-group).
    The swapper's ``buffer_count`` is chosen so that its pinned swap buffers
    (one per tensor of a sub-group in flight, each of the largest sub-group)
    take about ``host_budget_bytes``; the pipelined swapper needs 12 of them
    (three sub-groups in flight: master, exp_avg, exp_avg_sq, gradient) and
    never uses more: DeepSpeed allocates and page-locks (mlock) them all, but
    has no use for host memory beyond that (it keeps no sub-group resident).
    ``aio`` overrides DeepSpeed's aio defaults (block_size 1 MiB, queue_depth 8,
    intra_op_parallelism 1, single_submit False, overlap_events True).

    Returns per-step times (``step_s``: median without the first step), the bytes
    read and written per step (counted at the aio submissions), and ``checksum``:
    the float64 sum of the final fp32 masters, read back from the swap files.
    ``memory``: also ``memory``, the current RSS sampled in a thread
    (benches/offload_memory.py) in the phases setup, warm (the first ``warm``
    steps), timed (the others), with ``model_bytes``: the fp32 parameters and
    bf16 gradients this driver holds beside the swapper.
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    deepspeed = _import_deepspeed()
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    mem = None
    if memory:
        from offload_memory import RssSampler

        mem = RssSampler().start()
        mem.phase("setup")

    aio_config = get_aio_config({"aio": dict(aio or {})})
    params = make_params(int(nparams), seed)
    groups = _sub_groups([p.numel() for p in params], int(subgroup_elems))
    group_numel = [sum(params[i].numel() for i in g) for g in groups]

    # Buffer count from the budget, in the swapper's own units (largest sub-group, io-aligned).
    align = 1024 * aio_config["intra_op_parallelism"] // 4  # AIO_ALIGNED_BYTES per fp32 element
    buffer_elems = -(-max(group_numel) // align) * align
    buffer_count = int(host_budget_bytes) // (buffer_elems * 4)
    need = 12 if pipeline else 4
    if buffer_count < need:
        raise ValueError(
            f"host budget {host_budget_bytes} B holds {buffer_count} swap buffers of {buffer_elems * 4} B; the "
            f"{'pipelined' if pipeline else 'partitioned'} swapper needs {need} (at least {need * buffer_elems * 4} B):"
            " use smaller sub-groups or a larger budget"
        )
    # DeepSpeed prints ("... built successfully") to stdout: to stderr with it.
    with contextlib.redirect_stdout(sys.stderr):
        _check_aio_op(allow_build)
        _init_comm()

    run_dir = Path(tempfile.mkdtemp(prefix="ds-swap-", dir=swap_dir))
    try:
        out = _drive(params, groups, run_dir, buffer_count, aio_config, pipeline, steps, lr, weight_decay, mem, warm)
    finally:
        gc.collect()  # the swapper's pinned buffers are munlocked and freed when it goes
        if not keep_files:
            shutil.rmtree(run_dir, ignore_errors=True)
    per_step = (out["read_bytes_per_step"] + out["write_bytes_per_step"]) / 2**30
    if mem is not None:
        out["memory"] = mem.stop()
        # The model this driver keeps beside the swapper: fp32 parameters, bf16 gradients.
        out["model_bytes"] = 6 * int(nparams)
    return {
        "mode": f"deepspeed {deepspeed.__version__} {out.pop('swapper')}",
        "params": int(nparams),
        "subgroups": len(groups),
        "subgroup_elems": int(subgroup_elems),
        "swap_buffer_count": buffer_count,
        "swap_buffer_bytes": buffer_count * buffer_elems * 4,
        "aio": dict(aio_config),
        **out,
        "moved_gib_per_step": per_step,
        "io_gib_s": per_step / out["step_s"],
    }


def _drive(
    params: list[torch.Tensor],
    groups: list[list[int]],
    run_dir: Path,
    buffer_count: int,
    aio_config: dict[str, Any],
    pipeline: bool,
    steps: int,
    lr: float,
    weight_decay: float,
    mem: Any = None,
    warm: int = 1,
) -> dict[str, Any]:
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import PipelinedOptimizerSwapper
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    # The "offload_optimizer" section of a ZeRO config: {"device": "nvme", "nvme_path": ...,
    # "buffer_count": ..., "pipeline_read": true, "pipeline_write": true}.
    swap_config = DeepSpeedZeroOffloadOptimizerConfig(
        device="nvme",
        nvme_path=run_dir,
        buffer_count=buffer_count,
        pipeline_read=pipeline,
        pipeline_write=pipeline,
    )
    # The flat fp32 partitions, as stage3._create_fp32_partitions makes them for
    # swappable sub-groups: empty tensors with a ds_id; their data lives in the swap files.
    flats: list[torch.Tensor] = []
    for g in groups:
        f = torch.empty(0, dtype=torch.float32)
        f.ds_id = f"{g[0]}_{g[-1]}"  # type: ignore[attr-defined]
        f.requires_grad = True
        flats.append(f)
    # stage3 wraps an optimizer built over the flat fp32 partitions and steps it
    # on one sub-group at a time (_optimizer_step).
    optimizer = torch.optim.AdamW(flats, lr=lr, weight_decay=weight_decay, fused=True)
    timers = SynchronizedWallClockTimer()
    # stage3._configure_tensor_swapping
    swapper_type = PipelinedOptimizerSwapper if swap_config.pipeline else PartitionedOptimizerSwapper
    t0 = time.perf_counter()
    swapper = swapper_type(
        swap_config=swap_config,
        aio_config=aio_config,
        base_folder=str(run_dir / "zero_stage_3"),
        optimizer=optimizer,
        largest_numel=max(sum(params[i].numel() for i in g) for g in groups),
        device="cpu",
        dtype=torch.float32,
        timers=timers,
    )
    for f, g in zip(flats, groups, strict=True):
        # stage3 initialises each swapped fp32 partition from the flat low-precision one.
        swapper.initialize_parameters(parameters=[f], src_tensors=[torch.cat([params[i] for i in g])])
    init_s = time.perf_counter() - t0
    # stage3._create_next_swappable_fp32_groups: the sub-group to prefetch after each.
    nxt: list[torch.Tensor | None] = [*flats[1:], None]

    counts = {"read": 0, "write": 0}
    reads: list[int] = []
    writes: list[int] = []
    times: list[float] = []
    waits: list[dict[str, float]] = []
    with _count_io(counts):
        for step in range(steps):
            if mem is not None and step in (0, warm):
                mem.phase("warm" if step < warm else "timed", trim=step == warm)
            # Backward's result: bf16 gradients in host memory, one partition per tensor.
            grads = make_grads(params, step)
            for f, g in zip(flats, groups, strict=True):
                info = swapper.swap_params_info[f.ds_id]  # type: ignore[attr-defined]
                off = 0
                for i in g:
                    # Work-around (see the module doc): host-resident gradient
                    # partitions; the swapper copies them, bf16 -> fp32, into its
                    # pinned gradient buffer when it swaps the sub-group in.
                    info.unswapped_gradients[off] = grads[i].view(-1)
                    off += params[i].numel()
            for t in timers.timers.values():
                t.reset()
            counts.update(read=0, write=0)
            t0 = time.perf_counter()
            # DeepSpeedZeroOptimizer_Stage3.step, sub-group loop.
            for k, f in enumerate(flats):
                # _prepare_sub_group -> _optimizer_states_and_gradient_swap_in
                swapper.swap_in_optimizer_state(parameter=f, async_parameter=nxt[k])
                # _optimizer_step
                optimizer.param_groups[0]["params"] = [f]
                optimizer.step()
                optimizer.param_groups[0]["params"] = []
                # _reassign_or_swap_out_partitioned_parameters: fp32 -> the model's parameters
                off = 0
                for i in groups[k]:
                    params[i].copy_(f.data.narrow(0, off, params[i].numel()).view_as(params[i]))
                    off += params[i].numel()
                # _release_sub_group -> _optimizer_states_and_gradient_swap_out
                swapper.swap_out_optimizer_state(parameter=f, async_swap=nxt[k] is not None)
                f.grad = None
            times.append(time.perf_counter() - t0)
            reads.append(counts["read"])
            writes.append(counts["write"])
            waits.append({n: t.elapsed(reset=True) / 1e3 for n, t in timers.timers.items() if n in SWAPPER_TIMERS})
            del grads
    if mem is not None:
        mem.phase("after")
    # The final masters, read back from the swap files (no write-back).
    finals: list[torch.Tensor] = []
    for f, g in zip(flats, groups, strict=True):
        swapper.swap_in_optimizer_state(parameter=f, async_parameter=None)
        off = 0
        for i in g:
            finals.append(f.data.narrow(0, off, params[i].numel()).clone())
            off += params[i].numel()
        swapper.release_swap_buffers(parameter=f)
    masters_sum = checksum(finals)
    if masters_sum != checksum(params):
        raise AssertionError("the masters read back differ from the model parameters copied from them")
    later = waits[1:] or waits
    return {
        "swapper": swapper_type.__name__,
        "init_s": init_s,
        "step_s": statistics.median(times[1:] or times),
        "first_step_s": times[0],
        "step_times_s": times,
        # Steady state (the first step reads only the masters: Adam's state does not exist yet).
        "read_bytes_per_step": statistics.median(reads[1:] or reads),
        "write_bytes_per_step": statistics.median(writes[1:] or writes),
        "read_bytes_each_step": reads,
        "write_bytes_each_step": writes,
        # Time the step spent inside the swapper (waits on reads and writes, the
        # gradient copies, submissions), median over the steps after the first.
        "swapper_s": {n: statistics.median(w.get(n, 0.0) for w in later) for n in sorted({*later[0]})},
        "checksum": masters_sum,
    }


def reference_in_memory(nparams: int, steps: int, seed: int = 0, lr: float = 1e-4, weight_decay: float = 0.01) -> float:
    """Checksum of the same steps with the fused AdamW fully in memory (no DeepSpeed)."""
    params = [torch.nn.Parameter(p) for p in make_params(int(nparams), seed)]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    for step in range(steps):
        for p, g in zip(params, make_grads(params, step), strict=True):
            p.grad = g.to(torch.float32)
        opt.step()
    return checksum(params)


def _size(s: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = s.strip().lower()
    for u, m in units.items():
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    return int(float(low))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--host", default="256MiB", help="host memory for DeepSpeed's swap buffers")
    ap.add_argument("--subgroup-elems", type=float, default=TENSOR_ELEMS, help="ZeRO-3 sub_group_size")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=".", help="where the swap files go (a real disk, not tmpfs)")
    ap.add_argument("--no-pipeline", action="store_true", help="PartitionedOptimizerSwapper (no overlap)")
    ap.add_argument("--check", action="store_true", help="also run fused AdamW in memory and compare checksums")
    ap.add_argument(
        "--aio",
        default="{}",
        help='the "aio" section of a DeepSpeed config as JSON, e.g. \'{"block_size": 8388608, "queue_depth": 32}\'',
    )
    ap.add_argument("--warm", type=int, default=1, help="steps counted as warm-up in the memory phases")
    ap.add_argument("--memory", action="store_true", help="sample the current RSS during setup and steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        r = run_deepspeed_swapper(
            int(args.params),
            _size(args.host),
            int(args.subgroup_elems),
            args.dir,
            args.steps,
            args.seed,
            pipeline=not args.no_pipeline,
            aio=json.loads(args.aio),
            warm=args.warm,
            memory=args.memory,
        )
    except DeepSpeedUnavailableError as e:
        print(f"ds_baseline: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1))
    ok = True
    if args.check:
        ref = reference_in_memory(int(args.params), args.steps, args.seed)
        ok = ref == r["checksum"]
        print(f"in-memory fused AdamW checksum {ref!r}: {'equal' if ok else 'DIFFERENT'}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
