"""FuseModelUpdate: each param group's optimizer update becomes in-place kernels.

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
A parameter of OWN_KERNEL_MIN elements or more gets a kernel of its own (see `_chunks`), the
others of the group share one.

In-place is safe because the formula produces its results in order, a later result reads an
earlier one only through the value `output` returned (the new value, already stored), no
result reads the old value of a state or of the parameter once it is stored (TEUpdateOps
checks; rules that cannot keep to it are not `in_place` and stay Relax ops), and train_step
calls all updates after all gradients are computed (later passes, which may move a kernel
earlier, keep it after every other reader of what it overwrites).

Scalar state (Adam's `step`) is not written by the kernel, which would have to order that
store after every element loop: the kernel recomputes the new step where it reads it, and the
new step itself is computed by Relax ops beside the kernel (a fresh 4-byte tensor).

Limits: static shapes; float dtypes; LLVM and CUDA targets.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmgraph.debug import logger
from tvmgraph.training.optimizers import PARAM, RULES, UpdateRule
from tvmgraph.training.loss_scale import keep_if_found
from tvmgraph.training.train_step import FLAGS_ATTR, MODEL_UPDATE_ATTR, SKIP_ATTR, SKIP_INPUTS, hyper_reads
from tvmgraph.training.update_ops import SCALAR_DTYPE, RelaxUpdateOps

LANES = 16  # elements per vector on AVX-512 float32; 8 on AVX2 is handled by LLVM splitting
PARALLEL_MIN = 1 << 15  # elements below which one thread updates a parameter alone
GPU_THREADS = 256
OWN_KERNEL_MIN = 1 << 17  # elements (512 KiB of float32) from which a parameter gets its own kernel
SMALL_PER_KERNEL = 8  # smaller parameters per shared kernel


def _dtype(x: tirx.PrimExpr) -> str:
    return str(x.ty.dtype)


class TEValue:
    """An element expression: `fn(index)` -> PrimExpr; `scalar` when it ignores the index."""

    __slots__ = ("fn", "scalar", "ops")

    def __init__(self, fn, scalar: bool, ops: TEUpdateOps):
        self.fn, self.scalar, self.ops = fn, scalar, ops

    def __call__(self, index: tuple) -> tirx.PrimExpr:
        return self.fn(index)

    def __add__(self, other): return self.ops.apply(lambda a, b: a + b, self, other)  # noqa: E704
    def __sub__(self, other): return self.ops.apply(lambda a, b: a - b, self, other)  # noqa: E704
    def __mul__(self, other): return self.ops.apply(lambda a, b: a * b, self, other)  # noqa: E704
    def __truediv__(self, other): return self.ops.apply(lambda a, b: a / b, self, other)  # noqa: E704
    def __neg__(self): return self.ops.apply(lambda a: -a, self)  # noqa: E704


class TEUpdateOps:
    """Evaluates a formula for one parameter into TE computes, in the order of `output` calls."""

    def __init__(self, shape: tuple[int, ...], dtype: str, out_dtypes: dict[str, str], tag: str,
                 scalar_keys: frozenset[str] = frozenset(), skip: te.Tensor | None = None,
                 unscale: te.Tensor | None = None):
        self.shape, self.dtype, self.out_dtypes, self.tag = shape, dtype, out_dtypes, tag
        self.scalar_keys = scalar_keys  # results that are scalar state (not stored)
        self.skip = skip  # loss scaling: where skip() > 0, every result is its old value
        self.unscale = unscale  # loss scaling: what a gradient is multiplied by when read
        self.old: dict[str, TEValue] = {}  # the buffer each key's result overwrites
        self.outputs: dict[str, te.Tensor] = {}  # element-wise results, in formula order
        self.stored: set[str] = set()  # keys whose buffer already holds the new value

    def value(self, fn, scalar: bool) -> TEValue:
        return TEValue(fn, scalar, self)

    def read(self, tensor: te.Tensor, scalar: bool = False) -> TEValue:
        if len(tensor.shape) == 0:
            return self.value(lambda i: tensor(), scalar)
        return self.value(lambda i: tensor(*i), False)

    def read_state(self, key: str, tensor: te.Tensor, scalar: bool) -> TEValue:
        """The old value of state `key`, which a formula may read only until it stores `key`
        (the kernel overwrites the buffer in place)."""
        old = self.read(tensor, scalar)
        self.old[key] = old

        def element(i):
            if key in self.stored:
                raise AssertionError(f"update formula reads the old {key!r} after storing the new one; "
                                     f"read it before, or use the value output() returned")
            return old(i)

        return self.value(element, old.scalar)

    def read_grad(self, tensor: te.Tensor) -> TEValue:
        """The gradient, unscaled (times `unscale`, in its dtype) under loss scaling."""
        if self.unscale is None:
            return self.read(tensor)
        return self.value(lambda i: tensor(*i) * tirx.Cast(tensor.dtype, self.unscale()), False)

    def apply(self, fn, *args: TEValue) -> TEValue:
        """`fn` of `args`' elements, in float64 if all are scalar, else in the parameter's dtype
        (see update_ops.py)."""
        scalar = all(a.scalar for a in args)
        dtype = SCALAR_DTYPE if scalar else self.dtype

        def element(i):
            exprs = [a(i) for a in args]
            return fn(*[x if _dtype(x) == dtype else tirx.Cast(dtype, x) for x in exprs])

        return self.value(element, scalar)

    def const(self, value: float) -> TEValue:
        return self.value(lambda i: tirx.const(value, SCALAR_DTYPE), True)

    # Scalar sub-expressions (Adam's bias corrections) stay inline: they are loop-invariant,
    # and LLVM hoists them out of the element loop.
    def sqrt(self, x: TEValue) -> TEValue:
        return self.apply(tirx.sqrt, x)

    def pow(self, base: TEValue, exponent: TEValue) -> TEValue:
        return self.apply(tirx.power, base, exponent)

    def abs(self, x: TEValue) -> TEValue:
        return self.apply(tirx.abs, x)

    def sign(self, x: TEValue) -> TEValue:
        def sign(a):
            zero, one = tirx.const(0, _dtype(a)), tirx.const(1, _dtype(a))
            return tirx.Select(a > zero, one, tirx.Select(a < zero, -one, zero))

        return self.apply(sign, x)

    def maximum(self, a: TEValue, b: TEValue) -> TEValue:
        return self.apply(tirx.max, a, b)

    def minimum(self, a: TEValue, b: TEValue) -> TEValue:
        return self.apply(tirx.min, a, b)

    def where_gt(self, x: TEValue, threshold: TEValue, then: TEValue, otherwise: TEValue) -> TEValue:
        return self.apply(lambda a, b, c, d: tirx.Select(a > b, c, d), x, threshold, then, otherwise)

    def output(self, key: str, value: TEValue) -> TEValue:
        dtype = self.out_dtypes[key]

        def stored(i):
            v = value(i)
            v = v if _dtype(v) == dtype else tirx.Cast(dtype, v)
            if self.skip is None:
                return v
            # Read before this key is stored: the element's own old value, kept on overflow.
            return tirx.Select(self.skip() > tirx.const(0.0, "float32"), self.old[key](i), v)

        if key in self.scalar_keys:
            # Scalar state (Adam's step) is not stored by the kernel (its store would have to
            # follow every element loop); the kernel recomputes the new value where it is read,
            # and FuseModelUpdate stores it with Relax ops beside the kernel. (Decided by the
            # key: every value of a 0-d parameter ignores the index too, and is stored.)
            return self.value(stored, True)
        out = te.compute(self.shape, lambda *i: stored(i), name=f"{self.tag}_{key}")
        self.outputs[key] = out
        self.stored.add(key)
        return self.read(out)


def _chunks(param_types: list[relax.TensorType]) -> list[list[int]]:
    """Which parameters each kernel updates: every big one alone, the others by eights.

    A big parameter's kernel can then run as soon as its gradient exists (StraightenBindings
    moves it there: it frees the gradient), so the gradients of the big parameters are never
    all alive at once, as they are for one kernel run after the whole backward pass (the
    benchmark MLP's step: 7 MiB of gradients). Small ones are not worth a kernel call each.
    """
    big = [j for j, ty in enumerate(param_types) if math.prod(int(d) for d in ty.shape) >= OWN_KERNEL_MIN]
    rest = [j for j in range(len(param_types)) if j not in big]
    # NOTE: LLVM's time grows faster than the size of a function: 59 parameters in one kernel
    # took 3.5 s to compile, in kernels of 8 1.6 s in all, and the kernels compile in parallel.
    return [[j] for j in big] + [rest[i:i + SMALL_PER_KERNEL] for i in range(0, len(rest), SMALL_PER_KERNEL)]


def build_update_kernel(rule: UpdateRule, flags: dict[str, bool], param_types: list[relax.TensorType],
                        target: tvm.target.Target, skippable: bool = False,
                        positions: list[int] | None = None, group_size: int | None = None,
                        ) -> tuple[tirx.PrimFunc, list[int]]:
    """The in-place TIR kernel for one group, and for each of its results (the element-wise
    state and the parameter, per parameter in formula order) the index of the argument it
    overwrites. Scalar state is read, not written (see TEUpdateOps.output). `skippable`: a
    second and third input, `skip` and `unscale` (train_step.update_function). A kernel for
    some of a group's parameters (see `_chunks`) reads the group's whole hyperparameter vector:
    `positions` are its parameters' places in the group of `group_size`."""
    keys = rule.state_keys(flags)
    positions = list(range(len(param_types))) if positions is None else positions
    group_size = len(param_types) if group_size is None else group_size
    hyper = te.placeholder((rule.hyper_length(group_size),), SCALAR_DTYPE, name="hyper")
    scalars = [te.placeholder((), "float32", name=name) for name in SKIP_INPUTS] if skippable else []
    skip, unscale = scalars or (None, None)
    inputs, outputs, inplace, chains = [hyper, *scalars], [], [], []
    for j, ty in enumerate(param_types):
        shape, dtype = tuple(int(d) for d in ty.shape), ty.dtype.dtype
        p = te.placeholder(shape, dtype, name=f"p{j}")
        g = te.placeholder(shape, dtype, name=f"g{j}")
        states = {k: te.placeholder((), "float32", name=f"{k}{j}") if rule.scalar_state(k)
                  else te.placeholder(shape, dtype, name=f"{k}{j}") for k in keys}
        base = len(inputs)
        arg_index = {PARAM: base, **{k: base + 2 + n for n, k in enumerate(keys)}}
        inputs += [p, g, *states.values()]
        ops = TEUpdateOps(shape, dtype, {PARAM: dtype, **{k: s.dtype for k, s in states.items()}}, f"u{j}",
                          frozenset(k for k in keys if rule.scalar_state(k)), skip, unscale)
        h = {k: ops.value(lambda i, n=n: hyper(n), True) for k, n in rule.hyper_slots(positions[j]).items()}
        rule.update(ops, ops.read_state(PARAM, p, False), ops.read_grad(g),
                    {k: ops.read_state(k, s, rule.scalar_state(k)) for k, s in states.items()}, h, flags)
        order = list(ops.outputs)  # stored in formula order
        outputs += [ops.outputs[k] for k in order]
        inplace += [arg_index[k] for k in order]
        chains.append([ops.outputs[k] for k in order])
    func = te.create_prim_func([*inputs, *outputs])
    func = _schedule(func, chains, target)
    num_in = len(inputs)
    func = func.specialize({func.params[num_in + n]: func.params[arg] for n, arg in enumerate(inplace)})
    # Opaque to FuseOps: the kernel is complete and writes its arguments in place.
    return func.without_attr("global_symbol").with_attrs({"tir.is_scheduled": True, "op_pattern": 8}), inplace


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
    follows every read of its buffer's old value (see TEUpdateOps.read_state). On GPUs a chunk is a
    thread block and each element stays with one thread through all results.

    Every result's loops are split into the same chunks and the chunk loops are merged, so a
    chunk is always a box of the tensor and every element is written exactly once.
    """
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    gpu = "gpu" in target.keys
    for outputs in chains:
        shape = [int(d) for d in outputs[0].shape] if outputs else []
        if not shape:  # a 0-d parameter: one element, its results stored in formula order
            continue
        lanes = GPU_THREADS if gpu else LANES
        outers, inner_loops = [], []
        for tensor in outputs:
            outer, chunk = _chunk_outer(sch, sch.get_sblock(tensor.op.name), shape, lanes)
            inner = sch.get_loops(sch.get_sblock(tensor.op.name))[1:]  # the chunk loop is outermost
            outers.append(outer)
            inner_loops.append(sch.fuse(*inner) if len(inner) > 1 else inner[0])
        outer = sch.merge(*outers) if len(outers) > 1 else outers[0]
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
        self.kernels = 0
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
        if not rule.in_place(flags):
            self.skipped.append(f"{call.op.name_hint} (its results read each other's old values)")
            return call
        keys = rule.state_keys(flags)
        per_param = 2 + len(keys)
        skippable = bool((func.attrs or {}).get(SKIP_ATTR, False))
        lead = 1 + len(SKIP_INPUTS) * skippable  # hyper[, skip, unscale], then each parameter's
        param_types = [p.ty for p in func.params[lead::per_param]]
        chunks = _chunks(param_types)
        self.kernels += len(chunks)
        self.fused.append(f"{call.op.name_hint} ({len(param_types)} parameters"
                          + (f" in {len(chunks)} kernels)" if len(chunks) > 1 else ")"))
        has_scalars = any(rule.scalar_state(k) for k in keys)
        arg_key = [PARAM, None, *keys]  # a parameter's arguments: p, g, its state
        kernel_results: dict[int, dict[str, relax.Expr]] = {}
        for c, chunk in enumerate(chunks):
            kernel, inplace = build_update_kernel(rule, flags, [param_types[j] for j in chunk], self.target,
                                                  skippable, positions=list(chunk), group_size=len(param_types))
            gv = self.builder_.add_func(kernel, f"{call.op.name_hint}_kernel" + (str(c) if len(chunks) > 1 else ""))
            args = [*call.args[:lead]] + [a for j in chunk
                                          for a in call.args[lead + j * per_param: lead + (j + 1) * per_param]]
            updated = relax.op.call_tir_inplace(gv, relax.Tuple(args), inplace, [args[i].ty for i in inplace])
            # Result t overwrites argument inplace[t]: its position names the parameter and key.
            named = [(chunk[(arg - lead) // per_param], arg_key[(arg - lead) % per_param]) for arg in inplace]
            if len(inplace) == 1:  # one result (plain SGD on one parameter): a tensor, no tuple
                kernel_results.setdefault(named[0][0], {})[named[0][1]] = self.builder_.emit(updated)
                continue
            layout = [(j, key) for j in chunk for key in (*keys, PARAM)]
            if len(chunks) == 1 and named == layout:  # already the update function's result layout
                return updated
            updated = self.builder_.emit(updated)
            for t, (j, key) in enumerate(named):
                kernel_results.setdefault(j, {})[key] = relax.TupleGetItem(updated, t)
        # The kernels' results, with the scalar state computed by Relax ops, back into the
        # update function's result layout.
        scalars = self._scalar_state(rule, flags, list(call.args), per_param, lead) if has_scalars else None
        results = []
        for j in range(len(param_types)):
            for key in (*keys, PARAM):
                results.append(scalars[j][key] if rule.scalar_state(key) else kernel_results[j][key])
        return relax.Tuple(results)

    def _scalar_state(self, rule: UpdateRule, flags: dict[str, bool], args: list[relax.Expr],
                      per_param: int, lead: int) -> list[dict[str, relax.Expr]]:
        """New scalar state per parameter, evaluated as Relax ops (element-wise parts die);
        `args[:lead]` are hyper and, under loss scaling, skip and unscale."""
        keys = rule.state_keys(flags)
        bb = self.builder_
        count = len(args[lead:]) // per_param
        out = []
        for j, h in enumerate(hyper_reads(bb, rule, args[0], count)):
            p, g, *states = args[lead + j * per_param: lead + (j + 1) * per_param]
            dtype = p.ty.dtype.dtype
            ops = RelaxUpdateOps(bb, dtype, {PARAM: dtype, **{k: s.ty.dtype.dtype for k, s in zip(keys, states)}})
            rule.update(ops, ops.wrap(p), ops.wrap(g),
                        {k: ops.wrap(s, rule.scalar_state(k)) for k, s in zip(keys, states)},
                        {k: ops.wrap(v, scalar=True) for k, v in h.items()}, flags)
            new = {k: ops.outputs[k] for k in keys if rule.scalar_state(k)}
            if lead > 1:  # a skipped step keeps the old scalar state too
                old = dict(zip(keys, states))
                new = {k: keep_if_found(bb, args[1], old[k], v) for k, v in new.items()}
            out.append(new)
        return out


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
            self.report(f"FuseModelUpdate: {rewriter.kernels} in-place update kernel(s): "
                        + ", ".join(rewriter.fused))
        if rewriter.skipped:
            self.report("FuseModelUpdate: left as Relax ops: " + ", ".join(rewriter.skipped))
        return relax.transform.DeadCodeElimination()(mod)
