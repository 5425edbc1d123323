"""Helpers for the gradient tests: differentiate one Relax op (or a whole network), compare with
torch and with central differences.

For an op ``f`` and random cotangent weights ``w`` (same shape as ``f``'s output), the module

    main(x_0, ..., x_{k-1}, w) = sum(f(x_0, ..., x_{k-1}) * w)

is differentiated by ``relax.transform.Gradient`` w.r.t. its differentiable inputs, so
``main_adjoint`` returns the vector-Jacobian products ``w^T df/dx_i``. The same quantity comes
from ``torch.autograd`` on the equivalent torch op, and from central differences of the loss.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import tvm
from tvm import relax

import tvmgraph.gradients  # noqa: F401  (registers the gradients)

TARGET = tvm.target.Target({"kind": "llvm"})


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol * scale + rtol * |expected|``,
    with ``scale = max(1, max|expected|)``."""

    atol: float
    rtol: float


#: Relax gradient vs torch.autograd, per dtype (the values of tests/conftest.py's table).
TOLERANCES = {
    "float32": Tolerance(atol=1e-5, rtol=1e-4),
    "float64": Tolerance(atol=1e-10, rtol=1e-8),
}
#: Relax gradient vs central differences ``(step, tolerance)``, per dtype. float64 is the
#: check; float32 serves ops whose TVM kernel lacks float64 (rounding of the loss, ~1e-7 of
#: its size, is divided by the step, hence the larger step and looser tolerance).
FD_SETTINGS = {
    "float64": (1e-6, Tolerance(atol=1e-6, rtol=1e-5)),
    "float32": (1e-2, Tolerance(atol=5e-4, rtol=1e-3)),
}
#: Whole-network parameter gradients, Relax float32 vs torch float64; atol is relative to the
#: network's largest gradient (float32 rounding in the test networks stays near 1e-6 of it).
NETWORK_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-3)


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: Tolerance, what: str) -> None:
    """Assert shape, dtype kind and values agree; ``what`` names the quantity in the message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype.kind == expected.dtype.kind, f"{what}: {actual.dtype} vs {expected.dtype}"
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol * scale, err_msg=what)


##################### Relax side #####################


def vjp_module(
    relax_fn: Callable[..., relax.Expr],
    inputs: Sequence[np.ndarray],
    differentiable: Sequence[int],
    out_shape: Sequence[int],
) -> tvm.IRModule:
    """``main(*inputs, w) = sum(relax_fn(*inputs) * w)`` plus its ``main_adjoint``."""
    params = [
        relax.Var(f"x{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(inputs)
    ]
    dtype = str(inputs[differentiable[0]].dtype)
    weights = relax.Var("w", relax.TensorType(tuple(out_shape), dtype))
    builder = relax.BlockBuilder()
    with builder.function("main", [*params, weights]):
        with builder.dataflow():
            out = builder.emit(relax_fn(*params))
            loss = builder.emit(relax.op.sum(relax.op.multiply(out, weights)))
            gv = builder.emit_output(loss)
        builder.emit_func_output(gv)
    mod = builder.get()
    require = [mod["main"].params[i] for i in differentiable]
    return relax.transform.Gradient("main", require_grads=require)(mod)


def without_main(mod: tvm.IRModule) -> tvm.IRModule:
    """`main_adjoint` and the kernels a gradient added (batch_norm_backward), without `main`."""
    return tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"})


class CompiledVJP:
    """A compiled :func:`vjp_module`: ``loss(*arrays)`` and ``grads(*arrays)``.

    Only ``main_adjoint`` is compiled (it returns the loss too): compilation dominates the
    tests' run time, and the extra gradient work per call is negligible at these sizes.
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        adjoint = without_main(mod)
        self.vm = relax.VirtualMachine(tvm.compile(adjoint, target=TARGET), tvm.cpu())

    def loss(self, *arrays: np.ndarray) -> float:
        """The value of ``main``."""
        loss, _ = self.vm["main_adjoint"](*map(tvm.runtime.tensor, arrays))
        return float(loss.numpy())

    def grads(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The gradients ``main_adjoint`` returns, one per differentiable input."""
        _, grads = self.vm["main_adjoint"](*map(tvm.runtime.tensor, arrays))
        return [g.numpy() for g in grads]


def central_differences(
    loss: Callable[..., float], arrays: Sequence[np.ndarray], index: int, step: float
) -> np.ndarray:
    """``(L(x + h e_j) - L(x - h e_j)) / 2h`` for every element ``j`` of ``arrays[index]``."""
    arrays = [a.copy() for a in arrays]
    target = arrays[index].reshape(-1)
    grad = np.zeros(target.shape, dtype=np.float64)
    for j in range(target.size):
        saved = target[j]
        target[j] = saved + step
        plus = loss(*arrays)
        target[j] = saved - step
        minus = loss(*arrays)
        target[j] = saved
        grad[j] = (plus - minus) / (2 * step)
    return grad.reshape(arrays[index].shape)


##################### torch side #####################


def torch_vjp(
    torch_fn: Callable[..., torch.Tensor],
    inputs: Sequence[np.ndarray],
    differentiable: Sequence[int],
    weights: np.ndarray,
) -> tuple[float, list[np.ndarray]]:
    """``sum(torch_fn(*inputs) * w)`` and its gradients from ``torch.autograd``."""
    tensors = [torch.tensor(a, requires_grad=i in differentiable) for i, a in enumerate(inputs)]
    loss = (torch_fn(*tensors) * torch.tensor(weights)).sum()
    grads = torch.autograd.grad(loss, [tensors[i] for i in differentiable])
    return float(loss.detach()), [g.numpy() for g in grads]


def torch_output_shape(
    torch_fn: Callable[..., torch.Tensor], inputs: Sequence[np.ndarray]
) -> list[int]:
    """The output shape of ``torch_fn`` on ``inputs``."""
    with torch.no_grad():
        return list(torch_fn(*(torch.tensor(a) for a in inputs)).shape)


##################### One op: cases and the check #####################

Inputs = Callable[[np.random.Generator], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op configuration: the Relax op, the torch op it must equal, and its inputs."""

    id: str
    relax_fn: Callable[..., relax.Expr]
    torch_fn: Callable[..., torch.Tensor]
    #: float64 arrays (differentiable unless listed in ``nondiff``) and int64 index arrays.
    inputs: Inputs
    nondiff: tuple[int, ...] = ()
    #: False when inputs sit on a kink on purpose (central differences are meaningless there).
    fd: bool = True
    #: False where TVM's kernel lacks float64 (layer/instance/group norm reject it; rms_norm
    #: and resize2d compute in float32): then only float32 runs, central differences included.
    float64: bool = True


def const_like(value: float, like: relax.Expr) -> relax.Constant:
    """A scalar Relax constant with the dtype of ``like``."""
    return relax.const(value, str(like.ty.dtype.dtype))


def emit(expr: relax.Expr) -> relax.Var:
    """Bind ``expr`` in the function being built (so several fields of one call share it)."""
    return relax.BlockBuilder.current().emit(expr)


def normal(*shapes: tuple[int, ...]) -> Inputs:
    """Standard normal float inputs of the given shapes."""
    return lambda rng: [np.asarray(rng.standard_normal(shape)) for shape in shapes]


def spaced(shape: tuple[int, ...], low: float = -3.0, high: float = 3.0) -> Inputs:
    """Distinct values at least ``(high - low) / size`` apart, shuffled: no ties, no near-kinks."""

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        size = int(np.prod(shape))
        values = np.linspace(low, high, size) + 0.1 * (high - low) / size
        return [rng.permutation(values).reshape(shape)]

    return make


def with_indices(float_shape: tuple[int, ...], index_shape: tuple[int, ...], bound: int) -> Inputs:
    """A normal float input and int64 indices in ``[0, bound)`` (repeats included)."""
    return lambda rng: [
        rng.standard_normal(float_shape),
        rng.integers(0, bound, size=index_shape).astype(np.int64),
    ]


def positive(*shapes: tuple[int, ...]) -> Inputs:
    """Float inputs in ``[0.5, 2)``, for ops defined on positive numbers."""
    return lambda rng: [rng.uniform(0.5, 2.0, shape) for shape in shapes]


def check_op(case: OpCase) -> None:
    """Compare ``case``'s Relax gradients with torch (float32, float64) and central differences."""
    rng = np.random.default_rng(0)
    inputs = case.inputs(rng)
    diff = [i for i, a in enumerate(inputs) if a.dtype.kind == "f" and i not in case.nondiff]
    out_shape = torch_output_shape(case.torch_fn, inputs)
    weights = rng.standard_normal(out_shape)
    dtypes = ("float32", "float64") if case.float64 else ("float32",)
    for dtype in dtypes:
        arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs]
        w = weights.astype(dtype)
        compiled = CompiledVJP(vjp_module(case.relax_fn, arrays, diff, out_shape))
        expected_loss, expected = torch_vjp(case.torch_fn, arrays, diff, w)
        tol = TOLERANCES[dtype]
        loss = np.array(compiled.loss(*arrays, w))
        assert_close(loss, np.array(expected_loss), tol, f"{dtype} forward")
        for i, got, want in zip(diff, compiled.grads(*arrays, w), expected):
            assert_close(got, want, tol, f"{dtype} d/dx{i} vs torch")
            if dtype == dtypes[-1] and case.fd:
                step, fd_tol = FD_SETTINGS[dtype]
                numeric = central_differences(compiled.loss, [*arrays, w], i, step)
                assert_close(got, numeric, fd_tol, f"{dtype} d/dx{i} vs central differences")


