"""The pickle of a DCP ``.metadata``, read without running it: the
allow-list of the classes DCP writes, an opcode scanner that refuses what
would make CPython's unpickler allocate or recurse without bound (used for
torch's ``data.pkl`` too), and the restricted unpickler. It imports no other
tierstore module but the errors and the collector's pause (``_gc``, which
imports none), so that both the loader (``api``) and the DCP reader
(``dcp``) can use it."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from typing import Any, NoReturn

import torch

from tierstore import _gc
from tierstore.errors import ManifestError, TierstoreError, UnsafeObjectError

#: Nesting deeper than this is refused before unpickling: CPython hashes
#: nested tuples recursively in C, and a crafted pickle of a megabyte nests
#: deep enough to overflow the C stack (DCP's own metadata nests 10 deep).
MAX_NESTING = 100

# --------------------------------------------------------------------------
# The allow-list


_DCP_CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # Written by torch < 2.2, where TensorProperties lived with ShardedTensor.
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties",),
}
_ENUM_NAMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": ("_MEM_FORMAT_ENCODING",),
    "torch.distributed._shard.sharded_tensor.metadata": ("MEM_FORMAT_ENCODING",),
}

_allowed: dict[tuple[str, str], Any] | None = None
_dcp_classes: frozenset[tuple[str, str]] = frozenset()


def allowed_globals() -> dict[tuple[str, str], Any]:
    """``{(module, name): object}``: every global a DCP ``.metadata`` may name
    when it is loaded with ``weights_only=True``.

    DCP's metadata dataclasses (``Metadata``, ``TensorStorageMetadata``,
    ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
    ``MetadataIndex``, ``StorageMeta``, ``_StorageInfo``, and the
    ``TensorProperties`` of torch < 2.2), the memory-format enums they
    pickle, ``torch.Size``, every ``torch.<name>`` that is a dtype, a layout
    or a memory format, ``torch.serialization._get_layout`` (how layouts
    pickle), ``collections.OrderedDict`` and ``pathlib``'s path classes
    (``StorageMeta.checkpoint_id``; a ``WindowsPath`` is read as a
    ``PureWindowsPath``, which any system can build). Modules are imported
    here, from this fixed list, never because a file names them.
    """
    global _allowed, _dcp_classes
    if _allowed is not None:
        return _allowed
    import collections
    import importlib
    import pathlib

    table: dict[tuple[str, str], Any] = {}
    classes = set()
    for group, is_class in ((_DCP_CLASS_NAMES, True), (_ENUM_NAMES, False)):
        for mod, names in group.items():
            try:
                m = importlib.import_module(mod)
            except ImportError:
                continue
            for n in names:
                obj = getattr(m, n, None)
                if isinstance(obj, type):
                    table[(mod, n)] = obj
                    if is_class:
                        classes.add((mod, n))
    for n in dir(torch):
        v = getattr(torch, n, None)
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", n)] = v
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("collections", "OrderedDict")] = collections.OrderedDict
    for mod in ("pathlib", "pathlib._local"):  # 3.13 moved the classes
        table[(mod, "PurePath")] = pathlib.PurePath
        table[(mod, "PurePosixPath")] = pathlib.PurePosixPath
        table[(mod, "PureWindowsPath")] = pathlib.PureWindowsPath
        table[(mod, "PosixPath")] = pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath
        table[(mod, "WindowsPath")] = pathlib.PureWindowsPath if os.name != "nt" else pathlib.WindowsPath
    _dcp_classes = frozenset(classes)
    _allowed = table
    return table


def _unsafe_hint() -> str:
    return (
        "a DCP .metadata holds only DCP's metadata classes, torch.Size, dtypes, layouts and plain containers, "
        "and unpickling anything else can run code. If you trust the file, load it with weights_only=False "
        "(tierstore.load_sharded, tierstore.sharded.consolidate, tierstore.dcp.to_state_dict) or pass --unsafe "
        "to the tierstore command (consolidate, convert, verify)"
    )


def _refused(where: str, what: str) -> NoReturn:
    raise UnsafeObjectError(f"{where}: weights_only=True refused {what}: {_unsafe_hint()}", path=where)


class _RestrictedUnpickler(pickle.Unpickler):
    """``find_class`` admits only :func:`allowed_globals` (resolved from the
    fixed table, never imported on the file's say)."""

    def __init__(self, file: io.BytesIO, where: str) -> None:
        super().__init__(file)
        self._where = where
        self._table = allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = self._table.get((module, name))
        if obj is None:
            _refused(self._where, f"the global {str(module)[:200]}.{str(name)[:200]}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise ManifestError(f"{self._where}: a DCP .metadata holds no persistent ids", path=self._where)


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, where: str) -> None:
        super().__init__(file)
        self._where = where

    def persistent_load(self, pid: Any) -> Any:
        raise ManifestError(f"{self._where}: a DCP .metadata holds no persistent ids", path=self._where)


# --------------------------------------------------------------------------
# Walking the opcodes before anything runs

# Argument sizes from pickletools: >= 0 fixed, -1 up to a newline, -2/-3/-4/-5
# counted by a 1-byte / signed 4-byte / unsigned 4-byte / unsigned 8-byte length.
_ARG_N = {op.name: (op.arg.n if op.arg is not None else 0) for op in pickletools.opcodes}
(
    _A_LEAF, _A_STR, _A_MEMOIZE, _A_GET, _A_PUT, _A_MARK, _A_TUPLE_N, _A_TUPLE, _A_EMPTY, _A_COLLECT,
    _A_ADD, _A_STACK_GLOBAL, _A_GLOBAL, _A_CALL, _A_BUILD, _A_POP, _A_POP_MARK, _A_DUP, _A_NOP, _A_STOP,
    _A_OTHER,
) = range(21)  # fmt: skip
# Node kinds.
_K_LIST, _K_DICT, _K_SET, _K_TUPLE, _K_INST, _K_VALUE = range(6)
_KIND_NAMES = ("list", "dict", "set", "tuple", "object", "value")
_LEAF_OPS = (
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
    "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
)  # fmt: skip
_ACTIONS: dict[str, tuple[int, Any]] = {
    **{n: (_A_LEAF, None) for n in _LEAF_OPS},
    **{n: (_A_STR, None) for n in ("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")},
    "MEMOIZE": (_A_MEMOIZE, None),
    "GET": (_A_GET, "text"),
    "BINGET": (_A_GET, None),
    "LONG_BINGET": (_A_GET, None),
    "PUT": (_A_PUT, "text"),
    "BINPUT": (_A_PUT, None),
    "LONG_BINPUT": (_A_PUT, None),
    "MARK": (_A_MARK, None),
    "TUPLE1": (_A_TUPLE_N, 1),
    "TUPLE2": (_A_TUPLE_N, 2),
    "TUPLE3": (_A_TUPLE_N, 3),
    "EMPTY_TUPLE": (_A_TUPLE_N, 0),
    "TUPLE": (_A_TUPLE, _K_TUPLE),
    "FROZENSET": (_A_TUPLE, _K_TUPLE),
    "EMPTY_LIST": (_A_EMPTY, _K_LIST),
    "EMPTY_DICT": (_A_EMPTY, _K_DICT),
    "EMPTY_SET": (_A_EMPTY, _K_SET),
    "LIST": (_A_COLLECT, _K_LIST),
    "DICT": (_A_COLLECT, _K_DICT),
    "APPEND": (_A_ADD, (_K_LIST, 1)),
    "SETITEM": (_A_ADD, (_K_DICT, 2)),
    "APPENDS": (_A_ADD, (_K_LIST, 0)),
    "SETITEMS": (_A_ADD, (_K_DICT, 0)),
    "ADDITEMS": (_A_ADD, (_K_SET, 0)),
    "STACK_GLOBAL": (_A_STACK_GLOBAL, None),
    "GLOBAL": (_A_GLOBAL, None),
    "REDUCE": (_A_CALL, 1),
    "NEWOBJ": (_A_CALL, 1),
    "NEWOBJ_EX": (_A_CALL, 2),
    "BUILD": (_A_BUILD, None),
    "POP": (_A_POP, None),
    "POP_MARK": (_A_POP_MARK, None),
    "DUP": (_A_DUP, None),
    "PROTO": (_A_NOP, None),
    "FRAME": (_A_NOP, None),
    "STOP": (_A_STOP, None),
}
# What a DCP .metadata never holds and that would reach code or state outside
# the allow-list (old-style instances, the copyreg extension registry,
# persistent ids, out-of-band buffers): refused with weights_only=True.
_OTHER = ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER")
_OPS: list[tuple[int, int, str, Any] | None] = [None] * 256
for _op in pickletools.opcodes:
    _act, _extra = _ACTIONS.get(_op.name, (_A_OTHER, None))
    assert _act != _A_OTHER or _op.name in _OTHER, _op.name
    _OPS[ord(_op.code.encode("latin-1"))] = (_act, _ARG_N[_op.name], _op.name, _extra)


def _scan(data: bytes, where: str, strict: bool, what: str = "DCP metadata pickle") -> None:
    """Walks the pickle's opcodes without running anything.

    Refuses what would make CPython's unpickler (or what it builds) misbehave
    before any object exists: a memo index beyond the memo (the C unpickler
    sizes its memo by the largest index: 10 bytes could ask for 64 GiB), an
    argument longer than the file (it allocates the length first), stack
    underflow, unknown opcodes, nesting deeper than :data:`MAX_NESTING`
    (CPython hashes nested tuples recursively in C: a crafted megabyte
    overflows the C stack) and changing an object after it was put inside
    another (a cycle, which would defeat the nesting bound; pickle fills
    every container before it uses it, and DCP metadata holds no cycles).
    With ``strict`` (``weights_only=True``) also: every global outside the
    allow-list; ``REDUCE`` of anything but an allowed global and ``NEWOBJ``
    of anything but DCP's classes; ``BUILD`` on anything but an object this
    pickle made from one of DCP's classes (a class, a function or an enum
    member would be changed for the whole process);
    ``APPEND``/``SETITEM``/``ADDITEMS`` on anything but a list, dict or set;
    and the opcodes in ``_OTHER``.

    A stack item is a leaf (``None``; for a string, the position of its
    opcode; for a global, ``(module, name)``) or a node ``[depth, kind,
    sealed]``, sealed once it is inside another node.
    """
    table = allowed_globals()
    dcp_classes = _dcp_classes
    ops = _OPS
    n = len(data)
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []
    fence = 0
    pos = 0
    at = 0
    name = ""

    def bad(why: str) -> NoReturn:
        raise ManifestError(f"{where}: not a valid {what}: {why} (at byte {at})", path=where)

    def refuse(what: str) -> NoReturn:
        _refused(where, f"{what} (at byte {at} of the pickle)")

    def depth_of(items: list[Any], into: Any = None) -> int:
        """The depth of a node holding ``items`` (which are sealed), new or ``into``."""
        d = 1
        for c in items:
            if type(c) is list:
                if c is into:
                    bad(f"{name} of an object into itself (a cycle, which DCP metadata never holds)")
                c[2] = True
                if c[0] >= d:
                    d = c[0] + 1
        if d > MAX_NESTING:
            bad(f"objects nested more than {MAX_NESTING} deep")
        return d

    def underflow() -> NoReturn:
        bad(f"{name} finds too few items on the stack")

    def pop_mark() -> list[Any]:
        nonlocal fence
        if not marks:
            bad(f"{name} without a MARK")
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        fence = marks[-1] if marks else 0
        return items

    def string_at(p: int) -> str:
        _act, an, _name, _extra = ops[data[p]]  # type: ignore[misc]
        if an == -1:  # UNICODE: raw-unicode-escape up to the newline
            return data[p + 1 : data.index(b"\n", p + 1)].decode("raw-unicode-escape")
        w = 1 if an == -2 else 8 if an == -5 else 4
        ln = int.from_bytes(data[p + 1 : p + 1 + w], "little")
        return data[p + 1 + w : p + 1 + w + ln].decode("utf-8", "surrogatepass")

    def glob(module: str, gname: str) -> tuple[str, str]:
        if strict and (module, gname) not in table:
            refuse(f"the global {module[:200]}.{gname[:200]}")
        return (module, gname)

    def memo_index(a0: int, end: int, text: bool) -> int:
        if not text:
            return int.from_bytes(data[a0:end], "little")
        raw = data[a0 : end - 1].strip()
        if len(raw) > 20 or not raw.isdigit():
            bad(f"{name} with a memo index that is not a small number")
        return int(raw)

    _gc.begin()  # millions of small lists, none in a cycle
    try:
        while True:
            if pos >= n:
                bad("the pickle ends before its STOP")
            at = pos
            op = ops[data[pos]]
            if op is None:
                bad(f"unknown opcode {data[pos]:#04x}")
            act, an, name, extra = op
            a0 = pos + 1
            if an == 0:
                end = a0
            elif an > 0:
                end = a0 + an
            elif an == -2:
                if a0 >= n:
                    bad(f"{name} is cut short")
                end = a0 + 1 + data[a0]
                a0 += 1
            elif an == -1:
                end = data.find(b"\n", a0) + 1
                if end and name in ("GLOBAL", "INST"):
                    end = data.find(b"\n", end) + 1
                if not end:
                    bad(f"{name} without its end of line")
            else:
                w = 8 if an == -5 else 4
                if a0 + w > n:
                    bad(f"{name} is cut short")
                ln = int.from_bytes(data[a0 : a0 + w], "little", signed=an == -3)
                if ln < 0:
                    bad(f"{name} with a negative length")
                a0 += w
                end = a0 + ln
            if end > n:
                bad(f"{name} is cut short (its argument runs past the end of the pickle)")
            pos = end

            if act == _A_MEMOIZE:
                if len(stack) <= fence:
                    underflow()
                memo.append(stack[-1])
            elif act == _A_GET:
                i = data[a0] if an == 1 else memo_index(a0, end, extra is not None)
                if i >= len(memo):
                    bad(f"memo entry {i} is read before it is written")
                stack.append(memo[i])
            elif act == _A_LEAF:
                stack.append(None)
            elif act == _A_STR:
                stack.append(at)
            elif act == _A_MARK:
                fence = len(stack)
                marks.append(fence)
            elif act == _A_TUPLE_N:
                if extra:
                    if len(stack) - extra < fence:
                        underflow()
                    items = stack[-extra:]
                    del stack[-extra:]
                    stack.append([depth_of(items), _K_TUPLE, False])
                else:
                    stack.append([1, _K_TUPLE, False])
            elif act == _A_ADD:
                want, k = extra
                if k:
                    if len(stack) - k <= fence:
                        underflow()
                    items = stack[-k:]
                    del stack[-k:]
                else:
                    items = pop_mark()
                    if len(stack) <= fence:
                        underflow()
                    if want == _K_DICT and len(items) % 2:
                        bad(f"{name} with an odd number of items")
                target = stack[-1]
                if type(target) is list:
                    if target[2]:
                        bad(f"{name} on a {_KIND_NAMES[target[1]]} after it was put inside another object (a cycle)")
                    if strict and target[1] != want:
                        refuse(f"{name} on a {_KIND_NAMES[target[1]]}, not a {_KIND_NAMES[want]}")
                    d = depth_of(items, target)
                    if d > target[0]:
                        target[0] = d
                elif strict:
                    refuse(f"{name} on something that is not a {_KIND_NAMES[want]}")
            elif act == _A_EMPTY:
                stack.append([1, extra, False])
            elif act == _A_CALL:
                if len(stack) - extra - 1 < fence:
                    underflow()
                items = stack[-extra:]
                del stack[-extra:]
                fn = stack.pop()
                is_glob = type(fn) is tuple
                if strict:
                    if not is_glob:
                        refuse(f"{name} of something that is not an allowed global")
                    if name != "REDUCE" and fn not in dcp_classes:
                        refuse(f"{name} of {fn[0]}.{fn[1]}, which is not one of DCP's classes")
                kind = (
                    _K_INST
                    if is_glob and fn in dcp_classes
                    else _K_DICT
                    if is_glob and fn[1] == "OrderedDict"
                    else _K_VALUE
                )
                stack.append([depth_of(items), kind, False])
            elif act == _A_BUILD:
                if len(stack) - 2 < fence:
                    underflow()
                state = stack.pop()
                target = stack[-1]
                if type(target) is list:
                    if target[2]:
                        bad("BUILD on an object after it was put inside another (a cycle)")
                    if strict and target[1] != _K_INST:
                        refuse(f"BUILD on a {_KIND_NAMES[target[1]]}, not a new object of DCP's classes")
                    d = depth_of([state], target)
                    if d > target[0]:
                        target[0] = d
                elif strict:
                    refuse("BUILD on a class, function or constant, not a new object of DCP's classes")
            elif act == _A_TUPLE:
                stack.append([depth_of(pop_mark()), extra, False])
            elif act == _A_COLLECT:
                items = pop_mark()
                if extra == _K_DICT and len(items) % 2:
                    bad("DICT with an odd number of items")
                stack.append([depth_of(items), extra, False])
            elif act == _A_STACK_GLOBAL:
                if len(stack) - 2 < fence:
                    underflow()
                gname = stack.pop()
                module = stack.pop()
                if type(gname) is not int or type(module) is not int:
                    bad("STACK_GLOBAL of something other than two strings")
                stack.append(glob(string_at(module), string_at(gname)))
            elif act == _A_GLOBAL:
                line = data[a0:end].split(b"\n")
                stack.append(glob(line[0].decode("utf-8"), line[1].decode("utf-8")))
            elif act == _A_PUT:
                if len(stack) <= fence:
                    underflow()
                i = memo_index(a0, end, extra is not None)
                if i > len(memo):
                    bad(f"memo index {i} beyond the {len(memo)} entries written so far")
                if i == len(memo):
                    memo.append(stack[-1])
                else:
                    memo[i] = stack[-1]
            elif act == _A_POP:
                if len(stack) > fence:
                    stack.pop()
                else:
                    pop_mark()
            elif act == _A_POP_MARK:
                pop_mark()
            elif act == _A_DUP:
                if len(stack) <= fence:
                    underflow()
                stack.append(stack[-1])
            elif act == _A_NOP:
                pass
            elif act == _A_STOP:
                if len(stack) <= fence:
                    underflow()
                return
            else:  # _OTHER, with weights_only=False: no depth is known beyond this
                if strict:
                    refuse(f"the pickle opcode {name}")
                if name in ("INST", "OBJ"):
                    pop_mark()
                elif name == "BINPERSID":
                    if len(stack) <= fence:
                        underflow()
                    stack.pop()
                if name != "READONLY_BUFFER":
                    stack.append(None)
    finally:
        _gc.end()


def scan_pickle(data: bytes, where: str, *, strict: bool = False) -> None:
    """Walks any pickle's opcodes without running anything and refuses what
    would make CPython's unpickler, or what it builds, misbehave (see
    ``_scan``; ``strict=False`` checks the structure only). Used before a
    ``data.pkl`` goes to torch's weights-only unpickler."""
    _scan(data, where, strict, "pickle")


def unpickle_metadata(data: bytes, where: str, weights_only: bool) -> Any:
    """The object of a ``.metadata`` pickle: scanned, then unpickled with the
    allow-list (or plainly, with ``weights_only=False``). Every failure is a
    TierstoreError naming ``where``."""
    try:
        _scan(data, where, strict=weights_only)
        cls = _RestrictedUnpickler if weights_only else _PlainUnpickler
        return cls(io.BytesIO(data), where).load()
    except TierstoreError:
        raise
    except RecursionError:
        raise ManifestError(f"{where}: not a valid DCP metadata file (nested too deeply)", path=where) from None
    except MemoryError:
        raise ManifestError(
            f"{where}: not a valid DCP metadata file (it asks for more memory than there is)", path=where
        ) from None
    except Exception as e:  # UnpicklingError, EOFError, UnicodeDecodeError, ValueError, TypeError, ...
        raise ManifestError(
            f"{where}: not a valid DCP metadata file ({type(e).__name__}: {error_text(e)})", path=where
        ) from None


def error_text(e: BaseException) -> str:
    try:
        s = str(e)
    except Exception:
        s = "?"
    return s if len(s) <= 200 else s[:197] + "..."


def metadata_classes() -> dict[str, tuple[type, ...]]:
    """DCP's metadata classes by name (both homes of ``TensorProperties``)."""
    table = allowed_globals()
    out: dict[str, list[type]] = {}
    for (_mod, name), obj in table.items():
        if (_mod, name) in _dcp_classes:
            out.setdefault(name, []).append(obj)
    return {k: tuple(v) for k, v in out.items()}
