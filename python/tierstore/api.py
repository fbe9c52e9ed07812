"""``tierstore.save`` and ``tierstore.load``: drop-in ``torch.save`` / ``torch.load``.

The file is the zip archive ``torch.save`` writes (``data.pkl`` plus one record
per storage), with each record's data aligned to 4096 bytes, correct CRC-32s,
and a manifest record that ``torch.load`` ignores. Writes go through the Rust
engine (io_uring, O_DIRECT, many requests in flight, fsync, atomic rename);
reads land directly in the memory that becomes each tensor's storage.
"""

from __future__ import annotations

import os
import pickle
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import IO, Any

import torch

from tierstore import _core, _gc, _load, _lossy, _pickle, _progress, gpu, manifest
from tierstore import codec as _codec
from tierstore._engine import get_engine
from tierstore._save_parts import (
    ManifestParts,
    PickleJob,
    archive_name,
    host_storages,
    small_records,
)
from tierstore.errors import (
    InternalError,
    InvalidArgumentError,
    NotAFileError,
)

__all__ = ["load", "save"]

FileLike = str | os.PathLike[str] | IO[bytes]
MapLocation = None | str | torch.device | dict[str, str] | Callable[[Any, str], Any]

DEFAULT_ALIGN = 4096
# A path save registers this many tensors, starts writing them, and registers
# the rest in batches four times larger each while the engine writes.
_FIRST_BATCH = 256
# Metadata records (data.pkl, version, the manifest, ...) are aligned like
# torch aligns records; only storages need page alignment.
_META_ALIGN = 64
_STREAM_CHUNK = 8 << 20


# torch's own save, taken at import: formats that are torch's alone are
# handed to it even where torch.save has been routed to tierstore
# (tests/compat runs PyTorch's suite that way).
_TORCH_SAVE = torch.serialization.save


# storage address -> (gate, value it must reach before the storage is read)
Gates = Mapping[int, tuple[_core.Gate, int]]


def _skip_data() -> bool:
    """True inside ``torch.serialization.skip_data()``."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    return bool(getattr(tls, "skip_data", False))


@_gc.paused
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
    codec: Any = None,
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
    ``codec``: ``"zstd"`` (lossless compression) or
    ``tierstore.Delta(base="base.pt")`` (each storage encoded against the
    same tensor of ``base``); ``tierstore.load`` decodes such files
    transparently, ``torch.load`` refuses them with a message saying how to
    convert them (:mod:`tierstore.codec`).
    """
    spec = _codec.resolve(codec)
    if spec is not None:
        if not _use_new_zipfile_serialization or _skip_data():
            raise InvalidArgumentError("codec= needs the zip format and real data (not skip_data())")
        if not isinstance(f, (str, os.PathLike)):
            raise InvalidArgumentError("codec= needs a file path (a compressed file is written in one piece)")
        _check_align(align)
        pickler = PickleJob(obj, pickle_module, pickle_protocol)
        small = small_records(not _disable_byteorder_record, align)
        _save_encoded(os.fspath(f), pickler, small, spec, durable=durable, align=align, background=background)
        return
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
        pickler = PickleJob(obj, pickle_module, pickle_protocol, first=_FIRST_BATCH)
        small = small_records(not _disable_byteorder_record, align)
        _save_path(os.fspath(f), pickler, small, durable=durable, progress=progress, align=align, background=background)
    else:
        pickler = PickleJob(obj, pickle_module, pickle_protocol)
        prefix = archive_name(f)
        data_pkl = pickler.run()
        staged: list[gpu.Staged] = []
        try:
            storages = host_storages(pickler.collector, None, staged)
            for sg in staged:
                sg.wait()
            parts = ManifestParts(prefix, pickler.collector, pickler.found, align)
            small = small_records(not _disable_byteorder_record, align)
            _save_stream(f, prefix, data_pkl, storages, small, parts, align)
        finally:
            for sg in staged:
                sg.release()


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
    extra: Mapping[str, Any] | None = None,
) -> Written:
    """The file writer under :func:`save` for the package's own containers
    (shard files, objects files, Checkpointer snapshots): ``gates`` lets the
    writer read storages still being filled by a capture, ``chunk_checksums``
    adds the per-chunk table partial reads verify against, ``layouts`` gives
    tensors' shard layouts for the manifest, ``extra`` top-level fields of
    the manifest. Returns where everything went, so that no caller opens
    the file again to learn it."""
    pickler = PickleJob(obj, None, _pickle.DEFAULT_PROTOCOL, first=_FIRST_BATCH)
    small = small_records(True, DEFAULT_ALIGN)
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
        extra=extra,
    )


