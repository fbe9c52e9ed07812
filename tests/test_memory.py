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


HOST_BUFFER = r"""
import gc, os, torch
os.environ["TIERSTORE_HUGE_PAGES"] = "0"  # the engine's choice: plain pages for buffers that do not ask
from tierstore._engine import host_buffer

def rss_kib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])

def huge_kib(addr):
    # AnonHugePages of the mapping that holds ``addr``
    cur = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = lo <= addr < hi
        elif cur and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0

b = host_buffer(64 << 20, huge=True)
assert b.dtype == torch.uint8 and b.numel() == 64 << 20 and b.is_contiguous()
assert b.data_ptr() % (2 << 20) == 0, hex(b.data_ptr())
b.fill_(7)
assert int(b[::4096].sum()) == 7 * (16 << 10)
thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
if "[never]" not in thp:
    print("huge", huge_kib(b.data_ptr()))
c = host_buffer(64 << 20)  # follows the engine: no advice
c.fill_(1)
if "[madvise]" in thp:
    print("plain", huge_kib(c.data_ptr()))
del c
v = b[100:200]
del b
gc.collect()
assert int(v.sum()) == 700  # a view keeps the memory
del v
base = rss_kib()
for _ in range(8):
    x = host_buffer(256 << 20)
    x.fill_(1)
    del x
print("grew", (rss_kib() - base) // 1024)
assert host_buffer(0).numel() == 0
small = host_buffer(8 << 10)
assert small.numel() == 8 << 10 and small.data_ptr() % 4096 == 0
small.fill_(1)
assert huge_kib(small.data_ptr()) == 0  # no huge page behind a small buffer
"""


def test_host_buffer_is_aligned_huge_and_returned(tmp_path: pathlib.Path) -> None:
    """The O_DIRECT host buffers: 2 MiB aligned, on huge pages where the kernel
    has them (full-size requests), and given back to the system when dropped."""
    r = run_python(HOST_BUFFER)
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in r.stdout.strip().splitlines())
    assert int(out["grew"]) < 128, f"RSS grew {out['grew']} MiB over 8 dropped 256 MiB buffers"
    if "huge" in out:
        assert int(out["huge"]) >= 16 << 10, f"only {out['huge']} KiB of 64 MiB on huge pages"
    if "plain" in out:  # a buffer that does not ask follows the engine's choice (here: no huge pages)
        assert int(out["plain"]) == 0, f"{out['plain']} KiB on huge pages against the engine's choice"
