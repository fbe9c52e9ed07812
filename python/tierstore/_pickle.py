"""Pickling and unpickling exactly as ``torch.save`` / ``torch.load`` do.

``data.pkl`` is the object graph pickled with protocol 2, where every storage
is replaced by the persistent id ``("storage", storage_type, key, location,
numel)`` and its bytes go to the record ``data/<key>``. Tensors reduce to
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``, so
views of one storage share it again after loading.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import Counter, OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tierstore import _core, _gc
from tierstore._metadata import dtype_name
from tierstore.errors import CorruptFileError, InvalidArgumentTypeError, UnsupportedObjectError, UsageError

DEFAULT_PROTOCOL = 2
_UNTYPED_DTYPES = frozenset(torch.storage._new_dtypes())
_NO_STORAGE_DEVICES = frozenset({"meta", "xla", "maia", "mtia"})
_STORAGE_TYPES: dict[torch.dtype, Any] = {}


def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class torch pickles for ``dtype`` (torch.FloatStorage, ...)."""
    st = _STORAGE_TYPES.get(dtype)
    if st is None:
        st = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        _STORAGE_TYPES[dtype] = st
    return st


def _dtype_attr(dtype: torch.dtype) -> str:
    """The name under which ``dtype`` pickles (``torch.<name>``)."""
    name = dtype.__reduce__()
    assert isinstance(name, str)
    return name


def _refuse_zerotensor(t: torch.Tensor) -> None:
    """A ZeroTensor (``torch._efficientzerotensor``) has no storage to save;
    torch.save refuses it with a ``RuntimeError``, and so does tierstore."""
    if t._is_zerotensor():
        raise UnsupportedObjectError(
            f"ZeroTensor is not serializable (shape {tuple(t.shape)}, {t.dtype}); torch.save refuses it too: "
            "save torch.zeros(t.shape, dtype=t.dtype) instead"
        )


@dataclass
class SavedStorage:
    """A storage met while pickling."""

    key: str
    storage: torch.UntypedStorage
    dtype: torch.dtype
    location: str
    numel: int


