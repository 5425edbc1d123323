"""`relax.grad.take_backward` (an embedding's or a gather's gradient) as a parallel kernel.

`dx = take_backward(dy, x, indices, axis)` adds each slice `dy[..., l, ...]` into
`dx[..., indices[l], ...]`; repeated indices add up. TVM 0.27 legalizes it into one serial
loop nest that zero-fills `dx` and then, for each element of a row, walks every index: a GPT's
tied-embedding gradient (1024 tokens into 4096 x 256) took 2.5 ms of its training step on one
core, the writes 1 KiB apart.

Here the columns after `axis` (the embedding dimension) are cut into chunks, one parallel
iteration per (leading index, chunk): each clears its own chunk of `dx` and adds the rows of
`dy` into it index by index, a vector at a time. No two iterations write the same element, so
repeated indices need no atomics and add up in index order, as the serial loop did.

On a GPU the same plan, one thread per (leading index, column): TVM's legalization is a bare
loop nest that no GPU rule can bind to threads, so a CUDA build ran it on the host, with device
pointers (every model with an embedding segfaulted in its first training step on an H200).

`axis` must be given (tvmgraph's gradients always pass it, with 1-D indices). On the CPU the
table's shape must be static (the count of indices may be symbolic: a dynamic batch's tokens);
on a GPU any extent may be symbolic. Anything else keeps TVM's legalization (on a GPU the compile then
stops: ApplyGPUSchedules). Importing this module registers it.
"""

from __future__ import annotations

import math
import os

import tvm
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops import grad as _stock
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T
from tvm.sym import Analyzer
from tvm.tirx.script.builder.utils import buffer_proxy

_LEVEL = 11  # above TVM's own (10)

# A chunk is at least this many columns (one cache line of floats per row, at least): narrower
# chunks share cache lines between threads.
MIN_CHUNK_COLUMNS = 16
VECTOR_COLUMNS = 8
GPU_BLOCK_THREADS = 256


def _static(shape) -> list[int] | None:
    return [int(d) for d in shape] if all(isinstance(d, tirx.IntImm) for d in shape) else None


def column_chunks(leading: int, columns: int, threads: int) -> int:
    """How many chunks to cut `columns` into: the fewest, dividing it evenly and at least
    MIN_CHUNK_COLUMNS wide, that give every thread some (leading x chunks) iterations."""
    best = 1
    for chunks in range(1, columns + 1):
        if columns % chunks or columns // chunks < MIN_CHUNK_COLUMNS:
            continue
        best = chunks
        if leading * chunks >= threads:
            break
    return best


def _parallel_take_backward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    axis = call.attrs.axis
    dy, x, indices = call.args
    idx_ndim = indices.ty.ndim if isinstance(indices.ty, relax.TensorType) else None
    if axis is None or idx_ndim != 1 or not isinstance(x.ty, relax.TensorType) or x.ty.ndim < 0:
        return _stock._grad_take_backward(bb, call)
    axis = int(axis) % x.ty.ndim
    target = tvm.target.Target.current(allow_none=True)
    if target is not None and "gpu" in target.keys:  # any extent may be symbolic (a dynamic batch)
        return _extern(bb, dy, x, indices, lambda *ptrs: _gpu_ir(axis, *ptrs))
    x_shape = _static(x.ty.shape)
    if x_shape is None:
        return _stock._grad_take_backward(bb, call)
    leading, columns = math.prod(x_shape[:axis]), math.prod(x_shape[axis + 1:])
    rows = x_shape[axis]
    chunks = column_chunks(leading, columns, os.cpu_count() or 1)
    width = columns // chunks
    vector = VECTOR_COLUMNS if width % VECTOR_COLUMNS == 0 else 1
    # The count of indices from the buffer: symbolic with a dynamic batch (n * seq tokens).
    return _extern(bb, dy, x, indices,
                   lambda dy_ptr, idx_ptr, out_ptr: _cpu_ir(leading, rows, columns, idx_ptr.shape[0], chunks,
                                                            vector, dy_ptr, idx_ptr, out_ptr))


def _i64(n: int) -> tirx.IntImm:
    return tirx.IntImm("int64", n)  # relax shapes are int64


