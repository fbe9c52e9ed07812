"""The load side of ``tierstore.load``: a path opened once (its directory
validated in Rust), the storages read with their CRC-32s checked into the
memory that becomes each tensor's storage, streams read from their position
and left just after the archive, the unpickling under torch's rules, and
the formats torch alone reads handed to torch."""

from __future__ import annotations

import ctypes
import errno
import io as _io
import mmap as _mmap
import os
import pickle
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Any

import torch

from tierstore import _archive, _core, _gpu_load, _pickle, _progress, manifest
from tierstore import codec as _codec
from tierstore._engine import get_engine
from tierstore.errors import (
    ChecksumError,
    CorruptFileError,
    InvalidArgumentError,
    ManifestError,
    MissingRecordError,
    NotAContainerError,
    NotAFileError,
    NotSeekableError,
    StorageIOError,
    TierstoreError,
    TorchLoadError,
    TruncatedFileError,
    UnsafeObjectError,
    UnsafeTorchScriptError,
    UsageError,
)

# torch's own loader, taken at import: formats that are torch's alone are
# handed to it even where torch.load has been routed to tierstore
# (tests/compat runs PyTorch's suite that way).
_TORCH_LOAD = torch.serialization.load


def is_legacy_torch(head: bytes) -> bool:
    # Pre-1.6 torch files are a sequence of pickles (protocol 2 starts with
    # 0x80 0x02), or a tar archive from even older versions.
    return head[:1] == b"\x80" or head[257:262] == b"ustar"


def resolve_weights_only(weights_only: bool | None, pickle_module: ModuleType | None) -> bool:
    if weights_only is None:
        true_values = ("1", "y", "yes", "true")
        if os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in true_values:
            return False
        weights_only = pickle_module is None
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        weights_only = True
    if weights_only and pickle_module is not None:
        raise UsageError("Can not safely load weights when explicit pickle_module is specified")
    return bool(weights_only)


@dataclass(frozen=True)
class LoadOptions:
    """What ``tierstore.load`` was asked for besides the file: torch.load's
    arguments, resolved."""

    map_location: Any
    pickle_module: ModuleType | None
    weights_only: bool
    encoding: str
    # Whether the caller named an encoding (torch honours it for legacy
    # files even under weights_only).
    encoding_given: bool
    pickle_load_args: dict[str, Any]
    delta_base: str | list[str] | None

    @classmethod
    def of(
        cls,
        map_location: Any,
        pickle_module: ModuleType | None,
        weights_only: bool | None,
        delta_base: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
        pickle_load_args: dict[str, Any],
    ) -> LoadOptions:
        """``load``'s arguments as torch.load resolves them (``weights_only``
        from the environment and ``pickle_module``; ``encoding`` taken out of
        ``pickle_load_args``)."""
        weights = resolve_weights_only(weights_only, pickle_module)
        if pickle_load_args and weights:
            warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=3)
        args = dict(pickle_load_args)
        given = "encoding" in args
        encoding = args.pop("encoding", "utf-8")
        if delta_base is None or isinstance(delta_base, (str, os.PathLike)):
            bases: str | list[str] | None = None if delta_base is None else os.fspath(delta_base)
        else:
            bases = [os.fspath(b) for b in delta_base]
        return cls(map_location, pickle_module, weights, encoding, given, args, bases)