class StorageCollector:
    """``persistent_id`` of ``torch.save``: one record per distinct storage.

    Storages can be registered before pickling (``preseed``) so that their
    bytes are written while the pickler runs; the pickler then finds their keys.
    """

    def __init__(self) -> None:
        self.storages: dict[str, SavedStorage] = {}
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        # tensor_args of the tensors preseed saw, by id (the tensor is kept, so the id stays its own)
        self._args: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}

    def key_of(self, storage: torch.UntypedStorage) -> str | None:
        return self._keys.get(storage._cdata)

    def _register(self, storage: torch.UntypedStorage, dtype: torch.dtype, numel: int, location: str) -> str:
        ptr = storage.data_ptr()
        if ptr != 0 and storage.device.type != "meta":
            seen = self._dtypes.setdefault(ptr, dtype)
            if seen != dtype:
                raise UsageError("Cannot save multiple tensors or storages that view the same data as different types")
        key = self._keys.get(storage._cdata)
        if key is None:
            key = str(len(self._keys))
            self._keys[storage._cdata] = key
        if key not in self.storages:
            self.storages[key] = SavedStorage(key, storage, dtype, location, numel)
        return key

    def preseed(self, tensors: list[torch.Tensor]) -> None:
        """Registers the storages of plain tensors, in order. For each tensor
        the fast pickler can reduce, its arguments are computed now, every
        check included, and :meth:`tensor_args` looks them up."""
        for t in tensors:
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                continue
            if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
                continue
            if type(t) is torch.Tensor and id(t) not in self._args:
                args = self._tensor_args(t)  # refuses a ZeroTensor
                if args is not None:
                    self._args[id(t)] = (t, args)
                    continue
            _refuse_zerotensor(t)
            storage = t.untyped_storage()
            if storage._cdata in self._keys:
                continue
            # Tensors of the newer dtypes pickle their storage untyped (bytes),
            # as Tensor.__reduce_ex__ does; register them the same way.
            dtype = torch.uint8 if t.dtype in _UNTYPED_DTYPES else t.dtype
            dev = storage.device
            location = "cpu" if dev.type == "cpu" else torch.serialization.location_tag(storage)
            self._register(storage, dtype, storage.nbytes() // dtype.itemsize, location)

    def tensor_args(self, t: torch.Tensor) -> tuple[Any, ...] | None:
        """What ``Tensor.__reduce_ex__`` puts in ``_rebuild_tensor_v2``/``_v3``'s
        arguments, for the fast pickler: ``(v3, persistent_id, storage_offset,
        size, stride, requires_grad, dtype_name)``; ``None`` when the tensor
        needs torch's own reduction."""
        hit = self._args.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        return self._tensor_args(t)

    def _tensor_args(self, t: torch.Tensor) -> tuple[Any, ...] | None:
        _refuse_zerotensor(t)
        if (
            type(t) is not torch.Tensor
            or t.layout != torch.strided
            or t.is_quantized
            or t.is_nested
            or t.device.type in _NO_STORAGE_DEVICES
            or t.__dict__
            or t._backward_hooks
            or torch._utils.get_tensor_metadata(t)
        ):
            return None
        storage = t.untyped_storage()
        dev = storage.device
        location = "cpu" if dev.type == "cpu" else torch.serialization.location_tag(storage)
        dtype = t.dtype
        if dtype in _UNTYPED_DTYPES:
            key = self._register(storage, torch.uint8, storage.nbytes(), location)
            pid = ("storage", torch.UntypedStorage, key, location, storage.nbytes())
            return (True, pid, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, _dtype_attr(dtype))
        numel = storage.nbytes() // dtype.itemsize
        key = self._register(storage, dtype, numel, location)
        pid = ("storage", _storage_type(dtype), key, location, numel)
        return (False, pid, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, None)

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        storage: torch.UntypedStorage
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            storage = obj
            dtype = torch.uint8
            storage_type = torch.serialization.normalize_storage_type(type(obj))
            numel = storage.nbytes()
        else:
            return None
        fake = getattr(obj, "_fake_device", None)
        location = str(fake) if fake is not None else torch.serialization.location_tag(storage)
        key = self._register(storage, dtype, numel, location)
        return ("storage", storage_type, key, location, numel)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, protocol: int, collector: StorageCollector) -> None:
        super().__init__(file, protocol=protocol)
        self._collector = collector

    def persistent_id(self, obj: Any) -> Any:
        return self._collector.persistent_id(obj)


def dumps(
    obj: Any, pickle_module: ModuleType | None, protocol: int, collector: StorageCollector | None = None
) -> tuple[bytes, StorageCollector]:
    """Pickles ``obj``; returns ``data.pkl`` and the storages it refers to."""
    col = collector if collector is not None else StorageCollector()
    if (pickle_module is None or pickle_module is pickle) and protocol == DEFAULT_PROTOCOL:
        from collections import OrderedDict

        from tierstore import _core

        fast = _core.fast_dumps(obj, torch.Tensor, OrderedDict, col.tensor_args)
        if fast is not None:
            return fast, col
    buf = io.BytesIO()
    if pickle_module is None or pickle_module is pickle:
        _Pickler(buf, protocol, col).dump(obj)
    else:
        base: Any = pickle_module.Pickler

        class _Custom(base):  # type: ignore[misc]
            def persistent_id(self, o: Any) -> Any:
                return col.persistent_id(o)

        _Custom(buf, protocol=protocol).dump(obj)
    return buf.getvalue(), col


_MODULE_RENAMES = {"torch.tensor": "torch._tensor"}


def _find_class(base_find: Any, module: str, name: str) -> Any:
    """torch.load's name resolution: legacy storage classes become
    ``StorageType``s, and renamed modules are followed."""
    if type(name) is str and "Storage" in name:
        try:
            return torch.serialization.StorageType(name)
        except KeyError:
            pass
    return base_find(_MODULE_RENAMES.get(module, module), name)


