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

import itertools
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
    against the CRC-32 recorded at save). ``e`` is one of the entries that
    :func:`check_sources` found whole; a file cut short since is a short
    read, reported as damage below."""
    n = int(e["nbytes"])
    if "tensor" in e:
        buf = out if out is not None else host_buffer(n, huge=True)
        buf.copy_(tensors[e["tensor"]].view(torch.uint8).reshape(-1))
        return buf
    f = _paths.member(d, e["file"], source=str(d), field=f"offloaded optimizer subgroup {e['index']}")
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
    check_sources(meta["subgroups"], tensors, d)
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
    """Every size, place and index an offload entry states, checked before
    use: each subgroup holds parameters of its own (ranges of the saved
    parameters that do not overlap), and each of its state tensors is a
    distinct (parameter, key) at bytes of its own inside the subgroup."""
    from tierstore._metadata import Fields

    f = Fields(f"{where}: offloaded optimizer state")
    f.uint(meta.get("steps", 0), "steps")
    grouped: list[int] = []
    for i, g in enumerate(f.array(f.get(meta, "param_groups", "param_groups"), "param_groups")):
        f.mapping(g, f"param_groups[{i}]")
        for j, q in enumerate(f.array(f.get(g, "params", f"param_groups[{i}].params"), f"param_groups[{i}].params")):
            grouped.append(f.uint(q, f"param_groups[{i}].params[{j}]", most=1 << 40))
    nparams = None
    if "params" in meta:  # format /1 and /2 both write it; the partition check reads it
        saved = f.array(meta["params"], "params")
        for i, q in enumerate(saved):
            f.mapping(q, f"params[{i}]")
            f.shape(f.get(q, "shape", f"params[{i}].shape"), f"params[{i}].shape")
        nparams = len(saved)
        if sorted(grouped) != list(range(nparams)):
            f.fail("param_groups", f"groups that hold each of the {nparams} saved parameters once", grouped[:20])
    taken: list[tuple[int, int, str]] = []
    sources: dict[tuple[str, str], str] = {}
    for i, e in enumerate(f.array(f.get(meta, "subgroups", "subgroups"), "subgroups")):
        fld = f"subgroups[{i}]"
        f.mapping(e, fld)
        for k in ("index", "group", "first", "count"):
            f.uint(f.get(e, k, f"{fld}.{k}"), f"{fld}.{k}", most=1 << 40)
        first, count = e["first"], e["count"]
        if nparams is not None and first + count > nparams:
            f.fail(f"{fld}.first", f"parameters [first, first + count) among the {nparams} saved", (first, count))
        taken.append((first, first + count, fld))
        nbytes = f.uint(f.get(e, "nbytes", f"{fld}.nbytes"), f"{fld}.nbytes")
        if "tensor" in e:
            src = ("tensor", f.string(e["tensor"], f"{fld}.tensor"))
        else:
            src = ("file", f.string(f.get(e, "file", f"{fld}.file"), f"{fld}.file"))
            f.uint(f.get(e, "crc32", f"{fld}.crc32"), f"{fld}.crc32", most=0xFFFFFFFF)
        if src in sources:
            f.fail(f"{fld}.{src[0]}", f"a {src[0]} of its own ({sources[src]} names it too)", src[1])
        sources[src] = fld
        for key in f.mapping(f.get(e, "objects", f"{fld}.objects"), f"{fld}.objects"):
            if not isinstance(key, str) or not key.isdigit() or int(key) >= count:
                f.fail(f"{fld}.objects", f"keys naming the subgroup's parameters (0 to {count - 1})", key)
            f.mapping(e["objects"][key], f"{fld}.objects[{key!r}]")
        spans: list[tuple[int, int, str]] = []
        seen: set[tuple[int, Any]] = set()
        for j, item in enumerate(f.array(f.get(e, "layout", f"{fld}.layout"), f"{fld}.layout")):
            lf = f"{fld}.layout[{j}]"
            f.array(item, lf, length=6)
            pi = f.uint(item[0], f"{lf}[0]", most=1 << 40)
            if pi >= count:
                f.fail(f"{lf}[0]", f"one of the subgroup's {count} parameters (0 to {count - 1})", pi)
            if item[1] is not None:
                f.string(item[1], f"{lf}[1]", most=256)
            if (pi, item[1]) in seen:
                f.fail(f"{lf}[1]", f"a state key not listed before for parameter {pi}", item[1])
            seen.add((pi, item[1]))
            o = f.uint(item[2], f"{lf}[2]")
            n = f.uint(item[3], f"{lf}[3]")
            dt = dtype_named(item[4])
            if dt is None:
                f.fail(f"{lf}[4]", "a dtype", item[4])
            shape = f.shape(item[5], f"{lf}[5]")
            if o + n > nbytes or math.prod(shape) * torch.empty((), dtype=dt).element_size() != n:
                f.fail(lf, f"a tensor of {n} bytes at {o} inside the subgroup's {nbytes} bytes", item)
            if n:
                spans.append((o, o + n, lf))
        spans.sort()
        for (_a0, a1, la), (b0, _b1, lb) in itertools.pairwise(spans):
            if b0 < a1:
                f.fail(lb, f"bytes of its own (those of {la} end at {a1})", b0)
    taken.sort()
    for (_a0, a1, fa), (b0, _b1, fb) in itertools.pairwise(taken):
        if b0 < a1:
            f.fail(f"{fb}.first", f"parameters of its own ({fa} holds those up to {a1 - 1})", b0)


def check_sources(entries: list[dict[str, Any]], tensors: dict[str, torch.Tensor], d: Path) -> None:
    """Every subgroup's bytes are there, as many as its entry says (its
    tensor, or its file inside ``d``), checked before anything is allocated
    for them or changed in an optimizer: a size in the metadata is never
    trusted further than the files hold."""
    for e in entries:
        n = int(e["nbytes"])
        if "tensor" in e:
            t = tensors.get(e["tensor"])
            if t is None or t.numel() * t.element_size() != n:
                raise TierstoreError(
                    f"{d}: offloaded optimizer subgroup {e['index']}: tensor {e['tensor']!r} of {n} bytes is missing"
                )
            continue
        f = _paths.member(d, e["file"], source=str(d), field=f"offloaded optimizer subgroup {e['index']}")
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise TierstoreError(f"{f}: file of offloaded optimizer subgroup {e['index']} is missing") from None
        if size < n:
            raise TierstoreError(f"{f}: file of offloaded optimizer subgroup {e['index']} holds fewer than {n} bytes")
