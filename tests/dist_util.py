"""Runs a function on N real processes joined by torch.distributed (gloo on
loopback), the way users start ranks; failures come back with tracebacks."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, q: Any, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    # A forked child must not enter the parent's OpenMP pool (it would hang).
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    except BaseException:
        # gloo's rendezvous failed before the job ran (reported apart: see run_world)
        q.put((rank, "init-error", traceback.format_exc()))
        raise SystemExit(1) from None
    try:
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, method: str = "fork") -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` processes; returns their
    results in rank order, or raises with the first failure.

    ``fork`` is quick and fine for I/O; jobs that compute with torch need
    ``spawn`` (OpenMP thread pools do not survive a fork).

    When gloo's rendezvous itself fails (``init_process_group`` raised on a
    rank, and no rank failed in ``fn``), the world is started once more with
    a fresh store: that is the transport's setup on loopback, before any job
    code ran (seen once in CI: "Gloo connectFullMesh failed ... Connection
    closed by peer"). A failure inside ``fn`` is never retried."""
    results, errors, init_only = _run_once(world, fn, args, timeout, method)
    if errors and init_only:
        results, errors, _ = _run_once(world, fn, args, timeout, method)
    if errors:
        # The root cause is usually the error that is not about a peer closing.
        errors.sort(key=lambda e: "Connection closed by peer" in e)
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _run_once(
    world: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float, method: str
) -> tuple[dict[int, Any], list[str], bool]:
    """One start of the world: the results by rank, the errors, and whether
    every error came from the rendezvous (or a rank that never reported)."""
    ctx = mp.get_context(method)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as td:
        store = os.path.join(td, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, q, args)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        init_errors = 0
        job_errors = 0
        try:
            for _ in range(world):
                try:
                    rank, status, out = q.get(timeout=timeout if not errors else 10)
                except Exception:  # a rank died without reporting (killed), or all hung
                    errors.append("some ranks did not report (killed or hung)")
                    break
                if status == "ok":
                    results[rank] = out
                else:
                    errors.append(f"rank {rank}{' (rendezvous)' if status == 'init-error' else ''}:\n{out}")
                    init_errors += status == "init-error"
                    job_errors += status != "init-error"
        finally:
            for p in procs:
                p.join(timeout=5 if errors else timeout)
                if p.is_alive():
                    p.kill()
                    p.join()
    return results, errors, init_errors > 0 and job_errors == 0
