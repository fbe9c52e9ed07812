"""Optimizer step time with the state offloaded (first version of the benchmark).

One run, the same parameters and gradients for every mode: AdamW fully in
memory (the lower bound), the naive synchronous offload (each subgroup read,
updated, written in turn, one path), tierstore's pipelined offload on one path
(the disk), and on two paths of different bandwidth (the disk and a RAM file
system). Also the I/O bandwidth achieved against the engine's raw write and
read rate on the disk, measured in the same run.

    python benches/bench_offload.py [--params 50e6 --host 256MiB --subgroup 64MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore import DiskTier, HostTier, _core


def make_params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    sizes = [4 << 20] * (n // (4 << 20)) + ([n % (4 << 20)] if n % (4 << 20) else [])
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in sizes]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def raw_ceiling(d: Path, nbytes: int) -> tuple[float, float]:
    """Engine write (durable) and read rate of one large file on ``d``."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    f = d / "ceiling.pt"
    t0 = time.perf_counter()
    w = _core.create_writer(tierstore.get_engine(), f, durable=True)
    w.add_memory("c/data/0", buf.data_ptr(), nbytes, buf)
    w.write_data()
    off = w.entries()[0][2]
    w.commit()
    wt = time.perf_counter() - t0
    os.posix_fadvise(os.open(f, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    _core.read_ranges(tierstore.get_engine(), f, [off], [nbytes], [buf.data_ptr()])
    rt = time.perf_counter() - t0
    f.unlink()
    return nbytes / wt, nbytes / rt


def run(mode: str, args: argparse.Namespace, disk: Path, fast: Path) -> dict[str, Any]:
    params = make_params(int(args.params))
    kw = {"lr": 1e-4, "weight_decay": 0.01}
    if mode == "in memory":
        opt: Any = torch.optim.AdamW(params, **kw)
    else:
        paths = [str(disk)] if mode != "tierstore 2 paths" else [str(disk), str(fast)]
        opt = tierstore.offload(
            torch.optim.AdamW,
            params,
            tiers=[HostTier(args.host), DiskTier(paths)],
            subgroup_bytes=args.subgroup,
            pipeline=mode != "naive sync",
            **kw,
        )
    times = []
    for step in range(args.steps):
        set_grads(params, step)
        t0 = time.perf_counter()
        opt.step()
        if hasattr(opt, "wait_io"):
            opt.wait_io()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"mode": mode, "step_s": statistics.median(times[1:]), "first_step_s": times[0]}
    if hasattr(opt, "stats"):
        moved = (opt.stats["read_bytes"] + opt.stats["write_bytes"]) / args.steps
        out["moved_gib_per_step"] = moved / 2**30
        out["io_gib_s"] = moved / 2**30 / out["step_s"]
        out["placement_mib"] = {k: v / 2**20 for k, v in opt.placement().items()}
        opt.close()
    out["checksum"] = float(sum(p.detach().double().sum() for p in params))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--host", default="256MiB")
    ap.add_argument("--subgroup", default="64MiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--fast-dir", default="/dev/shm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    disk = Path(tempfile.mkdtemp(prefix="ts-offbench-", dir=args.dir))
    fast = Path(tempfile.mkdtemp(prefix="ts-offbench-", dir=args.fast_dir))
    try:
        state = int(args.params) * 12
        print(
            f"{args.params / 1e6:.0f} M parameters: {state / 2**30:.2f} GiB of fp32 master + AdamW state; "
            f"host budget {args.host}, subgroups of {args.subgroup}",
            flush=True,
        )
        wbw, rbw = raw_ceiling(disk, 512 << 20)
        print(
            f"disk ceiling (engine, same run): write {wbw / 2**30:.2f} GiB/s, read {rbw / 2**30:.2f} GiB/s", flush=True
        )
        results = []
        for mode in ("in memory", "naive sync", "tierstore 1 path", "tierstore 2 paths"):
            r = run(mode, args, disk, fast)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    sums = {r["checksum"] for r in results}
    print()
    print(f"{'mode':18} {'step s':>8} {'GiB moved':>10} {'I/O GiB/s':>10}")
    for r in results:
        print(f"{r['mode']:18} {r['step_s']:8.2f} {r.get('moved_gib_per_step', 0):10.2f} {r.get('io_gib_s', 0):10.2f}")
    by = {r["mode"]: r for r in results}
    print(f"same parameters after every mode: {'yes' if len(sums) == 1 else 'NO'}")
    print(f"pipelined 1 path vs naive: {by['naive sync']['step_s'] / by['tierstore 1 path']['step_s']:.2f}x faster")
    print(f"2 paths vs 1 path: {by['tierstore 1 path']['step_s'] / by['tierstore 2 paths']['step_s']:.2f}x faster")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "ceiling": [wbw, rbw]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
