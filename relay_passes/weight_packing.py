"""Frozen weights: what an inference graph computes from its weights alone, computed once.

With `graph.config.enable_frozen_weights()` the graph's state does not change behind its back
(tvmgraph/frozen_weights.py), so every kernel whose operands are frozen tensors, or results of
such kernels, gives the same result on every call: a weight's transpose shared by an RNN's steps
(ShareTransposes), its bfloat16 cast under AMP, an eval-mode batch norm's scale and shift, and
the packing of a weight into the panels a matmul's register tiles read. A product `x @ W.T`
with a few rows of x packs W on every call, which costs about as much as its multiply-adds
(docs/benchmarks.md). Two passes, either side of the schedules:

  MarkPackedWeights       before the schedules: a kernel that `main` calls with frozen values
                          (FROZEN_PARAMS, main's attribute, and what kernels compute from them
                          alone) lists those arguments in its `layout_free_buffers`; the Matmul
                          rule then packs such a B in a block of its own, marked WEIGHT_PACK
                          (tvmgraph/schedules/matmul.py).
  LiftFrozenComputation   after them: TVM's SplitLayoutRewritePreproc makes each marked block a
                          kernel of its own, called before the product; then every kernel call
                          on frozen values moves out of `main` into `pack_weights`, whose
                          results main reads become main's last parameters:

    main(x, W, b):                                   pack_weights(W, b):        (main's state)
      Wt = call_tir(transpose, W)                        Wt = call_tir(transpose, W)
      Wp = call_tir(k_weight_prepack, Wt)       ->       Wp = call_tir(k_weight_prepack, Wt)
      y = call_tir(k_prepacked, x, Wp, b)                return (Wp,)
                                                     main(x, W, b, Wp):
                                                       y = call_tir(k_prepacked, x, Wp, b)

A value main returns stays in main (the caller owns its outputs; a cached one could be changed
through them). `pack_weights` takes main's parameters from `num_input` on, the state tensors;
the runner calls it when a state tensor changed and passes its results after them. Exact (the
same kernels, run earlier). Inference graphs only.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from relay_passes import report_counts
from relay_passes.bindings import Substitute, is_view, rebound, vars_in

FROZEN_PARAMS = "tvmgraph.frozen_params"  # main's attribute: indices of its frozen parameters
PACK_FUNCTION = "pack_weights"
PREPACKED_SUFFIX = "_prepacked"  # SplitLayoutRewritePreproc's name for a kernel reading a pack
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _has_main(mod: tvm.IRModule) -> bool:
    return any(gv.name_hint == "main" for gv in mod.get_global_vars())


def _lifts(binding: relax.Binding, frozen: set[relax.Var]) -> bool:
    """Whether `binding` is a kernel call on frozen values (or constants) alone, with one
    tensor of static shape as its result."""
    value = binding.value
    if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
            and value.op.same_as(_CALL_TIR) and len(value.args) == 2):  # no symbolic tir_vars
        return False
    shape = getattr(binding.var.ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return False
    return all(isinstance(a, tvm.ir.Constant) or a in frozen for a in value.args[1].fields)


def _frozen_params(main: relax.Function) -> set[relax.Var]:
    return {main.params[int(i)] for i in (main.attrs or {}).get(FROZEN_PARAMS, [])}


def frozen_values(main: relax.Function, kept: set[relax.Var] = frozenset()) -> set[relax.Var]:
    """main's frozen parameters, and the results of kernel calls on frozen values alone, but
    for `kept` and what is computed from them."""
    frozen = _frozen_params(main)
    if not frozen:
        return frozen
    for block in main.body.blocks:
        for binding in block.bindings:
            if binding.var not in kept and _lifts(binding, frozen):
                frozen.add(binding.var)
    return frozen


def _tir_calls(main: relax.Function) -> list[relax.Call]:
    found: list[relax.Call] = []
    relax.analysis.post_order_visit(
        main.body, lambda e: found.append(e) if isinstance(e, relax.Call) and e.op.same_as(_CALL_TIR) else None)
    return found


@tvm.transform.module_pass(opt_level=0, name="MarkPackedWeights")
class MarkPackedWeights:
    """List the frozen arguments of each kernel main calls in the kernel's `layout_free_buffers`."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not _has_main(mod):
            return mod
        frozen = frozen_values(mod["main"])
        if not frozen:
            return mod
        # A kernel takes an argument as layout-free only where every call passes a frozen value.
        positions: dict[tvm.ir.GlobalVar, set[int]] = {}
        for call in _tir_calls(mod["main"]):
            here = {i for i, arg in enumerate(call.args[1].fields) if arg in frozen}
            gv = call.args[0]
            positions[gv] = positions.get(gv, here) & here
        marked = 0
        for gv, free in positions.items():
            if free and isinstance(mod[gv], tvm.tirx.PrimFunc):
                mod[gv] = mod[gv].with_attr("layout_free_buffers", sorted(free))
                marked += 1
        report_counts(self.report, "MarkPackedWeights", {"kernel reading frozen weights": marked} if marked else {})
        return mod


