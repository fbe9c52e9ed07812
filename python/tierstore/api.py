"""``tierstore.save`` and ``tierstore.load``: drop-in ``torch.save`` / ``torch.load``.

The file is the zip archive ``torch.save`` writes (``data.pkl`` plus one record
per storage), with each record's data aligned to 4096 bytes, correct CRC-32s,
and a manifest record that ``torch.load`` ignores. Writes go through the Rust
engine (io_uring, O_DIRECT, many requests in flight, fsync, atomic rename);
reads land directly in the memory that becomes each tensor's storage.
"""

from __future__ import annotations

import ctypes
import errno
import io as _io
import mmap as _mmap
import os
import pickle
import secrets
import struct
import sys
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Any

import torch

from tierstore import _archive, _core, _pickle, _progress, manifest
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
    TierstoreError,
    TorchLoadError,
    TruncatedFileError,
    UnsafeObjectError,
    UnsafeTorchScriptError,
    UsageError,
)

__all__ = ["load", "save"]

FileLike = str | os.PathLike[str] | IO[bytes]
MapLocation = None | str | torch.device | dict[str, str] | Callable[[Any, str], Any]

DEFAULT_ALIGN = 4096
# Metadata records (data.pkl, version, the manifest, ...) are aligned like
# torch aligns records; only storages need page alignment.
_META_ALIGN = 64
_STREAM_CHUNK = 8 << 20


# torch's own functions, taken at import: formats that are torch's alone are
# handed to them even where torch.save / torch.load have been routed to
# tierstore (tests/compat runs PyTorch's suite that way).
_TORCH_SAVE = torch.serialization.save
_TORCH_LOAD = torch.serialization.load


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike))


def _archive_name(f: Any) -> str:
    """The prefix of every record name, as torch derives it from the file name."""
    if not _is_path(f):
        return "archive"
    stem = os.path.splitext(os.path.basename(os.fspath(f)))[0]
    clean = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "_" for c in stem)
    return clean or "archive"


