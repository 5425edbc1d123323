"""`tvmgraph.nn.Graph`: OneFlow's `nn.Graph` for PyTorch modules, compiled with TVM Relax.

    >>> import torch, tvmgraph
    >>> class LinearGraph(tvmgraph.nn.Graph):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(3, 8, bias=False)
    ...     def build(self, x):
    ...         return self.linear(x)
    >>> g = LinearGraph()
    >>> g(torch.randn(4, 3)).shape     # first call: trace, lower, compile, run
    torch.Size([4, 8])
    >>> g(torch.randn(4, 3)).shape     # later calls with the same signature only run
    torch.Size([4, 8])
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import inspect
import itertools
import operator
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from . import entry
from .config import GraphConfig
from .debug import GraphLog
from .dynamic_batch import batch_specs
from .errors import (
    BackwardError,
    BuildNotImplementedError,
    ConfigError,
    DeviceMismatchError,
    DistributedError,
    ExecutionError,
    GraphArgumentError,
    GraphAttributeError,
    GraphInitError,
    NestedGraphError,
    OptimizerError,
    RecompileLimitError,
    StaleGraphError,
    StateDictError,
    TvmGraphError,
    UnsupportedOptionError,
    reason_of,
)
from .graph_module import ModuleProxy, unwrap
from .guards import StructureGuard, modules_of
from .graph_repr import graph_repr
from .amp import autocast_args, check_scaler
from .spec import NotATreeError, Signature, TensorSpec, TreeDef, flatten, tuple_of_tensors
from .stages import CompiledGraph, LoweredGraph, TracedGraph
from .trace import shared_storage, trace_build, tracing_graph
from .training.accumulation import check_micro_batches, first_micro_batch
from .training.data_parallel import DataParallel, Ranks
from .training.pipeline_parallel import PipelineEntry, compile_pipeline
from .training.optimizers import rule_for
from .training.plan import CLIP_MAX_NORM, CLIP_NORM_TYPE

if TYPE_CHECKING:
    from .profile import Profile

_instance_counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)

MSG_INIT_NOT_CALLED = """\
{cls}: super().__init__() was not called before {what}. Call it first in __init__:

    class {cls}(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()      # must come first
            self.model = model
"""

# Graph calls in one process run one at a time, any graph, any thread. Tracing puts hooks on
# the user's modules and torch.export patches torch's global state: another thread's call of an
# already compiled graph over the same modules saw the hooks, traced again at the same time,
# and failed inside torch.export ("Trying to pop empty mode stack"); concurrent first calls of
# one graph failed alike. Running a compiled program holds the GIL anyway, and its kernels use
# every core. Reentrant: build() may call another graph. A child forked while another thread
# held it (a DataLoader worker) gets a fresh one.
_ONE_CALL_AT_A_TIME = threading.RLock()


def _fresh_call_lock() -> None:
    global _ONE_CALL_AT_A_TIME
    _ONE_CALL_AT_A_TIME = threading.RLock()


os.register_at_fork(after_in_child=_fresh_call_lock)


class _GraphState:
    """Everything the Graph base class keeps; one attribute on the instance, so that user
    attributes and ours never collide."""

    __slots__ = ("name", "config", "log", "modules", "guard", "entries",
                 "last", "build_params", "arity", "optimizers", "step", "grad_scaler", "data_parallel", "pipeline",
                 "warned_of_input_grads")

    def __init__(self, name: str, cls: str):
        self.name = name
        self.config = GraphConfig()
        self.log = GraphLog(f"(GRAPH:{name}:{cls})")
        self.modules: dict[str, torch.nn.Module] = {}
        self.guard = StructureGuard(lambda: modules_of(self.modules))
        # Per signature, the programs compiled for the attribute values build() read (attribute_guard.py).
        self.entries: dict[Signature, list[CompiledGraph]] = {}
        self.last: CompiledGraph | None = None
        self.build_params: list[inspect.Parameter] | None = None
        self.arity: tuple[int, int | None] | None = None  # Graph._arity
        self.optimizers: list[tuple[torch.optim.Optimizer, Any]] = []  # (optimizer, lr_sch)
        self.step = 0  # training steps run, part of the graph's state_dict
        self.grad_scaler: torch.amp.GradScaler | None = None  # set_grad_scaler (tvmgraph/amp.py)
        self.data_parallel: DataParallel | None = None  # in a process group (training/data_parallel.py)
        self.pipeline: PipelineEntry | None = None  # the last pipelined entry (training/pipeline_parallel.py)
        self.warned_of_input_grads = False  # Graph._warn_of_arguments_requiring_grad, once


class Graph:
    """Base class for running `torch.nn.Module`s as a compiled static graph.

    Subclass it, call `super().__init__()` first in `__init__`, assign modules as attributes,
    describe the computation in `build()`, then call the instance like a module. The first call
    traces `build()` with torch.export, lowers it to TVM Relax and compiles it for the inputs'
    device; later calls with the same signature (shapes, dtypes, devices, argument structure,
    train/eval modes) run the compiled program. A new signature compiles a new entry.
    """

    def __init__(self) -> None:
        if "_tvmgraph" in self.__dict__:
            return
        cls = type(self).__name__
        object.__setattr__(self, "_tvmgraph", _GraphState(f"{cls}_{next(_instance_counters[cls])}", cls))

    # ---- attributes: modules are registered, everything else is a plain attribute ----

    def _state(self, what: str = "using the graph") -> _GraphState:
        try:
            return self.__dict__["_tvmgraph"]
        except KeyError:
            raise GraphInitError(MSG_INIT_NOT_CALLED.format(cls=type(self).__name__, what=what)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        st = self._state(f"assigning self.{name}")
        value = unwrap(value)  # another graph's `graph.model`: the module itself
        if isinstance(value, Graph):
            raise NestedGraphError(
                f"{st.name}: self.{name} is a Graph ({value.name}); a Graph cannot be nested in "
                f"another Graph. Assign its modules instead (self.{name} = other_graph.model)."
            )
        if isinstance(value, torch.nn.Module):
            st.modules.pop(name, None)
            st.modules[name] = value
            st.guard.invalidate()
            self.__dict__.pop(name, None)
            return
        if isinstance(value, torch.Tensor):
            kind = "Parameter" if isinstance(value, torch.nn.Parameter) else "Tensor"
            raise GraphAttributeError(
                f"{st.name}: self.{name} is a {kind}; a graph owns modules, not tensors. Put it in a "
                f"module (module.register_parameter / register_buffer) and assign the module, or pass "
                f"it to the graph call as an argument."
            )
        if name in st.modules:
            del st.modules[name]
            st.guard.invalidate()
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: that is where registered modules live. They come
        # wrapped, as in OneFlow: `.to(tvmgraph.nn.GraphModule)` is the module's options here.
        state = self.__dict__.get("_tvmgraph")
        if state is not None and name in state.modules:
            return ModuleProxy(state.modules[name], name, state.name, state.config)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        st = self._state()
        if name in st.modules:
            del st.modules[name]
            st.guard.invalidate()
        else:
            object.__delattr__(self, name)

    # ---- public surface ----

    @property
    def name(self) -> str:
        """Name auto-generated for this graph: `ClassName_N`, N counting instances of the class."""
        return self._state().name

    @property
    def training(self) -> bool:
        """True when the graph has an optimizer (it then runs a training step per call)."""
        return bool(self._state().optimizers)

    @property
    def config(self) -> GraphConfig:
        """The graph's `GraphConfig`. An option changed after a call compiles the program again
        for the new value at the next call (a guard, like an input shape)."""
        st = self._state()
        st.config.training = self.training
        return st.config

    def build(self, *args: Any) -> Any:
        """Describe the computation; must be overridden (like `nn.Module.forward`)."""
        raise BuildNotImplementedError(
            f"{self.name}: build() is not overridden in {type(self).__name__}. Define it:\n\n"
            f"    def build(self, x):\n        return self.model(x)\n"
        )

    def add_optimizer(self, optim: torch.optim.Optimizer, *, lr_sch: Any = None) -> None:
        """Add an optimizer (and optionally its lr scheduler): the graph then trains.

        Each call of a training graph runs `build()` (which must call `loss.backward()`),
        the gradients, gradient clipping if a param group sets `clip_grad_max_norm`, the
        optimizer step and `zero_grad`, all in one compiled program; then `lr_sch.step()`
        (any torch scheduler but ReduceLROnPlateau, which the user steps with their metric).
        Supported: torch.optim.SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam,
        Adadelta, Rprop, ASGD, with any param groups (docs/training.md).
        """
        st = self._state("add_optimizer()")
        if not isinstance(optim, torch.optim.Optimizer):
            raise OptimizerError(f"{st.name}: add_optimizer() takes a torch.optim.Optimizer, got "
                                 f"{type(optim).__name__}")
        if lr_sch is not None and getattr(lr_sch, "optimizer", None) is not optim:
            raise OptimizerError(f"{st.name}: lr_sch must be a scheduler of the optimizer passed with it "
                                 f"(torch.optim.lr_scheduler.X(optimizer, ...))")
        if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise OptimizerError(
                f"{st.name}: add_optimizer(lr_sch=ReduceLROnPlateau) cannot work: it steps on a metric (a "
                f"validation loss) the graph does not have. Leave it out of add_optimizer() and call "
                f"plateau.step(metric) yourself (e.g. after each epoch's validation); the graph reads the "
                f"reduced lr at its next call, without recompiling.")
        if any(o is optim for o, _ in st.optimizers):
            raise OptimizerError(f"{st.name}: this optimizer was already added")
        rule_for(optim, f"{st.name}: add_optimizer()")  # fail now, not at the first call
        st.optimizers.append((optim, lr_sch))

    def set_grad_scaler(self, grad_scaler: Any = None) -> None:
        """Scale the loss dynamically with `grad_scaler`, a `torch.amp.GradScaler` (or
        `tvmgraph.amp.GradScaler`, OneFlow's signature); None turns loss scaling off.

        Each training step then does what `scaler.scale(loss).backward(); scaler.unscale_(opt);
        scaler.step(opt); scaler.update()` does eagerly, inside the compiled program: a step
        with an inf/NaN gradient changes no parameter or optimizer state and backs the scale
        off (tvmgraph/training/loss_scale.py). The scaler's state stays in the scaler
        (`scaler.get_scale()`) and is part of `graph.state_dict()`.
        """
        self._state().grad_scaler = check_scaler(self.name, grad_scaler)

    def state_dict(self) -> dict[str, Any]:
        """The whole training state: module parameters and buffers, optimizer and lr scheduler
        states, and the graph's step counter. `torch.save` it to resume training later."""
        st = self._state()
        parallel = self._parallel(st)
        optimizers = [o for o, _ in st.optimizers]
        if parallel is not None and st.config.zero:  # each rank holds its share: gather the whole state
            optimizer_states = parallel.gather_optimizer_states(optimizers)
        elif st.pipeline is not None:  # each rank trains one stage: gather the whole model and state
            optimizer_states = st.pipeline.gather_state(optimizers)
        else:
            optimizer_states = [o.state_dict() for o in optimizers]
        return {
            "modules": {name: m.state_dict() for name, m in st.modules.items()},
            "optimizers": optimizer_states,
            "lr_schedulers": [s.state_dict() if s is not None else None for _, s in st.optimizers],
            "step": st.step,
            "grad_scaler": st.grad_scaler.state_dict() if st.grad_scaler is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (same graph structure and optimizers)."""
        st = self._state()
        keys = ("modules", "optimizers", "lr_schedulers", "step")
        if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise StateDictError(f"{st.name}: load_state_dict(state_dict) takes what {st.name}.state_dict() "
                                 f"returned (keys {', '.join(keys)}), got {got}. For one module's "
                                 f"weights use module.load_state_dict(...) instead.")
        missing = set(st.modules) - set(state_dict["modules"])
        if missing or len(state_dict["optimizers"]) != len(st.optimizers):
            raise StateDictError(f"{st.name}: state_dict does not fit this graph (modules missing: "
                                 f"{sorted(missing)}; optimizers: {len(state_dict['optimizers'])} saved, "
                                 f"{len(st.optimizers)} in the graph); load it into a graph built with the "
                                 f"same modules and add_optimizer() calls.")
        for name, module in st.modules.items():
            module.load_state_dict(state_dict["modules"][name])
        for (optimizer, scheduler), opt_state, sch_state in zip(
                st.optimizers, state_dict["optimizers"], state_dict["lr_schedulers"]):
            optimizer.load_state_dict(opt_state)
            if scheduler is not None and sch_state is not None:
                scheduler.load_state_dict(sch_state)
        parallel = self._parallel(st)
        if parallel is not None and st.config.zero:
            parallel.keep_owned_state([o for o, _ in st.optimizers])
        st.step = int(state_dict["step"])
        if st.grad_scaler is not None and state_dict.get("grad_scaler"):
            st.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    @property
    def step(self) -> int:
        """Number of training steps this graph has run (restored by load_state_dict)."""
        return self._state().step

    def debug(self, v_level: int = 0, ranks: int | list[int] | None = None, mode: bool = True) -> None:
        """Open (or close, `mode=False`) debug output of this graph, at verbosity `v_level` 0..3.

        `ranks` picks which torch.distributed ranks print (default 0; -1 for all).
        """
        self._state().log.configure(v_level, ranks, mode)

    def profile(self, *args: Any, repeat: int = 5) -> Profile:
        """Run `self(*args)` with every kernel timed; `print()` the result to see where the time
        goes (each kernel's time, share of the call, FLOPs and share of the machine's limit).

        A training graph runs real steps, then gets its state back: profiling changes nothing.
        """
        from .profile import profile_graph

        return profile_graph(self, args, repeat)

    def refresh_weights(self) -> None:
        """Recompute what the graph keeps from its weights at the next call
        (`config.enable_frozen_weights()`): after a
        write that torch's version counter does not see (`w.data.copy_(...)`, a numpy view of
        a weight, an optimizer with `fused=True`). Any other change is seen on its own."""
        for compiled in (c for entries in self._state().entries.values() for c in entries):
            if compiled.packed_weights is not None:
                compiled.packed_weights.refresh()

    def named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """Every registered module and its submodules, with their paths in the graph."""
        return modules_of(self._state().modules)

    @property
    def lowered(self) -> LoweredGraph | None:
        """The Relax stage of the most recently run entry (`graph.lowered.as_text()`)."""
        last = self._state().last
        return last.lowered if last is not None else None

    @property
    def compiled(self) -> CompiledGraph | None:
        """The compiled stage of the most recently run entry."""
        return self._state().last

    @property
    def num_compiled(self) -> int:
        """How many programs have been compiled so far (signatures and attribute values)."""
        return sum(map(len, self._state().entries.values()))

    def __repr__(self) -> str:
        st = self._state()
        return graph_repr(self, st.last.traced if st.last else None)

    def __reduce_ex__(self, protocol: int) -> Any:
        # A graph holds compiled native code and live modules; neither pickles.
        from .errors import GraphPickleError

        raise GraphPickleError(
            f"{self._state().name}: a Graph cannot be pickled (pickle, torch.save, copy.deepcopy). Save the "
            f"compiled graph with tvmgraph.save(graph, path) and run it with tvmgraph.load(path), or save "
            f"its weights with tvmgraph.save(graph.state_dict(), path)."
        )

    # ---- calling ----

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph: compile on the first call of each signature, then execute."""
        with _ONE_CALL_AT_A_TIME:
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        st = self._state("calling the graph")
        if st.optimizers and not torch.is_grad_enabled():
            # As eager's loss.backward() fails there. Before, a first call so failed to find the
            # parameters (OptimizerError) and a compiled training graph trained, silently.
            raise BackwardError(
                f"{st.name}: the graph trains (add_optimizer) and was called under torch.no_grad() or "
                f"torch.inference_mode(), where build()'s loss.backward() fails in eager. Call it outside, "
                f"and evaluate with a graph that has no optimizer.")
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            self._refuse_ambient_autocast(st, args, kwargs)
        entry = None if kwargs else self._last_entry_again(st, args)
        if entry is not None:
            flat, args_tree = list(args), entry.traced.signature.args
        else:
            args = self._bind_keywords(st, args, kwargs)
            self._check_callable(st, args, {})
            flat, args_tree = self._flatten_args(st, args)
            entry = self._entry_for(st, args_tree, flat)
        if isinstance(entry, CompiledGraph):  # (a pipeline stage's entry has its own inputs)
            if any(m.kind == "user" for m in entry.signature.mutations):
                self._refuse_shared_arguments(st, args_tree, flat)
            if (entry.training is not None and not st.warned_of_input_grads and torch.is_grad_enabled()
                    and any(t.requires_grad for t in flat)):
                self._warn_of_arguments_requiring_grad(st, args_tree, flat)
        st.last = entry
        try:
            outputs = self._run(st, entry, flat)
        except StaleGraphError:
            # A tensor changed shape or dtype with no registration for the guard to see
            # (`model.double()`, `p.data = ...`); the program refused it at its entry, before
            # touching anything. Look at the model again: if it moved, compile for it and rerun.
            st.guard.invalidate()
            retry = self._entry_for(st, args_tree, flat)
            if retry is entry:
                raise
            entry = st.last = retry
            outputs = self._run(st, entry, flat)
        if entry.training is not None:
            st.step += 1
            for _, scheduler in st.optimizers:
                if scheduler is not None:
                    scheduler.step()
        tree = entry.traced.out_tree
        try:
            return tree.unflatten(outputs)
        except ValueError:
            if tree.num_leaves == 0:  # build() returned no tensor: its program's 0-d zero is dropped
                return tree.unflatten(())
            raise

    def _refuse_ambient_autocast(self, st: _GraphState, args: tuple, kwargs: dict) -> None:
        """A call inside `torch.autocast` on the graph's device: its program's precision is the
        graph's own config, compiled once (the first call's autocast used to stay baked in, and
        a later one was ignored). Allowed when the graph's AMP is on with the same dtype."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else entry.module_device(st.modules)
        if not torch.is_autocast_enabled(device.type):
            return
        dtype = torch.get_autocast_dtype(device.type)
        config = st.config.snapshot(None)
        if config.amp and autocast_args(device, config.amp, config.amp_dtype)[1] == dtype:
            return
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(
            f"{st.name}: called inside torch.autocast('{device.type}', dtype=torch.{name}); a graph does not "
            f"follow an autocast region around its call (its program is compiled once, and its precision is "
            f"its config). Turn AMP on in the graph, graph.config.enable_amp(True, dtype=torch.{name}), or "
            f"call it outside the region (or inside torch.autocast('{device.type}', enabled=False)).")

    def _last_entry_again(self, st: _GraphState, args: tuple) -> CompiledGraph | None:
        """The last call's entry when this call's signature equals its own, checked field by
        field without building a Signature; None sends the call the long way (`_entry_for`),
        which decides every case this one leaves to it.

        Why: after kernels that stream more than L2 holds, the interpreter's code and objects
        come back from L3, and building and comparing a Signature cost 35 us of a 210 us call
        of the batch-1 MLP on a Xeon. Every field of `Signature` is checked here, in its order
        (tests/unit/test_repeat_call.py fails when a field is added).
        """
        last = st.last
        if last is None or tracing_graph() is not None:
            return None
        sig = last.traced.signature
        options = sig.options
        if sig.args is not tuple_of_tensors(len(args)) or options.dynamic_batch or options.data_parallel > 1:
            return None
        for t, spec in zip(args, sig.leaves):
            if (not isinstance(t, torch.Tensor) or t.dtype is not spec.dtype or t.shape != spec.shape
                    or t.device != spec.device):
                return None
        if st.guard.current(identities=bool(st.optimizers)) != sig.structure:
            return None
        if tuple(map(_TRAINING, st.guard.modules)) != sig.module_modes:
            return None
        if st.optimizers or st.grad_scaler is not None or sig.optimizers:
            if (st.optimizers and self._parallel(st) is not None) or _training_guards(st) != sig.optimizers:
                return None
        if st.config.snapshot(None) is not options:  # a changed option makes a new snapshot
            return None
        if torch.get_default_dtype() is not sig.default_dtype:
            return None
        return last if last.traced.result.attributes.holds() else None

    def _entry_for(self, st: _GraphState, args_tree: TreeDef, flat: list[torch.Tensor]) -> CompiledGraph:
        """The compiled entry whose guards this call meets, compiled now if there is none."""
        signature = self._signature(st, args_tree, flat)
        parallel = st.data_parallel if signature.options.data_parallel > 1 else None
        if parallel is not None:
            parallel.before_call(signature, lambda: self._program_parts(st, signature), st.modules)
        last = st.last  # most calls repeat the last one: an equality test, not a hash of the signature
        if last is not None and last.traced.signature == signature and last.traced.result.attributes.holds():
            entry = last
        else:
            variants = st.entries.get(signature, ())
            entry = _holding(variants)
        if entry is None:
            # About to compile: look at the model afresh first. `model.double()` or `p.data = ...`
            # change tensors with no registration for the guard to see; filed under the stale
            # structure, the new entry would miss on the next call and be compiled again.
            st.guard.invalidate()
            fresh = self._signature(st, args_tree, flat)
            if fresh != signature:
                signature, variants = fresh, st.entries.get(fresh, ())
                entry = _holding(variants)
        if entry is None:
            entry = self._compile(st, signature, args_tree, flat, variants[-1] if variants else None)
        elif signature.options.dynamic_batch and signature.options.gradient_accumulation_steps > 1:
            check_micro_batches(st.name, lambda: self._leaf_paths(st, args_tree), flat,
                                signature.options.gradient_accumulation_steps)
        entry.data_parallel = parallel
        return entry

    def _warn_of_arguments_requiring_grad(self, st: _GraphState, args_tree: TreeDef, flat: list[torch.Tensor]) -> None:
        """A UserWarning (once per graph) for an argument that requires grad in a training call:
        eager's backward() fills its .grad (and flows into what made it); the graph's computes
        the parameters' gradients only, and the argument's stayed None, silently. Not an error:
        the parameters' update is right, and code that drops those gradients anyway (a GAN's
        discriminator step given the generator's output) trains as in eager."""
        st.warned_of_input_grads = True
        path = self._leaf_paths(st, args_tree)[next(i for i, t in enumerate(flat) if t.requires_grad)]
        warnings.warn(
            f"{st.name}: argument '{path}' requires grad, and the graph's backward() computes the gradients of its "
            f"parameters only: '{path}'.grad (and the gradients of what produced it) stay empty. Pass "
            f"`{path}.detach()` to say so, or register the module that produced it in the graph (or make "
            f"'{path}' an nn.Parameter of a registered module to train it).", UserWarning, stacklevel=4)

    def _refuse_shared_arguments(self, st: _GraphState, args_tree: TreeDef, flat: list[torch.Tensor]) -> None:
        """GraphArgumentError when two arguments share memory and build() updates one in place:
        the program reads them as separate tensors, where eager's other one sees the update (a
        program compiled for separate tensors and called with `g(x, x)` was 1.0 off eager). A
        first call so fails to trace (trace.aliasing_hint); this checks the later ones."""
        pair = shared_storage((str(i), t) for i, t in enumerate(flat))
        if pair is not None:
            paths = self._leaf_paths(st, args_tree)
            first, second = (paths[int(i)] for i in pair)
            raise GraphArgumentError(
                f"{st.name}: arguments '{first}' and '{second}' share memory (one tensor, or views of one), and "
                f"build() updates an argument in place, which the compiled program reads as separate tensors: "
                f"pass a copy, `{second}.clone()`.")

    def _parallel(self, st: _GraphState) -> DataParallel | None:
        """The graph's data-parallel state when it trains in a process group of 2 or more ranks."""
        if not st.optimizers:
            return None
        if st.config.pipeline_stages:  # each rank runs one stage (training/pipeline_parallel.py)
            if st.config.zero:
                raise UnsupportedOptionError(f"{st.name}: enable_zero with pipeline stages (set_stage) is not "
                                             f"implemented: each rank already keeps only its stage's optimizer "
                                             f"state. Turn enable_zero off.")
            return None
        ranks = Ranks.current() if st.config.data_parallel else None
        if ranks is None:
            if st.config.zero:
                why = ("enable_data_parallel(False) is set" if st.config.data_parallel
                       is False else "torch.distributed has no process group of 2 or more ranks")
                raise DistributedError(f"{st.name}: enable_zero(True) shards optimizer state over ranks, but {why}. "
                                       f"Initialize the process group first (torchrun, "
                                       f"torch.distributed.init_process_group), or enable_zero(False).")
            return None
        if st.data_parallel is None or st.data_parallel.ranks != ranks:
            st.data_parallel = DataParallel(st.name, ranks)
        return st.data_parallel

    def _program_parts(self, st: _GraphState, signature: Signature) -> tuple[list[object], str]:
        """What every rank's program must agree on (no object ids), and a line saying it."""
        for path, module in self.named_modules():
            if isinstance(module, torch.nn.SyncBatchNorm):
                raise UnsupportedOptionError(
                    f"{st.name}: '{path}' is a SyncBatchNorm; tvmgraph's data-parallel graphs keep batch-norm "
                    f"statistics per rank (as DDP with BatchNorm2d does) and cannot all-gather them inside the "
                    f"compiled step. Use nn.BatchNorm*d (torch.nn.SyncBatchNorm.revert is not in torch; rebuild the "
                    f"model with BatchNorm), or enable_data_parallel(False).")
        params = [(path, tuple(p.shape), str(p.dtype), p.requires_grad) for path, p in self.named_parameters()]
        optimizers = [(type(o).__name__, [rule_for(o, "").structure(g) for g in o.param_groups]) for o, _ in st.optimizers]
        options = dataclasses.replace(signature.options, zero_rank=None)
        inputs = ", ".join(leaf.describe() for leaf in signature.leaves)
        text = f"inputs ({inputs}), {len(params)} parameters, optimizers {[o for o, _ in optimizers]}"
        return [signature.args, signature.leaves, signature.module_modes, params, optimizers, options], text

    @staticmethod
    def _run(st: _GraphState, entry: CompiledGraph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return entry.run(inputs)[0]
        except TvmGraphError:
            raise
        except Exception as e:  # the VM raises plain TVM errors
            raise ExecutionError(f"{st.name}: the compiled program failed while running: "
                                 f"{type(e).__name__}: {reason_of(e)}") from e

    def trace(self, *args: Any) -> TracedGraph:
        """Stage 1 alone: trace `build(*args)` without lowering or compiling it."""
        st = self._state("tracing the graph")
        self._check_callable(st, args, {})
        flat, args_tree = self._flatten_args(st, args)
        return self._trace(st, self._signature(st, args_tree, flat), args_tree, flat)

    def _check_callable(self, st: _GraphState, args: tuple, kwargs: dict) -> None:
        outer = tracing_graph()
        if outer is not None:
            raise NestedGraphError(f"{st.name} was called inside build() of {outer}; graphs cannot be nested. "
                                   f"Call the modules of {st.name} directly instead.")
        if type(self).build is Graph.build:
            self.build()  # raises BuildNotImplementedError
        if kwargs:
            names = ", ".join(f"{k}=" for k in kwargs)
            raise GraphArgumentError(
                f"{st.name}: keyword argument(s) {names} given; build() takes positional arguments only "
                f"(as in OneFlow). Call {st.name.rsplit('_', 1)[0]}(...) with the values in the order of "
                f"build({', '.join(p.name for p in self._build_params(st))})."
            )
        least, most = self._arity(st)
        if least <= len(args) and (most is None or len(args) <= most):
            return
        expected = f"at least {least}" if most is None else f"{least}" if least == most else f"{least} to {most}"
        names = ", ".join(p.name for p in self._build_params(st) if p.kind is not p.VAR_POSITIONAL)
        raise GraphArgumentError(
            f"{st.name}: build({names}) takes {expected} argument(s) but {len(args)} were given; "
            f"call the graph with exactly the arguments of build()."
        )

    def _bind_keywords(self, st: _GraphState, args: tuple, kwargs: dict) -> tuple:
        """`args` with the keyword arguments put in their places among build()'s parameters (a
        parameter skipped before one given by keyword takes its default)."""
        if not kwargs:
            return args
        params = self._build_params(st)
        by_keyword = [p for p in params if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
        if by_keyword:
            names = ", ".join(f"{k}=" for k in kwargs)
            raise GraphArgumentError(
                f"{st.name}: keyword argument(s) {names} given, and build() has keyword-only parameters "
                f"({', '.join(p.name for p in by_keyword)}); a graph passes its arguments to build() by "
                f"position. Make them ordinary parameters of build().")
        try:
            bound = inspect.Signature(params).bind(*args, **kwargs)
        except TypeError as e:
            raise GraphArgumentError(
                f"{st.name}: {e} (build({', '.join(p.name for p in params)}))") from None
        given = [i for i, p in enumerate(params) if p.name in bound.arguments]
        positional = []
        for p in params[:max(given) + 1]:
            if p.kind is p.VAR_POSITIONAL:
                positional.extend(bound.arguments.get(p.name, ()))
            else:
                positional.append(bound.arguments[p.name] if p.name in bound.arguments else p.default)
        return tuple(positional)

    def _build_params(self, st: _GraphState) -> list[inspect.Parameter]:
        if st.build_params is None:
            st.build_params = list(inspect.signature(self.build).parameters.values())
        return st.build_params

    def _arity(self, st: _GraphState) -> tuple[int, int | None]:
        """How many positional arguments build() takes: (at least, at most or None)."""
        if st.arity is None:
            params = self._build_params(st)
            fixed = [p for p in params if p.kind is not p.VAR_POSITIONAL]
            least = sum(p.default is p.empty for p in fixed)
            st.arity = (least, None if len(fixed) < len(params) else len(fixed))
        return st.arity

    def _arg_names(self, st: _GraphState, count: int) -> list[str]:
        names = [p.name for p in self._build_params(st) if p.kind is not p.VAR_POSITIONAL]
        return [names[i] if i < len(names) else f"args[{i}]" for i in range(count)]

    def _leaf_paths(self, st: _GraphState, args_tree: TreeDef) -> list[str]:
        """Paths of the flat inputs, for messages: `x` for a tensor argument, `xs.0` inside a list."""
        names = self._arg_names(st, len(args_tree.children))
        return [p for n, sub in zip(names, args_tree.children) for p in sub.leaf_paths(n)]

    def _leaf_names(self, st: _GraphState, args_tree: TreeDef) -> list[str]:
        """Identifiers for the flat inputs: `x` for a tensor argument, `xs_0` inside a list."""
        return [p.replace(".", "_").replace("[", "_").replace("]", "") for p in self._leaf_paths(st, args_tree)]

    def _flatten_args(self, st: _GraphState, args: tuple) -> tuple[list[torch.Tensor], TreeDef]:
        try:
            flat, tree = flatten(args)
        except NotATreeError as e:
            index = int(e.path[1:].split("]")[0])
            name = self._arg_names(st, len(args))[index]
            inner = e.path[len(f"[{index}]"):]
            raise GraphArgumentError(
                f"{st.name}: argument '{name}'{inner} is {type(e.value).__name__}; build() arguments must "
                f"be a torch.Tensor, a list, tuple or dict (string keys) of Tensors, or None. Pass "
                f"torch.as_tensor(value), "
                f"or keep Python values as graph attributes set in __init__."
            ) from None
        devices = {t.device for t in flat}
        if len(devices) > 1:
            where = ", ".join(f"'{p}' on {t.device}" for p, t in zip(self._leaf_paths(st, tree), flat))
            raise DeviceMismatchError(f"{st.name}: inputs are on different devices ({where}); "
                                      f"move them to one device with .to(device).")
        return flat, tree

    def _signature(self, st: _GraphState, args_tree: TreeDef, flat: list[torch.Tensor]) -> Signature:
        """The guards of this call: a compiled entry runs only for an equal signature."""
        structure = st.guard.current(identities=bool(st.optimizers))
        modes = tuple(map(_TRAINING, st.guard.modules))
        training = _training_guards(st)
        parallel = self._parallel(st)
        ranks = (parallel.ranks.rank, parallel.ranks.world) if parallel is not None else None
        options = st.config.snapshot(ranks)
        if options.activation_checkpointing and not st.optimizers:
            # Nothing is recomputed without a backward pass: the inference program stays the same.
            options = dataclasses.replace(options, activation_checkpointing=())
        if options.dynamic_batch:
            leaves = batch_specs(st.name, flat, lambda: self._leaf_paths(st, args_tree))
        else:
            leaves = tuple(TensorSpec.of(t) for t in flat)
        return Signature(args_tree, leaves, modes, training, structure, options, torch.get_default_dtype())

    def _trace(self, st: _GraphState, signature: Signature, args_tree: TreeDef,
               flat: list[torch.Tensor]) -> TracedGraph:
        options = signature.options
        device = flat[0].device if flat else entry.module_device(st.modules)
        with st.log.stage("tracing build()"):
            result = trace_build(st.name, self.build, st.modules, args_tree, flat, self._leaf_names(st, args_tree),
                                 autocast_args(device, options.amp, options.amp_dtype), options.dynamic_batch)
        traced = TracedGraph(st.name, signature, args_tree, result)
        if st.log.on(1):
            for path, io in result.module_io.items():
                ins = ", ".join(s.describe() for s in io.inputs)
                outs = ", ".join(s.describe() for s in io.outputs)
                st.log.info(1, f"(MODULE:{path}) inputs ({ins}) -> outputs ({outs})")
        return traced

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Every parameter of the registered modules, with its path in the graph."""
        return [(f"{name}.{path}", p) for name, m in self._state().modules.items()
                for path, p in m.named_parameters()]

    def _compile(self, st: _GraphState, signature: Signature, args_tree: TreeDef,
                 flat: list[torch.Tensor], stale: CompiledGraph | None = None) -> CompiledGraph:
        """Trace and compile for this call; `stale`: the entry of this signature whose
        attribute values no longer hold."""
        steps = signature.options.gradient_accumulation_steps
        if steps > 1:  # the program is compiled for one micro-batch (training/accumulation.py)
            flat = first_micro_batch(st.name, self._leaf_paths(st, args_tree), flat, steps, bool(st.optimizers))
        if st.last is not None:
            old = st.last.traced.signature
            arg_names = self._arg_names(st, len(args_tree.children))
            diffs = signature.differences(old, arg_names, st.guard.paths)
            if stale is not None:
                diffs += stale.traced.result.attributes.changes()
            reason = "; ".join(diffs or ["(a signature seen before was changed back)"])
            limit = st.config.recompile_limit
            if self.num_compiled >= limit:
                raise RecompileLimitError(
                    f"{st.name}: this call would compile program #{self.num_compiled + 1}, past the graph's "
                    f"recompile limit of {limit}. What changed this time: {reason}. A shape that changes "
                    f"every call is the usual cause: keep input shapes fixed (pad the last batch, or "
                    f"DataLoader(drop_last=True)), or compile one program for every batch size: "
                    f"graph.config.enable_dynamic_batch(). If the "
                    f"programs are all wanted, raise the limit: graph.config.set_recompile_limit(n)."
                )
            st.log.note(f"recompiling (program #{self.num_compiled + 1}): guard failed: {reason}")
        traced = self._trace(st, signature, args_tree, flat)
        options = signature.options
        plan = entry.training_plan(st.name, st.optimizers, traced, self.named_parameters, options,
                                   _enabled(st.grad_scaler), self.named_modules)
        device = flat[0].device if flat else entry.module_device(st.modules)
        if options.pipeline_stages:
            compiled = st.pipeline = compile_pipeline(type(self).__name__, traced, flat, st.optimizers, st.modules,
                                                      options, device, st.log, plan)
        else:
            compiled = entry.compile_or_load(type(self).__name__, traced, plan, device, options, st.modules,
                                             st.log, self.build)
        st.entries.setdefault(signature, []).append(compiled)
        st.guard.current(bool(st.optimizers))  # tracing registers modules: absorb that epoch change now
        return compiled


_TRAINING = operator.attrgetter("training")


def _holding(entries: collections.abc.Sequence[CompiledGraph]) -> CompiledGraph | None:
    """The first of a signature's entries whose attribute values (attribute_guard.py) hold."""
    return next((e for e in entries if e.traced.result.attributes.holds()), None)


def _training_guards(st: _GraphState) -> tuple:
    """What about the optimizers and the grad scaler shapes a training program (empty for
    inference)."""
    training = tuple(_optimizer_structure(o) for o, _ in st.optimizers)
    scaler = _enabled(st.grad_scaler)
    if scaler is not None:  # the program reads this scaler's tensors
        training += (("grad_scaler", id(scaler)),)
    return training


def _enabled(scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
    """The scaler if it scales (a disabled GradScaler is a no-op in eager torch too)."""
    return scaler if scaler is not None and scaler.is_enabled() else None
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _optimizer_structure(optimizer: torch.optim.Optimizer) -> tuple:
    """What about an optimizer changes the compiled program (cheap enough for every call)."""
    rule = rule_for(optimizer, "")
    return tuple((rule.structure(g), tuple(map(id, g["params"])), tuple(map(_REQUIRES_GRAD, g["params"])),
                  g.get(CLIP_MAX_NORM), g.get(CLIP_NORM_TYPE))
                 for g in optimizer.param_groups)
