"""The resharding benchmark's metadata-only planning simulation runs the
real planner and block expansion (it broke once without anyone noticing:
a benchmark that only runs by hand rots)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_planning_simulation_runs_the_real_planner() -> None:
    spec = importlib.util.spec_from_file_location("bench_reshard", ROOT / "benches" / "bench_reshard.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_reshard"] = mod
    spec.loader.exec_module(mod)
    plan_s, expand_s = mod.planning_simulation(n_tensors=200, ranks=64)
    assert plan_s > 0 and expand_s > 0
