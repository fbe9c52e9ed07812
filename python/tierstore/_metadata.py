"""Checksummed JSON metadata files (``manifest.json``, ``checkpoint.json``).

A metadata file is one JSON object whose last member is its checksum::

    {"format":"tierstore-sharded", ... ,"checksum":"crc32:1c291ca3"}

The CRC-32 covers every byte before the comma that introduces
``"checksum"`` (the object without its closing brace), so it is verified on
the raw bytes before the JSON is parsed, and the file stays plain JSON for
``jq`` and friends. A reader refuses a file whose checksum does not match,
and a file of a format version that requires one without it.

:class:`Fields` reads values out of the parsed object with their types and
ranges checked, so that every malformed field becomes a ``ManifestError``
naming the file, the field and what was expected (never a ``KeyError`` or
``TypeError``).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from tierstore.errors import InvalidArgumentError, ManifestError


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype a file names (``"float32"``, ``"bfloat16"``), or None
    where ``name`` is not one: the one reading of a dtype name, for every
    format (only attributes of ``torch`` that are dtypes, so a name can
    reach nothing else)."""
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return dt if isinstance(dt, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """The name files give ``dtype`` (``torch.float32`` -> ``"float32"``);
    :func:`dtype_named` reads it back."""
    return str(dtype).removeprefix("torch.")


__all__ = ["Fields", "dumps", "loads"]

_TRAILER = re.compile(rb',?"checksum":"crc32:([0-9a-f]{8})"\}\s*\Z')


def dumps(obj: Mapping[str, Any]) -> bytes:
    """``obj`` as compact JSON with its checksum as the last member."""
    if "checksum" in obj:
        raise InvalidArgumentError("metadata may not hold its own 'checksum' member")
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    head = body[:-1]
    crc = zlib.crc32(head)
    return head + (b"," if head != b"{" else b"") + b'"checksum":"crc32:%08x"}' % crc


def loads(data: bytes, path: str, *, required: bool) -> tuple[dict[str, Any], bool]:
    """Verifies and parses a metadata file: ``(object, had a checksum)``.

    Raises ``ManifestError`` for a checksum that does not match, a missing
    checksum when ``required``, and anything that is not one JSON object.
    """
    m = _TRAILER.search(data)
    if m is not None:
        stored = int(m.group(1), 16)
        actual = zlib.crc32(data[: m.start()])
        if actual != stored:
            raise ManifestError(
                f"{path}: checksum mismatch (stored crc32 {stored:08x}, computed {actual:08x}); the file is damaged",
                path=path,
            )
    elif required:
        raise ManifestError(f"{path}: the file has no checksum (damaged, or cut short)", path=path)
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ManifestError(f"{path}: not valid metadata (nested too deeply)", path=path) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, integers of too many digits
        raise ManifestError(f"{path}: not valid JSON ({str(e)[:200]})", path=path) from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: expected a JSON object, got {type(obj).__name__}", path=path)
    obj.pop("checksum", None)
    return obj, m is not None


def _short(v: Any) -> str:
    if isinstance(v, int) and v.bit_length() > 256:
        return f"<an integer of {v.bit_length()} bits>"
    try:
        r = repr(v)
    except (ValueError, RecursionError):
        return f"<a {type(v).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


class Fields:
    """Typed access to the members of a parsed metadata object."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, expected: str, got: Any = ..., detail: str = "") -> NoReturn:
        tail = "" if got is ... else f", got {_short(got)}"
        raise ManifestError(f"{self.path}: {field}: expected {expected}{tail}{detail}", path=self.path, record=field)

    def get(self, obj: Any, key: str | int, field: str) -> Any:
        if isinstance(key, int):
            if not isinstance(obj, list) or not -len(obj) <= key < len(obj):
                self.fail(field, f"a list with an item {key}", obj)
            return obj[key]
        if not isinstance(obj, dict):
            self.fail(field.rsplit(".", 1)[0] if "." in field else field, "an object", obj)
        if key not in obj:
            self.fail(field, "a value (the member is missing)")
        return obj[key]

    def uint(self, v: Any, field: str, *, most: int = 1 << 62) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > most:
            self.fail(field, f"an integer in [0, {most}]", v)
        return v

    def string(self, v: Any, field: str, *, most: int = 4096) -> str:
        if not isinstance(v, str) or len(v) > most:
            self.fail(field, f"a string of at most {most} characters", v)
        return v

    def boolean(self, v: Any, field: str) -> bool:
        if not isinstance(v, bool):
            self.fail(field, "true or false", v)
        return v

    def number(self, v: Any, field: str) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            self.fail(field, "a number", v)
        return float(v)

    def array(self, v: Any, field: str, *, length: int | None = None) -> list[Any]:
        if not isinstance(v, list) or (length is not None and len(v) != length):
            self.fail(field, "a list" if length is None else f"a list of {length} items", v)
        return v

    def mapping(self, v: Any, field: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            self.fail(field, "an object", v)
        return v

    def shape(self, v: Any, field: str, *, ndim: int | None = None) -> tuple[int, ...]:
        dims = self.array(v, field)
        if len(dims) > 64 or (ndim is not None and len(dims) != ndim):
            self.fail(field, f"a shape of {ndim if ndim is not None else 'at most 64'} dimensions", v)
        out = tuple(self.uint(x, f"{field}[{i}]") for i, x in enumerate(dims))
        if math.prod(out) > 1 << 62:
            self.fail(field, "a shape of fewer than 2^62 elements", v)
        return out
