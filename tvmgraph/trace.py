"""Tracing: run `build()` under `torch.export` (non-strict) and record what it did.

The graph's registered modules become children of a throw-away root module whose `forward`
calls `build()`. Because the children are the user's own module objects, `torch.export` lifts
their parameters and buffers as inputs named by their path in the graph (`model.0.weight`):
the compiled program reads the live tensors at every call, never a stale copy.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.export._trace  # the ATen-level export that AMP uses (`_export`)
import torch.nn.functional as F

from . import autograd_in_build, covariance, ctc_loss, cumulative_batch_norm, stop_gradient
from .attribute_guard import AttributeGuard, recording
from .dynamic_batch import HINT as DYNAMIC_BATCH_HINT
from .dynamic_batch import export_arguments
from .errors import BackwardError, GraphOutputError, TraceError, TvmGraphError
from .module_stack import ModuleStack
from .spec import NotATreeError, TensorSpec, TreeDef, flatten
from .training import reached

_state = threading.local()


_DATA_DEPENDENT_MARKERS = ("data-dependent", "data dependent", "GuardOnDataDependent", "Could not guard",
                           "Could not extract specialized integer", "item()")
# What torch.export says when build() fixed a size that dynamic_shapes left open.
_SPECIALIZED_MARKER = "Constraints violated"
_DATA_DEPENDENT_HINT = (
    "\nTracing runs build() once with symbolic tensors: data-dependent Python control flow "
    "(`if x.sum() > 0:`) and .item()/.tolist() cannot be traced. Rewrite them with torch.where "
    "(both branches computed, one picked), or compute them outside the graph. A slice at a "
    "position read from a tensor (`cache[:, p:p + n] = k` with `p = pos[0]`) is one too: index "
    "with tensors instead "
    "(`cache.index_copy_(1, pos + torch.arange(n), k)`, `x.index_select`, `torch.gather`)."
)
# Where torch.export says a data-dependent size came from, for F.one_hot without num_classes.
_ONE_HOT_MARKER = " in one_hot)"
_ONE_HOT_HINT = ("\n`F.one_hot(x)` without num_classes takes the number of classes from x's values (x.max() + 1), "
                 "which a compiled program cannot know in advance: pass it, `F.one_hot(x, num_classes=n)`.")
# What torch.export says when build() reads `tensor.data`.
_DOT_DATA_MARKER = "fake tensor in the exported program constant"
_DOT_DATA_HINT = ("\n`tensor.data` inside build() cannot be traced: use `tensor.detach()` (the same values, "
                  "no gradient), which the graph keeps. torch.func.vmap fails the same way in "
                  "torch.export when an argument is not batched (`in_dims=(None, 0)`, or a tensor the "
                  "vmapped function captures) or batched on a dim other than 0: batch every argument on "
                  "dim 0 (x.movedim(d, 0)), or write the computation with broadcasting (x @ w.T).")


def tracing_graph() -> str | None:
    """Name of the graph whose `build()` is being traced on this thread, if any."""
    return getattr(_state, "graph_name", None)


@dataclass
class ModuleIO:
    """Inputs and outputs one registered submodule saw while `build()` was traced."""

    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)


@dataclass
class BackwardCall:
    """The `loss.backward()` recorded while tracing: which flat output holds the loss."""

    loss: torch.Tensor
    where: str
    reached: frozenset[str] = frozenset()  # the parameters (by path) autograd gives a gradient
    inputs: tuple[torch.Tensor, ...] | None = None  # backward(inputs=...): only these get gradients
    only: frozenset[str] | None = None  # the paths of those inputs (parameters)


def _leaves(value: object) -> list[TensorSpec]:
    if isinstance(value, torch.Tensor):
        return [TensorSpec.of(value)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _leaves(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _leaves(v)]
    return []


@dataclass
class _Record:
    """Facts collected while build() runs (kept off the module: export restores module state)."""

    graph_name: str
    autocast: tuple[str, torch.dtype] | None = None  # (device_type, dtype) for AMP (tvmgraph/amp.py)
    out_tree: TreeDef | None = None
    backward: BackwardCall | None = None
    functions: list[type] = field(default_factory=list)  # autograd.Function classes applied (AMP)


class _BuildRoot(torch.nn.Module):
    """Root module handed to torch.export: forward(*flat_inputs) = flat(build(*args))."""

    def __init__(self, record: _Record, build: Callable, modules: dict[str, torch.nn.Module], args_tree: TreeDef):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self._record = record
        self._build_fn = build
        self._args_tree = args_tree

    def forward(self, *flat_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        record = self._record
        record.backward = None  # the ATen-level export (AMP) runs build() twice
        args = self._args_tree.unflatten(flat_inputs)
        amp = torch.autocast(*record.autocast) if record.autocast else contextlib.nullcontext()
        stops = stop_gradient.StopWhereGradIsOff() if record.autocast else contextlib.nullcontext()
        functions = autograd_in_build.record_functions(record) if record.autocast else contextlib.nullcontext()
        edits = autograd_in_build.Edits(record)
        with _capture_backward(record), _refuse_gradient_clipping(record), _causal_hints_from_arguments(), \
                _gaussian_nll_without_value_check(), _distributions_without_value_checks(), ctc_loss.traceable(), \
                cumulative_batch_norm.traceable(), covariance.traceable(), \
                autograd_in_build.inference_mode_as_no_grad(), edits.watching(), \
                amp, stops, functions:  # export records autocast's casts
            out = self._build_fn(*args)
        try:
            leaves, record.out_tree = flatten(out, "output")
        except NotATreeError as e:
            raise GraphOutputError(
                f"{record.graph_name}: build() returned {type(e.value).__name__} at {e.path or 'output'}; "
                f"build() may return only Tensors, lists, tuples and dicts (string keys) of Tensors, and None. "
                f"Convert the value to a tensor (torch.as_tensor) or return it outside the graph."
            ) from None
        if not leaves and record.backward is None:
            # Seed 003: build()'s outputs may be None (`def build(self): pass`; a build() that only
            # updates buffers). The program still needs a result: a 0-d zero the call drops
            # (Graph.__call__).
            leaves = [torch.zeros(())]
        if record.backward is not None:
            if record.autocast is None:  # under AMP autograd is off: read from the program instead
                record.backward.reached = reached.from_autograd(record.backward.loss, self)
            if record.backward.inputs is not None:
                record.backward.only = autograd_in_build.parameters_named(record.graph_name,
                                                                          record.backward.inputs, self)
            functions = autograd_in_build.refused(reached.autograd_functions(record.backward.loss)
                                                  if record.autocast is None else record.functions)
            if functions:
                raise BackwardError(autograd_in_build.through_functions(record.graph_name, functions))
            if edits.refusal() is not None:
                raise BackwardError(edits.refusal())
            # The loss joins the outputs so that autodiff can find it in the lowered program.
            leaves = [*leaves, record.backward.loss]
        return tuple(leaves)


@contextlib.contextmanager
def _causal_hints_from_arguments() -> Iterator[None]:
    """nn.Transformer(Encoder/Decoder) compare a mask with the causal one to set `is_causal` (a
    speed hint: the mask is applied either way); on traced tensors that comparison depends on
    data and export fails. While tracing, the hint comes from the arguments only."""
    from torch.nn.modules import transformer

    original = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = lambda mask, is_causal=None, size=None: is_causal is True
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original


@contextlib.contextmanager
def _gaussian_nll_without_value_check() -> Iterator[None]:
    """F.gaussian_nll_loss (and nn.GaussianNLLLoss) start with `if torch.any(var < 0): raise`, a
    branch on data that export cannot trace. While tracing, the loss is torch's own formula
    without that check (a negative variance is clamped to eps like a small one, where eager
    raises)."""
    original = F.gaussian_nll_loss

    def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
        if not isinstance(var, torch.Tensor):  # a float variance: no branch on data
            return original(input, target, var, full=full, eps=eps, reduction=reduction)
        # torch's shape rules (static: they trace)
        if var.size() != input.size():
            if input.size()[:-1] == var.size():
                var = torch.unsqueeze(var, -1)
            elif not (input.ndim == var.ndim and sum(v for i, v in zip(input.size(), var.size()) if i != v) == 1):
                raise ValueError("var is of incorrect size")
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(reduction + " is not valid")
        var = var.clone()
        with torch.no_grad():
            var.clamp_(min=eps)
        loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
        if full:
            loss = loss + 0.5 * math.log(2 * math.pi)
        return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss

    F.gaussian_nll_loss = gaussian_nll_loss
    try:
        yield
    finally:
        F.gaussian_nll_loss = original


@contextlib.contextmanager
def _distributions_without_value_checks() -> Iterator[None]:
    """torch.distributions check their parameters and samples by default (`Normal(mu,
    sigma).log_prob(x)` asks whether all of sigma is positive): branches on data that export
    cannot trace. While tracing they default to validate_args=False (a distribution built with
    validate_args=True still checks, and fails to trace)."""
    distribution = torch.distributions.Distribution
    saved = distribution._validate_args
    distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        distribution.set_default_validate_args(saved)


@contextlib.contextmanager
def _refuse_gradient_clipping(record: _Record) -> Iterator[None]:
    """`torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` in build(): no gradient exists while
    build() is traced, and torch's functions skip parameters without one, so the clipping
    silently did not happen (a step 5.4 away from eager's). Refused, pointing at the graph's own
    clipping. Patched at the helpers they call, so that `from torch.nn.utils import
    clip_grad_norm_` is caught too."""
    from torch.nn.utils import clip_grad

    def refuse(*args, **kwargs):
        raise BackwardError(
            f"{record.graph_name}: torch.nn.utils.clip_grad_norm_ (or clip_grad_value_) was called in "
            f"build(); gradients do not exist while build() is traced, so it would clip nothing. Clip "
            f"in the graph's optimizer step instead: put 'clip_grad_max_norm': max_norm (and "
            f"'clip_grad_norm_type') in the optimizer's param group (docs/training.md, \"Gradient "
            f"clipping\"), or clip outside the graph.")

    names = ("_get_total_norm", "_group_tensors_by_device_and_dtype")
    saved = {name: getattr(clip_grad, name) for name in names}
    for name in names:
        setattr(clip_grad, name, refuse)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(clip_grad, name, value)


@contextlib.contextmanager
def _capture_backward(record: _Record) -> Iterator[None]:
    """Turn `loss.backward()` (or `torch.autograd.backward(loss)`) inside build() into a record
    instead of running autograd; `torch.autograd.grad` is refused."""
    original = torch.Tensor.backward

    def record_backward(tensor: torch.Tensor, gradient=None, retain_graph=None, create_graph=False,
                        inputs=None) -> None:
        name = record.graph_name
        if record.backward is not None:
            raise BackwardError(f"{name}: backward() was called twice in build(); call it once, "
                                f"on the sum of your losses: (loss_a + loss_b).backward()")
        if tensor.dim() != 0 or not tensor.is_floating_point():
            raise BackwardError(
                f"{name}: backward() was called on a {TensorSpec.of(tensor).describe()} tensor; only a "
                f"scalar floating-point loss may call backward() in build(). Reduce it first: "
                f"loss.sum().backward() or loss.mean().backward()"
            )
        if gradient is not None:
            raise BackwardError(f"{name}: backward(gradient=...) is not supported in build(); "
                                f"scale the loss instead: (loss * g).backward()")
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        record.backward = BackwardCall(tensor, where="build()", inputs=None if inputs is None else tuple(inputs))

    def autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                          grad_variables=None, inputs=None) -> None:
        """`torch.autograd.backward(loss)`: eager's loss.backward() is this call."""
        losses = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if len(losses) != 1:
            raise BackwardError(f"{record.graph_name}: torch.autograd.backward() was given {len(losses)} "
                                f"tensors; give it one loss, the sum of your losses")
        gradient = grad_tensors if grad_tensors is None or isinstance(grad_tensors, torch.Tensor) else grad_tensors[0]
        record_backward(losses[0], gradient, inputs=inputs)

    def autograd_grad(*args: object, **kwargs: object) -> None:
        raise BackwardError(
            f"{record.graph_name}: torch.autograd.grad was called in build() (a gradient penalty, an input "
            f"gradient): the graph differentiates the loss once, with loss.backward(), and cannot take "
            f"gradients inside build(). Compute such a term outside the graph, or train without it.")

    saved = torch.autograd.backward, torch.autograd.grad
    torch.Tensor.backward = record_backward
    torch.autograd.backward, torch.autograd.grad = autograd_backward, autograd_grad
    try:
        yield
    finally:
        torch.Tensor.backward = original
        torch.autograd.backward, torch.autograd.grad = saved


@dataclass
class TraceResult:
    """What tracing produced: the exported program plus the facts export does not keep."""

    exported: torch.export.ExportedProgram
    out_tree: TreeDef
    module_io: dict[str, ModuleIO]
    has_backward: bool
    attributes: AttributeGuard = field(default_factory=AttributeGuard)  # plain values build() read
    # The parameters (by path) that loss.backward() gives a gradient (training/reached.py).
    reached: frozenset[str] = frozenset()
    # What to say when a later stage fails and two tensor arguments share memory (aliasing_hint).
    aliasing: str = ""


def trace_build(
    graph_name: str,
    build: Callable,
    modules: dict[str, torch.nn.Module],
    args_tree: TreeDef,
    flat_inputs: list[torch.Tensor],
    arg_names: list[str],
    autocast: tuple[str, torch.dtype] | None = None,
    dynamic_batch: bool = False,
) -> TraceResult:
    """Export `build(*args)` with torch.export (non-strict) and record module inputs/outputs;
    with `autocast` (device_type, dtype), build() runs under `torch.autocast` (AMP). With
    `dynamic_batch`, dim 0 of the tensor arguments is exported as one symbolic size."""
    record = _Record(graph_name, autocast)
    root = _named_inputs(_BuildRoot, arg_names)(record, build, modules, args_tree)
    module_io: dict[str, ModuleIO] = {}
    handles = []
    for path, module in root.named_modules():
        if path:
            handles.append(module.register_forward_hook(_io_recorder(module_io, path), with_kwargs=True))
    running = ModuleStack(root)
    _state.graph_name = graph_name
    _record_frames_of(build)
    try:
        with warnings.catch_warnings():
            # nn.RNN/LSTM/GRU refresh their `_flat_weights` list (views of their registered
            # parameters) on every forward; export warns about it although nothing is lost.
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights", category=UserWarning)
            owners = [("self", getattr(build, "__self__", None))] + [
                (f"self.{path}", m) for path, m in root.named_modules() if path]
            with recording([(w, o) for w, o in owners if o is not None]) as attributes, \
                    math_attention(t.device for t in flat_inputs if isinstance(t, torch.Tensor)):
                examples, dynamic_shapes = export_arguments(flat_inputs) if dynamic_batch \
                    else (tuple(flat_inputs), None)
                with _quiet_meta_failures(), global_hooks_on_user_modules():
                    exported = _export(root, examples, dynamic_shapes, below_autocast=autocast is not None)
    except TvmGraphError:
        raise
    except Exception as e:  # torch raises many types here; all mean "could not trace"
        aliasing = aliasing_hint(flat_inputs, arg_names)
        hint = f"\n{aliasing}" if aliasing else f"{running.hint()}{_trace_hint(str(e), dynamic_batch)}"
        raise TraceError(f"{graph_name}: torch.export could not trace build(): {type(e).__name__}: {e}"
                         f"{hint}") from e
    finally:
        _state.graph_name = None
        running.remove()
        for h in handles:
            h.remove()
    assert record.out_tree is not None
    stop_gradient.mark(exported, graph_name)
    trained = frozenset()
    if record.backward is not None:
        trained = reached.from_program(exported) if autocast is not None else record.backward.reached
        if record.backward.only is not None:  # backward(inputs=...): the others keep no gradient
            trained = trained & record.backward.only
    return TraceResult(exported, record.out_tree, module_io, record.backward is not None, attributes[0], trained,
                       aliasing_hint(flat_inputs, arg_names))


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    """Keep torch's fake-tensor logger from printing the traceback of an op that fails while
    tracing ("failed while attempting to run meta for aten.mm.default", 20 lines on stderr
    before the TraceError that carries the same message), and the symbolic-shapes logger from
    printing the traced graph twice when build() branches on a value ("Unable to find user code
    corresponding to {u0}"). Each is left alone when the user asked torch for more than
    warnings from it (TORCH_LOGS)."""
    loggers = [logging.getLogger(name) for name in _QUIETED_LOGGERS]
    quieted = [(logger, logger.level) for logger in loggers if logger.getEffectiveLevel() >= logging.WARNING]
    for logger, _ in quieted:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in quieted:
            logger.setLevel(level)


_QUIETED_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


# Where the modules torch.export and tvmgraph make while tracing come from (tvmgraph's root
# module, export's wrappers and guard functions, the GraphModule a decomposition retraces).
_INTERNAL_MODULES = ("torch.export", "torch._export", "torch._dynamo", "torch.fx", "torch._functorch",
                     "torch._higher_order_ops", "tvmgraph.")


@contextlib.contextmanager
def global_hooks_on_user_modules() -> Iterator[None]:
    """torch's global forward hooks and pre-hooks (`register_module_forward_hook`) skip the
    modules torch.export and tvmgraph make while build() is traced or decomposed: a hook
    reading `output.detach()` failed on their tuples and Nones, where eager calls it on the
    user's modules only."""
    from torch.nn.modules import module as module_mod

    tables = (module_mod._global_forward_hooks, module_mod._global_forward_pre_hooks)
    saved = [dict(table) for table in tables]

    def on_user_modules(hook: Callable) -> Callable:
        return lambda module, *rest: None if type(module).__module__.startswith(_INTERNAL_MODULES) \
            else hook(module, *rest)

    for table in tables:
        for key, hook in list(table.items()):
            table[key] = on_user_modules(hook)
    try:
        yield
    finally:
        for table, hooks in zip(tables, saved):
            for key in list(table):
                if key in hooks:
                    table[key] = hooks[key]


def _export(root: torch.nn.Module, examples: tuple, dynamic_shapes: object,
             below_autocast: bool) -> torch.export.ExportedProgram:
    """torch.export, non-strict. `below_autocast` (AMP) traces at the ATen level, below the
    autocast dispatch keys, so the program holds the casts that eager's autocast makes. The
    default training IR traces above them, and its autocast regions lose the policy of ops
    that decompose there: `F.nll_loss` stayed bfloat16 on the CPU (eager: float32), and on
    CUDA `log_softmax` stayed float16 (a float16 AMP loss rounded to float16)."""
    if not below_autocast:
        return torch.export.export(root, examples, dynamic_shapes=dynamic_shapes, strict=False)
    return torch.export._trace._export(root, examples, dynamic_shapes=dynamic_shapes, strict=False,
                                       pre_dispatch=False)


def math_attention(devices: Iterable[torch.device]) -> contextlib.AbstractContextManager:
    """On CUDA, scaled_dot_product_attention dispatches to fused kernels (flash, memory-efficient,
    cuDNN) that torch has no decomposition for; its math backend is matmuls and a softmax, the
    program the CPU gets."""
    if any(d.type == "cuda" for d in devices):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def aliasing_hint(inputs: Sequence[object], names: Sequence[str]) -> str:
    """The likely cause of a failed trace or decomposition when two tensor arguments share
    memory (one tensor passed twice, or views of one): export takes them for separate tensors,
    and an in-place update of one in build() fails deep inside torch, in an error that names
    another cause. "" when no two share memory."""
    pair = shared_storage(zip(names, inputs))
    if pair is None:
        return ""
    return (f"Arguments '{pair[0]}' and '{pair[1]}' share memory (one tensor, or views of one), which "
            f"torch cannot trace with an in-place update in build(): pass a copy, `{pair[1]}.clone()`.")


def shared_storage(named: Iterable[tuple[str, object]]) -> tuple[str, str] | None:
    """The first two names whose tensors share memory (one tensor, or views of one), or None."""
    seen: dict[int, str] = {}
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.numel():
            storage = value.untyped_storage().data_ptr()
            if storage in seen:
                return seen[storage], name
            seen[storage] = name
    return None


def _trace_hint(message: str, dynamic_batch: bool) -> str:
    """What to add to torch.export's `message`: the likely cause in build(), and its fix."""
    if dynamic_batch and _SPECIALIZED_MARKER in message:
        return DYNAMIC_BATCH_HINT
    if _DOT_DATA_MARKER in message:
        return _DOT_DATA_HINT
    if _ONE_HOT_MARKER in message:
        return _ONE_HOT_HINT
    return _DATA_DEPENDENT_HINT if any(m in message for m in _DATA_DEPENDENT_MARKERS) else ""


def _record_frames_of(build: Callable) -> None:
    """Make torch.export keep build()'s frames in each node's stack trace (it keeps only those
    of `forward()` methods), so that an error names the line of build() an op came from."""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)  # private API
    if register is not None:
        register(build)


def _named_inputs(cls: type[_BuildRoot], names: list[str]) -> type[_BuildRoot]:
    """A subclass whose forward() declares one parameter per flat input, named after build()'s
    arguments (`x`, `xs_0`, ...), so that export and the Relax program use the user's names."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]

    def forward(self: _BuildRoot, *flat_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cls.forward(self, *flat_inputs)

    forward.__signature__ = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    return type(cls.__name__, (cls,), {"forward": forward})


def _io_recorder(module_io: dict[str, ModuleIO], path: str) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        # A module called twice keeps its first call's record, like OneFlow's repr.
        module_io.setdefault(path, ModuleIO(_leaves(args) + _leaves(kwargs), _leaves(output)))

    return hook
