"""LegalizeOnce: TVM's LegalizeOps, each distinct operator call legalized once.

    y1 = R.add(a, b)                          y1 = R.call_tir(add, (a, b), ...)    # legalized
    y2 = R.add(c, d)      (c, d typed as a, b) ->   y2 = R.call_tir(add, (c, d), ...)    # reused

LegalizeOps builds a TE compute and a PrimFunc for every operator call, then keeps one PrimFunc
of each structurally equal set (the BlockBuilder deduplicates them): about 1 ms of Python a call.
Models repeat the same call with the same shapes (an RNN unrolled over its time steps, the
blocks of a ResNet, a training step's gradients of like layers): a 2-layer GRU's training step
made 3433 PrimFuncs for a few hundred distinct ones.

Here every operator's legalization is wrapped (LegalizeOps' custom map, consulted before the
registered ones and under the same conditions): a call whose operator, attributes, argument
types, other arguments and result type equal an earlier call's (structurally, the variables
mapped by position) reuses that call's result with its own arguments, when that result was
exactly `call_tir(f, (the call's tensor arguments, in order))`. Anything else is legalized as
before and not reused: a legalization that looks up a tuple or shape argument's binding (concat,
einsum, a reshape to a shape variable), emits more than one binding, repeats an argument, or
takes a constant. The module is the one LegalizeOps makes (tests/passes/test_legalize_once.py).

Position: where LegalizeOps was, after LowerCallTIRWithGrad.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax

from relay_passes import report_counts

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


class _Reuse:
    """The memo of one LegalizeOps run: each reusable call (as its template, `_template`) and
    the `call_tir` it was legalized to."""

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[relax.Call, relax.Call]]] = {}  # hash -> (call, its call_tir)
        self.calls = self.reused = 0

    def wrap(self, legalize: Callable) -> Callable:
        def legalize_once(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            self.calls += 1
            tensors = _tensor_arguments(call)
            if tensors is None:
                return legalize(bb, call)
            template = _template(call)
            key = tvm_ffi.structural_hash(template, map_free_vars=True) ^ tvm_ffi.structural_hash(call.ty)
            for earlier, legalized in self.seen.get(key, []):
                if _same_call(template, call, earlier):
                    self.reused += 1
                    return relax.Call(legalized.op, [legalized.args[0], relax.Tuple(tensors)],
                                      legalized.attrs, legalized.ty_args)
            result = legalize(bb, call)
            if _reusable(result, tensors):
                self.seen.setdefault(key, []).append((template, result))
            return result

        return legalize_once


def _tensor_arguments(call: relax.Call) -> list[relax.Var] | None:
    """The call's variable arguments, all tensors; None where the call is not reused: an
    argument that is a tuple or shape variable (legalizations look up its binding), a constant,
    or the same variable twice."""
    tensors = []
    for arg in call.args:
        if isinstance(arg, relax.Var):
            if not isinstance(arg.ty, relax.TensorType) or any(arg.same_as(t) for t in tensors):
                return None
            tensors.append(arg)
        elif isinstance(arg, (tvm.ir.Constant, relax.Tuple)):
            return None
    return tensors


def _template(call: relax.Call) -> relax.Call:
    """The call with each variable argument replaced by a new variable of its type (a block's
    dataflow variable and a function parameter are then alike), its result type attached."""
    args = [relax.Var(f"arg{i}", arg.ty) if isinstance(arg, relax.Var) else arg for i, arg in enumerate(call.args)]
    return relax.Call(call.op, args, call.attrs, call.ty_args, ret_ty=call.ty)


def _same_call(template: relax.Call, call: relax.Call, earlier: relax.Call) -> bool:
    """Equal but for which variables they take (argument and result types compared too)."""
    return (tvm_ffi.structural_equal(template, earlier, map_free_vars=True)
            and tvm_ffi.structural_equal(call.ty, earlier.ty)
            and all(tvm_ffi.structural_equal(a.ty, b.ty) for a, b in zip(template.args, earlier.args)
                    if isinstance(a, relax.Var)))


def _reusable(result: relax.Expr, tensors: list[relax.Var]) -> bool:
    """Whether `result` is exactly `call_tir(f, tensors)`."""
    if not (isinstance(result, relax.Call) and result.op.same_as(_CALL_TIR) and len(result.args) == 2):
        return False
    gv, args = result.args
    return (isinstance(gv, tvm.ir.GlobalVar) and isinstance(args, relax.Tuple) and len(args.fields) == len(tensors)
            and all(a.same_as(t) for a, t in zip(args.fields, tensors)))


def _legalizations() -> dict[str, Callable]:
    """Every operator's registered legalization (tvmgraph's replacements included)."""
    found = {}
    for name in tvm.ir.Op.list_op_names():
        legalize = tvm.ir.Op.get(name).get_attr("FLegalize")
        if legalize is not None:
            found[name] = legalize
    return found


@tvm.transform.module_pass(opt_level=0, name="LegalizeOnce")
class LegalizeOnce:
    """LegalizeOps, reusing the legalization of a call equal to an earlier one."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        reuse = _Reuse()
        custom = {name: reuse.wrap(legalize) for name, legalize in _legalizations().items()}
        mod = relax.transform.LegalizeOps(custom)(mod)
        if reuse.reused:
            report_counts(self.report, "LegalizeOnce", {"operator call legalized": reuse.calls - reuse.reused,
                                                        "reused": reuse.reused})
        return mod
