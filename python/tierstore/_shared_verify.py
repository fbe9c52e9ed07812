"""Chunk checksums proven by the ranks of a load together
(``load_sharded(..., verify="shared")``).

A resharding load often needs part of a checksum chunk on one rank and the
rest on others: a column shard of a row-major matrix takes a slice of every
row, so the checksum chunks at the edges of each rank's slice are shared
with its neighbours in the TP group. To check such a chunk alone, a rank
must read all of it (``verify="touched"``): with 512-byte chunks, about a
chunk more per row than it needs (several times its bytes for the 4 KiB
chunks of older files). Here each rank reads only its own bytes of
such a chunk and checksums the spans it read (the engine returns them as
pieces); the pieces go to the chunk's owner rank (a hash of the file and the
chunk's offset, so the work spreads over the ranks), which combines the
checksums of the pieces that tile the chunk, in file order, and compares the
result with the chunk's checksum (CRC-32 is linear, so the CRC of a chunk
follows from the CRCs of its spans and their lengths). Each rank learns
which of its pieces were proven; the rest (a chunk that no set of pieces
tiles, that did not match, or whose span another rank read with different
bytes) it checks itself, by reading those chunks whole as
``verify="touched"`` would, and copying its parts again from the checked
bytes.

So no byte is returned that a matching checksum did not cover, and a
damaged chunk is reported by every rank that needs part of it, with the
file, the record and the chunk, from its own check. A rank sends and
receives a few dozen bytes per piece plus one integer per rank: two
all-to-alls, whatever the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tierstore import _core, _dist
from tierstore._engine import get_engine

# A piece row (as ``_core.read_blocks`` returns it, four u64): the chunk's
# file offset; offset in the chunk << 32 | length; checksum << 32 | expected
# checksum; key << 32 | algorithm << 31 | chunk length, the key (the file's
# index) set here.
_CHUNK, _SPAN, _LAST = 0, 1, 3
_LOW32 = np.uint64(0xFFFFFFFF)
# Columns of a filled row: chunk offset, file offset, length, address.
_F_CHUNK, _F_OFF, _F_LEN, _F_MEM = 0, 1, 2, 3


@dataclass
class FilePieces:
    """What a ``verify="shared"`` read of one data file left to prove."""

    file: int
    path: str
    tables: list[Any]
    pieces: np.ndarray  # (n, 4) uint64
    filled: np.ndarray  # (m, 4) uint64


def collect(file: int, path: str, tables: list[Any], pieces: bytes, filled: bytes) -> FilePieces | None:
    """The pieces a read of data file ``file`` returned, or None if none."""
    if not pieces:
        return None
    p = np.frombuffer(pieces, dtype="<u8").reshape(-1, 4).copy()
    p[:, _LAST] |= np.uint64(file) << np.uint64(32)
    f = np.frombuffer(filled, dtype="<u8").reshape(-1, 4)
    return FilePieces(file, path, tables, p, f)


def settle(files: list[FilePieces] | None, world: int, pg: Any) -> tuple[int, int, int]:
    """Proves the pieces of ``files`` with the other ranks of ``pg`` (every
    rank calls this, once per load; a rank that failed before its reads were
    done passes None, and then every rank checks its own chunks alone).
    Re-reads, checking whole chunks, what was not proven. Returns the bytes
    proven with other ranks, and the bytes read and checked by re-reading."""
    mine = np.concatenate([f.pieces for f in files]) if files else np.zeros((0, 4), dtype=np.uint64)
    sends: list[Any] | None = None
    if files is not None:
        # In the order of the ranks that prove them (a hash of file and chunk).
        routed, counts = _core.route_pieces(mine.tobytes(), world)
        mine = np.frombuffer(routed, dtype="<u8").reshape(-1, 4)
        ends = np.cumsum(counts).tolist()
        signed = mine.view(np.int64)
        sends = [signed[e - c : e] for c, e in zip(counts, ends, strict=True)]
    got = _dist.exchange(sends, world, pg)
    if files is None:
        return 0, 0, 0
    proven = np.zeros(len(mine), dtype=bool)
    if got is not None:
        replies: list[Any] | None = None
        try:
            everyone = np.concatenate(got)
            ok = np.frombuffer(_core.prove_pieces(everyone.tobytes()), dtype=np.uint8)
            ends = np.cumsum([len(g) for g in got]).tolist()
            replies = [ok[e - len(g) : e].reshape(-1, 1) for g, e in zip(got, ends, strict=True)]
        finally:
            # The answers go back even when proving failed here (then none,
            # and every rank checks its own chunks): no rank is left waiting.
            back = _dist.exchange(replies, world, pg)
        if back is not None:
            answer = np.concatenate(back).reshape(-1)
            if len(answer) == len(mine):
                proven = answer.astype(bool)
    unproven = mine[~proven]
    # A chunk re-read whole counts once, as checked there, not also as proven.
    again = np.isin(_chunk_keys(mine), _chunk_keys(unproven))
    shared = int((mine[proven & ~again, _SPAN] & _LOW32).sum())
    return (shared, *_check_unproven(files, unproven))


def _chunk_keys(rows: np.ndarray) -> np.ndarray:
    """One value per (file, chunk) of piece rows (for the byte counts only:
    distinct for files under 2^20 and offsets under 2^44)."""
    keys: np.ndarray = (rows[:, _LAST] >> np.uint64(32)) << np.uint64(44) ^ rows[:, _CHUNK]
    return keys


def _check_unproven(files: list[FilePieces], unproven: np.ndarray) -> tuple[int, int]:
    """Reads whole, checks and copies out again every chunk of ``unproven``
    pieces this rank filled memory from. Returns the bytes read and checked."""
    read = checked = 0
    for f in files:
        mine = unproven[(unproven[:, _LAST] >> np.uint64(32)) == np.uint64(f.file)]
        if not len(mine):
            continue
        redo = f.filled[np.isin(f.filled[:, _F_CHUNK], mine[:, _CHUNK])]
        rows = np.stack([redo[:, _F_OFF], redo[:, _F_MEM], redo[:, _F_LEN]], axis=1).astype("<i8")
        r, c, _b, _p, _f = _core.read_blocks(get_engine(), f.path, rows.tobytes(), 0, f.tables, verify="touched")
        read += r
        checked += c
    return read, checked
