"""Max pooling's gradient for windows that do not overlap, as one element-wise kernel.

TVM 0.27 legalizes `relax.grad.max_pool2d_backward` with TOPI's `pool_grad`: an argmax of each
window (the flat index of its first maximum), then, for every input element, a sum over the
windows that may cover it of `dy` where that window's argmax is this element. With windows that
do not overlap (stride = kernel, no padding: `nn.MaxPool1d(4)`, `nn.MaxPool2d(2)`) each element
lies in one window at most, and the sum's truncating divisions, range tests and int64 index
compares kept the kernel scalar: a raw-audio net's (16, 32, 1981) gradient ran at 7% of the
memory bandwidth. Here the window is `y // kh, x // kw` and the argmax a position in the window:

    argmax[n, c, i, j] = first (dy, dx) with the window's largest x   (TOPI's reducer: ties go to
                                                                       the first, as in torch)
    dx[n, c, y, x] = dy[n, c, y // kh, x // kw] if argmax[..] == (y % kh) * kw + x % kw else 0

(0 also past the last whole window). One window of more than MAX_UNROLLED_TAPS elements over
the whole plane (a global max pooling) is a max, the first offset that holds it, and a select
instead. Any other max pooling keeps TVM's legalization.

With static float32/float64 shapes on the CPU the kernel is built as loops (`window_loops`):
per plane (in parallel), per row of windows, 16 windows at a time (8 in float64): each row of
their inputs read as kw vectors, each tap a shuffle of them, the argmax kept in registers, the
outputs shuffled back into kw vectors and stored; the windows past the last whole vector one
at a time. The TE form (an argmax reduction, then a select through `col // kw` for every
output) left each output a scalar with its own divisions: alone, the raw-audio net's
(16, 32, 1981) gradient 1.37 -> 0.17 ms (torch's: 0.28-0.34), a (64, 64, 32, 32) one with 2x2
windows 2.9 -> 0.71 ms (torch's: 1.5). FuseOps no longer fuses the ReLU gradient after it (an
opaque kernel), and the step is still faster: the pooling and ReLU-gradient kernels of the
raw-audio net's step 3.50 -> 1.10 ms, VGG's 1.41 -> 1.01, the U-Net's 0.83 -> 0.30 (graph.profile).
A dynamic batch, half precision and GPU targets (whose schedules bind the TE form to threads)
keep the TE form.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops.grad import _grad_max_pool2d_backward

from .max_pool_forward import plane_max

_LEVEL = 11  # TVM registers its legalizations at level 10
VECTOR_BYTES = 64  # an AVX-512 register; LLVM splits the vectors on narrower units
MAX_UNROLLED_TAPS = 64  # a larger window over a whole plane is reduced, not unrolled


def _argmax_reducer() -> object:
    """TOPI's argmax reducer over (index, value): the larger value, on a tie the smaller index."""

    def combine(lhs, rhs):  # noqa: ANN001, ANN202  (TIR expressions)
        bigger = lhs[1] > rhs[1]
        index = tirx.Select(bigger | ((lhs[1] == rhs[1]) & (lhs[0] < rhs[0])), lhs[0], rhs[0])
        return index, tirx.Select(bigger, lhs[1], rhs[1])

    def identity(index_dtype, value_dtype):  # noqa: ANN001, ANN202
        return tirx.const(-1, index_dtype), tirx.min_value(value_dtype)

    return te.comm_reducer(combine, identity, name="argmax")


