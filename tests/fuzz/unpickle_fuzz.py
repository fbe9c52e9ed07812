#!/usr/bin/env python
"""Differential fuzzing of the weights-only fast path against torch.

``tierstore.load(weights_only=True)`` first runs ``data.pkl`` through a Rust
re-implementation of torch's weights-only unpickler
(``rust/py/src/unpickle.rs``, called by ``tierstore._pickle.fast_weights_only``),
which either returns the object or *declines* (returns ``None``), and then
torch's own ``torch._weights_only_unpickler`` runs. This script generates
pickles (structured programs of the opcodes torch's checkpoints use, random
opcode streams with random arguments, and mutations of ``data.pkl`` files
that ``torch.save`` wrote: opcodes deleted, duplicated, swapped, inserted,
their arguments changed, bytes flipped, the stream cut short) and checks, for
each case, two things:

``direct``: the fast path and ``torch._weights_only_unpickler.Unpickler`` on
the same bytes, with the same persistent loader (modelled on ``torch.load``'s).
The fast path must return what torch returns (types, values, bit patterns of
floats, tensors' dtype/shape/stride/bytes, the sharing of objects), or decline,
or raise where torch raises; it must never return an object where torch
raises, and never hand the persistent loader an id that torch's unpickler
would have refused (torch checks ``type(pid)`` and ``pid[0] == "storage"``).

``load``: the pickle as ``data.pkl`` of a torch zip archive with storage
records, loaded by ``tierstore.load(weights_only=True)`` and by
``torch.load(weights_only=True)``: tierstore must return what torch returns
or raise where torch raises, never return an object where torch raises.

Where tierstore refuses on purpose what torch accepts (a ``bytearray`` larger
than the pickle, tuples nested over 1,000 deep), the case is counted as an
intended refusal, not a finding.

::

    .venv/bin/python tests/fuzz/unpickle_fuzz.py --cases 20000 --seed 1       # a long run
    .venv/bin/python tests/fuzz/unpickle_fuzz.py --replay 1:4711 --show        # one case, disassembled
    .venv/bin/python tests/fuzz/unpickle_fuzz.py --replay 1:4711 --minimize    # its smallest pickle

Seeds: case ``i`` of a run with ``--seed s`` is ``s:i``; every run starts with the same
catalogue cases (each allow-listed and refused global alone and called), ``catalogue:i``. The exit status is 1
when there is any finding. ``tests/test_i13_b_unpickle_fuzz.py`` runs a short
seeded campaign in a subprocess (``--json``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import pickle
import pickletools
import random
import struct
import sys
import tempfile
import time
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import memlimit
import torch
from torch import _weights_only_unpickler as wo

import tierstore
from tierstore import _pickle

P2 = b"\x80\x02"

# ----------------------------------------------------------------------------------------------
# opcode encoders


def u(s: str | bytes) -> bytes:
    b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return b"X" + struct.pack("<I", len(b)) + b


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def integer(v: int, rng: random.Random | None = None) -> bytes:
    forms: list[bytes] = []
    if 0 <= v < 256:
        forms.append(b"K" + bytes([v]))
    if 0 <= v < 65536:
        forms.append(b"M" + struct.pack("<H", v))
    if -(2**31) <= v < 2**31:
        forms.append(b"J" + struct.pack("<i", v))
    enc = pickle.encode_long(v)
    if len(enc) < 256:
        forms.append(b"\x8a" + bytes([len(enc)]) + enc)
    if not forms:
        forms.append(b"\x8b" + struct.pack("<I", len(enc)) + enc)  # LONG4
    return rng.choice(forms) if rng else forms[0]


def flt(x: float) -> bytes:
    return b"G" + struct.pack(">d", x)


def tup(*items: bytes, rng: random.Random | None = None) -> bytes:
    if len(items) == 0:
        return b")"
    if 1 <= len(items) <= 3 and (rng is None or rng.random() < 0.7):
        return b"".join(items) + {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)]
    return b"(" + b"".join(items) + b"t"


def reduce(fn: bytes, *args: bytes, rng: random.Random | None = None) -> bytes:
    return fn + tup(*args, rng=rng) + b"R"


def persid(key: str, numel: int, stype: str = "FloatStorage", loc: str = "cpu", first: bytes | None = None) -> bytes:
    head = first if first is not None else u("storage")
    return b"(" + head + glob("torch", stype) + u(key) + u(loc) + integer(numel) + b"tQ"


# Every opcode of pickle protocols 0-5 (pickletools' table), for random streams.
OPCODES = {op.code.encode("latin-1"): op for op in pickletools.opcodes}

# ----------------------------------------------------------------------------------------------
# storages: the records every case may name


STORAGE_TYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": torch.uint8,
}


def pool_records() -> dict[str, bytes]:
    rng = random.Random(12345)
    return {
        "0": bytes(rng.randrange(256) for _ in range(64)),
        "1": bytes(rng.randrange(256) for _ in range(16)),
        "2": b"",
        "3": bytes(rng.randrange(2) for _ in range(40)),  # valid as bool too
    }


# ----------------------------------------------------------------------------------------------
# persistent loaders


def decode_ascii(v: Any) -> Any:
    return v.decode("ascii") if isinstance(v, bytes) else v


def torch_rule_allows(pid: Any) -> bool:
    """Whether torch's weights-only unpickler hands ``pid`` to its persistent loader."""
    if type(pid) is not tuple and type(pid) is not int:
        return False
    return not (type(pid) is tuple and len(pid) > 0 and decode_ascii(pid[0]) != "storage")


