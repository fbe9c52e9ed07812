"""The resharding benchmark's metadata-only planning simulation runs the
real planner and block expansion (it broke once without anyone noticing:
a benchmark that only runs by hand rots)."""

from __future__ import annotations

from bench_util import load_bench


def test_planning_simulation_runs_the_real_planner() -> None:
    mod = load_bench("bench_reshard")
    plan_s, expand_s = mod.planning_simulation(n_tensors=200, ranks=64)
    assert plan_s > 0 and expand_s > 0
