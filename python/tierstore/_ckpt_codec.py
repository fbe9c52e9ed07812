"""The Checkpointer's side of tiers with a codec: which keyframe a new
checkpoint is encoded against, and the raw copies of keyframes kept for
encoding (the encoded format itself: :mod:`tierstore._tier_codec`)."""

from __future__ import annotations

import os
from pathlib import Path

from tierstore._tier_codec import SUFFIX, Decoder, encodable, fingerprint
from tierstore._tier_steps import copy_file, step_of, suppress_errors, tier_meta
from tierstore.errors import TierstoreError
from tierstore.shardmeta import MANIFEST, read_manifest


def plan_references(
    tier_dir: Path, step: int, every: int, world: int, mode: str = "keyframe", share: float | None = None
) -> list[Path]:
    """The step directories of ``tier_dir`` that a new checkpoint of
    ``step`` may be encoded against, by ``mode`` (``Delta.reference``):
    ``"keyframe"``: the latest keyframe; ``"parent"``: the latest checkpoint
    (a chain back to the keyframe); ``"best"``: both (each rank's file picks
    one). Empty when the new checkpoint is a keyframe: there is none yet,
    ``every`` checkpoints have been stored since the last one, the latest
    delta stored more than ``share`` of the keyframe's stored bytes, or it
    was saved by another number of ranks. Every rank computes the same answer
    from the tier's committed directories."""
    rows: list[tuple[int, Path, bool]] = []
    try:
        entries = list(tier_dir.iterdir())
    except OSError:
        return []
    for d in entries:
        s = step_of(d)
        if s is None or s >= step or not (d / MANIFEST).is_file():
            continue
        try:
            meta = tier_meta(d)
        except TierstoreError:
            continue
        if meta is not None:
            rows.append((s, d, bool(meta.get("keyframe"))))
    rows.sort()
    keys = [i for i, r in enumerate(rows) if r[2]]
    if not keys or every <= 1:
        return []
    since = len(rows) - 1 - keys[-1]
    if since + 1 >= every:
        return []
    key, parent = rows[keys[-1]][1], rows[-1][1]
    if share is not None and parent != key and stored_bytes(parent) > share * stored_bytes(key):
        return []
    want = {"keyframe": [key], "parent": [parent], "best": [key, parent]}[mode]
    out: list[Path] = []
    for ref in dict.fromkeys(want):
        try:
            if read_manifest(ref)["world_size"] != world:
                return []
        except TierstoreError:
            return []
        out.append(ref)
    return out


def stored_bytes(d: Path) -> int:
    """The bytes checkpoint ``d`` stores encoded (its ``.tsd`` files, every
    rank's: the same sum on every rank, from the committed directory)."""
    total = 0
    try:
        for f in d.iterdir():
            if f.name.endswith(SUFFIX):
                total += f.stat().st_size
    except OSError:
        pass
    return total


def expected_files(d: Path) -> dict[str, tuple[int, int]]:
    """Each data and objects file of checkpoint ``d`` with the length and
    manifest CRC-32 its ``manifest.json`` records."""
    m = read_manifest(d)
    out = {f["name"]: (f["bytes"], f["manifest_crc32"]) for f in m.get("files", ()) if "manifest_crc32" in f}
    for o in m.get("object_files", ()):
        if "manifest_crc32" in o:
            out[o["name"]] = (o["bytes"], o["manifest_crc32"])
    return out


def reference_file(ref_dir: Path, name: str) -> str | None:
    """The file of checkpoint ``ref_dir`` that file ``name`` (of the same
    rank: ``rank-00003.<id>.pt``, ``objects-00003.<id>.pt``) is encoded
    against, by its raw name."""
    head = name.split(".", 1)[0] + "."
    try:
        names = os.listdir(ref_dir)
    except OSError:
        return None
    for n in sorted(names):
        raw = n.removesuffix(SUFFIX)
        if raw.startswith(head) and encodable(raw):
            return raw
    return None


class ReferenceCache:
    """Raw copies of the current keyframe's files of one rank, for encoding
    deltas against them: a keyframe's local file is linked here when it is
    encoded (no copy on the same file system), so that the local tier's
    retention does not take it; when absent (a restart), the keyframe is
    decoded from the tier. Each file is checked against the keyframe's
    manifest.json before a delta is encoded against it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def keep(self, step_dir: str, src: Path, also: str | None = None) -> None:
        """Links (or copies) raw file ``src`` as ``step_dir``'s, and drops
        this rank's files of other checkpoints (but ``also``'s: the
        keyframe, while its deltas are encoded against it too)."""
        d = self.root / step_dir
        d.mkdir(parents=True, exist_ok=True)
        dst = d / src.name
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            import shutil

            shutil.copyfile(src, dst)
        head = src.name.split(".", 1)[0] + "."
        for old in self.root.iterdir() if self.root.is_dir() else ():
            if old.name in (step_dir, also) or not old.is_dir():
                continue
            for f in old.iterdir():
                if f.name.startswith(head):
                    f.unlink(missing_ok=True)
            with suppress_errors():
                old.rmdir()

    def raw(self, ref_dir: Path, name: str, want: tuple[int, int]) -> Path | None:
        """Raw file ``name`` of keyframe ``ref_dir`` with fingerprint
        ``want``: from the cache, else decoded from the tier into it. None
        when neither gives that file."""
        cached = self.root / ref_dir.name / name
        if cached.is_file():
            with suppress_errors():
                if fingerprint(cached) == want:
                    return cached
        src = ref_dir / name
        if src.is_file():
            with suppress_errors():
                if fingerprint(src) == want:
                    self.keep(ref_dir.name, src)
                    return self.root / ref_dir.name / name
        enc = ref_dir / (name + SUFFIX)
        if not enc.is_file():
            return None
        dec = Decoder()
        try:
            out = dec.raw(enc)
            dec.ensure_all(out)
            if fingerprint(out) != want:
                return None
            cached.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out, cached) if out.stat().st_dev == cached.parent.stat().st_dev else copy_file(out, cached)
            return cached
        except (OSError, TierstoreError):
            return None
        finally:
            dec.close()
