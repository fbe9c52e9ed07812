"""``tierstore.info()``: what the engine chose and why, what the file system
at a path allows, and which GPU path copies are taken through and why."""

from __future__ import annotations

import os
from typing import Any

from tierstore import _engine, gpu


def info(path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """The engine's choices (backend, queue depth, huge pages... with their
    reasons), what the file system at ``path`` allows (O_DIRECT, alignment),
    and under ``gpu`` the GPU path (``shim``, ``torch`` or ``none``) and why."""
    d = _engine.info(path)
    d["gpu"] = gpu.status()
    return d
