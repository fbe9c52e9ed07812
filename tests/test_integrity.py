"""Integrity and safety of the sharded load paths: every class of defect an
adversarial campaign found, each as the user meets it.

A load returns exactly the bytes that were saved or raises a TierstoreError
naming the file and record; nothing a file names leads outside the
checkpoint; nothing hangs or allocates what the files do not hold.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_util import stored_tensors
from dist_util import run_world

import tierstore
import tierstore.cli
from tierstore import _metadata
from tierstore.checkpointer import Checkpointer, DiskTier
from tierstore.errors import (
    ChecksumError,
    CorruptFileError,
    CoverageError,
    ManifestError,
    ResourceLimitError,
    TierstoreError,
    UnsafePathError,
)
from tierstore.layout import Layout, attach
from tierstore.sharded import consolidate


def _manifest(d: Path) -> dict[str, Any]:
    m, _ = _metadata.loads((d / "manifest.json").read_bytes(), "m", required=False)
    return m


def _reseal(d: Path, m: dict[str, Any]) -> None:
    """Writes ``m`` back with a correct checksum (what an attacker would do)."""
    (d / "manifest.json").write_bytes(_metadata.dumps(m))


def _row_layout(shape: tuple[int, ...], r: int, n: int, explicit: bool) -> Layout:
    """Row shard ``r`` of ``n``: a position of a sharding rule, or (``explicit``)
    the same box with no rule (stored as pieces in manifest.json)."""
    if not explicit:
        return Layout.shard("w", shape, 0, r, n)
    per = shape[0] // n
    return Layout.block("w", shape, (r * per, *[0] * (len(shape) - 1)), (per, *shape[1:]))


def _rows(
    tmp_path: Path, n: int = 4, shape: tuple[int, int] = (256, 384), explicit: bool = False
) -> tuple[Path, torch.Tensor]:
    """A tensor saved as ``n`` row shards by one process (one file)."""
    full = torch.randn(*shape)
    d = tmp_path / "rows"
    per = shape[0] // n
    sd = {f"p{r}": attach(full[r * per : (r + 1) * per].clone(), _row_layout(shape, r, n, explicit)) for r in range(n)}
    tierstore.save_sharded(sd, d)
    return d, full


def _column_target(shape: tuple[int, int], k: int, n: int) -> dict[str, torch.Tensor]:
    return {"w": attach(torch.zeros(shape[0], shape[1] // n), Layout.shard("w", shape, 1, k, n))}


def _data_file(d: Path) -> Path:
    return next(p for p in d.iterdir() if p.name.startswith("rank-"))


def _flip(p: Path, at: int) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def _stored_ranges(d: Path) -> list[tuple[int, int]]:
    return [(s["offset"], s["offset"] + s["nbytes"]) for s in stored_tensors(d)]


# ----------------------------------------------------------------------------------------------
# 1. partial reads are verified


@pytest.mark.parametrize("verify", ["touched", "full"])
def test_every_flip_in_a_column_shard_is_caught(tmp_path: Path, verify: str) -> None:
    d, full = _rows(tmp_path)
    f = _data_file(d)
    original = f.read_bytes()
    rng = random.Random(0)
    ranges = _stored_ranges(d)
    caught = 0
    for _ in range(30):
        lo, hi = rng.choice(ranges)
        at = rng.randrange(lo, hi)
        f.write_bytes(original)
        _flip(f, at)
        sd = _column_target((256, 384), rng.randrange(3), 3)
        k = 0
        # The flipped byte is in a column this target needs, or not; either
        # way no wrong byte may come back.
        try:
            tierstore.load_sharded(d, sd, verify=verify)
        except ChecksumError as e:
            msg = str(e)
            caught += 1
            assert str(f) in msg and "record" in msg
            continue
        cols = sd["w"].shape[1]
        k = next(i for i in range(3) if torch.equal(sd["w"], full[:, i * cols : (i + 1) * cols]))
        assert k >= 0
    f.write_bytes(original)
    assert caught >= 10, "most flips land in columns every target touches (chunks span rows)"


def test_a_flip_among_chunks_checked_together_names_its_own_chunk(tmp_path: Path) -> None:
    """Consecutive 512-byte chunks are checked a few at a time (one span of
    the mapping): a flip inside such a span is reported as its own chunk,
    with that chunk's bytes, whether a short read touches it (``"touched"``)
    or no read does (``"full"``, every chunk of a record read from)."""
    d, _full = _rows(tmp_path, 4, (256, 384))  # rows of 1,536 bytes; record 2 holds rows 128-191
    f = _data_file(d)
    original = f.read_bytes()
    lo, _hi = sorted(_stored_ranges(d))[2]
    block = Layout.block("w", (256, 384), (128, 0), (8, 384))  # 8 rows: 12 KiB, chunks 0-23 of record 2
    for verify, chunk in (("touched", 1), ("touched", 20), ("full", 37), ("full", 150)):
        f.write_bytes(original)
        _flip(f, lo + 512 * chunk + 100)
        with pytest.raises(ChecksumError, match=rf"bytes \[{512 * chunk}, {512 * chunk + 512}\) \(chunk {chunk};"):
            tierstore.load_sharded(d, {"w": attach(torch.zeros(8, 384), block)}, verify=verify)
    # Outside the rows read, "touched" does not look (and loads), "full" does.
    tierstore.load_sharded(d, {"w": attach(torch.zeros(8, 384), block)}, verify="touched")
    f.write_bytes(original)


def test_tp_target_load_misses_no_flip(tmp_path: Path) -> None:
    d, _full = _rows(tmp_path, 2, (128, 256))
    f = _data_file(d)
    original = f.read_bytes()
    rng = random.Random(1)
    for lo, hi in _stored_ranges(d):
        for _ in range(25):
            f.write_bytes(original)
            _flip(f, rng.randrange(lo, hi))
            # Every byte of the tensor is needed by some TP target: load them all.
            sds = [{"w": attach(torch.zeros(128, 64), Layout.shard("w", (128, 256), 1, k, 4))} for k in range(4)]
            errors = 0
            for sd in sds:
                try:
                    tierstore.load_sharded(d, sd)
                except ChecksumError:
                    errors += 1
            assert errors >= 1, "a flip in bytes some target reads is reported"
    f.write_bytes(original)


def test_bytes_read_per_verify_mode(tmp_path: Path) -> None:
    d, full = _rows(tmp_path, 4, (512, 1024))
    out: dict[Any, dict[str, int]] = {}
    for mode in ("touched", "full", False):
        sd = _column_target((512, 1024), 1, 4)
        stats: dict[str, int] = {}
        tierstore.load_sharded(d, sd, verify=mode, stats=stats)
        assert torch.equal(sd["w"], full[:, 256:512])
        out[mode] = stats
    assert out[False]["bytes_read"] == out[False]["bytes_needed"]
    assert out["touched"]["bytes_read"] <= 1.10 * out["touched"]["bytes_needed_blocks"]
    assert out["full"]["bytes_verified"] == 512 * 1024 * 4  # every chunk of every record read from
    assert out["touched"]["bytes_verified"] == out["touched"]["bytes_read"]


def test_old_checkpoints_without_chunk_checksums_are_verified_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version-1 checkpoints (no chunk checksums, no manifest checksum) load;
    a record read in part is read whole and checked against its CRC-32."""
    import tierstore.api

    real_write = tierstore.api.write_file

    def v1_write(*a: Any, **kw: Any) -> Any:  # shard files as tierstore 0.1.0 wrote them
        kw.pop("chunk_checksums", None)
        return real_write(*a, **kw)

    monkeypatch.setattr(tierstore.api, "write_file", v1_write)
    d, full = _rows(tmp_path, 2, (64, 128), explicit=True)
    monkeypatch.undo()
    m = _manifest(d)
    m["format_version"] = 1
    for k in ("object_files", "attachments"):
        m.pop(k, None)
    for fe in m["files"]:
        fe.pop("manifest_crc32")
    (d / "manifest.json").write_text(json.dumps(m))
    assert b".tierstore/chunks" not in _data_file(d).read_bytes()
    sd = _column_target((64, 128), 0, 2)
    tierstore.load_sharded(d, sd)
    assert torch.equal(sd["w"], full[:, :64])
    _lo, hi = _stored_ranges(d)[1]
    _flip(_data_file(d), hi - 3)  # a byte of the last rows, in columns target 0 does not need
    with pytest.raises(ChecksumError):
        tierstore.load_sharded(d, _column_target((64, 128), 0, 2))


