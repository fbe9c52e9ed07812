#!/usr/bin/env python
"""An adversarial fuzz campaign over every tierstore load path.

Builds checkpoints of four kinds (single files, sharded checkpoints, PyTorch
DCP directories, Checkpointer run directories), damages or crafts them the
way a failing disk or an attacker would, loads them through every path and
classifies what happened (see README.md in this directory)::

    .venv/bin/python tests/fuzz/campaign.py --cases 10000 --seed 1 \\
        [--kinds single,sharded,dcp,checkpointer] [--workers 2] [--json out.json]
    .venv/bin/python tests/fuzz/campaign.py --replay sharded:1000042

Cases run in long-lived worker processes (torch is imported once per
worker) under an address-space limit; this process hands them out one at a
time, enforces a wall-clock limit per case and replaces a worker that hangs
or dies. The exit status is non-zero when any bad class occurred or
other_error exceeds 1% of the cases.

This module imports nothing but the standard library: the workers and
``--replay`` import ``fuzz_cases`` (torch, tierstore).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ["single", "sharded", "dcp", "checkpointer"]
CLASSES = [
    "equal",
    "error_clean",
    "accepted",
    "silent_difference",
    "cli_ok_on_damage",
    "crash",
    "hang",
    "memory_limit",
    "code_executed",
    "read_outside",
    "other_error",
    "collector_left_off",
    "reads_left_running",
    "control_failed",
    "harness_error",
]
SHORT = {
    "equal": "equal",
    "error_clean": "clean",
    "accepted": "accept",
    "silent_difference": "SILENT",
    "cli_ok_on_damage": "CLI_OK",
    "crash": "CRASH",
    "hang": "HANG",
    "memory_limit": "MEM",
    "code_executed": "CODE",
    "read_outside": "OUTSIDE",
    "other_error": "other",
    "collector_left_off": "GC_OFF",
    "reads_left_running": "READS",
    "control_failed": "CONTROL",
    "harness_error": "HARNESS",
}
# Every class but these four fails a campaign (other_error: up to OTHER_BUDGET of the cases).
BAD = set(CLASSES) - {"equal", "error_clean", "accepted", "other_error"}
OTHER_BUDGET = 0.01
SEED_STRIDE = 1_000_000


def case_list(cases: int, seed: int, kinds: list[str]) -> list[tuple[str, int]]:
    """The cases of a campaign: kinds in turn, seeds ``seed * 1e6 + i``."""
    return [(kinds[i % len(kinds)], seed * SEED_STRIDE + i) for i in range(cases)]


# ----------------------------------------------------------------------------------------------
# the parent: workers, scheduling, time limits


class Worker:
    """A long-lived worker process that runs one case at a time."""

    def __init__(self, wid: int, work: Path, template: Path | None, timeout: float) -> None:
        self.wid = wid
        self.work = work
        self.template = template
        self.timeout = timeout
        self.dir = work / f"w{wid}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "stderr.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "down"
        self.buf = b""
        self.case: tuple[str, int] | None = None
        self.since = 0.0
        self.last: dict[str, Any] = {}
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", PYTHONFAULTHANDLER="1", PYTHONHASHSEED="0")
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "campaign.py"),
                    "--worker",
                    str(self.wid),
                    "--work",
                    str(self.work),
                    "--template",
                    str(self.template or ""),
                    "--case-timeout",
                    str(self.timeout),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=env,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.state = "starting"
        self.since = time.monotonic()
        self.buf = b""

    def send(self, kind: str, seed: int, mutator: str | None) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.case = (kind, seed)
        self.last = {}
        self.state = "busy"
        self.since = time.monotonic()
        self.proc.stdin.write((json.dumps({"kind": kind, "seed": seed, "mutator": mutator}) + "\n").encode())
        self.proc.stdin.flush()

    def pump(self) -> tuple[list[dict[str, Any]], bool]:
        """Messages that arrived, and whether the pipe closed."""
        assert self.proc is not None and self.proc.stdout is not None
        eof = False
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            with contextlib.suppress(ValueError):
                msgs.append(json.loads(line))
        return msgs, eof

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._close()
        self.state = "down"

    def _close(self) -> None:
        assert self.proc is not None
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"{}\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close()
        self.state = "down"

    def log_tail(self, n: int = 3000) -> str:
        try:
            data = self.log.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode("utf-8", "replace")


def make_template(work: Path, log: Callable[[str], None]) -> Path | None:
    """The 2-rank template (made once per campaign, in a process of its own)."""
    out = work / "template-dist2"
    if (
        all((out / sub / "manifest.json").exists() for sub in ("sharded", "sharded_indexed"))
        and (out / "dcp" / ".metadata").exists()
    ):
        return out
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(HERE / "campaign.py"), "--make-template", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if r.returncode != 0:
        log(f"warning: the 2-rank template could not be made; its variants are skipped:\n{r.stderr[-3000:]}")
        return None
    log(f"2-rank template made in {time.monotonic() - t0:.1f} s")
    return out


def _death(w: Worker, kind: str, seed: int, how: str) -> dict[str, Any]:
    tail = w.log_tail()
    cls = how
    if how == "crash" and re.search(
        r"memory allocation of \d+ bytes failed|MemoryError|bad_alloc|Cannot allocate memory", tail
    ):
        cls = "memory_limit"
    rc = w.proc.returncode if w.proc is not None else None
    sig = ""
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            sig = signal.Signals(-rc).name
    return {
        "kind": kind,
        "seed": seed,
        "mutator": w.last.get("mutator", "?"),
        "detail": w.last.get("detail", ""),
        "class": cls,
        "ops": [{"op": w.last.get("op", "?"), "outcome": cls, "exc": f"worker {how} (exit {rc} {sig})".strip()}],
        "why": f"worker {'died' if how == 'crash' else 'timed out'} during {w.last.get('op', 'setup')}"
        + (f" ({sig})" if sig else ""),
        "stack": tail,
    }


def run_campaign(
    cases: int,
    seed: int,
    kinds: list[str] | None = None,
    workers: int = 2,
    workdir: str | os.PathLike[str] | None = None,
    case_timeout: float = 20.0,
    mutator: str | list[str] | None = None,
    log: Callable[[str], None] = print,
    json_path: str | None = None,
) -> dict[str, Any]:
    """Runs a campaign and returns its summary (see :func:`summarize`).
    ``mutator`` forces one mutator for every case (or, a list, one per case
    in turn)."""
    kinds = list(kinds or KINDS)
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown kind {k!r}; choose from {', '.join(KINDS)}")
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="tierstore-fuzz-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    template = make_template(work, log) if any(k in ("sharded", "dcp") for k in kinds) else None
    forced = mutator if isinstance(mutator, list) else [mutator]
    todo = collections.deque((k, s, forced[i % len(forced)]) for i, (k, s) in enumerate(case_list(cases, seed, kinds)))
    pool = [Worker(i, work, template, case_timeout) for i in range(max(1, min(workers, cases or 1)))]
    sel = selectors.DefaultSelector()
    results: list[dict[str, Any]] = []
    restarts = 0

    def up(w: Worker) -> None:
        w.start()
        assert w.proc is not None and w.proc.stdout is not None
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)

    def down(w: Worker) -> None:
        if w.proc is not None and w.proc.stdout is not None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(w.proc.stdout)
        w.kill()

    for w in pool:
        up(w)
    last_report = time.monotonic()
    try:
        while todo or any(w.state == "busy" for w in pool):
            for w in pool:
                if w.state == "idle" and todo:
                    w.send(*todo.popleft())
            now = time.monotonic()
            limits = [
                w.since + (case_timeout if w.state == "busy" else 400) for w in pool if w.state in ("busy", "starting")
            ]
            wait = max(0.02, min(limits) - now) if limits else 0.5
            for key, _ev in sel.select(timeout=min(wait, 5.0)):
                w = key.data
                msgs, eof = w.pump()
                for m in msgs:
                    ev = m.get("ev")
                    if ev == "ready":
                        w.state = "idle"
                    elif ev in ("case", "op"):
                        w.last.update({k: v for k, v in m.items() if k != "ev"})
                    elif ev == "result" and w.case is not None:
                        m.pop("ev")
                        results.append(m)
                        w.case = None
                        w.state = "idle"
                if eof:
                    if w.state == "busy" and w.case is not None:
                        w.proc.wait()  # type: ignore[union-attr]
                        results.append(_death(w, *w.case, "crash"))
                        w.case = None
                    elif w.state == "starting":
                        w.proc.wait()  # type: ignore[union-attr]
                        if w.starts > 3:
                            raise RuntimeError(f"worker {w.wid} fails to start:\n{w.log_tail()}")
                    down(w)
                    restarts += 1
                    up(w)
            now = time.monotonic()
            for w in pool:
                if w.state == "busy" and w.case is not None and now > w.since + case_timeout:
                    time.sleep(0.2)  # let faulthandler's dump land in the log
                    down(w)
                    results.append(_death(w, *w.case, "hang"))
                    w.case = None
                    restarts += 1
                    up(w)
                elif w.state == "starting" and now > w.since + 400:
                    raise RuntimeError(f"worker {w.wid} did not start in 400 s:\n{w.log_tail()}")
            if now - last_report > 15 or (not todo and not any(w.state == "busy" for w in pool)):
                last_report = now
                bad = sum(1 for r in results if r["class"] in BAD)
                log(f"[{len(results)}/{cases}] {now - t0:.0f} s, {bad} bad so far, {restarts} worker restarts")
    finally:
        for w in pool:
            if w.state in ("idle", "busy"):
                w.stop()
            else:
                w.kill()
        sel.close()
    summary = summarize(results, kinds, seed, time.monotonic() - t0, restarts)
    summary["workdir"] = str(work)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1, default=str))
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return summary


# ----------------------------------------------------------------------------------------------
# summary and report


def _norm(msg: str) -> str:
    msg = re.sub(r"/[^\s:'\"]*", "<path>", msg)
    msg = re.sub(r"0x[0-9a-f]+|\b[0-9a-f]{8,}\b|\d+", "N", msg)
    return msg[:140]


def deciding_op(r: dict[str, Any]) -> dict[str, Any]:
    for o in r.get("ops", []):
        if o.get("outcome") == r["class"]:
            return o
    ops = [o for o in r.get("ops", []) if o.get("outcome") not in ("equal", "accepted")]
    return ops[0] if ops else {}


def signature(r: dict[str, Any]) -> str:
    o = deciding_op(r)
    exc = o.get("exc") or re.sub(r"^<root>\S*: ", "", o.get("detail") or "") or r.get("why", "")
    exc_type = exc.split(":", 1)[0] if o.get("exc") else ""
    mut = r["mutator"].removesuffix("+seal")
    return f"[{r['class']}] {r['kind']}/{mut} {o.get('op', '?')}: {exc_type or _norm(exc)[:80]}"


def summarize(
    results: list[dict[str, Any]], kinds: list[str], seed: int, seconds: float, restarts: int
) -> dict[str, Any]:
    table = {k: dict.fromkeys(CLASSES, 0) for k in kinds}
    mutators: dict[str, dict[str, int]] = {}
    for r in results:
        table[r["kind"]][r["class"]] += 1
        mutators.setdefault(f"{r['kind']}/{r['mutator']}", dict.fromkeys(CLASSES, 0))[r["class"]] += 1
    bad = [r for r in results if r["class"] in BAD]
    other = [r for r in results if r["class"] == "other_error"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in bad + other:
        groups.setdefault(signature(r), []).append(r)
    n = len(results)
    return {
        "cases": n,
        "seed": seed,
        "kinds": kinds,
        "seconds": round(seconds, 1),
        "worker_restarts": restarts,
        "table": table,
        "mutators": dict(sorted(mutators.items())),
        "bad": [brief(r) for r in bad],
        "other": [brief(r) for r in other],
        "signatures": {
            s: {"count": len(rs), "replay": [f"{r['kind']}:{r['seed']}" for r in rs[:5]], "example": brief(rs[0])}
            for s, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        },
        "other_fraction": (len(other) / n) if n else 0.0,
        "ok": not bad and len(other) <= OTHER_BUDGET * n,
        "results": results,
    }


def brief(r: dict[str, Any]) -> dict[str, Any]:
    o = deciding_op(r)
    out = {
        "replay": f"{r['kind']}:{r['seed']}",
        "class": r["class"],
        "mutator": r["mutator"],
        "detail": r.get("detail", "")[:300],
        "op": o.get("op"),
        "exception": o.get("exc"),
        "why": r.get("why") or o.get("detail"),
    }
    if o.get("traceback"):
        out["traceback_tail"] = o["traceback"][-1500:]
    if r.get("stack"):
        out["stack_tail"] = r["stack"][-1500:]
    return out


def _grid(rows: list[tuple[str, dict[str, int]]], first: str) -> list[str]:
    cols = [c for c in CLASSES if any(v[c] for _n, v in rows) or c in ("equal", "error_clean")]
    w0 = max([len(first)] + [len(n) for n, _v in rows]) + 1
    head = first.ljust(w0) + "".join(SHORT[c].rjust(8) for c in cols) + "   total"
    out = [head, "-" * len(head)]
    for name, v in rows:
        out.append(
            name.ljust(w0)
            + "".join((str(v[c]) if v[c] else ".").rjust(8) for c in cols)
            + str(sum(v.values())).rjust(8)
        )
    return out


def report(s: dict[str, Any], *, mutators: bool = True, limit: int = 60) -> str:
    lines = [
        f"tierstore fuzz campaign: {s['cases']} cases, seed {s['seed']}, {s['seconds']} s, "
        f"{s['worker_restarts']} worker restarts",
        "",
    ]
    total = dict.fromkeys(CLASSES, 0)
    for v in s["table"].values():
        for c, n in v.items():
            total[c] += n
    lines += _grid([*s["table"].items(), ("all", total)], "kind")
    lines.append("legend: " + ", ".join(f"{SHORT[c]}={c}" for c in CLASSES))
    lines.append("bad classes (upper case): any non-zero fails; other_error may be at most 1% "
                 f"(here {100 * s['other_fraction']:.2f}%)")  # fmt: skip
    if mutators:
        lines += ["", "per mutator:"]
        lines += _grid(list(s["mutators"].items()), "kind/mutator")
    if s["signatures"]:
        lines += ["", f"distinct findings ({len(s['signatures'])} signatures; replay with --replay KIND:SEED):"]
        for sig, g in list(s["signatures"].items())[:limit]:
            ex = g["example"]
            lines.append(f"  {g['count']:>4}x {sig}")
            lines.append(f"        e.g. --replay {ex['replay']}  ({ex['mutator']}: {ex['detail'][:150]})")
            if ex.get("exception"):
                lines.append(f"        {ex['exception'][:300]}")
            elif ex.get("why"):
                lines.append(f"        {str(ex['why'])[:300]}")
    if s["bad"]:
        lines += ["", f"bad cases ({len(s['bad'])}):"]
        for b in s["bad"][:limit]:
            lines.append(
                f"  {b['replay']:<22} {b['class']:<18} {b['mutator']:<28} {b['op'] or '':<18} "
                f"{(b['exception'] or b['why'] or '')[:120]}"
            )
        if len(s["bad"]) > limit:
            lines.append(f"  ... and {len(s['bad']) - limit} more (see --json)")
    lines.append("")
    lines.append("RESULT: " + ("OK" if s["ok"] else "FAILED"))
    return "\n".join(lines)


def failure_message(s: dict[str, Any]) -> str:
    return report(s, mutators=False, limit=40)


# ----------------------------------------------------------------------------------------------
# the worker


def worker_main(wid: int, work: Path, template: str, timeout: float) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of the library and the CLI go to the log, not the protocol
    import faulthandler
    import gc
    import resource

    faulthandler.enable()
    sys.path.insert(0, str(HERE))
    import memlimit
    import torch

    torch.set_num_threads(1)
    import fuzz_cases as fc

    def emit(m: dict[str, Any]) -> None:
        proto.write(json.dumps(m, default=str) + "\n")
        proto.flush()

    env = fc.Env(root=work / f"w{wid}", template=Path(template) if template else None, emit=emit)
    fc.warm_up(env)
    limit = memlimit.limit_address_space()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    emit({"ev": "ready", "address_space_limit": limit})
    for line in sys.stdin:
        req = json.loads(line)
        if not req:
            break
        os.ftruncate(2, 0)
        print(f"=== case {req['kind']}:{req['seed']}", file=sys.stderr, flush=True)
        env.cache["force_mutator"] = req.get("mutator")
        faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=False)
        try:
            v = fc.run_case(env, req["kind"], int(req["seed"]))
        finally:
            faulthandler.cancel_dump_traceback_later()
        gc.collect()
        emit({"ev": "result", **v})


# ----------------------------------------------------------------------------------------------
# replay


def replay(spec: str, work: str | None, mutator: str | None = None) -> int:
    """Runs one case in this process, printing every op with its traceback."""
    kind, _, seed = spec.partition(":")
    if kind not in KINDS or not seed.lstrip("-").isdigit():
        print(f"--replay takes KIND:SEED with KIND one of {', '.join(KINDS)}", file=sys.stderr)
        return 2
    import faulthandler

    faulthandler.enable()
    root = Path(work or tempfile.mkdtemp(prefix="tierstore-replay-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    template = make_template(root, print) if kind in ("sharded", "dcp") else None
    sys.path.insert(0, str(HERE))
    import fuzz_cases as fc

    env = fc.Env(root=root / "replay", template=template, verbose=True)
    env.cache["force_mutator"] = mutator
    print(f"replaying {kind}:{seed} in {env.root}")
    v = fc.run_case(env, kind, int(seed))
    print(f"mutator: {v['mutator']} (oracle {v['oracle']})\ndetail:  {v['detail']}")
    print(f"class:   {v['class']}" + (f"  ({v['why']})" if v.get("why") else ""))
    print(f"files are left in {env.root / 'case'}")
    return 1 if v["class"] in BAD else 0


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", help="write the summary and every case's record here")
    p.add_argument("--work", help="working directory (default: a temporary one, removed at the end)")
    p.add_argument("--case-timeout", type=float, default=20.0, help="wall-clock seconds per case (default 20)")
    p.add_argument("--mutator", help="use only this mutator (by name, e.g. json_overlap_hole)")
    p.add_argument("--replay", metavar="KIND:SEED", help="run one case here, printing tracebacks")
    p.add_argument("--no-mutator-table", action="store_true", help="leave the per-mutator table out of the report")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--template", default="", help=argparse.SUPPRESS)
    p.add_argument("--make-template", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.make_template:
        sys.path.insert(0, str(HERE))
        import fuzz_cases as fc

        fc.make_dist_template(Path(a.make_template))
        return 0
    if a.worker is not None:
        worker_main(a.worker, Path(a.work), a.template, a.case_timeout)
        return 0
    if a.replay:
        return replay(a.replay, a.work, a.mutator)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    s = run_campaign(
        a.cases,
        a.seed,
        kinds,
        a.workers,
        a.work,
        a.case_timeout,
        a.mutator,
        log=lambda m: print(m, flush=True),
        json_path=a.json,
    )
    print(report(s, mutators=not a.no_mutator_table))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
