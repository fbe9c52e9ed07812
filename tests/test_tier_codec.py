"""Codec tiers (issue 18): a Checkpointer's remote tier storing deltas
against keyframes, read back bit-exact by every reader; retention that
keeps references; damaged or hostile encoded files refused by name."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
import tierstore.cli
from tierstore import _metadata, _tier_codec, _tier_steps
from tierstore.errors import ChecksumError, CorruptFileError, InvalidArgumentError, TierstoreError
from tierstore.layout import Layout, attach
from tierstore.sharded import consolidate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Two frozen layers (their chunks equal the keyframe's) and one that trains.
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    for p in [*m[0].parameters(), *m[1].parameters()]:
        p.requires_grad_(False)
    return m


def _run(
    root: Path, saves: int, every: int = 3, keep_last: int | None = None, reference: str = "keyframe"
) -> tuple[Any, list[dict[str, Any]]]:
    """Trains ``saves`` steps, saving each; returns the checkpointer's tier
    list factory and each step's state (cloned)."""
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    states: list[dict[str, Any]] = []
    with tierstore.Checkpointer(root / "run", tiers=_tiers(root, every, keep_last, reference)) as ck:
        for step in range(1, saves + 1):
            loss = model(torch.randn(8, 256)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            ck.wait()
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return model, states


def _tiers(root: Path, every: int, keep_last: int | None = None, reference: str = "keyframe") -> list[Any]:
    return [
        tierstore.HostTier("256MiB"),
        tierstore.DiskTier("local", keep_last=1),
        tierstore.RemoteTier(
            str(root / "remote"),
            codec=tierstore.Delta(keyframe_every=every, reference=reference),
            keep_last=keep_last,
        ),
    ]


def _meta(d: Path) -> dict[str, Any]:
    return _metadata.loads((d / "codec.json").read_bytes(), str(d), required=True)[0]


def _steps(root: Path) -> list[Path]:
    return sorted((root / "remote").glob("step-*"))


def test_remote_deltas_restore_bit_exact_and_shrink(tmp_path: Path) -> None:
    _m, states = _run(tmp_path, 7, every=3)
    steps = _steps(tmp_path)
    assert len(steps) == 7
    metas = [_meta(d) for d in steps]
    assert [m["keyframe"] for m in metas] == [True, False, False, True, False, False, True]
    assert [m["reference"] for m in metas[1:3]] == [steps[0].name] * 2  # a star: deltas name the keyframe
    for d in steps:
        assert not list(d.glob("rank-*.pt")) and len(list(d.glob("rank-*.pt.tsd"))) == 1
        h, _ = _tier_codec.read_header(next(d.glob("rank-*.pt.tsd")))
        assert (h["reference"] is None) == _meta(d)["keyframe"]
    # A delta of a model whose first two layers are frozen: those records equal the keyframe's.
    key = next(steps[0].glob("rank-*.tsd")).stat().st_size
    delta = next(steps[1].glob("rank-*.tsd")).stat().st_size
    raw = _tier_codec.read_header(next(steps[1].glob("rank-*.tsd")))[0]["bytes"]
    assert delta < 0.6 * key and key < raw, (delta, key, raw)
    # The local tier lost: the restore decodes the newest remote delta against its keyframe.
    shutil.rmtree(tmp_path / "run" / "local")
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 3)) as ck:
        got = ck.load_latest()
        assert ck.restored is not None and ck.restored["tier"] == "remote"
    for k, v in states[-1].items():
        assert torch.equal(got["model"][k], v), k
    # Every step reads back exactly, through load_sharded and verify.
    for i, d in enumerate(steps):
        w = states[i]["2.weight"]
        out = {"model.2.weight": torch.zeros_like(w)}
        tierstore.load_sharded(d, out)
        assert torch.equal(out["model.2.weight"], w), d.name
        assert tierstore.cli.main(["verify", str(d)]) == 0


