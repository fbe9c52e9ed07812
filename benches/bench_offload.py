"""Optimizer step time with the optimizer state offloaded, every mode in one run.

The model: ``--params`` bf16 parameters (4M-element tensors), their fp32
master weights and AdamW state (12 bytes per parameter) several times larger
than the host budget ``--host``. Every mode starts from the same fp32 values
and gets the same bf16 gradients, runs torch's fused AdamW, and must end with
the same fp32 masters (checked). Modes:

* in memory: masters and state all in host memory (the lower bound: the same
  update, no I/O);
* naive: each subgroup read, updated and written back in turn, one path,
  nothing kept, nothing overlapped, fp32 masters stored whole (same engine,
  O_DIRECT);
* tierstore: the pipelined offload on one path, and on two paths of different
  bandwidth, split in proportion to the measured bandwidth and evenly; with
  its default split masters (the bf16 parameters hold the masters' high
  halves, so 10 bytes per parameter are stored), and on the disk also with
  the masters whole (``split_masters=False``: the same 12 bytes as the naive
  offload and DeepSpeed);
* DeepSpeed: its ZeRO-Infinity optimizer swapper (PipelinedOptimizerSwapper +
  aio handle, built by benches/setup_deepspeed.sh) on the same bytes as the
  whole-masters mode;
* two processes offloading to one disk with the machine-wide device turns on
  and off (total throughput).

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
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore import DiskTier, HostTier, _core
from tierstore._engine import host_buffer

HERE = Path(__file__).resolve().parent
TENSOR = 4 << 20  # elements per parameter tensor
WARM = 3  # untimed steps of every mode (the same number of steps in all, for the equality check)


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
            fn = _core.write_ranges if what == "write" else _core.read_ranges
            fn(eng, f, [i * chunk], [chunk], [buf.data_ptr()], direct=True)
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
# modes


def run_mode(name: str, args: argparse.Namespace, paths: list[Path], **kw: Any) -> dict[str, Any]:
    params = make_params(int(args.params))
    host = HostTier(kw.pop("host", args.host))
    opt = tierstore.offload(
        torch.optim.AdamW,
        params,
        tiers=[host, DiskTier([str(p) for p in paths])],
        subgroup_bytes=args.subgroup,
        lr=1e-4,
        weight_decay=0.01,
        fused=True,
        **kw,
    )
    with torch.no_grad():  # the model in bf16; the optimizer took the fp32 masters
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    times: list[float] = []
    moved: list[tuple[float, float]] = []
    warm = WARM
    for step in range(args.steps + warm):
        set_grads(params, step)
        r0, w0 = opt.stats["read_bytes"], opt.stats["write_bytes"]
        t0 = time.perf_counter()
        opt.step()
        opt.wait_io()
        dt = time.perf_counter() - t0
        # The first step creates the state; the next two measure how each device
        # serves reads and writes (at once or in one line).
        if step >= warm:
            times.append(dt)
            moved.append((opt.stats["read_bytes"] - r0, opt.stats["write_bytes"] - w0))
    masters = opt.master_params()
    out: dict[str, Any] = {
        "mode": name,
        "step_s": statistics.median(times),
        "steps_s": times,
        "read_bytes": statistics.median(m[0] for m in moved),
        "write_bytes": statistics.median(m[1] for m in moved),
        "host_peak_bytes": opt.host_bytes(),
        "placement": {k: v for k, v in opt.placement().items()},
        "bandwidth": opt.bandwidth(),
        "checksum": float(sum(m.double().sum() for m in masters)),
        "crc": _core.crc32_regions([(m.data_ptr(), m.numel() * 4) for m in masters], 2),
    }
    opt.close()
    return out


def run_deepspeed(args: argparse.Namespace, disk: Path) -> dict[str, Any] | None:
    try:
        py = subprocess.run(
            ["bash", str(HERE / "setup_deepspeed.sh")], capture_output=True, text=True, check=True
        ).stdout.strip()
    except subprocess.CalledProcessError as e:
        print(f"DeepSpeed baseline skipped: setup failed: {e.stderr.strip()[-500:]}", flush=True)
        return None
    out = disk / "ds.json"
    host = tierstore.checkpointer.parse_size(args.host)
    cmd = [py, str(HERE / "ds_baseline.py"), "--params", str(args.params), "--host", str(host)]
    cmd += ["--dir", str(disk), "--steps", str(args.steps + WARM), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        print(f"DeepSpeed baseline failed: {r.stderr.strip()[-800:]}", flush=True)
        return None
    d = json.loads(out.read_text())
    timed = d["step_times_s"][WARM:] or d["step_times_s"][1:]  # after as many warm-up steps as ours
    return {
        "mode": "deepspeed, disk",
        "step_s": statistics.median(timed),
        "steps_s": timed,
        "read_bytes": d["read_bytes_per_step"],
        "write_bytes": d["write_bytes_per_step"],
        "checksum": d["checksum"],
        "detail": {k: v for k, v in d.items() if k not in ("checksum",)},
    }


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
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after the warm-up steps)")
    ap.add_argument("--dir", default=".", help="a directory on the disk")
    ap.add_argument("--fast-rate", type=int, default=600, help="MiB/s per direction of the fast loop device")
    ap.add_argument("--slow-rate", type=int, default=300, help="MiB/s per direction of the slow loop device")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the disk modes (its rate drifts)")
    ap.add_argument("--two-rounds", type=int, default=4, help="rounds of the two-process variants")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-two-processes", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n = int(args.params)
    state = 12 * n
    print(
        f"{n / 1e6:.0f} M bf16 parameters: {state / 2**30:.2f} GiB of fp32 master + AdamW state "
        f"({10 * n / 2**30:.2f} GiB with split masters); host budget "
        f"{args.host}, subgroups of {args.subgroup}; torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    disk = Path(tempfile.mkdtemp(prefix="ts-offbench-", dir=args.dir))
    ceiling_bytes = min(1 << 30, max(state // 2, 256 << 20))
    size_mib = max(state, 2 * ceiling_bytes) // 2**20 + 512
    fast = slow_path(f"bench{os.getpid()}f", size_mib, args.fast_rate)
    slow = slow_path(f"bench{os.getpid()}s", size_mib, args.slow_rate)
    chunk = 12 * TENSOR
    results: list[dict[str, Any]] = []
    ceilings: dict[str, dict[str, float]] = {}
    two: dict[str, list[float]] = {}
    try:
        label = {disk: "disk"}

        def measure_ceiling(name: str, d: Path) -> None:
            """The best the path showed in this run (the bound is the stricter for it)."""
            c = ceiling(d, ceiling_bytes, chunk)
            print(
                f"ceiling {name}: write {c['write'] / 2**30:.2f}, read {c['read'] / 2**30:.2f}, "
                f"both at once {c['both'] / 2**30:.2f} GiB/s",
                flush=True,
            )
            old = ceilings.get(name)
            ceilings[name] = c if old is None else {k: max(c[k], old[k]) for k in c}

        for name, d in (("disk", disk), ("fast", fast), ("slow", slow)):
            if d is not None:
                label[d] = name
                measure_ceiling(name, d)
        # The disk's rate drifts within minutes: its modes run in rounds, one
        # after the other in each, and each mode's step is the median of all
        # its rounds' steps (the throttled loop devices do not drift).
        disk_modes: list[tuple[str, list[Path], dict[str, Any]]] = [
            ("naive, disk", [disk], {"pipeline": False, "split_masters": False}),
            ("tierstore, disk, masters whole", [disk], {"split_masters": False}),
            ("tierstore, disk", [disk], {}),
        ]
        if not args.no_deepspeed:
            disk_modes.append(("deepspeed, disk", [disk], {}))
        modes: list[tuple[str, list[Path], dict[str, Any]]] = [("in memory", [disk], {"host": f"{state * 2}B"})]
        for rnd in range(args.rounds):
            modes += [(name, paths, {**kw, "_round": rnd}) for name, paths, kw in disk_modes]
        if fast is not None and slow is not None:
            modes += [
                ("naive, fast", [fast], {"pipeline": False, "split_masters": False}),
                ("tierstore, fast", [fast], {}),
                ("tierstore, slow", [slow], {}),
                ("tierstore, fast+slow even", [fast, slow], {"balance": "even"}),
                ("tierstore, fast+slow", [fast, slow], {}),
            ]
        by_mode: dict[str, dict[str, Any]] = {}
        for name, paths, kw in modes:
            rnd = kw.pop("_round", 0)
            if rnd > 0 and name == disk_modes[0][0]:
                measure_ceiling("disk", disk)
            if name.startswith("deepspeed"):
                r = run_deepspeed(args, disk)
                if r is None:
                    continue
            else:
                r = run_mode(name, args, paths, **kw)
            r["paths"] = [label[p] for p in paths]
            prev = by_mode.get(name)
            if prev is None:
                by_mode[name] = r
                results.append(r)
            else:  # another round: the same bytes and end values, more step times
                prev["steps_s"] = prev["steps_s"] + r["steps_s"]
                prev["step_s"] = statistics.median(prev["steps_s"])
                for k in ("crc", "checksum"):
                    if k in r and r[k] != prev[k]:
                        prev[k] = "differs between rounds"
            shown = name + (f" (round {rnd + 1})" if any(name == m[0] for m in disk_modes) else "")
            moved = f"read {r['read_bytes'] / 2**30:5.2f} GiB  write {r['write_bytes'] / 2**30:5.2f} GiB"
            steps = ", ".join(f"{t:.2f}" for t in r["steps_s"])
            print(f"{shown:42} step {statistics.median(r['steps_s']):6.2f} s  {moved}  ({steps})", flush=True)
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
    report(args, results, ceilings, two)
    return 0


def report(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    ceilings: dict[str, dict[str, float]],
    two: dict[str, list[float]],
) -> None:
    by = {r["mode"]: r for r in results}
    compute = by["in memory"]["step_s"]

    def bound(r: dict[str, Any]) -> float:
        """Bytes moved at the paths' ceilings (the better of one direction
        after the other and both at once), plus the update compute."""
        cs = [ceilings[p] for p in r["paths"]]
        rd, wr = r["read_bytes"], r["write_bytes"]
        serial = rd / sum(c["read"] for c in cs) + wr / sum(c["write"] for c in cs)
        both = (rd + wr) / sum(c["both"] for c in cs)
        return float(min(serial, both) + compute)

    print()
    print(
        f"{'mode':31} {'step s':>7} {'read GiB':>9} {'write GiB':>10} {'I/O GiB/s':>10} {'bound s':>8} {'x bound':>8}"
    )
    for r in results:
        io = (r["read_bytes"] + r["write_bytes"]) / 2**30 / r["step_s"]
        b = bound(r) if r["mode"] != "in memory" else compute
        r["bound_s"] = b
        print(
            f"{r['mode']:31} {r['step_s']:7.2f} {r['read_bytes'] / 2**30:9.2f} {r['write_bytes'] / 2**30:10.2f} "
            f"{io:10.2f} {b:8.2f} {r['step_s'] / b:8.2f}"
        )
    ours = [r for r in results if r["mode"] != "deepspeed, disk"]
    same = len({tuple(r["crc"]) for r in ours}) == 1
    ds_same = "deepspeed, disk" not in by or by["deepspeed, disk"]["checksum"] == by["in memory"]["checksum"]
    print(f"\nsame fp32 masters after every mode: {'yes' if same and ds_same else 'NO'}")
    checks: list[tuple[str, float, str, bool]] = []

    def check(what: str, value: float, target: float, higher_is_better: bool) -> None:
        ok = value >= target if higher_is_better else value <= target
        checks.append((what, value, f"{'>=' if higher_is_better else '<='} {target}", ok))

    for m in ("tierstore, disk, masters whole", "tierstore, disk", "tierstore, fast", "tierstore, fast+slow"):
        if m in by:
            check(f"{m}: step / bound", by[m]["step_s"] / by[m]["bound_s"], 1.15, False)
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
                f"{ours_m}: 2x {naive_m} needs a step of {by[naive_m]['step_s'] / 2:.2f} s; "
                f"its bytes at the ceilings plus the update take {by[ours_m]['bound_s']:.2f} s"
            )
    if "deepspeed, disk" in by:
        for m in ("tierstore, disk, masters whole", "tierstore, disk"):
            check(f"{m} vs deepspeed: speed-up", by["deepspeed, disk"]["step_s"] / by[m]["step_s"], 1.0, True)
    if "tierstore, fast+slow" in by:
        mp_s = by["tierstore, fast+slow"]["step_s"]
        check(
            "fast+slow vs best single path: speed-up",
            min(by["tierstore, fast"]["step_s"], by["tierstore, slow"]["step_s"]) / mp_s,
            1.0,
            True,
        )
        check("fast+slow vs even split: speed-up", by["tierstore, fast+slow even"]["step_s"] / mp_s, 1.0, True)
    if two:
        off = statistics.median(two["turns off"])
        for key in [k for k in two if k != "turns off"]:
            check(f"two processes: {key} / turns off, throughput", statistics.median(two[key]) / off, 1.0, True)
    print()
    for what, value, target, ok in checks:
        print(f"{'MET   ' if ok else 'MISSED'} {what}: {value:.2f} (target {target})")
    print()
    for line in limits:
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "ceilings": ceilings,
                    "results": results,
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
