"""FuseEpilogue: a matmul or conv2d and the element-wise ops after it become one kernel.

    wt = R.permute_dims(w)                    o = fused_relax_permute_dims_relax_matmul_..._add(
    y = R.matmul(x, wt)                              w, x, b, r)
    z = R.add(b, y)                      ->     (a function holding the same six ops, which
    h = R.reshape(z, s)                          LegalizeOps and FuseTIR turn into one PrimFunc)
    a = R.nn.gelu(h)
    o = R.add(a, r)

Each matmul (`relax.matmul`) or convolution (`relax.nn.conv2d`) is grouped with a chain of up to
`MAX_EPILOGUE` ops, each applied to the previous result: a bias or residual `add`, an activation
(`relu`, `clip` as in relu6, `gelu`, `gelu_tanh`), a `multiply` by a per-channel factor (an
eval-mode batch norm, relay_passes/inference_batch_norm.py), or a `reshape` between them (nn.Linear on a
3-D input, or a residual added in another shape). A matmul operand that is a transpose
(`permute_dims` of the last two axes, as in nn.Linear's `x @ w.T` and every weight gradient) is
grouped too, so that the kernel reads the untransposed tensor; so is the reshape-transpose-
reshape that lays out a grouped (depthwise) conv's input for its weight gradient, which would
otherwise be a copy of the whole activation (24 MiB in the benchmark CNN's step). The schedule rules
(tvmgraph/schedules/matmul.py, conv.py) see one PrimFunc: they compute the epilogue on the
accumulator registers before the one store, and inline the transpose into the operand reads.

TVM's FuseOps already fuses element-wise ops after a matmul; this pass fuses past a reshape
(FuseOps stops at injective ops), takes operand transposes in (FuseOps never fuses producers
into a matmul), and groups exactly what the schedule rules handle.

Position: after SimplifyBroadcastMatmul (which removes broadcast weights) and before
LegalizeOps; FuseOps then fuses what is left. A group is a function with the attributes
"Primitive" and "Composite" (= PATTERN_NAME), which LegalizeOps legalizes and FuseTIR fuses.
Turned off (GraphConfig.allow_fuse_add_to_output(False)) it does nothing: FuseOps alone fuses.

A value inside the chain that is also used outside it (the pre-activation a training graph
keeps for the backward pass) becomes a second output of the group. A chain is not taken where
the group would depend on itself: in `x = x + a(x); y = x + b(x)` the first matmul's chain
must end at the first residual add, since `b(x)`, which the second add reads, needs that sum
(one group with both adds would be computed from its own output). FuseOpsByPattern does not
check this, so `bindings.Acyclic` does, for the groups of each pattern in turn.

Limits: a chain ends at the first op that is not listed (batch_norm, softmax, ...), that
broadcasts the result to a larger shape, at a reshape that splits the innermost axis (its
stores would not vectorize; outside the group it is a view), before a reshape of a value the
group outputs anyway (a training step's activation that the backward pass reads: the group
would store the same elements twice; outside, the reshape is a view), or at a reshape to a
symbolic shape (a dynamic batch:
FuseOpsByPattern would make the shape a parameter, which LegalizeOps cannot take); a transpose
or regrouping whose result is also used elsewhere is left out of the group (it is materialized anyway); only float tensors; transposes up to rank 5.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext
from tvm.sym import Analyzer

from .bindings import Acyclic

PATTERN_NAME = "tvmgraph.fuse_epilogue"
MAX_EPILOGUE = 4
MAX_RANK = 5  # operand transposes are matched up to this rank
UNARY = ("relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh")


def _epilogue_op(x: DFPattern) -> DFPattern:
    """One epilogue step applied to `x`."""
    # SiLU as torch.export writes it, `x * sigmoid(x)` (first: `x * anything` would match it
    # with the sigmoid left outside, which the check then refuses).
    sigmoid = is_op("relax.sigmoid")(x)
    step = is_op("relax.multiply")(x, sigmoid) | is_op("relax.multiply")(sigmoid, x)
    step = step | is_op("relax.add")(x, wildcard()) | is_op("relax.add")(wildcard(), x)
    for name in UNARY:
        step = step | is_op(name)(x)
    step = step | is_op("relax.clip")(x, wildcard(), wildcard())
    # A per-channel scale (an eval-mode batch norm, relay_passes/inference_batch_norm.py; _check
    # takes no other multiply).
    step = step | is_op("relax.multiply")(x, wildcard()) | is_op("relax.multiply")(wildcard(), x)
    return step | is_op("relax.reshape")(x, wildcard())


def _transposed(x: DFPattern) -> DFPattern:
    """permute_dims(x) swapping the last two axes, for x of rank 2 to MAX_RANK."""
    swaps = [is_op("relax.permute_dims")(x).has_attr({"axes": [*range(n - 2), n - 1, n - 2]})
             for n in range(2, MAX_RANK + 1)]
    out = swaps[0]
    for swap in swaps[1:]:
        out = out | swap
    return out


def _regrouped(x: DFPattern) -> DFPattern:
    """reshape(permute_dims(reshape(x))): how autodiff lays out a grouped conv's input for its
    weight gradient (the batch folded into the groups)."""
    return is_op("relax.reshape")(is_op("relax.permute_dims")(is_op("relax.reshape")(x, wildcard())),
                                  wildcard())


def _producer(transposed: bool) -> DFPattern:
    a, b = wildcard(), wildcard()
    data = wildcard()
    if transposed:
        a, b = _transposed(a) | a, _transposed(b) | b
        data = _regrouped(data) | data
    return is_op("relax.matmul")(a, b) | is_op("relax.nn.conv2d")(data, wildcard())


def _pattern(depth: int, transposed: bool) -> tuple[DFPattern, dict[str, DFPattern], Callable]:
    """(pattern, annotations, check) for a producer followed by `depth` epilogue ops."""
    producer = _producer(transposed)
    out = producer
    for _ in range(depth):
        out = _epilogue_op(out)
    return out, {"producer": producer}, _check


def _check(context: PatternCheckContext) -> bool:
    """Float tensors; no step broadcasts past the producer's size; an operand's transpose or
    regrouping is used by the producer alone."""
    producer = context.annotated_expr["producer"]
    size = _numel(producer)
    if size is None or not str(producer.ty.dtype).startswith(("float", "bfloat")):
        return False
    bindings = context.matched_bindings
    inside = set(bindings.keys())
    operand_side = _operand_side(producer, bindings)
    for var, value in bindings.items():
        if not isinstance(value, relax.Call) or value.same_as(producer):
            continue
        if var in operand_side:
            if _used_outside(var, context, inside):
                return False
        elif not _same_size(_numel(value), size) or not _multiplies_per_axis(value, inside, bindings):
            return False
        if _symbolic_reshape(value) or _splits_innermost_axis(value):
            return False
        if _copies_an_output(var, value, context, inside):
            return False
    return True


def _used_outside(var: relax.Var, context: PatternCheckContext, inside: set[relax.Var]) -> bool:
    """Whether the group would output `var`: a result of the block, or read by a binding outside
    the match (as the pattern's root is)."""
    if not isinstance(var, relax.DataflowVar):
        return True
    return any(u not in inside for u in context.var_usages.get(var, []))


def _copies_an_output(var: relax.Var, value: relax.Call, context: PatternCheckContext,
                      inside: set[relax.Var]) -> bool:
    """A reshape that the group would output beside the value it reshapes, which the group
    outputs too (read outside: a training step's activation read by the backward pass and, as
    2-D, by the next layer): the kernel would store the same elements twice. Left out, the
    reshape is a view of the group's output."""
    if not (isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.reshape"):
        return False
    source = value.args[0]
    return (isinstance(source, relax.Var) and source in inside and _used_outside(source, context, inside)
            and _used_outside(var, context, inside))


def _multiplies_per_axis(value: relax.Call, inside: set[relax.Var], bindings: dict) -> bool:
    """Not a multiply, a SiLU's `x * sigmoid(x)`, or a multiply by a factor that varies along
    one axis at most (a per-channel scale); a product of two activations (a gate) stays out of
    the group."""
    if not (isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.multiply"):
        return True
    if _is_silu(value, bindings):
        return True
    factors = [a for a in value.args if not (isinstance(a, relax.Var) and a in inside)]
    if len(factors) != 1 or not isinstance(factors[0].ty, relax.TensorType):
        return False
    shape = factors[0].ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return False
    varying = [d for d in shape.values if not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)]
    return len(varying) <= 1


def _is_silu(value: relax.Call, bindings: dict) -> bool:
    """`x * sigmoid(x)` (either order), the sigmoid bound in the match."""
    for x, s in (value.args, value.args[::-1]):
        sigmoid = bindings.get(s) if isinstance(s, relax.Var) else None
        if (isinstance(sigmoid, relax.Call) and isinstance(sigmoid.op, tvm.ir.Op)
                and sigmoid.op.name == "relax.sigmoid" and sigmoid.args[0].same_as(x)):
            return True
    return False


def _splits_innermost_axis(value: relax.Call) -> bool:
    """A reshape whose last axis is not whole multiples of its input's (a weight gradient
    [co, ci * 9] -> [co, ci, 3, 3]). In the group, the kernel's vector of 16 output columns is
    stored through `j // 9, j // 3 % 3, j % 3`, which TVM's vectorizer cannot prove contiguous:
    16 scalar stores with their index arithmetic each (ResNet-18's 512 x 4608 x 256 weight
    gradient: 5.9 ms in the group, 3.8 as a product alone). Left out, the reshape is a view."""
    if not (isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.reshape"):
        return False
    before, after = value.args[0].ty.shape, value.ty.shape
    if before is None or after is None or not before.values or not after.values:
        return False
    old, new = before.values[-1], after.values[-1]
    if not (isinstance(old, tvm.tirx.IntImm) and isinstance(new, tvm.tirx.IntImm)):
        return False
    return int(new) % int(old) != 0


def _symbolic_reshape(value: relax.Call) -> bool:
    """A reshape to a symbolic shape (a dynamic batch): FuseOpsByPattern would pass the shape
    into the group as a parameter, which LegalizeOps cannot legalize a reshape to."""
    if not (isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.reshape"):
        return False
    shape = value.args[1]
    return not (isinstance(shape, relax.ShapeExpr) and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values))


def _operand_side(producer: relax.Call, bindings: dict) -> set[relax.Var]:
    """The matched bindings that compute the producer's operands."""
    found: set[relax.Var] = set()
    pending = [a for a in producer.args if isinstance(a, relax.Var)]
    while pending:
        var = pending.pop()
        if var in bindings and var not in found:
            found.add(var)
            pending.extend(a for a in bindings[var].args if isinstance(a, relax.Var))
    return found


def _numel(expr: relax.Expr) -> tvm.tirx.PrimExpr | None:
    """The number of elements, symbolic under a dynamic batch; None when the shape is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    n = tvm.tirx.const(1, "int64")
    for d in ty.shape.values:
        n = n * d
    return n


def _same_size(a: tvm.tirx.PrimExpr | None, b: tvm.tirx.PrimExpr) -> bool:
    return a is not None and Analyzer().can_prove_equal(a, b)


Check = Callable[[PatternCheckContext], bool]


def patterns() -> list[tuple[DFPattern, dict[str, DFPattern], Check]]:
    """(pattern, annotations, check), longest chains first; for each length, with operand
    transposes first; last a matmul/conv with transposed (regrouped) operands and no epilogue.
    (FuseOpsByPattern gives an op to the first pattern that takes it.)"""
    result = []
    for depth in range(MAX_EPILOGUE, 0, -1):
        for transposed in (True, False):
            result.append(_pattern(depth, transposed))
    pattern, annotations, check = _pattern(0, True)

    def has_operand_ops(context: PatternCheckContext) -> bool:
        return check(context) and bool(_operand_side(context.annotated_expr["producer"],
                                                     context.matched_bindings))

    result.append((pattern, annotations, has_operand_ops))
    return result


@tvm.transform.module_pass(opt_level=0, name="FuseEpilogue")
class FuseEpilogue:
    """Group each matmul/conv2d with its operand transposes and element-wise epilogue."""

    def __init__(self, enabled: bool = True, report: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled:
            return mod
        before = {gv.name_hint for gv, _ in mod.functions_items()}
        # NOTE: one pattern at a time (as FuseOpsByPattern itself does), so that each check
        # sees the groups of the patterns before it as calls.
        for pattern, annotated, check in patterns():
            acyclic = Acyclic(mod)
            fusion = FusionPattern(PATTERN_NAME, pattern, annotated,
                                   lambda context, check=check, acyclic=acyclic:
                                   check(context) and acyclic(context))
            mod = relax.transform.FuseOpsByPattern([fusion], bind_constants=False)(mod)
        groups = [f for gv, f in mod.functions_items()
                  if gv.name_hint not in before and isinstance(f, relax.Function)]
        if groups:
            ops = sum(_count_ops(f) for f in groups)
            self.report(f"FuseEpilogue: {len(groups)} matmul/conv kernel(s) with their epilogues "
                        f"({ops} ops in all)")
        return mod


def _count_ops(func: relax.Function) -> int:
    count = 0

    def visit(expr: relax.Expr) -> None:
        nonlocal count
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            count += 1

    relax.analysis.post_order_visit(func.body, visit)
    return count
