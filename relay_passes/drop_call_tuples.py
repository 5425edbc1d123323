"""DropCallTuples: a kernel call's outputs are read as the tensors they are, not through a tuple.

After CallTIRRewrite, a call with several outputs writes into tensors allocated before it and
binds a tuple of them, which its readers index:

    a = alloc_tensor(...);  b = alloc_tensor(...)          a = alloc_tensor(...);  b = alloc_tensor(...)
    kernel(x, a, b)                                   ->   kernel(x, a, b)
    t = (a, b);  c = t[0];  h = t[1]                       (c, h: a, b themselves)

TVM's CanonicalizeBindings reads each `t[i]` as the tensor it is, and the pass then drops the
tuples nothing reads any more. Each was a VM instruction at every call: making a tuple object
(32 calls of a tiny kernel took 1.9 us each with two outputs, 0.38 with one). An LSTM's 32 time
steps (two states each) and a training step's kernels with second outputs have them. Exact (no
kernel changes). CPU targets (measured there). Position: after LowerAllocTensor, before
KillAfterLastUse (whose kills then follow the tensors' own last reads).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from relay_passes import graph_functions, report_counts
from relay_passes.bindings import function_reads


@tvm.transform.module_pass(opt_level=0, name="DropCallTuples")
class DropCallTuples:
    """Read multi-output calls' tensors directly; drop the tuples left unread."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = relax.transform.CanonicalizeBindings()(mod)
        dropped = 0
        updates = {}
        for gv, func in graph_functions(mod):
            reads = function_reads(func)
            blocks, before = [], dropped
            for block in func.body.blocks:
                kept = [b for b in block.bindings
                        if not (isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Tuple) and reads[b.var] == 0)]
                dropped += len(block.bindings) - len(kept)
                blocks.append(type(block)(kept))
            if dropped > before:
                updates[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                             func.is_pure, func.attrs)
        for gv, func in updates.items():
            mod[gv] = func
        if updates:  # the rebuilt bodies get their types
            mod = relax.transform.Normalize()(mod)
        report_counts(self.report, "DropCallTuples", {"unread output tuple": dropped} if dropped else {})
        return mod
