"""Training with checkpoints: what each way of checkpointing costs the loop.

A GPT-style model (tens of millions of parameters, AdamW state) trains on the
CPU (or the GPU when there is one), saving every ``--every`` steps, in one run
per mode on the same model, data and state:

- ``none``: no checkpoints (the step time to compare against);
- ``torch.save``: synchronous ``torch.save`` + fsync;
- ``dcp.async_save``: PyTorch DCP ``async_save`` with its ``DefaultStager``
  (async staging; pinned and shared memory where they apply); the loop waits
  for staging before the next optimizer step, as DCP's recipe says;
- ``tierstore``: ``tierstore.Checkpointer`` (host tier + local disk), attached
  to the optimizer;
- ``tierstore 2-tier``: the same with a fast local tier (RAM file system) and a
  slower one (the disk) as its remote tier.

Per checkpoint: training time blocked, time until durable on the local tier,
host memory the mode used. Also a plain ``tierstore.save`` of the same state
(the reference for "durable locally") and a 1,000-save memory check.

    python benches/bench_checkpoint.py [--layers 6 --width 640 --steps 24 --every 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore.demo import TinyGPT

sys.path.insert(0, str(Path(__file__).parent))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fsync_tree(p: Path) -> None:
    for f in [p] if p.is_file() else sorted(p.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class Run:
    def __init__(self, args: argparse.Namespace, device: str) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT(args.vocab, args.width, args.layers, max(1, args.width // 64), args.ctx).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.args = args
        self.device = device
        g = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, args.vocab, (args.steps + 1, args.batch, args.ctx + 1), generator=g)

    def step(self, i: int, before_step: Any = None) -> float:
        b = self.data[i].to(self.device)
        logits = self.model(b[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
        loss.backward()
        if before_step is not None:
            before_step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())


def run_mode(mode: str, args: argparse.Namespace, root: Path, device: str) -> dict[str, Any]:
    r = Run(args, device)
    r.step(0)  # warm-up (allocates optimizer state)
    d = root / mode.replace(" ", "_").replace(".", "_")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    rss0 = _rss_mib()
    per: list[dict[str, float]] = []
    step_times: list[float] = []
    ck: tierstore.Checkpointer | None = None
    pending: list[Any] = []  # dcp responses
    staging_wait = [0.0]
    if mode.startswith("tierstore"):
        if mode == "tierstore":
            tiers: list[Any] = [tierstore.HostTier(args.host_budget), tierstore.DiskTier(".", keep_last=2)]
        else:
            fast = Path(args.fast_dir) / f"ts-bench-{os.getpid()}"
            tiers = [
                tierstore.HostTier(args.host_budget),
                tierstore.DiskTier(str(fast), keep_last=2),
                tierstore.RemoteTier(".", keep_last=2),
            ]
        ck = tierstore.Checkpointer(d, tiers=tiers)
        ck.attach(r.opt)
    if mode == "dcp.async_save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=torch.cuda.is_available(),
            )
        )

    def wait_staging() -> None:
        # DCP's zero-overhead recipe: the step waits for staging of the last save.
        t0 = time.perf_counter()
        for resp in pending:
            if not resp["staged"]:
                resp["resp"].staging_completion.result()
                resp["staged"] = True
        dt = time.perf_counter() - t0
        staging_wait[0] += dt
        if pending:
            pending[-1]["blocked"] += dt

    hook = wait_staging if mode == "dcp.async_save" else None
    t_all = time.perf_counter()
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        r.step(i, hook)
        if i % args.every == 0:
            state = _state(r.model, r.opt)
            ts = time.perf_counter()
            if mode == "torch.save":
                p = d / f"step-{i}.pt"
                torch.save(state, p)
                _fsync_tree(p)
                dt = time.perf_counter() - ts
                per.append({"step": i, "blocked": dt, "to_local": dt})
            elif mode == "dcp.async_save":
                resp = dcp.async_save(state, checkpoint_id=str(d / f"step-{i}"), async_stager=stager, no_dist=True)
                pending.append({"resp": resp, "t": ts, "blocked": time.perf_counter() - ts, "staged": False, "step": i})
            elif ck is not None:
                ck.save(i, state)
        step_times.append(time.perf_counter() - t0)
    # Durable everywhere before the clock stops for the loop total.
    if mode == "dcp.async_save":
        for pr in pending:
            pr["resp"].upload_completion.result()
            per.append({"step": pr["step"], "blocked": pr["blocked"], "to_local": time.perf_counter() - pr["t"]})
        # The upload future's completion time is what counts; re-measure precisely below.
    if ck is not None:
        ck.wait()
    total = time.perf_counter() - t_all
    if ck is not None:
        for h in ck.handles():
            per.append(
                {
                    "step": h.step,
                    "blocked": h.timings.get("blocked", 0.0),
                    "to_local": h.timings.get("to_local", float("nan")),
                    "to_remote": h.timings.get("to_remote", float("nan")),
                }
            )
        stats = ck.stats()
        host = stats["host_peak"] / 2**20
        ck.close()
    else:
        host = max(0.0, _rss_mib() - rss0)
    if mode == "tierstore 2-tier":
        shutil.rmtree(Path(args.fast_dir) / f"ts-bench-{os.getpid()}", ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {
        "mode": mode,
        "loop_s": total,
        "step_median_s": statistics.median(step_times),
        "checkpoints": len(per),
        "host_mib": host,
    }
    if per:
        out["blocked_median_s"] = statistics.median(p["blocked"] for p in per)
        out["to_local_median_s"] = statistics.median(p["to_local"] for p in per)
        rem = [p["to_remote"] for p in per if "to_remote" in p and p["to_remote"] == p["to_remote"]]
        if rem:
            out["to_remote_median_s"] = statistics.median(rem)
    del r
    gc.collect()
    return out


def dcp_durable_times(args: argparse.Namespace, root: Path, device: str) -> float:
    """Time from async_save to durable for DCP, one save at a time (no queueing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    r = Run(args, device)
    r.step(0)
    stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, True, torch.cuda.is_available()))
    times = []
    for k in range(args.reps):
        d = root / f"dcp-one-{k}"
        t0 = time.perf_counter()
        resp = dcp.async_save(_state(r.model, r.opt), checkpoint_id=str(d), async_stager=stager, no_dist=True)
        resp.upload_completion.result()
        times.append(time.perf_counter() - t0)
        shutil.rmtree(d, ignore_errors=True)
    return statistics.median(times)


