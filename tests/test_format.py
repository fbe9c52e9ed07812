"""The container: torch-compatible zip, 4096-aligned records, valid CRCs,
zip64 when needed, a manifest that follows its schema, old files still load."""

from __future__ import annotations

import json
import pathlib
import shutil
import struct
import zipfile

import jsonschema
import pytest
import torch
from conftest import tensors_equal

import tierstore
from tierstore import _archive, manifest

DATA = pathlib.Path(__file__).parent / "data"


def _data_offset(path: pathlib.Path, info: zipfile.ZipInfo) -> int:
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        h = f.read(30)
    nlen, xlen = struct.unpack_from("<HH", h, 26)
    return info.header_offset + 30 + nlen + xlen


def test_records_aligned_crcs_valid_manifest_ignored_by_torch(tmp_path: pathlib.Path) -> None:
    sd = {f"t{i}": torch.randn(i * 37 + 1) for i in range(20)}
    p = tmp_path / "f.pt"
    tierstore.save(sd, p)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None, "every CRC-32 is correct"
        names = z.namelist()
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            align = 4096 if "/data/" in info.filename else 64
            assert _data_offset(p, info) % align == 0, info.filename
        assert "f/.tierstore/manifest.json" in names
        assert {"f/data.pkl", "f/version", "f/byteorder", "f/.format_version"} <= set(names)
    assert tensors_equal(torch.load(p), sd)


def test_manifest_follows_schema_and_describes_records(tmp_path: pathlib.Path) -> None:
    sd = {"model": {"w": torch.randn(4, 5), "b": torch.zeros(5, dtype=torch.bfloat16)}}
    sd["model"]["wt"] = sd["model"]["w"].t()
    p = tmp_path / "m.pt"
    tierstore.save(sd, p)
    with zipfile.ZipFile(p) as z:
        m = json.loads(z.read("m/.tierstore/manifest.json"))
        jsonschema.validate(m, manifest.schema())
        for r in m["records"]:
            info = z.getinfo("m/" + r["name"])
            assert r["size"] == info.file_size and r["crc32"] == info.CRC
            assert r["offset"] == _data_offset(p, info)
    assert m["format"] == "tierstore" and m["format_version"] == 1 and m["alignment"] == 4096
    by_path = {tuple(t["path"]): t for t in m["tensors"]}
    assert by_path[("model", "w")]["shape"] == [4, 5]
    assert by_path[("model", "wt")]["stride"] == [1, 5]
    assert by_path[("model", "wt")]["record"] == by_path[("model", "w")]["record"]
    assert by_path[("model", "b")]["dtype"] == "bfloat16"
    storage = next(r for r in m["records"] if r["name"] == by_path[("model", "b")]["record"])
    assert storage["dtype"] == "bfloat16" and storage["numel"] == 5 and storage["codec"] == "raw"


def test_files_of_format_version_1_still_load(tmp_path: pathlib.Path) -> None:
    """A file written by tierstore 0.1.0 is kept in tests/data; it must keep loading."""
    src = DATA / "format_v1.pt"
    p = tmp_path / "format_v1.pt"
    shutil.copy(src, p)
    back = tierstore.load(p)
    assert torch.equal(back["arange"], torch.arange(10, dtype=torch.float32))
    assert back["bf16"].dtype == torch.bfloat16 and back["meta"] == {"step": 7, "name": "v1"}
    assert torch.equal(torch.load(p)["arange"], back["arange"])


def _shard_manifest(d: pathlib.Path) -> dict:
    (rank,) = d.glob("rank-*.pt")
    with zipfile.ZipFile(rank) as z:
        return json.loads(z.read(next(n for n in z.namelist() if n.endswith(manifest.MANIFEST_NAME))))


def test_sharded_checkpoints_with_crc32c_chunk_tables_still_load(tmp_path: pathlib.Path) -> None:
    """Shard files written before the chunk tables became CRC-32 over 512-byte
    chunks (tests/data/sharded_crc32c, by 0.1.0 at a0cfe34) name CRC-32C over
    4 KiB chunks: they load whole and in
    parts (every chunk a partial read touches is verified under its own
    algorithm), and a flipped byte is still caught."""
    d = tmp_path / "ck"
    shutil.copytree(DATA / "sharded_crc32c", d)
    tables = [r["chunks"] for r in _shard_manifest(d)["records"] if "chunks" in r]
    # Written before the chunks became 512 bytes: CRC-32C over 4 KiB chunks, read as the tables say.
    assert {c["algo"] for c in tables} == {"crc32c"} and {c["size"] for c in tables} == {4096}
    g = torch.Generator().manual_seed(1234)
    want_w, want_b = torch.randn(64, 96, generator=g), torch.arange(1000, dtype=torch.float64)
    w = torch.empty(64, 96)
    target = {"model": {"w": w, "b": torch.empty(1000, dtype=torch.float64)}, "step": None}
    tierstore.load_sharded(d, target)
    assert torch.equal(w, want_w) and torch.equal(target["model"]["b"], want_b) and target["step"] == 7
    # Columns 24..48 of the row-major tensor: a partial read of every chunk.
    part = tierstore.attach(torch.empty(64, 24), tierstore.Layout.shard("model.w", (64, 96), dim=1, rank=1, world=4))
    tierstore.load_sharded(d, {"model": {"w": part}})
    assert torch.equal(part, want_w[:, 24:48])
    (rank,) = d.glob("rank-*.pt")
    off = next(r for r in _shard_manifest(d)["records"] if r.get("dtype") == "float32")["offset"]
    raw = bytearray(rank.read_bytes())
    raw[off + 4 * (5 * 96 + 30)] ^= 0x10  # row 5, column 30: inside the shard read below
    rank.write_bytes(bytes(raw))
    part = tierstore.attach(torch.empty(64, 24), tierstore.Layout.shard("model.w", (64, 96), dim=1, rank=1, world=4))
    with pytest.raises(tierstore.ChecksumError, match="chunk"):
        tierstore.load_sharded(d, {"model": {"w": part}})