@tvm.transform.module_pass(opt_level=0, name="LiftFrozenComputation")
class LiftFrozenComputation:
    """Split each marked weight pack off its kernel; move every kernel call on frozen values
    out of `main` into `pack_weights`, the results main reads its last parameters."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not _has_main(mod) or not _frozen_params(mod["main"]):
            return mod
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        main = mod["main"]
        # What main returns stays in main, and so does what is computed from it.
        frozen = frozen_values(main, kept=_returned(mod, main))
        bindings = [b for block in main.body.blocks for b in block.bindings]
        lifted = [b for b in bindings if b.var in frozen]
        # A reshape main would read is left to main, where RewriteDataflowReshape makes it a
        # view; kept, it was a copy of the weight (ResNet-18's im2col weights: 40 MiB more).
        while True:
            results = _read_by_main(main, bindings, lifted)
            views = [b for b in lifted if b.var in results and is_view(b.value, mod)]
            if not views:
                break
            lifted = [b for b in lifted if b not in views]
        if not results:
            return mod
        gone = {b.var for b in lifted}
        packed = [relax.Var(f"{v.name}_frozen", v.ty) for v in results]
        substitute = Substitute(dict(zip(results, packed)))
        blocks = [type(block)([rebound(b, substitute) for b in block.bindings if b.var not in gone])
                  for block in main.body.blocks]
        body = relax.SeqExpr(blocks, substitute.visit_expr(main.body.body))
        num_input = int(main.attrs["num_input"])
        mod["main"] = relax.Function([*main.params, *packed], body, main.ret_ty, main.is_pure, main.attrs)
        mod[PACK_FUNCTION] = _pack_function(list(main.params[num_input:]), lifted, results)
        report_counts(self.report, "LiftFrozenComputation",
                      {"kernel run once per weight version": len(lifted), "result kept": len(results)})
        return relax.transform.Normalize()(mod)


def _read_by_main(main: relax.Function, bindings: list[relax.Binding],
                  lifted: list[relax.Binding]) -> list[relax.Var]:
    """The lifted variables that main's remaining bindings or its result read, in order."""
    gone = {b.var for b in lifted}
    read = set(vars_in(main.body.body))
    for b in bindings:
        if b.var not in gone:
            read.update(vars_in(b.value))
    return [b.var for b in lifted if b.var in read]


def _returned(mod: tvm.IRModule, main: relax.Function) -> set[relax.Var]:
    """The variables whose tensors main's result may be: read by its return value, through
    tuples, aliases and reshapes (RewriteDataflowReshape makes a reshape kernel a view)."""
    returned = set(vars_in(main.body.body))
    for block in reversed(main.body.blocks):
        for binding in reversed(block.bindings):
            if binding.var not in returned:
                continue
            value = binding.value
            kernel = isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)
            if not kernel or is_view(value, mod):
                returned.update(vars_in(value))
    return returned


def _pack_function(state: list[relax.Var], lifted: list[relax.Binding],
                   results: list[relax.Var]) -> relax.Function:
    """pack_weights(state...) -> (results...): the lifted calls over fresh copies of the state."""
    params = [relax.Var(p.name, p.ty) for p in state]
    substitute = Substitute(dict(zip(state, params)))
    for b in lifted:  # fresh non-dataflow variables: this function has no dataflow block
        substitute.mapping[b.var] = relax.Var(b.var.name, b.var.ty)
    bindings = [relax.VarBinding(substitute.mapping[b.var], substitute.visit_expr(b.value)) for b in lifted]
    result = relax.Tuple([substitute.mapping[v] for v in results])
    body = relax.SeqExpr([relax.BindingBlock(bindings)], result)
    return relax.Function(params, body, result.ty, True).with_attr("global_symbol", PACK_FUNCTION)