class _FullUnpickler(pickle.Unpickler):
    """The unrestricted unpickler (``weights_only=False``), as torch's."""

    def find_class(self, module: str, name: str) -> Any:
        return _find_class(super().find_class, module, name)


def unpickler(
    data: bytes, *, weights_only: bool, pickle_module: ModuleType | None, encoding: str, **kwargs: Any
) -> Any:
    """An unpickler for ``data.pkl``; the caller sets ``persistent_load``."""
    f = io.BytesIO(data)
    if weights_only:
        from torch import _weights_only_unpickler

        return _weights_only_unpickler.Unpickler(f, encoding=encoding)
    if pickle_module is None or pickle_module is pickle:
        return _FullUnpickler(f, encoding=encoding, **kwargs)
    base: Any = pickle_module.Unpickler

    class _Custom(base):  # type: ignore[misc]
        def find_class(self, module: str, name: str) -> Any:
            return _find_class(super().find_class, module, name)

    return _Custom(f, encoding=encoding, **kwargs)


def refuse_absurd_sizes(data: bytes, path: str) -> None:
    """Scans a pickle without running it, before torch's weights-only
    unpickler runs it: its structure (memo indices, argument lengths,
    nesting: what makes CPython's own unpickler allocate or recurse without
    bound) and ``bytearray(<int>)`` beyond what the pickle could hold."""
    import pickletools

    from tierstore._dcp_pickle import scan_pickle
    from tierstore.errors import CorruptFileError, UnsafeObjectError

    scan_pickle(data, f"{path}: record 'data.pkl'")

    last_global = None
    pending_int: int | None = None
    strings: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings = [*strings[-1:], str(arg)]
            elif op.name == "GLOBAL":
                last_global = str(arg).replace(" ", ".")
            elif op.name == "STACK_GLOBAL" and len(strings) == 2:
                last_global = ".".join(strings)
            elif op.name in ("INT", "LONG", "BININT", "BININT1", "BININT2", "LONG1", "LONG4"):
                pending_int = arg if isinstance(arg, int) and not isinstance(arg, bool) else None
            elif op.name == "REDUCE":
                if last_global == "builtins.bytearray" and pending_int is not None and pending_int > len(data):
                    raise UnsafeObjectError(
                        f"{path}: record 'data.pkl': bytearray of {pending_int} bytes in a pickle of {len(data)} "
                        "bytes refused (a crafted size, not data the file holds)",
                        path=path,
                    )
                pending_int = None
    except (ValueError, EOFError, UnicodeDecodeError, IndexError) as e:
        raise CorruptFileError(
            f"{path}: record 'data.pkl': not a valid pickle ({str(e)[:200]})", path=path, record="data.pkl"
        ) from None


def _weights_only_rules() -> tuple[dict[str, Any], list[str]] | None:
    """torch's weights-only allow-list (its own and ``add_safe_globals``)
    and blocked modules; None for a torch without these internals."""
    try:
        from torch import _weights_only_unpickler as wo

        return {**wo._get_user_allowed_globals(), **wo._get_allowed_globals()}, list(wo._blocklisted_modules)
    except (ImportError, AttributeError):
        return None


def _fast_rules(data: bytes) -> tuple[dict[str, Any], list[str]] | None:
    """torch's weights-only rules for the Rust fast path over pickle ``data``,
    or None where the pickle is left to torch's own unpickler: one that
    holds ``bytearray`` (``bytearray(<int>)`` allocates what the file need
    not hold; torch's unpickler runs after refuse_absurd_sizes, which bounds
    it, and a stand-in here would differ from torch where the class itself
    is loaded), or a torch without the rules."""
    if b"bytearray" in data:
        return None
    return _weights_only_rules()


