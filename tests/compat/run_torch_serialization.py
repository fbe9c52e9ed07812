"""Runs PyTorch's own serialization tests (``../shared/compat/
torch_test_serialization.py``, never copied here) on plain torch and with
``torch.save`` / ``torch.load`` routed to tierstore, under torch's default
``weights_only`` and with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (the suite
predates torch 2.6), and compares the outcome of every test.

A test that passes on torch and fails through tierstore is a difference; each
must be listed in ``known_differences.txt`` with its reason, or this exits 1.
Listed tests that no longer differ are reported (the list is stale).

    python tests/compat/run_torch_serialization.py [--suite PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SUITE = ROOT.parent / "shared" / "compat" / "torch_test_serialization.py"
MODES = {"default": {}, "no-weights-only": {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}}


def outcomes(junit: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            out[name] = "failed"
        elif "skipped" in kinds:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def run_one(suite: Path, route: str, mode: str, work: Path, timeout: float) -> dict[str, str]:
    junit = work / f"{route}-{mode}.xml"
    env = {**os.environ, **MODES[mode], "TIERSTORE_COMPAT_ROUTE": route, "PYTHONDONTWRITEBYTECODE": "1"}
    extra = os.environ.get("TIERSTORE_COMPAT_DEPS")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), extra, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tierstore_route",
        f"--junitxml={junit}",
        "--rootdir",
        str(work),
        "-c",
        os.devnull,
        str(suite),
    ]
    r = subprocess.run(cmd, cwd=suite.parent, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if not junit.exists():
        raise SystemExit(
            f"{route}/{mode}: the suite did not run (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return outcomes(junit)


def _counts(res: dict[str, str]) -> str:
    return ", ".join(f"{sum(v == k for v in res.values())} {k}" for k in ("passed", "failed", "skipped"))


def known(path: Path) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, reason = line.partition("|")
        mode, test = head.split()
        if not reason.strip():
            raise SystemExit(f"{path}: {test}: every known difference needs its reason")
        out[(mode, test)] = reason.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", type=Path, default=SUITE)
    ap.add_argument("--known", type=Path, default=HERE / "known_differences.txt")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if not args.suite.exists():
        print(f"{args.suite}: not here", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ts-compat-") as td:
        work = Path(td)
        jobs = [(route, mode) for mode in MODES for route in ("torch", "tierstore")]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futs = {j: ex.submit(run_one, args.suite, j[0], j[1], work, args.timeout) for j in jobs}
            res = {j: f.result() for j, f in futs.items()}
    expected = known(args.known)
    diffs: dict[tuple[str, str], str] = {}
    lines = []
    for mode in MODES:
        base, ours = res[("torch", mode)], res[("tierstore", mode)]
        for test, st in sorted(base.items()):
            if st == "passed" and ours.get(test) != "passed":
                diffs[(mode, test)] = ours.get(test, "missing")
        lines.append(
            f"{mode:16} torch: {_counts(base)}; tierstore: {_counts(ours)}; "
            f"pass on torch, not through tierstore: {sum(1 for k in diffs if k[0] == mode)}"
        )
    new = sorted(k for k in diffs if k not in expected)
    stale = sorted(k for k in expected if k not in diffs)
    for mode, test in sorted(diffs):
        why = expected.get((mode, test), "NOT LISTED")
        lines.append(f"  {mode:16} {test}: {diffs[(mode, test)]} ({why})")
    for mode, test in stale:
        lines.append(f"  stale entry (no longer differs): {mode} {test}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"outcomes": {f"{r}/{m}": v for (r, m), v in res.items()}, "differences": [list(k) for k in diffs]},
                indent=1,
            )
        )
    if new:
        print(f"\n{len(new)} difference(s) not in {args.known.name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
