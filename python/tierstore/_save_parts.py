"""What a save writes besides the storages' bytes: the object to pickle with
its storages found first (:class:`PickleJob`), the manifest prepared while the
data is written (:class:`ManifestParts`), the small records torch writes, and
each storage brought to the host (GPU ones staged into pinned memory the
writer reads). :mod:`tierstore.api` drives the writer with them.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from tierstore import _core, _pickle, gpu, manifest
from tierstore import codec as _codec
from tierstore._metadata import dtype_name
from tierstore.errors import TierstoreError


def is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike))


def archive_name(f: Any) -> str:
    """The prefix of every record name, as torch derives it from the file name."""
    if not is_path(f):
        return "archive"
    stem = os.path.splitext(os.path.basename(os.fspath(f)))[0]
    clean = "".join(c if (c.isascii() and (c.isalnum() or c in "._-")) else "_" for c in stem)
    return clean or "archive"


def small_records(byteorder: bool, align: int) -> list[tuple[str, bytes]]:
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


def tensor_entries(
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
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "layout": None if layouts is None else layouts.get(tuple(path)),
            }
        )
    return out


def host_storages(
    collector: _pickle.StorageCollector, skip: set[str] | None, staged: list[gpu.Staged]
) -> list[tuple[str, torch.UntypedStorage]]:
    """Each storage not in ``skip`` on the host (meta ones refused). GPU
    storages are copied asynchronously into pinned memory the writer reads
    directly; their copies are appended to ``staged``, whose gates say when
    each is complete, and which the caller releases. Other device storages
    are copied with ``storage.cpu()``."""
    out: list[tuple[str, torch.UntypedStorage]] = []
    on_gpu: list[tuple[int, str, torch.UntypedStorage]] = []
    for key, s in collector.storages.items():
        if skip is not None and key in skip:
            continue
        st = s.storage
        if st.device.type == "meta":
            raise TierstoreError(f"cannot save the data of meta storage data/{key}: it has none")
        if st.device.type == "cuda":
            if st.nbytes():
                on_gpu.append((len(out), key, st))
            out.append((key, st if st.nbytes() else torch.UntypedStorage(0)))
            continue
        if st.device.type != "cpu":
            st = st.cpu()
        out.append((key, st))
    if on_gpu:
        sg = gpu.Staged([st for _i, _k, st in on_gpu])
        for (i, key, _st), host in zip(on_gpu, sg.host, strict=True):
            out[i] = (key, host)
        staged.append(sg)
    return out


class PickleJob:
    """The object to pickle, with its storages found beforehand: those
    reachable through dicts, lists and tuples get their keys before pickling,
    so that their bytes are written while the pickler runs."""

    def __init__(self, obj: Any, module: ModuleType | None, protocol: int, first: int | None = None) -> None:
        """``first``: register only that many tensors now, the rest by
        :meth:`register_more` (a path save starts writing the first ones
        while it registers the others)."""
        self.obj, self.module, self.protocol = obj, module, protocol
        self.found = _pickle.tensor_paths(obj)
        self.collector = _pickle.StorageCollector()
        tensors = [t for _, t in self.found]
        n = len(tensors) if first is None else first
        self.collector.preseed(tensors[:n])
        self._rest = tensors[n:]

    def register_more(self, n: int) -> bool:
        """Registers the next ``n`` tensors, in order (keys and file are the
        same as when all are registered at once); False when none was left."""
        if not self._rest:
            return False
        self.collector.preseed(self._rest[:n])
        del self._rest[:n]
        return True

    @property
    def registered_all(self) -> bool:
        return not self._rest

    def run(self) -> bytes:
        data, _ = _pickle.dumps(self.obj, self.module, self.protocol, self.collector)
        return data


class ManifestParts:
    """The manifest, prepared while the data is written; CRCs come last."""

    def __init__(
        self,
        prefix: str,
        collector: _pickle.StorageCollector,
        found: list[tuple[list[str | int], torch.Tensor]],
        align: int,
        layouts: Mapping[tuple[str | int, ...], Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.prefix, self.collector, self.align = prefix, collector, align
        self.extra = dict(extra or {})
        self.tensors = tensor_entries(found, collector, layouts)
        self.tensors_json = manifest.dump_tensors(self.tensors)
        self.records: list[dict[str, Any]] = []
        # From :meth:`prepare`: the first records (names, dicts) and their
        # JSON cut where each one's CRC goes.
        self._early: tuple[list[str], list[dict[str, Any]], list[str]] | None = None

    def record(
        self,
        e: _core.PlannedRecord,
        crc: int,
        chunks: dict[str, dict[str, Any]] | None = None,
        encoded: Mapping[str, _codec.Encoded] | None = None,
    ) -> dict[str, Any]:
        """The manifest's entry of the record ``e``."""
        rel = e.name[len(self.prefix) + 1 :]
        rec: dict[str, Any] = {"name": rel, "offset": e.data_offset, "size": e.size, "crc32": crc}
        if rel.startswith("data/"):
            s = self.collector.storages[rel[5:]]
            rec["kind"] = "storage"
            rec["dtype"] = dtype_name(s.dtype)
            rec["numel"] = s.numel
            rec["location"] = s.location
            rec["codec"] = "raw"
            rec["delta_base"] = None
            if encoded is not None and rel[5:] in encoded:
                rec.update(encoded[rel[5:]].fields)
            if chunks is not None and rel in chunks:
                rec["chunks"] = chunks[rel]
        elif encoded is not None and rel == "data.pkl":
            rec["kind"] = "guard"  # torch.load's entry: it says the file is compressed
        else:
            rec["kind"] = "pickle" if rel in ("data.pkl", _codec.PICKLE_NAME) else "meta"
        return rec

    def prepare(self, entries: list[_core.PlannedRecord]) -> None:
        """Builds the entries of these records (placed, not yet written)
        and their JSON while the data is written; :meth:`build` then only
        puts in the CRCs. A state of many small tensors spent a tenth of its
        save on this after the last byte was written."""
        recs = [self.record(e, _CRC_SLOT) for e in entries]
        cut = json.dumps(recs, separators=(",", ":"))[1:-1].split(f'"crc32":{_CRC_SLOT}')
        if len(cut) == len(recs) + 1:  # the mark occurs nowhere else (it cannot inside a string)
            self._early = ([e.name for e in entries], recs, cut)

    def build(
        self,
        entries: list[_core.PlannedRecord],
        crcs: dict[str, int],
        chunks: dict[str, dict[str, Any]] | None = None,
        encoded: Mapping[str, _codec.Encoded] | None = None,
    ) -> bytes:
        from tierstore import __version__

        early = self._early
        n = 0
        if early is not None and chunks is None and encoded is None:
            names = early[0]
            n = len(names)
            if len(entries) < n or any(e.name != m for e, m in zip(entries, names, strict=False)):
                n = 0  # not the records prepared: built afresh
        if n:
            names, recs, cut = early  # type: ignore[misc]
            parts = [cut[0]]
            for name, rec, after in zip(names, recs, cut[1:], strict=True):
                crc = crcs[name]
                rec["crc32"] = crc
                parts.append(f'"crc32":{crc}')
                parts.append(after)
            rest = [self.record(e, crcs[e.name]) for e in entries[n:]]
            tail = json.dumps(rest, separators=(",", ":"))[1:-1]
            records_json = "[" + "".join(parts) + ("," + tail if tail else "") + "]"
            records = recs + rest
        else:
            records = [self.record(e, crcs[e.name], chunks, encoded) for e in entries]
            records_json = json.dumps(records, separators=(",", ":"))
        self.records = records
        return manifest.build(
            archive=self.prefix,
            alignment=self.align,
            records_json=records_json,
            tensors_json=self.tensors_json,
            writer=f"tierstore {__version__}",
            torch_version=torch.__version__,
            extra={**self.extra, **({} if encoded is None else {"codec": _codec.CODEC, "pickle": _codec.PICKLE_NAME})},
        )


# Stands for a record's CRC in the JSON prepared before it is known (no CRC
# is negative).
_CRC_SLOT = -1
