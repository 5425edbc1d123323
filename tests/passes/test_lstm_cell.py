"""LSTMCellAsOneKernel: an unrolled LSTM step (product, gates, states) is one CPU kernel, which
reads the step's row of the input projection in place; the kernel (tvmgraph/schedules/lstm_cell.py)
against torch; whole LSTMs against eager."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax

from relay_passes.lstm_cell import LSTMCellAsOneKernel
from tests.conftest import ModuleGraph
from tvmgraph.schedules.apply import ApplyCPUSchedules
from tvmgraph.schedules.lstm_cell import ATTRIBUTE, LSTMCell, lstm_cell_kernel, rows_per_tile
from tvmgraph.schedules.rules import default_rules

AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
HOST = tvm.target.Target({"kind": "llvm"})


STEP = """


@I.ir_module
class Module:
    @R.function
    def main(h: R.Tensor((1, 2, {H}), "float32"), c: R.Tensor((1, 2, {H}), "float32"),
             wt: R.Tensor(({H}, {G}), "float32"), b: R.Tensor(({G},), "float32"),
             xw: R.Tensor((3, 2, {G}), "float32")):
        with R.dataflow():
            x0 = R.strided_slice(xw, (0,), (1,), (2,), (1,))
            x = R.squeeze(x0, axis=[0])
            h2 = R.reshape(h, R.shape([2, {H}]))
            m = R.matmul(h2, wt)
            z0 = R.add(b, m)
            z1 = R.reshape(z0, R.shape([1, 2, {G}]))
            z = R.add(z1, x)
            s = R.split(z, indices_or_sections=[{H}, {H2}, {H3}], axis=2)
            i = R.sigmoid(s[0])
            f = R.sigmoid(s[{f}])
            g = R.tanh(s[{g}])
            o = R.sigmoid(s[3])
            fc = R.multiply(f, c)
            ig = R.multiply(i, g)
            c1 = R.add(fc, ig)
            tc = R.tanh(c1)
            h1 = R.multiply(o, tc)
            out = (h1, c1{extra})
            R.output(out)
        return out
"""


def step(hidden: int = 16, f: int = 1, g: int = 2, extra: str = "") -> tvm.IRModule:
    """One step of torch's LSTM as torch.export writes it (batch 2, step 1 of 3); `f`, `g`: the
    pieces the forget gate and the candidate read; `extra`: more outputs."""
    return tvm.script.from_source(STEP.format(H=hidden, G=4 * hidden, H2=2 * hidden, H3=3 * hidden,
                                              f=f, g=g, extra=extra))


Step = step()


def fused(mod: tvm.IRModule, target: tvm.target.Target = AVX512) -> tvm.IRModule:
    with target:
        return LSTMCellAsOneKernel()(mod)


def _calls(mod: tvm.IRModule) -> list[relax.Call]:
    """The call_tir calls of main, in order."""
    calls = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.call_tir":
                calls.append(value)
    return calls


def _ops(mod: tvm.IRModule) -> set[str]:
    return {b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}


def test_a_step_becomes_one_kernel_that_reads_its_row_of_the_projection_in_place() -> None:
    out = fused(Step)
    (call,) = _calls(out)
    kernel = out[call.args[0]]
    assert kernel.attrs[ATTRIBUTE]
    h, c, wt, b, xw = out["main"].params
    operands = list(call.args[1].fields)
    # h' of the previous step itself (not its reshape), the whole projection, and t = 1
    assert [a.same_as(p) for a, p in zip(operands, (h, wt, b, xw, c))] == [True] * 5
    assert int(operands[5].value) == 1
    # the product, the gates and the slice of xw are gone
    assert _ops(out) == {"relax.call_tir"}


def test_results_equal_the_unfused_step() -> None:
    rng = np.random.default_rng(0)
    shapes = [p.ty.shape for p in Step["main"].params]
    args = [rng.standard_normal([int(d) for d in s]).astype("float32") for s in shapes]
    results = []
    for mod in (Step, fused(Step, HOST)):
        with HOST:
            mod = ApplyCPUSchedules()(relax.transform.LegalizeOps()(mod))
        vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
        results.append([t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in args))])
    for got, expected in zip(results[1], results[0]):
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["gates read elsewhere", "hidden no vector divides", "other split",
                                  "other target"])
def test_what_the_kernel_cannot_replace_is_left_alone(case: str) -> None:
    mod, target = Step, AVX512
    if case == "gates read elsewhere":  # a training step's backward pass reads the gates
        mod = step(extra=", i")
    elif case == "hidden no vector divides":  # 12 units; 16 lanes
        mod = step(hidden=12)
    elif case == "other split":  # the gates in another order than torch's i, f, g, o
        mod = step(f=2, g=1)
    else:  # the kernel and its schedule are the CPU's
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    out = fused(mod, target)
    assert not _calls(out)
    tvm.ir.assert_structural_equal(out, mod)


@pytest.mark.parametrize("batch,hidden,steps,bias,rank", [(16, 128, 32, True, 3), (3, 32, 5, False, 3),
                                                        (5, 16, 1, True, 2), (7, 32, 2, True, 2)])
def test_the_kernel_equals_torch(batch: int, hidden: int, steps: int, bias: bool, rank: int) -> None:
    """Scheduled by its rule, for row counts its tile divides (16 by 4, 5 by 5) and not (7: a
    tile of 1), with and without the bias, with nn.LSTM's states ([1, B, H]) and nn.LSTMCell's."""
    kernel = lstm_cell_kernel(batch, hidden, steps, bias, rank)
    mod = tvm.IRModule({"cell": kernel.with_attr("global_symbol", "cell")})
    with HOST:
        mod = ApplyCPUSchedules(LSTMCell())(mod)
    assert mod["cell"].attrs["tirx.is_scheduled"]
    lib = tvm.compile(mod, target=HOST)
    g = torch.Generator().manual_seed(0)
    state = (1, batch, hidden) if rank == 3 else (batch, hidden)
    h, c = torch.randn(*state, generator=g), torch.randn(*state, generator=g)
    wt = torch.randn(hidden, 4 * hidden, generator=g) * 0.2
    b = torch.randn(4 * hidden, generator=g)
    xw = torch.randn(steps, batch, 4 * hidden, generator=g) * 2
    t = steps - 1
    outs = [tvm.runtime.tensor(np.zeros(state, "float32")) for _ in range(2)]
    args = [h, wt, *([b] if bias else []), xw, c]
    lib["cell"](*(tvm.runtime.tensor(a.numpy()) for a in args), t, *outs)
    z = h.reshape(batch, hidden) @ wt + xw[t] + (b if bias else 0)
    i, f, gg, o = z.split(hidden, -1)
    cell = torch.sigmoid(f) * c.reshape(batch, hidden) + torch.sigmoid(i) * torch.tanh(gg)
    torch.testing.assert_close(torch.from_numpy(outs[0].numpy()).reshape(batch, hidden), cell, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(outs[1].numpy()).reshape(batch, hidden),
                               torch.sigmoid(o) * torch.tanh(cell), atol=2e-6, rtol=1e-5)


def test_rows_per_tile() -> None:
    assert [rows_per_tile(b) for b in (1, 3, 4, 7, 12, 16, 64)] == [1, 3, 4, 1, 6, 4, 4]


def test_the_rule_is_tried_before_the_matmul_rule() -> None:
    names = [type(rule).__name__ for rule in default_rules()]
    assert names.index("LSTMCell") < names.index("Matmul")


class Sequence(nn.Module):
    """An nn.LSTM's whole output and final states, as a user reads them."""

    def __init__(self, **kwargs):
        super().__init__()
        self.lstm = nn.LSTM(**kwargs)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        return y, h, c


