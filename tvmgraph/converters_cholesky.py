"""Symmetric positive-definite and triangular systems: `torch.linalg.cholesky` (and
`torch.cholesky`), `linalg.solve_triangular`, `cholesky_solve`, `cholesky_inverse`, which TVM
0.27 does not lower.

Two loop kernels (tvmgraph/linalg_kernels.py): Cholesky (LAPACK's potrf, reading the lower
triangle) and forward substitution with a lower-triangular matrix (trsm). An upper-triangular
system is the lower one with rows and columns reversed (`J U J` is lower for the reversal J),
`upper=True` Cholesky the lower one of A^T, transposed.

As in converters_linalg.py, the kernels' results are stopped and each result is returned plus
a first-order term that is exactly zero in value (`A - stop(A)`), so that autodiff gives
torch's gradients:

    cholesky        L + L Phi(L^-1 sym(dA) L^-T)   Phi: the strict lower triangle, half the diagonal
                                                  sym(dA) = (dA + dA^T) / 2: torch's gradient is symmetric
    solve_triangular X + T^-1 (dB - mask(dA) X)     mask: the triangle read (strict when unitriangular)
    cholesky_solve   X + M^-1 (dB - dM X)           M = L L^T as a Relax product: the gradient of L is
    cholesky_inverse Y - Y dM Y                     torch's, for every entry of L (not only its triangle)

Differences from eager: a matrix that is not positive definite gives NaN where
`torch.linalg.cholesky` raises (`cholesky_ex`'s `info` is always 0); static shapes, the CPU only,
float32 and float64; scalar loops, O(n^3) per matrix.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_linalg import broadcast_batches, eye_like, finite, square_matrices, stop, transposed
from .converters_nn import _arg, _dtype
from .linalg_kernels import cholesky_upper_kernel, lower_solve_kernel

op = relax.op


def _flip_both(x: relax.Expr) -> relax.Expr:
    return op.flip(op.flip(x, -1), -2)


def _triangular_solve(bb: relax.BlockBuilder, t: relax.Expr, rhs: relax.Expr, upper: bool) -> relax.Expr:
    """X with T X = rhs, both [*batch, ...] with one batch, T stopped: the kernel reads T's
    lower (or upper) triangle and diagonal. Stopped."""
    dims = [int(d) for d in rhs.ty.shape.values]
    batch, n, m = dims[:-2], dims[-2], dims[-1]
    count, dtype = math.prod(batch), _dtype(t)
    if count == 0 or n == 0 or m == 0:
        return bb.emit(op.zeros(dims, dtype))
    if upper:  # J U J is lower triangular: solve (J U J)(J X) = J rhs
        t, rhs = _flip_both(t), op.flip(rhs, -2)
    kernel = bb.add_func(lower_solve_kernel(count, n, m, dtype), "lower_solve")
    x = bb.emit(relax.call_tir(kernel, [bb.emit(op.reshape(t, [count, n, n])), bb.emit(op.reshape(rhs, [count, n, m]))],
                               relax.TensorType([count, n, m], dtype)))
    x = op.reshape(x, dims)
    return stop(bb, bb.emit(op.flip(x, -2) if upper else x))


def _mask(n: int, dtype: str, upper: bool, strict: bool, diagonal: float = 1.0) -> relax.Expr:
    """A constant n x n triangle of ones (the diagonal `diagonal`, or 0 when strict)."""
    mask = np.triu(np.ones((n, n)), 1) if upper else np.tril(np.ones((n, n)), -1)
    if not strict:
        mask += diagonal * np.eye(n)
    return relax.const(mask.astype(dtype), dtype)


def _cholesky(bb: relax.BlockBuilder, a: relax.Expr, node: torch.fx.Node, upper: bool,
              differentiated: bool) -> relax.Expr:
    batch, n = square_matrices(a, "cholesky", node.args[0])
    dtype, count = _dtype(a), math.prod(batch)
    if count == 0 or n == 0:
        return bb.emit(op.zeros([*batch, n, n], dtype))
    if upper:  # U^T U = A, U^T the lower factor of A^T (whose lower triangle is A's upper one)
        return bb.emit(transposed(_cholesky(bb, bb.emit(transposed(a)), node, False, differentiated)))
    stopped = stop(bb, a)
    kernel = bb.add_func(cholesky_upper_kernel(count, n, dtype), "cholesky_upper")
    factor = bb.emit(relax.call_tir(kernel, [bb.emit(op.reshape(stopped, [count, n, n]))],
                                    relax.TensorType([count, n, n], dtype)))
    lower = stop(bb, bb.emit(transposed(bb.emit(op.reshape(factor, [*batch, n, n])))))
    if not differentiated:
        return lower
    inverse = finite(bb, _triangular_solve(bb, lower, bb.emit(eye_like(lower)), upper=False))
    change = bb.emit(op.subtract(a, stopped))
    symmetric = op.multiply(op.add(change, transposed(change)), relax.const(0.5, dtype))
    inner = op.matmul(op.matmul(inverse, symmetric), transposed(inverse))
    phi = op.multiply(inner, _mask(n, dtype, upper=False, strict=False, diagonal=0.5))
    return bb.emit(op.add(lower, op.matmul(finite(bb, lower), phi)))


def linalg_cholesky_ex(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """linalg_cholesky_ex(A, upper=False) -> (L, info)."""
    bb = importer.block_builder
    a = importer.env[node.args[0]]
    factor = _cholesky(bb, a, node, bool(_arg(node, 1, "upper", False)), differentiated)
    batch = [int(d) for d in a.ty.shape.values][:-2]
    return relax.Tuple([factor, bb.emit(op.zeros(batch, "int32"))])


def cholesky(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """cholesky(A, upper=False) -> L (or U)."""
    return _cholesky(importer.block_builder, importer.env[node.args[0]], node, bool(_arg(node, 1, "upper", False)),
                     differentiated)


def linalg_solve_triangular(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """linalg_solve_triangular(A, B, upper, left=True, unitriangular=False) -> X."""
    bb = importer.block_builder
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    upper = bool(_arg(node, 2, "upper", False))
    left, unit = bool(_arg(node, 3, "left", True)), bool(_arg(node, 4, "unitriangular", False))
    _, n = square_matrices(a, "solve_triangular", node.args[0])
    if not left:  # X A = B is A^T X^T = B^T, A^T triangular the other way
        a, b, upper = bb.emit(transposed(a)), bb.emit(transposed(b)), not upper
    a, b = broadcast_batches(bb, a, b)
    dtype = _dtype(a)
    stopped_a, stopped_b = stop(bb, a), stop(bb, b)
    t = stopped_a
    if unit:  # the kernel divides by the diagonal: make it ones
        t = bb.emit(op.add(op.multiply(t, _mask(n, dtype, upper, strict=True)), op.eye(n, dtype=dtype)))
    x = _triangular_solve(bb, t, stopped_b, upper)
    if not differentiated:
        return bb.emit(transposed(x)) if not left else x
    inverse = finite(bb, _triangular_solve(bb, t, bb.emit(eye_like(t)), upper))
    change_a = op.multiply(op.subtract(a, stopped_a), _mask(n, dtype, upper, strict=unit))
    change = op.subtract(op.subtract(b, stopped_b), op.matmul(change_a, finite(bb, x)))
    result = bb.emit(op.add(x, op.matmul(inverse, change)))
    return bb.emit(transposed(result)) if not left else result


def _lower_factor(bb: relax.BlockBuilder, factor: relax.Expr, upper: bool) -> relax.Expr:
    """L with A = L L^T from torch's argument (L, or U with A = U^T U)."""
    return bb.emit(transposed(factor)) if upper else factor


