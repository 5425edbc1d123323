"""Bad input gets an error that names the graph, the argument or op, and the fix."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import errors
from tests.conftest import Fn, ModuleGraph, TrainGraph


class TwoInputs(tvmgraph.nn.Graph):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def build(self, x, y):
        return self.linear(x) + y


def test_missing_super_init_on_attribute_assignment() -> None:
    class Forgot(tvmgraph.nn.Graph):
        def __init__(self):
            self.model = nn.Linear(2, 2)

        def build(self, x):
            return self.model(x)

    with pytest.raises(errors.GraphInitError, match=r"Forgot: super\(\).__init__\(\) was not called before assigning self.model"):
        Forgot()


def test_missing_super_init_on_call() -> None:
    class Forgot(tvmgraph.nn.Graph):
        def __init__(self):
            pass

        def build(self, x):
            return x

    with pytest.raises(errors.GraphInitError, match="was not called before calling the graph"):
        Forgot()(torch.ones(1))


def test_build_not_overridden() -> None:
    class NoBuild(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()

    graph = NoBuild()
    with pytest.raises(errors.BuildNotImplementedError, match=rf"{graph.name}: build\(\) is not overridden in NoBuild"):
        graph(torch.ones(1))
    assert isinstance(errors.BuildNotImplementedError("x"), NotImplementedError)


@pytest.mark.parametrize("args", [(torch.ones(1, 3),), (torch.ones(1, 3),) * 3], ids=["too_few", "too_many"])
def test_wrong_number_of_arguments(args: tuple) -> None:
    graph = TwoInputs()
    with pytest.raises(errors.GraphArgumentError,
                       match=rf"{graph.name}: build\(x, y\) takes 2 argument\(s\) but {len(args)} were given"):
        graph(*args)


def test_keyword_arguments_take_their_places_and_unknown_ones_are_refused() -> None:
    graph = TwoInputs()
    x, y = torch.ones(1, 3), torch.full((1, 3), 2.0)
    torch.testing.assert_close(graph(x, y=y), graph(x, y))
    torch.testing.assert_close(graph(y=y, x=x), graph(x, y))
    with pytest.raises(errors.GraphArgumentError, match=r"unexpected keyword argument 'z' \(build\(x, y\)\)"):
        graph(x, y, z=y)
    with pytest.raises(errors.GraphArgumentError, match=r"multiple values for argument 'x'"):
        graph(x, x=y)


def test_non_tensor_argument_is_named() -> None:
    graph = TwoInputs()
    with pytest.raises(errors.GraphArgumentError, match=r"argument 'y' is int; build\(\) arguments must be a torch.Tensor"):
        graph(torch.ones(1, 3), 3)
    with pytest.raises(errors.GraphArgumentError, match=r"argument 'y'\[1\] is str"):
        graph(torch.ones(1, 3), [torch.ones(1), "a"])
    assert issubclass(errors.GraphArgumentError, TypeError)


def test_non_tensor_output() -> None:
    class ReturnsInt(tvmgraph.nn.Graph):
        def build(self, x):
            return x, 3

    graph = ReturnsInt()
    with pytest.raises(errors.GraphOutputError, match=rf"{graph.name}: build\(\) returned int at output\[1\]"):
        graph(torch.ones(2))


class Orthonormal(nn.Module):
    def forward(self, x):
        return torch.linalg.qr(x).Q  # linear algebra: not lowered, by design


def test_unsupported_op_names_op_and_module_path() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Orthonormal())
    graph = ModuleGraph(model)
    with pytest.raises(errors.UnsupportedOpError) as info:
        graph(torch.randn(2, 4))
    message = str(info.value)
    assert f"{graph.name}: 1 op(s) used in build() have no lowering to TVM Relax" in message
    assert "aten.linalg_qr.default from 'model.1' (Orthonormal)" in message
    assert "Rewrite that code with supported torch ops" in message
    assert message.endswith("See docs/errors.md#unsupportedoperror")


def test_data_dependent_control_flow_is_a_trace_error() -> None:
    class Branchy(tvmgraph.nn.Graph):
        def build(self, x):
            return x * 2 if x.sum() > 0 else x

    graph = Branchy()
    with pytest.raises(errors.TraceError, match=rf"{graph.name}: torch.export could not trace build\(\)"):
        graph(torch.ones(3))


def test_an_input_that_does_not_fit_a_module_names_the_module_and_the_input(caplog: pytest.LogCaptureFixture) -> None:
    """torch's message ("a and b must have same reduction dim, but got [6, 5] X [4, 8]") names
    neither; the TraceError adds the module that raised, its sizes and what it was given, and
    torch's 20-line fake-tensor traceback no longer precedes it on stderr."""
    graph = ModuleGraph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    graph(torch.randn(6, 4))
    with pytest.raises(errors.TraceError) as info, caplog.at_level(logging.WARNING):
        graph(torch.randn(6, 5))
    message = str(info.value)
    assert f"{graph.name}: torch.export could not trace build(): RuntimeError: a and b must have same" in message
    assert ("Raised inside 'model.0', Linear(in_features=4, out_features=8, bias=True), called with "
            "float32[6, 5]. If eager torch raises the same, these inputs do not fit that module") in message
    assert "failed while attempting to run meta" not in caplog.text


