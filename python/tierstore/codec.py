"""Compressed and delta-encoded files: ``tierstore.save(..., codec=...)``.

``codec="zstd"`` stores each storage of 64 KiB or more with the ``tsz1``
record codec of the Rust core (``rust/core/src/codec.rs``): chunks of 1 MiB,
byte planes by element width, zstd per plane, raw where coding does not pay,
an xxh3 checksum of every decoded chunk. ``codec=Delta(base="base.pt")``
also predicts each storage from the storage at the same place in ``base``
(same tensor path, dtype and size): the integer difference of the elements'
bit patterns (or their exclusive or, whichever a sample says codes smaller),
and chunks equal to the base's cost nothing. ``tierstore.load`` decodes
transparently and bit-exact.

A compressed file is still a zip archive, but ``torch.load`` must not build
tensors from encoded bytes: its ``data.pkl`` is a guard whose only content is
a call of :func:`tierstore_compressed_file__load_with_tierstore_or_convert_plain`,
which ``torch.load`` refuses by name under ``weights_only=True`` and which
raises :class:`~tierstore.errors.CompressedFileError` (what to do) when run.
The object graph is ``.tierstore/data.pkl``. ``tierstore convert --plain``
writes a plain, torch-compatible copy. docs/FORMAT.md has the format.
"""

from __future__ import annotations

import os
import pickle
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from tierstore import _core, _lossy
from tierstore._metadata import dtype_name
from tierstore.errors import (
    CompressedFileError,
    CorruptFileError,
    InvalidArgumentError,
    MissingRecordError,
    TierstoreError,
)

__all__ = ["Delta", "tierstore_compressed_file__load_with_tierstore_or_convert_plain"]

#: The record codec's name in manifests.
CODEC = "tsz1"
#: Storages smaller than this stay raw: the codec's header and directory
#: would cost more than 0.1% of them.
MIN_BYTES = 64 << 10
#: Where a compressed file keeps its object graph (``data.pkl`` is the guard).
PICKLE_NAME = ".tierstore/data.pkl"
#: Longest chain of references a load follows (a cycle is damage).
MAX_CHAIN = 64
_TRANSFORMS = (None, "none", "isub", "xor", "scaled")
#: What a tier's deltas are encoded against (:class:`Delta`'s ``reference``).
REFERENCES = ("keyframe", "parent", "best")


