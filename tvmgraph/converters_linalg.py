"""Square linear systems: `det`, `slogdet`/`logdet`, `inv` and `solve` (torch.linalg and the
torch.* aliases), which TVM 0.27 does not lower.

All four go through one LU factorization with partial pivoting (LAPACK's getrf, unblocked: at
step k the row with the largest |a[i, k]|, the first one on ties, is swapped up, the column
below the pivot divided by it and the trailing block updated) and one substitution (getrs: the
row swaps, then L, then U), loop kernels of tvmgraph/linalg_kernels.py. From them:

    det      = prod(diag(U)) * (-1)^(rows swapped)
    slogdet  = (sign of that product, sum(log|diag(U)|))     a singular matrix: (0, -inf)
    inv      = lu_solve(LU, I)
    solve    = lu_solve(LU, B)                               (left=True; B a matrix or a vector)

The kernels are stopped (`no_grad`): Relax's autodiff cannot differentiate a loop kernel. The
gradient comes from a first-order term whose value is exactly zero, written in Relax ops that
autodiff does differentiate, with the kernels' results as constants:

    det(A)     + sum(det * inv(A)^T * (A - stop(A)))          d det     = det * tr(A^-1 dA)
    logabsdet  + sum(inv(A)^T * (A - stop(A)))                d log|det| = tr(A^-1 dA)
    inv(A)     - inv(A) @ (A - stop(A)) @ inv(A)              d inv     = -A^-1 dA A^-1
    X          + inv(A) @ ((B - stop(B)) - (A - stop(A)) @ X)  d X       = A^-1 (dB - dA X)

so the gradients are torch's: `det * inv^T * g`, `inv^T * g`, `-inv^T g inv^T`, and for solve
`inv^T g` (B) and `-(inv^T g) X^T` (A). The coefficient is made finite first (a singular
matrix's inverse is inf): the term stays exactly zero and the value exact, but the gradient
of det at a singular matrix is then zero where torch's is the adjugate's.

Differences from eager: a singular matrix passed to `inv` or `solve` gives inf/NaN where torch
raises `LinAlgError` (the compiled program cannot raise on a computed value; `inv_ex`'s and
`solve_ex`'s `info` is always 0); static shapes and the CPU only (on a GPU the op is refused);
float32 and float64. The kernels are scalar loops, O(n^3) per matrix: meant for the small
matrices of a model (a flow's 1x1 convolution, a Gaussian process's kernel matrix), not for
n in the thousands.
"""

from __future__ import annotations

import functools
import math

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import _arg, _dtype
from .linalg_kernels import lu_factor_kernel, lu_solve_kernel

op = relax.op
DTYPES = ("float32", "float64")


def square_matrices(a: relax.Expr, what: str, arg: torch.fx.Node) -> tuple[list[int], int]:
    """(batch dims, n) of `a` (the value of the op's argument `arg`), a static [*batch, n, n]
    float32/float64 tensor on the CPU; any other raises NotImplementedError (an
    UnsupportedOpError naming the op)."""
    if arg.meta["val"].device.type != "cpu":
        raise NotImplementedError(f"{what} is lowered for the CPU only (its kernels are loops no GPU "
                                  f"schedule binds); compute it outside the graph")
    shape = a.ty.shape
    dims = [getattr(d, "value", None) for d in shape.values] if shape is not None else [None]
    if any(d is None for d in dims) or len(dims) < 2:
        raise NotImplementedError(f"{what} needs static shapes: leave config.enable_dynamic_batch() off for "
                                  f"this graph (one program per batch size)")
    if dims[-1] != dims[-2]:
        raise NotImplementedError(f"{what} of a non-square matrix ({dims[-2]} x {dims[-1]})")
    if _dtype(a) not in DTYPES:
        raise NotImplementedError(f"{what} in {_dtype(a)} (float32 and float64 are lowered)")
    return dims[:-2], dims[-1]


def broadcast_batches(bb: relax.BlockBuilder, a: relax.Expr, b: relax.Expr) -> tuple[relax.Expr, relax.Expr]:
    """a [*ba, n, n] and b [*bb, n, m] broadcast to one batch."""
    a_shape, b_shape = [int(d) for d in a.ty.shape.values], [int(d) for d in b.ty.shape.values]
    batch = list(torch.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))
    if a_shape[:-2] != batch:
        a = bb.emit(op.broadcast_to(a, [*batch, *a_shape[-2:]]))
    if b_shape[:-2] != batch:
        b = bb.emit(op.broadcast_to(b, [*batch, *b_shape[-2:]]))
    return a, b


