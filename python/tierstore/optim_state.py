"""Optimizer state that follows its parameters: a state dict keyed by
parameter name, each state tensor carrying its parameter's layout, so that
any optimizer's state reshards with its parameter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierstore.layout import Layout, attach, layout_of


def optim_name(state: str, param: str) -> str:
    """Global name of optimizer state ``state`` (exp_avg, momentum_buffer, step, ...) of ``param``."""
    return f"optim.{state}.{param}"


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    named_params: Any,
    layouts: Mapping[str, Layout] | None = None,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, each state tensor carrying
    its parameter's layout (renamed to ``optim.<state>.<param>``), so that any
    optimizer's state (Adam's moments, Muon's momentum, step counts) reshards
    with its parameter. Scalar states are replicated.

    ``named_params`` is ``model.named_parameters()`` (or pairs in the
    optimizer's parameter order); ``layouts`` gives the layout of parameters
    that are shards (defaults to the layout attached to each parameter).
    """
    pairs = list(named_params)
    by_id = {id(p): (n, p) for n, p in pairs}
    sd = optimizer.state_dict()
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    out_state: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        name, param = by_id[ids[idx]]
        lay = (layouts or {}).get(name) or layout_of(param) or Layout.full(name, tuple(param.shape))
        entry: dict[str, Any] = {}
        for sname, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape):
                entry[sname] = _attach_copy(v, lay.renamed(lambda n, s=sname: optim_name(s, n)))
            elif isinstance(v, torch.Tensor):
                entry[sname] = _attach_copy(v, Layout.full(optim_name(sname, name), tuple(v.shape)))
            else:
                entry[sname] = v
        out_state[name] = entry
    groups = []
    for g in sd["param_groups"]:
        g2 = dict(g)
        g2["params"] = [by_id[ids[i]][0] for i in g["params"]]
        groups.append(g2)
    return {"state": out_state, "param_groups": groups}


def _attach_copy(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """A new tensor object sharing ``t``'s memory, with ``lay`` attached (so a
    load fills the optimizer's own state in place)."""
    return attach(t.detach(), lay)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates a fresh optimizer's state (one step with zero gradients and a
    zero learning rate, which leaves the parameters unchanged), so that a
    checkpoint can be loaded into it."""
    saved = []
    for g in optimizer.param_groups:
        saved.append(g["lr"])
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, named_params: Any, state: Mapping[str, Any]) -> None:
    """Loads a state produced by :func:`optimizer_state_dict` (and filled by
    :func:`load_sharded`) into ``optimizer``."""
    pairs = list(named_params)
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    index = {name: ids.index(id(p)) for name, p in pairs if id(p) in ids}
    sd = {
        "state": {index[name]: dict(st) for name, st in state["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]],
    }
    optimizer.load_state_dict(sd)
