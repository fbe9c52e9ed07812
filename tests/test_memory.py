"""A save of N GiB holds no second copy: peak RSS grows by at most 512 MiB."""

from __future__ import annotations

import pathlib

from conftest import run_python

CHILD = r"""
import resource, sys, torch, tierstore
state = {f"w{i}": torch.randn(32 << 20) for i in range(8)}  # 8 x 128 MiB = 1 GiB
state.update({f"s{i}": torch.randn(1024) for i in range(2000)})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tierstore.save(state, sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024)
"""


def test_peak_rss_during_save(tmp_path: pathlib.Path) -> None:
    r = run_python(CHILD, str(tmp_path / "m.pt"))
    assert r.returncode == 0, r.stderr
    extra_mib = int(r.stdout.strip().splitlines()[-1])
    assert extra_mib <= 512, f"peak RSS grew by {extra_mib} MiB during a 1 GiB save"
