"""docs/errors.md is true: each section's snippet raises the class the section names.

Every TvmGraphError subclass has a section; every section but the ones for tvmgraph's own bugs
has a snippet; the snippet raises exactly that class (which also derives from a builtin).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tvmgraph import errors

DOC = Path(__file__).parents[2] / "docs" / "errors.md"
PRELUDE = "import torch, tvmgraph\nfrom torch import nn\n"
# Errors that mean a bug in tvmgraph itself: documented, with no snippet that triggers them.
NO_SNIPPET = {"TvmGraphError", "CompileError", "ExecutionError", "StaleGraphError", "PassError"}


def sections() -> dict[str, str]:
    """Class name -> the section's text, from the `<a id>` anchors."""
    text = DOC.read_text()
    parts = re.split(r'<a id="[a-z]+"></a>\n## ', text)[1:]
    return {part.split()[0]: part for part in parts}


def error_classes() -> list[type]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.TvmGraphError)]


def test_every_error_class_has_a_section_and_every_section_a_class() -> None:
    """A new error class needs its section; a section for a removed class is stale."""
    names = {c.__name__ for c in error_classes()}
    assert set(sections()) == names


@pytest.mark.parametrize("name", sorted(set(sections()) - NO_SNIPPET))
def test_snippet_raises_its_error(name: str) -> None:
    """Run the section's snippet: it must raise `name`, with the docs anchor in the message."""
    blocks = re.findall(r"```python\n(.*?)```", sections()[name], re.S)
    assert len(blocks) == 1, f"{name}: expected one snippet, found {len(blocks)}"
    cls = getattr(errors, name)
    with pytest.raises(cls) as info:
        exec(compile(PRELUDE + blocks[0], f"docs/errors.md#{name.lower()}", "exec"), {})
    assert type(info.value) is cls
    assert f"See docs/errors.md#{name.lower()}" in str(info.value)
    assert len(cls.__mro__) > 3, f"{name} must also derive from a builtin exception"
