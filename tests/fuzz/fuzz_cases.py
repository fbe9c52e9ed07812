"""Inputs, mutations and load operations of the fuzz campaign (see campaign.py).

Everything here runs in a worker process (or in the replaying process): a
case is ``(kind, seed)``. From the seed alone it builds a checkpoint of that
kind, keeps what was saved as the reference, picks a mutator, damages or
crafts the checkpoint, runs every load path over it and classifies each
outcome against the reference.

Mutators carry two properties:

- ``oracle``: ``"same"`` when a load must return exactly what was saved or
  raise a ``TierstoreError`` (damage, and crafted files that disagree with
  themselves or with the checkpoint's other files); ``"safe"`` when the file
  is crafted to say something else on purpose (a hostile or bomb pickle): any
  result is acceptable as long as nothing runs, hangs, leaks or blows up.
- ``sealed``: the mutation recomputes the checksums an attacker can recompute.
  ``cli_ok_on_damage`` is judged only for unsealed mutations (a failing disk
  or a careless copy): ``verify`` checks integrity, not intent.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import struct
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import tierstore
import tierstore.checkpointer
import tierstore.dcp
import tierstore.sharded
from tierstore import Layout, _gc, _load, attach, cli
from tierstore.errors import TierstoreError, UnsafeObjectError
from tierstore.layout import zero_partition

# 8 random bytes: the secret planted outside every checkpoint (and the fill of
# every "foreign" tensor) is made of them; finding them in a result means that
# something outside the checkpoint was read and returned.
MAGIC = bytes.fromhex("d71f935ca26e0be4")
SECRET_BYTES = MAGIC * 8192

# Outcome classes (campaign.py keeps the same names).
EQUAL = "equal"
CLEAN = "error_clean"
ACCEPTED = "accepted"
SILENT = "silent_difference"
CLI_OK = "cli_ok_on_damage"
OTHER = "other_error"
MEMORY = "memory_limit"
CODE = "code_executed"
OUTSIDE = "read_outside"
CONTROL = "control_failed"
HARNESS = "harness_error"
# The cyclic collector left switched off (or a pause left open) after a case:
# a load's error path that skipped its pause's end would leave every later
# allocation of the process uncollected.
GC_OFF = "collector_left_off"
# A load's reader thread (a sharded load reads several files at once) still
# running after the case: it could still be writing into the caller's tensors.
READS_LEFT = "reads_left_running"

PRECEDENCE = [
    CODE,
    OUTSIDE,
    "crash",
    "hang",
    MEMORY,
    SILENT,
    CLI_OK,
    GC_OFF,
    READS_LEFT,
    CONTROL,
    HARNESS,
    OTHER,
    CLEAN,
    ACCEPTED,
    EQUAL,
]

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
]

# An op that allocates more than this for inputs of a few KiB is reported as
# a memory_limit outcome (the files do not hold that much).
BLOWUP_MIB = 1024


# ----------------------------------------------------------------------------------------------
# small helpers


def worst(classes: list[str]) -> str:
    return min(classes, key=PRECEDENCE.index) if classes else EQUAL


def fmt_exc(e: BaseException) -> str:
    msg = str(e).replace("\n", " ")
    return f"{type(e).__module__}.{type(e).__qualname__}: {msg[:400]}"


def hwm_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_hwm() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rand_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = math.prod(shape)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape).clone()


def magic_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s dtype and shape whose bytes are the MAGIC pattern."""
    n = t.numel() * t.element_size()
    if n == 0:
        return t.clone()
    raw = torch.frombuffer(bytearray((MAGIC * (n // 8 + 1))[:n]), dtype=torch.uint8)
    return raw.view(t.dtype).reshape(t.shape).clone()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def compare(got: Any, want: Any, path: str = "", *, ordered: bool = True, strides: bool = False) -> str | None:
    """None when ``got`` equals ``want`` bit for bit (tensors: dtype, shape,
    bytes, and with ``strides`` the strides); otherwise where they differ."""
    try:
        return _compare(got, want, path or "<root>", ordered, strides)
    except Exception as e:  # a result so odd that comparing it fails
        return f"{path or '<root>'}: comparison failed: {fmt_exc(e)}"


def _compare(got: Any, want: Any, path: str, ordered: bool, strides: bool) -> str | None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if got.device.type != "cpu":
            return f"{path}: tensor on {got.device}"
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{path}: {got.dtype}{tuple(got.shape)} instead of {want.dtype}{tuple(want.shape)}"
        if strides and (got.stride() != want.stride() or got.storage_offset() != want.storage_offset()):
            return (
                f"{path}: stride {got.stride()}+{got.storage_offset()} instead of "
                f"{want.stride()}+{want.storage_offset()}"
            )
        if want.numel() and tensor_bytes(got) != tensor_bytes(want):
            a, b = tensor_bytes(got), tensor_bytes(want)
            at = next(i for i in range(len(a)) if a[i] != b[i])
            return f"{path}: bytes differ (first at byte {at} of {len(a)})"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{path}: expected a dict, got {type(got).__name__}"
        if (list(got) != list(want)) if ordered else (set(got) != set(want)):
            return f"{path}: keys {sorted(map(str, got))[:12]} instead of {sorted(map(str, want))[:12]}"
        for k in want:
            d = _compare(got[k], want[k], f"{path}.{k}", ordered, strides)
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            n = len(got) if hasattr(got, "__len__") else "?"
            return f"{path}: {type(got).__name__} of {n} instead of {type(want).__name__} of {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            d = _compare(g, w, f"{path}[{i}]", ordered, strides)
            if d:
                return d
        return None
    if type(got) is not type(want) or got != want:
        return f"{path}: {str(got)[:60]!r} instead of {str(want)[:60]!r}"
    return None


def shared_storage_diff(got: Any, want: Any) -> str | None:
    """Tensors that share a storage in ``want`` must share one in ``got``."""
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def walk(g: Any, w: Any, p: str) -> None:
        if isinstance(w, torch.Tensor):
            pairs.append((p, g, w))
        elif isinstance(w, dict):
            for k in w:
                walk(g[k], w[k], f"{p}.{k}")
        elif isinstance(w, (list, tuple)):
            for i, (a, b) in enumerate(zip(g, w, strict=True)):
                walk(a, b, f"{p}[{i}]")

    walk(got, want, "")
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for p, g, w in pairs:
        if w.untyped_storage().nbytes():
            groups.setdefault(w.untyped_storage().data_ptr(), []).append((p, g))
    for members in groups.values():
        ptrs = {g.untyped_storage().data_ptr() for _p, g in members}
        if len(ptrs) > 1:
            return f"{', '.join(p for p, _g in members)} shared a storage when saved and do not when loaded"
    return None


def find_magic(value: Any, limit: int = 200_000) -> str | None:
    """Where the MAGIC bytes appear in a loaded value (tensor storages, bytes)."""
    stack: list[tuple[str, Any]] = [("<root>", value)]
    seen: set[int] = set()
    n = 0
    while stack and n < limit:
        p, v = stack.pop()
        n += 1
        if isinstance(v, torch.Tensor):
            try:
                if v.device.type != "cpu":
                    continue
                s = v.untyped_storage()
                if 0 < s.nbytes() <= 64 << 20 and MAGIC in torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes():
                    return p
            except Exception:
                continue
            continue
        if isinstance(v, (bytes, bytearray)):
            if MAGIC in v:
                return p
            continue
        if id(v) in seen:
            continue
        if isinstance(v, dict):
            seen.add(id(v))
            stack.extend((f"{p}.{k}", x) for k, x in v.items())
        elif isinstance(v, (list, tuple, set, frozenset)):
            seen.add(id(v))
            stack.extend((f"{p}[{i}]", x) for i, x in enumerate(v))
    return None


def flip_bits(path: Path, rng: random.Random, lo: int = 0, hi: int | None = None, n: int | None = None) -> str:
    data = bytearray(path.read_bytes())
    hi = len(data) if hi is None else min(hi, len(data))
    if hi <= lo:
        lo, hi = 0, len(data)
    if not data:
        return "empty file"
    n = n or rng.choice([1, 1, 1, 2, 3, 8])
    where = []
    for _ in range(n):
        i = rng.randrange(lo, hi)
        b = rng.randrange(8)
        data[i] ^= 1 << b
        where.append(f"{i}.{b}")
    path.write_bytes(bytes(data))
    return f"flipped bits {', '.join(where)} of {len(data)} bytes"


def truncate(path: Path, rng: random.Random, points: list[int] | None = None) -> str:
    size = path.stat().st_size
    choices = [0, max(size - 1, 0), max(size - 22, 0), size // 2, rng.randrange(size + 1)]
    if points:
        choices += [p for p in points if 0 <= p < size] * 2
    n = rng.choice(choices)
    os.truncate(path, n)
    return f"cut to {n} of {size} bytes"


def extend(path: Path, rng: random.Random) -> str:
    n = rng.choice([1, 22, 100, 4096])
    tail = rng.choice([b"\0" * n, bytes(rng.randrange(256) for _ in range(n)), (b"PK\x05\x06" + b"\0" * 18)])
    with open(path, "ab") as f:
        f.write(tail)
    return f"appended {len(tail)} bytes"


def byte_damage(path: Path, rng: random.Random, how: str) -> str | None:
    """``path`` damaged as ``how`` says (``flip``, ``truncate`` or ``zero``:
    :func:`flip_bits`, :func:`truncate` without extra points,
    :func:`zero_block`) and what was done; None for another ``how``."""
    if how == "flip":
        return flip_bits(path, rng)
    if how == "truncate":
        return truncate(path, rng)
    if how == "zero":
        return zero_block(path, rng)
    return None


def zero_block(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    blocks = max(1, -(-size // 4096))
    b = rng.randrange(blocks)
    data = bytearray(path.read_bytes())
    data[b * 4096 : (b + 1) * 4096] = bytes(len(data[b * 4096 : (b + 1) * 4096]))
    path.write_bytes(bytes(data))
    return f"zeroed 4 KiB block {b} of {blocks}"


def make_fifo(path: Path) -> str:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return f"{path.name} replaced by a FIFO"


def replace_by_symlink(path: Path, target: str | Path) -> str:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)
    return f"{path.name} replaced by a symlink to {target}"


# ----------------------------------------------------------------------------------------------
# zip archives: a map of the structures, and a writer for crafted archives


@dataclasses.dataclass
class ZipEntry:
    name: str
    cd_off: int  # central directory entry
    hdr_off: int  # local header
    data_off: int
    size: int
    crc: int


@dataclasses.dataclass
class ZipMap:
    entries: list[ZipEntry]
    cd_off: int
    cd_size: int
    eocd_off: int
    length: int

    def by_suffix(self, suffix: str) -> list[ZipEntry]:
        return [e for e in self.entries if e.name.endswith(suffix)]

    def storages(self) -> list[ZipEntry]:
        return [e for e in self.entries if "/data/" in e.name and not e.name.split("/")[-1].startswith(".")]


def zip_map(data: bytes) -> ZipMap | None:
    e = data.rfind(b"PK\x05\x06")
    if e < 0 or e + 22 > len(data):
        return None
    _sig, _d, _cd, _nh, count, cd_size, cd_off, _cl = struct.unpack_from("<IHHHHIIH", data, e)
    if cd_off == 0xFFFFFFFF or count == 0xFFFF:
        loc = data.rfind(b"PK\x06\x07", 0, e)
        if loc < 0:
            return None
        z64 = struct.unpack_from("<Q", data, loc + 8)[0]
        if z64 + 56 > len(data):
            return None
        count, cd_size, cd_off = struct.unpack_from("<QQQ", data, z64 + 32)
    entries = []
    p = cd_off
    try:
        for _ in range(count):
            f = struct.unpack_from("<IHHHHHHIIIHHHHHII", data, p)
            if f[0] != 0x02014B50:
                return None
            crc, _cs, size, nlen, xlen, clen, hdr = f[7], f[8], f[9], f[10], f[11], f[12], f[16]
            name = data[p + 46 : p + 46 + nlen].decode("utf-8", "replace")
            if size == 0xFFFFFFFF or hdr == 0xFFFFFFFF:
                x = data[p + 46 + nlen : p + 46 + nlen + xlen]
                q = 0
                while q + 4 <= len(x):
                    tag, ln = struct.unpack_from("<HH", x, q)
                    if tag == 1:
                        vals = list(struct.unpack_from("<" + "Q" * (ln // 8), x, q + 4))
                        if size == 0xFFFFFFFF:
                            size = vals.pop(0)
                            vals.pop(0)
                        if hdr == 0xFFFFFFFF and vals:
                            hdr = vals.pop(0)
                    q += 4 + ln
            lh = struct.unpack_from("<IHHHHHIIIHH", data, hdr)
            entries.append(ZipEntry(name, p, hdr, hdr + 30 + lh[9] + lh[10], size, crc))
            p += 46 + nlen + xlen + clen
    except struct.error:
        return None
    return ZipMap(entries, cd_off, cd_size, e, len(data))


def write_zip(path: Path, records: list[tuple[str, bytes]]) -> None:
    """A stored (uncompressed) zip archive like torch writes: storages on
    4096-byte boundaries, other records on 64-byte ones, correct CRCs."""
    out = bytearray()
    cd = bytearray()
    for name, data in records:
        nb = name.encode()
        align = 4096 if "/data/" in name else 64
        base = len(out) + 30 + len(nb) + 4
        pad = (-base) % align
        extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad
        crc = zlib.crc32(data)
        hdr_off = len(out)
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(nb), len(extra)
        )
        out += nb + extra + data
        cd += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50, 0x031E, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(nb), 0, 0, 0, 0,
            0o100644 << 16, hdr_off,
        )  # fmt: skip
        cd += nb
    cd_off = len(out)
    out += cd
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), len(cd), cd_off, 0)
    path.write_bytes(bytes(out))


def zip_records(data: bytes, zm: ZipMap) -> list[tuple[str, bytes]]:
    return [(e.name, data[e.data_off : e.data_off + e.size]) for e in zm.entries]


def _reseal_inner_manifest(path: Path, edit: Callable[[bytearray], str | None]) -> tuple[str, int] | None:
    """Applies ``edit`` in place (same length) to the text of the file's own
    ``.tierstore/manifest.json`` record and fixes that record's CRC in the
    zip directory and local header: a forger who knows the zip format.
    ``edit`` returns what it changed, or None to leave the file alone.
    Returns (what changed, the record's new CRC-32), or None."""
    data = bytearray(path.read_bytes())
    zm = zip_map(bytes(data))
    ents = zm.by_suffix(".tierstore/manifest.json") if zm else []
    if not ents:
        return None
    e = ents[0]
    text = bytearray(data[e.data_off : e.data_off + e.size])
    what = edit(text)
    if what is None:
        return None
    data[e.data_off : e.data_off + e.size] = text
    crc = zlib.crc32(bytes(text))
    struct.pack_into("<I", data, e.cd_off + 16, crc)
    struct.pack_into("<I", data, e.hdr_off + 14, crc)
    path.write_bytes(bytes(data))
    return what + " (record CRC fixed)", crc


def inner_manifest_digit(path: Path, rng: random.Random) -> tuple[str, int] | None:
    """Changes one digit in the file's own manifest record (in place, same
    length) and fixes its CRC. Returns (what changed, the record's new
    CRC-32), or None without a manifest."""

    def edit(text: bytearray) -> str | None:
        digits = [i for i, c in enumerate(text) if 48 <= c <= 57]
        if not digits:
            return None
        i = rng.choice(digits)
        old = text[i]
        leading = (i == 0 or not 48 <= text[i - 1] <= 57) and i + 1 < len(text) and 48 <= text[i + 1] <= 57
        text[i] = rng.choice([c for c in b"0123456789" if c != old and not (leading and c == 48)])
        around = bytes(text[max(0, i - 30) : i + 6]).decode("utf-8", "replace")
        return f"its manifest record: digit {chr(old)} -> {chr(text[i])} in ...{around}..."

    return _reseal_inner_manifest(path, edit)


def inner_chunk_size(path: Path, rng: random.Random) -> tuple[str, int] | None:
    """Forges the chunk size of one record's checksum table in the file's own
    manifest (``"chunks":{"size":512`` to another value of three digits, in
    place) and fixes that record's CRC in the zip: the table then describes
    chunks it was not computed over (a size whose count no longer matches
    must be refused; one that still matches must not let a wrong byte
    through). Returns (what changed, the record's new CRC-32), or None."""

    def edit(text: bytearray) -> str | None:
        key = b'"chunks":{"size":'
        spots = [m.end() for m in re.finditer(re.escape(key) + rb"\d{3}[,}]", bytes(text))]
        if not spots:
            return None
        i = rng.choice(spots) - 1 - 3
        old = bytes(text[i : i + 3])
        sizes = [v for v in (100, 256, 511, 513, 999, rng.randrange(100, 1000)) if str(v).encode() != old]
        new = str(rng.choice(sizes))
        text[i : i + 3] = new.encode()
        return f"its manifest record: a chunk table's size {old.decode()} -> {new}"

    return _reseal_inner_manifest(path, edit)


def inner_key_paths(path: Path, rng: random.Random) -> tuple[str, int] | None:
    """Forges the ``key_paths`` of the file's own manifest in place (same
    length): all of them dropped (the mapping blanked to ``{}`` and spaces),
    or a digit inside changed; fixes the record's CRC in the zip directory
    and local header. Returns (what changed, the new CRC), or None when the
    file records no key path."""

    def edit(text: bytearray) -> str | None:
        at = text.find(b'"key_paths":{')
        if at < 0 or text[at + 13 : at + 14] == b"}":
            return None
        start, depth, i = at + 12, 0, at + 12
        while i < len(text):
            depth += {ord("{"): 1, ord("}"): -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        digits = [j for j in range(start, i) if 48 <= text[j] <= 57]
        if digits and rng.random() < 0.5:
            j = rng.choice(digits)
            old = text[j]
            text[j] = rng.choice([c for c in b"0123456789" if c != old])
            return f"a digit of its key_paths {chr(old)} -> {chr(text[j])}"
        text[start : i + 1] = b"{}" + b" " * (i + 1 - start - 2)
        return "its key_paths dropped"

    return _reseal_inner_manifest(path, edit)


def zip64_huge_record(path: Path, rng: random.Random) -> str:
    """Gives one record a zip64 size (an extra field in its central
    directory entry) far beyond the file: 2**31 .. 2**64-1 bytes."""
    data = bytearray(path.read_bytes())
    zm = zip_map(bytes(data))
    if zm is None:
        return flip_bits(path, rng)
    e = rng.choice(zm.storages() or zm.entries)
    f = struct.unpack_from("<IHHHHHHIIIHHHHHII", data, e.cd_off)
    nlen, xlen, clen = f[10], f[11], f[12]
    huge = rng.choice([1 << 31, (1 << 32) + 7, 1 << 40, 1 << 62, (1 << 64) - 1])
    extra = struct.pack("<HHQQ", 1, 16, huge, huge)
    end = e.cd_off + 46 + nlen + xlen + clen
    entry = bytearray(data[e.cd_off : end])
    struct.pack_into("<II", entry, 20, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<H", entry, 30, xlen + len(extra))
    entry = entry[: 46 + nlen] + extra + entry[46 + nlen :]
    new = data[: e.cd_off] + entry + data[end:]
    struct.pack_into("<I", new, zm.eocd_off + len(extra) + 12, zm.cd_size + len(extra))
    if rng.random() < 0.5:
        struct.pack_into("<II", new, e.hdr_off + 18, 0xFFFFFFFF, 0xFFFFFFFF)
    path.write_bytes(bytes(new))
    return f"record {e.name}: zip64 size {huge} in its central directory entry"


def zip64_end_record(path: Path, rng: random.Random) -> str:
    """Replaces the end record by a zip64 one claiming a huge directory."""
    data = path.read_bytes()
    zm = zip_map(data)
    if zm is None:
        return flip_bits(path, rng)
    count = rng.choice([1 << 40, 1 << 62, (1 << 64) - 1, len(zm.entries) + 1, 0])
    cd_size = rng.choice([zm.cd_size, 1 << 62, 1 << 40, 0])
    cd_off = rng.choice([zm.cd_off, zm.cd_off, 1 << 62, 0])
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_off)
    loc = struct.pack("<IIQI", 0x07064B50, 0, zm.eocd_off, 1)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(data[: zm.eocd_off] + z64 + loc + eocd)
    return f"zip64 end record: {count} entries, directory of {cd_size} bytes at {cd_off}"


def zip64_disagrees(path: Path, rng: random.Random) -> str:
    """A zip64 end record (as torch writes into every archive) beside a plain,
    unsaturated end record, disagreeing with it in one field: every reader
    must refuse the file alike (the path reader once took the plain record's
    word while the stream reader refused, and verify passed)."""
    data = path.read_bytes()
    zm = zip_map(data)
    if zm is None or len(zm.entries) >= 0xFFFF or zm.cd_off + zm.cd_size >= 0xFFFFFFFF:
        return flip_bits(path, rng)
    count, cd_size, cd_off = len(zm.entries), zm.cd_size, zm.cd_off
    field = rng.choice(["count", "size", "offset"])
    if field == "count":
        count += rng.choice([1, 2, 1 << 40])
    elif field == "size":
        cd_size += rng.choice([-46, 46, 1 << 40]) if cd_size > 46 else 46
    else:
        cd_off = rng.choice([cd_off ^ (1 << rng.randrange(0, 63)), max(0, cd_off - 1)])
    cd_end = zm.cd_off + zm.cd_size
    z64_off = cd_end
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_off)
    loc = struct.pack("<IIQI", 0x07064B50, 0, z64_off, 1)
    n = len(zm.entries)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, zm.cd_size, zm.cd_off, 0)
    path.write_bytes(data[:cd_end] + z64 + loc + eocd)
    plain = f"{n}, {zm.cd_size} at {zm.cd_off}"
    return f"zip64 end record disagrees in {field}: {count} entries, {cd_size} bytes at {cd_off} (plain: {plain})"


# ----------------------------------------------------------------------------------------------
# hand-made pickles


def _u(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _int(v: int) -> bytes:
    if 0 <= v < 1 << 31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def _global(mod: str, name: str) -> bytes:
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def _tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


P2 = b"\x80\x02"


def hostile_pickles(marker: str) -> dict[str, bytes]:
    """Pickles that create ``marker`` when unpickled by an unrestricted
    unpickler; each must be refused under weights_only."""
    sh = f"touch {shlex.quote(marker)}"
    py = f"open({marker!r}, 'w').close()"
    return {
        "os.system": P2 + _global("os", "system") + _tuple(_u(sh)) + b"R.",
        "posix.system": P2 + _global("posix", "system") + _tuple(_u(sh)) + b"R.",
        "builtins.exec": P2 + _global("builtins", "exec") + _tuple(_u(py)) + b"R.",
        "builtins.eval": P2 + _global("builtins", "eval") + _tuple(_u(py)) + b"R.",
        "subprocess.run": P2 + _global("subprocess", "run") + _tuple(_tuple(_u("touch"), _u(marker))) + b"R.",
        "getattr(__import__('os'),'system')": P2
        + _global("builtins", "getattr")
        + _tuple(_global("builtins", "__import__") + _tuple(_u("os")) + b"R", _u("system"))
        + b"R"
        + _tuple(_u(sh))
        + b"R.",
        "STACK_GLOBAL exec": b"\x80\x04" + _u("builtins") + _u("exec") + b"\x93" + _tuple(_u(py)) + b"R.",
        "STACK_GLOBAL memo exec": b"\x80\x04"
        + _u("builtins")
        + b"\x94"
        + _u("exec")
        + b"\x94"
        + b"h\x00h\x01\x93"
        + _tuple(_u(py))
        + b"R.",
        "INST os.system": b"(" + _u(sh) + b"ios\nsystem\n.",
        "OBJ os.system": P2 + b"(" + _global("os", "system") + _u(sh) + b"o.",
        "dotted torch.serialization.os.system": b"\x80\x04"
        + _u("torch.serialization")
        + _u("os.system")
        + b"\x93"
        + _tuple(_u(sh))
        + b"R.",
        "dict with an exec value": P2 + b"}" + _u("model") + _global("builtins", "exec") + _tuple(_u(py)) + b"Rs.",
        "_rebuild_from_type_v2(exec)": P2
        + _global("torch._tensor", "_rebuild_from_type_v2")
        + _tuple(_global("builtins", "exec"), _global("builtins", "object"), _tuple(_u(py)), b"}")
        + b"R.",
        "torch.load nested": P2 + _global("torch", "load") + _tuple(_u(marker)) + b"R.",
    }


def _persid(key: str, numel: int, location: str = "cpu", storage: str = "FloatStorage") -> bytes:
    return b"(" + _u("storage") + _global("torch", storage) + _u(key) + _u(location) + _int(numel) + b"tQ"


def _rebuild(storage: bytes, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    return (
        _global("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + storage
        + _int(offset)
        + _tuple(*[_int(s) for s in size])
        + _tuple(*[_int(s) for s in stride])
        + b"\x89"
        + _global("collections", "OrderedDict")
        + b")R"
        + b"tR"
    )


def bomb_pickles() -> dict[str, bytes]:
    """Pickles that ask for far more memory (or depth) than the file holds,
    or name storages wrongly. The crafted archive has a record data/0 of
    64 bytes."""
    deep = 200_000
    return {
        "bytearray(2**40)": P2 + _global("builtins", "bytearray") + _tuple(_int(1 << 40)) + b"R.",
        "bytearray(2**31)": P2 + _global("builtins", "bytearray") + _tuple(_int(1 << 31)) + b"R.",
        "view past storage": P2 + _rebuild(_persid("0", 16), 0, (1 << 40,), (1,)) + b".",
        "view offset past storage": P2 + _rebuild(_persid("0", 16), 1 << 50, (4,), (1,)) + b".",
        "negative size": P2 + _rebuild(_persid("0", 16), 0, (-5,), (1,)) + b".",
        "huge numel persid": P2 + _rebuild(_persid("0", 1 << 60), 0, (4,), (1,)) + b".",
        "negative numel persid": P2 + _rebuild(_persid("0", -1), 0, (4,), (1,)) + b".",
        "missing storage key": P2 + _rebuild(_persid("77", 4), 0, (4,), (1,)) + b".",
        "location cuda:7": P2 + _rebuild(_persid("0", 16, "cuda:7"), 0, (4,), (1,)) + b".",
        "location garbage": P2 + _rebuild(_persid("0", 16, "/etc/passwd"), 0, (4,), (1,)) + b".",
        "persid short tuple": P2 + b"(" + _u("storage") + b"tQ.",
        "persid not a tuple": P2 + _u("storage") + b"Q.",
        "storage type OrderedDict": P2
        + _rebuild(
            b"(" + _u("storage") + _global("collections", "OrderedDict") + _u("0") + _u("cpu") + _int(4) + b"tQ",
            0,
            (4,),
            (1,),
        )
        + b".",
        "zero-stride 2**40 view": P2 + _rebuild(_persid("0", 16), 0, (1 << 40,), (0,)) + b".",
        "ndim 100000": P2 + _rebuild(_persid("0", 16), 0, (1,) * 100_000, (1,) * 100_000) + b".",
        "deep lists": P2 + b"]" * deep + b"a" * (deep - 1) + b".",
        "deep dicts": P2 + (b"}" + _u("k")) * deep + b"s" * (deep - 1) + b"}" * 0 + b".",
        "deep tuples": P2 + b"(" * deep + b"t" * deep + b".",
        "unclosed marks": P2 + b"(" * 1_000_000 + b"N.",
        "BINUNICODE8 2**62": b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"abc.",
        "BINBYTES8 2**62": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"abc.",
        "BYTEARRAY8 2**62": b"\x80\x05\x96" + struct.pack("<Q", 1 << 62) + b"abc.",
        "LONG4 2**31": P2 + b"\x8b" + struct.pack("<i", (1 << 31) - 1) + b"\x01.",
        "FRAME 2**62": b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N.",
        "LONG_BINPUT 2**32-1": P2 + b"N" + b"r" + struct.pack("<I", 0xFFFFFFFF) + b".",
        "LONG_BINGET unset": P2 + b"j" + struct.pack("<I", 0xFFFFFFF0) + b".",
        "billion laughs": P2 + _laughs(9) + b".",
        "empty": b"",
        "no STOP": P2 + b"}",
        "garbage": bytes(range(256)) * 4,
    }


def _laughs(depth: int) -> bytes:
    out = b"]" + b"r" + struct.pack("<I", 0)  # memo 0: []
    for i in range(1, depth + 1):
        out += b"(" + (b"j" + struct.pack("<I", i - 1)) * 10 + b"l" + b"r" + struct.pack("<I", i)
    return out


def legacy_and_script_files(marker: str) -> dict[str, bytes]:
    """Files that tierstore hands to torch.load: legacy (pre-1.6) and tar
    headers followed by hostile or broken content."""
    sh = f"touch {shlex.quote(marker)}"
    hostile = P2 + _global("os", "system") + _tuple(_u(sh)) + b"R."
    tar = bytearray(1024)
    tar[257:262] = b"ustar"
    tar[:9] = b"storages\0"
    return {
        "legacy magic then os.system": P2 + _int(0x1950A86A20F9469CFC6C) + b"." + hostile,
        "legacy os.system": hostile,
        "legacy garbage": P2 + b"\xff" * 64,
        "tar header": bytes(tar),
    }


class _Evil:
    """Pickles as a call of ``fn(arg)``: what a hostile file holds."""

    def __init__(self, fn: Callable[[str], Any], arg: str) -> None:
        self.fn = fn
        self.arg = arg

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, (self.arg,))


def evil_object(rng: random.Random, marker: str) -> tuple[str, Any]:
    sh = f"touch {shlex.quote(marker)}"
    py = f"open({marker!r}, 'w').close()"
    name, fn, arg = rng.choice([("os.system", os.system, sh), ("exec", exec, py), ("eval", eval, py)])
    return name, _Evil(fn, arg)


def file_facts(path: Path) -> tuple[int, int]:
    """A tierstore file's length and the CRC-32 of its manifest record."""
    data = path.read_bytes()
    zm = zip_map(data)
    assert zm is not None
    return len(data), zm.by_suffix(".tierstore/manifest.json")[0].crc


def resave_objects_file(d: Path, p: Path, saved: Any) -> None:
    """Writes ``saved`` as objects file ``p`` of sharded checkpoint ``d``
    with the library's own writer and fixes and re-seals manifest.json (the
    file's size and manifest CRC): consistent at every level."""
    tierstore.save(saved, p)
    size, crc = file_facts(p)
    m, _old = read_json(d / "manifest.json")
    for f in m.get("object_files", []):
        if f.get("name") == p.name:
            f["bytes"], f["manifest_crc32"] = size, crc
    write_json(d / "manifest.json", m, sealed=True, old=None)


def hostile_objects_file(ctx: Ctx, d: Path) -> str | None:
    """Rewrites an objects file of sharded checkpoint ``d`` with the library's
    own writer, one value replaced by a hostile object, and fixes and
    re-seals manifest.json: consistent at every level."""
    objs = sorted(p for p in d.iterdir() if p.name.startswith("objects-") and p.name.endswith(".pt"))
    if not objs:
        return None
    p = objs[0]
    saved = tierstore.load(p)  # our own file, before any mutation
    key = ctx.rng.choice(sorted(saved["objects"]))
    what, obj = evil_object(ctx.rng, str(ctx.marker))
    saved["objects"][key] = obj
    resave_objects_file(d, p, saved)
    ctx.sealed, ctx.oracle = True, "safe"
    return f"{p.name}: value {key!r} is a {what} call (written by tierstore.save; manifest.json fixed and re-sealed)"


def forged_offload_entry(ctx: Ctx, d: Path) -> str | None:
    """Rewrites the objects file of Checkpointer step ``d`` with its
    offloaded optimizer's entry forged (through tierstore.save, so the file
    is consistent) and re-seals manifest.json: only the entry's own
    statements (and the bytes they point at) can tell what is wrong."""
    rng = ctx.rng
    objs = sorted(p for p in d.iterdir() if p.name.startswith("objects-") and p.name.endswith(".pt"))
    if not objs:
        return None
    p = objs[0]
    saved = tierstore.load(p)
    keys = [k for k in saved["objects"] if str(k).endswith("__tierstore_offload__")]
    if not keys:
        return None
    key = keys[0]
    fmt, meta = saved["objects"][key]
    meta = copy.deepcopy(meta)
    sgs = meta["subgroups"]
    e = rng.choice(sgs)
    lay = e["layout"]
    how = rng.choice(
        ["layout_param", "layout_dup", "layout_overlap", "layout_offset", "layout_dtype", "nbytes", "objects",
         "first", "count", "params_shared", "crc", "file_outside", "file_other", "tensor_other", "param_groups",
         "params_shape", "format"]
    )  # fmt: skip
    if how == "layout_param" and lay:
        rng.choice(lay)[0] = rng.choice([e["count"], e["count"] + 1, 1 << 40, -1])
    elif how == "layout_dup" and len(lay) > 1:
        a, b = rng.sample(range(len(lay)), 2)
        lay.append([*lay[a][:2], lay[b][2], *lay[a][3:]])
    elif how == "layout_overlap" and len(lay) > 1:
        a, b = rng.sample(range(len(lay)), 2)
        lay[a][2] = lay[b][2]
    elif how == "layout_offset" and lay:
        rng.choice(lay)[2] = rng.choice([e["nbytes"], e["nbytes"] - 1, 1 << 50, 4])
    elif how == "layout_dtype" and lay:
        rng.choice(lay)[4] = rng.choice(["bfloat16", "float64", "int8", "no_such_dtype"])
    elif how == "nbytes":
        e["nbytes"] = rng.choice([e["nbytes"] + 4096, e["nbytes"] * 2, 1 << 40, 1 << 45, 0])
    elif how == "objects":
        e["objects"] = rng.choice([{str(e["count"]): {"x": 1}}, {"-1": {}}, {"a": {}}, {"0": 5}])
    elif how == "first":
        e["first"] = rng.choice([e["first"] + 1, 1 << 40, len(meta.get("params", [])) + 3])
    elif how == "count":
        e["count"] = rng.choice([e["count"] + 1, 0, 1 << 40])
    elif how == "params_shared" and len(sgs) > 1:
        a, b = rng.sample(sgs, 2)
        a["first"] = b["first"]
    elif how == "crc" and "file" in e:
        e["crc32"] = (e["crc32"] + rng.randrange(1, 1 << 32)) % (1 << 32)
    elif how == "file_outside" and "file" in e:
        e["file"] = rng.choice(["../../outside/secret.bin", "/etc/passwd", "../step-000000000002/" + e["file"]])
    elif how == "file_other" and "file" in e:
        others = [x["file"] for x in sgs if "file" in x and x is not e]
        e["file"] = rng.choice(others) if others else e["file"] + ".missing"
    elif how == "tensor_other" and "tensor" in e:
        others = [x["tensor"] for x in sgs if "tensor" in x and x is not e]
        e["tensor"] = rng.choice(others) if others else e["tensor"] + "-missing"
    elif how == "param_groups":
        meta["param_groups"] = rng.choice([[], meta["param_groups"] * 2, [5], None])
    elif how == "params_shape" and meta.get("params"):
        rng.choice(meta["params"])["shape"] = rng.choice([[1 << 62, 1 << 62], "x", [3]])
    elif how == "format":
        fmt = rng.choice(["tierstore-offload/9", None, 5])
    else:
        how = "nbytes"
        e["nbytes"] = 1 << 45
    saved["objects"][key] = (fmt, meta)
    resave_objects_file(d, p, saved)
    ctx.sealed = True
    return (
        f"{p.name}: offload entry subgroup {e['index']}: {how} forged (written by tierstore.save; "
        "manifest.json re-sealed)"
    )


# ----------------------------------------------------------------------------------------------
# JSON documents: paths to nodes, changes, sealing


def nodes(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from nodes(v, (*path, i))


def set_at(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def get_at(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def del_at(obj: Any, path: tuple[Any, ...]) -> None:
    for p in path[:-1]:
        obj = obj[p]
    del obj[path[-1]]


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's text) with a correct checksum trailer, as
    ``tierstore._metadata.dumps`` writes it."""
    head = body.rstrip()[:-1]
    crc = zlib.crc32(head)
    return head + (b"," if head.strip() != b"{" else b"") + b'"checksum":"crc32:%08x"}' % crc


def read_json(path: Path) -> tuple[dict[str, Any], str | None]:
    data = path.read_bytes()
    obj = json.loads(data)
    old = obj.pop("checksum", None)
    return obj, old


def write_json(path: Path, obj: Any, *, sealed: bool, old: str | None, raw: bytes | None = None) -> str:
    """Writes a mutated metadata file: sealed with a correct checksum, or
    with the old one (which no longer matches), or with none."""
    body = raw if raw is not None else json.dumps(obj, separators=(",", ":")).encode()
    if not body.lstrip().startswith(b"{"):
        path.write_bytes(body)
        return "not an object (no checksum possible)"
    if sealed:
        if raw is None:
            from tierstore import _metadata

            path.write_bytes(_metadata.dumps(obj))
        else:
            path.write_bytes(seal(body))
        return "re-sealed"
    if old is not None and zlib.crc32(body) % 3:
        head = body.rstrip()[:-1]
        path.write_bytes(head + b',"checksum":"' + old.encode() + b'"}')
        return "old checksum kept"
    path.write_bytes(body)
    return "checksum removed"


def digit_change(rng: random.Random, v: int) -> int:
    s = str(v)
    i = rng.randrange(len(s))
    d = rng.choice([c for c in "0123456789" if c != s[i]])
    return int(s[:i] + d + s[i + 1 :])


HUGE = [1 << 62, (1 << 62) + 1, 1 << 63, 1 << 64, 10**30, -1, -(1 << 63), 1e300, 0.5, 4096.0]
WRONG = [None, True, False, "x", "", [], {}, 0, [[0]], {"a": [1]}, -7, 3.25, "0", [None]]


# ----------------------------------------------------------------------------------------------
# the worker environment and a case


@dataclasses.dataclass
class Env:
    root: Path  # this worker's directory
    template: Path | None  # the 2-rank template (sharded/ and dcp/), when made
    emit: Callable[[dict[str, Any]], None] = lambda _m: None
    verbose: bool = False  # replay: print every op with its traceback
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict)


class Ctx:
    """One case: its directories, random streams, mutation and op records."""

    def __init__(self, env: Env, kind: str, seed: int) -> None:
        self.env = env
        self.kind = kind
        self.seed = seed
        self.rng = random.Random(f"{kind}:{seed}")
        self.gen = torch.Generator().manual_seed(seed % (1 << 62))
        self.dir = env.root / "case"
        if self.dir.exists() or self.dir.is_symlink():
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.outside = self.dir / "outside"
        self.outside.mkdir()
        self.marker = env.root / "code-executed.marker"
        self.marker.unlink(missing_ok=True)
        self.secret = self.outside / "secret.bin"
        self.secret.write_bytes(SECRET_BYTES)
        self.watched: list[Path] = [self.secret]
        self.mutator = "none"
        self.detail = ""
        self.sealed = False
        self.oracle = "same"
        self.ops: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.input_bytes = 0
        self.damaged_steps: set[int] = set()

    # -- outside files ------------------------------------------------------------------------

    def plant(self, src: Path, name: str | None = None) -> Path:
        """An identical copy of ``src`` outside the checkpoint, watched."""
        dst = self.outside / (name or src.name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        self.watched.append(dst)
        return dst

    def watch_tree(self, root: Path) -> None:
        for dp, _dn, fn in os.walk(root):
            self.watched.extend(Path(dp) / f for f in fn)

    def arm(self) -> None:
        for p in self.watched:
            with contextlib.suppress(OSError):
                st = os.stat(p)
                os.utime(p, (0, st.st_mtime))

    def tripped(self) -> list[str]:
        out = []
        for p in self.watched:
            with contextlib.suppress(OSError):
                if os.stat(p).st_atime != 0:
                    out.append(str(p.relative_to(self.dir)))
        return out

    # -- ops ----------------------------------------------------------------------------------

    def op(
        self,
        name: str,
        fn: Callable[[], Any],
        check: Callable[[Any, list[warnings.WarningMessage]], tuple[str, str]],
        *,
        load: bool = True,
        injected: bool = False,
    ) -> dict[str, Any]:
        """Runs one load path and records its outcome. ``check(value,
        warnings)`` classifies a value that came back. ``injected``: the op
        adds a fault of its own (a file cut short while it loads), so its
        clean error is expected even on a control case or where ``verify``
        passed the file."""
        self.env.emit({"ev": "op", "op": name})
        self.arm()
        rec: dict[str, Any] = {"op": name, "load": load, "injected": injected}
        reset_hwm()
        base = hwm_kib()
        tb = None
        value: Any = None
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            try:
                value = fn()
            except TierstoreError as e:
                rec.update(outcome=CLEAN, exc=fmt_exc(e), unsafe=isinstance(e, UnsafeObjectError))
                tb = traceback.format_exc()
            except MemoryError as e:
                rec.update(outcome=MEMORY, exc=fmt_exc(e))
                tb = traceback.format_exc()
            except BaseException as e:
                rec.update(outcome=OTHER, exc=fmt_exc(e))
                tb = traceback.format_exc()
        rec["seconds"] = round(time.perf_counter() - t0, 4)
        if "outcome" not in rec:
            try:
                outcome, detail = check(value, list(wlist))
            except Exception as e:
                outcome, detail = HARNESS, f"check failed: {fmt_exc(e)}"
                tb = traceback.format_exc()
            rec["outcome"] = outcome
            if detail:
                rec["detail"] = detail
            where = find_magic(value)
            if where is not None:
                rec.update(outcome=OUTSIDE, detail=f"the secret's bytes came back at {where}")
        if wlist:
            rec["warnings"] = [str(w.message)[:300] for w in wlist][:5]
        value = None
        grown = (hwm_kib() - base) // 1024
        rec["peak_mib"] = grown
        if grown > BLOWUP_MIB and self.input_bytes < 16 << 20 and rec["outcome"] not in (CODE, OUTSIDE):
            rec["detail"] = f"allocated {grown} MiB for {self.input_bytes} bytes of input; " + rec.get("detail", "")
            rec["outcome"] = MEMORY
        read = self.tripped()
        if read:
            rec["outcome"] = OUTSIDE
            rec["detail"] = f"read the file(s) {', '.join(read)} outside the checkpoint; " + rec.get("detail", "")
        if self.marker.exists():
            rec["outcome"] = CODE
            rec["detail"] = "the marker file appeared: code from the file ran"
            self.marker.unlink()
        if tb and (self.env.verbose or rec["outcome"] not in (CLEAN, EQUAL)):
            rec["traceback"] = tb[-4000:]
        self.ops.append(rec)
        if self.env.verbose:
            print(f"  {name:>20}: {rec['outcome']}  {rec.get('exc', '')} {rec.get('detail', '')}")
            if tb:
                print("    " + tb.rstrip().replace("\n", "\n    "))
        return rec

    def same_check(self, want: Any, *, ordered: bool = True, strides: bool = False) -> Callable[..., tuple[str, str]]:
        def check(value: Any, _w: list[Any]) -> tuple[str, str]:
            d = compare(value, want, ordered=ordered, strides=strides)
            if d is None and strides:
                d = shared_storage_diff(value, want)
            if d is None:
                return EQUAL, ""
            return (ACCEPTED if self.oracle == "safe" else SILENT), d

        return check

    def cli_op(self, name: str, argv: list[str]) -> dict[str, Any]:
        def run() -> int:
            rc = cli.main(argv)
            sys.stdout.flush()
            return rc

        return self.op(
            name, run, lambda rc, _w: (EQUAL if rc == 0 else CLEAN, "" if rc == 0 else f"exit {rc}"), load=False
        )

    # -- the verdict ----------------------------------------------------------------------------

    def verdict(self) -> dict[str, Any]:
        classes = [o["outcome"] for o in self.ops]
        extra = ""
        verify = [o for o in self.ops if o["op"] == "verify"]
        if verify and verify[0]["outcome"] == EQUAL and not self.sealed and self.mutator != "none":
            failed = [
                o
                for o in self.ops
                if o["load"]
                and o["outcome"] in (CLEAN, OTHER, SILENT, MEMORY)
                and not o.get("unsafe")
                and not (o.get("injected") and o["outcome"] == CLEAN)
            ]
            if failed:
                classes.append(CLI_OK)
                extra = f"verify said OK, but {failed[0]['op']} gave {failed[0]['outcome']}"
        if self.mutator == "none":
            bad = [o for o in self.ops if o["outcome"] != EQUAL and not (o.get("injected") and o["outcome"] == CLEAN)]
            if bad:
                classes.append(CONTROL)
                extra = f"control case (no mutation): {bad[0]['op']} gave {bad[0]['outcome']}"
        cls = worst(classes)
        out: dict[str, Any] = {
            "kind": self.kind,
            "seed": self.seed,
            "mutator": self.mutator + ("+seal" if self.sealed else ""),
            "oracle": self.oracle,
            "detail": self.detail[:600],
            "class": cls,
            "ops": self.ops,
        }
        if extra:
            out["why"] = extra
        if self.notes:
            out["notes"] = self.notes
        return out


def pick(rng: random.Random, table: list[tuple[str, float, Any]]) -> tuple[str, Any]:
    total = sum(w for _n, w, _f in table)
    x = rng.random() * total
    for name, w, f in table:
        x -= w
        if x < 0:
            return name, f
    return table[-1][0], table[-1][2]


def dir_bytes(d: Path) -> int:
    total = 0
    for dp, _dn, fn in os.walk(d):
        for f in fn:
            with contextlib.suppress(OSError):
                p = Path(dp) / f
                if p.is_file() and not p.is_symlink():
                    total += p.stat().st_size
    return total


# ----------------------------------------------------------------------------------------------
# kind 1: single files


def single_object(ctx: Ctx) -> Any:
    rng, g = ctx.rng, ctx.gen

    def t(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return rand_tensor(g, shape, dtype or rng.choice(DTYPES))

    obj: dict[str, Any] = {}
    obj["model"] = {"w": t((rng.randint(1, 9), rng.randint(1, 9))), "b": t((rng.randint(1, 17),))}
    if rng.random() < 0.7:
        base = t((rng.randint(2, 6), rng.randint(2, 6)))
        obj["views"] = {"base": base, "row": base[1], "T": base.t(), "strided": base[:, ::2], "tail": base.view(-1)[3:]}
    if rng.random() < 0.6:
        obj["scalar"] = t(())
    if rng.random() < 0.5:
        obj["empty"] = t((0, rng.randint(0, 4)))
    if rng.random() < 0.6:
        obj["meta"] = {
            "step": rng.randint(0, 1 << 40),
            "lr": rng.random(),
            "name": "run-" + str(rng.randint(0, 99)),
            "flags": [True, None, -3],
            "tup": (1, "a", 2.5),
        }
    if rng.random() < 0.5:
        obj["list"] = [t((rng.randint(1, 5),)) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        obj["big"] = t((rng.randint(1100, 3000),), torch.float32)  # spans several 4 KiB chunks
    return obj


def _single_fields(zm: ZipMap) -> list[tuple[str, int, int]]:
    """(description, offset, width) of the numeric fields of the zip structures."""
    out = []
    for e in zm.entries:
        for fld, off, w in (
            ("crc", 16, 4), ("csize", 20, 4), ("usize", 24, 4), ("nlen", 28, 2), ("xlen", 30, 2),
            ("clen", 32, 2), ("hdr", 42, 4), ("method", 10, 2), ("flags", 8, 2),
        ):  # fmt: skip
            out.append((f"central[{e.name}].{fld}", e.cd_off + off, w))
        for fld, off, w in (("crc", 14, 4), ("csize", 18, 4), ("usize", 22, 4), ("nlen", 26, 2), ("xlen", 28, 2)):
            out.append((f"local[{e.name}].{fld}", e.hdr_off + off, w))
    for fld, off, w in (("n_here", 8, 2), ("n_total", 10, 2), ("cd_size", 12, 4), ("cd_off", 16, 4), ("clen", 20, 2)):
        out.append((f"eocd.{fld}", zm.eocd_off + off, w))
    return out


def shrink_under_mapping(ctx: Ctx, path: Path, check: Callable[..., tuple[str, str]]) -> None:
    """``load(mmap=True)`` of a copy that another process cuts short once it is
    mapped (before its records are checked): the load raises an error naming
    the file (a ``TruncatedFileError`` where a record lost bytes) or, where
    the cut spared every byte it reads, returns the saved state; never
    ``SIGBUS``."""
    copy_path = path.parent / "shrinking.pt"
    try:
        shutil.copyfile(path, copy_path)
        size = copy_path.stat().st_size
    except OSError as e:
        ctx.ops.append({"op": "load_mmap_shrunk", "load": True, "outcome": CLEAN, "exc": f"copy failed: {fmt_exc(e)}"})
        return
    cut = ctx.rng.randrange(0, max(size, 1))
    ctx.detail += f"; shrunk to {cut} of {size} bytes under the mapping"
    real = _load._check_data_crcs

    def shrink_then_check(name: str, *args: Any, **kwargs: Any) -> None:
        os.truncate(name, cut)
        real(name, *args, **kwargs)

    def load() -> Any:
        _load._check_data_crcs = shrink_then_check
        try:
            return tierstore.load(str(copy_path), mmap=True)
        finally:
            _load._check_data_crcs = real

    ctx.op("load_mmap_shrunk", load, check, injected=True)
    copy_path.unlink(missing_ok=True)


def single_mutate(ctx: Ctx, path: Path, tier_file: bool) -> None:
    rng = ctx.rng
    data = path.read_bytes()
    zm = zip_map(data)
    assert zm is not None

    def region(entries: list[ZipEntry]) -> str:
        if not entries:
            return flip_bits(path, rng)
        e = rng.choice(entries)
        if e.size == 0:
            return flip_bits(path, rng, e.hdr_off, e.data_off)
        return f"{e.name}: " + flip_bits(path, rng, e.data_off, e.data_off + e.size)

    def m_none() -> str:
        return "no change"

    def m_flip_any() -> str:
        return flip_bits(path, rng)

    def m_flip_record() -> str:
        return region(zm.storages())

    def m_flip_pickle() -> str:
        return region(zm.by_suffix("/data.pkl"))

    def m_flip_manifest() -> str:
        return region(zm.by_suffix(".tierstore/manifest.json") or zm.by_suffix("/data.pkl"))

    def m_flip_small() -> str:
        return region([e for e in zm.entries if "/data/" not in e.name or e.name.split("/")[-1].startswith(".")])

    def m_flip_local_header() -> str:
        e = rng.choice(zm.entries)
        return f"local header of {e.name}: " + flip_bits(path, rng, e.hdr_off, e.data_off)

    def m_flip_central() -> str:
        return "central directory: " + flip_bits(path, rng, zm.cd_off, zm.eocd_off)

    def m_flip_eocd() -> str:
        return "end record: " + flip_bits(path, rng, zm.eocd_off, len(data))

    def m_truncate() -> str:
        pts = [e.data_off for e in zm.entries] + [e.data_off + e.size for e in zm.entries] + [zm.cd_off, zm.eocd_off]
        return truncate(path, rng, pts)

    def m_extend() -> str:
        return extend(path, rng)

    def m_prepend() -> str:
        n = rng.choice([1, 64, 4096])
        path.write_bytes(b"\0" * n + data)
        return f"{n} bytes inserted at the start"

    def m_zero_block() -> str:
        return zero_block(path, rng)

    def m_field() -> str:
        desc, off, w = rng.choice(_single_fields(zm))
        mx = (1 << (8 * w)) - 1
        v = rng.choice([0, 1, mx, mx - 1, 1 << (8 * w - 1), rng.randrange(mx + 1)])
        buf = bytearray(data)
        buf[off : off + w] = v.to_bytes(w, "little")
        path.write_bytes(bytes(buf))
        return f"{desc} set to {v:#x}"

    def m_crc_fixed() -> str:
        # A storage's bytes changed and its CRC fixed in the zip directory and
        # local header (not in the tierstore manifest): a careful forger.
        sto = [e for e in zm.storages() if e.size]
        if not sto:
            return m_flip_any()
        e = rng.choice(sto)
        buf = bytearray(data)
        i = rng.randrange(e.data_off, e.data_off + e.size)
        buf[i] ^= 0x5A
        crc = zlib.crc32(bytes(buf[e.data_off : e.data_off + e.size]))
        buf[e.cd_off + 16 : e.cd_off + 20] = struct.pack("<I", crc)
        buf[e.hdr_off + 14 : e.hdr_off + 18] = struct.pack("<I", crc)
        path.write_bytes(bytes(buf))
        ctx.sealed = True
        return f"{e.name}: byte {i} changed, CRC fixed in the zip directory and local header"

    def m_rename() -> str:
        e = rng.choice(zm.entries)
        buf = bytearray(data)
        nlen = len(e.name.encode())
        new = bytearray(e.name.encode())
        new[-1] = ord("9") if new[-1] != ord("9") else ord("8")
        buf[e.cd_off + 46 : e.cd_off + 46 + nlen] = new
        if rng.random() < 0.5:
            buf[e.hdr_off + 30 : e.hdr_off + 30 + nlen] = new
        path.write_bytes(bytes(buf))
        return f"record {e.name} renamed to {new.decode()}"

    def m_swap() -> str:
        sto = zm.storages()
        if len(sto) < 2:
            return m_rename()
        a, b = rng.sample(sto, 2)
        na, nb = a.name.encode(), b.name.encode()
        if len(na) != len(nb):
            return m_rename()
        buf = bytearray(data)
        for e, new in ((a, nb), (b, na)):
            buf[e.cd_off + 46 : e.cd_off + 46 + len(new)] = new
            buf[e.hdr_off + 30 : e.hdr_off + 30 + len(new)] = new
        path.write_bytes(bytes(buf))
        ctx.sealed = True  # CRCs travel with the records
        return f"records {a.name} and {b.name} swapped names"

    def m_name_twice() -> str:
        # Two entries, two records, one name: which one is meant is unknowable.
        sto = list(zm.storages())
        pairs = [(a, b) for a in sto for b in sto if a is not b and len(a.name) == len(b.name)]
        if not pairs:
            return m_dup_entry()
        a, b = rng.choice(pairs)
        buf = bytearray(data)
        new = b.name.encode()
        buf[a.cd_off + 46 : a.cd_off + 46 + len(new)] = new
        if rng.random() < 0.5:
            buf[a.hdr_off + 30 : a.hdr_off + 30 + len(new)] = new
        path.write_bytes(bytes(buf))
        return f"record {a.name} renamed to {b.name}, which another record has"

    def m_dup_entry() -> str:
        e = rng.choice(zm.entries)
        buf = bytearray(data)
        f = struct.unpack_from("<IHHHHHHIIIHHHHHII", buf, e.cd_off)
        entry = bytes(buf[e.cd_off : e.cd_off + 46 + f[10] + f[11] + f[12]])
        cd = bytes(buf[zm.cd_off : zm.eocd_off]) + entry
        eocd = bytearray(buf[zm.eocd_off : zm.eocd_off + 22])
        n = struct.unpack_from("<H", eocd, 10)[0] + 1
        struct.pack_into("<HHI", eocd, 8, n, n, len(cd))
        path.write_bytes(bytes(buf[: zm.cd_off]) + cd + bytes(eocd))
        return f"central directory entry of {e.name} duplicated"

    def crafted(pkl: bytes, what: str) -> str:
        prefix = zm.entries[0].name.split("/")[0]
        recs = [
            (f"{prefix}/data.pkl", pkl),
            (f"{prefix}/.format_version", b"1"),
            (f"{prefix}/.storage_alignment", b"64"),
            (f"{prefix}/byteorder", b"little"),
            (f"{prefix}/data/0", bytes(range(64))),
            (f"{prefix}/version", b"3\n"),
            (f"{prefix}/.data/serialization_id", b"1" * 40),
        ]
        write_zip(path, recs)
        ctx.sealed, ctx.oracle = True, "safe"
        return f"data.pkl replaced by a crafted pickle: {what}"

    def m_hostile() -> str:
        name, pkl = rng.choice(sorted(hostile_pickles(str(ctx.marker)).items()))
        return crafted(pkl, name)

    def m_bomb() -> str:
        name, pkl = rng.choice(sorted(bomb_pickles().items()))
        return crafted(pkl, name)

    def m_legacy() -> str:
        name, blob = rng.choice(sorted(legacy_and_script_files(str(ctx.marker)).items()))
        path.write_bytes(blob)
        ctx.sealed, ctx.oracle = True, "safe"
        return f"file replaced by {name}"

    def m_torchscript() -> str:
        recs = [(n.replace("/data.pkl", "/constants.pkl"), b) for n, b in zip_records(data, zm)]
        if rng.random() < 0.5:
            recs = [(n, b) for n, b in zip_records(data, zm)] + [
                (f"{zm.entries[0].name.split('/')[0]}/constants.pkl", P2 + b").")
            ]
            recs = [(n, b) for n, b in recs if not n.endswith("/data.pkl")]
        write_zip(path, recs)
        ctx.sealed, ctx.oracle = True, "safe"
        return "data.pkl renamed constants.pkl (a TorchScript archive to the dispatcher)"

    def m_inner_manifest() -> str:
        got = inner_manifest_digit(path, rng)
        if got is None:
            return m_flip_any()
        ctx.sealed = True
        return got[0]

    def m_flip_base() -> str:
        # The base a delta file is encoded against (raw, or coded: a chain).
        base = path.parent / "base.pt"
        bm = zip_map(base.read_bytes())
        sto = [e for e in (bm.storages() if bm else []) if e.size]
        if not sto:
            return "base.pt: " + flip_bits(base, rng)
        e = rng.choice(sto)
        return f"base.pt {e.name}: " + flip_bits(base, rng, e.data_off, e.data_off + e.size)

    def m_hostile_saved() -> str:
        what, obj = evil_object(rng, str(ctx.marker))
        tierstore.save({"model": {"w": torch.zeros(3)}, "evil": obj, "step": 1}, path)
        ctx.sealed, ctx.oracle = True, "safe"
        return f"a consistent tierstore file (written by tierstore.save) holding a {what} call"

    def m_special() -> str:
        which = rng.choice(["empty", "directory", "missing", "zip of nothing"])
        if which == "empty":
            path.write_bytes(b"")
        elif which == "directory":
            path.unlink()
            path.mkdir()
        elif which == "missing":
            path.unlink()
        else:
            write_zip(path, [])
        return f"file replaced: {which}"

    table: list[tuple[str, float, Any]] = [
        ("none", 2, m_none),
        ("flip_any", 10, m_flip_any),
        ("flip_storage", 8, m_flip_record),
        ("flip_base", 6 if (path.parent / "base.pt").exists() else 0, m_flip_base),
        ("flip_pickle", 4, m_flip_pickle),
        ("flip_manifest", 4 if tier_file else 0, m_flip_manifest),
        ("flip_small_record", 3, m_flip_small),
        ("flip_local_header", 4, m_flip_local_header),
        ("flip_central_dir", 6, m_flip_central),
        ("flip_eocd", 3, m_flip_eocd),
        ("truncate", 8, m_truncate),
        ("extend", 2, m_extend),
        ("prepend", 1, m_prepend),
        ("zero_block", 3, m_zero_block),
        ("zip_field", 6, m_field),
        ("zip64_huge_record", 3, lambda: zip64_huge_record(path, rng)),
        ("zip64_end_record", 2, lambda: zip64_end_record(path, rng)),
        ("zip64_disagrees", 2, lambda: zip64_disagrees(path, rng)),
        ("crc_fixed", 3 if tier_file else 0, m_crc_fixed),
        ("inner_manifest_digit", 4 if tier_file else 0, m_inner_manifest),
        ("rename_record", 2, m_rename),
        ("swap_records", 2 if tier_file else 0, m_swap),
        ("dup_central_entry", 1, m_dup_entry),
        ("name_twice", 1, m_name_twice),
        ("hostile_pickle", 8, m_hostile),
        ("hostile_saved", 2, m_hostile_saved),
        ("bomb_pickle", 7, m_bomb),
        ("legacy_dispatch", 2, m_legacy),
        ("torchscript_dispatch", 1, m_torchscript),
        ("special_file", 1, m_special),
    ]
    table = [r for r in table if r[1] > 0]
    ctx.mutator, fn = pick(rng, table)
    if ctx.env.cache.get("force_mutator"):
        ctx.mutator, fn = next((n, f) for n, _w, f in table if n == ctx.env.cache["force_mutator"])
    ctx.detail = fn()


def case_single(ctx: Ctx) -> None:
    obj = single_object(ctx)
    tier_file = ctx.rng.random() < 0.85 or ctx.env.cache.get("force_mutator") == "flip_base"
    path = ctx.dir / "ck" / "model.pt"
    path.parent.mkdir()
    # A quarter of tierstore's files are compressed (codec tsz1), half of
    # those as deltas against a base beside them: the mutators then damage
    # encoded records, their directories and their references.
    coded = tier_file and ctx.rng.random() < 0.25
    force_base = ctx.env.cache.get("force_mutator") == "flip_base"  # it needs a delta file and its base
    coded = coded or force_base
    if coded:
        g = ctx.gen
        obj["huge"] = torch.randn(ctx.rng.randint(17_000, 80_000), generator=g)
        obj["frozen"] = torch.zeros(ctx.rng.randint(17_000, 40_000))
        if ctx.rng.random() < 0.5 or force_base:
            # A moment that mostly decays by one factor (Adam's, of rows
            # without a gradient): its record is coded with the `scaled`
            # transform, whose scale in the stream's header the mutators hit.
            moment = torch.rand(ctx.rng.randint(17_000, 40_000), generator=g) + 0.1
            decayed = moment * 0.348678
            mask = torch.rand(moment.shape, generator=g) < 0.25
            obj["moment"] = torch.where(mask, torch.rand(moment.shape, generator=g), decayed)
            base = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in obj.items()}
            base["huge"] = base["huge"] + 1e-3 * torch.randn(base["huge"].shape, generator=g)
            base["moment"] = moment
            # Half of the bases are coded too: the delta then decodes chunk
            # by chunk down the chain (base damage met inside that pass).
            tierstore.save(base, path.parent / "base.pt", codec="zstd" if ctx.rng.random() < 0.5 else None)
            tierstore.save(obj, path, codec=tierstore.Delta(base=path.parent / "base.pt"))
        else:
            tierstore.save(obj, path, codec="zstd")
    elif tier_file:
        tierstore.save(obj, path)
    else:
        torch.save(obj, path)
    ctx.env.emit({"ev": "case", "stage": "saved"})
    single_mutate(ctx, path, tier_file)
    if not tier_file:
        ctx.detail = "[torch.save file] " + ctx.detail
    ctx.env.emit({"ev": "case", "mutator": ctx.mutator, "detail": ctx.detail[:300]})
    ctx.input_bytes = dir_bytes(path.parent)
    p = str(path)
    check = ctx.same_check(obj, strides=True)
    ctx.op("load", lambda: tierstore.load(p), check)
    if coded:  # a compressed file loads from its path only (mmap and file objects are refused by design)
        ctx.cli_op("verify", ["verify", p])
        ctx.cli_op("inspect", ["inspect", "--json", p])
        return
    ctx.op("load_mmap", lambda: tierstore.load(p, mmap=True), check)
    if tier_file and ctx.rng.random() < 0.25:
        shrink_under_mapping(ctx, path, check)

    try:
        fobj = open(p, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:  # the caller's open, not tierstore's
        ctx.ops.append({"op": "load_stream", "load": True, "outcome": CLEAN, "exc": f"open() failed: {fmt_exc(e)}"})
    else:
        with fobj:
            ctx.op("load_stream", lambda: tierstore.load(fobj), check)
    # The same bytes inside a longer stream, between other saved objects: the
    # load starts at the position and must stop at the archive's end.
    try:
        blob = path.read_bytes()
    except OSError:
        blob = None
    if blob:  # (no bytes at all: the stream's next object is legitimately loaded)
        after = io.BytesIO()
        tierstore.save({"after": torch.arange(3)}, after)
        stream = io.BytesIO(b"lead" + blob + after.getvalue())

        def load_in_stream() -> Any:
            stream.seek(4)
            return tierstore.load(stream)

        ctx.op("load_in_stream", load_in_stream, check)
    ctx.cli_op("verify", ["verify", p])
    ctx.cli_op("inspect", ["inspect", "--json", p])


# ----------------------------------------------------------------------------------------------
# kind 2: sharded checkpoints


@dataclasses.dataclass
class Sharded:
    """A saved sharded checkpoint and what it holds."""

    dir: Path
    globals: dict[str, torch.Tensor]  # global name -> full tensor
    objects: dict[str, Any]  # flat key -> value (per-rank ones: rank 0's)
    same: Callable[[], tuple[dict[str, Any], dict[str, Any]]]  # (target, expected) in the saved layout
    policy: str | None
    variant: str
    make_state: Callable[[bool], dict[str, Any]] | None = None  # state with magic tensors (for a twin)


def expected_local(lay: Layout, globals_: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(lay.local_shape, dtype=dtype)
    flat = out.view(-1)
    for p in lay.pieces:
        g = globals_[p.tensor]
        region = g[tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))]
        if isinstance(p.local, int):
            flat[p.local : p.local + region.numel()] = region.reshape(-1)
        else:
            sl = tuple(slice(o, o + n) for o, n in zip(p.local.offsets, p.local.lengths, strict=True))
            out[sl] = region.reshape(p.local.lengths)
    return out


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A load target whose bytes are 0x5A, so that elements a load leaves
    unwritten show."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(0x5A)
    return t


def target_for(lay: Layout, globals_: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return attach(poisoned(lay.local_shape, dtype), lay), expected_local(lay, globals_, dtype)


def other_layout(rng: random.Random, name: str, shape: tuple[int, ...]) -> Layout | None:
    """A layout different from how the tensor was saved (None: whole)."""
    numel = math.prod(shape)
    if not shape or numel == 0:
        return None
    opts = ["whole", "flat", "block"]
    if len(shape) >= 2 and any(shape[1] % n == 0 for n in (2, 3)):
        opts += ["col", "col"]
    if len(shape) >= 2 and shape[0] > 1 and shape[-1] > 1:
        opts += ["strided"]
    kind = rng.choice(opts)
    if kind == "whole":
        return None
    if kind == "col":
        n = rng.choice([n for n in (2, 3) if shape[1] % n == 0])
        return Layout.shard(name, shape, 1, rng.randrange(n), n)
    if kind == "strided":
        # Every row's part of the last dimension: one copy block of many short
        # runs, all read through the engine's shared-chunk windows.
        c = rng.randrange(shape[-1] - 1)
        offs = (rng.randrange(2) if shape[0] > 2 else 0,) + (0,) * (len(shape) - 2) + (c,)
        lens = (shape[0] - offs[0], *shape[1:-1], rng.randint(1, shape[-1] - c - 1))
        return Layout.block(name, shape, offs, lens)
    if kind == "flat":
        start = rng.randrange(numel)
        length = rng.randint(1, numel - start)
        return Layout.flat(name, shape, start, length, local_numel=length + rng.choice([0, 0, 3]))
    offs = tuple(rng.randrange(s) for s in shape)
    lens = tuple(rng.randint(1, s - o) for s, o in zip(shape, offs, strict=True))
    return Layout.block(name, shape, offs, lens)


def sharded_variant_whole(ctx: Ctx, d: Path) -> Sharded:
    rng, g = ctx.rng, ctx.gen
    dt = [rng.choice(DTYPES) for _ in range(5)]
    shapes = {
        "model.w": (rng.randint(1, 8), rng.choice([2, 3, 4, 6])),
        "model.b": (rng.randint(1, 9),),
        "emb": (rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 3)),
        "big": (rng.randint(2, 4), 1200),
    }
    globals_ = {k: rand_tensor(g, s, dt[i % 5]) for i, (k, s) in enumerate(shapes.items())}
    if rng.random() < 0.5:
        globals_["scalar"] = rand_tensor(g, (), dt[4])
    if rng.random() < 0.4:
        globals_["empty"] = rand_tensor(g, (0, 3), dt[3])
    # Tied weights: a second tensor object over big's storage (written once;
    # a consolidated load shares it, and the size guard counts it once).
    tied = rng.random() < 0.3
    if tied:
        globals_["head"] = globals_["big"]
    objects: dict[str, Any] = {
        "step": rng.randint(0, 10**9),
        "cfg.lr": rng.random(),
        "cfg.name": "x" * rng.randint(0, 9),
    }
    if rng.random() < 0.5:
        objects["hist"] = [1, 2.5, "three", None, (4, 5)]
    # An optimizer.state_dict()-like part: integer keys, a list of dicts, an
    # empty dict (DCP's flattening rules; key paths in the manifest).
    optim = rng.random() < 0.5
    fresh = optim and rng.random() < 0.5  # the target holds {} / None there: rebuilt from the saved keys
    if optim:
        globals_["opt.state.0.m"] = rand_tensor(g, (rng.randint(1, 6),), dt[1])
        objects["opt.state.1"] = {}
        objects["opt.groups.0.lr"] = rng.random()
        objects["opt.groups.0.params"] = [0, 1]

    def opt_part(gl: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "state": {0: {"m": gl["opt.state.0.m"]}, 1: {}},
            "groups": [{"lr": objects["opt.groups.0.lr"], "params": [0, 1]}],
        }

    def state(magic: bool = False) -> dict[str, Any]:
        gl = {k: (magic_like(v) if magic else v) for k, v in globals_.items()}
        s: dict[str, Any] = {"model": {"w": gl["model.w"], "b": gl["model.b"]}}
        s.update({k: v for k, v in gl.items() if not k.startswith(("model.", "opt."))})
        if tied:
            s["head"] = gl["big"].detach()  # another tensor object, the same storage
        s["step"] = objects["step"]
        s["cfg"] = {"lr": objects["cfg.lr"], "name": objects["cfg.name"]}
        if "hist" in objects:
            s["hist"] = objects["hist"]
        if optim:
            s["opt"] = opt_part(gl)
        return s

    tierstore.save_sharded(state(), d)

    def same() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt = state()
        exp = state()
        tgt["model"] = {k: poisoned(tuple(v.shape), v.dtype) for k, v in tgt["model"].items()}
        for k in globals_:
            if not k.startswith(("model.", "opt.")):
                tgt[k] = poisoned(tuple(globals_[k].shape), globals_[k].dtype)
        tgt["step"], tgt["cfg"] = None, {"lr": None, "name": None}
        if "hist" in tgt:
            tgt["hist"] = None
        if optim and fresh:
            tgt["opt"] = {"state": {}, "groups": None}
        elif optim:
            m = globals_["opt.state.0.m"]
            tgt["opt"] = {"state": {0: {"m": poisoned(tuple(m.shape), m.dtype)}, 1: {}},
                          "groups": [{"lr": None, "params": None}]}  # fmt: skip
        return tgt, exp

    return Sharded(d, globals_, objects, same, None, "whole+tied" if tied else "whole", state)


def sharded_variant_pieces(ctx: Ctx, d: Path) -> Sharded:
    """One process, several pieces per global tensor: row shards under two
    keys, column shards under three, flat ranges, a flat buffer of two
    parameters split in two, padding, a ZeRO-1/2 group partition."""
    rng, g = ctx.rng, ctx.gen
    r = rng.choice([2, 4, 6])
    c = rng.randint(1, 7)
    k = rng.randint(1, 3)
    fa, fb = rng.randint(1, 5), rng.randint(1, 6)
    pa, pb = (rng.randint(1, 4), rng.randint(1, 4)), (rng.randint(1, 9),)
    dts = [rng.choice(DTYPES) for _ in range(4)]
    globals_ = {
        "W": rand_tensor(g, (r, c), dts[0]),
        "X": rand_tensor(g, (rng.randint(1, 4), 3 * k), dts[1]),
        "F": rand_tensor(g, (fa, fb), dts[2]),
        "P": rand_tensor(g, pa, dts[3]),
        "Q": rand_tensor(g, pb, dts[3]),
    }
    nf = fa * fb
    cuts = sorted(rng.sample(range(1, nf), min(2, nf - 1))) if nf > 1 else []
    franges = list(zip([0, *cuts], [*cuts, nf], strict=True))
    npq = math.prod(pa) + math.prod(pb)
    split = rng.randint(1, npq - 1)
    pad = rng.choice([0, 2, 5])
    # A ZeRO-1/2 partition of a group of two parameters over 1-3 data-parallel
    # parts, held by this one process: one rule per member (flat_at, flat_per).
    za, zb = (rng.randint(1, 5), rng.randint(1, 4)), (rng.randint(1, 7),)
    zdp, zstage = rng.randint(1, 3), rng.choice([1, 2])
    globals_["Z"] = rand_tensor(g, za, dts[2])
    globals_["Y"] = rand_tensor(g, zb, dts[2])

    def layouts() -> list[tuple[str, Layout, torch.dtype]]:
        out: list[tuple[str, Layout, torch.dtype]] = []
        for i in range(2):
            out.append((f"w.part{i}", Layout.shard("W", (r, c), 0, i, 2), dts[0]))
        xs = tuple(globals_["X"].shape)
        for i in range(3):
            out.append((f"x.col{i}", Layout.shard("X", xs, 1, i, 3), dts[1]))
        for i, (a, b) in enumerate(franges):
            extra = pad if i == len(franges) - 1 else 0
            out.append((f"f.flat{i}", Layout.flat("F", (fa, fb), a, b - a, local_numel=b - a + extra), dts[2]))
        out.append(("buf.0", Layout.flat_buffer([("P", pa), ("Q", pb)], 0, split), dts[3]))
        out.append(
            (
                "buf.1",
                Layout.flat_buffer([("P", pa), ("Q", pb)], split, npq - split, local_numel=npq - split + pad),
                dts[3],
            )
        )
        for i in range(zdp):
            out.append((f"zg.part{i}", zero_partition([("Z", za), ("Y", zb)], i, zdp, stage=zstage), dts[2]))
        return out

    objects = {"step": rng.randint(0, 1000), "note": "pieces"}

    def state(magic: bool = False) -> dict[str, Any]:
        gl = {k: (magic_like(v) if magic else v) for k, v in globals_.items()}
        s: dict[str, Any] = {}
        for key, lay, dt in layouts():
            s[key] = attach(expected_local(lay, gl, dt), lay)
        s.update(objects)
        return s

    tierstore.save_sharded(state(), d)

    def same() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt: dict[str, Any] = {}
        exp: dict[str, Any] = {}
        for key, lay, dt in layouts():
            tgt[key], exp[key] = target_for(lay, globals_, dt)
        for kk, v in objects.items():
            tgt[kk], exp[kk] = None, v
        return tgt, exp

    return Sharded(d, globals_, objects, same, None, "pieces", state)


# The 2-rank template: the same function builds each rank's state when it is
# saved (tests/dist_util.run_world) and the targets when a worker loads it.


def dist_globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "model.w": rand_tensor(g, (8, 6), torch.float32),
        "model.f": rand_tensor(g, (5, 4), torch.bfloat16),
        "model.e": rand_tensor(g, (4, 8), torch.int16),
        "model.b": rand_tensor(g, (3,), torch.float64),
    }


def dist_layouts(rank: int) -> dict[str, Layout]:
    return {
        "model.w": Layout.shard("model.w", (8, 6), 0, rank, 2),
        "model.f": Layout.flat("model.f", (5, 4), rank * 10, 10),
        "model.e": Layout.shard("model.e", (4, 8), 1, rank, 2),
    }


def dist_state(rank: int) -> dict[str, Any]:
    gl = dist_globals()
    lays = dist_layouts(rank)
    model: dict[str, Any] = {}
    for name, lay in lays.items():
        model[name.split(".", 1)[1]] = attach(expected_local(lay, gl, gl[name].dtype), lay)
    model["b"] = gl["model.b"].clone()
    return {"model": model, "step": 7, "rng": tierstore.PerRank({"seed": 100 + rank})}


def _template_rank(rank: int, world: int, out: str) -> str:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    tierstore.save_sharded(dist_state(rank), os.path.join(out, "sharded"))
    # The same as a large job writes it: an indexed manifest, files[] in
    # index sections (one file each), rule groups as grids.
    os.environ.update(TIERSTORE_MANIFEST_INDEX_BYTES="0", TIERSTORE_INDEX_FILES_PER_SECTION="1", TIERSTORE_GRID_MIN="1")
    try:
        tierstore.save_sharded(dist_state(rank), os.path.join(out, "sharded_indexed"))
    finally:
        for k in ("TIERSTORE_MANIFEST_INDEX_BYTES", "TIERSTORE_INDEX_FILES_PER_SECTION", "TIERSTORE_GRID_MIN"):
            os.environ.pop(k, None)
    mesh = init_device_mesh("cpu", (world,))
    gl = dist_globals()
    w = DTensor.from_local(gl["model.w"][rank * 4 : (rank + 1) * 4].clone(), mesh, [Shard(0)], run_check=False)
    e = DTensor.from_local(gl["model.e"][:, rank * 4 : (rank + 1) * 4].clone(), mesh, [Shard(1)], run_check=False)
    tdcp.save({"w": w, "e": e, "b": gl["model.b"], "step": 7}, checkpoint_id=os.path.join(out, "dcp"))
    return "ok"


def make_dist_template(out: Path) -> None:
    """Saves the 2-rank sharded checkpoint and the 2-rank DCP checkpoint
    (torch.multiprocessing + gloo, as users start ranks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dist_util import run_world

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    run_world(2, _template_rank, str(tmp), timeout=180)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def sharded_variant_dist(ctx: Ctx, d: Path) -> Sharded:
    assert ctx.env.template is not None
    which = ctx.rng.choice(["sharded", "sharded_indexed"])
    shutil.copytree(ctx.env.template / which, d)
    gl = dist_globals()
    rank = ctx.rng.randrange(2)

    def same() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt: dict[str, Any] = {"model": {}}
        exp: dict[str, Any] = {"model": {}}
        for name, lay in dist_layouts(rank).items():
            k = name.split(".", 1)[1]
            tgt["model"][k], exp["model"][k] = target_for(lay, gl, gl[name].dtype)
        tgt["model"]["b"], exp["model"]["b"] = poisoned((3,), torch.float64), gl["model.b"]
        tgt["step"], exp["step"] = None, 7
        tgt["rng"], exp["rng"] = None, {"seed": 100}
        return tgt, exp

    return Sharded(d, gl, {"step": 7, "rng": {"seed": 100}}, same, "rank0", f"dist2(rank {rank}, {which})")


def sharded_build(ctx: Ctx, d: Path) -> Sharded:
    opts = [("whole", 0.35), ("pieces", 0.4)]
    if ctx.env.template is not None:
        opts.append(("dist", 0.25))
    v = pick(ctx.rng, [(n, w, n) for n, w in opts])[0]
    if v == "dist":
        return sharded_variant_dist(ctx, d)
    # A third of the one-process saves write an indexed manifest (global
    # tensors in index.<id>.bin, read in part), as large checkpoints do.
    # Half of those store their rule groups as grids (of one file).
    indexed = ctx.rng.random() < 0.33
    grids = indexed and ctx.rng.random() < 0.5
    knobs = {"TIERSTORE_MANIFEST_INDEX_BYTES": "0"} if indexed else {}
    if grids:
        knobs["TIERSTORE_GRID_MIN"] = "1"
    old = {k: os.environ.get(k) for k in knobs}
    os.environ.update(knobs)
    try:
        return sharded_variant_whole(ctx, d) if v == "whole" else sharded_variant_pieces(ctx, d)
    finally:
        for k, was in old.items():
            if was is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = was


def data_files(d: Path, prefix: str) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(prefix) and p.name.endswith(".pt"))


def manifest_mutators(ctx: Ctx, d: Path, sh: Sharded | None) -> list[tuple[str, float, Any]]:
    """JSON-aware mutations of a sharded manifest.json (also used for the
    step directories of a Checkpointer run). Each re-seals half the time."""
    rng = ctx.rng
    mp = d / "manifest.json"

    def load() -> tuple[dict[str, Any], str | None]:
        ctx.sealed = rng.random() < 0.5
        return read_json(mp)

    def done(m: Any, what: str, raw: bytes | None = None) -> str:
        _obj, old = read_json(mp) if mp.exists() else ({}, None)
        how = write_json(mp, m, sealed=ctx.sealed, old=old, raw=raw)
        if how != "re-sealed":
            ctx.sealed = False
        return f"{what} ({how})"

    def ints(m: dict[str, Any], prefer: tuple[str, ...] = ()) -> list[tuple[tuple[Any, ...], int]]:
        out = [(p, v) for p, v in nodes(m) if isinstance(v, int) and not isinstance(v, bool) and p]
        pref = [x for x in out if x[0] and x[0][0] in prefer]
        return pref if pref and rng.random() < 0.7 else out

    def j_digit() -> str:
        m, _o = load()
        fields = ints(m, ("stored", "files", "tensors"))
        if rng.random() < 0.4:
            fields = [x for x in fields if x[0][-1] == "offset"] or fields
        p, v = rng.choice(fields)
        nv = digit_change(rng, v)
        set_at(m, p, nv)
        return done(m, f"{'.'.join(map(str, p))}: {v} -> {nv}")

    def j_swap_offsets() -> str:
        m, _o = load()
        st = m.get("stored", [])
        if len(st) < 2:
            return j_digit()
        i, j = rng.sample(range(len(st)), 2)
        fld = rng.choice(["offset", "offset", "record_offset", "crc32", "shape", "record", "key"])
        st[i][fld], st[j][fld] = st[j][fld], st[i][fld]
        return done(m, f"stored[{i}].{fld} and stored[{j}].{fld} swapped")

    def j_transpose() -> str:
        m, _o = load()
        cands = [
            (n, g)
            for n, g in m.get("tensors", {}).items()
            if len(g.get("shape", [])) >= 2 and g["shape"][0] != g["shape"][-1]
        ]
        if not cands:
            return j_digit()
        n, g = rng.choice(cands)
        if "rule" in g:
            # A rule's tensor: the entry's shape, the rule's, or both (with
            # the splits' dimensions mirrored): every one contradicts the
            # rule the data files recorded.
            how = rng.choice(["global", "rule", "both"])
            if how in ("global", "both"):
                g["shape"] = g["shape"][::-1]
            if how in ("rule", "both"):
                r = g["rule"]
                r["shape"] = r["shape"][::-1]
                for sp in r["splits"]:
                    sp[0] = len(r["shape"]) - 1 - sp[0]
            return done(m, f"tensor {n}: shape transposed ({how}, a rule)")
        how = rng.choice(["global", "global+boxes", "stored", "all"])

        def sq(v: list[int]) -> list[int]:
            return [x for x in v if x != 1]

        if how == "global+boxes" and not any(
            isinstance(pc[2], list) and sq(pc[1][1][::-1]) != sq(pc[2][1]) for pc in g["pieces"]
        ):
            # Flat pieces, or square blocks, with transposed boxes describe
            # another, consistent tensor (nothing in the data files
            # contradicts it): not damage.
            how = "global"
        if how in ("global", "global+boxes", "all"):
            g["shape"] = g["shape"][::-1]
        if how in ("global+boxes", "all"):
            for pc in g["pieces"]:
                pc[1] = [pc[1][0][::-1], pc[1][1][::-1]]
                if how == "all" and isinstance(pc[2], list):
                    pc[2] = [pc[2][0][::-1], pc[2][1][::-1]]
        if how in ("stored", "all"):
            for pc in g["pieces"]:
                s = m["stored"][pc[0]]
                s["shape"] = s["shape"][::-1]
        return done(m, f"tensor {n}: shape transposed ({how})")

    def j_dtype() -> str:
        m, _o = load()
        if not m.get("tensors"):
            return j_digit()
        n, g = rng.choice(sorted(m["tensors"].items()))
        new = rng.choice(
            [
                "float32",
                "int32",
                "float16",
                "bfloat16",
                "int64",
                "uint8",
                "bool",
                "complex128",
                "float8_e5m2",
                "Tensor",
                "__class__",
                "float",
                # Not names of a torch attribute at all: one dtype reader
                # (_metadata.dtype_named) refuses them for every format.
                "float32.__class__",
                "float32 ",
                "",
                7,
                None,
            ]
        )
        how = rng.choice(["global", "stored", "both"])
        if how in ("global", "both"):
            g["dtype"] = new
        if how in ("stored", "both"):
            for pc in g.get("pieces", []):
                m["stored"][pc[0]]["dtype"] = new
        return done(m, f"tensor {n}: dtype {new} ({how})")

    def j_overlap_hole() -> str:
        m, _o = load()
        cands = []
        for n, g in m.get("tensors", {}).items():
            ps = g.get("pieces", [])
            if len(ps) >= 2 and g["shape"] and g["shape"][0] >= 2:
                cands.append((n, g))
        if not cands:
            return j_digit()
        n, g = rng.choice(cands)
        ps = g["pieces"]
        # Move the piece that starts last along dim 0 one step back: it
        # overlaps its neighbour and leaves a hole of the same size at the end.
        j = max(range(len(ps)), key=lambda i: (ps[i][1][0][0], ps[i][1][0][1:]))
        box = ps[j][1]
        if box[0][0] == 0:
            return j_digit()
        shift = rng.randint(1, box[0][0])
        box[0][0] -= shift
        if rng.random() < 0.3 and isinstance(ps[j][2], int):
            ps[j][2] = max(0, ps[j][2] - 1)
        return done(m, f"tensor {n}: piece {j} moved {shift} back along dim 0 (overlap + hole of equal size)")

    def j_huge() -> str:
        m, _o = load()
        p, v = rng.choice(ints(m, ("stored", "files", "tensors")))
        nv = rng.choice(HUGE)
        set_at(m, p, nv)
        return done(m, f"{'.'.join(map(str, p))}: {v} -> {nv}")

    def j_huge_shape() -> str:
        m, _o = load()
        if not m.get("tensors"):
            return j_huge()
        n, g = rng.choice(sorted(m["tensors"].items()))
        big = rng.choice([[1 << 40], [1 << 31, 1 << 31], [1 << 62], [3, 1 << 61], [0], [1 << 20] * 40])
        g["shape"] = big
        if rng.random() < 0.5:
            for pc in g.get("pieces", []):
                pc[1] = [[0] * len(big), big]
            if "rule" in g:
                g["rule"]["shape"] = big
        return done(m, f"tensor {n}: shape {big}")

    def j_wrong_type() -> str:
        m, _o = load()
        cands = [p for p, _v in nodes(m) if p]
        p = rng.choice(cands)
        nv = rng.choice(WRONG)
        old = get_at(m, p)
        if type(nv) is type(old):
            nv = [old]
        set_at(m, p, nv)
        return done(m, f"{'.'.join(map(str, p))}: {str(old)[:40]} -> {nv!r}")

    def j_deep() -> str:
        m, _o = load()
        cands = [p for p, _v in nodes(m) if p]
        p = rng.choice(cands)
        set_at(m, p, "__DEEP__")
        depth = rng.choice([1000, 100_000])
        opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
        raw = json.dumps(m, separators=(",", ":")).replace('"__DEEP__"', opener * depth + "0" + closer * depth).encode()
        return done(m, f"{'.'.join(map(str, p))}: {depth}-deep nesting", raw=raw)

    def j_toplevel() -> str:
        ctx.sealed = False
        raw = rng.choice([b"null", b"[]", b'"manifest"', b"0", b"{}", b"[" * 50000 + b"]" * 50000, b"", b"\xff\xfe"])
        if raw == b"{}" and rng.random() < 0.5:
            raw = seal(raw)
            ctx.sealed = True
        mp.write_bytes(raw)
        return f"manifest.json replaced by {raw[:20]!r}"

    def j_drop() -> str:
        m, _o = load()
        cands = [
            p
            for p, v in nodes(m)
            if p and isinstance(p[-1], str) and p[0] not in ("tensors", "objects", "per_rank_objects")
        ]
        cands += [p for p, v in nodes(m) if len(p) >= 3 and p[0] == "tensors" and isinstance(p[-1], str)]
        p = rng.choice(cands)
        del_at(m, p)
        return done(m, f"member {'.'.join(map(str, p))} removed")

    def j_dup() -> str:
        m, _o = load()
        which = rng.choice(["files", "stored", "piece"])
        if which == "piece" and m.get("tensors"):
            n, g = rng.choice(sorted(m["tensors"].items()))
            if g.get("pieces"):
                g["pieces"].append(copy.deepcopy(rng.choice(g["pieces"])))
                return done(m, f"tensor {n}: a piece duplicated")
            if g.get("parts"):
                g["parts"].append(copy.deepcopy(rng.choice(g["parts"])))
                return done(m, f"tensor {n}: a part of its rule duplicated")
        lst = m.get(which if which != "piece" else "stored", [])
        if not lst:
            return j_digit()
        lst.append(copy.deepcopy(rng.choice(lst)))
        return done(m, f"an entry of {which} duplicated")

    def j_rule() -> str:
        """A sharding rule, its groups of positions or its parts changed."""
        m, _o = load()
        ruled = [(n, g) for n, g in sorted(m.get("tensors", {}).items()) if "rule" in g]
        if not ruled:
            return j_digit()
        n, g = rng.choice(ruled)
        r = g["rule"]
        grp = m["groups"][g["parts"][0][0]] if m.get("groups") and g["parts"][0][0] < len(m["groups"]) else None
        what = rng.choice(["count", "dim", "mode", "size", "add_split", "drop_split", "flat", "replicated",
                           "coords", "coord_value", "files", "swap_files", "key", "group", "drop_part",
                           "flat_at", "flat_per"])  # fmt: skip
        sp = r["splits"][rng.randrange(len(r["splits"]))] if r["splits"] else None
        if what == "count" and sp is not None:
            sp[1] = rng.choice([1, 2, 3, sp[1] * 2, max(1, sp[1] - 1), 1 << 40])
        elif what == "dim" and sp is not None:
            sp[0] = rng.choice([0, 1, 2, 7, len(r["shape"])])
        elif what == "mode" and sp is not None:
            sp[2] = rng.choice(["even", "pad", "chunk", "zigzag"])
        elif what == "size" and sp is not None:
            sp[3] = rng.choice([0, 1, sp[3] + sp[1], sp[3] * 2, 1 << 50])
        elif what == "add_split" and r["shape"]:
            r["splits"].append([rng.randrange(len(r["shape"])), rng.choice([2, 3, 4]), "chunk", 0])
        elif what == "drop_split" and r["splits"]:
            r["splits"].pop()
        elif what == "flat":
            r["flat"] = rng.choice([0, 1, 2, 3, 1 << 40])
        elif what in ("flat_at", "flat_per"):  # a member of a ZeRO-1/2 buffer moved or the buffer recut
            r[what] = max(0, r.get(what, 0) + rng.choice([1, -1, 2, 7, 1 << 40, -(1 << 20)]))
        elif what == "replicated":
            r["replicated"] = not r["replicated"]
        elif what == "coords" and grp is not None and grp["coords"]:
            grp["coords"][rng.randrange(len(grp["coords"]))] = rng.choice([[], [0], [0, 0], [1 << 40], [3, 1]])
        elif what == "coord_value" and grp is not None and grp["coords"] and grp["coords"][0]:
            c = grp["coords"][rng.randrange(len(grp["coords"]))]
            if c:
                c[rng.randrange(len(c))] += rng.choice([1, -1, 1 << 31])
        elif what == "files" and grp is not None and grp["files"]:
            grp["files"][rng.randrange(len(grp["files"]))] = rng.choice([0, 1, len(m["files"]), 1 << 40])
        elif what == "swap_files" and grp is not None and len(grp["files"]) >= 2:
            i, j = rng.sample(range(len(grp["files"])), 2)
            grp["files"][i], grp["files"][j] = grp["files"][j], grp["files"][i]
        elif what == "key":
            g["parts"][0][1] = rng.choice(["", "x", n + ".other", "../" + n])
        elif what == "group":
            g["parts"][0][0] = rng.choice([0, 1, 2, 1 << 40])
        elif what == "drop_part" and len(g["parts"]) > 1:
            g["parts"].pop()
        else:
            return j_digit()
        return done(m, f"tensor {n}: rule {what} changed")

    def j_version() -> str:
        m, _o = load()
        v = rng.choice([0, 1, 1, 3, 99, "2", 2.0, None, -1])
        m["format_version"] = v
        if v == 1 and rng.random() < 0.7:
            # A downgrade to version 1 (no checksum required), with a
            # change the checksum would have caught.
            ctx.sealed = True
            p, old = rng.choice(ints(m, ("stored", "files", "tensors")))
            set_at(m, p, digit_change(rng, old))
            mp.write_bytes(json.dumps(m, separators=(",", ":")).encode())
            return f"format_version 1 without a checksum, and {'.'.join(map(str, p))}: {old} changed"
        return done(m, f"format_version {v!r}")

    def j_world() -> str:
        m, _o = load()
        v = rng.choice([0, 1, 2, 3, 1 << 24, 1 << 40, -2])
        m["world_size"] = v
        return done(m, f"world_size {v}")

    def j_names() -> str:
        m, _o = load()
        slots: list[tuple[tuple[Any, ...], str]] = []
        for i, f in enumerate(m.get("files", [])):
            slots.append((("files", i, "name"), f["name"]))
        for i, f in enumerate(m.get("object_files", [])):
            slots.append((("object_files", i, "name"), f["name"]))
        for k, v in m.get("objects", {}).items():
            slots.append((("objects", k), v))
        for k, h in m.get("per_rank_objects", {}).items():
            for r, v in h.items():
                slots.append((("per_rank_objects", k, r), v))
        if not slots:
            return j_digit()
        p, name = rng.choice(slots)
        real = d / name
        copy_ = ctx.plant(real, name) if real.is_file() else ctx.secret
        (d / "sub").symlink_to("../outside", target_is_directory=True)
        bad = rng.choice([
            "/etc/passwd",
            "../../../../../../../../etc/passwd",
            "../outside/secret.bin",
            str(ctx.secret),
            f"../outside/{copy_.name}",
            str(copy_),
            f"sub/{copy_.name}",
            f"x/../../outside/{copy_.name}",
            f"./{name}",
            f"{name}/",
            f"{name}/.",
            "",
            ".",
            "..",
            "a\0b",
            f"~/{name}",
            f"..\\outside\\{copy_.name}",
            "/proc/self/environ",
            "/dev/zero",
            "x" * 5000,
            7,
            None,
            [name],
            name.upper(),
            "manifest.json",
            "sub",
        ])  # fmt: skip
        set_at(m, p, bad)
        # Every mention of the name goes the same way (the objects map and object_files agree).
        if isinstance(bad, str):
            for q, v in list(nodes(m)):
                if q and v == name and q[0] in ("objects", "object_files", "per_rank_objects", "files"):
                    set_at(m, q, bad)
        return done(m, f"{'.'.join(map(str, p))}: {name!r} -> {str(bad)[:60]!r}")

    def j_redirect() -> str:
        # A manifest that is right in every field but names copies of the
        # checkpoint's own files outside it: loading means reading outside.
        m, _o = load()
        ctx.sealed = True
        for p, v in list(nodes(m)):
            if (
                isinstance(v, str)
                and p
                and p[0] in ("files", "object_files", "objects", "per_rank_objects")
                and (d / v).is_file()
            ):
                ctx.plant(d / v, "copies/" + v)
                set_at(m, p, rng.choice(["../outside/copies/", str(ctx.outside / "copies") + "/"]) + v)
        return done(m, "every file name points at an identical copy outside the checkpoint")

    return [
        ("json_digit", 10, j_digit),
        ("json_swap_fields", 3, j_swap_offsets),
        ("json_transpose", 3, j_transpose),
        ("json_dtype", 3, j_dtype),
        ("json_overlap_hole", 4, j_overlap_hole),
        ("json_huge_int", 3, j_huge),
        ("json_huge_shape", 2, j_huge_shape),
        ("json_wrong_type", 4, j_wrong_type),
        ("json_deep", 2, j_deep),
        ("json_toplevel", 2, j_toplevel),
        ("json_drop_member", 2, j_drop),
        ("json_duplicate", 2, j_dup),
        ("json_rule", 6, j_rule),
        ("json_version", 2, j_version),
        ("json_world_size", 1, j_world),
        ("json_names", 5, j_names),
        ("json_redirect_outside", 2, j_redirect),
    ]


def sharded_file_mutators(ctx: Ctx, d: Path, sh: Sharded | None) -> list[tuple[str, float, Any]]:
    """Byte-level and file-system mutations of a sharded checkpoint's files."""
    rng = ctx.rng
    mp = d / "manifest.json"

    def ranks() -> list[Path]:
        return data_files(d, "rank-")

    def objs() -> list[Path]:
        return data_files(d, "objects-") or ranks()

    def one(files: list[Path]) -> Path:
        return rng.choice(files)

    def f_rank_flip() -> str:
        p = one(ranks())
        return f"{p.name}: " + flip_bits(p, rng)

    def f_index() -> str:
        """An indexed manifest's index file: bits flipped in its table or a
        section, cut short, extended, or swapped for another save's."""
        idx = sorted(d.glob("index.*.bin"))
        if not idx:
            return f_rank_flip()
        p = idx[0]
        how = rng.choice(["flip", "flip_table", "truncate", "extend", "zero"])
        if how == "flip":
            return f"{p.name}: " + flip_bits(p, rng)
        if how == "flip_table":
            return f"{p.name} table: " + flip_bits(p, rng, 0, min(p.stat().st_size, 16 + 29 * 4), n=1)
        if how == "truncate":
            return f"{p.name}: " + truncate(p, rng, None)
        if how == "extend":
            return f"{p.name}: " + extend(p, rng)
        return f"{p.name}: " + zero_block(p, rng)

    def f_rank_data_flip() -> str:
        p = one(ranks())
        zm = zip_map(p.read_bytes())
        sto = [e for e in (zm.storages() if zm else []) if e.size]
        if not sto:
            return f_rank_flip()
        e = rng.choice(sto)
        return f"{p.name} record {e.name}: " + flip_bits(p, rng, e.data_off, e.data_off + e.size, n=1)

    def f_ranks_data_flip_all() -> str:
        """One bit of one storage flipped in every rank file: a load that
        reads several files at once must name one damaged record, never
        return a wrong byte, and leave no read running."""
        done = []
        for p in ranks():
            zm = zip_map(p.read_bytes())
            sto = [e for e in (zm.storages() if zm else []) if e.size]
            if sto:
                e = rng.choice(sto)
                done.append(f"{p.name} record {e.name}: " + flip_bits(p, rng, e.data_off, e.data_off + e.size, n=1))
        return "; ".join(done) if done else f_rank_flip()

    def f_rank_meta_flip() -> str:
        p = one(ranks())
        zm = zip_map(p.read_bytes())
        ents = [
            e
            for e in (zm.entries if zm else [])
            if e.size and ("/data/" not in e.name or "/." in e.name or e.name.endswith("chunks"))
        ]
        ents += [e for e in (zm.entries if zm else []) if ".tierstore" in e.name]
        if not ents:
            return f_rank_flip()
        e = rng.choice(ents)
        return f"{p.name} record {e.name}: " + flip_bits(p, rng, e.data_off, e.data_off + e.size)

    def f_rank_trunc() -> str:
        p = one(ranks())
        zm = zip_map(p.read_bytes())
        pts = [e.data_off + e.size // 2 for e in zm.entries] + [zm.cd_off] if zm else None
        return f"{p.name}: " + truncate(p, rng, pts)

    def f_rank_extend() -> str:
        p = one(ranks())
        return f"{p.name}: " + extend(p, rng)

    def f_rank_zero() -> str:
        p = one(ranks())
        return f"{p.name}: " + zero_block(p, rng)

    def f_rank_field() -> str:
        p = one(ranks())
        data = p.read_bytes()
        zm = zip_map(data)
        if zm is None:
            return f_rank_flip()
        desc, off, w = rng.choice(_single_fields(zm))
        mx = (1 << (8 * w)) - 1
        v = rng.choice([0, 1, mx, 1 << (8 * w - 1), rng.randrange(mx + 1)])
        buf = bytearray(data)
        buf[off : off + w] = v.to_bytes(w, "little")
        p.write_bytes(bytes(buf))
        return f"{p.name}: {desc} set to {v:#x}"

    def f_obj_flip() -> str:
        p = one(objs())
        return f"{p.name}: " + flip_bits(p, rng)

    def f_obj_trunc() -> str:
        p = one(objs())
        return f"{p.name}: " + truncate(p, rng)

    def f_man_flip() -> str:
        return "manifest.json: " + flip_bits(mp, rng)

    def f_man_trunc() -> str:
        return "manifest.json: " + truncate(mp, rng)

    def f_man_extend() -> str:
        tail = rng.choice([b" \n", b"\n\n{}", b"x", b',"checksum":"crc32:00000000"}'])
        with open(mp, "ab") as f:
            f.write(tail)
        return f"manifest.json: appended {tail!r}"

    def f_delete() -> str:
        p = one([*ranks(), *data_files(d, "objects-"), mp])
        p.unlink()
        return f"{p.name} deleted"

    def f_foreign() -> str:
        rs = ranks()
        if len(rs) >= 2 and rng.random() < 0.7:
            a, b = rng.sample(rs, 2)
            shutil.copyfile(a, b)
            return f"{b.name} replaced by {a.name}"
        if sh is None or sh.make_state is None:
            return f_rank_flip()
        twin = ctx.outside / "twin"
        tierstore.save_sharded(sh.make_state(True), twin)
        pref = rng.choice(["rank-", "objects-"])
        mine, theirs = data_files(d, pref), data_files(twin, pref)
        if not mine or not theirs:
            mine, theirs = ranks(), data_files(twin, "rank-")
        shutil.copyfile(theirs[0], mine[0])
        ctx.watch_tree(twin)
        return f"{mine[0].name} replaced by the same file of another checkpoint (magic values)"

    def f_fifo() -> str:
        p = one([*ranks(), *data_files(d, "objects-"), mp])
        return make_fifo(p)

    def f_dir() -> str:
        p = one([*ranks(), *data_files(d, "objects-")])
        p.unlink()
        p.mkdir()
        (p / "x").write_bytes(b"x")
        return f"{p.name} replaced by a directory"

    def f_symlink_out() -> str:
        p = one([*ranks(), *data_files(d, "objects-"), mp])
        c = ctx.plant(p)
        if rng.random() < 0.5:
            return replace_by_symlink(p, c) + " (identical copy, absolute)"
        return replace_by_symlink(p, Path("../outside") / c.name) + " (identical copy, relative)"

    def f_symlink_secret() -> str:
        p = one([*ranks(), *data_files(d, "objects-"), mp])
        return replace_by_symlink(
            p,
            rng.choice([ctx.secret, "/dev/zero", "/dev/urandom", "/proc/self/environ", "/etc/passwd", "/nonexistent"]),
        )

    def f_symlink_inside() -> str:
        p = one(ranks())
        moved = p.with_name(p.name + ".moved")
        os.rename(p, moved)
        os.symlink(moved.name, p)
        return f"{p.name} is a symlink to {moved.name} in the same directory (legitimate)"

    def resealed(p: Path, got: tuple[str, int]) -> str:
        # The file's new manifest CRC-32 (got[1]) put in manifest.json, which is re-sealed.
        m, _old = read_json(mp)
        for lst in ("files", "object_files"):
            for f in m.get(lst, []):
                if f.get("name") == p.name:
                    f["manifest_crc32"] = got[1]
        write_json(mp, m, sealed=True, old=None)
        ctx.sealed = True
        return f"{p.name}: {got[0]}; manifest.json updated and re-sealed"

    def f_inner_manifest() -> str:
        # A digit of a data file's own manifest changed, its CRC fixed in the
        # file and in manifest.json, which is re-sealed: consistent at every
        # level a forger can reach without rewriting the data.
        p = one([*ranks(), *data_files(d, "objects-")])
        got = inner_manifest_digit(p, rng)
        if got is None:
            return f_rank_flip()
        return resealed(p, got)

    def f_chunk_size() -> str:
        # A rank file's chunk table forged to another chunk size, the file's
        # manifest CRC fixed in it and in manifest.json, which is re-sealed.
        p = one(ranks())
        got = inner_chunk_size(p, rng)
        if got is None:
            return f_inner_manifest()
        return resealed(p, got)

    def f_key_paths() -> str:
        # A data or objects file's own key paths forged, its CRC fixed in the
        # file and in manifest.json, which is re-sealed.
        p = one([*ranks(), *data_files(d, "objects-")])
        got = inner_key_paths(p, rng)
        if got is None:
            return f_inner_manifest()
        return resealed(p, got)

    def f_objects_hostile() -> str:
        return hostile_objects_file(ctx, d) or f_obj_flip()

    def f_dir_symlink() -> str:
        # The whole checkpoint directory is a symlink to a copy: the user named it, legitimate.
        real = ctx.dir / "ck-real"
        shutil.copytree(d, real, symlinks=True)
        shutil.rmtree(d)
        os.symlink(real, d)
        return "the checkpoint directory is a symlink to its copy (legitimate)"

    return [
        ("rank_flip", 8, f_rank_flip),
        ("index_damage", 3, f_index),
        ("rank_data_flip", 8, f_rank_data_flip),
        ("ranks_data_flip_all", 3, f_ranks_data_flip_all),
        ("rank_meta_flip", 4, f_rank_meta_flip),
        ("rank_truncate", 5, f_rank_trunc),
        ("rank_extend", 2, f_rank_extend),
        ("rank_zero_block", 2, f_rank_zero),
        ("rank_zip_field", 3, f_rank_field),
        (
            "rank_zip64",
            2,
            lambda: (lambda p: f"{p.name}: " + rng.choice([zip64_huge_record, zip64_end_record])(p, rng))(one(ranks())),
        ),
        ("objects_flip", 4, f_obj_flip),
        ("objects_truncate", 3, f_obj_trunc),
        ("manifest_flip", 5, f_man_flip),
        ("manifest_truncate", 4, f_man_trunc),
        ("manifest_extend", 1, f_man_extend),
        ("delete_file", 2, f_delete),
        ("foreign_file", 4, f_foreign),
        ("fifo", 3, f_fifo),
        ("directory", 1, f_dir),
        ("symlink_outside", 3, f_symlink_out),
        ("symlink_secret_dev", 2, f_symlink_secret),
        ("symlink_inside", 1, f_symlink_inside),
        ("dir_symlink", 0.5, f_dir_symlink),
        ("inner_manifest_resealed", 4, f_inner_manifest),
        ("inner_key_paths_resealed", 2, f_key_paths),
        ("chunk_size_resealed", 3, f_chunk_size),
        ("objects_hostile_resealed", 3, f_objects_hostile),
    ]


def _half(name: str, shape: tuple[int, ...], rank: int, uneven: bool = False) -> Layout | None:
    """Rank ``rank``'s half of a tensor: a column half (short runs in every
    row, sharing chunks with the other rank's), or a flat half of a 1-D one.
    ``uneven``: the columns split at a point the name picks (the same on
    both ranks), so that each row's parts end anywhere in a chunk: a part
    inside one chunk, parts over several with either end or both in part."""
    numel = math.prod(shape)
    if not shape or numel < 2:
        return None
    if len(shape) >= 2 and shape[-1] >= 2:
        c = 1 + zlib.crc32(name.encode()) % (shape[-1] - 1) if uneven else shape[-1] // 2
        offs = (0,) * (len(shape) - 1) + (rank * c,)
        lens = (*shape[:-1], c if rank == 0 else shape[-1] - c)
        return Layout.block(name, shape, offs, lens)
    half = numel // 2
    return Layout.flat(name, shape, rank * half, half if rank == 0 else numel - half)


def _shared_rank(
    rank: int, world: int, d: str, globals_: dict[str, torch.Tensor], pol: Any, uneven: bool
) -> dict[str, Any]:
    tgt: dict[str, Any] = {}
    exp: dict[str, Any] = {}
    for name, gt in globals_.items():
        lay = _half(name, tuple(gt.shape), rank, uneven)
        if lay is None:
            tgt[name], exp[name] = poisoned(tuple(gt.shape), gt.dtype), gt
        else:
            tgt[name], exp[name] = target_for(lay, globals_, gt.dtype)
    try:
        tierstore.load_sharded(d, tgt, verify="shared", per_rank_policy=pol)
    except TierstoreError as e:
        return {"error": fmt_exc(e), "clean": True}
    except Exception as e:
        return {"error": fmt_exc(e), "clean": False}

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    bad = [k for k in exp if tgt[k].shape != exp[k].shape or not torch.equal(raw(tgt[k]), raw(exp[k]))]
    return {"differs": bad}


def shared_load(d: Path, sh: Sharded, uneven: bool = False) -> list[dict[str, Any]]:
    """Two ranks load halves of every tensor with ``verify="shared"`` (split
    unevenly: see ``_half``);
    a rank's TierstoreError is raised here (the other rank's result must
    still be exact or an error of its own)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dist_util import run_world

    got = run_world(2, _shared_rank, str(d), sh.globals, sh.policy, uneven, timeout=120)
    if any("error" in r and not r["clean"] for r in got):
        raise RuntimeError("; ".join(r["error"] for r in got if "error" in r))
    return got


def shared_check(sh: Sharded) -> Callable[..., tuple[str, str]]:
    def check(value: Any, _w: list[Any]) -> tuple[str, str]:
        differ = [(r, x["differs"]) for r, x in enumerate(value) if x.get("differs")]
        if differ:
            return SILENT, f"rank {differ[0][0]} loaded {differ[0][1][:3]} with different bytes"
        errors = [x["error"] for x in value if "error" in x]
        if errors:
            return CLEAN, errors[0][:300]
        return EQUAL, ""

    return check


def case_sharded(ctx: Ctx) -> None:
    d = ctx.dir / "ck"
    sh = sharded_build(ctx, d)
    ctx.env.emit({"ev": "case", "stage": f"saved {sh.variant}"})
    table = [("none", 2, lambda: "no change"), *sharded_file_mutators(ctx, d, sh), *manifest_mutators(ctx, d, sh)]
    ctx.mutator, fn = pick(ctx.rng, table)
    if ctx.env.cache.get("force_mutator"):
        ctx.mutator, fn = next((n, f) for n, _w, f in table if n == ctx.env.cache["force_mutator"])
    ctx.detail = f"[{sh.variant}] " + fn()
    ctx.env.emit({"ev": "case", "mutator": ctx.mutator, "detail": ctx.detail[:300]})
    ctx.input_bytes = dir_bytes(ctx.dir)
    rng = ctx.rng
    pol = sh.policy

    def other() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt: dict[str, Any] = {}
        exp: dict[str, Any] = {}
        for name, gt in sh.globals.items():
            lay = other_layout(rng, name, tuple(gt.shape))
            if lay is None:
                tgt[name], exp[name] = poisoned(tuple(gt.shape), gt.dtype), gt
            else:
                tgt[name], exp[name] = target_for(lay, sh.globals, gt.dtype)
        if rng.random() < 0.5:
            k = rng.choice(sorted(sh.objects))
            tgt[k], exp[k] = None, sh.objects[k]
        return tgt, exp

    for verify in ("touched", "full"):
        for which, make in (("same", sh.same), ("other", other)):
            tgt, exp = make()

            def run(tgt: dict[str, Any] = tgt, verify: str = verify) -> Any:
                return tierstore.load_sharded(str(d), tgt, verify=verify, per_rank_policy=pol)

            ctx.op(f"load_{which}_{verify}", run, ctx.same_check(exp, ordered=False))
    # A quarter of the cases: one Checkpoint opened, then two loads from it
    # (into the saved layout and another), as a Checkpointer's restore does:
    # the metadata is read and checked once, each data file when first used.
    if rng.random() < 0.25:
        (t1, e1), (t2, e2) = sh.same(), other()

        def opened() -> Any:
            from tierstore.shardmeta import Checkpoint

            ck = Checkpoint(d)
            return {
                "same": tierstore.load_sharded(ck, t1, per_rank_policy=pol),
                "other": tierstore.load_sharded(ck, t2, per_rank_policy=pol),
            }

        ctx.op("load_opened_twice", opened, ctx.same_check({"same": e1, "other": e2}, ordered=False))
    # A quarter of the cases: two real ranks (gloo) load column halves with
    # verify="shared", proving the chunks they share from each other's pieces.
    if rng.random() < 0.25:
        ctx.op("load_cols_shared", lambda: shared_load(d, sh), shared_check(sh))
    # Another tenth: the columns split where each tensor's name says, so the
    # parts a rank reads begin and end anywhere in a chunk (the edges a
    # shared read cuts into pieces, or keeps when its own parts cover them).
    if rng.random() < 0.1:
        ctx.op("load_cols_shared_uneven", lambda: shared_load(d, sh, True), shared_check(sh))
    # What a Checkpointer's restore asks before it fetches files from peers:
    # the files a load of the target plans to read, from the metadata alone.
    # It may say "all" (None) or raise a TierstoreError; any name it gives
    # must be one the manifest lists (peers read exactly those files).
    tgt_n, _exp_n = other()

    def needed() -> Any:
        from tierstore._sharded_read import needed_files
        from tierstore.shardmeta import Checkpoint

        return needed_files(Checkpoint(d), tgt_n, 0, 1)

    def needed_check(value: Any, _w: list[Any]) -> tuple[str, str]:
        if value is None:
            return EQUAL, ""
        from tierstore.shardmeta import read_manifest

        m = read_manifest(d)
        listed = {f["name"] for f in m["files"]} | {o["name"] for o in m.get("object_files", ())}
        bad = [n for n in value if not isinstance(n, str) or "/" in n or n in ("", ".", "..") or n not in listed]
        return (EQUAL, "") if isinstance(value, set) and not bad else (SILENT, f"needed_files named {bad[:3]}")

    ctx.op("needed_files", needed, needed_check)
    want = dict(sh.globals)
    want.update(sh.objects)
    ctx.op(
        "consolidate",
        lambda: tierstore.sharded.consolidate(str(d), per_rank_policy=pol),
        ctx.same_check(want, ordered=False),
    )
    ctx.cli_op("verify", ["verify", str(d)])
    ctx.cli_op("inspect", ["inspect", "--json", str(d)])


# ----------------------------------------------------------------------------------------------
# kind 3: PyTorch DCP directories


@dataclasses.dataclass
class Dcp:
    dir: Path
    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    variant: str
    multi: bool  # chunks per tensor > 1


def dcp_single_template(env: Env, k: int) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    key = ("dcp", k)
    if key not in env.cache:
        rng = random.Random(f"dcp-template:{k}")
        g = torch.Generator().manual_seed(4321 + k)
        dts = [rng.choice(DTYPES) for _ in range(3)]
        tensors = {
            "w": rand_tensor(g, (rng.randint(1, 6), rng.choice([2, 4, 6])), dts[0]),
            "v": rand_tensor(g, (rng.randint(1, 40),), dts[1]),
            "model.big": rand_tensor(g, (1100,), torch.float32),
        }
        if k % 2:
            tensors["s"] = rand_tensor(g, (), dts[2])
        objects = {"step": rng.randint(0, 10**6), "name": f"dcp-{k}"}
        out = env.root / "templates" / f"dcp-{k}"
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tierstore.dcp.save_dcp({**tensors, **objects}, out)
        env.cache[key] = (out, tensors, objects)
    return env.cache[key]  # type: ignore[no-any-return]


def dcp_build(ctx: Ctx, d: Path) -> Dcp:
    if ctx.env.template is not None and ctx.rng.random() < 0.5:
        shutil.copytree(ctx.env.template / "dcp", d)
        gl = dist_globals()
        tensors = {"w": gl["model.w"], "e": gl["model.e"], "b": gl["model.b"]}
        return Dcp(d, tensors, {"step": 7}, "dist2", True)
    k = ctx.rng.randrange(6)
    src, tensors, objects = dcp_single_template(ctx.env, k)
    shutil.copytree(src, d)
    return Dcp(d, tensors, objects, f"save_dcp #{k}", False)


def dcp_meta(d: Path) -> Any:
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)  # our own template, before any mutation


def dcp_put(d: Path, md: Any) -> None:
    (d / ".metadata").write_bytes(pickle.dumps(md))


def dcp_mutators(ctx: Ctx, dc: Dcp) -> list[tuple[str, float, Any]]:
    rng = ctx.rng
    d = dc.dir
    meta = d / ".metadata"

    def distcps() -> list[Path]:
        return sorted(d.glob("*.distcp"))

    def tensor_items(md: Any) -> list[tuple[Any, Any]]:
        return [(i, inf) for i, inf in md.storage_data.items() if i.offset is not None]

    def m_flip() -> str:
        return ".metadata: " + flip_bits(meta, rng)

    def m_trunc() -> str:
        return ".metadata: " + truncate(meta, rng)

    def m_hostile() -> str:
        ctx.sealed, ctx.oracle = True, "safe"
        py = f"open({str(ctx.marker)!r}, 'w').close()"
        if rng.random() < 0.4:
            md = dcp_meta(d)
            where = rng.choice(["storage_meta", "planner_data", "storage_data value", "version"])
            if where == "storage_data value":
                k = rng.choice(list(md.storage_data))
                md.storage_data[k] = _Evil(exec, py)
            elif hasattr(md, where.split()[0]):
                setattr(md, where.split()[0], _Evil(exec, py))
            dcp_put(d, md)
            return f".metadata: a real Metadata whose {where} runs exec on unpickling"
        name, pkl = rng.choice(sorted(hostile_pickles(str(ctx.marker)).items()))
        meta.write_bytes(pkl)
        return f".metadata replaced by a hostile pickle: {name}"

    def m_relpath() -> str:
        md = dcp_meta(d)
        idx, info = rng.choice(list(md.storage_data.items()))
        real = d / info.relative_path
        copy_ = ctx.plant(real)
        choice = rng.choice(
            [
                "abs copy",
                "rel copy",
                "sub copy",
                "fifo new",
                "fifo real",
                "dir",
                "dev",
                "secret",
                "missing",
                "symlink out",
                "not a str",
                "empty",
                "dotdot",
            ]
        )
        if choice == "abs copy":
            rp: Any = str(copy_)
        elif choice == "rel copy":
            rp = f"../outside/{copy_.name}"
        elif choice == "sub copy":
            (d / "sub").symlink_to("../outside", target_is_directory=True)
            rp = f"sub/{copy_.name}"
        elif choice == "fifo new":
            os.mkfifo(d / "fifo.distcp")
            rp = "fifo.distcp"
        elif choice == "fifo real":
            make_fifo(real)
            rp = info.relative_path
        elif choice == "dir":
            rp = rng.choice([".", "", "sub2"])
            (d / "sub2").mkdir()
        elif choice == "dev":
            rp = rng.choice(["/dev/zero", "/dev/urandom", "/proc/self/environ", "/etc/passwd"])
        elif choice == "secret":
            rp = rng.choice(["../outside/secret.bin", str(ctx.secret)])
        elif choice == "missing":
            rp = "nope.distcp"
        elif choice == "symlink out":
            os.symlink(copy_, d / "link.distcp")
            rp = "link.distcp"
        elif choice == "not a str":
            rp = rng.choice([None, 7, b"__0_0.distcp", ["__0_0.distcp"]])
        elif choice == "empty":
            rp = ""
        else:
            rp = f"../{d.name}/{info.relative_path}" if rng.random() < 0.5 else f"x/../{info.relative_path}"
        everywhere = rng.random() < 0.5
        for k, v in list(md.storage_data.items()):
            if k == idx or (everywhere and v.relative_path == info.relative_path):
                md.storage_data[k] = dataclasses.replace(v, relative_path=rp)
        dcp_put(d, md)
        mates = " (and its file-mates)" if everywhere else ""
        return f"relative_path of {idx.fqn}{mates}: {choice} -> {str(rp)[:60]!r}"

    def m_huge() -> str:
        md = dcp_meta(d)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        which = rng.choice(["size", "chunk sizes", "length", "offset", "negative size", "length+1"])
        if which in ("size", "chunk sizes", "negative size"):
            fqn, tm = rng.choice(
                [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
            )
            nd = len(tm.size)
            big = torch.Size([1 << 40] + [1 << 20] * (nd - 1)) if nd else torch.Size([])
            if which == "negative size":
                big = torch.Size([-3] * max(nd, 1))
            if which in ("size", "negative size"):
                tm.size = big
            else:
                tm.chunks[0] = dataclasses.replace(tm.chunks[0], sizes=big)
            dcp_put(d, md)
            return f"{fqn}: {which} -> {list(big)}"
        idx, info = rng.choice(list(md.storage_data.items()))
        if which == "length":
            v = rng.choice([1 << 62, 1 << 31, 1 << 40, 0, -1])
            md.storage_data[idx] = dataclasses.replace(info, length=v)
        elif which == "length+1":
            v = info.length + rng.choice([1, 4096, -1])
            md.storage_data[idx] = dataclasses.replace(info, length=v)
        else:
            v = rng.choice([1 << 62, -5, 1 << 33, info.offset + 1])
            md.storage_data[idx] = dataclasses.replace(info, offset=v)
        dcp_put(d, md)
        return f"{idx.fqn}: {which} -> {v}"

    def m_overlap() -> str:
        md = dcp_meta(d)
        from torch.distributed.checkpoint.metadata import MetadataIndex

        multi = [(k, v) for k, v in md.state_dict_metadata.items() if len(getattr(v, "chunks", [])) >= 2]
        if not multi:
            return m_shape()
        fqn, tm = rng.choice(multi)
        ci = max(range(len(tm.chunks)), key=lambda i: tuple(tm.chunks[i].offsets))
        ch = tm.chunks[ci]
        dim = next((i for i, o in enumerate(ch.offsets) if o > 0), 0)
        new_off = list(ch.offsets)
        new_off[dim] -= 1
        how = rng.choice(["chunk only", "chunk and storage key", "shrink"])
        if how == "shrink":
            sizes = list(ch.sizes)
            sizes[dim] -= 1
            tm.chunks[ci] = dataclasses.replace(ch, sizes=torch.Size(sizes))
        else:
            tm.chunks[ci] = dataclasses.replace(ch, offsets=torch.Size(new_off))
            if how == "chunk and storage key":
                for k in list(md.storage_data):
                    if k.fqn == fqn and k.offset is not None and tuple(k.offset) == tuple(ch.offsets):
                        md.storage_data[MetadataIndex(fqn, torch.Size(new_off), k.index)] = md.storage_data.pop(k)
        dcp_put(d, md)
        return f"{fqn}: chunk {ci} {how} (offsets {list(ch.offsets)} -> {new_off}: overlap + hole)"

    def m_dtype() -> str:
        md = dcp_meta(d)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        fqn, tm = rng.choice(
            [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        )
        new = rng.choice([dt for dt in DTYPES if dt != tm.properties.dtype])
        tm.properties = dataclasses.replace(tm.properties, dtype=new)
        dcp_put(d, md)
        return f"{fqn}: dtype -> {new}"

    def m_shape() -> str:
        md = dcp_meta(d)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        fqn, tm = rng.choice(
            [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata) and len(v.size)]
        )
        s = list(tm.size)
        how = rng.choice(["bigger", "smaller", "transposed", "extra dim"])
        if how == "bigger":
            s[0] += 1
        elif how == "smaller":
            s[0] = max(0, s[0] - 1)
        elif how == "transposed":
            s = s[::-1]
        else:
            s = [*s, 1]
        tm.size = torch.Size(s)
        dcp_put(d, md)
        return f"{fqn}: size {how} -> {s}"

    def m_types() -> str:
        md = dcp_meta(d)
        which = rng.choice(
            [
                "storage_data None",
                "storage_data list",
                "sdm None",
                "chunk None",
                "properties None",
                "fqn int",
                "object md tensor",
                "md dict",
                "md list",
                "md int",
                "index offset str",
            ]
        )
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        tms = [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        if which == "storage_data None":
            md.storage_data = None
        elif which == "storage_data list":
            md.storage_data = list(md.storage_data.values())
        elif which == "sdm None":
            md.state_dict_metadata = None
        elif which == "chunk None":
            rng.choice(tms)[1].chunks[0] = None
        elif which == "properties None":
            rng.choice(tms)[1].properties = None
        elif which == "fqn int":
            k = rng.choice(list(md.storage_data))
            md.storage_data[MetadataIndex(7, k.offset, k.index)] = md.storage_data.pop(k)  # type: ignore[arg-type]
        elif which == "object md tensor":
            objs = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
            if objs:
                md.state_dict_metadata[rng.choice(objs)] = copy.deepcopy(tms[0][1])
        elif which == "index offset str":
            k = rng.choice([k for k in md.storage_data if k.offset is not None])
            bad_idx = MetadataIndex(k.fqn, k.offset, k.index)
            object.__setattr__(bad_idx, "offset", "0")
            md.storage_data[bad_idx] = md.storage_data.pop(k)
        else:
            md = {"md dict": {"state_dict_metadata": {}}, "md list": [md], "md int": 42}[which]
        dcp_put(d, md)
        return f".metadata: {which}"

    def m_swap() -> str:
        md = dcp_meta(d)
        items = tensor_items(md)
        by = {i.fqn: t for i, t in items}
        pairs = [
            (a, b)
            for a in items
            for b in items
            if a[0].fqn != b[0].fqn
            and (dc.tensors[a[0].fqn].dtype, dc.tensors[a[0].fqn].shape)
            != (dc.tensors[b[0].fqn].dtype, dc.tensors[b[0].fqn].shape)
        ]
        del by
        if not pairs:
            return m_shape()
        a, b = rng.choice(pairs)
        md.storage_data[a[0]], md.storage_data[b[0]] = b[1], a[1]
        dcp_put(d, md)
        return f"the storage of {a[0].fqn} and {b[0].fqn} swapped (different dtypes or shapes)"

    def f_flip() -> str:
        p = rng.choice(distcps())
        return f"{p.name}: " + flip_bits(p, rng)

    def f_data_flip() -> str:
        md = dcp_meta(d)
        idx, info = rng.choice(tensor_items(md))
        p = d / info.relative_path
        blob = p.read_bytes()[info.offset : info.offset + info.length]
        zm = zip_map(blob)
        sto = [e for e in (zm.storages() if zm else []) if e.size]
        if not sto:
            return f_flip()
        e = sto[0]
        return f"{p.name} chunk of {idx.fqn}, record {e.name}: " + flip_bits(
            p, rng, info.offset + e.data_off, info.offset + e.data_off + e.size, n=1
        )

    def f_trunc() -> str:
        p = rng.choice(distcps())
        return f"{p.name}: " + truncate(p, rng)

    def f_delete() -> str:
        p = rng.choice(distcps())
        p.unlink()
        return f"{p.name} deleted"

    def f_foreign() -> str:
        fs = distcps()
        if len(fs) < 2:
            return f_data_flip()
        a, b = rng.sample(fs, 2)
        shutil.copyfile(a, b)
        return f"{b.name} replaced by {a.name}"

    def f_meta_fifo() -> str:
        return make_fifo(meta)

    return [
        ("meta_flip", 6, m_flip),
        ("meta_truncate", 4, m_trunc),
        ("meta_hostile", 8, m_hostile),
        ("meta_relative_path", 7, m_relpath),
        ("meta_huge", 4, m_huge),
        ("meta_overlap", 4, m_overlap),
        ("meta_dtype", 2, m_dtype),
        ("meta_shape", 2, m_shape),
        ("meta_types", 3, m_types),
        ("meta_swap_storage", 2, m_swap),
        ("meta_fifo", 1, f_meta_fifo),
        ("distcp_flip", 6, f_flip),
        ("distcp_data_flip", 5, f_data_flip),
        ("distcp_truncate", 3, f_trunc),
        ("distcp_delete", 1, f_delete),
        ("distcp_foreign", 1, f_foreign),
    ]


def case_dcp(ctx: Ctx) -> None:
    d = ctx.dir / "ck"
    dc = dcp_build(ctx, d)
    ctx.env.emit({"ev": "case", "stage": f"saved {dc.variant}"})
    table = [("none", 2, lambda: "no change"), *dcp_mutators(ctx, dc)]
    ctx.mutator, fn = pick(ctx.rng, table)
    if ctx.env.cache.get("force_mutator"):
        ctx.mutator, fn = next((n, f) for n, _w, f in table if n == ctx.env.cache["force_mutator"])
    ctx.detail = f"[{dc.variant}] " + fn()
    if ctx.mutator in ("meta_flip", "meta_truncate"):
        ctx.notes.append("DCP's .metadata has no checksum: a renamed key is accepted")
    ctx.env.emit({"ev": "case", "mutator": ctx.mutator, "detail": ctx.detail[:300]})
    ctx.input_bytes = dir_bytes(ctx.dir)
    rng = ctx.rng

    def same() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt: dict[str, Any] = {k: poisoned(tuple(v.shape), v.dtype) for k, v in dc.tensors.items()}
        exp: dict[str, Any] = dict(dc.tensors)
        for k, v in dc.objects.items():
            tgt[k], exp[k] = None, v
        return tgt, exp

    def other() -> tuple[dict[str, Any], dict[str, Any]]:
        tgt: dict[str, Any] = {}
        exp: dict[str, Any] = {}
        for name, gt in dc.tensors.items():
            lay = other_layout(rng, name, tuple(gt.shape))
            if lay is None:
                tgt[name], exp[name] = poisoned(tuple(gt.shape), gt.dtype), gt
            else:
                tgt[name], exp[name] = target_for(lay, dc.tensors, gt.dtype)
        return tgt, exp

    for which, make in (("same", same), ("other", other)):
        tgt, exp = make()
        ctx.op(
            f"load_{which}",
            lambda tgt=tgt: tierstore.load_sharded(str(d), tgt),
            ctx.same_check(exp, ordered=False),
        )
    want = {**dc.tensors, **dc.objects}
    base = ctx.same_check(want, ordered=False)

    def consolidated(value: Any, w: list[Any]) -> tuple[str, str]:
        outcome, detail = base(value, w)
        if outcome == SILENT and ctx.mutator in ("meta_flip", "meta_truncate") and isinstance(value, dict):
            # DCP metadata carries no checksum: a flipped name is undetectable.
            # Accept a result whose values match the reference under a renaming.
            left = dict(want)
            for v in value.values():
                hit = next((kk for kk, vv in left.items() if compare(v, vv) is None), None)
                if hit is None:
                    return outcome, detail
                del left[hit]
            if not left:
                return ACCEPTED, "keys renamed by the flip (DCP metadata has no checksum)"
        return outcome, detail

    ctx.op("consolidate", lambda: tierstore.sharded.consolidate(str(d)), consolidated)
    ctx.cli_op("inspect", ["inspect", str(d)])
    # verify of a DCP directory reads every chunk one at a time. Named apart from "verify":
    # DCP's metadata has no checksum, so damage that parses cannot be caught, and "verify
    # said OK" is no promise here; it must still end cleanly (no crash, hang or allocation).
    ctx.cli_op("verify_dcp", ["verify", str(d)])


# ----------------------------------------------------------------------------------------------
# kind 4: Checkpointer run directories


def ckpt_states(ctx: Ctx) -> tuple[dict[int, dict[str, Any]], Callable[[int, bool], dict[str, Any]]]:
    rng = ctx.rng
    dts = [rng.choice(DTYPES) for _ in range(3)]
    shapes = [(rng.randint(1, 6), rng.randint(1, 6)), (rng.randint(1, 12),), (rng.randint(4, 8), 4)]
    seed = ctx.seed

    def state(step: int, magic: bool = False) -> dict[str, Any]:
        g = torch.Generator().manual_seed((seed * 7 + step) % (1 << 62))
        t = [rand_tensor(g, s, dt) for s, dt in zip(shapes, dts, strict=True)]
        big = rand_tensor(g, shapes[2], torch.float32)
        if magic:
            t = [magic_like(x) for x in t]
            big = magic_like(big)
        return {
            "model": {"w": t[0], "b": t[1], "big": big},
            "optim": {"m": t[2], "lr": 0.001 * step},
            "step": step,
            "tag": "fuzz",
        }

    return {s: state(s) for s in (1, 2, 3)}, state


def ckpt_tiers(run: Path, remote: bool, codec: str = "") -> list[Any]:
    """The case's tiers: one local tier; or (``remote``) a node-scoped local
    tier and a remote one, so that a load reads each file of the agreed
    step from the nearest copy that holds it intact (per-file fallback).
    ``codec``: the remote tier stores deltas (step 1 a keyframe, steps 2
    and 3 deltas), decoded where a load reads them; its value is what they
    reference (``Delta.reference``: the keyframe, a chain of parents, or
    the better of the two per file)."""
    if not remote:
        return [tierstore.DiskTier(str(run / "local"))]
    rc = tierstore.Delta(keyframe_every=3, reference=codec) if codec else None
    return [tierstore.DiskTier(str(run / "local"), scope="node"), tierstore.RemoteTier(str(run / "remote"), codec=rc)]


def ckpt_save(run: Path, states: dict[int, dict[str, Any]], remote: bool = False, codec: str = "") -> None:
    ck = tierstore.Checkpointer(str(run), tiers=ckpt_tiers(run, remote, codec))
    try:
        for s in sorted(states):
            ck.save(s, states[s])
            ck.wait()
    finally:
        ck.close()


def step_dir(run: Path, s: int) -> Path:
    return run / "local" / f"step-{s:012d}"


def offload_model(seed: int) -> torch.nn.Module:
    """The model of an offloaded-optimizer case (two small layers)."""
    torch.manual_seed(seed % (1 << 62))
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))


def offload_optimizer(model: torch.nn.Module, scratch: Path, subgroup: str = "8KiB") -> Any:
    """AdamW offloaded in ``subgroup``-sized subgroups with 16 KiB of host
    memory: some subgroups resident (checkpointed as tensors in the rank
    file), the others on ``scratch`` (checkpointed as ``offload-*`` files)."""
    return tierstore.offload(
        torch.optim.AdamW,
        model.parameters(),
        lr=1e-3,
        tiers=[tierstore.HostTier("16KiB"), tierstore.DiskTier(str(scratch))],
        subgroup_bytes=subgroup,
    )


def ckpt_offload_save(ctx: Ctx, run: Path, remote: bool, codec: str) -> dict[int, dict[str, Any]]:
    """Steps 1..3 of a model trained with an offloaded optimizer, each saved
    with the optimizer itself in the state (the Checkpointer takes its
    subgroups from the tiers). Returns what ``load_latest()`` must give back
    for each step: the model's tensors and the optimizer's ordinary state
    dict at that step."""
    model = offload_model(ctx.seed)
    opt = offload_optimizer(model, ctx.dir / "scratch")
    ck = tierstore.Checkpointer(str(run), tiers=ckpt_tiers(run, remote, codec))
    states: dict[int, dict[str, Any]] = {}
    try:
        for s in (1, 2, 3):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(ctx.seed * 3 + s))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            opt.wait_io()
            states[s] = {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": copy.deepcopy(opt.state_dict()),
                "step": s,
                "tag": "fuzz",
            }
            ck.save(s, {"model": model.state_dict(), "optim": opt, "step": s, "tag": "fuzz"})
            ck.wait()
    finally:
        ck.close()
        opt.close()
    return states


def ckpt_mutators(
    ctx: Ctx,
    run: Path,
    make_state: Callable[[int, bool], dict[str, Any]],
    codec: str = "",
    offloaded: bool = False,
) -> list[tuple[str, float, Any]]:
    rng = ctx.rng

    def newest() -> Path:
        ctx.damaged_steps.add(3)
        return step_dir(run, 3)

    def raw_damage(d: Path) -> str:
        files = sorted(p for p in d.iterdir() if p.is_file())
        p = rng.choice(files)
        how = rng.choice(["flip", "flip", "truncate", "delete", "fifo", "zero"])
        done = byte_damage(p, rng, how)
        if done is not None:
            return f"{d.name}/{p.name}: " + done
        if how == "delete":
            p.unlink()
            return f"{d.name}/{p.name} deleted"
        return f"{d.name}/" + make_fifo(p)

    def c_manifest_flip() -> str:
        d = newest()
        return "manifest.json: " + flip_bits(d / "manifest.json", rng)

    def c_manifest_trunc() -> str:
        d = newest()
        return "manifest.json: " + truncate(d / "manifest.json", rng)

    def c_manifest_json() -> str:
        d = newest()
        name, fn = pick(rng, manifest_mutators(ctx, d, None))
        return f"{name}: " + fn()

    def c_manifest_null() -> str:
        d = newest()
        raw = rng.choice([b"null", b"[]", b"{}", seal(b"{}"), b""])
        (d / "manifest.json").write_bytes(raw)
        ctx.sealed = raw.startswith(b'{"checksum')
        return f"manifest.json replaced by {raw!r}"

    def meta_mut(d: Path) -> str:
        p = d / "checkpoint.json"
        obj, old = read_json(p)
        ctx.sealed = rng.random() < 0.5
        tree = obj.get("tree", [])
        how = rng.choice(
            ["rename", "swap", "drop tree", "tree type", "entry shape", "deep", "step", "huge", "move", "flip"]
        )
        raw = None
        if how == "flip":
            ctx.sealed = False
            return "checkpoint.json: " + flip_bits(p, rng)
        if how == "rename" and tree:
            e = rng.choice(tree)
            e[1][-1] = e[1][-1] + "_x"
        elif how == "swap" and len(tree) >= 2:
            a, b = rng.sample(range(len(tree)), 2)
            tree[a][1], tree[b][1] = tree[b][1], tree[a][1]
        elif how == "move" and tree:
            e = rng.choice(tree)
            e[1] = ["elsewhere", *e[1]]
        elif how == "drop tree":
            obj.pop("tree", None)
        elif how == "tree type":
            obj["tree"] = rng.choice(
                [
                    None,
                    "tree",
                    {},
                    5,
                    [[1, 2, 3]],
                    [["k"]],
                    [["model.w", "notalist"]],
                    [["model.w", []]],
                    [[None, None]],
                ]
            )
        elif how == "entry shape" and tree:
            tree[0] = rng.choice([[], [tree[0][0]], [tree[0][0], tree[0][1], 3], [tree[0][0], [1, {}]], "x"])
        elif how == "deep":
            obj["tree"] = "__DEEP__"
            raw = json.dumps(obj, separators=(",", ":")).replace('"__DEEP__"', "[" * 100_000 + "]" * 100_000).encode()
        elif how == "step":
            obj["step"] = rng.choice([1, 2, 4, -1, "3", None])
        else:
            obj["world_size"] = rng.choice([0, 2, 1 << 40, None])
        r = write_json(p, obj, sealed=ctx.sealed, old=old, raw=raw)
        if r != "re-sealed":
            ctx.sealed = False
        return f"checkpoint.json: {how} ({r})"

    def c_meta_json() -> str:
        return meta_mut(newest())

    def c_meta_delete() -> str:
        d = newest()
        (d / "checkpoint.json").unlink()
        return "checkpoint.json deleted"

    def c_meta_null() -> str:
        d = newest()
        raw = rng.choice([b"null", b"[]", b"{}", seal(b"{}"), b"", b"\xff"])
        (d / "checkpoint.json").write_bytes(raw)
        return f"checkpoint.json replaced by {raw!r}"

    def c_meta_swap() -> str:
        d = newest()
        shutil.copyfile(step_dir(run, 2) / "checkpoint.json", d / "checkpoint.json")
        return "checkpoint.json replaced by step 2's (valid and sealed)"

    def c_rank_damage() -> str:
        d = newest()
        p = rng.choice(data_files(d, "rank-") + data_files(d, "objects-"))
        how = rng.choice(["flip", "flip", "truncate", "delete", "fifo", "symlink out", "data flip"])
        if how == "flip":
            return f"{p.name}: " + flip_bits(p, rng)
        if how == "data flip":
            zm = zip_map(p.read_bytes())
            sto = [e for e in (zm.storages() if zm else []) if e.size]
            if sto:
                e = rng.choice(sto)
                return f"{p.name} {e.name}: " + flip_bits(p, rng, e.data_off, e.data_off + e.size, n=1)
            return f"{p.name}: " + flip_bits(p, rng)
        if how == "truncate":
            return f"{p.name}: " + truncate(p, rng)
        if how == "delete":
            p.unlink()
            return f"{p.name} deleted"
        if how == "fifo":
            return make_fifo(p)
        c = ctx.plant(p)
        return replace_by_symlink(p, c) + " (identical copy outside)"

    def c_objects_hostile() -> str:
        d = newest()
        got = hostile_objects_file(ctx, d)
        ctx.oracle = "same"  # the fallback rules apply
        return got or c_rank_damage()

    def c_fifo_meta() -> str:
        d = newest()
        return make_fifo(d / rng.choice(["checkpoint.json", "manifest.json"]))

    def c_symlink_foreign() -> str:
        d = newest()
        other = ctx.outside / "run2"
        ckpt_save(other, {s: make_state(s, True) for s in (1, 2, 3)})
        ctx.watch_tree(other)
        target = step_dir(other, rng.choice([3, 3, 2]))
        how = rng.choice(["dir", "dir", "manifest"])
        if how == "dir":
            return replace_by_symlink(d, target) + " (another run, magic values)"
        # The step's own files replaced by the other run's, through symlinks.
        # (A copy of another run's step inside this tier would be a
        # legitimate checkpoint: nothing ties a step to its run.)
        shutil.rmtree(d)
        d.mkdir()
        for f in target.iterdir():
            os.symlink(f, d / f.name)
        return f"{d.name} holds symlinks to every file of another run's step (magic values)"

    def c_symlink_older() -> str:
        d = newest()
        older = rng.choice([1, 2])
        return replace_by_symlink(d, f"step-{older:012d}") + f" (this run's step {older})"

    def c_clone_older() -> str:
        d = newest()
        src = step_dir(run, 2)
        for f in d.iterdir():
            if f.name != "checkpoint.json":
                f.unlink()
        for f in src.iterdir():
            if f.name != "checkpoint.json":
                shutil.copyfile(f, d / f.name)
        return "step 3's data and manifest replaced by step 2's (checkpoint.json of step 3 kept)"

    def c_step_file() -> str:
        d = newest()
        shutil.rmtree(d)
        d.write_bytes(b"not a directory")
        return f"{d.name} replaced by a regular file"

    def c_two() -> str:
        a = raw_damage(newest())
        ctx.damaged_steps.add(2)
        b = raw_damage(step_dir(run, 2))
        return f"step 3: {a}; step 2: {b}"

    def c_all() -> str:
        parts = []
        for s in (3, 2, 1):
            ctx.damaged_steps.add(s)
            d = step_dir(run, s)
            mp = d / "manifest.json"
            how = rng.choice(["manifest flip", "manifest null", "rank delete", "meta delete", "data flip", "data flip"])
            if how == "data flip":
                # The last storage of the rank file: the tensors before it load first.
                p = data_files(d, "rank-")[0]
                zm = zip_map(p.read_bytes())
                sto = [e for e in (zm.storages() if zm else []) if e.size]
                e = max(sto, key=lambda e: e.data_off)
                flip_bits(p, rng, e.data_off, e.data_off + e.size, n=1)
            elif how == "manifest flip":
                flip_bits(mp, rng, n=2)
            elif how == "manifest null":
                mp.write_bytes(b"null")
            elif how == "meta delete":
                (d / "checkpoint.json").unlink()
            else:
                data_files(d, "rank-")[0].unlink()
            parts.append(f"step {s}: {how}")
        return "; ".join(parts)

    def tsd_damage() -> str:
        """One of the remote tier's encoded files damaged (bits, length, its
        header re-sealed with another value, its reference swapped)."""
        files = sorted((run / "remote").glob("step-*/*.tsd"))
        if not files:
            return "no encoded file"
        p = rng.choice(files)
        how = rng.choice(["flip", "flip", "truncate", "zero", "header", "swap"])
        where = f"remote {p.parent.name}/{p.name}: "
        done = byte_damage(p, rng, how)
        if done is not None:
            return where + done
        if how == "swap":
            others = [f for f in files if f != p and f.name.split(".")[0] == p.name.split(".")[0]]
            if others:
                shutil.copyfile(rng.choice(others), p)
                return where + "replaced by another step's encoded file of the same rank"
            return where + flip_bits(p, rng)
        data = bytearray(p.read_bytes())
        hlen = struct.unpack_from("<I", data, len(data) - 16)[0]
        at = len(data) - 16 - hlen
        h = json.loads(bytes(data[at : at + hlen]))
        field = rng.choice(["segment", "bytes", "reference", "label", "references"])
        if field == "references" and h.get("reference") is None:
            field = "reference"
        if field == "segment" and h["segments"]:
            seg = rng.choice(h["segments"])
            i = rng.randrange(len(seg))
            seg[i] = rng.choice([seg[i] + 1, seg[i] - 1, 0, -1, 1 << 40, seg[i] * 2])
        elif field == "bytes":
            h["bytes"] = rng.choice([h["bytes"] + 1, h["bytes"] - 1, 0, 1 << 50])
        elif field == "reference":
            # A later step's file of the same rank: with a chain of parents
            # (step 3 against step 2), a cycle.
            later = [f for f in files if f.parent.name > p.parent.name and f.name.split(".")[0] == p.name.split(".")[0]]
            cyc = rng.choice(later) if later else p
            h["reference"] = rng.choice(
                [
                    None,
                    {"step_dir": "step-000000000002", "name": p.name.removesuffix(".tsd"), "bytes": 1,
                     "manifest_crc32": 0},
                    {"step_dir": "../../..", "name": "etc", "bytes": 1, "manifest_crc32": 0},
                    {"step_dir": cyc.parent.name, "name": cyc.name.removesuffix(".tsd"), "bytes": h["bytes"],
                     "manifest_crc32": 0},
                ]
            )  # fmt: skip
        elif field == "references":
            # Version 2 (a reference per segment): re-sealed as it is (a valid
            # file, which must still load exactly) or with one field wrong.
            ref = h["reference"]
            if h.get("version") != 2:
                h["version"] = 2
                h["references"] = [ref, dict(ref)]
                for seg in h["segments"]:
                    seg.append(0 if seg[3] >= 0 else -1)
            refd = [seg for seg in h["segments"] if seg[3] >= 0]
            what = rng.choice(["valid", "index", "none", "outside", "first", "many"])
            field = f"references ({what})"
            if what == "index" and refd:
                rng.choice(refd)[5] = rng.choice([len(h["references"]), 7, -2])
            elif what == "none" and refd:
                rng.choice(refd)[5] = -1
            elif what == "outside":
                h["references"][-1] = {**ref, "step_dir": "../../..", "name": "etc"}
            elif what == "first":
                h["references"][0] = {**ref, "name": "rank-00099.x.pt"}
            elif what == "many":
                h["references"] = [ref] * 5
        else:
            h["labels"] = rng.choice([[], None, ["x"] * (len(h["segments"]) + 1)])
        hb = json.dumps(h).encode()
        data[at:] = hb + struct.pack("<II", len(hb), zlib.crc32(hb)) + b"TSDELTA1"
        p.write_bytes(bytes(data))
        ctx.sealed = True
        return where + f"header field {field} changed, header re-sealed"

    def c_tsd_only() -> str:
        # The local copies are intact: the load must not need the remote one.
        return tsd_damage()

    def c_tsd_and_local() -> str:
        # Step 3's local data file lost: its remote copy is a delta whose
        # keyframe (step 1) may be the damaged file.
        d = newest()
        data_files(d, "rank-")[0].unlink()
        return f"local {d.name} rank file deleted; " + tsd_damage()

    def c_offload_file() -> str:
        """A subgroup file of step 3's offloaded optimizer damaged, lost,
        or replaced by step 2's (a consistent file of the wrong step: its
        CRC is not the one step 3's entry records)."""
        d = newest()
        files = sorted(d.glob("offload-*"))
        if not files:
            return raw_damage(d)
        p = rng.choice(files)
        how = rng.choice(["flip", "flip", "truncate", "delete", "zero", "older", "extend"])
        where = f"{d.name}/{p.name}: "
        done = byte_damage(p, rng, how)
        if done is not None:
            return where + done
        if how == "delete":
            p.unlink()
            return where + "deleted"
        if how == "extend":
            with open(p, "ab") as f:
                f.write(b"\x5a" * rng.choice([1, 4096]))
            return where + "bytes appended"
        older = step_dir(run, 2) / p.name
        if older.exists():
            shutil.copyfile(older, p)
            return where + "replaced by step 2's file of the same name"
        return where + flip_bits(p, rng)

    def c_offload_meta() -> str:
        d = newest()
        return forged_offload_entry(ctx, d) or raw_damage(d)

    extra: list[tuple[str, float, Any]] = []
    if codec:
        extra = [("remote_tsd_damage", 4, c_tsd_only), ("remote_tsd_and_local", 6, c_tsd_and_local)]
    if offloaded:
        extra += [("step_offload_file", 8, c_offload_file), ("step_offload_meta", 10, c_offload_meta)]
    return [
        *extra,
        ("step_manifest_flip", 5, c_manifest_flip),
        ("step_manifest_truncate", 3, c_manifest_trunc),
        ("step_manifest_json", 8, c_manifest_json),
        ("step_manifest_null", 2, c_manifest_null),
        ("step_meta_json", 6, c_meta_json),
        ("step_meta_delete", 3, c_meta_delete),
        ("step_meta_null", 2, c_meta_null),
        ("step_meta_swap", 1, c_meta_swap),
        ("step_data_damage", 6, c_rank_damage),
        ("step_fifo_metadata", 1, c_fifo_meta),
        ("step_objects_hostile", 2, c_objects_hostile),
        ("step_symlink_foreign", 3, c_symlink_foreign),
        ("step_symlink_older", 2, c_symlink_older),
        ("step_clone_older", 2, c_clone_older),
        ("step_not_a_dir", 1, c_step_file),
        ("two_steps", 3, c_two),
        ("all_steps", 2, c_all),
    ]


def case_checkpointer(ctx: Ctx) -> None:
    run = ctx.dir / "run"
    states, make_state = ckpt_states(ctx)
    # A third of the cases keep a remote copy too: damage to the local copy is
    # then read around file by file (every result must still be exact).
    remote = ctx.rng.random() < 0.33
    # Half of those store deltas on the remote tier (read where the local copy is damaged).
    deltas = remote and ctx.rng.random() < 0.5
    if "tsd" in str(ctx.env.cache.get("force_mutator", "")):
        remote = deltas = True  # a mutator of encoded files needs them
    codec = ctx.rng.choice(["keyframe", "parent", "best"]) if deltas else ""
    # A quarter of the cases checkpoint an offloaded optimizer (its own
    # random stream, so that the other cases of a seed stay as they were).
    offloaded = random.Random(f"offload:{ctx.seed}").random() < 0.25
    if ctx.env.cache.get("force_mutator") in ("step_offload_file", "step_offload_meta"):
        offloaded = True
    if offloaded:
        states = ckpt_offload_save(ctx, run, remote, codec)
    else:
        ckpt_save(run, states, remote, codec)
    ctx.env.emit({"ev": "case", "stage": "saved", "offloaded": offloaded})
    table = [("none", 2, lambda: "no change"), *ckpt_mutators(ctx, run, make_state, codec, offloaded)]
    ctx.mutator, fn = pick(ctx.rng, table)
    if ctx.env.cache.get("force_mutator"):
        ctx.mutator, fn = next((n, f) for n, _w, f in table if n == ctx.env.cache["force_mutator"])
    ctx.detail = fn()
    ctx.env.emit({"ev": "case", "mutator": ctx.mutator, "detail": ctx.detail[:300]})
    ctx.input_bytes = dir_bytes(ctx.dir)
    intact = [s for s in (3, 2, 1) if s not in ctx.damaged_steps]

    def judge(result: Any, restored: Any, wl: list[Any], got: Any) -> tuple[str, str]:
        if restored is None:
            if result is not None:
                return SILENT, "returned a state but restored is None"
            if intact:
                return SILENT, f"returned None although step {intact[0]} was never touched"
            return CLEAN, "no usable checkpoint (all damaged): None"
        step = restored.get("step") if isinstance(restored, dict) else None
        if step not in states:
            return SILENT, f"restored names step {step!r}"
        d = compare(got, states[step], ordered=False)
        if d is not None:
            # Which state does it hold, if any?
            for s, st in states.items():
                if compare(got, st, ordered=False) is None:
                    return SILENT, f"restored says step {step} but the data is step {s}'s"
            return SILENT, f"restored step {step}: {d}"
        if intact and step < intact[0]:
            return SILENT, f"fell back to step {step} past step {intact[0]}, which was never touched"
        if step < 3:
            msgs = [str(w.message) for w in wl if issubclass(w.category, UserWarning)]
            for s in range(3, step, -1):
                sd = step_dir(run, s)
                if not (sd / "manifest.json").exists() and not (sd / "manifest.json").is_symlink():
                    continue  # an incomplete step is skipped without a word
                named = rf"(\bstep {s}\b|step-{s:012d})"
                if not any(re.search(named, m) and "local" in m for m in msgs):
                    return (
                        SILENT,
                        f"fell back from step {s} to {step} without a warning naming step {s} and tier 'local'",
                    )
            return EQUAL, f"fell back to step {step} with a warning"
        return EQUAL, ""

    def fresh() -> Any:
        # Each op stands for a fresh process: warnings given "once per
        # process" by an earlier case or op must be given again.
        warned = getattr(tierstore.checkpointer, "_WARNED", None)
        if isinstance(warned, set):
            warned.clear()
        return tierstore.Checkpointer(str(run), tiers=ckpt_tiers(run, remote, codec))

    box: dict[str, Any] = {}

    def plain() -> Any:
        ck = fresh()
        try:
            box["result"] = ck.load_latest()
            box["restored"] = ck.restored
        finally:
            ck.close(wait=False)
        return box["result"]

    ctx.op("load_latest", plain, lambda r, wl: judge(r, box.get("restored"), wl, r))

    def template() -> dict[str, Any]:
        st = states[3]
        if offloaded:
            # A fresh model's offloaded optimizer (no state yet) takes the
            # optimizer's part in place; with other subgroups than the saved
            # ones in half the cases (the state is then re-partitioned).
            n = len(into_box.setdefault("opts", []))
            opt = offload_optimizer(offload_model(ctx.seed + 1), ctx.dir / f"scratch-into-{n}", into_subgroup)
            into_box["opts"].append(opt)
            optim: Any = opt
        else:
            optim = {"m": poisoned(tuple(st["optim"]["m"].shape), st["optim"]["m"].dtype), "lr": None}
        return {
            "model": {k: poisoned(tuple(v.shape), v.dtype) for k, v in st["model"].items()},
            "optim": optim,
            "step": None,
            "tag": None,
        }

    into_subgroup = random.Random(f"offload-into:{ctx.seed}").choice(["8KiB", "8KiB", "4KiB", "64KiB"])

    def as_state(d: dict[str, Any]) -> dict[str, Any]:
        """``into`` as the state it holds (an offloaded optimizer as its
        ordinary state dict)."""
        o = d["optim"]
        return {**d, "optim": o.state_dict()} if isinstance(o, tierstore.OffloadedOptimizer) else d

    into_box: dict[str, Any] = {}

    def into() -> Any:
        ck = fresh()
        try:
            into_box["into"] = template()
            into_box["before"] = as_state(template())
            into_box["result"] = ck.load_latest(into=into_box["into"])
            into_box["restored"] = ck.restored
        finally:
            ck.close(wait=False)
            into_box["held"] = as_state(into_box["into"]) if "into" in into_box else None
            for o in into_box.pop("opts", []):
                o.close()
        return into_box["result"]

    def judge_into(r: Any, wl: list[Any]) -> tuple[str, str]:
        if r is not None and r is not into_box["into"]:
            return SILENT, "load_latest(into=...) returned something other than `into`"
        if r is None and into_box.get("restored") is None:
            d = compare(into_box["held"], into_box["before"], ordered=False)
            if d is not None:
                return SILENT, f"returned None, but `into` was changed by the failed attempts ({d})"
        return judge(r, into_box.get("restored"), wl, into_box["held"] if r is not None else None)

    ctx.op("load_latest_into", into, judge_into)


KINDS: dict[str, Callable[[Ctx], None]] = {
    "single": case_single,
    "sharded": case_sharded,
    "dcp": case_dcp,
    "checkpointer": case_checkpointer,
}


SELFTESTS = (
    "__hang__",
    "__crash__",
    "__memory__",
    "__code__",
    "__outside__",
    "__silent__",
    "__other__",
    "__gc_off__",
    "__read_left__",
)


def selftest(ctx: Ctx, what: str) -> None:
    """Makes the outcome ``what`` happen inside an op, to check that the
    campaign detects and classifies it (tests/fuzz/test_fuzz_campaign.py)."""
    ctx.mutator = what
    ctx.detail = "harness self-test"
    ctx.oracle = "same"
    ctx.env.emit({"ev": "case", "mutator": what, "detail": ctx.detail})
    actions: dict[str, Callable[[], Any]] = {
        "__hang__": lambda: time.sleep(3600),
        "__crash__": os.abort,
        "__memory__": lambda: bytearray(64 << 30),
        "__code__": lambda: ctx.marker.write_bytes(b"ran"),
        "__outside__": lambda: {"t": torch.frombuffer(bytearray(ctx.secret.read_bytes()[:64]), dtype=torch.uint8)},
        "__silent__": lambda: {"t": torch.ones(3)},
        "__other__": lambda: {}["missing"],
        "__gc_off__": lambda: (_gc.begin(), {"t": torch.zeros(3)})[1],  # a pause never ended
        # a reader thread that outlives its load
        "__read_left__": lambda: (
            threading.Thread(target=time.sleep, args=(3,), name="tierstore-read_0", daemon=True).start(),
            {"t": torch.zeros(3)},
        )[1],
    }
    want = {"t": torch.zeros(3)}
    ctx.op("selftest", actions[what], ctx.same_check(want))


def run_case(env: Env, kind: str, seed: int) -> dict[str, Any]:
    """Builds, mutates and loads one case; returns its verdict."""
    ctx = Ctx(env, kind, seed)
    try:
        forced = env.cache.get("force_mutator")
        if forced in SELFTESTS:
            selftest(ctx, forced)
        else:
            KINDS[kind](ctx)
    except BaseException as e:  # the harness itself (building or mutating)
        ctx.ops.append(
            {
                "op": "harness",
                "load": False,
                "outcome": HARNESS,
                "exc": fmt_exc(e),
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        if env.verbose:
            traceback.print_exc()
    if not gc.isenabled():
        off = "gc.isenabled() is False after the case"
        ctx.ops.append({"op": "collector", "load": False, "outcome": GC_OFF, "exc": off})
        gc.enable()  # the next case starts as this one did
    left = [t.name for t in threading.enumerate() if t.name.startswith("tierstore-read")]
    if left:
        ctx.ops.append({"op": "readers", "load": False, "outcome": READS_LEFT, "exc": f"threads still running: {left}"})
    return ctx.verdict()


def warm_up(env: Env) -> None:
    """Runs one control case of each kind, so that every thread, pool and
    lazy import exists before the address-space limit is set."""
    env.cache["force_mutator"] = "none"
    try:
        for kind in KINDS:
            if kind in ("sharded", "dcp") and env.template is None:
                pass
            v = run_case(env, kind, 0)
            if v["class"] != EQUAL:
                print(f"warm-up {kind}: {v['class']} {json.dumps(v['ops'])[:2000]}", file=sys.stderr)
    finally:
        env.cache.pop("force_mutator", None)
    for k in range(6):
        dcp_single_template(env, k)
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buf)
