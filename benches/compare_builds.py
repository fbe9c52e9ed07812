"""Single-file save and load speed of this build against another build, in one run.

Runs ``benches/bench_save_load.py --systems tierstore`` (durable saves, cold
loads, the same state dicts, each measurement in a fresh process with a disk
ceiling probe beside it) with two Python environments in alternating rounds,
so that drift of the shared disk favours neither, and compares tierstore's
throughput, raw and as a fraction of the ceiling of its moment:

    python benches/compare_builds.py --baseline /path/to/other/checkout/.venv/bin/python [--rounds 2]

Make the baseline environment from another commit with ``git worktree add
/tmp/base <commit> && make -C /tmp/base setup``. Prints, per state dict and
operation, the median GiB/s of each build over every repetition of every
round, the spread, and the ratio this/baseline (of GiB/s, and of fractions of
the ceiling, which take out the disk's drift between measurements); writes
JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run(python: str, out: Path, reps: int, extra: list[str]) -> list[dict[str, Any]]:
    cmd = [python, str(HERE / "bench_save_load.py"), "--reps", str(reps), "--out", str(out), "--systems", "tierstore"]
    cmd += extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads((out / "save_load.json").read_text())
    rows: list[dict[str, Any]] = data["results"]
    return [r for r in rows if r["system"] == "tierstore"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="python of the other build's environment")
    ap.add_argument("--python", default=sys.executable, help="python of this build (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-results/compare"))
    ap.add_argument("extra", nargs="*", help="arguments passed to bench_save_load.py (after --)")
    args = ap.parse_args()
    builds = {"this": args.python, "baseline": args.baseline}
    secs: dict[tuple[str, str, str], list[float]] = {}
    fracs: dict[tuple[str, str, str], list[float]] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for rnd in range(args.rounds):
        order = ["baseline", "this"] if rnd % 2 == 0 else ["this", "baseline"]
        for label in order:
            print(f"round {rnd + 1}/{args.rounds}: {label} ({builds[label]})", flush=True)
            for r in run(builds[label], args.out / f"{label}-{rnd}", args.reps, args.extra):
                secs.setdefault((r["dataset"], r["op"], label), []).extend(r["seconds"])
                fracs.setdefault((r["dataset"], r["op"], label), []).extend(r.get("fraction_of_ceiling", []))
                nbytes[(r["dataset"], r["op"])] = r["bytes"]
    rows = []
    print(
        f"\n{'state dict':10} {'operation':10} {'baseline GiB/s':>15} {'this GiB/s':>11} {'this/baseline':>14} "
        f"{'x ceiling: baseline':>20} {'this':>17} {'this/baseline':>14}"
    )
    for (ds, op), n in sorted(nbytes.items()):
        b, t = secs[(ds, op, "baseline")], secs[(ds, op, "this")]
        gb = [n / s / 2**30 for s in b]
        gt = [n / s / 2**30 for s in t]
        row = {
            "dataset": ds,
            "op": op,
            "baseline_gibps": statistics.median(gb),
            "this_gibps": statistics.median(gt),
            "baseline_range": [min(gb), max(gb)],
            "this_range": [min(gt), max(gt)],
            "ratio": statistics.median(gt) / statistics.median(gb),
        }
        fb, ft = fracs[(ds, op, "baseline")], fracs[(ds, op, "this")]
        frac = ""
        if fb and ft:
            row["baseline_fraction"], row["this_fraction"] = statistics.median(fb), statistics.median(ft)
            row["baseline_fraction_range"], row["this_fraction_range"] = [min(fb), max(fb)], [min(ft), max(ft)]
            row["fraction_ratio"] = row["this_fraction"] / row["baseline_fraction"]
            frac = (
                f" {row['baseline_fraction']:8.2f} ({min(fb):.2f}-{max(fb):.2f}) "
                f"{row['this_fraction']:5.2f} ({min(ft):.2f}-{max(ft):.2f}) {row['fraction_ratio']:8.3f}"
            )
        rows.append(row)
        print(
            f"{ds:10} {op:10} {row['baseline_gibps']:8.2f} ({min(gb):.2f}-{max(gb):.2f}) "
            f"{row['this_gibps']:5.2f} ({min(gt):.2f}-{max(gt):.2f}) {row['ratio']:8.3f}{frac}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"rounds": args.rounds, "reps": args.reps, "rows": rows}
    (args.out / "compare.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