def _spd_solve(bb: relax.BlockBuilder, lower: relax.Expr, rhs: relax.Expr) -> relax.Expr:
    """(L L^T)^-1 rhs, L stopped: two triangular solves. Stopped."""
    return _triangular_solve(bb, bb.emit(transposed(lower)), _triangular_solve(bb, lower, rhs, upper=False), upper=True)


def cholesky_solve(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """cholesky_solve(B, L, upper=False) -> X with L L^T X = B."""
    bb = importer.block_builder
    b, factor = importer.env[node.args[0]], importer.env[node.args[1]]
    square_matrices(factor, "cholesky_solve", node.args[1])
    factor, b = broadcast_batches(bb, factor, b)
    lower = _lower_factor(bb, factor, bool(_arg(node, 2, "upper", False)))
    product = bb.emit(op.matmul(lower, transposed(lower)))
    stopped_lower, stopped_b, stopped_product = stop(bb, lower), stop(bb, b), stop(bb, product)
    x = _spd_solve(bb, stopped_lower, stopped_b)
    if not differentiated:
        return x
    inverse = finite(bb, _spd_solve(bb, stopped_lower, bb.emit(eye_like(stopped_lower))))
    change = op.subtract(op.subtract(b, stopped_b), op.matmul(op.subtract(product, stopped_product), finite(bb, x)))
    return bb.emit(op.add(x, op.matmul(inverse, change)))


def cholesky_inverse(node: torch.fx.Node, importer: ExportedProgramImporter, differentiated: bool) -> relax.Expr:
    """cholesky_inverse(L, upper=False) -> (L L^T)^-1."""
    bb = importer.block_builder
    factor = importer.env[node.args[0]]
    square_matrices(factor, "cholesky_inverse", node.args[0])
    lower = _lower_factor(bb, factor, bool(_arg(node, 1, "upper", False)))
    product = bb.emit(op.matmul(lower, transposed(lower)))
    stopped_lower, stopped_product = stop(bb, lower), stop(bb, product)
    inverse = _spd_solve(bb, stopped_lower, bb.emit(eye_like(stopped_lower)))
    if not differentiated:
        return inverse
    coefficient = finite(bb, inverse)
    term = op.matmul(op.matmul(coefficient, op.subtract(product, stopped_product)), coefficient)
    return bb.emit(op.subtract(inverse, term))


def converters(differentiated: bool) -> dict:
    """The converters; with `differentiated` False (a program autodiff never sees) without the
    gradient terms, which would cost an inverse and two products per call."""
    table = {"linalg_cholesky_ex.default": linalg_cholesky_ex, "cholesky.default": cholesky,
             "linalg_solve_triangular.default": linalg_solve_triangular, "cholesky_solve.default": cholesky_solve,
             "cholesky_inverse.default": cholesky_inverse}
    return {name: functools.partial(fn, differentiated=differentiated) for name, fn in table.items()}


CONVERTERS = converters(differentiated=True)
