"""The installed stack is the pinned one (pyproject.toml); each pin exists for a reason."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
EXACT = {m.group(1): m.group(2) for dep in PYPROJECT["project"]["dependencies"]
         if (m := re.match(r"([A-Za-z0-9_.-]+)==([^\s;,]+)$", dep))}


@pytest.mark.parametrize("package", sorted(EXACT))
def test_exact_pins_are_installed(package: str) -> None:
    installed = md.version(package)
    assert installed.split("+")[0] == EXACT[package], f"{package} {installed} != pinned {EXACT[package]}"


def test_numpy_below_2_3() -> None:
    major, minor = (int(x) for x in md.version("numpy").split(".")[:2])
    assert (major, minor) < (2, 3), "numpy 2.4 breaks relax.training's Adam init; keep <2.3"
