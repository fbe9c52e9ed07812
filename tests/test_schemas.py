"""Every JSON document tierstore writes follows the schema docs/FORMAT.md
points to: a sharded checkpoint's manifest.json (tensor-parallel, ZeRO flat
and replicated pieces, objects, per-rank objects, key paths, attachments),
a Checkpointer step's checkpoint.json, and the meta of an offloaded
optimizer's checkpoint entry. Each schema also refuses what the writer never
writes (a field missing, a wrong type, an unknown member)."""

from __future__ import annotations

import copy
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import manifest
from tierstore._offload_entry import OFFLOAD_KEY


def _check(doc: Any, name: str) -> None:
    jsonschema.validate(doc, manifest.schema(name))


def _refused(doc: Any, name: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        _check(doc, name)


def _save_two_ranks(rank: int, world: int, d: str) -> None:
    from tierstore.layout import Layout, tp_column, zero_partition

    w = torch.arange(64.0).reshape(8, 8)
    local = w.chunk(world)[rank].clone()
    tierstore.attach(local, tp_column("w", (8, 8), rank, world))
    # A flat buffer of explicit pieces, and a ZeRO-1 partition (stored as its members' rules).
    flat_lay = Layout.flat_buffer([("master.w", (8, 8)), ("master.b", (5,))], rank * 35, 35)
    flat = torch.zeros(flat_lay.local_shape)
    tierstore.attach(flat, flat_lay)
    zero_lay = zero_partition([("zero.w", (8, 8)), ("zero.b", (5,))], rank, world, stage=1)
    zero = torch.zeros(zero_lay.local_shape)
    tierstore.attach(zero, zero_lay)
    sd = {
        "w": local,
        "flat": flat,
        "zero": zero,
        "bias": torch.ones(3),  # replicated: one rank writes it
        "step": 7,
        "rng": tierstore.PerRank(rank),
        "optim": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
    }
    tierstore.save_sharded(sd, d)


def test_sharded_manifest_follows_its_schema(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    run_world(2, _save_two_ranks, str(d))
    m = json.loads((d / "manifest.json").read_text())
    _check(m, "sharded_manifest")
    assert m["world_size"] == 2 and set(m["per_rank_objects"]["rng"]) == {"0", "1"}
    assert any(isinstance(p[2], int) for p in m["tensors"]["master.w"]["pieces"] + m["tensors"]["master.b"]["pieces"])
    assert "optim.state.0.exp_avg" in m["paths"]
    assert m["tensors"]["zero.b"]["rule"]["flat_per"] == 36 and m["tensors"]["zero.b"]["rule"]["flat_at"] == 64
    assert m["tensors"]["w"]["rule"]["splits"] == [[0, 2, "even", 8]], "a TP split is stored as its rule"
    for mutate in (
        lambda x: x.pop("files"),
        lambda x: x.update(world_size=0),
        lambda x: x.update(surprise=1),
        lambda x: x["stored"][0].update(offset=-1),
        lambda x: x["files"][0].update(name="../escape.pt"),
        lambda x: x["tensors"]["master.w"]["pieces"][0].append(9),
        lambda x: x["tensors"]["w"]["rule"]["splits"][0].append(9),
        lambda x: x["tensors"]["w"]["rule"]["splits"][0].__setitem__(2, "odd"),
        lambda x: x["tensors"]["w"].pop("parts"),
        lambda x: x["groups"][0].update(coords=[[-1]]),
        lambda x: x.update(checksum="sha1:00"),
    ):
        bad = copy.deepcopy(m)
        mutate(bad)
        _refused(bad, "sharded_manifest")


def test_checkpointer_documents_follow_their_schemas(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    opt = tierstore.offload(
        torch.optim.AdamW,
        model.parameters(),
        tiers=[tierstore.HostTier("8KiB"), tierstore.DiskTier(tmp_path / "scratch")],
        subgroup_bytes=16384,
    )
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with tierstore.Checkpointer(tmp_path / "ck", tiers=[tierstore.HostTier("64MiB"), tierstore.DiskTier(".")]) as ck:
        ck.save(1, {"model": model.state_dict(), "optim": opt, "step": 1})
        ck.wait()
    (step,) = (tmp_path / "ck").glob("step-*")
    m = json.loads((step / "manifest.json").read_text())
    _check(m, "sharded_manifest")
    assert "checkpoint.json" in m["attachments"]
    meta_doc = json.loads((step / "checkpoint.json").read_text())
    _check(meta_doc, "checkpoint")
    for mutate in (lambda x: x.pop("tree"), lambda x: x.update(step=-1), lambda x: x["tree"].append(["k"])):
        bad = copy.deepcopy(meta_doc)
        mutate(bad)
        _refused(bad, "checkpoint")

    # The offload entry, as the objects file holds it (tuples read as arrays).
    objects_file = step / m["objects"][f"optim.{OFFLOAD_KEY}"]
    saved = tierstore.load(objects_file, weights_only=False)["objects"][f"optim.{OFFLOAD_KEY}"]
    fmt, meta = saved
    assert fmt == "tierstore-offload/2"
    doc = json.loads(json.dumps(meta))
    _check(doc, "offload_entry")
    # A subgroup is either in a file beside the entry or a tensor in it (where
    # it was at save time; which one depends on the write-back's timing).
    for sg in doc["subgroups"]:
        assert ("file" in sg) != ("tensor" in sg), sg
        other = copy.deepcopy(doc)
        osg = next(x for x in other["subgroups"] if x["index"] == sg["index"])
        if "file" in osg:
            del osg["file"], osg["crc32"]
            osg["tensor"] = f"o0-sg-{osg['index']:06d}"
        else:
            del osg["tensor"]
            osg.update(file=f"o0-sg-{osg['index']:06d}.bin", crc32=0)
        _check(other, "offload_entry")
    for mutate in (
        lambda x: x["subgroups"][0].pop("layout"),
        lambda x: x["subgroups"][0].update(tensor="t", file="f.bin"),
        lambda x: x["params"][0].update(dtype=3),
        lambda x: x.update(steps="1"),
    ):
        bad = copy.deepcopy(doc)
        mutate(bad)
        _refused(bad, "offload_entry")
    pickle.dumps(meta)  # stays a plain picklable value


def test_file_manifest_schema_is_found_by_name(tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    tierstore.save({"a": torch.ones(2)}, p)
    with zipfile.ZipFile(p) as z:
        _check(json.loads(z.read("x/.tierstore/manifest.json")), "manifest")
    assert set(manifest.SCHEMAS) == {"manifest", "sharded_manifest", "checkpoint", "offload_entry"}
    with pytest.raises(tierstore.TierstoreError, match="no schema"):
        manifest.schema("nope")
