"""tvmgraph/ragged_sums.py: sums along an innermost axis that no vector divides are cut after
its whole vectors (contiguous vector loads) and summed with their tail; torch's numbers."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax

import tvmgraph  # noqa: F401  (registers the legalizations)
from tvmgraph.ragged_sums import ROW_VECTOR, ragged_split, splits
from tvmgraph.schedules import ApplyCPUSchedules

HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})


def compiled(build, *shapes: tuple) -> tuple[relax.VirtualMachine, tvm.IRModule]:
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(shape, "float32")) for i, shape in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build(*params))
        bb.emit_func_output(out)
    with HOST:
        mod = relax.transform.LegalizeOps()(bb.get())
        scheduled = ApplyCPUSchedules()(mod)
    return relax.VirtualMachine(tvm.compile(scheduled, target=HOST), tvm.cpu()), mod


def run(vm: relax.VirtualMachine, *inputs: torch.Tensor) -> list[torch.Tensor]:
    out = vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in inputs])
    outs = [out[i] for i in range(len(out))] if not hasattr(out, "numpy") else [out]
    return [torch.from_numpy(o.numpy()) for o in outs]


def test_the_cut_is_after_the_whole_vectors_of_rows_longer_than_two() -> None:
    assert [ragged_split(n) for n in (1981, 495, 33, 32, 31, 64, 2001)] == [1968, 480, 32, None, None, None, 2000]
    assert ROW_VECTOR == 16
    x = relax.Var("x", relax.TensorType((16, 32, 1981), "float32"))
    assert splits(x, [0, 2]) and splits(x, [2]) and not splits(x, [0, 1]) and not splits(x, None)


STATISTICS = {
    "sum-over-batch-and-samples": (lambda x: relax.op.sum(x, [0, 2]), lambda x: x.sum((0, 2))),
    "mean-keepdims": (lambda x: relax.op.mean(x, [0, 2], keepdims=True), lambda x: x.mean((0, 2), keepdim=True)),
    "variance": (lambda x: relax.op.variance(x, [0, 2]), lambda x: x.var((0, 2), unbiased=False)),
    "row-sum": (lambda x: relax.op.sum(x, [-1]), lambda x: x.sum(-1)),
    # autodiff's gradient of a bias (C, 1) broadcast over (N, C, L)
    "collapse-sum-to-a-bias": (lambda x: relax.op.collapse_sum_to(x, relax.ShapeExpr([32, 1])),
                               lambda x: x.sum((0, 2)).reshape(32, 1)),
}


@pytest.mark.parametrize("case", STATISTICS.values(), ids=STATISTICS.keys())
def test_statistics_over_rows_no_vector_divides_match_torch(case: tuple) -> None:
    """(16, 32, 1981): the legalized kernel sums 1968 samples, then 13; float64 torch as the
    reference, float32 tolerance."""
    build, reference = case
    vm, mod = compiled(build, (16, 32, 1981))
    text = "".join(f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert "_whole_vectors" in text and "_tail" in text and "T.int64(1968)" in text, text
    x = torch.randn(16, 32, 1981) + 3
    (got,) = run(vm, x)
    torch.testing.assert_close(got, reference(x.double()).float(), atol=1e-4, rtol=1e-5)


def test_a_sum_to_one_value_keeps_tvms() -> None:
    """A loss sums every axis: TVM's legalization (its schedule chunks it for precision)."""
    _, mod = compiled(lambda x: relax.op.sum(x), (4, 1981))
    text = "".join(f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    assert "_whole_vectors" not in text


def test_a_training_batch_norm_over_ragged_rows_matches_torch() -> None:
    """relax.nn.batch_norm(training=True) over (8, 6, 501): the output and the moving mean and
    variance of TOPI's formula (biased variance, momentum 0.1), against torch in float64."""
    shape = (8, 6, 501)

    def build(x, gamma, beta, mean, var):  # noqa: ANN001, ANN202
        return relax.op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, epsilon=1e-5, momentum=0.1, training=True)

    vm, mod = compiled(build, shape, (6,), (6,), (6,), (6,))
    assert "_whole_vectors" in mod["batch_norm"].script()
    x = torch.randn(shape) * 2 + 1
    gamma, beta, mean, var = torch.randn(6), torch.randn(6), torch.randn(6), torch.rand(6) + 0.5
    out, new_mean, new_var = run(vm, x, gamma, beta, mean, var)
    xd = x.double()
    batch_mean, batch_var = xd.mean((0, 2)), xd.var((0, 2), unbiased=False)
    expected = (xd - batch_mean[:, None]) / torch.sqrt(batch_var[:, None] + 1e-5) * gamma.double()[:, None] + beta.double()[:, None]
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_mean, (0.9 * mean.double() + 0.1 * batch_mean).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_var, (0.9 * var.double() + 0.1 * batch_var).float(), atol=1e-5, rtol=1e-5)


def test_batch_norm_1d_trains_like_eager_over_ragged_rows() -> None:
    """Through tvmgraph: a Conv1d + BatchNorm1d + ReLU net over 203 samples, three SGD steps;
    loss, parameters and running statistics as eager's (forward statistics, the backward pass's
    four sums and the bias gradient are all cut sums here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(3, 8, 5), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    eager = __import__("copy").deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)

    class Step(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

        def build(self, x, y):  # noqa: ANN001, ANN201
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    step = Step()
    for _ in range(3):
        x, y = torch.randn(5, 3, 207), torch.randint(0, 4, (5,))
        loss = step(x, y)
        opt_e.zero_grad()
        loss_e = torch.nn.functional.cross_entropy(eager(x), y)
        loss_e.backward()
        opt_e.step()
        torch.testing.assert_close(loss, loss_e, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
