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


def test_tied_indices_are_checked_by_the_values_they_pick() -> None:
    """topk/sort/kthvalue/mode leave the index among equal values unspecified: other indices of
    the same values pass, indices of other values do not, and a stable sort's must be eager's."""
    from torch.testing._internal.common_methods_invocations import SampleInput, op_db

    ops = {op.name: op for op in op_db if op.name in ("topk", "sort") and not op.variant_test_name}
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 5.0]])
    topk = sweep.prepare(ops["topk"], torch.float32, 0, SampleInput(x, args=(2, 1)))
    values, indices = topk.expected
    other = torch.tensor([[2, 1], [3, 0]]) if indices[1, 1] != 0 else torch.tensor([[2, 1], [3, 1]])
    assert sweep.compare([values, other], topk.expected, sweep.TOLERANCES)[0] == "mismatch"
    assert sweep._picks_tied_values(topk, [values, other])
    assert not sweep._picks_tied_values(topk, [values, torch.tensor([[2, 3], [3, 0]])])  # picks 0.0
    assert not sweep._picks_tied_values(topk, [values + 1, other])
    stable = sweep.prepare(ops["sort"], torch.float32, 0, SampleInput(x, kwargs={"dim": 1, "stable": True}))
    swapped = stable.expected[1].clone()
    swapped[0, 2:] = swapped[0, 2:].flip(0)  # the two 3.0s the other way round
    assert not sweep._picks_tied_values(stable, [stable.expected[0], swapped])