def non_overlapping_pool_grad(dy: te.Tensor, x: te.Tensor, kernel: tuple[int, int]) -> te.Tensor:
    """dx of a non-overlapping max pooling (NCHW) of `x` with `kernel`; see the module docstring."""
    kh, kw = kernel
    _, _, height, width = x.shape
    _, _, out_h, out_w = dy.shape
    dh = te.reduce_axis((0, kh), name="dh")
    dw = te.reduce_axis((0, kw), name="dw")
    argmax = _argmax_reducer()
    index, _ = te.compute(
        dy.shape,
        lambda n, c, i, j: argmax((dh * kw + dw, x[n, c, i * kh + dh, j * kw + dw]), axis=[dh, dw]),
        name="window_argmax")

    def dx(n, c, y, col):  # noqa: ANN001, ANN202  (te index variables)
        i, j = y // kh, col // kw
        window = (n, c, tirx.min(i, out_h - 1), tirx.min(j, out_w - 1))  # in bounds past the last one
        hit = tirx.all(i < out_h, j < out_w, index[window] == (y % kh) * kw + col % kw)
        return tirx.Select(hit, dy[window], tirx.const(0, dy.dtype))

    return te.compute((x.shape[0], x.shape[1], height, width), dx, name="max_pool_grad")


def window_loops(shape: tuple[int, int, int, int], kernel: tuple[int, int], dtype: str) -> tirx.PrimFunc:
    """dx of a non-overlapping max pooling of an x of static `shape` (NCHW) as loops over
    windows, `lanes` windows at a time (see the module docstring): the same numbers as
    `non_overlapping_pool_grad`."""
    n, c, height, width = shape
    kh, kw = kernel
    out_h, out_w = height // kh, width // kw
    lanes = VECTOR_BYTES // (tvm.DataType(dtype).bits // 8)
    dy = tirx.decl_buffer((n, c, out_h, out_w), dtype, "dy")
    x = tirx.decl_buffer((n, c, height, width), dtype, "x")
    dx = tirx.decl_buffer((n, c, height, width), dtype, "dx")
    plane, i, block, j, col, row, rest = (tirx.Var(name, "int64") for name in ("plane", "i", "block", "j", "col",
                                                                                 "row", "rest"))
    at = (tirx.floordiv(plane, _i64(c)), tirx.floormod(plane, _i64(c)))  # (n, c) of the plane
    zero = tirx.const(0, dtype)

    loops = []
    if out_w >= lanes:
        windows = _windows(x, dy, dx, at, i, block * _i64(lanes), kernel, lanes)
        loops.append(tirx.For(block, _i64(0), _i64(out_w // lanes), tirx.ForKind.SERIAL, windows))
    if out_w % lanes:
        windows = _windows(x, dy, dx, at, i, j, kernel, 1)
        loops.append(tirx.For(j, _i64(out_w - out_w % lanes), _i64(out_w % lanes), tirx.ForKind.SERIAL, windows))
    if width > out_w * kw:  # past the last whole window: no gradient
        zeros = [tirx.BufferStore(dx, zero, [*at, i * _i64(kh) + _i64(dh), col]) for dh in range(kh)]
        loops.append(tirx.For(col, _i64(out_w * kw), _i64(width - out_w * kw), tirx.ForKind.SERIAL, _seq(zeros)))
    per_plane = [tirx.For(i, _i64(0), _i64(out_h), tirx.ForKind.SERIAL, _seq(loops))]
    if height > out_h * kh:
        zeros = tirx.For(rest, _i64(0), _i64(width), tirx.ForKind.SERIAL, tirx.BufferStore(dx, zero, [*at, row, rest]))
        per_plane.append(tirx.For(row, _i64(out_h * kh), _i64(height - out_h * kh), tirx.ForKind.SERIAL, zeros))
    body = tirx.For(plane, _i64(0), _i64(n * c), tirx.ForKind.PARALLEL, _seq(per_plane))
    return tirx.PrimFunc([dy, x, dx], body).with_attrs({"tirx.noalias": True, "tirx.is_scheduled": True})


def _windows(x: tirx.Buffer, dy: tirx.Buffer, dx: tirx.Buffer, at: tuple, i: tirx.Var, first: tirx.PrimExpr,
             kernel: tuple[int, int], lanes: int) -> tirx.Stmt:
    """The gradient of `lanes` windows of output row `i` from window `first`. With lanes > 1,
    each row of the windows is read as kw vectors, and tap (dh, dw) of every window is a shuffle
    of them (lanes dw, dw + kw, ...); each window's outputs are shuffled back the same way."""
    kh, kw = kernel
    vector = lanes > 1

    def lanes_of(value: int, dtype: str) -> tirx.PrimExpr:
        return tirx.Broadcast(tirx.const(value, dtype), lanes) if vector else tirx.const(value, dtype)

    def row(dh: int) -> list[tirx.PrimExpr]:
        return [*at, i * _i64(kh) + _i64(dh)]

    start = first * _i64(kw)
    taps = []  # in window order (dh, dw): the tap's value in each window
    for dh in range(kh):
        if vector:
            parts = [tirx.BufferLoad(x, [*row(dh), tirx.Ramp(start + _i64(q * lanes), _i64(1), lanes)]) for q in range(kw)]
            taps += [tirx.Shuffle(parts, [_i32(l * kw + dw) for l in range(lanes)]) for dw in range(kw)]
        else:
            taps += [tirx.BufferLoad(x, [*row(dh), start + _i64(dw)]) for dw in range(kw)]
    bindings = []

    def bind(name: str, value: tirx.PrimExpr) -> tirx.Var:
        var = tirx.Var(name, value.ty)
        bindings.append(tirx.Bind(var, value))
        return var

    values = [bind(f"tap{k}", tap) for k, tap in enumerate(taps)]
    # The running maximum lives in a local buffer, not in let bindings: TVM's simplifier
    # substitutes a let's value into its uses, and once PropagateNaN has made each Max a Select
    # that reads the previous maximum twice, a 3x3 window's chain grew 2^9-fold and
    # s_tir.StmtSimplify never finished. A load is not substituted.
    best = tirx.decl_buffer((lanes,), dy.dtype, "best", scope="local")
    at_best = [tirx.Ramp(_i64(0), _i64(1), lanes) if vector else _i64(0)]
    bindings += [tirx.AllocBuffer(best), tirx.BufferStore(best, values[0], at_best)]
    index = lanes_of(0, "int32")
    for k in range(1, len(values)):  # a later tap wins only when larger: ties keep the first, as torch
        index = bind(f"index{k}", tirx.Select(values[k] > tirx.BufferLoad(best, at_best), lanes_of(k, "int32"),
                                              index))
        bindings.append(tirx.BufferStore(best, tirx.Max(tirx.BufferLoad(best, at_best), values[k]), at_best))
    grad = bind("grad", tirx.BufferLoad(dy, [*at, i, tirx.Ramp(first, _i64(1), lanes) if vector else first]))
    zero = lanes_of(0, dy.dtype)
    outputs = [bind(f"out{k}", tirx.Select(index == lanes_of(k, "int32"), grad, zero)) for k in range(len(values))]
    stores = []
    for dh in range(kh):
        mine = outputs[dh * kw:(dh + 1) * kw]
        if vector:
            for q in range(kw):  # output q * lanes + p of the row is tap p % kw of window p // kw
                picks = [_i32((p % kw) * lanes + p // kw) for p in range(q * lanes, (q + 1) * lanes)]
                where = tirx.Ramp(start + _i64(q * lanes), _i64(1), lanes)
                stores.append(tirx.BufferStore(dx, tirx.Shuffle(mine, picks), [*row(dh), where]))
        else:
            stores += [tirx.BufferStore(dx, mine[dw], [*row(dh), start + _i64(dw)]) for dw in range(kw)]
    return _seq(bindings + stores)


def _i64(value: int) -> tirx.PrimExpr:
    return tirx.const(value, "int64")


def _i32(value: int) -> tirx.PrimExpr:
    return tirx.const(value, "int32")


def _seq(stmts: list[tirx.Stmt]) -> tirx.Stmt:
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _non_overlapping(call: relax.Call) -> tuple[int, int] | None:
    """The kernel of a max pooling gradient whose windows do not overlap (NCHW, stride = kernel,
    no padding, no dilation, floor mode, static window), else None."""
    attrs = call.attrs
    kernel = [int(k) for k in attrs.pool_size]
    if (str(attrs.layout) != "NCHW" or [int(s) for s in attrs.strides] != kernel
            or any(int(p) for p in attrs.padding) or any(int(d) != 1 for d in attrs.dilation)
            or bool(attrs.ceil_mode)):
        return None
    return kernel[0], kernel[1]


def _first_maximum(x: te.Tensor, maximum: te.Tensor) -> te.Tensor:
    """The flat offset in each (n, c) plane of x of its first element equal to `maximum` (or
    its first NaN). A min over offsets: a tuple (argmax) reducer came out wrong under the
    default CPU schedules (converters_nn._pool_indices)."""
    batch, channels, height, width = x.shape
    h, w = te.reduce_axis((0, height), name="h"), te.reduce_axis((0, width), name="w")
    none = tirx.const(2**31 - 1, "int32")

    def first(n, c):  # noqa: ANN001, ANN202  (te index variables)
        value = x[n, c, h, w]
        hit = tirx.any(value == maximum[n, c, 0, 0], tirx.isnan(value))
        return te.min(tirx.Select(hit, tirx.Cast("int32", h * width + w), none), axis=[h, w])

    return te.compute((batch, channels), first, name="first_maximum")


def _whole_plane_grad(dy: te.Tensor, x: te.Tensor, first: te.Tensor) -> te.Tensor:
    """dx of one window over the whole plane: dy at the plane's first maximum, 0 elsewhere."""
    width = x.shape[3]

    def dx(n, c, y, col):  # noqa: ANN001, ANN202  (te index variables)
        hit = tirx.Cast("int32", y * width + col) == first[n, c]
        return tirx.Select(hit, dy[n, c, 0, 0], tirx.const(0, dy.dtype))

    return te.compute(x.shape, dx, name="max_pool_grad")


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    kernel = _non_overlapping(call)
    if kernel is None:
        return _grad_max_pool2d_backward(bb, call)
    dy, x = call.args
    shape = x.ty.shape.values
    if all(isinstance(d, tvm.tirx.IntImm) for d in shape[2:]) and kernel == (int(shape[2]), int(shape[3])) \
            and kernel[0] * kernel[1] > MAX_UNROLLED_TAPS:
        # One large window over the plane (a global max pooling): a max, the first offset that
        # holds it, a select. The window loops would unroll one tap per element of the plane
        # (16 x 256 x 32 x 32, the step of sum(pool(p) * w): 5.9 -> 3.1 ms; 7 x 7 planes stay
        # unrolled, 3.0 ms against 4.5 this way).
        # the forward's kernel (from -inf after MinusInfinityPool: a plane of -inf has a first maximum)
        maximum = bb.emit(bb.call_te(plane_max, x, 2, primfunc_name_hint="max_pool_plane_max"))
        first = bb.emit(bb.call_te(_first_maximum, x, maximum, primfunc_name_hint="max_pool_first_maximum"))
        return bb.call_te(_whole_plane_grad, dy, x, first, primfunc_name_hint="max_pool2d_backward")
    target = tvm.target.Target.current(allow_none=True)
    on_cpu = target is None or target.kind.name == "llvm"  # GPUs: the TE form, which dlight binds to threads
    if on_cpu and x.ty.dtype.dtype in ("float32", "float64") and all(isinstance(d, tvm.tirx.IntImm) for d in shape):
        func = window_loops(tuple(int(d) for d in shape), kernel, x.ty.dtype.dtype)
        gv = bb.add_func(func, "max_pool2d_backward")
        return relax.call_tir(gv, [dy, x], relax.TensorType(x.ty.shape, x.ty.dtype.dtype))
    return bb.call_te(non_overlapping_pool_grad, dy, x, kernel, primfunc_name_hint="max_pool2d_backward")


tvm.ir.register_op_attr("relax.grad.max_pool2d_backward", "FLegalize", _legalize, level=_LEVEL)
