"""An offloaded optimizer's subgroups as a checkpoint takes them and puts
them back: the store side of ``OffloadedOptimizer.checkpoint_parts`` and
``restore_from_checkpoint`` (the entry's format is ``_offload_entry``'s)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierstore._engine import host_buffer
from tierstore._metadata import dtype_name
from tierstore._offload_entry import state_dtype, subgroup_bytes
from tierstore._offload_store import SubgroupStore
from tierstore._offload_subgroup import Subgroup


def take_subgroups(
    store: SubgroupStore, prefix: str, pin_tag: str, file_prefix: str
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], list[tuple[Path, str]]]:
    """Each subgroup's entry, without reading anything back: a resident one
    (or one whose write-back is in flight: its buffer is unchanged until the
    next step) as its flat byte tensor, to be captured before the next step
    changes it; the others as their files, pinned by a hard link (a later
    write-back goes to a new file, never into a pinned one). Returns the
    entries, the tensors by name and the pins with their names in the
    checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    pins: list[tuple[Path, str]] = []
    entries = []
    for sg in store.subgroups:
        entry: dict[str, Any] = {
            "index": sg.index,
            "group": sg.group,
            "first": sg.first,
            "count": len(sg.params),
            "nbytes": sg.nbytes,
            "split": sg.split,
            "layout": [[i, k, o, n, dtype_name(dt), list(shape)] for i, k, o, n, dt, shape in sg.layout],
            "objects": sg.objects(),
        }
        if sg.buf is None and sg.reading is not None:
            store.settle(sg)  # only a state_dict() read can be in flight here
        if sg.buf is not None:
            entry["tensor"] = f"{prefix}sg-{sg.index:06d}"
            tensors[entry["tensor"]] = sg.buf
        else:
            assert sg.file is not None
            name = f"{file_prefix}{prefix}sg-{sg.index:06d}.bin"
            pin = sg.file.parent / f"pin-{pin_tag}-sg-{sg.index:06d}.bin"
            try:
                os.link(sg.file, pin)
                sg.pinned = True
            except OSError:  # no hard links here: take the bytes now
                buf = host_buffer(sg.nbytes, huge=True)
                store.read(sg, buf)
                entry["tensor"] = f"{prefix}sg-{sg.index:06d}"
                tensors[entry["tensor"]] = buf
            else:
                entry["file"] = name
                entry["crc32"] = sg.crc
                pins.append((pin, name))
        entries.append(entry)
    return entries, tensors, pins


def restore_subgroups(
    store: SubgroupStore,
    entries: list[dict[str, Any]],
    tensors: dict[str, torch.Tensor],
    d: Path,
    ensure_inner: Callable[[Subgroup], torch.optim.Optimizer],
) -> None:
    """Puts each entry's bytes, checked, straight into host memory or a path
    (the partition is the same: the caller checked)."""
    resident = 0
    for sg, e in zip(store.subgroups, entries, strict=True):
        if sg.buf is not None:
            store.drop(sg)
        store.wait_room(e["nbytes"])
        buf = store.memory.alloc(e["nbytes"])
        try:
            subgroup_bytes(e, tensors, d, out=buf)
        except BaseException:
            store.memory.release(buf)
            raise
        inner = ensure_inner(sg)
        inner.state.clear()
        for i, objs in e["objects"].items():
            inner.state[sg.masters[int(i)]].update(objs)
        sg.layout = [(i, k, o, n, state_dtype(dt), tuple(shape)) for i, k, o, n, dt, shape in e["layout"]]
        sg.nbytes = e["nbytes"]
        sg.split = bool(e.get("split", False))
        if sg.split:  # rebuilt from the parameters (restored with the model) at the next update
            sg.drop_masters()
        for i, k, *_ in sg.layout:
            if k is not None:
                inner.state.setdefault(sg.masters[i], {})
        store.adopt(sg, buf)
        resident = store.spill(sg, resident)


def same_partition(meta: dict[str, Any], optimizer: str, params: list[torch.Tensor], subgroups: list[Subgroup]) -> bool:
    """Whether a checkpoint's subgroups are these (the same optimizer, the
    same parameter shapes, the same partition), so that its bytes go in as
    they are."""
    if meta.get("optimizer") != optimizer:
        return False
    if [tuple(q["shape"]) for q in meta["params"]] != [tuple(p.shape) for p in params]:
        return False
    mine = [(sg.group, sg.first, len(sg.params)) for sg in subgroups]
    return mine == [(e["group"], e["first"], e["count"]) for e in meta["subgroups"]]
