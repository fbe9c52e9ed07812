"""Save and load throughput: tierstore against torch.save/torch.load and safetensors.

One run measures, on the same state dicts and the same disk:

- durable saves (each followed by fsync, for every system): ``tierstore.save``,
  ``torch.save``, ``safetensors.torch.save_file``;
- cold loads: ``tierstore.load`` and ``torch.load``, each with and without
  ``mmap=True`` (tierstore's mapped load still checks every CRC, so it reads
  the whole file), ``safetensors.torch.load_file``; before each the file is
  evicted from the page cache (fsync, ``POSIX_FADV_DONTNEED``; every clean
  page is dropped once at the start with ``drop_caches``), checked with
  ``mincore``, and the bytes the load read from the device are counted
  (``/proc/self/io`` ``read_bytes``); every load touches
  every page of every tensor, so lazy loaders pay their I/O.

The shared disk's speed drifts within minutes, so the systems are interleaved:
each repetition runs every save, then every load, once each, in an order that
is reversed every other repetition, and each measurement is bracketed by a
short fio probe of the device (O_DIRECT, io_uring, the block size and queue
depth that were best at the start; a sequential write with fsync before a
save, a cold sequential read before a load). Each figure is reported against
the ceiling of its own moment (the better of the probes just before and just
after it), and as the median with min-max over repetitions. A claim that one
system is faster than another needs their ranges of fractions of the ceiling
not to overlap; otherwise the difference is within the spread.

Every measurement runs in a fresh process (``benches/saveload_child.py``), so
that its memory is its own: current RSS is sampled from ``/proc/self/statm``
during the operation (and the kernel's peak, reset just before, catches what
falls between samples); the table gives the peak above the RSS before the
operation and the RSS once it is over (a load's result still held: N bytes),
and for tierstore the engine's own buffer accounting.

Two state dicts: ``large`` (a few big fp32 and bf16 tensors, 2 GiB) and
``small`` (20,000 tensors of 4-256 KiB). Prints a table, writes JSON with every
measurement, a text table, a Markdown table and a PNG chart to ``--out``.

    python benches/bench_save_load.py [--reps 5] [--dir /path/on/the/disk] [--out bench-results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import saveload_child as child  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)

SAVES = ["tierstore", "torch.save", "safetensors"]
LOADS = ["tierstore", "tierstore mmap", "torch.load", "torch.load mmap", "safetensors"]
SUFFIX = {"tierstore": ".ts.pt", "torch": ".torch.pt", "safetensors": ".st"}


def file_for(d: Path, dataset: str, system: str) -> Path:
    key = system.split(" ")[0] if system.split(" ")[0] in ("tierstore", "safetensors") else "torch"
    return d / f"{dataset}{SUFFIX[key]}"


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- ceiling probes

FIO_CONFIGS = [("8M", 16), ("1M", 64), ("4M", 32)]


class Probe:
    """The device ceiling at a moment: one fio run of ``size`` bytes
    (O_DIRECT, io_uring), a sequential write ending in fsync or a sequential
    read of the last file written, cold. Without fio: Python O_DIRECT at queue
    depth 1 (a lower figure; the report says which)."""

    def __init__(self, directory: Path, size_gib: float) -> None:
        self.file = directory / "ceiling.probe"
        self.size = max(int(size_gib * GiB) // (8 << 20) * (8 << 20), 8 << 20)
        self.fio = shutil.which("fio") is not None
        self.best = {"write": FIO_CONFIGS[0], "read": FIO_CONFIGS[0]}
        self.calibration: dict[str, dict[str, float]] = {}

    @property
    def method(self) -> str:
        if not self.fio:
            return f"Python O_DIRECT, queue depth 1, {self.size / GiB:.2f} GiB (fio not found)"
        w, r = self.best["write"], self.best["read"]
        return (
            f"fio O_DIRECT io_uring, {self.size / GiB:.2f} GiB; write bs {w[0]} QD{w[1]} + fsync, "
            f"cold read bs {r[0]} QD{r[1]}"
        )

    def _fio(self, rw: str, bs: str, qd: int) -> float:
        cmd = [
            "fio", "--name=ceiling", f"--filename={self.file}", f"--size={self.size}", f"--bs={bs}",
            "--direct=1", "--ioengine=io_uring", f"--iodepth={qd}", "--output-format=json", f"--rw={rw}",
        ]  # fmt: skip
        if rw == "write":
            cmd.append("--end_fsync=1")
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(run.stdout)["jobs"][0][rw]
        return float(job["bw_bytes"]) / GiB

    def _py(self, rw: str) -> float:
        import mmap

        chunk = 8 << 20
        buf = mmap.mmap(-1, chunk)
        buf.write(b"\x01" * chunk)
        flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if rw == "write" else os.O_RDONLY)
        fd = os.open(self.file, flags, 0o644)
        t0 = time.perf_counter()
        try:
            for off in range(0, self.size, chunk):
                if rw == "write":
                    os.pwrite(fd, buf, off)
                else:
                    os.preadv(fd, [buf], off)
            if rw == "write":
                os.fsync(fd)
        finally:
            os.close(fd)
        return self.size / GiB / (time.perf_counter() - t0)

    def write(self, config: tuple[str, int] | None = None) -> float:
        self.file.unlink(missing_ok=True)
        os.sync()
        bs, qd = config or self.best["write"]
        return self._fio("write", bs, qd) if self.fio else self._py("write")

    def read(self, config: tuple[str, int] | None = None) -> float:
        if not self.file.exists() or self.file.stat().st_size < self.size:
            self.write()
        child.evict(self.file)
        bs, qd = config or self.best["read"]
        return self._fio("read", bs, qd) if self.fio else self._py("read")

    def calibrate(self) -> None:
        """Tries each fio configuration once; the best for each direction is
        used for every probe after."""
        if not self.fio:
            return
        for bs, qd in FIO_CONFIGS:
            key = f"{bs}/QD{qd}"
            w = self.write((bs, qd))
            r = self.read((bs, qd))
            self.calibration[key] = {"write": w, "read": r}
        for rw in ("write", "read"):
            best = max(FIO_CONFIGS, key=lambda c: self.calibration[f"{c[0]}/QD{c[1]}"][rw])
            self.best[rw] = best


def engine_ceiling(directory: Path, size_gib: float) -> dict[str, float]:
    """The engine's raw path: one record written durably and read back cold
    (no pickling, no checksums). Context only: it is tierstore measuring
    itself, not an independent ceiling."""
    code = f"""
