"""Node-scoped tiers (issue 17, first part): each node writes its ranks' files
to its own local tier and holds the checkpoint's manifest there too; a
restore reads each file from the nearest intact copy (this node's, else the
remote tier's), every rank the same step. Real processes on one machine:
4 ranks as 2 nodes (``TIERSTORE_NODE``), a ``{node}`` in the local tier's
path keeping the nodes' copies apart, bytes read counted per tier."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_world

import tierstore
from tierstore import Checkpointer, DiskTier, HostTier, RemoteTier
from tierstore.errors import InvalidArgumentError
from tierstore.layout import Layout, attach

ROWS, COLS = 64, 40


def _full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def _tiers(root: str) -> list[Any]:
    return [
        HostTier("64MiB"),
        DiskTier("nvme-{node}", scope="node"),  # under the job directory
        RemoteTier(os.path.join(root, "remote")),
    ]


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    per = ROWS // world
    lay = Layout.block("w", (ROWS, COLS), (rank * per, 0), (per, COLS))
    return {"w": attach(_full(step)[rank * per : (rank + 1) * per].clone(), lay), "step": step,
            "rng": tierstore.PerRank(rank * 100 + step)}  # fmt: skip


def _target(rank: int, world: int) -> dict[str, Any]:
    per = ROWS // world
    lay = Layout.block("w", (ROWS, COLS), (rank * per, 0), (per, COLS))
    return {"w": attach(torch.full((per, COLS), float("nan")), lay), "step": None, "rng": None}


def _node_env(rank: int) -> None:
    os.environ["TIERSTORE_NODE"] = f"n{rank // 2}"  # ranks 0, 1 on node n0; 2, 3 on n1


def _train(rank: int, world: int, root: str, tiers: Any = _tiers, clean: bool = True) -> list[str]:
    """Steps 0-2 saved and waited for; ``clean=False`` closes without
    waiting, as if the processes died once the checkpoints were durable."""
    _node_env(rank)
    ck = Checkpointer(os.path.join(root, "job"), tiers=tiers(root))
    hs = []
    for step in range(3):
        hs.append(ck.save(step, _state(rank, world, step)))
        ck.wait_capture()
    ck.wait()
    ck.close(wait=clean)
    return [h.state for h in hs]


def _restore(rank: int, world: int, root: str, tiers: Any = _tiers) -> dict[str, Any]:
    _node_env(rank)
    ck = Checkpointer(os.path.join(root, "job"), tiers=tiers(root))
    into = _target(rank, world)
    ck.load_latest(into=into)
    per = ROWS // world
    assert torch.equal(into["w"], _full(2)[rank * per : (rank + 1) * per]), rank
    assert into["step"] == 2 and into["rng"] == rank * 100 + 2
    got = dict(ck.restored or {})
    ck.close()
    return got


def _job(tmp_path: Path) -> str:
    root = str(tmp_path)
    states = run_world(4, _train, root)
    assert states == [["durable-remote"] * 3] * 4
    return root


def test_each_node_holds_its_ranks_files_and_the_manifest(tmp_path: Path) -> None:
    root = _job(tmp_path)
    for node, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        d = tmp_path / "job" / f"nvme-{node}" / "step-000000000002"
        names = sorted(p.name.split(".")[0] for p in d.glob("rank-*.pt"))
        assert names == [f"rank-{r:05d}" for r in ranks], (node, names)
        assert (d / "manifest.json").is_file() and (d / "checkpoint.json").is_file()
    # The remote copy has every rank's files, and one process reads it whole.
    remote = tmp_path / "remote" / "step-000000000002"
    assert len(list(remote.glob("rank-*.pt"))) == 4
    whole = {"w": torch.zeros(ROWS, COLS)}
    tierstore.load_sharded(remote, whole)
    assert torch.equal(whole["w"], _full(2))
    assert root


def test_a_restart_on_the_same_nodes_reads_nothing_remotely(tmp_path: Path) -> None:
    root = _job(tmp_path)
    got = run_world(4, _restore, root)
    for r in got:
        assert r["step"] == 2 and r["tier"] == "local", r
        by = r["bytes_by_tier"]
        assert by.get("remote", 0) == 0 and by["local"] > 0, r


def test_a_replaced_node_reads_only_its_files_from_the_remote_tier(tmp_path: Path) -> None:
    root = _job(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n1")  # node n1 replaced: its local disk is empty
    got = run_world(4, _restore, root)
    for rank, r in enumerate(got):
        by = r["bytes_by_tier"]
        if rank < 2:
            assert by.get("remote", 0) == 0 and by["local"] > 0, (rank, r)
        else:
            assert by.get("local", 0) == 0 and by["remote"] > 0, (rank, r)


def test_a_damaged_local_file_is_read_from_the_next_copy(tmp_path: Path) -> None:
    root = _job(tmp_path)
    d = tmp_path / "job" / "nvme-n1" / "step-000000000002"
    victim = next(d.glob("rank-00003.*.pt"))
    data = bytearray(victim.read_bytes())
    at = bytes(data).find(_full(2)[48:64].numpy().tobytes()[:64])
    assert at > 0
    data[at + 100] ^= 0xFF  # inside rank 3's tensor data: found by its chunk checksum
    victim.write_bytes(bytes(data))
    got = run_world(4, _restore_warned, root)  # rank 3 is warned, naming the file, and reads the remote copy
    assert got[3]["bytes_by_tier"]["remote"] > 0 and got[2]["bytes_by_tier"].get("remote", 0) == 0


def _restore_warned(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _restore(rank, world, root)
    said = [str(x.message) for x in w if "rank-00003" in str(x.message)]
    assert bool(said) == (rank == 3), [str(x.message) for x in w]
    assert rank != 3 or "checksum" in said[0].lower() or "crc" in said[0].lower(), said
    return got


def test_a_node_that_lost_a_step_makes_every_rank_take_an_older_one(tmp_path: Path) -> None:
    """Node n1's copy of step 2 is gone and the remote tier never got step 2:
    every rank restores step 1 (local where it is, remote for the rest)."""
    root = _job(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n1" / "step-000000000002")
    shutil.rmtree(tmp_path / "remote" / "step-000000000002")
    got = run_world(4, _restore_step1, root)
    assert all(r["step"] == 1 for r in got)


def _restore_step1(rank: int, world: int, root: str, tiers: Any = _tiers) -> dict[str, Any]:
    import warnings

    _node_env(rank)
    ck = Checkpointer(os.path.join(root, "job"), tiers=tiers(root))
    into = _target(rank, world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.load_latest(into=into)
    per = ROWS // world
    assert torch.equal(into["w"], _full(1)[rank * per : (rank + 1) * per]), rank
    got = dict(ck.restored or {})
    ck.close()
    return got


def test_scope_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="scope"):
        DiskTier("x", scope="rack")


# ----------------------------------------------------------------------------------------------
# peer replicas


def _tiers_r(root: str) -> list[Any]:
    return [
        HostTier("64MiB"),
        DiskTier("nvme-{node}", scope="node", replicas=1),
        RemoteTier(os.path.join(root, "remote")),
    ]


def _train_r(rank: int, world: int, root: str) -> list[str]:
    return _train(rank, world, root, _tiers_r)


def _restore_r(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _restore(rank, world, root, _tiers_r)
    got["warnings"] = [str(x.message) for x in w]
    return got


def _job_r(tmp_path: Path) -> str:
    root = str(tmp_path)
    assert run_world(4, _train_r, root) == [["durable-remote"] * 3] * 4
    return root


def test_each_nodes_part_is_replicated_on_its_peer(tmp_path: Path) -> None:
    _job_r(tmp_path)
    for node, others in (("n0", (2, 3)), ("n1", (0, 1))):
        d = tmp_path / "job" / f"nvme-{node}" / "step-000000000002"
        names = {p.name.split(".")[0] for p in d.glob("rank-*.pt")}
        assert {f"rank-{r:05d}" for r in others} <= names, (node, names)


def test_a_lost_node_restores_from_its_peer_with_the_remote_tier_gone(tmp_path: Path) -> None:
    root = _job_r(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n1")
    shutil.rmtree(tmp_path / "remote")  # the remote tier is unavailable
    got = run_world(4, _restore_r, root)
    for rank, r in enumerate(got):
        assert r["bytes_by_tier"].get("remote", 0) == 0, (rank, r)
        assert (r["bytes_from_peers"] > 0) == (rank >= 2), (rank, r)
    # The replaced node's copy is whole again: a second restart reads only locally, from no peer.
    got = run_world(4, _restore_r, root)
    assert all(r["bytes_from_peers"] == 0 and r["bytes_by_tier"].get("remote", 0) == 0 for r in got), got


def test_a_damaged_peer_replica_is_named_and_the_next_copy_used(tmp_path: Path) -> None:
    root = _job_r(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n1")
    d = tmp_path / "job" / "nvme-n0" / "step-000000000002"  # where n1's replicas are kept
    victim = next(d.glob("rank-00003.*.pt"))
    data = bytearray(victim.read_bytes())
    at = bytes(data).find(_full(2)[48:64].numpy().tobytes()[:64])
    assert at > 0
    data[at + 100] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = run_world(4, _restore_r, root)
    said = [m for m in got[3]["warnings"] if "rank-00003" in m]
    assert said and "checksum" in said[0], got[3]["warnings"]
    assert got[3]["bytes_by_tier"]["remote"] > 0 and got[2]["bytes_by_tier"].get("remote", 0) == 0


def test_replicas_need_node_scope() -> None:
    with pytest.raises(InvalidArgumentError, match="replicas"):
        DiskTier("x", replicas=1)


# ----------------------------------------------------------------------------------------------
# replicas in pieces, repair of the step actually restored, replicas on a farther tier


def _train_small_pieces(rank: int, world: int, root: str) -> list[str]:
    from tierstore import _ckpt_peers

    _ckpt_peers.PIECE = 3000  # every file moves in several pieces, the ranks' counts differ
    return _train_r(rank, world, root)


def test_replicas_move_in_pieces_bit_exact(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_world(4, _train_small_pieces, root) == [["durable-remote"] * 3] * 4
    for node, peer, others in (("n0", "n1", (2, 3)), ("n1", "n0", (0, 1))):
        d = tmp_path / "job" / f"nvme-{node}" / "step-000000000002"
        src = tmp_path / "job" / f"nvme-{peer}" / "step-000000000002"
        for r in others:
            for p in src.glob(f"*-{r:05d}.*"):
                assert p.stat().st_size > 3000 or p.name.startswith("objects"), p
                assert (d / p.name).read_bytes() == p.read_bytes(), (node, p.name)
        assert not [p.name for p in d.iterdir() if ".replica." in p.name]
    # And a lost node gets its files back in pieces too.
    shutil.rmtree(tmp_path / "job" / "nvme-n1")
    shutil.rmtree(tmp_path / "remote")
    got = run_world(4, _restore_small_pieces, root)
    assert [r["bytes_from_peers"] > 0 for r in got] == [False, False, True, True], got


def _restore_small_pieces(rank: int, world: int, root: str) -> dict[str, Any]:
    from tierstore import _ckpt_peers

    _ckpt_peers.PIECE = 3000
    return _restore_r(rank, world, root)


def test_rank_zeros_node_lost_with_the_remote_tier_gone(tmp_path: Path) -> None:
    """Rank 0's own node is the replaced one: the ranks still agree on the
    newest step (the candidates any rank sees), and n0 gets its part back."""
    root = _job_r(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n0")
    shutil.rmtree(tmp_path / "remote")
    got = run_world(4, _restore_r, root)
    for rank, r in enumerate(got):
        assert r["step"] == 2 and r["bytes_by_tier"].get("remote", 0) == 0, (rank, r)
        assert (r["bytes_from_peers"] > 0) == (rank < 2), (rank, r)


def test_an_older_step_is_repaired_when_the_newest_cannot_be_used(tmp_path: Path) -> None:
    """Node n1 is replaced and rank 0's file of step 2 is damaged with no
    other copy: the restore falls back to step 1, and n1 gets step 1's files
    from its peer before it is tried (not only the newest step's)."""
    root = _job_r(tmp_path)
    shutil.rmtree(tmp_path / "job" / "nvme-n1")
    shutil.rmtree(tmp_path / "remote")
    victim = next((tmp_path / "job" / "nvme-n0" / "step-000000000002").glob("rank-00000.*.pt"))
    data = bytearray(victim.read_bytes())
    at = bytes(data).find(_full(2)[0:16].numpy().tobytes()[:64])
    assert at > 0
    data[at + 100] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = run_world(4, _restore_step1_r, root)
    for rank, r in enumerate(got):
        assert r["step"] == 1 and r["bytes_by_tier"].get("remote", 0) == 0, (rank, r)
        assert (r["bytes_from_peers"] > 0) == (rank >= 2), (rank, r)
    assert (tmp_path / "job" / "nvme-n1" / "step-000000000001" / "manifest.json").is_file()


def _restore_step1_r(rank: int, world: int, root: str) -> dict[str, Any]:
    return _restore_step1(rank, world, root, _tiers_r)


def _tiers_far(root: str) -> list[Any]:
    return [
        HostTier("64MiB"),
        DiskTier("ram-{node}", scope="node", name="ram"),
        DiskTier("nvme-{node}", scope="node", replicas=1, name="nvme"),
        RemoteTier(os.path.join(root, "remote")),
    ]


def _train_far(rank: int, world: int, root: str) -> list[str]:
    return _train(rank, world, root, _tiers_far)


def _restore_far(rank: int, world: int, root: str) -> dict[str, Any]:
    return _restore(rank, world, root, _tiers_far)


def test_replicas_on_a_farther_node_tier(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_world(4, _train_far, root) == [["durable-remote"] * 3] * 4
    for node, others in (("n0", (2, 3)), ("n1", (0, 1))):
        names = {p.name.split(".")[0] for p in (tmp_path / "job" / f"nvme-{node}" / "step-000000000002").glob("rank-*")}
        assert {f"rank-{r:05d}" for r in others} <= names, (node, names)
        ram = {p.name.split(".")[0] for p in (tmp_path / "job" / f"ram-{node}" / "step-000000000002").glob("rank-*")}
        assert not {f"rank-{r:05d}" for r in others} & ram, (node, ram)  # no replicas asked there
    # n1 replaced (both its tiers empty), the remote tier gone: n1's part comes from n0's nvme copy.
    for d in ("ram-n1", "nvme-n1"):
        shutil.rmtree(tmp_path / "job" / d)
    shutil.rmtree(tmp_path / "remote")
    got = run_world(4, _restore_far, root)
    for rank, r in enumerate(got):
        assert r["bytes_by_tier"].get("remote", 0) == 0, (rank, r)
        assert (r["bytes_from_peers"] > 0) == (rank >= 2), (rank, r)


def _train_big(rank: int, world: int, root: str) -> tuple[int, int]:
    """8 MiB per rank, replicas in pieces of 1 MiB: the Python memory
    traced while the replicas move (the exchange's buffers are Python
    bytearrays; torch's tensors are not traced) stays a few pieces."""
    import tracemalloc

    from tierstore import _ckpt_peers

    _ckpt_peers.PIECE = 1 << 20
    reads: list[int] = []
    real = _ckpt_peers._core

    class Core:  # the real engine binding, the lengths of the exchange's reads recorded
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def transfer_ranges(self, *a: Any, **k: Any) -> int:
            reads.extend(a[3])
            return int(real.transfer_ranges(*a, **k))

    _ckpt_peers._core = Core()  # type: ignore[assignment]
    _node_env(rank)
    ck = Checkpointer(os.path.join(root, "job"), tiers=_tiers_r(root))
    big = torch.arange(2 << 20, dtype=torch.float32) + rank
    lay = Layout.block("big", (4 * big.numel(),), (rank * big.numel(),), (big.numel(),))
    tracemalloc.start()
    ck.save(1, {"big": attach(big, lay)})
    ck.wait()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ck.close()
    return peak, big.numel() * 4, max(reads), sum(reads)


def test_replicas_never_hold_a_whole_file_in_memory(tmp_path: Path) -> None:
    got = run_world(4, _train_big, str(tmp_path))
    for rank, (peak, nbytes, most, total) in enumerate(got):
        assert peak < nbytes // 2, (rank, peak, nbytes)
        assert most <= 1 << 20 and total > nbytes, (rank, most, total)  # its file read in pieces, all of it
    d = tmp_path / "job" / "nvme-n0" / "step-000000000001"
    assert {p.name.split(".")[0] for p in d.glob("rank-*")} == {f"rank-{r:05d}" for r in range(4)}


# ----------------------------------------------------------------------------------------------
# host-memory copies and peer replicas (HostTier(shm=..., replicas=k))


def _tiers_shm(root: str) -> list[Any]:
    return [
        HostTier("64MiB", shm=os.path.join(root, "shm-{node}"), replicas=1),  # a RAM folder per simulated node
        DiskTier("nvme-{node}", scope="node"),
        RemoteTier(os.path.join(root, "remote")),
    ]


def _train_shm(rank: int, world: int, root: str, clean: bool = False) -> list[str]:
    return _train(rank, world, root, _tiers_shm, clean)  # not clean: the processes die, the copies stay


def _restore_shm(rank: int, world: int, root: str) -> dict[str, Any]:
    return _restore(rank, world, root, _tiers_shm)


def test_host_copies_in_shared_memory_restore_without_disk_reads(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_world(4, _train_shm, root) == [["durable-remote"] * 3] * 4
    for node, own, others in (("n0", (0, 1), (2, 3)), ("n1", (2, 3), (0, 1))):
        d = tmp_path / f"shm-{node}" / "step-000000000002"
        names = {p.name.split(".")[0] for p in d.glob("rank-*")}
        assert names == {f"rank-{r:05d}" for r in (*own, *others)}, (node, names)  # its own part and its peer's
        assert not (tmp_path / f"shm-{node}" / "step-000000000001").exists()  # keep_last=1 there
    got = run_world(4, _restore_shm, root)
    for rank, r in enumerate(got):
        assert r["tier"] == "host-shm", (rank, r)
        by = r["bytes_by_tier"]
        assert by["host-shm"] > 0 and by.get("nvme", 0) == 0 and by.get("remote", 0) == 0, (rank, r)
    # Node n1 replaced: its ranks' part comes back from n0's memory; no disk is read.
    shutil.rmtree(tmp_path / "shm-n1")
    got = run_world(4, _restore_shm, root)
    for rank, r in enumerate(got):
        assert r["tier"] == "host-shm" and set(r["bytes_by_tier"]) == {"host-shm"}, (rank, r)
        assert (r["bytes_from_peers"] > 0) == (rank >= 2), (rank, r)


def test_a_clean_close_frees_the_shared_memory_copies(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_world(4, _train_shm, root, True) == [["durable-remote"] * 3] * 4
    assert not (tmp_path / "shm-n0").exists() and not (tmp_path / "shm-n1").exists()
    got = run_world(4, _restore_shm, root)  # the disk copies are whole
    assert all(r["tier"] == "local" for r in got), got


def test_host_shm_default_folder_single_process(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "job", tiers=[HostTier("16MiB", shm=True), DiskTier("local")])
    shm = ck.cascade.tier_paths(ck.disks[0])[0]
    try:
        assert str(shm).startswith(f"/dev/shm/tierstore-{os.getuid()}-") and ck.disks[0].name == "host-shm"
        ck.save(1, {"w": _full(1)})
        ck.wait()
        assert (shm / "step-000000000001" / "manifest.json").is_file()
        ck.close()
        assert not shm.exists() and not shm.parent.exists()  # freed: the local tier holds step 1
        ck2 = Checkpointer(tmp_path / "job", tiers=[HostTier("16MiB", shm=True), DiskTier("local")])
        got = ck2.load_latest()
        assert torch.equal(got["w"], _full(1)) and ck2.restored is not None and ck2.restored["tier"] == "local"
        ck2.close()
    finally:
        shutil.rmtree(shm.parent, ignore_errors=True)


def test_host_replicas_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="replicas"):
        HostTier(replicas=-1)
    assert HostTier(replicas=2).shm is True
    with pytest.raises(InvalidArgumentError, match="differ"):
        Checkpointer("/tmp/unused-ts-job", tiers=[HostTier(shm=True), DiskTier("x", name="host-shm")])


# ----------------------------------------------------------------------------------------------
# resharding restores read other nodes' files from those nodes


def _restore_cols(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks, one per node (n0, n1), each restoring a column half: every
    old rank's file holds rows of both halves, so each node needs the other
    node's files too."""
    import warnings

    os.environ["TIERSTORE_NODE"] = f"n{rank}"
    ck = Checkpointer(os.path.join(root, "job"), tiers=_tiers(root))
    half = COLS // 2
    lay = Layout.block("w", (ROWS, COLS), (0, rank * half), (ROWS, half))
    into = {"w": attach(torch.full((ROWS, half), float("nan")), lay), "step": None}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck.load_latest(into=into)
    assert torch.equal(into["w"], _full(2)[:, rank * half : (rank + 1) * half]), rank
    assert into["step"] == 2
    got = dict(ck.restored or {})
    got["warnings"] = [str(x.message) for x in w]
    ck.close()
    return got


def test_a_resharding_restore_reads_other_nodes_files_from_them(tmp_path: Path) -> None:
    root = _job(tmp_path)  # 4 ranks as 2 nodes, no replicas
    shutil.rmtree(tmp_path / "remote")  # the remote tier is gone: only the nodes' copies are left
    got = run_world(2, _restore_cols, root)
    for rank, r in enumerate(got):
        assert r["step"] == 2 and r["tier"] == "local" and r["bytes_from_peers"] > 0, (rank, r)
        assert set(r["bytes_by_tier"]) == {"local"}, (rank, r)
    # Each node's copy now holds the other node's files it read; a second restore moves nothing.
    for node, other in (("n0", (2, 3)), ("n1", (0, 1))):
        names = {p.name.split(".")[0] for p in (tmp_path / "job" / f"nvme-{node}" / "step-000000000002").glob("rank-*")}
        assert {f"rank-{r:05d}" for r in other} <= names, (node, names)
    got = run_world(2, _restore_cols, root)
    assert all(r["bytes_from_peers"] == 0 for r in got), got


def _restore_rows_new_node(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 ranks on 3 nodes: n0 (ranks 0, 1) as before, n1 (rank 2) and a new
    node n2 (rank 3) with no copy at all: n2 gets the commit, then rank 3's
    rows from n1."""
    os.environ["TIERSTORE_NODE"] = ["n0", "n0", "n1", "n2"][rank]
    ck = Checkpointer(os.path.join(root, "job"), tiers=_tiers(root))
    into = _target(rank, world)
    ck.load_latest(into=into)
    per = ROWS // world
    assert torch.equal(into["w"], _full(2)[rank * per : (rank + 1) * per]), rank
    got = dict(ck.restored or {})
    ck.close()
    return got


def test_a_new_node_gets_the_commit_and_its_files_from_peers(tmp_path: Path) -> None:
    root = _job(tmp_path)
    shutil.rmtree(tmp_path / "remote")
    got = run_world(4, _restore_rows_new_node, root)
    assert [r["bytes_from_peers"] > 0 for r in got] == [False, False, False, True], got
    assert all(r["bytes_by_tier"].get("remote", 0) == 0 for r in got), got
    d = tmp_path / "job" / "nvme-n2" / "step-000000000002"
    assert (d / "manifest.json").is_file() and len(list(d.glob("rank-00003.*"))) == 1
    assert not list(d.glob("rank-00002.*"))  # only what its rank needs


# ----------------------------------------------------------------------------------------------
# a stale or foreign copy of a step on one node


def _train_other_job(rank: int, world: int, root: str) -> None:
    """Another save of the same steps (other values), as a foreign job or an
    earlier run from scratch would have left on a node's disk."""
    _node_env(rank)
    ck = Checkpointer(os.path.join(root, "job"), tiers=_tiers_r(root))
    for step in range(3):
        st = _state(rank, world, step)
        st["w"] = attach(st["w"] + 0.5, layout_of_w(rank, world))
        ck.save(step, st)
        ck.wait_capture()
    ck.wait()
    ck.close()


def layout_of_w(rank: int, world: int) -> Layout:
    per = ROWS // world
    return Layout.block("w", (ROWS, COLS), (rank * per, 0), (per, COLS))


@pytest.mark.parametrize(("remote", "node"), [(True, 1), (False, 1), (False, 0)])
def test_a_stale_copy_on_one_node_is_never_mixed_in(tmp_path: Path, remote: bool, node: int) -> None:
    """One node's copy of step 2 is an earlier save's (same step, other
    values: the node missed this run's save and kept an older run's): its
    ranks must restore this job's bytes, from the remote tier where it is
    there, else from the peer that keeps their replicas (the node gets the
    agreed save's commit first); never the stale values. Two nodes disagree
    two ranks to two: the newer save wins, whichever node rank 0 is on."""
    other = tmp_path / "other"
    other.mkdir()
    run_world(4, _train_other_job, str(other))  # first: the older save
    root = _job_r(tmp_path)
    step2 = "step-000000000002"
    shutil.rmtree(tmp_path / "job" / f"nvme-n{node}" / step2)
    shutil.copytree(other / "job" / f"nvme-n{node}" / step2, tmp_path / "job" / f"nvme-n{node}" / step2)
    if not remote:
        shutil.rmtree(tmp_path / "remote")
    got = run_world(4, _restore_r, root)  # asserts this job's values of step 2 on every rank
    for rank, r in enumerate(got):
        assert r["step"] == 2, (rank, r)
        if rank // 2 == node:
            assert (r["bytes_by_tier"].get("remote", 0) > 0) == remote, (rank, r)
            assert (r["bytes_from_peers"] > 0) == (not remote), (rank, r)


def _train_keep1(rank: int, world: int, root: str, steps: tuple[int, ...]) -> None:
    _node_env(rank)
    tiers = [HostTier("64MiB"), DiskTier("nvme-{node}", scope="node", keep_last=1), RemoteTier(os.path.join(root, "r"))]
    ck = Checkpointer(os.path.join(root, "job"), tiers=tiers)
    for step in steps:
        ck.save(step, _state(rank, world, step))
        ck.wait_capture()
    ck.wait()
    ck.close()


def test_retention_keeps_the_step_just_written_over_newer_stale_ones(tmp_path: Path) -> None:
    """A node's copy holds step 9 of an earlier run; this run writes step 3
    with keep_last=1: retention must keep step 3 (the job's newest), not
    only the stale step 9."""
    root = str(tmp_path)
    run_world(4, _train_keep1, root, (9,))
    shutil.rmtree(tmp_path / "job" / "nvme-n0" / "step-000000000009")  # n0 took part in the new run only...
    shutil.rmtree(tmp_path / "r")
    run_world(4, _train_keep1, root, (3,))  # ...while n1 still holds the old run's step 9
    for node in ("n0", "n1"):
        assert (tmp_path / "job" / f"nvme-{node}" / "step-000000000003" / "manifest.json").is_file(), node