def hand_to_torch(src: Any, opts: LoadOptions, mmap: bool) -> Any:
    """Files in formats that are torch's alone (legacy pre-1.6, TorchScript)."""
    kwargs = dict(opts.pickle_load_args)
    if opts.encoding_given or not opts.weights_only:
        kwargs["encoding"] = opts.encoding  # torch honours it for legacy files under weights_only too
    if opts.pickle_module is not None:
        kwargs["pickle_module"] = opts.pickle_module
    name = str(src) if isinstance(src, (str, os.PathLike)) else str(getattr(src, "name", "<stream>"))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pickle_load_args only works")  # load() said so already
            return _TORCH_LOAD(
                src, map_location=opts.map_location, weights_only=opts.weights_only, mmap=mmap or None, **kwargs
            )
    except TierstoreError:
        raise
    except Exception as e:
        if not opts.weights_only:
            raise  # the file's own code may raise anything; running it was the caller's choice
        msg = " ".join(str(e).split())[:400]
        if "weights_only" in msg or "weights only" in msg.lower():
            unsafe = UnsafeTorchScriptError if isinstance(e, RuntimeError) else UnsafeObjectError
            raise unsafe(f"{name}: torch.load refused it with weights_only=True: {msg}", path=name) from None
        cls = TorchLoadError if isinstance(e, RuntimeError) else CorruptFileError
        raise cls(
            f"{name}: a legacy or TorchScript torch file that torch.load cannot read ({type(e).__name__}: {msg})",
            path=name,
        ) from None


def _expected_crc(arch: _archive.Archive, rel: str) -> int | None:
    """The CRC-32 a data record's bytes must have, or None where the file
    does not record one: ``torch.save`` under ``torch.serialization.skip_data()``
    reserves the records' space without writing the bytes and stores CRC 0
    (the bytes are populated later, in place). Only for files tierstore did
    not write (tierstore's always record the real CRC, and its manifest
    repeats it)."""
    r = arch.records[rel]
    if r.crc32 == 0 and r.size and manifest.MANIFEST_NAME not in arch.records:
        return None
    return int(r.crc32)


def _check_data_crcs(
    name: str, arch: _archive.Archive, regions: list[tuple[str, int, int]], mapped: bool = False
) -> None:
    """Checks the CRC-32 of data records held in memory: ``(record, address,
    length)`` each; ``ChecksumError`` naming the first that differs.

    ``mapped``: the regions lie in a mapping of the file ``name``; each window
    of it is read in before it is summed (``tierstore_core::mapped``), and a
    page the file no longer holds or the device cannot read is an error naming
    its record, not a ``SIGBUS``."""
    wanted = [(rel, ptr, n, _expected_crc(arch, rel)) for rel, ptr, n in regions]
    wanted = [w for w in wanted if w[3] is not None]
    if not wanted:
        return
    spans = [(ptr, n) for _, ptr, n, _ in wanted]
    threads = get_engine().info()["cpu_threads"]
    if mapped:
        got, failed = _core.crc32_mapped(spans, threads)
        if failed is not None:
            rel, err = arch.full(wanted[failed[0]][0]), failed[1]
            if err == errno.EFAULT:
                raise TruncatedFileError(
                    f"{name}: record '{rel}': the file ends before the record's bytes (it shrank while it was "
                    "being loaded)",
                    path=name,
                    record=rel,
                )
            raise StorageIOError(
                f"{name}: record '{rel}': reading the mapped file failed: {os.strerror(err)}",
                path=name,
                record=rel,
                errno=err,
            )
    else:
        got = _core.crc32_regions(spans, threads)
    for (rel, _ptr, _n, exp), c in zip(wanted, got, strict=True):
        if c != exp:
            raise ChecksumError(
                f"{name}: record '{arch.full(rel)}': checksum mismatch "
                f"(stored crc32 {exp:08x}, computed {c:08x}); the record is damaged",
                path=name,
                record=arch.full(rel),
            )