# ----------------------------------------------------------------------------------------------
# 2. metadata integrity


def test_manifest_checksum_catches_any_edit(tmp_path: Path) -> None:
    d, _full = _rows(tmp_path, 2, (32, 32))
    raw = (d / "manifest.json").read_bytes()
    rng = random.Random(2)
    for _ in range(50):
        at = rng.randrange(len(raw) - 30)  # not inside the checksum trailer itself
        bad = bytearray(raw)
        bad[at] ^= 1 << rng.randrange(8)
        (d / "manifest.json").write_bytes(bytes(bad))
        with pytest.raises(TierstoreError):
            tierstore.load_sharded(d, {"w": torch.zeros(32, 32)})
    (d / "manifest.json").write_bytes(raw)


@pytest.mark.parametrize(
    "edit",
    ["offset_digit", "swap_offsets", "transpose", "global_dtype", "record_size", "stored_dtype"],
)
def test_resealed_metadata_is_checked_against_the_data_files(tmp_path: Path, edit: str) -> None:
    """An attacker can recompute the checksum; the fields must still agree
    with the data files' own directory and manifest."""
    d, _full = _rows(tmp_path, 2, (32, 48), explicit=True)
    m = _manifest(d)
    s0, s1 = m["stored"][0], m["stored"][1]
    if edit == "offset_digit":
        s0["offset"] += 4
    elif edit == "swap_offsets":
        s0["offset"], s1["offset"] = s1["offset"], s0["offset"]
        s0["record_offset"], s1["record_offset"] = s1["record_offset"], s0["record_offset"]
    elif edit == "transpose":
        s0["shape"] = s0["shape"][::-1]
    elif edit == "global_dtype":
        m["tensors"]["w"]["dtype"] = "int32"
    elif edit == "record_size":
        s0["record_size"] += 4096
    elif edit == "stored_dtype":
        s0["dtype"] = "int32"
        m["tensors"]["w"]["dtype"] = "int32"
    _reseal(d, m)
    sd = {"w": torch.zeros(32, 48)}
    with pytest.raises(TierstoreError) as ei:
        tierstore.load_sharded(d, sd)
    assert "manifest" in str(ei.value) or "rank-" in str(ei.value)


