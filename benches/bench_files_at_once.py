"""A/B: a sharded load reading its data files one after another against
several at once (``tierstore._sharded_read._FILES_AT_ONCE``).

``bench_reshard.py``'s checkpoint (row-sharded over ``--ranks`` processes,
gloo on loopback) is loaded by the same number of processes as row shards
(the plain load: one file per rank) and as column shards (a part of every
file per rank), verified (``"touched"``) and not, with the page cache dropped
before every load. The two settings alternate in fresh rank processes,
``--runs`` times each, so that drift of the machine favours neither; each
run makes ``--repeats`` loads of every kind and reports the median of the
slowest rank's time.

    python benches/bench_files_at_once.py [--runs 3] [--repeats 3] [--ranks 4] [--settings 1,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_reshard as br

KINDS = [("fsdp", "touched"), ("tp_col", "touched"), ("fsdp", False), ("tp_col", False)]


def _run(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import tierstore
    from tierstore import _sharded_read

    shp = job["shapes"]
    if job["op"] == "save":
        tierstore.save_sharded(br._local_dtensors(shp, "fsdp", world, True), job["tierstore"])
        dist.barrier()
        return {}
    _sharded_read._FILES_AT_ONCE = job["files_at_once"]
    # One untimed load: the first load of a process also starts the engine.
    tierstore.load_sharded(job["tierstore"], br._local_dtensors(shp, "tp_col", world, False), verify=False)
    res: dict[str, Any] = {}
    for rep in range(job["repeats"]):
        for kind, verify in KINDS if rep % 2 == 0 else KINDS[::-1]:
            sd = br._local_dtensors(shp, kind, world, False)
            if rank == 0:
                br.drop_caches()
            dist.barrier()
            t0 = time.perf_counter()
            tierstore.load_sharded(job["tierstore"], sd, verify=verify)
            dist.barrier()
            res.setdefault(f"{kind}/{verify}", []).append(time.perf_counter() - t0)
            br._check(sd, shp)
    return res


# bench_reshard's launcher runs bench_reshard._run in every rank process; the
# rank processes are spawned and import this file as their main module, so
# this assignment runs there too.
br._run = _run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="1,4", help="values of _FILES_AT_ONCE, alternated")
    ap.add_argument("--dir", type=Path, default=Path("bench-results/files-at-once-tmp"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    shp = br.shapes(16, 1280)
    job: dict[str, Any] = {"shapes": shp, "tierstore": str(args.dir / "ts"), "op": "save"}
    if not (args.dir / "ts" / "manifest.json").exists():
        br.run_ranks(args.ranks, job)
    settings = [int(x) for x in args.settings.split(",")]
    got: dict[tuple[int, str], list[float]] = {}
    for run in range(args.runs):
        for s in settings if run % 2 == 0 else settings[::-1]:
            out = br.run_ranks(args.ranks, {**job, "op": "load", "repeats": args.repeats, "files_at_once": s})
            for key in out[0]:
                slowest = [max(o[key][i] for o in out) for i in range(args.repeats)]
                got.setdefault((s, key), []).append(statistics.median(slowest))
                print(f"run {run} files at once {s}: {key:16s} {statistics.median(slowest):.3f} s", flush=True)
    when = f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores"
    print(f"\n{' '.join(sys.argv)} ({when}; page cache dropped before every load)")
    print("load s (slowest rank; per run, the median of its loads)")
    for kind, verify in KINDS:
        key = f"{kind}/{verify}"
        cells = [f"{s} at once: " + " ".join(f"{v:.3f}" for v in got[(s, key)]) for s in settings]
        print(f"  {key:16s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