def load_path(path: str, mmap: bool, verify: bool, progress: bool | None, opts: LoadOptions) -> Any:
    try:
        arch = _archive.open_directory(path)
    except NotAContainerError:
        with open(path, "rb") as fh:
            head = fh.read(512)
        if is_legacy_torch(head):
            return hand_to_torch(path, opts, mmap)
        raise
    # TorchScript (torch.jit.save) archives hold data.pkl too, and compressed
    # code records: torch.load tells them by constants.pkl and dispatches them.
    if "constants.pkl" in arch.records:
        return hand_to_torch(path, opts, mmap)
    if "data.pkl" not in arch.records:
        raise MissingRecordError(
            f"{path}: missing record '{arch.full('data.pkl')}'", path=path, record=arch.full("data.pkl")
        )
    _m, offsets = _archive.manifest_and_offsets(arch)
    if _codec.is_compressed(_m):
        assert _m is not None
        return _load_encoded(path, arch, _m, offsets, mmap, verify, opts)
    pkl = arch.records["data.pkl"]
    data_pkl = _archive.load_small(arch, offsets["data.pkl"], pkl.size, "data.pkl")
    if verify:
        _archive.check_crc(path, arch.full("data.pkl"), data_pkl, pkl.crc32)
    byteorder = _archive.byteorder(arch, offsets, lambda off, n: _archive.load_small(arch, off, n, "byteorder"))
    keys = [rel[5:] for rel in arch.records if rel.startswith("data/")]
    storages: dict[str, torch.UntypedStorage] = {}
    if mmap:
        # Private (copy-on-write) unless torch.serialization.set_default_mmap_options(MAP_SHARED),
        # as torch.load does: then writes to the tensors reach the file.
        get_opts = getattr(torch.serialization, "get_default_mmap_options", None)
        shared = get_opts is not None and get_opts() == _mmap.MAP_SHARED
        overall = torch.UntypedStorage.from_file(path, shared, arch.file_len)
        for k in keys:
            off = offsets[f"data/{k}"]
            storages[k] = overall[off : off + arch.records[f"data/{k}"].size]
        if verify:
            _check_data_crcs(
                path, arch, [(f"data/{k}", storages[k].data_ptr(), storages[k].nbytes()) for k in keys], mapped=True
            )
    else:
        specs = [
            (
                arch.full(f"data/{k}"),
                offsets[f"data/{k}"],
                arch.records[f"data/{k}"].size,
                _expected_crc(arch, f"data/{k}") if verify else None,
            )
            for k in keys
        ]
        total = sum(s[2] for s in specs)
        routes = _gpu_routes(opts.map_location, data_pkl, keys) if byteorder == sys.byteorder else {}
        if routes:
            return _load_with_gpu(path, data_pkl, keys, specs, routes, byteorder, verify, progress, opts)
        # The reads run in the engine while this thread unpickles: tensors are
        # built on the buffers as they fill, and nothing reads their bytes
        # before the read has finished (see _unpickle's `ready`).
        pending = _core.start_read(get_engine(), path, specs, verify=verify)
        for k, b in zip(keys, pending.buffers, strict=True):
            storages[k] = _storage_over(b)
        with _progress.bar(_progress.wanted(progress) and total > 0, f"loading {path}") as cb:
            waited = False

            def ready() -> None:
                nonlocal waited
                if not waited:
                    waited = True
                    pending.wait(cb)

            try:
                result = _unpickle(path, data_pkl, storages, byteorder, opts, ready)
                ready()
            except BaseException:
                pending.abandon()
                raise
        return result
    return _unpickle(path, data_pkl, storages, byteorder, opts)


def _load_encoded(
    path: str,
    arch: _archive.Archive,
    m: dict[str, Any],
    offsets: dict[str, int],
    mmap: bool,
    verify: bool,
    opts: LoadOptions,
) -> Any:
    """A compressed file (:mod:`tierstore.codec`): its storages decoded into
    fresh host memory (with the references they are deltas against), then
    the object graph of ``.tierstore/data.pkl`` built over them."""
    if mmap:
        raise InvalidArgumentError(
            f"{path}: mmap=True cannot map a compressed file's tensors; load it without mmap, or write a plain copy "
            f"with `tierstore convert --plain {path} PLAIN.pt`"
        )
    _codec.check_codec(path, m)
    pk = _codec.PICKLE_NAME
    if pk not in arch.records:
        raise MissingRecordError(f"{path}: missing record '{arch.full(pk)}'", path=path, record=arch.full(pk))
    rec = arch.records[pk]
    data_pkl = _archive.load_small(arch, offsets[pk], rec.size, pk)
    if verify:
        _archive.check_crc(path, arch.full(pk), data_pkl, rec.crc32)
    byteorder = _archive.byteorder(arch, offsets, lambda off, n: _archive.load_small(arch, off, n, "byteorder"))
    decoded = _codec.read_decoded(path, None, verify=verify, delta_base=opts.delta_base)
    storages = {n[5:]: (t.untyped_storage() if t.numel() else _empty_storage()) for n, t in decoded.items()}
    return _unpickle(path, data_pkl, storages, byteorder, opts)


