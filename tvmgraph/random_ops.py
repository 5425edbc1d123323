"""Random ops in a compiled graph: `torch.rand`, `randn`, `randint`, `normal`, `bernoulli`,
`exponential`, ... drawn inside the program at every call (counter_rng.py).

The stock TVM 0.27 converters drew `randn`/`randn_like` once, at import, into a constant (every
call of the graph returned the same "random" tensor), returned `bernoulli(x, p)`'s input
unchanged (`nn.Dropout2d`, `alpha_dropout` and `feature_alpha_dropout` multiplied by an
uninitialized tensor) and `exponential_` as zeros (`gumbel_softmax` gave NaN). Here each
random op is one TE kernel of the seed input and its tensor parameters, behind
`relax.grad.no_grad`: no input gets a gradient through it, as torch's own derivatives give
(`normal(mean, std)` passes none to `mean`; `rrelu`'s slopes are drawn here and multiplied by
`x` in Relax, so `x` gets its gradient).

The numbers follow torch's distributions, not its generator: a graph and eager draw different
samples from the same `torch.manual_seed`. `rand` draws at the resolution of its dtype (24 bits
for float32, 53 for float64, 8 for bfloat16, 11 for float16), so it never returns 1.0; the
other distributions transform float32 draws (float64 for float64) and round the result to the
dtype (at 8 bits, bfloat16 normals had no tail past 3.5); normals come from Box-Muller.
Random ops with no converter here (`multinomial`, `randperm`, `poisson`, `random_`,
`bernoulli_` of a tensor p, a draw with a `generator=`) raise UnsupportedOpError like any op
without a lowering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from tvm import relax, te, tirx as tir
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import stop_gradient
from .counter_rng import bits, linear_index, op_key
from .errors import UnsupportedOpError

Converter = Callable[[torch.fx.Node, ExportedProgramImporter], relax.Expr]

_RESOLUTION = {"float16": 11, "bfloat16": 8}  # bits of a uniform; float32 24, float64 53


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """A seeded random op, unless its dropout probability is 0 or it is not training
    (`scaled_dot_product_attention(dropout_p=0.0)`, `dropout(x, p, train=False)`)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if getattr(node.target, "_schema", None) is None:
        return True
    values = _arguments(node)
    if values.get("train") is False or values.get("training") is False:
        return False
    # A dropout of probability 0 draws nothing; a bernoulli(x, p=0) still goes through its kernel.
    probability = values.get("dropout_p", values.get("p") if "dropout" in str(node.target) else None)
    return probability != 0


# --- the kernels ------------------------------------------------------------------------------

def _uniform(seed: te.Tensor, salt: int, stream: int, linear: tir.PrimExpr, dtype: str,
             open_interval: bool = False) -> tir.PrimExpr:
    """A uniform number in [0, 1) (in (0, 1) with `open_interval`: safe under log), in float64
    for float64 results and float32 otherwise, at `dtype`'s resolution. Uses streams
    `stream` and `stream + 1` (float64 takes two 32-bit draws)."""
    if dtype == "float64":
        hi = tir.Cast("float64", bits(op_key(seed, salt, stream), linear) >> tir.const(6, "uint32"))
        lo = tir.Cast("float64", bits(op_key(seed, salt, stream + 1), linear) >> tir.const(5, "uint32"))
        u = (hi * tir.const(2.0**27, "float64") + lo) * tir.const(2.0**-53, "float64")
        return u + tir.const(2.0**-54, "float64") if open_interval else u
    resolution = _RESOLUTION.get(dtype, 24)
    h = bits(op_key(seed, salt, stream), linear) >> tir.const(32 - resolution, "uint32")
    u = tir.Cast("float32", h) * tir.const(2.0**-resolution, "float32")
    return u + tir.const(2.0 ** -(resolution + 1), "float32") if open_interval else u


def _normal(seed: te.Tensor, salt: int, linear: tir.PrimExpr, dtype: str) -> tir.PrimExpr:
    """A standard normal number (Box-Muller: streams 0-1 and 2-3)."""
    u1 = _uniform(seed, salt, 0, linear, dtype, open_interval=True)
    u2 = _uniform(seed, salt, 2, linear, dtype)
    ct = "float64" if dtype == "float64" else "float32"
    radius = tir.sqrt(tir.const(-2.0, ct) * tir.log(u1))
    return radius * tir.cos(tir.const(2.0 * math.pi, ct) * u2)


def _randint(seed: te.Tensor, salt: int, linear: tir.PrimExpr, low: int, high: int) -> tir.PrimExpr:
    """An integer in [low, high), from 64 random bits (the modulo bias is below 2**-32 for any
    range under 2**32), as int64."""
    h = (tir.Cast("uint64", bits(op_key(seed, salt, 0), linear)) << tir.const(32, "uint64")) | tir.Cast(
        "uint64", bits(op_key(seed, salt, 1), linear))
    span = tir.const(high - low, "uint64")
    return tir.Cast("int64", tir.floormod(h, span)) + tir.const(low, "int64")