@dataclass(frozen=True)
class Delta:
    """A delta codec: each storage is encoded against the same storage of a
    reference.

    ``base``: a file to difference against (a pre-trained model for a
    fine-tune's checkpoints, an earlier checkpoint), or a list of candidates
    (``[pretrained, previous]``): each storage is encoded against the
    candidate against which a sample of it (up to 1 MiB from its middle)
    encodes smallest, ties to the first listed; each record names its own.

    ``keyframe_every``: for tiers that keep a series of checkpoints, how
    often one is a keyframe (encoded on its own). ``keyframe_share``: also a
    keyframe as soon as the tier's latest delta stored more than this share
    of its keyframe's stored bytes (``0.8``: a delta that saves less than a
    fifth against a fresh keyframe ends the series; None: every
    ``keyframe_every`` only). ``reference``: what a tier's delta is encoded
    against: ``"keyframe"``, ``"parent"`` (a chain) or ``"best"`` (each
    record against whichever of the two a sample of it encodes smaller
    against).

    ``transform``: ``"isub"``, ``"xor"``, ``"none"`` or ``"scaled"``
    (``isub`` against the reference times a scale, for float32 state that
    decays by a common factor between checkpoints, such as Adam's moments
    of rows that saw no gradient; ``isub`` where no common factor is found);
    None chooses per storage by trial on a sample. ``level``: zstd level.

    ``keep_bits``: lossy, opt-in per tensor class: ``{"exp_avg_sq": 10}``
    rounds the mantissa of every float tensor whose path has that key to 10
    bits (``"*"``: every float tensor), a relative error of at most
    ``2**-(k+1)``, measured and recorded per record (:mod:`tierstore._lossy`);
    everything else stays bit-exact. ``max_rel_error``: the same, given as
    a bound per class (``{"exp_avg_sq": 1e-3}`` keeps the fewest bits whose
    error is within it); a bound tighter than a tensor's dtype represents
    is refused. Each element is rounded from its exact value, never from a
    reconstruction, and a delta is taken against its reference as a
    decoder holds it (rounded), so errors do not grow along a chain."""

    base: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None
    keyframe_every: int = 8
    keyframe_share: float | None = None
    level: int = 1
    transform: str | None = None
    keep_bits: Mapping[str, int] | None = None
    max_rel_error: Mapping[str, float] | None = None
    reference: str = "keyframe"

    def __post_init__(self) -> None:
        _lossy.check_keep_bits(self.keep_bits)
        _lossy.bits_for_bounds(self.max_rel_error)
        if not isinstance(self.keyframe_every, int) or self.keyframe_every < 1:
            raise InvalidArgumentError(f"keyframe_every must be a positive integer, got {self.keyframe_every!r}")
        share = self.keyframe_share
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < float("inf")
        ):
            raise InvalidArgumentError(f"keyframe_share must be a positive number or None, got {share!r}")
        if self.reference not in REFERENCES:
            raise InvalidArgumentError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.reference != "keyframe" and self.keyframe_every > MAX_CHAIN:
            raise InvalidArgumentError(
                f"Delta(reference={self.reference!r}): a chain of deltas is decoded one file after another, "
                f"so keyframe_every must be at most {MAX_CHAIN} (got {self.keyframe_every})"
            )
        _check_level(self.level)
        if self.transform not in _TRANSFORMS:
            raise InvalidArgumentError(
                f"transform must be one of isub, xor, none, scaled or None, got {self.transform!r}"
            )


@dataclass(frozen=True)
class Spec:
    """A resolved codec choice."""

    level: int = 1
    transform: str | None = None
    base: tuple[str, ...] | None = None
    keep_bits: Mapping[str, int] | None = None


def _check_level(level: Any) -> None:
    if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 19:
        raise InvalidArgumentError(f"the zstd level must be an integer from 1 to 19, got {level!r}")


def resolve(codec: Any) -> Spec | None:
    """The codec a ``save`` was asked for: None (raw), ``"zstd"`` or
    ``"zstd:N"`` (level N), or a :class:`Delta`."""
    if codec is None or codec == "raw":
        return None
    if isinstance(codec, Delta):
        base: tuple[str, ...] | None = None
        if codec.base is not None:
            b0 = codec.base
            base = (os.fspath(b0),) if isinstance(b0, (str, os.PathLike)) else tuple(os.fspath(b) for b in b0)
            if not base:
                raise InvalidArgumentError("Delta(base=[]): name at least one base file, or base=None")
            for b in base:
                if not os.path.isfile(b):
                    raise InvalidArgumentError(f"Delta(base={b!r}): no such file")
        bits = {**_lossy.check_keep_bits(codec.keep_bits)}
        for cls, k in _lossy.bits_for_bounds(codec.max_rel_error).items():
            bits[cls] = max(k, bits[cls]) if cls in bits else k  # both asked: the tighter error
        return Spec(codec.level, codec.transform, base, bits)
    if isinstance(codec, str) and (codec == "zstd" or codec.startswith("zstd:")):
        level = 1
        if codec != "zstd":
            try:
                level = int(codec[5:])
            except ValueError:
                raise InvalidArgumentError(f"codec {codec!r}: the level after 'zstd:' must be an integer") from None
        _check_level(level)
        return Spec(level)
    raise InvalidArgumentError(f"unknown codec {codec!r}: use None, 'zstd', 'zstd:LEVEL' or tierstore.Delta(...)")


