"""LSTMCellAsOneKernel: each time step of an LSTM in one CPU kernel (inference).

torch.export unrolls `nn.LSTM` (and a Python loop over `nn.LSTMCell`) into time steps; each is,
in a dataflow block,

    m = matmul(h2, wt)                       h2 [B, H], wt [H, 4H] (W_hh.T), float32
    z = add(b, m) ?   z = reshape(z, [1, B, 4H]) ?
    z = add(z, x)                            x = squeeze(strided_slice(xw, axis 0, t..t+1), 0),
                                             xw [T, B, 4H] (every step's input projection, nn.LSTM),
                                             or any x of z's shape (nn.LSTMCell's x @ W_ih.T + b_ih)
    s = split(z, 4, axis=-1);  i, f, g, o = s[0], s[1], s[2], s[3]     each [1, B, H] or [B, H]
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

(the products and the sums in either order). Where nothing but this step reads what is between
`m` and `h'` (c' and h' may be read anywhere: the next step, the outputs), the step becomes

    states = call_tir(lstm_cell, (h, wt, b?, xw, c, t));  c' = states[0];  h' = states[1]

(h: h2 in the states' shape, the previous step's h' itself where h2 is its reshape; xw: x viewed
as [1, B, 4H] with t = 0 when x is no such slice), with the kernel of
tvmgraph/schedules/lstm_cell.py: the product with the four gates of the same hidden units in
registers, c' and h' computed in its epilogue, xw[t] read in place (t is a primitive argument,
so the steps of a sequence share one kernel). An LSTM of 128 units over 32 steps, batch 16, on
a 2-vCPU Xeon: 4 kernels and 25-28 us a step before, one of 12 us alone (about 17 in the
graph) after.

A training step's LSTM does not match: its backward pass reads the gates. Nor do hidden sizes
that whole vectors do not divide (the kernel's epilogue is one vector of units per lane set),
nor an LSTM with projections (proj_size: its h' is projected before the next step reads it).
CPU (llvm) targets only. Position: after ShareTransposes (so `wt` is the one transpose every
step reads) and before FuseEpilogue, which would take the product and its adds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from relay_passes import graph_functions, rewrite_on_cpu
from relay_passes.bindings import read_counts
from relay_passes.rebind import BoundRewriter, rebind
from relay_passes.safe_softmax_pattern import call_of
from relay_passes.tensor_sizes import static_shape
from tvmgraph.schedules.lstm_cell import GATES, lstm_cell_kernel

R = relax.op


@dataclass(frozen=True)
class Step:
    """One matched time step: the kernel's operands and the two states it binds."""

    h: relax.Expr            # h2 [B, H], or the [1, B, H] h' of the step before it reshapes
    wt: relax.Expr           # [H, 4H]
    bias: relax.Expr | None  # [4H]
    xw: relax.Expr           # [T, B, 4H], or x itself ([1, B, 4H] or [B, 4H])
    t: int                   # the step's row of xw (0 for x itself)
    c: relax.Expr            # [1, B, H] (nn.LSTM) or [B, H] (nn.LSTMCell): the states' shape
    c_out: relax.Var
    h_out: relax.Var