def make_persistent_load(records: dict[str, bytes], seen: list[Any]) -> Callable[[Any], Any]:
    """``torch.load``'s persistent loader (``torch.serialization._load``), over ``records``."""
    loaded: dict[Any, Any] = {}

    def persistent_load(saved_id: Any) -> Any:
        seen.append(saved_id)
        assert isinstance(saved_id, tuple)
        typename = decode_ascii(saved_id[0])
        assert typename == "storage", f"Unknown typename for persistent_load, expected 'storage' but got '{typename}'"
        storage_type, key, location, numel = saved_id[1:]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key in loaded:
            return loaded[key]
        nbytes = numel * torch._utils._element_size(dtype)
        rec = records[key]
        if len(rec) != nbytes:
            raise RuntimeError(f"record size ({len(rec)} bytes) does not match expected size ({nbytes} bytes)")
        # torch's storages of records are not resizable, empty ones included
        raw = torch.frombuffer(bytearray(rec or b"\0"), dtype=torch.uint8).untyped_storage()[0 : len(rec)]
        decode_ascii(location)
        typed = torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        loaded[key] = typed
        return typed

    return persistent_load


# ----------------------------------------------------------------------------------------------
# comparing results


class UncomparableError(Exception):
    pass


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(a: Any, b: Any) -> str | None:
    """None when ``a`` and ``b`` are the same result (deep, with aliasing), else why not;
    ``UncomparableError`` when comparing them raises (a tensor's ``==`` in a dict key, ...)."""
    try:
        return _same(a, b)
    except UncomparableError:
        raise
    except Exception as e:
        raise UncomparableError(f"{type(e).__name__}: {e}") from None


def _same(a: Any, b: Any) -> str | None:
    pairs: dict[int, int] = {}
    back: dict[int, int] = {}
    keep: list[Any] = []  # ids stay valid while compared
    stack: list[tuple[Any, Any, str]] = [(a, b, "$")]
    steps = 0
    while stack:
        x, y, where = stack.pop()
        steps += 1
        if steps > 200_000:
            raise UncomparableError("too large to compare")
        if type(x) is not type(y):
            return f"{where}: {type(x).__name__} vs {type(y).__name__}"
        if isinstance(x, (list, dict, set, bytearray, torch.Tensor, torch.storage.TypedStorage, tuple)):
            ix, iy = id(x), id(y)
            if ix in pairs or iy in back:
                if pairs.get(ix) != iy or back.get(iy) != ix:
                    return f"{where}: objects shared differently"
                continue
            pairs[ix], back[iy] = iy, ix
            keep += [x, y]
        if isinstance(x, float):
            if _bits(x) != _bits(y):
                return f"{where}: {x!r} vs {y!r}"
        elif isinstance(x, complex):
            if _bits(x.real) + _bits(x.imag) != _bits(y.real) + _bits(y.imag):
                return f"{where}: {x!r} vs {y!r}"
        elif isinstance(x, (int, str, bytes, bytearray, type(None), bool, torch.dtype, torch.device, torch.layout)):
            if x != y:
                return f"{where}: {x!r:.80} vs {y!r:.80}"
        elif isinstance(x, torch.Size):
            if tuple(x) != tuple(y):
                return f"{where}: {x} vs {y}"
        elif isinstance(x, (tuple, list)):
            if len(x) != len(y):
                return f"{where}: lengths {len(x)} vs {len(y)}"
            stack += [(xi, yi, f"{where}[{i}]") for i, (xi, yi) in enumerate(zip(x, y, strict=True))]
        elif isinstance(x, dict):
            kx, ky = list(x.keys()), list(y.keys())
            if len(kx) != len(ky):
                return f"{where}: {len(kx)} vs {len(ky)} keys"
            for i, (k1, k2) in enumerate(zip(kx, ky, strict=True)):
                stack.append((k1, k2, f"{where}.key[{i}]"))
                stack.append((x[k1], y[k2], f"{where}[{k1!r:.30}]"))
            if isinstance(x, OrderedDict) and not isinstance(x, Counter):
                stack.append((dict(x.__dict__), dict(y.__dict__), f"{where}.__dict__"))
        elif isinstance(x, (set, frozenset)):
            try:  # by repr: a set of NaNs is not equal to itself
                if sorted(f"{type(v).__name__}:{v!r}" for v in x) != sorted(f"{type(v).__name__}:{v!r}" for v in y):
                    return f"{where}: sets differ"
            except Exception as e:
                raise UncomparableError(f"set: {e}") from None
        elif isinstance(x, torch.storage.TypedStorage):
            if x.dtype != y.dtype or bytes(x.untyped()) != bytes(y.untyped()):
                return f"{where}: storages differ"
        elif isinstance(x, torch.Tensor):
            why = _tensor_diff(x, y)
            if why:
                return f"{where}: {why}"
        elif isinstance(x, type) or callable(x):
            if x is not y:
                return f"{where}: {x!r:.60} is not {y!r:.60}"
        elif isinstance(x, torch.serialization.StorageType):
            if x.dtype != y.dtype:
                return f"{where}: {x} vs {y}"
        else:
            try:
                if not (x is y or x == y):
                    return f"{where}: {x!r:.60} vs {y!r:.60}"
            except Exception as e:
                raise UncomparableError(f"{type(x).__name__}: {e}") from None
    return None


