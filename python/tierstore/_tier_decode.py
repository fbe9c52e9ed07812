"""Reading a codec tier's encoded files: each ``.tsd`` file decoded, bit-exact,
into a private folder, the records a read needs first (and those of the
references they are predicted from), or straight into the reader's memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from tierstore import _core
from tierstore import codec as _codec
from tierstore._tier_format import MAX_DEPTH, SUFFIX, fingerprint, read_header
from tierstore.errors import CorruptFileError, NotFoundError, TierstoreError

#: Where readers decode encoded files (a Checkpointer's restore: under its
#: first disk tier, node-local storage meant for checkpoints).
DECODE_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("tierstore_decode_root", default=None)


class _Open:
    """An encoded file being decoded into ``out`` (sparse: a segment is
    written when a reader needs its bytes)."""

    def __init__(self, enc: Path, header: dict[str, Any], at: int, out: Path, refs: list[_Open | Path]) -> None:
        self.enc, self.header, self.out, self.refs = enc, header, out, refs
        self.starts: list[int] = []
        for seg in header["segments"]:
            self.starts.append(at)
            at += seg[4]
        self.seg_at = [seg[0] for seg in header["segments"]]
        self.done: set[int] = set()  # segments decoded whole
        self.heads: dict[int, bytes] = {}  # a segment's stream header and directory
        self.chunks: dict[int, set[int]] = {}  # a segment's chunks decoded so far
        self.bytes_read = 0  # encoded bytes read
        self.enc_fd = os.open(enc, os.O_RDONLY | os.O_CLOEXEC)
        self.out_fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.out_fd, header["bytes"])

    def close(self) -> None:
        for fd in (self.enc_fd, self.out_fd):
            with contextlib.suppress(OSError, TierstoreError):
                os.close(fd)


class Decoder:
    """Decodes a checkpoint's ``.tsd`` files for readers of the raw format,
    into a private folder removed with the decoder (under ``root``, else
    ``TIERSTORE_DECODE_DIR``, else the system's temporary folder).

    :meth:`raw` gives the decoded file's path at once with only the bytes
    between records decoded (zip directory, pickle, manifest: what opening
    and checking it reads); :meth:`ensure` decodes the records a read
    touches, so a resharding load decodes only the records it reads (and
    their keyframe's), and :meth:`ensure_all` the rest. References are
    followed within the tier, depth at most 64, cycles refused; a reference
    must have the fingerprint the delta recorded."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root if root is not None else DECODE_ROOT.get()
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._open: dict[Path, _Open] = {}  # by encoded path
        self._by_out: dict[str, _Open] = {}
        self._n = 0

    def raw(self, enc: Path, stack: tuple[Path, ...] = ()) -> Path:
        """The decoded path of ``enc`` (a ``.tsd`` file); its records are
        decoded by :meth:`ensure` / :meth:`ensure_all`."""
        return self._open_file(enc, stack).out

    def _open_file(self, enc: Path, stack: tuple[Path, ...] = ()) -> _Open:
        enc = Path(os.path.abspath(enc))
        got = self._open.get(enc)
        if got is not None:
            return got
        if enc in stack or len(stack) >= MAX_DEPTH:
            raise CorruptFileError(f"{enc}: its references form a cycle or a chain deeper than {MAX_DEPTH}")
        h, at = read_header(enc)
        refs: list[_Open | Path] = []
        for r in h["refs"]:
            ref: _Open | Path
            tier = enc.parent.parent
            rdir = tier / str(r["step_dir"])
            coded, plain = rdir / (str(r["name"]) + SUFFIX), rdir / str(r["name"])
            if coded.is_file():
                ref = self._open_file(coded, (*stack, enc))
                rpath = ref.out
            elif plain.is_file():
                ref = rpath = plain
            else:
                raise NotFoundError(
                    f"{enc}: its reference {r['step_dir']}/{r['name']} is missing from {tier}", path=str(enc)
                )
            got_fp = fingerprint(rpath)
            if got_fp != (r["bytes"], r["manifest_crc32"]):
                raise CorruptFileError(
                    f"{enc}: its reference {r['step_dir']}/{r['name']} is not the file it was encoded against "
                    f"({got_fp[0]} bytes, manifest crc32 {got_fp[1]:08x}; recorded {r['bytes']}, "
                    f"{r['manifest_crc32']:08x})",
                    path=str(enc),
                    record="reference",
                )
            refs.append(ref)
        if self._dir is None:
            env = os.environ.get("TIERSTORE_DECODE_DIR")
            root = self._root or (Path(env) if env else None)
            self._dir = tempfile.TemporaryDirectory(prefix=".tierstore-decoded-", dir=root)
        self._n += 1
        sub = Path(self._dir.name) / str(self._n)
        sub.mkdir()
        o = _Open(enc, h, at, sub / enc.name.removesuffix(SUFFIX), refs)
        self._open[enc] = o
        self._by_out[str(o.out)] = o
        try:
            # What opening and checking the file reads: the bytes between records.
            for i, label in enumerate(h["labels"]):
                if not label:
                    self._decode(o, i)
        except BaseException:
            self._forget(o)
            raise
        return o

    def _forget(self, o: _Open) -> None:
        o.close()
        self._open.pop(o.enc, None)
        self._by_out.pop(str(o.out), None)

    def ensure(self, path: str | Path, spans: list[tuple[int, int]]) -> None:
        """Decodes the segments of decoded file ``path`` that the byte
        ranges ``[lo, hi)`` touch (nothing for a file that is not one)."""
        o = self._by_out.get(str(path))
        if o is None:
            return
        import bisect

        for lo, hi in spans:
            if hi <= lo:
                continue
            i = max(0, bisect.bisect_right(o.seg_at, lo) - 1)
            while i < len(o.seg_at) and o.seg_at[i] < hi:
                at = o.seg_at[i]
                self._decode(o, i, max(lo - at, 0), hi - at)
                i += 1

    def ensure_all(self, path: str | Path) -> None:
        o = self._by_out.get(str(path))
        if o is not None:
            for i in range(len(o.seg_at)):
                self._decode(o, i)

    def _read(self, o: _Open, n: int, at: int, i: int, what: str) -> bytes:
        got = os.pread(o.enc_fd, n, at) if n else b""
        if len(got) != n:
            raise CorruptFileError(
                f"{o.enc}: segment {i}: the file is shorter than its header says ({what})", path=str(o.enc)
            )
        o.bytes_read += n
        return got

    def decodes(self, path: str | Path) -> bool:
        """Whether ``path`` is a file this decoder decodes."""
        return str(path) in self._by_out

    def decode_into(self, path: str | Path, at: int, length: int, addr: int) -> bool:
        """Decodes bytes ``[at, at + length)`` of decoded file ``path``
        straight into the ``length`` bytes of memory at ``addr`` (a restore's
        destination), where they are exactly one segment (a record) not yet
        decoded into the file: the file is not written. False (nothing
        done) otherwise: read them from the file."""
        import bisect

        o = self._by_out.get(str(path))
        if o is None or length <= 0:
            return False
        k = bisect.bisect_left(o.seg_at, at)
        if k >= len(o.seg_at) or o.seg_at[k] != at or o.header["segments"][k][1] != length or k in o.done:
            return False
        self._decode(o, k, 0, length, into=addr)
        return True

    def _decode(self, o: _Open, i: int, lo: int = 0, hi: int | None = None, into: int = 0) -> None:
        """Decodes the chunks of segment ``i`` that its decoded bytes ``[lo,
        hi)`` (default: all) lie in, reading only the stream's directory and
        those chunks' payloads (and the reference's bytes of those chunks).
        ``into``: the address of memory for the whole segment to decode into
        instead of the decoded file."""
        if i in o.done and not into:
            return
        at, length, _width, ref_at, slen = o.header["segments"][i]
        hi = length if hi is None else min(hi, length)
        record = f"segment {i} (bytes {at}..{at + length} of {o.header['name']})"
        if ref_at >= 0 and self._decode_chain(o, i, max(lo, 0), hi, into):
            return
        head = self._head(o, i)
        plen = slen - len(head)
        sp = _core.codec_span(head, plen, lo, hi, path=str(o.enc), record=record)
        first_chunk, end_chunk, start, end, p_lo, p_hi = sp
        if into and (start, end) != (0, length):
            raise TierstoreError(f"{o.enc}: {record}: a decode into memory takes the whole segment")
        done = o.chunks.setdefault(i, set())
        if not into and all(c in done for c in range(first_chunk, end_chunk)):
            return
        window = self._read(o, p_hi - p_lo, o.starts[i] + len(head) + p_lo, i, "chunk payloads")
        ref_buf: torch.Tensor | None = None
        if ref_at >= 0:
            ref = o.refs[o.header["seg_refs"][i]]
            n = end - start
            if isinstance(ref, _Open):
                self.ensure(ref.out, [(ref_at + start, ref_at + end)])
                rb = os.pread(ref.out_fd, n, ref_at + start)
            else:
                with open(ref, "rb") as f:
                    f.seek(ref_at + start)
                    rb = f.read(n)
            if len(rb) != n:
                raise CorruptFileError(f"{o.enc}: {record}: its reference is too short", path=str(o.enc))
            ref_buf = torch.frombuffer(bytearray(rb), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(0 if into else end - start, dtype=torch.uint8)
        _core.codec_decode_span(
            head,
            plen,
            sp,
            window,
            (into or (out.data_ptr() if end > start else 0), end - start),
            ((ref_buf.data_ptr() if ref_buf.numel() else 1), ref_buf.numel()) if ref_buf is not None else None,
            threads=_codec.threads(),
            path=str(o.enc),
            record=record,
        )
        if not into:
            self._store(o, i, at + start, out, range(first_chunk, end_chunk))

    def _head(self, o: _Open, i: int) -> bytes:
        """Segment ``i``'s stream header and directory (read once)."""
        head = o.heads.get(i)
        if head is None:
            at, length, _width, _ref_at, slen = o.header["segments"][i]
            record = f"segment {i} (bytes {at}..{at + length} of {o.header['name']})"
            first = self._read(o, min(_core.CODEC_HEADER, slen), o.starts[i], i, "stream header")
            n = _core.codec_directory_end(first, path=str(o.enc), record=record)
            if n > slen:
                raise CorruptFileError(
                    f"{o.enc}: {record}: a directory of {n} bytes in a stream of {slen}", path=str(o.enc)
                )
            head = first + self._read(o, n - len(first), o.starts[i] + len(first), i, "directory")
            o.heads[i] = head
        return head

    def _decode_chain(self, o: _Open, i: int, lo: int, hi: int, into: int = 0) -> bool:
        """Decodes the chunks of segment ``i`` that its bytes ``[lo, hi)``
        lie in, in one pass down its chain of references, where each link is
        a segment of the same length at the reference's offset and the chain
        ends in a keyframe's segment: each link's directory and the payloads
        of the same chunks are read, each reference chunk is decoded into
        scratch (``codec_decode_chain_span``) and none of the links is
        decoded on its own. False (nothing done) where that does not apply
        or fails: then it is decoded link by link, and an error names the
        link it comes from."""
        import bisect

        links: list[tuple[_Open, int]] = [(o, i)]
        cur, j = o, i
        while True:
            _a, length, _w, ref_at, _sl = cur.header["segments"][j]
            if ref_at < 0:
                break
            ref = cur.refs[cur.header["seg_refs"][j]]
            if not isinstance(ref, _Open) or len(links) > MAX_DEPTH:
                return False
            k = bisect.bisect_left(ref.seg_at, ref_at)
            if k >= len(ref.seg_at) or ref.seg_at[k] != ref_at or ref.header["segments"][k][1] != length:
                return False
            cur, j = ref, k
            links.append((cur, j))
        if len(links) < 2:
            return False
        heads = [self._head(lk, k) for lk, k in links]
        plens = [lk.header["segments"][k][4] - len(h) for (lk, k), h in zip(links, heads, strict=True)]
        name = f"segment {i} of {o.header['name']}"
        first, last, start, end, _p_lo, _p_hi = _core.codec_span(
            heads[0], plens[0], lo, hi, path=str(o.enc), record=name
        )
        if into and (start, end) != (0, o.header["segments"][i][1]):
            return False
        done = o.chunks.setdefault(i, set())
        if not into and all(c in done for c in range(first, last)):
            return True
        windows, bases = [], []
        for n, ((lk, k), h) in enumerate(zip(links, heads, strict=True)):
            sp = _core.codec_span(h, plens[n], start, end, path=str(lk.enc), record=f"segment {k}")
            if (sp[0], sp[1]) != (first, last):
                return False  # a link copies its own chunks: decoded link by link
            windows.append(self._read(lk, sp[5] - sp[4], lk.starts[k] + len(h) + sp[4], k, "chunk payloads"))
            bases.append(sp[4])
        out = torch.empty(0 if into else end - start, dtype=torch.uint8)
        try:
            ok = _core.codec_decode_chain_span(
                heads,
                plens,
                windows,
                bases,
                first,
                last,
                (into or (out.data_ptr() if end > start else 0), end - start),
                threads=_codec.threads(),
                path=str(o.enc),
                record=name,
            )
        except TierstoreError:
            return False
        if not ok:
            return False
        if not into:
            self._store(o, i, o.header["segments"][i][0] + start, out, range(first, last))
        return True

    def _store(self, o: _Open, i: int, at: int, out: torch.Tensor, chunks: range) -> None:
        """Writes decoded bytes ``out`` of segment ``i`` at file offset ``at``
        of its decoded file and marks its ``chunks`` decoded (the segment
        done once all of them are)."""
        mv = memoryview(out.numpy().data)
        written = 0
        while written < len(mv):
            written += os.pwrite(o.out_fd, mv[written:], at + written)
        done = o.chunks.setdefault(i, set())
        done.update(chunks)
        if len(done) == (len(o.heads[i]) - _core.CODEC_HEADER) // _core.CODEC_ENTRY:  # every chunk of the segment
            o.done.add(i)
            o.heads.pop(i, None)
            o.chunks.pop(i, None)

    def close(self) -> None:
        for o in list(self._open.values()):
            o.close()
        self._open.clear()
        self._by_out.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
