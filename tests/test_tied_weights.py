"""Tied weights (an embedding and the output head over one storage, as GPT-2
and many LLMs have) in sharded checkpoints: written once, consolidated as one
storage, as torch.save and torch.load keep them.

The consolidated load refuses a manifest whose tensors add up to more than
its files hold (an allocation guard); tensors saved as the same bytes count
once there, and only when the files' own manifests (checked against their
pickles) say that they are the same bytes."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore.layout import Box, attach, tp_vocab
from tierstore.sharded import consolidate


def _tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, torch.nn.LayerNorm(64), head)


def test_tied_weights_consolidate_as_one_storage(tmp_path: pathlib.Path) -> None:
    model = _tied_model()
    sd = model.state_dict()
    assert sd["0.weight"] is not sd["2.weight"] and sd["0.weight"].data_ptr() == sd["2.weight"].data_ptr()
    path = tmp_path / "sh"
    tierstore.save_sharded({"model": sd}, path)
    # The storage is written once.
    held = sum(p.stat().st_size for p in path.glob("rank-*"))
    assert held < 2 * sd["0.weight"].nbytes
    full = consolidate(path)
    a, b = full["model.0.weight"], full["model.2.weight"]
    assert torch.equal(a, sd["0.weight"]) and torch.equal(b, sd["2.weight"])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(full["model.1.weight"], sd["1.weight"])
    # Into a fresh model of the same shape: values, not sharing, are asked for.
    fresh = _tied_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    tgt = {"model": fresh.state_dict()}
    tierstore.load_sharded(path, tgt)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_tied_weights_through_the_cli_give_a_torch_file_with_one_storage(tmp_path: pathlib.Path) -> None:
    sd = _tied_model().state_dict()
    tierstore.save_sharded(sd, tmp_path / "sh")
    out = tmp_path / "full.pt"
    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "consolidate", str(tmp_path / "sh"), str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["0.weight"], sd["0.weight"])
    assert got["0.weight"].untyped_storage().data_ptr() == got["2.weight"].untyped_storage().data_ptr()


def test_equal_values_in_separate_storages_stay_separate(tmp_path: pathlib.Path) -> None:
    """Only the same bytes are shared: two tensors with equal values that
    the state keeps apart come back apart."""
    w = torch.randn(100, 8)
    tierstore.save_sharded({"a": w, "b": w.clone(), "c": w[1:]}, tmp_path / "sh")
    full = consolidate(tmp_path / "sh")
    assert torch.equal(full["a"], w) and torch.equal(full["b"], w) and torch.equal(full["c"], w[1:])
    ptrs = {full[k].untyped_storage().data_ptr() for k in "abc"}
    assert len(ptrs) == 3


V, D = 10, 4


def _vocab_job(rank: int, world: int, path: str) -> None:
    full = torch.arange(V * D, dtype=torch.float32).reshape(V, D)
    emb = tp_vocab("embed.weight", (V, D), rank, world)
    head = tp_vocab("head.weight", (V, D), rank, world)
    local = torch.zeros(emb.local_shape)
    for p in emb.pieces:
        assert isinstance(p.local, Box)
        src = full[tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))]
        local[tuple(slice(o, o + n) for o, n in zip(p.local.offsets, p.local.lengths, strict=True))] = src
    # Two tensor objects over one storage, each with its own global name.
    tierstore.save_sharded({"embed": attach(local, emb), "head": attach(local.detach(), head)}, path)


def test_tp_split_tied_weights_consolidate_as_one_storage(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "tp")
    run_world(2, _vocab_job, path)
    full = consolidate(path)
    expect = torch.arange(V * D, dtype=torch.float32).reshape(V, D)
    assert torch.equal(full["embed.weight"], expect) and torch.equal(full["head.weight"], expect)
    assert full["embed.weight"].untyped_storage().data_ptr() == full["head.weight"].untyped_storage().data_ptr()


def test_a_manifest_over_its_files_is_still_refused(tmp_path: pathlib.Path) -> None:
    """The guard still refuses tensors that are not the same bytes and add
    up to more than the files hold (a shape grown in a re-sealed manifest)."""
    from tierstore import _metadata

    tierstore.save_sharded({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, tmp_path / "sh")
    mp = tmp_path / "sh" / "manifest.json"
    m, _ = _metadata.loads(mp.read_bytes(), "m", required=False)
    for name in ("a", "b"):
        m["tensors"][name]["shape"] = [6400, 64]
        if "rule" in m["tensors"][name]:
            m["tensors"][name]["rule"]["shape"] = [6400, 64]
    mp.write_bytes(_metadata.dumps(m))  # re-sealed, as an attacker would
    with pytest.raises(tierstore.TierstoreError, match="add up to"):
        consolidate(tmp_path / "sh")
