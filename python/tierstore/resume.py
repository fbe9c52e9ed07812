"""Resuming exactly: the training state beyond tensors.

A job resumes bit-exactly only when, besides the model, the optimizer and
the step, it restores its random number generators (torch's CPU and CUDA
generators, numpy's and Python's global ones, and any generator it holds),
the order and position of its data, and its schedulers. :class:`RunState`
captures all of it per rank and restores it::

    sampler = tierstore.ResumableSampler(len(dataset), shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    run = tierstore.RunState(sampler=sampler, scheduler=scheduler)
    ...
    ckpt.save(step, {"model": ..., "optim": ..., "run": run.state_dict()})
    ...
    state = ckpt.load_latest()
    run.load_state_dict(state["run"])   # RNGs, sampler position, scheduler

Each named object is anything with ``state_dict()`` / ``load_state_dict()``
(a scheduler, a ``GradScaler``, torchdata's ``StatefulDataLoader``, a
:class:`ResumableSampler`), a ``torch.Generator`` or a
``numpy.random.Generator``.

Under ``torch.distributed`` (more than one rank) :meth:`RunState.state_dict`
wraps its value in :class:`~tierstore.PerRank`, so that ``save_sharded`` and
the ``Checkpointer`` keep every rank's own; with ``tierstore.save`` each rank
writes its own file anyway: pass ``per_rank=False``. Everything is stored as
tensors and plain values, so ``weights_only=True`` loads it.

When the world size changes, a bit-exact resume is impossible (the ranks'
streams cannot be split or merged); load with ``per_rank_policy="rank0"``
and choose with ``on_world_change``: ``"error"`` (the default: raise),
``"rank0"`` (every rank takes rank 0's state, generators included, so ranks
draw the same numbers) or ``"reseed"`` (the named objects from rank 0's
state; every generator seeded from rank 0's state and the new rank, so the
streams are deterministic and differ per rank).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from tierstore._dist import group_info
from tierstore.errors import InvalidArgumentError, InvalidArgumentTypeError, TierstoreError
from tierstore.sharded import PerRank

__all__ = ["ResumableSampler", "RunState"]

_FORMAT = "tierstore-run/1"
WORLD_CHANGE = ("error", "rank0", "reseed")


def _rank_world() -> tuple[int, int]:
    rank, world, _pg = group_info(None)
    return rank, world


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(gauss),
    }


def _set_numpy_state(s: Mapping[str, Any]) -> None:
    keys = s["keys"].numpy().astype(np.uint32)
    np.random.set_state((s["bit_generator"], keys, int(s["pos"]), int(s["has_gauss"]), float(s["cached_gaussian"])))


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss}


def _set_python_state(s: Mapping[str, Any]) -> None:
    random.setstate((int(s["version"]), tuple(int(x) for x in s["state"].tolist()), s["gauss_next"]))


def _cuda_states() -> list[torch.Tensor] | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return [t.clone() for t in torch.cuda.get_rng_state_all()]


def _capture(obj: Any) -> dict[str, Any]:
    if isinstance(obj, torch.Generator):
        return {"kind": "torch.Generator", "state": obj.get_state()}
    if isinstance(obj, np.random.Generator):
        return {"kind": "numpy.Generator", "state": obj.bit_generator.state}
    return {"kind": "state_dict", "state": obj.state_dict()}


def _restore(obj: Any, saved: Mapping[str, Any], name: str) -> None:
    kind = saved.get("kind")
    want = _capture_kind(obj)
    if kind != want:
        raise TierstoreError(f"RunState: {name!r} was saved as a {kind}, but is now a {want}")
    if kind == "torch.Generator":
        obj.set_state(saved["state"])
    elif kind == "numpy.Generator":
        obj.bit_generator.state = saved["state"]
    else:
        obj.load_state_dict(saved["state"])


def _capture_kind(obj: Any) -> str:
    if isinstance(obj, torch.Generator):
        return "torch.Generator"
    if isinstance(obj, np.random.Generator):
        return "numpy.Generator"
    return "state_dict"


def _seed_from(saved: Mapping[str, Any], rank: int, what: str) -> int:
    """A 63-bit seed derived from rank 0's saved generator state, the new
    rank and the generator's name (distinct streams, reproducible)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(what.encode())
    h.update(rank.to_bytes(8, "little"))
    g = saved.get("torch_cpu")
    if isinstance(g, torch.Tensor):
        h.update(g.numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


class RunState:
    """The training state beyond tensors, per rank: global RNGs (``rng=True``:
    torch CPU, CUDA where it is in use, numpy, Python) and the named objects
    (see the module documentation)."""

    def __init__(self, *, rng: bool = True, on_world_change: str = "error", **objects: Any) -> None:
        if on_world_change not in WORLD_CHANGE:
            raise InvalidArgumentError(f"on_world_change must be one of {WORLD_CHANGE}, not {on_world_change!r}")
        for name, obj in objects.items():
            if _capture_kind(obj) == "state_dict" and not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            ):
                raise InvalidArgumentTypeError(
                    f"RunState: {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict() and is not a "
                    "torch.Generator or numpy.random.Generator"
                )
        self.rng = rng
        self.on_world_change = on_world_change
        self.objects = dict(objects)

    def state_dict(self, *, per_rank: bool | None = None) -> Any:
        """This rank's state (a copy). ``per_rank``: wrap it in
        :class:`~tierstore.PerRank` (default: when more than one rank runs)."""
        rank, world = _rank_world()
        out: dict[str, Any] = {"format": _FORMAT, "rank": rank, "world_size": world}
        if self.rng:
            out["rng"] = {
                "torch_cpu": torch.get_rng_state(),
                "cuda": _cuda_states(),
                "numpy": _numpy_state(),
                "python": _python_state(),
            }
        out["objects"] = {name: _capture(obj) for name, obj in self.objects.items()}
        if per_rank if per_rank is not None else world > 1:
            return PerRank(out)
        return out

    def load_state_dict(self, state: Any, *, on_world_change: str | None = None) -> None:
        """Restores what :meth:`state_dict` captured (a :class:`~tierstore.PerRank`
        or its value). On a world-size change, follows ``on_world_change``
        (default: the one given at construction)."""
        policy = on_world_change or self.on_world_change
        if policy not in WORLD_CHANGE:
            raise InvalidArgumentError(f"on_world_change must be one of {WORLD_CHANGE}, not {policy!r}")
        if isinstance(state, PerRank):
            state = state.value
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise TierstoreError(f"RunState: not a saved run state ({type(state).__name__})")
        rank, world = _rank_world()
        saved_world, saved_rank = int(state["world_size"]), int(state["rank"])
        reseed = False
        if saved_world != world or saved_rank != rank:
            if policy == "error":
                raise TierstoreError(
                    f"RunState: saved by rank {saved_rank} of {saved_world}, restored on rank {rank} of {world}: a "
                    "bit-exact resume needs the same world; pass on_world_change='rank0' (every rank takes rank 0's "
                    "state) or 'reseed' (rank 0's objects, generators seeded per rank), and per_rank_policy='rank0' "
                    "to the load"
                )
            reseed = policy == "reseed"
        missing = sorted(set(self.objects) - set(state.get("objects", {})))
        if missing:
            raise TierstoreError(f"RunState: the saved state has no {', '.join(map(repr, missing))}")
        for name, obj in self.objects.items():
            saved = state["objects"][name]
            if reseed and saved.get("kind") in ("torch.Generator", "numpy.Generator"):
                seed = _seed_from(state.get("rng", {}), rank, name)
                if isinstance(obj, torch.Generator):
                    obj.manual_seed(seed)
                else:
                    obj.bit_generator.state = type(obj.bit_generator)(seed).state
                continue
            _restore(obj, saved, name)
        if self.rng and "rng" in state:
            r = state["rng"]
            if reseed:
                torch.manual_seed(_seed_from(r, rank, "torch"))  # CPU and every CUDA device
                np.random.seed(_seed_from(r, rank, "numpy") % (1 << 32))
                random.seed(_seed_from(r, rank, "python"))
                return
            torch.set_rng_state(r["torch_cpu"])
            if r.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(r["cuda"])
            _set_numpy_state(r["numpy"])
            _set_python_state(r["python"])


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A shuffling (or sequential) sampler, optionally split over ranks like
    ``DistributedSampler``, whose ``state_dict`` records the epoch and the
    position in it, so that a resumed job continues with the next sample of
    the same order.

    The order of an epoch is a pure function of ``seed`` and the epoch
    (``torch.randperm`` with its own generator; the global RNG is not
    touched). ``position`` counts the indices handed out in this epoch: with
    ``num_workers=0`` a ``DataLoader`` draws exactly the batches the loop
    consumed; with workers it draws ahead (up to ``prefetch_factor *
    num_workers`` batches), so save ``state_dict(consumed=samples)`` with the
    samples the loop has consumed this epoch. A new epoch starts
    automatically after the last index (or call :meth:`set_epoch`).
    """

    def __init__(
        self,
        n: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world is None:
            r, w = _rank_world()
            rank = r if rank is None else rank
            world = w if world is None else world
        if not 0 <= rank < world:
            raise InvalidArgumentError(f"rank {rank} is not in a world of {world}")
        self.n, self.shuffle, self.seed = int(n), shuffle, int(seed)
        self.rank, self.world, self.drop_last = rank, world, drop_last
        self.epoch = 0
        self.position = 0
        self._start = 0

    def __len__(self) -> int:
        return self.n // self.world if self.drop_last else math.ceil(self.n / self.world)

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        total = len(self) * self.world
        if total > len(idx):
            idx += (idx * math.ceil(total / max(1, len(idx))))[: total - len(idx)]  # pad as DistributedSampler
        return idx[:total][self.rank :: self.world]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        start, self._start = self._start, 0
        self.position = start
        for i in order[start:]:
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._start = int(epoch), 0, 0

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        return {
            "n": self.n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position if consumed is None else int(consumed),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if int(sd["n"]) != self.n or int(sd["seed"]) != self.seed or bool(sd["shuffle"]) != self.shuffle:
            raise TierstoreError(
                f"ResumableSampler: saved for {sd['n']} samples (seed {sd['seed']}, shuffle {sd['shuffle']}), "
                f"now {self.n} (seed {self.seed}, shuffle {self.shuffle}): the order would differ"
            )
        self.epoch = int(sd["epoch"])
        self.position = self._start = int(sd["position"])
