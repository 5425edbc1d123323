"""PyTorch's OpInfo samples through tvmgraph graphs against eager, forward and gradient.

The sweep itself is tests/numeric/opinfo_sweep.py (scope, tolerances, batching, the worker
subprocess). CI runs the first usable float32 sample of every in-scope op;
`TVMGRAPH_TEST_OPINFO=all` runs every sample in every dtype the op supports. The test fails on
any `mismatch`, `raw` or `crash` that `KNOWN_FAILURES` does not list, and on a listed failure
that no longer happens (so that the table stays true: delete the entry when you fix the op).
`TVMGRAPH_TEST_OPINFO_DOCS=1` also rewrites docs/ops.md from the run. KNOWN_FAILURES describes the
CI slice: in all mode, failures seen only in other samples or dtypes (bfloat16 training, say) are
reported as new.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.numeric import opinfo_sweep as sweep

# (op, phase): (kind, reason seen), from the CI slice (float32, first usable sample).
KNOWN_FAILURES: dict[tuple[str, str], tuple[str, str]] = {
    ("acos", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.acos"),
    ("acosh", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.acosh"),
    ("asin", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.asin"),
    ("asinh", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.asinh"),
    ("atan", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.atan"),
    ("atan2", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.atan2"),
    ("atanh", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.atanh"),
    ("block_diag", "gradient"): ("raw", "CompileError: idx_node->value > back_node->value (0 vs. 0) : split_indices must b"),
    ("combinations", "gradient"): ("raw", "CompileError: (var_binding) is false:"),
    ("cosh", "forward"): ("raw", "CompileError: unknown intrinsic tirx.cosh"),
    ("cumprod", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.cumprod"),
    ("div.floor_rounding", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.floor_divide"),
    ("diagonal", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.einsum"),
    ("diagonal_copy", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.einsum"),
    ("fmod", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.mod"),
    ("remainder", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.floor_mod"),
    ("max.reduction_with_dim", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.topk"),
    ("max.reduction_no_dim", "gradient"): ("raw", "CompileError: Var lv2 is not defined"),
    ("median", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.median"),
    ("min.reduction_no_dim", "gradient"): ("raw", "CompileError: Var lv2 is not defined"),
    ("quantile", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.argsort"),
    ("nanquantile", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.logical_not"),
    ("heaviside", "forward"): ("raw", "CompileError: TypeError: Binary operators must have the same datatype for both operands. However, R.where(lv, "),
    ("as_strided.partial_views", "forward"): ("raw", "CompileError: AssertionError: as_strided with non-contiguous stride [1, 2] forsize [2, 2] is not supported"),
    ("native_group_norm", "forward"): ("mismatch", "output 1: torch.float32[1, 6, 3], eager torch.float32[1, 2]"),
    ("native_group_norm", "gradient"): ("raw", "CompileError: ValueError: In relax.multiply, ..."),
    ("native_layer_norm", "forward"): ("mismatch", "output 1: torch.float32[1, 2, 3], eager torch.float32[1, 1, 1]"),
    ("nn.functional.adaptive_avg_pool3d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.adaptive_avg_pool3d"),
    ("nn.functional.avg_pool3d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.avg_pool3d"),
    ("nn.functional.conv_transpose1d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.conv1d_transpose"),
    ("nn.functional.conv_transpose2d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.conv2d_transpose"),
    ("nn.functional.conv_transpose3d", "forward"): ("raw", "CompileError: ValueError: Unsupported transposed convolution dimensionality: 5"),
    ("nn.functional.conv3d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.conv3d"),
    ("nn.functional.pad.circular", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.slice_scatter"),
    ("nn.functional.unfold", "forward"): ("raw", "CompileError: ValueError: index_tensor: cannot broadcast index shapes. Mismatch at axis 0: T.int64(0) vs T.int"),
    ("nn.functional.interpolate.linear", "forward"): ("raw", "CompileError: RuntimeError: Cannot convert infinity to BigInt"),
    ("nn.functional.interpolate.bicubic", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.arange"),
    ("nn.functional.interpolate.trilinear", "forward"): ("raw", "CompileError: ValueError: index_tensor: cannot broadcast index shapes. Mismatch at axis 0: T.int64(2) vs T.int"),
    ("_upsample_bilinear2d_aa", "forward"): ("mismatch", "output 0: max abs diff 7.42 (eager's largest 2.19)"),
    ("_upsample_bilinear2d_aa", "gradient"): ("mismatch", "output 0: max abs diff 2.13 (eager's largest 0.18)"),
    ("nn.functional.avg_pool2d", "forward"): ("mismatch", "output 0: max abs diff 13.7 (eager's largest 17.6)"),
    ("nn.functional.avg_pool2d", "gradient"): ("mismatch", "output 0: max abs diff 4.02 (eager's largest 5.44)"),
    ("nn.functional.max_pool1d", "forward"): ("mismatch", "output 1: torch.float32[1, 2, 1], eager torch.int64[1, 2, 1]"),
    ("nn.functional.max_pool1d", "gradient"): ("mismatch", "output 0: max abs diff 0.654 (eager's largest 0.661)"),
    ("nn.functional.max_pool2d", "forward"): ("mismatch", "output 1: torch.float32[1, 2, 1, 3], eager torch.int64[1, 2, 1, 3]"),
    ("nn.functional.max_pool3d", "forward"): ("mismatch", "output 1: torch.float32[1, 2, 1, 3, 2], eager torch.int64[1, 2, 1, 3, 2]"),
    ("nn.functional.max_pool3d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.nn.max_pool3d"),
    ("nn.functional.max_unpool1d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.max_unpool1d.grad", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.max_unpool2d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.max_unpool2d.grad", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.max_unpool3d", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.max_unpool3d.grad", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("nn.functional.selu", "forward"): ("mismatch", "output 0: max abs diff 0.293 (eager's largest 6.07)"),
    ("nn.functional.selu", "gradient"): ("mismatch", "output 0: max abs diff 0.0896 (eager's largest 1.86)"),
    ("torch.ops.aten._safe_softmax.default", "gradient"): ("mismatch", "output 0: max abs diff inf (eager's largest 0.0746), 15 NaN differ"),
    ("topk", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.topk"),
    ("roll", "gradient"): ("raw", "ExecutionError: the compiled program failed while running: ValueError: expected to be compact array"),
    ("sinh", "forward"): ("raw", "CompileError: unknown intrinsic tirx.sinh"),
    ("slice_scatter", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.slice_scatter"),
    ("tan", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.tan"),
    ("index_fill", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("index_copy", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("index_select", "forward"): ("raw", "CompileError: ValueError: In relax.take, ..."),
    ("index_add", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.index_put"),
    ("sort", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.argsort"),
    ("scatter", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.scatter_elements"),
    ("bfloat16", "gradient"): ("raw", "CompileError: The differentiation target must be a float scalar (0-dim Tensor), but the Type of"),
    ("zeros", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("full", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("eye", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("scalar_tensor", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("stack", "gradient"): ("raw", "CompileError: Expected nested to match tuple"),
    ("msort", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.argsort"),
    ("trace", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.einsum"),
    ("norm.inf", "gradient"): ("raw", "CompileError: Var lv2 is not defined"),
    ("nn.functional.grid_sample", "forward"): ("mismatch", "output 0: torch.float32[2, 3, 5, 2], eager torch.float32[2, 3, 5, 5]"),
    ("nn.functional.grid_sample", "gradient"): ("raw", "CompileError: ValueError: In relax.multiply, ..."),
    ("grid_sampler_2d", "forward"): ("mismatch", "output 0: torch.float32[2, 3, 10, 2], eager torch.float32[2, 3, 13, 10]"),
    ("grid_sampler_2d", "gradient"): ("raw", "CompileError: ValueError: In relax.multiply, ..."),
    ("argmax", "forward"): ("raw", "CompileError: ndim != 0 (0 vs. 0) : Cannot reduce a 0 dim Tensor"),
    ("argmin", "forward"): ("raw", "CompileError: ndim != 0 (0 vs. 0) : Cannot reduce a 0 dim Tensor"),
    ("nanmean", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.logical_not"),
    ("prod", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.prod"),
    ("signal.windows.hamming", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.hann", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.bartlett", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.blackman", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.cosine", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.exponential", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.gaussian", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.kaiser", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.general_cosine", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.general_hamming", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("signal.windows.nuttall", "forward"): ("mismatch", "output 0 is a tvm.runtime._tensor.Tensor, not a torch.Tensor (graph without tensor inputs)"),
    ("masked.cumprod", "gradient"): ("raw", "CompileError: no FPrimalGradient for relax.cumprod"),
    ("masked.argmax", "forward"): ("raw", "CompileError: ndim != 0 (0 vs. 0) : Cannot reduce a 0 dim Tensor"),
    ("masked.argmin", "forward"): ("raw", "CompileError: ndim != 0 (0 vs. 0) : Cannot reduce a 0 dim Tensor"),
}


def _unexpected(table: list[sweep.Row]) -> tuple[list[str], list[str]]:
    """(new failures, known failures that did not happen) in a sweep's table."""
    new, fixed = [], []
    for row in table:
        for phase, cell in (("forward", row.forward), ("gradient", row.gradient)):
            kind = cell.split(" ")[0]
            known = KNOWN_FAILURES.get((row.op, phase))
            if kind in sweep.FAILURES and (known is None or known[0] != kind):
                new.append(f"{row.op} {phase}: {cell}: {row.reason}")
            elif known is not None and known[0] != kind:
                fixed.append(f"{row.op} {phase}: known {known[0]} ({known[1]}), now {cell}")
    return new, fixed


