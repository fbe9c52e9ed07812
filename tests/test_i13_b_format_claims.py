"""Claims of docs/FORMAT.md that had no test (issue 13, item 11).

Each test names the sentence it checks. Two of them were false before this
change and were fixed in the reader: TorchScript archives (which hold a
``data.pkl`` as well as ``constants.pkl``, and compressed code records) were
refused as compressed instead of being handed to ``torch.load``, and a file
object holding compressed records failed with a checksum error instead of the
``CorruptFileError`` that says so.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import _archive, _core, _metadata, manifest
from tierstore._engine import get_engine
from tierstore.checkpointer import Checkpointer, DiskTier, HostTier

# ----------------------------------------------------------------------------------------------
# helpers


def _entries(data: bytes) -> list[dict[str, int | str]]:
    """The central directory of a small (non-zip64) archive, with where each field lives."""
    eocd = data.rfind(b"PK\x05\x06")
    (n,) = struct.unpack_from("<H", data, eocd + 10)
    (cd,) = struct.unpack_from("<I", data, eocd + 16)
    out: list[dict[str, int | str]] = []
    at = cd
    for _ in range(n):
        assert data[at : at + 4] == b"PK\x01\x02"
        nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
        (hdr,) = struct.unpack_from("<I", data, at + 42)
        name = data[at + 46 : at + 46 + nlen].decode()
        lnlen, lxlen = struct.unpack_from("<HH", data, hdr + 26)
        size = struct.unpack_from("<I", data, at + 24)[0]
        out.append({"name": name, "cd": at, "hdr": hdr, "data": hdr + 30 + lnlen + lxlen, "size": size})
        at += 46 + nlen + xlen + clen
    return out


def _patch_record(path: Path, suffix: str, edit: bytes, to: bytes) -> None:
    """Replaces ``edit`` by ``to`` (same length) in the record named ``*suffix``
    and rewrites its CRC-32 in the local header and the central directory, so
    the file stays a well-formed archive whose only change is that content."""
    assert len(edit) == len(to)
    data = bytearray(path.read_bytes())
    (e,) = [e for e in _entries(bytes(data)) if str(e["name"]).endswith(suffix)]
    start, size = int(e["data"]), int(e["size"])
    body = bytes(data[start : start + size])
    assert body.count(edit) == 1, body[:200]
    body = body.replace(edit, to)
    data[start : start + size] = body
    crc = zlib.crc32(body)
    struct.pack_into("<I", data, int(e["hdr"]) + 14, crc)
    struct.pack_into("<I", data, int(e["cd"]) + 16, crc)
    path.write_bytes(bytes(data))


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(16, 8), "b": torch.arange(5)}


# ----------------------------------------------------------------------------------------------
# "format_version ... A reader refuses a newer version with a message saying so."


def test_single_file_of_a_newer_format_version_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "new.pt"
    tierstore.save(_state(), p)
    _patch_record(p, "/.tierstore/manifest.json", b'"format_version":1', b'"format_version":2')
    loads = (
        lambda: tierstore.load(p),
        lambda: tierstore.load(p, mmap=True),
        lambda: tierstore.load(io.BytesIO(p.read_bytes())),
        lambda: _archive.verify(str(p)),
    )
    for load in loads:
        with pytest.raises(tierstore.ManifestError, match=r"format_version 2 is newer than this tierstore understands"):
            load()
    # the same file with its own version loads, and torch (which ignores the manifest) opens the newer one
    assert torch.equal(torch.load(p)["b"], torch.arange(5))
    _patch_record(p, "/.tierstore/manifest.json", b'"format_version":2', b'"format_version":1')
    assert torch.equal(tierstore.load(p)["b"], torch.arange(5))


def _reseal(d: Path, **change: object) -> None:
    mp = d / "manifest.json"
    m, _ = _metadata.loads(mp.read_bytes(), str(mp), required=True)
    m.update(change)
    mp.write_bytes(_metadata.dumps(m))


def test_sharded_checkpoint_of_a_newer_format_version_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tierstore.save_sharded(_state(), d)
    _reseal(d, format_version=4)  # a valid checksum: only the version is new
    target = {"w": torch.empty(16, 8), "b": torch.empty(5, dtype=torch.int64)}
    with pytest.raises(tierstore.ManifestError, match=r"format_version 4 is newer than this tierstore understands"):
        tierstore.load_sharded(d, target)
    _reseal(d, format_version=3)
    tierstore.load_sharded(d, target)
    assert torch.equal(target["b"], torch.arange(5))


# ----------------------------------------------------------------------------------------------
# "Compressed records are refused (CorruptFileError): neither torch nor tierstore writes them."


def _deflate_all(src: Path, dst: Path, only: str | None = None) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if only is None or info.filename.endswith(only) else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info.filename), compress_type=method)


@pytest.mark.parametrize("writer", ["torch", "tierstore"])
@pytest.mark.parametrize("only", [None, "data.pkl", "data/0"])
def test_compressed_records_are_refused(tmp_path: Path, writer: str, only: str | None) -> None:
    src = tmp_path / "plain.pt"
    (torch.save if writer == "torch" else tierstore.save)(_state(), src)
    p = tmp_path / "deflated.pt"
    _deflate_all(src, p, only)
    with zipfile.ZipFile(p) as z:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    loads = {
        "path": lambda: tierstore.load(p),
        "path, verify=False": lambda: tierstore.load(p, verify=False),
        "mmap": lambda: tierstore.load(p, mmap=True),
        "file object": lambda: tierstore.load(io.BytesIO(p.read_bytes())),
        "file object, verify=False": lambda: tierstore.load(io.BytesIO(p.read_bytes()), verify=False),
        "verify": lambda: _archive.verify(str(p)),
    }
    for how, load in loads.items():
        with pytest.raises(tierstore.CorruptFileError, match=r"is compressed \(method 8\)") as ei:
            load()
        assert str(p) in str(ei.value) or how.startswith("file object"), how


# ----------------------------------------------------------------------------------------------
# "TorchScript archives (constants.pkl) are handed to torch.load, which dispatches them to torch.jit.load."


@pytest.fixture
def scripted(tmp_path: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    p = tmp_path / "script.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated
        torch.jit.save(torch.jit.script(lin), str(p))
    x = torch.randn(4, 3)
    return p, x, lin(x).detach()


def test_torchscript_archives_are_handed_to_torch(scripted: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    p, x, want = scripted
    with zipfile.ZipFile(p) as z:
        names = {n.split("/", 1)[1] for n in z.namelist()}
        assert {"constants.pkl", "data.pkl"} <= names  # what a real TorchScript archive holds
        assert any(i.compress_type != zipfile.ZIP_STORED for i in z.infolist())
    for src in (p, io.BytesIO(p.read_bytes())):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            m = tierstore.load(src, weights_only=False)
        assert isinstance(m, torch.jit.ScriptModule), type(m)
        assert torch.equal(m(x), want)
        assert any("TorchScript archive" in str(w.message) for w in seen), "torch.load's dispatch warning"


def test_torchscript_with_weights_only_is_refused_as_torch_refuses(
    scripted: tuple[Path, torch.Tensor, torch.Tensor],
) -> None:
    p, _x, _want = scripted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="weights_only"):
            torch.load(p, weights_only=True)
        for src in (p, io.BytesIO(p.read_bytes())):
            with pytest.raises(tierstore.UnsafeObjectError, match="TorchScript"):
                tierstore.load(src)


# ----------------------------------------------------------------------------------------------
# "Zip64 end-of-central-directory record ... and locator ... are written when there are 65 535
# records or more ...; then the classic end record holds FFFF/FFFFFFFF in those fields."


def _end_records(data: bytes) -> tuple[bool, int, int]:
    """(zip64 end records present and consistent, classic entry count, zip64 entry count or -1)."""
    eocd = data.rfind(b"PK\x05\x06")
    assert eocd == len(data) - 22, "no comment after the end record"
    n16, cd_size, cd_off = struct.unpack_from("<HII", data, eocd + 10)
    loc = eocd - 20
    if data[loc : loc + 4] != b"PK\x06\x07":
        return False, n16, -1
    (z64_off,) = struct.unpack_from("<Q", data, loc + 8)
    assert data[z64_off : z64_off + 4] == b"PK\x06\x06"
    n_disk, n_total, _size, _off = struct.unpack_from("<QQQQ", data, z64_off + 24)
    assert n_disk == n_total
    assert (cd_size, cd_off) == (0xFFFFFFFF, 0xFFFFFFFF)
    return True, n16, n_total


@pytest.mark.parametrize(("records", "zip64"), [(65_534, False), (65_535, True), (65_536, True)])
def test_zip64_end_records_from_65535_records(tmp_path: Path, records: int, zip64: bool) -> None:
    # The writer the saves use, fed tiny records directly: the boundary is cheap to hit exactly.
    p = tmp_path / "w.pt"
    w = _core.create_writer(get_engine(), p, align=64, durable=False)
    for i in range(records - 2):
        w.add_bytes(f"w/data/{i}", b"x", 64)
    w.add_bytes("w/data.pkl", b"\x80\x02N.", 64)
    w.add_bytes("w/version", b"3\n", 64)
    w.commit()
    has64, n16, n64 = _end_records(p.read_bytes())
    assert has64 == zip64
    assert n16 == (0xFFFF if zip64 else records) and n64 == (records if zip64 else -1)
    with zipfile.ZipFile(p) as z:
        assert len(z.infolist()) == records
    assert len(torch._C.PyTorchFileReader(str(p)).get_all_records()) == records
    assert tierstore.load(p) is None and torch.load(p) is None


def test_a_save_of_70000_tensors_is_zip64_and_opens_everywhere(tmp_path: Path) -> None:
    n = 70_000
    sd = {f"t{i}": torch.tensor([i], dtype=torch.int32) for i in range(n)}
    p = tmp_path / "many.pt"
    tierstore.save(sd, p, align=64, durable=False)  # 64-byte alignment: 34 MB instead of 290
    has64, n16, n64 = _end_records(p.read_bytes())
    records = n + 7  # data.pkl, .format_version, .storage_alignment, byteorder, version, serialization_id, manifest
    assert has64 and n16 == 0xFFFF and n64 == records
    with zipfile.ZipFile(p) as z:
        assert len(z.infolist()) == records
        assert z.read("many/data/69999") == struct.pack("<i", 69999)
    reader = torch._C.PyTorchFileReader(str(p))  # torch's own zip reader
    assert len(reader.get_all_records()) == records
    assert reader.get_record("data/69999") == struct.pack("<i", 69999)
    back = tierstore.load(p)
    assert len(back) == n and all(back[f"t{i}"].item() == i for i in (0, 1, 65_534, 65_535, n - 1))
    assert _archive.verify(str(p))[0] == records


# ----------------------------------------------------------------------------------------------
# "a manifest larger than 1 GiB is refused before it is read"


def _zip_with_huge_manifest(p: Path, manifest_size: int) -> None:
    """A stored archive whose manifest record is ``manifest_size`` bytes of a
    sparse hole (nothing of it is on disk), with correct sizes everywhere."""
    small = [("h/data.pkl", b"\x80\x02N."), ("h/version", b"3\n")]
    with open(p, "wb") as f:
        cd = b""
        for name, data in [*small, ("h/.tierstore/manifest.json", None)]:
            off = f.tell()
            size = len(data) if data is not None else manifest_size
            crc = zlib.crc32(data) if data is not None else 0
            nb = name.encode()
            f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, size, size, len(nb), 0) + nb)
            if data is not None:
                f.write(data)
            else:
                f.seek(size, os.SEEK_CUR)  # the hole
            cd += struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 0x031E, 20, 0, 0, 0, 0x21, crc, size, size, len(nb), 0, 0, 0, 0,
                0o100644 << 16, off,
            ) + nb  # fmt: skip
        cd_off = f.tell()
        f.write(cd)
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 3, 3, len(cd), cd_off, 0))


def test_a_manifest_over_1_gib_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert manifest.MAX_MANIFEST_BYTES == 1 << 30
    p = tmp_path / "huge.pt"
    _zip_with_huge_manifest(p, (1 << 30) + 1)
    assert p.stat().st_size > 1 << 30 and p.stat().st_blocks * 512 < 1 << 20, "sparse"
    with zipfile.ZipFile(p) as z:
        assert z.getinfo("h/.tierstore/manifest.json").file_size == (1 << 30) + 1

    reads: list[int] = []
    real = _archive.load_small

    def small_reads_only(path: str, offset: int, size: int, what: str) -> bytes:
        reads.append(size)
        if size > 1 << 20:
            raise AssertionError(f"read {size} bytes of {what}")
        return real(path, offset, size, what)

    monkeypatch.setattr(_archive, "load_small", small_reads_only)
    for load in (tierstore.load, lambda q: _archive.verify(str(q))):
        with pytest.raises(tierstore.ManifestError, match=r"manifest\.json': absurd size 1073741825") as ei:
            load(p)
        assert str(p) in str(ei.value)
    assert all(r <= 1 << 20 for r in reads), reads


def test_a_manifest_of_1_gib_exactly_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The limit is inclusive: 1 GiB is not refused for its size (it is read, and here its CRC fails).
    p = tmp_path / "edge.pt"
    _zip_with_huge_manifest(p, 1 << 30)
    asked: list[int] = []
    real = _archive.load_small

    def record(path: str, offset: int, size: int, what: str) -> bytes:
        asked.append(size)
        if size >= 1 << 30:
            raise tierstore.ChecksumError("stopped before reading 1 GiB", path=path)
        return real(path, offset, size, what)

    monkeypatch.setattr(_archive, "load_small", record)
    with pytest.raises(tierstore.ChecksumError, match="stopped before"):
        tierstore.load(p)
    assert asked[-1] == 1 << 30


# ----------------------------------------------------------------------------------------------
# "files of other save ids are removed after the commit"


def test_files_of_other_save_ids_are_removed_after_the_commit(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tierstore.save_sharded({**_state(), "step": 1}, d)
    first = json.loads((d / "manifest.json").read_bytes())["save_id"]
    old = sorted(f.name for f in d.iterdir() if f".{first}." in f.name)
    assert any(n.startswith("rank-") for n in old) and any(n.startswith("objects-") for n in old), old
    # what a crashed save of a third id leaves, and files that are not the checkpoint's
    (d / "rank-00003.0123456789ab.pt").write_bytes(b"partial")
    (d / "objects-00001.0123456789ab.pt").write_bytes(b"partial")
    keep = ["notes.txt", "rank-00000.pt.bak", "checkpoint.json"]
    for k in keep:
        (d / k).write_text("user file")
    tierstore.save_sharded({**_state(), "step": 2}, d)
    second = json.loads((d / "manifest.json").read_bytes())["save_id"]
    assert second != first
    names = sorted(f.name for f in d.iterdir())
    assert not [n for n in names if f".{first}." in n or ".0123456789ab." in n], names
    assert [n for n in names if n.startswith(("rank-", "objects-")) and n.endswith(".pt")] == sorted(
        n.replace(first, second) for n in old
    )
    assert set(keep) <= set(names)
    t = {"w": torch.empty(16, 8), "b": torch.empty(5, dtype=torch.int64), "step": None}
    tierstore.load_sharded(d, t)
    assert t["step"] == 2


# ----------------------------------------------------------------------------------------------
# "A step directory without manifest.json is incomplete ... and is never loaded; the retention
# pass removes such directories once a newer complete checkpoint exists on that tier."


def _step(root: Path, s: int) -> Path:
    return root / "local" / f"step-{s:012d}"


def _eventually(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    """The retention pass runs on the flush thread just after a checkpoint is reported durable."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_incomplete_step_directories_are_never_loaded_and_are_cleaned_up(tmp_path: Path) -> None:
    tiers = [HostTier("16MiB"), DiskTier("local", keep_last=5)]
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        for s in (5, 7):
            ck.save(s, {"w": torch.full((1000,), float(s)), "step": s}).wait()
    # A crash before the commit: the files of step 7 are there, its manifest.json is not
    # (the commit point is written last), and step 9 died after its first file.
    (_step(tmp_path, 7) / "manifest.json").unlink()
    nine = _step(tmp_path, 9)
    nine.mkdir()
    src = next(_step(tmp_path, 5).glob("rank-00000.*.pt"))
    (nine / src.name).write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        assert [c["step"] for c in ck.checkpoints()] == [5]
        got = ck.load_latest()
        assert got["step"] == 5 and torch.equal(got["w"], torch.full((1000,), 5.0))
        # steps 7 and 9 stay until a newer complete checkpoint exists on the tier
        assert _step(tmp_path, 7).is_dir() and nine.is_dir()
        ck.save(8, {"w": torch.full((1000,), 8.0), "step": 8}).wait()
        # the retention pass after step 8: step 7 (older, incomplete) is removed, step 9 (newer) kept
        assert _eventually(lambda: not _step(tmp_path, 7).exists()), "incomplete step 7 not removed"
        assert nine.is_dir() and _step(tmp_path, 5).is_dir()
        ck.save(10, {"w": torch.full((1000,), 10.0), "step": 10}).wait()
        assert _eventually(lambda: not nine.exists()), "incomplete step 9 not removed"
        assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [f"step-{s:012d}" for s in (5, 8, 10)]
        assert ck.load_latest()["step"] == 10
