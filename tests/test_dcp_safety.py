"""Loading PyTorch DCP checkpoints is safe: a hostile ``.metadata`` runs no
code, names no file outside the checkpoint, states no size that is trusted
before it is checked; damaged chunks are detected; every failure is a clean
TierstoreError; genuine checkpoints still load exactly."""

from __future__ import annotations

import builtins
import io
import os
import pathlib
import pickle
import random
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import _limits, dcp
from tierstore.errors import (
    ChecksumError,
    CorruptFileError,
    CoverageError,
    FormatError,
    ManifestError,
    ResourceLimitError,
    TierstoreError,
    TruncatedFileError,
    UnsafeObjectError,
    UnsafePathError,
)
from tierstore.layout import Layout, attach
from tierstore.sharded import consolidate

# --------------------------------------------------------------------------
# Helpers


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args], capture_output=True, text=True, check=False, timeout=timeout
    )


class Reduce:
    """Pickles as ``fn(*args)``: what a hostile file would hold."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


class Custom:
    """An object outside torch's weights_only allow-list."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.v == self.v


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.arange(4),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "epoch": 2,
        "opt": {"lr": 0.25, "name": "hello-object-marker"},
    }


def targets() -> dict[str, Any]:
    return {
        "w": torch.zeros(6, 5),
        "b": torch.zeros(4, dtype=torch.int64),
        "h": torch.zeros(3, dtype=torch.bfloat16),
        "epoch": None,
        "opt": {"lr": None, "name": None},
    }


