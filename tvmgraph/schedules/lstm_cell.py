"""An LSTM's time step as one CPU kernel: the recurrent product with the gates in its epilogue.

`LSTMCellAsOneKernel` (relay_passes/lstm_cell.py) replaces one unrolled step of torch's LSTM,

    z = h @ W_hh.T + b_hh + xw[t]          xw: the input projection of every step, computed once
    i, f, g, o = split(z, 4)
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

with a call of `lstm_cell_kernel`, which computes, for a batch of B rows and H hidden units,

    acc[r, q, j] = sum_k h[r, k] * wt[k, q * H + j]      q in 0..3: the gates i, f, g, o
    z[r, q, j]   = acc[r, q, j] (+ bias[q * H + j]) + xw[t, r, q * H + j]
    c'[r, j]     = sigmoid(z[r, 1, j]) * c[r, j] + sigmoid(z[r, 0, j]) * tanh(z[r, 2, j])
    h'[r, j]     = sigmoid(z[r, 3, j]) * tanh(c'[r, j])

(the states h, c, h', c' are [1, B, H] in nn.LSTM's steps, [B, H] in nn.LSTMCell's)

`t` is a scalar parameter (the call passes it as a primitive value), so every step of a sequence
calls the same PrimFunc, and xw[t] is read in place. Unfused, each step was four kernels: the
product with the bias and xw[t] in its epilogue, a copy of xw[t] (its slice), c' and h'; on a
2-vCPU Xeon 12, 3.3, 5.8 and 3.4 us a step for B = 16, H = 128.

Schedule (`LSTMCell`): hidden units in vectors of `lanes` (j), rows in tiles of R (r). Per
(vector of j, tile of rows), the tile's 4 x R vectors of sums (the four gates of the same
units, so that the epilogue finds them in registers), then c' and h' for the tile. `wt`'s four
gate columns of the vector are read along k as they are stored (wt is `W_hh.T`, [H, 4H]), each
h[r, k] broadcast. R: the most rows, up to MAX_ROWS, that divide B; 4 x R sums stay in
registers at LLVM -O3. The threads split the rows when there are enough tiles (else the
vectors): each thread then reads only the h' it wrote itself at the step before. Split by
vectors, every step read half of h' from the other core's cache: benchmarks.outside's LSTM took
0.87 of its time without the kernel, 0.81-0.82 with the rows split. Only H that whole vectors divide, float32.
"""

from __future__ import annotations

import math
import os

from tvm import s_tir, te, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from relay_passes import OPAQUE

from .cpu_target import CPUTarget

# Marks a PrimFunc made by `lstm_cell_kernel` (the rule schedules nothing else).
ATTRIBUTE = "tvmgraph.lstm_cell"
GATES = 4
MAX_ROWS = 6  # rows per register tile: 4 x 6 sums of AVX-512's 32 registers


def lstm_cell_kernel(batch: int, hidden: int, steps: int, bias: bool, state_rank: int = 3) -> tirx.PrimFunc:
    """The PrimFunc `main(h[S], wt[H, 4H], (bias[4H],) xw[steps, B, 4H], c[S], t, c_out[S],
    h_out[S])`, S = [1, B, H] (nn.LSTM's states) or, with `state_rank` 2, [B, H] (nn.LSTMCell's):
    the step's hidden and cell states in, the next ones out; `t` (int64, a primitive argument of
    the call) selects the step's row of `xw`."""
    state = (1, batch, hidden) if state_rank == 3 else (batch, hidden)

    def at(tensor: te.Tensor, r: tirx.PrimExpr, j: tirx.PrimExpr) -> tirx.PrimExpr:
        return tensor[0, r, j] if state_rank == 3 else tensor[r, j]

    h = te.placeholder(state, "float32", name="h")
    wt = te.placeholder((hidden, GATES * hidden), "float32", name="wt")
    b = te.placeholder((GATES * hidden,), "float32", name="bias") if bias else None
    xw = te.placeholder((steps, batch, GATES * hidden), "float32", name="xw")
    c = te.placeholder(state, "float32", name="c")
    t = tirx.Var("t", "int64")
    k = te.reduce_axis((0, hidden), "k")
    acc = te.compute((batch, GATES, hidden), lambda r, q, j: te.sum(at(h, r, k) * wt[k, q * hidden + j], axis=k),
                     name="gates")

    def z(r, q, j):
        column = q * hidden + j
        value = acc[r, q, j] + xw[t, r, column]
        return value + b[column] if b is not None else value

    def states(*index):
        r, j = index[-2:]
        cell = tirx.sigmoid(z(r, 1, j)) * at(c, r, j) + tirx.sigmoid(z(r, 0, j)) * tirx.tanh(z(r, 2, j))
        return cell, tirx.sigmoid(z(r, 3, j)) * tirx.tanh(cell)

    # Both states in one loop nest: h' reuses c' in registers (LLVM shares the expression), and
    # the schedule moves no consumer of an output block.
    c_out, h_out = te.compute(state, states, name="states")
    inputs = [h, wt, *([b] if b is not None else []), xw, c]
    func = te.create_prim_func([*inputs, t, c_out, h_out])
    # (private: TE names every function "main", which a module calling it already has)
    return func.without_attr("global_symbol").with_attrs({ATTRIBUTE: True, "op_pattern": OPAQUE})


def rows_per_tile(batch: int) -> int:
    """The most rows up to MAX_ROWS that divide `batch`."""
    return max(r for r in range(1, MAX_ROWS + 1) if batch % r == 0)


class LSTMCell(ScheduleRule):
    """Schedules `lstm_cell_kernel`'s PrimFuncs (see the module docstring)."""

    # At the -O1 graphs build with, LLVM keeps the tile's sums in memory.
    llvm_opt_level = 3

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if func.attrs is None or ATTRIBUTE not in func.attrs:
            return None
        lanes = CPUTarget.from_target(target).lanes("float32")
        sch = s_tir.Schedule(func)
        # the two blocks of the states (TE's "states_v0" and "states_v1") share their loops
        *_, rows, units = sch.get_loops(sch.get_sblock("states_v0"))
        batch = sch.get(rows).extent.value
        tile = rows_per_tile(batch)
        groups = math.gcd(batch // tile, os.cpu_count() or 1)
        unit_vectors, lane = sch.split(units, [None, lanes])
        if groups > 1:
            # Each thread its own rows: the next step reads the h' a thread wrote in its own
            # cache (split by units, every step read half of h' from the other core), and the
            # tiles of its rows take each vector's four gate columns of wt in turn (from L1).
            group, row_tiles, row = sch.split(rows, [groups, None, tile])
            sch.reorder(group, unit_vectors, row_tiles, row, lane)
            sch.parallel(group)
            at = row_tiles
        else:
            row_tiles, row = sch.split(rows, [None, tile])
            sch.reorder(unit_vectors, row_tiles, row, lane)
            at = sch.fuse(unit_vectors, row_tiles)
            sch.parallel(at)
        sch.vectorize(lane)
        gates = sch.get_sblock("gates")
        sch.compute_at(gates, at, preserve_unit_loops=True)  # a tile of one row keeps its loop
        r, q, j, k = sch.get_loops(gates)[-4:]
        sch.reorder(k, r, q, j)
        sch.unroll(r)
        sch.unroll(q)
        sch.vectorize(j)
        init = sch.decompose_reduction(gates, k)
        sch.vectorize(sch.get_loops(init)[-1])
        return sch
