"""Bad input gets a clear error naming the file and the record; nothing is lost."""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import zipfile

import pytest
import torch
from conftest import skip_for_privilege, tensors_equal

import tierstore
from tierstore import _archive


def _save(tmp_path: pathlib.Path, name: str = "c.pt") -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    sd = {"a": torch.randn(2000), "b": torch.arange(100), "c": torch.ones(3, 3)}
    p = tmp_path / name
    tierstore.save(sd, p)
    return p, sd


def _rewrite_zip(
    src: pathlib.Path, dst: pathlib.Path, drop: str | None = None, replace: dict[str, bytes] | None = None
) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if drop and info.filename.endswith(drop):
                continue
            data = zin.read(info.filename)
            for suffix, new in (replace or {}).items():
                if info.filename.endswith(suffix):
                    data = new
            zout.writestr(info.filename, data)


def test_missing_path(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "nope.pt"
    with pytest.raises(tierstore.NotFoundError) as ei:
        tierstore.load(p)
    assert isinstance(ei.value, FileNotFoundError)
    assert str(p) in str(ei.value)
    with pytest.raises(FileNotFoundError, match="no_dir"):
        tierstore.save({"x": torch.ones(1)}, tmp_path / "no_dir" / "x.pt")


def test_directory_instead_of_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(tierstore.DirectoryError) as ei:
        tierstore.load(tmp_path)
    assert isinstance(ei.value, IsADirectoryError) and str(tmp_path) in str(ei.value)
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(IsADirectoryError):
        tierstore.save({"x": torch.ones(1)}, d)
    assert d.is_dir()


def test_truncated_file(tmp_path: pathlib.Path, backend: str) -> None:
    p, _ = _save(tmp_path)
    data = p.read_bytes()
    for cut in (len(data) // 2, len(data) - 30, 100):
        p.write_bytes(data[:cut])
        with pytest.raises(tierstore.TruncatedFileError) as ei:
            tierstore.load(p)
        assert str(p) in str(ei.value) and "truncated" in str(ei.value)
        assert isinstance(ei.value, ValueError)


def test_flipped_byte_names_the_record(tmp_path: pathlib.Path, backend: str) -> None:
    p, _ = _save(tmp_path)
    _arch, _m, offsets = _archive.open_archive(str(p))
    data = bytearray(p.read_bytes())
    data[offsets["data/0"] + 1234] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(tierstore.ChecksumError) as ei:
        tierstore.load(p)
    assert ei.value.record == "c/data/0"
    assert "c/data/0" in str(ei.value) and str(p) in str(ei.value) and "checksum" in str(ei.value)


def test_flipped_byte_in_a_torch_written_file(tmp_path: pathlib.Path) -> None:
    sd = {"a": torch.randn(5000)}
    p = tmp_path / "t.pt"
    torch.save(sd, p)
    with zipfile.ZipFile(p) as z:
        info = z.getinfo("t/data/0")
    data = bytearray(p.read_bytes())
    # Local header: 30 bytes + name + extra, then the data.
    nlen, xlen = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + nlen + xlen + 99] ^= 0x80
    p.write_bytes(bytes(data))
    with pytest.raises(tierstore.ChecksumError, match="t/data/0"):
        tierstore.load(p)


def test_not_a_zip(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "text.pt"
    p.write_text("hello, this is not a checkpoint at all\n" * 10)
    with pytest.raises(tierstore.NotAContainerError) as ei:
        tierstore.load(p)
    assert str(p) in str(ei.value) and isinstance(ei.value, ValueError)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(tierstore.NotAContainerError):
        tierstore.load(empty)


def test_missing_records(tmp_path: pathlib.Path) -> None:
    p, _ = _save(tmp_path)
    q = tmp_path / "nopkl.pt"
    _rewrite_zip(p, q, drop="data.pkl")
    with pytest.raises(tierstore.MissingRecordError, match=r"data\.pkl"):
        tierstore.load(q)
    # A storage missing (and no manifest, as in a torch-written file).
    r = tmp_path / "nodata.pt"
    _rewrite_zip(p, tmp_path / "tmp.pt", drop="manifest.json")
    _rewrite_zip(tmp_path / "tmp.pt", r, drop="data/1")
    with pytest.raises(tierstore.MissingRecordError, match="data/1"):
        tierstore.load(r)
    # With the (now stale) manifest kept, the mismatch is reported, naming the file.
    s = tmp_path / "nodata2.pt"
    _rewrite_zip(p, s, drop="data/1")
    with pytest.raises(tierstore.ManifestError, match=r"nodata2\.pt"):
        tierstore.load(s)


def _manifest(p: pathlib.Path) -> dict:
    with zipfile.ZipFile(p) as z:
        return json.loads(z.read("c/.tierstore/manifest.json"))


@pytest.mark.parametrize(("field", "value"), [("offset", 2**62), ("size", 2**62), ("offset", 7), ("crc32", 2**40)])
def test_manifest_with_absurd_values(tmp_path: pathlib.Path, field: str, value: int) -> None:
    p, _ = _save(tmp_path)
    m = _manifest(p)
    m["records"][0][field] = value
    q = tmp_path / "bad.pt"
    _rewrite_zip(p, q, replace={"manifest.json": json.dumps(m).encode()})
    with pytest.raises(tierstore.FormatError) as ei:
        tierstore.load(q)
    assert str(q) in str(ei.value)


def test_manifest_not_json(tmp_path: pathlib.Path) -> None:
    p, _ = _save(tmp_path)
    q = tmp_path / "bad.pt"
    _rewrite_zip(p, q, replace={"manifest.json": b"{not json"})
    with pytest.raises(tierstore.ManifestError, match="manifest"):
        tierstore.load(q)


def test_directory_with_absurd_size_does_not_allocate(tmp_path: pathlib.Path) -> None:
    p, _ = _save(tmp_path)
    data = bytearray(p.read_bytes())
    eocd = data.rfind(b"PK\x05\x06")
    struct.pack_into("<I", data, eocd + 12, 0xFFFFFFF0)  # central directory size
    p.write_bytes(bytes(data))
    with pytest.raises(tierstore.FormatError):
        tierstore.load(p)


def _mount_ro(src: pathlib.Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(src)], capture_output=True, check=False)
    if r.returncode != 0:
        skip_for_privilege(f"cannot remount read-only: {r.stderr.decode().strip()}")


def test_read_only_directory(tmpfs: pathlib.Path) -> None:
    p = tmpfs / "x.pt"
    tierstore.save({"v": torch.ones(4)}, p)
    _mount_ro(tmpfs)
    with pytest.raises(tierstore.PermissionDeniedError) as ei:
        tierstore.save({"v": torch.zeros(4)}, p)
    assert isinstance(ei.value, PermissionError) and str(p) in str(ei.value)
    assert torch.equal(tierstore.load(p)["v"], torch.ones(4)), "the previous file is intact"


def test_full_disk_keeps_the_previous_file(tmpfs: pathlib.Path, backend: str) -> None:
    p = tmpfs / "x.pt"
    small = {"v": torch.arange(1000)}
    tierstore.save(small, p)
    big = {"w": torch.randn(8 << 20)}  # 32 MiB on a 16 MiB file system
    with pytest.raises(tierstore.NoSpaceError) as ei:
        tierstore.save(big, p)
    assert isinstance(ei.value, OSError) and str(p) in str(ei.value)
    assert tensors_equal(tierstore.load(p), small)
    assert sorted(x.name for x in tmpfs.iterdir()) == ["x.pt"], "no temporary file is left"


def test_torchs_runtime_error_on_a_file_handed_to_it_stays_a_runtime_error(tmp_path: pathlib.Path) -> None:
    """A legacy file is torch's to read; where torch refuses it with a
    RuntimeError (here an invalid sparse tensor), the error is one user code
    catching torch's still catches, and a TierstoreError naming the file."""
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False)
    p = tmp_path / "legacy.pt"
    torch.save({"s": bad}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError) as torch_err, pytest.warns(UserWarning, match="sparse tensor invariants"):
        torch.load(p, weights_only=True)
    with (
        pytest.raises(tierstore.TorchLoadError, match=r"legacy\.pt") as ours,
        pytest.warns(UserWarning, match="sparse tensor invariants"),
    ):
        tierstore.load(p, weights_only=True)
    assert isinstance(ours.value, RuntimeError) and isinstance(ours.value, tierstore.CorruptFileError)
    assert str(torch_err.value).split("\n")[0][:40] in str(ours.value)
