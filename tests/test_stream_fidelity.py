"""Loading from file objects as torch.load does (issue 14): the archive is
read from the stream's position, records go straight into tensor memory with
``readinto``, the position is left just after the archive (objects saved one
after another load one after another), and what cannot be loaded from
raises torch's exception types."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import NotAFileError, NotSeekableError, TierstoreError


class Recording(io.BytesIO):
    """A BytesIO that counts its calls and the bytes ``read`` returned."""

    def __init__(self, data: bytes = b"", readinto: bool = True) -> None:
        super().__init__(data)
        self.calls: dict[str, int] = {}
        self.read_bytes = 0
        self._readinto = readinto

    def read(self, n: int | None = -1) -> bytes:
        self.calls["read"] = self.calls.get("read", 0) + 1
        b = super().read(n)
        self.read_bytes += len(b)
        return b

    def readinto(self, b):  # type: ignore[no-untyped-def]
        if not self._readinto:
            raise AssertionError("readinto must not be called")
        self.calls["readinto"] = self.calls.get("readinto", 0) + 1
        return super().readinto(b)


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_objects_saved_one_after_another_load_one_after_another() -> None:
    """tierstore archives, torch archives (whose records give their sizes
    after the data), legacy torch pickles and plain pickles, interleaved in
    one stream: each load returns its object and leaves the position exactly
    after it."""
    objs: list[tuple[str, object]] = [
        ("pickle", 41),
        ("tierstore", torch.arange(25.0)),
        ("pickle", 43),
        ("tierstore", {"w": torch.randn(300, 7), "step": 3}),
        ("torch", {"b": torch.randn(5, dtype=torch.bfloat16)}),
        ("tierstore", torch.ones(3, dtype=torch.int8)),
        ("legacy", torch.full((4,), 2.5)),
        ("pickle", "between"),
        ("torch", torch.arange(6)),
    ]
    f = io.BytesIO()
    ends = []
    for kind, o in objs:
        if kind == "pickle":
            pickle.dump(o, f)
        elif kind == "tierstore":
            tierstore.save(o, f)
        elif kind == "torch":
            torch.save(o, f)
        else:
            torch.save(o, f, _use_new_zipfile_serialization=False)
        ends.append(f.tell())
    f.seek(0)
    for (kind, o), end in zip(objs, ends, strict=True):
        got = pickle.load(f) if kind == "pickle" else tierstore.load(f)
        _same(o, got)
        assert f.tell() == end, kind


def test_a_tierstore_stream_is_read_by_torch_and_back() -> None:
    f = io.BytesIO()
    tierstore.save({"a": torch.randn(10)}, f)
    pickle.dump("after", f)
    f.seek(0)
    a = tierstore.load(f)
    assert pickle.load(f) == "after"
    f.seek(0)
    _same(a, torch.load(f))


def test_records_are_read_with_readinto_and_only_once() -> None:
    t = torch.randn(256, 1024)  # 1 MiB
    buf = io.BytesIO()
    tierstore.save({"t": t}, buf)
    data = buf.getvalue()
    f = Recording(data)
    got = tierstore.load(f)
    assert torch.equal(got["t"], t)
    assert f.calls.get("readinto", 0) >= 1
    # read() serves only the headers, the directory and small records: the
    # tensor's megabyte is not also copied through bytes objects.
    assert f.read_bytes < 64 << 10, f.read_bytes
    assert f.tell() == len(data)


def test_a_file_object_without_readinto_is_read_with_read() -> None:
    t = torch.randn(11 * 512 + 1, 5)
    buf = io.BytesIO()
    tierstore.save(t, buf)
    f = Recording(buf.getvalue(), readinto=False)
    f.readinto = None  # type: ignore[method-assign,assignment]
    assert torch.equal(tierstore.load(f), t)


def test_an_archive_in_a_real_file_at_an_offset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "two.bin"
    a, b = torch.randn(1000), torch.randn(77, 3)
    with open(p, "wb") as fh:
        fh.write(b"header!")
        tierstore.save(a, fh)
        tierstore.save(b, fh)
    with open(p, "rb") as fh:
        assert fh.read(7) == b"header!"
        assert torch.equal(tierstore.load(fh), a)
        assert torch.equal(tierstore.load(fh), b)
        assert fh.read() == b""


def test_trailing_bytes_after_an_archive_in_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch.load tolerates bytes after the archive; so does tierstore, for
    its archives and torch's, of any length."""
    for writer in (tierstore.save, torch.save):
        for tail in (b"x", b"\0" * 70_000):
            p = tmp_path / f"{writer.__module__}-{len(tail)}.pt"
            obj = {"w": torch.randn(33, 4)}
            writer(obj, p)
            with open(p, "ab") as fh:
                fh.write(tail)
            _same(obj, tierstore.load(p))
            _same(obj, tierstore.load(p, mmap=True))


