"""FoldConstantTables: tables computed from constants alone with transcendental ops are
computed once, at compile time.

    a = R.astype(metadata[0], "float32")          (torch.arange(t), made a constant by export)
    f = R.power(R.const(10000.0), R.divide(b, 64.0))
    angle = R.divide(R.expand_dims(a, 1), f)                 cos = R.const(<128 x 32 table>)
    cos = R.cos(angle);  sin = R.sin(angle)          ->      sin = R.const(<128 x 32 table>)
    y = R.multiply(x_even, cos) ...                          y = R.multiply(x_even, cos) ...

A LLaMA's rotary embedding computes its cos/sin tables from `torch.arange` in forward(); so do
sinusoidal position encodings. Nothing in them depends on an input, and FuseOps fuses the
whole chain into the element-wise kernel that applies it: the tables were recomputed for every
element of q and k, batch and heads included, each `power`, `cos` and `sin` a scalar libm
call (benchmarks.outside's LLaMA, 8 x 4 heads x 128 tokens: the two rotary kernels 38% of an
inference call on a 2-vCPU Xeon).

TVM's FoldConstant would fold them, and everything else constant with them: every constant
kernel compiled and run at build time doubled that LLaMA's compile (3.6 -> 7.5 s). Here only
what is worth it is folded: a value computed from constants alone (ops of constants and of
such values; no input, parameter or symbolic shape) that something else reads, of at most
`MAX_ELEMENTS` elements, with a transcendental op (`TRANSCENDENTAL`) among the ops it comes
from. The values of a function are computed together, by one Relax function compiled for the
host and run once; each is then a constant of the program. The tables are TVM's own
legalization of the same ops, so the numbers are those the kernels computed before (libm's cos,
sin and pow, bit for bit), except that an exp, tanh, erf or sigmoid is libm's where tvmgraph's
CPU kernels use a polynomial (schedules/fast_math.py, within 3e-7 relative of it).

Position: before LegalizeOps (after autodiff, so a training step's backward pass reads the same
constants), on every target: the values are computed on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import math

import numpy as np
import tvm
from tvm import relax

from relay_passes import graph_functions
from relay_passes.bindings import Substitute, drop_unread, vars_in
from relay_passes.tensor_sizes import static_shape
from tvmgraph.schedules.loops import with_functions

MAX_ELEMENTS = 1 << 20  # 4 MiB of float32: a table, not an activation made of constants

TRANSCENDENTAL = frozenset(f"relax.{name}" for name in (
    "cos", "sin", "tan", "acos", "asin", "atan", "atan2", "cosh", "sinh", "tanh", "acosh", "asinh", "atanh",
    "exp", "log", "log2", "log10", "log1p", "expm1", "power", "sqrt", "rsqrt", "erf", "sigmoid",
))


def _is_constant_leaf(expr: relax.Expr) -> bool:
    # tvm.ir.expr.Constant: tensor constants (GenericConst) and primitive values (IntImm, FloatImm)
    return isinstance(expr, tvm.ir.expr.Constant) or (
        isinstance(expr, relax.ShapeExpr) and all(isinstance(v, tvm.tirx.IntImm) for v in expr.values))


def _static_numel(expr: relax.Expr) -> int | None:
    shape = static_shape(expr)
    return None if shape is None else math.prod(shape)


class _Tables:
    """The constant values of one function and the ones to fold (see the module docstring)."""

    def __init__(self, func: relax.Function) -> None:
        self.bindings: dict[relax.Var, relax.Call] = {}   # constant values, in order
        self.expensive: dict[relax.Var, bool] = {}        # a transcendental op among its sources
        readers_outside: set[relax.Var] = set()
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(binding, relax.VarBinding) and self._constant_call(value):
                    self.bindings[binding.var] = value
                    self.expensive[binding.var] = value.op.name in TRANSCENDENTAL or any(
                        self.expensive.get(v, False) for v in vars_in(value))
                else:
                    readers_outside.update(vars_in(value) if isinstance(binding, relax.VarBinding) else [])
        readers_outside.update(vars_in(func.body.body))
        # (every value in `bindings` has a static shape: `_constant_call` requires it)
        self.folded = [v for v in self.bindings if v in readers_outside and self.expensive[v]
                       and _static_numel(v) <= MAX_ELEMENTS]

    def _constant_call(self, value: relax.Expr) -> bool:
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
            return False
        if _static_numel(value) is None or value.op.name.startswith(("relax.call_", "relax.vm.", "relax.builtin")):
            return False
        args = list(value.args)
        for arg in args:
            if isinstance(arg, relax.Tuple):
                args.extend(arg.fields)
                continue
            if not (_is_constant_leaf(arg) or (isinstance(arg, relax.Var) and arg in self.bindings)):
                return False
        return True

    def function(self) -> relax.Function:
        """A function with no parameters returning the folded values."""
        needed: set[relax.Var] = set()
        stack = list(self.folded)
        while stack:
            var = stack.pop()
            if var not in needed:
                needed.add(var)
                stack.extend(v for v in vars_in(self.bindings[var]) if v in self.bindings)
        bb = relax.BlockBuilder()
        remap: dict[relax.Var, relax.Var] = {}

        def moved(arg: relax.Expr) -> relax.Expr:
            if isinstance(arg, relax.Tuple):
                return relax.Tuple([moved(field) for field in arg.fields])
            return remap.get(arg, arg) if isinstance(arg, relax.Var) else arg

        with bb.function("main", []):
            with bb.dataflow():
                for var, value in self.bindings.items():
                    if var in needed:
                        remap[var] = bb.emit(relax.Call(value.op, [moved(a) for a in value.args], value.attrs,
                                                        value.ty_args))
                out = bb.emit_output(relax.Tuple([remap[v] for v in self.folded]))
            bb.emit_func_output(out)
        return bb.get()["main"]


def _values(func: relax.Function) -> list[np.ndarray]:
    """Run `func` (no parameters) once on the host."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    target = tvm.target.Target({"kind": "llvm"})
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return [t.numpy() for t in vm["main"]()]


@tvm.transform.module_pass(opt_level=0, name="FoldConstantTables")
class FoldConstantTables:
    """Compute at compile time each table that transcendental ops make from constants alone."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        folded = 0
        updates = {}
        for gv, func in graph_functions(mod):
            tables = _Tables(func)
            if not tables.folded:
                continue
            try:
                values = _values(tables.function())
            except tvm.error.InternalError as error:
                # TVM's simplifier refuses some constant arithmetic that runs fine as a kernel:
                # a float divided by a constant 0 (a T5 bucket's log(n / m) / log(1.0)) is
                # "Divide by zero" here, inf in the program. Those tables stay in the program.
                self.report(f"FoldConstantTables: {gv.name_hint}'s tables left to run time "
                            f"({type(error).__name__}: {str(error).strip().splitlines()[-1][:200]})")
                continue
            # Each read of a folded variable reads its constant; its binding, left unread, goes.
            constants = {var: relax.const(value, var.ty.dtype) for var, value in zip(tables.folded, values)}
            updates[gv] = drop_unread(Substitute(constants).visit_expr(func))
            folded += len(constants)
        if folded:
            self.report(f"FoldConstantTables: {folded} table(s) computed at compile time")
        return with_functions(mod, updates)
