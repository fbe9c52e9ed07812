"""How a state dict is flattened into keys, and rebuilt from them.

The rules are DCP's (``torch.distributed.checkpoint``'s ``traverse_state_dict``
and ``flatten_state_dict``), so that one target state dict addresses the same
values in a DCP checkpoint and in a tierstore one:

- a mapping is walked, its keys joined to the prefix with ``"."`` (``str(k)``);
- a list is walked (its indices become keys) only when it holds a tensor, or
  a mapping, or a list that is itself walked; otherwise it is one value;
- everything else (tuples included) is one value (a leaf).

``optimizer.state_dict()`` therefore becomes ``optim.state.0.exp_avg`` (a
tensor record), ``optim.param_groups.0.lr`` (an object) and so on.

For tierstore's own checkpoints two cases stay one value where DCP would walk
them, because walking them would lose what the user had: an empty mapping
(there is nothing to walk, but ``{}`` must come back), and a mapping whose
keys are not all ``str`` or ``int`` or whose keys collide once made strings
(``{1: a, "1": b}``, tuple keys).

A leaf's *path* says how to rebuild the nesting: JSON-able items, a string
for a mapping's string key, ``{"int": n}`` for a mapping's integer key, an
integer for a list index (DCP's ``planner_data`` paths use the same string and
integer items).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.errors import InvalidArgumentError

PathItem = str | int | dict[str, int]


@dataclass
class Leaf:
    """One value of a flattened state dict: its flat ``key``, the value, where
    it lives (``parent[slot]``) and its ``path`` (see the module doc)."""

    key: str
    value: Any
    parent: Any
    slot: Any
    path: tuple[PathItem, ...]


def _item_text(item: PathItem) -> str:
    if isinstance(item, dict):
        return str(item["int"])
    return str(item)


def key_of(path: tuple[PathItem, ...] | list[PathItem]) -> str:
    """The flat key of ``path`` (its items joined by ``"."``)."""
    return ".".join(_item_text(i) for i in path)


def is_plain(path: tuple[PathItem, ...] | list[PathItem]) -> bool:
    """Whether ``path`` is what splitting its key at ``"."`` gives (so it need not be stored)."""
    return all(isinstance(i, str) and "." not in i and i for i in path)


def _walk_mapping(v: Mapping[Any, Any], dcp: bool) -> bool:
    if dcp:
        return True
    if not v:
        return False
    seen: set[str] = set()
    for k in v:
        if not (isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))):
            return False
        seen.add(str(k))
    return len(seen) == len(v)


def _walk_list(v: list[Any]) -> bool:
    """DCP's rule: a list is walked when an entry is a tensor, a mapping, or a
    list that is walked."""
    return any(isinstance(e, (torch.Tensor, Mapping)) or (isinstance(e, list) and _walk_list(e)) for e in v)


def walks(v: Any, dcp: bool = False) -> bool:
    """Whether ``v`` is walked into (is not one value)."""
    if isinstance(v, Mapping):
        return _walk_mapping(v, dcp)
    if isinstance(v, list):
        return _walk_list(v)
    return False


def child(prefix: str, k: Any) -> str:
    """The flat key of entry ``k`` under ``prefix``."""
    return f"{prefix}.{k}" if prefix else str(k)


def flatten(sd: Mapping[Any, Any], *, dcp: bool = False, where: str = "state dict") -> Iterator[Leaf]:
    """Every leaf of ``sd`` under the rules above (``dcp=True``: DCP's exactly).
    Raises ``ValueError`` when two leaves get the same key (``{"a.b": x, "a":
    {"b": y}}``), as DCP does."""
    seen: set[str] = set()

    def visit(v: Any, parent: Any, slot: Any, path: tuple[PathItem, ...]) -> Iterator[Leaf]:
        if isinstance(v, Mapping) and walks(v, dcp):
            for k, x in v.items():
                item: PathItem = str(k) if dcp else (k if isinstance(k, str) else {"int": k})
                yield from visit(x, v, k, (*path, item))
        elif isinstance(v, list) and walks(v, dcp):
            for i, x in enumerate(v):
                yield from visit(x, v, i, (*path, i))
        else:
            key = key_of(path)
            if key in seen:
                raise InvalidArgumentError(f"{where}: two values flatten to the key {key!r}")
            seen.add(key)
            yield Leaf(key, v, parent, slot, path)

    for k, v in sd.items():
        int_key = isinstance(k, int) and not isinstance(k, bool)
        first: PathItem = {"int": k} if int_key and not dcp else str(k)
        yield from visit(v, sd, k, (first,))


def set_path(
    root: MutableMapping[Any, Any], path: tuple[PathItem, ...] | list[PathItem], value: Any
) -> tuple[Any, Any]:
    """Sets ``value`` at ``path`` in ``root``, making the mappings and lists on
    the way (as DCP's ``set_element``, with ``{"int": n}`` for integer keys).
    Returns the container and the key or index it was set under."""

    def key(item: PathItem) -> Any:
        return item["int"] if isinstance(item, dict) else item

    def place(cur: Any, item: PathItem, fresh: Any) -> Any:
        if isinstance(cur, list):
            if not isinstance(item, int):
                raise InvalidArgumentError(f"path item {item!r} indexes a list")
            while len(cur) <= item:
                cur.append(None)
            if cur[item] is None:
                cur[item] = fresh
            return cur[item]
        return cur.setdefault(key(item), fresh)

    cur: Any = root
    for i in range(len(path) - 1):
        cur = place(cur, path[i], [] if type(path[i + 1]) is int else {})
        if not isinstance(cur, (list, MutableMapping)):
            raise InvalidArgumentError(f"path {list(path)!r} goes through a value")
    last = path[-1]
    place(cur, last, None)
    slot = last if isinstance(cur, list) else key(last)
    cur[slot] = value
    return cur, slot


def check_path(p: Any, key: str) -> tuple[PathItem, ...] | None:
    """``p`` as a path of ``key``, or None when it is not one (for the
    callers' error messages)."""
    if not isinstance(p, (list, tuple)) or not p or len(p) > 1024:
        return None
    out: list[PathItem] = []
    for i, item in enumerate(p):
        if isinstance(item, str) or (
            isinstance(item, int) and not isinstance(item, bool) and 0 <= item < (1 << 31) and i > 0
        ):
            out.append(item)
        elif (
            isinstance(item, dict)
            and list(item) == ["int"]
            and isinstance(item["int"], int)
            and not isinstance(item["int"], bool)
        ):
            out.append({"int": item["int"]})
        else:
            return None
    if key_of(out) != key:
        return None
    return tuple(out)


def split_key(key: str) -> tuple[PathItem, ...]:
    """The path of a key saved without one (its parts are string keys)."""
    return tuple(key.split("."))
