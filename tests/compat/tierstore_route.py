"""pytest plugin: routes ``torch.save`` / ``torch.load`` (and the same names
in ``torch.serialization``) to ``tierstore.save`` / ``tierstore.load`` when
``TIERSTORE_COMPAT_ROUTE=tierstore``, so that PyTorch's own serialization
tests run through tierstore. tierstore took torch's originals at import, so
its hand-offs to torch (legacy and TorchScript files) still reach torch.

Loaded with ``-p tierstore_route`` (this directory on ``PYTHONPATH``) by
``tests/compat/run_torch_serialization.py``.
"""

from __future__ import annotations

import os

import torch

ROUTE_ENV = "TIERSTORE_COMPAT_ROUTE"


def pytest_configure(config: object) -> None:
    if os.environ.get(ROUTE_ENV) != "tierstore":
        return
    import tierstore

    for mod in (torch, torch.serialization):
        mod.save = tierstore.save  # type: ignore[assignment]
        mod.load = tierstore.load  # type: ignore[assignment]
