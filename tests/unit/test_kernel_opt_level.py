"""A kernel whose schedule asks for more of LLVM than the target's opt-level (apply.OPT_LEVEL_ATTR:
the direct convolutions, Conv2d.llvm_opt_level) is built at that level; every other kernel at
the target's (tvmgraph's default -O1, for compile time)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ModuleGraph
from tvmgraph import codegen
from tvmgraph.schedules.conv import Conv2d


class ConvHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.head = torch.nn.Linear(16 * 20 * 20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(torch.relu(self.conv(x)))
        return self.head(y.flatten(1))


def test_convolutions_are_built_at_o3_and_the_rest_at_the_targets_level(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, int] = {}
    real = codegen._build_part

    def recording(part, target, vectorize, kernel_checks):
        for gv in part.get_global_vars():
            built[gv.name_hint] = int(target.attrs["opt-level"])
        return real(part, target, vectorize, kernel_checks)

    monkeypatch.setattr(codegen, "_build_part", recording)
    torch.manual_seed(0)
    model = ConvHead()
    x = torch.randn(3, 8, 20, 20)
    actual = ModuleGraph(model)(x)
    torch.testing.assert_close(actual, model(x), atol=1e-4, rtol=1e-4)
    convs = {name: level for name, level in built.items() if "conv2d" in name}
    others = {name: level for name, level in built.items() if "conv2d" not in name}
    assert len(convs) == 2 and set(convs.values()) == {Conv2d.llvm_opt_level} == {3}, built
    assert others and set(others.values()) == {1}, built
