"""Durability seen from the kernel: the system calls of a save, traced.

A child process runs, under ``strace -f -y``, (a) a durable ``tierstore.save``,
(b) a durable ``tierstore.save_sharded`` (one process world), (c) a
``Checkpointer`` with a ``DiskTier`` and a ``RemoteTier``, waited for until
the checkpoint is durable on the remote tier, and the same saves with
``durable=False``. The tests then check, on the trace, the order that makes a
commit survive a power loss: every committed file is fsynced (``fsync`` or
``fdatasync``, on the descriptor of its temporary name) before it is renamed
over its final name, its directory is fsynced after the rename and before the
save reports success, a sharded checkpoint's ``manifest.json`` is renamed
only after every data file of that save is durable, and a directory a commit
creates (a checkpoint directory, a Checkpointer's step directory) has its
entry fsynced in its parent. With ``durable=False`` no sync call is made at all.

How the engine syncs: ``rust/core/src/file.rs`` (``AtomicFile::commit``,
``sync_dir``) calls ``fsync(2)`` itself (``File::sync_all``) on the committing
thread, with every backend; io_uring only carries reads and writes
(``rust/core/src/io/uring.rs`` submits no ``IORING_OP_FSYNC``), so strace sees
every sync and the trace runs with the default backend (io_uring where the
kernel has it). Were a sync ever moved into io_uring, strace would not see it
and these tests would fail, not pass silently.

What the other crash tests do not cover: the SIGKILL tests
(``test_durability.py``, ``test_checkpointer.py``, ``test_sharded.py``) kill
the process, so they model a process crash only: the page cache survives a
SIGKILL, and a file that was written but never fsynced still reads back
whole. They cannot see a missing fsync. A power loss drops what is not on
stable storage, which this trace checks by order. The planned power-loss test
goes one step further: a recording block device (a dm-log-writes target, or a
FUSE file system that logs each write and each flush) under a save, then every
prefix of the log up to each flush replayed onto a fresh image and loaded,
requiring the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import skip_for_privilege

STRACE = shutil.which("strace")
SYNCS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "sync", "msync")
TRACED = ",".join((*SYNCS, "rename", "renameat", "renameat2", "mkdir", "mkdirat"))

_CHILD = r"""
import os, sys
import torch
import tierstore
from tierstore import Checkpointer, DiskTier, HostTier, RemoteTier

root = sys.argv[1]
print("tierstore from", tierstore.__file__, flush=True)


def mark(name):
    os.mkdir(os.path.join(root, "markers", name))  # a traced call that orders the trace


state = {"w": torch.randn(256, 64), "b": torch.arange(100), "step": 7}
os.mkdir(os.path.join(root, "markers"))
for sub in ("save", "save_nd"):
    os.mkdir(os.path.join(root, sub))
mark("begin")
tierstore.save(state, os.path.join(root, "save", "x.pt"))
mark("save")
tierstore.save(state, os.path.join(root, "save_nd", "x.pt"), durable=False)
mark("save_nd")
tierstore.save_sharded(state, os.path.join(root, "sharded", "ck"))
mark("sharded")
tierstore.save_sharded(state, os.path.join(root, "sharded_nd", "ck"), durable=False)
mark("sharded_nd")
ck = Checkpointer(
    os.path.join(root, "job"), tiers=[HostTier("64MiB"), DiskTier("local"), RemoteTier(os.path.join(root, "remote"))]
)
mark("ckpt_open")
h = ck.save(5, {"model": {"w": torch.randn(128, 128)}, "step": 5})
state_now = h.wait("remote")
mark("ckpt")
ck.close()
print("checkpoint", state_now, flush=True)
# Everything the trace saw must also load: the saves really happened.
assert torch.equal(tierstore.load(os.path.join(root, "save", "x.pt"))["w"], state["w"])
assert torch.equal(tierstore.load(os.path.join(root, "save_nd", "x.pt"))["w"], state["w"])
for sub in ("sharded", "sharded_nd"):
    t = {"w": torch.empty(256, 64), "b": torch.empty(100, dtype=torch.int64), "step": None}
    tierstore.load_sharded(os.path.join(root, sub, "ck"), t)
    assert torch.equal(t["w"], state["w"]) and t["step"] == 7
