"""The files of a sharded checkpoint, opened: each data or objects file from
the first copy of the checkpoint (this directory, then farther tiers' or
nodes' copies) where it is present and matches ``manifest.json`` (its
length and the CRC-32 of its own manifest record), its manifest checked
against its pickle and its key paths against ``manifest.json``'s, its
records' chunk checksums read and checked; a codec tier's encoded copy is
decoded as reads need it. :class:`tierstore.shardmeta.Checkpoint` checks
what the manifest says each file holds on top of this.
"""

from __future__ import annotations

import os
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tierstore import _archive, _metadata, _paths, _pickle, _tier_codec, _tree, manifest
from tierstore.errors import ManifestError, NotFoundError, TierstoreError

_U32 = 0xFFFFFFFF
_T = TypeVar("_T")


@dataclass
class ChunkTable:
    """The checksums of one record, as ``_core.read_ranges_verified`` takes them."""

    record: str
    data_offset: int
    size: int
    chunk: int
    algo: str
    sums: bytes

    def as_tuple(self) -> tuple[str, int, int, int, str, bytes]:
        return (self.record, self.data_offset, self.size, self.chunk, self.algo, self.sums)


@dataclass
class FileView:
    """A data file of the checkpoint, opened: its zip directory, its own
    manifest, and that manifest's records and tensors by name."""

    path: str
    arch: _archive.Archive
    fm: dict[str, Any]
    offsets: dict[str, int]
    recs: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]

    def bad(self, detail: str) -> ManifestError:
        return ManifestError(
            f"{self.path}: the shard file does not match manifest.json: {detail}; the file is damaged or from "
            "another checkpoint or rank",
            path=self.path,
        )