_NOT_SEEKABLE = (
    "You can only torch.load from a file that is seekable. Please pre-load the data into a buffer like "
    "io.BytesIO and try to load from it instead."
)


def _stream_start(f: Any, name: str) -> tuple[int, int]:
    """Where the archive starts in the stream (its position) and how many
    bytes follow; errors of torch's types for what cannot be loaded from."""
    try:
        start = f.tell()
        f.seek(start)
    except _io.UnsupportedOperation as e:
        raise NotSeekableError(f"{name}: the stream cannot seek ({e}). {_NOT_SEEKABLE}", path=name) from None
    except OSError as e:
        if e.errno != errno.ESPIPE:
            raise
        raise NotSeekableError(
            f"{name}: the stream cannot seek (a pipe or socket). {_NOT_SEEKABLE}", path=name
        ) from None
    except AttributeError as e:
        raise NotAFileError(f"{name}: the file object has no seek or tell ({e}). {_NOT_SEEKABLE}", path=name) from None
    end = f.seek(0, os.SEEK_END)
    f.seek(start)
    if not isinstance(start, int) or not isinstance(end, int) or end < start:
        raise NotSeekableError(f"{name}: seek/tell report positions {start!r} and {end!r}. {_NOT_SEEKABLE}", path=name)
    return start, end - start


def _read_exact(f: Any, name: str, rel: str, pos: int, out: memoryview) -> None:
    """Fills ``out`` from ``pos`` of the stream, with ``readinto`` when it has
    one (straight into the tensor's memory), else ``read`` in pieces."""
    f.seek(pos)
    n = len(out)
    got = 0
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(out[got:])
        else:
            chunk = f.read(min(n - got, 16 << 20))
            k = len(chunk)
            out[got : got + k] = chunk
        if not k:
            raise TruncatedFileError(
                f"{name}: record '{rel}': the stream ended after {got} of its {n} bytes", path=name, record=rel
            )
        got += k


def load_stream(f: IO[bytes], verify: bool, opts: LoadOptions) -> Any:
    """Loads the archive that starts at the stream's position, reading only
    its headers, directory and records (each record straight into its
    tensor's memory), and leaves the position just after the archive, as
    torch.load does: objects saved one after another load one after another.
    """
    name = str(getattr(f, "name", "<stream>"))
    start, avail = _stream_start(f, name)
    head = f.read(512)
    f.seek(start)
    if is_legacy_torch(head):
        return hand_to_torch(f, opts, False)  # torch leaves the position after the legacy pickles
    records, cd_offset, arch_len, offs = _core.read_directory_stream(f, start, avail, name)
    arch = _archive.Archive(name, records, cd_offset, arch_len)
    if "constants.pkl" in arch.records:  # TorchScript, as in _load_path
        f.seek(start)
        return hand_to_torch(f, opts, False)
    if "data.pkl" not in arch.records:
        raise MissingRecordError(
            f"{name}: missing record '{arch.full('data.pkl')}'", path=name, record=arch.full("data.pkl")
        )
    _archive.refuse_compressed(name, arch)
    offsets = dict(zip(arch.records, offs, strict=True))

    def small(rel: str) -> bytes:
        buf = bytearray(arch.records[rel].size)
        _read_exact(f, name, arch.full(rel), start + offsets[rel], memoryview(buf))
        if verify:
            _archive.check_crc(name, arch.full(rel), buf, arch.records[rel].crc32)
        return bytes(buf)

    _check_stream_manifest(name, arch, offsets, small)
    data_pkl = small("data.pkl")
    byteorder = _archive.byteorder(arch, offsets, lambda off, n: small("byteorder"))
    storages: dict[str, torch.UntypedStorage] = {}
    regions: list[tuple[str, int, int]] = []
    for rel in arch.records:
        if not rel.startswith("data/"):
            if verify and rel not in ("data.pkl", "byteorder", manifest.MANIFEST_NAME):
                small(rel)  # every record's checksum is checked, as a path load does
            continue
        n = arch.records[rel].size
        if not n:
            storages[rel[5:]] = _empty_storage()
            continue
        st = torch.empty(n, dtype=torch.uint8).untyped_storage()
        _read_exact(
            f,
            name,
            arch.full(rel),
            start + offsets[rel],
            memoryview((ctypes.c_char * n).from_address(st.data_ptr())).cast("B"),
        )
        storages[rel[5:]] = st
        regions.append((rel, st.data_ptr(), n))
    if verify:
        _check_data_crcs(name, arch, regions)
    f.seek(start + arch_len)
    return _unpickle(name, data_pkl, storages, byteorder, opts)


