"""The house rules of the package (issue 15): one zip parser, in Rust, with
typed records; a load opens and reads a file's directory once; the sharded
writer learns offsets from the file writer, never by opening what it wrote;
the Checkpointer's plumbing is not a keyword of the public API; and every
exception tierstore raises on purpose is a ``TierstoreError``."""

from __future__ import annotations

import ast
import builtins
import inspect
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import _archive, _core, manifest
from tierstore.errors import InvalidArgumentError, InvalidArgumentTypeError, TierstoreError, UsageError

PKG = pathlib.Path(__file__).resolve().parent.parent / "python" / "tierstore"
STRACE = shutil.which("strace")

# ----------------------------------------------------------------------------
# One zip parser


def test_no_zip_structure_is_parsed_in_python() -> None:
    """No module of the package knows a zip signature or unpacks a header."""
    signatures = re.compile(r"0x0[0-9]0[0-9]4B50|PK\\x0[1-8]|\bPK\x03|struct\.Struct\(\"<I", re.IGNORECASE)
    found = [
        f"{p.name}:{i}: {line.strip()}"
        for p in sorted(PKG.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if signatures.search(line)
    ]
    assert not found, found


def test_open_container_gives_typed_records(tmp_path: Path) -> None:
    p = tmp_path / "m.pt"
    tierstore.save({"w": torch.arange(1000, dtype=torch.float32)}, p)
    c = _core.open_container(str(p))
    with zipfile.ZipFile(p) as z:
        infos = {i.filename: i for i in z.infolist()}
    assert [r.name for r in c.records] == list(infos)
    for r in c.records:
        zi = infos[r.name]
        assert (r.size, r.crc32, r.compressed_size, r.method, r.header_offset) == (
            zi.file_size,
            zi.CRC,
            zi.compress_size,
            zi.compress_type,
            zi.header_offset,
        )
    assert c.file_len == p.stat().st_size
    offsets = c.data_offsets()
    raw = p.read_bytes()
    with zipfile.ZipFile(p) as z:
        for r, off in zip(c.records, offsets, strict=True):
            assert raw[off : off + r.size] == z.read(r.name)
            assert c.local_data_offset(r.name) == off
    c.check_offsets([(r.name, off) for r, off in zip(c.records, offsets, strict=True)])
    data = c.records[-1]
    with pytest.raises(tierstore.CorruptFileError, match=re.escape(data.name)):
        c.check_offsets([(data.name, c.cd_offset)])  # past its own space
    with pytest.raises(tierstore.MissingRecordError, match="no/such"):
        c.local_data_offset("no/such")
    with pytest.raises(tierstore.TruncatedFileError, match=str(p)):
        c.read(c.file_len - 2, 4, "the tail")


def test_writer_records_are_typed_and_where_the_file_has_them(tmp_path: Path) -> None:
    p = tmp_path / "w.pt"
    written = tierstore.api.write_file({"tensors": {"a": torch.ones(5), "b": torch.zeros(3, 3)}}, p)
    assert written.file_len == p.stat().st_size
    c = _core.open_container(str(p))
    manifest_rec = next(r for r in c.records if r.name.endswith(manifest.MANIFEST_NAME))
    assert written.manifest_crc32 == manifest_rec.crc32
    by_name = {r.name.split("/", 1)[1]: (r, off) for r, off in zip(c.records, c.data_offsets(), strict=True)}
    for rec in written.records:
        zr, off = by_name[rec["name"]]
        assert (rec["offset"], rec["size"], rec["crc32"]) == (off, zr.size, zr.crc32)
    assert sorted(t["path"][1] for t in written.tensors) == ["a", "b"]


def _opens(script: str, path: Path, *args: str) -> list[str]:
    if STRACE is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    out = path.parent / "opens.txt"
    r = subprocess.run(
        [STRACE, "-f", "-qq", "-e", "trace=openat,open", "-o", str(out), sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [line for line in out.read_text().splitlines() if f'"{path}' in line]


def test_a_load_opens_the_file_for_its_directory_once(tmp_path: Path) -> None:
    p = tmp_path / "big.pt"
    tierstore.save({f"t{i}": torch.full((100,), float(i)) for i in range(50)}, p)
    opens = _opens("import tierstore, sys; tierstore.load(sys.argv[1]); print('ok')", p, str(p))
    # one open for the directory, manifest and small records; one for the
    # data, through the engine (O_DIRECT where the file system allows it)
    assert len(opens) == 2, opens
    assert sum("O_DIRECT" not in line for line in opens) == 1, opens


def test_save_sharded_does_not_open_what_it_wrote(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    script = (
        "import tierstore, torch, sys; "
        "tierstore.save_sharded({'w': torch.ones(64, 64), 'step': 3, 'opt': {'lr': 0.1}}, sys.argv[1])"
    )
    opens = _opens(script, d, str(d))
    files = [line for line in opens if re.search(r'/(rank|objects)-\d{5}\.[0-9a-f]{12}\.pt"', line)]
    assert not files, files  # written under temporary names and renamed: never opened by their final names
    assert any(".tmp" in line or "O_CREAT" in line for line in opens), opens
    sd = {"w": torch.empty(64, 64), "step": 0, "opt": {"lr": 0.0}}
    tierstore.load_sharded(d, sd)
    assert torch.equal(sd["w"], torch.ones(64, 64)) and sd["step"] == 3 and sd["opt"] == {"lr": 0.1}


def test_archive_reads_go_through_the_container(tmp_path: Path) -> None:
    p = tmp_path / "a.pt"
    tierstore.save({"x": torch.arange(10)}, p)
    arch, m, offsets = _archive.open_archive(str(p))
    assert m is not None and arch.container is not None
    rec = arch.records["data.pkl"]
    assert _archive.load_small(arch, offsets["data.pkl"], rec.size, "data.pkl") == zipfile.ZipFile(p).read(rec.name)


# ----------------------------------------------------------------------------
# The public API's keywords


def test_checkpointer_plumbing_is_not_a_keyword_of_the_public_api() -> None:
    torch_own = {"_use_new_zipfile_serialization", "_disable_byteorder_record"}
    for fn in (tierstore.save, tierstore.load, tierstore.save_sharded, tierstore.load_sharded):
        private = {n for n in inspect.signature(fn).parameters if n.startswith("_")} - torch_own
        assert not private, (fn.__name__, private)
    with pytest.raises(TypeError):
        tierstore.save({}, "x.pt", _gates={})  # type: ignore[call-arg]


# ----------------------------------------------------------------------------
# Errors

_BUILTIN_EXCEPTIONS = {n for n in dir(builtins) if n.endswith("Error")} | {"Exception"}


def test_every_exception_raised_on_purpose_is_a_tierstore_error() -> None:
    """No ``raise ValueError(...)`` (or another builtin) in the package: each
    is a class from errors.py that is both a TierstoreError and that builtin."""
    found = []
    for p in sorted(PKG.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in _BUILTIN_EXCEPTIONS:
                    found.append(f"{p.name}:{node.lineno}: raise {name}")
    assert not found, found
    for name in tierstore.errors.__all__:
        assert issubclass(getattr(tierstore.errors, name), TierstoreError), name
        assert getattr(tierstore, name) is getattr(tierstore.errors, name), name
        assert name in tierstore.__all__, name
    # Every public error class is listed once, in errors.__all__, and so reaches the top level.
    defined = {
        n
        for n, c in vars(tierstore.errors).items()
        if isinstance(c, type) and issubclass(c, TierstoreError) and not n.startswith("_")
    }
    assert defined == set(tierstore.errors.__all__), defined ^ set(tierstore.errors.__all__)


def test_argument_errors_are_tierstore_errors_and_builtins(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot read 'lots' as a size") as ei:
        tierstore.HostTier(budget="lots")
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, TierstoreError)
    with pytest.raises(InvalidArgumentError, match="interval"):
        tierstore.Checkpointer(tmp_path / "c", interval=0)
    with pytest.raises(InvalidArgumentError, match="align"):
        tierstore.save({}, tmp_path / "x.pt", align=100)
    with pytest.raises(UsageError, match="pickle_module") as ue:
        tierstore.load(tmp_path / "x.pt", pickle_module=pickle, weights_only=True)
    assert isinstance(ue.value, RuntimeError)
    tierstore.save({"a": torch.ones(2)}, tmp_path / "y.pt")
    with pytest.raises(InvalidArgumentTypeError, match="map_location") as te:
        tierstore.load(tmp_path / "y.pt", map_location=3.5)  # type: ignore[arg-type]
    assert isinstance(te.value, TypeError)
    with pytest.raises(InvalidArgumentError, match="verify"):
        tierstore.load_sharded(tmp_path, {}, verify="sometimes")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------
# One I/O scheduler


_HOLD = (
    "import fcntl, os, sys\n"
    "fds = [os.open(f, os.O_RDWR | os.O_CREAT, 0o666) for f in sys.argv[1:]]\n"
    "for fd in fds:\n"
    "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
)


def _lock(d: Path, what: str, i: int) -> str:
    from tierstore._offload_io import lock_dir

    return str(lock_dir() / f"tierstore-io-{d.stat().st_dev:x}-{what}{i}.lock")


def _blocked_while_held(locks: list[str], job: Any, patience: float = 1.0) -> tuple[bool, float]:
    """Runs ``job`` in a thread while another process holds ``locks``:
    whether it was still running after ``patience`` seconds, and how long it
    took in all (it must finish once they are let go)."""
    import threading
    import time

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, *locks], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdin is not None and holder.stdout is not None
    err: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as e:
            err.append(e)

    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.perf_counter()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(patience)
        blocked = t.is_alive()
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    t.join(60)
    assert not t.is_alive(), "hung after the other process let go"
    if err:
        raise err[0]
    return blocked, time.perf_counter() - t0


def test_saves_and_loads_take_the_engine_turns_of_a_device_with_offload(tmp_path: Path) -> None:
    """The machine-wide device turns are the engine's: while an offloaded
    optimizer of this process has turns at a device, a plain save and a load
    at that device wait while another process holds every turn in their
    direction, and go at once when the turns in the other direction are the
    ones held. With no turns registered, neither waits."""
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(1 << 16)}
    f = data / "a.pt"
    tierstore.save(state, f)
    writes = [_lock(data, "w", i) for i in range(2)]
    reads = [_lock(data, "r", i) for i in range(2)]

    # No optimizer, no turns: nothing waits for the lock files.
    blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "b.pt"))
    assert not blocked

    opt = tierstore.offload(
        torch.optim.AdamW,
        [torch.nn.Parameter(torch.randn(64))],
        tiers=[tierstore.HostTier(0), tierstore.DiskTier(str(tmp_path / "off"))],
    )
    try:
        blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "c.pt"))
        assert blocked, "a save ran while another process held every write turn at the device"
        blocked, _ = _blocked_while_held(reads, lambda: tierstore.save(state, data / "d.pt"))
        assert not blocked, "a save waited for read turns"
        got: dict[str, Any] = {}
        blocked, _ = _blocked_while_held(reads, lambda: got.update(tierstore.load(f)))
        assert blocked, "a load ran while another process held every read turn at the device"
        assert torch.equal(got["w"], state["w"])
        assert sum(d.lock_wait_s for d in opt.devices) > 0.5  # counted at the device's turns, whoever waited
    finally:
        opt.close()
    # Closed: the turns are gone with it.
    blocked, _ = _blocked_while_held(writes, lambda: tierstore.save(state, data / "e.pt"))
    assert not blocked
    for n in "bcde":
        assert torch.equal(tierstore.load(data / f"{n}.pt")["w"], state["w"])


def test_device_turns_live_in_the_engine_only() -> None:
    """No Python module takes turns (flock on the device lock files) itself."""
    src = (PKG / "_offload_io.py").read_text()
    assert "class Lane" not in src and "heapq" not in src
    for p in PKG.glob("*.py"):
        assert "tierstore-io-" not in p.read_text(), p.name
    turns = _core.DeviceTurns(
        tierstore.get_engine(), 12345, slots=1, exclusive=False, shared=1, lock_dir=str(PKG), duplex=False
    )
    assert turns.duplex is False and turns.take_bytes() == 0
    a, b = turns.ticket(), turns.ticket(background=True)
    assert a[0] < b[0], "foreground goes first"
    turns.close()
    with pytest.raises(RuntimeError):
        turns.ticket()