class CellLoop(nn.Module):
    """nn.LSTMCell over a sequence in a Python loop, as seq2seq decoders write it."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.cell = nn.LSTMCell(inputs, hidden)

    def forward(self, x, h, c):
        outputs = []
        for step in x:
            h, c = self.cell(step, (h, c))
            outputs.append(h)
        return torch.stack(outputs), h, c


@pytest.mark.parametrize("kwargs,shape", [
    ({"input_size": 8, "hidden_size": 32, "batch_first": True}, (4, 6, 8)),
    ({"input_size": 8, "hidden_size": 32, "num_layers": 2}, (5, 3, 8)),
    ({"input_size": 8, "hidden_size": 16, "bidirectional": True, "batch_first": True}, (2, 4, 8)),
    ({"input_size": 8, "hidden_size": 32, "bias": False}, (3, 2, 8)),
    ({"input_size": 8, "hidden_size": 12}, (3, 2, 8)),  # no kernel: 12 units
    ({"input_size": 8, "hidden_size": 32, "cell": True}, (4, 3, 8)),
], ids=["batch_first", "two layers", "bidirectional", "no bias", "12 units", "LSTMCell loop"])
def test_lstms_equal_eager(kwargs: dict, shape: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Through a whole inference graph: every output and state equals eager's to float32
    rounding, and debug(1) reports the kernel wherever whole vectors divide the hidden units."""
    torch.manual_seed(0)
    if kwargs.get("cell"):
        model = CellLoop(kwargs["input_size"], kwargs["hidden_size"]).eval()
        args = (torch.randn(*shape), torch.randn(shape[1], kwargs["hidden_size"]),
                torch.randn(shape[1], kwargs["hidden_size"]))
    else:
        model = Sequence(**kwargs).eval()
        args = (torch.randn(*shape),)
    with torch.no_grad():
        expected = model(*args)
    graph = ModuleGraph(model)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        got = graph(*args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-6, rtol=1e-5)
    fused_steps = "LSTMCellAsOneKernel: LSTM step" in caplog.text
    assert fused_steps == (kwargs["hidden_size"] % 16 == 0)


def test_a_training_step_keeps_its_gates(caplog: pytest.LogCaptureFixture) -> None:
    """The backward pass reads the gates: no step is replaced, and training equals eager's."""
    from tests.conftest import TrainGraph

    torch.manual_seed(0)
    model = Sequence(input_size=8, hidden_size=32, batch_first=True)
    reference = Sequence(input_size=8, hidden_size=32, batch_first=True)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 32)

    def loss_fn(out, target):
        return nn.functional.mse_loss(out[0], target) + out[2].square().mean()

    graph = TrainGraph(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.5))
    graph.debug(1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        for _ in range(2):
            loss = graph(x, y)
            opt.zero_grad()
            expected = loss_fn(reference(x), y)
            expected.backward()
            opt.step()
            torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    assert "LSTMCellAsOneKernel" not in caplog.text
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)
