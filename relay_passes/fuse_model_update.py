"""FuseModelUpdate: each param group's optimizer update becomes one in-place kernel.

Position: before LegalizeOps, on a module made by tvmgraph's training pass, where each param
group is updated by a call to a private-style Relax function tagged `tvmgraph.model_update`
(see tvmgraph/training/train_step.py). Each such call becomes

    R.call_tir_inplace(update_kernel, (hyper, p0, g0, s0..., p1, g1, s1..., ...), inplace_indices)

where `update_kernel` is a TIR function built from the same formula (tvmgraph/training/
optimizers.py) with a TE backend: for every parameter one loop (parallel over chunks,
vectorized within) that reads p, g and each state once and writes the new state and p back into
their own buffers. Compared with the Relax ops it replaces (which FuseOps splits into one
kernel per output, each allocating a fresh result), this reads and writes every tensor once and
allocates nothing: the parameters and optimizer state are updated where torch keeps them.

In-place is safe because the formula produces its results in order, a later result reads an
earlier one only through the value `output` returned (the new value, already stored), every
result reads only the old value of its own state and of the parameter (stored last), and
train_step calls all updates after all gradients are computed.

Limits: static shapes; float dtypes; LLVM and CUDA targets; rules with scalar state (Adam's
`step`) are left as Relax ops for now (reported), since the scalar store would have to be
ordered after every element loop.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmgraph.debug import logger
from tvmgraph.training.optimizers import PARAM, RULES, UpdateRule
from tvmgraph.training.train_step import FLAGS_ATTR, MODEL_UPDATE_ATTR

LANES = 16  # elements per vector on AVX-512 float32; 8 on AVX2 is handled by LLVM splitting
PARALLEL_MIN = 1 << 15  # elements below which one thread updates a parameter alone
GPU_THREADS = 256


def _dtype(x: tirx.PrimExpr) -> str:
    return str(x.ty.dtype)


class TEValue:
    """An element expression: `fn(index)` -> PrimExpr; `scalar` when it ignores the index."""

    __slots__ = ("fn", "scalar", "ops")

    def __init__(self, fn, scalar: bool, ops: TEUpdateOps):
        self.fn, self.scalar, self.ops = fn, scalar, ops

    def __call__(self, index: tuple) -> tirx.PrimExpr:
        return self.fn(index)

    def _binary(self, other: TEValue, combine) -> TEValue:
        ops = self.ops
        return ops.value(lambda i: combine(ops.cast(self(i)), ops.cast(other(i))), self.scalar and other.scalar)

    def __add__(self, other): return self._binary(other, lambda a, b: a + b)  # noqa: E704
    def __sub__(self, other): return self._binary(other, lambda a, b: a - b)  # noqa: E704
    def __mul__(self, other): return self._binary(other, lambda a, b: a * b)  # noqa: E704
    def __truediv__(self, other): return self._binary(other, lambda a, b: a / b)  # noqa: E704

    def __neg__(self) -> TEValue:
        return self.ops.value(lambda i: -self.ops.cast(self(i)), self.scalar)


class TEUpdateOps:
    """Evaluates a formula for one parameter into TE computes, in the order of `output` calls."""

    def __init__(self, shape: tuple[int, ...], dtype: str, out_dtypes: dict[str, str], tag: str):
        self.shape, self.dtype, self.out_dtypes, self.tag = shape, dtype, out_dtypes, tag
        self.outputs: dict[str, te.Tensor] = {}
        self.scalars: list[te.Tensor] = []

    def value(self, fn, scalar: bool) -> TEValue:
        return TEValue(fn, scalar, self)

    def read(self, tensor: te.Tensor) -> TEValue:
        if len(tensor.shape) == 0:
            return self.value(lambda i: tensor(), True)
        return self.value(lambda i: tensor(*i), False)

    def cast(self, x: tirx.PrimExpr) -> tirx.PrimExpr:
        return x if _dtype(x) == self.dtype else tirx.Cast(self.dtype, x)

    def _scalar_temp(self, fn) -> TEValue:
        # Scalar work (bias corrections) is computed once, not once per element.
        tensor = te.compute((), lambda: fn(()), name=f"{self.tag}_s{len(self.scalars)}")
        self.scalars.append(tensor)
        return self.read(tensor)

    def const(self, value: float) -> TEValue:
        return self.value(lambda i: tirx.const(value, self.dtype), True)

    def sqrt(self, x: TEValue) -> TEValue:
        fn = lambda i: tirx.sqrt(self.cast(x(i)))  # noqa: E731
        return self._scalar_temp(fn) if x.scalar else self.value(fn, False)

    def pow(self, base: TEValue, exponent: TEValue) -> TEValue:
        fn = lambda i: tirx.power(self.cast(base(i)), self.cast(exponent(i)))  # noqa: E731
        return self._scalar_temp(fn) if base.scalar and exponent.scalar else self.value(fn, False)

    def maximum(self, a: TEValue, b: TEValue) -> TEValue:
        return self.value(lambda i: tirx.max(self.cast(a(i)), self.cast(b(i))), a.scalar and b.scalar)

    def where_gt(self, x: TEValue, threshold: TEValue, then: TEValue, otherwise: TEValue) -> TEValue:
        return self.value(lambda i: tirx.Select(self.cast(x(i)) > self.cast(threshold(i)),
                                                self.cast(then(i)), self.cast(otherwise(i))),
                          x.scalar and threshold.scalar and then.scalar and otherwise.scalar)

    def output(self, key: str, value: TEValue) -> TEValue:
        dtype = self.out_dtypes[key]

        def stored(i):
            v = value(i)
            return v if _dtype(v) == dtype else tirx.Cast(dtype, v)

        shape = () if value.scalar else self.shape
        out = te.compute(shape, lambda *i: stored(i if i else ()), name=f"{self.tag}_{key}")
        self.outputs[key] = out
        return self.read(out)


def build_update_kernel(rule: UpdateRule, flags: dict[str, bool], param_types: list[relax.TensorType],
                        target: tvm.target.Target) -> tuple[tirx.PrimFunc, list[int]]:
    """The in-place TIR kernel for one group, and for each of its results the index of the
    argument it overwrites."""
    keys = rule.state_keys(flags)
    hyper = te.placeholder((len(rule.hyper_keys),), "float32", name="hyper")
    inputs, outputs, inplace, chains = [hyper], [], [], []
    for j, ty in enumerate(param_types):
        shape, dtype = tuple(int(d) for d in ty.shape), ty.dtype.dtype
        p = te.placeholder(shape, dtype, name=f"p{j}")
        g = te.placeholder(shape, dtype, name=f"g{j}")
        states = {k: te.placeholder((), "float32", name=f"{k}{j}") if rule.scalar_state(k)
                  else te.placeholder(shape, dtype, name=f"{k}{j}") for k in keys}
        base = len(inputs)
        arg_index = {PARAM: base, **{k: base + 2 + n for n, k in enumerate(keys)}}
        inputs += [p, g, *states.values()]
        ops = TEUpdateOps(shape, dtype, {PARAM: dtype, **{k: s.dtype for k, s in states.items()}}, f"u{j}")
        h = {k: ops.value(lambda i, n=n: hyper(n), True) for n, k in enumerate(rule.hyper_keys)}
        rule.update(ops, ops.read(p), ops.read(g), {k: ops.read(s) for k, s in states.items()}, h, flags)
        order = [*keys, PARAM]  # the results' order in the Relax tuple
        outputs += [ops.outputs[k] for k in order]
        inplace += [arg_index[k] for k in order]
        chains.append([ops.outputs[k] for k in order if len(ops.outputs[k].shape)])
    func = te.create_prim_func([*inputs, *outputs])
    func = _schedule(func, chains, target)
    num_in = len(inputs)
    func = func.specialize({func.params[num_in + n]: func.params[arg] for n, arg in enumerate(inplace)})
    # Opaque to FuseOps: the kernel is complete and writes its arguments in place.
    return func.with_attrs({"tir.is_scheduled": True, "op_pattern": 8}), inplace


def _chunk_outer(sch, block, shape: list[int], lanes: int):
    """Split `block`'s loops into an outer loop over chunks and return (outer, chunk size).

    A chunk must be a box of the tensor (see _schedule): `lanes` elements of the last dimension
    when it divides it, else whole trailing dimensions, at least `lanes` elements if possible."""
    loops = sch.get_loops(block)
    if shape[-1] % lanes == 0:
        lo, _ = sch.split(loops[-1], [None, lanes])
        return (sch.fuse(*loops[:-1], lo) if len(loops) > 1 else lo), lanes
    split = len(shape) - 1
    while split > 0 and math.prod(shape[split:]) < lanes:
        split -= 1
    if split == 0:
        return sch.add_unit_loop(loops[0]), math.prod(shape)
    return (sch.fuse(*loops[:split]) if split > 1 else loops[0]), math.prod(shape[split:])


def _schedule(func: tirx.PrimFunc, chains, target: tvm.target.Target) -> tirx.PrimFunc:
    """Per parameter: one loop over chunks of its elements that computes and stores every
    result in formula order, each in its own inner loop. Within a chunk a result's store
    follows every read of its buffer's old value: only its own formula reads its old state,
    and the parameter, which every formula may read, is stored last. On GPUs a chunk is a
    thread block and each element stays with one thread through all results.

    The results after the first are placed per chunk with reverse_compute_at, which computes
    the box covering the chunk; a chunk is therefore always a box, so every element is
    written exactly once.
    """
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    gpu = "gpu" in target.keys
    for outputs in chains:
        if not outputs:
            continue
        shape = [int(d) for d in outputs[0].shape]
        outer, chunk = _chunk_outer(sch, sch.get_sblock(outputs[0].op.name), shape, GPU_THREADS if gpu else LANES)
        for tensor in outputs[1:]:
            sch.reverse_compute_at(sch.get_sblock(tensor.op.name), outer)
        outer_sref = sch.get_sref(outer)
        inner_loops = []
        for tensor in outputs:
            block_loops = sch.get_loops(sch.get_sblock(tensor.op.name))
            depth = next(i for i, loop in enumerate(block_loops) if sch.get_sref(loop).same_as(outer_sref)) + 1
            inner = block_loops[depth:]
            inner_loops.append(sch.fuse(*inner) if len(inner) > 1 else inner[0])
        if gpu:
            sch.bind(outer, "blockIdx.x")
            for loop in inner_loops:
                sch.bind(sch.split(loop, [None, min(chunk, GPU_THREADS)])[1], "threadIdx.x")
            continue
        if math.prod(shape) >= PARALLEL_MIN and chunk < math.prod(shape):
            sch.parallel(outer)
        if chunk % LANES == 0:
            for loop in inner_loops:
                sch.vectorize(sch.split(loop, [None, LANES])[1])
    return sch.mod["main"]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.mod_ = mod
        self.target = target
        self.fused: list[str] = []
        self.skipped: list[str] = []

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, relax.GlobalVar):
            return call
        func = self.mod_[call.op]
        if not isinstance(func, relax.Function) or MODEL_UPDATE_ATTR not in (func.attrs or {}):
            return call
        rule = RULES[str(func.attrs[MODEL_UPDATE_ATTR])]
        flags = {str(k): bool(v) for k, v in func.attrs[FLAGS_ATTR].items()}
        if any(rule.scalar_state(k) for k in rule.state_keys(flags)):
            # Scalar state (Adam's step) would need its own block ordered after every element
            # loop; not built yet: the update stays Relax ops (FuseOps fuses them).
            self.skipped.append(f"{call.op.name_hint} ({rule.name}: scalar state)")
            return call
        per_param = 2 + len(rule.state_keys(flags))
        param_types = [p.ty for p in func.params[1::per_param]]
        kernel, inplace = build_update_kernel(rule, flags, param_types, self.target)
        gv = self.builder_.add_func(kernel, f"{call.op.name_hint}_kernel")
        out_types = [p.ty for p in (func.params[i] for i in inplace)]
        self.fused.append(f"{call.op.name_hint} ({len(param_types)} parameters)")
        return relax.op.call_tir_inplace(gv, relax.Tuple(list(call.args)), inplace, out_types)


@tvm.transform.module_pass(opt_level=0, name="FuseModelUpdate")
class FuseModelUpdate:
    """Replace each tagged update-function call with one in-place update kernel."""

    def __init__(self, enabled: bool = True, report=None):
        self.enabled = enabled
        self.report = report or (lambda msg: logger.info("%s", msg))

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled:
            return mod
        target = tvm.target.Target.current() or tvm.target.Target({"kind": "llvm"})
        rewriter = _Rewriter(mod, target)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and MODEL_UPDATE_ATTR not in (func.attrs or {}):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        mod = rewriter.builder_.get()
        if rewriter.fused:
            self.report(f"FuseModelUpdate: {len(rewriter.fused)} in-place update kernel(s): "
                        + ", ".join(rewriter.fused))
        if rewriter.skipped:
            self.report("FuseModelUpdate: left as Relax ops: " + ", ".join(rewriter.skipped))
        return relax.transform.DeadCodeElimination()(mod)
