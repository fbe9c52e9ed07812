"""Records of a file read straight into device memory: the engine reads
each window into one of a few pinned slots, the copier moves it to the
device while the next window is read, and a helper thread checksums each
window in the meantime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tierstore import _core
from tierstore._engine import get_engine
from tierstore.errors import ChecksumError
from tierstore.gpu import RING_SLOT, Event, copier, give_ring, take_ring


def load_records_to_device(
    path: str,
    specs: Sequence[tuple[str, int, int, int | None]],
    device: torch.device,
    *,
    on_chunk: Callable[[int], None] | None = None,
) -> list[torch.UntypedStorage]:
    """Reads records ``(name, data_offset, size, crc32 or None)`` of ``path``
    into new device storages: the engine reads each window of a record
    (direct I/O where aligned) into one of a few pinned slots, the copier
    moves it to the device and a helper thread checksums it while the next
    window is read. A record's CRC-32 is checked before its storage is
    returned; a mismatch raises :class:`~tierstore.errors.ChecksumError`
    naming it."""
    c = copier(device)
    eng = get_engine()
    slots = take_ring()
    busy: list[Event | None] = [None] * len(slots)
    sums: list[tuple[int, Future[list[int]], int]] = []  # (window, CRC job, length), in window order
    acc = [0, 0]  # [CRC so far of the current record, bytes it covers]
    out: list[torch.UntypedStorage] = []

    def fold(upto: int) -> None:
        """Folds the CRCs of windows up to ``upto`` into the record's."""
        while sums and sums[0][0] <= upto:
            _w, job, n = sums.pop(0)
            part = job.result()[0]
            acc[0] = _core.crc32_combine(acc[0], part, n) if acc[1] else part
            acc[1] += n

    k = 0
    pool = ThreadPoolExecutor(1, thread_name_prefix="tierstore-crc")
    try:
        for name, off, size, crc in specs:
            st = torch.empty(size, dtype=torch.uint8, device=c.device).untyped_storage()
            acc[0] = acc[1] = 0
            pos, end = off, off + size
            while pos < end:
                lo = pos - pos % 4096
                hi = min(lo + RING_SLOT, end + (-end % 4096))
                slot = k % len(slots)
                fold(k - len(slots))  # the slot's previous window is checksummed
                ev = busy[slot]
                if ev is not None:
                    ev.wait()  # and copied to the device
                b = slots[slot]
                try:
                    _core.transfer_ranges(eng, path, [lo], [hi - lo], [b.addr], direct=True)
                except Exception:
                    # The window's page-rounded end lies past the end of the
                    # file: read exactly the record's bytes (buffered).
                    lo = pos
                    _core.transfer_ranges(eng, path, [lo], [end - lo], [b.addr])
                take = min(hi, end) - pos
                src = b.addr + (pos - lo)
                if crc is not None:
                    sums.append((k, pool.submit(_core.crc32_regions, [(src, take)], 1), take))
                c.h2d(st.data_ptr() + (pos - off), src, take)
                busy[slot] = c.record()
                k += 1
                if on_chunk is not None:
                    on_chunk(take)
                pos += take
            fold(k)
            if crc is not None and size and acc[0] != crc:
                raise ChecksumError(
                    f"{path}: record '{name}': CRC-32 {acc[0]:08x} of the bytes read differs from the {crc:08x} "
                    "the archive stores; the file is damaged",
                    path=path,
                    record=name,
                )
            out.append(st)
        c.synchronize()
    finally:
        pool.shutdown(wait=True)
        for ev in busy:
            if ev is not None:
                ev.wait()
        give_ring(slots)
    return out
