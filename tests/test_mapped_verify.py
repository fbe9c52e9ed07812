"""``load(mmap=True)`` checks every record through the mapping, a window at a
time, with the pages brought in before the checksum reads them
(``tierstore_core::mapped``): exact bytes, damage named by record, and a file
that shrinks under the mapping is an error naming the record, not a
``SIGBUS`` that ends the process."""

from __future__ import annotations

import errno
import os
import pathlib
import zlib
from typing import Any

import pytest
import torch
from conftest import tensors_equal

import tierstore
from tierstore import _archive, _core, _load
from tierstore.errors import ChecksumError, TierstoreError, TruncatedFileError

WINDOW = 8 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {f"small{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)}
    # Records across window boundaries: 5 MiB, 11 MiB, 3 MiB of fp32.
    for i, mib in enumerate((5, 11, 3)):
        sd[f"big{i}"] = torch.randn((mib << 20) // 4, generator=g)
    return sd


def _record_offset(p: pathlib.Path, key: str) -> tuple[str, int, int]:
    arch = _archive.open_directory(str(p))
    _m, offsets = _archive.manifest_and_offsets(arch)
    rels = {rel for rel in arch.records if rel.startswith("data/")}
    pkl_keys = list(tierstore.load(p, map_location="meta"))
    assert key in pkl_keys
    # Storage keys are the order of first appearance in the pickle.
    rel = f"data/{pkl_keys.index(key)}"
    assert rel in rels
    return arch.full(rel), offsets[rel], arch.records[rel].size


def test_crc32_mapped_matches_zlib_across_windows(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "blob"
    data = os.urandom(2 * WINDOW + 4321)
    p.write_bytes(data)
    s = torch.UntypedStorage.from_file(str(p), False, len(data))
    base = s.data_ptr()
    spans = [(WINDOW - 10, WINDOW + 20), (0, 100), (200, 0), (2 * WINDOW, 4321)]
    for threads in (1, 2):
        crcs, failed = _core.crc32_mapped([(base + o, n) for o, n in spans], threads)
        assert failed is None
        assert crcs == [zlib.crc32(data[o : o + n]) for o, n in spans]


def test_crc32_mapped_reports_pages_past_the_end_of_a_shrunk_file(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "blob"
    p.write_bytes(os.urandom(2 * WINDOW))
    s = torch.UntypedStorage.from_file(str(p), False, 2 * WINDOW)
    base = s.data_ptr()
    os.truncate(p, WINDOW)
    crcs, failed = _core.crc32_mapped([(base, 4096), (base + WINDOW + 4096, 4096)], 2)
    assert crcs == [] and failed == (1, errno.EFAULT)


def test_mapped_load_is_exact_and_names_a_damaged_record(tmp_path: pathlib.Path) -> None:
    sd = _state()
    p = tmp_path / "m.pt"
    tierstore.save(sd, p)
    assert tensors_equal(tierstore.load(p, mmap=True), sd)
    rel, off, size = _record_offset(p, "big1")
    with open(p, "r+b") as f:  # one bit in the record's second window
        f.seek(off + size - 5)
        b = f.read(1)
        f.seek(off + size - 5)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError) as ei:
        tierstore.load(p, mmap=True)
    assert ei.value.record == rel and ei.value.path == str(p)


def test_a_file_cut_short_during_a_mapped_load_is_an_error_naming_the_record(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    p = tmp_path / "m.pt"
    tierstore.save(sd, p)
    rel, off, size = _record_offset(p, "big1")
    real = _load._check_data_crcs

    def shrink_then_check(name: str, *args: Any, **kwargs: Any) -> None:
        # Another process cuts the file once it is mapped: the record big1
        # loses its second half, and everything after it.
        os.truncate(name, off + size // 2)
        real(name, *args, **kwargs)

    monkeypatch.setattr(_load, "_check_data_crcs", shrink_then_check)
    with pytest.raises(TierstoreError) as ei:
        tierstore.load(p, mmap=True)
    assert isinstance(ei.value, TruncatedFileError), repr(ei.value)
    assert ei.value.record == rel and ei.value.path == str(p)


@pytest.mark.parametrize("mmap", [True, False])
def test_a_file_cut_short_after_its_directory_was_read_is_a_truncation(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, mmap: bool
) -> None:
    p = tmp_path / "m.pt"
    tierstore.save(_state(), p)
    real = _archive.open_directory

    def open_then_shrink(path: str) -> _archive.Archive:
        arch = real(path)
        os.truncate(path, os.path.getsize(path) // 2)
        return arch

    monkeypatch.setattr(_archive, "open_directory", open_then_shrink)
    with pytest.raises(TruncatedFileError) as ei:
        tierstore.load(p, mmap=mmap)
    assert ei.value.path == str(p)
