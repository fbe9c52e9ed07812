"""The step directories of a tier with a codec: what each one's
``codec.json`` says (:func:`tier_meta`, the steps its files are encoded
against), which steps depend on one (:func:`dependents`), deleting one
without breaking those (:func:`delete_checkpoint`), and what the encoding
saved (:func:`run_stats`, for ``tierstore stats``). The files themselves
are encoded and decoded in :mod:`tierstore._tier_codec`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from tierstore import _metadata
from tierstore._tier_format import (
    CODEC_META,
    MANIFEST,
    MAX_HEADER,
    STEP_DIR,
    SUFFIX,
    encodable,
    read_header,
    storage_records,
)
from tierstore.errors import CorruptFileError, InvalidArgumentError, TierstoreError


def tier_meta(d: Path) -> dict[str, Any] | None:
    """A codec tier's ``codec.json`` of step directory ``d`` (None without)."""
    p = d / CODEC_META
    try:
        if p.stat().st_size > MAX_HEADER:
            raise CorruptFileError(f"{p}: {p.stat().st_size} bytes; not a codec record", path=str(p))
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TierstoreError(f"{p}: {e}") from None
    m, _sealed = _metadata.loads(data, str(p), required=True)
    ref = m.get("reference")
    if ref is not None and not (isinstance(ref, str) and STEP_DIR.match(ref)):
        raise CorruptFileError(f"{p}: bad reference {ref!r:.60}", path=str(p))
    refs = m.get("references")
    if refs is not None and not (
        isinstance(refs, list) and len(refs) <= 2 and all(isinstance(r, str) and STEP_DIR.match(r) for r in refs)
    ):
        raise CorruptFileError(f"{p}: bad references {refs!r:.60}", path=str(p))
    return m


def references_of(meta: dict[str, Any]) -> list[str]:
    """The step directories a tier checkpoint's ``codec.json`` says its
    files may be encoded against (``references``; written before it:
    ``reference`` alone)."""
    refs = meta.get("references")
    if isinstance(refs, list):
        return [r for r in refs if isinstance(r, str)]
    ref = meta.get("reference")
    return [ref] if isinstance(ref, str) else []


def add_references(keep: set[Path]) -> None:
    """Adds to ``keep`` (step directories of one codec tier) what each
    delta in it is encoded against, along its chain (a delta's parent may
    be a delta too). A step whose metadata cannot be read adds nothing."""
    todo = list(keep)
    while todo:
        d = todo.pop()
        meta = None
        with contextlib.suppress(OSError, TierstoreError):
            meta = tier_meta(d)
        for ref in references_of(meta) if meta is not None else ():
            r = d.parent / ref
            if r not in keep:
                keep.add(r)
                todo.append(r)


def step_of(d: Path) -> int | None:
    return int(d.name[5:]) if STEP_DIR.match(d.name) else None


def copy_file(a: Path, b: Path) -> None:
    import shutil

    shutil.copyfile(a, b)


def suppress_errors() -> Any:
    import contextlib

    return contextlib.suppress(OSError, TierstoreError)


def tensor_class(label: str) -> str:
    """The class ``tierstore stats`` counts a tensor under, by its path."""
    if not label:
        return "metadata"
    parts = label.split(".")
    if "exp_avg_sq" in parts:
        return "second moment"
    if "exp_avg" in parts:
        return "first moment"
    if "state" in parts or parts[0] in ("optim", "optimizer"):
        return "other optimizer state"
    return "weights"


def _step_dirs_below(root: Path, depth: int = 3) -> list[Path]:
    if STEP_DIR.match(root.name) and root.is_dir():
        return [root]
    out: list[Path] = []
    if depth == 0 or root.is_symlink() or not root.is_dir():
        return out
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return out
    for p in entries:
        if p.is_dir() and not p.is_symlink() and not p.name.startswith(".tierstore-refs"):
            out += _step_dirs_below(p, depth - 1)
    return out