def _check_stream_manifest(
    name: str, arch: _archive.Archive, offsets: dict[str, int], read: Callable[[str], bytes]
) -> None:
    """The checks a path load makes of a tierstore manifest, for an archive
    read from a file object: each record it lists has the size, CRC-32 and
    data offset the zip directory and local headers give."""
    rel = manifest.MANIFEST_NAME
    if rel not in arch.records:
        return
    size, crc = arch.records[rel].size, arch.records[rel].crc32
    if size > manifest.MAX_MANIFEST_BYTES:
        raise ManifestError(f"{name}: record '{arch.full(rel)}': absurd size {size}", path=name, record=rel)
    data = read(rel)
    _archive.check_crc(name, arch.full(rel), data, crc)
    m = manifest.parse(data, name, arch.file_len)
    if _codec.is_compressed(m):
        raise InvalidArgumentError(
            f"{name}: a tierstore-compressed file (codec {m.get('codec')!r:.40}) loads from its path, not from a "
            "file object: call tierstore.load(PATH)"
        )
    for r in m["records"]:
        ent = arch.records.get(r["name"])
        if ent is None or ent.crc32 != r["crc32"] or ent.size != r["size"] or offsets.get(r["name"]) != r["offset"]:
            raise ManifestError(
                f"{name}: record '{rel}': entry for '{r['name']}' (size {r['size']}, crc32 {r['crc32']:08x}, offset "
                f"{r['offset']}) disagrees with the zip directory and local headers",
                path=name,
                record=rel,
            )


def _empty_storage() -> torch.UntypedStorage:
    """An empty storage that cannot be resized, as torch.load makes for an
    empty record: a tensor that claims more elements than its record holds
    fails to build instead of growing over uninitialised memory."""
    st: torch.UntypedStorage = torch.frombuffer(bytearray(1), dtype=torch.uint8).untyped_storage()[0:0]
    return st