@pytest.mark.slow
def test_opinfo_samples_match_eager() -> None:
    """Every in-scope op's sample gives eager's outputs and gradients, or a tvmgraph error that
    says it is unsupported; the failures of today are exactly those in KNOWN_FAILURES."""
    ops, skipped = sweep.in_scope_ops()
    keys = [sweep.op_key(op) for op in ops]
    results, unusable = sweep.sweep(keys)
    table = sweep.rows(results, keys, unusable)
    if os.environ.get("TVMGRAPH_TEST_OPINFO_DOCS") == "1":
        sweep.DOCS.write_text(sweep.render(table, skipped, sweep.MODE))
    new, fixed = _unexpected(table)
    message = []
    if new:
        message += [f"{len(new)} new failure(s) (fix them, or list them in KNOWN_FAILURES):", *new]
    if fixed:
        message += [f"{len(fixed)} known failure(s) no longer seen (delete them from KNOWN_FAILURES):", *fixed]
    assert not message, "\n".join(message)


@pytest.mark.slow
def test_a_crashing_graph_is_recorded_and_the_sweep_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph that kills the worker process (here: abort() before neg's graph) is `crash` for
    that op alone; the ops batched with it are rerun one by one and get their own results."""
    monkeypatch.setenv("TVMGRAPH_TEST_OPINFO_CRASH", "neg")
    results, _ = sweep.sweep(["abs", "neg", "sin"], mode="ci")
    status = {(r.op, r.phase): r.status for r in results}
    assert status == {("abs", "forward"): "ok", ("abs", "gradient"): "ok", ("neg", "forward"): "crash",
                      ("neg", "gradient"): "-", ("sin", "forward"): "ok", ("sin", "gradient"): "ok"}
    crash = next(r for r in results if r.status == "crash")
    assert signal.Signals.SIGABRT.name in crash.reason


def test_compare_reports_values_dtypes_and_shapes() -> None:
    """A wrong value, dtype or shape is a mismatch naming the output; NaN where eager has NaN is not."""
    e = torch.tensor([1.0, float("nan"), 3.0])
    assert sweep.compare([e.clone()], [e], sweep.TOLERANCES) == ("ok", "")
    status, reason = sweep.compare([e + torch.tensor([0.0, 0.0, 0.1])], [e], sweep.TOLERANCES)
    assert status == "mismatch" and reason.startswith("output 0: max abs diff 0.1")
    assert sweep.compare([e.double()], [e], sweep.TOLERANCES) == (
        "mismatch", "output 0: torch.float64[3], eager torch.float32[3]")
    assert sweep.compare([e[:2]], [e], sweep.TOLERANCES)[0] == "mismatch"
    assert sweep.compare([torch.tensor([1, 2])], [torch.tensor([1, 3])], sweep.TOLERANCES)[0] == "mismatch"


def test_classify_separates_tvmgraph_errors_from_bugs() -> None:
    """UnsupportedOpError (and other deliberate tvmgraph errors) are `unsupported`; CompileError,
    ExecutionError and any foreign exception are `raw`."""
    from tvmgraph import errors

    unsupported = errors.UnsupportedOpError(
        "ForwardBatch_3: 1 op(s) used in build() have no lowering to TVM Relax:\n"
        "  * aten.erfinv.default from 'calls.0' (OpCall)\nRewrite that code")
    assert sweep.classify(unsupported) == ("unsupported", "no lowering: aten.erfinv.default")
    assert sweep.classify(errors.TraceError("ForwardBatch_0: x"))[0] == "unsupported"
    assert sweep.classify(errors.CompileError("TrainBatch_7: compiling build() failed inside TVM "
                                              "(InternalError: boom). This is a tvmgraph bug")) == (
        "raw", "CompileError: InternalError: boom")
    assert sweep.classify(errors.ExecutionError("x"))[0] == "raw"
    assert sweep.classify(ValueError("x")) == ("raw", "ValueError: x")
