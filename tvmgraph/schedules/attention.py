"""Attention as one CPU kernel: `softmax(q @ k.T [* scale]) @ v` per batch, with the queries
along the vector lanes.

`AttentionAsOneKernel` (relay_passes/attention.py) replaces the two products and the softmax
between them with a call of `attention_kernel`, which computes, for each batch b,

    qt[d, i]  = q[i, d]                               queries padded to whole vectors with 0
    s[j, i]   = scale * sum_d kt[d, j] * qt[d, i]     the scores, query i down the lanes
    m[i]      = max_j s[j, i]                         TVM's max starts at -FLT_MAX
    e[j, i]   = exp(s[j, i] - m[i])
    z[i]      = sum_j e[j, i]
    out[i, c] = sum_j v[j, c] * e[j, i] / z[i]        (0 where z is 0, for torch's _safe_softmax)

Queries run along the vector lanes, so the row max, the exponentials, the sum and the weighted
sum of v are all vertical vector operations: no horizontal sums, and keys and values need no
padding (kt[d, j] and v[j, c] are read one float at a time, broadcast). A softmax over rows of
65 keys (a ViT's 64 patches and class token) had each of its rows padded to 80, and both
products padded to whole register tiles; the three kernels took 0.65 ms a layer on a 2-vCPU
Xeon where this one takes 0.26 (alone) to 0.35 (in the graph).

Exact where torch's softmax is: the row's max is subtracted before exp. The division by z comes
after the weighted sum (torch divides first): a difference of rounding, about one ulp of a
float32. `_safe_softmax` rows that are all -inf have z = 0 and give 0, as in torch; the plain
softmax (`safe=False`) gives NaN there, as torch's does. A NaN or infinite score gives a NaN
row, as in torch.

Schedule (`Attention`, first of the CPU rules; the kernel carries ATTRIBUTE, and asks for LLVM
-O3): one batch per parallel iteration, every stage computed at it (a batch's scores and
exponentials stay in L1/L2); the scores as register tiles of keys by vectors of queries
(`_register_tile`), the sum over d outside the tile; the weighted sum as tiles of queries by
vectors of output features when whole vectors divide them (then the output is stored a vector
at a time), else of features by vectors of queries. Every stage covers the padded queries (a
stage cut at L would put a bounds test in every vector loop above it): the output has `padded`
rows, which the pass crops. On the 2-vCPU Xeon: the ViT's attention (65 keys, 32 features,
64 heads) at 134 GFLOP/s alone, 31% of the FMA peak; heads of 64 over 128 tokens 198, 46%.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from relay_passes import OPAQUE

from .cpu_target import CPUTarget

# Marks a PrimFunc made by `attention_kernel` (the rule schedules nothing else).
ATTRIBUTE = "tvmgraph.attention"
# TVM's op pattern for "never fuse": the crop and reshapes the pass puts around the call fuse
# into their other neighbours instead (relax FuseOps reads the attribute when it is present).
MAX_TILE = 8  # keys (scores) or output features (weighted sum) per register tile


def padded_queries(queries: int, lanes: int) -> int:
    """The rows of the kernel's output: `queries` rounded up to whole vectors of `lanes`."""
    return -(-queries // lanes) * lanes


def attention_kernel(batch: int, keys: int, queries: int, depth: int, features: int, lanes: int,
                     scale: float | None, divide: bool, safe: bool) -> tirx.PrimFunc:
    """The PrimFunc `main(q[b, queries, depth], kt[b, depth, keys], v[b, keys, features]) ->
    out[b, padded, features]`: the graph's own operands, and its result with the queries
    padded to whole vectors of `lanes` (`padded`; the caller crops them).

    `scale` multiplies the scores (divides them with `divide`), as the graph did after its
    product; None for none. `safe`: torch's `_safe_softmax` (0 on rows that are all -inf)."""
    padded = padded_queries(queries, lanes)
    q = te.placeholder((batch, queries, depth), "float32", name="q")
    kt = te.placeholder((batch, depth, keys), "float32", name="kt")
    v = te.placeholder((batch, keys, features), "float32", name="v")
    zero = tirx.const(0.0, "float32")
    # q transposed, queries padded with zeros to whole vectors (copied per batch, in L1)
    qt = te.compute((batch, depth, padded),
                    lambda b, d, i: tirx.if_then_else(i < queries, q[b, tirx.min(i, queries - 1), d], zero),
                    name="queries")
    d = te.reduce_axis((0, depth), "d")
    product = te.compute((batch, keys, padded), lambda b, j, i: te.sum(kt[b, d, j] * qt[b, d, i], axis=d),
                         name="product")
    if scale is None:
        scores = product
    else:
        factor = tirx.const(scale, "float32")
        scores = te.compute(product.shape, lambda b, j, i: product[b, j, i] / factor if divide
                            else product[b, j, i] * factor, name="scores")
    j1 = te.reduce_axis((0, keys), "j1")
    row_max = te.compute((batch, padded), lambda b, i: te.max(scores[b, j1, i], axis=j1), name="row_max")
    exp = te.compute(scores.shape, lambda b, j, i: te.exp(scores[b, j, i] - row_max[b, i]), name="exp")
    j2 = te.reduce_axis((0, keys), "j2")
    total = te.compute((batch, padded), lambda b, i: te.sum(exp[b, j2, i], axis=j2), name="total")
    j3 = te.reduce_axis((0, keys), "j3")
    # The weighted sum of v runs its output features along the lanes when whole vectors of them
    # divide v's rows (then the output is stored a vector at a time), else its queries.
    by_features = features % lanes == 0
    if by_features:
        weighted = te.compute((batch, padded, features), lambda b, i, c: te.sum(v[b, j3, c] * exp[b, j3, i], axis=j3),
                              name="weighted")
    else:
        weighted = te.compute((batch, features, padded), lambda b, c, i: te.sum(v[b, j3, c] * exp[b, j3, i], axis=j3),
                              name="weighted")

    def normalized(b, i, c):
        value = (weighted[b, i, c] if by_features else weighted[b, c, i]) / total[b, i]
        return tirx.Select(total[b, i] == zero, zero, value) if safe else value

    # All `padded` rows: a stage computed at the batch loop covers what its readers read, and
    # rows cut at `queries` would leave every vector loop above with a bounds test.
    out = te.compute((batch, padded, features), normalized, name="attention")
    func = te.create_prim_func([q, kt, v, out])
    return func.with_attrs({ATTRIBUTE: "features" if by_features else "queries", "op_pattern": OPAQUE})


def _register_tile(rows: int, vectors: int, registers: int) -> tuple[int, int]:
    """(rows, vectors) of a register tile of partial sums: divisors of the extents, at most
    MAX_TILE rows and `registers` * 25 / 32 sums (25 of AVX-512's 32 registers: the rest hold
    the tile's row of vectors and a broadcast), the most sums first, then the fewest loads
    (rows + vectors) per sum. Measured on the 2-vCPU Xeon, the ViT's 65 keys x 5 vectors of
    queries: 5 x 5 138 GFLOP/s, 5 x 1 126, 1 x 5 121; heads of 64 over 128 tokens: 4 x 4 196,
    8 x 2 191, 8 x 1 171."""
    most = registers * 25 // 32
    tiles = [(r, v) for r in range(1, MAX_TILE + 1) for v in range(1, vectors + 1)
             if rows % r == 0 and vectors % v == 0 and r * v <= most]
    return max(tiles, key=lambda t: (t[0] * t[1], -(t[0] + t[1])))


class Attention(ScheduleRule):
    """Schedules `attention_kernel`'s PrimFuncs (see the module docstring)."""

    # At the -O1 graphs build with, LLVM keeps the tiles' partial sums in memory.
    llvm_opt_level = 3

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if func.attrs is None or ATTRIBUTE not in func.attrs:
            return None
        cpu = CPUTarget.from_target(target)
        lanes, registers = cpu.lanes("float32"), cpu.num_vector_registers
        sch = s_tir.Schedule(func)
        out = sch.get_sblock("attention")
        batch = sch.get_loops(out)[0]
        sch.parallel(batch)
        stages = {sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))}
        if "scores" in stages:  # the scale: recomputed where read, as the graph rounded it
            sch.compute_inline(sch.get_sblock("scores"))
        for name in ("weighted", "total", "exp", "row_max", "product", "queries"):
            sch.compute_at(sch.get_sblock(name), batch)
        queries = sch.get_sblock("queries")
        d, i = sch.get_loops(queries)[-2:]
        sch.reorder(i, d)  # read q's rows in order; the scattered writes stay in L1
        # the scores: tiles of (keys x vectors of queries), the sum over d outside the tile
        product = sch.get_sblock("product")
        _register_tiles(sch, product, *sch.get_loops(product)[-3:], lanes, registers)
        for name in ("row_max", "total"):
            block = sch.get_sblock(name)
            i, j = sch.get_loops(block)[-2:]
            sch.reorder(j, i)
            sch.vectorize(sch.split(i, [None, lanes])[1])
            _vectorize_init(sch, sch.decompose_reduction(block, j), lanes)
        sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("exp"))[-1], [None, lanes])[1])
        # the weighted sum: tiles of (queries x vectors of features) or (features x vectors of
        # queries), the sum over the keys outside the tile
        weighted = sch.get_sblock("weighted")
        _register_tiles(sch, weighted, *sch.get_loops(weighted)[-3:], lanes, registers)
        if str(func.attrs[ATTRIBUTE]) == "features":  # the output, a vector of features at a time
            sch.vectorize(sch.split(sch.get_loops(out)[-1], [None, lanes])[1])
        return sch