##################### Whole networks #####################


class WithLoss(torch.nn.Module):
    """``forward(x, target) = (loss_fn(model(x), target),)``: the shape tvmgraph differentiates."""

    def __init__(self, model: torch.nn.Module, loss_fn: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.loss_fn(self.model(x), target),)


class CompiledLossGrad:
    """A network's loss and parameter gradients, lowered the way tvmgraph lowers it.

    ``torch.export`` (train mode) with decompositions, ``from_exported_program`` keeping the
    parameters as inputs after the ``num_input`` user inputs, ``Gradient`` w.r.t. all of them,
    and only ``main_adjoint`` compiled. Calling it runs with a module's current parameters, so
    one compilation serves every module of the same architecture.
    """

    def __init__(self, module: WithLoss, args: Sequence[torch.Tensor]) -> None:
        from tvm.relax.frontend.torch import from_exported_program

        module.train()
        exported = torch.export.export(module, tuple(args), strict=False)
        with warnings.catch_warnings():
            # torch 2.13 deep-copies its own pytree specs here and warns about itself.
            warnings.filterwarnings(
                "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
            )
            exported = exported.run_decompositions()
        mod = from_exported_program(
            exported,
            keep_params_as_input=True,
            run_ep_decomposition=False,
            no_bind_return_tuple=True,
        )
        specs = exported.graph_signature.input_specs
        targets = {spec.arg.name: spec.target for spec in specs if spec.target is not None}
        parameters = {spec.arg.name for spec in specs if spec.kind.name == "PARAMETER"}
        main = mod["main"]
        num_input = int(main.attrs["num_input"])
        state_vars = list(main.params[num_input:])
        require = [var for var in state_vars if var.name in parameters]
        assert len(require) == len(parameters), "every parameter must be a function input"
        mod = relax.transform.Gradient("main", require_grads=require, target_index=0)(mod)
        adjoint = without_main(mod)
        self.vm = relax.VirtualMachine(tvm.compile(adjoint, target=TARGET), tvm.cpu())
        self.state_names = [targets[var.name] for var in state_vars]
        self.parameter_names = [targets[var.name] for var in require]

    def __call__(
        self, module: WithLoss, args: Sequence[torch.Tensor]
    ) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and the gradient of every parameter, by name, at ``module``'s parameters."""
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        values = [*args, *(state[name] for name in self.state_names)]
        arrays = (tvm.runtime.tensor(v.detach().numpy()) for v in values)
        (loss,), grads = self.vm["main_adjoint"](*arrays)
        return float(loss.numpy()), {n: g.numpy() for n, g in zip(self.parameter_names, grads)}


def torch_parameter_grads(
    module: WithLoss, args: Sequence[torch.Tensor]
) -> tuple[float, dict[str, np.ndarray]]:
    """The loss and parameter gradients from ``torch.autograd`` (train mode)."""
    module.train()
    module.zero_grad()
    (loss,) = module(*args)
    loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in module.named_parameters()}
    return float(loss.detach()), grads