def test_a_packed_sequence_given_to_an_rnn_says_what_to_pass_instead() -> None:
    """An RNN given a PackedSequence: the hint said "called with no tensor ... compare their
    shapes", where eager runs it and the cause is the sequence's data-dependent batch sizes."""
    class Packed(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 6, batch_first=True)

        def build(self, x, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]

    with pytest.raises(errors.TraceError) as info:
        Packed()(torch.randn(3, 5, 4), torch.tensor([5, 3, 4]))
    assert ("Raised inside 'rnn', GRU(4, 6, batch_first=True), called with a PackedSequence. A PackedSequence "
            "cannot go through a graph") in str(info.value)
    assert "pad_sequence" in str(info.value)


def test_an_error_in_build_outside_any_module_names_no_module() -> None:
    class Reshaping(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def build(self, x):
            return self.fc(x).view(5, -1)

    with pytest.raises(errors.TraceError) as info:
        Reshaping()(torch.randn(2, 4))
    assert "Raised inside" not in str(info.value)


def test_a_module_torch_cannot_decompose_is_a_trace_error_not_a_tvm_bug() -> None:
    """nn.CrossMapLRN2d's legacy autograd.Function fails inside torch's decompositions; it was a
    CompileError saying "failed inside TVM ... This is a tvmgraph bug"."""
    graph = ModuleGraph(nn.Sequential(nn.Conv2d(4, 4, 1), nn.CrossMapLRN2d(3)))
    with pytest.raises(errors.TraceError,
                       match=rf"{graph.name}: torch could not decompose build\(\)'s program into core ATen ops .*"
                             r"torch.autograd.Function or a legacy module"):
        graph(torch.randn(2, 4, 6, 6))


def test_dot_data_in_build_names_detach() -> None:
    """torch.export's own message ("a fake tensor in the exported program constant's list")
    says nothing a user can act on."""
    graph = ModuleGraph(Fn(lambda x: x * x.data))
    with pytest.raises(errors.TraceError, match=r"`tensor.data` inside build\(\) cannot be traced: use `tensor.detach\(\)`"):
        graph(torch.ones(3))


def test_vmap_of_an_unbatched_argument_names_vmap_not_only_dot_data() -> None:
    """torch.export fails it with the message `.data` gets; the hint named `.data` alone, which
    build() never used (found by a sweep)."""
    graph = ModuleGraph(Fn(lambda w, x: torch.func.vmap(torch.mv, in_dims=(None, 0))(w, x)))
    with pytest.raises(errors.TraceError, match=r"torch.func.vmap fails the same way .* batch every argument on dim 0"):
        graph(torch.randn(6, 4), torch.randn(3, 4))


def test_torch_cond_on_a_tensor_predicate_is_refused_by_name() -> None:
    """It was a CompileError calling itself a tvmgraph bug (TVM translates cond's branches with
    its own converters only; found by a sweep)."""
    graph = ModuleGraph(Fn(lambda x: torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))))
    with pytest.raises(errors.UnsupportedOpError, match=r"torch.cond on a tensor predicate has no lowering yet; "
                                                        r"compute both branches and pick one with torch.where"):
        graph(torch.randn(3, 4))


def test_one_hot_without_num_classes_says_to_pass_it() -> None:
    """Its class count is x.max() + 1, a size read from values: torch.export's own message points
    into torch's decompositions."""
    graph = ModuleGraph(Fn(lambda x: torch.nn.functional.one_hot(x)))
    with pytest.raises(errors.TraceError, match=r"without num_classes .* pass it, `F.one_hot\(x, num_classes=n\)`"):
        graph(torch.tensor([0, 2, 1]))


@pytest.mark.parametrize("model, x, dtypes", [
    (nn.Linear(4, 3).double(), torch.randn(2, 4), "float32 and float64"),
    (nn.Sequential(nn.Flatten(0), nn.Linear(8, 2)), torch.randn(2, 4).double(), "float32 and float64"),
    (nn.Linear(4, 3), torch.randint(0, 5, (2, 4)), "float32 and int64"),
])
def test_mixed_dtypes_in_a_matmul_are_a_trace_error(model: nn.Module, x: torch.Tensor, dtypes: str) -> None:
    """A float64 module fed float32 inputs (or the reverse), integer inputs to a float layer:
    eager raises "must have the same dtype"; torch.export does not check, and TVM failed with
    an internal type error that the graph reported as a tvmgraph bug."""
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model(x)
    graph = ModuleGraph(model)
    with pytest.raises(errors.TraceError, match=rf"{graph.name}: aten\.(addmm|mm)\.default from '[\w.]+' \(Linear\)"
                                                 rf".* takes {dtypes} tensors; .* module\.float\(\), x\.float\(\) "
                                                 rf"or x\.double\(\)"):
        graph(x)