def test_a_delta_checkpoint_reshards(tmp_path: Path) -> None:
    """A resharding load of a delta: each target rank's rows of a tensor."""
    _m, states = _run(tmp_path, 2, every=4)
    d = _steps(tmp_path)[1]
    assert not _meta(d)["keyframe"]
    w = states[1]["1.weight"]
    for r in range(4):
        lay = Layout.shard("model.1.weight", tuple(w.shape), 0, r, 4)
        out = {"model.1.weight": attach(torch.zeros(w.shape[0] // 4, w.shape[1]), lay)}
        tierstore.load_sharded(d, out)
        assert torch.equal(out["model.1.weight"], w[r * 128 : (r + 1) * 128])


def test_retention_keeps_the_keyframe_of_a_kept_delta(tmp_path: Path) -> None:
    _run(tmp_path, 3, every=4, keep_last=1)
    names = [d.name for d in _steps(tmp_path)]
    # keep_last=1 keeps step 3, a delta against step 1: step 1 stays, step 2 goes.
    assert names == ["step-000000000001", "step-000000000003"], names
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 4, keep_last=1)) as ck:
        shutil.rmtree(tmp_path / "run" / "local")
        assert ck.load_latest() is not None and ck.restored is not None and ck.restored["step"] == 3


def _file_reference(d: Path) -> str | None:
    ref = _tier_codec.read_header(next(d.glob("rank-*.pt.tsd")))[0]["reference"]
    return None if ref is None else str(ref["step_dir"])


def test_parent_chains_restore_every_step_and_keep_their_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Delta(reference="parent")``: each delta is encoded against the
    checkpoint before it, back to the keyframe; every step decodes bit-exact
    from the tier alone (a whole record in one pass down its chain), a
    checkpoint a later delta needs cannot be deleted, and retention keeps
    the whole chain of what it keeps."""
    links: list[int] = []
    real = _tier_codec._core.codec_decode_chain_span

    def spy(heads: Any, *a: Any, **kw: Any) -> bool:
        links.append(len(heads))
        return real(heads, *a, **kw)

    monkeypatch.setattr(_tier_codec._core, "codec_decode_chain_span", spy)
    _m, states = _run(tmp_path, 5, every=4, reference="parent")
    steps = _steps(tmp_path)
    metas = [_meta(d) for d in steps]
    assert [m["keyframe"] for m in metas] == [True, False, False, False, True]
    assert [m["references"] for m in metas] == [[], [steps[0].name], [steps[1].name], [steps[2].name], []]
    assert [_file_reference(d) for d in steps] == [None, steps[0].name, steps[1].name, steps[2].name, None]
    remote = _tier_steps.run_stats([tmp_path / "remote"])["tiers"][str(tmp_path / "remote")]
    assert (remote["keyframes"], remote["deltas"], remote["longest_chain"]) == (2, 3, 3)
    shutil.rmtree(tmp_path / "run")  # no raw copy left anywhere: only the tier's encoded files
    for i, d in enumerate(steps):
        w = states[i]["2.weight"]
        out = {"model.2.weight": torch.zeros_like(w)}
        links.clear()
        tierstore.load_sharded(d, out, verify="full")  # every record read whole
        assert torch.equal(out["model.2.weight"], w), d.name
        assert max(links, default=1) == [1, 2, 3, 4, 1][i], (d.name, links)  # the chain's links, in one pass
    with pytest.raises(tierstore.ReferencedCheckpointError) as e:
        tierstore.delete_checkpoint(steps[1])
    assert e.value.dependents == [str(steps[2])]
    tierstore.delete_checkpoint(steps[3])  # the end of a chain goes on its own
    # Retention: keep_last=1 keeps step 3 of a new run, and with it steps 2 and 1.
    root = tmp_path / "again"
    _run(root, 3, every=4, keep_last=1, reference="parent")
    assert [d.name for d in _steps(root)] == [f"step-{i:012d}" for i in (1, 2, 3)]
    shutil.rmtree(root / "run" / "local")
    with tierstore.Checkpointer(root / "run", tiers=_tiers(root, 4, keep_last=1, reference="parent")) as ck:
        assert ck.load_latest() is not None and ck.restored is not None and ck.restored["step"] == 3


def test_best_reference_picks_per_file_among_keyframe_and_parent(tmp_path: Path) -> None:
    _m, states = _run(tmp_path, 3, every=4, reference="best")
    steps = _steps(tmp_path)
    assert _meta(steps[1])["references"] == [steps[0].name]  # the parent is the keyframe
    assert _meta(steps[2])["references"] == [steps[0].name, steps[1].name]
    assert _file_reference(steps[2]) in (steps[0].name, steps[1].name)
    # Retention and deletion count every candidate as needed.
    with pytest.raises(tierstore.ReferencedCheckpointError):
        tierstore.delete_checkpoint(steps[1])
    shutil.rmtree(tmp_path / "run" / "local")
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 4, reference="best")) as ck:
        got = ck.load_latest()
    for k, v in states[-1].items():
        assert torch.equal(got["model"][k], v), k


def test_each_record_takes_the_reference_it_is_closest_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(3)

    def noise() -> torch.Tensor:
        return torch.randn(256, 1024, generator=g)

    w0, v0 = noise(), noise()
    src = {"w": w0 + 1e-4 * noise(), "v": v0 + 1e-4 * noise(), "u": noise(), "b": torch.zeros(10)}
    # Reference A is close in w, B in v; only B holds u at all.
    a = {"w": w0 + 1e-4 * noise(), "v": noise(), "b": torch.zeros(10)}
    b = {"w": noise(), "v": v0 + 1e-4 * noise(), "u": src["u"] + 1e-4 * noise(), "b": torch.zeros(10)}
    tier = tmp_path / "tier"
    name = "rank-00000.x.pt"
    paths = {}
    for step, sd in ((1, a), (2, b)):
        d = tier / f"step-{step:012d}"
        d.mkdir(parents=True)
        tierstore.save({"m": sd}, d / name)
        paths[step] = d / name
    tierstore.save({"m": src}, tmp_path / name)
    spec = tierstore.codec.resolve(tierstore.Delta())
    assert spec is not None
    out_dir = tier / "step-000000000003"
    out_dir.mkdir()
    dst = out_dir / (name + _tier_codec.SUFFIX)
    _tier_codec.encode_file(tmp_path / name, dst, spec, [(p.parent.name, p) for p in paths.values()])
    h, _at = _tier_codec.read_header(dst)
    assert h["version"] == _tier_codec.VERSION_REFS
    used = {lab: h["refs"][k]["step_dir"] for lab, k in zip(h["labels"], h["seg_refs"], strict=True) if k >= 0}
    assert used == {"w": "step-000000000001", "v": "step-000000000002", "u": "step-000000000002"}, used
    assert h["reference"] == h["refs"][0]
    dec = _tier_codec.Decoder()
    try:
        got = dec.raw(dst)
        dec.ensure_all(got)
        assert got.read_bytes() == (tmp_path / name).read_bytes()
    finally:
        dec.close()
    assert tierstore.cli.main(["inspect", str(dst)]) == 0
    shown = capsys.readouterr().out
    assert "#1 step-000000000001/" in shown and "#2 step-000000000002/" in shown
    assert tierstore.cli.main(["inspect", "--json", str(dst)]) == 0
    rows = {r["reference_step"] for r in json.loads(capsys.readouterr().out)["segments"]}
    assert rows == {None, "step-000000000001", "step-000000000002"}
    # Both steps are needed by it: deleting either is refused.
    for step in (1, 2):
        assert out_dir in _tier_steps.dependents(tier / f"step-{step:012d}")
    # One candidate, or one that every record prefers: version 1 as before.
    _tier_codec.encode_file(tmp_path / name, dst, spec, [("step-000000000002", paths[2])])
    h1, _ = _tier_codec.read_header(dst)
    assert h1["version"] == _tier_codec.VERSION and h1["reference"]["step_dir"] == "step-000000000002"


def test_a_damaged_keyframe_is_named_and_the_restore_moves_on(tmp_path: Path) -> None:
    _run(tmp_path, 4, every=3)
    steps = _steps(tmp_path)
    key = next(steps[0].glob("rank-*.tsd"))
    data = bytearray(key.read_bytes())
    data[len(data) // 2] ^= 0x40
    key.write_bytes(bytes(data))
    with pytest.raises(TierstoreError, match="segment") as e:
        consolidate(steps[1], per_rank_policy="rank0")
    assert key.name in str(e.value)
    # The newest step (a keyframe of its own) is intact; the deltas of the damaged keyframe are not.
    shutil.rmtree(tmp_path / "run" / "local")
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 3)) as ck:
        assert ck.load_latest() is not None and ck.restored is not None and ck.restored["step"] == 4
        for d in steps[1:3]:
            with pytest.raises(TierstoreError):
                consolidate(d, per_rank_policy="rank0")


def test_a_partial_load_decodes_only_the_records_it_reads(tmp_path: Path) -> None:
    """A load of some tensors of a delta decodes only their records (and
    the same records of the keyframe): damage to another record of the
    keyframe is never touched, while a load of everything meets it."""
    _m, states = _run(tmp_path, 2, every=4)
    steps = _steps(tmp_path)
    key = next(steps[0].glob("rank-*.tsd"))
    h, at = _tier_codec.read_header(key)
    i = next(i for i, lab in enumerate(h["labels"]) if lab == "model.1.weight")
    start = at + sum(seg[4] for seg in h["segments"][:i])
    data = bytearray(key.read_bytes())
    data[start + h["segments"][i][4] // 2] ^= 0x10  # inside the keyframe's stream of model.1.weight
    key.write_bytes(bytes(data))
    out = {"model.2.weight": torch.zeros(256, 512)}
    tierstore.load_sharded(steps[1], out)
    assert torch.equal(out["model.2.weight"], states[1]["2.weight"])
    with pytest.raises(TierstoreError, match="segment"):
        tierstore.load_sharded(steps[1], {"model.1.weight": torch.zeros(512, 512)})


def test_a_row_shard_of_a_delta_reads_and_decodes_only_its_chunks(tmp_path: Path) -> None:
    """Within a record too: a resharding load of rows of a 16 MiB tensor
    decodes only the codec chunks (1 MiB) its rows lie in, of the delta and
    of its keyframe, and reads only their payloads; damage to a chunk it
    does not need is never met, while a load of the rows there meets it."""
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(4096, 1024, generator=g)
    w2 = w1 + 1e-3 * torch.randn(4096, 1024, generator=g)
    tiers = _tiers(tmp_path, 4)
    with tierstore.Checkpointer(tmp_path / "run", tiers=tiers) as ck:
        for step, w in ((1, w1), (2, w2)):
            ck.save(step, {"w": w})
            ck.wait()
    key, delta = (next(d.glob("rank-*.tsd")) for d in _steps(tmp_path))
    # Damage the keyframe's last chunk of "w" (the last rows).
    h, at = _tier_codec.read_header(key)
    i = h["labels"].index("w")
    end = at + sum(seg[4] for seg in h["segments"][: i + 1])
    data = bytearray(key.read_bytes())
    data[end - 100] ^= 0x08
    key.write_bytes(bytes(data))

    def rows(r: int) -> dict[str, torch.Tensor]:
        return {"w": attach(torch.zeros(1024, 1024), Layout.shard("w", (4096, 1024), 0, r, 4))}

    calls: list[tuple[int, int, int]] = []
    real = _tier_codec._core.codec_decode_chain_span

    def spy(heads: Any, lens: Any, windows: Any, bases: Any, first: int, last: int, *a: Any, **kw: Any) -> bool:
        calls.append((len(heads), first, last))
        return real(heads, lens, windows, bases, first, last, *a, **kw)

    _tier_codec._core.codec_decode_chain_span = spy  # type: ignore[assignment]
    try:
        out = rows(0)
        tierstore.load_sharded(delta.parent, out)
    finally:
        _tier_codec._core.codec_decode_chain_span = real  # type: ignore[assignment]
    assert torch.equal(out["w"], w2[:1024])
    # The rows' chunks of "w" (4 of 16) in one pass down delta -> keyframe.
    assert (2, 0, 4) in calls, calls
    with pytest.raises(TierstoreError, match="segment"):
        tierstore.load_sharded(delta.parent, rows(3))
    # What the decoder reads of the delta for a quarter of the rows.
    dh, _ = _tier_codec.read_header(delta)
    seg = dh["segments"][dh["labels"].index("w")]
    dec = _tier_codec.Decoder()
    try:
        raw = dec.raw(delta)
        before = {p: o.bytes_read for p, o in dec._open.items()}
        dec.ensure(raw, [(seg[0], seg[0] + seg[1] // 4)])
        got = dec._open[Path(os.path.abspath(delta))].bytes_read - before[Path(os.path.abspath(delta))]
    finally:
        dec.close()
    assert 0 < got < 0.35 * seg[4], (got, seg[4])


def test_a_replaced_keyframe_is_refused(tmp_path: Path) -> None:
    """A keyframe file swapped for another intact one (another step's):
    its fingerprint is not the one the delta recorded."""
    _run(tmp_path, 5, every=3)
    steps = _steps(tmp_path)
    a = next(steps[0].glob("rank-*.tsd"))
    b = next(steps[3].glob("rank-*.tsd"))  # the second keyframe
    shutil.copyfile(b, a)
    with pytest.raises(CorruptFileError, match="not the file it was encoded against"):
        tierstore.load_sharded(steps[1], {"model.2.bias": torch.zeros(256)})


def _hostile(p: Path, edit: str) -> None:
    data = bytearray(p.read_bytes())
    hlen = struct.unpack_from("<I", data, len(data) - 16)[0]
    at = len(data) - 16 - hlen
    h = json.loads(bytes(data[at : at + hlen]))
    if edit == "magic":
        data[0:8] = b"PK\x03\x04xxxx"
    elif edit == "truncate":
        del data[len(data) - 100 :]
    elif edit == "header_flip":
        data[at + 20] ^= 1
    else:
        if edit == "huge":
            h["segments"][-1][1] = 1 << 50
            h["bytes"] = sum(s[1] for s in h["segments"])
        elif edit == "gap":
            h["segments"][1][0] += 1
        elif edit == "ref_outside":
            h["reference"] = {"step_dir": "../../etc", "name": "passwd", "bytes": 1, "manifest_crc32": 0}
        elif edit == "ref_name":
            h["reference"] = {"step_dir": "step-000000000001", "name": "../x", "bytes": 1, "manifest_crc32": 0}
        elif edit == "negative":
            h["segments"][0][4] = -5
        elif edit.startswith("refs_"):
            # Version 2 (a reference per segment), each field wrong in turn.
            ref = h["reference"]
            assert ref is not None
            h["version"] = 2
            h["references"] = [ref, dict(ref)]
            for sg in h["segments"]:
                sg.append(0 if sg[3] >= 0 else -1)
            refd = [sg for sg in h["segments"] if sg[3] >= 0]
            if edit == "refs_outside":
                h["references"][1] = {**ref, "step_dir": "../../etc", "name": "passwd"}
            elif edit == "refs_index":
                refd[0][5] = 2
            elif edit == "refs_none":
                refd[0][5] = -1
            elif edit == "refs_first":
                h["references"][0] = {**ref, "name": "rank-00009.x.pt"}
            elif edit == "refs_many":
                h["references"] = [ref] * 5
            elif edit == "refs_fields":
                refd[0].pop()
        hb = json.dumps(h).encode()
        data[at:] = hb + struct.pack("<II", len(hb), zlib.crc32(hb)) + b"TSDELTA1"
    p.write_bytes(bytes(data))


HOSTILE = [
    "magic",
    "truncate",
    "header_flip",
    "huge",
    "gap",
    "ref_outside",
    "ref_name",
    "negative",
    "refs_outside",
    "refs_index",
    "refs_none",
    "refs_first",
    "refs_many",
    "refs_fields",
]


@pytest.mark.parametrize("edit", HOSTILE)
def test_hostile_encoded_files_are_refused(tmp_path: Path, edit: str) -> None:
    """Encoded files crafted by an attacker (their header re-sealed): a
    clear error naming the file, nothing read outside the tier, nothing
    allocated that the file does not hold."""
    _run(tmp_path, 2, every=4)
    d = _steps(tmp_path)[1]
    p = next(d.glob("rank-*.tsd"))
    _hostile(p, edit)
    with pytest.raises(TierstoreError) as e:
        tierstore.load_sharded(d, {"model.2.bias": torch.zeros(256)})
    assert p.name in str(e.value) or str(d) in str(e.value)


def test_a_well_formed_version_2_header_loads(tmp_path: Path) -> None:
    """The same file re-sealed as version 2 (a reference per segment) with
    nothing wrong loads: the refusals above are the edits', not the version's."""
    _run(tmp_path, 2, every=4)
    d = _steps(tmp_path)[1]
    p = next(d.glob("rank-*.tsd"))
    want = tierstore.load_sharded(d, {"model.2.bias": torch.zeros(256)})
    _hostile(p, "refs_valid")
    assert _tier_codec.read_header(p)[0]["version"] == 2
    got = tierstore.load_sharded(d, {"model.2.bias": torch.zeros(256)})
    assert torch.equal(got["model.2.bias"], want["model.2.bias"])


@pytest.mark.parametrize("share", [None, 0.5])
def test_a_delta_grown_past_a_share_of_its_keyframe_starts_a_new_one(tmp_path: Path, share: float | None) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(300_000, generator=g)
    states = [
        base,
        base + 1e-6 * torch.randn(300_000, generator=g),  # a small delta
        torch.randn(300_000, generator=g),  # all new: as large as a keyframe
        torch.randn(300_000, generator=g),
        torch.randn(300_000, generator=g),
    ]
    tiers = [
        tierstore.HostTier("64MiB"),
        tierstore.DiskTier("local", keep_last=1),
        tierstore.RemoteTier(str(tmp_path / "remote"), codec=tierstore.Delta(keyframe_every=100, keyframe_share=share)),
    ]
    with tierstore.Checkpointer(tmp_path / "run", tiers=tiers) as ck:
        for step, w in enumerate(states, 1):
            ck.save(step, {"w": w})
            ck.wait()
    metas = [_meta(d) for d in _steps(tmp_path)]
    keyframes = [m["keyframe"] for m in metas]
    if share is None:
        assert keyframes == [True, False, False, False, False]
    else:
        # Step 3's delta stores about what a keyframe does: step 4 is a
        # keyframe; step 5's delta against it is as large again: step 6
        # would be one too. Step 2's small delta did not end the series.
        assert keyframes == [True, False, False, True, False], keyframes
        assert metas[0]["keyframe_share"] == share
    shutil.rmtree(tmp_path / "run" / "local")
    with tierstore.Checkpointer(tmp_path / "run", tiers=tiers) as ck:
        got = ck.load_latest()
    assert torch.equal(got["w"], states[-1])


def test_a_restore_decodes_whole_records_straight_into_the_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _m, states = _run(tmp_path, 2, every=4)
    d = _steps(tmp_path)[1]  # a delta against step 1
    stored: list[tuple[str, str]] = []
    real = _tier_codec.Decoder._store

    def spy(self: Any, o: Any, i: int, at: int, out: torch.Tensor, chunks: range) -> None:
        stored.append((o.enc.parent.name, o.header["labels"][i]))
        real(self, o, i, at, out, chunks)

    monkeypatch.setattr(_tier_codec.Decoder, "_store", spy)
    names = ("model.2.weight", "model.1.weight")
    want = {"model.2.weight": torch.zeros(256, 512), "model.1.weight": torch.zeros(512, 512)}
    got = tierstore.load_sharded(d, want)
    assert torch.equal(got["model.2.weight"], states[-1]["2.weight"])
    assert torch.equal(got["model.1.weight"], states[-1]["1.weight"])
    # Those records of the step read went through no decoded file (its
    # keyframe's may have: references are read from there where needed).
    assert all(lab in _tier_codec.read_header(f)[0]["labels"] for f in d.glob("rank-*.tsd") for lab in names)
    assert not [x for x in stored if x[0] == d.name and x[1] in names], stored
    # A column shard is no whole record: decoded into the file and read from there, the same bytes.
    stored.clear()
    lay = Layout.shard("model.2.weight", (256, 512), 1, 1, 2)
    half = tierstore.load_sharded(d, {"model.2.weight": attach(torch.zeros(256, 256), lay)})
    assert torch.equal(half["model.2.weight"], states[-1]["2.weight"][:, 256:])
    assert (d.name, "model.2.weight") in stored


def test_a_record_whose_decoded_bytes_miss_its_checksums_is_named(tmp_path: Path) -> None:
    """An encoded file that decodes cleanly (its own xxh3 checks pass) to
    bytes that are not the record's: the record's checksums, checked in the
    destination after a straight decode, name it."""
    _run(tmp_path, 1, every=4)
    d = _steps(tmp_path)[0]
    enc = next(d.glob("rank-*.tsd"))
    dec = _tier_codec.Decoder()
    try:
        raw = dec.raw(enc)
        dec.ensure_all(raw)
        bad = tmp_path / raw.name
        shutil.copyfile(raw, bad)
    finally:
        dec.close()
    h, _at = _tier_codec.read_header(enc)
    k = h["labels"].index("model.2.weight")
    at, length = h["segments"][k][:2]
    data = bytearray(bad.read_bytes())
    data[at + length // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    spec = tierstore.codec.resolve(tierstore.Delta())
    assert spec is not None
    _tier_codec.encode_file(bad, enc, spec)
    with pytest.raises(ChecksumError) as e:
        tierstore.load_sharded(d, {"model.2.weight": torch.zeros(256, 512)})
    assert "model.2.weight" in str(e.value) or "data/" in str(e.value)
    assert enc.name.removesuffix(".tsd") in str(e.value)
    # Unverified, it loads (the damaged bytes: what the file holds).
    tierstore.load_sharded(d, {"model.2.weight": torch.zeros(256, 512)}, verify=False)


def test_tier_codec_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="first disk tier"):
        tierstore.Checkpointer("x", tiers=[tierstore.DiskTier("a", codec="zstd")])
    with pytest.raises(InvalidArgumentError, match="lossless"):
        tierstore.RemoteTier("/tmp/r", codec=tierstore.Delta(keep_bits={"*": 10}))
    with pytest.raises(InvalidArgumentError, match="node"):
        tierstore.DiskTier("a", scope="node", codec="zstd")
    for bad in (0, -1.0, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(InvalidArgumentError, match="keyframe_share"):
            tierstore.Delta(keyframe_share=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unknown codec"):
        tierstore.RemoteTier("/tmp/r", codec="lz4")
    with pytest.raises(InvalidArgumentError, match="reference must be one of keyframe, parent, best"):
        tierstore.Delta(reference="sideways")
    with pytest.raises(InvalidArgumentError, match="at most 64"):
        tierstore.Delta(reference="parent", keyframe_every=65)
    assert tierstore.Delta(reference="keyframe", keyframe_every=65).keyframe_every == 65
    assert not os.path.exists("x")


def test_zstd_tier_stores_keyframes_only(tmp_path: Path) -> None:
    tiers = [
        tierstore.HostTier("64MiB"),
        tierstore.DiskTier("local"),
        tierstore.RemoteTier(str(tmp_path / "remote"), codec="zstd"),
    ]
    sd = {"w": torch.zeros(256, 256), "b": torch.arange(100000)}
    with tierstore.Checkpointer(tmp_path / "run", tiers=tiers) as ck:
        for s in (1, 2):
            ck.save(s, sd)
            ck.wait()
    for d in _steps(tmp_path):
        assert _meta(d)["keyframe"] and _meta(d)["reference"] is None
        enc = next(d.glob("rank-*.tsd"))
        assert enc.stat().st_size < 0.2 * _tier_codec.read_header(enc)[0]["bytes"]
    out = {"w": torch.ones(256, 256), "b": torch.zeros(100000, dtype=torch.int64)}
    tierstore.load_sharded(_steps(tmp_path)[1], out)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])


def test_stats_counts_bytes_per_tier_and_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tierstore stats``: what each tier holds and stores, per tensor
    class, from the encoded files' headers (nothing decoded)."""
    _run(tmp_path, 3, every=4)
    got = _tier_steps.run_stats([tmp_path / "remote", tmp_path / "run"])["tiers"]
    remote = got[str(tmp_path / "remote")]
    local = got[str(tmp_path / "run" / "local")]
    assert (remote["steps"], remote["keyframes"], remote["deltas"], remote["longest_chain"]) == (3, 1, 2, 1)
    assert local["steps"] == 1 and local["raw"] == local["stored"]
    # Each remote step holds what the local one does; the remote stores less.
    assert remote["raw"] == 3 * local["raw"] or abs(remote["raw"] - 3 * local["raw"]) < 0.01 * remote["raw"]
    assert remote["stored"] < remote["raw"] / 1.5
    classes = remote["classes"]
    assert {"weights", "first moment", "second moment", "metadata"} <= set(classes)
    stored = sum(p.stat().st_size for p in (tmp_path / "remote").rglob("*") if p.is_file())
    assert remote["stored"] == stored
    assert tierstore.cli.main(["stats", str(tmp_path / "remote")]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoints, 1 keyframes, 2 deltas" in out and "second moment" in out
    assert tierstore.cli.main(["stats", str(tmp_path / "nothing")]) == 1


def test_deleting_a_keyframe_still_needed_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A delta is deleted on its own; its keyframe only once no delta
    needs it (the refusal names the dependents, and deletes nothing)."""
    _run(tmp_path, 3, every=4)
    steps = _steps(tmp_path)
    with pytest.raises(tierstore.ReferencedCheckpointError) as e:
        tierstore.delete_checkpoint(steps[0])
    assert steps[1].name in str(e.value) and steps[2].name in str(e.value)
    assert sorted(e.value.dependents) == [str(steps[1]), str(steps[2])]
    assert all(d.is_dir() for d in steps)
    assert tierstore.cli.main(["delete", str(steps[0])]) == 1
    assert "delete them first" in capsys.readouterr().err
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 4)) as ck:
        with pytest.raises(tierstore.ReferencedCheckpointError):
            ck.delete(1)
        local3 = tmp_path / "run" / "local" / "step-000000000003"
        assert ck.delete(3) == [str(local3), str(steps[2])]  # a delta: on its own, from every tier
        assert not local3.exists() and not steps[2].exists()
    tierstore.delete_checkpoint(steps[1])
    out = {"model.2.bias": torch.zeros(256)}
    assert tierstore.cli.main(["delete", str(steps[0])]) == 0  # no dependent left
    assert not steps[0].exists()
    with pytest.raises(TierstoreError):
        tierstore.load_sharded(steps[0], out)


def test_inspect_an_encoded_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, 2, every=4)
    delta = next(_steps(tmp_path)[1].glob("rank-*.tsd"))
    assert tierstore.cli.main(["inspect", str(delta)]) == 0
    out = capsys.readouterr().out
    assert "a delta against step-000000000001/rank-00000." in out and "model.2.weight" in out
    assert tierstore.cli.main(["inspect", "--json", str(delta)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["reference"]["step_dir"] == "step-000000000001"
    assert sum(s["bytes"] for s in got["segments"]) == got["bytes"]
    w = next(s for s in got["segments"] if s["tensor"] == "model.0.weight")
    assert w["reference"] == "yes" and w["ratio"] > 100  # a frozen layer: its chunks equal the keyframe's


def test_a_restore_decodes_under_the_first_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Checkpointer's restore from a codec tier decodes under its first
    disk tier (storage meant for checkpoints), not the system's temporary
    folder, and leaves nothing there."""
    monkeypatch.delenv("TIERSTORE_DECODE_DIR", raising=False)
    _run(tmp_path, 2, every=4)
    shutil.rmtree(tmp_path / "run" / "local")
    seen: list[str] = []
    real = _tier_codec.Decoder._open_file

    def spy(self: Any, enc: Path, stack: tuple[Path, ...] = ()) -> Any:
        o = real(self, enc, stack)
        seen.append(str(o.out))
        return o

    monkeypatch.setattr(_tier_codec.Decoder, "_open_file", spy)
    with tierstore.Checkpointer(tmp_path / "run", tiers=_tiers(tmp_path, 4)) as ck:
        assert ck.load_latest() is not None and ck.restored is not None and ck.restored["tier"] == "remote"
    local = tmp_path / "run" / "local"
    assert seen and all(p.startswith(str(local) + "/.tierstore-decoded-") for p in seen), seen
    assert not [p for p in local.iterdir() if p.name.startswith(".tierstore-decoded-")]
