"""The indexed manifest (issue 16, a manifest a rank reads in part): a large
checkpoint's global tensors go to ``index.<save id>.bin``, per-tensor
sections with a CRC-32 each behind a checked table, so a loading rank reads
and decodes only the entries of the tensors it loads."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import tierstore
import tierstore.cli
from tierstore import _metadata
from tierstore._sharded_read import load_sharded
from tierstore.errors import ManifestError, TierstoreError
from tierstore.layout import attach, tp_column
from tierstore.sharded import consolidate
from tierstore.shardmeta import Checkpoint

N = 40


def _save(d: pathlib.Path, monkeypatch: pytest.MonkeyPatch, index: bool = True) -> dict[str, torch.Tensor]:
    if index:
        monkeypatch.setenv("TIERSTORE_MANIFEST_INDEX_BYTES", "0")
    full = {f"layer{i:02d}.w": torch.randn(16, 8) + i for i in range(N)}
    sd: dict[str, torch.Tensor] = {}
    for k, t in full.items():  # two row shards of each, held by this one process
        for r in range(2):
            sd[f"{k}.{r}"] = attach(t[8 * r : 8 * r + 8].clone(), tp_column(k, (16, 8), r, 2))
    tierstore.save_sharded(sd, d)
    monkeypatch.delenv("TIERSTORE_MANIFEST_INDEX_BYTES", raising=False)
    return full


def _head(d: pathlib.Path) -> dict[str, object]:
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=True)
    return m


def test_a_loading_rank_reads_only_the_sections_it_needs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ck"
    full = _save(d, monkeypatch)
    head = _head(d)
    assert "tensors" not in head and "groups" not in head
    rec = head["index"]
    assert isinstance(rec, dict) and (d / rec["name"]).stat().st_size == rec["bytes"] and rec["tensors"] == N
    ck = Checkpoint(d)
    assert ck.index_file is not None
    table = ck.index_file.bytes_read
    assert table == rec["table_bytes"] < rec["bytes"] / 2
    out = {"layer07.w": torch.zeros(16, 8)}
    load_sharded(ck, out)
    assert torch.equal(out["layer07.w"], full["layer07.w"])
    one = ck.index_file.bytes_read - table
    # One tensor section and its group's: a small part of what the index holds.
    assert 0 < one < (rec["bytes"] - rec["table_bytes"]) / 8, (one, rec)
    # Everything still loads, whole and resharded; verify and consolidate read it all.
    whole = consolidate(d)
    assert all(torch.equal(whole[k], v) for k, v in full.items())
    assert tierstore.cli.main(["verify", str(d)]) == 0


def test_small_checkpoints_keep_one_manifest(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "ck"
    _save(d, monkeypatch, index=False)
    head = _head(d)
    assert "index" not in head and len(head["tensors"]) == N  # type: ignore[arg-type]
    assert not list(d.glob("index.*.bin"))


@pytest.mark.parametrize("where", ["table", "section", "truncate", "missing"])
def test_a_damaged_index_is_refused_naming_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    d = tmp_path / "ck"
    full = _save(d, monkeypatch)
    rec = _head(d)["index"]
    assert isinstance(rec, dict)
    p = d / rec["name"]
    data = bytearray(p.read_bytes())
    if where == "table":
        data[20] ^= 0x01
    elif where == "section":
        data[rec["table_bytes"] + 5] ^= 0x01
    elif where == "truncate":
        del data[len(data) - 10 :]
    if where == "missing":
        p.unlink()
    else:
        p.write_bytes(bytes(data))
    if where == "section":
        # Only the damaged section is refused: a load that does not need it goes on.
        with pytest.raises(ManifestError, match=r"index"):
            consolidate(d)
        ck = Checkpoint(d)
        names = [n for n in ck.manifest["tensors"] if n != ck.index_file.keys[0][1]]  # type: ignore[union-attr]
        got = {names[0]: torch.zeros(16, 8)}
        tierstore.load_sharded(d, got)
        assert torch.equal(got[names[0]], full[names[0]])
        return
    with pytest.raises(TierstoreError, match=r"index"):
        tierstore.load_sharded(d, {"layer00.w": torch.zeros(16, 8)})


def test_a_resealed_manifest_cannot_point_at_another_index(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ck"
    _save(d, monkeypatch)
    head = _head(d)
    rec = head["index"]
    assert isinstance(rec, dict)
    for change in ({"name": "../index.bin"}, {"table_crc32": rec["table_crc32"] ^ 1}, {"tensors": N + 1}):
        bad = dict(head)
        bad["index"] = {**rec, **change}
        (d / "manifest.json").write_bytes(_metadata.dumps(bad))
        with pytest.raises(TierstoreError):
            tierstore.load_sharded(d, {"layer00.w": torch.zeros(16, 8)})


def test_the_next_save_removes_the_old_index_and_inspect_prints_the_whole_manifest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ck"
    _save(d, monkeypatch)
    first = sorted(d.glob("index.*.bin"))
    _save(d, monkeypatch)
    second = sorted(d.glob("index.*.bin"))
    assert len(first) == len(second) == 1 and first != second
    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "inspect", "--manifest", str(d)],
        capture_output=True, text=True, check=True, env={**os.environ},
    )  # fmt: skip
    m = json.loads(r.stdout)
    assert len(m["tensors"]) == N and m["tensors"]["layer00.w"]["rule"]["splits"] == [[0, 2, "even", 16]]
    assert m["groups"] and "index" in m


def test_manifests_cached_reads_each_file_once_and_sees_a_replacement(tmp_path: pathlib.Path) -> None:
    """Inside ``manifests_cached`` a manifest is parsed once per file
    identity: the same file gives the same checked dict, a manifest replaced
    (written under a new name and renamed, as every writer does) or changed
    in place is read and checked anew."""
    from tierstore._fs import write_atomic
    from tierstore.errors import TierstoreError
    from tierstore.shardmeta import MANIFEST, manifests_cached, read_manifest

    d = tmp_path / "ck"
    tierstore.save_sharded({"w": torch.arange(10.0)}, d)
    data = (d / MANIFEST).read_bytes()
    with manifests_cached():
        a = read_manifest(d)
        assert read_manifest(d) is a
        write_atomic(d / MANIFEST, data)  # the same bytes, a new file
        b = read_manifest(d)
        assert b is not a and b == a
        with open(d / MANIFEST, "r+b") as f:  # damaged in place: its size stays, its time moves
            f.seek(len(data) // 2)
            f.write(b"#")
        st = os.stat(d / MANIFEST)
        os.utime(d / MANIFEST, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        with pytest.raises(TierstoreError):
            read_manifest(d)
