"""The manifest record: what tierstore adds to a torch-compatible archive.

Every data file carries ``<archive>/.tierstore/manifest.json``, a JSON object
that ``torch.load`` ignores. It lists each record's byte offset, size and
CRC-32, each storage's dtype and element count, and where each tensor sits in
the saved object, and it leaves room for what later formats add: a shard
layout per tensor, a codec and a delta base per record. Its JSON schema is
``schemas/manifest.schema.json`` in this package (beside those of a sharded
checkpoint's ``manifest.json``, a step's ``checkpoint.json`` and an offloaded
optimizer's entry); docs/FORMAT.md describes them.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any

from tierstore.errors import InvalidArgumentError, ManifestError

FORMAT_NAME = "tierstore"
FORMAT_VERSION = 1
MANIFEST_NAME = ".tierstore/manifest.json"
# Chunk checksums of the storage records (written for the shard files of
# sharded checkpoints, which are read in parts): little-endian CRC-32 per
# CHUNK_BYTES of each record, records one after another. CRC-32 (zip's) and
# not CRC-32C: the writer computes each record's zip CRC from its chunks', in
# one pass over the bytes. Files written before say "crc32c"; both are read.
CHUNKS_NAME = ".tierstore/chunks"
CHUNK_BYTES = 512
CHUNK_ALGO = "crc32"
# Readers refuse manifests larger than this (a damaged size field must not
# make us allocate gigabytes).
MAX_MANIFEST_BYTES = 1 << 30


SCHEMAS = ("manifest", "sharded_manifest", "checkpoint", "offload_entry")


def schema(name: str = "manifest") -> dict[str, Any]:
    """A JSON schema of the format, by name (:data:`SCHEMAS`): ``manifest``
    (this record), ``sharded_manifest`` (a sharded checkpoint's
    ``manifest.json``), ``checkpoint`` (a Checkpointer step's
    ``checkpoint.json``) or ``offload_entry`` (the meta of an offloaded
    optimizer's checkpoint entry)."""
    if name not in SCHEMAS:
        raise InvalidArgumentError(f"no schema {name!r}; there are {', '.join(SCHEMAS)}")
    text = resources.files("tierstore").joinpath("schemas", f"{name}.schema.json").read_text()
    result: dict[str, Any] = json.loads(text)
    return result


def dump_tensors(tensors: list[dict[str, Any]]) -> str:
    """The ``tensors`` list as JSON (prepared early, while data is written)."""
    return json.dumps(tensors, separators=(",", ":"))


def build(
    *,
    archive: str,
    alignment: int,
    records_json: str,
    tensors_json: str,
    writer: str,
    torch_version: str,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The manifest's bytes; ``records_json`` and ``tensors_json`` are the
    JSON lists of its records and tensors, rendered already."""
    m: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "writer": writer,
        "torch_version": torch_version,
        "created_unix": round(time.time(), 3),
        "archive": archive,
        "alignment": alignment,
        "checksum": "crc32",
        "shard": None,
    }
    if extra:
        m.update(extra)
    head = json.dumps(m, separators=(",", ":"))
    return (head[:-1] + ',"records":' + records_json + ',"tensors":' + tensors_json + "}").encode()


def _fail(path: str, detail: str) -> ManifestError:
    return ManifestError(f"{path}: record '{MANIFEST_NAME}': {detail}", path=path, record=MANIFEST_NAME)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse(data: bytes, path: str, file_len: int) -> dict[str, Any]:
    """Parses and checks a manifest; raises ``ManifestError`` naming the problem."""
    try:
        m = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise _fail(path, 'not a tierstore manifest (missing "format": "tierstore")')
    v = m.get("format_version")
    if not isinstance(v, int) or v < 1:
        raise _fail(path, f"bad format_version {v!r}")
    if v > FORMAT_VERSION:
        raise _fail(
            path,
            f"format_version {v} is newer than this tierstore understands ({FORMAT_VERSION}); upgrade tierstore",
        )
    recs = m.get("records")
    if not isinstance(recs, list):
        raise _fail(path, '"records" must be a list')
    for r in recs:
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise _fail(path, f"bad record entry {r!r:.200}")
        for field in ("offset", "size", "crc32"):
            if not _uint(r.get(field)):
                raise _fail(path, f"record '{r['name']}': {field} must be a non-negative integer")
        if r["offset"] > file_len or r["size"] > file_len or r["offset"] + r["size"] > file_len:
            raise _fail(
                path,
                f"record '{r['name']}': offset {r['offset']} + size {r['size']} lies beyond the file "
                f"({file_len} bytes)",
            )
        if r["crc32"] > 0xFFFFFFFF:
            raise _fail(path, f"record '{r['name']}': crc32 {r['crc32']} does not fit 32 bits")
    tensors = m.get("tensors", [])
    if not isinstance(tensors, list):
        raise _fail(path, '"tensors" must be a list')
    return m
