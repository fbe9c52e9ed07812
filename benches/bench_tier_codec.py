"""A remote tier with deltas (issue 18): time until durable and bytes, against a raw remote tier.

The MiniLM fine-tune of ``bench_codec.py`` (AdamW, state every ``--every``
steps) gives the checkpoints; each is saved by two Checkpointers, alike but
for the remote tier's codec: ``raw`` (``RemoteTier(path)``) and ``delta``
(``RemoteTier(path, codec=tierstore.Delta(keyframe_every=K))``), in
alternating order, each waited for before the other starts, so that both
get the same bytes and the same machine. Each remote tier is a loop-mounted
ext4 file system whose reads and writes the kernel's block I/O controller
limits to ``--rate`` MiB/s (``benches/slow_path.sh``; a plain directory,
said so, where that needs root and is not available).

Reported: time from ``save`` until the checkpoint is durable on the remote
tier (the handle's ``to_remote``), per checkpoint, median and total, delta
over raw; bytes each remote tier holds per tensor class (``tierstore
stats``); restore from the remote tier alone (local tier and page cache
dropped): a keyframe, a delta (its keyframe read and decoded too) and the
raw copy of the same step.

    python benches/bench_tier_codec.py --model-wheel PATH [--steps 200 --every 10 --rate 100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_codec  # the model, the data and the training loop

import tierstore
from tierstore import _tier_steps

HERE = Path(__file__).resolve().parent


class SlowPath:
    """A kernel-throttled path (benches/slow_path.sh), or a plain folder."""

    def __init__(self, name: str, mib: int, rate: int, fallback: Path) -> None:
        self.name = name
        r = subprocess.run(
            ["bash", str(HERE / "slow_path.sh"), "up", name, str(mib), str(rate), "ram"],
            capture_output=True,
            text=True,
            check=False,
        )
        self.throttled = r.returncode == 0
        if self.throttled:
            self.path = Path(r.stdout.strip().splitlines()[-1])
        else:
            print(f"remote {name} not throttled ({r.stderr.strip()}); a plain folder", file=sys.stderr)
            self.path = fallback / name
            self.path.mkdir(parents=True)

    def close(self) -> None:
        if self.throttled:
            subprocess.run(["bash", str(HERE / "slow_path.sh"), "down", self.name], check=False, capture_output=True)


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def state_of(snap: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    return {"model": snap["weights"], "optim": {"exp_avg": snap["m1"], "exp_avg_sq": snap["m2"]}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-wheel", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--keyframe-every", type=int, default=8)
    ap.add_argument(
        "--reference", default="keyframe", choices=["keyframe", "parent", "best"], help="Delta(reference=...)"
    )
    ap.add_argument("--rate", type=int, default=100, help="remote tier bandwidth, MiB/s (kernel-enforced)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)

    print("fine-tuning MiniLM ...", file=sys.stderr)
    model, vocab = bench_codec.load_minilm(args.model_wheel, pretrained=True)
    pairs = bench_codec.docstring_pairs()
    snaps = bench_codec.train(model, vocab, pairs, args.steps, args.every, 2e-5)
    raw_bytes = sum(t.numel() * t.element_size() for c in snaps[0].values() for t in c.values())

    work = Path(tempfile.mkdtemp(prefix="bench-tier-codec-"))
    img_mib = max(1024, int(raw_bytes * (len(snaps) + 4) / (1 << 20) * 1.2))
    remotes = {
        "raw": SlowPath("tc-raw", img_mib, args.rate, work),
        "delta": SlowPath("tc-delta", img_mib, args.rate, work),
    }
    result: dict[str, Any] = {
        "model": "all-MiniLM-L6-v2 fine-tune",
        "checkpoints": len(snaps),
        "checkpoint_bytes": raw_bytes,
        "rate_mib_s": args.rate,
        "throttled": all(r.throttled for r in remotes.values()),
        "keyframe_every": args.keyframe_every,
        "reference": args.reference,
    }
    try:
        cks = {}
        for name, r in remotes.items():
            codec = (
                tierstore.Delta(keyframe_every=args.keyframe_every, reference=args.reference)
                if name == "delta"
                else None
            )
            cks[name] = tierstore.Checkpointer(
                work / f"run-{name}",
                tiers=[
                    tierstore.HostTier(f"{raw_bytes * 3 // (1 << 20)}MiB"),
                    tierstore.DiskTier("local", keep_last=2),
                    tierstore.RemoteTier(str(r.path / "exp"), codec=codec),
                ],
            )
        durable: dict[str, list[float]] = {"raw": [], "delta": []}
        promote: dict[str, list[float]] = {"raw": [], "delta": []}
        for i, snap in enumerate(snaps):
            order = ["raw", "delta"] if i % 2 == 0 else ["delta", "raw"]
            for name in order:
                h = cks[name].save((i + 1) * args.every, state_of(snap))
                cks[name].wait()
                durable[name].append(h.timings["to_remote"])
                promote[name].append(h.timings["promote"])
            print(
                f"  checkpoint {i + 1}: until durable remotely raw {durable['raw'][-1]:.2f} s, "
                f"delta {durable['delta'][-1]:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        for ck in cks.values():
            ck.close()
        result["until_durable"] = {
            k: {"median_s": statistics.median(v), "total_s": sum(v), "each_s": v} for k, v in durable.items()
        }
        result["until_durable_ratio"] = sum(durable["delta"]) / sum(durable["raw"])
        result["promotion"] = {
            k: {"median_s": statistics.median(v), "total_s": sum(v), "each_s": v} for k, v in promote.items()
        }
        result["promotion_ratio"] = sum(promote["delta"]) / sum(promote["raw"])
        stats = {k: _tier_steps.run_stats([r.path / "exp"])["tiers"] for k, r in remotes.items()}
        result["stored"] = {k: next(iter(v.values())) for k, v in stats.items()}

        # Restores from the remote tier alone (cold: page cache dropped where allowed).
        steps = sorted((remotes["delta"].path / "exp").glob("step-*"))
        metas = {d: _tier_steps.tier_meta(d) for d in steps}
        key = next(d for d in steps if metas[d] and metas[d]["keyframe"])
        delta = next(d for d in reversed(steps) if metas[d] and not metas[d]["keyframe"])
        raw_same = remotes["raw"].path / "exp" / delta.name
        target = (
            {f"model.{n}": torch.empty_like(t) for n, t in snaps[0]["weights"].items()}
            | {f"optim.exp_avg.{n}": torch.empty_like(t) for n, t in snaps[0]["m1"].items()}
            | {f"optim.exp_avg_sq.{n}": torch.empty_like(t) for n, t in snaps[0]["m2"].items()}
        )
        restore: dict[str, list[float]] = {"raw": [], "keyframe": [], "delta": []}
        cold = True
        for _rep in range(3):
            for name, d in (("raw", raw_same), ("keyframe", key), ("delta", delta)):
                cold = drop_caches() and cold
                t0 = time.perf_counter()
                tierstore.load_sharded(d, target)
                restore[name].append(time.perf_counter() - t0)
        want = snaps[int(delta.name[5:]) // args.every - 1]
        assert all(torch.equal(target[f"model.{n}"], t) for n, t in want["weights"].items()), "restore mismatch"
        result["restore"] = {k: statistics.median(v) for k, v in restore.items()}
        result["restore_cold"] = cold
        result["restore_delta_over_keyframe"] = result["restore"]["delta"] / result["restore"]["keyframe"]
    finally:
        for r in remotes.values():
            r.close()
        shutil.rmtree(work, ignore_errors=True)
    lines = report(result)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def report(r: dict[str, Any]) -> list[str]:
    u = r["until_durable"]
    lines = [
        f"remote tier with deltas: {r['model']}, {r['checkpoints']} checkpoints of {_mib(r['checkpoint_bytes'])} "
        f"(fp32 weights, exp_avg, exp_avg_sq), remote tiers at {r['rate_mib_s']} MiB/s "
        f"({'kernel-throttled loop devices' if r['throttled'] else 'NOT throttled: plain folders'}), "
        f"keyframe every {r['keyframe_every']}, deltas against the {r.get('reference', 'keyframe')}"
        + (" (reference='best': per record, keyframe or parent)" if r.get("reference") == "best" else ""),
        "",
        f"{'until durable remotely':<26} {'median':>9} {'total':>9}",
        f"{'raw remote tier':<26} {u['raw']['median_s']:>8.2f}s {u['raw']['total_s']:>8.1f}s",
        f"{'delta remote tier':<26} {u['delta']['median_s']:>8.2f}s {u['delta']['total_s']:>8.1f}s",
        f"delta / raw (total): {r['until_durable_ratio']:.2f}x (target at most 0.5x)",
        f"the promotion alone (local tier -> remote tier, encoding included): raw median "
        f"{r['promotion']['raw']['median_s']:.2f} s, delta {r['promotion']['delta']['median_s']:.2f} s, "
        f"delta / raw (total) {r['promotion_ratio']:.2f}x",
        "",
        f"{'stored on the remote tier':<26} {'held':>12} {'stored':>12} {'ratio':>7}",
    ]
    for name, t in r["stored"].items():
        for cls, (raw, stored) in sorted(t["classes"].items(), key=lambda kv: -kv[1][0]):
            lines.append(f"{name + ' ' + cls:<26} {_mib(raw):>12} {_mib(stored):>12} {raw / stored:>6.2f}x")
        ratio = t["raw"] / t["stored"]
        lines.append(f"{name + ' all':<26} {_mib(t['raw']):>12} {_mib(t['stored']):>12} {ratio:>6.2f}x")
    rs = r["restore"]
    lines += [
        "",
        f"restore from the remote tier alone ({'cold' if r['restore_cold'] else 'page cache NOT dropped'}, "
        "median of 3):",
        f"  raw copy {rs['raw']:.2f} s, keyframe {rs['keyframe']:.2f} s, delta {rs['delta']:.2f} s "
        f"(delta / keyframe {r['restore_delta_over_keyframe']:.2f}x, target at most 2x)",
    ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