print("loaded", flush=True)
"""


@dataclass
class Call:
    """One traced system call: where it entered and where it returned in the trace."""

    pid: int
    name: str
    args: str
    ret: str
    entry: int
    exit: int

    def fd_path(self) -> str | None:
        m = re.match(r"\s*-?\d+<(.*?)>", self.args)
        return m.group(1) if m else None

    def paths(self) -> list[str]:
        """The path arguments, made absolute where a directory descriptor (shown by -y) is given."""
        quoted = [bytes(q, "ascii").decode("unicode_escape") for q in re.findall(r'"((?:[^"\\]|\\.)*)"', self.args)]
        dirs = re.findall(r"(?:^|, )(-?\d+<(.*?)>|AT_FDCWD)", self.args)
        if self.name in ("renameat", "renameat2", "mkdirat") and dirs:
            bases = [d[1] if d[1] else "" for d in dirs]
            return [
                q if q.startswith("/") or not b else os.path.join(b, q) for q, b in zip(quoted, bases, strict=False)
            ]
        return quoted


_FULL = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+= (-?\d+|\?)")
_START = re.compile(r"^(\d+)\s+(\w+)\((.*) <unfinished \.\.\.>$")
_RESUME = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>(.*)\)\s+= (-?\d+|\?)")


def parse(text: str) -> list[Call]:
    calls: list[Call] = []
    open_: dict[int, tuple[str, str, int]] = {}
    for i, line in enumerate(text.splitlines()):
        if m := _FULL.match(line):
            calls.append(Call(int(m[1]), m[2], m[3], m[4], i, i))
        elif m := _START.match(line):
            open_[int(m[1])] = (m[2], m[3], i)
        elif m := _RESUME.match(line):
            name, args, start = open_.pop(int(m[1]), (m[2], "", i))
            calls.append(Call(int(m[1]), name, args + m[3], m[4], start, i))
    calls.sort(key=lambda c: c.entry)
    return calls


@dataclass
class Trace:
    root: Path
    calls: list[Call]
    stdout: str

    def marker(self, name: str) -> int:
        p = str(self.root / "markers" / name)
        for c in self.calls:
            if c.name in ("mkdir", "mkdirat") and c.paths()[:1] == [p]:
                return c.entry
        raise AssertionError(f"marker {name} not in the trace")

    def window(self, start: str, end: str) -> list[Call]:
        a, b = self.marker(start), self.marker(end)
        return [c for c in self.calls if a < c.entry < b]

    def renames(self, calls: list[Call]) -> list[tuple[str, str, Call]]:
        out = []
        for c in calls:
            if c.name in ("rename", "renameat", "renameat2") and c.ret == "0":
                src, dst = c.paths()[:2]
                out.append((src, dst, c))
        return out


def _syncs_of(calls: list[Call], path: str) -> list[Call]:
    return [c for c in calls if c.name in ("fsync", "fdatasync") and c.ret == "0" and c.fd_path() == path]


def _commit(tr: Trace, calls: list[Call], final: Path, before: int) -> int:
    """Checks fsync(temp) -> rename(temp, final) -> fsync(dir) for ``final``,
    the directory sync done before trace position ``before``; returns where
    that directory sync returned."""
    ren = [(s, d, c) for s, d, c in tr.renames(calls) if d == str(final)]
    assert ren, f"{final}: never renamed into place (renames seen: {[d for _s, d, _c in tr.renames(calls)]})"
    src, _dst, r = ren[-1]
    assert _syncs_of([c for c in calls if c.exit < r.entry], src), (
        f"{final}: its temporary file {src} was not fsynced before the rename"
    )
    after = [c for c in _syncs_of(calls, str(final.parent)) if c.entry > r.exit and c.exit < before]
    assert after, f"{final}: directory {final.parent} not fsynced after the rename (before the save returned)"
    return min(c.exit for c in after)


def _no_syncs(calls: list[Call], under: Path) -> None:
    bad = [
        f"{c.name}({c.args})"
        for c in calls
        if (c.name in SYNCS and (c.fd_path() or "").startswith(str(under))) or c.name in ("sync", "syncfs")
    ]
    assert not bad, f"durable=False still syncs: {bad}"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    if STRACE is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    root = tmp_path_factory.mktemp("trace")
    out = root / "strace.txt"
    cmd = [STRACE, "-f", "-qq", "-y", "-s", "4096", "-e", f"trace={TRACED}", "-o", str(out)]
    r = subprocess.run(
        [*cmd, sys.executable, "-c", _CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if r.returncode != 0 and "PTRACE" in r.stderr.upper() and "not permitted" in r.stderr.lower():
        skip_for_privilege(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, f"traced child failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    assert "loaded" in r.stdout, r.stdout
    print(r.stdout)
    text = out.read_text()
    calls = parse(text)
    assert calls, f"no system call parsed from the trace; it begins:\n{text[:2000]}"
    return Trace(root, calls, r.stdout)


def test_the_trace_is_parsed(trace: Trace) -> None:
    # The parser must find the calls, or every check below would be vacuous.
    names = {c.name for c in trace.calls}
    assert {"fsync", "mkdir"} <= names and any(n.startswith("rename") for n in names), names
    assert trace.marker("begin") < trace.marker("save") < trace.marker("ckpt")


def test_durable_save_fsyncs_file_then_renames_then_fsyncs_dir(trace: Trace) -> None:
    calls = trace.window("begin", "save")
    _commit(trace, calls, trace.root / "save" / "x.pt", trace.marker("save"))


def test_save_without_durable_syncs_nothing(trace: Trace) -> None:
    calls = trace.window("save", "save_nd")
    assert any(d == str(trace.root / "save_nd" / "x.pt") for _s, d, _c in trace.renames(calls))
    _no_syncs(calls, trace.root / "save_nd")


def _sharded_commit(trace: Trace, calls: list[Call], ck: Path, end: int) -> None:
    """Every data file durable before manifest.json is renamed; the manifest committed."""
    man = [c for s, d, c in trace.renames(calls) if d == str(ck / "manifest.json")]
    assert man, f"{ck}: manifest.json never committed"
    data = sorted({d for _s, d, _c in trace.renames(calls) if Path(d).parent == ck and Path(d).name != "manifest.json"})
    assert any(Path(d).name.startswith("rank-") for d in data), data
    for d in data:
        _commit(trace, calls, Path(d), man[-1].entry)
    _commit(trace, calls, ck / "manifest.json", end)


def test_sharded_commit_order(trace: Trace) -> None:
    calls = trace.window("save_nd", "sharded")
    _sharded_commit(trace, calls, trace.root / "sharded" / "ck", trace.marker("sharded"))


def test_sharded_without_durable_syncs_nothing(trace: Trace) -> None:
    calls = trace.window("sharded", "sharded_nd")
    assert any(d == str(trace.root / "sharded_nd" / "ck" / "manifest.json") for _s, d, _c in trace.renames(calls))
    _no_syncs(calls, trace.root / "sharded_nd")


def test_checkpointer_promotion_order(trace: Trace) -> None:
    calls = trace.window("ckpt_open", "ckpt")
    assert "checkpoint durable-remote" in trace.stdout
    end = trace.marker("ckpt")
    for tier in (trace.root / "job" / "local", trace.root / "remote"):
        step = tier / "step-000000000005"
        _sharded_commit(trace, calls, step, end)
        # checkpoint.json is an attachment the manifest vouches for: durable before it
        man = [c for _s, d, c in trace.renames(calls) if d == str(step / "manifest.json")][-1]
        _commit(trace, calls, step / "checkpoint.json", man.entry)


def _made_dirs(calls: list[Call]) -> list[tuple[str, Call]]:
    return [(c.paths()[0], c) for c in calls if c.name in ("mkdir", "mkdirat") and c.ret == "0"]


def _entry_synced(trace: Trace, calls: list[Call], d: Path, manifest: Path) -> None:
    """The new directory ``d``'s entry is fsynced in its parent after it is
    made and before ``manifest`` (the commit point inside it) is renamed."""
    made = [c for p, c in _made_dirs(calls) if p == str(d)]
    assert made, f"{d} was not created in this window"
    man = [c for _s, dst, c in trace.renames(calls) if dst == str(manifest)][-1]
    ok = [c for c in _syncs_of(calls, str(d.parent)) if c.entry > made[-1].exit and c.exit < man.entry]
    assert ok, f"{d}: made, but its parent {d.parent} is never fsynced before {manifest.name} commits"


def test_sharded_checkpoint_directory_entry_is_durable(trace: Trace) -> None:
    calls = trace.window("save_nd", "sharded")
    ck = trace.root / "sharded" / "ck"
    _entry_synced(trace, calls, ck, ck / "manifest.json")
    _entry_synced(trace, calls, ck.parent, ck / "manifest.json")


def test_local_step_directory_entry_is_durable(trace: Trace) -> None:
    step = trace.root / "job" / "local" / "step-000000000005"
    _entry_synced(trace, trace.window("ckpt_open", "ckpt"), step, step / "manifest.json")


def test_remote_step_directory_entry_is_durable(trace: Trace) -> None:
    step = trace.root / "remote" / "step-000000000005"
    _entry_synced(trace, trace.window("ckpt_open", "ckpt"), step, step / "manifest.json")


def test_save_docstrings_say_what_durable_false_skips() -> None:
    import tierstore

    assert "durable=False`` skips the fsyncs" in (tierstore.save.__doc__ or "")
    assert "durable=False`` skips every fsync" in (tierstore.save_sharded.__doc__ or "")


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("12 fsync(3</a/b/.x.tmp>) = 0", ("fsync", "/a/b/.x.tmp", [])),
        # strace pads pids to five columns: a pid under 10000 (after a reboot) is followed by two spaces
        ("1189  fsync(3</a/b/.x.tmp>) = 0", ("fsync", "/a/b/.x.tmp", [])),
        ('12 rename("/a/.x", "/a/x") = 0', ("rename", None, ["/a/.x", "/a/x"])),
        ('12 renameat2(AT_FDCWD, "/a/.x", 4</a>, "x", RENAME_NOREPLACE) = 0', ("renameat2", None, ["/a/.x", "/a/x"])),
    ],
)
def test_parser(text: str, expect: tuple[str, str | None, list[str]]) -> None:
    (c,) = parse(text)
    assert (c.name, c.fd_path(), c.paths()) == expect


def test_parser_joins_unfinished_calls() -> None:
    text = "\n".join(
        [
            "7 fsync(3</d/.a.tmp> <unfinished ...>",
            '8 rename("/d/.b", "/d/b") = 0',
            "7 <... fsync resumed>) = 0",
        ]
    )
    calls = parse(text)
    f = next(c for c in calls if c.name == "fsync")
    assert (f.entry, f.exit, f.fd_path()) == (0, 2, "/d/.a.tmp")
    assert os.path.basename(next(c for c in calls if c.name == "rename").paths()[1]) == "b"
