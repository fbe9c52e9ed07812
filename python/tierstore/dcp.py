"""PyTorch Distributed Checkpoint (DCP) interoperability.

A DCP checkpoint is a directory with a pickled ``.metadata`` (global tensor
shapes, dtypes, and the n-D chunks that were saved, each with its file,
offset and length) and ``__<rank>_<i>.distcp`` files in which every chunk is
a ``torch.save`` blob. tierstore reads the metadata with DCP's own reader,
maps each chunk to a piece of the global tensor, and reshards exactly as for
its own checkpoints: the planner finds the chunks a target needs and the
coverage proof checks the result. DCP chunks are opaque blobs, so a chunk is
read whole even when only part of it is needed (what DCP itself does).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from tierstore.errors import FormatError
from tierstore.layout import Box, Layout
from tierstore.reshard import prove_coverage


def is_dcp(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ".metadata").is_file()


class DcpCheckpoint:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        self.dir = Path(path)
        self.meta = FileSystemReader(str(path)).read_metadata()
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Box, Any]]]] = {}
        self.objects: dict[str, Any] = {}
        by_fqn: dict[str, list[tuple[Any, Any]]] = {}
        for idx, info in self.meta.storage_data.items():
            by_fqn.setdefault(idx.fqn, []).append((idx, info))
        for fqn, md in self.meta.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = []
                infos = {tuple(i.offset): inf for i, inf in by_fqn.get(fqn, [])}
                for ch in md.chunks:
                    box = Box(tuple(int(x) for x in ch.offsets), tuple(int(x) for x in ch.sizes))
                    chunks.append((box, infos[tuple(ch.offsets)]))
                self.tensors[fqn] = (tuple(int(x) for x in md.size), md.properties.dtype, chunks)
            elif isinstance(md, BytesStorageMetadata):
                self.objects[fqn] = by_fqn[fqn][0][1]

    def _blob(self, info: Any) -> bytes:
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise FormatError(f"{self.dir / info.relative_path}: chunk at {info.offset} is cut short",
                              path=str(self.dir / info.relative_path))  # fmt: skip
        return data

    def chunk(self, info: Any) -> torch.Tensor:
        t = torch.load(io.BytesIO(self._blob(info)), weights_only=True)
        assert isinstance(t, torch.Tensor)
        return t

    def obj(self, fqn: str, weights_only: bool) -> Any:
        return torch.load(io.BytesIO(self._blob(self.objects[fqn])), weights_only=weights_only)


def load_dcp_into(
    path: str | os.PathLike[str],
    targets: list[tuple[str, torch.Tensor, Layout]],
    objects: list[tuple[str, MutableMapping[str, Any], str]],
    weights_only: bool = True,
    stats: dict[str, Any] | None = None,
) -> None:
    ck = DcpCheckpoint(path)
    cache: dict[int, torch.Tensor] = {}
    read = 0
    needed = 0
    for key, dest, lay in targets:
        inters_all = []
        flat = dest.view(-1)
        for p in lay.pieces:
            if p.tensor not in ck.tensors:
                raise FormatError(f"{path}: DCP checkpoint has no tensor {p.tensor!r}", path=str(path))
            _shape, _dt, chunks = ck.tensors[p.tensor]
            boxes = []
            for box, info in chunks:
                inter = box.intersect(p.box)
                if inter is None:
                    continue
                boxes.append(inter)
                k = id(info)
                if k not in cache:
                    cache[k] = ck.chunk(info)
                    read += info.length
                where = zip(inter.offsets, box.offsets, inter.lengths, strict=True)
                src = cache[k][tuple(slice(o - b, o - b + n) for o, b, n in where)]
                rel = [o - b for o, b in zip(inter.offsets, p.box.offsets, strict=True)]
                if isinstance(p.local, Box):
                    lb = p.local
                    gd = [d for d in range(len(p.box.lengths)) if p.box.lengths[d] != 1]
                    ld = [d for d in range(len(lb.lengths)) if lb.lengths[d] != 1]
                    off = list(lb.offsets)
                    ln = [1] * len(lb.lengths)
                    for g, d in zip(gd, ld, strict=True):
                        off[d] = lb.offsets[d] + rel[g]
                        ln[d] = inter.lengths[g]
                    dest[tuple(slice(o, o + n) for o, n in zip(off, ln, strict=True))] = src.reshape(ln)
                else:
                    # Flat local: copy element runs in the piece box's C order.
                    idx = torch.arange(p.box.numel).reshape(p.box.lengths)
                    sel = idx[tuple(slice(r, r + n) for r, n in zip(rel, inter.lengths, strict=True))].reshape(-1)
                    flat[p.local + sel] = src.reshape(-1).to(flat.dtype)
            inters_all.append(boxes)
            needed += p.box.numel * dest.element_size()
        prove_coverage(key, lay, inters_all)
    for key, parent, pkey in objects:
        if key not in ck.objects:
            raise FormatError(f"{path}: DCP checkpoint has no value for {key!r}", path=str(path))
        parent[pkey] = ck.obj(key, weights_only)
    if stats is not None:
        stats["bytes_read"] = read
        stats["bytes_needed"] = needed


def to_state_dict(path: str | os.PathLike[str], weights_only: bool = True) -> dict[str, Any]:
    """A DCP checkpoint as one flat dict of full tensors and objects."""
    ck = DcpCheckpoint(path)
    out: dict[str, Any] = {}
    for fqn, (shape, dtype, chunks) in ck.tensors.items():
        t = torch.empty(shape, dtype=dtype)
        for box, info in chunks:
            t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))] = ck.chunk(info)
        out[fqn] = t
    for fqn in ck.objects:
        out[fqn] = ck.obj(fqn, weights_only)
    return out


def save_dcp(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``state`` (full tensors and objects) as a DCP checkpoint."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(dict(state), storage_writer=FileSystemWriter(str(path)), no_dist=True)
