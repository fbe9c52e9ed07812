"""Sharded-checkpoint metadata at scale, simulated in one process.

A job of W ranks (pipeline x data x tensor parallel) with T parameters per
rank is built without any data: each simulated rank's layouts, the
metadata it sends to rank 0 before writing (``sharded.holdings_meta``), the
decisions rank 0 sends back (``sharded.decide_writers``), what it reports
about the file it wrote (``sharded.tensor_file_info``, with the file's
records laid out as the writer would), then rank 0's commit
(``sharded.build_manifest`` and ``shardmeta.write_manifest``, really
written) and a loading rank of another layout (TP halved, DP doubled)
opening the checkpoint and planning its reads (``shardmeta.Checkpoint``,
``make_plan``). These are the functions ``save_sharded`` and
``load_sharded`` run; only the transport is simulated: every object a
collective would carry is pickled and its size counted, as torch.distributed
pickles it.

Layout families:

- ``zero3``: Megatron TP (even parameters split on rows, odd on columns, a
  norm every tenth replicated over TP) inside ZeRO-3 flat partitions over
  DP (``zero_partition(stage=3)``), one pipeline stage per PP rank;
- ``zero1``: the same TP shards in one ZeRO-1 flat partition per rank over
  DP (``zero_partition(stage=1)``: the group's buffer padded and cut into DP
  parts, stored as one rule per member);
- ``fsdp2``: the same with FSDP2's row split over DP (DTensor
  ``Shard(0)`` boxes), also saved as PyTorch DCP would plan it (its planner
  functions run on the same chunks: local plans, ``dedup_save_plans``,
  ``create_default_global_save_plan``, and ``create_read_items_for_chunk_list``
  for the loading rank).

Per (family, W, T) it prints: metadata bytes a non-zero rank sends and
receives, rank 0's commit time and peak memory (tracemalloc, in a second
pass), manifest bytes, the manifest bytes a loading rank reads, and its
planning time. DCP's planner runs where its W x T objects fit in this one
process (``--dcp-max-entries``).

    python benches/bench_scale.py [--ranks 64,256,1024 --tensors 100 --tp 8 --pp 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierstore import api, sharded
from tierstore._sharded_read import Target, make_plan
from tierstore.layout import Box, Layout, Rule, Split, zero_partition
from tierstore.shardmeta import MANIFEST, Checkpoint, write_manifest

ROWS, COLS = 16384, 512
WORKERS = min(2, os.cpu_count() or 1)


def _shape(i: int) -> tuple[int, ...]:
    return (ROWS,) if i % 10 == 9 else (ROWS, COLS)


def _tp_dim(i: int) -> int | None:
    """The dimension TP splits parameter ``i`` on (None: TP replicates it)."""
    if len(_shape(i)) == 1:
        return None
    return 0 if i % 2 == 0 else 1


def rank_layouts(family: str, rank: int, world: int, n: int, tp: int, pp: int) -> dict[str, Layout]:
    """The layouts of one rank's ``n`` parameters (rank = (stage * dp + dp_rank) * tp + tp_rank),
    built as a job builds them: Megatron's TP splits (``Layout.shard``) inside
    ZeRO-3 partitions (``zero_partition``), or the rules ``save_sharded``
    reads from FSDP2 + TP DTensors (TP's ``Shard``, then DP's ``Shard(0)``)."""
    dp = world // (tp * pp)
    tp_rank, dp_rank, stage = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    out: dict[str, Layout] = {}
    if family == "zero1":
        # One ZeRO-1 flat partition of the stage's TP shards (one rule per member).
        params = []
        for i in range(n):
            name, shape, tdim = f"s{stage}.p{i}", _shape(i), _tp_dim(i)
            params.append(Layout.full(name, shape) if tdim is None else Layout.shard(name, shape, tdim, tp_rank, tp))
        out[f"s{stage}.zero1"] = zero_partition(params, dp_rank, dp, stage=1)
        return out
    for i in range(n):
        name = f"s{stage}.p{i}"
        shape = _shape(i)
        tdim = _tp_dim(i)
        if family == "zero3":
            param = Layout.full(name, shape) if tdim is None else Layout.shard(name, shape, tdim, tp_rank, tp)
            out[name] = zero_partition([param], dp_rank, dp, stage=3)
        elif tdim is None:  # FSDP2: rows split over DP, replicated over TP
            out[name] = Rule(name, shape, (Split(0, dp, "chunk"),), 0, True).layout_at((dp_rank,))
        else:
            rule = Rule(name, shape, (Split(tdim, tp, "chunk"), Split(0, dp, "chunk")))
            out[name] = rule.layout_at((tp_rank, dp_rank))
    return out


def _written(layouts: dict[str, Layout]) -> api.Written:
    """The records a rank's tensor file would hold (one per tensor, 4 KiB aligned)."""
    records, tensors = [], []
    at = 4096
    for j, (key, lay) in enumerate(layouts.items()):
        nbytes = 4 * int(torch.Size(lay.local_shape).numel())
        records.append({"name": f"data/{j}", "offset": at, "size": nbytes, "crc32": 0})
        tensors.append(
            {"path": ["tensors", key], "record": f"data/{j}", "storage_offset": 0, "dtype": "float32",
             "shape": list(lay.local_shape)}
        )  # fmt: skip
        at += -(-(nbytes + 128) // 4096) * 4096
    return api.Written(at + 8192, records, tensors, 0)


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _holdings(family: str, r: int, world: int, n: int, tp: int, pp: int) -> dict[str, Any]:
    """What rank ``r`` sends rank 0 before writing."""
    lay = rank_layouts(family, r, world, n, tp, pp)
    return sharded.holdings_meta({k: torch.empty(v.local_shape, device="meta") for k, v in lay.items()}, lay, world)


def _ranks_in_workers(fn: Any, world: int, args: Any, per_rank: list[Any] | None = None) -> list[Any]:
    """``fn(first, last, *args, per_rank[first:last])`` over the ranks, in
    ``WORKERS`` processes (each simulated rank runs the real code in one of
    them; only the messages come back)."""
    if WORKERS <= 1 or world < 256:
        return list(fn(0, world, *args, per_rank))
    step = -(-world // (WORKERS * 8))
    starts = list(range(0, world, step))
    with ProcessPoolExecutor(WORKERS) as ex:
        jobs = [
            ex.submit(fn, a, min(world, a + step), *args, per_rank[a : a + step] if per_rank is not None else None)
            for a in starts
        ]
        return [x for j in jobs for x in j.result()]


def _holdings_range(first: int, last: int, family: str, world: int, n: int, tp: int, pp: int, _: Any) -> list[Any]:
    return [_holdings(family, r, world, n, tp, pp) for r in range(first, last)]


def build_ranks(family: str, world: int, n: int, tp: int, pp: int) -> list[Any]:
    """The metadata every rank sends rank 0 before writing (each rank's
    layouts built, used and dropped in turn, as on W machines)."""
    return _ranks_in_workers(_holdings_range, world, (family, world, n, tp, pp))


def file_infos(family: str, world: int, n: int, tp: int, pp: int, decisions: list[dict[str, Any]]) -> list[Any]:
    """What every rank reports to rank 0 after writing its file."""
    return _ranks_in_workers(_infos_range, world, (family, world, n, tp, pp), decisions)


def _infos_range(
    first: int, last: int, family: str, world: int, n: int, tp: int, pp: int, decisions: list[dict[str, Any]]
) -> list[Any]:
    infos = []
    for r in range(first, last):
        dec = decisions[r - first]
        lay = rank_layouts(family, r, world, n, tp, pp)
        tensors = {k: torch.empty(v.local_shape, device="meta") for k, v in lay.items()}
        table = sharded.rule_table(tensors, lay)
        skip = sharded.skipped_keys(table, dec)
        mine = {k: v for k, v in lay.items() if k not in skip}
        info: dict[str, Any] = {"rank": r, "tensors": {}, "objects_file": None, "paths": {}}
        if dec.get("describe"):
            by_digest = {sharded._digest(e): e for e in table.values()}
            info["rules"] = {dg: by_digest[dg] for dg in dec["describe"]}
        if mine:
            lay_json = {k: v.to_json() for k, v in mine.items()}
            info.update(sharded.tensor_file_info(f"rank-{r:05d}.{dec['save_id']}.pt", _written(mine), lay_json))
        infos.append(info)
    return infos


SAVE_ID = "0123456789ab"


def simulate(family: str, world: int, n: int, tp: int, pp: int, d: Path, memory: bool = False) -> dict[str, Any]:
    """One (family, W, T) point through tierstore's commit and load planning."""
    metas = build_ranks(family, world, n, tp, pp)
    sent = [_size(m) for m in metas]
    t0 = time.perf_counter()
    decisions = sharded.decide_writers(metas, d, SAVE_ID)
    t_decide = time.perf_counter() - t0
    infos = file_infos(family, world, n, tp, pp, decisions)
    sent_info = [_size(i) for i in infos]
    received = [_size(dec) + _size(None) for dec in decisions]
    gc.collect()
    t0 = time.perf_counter()
    m = sharded.build_manifest(d, SAVE_ID, world, infos, metas, decisions)
    write_manifest(d, m, durable=False)
    t_commit = t_decide + time.perf_counter() - t0
    head_bytes = (d / MANIFEST).stat().st_size
    manifest_bytes = head_bytes + sum(p.stat().st_size for p in d.glob("index.*.bin"))
    del m
    mib = rank0_memory(metas, infos, world, d) if memory else None
    del infos, metas, decisions
    # A loading rank of another layout: TP halved, DP doubled, the first stage.
    t0 = time.perf_counter()
    ck = Checkpoint(d)
    t_open = time.perf_counter() - t0
    target = rank_layouts(family, 1, world, n, max(1, tp // 2), pp)
    t0 = time.perf_counter()
    targets = [Target(k, torch.empty(v.local_shape, device="meta"), torch.empty(0), v) for k, v in target.items()]
    plan = make_plan(ck, targets)
    t_plan = time.perf_counter() - t0
    assert len(plan.needed) == len(targets)
    others = range(1, world)
    return {
        "family": family,
        "world": world,
        "tensors": n,
        "sent_max": max(sent[r] + sent_info[r] for r in others),
        "received_max": max(received[r] for r in others),
        "rank0_received": sum(sent) + sum(sent_info),
        "commit_s": t_commit,
        "manifest_bytes": manifest_bytes,
        # manifest.json, and of an indexed manifest its table and the sections planned from
        "loader_reads_bytes": head_bytes + (ck.index_file.bytes_read if ck.index_file is not None else 0),
        "open_s": t_open,
        "plan_s": t_plan,
        **({"rank0_mib": mib} if mib is not None else {}),
    }


def rank0_memory(metas: list[Any], infos: list[Any], world: int, d: Path) -> float:
    """Peak MiB rank 0 holds for the commit: the gathered metadata, and what
    the commit allocates over it (decisions, manifest, its JSON; tracemalloc,
    in a second run of the commit on the same gathered metadata)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    decisions = sharded.decide_writers(metas, d, SAVE_ID)
    m = sharded.build_manifest(d, SAVE_ID, world, infos, metas, decisions)
    write_manifest(d, m, durable=False)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    held = sum(_size(x) for x in metas) + sum(_size(x) for x in infos)
    return (peak + held) / 2**20


def simulate_dcp(world: int, n: int, tp: int, pp: int) -> dict[str, Any]:
    """The same fsdp2 layouts through PyTorch DCP's planner functions."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    props = TensorProperties(dtype=torch.float32)

    def chunks(lay: Layout) -> list[tuple[str, Box, tuple[int, ...]]]:
        return [(p.tensor, p.box, lay.global_shapes[p.tensor]) for p in lay.pieces]

    plans = []
    for r in range(world):
        items = []
        for lay in rank_layouts("fsdp2", r, world, n, tp, pp).values():
            for fqn, box, shape in chunks(lay):
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(box.offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths)),
                            properties=props,
                            size=torch.Size(shape),
                        ),
                    )
                )
        plans.append(SavePlan(items))
    sent = [_size(p) for p in plans[1:]]
    t0 = time.perf_counter()
    deduped = dedup_save_plans(plans)
    global_plans, md = create_default_global_save_plan(deduped)
    t_commit = time.perf_counter() - t0
    received = [_size(p) for p in global_plans[1:]]
    md_bytes = _size(md)
    t0 = time.perf_counter()
    md2 = pickle.loads(pickle.dumps(md))
    t_open = time.perf_counter() - t0
    target = rank_layouts("fsdp2", 1, world, n, max(1, tp // 2), pp)
    t0 = time.perf_counter()
    for lay in target.values():
        for fqn, box, _shape in chunks(lay):
            local = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths))]
            create_read_items_for_chunk_list(fqn, md2.state_dict_metadata[fqn], local)
    t_plan = time.perf_counter() - t0
    return {
        "family": "fsdp2 (DCP)",
        "world": world,
        "tensors": n,
        "sent_max": max(sent),
        "received_max": max(received),
        "commit_s": t_commit,
        "manifest_bytes": md_bytes,
        "loader_reads_bytes": md_bytes,
        "open_s": t_open,
        "plan_s": t_plan,
    }