def _read(t: te.Tensor, out_shape: Sequence[tir.PrimExpr], index: Sequence[tir.Var]) -> tir.PrimExpr:
    """t broadcast to the output (aligned on the right, size-1 axes repeated)."""
    offset = len(out_shape) - len(t.shape)
    return t(*[tir.const(0, "int64") if isinstance(d, tir.IntImm) and int(d) == 1 else index[offset + k]
               for k, d in enumerate(t.shape)])


def random_kernel(*tensors: te.Tensor, kind: str, salt: int, dtype: str, shape: tuple | None,
                  like: int | None, params: tuple[float | None, ...]) -> te.Tensor:
    """One random op. `tensors` is (*inputs, seed); the output has `shape`, or the shape of
    inputs[like]. `params` are the kind's parameters in order; a None one is a tensor (normal's
    mean or std, bernoulli's p): the next input that is not the shape source, broadcast."""
    *inputs, seed = tensors
    out_shape = list(inputs[like].shape) if like is not None else [tir.const(d, "int64") for d in shape]
    operands = [t for i, t in enumerate(inputs) if i != like]
    # Only `uniform` draws at the output's resolution (a float32 number rounded to bfloat16
    # could be 1.0). The others transform float32 (float64) draws: at 8 bits, a bernoulli(p=0.001)
    # of bfloat16 drew ones at 0.004 (p rounded up to 1/256), and normals had no tail past 3.5.
    compute = "float64" if dtype == "float64" else "float32"

    def value(*index: tir.Var) -> tir.PrimExpr:
        linear = linear_index(out_shape, index)
        arg = iter([tir.Cast(compute, _read(t, out_shape, index)) for t in operands])
        c = lambda v: tir.const(v, compute)  # noqa: E731
        if kind == "uniform":
            low, high = params
            result = c(low) + c(high - low) * _uniform(seed, salt, 0, linear, dtype)
        elif kind == "normal":
            mean = next(arg) if params[0] is None else c(params[0])
            std = next(arg) if params[1] is None else c(params[1])
            result = mean + std * _normal(seed, salt, linear, compute)
        elif kind == "log_normal":
            result = tir.exp(c(params[0]) + c(params[1]) * _normal(seed, salt, linear, compute))
        elif kind == "bernoulli":
            p = next(arg) if params[0] is None else c(params[0])
            result = tir.Select(_uniform(seed, salt, 0, linear, compute) < p, c(1.0), c(0.0))
        elif kind == "exponential":
            result = -tir.log(_uniform(seed, salt, 0, linear, compute, open_interval=True)) / c(params[0])
        elif kind == "geometric":
            result = tir.ceil(tir.log(_uniform(seed, salt, 0, linear, compute, open_interval=True))
                              / c(math.log1p(-params[0])))
        elif kind == "cauchy":
            u = _uniform(seed, salt, 0, linear, compute, open_interval=True)
            result = c(params[0]) + c(params[1]) * tir.tan(c(math.pi) * (u - c(0.5)))
        elif kind == "randint":
            return tir.Cast(dtype, _randint(seed, salt, linear, int(params[0]), int(params[1])))
        else:
            raise ValueError(f"unknown random kind {kind!r}")
        return tir.Cast(dtype, result)

    return te.compute(out_shape, value, name=f"random_{kind}")


# --- the converters ---------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _arguments(node: torch.fx.Node) -> dict[str, object]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    values.update(node.kwargs)
    return values


def _static_shape(node: torch.fx.Node) -> tuple[int, ...]:
    shape = node.meta["val"].shape
    if not all(isinstance(d, int) for d in shape):
        raise UnsupportedOpError(
            f"{node.target} with a size that depends on a dynamic batch ({tuple(shape)}) is not supported: draw "
            f"it with the _like form of a tensor of that shape instead (torch.rand_like(x)).")
    return tuple(shape)


def _emit(importer: ExportedProgramImporter, node: torch.fx.Node, seed: relax.Expr, salt: int, kind: str,
          tensors: Sequence[relax.Expr] = (), params: tuple = (), like: int | None = None) -> relax.Expr:
    bb = importer.block_builder
    dtype = _dtype_name(node.meta["val"].dtype)
    shape = None if like is not None else _static_shape(node)
    # No gradient into the inputs, as in torch; autodiff never reaches the kernel.
    return stop_gradient.emit_te(bb, random_kernel, *tensors, seed, kind=kind, salt=salt, dtype=dtype, shape=shape,
                                 like=like, params=params, primfunc_name_hint=f"random_{kind}")


def _float_or_tensor(importer: ExportedProgramImporter, value: object) -> tuple[float | None, list[relax.Expr]]:
    if isinstance(value, torch.fx.Node):
        return None, [importer.env[value]]
    return float(value), []