def check_loaded(sd: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("w", "b", "h"):
        assert torch.equal(sd[k], want[k]), k
    assert sd["epoch"] == want["epoch"]
    assert sd["opt"] == want["opt"]


def read_meta(path: pathlib.Path) -> Any:
    # Our own checkpoints: trusted, so plain pickle is fine here.
    return pickle.loads((path / ".metadata").read_bytes())


def write_meta(path: pathlib.Path, meta: Any) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def rekey(meta: Any, fqn: str, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    """Moves the storage entry of chunk ``old`` of ``fqn`` to offsets ``new``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    sd = meta.storage_data
    info = sd.pop(MetadataIndex(fqn, torch.Size(old)))
    sd[MetadataIndex(fqn, torch.Size(new))] = info


@pytest.fixture
def single(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "dcp"
    dcp.save_dcp(state(), path)
    return path


def flat_state() -> dict[str, Any]:
    s = state()
    return {"w": s["w"], "b": s["b"], "h": s["h"], "epoch": 2, "opt.lr": 0.25, "opt.name": "hello-object-marker"}


# --------------------------------------------------------------------------
# Genuine checkpoints load exactly


def test_single_rank_checkpoint_loads_exactly(single: pathlib.Path) -> None:
    want = state()
    sd = targets()
    stats: dict[str, Any] = {}
    tierstore.load_sharded(single, sd, stats=stats)
    check_loaded(sd, want)
    assert stats["bytes_verified"] == stats["bytes_read"] > 0
    for verify in ("full", False, True):
        sd = targets()
        tierstore.load_sharded(single, sd, verify=verify)
        check_loaded(sd, want)
    full = dcp.to_state_dict(single)
    flat = flat_state()
    assert full.keys() == flat.keys()
    for k, v in flat.items():
        assert torch.equal(full[k], v) if isinstance(v, torch.Tensor) else full[k] == v
    # consolidate nests as the saved state dict was (as dcp_to_torch_save does).
    nested = consolidate(single)
    assert nested.keys() == want.keys() and nested["opt"] == want["opt"]
    assert torch.equal(nested["w"], want["w"])
    # weights_only=False reads the same metadata with the plain unpickler.
    sd = targets()
    tierstore.load_sharded(single, sd, weights_only=False)
    check_loaded(sd, want)


def test_allow_list_covers_what_torch_writes(single: pathlib.Path) -> None:
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO((single / ".metadata").read_bytes())).load()
    allowed = dcp.allowed_globals()
    assert seen and seen <= allowed.keys()
    assert ("posix", "system") not in allowed and ("builtins", "eval") not in allowed


def multi_save_job(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    sd = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "c": distribute_tensor(full.to(torch.bfloat16), mesh, [Shard(1)]),
        "r": distribute_tensor(torch.arange(3), mesh, [Replicate()]),
        "step": 3,
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
    }
    dist_cp.save(sd, checkpoint_id=path)


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("multi") / "dcp"
    run_world(4, multi_save_job, str(path))
    return path


def test_multi_rank_checkpoint_loads_and_reshards_exactly(multi: pathlib.Path) -> None:
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    t = attach(torch.zeros(8, 4), Layout.shard("w", (8, 12), 1, 1, 3))  # a layout DCP never had
    sd: dict[str, Any] = {"w": t, "c": torch.zeros(8, 12, dtype=torch.bfloat16), "r": torch.zeros(3, dtype=torch.int64),
                          "step": None, "opt": {"lr": None, "betas": None}}  # fmt: skip
    tierstore.load_sharded(multi, sd, verify="full")
    assert torch.equal(t, full[:, 4:8])
    assert torch.equal(sd["c"], full.to(torch.bfloat16))
    assert torch.equal(sd["r"], torch.arange(3))
    assert sd["step"] == 3 and sd["opt"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    whole = dcp.to_state_dict(multi)
    assert torch.equal(whole["w"], full) and torch.equal(whole["c"], full.to(torch.bfloat16))
    assert whole["step"] == 3 and whole["opt.betas"] == (0.9, 0.99)
    ck = dcp.DcpCheckpoint(multi)
    assert len(ck.tensors["w"][2]) == 4 and ck.dir == multi and ck.meta is not None
    r = cli("inspect", "--json", str(multi))
    assert r.returncode == 0, r.stderr


def test_objects_outside_the_allow_list_need_weights_only_false(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "custom"
    dcp.save_dcp({"w": torch.ones(2), "obj": Custom(5)}, path)
    with pytest.raises(UnsafeObjectError, match="weights_only"):
        tierstore.load_sharded(path, {"w": torch.zeros(2), "obj": None})
    sd: dict[str, Any] = {"w": torch.zeros(2), "obj": None}
    tierstore.load_sharded(path, sd, weights_only=False)
    assert sd["obj"] == Custom(5)


# --------------------------------------------------------------------------
# Code execution


def hostile_payloads(marker: pathlib.Path) -> list[Any]:
    return [
        Reduce(os.system, (f"touch {marker}",)),
        Reduce(builtins.eval, (f"open({str(marker)!r}, 'w').close()",)),
        Reduce(subprocess.Popen, (["touch", str(marker)],)),
        Reduce(builtins.exec, (f"open({str(marker)!r}, 'w').close()",)),
    ]


def hostile_copies(src: pathlib.Path, tmp_path: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    out = []
    for i, where in enumerate(["planner_data", "version", "top"]):
        for j in range(4):
            d = tmp_path / f"hostile{i}_{j}"
            shutil.copytree(src, d)
            marker = tmp_path / f"marker{i}_{j}"
            payload = hostile_payloads(marker)[j]
            if where == "top":
                (d / ".metadata").write_bytes(pickle.dumps(payload))
            else:
                meta = read_meta(src)
                setattr(meta, where, payload)
                write_meta(d, meta)
            out.append((d, marker))
    return out


def test_hostile_metadata_runs_no_code(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    for d, marker in hostile_copies(single, tmp_path):
        with pytest.raises(UnsafeObjectError) as ei:
            tierstore.load_sharded(d, targets())
        msg = str(ei.value)
        assert str(d / ".metadata") in msg and "weights_only=False" in msg and "--unsafe" in msg
        assert ei.value.path == str(d / ".metadata")
        with pytest.raises(UnsafeObjectError):
            consolidate(d)
        with pytest.raises(UnsafeObjectError):
            dcp.to_state_dict(d)
        with pytest.raises(UnsafeObjectError):
            dcp.DcpCheckpoint(d)
        assert not marker.exists()


def test_the_unpickler_refuses_on_its_own(
    single: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the opcode walk, find_class alone still refuses every global."""
    from tierstore import _dcp_pickle

    monkeypatch.setattr(_dcp_pickle, "_scan", lambda data, where, strict: None)
    for d, marker in hostile_copies(single, tmp_path):
        with pytest.raises(UnsafeObjectError, match="refused the global"):
            dcp.DcpCheckpoint(d)
        assert not marker.exists()


def test_hostile_metadata_refused_by_the_cli(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    d = tmp_path / "hostile"
    shutil.copytree(single, d)
    marker = tmp_path / "marker"
    meta = read_meta(single)
    meta.planner_data = Reduce(os.system, (f"touch {marker}",))
    write_meta(d, meta)
    for args in (
        ("inspect", str(d)),
        ("inspect", "--json", str(d)),
        ("consolidate", str(d), str(tmp_path / "out.pt")),
        ("convert", str(d), str(tmp_path / "converted")),
    ):
        r = cli(*args)
        assert r.returncode != 0, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tierstore: "), r.stderr
        assert "refused the global posix.system" in lines[0] and "--unsafe" in lines[0]
        assert "Traceback" not in r.stderr
        assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "converted").exists()
    # --unsafe is the explicit opt-in: the plain unpickler runs the file.
    r = cli("consolidate", "--unsafe", str(d), str(tmp_path / "out.pt"))
    assert r.returncode == 0, r.stderr
    assert marker.exists()


def raw_pickles() -> dict[str, bytes]:
    def su(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    enum = su("torch.distributed.checkpoint.metadata") + su("_MEM_FORMAT_ENCODING") + b"\x93"
    return {
        # GLOBAL of modules and attributes outside the list, and attribute chains.
        "global_os": b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
        "dotted": b"\x80\x04" + su("torch.distributed.checkpoint.metadata") + su("Metadata.__init__") + b"\x93.",
        "module_attr": b"\x80\x04" + su("torch.distributed.checkpoint.metadata") + su("os") + b"\x93.",
        "torch_load": b"\x80\x04" + su("torch") + su("load") + b"\x93.",
        # BUILD on a function: would replace torch.serialization._get_layout.cache process-wide.
        "build_on_function": b"\x80\x02ctorch.serialization\n_get_layout\n}X\x05\x00\x00\x00cacheNsb.",
        # BUILD on a shared enum member.
        "build_on_enum": b"\x80\x04" + enum + b"K\x00\x85R}" + su("x") + b"K\x01sb.",
        # NEWOBJ of something that is not one of DCP's classes.
        "newobj_size": b"\x80\x04" + su("torch") + su("Size") + b"\x93)\x81.",
        # Old-style instance and extension-registry opcodes.
        "inst": b"\x80\x02(ios\nsystem\n.",
        "ext": b"\x80\x02\x82\x01.",
        "persid": b"\x80\x02P1\n.",
    }


def crafted_bombs() -> dict[str, bytes]:
    return {
        # A memo index the C unpickler would size its memo by (64 GiB).
        "memo_bomb": b"\x80\x04N" + b"r" + (0xFFFFFFFF).to_bytes(4, "little") + b".",
        "memo_text": b"\x80\x02Np99999999999\n.",
        # A megabyte of nested tuples used as a dict key: CPython hashes them
        # recursively in C and overflows its stack.
        "deep_tuple": b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns.",
        "deep_lists": b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".",
        # Lengths far beyond the file (the C unpickler allocates them first).
        "binbytes8": b"\x80\x04\x8e" + (1 << 60).to_bytes(8, "little") + b".",
        "binunicode8": b"\x80\x04\x8d" + (1 << 40).to_bytes(8, "little") + b".",
        "long4": b"\x80\x02\x8b\xff\xff\xff\x7f.",
        "cycle": b"\x80\x04]\x94h\x00a.",
        "empty": b"",
        "garbage": b"\x00\x01\x02garbage",
        "no_stop": b"\x80\x04N",
        "underflow": b"\x80\x04a.",
        "not_metadata": pickle.dumps({"a": 1}),
        "not_metadata_list": pickle.dumps([1, 2, 3]),
    }


def test_crafted_pickles_are_refused_cleanly(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cache = torch.serialization._get_layout.cache  # type: ignore[attr-defined]
    for name, data in {**raw_pickles(), **crafted_bombs()}.items():
        d = tmp_path / name
        shutil.copytree(single, d)
        (d / ".metadata").write_bytes(data)
        with pytest.raises(TierstoreError) as ei:
            dcp.DcpCheckpoint(d)
        assert str(d / ".metadata") in str(ei.value), name
        if name in raw_pickles():
            assert isinstance(ei.value, UnsafeObjectError), (name, ei.value)
        else:
            assert isinstance(ei.value, (ManifestError, UnsafeObjectError)), (name, ei.value)
    assert torch.serialization._get_layout.cache is cache  # type: ignore[attr-defined]
    assert isinstance(cache, dict)


def test_bombs_do_not_crash_or_exhaust_memory(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """In a child (a crash must not take pytest down) with 4 GiB of address space."""
    d = tmp_path / "bombs"
    d.mkdir()
    for name, data in crafted_bombs().items():
        (d / name).mkdir()
        shutil.copy(single / "__0_0.distcp", d / name / "__0_0.distcp")
        (d / name / ".metadata").write_bytes(data)
    code = textwrap.dedent(
        """
        import os, resource, sys
        import torch
        import tierstore
        from tierstore import dcp
        from tierstore.errors import TierstoreError
        resource.setrlimit(resource.RLIMIT_AS, (1 << 32, resource.RLIM_INFINITY))
        for name in sorted(os.listdir(sys.argv[1])):
            for weights_only in (True, False):
                try:
                    dcp.DcpCheckpoint(os.path.join(sys.argv[1], name), weights_only=weights_only)
                    print(name, weights_only, "loaded")
                except TierstoreError as e:
                    print(name, weights_only, type(e).__name__)
        print("done")
        """
    )
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split("\n")
    assert "done" in lines
    for name in crafted_bombs():
        assert f"{name} True loaded" not in lines, r.stdout
        assert f"{name} False loaded" not in lines, r.stdout


# --------------------------------------------------------------------------
# Absurd content


def test_wrong_field_types_are_refused_naming_the_field(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def bad(fn: Any, field: str, exc: type[BaseException] = ManifestError) -> None:
        meta = read_meta(single)
        fn(meta)
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(single, d)
        write_meta(d, meta)
        with pytest.raises(exc) as ei:
            dcp.to_state_dict(d)
        assert str(d / ".metadata") in str(ei.value) and field in str(ei.value), str(ei.value)

    first = lambda m: next(iter(m.storage_data.values()))  # noqa: E731
    bad(lambda m: setattr(m, "state_dict_metadata", [1, 2]), "state_dict_metadata")
    bad(lambda m: setattr(m, "storage_data", None), "storage_data")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "size", torch.Size([6])), "state_dict_metadata['w']")
    bad(lambda m: setattr(m.state_dict_metadata["w"].properties, "dtype", "float32"), ".dtype")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "chunks", None), ".chunks")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "size", (6, -5)), ".size[1]")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "size", (6, 10**5000)), ".size[1]")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "size", (2**62, 2**62)), ".size")
    bad(lambda m: setattr(m.state_dict_metadata["w"], "size", tuple([1] * 65)), ".size")
    bad(lambda m: m.state_dict_metadata.__setitem__("x", 5), "state_dict_metadata['x']")
    bad(lambda m: m.state_dict_metadata.__setitem__("x", BytesStorageMetadata()), "state_dict_metadata['x']")
    bad(lambda m: setattr(first(m), "offset", -1), ".offset")
    bad(lambda m: setattr(first(m), "length", "12"), ".length")
    bad(lambda m: setattr(first(m), "relative_path", 7), ".relative_path")
    bad(lambda m: setattr(first(m), "transform_descriptors", ["zstd"]), "transform_descriptors", FormatError)
    bad(lambda m: delattr(first(m), "length"), ".length")
    bad(lambda m: setattr(m.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([7, 5])), "chunks[0]",
        CoverageError)  # fmt: skip

    def move(m: Any) -> None:  # a chunk without its storage entry
        m.state_dict_metadata["w"].chunks[0].offsets = torch.Size([1, 0])
        m.state_dict_metadata["w"].chunks[0].sizes = torch.Size([5, 5])

    bad(move, "no storage_data entry")
    # Two entries of storage_data on one byte range.
    bad(lambda m: setattr(list(m.storage_data.values())[1], "offset", first(m).offset), "a byte range apart")


