"""A sharded load reads several data files at once (a column shard of
row-sharded tensors needs a part of every file): the reads overlap, the
bytes are exact, and a damaged file is named, the first in file order when
several are damaged, with every read finished before the error is raised."""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import ChecksumError, Layout, attach
from tierstore import _sharded_read as sr

ROWS, COLS = 256, 1280
NAMES = ("a", "b", "c")


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(ROWS, COLS, generator=g)


def save_job(rank: int, world: int, path: str) -> None:
    sd = {n: attach(full(n).chunk(world)[rank].clone(), Layout.shard(n, (ROWS, COLS), 0, rank, world)) for n in NAMES}
    tierstore.save_sharded(sd, path)


@pytest.fixture(scope="module")
def rows_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("files_at_once") / "ckpt")
    run_world(4, save_job, path)
    return path


def data_files(path: str) -> list[pathlib.Path]:
    files = sorted(pathlib.Path(path).glob("rank-*.pt"))
    assert len(files) == 4, files
    return files


def column_shard(t: int, tp: int) -> dict[str, torch.Tensor]:
    return {n: attach(torch.zeros(ROWS, COLS // tp), Layout.shard(n, (ROWS, COLS), 1, t, tp)) for n in NAMES}


class Overlap:
    """Wraps the engine's per-file read: counts the calls in flight at once."""

    def __init__(self, real: Any) -> None:
        self.real, self.now, self.most, self.calls = real, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.2)  # long enough for the other files' reads to start if they run at once
            return self.real(*args, **kwargs)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("verify", ["touched", False])
def test_a_column_shard_reads_its_files_at_once(rows_ckpt: str, monkeypatch: pytest.MonkeyPatch, verify: Any) -> None:
    spy = Overlap(sr._core.read_blocks)
    monkeypatch.setattr(sr._core, "read_blocks", spy)
    sd = column_shard(1, 4)
    tierstore.load_sharded(rows_ckpt, sd, verify=verify)
    for n in NAMES:
        assert torch.equal(sd[n], full(n).chunk(4, dim=1)[1]), n
    assert spy.calls == 4  # one read per data file, every file holding rows of the shard
    assert spy.most >= 2, spy.most  # read one after another, the device would see one stream


def test_a_row_shard_of_one_file_is_read_on_the_callers_thread(rows_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = sr._core.read_blocks

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(sr._core, "read_blocks", spy)
    sd = {n: attach(torch.zeros(ROWS // 4, COLS), Layout.shard(n, (ROWS, COLS), 0, 2, 4)) for n in NAMES}
    tierstore.load_sharded(rows_ckpt, sd)
    for n in NAMES:
        assert torch.equal(sd[n], full(n).chunk(4)[2]), n
    assert seen == [threading.main_thread().name]


def first_column(p: pathlib.Path) -> int:
    """An offset inside the first 1,280-byte column slice of a row of the
    first data record of ``p`` (bytes every column shard 0 reads)."""
    from tierstore import _archive

    _arch, _m, offsets = _archive.open_archive(str(p))
    data = min(v for k, v in offsets.items() if k.startswith("data/"))
    return data + 5 * COLS * 4 + 40


def flip(p: pathlib.Path, at: int) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tierstore-read")]


def test_damage_in_two_files_names_the_first_and_every_read_has_ended(rows_ckpt: str, tmp_path: pathlib.Path) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(rows_ckpt, copy)
    files = data_files(str(copy))
    for p in (files[1], files[3]):
        flip(p, first_column(p))
    sd = column_shard(0, 4)
    with pytest.raises(ChecksumError) as e:
        tierstore.load_sharded(str(copy), sd)
    assert files[1].name in str(e.value), e.value
    assert files[3].name not in str(e.value), e.value
    assert reader_threads() == []
    # Damage in one file alone is named as well.
    copy2 = tmp_path / "ckpt2"
    shutil.copytree(rows_ckpt, copy2)
    f3 = data_files(str(copy2))[3]
    flip(f3, first_column(f3))
    with pytest.raises(ChecksumError, match=f3.name):
        tierstore.load_sharded(str(copy2), column_shard(0, 4))
    assert reader_threads() == []
    # The undamaged checkpoint still loads exactly.
    sd = column_shard(3, 4)
    tierstore.load_sharded(rows_ckpt, sd)
    for n in NAMES:
        assert torch.equal(sd[n], full(n).chunk(4, dim=1)[3]), n
