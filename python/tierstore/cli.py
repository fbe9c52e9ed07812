"""The ``tierstore`` command: ``inspect``, ``verify`` and ``info``.

``tierstore inspect FILE``
    Records (name, kind, dtype, shapes, size, offset, alignment) and whether
    each one's checksum holds. ``--no-verify`` skips reading the data.
``tierstore verify FILE``
    Checks every record's CRC-32; exits 1 naming the damaged record.
``tierstore inspect DIR`` / ``tierstore verify DIR``
    The same for a sharded checkpoint (global tensors, layouts, coverage);
    ``inspect --manifest DIR`` prints its manifest as JSON (an indexed
    manifest's sections included).
``tierstore consolidate DIR OUT.pt``
    One full state dict from a sharded (or DCP) checkpoint.
``tierstore convert SRC DST``
    PyTorch DCP to tierstore, or tierstore to DCP.
``tierstore info [PATH]``
    The I/O backend in use and why, io_uring availability, and the O_DIRECT
    alignment of the file system at PATH.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, cast

from rich.markup import escape

from tierstore import _archive, _core, _progress
from tierstore import codec as _codec
from tierstore._metadata import dtype_name
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
        specs = [(arch.full(rel), offsets[rel], e.size, e.crc32) for rel, e in arch.records.items()]
        total = sum(s[2] for s in specs)
        done = 0
        for spec, rel in zip(specs, arch.records, strict=True):
            try:
                _core.start_read(_engine(), path, [spec], verify=True).wait()
                states[rel] = "ok"
            except ChecksumError:
                states[rel] = "DAMAGED"
            done += spec[2]
            if cb is not None:
                cb(done, total)
    return states


def _torch_kind(rel: str) -> str:
    """The kind of a record in a file torch wrote (tierstore's manifest names its own)."""
    if rel.startswith("data/"):
        return "storage"
    if rel.endswith(".pkl"):
        return "pickle"
    if rel.startswith("code/"):
        return "code"
    return "meta"


def _engine() -> Any:
    from tierstore._engine import get_engine

    return get_engine()


def _print_manifest(path: str) -> int:
    """The checked manifest of a sharded checkpoint as one JSON document:
    an indexed manifest's global tensors and groups read from its index."""
    from tierstore.shardmeta import read_manifest

    m = read_manifest(path)
    out = {k: v for k, v in m.items() if k not in ("tensors", "groups", "index_file")}
    out["files"] = list(m["files"])  # an index's sections of file entries included
    out["tensors"] = {n: m["tensors"][n] for n in m["tensors"]}
    groups = m["groups"]
    out["groups"] = [
        {"coords": [list(c) for c in groups[i]], "files": list(groups[i].values())} for i in range(len(groups))
    ]
    print(json.dumps(out, indent=1))
    return 0


def _inspect_dir(args: argparse.Namespace) -> int:
    from tierstore import dcp
    from tierstore.layout import Box, Rule
    from tierstore.shardmeta import read_manifest

    path = args.file
    if getattr(args, "manifest", False) and os.path.exists(os.path.join(path, "manifest.json")):
        return _print_manifest(path)
    rows: list[dict[str, Any]]
    if dcp.is_dcp(path) and not os.path.exists(os.path.join(path, "manifest.json")):
        ck = dcp.DcpCheckpoint(path, weights_only=not args.unsafe)
        rows = [
            {"tensor": n, "shape": list(s), "dtype": dtype_name(dt), "pieces": len(ch),
             "covered": _exactly_covered([b for b, _ in ch], s)}
            for n, (s, dt, ch) in sorted(ck.tensors.items())
        ]  # fmt: skip
        files, objects, writer = (
            len({i.relative_path for _s, _d, ch in ck.tensors.values() for _b, i in ch}),
            sorted(ck.objects),
            "PyTorch DCP",
        )
    else:
        m = read_manifest(path)
        rows = []
        for n, g in sorted(m["tensors"].items()):
            if "rule" in g:  # positions of a sharding rule: proven to tile the tensor when the manifest was read
                rule = Rule.from_json(g["rule"])
                rows.append({"tensor": n, "shape": g["shape"], "dtype": g["dtype"], "pieces": math.prod(rule.axes),
                             "covered": True, "layouts": ["rule"], "rule": g["rule"]})  # fmt: skip
                continue
            boxes = [Box.from_json(p[1]) for p in g["pieces"]]
            rows.append(
                {"tensor": n, "shape": g["shape"], "dtype": g["dtype"], "pieces": len(boxes),
                 "covered": _exactly_covered(boxes, g["shape"]),
                 "layouts": sorted({"flat" if not isinstance(p[2], list) else "block" for p in g["pieces"]})}
            )  # fmt: skip
        files, objects, writer = len(m["files"]), sorted(m["objects"]) + sorted(m["per_rank_objects"]), m["writer"]
    if args.json:
        print(json.dumps({"checkpoint": path, "writer": writer, "files": files, "tensors": rows, "objects": objects},
                         indent=2))  # fmt: skip
        return 0 if all(r["covered"] for r in rows) else 1
    from rich.table import Table

    con = _console()
    con.print(
        f"[bold]{escape(path)}[/bold]: sharded checkpoint ({escape(str(writer))}), {files} files, "
        f"{len(rows)} global tensors"
    )
    table = Table()
    for col in ("global tensor", "shape", "dtype", "pieces", "coverage"):
        table.add_column(col)
    for r in rows:
        table.add_row(escape(r["tensor"]), str(tuple(r["shape"])), escape(r["dtype"]), str(r["pieces"]),
                      "[green]complete[/green]" if r["covered"] else "[red]INCOMPLETE[/red]")  # fmt: skip
    con.print(table)
    if objects:
        con.print("objects: " + escape(", ".join(objects)))
    return 0 if all(r["covered"] for r in rows) else 1


def _exactly_covered(boxes: list[Any], shape: Any) -> bool:
    """Whether ``boxes`` (inside the shape) tile a tensor of ``shape`` exactly once."""
    from tierstore.reshard import overlapping_pair

    return sum(b.numel for b in boxes) == math.prod(shape) and overlapping_pair(boxes) is None


def _codec_fields(rec: dict[str, Any] | None, size: int) -> dict[str, Any]:
    """A record's codec, transform, reference and ratio (decoded / stored)."""
    if not rec or rec.get("codec") in (None, "raw"):
        return {
            "codec": "raw" if rec and rec.get("kind") == "storage" else "",
            "transform": "",
            "reference": "",
            "ratio": "",
        }
    ref = rec.get("delta_base")
    decoded = rec.get("decoded_size")
    ratio = f"{decoded / size:.2f}x" if isinstance(decoded, int) and size else ""
    return {
        "codec": str(rec.get("codec")),
        "transform": str(rec.get("transform", "")),
        "reference": f"{ref.get('file')}:{ref.get('record')}" if isinstance(ref, dict) else "",
        "ratio": ratio,
    }


def _inspect_encoded(args: argparse.Namespace) -> int:
    """An encoded file of a codec tier: per segment (a record, or the bytes
    between records) its tensor, sizes, ratio and whether it is predicted
    from the reference; nothing decoded."""
    from tierstore import _tier_codec

    h, _at = _tier_codec.read_header(Path(args.file))
    ref = h["reference"]
    refs = h["refs"]
    several = len(refs) > 1
    rows = [
        {
            "at": a,
            "bytes": n,
            "stored": sl,
            "width": w,
            "tensor": label,
            "reference": "yes" if r >= 0 else "no",
            "reference_step": refs[k]["step_dir"] if k >= 0 else None,
            "ratio": round(n / sl, 3) if sl else None,
        }
        for (a, n, w, r, sl), k, label in zip(h["segments"], h["seg_refs"], h["labels"], strict=True)
    ]
    if args.json:
        out = {
            "file": args.file,
            "name": h["name"],
            "bytes": h["bytes"],
            "reference": ref,
            "references": refs,
            "segments": rows,
        }
        print(json.dumps(out))
        return 0
    stored = sum(r["stored"] for r in rows)
    if several:
        listed = ", ".join(f"#{i + 1} {x['step_dir']}/{x['name']}" for i, x in enumerate(refs))
        kind = f"a delta, each record against one of {listed}"
    else:
        kind = f"a delta against {ref['step_dir']}/{ref['name']}" if ref else "a keyframe (no reference)"
    print(f"{args.file}: {h['name']} encoded ({h['codec']}), {kind}")
    print(f"  {_human(h['bytes'])} held, {_human(stored)} stored ({h['bytes'] / max(stored, 1):.2f}x)")
    print(f"  {'offset':>12} {'bytes':>10} {'stored':>10} {'ratio':>7} {'ref':>4}  tensor")
    for r, k in zip(rows, h["seg_refs"], strict=True):
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        mark = f"#{k + 1}" if several and k >= 0 else r["reference"]
        print(
            f"  {r['at']:>12} {_human(r['bytes']):>10} {_human(r['stored']):>10} {ratio:>7} {mark:>4}  "
            f"{r['tensor'] or '(metadata)'}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = args.file
    if os.path.isdir(path):
        return _inspect_dir(args)
    if path.endswith(".tsd"):
        return _inspect_encoded(args)
    arch, m, offsets = _archive.open_archive(path)
    states = _record_states(path, arch, offsets, not args.no_verify)
    shapes: dict[str, list[str]] = {}
    dtypes: dict[str, str] = {}
    kinds: dict[str, str] = {}
    if m is None and "data.pkl" in arch.records:
        # A file torch.save wrote: dtypes and tensors from its pickle (weights-only rules, meta device).
        from tierstore import _pickle

        pkl = arch.records["data.pkl"]
        if pkl.size <= 1 << 30:
            spec = (pkl.name, offsets["data.pkl"], pkl.size, pkl.crc32)
            pending = _core.start_read(_engine(), path, [spec], verify=False)
            pending.wait()
            (data,) = pending.buffers
            dtypes, shapes = _pickle.describe_storages(bytes(cast(Any, data)))
    if m is not None:
        for t in m.get("tensors", []):
            if not isinstance(t, dict):
                continue
            path_s = _path_str(t["path"]) if isinstance(t.get("path"), list) else str(t.get("path"))
            shape = tuple(t["shape"]) if isinstance(t.get("shape"), list) else t.get("shape")
            shapes.setdefault(str(t.get("record")), []).append(f"{path_s} {shape}")
        for r in m["records"]:
            if "dtype" in r:
                dtypes[r["name"]] = str(r["dtype"])
            kinds[r["name"]] = str(r.get("kind", ""))
    recs_by_name = {r["name"]: r for r in m["records"]} if m is not None else {}
    rows: list[dict[str, Any]] = []
    for rel, rec in sorted(arch.records.items(), key=lambda kv: offsets[kv[0]]):
        off, size, crc = offsets[rel], rec.size, rec.crc32
        rows.append(
            {
                "record": rel,
                "kind": kinds.get(rel) or _torch_kind(rel),
                "dtype": dtypes.get(rel, ""),
                "tensors": shapes.get(rel, []),
                "size": size,
                "offset": off,
                "alignment": off & -off if off else 4096,
                "aligned": off % 4096 == 0 if rel.startswith("data/") else off % 64 == 0,
                "crc32": f"{crc:08x}",
                "checksum": states[rel],
                **_codec_fields(recs_by_name.get(rel), size),
            }
        )
    damaged = [r["record"] for r in rows if r["checksum"] == "DAMAGED"]
    if args.json:
        out = {
            "file": path,
            "writer": m.get("writer") if m else "torch.save (no tierstore manifest)",
            "archive": arch.prefix,
            "file_bytes": arch.file_len,
            "record_bytes": sum(r["size"] for r in rows),
            "records": rows,
            "damaged": damaged,
        }
        print(json.dumps(out, indent=2))
        return 1 if damaged else 0
    from rich.table import Table

    con = _console()
    writer = m.get("writer") if m else "torch.save (no tierstore manifest)"
    con.print(
        f"[bold]{escape(path)}[/bold]: {len(rows)} records, {_human(sum(r['size'] for r in rows))} of record data "
        f"in a {_human(arch.file_len)} file, written by {escape(str(writer))}"
    )
    table = Table(show_lines=False)
    coded = any(r["codec"] not in ("", "raw") for r in rows)
    cols = ["record", "kind", "dtype", "tensors (path shape)", "size", "offset", "aligned", "checksum"]
    if coded:
        cols.append("codec transform reference ratio")
    for col in cols:
        table.add_column(col, overflow="fold")
    for r in rows:
        tens = r["tensors"]
        shown = "; ".join(tens[:3]) + (f"; +{len(tens) - 3} more" if len(tens) > 3 else "")
        state = r["checksum"]
        style = {"ok": "green", "DAMAGED": "bold red"}.get(state, "yellow")
        table.add_row(
            escape(r["record"]),
            escape(r["kind"]),
            escape(r["dtype"]),
            escape(shown),
            _human(r["size"]),
            str(r["offset"]),
            str(min(r["alignment"], 4096)),
            f"[{style}]{state}[/{style}] {r['crc32']}",
            *(
                [escape(" ".join(x for x in (r["codec"], r["transform"], r["reference"], r["ratio"]) if x))]
                if coded
                else []
            ),
        )
    con.print(table)
    if damaged:
        con.print(f"[bold red]damaged records: {escape(', '.join(damaged))}[/bold red]")
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    path = args.file
    if os.path.isdir(path):
        return _verify_dir(path, not args.unsafe)
    with _progress.bar(_progress.wanted(None), f"verifying {path}") as cb:
        n, nbytes = _archive.verify(path, cb)
    arch, m, _offsets = _archive.open_archive(path)
    # A compressed file decodes as a load does, with the records of the
    # bases its deltas name read and checked too (a load needs them).
    _loads_as_load_does(path, not args.unsafe, verify=_codec.is_compressed(m))
    size = arch.file_len
    print(f"{path}: OK ({n} records, {_human(nbytes)} of record data verified, in a {_human(size)} file)")
    return 0


def _loads_as_load_does(path: str, weights_only: bool, verify: bool = False) -> None:
    """Everything ``tierstore.load`` relies on besides the data's checksums
    (the directory as load reads it, the manifest, data.pkl and the storages
    it names), without reading the data: a load onto the meta device."""
    from tierstore.api import load

    load(path, map_location="meta", weights_only=weights_only, verify=verify)


def _verify_dir(path: str, weights_only: bool) -> int:
    """A sharded checkpoint: the manifest (checksum, every field), every data
    file against it (directory, manifest, record CRC-32s, chunk checksums),
    every objects file (checksums, and that it loads), the attachments, and
    the exact coverage of every global tensor."""
    from tierstore import dcp
    from tierstore.shardmeta import MANIFEST, closing_scope

    if dcp.is_dcp(path) and not os.path.exists(os.path.join(path, MANIFEST)):
        return _verify_dcp(path, weights_only)
    with closing_scope():
        return _verify_sharded(path, weights_only)


def _verify_sharded(path: str, weights_only: bool) -> int:
    from tierstore.layout import Box
    from tierstore.reshard import overlapping_pair
    from tierstore.shardmeta import Checkpoint, read_attachment

    ck = Checkpoint(path)
    ck.check_all_files()
    m = ck.manifest
    for name, g in m["tensors"].items():
        if "rule" in g:
            continue  # its positions were proven complete when the manifest was read, and checked just now
        boxes = [Box.from_json(p[1]) for p in g["pieces"]]
        held = sum(b.numel for b in boxes)
        pair = overlapping_pair(boxes)
        if held != math.prod(g["shape"]) or pair is not None:
            what = "overlap" if pair is not None else f"hold {held} of {math.prod(g['shape'])} elements"
            print(f"tierstore: {ck.manifest_path}: global tensor {name!r}: its pieces {what}", file=sys.stderr)
            return 1
    total_n = total_b = checked = 0
    engine = _engine()
    for fi in range(len(ck.files)):
        tables = ck.check_file(fi)
        fp = ck.path_of(fi)  # a codec tier's encoded file: decoded (bit-exact) and checked as the raw file
        ck.prepare_read(fi, None)
        n, b = _archive.verify(str(fp))
        total_n, total_b = total_n + n, total_b + b
        if tables:
            _r, c = _core.read_ranges_verified(
                engine, str(fp), [], [], [], [], [t.as_tuple() for t in tables.values()], full=True
            )
            checked += c
    names = set(m["objects"].values()) | {f for h in m["per_rank_objects"].values() for f in h.values()}
    for name in sorted(names):
        p = ck.check_objects_file(name)
        n, b = _archive.verify(str(p))
        total_n, total_b = total_n + n, total_b + b
        from tierstore.api import load

        load(p, weights_only=weights_only, verify=False)
    for name in m.get("attachments", {}):
        read_attachment(ck.dir, m, name)
    print(
        f"{path}: OK ({len(ck.files)} data files, {len(names)} objects files, {total_n} records, "
        f"{_human(total_b)} and {_human(checked)} of chunks verified)"
    )
    return 0


def _verify_dcp(path: str, weights_only: bool) -> int:
    """A DCP checkpoint: see :func:`tierstore.dcp.verify`."""
    from tierstore import dcp

    with _progress.bar(_progress.wanted(None), f"verifying {path}") as cb:
        c = dcp.verify(path, weights_only, cb)
    print(
        f"{path}: OK (PyTorch DCP checkpoint: {c['tensors']} tensors in {c['chunks']} chunks and {c['objects']} "
        f"objects read from {c['files']} files, {_human(c['bytes'])}; every chunk's size, shape and dtype match "
        "the metadata and its torch.save CRC-32s hold. DCP keeps no checksums of its own: its .metadata is not "
        "checksummed, so damage that still parses cannot be detected)"
    )
    return 0


def _gpu_line(g: dict[str, Any]) -> str:
    if g["path"] == "shim":
        v = g["runtime_version"]
        devices = ", ".join(g["devices"])
        what = f"the shim ({g['platform']} runtime {v // 1000}.{v % 1000 // 10}, {devices}; {g['library']})"
    elif g["path"] == "torch":
        what = f"torch's pinned copies ({g['reason']})"
    elif g["path"] == "error":
        what = f"error: {g['reason']}"
    else:
        what = f"none ({g['reason']})"
    return f"GPU path:       {what}"


def cmd_info(args: argparse.Namespace) -> int:
    from tierstore._info import info

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
        f"huge pages:     {'yes' if d['huge_pages'] else 'no'} ({d['huge_pages_reason']})",
        _gpu_line(d["gpu"]),
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


def cmd_consolidate(args: argparse.Namespace) -> int:
    from tierstore._tree import flatten
    from tierstore.api import save
    from tierstore.sharded import consolidate

    sd = consolidate(args.dir, weights_only=not args.unsafe)
    save(sd, args.out, progress=None)
    leaves = [leaf.value for leaf in flatten(sd)]
    n = sum(1 for v in leaves if hasattr(v, "shape"))
    print(f"{args.out}: {n} tensors and {len(leaves) - n} objects from {args.dir}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from tierstore import dcp
    from tierstore.sharded import consolidate, save_sharded

    src, dst = args.src, args.dst
    if args.plain:
        from tierstore.codec import convert_plain

        n = convert_plain(src, dst, delta_base=args.delta_base)
        print(f"{dst}: plain copy of {src} ({n} storages decoded), readable by torch.load")
        return 0
    if dcp.is_dcp(src) and not os.path.exists(os.path.join(src, "manifest.json")):
        save_sharded(dcp.to_state_dict(src, weights_only=not args.unsafe, nested=True), dst)
        print(f"{dst}: tierstore sharded checkpoint converted from DCP {src}")
    else:
        dcp.save_dcp(consolidate(src, weights_only=not args.unsafe), dst)
        print(f"{dst}: DCP checkpoint converted from tierstore {src}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from tierstore import _tier_steps

    got = _tier_steps.run_stats([Path(p) for p in args.run])
    if args.json:
        print(json.dumps(got, indent=1))
        return 0
    if not got["tiers"]:
        print(f"tierstore: no committed checkpoint under {' '.join(args.run)}", file=sys.stderr)
        return 1
    for tier, t in got["tiers"].items():
        kinds = f", {t['keyframes']} keyframes, {t['deltas']} deltas" if t["keyframes"] or t["deltas"] else ""
        if t.get("longest_chain", 0) > 1:
            kinds += f" (chains of deltas: the deepest decodes {t['longest_chain']} deltas)"
        print(f"{tier}: {t['steps']} checkpoints{kinds}")
        print(f"  {'class':<22} {'held':>12} {'stored':>12} {'ratio':>7}")
        rows = sorted(t["classes"].items(), key=lambda kv: -kv[1][0])
        for cls, (raw, stored) in [*rows, ("all", (t["raw"], t["stored"]))]:
            r = f"{raw / stored:.2f}x" if stored else "-"
            print(f"  {cls:<22} {_human(raw):>12} {_human(stored):>12} {r:>7}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from tierstore._tier_steps import delete_checkpoint

    for d in args.step_dir:
        delete_checkpoint(d)
        print(f"{d}: deleted")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierstore", description="Inspect, verify and probe tierstore files.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="list the records of a file, with dtypes, shapes and checksum state")
    i.add_argument("file")
    i.add_argument("--no-verify", action="store_true", help="do not read the data to check checksums")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--unsafe", action="store_true", help="DCP metadata: allow globals outside DCP's own classes")
    i.add_argument(
        "--manifest", action="store_true",
        help="sharded checkpoint: print its manifest as one JSON document (an indexed one's sections included)",
    )  # fmt: skip
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("verify", help="check every checksum and everything a load relies on; exit 1 on damage")
    v.add_argument("file")
    v.add_argument("--unsafe", action="store_true", help="allow objects outside torch's weights_only allow-list")
    v.set_defaults(func=cmd_verify)
    c = sub.add_parser("consolidate", help="write one full state dict (.pt) from a sharded checkpoint (or DCP)")
    c.add_argument("dir")
    c.add_argument("out")
    c.add_argument("--unsafe", action="store_true", help="allow objects outside torch's weights_only allow-list")
    c.set_defaults(func=cmd_consolidate)
    cv = sub.add_parser(
        "convert",
        help="convert between PyTorch DCP and tierstore sharded checkpoints; --plain: a compressed file to a plain one",
    )
    cv.add_argument("src")
    cv.add_argument("dst")
    cv.add_argument("--plain", action="store_true", help="write SRC decoded (codec raw), a file torch.load reads")
    cv.add_argument("--delta-base", default=None, help="with --plain: the base file a delta SRC was encoded against")
    cv.add_argument("--unsafe", action="store_true", help="allow objects outside torch's weights_only allow-list")
    cv.set_defaults(func=cmd_convert)
    st = sub.add_parser("stats", help="bytes held and stored over a run, per tier and tensor class (codec tiers)")
    st.add_argument("run", nargs="+", help="a Checkpointer's path, a tier's path or a step directory")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_stats)
    dl = sub.add_parser(
        "delete", help="delete a Checkpointer's step directory; refused while deltas reference it (names them)"
    )
    dl.add_argument("step_dir", nargs="+")
    dl.set_defaults(func=cmd_delete)
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
        print(f"tierstore: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tierstore: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a defect of tierstore, not of the input: say so in one line
        if os.environ.get("TIERSTORE_DEBUG"):
            raise
        print(
            f"tierstore: internal error ({type(e).__name__}: {_one_line(e)}); "
            "please report it (TIERSTORE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 2
    return rc


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:2000]


if __name__ == "__main__":
    sys.exit(main())
