"""A subgroup of an offloaded optimizer: the parameters updated together,
whose fp32 masters and optimizer state live in one flat, page-padded buffer
(resident in host memory, or in a file on one of the disk paths).

Its lifecycle: *on disk* (``buf`` None, ``file`` set) → *reading* (``reading``
a future) → *resident* (``buf`` set; ``dirty`` once the step changed it) →
*writing back* (``writing`` a future; ``wanted`` keeps it resident after the
write) → on disk again. A file linked by a checkpoint (``pinned``) is never
rewritten in place: the next write-back goes to a new ``generation``.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from tierstore._offload_io import StoragePath

# layout entry: (index of the parameter in the subgroup, state key or None for
# the master, byte offset, byte length, dtype, shape)
Entry = tuple[int, str | None, int, int, torch.dtype, tuple[int, ...]]


class Subgroup:
    def __init__(self, index: int, group: int, params: list[torch.Tensor], first: int) -> None:
        self.index = index
        self.group = group
        self.params = params
        self.first = first  # index of its first parameter among all parameters
        self.masters: list[torch.Tensor] = []
        self.inner: torch.optim.Optimizer | None = None
        self.buf: torch.Tensor | None = None  # resident flat bytes
        self.layout: list[Entry] = []
        self.nbytes = 0
        self.path: StoragePath | None = None
        self.file: Path | None = None
        self.home: StoragePath | None = None  # where it is written back (counted in that path's `stored`)
        self.home_bytes = 0
        self.crc = 0
        self.dirty = True  # resident and changed since its file was written
        self.reading: Future[None] | None = None
        self.writing: Future[None] | None = None
        self.pinned = False  # its file is linked by a checkpoint: rewrite elsewhere
        self.wanted = False  # stays resident after its write-back in flight
        self.generation = 0
        self.numel = sum(p.numel() for p in params)
        # Split masters: the layout's master entries hold only the low 16 bits
        # of each fp32 master; the high 16 bits are the bf16 parameter itself.
        self.split = False

    @property
    def resident(self) -> bool:
        return self.buf is not None
