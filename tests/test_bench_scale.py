"""The scale simulator (benches/bench_scale.py) on small sizes: it runs the
real commit and planning functions, and what a non-zero rank sends and
receives does not grow with the number of ranks."""

from __future__ import annotations

import json
import pathlib

from bench_util import load_bench


def test_per_rank_traffic_does_not_grow_with_the_ranks(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "scale.json"
    rc = load_bench("bench_scale").main(
        ["--ranks", "16,32,64", "--tensors", "20", "--tp", "4", "--pp", "2", "--json", str(out)]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    for fam in ("zero3", "fsdp2"):
        rs = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["world"])
        assert [r["world"] for r in rs] == [16, 32, 64]
        recv = [r["received_max"] for r in rs]
        assert max(recv) - min(recv) <= 16, recv  # its decisions: the same whatever W
        sent = [r["sent_max"] for r in rs]
        assert max(sent) <= 1.3 * min(sent), sent
        # Rank 0 hears from every rank: that does grow (linearly at most; the
        # rule tables, one copy each, do not grow at all).
        r0 = [r["rank0_received"] for r in rs]
        assert 1.2 < r0[1] / r0[0] < 2.1 and 1.2 < r0[2] / r0[1] < 2.1, r0
        # Doubling W doubles nothing a loading rank reads for a fixed target:
        # rules, not per-rank pieces (what grows is a file entry and a
        # position per rank: about 120 bytes, while T x ~100 bytes do not).
        reads = [r["loader_reads_bytes"] for r in rs]
        assert reads[1] < 1.5 * reads[0] and reads[2] < 1.5 * reads[1], reads
    dcp = [r for r in rows if r["family"] == "fsdp2 (DCP)"]
    assert len(dcp) == 3 and all(r["manifest_bytes"] > 0 for r in dcp)
