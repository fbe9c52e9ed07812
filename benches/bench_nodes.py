"""Node-scoped tiers benchmark (issue 17): 4 ranks as 2 simulated nodes
(``TIERSTORE_NODE``; each node's local tier a directory of its own on the
local disk), a remote tier on a loop-mounted ext4 image whose reads the
kernel throttles (blkio ``read_bps_device``) to a tenth of the local disk's
measured speed. One run measures, page cache dropped before each restore:

- a restore after a full restart (every node's copy intact): bytes read
  remotely, and its time next to a plain ``load_sharded`` of the same bytes
  from one local directory (medians of ``--repeats``
  rounds, the two alternating);
- a restore after one node lost its copy (its directory removed): the bytes
  that came from elsewhere (peers with ``replicas=1``, else the remote tier)
  next to that node's share, and its time next to a restore from the remote
  tier alone;
- the training loop's blocked time per checkpoint with ``replicas=1``, next
  to a synchronous ``torch.save`` plus fsync of the same state in the same
  processes. Each rank runs a loop: the update of a step writes the state in
  place, ``save`` starts a checkpoint of it, the next step's forward and
  backward (single-threaded matrix products for ``--compute-s`` seconds)
  run while it is captured, and ``wait_capture`` (what an attached
  optimizer's pre-step hook does) comes before the next update. Blocked is
  the time in ``save`` plus the time in ``wait_capture``; the capture alone
  (``save`` then ``wait_capture`` at once, no compute) is reported beside it.

Needs root for the loop device and the throttle; without them the remote tier
is a plain directory, unthrottled, and the table says so.

    python benches/bench_nodes.py [--mib-per-rank 64] [--compute-s 1.0] [--json out.json] [--out out.txt]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WORLD = 4
STEPS = 3  # the loop's checkpoints, then one captured alone (the newest, restored)


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_speed(d: Path, mib: int = 256) -> float:
    """This disk's cold sequential read speed (bytes/s, O_DIRECT, 4 MiB reads)."""
    f = d / "speed.bin"
    with open(f, "wb") as fh:
        fh.write(os.urandom(1 << 20) * mib)
        fh.flush()
        os.fsync(fh.fileno())
    drop_caches()
    t0 = time.perf_counter()
    r = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"], capture_output=True, check=False)
    dt = time.perf_counter() - t0
    f.unlink()
    return mib * (1 << 20) / dt if r.returncode == 0 else float("nan")


class Remote:
    """The remote tier's directory: a loop-mounted ext4 image with reads
    throttled by the kernel, or (not root) a plain directory."""

    def __init__(self, work: Path, size_mib: int, bps: int, throttle: bool = True) -> None:
        self.path = work / "remote"
        self.loop: str | None = None
        self.mount: Path | None = None
        self.throttled = False
        self.bps = bps
        img = work / "remote.img"
        try:
            if not throttle:
                raise OSError("--no-throttle")
            subprocess.run(["truncate", "-s", f"{size_mib}M", str(img)], check=True)
            self.loop = subprocess.run(
                ["losetup", "-f", "--show", str(img)], check=True, capture_output=True, text=True
            ).stdout.strip()
            subprocess.run(["mkfs.ext4", "-q", self.loop], check=True)
            self.mount = work / "remote-mnt"
            self.mount.mkdir()
            subprocess.run(["mount", self.loop, str(self.mount)], check=True)
            self.path = self.mount / "remote"
            st = os.stat(self.loop)
            rule = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} {bps}\n"
            Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").write_text(rule)
            self.rule = rule
            self.throttled = True
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"remote tier not throttled ({e}); using a plain directory")
            self.close()
            self.path = work / "remote"
        self.path.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        if self.throttled:
            with contextlib.suppress(OSError):
                Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").write_text(self.rule.split()[0] + " 0\n")
            self.throttled = False
        if self.mount is not None:
            subprocess.run(["umount", str(self.mount)], check=False)
            self.mount = None
        if self.loop is not None:
            subprocess.run(["losetup", "-d", self.loop], check=False)
            self.loop = None


def _tiers(job: dict[str, Any], replicas: int) -> list[Any]:
    from tierstore import DiskTier, HostTier, RemoteTier

    return [
        HostTier(f"{job['mib'] * 3}MiB"),
        DiskTier("nvme-{node}", scope="node", replicas=replicas),
        RemoteTier(job["remote"]),
    ]


def _state(rank: int, step: int, mib: int) -> dict[str, Any]:
    import tierstore
    from tierstore.layout import Layout, attach

    rows = mib * (1 << 20) // (4 * 1024)
    g = torch.Generator().manual_seed(rank * 1000 + step)
    w = torch.randn(rows, 1024, generator=g)
    lay = Layout.block("w", (rows * WORLD, 1024), (rank * rows, 0), (rows, 1024))
    return {"w": attach(w, lay), "step": step, "rng": tierstore.PerRank(rank)}


