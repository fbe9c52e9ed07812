"""Round trips: tierstore -> tierstore, tierstore -> torch.load, torch.save -> tierstore."""

from __future__ import annotations

import collections
import io
import json
import pathlib
import zipfile
from typing import Any

import hypothesis.strategies as st
import jsonschema
import numpy as np
import pytest
import torch
from conftest import tensors_equal
from hypothesis import HealthCheck, given, settings

import tierstore
from tierstore import manifest

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    t = make_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["plain", "transpose", "slice", "expand"]))
    if kind == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif kind == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif kind == "expand" and t.dim() == 1 and t.shape[0] == 1:
        t = t.expand(3)
    return t


leaves = st.one_of(
    tensors(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.booleans(),
    st.none(),
)
objects = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(min_size=1, max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)

HSET = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HSET
@given(obj=objects)
def test_tierstore_to_tierstore_and_torch(tmp_path: pathlib.Path, obj: Any) -> None:
    p = tmp_path / "obj.pt"
    tierstore.save(obj, p)
    assert tensors_equal(obj, tierstore.load(p))
    assert tensors_equal(obj, torch.load(p))


@HSET
@given(obj=objects)
def test_torch_save_to_tierstore(tmp_path: pathlib.Path, obj: Any) -> None:
    p = tmp_path / "torch.pt"
    torch.save(obj, p)
    assert tensors_equal(obj, tierstore.load(p))


def sample_state() -> dict[str, Any]:
    base = torch.randn(64, 32)
    return {
        "w": base,
        "row_view": base[3],
        "t_view": base.t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bf16": torch.randn(5, 7).bfloat16(),
        "f8": torch.randn(9).to(torch.float8_e4m3fn),
        "bool": torch.tensor([True, False, True]),
        "cplx": torch.randn(3, dtype=torch.complex64),
        "i64": torch.arange(10),
        "nested": {"list": [torch.ones(2), 7, "x"], "tuple": (1.5, torch.zeros(3, dtype=torch.int8))},
        "step": 11,
        "name": "model",
    }


def test_every_backend_roundtrip(tmp_path: pathlib.Path, backend: str) -> None:
    sd = sample_state()
    big = torch.randn(3 << 20)  # 12 MiB: several chunks under the 1 MiB test chunk size
    sd["big"] = big
    p = tmp_path / f"{backend}.pt"
    tierstore.save(sd, p)
    back = tierstore.load(p)
    assert tensors_equal(sd, back)
    assert tensors_equal(sd, torch.load(p))
    assert tensors_equal(sd, tierstore.load(p, mmap=True))
    torch.save(sd, tmp_path / "t.pt")
    assert tensors_equal(sd, tierstore.load(tmp_path / "t.pt"))


def test_views_share_storage_after_load(tmp_path: pathlib.Path) -> None:
    sd = sample_state()
    p = tmp_path / "v.pt"
    tierstore.save(sd, p)
    for back in (tierstore.load(p), tierstore.load(p, mmap=True)):
        ptr = back["w"].untyped_storage().data_ptr()
        assert back["row_view"].untyped_storage().data_ptr() == ptr
        assert back["t_view"].untyped_storage().data_ptr() == ptr
        back["w"][3, 0] = 1234.0
        assert back["row_view"][0] == 1234.0, "views alias the same memory, as with torch"
    with zipfile.ZipFile(p) as z:
        storages = [n for n in z.namelist() if "/data/" in n]
    # 10 tensors own storages; the two views add none (one record for w and its views).
    assert len(storages) == 10


def test_optimizer_state_dict(tmp_path: pathlib.Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    p = tmp_path / "ckpt.pt"
    tierstore.save(state, p)
    back = tierstore.load(p)
    assert tensors_equal(state["model"], back["model"])
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert tensors_equal(state["optim"]["state"], back["optim"]["state"])
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optim"])
    assert isinstance(back["model"], collections.OrderedDict)


def test_numpy_arrays_and_scalars(tmp_path: pathlib.Path) -> None:
    obj = {"arr": np.arange(12, dtype=np.float32).reshape(3, 4), "f": 2.5, "s": "text", "b": b"bytes"}
    p = tmp_path / "np.pt"
    tierstore.save(obj, p)
    back = tierstore.load(p, weights_only=False)
    np.testing.assert_array_equal(back["arr"], obj["arr"])
    assert back["f"] == 2.5 and back["s"] == "text" and back["b"] == b"bytes"
    t = torch.load(p, weights_only=False)
    np.testing.assert_array_equal(t["arr"], obj["arr"])


def test_file_objects(tmp_path: pathlib.Path) -> None:
    sd = sample_state()
    buf = io.BytesIO()
    tierstore.save(sd, buf)
    buf.seek(0)
    assert tensors_equal(sd, torch.load(buf))
    buf.seek(0)
    assert tensors_equal(sd, tierstore.load(buf))
    with open(tmp_path / "f.pt", "wb") as f:
        tierstore.save(sd, f)
    assert tensors_equal(sd, tierstore.load(tmp_path / "f.pt"))
    with open(tmp_path / "f.pt", "rb") as f:
        assert tensors_equal(sd, tierstore.load(f))
    tb = io.BytesIO()
    torch.save(sd, tb)
    tb.seek(0)
    assert tensors_equal(sd, tierstore.load(tb))


def test_path_types(tmp_path: pathlib.Path) -> None:
    sd = {"x": torch.arange(5)}
    tierstore.save(sd, str(tmp_path / "a.pt"))
    tierstore.save(sd, tmp_path / "b.pt")
    assert tensors_equal(tierstore.load(str(tmp_path / "b.pt")), sd)
    assert tensors_equal(tierstore.load(tmp_path / "a.pt"), sd)


def test_legacy_format_is_handed_to_torch(tmp_path: pathlib.Path) -> None:
    sd = {"x": torch.arange(5.0)}
    p = tmp_path / "legacy.pt"
    torch.save(sd, p, _use_new_zipfile_serialization=False)
    assert tensors_equal(tierstore.load(p), sd)


def test_save_overwrites_atomically(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x.pt"
    tierstore.save({"v": torch.zeros(3)}, p)
    tierstore.save({"v": torch.ones(3)}, p)
    assert torch.equal(tierstore.load(p)["v"], torch.ones(3))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x.pt"]


@pytest.mark.parametrize("n", [1, 1000])
def test_many_records(tmp_path: pathlib.Path, n: int) -> None:
    sd = {f"t{i}": torch.full((i % 17 + 1,), float(i)) for i in range(n)}
    p = tmp_path / "many.pt"
    tierstore.save(sd, p)
    assert tensors_equal(tierstore.load(p), sd)
    assert tensors_equal(torch.load(p), sd)


class _Holder:
    """An object whose tensor only the pickler finds (the walk enters dicts,
    lists and tuples)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_a_save_of_many_tensors_written_in_batches_is_the_one_file(tmp_path: pathlib.Path) -> None:
    """A path save registers its first tensors, starts writing them, and
    registers the rest in batches while the engine writes: the keys, the
    pickle and the records are those of a save that registers all first (a
    file-object save, which does), including a storage shared by tensors of
    different batches, a strided view in the last batch and a storage only
    the pickler finds (inside an object the walk does not enter)."""
    from tierstore import api

    torch.manual_seed(0)
    shared = torch.randn(50, 40)
    state: dict[str, Any] = {f"t{i}": torch.randn(i % 7 + 1) for i in range(3000)}
    state["t5"] = shared[:10]  # first batch
    state["t2500"] = shared  # a later batch: the same storage
    state["t2999"] = torch.randn(30, 20).t()  # strided, last batch
    state["hidden"] = _Holder(torch.arange(12.0))  # found only by the pickler
    assert api._FIRST_BATCH < 3000  # the test is about the batches
    path = tmp_path / "many.pt"
    tierstore.save(state, path)
    buf = io.BytesIO()
    tierstore.save(state, buf)
    with zipfile.ZipFile(path) as a, zipfile.ZipFile(io.BytesIO(buf.getvalue())) as b:
        pa = next(n for n in a.namelist() if n.endswith("/data.pkl"))
        pb = next(n for n in b.namelist() if n.endswith("/data.pkl"))
        assert a.read(pa) == b.read(pb)
        names_a = sorted(n.split("/", 1)[1] for n in a.namelist() if "/data/" in n)
        names_b = sorted(n.split("/", 1)[1] for n in b.namelist() if "/data/" in n)
        assert names_a == names_b
        for n in names_a:
            assert a.read(f"{pa.split('/')[0]}/{n}") == b.read(f"{pb.split('/')[0]}/{n}"), n
        # The path save prepares the manifest's entries of the last batch
        # while it is written and puts the CRCs in after: the same entries as
        # the file-object save builds at the end, each true to the zip.
        ma = json.loads(a.read(pa.replace("data.pkl", manifest.MANIFEST_NAME)))
        mb = json.loads(b.read(pb.replace("data.pkl", manifest.MANIFEST_NAME)))
        jsonschema.validate(ma, manifest.schema())
        ra = {r["name"]: r for r in ma["records"]}
        rb = {r["name"]: r for r in mb["records"]}
        assert set(ra) == set(rb) == {n.split("/", 1)[1] for n in a.namelist()} - {manifest.MANIFEST_NAME}
        for name, r in ra.items():
            info = a.getinfo(f"{pa.split('/')[0]}/{name}")
            assert (r["size"], r["crc32"]) == (info.file_size, info.CRC), name
            same = {k: v for k, v in r.items() if k not in ("offset", "crc32")}  # the serialization id differs
            assert same == {k: v for k, v in rb[name].items() if k not in ("offset", "crc32")}, name
    got = tierstore.load(path, weights_only=False)
    for k, v in state.items():
        if k != "hidden":
            assert torch.equal(got[k], v), k
    assert got["t5"].untyped_storage().data_ptr() == got["t2500"].untyped_storage().data_ptr()
    assert torch.equal(got["hidden"].t, state["hidden"].t)
