"""An offloaded optimizer's entry in a checkpoint: its format, its checked
metadata, and the wrapped optimizer's ordinary state dict rebuilt from it.

The entry is ``{"__tierstore_offload__": (format, meta), <subgroup tensor
name>: uint8 tensor, ...}``: each subgroup's packed bytes are a tensor of the
checkpoint (resident subgroups) or a file beside it (the others), with the
CRC-32 recorded at save (docs/FORMAT.md). Both the Checkpointer (which
restores entries without an optimizer object) and ``OffloadedOptimizer``
(which writes them and restores into itself) use this module; it knows
nothing of either."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from tierstore import _core, _paths
from tierstore._engine import get_engine, host_buffer
from tierstore._metadata import dtype_named
from tierstore.errors import ChecksumError, TierstoreError

OFFLOAD_KEY = "__tierstore_offload__"  # an offloaded optimizer's entry in a checkpoint
OFFLOAD_FORMAT = "tierstore-offload/2"  # /2: subgroups may store split masters ("split")
OFFLOAD_FORMATS_READ = ("tierstore-offload/1", OFFLOAD_FORMAT)


def state_dtype(name: str) -> torch.dtype:
    dt = dtype_named(name)
    if dt is None:
        raise TierstoreError(f"offloaded optimizer state: unknown dtype {name!r}")
    return dt


def subgroup_bytes(
    e: dict[str, Any], tensors: dict[str, torch.Tensor], d: Path, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One saved subgroup's flat bytes (from its tensor, or its file checked
    against the CRC-32 recorded at save)."""
    n = int(e["nbytes"])
    if "tensor" in e:
        t = tensors.get(e["tensor"])
        if t is None or t.numel() * t.element_size() != n:
            raise TierstoreError(f"{d}: offloaded optimizer subgroup {e['index']}: tensor {e['tensor']!r} is missing")
        buf = out if out is not None else host_buffer(n, huge=True)
        buf.copy_(t.view(torch.uint8).reshape(-1))
        return buf
    f = _paths.member(d, e["file"], source=str(d), field=f"offloaded optimizer subgroup {e['index']}")
    if not f.exists():
        raise TierstoreError(f"{f}: file of offloaded optimizer subgroup {e['index']} is missing")
    if f.stat().st_size < n:
        raise TierstoreError(f"{f}: file of offloaded optimizer subgroup {e['index']} holds fewer than {n} bytes")
    buf = out if out is not None else host_buffer(n, huge=True)
    record = f"subgroup {e['index']}"
    try:
        # Verified by the engine as the chunks arrive (against the CRC-32 recorded at save).
        got = _core.transfer_ranges(
            get_engine(), f, [0], [n], [buf.data_ptr()], direct=True, crc32=int(e["crc32"]), record=record
        )
    except ChecksumError as err:
        raise ChecksumError(
            f"{f}: offloaded optimizer state of subgroup {e['index']} is damaged ({err})", path=str(f), record=record
        ) from None
    if got != n:
        raise ChecksumError(
            f"{f}: offloaded optimizer state of subgroup {e['index']} is damaged ({got} of {n} bytes)",
            path=str(f),
            record=record,
        )
    return buf


def restore_state_dict(meta: dict[str, Any], tensors: dict[str, torch.Tensor], d: Path) -> dict[str, Any]:
    """The wrapped optimizer's ordinary state dict (``{"state": {param index:
    {...}}, "param_groups": [...]}``) from an offloaded optimizer's checkpoint
    parts, each subgroup checked."""
    state: dict[int, dict[str, Any]] = {}
    for e in meta["subgroups"]:
        buf = subgroup_bytes(e, tensors, d)
        for i, k, o, n, dt, shape in e["layout"]:
            if k is None:
                continue
            v = buf[o : o + n].view(state_dtype(dt)).view(tuple(shape)).clone()
            state.setdefault(e["first"] + i, {})[k] = v
        for i, objs in e["objects"].items():
            state.setdefault(e["first"] + int(i), {}).update(objs)
    return {"state": dict(sorted(state.items())), "param_groups": meta["param_groups"]}


def is_offload_parts(obj: Any) -> bool:
    """Whether ``obj`` is an offloaded optimizer's checkpoint entry."""
    return isinstance(obj, dict) and OFFLOAD_KEY in obj


def offload_meta(value: Any, where: str) -> dict[str, Any]:
    """The metadata of an offloaded optimizer's checkpoint entry (its
    ``__tierstore_offload__`` value), checked."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[1], dict):
        raise TierstoreError(f"{where}: not the checkpoint of an offloaded optimizer ({OFFLOAD_FORMAT})")
    if value[0] not in OFFLOAD_FORMATS_READ:
        raise TierstoreError(
            f"{where}: offloaded optimizer state in format {value[0]!r}; this tierstore reads "
            f"{', '.join(OFFLOAD_FORMATS_READ)} (written by a newer version?)"
        )
    _check_meta(value[1], where)
    return value[1]


def _check_meta(meta: dict[str, Any], where: str) -> None:
    """Every size and place an offload entry states, checked before use."""
    from tierstore._metadata import Fields

    f = Fields(f"{where}: offloaded optimizer state")
    f.uint(meta.get("steps", 0), "steps")
    f.array(f.get(meta, "param_groups", "param_groups"), "param_groups")
    for i, e in enumerate(f.array(f.get(meta, "subgroups", "subgroups"), "subgroups")):
        fld = f"subgroups[{i}]"
        f.mapping(e, fld)
        for k in ("index", "group", "first", "count"):
            f.uint(f.get(e, k, f"{fld}.{k}"), f"{fld}.{k}", most=1 << 40)
        nbytes = f.uint(f.get(e, "nbytes", f"{fld}.nbytes"), f"{fld}.nbytes")
        if "tensor" in e:
            f.string(e["tensor"], f"{fld}.tensor")
        else:
            f.string(f.get(e, "file", f"{fld}.file"), f"{fld}.file")
            f.uint(f.get(e, "crc32", f"{fld}.crc32"), f"{fld}.crc32", most=0xFFFFFFFF)
        f.mapping(f.get(e, "objects", f"{fld}.objects"), f"{fld}.objects")
        for j, item in enumerate(f.array(f.get(e, "layout", f"{fld}.layout"), f"{fld}.layout")):
            lf = f"{fld}.layout[{j}]"
            f.array(item, lf, length=6)
            f.uint(item[0], f"{lf}[0]", most=1 << 40)
            o = f.uint(item[2], f"{lf}[2]")
            n = f.uint(item[3], f"{lf}[3]")
            dt = dtype_named(item[4])
            if dt is None:
                f.fail(f"{lf}[4]", "a dtype", item[4])
            shape = f.shape(item[5], f"{lf}[5]")
            if o + n > nbytes or math.prod(shape) * torch.empty((), dtype=dt).element_size() != n:
                f.fail(lf, f"a tensor of {n} bytes at {o} inside the subgroup's {nbytes} bytes", item)