# --------------------------------------------------------------------------
# Path traversal


def retarget(single: pathlib.Path, d: pathlib.Path, name: str) -> None:
    """A copy of ``single`` whose first tensor chunk names ``name``."""
    shutil.copytree(single, d)
    meta = read_meta(single)
    info = meta.storage_data[next(k for k in meta.storage_data if k.fqn == "w")]
    info.relative_path = name
    write_meta(d, meta)


def test_relative_paths_stay_inside_the_checkpoint(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    outside = tmp_path / "outside.distcp"
    shutil.copy(single / "__0_0.distcp", outside)  # were it read, the load would succeed
    cases = {
        "abs": str(outside),
        "dotdot": "../outside.distcp",
        "inner_dotdot": "sub/../../outside.distcp",
        "link": "link.distcp",
        "dir": "subdir",
        "empty": "",
        "nul": "a\0b",
    }
    for case, name in cases.items():
        d = tmp_path / case
        retarget(single, d, name)
        if case == "link":
            os.symlink(outside, d / "link.distcp")
        if case == "dir":
            (d / "subdir").mkdir()
        for load in (lambda p: tierstore.load_sharded(p, targets()), consolidate, dcp.DcpCheckpoint):
            with pytest.raises(UnsafePathError) as ei:
                load(d)
            assert str(d / ".metadata") in str(ei.value) and "relative_path" in str(ei.value), str(ei.value)
        if case in ("dotdot", "link"):
            r = cli("inspect", str(d))
            assert r.returncode != 0 and r.stderr.startswith("tierstore: ") and "Traceback" not in r.stderr


def test_fifos_do_not_block(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    d = tmp_path / "fifo"
    retarget(single, d, "fifo.distcp")
    os.mkfifo(d / "fifo.distcp")
    m = tmp_path / "fifo_meta"
    m.mkdir()
    shutil.copy(single / "__0_0.distcp", m / "__0_0.distcp")
    os.mkfifo(m / ".metadata")
    code = textwrap.dedent(
        """
        import sys, torch, tierstore
        from tierstore import dcp
        from tierstore.sharded import consolidate
        from tierstore.errors import TierstoreError
        for fn in (lambda: tierstore.load_sharded(sys.argv[1], {"w": torch.zeros(6, 5)}),
                   lambda: consolidate(sys.argv[1]), lambda: dcp.DcpCheckpoint(sys.argv[1]),
                   lambda: dcp.DcpCheckpoint(sys.argv[2])):
            try:
                fn()
                print("loaded")
            except TierstoreError as e:
                print(type(e).__name__)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(d), str(m)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["UnsafePathError"] * 4, r.stdout
    r = cli("inspect", str(d), timeout=120)
    assert r.returncode != 0 and "FIFO" in r.stderr


# --------------------------------------------------------------------------
# Integrity and sizes


def test_flipped_byte_in_a_chunk_is_detected(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    want = state()
    data = (single / "__0_0.distcp").read_bytes()
    for what, needle in (("tensor", want["w"].numpy().tobytes()), ("object", b"hello-object-marker")):
        d = tmp_path / what
        shutil.copytree(single, d)
        at = data.index(needle) + len(needle) // 2
        (d / "__0_0.distcp").write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :])
        with pytest.raises(ChecksumError) as ei:
            tierstore.load_sharded(d, targets())
        assert ei.value.path == str(d / "__0_0.distcp") and str(d / "__0_0.distcp") in str(ei.value)
        with pytest.raises(ChecksumError):
            dcp.to_state_dict(d)
        with pytest.raises(ChecksumError):
            consolidate(d)
        sd = targets()
        tierstore.load_sharded(d, sd, verify=False)  # the caller's choice: no checksums
        if what == "tensor":
            assert not torch.equal(sd["w"], want["w"])


def test_truncated_data_file(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    data = (single / "__0_0.distcp").read_bytes()
    for cut in (0, 100, len(data) // 2, len(data) - 1):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(single, d)
        (d / "__0_0.distcp").write_bytes(data[:cut])
        with pytest.raises(TruncatedFileError) as ei:
            tierstore.load_sharded(d, targets())
        assert str(d / "__0_0.distcp") in str(ei.value)
        with pytest.raises(TierstoreError):
            dcp.to_state_dict(d)
    d = tmp_path / "missing"
    shutil.copytree(single, d)
    (d / "__0_0.distcp").unlink()
    with pytest.raises(FileNotFoundError):
        tierstore.load_sharded(d, targets())


def test_chunk_that_is_not_what_the_metadata_says(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The blob of 'b' named as the chunk of 'w': a tensor of another shape and dtype."""
    d = tmp_path / "swap"
    shutil.copytree(single, d)
    meta = read_meta(single)
    keys = {k.fqn: k for k in meta.storage_data}
    meta.storage_data[keys["w"]], meta.storage_data[keys["b"]] = (
        meta.storage_data[keys["b"]],
        meta.storage_data[keys["w"]],
    )
    write_meta(d, meta)
    with pytest.raises(CorruptFileError, match="shape"):
        tierstore.load_sharded(d, targets())
    with pytest.raises(CorruptFileError, match="'w'"):
        dcp.to_state_dict(d)


def test_exabyte_shapes_are_refused_before_allocation(
    single: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = torch.Size([2**40, 2**20])
    meta = read_meta(single)
    meta.state_dict_metadata["w"].size = huge
    meta.state_dict_metadata["w"].chunks[0].sizes = huge
    d = tmp_path / "claims"
    shutil.copytree(single, d)
    write_meta(d, meta)
    with pytest.raises(ManifestError, match="bytes"):
        dcp.to_state_dict(d)
    with pytest.raises(ManifestError):
        tierstore.load_sharded(d, targets())
    # The shape alone: the chunk leaves almost all of it uncovered.
    meta = read_meta(single)
    meta.state_dict_metadata["w"].size = huge
    d = tmp_path / "shape"
    shutil.copytree(single, d)
    write_meta(d, meta)
    with pytest.raises(CoverageError):
        dcp.to_state_dict(d)
    with pytest.raises(CoverageError):
        tierstore.load_sharded(d, targets())
    # Checked against the memory there is, too.
    monkeypatch.setattr(_limits, "available_memory", lambda: 64)
    with pytest.raises(ResourceLimitError):
        dcp.to_state_dict(single)


def test_overlaps_and_holes_are_refused(multi: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # 'w' (8, 12) was saved as four row blocks of 2.
    meta = read_meta(multi)
    ch = meta.state_dict_metadata["w"].chunks
    assert [tuple(c.offsets) for c in ch] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    ch[1].offsets = torch.Size([1, 0])
    rekey(meta, "w", (2, 0), (1, 0))
    d = tmp_path / "overlap"
    shutil.copytree(multi, d)
    write_meta(d, meta)
    for load in (lambda: dcp.DcpCheckpoint(d), lambda: dcp.to_state_dict(d),
                 lambda: tierstore.load_sharded(d, {"w": torch.zeros(8, 12)})):  # fmt: skip
        with pytest.raises(CoverageError, match="overlap"):
            load()
    meta = read_meta(multi)
    del meta.state_dict_metadata["w"].chunks[2]
    d = tmp_path / "hole"
    shutil.copytree(multi, d)
    write_meta(d, meta)
    with pytest.raises(CoverageError, match="elements"):
        dcp.to_state_dict(d)
    with pytest.raises(CoverageError):
        tierstore.load_sharded(d, {"w": torch.zeros(8, 12)})
    part: dict[str, Any] = {"w": attach(torch.zeros(2, 12), Layout.shard("w", (8, 12), 0, 0, 4))}
    tierstore.load_sharded(d, part)  # the rows that are there still load
    assert torch.equal(part["w"], torch.arange(24, dtype=torch.float32).reshape(2, 12))
    r = cli("inspect", "--json", str(d))
    assert r.returncode == 1 and '"covered": false' in r.stdout, r.stderr


# --------------------------------------------------------------------------
# Fuzzing the metadata


def test_damaged_metadata_gives_a_clean_error_or_the_right_data(single: pathlib.Path, tmp_path: pathlib.Path) -> None:
    want = state()
    flat = flat_state()
    good = (single / ".metadata").read_bytes()
    d = tmp_path / "fuzz"
    shutil.copytree(single, d)
    rng = random.Random(1234)
    outcomes = {"error": 0, "loaded": 0}
    for case in range(200):
        data = bytearray(good)
        kind = rng.choice(["flip", "flip", "flips", "truncate", "byte"])
        if kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind == "byte":
            data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            for _ in range(1 if kind == "flip" else rng.randint(2, 8)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        (d / ".metadata").write_bytes(bytes(data))
        try:
            sd = targets()
            tierstore.load_sharded(d, sd)
            check_loaded(sd, want)
            outcomes["loaded"] += 1
        except TierstoreError:
            outcomes["error"] += 1
        except Exception as e:  # pragma: no cover - what the test is for
            raise AssertionError(f"case {case} ({kind}): {type(e).__name__}: {e}") from e
        try:
            full = dcp.to_state_dict(d)
        except TierstoreError:
            continue
        except Exception as e:  # pragma: no cover
            raise AssertionError(f"case {case} ({kind}): {type(e).__name__}: {e}") from e
        # A flipped name is a consistent rename; what keeps its name is exact.
        for k, v in full.items():
            if k in flat:
                assert torch.equal(v, flat[k]) if isinstance(v, torch.Tensor) else v == flat[k], (case, k)
    assert outcomes["error"] > 100, outcomes