class _Square:
    """A batch of square matrices `a` (shape [*batch, n, n]) flattened to [count, n, n], with its
    LU factorization emitted."""

    def __init__(self, bb: relax.BlockBuilder, a: relax.Expr, what: str, node: torch.fx.Node):
        self.batch, self.n = square_matrices(a, what, node.args[0])
        self.bb, self.a, self.dtype = bb, a, _dtype(a)
        self.count = math.prod(self.batch)
        self._inverse: relax.Expr | None = None
        self.stopped = stop(bb, a)
        self.empty = self.count == 0 or self.n == 0  # no kernels: det 1 (an empty product), inv 0 x 0
        if self.empty:
            self.lu = bb.emit(op.zeros([self.count, self.n, self.n], self.dtype))
            self.pivots = bb.emit(op.zeros([self.count, self.n], "int32"))
            return
        flat = bb.emit(op.reshape(self.stopped, [self.count, self.n, self.n]))
        factor = bb.add_func(lu_factor_kernel(self.count, self.n, self.dtype), "lu_factor")
        lu = bb.emit(relax.call_tir(factor, [flat], [relax.TensorType([self.count, self.n, self.n], self.dtype),
                                                     relax.TensorType([self.count, self.n], "int32")]))
        self.lu = stop(bb, bb.emit(relax.TupleGetItem(lu, 0)))
        self.pivots = stop(bb, bb.emit(relax.TupleGetItem(lu, 1)))

    def solve(self, rhs: relax.Expr, m: int) -> relax.Expr:
        """x[count, n, m] with A x = rhs (rhs already [count, n, m]), stopped."""
        if self.empty or m == 0:
            return self.bb.emit(op.zeros([self.count, self.n, m], self.dtype))
        solver = self.bb.add_func(lu_solve_kernel(self.count, self.n, m, self.dtype), "lu_solve")
        x = self.bb.emit(relax.call_tir(solver, [self.lu, self.pivots, rhs],
                                        relax.TensorType([self.count, self.n, m], self.dtype)))
        return stop(self.bb, x)

    def inverse(self) -> relax.Expr:
        """A^-1 as [*batch, n, n], stopped (solved once)."""
        if self._inverse is None:
            eye = op.broadcast_to(op.eye(self.n, dtype=self.dtype), [self.count, self.n, self.n])
            self._inverse = self.unflatten(self.solve(self.bb.emit(eye), self.n))
        return self._inverse

    def diagonal(self) -> relax.Expr:
        """diag(U) as [count, n]."""
        eye = op.eye(self.n, dtype=self.dtype)
        return self.bb.emit(op.sum(op.multiply(self.lu, eye), axis=[-1]))

    def permutation_sign(self) -> relax.Expr:
        """(-1)^(rows swapped) as [count], in the matrices' dtype."""
        steps = op.add(op.arange(0, self.n, 1, "int32"), relax.const(1, "int32"))
        flips = op.where(op.not_equal(self.pivots, steps), relax.const(-1, self.dtype), relax.const(1, self.dtype))
        return self.bb.emit(op.prod(flips, axis=[-1]))

    def unflatten(self, x: relax.Expr, tail: tuple[int, ...] | None = None) -> relax.Expr:
        tail = (self.n, self.n) if tail is None else tail
        return self.bb.emit(op.reshape(x, [*self.batch, *tail]))

    def factors(self) -> list[relax.Expr]:
        """[LU, pivots] shaped as torch returns them."""
        if self.empty:  # a reshape to a 0 extent would read it as "keep this axis"
            return [self.bb.emit(op.zeros([*self.batch, self.n, self.n], self.dtype)),
                    self.bb.emit(op.zeros([*self.batch, self.n], "int32"))]
        return [self.unflatten(self.lu), self.unflatten(self.pivots, (self.n,))]

    def change(self) -> relax.Expr:
        """A - stop(A): zero, with A's gradient."""
        return self.bb.emit(op.subtract(self.a, self.stopped))


