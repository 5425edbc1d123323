"""FoldConstantTables: a table that transcendental ops compute from constants alone (a rotary
embedding's cos/sin of torch.arange) becomes a constant of the program; what reads an input,
what has no transcendental op and what is too big stays computed."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes import fold_constant_tables
from relay_passes.fold_constant_tables import FoldConstantTables
from tests.conftest import ModuleGraph, TrainGraph, assert_steps_match_eager

POSITIONS = np.arange(6, dtype="int64")
PAIRS = np.arange(0, 8, 2, dtype="int64")


def rotary_tables(x_shape=(2, 6, 4)) -> tvm.IRModule:
    """`x * cos(angle) + x * sin(angle)`, angle = positions / 10000 ** (pairs / 8), as torch.export
    writes a rotary embedding's tables (positions and pairs are constants: torch.arange)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.expand_dims(relax.op.astype(relax.const(POSITIONS), "float32"), [1]))
            p = bb.emit(relax.op.divide(relax.op.astype(relax.const(PAIRS), "float32"), relax.const(8.0)))
            f = bb.emit(relax.op.expand_dims(relax.op.power(relax.const(10000.0), p), [0]))
            angle = bb.emit(relax.op.divide(t, f))
            cos, sin = bb.emit(relax.op.cos(angle)), bb.emit(relax.op.sin(angle))
            y = bb.emit(relax.op.add(relax.op.multiply(x, cos), relax.op.multiply(x, sin)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod: tvm.IRModule) -> list[str]:
    return [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _constants(mod: tvm.IRModule) -> list[np.ndarray]:
    found = []

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.GenericConst):
            found.append(expr.value.numpy())

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def test_the_tables_become_constants() -> None:
    out = FoldConstantTables()(rotary_tables())
    assert _ops(out) == ["relax.multiply", "relax.multiply", "relax.add"]
    angle = POSITIONS[:, None].astype("float32") / (np.float32(10000.0) ** (PAIRS.astype("float32") / 8))[None]
    cos, sin = _constants(out)  # in the order the multiplies read them
    np.testing.assert_allclose(cos, np.cos(angle), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angle), rtol=1e-6, atol=1e-7)


def test_the_program_computes_what_it_did() -> None:
    mod = rotary_tables()
    x = np.random.default_rng(0).standard_normal((2, 6, 4)).astype("float32")
    host = tvm.target.Target({"kind": "llvm"})
    results = [relax.VirtualMachine(tvm.compile(m, target=host), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
               for m in (mod, FoldConstantTables()(mod))]
    np.testing.assert_array_equal(results[1], results[0])


@I.ir_module
class MaskOnly:
    """A causal mask from constants: no transcendental op, cheap to compute where it is read."""

    @R.function
    def main(x: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            a = R.astype(R.const(np.arange(4, dtype="int64")), "float32")
            m = R.less(R.expand_dims(a, [0]), R.expand_dims(a, [1]))
            y = R.where(m, x, R.const(0.0, "float32"))
            R.output(y)
        return y


@I.ir_module
class FromAnInput:
    """cos of something computed from an input: not a table."""

    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            a = R.multiply(x, R.const(2.0, "float32"))
            y = R.cos(a)
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [MaskOnly, FromAnInput], ids=["no transcendental op", "reads an input"])
def test_what_is_no_table_stays(mod: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(FoldConstantTables()(mod), mod)


def test_a_table_above_the_size_limit_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold_constant_tables, "MAX_ELEMENTS", 6 * 4 - 1)  # the tables are 6 x 4
    mod = rotary_tables()
    assert "relax.cos" in _ops(FoldConstantTables()(mod))


class Rotary(nn.Module):
    """q, k projections with a rotary embedding computed in forward(), as LLaMA code writes it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)

    @staticmethod
    def rotate(x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[-2], x.shape[-1]
        angle = torch.arange(t).float()[:, None] / (10000 ** (torch.arange(0, d, 2).float() / d))[None]
        even, odd = x[..., ::2], x[..., 1::2]
        return torch.stack([even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()],
                           -1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.rotate(self.q(x)) * self.rotate(self.k(x))).sum(-1)


class Sinusoidal(nn.Module):
    """The transformer paper's position encoding, computed in forward()."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width
        self.fc = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        position = torch.arange(t).unsqueeze(1)
        div = torch.exp(torch.arange(0, self.width, 2) * (-math.log(10000.0) / self.width))
        pe = torch.zeros(t, self.width)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        return self.fc(x + pe).mean(1)


@pytest.mark.parametrize("model_class", [Rotary, Sinusoidal])
def test_models_equal_eager(model_class: type, caplog: pytest.LogCaptureFixture) -> None:
    """Inference and two SGD steps against eager; debug(1) reports the folded tables."""
    torch.manual_seed(0)
    model, reference = model_class(), model_class()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(3, 10, 16), torch.randn(3, 10) if model_class is Rotary else torch.randn(3, 3)
    graph = ModuleGraph(model.eval())
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        with torch.no_grad():
            torch.testing.assert_close(graph(x), reference.eval()(x), atol=2e-6, rtol=1e-5)
    assert "FoldConstantTables:" in caplog.text

    model.train(), reference.train()
    train = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert_steps_match_eager(train, model, reference, nn.functional.mse_loss, x, y)


class BucketsOverLogOfOne(nn.Module):
    """T5-style relative buckets with max_distance == max_exact: log(n / 4) / log(4 / 4), a
    constant float divided by 0 (inf, then a saturated cast, in eager)."""

    def forward(self, x):
        n = torch.arange(8)
        large = (torch.log(n.float() / 4) / math.log(4 / 4)).to(torch.long)
        return x + torch.where(n < 4, n, large).float()


def test_a_table_tvm_cannot_fold_stays_in_the_program(caplog: pytest.LogCaptureFixture) -> None:
    """TVM's simplifier refuses the constant division by 0 ("Divide by zero", an InternalError):
    the pass raised, and the graph compiled without it after a warning to report a tvmgraph bug.
    The table now stays to run time; the result is eager's."""
    x = torch.zeros(8)
    graph = ModuleGraph(BucketsOverLogOfOne())
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(x)
    torch.testing.assert_close(out, BucketsOverLogOfOne()(x))
    assert "please report" not in caplog.text
