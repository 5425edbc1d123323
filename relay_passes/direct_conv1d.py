"""DirectConv1d: a 1-D convolution computed over whole vectors of output columns, then cropped.

TVM 0.27 legalizes `relax.nn.conv1d` with TOPI's `conv1d_ncw`, which no tvmgraph schedule rule
took: a raw-audio net's three convolutions ran at 22-31% of the FMA peak, 60% of its inference.
Its rows are rarely whole vectors (1981, 493, 121 columns: `(W + padding - K) / stride + 1`),
and a first layer reads raw samples at a stride (4 in M5), so output columns in the vector
lanes would read the input at the stride. Here the conv1d becomes one kernel of three steps:

    phases[n, c, p, j]  = x[n, c, j*s + p - pad]    (0 outside x; the input split by position
                                                      modulo the stride: contiguous per phase)
    padded[n, f, col]   = sum over c, q, p of phases[n, c, p, col + q] * w[f, c, q*s + p]
                                                    (col up to L rounded up to whole
                                                      register tiles: `padded_row`)
    out[n, f, col]      = padded[n, f, col]          (col < L)

so that `tvmgraph/schedules/conv1d.py` tiles `padded` into registers (output channels x whole
vectors of columns), each step loading contiguous columns of one phase and broadcasting one
weight per channel, with no bounds test inside the reduction. The phases of x are copied per
tile of columns (L1), the crop and the epilogue (bias, activation: FuseOps fuses them in, the
kernel is marked out-element-wise fusable) are done on the tile before its store. With stride 1
there is one phase and the copy only adds the zeros. A kernel length that the stride does not
divide reads zero weights for the missing offsets (`w` is copied into [F, C, s, K/s] first).

Exact up to the order of the sums. Position: after autodiff (a training step's forward conv1d;
its gradients are conv2ds, tvmgraph/gradients/conv.py), CPU targets only. Limits: NCW/OIW,
groups 1, dilation 1, static channels, width and kernel (the batch may be symbolic), float32
and float64 with the result in the input's type (16-bit convolutions keep TVM's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import current_cpu, graph_functions, report_counts
from relay_passes.rebind import rebind
from tvmgraph.schedules.conv1d import BLOCK, padded_row
from tvmgraph.schedules.cpu_target import CPUTarget

OUT_EWISE_FUSABLE = 4  # TVM's OpPatternKind kOutEWiseFusable: FuseOps fuses element-wise ops after it


def padded_conv1d(x: te.Tensor, w: te.Tensor, stride: int, padding: tuple[int, int],
                  rows: int) -> te.Tensor:
    """conv1d(x, w) (NCW, OIW, groups 1, dilation 1) as phases, a product over `rows` columns
    (at least the output's) and a crop."""
    _, channels, width = x.shape
    filters, _, kernel = (int(d) for d in w.shape)
    channels, width = int(channels), int(width)
    left, right = padding
    length = (width + left + right - kernel) // stride + 1
    assert rows >= length, (rows, length)
    taps = -(-kernel // stride)  # kernel offsets per phase
    zero = tirx.const(0, x.dtype)

    def phase(n, c, p, j):  # noqa: ANN001, ANN202  (te index variables)
        at = j * stride + p - left
        return tirx.if_then_else(tirx.all(at >= 0, at < width), x[n, c, tirx.min(tirx.max(at, 0), width - 1)], zero)

    phases = te.compute((x.shape[0], channels, stride, rows + taps - 1), phase, name="conv1d_phases")
    if stride > 1 or kernel % stride:
        w = te.compute((filters, channels, stride, taps),
                       lambda f, c, p, q: tirx.if_then_else(q * stride + p < kernel,
                                                            w[f, c, tirx.min(q * stride + p, kernel - 1)], zero),
                       name="conv1d_weight_phases")

        def weight(f, c, p, q):  # noqa: ANN001, ANN202
            return w[f, c, p, q]
    else:
        def weight(f, c, p, q):  # noqa: ANN001, ANN202, ARG001
            return w[f, c, q]
    rc = te.reduce_axis((0, channels), name="rc")
    rq = te.reduce_axis((0, taps), name="rq")
    rp = te.reduce_axis((0, stride), name="rp")
    padded = te.compute(
        (x.shape[0], filters, rows),
        lambda n, f, col: te.sum(phases[n, rc, rp, col + rq] * weight(f, rc, rp, rq), axis=[rc, rq, rp]),
        name=BLOCK)
    return te.compute((x.shape[0], filters, length), lambda n, f, col: padded[n, f, col], name="conv1d_crop")


def _ints(values: object) -> list[int]:
    return [int(v) for v in values]  # type: ignore[union-attr]


def _supported(call: relax.Call) -> bool:
    """NCW/OIW, groups 1, dilation 1, static sizes but the batch, float32/64 in and out."""
    attrs = call.attrs
    x, w = call.args
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
        return False
    if int(attrs.groups) != 1 or _ints(attrs.dilation) != [1]:
        return False
    dtypes = {str(x.ty.dtype), str(w.ty.dtype), str(call.ty.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in ("float32", "float64"):
        return False
    x_shape, w_shape = getattr(x.ty, "shape", None), getattr(w.ty, "shape", None)
    if x_shape is None or w_shape is None or len(x_shape) != 3:
        return False
    return all(isinstance(d, tirx.IntImm) for d in (*x_shape.values[1:], *w_shape.values))


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cpu: CPUTarget) -> None:
        super().__init__(mod)
        self.cpu = cpu
        self.counts: Counter[str] = Counter()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        rebind(self, binding, self.visit_expr(binding.value))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv1d" and _supported(call)):
            return call
        stride = int(call.attrs.strides[0])
        padding = tuple(_ints(call.attrs.padding))
        length = int(call.ty.shape[2])
        rows = padded_row(self.cpu, length, str(call.ty.dtype))
        self.counts[f"conv1d stride {stride}, {length} -> {rows} columns"] += 1
        bb = self.builder_
        out = bb.emit_te(padded_conv1d, *call.args, stride, padding, rows, primfunc_name_hint="conv1d")
        gv = bb.lookup_binding(out).args[0]
        bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OUT_EWISE_FUSABLE))
        return out


@tvm.transform.module_pass(opt_level=0, name="DirectConv1d")
class DirectConv1d:
    """Compute each supported conv1d as `padded_conv1d` (under an llvm target)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        cpu = current_cpu()
        if cpu is None:
            return mod
        rewriter = _Rewriter(mod, cpu)
        for gv, func in graph_functions(mod):
            rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
        report_counts(self.report, "DirectConv1d", rewriter.counts)
        return rewriter.builder_.get() if rewriter.counts else mod