def stop(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Var:
    """x with no gradient (the kernels' inputs and results: autodiff cannot differentiate them)."""
    return bb.emit(relax.op.grad.no_grad(x))


def eye_like(x: relax.Expr) -> relax.Expr:
    """The identity broadcast to x's shape [*batch, n, n]."""
    dims = [int(d) for d in x.ty.shape.values]
    return op.broadcast_to(op.eye(dims[-1], dtype=_dtype(x)), dims)


def finite(bb: relax.BlockBuilder, x: relax.Expr) -> relax.Expr:
    """x with its inf and NaN entries zeroed: a coefficient of an exactly-zero term stays finite."""
    return bb.emit(op.where(op.isfinite(x), x, op.zeros_like(x)))


def transposed(x: relax.Expr) -> relax.Expr:
    return op.permute_dims(x, list(range(x.ty.ndim - 2)) + [x.ty.ndim - 1, x.ty.ndim - 2])


def _trace_term(bb: relax.BlockBuilder, coefficient: relax.Expr, change: relax.Expr) -> relax.Expr:
    """sum(coefficient * change) over the last two axes: tr(coefficient^T change)."""
    return bb.emit(op.sum(op.multiply(coefficient, change), axis=[-2, -1]))


def _det(square: _Square, differentiated: bool) -> relax.Expr:
    bb = square.bb
    if square.empty:
        return bb.emit(op.ones(square.batch, square.dtype))
    det = square.unflatten(bb.emit(op.multiply(op.prod(square.diagonal(), axis=[-1]), square.permutation_sign())), ())
    if not differentiated:
        return det
    coefficient = finite(bb, bb.emit(op.multiply(op.expand_dims(det, [-2, -1]), transposed(square.inverse()))))
    return bb.emit(op.add(det, _trace_term(bb, coefficient, square.change())))


def _slogdet(square: _Square, differentiated: bool) -> tuple[relax.Expr, relax.Expr]:
    bb = square.bb
    if square.empty:
        return bb.emit(op.ones(square.batch, square.dtype)), bb.emit(op.zeros(square.batch, square.dtype))
    diagonal = square.diagonal()
    sign = op.multiply(op.prod(op.sign(diagonal), axis=[-1]), square.permutation_sign())
    sign = stop(bb, square.unflatten(bb.emit(sign), ()))
    logabsdet = square.unflatten(bb.emit(op.sum(op.log(op.abs(diagonal)), axis=[-1])), ())
    if not differentiated:
        return sign, logabsdet
    coefficient = finite(bb, bb.emit(transposed(square.inverse())))
    return sign, bb.emit(op.add(logabsdet, _trace_term(bb, coefficient, square.change())))


def _inv(square: _Square, differentiated: bool) -> relax.Expr:
    bb = square.bb
    if square.empty:
        return bb.emit(op.zeros([*square.batch, square.n, square.n], square.dtype))
    inverse = square.inverse()
    if not differentiated:
        return inverse
    coefficient = finite(bb, inverse)
    term = op.matmul(op.matmul(coefficient, square.change()), coefficient)
    return bb.emit(op.subtract(inverse, term))


def _solve(square: _Square, b: relax.Expr, differentiated: bool) -> relax.Expr:
    """X with A X = B for B of shape [*batch, n, m] (the batch already A's)."""
    bb = square.bb
    m = b.ty.shape.values[-1].value
    if square.empty or m == 0:
        return bb.emit(op.zeros([*square.batch, square.n, m], square.dtype))
    stopped_b = stop(bb, b)
    flat_b = bb.emit(op.reshape(stopped_b, [square.count, square.n, m]))
    x = square.unflatten(square.solve(flat_b, m), (square.n, m))
    if not differentiated:
        return x
    coefficient = finite(bb, square.inverse())
    change = op.subtract(bb.emit(op.subtract(b, stopped_b)), op.matmul(square.change(), finite(bb, x)))
    return bb.emit(op.add(x, op.matmul(coefficient, change)))


def _zero_info(square: _Square) -> relax.Expr:
    return square.bb.emit(op.zeros(square.batch, "int32"))


def linalg_det(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """_linalg_det(A) -> (det, LU, pivots)."""
    square = _Square(importer.block_builder, importer.env[node.args[0]], "det", node)
    return relax.Tuple([_det(square, differentiated), *square.factors()])


def linalg_slogdet(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """_linalg_slogdet(A) -> (sign, logabsdet, LU, pivots)."""
    square = _Square(importer.block_builder, importer.env[node.args[0]], "slogdet", node)
    sign, logabsdet = _slogdet(square, differentiated)
    return relax.Tuple([sign, logabsdet, *square.factors()])


def linalg_inv_ex(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """linalg_inv_ex(A) -> (inverse, info)."""
    square = _Square(importer.block_builder, importer.env[node.args[0]], "inv", node)
    return relax.Tuple([_inv(square, differentiated), _zero_info(square)])


def linalg_solve_ex(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """_linalg_solve_ex(A, B, left=True) -> (result, LU, pivots, info); B a matrix or, when
    its shape is A's without the last axis, a vector (torch's rule)."""
    bb = importer.block_builder
    if not _arg(node, 2, "left", True):
        raise NotImplementedError("solve with left=False (X A = B): solve A^T X^T = B^T instead")
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    a_shape, b_shape = tuple(node.args[0].meta["val"].shape), tuple(node.args[1].meta["val"].shape)
    vector = len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1 and b_shape == a_shape[:-1])
    if vector:
        b = bb.emit(op.expand_dims(b, [-1]))
    square_matrices(a, "solve", node.args[0])
    a, b = broadcast_batches(bb, a, b)
    square = _Square(bb, a, "solve", node)
    x = _solve(square, b, differentiated)
    if vector:
        x = bb.emit(op.squeeze(x, [-1]))
    return relax.Tuple([x, *square.factors(), _zero_info(square)])


def converters(differentiated: bool) -> dict:
    """The converters; with `differentiated` False (a program autodiff never sees) without the
    gradient terms, which would cost an inverse and two products per call."""
    table = {"_linalg_det.default": linalg_det, "_linalg_slogdet.default": linalg_slogdet,
             "linalg_inv_ex.default": linalg_inv_ex, "_linalg_solve_ex.default": linalg_solve_ex}
    return {name: functools.partial(fn, differentiated=differentiated) for name, fn in table.items()}


CONVERTERS = converters(differentiated=True)