def _tensor_diff(x: torch.Tensor, y: torch.Tensor) -> str | None:
    facts = lambda t: (  # noqa: E731
        t.dtype,
        t.layout,
        t.device.type,
        tuple(t.shape),
        t.stride() if t.layout == torch.strided else None,
        t.storage_offset() if t.layout == torch.strided else None,
        t.requires_grad,
        type(t),
    )
    if facts(x) != facts(y):
        return f"tensors {facts(x)} vs {facts(y)}"
    if x.layout != torch.strided or x.device.type == "meta" or x.is_quantized:
        return None if str(x) == str(y) else "tensors print differently"
    if x.numel() and x.untyped_storage().nbytes():
        ax, ay = x.detach().contiguous().view(-1), y.detach().contiguous().view(-1)
        if ax.element_size() > 0 and bytes(ax.untyped_storage()) != bytes(ay.untyped_storage()):
            return "tensor bytes differ"
    if bytes(x.untyped_storage()) != bytes(y.untyped_storage()):
        return "storages of the tensors differ"
    return None


# ----------------------------------------------------------------------------------------------
# generating cases


GLOBALS_OK = [
    ("collections", "OrderedDict"),
    ("collections", "Counter"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch", "FloatStorage"),
    ("torch", "LongStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "UntypedStorage"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch", "int64"),
    ("torch", "bool"),
    ("torch", "float8_e4m3fn"),
    ("torch", "uint16"),
    ("torch", "per_tensor_affine"),
    ("torch.serialization", "_get_layout"),
    ("_codecs", "encode"),
    ("builtins", "bytearray"),
    ("builtins", "set"),
    ("builtins", "complex"),
]
GLOBALS_BAD = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "getattr"),
    ("builtins", "print"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("subprocess", "Popen"),
    ("sys", "modules"),
    ("torch", "load"),
    ("torch", "ones"),
    ("torch.serialization", "os"),
    ("collections", "OrderedDic"),
    ("collections", "defaultdict"),
    ("__builtin__", "set"),  # torch maps Python 2 names (IMPORT_MAPPING), the fast path declines
    ("__builtin__", "bytearray"),
    ("copy_reg", "_reconstructor"),
    ("UserDict", "UserDict"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.nested._internal.nested_tensor", "NestedTensor"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("torch._utils", "_rebuild_sparse_tensor"),
    ("torch", "sparse_coo"),
    ("torch", "SparseFloatTensor" if hasattr(torch, "SparseFloatTensor") else "FloatTensor"),
    ("", ""),
    ("torch", ""),
    ("collections\x00", "OrderedDict"),
]
STRINGS = ["storage", "cpu", "meta", "cuda:0", "0", "1", "_metadata", "version", "w", "b", "latin1", "utf-8", "", "é✓"]


@dataclass
class Case:
    seed: str
    source: str
    pickle: bytes
    records: dict[str, bytes]
    note: str = ""


class Gen:
    """Structured programs: each ``value()`` pushes exactly one object."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.memo: list[int] = []
        self.next_memo = 0

    def put(self, code: bytes) -> bytes:
        if self.rng.random() < 0.25:
            i = self.next_memo if self.rng.random() < 0.9 else self.rng.choice([0, 255, 256, 2**31])
            self.next_memo += 1
            self.memo.append(i)
            return code + (b"q" + bytes([i]) if i < 256 else b"r" + struct.pack("<I", i))
        return code

    def get(self) -> bytes | None:
        if not self.memo:
            return None
        i = self.rng.choice(self.memo)
        return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)

    def scalar(self) -> bytes:
        r = self.rng
        k = r.randrange(10)
        if k == 0:
            return r.choice([b"N", b"\x88", b"\x89"])
        if k <= 3:
            v = r.choice([0, 1, -1, 7, 255, 256, 65535, 65536, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 2**64, 10**30])
            return integer(v if r.random() < 0.8 else r.randrange(-(10**6), 10**6), r)
        if k <= 5:
            return flt(r.choice([0.0, -0.0, 1.5, -2.25, math.inf, -math.inf, math.nan, 1e-310, 1e308, r.random()]))
        if k <= 8:
            return u(r.choice(STRINGS))
        return u(r.choice(["\ud800", "a\udfff", "x" * 300]))  # lone surrogates: torch decodes with surrogatepass

    def hashable(self) -> bytes:
        return self.scalar() if self.rng.random() < 0.9 else tup(self.scalar(), self.scalar(), rng=self.rng)

    def storage(self) -> bytes:
        r = self.rng
        stype = r.choice(list(STORAGE_TYPES))
        key = r.choice(["0", "1", "2", "3"] * 5 + ["9", "", "00"])
        nbytes = {"0": 64, "1": 16, "2": 0, "3": 40}.get(key, 8)
        item = torch._utils._element_size(STORAGE_TYPES[stype])
        numel = nbytes // item if r.random() < 0.85 else r.choice([0, 1, 3, nbytes, nbytes // item + 1, -1, 2**40])
        first = None
        if r.random() < 0.08:
            first = r.choice(
                [
                    reduce(glob("_codecs", "encode"), u("storage"), u("latin1")),  # bytes b"storage": torch decodes
                    reduce(glob("builtins", "bytearray"), reduce(glob("_codecs", "encode"), u("storage"), u("latin1"))),
                    b"]" + b"(" + b"".join(integer(c) for c in b"storage") + b"e",  # a list of the bytes
                    u("Storage"),
                    u(""),
                    b"N",
                ]
            )
        loc = r.choice(["cpu"] * 8 + ["meta", "cuda:0", "", "mps"])
        return persid(key, numel, stype, loc, first)

    def tensor(self, depth: int) -> bytes:
        r = self.rng
        st = self.storage()
        n = r.choice([0, 1, 2, 4, 8, 16])
        shape: tuple[int, ...] = r.choice([(n,), (2, n // 2 or 1), (), (n, 1), (1, 1, n)])
        stride = tuple(int(math.prod(shape[i + 1 :])) for i in range(len(shape)))
        if r.random() < 0.1:
            stride = tuple(r.choice([0, 1, 2, -1]) for _ in shape)
        off = 0 if r.random() < 0.9 else r.choice([1, 3, 2**40, -1])
        size_b = (
            tup(*(integer(s) for s in shape), rng=r)
            if r.random() < 0.9
            else reduce(glob("torch", "Size"), tup(*(integer(s) for s in shape)))
        )
        stride_b = tup(*(integer(s) for s in stride), rng=r)
        hooks = reduce(glob("collections", "OrderedDict")) if r.random() < 0.9 else b"}"
        args = [st, integer(off), size_b, stride_b, r.choice([b"\x89", b"\x88"]), hooks]
        if r.random() < 0.05:
            args = args[: r.randrange(len(args))]
        if r.random() < 0.05:
            args.append(self.value(depth + 1))
        t = reduce(glob("torch._utils", "_rebuild_tensor_v2"), *args, rng=r)
        if r.random() < 0.15:
            t = reduce(glob("torch._utils", "_rebuild_parameter"), t, r.choice([b"\x88", b"\x89"]), b"}", rng=r)
        return t

    def value(self, depth: int = 0) -> bytes:
        r = self.rng
        if depth > 4 or r.random() < 0.25:
            if r.random() < 0.1 and (g := self.get()) is not None:
                return g
            return self.put(self.scalar())
        k = r.randrange(17)
        if k == 16:
            return self.misuse(depth)
        if k == 0:
            items = [self.value(depth + 1) for _ in range(r.randrange(5))]
            return self.put(tup(*items, rng=r))
        if k in (1, 2):
            body = [self.value(depth + 1) for _ in range(r.randrange(5))]
            if body and r.random() < 0.5:
                return self.put(b"]") + b"(" + b"".join(body) + b"e"
            return self.put(b"]") + b"".join(v + b"a" for v in body)
        if k in (3, 4, 5):
            head = b"}" if r.random() < 0.6 else reduce(glob("collections", r.choice(["OrderedDict", "Counter"])))
            pairs = [(self.hashable(), self.value(depth + 1)) for _ in range(r.randrange(4))]
            out = self.put(head)
            if pairs and r.random() < 0.5:
                out += b"(" + b"".join(k_ + v for k_, v in pairs) + b"u"
            else:
                out += b"".join(k_ + v + b"s" for k_, v in pairs)
            if head != b"}" and r.random() < 0.3:
                out += b"}" + u("_metadata") + b"}" + u("") + b"}" + u("version") + integer(1) + b"sss" + b"b"
            return out
        if k in (6, 7, 8):
            return self.put(self.tensor(depth))
        if k == 9:
            return self.put(reduce(glob("builtins", "set"), b"](" + self.hashable() + self.hashable() + b"e"))
        if k == 10:
            return self.put(reduce(glob("_codecs", "encode"), u(r.choice(["abc", "é", ""])), u("latin1")))
        if k == 11:
            arg = (
                reduce(glob("_codecs", "encode"), u("xyz"), u("latin1"))
                if r.random() < 0.7
                else integer(r.choice([0, 5, 100, 5000]))
            )
            return self.put(reduce(glob("builtins", "bytearray"), arg))
        if k == 12:
            return self.put(
                reduce(glob("builtins", "complex"), flt(1.5), self.scalar() if r.random() < 0.3 else flt(-2))
            )
        if k == 13:
            return self.put(reduce(glob("torch", "device"), u(r.choice(["cpu", "meta", "cuda", "cuda:1", "bogus"]))))
        if k == 14:
            return self.put(glob(*r.choice(GLOBALS_OK)) if r.random() < 0.5 else glob(*r.choice(GLOBALS_BAD)))
        return self.put(reduce(glob("torch", "Size"), tup(*(integer(r.randrange(5)) for _ in range(r.randrange(4))))))

    def misuse(self, depth: int) -> bytes:
        """An opcode that changes an object, applied to an object of any kind (torch allows
        SETITEM(S) on dict, OrderedDict and Counter, APPEND(S) on lists, BUILD on OrderedDict,
        tensors, parameters and allow-listed classes)."""
        r = self.rng
        target = r.choice(
            [
                b"}",
                b"]",
                b")",
                u("s"),
                integer(3),
                reduce(glob("collections", "OrderedDict")),
                reduce(glob("collections", "Counter")),
                reduce(glob("builtins", "set"), b"]"),
                reduce(glob("torch", "Size"), tup(integer(2))),
                reduce(glob("torch", "device"), u("cpu")),
                glob("collections", "OrderedDict"),
                self.tensor(depth + 1),
            ]
        )
        op = r.choice(["s", "u", "a", "e", "b", "b"])
        if op == "s":
            return target + self.hashable() + self.value(depth + 1) + b"s"
        if op == "u":
            return target + b"(" + self.hashable() + self.value(depth + 1) + b"u"
        if op == "a":
            return target + self.value(depth + 1) + b"a"
        if op == "e":
            return target + b"(" + self.value(depth + 1) + self.value(depth + 1) + b"e"
        state = r.choice([b"}" + u("x") + integer(1) + b"s", b"}", b"N", tup(b"}", b"}"), b"]"])
        return target + state + b"b"

    def program(self) -> bytes:
        body = self.value()
        head = P2 if self.rng.random() < 0.95 else self.rng.choice([b"", b"\x80\x03", b"\x80\x04", b"\x80\x02\x80\x02"])
        return head + body + b"."


def random_op(rng: random.Random) -> bytes:
    """One opcode of any protocol with a random argument of its kind."""
    code = rng.choice(list(OPCODES))
    op = OPCODES[code]
    arg = op.arg
    if arg is None:
        return code
    name = arg.name
    if name in ("uint1",):
        return code + bytes([rng.randrange(256)])
    if name == "uint2":
        return code + struct.pack("<H", rng.randrange(65536))
    if name in ("int4", "uint4"):
        return code + struct.pack("<I", rng.choice([0, 1, 5, 255, 2**31 - 1, 2**32 - 1]))
    if name == "uint8":
        return code + struct.pack("<Q", rng.choice([0, 1, 5]))
    if name == "float8":
        return code + struct.pack(">d", rng.random())
    if name == "long1":
        b = pickle.encode_long(rng.choice([0, 1, -1, 2**64, -(2**70)]))
        return code + bytes([len(b)]) + b
    if name == "long4":
        b = pickle.encode_long(rng.choice([0, 2**100]))
        return code + struct.pack("<i", len(b)) + b
    if name in ("stringnl_noescape_pair",):
        m, n = rng.choice(GLOBALS_OK + GLOBALS_BAD)
        return code + m.encode() + b"\n" + n.encode() + b"\n"
    if name in ("decimalnl_short", "decimalnl_long"):
        return code + str(rng.choice([0, 1, 7, -3])).encode() + (b"L" if name.endswith("long") else b"") + b"\n"
    if name in ("floatnl",):
        return code + b"1.5\n"
    if name in ("stringnl", "stringnl_noescape", "unicodestringnl"):
        return code + b"'storage'\n" if name == "stringnl" else code + b"storage\n"
    if name in ("string1", "bytes1", "unicodestring1"):
        s = rng.choice([b"storage", b"cpu", b"\xff\xfe", b""])
        return code + bytes([len(s)]) + s
    if name in ("string4", "bytes4", "unicodestring4"):
        s = rng.choice([b"storage", b"cpu", b"\xed\xa0\x80", b""])
        return code + struct.pack("<I", len(s)) + s
    if name in ("bytes8", "unicodestring8", "bytearray8"):
        s = b"abc"
        return code + struct.pack("<Q", len(s)) + s
    return code


def ops_of(data: bytes) -> list[bytes]:
    """``data`` cut into opcodes (with their arguments); the tail that does not parse is one piece."""
    out: list[bytes] = []
    last = 0
    try:
        for _op, _arg, pos in pickletools.genops(data):
            if pos > last:
                out.append(data[last:pos])
            last = pos
    except Exception:
        pass
    out.append(data[last:])
    return [p for p in out if p]


def mutate(data: bytes, rng: random.Random, n: int) -> tuple[bytes, list[str]]:
    notes = []
    for _ in range(n):
        ops = ops_of(data)
        k = rng.randrange(10)
        i = rng.randrange(len(ops)) if ops else 0
        if k == 0 and ops:
            del ops[i]
            notes.append(f"del op {i}")
        elif k == 1 and ops:
            ops.insert(i, ops[i])
            notes.append(f"dup op {i}")
        elif k == 2 and len(ops) > 1:
            j = rng.randrange(len(ops))
            ops[i], ops[j] = ops[j], ops[i]
            notes.append(f"swap ops {i},{j}")
        elif k in (3, 4):
            ops.insert(i, random_op(rng))
            notes.append(f"insert op at {i}")
        elif k == 5 and ops:
            ops[i] = random_op(rng)
            notes.append(f"replace op {i}")
        elif k == 6 and ops:
            ops = ops[: i + 1]
            notes.append(f"cut after op {i}")
        elif k == 7:
            b = bytearray(b"".join(ops))
            if b:
                j = rng.randrange(len(b))
                b[j] ^= 1 << rng.randrange(8)
                notes.append(f"flip byte {j}")
            ops = [bytes(b)]
        elif k == 8:
            b = bytearray(b"".join(ops))
            j = rng.randrange(len(b) + 1)
            b[j:j] = bytes([rng.randrange(256)])
            ops = [bytes(b)]
            notes.append(f"insert byte at {j}")
        else:
            ops.insert(i, Gen(rng).value(2))
            notes.append(f"insert value at {i}")
        data = b"".join(ops)
    return data, notes


def torch_corpus() -> list[tuple[str, bytes, dict[str, bytes]]]:
    """``data.pkl`` and storage records of files ``torch.save`` wrote."""
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(12, dtype=torch.float32)
    objs: dict[str, Any] = {
        "module": lin.state_dict(),
        "optimizer": opt.state_dict(),
        "dtypes": {
            str(dt): torch.ones(3, dtype=dt)
            for dt in (torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.int64)
        },
        "new dtypes": {"f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "u16": torch.zeros(3, dtype=torch.uint16)},
        "views": {"a": base, "t": base.view(3, 4).t(), "s": base[2:9:3], "e": base[:0]},
        "parameter": {"p": torch.nn.Parameter(torch.ones(2)), "g": torch.ones(2, requires_grad=True)},
        "values": {
            "i": [0, -1, 2**40, -(2**70)],
            "f": (1.5, math.nan, -0.0, math.inf),
            "s": {"x", "y"},
            "b": b"bytes",
            "ba": bytearray(b"ba"),
            "c": 1 + 2j,
            "size": torch.Size([2, 3]),
            "dev": torch.device("cpu"),
            "dt": torch.float32,
            "u": "é✓",
            "n": None,
            "counter": Counter({"a": 2}),
            "nested": [[(), {}], (1, (2, (3,)))],
        },
        "shared": {"x": [1, 2], "y": None},
        "meta": {"m": torch.empty(2, 3, device="meta")},
    }
    objs["shared"]["y"] = objs["shared"]["x"]
    out = []
    for name, obj in objs.items():
        bio = io.BytesIO()
        torch.save(obj, bio)
        with zipfile.ZipFile(io.BytesIO(bio.getvalue())) as z:
            recs = {n.split("/data/", 1)[1]: z.read(n) for n in z.namelist() if "/data/" in n and "/.data/" not in n}
            pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        out.append((name, pkl, recs))
    return out


_CORPUS: list[tuple[str, bytes, dict[str, bytes]]] | None = None


def catalogue() -> list[Case]:
    """Every global of the lists above, alone and called with a few arguments, and every opcode
    that changes an object applied to objects of each kind: run first in every campaign, so that
    a name or a target the fast path wrongly allows is met whatever the seed."""
    pool = pool_records()
    out = []
    for module, name in GLOBALS_OK + GLOBALS_BAD:
        g = glob(module, name)
        for what, body in (
            ("value", g),
            ("call()", reduce(g)),
            ("call('cpu')", reduce(g, u("cpu"))),
            ("call([1, 2])", reduce(g, b"](" + integer(1) + integer(2) + b"e")),  # torch.Tensor(1, 2) is uninitialised
            ("in a dict", b"}" + u("k") + g + b"s"),
        ):
            out.append(Case(f"catalogue:{len(out)}", "catalogue", P2 + body + b".", pool, f"{module}.{name} {what}"))
    targets = {
        "dict": b"}",
        "list": b"]",
        "tuple": b")",
        "str": u("s"),
        "int": integer(3),
        "OrderedDict": reduce(glob("collections", "OrderedDict")),
        "Counter": reduce(glob("collections", "Counter")),
        "set": reduce(glob("builtins", "set"), b"]"),
        "Size": reduce(glob("torch", "Size"), tup(integer(2))),
        "device": reduce(glob("torch", "device"), u("cpu")),
        "a class": glob("collections", "OrderedDict"),
        "tensor": reduce(
            glob("torch._utils", "_rebuild_tensor_v2"),
            persid("1", 4),
            integer(0),
            tup(integer(4)),
            tup(integer(1)),
            b"\x89",
            reduce(glob("collections", "OrderedDict")),
        ),
    }
    ops = {
        "SETITEM": u("k") + integer(1) + b"s",
        "SETITEMS": b"(" + u("k") + integer(1) + b"u",
        "APPEND": integer(1) + b"a",
        "APPENDS": b"(" + integer(1) + integer(2) + b"e",
        "BUILD": b"}" + u("x") + integer(1) + b"s" + b"b",
    }
    for tname, target in targets.items():
        for oname, op in ops.items():
            out.append(Case(f"catalogue:{len(out)}", "catalogue", P2 + target + op + b".", pool, f"{oname} on {tname}"))
    return out


def make_case(seed: int, index: int) -> Case:
    global _CORPUS
    rng = random.Random(f"{seed}:{index}")
    sid = f"{seed}:{index}"
    pool = pool_records()
    kind = rng.random()
    if kind < 0.30:
        return Case(sid, "generated", Gen(rng).program(), pool)
    if kind < 0.60:
        data, notes = mutate(Gen(rng).program(), rng, rng.choice([1, 1, 2, 3]))
        return Case(sid, "generated+mutated", data, pool, "; ".join(notes))
    if kind < 0.92:
        if _CORPUS is None:
            _CORPUS = torch_corpus()
        name, pkl, recs = rng.choice(_CORPUS)
        data, notes = mutate(pkl, rng, rng.choice([0, 1, 1, 2, 3]))
        return Case(sid, "torch+mutated", data, {**pool, **recs}, f"{name}: " + "; ".join(notes))
    ops = [random_op(rng) if rng.random() < 0.6 else Gen(rng).value(3) for _ in range(rng.randrange(1, 12))]
    return Case(sid, "random", P2 + b"".join(ops) + b".", pool)


# ----------------------------------------------------------------------------------------------
# running a case


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    declined: bool = False
    pids: list[Any] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "declined" if self.declined else ("raised" if self.error is not None else "value")

    def err(self) -> str:
        return f"{type(self.error).__name__}: {str(self.error)[:160]}" if self.error is not None else ""


def _run(fn: Callable[[], Any]) -> Outcome:
    o = Outcome()
    try:
        o.value = fn()
    except MemoryError as e:
        o.error = e
    except RecursionError as e:
        o.error = e
    except Exception as e:
        o.error = e
    return o


def _clear_sparse() -> None:
    with contextlib.suppress(Exception):
        torch._utils._get_sparse_tensors_to_validate().clear()


def run_fast(case: Case) -> Outcome:
    seen: list[Any] = []
    pl = make_persistent_load(case.records, seen)
    o = _run(lambda: _pickle.fast_weights_only(case.pickle, pl))
    if o.error is None and o.value is None:
        o.declined = True
    o.pids = seen
    _clear_sparse()
    return o


def run_torch_unpickler(case: Case) -> Outcome:
    seen: list[Any] = []
    up = wo.Unpickler(io.BytesIO(case.pickle), encoding="utf-8")
    up.persistent_load = make_persistent_load(case.records, seen)

    def go() -> Any:
        try:
            v = up.load()
            torch._utils._validate_loaded_sparse_tensors()
            return v
        finally:
            _clear_sparse()

    o = _run(go)
    o.pids = seen
    return o


def write_archive(path: Path, case: Case) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("c/data.pkl", case.pickle)
        z.writestr("c/byteorder", "little")
        for k, v in case.records.items():
            if k and "/" not in k:
                z.writestr(f"c/data/{k}", v)
        z.writestr("c/version", "3\n")
        z.writestr("c/.data/serialization_id", "0" * 40)


def run_load(case: Case, path: Path) -> tuple[Outcome, Outcome, bool | None]:
    """(tierstore.load, torch.load), both weights_only=True; and whether the fast path decided."""
    write_archive(path, case)
    decided: list[bool] = []
    real = _pickle.fast_weights_only

    def spy(data: bytes, pl: Any) -> Any:
        decided.append(True)  # raised, unless it returns
        r = real(data, pl)
        decided[-1] = r is not None
        return r

    _pickle.fast_weights_only = spy
    try:
        ts = _run(lambda: tierstore.load(path, weights_only=True, map_location="cpu"))
    finally:
        _pickle.fast_weights_only = real
        _clear_sparse()
    th = _run(lambda: torch.load(path, weights_only=True, map_location="cpu"))
    _clear_sparse()
    return ts, th, (decided[0] if decided else None)


# Refusals of what torch accepts that tierstore makes on purpose: an allocation the pickle cannot
# hold (tierstore/_pickle.py's bounded bytearray), tuples nested deeper than any checkpoint
# (rust/py/src/unpickle.rs), and the structure scan that runs before torch's unpickler on the slow
# path (tierstore/dcp.py scan_pickle: memo indices beyond the memo, containers changed after they were
# put inside another, nesting over its bound, ...).
INTENDED = {
    "in a pickle of": "bytearray larger than the pickle",
    "nested more than 1000 deep": "tuple nesting",
    "record 'data.pkl': not a valid pickle: ": "structure scan",
    "record 'data.pkl': bad storage reference": "types of a persistent id's fields",
}

# Findings explained and reported (tests/test_i13_b_unpickle_fuzz.py holds each as an
# xfail(strict=True) case): a signature -> what it is.
KNOWN = {
    "rust-binpersid-sequence": "unpickle.rs BINPERSID takes pid[0] as Vec<u8>: a bytearray, list or tuple of the "
    "bytes of 'storage' passes its check, which torch's refuses (only str, or bytes decoded as ASCII)",
    "python-bytearray-standin": "tierstore/_pickle.py fast_weights_only replaces builtins.bytearray in the allow-list "
    "by a size-checked function, so a pickle whose result holds the bytearray class gets that function "
    "(tierstore.load sends pickles naming bytearray to torch's unpickler, so loads are not affected)",
}


def intended(o: Outcome) -> str | None:
    if o.error is None:
        return None
    return next((why for s, why in INTENDED.items() if s in str(o.error)), None)


def known(finding: dict[str, Any], pids: list[Any], case: Case) -> str | None:
    if (
        finding["check"] == "direct"
        and finding["class"] == "different_result"
        and "function vs type" in finding["detail"]
        and b"builtins\nbytearray\n" in case.pickle
    ):
        return "python-bytearray-standin"
    if finding["class"] == "persistent_id_torch_refuses":
        bad = [p for p in pids if not torch_rule_allows(p)]
        if bad and all(type(p) is tuple and p and isinstance(p[0], (bytearray, list, tuple)) for p in bad):
            return "rust-binpersid-sequence"
    return None


def classify(case: Case, workdir: Path, e2e: bool = True) -> dict[str, Any]:
    rec: dict[str, Any] = {"seed": case.seed, "source": case.source, "note": case.note, "findings": []}
    fast = run_fast(case)
    ref = run_torch_unpickler(case)
    rec["fast"], rec["torch"] = fast.kind, ref.kind
    rec["fast_error"], rec["torch_error"] = fast.err(), ref.err()
    f = rec["findings"]
    resource_err = (MemoryError, RecursionError)
    if isinstance(fast.error, resource_err) or isinstance(ref.error, resource_err):
        rec["direct"] = "resource"
    elif fast.declined:
        rec["direct"] = "declined"
    elif fast.error is None and ref.error is None:
        try:
            why = same(fast.value, ref.value)
        except UncomparableError as e:
            why, rec["direct"] = None, f"uncomparable ({e})"
        if why:
            f.append({"check": "direct", "class": "different_result", "detail": why})
            f[-1]["known"] = known(f[-1], fast.pids, case)
            rec["direct"] = "different"
        else:
            rec.setdefault("direct", "equal")
    elif fast.error is None:
        f.append({"check": "direct", "class": "accepts_what_torch_refuses", "detail": ref.err()})
        rec["direct"] = "ACCEPTED"
    elif ref.error is None:
        if intended(fast):
            rec["direct"] = f"intended_refusal ({intended(fast)})"
        else:
            f.append({"check": "direct", "class": "refuses_what_torch_accepts", "detail": fast.err()})
            rec["direct"] = "refused"
    else:
        rec["direct"] = "both_refuse"
    bad = [p for p in fast.pids if not torch_rule_allows(p)]
    if bad:
        f.append({"check": "direct", "class": "persistent_id_torch_refuses", "detail": f"{bad[0]!r:.200}"})
        f[-1]["known"] = known(f[-1], fast.pids, case)
    if e2e:
        ts, th, decided = run_load(case, workdir / "case.pt")
        rec["load_fast_decided"] = decided
        rec["tierstore"], rec["torch_load"] = ts.kind, th.kind
        rec["tierstore_error"], rec["torch_load_error"] = ts.err(), th.err()
        if isinstance(ts.error, resource_err) or isinstance(th.error, resource_err):
            rec["load"] = "resource"
        elif ts.error is None and th.error is None:
            try:
                why = same(ts.value, th.value)
            except UncomparableError as e:
                why, rec["load"] = None, f"uncomparable ({e})"
            if why:
                f.append({"check": "load", "class": "different_result", "detail": why})
                rec["load"] = "different"
            else:
                rec.setdefault("load", "equal")
        elif ts.error is None:
            f.append({"check": "load", "class": "accepts_what_torch_refuses", "detail": th.err()})
            rec["load"] = "ACCEPTED"
        elif th.error is None:
            if intended(ts):
                rec["load"] = f"intended_refusal ({intended(ts)})"
            else:
                f.append({"check": "load", "class": "refuses_what_torch_accepts", "detail": ts.err()})
                rec["load"] = "refused"
        else:
            rec["load"] = "both_refuse"
    return rec


def signature(finding: dict[str, Any]) -> str:
    return f"{finding['check']}:{finding['class']}"


# ----------------------------------------------------------------------------------------------
# minimizing


def minimize(case: Case, workdir: Path, keep: Callable[[dict[str, Any]], bool]) -> Case:
    """Removes opcodes (then bytes) while ``keep(classify(...))`` holds."""
    cur = case
    changed = True
    while changed:
        changed = False
        for unit in ("ops", "bytes"):
            parts = ops_of(cur.pickle) if unit == "ops" else [bytes([b]) for b in cur.pickle]
            i = 0
            while i < len(parts):
                trial = Case(cur.seed, cur.source, b"".join(parts[:i] + parts[i + 1 :]), cur.records, cur.note)
                if trial.pickle and keep(classify(trial, workdir)):
                    cur, parts, changed = trial, parts[:i] + parts[i + 1 :], True
                else:
                    i += 1
    used = {k: v for k, v in cur.records.items() if k.encode() in cur.pickle}
    trial = Case(cur.seed, cur.source, cur.pickle, used, cur.note)
    return trial if keep(classify(trial, workdir)) else cur


def disassemble(data: bytes) -> str:
    out = io.StringIO()
    try:
        pickletools.dis(data, out)
    except Exception as e:
        out.write(f"(stops: {e})\n")
    return out.getvalue()


# ----------------------------------------------------------------------------------------------
# the campaign


def limit_memory() -> None:
    memlimit.limit_address_space()


def _label(v: str) -> str:
    return v if v.startswith("intended") else v.split(" ")[0]


def run_campaign(cases: int, seed: int, e2e: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    findings: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ts-unpickle-fuzz-") as td:
        work = Path(td)
        for i, case in enumerate([*catalogue(), *(make_case(seed, i) for i in range(cases))]):
            rec = classify(case, work, e2e)
            table["source"][case.source] += 1
            table["direct"][_label(rec["direct"])] += 1
            if e2e:
                table["load"][_label(rec["load"])] += 1
                table["load_path"][
                    {True: "fast", False: "slow", None: "fast path not tried"}[rec.get("load_fast_decided")]
                ] += 1
            for f in rec["findings"]:
                findings.append({**f, "seed": case.seed, "source": case.source, "note": case.note,
                                 "pickle": case.pickle.hex()})  # fmt: skip
            if (i + 1) % 500 == 0:
                log(f"{i + 1} cases, {len(findings)} findings, {time.perf_counter() - t0:.1f} s")
    return {
        "cases": cases,
        "catalogue": len(catalogue()),
        "seed": seed,
        "seconds": round(time.perf_counter() - t0, 2),
        "table": {k: dict(v) for k, v in table.items()},
        "findings": findings,
    }


def new_findings(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in summary["findings"] if not f.get("known")]


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['cases']} cases (seed {summary['seed']}) and {summary['catalogue']} catalogue cases in "
        f"{summary['seconds']} s"
    ]
    for k, v in summary["table"].items():
        lines.append(f"  {k:10s} " + ", ".join(f"{c} {n}" for n, c in sorted(v.items(), key=lambda kv: -kv[1])))
    fresh = new_findings(summary)
    kn = collections.Counter(f["known"] for f in summary["findings"] if f.get("known"))
    lines.append(
        f"  known findings: {sum(kn.values())}" + "".join(f"\n    {k} ({n}): {KNOWN[k]}" for k, n in kn.items())
    )
    groups = collections.Counter(signature(f) for f in fresh)
    lines.append(f"  NEW findings: {len(fresh)}" + "".join(f"\n    {g}: {n}" for g, n in groups.items()))
    for f in fresh[:20]:
        lines.append(
            f"    --replay {f['seed']}  {signature(f)}  {f['detail'][:150]}  [{f['source']}: {f['note'][:60]}]"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-load", action="store_true", help="only the direct comparison (faster)")
    ap.add_argument("--json", help="write the summary (and findings) here")
    ap.add_argument("--replay", help="SEED:INDEX: run one case and print both outcomes")
    ap.add_argument("--show", action="store_true", help="with --replay: disassemble the pickle")
    ap.add_argument("--minimize", action="store_true", help="with --replay: shrink it, keeping its findings")
    args = ap.parse_args(argv)
    limit_memory()
    warnings.simplefilter("ignore")
    if args.replay:
        s, i = args.replay.split(":")
        case = catalogue()[int(i)] if s == "catalogue" else make_case(int(s), int(i))
        with tempfile.TemporaryDirectory() as td:
            rec = classify(case, Path(td))
            if args.minimize and rec["findings"]:
                want = {signature(f) for f in rec["findings"]}
                case = minimize(case, Path(td), lambda r: want <= {signature(f) for f in r["findings"]})
                rec = classify(case, Path(td))
        print(json.dumps({k: v for k, v in rec.items()}, indent=1, default=str))
        print("pickle:", case.pickle.hex())
        print("records:", {k: len(v) for k, v in case.records.items()})
        if args.show:
            print(disassemble(case.pickle))
        return 1 if [f for f in rec["findings"] if not f.get("known")] else 0
    summary = run_campaign(args.cases, args.seed, e2e=not args.no_load, log=lambda m: print(m, file=sys.stderr))
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 1 if new_findings(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