@pytest.mark.parametrize(
    "edit",
    ["split_count", "split_dim", "swap_files", "move_position", "drop_position", "key", "dtype", "shape", "empty"],
)
def test_a_resealed_rule_is_checked_against_the_data_files(tmp_path: Path, edit: str) -> None:
    """A tensor stored by a sharding rule: manifest.json holds the rule and
    where each position is, no offsets. A re-sealed manifest that changes
    the rule, moves or drops a position, or renames what a file holds is
    refused: against the rule's own proof of coverage or against the layout
    each data file recorded for the tensor."""
    d = tmp_path / "ck"
    run_world(2, _save_two_ranks, str(d))
    m = _manifest(d)
    g = m["tensors"]["w"]
    grp = m["groups"][g["parts"][0][0]]
    if edit == "split_count":
        g["rule"]["splits"][0][1] = 1
    elif edit == "split_dim":
        g["rule"]["splits"][0][0] = 1
    elif edit == "swap_files":
        grp["files"] = grp["files"][::-1]
    elif edit == "move_position":
        grp["coords"][1] = [0]
    elif edit == "drop_position":
        grp["coords"], grp["files"] = grp["coords"][:1], grp["files"][:1]
    elif edit == "key":
        g["parts"][0][1] = "rng"
    elif edit == "dtype":
        g["dtype"] = "int32"
    elif edit == "shape":
        g["shape"] = [8, 16]
        g["rule"]["shape"] = [8, 16]
    elif edit == "empty":  # no element left to read: each position is still checked against its file
        g["shape"] = [0, 8]
        g["rule"]["shape"] = [0, 8]
        g["rule"]["splits"][0][3] = 0
    _reseal(d, m)
    with pytest.raises(TierstoreError):
        consolidate(d, per_rank_policy="rank0")
    with pytest.raises(TierstoreError):
        tierstore.load_sharded(d, {"w": torch.zeros(16, 8)})


def test_a_rule_is_stored_once_whatever_the_ranks(tmp_path: Path) -> None:
    """The manifest of a sharding rule names no per-rank offsets: a position
    is a file index, and the tensor's entry is the rule."""
    d = tmp_path / "ck"
    run_world(2, _save_two_ranks, str(d))
    m = _manifest(d)
    assert m["stored"] == [] and m["format_version"] == 3
    g = m["tensors"]["w"]
    assert g["rule"]["splits"] == [[0, 2, "even", 16]] and "pieces" not in g
    grp = m["groups"][g["parts"][0][0]]
    assert grp["coords"] == [[0], [1]] and len(set(grp["files"])) == 2
    sd = {"w": attach(torch.zeros(16, 4), Layout.shard("w", (16, 8), 1, 1, 2))}
    tierstore.load_sharded(d, sd)
    assert torch.equal(sd["w"], torch.arange(128, dtype=torch.float32).reshape(16, 8)[:, 4:])