def tierstore_compressed_file__load_with_tierstore_or_convert_plain(path: str) -> NoReturn:
    """What ``torch.load(weights_only=False)`` of a compressed file calls."""
    raise CompressedFileError(
        f"{path} is a tierstore-compressed file (codec {CODEC}): load it with tierstore.load, or write a plain "
        f"copy that torch.load reads with `tierstore convert --plain {path} PLAIN.pt`",
        path=path,
    )


class _Guard:
    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (tierstore_compressed_file__load_with_tierstore_or_convert_plain, (self.name,))


def guard_pickle(name: str) -> bytes:
    """The ``data.pkl`` of a compressed file (see the module's doc)."""
    return pickle.dumps(_Guard(name), protocol=2)


def element_width(dtype: torch.dtype) -> int:
    """The unit the codec splits into byte planes: the element's size (the
    largest power of two dividing it, at most 8: complex128 as two float64)."""
    size = torch.empty((), dtype=dtype).element_size()
    for w in (8, 4, 2):
        if size % w == 0:
            return w
    return 1


def threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


@dataclass
class Encoded:
    """One storage's encoded record and what the manifest says of it."""

    data: bytes
    fields: dict[str, Any]


def encode_storage(
    st: torch.UntypedStorage,
    dtype: torch.dtype,
    spec: Spec,
    reference: tuple[torch.Tensor, dict[str, Any]] | None,
    keep_bits: int | None = None,
    what: str = "",
) -> Encoded | None:
    """``st`` encoded (None: it stays raw, too small to gain). ``reference``:
    the bytes to predict from and the manifest's reference entry;
    ``keep_bits``: round the mantissa first (lossy)."""
    n = st.nbytes()
    if n < MIN_BYTES:
        return None
    lossy = None
    if keep_bits is not None and dtype in _lossy.MANTISSA:
        flat = torch.empty(0, dtype=dtype).set_(st, 0, (n // dtype.itemsize,))  # type: ignore[call-overload]
        rounded, lossy = _lossy.round_mantissa(flat, keep_bits, what)
        st = rounded.untyped_storage()
    width = element_width(dtype)
    if n % width:
        width = 1
    ref_addr = ref_len = 0
    if reference is not None:
        ref_addr, ref_len = reference[0].data_ptr(), reference[0].numel()
    data, transform, stats = _core.codec_encode(
        st.data_ptr(),
        n,
        width,
        ref_addr,
        ref_len,
        level=spec.level,
        threads=threads(),
        transform=spec.transform if reference is not None else None,
    )
    if len(data) >= n:  # nothing gained: the record stays raw (and exact)
        return None
    raw, coded, dup, same, zero = stats
    fields: dict[str, Any] = {
        "codec": CODEC,
        "transform": transform,
        "decoded_size": n,
        "chunk_bytes": 1 << 20,
        "chunk_kinds": {"raw": raw, "coded": coded, "dup": dup, "same": same, "zero": zero},
        "delta_base": reference[1] if reference is not None else None,
    }
    if lossy is not None:
        fields["lossy"] = lossy
    return Encoded(data, fields)


# ---------------------------------------------------------------------------------------------
# references


class BaseFile:
    """A file deltas are taken against: its storages by tensor path, read
    (and decoded) only when a storage of the same place is encoded."""

    def __init__(self, path: str, out_dir: str) -> None:
        from tierstore import _archive

        self.path = path
        self.rel = os.path.relpath(os.path.abspath(path), os.path.abspath(out_dir))
        self.arch, m, self.offsets = _archive.open_archive(path)
        if m is None:
            raise InvalidArgumentError(
                f"Delta(base={path!r}): the base has no tierstore manifest (a torch.save file); save it once with "
                "tierstore.save to use it as a base"
            )
        self.manifest = m
        self.records = {r["name"]: r for r in m["records"]}
        self.by_path: dict[tuple[Any, ...], dict[str, Any]] = {}
        for t in m.get("tensors", []):
            self.by_path.setdefault(tuple(t["path"]), t)
        self._cache: dict[str, torch.Tensor] = {}

    def match(self, paths: list[tuple[Any, ...]], dtype: torch.dtype, nbytes: int) -> str | None:
        """The base record at the first of ``paths`` holding a storage of the
        same dtype and size."""
        name = dtype_name(dtype)
        for p in paths:
            t = self.by_path.get(p)
            if t is None or t.get("dtype") != name:
                continue
            rec = self.records.get(t.get("record", ""))
            if rec is None or rec.get("kind") != "storage":
                continue
            if rec.get("decoded_size", rec["size"]) == nbytes:
                return str(t["record"])
        return None

    def read(self, records: list[str]) -> None:
        """Reads (and decodes) ``records`` at once, for :meth:`bytes_of`."""
        todo = sorted(set(records) - self._cache.keys())
        if todo:
            self._cache.update(read_decoded(self.path, todo, depth=0))

    def bytes_of(self, record: str) -> tuple[torch.Tensor, dict[str, Any]]:
        self.read([record])
        rec = self.records[record]
        return self._cache[record], {
            "file": self.rel,
            "record": record,
            "crc32": rec["crc32"],
            "size": rec["size"],
        }


def closest_reference(addr: int, nbytes: int, width: int, refs: list[int], spec: Spec, sample: int) -> int:
    """Which of the references ``refs`` (addresses of ``nbytes`` bytes each,
    aligned with the data) to encode the ``nbytes`` at ``addr`` (elements of
    ``width`` bytes) against: the one against which a sample (up to
    ``sample`` bytes from the middle) encodes smallest; ties go to the first."""
    if len(refs) < 2:
        return 0
    length = min(sample, nbytes) // width * width
    off = (nbytes - length) // 2 // width * width
    sizes = []
    for ref in refs:
        data, _t, _s = _core.codec_encode(
            addr + off,
            length,
            width,
            ref + off,
            length,
            level=spec.level,
            threads=threads(),
            transform=spec.transform,
        )
        sizes.append(len(data))
    return min(range(len(sizes)), key=sizes.__getitem__)


def choose_base(
    st: torch.UntypedStorage, dtype: torch.dtype, spec: Spec, candidates: list[tuple[BaseFile, str]]
) -> int:
    """Which of ``candidates`` (a base file and its record for this storage)
    to encode storage ``st`` against: the one against which a sample (up
    to 1 MiB from its middle) encodes smallest; ties go to the first."""
    if len(candidates) < 2:
        return 0
    n = st.nbytes()
    width = element_width(dtype)
    if n % width:
        width = 1
    refs = [bf.bytes_of(rname)[0] for bf, rname in candidates]
    return closest_reference(st.data_ptr(), n, width, [r.data_ptr() for r in refs], spec, 1 << 20)


def resolve_reference(path: str, ref: Any, record: str, override: str | list[str] | None) -> str:
    """The file a record's ``delta_base`` names, confined to the directory
    of ``path`` unless the caller named the base (``override``: a file, or
    a list of them, each taken for the records whose base has its name)."""
    if not isinstance(ref, dict) or not isinstance(ref.get("file"), str) or not isinstance(ref.get("record"), str):
        raise CorruptFileError(f"{path}: record '{record}': bad delta_base {ref!r:.200}", path=path, record=record)
    if isinstance(override, str):
        return override
    if override is not None:
        named = [o for o in override if os.path.basename(o) == os.path.basename(ref["file"])]
        if len(named) != 1:
            raise InvalidArgumentError(
                f"{path}: record '{record}' is a delta against '{ref['file']}'; delta_base names "
                f"{len(named)} files of that name ({', '.join(override)})"
            )
        return named[0]
    rel = ref["file"]
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or "\0" in rel:
        raise CorruptFileError(
            f"{path}: record '{record}' is a delta against '{rel}', outside the file's directory; if that is the "
            "base you mean, name it: tierstore.load(path, delta_base=BASE)",
            path=path,
            record=record,
        )
    return str(Path(path).parent / rel)


# ---------------------------------------------------------------------------------------------
# reading


def is_compressed(m: dict[str, Any] | None) -> bool:
    return m is not None and m.get("codec") is not None


def check_codec(path: str, m: dict[str, Any]) -> None:
    """Refuses a codec this tierstore does not know, by name."""
    codec = m.get("codec")
    if codec != CODEC:
        raise CorruptFileError(
            f"{path}: encoded with codec {codec!r:.40}, which this tierstore does not know (it reads {CODEC!r}); "
            "upgrade tierstore",
            path=path,
        )
    for r in m["records"]:
        c = r.get("codec", "raw")
        if c not in ("raw", None, CODEC):
            raise CorruptFileError(
                f"{path}: record '{r['name']}': codec {c!r:.40} is not one this tierstore knows ({CODEC!r})",
                path=path,
                record=r["name"],
            )


def _read_stored(
    path: str, names: list[str] | None, *, depth: int, verify: bool, seen: frozenset[str]
) -> tuple[str, dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """The stored bytes (uint8 tensors, checked against their CRC-32) of the
    storage records ``names`` of ``path`` (None: all), not decoded; with the
    file's real path and its manifest's records."""
    from tierstore import _archive
    from tierstore._engine import get_engine

    real = os.path.realpath(path)
    if depth > MAX_CHAIN or real in seen:
        raise CorruptFileError(
            f"{path}: its chain of delta references is longer than {MAX_CHAIN} or loops back to itself",
            path=path,
        )
    arch, m, offsets = _archive.open_archive(path)
    recs = {} if m is None else {r["name"]: r for r in m["records"]}
    if names is None:
        names = [n for n in arch.records if n.startswith("data/")]
    if m is not None and is_compressed(m):
        check_codec(path, m)
    for n in names:
        if n not in arch.records:
            raise MissingRecordError(f"{path}: missing record '{arch.full(n)}'", path=path, record=arch.full(n))
    specs = []
    for n in names:
        want = recs.get(n, {}).get("crc32") if verify else None
        if want is None and verify:
            want = arch.records[n].crc32
        specs.append((arch.full(n), offsets[n], arch.records[n].size, want))
    pending = _core.start_read(get_engine(), path, specs, verify=verify)
    pending.wait(None)
    out: dict[str, torch.Tensor] = {}
    for n, buf in zip(names, pending.buffers, strict=True):
        out[n] = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return real, recs, out


#: A record's stored bytes with what decoding them needs: (file, record name,
#: manifest record, stored bytes, its reference: another link, raw bytes, or None).
_Link = tuple[str, str, dict[str, Any], torch.Tensor, Any]


def read_decoded(
    path: str,
    names: list[str] | None,
    *,
    depth: int = 0,
    verify: bool = True,
    delta_base: str | list[str] | None = None,
    seen: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The decoded bytes (uint8 tensors) of the storage records ``names`` of
    ``path`` (None: all), with the references they need read likewise. A
    delta whose references are coded too is decoded chunk by chunk down its
    chain (a reference is never decoded whole into memory of its own)."""
    links = _read_links(path, names, depth=depth, verify=verify, delta_base=delta_base, seen=seen)
    return {n: _decode_link(link) for n, link in links.items()}


def _read_links(
    path: str,
    names: list[str] | None,
    *,
    depth: int,
    verify: bool,
    delta_base: str | list[str] | None,
    seen: frozenset[str],
) -> dict[str, _Link]:
    real, recs, stored = _read_stored(path, names, depth=depth, verify=verify, seen=seen)
    coded = {n: recs[n] for n in stored if recs.get(n, {}).get("codec") == CODEC}
    refs = _references(path, coded, depth, verify, delta_base, seen | {real})
    return {n: (path, n, recs.get(n, {}), t, refs.get(n) if n in coded else None) for n, t in stored.items()}


def _decode_link(link: _Link) -> torch.Tensor:
    """The decoded bytes of one link: stored bytes that are not coded as
    they are; a chain of coded links in one pass where the codec can; else
    its reference decoded first, then the link against it."""
    path, name, rec, t, ref = link
    if rec.get("codec") != CODEC:
        return t
    chain = [link]
    while isinstance(chain[-1][4], tuple) and chain[-1][4][2].get("codec") == CODEC:
        chain.append(chain[-1][4])
    if len(chain) > 1 and chain[-1][4] is None:
        out = _empty_decoded(path, name, rec, t)
        try:
            if out.numel() == 0 or _core.codec_decode_chain(
                [(c[3].data_ptr() if c[3].numel() else 1, c[3].numel()) for c in chain],
                out.data_ptr(),
                out.numel(),
                threads=threads(),
                path=path,
                record=name,
            ):
                return out
        except TierstoreError:
            pass  # decoded again level by level below, so that the error names the damaged file and record
    ref_t = _decode_link(ref) if isinstance(ref, tuple) else ref
    return decode_record(path, name, rec, t, ref_t)


def _references(
    path: str,
    recs: dict[str, dict[str, Any]],
    depth: int,
    verify: bool,
    delta_base: str | list[str] | None,
    seen: frozenset[str],
) -> dict[str, Any]:
    """The reference of every record in ``recs`` that has one, as a link
    (its stored bytes, not decoded yet): each base file opened once, its
    records read together, each checked to be the one the record was
    encoded against."""
    from tierstore import _archive

    wanted: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for n, rec in recs.items():
        ref = rec.get("delta_base")
        if ref is not None:
            wanted.setdefault(resolve_reference(path, ref, n, delta_base), []).append((n, ref))
    out: dict[str, Any] = {}
    for base, items in wanted.items():
        if not os.path.isfile(base):
            n = items[0][0]
            raise MissingRecordError(
                f"{path}: record '{n}' is a delta against {base}, which does not exist", path=path, record=n
            )
        _a, bm, _o = _archive.open_archive(base)
        brecs = {r.get("name"): r for r in (bm or {}).get("records", [])}
        for n, ref in items:
            brec = brecs.get(ref["record"])
            if brec is None or brec.get("crc32") != ref.get("crc32") or brec.get("size") != ref.get("size"):
                raise CorruptFileError(
                    f"{path}: record '{n}' is a delta against record '{ref['record']}' of {base}, which is not the "
                    f"one it was encoded against (its size or CRC-32 changed)",
                    path=path,
                    record=n,
                )
        names = sorted({ref["record"] for _n, ref in items})
        got = _read_links(base, names, depth=depth + 1, verify=verify, delta_base=None, seen=seen)
        for n, ref in items:
            link = got[ref["record"]]
            out[n] = link if link[2].get("codec") == CODEC else link[3]
    return out


def _empty_decoded(path: str, name: str, rec: dict[str, Any], stored: torch.Tensor) -> torch.Tensor:
    """Room for record ``name``'s decoded bytes, its ``decoded_size`` checked
    first: the codec's directory bounds what a record can decode to (chunks
    of at most 4 MiB, 32 bytes each), so a size beyond that is damage, not a
    reason to allocate."""
    size = rec.get("decoded_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptFileError(f"{path}: record '{name}': bad decoded_size {size!r:.40}", path=path, record=name)
    if size > (stored.numel() // _core.CODEC_ENTRY) * (4 << 20):
        raise CorruptFileError(
            f"{path}: record '{name}': decoded_size {size} is more than its {stored.numel()} stored bytes can hold",
            path=path,
            record=name,
        )
    return torch.empty(size, dtype=torch.uint8)


def decode_record(
    path: str, name: str, rec: dict[str, Any], stored: torch.Tensor, ref_t: torch.Tensor | None
) -> torch.Tensor:
    """Record ``name`` of ``path`` decoded from its ``stored`` bytes (and its
    decoded reference, where it has one)."""
    out = _empty_decoded(path, name, rec, stored)
    size = out.numel()
    ref_addr = 0
    if ref_t is not None:
        # An empty reference still says "there is one" to the decoder.
        ref_addr = ref_t.data_ptr() if ref_t.numel() else 1
    _core.codec_decode(
        stored.data_ptr() if stored.numel() else 0,
        stored.numel(),
        out.data_ptr() if size else 0,
        size,
        ref_addr,
        ref_t.numel() if ref_t is not None else 0,
        threads=threads(),
        path=path,
        record=name,
    )
    return out


def stored_crc(data: bytes) -> int:
    return zlib.crc32(data)


# ---------------------------------------------------------------------------------------------
# tierstore convert --plain


def convert_plain(src: str, dst: str, *, delta_base: str | None = None, durable: bool = True) -> int:
    """Writes ``dst``: ``src`` with every record decoded, a plain file that
    ``torch.load`` reads (record by record: nothing is unpickled). Returns
    the number of storages written."""
    import json

    from tierstore import _archive, manifest
    from tierstore._engine import get_engine

    arch, m, offsets = _archive.open_archive(src)
    if m is None:
        raise InvalidArgumentError(f"{src}: a torch.save file is plain already")
    compressed = is_compressed(m)
    if compressed:
        check_codec(src, m)
    pk = PICKLE_NAME if compressed else "data.pkl"
    if pk not in arch.records:
        raise MissingRecordError(f"{src}: missing record '{arch.full(pk)}'", path=src, record=arch.full(pk))

    def small(rel: str) -> bytes:
        rec = arch.records[rel]
        data = _archive.load_small(arch, offsets[rel], rec.size, rel)
        _archive.check_crc(src, arch.full(rel), data, rec.crc32)
        return data

    decoded = read_decoded(src, None, delta_base=delta_base)
    old = {r["name"]: r for r in m["records"]}
    prefix = arch.prefix or "archive"
    skip = {"data.pkl", PICKLE_NAME, manifest.MANIFEST_NAME, manifest.CHUNKS_NAME}
    metas = [("data.pkl", small(pk))]
    metas += [(rel, small(rel)) for rel in arch.records if not rel.startswith("data/") and rel not in skip]
    w = _core.create_writer(get_engine(), dst, align=int(m.get("alignment", 4096)), durable=durable)
    try:
        for name, t in decoded.items():
            if t.numel():
                w.add_memory(f"{prefix}/{name}", t.data_ptr(), t.numel(), t.untyped_storage())
            else:
                w.add_bytes(f"{prefix}/{name}", b"")
        w.start_data()
        w.wait_data(None)
        for rel, data in metas:
            w.add_bytes(f"{prefix}/{rel}", data, 64)
        crcs = {e.name: e.crc32 for e in w.entries() if e.crc32 is not None}
        for rel, data in metas:
            crcs[f"{prefix}/{rel}"] = zlib.crc32(data)
        records = []
        for e in w.entries():
            rel = e.name[len(prefix) + 1 :]
            rec: dict[str, Any] = {"name": rel, "offset": e.data_offset, "size": e.size, "crc32": crcs[e.name]}
            o = old.get(rel, {})
            if rel.startswith("data/"):
                rec.update({k: o[k] for k in ("kind", "dtype", "numel", "location") if k in o})
                rec["codec"] = "raw"
                rec["delta_base"] = None
            else:
                rec["kind"] = "pickle" if rel == "data.pkl" else "meta"
            records.append(rec)
        built = manifest.build(
            archive=prefix,
            alignment=int(m.get("alignment", 4096)),
            records_json=json.dumps(records, separators=(",", ":")),
            tensors_json=json.dumps(m.get("tensors", []), separators=(",", ":")),
            writer=str(m.get("writer", "tierstore")),
            torch_version=str(m.get("torch_version", torch.__version__)),
        )
        w.add_bytes(f"{prefix}/{manifest.MANIFEST_NAME}", built, 64)
        w.commit()
    except BaseException:
        w.abort()
        raise
    return len(decoded)