def converters(seed: torch.fx.Node | None, salts: dict[torch.fx.Node, int]) -> dict[str, Converter]:
    """fx -> Relax converters of the random ops, reading `seed` (lower.RNG_INPUT); `salts`
    numbers the random nodes of the program."""

    def op(build: Callable[[torch.fx.Node, ExportedProgramImporter, dict, relax.Expr, int], relax.Expr]) -> Converter:
        def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
            if node not in salts:  # not random here (rrelu in eval mode): no seed input
                return build(node, importer, _arguments(node), None, -1)
            return build(node, importer, _arguments(node), importer.env[seed], salts[node])
        return convert

    def sized(kind: str, params: Callable[[dict], tuple]) -> Converter:
        return op(lambda node, imp, a, s, salt: _emit(imp, node, s, salt, kind, params=params(a)))

    def like(kind: str, params: Callable[[dict], tuple]) -> Converter:
        return op(lambda node, imp, a, s, salt: _emit(imp, node, s, salt, kind, [imp.env[a["self"]]],
                                                      params(a), like=0))

    def normal(node, imp, a, s, salt):
        mean, mean_tensors = _float_or_tensor(imp, a["mean"])
        std, std_tensors = _float_or_tensor(imp, a["std"])
        tensors = mean_tensors + std_tensors
        shape = tuple(node.meta["val"].shape)
        # The output takes the shape of a tensor parameter of its shape (symbolic under a
        # dynamic batch), passed once more as the shape source; else the static broadcast shape.
        source = next((imp.env[v] for v in (a["mean"], a["std"])
                       if isinstance(v, torch.fx.Node) and tuple(v.meta["val"].shape) == shape), None)
        if source is None:
            return _emit(imp, node, s, salt, "normal", tensors, (mean, std))
        return _emit(imp, node, s, salt, "normal", [source, *tensors], (mean, std), like=0)

    def bernoulli_p(node, imp, a, s, salt):
        p, p_tensors = _float_or_tensor(imp, a["p"])
        return _emit(imp, node, s, salt, "bernoulli", [imp.env[a["self"]], *p_tensors], (p,), like=0)

    def rrelu(node, imp, a, s, salt):
        bb = imp.block_builder
        x = imp.env[a["self"]]
        lower, upper = float(a["lower"]), float(a["upper"])
        if not a["training"]:
            slope = relax.const((lower + upper) / 2, x.ty.dtype.dtype)
            # x > 0, as torch's (x == 0 takes the slope: its gradient is the slope, not 1)
            out = bb.emit(relax.op.where(relax.op.greater(x, relax.const(0, x.ty.dtype.dtype)), x,
                                         relax.op.multiply(x, slope)))
            return bb.emit(relax.Tuple([out, imp.env[a["noise"]]]))
        # x's node gives the slopes' dtype (this node's value is the (out, noise) pair).
        slopes = _emit(imp, node.args[0], s, salt, "uniform", [x], (lower, upper), like=0)
        positive = relax.op.greater(x, relax.const(0, x.ty.dtype.dtype))
        noise = bb.emit(relax.op.where(positive, relax.op.ones_like(x), slopes))
        return bb.emit(relax.Tuple([bb.emit(relax.op.multiply(x, noise)), noise]))

    randint = op(lambda node, imp, a, s, salt: _emit(imp, node, s, salt, "randint", params=(a.get("low", 0), a["high"])))
    randint_like = op(lambda node, imp, a, s, salt: _emit(imp, node, s, salt, "randint", [imp.env[a["self"]]],
                                                          (a.get("low", 0), a["high"]), like=0))
    return {
        "rand.default": sized("uniform", lambda a: (0.0, 1.0)),
        "rand_like.default": like("uniform", lambda a: (0.0, 1.0)),
        "randn.default": sized("normal", lambda a: (0.0, 1.0)),
        "randn_like.default": like("normal", lambda a: (0.0, 1.0)),
        "randint.default": randint,
        "randint.low": randint,
        "randint_like.default": randint_like,
        "randint_like.low_dtype": randint_like,
        "uniform.default": like("uniform", lambda a: (float(a["from"]), float(a["to"]))),
        "normal_functional.default": like("normal", lambda a: (float(a["mean"]), float(a["std"]))),
        "normal.Tensor_float": op(normal),
        "normal.float_Tensor": op(normal),
        "normal.Tensor_Tensor": op(normal),
        "normal.float_float": op(normal),
        "log_normal.default": like("log_normal", lambda a: (float(a["mean"]), float(a["std"]))),
        "bernoulli.p": op(bernoulli_p),
        "exponential.default": like("exponential", lambda a: (float(a["lambd"]),)),
        "geometric.default": like("geometric", lambda a: (float(a["p"]),)),
        "cauchy.default": like("cauchy", lambda a: (float(a["median"]), float(a["sigma"]))),
        "rrelu_with_noise_functional.default": op(rrelu),
    }


OPS = frozenset(converters(None, {}))  # the op keys lowered here