def _register_tiles(sch: s_tir.Schedule, block: s_tir.SBlockRV, rows: s_tir.LoopRV, columns: s_tir.LoopRV,
                    reduction: s_tir.LoopRV, lanes: int, registers: int) -> None:
    """Compute `block` (loops rows, columns, reduction) in register tiles of rows x vectors of
    columns (`_register_tile`), the reduction loop outside each tile."""
    tile_rows, vectors = _register_tile(sch.get(rows).extent.value, sch.get(columns).extent.value // lanes, registers)
    row_tiles, row = sch.split(rows, [None, tile_rows])
    column_tiles, vector, lane = sch.split(columns, [None, vectors, lanes])
    sch.reorder(row_tiles, column_tiles, reduction, row, vector, lane)
    sch.unroll(row)
    sch.unroll(vector)
    sch.vectorize(lane)
    _vectorize_init(sch, sch.decompose_reduction(block, reduction), lanes)


def _vectorize_init(sch: s_tir.Schedule, init: s_tir.SBlockRV, lanes: int) -> None:
    """Vectorize a decomposed reduction's init over its innermost loop, by whole vectors."""
    loop = sch.get_loops(init)[-1]
    if sch.get(loop).extent.value > lanes:
        loop = sch.split(loop, [None, lanes])[1]
    sch.vectorize(loop)
