"""The cost of chunk verification on one resharding read, in one process.

A row-sharded fp32 tensor (300 MiB by default, rows of 5 KiB) is saved as a
sharded checkpoint; one process then loads column shards of it (1/2, 1/4,
1/8 of the columns: the checksum chunks at the edges of every row's slice
are touched in part) and a row
block (chunks read straight into place) with ``verify="touched"``,
``"full"`` and ``False``, interleaved in alternating order over ``--rounds``
rounds, page cache dropped before each load (cold) and then without dropping
(warm). Prints the median load time per mode, the ratio to the unverified
load, and the bytes read over the bytes needed rounded out to 4 KiB blocks.

Unlike ``bench_reshard.py`` (4 ranks on this 2-core machine, which makes
every CPU cycle of verification show), this measures verification as one
rank with its own cores would see it.

    python benches/bench_verify.py [--mib 300] [--rounds 5] [--dir bench-results/verify-tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore.layout import Layout, attach

MODES: list[Any] = ["touched", "full", False]


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("bench-results/verify-tmp"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cols = 1280
    rows = (args.mib << 20) // (cols * 4)
    shape = (rows, cols)
    shutil.rmtree(args.dir, ignore_errors=True)
    torch.manual_seed(0)
    full = torch.randn(*shape)
    tierstore.save_sharded({"w": attach(full, Layout.shard("w", shape, 0, 0, 1))}, args.dir)
    cold_ok = drop_caches()
    targets: dict[str, Any] = {f"columns 1/{k}": (1, k) for k in (2, 4, 8)}
    targets["rows 1/4"] = (0, 4)
    out: list[dict[str, Any]] = []
    for cache in ("cold", "warm"):
        if cache == "cold" and not cold_ok:
            continue
        for name, (dim, k) in targets.items():
            times: dict[str, list[float]] = {str(m): [] for m in MODES}
            stats: dict[str, dict[str, int]] = {}
            for rnd in range(args.rounds):
                for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                    local = (rows, cols // k) if dim == 1 else (rows // k, cols)
                    sd = {"w": attach(torch.empty(local), Layout.shard("w", shape, dim, 1, k))}
                    if cache == "cold":
                        drop_caches()
                    st: dict[str, int] = {}
                    t0 = time.perf_counter()
                    tierstore.load_sharded(args.dir, sd, verify=mode, stats=st)
                    times[str(mode)].append(time.perf_counter() - t0)
                    stats[str(mode)] = st
                    want = full[:, cols // k : 2 * cols // k] if dim == 1 else full[rows // k : 2 * rows // k]
                    if not torch.equal(sd["w"], want):
                        raise AssertionError(f"{name}, verify={mode}: wrong values")
            med = {m: statistics.median(v) for m, v in times.items()}
            row = {
                "cache": cache,
                "target": name,
                "seconds": med,
                "runs": times,
                "touched_over_unverified": med["touched"] / med["False"],
                "full_over_unverified": med["full"] / med["False"],
                "read_over_blocks": stats["touched"]["bytes_read"] / stats["touched"]["bytes_needed_blocks"],
                "read_over_needed": stats["touched"]["bytes_read"] / stats["touched"]["bytes_needed"],
            }
            out.append(row)
            print(
                f"{cache:5} {name:13} unverified {med['False']:6.3f} s  touched {med['touched']:6.3f} s "
                f"({row['touched_over_unverified']:.2f}x)  full {med['full']:6.3f} s "
                f"({row['full_over_unverified']:.2f}x)  "
                f"read/needed {row['read_over_needed']:.2f}, read/4K blocks {row['read_over_blocks']:.3f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "rounds": args.rounds, "rows": out}, indent=2))
    with contextlib.suppress(OSError):
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
