"""PyTorch's OpInfo samples run through tvmgraph graphs and compared with eager: the op-coverage sweep.

For every in-scope op of `op_db` (see `out_of_scope`), each chosen sample is run

* forward: in an inference graph whose `build()` calls the op on the sample and returns its outputs,
  compared with eager at the per-dtype `TOLERANCES`;
* gradient: in a training graph where every input tensor that OpInfo marks differentiable is an
  `nn.Parameter` of a registered module, loss = sum(output * w) over the floating outputs (`w` a
  fixed random tensor per output), and SGD(lr=1, momentum=0), so that `before - after` is the
  gradient; compared with `torch.autograd.grad` of the same loss in eager.

Each (op, sample, phase) gets a status (`STATUSES`). Graphs are batched: one graph runs up to
`BATCH` samples; when it raises, its half-batches are retried until the failing sample is alone.
The graphs run in a worker subprocess that reports one JSON line per event; when the worker dies
(segfault, abort, hang past `TIMEOUT_S`), `sweep` restarts it, runs the samples of the graph that
was running one by one, and records the one that kills the process as `crash`.

    python -m tests.numeric.opinfo_sweep            # the CI slice; writes docs/ops.md
    TVMGRAPH_TEST_OPINFO=all python -m tests.numeric.opinfo_sweep   # every sample and dtype
    python -m tests.numeric.opinfo_sweep worker JOB.json           # (what sweep() runs)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import unittest
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "ops.md"
# "ci": first usable float32 sample per op (another dtype for ops without float32);
# "ci:bfloat16" (any dtype name): that dtype's; "all"
MODE = os.environ.get("TVMGRAPH_TEST_OPINFO", "ci")
# A comma-separated list of op keys (`name` or `name.variant`) sweeps only those.
ONLY = [k for k in os.environ.get("TVMGRAPH_TEST_OPINFO_OPS", "").split(",") if k]
BATCH = 12          # samples per graph: fewer compiles; a failure costs ~2*log2(BATCH) retries
TIMEOUT_S = 300     # one graph (trace + compile + run) taking longer than this counts as a crash
ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool)

# Graph vs eager, by dtype of the compared tensor. float32: TVM's kernels (fast math, other
# summation orders) are not bit-exact with ATen's; gradients add one reduction and the lr=1 update.
TOLERANCES = {
    torch.float64: dict(atol=1e-7, rtol=1e-7),
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
GRAD_TOLERANCES = {
    torch.float64: dict(atol=1e-6, rtol=1e-6),
    torch.float32: dict(atol=1e-4, rtol=1e-3),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}
EXACT = dict(atol=0.0, rtol=0.0)

# Worst first: an op's row shows its worst sample.
STATUSES = ("crash", "mismatch", "raw", "unsupported", "ok")
FAILURES = ("crash", "mismatch", "raw")


# ---- scope: which ops are swept, and why the others are not ----

# Decompositions and solvers (and what needs them: a norm or rank through singular values), but
# those lowered through LU or Cholesky kernels (converters_linalg.py, converters_cholesky.py):
# det, slogdet, inv, solve, cholesky, triangular and Cholesky solves. The products, norms and
# shape ops of torch.linalg are swept.
LINALG = {
    "geqrf", "lu", "lu_solve", "lu_unpack", "matrix_exp", "ormqr", "pca_lowrank", "pinverse", "qr", "svd",
    "svd_lowrank", "triangular_solve", "norm.nuc",
    "linalg.cond", "linalg.eig", "linalg.eigh", "linalg.eigvals", "linalg.eigvalsh", "linalg.householder_product",
    "linalg.ldl_factor", "linalg.ldl_factor_ex", "linalg.ldl_solve", "linalg.lstsq", "linalg.lstsq.grad_oriented",
    "linalg.lu", "linalg.lu_factor", "linalg.lu_factor_ex", "linalg.lu_solve", "linalg.matrix_rank",
    "linalg.matrix_rank.hermitian", "linalg.pinv", "linalg.pinv.hermitian", "linalg.pinv.singular", "linalg.qr",
    "linalg.svd", "linalg.svdvals",
}
RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal", "uniform",
    "rand_like", "randint", "randint_like", "randn", "randn_like", "nn.functional.dropout",
    "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "nn.functional.rrelu",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.multi_head_attention_forward",
}
DATA_DEPENDENT_SHAPE = {
    "unique", "unique_consecutive", "bincount",
    "histogram", "histogramdd", "_segment_reduce",
}
UNINITIALIZED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
COMPLEX = {"complex", "polar", "view_as_complex", "cfloat", "cdouble", "chalf", "stft", "istft"}
NO_TENSOR_RESULT = {"item", "equal", "allclose", "broadcast_shapes", "tolist"}
MUTATING = {"resize_", "resize_as_", "zero_", "fill", "put",
            "_unsafe_masked_index_put_accumulate"}


def out_of_scope(op: Any) -> str | None:
    """Why an OpInfo is left out of the sweep, or None when it is swept."""
    name = op.name
    if not any(dtype in op.supported_dtypes("cpu") for dtype in ALL_DTYPES):
        return "no CPU kernel for float32, float64, bfloat16, int64, int32 or bool"
    in_place = name.endswith("_") and not name.startswith("__")  # `__getitem__`, `__radd__` are not
    if in_place or op.variant_test_name == "in_place" or name in MUTATING:
        return "in-place: mutates its input (graphs are functional)"
    if name.startswith("jiterator_"):
        return "CUDA-only (jiterator)"
    if "sparse" in name:
        return "sparse tensors"
    if name in LINALG or f"{name}.{op.variant_test_name}" in LINALG:
        return "linear algebra (decompositions, solvers): not lowered by design"
    if name.startswith("fft.") or name in COMPLEX:
        return "complex results: tvmgraph has no complex dtype"
    if name in RANDOM:
        return "random: eager and graph draw different numbers"
    if name in DATA_DEPENDENT_SHAPE:
        return "output shape depends on the values (no static shape to compile)"
    if name in UNINITIALIZED:
        return "uninitialized memory: nothing to compare"
    if name in NO_TENSOR_RESULT:
        return "returns a Python value, not a tensor"
    return None


def op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def in_scope_ops() -> tuple[list[Any], dict[str, str]]:
    """The swept OpInfos (op_db order) and, for the others, why not."""
    from torch.testing._internal.common_methods_invocations import op_db

    swept, skipped = [], {}
    for op in op_db:
        if ONLY and op_key(op) not in ONLY:
            continue
        reason = out_of_scope(op)
        if reason is None:
            swept.append(op)
        else:
            skipped[op_key(op)] = reason
    return swept, skipped


# ---- one sample, prepared in eager ----

@dataclasses.dataclass
class Case:
    """One OpInfo sample with everything eager says about it."""

    id: str
    op: Any
    dtype: torch.dtype
    leaves: list[Any]              # pytree leaves of (input, args, kwargs); tensors detached
    spec: Any
    tensor_at: list[int]           # leaves that are tensors (graph inputs or parameters)
    param_at: list[int]            # of those, the differentiable ones (parameters in the training graph)
    expected: list[torch.Tensor]   # eager outputs, flattened
    loss_at: list[int]             # outputs eager differentiates (floating, requires_grad)
    weights: list[torch.Tensor]    # one per loss_at output: loss = sum(out * w)
    grads: list[torch.Tensor]      # eager d loss / d leaves[param_at]
    grad_note: str                 # why there is no gradient check, if there is none

    def call(self, leaves: list[Any]) -> list[torch.Tensor]:
        args_in, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return pytree.tree_leaves(self.op(args_in, *args, **kwargs))

    def loss(self, outputs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor | None:
        terms = [(outputs[i] * w).sum() for i, w in zip(self.loss_at, weights)]
        return sum(terms[1:], terms[0]) if terms else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _detached(leaves: list[Any]) -> list[Any]:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]


def prepare(op: Any, dtype: torch.dtype, index: int, sample: Any) -> Case | str:
    """The Case for one sample, or why the sample cannot be compared (a string)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    wants_grad = [i for i in tensor_at if leaves[i].requires_grad and leaves[i].is_floating_point()]
    case = Case(f"{op_key(op)}|{_name(dtype)}|{index}", op, dtype, _detached(leaves),
                spec, tensor_at, [], [], [], [], [], "")
    try:
        with torch.no_grad():
            first = case.call(_detached(case.leaves))
            second = case.call(_detached(case.leaves))
    except Exception as e:  # noqa: BLE001 - any eager failure makes the sample unusable
        return f"eager raises {type(e).__name__}"
    if not first or not all(isinstance(t, torch.Tensor) for t in first):
        return "non-tensor output"
    if any(t.is_complex() for t in first):
        return "complex output"
    if any(t.layout != torch.strided for t in first):
        return "sparse output"
    same = (a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(first, second))
    if not all(same):
        return "random: two eager runs differ"
    case.expected = [t.clone() for t in first]
    if not op.supports_autograd:
        case.grad_note = "no autograd (OpInfo)"
    elif _eager_gradient_wrong(op):
        case.grad_note = "eager's gradient is wrong (OpInfo expects its gradcheck to fail)"
    elif not wants_grad:
        case.grad_note = "no differentiable input"
    else:
        _eager_grads(case, wants_grad)
    return case


