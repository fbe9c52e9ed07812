"""torch.load's options, mirrored: map_location, mmap, weights_only, verify."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from conftest import tensors_equal

import tierstore


@dataclasses.dataclass
class Custom:
    """A class outside torch's weights_only allow-list."""

    value: int


def _saved(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    sd = {"a": torch.randn(100, 10), "b": torch.arange(7)}
    p = tmp_path / "m.pt"
    tierstore.save(sd, p)
    return p, sd


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage, lambda storage, loc: None],
    ids=["str", "device", "dict", "callable", "callable-none"],
)
def test_map_location_forms(tmp_path: pathlib.Path, map_location: object) -> None:
    p, sd = _saved(tmp_path)
    back = tierstore.load(p, map_location=map_location)
    assert tensors_equal(back, sd)
    assert back["a"].device.type == "cpu"


def test_map_location_callable_sees_locations(tmp_path: pathlib.Path) -> None:
    p, _sd = _saved(tmp_path)
    seen = []

    def where(storage: object, location: str) -> object:
        seen.append(location)
        return storage

    tierstore.load(p, map_location=where)
    assert seen == ["cpu", "cpu"]


def test_map_location_meta(tmp_path: pathlib.Path) -> None:
    p, sd = _saved(tmp_path)
    back = tierstore.load(p, map_location="meta")
    assert back["a"].device.type == "meta" and back["a"].shape == sd["a"].shape


def test_mmap_tensors_are_backed_by_the_file(tmp_path: pathlib.Path) -> None:
    p, sd = _saved(tmp_path)
    back = tierstore.load(p, mmap=True)
    assert tensors_equal(back, sd)
    maps = pathlib.Path("/proc/self/maps").read_text()
    assert str(p) in maps, "the file is mapped into memory"
    # The same holds for files written by torch.save.
    tp = tmp_path / "torch.pt"
    torch.save(sd, tp)
    tb = tierstore.load(tp, mmap=True)
    assert tensors_equal(tb, sd)
    assert str(tp) in pathlib.Path("/proc/self/maps").read_text()


def test_mmap_needs_a_path(tmp_path: pathlib.Path) -> None:
    p, _sd = _saved(tmp_path)
    with open(p, "rb") as f, pytest.raises(ValueError, match="file path"):
        tierstore.load(f, mmap=True)


def test_weights_only_refuses_unknown_globals_and_says_how(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "obj.pt"
    tierstore.save({"x": Custom(3), "t": torch.ones(2)}, p)
    with pytest.raises(tierstore.UnsafeObjectError) as ei:
        tierstore.load(p)
    msg = str(ei.value)
    assert "add_safe_globals" in msg and "Custom" in msg and str(p) in msg
    # Also a pickle.UnpicklingError, as torch raises.
    import pickle

    assert isinstance(ei.value, pickle.UnpicklingError)
    with torch.serialization.safe_globals([Custom]):
        assert tierstore.load(p)["x"] == Custom(3)
    assert tierstore.load(p, weights_only=False)["x"] == Custom(3)
    # torch refuses the same file the same way.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(p)


def test_explicit_pickle_module_conflicts_with_weights_only(tmp_path: pathlib.Path) -> None:
    import pickle

    p, sd = _saved(tmp_path)
    with pytest.raises(RuntimeError, match="pickle_module"):
        tierstore.load(p, pickle_module=pickle, weights_only=True)
    assert tensors_equal(tierstore.load(p, pickle_module=pickle), sd)


def test_verify_false_skips_checksums(tmp_path: pathlib.Path) -> None:
    p, _sd = _saved(tmp_path)
    data = bytearray(p.read_bytes())
    from tierstore import _archive

    _arch, _m, offsets = _archive.open_archive(str(p))
    data[offsets["data/0"] + 10] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(tierstore.ChecksumError):
        tierstore.load(p)
    with pytest.raises(tierstore.ChecksumError):
        tierstore.load(p, mmap=True)
    back = tierstore.load(p, verify=False)
    assert back["a"].shape == (100, 10)


def test_mmap_follows_torchs_default_mmap_options(tmp_path: pathlib.Path) -> None:
    """Mapped loads are private by default (writes stay in memory); with
    ``torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)`` they
    are shared, as torch.load's are: writes reach the file."""
    import mmap as mmap_mod

    p = tmp_path / "m.pt"
    tierstore.save({"w": torch.zeros(1024)}, p)
    private = tierstore.load(p, mmap=True)
    private["w"] += 1
    assert torch.equal(tierstore.load(p)["w"], torch.zeros(1024))
    torch.serialization.set_default_mmap_options(mmap_mod.MAP_SHARED)
    try:
        shared = tierstore.load(p, mmap=True)
        shared["w"] += 2
        del shared
    finally:
        torch.serialization.set_default_mmap_options(mmap_mod.MAP_PRIVATE)
    assert torch.equal(tierstore.load(p, verify=False)["w"], torch.full((1024,), 2.0))


def test_files_without_a_byteorder_record_follow_torchs_default_load_endianness(tmp_path: pathlib.Path) -> None:
    """torch.load reads a file that has no ``byteorder`` record in the order
    ``torch.serialization.set_default_load_endianness`` says; so does tierstore."""
    import zipfile

    src, p = tmp_path / "bom.pt", tmp_path / "nobom.pt"
    torch.save({"w": torch.arange(8, dtype=torch.int32)}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            if not name.endswith("/byteorder"):  # as files from torch before 2.1
                zout.writestr(name, zin.read(name))
    assert torch.equal(tierstore.load(p)["w"], torch.arange(8, dtype=torch.int32))
    torch.serialization.set_default_load_endianness(torch.serialization.LoadEndianness.BIG)
    try:
        theirs, ours = torch.load(p)["w"], tierstore.load(p)["w"]
    finally:
        torch.serialization.set_default_load_endianness(torch.serialization.LoadEndianness.LITTLE)
    assert torch.equal(ours, theirs) and not torch.equal(ours, torch.arange(8, dtype=torch.int32))