def test_training_bfloat16_parameters_is_refused_with_the_amp_fix() -> None:
    """TVM's autodiff takes float16/32/64 parameters only: a bfloat16 model failed with an
    internal check that the graph called a tvmgraph bug. float16 parameters train."""
    model = nn.Linear(4, 3).bfloat16()
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(errors.UnsupportedOpError, match=rf"{graph.name}: parameter model_weight is bfloat16.*"
                                                        r"enable_amp\(True, dtype=torch\.bfloat16\)"):
        graph(torch.randn(8, 4).bfloat16(), torch.randn(8, 3).bfloat16())


def test_tensor_attribute_is_refused() -> None:
    class HoldsTensor(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

    with pytest.raises(errors.GraphAttributeError, match=r"self.w is a Parameter; a graph owns modules, not tensors"):
        HoldsTensor()


def test_nested_graph_assignment_is_refused() -> None:
    inner = TwoInputs()

    class Outer(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.inner = inner

    with pytest.raises(errors.NestedGraphError, match=rf"self.inner is a Graph \({inner.name}\); a Graph cannot be nested"):
        Outer()


def test_calling_a_graph_inside_build_is_refused() -> None:
    inner = ModuleGraph(nn.Linear(2, 2))

    class Outer(tvmgraph.nn.Graph):
        def build(self, x):
            return inner(x)

    outer = Outer()
    with pytest.raises(errors.NestedGraphError, match=rf"{inner.name} was called inside build\(\) of {outer.name}"):
        outer(torch.ones(1, 2))


def test_inputs_on_different_devices() -> None:
    graph = TwoInputs()
    with pytest.raises(errors.DeviceMismatchError, match=r"inputs are on different devices \('x' on cpu, 'y' on meta\)"):
        graph(torch.ones(1, 3), torch.ones(1, 3, device="meta"))


def test_parameter_data_swapped_for_other_shape_recompiles() -> None:
    """`p.data = bigger` registers nothing; the program refuses it at its entry, and the call
    looks at the model again and compiles for it (eager's result), never running stale."""
    model = nn.Linear(3, 2)
    graph = ModuleGraph(model)
    x = torch.ones(1, 3)
    graph(x)
    model.weight.data = torch.randn(5, 3)
    model.bias.data = torch.randn(5)
    torch.testing.assert_close(graph(x), model(x).detach())
    assert graph.num_compiled == 2
    model.double()  # .to(dtype) swaps .data too
    torch.testing.assert_close(graph(x.double()), model(x.double()).detach())
    assert graph.num_compiled == 3


def test_every_error_class_has_a_docs_section() -> None:
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.TvmGraphError)]
    for cls in classes:
        assert f'<a id="{cls.__name__.lower()}"></a>' in docs, cls.__name__


def test_one_tensor_passed_twice_and_updated_in_place_names_the_arguments() -> None:
    """torch fails deep inside its decomposition ("expected compiled_fn to be GraphModule"),
    which read as an autograd.Function problem; the error names the two arguments that share
    memory and the fix. Without an in-place update the same call runs."""

    class Bumps(tvmgraph.nn.Graph):
        def build(self, a, b):
            a.add_(1)
            return a + b

    class Adds(tvmgraph.nn.Graph):
        def build(self, a, b):
            return a + b

    x = torch.zeros(3)
    with pytest.raises(errors.TraceError, match=r"Arguments 'a' and 'b' share memory .* `b\.clone\(\)`"):
        Bumps()(x, x)
    assert torch.equal(Adds()(x + 1, x + 1), torch.full((3,), 2.0))
    y = torch.ones(3)
    assert torch.equal(Adds()(y, y), torch.full((3,), 2.0))
    # Compiled for separate tensors, then called with one tensor (or overlapping views) twice:
    # the program read them as two, 1.0 off eager, silently; refused at every call now.
    bumps = Bumps()
    bumps(torch.zeros(3), torch.zeros(3))
    z = torch.zeros(4)
    for a, b in ((x, x), (z[:3], z[1:])):
        with pytest.raises(errors.GraphArgumentError, match=rf"{bumps.name}: arguments 'a' and 'b' share memory"):
            bumps(a, b)
    assert torch.equal(x, torch.zeros(3))


def test_a_slice_at_a_tensor_position_suggests_indexing_with_tensors() -> None:
    """A KV cache written at a position read from a tensor (`kc[:, p:p + n] = k`, p = pos[0]) is a
    data-dependent size that torch.export cannot trace; the hint spoke of `if x.sum() > 0` and
    .item() only. It names the slice and index_copy_ (which traces)."""

    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kc", torch.zeros(1, 16, 4))

        def forward(self, k, pos):
            p = pos[0]
            self.kc[:, p:p + k.shape[1]] = k
            return self.kc.sum(1)

    graph = ModuleGraph(Cache())
    with pytest.raises(errors.TraceError, match=r"A slice at a position read from a tensor .*index_copy_"):
        graph(torch.randn(1, 1, 4), torch.tensor([3]))