def _eager_gradient_wrong(op: Any) -> bool:
    """OpInfo marks TestBwdGradients.test_fn_grad an expected failure: eager's backward fails
    gradcheck (as_strided_scatter's gradient for self lands on the overwritten elements)."""
    return any(getattr(d, "cls_name", None) == "TestBwdGradients" and d.test_name == "test_fn_grad"
               and unittest.expectedFailure in d.decorators for d in op.decorators)


def _eager_grads(case: Case, wants_grad: list[int]) -> None:
    leaves = _detached(case.leaves)
    for i in wants_grad:
        leaves[i].requires_grad_(True)
    try:
        outputs = case.call(leaves)
        # Only outputs eager differentiates: autograd ignores e.g. native_batch_norm's saved
        # mean and invstd, which a decomposed graph would differentiate through.
        case.loss_at = [i for i, o in enumerate(outputs) if o.is_floating_point() and o.requires_grad]
        generator = torch.Generator().manual_seed(1)
        case.weights = [torch.randn(outputs[i].shape, generator=generator).to(outputs[i].dtype)
                        for i in case.loss_at]
        loss = case.loss(outputs, case.weights)
        if loss is None:
            case.grad_note = "no differentiable output"
            return
        grads = torch.autograd.grad(loss, [leaves[i] for i in wants_grad], allow_unused=True)
    except Exception as e:  # noqa: BLE001 - eager has no gradient for this sample
        case.grad_note = f"eager backward raises {type(e).__name__}"
        return
    # An input eager gives no gradient to stays a plain graph input (nothing to update).
    case.param_at = [i for i, g in zip(wants_grad, grads) if g is not None]
    case.grads = [g for g in grads if g is not None]
    if not case.param_at:
        case.grad_note = "no input gets a gradient"


