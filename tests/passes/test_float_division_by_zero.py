"""FloatDivisionByZero: a float division by a constant zero gives IEEE's inf or NaN instead of
stopping TVM's build (a training step on a batch of zero rows failed to compile)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import tvm
from tvm.script import tirx as T
from tvm_ffi.structural import structural_visit

import tvmgraph
from tvmgraph.schedules.float_division_by_zero import FloatDivisionByZero


@T.prim_func(s_tir=True)
def _divisions(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"), by_zero: T.Buffer((4,), "float32"),
               by_minus_zero: T.Buffer((4,), "float32"), by_b: T.Buffer((4,), "float32")):
    T.func_attr({"global_symbol": "divisions", "tirx.noalias": True})
    for i in range(4):
        with T.sblock("divide"):
            v = T.axis.spatial(4, i)
            by_zero[v] = T.Div(a[v], T.Cast("float32", T.int64(0)))
            by_minus_zero[v] = T.Div(a[v], T.float32(-0.0))  # `/` folds, and refuses
            by_b[v] = a[v] / b[v]


def _module() -> tvm.IRModule:
    return tvm.IRModule({"divisions": _divisions})


def _divisors(func: tvm.tirx.PrimFunc) -> list[str]:
    found = []
    structural_visit(func.body, [(tvm.tirx.Div, lambda node, visitor: found.append(type(node.b).__name__))])
    return found


def test_constant_zero_divisors_become_ieee_results_buffer_divisors_stay() -> None:
    """Before/after: `a / float32(int64(0))` and `a / -0.0` become selects of NaN and signed
    infinities; `a / b[i]` (divided at run time) is unchanged. (TVM cannot print the kernel
    before: its printer's `/` folds the constant divisor, and refuses.)"""
    assert sorted(_divisors(_module()["divisions"])) == ["Cast", "FloatImm", "TensorLoad"]
    after = FloatDivisionByZero()(_module())["divisions"]
    assert _divisors(after) == ["TensorLoad"]
    lines = {line.split(" = ")[0].strip(): line.split(" = ", 1)[1] for line in after.script().splitlines()
             if "[v] = " in line}
    assert lines == {
        "by_zero[v]": 'T.Select(T.isnan(a[v]) or a[v] == T.float32(0.0), T.float32("nan"), '
                      'T.Select(a[v] > T.float32(0.0), T.float32("inf"), T.float32("-inf")))',
        "by_minus_zero[v]": 'T.Select(T.isnan(a[v]) or a[v] == T.float32(0.0), T.float32("nan"), '
                            'T.Select(a[v] > T.float32(0.0), T.float32("-inf"), T.float32("inf")))',
        "by_b[v]": "a[v] / b[v]",
    }, lines


def test_built_kernel_divides_as_the_hardware_does() -> None:
    """Without the pass the build itself fails (`Divide by zero`); with it the kernel gives
    numpy's (IEEE's) quotients: inf, -inf, NaN for 0/0 and NaN/0."""
    target = tvm.target.Target({"kind": "llvm"})
    with pytest.raises(Exception, match="Divide by zero"):
        tvm.tirx.build(_module(), target=target)
    lib = tvm.tirx.build(FloatDivisionByZero()(_module()), target=target)
    a = np.array([1.5, -2.0, 0.0, math.nan], dtype="float32")
    b = np.array([2.0, 0.0, -4.0, 1.0], dtype="float32")
    out = [tvm.runtime.tensor(np.zeros(4, "float32")) for _ in range(3)]
    lib["divisions"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), *out)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = [a / np.float32(0.0), a / np.float32(-0.0), a / b]
    for got, want in zip(out, expected):
        np.testing.assert_array_equal(got.numpy(), want)


def test_a_training_step_on_zero_rows_matches_eager() -> None:
    """A static batch of zero rows: eager's cross-entropy is NaN (its mean divides by zero
    rows), the gradients are zero and SGD leaves the parameters as they were. The graph's
    compile failed inside TVM before; now it gives eager's loss and parameters, and the same
    graph class then trains on real rows as eager does."""
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class Step(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x, y):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    graph = Step()
    batches = [(torch.randn(0, 4), torch.zeros(0, dtype=torch.long)),
               (torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    for x, y in batches:
        eager_opt.zero_grad()
        expected = torch.nn.functional.cross_entropy(eager_model(x), y)
        expected.backward()
        eager_opt.step()
        got = graph(x, y)
        torch.testing.assert_close(got, expected.detach(), equal_nan=True, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert torch.isnan(graph(*batches[0]))