class ShardFiles:
    """The data and objects files of one checkpoint, each opened once, from
    the first copy that holds it intact (a copy found damaged is reported
    and the next one used)."""

    def __init__(self, manifest_path: str, m: dict[str, Any], version: int, copies: Sequence[Path]) -> None:
        # (``m``: the checked manifest.json; ``manifest`` is the module of the files' own manifests.)
        self.manifest_path, self.manifest, self.version = manifest_path, m, version
        self.dir = Path(copies[0])
        self.copies = list(copies)
        self.excluded: set[tuple[str, str]] = set()  # (copy, file name) found damaged: not used again
        # A codec tier's copy holds its files encoded (``<name>.tsd``): they
        # are decoded, bit-exact, into a private folder removed with this object.
        self._decoder = _tier_codec.Decoder()
        weakref.finalize(self, self._decoder.close)
        self.bytes_by_copy: dict[str, int] = {}
        self.objects_copy: dict[str, str] = {}  # objects file -> the copy it was read from
        self._path_of: dict[int, str] = {}
        self._views: dict[int, FileView] = {}

    def view(self, fi: int) -> FileView:
        """Data file ``fi`` opened and checked against its files[] entry (its
        length and its manifest record's CRC-32), once."""
        known = self._views.get(fi)
        if known is not None:
            return known
        fe = self.manifest["files"][fi]
        view, c = self._from_copies(fe["name"], lambda c: self._open_view(fi, fe, c), "shard")
        self._views[fi] = view
        self._path_of[fi] = str(c)
        return view

    def _from_copies(self, name: str, open_in: Callable[[Path], _T], what: str) -> tuple[_T, Path]:
        """``open_in(copy)`` for the first copy of the checkpoint where file
        ``name`` opens and matches the manifest (a warning names a copy
        that held it damaged); the first copy's error when none does."""
        first: TierstoreError | None = None
        for c in self.copies:
            if (str(c), name) in self.excluded:
                continue
            try:
                got = open_in(c)
            except TierstoreError as e:  # missing or not this checkpoint's file here: the next copy
                first = first or e
                continue
            if first is not None and not isinstance(first, NotFoundError):
                warnings.warn(f"tierstore: {first}; reading {name} from {c} instead", stacklevel=4)
            return got, c
        if first is None:
            p = str(self.dir / name)
            first = NotFoundError(f"{p}: {what} file of the checkpoint is missing (every copy excluded)", path=p)
        raise first

    def copy_of(self, fi: int) -> str:
        """The directory data file ``fi`` is read from (after :meth:`view`)."""
        return self._path_of.get(fi, str(self.dir))

    def path_of(self, fi: int) -> str:
        """The path data file ``fi`` is read from (after :meth:`view`)."""
        return self._views[fi].path if fi in self._views else str(self.dir / self.manifest["files"][fi]["name"])

    def count_read(self, fi: int, n: int) -> None:
        c = self.copy_of(fi)
        self.bytes_by_copy[c] = self.bytes_by_copy.get(c, 0) + n

    def _open_view(self, fi: int, fe: dict[str, Any], copy: Path) -> FileView:
        p = str(self._member(copy, fe["name"], f"files[{fi}].name"))
        if not os.path.exists(p):
            raise NotFoundError(f"{p}: shard file of the checkpoint is missing", path=p)
        arch, fm, offsets = _archive.open_archive(p)
        where = f"{self.manifest_path}: files[{fi}] ({fe['name']})"
        view = FileView(p, arch, fm or {}, offsets, {}, {})
        if arch.file_len != fe["bytes"]:
            raise view.bad(f"it is {arch.file_len} bytes long, the manifest says {fe['bytes']} ({where})")
        if fm is None:
            raise view.bad("it has no tierstore manifest record")
        if self.version >= 2:
            mcrc = arch.records[manifest.MANIFEST_NAME].crc32
            if mcrc != fe["manifest_crc32"]:
                raise view.bad(
                    f"its manifest record has crc32 {mcrc:08x}, manifest.json recorded {fe['manifest_crc32']:08x}"
                )
        view.recs.update({r["name"]: r for r in fm["records"] if isinstance(r, dict)})
        for t in fm.get("tensors", []):
            path = t.get("path") if isinstance(t, dict) else None
            if isinstance(path, list) and len(path) == 2 and path[0] == "tensors" and isinstance(path[1], str):
                view.tensors[path[1]] = t
        if view.tensors:
            self._check_pickle(view)
        self._check_key_paths(view.path, fm, list(view.tensors))
        return view

    def _check_key_paths(self, path: str, fm: dict[str, Any], keys: list[str]) -> None:
        """A data or objects file written since it records them holds the key
        paths of its keys (``key_paths``): manifest.json's ``paths`` must say
        the same of each, so that a re-sealed manifest.json that drops, adds
        or changes a path (an integer key read back as a string) is refused."""
        kp = fm.get("key_paths")
        if kp is None:
            return  # a file written before files recorded them
        if not isinstance(kp, dict):
            raise ManifestError(f"{path}: its manifest's key_paths is not a mapping", path=path)
        paths = self.manifest.get("paths", {})
        for key in keys:
            mine = kp.get(key)
            got = _tree.check_path(mine, key) if mine is not None else None
            if mine is not None and got is None:
                raise ManifestError(
                    f"{path}: its manifest's key_paths[{key[:100]!r}] is not a path of the key", path=path
                )
            said = paths.get(key)
            if (tuple(said) if said is not None else None) != got:
                raise ManifestError(
                    f"{path}: the file records the key path of {key[:100]!r} as {mine!r:.200}, manifest.json "
                    f"says {said!r:.200}; manifest.json or the file is damaged or from another checkpoint",
                    path=path,
                )

    @staticmethod
    def _check_pickle(view: FileView) -> None:
        """The file's own manifest must say of each tensor what its pickle
        says: the same storage record, offset, shape, stride and dtype. The
        pickle is the second witness: a manifest rewritten to point a tensor
        at another record of the same size (its checksums fixed up) is
        caught here, where each record's own checksum cannot catch it."""
        rel = str(view.fm.get("pickle") or "data.pkl")
        rec = view.arch.records.get(rel)
        off = view.offsets.get(rel)
        if rec is None or off is None:
            raise view.bad(f"it has no record '{rel}'")
        if rec.size > manifest.MAX_MANIFEST_BYTES:
            raise view.bad(f"its record '{rel}' is {rec.size} bytes")
        data = _archive.load_small(view.arch, off, rec.size, rel)
        _archive.check_crc(view.path, view.arch.full(rel), data, rec.crc32)
        pickled = _pickle.tensor_views(data, view.path)
        for key, t in view.tensors.items():
            v = pickled.get(("tensors", key))
            said = (t.get("record"), t.get("dtype"), t.get("shape"), t.get("stride"), t.get("storage_offset"))
            if v is None or said != (f"data/{v.key}", v.dtype, v.shape, v.stride, v.storage_offset):
                was = "nothing" if v is None else f"record 'data/{v.key}' {v.dtype} {v.shape} at {v.storage_offset}"
                raise view.bad(
                    f"its manifest puts tensor {key!r} in record {t.get('record')!r} {t.get('dtype')} "
                    f"{t.get('shape')} at {t.get('storage_offset')}, its {rel} says {was}"
                )
        extra = sorted(str(p[1]) for p in pickled if len(p) == 2 and p[0] == "tensors" and p[1] not in view.tensors)
        if extra:
            raise view.bad(f"its {rel} holds tensors its manifest does not list ({', '.join(extra[:5])})")

    def check_objects_file(self, name: str) -> Path:
        """The objects file ``name``, checked against the manifest's record of
        it (its length and the CRC-32 of its manifest record; version 2),
        from the first copy of the checkpoint that holds it intact."""
        p, c = self._from_copies(name, lambda c: self._objects_file_in(c, name), "objects")
        self.objects_copy[name] = str(c)
        return p

    def close(self) -> None:
        """Removes the files decoded for this checkpoint's reads (a codec
        tier's copy); its metadata stays usable, its data files do not."""
        self._decoder.close()

    def _member(self, copy: Path, name: str, field: str, whole: bool = False) -> Path:
        """File ``name`` of ``copy`` (confined to it); where the copy holds
        it encoded, the decoded file: its records decoded as reads need
        them (:meth:`prepare_read`), or all of them (``whole``)."""
        p = _paths.member(copy, name, source=self.manifest_path, field=field)
        if not p.exists():
            enc = _tier_codec.encoded_of(p.parent, p.name)
            if enc is not None:
                out = self._decoder.raw(enc)
                if whole:
                    self._decoder.ensure_all(out)
                return out
        return p

    def is_decoding(self, fi: int) -> bool:
        """Whether data file ``fi`` is read from an encoded file's decoding."""
        return self._decoder.decodes(self.path_of(fi))

    def decode_into(self, fi: int, at: int, length: int, addr: int) -> bool:
        """Where data file ``fi`` is an encoded file's decoding and its bytes
        ``[at, at + length)`` are one record not yet decoded: decodes them
        straight into the memory at ``addr`` (True). False: read the file."""
        return self._decoder.decode_into(self.path_of(fi), at, length, addr)

    def prepare_read(self, fi: int, spans: list[tuple[int, int]] | None) -> None:
        """Before data file ``fi`` is read at the byte ranges ``spans``
        (None: all of it): where it is an encoded file's decoding, the
        records those ranges touch are decoded (and their references')."""
        path = self.path_of(fi)
        if spans is None:
            self._decoder.ensure_all(path)
        else:
            self._decoder.ensure(path, spans)

    def _objects_file_in(self, copy: Path, name: str) -> Path:
        p = self._member(copy, name, "objects", whole=True)
        if self.version < 2:
            return p
        want = next((o for o in self.manifest["object_files"] if o["name"] == name), None)
        if want is None:
            raise ManifestError(
                f"{self.manifest_path}: objects file {name!r} is not in object_files", path=self.manifest_path
            )
        if not p.exists():
            raise NotFoundError(f"{p}: objects file of the checkpoint is missing", path=str(p))
        arch = _archive.open_directory(str(p))
        entry = arch.records.get(manifest.MANIFEST_NAME)
        if arch.file_len != want["bytes"] or entry is None or entry.crc32 != want["manifest_crc32"]:
            raise ManifestError(
                f"{p}: the objects file does not match manifest.json ({arch.file_len} bytes, the manifest says "
                f"{want['bytes']}, or another manifest record); it is damaged or from another checkpoint or rank",
                path=str(p),
            )
        fm = _archive.read_manifest(str(p), arch)
        if fm is not None:
            m = self.manifest
            keys = [k for k, f in m["objects"].items() if f == name]
            keys += [k for k, held in m["per_rank_objects"].items() if name in held.values()]
            self._check_key_paths(str(p), fm, keys)
        return p

    def table(
        self, p: str, arch: _archive.Archive, fm: dict[str, Any], offsets: dict[str, int], r: dict[str, Any]
    ) -> ChunkTable:
        c = r.get("chunks")
        name = arch.full(r["name"])
        if c is None:
            # No chunk checksums (version 1): the record's CRC-32 is one chunk.
            whole = r["crc32"].to_bytes(4, "little") if r["size"] else b""  # an empty record has no chunk
            return ChunkTable(name, r["offset"], r["size"], max(r["size"], 1), "crc32", whole)
        f = _metadata.Fields(f"{p}: record '{manifest.MANIFEST_NAME}': records[{r['name']!r}].chunks")
        f.mapping(c, "chunks")
        size = f.uint(f.get(c, "size", "size"), "size", most=1 << 30)
        algo = f.string(f.get(c, "algo", "algo"), "algo")
        at = f.uint(f.get(c, "at", "at"), "at")
        count = f.uint(f.get(c, "count", "count"), "count")
        crc = f.uint(f.get(c, "crc32", "crc32"), "crc32", most=_U32)
        if size < 1 or algo not in ("crc32", "crc32c"):
            f.fail("chunks", "a positive chunk size and algo crc32 or crc32c", c)
        if count != -(-r["size"] // size):
            f.fail("count", f"{-(-r['size'] // size)} chunks of {size} bytes for {r['size']} bytes", count)
        trec = arch.records.get(manifest.CHUNKS_NAME)
        if trec is None or at + 4 * count > trec.size:
            f.fail("at", f"a part of record '{manifest.CHUNKS_NAME}'", at)
        sums = _archive.load_small(arch, offsets[manifest.CHUNKS_NAME] + at, 4 * count, "chunk checksums")
        if zlib.crc32(sums) != crc:
            raise ManifestError(
                f"{p}: record '{arch.full(manifest.CHUNKS_NAME)}': the chunk checksums of record '{name}' are "
                f"damaged (crc32 {zlib.crc32(sums):08x}, expected {crc:08x})",
                path=p,
                record=arch.full(manifest.CHUNKS_NAME),
            )
        return ChunkTable(name, r["offset"], r["size"], size, algo, sums)
