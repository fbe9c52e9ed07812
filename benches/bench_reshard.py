"""Resharding benchmark: tierstore against PyTorch DCP (and an offline
UCP-style path) on the same tensors, in one run.

A model-shaped checkpoint (fp32 transformer weights, ~1.2 GiB by default) is
saved by ``--ranks`` processes (gloo on loopback) as DTensors sharded
``Shard(0)`` on a 1-D mesh, then loaded by the same number of processes on a
2-D mesh with ``(Shard(1), Shard(0))`` (FSDP + TP) and on a column-parallel
``Shard(1)`` layout. For each system it reports, per rank, the bytes read
over the bytes the rank needs, measured the same way for every system: what
the rank's process read from the device (``read_bytes`` of its own
/proc/self/io before and after its load, page cache dropped before each
load; readahead and O_DIRECT counted alike), next to tierstore's planner's
count of the bytes it asked for and ``rchar``; and load time, save time and
planning time. tierstore runs in each verification mode (``verify="touched"``,
the default; ``"full"``; ``"shared"``, the chunks a rank reads in part proven
with the other ranks' pieces; ``False``), interleaved with DCP over
``--repeats`` rounds, with bytes read also over the bytes
needed rounded out to the 4 KiB blocks O_DIRECT reads anyway. The UCP-style
path consolidates the checkpoint offline into one file per tensor, then every
rank loads whole tensors and slices them.

The target layouts are loaded in the same rounds: per round and system, one
after another in alternating order, so that each resharding load is
compared with the plain load (the saved layout loaded again) of its own
round, seconds apart; the ratio reported is the median of those per-round
ratios of the slowest rank's times.

Also: planning time for 10,000 tensors x 64 ranks, from metadata alone.

    python benches/bench_reshard.py [--ranks 4] [--layers 16] [--hidden 1280] [--out bench-results]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def proc_io() -> dict[str, int]:
    """/proc/self/io of this rank's process (all its threads): ``read_bytes``
    (bytes its reads brought from the block device, readahead and O_DIRECT
    included), ``rchar`` (bytes asked of read(2)-style calls)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def shapes(layers: int, hidden: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        out[f"layers.{i}.attn.qkv.weight"] = (3 * hidden, hidden)
        out[f"layers.{i}.attn.o.weight"] = (hidden, hidden)
        out[f"layers.{i}.mlp.fc1.weight"] = (4 * hidden, hidden)
        out[f"layers.{i}.mlp.fc2.weight"] = (hidden, 4 * hidden)
    return out


def _worker(rank: int, world: int, store: str, job: dict[str, Any], q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        q.put((rank, _run(rank, world, job)))
    finally:
        dist.destroy_process_group()


def _mesh_and_placements(kind: str, world: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    if kind == "fsdp":
        return init_device_mesh("cpu", (world,)), [Shard(0)]
    if kind == "fsdp_tp":
        a = int(math.sqrt(world))
        return init_device_mesh("cpu", (world // a, a)), [Shard(1), Shard(0)]
    if kind == "tp_col":
        return init_device_mesh("cpu", (world,)), [Shard(1)]
    raise ValueError(kind)


def _local_dtensors(shp: dict[str, tuple[int, int]], kind: str, world: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, pl = _mesh_and_placements(kind, world)
    out = {}
    for name, s in shp.items():
        lshape, off = compute_local_shape_and_global_offset(s, mesh, pl)
        if fill:
            # Values that identify their global position: row * 1e-3 + column.
            rows = torch.arange(off[0], off[0] + lshape[0], dtype=torch.float32)[:, None]
            cols = torch.arange(off[1], off[1] + lshape[1], dtype=torch.float32)[None, :]
            local = rows * 1e-3 + cols
        else:
            local = torch.zeros(lshape)
        out[name] = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(s), stride=(s[1], 1))
    return out


def _check(sd: dict[str, Any], shp: dict[str, tuple[int, int]]) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, dt in sd.items():
        lshape, off = compute_local_shape_and_global_offset(shp[name], dt.device_mesh, dt.placements)
        rows = torch.arange(off[0], off[0] + lshape[0], dtype=torch.float32)[:, None]
        cols = torch.arange(off[1], off[1] + lshape[1], dtype=torch.float32)[None, :]
        if not torch.equal(dt.to_local(), rows * 1e-3 + cols):
            raise AssertionError(f"{name}: wrong values after load")


class _TimedPlanner:
    """Accumulates the time DCP's planner spends (class attribute, one per process)."""

    seconds: float = 0.0


def _run(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import tierstore

    shp = job["shapes"]
    res: dict[str, Any] = {}
    if job["op"] == "save":
        sd = _local_dtensors(shp, job["src"], world, True)
        for system in ("tierstore", "dcp"):
            path = job[system]
            dist.barrier()
            t0 = time.perf_counter()
            if system == "tierstore":
                tierstore.save_sharded(sd, path)
            else:
                dist_cp.save(sd, checkpoint_id=path)
                # DCP does not fsync; make it durable like tierstore's save.
                os.sync()
            dist.barrier()
            res[f"{system}_save_s"] = time.perf_counter() - t0
        return res

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            t = time.perf_counter()
            p = super().create_local_plan()
            _TimedPlanner.seconds += time.perf_counter() - t
            return p

        def create_global_plan(self, plans: Any) -> Any:
            t = time.perf_counter()
            p = super().create_global_plan(plans)
            _TimedPlanner.seconds += time.perf_counter() - t
            return p

    # Every target layout is loaded in the same rounds: per round and system
    # the layouts come one after another (alternating order), so that the
    # resharding loads and the plain load they are compared with run seconds
    # apart, not minutes (the VM's speed drifts by 10-40% between minutes).
    dsts: list[str] = job["dsts"]
    out: dict[str, dict[str, Any]] = {d: {} for d in dsts}
    for d in dsts:
        out[d]["needed"] = sum(dt.to_local().numel() * 4 for dt in _local_dtensors(shp, d, world, False).values())
        # One untimed load first: the first load of a process also sets up
        # the engine (threads, buffers, the extension's first calls), which
        # would be charged to whichever system comes first in round 0.
        tierstore.load_sharded(job["tierstore"], _local_dtensors(shp, d, world, False), verify=False)
    order: list[tuple[str, str]] = []
    for rep in range(job["repeats"]):
        systems = LOAD_SYSTEMS if rep % 2 == 0 else LOAD_SYSTEMS[::-1]
        for k, system in enumerate(systems):
            order += [(d, system) for d in (dsts if (rep + k) % 2 == 0 else dsts[::-1])]
    order += [(d, "ucp") for d in dsts]
    for dst, system in order:
        res = out[dst]
        sd = _local_dtensors(shp, dst, world, False)
        if rank == 0:
            drop_caches()
        dist.barrier()
        io0 = proc_io()
        t0 = time.perf_counter()
        if system in TS_MODES:
            stats: dict[str, Any] = {}
            tierstore.load_sharded(job["tierstore"], sd, stats=stats, verify=TS_VERIFY[system])
            res[f"{system}_planned"] = stats["bytes_read"]
            res[f"{system}_verified"] = stats["bytes_verified"]
            res["needed_blocks"] = stats["bytes_needed_blocks"]
            res[f"{system}_plan_s"] = stats["plan_seconds"]
        elif system == "dcp":
            _TimedPlanner.seconds = 0.0
            dist_cp.load(sd, checkpoint_id=job["dcp"], planner=Planner())
            res["dcp_plan_s"] = _TimedPlanner.seconds
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            ucp_bytes = 0
            for name, dt in sd.items():
                f = Path(job["ucp"]) / f"{name}.pt"
                ucp_bytes += f.stat().st_size  # whole tensors: every rank reads them entirely
                full = tierstore.load(f)
                lshape, off = compute_local_shape_and_global_offset(shp[name], dt.device_mesh, dt.placements)
                dt.to_local().copy_(full[off[0] : off[0] + lshape[0], off[1] : off[1] + lshape[1]])
            res["ucp_planned"] = ucp_bytes
        io1 = proc_io()  # this rank's own reads, before waiting for the others
        dist.barrier()
        res.setdefault(f"{system}_load_runs", []).append(time.perf_counter() - t0)
        res[f"{system}_load_s"] = statistics.median(res[f"{system}_load_runs"])
        res.setdefault(f"{system}_read_bytes_runs", []).append(io1["read_bytes"] - io0["read_bytes"])
        res.setdefault(f"{system}_rchar_runs", []).append(io1["rchar"] - io0["rchar"])
        _check(sd, shp)
    return out


# tierstore's verification modes: every chunk a read touches (the default),
# every chunk of every record read from, every chunk touched with those read
# in part proven across the ranks, none.
TS_MODES = ["tierstore", "tierstore-full", "tierstore-shared", "tierstore-noverify"]
TS_VERIFY: dict[str, Any] = {
    "tierstore": "touched",
    "tierstore-full": "full",
    "tierstore-shared": "shared",
    "tierstore-noverify": False,
}
LOAD_SYSTEMS = [*TS_MODES, "dcp"]


def run_ranks(world: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as td:
        procs = [ctx.Process(target=_worker, args=(r, world, f"{td}/store", job, q)) for r in range(world)]
        for p in procs:
            p.start()
        out = dict(q.get(timeout=3600) for _ in range(world))
        for p in procs:
            p.join()
    return [out[r] for r in range(world)]


def planning_simulation(n_tensors: int = 10_000, ranks: int = 64) -> tuple[float, float]:
    """Plans one rank's load of a 2-D (8x8) sharded target from a checkpoint
    whose every tensor was saved as Shard(0) over ``ranks`` ranks, from
    metadata alone (no file is read)."""
    from tierstore._sharded_read import Target, expand_plan, make_plan
    from tierstore.layout import Box, Layout, Piece
    from tierstore.reshard import GlobalIndex, Source, prove_tiling_arrays

    class Fake:
        def __init__(self) -> None:
            self.index: dict[str, GlobalIndex] = {}

        def lookup(self, name: str) -> GlobalIndex | None:
            return self.index.get(name)

        def check_tensor(self, name: str) -> None:  # as Checkpoint does: the saved pieces tile the tensor
            idx = self.index[name]
            prove_tiling_arrays(name, idx.shape, idx.lo, idx.hi, "simulation")

    ck = Fake()
    shape = (1024, 512)
    per = shape[0] // ranks
    targets = []
    a = int(math.sqrt(ranks))
    for i in range(n_tensors):
        name = f"t{i}"
        sources = [
            Source(file=r, offset=0, local_shape=(per, shape[1]), itemsize=4,
                   piece=Piece(name, Box((r * per, 0), (per, shape[1])), Box((0, 0), (per, shape[1]))))
            for r in range(ranks)
        ]  # fmt: skip
        ck.index[name] = GlobalIndex.build(shape, sources)
        rows, cols = shape[0] // a, shape[1] // a
        lay = Layout.block(name, shape, (3 * rows, 5 * cols), (rows, cols))
        targets.append(Target(name, torch.empty(0), torch.empty(0), lay))
    t0 = time.perf_counter()
    plan = make_plan(ck, targets)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    expand_plan(plan, targets)
    return t1 - t0, time.perf_counter() - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each tierstore verification mode and DCP")
    ap.add_argument("--dir", type=Path, default=Path("bench-results/reshard-tmp"))
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    shp = shapes(args.layers, args.hidden)
    total = sum(math.prod(s) * 4 for s in shp.values())
    print(f"checkpoint: {len(shp)} tensors, {total / 2**30:.2f} GiB fp32, {args.ranks} ranks", flush=True)
    job = {
        "shapes": shp,
        "tierstore": str(args.dir / "ts"),
        "dcp": str(args.dir / "dcp"),
        "ucp": str(args.dir / "ucp"),
    }
    saves = run_ranks(args.ranks, {**job, "op": "save", "src": "fsdp"})
    # Offline UCP-style conversion: consolidate, one file per tensor.
    import tierstore
    from tierstore.sharded import consolidate

    t0 = time.perf_counter()
    full = consolidate(job["tierstore"])
    Path(job["ucp"]).mkdir()
    for name, t in full.items():
        tierstore.save(t, Path(job["ucp"]) / f"{name}.pt")
    ucp_convert_s = time.perf_counter() - t0
    del full
    rows = []
    save_s = {s: max(r[f"{s}_save_s"] for r in saves) for s in ("tierstore", "dcp")}
    result: dict[str, Any] = {"ranks": args.ranks, "bytes": total, "ucp_convert_s": ucp_convert_s, "save_s": save_s}
    dsts = ["fsdp", "fsdp_tp", "tp_col"]
    loads_all = run_ranks(args.ranks, {**job, "op": "load", "dsts": dsts, "repeats": args.repeats})
    for dst in dsts:
        loads = [r[dst] for r in loads_all]
        for system in (*TS_MODES, "dcp", "ucp"):
            ts = system in TS_MODES
            # Per rank: the median over rounds of what its process read from
            # the device; the slowest (most-reading) rank and the job's total.
            dev = [statistics.median(r[f"{system}_read_bytes_runs"]) for r in loads]
            rchar = [statistics.median(r[f"{system}_rchar_runs"]) for r in loads]
            needed = [r["needed"] for r in loads]
            rows.append({
                "transition": f"Shard(0) x{args.ranks} -> {dst}",
                "system": system,
                "load_s": max(r[f"{system}_load_s"] for r in loads),
                "load_runs_s": [max(x) for x in zip(*(r[f"{system}_load_runs"] for r in loads), strict=True)],
                "device_read_over_needed": max(d / n for d, n in zip(dev, needed, strict=True)),
                "device_read_over_needed_job": sum(dev) / sum(needed),
                "device_read_over_blocks": max(d / r["needed_blocks"] for d, r in zip(dev, loads, strict=True))
                if ts else None,
                "device_read_bytes_per_rank": dev,
                "device_read_bytes_runs": [r[f"{system}_read_bytes_runs"] for r in loads],
                "planned_over_needed": max(r[f"{system}_planned"] / r["needed"] for r in loads)
                if system != "dcp" else None,
                "planned_over_blocks": max(r[f"{system}_planned"] / r["needed_blocks"] for r in loads) if ts else None,
                "rchar_over_needed": max(c / n for c, n in zip(rchar, needed, strict=True)),
                "verified_bytes": sum(r[f"{system}_verified"] for r in loads) if ts else None,
                "plan_s": max(r.get(f"{system}_plan_s", float("nan")) for r in loads),
            })  # fmt: skip
    result["loads"] = rows
    plan_s, expand_s = planning_simulation()
    result["planning_10k_tensors_64_ranks_s"] = plan_s
    result["expanding_10k_tensors_64_ranks_s"] = expand_s
    lines = [
        f"benches/bench_reshard.py --ranks {args.ranks} --repeats {args.repeats} ({datetime.date.today().isoformat()}, "
        f"{os.cpu_count()} cores; page cache dropped before every load)",
        f"checkpoint {total / 2**30:.2f} GiB, {args.ranks} ranks; save (durable): "
        f"tierstore {result['save_s']['tierstore']:.2f} s, DCP {result['save_s']['dcp']:.2f} s; "
        f"UCP-style offline conversion {ucp_convert_s:.2f} s",
        "bytes over the bytes each rank needs: device = read_bytes of the rank's own /proc/self/io around its load "
        "(median of rounds; max over ranks, and the job's total), planner = what tierstore's plan asked for "
        "(UCP: the whole files), rchar = bytes asked of read calls; /4K = over the needed bytes rounded out to "
        "4 KiB blocks",
        f"{'transition':24} {'system':19} {'load s (min-max)':>18} {'device':>7} {'job':>6} {'dev/4K':>7} "
        f"{'planner':>8} {'plan/4K':>8} {'rchar':>7} {'plan s':>7}",
    ]
    by = {(r["transition"], r["system"]): r for r in rows}

    def f3(x: float | None, w: int) -> str:
        return f"{x:{w}.3f}" if x is not None else " " * w

    for r in rows:
        runs = r["load_runs_s"]
        ls = f"{r['load_s']:.2f} ({min(runs):.2f}-{max(runs):.2f})"
        lines.append(
            f"{r['transition']:24} {r['system']:19} {ls:>18} {r['device_read_over_needed']:7.3f} "
            f"{r['device_read_over_needed_job']:6.3f} {f3(r['device_read_over_blocks'], 7)} "
            f"{f3(r['planned_over_needed'], 8)} {f3(r['planned_over_blocks'], 8)} {r['rchar_over_needed']:7.3f} "
            f"{r['plan_s']:7.3f}"
        )
    lines.append("verified load time / unverified (median of rounds, slowest rank):")
    transitions = list(dict.fromkeys(r["transition"] for r in rows))
    for t in transitions:
        raw = by[(t, "tierstore-noverify")]["load_s"]
        touched, full = by[(t, "tierstore")]["load_s"] / raw, by[(t, "tierstore-full")]["load_s"] / raw
        shared = by[(t, "tierstore-shared")]["load_s"] / raw
        lines.append(f"  {t:28} touched {touched:.3f}x, full {full:.3f}x, shared {shared:.3f}x")
    # The plain load: the saved layout loaded again (every rank reads its own file whole).
    plain = transitions[0]
    lines.append(
        f"resharding load time / the plain load ({plain}) in the same mode and round, slowest rank "
        "(median of rounds, range; target: at most 1.2x):"
    )
    for t in transitions[1:]:
        per_round = {
            s: [a / b for a, b in zip(by[(t, s)]["load_runs_s"], by[(plain, s)]["load_runs_s"], strict=True)]
            for s in TS_MODES
        }
        ratios = {s: statistics.median(x) for s, x in per_round.items()}
        result.setdefault("reshard_over_plain", {})[t] = ratios
        result.setdefault("reshard_over_plain_rounds", {})[t] = per_round
        each = ", ".join(
            f"{s.removeprefix('tierstore-')} {ratios[s]:.3f}x ({min(x):.2f}-{max(x):.2f})" for s, x in per_round.items()
        )
        lines.append(f"  {t:28} {each}")
    lines.append(
        f"planning, 10,000 tensors x 64 ranks (metadata only): {result['planning_10k_tensors_64_ranks_s']:.3f} s"
    )
    text = "\n".join(lines)
    print(text)
    (args.out / "reshard.json").write_text(json.dumps(result, indent=2))
    (args.out / "reshard.txt").write_text(text + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