def fast_weights_only(data: bytes, persistent_load: Any) -> Any:
    """Runs torch's weights-only unpickling rules in Rust (``tierstore._core``).

    Returns ``None`` when the file needs something the fast path leaves to
    torch (another opcode, a global outside the allow-list, sparse tensors,
    ...); the caller then runs ``torch._weights_only_unpickler`` itself, which
    accepts the file or raises torch's own error. The allow-list is torch's
    default one plus ``torch.serialization.add_safe_globals``.
    """
    rules = _fast_rules(data)
    if rules is None:
        return None
    allowed, blocked = rules
    deferred = [c for c in getattr(torch, "_tensor_classes", ()) if "sparse" in getattr(c, "__module__", "")]
    # Calls of torch's rebuild go to the stand-in (the function itself, loaded
    # as a value, stays torch's); the fake-mode check is made here, once.
    substitute = (torch._utils._rebuild_tensor_v2, rebuild_tensor_v2) if no_fake_mode() else None
    # Building many small objects triggers the cyclic collector again and
    # again (a sixth of a 20,000-tensor load); the graph the fast path builds
    # runs no code of the file's, and what it makes is collected afterwards.
    with _gc.pausing():
        return _core.fast_weights_only_load(
            data, allowed, blocked, OrderedDict, Counter, deferred, persistent_load, substitute
        )


def no_fake_mode() -> bool:
    """True when no fake tensor mode is active: a load may then make real
    storages, and torch's rebuild functions need not look for one per tensor."""
    detect = getattr(getattr(torch, "_guards", None), "detect_fake_mode", None)
    return detect is None or detect(None) is None