import json, os, time, torch, tierstore
from tierstore import _core, _archive
import saveload_child as c
n = {int(size_gib * GiB) // 4096 * 4096}
f = {str(directory / "raw.ceiling")!r}
buf = torch.ones(n, dtype=torch.uint8); st = buf.untyped_storage()
c.prefault(n); os.sync()
t0 = time.perf_counter()
w = _core.create_writer(tierstore.get_engine(), f)
w.add_memory("raw/data/0", st.data_ptr(), st.nbytes(), st); w.write_data(); w.commit()
wt = time.perf_counter() - t0
del buf, st
_a, _m, offs = _archive.open_archive(f)
c.prefault(n); c.evict(__import__("pathlib").Path(f))
t0 = time.perf_counter()
pending = _core.start_read(tierstore.get_engine(), f, [("raw/data/0", offs["data/0"], n, None)]); pending.wait()
rt = time.perf_counter() - t0
os.unlink(f)
print(json.dumps({{"write": n / 2**30 / wt, "read": n / 2**30 / rt}}))
"""
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=HERE, timeout=600
        )
        out: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
        return out
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        print(f"engine raw path failed: {e}", file=sys.stderr)
        return {}


# ---------------------------------------------------------------- measurements


@dataclass
class Result:
    system: str
    op: str
    dataset: str
    nbytes: int
    runs: list[dict[str, Any]] = field(default_factory=list)

    def col(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.runs]

    @property
    def gibps_runs(self) -> list[float]:
        return [self.nbytes / GiB / s for s in self.col("seconds")]

    @property
    def fractions(self) -> list[float]:
        return self.col("fraction")

    @property
    def gibps(self) -> float:
        return statistics.median(self.gibps_runs)

    @property
    def fraction(self) -> float:
        return statistics.median(self.fractions)

    @property
    def cpu_per_gib_runs(self) -> list[float]:
        return [c / (self.nbytes / GiB) for c in self.col("cpu_seconds")]

    @property
    def cpu_per_gib(self) -> float:
        return statistics.median(self.cpu_per_gib_runs)

    def mib(self, key: str, base: str = "rss_base") -> list[float]:
        return [(r[key] - r[base]) / MiB for r in self.runs]


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        out = Path(tf.name)
    try:
        subprocess.run([sys.executable, str(HERE / "saveload_child.py"), json.dumps(job), str(out)], check=True)
        res: dict[str, Any] = json.loads(out.read_text())
        return res
    finally:
        out.unlink(missing_ok=True)


def run_dataset(
    name: str, args: argparse.Namespace, probe: Probe, systems: set[str] | None
) -> tuple[list[Result], list[dict[str, Any]]]:
    """Every save and load of ``name``, interleaved per repetition, and, after
    each repetition's loads, the fresh-memory floor of a load of this state
    (``saveload_child.fresh_memory``)."""
    spec = child.spec_for(name, args.large_gib, args.small_count)
    nbytes = child.spec_bytes(spec)
    saves = [s for s in SAVES if systems is None or s in systems or s.split(".")[0] in systems]
    loads = [s for s in LOADS if systems is None or s in systems or s.split(".")[0] in systems]
    # A load needs its file: torch.load's and safetensors' come from their saves.
    for s in loads:
        src = s.split(" ")[0] if s.split(" ")[0] in ("tierstore", "safetensors") else "torch.save"
        if src not in saves:
            saves.append(src)
    results = {(op, s): Result(s, op, name, nbytes) for op, ss in (("save", saves), ("load", loads)) for s in ss}
    base = {"dataset": name, "large_gib": args.large_gib, "small_count": args.small_count, "level": not args.no_level}
    floors: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for op, order in (("save", saves), ("load", loads)):
            order = order if rep % 2 == 0 else order[::-1]
            # Probe, measure, probe, measure, ... probe: each measurement has
            # a probe just before and just after it.
            after = probe.write() if op == "save" else probe.read()
            for system in order:
                f = file_for(args.dir, name, system)
                before = after
                r = run_child({**base, "op": op, "system": system, "file": str(f)})
                after = probe.write() if op == "save" else probe.read()
                r["rep"] = rep
                r["position"] = order.index(system)
                r["ceiling_before"], r["ceiling_after"] = before, after
                r["ceiling"] = max(before, after)
                r["gibps"] = nbytes / GiB / r["seconds"]
                r["fraction"] = r["gibps"] / r["ceiling"]
                results[(op, system)].runs.append(r)
                extra = ""
                if op == "load":
                    extra = f", device read {r['read_bytes'] / r['file_bytes']:.3f} of the file"
                print(
                    f"  {name:5} rep {rep + 1} {op} {system:16} {r['gibps']:6.2f} GiB/s = {r['fraction']:.2f} x "
                    f"ceiling {r['ceiling']:.2f} ({before:.2f} before, {after:.2f} after), "
                    f"peak RSS +{(r['rss_peak'] - r['rss_base']) / MiB:.0f} MiB{extra}",
                    flush=True,
                )
        if loads:
            fl = run_child({**base, "op": "floor", "system": "floor", "file": str(args.dir / "floor")})
            fl["rep"] = rep
            floors.append(fl)
            print(
                f"  {name:5} rep {rep + 1} fresh memory of the state, populated: "
                f"{fl['cpu_seconds'] / (nbytes / GiB):.2f} CPU s/GiB ({fl['minor_faults']} faults)",
                flush=True,
            )
    for s in {*saves}:
        file_for(args.dir, name, s).unlink(missing_ok=True)
    out = [results[("save", s)] for s in SAVES if s in saves] + [results[("load", s)] for s in LOADS if s in loads]
    return out, floors


def floor_cpu(floors: list[dict[str, Any]]) -> list[float]:
    """The fresh-memory floor's CPU s/GiB, one per repetition."""
    return [f["cpu_seconds"] / (f["bytes"] / GiB) for f in floors]


def floor_lines(floors: dict[str, list[dict[str, Any]]]) -> list[str]:
    return [
        f"fresh memory, {ds}: {rng(floor_cpu(fl))} CPU s/GiB to populate anonymous memory of the state's size "
        f"({statistics.median(f['minor_faults'] for f in fl) / (fl[0]['bytes'] / GiB):,.0f} faults per GiB; "
        f"{fl[0].get('method', 'MADV_POPULATE_WRITE')}, the kernel's default pages, nothing read): the floor of "
        "every load that returns its tensors in memory of their own (tierstore.load, torch.load); the mapped "
        "loaders (mmap=True, safetensors) allocate none"
        for ds, fl in floors.items()
        if fl
    ]


# ---------------------------------------------------------------- reporting


def rng(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def peer_of(results: list[Result], r: Result) -> Result | None:
    return next(
        (x for x in results if x.dataset == r.dataset and x.op == r.op and x.system in ("torch.save", "torch.load")),
        None,
    )


def paired(a: Result, b: Result, key: str = "gibps") -> list[float]:
    """Per-repetition ratios a/b (the two measured in the same repetition)."""
    bb = {r["rep"]: r[key] for r in b.runs}
    return [r[key] / bb[r["rep"]] for r in a.runs if r["rep"] in bb]


def verdict(a: list[float], b: list[float]) -> str:
    """``higher`` / ``lower`` when the ranges do not overlap, else ``within spread``."""
    if min(a) > max(b):
        return "higher"
    if max(a) < min(b):
        return "lower"
    return "within spread"


def request_kib(r: Result) -> float | None:
    """The median over repetitions of the mean size of the requests the
    device served during the operation, in KiB (None where unknown)."""
    sizes = [x["device_request_bytes"] / x["device_requests"] / 1024 for x in r.runs if x.get("device_requests")]
    return statistics.median(sizes) if sizes else None


def table(results: list[Result], probe: Probe, floors: dict[str, list[dict[str, Any]]]) -> str:
    hdr = (
        f"{'dataset':7} {'op':4} {'system':16} {'GiB/s median (min-max)':>23} {'x ceiling (min-max)':>20} "
        f"{'x torch (min-max)':>18} {'CPU s/GiB':>9} {'peak +MiB':>9} {'after +MiB':>10} {'dev/file':>8} {'KiB/req':>7}"
    )
    lines = [hdr, "-" * len(hdr)]
    for r in results:
        peer = peer_of(results, r)
        vs = rng(paired(r, peer)) if peer else "n/a"
        dev = r.col("read_bytes" if r.op == "load" else "write_bytes")
        devf = statistics.median(d / fb for d, fb in zip(dev, r.col("file_bytes"), strict=True))
        kib = request_kib(r)
        req = f"{kib:7.0f}" if kib is not None else f"{'-':>7}"
        lines.append(
            f"{r.dataset:7} {r.op:4} {r.system:16} {rng(r.gibps_runs):>23} {rng(r.fractions):>20} {vs:>18} "
            f"{r.cpu_per_gib:9.2f} {max(r.mib('rss_peak')):9.0f} {statistics.median(r.mib('rss_after')):10.0f} "
            f"{devf:8.3f} {req}"
        )
    lines.append(f"ceiling probe next to every measurement: {probe.method}")
    lines.append(
        "peak +MiB: the highest RSS during the operation above the RSS just before it (max over repetitions); "
        "after +MiB: RSS once it is over (a load's result still held), median; dev/file: bytes the process "
        "read from (loads) or wrote to (saves) the block layer over the file's size, median; KiB/req: the mean size "
        "of the requests the device served during the operation (/proc/diskstats), median"
    )
    lines += floor_lines(floors)
    ts = [r for r in results if r.system.startswith("tierstore")]
    for r in ts:
        pool = r.col("engine_pool_allocated_bytes")
        lines.append(
            f"tierstore engine buffers after a {r.dataset} {r.op}: {max(pool) / MiB:.0f} MiB allocated "
            f"(engine start {statistics.median(r.col('engine_start_s')) * 1e3:.0f} ms, before the clock)"
        )
    return "\n".join(lines)


def above_ceiling(results: list[Result]) -> list[str]:
    """Every measurement above the ceiling of its moment, with what the
    measurement itself shows about why."""
    out = []
    for r in results:
        for run in r.runs:
            if run["fraction"] <= 1.0:
                continue
            why = []
            if r.op == "load":
                dev = run["read_bytes"] / run["file_bytes"]
                cached = run["file_cached_before"] / run["file_bytes"]
                if dev < 0.98:
                    why.append(
                        f"only {dev:.3f} of the file was read from the device ({cached:.3f} cached before): "
                        "the rest came from the page cache"
                    )
                else:
                    why.append(
                        f"the load was cold ({cached:.3f} of the file cached before, the process read "
                        f"{dev:.3f} of it from the device)"
                    )
            lo, hi = sorted((run["ceiling_before"], run["ceiling_after"]))
            if hi > lo * 1.15:
                why.append(f"the probes around it disagree ({lo:.2f} and {hi:.2f} GiB/s): the disk changed speed")
            if len(why) == 1 or r.op == "save":
                why.append(
                    "this access pattern got more from the disk at that moment than the fixed-size probe did: "
                    "the ceiling is a probe, not a bound"
                )
            out.append(
                f"{r.dataset} {r.op} {r.system} rep {run['rep'] + 1}: {run['gibps']:.2f} GiB/s = "
                f"{run['fraction']:.2f}x its ceiling {run['ceiling']:.2f}; " + "; ".join(why)
            )
    return out


def targets(results: list[Result], floors: dict[str, list[dict[str, Any]]]) -> list[tuple[str, bool, str]]:
    def get(ds: str, op: str, system: str) -> Result | None:
        return next((r for r in results if r.dataset == ds and r.op == op and r.system == system), None)

    out = []
    for ds, save_ceil, load_ceil, load_torch in (("large", 0.8, 0.9, None), ("small", 0.75, 0.8, 2.0)):
        s, ts = get(ds, "save", "tierstore"), get(ds, "save", "torch.save")
        ld, tl = get(ds, "load", "tierstore"), get(ds, "load", "torch.load")
        if s is None or ld is None:
            continue
        out.append((
            f"{ds}: save >= {save_ceil}x write ceiling (median of each against its moment)",
            s.fraction >= save_ceil,
            f"{rng(s.fractions)}x",
        ))  # fmt: skip
        if ts is not None:
            pr = paired(s, ts)
            out.append((f"{ds}: save >= 4x torch.save (paired per repetition)", statistics.median(pr) >= 4, rng(pr)))
        out.append((
            f"{ds}: cold load >= {load_ceil}x read ceiling (median of each against its moment)",
            ld.fraction >= load_ceil,
            f"{rng(ld.fractions)}x",
        ))  # fmt: skip
        if load_torch is not None and tl is not None:
            pr = paired(ld, tl)
            out.append(
                (f"{ds}: cold load >= {load_torch}x torch.load (paired)", statistics.median(pr) >= load_torch, rng(pr))
            )
        mapped = get(ds, "load", "tierstore mmap")
        modes = [("save", "", s), ("load", "", ld)] + ([("load", " with mmap=True", mapped)] if mapped else [])
        for op, how, mine in modes:
            peers = [r for r in results if r.dataset == ds and r.op == op and not r.system.startswith("tierstore")]
            if not peers:
                continue
            if op == "load":
                # "Not slower than any peer" is claimed only when the ranges of
                # fractions of the ceiling do not overlap: the difference must
                # exceed the spread. A peer within the spread fails the claim.
                v = {p.system: verdict(mine.fractions, p.fractions) for p in peers}
                detail = f"{mine.system} {rng(mine.fractions)}x ceiling; " + "; ".join(
                    f"{p.system} {rng(p.fractions)}: {mine.system} {v[p.system]}" for p in peers
                )
                out.append((
                    f"{ds}: cold load{how} not slower than any peer (faster than each beyond the spread)",
                    all(x == "higher" for x in v.values()),
                    detail,
                ))  # fmt: skip
            cpu = {p.system: verdict(p.cpu_per_gib_runs, mine.cpu_per_gib_runs) for p in peers}
            floor = ""
            if op == "load" and not how and floors.get(ds):
                floor = f"; fresh-memory floor {rng(floor_cpu(floors[ds]))}"
            out.append((
                f"{ds}: {op}{how} CPU s/GiB lower than every peer beyond the spread",
                all(x == "higher" for x in cpu.values()),
                f"{mine.system} {rng(mine.cpu_per_gib_runs)}; "
                + "; ".join(f"{p.system} {rng(p.cpu_per_gib_runs)}" for p in peers)
                + floor,
            ))  # fmt: skip
        peak = max(s.mib("rss_peak"))
        out.append((f"{ds}: peak RSS during save <= N + 512 MiB", peak <= 512, f"+{peak:.0f} MiB over the state"))
        lpeak = max(ld.mib("rss_peak")) - ld.nbytes / MiB
        out.append((f"{ds}: peak RSS during load <= N + 512 MiB", lpeak <= 512, f"+{lpeak:.0f} MiB over the result"))
    return out


def markdown(results: list[Result], probe: Probe, floors: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        "| state dict | operation | system | GiB/s median (min-max) | x ceiling of its moment (min-max) | x torch | "
        "CPU s/GiB | peak RSS +MiB | RSS after +MiB | KiB/request |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        peer = peer_of(results, r)
        name = f"**{r.system}**" if r.system.startswith("tierstore") else r.system
        op = "durable save" if r.op == "save" else "cold load"
        vs = f"{statistics.median(paired(r, peer)):.2f}" if peer else ""
        g, f = r.gibps_runs, r.fractions
        rows.append(
            f"| {r.dataset} | {op} | {name} | {statistics.median(g):.2f} ({min(g):.2f}-{max(g):.2f}) | "
            f"{statistics.median(f):.2f} ({min(f):.2f}-{max(f):.2f}) | {vs} | {r.cpu_per_gib:.2f} | "
            f"{max(r.mib('rss_peak')):.0f} | {statistics.median(r.mib('rss_after')):.0f} | "
            f"{'' if (kib := request_kib(r)) is None else f'{kib:.0f}'} |"
        )
    ceil = {op: [run["ceiling"] for r in results if r.op == op for run in r.runs] for op in ("save", "load")}
    if ceil["save"] and ceil["load"]:
        rows.append("")
        rows.append(
            f"Ceilings of the moments ({probe.method}): write {min(ceil['save']):.2f}-{max(ceil['save']):.2f} GiB/s, "
            f"read {min(ceil['load']):.2f}-{max(ceil['load']):.2f} GiB/s."
        )
    if any(floors.values()):
        rows += ["", *(f"{line}." for line in floor_lines(floors))]
    return "\n".join(rows)


def chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(ds, op) for ds in ("large", "small") for op in ("save", "load")]
    panels = [p for p in panels if any(r.dataset == p[0] and r.op == p[1] for r in results)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.5), squeeze=False)
    for ax, (ds, op) in zip(axes[0], panels, strict=True):
        rs = [r for r in results if r.dataset == ds and r.op == op]
        med = [r.fraction for r in rs]
        err = [[r.fraction - min(r.fractions) for r in rs], [max(r.fractions) - r.fraction for r in rs]]
        colors = ["#d1495b" if r.system.startswith("tierstore") else "#8d99ae" for r in rs]
        ax.bar(range(len(rs)), med, color=colors, yerr=err, capsize=4)
        ax.set_xticks(range(len(rs)), [r.system for r in rs], rotation=30, ha="right", fontsize=8)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ceiling of the moment")
        ax.legend(fontsize=7, loc="upper right")
        ax.set_title(f"{ds}: {'durable save' if op == 'save' else 'cold load'}")
        ax.set_ylabel("x device ceiling (median, min-max)")
    fig.suptitle("tierstore vs torch.save/torch.load and safetensors, each against the disk's ceiling of its moment")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("bench-results/tmp"))
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--large-gib", type=float, default=2.0)
    ap.add_argument("--small-count", type=int, default=20_000)
    ap.add_argument("--probe-gib", type=float, default=1.0, help="bytes each ceiling probe writes or reads")
    ap.add_argument("--only", choices=["large", "small"], default=None)
    ap.add_argument("--systems", default=None, help="comma-separated systems to run (e.g. tierstore)")
    ap.add_argument(
        "--no-level",
        action="store_true",
        help="do not touch-and-free memory before each measurement (see saveload_child.prefault)",
    )
    args = ap.parse_args()
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    systems = set(args.systems.split(",")) if args.systems else None
    cold = drop_caches()
    import tierstore

    info = tierstore.info(args.dir)
    print(
        f"tierstore {info['version']}, backend {info['backend']}, {info['path']['fs_type']} at {args.dir}; "
        f"cold loads: {'yes' if cold else 'NO (cannot drop the page cache)'}",
        flush=True,
    )
    started = time.time()
    probe = Probe(args.dir, args.probe_gib)
    probe.calibrate()
    raw = [engine_ceiling(args.dir, args.probe_gib)]
    print(f"ceiling calibration: fio {probe.calibration or 'not found'}; {probe.method}", flush=True)
    print(f"engine raw path (context): {raw[0]}", flush=True)
    results: list[Result] = []
    floors: dict[str, list[dict[str, Any]]] = {}
    for ds in ("large", "small"):
        if args.only in (None, ds):
            got, floors[ds] = run_dataset(ds, args, probe, systems)
            results += got
    raw.append(engine_ceiling(args.dir, args.probe_gib))
    probe.file.unlink(missing_ok=True)
    text = table(results, probe, floors)
    notes = above_ceiling(results)
    print()
    print(text)
    if notes:
        text += "\nabove the ceiling of its moment:\n" + "\n".join(f"  {n}" for n in notes)
        print("\nabove the ceiling of its moment:")
        for n in notes:
            print(f"  {n}")
    checks = targets(results, floors) if args.only is None and systems is None else []
    if checks:
        text += "\n\n" + "\n".join(f"{'MET ' if ok else 'MISS'}  {n}: {d}" for n, ok, d in checks)
        print()
        for name, ok, detail in checks:
            print(f"{'MET ' if ok else 'MISS'}  {name}: {detail}")
    header = (
        f"benches/bench_save_load.py --reps {args.reps} ({datetime.date.today().isoformat()}, "
        f"{os.cpu_count()} cores, {info['path']['fs_type']}, backend {info['backend']}, torch "
        f"{child.torch.__version__}; {(time.time() - started) / 60:.0f} min)"
    )
    data = {
        "tierstore": info,
        "ceiling_method": probe.method,
        "ceiling_calibration": probe.calibration,
        "engine_raw_path": raw,
        "cold": cold,
        "memory_levelled": not args.no_level,
        "torch": child.torch.__version__,
        "reps": args.reps,
        "results": [
            {
                "dataset": r.dataset, "op": r.op, "system": r.system, "bytes": r.nbytes,
                "seconds": r.col("seconds"), "gibps": r.gibps_runs, "gibps_median": r.gibps,
                "ceiling_gibps": r.col("ceiling"), "fraction_of_ceiling": r.fractions,
                "fraction_median": r.fraction, "cpu_seconds": r.col("cpu_seconds"), "cpu_s_per_gib": r.cpu_per_gib,
                "peak_rss_growth_bytes": [run["rss_peak"] - run["rss_base"] for run in r.runs],
                "rss_after_growth_bytes": [run["rss_after"] - run["rss_base"] for run in r.runs],
                "runs": r.runs,
            }
            for r in results
        ],
        "fresh_memory_floor": {
            ds: {"cpu_s_per_gib": floor_cpu(fl), "runs": fl} for ds, fl in floors.items() if fl
        },
        "above_ceiling": notes,
        "targets": [{"target": n, "met": ok, "detail": d} for n, ok, d in checks],
    }  # fmt: skip
    (args.out / "save_load.json").write_text(json.dumps(data, indent=2))
    (args.out / "save_load.txt").write_text(header + "\n" + text + "\n")
    (args.out / "save_load.md").write_text(markdown(results, probe, floors) + "\n")
    chart(results, args.out / "save_load.png")
    print(f"\nwrote save_load.json, .txt, .md and .png to {args.out}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
