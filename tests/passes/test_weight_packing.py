"""MarkPackedWeights and LiftFrozenComputation: a frozen weight's packing leaves `main` for `pack_weights`.

`relu(x @ W.T + b)` at 64 x 256 -> 512 with W and b frozen (main's parameters 1 and 2): before,
one kernel packs W and multiplies; after, `pack_weights(W, b)` packs W, and main takes the
packed W as its last parameter and runs the product alone. Built, `main(x, W, b,
*pack_weights(W, b))` is numpy's result.
"""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax, tirx

from relay_passes.weight_packing import FROZEN_PARAMS, PACK_FUNCTION, LiftFrozenComputation, MarkPackedWeights
from tvmgraph.codegen import build_executable
from tvmgraph.schedules import ApplyCPUSchedules
from tvmgraph.schedules.cpu_target import CPUTarget
from tvmgraph.schedules.matmul import WEIGHT_PACK
from tvmgraph.target import target_for

TARGET = target_for(torch.device("cpu"))
T = relax.transform


def _linear(rows: int, frozen: list[int]) -> tvm.IRModule:
    """The fused kernel of relu(x @ W.T + b), main marked as tvmgraph/frozen_weights.py does."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 256), "float32"))
    w = relax.Var("w", relax.TensorType((512, 256), "float32"))
    b = relax.Var("b", relax.TensorType((512,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, b)))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1).with_attr(FROZEN_PARAMS, frozen)
    with TARGET:
        return tvm.transform.Sequential([T.FuseTransposeMatmul(), T.LegalizeOps(), T.AnnotateTIROpPattern(),
                                         T.FuseOps(), T.FuseTIR()])(mod)


def _kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _pipeline(mod: tvm.IRModule) -> tvm.IRModule:
    with TARGET:
        return LiftFrozenComputation()(ApplyCPUSchedules()(MarkPackedWeights()(mod)))


def test_the_kernel_reading_a_frozen_weight_lists_it_as_layout_free() -> None:
    before = _linear(64, frozen=[1, 2])
    (name, kernel), = _kernels(before).items()
    after = _kernels(MarkPackedWeights()(before))[name]
    assert "layout_free_buffers" not in kernel.attrs
    w, b = kernel.params[1], kernel.params[2]  # the fused kernel takes (x, w, b, out)
    assert [str(w), str(b)] == ["w", "b"]
    assert [int(i) for i in after.attrs["layout_free_buffers"]] == [1, 2]
    # Nothing frozen: nothing marked.
    assert "layout_free_buffers" not in _kernels(MarkPackedWeights()(_linear(64, frozen=[])))[name].attrs


def test_the_pack_moves_out_of_main_into_pack_weights() -> None:
    after = _pipeline(_linear(64, frozen=[1, 2]))
    main, pack = after["main"], after[PACK_FUNCTION]
    assert [p.name for p in main.params] == ["x", "w", "b", "lv_frozen"]
    assert [p.name for p in pack.params] == ["w", "b"]
    # Panels along K, a whole number of vectors wide (48 columns on AVX-512 Intel, 24 on AVX2).
    k, width = [int(d) for d in main.params[3].ty.shape][-2:]
    assert k == 256 and width % CPUTarget.from_target(TARGET).lanes("float32") == 0
    kernels = _kernels(after)
    (product,) = [n for n in kernels if n.endswith("_prepacked")]
    (packing,) = [n for n in kernels if n.endswith("_weight_prepack")]
    assert product in main.script() and packing not in main.script()
    assert packing in pack.script()
    # The annotation that marked the pack is gone with it.
    assert WEIGHT_PACK not in kernels[product].script() and WEIGHT_PACK not in kernels[packing].script()


def test_more_rows_or_nothing_frozen_keep_the_pack_in_the_kernel() -> None:
    for mod in (_linear(256, frozen=[1, 2]), _linear(64, frozen=[])):
        after = _pipeline(mod)
        assert PACK_FUNCTION not in [gv.name_hint for gv in after.get_global_vars()]
        assert len(after["main"].params) == 3


def test_built_it_computes_what_numpy_does() -> None:
    after = _pipeline(_linear(64, frozen=[1, 2]))
    with TARGET:
        after = tvm.transform.Sequential([
            T.ToNonDataflow(), T.RemovePurityChecking(), T.CallTIRRewrite(), T.StaticPlanBlockMemory(),
            T.LowerAllocTensor(), T.KillAfterLastUse(), T.LowerRuntimeBuiltin(), T.ComputePrimValue(),
            T.VMShapeLower(), T.AttachGlobalSymbol()])(after)
    vm = relax.VirtualMachine(build_executable(after, TARGET, kernel_checks=True), tvm.cpu())
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype("float32") for s in ((64, 256), (512, 256), (512,)))
    args = [tvm.runtime.tensor(a) for a in (x, w, b)]
    packed = vm[PACK_FUNCTION](*args[1:])
    out = vm["main"](*args, *packed).numpy()
    np.testing.assert_allclose(out, np.maximum(x @ w.T + b, 0), rtol=1e-4, atol=1e-4)


def test_kernels_on_frozen_values_alone_are_lifted_but_not_what_main_returns() -> None:
    """main(x, w): t = transpose(w); y = x @ t; d = w * 2; returns (y, d). The transpose (and
    the packing of t for the product) runs in pack_weights; d, returned, stays in main."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 256), "float32"))
    w = relax.Var("w", relax.TensorType((512, 256), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            t = bb.emit(relax.op.permute_dims(w))
            y = bb.emit(relax.op.matmul(x, t))
            d = bb.emit(relax.op.multiply(w, relax.const(2.0, "float32")))
            out = bb.emit_output(relax.Tuple([y, d]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1).with_attr(FROZEN_PARAMS, [1])
    with TARGET:
        mod = tvm.transform.Sequential([T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR()])(mod)
    before = mod["main"].script()
    assert "transpose" in before and "multiply" in before
    after = _pipeline(mod)
    main, pack = after["main"].script(), after[PACK_FUNCTION].script()
    assert "transpose" in pack and "transpose" not in main
    assert "multiply" in main and "multiply" not in pack
    assert len(after["main"].params) == 3  # x, w, and the packed transpose


def test_a_reshape_main_reads_stays_in_main_where_it_is_a_view() -> None:
    """main(x, w): x + reshape(w): the reshape is not lifted (kept, it would be a copy of the
    weight; in main RewriteDataflowReshape makes it a view), so nothing is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 512), "float32"))
    w = relax.Var("w", relax.TensorType((512, 64), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            r = bb.emit(relax.op.reshape(w, (64, 512)))
            out = bb.emit_output(relax.op.add(x, r))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1).with_attr(FROZEN_PARAMS, [1])
    with TARGET:
        mod = tvm.transform.Sequential([T.LegalizeOps(), T.AnnotateTIROpPattern()])(mod)
    assert "reshape" in mod["main"].script()
    after = _pipeline(mod)
    assert PACK_FUNCTION not in [gv.name_hint for gv in after.get_global_vars()]
    assert "reshape" in after["main"].script()
