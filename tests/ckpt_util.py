"""Where a sharded checkpoint's local tensors lie, read from its data files'
own manifests (the checkpoint's manifest.json names no offsets for tensors
stored by a sharding rule): for tests that damage chosen bytes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tierstore import _archive
from tierstore.shardmeta import read_manifest


def stored_tensors(d: Path) -> list[dict[str, Any]]:
    """Every local tensor of every data file of the checkpoint at ``d``:
    ``{file, rank, key, offset, nbytes, shape, dtype}`` (``offset``: its
    first byte in ``file``), in files[] order."""
    m = read_manifest(d)
    out = []
    for fe in m["files"]:
        p = d / fe["name"]
        _arch, fm, _offsets = _archive.open_archive(str(p))
        assert fm is not None
        recs = {r["name"]: r for r in fm["records"]}
        for t in fm["tensors"]:
            if t["path"][0] != "tensors":
                continue
            item = torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()
            out.append(
                {
                    "file": p,
                    "rank": fe["rank"],
                    "key": t["path"][1],
                    "offset": recs[t["record"]]["offset"] + t["storage_offset"] * item,
                    "nbytes": math.prod(t["shape"]) * item,
                    "shape": t["shape"],
                    "dtype": t["dtype"],
                }
            )
    return out
