"""The naive optimizer offload a user would write, as bench_offload.py's baseline.

It uses the host budget the way the obvious implementation would: the first
subgroups whose fp32 masters and AdamW state fit stay in host memory for good
(the budget less one working buffer), and every other subgroup is, in turn,
read from its file into the one working buffer, stepped, and written back,
synchronously, one after the other, in the same order every step. Nothing is
overlapped, nothing is checksummed, the masters are stored whole (12 bytes per
parameter). So it moves the bytes any offload using its budget would move,
and what tierstore's offload saves beyond it is its own (the overlap of reads,
update and writes; the split masters), not the budget's.

To isolate exactly that, it moves its bytes the way tierstore's offload does:
subgroups formed by the same rule (tensors added while master + state stay
within ``subgroup_bytes``), the same engine's O_DIRECT transfers of a whole
subgroup, from host buffers on transparent huge pages (tierstore's
``host_buffer``), and the update is the same (torch's fused AdamW per
subgroup, the bf16 gradient converted to fp32 in a reused buffer, the fp32
master copied into the bf16 parameter), so the fp32 masters it ends with are
bit for bit those of every other mode (bench_offload.py checks).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

import tierstore
from tierstore import _core
from tierstore._engine import host_buffer

_PAGE = 4096
_ALIGN = 64  # tensor offsets inside a subgroup's buffer


class NaiveOffload:
    """AdamW over ``params`` with master + state in ``budget`` bytes of host memory and files under ``path``."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        budget: int,
        subgroup_bytes: int,
        path: str | Path,
        lr: float,
        weight_decay: float,
    ) -> None:
        self.params = params
        self.engine = tierstore.get_engine()
        self.dir = Path(tempfile.mkdtemp(prefix="naive-", dir=path))
        self.stats = {"read_bytes": 0, "write_bytes": 0}
        # Subgroups as tierstore's offload forms them.
        groups: list[list[int]] = []
        cur: list[int] = []
        size = 0
        for i, p in enumerate(params):
            need = 12 * p.numel()
            if cur and size + need > subgroup_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += need
        if cur:
            groups.append(cur)
        self.groups = groups
        # Layout of a subgroup's buffer: per parameter its master, exp_avg, exp_avg_sq (fp32).
        self.layouts: list[list[tuple[int, int, int, int]]] = []  # (param, master, exp_avg, exp_avg_sq offsets)
        self.sizes: list[int] = []
        for g in groups:
            off = 0
            lay = []
            for i in g:
                n = 4 * params[i].numel()
                offs = []
                for _ in range(3):
                    off = -(-off // _ALIGN) * _ALIGN
                    offs.append(off)
                    off += n
                lay.append((i, *offs))
            self.layouts.append(lay)
            self.sizes.append(-(-off // _PAGE) * _PAGE)
        # The first K subgroups that fit beside one working buffer for the rest.
        k = 0
        while k < len(groups) and sum(self.sizes[: k + 1]) + max(self.sizes[k + 1 :], default=0) <= budget:
            k += 1
        self.resident = k
        self.buffers: list[torch.Tensor | None] = [host_buffer(self.sizes[j]) for j in range(k)]
        self.buffers += [None] * (len(groups) - k)
        self.work = host_buffer(max(self.sizes[k:])) if k < len(groups) else None
        self.files = [self.dir / f"sg-{j:06d}.bin" for j in range(len(groups))]
        self.masters = [torch.empty(0) for _ in params]
        self.inner: list[torch.optim.Optimizer] = []
        self._scratch = torch.empty(max(sum(params[i].numel() for i in g) for g in groups), dtype=torch.float32)
        for j, g in enumerate(groups):
            buf = self._buffer(j)
            buf.zero_()  # Adam's state starts at zero, as torch creates it
            for i, mo, _, _ in self.layouts[j]:
                self._view(buf, mo, params[i]).copy_(params[i].detach())
                self.masters[i] = torch.nn.Parameter(self._view(buf, mo, params[i]))
            opt = torch.optim.AdamW([self.masters[i] for i in g], lr=lr, weight_decay=weight_decay, fused=True)
            for i in g:
                # The state AdamW would create in its first step (zeros, a float32 step count), allocated
                # up front in the subgroup's buffer.
                opt.state[self.masters[i]] = {"step": torch.zeros((), dtype=torch.float32)}
            self.inner.append(opt)
            self._point(j, buf)
            if j >= k:
                self._write(j, buf)

    # ---------------------------------------------------------------------------------------------

    @staticmethod
    def _view(buf: torch.Tensor, off: int, like: torch.Tensor) -> torch.Tensor:
        return buf[off : off + 4 * like.numel()].view(torch.float32).view(like.shape)

    def _buffer(self, j: int) -> torch.Tensor:
        buf = self.buffers[j]
        if buf is None:
            assert self.work is not None
            return self.work[: self.sizes[j]]
        return buf

    def _point(self, j: int, buf: torch.Tensor) -> None:
        """Masters and state of subgroup ``j`` as views of ``buf``."""
        opt = self.inner[j]
        for i, mo, ea, eas in self.layouts[j]:
            p = self.params[i]
            m = self.masters[i]
            m.data = self._view(buf, mo, p)
            opt.state[m]["exp_avg"] = self._view(buf, ea, p)
            opt.state[m]["exp_avg_sq"] = self._view(buf, eas, p)

    def _read(self, j: int, buf: torch.Tensor) -> None:
        n = self.sizes[j]
        _core.transfer_ranges(self.engine, self.files[j], [0], [n], [buf.data_ptr()], direct=True)
        self.stats["read_bytes"] += n

    def _write(self, j: int, buf: torch.Tensor) -> None:
        n = self.sizes[j]
        _core.transfer_ranges(self.engine, self.files[j], [0], [n], [buf.data_ptr()], write=True, size=n, direct=True)
        self.stats["write_bytes"] += n

    # ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        for j, g in enumerate(self.groups):
            streamed = j >= self.resident
            buf = self._buffer(j)
            if streamed:
                self._read(j, buf)
                self._point(j, buf)
            off = 0
            for i in g:
                grad = self.params[i].grad
                assert grad is not None
                view = self._scratch[off : off + grad.numel()].view(grad.shape)
                view.copy_(grad)
                self.masters[i].grad = view
                off += grad.numel()
            self.inner[j].step()
            for i in g:
                self.masters[i].grad = None
                self.params[i].copy_(self.masters[i])
            if streamed:
                self._write(j, buf)

    def wait_io(self) -> None:
        """Nothing is in flight after a step (for the same calling code as tierstore's offload)."""

    def host_bytes(self) -> int:
        """Host memory held for state: the resident subgroups and the working buffer."""
        return sum(self.sizes[: self.resident]) + (self.work.numel() if self.work is not None else 0)

    def placement(self) -> dict[str, int]:
        return {"host": sum(self.sizes[: self.resident]), str(self.dir): sum(self.sizes[self.resident :])}

    def master_params(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for j in range(len(self.groups)):
            buf = self._buffer(j)
            if j >= self.resident:
                n = self.sizes[j]
                _core.transfer_ranges(self.engine, self.files[j], [0], [n], [buf.data_ptr()], direct=True)
            for i, mo, _, _ in self.layouts[j]:
                out[i] = self._view(buf, mo, self.params[i]).clone()
        return [t for t in out if t is not None]

    def describe(self) -> dict[str, Any]:
        return {
            "subgroups": len(self.groups),
            "resident_subgroups": self.resident,
            "resident_bytes": sum(self.sizes[: self.resident]),
            "working_buffer_bytes": self.work.numel() if self.work is not None else 0,
            "streamed_bytes": sum(self.sizes[self.resident :]),
        }

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.buffers = []
        self.work = None
