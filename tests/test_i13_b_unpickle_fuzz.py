"""The weights-only fast path against torch's own rules (issue 13, item 10).

``test_short_campaign`` runs ``tests/fuzz/unpickle_fuzz.py`` (a seeded run of
a few hundred generated, random and mutated pickles; see its docstring) in a
subprocess under an address-space limit and fails on any finding it does not
already know: the fast path returning something other than torch's result,
accepting what torch refuses, refusing what torch accepts (beyond tierstore's
deliberate refusals), handing the persistent loader an id torch would refuse,
or ``tierstore.load`` disagreeing with ``torch.load``. The long run is the
script's ``--cases``.

The findings are below, each as a regression test with its smallest pickle
(the Rust persistent-id check and the bytearray stand-in were the last two,
kept as strict xfails until fixed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import _pickle

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fuzz"))

import unpickle_fuzz as uf  # noqa: E402

CASES = int(os.environ.get("TIERSTORE_UNPICKLE_FUZZ_CASES", "800"))
SEED = int(os.environ.get("TIERSTORE_UNPICKLE_FUZZ_SEED", "20260113"))


def test_short_campaign(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    args = ["--cases", str(CASES), "--seed", str(SEED), "--json", str(out)]
    r = subprocess.run(
        [sys.executable, str(HERE / "fuzz" / "unpickle_fuzz.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    print(r.stdout, r.stderr[-3000:])
    assert out.exists(), f"the campaign did not finish (rc {r.returncode}):\n{r.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert s["cases"] == CASES
    fresh = uf.new_findings(s)
    assert not fresh, "\n".join(
        f"--replay {f['seed']}: {f['check']}:{f['class']}: {f['detail']} [{f['source']}: {f['note']}]" for f in fresh
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # The run must exercise both outcomes of the fast path, or its verdicts mean little.
    direct, load = s["table"]["direct"], s["table"]["load"]
    assert direct.get("equal", 0) >= CASES // 5, direct  # the fast path returned torch's object
    assert direct.get("declined", 0) >= CASES // 5, direct
    assert load.get("equal", 0) >= CASES // 5 and load.get("both_refuse", 0) >= CASES // 5, load
    assert s["table"]["load_path"].get("fast", 0) >= CASES // 5, s["table"]["load_path"]


# ----------------------------------------------------------------------------------------------
# known findings (Rust side: rust/py/src/unpickle.rs; reported, not fixed here)


def _pids_fast_path_passes(pkl: bytes) -> list[Any]:
    seen: list[Any] = []

    def persistent_load(pid: Any) -> Any:
        seen.append(pid)
        return "loaded"

    with contextlib.suppress(Exception):
        _pickle.fast_weights_only(pkl, persistent_load)
    return seen


_STORAGE_AS = {
    "bytearray": uf.reduce(
        uf.glob("builtins", "bytearray"), uf.reduce(uf.glob("_codecs", "encode"), uf.u("storage"), uf.u("latin1"))
    ),
    "list": b"](" + b"".join(uf.integer(c) for c in b"storage") + b"e",
    "tuple": b"(" + b"".join(uf.integer(c) for c in b"storage") + b"t",
}


@pytest.mark.parametrize("as_", list(_STORAGE_AS))
def test_fast_path_hands_only_torch_persistent_ids_to_the_loader(as_: str) -> None:
    # smallest pickle: MARK <'storage' as bytearray/list/tuple> TUPLE BINPERSID STOP
    pkl = b"(" + _STORAGE_AS[as_] + b"tQ."
    with pytest.raises(pickle.UnpicklingError):
        uf.wo.Unpickler(io.BytesIO(pkl), encoding="utf-8").load()  # torch refuses it
    assert _pids_fast_path_passes(pkl) == []


def test_tierstore_load_refuses_those_persistent_ids(tmp_path: Path) -> None:
    for first in _STORAGE_AS.values():
        case = uf.Case("x", "known", uf.P2 + uf.persid("1", 4, first=first) + b".", uf.pool_records())
        ts, th, _fast = uf.run_load(case, tmp_path / "c.pt")
        assert th.error is not None and ts.error is not None, (ts, th)
        assert isinstance(ts.error, tierstore.TierstoreError), ts.error


def test_fast_path_returns_the_bytearray_class_as_torch_does() -> None:
    pkl = b"cbuiltins\nbytearray\n."
    assert uf.wo.Unpickler(io.BytesIO(pkl)).load() is bytearray
    assert _pickle.fast_weights_only(pkl, None) in (None, bytearray)


def _archive(tmp_path: Path, pkl: bytes, records: dict[str, bytes]) -> Path:
    p = tmp_path / "a.pt"
    uf.write_archive(p, uf.Case("x", "t", pkl, records))
    return p


def test_load_returns_the_bytearray_class_as_torch_does(tmp_path: Path) -> None:
    p = _archive(tmp_path, b"cbuiltins\nbytearray\n.", {})
    assert torch.load(p, weights_only=True) is bytearray
    assert tierstore.load(p, weights_only=True) is bytearray
    # and a bytearray larger than the pickle is still refused (tierstore's own limit)
    big = _archive(tmp_path, uf.P2 + uf.reduce(uf.glob("builtins", "bytearray"), uf.integer(1 << 30)) + b".", {})
    with pytest.raises(tierstore.UnsafeObjectError, match="in a pickle of"):
        tierstore.load(big)


# ----------------------------------------------------------------------------------------------
# disagreements the fuzzer found on the Python side (tierstore/api.py), fixed


def _tensor_pickle(key: str, numel: int, stype: str = "FloatStorage", size: int = 2) -> bytes:
    return (
        uf.P2
        + uf.reduce(
            uf.glob("torch._utils", "_rebuild_tensor_v2"),
            uf.persid(key, numel, stype),
            uf.integer(0),
            uf.tup(uf.integer(size)),
            uf.tup(uf.integer(1)),
            b"\x89",
            uf.reduce(uf.glob("collections", "OrderedDict")),
        )
        + b"."
    )


@pytest.mark.parametrize("record", [12, 16, 4])
def test_a_record_of_another_size_than_its_reference_is_refused_as_torch_does(tmp_path: Path, record: int) -> None:
    # data.pkl says 2 floats (8 bytes); tierstore used to take the first 8 bytes of a longer record.
    p = _archive(tmp_path, _tensor_pickle("0", 2), {"0": bytes(range(record))})
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(p, weights_only=True)
    for wo in (True, False):
        with pytest.raises(tierstore.CorruptFileError, match=f"holds {record} bytes but data.pkl expects 8"):
            tierstore.load(p, weights_only=wo)
    ok = _archive(tmp_path, _tensor_pickle("0", 2), {"0": bytes(range(8))})
    assert torch.equal(tierstore.load(ok), torch.load(ok))


def test_an_empty_record_does_not_grow_into_uninitialised_memory(tmp_path: Path) -> None:
    # A tensor of 4 halves over an empty record: torch refuses to resize the record's storage;
    # tierstore used to resize its own (resizable) empty storage and return 8 bytes of heap.
    pkl = _tensor_pickle("2", 0, "HalfStorage", size=4)
    p = _archive(tmp_path, pkl, {"2": b""})
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(p, weights_only=True)
    for load in (lambda: tierstore.load(p), lambda: tierstore.load(io.BytesIO(p.read_bytes()))):
        with pytest.raises(tierstore.CorruptFileError, match="not resizable"):
            load()
    # empty tensors over empty records still load, through every path
    p = _archive(tmp_path, _tensor_pickle("2", 0, size=0), {"2": b""})
    for back in (tierstore.load(p), tierstore.load(p, mmap=True), tierstore.load(io.BytesIO(p.read_bytes()))):
        assert back.shape == (0,) and back.dtype == torch.float32


def test_a_record_referenced_twice_as_torch_does(tmp_path: Path) -> None:
    # torch.load loads a record once per dtype; a reference with another dtype of the same length
    # shares its bytes, and lengths are checked against the record.
    rebuild = uf.glob("torch._utils", "_rebuild_tensor_v2")
    od = uf.reduce(uf.glob("collections", "OrderedDict"))
    a = uf.reduce(
        rebuild,
        uf.persid("0", 2, "FloatStorage"),
        uf.integer(0),
        uf.tup(uf.integer(2)),
        uf.tup(uf.integer(1)),
        b"\x89",
        od,
    )
    b = uf.reduce(
        rebuild,
        uf.persid("0", 8, "ByteStorage"),
        uf.integer(0),
        uf.tup(uf.integer(2)),
        uf.tup(uf.integer(1)),
        b"\x89",
        od,
    )
    p = _archive(tmp_path, uf.P2 + a + b + b"\x86.", {"0": bytes(range(8))})
    want = torch.load(p, weights_only=True)
    assert want[1].dtype == torch.uint8
    for wo in (True, False):
        got = tierstore.load(p, weights_only=wo)
        assert uf.same(got, want) is None, uf.same(got, want)


# ----------------------------------------------------------------------------------------------
# a rule the fast path relies on without checking it at run time


def test_allowed_globals_are_not_renamed_by_torch() -> None:
    """The fast path looks ``module.name`` up as written; torch first maps Python 2 names
    (``_compat_pickle.NAME_MAPPING`` / ``IMPORT_MAPPING``). That is only equivalent while no
    allowed name is itself renamed by the mapping."""
    from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

    allowed = {**uf.wo._get_user_allowed_globals(), **uf.wo._get_allowed_globals()}
    renamed = []
    for full in allowed:
        module, _, name = full.rpartition(".")
        if (module, name) in NAME_MAPPING or module in IMPORT_MAPPING:
            renamed.append(full)
    assert not renamed


def test_the_harness_compares_what_it_should() -> None:
    """The comparison the campaign rests on tells results apart (and NaNs, aliasing, types)."""
    t = torch.arange(4.0)
    x: list[Any] = [1]
    assert (
        uf.same(
            {"a": t, "n": float("nan"), "s": {float("nan")}}, {"a": t.clone(), "n": float("nan"), "s": {float("nan")}}
        )
        is None
    )
    assert uf.same([x, x], [[1], [1]]) is not None  # sharing differs
    assert uf.same(t, t.to(torch.float64)) is not None
    assert uf.same(t, t + 1) is not None
    assert uf.same(0.0, -0.0) is not None
    assert uf.same(1, True) is not None
    assert uf.same(bytearray, bytearray) is None and uf.same(bytearray, bytes) is not None
    assert uf.same(torch.nn.Parameter(t), t) is not None
