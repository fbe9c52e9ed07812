"""The node-tier benchmark (benches/bench_nodes.py) on a small state, with
the remote tier unthrottled: a restart reads nothing remotely and a lost
node's restore fetches exactly that node's share from elsewhere."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_nodes_runs_and_measures_what_it_claims(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "nodes.json"
    cmd = [sys.executable, str(ROOT / "benches" / "bench_nodes.py"), "--mib-per-rank", "2", "--no-throttle",
           "--repeats", "2", "--compute-s", "0.3",
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows["restart_remote_bytes"] == 0 and rows["restart_peer_bytes"] == 0
    assert rows["lost_node_elsewhere_bytes"] == rows["lost_node_share_bytes"] > 0
    assert rows["plain_local_s"] > 0 and rows["remote_only_s"] > 0 and not rows["remote_throttled"]
    # blocked: save + wait_capture around a step of compute; the capture alone is reported beside it
    assert rows["blocked_s"] >= 0 and rows["capture_s"] > 0 and rows["sync_save_s"] > 0
    assert "lost node" in r.stdout and "capture alone" in r.stdout