def _row(r: dict[str, Any]) -> str:
    mem = f"{r['rank0_mib']:9.1f}" if "rank0_mib" in r else f"{'':>9}"
    return (
        f"{r['family']:12} {r['world']:6d} {r['tensors']:5d} {r['sent_max'] / 1e3:10.1f} "
        f"{r['received_max'] / 1e3:10.2f} "
        f"{r['commit_s']:9.2f} {mem} {r['manifest_bytes'] / 1e6:10.2f} {r['loader_reads_bytes'] / 1e6:10.2f} "
        f"{r['open_s'] + r['plan_s']:8.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--tensors", default="100")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--families", default="zero3,zero1,fsdp2")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--memory", action="store_true", help="also measure rank 0's peak memory (a second pass)")
    ap.add_argument(
        "--dcp-max-entries", type=int, default=1_100_000,
        help="run DCP's planner (one object per rank x tensor, in this one process) up to this W x T",
    )  # fmt: skip
    ap.add_argument(
        "--index-bytes", type=int, default=None,
        help="index the manifest above this many bytes (TIERSTORE_MANIFEST_INDEX_BYTES; default 1 MiB)",
    )  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="write the table here too")
    args = ap.parse_args(argv)
    was = os.environ.get("TIERSTORE_MANIFEST_INDEX_BYTES")
    if args.index_bytes is not None:
        os.environ["TIERSTORE_MANIFEST_INDEX_BYTES"] = str(args.index_bytes)
    try:
        return _run(args, sys.argv[1:] if argv is None else argv)
    finally:
        if was is None:
            os.environ.pop("TIERSTORE_MANIFEST_INDEX_BYTES", None)
        else:
            os.environ["TIERSTORE_MANIFEST_INDEX_BYTES"] = was