def rebuild_tensor_v2(
    storage: Any,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool,
    backward_hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for a load that runs outside any
    fake tensor mode (checked once per load, not once per tensor as torch
    does: that check was a third of the time of loading many small tensors).
    The same tensor, built the same way."""
    untyped = storage._untyped_storage
    t = torch.empty((0,), dtype=storage.dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)
    t.requires_grad = requires_grad
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)
    t._backward_hooks = backward_hooks
    return t


def restore_location_fn(map_location: Any) -> Any:
    """``map_location`` (None, str, device, dict or callable) as a function
    ``(storage, location) -> storage``, with torch's semantics."""
    restore = torch.serialization.default_restore_location
    if map_location is None:
        return restore
    if isinstance(map_location, dict):
        return lambda s, loc: restore(s, map_location.get(loc, loc))
    if isinstance(map_location, (str, bytes)):
        target = map_location.decode() if isinstance(map_location, bytes) else map_location
        return lambda s, loc: restore(s, target)
    if isinstance(map_location, torch.device):
        target = str(map_location)
        return lambda s, loc: restore(s, target)
    if callable(map_location):

        def call(s: Any, loc: str) -> Any:
            r = map_location(s, loc)
            return restore(s, loc) if r is None else r

        return call
    raise InvalidArgumentTypeError(
        f"map_location must be None, a str, a torch.device, a dict or a callable, not {map_location!r}"
    )


def tensor_paths(obj: Any, limit: int = 1_000_000) -> list[tuple[list[str | int], torch.Tensor]]:
    """Where each tensor sits in nested dicts, lists and tuples (for the manifest)."""
    out: list[tuple[list[str | int], torch.Tensor]] = []
    stack: list[tuple[list[str | int], Any]] = [([], obj)]
    seen: set[int] = set()
    while stack and len(out) < limit:
        path, o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append((path, o))
            continue
        if id(o) in seen:
            continue
        if isinstance(o, dict):
            seen.add(id(o))
            items = [(k if isinstance(k, (str, int)) else repr(k), v) for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            seen.add(id(o))
            items = list(enumerate(o))
        else:
            continue
        for k, v in reversed(items):
            stack.append(([*path, k], v))
    return out


@dataclass(frozen=True)
class TensorView:
    """A tensor of a pickle, as ``data.pkl`` describes it: the storage it
    views (its key: record ``data/<key>``), where in it, and how."""

    key: str
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int


def tensor_views(data: bytes, path: str) -> dict[tuple[str | int, ...], TensorView]:
    """Every tensor of pickle ``data`` by its path in the object, unpickled
    under torch's weights-only rules onto the meta device (no data read,
    nothing of the file's run). For a check of the file's own manifest
    against the pickle it describes (which storage each tensor views);
    raises :class:`CorruptFileError` naming ``data.pkl`` when the pickle
    does not unpickle under those rules."""
    fast = _fast_views(data, path)  # bounded by the engine, as a load's is
    if fast is not None:
        return fast
    refuse_absurd_sizes(data, path)  # what would make torch's unpickler allocate or recurse without bound
    obj, by_impl = _meta_unpickle(data, path)
    out: dict[tuple[str | int, ...], TensorView] = {}
    for tp, t in tensor_paths(obj):
        try:
            got = by_impl.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            got = None
        if got is None:
            raise CorruptFileError(
                f"{path}: record 'data.pkl': tensor at {tp} views no storage of the file", path=path, record="data.pkl"
            )
        out[tuple(tp)] = TensorView(
            got[0], dtype_name(t.dtype), list(t.shape), list(t.stride()), int(t.storage_offset())
        )
    return out


def _fast_views(data: bytes, path: str) -> dict[tuple[str | int, ...], TensorView] | None:
    """:func:`tensor_views` through the engine's weights-only unpickler, each
    tensor rebuilt as a :class:`TensorView` rather than a tensor (a tenth of
    the time of meta tensors); ``None`` where the fast path declines."""

    def persistent_load(pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}"[:200])
        stype = pid[1]
        dtype = stype if isinstance(stype, torch.dtype) else getattr(stype, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {pid[2]!r}: no dtype in its persistent id"[:200])
        return (str(pid[2]), dtype_name(dtype))

    if b"_rebuild_tensor_v2" not in data or b"_rebuild_tensor_v3" in data or b"UntypedStorage" in data:
        # dtypes without a legacy storage class (float8, uint16, ...) rebuild
        # through v3 from untyped storages: the general path describes them
        return None

    def rebuild(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> TensorView:
        ok = (
            isinstance(storage, tuple) and isinstance(offset, int) and all(isinstance(x, int) for x in (*size, *stride))
        )
        if not ok:
            raise pickle.UnpicklingError("a tensor rebuilt from something other than a storage and sizes")
        return TensorView(storage[0], storage[1], list(size), list(stride), offset)

    rules = _fast_rules(data)
    if rules is None:
        return None
    allowed, blocked = rules
    try:
        substitute = (torch._utils._rebuild_tensor_v2, rebuild)
        load = _core.fast_weights_only_load
        obj = load(data, allowed, blocked, OrderedDict, Counter, [], persistent_load, substitute)
    except Exception as e:  # any failure of a hostile pickle is the file's
        raise _not_weights_only(path, e) from None
    if obj is None:
        return None
    out: dict[tuple[str | int, ...], TensorView] = {}
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), obj)]
    while stack:
        at, o = stack.pop()
        if isinstance(o, TensorView):
            out[at] = o
        elif isinstance(o, torch.Tensor):
            return None  # a tensor made some other way: the slow path describes it
        elif isinstance(o, dict) and len(at) < 64:
            stack.extend(((*at, k), v) for k, v in o.items() if isinstance(k, (str, int)))
        elif isinstance(o, (list, tuple)) and len(at) < 64:
            stack.extend(((*at, i), v) for i, v in enumerate(o))
    return out


def _not_weights_only(path: str, e: Exception) -> CorruptFileError:
    return CorruptFileError(
        f"{path}: record 'data.pkl': does not unpickle under the weights-only rules "
        f"({type(e).__name__}: {str(e)[:200]})",
        path=path,
        record="data.pkl",
    )


def _meta_unpickle(data: bytes, path: str) -> tuple[Any, dict[int, tuple[str, str]]]:
    """``data`` unpickled under torch's weights-only rules with every
    storage made on the meta device; also each storage's key and dtype by
    its untyped storage's ``_cdata``."""
    from torch import _weights_only_unpickler

    by_impl: dict[int, tuple[str, str]] = {}

    def persistent_load(pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}"[:200])
        stype, key, numel = pid[1], str(pid[2]), pid[4]
        # an untyped storage holds bytes (torch's loader reads it as uint8)
        dtype = torch.uint8 if stype is torch.UntypedStorage else stype
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(dtype, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int):
            raise pickle.UnpicklingError(f"storage {key!r}: bad type or size in its persistent id"[:200])
        item = torch.empty((), dtype=dtype).element_size()
        if numel < 0 or numel * item > 1 << 62:
            raise pickle.UnpicklingError(f"storage {key!r}: {numel} elements"[:200])
        untyped = torch.UntypedStorage(numel * item, device="meta")
        by_impl[untyped._cdata] = (key, dtype_name(dtype))
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    try:
        u = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
        u.persistent_load = persistent_load  # type: ignore[method-assign]
        return u.load(), by_impl
    except Exception as e:  # any failure of a hostile pickle is the file's
        raise _not_weights_only(path, e) from None


def describe_storages(data: bytes) -> tuple[dict[str, str], dict[str, list[str]]]:
    """For ``tierstore inspect`` of a file torch.save wrote: the dtype of
    each storage record (``data/<key>``) and the tensors viewing it (``path
    shape``), from ``data.pkl`` unpickled under torch's weights-only rules
    onto the meta device (no data read, nothing run). Empty when the pickle
    needs more than those rules allow."""
    try:
        refuse_absurd_sizes(data, "inspect")  # what would make the unpickler allocate or recurse without bound
        obj, by_impl = _meta_unpickle(data, "inspect")
    except CorruptFileError:  # inspect shows what it can; load and verify report the pickle's problems
        return {}, {}
    dtypes = {f"data/{k}": dt for k, dt in by_impl.values()}
    views: dict[str, list[str]] = {}
    for path, t in tensor_paths(obj):
        try:
            got = by_impl.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            continue
        if got is not None:
            shown = ".".join(str(p) for p in path) or "(root)"
            views.setdefault(f"data/{got[0]}", []).append(f"{shown} {tuple(t.shape)}")
    return dtypes, views


_PUSH_ARG = frozenset(
    {
        "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING", "STRING",
        "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    }
)  # fmt: skip
_SCAN_LIMIT = 64 << 20


def saved_locations(data: bytes) -> dict[str, str] | None:
    """The location each storage was saved from (``cpu``, ``cuda:0``) by its
    key, read from the opcodes of a torch pickle without unpickling it: the
    stack is simulated just enough to see each persistent id
    ``('storage', type, key, location, numel)``. ``None`` when the pickle does
    not parse this way (the caller then decides per storage while
    unpickling). Only a choice of path rests on it, never the bytes loaded."""
    if len(data) > _SCAN_LIMIT:
        return None
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    out: dict[str, str] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _PUSH_ARG:
                stack.append(arg)
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(str(arg))] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo.get(int(str(arg))))
            elif name == "TUPLE":
                at = marks.pop()
                items = tuple(stack[at:])
                del stack[at:]
                stack.append(items)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                if len(stack) < n:
                    return None
                items = tuple(stack[len(stack) - n :])
                del stack[len(stack) - n :]
                stack.append(items)
            elif name == "BINPERSID":
                pid = stack.pop()
                if (
                    isinstance(pid, tuple)
                    and len(pid) == 5
                    and pid[0] in ("storage", b"storage")
                    and isinstance(pid[2], str)
                    and isinstance(pid[3], str)
                ):
                    out[pid[2]] = pid[3]
                stack.append(None)
            else:
                before = [s.name for s in op.stack_before]
                if "mark" in before:
                    at = marks.pop()
                    del stack[at:]
                    pops = before.index("mark")
                else:
                    pops = len(before)
                if pops > len(stack):
                    return None
                if pops:
                    del stack[len(stack) - pops :]
                stack.extend([None] * len(op.stack_after))
    except Exception:  # any malformed pickle: no answer (the unpickler then reports what is wrong)
        return None
    return out