def test_a_rank_file_replaced_by_another_ranks_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    run_world(2, _save_two_ranks, str(d))
    files = sorted(p for p in d.iterdir() if p.name.startswith("rank-"))
    assert len(files) == 2
    files[0].write_bytes(files[1].read_bytes())
    with pytest.raises(ManifestError, match="another"):
        consolidate(d, per_rank_policy="rank0")


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    t = attach(full[rank * 8 : (rank + 1) * 8].clone(), Layout.shard("w", (16, 8), 0, rank, world))
    tierstore.save_sharded({"w": t, "rng": tierstore.PerRank(torch.tensor([rank]))}, path)


def test_damaged_shard_of_one_rank_names_the_file(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    run_world(2, _save_two_ranks, str(d))
    s = next(s for s in stored_tensors(d) if s["rank"] == 1)
    victim = s["file"]
    _flip(victim, s["offset"] + 5)
    with pytest.raises(ChecksumError) as ei:
        consolidate(d, per_rank_policy="rank0")
    assert victim.name in str(ei.value)
    # The other rank's rows still load.
    sd = {"w": attach(torch.zeros(8, 8), Layout.shard("w", (16, 8), 0, 0, 2))}
    tierstore.load_sharded(d, sd)
    assert torch.equal(sd["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8))


# ----------------------------------------------------------------------------------------------
# 3. names confined to the checkpoint


@pytest.mark.parametrize("name", ["/etc/passwd", "../secret.pt", "sub/../../secret.pt", "", "a\0b"])
def test_file_names_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    d, _full = _rows(tmp_path, 2, (8, 8))
    m = _manifest(d)
    m["files"][0]["name"] = name
    _reseal(d, m)
    with pytest.raises(UnsafePathError):
        tierstore.load_sharded(d, {"w": torch.zeros(8, 8)})
    r = subprocess.run([sys.executable, "-m", "tierstore", "verify", str(d)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_symlink_leading_out_and_objects_names(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tierstore.save_sharded({"w": torch.ones(4), "epoch": 3}, d)
    outside = tmp_path / "elsewhere.pt"
    f = _data_file(d)
    f.rename(outside)
    f.symlink_to(outside)
    with pytest.raises(UnsafePathError, match="outside"):
        tierstore.load_sharded(d, {"w": torch.zeros(4)})
    f.unlink()
    outside.rename(f)
    m = _manifest(d)
    m["objects"]["epoch"] = "../../etc/hostname"
    _reseal(d, m)
    with pytest.raises(UnsafePathError):
        tierstore.load_sharded(d, {"epoch": None})


def test_a_fifo_named_as_a_data_file_does_not_block(tmp_path: Path) -> None:
    d, _full = _rows(tmp_path, 2, (8, 8))
    f = _data_file(d)
    f.unlink()
    os.mkfifo(f)
    done: list[BaseException] = []

    def go() -> None:
        for fn in (
            lambda: tierstore.load_sharded(d, {"w": torch.zeros(8, 8)}),
            lambda: consolidate(d),
            lambda: tierstore.cli.main(["verify", str(d)]),
        ):
            try:
                fn()
            except TierstoreError as e:
                done.append(e)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(30)
    assert not th.is_alive(), "a load blocked on a FIFO"
    assert len(done) == 2  # the CLI returns 1 instead of raising
    assert all(isinstance(e, UnsafePathError) for e in done)


def test_a_fifo_given_to_load_does_not_block(tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    os.mkfifo(p)
    with pytest.raises(UnsafePathError):
        tierstore.load(p)


# ----------------------------------------------------------------------------------------------
# 4. the coverage proof is exact


def test_overlap_plus_hole_of_the_same_size_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    sd = {f"p{r}": attach(full[2 * r : 2 * r + 2].clone(), _row_layout((8, 4), r, 4, True)) for r in range(4)}
    tierstore.save_sharded(sd, d)
    m = _manifest(d)
    # Rows 6-7 are now never covered, rows 2-3 covered twice.
    piece = next(p for p in m["tensors"]["w"]["pieces"] if p[1][0][0] == 6)
    piece[1][0][0] = 2
    _reseal(d, m)
    with pytest.raises(CoverageError, match="overlap"):
        tierstore.load_sharded(d, {"w": torch.zeros(8, 4)})
    r = subprocess.run([sys.executable, "-m", "tierstore", "inspect", "--json", str(d)], capture_output=True, text=True)
    assert r.returncode == 1
    assert not json.loads(r.stdout)["tensors"][0]["covered"]


# ----------------------------------------------------------------------------------------------
# 6. sizes checked before allocating


def test_exabyte_shape_is_refused_before_allocation(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tierstore.save_sharded({"w": torch.ones(4, 4)}, d)
    m = _manifest(d)
    m["tensors"]["w"]["shape"] = [1 << 30, 1 << 30]
    _reseal(d, m)
    with pytest.raises((CoverageError, ManifestError, ResourceLimitError)):
        consolidate(d, per_rank_policy="rank0")


def test_allocation_beyond_available_memory_is_refused(tmp_path: Path) -> None:
    from tierstore import _limits

    with pytest.raises(ResourceLimitError, match="memory"):
        _limits.check_allocation(1 << 60, "a test tensor")


# ----------------------------------------------------------------------------------------------
# 7. Checkpointer restores fall back on any damage


def _two_steps(tmp_path: Path) -> tuple[list[Any], Path]:
    tiers = [DiskTier("local", keep_last=3)]
    states = [{"model": {"w": torch.full((1000,), float(s))}, "step": s} for s in (1, 2)]
    with Checkpointer(tmp_path, tiers=tiers) as ck:
        for i, st in enumerate(states):
            ck.save(i + 1, st)
        ck.wait()
    return tiers, tmp_path / "local" / "step-000000000002"


@pytest.mark.parametrize(
    "damage",
    ["manifest_null", "manifest_list", "tree_wrong_type", "tree_renamed_key", "meta_deleted", "meta_flipped"],
)
def test_load_latest_falls_back_on_damage(tmp_path: Path, damage: str) -> None:
    tiers, newest = _two_steps(tmp_path)
    if damage == "manifest_null":
        (newest / "manifest.json").write_text("null")
    elif damage == "manifest_list":
        (newest / "manifest.json").write_text("[]")
    elif damage in ("tree_wrong_type", "tree_renamed_key"):
        meta, _ = _metadata.loads((newest / "checkpoint.json").read_bytes(), "c", required=False)
        meta["tree"] = {"a": 1} if damage == "tree_wrong_type" else [["model.w", ["model", "weigxt"]]]
        (newest / "checkpoint.json").write_bytes(_metadata.dumps(meta))
    elif damage == "meta_deleted":
        (newest / "checkpoint.json").unlink()
    elif damage == "meta_flipped":
        raw = bytearray((newest / "checkpoint.json").read_bytes())
        raw[raw.index(b"model") + 1] ^= 0x10
        (newest / "checkpoint.json").write_bytes(bytes(raw))
    ck = Checkpointer(tmp_path, tiers=tiers)
    with pytest.warns(UserWarning, match=r"step 2 on tier 'local'"):
        got = ck.load_latest()
    assert ck.restored is not None and ck.restored["step"] == 1
    assert torch.equal(got["model"]["w"], torch.full((1000,), 1.0)) and got["step"] == 1
    ck.close()


@pytest.mark.parametrize("target", ["other_job", "older_step"])
def test_a_step_directory_symlink_is_never_trusted(tmp_path: Path, target: str) -> None:
    other = tmp_path / "other"
    _tiers, _newest = _two_steps(other)
    tiers, _newest = _two_steps(tmp_path / "me")
    link = tmp_path / "me" / "local" / "step-000000000099"
    mine = tmp_path / "me" / "local" / "step-000000000001"
    src = other / "local" / "step-000000000002" if target == "other_job" else mine
    link.symlink_to(src, target_is_directory=True)
    ck = Checkpointer(tmp_path / "me", tiers=tiers)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = ck.load_latest()
    assert ck.restored is not None and ck.restored["step"] == 2
    assert got["step"] == 2
    assert any("symlink" in str(x.message) for x in w)
    ck.close()


# ----------------------------------------------------------------------------------------------
# 8. clear errors


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"format":"tierstore-sharded","format_version":' + "9" * 5000 + "}",
        '{"format":"tierstore-sharded","format_version":1,"save_id":"x","world_size":1,"files":[],"stored":[{}]}',
        '{"format":"tierstore-sharded","format_version":1,"save_id":"x","world_size":1,"files":[],"stored":[],'
        '"tensors":{"w":{"shape":[2],"dtype":"float32","pieces":[[7,[[0],[2]],0]]}}}',
        '{"format":"tierstore-sharded","format_version":1,"save_id":"x","world_size":1,"files":{},"stored":[]}',
        '{"format":"tierstore-sharded","format_version":1,"save_id":"x","world_size":1,"files":[[]],"stored":[]}',
    ],
)
def test_crafted_manifests_give_clear_errors(tmp_path: Path, text: str) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    (d / "manifest.json").write_text(text)
    with pytest.raises(ManifestError) as ei:
        tierstore.load_sharded(d, {"w": torch.zeros(2)})
    assert str(d / "manifest.json") in str(ei.value)
    r = subprocess.run([sys.executable, "-m", "tierstore", "inspect", str(d)], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_layout_and_coverage_errors_are_tierstore_errors() -> None:
    assert issubclass(tierstore.LayoutError, TierstoreError) and issubclass(tierstore.LayoutError, ValueError)
    assert issubclass(CoverageError, TierstoreError) and issubclass(CoverageError, ValueError)


def test_verify_dir_checks_objects_files(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tierstore.save_sharded({"w": torch.ones(4), "optim": {"lr": 0.1, "m": [1, 2, 3]}}, d)
    obj = next(p for p in d.iterdir() if p.name.startswith("objects-"))
    raw = bytearray(obj.read_bytes())
    i = raw.index(b"optim.lr")  # inside the pickled objects
    raw[i] ^= 0x01
    obj.write_bytes(bytes(raw))
    r = subprocess.run([sys.executable, "-m", "tierstore", "verify", str(d)], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout


def test_verify_file_checks_what_load_relies_on(tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    tierstore.save({"a": torch.ones(3)}, p)
    raw = bytearray(p.read_bytes())
    eocd = raw.rindex(b"PK\x05\x06")
    raw[eocd + 8] += 1  # entries on this disk
    raw[eocd + 10] += 1  # entries in total
    p.write_bytes(bytes(raw))
    load_ok = True
    try:
        tierstore.load(p)
    except TierstoreError:
        load_ok = False
    rc = tierstore.cli.main(["verify", str(p)])
    assert (rc == 0) == load_ok


@pytest.mark.parametrize("proto", [2, 4])
def test_deeply_nested_pickle_is_refused_not_a_crash(tmp_path: Path, proto: int) -> None:
    """CPython hashes nested tuples recursively in C: a data.pkl of 200,000
    nested tuples used as a dict key crashed the process (torch.load too)."""
    import zipfile

    p = tmp_path / "x.pt"
    torch.save({"a": torch.ones(2)}, p)
    with zipfile.ZipFile(p) as z:
        items = [(i, z.read(i.filename)) for i in z.infolist()]
    payload = b"\x80" + bytes([proto]) + b"}N" + b"\x85" * 200_000 + b"Ns."
    out = tmp_path / "deep.pt"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            z.writestr(info, payload if info.filename.endswith("data.pkl") else data)
    code = (
        f"import tierstore\ntry:\n    tierstore.load({str(out)!r})\n"
        "except tierstore.TierstoreError as e:\n    print('refused', e)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("refused"), (r.returncode, r.stdout, r.stderr[-500:])
    assert "nested" in r.stdout


@pytest.mark.parametrize("edit", ["transpose_all", "empty_tensor", "move_piece"])
def test_a_resealed_manifest_cannot_redescribe_what_a_file_holds(tmp_path: Path, edit: str) -> None:
    """Each data file records the layout of every tensor it holds: a manifest
    re-sealed with a valid checksum that consistently transposes a tensor,
    declares it empty, or moves a piece is refused against it."""
    d = tmp_path / "ck"
    full = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)
    sd = {f"p{r}": attach(full[2 * r : 2 * r + 2].clone(), _row_layout((4, 8), r, 2, True)) for r in range(2)}
    tierstore.save_sharded({**sd, "b": torch.ones(3)}, d)
    m = _manifest(d)
    g = m["tensors"]["w"]
    if edit == "transpose_all":
        g["shape"] = g["shape"][::-1]
        for s in m["stored"]:
            if s["key"].startswith("p"):
                s["shape"] = s["shape"][::-1]
        for pc in g["pieces"]:
            pc[1] = [pc[1][0][::-1], pc[1][1][::-1]]
            pc[2] = [pc[2][0][::-1], pc[2][1][::-1]]
    elif edit == "empty_tensor":
        g["shape"] = [0]
        g["pieces"] = []
    elif edit == "move_piece":
        g["pieces"][0][1][0] = [2, 0]
        g["pieces"][1][1][0] = [0, 0]
    _reseal(d, m)
    with pytest.raises(ManifestError, match=r"does not match manifest\.json"):
        consolidate(d)


def test_overlap_sweep_agrees_with_brute_force() -> None:
    import itertools

    from tierstore.layout import Box
    from tierstore.reshard import overlapping_pair

    rng = random.Random(3)
    for _ in range(3000):
        nd = rng.randrange(1, 4)
        boxes = [
            Box(tuple(rng.randrange(8) for _ in range(nd)), tuple(rng.randrange(0, 5) for _ in range(nd)))
            for _ in range(rng.randrange(2, 14))
        ]
        brute = next(
            ((i, j) for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2) if a.intersect(b) is not None),
            None,
        )
        got = overlapping_pair(boxes)
        assert (got is None) == (brute is None), boxes
        if got is not None:
            assert boxes[got[0]].intersect(boxes[got[1]]) is not None


def test_a_record_name_twice_in_the_directory_is_refused_by_path_and_stream_loads(tmp_path: Path) -> None:
    """Two directory entries with one name (fuzz case single:71000340: bit
    flips in the central directory): which copy is meant is unknowable, so
    both loads refuse the file, naming the record, instead of picking one."""
    p = tmp_path / "dup.pt"
    tierstore.save({"a": torch.arange(10), "b": torch.ones(10)}, p)
    raw = p.read_bytes()
    assert raw.count(b"/data/1") >= 2
    p.write_bytes(raw.replace(b"/data/1", b"/data/0"))
    with pytest.raises(CorruptFileError, match="data/0' appears twice"):
        tierstore.load(p)
    with open(p, "rb") as f, pytest.raises(CorruptFileError, match="data/0' appears twice"):
        tierstore.load(f)


def _own_manifest(p: Path) -> tuple[dict[str, Any], int, int]:
    """A data file's own manifest, the offset of its bytes in the file and their length."""
    import struct
    import zipfile

    with zipfile.ZipFile(p) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(".tierstore/manifest.json"))
        fm = json.loads(z.read(info))
    with open(p, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return fm, info.header_offset + 30 + name_len + extra_len, info.file_size


def _rewrite_own_manifest(p: Path, old: bytes, new: bytes) -> int:
    """Replaces ``old`` by ``new`` (same length) once in the data file's own
    ``.tierstore/manifest.json`` and fixes that record's CRC-32 in the zip's
    local header and central directory, as a forger who knows the zip
    format would; returns the new CRC-32."""
    import struct
    import zlib

    _fm, at, size = _own_manifest(p)
    data = bytearray(p.read_bytes())
    text = bytes(data[at : at + size])
    assert len(old) == len(new) and old in text
    fixed = text.replace(old, new, 1)
    data[at : at + len(fixed)] = fixed
    crc = zlib.crc32(fixed)
    hits = 0
    for sig, field in ((b"PK\x03\x04", 14), (b"PK\x01\x02", 16)):
        i = data.find(sig)
        while i >= 0:
            if sig == b"PK\x03\x04":
                n = struct.unpack_from("<H", data, i + 26)[0]
                name = bytes(data[i + 30 : i + 30 + n])
            else:
                n = struct.unpack_from("<H", data, i + 28)[0]
                name = bytes(data[i + 46 : i + 46 + n])
            if name.endswith(b".tierstore/manifest.json"):
                struct.pack_into("<I", data, i + field, crc)
                hits += 1
            i = data.find(sig, i + 4)
    assert hits == 2
    p.write_bytes(bytes(data))
    return crc


@pytest.mark.parametrize("explicit", [False, True])
def test_a_resealed_own_manifest_pointing_a_tensor_at_another_record_is_refused(tmp_path: Path, explicit: bool) -> None:
    """A data file's own manifest rewritten to say that a shard is in
    another record of the same size, with every checksum a forger can reach
    fixed (the zip's, the file's manifest CRC in manifest.json, the seal,
    and for an explicit piece its record, offset and CRC in manifest.json):
    the file's pickle still says which storage each tensor views, and the
    load, ``consolidate`` and ``verify`` refuse the file instead of
    returning the other shard's bytes."""
    d, _full = _rows(tmp_path, explicit=explicit)
    p = _data_file(d)
    fm, _at, _size = _own_manifest(p)
    other = next(r for r in fm["records"] if r["name"] == "data/1")
    crc = _rewrite_own_manifest(p, b'"record":"data/0"', b'"record":"data/1"')
    m = _manifest(d)
    for f in m["files"]:
        if f["name"] == p.name:
            f["manifest_crc32"] = crc
    for s in m.get("stored", []):  # an explicit piece names its record in manifest.json too
        if s.get("record") == "data/0":
            s.update(record="data/1", record_offset=other["offset"], offset=other["offset"], crc32=other["crc32"])
    _reseal(d, m)
    with pytest.raises(ManifestError, match=r"its data\.pkl says"):
        tierstore.load_sharded(d, _column_target((256, 384), 0, 2))
    with pytest.raises(ManifestError, match=r"its data\.pkl says"):
        consolidate(d, per_rank_policy="rank0")
    assert tierstore.cli.main(["verify", str(d)]) != 0


def test_dtypes_without_a_legacy_storage_class_pass_the_pickle_check(tmp_path: Path) -> None:
    """float8 and uint16 tensors pickle through untyped storages and
    ``_rebuild_tensor_v3``: the check of a shard file's manifest against
    its pickle reads them too (a control: nothing damaged, nothing refused)."""
    sd = {
        "f8": torch.randn(64, 8).to(torch.float8_e4m3fn),
        "u16": torch.arange(300, dtype=torch.int32).to(torch.uint16),
        "w": torch.randn(4, 4),
    }
    d = tmp_path / "ck"
    tierstore.save_sharded(sd, d)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    tierstore.load_sharded(d, out)
    for k, v in sd.items():
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    assert tierstore.cli.main(["verify", str(d)]) == 0


@pytest.mark.parametrize("edit", ["drop", "add", "change"])
def test_a_resealed_key_path_is_checked_against_the_files(tmp_path: Path, edit: str) -> None:
    """manifest.json's ``paths`` (how to rebuild integer keys and list
    indices) is re-sealed with a path dropped, added or changed: each data
    and objects file records the key paths of its own keys, and the load
    refuses the difference instead of giving ``"1"`` for the integer key 1."""
    sd = {"opt": {"state": {0: {"exp_avg": torch.randn(8), "step": 3}, 1: {"exp_avg": torch.randn(8), "step": 4}}},
          "w": torch.randn(4)}  # fmt: skip
    d = tmp_path / "ck"
    tierstore.save_sharded(sd, d)
    out: dict[str, Any] = {"opt": {"state": {}}, "w": torch.zeros(4)}
    tierstore.load_sharded(d, out)  # a control: as saved, integer keys included
    assert out["opt"]["state"][1]["step"] == 4 and torch.equal(
        out["opt"]["state"][0]["exp_avg"], sd["opt"]["state"][0]["exp_avg"]
    )
    m = _manifest(d)
    if edit == "drop":
        del m["paths"][next(k for k in m["paths"] if k.endswith("exp_avg"))]
    elif edit == "add":
        m["paths"]["w"] = ["w"]
    else:
        k = next(k for k in m["paths"] if k.endswith("step"))
        m["paths"][k] = k.split(".")
    _reseal(d, m)
    with pytest.raises(ManifestError, match="key path"):
        tierstore.load_sharded(d, {"opt": {"state": {}}, "w": torch.zeros(4)})


def test_damage_in_an_early_batch_of_a_long_read_stops_the_batches_in_flight(tmp_path: Path) -> None:
    """A record read whole goes to the device in batches of 32 MiB, several
    in flight while the oldest is verified: damage in the first batch fails
    the load naming its chunk, the later batches are cancelled and joined
    (they write into the caller's tensor), and the next load is unharmed."""
    n = 40 * 2**20  # 160 MiB of float32: five batches
    x = torch.arange(n, dtype=torch.float32)
    d = tmp_path / "long"
    tierstore.save_sharded({"x": x}, d)
    f = _data_file(d)
    (lo, _hi) = _stored_ranges(d)[0]
    _flip(f, lo + 512 * 1000 + 7)
    y = torch.empty(n)
    with pytest.raises(ChecksumError, match=r"\(chunk 1000;"):
        tierstore.load_sharded(d, {"x": y})
    _flip(f, lo + 512 * 1000 + 7)
    z = torch.empty(n)
    tierstore.load_sharded(d, {"x": z})
    assert torch.equal(z, x)