def test_a_damaged_record_in_a_stream_is_named() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    buf = io.BytesIO()
    tierstore.save({"t": t}, buf)
    data = bytearray(buf.getvalue())
    i = data.find(t.numpy().tobytes()[:64])
    data[i + 100] ^= 0x40
    with pytest.raises(tierstore.ChecksumError, match=r"data/0"):
        tierstore.load(io.BytesIO(bytes(data)))
    assert torch.equal(tierstore.load(io.BytesIO(bytes(data)), verify=False)["t"][:20], t[:20])


def test_a_stream_cut_short_raises() -> None:
    buf = io.BytesIO()
    tierstore.save({"t": torch.randn(5000)}, buf)
    data = buf.getvalue()
    for cut in (10, len(data) // 2, len(data) - 1):
        with pytest.raises(TierstoreError):
            tierstore.load(io.BytesIO(data[:cut]))


def test_a_stream_without_seek_raises_torchs_attribute_error() -> None:
    class NoSeek:
        def __init__(self, data: bytes) -> None:
            self._b = io.BytesIO(data)

        def read(self, n: int = -1) -> bytes:
            return self._b.read(n)

    with pytest.raises(AttributeError, match=r"You can only torch\.load from a file that is seekable"):
        tierstore.load(NoSeek(b"data"))
    with pytest.raises(NotAFileError):
        tierstore.load(NoSeek(b"data"))


def test_a_pipe_raises_unsupported_operation() -> None:
    r, w = os.pipe()
    os.write(w, b"PK\x03\x04" + b"\0" * 100)
    os.close(w)
    with open(r, "rb", buffering=0) as fh:
        with pytest.raises(io.UnsupportedOperation) as ei:
            tierstore.load(fh)
        assert isinstance(ei.value, NotSeekableError)
        assert "seekable" in str(ei.value)


def test_saving_to_what_is_not_a_file_raises_attribute_error() -> None:
    for target in (torch.rand(10), torch.UntypedStorage(4), object()):
        with pytest.raises(AttributeError):
            tierstore.save("foo", target)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            tierstore.save("foo", target)  # type: ignore[arg-type]


def test_a_zerotensor_is_refused_as_torch_refuses_it() -> None:
    z = torch._efficientzerotensor((4, 5))
    with pytest.raises(RuntimeError, match="ZeroTensor is not serializable") as ei:
        tierstore.save(z, io.BytesIO())
    assert isinstance(ei.value, tierstore.UnsupportedObjectError)
    with pytest.raises(RuntimeError, match="ZeroTensor is not serializable"):
        tierstore.save({"z": z}, io.BytesIO())


# --- torch behaviours the old compat suite does not look at ------------------


def test_skip_data_save_reserves_space_and_load_makes_storages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under torch.serialization.skip_data(), a save writes the structure
    with the records' space reserved and their bytes unwritten (to be
    populated later in place), as torch.save does; such a file loads through
    tierstore (its CRC-0 records are not refused), and a load under
    skip_data makes the storages without reading them."""
    sd = {"w": torch.randn(64, 64), "b": torch.arange(5)}
    p = tmp_path / "skel.pt"
    with torch.serialization.skip_data():
        tierstore.save(sd, p)
    for got in (tierstore.load(p), tierstore.load(p, mmap=True), torch.load(p)):
        assert got.keys() == sd.keys()
        assert got["w"].shape == (64, 64) and got["b"].dtype == torch.int64
        assert not got["w"].any()
    # Populate the bytes in place, as skip_data users do: both loaders read them.
    full = tmp_path / "full.pt"
    torch.save(sd, full)
    with torch.serialization.skip_data():
        got = tierstore.load(full)
    assert got["w"].shape == (64, 64)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        fake = tierstore.load(full)
    assert fake["w"].shape == (64, 64)


def test_skip_data_file_with_populated_bytes_loads_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import zipfile

    w = torch.randn(128)
    p = tmp_path / "skel.pt"
    with torch.serialization.skip_data():
        torch.save({"w": w}, p)
    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        hdr = info.header_offset
    with open(p, "r+b") as fh:
        fh.seek(hdr + 26)
        nlen, xlen = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        fh.seek(hdr + 30 + nlen + xlen)
        fh.write(w.numpy().tobytes())
    assert torch.equal(torch.load(p)["w"], w)
    assert torch.equal(tierstore.load(p)["w"], w)


def test_a_tierstore_file_with_a_zeroed_crc_is_still_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The CRC-0 allowance is for torch's skip_data files alone: a tierstore
    file records real CRCs (its manifest repeats them), so damage plus a
    zeroed CRC field is still caught."""
    import zipfile

    p = tmp_path / "t.pt"
    tierstore.save({"w": torch.arange(1000, dtype=torch.int32)}, p)
    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(p.read_bytes())
    # Zero the data record's CRC in the central directory and local header, damage a byte.
    at = data.find(b"PK\x01\x02")
    while at != -1:
        name_len = int.from_bytes(data[at + 28 : at + 30], "little")
        if bytes(data[at + 46 : at + 46 + name_len]).endswith(b"/data/0"):
            data[at + 16 : at + 20] = b"\0\0\0\0"
        at = data.find(b"PK\x01\x02", at + 4)
    nlen = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    xlen = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    data[info.header_offset + 30 + nlen + xlen + 5] ^= 0x10
    data[info.header_offset + 14 : info.header_offset + 18] = b"\0\0\0\0"
    p.write_bytes(bytes(data))
    for src in (lambda: str(p), lambda: io.BytesIO(bytes(data))):
        with pytest.raises((tierstore.ChecksumError, tierstore.ManifestError), match="data/0"):
            tierstore.load(src())