def cases_for(op: Any, mode: str) -> Iterator[Case | tuple[str, str]]:
    """The Cases of one op: the first usable sample of the mode's dtype ("ci"), or every sample of
    every dtype in ALL_DTYPES the op supports ("all"). Unusable samples come as (id, reason)."""
    first_only = mode.startswith("ci")
    supported = [d for d in ALL_DTYPES if d in op.supported_dtypes("cpu")]
    dtypes = [_ci_dtype(mode, supported)] if first_only else supported
    reasons = []
    for dtype in dtypes:
        torch.manual_seed(0)
        try:
            grad = op.supports_autograd and dtype.is_floating_point
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))
        except Exception as e:  # noqa: BLE001
            yield f"{op_key(op)}|{_name(dtype)}|-", f"sample_inputs raises {type(e).__name__}"
            continue
        for index, sample in enumerate(samples):
            case = prepare(op, dtype, index, sample)
            if isinstance(case, Case):
                yield case
                if first_only:
                    return
            else:
                reasons.append(case)
                if not first_only:
                    yield f"{op_key(op)}|{_name(dtype)}|{index}", case
    if first_only:
        yield f"{op_key(op)}|{_name(dtypes[0])}|-", "no usable sample: " + (", ".join(sorted(set(reasons))) or "none")


def _ci_dtype(mode: str, supported: list[torch.dtype] | None = None) -> torch.dtype:
    """The dtype of a "ci" mode: the one named after "ci:", else float32, else (an op without a
    float32 kernel: bitwise ops, one_hot, gcd) the first of ALL_DTYPES in `supported`."""
    name = mode.partition(":")[2]
    if not name:
        return torch.float32 if not supported or torch.float32 in supported else supported[0]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"TVMGRAPH_TEST_OPINFO={mode!r}: {name!r} is not a torch dtype")
    return dtype


# ---- the graphs ----

