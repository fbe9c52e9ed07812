"""DCP checkpoints at scale (issue 16, item 5): ``.metadata`` is unpickled
and checked once per process while its bytes stay the same, and a target
finds the chunks it meets through an index, not a scan."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from dist_util import run_world
from test_dcp_safety import multi_save_job

import tierstore
from tierstore import dcp
from tierstore.layout import Box, Layout, attach


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("multi") / "dcp"
    run_world(4, multi_save_job, str(path))
    return path


def _target() -> dict[str, Any]:
    t = attach(torch.zeros(8, 4), Layout.shard("w", (8, 12), 1, 1, 3))
    return {"w": t, "step": None}


def test_metadata_is_unpickled_once_per_process(multi: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = dcp.unpickle_metadata

    def counting(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(dcp, "unpickle_metadata", counting)
    dcp._opened.clear()
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    for _ in range(3):
        sd = _target()
        tierstore.load_sharded(multi, sd)
        assert torch.equal(sd["w"], full[:, 4:8]) and sd["step"] == 3
    assert len(calls) == 1


def test_changed_metadata_is_read_again(multi: pathlib.Path, tmp_path: pathlib.Path) -> None:
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(multi, d)
    tierstore.load_sharded(d, _target())
    meta = d / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, same inode, likely the same modification time
    meta.write_bytes(bytes(raw))
    with pytest.raises(tierstore.TierstoreError):
        tierstore.load_sharded(d, _target())


def test_chunks_meeting_matches_a_scan(multi: pathlib.Path) -> None:
    ck = dcp.DcpCheckpoint(multi)
    for fqn in ("w", "c"):
        shape, _dt, chunks = ck.tensors[fqn]
        for q in (Box((0, 0), shape), Box((1, 2), (3, 5)), Box((7, 11), (1, 1)), Box((2, 0), (4, 12))):
            want = [(b, b.intersect(q)) for b, _i in chunks if b.intersect(q) is not None]
            got = [(b, inter) for b, _i, inter in ck.chunks_meeting(fqn, q)]
            assert sorted(got, key=str) == sorted(want, key=str)
