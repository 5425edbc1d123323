"""The loop kernels behind converters_linalg.py and converters_cholesky.py: LU with partial
pivoting, its substitution, Cholesky and a lower-triangular substitution, for a batch of static
n x n matrices in float32 or float64. One block per matrix, the matrices in parallel; inside,
LAPACK's unblocked algorithms as loops. Marked scheduled: no schedule rule touches them, and
no GPU rule binds them (the converters lower them for the CPU only).

Every innermost loop runs along a row, as a TIR vector loop of 64 bytes over whole aligned
chunks plus a scalar tail (LLVM's loop vectorizer left TVM's scalar loops scalar: n = 256, an
inverse took 6.5 ms, 14x LAPACK's time). A step's update starts at the chunk holding its first
column; the columns of that chunk before it subtract zeros (LU) or get values never read
(Cholesky, zeroed at the end). Every loop starts at 0 (`k + 1 + below`): `for j in range(i, n)`
inside `for i in range(k + 1, n)` was miscompiled by TVM 0.27 (stores below a Cholesky factor's
diagonal).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from relay_passes import OPAQUE

PIVOT_DTYPE = "int32"  # LAPACK's, and torch's pivots
VECTOR_BYTES = 64  # an AVX-512 register; LLVM splits the vectors on narrower units


def _lanes(dtype: str) -> int:
    return VECTOR_BYTES // (tvm.DataType(dtype).bits // 8)


@T.macro
def _subtract_scaled_row(acc, coefficient, x, b, row, m, lanes, whole):
    """acc[:m] -= coefficient * x[b, row, :m]: 64-byte vectors over the whole chunks, then the
    tail one element at a time (the substitutions' inner loop)."""
    for chunk in range(m // lanes):
        for lane in T.vectorized(lanes):
            acc[chunk * lanes + lane] = acc[chunk * lanes + lane] - coefficient * x[b, row, chunk * lanes + lane]
    for tail in range(m - whole):
        acc[whole + tail] = acc[whole + tail] - coefficient * x[b, row, whole + tail]


def lu_factor_kernel(batch: int, n: int, dtype: str) -> tirx.PrimFunc:
    """(a[batch, n, n]) -> lu[batch, n, n] (L below the diagonal, unit diagonal implied; U on
    and above it), pivots[batch, n] (1-based: row k was swapped with row pivots[k] - 1).
    Right-looking: at step k the pivot row is swapped up, the column below it divided by the
    pivot, and the pivot row (copied to `row`) subtracted from every row below, in vectors of
    whole aligned chunks (the columns up to k subtract a zero)."""
    lanes, whole = _lanes(dtype), n // _lanes(dtype) * _lanes(dtype)

    @T.prim_func(private=True, s_tir=True)
    def lu_factor(a: T.Buffer((batch, n, n), dtype), lu: T.Buffer((batch, n, n), dtype),
                  pivots: T.Buffer((batch, n), PIVOT_DTYPE)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        with T.sblock("root"):
            for matrix in T.parallel(batch):
                with T.sblock("lu_factor"):
                    b = T.axis.spatial(batch, matrix)
                    T.reads(a[b, 0:n, 0:n])
                    T.writes(lu[b, 0:n, 0:n], pivots[b, 0:n])
                    best = T.sblock_alloc_buffer((1,), dtype, scope="local")
                    found = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    row = T.sblock_alloc_buffer((n,), dtype)
                    for i, j in T.grid(n, n):
                        lu[b, i, j] = a[b, i, j]
                    for k in range(n):
                        best[0] = T.abs(lu[b, k, k])
                        found[0] = k
                        for below in range(n - 1 - k):  # the first largest |a[i, k]|, as LAPACK's idamax
                            if T.abs(lu[b, k + 1 + below, k]) > best[0]:
                                best[0] = T.abs(lu[b, k + 1 + below, k])
                                found[0] = k + 1 + below
                        pivots[b, k] = found[0] + 1
                        if found[0] != k:
                            for j in range(n):
                                row[j] = lu[b, k, j]
                            for j in range(n):
                                lu[b, k, j] = lu[b, found[0], j]
                            for j in range(n):
                                lu[b, found[0], j] = row[j]
                        if lu[b, k, k] != T.Cast(dtype, 0):  # a zero pivot has a zero column below it
                            for below in range(n - 1 - k):
                                lu[b, k + 1 + below, k] = lu[b, k + 1 + below, k] / lu[b, k, k]
                        for j in range(n):  # the pivot row right of k, zero up to k (a no-op there)
                            row[j] = T.if_then_else(j > k, lu[b, k, j], T.Cast(dtype, 0))
                        for below in range(n - 1 - k):
                            for chunk in range(whole // lanes - (k + 1) // lanes):
                                for lane in T.vectorized(lanes):
                                    lu[b, k + 1 + below, ((k + 1) // lanes + chunk) * lanes + lane] = (
                                        lu[b, k + 1 + below, ((k + 1) // lanes + chunk) * lanes + lane]
                                        - lu[b, k + 1 + below, k] * row[((k + 1) // lanes + chunk) * lanes + lane])
                            for tail in range(n - whole):
                                if whole + tail > k:
                                    lu[b, k + 1 + below, whole + tail] = (lu[b, k + 1 + below, whole + tail]
                                                                          - lu[b, k + 1 + below, k] * row[whole + tail])

    return lu_factor


def lu_solve_kernel(batch: int, n: int, m: int, dtype: str) -> tirx.PrimFunc:
    """(lu, pivots, b[batch, n, m]) -> x[batch, n, m] with A x = b: the row swaps, then L (unit
    diagonal) from the top, then U from the bottom, each row accumulated in `acc` from the rows
    already solved."""
    lanes, whole = _lanes(dtype), m // _lanes(dtype) * _lanes(dtype)

    @T.prim_func(private=True, s_tir=True)
    def lu_solve(lu: T.Buffer((batch, n, n), dtype), pivots: T.Buffer((batch, n), PIVOT_DTYPE),
                 rhs: T.Buffer((batch, n, m), dtype), x: T.Buffer((batch, n, m), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        with T.sblock("root"):
            for matrix in T.parallel(batch):
                with T.sblock("lu_solve"):
                    b = T.axis.spatial(batch, matrix)
                    T.reads(lu[b, 0:n, 0:n], pivots[b, 0:n], rhs[b, 0:n, 0:m])
                    T.writes(x[b, 0:n, 0:m])
                    acc = T.sblock_alloc_buffer((m,), dtype)
                    for i, j in T.grid(n, m):
                        x[b, i, j] = rhs[b, i, j]
                    for k in range(n):  # the row swaps, in factorization order
                        if pivots[b, k] - 1 != k:
                            for j in range(m):
                                acc[j] = x[b, k, j]
                            for j in range(m):
                                x[b, k, j] = x[b, pivots[b, k] - 1, j]
                            for j in range(m):
                                x[b, pivots[b, k] - 1, j] = acc[j]
                    for i in range(n):  # L y = P b
                        for j in range(m):
                            acc[j] = x[b, i, j]
                        for k in range(i):
                            _subtract_scaled_row(acc, lu[b, i, k], x, b, k, m, lanes, whole)
                        for j in range(m):
                            x[b, i, j] = acc[j]
                    for r in range(n):  # U x = y, from the last row up
                        for j in range(m):
                            acc[j] = x[b, n - 1 - r, j]
                        for solved in range(r):
                            _subtract_scaled_row(acc, lu[b, n - 1 - r, n - r + solved], x, b, n - r + solved, m, lanes,
                                                 whole)
                        for j in range(m):
                            x[b, n - 1 - r, j] = acc[j] / lu[b, n - 1 - r, n - 1 - r]

    return lu_solve


def cholesky_upper_kernel(batch: int, n: int, dtype: str) -> tirx.PrimFunc:
    """(a[batch, n, n]) -> u[batch, n, n], upper triangular with u^T u = a, reading a's lower
    triangle only (LAPACK's potrf, uplo L, as the transposed factor): right-looking by rows, so
    that every update runs along a row of u, in vectors of whole aligned chunks (the entries
    before the diagonal get garbage, zeroed at the end). The caller transposes u into torch's L.
    A matrix that is not positive definite gets NaN from the square root of a negative pivot."""
    lanes, whole = _lanes(dtype), n // _lanes(dtype) * _lanes(dtype)

    @T.prim_func(private=True, s_tir=True)
    def cholesky_upper(a: T.Buffer((batch, n, n), dtype), upper: T.Buffer((batch, n, n), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        with T.sblock("root"):
            for matrix in T.parallel(batch):
                with T.sblock("cholesky_upper"):
                    b = T.axis.spatial(batch, matrix)
                    T.reads(a[b, 0:n, 0:n])
                    T.writes(upper[b, 0:n, 0:n])
                    row = T.sblock_alloc_buffer((n,), dtype)
                    for i, j in T.grid(n, n):  # a's lower triangle, transposed
                        upper[b, i, j] = a[b, j, i]
                    for k in range(n):
                        upper[b, k, k] = T.sqrt(upper[b, k, k])
                        for j in range(n):  # row k right of the diagonal, scaled; zero up to k
                            row[j] = T.if_then_else(j > k, upper[b, k, j] / upper[b, k, k], T.Cast(dtype, 0))
                        for right in range(n - 1 - k):
                            upper[b, k, k + 1 + right] = row[k + 1 + right]
                        for below in range(n - 1 - k):  # row i = k + 1 + below, from its diagonal's chunk on
                            for chunk in range(whole // lanes - (k + 1 + below) // lanes):
                                for lane in T.vectorized(lanes):
                                    upper[b, k + 1 + below, ((k + 1 + below) // lanes + chunk) * lanes + lane] = (
                                        upper[b, k + 1 + below, ((k + 1 + below) // lanes + chunk) * lanes + lane]
                                        - row[k + 1 + below] * row[((k + 1 + below) // lanes + chunk) * lanes + lane])
                            for tail in range(n - whole):
                                upper[b, k + 1 + below, whole + tail] = (upper[b, k + 1 + below, whole + tail]
                                                                         - row[k + 1 + below] * row[whole + tail])
                    for i, j in T.grid(n, n):  # below the diagonal: what the chunks wrote there, never read
                        if j < i:
                            upper[b, i, j] = T.Cast(dtype, 0)

    return cholesky_upper


def lower_solve_kernel(batch: int, n: int, m: int, dtype: str) -> tirx.PrimFunc:
    """(l[batch, n, n], rhs[batch, n, m]) -> x with l x = rhs, reading l's lower triangle and
    diagonal only (forward substitution, trsm), each row accumulated in `acc`."""
    lanes, whole = _lanes(dtype), m // _lanes(dtype) * _lanes(dtype)

    @T.prim_func(private=True, s_tir=True)
    def lower_solve(lower: T.Buffer((batch, n, n), dtype), rhs: T.Buffer((batch, n, m), dtype),
                    x: T.Buffer((batch, n, m), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        with T.sblock("root"):
            for matrix in T.parallel(batch):
                with T.sblock("lower_solve"):
                    b = T.axis.spatial(batch, matrix)
                    T.reads(lower[b, 0:n, 0:n], rhs[b, 0:n, 0:m])
                    T.writes(x[b, 0:n, 0:m])
                    acc = T.sblock_alloc_buffer((m,), dtype)
                    for i in range(n):
                        for j in range(m):
                            acc[j] = rhs[b, i, j]
                        for k in range(i):
                            _subtract_scaled_row(acc, lower[b, i, k], x, b, k, m, lanes, whole)
                        for j in range(m):
                            x[b, i, j] = acc[j] / lower[b, i, i]

    return lower_solve