def _cpu_ir(leading, rows, columns, count, chunks, vector, dy_ptr, idx_ptr, out_ptr) -> tirx.Stmt:
    """One parallel iteration per (leading index, chunk of `columns // chunks` columns)."""
    out, grad, idx = buffer_proxy(out_ptr), buffer_proxy(dy_ptr), buffer_proxy(idx_ptr)
    width = columns // chunks
    zero = tirx.const(0, out_ptr.dtype)
    with IRBuilder() as ib:
        with T.parallel(_i64(leading * chunks)) as task:
            lead = task // chunks
            first = task % chunks * width
            out_base = lead * rows * columns + first
            grad_base = lead * count * columns + first
            with T.serial(_i64(rows)) as r:
                with T.serial(_i64(width // vector)) as c:
                    with T.vectorized(_i64(vector)) as v:
                        out[out_base + r * columns + c * vector + v] = zero
            with T.serial(tirx.Cast("int64", count)) as l:
                row = tirx.Cast("int64", idx[l]) * columns
                with T.serial(_i64(width // vector)) as c:
                    with T.vectorized(_i64(vector)) as v:
                        at = out_base + row + c * vector + v
                        out[at] = out[at] + grad[grad_base + l * columns + c * vector + v]
    return ib.get()


def _gpu_ir(axis: int, dy_ptr, idx_ptr, out_ptr) -> tirx.Stmt:
    """One GPU thread per (leading index, column): neighbouring threads touch neighbouring
    columns (coalesced), and each adds its column's rows in index order, as on the CPU. The
    extents come from the buffers' shapes, symbolic or not."""
    out, grad, idx = buffer_proxy(out_ptr), buffer_proxy(dy_ptr), buffer_proxy(idx_ptr)
    shape = [tirx.Cast("int64", d) for d in out_ptr.shape]
    leading, columns = _product(shape[:axis]), _product(shape[axis + 1:])
    rows, count = shape[axis], tirx.Cast("int64", idx_ptr.shape[0])
    total = leading * columns
    static_total = total.value if isinstance(total, tirx.IntImm) else None
    block = min(GPU_BLOCK_THREADS, static_total) if static_total else GPU_BLOCK_THREADS
    blocks = (total + block - 1) // block
    zero = tirx.const(0, out_ptr.dtype)
    bx, tx = tirx.Var("blockIdx.x", "int32"), tirx.Var("threadIdx.x", "int32")
    with IRBuilder() as ib:
        task = tirx.Cast("int64", bx) * block + tirx.Cast("int64", tx)
        with T.If(task < total):
            with T.Then():
                out_base = task // columns * rows * columns + task % columns
                grad_base = task // columns * count * columns + task % columns
                with T.serial(rows) as r:
                    out[out_base + r * columns] = zero
                with T.serial(count) as l:
                    at = out_base + tirx.Cast("int64", idx[l]) * columns
                    out[at] = out[at] + grad[grad_base + l * columns]
    body = ib.get()
    for var, extent in ((tx, tirx.IntImm("int32", block)), (bx, tirx.Cast("int32", blocks))):  # innermost first
        thread = tirx.IterVar(tvm.ir.Range(0, extent), var, 1, var.name)  # 1: a thread index
        body = tirx.AttrStmt(thread, "thread_extent", extent, body)
    return body


def _product(dims: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """The product of int64 extents, folded where they are constants."""
    return Analyzer().simplify(math.prod(dims, start=tirx.IntImm("int64", 1)))


def _extern(bb: relax.BlockBuilder, dy: relax.Expr, x: relax.Expr, indices: relax.Expr, ir) -> relax.Expr:
    """`ir(dy, indices, out)` as the body of a PrimFunc `take_backward` returning x's shape."""

    def kernel(dy_t: te.Tensor, x_t: te.Tensor, idx_t: te.Tensor):
        out_buf = tirx.decl_buffer(x_t.shape, x_t.dtype, "out_buf")
        return te.extern([x_t.shape], [dy_t, x_t, idx_t], lambda ins, outs: ir(ins[0], ins[2], outs[0]),
                         dtype=x_t.dtype, out_buffers=[out_buf], name="take_backward", tag="take_backward")

    return bb.call_te(kernel, dy, x, indices, primfunc_name_hint="take_backward")


tvm.ir.register_op_attr("relax.grad.take_backward", "FLegalize", _parallel_take_backward, level=_LEVEL)
