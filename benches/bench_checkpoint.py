"""Training with checkpoints: the loop time each way of checkpointing costs.

What a user feels is how much longer training takes, not how long a call
blocks: background capture and flush compete with the step for the CPU and
memory bandwidth, and only the loop time shows it. So the headline figure is

    overhead per checkpoint = (loop time of a mode - loop time without checkpoints) / checkpoints

measured on the same model, data and disk, with each (round, mode) run in a
fresh process (no allocator or page-cache state carried between modes) and
the modes interleaved: round 0 runs them in order, round 1 in reverse, and so
on, so that drift of the machine does not favour one. Each mode's loop time
is compared with the no-checkpoint loop of its own round; the table gives the
median and the spread over the rounds. The time blocked in ``save`` calls is
reported beside it.

Workloads (``--workloads``):

- ``gpt``: the demo's GPT (40.1 M parameters, 6 layers x 640, tied
  embeddings) with AdamW (499 MiB of state);
- ``mlp``: an MLP of 16.8 M parameters (4 x Linear 2048x2048) with AdamW
  (201 MiB), the simple steady-state loop a user would try first.

Both use ``--threads`` torch threads (2 = every core of the reference VM).
Each run does a warm-up step and a warm-up save (first-time allocations), then
``--steps`` timed steps with a checkpoint every ``--every`` steps; the last
checkpoint comes ``--every`` steps before the end, so each one's background
work falls inside the timed loop.

Modes:

- ``none``: no checkpoints;
- ``torch.save``: synchronous ``torch.save`` + fsync of the file;
- ``dcp.async_save``: PyTorch DCP ``async_save`` with its ``DefaultStager``
  (async staging); the step waits for the last save's staging before the
  optimizer changes the tensors, as DCP's recipe says; durability is the time
  its upload future completes (a done-callback records it when it happens);
- ``tierstore``: ``tierstore.Checkpointer`` (host tier + local disk) attached
  to the optimizer;
- ``tierstore 2-tier``: the same with a RAM file system as the local tier and
  the disk as the remote tier;
- ``tierstore sync-capture``: ``tierstore`` with the capture waited for at
  once (``save`` then ``wait_capture``): the copy done while the step
  waits, with both cores free of training, instead of beside it;
- ``floor checksum``, ``floor capture``, ``floor write``: not checkpoints,
  the parts of one alone, to show what any checkpoint of this state costs
  the loop on this machine: one CRC-32 pass over every byte of the state
  (the least a verified checkpoint does); the Checkpointer's capture kernel
  (copy into kept host buffers with 512-byte chunk sums, one pass); that
  copy written as it is to a new file with O_DIRECT (8 MiB ``pwrite`` calls)
  and fsynced, the previous file removed (no format, no metadata). Each
  runs on one background thread started at the save; the step waits for it
  before the optimizer changes the tensors;
- ``tierstore idle-pri``, ``tierstore low-pri``, ``tierstore normal-pri``:
  ``tierstore`` with its background threads under each scheduling class
  (``priority="idle"``: ``SCHED_IDLE``; ``"low"``: nice 19; ``"normal"``), to
  show what each costs (``tierstore`` itself runs the Checkpointer's default).

Per mode also: time until durable, current RSS above the pre-loop baseline
(sampled every 10 ms by a thread: peak), and where the CPU went, per thread
(``/proc/self/task/*/stat``, grouped by thread name: training, tierstore's
capture/flush/promote threads, the engine's I/O threads, torch's OpenMP pool).
``--perf`` also records the tierstore mode with ``perf`` in one more run,
not counted in the figures (recording slows the process), and prints the
heaviest symbols of the background threads (copy, checksum, write submission).

``--paired N`` (default 6) also measures each mode in its own process in N
pairs of adjacent blocks (a block of ``--every`` steps that starts with a
save against one without, ABBA order): drift of the machine over seconds
cancels there, where across processes it does not.

    python benches/bench_checkpoint.py [--workloads gpt,mlp --rounds 3 --steps 32 --every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODES = (
    "none,torch.save,dcp.async_save,tierstore,tierstore 2-tier,tierstore idle-pri,tierstore low-pri,"
    "tierstore normal-pri,tierstore sync-capture,floor checksum,floor capture,floor write"
)
PRI_MODES = {"tierstore idle-pri": "idle", "tierstore low-pri": "low", "tierstore normal-pri": "normal"}


# ---------------------------------------------------------------------------------------------
# one run, in its own process


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _RssSampler:
    def __init__(self) -> None:
        self.base = _rss_mib()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_mib())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._t.join()
        return {"rss_base_mib": self.base, "rss_peak_above_base_mib": self.peak - self.base}


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = s[s.index("(") + 1 : s.rindex(")")]
        fields = s[s.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _cpu_by_group(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], process_cpu: float
) -> dict[str, float]:
    """CPU seconds per thread group; threads that ended in between (the
    engine's short-lived checksum and write workers) are the remainder of
    the process's total."""
    main = threading.main_thread().native_id
    groups: dict[str, float] = {}
    for tid, (name, t) in after.items():
        dt = t - before.get(tid, (name, 0.0))[1]
        if dt <= 0:
            continue
        if tid == main:
            g = "training (main thread)"
        elif name.startswith("ts-") or name.startswith("tierstore"):
            g = name
        elif name in ("python", "python3") or name.startswith("pt_") or name.startswith("python"):
            g = "torch/OpenMP and other threads"
        else:
            g = name
        groups[g] = groups.get(g, 0.0) + dt
    gone = process_cpu - sum(groups.values())
    if gone > 0.05:
        groups["threads that ended (engine workers)"] = gone
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _settle(ck: Any, uploads: list[Any]) -> bool:
    """Waits (outside any clock) until every save so far is durable; True
    when one was still in flight (its work spilled past the block that
    started it)."""
    busy = False
    if ck is not None:
        busy = any(h.state not in ("durable-local", "durable", "failed") for h in ck.handles())
        ck.wait()
    for u in uploads:
        busy = busy or not u.done()
        u.result()
    return busy


def _write_direct(buf: Any, nbytes: int, path: Path) -> None:
    """Writes the first ``nbytes`` (a multiple of 4 KiB) of ``buf`` from its
    first page boundary to a new file with O_DIRECT, 8 MiB per call, then
    fsyncs it."""
    base = -buf.data_ptr() % 4096
    mem = memoryview(buf.numpy())[base : base + nbytes - 4096]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        step = 8 << 20
        for off in range(0, len(mem), step):
            os.pwrite(fd, mem[off : off + step], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _steal() -> tuple[float, float]:
    """The machine's (steal, all) CPU seconds so far, from /proc/stat: time
    the hypervisor ran something else while this VM's CPUs wanted to run."""
    with open("/proc/stat") as f:
        xs = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return xs[7] / tick, sum(xs[:8]) / tick


def _tensors(tree: Any) -> list[Any]:
    """Every tensor leaf of a state dict (tierstore's own flattening), each
    memory once (tied weights)."""
    import torch

    from tierstore import _tree

    out: dict[tuple[int, int], Any] = {}
    for leaf in _tree.flatten(tree):
        x = leaf.value
        if isinstance(x, torch.Tensor):
            out.setdefault((x.data_ptr(), x.numel() * x.element_size()), x)
    return list(out.values())


def _paired_blocks(args: argparse.Namespace, step: Any, save: Any, ck: Any, uploads: list[Any]) -> dict[str, Any]:
    """Loop time lost per checkpoint measured in adjacent blocks of one
    process: a block of ``--every`` steps that starts with a save against one
    of ``--every`` steps without, in the order ABBA BAAB ..., so that drift of
    the machine over seconds cancels (across processes it does not: a fresh
    process's loop time moved by 10-40% between minutes on the 2-core VM).
    Each block starts once every earlier save is durable, so a save's
    background work falls in its own block; a save still in flight at the end
    of its block is counted as spilled (its remaining work is then missed)."""
    if save is None or args.paired <= 0:
        return {}
    diffs: list[float] = []
    plain: list[float] = []
    spilled = 0
    k = 10_000
    for j in range(args.paired):
        order = "AB" if j % 2 == 0 else "BA"
        t: dict[str, float] = {}
        for kind in order:
            _settle(ck, uploads)
            t0 = time.perf_counter()
            if kind == "A":
                k += args.every
                save(k)
            for i in range(args.every):
                step(k + i)
            t[kind] = time.perf_counter() - t0
            if kind == "A":
                spilled += _settle(ck, uploads)
        diffs.append(t["A"] - t["B"])
        plain.append(t["B"])
    _settle(ck, uploads)
    return {"lost_s": diffs, "block_s": plain, "spilled": spilled, "pairs": args.paired}


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    import tierstore

    torch.manual_seed(0)
    if args.workload == "gpt":
        from tierstore.demo import TinyGPT

        model: torch.nn.Module = TinyGPT(16384, 640, 6, 10, 64)
        data = [torch.randint(0, 16384, (4, 65)) for _ in range(8)]

        def loss_of(i: int) -> torch.Tensor:
            b = data[i % len(data)]
            logits = model(b[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    elif args.workload == "mlp":
        width = 2048
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
        xs = [torch.randn(256, width) for _ in range(8)]

        def loss_of(i: int) -> torch.Tensor:
            return model(xs[i % len(xs)]).square().mean()

    else:
        raise SystemExit(f"unknown workload {args.workload!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before_step: list[Any] = []

    def step(i: int) -> None:
        loss_of(i).backward()
        for f in before_step:
            f()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    root = Path(args.dir)
    d = root / f"{args.workload}-{args.mode.replace(' ', '_').replace('.', '_')}-{os.getpid()}"
    d.mkdir(parents=True)
    fast = Path(args.fast_dir) / f"ts-ckbench-{os.getpid()}"
    per: list[dict[str, float]] = []
    ck: Any = None
    save: Any = None
    done_at: dict[int, float] = {}
    t_save: dict[int, float] = {}
    uploads: list[Any] = []
    try:
        if args.mode == "torch.save":
            from tierstore._fs import fsync_file

            def save(i: int) -> None:
                p = d / f"step-{i}.pt"
                torch.save(state(), p)
                fsync_file(p)
                done_at[i] = time.perf_counter()
                if i > 0:
                    (d / f"step-{i - args.every}.pt").unlink(missing_ok=True)

        elif args.mode == "dcp.async_save":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(False, False, True, False))
            pending: list[Any] = []

            def wait_staging() -> None:
                for resp in pending:
                    resp.staging_completion.result()
                pending.clear()

            before_step.append(wait_staging)

            def save(i: int) -> None:
                resp = dcp.async_save(state(), checkpoint_id=str(d / f"step-{i}"), async_stager=stager, no_dist=True)

                def done(_f: Any, i: int = i) -> None:
                    done_at[i] = time.perf_counter()

                resp.upload_completion.add_done_callback(done)
                pending.append(resp)
                uploads.append(resp.upload_completion)

        elif args.mode in ("floor checksum", "floor capture", "floor write"):
            # Parts of a checkpoint's work alone, each on one background
            # thread that the step waits for as it waits for a capture (see
            # the module's docstring: "floor checksum", "floor capture",
            # "floor write").
            from tierstore import _core

            passes: list[threading.Thread] = []
            spare: list[torch.Tensor] = []

            def wait_pass() -> None:
                for t in passes:
                    t.join()
                passes.clear()

            before_step.append(wait_pass)

            def save(i: int) -> None:
                regions = [
                    (t.data_ptr(), t.numel() * t.element_size())
                    for t in _tensors(state())
                    if t.numel() and t.is_contiguous()
                ]

                def run(i: int = i) -> None:
                    if args.mode == "floor checksum":
                        _core.crc32_regions(regions, 1)
                    else:
                        # The capture's own kernel: copy into host memory and
                        # sum each chunk in the same pass, into buffers kept
                        # from one save to the next; nothing written.
                        gate = _core.Gate()
                        need = sum(-(-n // 4096) * 4096 for _a, n in regions) + 4096
                        if len(spare) == 0 or spare[0].numel() < need:
                            spare[:] = [torch.empty(need, dtype=torch.uint8)]
                        base = spare[0].data_ptr() + (-spare[0].data_ptr() % 4096)
                        for k, (a, n) in enumerate(regions):
                            gate.copy_in(k, base, a, n)
                            base += -(-n // 4096) * 4096
                        if args.mode == "floor write":
                            # ... and written as they are, with O_DIRECT
                            # from those buffers into a new file, fsynced;
                            # the one before it removed (no format, no
                            # metadata, no checksums kept).
                            _write_direct(spare[0], need, d / f"pass-{i}.bin")
                            (d / f"pass-{i - 2 * args.every}.bin").unlink(missing_ok=True)
                    done_at[i] = time.perf_counter()

                th = threading.Thread(target=run, name="floor-pass", daemon=True)
                th.start()
                passes.append(th)

        elif args.mode.startswith("tierstore"):
            if args.mode in ("tierstore", "tierstore sync-capture") or args.mode in PRI_MODES:
                tiers: list[Any] = [tierstore.HostTier(args.host_budget), tierstore.DiskTier(".", keep_last=2)]
            else:
                tiers = [
                    tierstore.HostTier(args.host_budget),
                    tierstore.DiskTier(str(fast), keep_last=2),
                    tierstore.RemoteTier(str(d), keep_last=2),  # the disk: the checkpoint directory itself
                ]
            pri = PRI_MODES.get(args.mode, args.priority)
            kw: dict[str, Any] = {} if pri is None else {"priority": pri}
            if args.rate_limit:
                kw["rate_limit"] = args.rate_limit
            ck = tierstore.Checkpointer(d, tiers=tiers, **kw)
            ck.attach(opt)

            def save(i: int) -> None:
                ck.save(i, state())
                if args.mode == "tierstore sync-capture":
                    ck.wait_capture()

        # Warm-up: one step and one save, finished.
        step(0)
        if save is not None:
            t_save[0] = time.perf_counter()
            save(0)
            if ck is not None:
                ck.wait()
            if args.mode == "dcp.async_save":
                uploads[-1].result()
        step(0)
        if ck is not None:
            ck.wait()
        base_handles = len(ck.handles()) if ck is not None else 0
        done_at.clear()
        t_save.clear()
        rss = _RssSampler()
        cpu0 = _thread_cpu()
        pcpu0 = _process_cpu()
        perf = None
        if args.perf_file and args.mode == "tierstore":
            perf = subprocess.Popen(
                ["perf", "record", "-F", "499", "-g", "-q", "-o", args.perf_file, "-p", str(os.getpid())],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        blocked: dict[int, float] = {}
        step_times: list[float] = []
        steal0 = _steal()
        t_all = time.perf_counter()
        for i in range(1, args.steps + 1):
            t0 = time.perf_counter()
            step(i)
            if save is not None and i % args.every == 0 and i <= args.steps - args.every:
                ts = time.perf_counter()
                t_save[i] = ts
                save(i)
                blocked[i] = time.perf_counter() - ts
            step_times.append(time.perf_counter() - t0)
        loop = time.perf_counter() - t_all
        steal1 = _steal()
        cpu1 = _thread_cpu()
        pcpu = _process_cpu() - pcpu0
        if perf is not None:
            perf.send_signal(2)
            perf.wait()
        mem = rss.stop()
        paired = _paired_blocks(args, step, save, ck, uploads if args.mode == "dcp.async_save" else [])
        # Durable everywhere (outside the clock).
        if args.mode == "dcp.async_save":
            for u in uploads:
                u.result()
        to_remote: dict[int, float] = {}
        if ck is not None:
            ck.wait()
            for h in ck.handles()[base_handles:]:
                if h.step not in t_save:  # the paired blocks' saves
                    continue
                # The Checkpointer's own timings are taken when each tier's copy becomes durable.
                done_at[h.step] = t_save[h.step] + h.timings.get("to_local", float("nan"))
                if "to_remote" in h.timings:
                    to_remote[h.step] = h.timings["to_remote"]
                blocked[h.step] = h.timings.get("blocked", blocked.get(h.step, 0.0))
            stats = ck.stats()
            ck.close()
            mem["host_tier_peak_mib"] = stats["host_peak"] / 2**20
        for i in sorted(blocked):
            per.append(
                {
                    "step": i,
                    "blocked": blocked[i],
                    "to_local": done_at.get(i, float("nan")) - t_save[i],
                    **({"to_remote": to_remote[i]} if i in to_remote else {}),
                }
            )
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    return {
        "workload": args.workload,
        "mode": args.mode,
        "round": args.round,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "loop_s": loop,
        "step_median_s": statistics.median(step_times),
        "checkpoints": len(per),
        "per_checkpoint": per,
        "cpu_s": _cpu_by_group(cpu0, cpu1, pcpu),
        "paired": paired,
        "process_cpu_s": pcpu,
        "steal_s": steal1[0] - steal0[0],
        **mem,
    }


# ---------------------------------------------------------------------------------------------
# the driver


def _run_child(args: argparse.Namespace, workload: str, mode: str, rnd: int, root: Path, perf: str | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--workload",
        workload,
        "--mode",
        mode,
        "--round",
        str(rnd),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--threads",
        str(args.threads),
        "--paired",
        str(args.paired),
        "--host-budget",
        args.host_budget,
        "--dir",
        str(root),
        "--fast-dir",
        args.fast_dir,
        *(["--priority", args.priority] if args.priority else []),
        *(["--rate-limit", args.rate_limit] if args.rate_limit else []),
    ]
    if perf:
        cmd += ["--perf-file", perf]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _spread(xs: list[float]) -> str:
    return f"{min(xs):+.3f}..{max(xs):+.3f}" if len(xs) > 1 else ""


def summarize(results: list[dict[str, Any]], modes: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    lines: list[str] = []
    summary: list[dict[str, Any]] = []
    for w in sorted({r["workload"] for r in results}, key=lambda s: s != "gpt"):
        rs = [r for r in results if r["workload"] == w]
        none = {r["round"]: r["loop_s"] for r in rs if r["mode"] == "none"}
        params = rs[0]["params_m"]
        n_ck = max(r["checkpoints"] for r in rs)
        lines.append("")
        lines.append(
            f"{w}: {params:.1f} M parameters, AdamW; {len(none)} rounds, interleaved; "
            f"{n_ck} checkpoints in each timed loop"
        )
        lines.append(
            f"{'mode':18} {'loop s':>8} {'overhead':>9} {'lost/ckpt s':>12} {'spread':>15} "
            f"{'blocked/ckpt':>13} {'durable s':>10} {'RSS+ MiB':>9} {'paired':>8} {'paired lost s':>14} "
            f"{'paired IQR':>16}"
        )
        for m in modes:
            mr = [r for r in rs if r["mode"] == m]
            if not mr:
                continue
            loops = [r["loop_s"] for r in mr]
            rel = [(r["loop_s"] - none[r["round"]]) / none[r["round"]] for r in mr if r["round"] in none]
            lost = [
                (r["loop_s"] - none[r["round"]]) / r["checkpoints"]
                for r in mr
                if r["round"] in none and r["checkpoints"]
            ]
            pcs = [p for r in mr for p in r["per_checkpoint"]]
            blocked = statistics.median(p["blocked"] for p in pcs) if pcs else 0.0
            durable = statistics.median(p["to_local"] for p in pcs) if pcs else float("nan")
            rss = statistics.median(r["rss_peak_above_base_mib"] for r in mr)
            row = {
                "workload": w,
                "mode": m,
                "loop_s_median": statistics.median(loops),
                "overhead_median": statistics.median(rel) if rel else 0.0,
                "overhead_per_round": rel,
                "lost_per_checkpoint_s_median": statistics.median(lost) if lost else 0.0,
                "lost_per_checkpoint_s": lost,
                "blocked_per_checkpoint_s": blocked,
                "durable_s": durable,
                "rss_peak_above_base_mib": rss,
                "cpu_s": mr[0]["cpu_s"],
            }
            pl = [x for r in mr for x in r.get("paired", {}).get("lost_s", [])]
            pb = [x for r in mr for x in r.get("paired", {}).get("block_s", [])]
            if pl:
                q = statistics.quantiles(pl, n=4) if len(pl) > 1 else [pl[0], pl[0], pl[0]]
                row["paired_lost_s_median"] = statistics.median(pl)
                row["paired_lost_s_iqr"] = [q[0], q[2]]
                row["paired_overhead_median"] = statistics.median(pl) / statistics.median(pb)
                row["paired_spilled"] = sum(r["paired"]["spilled"] for r in mr)
                row["paired_pairs"] = len(pl)
            if any("to_remote" in p for p in pcs):
                row["durable_remote_s"] = statistics.median(p["to_remote"] for p in pcs if "to_remote" in p)
            summary.append(row)
            lines.append(
                f"{m:18} {row['loop_s_median']:8.2f} {row['overhead_median'] * 100:+8.1f}% "
                f"{row['lost_per_checkpoint_s_median']:12.3f} {_spread(lost):>15} {blocked:13.3f} "
                f"{durable:10.3f} {rss:9.0f}"
                + (
                    f" {row['paired_overhead_median'] * 100:+7.1f}% {row['paired_lost_s_median']:14.3f} "
                    f"{row['paired_lost_s_iqr'][0]:+.3f}..{row['paired_lost_s_iqr'][1]:+.3f}"
                    + (f" ({row['paired_spilled']} spilled)" if row["paired_spilled"] else "")
                    if "paired_lost_s_median" in row
                    else ""
                )
            )
    return summary, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gpt,mlp")
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--paired",
        type=int,
        default=6,
        help="also measure each mode in N pairs of adjacent blocks in its own process (0: off)",
    )
    ap.add_argument("--host-budget", default="2GiB")
    ap.add_argument("--dir", default=None, help="directory on the local disk (default: a temporary one under .)")
    ap.add_argument("--fast-dir", default="/dev/shm", help="a RAM file system for the 2-tier run")
    ap.add_argument(
        "--perf", action="store_true", help="also profile the tierstore mode with perf (one more run, not counted)"
    )
    ap.add_argument(
        "--priority", default=None, help="the background priority of the tierstore and 2-tier modes (default: its own)"
    )
    ap.add_argument(
        "--rate-limit", default=None, help="the tierstore modes' rate_limit (bytes/s of background I/O; default none)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="write the table here too")
    # child-only
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="gpt", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--perf-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    modes = args.modes.split(",")
    root = Path(tempfile.mkdtemp(prefix="ts-ckbench-", dir=args.dir or "."))
    results: list[dict[str, Any]] = []
    perf_file = None
    try:
        for w in args.workloads.split(","):
            for rnd in range(args.rounds):
                order = modes if rnd % 2 == 0 else modes[::-1]
                for m in order:
                    r = _run_child(args, w, m, rnd, root, None)
                    results.append(r)
                    pcs = r["per_checkpoint"]
                    print(
                        f"{w} round {rnd} {m:18} loop {r['loop_s']:7.2f} s  "
                        f"blocked {statistics.median(p['blocked'] for p in pcs) if pcs else 0:.3f} s/ckpt  "
                        f"steal {r.get('steal_s', 0.0):.2f} s",
                        flush=True,
                    )
        if args.perf:
            # The profile is a run of its own, outside the figures (perf slows
            # the process it records).
            perf_file = str(root / "perf.data")
            _run_child(args, args.workloads.split(",")[0], "tierstore", args.rounds, root, perf_file)
        summary, lines = summarize(results, modes)
        lines.append("")
        for row in summary:
            if row["mode"] == "tierstore":
                ok = row["overhead_median"] <= 0.03
                lines.append(
                    f"{'MET    ' if ok else 'NOT met'} {row['workload']}, tierstore: loop-time overhead "
                    f"{row['overhead_median'] * 100:+.1f}% checkpointing every {args.every} steps (target <= +3%)"
                )
                if "paired_overhead_median" in row:
                    ok = row["paired_overhead_median"] <= 0.03
                    lines.append(
                        f"{'MET    ' if ok else 'NOT met'} {row['workload']}, tierstore: paired in-process overhead "
                        f"{row['paired_overhead_median'] * 100:+.1f}% per block of {args.every} steps (target <= +3%)"
                    )
        lines.append("")
        lines.append("CPU seconds per thread group in the timed loop (first round of each mode):")
        for row in summary:
            if row["mode"] == "none" or row["mode"].startswith("tierstore"):
                top = ", ".join(f"{k} {v:.2f}" for k, v in list(row["cpu_s"].items())[:6])
                lines.append(f"  {row['workload']:4} {row['mode']:18} {top}")
        if perf_file and Path(perf_file).exists():
            lines.append("")
            lines.append("perf: heaviest symbols outside the training thread (tierstore mode, first workload):")
            rep = subprocess.run(
                ["perf", "report", "-i", perf_file, "--stdio", "--no-children", "--sort", "comm,sym", "-g", "none"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            ).stdout
            kept = [ln.strip() for ln in rep.splitlines() if ln.strip() and not ln.startswith("#") and "%" in ln]
            ours = [ln for ln in kept if ln.split()[1] != "python"]
            lines.append("  tierstore's own threads (capture, flush, engine workers, I/O):")
            lines.extend("    " + ln for ln in ours[:15])
            lines.append("  every thread (training included: the step pays page faults and copies on its own thread):")
            lines.extend("    " + ln for ln in kept[:15])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text.lstrip() + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
