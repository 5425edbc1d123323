"""SerialHalfFills: a vectorized loop that stores a bfloat16 value read from no buffer (a fill
with zeros or another constant) runs serial instead.

TVM's bfloat16 legalization (bfloat16 is stored as uint16 on the CPU) fails on such a store once
it is a vector: `dtype mismatch on BufferStore: buffer's dtype is T.uint16, the lanes of indexing
are: 16 ... but RHS's dtype is T.bfloat16x16`, and the whole graph failed to compile. Under AMP
an LSTM's zero initial state is such a kernel (once SeparateBackward's cut held, it was a
kernel of its own). A computed value (one that reads a buffer) legalizes fine, vectorized. A
fill is a few elements (a state), so running it serial costs nothing measurable.

CPU targets, after the schedules.
"""

from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import contains, rewrite_prim_funcs

_FAILING = ("bfloat16",)  # dtypes whose vector constants TVM legalizes wrongly


def _stores_a_half_constant(stmt: tirx.Stmt) -> bool:
    found = []

    def store(node: tirx.BufferStore, mutator: StructuralMutator):
        if str(node.buffer.dtype) in _FAILING and not contains(node.value, ir.TensorLoad):
            found.append(node)
        return node

    structural_mutate(stmt, [(tirx.BufferStore, store)])
    return bool(found)


def _serial(node: tirx.For, mutator: StructuralMutator) -> tirx.Stmt:
    node = mutator.default_mutate(node)
    if not isinstance(node, tirx.For) or node.kind != tirx.ForKind.VECTORIZED or not _stores_a_half_constant(node.body):
        return node
    return tirx.For(node.loop_var, node.min, node.extent, tirx.ForKind.SERIAL, node.body,
                    node.thread_binding, node.annotations, node.step, node.span)


def serial_half_fills(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its vectorized bfloat16 fills serial."""
    return structural_mutate(func, [(tirx.For, _serial)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.SerialHalfFills")
class SerialHalfFills:
    """Apply `serial_half_fills` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, serial_half_fills)