def _storage_over(buf: Any) -> torch.UntypedStorage:
    """An untyped storage viewing ``buf`` without a copy (it keeps ``buf`` alive)."""
    if not len(buf):
        return _empty_storage()
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def _load_with_gpu(
    path: str,
    data_pkl: bytes,
    keys: list[str],
    specs: list[tuple[str, int, int, int | None]],
    routes: dict[str, torch.device],
    byteorder: str,
    verify: bool,
    progress: bool | None,
    opts: LoadOptions,
) -> Any:
    """A load where the storages in ``routes`` go to a GPU: those are read
    through pinned buffers straight into device memory (the copies overlapped
    with the reads), the others into host buffers by the engine meanwhile."""
    storages: dict[str, torch.UntypedStorage] = {}
    host = [(k, s) for k, s in zip(keys, specs, strict=True) if k not in routes]
    total = sum(s[2] for s in specs)
    pending = _core.start_read(get_engine(), path, [s for _k, s in host], verify=verify) if host else None
    try:
        if pending is not None:
            for (k, _s), b in zip(host, pending.buffers, strict=True):
                storages[k] = _storage_over(b)
        with _progress.bar(_progress.wanted(progress) and total > 0, f"loading {path}") as cb:
            done = 0

            def step(n: int) -> None:
                nonlocal done
                done += n
                if cb is not None:
                    cb(done, total)

            for dev in dict.fromkeys(routes.values()):
                mine = [(k, s) for k, s in zip(keys, specs, strict=True) if routes.get(k) == dev]
                got = _gpu_load.load_records_to_device(path, [s for _k, s in mine], dev, on_chunk=step)
                storages.update(zip((k for k, _s in mine), got, strict=True))
            if pending is not None:
                pending.wait()
    except BaseException:
        if pending is not None:
            pending.abandon()
        raise
    return _unpickle(path, data_pkl, storages, byteorder, opts)


def _gpu_routes(map_location: Any, data_pkl: bytes, keys: list[str]) -> dict[str, torch.device]:
    """The storages that the restore sends to a GPU, by key, with their
    device: every storage for a ``map_location`` naming a GPU; for ``None``
    or a dict, those whose saved location (read from ``data.pkl``'s opcodes)
    maps to one. Empty without a GPU, for a callable, or when unsure."""
    if not keys or not torch.cuda.is_available():
        return {}
    one = _gpu_target(map_location)
    if one is not None:
        return dict.fromkeys(keys, one)
    if map_location is not None and not isinstance(map_location, dict):
        return {}
    # The opcode scan costs about 30 us per storage; where neither data.pkl
    # nor map_location names a GPU (a file saved on the CPU, loaded as
    # saved), no storage can go to one.
    names_gpu = isinstance(map_location, dict) and any("cuda" in str(v) for v in map_location.values())
    if not names_gpu and b"cuda" not in data_pkl:
        return {}
    locs = _pickle.saved_locations(data_pkl)
    if not locs:
        return {}
    out: dict[str, torch.device] = {}
    for k in keys:
        loc = locs.get(k)
        if loc is None:
            continue
        target = map_location.get(loc, loc) if isinstance(map_location, dict) else loc
        dev = _gpu_target(target)
        if dev is not None:
            out[k] = dev
    return out


def _gpu_target(map_location: Any) -> torch.device | None:
    """The GPU every storage is restored to, when ``map_location`` names one
    (``"cuda"``, ``"cuda:1"``, a ``torch.device``) and it exists."""
    if not isinstance(map_location, (str, torch.device)):
        return None
    try:
        dev = torch.device(map_location)
    except (RuntimeError, TypeError):
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        return None  # torch's restore raises its own error for a missing device
    return torch.device("cuda", index)


def _stays_on_host(map_location: Any, location: str) -> bool:
    """True when restoring a storage saved at ``location`` keeps it on the CPU
    (or makes it meta) without reading its bytes."""
    if map_location is None:
        target = location
    elif isinstance(map_location, dict):
        target = map_location.get(location, location)
    elif isinstance(map_location, (str, torch.device)):
        target = str(map_location)
    else:
        return False  # a callable may do anything with the data
    return target == "cpu" or target.startswith("meta")