def test_new_chunk_tables_are_crc32_from_the_write_pass(tmp_path: pathlib.Path) -> None:
    """The chunk table names CRC-32 and holds zip's CRC-32 of every 512-byte
    chunk of each storage (the writer derives the record CRC from them)."""
    import zlib

    assert manifest.CHUNK_BYTES == 512
    x = torch.randn(3 * 1024 + 17)  # 12,356 bytes: 24 whole chunks and a short one
    tierstore.save_sharded({"x": x}, tmp_path / "ck")
    (rank,) = (tmp_path / "ck").glob("rank-*.pt")
    m = _shard_manifest(tmp_path / "ck")
    rec = next(r for r in m["records"] if "chunks" in r)
    assert rec["chunks"]["algo"] == "crc32" and rec["chunks"]["size"] == 512 and rec["chunks"]["count"] == 25
    with zipfile.ZipFile(rank) as z:
        table = z.read(next(n for n in z.namelist() if n.endswith(manifest.CHUNKS_NAME)))
        data = z.read(next(n for n in z.namelist() if n.endswith("/" + rec["name"])))
        assert zlib.crc32(data) == z.getinfo(next(n for n in z.namelist() if n.endswith("/" + rec["name"]))).CRC
    at = rec["chunks"]["at"]
    sums = struct.unpack(f"<{rec['chunks']['count']}I", table[at : at + 4 * rec["chunks"]["count"]])
    assert list(sums) == [zlib.crc32(data[i : i + 512]) for i in range(0, len(data), 512)]


def _enough(gib: int) -> bool:
    import os

    st = os.statvfs("/tmp")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return st.f_bavail * st.f_frsize > gib * 2**30 * 2 and mem > gib * 2**30 * 2


@pytest.mark.skipif(not _enough(5), reason="needs ~10 GiB of free disk and memory")
def test_zip64_for_records_over_4_gib(tmp_path: pathlib.Path) -> None:
    n = (4 << 30) + 12345
    big = torch.zeros(n, dtype=torch.uint8)
    big[-7:] = torch.arange(1, 8, dtype=torch.uint8)
    p = tmp_path / "huge.pt"
    tierstore.save({"big": big, "after": torch.arange(3)}, p)
    del big
    with zipfile.ZipFile(p) as z:
        info = z.getinfo("huge/data/0")
        assert info.file_size == n
        after = z.getinfo("huge/data/1")
        assert after.header_offset > 2**32, "a record beyond 4 GiB needs zip64 offsets"
    back = torch.load(p, mmap=True)
    assert back["big"].shape == (n,) and back["big"][-7:].tolist() == list(range(1, 8))
    assert back["after"].tolist() == [0, 1, 2]
    mine = tierstore.load(p, mmap=True, verify=False)
    assert mine["big"][-1].item() == 7 and mine["after"].tolist() == [0, 1, 2]


def test_a_damaged_zip64_end_record_is_refused_by_every_reader(tmp_path: pathlib.Path) -> None:
    """torch writes a zip64 end record into every archive, beside the plain
    one; where they disagree (a flipped bit in the zip64 record's directory
    offset), a path load, a stream load and ``tierstore verify`` refuse the
    file alike (the stream reader used to, the path reader took the plain
    record's word and verify passed)."""
    import io
    import struct

    p = tmp_path / "t.pt"
    torch.save({"w": torch.arange(10)}, p)
    raw = bytearray(p.read_bytes())
    z64 = raw.rfind(b"PK\x06\x06")
    assert z64 > 0, "torch wrote no zip64 end record"
    (cd_off,) = struct.unpack_from("<Q", raw, z64 + 48)
    assert tierstore.load(p)["w"].tolist() == list(range(10))
    raw[z64 + 54] ^= 0x08  # the directory offset's 7th byte
    p.write_bytes(bytes(raw))
    for load in (
        lambda: tierstore.load(p),
        lambda: tierstore.load(io.BytesIO(bytes(raw))),
        lambda: _archive.verify(str(p)),
    ):
        with pytest.raises(tierstore.CorruptFileError, match=r"zip64|directory"):
            load()
    assert cd_off < len(raw)