def _small_records(byteorder: bool, align: int) -> list[tuple[str, bytes]]:
    recs = [
        (".format_version", b"1"),
        (".storage_alignment", str(align).encode()),
    ]
    if byteorder:
        recs.append(("byteorder", sys.byteorder.encode()))
    recs.append(("version", b"3\n"))
    # Not from the global `random`: a save (often on a background thread) must not move the training's stream.
    serial = f"{secrets.randbelow(10**40):040d}"
    recs.append((".data/serialization_id", serial.encode()))
    return recs


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_entries(
    found: list[tuple[list[str | int], torch.Tensor]],
    collector: _pickle.StorageCollector,
    layouts: Mapping[tuple[str | int, ...], Any] | None = None,
) -> list[dict[str, Any]]:
    out = []
    for path, t in found:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            continue
        try:
            key = collector.key_of(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            continue
        if key is None:
            continue
        out.append(
            {
                "path": path,
                "record": f"data/{key}",
                "dtype": _dtype_name(t.dtype),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "layout": None if layouts is None else layouts.get(tuple(path)),
            }
        )
    return out


def _host_storages(
    collector: _pickle.StorageCollector, skip: set[str] | None = None
) -> list[tuple[str, torch.UntypedStorage]]:
    """Each storage not in ``skip`` on the host (device storages are copied;
    meta ones refused)."""
    out = []
    for key, s in collector.storages.items():
        if skip is not None and key in skip:
            continue
        st = s.storage
        if st.device.type == "meta":
            raise TierstoreError(f"cannot save the data of meta storage data/{key}: it has none")
        if st.device.type != "cpu":
            st = st.cpu()
        out.append((key, st))
    return out


# storage address -> (gate, value it must reach before the storage is read)
Gates = Mapping[int, tuple[_core.Gate, int]]


def _skip_data() -> bool:
    """True inside ``torch.serialization.skip_data()``."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    return bool(getattr(tls, "skip_data", False))


def save(
    obj: Any,
    f: FileLike,
    pickle_module: ModuleType | None = None,
    pickle_protocol: int = _pickle.DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    *,
    durable: bool = True,
    progress: bool | None = False,
    align: int = DEFAULT_ALIGN,
    background: bool = False,
) -> None:
    """Saves ``obj`` to ``f`` like ``torch.save``, at the disk's speed.

    ``f`` is a path or a writable binary file object (written front to back,
    a slower path). A path is replaced atomically: the data goes to a
    temporary file in the same directory, which is fsynced and renamed over
    ``f`` (and the directory fsynced) only when complete, so a crash leaves
    either the old file or the new one. ``durable=False`` skips the fsyncs.
    ``progress`` shows a progress bar (``None``: when stderr is a terminal).
    ``background=True`` sends the writes through the engine's background
    class (yielding to foreground loads, subject to its rate limit).
    """
    if not _use_new_zipfile_serialization:
        # The legacy pre-1.6 format is torch's alone.
        _TORCH_SAVE(obj, f, pickle_module or pickle, pickle_protocol, _use_new_zipfile_serialization=False)
        return
    if _skip_data():
        # torch.serialization.skip_data(): the records' space is reserved and
        # their bytes left unwritten, to be populated later in place; torch's
        # own writer does exactly that (and stores CRC 0 for them).
        _TORCH_SAVE(obj, f, pickle_module or pickle, pickle_protocol)
        return
    _check_align(align)
    if not isinstance(f, (str, os.PathLike)) and not hasattr(f, "write"):
        raise NotAFileError(
            f"f must be a path or a writable binary file object, not {type(f).__name__} (it has no write)"
        )
    if isinstance(f, (str, os.PathLike)):
        pickler = _PickleJob(obj, pickle_module, pickle_protocol)
        small = _small_records(not _disable_byteorder_record, align)
        _save_path(os.fspath(f), pickler, small, durable=durable, progress=progress, align=align, background=background)
    else:
        pickler = _PickleJob(obj, pickle_module, pickle_protocol)
        prefix = _archive_name(f)
        data_pkl = pickler.run()
        storages = _host_storages(pickler.collector)
        parts = _ManifestParts(prefix, pickler.collector, pickler.found, align)
        small = _small_records(not _disable_byteorder_record, align)
        _save_stream(f, prefix, data_pkl, storages, small, parts, align)


def _check_align(align: int) -> None:
    if align & (align - 1) or not 64 <= align <= 32768:
        raise InvalidArgumentError(f"align must be a power of two between 64 and 32768, got {align}")


@dataclass(frozen=True)
class Written:
    """What :func:`write_file` wrote, as its writer placed it: the file's
    length, its manifest's records (name without the archive folder, data
    offset, size, CRC-32) and tensors, and the CRC-32 of the manifest record."""

    file_len: int
    records: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    manifest_crc32: int


def write_file(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    durable: bool = True,
    background: bool = False,
    gates: Gates | None = None,
    chunk_checksums: bool = False,
    layouts: Mapping[tuple[str | int, ...], Any] | None = None,
) -> Written:
    """The file writer under :func:`save` for the package's own containers
    (shard files, objects files, Checkpointer snapshots): ``gates`` lets the
    writer read storages still being filled by a capture, ``chunk_checksums``
    adds the per-chunk table partial reads verify against, ``layouts`` gives
    tensors' shard layouts for the manifest. Returns where everything went,
    so that no caller opens the file again to learn it."""
    pickler = _PickleJob(obj, None, _pickle.DEFAULT_PROTOCOL)
    small = _small_records(True, DEFAULT_ALIGN)
    return _save_path(
        os.fspath(path),
        pickler,
        small,
        durable=durable,
        progress=False,
        align=DEFAULT_ALIGN,
        background=background,
        gates=gates,
        chunk_checksums=chunk_checksums,
        layouts=layouts,
    )


class _PickleJob:
    """The object to pickle, with its storages found beforehand: those
    reachable through dicts, lists and tuples get their keys before pickling,
    so that their bytes are written while the pickler runs."""

    def __init__(self, obj: Any, module: ModuleType | None, protocol: int) -> None:
        self.obj, self.module, self.protocol = obj, module, protocol
        self.found = _pickle.tensor_paths(obj)
        self.collector = _pickle.StorageCollector()
        self.collector.preseed([t for _, t in self.found])

    def run(self) -> bytes:
        data, _ = _pickle.dumps(self.obj, self.module, self.protocol, self.collector)
        return data


class _ManifestParts:
    """The manifest, prepared while the data is written; CRCs come last."""

    def __init__(
        self,
        prefix: str,
        collector: _pickle.StorageCollector,
        found: list[tuple[list[str | int], torch.Tensor]],
        align: int,
        layouts: Mapping[tuple[str | int, ...], Any] | None = None,
    ) -> None:
        self.prefix, self.collector, self.align = prefix, collector, align
        self.tensors = _tensor_entries(found, collector, layouts)
        self.tensors_json = manifest.dump_tensors(self.tensors)
        self.records: list[dict[str, Any]] = []

    def build(
        self,
        entries: list[_core.PlannedRecord],
        crcs: dict[str, int],
        chunks: dict[str, dict[str, Any]] | None = None,
    ) -> bytes:
        from tierstore import __version__

        records = []
        cut = len(self.prefix) + 1
        storages = self.collector.storages
        for e in entries:
            rel = e.name[cut:]
            rec: dict[str, Any] = {"name": rel, "offset": e.data_offset, "size": e.size, "crc32": crcs[e.name]}
            if rel.startswith("data/"):
                s = storages[rel[5:]]
                rec["kind"] = "storage"
                rec["dtype"] = _dtype_name(s.dtype)
                rec["numel"] = s.numel
                rec["location"] = s.location
                rec["codec"] = "raw"
                rec["delta_base"] = None
                if chunks is not None and rel in chunks:
                    rec["chunks"] = chunks[rel]
            else:
                rec["kind"] = "pickle" if rel == "data.pkl" else "meta"
            records.append(rec)
        self.records = records
        return manifest.build(
            archive=self.prefix,
            alignment=self.align,
            records=records,
            tensors_json=self.tensors_json,
            writer=f"tierstore {__version__}",
            torch_version=torch.__version__,
        )


def _add_storages(
    target: _core.Writer | _core.Stream,
    prefix: str,
    storages: list[tuple[str, torch.UntypedStorage]],
    gates: Gates | None = None,
) -> None:
    """Adds one record per storage; the storage is kept alive by the target.
    A storage whose address is in ``gates`` is still being filled: the
    writer reads it once its gate reaches the given value."""
    for key, st in storages:
        name = f"{prefix}/data/{key}"
        n = st.nbytes()
        if n == 0:
            target.add_bytes(name, b"")
        elif gates and st.data_ptr() in gates and isinstance(target, _core.Writer):
            gate, at = gates[st.data_ptr()]
            target.add_memory(name, st.data_ptr(), n, st, gate, at)
        else:
            target.add_memory(name, st.data_ptr(), n, st)


def _save_path(
    path: str,
    pickler: _PickleJob,
    small: list[tuple[str, bytes]],
    *,
    durable: bool,
    progress: bool | None,
    align: int,
    background: bool,
    gates: Gates | None = None,
    chunk_checksums: bool = False,
    layouts: Mapping[tuple[str | int, ...], Any] | None = None,
) -> Written:
    collector, found, prefix = pickler.collector, pickler.found, _archive_name(path)
    w = _core.create_writer(get_engine(), path, align=align, durable=durable, background=background)
    added: set[str] = set()
    # Host copies of device storages must live until their bytes are written.
    keep: list[tuple[str, torch.UntypedStorage]] = []

    def add_new() -> int:
        new = _host_storages(collector, added)
        _add_storages(w, prefix, new, gates)
        keep.extend(new)
        added.update(k for k, _st in new)
        return sum(st.nbytes() for _k, st in new)

    try:
        total = add_new()
        with _progress.bar(_progress.wanted(progress) and total > 0, f"saving {path}") as cb:
            w.start_data()
            # Pickling and most of the manifest are done while the engine writes.
            data_pkl = pickler.run()
            late = [key for key in collector.storages if key not in added]
            parts = _ManifestParts(prefix, collector, found, align, layouts)
            w.wait_data(cb)
            if late:  # storages only the pickler found (inside custom objects)
                add_new()
                w.write_data(cb)
        chunks = None
        if chunk_checksums:
            table, chunks = _chunk_table(keep)
            small = [*small, (manifest.CHUNKS_NAME, table)]
        for name, data in [("data.pkl", data_pkl), *small]:
            w.add_bytes(f"{prefix}/{name}", data, _META_ALIGN)
        entries = w.entries()
        crcs = {e.name: e.crc32 for e in entries if e.crc32 is not None}
        for name, data in [("data.pkl", data_pkl), *small]:
            crcs[f"{prefix}/{name}"] = zlib.crc32(data)
        built = parts.build(entries, crcs, chunks)
        w.add_bytes(f"{prefix}/{manifest.MANIFEST_NAME}", built, _META_ALIGN)
        file_len = w.commit()
    except BaseException:
        w.abort()
        raise
    return Written(file_len, parts.records, parts.tensors, zlib.crc32(built))


def _chunk_table(storages: list[tuple[str, torch.UntypedStorage]]) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """The chunk checksums of every storage (the record ``.tierstore/chunks``)
    and, per storage record, where its part of the table is (docs/FORMAT.md)."""
    regions = [(st.data_ptr(), st.nbytes()) for _k, st in storages]
    table = _core.chunk_checksums(get_engine(), regions, manifest.CHUNK_BYTES, manifest.CHUNK_ALGO)
    out: dict[str, dict[str, Any]] = {}
    at = 0
    for key, st in storages:
        count = -(-st.nbytes() // manifest.CHUNK_BYTES)
        part = table[at : at + 4 * count]
        out[f"data/{key}"] = {
            "size": manifest.CHUNK_BYTES,
            "algo": manifest.CHUNK_ALGO,
            "at": at,
            "count": count,
            "crc32": zlib.crc32(part),
        }
        at += 4 * count
    return table, out


def _save_stream(
    f: IO[bytes],
    prefix: str,
    data_pkl: bytes,
    storages: list[tuple[str, torch.UntypedStorage]],
    small: list[tuple[str, bytes]],
    parts: _ManifestParts,
    align: int,
) -> None:
    s = _core.Stream(align=align, chunk_bytes=_STREAM_CHUNK, threads=get_engine().info()["cpu_threads"])
    _add_storages(s, prefix, storages)
    for name, data in [("data.pkl", data_pkl), *small]:
        s.add_bytes(f"{prefix}/{name}", data, _META_ALIGN)
    crcs = dict(zip((e.name for e in s.entries()), s.checksums(), strict=True))
    m = parts.build(s.entries(), crcs)
    s.add_bytes(f"{prefix}/{manifest.MANIFEST_NAME}", m, _META_ALIGN)
    while (chunk := s.next_chunk()) is not None:
        f.write(chunk)
    flush = getattr(f, "flush", None)
    if flush is not None:
        flush()


# ----------------------------------------------------------------------------
# Loading


def _is_legacy_torch(head: bytes) -> bool:
    # Pre-1.6 torch files are a sequence of pickles (protocol 2 starts with
    # 0x80 0x02), or a tar archive from even older versions.
    return head[:1] == b"\x80" or head[257:262] == b"ustar"


def _resolve_weights_only(weights_only: bool | None, pickle_module: ModuleType | None) -> bool:
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


def load(
    f: FileLike,
    map_location: MapLocation = None,
    pickle_module: ModuleType | None = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    verify: bool = True,
    progress: bool | None = False,
    **pickle_load_args: Any,
) -> Any:
    """Loads an object saved by ``tierstore.save`` or ``torch.save``, like ``torch.load``.

    ``map_location`` (a string, ``torch.device``, dict or callable),
    ``weights_only`` (default True: only tensors, primitive types and the
    globals allowed by ``torch.serialization.add_safe_globals``) and ``mmap``
    behave as in ``torch.load`` (a mapping is private unless
    ``torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)``).
    Every record's CRC-32 is checked unless ``verify=False`` (also on mapped
    loads: a file changed through a shared mapping then fails them); a
    damaged record raises ``ChecksumError`` naming it.
    Files in torch's legacy pre-1.6 format are handed to ``torch.load``.
    """
    weights_only = _resolve_weights_only(weights_only, pickle_module)
    if pickle_load_args and weights_only:
        warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
    encoding_given = "encoding" in pickle_load_args
    encoding = pickle_load_args.pop("encoding", "utf-8")
    opts = dict(
        map_location=map_location,
        pickle_module=pickle_module,
        weights_only=weights_only,
        encoding=encoding,
        encoding_given=encoding_given,
        pickle_load_args=pickle_load_args,
    )
    if _skip_data() or not _pickle.no_fake_mode():
        # torch.serialization.skip_data(): storages are made, not read (fake
        # tensors with materialize_fake_tensors); under a FakeTensorMode,
        # storages become fake ones on their saved device: torch's loader
        # does both.
        return _hand_to_torch(f, opts, bool(mmap))
    if isinstance(f, (str, os.PathLike)):
        return _load_path(os.fspath(f), bool(mmap), verify, progress, opts)
    if mmap:
        raise InvalidArgumentError("f must be a file path in order to use the mmap argument")
    if not hasattr(f, "read"):
        raise NotAFileError(
            f"f must be a path or a readable binary file object, not {type(f).__name__} (it has no read)"
        )
    return _load_stream(f, verify, opts)


def _hand_to_torch(src: Any, opts: dict[str, Any], mmap: bool) -> Any:
    """Files in formats that are torch's alone (legacy pre-1.6, TorchScript)."""
    kwargs = dict(opts["pickle_load_args"])
    if opts["encoding_given"] or not opts["weights_only"]:
        kwargs["encoding"] = opts["encoding"]  # torch honours it for legacy files under weights_only too
    if opts["pickle_module"] is not None:
        kwargs["pickle_module"] = opts["pickle_module"]
    name = str(src) if isinstance(src, (str, os.PathLike)) else str(getattr(src, "name", "<stream>"))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pickle_load_args only works")  # load() said so already
            return _TORCH_LOAD(
                src, map_location=opts["map_location"], weights_only=opts["weights_only"], mmap=mmap or None, **kwargs
            )
    except TierstoreError:
        raise
    except Exception as e:
        if not opts["weights_only"]:
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


