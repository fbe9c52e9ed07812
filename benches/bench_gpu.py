"""GPU data path benchmark (run by benches/gpu_check.sh on a machine with a GPU).

Every figure is measured in this run, next to its peer on the same bytes:

* copies: device -> host and host -> device GB/s through tierstore's copier
  (the shim when loaded) into page-locked I/O buffers, against torch's
  pinned copies (``copy_(non_blocking=True)`` into a pinned tensor, and
  ``tensor.to("cpu", non_blocking=True)``) and pageable copies;
* save/load: a GPU state dict of ``--gib`` GiB with ``tierstore.save`` /
  ``tierstore.load(map_location="cuda")`` against ``torch.save`` (+ fsync) /
  ``torch.load(map_location="cuda")``, and the disk's ceilings measured here
  with ``dd`` (O_DIRECT, fsync'ed; reads after dropping the page cache);
* checkpoint: a training loop on the GPU (MLP + AdamW), a checkpoint every
  ``--every`` steps with no checkpoint, synchronous ``torch.save``, DCP
  ``async_save`` and the tierstore Checkpointer, in alternating rounds: loop
  time, step time, blocked time per checkpoint;
* offload: one step of the offload wrapper with bf16 parameters on the GPU,
  against its bound (its bytes at the disk's ceilings, or the update).

    python benches/bench_gpu.py --dir /tmp/bench --gib 4 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore import gpu

GB = 1e9


def log(msg: str) -> None:
    print(msg, flush=True)


def sync() -> None:
    torch.cuda.synchronize()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ copies


def bench_copies(nbytes: int, reps: int) -> dict[str, Any]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": nbytes, "path": gpu.status()["path"]}
    c = gpu.copier("cuda")
    pb = gpu.PinnedBuffer(nbytes)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # touched: page faults are not part of the copy

    def ours(kind: int) -> None:
        if kind == gpu.D2H:
            c.d2h(pb.addr, src.data_ptr(), nbytes)
        else:
            c.h2d(src.data_ptr(), pb.addr, nbytes)
        c.synchronize()

    cases = {
        "d2h tierstore": lambda: ours(gpu.D2H),
        "d2h torch pinned copy_": lambda: pinned.copy_(src, non_blocking=True),
        "d2h torch .to(cpu, non_blocking)": lambda: src.to("cpu", non_blocking=True),
        "d2h pageable": lambda: pageable.copy_(src),
        "h2d tierstore": lambda: ours(gpu.H2D),
        "h2d torch pinned copy_": lambda: src.copy_(pinned, non_blocking=True),
        "h2d pageable": lambda: src.copy_(pageable),
    }
    for name, fn in cases.items():
        ts = [timed(fn) for _ in range(reps + 1)][1:]
        out[name] = {"gbps_best": nbytes / min(ts) / GB, "gbps_median": nbytes / statistics.median(ts) / GB}
        log(f"  {name:34} {out[name]['gbps_best']:7.1f} GB/s best, {out[name]['gbps_median']:7.1f} median")
    # tierstore's bytes are the same bytes
    ours(gpu.D2H)
    assert torch.equal(torch.frombuffer(pb.mem[:nbytes], dtype=torch.uint8)[:4096], src[:4096].cpu())
    return out


# -------------------------------------------------------------- save/load


def dd_ceilings(d: Path, gib: float, streams: int = 4) -> dict[str, Any]:
    """The disk's write and read ceilings with ``dd`` (O_DIRECT, 64 MiB
    requests), ``streams`` at once on disjoint parts of one file (one dd keeps
    a single request in flight, which a fast device does not fill)."""
    f = d / "ceiling.bin"
    count = max(streams, int(gib * 1024 / 64)) // streams  # 64 MiB blocks per stream
    nbytes = count * streams * (64 << 20)
    out: dict[str, Any] = {"bytes": nbytes, "streams": streams}

    def run(args: list[list[str]]) -> float | None:
        t0 = time.perf_counter()
        procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for a in args]
        ok = all(p.wait() == 0 for p in procs)
        return time.perf_counter() - t0 if ok else None

    with open(f, "wb") as fh:
        fh.truncate(nbytes)
    for flags in (["oflag=direct", "conv=fsync,notrunc"], ["conv=fsync,notrunc"]):
        dt = run(
            [
                ["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", f"seek={i * count}", *flags]
                for i in range(streams)
            ]
        )
        if dt is not None:
            out["write_gbps"], out["write_flags"] = nbytes / dt / GB, " ".join(flags)
            break
    out["cold"] = drop_caches()
    for flags in (["iflag=direct"], []):
        dt = run(
            [
                ["dd", f"if={f}", "of=/dev/null", "bs=64M", f"count={count}", f"skip={i * count}", *flags]
                for i in range(streams)
            ]
        )
        if dt is not None:
            out["read_gbps"], out["read_flags"] = nbytes / dt / GB, " ".join(flags)
            break
    f.unlink()
    log(f"  write {out.get('write_gbps', 0):.2f} GB/s, read {out.get('read_gbps', 0):.2f} GB/s ({streams} dd streams)")
    return out


def best_ceilings(d: Path, gib: float) -> dict[str, Any]:
    """The disk's ceilings as the better of one ``dd`` stream and four: a
    device that one stream does not fill, and one that several streams
    slow down, are both measured at their best (the stricter comparison)."""
    runs = {n: dd_ceilings(d, gib, n) for n in (1, 4)}
    out: dict[str, Any] = {"runs": runs, "cold": all(r.get("cold") for r in runs.values())}
    for k in ("write_gbps", "read_gbps"):
        out[k] = max(r.get(k, 0.0) for r in runs.values())
    return out


def gpu_state(gib: float, parts: int = 32) -> dict[str, torch.Tensor]:
    per = int(gib * (1 << 30)) // parts // 2
    g = torch.Generator(device="cuda").manual_seed(1)
    return {
        f"layer{i}.weight": torch.randn(per, device="cuda", generator=g, dtype=torch.bfloat16) for i in range(parts)
    }


def torch_save_fsync(sd: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def bench_save_load(d: Path, gib: float, rounds: int) -> dict[str, Any]:
    sd = gpu_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out: dict[str, Any] = {"bytes": nbytes}
    tierstore.save({"warm": torch.ones(1 << 20, device="cuda")}, d / "warm.pt")  # builds/loads the shim
    tierstore.load(d / "warm.pt", map_location="cuda")
    ts_p, th_p = d / "tierstore.pt", d / "torch.pt"
    # The first save of a state page-locks its staging buffer, which later
    # saves reuse (a training job saves the same state again and again): it
    # is reported on its own; each peer gets an untimed first save too.
    out["tierstore.save first_s"] = timed(lambda: tierstore.save(sd, ts_p))
    log(f"  tierstore.save (first) {nbytes / out['tierstore.save first_s'] / GB:6.2f} GB/s")
    torch_save_fsync(sd, th_p)
    saves: dict[str, list[float]] = {"tierstore.save": [], "torch.save+fsync": []}
    loads: dict[str, list[float]] = {"tierstore.load": [], "torch.load": [], "torch.load mmap": []}
    for r in range(rounds):
        order = list(saves) if r % 2 == 0 else list(reversed(saves))
        for name in order:
            if name == "tierstore.save":
                saves[name].append(timed(lambda: tierstore.save(sd, ts_p)))
            else:
                saves[name].append(timed(lambda: torch_save_fsync(sd, th_p)))
            log(f"  {name:20} {nbytes / saves[name][-1] / GB:6.2f} GB/s")
        lorder = list(loads) if r % 2 == 0 else list(reversed(loads))
        for name in lorder:
            cold = drop_caches()
            if name == "tierstore.load":
                loads[name].append(timed(lambda: tierstore.load(ts_p, map_location="cuda")))
            elif name == "torch.load":
                loads[name].append(timed(lambda: torch.load(th_p, map_location="cuda", weights_only=True)))
            else:
                loads[name].append(timed(lambda: torch.load(th_p, map_location="cuda", weights_only=True, mmap=True)))
            log(f"  {name:20} {nbytes / loads[name][-1] / GB:6.2f} GB/s ({'cold' if cold else 'warm cache'})")
            gc.collect()
    got = tierstore.load(ts_p, map_location="cuda")
    out["bit_exact_tierstore"] = all(torch.equal(got[k], v) for k, v in sd.items())
    got = tierstore.load(th_p, map_location="cuda")
    out["bit_exact_from_torch_file"] = all(torch.equal(got[k], v) for k, v in sd.items())
    del got
    out["cold"] = drop_caches()
    for k, v in {**saves, **loads}.items():
        out[k] = {"s_median": statistics.median(v), "gbps": nbytes / statistics.median(v) / GB, "runs": v}
    ts_p.unlink()
    th_p.unlink()
    return out


# ------------------------------------------------------------- checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_checkpoint(
    d: Path, width: int, layers: int, batch: int, steps: int, every: int, rounds: int
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda")

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync()
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    modes = ["none", "torch.save", "dcp.async_save", "tierstore"]
    res: dict[str, dict[str, list[float]]] = {
        m: {"loop": [], "step": [], "ck_step": [], "blocked": [], "durable": [], "first": [], "later": []}
        for m in modes
    }

    def run(mode: str, rnd: int) -> None:
        base = d / f"ck-{mode.replace('.', '_')}-{rnd}"
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        blocked: list[float] = []
        step_times: list[float] = []
        ckpt = None
        fut = None
        if mode == "tierstore":
            ckpt = tierstore.Checkpointer(
                base, tiers=[tierstore.HostTier(f"{2 * state_bytes}B"), tierstore.DiskTier(str(base / "disk"))]
            )
            ckpt.attach(opt)
        sync()
        t_loop = time.perf_counter()
        for i in range(1, steps + 1):
            t_step = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            if i % every == 0 and mode != "none":
                t0 = time.perf_counter()
                if mode == "torch.save":
                    torch_save_fsync({"model": model.state_dict(), "optim": opt.state_dict()}, base / f"s{i}.pt")
                    blocked.append(time.perf_counter() - t0)
                elif mode == "dcp.async_save":
                    if fut is not None:
                        fut.result()  # one save in flight, as DCP's documentation shows
                    fut = dcp.async_save(
                        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(base / f"s{i}")
                    )
                    blocked.append(time.perf_counter() - t0)
                else:
                    assert ckpt is not None
                    ckpt.save(i, {"model": model.state_dict(), "optim": opt.state_dict()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            step_times.append(time.perf_counter() - t_step)
            if i % every == 0:
                res[mode]["ck_step"].append(step_times[-1])
        loop = time.perf_counter() - t_loop
        t0 = time.perf_counter()
        if fut is not None:
            fut.result()
        if ckpt is not None:
            ckpt.wait()
            blocked = [h.timings.get("blocked", 0.0) for h in ckpt.handles()]
            ckpt.close()
        res[mode]["loop"].append(loop)
        res[mode]["step"].append(statistics.median(step_times))
        res[mode]["blocked"].append(statistics.mean(blocked) if blocked else 0.0)
        res[mode]["first"].append(blocked[0] if blocked else 0.0)
        res[mode]["later"].extend(blocked[1:])
        res[mode]["durable"].append(time.perf_counter() - t0)
        shutil.rmtree(base, ignore_errors=True)
        log(
            f"  round {rnd + 1} {mode:15} loop {loop:6.2f} s, "
            f"median step {statistics.median(step_times) * 1e3:6.1f} ms, "
            f"blocked per checkpoint {res[mode]['blocked'][-1] * 1e3:8.1f} ms"
        )

    for rnd in range(rounds):
        for mode in modes if rnd % 2 == 0 else list(reversed(modes)):
            run(mode, rnd)
            gc.collect()
    n_ck = steps // every
    out: dict[str, Any] = {
        "state_bytes": state_bytes,
        "steps": steps,
        "every": every,
        "checkpoints_per_run": n_ck,
        "width": width,
        "layers": layers,
        "batch": batch,
    }
    none_loop = statistics.median(res["none"]["loop"])
    for m in modes:
        loop = statistics.median(res[m]["loop"])
        out[m] = {
            "loop_s": loop,
            "step_s": statistics.median(res[m]["step"]),
            "ck_step_s": statistics.median(res[m]["ck_step"]),
            "blocked_s": statistics.median(res[m]["blocked"]),
            "first_blocked_s": statistics.median(res[m]["first"]),
            "later_blocked_s": statistics.median(res[m]["later"]) if res[m]["later"] else 0.0,
            "lost_per_checkpoint_s": (loop - none_loop) / n_ck if m != "none" else 0.0,
            "overhead": loop / none_loop - 1,
            "runs": res[m],
        }
    return out


# ---------------------------------------------------------------- offload


def bench_offload(d: Path, params: float, ceilings: dict[str, Any], steps: int, device: str = "cuda") -> dict[str, Any]:
    width = 4096
    layers = max(1, int(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to(device, torch.bfloat16)
    x = torch.randn(256, width, device=device, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    path = d / "offload"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    opt = tierstore.offload(
        torch.optim.AdamW,
        model.parameters(),
        lr=1e-4,
        tiers=[tierstore.HostTier("256MiB"), tierstore.DiskTier(str(path))],
    )

    def one() -> None:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one()  # warm-up: the state is created and spread over the tiers
    times, moved = [], []
    for _ in range(steps):
        r0, w0 = opt.stats["read_bytes"], opt.stats["write_bytes"]
        times.append(timed(one))
        moved.append((opt.stats["read_bytes"] - r0, opt.stats["write_bytes"] - w0))
    stats = dict(opt.stats)
    duplex = [dev.duplex for dev in opt.devices]
    opt.close()
    shutil.rmtree(path, ignore_errors=True)
    # The update alone: torch's AdamW on fp32 CPU copies, in memory.
    cpu_params = [torch.nn.Parameter(torch.randn(p.shape)) for p in model.parameters()]
    for p in cpu_params:
        p.grad = torch.randn(p.shape)
    ref = torch.optim.AdamW(cpu_params, lr=1e-4)
    ref.step()
    t0 = time.perf_counter()
    ref.step()
    compute = time.perf_counter() - t0
    rb = statistics.median(m[0] for m in moved)
    wb = statistics.median(m[1] for m in moved)
    io = max(rb / (ceilings["read_gbps"] * GB), wb / (ceilings["write_gbps"] * GB))
    step = statistics.median(times)
    bound = max(io, compute)
    log(f"  stats after {steps + 1} steps: {stats}; duplex {duplex}")
    log(
        f"  offload step {step:.2f} s ({n / 1e6:.0f} M bf16 params on {device}); read {rb / GB:.2f} GB, "
        f"write {wb / GB:.2f} GB; I/O at the ceilings {io:.2f} s; update {compute:.2f} s; {step / bound:.2f}x bound"
    )
    return {"params": n, "step_s": step, "read_bytes": rb, "write_bytes": wb, "io_s": io, "update_s": compute,
            "bound_s": bound, "x_bound": step / bound, "device": device, "stats": stats, "duplex": duplex,
            "io_serial_s": rb / (ceilings["read_gbps"] * GB) + wb / (ceilings["write_gbps"] * GB)}  # fmt: skip


# ------------------------------------------------------------------ table


def table(r: dict[str, Any]) -> str:
    lines = [f"GPU data path, {r.get('device')}, torch {torch.__version__}, GPU path: {r.get('gpu_path')}"]
    c = r.get("copies")
    if c:
        lines.append(f"\ncopies of {c['bytes'] / 2**30:.1f} GiB (best of the runs)      GB/s   vs best torch pinned")
        for dirn in ("d2h", "h2d"):
            best_torch = max(v["gbps_best"] for k, v in c.items() if k.startswith(dirn + " torch"))
            for k, v in c.items():
                if k.startswith(dirn):
                    lines.append(f"  {k:36} {v['gbps_best']:7.1f}   {v['gbps_best'] / best_torch:5.2f}x")
    s = r.get("save_load")
    if s:
        ceil = r.get("ceilings", {})
        lines.append(
            f"\nsave/load of {s['bytes'] / 2**30:.1f} GiB on the GPU (medians)     GB/s   "
            f"(disk ceilings here: write {ceil.get('write_gbps', 0):.2f}, read {ceil.get('read_gbps', 0):.2f} GB/s, "
            "the better of 1 and 4 dd streams)"
        )
        for k in ("tierstore.save", "torch.save+fsync"):
            lines.append(f"  {k:36} {s[k]['gbps']:7.2f}   {s[k]['gbps'] / ceil.get('write_gbps', 1):5.2f}x ceiling")
        for k in ("tierstore.load", "torch.load", "torch.load mmap"):
            lines.append(
                f"  {k + ' (cuda)':36} {s[k]['gbps']:7.2f}   {s[k]['gbps'] / ceil.get('read_gbps', 1):5.2f}x ceiling"
            )
        lines.append(
            f"  tierstore.save / torch.save {s['tierstore.save']['gbps'] / s['torch.save+fsync']['gbps']:.2f}x; "
            f"tierstore.load / torch.load {s['tierstore.load']['gbps'] / s['torch.load']['gbps']:.2f}x; "
            f"bit-exact {s['bit_exact_tierstore'] and s['bit_exact_from_torch_file']}"
            + ("" if s.get("cold") else "; page cache could not be dropped: loads may be warm")
        )
    k = r.get("checkpoint")
    if k:
        lines.append(
            f"\ntraining loop, {k['layers']}x{k['width']} MLP + AdamW ({k['state_bytes'] / 2**30:.2f} GiB of state), "
            f"a checkpoint every {k['every']} steps, {k['steps']} steps (medians of rounds)"
        )
        lines.append(
            f"  {'mode':16} {'loop s':>7} {'step ms':>8} {'ckpt step ms':>13} {'blocked ms/ckpt':>16} "
            f"{'lost s/ckpt':>12} {'overhead':>9}"
        )
        for m in ("none", "torch.save", "dcp.async_save", "tierstore"):
            v = k[m]
            lines.append(
                f"  {m:16} {v['loop_s']:7.2f} {v['step_s'] * 1e3:8.1f} {v['ck_step_s'] * 1e3:13.1f} "
                f"{v['blocked_s'] * 1e3:16.1f} "
                f"{v['lost_per_checkpoint_s']:12.3f} {v['overhead'] * 100:8.1f}%"
            )
        lines.append(
            "  blocked, first checkpoint of a run / the later ones (median): "
            + "; ".join(
                f"{m} {k[m]['first_blocked_s'] * 1e3:.1f} / {k[m]['later_blocked_s'] * 1e3:.1f} ms"
                for m in ("torch.save", "dcp.async_save", "tierstore")
            )
        )
        ts, sv, dc = k["tierstore"]["blocked_s"], k["torch.save"]["blocked_s"], k["dcp.async_save"]["blocked_s"]
        lines.append(
            f"  tierstore blocked = {ts / sv * 100:.1f}% of torch.save's, {ts / dc * 100:.1f}% of DCP async_save's"
        )
    for key in ("offload", "offload_cpu"):
        o = r.get(key)
        if o:
            lines.append(
                f"\noffload, {o['params'] / 1e6:.0f} M bf16 parameters on {o['device']}: step {o['step_s']:.2f} s, "
                f"bound {o['bound_s']:.2f} s (I/O at both ceilings at once {o['io_s']:.2f} s, one after the other "
                f"{o['io_serial_s']:.2f} s; update {o['update_s']:.2f} s): {o['x_bound']:.2f}x bound"
            )
    for name, err in r.get("errors", {}).items():
        lines.append(f"\n{name}: FAILED: {err.splitlines()[-1] if err else ''}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the disk (default: a temporary one under .)")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--copy-gib", type=float, default=1.0)
    ap.add_argument("--sections", default="copies,save_load,checkpoint,offload,offload_cpu")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--offload-params", type=float, default=200e6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no GPU visible to torch", file=sys.stderr)
        return 2
    d = Path(a.dir or f"./bench-gpu-{os.getpid()}")
    d.mkdir(parents=True, exist_ok=True)
    sections = a.sections.split(",")
    st = gpu.status()
    r: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "gpu_path": st["path"],
        "gpu_status": st,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "errors": {},
    }
    log(f"{r['device']}; GPU path {st['path']} ({st.get('reason')})")
    steps: list[tuple[str, Any]] = [
        ("copies", lambda: bench_copies(int(a.copy_gib * (1 << 30)), 5)),
        ("ceilings", lambda: best_ceilings(d, a.gib)),
        ("save_load", lambda: bench_save_load(d, a.gib, a.rounds)),
        ("checkpoint", lambda: bench_checkpoint(d, a.width, a.layers, a.batch, a.steps, a.every, a.rounds)),
        ("offload", lambda: bench_offload(d, a.offload_params, r["ceilings"], 3)),
        ("offload_cpu", lambda: bench_offload(d, a.offload_params, r["ceilings"], 3, "cpu")),
    ]
    for name, fn in steps:
        if name != "ceilings" and name not in sections:
            continue
        log(f"[{name}]")
        t0 = time.perf_counter()
        faulthandler.dump_traceback_later(150)  # where a section that hangs is stuck
        try:
            r[name] = fn()
        except Exception:
            r["errors"][name] = traceback.format_exc()
            log(r["errors"][name])
        faulthandler.cancel_dump_traceback_later()
        log(f"  ({time.perf_counter() - t0:.0f} s)")
        torch.cuda.empty_cache()
        gc.collect()
    with contextlib.suppress(OSError):
        shutil.rmtree(d) if a.dir is None else None
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2, default=str))
    try:
        text = table(r)
    except Exception:
        text = "the table could not be made:\n" + traceback.format_exc()
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