def test_weights_only_with_tensor_subclasses_and_safe_globals() -> None:
    for saver in (torch.save, tierstore.save):
        t = torch.randn(3).as_subclass(_MyTensor)
        t.extra = "kept"  # type: ignore[attr-defined]
        f = io.BytesIO()
        saver({"t": t, "box": _Box(3)}, f)
        data = f.getvalue()
        with pytest.raises(pickle.UnpicklingError):
            tierstore.load(io.BytesIO(data))
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(data))
        with torch.serialization.safe_globals([_MyTensor, _Box]):
            got = tierstore.load(io.BytesIO(data))
            ref = torch.load(io.BytesIO(data))
        for r in (got, ref):
            assert type(r["t"]) is _MyTensor and r["t"].extra == "kept" and torch.equal(r["t"], t)
            assert r["box"] == _Box(3)
        torch.serialization.add_safe_globals([_MyTensor, _Box])
        try:
            assert type(tierstore.load(io.BytesIO(data))["t"]) is _MyTensor
        finally:
            torch.serialization.clear_safe_globals()


class _MyTensor(torch.Tensor):
    pass


class _Box:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, o: object) -> bool:
        return isinstance(o, _Box) and o.v == self.v


def test_a_lying_local_size_inside_a_longer_stream_still_loads() -> None:
    """Found by the fuzz campaign (single:33000348): a local header's size
    damaged (a field path loads and verify do not use) must not make the
    same file fail when it sits inside a longer stream."""
    import zipfile

    obj = {"w": torch.randn(50), "step": 4}
    buf = io.BytesIO()
    tierstore.save(obj, buf)
    data = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        hdr = next(i for i in z.infolist() if i.filename.endswith("/version")).header_offset
    data[hdr + 18 : hdr + 22] = (0x80000000).to_bytes(4, "little")
    after = io.BytesIO()
    tierstore.save({"after": 1}, after)
    stream = io.BytesIO(b"lead" + bytes(data) + after.getvalue())
    stream.seek(4)
    _same(obj, tierstore.load(stream))
    assert tierstore.load(stream) == {"after": 1}


@pytest.mark.filterwarnings("ignore:`torch.jit")
@pytest.mark.filterwarnings("ignore:'torch.load' received a zip file that looks like a TorchScript")
def test_torchscript_archives_are_handed_to_torch_with_its_error_types(tmp_path: pathlib.Path) -> None:
    """A TorchScript archive (data.pkl, constants.pkl, code records) loads
    as torch.load loads it, from a path and from a stream; under
    weights_only=True it is refused as torch refuses it (a RuntimeError)."""
    m = torch.jit.script(torch.nn.Linear(3, 2))
    p = tmp_path / "script.pt"
    torch.jit.save(m, str(p))
    with pytest.raises(RuntimeError, match="TorchScript"):
        tierstore.load(p)
    with pytest.raises(tierstore.UnsafeObjectError):
        tierstore.load(p)
    x = torch.randn(4, 3)
    for src in (p, io.BytesIO(p.read_bytes())):
        got = tierstore.load(src, weights_only=False)
        assert isinstance(got, torch.jit.ScriptModule)
        assert torch.equal(got(x), m(x))


@pytest.mark.parametrize("nesting", ["dict", "list", "deep"])
@pytest.mark.parametrize("target", ["path", "stream"])
def test_one_storage_viewed_as_two_dtypes_is_refused_as_torch_refuses_it(
    tmp_path: Path, nesting: str, target: str
) -> None:
    """Two tensors over one storage with different dtypes: torch.save refuses
    the state, and so does tierstore, whether the second view is met when
    the save registers tensors beforehand or while pickling."""
    t = torch.randn(64)
    u = t.view(torch.int32)
    state: Any = {"dict": {"a": t, "b": u}, "list": [t, u], "deep": {"x": [{"a": t}], "y": ({"b": u},)}}[nesting]
    with pytest.raises(RuntimeError, match="different types"):
        torch.save(state, io.BytesIO())
    dest: Any = tmp_path / "x.pt" if target == "path" else io.BytesIO()
    with pytest.raises(tierstore.UsageError, match="different types"):
        tierstore.save(state, dest)
    if target == "path":
        assert not (tmp_path / "x.pt").exists()
