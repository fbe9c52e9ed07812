"""The ``tierstore`` command: ``inspect``, ``verify`` and ``info``.

``tierstore inspect FILE``
    Records (name, kind, dtype, shapes, size, offset, alignment) and whether
    each one's checksum holds. ``--no-verify`` skips reading the data.
``tierstore verify FILE``
    Checks every record's CRC-32; exits 1 naming the damaged record.
``tierstore info [PATH]``
    The I/O backend in use and why, io_uring availability, and the O_DIRECT
    alignment of the file system at PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tierstore import _archive, _core, _progress
from tierstore.errors import ChecksumError, TierstoreError


def _console() -> Any:
    from rich.console import Console

    # Piped output is not wrapped at 80 columns (names would be folded).
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _path_str(path: list[str | int]) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


def _record_states(path: str, arch: _archive.Archive, offsets: dict[str, int], verify: bool) -> dict[str, str]:
    """Checksum state per record: ok, DAMAGED or 'not checked'."""
    if not verify:
        return dict.fromkeys(arch.records, "not checked")
    states: dict[str, str] = {}
    with _progress.bar(_progress.wanted(None), f"verifying {path}") as cb:
        specs = [(arch.full(rel), offsets[rel], e[1], e[0]) for rel, e in arch.records.items()]
        total = sum(s[2] for s in specs)
        done = 0
        for spec, rel in zip(specs, arch.records, strict=True):
            try:
                _core.read_records(_engine(), path, [spec], verify=True)
                states[rel] = "ok"
            except ChecksumError:
                states[rel] = "DAMAGED"
            done += spec[2]
            if cb is not None:
                cb(done, total)
    return states


def _engine() -> Any:
    from tierstore._engine import get_engine

    return get_engine()


def cmd_inspect(args: argparse.Namespace) -> int:
    path = args.file
    arch, m, offsets = _archive.open_archive(path)
    states = _record_states(path, arch, offsets, not args.no_verify)
    shapes: dict[str, list[str]] = {}
    dtypes: dict[str, str] = {}
    kinds: dict[str, str] = {}
    if m is not None:
        for t in m.get("tensors", []):
            shapes.setdefault(t["record"], []).append(f"{_path_str(t['path'])} {tuple(t['shape'])}")
        for r in m["records"]:
            if "dtype" in r:
                dtypes[r["name"]] = r["dtype"]
            kinds[r["name"]] = r.get("kind", "")
    rows: list[dict[str, Any]] = []
    for rel, (crc, size, _cs, _meth, _hdr) in sorted(arch.records.items(), key=lambda kv: offsets[kv[0]]):
        off = offsets[rel]
        rows.append(
            {
                "record": rel,
                "kind": kinds.get(rel, "storage" if rel.startswith("data/") else "meta"),
                "dtype": dtypes.get(rel, ""),
                "tensors": shapes.get(rel, []),
                "size": size,
                "offset": off,
                "alignment": off & -off if off else 4096,
                "aligned": off % 4096 == 0 if rel.startswith("data/") else off % 64 == 0,
                "crc32": f"{crc:08x}",
                "checksum": states[rel],
            }
        )
    damaged = [r["record"] for r in rows if r["checksum"] == "DAMAGED"]
    if args.json:
        out = {
            "file": path,
            "writer": m.get("writer") if m else "torch.save (no tierstore manifest)",
            "archive": arch.prefix,
            "file_bytes": arch.file_len,
            "records": rows,
            "damaged": damaged,
        }
        print(json.dumps(out, indent=2))
        return 1 if damaged else 0
    from rich.table import Table

    con = _console()
    writer = m.get("writer") if m else "torch.save (no tierstore manifest)"
    con.print(f"[bold]{path}[/bold]: {len(rows)} records, {_human(arch.file_len)}, written by {writer}")
    table = Table(show_lines=False)
    for col in ("record", "kind", "dtype", "tensors (path shape)", "size", "offset", "aligned", "checksum"):
        table.add_column(col, overflow="fold")
    for r in rows:
        tens = r["tensors"]
        shown = "; ".join(tens[:3]) + (f"; +{len(tens) - 3} more" if len(tens) > 3 else "")
        state = r["checksum"]
        style = {"ok": "green", "DAMAGED": "bold red"}.get(state, "yellow")
        table.add_row(
            r["record"],
            r["kind"],
            r["dtype"],
            shown,
            _human(r["size"]),
            str(r["offset"]),
            str(min(r["alignment"], 4096)),
            f"[{style}]{state}[/{style}] {r['crc32']}",
        )
    con.print(table)
    if damaged:
        con.print(f"[bold red]damaged records: {', '.join(damaged)}[/bold red]")
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    path = args.file
    with _progress.bar(_progress.wanted(None), f"verifying {path}") as cb:
        n, nbytes = _archive.verify(path, cb)
    print(f"{path}: OK ({n} records, {_human(nbytes)} verified)")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from tierstore._engine import info

    d = info(args.path)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    p = d["path"]
    ok, why = _core.io_uring_status()
    lines = [
        f"tierstore {d['version']}",
        f"backend:        {d['backend']} ({d['backend_reason']})",
        f"io_uring:       {'available' if ok else 'unavailable: ' + str(why)}",
        f"queue depth:    {d['queue_depth']} requests in flight, {d['path_limit']} per path",
        f"chunk size:     {_human(d['chunk_bytes'])}; staging pool bound {_human(d['pool_bytes'])}",
        f"cpu threads:    {d['cpu_threads']} (copy and checksum)",
        f"path:           {os.path.abspath(p['path'])} ({p['fs_type']})",
    ]
    if p["direct_io"]:
        lines.append(
            f"O_DIRECT:       yes; memory alignment {p['mem_align']}, offset alignment "
            f"{p['offset_align']} (from {p['align_source']})"
        )
    else:
        lines.append(f"O_DIRECT:       no ({p['reason']}); buffered I/O is used here")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore", description="Inspect, verify and probe tierstore files.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="list the records of a file, with dtypes, shapes and checksum state")
    i.add_argument("file")
    i.add_argument("--no-verify", action="store_true", help="do not read the data to check checksums")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("verify", help="check every record's checksum; exit 1 on damage")
    v.add_argument("file")
    v.set_defaults(func=cmd_verify)
    n = sub.add_parser("info", help="backend, io_uring availability and O_DIRECT alignment of a path")
    n.add_argument("path", nargs="?", default=".")
    n.add_argument("--json", action="store_true")
    n.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except TierstoreError as e:
        print(f"tierstore: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tierstore: interrupted", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
