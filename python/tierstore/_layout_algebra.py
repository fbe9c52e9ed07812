"""Layouts and rules (see :mod:`tierstore.layout` for what they describe):
:class:`Layout`, a local tensor's pieces listed; :class:`Rule`, a regular
sharding stored as the rule that makes every rank's pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierstore._boxes import (
    SPLIT_MODES,
    Box,
    Piece,
    Shape,
    Split,
    contiguous_rows,
    flat_range_boxes,
    position_inside,
    squeezed,
)
from tierstore.errors import LayoutError


@dataclass(frozen=True)
class Rule:
    """A regular sharding of one global tensor, the same description for every
    rank that holds part of it: the tensor's ``splits`` applied in order (each
    cuts the block the previous ones left), then optionally ``flat``: the
    block's local tensor flattened and cut into ``flat`` parts of
    ``ceil(numel / flat)`` elements (ZeRO-3 / FSDP1 partitions, padding at
    the end). A rank's position is one index per axis (the splits' counts,
    then ``flat``); ranks at the same position hold replicas, which is
    allowed only when ``replicated``.

    With ``flat_per``, the flat cut is of a buffer several tensors share
    (ZeRO-1/2 partitions of a parameter group): the block's local tensor
    sits at element ``flat_at`` of a buffer cut into ``flat`` parts of
    ``flat_per`` elements, and a position's local tensor is its part of the
    buffer (one such rule per member, the same for every data-parallel rank:
    the flattening order, alignment and world size give every rank's ranges).

    Every position's block is disjoint from the others' and together they
    tile the tensor by construction, so a checkpoint proves coverage once per
    rule (every position present exactly once) instead of per piece, and a
    loading rank finds the positions meeting a box in closed form.
    """

    tensor: str
    shape: Shape
    splits: tuple[Split, ...]
    flat: int = 0
    replicated: bool = False
    flat_at: int = 0
    flat_per: int = 0

    @property
    def axes(self) -> tuple[int, ...]:
        return tuple(s.count for s in self.splits) + ((self.flat,) if self.flat else ())

    def validate(self, what: str = "rule") -> None:
        """Checks that the rule is well formed (so that it tiles its tensor);
        remembered on the rule."""
        if self.__dict__.get("_valid"):
            return
        self._validate(what)
        self.__dict__["_valid"] = True

    def _validate(self, what: str) -> None:
        nd = len(self.shape)
        if not self.tensor or any(n < 0 for n in self.shape) or self.flat < 0:
            raise LayoutError(f"{what}: a rule needs a tensor name, a shape of lengths >= 0 and flat >= 0")
        modes: dict[int, list[str]] = {}
        ext = list(self.shape)
        for i, sp in enumerate(self.splits):
            if not 0 <= sp.dim < nd or sp.count < 1 or sp.mode not in SPLIT_MODES:
                raise LayoutError(f"{what}: split {i} ({sp}) does not cut a dimension of {list(self.shape)}")
            prev = modes.setdefault(sp.dim, [])
            if sp.mode == "pad" and (prev or sp.size < self.shape[sp.dim] or sp.size % sp.count):
                raise LayoutError(f"{what}: split {i}: a padded split is the first of its dimension, padded to "
                                  f"a multiple of {sp.count} at least {self.shape[sp.dim]} long")  # fmt: skip
            if sp.mode == "even" and (any(m != "even" for m in prev) or ext[sp.dim] % sp.count):
                raise LayoutError(f"{what}: split {i}: {ext[sp.dim]} does not cut evenly into {sp.count}")
            if sp.mode == "chunk" and "pad" in prev:
                raise LayoutError(f"{what}: split {i}: a chunked split cannot follow a padded one")
            if sp.mode == "even":
                ext[sp.dim] //= sp.count
            prev.append(sp.mode)
        if self.flat_per or self.flat_at:
            # A member of a shared flat buffer: every position's block has the
            # same local size (no chunked cut), and the buffer holds it.
            if not self.flat or not self.flat_per or any(sp.mode == "chunk" for sp in self.splits):
                raise LayoutError(f"{what}: a flat buffer's member needs flat > 0, flat_per > 0, no chunked split")
            offs, lens, local = [0] * nd, list(self.shape), list(self.shape)
            for sp in self.splits:
                sp.part(0, offs, lens, local)
            if self.flat_at + math.prod(local) > self.flat * self.flat_per:
                raise LayoutError(
                    f"{what}: {math.prod(local)} elements at {self.flat_at} overrun a flat buffer of "
                    f"{self.flat} x {self.flat_per}"
                )

    def _block(self, coords: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        axes = self.__dict__.get("_axes")
        if axes is None:
            axes = self.__dict__["_axes"] = self.axes
        if len(coords) != len(axes):
            raise LayoutError(f"rule of {self.tensor!r}: position {list(coords)} is outside its axes {list(axes)}")
        for c, n in zip(coords, axes, strict=True):
            if not 0 <= c < n:
                raise LayoutError(f"rule of {self.tensor!r}: position {list(coords)} is outside its axes {list(axes)}")
        offs, lens, local = [0] * len(self.shape), list(self.shape), list(self.shape)
        for sp, c in zip(self.splits, coords, strict=False):
            sp.part(c, offs, lens, local)
        return offs, lens, local

    def layout_at(self, coords: Sequence[int]) -> Layout:
        """The layout of the rank at position ``coords`` (its pieces are made
        when first asked for: a save needs only the rule and the position)."""
        coords = tuple(coords)
        _offs, _lens, local = self._block(coords)
        shape = (self.flat_per or -(-math.prod(local) // self.flat),) if self.flat else tuple(local)
        return RuleLayout(shape, None, {self.tensor: self.shape}, self.replicated, frozenset(), self, coords)

    def pieces_at(self, coords: tuple[int, ...]) -> tuple[Piece, ...]:
        """The pieces of the rank at position ``coords``."""
        offs, lens, local = self._block(coords)
        pieces: tuple[Piece, ...] = ()
        if math.prod(lens):
            box = Box.trusted(tuple(offs), tuple(lens))
            pieces = (Piece(self.tensor, box, Box.trusted((0,) * len(lens), tuple(lens))),)
        if not self.flat:
            return pieces
        inner = Layout(tuple(local), pieces, {self.tensor: self.shape})
        n = math.prod(local)
        if self.flat_per:
            # Part coords[-1] of a shared buffer holding the block at flat_at.
            start = coords[-1] * self.flat_per
            lo, hi = max(self.flat_at, start), min(self.flat_at + n, start + self.flat_per)
            if lo >= hi:
                return ()
            return tuple(flat_pieces(inner, lo - self.flat_at, hi - self.flat_at, self.flat_at - start))
        per = -(-n // self.flat)
        a = coords[-1] * per
        return tuple(flat_pieces(inner, a, min(a + per, n), -a)) if a < n else ()

    def coords_meeting(self, box: Box) -> list[tuple[int, ...]]:
        """The positions whose part meets ``box`` (a superset when ``flat``:
        every flat part between the box's first and last element)."""
        nd = len(self.shape)
        states: list[tuple[tuple[int, ...], list[int], list[int], list[int]]] = [
            ((), [0] * nd, list(self.shape), list(self.shape))
        ]
        for sp in self.splits:
            d = sp.dim
            q0, q1 = box.offsets[d], box.offsets[d] + box.lengths[d]
            nxt = []
            for coords, offs, lens, local in states:
                per = sp.per(lens[d])
                if per <= 0 or q1 <= q0:
                    continue
                c0 = max(0, (q0 - offs[d]) // per)
                c1 = min(sp.count - 1, (q1 - 1 - offs[d]) // per)
                for c in range(c0, c1 + 1):
                    o, ln, lc = list(offs), list(lens), list(local)
                    sp.part(c, o, ln, lc)
                    if ln[d] > 0 and o[d] < q1 and o[d] + ln[d] > q0:
                        nxt.append(((*coords, c), o, ln, lc))
            states = nxt
        if not self.flat:
            return [s[0] for s in states]
        out: list[tuple[int, ...]] = []
        for coords, offs, lens, local in states:
            lo = [max(a, b) for a, b in zip(offs, box.offsets, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offs, lens, box.offsets, box.lengths, strict=True)]
            if any(h <= x for x, h in zip(lo, hi, strict=True)):
                continue
            strides = [math.prod(local[i + 1 :]) for i in range(nd)]
            first = sum((x - o) * st for x, o, st in zip(lo, offs, strides, strict=True))
            last = sum((h - 1 - o) * st for h, o, st in zip(hi, offs, strides, strict=True))
            per = self.flat_per or -(-math.prod(local) // self.flat)
            at = self.flat_at if self.flat_per else 0
            out.extend((*coords, f) for f in range((at + first) // per, min(self.flat - 1, (at + last) // per) + 1))
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tensor": self.tensor,
            "shape": list(self.shape),
            "splits": [[s.dim, s.count, s.mode, s.size] for s in self.splits],
            "flat": self.flat,
            "replicated": self.replicated,
        }
        if self.flat_per:
            out["flat_at"] = self.flat_at
            out["flat_per"] = self.flat_per
        return out

    @staticmethod
    def from_json(v: Any) -> Rule:
        """The rule ``v`` describes (:meth:`to_json`), checked; LayoutError if not one."""

        def uint(x: Any) -> int:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise LayoutError(f"rule: {str(x)[:40]!r} is not a non-negative integer")
            return x

        try:
            splits = tuple(
                Split(uint(s[0]), uint(s[1]), str(s[2]), uint(s[3]))
                for s in v["splits"]
                if isinstance(s, list) and len(s) == 4 and isinstance(s[2], str)
            )
            if len(splits) != len(v["splits"]):
                raise LayoutError("rule: a split is not [dim, count, mode, size]")
            name = v["tensor"]
            if not isinstance(name, str) or not isinstance(v["shape"], list) or not isinstance(v["replicated"], bool):
                raise LayoutError("rule: tensor, shape or replicated of the wrong type")
            r = Rule(
                name,
                tuple(uint(x) for x in v["shape"]),
                splits,
                uint(v["flat"]),
                v["replicated"],
                uint(v.get("flat_at", 0)),
                uint(v.get("flat_per", 0)),
            )
        except (KeyError, TypeError) as e:
            raise LayoutError(f"rule: not a rule ({type(e).__name__}: {str(e)[:80]})") from None
        r.validate()
        return r


#: Layouts of whole tensors made by :meth:`Layout.full`, by (name, shape, replicated).
_FULL: dict[tuple[str, tuple[int, ...], bool], Layout] = {}
_FULL_MAX = 1 << 16


@dataclass(frozen=True)
class Layout:
    """Where the elements of one local tensor sit in global tensors.

    ``global_shapes`` gives the logical shape of every global tensor the pieces
    name. ``replicated`` marks pieces that other ranks hold identically (only
    one copy is written). Elements of the local tensor that no piece covers are
    padding.
    """

    local_shape: Shape
    pieces: tuple[Piece, ...]
    global_shapes: Mapping[str, Shape] = field(default_factory=dict)
    replicated: bool = False
    #: Global tensors whose pieces here are replicas of pieces other ranks hold
    #: too (e.g. a TP-replicated norm weight inside a ZeRO flat buffer): only
    #: one copy is referenced by the checkpoint.
    replicated_tensors: frozenset[str] = frozenset()
    #: The regular sharding this layout is one position of, when it is one
    #: (:class:`Rule`; the constructors of even splits, ZeRO-3 partitions and
    #: DTensor placements set it): the checkpoint then stores the rule once
    #: for every rank instead of every rank's pieces.
    rule: Rule | None = None
    #: This rank's position in ``rule`` (one index per axis).
    coords: tuple[int, ...] = ()
    #: A local tensor several rules share (a ZeRO-1/2 partition of a
    #: parameter group: one rule per member, :attr:`Rule.flat_per`): each
    #: member's rule and this rank's position in it, in buffer order.
    rules: tuple[tuple[Rule, tuple[int, ...]], ...] = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self.local_shape == other.local_shape
            and self.pieces == other.pieces
            and dict(self.global_shapes) == dict(other.global_shapes)
            and self.replicated == other.replicated
            and self.replicated_tensors == other.replicated_tensors
            and self.rule == other.rule
            and self.coords == other.coords
            and self.rules == other.rules
        )

    __hash__ = None  # type: ignore[assignment]  # global_shapes is a dict

    def __post_init__(self) -> None:
        if self.rule is not None and self.rule.replicated != self.replicated:
            # dataclasses.replace(layout, replicated=...): the rule follows.
            object.__setattr__(self, "rule", dataclasses.replace(self.rule, replicated=self.replicated))

    def rule_holds(self) -> bool:
        """Whether the layout is exactly its rule's position (False without a
        rule, or when its pieces were changed after the rule was set);
        remembered on the layout."""
        got = self.__dict__.get("_rule_holds")
        if got is None:
            got = False
            if self.rule is not None:
                try:
                    want = self.rule.layout_at(self.coords)
                    got = want.local_shape == self.local_shape and want.pieces == self.pieces
                    got = got and not self.replicated_tensors and dict(self.global_shapes) == dict(want.global_shapes)
                except LayoutError:
                    got = False
            object.__setattr__(self, "_rule_holds", got)
        return got

    def rule_positions(self) -> tuple[tuple[Rule, tuple[int, ...]], ...]:
        """The rule positions that describe this layout exactly: its rule's,
        or those of the rules of a shared buffer (:attr:`rules`) when their
        pieces are exactly the layout's; empty otherwise (explicit pieces)."""
        if self.rule is not None:
            return ((self.rule, self.coords),) if self.rule_holds() else ()
        if not self.rules:
            return ()
        got = self.__dict__.get("_rules_hold")
        if got is None:
            got = False
            try:
                names = [r.tensor for r, _c in self.rules]
                shapes_ok = len(set(names)) == len(names) and dict(self.global_shapes) == {
                    r.tensor: r.shape for r, _c in self.rules
                }
                reps = frozenset(r.tensor for r, _c in self.rules if r.replicated)
                if shapes_ok and not self.replicated and reps == self.replicated_tensors:
                    pieces: list[Piece] = []
                    for r, c in self.rules:
                        r.validate()
                        want = r.layout_at(c)
                        if want.local_shape != self.local_shape:
                            break
                        pieces.extend(want.pieces)
                    else:
                        got = tuple(pieces) == tuple(self.pieces)
            except LayoutError:
                got = False
            object.__setattr__(self, "_rules_hold", got)
        return self.rules if got else ()

    def is_replica(self, p: Piece) -> bool:
        return self.replicated or p.tensor in self.replicated_tensors

    def validate(self, what: str = "layout") -> None:
        if self.rule is not None and self.__dict__.get("_rule_holds"):
            # Made by its rule and never changed: the rule's checks cover it.
            self.rule.validate(what)
            return
        local_numel = math.prod(self.local_shape)
        covered = 0
        for p in self.pieces:
            if p.tensor not in self.global_shapes:
                raise LayoutError(f"{what}: piece names tensor {p.tensor!r} without a global shape")
            g = self.global_shapes[p.tensor]
            if not p.box.within(g):
                raise LayoutError(f"{what}: box {p.box} lies outside {p.tensor!r} of shape {g}")
            if isinstance(p.local, Box):
                if not p.local.within(self.local_shape):
                    raise LayoutError(f"{what}: local box {p.local} lies outside the local shape {self.local_shape}")
                if squeezed(p.local.lengths) != squeezed(p.box.lengths):
                    raise LayoutError(
                        f"{what}: local box {p.local.lengths} and global box {p.box.lengths} of {p.tensor!r} "
                        "differ in shape"
                    )
            else:
                if p.local < 0 or p.local + p.box.numel > local_numel:
                    raise LayoutError(
                        f"{what}: flat piece [{p.local}, +{p.box.numel}) lies outside the local tensor "
                        f"({local_numel} elements)"
                    )
            covered += p.box.numel
        if covered > local_numel:
            raise LayoutError(f"{what}: pieces cover {covered} elements of a local tensor of {local_numel}")

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON values; made once per layout (a layout does not
        change) and shared, so callers must not modify it."""
        got = self.__dict__.get("_json")
        if got is None:
            got = self._to_json()
            object.__setattr__(self, "_json", got)
        return got

    def _to_json(self) -> dict[str, Any]:
        out = {
            "local_shape": list(self.local_shape),
            "global_shapes": {k: list(v) for k, v in self.global_shapes.items()},
            "pieces": [p.to_json() for p in self.pieces],
            "replicated": self.replicated,
            "replicated_tensors": sorted(self.replicated_tensors),
        }
        if self.rule is not None and self.rule_holds():
            out["rule"] = self.rule.to_json()
            out["coords"] = list(self.coords)
        elif self.rule_positions():
            out["rules"] = [[r.to_json(), list(c)] for r, c in self.rules]
        return out

    @staticmethod
    def from_json(v: Mapping[str, Any]) -> Layout:
        rule = Rule.from_json(v["rule"]) if v.get("rule") is not None else None
        rules: list[tuple[Rule, tuple[int, ...]]] = []
        for item in v.get("rules") or ():
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
                raise LayoutError("layout: a shared-buffer rule is not [rule, position]")
            r = Rule.from_json(item[0])
            c = tuple(int(x) for x in item[1])
            if not position_inside(c, r.axes):
                raise LayoutError(f"layout: position {list(c)[:8]} is outside the axes of the rule of {r.tensor!r}")
            rules.append((r, c))
        return Layout(
            local_shape=tuple(int(x) for x in v["local_shape"]),
            pieces=tuple(Piece.from_json(p) for p in v["pieces"]),
            global_shapes={k: tuple(int(x) for x in s) for k, s in v["global_shapes"].items()},
            replicated=bool(v.get("replicated", False)),
            replicated_tensors=frozenset(v.get("replicated_tensors", ())),
            rule=rule,
            coords=tuple(int(x) for x in v.get("coords", ())) if rule is not None else (),
            rules=tuple(rules) if rule is None else (),
        )

    # -- constructors for the common cases ------------------------------------------------------

    @staticmethod
    def full(name: str, shape: Sequence[int], *, replicated: bool = True) -> Layout:
        """The whole global tensor (replicated on every rank by default)."""
        s = tuple(shape)
        key = (name, s, replicated)
        got = _FULL.get(key)
        if got is not None:
            return got
        # Unreplicated, it is the one position of a rule; replicated, each
        # holder is told on its own whether it writes it (writes balanced
        # over the ranks per tensor).
        if not replicated:
            got = Rule(name, s, (), 0, False).layout_at(())
        else:
            got = Layout(s, (Piece(name, Box.whole(s), Box.whole(s)),), {name: s}, replicated)
        # A Checkpointer asks for the same layouts at every save: the one
        # made first (and its JSON, made once) serves them all.
        if len(_FULL) >= _FULL_MAX:
            _FULL.clear()
        _FULL[key] = got
        return got

    @staticmethod
    def block(
        name: str, global_shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], *,
        replicated: bool = False,
    ) -> Layout:  # fmt: skip
        """An n-D block: the local tensor is ``global[offsets : offsets + lengths]``."""
        b = Box(tuple(offsets), tuple(lengths))
        return Layout(tuple(lengths), (Piece(name, b, Box.whole(b.lengths)),), {name: tuple(global_shape)}, replicated)

    @staticmethod
    def shard(
        name: str,
        global_shape: Sequence[int],
        dim: int,
        rank: int,
        world: int,
        *,
        padded_size: int | None = None,
        replicated: bool = False,
    ) -> Layout:
        """Even split of ``dim`` over ``world`` ranks (tensor parallelism).

        With ``padded_size`` (e.g. a vocabulary padded to a multiple of the TP
        degree), each rank holds ``padded_size / world`` rows of which those
        beyond the logical size are padding.
        """
        g = tuple(global_shape)
        size = padded_size if padded_size is not None else g[dim]
        if size % world:
            raise LayoutError(f"{name}: dimension {dim} of size {size} does not split evenly over {world} ranks")
        if padded_size is not None and padded_size < g[dim]:
            raise LayoutError(f"{name}: padded size {padded_size} is smaller than the logical size {g[dim]}")
        if 0 <= rank < world and 0 <= dim < len(g):
            mode = "pad" if padded_size is not None and padded_size != g[dim] else "even"
            return Rule(name, g, (Split(dim, world, mode, size),), 0, replicated).layout_at((rank,))
        per = size // world
        start = rank * per
        local = (*g[:dim], per, *g[dim + 1 :])
        n = max(0, min(per, g[dim] - start))
        if n == 0:
            return Layout(local, (), {name: g}, replicated)
        box = Box(tuple(start if i == dim else 0 for i in range(len(g))), (*g[:dim], n, *g[dim + 1 :]))
        lbox = Box(tuple(0 for _ in g), box.lengths)
        return Layout(local, (Piece(name, box, lbox),), {name: g}, replicated)

    @staticmethod
    def flat(
        name: str, global_shape: Sequence[int], start: int, length: int, *, local_numel: int | None = None
    ) -> Layout:
        """Elements ``[start, start + length)`` of the flattened global tensor,
        held by a 1-D local tensor (FSDP / ZeRO-3 shards). ``local_numel`` may
        exceed ``length`` (padding at the end)."""
        g = tuple(global_shape)
        total = math.prod(g)
        end = min(start + length, total)
        pieces = []
        if end > start:
            for box, off in flat_range_boxes(g, start, end):
                pieces.append(Piece(name, box, off - start))
        return Layout((local_numel if local_numel is not None else length,), tuple(pieces), {name: g})

    @staticmethod
    def concat(parts: Sequence[tuple[Layout, int]], dim: int) -> Layout:
        """Local tensors of ``parts`` concatenated along ``dim`` of the local tensor
        (fused QKV, fused gate/up). Each part is ``(layout, length along dim)``."""
        if not parts:
            raise LayoutError("concat of no parts")
        base = parts[0][0].local_shape
        pieces: list[Piece] = []
        shapes: dict[str, Shape] = {}
        at = 0
        for lay, n in parts:
            if lay.local_shape[:dim] + lay.local_shape[dim + 1 :] != base[:dim] + base[dim + 1 :]:
                raise LayoutError(f"concat: part shapes {lay.local_shape} and {base} differ outside dim {dim}")
            for p in lay.pieces:
                if not isinstance(p.local, Box):
                    raise LayoutError("concat of flat pieces is not supported; concatenate n-D parts")
                off = tuple(o + at if i == dim else o for i, o in enumerate(p.local.offsets))
                pieces.append(Piece(p.tensor, p.box, Box(off, p.local.lengths)))
            shapes.update(lay.global_shapes)
            at += n
        local = (*base[:dim], at, *base[dim + 1 :])
        return Layout(local, tuple(pieces), shapes, all(lay.replicated for lay, _ in parts))

    @staticmethod
    def stack(parts: Sequence[Layout]) -> Layout:
        """Local tensors of ``parts`` stacked on a new leading dimension (BOOST's
        stacked up factors ``[g, out/tp, r]``)."""
        if not parts:
            raise LayoutError("stack of no parts")
        base = parts[0].local_shape
        pieces: list[Piece] = []
        shapes: dict[str, Shape] = {}
        for i, lay in enumerate(parts):
            if lay.local_shape != base:
                raise LayoutError(f"stack: part shapes {lay.local_shape} and {base} differ")
            for p in lay.pieces:
                if not isinstance(p.local, Box):
                    raise LayoutError("stack of flat pieces is not supported")
                pieces.append(Piece(p.tensor, p.box, Box((i, *p.local.offsets), (1, *p.local.lengths))))
            shapes.update(lay.global_shapes)
        return Layout((len(parts), *base), tuple(pieces), shapes, all(lay.replicated for lay in parts))

    @staticmethod
    def flat_buffer(
        params: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], Box] | Layout],
        start: int,
        length: int,
        *,
        local_numel: int | None = None,
    ) -> Layout:
        """``[start, start + length)`` of a flat buffer that concatenates the
        flattened ``params`` in order (ZeRO-1/2 partitions, FSDP flat
        parameters); anything past the last parameter is padding.

        Each param is ``(global name, global shape)``, ``(global name, global
        shape, box)`` when this rank holds only a box of the global tensor (a
        tensor-parallel shard), or the :class:`Layout` of a local parameter
        (e.g. a fused QKV weight), flattened in its local C order.
        """
        pieces: list[Piece] = []
        shapes: dict[str, Shape] = {}
        reps: set[str] = set()
        pos = 0
        end = start + length
        for param in params:
            lay = param if isinstance(param, Layout) else box_layout(param)
            shapes.update(lay.global_shapes)
            reps.update(lay.global_shapes if lay.replicated else lay.replicated_tensors)
            n = math.prod(lay.local_shape)
            lo, hi = max(start, pos), min(end, pos + n)
            if lo < hi:
                pieces.extend(flat_pieces(lay, lo - pos, hi - pos, pos - start))
            pos += n
        return Layout(
            (local_numel if local_numel is not None else length,),
            tuple(pieces),
            shapes,
            replicated_tensors=frozenset(reps),
        )

    def renamed(self, fn: Any) -> Layout:
        """The same layout with every global tensor name passed through ``fn``."""
        return Layout(
            self.local_shape,
            tuple(Piece(fn(p.tensor), p.box, p.local) for p in self.pieces),
            {fn(k): v for k, v in self.global_shapes.items()},
            self.replicated,
            frozenset(fn(k) for k in self.replicated_tensors),
        )


class RuleLayout(Layout):
    """A position of a :class:`Rule` (made by :meth:`Rule.layout_at`) whose
    pieces are made when first asked for."""

    def __init__(
        self,
        local_shape: Shape,
        pieces: Sequence[Piece] | None = None,
        global_shapes: Mapping[str, Shape] | None = None,
        replicated: bool = False,
        replicated_tensors: frozenset[str] = frozenset(),
        rule: Rule | None = None,
        coords: tuple[int, ...] = (),
        rules: tuple[tuple[Rule, tuple[int, ...]], ...] = (),
    ) -> None:
        d = self.__dict__  # frozen: the fields are set as the dataclass's own __init__ does
        d["local_shape"] = tuple(local_shape)
        d["global_shapes"] = global_shapes if global_shapes is not None else {}
        d["replicated"] = replicated
        d["replicated_tensors"] = frozenset(replicated_tensors)
        d["rule"] = rule
        d["coords"] = tuple(coords)
        d["rules"] = tuple(rules)
        if pieces is not None:  # dataclasses.replace(): given pieces, checked by rule_holds
            self.__dict__["_pieces"] = tuple(pieces)
        else:
            self.__dict__["_rule_holds"] = True  # made from the rule
        if rule is None:
            self.__dict__["_pieces"] = tuple(pieces or ())
        self.__post_init__()

    @property
    def pieces(self) -> tuple[Piece, ...]:
        got = self.__dict__.get("_pieces")
        if got is None:
            assert self.rule is not None
            got = self.__dict__["_pieces"] = self.rule.pieces_at(self.coords)
        return got


def is_whole(lay: Layout) -> bool:
    """Whether ``lay`` is one whole global tensor (:meth:`Layout.full`)."""
    if len(lay.pieces) != 1 or lay.replicated_tensors:
        return False
    p = lay.pieces[0]
    whole = Box.whole(lay.local_shape)
    return p.box == whole and p.local == whole and lay.global_shapes.get(p.tensor) == lay.local_shape


def box_layout(param: tuple[str, Sequence[int]] | tuple[str, Sequence[int], Box]) -> Layout:
    name, shape = param[0], tuple(param[1])
    region = param[2] if len(param) > 2 else Box.whole(shape)
    return Layout(region.lengths, (Piece(name, region, Box.whole(region.lengths)),), {name: shape})


def flat_pieces(lay: Layout, a: int, b: int, shift: int) -> list[Piece]:
    """Flat pieces for elements ``[a, b)`` of ``lay``'s local tensor (C order),
    placed at ``shift + position`` in a flat buffer."""
    out: list[Piece] = []
    lshape = lay.local_shape
    lstr = [math.prod(lshape[i + 1 :]) for i in range(len(lshape))]
    for p in lay.pieces:
        if not isinstance(p.local, Box):
            # A flat piece inside a flat local tensor: a plain interval shift.
            lo, hi = max(a, p.local), min(b, p.local + p.box.numel)
            if lo < hi:
                for box, off in flat_range_boxes(p.box.lengths, lo - p.local, hi - p.local):
                    moved = Box(tuple(x + y for x, y in zip(box.offsets, p.box.offsets, strict=True)), box.lengths)
                    out.append(Piece(p.tensor, moved, shift + p.local + off))
            continue
        gdims = [d for d in range(len(p.box.lengths)) if p.box.lengths[d] != 1]
        ldims = [d for d in range(len(lshape)) if p.local.lengths[d] != 1]
        for cbox, _off in flat_range_boxes(lshape, a, b):
            inter = cbox.intersect(p.local)
            if inter is None:
                continue
            # Rows of the intersection are consecutive in the local C order;
            # whole blocks are when the piece spans the trailing dimensions.
            for row in contiguous_rows(inter, p.local, lshape):
                first = sum(o * st for o, st in zip(row.offsets, lstr, strict=True))
                goff = list(p.box.offsets)
                glen = list(p.box.lengths)
                for g, ld in zip(gdims, ldims, strict=True):
                    goff[g] = p.box.offsets[g] + row.offsets[ld] - p.local.offsets[ld]
                    glen[g] = row.lengths[ld]
                out.append(Piece(p.tensor, Box(tuple(goff), tuple(glen)), shift + first))
    return out
