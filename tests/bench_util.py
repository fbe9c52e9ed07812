"""Benchmarks under test: a script of ``benches/`` imported as a module
(benches run by hand rot unless a test runs their code)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHES = pathlib.Path(__file__).resolve().parents[1] / "benches"


def load_bench(name: str) -> ModuleType:
    """``benches/<name>.py`` as the module ``name`` (registered in
    ``sys.modules``, as its dataclasses and pickling need)."""
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
