"""Rank 0's side of a sharded save's commit: ``manifest.json`` built from
what the ranks hold (their files' records, the writers decided), rule-based
layouts stored as their rules with each position's file (a grid where the
files follow the mesh), every rule's positions proven to tile its tensor
before anything is written.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tierstore.errors import LayoutError, TierstoreError
from tierstore.layout import Box, Rule
from tierstore.layout import position_inside as _inside
from tierstore.reshard import CoverageError, overlapping_pair
from tierstore.shardmeta import (
    FORMAT,
    FORMAT_VERSION,
    Grid,
    grid_min,
)

# The load side and the optimizer-state helpers live in their own modules; their
# names are this module's public surface too.


def build_manifest(
    d: Path,
    save_id: str,
    world: int,
    infos: list[dict[str, Any]],
    metas: list[dict[str, Any]] | None = None,
    decisions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """On rank 0: the manifest of the checkpoint from what every rank reported
    (``infos``; ``metas`` and ``decisions``: the holdings gathered before
    writing and rank 0's decisions on them, which place the positions of
    rules). Proves that the saved pieces tile every global tensor."""
    from tierstore import __version__

    files: list[dict[str, Any]] = []
    stored: list[dict[str, Any]] = []
    globals_: dict[str, dict[str, Any]] = {}
    file_of_rank: dict[int, int] = {}
    for info in infos:
        if not info.get("file"):
            continue
        fidx = len(files)
        file_of_rank[info["rank"]] = fidx
        files.append(
            {
                "rank": info["rank"],
                "name": info["file"],
                "bytes": info["bytes"],
                "manifest_crc32": info["manifest_crc32"],
            }
        )
        for key, t in sorted(info["tensors"].items()):
            sidx = len(stored)
            stored.append({"file": fidx, "key": key, **{k: v for k, v in t.items() if k != "layout"}})
            # The layout as the writing rank's own code serialised it (Layout.to_json).
            lay = t["layout"]
            shapes = lay["global_shapes"]
            every = bool(lay.get("replicated", False))
            some = set(lay.get("replicated_tensors", ()))
            for pj in lay["pieces"]:
                name = pj["tensor"]
                g = globals_.get(name)
                if g is None:
                    g = globals_[name] = {"shape": list(shapes[name]), "dtype": t["dtype"], "pieces": []}
                elif list(shapes[name]) != g["shape"]:
                    raise LayoutError(
                        f"global tensor {name!r} has shape {g['shape']} on one rank and {list(shapes[name])} on another"
                    )
                local = pj["local_box"] if "local_box" in pj else pj["local_flat"]
                g["pieces"].append([sidx, pj["box"], local, every or name in some])
            for name, shape in shapes.items():
                globals_.setdefault(name, {"shape": list(shape), "dtype": t["dtype"], "pieces": []})
    groups = _place_rules(globals_, infos, metas or [], decisions or [], file_of_rank)
    # Replicas of one box (held by several ranks) are referenced once.
    for g in globals_.values():
        if "rule" in g:
            continue
        kept: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]] = {}
        pieces = []
        for pc in g["pieces"]:
            key = (tuple(pc[1][0]), tuple(pc[1][1]))
            if key in kept:
                if not (pc[3] and kept[key][3]):
                    pieces.append(pc)  # a genuine overlap: reported below
                continue
            kept[key] = pc
            pieces.append(pc)
        g["pieces"] = [pc[:3] for pc in pieces]
    # Every global tensor must be covered exactly once by what was written
    # (a rule's tensors: every position of the rule placed once, above).
    for name, g in globals_.items():
        if "rule" in g:
            continue
        want = math.prod(g["shape"])
        ps = g["pieces"]
        if len(ps) == 1 and ps[0][1][1] == g["shape"] and not any(ps[0][1][0]):
            continue  # one piece, the whole tensor
        boxes = [Box.from_json(p[1]) for p in ps]
        total = sum(b.numel for b in boxes)
        if total != want or overlapping_pair(boxes) is not None:
            raise CoverageError(
                f"save: global tensor {name!r} of shape {tuple(g['shape'])}: the ranks' pieces cover {total} of "
                f"{want} elements{' and overlap' if total >= want else ''}; check the layouts"
            )
    objects = {}
    per_rank: dict[str, dict[str, str]] = {}
    object_files = []
    for info in infos:
        if info.get("objects_file"):
            object_files.append(
                {
                    "name": info["objects_file"],
                    "bytes": info["objects_bytes"],
                    "manifest_crc32": info["objects_manifest_crc32"],
                }
            )
            for k in info["object_keys"]:
                if k in info.get("per_rank_keys", []):
                    per_rank.setdefault(k, {})[str(info["rank"])] = info["objects_file"]
                else:
                    objects[k] = info["objects_file"]
    paths: dict[str, Any] = {}
    for info in infos:
        paths.update(info.get("paths", {}))
    held = {s["key"] for s in stored} | set(objects) | set(per_rank)
    held.update(key for g in globals_.values() for _gi, key in g.get("parts", ()))
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "writer": f"tierstore {__version__}",
        "created_unix": round(time.time(), 3),
        "save_id": save_id,
        "world_size": world,
        "files": files,
        "stored": stored,
        "tensors": globals_,
        "groups": groups,
        "objects": objects,
        "per_rank_objects": per_rank,
        "object_files": object_files,
    }
    # Paths of the keys whose nesting their dotted key does not tell (list
    # indices, integer keys, keys with dots), for a load that rebuilds it.
    rebuild = {k: p for k, p in paths.items() if k in held}  # in the state dict's order, for a rebuild
    if rebuild:
        out["paths"] = rebuild
    return out


def _place_rules(
    globals_: dict[str, dict[str, Any]],
    infos: list[dict[str, Any]],
    metas: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    file_of_rank: dict[int, int],
) -> list[dict[str, Any]]:
    """The global tensors of rules (added to ``globals_``) and their groups:
    per distinct rule table, the position of each writing rank and its file.
    Proves coverage per rule: every position of its axes placed exactly once,
    and positions held by several ranks only for replicated rules."""
    tables: dict[str, list[Any]] = {}
    for info in infos:
        tables.update(info.get("rules", {}))
    placed: dict[str, dict[tuple[int, ...], int]] = {}
    holders: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for r, m in enumerate(metas):
        skipped = {(tuple(c), dg) for c, dg in decisions[r].get("skip_groups", ())} if r < len(decisions) else set()
        for g in m.get("groups", ()):
            coords, dg = tuple(g[0]), g[1]
            holders.setdefault(dg, {}).setdefault(coords, []).append(r)
            if (coords, dg) not in skipped:
                if r not in file_of_rank:
                    raise TierstoreError(f"rank {r} was to write position {list(coords)} of a rule but wrote no file")
                placed.setdefault(dg, {})[coords] = file_of_rank[r]
    out: list[dict[str, Any]] = []
    positions: dict[str, list[list[tuple[int, ...]]]] = {}
    parsed: dict[str, Rule] = {}
    for dg, where in sorted(placed.items()):
        entries = tables.get(dg)
        if entries is None:
            raise TierstoreError(f"no rank described the rule table {dg} (its holders: {sorted(holders[dg])[:4]})")
        gi = len(out)
        coords_list = sorted(where)
        grid = Grid.of(coords_list, [where[c] for c in coords_list]) if len(coords_list) >= grid_min() else None
        # A group filling a grid with files in mesh order is stored as the grid
        # and the map (O(1) bytes), any other as its list of positions.
        out.append(
            grid.to_json()
            if grid is not None
            else {"coords": [list(c) for c in coords_list], "files": [where[c] for c in coords_list]}
        )
        shared = [c for c, hs in holders[dg].items() if len(hs) > 1]
        for key, rj, dtype in entries:
            rule = Rule.from_json(rj)
            parsed[rule.tensor] = rule
            if shared and not rule.replicated:
                c = shared[0]
                raise CoverageError(
                    f"save: global tensor {rule.tensor!r}: ranks {holders[dg][c][:2]} both hold position {list(c)} "
                    "of its sharding rule and it is not replicated; check the layouts"
                )
            have = globals_.get(rule.tensor)
            if have is None:
                globals_[rule.tensor] = {"shape": list(rule.shape), "dtype": dtype, "rule": rj, "parts": [[gi, key]]}
                positions[rule.tensor] = [coords_list]
            elif "rule" in have and have["rule"] == rj and have["dtype"] == dtype:
                # More positions of the rule, held under another key (one process
                # holding several positions) or by ranks of another rule table.
                have["parts"].append([gi, key])
                positions[rule.tensor].append(coords_list)
            else:
                raise CoverageError(
                    f"save: global tensor {rule.tensor!r} is described by two layouts that do not agree "
                    f"(key {key!r}: {json.dumps(rj)[:200]}); check the layouts"
                )
    proven: set[tuple[tuple[int, ...], tuple[int, ...], bool]] = set()
    for name, parts in positions.items():
        g = globals_[name]
        rule = parsed[name]
        memo = (tuple(p[0] for p in g["parts"]), rule.axes, rule.replicated)  # the same groups, the same proof
        if memo not in proven:
            _prove_positions(rule, parts)
            proven.add(memo)
        if len(parts) > 1 and rule.replicated:
            g["parts"] = _drop_replicas(g["parts"], parts)
    return out


def _drop_replicas(refs: list[list[Any]], parts: list[list[tuple[int, ...]]]) -> list[list[Any]]:
    """Of the parts of a replicated rule's tensor (a tied weight held by two
    pipeline stages), those that add positions not held before."""
    seen: set[tuple[int, ...]] = set()
    keep = []
    for ref, coords in zip(refs, parts, strict=True):
        if not seen.issuperset(coords):
            keep.append(ref)
            seen.update(coords)
    return keep


def _prove_positions(rule: Rule, parts: list[list[tuple[int, ...]]]) -> None:
    """Every position of ``rule``'s axes is held exactly once by ``parts``
    (each a sorted list of distinct positions; a replicated rule's parts may
    repeat positions): with the rule's own proof of tiling, its pieces then
    cover the tensor exactly."""
    axes = rule.axes
    want = math.prod(axes)
    if len(parts) == 1:
        got: Any = parts[0]
        count = len(got)
    else:
        got = {c for p in parts for c in p} if rule.replicated else [c for p in parts for c in p]
        count = len(got) if rule.replicated else len(set(got))
        if not rule.replicated and count != len(got):
            raise CoverageError(f"save: global tensor {rule.tensor!r}: a position of its sharding rule is held twice")
    if count != want or not all(_inside(c, axes) for c in got):
        raise CoverageError(
            f"save: global tensor {rule.tensor!r} of shape {tuple(rule.shape)}: its sharding rule has {want} "
            f"positions (axes {list(axes)}) and {count} were written; check the layouts"
        )
