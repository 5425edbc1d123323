"""DropCallTuples: after CallTIRRewrite, a call with several outputs is read through its
tensors, and the tuple of them goes."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te

from relay_passes.drop_call_tuples import DropCallTuples
from tvmgraph.config import compile_options
from tvmgraph.pipeline import get_pipeline

CPU = tvm.target.Target({"kind": "llvm"})


def _two_outputs() -> tvm.IRModule:
    """main(x) = the second output of k(the first output of k(x)), k(x) = (x * 0.5, x + 1)."""
    x = te.placeholder((4, 8), "float32", name="x")
    half, plus = te.compute((4, 8), lambda i, j: (x[i, j] * 0.5, x[i, j] + 1.0), name="k")
    # opaque (op pattern 8), as tvmgraph's own kernels are: FuseOps keeps the two calls
    kernel = te.create_prim_func([x, half, plus]).without_attr("global_symbol").with_attr("op_pattern", 8)
    bb = relax.BlockBuilder()
    arg = relax.Var("x", relax.TensorType((4, 8), "float32"))
    ty = relax.TensorType((4, 8), "float32")
    with bb.function("main", [arg]):
        with bb.dataflow():
            gv = bb.add_func(kernel, "k")
            first = bb.emit(relax.call_tir(gv, [arg], [ty, ty]))
            second = bb.emit(relax.call_tir(gv, [bb.emit(relax.TupleGetItem(first, 0))], [ty, ty]))
            out = bb.emit_output(relax.TupleGetItem(second, 1))
        bb.emit_func_output(out)
    return bb.get()


def _lowered() -> tvm.IRModule:
    """The module as the pipeline has it when DropCallTuples runs."""
    with CPU:
        return get_pipeline(CPU, compile_options(None), checks=False).until("DropCallTuples")(_two_outputs())


def _tuple_bindings(mod: tvm.IRModule) -> list[relax.Var]:
    return [b.var for block in mod["main"].body.blocks for b in block.bindings if isinstance(b.value, relax.Tuple)]


def test_the_calls_tuples_are_read_through_and_dropped() -> None:
    before = _lowered()
    assert len(_tuple_bindings(before)) == 2  # what CallTIRRewrite leaves: one per call
    reports = []
    after = DropCallTuples(reports.append)(before)
    assert not _tuple_bindings(after)
    assert not any(isinstance(b.value, relax.TupleGetItem) for block in after["main"].body.blocks
                   for b in block.bindings)
    assert reports == ["DropCallTuples: unread output tuple x2"]


def test_results_are_unchanged() -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    results = []
    for full in (False, True):
        passes = get_pipeline(CPU, compile_options(None), checks=True).passes
        if not full:
            passes = [p for p in passes if p.info.name != "DropCallTuples"]
        with CPU:
            mod = tvm.transform.Sequential(passes)(_two_outputs())
        vm = relax.VirtualMachine(tvm.compile(mod, target=CPU, relax_pipeline=None), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[1], x * 0.5 + 1.0, rtol=1e-6)


def test_a_tuple_something_reads_stays() -> None:
    """A tuple the function returns is read: it stays."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((2,), "float32"))
    with bb.function("main", [a]):
        pair = bb.emit(relax.Tuple([a, a]))
        bb.emit_func_output(pair)
    mod = bb.get()
    after = DropCallTuples()(mod)
    assert len(_tuple_bindings(after)) == 1
