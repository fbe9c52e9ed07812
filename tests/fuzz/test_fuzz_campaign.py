"""A short seeded run of the adversarial fuzz campaign (tests/fuzz/campaign.py).

About 200 cases over all four kinds (single files, sharded checkpoints, DCP
directories, Checkpointer runs), in two worker processes under an
address-space limit; it fails on any bad outcome (wrong data returned, a
crash, a hang, runaway memory, code run from a file, data read from outside
the checkpoint, ``verify`` passing damage, a control case failing) and when
more than 1% of the cases raise something other than a ``TierstoreError``.
The failure message lists each finding with the ``--replay KIND:SEED`` that
reproduces it. The long campaign: see tests/fuzz/README.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import campaign

CASES = int(os.environ.get("TIERSTORE_FUZZ_CASES", "200"))
SEED = int(os.environ.get("TIERSTORE_FUZZ_SEED", "20260101"))


def test_fuzz_campaign(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = campaign.run_campaign(
        cases=CASES,
        seed=SEED,
        kinds=campaign.KINDS,
        workers=2,
        workdir=tmp_path,
        case_timeout=15.0,
        log=lines.append,
    )
    print("\n".join(lines))
    print(campaign.report(summary))
    assert summary["cases"] == CASES
    assert summary["ok"], "fuzz campaign found problems:\n" + campaign.failure_message(summary)


def test_campaign_detects_every_bad_outcome(tmp_path: Path) -> None:
    """The harness itself: a hang, a crash, an allocation past the
    address-space limit, code run, a read outside the checkpoint, wrong data
    and a raw exception, each made to happen inside an op, are classified as
    such (and the worker is replaced after a hang or a crash)."""
    tests = ["__hang__", "__crash__", "__memory__", "__code__", "__outside__", "__silent__", "__other__"]
    summary = campaign.run_campaign(
        cases=len(tests),
        seed=1,
        kinds=["single"],
        workers=1,
        workdir=tmp_path,
        case_timeout=6.0,
        mutator=tests,
        log=lambda _m: None,
    )
    got = {r["mutator"]: r["class"] for r in summary["results"]}
    assert got == {
        "__hang__": "hang",
        "__crash__": "crash",
        "__memory__": "memory_limit",
        "__code__": "code_executed",
        "__outside__": "read_outside",
        "__silent__": "silent_difference",
        "__other__": "other_error",
    }, campaign.report(summary, mutators=False)
    assert summary["worker_restarts"] == 2
    assert not summary["ok"]


@pytest.mark.parametrize(
    ("mutator", "bad"),
    [
        # Python's cyclic collector off after the case (a pause of
        # tierstore._gc begun and never ended, as an error path could leave it).
        ("__gc_off__", "collector_left_off"),
        # One of a load's reader threads still running after the case (it
        # could still be writing into the caller's tensors).
        ("__read_left__", "reads_left_running"),
    ],
)
def test_campaign_detects_what_a_case_leaves_behind(tmp_path: Path, mutator: str, bad: str) -> None:
    """A case that leaves the process in a state the next one must not
    inherit is a bad outcome of its own."""
    summary = campaign.run_campaign(
        cases=1,
        seed=1,
        kinds=["single"],
        workers=1,
        workdir=tmp_path,
        case_timeout=10.0,
        mutator=[mutator],
        log=lambda _m: None,
    )
    assert [r["class"] for r in summary["results"]] == [bad], campaign.report(summary)
    assert not summary["ok"]


def test_a_fault_the_op_injects_is_not_held_against_the_file(tmp_path: Path) -> None:
    """``load_mmap_shrunk`` cuts its copy of the file short while it loads:
    its clean error (naming the record that lost bytes) is the expected
    outcome, also on control cases, where every other op must still return
    the saved state exactly."""
    summary = campaign.run_campaign(
        cases=12,
        seed=2,
        kinds=["single"],
        workers=1,
        workdir=tmp_path,
        case_timeout=15.0,
        mutator=["none"],
        log=lambda _m: None,
    )
    assert summary["ok"], campaign.report(summary)
    shrunk = [o for r in summary["results"] for o in r["ops"] if o["op"] == "load_mmap_shrunk"]
    assert shrunk, "no case ran the op"
    # A cut past every byte the load reads leaves the state intact.
    assert all(o["outcome"] in ("error_clean", "equal") and o["injected"] for o in shrunk), shrunk
    assert any("TruncatedFileError" in o.get("exc", "") and "record '" in o.get("exc", "") for o in shrunk), shrunk
    others = [o for r in summary["results"] for o in r["ops"] if not o.get("injected")]
    assert others and all(o["outcome"] == "equal" for o in others), campaign.report(summary)


def test_damaged_offloaded_optimizer_files_fall_back_with_a_warning(tmp_path: Path) -> None:
    """``step_offload_file`` damages, loses or swaps a subgroup file of the
    newest step of a Checkpointer run whose state holds an offloaded
    optimizer: a fresh ``load_latest()``, plain and into a fresh offloaded
    optimizer, returns the newest step exactly or an older one exactly, with
    a warning naming the step it passed over."""
    summary = campaign.run_campaign(
        cases=6,
        seed=3,
        kinds=["checkpointer"],
        workers=1,
        workdir=tmp_path,
        case_timeout=30.0,
        mutator=["step_offload_file"],
        log=lambda _m: None,
    )
    assert summary["ok"], campaign.report(summary)
    ops = [o for r in summary["results"] for o in r["ops"]]
    assert {o["op"] for o in ops} == {"load_latest", "load_latest_into"}
    assert all(o["outcome"] == "equal" for o in ops), campaign.report(summary)
    # At least one case lost step 3 to the damage: a fallback, said out loud.
    fell = [o for o in ops if "fell back" in o.get("detail", "")]
    assert fell and all(any("offload" in w or "step 3" in w for w in o["warnings"]) for o in fell), ops