def _check_data_crcs(name: str, arch: _archive.Archive, regions: list[tuple[str, int, int]]) -> None:
    """Checks the CRC-32 of data records held in memory: ``(record, address,
    length)`` each; ``ChecksumError`` naming the first that differs."""
    wanted = [(rel, ptr, n, _expected_crc(arch, rel)) for rel, ptr, n in regions]
    wanted = [w for w in wanted if w[3] is not None]
    if not wanted:
        return
    got = _core.crc32_regions([(ptr, n) for _, ptr, n, _ in wanted], get_engine().info()["cpu_threads"])
    for (rel, _ptr, _n, exp), c in zip(wanted, got, strict=True):
        if c != exp:
            raise ChecksumError(
                f"{name}: record '{arch.full(rel)}': checksum mismatch "
                f"(stored crc32 {exp:08x}, computed {c:08x}); the record is damaged",
                path=name,
                record=arch.full(rel),
            )


def _load_path(path: str, mmap: bool, verify: bool, progress: bool | None, opts: dict[str, Any]) -> Any:
    try:
        arch = _archive.open_directory(path)
    except NotAContainerError:
        with open(path, "rb") as fh:
            head = fh.read(512)
        if _is_legacy_torch(head):
            return _hand_to_torch(path, opts, mmap)
        raise
    # TorchScript (torch.jit.save) archives hold data.pkl too, and compressed
    # code records: torch.load tells them by constants.pkl and dispatches them.
    if "constants.pkl" in arch.records:
        return _hand_to_torch(path, opts, mmap)
    if "data.pkl" not in arch.records:
        raise MissingRecordError(
            f"{path}: missing record '{arch.full('data.pkl')}'", path=path, record=arch.full("data.pkl")
        )
    _m, offsets = _archive.manifest_and_offsets(arch)
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
            _check_data_crcs(path, arch, [(f"data/{k}", storages[k].data_ptr(), storages[k].nbytes()) for k in keys])
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


