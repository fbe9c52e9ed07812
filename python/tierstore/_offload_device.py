"""The GPU side of an offloaded optimizer's update.

A subgroup whose parameters live on one GPU is updated on the host: its bf16
parameters (the high halves of split masters) and its gradients come down in
one batch of DMA copies into page-locked memory, on the copy stream of
:mod:`tierstore.gpu` (the shim's, else torch's) ordered after the backward;
its new parameters go up the same way from page-locked memory, and the
training stream waits for them on the device, not this thread. Nothing goes
through pageable memory, and the next subgroup's update runs on the host
while the previous one's parameters are still on their way up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierstore import gpu

ALIGN = 256


def _offsets(ts: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offs, at = [], 0
    for t in ts:
        at = -(-at // ALIGN) * ALIGN
        offs.append(at)
        at += t.numel() * t.element_size()
    return offs, at


def dense_on_one_gpu(params: Sequence[torch.Tensor]) -> torch.device | None:
    """The GPU holding every parameter, dense, or None (the host path then)."""
    dev = None
    for p in params:
        if not p.is_cuda or not p.is_contiguous():
            return None
        if dev is None:
            dev = p.device
        elif p.device != dev:
            return None
    return dev


class DeviceTransfers:
    """Pinned buffers and copies for the subgroups of one offloaded optimizer."""

    def __init__(self) -> None:
        self.down: gpu.PinnedBuffer | None = None
        self.up: list[gpu.PinnedBuffer | None] = [None, None]  # two: one fills while the other is copied up
        self.up_done: list[gpu.Event | None] = [None, None]
        self.turn = 0

    @staticmethod
    def _fits(buf: gpu.PinnedBuffer | None, n: int) -> gpu.PinnedBuffer:
        if buf is not None and buf.nbytes >= n:
            return buf
        return gpu.PinnedBuffer(max(n, 1 << 20))

    def fetch(
        self, dev: torch.device, params: Sequence[torch.Tensor], with_params: bool
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor | None]]:
        """Host copies of the parameters (when ``with_params``) and of their
        gradients (None where a parameter has none), in pinned memory, once
        the backward that produced them is done."""
        grads = [p.grad for p in params]
        items = [g for g in grads if g is not None and g.is_cuda and g.is_contiguous() and not g.is_sparse]
        src = (list(params) if with_params else []) + items
        offs, total = _offsets(src)
        self.down = self._fits(self.down, total)
        c = gpu.copier(dev)
        c.after_current()
        views = []
        for t, o in zip(src, offs, strict=True):
            n = t.numel() * t.element_size()
            c.d2h(self.down.addr + o, t.data_ptr(), n)
            views.append(self.down.view(o, n).view(t.dtype).view(t.shape))
        c.record().wait()
        his = views[: len(params)] if with_params else None
        it = iter(views[len(params) if with_params else 0 :])
        host_grads: list[torch.Tensor | None] = []
        for g in grads:
            if g is not None and g.is_cuda and g.is_contiguous() and not g.is_sparse:
                host_grads.append(next(it))
            else:
                host_grads.append(g)
        return his, host_grads

    def staging(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host tensors shaped as ``params`` to write their new values
        into (the buffer the last-but-one :meth:`push` used, once its copies
        are done)."""
        offs, total = _offsets(params)
        k = self.turn
        ev = self.up_done[k]
        if ev is not None:
            ev.wait()
            self.up_done[k] = None
        buf = self.up[k] = self._fits(self.up[k], total)
        return [
            buf.view(o, p.numel() * p.element_size()).view(p.dtype).view(p.shape)
            for p, o in zip(params, offs, strict=True)
        ]

    def push(self, dev: torch.device, params: Sequence[torch.Tensor], host: Sequence[torch.Tensor]) -> None:
        """Copies the staged values up into the parameters; the training
        stream waits for them on the device."""
        c = gpu.copier(dev)
        for p, h in zip(params, host, strict=True):
            c.h2d(p.data_ptr(), h.data_ptr(), h.numel() * h.element_size())
        self.up_done[self.turn] = c.record()
        ev = torch.cuda.Event()
        ev.record(c.torch_stream)
        torch.cuda.current_stream(dev).wait_event(ev)
        self.turn ^= 1

    def wait(self) -> None:
        for k, ev in enumerate(self.up_done):
            if ev is not None:
                ev.wait()
                self.up_done[k] = None