def _add_storages(
    target: _core.Writer,
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
        elif gates and st.data_ptr() in gates:
            gate, at = gates[st.data_ptr()]
            target.add_memory(name, st.data_ptr(), n, st, gate, at)
        else:
            target.add_memory(name, st.data_ptr(), n, st)


# A memory record for ``Writer.add_memories``: name, address, size, owner.
_Record = tuple[str, int, int, torch.UntypedStorage]
# Storages to add to a writer: (key, storage) pairs, their gates, their
# records when none is gated, their size in bytes.
_Batch = tuple[list[tuple[str, torch.UntypedStorage]], Gates, list[_Record] | None, int]


def _memory_records(
    prefix: str, storages: list[tuple[str, torch.UntypedStorage]], gates: Gates | None
) -> list[_Record] | None:
    """The writer's records of ``storages`` (as :func:`_add_storages` adds
    them), or None when one of them is gated (still being filled)."""
    if gates and any(st.data_ptr() in gates for _k, st in storages):
        return None
    return [(f"{prefix}/data/{key}", st.data_ptr(), st.nbytes(), st) for key, st in storages]


def _save_path(
    path: str,
    pickler: PickleJob,
    small: list[tuple[str, bytes]],
    *,
    durable: bool,
    progress: bool | None,
    align: int,
    background: bool,
    gates: Gates | None = None,
    chunk_checksums: bool = False,
    layouts: Mapping[tuple[str | int, ...], Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Written:
    collector, found, prefix = pickler.collector, pickler.found, archive_name(path)
    w = _core.create_writer(
        get_engine(), path, align=align, durable=durable, background=background, chunk_sums=chunk_checksums
    )
    added: set[str] = set()
    # Host copies of device storages must live until their bytes are written.
    keep: list[tuple[str, torch.UntypedStorage]] = []
    staged: list[gpu.Staged] = []

    def find_new() -> _Batch:
        """The storages registered since the last call (GPU ones being
        staged), the gates of those still being filled, when none is their
        records ready for the writer, and their size."""
        n_staged = len(staged)
        new = host_storages(collector, added, staged)
        all_gates = dict(gates or {})
        for sg in staged[n_staged:]:
            all_gates.update(sg.gates())
        added.update(k for k, _st in new)
        keep.extend(new)
        return new, all_gates, _memory_records(prefix, new, all_gates), sum(st.nbytes() for _k, st in new)

    def add(batch: _Batch) -> int:
        new, all_gates, records, nbytes = batch
        if records is not None:
            w.add_memories(records)
        else:
            _add_storages(w, prefix, new, all_gates)
        return nbytes

    def add_new() -> int:
        return add(find_new())

    try:
        total = add_new()
        enabled = _progress.wanted(progress) and (total > 0 or not pickler.registered_all)
        # The records placed before the last batch starts to be written,
        # whose manifest entries are then prepared while it is written.
        placed: list[_core.PlannedRecord] = []

        def start() -> None:
            if pickler.registered_all and not chunk_checksums:
                placed[:] = w.entries()
            w.start_data()

        with _progress.bar(enabled, f"saving {path}") as cb:
            start()
            # The tensors not registered yet are registered in growing batches,
            # each while the engine writes the one before (a state of many
            # small tensors would otherwise wait for all of them); only adding
            # them to the writer waits for that write.
            written = 0
            batch = 4 * _FIRST_BATCH
            while pickler.register_more(batch):
                nxt = find_new()
                w.wait_data(_after(cb, written))
                written += total
                total = add(nxt)
                start()
                batch *= 4
            # Pickling and most of the manifest are done while the engine writes.
            data_pkl = pickler.run()
            late = [key for key in collector.storages if key not in added]
            parts = ManifestParts(prefix, collector, found, align, layouts, extra)
            if placed:
                parts.prepare(placed)
            w.wait_data(_after(cb, written))
            if late:  # storages only the pickler found (inside custom objects)
                add_new()
                w.write_data(cb)
        chunks = None
        if chunk_checksums:
            table, chunks = _chunk_table(w, prefix, keep)
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
        for sg in staged:
            sg.raise_error()  # a failed GPU copy is the cause, not the writer's stop
        raise
    finally:
        for sg in staged:
            sg.release()
    return Written(file_len, parts.records, parts.tensors, zlib.crc32(built))


def _after(cb: _progress.ProgressFn | None, base: int) -> _progress.ProgressFn | None:
    """A write's progress reported after ``base`` bytes already written."""
    if cb is None:
        return None

    def report(done: int, of: int) -> None:
        cb(base + done, base + of)

    return report


def _save_encoded(
    path: str,
    pickler: PickleJob,
    small: list[tuple[str, bytes]],
    spec: _codec.Spec,
    *,
    durable: bool,
    align: int,
    background: bool,
) -> None:
    """A compressed file (see :mod:`tierstore.codec`): storages are encoded
    in batches, each batch laid out and written (an encoded record's size is
    known only once it is encoded) while the next one is encoded."""
    collector, found, prefix = pickler.collector, pickler.found, archive_name(path)
    data_pkl = pickler.run()
    staged: list[gpu.Staged] = []
    try:
        storages = host_storages(collector, None, staged)
        for sg in staged:
            sg.wait()
        out_dir = os.path.dirname(os.path.abspath(path))
        bases = [_codec.BaseFile(b, out_dir) for b in spec.base] if spec.base else []
        paths_of: dict[str, list[tuple[Any, ...]]] = {}
        for p, t in found:
            try:
                key = collector.key_of(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            if key is not None:
                paths_of.setdefault(key, []).append(tuple(p))
        encoded: dict[str, _codec.Encoded] = {}
        refs: dict[str, tuple[_codec.BaseFile, str]] = {}
        cands: dict[str, list[tuple[_codec.BaseFile, str]]] = {}
        for key, st in storages:
            if bases and st.nbytes() >= _codec.MIN_BYTES:
                dtype = collector.storages[key].dtype
                for bf in bases:
                    rname = bf.match(paths_of.get(key, []), dtype, st.nbytes())
                    if rname is not None:
                        cands.setdefault(key, []).append((bf, rname))
        for bf in bases:  # each base's records in one read
            bf.read([r for c in cands.values() for b, r in c if b is bf])
        for key, st in storages:
            if key in cands:
                c = cands[key]
                refs[key] = c[_codec.choose_base(st, collector.storages[key].dtype, spec, c)]
        w = _core.create_writer(get_engine(), path, align=align, durable=durable, background=background)
        try:
            # Encoded in batches of about _ENCODE_BATCH input bytes, each
            # batch added and written while the next one is encoded (the
            # codec runs without the GIL): compression overlaps the writes.
            writing = False
            batch: list[tuple[str, torch.UntypedStorage]] = []
            size = 0
            for i, (key, st) in enumerate(storages):
                dtype = collector.storages[key].dtype
                ref = refs[key][0].bytes_of(refs[key][1]) if key in refs else None
                bits = _lossy.bits_for(paths_of.get(key, []), spec.keep_bits) if spec.keep_bits else None
                e = _codec.encode_storage(st, dtype, spec, ref, bits, f"{path}: storage data/{key}")
                if e is not None:
                    encoded[key] = e
                batch.append((key, st))
                size += st.nbytes()
                if size < _ENCODE_BATCH and i + 1 < len(storages):
                    continue
                if writing:
                    w.wait_data(None)
                for k, s in batch:
                    name = f"{prefix}/data/{k}"
                    if k in encoded:
                        w.add_bytes(name, encoded[k].data, align)
                    elif s.nbytes() == 0:
                        w.add_bytes(name, b"")
                    else:
                        w.add_memory(name, s.data_ptr(), s.nbytes(), s)
                w.start_data()
                writing = True
                batch, size = [], 0
            if writing:
                w.wait_data(None)
            else:  # no storage at all
                w.write_data(None)
            metas = [("data.pkl", _codec.guard_pickle(os.path.basename(path))), (_codec.PICKLE_NAME, data_pkl), *small]
            for name, data in metas:
                w.add_bytes(f"{prefix}/{name}", data, _META_ALIGN)
            entries = w.entries()
            crcs = {e.name: e.crc32 for e in entries if e.crc32 is not None}
            for name, data in metas:
                crcs[f"{prefix}/{name}"] = zlib.crc32(data)
            parts = ManifestParts(prefix, collector, found, align)
            built = parts.build(entries, crcs, None, encoded)
            w.add_bytes(f"{prefix}/{manifest.MANIFEST_NAME}", built, _META_ALIGN)
            w.commit()
        except BaseException:
            w.abort()
            raise
    finally:
        for sg in staged:
            sg.release()


#: Input bytes encoded per batch of a compressed save (one batch is written
#: while the next is encoded).
_ENCODE_BATCH = 32 << 20


def _chunk_table(
    w: _core.Writer, prefix: str, storages: list[tuple[str, torch.UntypedStorage]]
) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """The chunk checksums of every storage (the record ``.tierstore/chunks``)
    and, per storage record, where its part of the table is (docs/FORMAT.md).
    The writer computed them in the pass that computed the records' CRCs."""
    index = {e.name: i for i, e in enumerate(w.entries())}
    parts: list[bytes] = []
    out: dict[str, dict[str, Any]] = {}
    at = 0
    for key, st in storages:
        part = w.chunk_table(index[f"{prefix}/data/{key}"])
        count = -(-st.nbytes() // manifest.CHUNK_BYTES)
        if len(part) != 4 * count:
            raise InternalError(f"the chunk table of storage {key} has {len(part) // 4} entries, not {count}")
        parts.append(part)
        out[f"data/{key}"] = {
            "size": manifest.CHUNK_BYTES,
            "algo": manifest.CHUNK_ALGO,
            "at": at,
            "count": count,
            "crc32": zlib.crc32(part),
        }
        at += 4 * count
    return b"".join(parts), out


def _save_stream(
    f: IO[bytes],
    prefix: str,
    data_pkl: bytes,
    storages: list[tuple[str, torch.UntypedStorage]],
    small: list[tuple[str, bytes]],
    parts: ManifestParts,
    align: int,
) -> None:
    s = _core.Stream(align=align, chunk_bytes=_STREAM_CHUNK, threads=get_engine().info()["cpu_threads"])
    s.add_memories(_memory_records(prefix, storages, None) or [])  # nothing is gated here
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


@_gc.paused
def load(
    f: FileLike,
    map_location: MapLocation = None,
    pickle_module: ModuleType | None = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    verify: bool = True,
    progress: bool | None = False,
    delta_base: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
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
    Compressed files (``save(..., codec=...)``) are decoded; a delta file's
    base is looked for where the file names it, inside the file's directory
    only, unless ``delta_base`` names it (a file, or a list of them for a
    file with several bases: each record takes the one of its base's name).
    """
    opts = _load.LoadOptions.of(map_location, pickle_module, weights_only, delta_base, pickle_load_args)
    if _skip_data() or not _pickle.no_fake_mode():
        # torch.serialization.skip_data(): storages are made, not read (fake
        # tensors with materialize_fake_tensors); under a FakeTensorMode,
        # storages become fake ones on their saved device: torch's loader
        # does both.
        return _load.hand_to_torch(f, opts, bool(mmap))
    if isinstance(f, (str, os.PathLike)):
        return _load.load_path(os.fspath(f), bool(mmap), verify, progress, opts)
    if mmap:
        raise InvalidArgumentError("f must be a file path in order to use the mmap argument")
    if not hasattr(f, "read"):
        raise NotAFileError(
            f"f must be a path or a readable binary file object, not {type(f).__name__} (it has no read)"
        )
    return _load.load_stream(f, verify, opts)
