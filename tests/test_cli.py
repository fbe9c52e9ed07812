"""The command line: inspect, verify, info."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import tierstore
from tierstore import _archive, _core


def tierstore_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args], capture_output=True, text=True, timeout=120, check=False
    )


def _file(tmp_path: pathlib.Path) -> pathlib.Path:
    p = tmp_path / "model.pt"
    tierstore.save({"layer": {"weight": torch.randn(16, 8), "bias": torch.zeros(16)}, "step": 3}, p)
    return p


def test_inspect_lists_records_dtypes_shapes_and_checksums(tmp_path: pathlib.Path) -> None:
    p = _file(tmp_path)
    r = tierstore_cli("inspect", "--json", str(p))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    recs = {x["record"]: x for x in out["records"]}
    assert recs["data/0"]["dtype"] == "float32"
    assert recs["data/0"]["tensors"] == ["layer.weight (16, 8)"]
    assert recs["data/0"]["size"] == 16 * 8 * 4
    assert all(x["aligned"] for x in out["records"])
    assert all(x["checksum"] == "ok" for x in out["records"])
    human = tierstore_cli("inspect", str(p))
    assert human.returncode == 0 and "layer.weight" in human.stdout and "data.pkl" in human.stdout


def test_inspect_a_torch_file(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "t.pt"
    torch.save({"a": torch.ones(3)}, p)
    r = tierstore_cli("inspect", "--json", str(p))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "torch.save" in out["writer"]
    assert any(x["record"] == "data/0" and x["checksum"] == "ok" for x in out["records"])


def test_verify_ok_and_damaged(tmp_path: pathlib.Path) -> None:
    p = _file(tmp_path)
    ok = tierstore_cli("verify", str(p))
    assert ok.returncode == 0 and "OK" in ok.stdout
    _arch, _m, offsets = _archive.open_archive(str(p))
    data = bytearray(p.read_bytes())
    data[offsets["data/1"] + 5] ^= 0x10
    p.write_bytes(bytes(data))
    bad = tierstore_cli("verify", str(p))
    assert bad.returncode != 0
    assert "model/data/1" in bad.stderr and "checksum" in bad.stderr
    ins = tierstore_cli("inspect", "--json", str(p))
    assert ins.returncode == 1
    assert json.loads(ins.stdout)["damaged"] == ["data/1"]


def test_verify_missing_file(tmp_path: pathlib.Path) -> None:
    r = tierstore_cli("verify", str(tmp_path / "none.pt"))
    assert r.returncode == 1 and "none.pt" in r.stderr


def test_info_reports_backend_uring_and_alignment(tmp_path: pathlib.Path) -> None:
    r = tierstore_cli("info", "--json", str(tmp_path))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["backend"] in ("io_uring", "threads", "buffered")
    assert isinstance(d["io_uring_available"], bool)
    assert d["io_uring_available"] or d["io_uring_error"]
    assert d["path"]["offset_align"] >= 1
    human = tierstore_cli("info", str(tmp_path))
    assert "backend:" in human.stdout and "io_uring:" in human.stdout and "O_DIRECT:" in human.stdout


def test_backend_forced_by_environment(tmp_path: pathlib.Path) -> None:
    import os

    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "info", "--json"],
        capture_output=True, text=True, env={**os.environ, "TIERSTORE_BACKEND": "buffered"}, check=False,
    )  # fmt: skip
    d = json.loads(r.stdout)
    assert d["backend"] == "buffered" and "TIERSTORE_BACKEND" in d["backend_reason"]


@pytest.mark.parametrize(("value", "want"), [("1", True), ("0", False), ("auto", None)])
def test_huge_pages_set_by_environment_are_reported(value: str, want: bool | None) -> None:
    import os

    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "info", "--json"],
        capture_output=True, text=True, env={**os.environ, "TIERSTORE_HUGE_PAGES": value}, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    if want is None:
        assert d["huge_pages_reason"].startswith("auto")
        # the automatic choice declines exactly where free page reporting is on
        assert d["huge_pages"] == (not _core.free_page_reporting())
    else:
        assert d["huge_pages"] is want and d["huge_pages_reason"] == "set by configuration"


def test_huge_pages_bad_value_is_refused() -> None:
    import os

    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "info"],
        capture_output=True, text=True, env={**os.environ, "TIERSTORE_HUGE_PAGES": "maybe"}, check=False,
    )  # fmt: skip
    assert r.returncode != 0 and "TIERSTORE_HUGE_PAGES" in r.stderr


@pytest.mark.parametrize("huge", [True, False])
def test_load_is_exact_with_and_without_huge_pages(tmp_path: pathlib.Path, huge: bool) -> None:
    sd = {"big": torch.randn(3 << 20), "small": torch.arange(7), "half": torch.randn(5 << 20).bfloat16()}
    p = tmp_path / "h.pt"
    tierstore.save(sd, p)
    tierstore.configure(None, chunk_mib=1, huge_pages=huge)
    try:
        assert tierstore.info()["huge_pages"] is huge
        back = tierstore.load(p)
    finally:
        tierstore.configure(None)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_inspect_of_a_torch_save_file_shows_dtypes_kinds_and_exits_1_when_damaged(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "torch.pt"
    b = torch.arange(5)
    torch.save({"a": torch.ones(3, dtype=torch.bfloat16), "nested": {"b": b}, "v": b[1:]}, p)
    r = tierstore_cli("inspect", "--json", str(p))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["record"]: row for row in out["records"]}
    assert rows["data.pkl"]["kind"] == "pickle"
    assert rows["data/0"]["kind"] == "storage" and rows["data/0"]["dtype"] == "bfloat16"
    assert rows["data/0"]["tensors"] == ["a (3,)"]
    assert rows["data/1"]["dtype"] == "int64" and sorted(rows["data/1"]["tensors"]) == ["nested.b (5,)", "v (4,)"]
    # The sizes inspect shows are the ones verify checks.
    v = tierstore_cli("verify", str(p))
    assert v.returncode == 0, v.stderr
    n = len(out["records"])
    from tierstore.cli import _human

    assert f"{n} records, {_human(out['record_bytes'])} of record data verified" in v.stdout
    assert f"in a {_human(out['file_bytes'])} file" in v.stdout
    text = tierstore_cli("inspect", str(p)).stdout
    assert f"{_human(out['record_bytes'])} of record data in a {_human(out['file_bytes'])} file" in text
    # A flipped bit in a storage: DAMAGED, and a non-zero exit (text and JSON).
    raw = bytearray(p.read_bytes())
    at = raw.find(torch.arange(5).numpy().tobytes())
    raw[at + 9] ^= 4
    p.write_bytes(bytes(raw))
    for args in (("inspect", str(p)), ("inspect", "--json", str(p))):
        r = tierstore_cli(*args)
        assert r.returncode == 1 and "DAMAGED" in r.stdout, args
    assert json.loads(tierstore_cli("inspect", "--json", str(p)).stdout)["damaged"] == ["data/1"]
