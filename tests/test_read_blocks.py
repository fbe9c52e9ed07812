"""A resharding load hands the engine one copy block per pair of saved and
target pieces (an affine grid of byte runs), however many runs it holds;
the engine expands, merges and reads them (exactly the needed bytes
unverified, every touched chunk verified otherwise), in every layout a
block can describe, and a damaged chunk under a block fails the load naming
the file and record."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore._sharded_read import _target, expand_plan, make_plan
from tierstore.errors import ChecksumError
from tierstore.layout import Layout, attach
from tierstore.shardmeta import Checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_util import stored_tensors

ROWS, COLS = 1000, 64


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    sd = {
        "w": torch.randn(ROWS, COLS, generator=g),
        "cube": torch.randn(6, 10, 12, generator=g),
        "h": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
    }
    d = tmp_path / "ck"
    tierstore.save_sharded(sd, d)
    return d, sd


def _load(d: Path, lay: Layout, dtype: torch.dtype, verify: str | bool) -> tuple[torch.Tensor, dict[str, int]]:
    t = attach(torch.full(lay.local_shape, -7.0, dtype=dtype), lay)
    stats: dict[str, int] = {}
    tierstore.load_sharded(d, {lay.pieces[0].tensor: t}, stats=stats, verify=verify)
    return t, stats


def test_a_column_shard_is_one_block_of_row_runs(ckpt: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, sd = ckpt
    lay = Layout.shard("w", (ROWS, COLS), 1, 1, 4)
    ck = Checkpoint(d)
    target = _target(ck, "w", attach(torch.empty(lay.local_shape), lay), 1)
    blocks = expand_plan(make_plan(ck, [target]), [target], ck)
    (fb,) = blocks.values()
    assert fb.rows.shape[0] == 1, "one block, not one object per row"
    assert fb.dims == 1 and fb.rows[0, 2] == 16 * 4 and fb.rows[0, 3] == ROWS
    assert fb.bytes_needed == ROWS * 16 * 4
    for verify in ("touched", "full", False):
        got, stats = _load(d, lay, torch.float32, verify)
        assert torch.equal(got, sd["w"][:, 16:32]), verify
        if verify is False:
            assert stats["bytes_read"] == stats["bytes_needed"] == ROWS * 16 * 4
            assert stats["bytes_verified"] == 0
        else:
            assert stats["bytes_needed"] <= stats["bytes_read"] == stats["bytes_verified"]
            assert stats["bytes_read"] <= (stats["bytes_needed_blocks"] if verify == "touched" else ROWS * COLS * 4)


@pytest.mark.parametrize(
    ("name", "lay"),
    [
        ("w", Layout.block("w", (ROWS, COLS), (17, 5), (300, 3))),  # runs of 3 elements
        ("w", Layout.block("w", (ROWS, COLS), (0, 0), (ROWS, COLS))),  # one run
        ("w", Layout.block("w", (ROWS, COLS), (999, 63), (1, 1))),  # one element
        ("cube", Layout.block("cube", (6, 10, 12), (1, 2, 3), (4, 5, 6))),  # two outer dimensions
        ("cube", Layout.block("cube", (6, 10, 12), (2, 0, 0), (3, 10, 12))),  # whole planes: one run
        ("h", Layout.shard("h", (ROWS, COLS), 1, 3, 4)),  # 2-byte elements
        ("w", Layout.flat("w", (ROWS, COLS), 1000, 5000)),  # a flat range crossing rows
    ],
)
@pytest.mark.parametrize("verify", ["touched", False])
def test_blocks_land_every_element(
    ckpt: tuple[Path, dict[str, torch.Tensor]], name: str, lay: Layout, verify: str | bool
) -> None:
    d, sd = ckpt
    got, stats = _load(d, lay, sd[name].dtype, verify)
    want = torch.empty(lay.local_shape, dtype=sd[name].dtype)
    for p in lay.pieces:
        src = sd[name][tuple(slice(o, o + n) for o, n in zip(p.box.offsets, p.box.lengths, strict=True))]
        if isinstance(p.local, int):
            want.view(-1)[p.local : p.local + src.numel()] = src.reshape(-1)
        else:
            want[tuple(slice(o, o + n) for o, n in zip(p.local.offsets, p.local.lengths, strict=True))] = src
    assert torch.equal(got, want)
    if verify is False:
        assert stats["bytes_read"] == stats["bytes_needed"]


def test_a_damaged_chunk_under_a_block_fails_naming_file_and_record(
    ckpt: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, sd = ckpt
    (w,) = [s for s in stored_tensors(d) if s["key"] == "w"]
    # Flip a byte of row 700, inside the columns a column shard reads.
    at = w["offset"] + (700 * COLS + 20) * 4
    with open(w["file"], "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    lay = Layout.shard("w", (ROWS, COLS), 1, 1, 4)
    with pytest.raises(ChecksumError) as e:
        _load(d, lay, torch.float32, "touched")
    assert str(w["file"].name) in str(e.value) and "chunk" in str(e.value)
    # Unverified, the damage is read as is (the caller asked for no checks).
    got, _stats = _load(d, lay, torch.float32, False)
    assert not torch.equal(got, sd["w"][:, 16:32])
    # A shard that does not touch the damaged chunk still loads.
    got, _stats = _load(d, Layout.block("w", (ROWS, COLS), (0, 0), (600, COLS)), torch.float32, "touched")
    assert torch.equal(got, sd["w"][:600])


def test_a_plain_load_does_not_import_dtensor(tmp_path: Path) -> None:
    """Importing torch.distributed.tensor costs about a second; a load of
    plain tensors must not pay it (no DTensor can exist before it is imported)."""
    import subprocess

    code = (
        "import sys, torch, tierstore\n"
        f"d = {str(tmp_path / 'ck')!r}\n"
        "tierstore.save_sharded({'a': torch.arange(6.0), 'n': 3}, d)\n"
        "sd = {'a': torch.zeros(6), 'n': 0}\n"
        "tierstore.load_sharded(d, sd)\n"
        "assert torch.equal(sd['a'], torch.arange(6.0)) and sd['n'] == 3\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
