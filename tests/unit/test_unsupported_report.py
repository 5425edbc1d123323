"""An UnsupportedOpError lists every op of the graph that is out of scope in one error, each with
its module path and the source line that called it: ops without a lowering (forward), and ops
the loss needs the gradient of (training), never integer-valued ones."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

import tvmgraph
from tests.numeric import opinfo_sweep
from tvmgraph import errors
from tvmgraph.training import gradient_check


def line_of(fn, text: str) -> str:
    """`test_unsupported_report.py:N: <the line>` for the line of `fn` that holds `text`."""
    lines, start = inspect.getsourcelines(fn)
    [offset] = [i for i, line in enumerate(lines) if text in line]
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{start + offset}: {lines[offset].strip()}"


def listed(message: str, head: str, where: str) -> bool:
    """Whether one line of the error is `head`, then ` at `, the file's directory, then `where`."""
    return any(line.startswith(head + " at ") and (line.endswith(os.sep + where) or line.endswith(" at " + where))
               for line in message.splitlines())


class Orthonormal(nn.Module):
    """Linear algebra (QR) is out of scope: it has no lowering by design."""

    def forward(self, x):
        return torch.linalg.qr(x).Q


class Noisy(nn.Module):
    """Poisson draws have no lowering (random_ops.py)."""

    def forward(self, x):
        return x + torch.poisson(x.abs())


class TwoUnsupported(tvmgraph.nn.Graph):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), Noisy())
        self.head = Orthonormal()

    def build(self, x):
        return self.head(self.encoder(x))


def test_forward_ops_without_lowering_are_listed_in_one_error() -> None:
    graph = TwoUnsupported()
    with pytest.raises(errors.UnsupportedOpError) as info:
        graph(torch.randn(4, 4))
    message = str(info.value)
    assert f"{graph.name}: 2 op(s) used in build() have no lowering to TVM Relax:" in message
    rand = line_of(Noisy.forward, "torch.poisson")
    qr = line_of(Orthonormal.forward, "torch.linalg.qr")
    assert listed(message, "  * aten.poisson.default from 'encoder.1' (Noisy)", rand)
    assert listed(message, "  * aten.linalg_qr.default from 'head' (Orthonormal)", qr)
    assert message.count("  * ") == 2
    assert opinfo_sweep.classify(info.value) == ("unsupported", "no lowering: aten.linalg_qr.default, aten.poisson.default")


def test_op_written_in_build_names_the_line_of_build() -> None:
    class InBuild(tvmgraph.nn.Graph):
        def build(self, x):
            return x + torch.poisson(x.abs())

    with pytest.raises(errors.UnsupportedOpError) as info:
        InBuild()(torch.zeros(3))
    where = line_of(InBuild.build, "torch.poisson")
    assert listed(str(info.value), "  * aten.poisson.default from build() itself", where)


class Scale(nn.Module):
    """exp of a trained weight times the input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.exp(self.w) * x


class Squash(nn.Module):
    """tanh of a linear map, then a row picked by argmax: an integer index into the result."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        picked = x.argmax(-1)
        return y[torch.arange(4), picked]


class Train(tvmgraph.nn.Graph):
    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.blocks = nn.Sequential(*modules)
        self.add_optimizer(torch.optim.SGD(self.blocks.parameters(), lr=0.1))

    def build(self, x):
        loss = self.blocks(x).sum()
        loss.backward()
        return loss


def test_ops_without_gradients_are_listed_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend that exp, tanh and argmax have no gradient: argmax, integer-valued and read only
    as an index, needs none and is not listed."""
    lacking = {"relax.exp", "relax.tanh", "relax.argmax"}
    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op not in lacking and real(op))
    graph = Train(Scale(), Squash())
    with pytest.raises(errors.UnsupportedOpError) as info:
        graph(torch.randn(4, 3))
    message = str(info.value)
    assert f"{graph.name}: build() needs the gradient of relax.exp, relax.tanh, which tvmgraph cannot compute yet:\n" \
        in message
    exp = line_of(Scale.forward, "torch.exp")
    tanh = line_of(Squash.forward, "torch.tanh")
    assert listed(message, "  * relax.exp: aten.exp.default from 'blocks.0' (Scale)", exp)
    assert listed(message, "  * relax.tanh: aten.tanh.default from 'blocks.1' (Squash)", tanh)
    assert "argmax" not in message
    assert message.count("  * ") == 2


def test_integer_index_path_needs_no_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """argmax read as an index needs no gradient, with one or without: the graph trains."""
    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op != "relax.argmax" and real(op))
    model, x = Squash(), torch.randn(4, 3)
    expected = model(x).sum().detach()  # before the graph's step changes the weights
    torch.testing.assert_close(Train(model)(x), expected, atol=1e-5, rtol=1e-4)


class CumProd(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.cumprod(self.w * x, dim=1)


def test_op_without_gradient_is_named_with_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No op a torch model reaches lacks a gradient today: cumprod is made to look like one."""
    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op != "relax.cumprod" and real(op))
    graph = Train(nn.Linear(3, 3), CumProd())
    with pytest.raises(errors.UnsupportedOpError) as info:
        graph(torch.randn(4, 3))
    where = line_of(CumProd.forward, "torch.cumprod")
    assert listed(str(info.value), "  * relax.cumprod: aten.cumprod.default from 'blocks.1' (CumProd)", where)
    assert opinfo_sweep.classify(info.value) == ("unsupported", "no gradient: relax.cumprod")


def test_op_on_an_input_alone_is_listed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM's autodiff differentiates what no trained parameter feeds as well (cumprod of the
    input here), so the check lists it rather than let autodiff fail on it."""

    class InputCumProd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return torch.cumprod(x, dim=1) * self.w

    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op != "relax.cumprod" and real(op))
    with pytest.raises(errors.UnsupportedOpError, match=r"\* relax.cumprod: aten.cumprod.default from 'blocks.0'"):
        Train(InputCumProd())(torch.randn(4, 3))


def test_binding_made_on_the_way_to_a_result_is_named_by_its_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.Linear's addmm lowers to a matmul, then an add (the node's result): a missing matmul
    gradient names aten.addmm, and for a torch module the line of build() that called it."""
    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op != "relax.matmul" and real(op))
    with pytest.raises(errors.UnsupportedOpError) as info:
        Train(nn.Linear(3, 2))(torch.randn(4, 3))
    where = line_of(Train.build, "self.blocks(x)")
    assert listed(str(info.value), "  * relax.matmul: aten.addmm.default from 'blocks.0' (Linear)", where)
