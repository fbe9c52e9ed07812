"""Does a lossy checkpoint resume as well as a lossless one? (issue 18)

The MiniLM fine-tune of ``bench_codec.py`` trains ``--warm`` steps; its
model and AdamW state are then saved twice with ``tierstore.save``:
lossless, and with ``Delta(keep_bits={"*": K})`` (every float tensor's
mantissa rounded to K bits, weights and both moments). Each file is loaded
into a fresh model and optimizer and trained on for ``--steps`` steps on the
same batches (the same data order, the same torch seed); the losses of the
two resumes are compared step by step. Also reported: both files' sizes and
the measured largest relative error per record.

    python benches/bench_lossy_resume.py --model-wheel PATH [--warm 100 --steps 50 --bits 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as nnf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_codec

import tierstore


def step_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (qa, ma), (qb, mb) = batch
    ea, eb = nnf.normalize(model(qa, ma), dim=-1), nnf.normalize(model(qb, mb), dim=-1)
    return nnf.cross_entropy(ea @ eb.T / 0.05, torch.arange(len(ea)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-wheel", required=True)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--bits", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, vocab = bench_codec.load_minilm(args.model_wheel, pretrained=True)
    pairs = bench_codec.docstring_pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    it = bench_codec.batches(pairs, vocab, 32, 0)
    for _ in range(args.warm):
        loss = step_loss(model, next(it))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"warmed up {args.warm} steps: loss {loss.item():.4f}", file=sys.stderr)
    batches = [next(it) for _ in range(args.steps)]
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    work = Path(tempfile.mkdtemp(prefix="bench-lossy-"))
    files = {"lossless": work / "lossless.pt", "lossy": work / "lossy.pt"}
    tierstore.save(state, files["lossless"])
    tierstore.save(state, files["lossy"], codec=tierstore.Delta(keep_bits={"*": args.bits}))
    with zipfile.ZipFile(files["lossy"]) as z:
        m = json.loads(z.read(next(n for n in z.namelist() if n.endswith(".tierstore/manifest.json"))))
    worst = max((r["lossy"]["max_rel_error"] for r in m["records"] if r.get("lossy")), default=0.0)
    losses: dict[str, list[float]] = {}
    for name, f in files.items():
        fresh, _v = bench_codec.load_minilm(args.model_wheel, pretrained=False)
        o = torch.optim.AdamW(fresh.parameters(), lr=2e-5)
        sd = tierstore.load(f)
        fresh.load_state_dict(sd["model"])
        o.load_state_dict(sd["optim"])
        torch.manual_seed(1)
        out = []
        for b in batches:
            loss = step_loss(fresh, b)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            out.append(loss.item())
        losses[name] = out
        print(f"  {name}: mean loss over {args.steps} steps {statistics.mean(out):.5f}", file=sys.stderr)
    a, b = losses["lossless"], losses["lossy"]
    rel_mean = abs(statistics.mean(b) - statistics.mean(a)) / statistics.mean(a)
    rel_last = abs(statistics.mean(b[-10:]) - statistics.mean(a[-10:])) / statistics.mean(a[-10:])
    worst_step = max(abs(x - y) / y for x, y in zip(b, a, strict=True))
    r = {
        "warm_steps": args.warm,
        "steps": args.steps,
        "bits": args.bits,
        "bytes": {k: f.stat().st_size for k, f in files.items()},
        "max_rel_error": worst,
        "bound": 2.0 ** -(args.bits + 1),
        "mean_loss": {k: statistics.mean(v) for k, v in losses.items()},
        "rel_diff_mean": rel_mean,
        "rel_diff_last10": rel_last,
        "rel_diff_worst_step": worst_step,
        "losses": losses,
    }
    lines = [
        f"lossy resume: all-MiniLM-L6-v2 fine-tune, saved after {args.warm} steps, resumed for {args.steps} steps "
        "on the same batches",
        f"lossless file {r['bytes']['lossless'] / 2**20:.1f} MiB; keep_bits={{'*': {args.bits}}} file "
        f"{r['bytes']['lossy'] / 2**20:.1f} MiB ({r['bytes']['lossless'] / r['bytes']['lossy']:.2f}x smaller, "
        "no reference); largest relative error of any element "
        f"{worst:.3g} (bound {r['bound']:.3g})",
        f"mean loss over the {args.steps} steps: lossless {r['mean_loss']['lossless']:.5f}, lossy "
        f"{r['mean_loss']['lossy']:.5f}: {100 * rel_mean:.3f}% apart (target at most 1%); last 10 steps "
        f"{100 * rel_last:.3f}%; worst single step {100 * worst_step:.3f}%",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    for f in files.values():
        f.unlink()
    work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