def _unpickle(
    path: str,
    data_pkl: bytes,
    storages: dict[str, torch.UntypedStorage],
    byteorder: str,
    opts: LoadOptions,
    ready: Callable[[], None] | None = None,
) -> Any:
    """Unpickles ``data.pkl`` over ``storages``. ``ready()`` blocks until the
    storages hold their data; it is called before anything reads them."""
    restore = _pickle.restore_location_fn(opts.map_location)
    loaded: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise CorruptFileError(
                f"{path}: record 'data.pkl': bad persistent id {saved_id!r:.100}",
                path=path,
                record="data.pkl",
            )
        typename, storage_type, key, location, numel = saved_id
        if isinstance(typename, bytes):
            typename = typename.decode("ascii", "replace")
        if typename != "storage":
            raise CorruptFileError(
                f"{path}: record 'data.pkl': unknown persistent id type {typename!r:.100}",
                path=path,
                record="data.pkl",
            )
        if isinstance(location, bytes):
            location = location.decode("ascii", "replace")
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        elif isinstance(getattr(storage_type, "dtype", None), torch.dtype):
            dtype = storage_type.dtype
        else:
            raise CorruptFileError(
                f"{path}: record 'data.pkl': bad storage type {storage_type!r:.100}", path=path, record="data.pkl"
            )
        typed = loaded.get(key) if isinstance(key, str) else None
        if typed is not None and typed.dtype == dtype:  # as torch.load: loaded once per dtype
            return typed
        if not isinstance(key, str) or not isinstance(location, str) or not isinstance(numel, int) or numel < 0:
            raise CorruptFileError(
                f"{path}: record 'data.pkl': bad storage reference {saved_id!r:.200}", path=path, record="data.pkl"
            )
        nbytes = numel * dtype.itemsize
        raw = storages.get(key)
        if raw is None:
            raise MissingRecordError(
                f"{path}: missing record 'data/{key}' (referenced by data.pkl)",
                path=path,
                record=f"data/{key}",
            )
        if raw.nbytes() != nbytes:  # torch.load refuses both, a longer record as a shorter one
            raise CorruptFileError(
                f"{path}: record 'data/{key}' holds {raw.nbytes()} bytes but data.pkl expects {nbytes}",
                path=path,
                record=f"data/{key}",
            )
        if ready is not None and (byteorder != sys.byteorder or not _stays_on_host(opts.map_location, location)):
            ready()
        if byteorder != sys.byteorder:
            raw.byteswap(dtype)
        # A storage already read into device memory is where map_location sends it.
        placed = raw if raw.device.type != "cpu" else restore(raw, location)
        typed = torch.storage.TypedStorage(wrap_storage=placed, dtype=dtype, _internal=True)
        if key not in loaded:
            loaded[key] = typed
        return typed

    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None:
        tls.map_location = opts.map_location
    try:
        result = _pickle.fast_weights_only(data_pkl, persistent_load) if opts.weights_only else None
        if result is None:
            if opts.weights_only:
                _pickle.refuse_absurd_sizes(data_pkl, path)
            up = _pickle.unpickler(
                data_pkl,
                weights_only=opts.weights_only,
                pickle_module=opts.pickle_module,
                encoding=opts.encoding,
                **opts.pickle_load_args,
            )
            up.persistent_load = persistent_load
            result = up.load()
    except TierstoreError:
        raise
    except pickle.UnpicklingError as e:
        if opts.weights_only:
            raise UnsafeObjectError(
                f"{path}: weights_only=True refused to load this file: {e}\n"
                "If you trust the file, allow the global(s) named above with "
                "torch.serialization.add_safe_globals([...]) or the torch.serialization.safe_globals([...]) "
                "context manager, or load with weights_only=False (which can run arbitrary code).",
                path=path,
            ) from None
        raise
    except (MemoryError, RecursionError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            UnicodeDecodeError, RuntimeError, OverflowError, struct.error) as e:  # fmt: skip
        if not opts.weights_only:
            raise  # code the file runs may raise anything; it is the caller's choice to run it
        raise CorruptFileError(
            f"{path}: record 'data.pkl': the object graph cannot be rebuilt ({type(e).__name__}: {str(e)[:300]}); "
            "the file is damaged",
            path=path,
            record="data.pkl",
        ) from None
    finally:
        if tls is not None:
            tls.map_location = None
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        try:
            validate(weights_only=opts.weights_only)
        except TypeError:
            validate()
    return result
