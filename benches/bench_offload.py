"""Optimizer step time with the optimizer state offloaded, every mode in one run.

The model: ``--params`` bf16 parameters (4M-element tensors), their fp32
master weights and AdamW state (12 bytes per parameter) several times larger
than the host budget ``--host``. Every mode starts from the same fp32 values
and gets the same bf16 gradients, runs torch's fused AdamW, and must end with
the same fp32 masters (checked). Modes:

* in memory: masters and state all in host memory (the update compute alone:
  the same update, no I/O);
* naive: the offload a user would write (benches/offload_naive.py): the
  first subgroups that fit the budget (beside one working buffer) stay in
  memory, every other one is read, stepped and written back in turn,
  synchronously; masters stored whole; the same engine's O_DIRECT transfers;
* tierstore: the pipelined offload on one path, and on two paths of different
  bandwidth, split in proportion to the measured bandwidth and evenly; with
  its default split masters (the bf16 parameters hold the masters' high
  halves, so 10 bytes per parameter are stored), and on the disk also with
  the masters whole (``split_masters=False``: the same 12 bytes as the naive
  offload and DeepSpeed);
* DeepSpeed: its ZeRO-Infinity optimizer swapper (PipelinedOptimizerSwapper +
  aio handle, built by benches/setup_deepspeed.sh) on the same bytes as the
  whole-masters mode, with DeepSpeed's default ``aio`` settings and with the
  best of a grid of them (block size, queue depth, threads, then single
  submit and overlapped events at the best) tried in the same run;
* two processes offloading to one disk with the machine-wide device turns on
  and off (total throughput).

Every mode runs in a fresh process (spawned), so that its memory is its own:
the current RSS is sampled in a thread (benches/offload_memory.py) during
setup, the warm-up steps and the timed steps, with the engine's count of the
host buffers it holds. Modes that are compared run in rounds, in alternating
order (the disk's rate and the CPU drift).

The bound of a step is max(bytes moved at the paths' ceilings, the update
compute), both measured in the same run: what a step that overlaps its I/O
with its update entirely would take.

Paths: the disk under ``--dir``; ``fast`` and ``slow``: RAM-backed loop devices
throttled by the kernel's block I/O controller to ``--fast-rate`` and
``--slow-rate`` MiB/s per direction (benches/slow_path.sh; needs root). The
ceiling of each path (engine write, read, and both at once, O_DIRECT, in
subgroup-sized transfers) is measured in the same run.

    python benches/bench_offload.py [--params 300e6 --host 1GiB --json docs/bench/offload.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from offload_memory import RssSampler
from offload_naive import NaiveOffload

import tierstore
from tierstore import DiskTier, HostTier, _core
from tierstore._engine import host_buffer
from tierstore.checkpointer import parse_size

HERE = Path(__file__).resolve().parent
TENSOR = 4 << 20  # elements per parameter tensor
WARM = 3  # untimed steps of every mode (the same number of steps in all, for the equality check)
LR, WEIGHT_DECAY = 1e-4, 0.01
# DeepSpeed's aio defaults (deepspeed/runtime/swap_tensor/constants.py), and the grid tried.
DS_AIO_DEFAULT = {
    "block_size": 1 << 20,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}
DS_GRID = [
    {**DS_AIO_DEFAULT, "block_size": b, "queue_depth": q, "intra_op_parallelism": t}
    for b in (1 << 20, 8 << 20)
    for q in (8, 32, 128)
    for t in (1, 2)
]


def make_params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """fp32 values (as benches/ds_baseline.py makes them), as parameters."""
    g = torch.Generator().manual_seed(seed)
    sizes = [TENSOR] * (n // TENSOR) + ([n % TENSOR] if n % TENSOR else [])
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in sizes]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# ceilings


def ceiling(d: Path, nbytes: int, chunk: int) -> dict[str, float]:
    """The engine's rate on ``d`` in the offload's own pattern: O_DIRECT
    transfers of ``chunk`` bytes rewriting and reading files in place; write,
    read, and both at once (one stream each way)."""
    eng = tierstore.get_engine()
    n = nbytes // chunk
    bufs = [host_buffer(chunk), host_buffer(chunk)]  # the offload's own kind of memory
    for b in bufs:
        b.fill_(1)
    files = [d / "ceiling-a.bin", d / "ceiling-b.bin"]

    def stream(what: str, f: Path, buf: torch.Tensor, out: list[float]) -> None:
        t0 = time.perf_counter()
        for i in range(n):
            _core.transfer_ranges(eng, f, [i * chunk], [chunk], [buf.data_ptr()], write=what == "write", direct=True)
        out.append(time.perf_counter() - t0)

    t: list[float] = []
    for f in files:  # lay the files out first
        stream("write", f, bufs[0], [])
    stream("write", files[0], bufs[0], t)
    stream("read", files[1], bufs[1], t)
    both: list[float] = []
    t0 = time.perf_counter()
    th = [
        threading.Thread(target=stream, args=("write", files[0], bufs[0], both)),
        threading.Thread(target=stream, args=("read", files[1], bufs[1], both)),
    ]
    for x in th:
        x.start()
    for x in th:
        x.join()
    tb = time.perf_counter() - t0
    for f in files:
        f.unlink()
    total = n * chunk
    return {"write": total / t[0], "read": total / t[1], "both": 2 * total / tb}


# ------------------------------------------------------------------------------------------------
# modes, each in a fresh process


def _mode_child(name: str, kind: str, args: argparse.Namespace, paths: list[str], kw: dict[str, Any]) -> dict[str, Any]:
    """One mode, in a spawned process: setup, warm-up steps, timed steps, the masters."""
    mem = RssSampler().start()  # the base: this interpreter with torch and tierstore imported
    mem.phase("setup")
    n = int(args.params)
    params = make_params(n)
    budget = parse_size(kw.pop("host", args.host))
    opt: Any
    if kind == "naive":
        opt = NaiveOffload(
            params,
            budget=budget,
            subgroup_bytes=parse_size(args.subgroup),
            path=paths[0],
            lr=LR,
            weight_decay=WEIGHT_DECAY,
        )
    else:
        opt = tierstore.offload(
            torch.optim.AdamW,
            params,
            tiers=[HostTier(budget), DiskTier(paths)],
            subgroup_bytes=args.subgroup,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            fused=True,
            **kw,
        )
    mem.set_engine(opt.host_bytes)
    with torch.no_grad():  # the model in bf16; the optimizer took the fp32 masters
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    times: list[float] = []
    moved: list[tuple[float, float]] = []
    for step in range(args.steps + WARM):
        if step in (0, WARM):
            mem.phase("warm" if step < WARM else "timed", trim=step == WARM)
        set_grads(params, step)
        r0, w0 = opt.stats["read_bytes"], opt.stats["write_bytes"]
        t0 = time.perf_counter()
        opt.step()
        opt.wait_io()
        dt = time.perf_counter() - t0
        # The first step creates the state; the next two measure how each device
        # serves reads and writes (at once or in one line).
        if step >= WARM:
            times.append(dt)
            moved.append((opt.stats["read_bytes"] - r0, opt.stats["write_bytes"] - w0))
    mem.phase("after")
    masters = opt.master_params()
    memory = mem.stop()
    out: dict[str, Any] = {
        "mode": name,
        "kind": kind,
        "step_s": statistics.median(times),
        "steps_s": times,
        "read_bytes": statistics.median(m[0] for m in moved),
        "write_bytes": statistics.median(m[1] for m in moved),
        "host_budget_bytes": budget,
        "placement": dict(opt.placement()),
        "checksum": float(sum(m.double().sum() for m in masters)),
        "crc": _core.crc32_regions([(m.data_ptr(), m.numel() * 4) for m in masters], 2),
        "memory": memory,
        "model_bytes": 4 * n,  # bf16 parameters and bf16 gradients
    }
    if kind == "naive":
        out["naive"] = opt.describe()
    else:
        out["bandwidth"] = opt.bandwidth()
        out["stats"] = dict(opt.stats)
    opt.close()
    return out


def _model_only_child(args: argparse.Namespace) -> dict[str, Any]:
    """The memory control: the same model and gradient steps, no optimizer at
    all (what the step loop itself holds: parameters, gradients, and the heap
    its allocations leave behind)."""
    mem = RssSampler().start()
    mem.phase("setup")
    n = int(args.params)
    params = make_params(n)
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    for step in range(args.steps + WARM):
        if step in (0, WARM):
            mem.phase("warm" if step < WARM else "timed", trim=step == WARM)
        set_grads(params, step)
        time.sleep(0.2)  # a few samples in each step
    return {"mode": "model only (no optimizer)", "kind": "model", "memory": mem.stop(), "model_bytes": 4 * n}


def fresh_process(
    name: str, kind: str, args: argparse.Namespace, paths: list[Path], kw: dict[str, Any]
) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        if kind == "model":
            return ex.submit(_model_only_child, args).result()
        return ex.submit(_mode_child, name, kind, args, [str(p) for p in paths], dict(kw)).result()


_DS_PY: list[str | None] = []


def deepspeed_python() -> str | None:
    """The interpreter benches/setup_deepspeed.sh prepares (once per run), or None."""
    if not _DS_PY:
        try:
            r = subprocess.run(["bash", str(HERE / "setup_deepspeed.sh")], capture_output=True, text=True, check=True)
            _DS_PY.append(r.stdout.strip())
        except subprocess.CalledProcessError as e:
            print(f"DeepSpeed baseline skipped: setup failed: {e.stderr.strip()[-500:]}", flush=True)
            _DS_PY.append(None)
    return _DS_PY[0]


def run_deepspeed(
    name: str, args: argparse.Namespace, disk: Path, aio: dict[str, Any], steps: int, warm: int
) -> dict[str, Any] | None:
    """DeepSpeed's swapper in its own interpreter (a fresh process); None where it cannot run."""
    py = deepspeed_python()
    if py is None:
        return None
    out = disk / "ds.json"
    host = parse_size(args.host)
    cmd = [py, str(HERE / "ds_baseline.py"), "--params", str(args.params), "--host", str(host)]
    cmd += ["--subgroup-elems", str(parse_size(args.subgroup) // 12 // TENSOR * TENSOR or TENSOR)]
    cmd += ["--dir", str(disk), "--steps", str(steps), "--json", str(out), "--aio", json.dumps(aio)]
    cmd += ["--warm", str(warm), "--memory"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        print(f"DeepSpeed baseline failed ({aio}): {r.stderr.strip()[-800:]}", flush=True)
        return None
    d = json.loads(out.read_text())
    out.unlink()
    timed = d["step_times_s"][warm:] or d["step_times_s"][1:]
    return {
        "mode": name,
        "kind": "deepspeed",
        "step_s": statistics.median(timed),
        "steps_s": timed,
        "read_bytes": d["read_bytes_per_step"],
        "write_bytes": d["write_bytes_per_step"],
        "host_budget_bytes": host,
        "checksum": d["checksum"],
        "aio": d["aio"],
        "memory": d.pop("memory"),
        "model_bytes": d["model_bytes"],
        "engine_bytes": d["swap_buffer_bytes"],  # pinned swap buffers, all allocated at the start
        "detail": {k: v for k, v in d.items() if k not in ("checksum",)},
    }


def aio_label(aio: dict[str, Any]) -> str:
    a = {**DS_AIO_DEFAULT, **aio}
    return (
        f"block {a['block_size'] >> 20} MiB, queue depth {a['queue_depth']}, threads {a['intra_op_parallelism']}, "
        f"single submit {'on' if a['single_submit'] else 'off'}, "
        f"overlap events {'on' if a['overlap_events'] else 'off'}"
    )


def tune_deepspeed(args: argparse.Namespace, disk: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Tries DeepSpeed's swapper with each aio setting of the grid (one short run
    each: ``--grid-steps`` steps, the first untimed), then single submit and
    no overlapped events at the best; returns the best setting and every trial."""
    trials: list[dict[str, Any]] = []

    def trial(aio: dict[str, Any]) -> None:
        r = run_deepspeed("grid", args, disk, aio, args.grid_steps, 1)
        if r is not None:
            trials.append(
                {"aio": {k: r["aio"][k] for k in DS_AIO_DEFAULT}, "step_s": r["step_s"], "steps_s": r["steps_s"]}
            )
            print(f"deepspeed aio grid: {aio_label(aio):85} step {r['step_s']:6.2f} s", flush=True)

    for aio in DS_GRID:
        trial(aio)
    if not trials:
        return None, trials
    best = min(trials, key=lambda t: t["step_s"])["aio"]
    for extra in ({"single_submit": not best["single_submit"]}, {"overlap_events": not best["overlap_events"]}):
        trial({**best, **extra})
    best = min(trials, key=lambda t: t["step_s"])["aio"]
    print(f"deepspeed aio grid: best {aio_label(best)}", flush=True)
    return best, trials


def _proc(args: argparse.Namespace, path: str, exclusive: bool, slots: int, shared: int, barrier: Any, q: Any) -> None:
    torch.set_num_threads(1)
    params = make_params(int(args.params) // 2, seed=os.getpid())
    host = tierstore.checkpointer.parse_size(args.host) // 2
    opt = tierstore.offload(
        torch.optim.AdamW,
        params,
        tiers=[HostTier(host), DiskTier(path)],
        subgroup_bytes=args.subgroup,
        exclusive_io=exclusive,
        io_slots=slots,
        device_slots=shared,
        fused=True,
    )
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    set_grads(params, 0)
    opt.step()
    opt.wait_io()
    barrier.wait()
    b0 = opt.stats["read_bytes"] + opt.stats["write_bytes"]
    t0 = time.perf_counter()
    for step in range(1, args.steps + 3):
        set_grads(params, step)
        opt.step()
    opt.wait_io()
    q.put((t0, time.perf_counter(), opt.stats["read_bytes"] + opt.stats["write_bytes"] - b0))
    opt.close()


def two_processes(args: argparse.Namespace, disk: Path, exclusive: bool, slots: int, shared: int) -> float:
    """Total bytes per second of two processes offloading to one disk."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    job = (args, str(disk), exclusive, slots, shared, barrier, q)
    procs = [ctx.Process(target=_proc, args=job) for _ in range(2)]
    for p in procs:
        p.start()
    res = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    start = min(r[0] for r in res)
    end = max(r[1] for r in res)
    return float(sum(r[2] for r in res) / (end - start))


# ------------------------------------------------------------------------------------------------


def slow_path(name: str, size_mib: int, rate: int) -> Path | None:
    r = subprocess.run(
        ["bash", str(HERE / "slow_path.sh"), "up", name, str(size_mib), str(rate), "ram"],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        print(f"throttled path {name} unavailable: {r.stderr.strip()}", flush=True)
        return None
    return Path(r.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=300e6)
    ap.add_argument("--host", default="1GiB")
    ap.add_argument("--subgroup", default="64MiB")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and round (after the warm-up steps)")
    ap.add_argument("--dir", default=".", help="a directory on the disk")
    ap.add_argument("--fast-rate", type=int, default=600, help="MiB/s per direction of the fast loop device")
    ap.add_argument("--slow-rate", type=int, default=300, help="MiB/s per direction of the slow loop device")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the compared modes, in alternating order")
    ap.add_argument("--two-rounds", type=int, default=4, help="rounds of the two-process variants")
    ap.add_argument("--grid-steps", type=int, default=3, help="steps of each DeepSpeed aio trial (the first untimed)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-ds-grid", action="store_true", help="DeepSpeed with its default aio settings only")
    ap.add_argument("--no-paths", action="store_true", help="skip the throttled loop devices")
    ap.add_argument("--no-two-processes", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = int(args.params)
    state = 12 * n
    print(
        f"{n / 1e6:.0f} M bf16 parameters: {state / 2**30:.2f} GiB of fp32 master + AdamW state "
        f"({10 * n / 2**30:.2f} GiB with split masters); host budget "
        f"{args.host}, subgroups of {args.subgroup}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"every mode in a fresh process, {args.rounds} rounds in alternating order",
        flush=True,
    )
    disk = Path(tempfile.mkdtemp(prefix="ts-offbench-", dir=args.dir))
    ceiling_bytes = min(1 << 30, max(state // 2, 256 << 20))
    size_mib = max(state, 2 * ceiling_bytes) // 2**20 + 512
    fast = slow = None
    if not args.no_paths:
        fast = slow_path(f"bench{os.getpid()}f", size_mib, args.fast_rate)
        slow = slow_path(f"bench{os.getpid()}s", size_mib, args.slow_rate)
    chunk = 12 * TENSOR
    results: list[dict[str, Any]] = []
    ceilings: dict[str, dict[str, float]] = {}
    ceiling_runs: dict[str, list[dict[str, float]]] = {}
    two: dict[str, list[float]] = {}
    grid: list[dict[str, Any]] = []
    best_aio: dict[str, Any] | None = None
    control: dict[str, Any] | None = None
    try:
        label = {disk: "disk"}

        def measure_ceiling(name: str, d: Path) -> None:
            """The best the path showed in this run (the bound is the stricter for it)."""
            c = ceiling(d, ceiling_bytes, chunk)
            print(
                f"ceiling {name}: write {c['write'] / 2**30:.2f}, read {c['read'] / 2**30:.2f}, "
                f"both at once {c['both'] / 2**30:.2f} GiB/s (load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            ceiling_runs.setdefault(name, []).append({**c, "loadavg": os.getloadavg()[0]})
            old = ceilings.get(name)
            ceilings[name] = c if old is None else {k: max(c[k], old[k]) for k in c}

        for name, d in (("disk", disk), ("fast", fast), ("slow", slow)):
            if d is not None:
                label[d] = name
                measure_ceiling(name, d)
        control = fresh_process("model only", "model", args, [], {})
        control["memory_rounds"] = [memory_summary(control)]
        if not args.no_deepspeed and not args.no_ds_grid:
            best_aio, grid = tune_deepspeed(args, disk)
        # (name, kind, paths, options). The disk's rate drifts within minutes
        # and the CPU is shared: the compared modes run in rounds, in
        # alternating order, each in a fresh process; each mode's step is the
        # median of all its rounds' steps.
        disk_modes: list[tuple[str, str, list[Path], dict[str, Any]]] = [
            ("in memory", "tierstore", [disk], {"host": f"{state * 2}B"}),
            ("naive, disk", "naive", [disk], {}),
            ("tierstore, disk, masters whole", "tierstore", [disk], {"split_masters": False}),
            ("tierstore, disk", "tierstore", [disk], {}),
        ]
        if not args.no_deepspeed:
            disk_modes.append(("deepspeed, disk, aio defaults", "deepspeed", [disk], {"aio": {}}))
            if best_aio is not None and best_aio != DS_AIO_DEFAULT:
                disk_modes.append(("deepspeed, disk, aio tuned", "deepspeed", [disk], {"aio": best_aio}))
            elif best_aio is not None:
                print("deepspeed aio grid: the defaults were the best setting tried", flush=True)
        path_modes: list[tuple[str, str, list[Path], dict[str, Any]]] = []
        if fast is not None and slow is not None:
            path_modes = [
                ("naive, fast", "naive", [fast], {}),
                ("tierstore, fast", "tierstore", [fast], {}),
                ("tierstore, slow", "tierstore", [slow], {}),
                ("tierstore, fast+slow even", "tierstore", [fast, slow], {"balance": "even"}),
                ("tierstore, fast+slow", "tierstore", [fast, slow], {}),
            ]
        by_mode: dict[str, dict[str, Any]] = {}

        def run(name: str, kind: str, paths: list[Path], kw: dict[str, Any], rnd: int) -> None:
            r: dict[str, Any] | None
            if kind == "deepspeed":
                r = run_deepspeed(name, args, disk, kw["aio"], args.steps + WARM, WARM)
                if r is None:
                    return
            else:
                r = fresh_process(name, kind, args, paths, kw)
            r["paths"] = [label[p] for p in paths]
            r["round_step_s"] = [r["step_s"]]
            r["memory_rounds"] = [memory_summary(r)]
            prev = by_mode.get(name)
            if prev is None:
                by_mode[name] = r
                results.append(r)
            else:  # another round: the same bytes and end values, more step times
                prev["steps_s"] = prev["steps_s"] + r["steps_s"]
                prev["step_s"] = statistics.median(prev["steps_s"])
                prev["round_step_s"] += r["round_step_s"]
                prev["memory_rounds"] += r["memory_rounds"]
                for k in ("crc", "checksum"):
                    if k in r and r[k] != prev[k]:
                        prev[k] = "differs between rounds"
            m = r["memory_rounds"][0]
            moved = f"read {r['read_bytes'] / 2**30:5.2f} GiB  write {r['write_bytes'] / 2**30:5.2f} GiB"
            steps = ", ".join(f"{t:.2f}" for t in r["steps_s"])
            print(
                f"{name + f' (round {rnd + 1})':45} step {r['step_s']:6.2f} s  {moved}  ({steps})  "
                f"RSS max {m['rss_max'] / 2**30:.2f} GiB, steady {m['rss_steady'] / 2**30:.2f} GiB  "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

        for modes, dname in ((disk_modes, "disk"), (path_modes, None)):
            for rnd in range(args.rounds if modes else 0):
                if dname is not None and rnd > 0:
                    measure_ceiling(dname, disk)
                for name, kind, paths, kw in modes if rnd % 2 == 0 else modes[::-1]:
                    run(name, kind, paths, kw, rnd)
        if not args.no_two_processes:
            # (name, turns across processes, transfers per process, per machine)
            variants = [
                ("turns off", False, 1, 1),
                ("turns on, 1 per machine", True, 1, 1),
                ("turns on (default: 1 per process, 2 per machine)", True, 1, 2),
                ("turns on, 2 per process and machine", True, 2, 2),
            ]
            # Rounds in alternating order: what a variant leaves behind at the
            # disk (dirty pages, its cache) falls on each of its neighbours.
            for rnd in range(args.two_rounds):
                for key, exclusive, slots, shared in variants if rnd % 2 == 0 else variants[::-1]:
                    two.setdefault(key, []).append(two_processes(args, disk, exclusive, slots, shared))
                    print(f"two processes, one disk, {key}: {two[key][-1] / 2**30:.2f} GiB/s", flush=True)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        for d in (fast, slow):
            if d is not None:
                subprocess.run(["bash", str(HERE / "slow_path.sh"), "down", d.name.removeprefix("tierstore-")])
    report(args, results, ceilings, ceiling_runs, two, grid, best_aio, control)
    return 0


def memory_summary(r: dict[str, Any]) -> dict[str, Any]:
    """The timed steps' current RSS above the process's base (its interpreter
    and libraries), and above the base and the model (parameters and
    gradients): the optimizer's; the engine's own count of its buffers."""
    m = r["memory"]
    base = m["base_bytes"]
    ph = m["phases"]
    timed = ph.get("timed", {}).get("rss", {})
    eng = ph.get("timed", {}).get("engine", {})
    setup = ph.get("setup", {}).get("rss", {})
    return {
        "rss_max": timed.get("max", 0) - base,
        "rss_steady": timed.get("median", 0) - base,
        "optimizer_rss_max": timed.get("max", 0) - base - r["model_bytes"],
        "optimizer_rss_steady": timed.get("median", 0) - base - r["model_bytes"],
        "engine_max": eng.get("max", r.get("engine_bytes", 0)),
        "engine_steady": eng.get("median", r.get("engine_bytes", 0)),
        "setup_rss_max": setup.get("max", 0) - base,
        "base": base,
        "heap_trimmed": m.get("trimmed_bytes", {}).get("timed", 0),
        "ru_maxrss_above_base": m["ru_maxrss_bytes"] - base,
        "locked_at_end": ph.get("timed", {}).get("rollup_at_end", {}).get("Locked", 0),
        "anon_at_end": ph.get("timed", {}).get("rollup_at_end", {}).get("Anonymous", 0),
        "anon_huge_at_end": ph.get("timed", {}).get("rollup_at_end", {}).get("AnonHugePages", 0),
    }


def report(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    ceilings: dict[str, dict[str, float]],
    ceiling_runs: dict[str, list[dict[str, float]]],
    two: dict[str, list[float]],
    grid: list[dict[str, Any]],
    best_aio: dict[str, Any] | None,
    control: dict[str, Any] | None = None,
) -> None:
    by = {r["mode"]: r for r in results}
    compute = by["in memory"]["step_s"] if "in memory" in by else 0.0
    budget = parse_size(args.host)

    def io_time(r: dict[str, Any]) -> float:
        """Bytes moved at the paths' ceilings: the better of one direction
        after the other and both at once."""
        cs = [ceilings[p] for p in r["paths"]]
        rd, wr = r["read_bytes"], r["write_bytes"]
        serial = rd / sum(c["read"] for c in cs) + wr / sum(c["write"] for c in cs)
        both = (rd + wr) / sum(c["both"] for c in cs)
        return float(min(serial, both))

    print()
    if grid:
        print(
            "DeepSpeed aio settings tried (one short run each, same model and disk; the best is rerun in the rounds):"
        )
        for t in sorted(grid, key=lambda t: t["step_s"]):
            print(f"  {aio_label(t['aio']):95} step {t['step_s']:6.2f} s")
        print()
    print(
        f"{'mode':31} {'step s':>7} {'read GiB':>9} {'write GiB':>10} {'I/O GiB/s':>10} "
        f"{'I/O s':>6} {'update s':>9} {'bound s':>8} {'x bound':>8}  rounds"
    )
    for r in results:
        io = (r["read_bytes"] + r["write_bytes"]) / 2**30 / r["step_s"]
        r["io_s"] = io_time(r) if r["mode"] != "in memory" else 0.0
        r["compute_s"] = compute
        r["bound_s"] = max(r["io_s"], compute)
        rounds = ", ".join(f"{t:.2f}" for t in r["round_step_s"])
        print(
            f"{r['mode']:31} {r['step_s']:7.2f} {r['read_bytes'] / 2**30:9.2f} {r['write_bytes'] / 2**30:10.2f} "
            f"{io:10.2f} {r['io_s']:6.2f} {compute:9.2f} {r['bound_s']:8.2f} "
            f"{r['step_s'] / r['bound_s']:8.2f}  {rounds}"
        )
    print(
        "\nbound = max(bytes at the paths' best ceilings in this run, the in-memory update): "
        "a step that overlaps all its I/O with the update"
    )
    print(
        "\nmemory in the timed steps, each mode in a fresh process: current RSS (sampled every 20 ms) above the "
        "process's base after its imports; the free heap the setup left handed back (malloc_trim) before the timed "
        "steps (trimmed); engine = the offload's own count of the host buffers it holds; over control = above the "
        "control's RSS (the same model and gradient steps, no optimizer; DeepSpeed's driver also holds fp32 "
        f"parameters, {2 * int(args.params) / 2**30:.2f} GiB more); anon = anonymous memory over the control's at the "
        f"end of the timed steps (the rest of RSS is code and files mapped); host budget {budget / 2**30:.2f} GiB"
    )
    print(
        f"{'mode':31} {'RSS max':>8} {'steady':>7} {'engine':>7} {'over control max':>17} {'steady':>7} "
        f"{'/ budget':>9} {'anon':>6} {'setup max':>10} {'ru_maxrss':>10} {'trimmed':>8}  GiB"
    )
    ctl = control["memory_rounds"][0] if control is not None else None
    rows = ([control] if control is not None else []) + results
    for r in rows:
        ms = r["memory_rounds"]
        agg = {
            "rss_max": max(m["rss_max"] for m in ms),
            "rss_steady": statistics.median(m["rss_steady"] for m in ms),
            "optimizer_rss_max": max(m["optimizer_rss_max"] for m in ms),
            "optimizer_rss_steady": statistics.median(m["optimizer_rss_steady"] for m in ms),
            "engine_max": max(m["engine_max"] for m in ms) if r["kind"] != "model" else 0,
            "setup_rss_max": max(m["setup_rss_max"] for m in ms),
            "ru_maxrss_above_base": max(m["ru_maxrss_above_base"] for m in ms),
            "heap_trimmed": max(m["heap_trimmed"] for m in ms),
            "anon_at_end": statistics.median(m["anon_at_end"] for m in ms),
        }
        if ctl is not None:
            agg["over_control_max"] = agg["rss_max"] - ctl["rss_max"]
            agg["over_control_steady"] = agg["rss_steady"] - ctl["rss_steady"]
            # Anonymous memory only (the rest of RSS: code and files mapped, e.g. the kernels an optimizer loads).
            agg["anon_over_control_at_end"] = agg["anon_at_end"] - ctl["anon_at_end"]
        r["memory_summary"] = agg
        g = {k: v / 2**30 for k, v in agg.items()}
        over = (
            f"{g['over_control_max']:17.2f} {g['over_control_steady']:7.2f} "
            f"{agg['over_control_max'] / r.get('host_budget_bytes', budget):9.2f} "
            f"{g['anon_over_control_at_end']:6.2f}"
            if ctl is not None
            else f"{'':17} {'':7} {'':9} {'':6}"
        )
        print(
            f"{r['mode']:31} {g['rss_max']:8.2f} {g['rss_steady']:7.2f} {g['engine_max']:7.2f} {over} "
            f"{g['setup_rss_max']:10.2f} {g['ru_maxrss_above_base']:10.2f} {g['heap_trimmed']:8.2f}"
        )
    ours = [r for r in results if r["kind"] != "deepspeed"]
    same = len({tuple(r["crc"]) if isinstance(r["crc"], list) else r["crc"] for r in ours}) == 1
    ref = by["in memory"]["checksum"] if "in memory" in by else None
    ds_same = all(r["checksum"] == ref for r in results if r["kind"] == "deepspeed")
    print(f"\nsame fp32 masters after every mode: {'yes' if same and ds_same else 'NO'}")
    checks: list[tuple[str, float, str, bool]] = []

    def check(what: str, value: float, target: float, higher_is_better: bool) -> None:
        ok = value >= target if higher_is_better else value <= target
        checks.append((what, value, f"{'>=' if higher_is_better else '<='} {target}", ok))

    # Step over the bound, for every offloading mode (the target is tierstore's claim;
    # the baselines' ratios are shown against the same line).
    for r in results:
        if r["mode"] != "in memory":
            tag = "" if r["mode"].startswith("tierstore") else " (baseline)"
            check(f"{r['mode']}{tag}: step / bound", r["step_s"] / r["bound_s"], 1.15, False)
    # Against the naive offload on the same paths (for two paths: on the
    # better of the two). What 2x needs is set next to the bound: where the
    # bound is above it, this device cannot give 2x for these bytes.
    limits: list[str] = []
    for ours_m, naive_m in (
        ("tierstore, disk, masters whole", "naive, disk"),
        ("tierstore, disk", "naive, disk"),
        ("tierstore, fast", "naive, fast"),
        ("tierstore, fast+slow", "naive, fast"),
    ):
        if ours_m in by and naive_m in by:
            check(f"{ours_m} vs {naive_m}: speed-up", by[naive_m]["step_s"] / by[ours_m]["step_s"], 2.0, True)
            limits.append(
                f"{ours_m}: 2x {naive_m} needs a step of {by[naive_m]['step_s'] / 2:.2f} s; its bound "
                f"(its bytes at the ceilings, or the update) is {by[ours_m]['bound_s']:.2f} s"
            )
    for ds in [r["mode"] for r in results if r["kind"] == "deepspeed"]:
        for m in ("tierstore, disk, masters whole", "tierstore, disk"):
            if m in by:
                check(f"{m} vs {ds}: speed-up", by[ds]["step_s"] / by[m]["step_s"], 1.0, True)
    if "tierstore, fast+slow" in by:
        mp_s = by["tierstore, fast+slow"]["step_s"]
        check(
            "fast+slow vs best single path: speed-up",
            min(by["tierstore, fast"]["step_s"], by["tierstore, slow"]["step_s"]) / mp_s,
            1.0,
            True,
        )
        check("fast+slow vs even split: speed-up", by["tierstore, fast+slow even"]["step_s"] / mp_s, 1.0, True)
    # Host memory: the engine's own count against the budget (tierstore's modes
    # on a budget). The RSS above base and model is in the memory table, with
    # no target: it also holds the step loop's own allocations (the naive
    # offload, which holds exactly its buffers, shows how much).
    for r in results:
        if r["mode"].startswith("tierstore"):
            agg = r["memory_summary"]
            check(f"{r['mode']}: engine's buffers max / budget", agg["engine_max"] / budget, 1.0, False)
    if two:
        off = statistics.median(two["turns off"])
        for key in [k for k in two if k != "turns off"]:
            check(f"two processes: {key} / turns off, throughput", statistics.median(two[key]) / off, 1.0, True)
    print()
    for what, value, target, ok in checks:
        print(f"{'MET    ' if ok else 'NOT met'} {what}: {value:.2f} (target {target})")
    print()
    for line in limits:
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "ceilings": ceilings,
                    "ceiling_runs": ceiling_runs,
                    "results": results,
                    "deepspeed_aio_grid": grid,
                    "deepspeed_aio_best": best_aio,
                    "memory_control": control,
                    "two_processes": two,
                    "limits": limits,
                    "checks": [{"what": w, "value": v, "target": t, "met": ok} for w, v, t, ok in checks],
                    "same_masters": same and ds_same,
                    "torch": torch.__version__,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