def _make_graphs():
    """The two graph classes (tvmgraph is imported in the worker only)."""
    import tvmgraph

    class OpCall(torch.nn.Module):
        """One sample's op call; its differentiable inputs are this module's parameters."""

        def __init__(self, case: Case, train: bool):
            super().__init__()
            self.case = case
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(case.leaves[i].clone()) for i in case.param_at] if train else [])
            self.inputs_at = [i for i in case.tensor_at if not (train and i in case.param_at)]

        def forward(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
            leaves = list(self.case.leaves)
            for i, x in zip(self.inputs_at, inputs):
                leaves[i] = x
            for i, p in zip(self.case.param_at if len(self.params) else [], self.params):
                leaves[i] = p
            return self.case.call(leaves)

    class ForwardBatch(tvmgraph.nn.Graph):
        def __init__(self, cases: list[Case]):
            super().__init__()
            self.calls = torch.nn.ModuleList([OpCall(c, train=False) for c in cases])

        def build(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outputs, at = [], 0
            for call in self.calls:
                n = len(call.inputs_at)
                outputs += call(*flat[at:at + n])
                at += n
            return tuple(outputs)

    class TrainBatch(tvmgraph.nn.Graph):
        def __init__(self, cases: list[Case]):
            super().__init__()
            self.calls = torch.nn.ModuleList([OpCall(c, train=True) for c in cases])
            self.add_optimizer(torch.optim.SGD(self.calls.parameters(), lr=1.0, momentum=0.0))

        def build(self, *flat: torch.Tensor) -> torch.Tensor:
            loss, at = None, 0
            for call in self.calls:
                n, w = len(call.inputs_at), len(call.case.weights)
                term = call.case.loss(call(*flat[at:at + n]), list(flat[at + n:at + n + w]))
                loss = term if loss is None else loss + term.to(loss.dtype)
                at += n + w
            loss.backward()
            return loss

    return ForwardBatch, TrainBatch


def _forward(graph_cls: type, cases: list[Case]) -> dict[str, tuple[str, str]]:
    graph = graph_cls(cases)
    flat = [c.leaves[i] for c in cases for i in c.tensor_at]
    outputs = list(graph(*_detached(flat)))
    results, at = {}, 0
    for c in cases:
        got, at = outputs[at:at + len(c.expected)], at + len(c.expected)
        results[c.id] = compare(got, c.expected, TOLERANCES)
        if results[c.id][0] == "mismatch" and (_picks_tied_values(c, got) or _closer_to_exact(c, got)):
            results[c.id] = ("ok", "")
    return results


def _closer_to_exact(case: Case, got: list[torch.Tensor]) -> bool:
    """Whether every output is at least as close to a more exact result as eager's, elementwise,
    within the dtype's tolerance: for a 16-bit float sample, the op computed in float64 on the
    same inputs; for a float64 sample of a unary op with a NumPy/SciPy reference in OpInfo, that.

    torch computes some 16-bit ops in 16-bit steps (addbmm rounds after each batch's product,
    grid_sample interpolates in bfloat16) where tvmgraph computes in float32 and rounds once
    (tvmgraph/half_in_float32.py, relay_passes/accumulate_float32.py), and torch's float64 Bessel
    functions are off by ~2e-7 near their zeros where tvmgraph calls libm (converters_special.py):
    a difference from eager that is eager's error is not a wrong number."""
    if len(got) != len(case.expected):
        return False
    try:
        if case.dtype in (torch.bfloat16, torch.float16):
            wide = [x.double() if isinstance(x, torch.Tensor) and x.dtype == case.dtype else x for x in case.leaves]
            with torch.no_grad():
                exact = case.call(_detached(wide))
        elif case.dtype == torch.float64 and _unary_reference(case) is not None:
            exact = [_unary_reference(case)]
        else:
            return False
    except Exception:  # noqa: BLE001 - no float64 kernel or reference: no verdict
        return False
    tol = TOLERANCES[case.dtype]
    for g, e, x in zip(got, case.expected, exact):
        if g.shape != e.shape or g.dtype != e.dtype or not g.is_floating_point() or x.shape != e.shape:
            return False
        g, e, x = g.double(), e.double(), x.double()
        slack = tol["atol"] + tol["rtol"] * x.abs()
        closer = ((g - x).abs() <= (e - x).abs() + slack) | (g.isnan() & e.isnan())
        if not bool(closer.all()):
            return False
    return True


# Ops whose index output torch leaves unspecified among equal values ("the indices of ties may
# be any"), with the position of `dim` among their arguments after the input: bfloat16 and
# integer samples tie often. Their indices are checked by what they pick instead.
TIED_INDEX_DIM = {"sort": 0, "argsort": 0, "topk": 1, "kthvalue": 1, "mode": 0, "median": 0, "nanmedian": 0}


def _picks_tied_values(case: Case, got: list[torch.Tensor]) -> bool:
    """For an op of TIED_INDEX_DIM (a stable sort excluded): whether its indices (its last
    output) pick out of the input exactly what eager's pick, and any values output is eager's."""
    position = TIED_INDEX_DIM.get(case.op.name)
    x, args, kwargs = pytree.tree_unflatten(case.leaves, case.spec)
    if position is None or len(got) != len(case.expected) or kwargs.get("stable") or not isinstance(x, torch.Tensor):
        return False
    *values, indices = got
    if values and compare(values, case.expected[:-1], TOLERANCES)[0] != "ok":
        return False
    if indices.dtype != torch.int64 or indices.shape != case.expected[-1].shape:
        return False
    if x.dim() == 0:
        return bool((indices == 0).all())
    dim = kwargs.get("dim", args[position] if len(args) > position else -1)

    def picked(i: torch.Tensor) -> torch.Tensor:
        return x.gather(dim, i if i.dim() == x.dim() else i.unsqueeze(dim)).nan_to_num()

    return torch.equal(picked(indices), picked(case.expected[-1]))


def _gradient(graph_cls: type, cases: list[Case]) -> dict[str, tuple[str, str]]:
    graph = graph_cls(cases)
    before = [p.detach().clone() for p in graph.calls.parameters()]
    flat = []
    for c in cases:
        flat += [c.leaves[i] for i in c.tensor_at if i not in c.param_at] + c.weights
    graph(*_detached(flat))
    after = [p.detach() for p in graph.calls.parameters()]
    results, at = {}, 0
    for c in cases:
        n = len(c.param_at)
        # Where a parameter is not finite (a sample's -inf), before - after is NaN whatever the
        # gradient: those elements carry no information and take eager's value.
        got = [torch.where(b.isfinite(), b - a, e) if b.is_floating_point() and e.shape == b.shape else b - a
               for b, a, e in zip(before[at:at + n], after[at:at + n], c.grads)]
        # before - after loses the bits of |param| that the gradient does not have: widen atol.
        slack = max((b[b.isfinite()].abs().max().item() for b in before[at:at + n] if b.isfinite().any()),
                    default=0.0)
        results[c.id] = compare(got, c.grads, GRAD_TOLERANCES, slack=slack)
        at += n
    return results


def _unary_reference(case: Case) -> torch.Tensor | None:
    """OpInfo's NumPy/SciPy reference of a one-tensor sample (`scipy.special.j0`), if it has one."""
    ref = getattr(case.op, "ref", None)
    args_in, args, kwargs = pytree.tree_unflatten(case.leaves, case.spec)
    if ref is None or args or kwargs or not isinstance(args_in, torch.Tensor):
        return None
    return torch.as_tensor(ref(args_in.numpy()))


def compare(got: list[torch.Tensor], expected: list[torch.Tensor], table: dict,
            slack: float = 0.0) -> tuple[str, str]:
    """("ok", "") or ("mismatch", what differs first) for graph outputs against eager."""
    if len(got) != len(expected):
        return "mismatch", f"{len(got)} outputs, eager has {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(g, torch.Tensor):
            return "mismatch", f"output {i} is a {type(g).__module__}.{type(g).__name__}, not a torch.Tensor"
        if g.shape != e.shape or g.dtype != e.dtype:
            return "mismatch", f"output {i}: {g.dtype}{list(g.shape)}, eager {e.dtype}{list(e.shape)}"
        tol = dict(table.get(e.dtype, EXACT))
        if e.is_floating_point():
            tol["atol"] += 2 * torch.finfo(e.dtype).eps * slack
        try:
            torch.testing.assert_close(g, e, equal_nan=True, **tol)
        except AssertionError:
            g, e = g.double(), e.double()
            both_nan = g.isnan() & e.isnan()
            diff = (g - e).abs().masked_fill(both_nan, 0).nan_to_num(float("inf"))
            nan = (g.isnan() != e.isnan()).sum().item()
            where = f", {nan} NaN differ" if nan else ""
            return "mismatch", (f"output {i}: max abs diff {diff.max().item():.3g} (eager's largest "
                                f"{e.abs().nan_to_num(0).max().item():.3g}){where}")
    return "ok", ""


def classify(error: BaseException) -> tuple[str, str]:
    """An exception from a graph: `unsupported` for a deliberate tvmgraph error, else `raw`."""
    from tvmgraph.errors import CompileError, ExecutionError, TvmGraphError, UnsupportedOpError

    text = str(error).split("\nSee docs/")[0]
    if isinstance(error, UnsupportedOpError):  # lists `* aten.op from ...` or `* relax.op: ...`
        listed = {line.split()[1].rstrip(":") for line in text.splitlines() if line.strip().startswith("* ")}
        for kind, prefix in (("no lowering", "aten."), ("no gradient", "relax.")):
            ops = sorted(op for op in listed if op.startswith(prefix))
            if ops:
                return "unsupported", f"{kind}: " + ", ".join(ops)
        return "unsupported", _one_line(text)
    if isinstance(error, TvmGraphError) and not isinstance(error, (CompileError, ExecutionError)):
        return "unsupported", f"{type(error).__name__}: {_one_line(text)}"
    return "raw", f"{type(error).__name__}: {_one_line(text)}"


def _one_line(text: str) -> str:
    text = re.sub(r"\b(ForwardBatch|TrainBatch)_\d+: ", "", " ".join(text.split()))  # our graphs' names
    # CompileError's wrapping and TVM's check conditions say nothing about the op.
    if "compiling build() failed inside TVM (" in text:
        text = text.replace("compiling build() failed inside TVM (", "").split(". This is a tvmgraph bug")[0]
        text = text.removesuffix(")")
    text = re.sub(r"Check failed: \(.*?\) is false: ", "", text)
    text = re.sub(r'ir\.Op\(span=None.*?name="([\w.]+)".*?support_level=\d+\)', r"\1", text)  # an Op's repr
    return text[:200].rstrip()


# ---- the worker: runs cases, one JSON line per event ----

def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _run(run_graph, graph_cls: type, cases: list[Case], phase: str) -> dict[str, tuple[str, str]]:
    """Run cases in one graph; on an exception, halve until each failure is alone."""
    _emit(event="begin", phase=phase, ids=[c.id for c in cases])
    crash_on = os.environ.get("TVMGRAPH_TEST_OPINFO_CRASH")  # the crash test's hook
    if crash_on and any(c.op.name == crash_on for c in cases):
        os.abort()
    try:
        return run_graph(graph_cls, cases)
    except Exception as e:  # noqa: BLE001 - every failure is classified, none ends the sweep
        if len(cases) == 1:
            return {cases[0].id: classify(e)}
        half = len(cases) // 2
        first = _run(run_graph, graph_cls, cases[:half], phase)
        return {**first, **_run(run_graph, graph_cls, cases[half:], phase)}
    finally:
        gc.collect()


def _batches(cases: list[Case], solo: set[str]) -> Iterator[list[Case]]:
    batch = []
    for case in cases:
        if case.id in solo:
            yield [case]
            continue
        batch.append(case)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def worker(job_path: str) -> None:
    """Run the job (ops, mode, ids to skip, ids to run alone) and report on stdout."""
    job = json.loads(Path(job_path).read_text())
    from torch.testing._internal.common_methods_invocations import op_db

    forward_cls, train_cls = _make_graphs()
    wanted = set(job["ops"])
    skip, solo = set(job["skip"]), set(job["solo"])
    pending: list[Case] = []

    def flush() -> None:
        for batch in _batches(pending, solo):
            forward = _run(_forward, forward_cls, batch, "forward")
            for c in batch:
                status, reason = forward[c.id]
                _emit(event="result", id=c.id, phase="forward", status=status, reason=reason)
            trainable = [c for c in batch if c.param_at and forward[c.id][0] in ("ok", "mismatch")]
            gradient = _run(_gradient, train_cls, trainable, "gradient") if trainable else {}
            for c in batch:
                not_run = c.grad_note or f"not run: forward {forward[c.id][0]}"
                status, reason = gradient.get(c.id, ("-", not_run))
                _emit(event="result", id=c.id, phase="gradient", status=status, reason=reason)
        pending.clear()

    for op in op_db:
        if op_key(op) not in wanted:
            continue
        for case in cases_for(op, job["mode"]):
            if not isinstance(case, Case):
                _emit(event="unusable", id=case[0], reason=case[1])
            elif case.id not in skip:
                pending.append(case)
        if len(pending) >= BATCH:
            flush()
    flush()
    _emit(event="finished")


# ---- the parent: restarts the worker after a crash ----

@dataclasses.dataclass
class Result:
    id: str
    phase: str      # "forward" or "gradient"
    status: str     # one of STATUSES, or "-" (not checked)
    reason: str

    @property
    def op(self) -> str:
        return self.id.split("|")[0]


def sweep(ops: list[str], mode: str = MODE,
          timeout_s: float = TIMEOUT_S) -> tuple[list[Result], dict[str, str]]:
    """Run the worker over `ops` until every case has a result; return the results and the
    unusable samples ({id: reason})."""
    results: dict[tuple[str, str], Result] = {}
    unusable: dict[str, str] = {}
    solo: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="opinfo-") as tmp:
        while True:
            done = {i for (i, phase) in results if phase == "gradient"}
            job = Path(tmp) / "job.json"
            job.write_text(json.dumps({"ops": ops, "mode": mode, "skip": sorted(done), "solo": sorted(solo)}))
            running, rc, stderr = _watch(job, results, unusable, Path(tmp) / "stderr.txt", timeout_s)
            if rc == 0 and running is None:
                break
            if running is None:
                raise RuntimeError(f"the OpInfo worker died outside any graph (rc={rc}):\n{stderr}")
            phase, ids = running
            if len(ids) > 1:
                solo.update(ids)  # rerun that graph's cases alone to find the one that crashes
                continue
            last = (stderr.strip().splitlines() or [""])[-1]
            reason = f"worker died in this graph ({_signal_name(rc)}): {last}"
            results[(ids[0], phase)] = Result(ids[0], phase, "crash", _one_line(reason))
            if phase == "forward":
                results[(ids[0], "gradient")] = Result(ids[0], "gradient", "-", "not run: forward crash")
    return sorted(results.values(), key=lambda r: (r.id, r.phase)), unusable


def _signal_name(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc < 0:
        return signal.Signals(-rc).name
    return f"exit {rc}"


def _watch(job: Path, results: dict, unusable: dict, stderr_path: Path, timeout_s: float):
    """Run one worker to its end; return (phase and ids of the graph it died in, or None; rc; stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               TVMGRAPH_COMPILE_CACHE="0")
    with open(stderr_path, "w") as err, subprocess.Popen(
            [sys.executable, "-m", "tests.numeric.opinfo_sweep", "worker", str(job)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        running, rc = None, None
        while True:
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                log.warning("OpInfo worker: no progress for %ss in %s; killing it", timeout_s, running)
                proc.kill()
                while lines.get() is not None:  # let the reader reach EOF before the pipe closes
                    pass
                proc.wait()
                break
            if line is None:
                rc = proc.wait()
                break
            event = json.loads(line)
            if event["event"] == "begin":
                running = (event["phase"], event["ids"])
                log.info("%s of %d sample(s): %s", *running[:1], len(running[1]), ", ".join(running[1]))
            elif event["event"] == "result":
                results[(event["id"], event["phase"])] = Result(event["id"], event["phase"], event["status"],
                                                                event["reason"])
                running = None
            elif event["event"] == "unusable":
                unusable[event["id"]] = event["reason"]
            elif event["event"] == "finished":
                running = None
    return running, rc, stderr_path.read_text()[-2000:]


# ---- the table in docs/ops.md ----

@dataclasses.dataclass
class Row:
    op: str
    forward: str
    gradient: str
    reason: str


def rows(results: list[Result], ops: list[str], unusable: dict[str, str]) -> list[Row]:
    """One row per swept op: its worst forward and gradient status, with the reason."""
    by_op: dict[str, list[Result]] = {}
    for r in results:
        by_op.setdefault(r.op, []).append(r)
    table = []
    for op in ops:
        found = by_op.get(op, [])
        if not found:
            reasons = {v for k, v in unusable.items() if k.split("|")[0] == op}
            table.append(Row(op, "n/a", "n/a", "; ".join(sorted(reasons)) or "no sample"))
            continue
        cells, reasons = [], []
        for phase in ("forward", "gradient"):
            phase_results = [r for r in found if r.phase == phase]
            worst = _worst(phase_results)
            count = sum(r.status == "ok" for r in phase_results)
            checked = sum(r.status != "-" for r in phase_results)
            cells.append(worst.status if len(phase_results) == 1 or worst.status == "-" else
                         f"{worst.status} ({count}/{checked} ok)")
            if worst.status not in ("ok",) and worst.reason:
                reasons.append(f"{phase}: {worst.reason}" if worst.status != "-" else worst.reason)
        table.append(Row(op, cells[0], cells[1], "; ".join(dict.fromkeys(reasons))))
    return table


def _worst(results: list[Result]) -> Result:
    order = {s: i for i, s in enumerate(STATUSES)}
    checked = [r for r in results if r.status != "-"] or results
    return min(checked, key=lambda r: order.get(r.status, len(order)))


def summary(table: list[Row]) -> dict[str, Any]:
    """The headline numbers of docs/ops.md."""
    status = lambda cell: cell.split(" ")[0]  # noqa: E731
    swept = [r for r in table if r.forward != "n/a"]
    # Ops with a gradient to check: eager has one (whether or not the graph got as far as running it).
    graded = [r for r in swept if status(r.gradient) != "-" or "forward " in r.reason.split(";")[-1]]
    counts = {s: sum(status(r.forward) == s for r in swept) + sum(status(r.gradient) == s for r in swept)
              for s in STATUSES}
    return dict(ops=len(table), swept=len(swept),
                forward_ok=sum(status(r.forward) == "ok" for r in swept),
                graded=len(graded), gradient_ok=sum(status(r.gradient) == "ok" for r in graded), **counts)


def render(table: list[Row], skipped: dict[str, str], mode: str) -> str:
    s = summary(table)
    pct = lambda a, b: f"{100 * a / b:.0f}%" if b else "-"  # noqa: E731
    command = ("python -m tests.numeric.opinfo_sweep" if mode == "ci"
               else f"TVMGRAPH_TEST_OPINFO={mode} python -m tests.numeric.opinfo_sweep")
    lines = [
        "# Op coverage: PyTorch OpInfo samples through tvmgraph",
        "",
        "Generated by `tests/numeric/opinfo_sweep.py`; do not edit by hand. Regenerate from the repository",
        f"root with `PYTHONPATH=. {command}` (12-25 min on 2 cores), or with the test:",
        "`TVMGRAPH_TEST_OPINFO_DOCS=1 python -m pytest tests/numeric/test_opinfo.py`.",
        "",
        "Each in-scope op of PyTorch's OpInfo database",
        "(`torch.testing._internal.common_methods_invocations.op_db`) runs "
        + (f"its first usable {_name(_ci_dtype(mode))} sample (without a float32 kernel: its first "
           "dtype of float64, bfloat16, int64, int32 and bool)" if mode == "ci" else
           f"its first usable {_name(_ci_dtype(mode))} sample" if mode.startswith("ci") else
           "every sample in each of float32, float64, bfloat16, int64, int32 and bool it supports")
        + " through two tvmgraph graphs, compared with eager:",
        "",
        "- **forward**: an inference graph returning the op's outputs (per-dtype `TOLERANCES` in the",
        "  sweep).",
        "- **gradient**: a training graph where the inputs OpInfo marks differentiable are parameters of a",
        "  registered module, loss = sum(output * fixed random tensor) over the outputs eager",
        "  differentiates, `SGD(lr=1, momentum=0)`: `before - after` is the gradient, compared with",
        "  `torch.autograd.grad` in eager.",
        "",
        "Status: `ok`; `unsupported` (tvmgraph refused with its own error, e.g. `UnsupportedOpError`:",
        "acceptable); `mismatch` (a wrong number, dtype or shape: the worst); `raw` (an exception that is",
        "not a tvmgraph error, or a `CompileError`/`ExecutionError`: a tvmgraph bug); `crash` (the process",
        "died); `-` (not checked: the reason says why). Several samples (all mode): the worst, with the",
        "count of `ok`. Out of scope, listed at the end with the reason: random ops, in-place ops, sparse,",
        "linear algebra, complex results, data-dependent output shapes, ops returning Python values.",
        "",
        "`python -m pytest tests/numeric/test_opinfo.py` runs the same sweep and fails on any mismatch,",
        "raw error or crash missing from its `KNOWN_FAILURES` table, and on a known failure that no",
        "longer happens. To run everything: `TVMGRAPH_TEST_OPINFO=all` (every sample and dtype: hours);",
        "`TVMGRAPH_TEST_OPINFO_OPS=abs,nn.functional.relu` sweeps only those ops.",
        "",
        "## Summary",
        "",
        f"- ops in op_db: {s['ops'] + len(skipped)}; swept: {s['ops']} "
        f"({s['swept']} with a usable sample); out of scope: {len(skipped)}",
        f"- forward ok: {s['forward_ok']} / {s['swept']} ({pct(s['forward_ok'], s['swept'])})",
        f"- gradient ok: {s['gradient_ok']} / {s['graded']} ({pct(s['gradient_ok'], s['graded'])}) "
        "of the ops with a gradient to check",
        f"- results (forward + gradient): {s['mismatch']} mismatch, {s['raw']} raw, {s['crash']} crash, "
        f"{s['unsupported']} unsupported",
        "",
        "## Swept ops",
        "",
        "| op | forward | gradient | reason |",
        "| --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(f"| `{r.op}` | {r.forward} | {r.gradient} | {r.reason.replace('|', '/')} |")
    lines += ["", "## Out of scope", "", "| op | why |", "| --- | --- |"]
    lines += [f"| `{op}` | {why} |" for op, why in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2])
        return
    ops, skipped = in_scope_ops()
    keys = [op_key(op) for op in ops]
    started = time.monotonic()
    results, unusable = sweep(keys)
    table = rows(results, keys, unusable)
    DOCS.write_text(render(table, skipped, MODE))
    log.info("swept %d ops in %.0f s: %s; wrote %s", len(keys), time.monotonic() - started, summary(table),
             DOCS)


if __name__ == "__main__":
    main()