def _provenance(seconds: float, argv: list[str]) -> str:
    """Which code made the table, when, how, and in how long."""
    import datetime
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", "python", "rust", "benches"):
        commit += " with local changes"
    cmd = " ".join(["python", "benches/bench_scale.py", *argv])
    return (
        f"(run on commit {commit}, {datetime.date.today().isoformat()}, {os.cpu_count()} cores, "
        f"{seconds / 60:.1f} minutes: {cmd})"
    )


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    printed: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        printed.append(line)

    head = (
        f"{'layout':12} {'ranks':>6} {'T':>5} {'sent kB':>10} {'recv kB':>10} {'commit s':>9} {'rank0 MiB':>9} "
        f"{'manifest MB':>10} {'loader MB':>10} {'plan s':>8}"
    )
    say("metadata per save, simulated (sent/recv: a non-zero rank, max over ranks; plan: open + plan of a")
    say(f"loading rank with TP {args.tp} -> {max(1, args.tp // 2)}, DP x2); TP {args.tp}, PP {args.pp}")
    say(head)
    for fam in args.families.split(","):
        for w in (int(x) for x in args.ranks.split(",")):
            for n in (int(x) for x in args.tensors.split(",")):
                dp = w // (args.tp * args.pp)
                if w % (args.tp * args.pp) or (ROWS // args.tp) % (2 * dp) or ROWS % (2 * dp):
                    say(f"{fam:12} {w:6d} {n:5d}  skipped: W must be a multiple of TP x PP with rows to split")
                    continue
                d = Path(tempfile.mkdtemp(prefix="ts-scale-"))
                try:
                    r = simulate(fam, w, n, args.tp, args.pp, d, args.memory)
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                rows.append(r)
                say(_row(r))
                if fam == "fsdp2" and not args.no_dcp and w * n > args.dcp_max_entries:
                    say(f"{'fsdp2 (DCP)':12} {w:6d} {n:5d}  skipped: {w * n:,} rank x tensor items > --dcp-max-entries")
                elif fam == "fsdp2" and not args.no_dcp:
                    r2 = simulate_dcp(w, n, args.tp, args.pp)
                    rows.append(r2)
                    say(_row(r2))
    say(_provenance(time.perf_counter() - t_all, argv))
    if args.out:
        Path(args.out).write_text("\n".join(printed) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