def run_stats(roots: list[Path]) -> dict[str, Any]:
    """Bytes over a run, per tier directory and tensor class: what the
    checkpoints hold (``raw``) and what is stored (``stored``), from the
    committed step directories under ``roots`` (a Checkpointer's path, a
    tier's path or one step directory). Encoded files are not decoded: their
    headers give each segment's sizes and tensor."""
    tiers: dict[str, dict[str, Any]] = {}
    links: dict[str, dict[str, list[str]]] = {}  # per tier: step -> the steps it references
    for root in roots:
        for d in _step_dirs_below(root):
            if not (d / MANIFEST).is_file():
                continue
            t = tiers.setdefault(
                str(d.parent),
                {"steps": 0, "keyframes": 0, "deltas": 0, "longest_chain": 0, "raw": 0, "stored": 0, "classes": {}},
            )
            t["steps"] += 1
            meta = tier_meta(d)
            if meta is not None:
                t["keyframes" if meta.get("keyframe") else "deltas"] += 1
                links.setdefault(str(d.parent), {})[d.name] = references_of(meta)
            classes: dict[str, list[int]] = t["classes"]

            def add(cls: str, raw: int, stored: int, classes: dict[str, list[int]] = classes) -> None:
                c = classes.setdefault(cls, [0, 0])
                c[0] += raw
                c[1] += stored

            for f in sorted(d.iterdir()):
                if not f.is_file():
                    continue
                size = f.stat().st_size
                if f.name.endswith(SUFFIX):
                    h, _at = read_header(f)
                    add("metadata", 0, size - sum(seg[4] for seg in h["segments"]))
                    for (_a, length, _w, _r, slen), label in zip(h["segments"], h["labels"], strict=True):
                        add(tensor_class(label), length, slen)
                elif encodable(f.name):
                    recs, n, _crc = storage_records(f)
                    held = 0
                    for r in recs:
                        add(tensor_class(r["label"]), r["size"], r["size"])
                        held += r["size"]
                    add("metadata", n - held, n - held)
                else:
                    add("metadata", size, size)
    for tier, refs in links.items():
        # Deltas to decode for the deepest step: 0 for keyframes, else one
        # more than the deepest of its references (a chain of parents).
        depth: dict[str, int] = {}
        for step in refs:
            stack, on_path = [(step, False)], set()
            while stack:  # post-order, without recursion (a damaged record may loop: counted as 0)
                cur, done = stack.pop()
                if cur in depth:
                    continue
                if done:
                    on_path.discard(cur)
                    depth[cur] = 1 + max((depth.get(r, 0) for r in refs[cur] if r in refs), default=-1)
                    continue
                on_path.add(cur)
                stack.append((cur, True))
                stack += [(r, False) for r in refs[cur] if r in refs and r not in depth and r not in on_path]
        tiers[tier]["longest_chain"] = max(depth.values(), default=0)
    for t in tiers.values():
        t["raw"] = sum(c[0] for c in t["classes"].values())
        t["stored"] = sum(c[1] for c in t["classes"].values())
    return {"tiers": tiers}


def dependents(step_dir: Path) -> list[Path]:
    """The committed step directories of the same tier path whose files are
    encoded against ``step_dir`` (they name it in their ``codec.json``)."""
    out: list[Path] = []
    try:
        entries = sorted(step_dir.parent.iterdir())
    except OSError:
        return out
    for d in entries:
        if d == step_dir or step_of(d) is None or d.is_symlink() or not d.is_dir():
            continue
        try:
            meta = tier_meta(d)
        except TierstoreError:
            meta = None
        if meta is not None and step_dir.name in references_of(meta):
            out.append(d)
            continue
        # A step without a readable codec.json may still hold deltas: their headers say.
        if meta is None:
            with suppress_errors():
                for f in d.glob("*" + SUFFIX):
                    if any(r["step_dir"] == step_dir.name for r in read_header(f)[0]["refs"]):
                        out.append(d)
                        break
    return out


def delete_checkpoint(path: str | os.PathLike[str]) -> None:
    """Deletes checkpoint directory ``path`` (a ``step-*`` directory of a
    tier). Refused, with :class:`~tierstore.ReferencedCheckpointError`
    naming them, while deltas of the same tier are encoded against it:
    delete those first (or let retention do it)."""
    from tierstore.errors import ReferencedCheckpointError

    d = Path(path)
    if step_of(d) is None or not d.is_dir() or d.is_symlink():
        raise InvalidArgumentError(f"{d}: not a checkpoint's step directory (step-NNNNNNNNNNNN)")
    deps = dependents(d)
    if deps:
        names = ", ".join(x.name for x in deps)
        raise ReferencedCheckpointError(
            f"{d}: {len(deps)} checkpoint(s) of the tier are deltas against it ({names}); delete them first",
            path=str(d),
            dependents=[str(x) for x in deps],
        )
    import shutil

    # The commit point first: a half-deleted directory is then never taken for a checkpoint.
    (d / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(d)