def _load_stream(f: IO[bytes], verify: bool, opts: dict[str, Any]) -> Any:
    """Loads the archive that starts at the stream's position, reading only
    its headers, directory and records (each record straight into its
    tensor's memory), and leaves the position just after the archive, as
    torch.load does: objects saved one after another load one after another.
    """
    name = str(getattr(f, "name", "<stream>"))
    start, avail = _stream_start(f, name)
    head = f.read(512)
    f.seek(start)
    if _is_legacy_torch(head):
        return _hand_to_torch(f, opts, False)  # torch leaves the position after the legacy pickles
    records, cd_offset, arch_len, offs = _core.read_directory_stream(f, start, avail, name)
    arch = _archive.Archive(name, records, cd_offset, arch_len)
    if "constants.pkl" in arch.records:  # TorchScript, as in _load_path
        f.seek(start)
        return _hand_to_torch(f, opts, False)
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
    opts: dict[str, Any],
    ready: Callable[[], None] | None = None,
) -> Any:
    """Unpickles ``data.pkl`` over ``storages``. ``ready()`` blocks until the
    storages hold their data; it is called before anything reads them."""
    restore = _pickle.restore_location_fn(opts["map_location"])
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
        if ready is not None and (byteorder != sys.byteorder or not _stays_on_host(opts["map_location"], location)):
            ready()
        if byteorder != sys.byteorder:
            raw.byteswap(dtype)
        typed = torch.storage.TypedStorage(wrap_storage=restore(raw, location), dtype=dtype, _internal=True)
        if key not in loaded:
            loaded[key] = typed
        return typed

    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is not None:
        tls.map_location = opts["map_location"]
    try:
        result = _pickle.fast_weights_only(data_pkl, persistent_load) if opts["weights_only"] else None
        if result is None:
            if opts["weights_only"]:
                _pickle.refuse_absurd_sizes(data_pkl, path)
            up = _pickle.unpickler(
                data_pkl,
                weights_only=opts["weights_only"],
                pickle_module=opts["pickle_module"],
                encoding=opts["encoding"],
                **opts["pickle_load_args"],
            )
            up.persistent_load = persistent_load
            result = up.load()
    except TierstoreError:
        raise
    except pickle.UnpicklingError as e:
        if opts["weights_only"]:
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
        if not opts["weights_only"]:
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
            validate(weights_only=opts["weights_only"])
        except TypeError:
            validate()
    return result