def plain_save_times(args: argparse.Namespace, root: Path, device: str) -> tuple[list[float], int]:
    """Durable ``tierstore.save`` of the same state, ``--reps`` times (the disk
    is shared and noisy: this runs before and after the modes, and the
    reference is the median of both)."""
    r = Run(args, device)
    r.step(0)
    state = _state(r.model, r.opt)
    times = []
    for k in range(args.reps):
        p = root / f"plain-{k}.pt"
        t0 = time.perf_counter()
        tierstore.save(state, p)
        times.append(time.perf_counter() - t0)
        p.unlink()
    return times, _nbytes(state)


def memory_over_saves(n: int, root: Path, fast_dir: str) -> dict[str, Any]:
    """``n`` saves of a small state to a RAM file system: host memory stays flat."""
    torch.manual_seed(0)
    state = {"w": torch.randn(1 << 20), "b": torch.randn(4096), "step": 0}
    budget = 16 << 20
    d = Path(fast_dir) / f"ts-mem-{os.getpid()}"
    allocated = []
    rss = []
    with tierstore.Checkpointer(d, tiers=[tierstore.HostTier(budget), tierstore.DiskTier(".", keep_last=2)]) as ck:
        for i in range(n):
            state["w"].add_(1)
            state["step"] = i
            ck.save(i, state)
            ck.wait_capture()
            if i % max(1, n // 10) == 0 or i == n - 1:
                allocated.append(ck.stats()["host_allocated"])
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        ck.wait()
    shutil.rmtree(d, ignore_errors=True)
    return {
        "saves": n,
        "budget_mib": budget / 2**20,
        "host_allocated_mib_max": max(allocated) / 2**20,
        "host_allocated_mib_first_last": [allocated[0] / 2**20, allocated[-1] / 2**20],
        "max_rss_mib_first_last": [rss[0], rss[-1]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-budget", default="2GiB")
    ap.add_argument("--dir", default=None, help="directory on the local disk (default: a temporary one under .)")
    ap.add_argument("--fast-dir", default="/dev/shm", help="a faster file system for the 2-tier run")
    ap.add_argument("--memory-saves", type=int, default=1000)
    ap.add_argument("--modes", default="none,torch.save,dcp.async_save,tierstore,tierstore 2-tier")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="ts-ckbench-", dir=args.dir or "."))
    try:
        r = Run(args, device)
        nparams = sum(p.numel() for p in r.model.parameters())
        del r
        print(
            f"model: {nparams / 1e6:.1f} M parameters, {args.layers} layers x {args.width}, AdamW; device {device}; "
            f"{args.steps} steps, a checkpoint every {args.every}; disk {root}",
            flush=True,
        )
        plain_before, nbytes = plain_save_times(args, root, device)
        print(f"state: {nbytes / 2**20:.0f} MiB; plain tierstore.save (durable): {plain_before}", flush=True)
        results = []
        for mode in args.modes.split(","):
            res = run_mode(mode, args, root, device)
            results.append(res)
            print(json.dumps(res), flush=True)
        plain_after, _ = plain_save_times(args, root, device)
        plain = statistics.median(plain_before + plain_after)
        print(f"plain tierstore.save after the runs: {plain_after}; median of all: {plain:.3f} s", flush=True)
        dcp_one = dcp_durable_times(args, root, device) if "dcp.async_save" in args.modes else None
        mem = memory_over_saves(args.memory_saves, root, args.fast_dir) if args.memory_saves else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by = {r["mode"]: r for r in results}
    base = by.get("none", {}).get("step_median_s")
    print()
    print(f"{'mode':18} {'blocked/ckpt':>13} {'durable local':>14} {'durable 2nd':>12} {'host MiB':>9} {'loop s':>8}")
    for r in results:
        print(
            f"{r['mode']:18} {r.get('blocked_median_s', 0):13.3f} {r.get('to_local_median_s', float('nan')):14.3f} "
            f"{r.get('to_remote_median_s', float('nan')):12.3f} {r['host_mib']:9.0f} {r['loop_s']:8.2f}"
        )
    if base:
        print(f"step time without checkpoints: {base:.3f} s")
    verdict: dict[str, Any] = {
        "state_mib": nbytes / 2**20,
        "plain_tierstore_save_s": plain,
        "dcp_one_save_durable_s": dcp_one,
    }
    ts, ref, dc = by.get("tierstore"), by.get("torch.save"), by.get("dcp.async_save")
    if ts and ref:
        verdict["blocked_vs_torch_save"] = ts["blocked_median_s"] / ref["blocked_median_s"]
    if ts and dc:
        verdict["blocked_vs_dcp_async"] = ts["blocked_median_s"] / dc["blocked_median_s"]
    if ts:
        verdict["to_local_vs_plain_save"] = ts["to_local_median_s"] / plain
    if mem:
        verdict["memory"] = mem
    print()
    if "blocked_vs_torch_save" in verdict:
        print(f"tierstore blocked / torch.save blocked: {verdict['blocked_vs_torch_save']:.3f} (target <= 0.05)")
    if "blocked_vs_dcp_async" in verdict:
        print(f"tierstore blocked / DCP async_save blocked: {verdict['blocked_vs_dcp_async']:.3f} (target <= 0.5)")
    if "to_local_vs_plain_save" in verdict:
        print(
            f"tierstore time to durable-local / plain tierstore.save: {verdict['to_local_vs_plain_save']:.2f} "
            f"(target <= 1.25)"
        )
    if dcp_one is not None:
        print(f"DCP async_save, one save until durable: {dcp_one:.3f} s")
    if mem:
        print(
            f"host memory over {mem['saves']} saves: allocated max {mem['host_allocated_mib_max']:.1f} MiB "
            f"(budget {mem['budget_mib']:.0f}); max RSS {mem['max_rss_mib_first_last'][0]:.0f} -> "
            f"{mem['max_rss_mib_first_last'][1]:.0f} MiB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "verdict": verdict}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
