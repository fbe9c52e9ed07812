"""The README's example runs as written."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # later examples build on earlier ones, as a reader would
    for code in blocks:
        exec(compile(code, str(README), "exec"), namespace)
    assert os.path.exists(tmp_path / "ckpt.pt")


def test_readme_quick_start_is_the_two_commands() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    cmds = re.findall(r"^make (\w+)", quick, flags=re.M)
    assert cmds == ["demo", "test"]