def _target(rank: int, mib: int) -> dict[str, Any]:
    from tierstore.layout import Layout, attach

    rows = mib * (1 << 20) // (4 * 1024)
    lay = Layout.block("w", (rows * WORLD, 1024), (rank * rows, 0), (rows, 1024))
    return {"w": attach(torch.empty(rows, 1024), lay), "step": None, "rng": None}


def _worker(rank: int, world: int, store: str, job: dict[str, Any], q: Any) -> None:
    import torch.distributed as dist

    import tierstore

    os.environ["TIERSTORE_NODE"] = f"n{rank // 2}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    res: dict[str, Any] = {}
    try:
        root = os.path.join(job["work"], "job")
        mib = job["mib"]
        if job["phase"] == "save":
            ck = tierstore.Checkpointer(root, tiers=_tiers(job, job["replicas"]))
            values = [_state(rank, step, mib)["w"] for step in range(STEPS)]
            st = _state(rank, 0, mib)
            a = torch.randn(256, 256)
            blocked, capture = [], []
            for step in range(STEPS - 1):
                st["w"].copy_(values[step])  # this step's update
                st["step"] = step
                dist.barrier()
                t0 = time.perf_counter()
                ck.save(step, st)
                in_save = time.perf_counter() - t0
                # The next step's forward and backward, while the capture runs.
                t1 = time.perf_counter()
                while time.perf_counter() - t1 < job["compute_s"]:
                    a = torch.tanh(a @ a)
                t2 = time.perf_counter()
                ck.wait_capture()  # before the next update writes the state
                blocked.append(in_save + time.perf_counter() - t2)
            ck.wait()
            # The capture alone: save, then wait for it at once (no compute to hide it).
            st["w"].copy_(values[STEPS - 1])
            st["step"] = STEPS - 1
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(STEPS - 1, st)
            ck.wait_capture()
            capture.append(time.perf_counter() - t0)
            ck.wait()
            ck.close()
            # The same state, saved synchronously with torch.save and fsync.
            st = _state(rank, 0, mib)
            f = Path(job["work"]) / f"sync-{rank}.pt"
            dist.barrier()
            t0 = time.perf_counter()
            torch.save(st, f)
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            res["sync_save_s"] = time.perf_counter() - t0
            f.unlink()
            res["blocked_s"] = statistics.median(blocked)
            res["capture_s"] = statistics.median(capture)
        elif job["phase"] == "restore":
            ck = tierstore.Checkpointer(root, tiers=_tiers(job, job["replicas"]))
            into = _target(rank, mib)
            dist.barrier()
            t0 = time.perf_counter()
            ck.load_latest(into=into)
            dist.barrier()
            res["s"] = time.perf_counter() - t0
            res["restored"] = {k: v for k, v in (ck.restored or {}).items() if k != "path"}
            assert torch.equal(into["w"], _state(rank, STEPS - 1, mib)["w"])
            ck.close()
        else:  # a plain load_sharded of one directory
            into = _target(rank, mib)
            dist.barrier()
            t0 = time.perf_counter()
            tierstore.load_sharded(job["dir"], into, per_rank_policy="rank0")
            dist.barrier()
            res["s"] = time.perf_counter() - t0
            assert torch.equal(into["w"], _state(rank, STEPS - 1, mib)["w"])
    finally:
        dist.destroy_process_group()
        q.put((rank, res))


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as td:
        procs = [ctx.Process(target=_worker, args=(r, WORLD, f"{td}/store", job, q)) for r in range(WORLD)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + 1800
        while len(out) < WORLD:
            try:
                r, res = q.get(timeout=2)
                out[r] = res
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a rank failed (exit codes {dead}) or the job timed out") from None
        for p in procs:
            p.join()
    return [out[r] for r in range(WORLD)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib-per-rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of restart and plain local load")
    ap.add_argument("--compute-s", type=float, default=1.0, help="forward+backward time of a step, per rank")
    ap.add_argument("--no-throttle", action="store_true", help="a plain directory for the remote tier (tests)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    mib = args.mib_per_rank
    work = Path(tempfile.mkdtemp(prefix="ts-nodes-", dir=os.environ.get("TIERSTORE_BENCH_DIR")))
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    local_bps = read_speed(work)
    remote = Remote(work, mib * WORLD * (STEPS + 1) * 2 + 256, int(local_bps / 10), not args.no_throttle)
    rows: dict[str, Any] = {"local_read_MBps": local_bps / 1e6, "remote_throttled": remote.throttled,
                            "remote_read_MBps": remote.bps / 1e6 if remote.throttled else None}  # fmt: skip
    try:
        base = {"work": str(work), "remote": str(remote.path), "mib": mib, "compute_s": args.compute_s}
        saved = run({**base, "phase": "save", "replicas": 1})
        rows["blocked_s"] = max(r["blocked_s"] for r in saved)
        rows["capture_s"] = max(r["capture_s"] for r in saved)
        rows["sync_save_s"] = max(r["sync_save_s"] for r in saved)
        step = f"step-{STEPS - 1:012d}"
        # A plain local load of the same bytes: the whole checkpoint in one local directory.
        plain = work / "plain"
        shutil.copytree(remote.path / step, plain)
        # Restart and plain load alternate (--repeats rounds, the order flipped
        # every round; the slowest rank of each run); the medians are compared.
        plains: list[float] = []
        restarts: list[float] = []
        remote_b = peer_b = 0
        for rep in range(args.repeats):
            for what in ("plain", "restart") if rep % 2 == 0 else ("restart", "plain"):
                drop_caches()
                if what == "plain":
                    plains.append(max(r["s"] for r in run({**base, "phase": "plain", "dir": str(plain)})))
                    continue
                full = run({**base, "phase": "restore", "replicas": 1})
                restarts.append(max(r["s"] for r in full))
                remote_b = max(remote_b, sum(r["restored"]["bytes_by_tier"].get("remote", 0) for r in full))
                peer_b = max(peer_b, sum(r["restored"]["bytes_from_peers"] for r in full))
        rows.update(plain_local_runs_s=plains, restart_runs_s=restarts)
        rows["plain_local_s"] = statistics.median(plains)
        rows["restart_s"] = statistics.median(restarts)
        rows["restart_remote_bytes"], rows["restart_peer_bytes"] = remote_b, peer_b
        # Node n1 lost its copy: with replicas=1, its files come back from its peer.
        # That node's share: its copy of the step without the replicas it keeps of n0's ranks
        # (its ranks' files and the commit: manifest, key tree, job-wide objects).
        n1 = work / "job" / "nvme-n1" / step
        share = sum(
            p.stat().st_size
            for p in n1.iterdir()
            if not p.name.startswith(("rank-00000", "rank-00001", "objects-00001"))
        )
        shutil.rmtree(work / "job" / "nvme-n1")
        drop_caches()
        lost = run({**base, "phase": "restore", "replicas": 1})
        rows["lost_node_s"] = max(r["s"] for r in lost)
        rows["lost_node_elsewhere_bytes"] = sum(
            r["restored"]["bytes_by_tier"].get("remote", 0) + r["restored"]["bytes_from_peers"] for r in lost
        )
        rows["lost_node_share_bytes"] = share
        drop_caches()
        rows["remote_only_s"] = max(r["s"] for r in run({**base, "phase": "plain", "dir": str(remote.path / step)}))
    finally:
        remote.close()
        shutil.rmtree(work, ignore_errors=True)
    say(
        f"4 ranks as 2 nodes, {mib} MiB per rank, local disk {rows['local_read_MBps']:.0f} MB/s cold; remote tier "
        + (f"throttled to {rows['remote_read_MBps']:.0f} MB/s" if rows["remote_throttled"] else "NOT throttled")
    )
    say(f"{'measure':52} {'value':>12} {'target':>16}")
    remote_b, peer_b = rows["restart_remote_bytes"], rows["restart_peer_bytes"]
    say(f"{'restart: bytes read remotely / from peers':52} {remote_b:>6} / {peer_b:<5} {'0':>16}")
    ratio = rows["restart_s"] / rows["plain_local_s"]
    say(f"{'restart: restore s / plain local load s':52} {rows['restart_s']:.2f}/{rows['plain_local_s']:.2f} "
        f"= {ratio:.2f}x {'<= 1.1x':>8}")  # fmt: skip
    runs = {k: ", ".join(f"{x:.2f}" for x in rows[k]) for k in ("restart_runs_s", "plain_local_runs_s")}
    say(f"  (medians of {args.repeats} alternating runs: restore {runs['restart_runs_s']}; "
        f"plain {runs['plain_local_runs_s']})")  # fmt: skip
    say(
        f"{'lost node: bytes from elsewhere / its share (MB)':52} "
        f"{rows['lost_node_elsewhere_bytes'] / 1e6:.1f}/{rows['lost_node_share_bytes'] / 1e6:.1f} {'<= 1':>12}"
    )
    speed = rows["remote_only_s"] / rows["lost_node_s"]
    say(f"{'lost node: remote-only s / restore s':52} {rows['remote_only_s']:.2f}/{rows['lost_node_s']:.2f} "
        f"= {speed:.2f}x {'>= 1.8x':>8}")  # fmt: skip
    blocked = rows["blocked_s"] / rows["sync_save_s"]
    what = "blocked per checkpoint (replicas=1) / sync torch.save"
    say(f"{what:52} {rows['blocked_s']:.3f}/{rows['sync_save_s']:.3f} = {blocked:.1%} {'<= 5%':>8}")
    cap = rows["capture_s"] / rows["sync_save_s"]
    what = f"  (capture alone, no {args.compute_s:g} s of compute to hide it)"
    say(f"{what:52} {rows['capture_s']:.3f}/{rows['sync_save_s']:.3f} = {cap:.1%}")
    rows.update(restart_ratio=ratio, lost_node_speedup=speed, blocked_ratio=blocked)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "python", "rust", "benches"], capture_output=True,
                           text=True, check=False).stdout.strip()  # fmt: skip
    rows["commit"] = (head.stdout.strip() or "unknown") + ("+changes" if dirty else "")
    say(f"(python benches/bench_nodes.py {' '.join(argv if argv is not None else sys.argv[1:])}; "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, commit {rows['commit']})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