def _shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a float32 tensor."""
    return static_shape(expr, "float32")


def _ints(expr: relax.Expr) -> list[int] | None:
    """The integers of a strided_slice argument (a tuple of integer immediates), or None."""
    if not isinstance(expr, relax.Tuple):
        return None
    out = []
    for field in expr.fields:
        value = field if isinstance(field, tirx.IntImm) else getattr(field, "value", None)
        if not isinstance(value, tirx.IntImm):
            return None
        out.append(int(value))
    return out


class _Matcher:
    """Finds the LSTM steps of one function (`steps`, by the variable of c')."""

    def __init__(self, func: relax.Function, uses: Counter[relax.Var], lanes: int) -> None:
        self.bound = relax.analysis.get_var2val(func)
        self.uses = uses
        self.lanes = lanes

    def _value(self, expr: relax.Expr, reads: int = 1) -> relax.Expr | None:
        """What `expr` is bound to, when it is a dataflow variable read `reads` times."""
        if not isinstance(expr, relax.DataflowVar) or self.uses[expr] != reads:
            return None
        return self.bound.get(expr)

    def _unary(self, expr: relax.Expr, name: str) -> relax.Expr | None:
        call = call_of(self._value(expr), name)
        return call.args[0] if call is not None else None

    def _piece(self, expr: relax.Expr | None) -> tuple[relax.Expr, int] | None:
        """(the split's variable, index) of `expr` = split(...)[index]."""
        item = self._value(expr) if expr is not None else None
        if not isinstance(item, relax.TupleGetItem):
            return None
        return item.tuple_value, int(item.index)

    def _gate(self, expr: relax.Expr, name: str) -> tuple[relax.Expr, int] | None:
        """(split, index) of `expr` = activation(split[index])."""
        return self._piece(self._unary(expr, name))

    def _pair(self, expr: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        product = call_of(self._value(expr), "relax.multiply")
        return (product.args[0], product.args[1]) if product is not None else None

    def step(self, h_out: relax.Var) -> Step | None:
        """The step whose h' is `h_out`, when it matches (module docstring)."""
        product = call_of(self.bound.get(h_out), "relax.multiply")
        if product is None:
            return None
        for o_sig, tanh_c in (product.args, product.args[::-1]):
            c_out = self._unary_any(tanh_c, "relax.tanh")
            o = self._gate(o_sig, "relax.sigmoid")
            if c_out is not None and o is not None:
                return self._cell(c_out, o, h_out)
        return None

    def _unary_any(self, expr: relax.Expr, name: str) -> relax.Expr | None:
        """x of `expr` = name(x), x a variable (read anywhere)."""
        x = self._unary(expr, name)
        return x if isinstance(x, relax.Var) else None

    def _cell(self, c_out: relax.Var, o: tuple[relax.Expr, int], h_out: relax.Var) -> Step | None:
        total = call_of(self.bound.get(c_out), "relax.add")
        if total is None or not isinstance(c_out, relax.DataflowVar):
            return None
        forget = input_gate = None
        for term in total.args:
            pair = self._pair(term)
            if pair is None:
                return None
            for a, b in (pair, pair[::-1]):
                gate = self._gate(a, "relax.sigmoid")
                if gate is None:
                    continue
                if gate[1] == 1 and forget is None:  # sigmoid(f) * c
                    forget = (gate, b)
                    break
                g = self._gate(b, "relax.tanh")
                if g is not None and (gate[1], g[1]) == (0, 2) and input_gate is None:  # sigmoid(i) * tanh(g)
                    input_gate = (gate, g)
                    break
        if forget is None or input_gate is None:
            return None
        (f, c), (i, g) = forget, input_gate
        split_var = o[0]
        if o[1] != 3 or not all(p[0].same_as(split_var) for p in (f, i, g)):
            return None
        return self._gates(split_var, c, c_out, h_out)

    def _gates(self, split_var: relax.Expr, c: relax.Expr, c_out: relax.Var, h_out: relax.Var) -> Step | None:
        split = call_of(self._value(split_var, reads=GATES), "relax.split")
        if split is None:
            return None
        z = split.args[0]
        shape = _shape(z)
        # nn.LSTM's steps: [1, B, 4H]; nn.LSTMCell's: [B, 4H]
        if shape is None or len(shape) not in (2, 3) or shape[:-2] not in ((), (1,)) or shape[-1] % GATES:
            return None
        batch, hidden = shape[-2], shape[-1] // GATES
        sections = split.attrs.indices_or_sections
        indices = [int(v) for v in sections] if not isinstance(sections, tirx.IntImm) else None
        even = int(sections) == GATES if isinstance(sections, tirx.IntImm) else indices == [hidden, 2 * hidden, 3 * hidden]
        if not even or int(split.attrs.axis) not in (-1, len(shape) - 1) or hidden % self.lanes:
            return None
        if _shape(c) != (*shape[:-1], hidden):
            return None
        total = call_of(self._value(z), "relax.add")
        if total is None:
            return None
        for product_side, x in (total.args, total.args[::-1]):
            found = self._product(product_side, batch, hidden)
            if found is None:
                continue
            source = self._input(x, batch, hidden)
            if source is None:
                return None
            (h, wt, bias), (xw, t) = found, source
            return Step(h, wt, bias, xw, t, c, c_out, h_out)
        return None

    def _product(self, expr: relax.Expr, batch: int, hidden: int) -> tuple | None:
        """(h2, wt, bias or None) of `expr` = reshape?(add?(bias, matmul(h2, wt)))."""
        value = self._value(expr)
        reshape = call_of(value, "relax.reshape")
        if reshape is not None:
            value = self._value(reshape.args[0])
        bias = None
        add = call_of(value, "relax.add")
        if add is not None:
            for b, m in (add.args, add.args[::-1]):
                if _shape(b) == (GATES * hidden,) and call_of(self._value(m), "relax.matmul") is not None:
                    bias, value = b, self._value(m)
                    break
            else:
                return None
        matmul = call_of(value, "relax.matmul")
        if matmul is None:
            return None
        h, wt = matmul.args
        if _shape(h) != (batch, hidden) or _shape(wt) != (hidden, GATES * hidden):
            return None
        # nn.LSTM's h2 is the previous step's h' [1, B, H] reshaped: the kernel reads h' itself.
        flat = call_of(self._value(h), "relax.reshape")
        if flat is not None and _shape(flat.args[0]) == (1, batch, hidden):
            h = flat.args[0]
        if reshape is not None and _shape(reshape)[-2:] != (batch, GATES * hidden):
            return None
        return h, wt, bias

    def _input(self, x: relax.Expr, batch: int, hidden: int) -> tuple[relax.Expr, int] | None:
        """(xw, t) of x = squeeze(strided_slice(xw, [0], [t], [t + 1], [1]), [0]), each read only
        here; else (x, 0) for an x of [B, 4H] or [1, B, 4H] (passed as [1, B, 4H])."""
        width = GATES * hidden
        squeeze = call_of(self._value(x), "relax.squeeze")
        sliced = call_of(self._value(squeeze.args[0]), "relax.strided_slice") if squeeze is not None else None
        if sliced is not None and [int(a) for a in (squeeze.attrs.axis or [])] == [0]:
            axes, begin, end = (_ints(a) for a in sliced.args[1:4])
            strides = _ints(sliced.args[4]) if len(sliced.args) > 4 else [1]
            xw = sliced.args[0]
            xw_shape = _shape(xw)
            if (axes == [0] and strides == [1] and begin is not None and end == [begin[0] + 1]
                    and xw_shape is not None and len(xw_shape) == 3 and xw_shape[1:] == (batch, width)
                    and 0 <= begin[0] < xw_shape[0]):
                return xw, begin[0]
        if _shape(x) in ((batch, width), (1, batch, width)):
            return x, 0
        return None


@mutator
class _Fuser(BoundRewriter):
    def __init__(self, mod: tvm.IRModule, lanes: int) -> None:
        super().__init__(mod)
        uses = read_counts(mod)
        self.steps: dict[relax.Var, Step] = {}
        for _, func in graph_functions(mod):
            matcher = _Matcher(func, uses, lanes)
            for var in matcher.bound:
                step = matcher.step(var)
                if step is not None:
                    self.steps[step.c_out] = step
        self.h_of: dict[relax.Var, relax.Var] = {}  # h' -> the call's variable
        self.kernels: dict[tuple[int, int, int, bool, int], tvm.ir.GlobalVar] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        step = self.steps.get(binding.var)
        if step is not None:
            states = self.builder_.emit(self._call(step), "lstm_states")
            rebind(self, binding, relax.TupleGetItem(states, 0))
            self.h_of[step.h_out] = states
            return
        states = self.h_of.get(binding.var)
        if states is not None:
            rebind(self, binding, relax.TupleGetItem(states, 1))
            return
        super().visit_var_binding_(binding)

    def _call(self, step: Step) -> relax.Call:
        state = _shape(step.c)
        batch, hidden = state[-2:]
        h = self.visit_expr(step.h)
        if _shape(step.h) != state:
            h = self.builder_.emit(R.reshape(h, state))
        xw = self.visit_expr(step.xw)
        if len(_shape(step.xw)) == 2:  # nn.LSTMCell's x, viewed as the one row of a projection
            xw = self.builder_.emit(R.reshape(xw, (1, batch, GATES * hidden)))
        steps = _shape(xw)[0]
        key = (batch, hidden, steps, step.bias is not None, len(state))
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(lstm_cell_kernel(*key), "lstm_cell")
        operands = [h, step.wt, *([step.bias] if step.bias is not None else []), xw, step.c]
        out = relax.TensorType(state, "float32")
        self.counts[f"LSTM step of {hidden} units, batch {batch}"] += 1
        step_index = relax.prim_value(tirx.IntImm("int64", step.t))
        return relax.call_tir(self.kernels[key], [*(self.visit_expr(a) for a in operands), step_index],
                              [out, out])


@tvm.transform.module_pass(opt_level=0, name="LSTMCellAsOneKernel")
class LSTMCellAsOneKernel:
    """Compute each unrolled LSTM step whose gates nothing else reads as one kernel (CPU only)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_on_cpu(mod, "LSTMCellAsOneKernel", self.report,
                              lambda cpu: _Fuser(mod, cpu.lanes("float32")), drop_unused=True)
