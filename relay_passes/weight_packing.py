"""Weights packed once: an inference graph's matmuls read their weights in panels made ahead.

A product `x @ W.T` packs W into panels of its register tile's width on every call, and for a
few rows of x that copy costs about as much as the multiply-adds (docs/benchmarks.md: 64 x 1024
x 1024 at 71-72% of the FMA peak with W already in panels, 62-67% packed per call). With
`graph.config.enable_frozen_weights()` the graph's state does not change behind its back, so
the packing can run once per weight version. Two passes, either side of the schedules:

  MarkPackedWeights   before the schedules: a kernel that `main` calls with a frozen tensor
                      (attribute `tvmgraph.frozen_params`, main's parameter indices) lists that
                      argument in its `layout_free_buffers`; the Matmul rule then packs it in a
                      block of its own, marked WEIGHT_PACK (tvmgraph/schedules/matmul.py).
  LiftWeightPacking   after them: TVM's SplitLayoutRewritePreproc makes each marked block a
                      kernel of its own, called before the product; those calls on frozen
                      tensors move out of `main` into `pack_weights`, and their results become
                      main's last parameters:

    main(x, W, b):                                   pack_weights(W, b):        (main's state)
      Wp = call_tir(k_weight_prepack, W)                 Wp = call_tir(k_weight_prepack, W)
      y = call_tir(k_prepacked, x, Wp, b)       ->       return (Wp,)
                                                     main(x, W, b, Wp):
                                                       y = call_tir(k_prepacked, x, Wp, b)

`pack_weights` takes main's parameters from `num_input` on, the state tensors; the runner
(tvmgraph/weight_cache.py) calls it when a state tensor changed and passes its results after
them. Exact (the same products, their operands copied earlier). Inference graphs only.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from relay_passes import report_counts
from relay_passes.bindings import Substitute, rebound

FROZEN_PARAMS = "tvmgraph.frozen_params"  # main's attribute: indices of its frozen parameters
PACK_FUNCTION = "pack_weights"
# SplitLayoutRewritePreproc's names for a split-off pack and the kernel left reading its result.
_PREPACK_SUFFIX = "_weight_prepack"
PREPACKED_SUFFIX = "_prepacked"


def _frozen(main: relax.Function) -> set[relax.Var]:
    indices = (main.attrs or {}).get(FROZEN_PARAMS, [])
    return {main.params[int(i)] for i in indices}


def _calls(main: relax.Function) -> list[relax.Call]:
    found: list[relax.Call] = []
    relax.analysis.post_order_visit(
        main.body, lambda e: found.append(e) if isinstance(e, relax.Call) and e.op.same_as(_CALL_TIR) else None)
    return found


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="MarkPackedWeights")
class MarkPackedWeights:
    """List main's frozen arguments of each kernel in the kernel's `layout_free_buffers`."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        frozen = _frozen(mod["main"])
        if not frozen:
            return mod
        # A kernel takes an argument as layout-free only where every call passes a frozen tensor.
        positions: dict[tvm.ir.GlobalVar, set[int]] = {}
        for call in _calls(mod["main"]):
            args = call.args[1].fields
            here = {i for i, arg in enumerate(args) if arg in frozen}
            gv = call.args[0]
            positions[gv] = positions.get(gv, here) & here
        marked = 0
        for gv, free in positions.items():
            if free and isinstance(mod[gv], tvm.tirx.PrimFunc):
                mod[gv] = mod[gv].with_attr("layout_free_buffers", sorted(free))
                marked += 1
        report_counts(self.report, "MarkPackedWeights", {"kernel reading frozen weights": marked} if marked else {})
        return mod


@tvm.transform.module_pass(opt_level=0, name="LiftWeightPacking")
class LiftWeightPacking:
    """Split each marked weight pack off its kernel; move the packs of frozen tensors out of
    `main` into `pack_weights`, their results main's last parameters."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()] or not _frozen(mod["main"]):
            return mod
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        main = mod["main"]
        frozen = _frozen(main)
        num_input = int(main.attrs["num_input"])
        state = list(main.params[num_input:])
        lifted: list[relax.VarBinding] = []
        for block in main.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
                        and value.op.same_as(_CALL_TIR) and value.args[0].name_hint.endswith(_PREPACK_SUFFIX)
                        and all(arg in frozen for arg in value.args[1].fields)):
                    lifted.append(binding)
        if not lifted:
            return mod
        packed = [relax.Var(f"{b.var.name}_packed", b.var.ty) for b in lifted]
        substitute = Substitute({b.var: p for b, p in zip(lifted, packed)})
        gone = {b.var for b in lifted}
        blocks = [type(block)([rebound(b, substitute) for b in block.bindings if b.var not in gone])
                  for block in main.body.blocks]
        body = relax.SeqExpr(blocks, substitute.visit_expr(main.body.body))
        mod["main"] = relax.Function([*main.params, *packed], body, main.ret_ty, main.is_pure, main.attrs)
        mod[PACK_FUNCTION] = _pack_function(state, lifted)
        report_counts(self.report, "LiftWeightPacking", {"weight packed once": len(lifted)})
        return relax.transform.Normalize()(mod)


def _pack_function(state: list[relax.Var], lifted: list[relax.VarBinding]) -> relax.Function:
    """pack_weights(state...) -> (packed...): the lifted packs over fresh copies of the state."""
    params = [relax.Var(p.name, p.ty) for p in state]
    substitute = Substitute(dict(zip(state, params)))
    bindings = [relax.VarBinding(relax.Var(b.var.name, b.var.ty), substitute.visit_expr(b.value))
                for b in lifted]
    result = relax.Tuple([b.var for b in bindings])
    body = relax.SeqExpr([relax.BindingBlock(bindings)], result)
    return relax.Function(params, body, result.ty, True).with_attr("global_symbol", PACK_FUNCTION)
