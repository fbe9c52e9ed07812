"""tierstore: a storage engine for AI training state.

``tierstore.save`` and ``tierstore.load`` are drop-in replacements for
``torch.save`` and ``torch.load`` that write and read at the disk's speed
through a Rust engine (io_uring, O_DIRECT, many requests in flight), make
every save atomic and durable, and verify a CRC-32 of every record on load.
Files are ordinary torch zip archives: ``torch.load`` opens them, and
``tierstore.load`` opens files written by ``torch.save``.
"""

from __future__ import annotations

from tierstore import errors
from tierstore._core import __version__
from tierstore._engine import configure, get_engine
from tierstore._info import info
from tierstore._tier_steps import delete_checkpoint
from tierstore.api import load, save
from tierstore.checkpointer import Checkpointer, CheckpointHandle
from tierstore.codec import Delta
from tierstore.devices import DeviceShare, take_turns
from tierstore.errors import *  # noqa: F403  (every error class, also at the top level: errors.__all__)
from tierstore.layout import Layout, attach, layout_of
from tierstore.offload import OffloadedOptimizer, offload
from tierstore.resume import ResumableSampler, RunState
from tierstore.sharded import (
    PerRank,
    load_optimizer_state_dict,
    load_sharded,
    optimizer_state_dict,
    save_sharded,
)
from tierstore.tiers import DiskTier, HostTier, RemoteTier

__all__ = [
    "CheckpointHandle",
    "Checkpointer",
    "Delta",
    "DeviceShare",
    "DiskTier",
    "HostTier",
    "Layout",
    "OffloadedOptimizer",
    "PerRank",
    "RemoteTier",
    "ResumableSampler",
    "RunState",
    "__version__",
    "attach",
    "configure",
    "delete_checkpoint",
    "get_engine",
    "info",
    "layout_of",
    "load",
    "load_optimizer_state_dict",
    "load_sharded",
    "offload",
    "optimizer_state_dict",
    "save",
    "save_sharded",
    "take_turns",
]
__all__ += errors.__all__
