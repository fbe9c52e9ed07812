"""Layouts of common parallel schemes: ZeRO flat partitions, tensor-parallel
rows, columns, vocabularies and fused groups, BOOST's low-rank factors,
expert slices, pipeline stages (re-exported by :mod:`tierstore.layout`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tierstore._boxes import Box, Piece, Shape
from tierstore._layout_algebra import Layout, Rule, box_layout, is_whole
from tierstore.errors import LayoutError

# -- layouts of common parallel schemes -------------------------------------------------------


def zero_partition(
    params: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], Box] | Layout],
    dp_rank: int,
    dp_size: int,
    *,
    stage: int,
    alignment_factor: int = 2,
) -> Layout:
    """The layout of this data-parallel rank's flat optimizer partition,
    partitioned exactly as DeepSpeed does.

    - ZeRO-1/2: the params are flattened into one buffer padded to a multiple
      of ``alignment_factor * dp_size`` (DeepSpeed's NCCL start alignment),
      then split into ``dp_size`` equal partitions.
    - ZeRO-3: each param is partitioned on its own into ``ceil(numel / dp)``
      elements per rank (padding at the end of the last ranks' parts), and a
      rank's partitions are concatenated.

    ``params`` are ``(global name, global shape[, box of it held locally])``
    or the layouts of the local parameters, in the optimizer's order.
    """
    sizes = [math.prod(p.local_shape) if isinstance(p, Layout) else box_layout(p).pieces[0].box.numel for p in params]
    if stage in (1, 2):
        total = sum(sizes)
        align = alignment_factor * dp_size
        padded = -(-total // align) * align
        part = padded // dp_size
        lay = Layout.flat_buffer(params, dp_rank * part, part)
        members = _member_rules(params, dp_size, part) if 0 <= dp_rank < dp_size else None
        if members:
            # One rule per member, the same on every data-parallel rank: the
            # checkpoint stores the group once, not every rank's ranges.
            lay = dataclasses.replace(lay, rules=tuple((r, (*c, dp_rank)) for r, c in members))
            if not lay.rule_positions():
                lay = dataclasses.replace(lay, rules=())
        return lay
    if stage == 3:
        one = params[0] if len(params) == 1 else None
        rule = one.rule if isinstance(one, Layout) else None
        if isinstance(one, tuple) and len(one) == 2:
            rule, one = Rule(one[0], tuple(one[1]), ()), Layout.full(one[0], one[1], replicated=False)
        elif isinstance(one, Layout) and rule is None and is_whole(one):
            rule = Rule(one.pieces[0].tensor, one.local_shape, (), 0, one.replicated)
        if rule is not None and not rule.flat and isinstance(one, Layout) and 0 <= dp_rank < dp_size:
            # One parameter of a regular sharding: the partition is a position of its rule.
            return Rule(rule.tensor, rule.shape, rule.splits, dp_size, rule.replicated).layout_at(
                (*one.coords, dp_rank)
            )
        pieces: list[Piece] = []
        shapes: dict[str, Shape] = {}
        reps: set[str] = set()
        at = 0
        for param, n in zip(params, sizes, strict=True):
            ps = -(-n // dp_size)
            sub = Layout.flat_buffer([param], dp_rank * ps, ps)
            for p in sub.pieces:
                assert isinstance(p.local, int)
                pieces.append(Piece(p.tensor, p.box, p.local + at))
            shapes.update(sub.global_shapes)
            reps.update(sub.replicated_tensors)
            at += ps
        return Layout((at,), tuple(pieces), shapes, replicated_tensors=frozenset(reps))
    raise LayoutError(f"ZeRO stage must be 1, 2 or 3, not {stage}")


def _member_rules(
    params: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], Box] | Layout], dp_size: int, part: int
) -> list[tuple[Rule, tuple[int, ...]]] | None:
    """The rules of the members of a flat buffer cut into ``dp_size`` parts
    of ``part`` elements, and each member's position before the cut; None
    when a member is not a regular sharding every rank cuts alike (explicit
    pieces, a chunked split, a layout of several tensors)."""
    out: list[tuple[Rule, tuple[int, ...]]] = []
    pos = 0
    for param in params:
        if isinstance(param, Layout):
            rule, coords = param.rule, param.coords
            if rule is None and is_whole(param):
                rule, coords = Rule(param.pieces[0].tensor, param.local_shape, (), 0, param.replicated), ()
            elif rule is None or not param.rule_holds() or param.replicated_tensors:
                return None
            n = math.prod(param.local_shape)
        elif len(param) == 2:
            rule, coords = Rule(param[0], tuple(param[1]), ()), ()
            n = math.prod(param[1])
        else:
            return None
        if rule.flat or any(sp.mode == "chunk" for sp in rule.splits):
            return None
        out.append((dataclasses.replace(rule, flat=dp_size, flat_at=pos, flat_per=part), coords))
        pos += n
    return out


def tp_column(name: str, shape: Sequence[int], tp_rank: int, tp: int) -> Layout:
    """Megatron column-parallel weight or bias: split on dimension 0."""
    return Layout.shard(name, shape, 0, tp_rank, tp)


def tp_row(name: str, shape: Sequence[int], tp_rank: int, tp: int) -> Layout:
    """Megatron row-parallel weight: split on dimension 1."""
    return Layout.shard(name, shape, 1, tp_rank, tp)


def tp_vocab(name: str, shape: Sequence[int], tp_rank: int, tp: int, *, divisible_by: int = 1) -> Layout:
    """Vocabulary-parallel embedding or output layer: the vocabulary (dim 0) is
    padded to a multiple of ``divisible_by * tp`` and split; the padding rows
    are not part of the logical tensor."""
    v = shape[0]
    mult = divisible_by * tp
    return Layout.shard(name, shape, 0, tp_rank, tp, padded_size=-(-v // mult) * mult)


def tp_fused_qkv(
    prefix: str, n_heads: int, n_kv_heads: int, head_dim: int, hidden: int, tp_rank: int, tp: int
) -> Layout:
    """Megatron's fused QKV weight with grouped-query attention on one TP rank.

    The fused tensor interleaves, per KV group, the group's query heads, then
    its key head, then its value head; TP ranks hold whole groups. The pieces
    point at the logical ``{prefix}.q.weight`` ``[n_heads*hd, d]``,
    ``{prefix}.k.weight`` and ``{prefix}.v.weight`` ``[n_kv_heads*hd, d]``.
    """
    if n_heads % n_kv_heads or n_kv_heads % tp:
        raise LayoutError("n_heads must be a multiple of n_kv_heads, and n_kv_heads of the TP degree")
    qpg = n_heads // n_kv_heads
    groups = n_kv_heads // tp
    rows = (qpg + 2) * head_dim
    q, k, v = f"{prefix}.q.weight", f"{prefix}.k.weight", f"{prefix}.v.weight"
    shapes = {q: (n_heads * head_dim, hidden), k: (n_kv_heads * head_dim, hidden), v: (n_kv_heads * head_dim, hidden)}
    pieces = []
    for j in range(groups):
        g = tp_rank * groups + j
        base = j * rows
        qrows = qpg * head_dim
        pieces.append(Piece(q, Box((g * qrows, 0), (qrows, hidden)), Box((base, 0), (qrows, hidden))))
        pieces.append(Piece(k, Box((g * head_dim, 0), (head_dim, hidden)), Box((base + qrows, 0), (head_dim, hidden))))
        pieces.append(
            Piece(v, Box((g * head_dim, 0), (head_dim, hidden)), Box((base + qrows + head_dim, 0), (head_dim, hidden)))
        )
    return Layout((groups * rows, hidden), tuple(pieces), shapes)


def tp_fused_swiglu(prefix: str, ffn: int, hidden: int, tp_rank: int, tp: int) -> Layout:
    """Megatron's fused gate/up (``linear_fc1``) weight on one TP rank: this
    rank's gate rows, then its up rows, of ``{prefix}.gate.weight`` and
    ``{prefix}.up.weight`` ``[ffn, d]``."""
    per = ffn // tp
    gate = tp_column(f"{prefix}.gate.weight", (ffn, hidden), tp_rank, tp)
    up = tp_column(f"{prefix}.up.weight", (ffn, hidden), tp_rank, tp)
    return Layout.concat([(gate, per), (up, per)], 0)


def boost_fused_down(names: Sequence[str], rank_dim: int, hidden: int, tp_rank: int, tp: int) -> Layout:
    """BOOST's fused down factors ``[g*r, d/tp]``: the ``[r, d]`` factors
    ``names`` sharded on the hidden dimension, stacked on the rank dimension."""
    parts = [(Layout.shard(n, (rank_dim, hidden), 1, tp_rank, tp), rank_dim) for n in names]
    return Layout.concat(parts, 0)


def boost_stacked_up(names: Sequence[str], out: int, rank_dim: int, tp_rank: int, tp: int) -> Layout:
    """BOOST's stacked up factors ``[g, out/tp, r]``: the ``[out, r]`` factors
    ``names`` sharded on the output dimension (the rank is never split)."""
    return Layout.stack([Layout.shard(n, (out, rank_dim), 0, tp_rank, tp) for n in names])


def expert_slice(name: str, shape: Sequence[int], ep_rank: int, ep: int) -> Layout:
    """Expert parallelism: the experts (dimension 0) split over EP ranks."""
    return Layout.shard(name, shape, 0, ep_rank, ep)


def pipeline_layers(stage: int, pp: int, n_layers: int) -> range:
    """Global layer numbers held by a pipeline stage (even split)."""
    per = n_layers // pp
    return range(stage * per, (stage + 1) * per)
