"""The demo behind ``make demo``: a small GPT-style model trained for a few
steps on the CPU, its checkpoint (model + AdamW state) saved and loaded with
tierstore and with torch, both ways, with the time each step took.

    python -m tierstore.demo [--dir DIR] [--layers N] [--width D] [--steps S]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tierstore


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one storage, two names
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    con = Console()
    torch.manual_seed(0)
    vocab, ctx = 8192, 64
    model = TinyGPT(vocab, args.width, args.layers, heads=8, ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    nparams = sum(p.numel() for p in model.parameters())
    info = tierstore.info(args.dir or ".")
    con.print(
        f"[bold]tierstore {tierstore.__version__}[/bold] demo: backend {info['backend']}, "
        f"O_DIRECT {'on' if info['path']['direct_io'] else 'off'}; "
        f"TinyGPT with {nparams / 1e6:.1f}M parameters, AdamW"
    )
    data = torch.randint(0, vocab, (8, ctx + 1))
    t0 = time.perf_counter()
    for step in range(args.steps):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        con.print(f"  step {step}: loss {loss.item():.4f}")
    con.print(f"  trained {args.steps} steps in {time.perf_counter() - t0:.2f} s")

    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": args.steps, "loss": loss.item()}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(
        v.numel() * v.element_size()
        for s in opt.state_dict()["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )

    own_dir = args.dir is None
    d = Path(tempfile.mkdtemp(prefix="tierstore-demo-", dir=".")) if own_dir else args.dir
    d.mkdir(parents=True, exist_ok=True)
    try:
        ts_file, pt_file = d / "ckpt.tierstore.pt", d / "ckpt.torch.pt"
        rows = []

        def timed(label: str, fn: Any, cold: bool = False) -> Any:
            dropped = _drop_caches() if cold else False
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            rows.append((label, dt, "cold" if dropped else ("warm" if cold else "")))
            return out

        def torch_save() -> None:
            torch.save(state, pt_file)
            _fsync(pt_file)

        timed("torch.save + fsync", torch_save)
        timed("tierstore.save (durable)", lambda: tierstore.save(state, ts_file))
        a = timed("torch.load", lambda: torch.load(pt_file), cold=True)
        b = timed("tierstore.load (checksums verified)", lambda: tierstore.load(ts_file), cold=True)
        c = timed("torch.load of the tierstore file", lambda: torch.load(ts_file), cold=True)
        e = timed("tierstore.load of the torch file", lambda: tierstore.load(pt_file), cold=True)
        ok = all(_same(state, x) for x in (a, b, c, e))
        b["model"]["head.weight"][0, 0] += 1
        tied = bool(b["model"]["tok.weight"][0, 0] == b["model"]["head.weight"][0, 0])

        table = Table(title=f"checkpoint of {nbytes / 2**20:.0f} MiB (model + AdamW state)")
        table.add_column("operation")
        table.add_column("seconds", justify="right")
        table.add_column("GiB/s", justify="right")
        table.add_column("cache")
        for label, dt, cache in rows:
            table.add_row(label, f"{dt:.3f}", f"{nbytes / 2**30 / dt:.2f}", cache)
        con.print(table)
        con.print(f"identical tensors in all four loads: {'[green]yes[/green]' if ok else '[red]NO[/red]'}")
        con.print(f"tied weights still share one storage after tierstore.load: {'yes' if tied else 'NO'}")
        from tierstore import _archive

        n, _ = _archive.verify(str(ts_file))
        con.print(f"tierstore verify {ts_file.name}: OK, {n} records checked")
        return 0 if ok and tied else 1
    finally:
        if own_dir:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
