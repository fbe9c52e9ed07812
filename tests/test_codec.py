"""Compressed and delta files (issue 18, first part): ``tierstore.save(...,
codec="zstd" | tierstore.Delta(base=...))``, transparent and bit-exact loads,
``torch.load`` refusing them clearly, ``tierstore convert --plain``, and
damage (a chunk, a reference) reported by file, record and chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore
import tierstore.cli
from tierstore import _core, codec

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()) if t.numel() else b""


def _same(a: object, b: object) -> None:
    """Bit-exact equality of nested tensors (NaN payloads and signed zeros included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _bits(a) == _bits(b)
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
        return
    assert a == b


def _special_floats(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values with NaN payloads, infinities, denormals, signed zeros and noise."""
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).clone()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float32)
        k = min(n, 5)
        t[:k] = specials[:k].to(dtype)
        if dtype == torch.float32:
            t.view(torch.int32)[5:8] = torch.tensor([0x7FC00001, 0x7F800123, 0x00000001], dtype=torch.int32)[
                : max(0, min(3, n - 5))
            ]
    return t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    n = 100_000
    if dtype.is_floating_point and dtype.itemsize >= 2:
        t = _special_floats(n, dtype, 1)
    elif dtype == torch.bool:
        t = torch.rand(n) > 0.5
    elif dtype.is_complex:
        t = torch.randn(n, dtype=dtype)
    else:
        t = (
            torch.randint(0, 100, (n,), dtype=torch.int64).to(dtype)
            if dtype != torch.uint8
            else torch.randint(0, 255, (n,), dtype=torch.uint8)
        )
    sd = {"t": t, "view": t[10:20], "small": t[:7].clone()}
    p = tmp_path / "z.pt"
    tierstore.save(sd, p, codec="zstd")
    _same(tierstore.load(p), sd)
    base = tmp_path / "base.pt"
    tierstore.save(sd, base)
    nt = t.clone()
    nt.view(torch.uint8)[::97] ^= 1
    nudged = {"t": nt, "view": nt[10:20], "small": sd["small"]}
    d = tmp_path / "d.pt"
    tierstore.save(nudged, d, codec=tierstore.Delta(base=base))
    got = tierstore.load(d)
    _same(got, nudged)
    # The view still shares its storage with the tensor it views.
    assert got["view"].untyped_storage().data_ptr() == got["t"].untyped_storage().data_ptr()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]),
    n=st.integers(0, 70_000),
    seed=st.integers(0, 2**31),
    flips=st.integers(0, 50),
    transform=st.sampled_from([None, "isub", "xor", "none"]),
)
def test_property_round_trips(
    tmp_path: Path, dtype: torch.dtype, n: int, seed: int, flips: int, transform: str | None
) -> None:
    a = _special_floats(n, dtype, seed)
    b = a.clone()
    if n:
        g = torch.Generator().manual_seed(seed + 1)
        idx = torch.randint(0, b.numel() * b.element_size(), (flips,), generator=g)
        b.view(torch.uint8)[idx] ^= 0x10
    base, out = tmp_path / f"b{seed}.pt", tmp_path / f"d{seed}.pt"
    tierstore.save({"x": a}, base)
    tierstore.save({"x": b}, out, codec=tierstore.Delta(base=base, transform=transform))
    _same(tierstore.load(out)["x"], b)
    # Never larger than the input by more than 0.1% (plus the fixed records of a file).
    plain = tmp_path / f"p{seed}.pt"
    tierstore.save({"x": b}, plain)
    assert os.path.getsize(out) <= os.path.getsize(plain) * 1.001 + 4096


def _training_like(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256)

    def state() -> dict[str, torch.Tensor]:
        sd = {f"w.{k}": v.clone() for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            sd[f"m1.{i}"] = s["exp_avg"].clone()
            sd[f"m2.{i}"] = s["exp_avg_sq"].clone()
        return sd

    for _ in range(10):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    a = state()
    for _ in range(10):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return a, state()


def test_delta_of_a_training_step_is_smaller_than_plain_zstd(tmp_path: Path) -> None:
    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "b.pt")
    tierstore.save(b, tmp_path / "bz.pt", codec="zstd")
    tierstore.save(b, tmp_path / "bd.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    raw, z, d = (os.path.getsize(tmp_path / n) for n in ("b.pt", "bz.pt", "bd.pt"))
    assert d < z < raw, (raw, z, d)
    _same(tierstore.load(tmp_path / "bd.pt"), b)
    m = _manifest(tmp_path / "bd.pt")
    encoded = [r for r in m["records"] if r.get("codec") == codec.CODEC]
    assert encoded and all(r["delta_base"]["file"] == "a.pt" for r in encoded)
    assert {r["transform"] for r in encoded} <= {"isub", "xor", "none"}


def test_identical_chunks_cost_nothing(tmp_path: Path) -> None:
    frozen = torch.randn(1 << 20)  # 4 MiB: four chunks, none compressible on its own
    tierstore.save({"f": frozen}, tmp_path / "a.pt")
    tierstore.save({"f": frozen}, tmp_path / "b.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    rec = next(r for r in _manifest(tmp_path / "b.pt")["records"] if r.get("codec"))
    assert rec["chunk_kinds"]["same"] == 4
    assert rec["size"] < 1024
    rep = torch.cat([frozen[:262144]] * 4)  # one chunk four times over
    tierstore.save({"r": rep}, tmp_path / "r.pt", codec="zstd")
    rec = next(r for r in _manifest(tmp_path / "r.pt")["records"] if r.get("codec"))
    assert rec["chunk_kinds"]["dup"] == 3
    _same(tierstore.load(tmp_path / "r.pt"), {"r": rep})


def test_a_chain_of_coded_files_decodes_in_one_pass_or_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delta whose base is coded too (a zstd keyframe, a delta against
    it) decodes chunk by chunk down the chain, never the base whole; a base
    that copies its own chunks is decoded whole instead; both bit-exact,
    and damage to the base is named either way."""
    g = torch.Generator().manual_seed(11)
    k = torch.randn(3 << 18, generator=g)  # 3 MiB
    mid = k + 1e-4 * torch.randn(3 << 18, generator=g)
    top = mid + 1e-4 * torch.randn(3 << 18, generator=g)
    tierstore.save({"w": k}, tmp_path / "k.pt", codec="zstd")
    tierstore.save({"w": mid}, tmp_path / "m.pt", codec=tierstore.Delta(base=tmp_path / "k.pt"))
    tierstore.save({"w": top}, tmp_path / "t.pt", codec=tierstore.Delta(base=tmp_path / "m.pt"))
    calls: list[tuple[int, bool]] = []
    real = codec._core.codec_decode_chain

    def spy(srcs: Any, *a: Any, **kw: Any) -> bool:
        got = real(srcs, *a, **kw)
        calls.append((len(srcs), got))
        return got

    monkeypatch.setattr(codec._core, "codec_decode_chain", spy)
    _same(tierstore.load(tmp_path / "t.pt"), {"w": top})
    assert calls == [(3, True)]
    # A keyframe whose record copies its own chunks: the chain declines, the base is decoded whole.
    rep = torch.cat([k[:262144]] * 3)
    tierstore.save({"w": rep}, tmp_path / "k.pt", codec="zstd")
    near = rep + 1e-4 * torch.randn(3 << 18, generator=g)
    tierstore.save({"w": near}, tmp_path / "n.pt", codec=tierstore.Delta(base=tmp_path / "k.pt"))
    calls.clear()
    _same(tierstore.load(tmp_path / "n.pt"), {"w": near})
    assert calls == [(2, False)]
    # Damage inside the keyframe's coded record: named (its file and record).
    tierstore.save({"w": k}, tmp_path / "k.pt", codec="zstd")
    tierstore.save({"w": mid}, tmp_path / "m.pt", codec=tierstore.Delta(base=tmp_path / "k.pt"))
    rec = next(r for r in _manifest(tmp_path / "k.pt")["records"] if r.get("codec"))
    data = bytearray((tmp_path / "k.pt").read_bytes())
    data[rec["offset"] + rec["size"] // 2] ^= 0x20
    (tmp_path / "k.pt").write_bytes(bytes(data))
    for verify in (True, False):  # the stored CRC-32; without it, the codec's chunk checksum
        with pytest.raises(tierstore.TierstoreError, match=r"k\.pt: record '[^']*data/0'") as e:
            tierstore.load(tmp_path / "m.pt", verify=verify)
        assert e.value.path == str(tmp_path / "k.pt")


def test_several_bases_each_storage_takes_the_one_it_is_closest_to(tmp_path: Path) -> None:
    """``Delta(base=[pretrained, previous])``: the reference is chosen per
    storage by trial on a sample; each record names its own base; bases
    outside the directory are named at load time as a list."""
    g = torch.Generator().manual_seed(7)
    pre = {"a": torch.randn(200_000, generator=g), "b": torch.randn(200_000, generator=g)}
    prev = {"a": torch.randn(200_000, generator=g), "b": pre["b"] + 0.5 * torch.randn(200_000, generator=g)}
    cur = {
        "a": pre["a"] + 1e-5 * torch.randn(200_000, generator=g),
        "b": prev["b"] + 1e-5 * torch.randn(200_000, generator=g),
    }
    (tmp_path / "bases").mkdir()
    (tmp_path / "run").mkdir()
    tierstore.save(pre, tmp_path / "bases" / "pre.pt")
    tierstore.save(prev, tmp_path / "bases" / "prev.pt")
    both = [tmp_path / "bases" / "pre.pt", tmp_path / "bases" / "prev.pt"]
    tierstore.save(cur, tmp_path / "run" / "cur.pt", codec=tierstore.Delta(base=both))
    m = _manifest(tmp_path / "run" / "cur.pt")
    by_tensor = {t["path"][-1]: t["record"] for t in m["tensors"]}
    recs = {r["name"]: r for r in m["records"]}
    assert recs[by_tensor["a"]]["delta_base"]["file"].endswith("pre.pt")
    assert recs[by_tensor["b"]]["delta_base"]["file"].endswith("prev.pt")
    # Each base alone would do worse than the choice per storage.
    tierstore.save(cur, tmp_path / "run" / "pre_only.pt", codec=tierstore.Delta(base=both[0]))
    tierstore.save(cur, tmp_path / "run" / "prev_only.pt", codec=tierstore.Delta(base=both[1]))
    size = {n: os.path.getsize(tmp_path / "run" / n) for n in ("cur.pt", "pre_only.pt", "prev_only.pt")}
    assert size["cur.pt"] < min(size["pre_only.pt"], size["prev_only.pt"]), size
    with pytest.raises(tierstore.CorruptFileError, match="outside the file's directory"):
        tierstore.load(tmp_path / "run" / "cur.pt")
    _same(tierstore.load(tmp_path / "run" / "cur.pt", delta_base=both), cur)
    with pytest.raises(tierstore.InvalidArgumentError, match="names 0 files of that name"):
        tierstore.load(tmp_path / "run" / "cur.pt", delta_base=[both[0]])
    with pytest.raises(tierstore.InvalidArgumentError, match="at least one base"):
        tierstore.save(cur, tmp_path / "x.pt", codec=tierstore.Delta(base=[]))
    with pytest.raises(tierstore.InvalidArgumentError, match="no such file"):
        tierstore.save(cur, tmp_path / "x.pt", codec=tierstore.Delta(base=[both[0], tmp_path / "nope.pt"]))


def test_verify_of_a_delta_checks_the_base_records_it_needs(tmp_path: Path) -> None:
    """``tierstore verify`` of a delta file reads and checks the records of
    its base that a load reads (found by the fuzz campaign: with the base
    damaged where the delta's chunks need no reference bytes, all zero
    here, verify said OK while every load failed on the base's CRC-32)."""
    g = torch.Generator().manual_seed(2)
    tierstore.save({"z": torch.randn(300_000, generator=g)}, tmp_path / "a.pt")
    tierstore.save({"z": torch.zeros(300_000)}, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    assert any(r.get("delta_base") for r in _manifest(tmp_path / "d.pt")["records"])  # a delta of zero chunks
    assert tierstore.cli.main(["verify", str(tmp_path / "d.pt")]) == 0
    rec = max(
        (r for r in _manifest(tmp_path / "a.pt")["records"] if r.get("kind") == "storage"), key=lambda r: r["size"]
    )
    data = bytearray((tmp_path / "a.pt").read_bytes())
    data[rec["offset"] + rec["size"] // 3] ^= 0x01
    (tmp_path / "a.pt").write_bytes(bytes(data))
    with pytest.raises(tierstore.ChecksumError, match=r"a\.pt: record"):
        tierstore.load(tmp_path / "d.pt")
    assert tierstore.cli.main(["verify", str(tmp_path / "d.pt")]) == 1


def test_a_compressed_save_writes_each_batch_while_the_next_is_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storages are encoded in batches, each written while the next is
    encoded; the records keep their order and the file loads bit-exact."""
    from tierstore import api

    g = torch.Generator().manual_seed(4)
    state = {f"t{i}": torch.randn(40_000, generator=g) for i in range(9)}
    state["empty"] = torch.zeros(0)
    state["small"] = torch.arange(10)
    calls: list[str] = []
    real = api._core.create_writer

    def spy(*a: Any, **kw: Any) -> Any:
        w = real(*a, **kw)

        class W:
            def __getattr__(self, name: str) -> Any:
                f = getattr(w, name)
                if name in ("start_data", "write_data"):
                    calls.append(name)
                return f

        return W()

    monkeypatch.setattr(api._core, "create_writer", spy)
    monkeypatch.setattr(api, "_ENCODE_BATCH", 300_000)  # about two storages per batch
    tierstore.save(state, tmp_path / "a.pt", codec="zstd")
    assert calls.count("start_data") >= 4, calls
    _same(tierstore.load(tmp_path / "a.pt"), state)
    recs = [r for r in _manifest(tmp_path / "a.pt")["records"] if r["name"].startswith("data/")]
    assert [r["offset"] for r in recs] == sorted(r["offset"] for r in recs)
    assert tierstore.cli.main(["verify", str(tmp_path / "a.pt")]) == 0
    calls.clear()
    tierstore.save({"x": 1}, tmp_path / "b.pt", codec="zstd")  # no storage at all
    assert tierstore.load(tmp_path / "b.pt") == {"x": 1}


def _manifest(p: Path) -> dict:
    with zipfile.ZipFile(p) as z:
        name = next(n for n in z.namelist() if n.endswith(".tierstore/manifest.json"))
        return json.loads(z.read(name))


def test_torch_load_refuses_a_compressed_file_clearly(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    tierstore.save({"w": torch.randn(100_000)}, p, codec="zstd")
    with pytest.raises(Exception, match="tierstore_compressed_file"):
        torch.load(p)
    with pytest.raises(tierstore.CompressedFileError, match=r"tierstore-compressed.*convert --plain"):
        torch.load(p, weights_only=False)


def test_convert_plain_gives_a_file_torch_loads(tmp_path: Path) -> None:
    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "convert", "--plain", str(tmp_path / "d.pt"), str(tmp_path / "p.pt")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    _same(torch.load(tmp_path / "p.pt"), b)
    _same(tierstore.load(tmp_path / "p.pt"), b)


def _embedding_adam(steps: int, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """AdamW state of an embedding before and after ``steps`` steps in which
    only ``rows`` of its 2,000 rows see a gradient: the other rows' moments
    only decay, by beta1**steps and beta2**steps."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(2000, 64)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3)

    def run(k: int, high: int) -> None:
        for _ in range(k):
            emb(torch.randint(0, high, (256,))).square().mean().backward()
            opt.step()
            opt.zero_grad()

    def state() -> dict[str, torch.Tensor]:
        s = opt.state_dict()["state"][0]
        return {"w": emb.weight.detach().clone(), "m1": s["exp_avg"].clone(), "m2": s["exp_avg_sq"].clone()}

    run(5, 2000)
    a = state()
    run(steps, rows)
    return a, state()


def test_decaying_optimizer_state_is_predicted_with_its_scale(tmp_path: Path) -> None:
    a, b = _embedding_adam(10, 40)
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    tierstore.save(b, tmp_path / "i.pt", codec=tierstore.Delta(base=tmp_path / "a.pt", transform="isub"))
    _same(tierstore.load(tmp_path / "d.pt"), b)
    _same(tierstore.load(tmp_path / "i.pt"), b)
    m = _manifest(tmp_path / "d.pt")
    transforms = [r["transform"] for r in m["records"] if r.get("codec") == codec.CODEC]
    assert transforms.count("scaled") >= 2, transforms  # both moments
    sized = {n: os.path.getsize(tmp_path / n) for n in ("d.pt", "i.pt")}
    assert sized["d.pt"] < 0.8 * sized["i.pt"], sized
    # Asked for where there is nothing to scale: plain isub, still exact.
    tierstore.save(b, tmp_path / "s.pt", codec=tierstore.Delta(base=tmp_path / "a.pt", transform="scaled"))
    _same(tierstore.load(tmp_path / "s.pt"), b)
    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "inspect", str(tmp_path / "d.pt")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "scaled" in r.stdout


def test_inspect_shows_codec_transform_reference_and_ratio(tmp_path: Path) -> None:
    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    r = subprocess.run(
        [sys.executable, "-m", "tierstore", "inspect", str(tmp_path / "d.pt")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "tsz1" in r.stdout and "a.pt" in r.stdout and "x" in r.stdout
    assert any(t in r.stdout for t in ("isub", "xor"))


def test_a_damaged_chunk_names_file_record_and_chunk(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    tierstore.save({"w": torch.randn(600_000)}, p, codec="zstd")
    m = _manifest(p)
    rec = next(r for r in m["records"] if r.get("codec"))
    with open(p, "r+b") as f:
        f.seek(rec["offset"] + rec["size"] - 100)
        b = f.read(1)
        f.seek(rec["offset"] + rec["size"] - 100)
        f.write(bytes([b[0] ^ 0x20]))
    with pytest.raises(tierstore.ChecksumError, match=rf"c\.pt: record '.*{rec['name']}'"):
        tierstore.load(p)
    # With the record's CRC not checked, the codec's own chunk checksum still catches it.
    with pytest.raises(tierstore.FormatError, match=r"chunk \d+"):
        tierstore.load(p, verify=False)


def test_reference_that_changed_or_is_gone_is_refused_by_name(tmp_path: Path) -> None:
    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    tierstore.save(b, tmp_path / "a.pt")  # the base replaced by other bytes
    with pytest.raises(tierstore.CorruptFileError, match=r"d\.pt: record '.*' is a delta against record .*a\.pt"):
        tierstore.load(tmp_path / "d.pt")
    os.unlink(tmp_path / "a.pt")
    with pytest.raises(tierstore.MissingRecordError, match=r"a\.pt, which does not exist"):
        tierstore.load(tmp_path / "d.pt")


def test_a_reference_outside_the_directory_needs_the_caller_to_name_it(tmp_path: Path) -> None:
    a, b = _training_like()
    (tmp_path / "base").mkdir()
    (tmp_path / "run").mkdir()
    tierstore.save(a, tmp_path / "base" / "a.pt")
    tierstore.save(b, tmp_path / "run" / "d.pt", codec=tierstore.Delta(base=tmp_path / "base" / "a.pt"))
    with pytest.raises(tierstore.CorruptFileError, match="outside the file's directory"):
        tierstore.load(tmp_path / "run" / "d.pt")
    _same(tierstore.load(tmp_path / "run" / "d.pt", delta_base=tmp_path / "base" / "a.pt"), b)


def test_unknown_codec_is_refused_by_name(tmp_path: Path) -> None:
    import zlib

    p = tmp_path / "c.pt"
    tierstore.save({"w": torch.randn(100_000)}, p, codec="zstd")
    data = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("manifest.json"))
    head = info.header_offset
    start = (
        head
        + 30
        + int.from_bytes(data[head + 26 : head + 28], "little")
        + int.from_bytes(data[head + 28 : head + 30], "little")
    )
    body = bytes(data[start : start + info.compress_size])
    assert body.count(b'"codec":"tsz1","pickle"') == 1
    body = body.replace(b'"codec":"tsz1","pickle"', b'"codec":"tsz9","pickle"')
    data[start : start + len(body)] = body
    crc = zlib.crc32(body).to_bytes(4, "little")
    data[head + 14 : head + 18] = crc  # the local header's CRC-32
    cd = data.find(b"PK\x01\x02")
    while int.from_bytes(data[cd + 42 : cd + 46], "little") != head:  # its directory entry
        cd = data.find(b"PK\x01\x02", cd + 4)
        assert cd > 0
    data[cd + 16 : cd + 20] = crc
    (tmp_path / "u.pt").write_bytes(bytes(data))
    with pytest.raises(tierstore.CorruptFileError, match="codec 'tsz9'"):
        tierstore.load(tmp_path / "u.pt")


def test_codec_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(tierstore.InvalidArgumentError):
        tierstore.save({"w": torch.zeros(3)}, tmp_path / "x.pt", codec="lz77")
    with pytest.raises(tierstore.InvalidArgumentError):
        tierstore.Delta(keyframe_every=0)
    with pytest.raises(tierstore.InvalidArgumentError):
        tierstore.save({"w": torch.zeros(3)}, tmp_path / "x.pt", codec=tierstore.Delta(base=tmp_path / "none.pt"))


def test_hostile_streams_are_refused_without_reading_past_them() -> None:
    src = torch.randn(300_000)
    enc, _t, _s = _core.codec_encode(src.data_ptr(), src.numel() * 4, 4)
    buf = torch.frombuffer(bytearray(enc), dtype=torch.uint8)
    out = torch.empty(src.numel() * 4, dtype=torch.uint8)
    for cut in (0, 16, 40, len(enc) // 2):
        with pytest.raises(tierstore.FormatError):
            _core.codec_decode(buf.data_ptr(), cut, out.data_ptr(), out.numel())
    bad = bytearray(enc)
    bad[12:16] = (10**6).to_bytes(4, "little")  # chunk count no decoded length fits
    b2 = torch.frombuffer(bad, dtype=torch.uint8)
    with pytest.raises(tierstore.FormatError):
        _core.codec_decode(b2.data_ptr(), len(bad), out.data_ptr(), out.numel())
    bad = bytearray(enc)
    bad[32 + 8 : 32 + 16] = (2**62).to_bytes(8, "little")  # a payload offset far outside
    b3 = torch.frombuffer(bad, dtype=torch.uint8)
    with pytest.raises(tierstore.FormatError, match="outside"):
        _core.codec_decode(b3.data_ptr(), len(bad), out.data_ptr(), out.numel())


def test_manifest_of_a_delta_file_follows_the_schema(tmp_path: Path) -> None:
    import jsonschema

    from tierstore import manifest

    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt"))
    m = _manifest(tmp_path / "d.pt")
    jsonschema.validate(m, manifest.schema("manifest"))
    assert m["codec"] == codec.CODEC and m["pickle"] == codec.PICKLE_NAME
    kinds = {r["name"]: r["kind"] for r in m["records"]}
    assert kinds["data.pkl"] == "guard" and kinds[codec.PICKLE_NAME] == "pickle"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("k", [1, 3, 7])
def test_lossy_mantissa_rounding_keeps_its_bound(tmp_path: Path, dtype: torch.dtype, k: int) -> None:
    x = _special_floats(50_000, dtype, k).clone()
    x[100:200] = (torch.randn(100) * 1e-3).to(dtype)
    sd = {"exp_avg_sq": x, "w": x.clone()}
    p = tmp_path / "l.pt"
    tierstore.save(sd, p, codec=tierstore.Delta(keep_bits={"exp_avg_sq": k}))
    got = tierstore.load(p)
    _same(got["w"], sd["w"])  # not in the class: lossless
    a, b = x.double(), got["exp_avg_sq"].double()
    finite = torch.isfinite(a) & (a != 0)
    normal = finite & (a.abs() >= torch.finfo(dtype).tiny)
    rel = ((b[normal] - a[normal]).abs() / a[normal].abs()).max().item()
    assert rel <= 2.0 ** -(k + 1)
    # Specials stay as they were, bit for bit.
    special = ~normal
    assert _bits(got["exp_avg_sq"][special]) == _bits(x[special])
    from tierstore import _lossy

    if k >= _lossy.MANTISSA[dtype]:
        return  # nothing to drop: the record is exact
    rec = next(r for r in _manifest(p)["records"] if r.get("lossy"))
    assert rec["lossy"]["keep_bits"] == k and rec["lossy"]["max_rel_error"] <= rec["lossy"]["bound"] == 2.0 ** -(k + 1)


def test_lossy_bounds_below_what_the_dtype_holds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(tierstore.InvalidArgumentError, match="mantissa bits"):
        tierstore.save(
            {"m": torch.randn(100_000).half()}, tmp_path / "x.pt", codec=tierstore.Delta(keep_bits={"m": 12})
        )
    with pytest.raises(tierstore.InvalidArgumentError):
        tierstore.Delta(keep_bits={"m": 0})


@pytest.mark.parametrize("bound", [0.3, 1e-2, 1e-3, 3e-5])
def test_lossy_error_bound_per_class_is_kept(tmp_path: Path, bound: float) -> None:
    """``Delta(max_rel_error={class: b})``: every element of the class is
    within ``b`` of its value (relative), verified by the writer and
    recorded; other tensors stay exact; and a chain of deltas does not
    accumulate error (each file is within the bound of its own values)."""
    torch.manual_seed(1)
    x = torch.randn(200_000) * 1e-3
    prev = tmp_path / "p.pt"
    tierstore.save({"exp_avg_sq": x, "w": x.clone()}, prev, codec=tierstore.Delta(max_rel_error={"exp_avg_sq": bound}))
    for i in range(3):  # a chain: each a delta against the one before, as a decoder holds it
        x = x + torch.randn_like(x) * 1e-6
        p = tmp_path / f"c{i}.pt"
        tierstore.save(
            {"exp_avg_sq": x, "w": x.clone()}, p, codec=tierstore.Delta(base=prev, max_rel_error={"exp_avg_sq": bound})
        )
        got = tierstore.load(p)
        _same(got["w"], x)
        nz = x != 0
        rel = ((got["exp_avg_sq"][nz].double() - x[nz].double()).abs() / x[nz].double().abs()).max().item()
        assert rel <= bound
        rec = next(r for r in _manifest(p)["records"] if r.get("lossy"))
        assert rec["lossy"]["max_rel_error"] <= rec["lossy"]["bound"] <= bound
        prev = p


def test_lossy_error_bound_below_the_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(tierstore.InvalidArgumentError, match="below what bfloat16 represents"):
        tierstore.save(
            {"m": torch.randn(100_000).bfloat16()},
            tmp_path / "x.pt",
            codec=tierstore.Delta(max_rel_error={"m": 1e-4}),
        )
    for bad in (0, 1.5, -1e-3, float("nan"), "1e-3"):
        with pytest.raises(tierstore.InvalidArgumentError):
            tierstore.Delta(max_rel_error={"m": bad})  # type: ignore[dict-item]
    with pytest.raises(tierstore.InvalidArgumentError, match="lossless"):
        tierstore.RemoteTier(str(tmp_path / "r"), codec=tierstore.Delta(max_rel_error={"m": 1e-3}))


def test_lossy_rounding_shrinks_the_moments(tmp_path: Path) -> None:
    _a, b = _training_like()
    tierstore.save(b, tmp_path / "z.pt", codec="zstd")
    tierstore.save(b, tmp_path / "l.pt", codec=tierstore.Delta(keep_bits={"*": 10}))
    assert os.path.getsize(tmp_path / "l.pt") < 0.8 * os.path.getsize(tmp_path / "z.pt")


def test_lossy_delta_records_follow_the_schema(tmp_path: Path) -> None:
    import jsonschema

    from tierstore import manifest

    a, b = _training_like()
    tierstore.save(a, tmp_path / "a.pt")
    tierstore.save(b, tmp_path / "d.pt", codec=tierstore.Delta(base=tmp_path / "a.pt", keep_bits={"*": 10}))
    m = _manifest(tmp_path / "d.pt")
    jsonschema.validate(m, manifest.schema("manifest"))
    lossy = [r for r in m["records"] if r.get("lossy")]
    assert lossy and all(r["delta_base"] for r in lossy)
    got = tierstore.load(tmp_path / "d.pt")
    for k, v in b.items():
        rel = ((got[k].double() - v.double()).abs() / v.double().abs().clamp(min=1e-30)).max().item()
        assert rel <= 2.0**-11 or v.numel() * 4 < codec.MIN_BYTES, k
